"""`flywheel pretrain --base PATH --corpus DIR`: continued pretraining of an imported model, FP4-aware
with router replay, resumable, published as a delta against v0 where the learner then starts."""

from __future__ import annotations

import io

import pytest
import torch
from rich.console import Console

from feedback.core.errors import UserError
from learner import store as S
from learner.train.pretrain import continue_pretraining
from learner.train.pretrain_settings import PretrainSettings
from tests.learner.family_models import make_family_model
from tests.learner.train.learn_support import ListProducer, make_corpus


def settings(tmp_path, folder, **pretrain) -> PretrainSettings:
    return PretrainSettings(
        data_dir=tmp_path / "data",
        model={"base": str(folder)},
        pretrain={
            "corpus": str(make_corpus(tmp_path / "corpus")),
            "seq_len": 64,
            "batch_size": 2,
            "steps": 4,
            "warmup_steps": 1,
            "eval_every": 2,
            "eval_windows": 2,
            "final_eval_windows": 4,
            "heldout_fraction": 0.25,
            "continue_lr": 1e-3,
            "checkpoint_minutes": 0,  # a checkpoint after every step: an interruption resumes where it stood
            **pretrain,
        },
    )


class Interrupt(Exception):
    pass


def test_continued_pretraining_resumes_and_publishes_a_delta_the_learner_starts_from(tmp_path):
    folder = make_family_model(tmp_path / "model", "qwen2_moe")
    s = settings(tmp_path, folder)
    out = io.StringIO()

    def stop_at_2(step, metrics):
        if step == 2:
            raise Interrupt

    with pytest.raises(Interrupt):
        continue_pretraining(s, Console(file=out), producer=ListProducer(), on_step=stop_at_2)
    store = S.open_store(S.default_store_uri(s))
    assert store.versions() == [0]  # imported, nothing published yet

    producer = ListProducer()
    record = continue_pretraining(s, Console(file=out), producer=producer)
    assert "resuming from step 1" in out.getvalue()  # the checkpoint saved before the interrupted step
    assert record["step"] == 4 and record["version"] == 1
    m = store.manifest(1)
    assert m["kind"] == "delta" and m["parent"] == 0 and store.base()["start_version"] == 1
    assert [msg.version for _, msg in producer.sent] == [1]
    kinds = {n: t["kind"] for n, t in m["tensors"].items()}
    assert {n for n, k in kinds.items() if k == "fp4"} == {n for n in kinds if ".experts." in n}  # FP4-aware
    v0, v1 = S.to_hf_tensors(store.materialize(0)), S.to_hf_tensors(store.materialize(1))
    assert any(not torch.equal(v0[n], v1[n]) for n in v0)
    assert record["metrics"]["heldout_loss"] < record["metrics"]["base_heldout_loss"]  # it learned the corpus

    again = continue_pretraining(s, Console(file=out), producer=ListProducer())
    assert again["version"] == 1 and store.versions() == [0, 1] and "already continued" in out.getvalue()

    from learner.train.learn import Learner
    from learner.train.learn_settings import LearnSettings

    learner = Learner(LearnSettings(**s.model_dump()), producer=ListProducer())
    learner.start()
    assert learner.state.version == learner.state.last_good == 1  # the learner starts from the continued model
    mine = S.to_hf_tensors(S.pack_checkpoint(learner.model.state_dict(), "nvfp4", learner.fp4_targets))
    assert all(torch.equal(mine[n], v1[n]) for n in v1)


def test_it_refuses_once_the_learner_has_published(tmp_path):
    folder = make_family_model(tmp_path / "model", "qwen3")
    s = settings(tmp_path, folder, steps=1)
    continue_pretraining(s, Console(file=io.StringIO()), producer=ListProducer())
    store = S.open_store(S.default_store_uri(s))
    store.publish(store.materialize(1), parent=1)  # as the learner would
    with pytest.raises(UserError, match="the learner already published v2 after the base's v1"):
        continue_pretraining(s.model_copy(deep=True), Console(file=io.StringIO()), producer=ListProducer())
