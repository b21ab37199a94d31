"""The learner on an imported base (model.base): it imports the folder as v0 on its first start,
starts exactly on v0's served weights, trains on its tokens and publishes deltas against it."""

from __future__ import annotations

import pytest
import torch

from learner import store as S
from learner.base_settings import ModelSection
from learner.train.learn import Learner, model_from_packed
from tests.learner.family_models import make_family_model
from tests.learner.train.learn_support import ListProducer, make_corpus, tiny_learn_settings, write_samples
from tests.learner.train.test_learn import texts


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3"])
def test_the_learner_imports_trains_and_publishes_a_delta(tmp_path, family):
    folder = make_family_model(tmp_path / "model", family, chat_eos=True)
    s = tiny_learn_settings(tmp_path, make_corpus(tmp_path / "corpus"), tmp_path / "cache", lr=1e-2)
    s = s.model_copy(update={"model": ModelSection(base=folder)})
    lr = Learner(s, producer=ListProducer())
    lr.start()
    assert lr.store.versions() == [0] and lr.store.base()["kind"] == "imported"
    im_end, endoftext = (lr.tok.token_to_id(t) for t in ("<|im_end|>", "<|endoftext|>"))
    assert lr.format.eos_ids == (im_end, endoftext) and lr.format.fim.name == "qwen" and endoftext >= 600
    v0 = model_from_packed(lr.store.materialize(0), lr.args)
    assert all(torch.equal(v, v0.state_dict()[k]) for k, v in lr.model.state_dict().items())  # on v0 exactly
    assert (lr.fmt is not None) == (family == "qwen2_moe")  # an MoE's experts train in FP4; a dense model has none

    write_samples(lr.engine, v0, lr.tok, texts(8))
    assert lr.poll() == 8
    m = lr.update()
    assert m is not None and m["mismatch_kl_no_replay"] < 0.05, m  # behaviour: v0's served weights
    assert lr.update() is not None
    trained = S.to_hf_tensors(S.pack_checkpoint(lr.model.state_dict(), lr.fmt or "nvfp4", lr.fp4_targets))
    info = lr.publish()  # stored whatever the gate says (a blocked version is kept for inspection)
    assert info["version"] == 1 and info["kind"] == "delta" and info["size_bytes"] < info["full_size_bytes"]
    served = S.to_hf_tensors(lr.store.materialize(1))
    assert served.keys() == trained.keys() and all(torch.equal(served[k], trained[k]) for k in served)
    assert any(not torch.equal(served[k], v) for k, v in S.to_hf_tensors(lr.store.materialize(0)).items())

    again = Learner(s, producer=ListProducer())
    again.start()  # resumes; imports nothing again
    assert again.state.version == 1 and again.store.versions() == [0, 1] and again._producer.sent == []


def test_another_model_base_than_the_store_holds_is_refused(tmp_path):
    from feedback.core.errors import UserError

    a = make_family_model(tmp_path / "a", "qwen3")
    b = make_family_model(tmp_path / "b", "qwen3", seed=1)
    s = tiny_learn_settings(tmp_path, make_corpus(tmp_path / "corpus"), tmp_path / "cache")
    Learner(s.model_copy(update={"model": ModelSection(base=a)}), producer=ListProducer()).start()
    with pytest.raises(UserError, match="use a fresh data_dir for another model"):
        Learner(s.model_copy(update={"model": ModelSection(base=b)}), producer=ListProducer()).start()
