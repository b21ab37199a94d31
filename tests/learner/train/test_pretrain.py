import io
import json
import os
import shutil
import signal

import pytest
import torch
from rich.console import Console
from safetensors.torch import load_file

from feedback.core.errors import UserError
from learner.corpus import default_corpus_dir
from learner.export import load_hf, load_packed_fp4, verify_packed_roundtrip
from learner.train.pretrain import (
    CHECKPOINT,
    Curriculum,
    bigram_baseline,
    ensure_base_model,
    lm_loss,
    load_training_corpus,
    lr_at,
    quality_problem,
    run_folder,
    train,
)
from learner.train.pretrain_settings import PretrainSection, PretrainSettings
from tests.helpers import flywheel
from tests.learner.train.learn_support import tiny_pretrain

FILES = ["textwrap.py", "shlex.py", "string.py", "fnmatch.py", "glob.py", "bisect.py", "heapq.py", "colorsys.py"]


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    for name in FILES:
        shutil.copy(default_corpus_dir() / name, root / name)
    return root


def tiny_settings(cache, corpus, **kw) -> PretrainSettings:
    cfg = tiny_pretrain(corpus, seq_len=32, steps=6, eval_every=3, heldout_fraction=0.2)
    return PretrainSettings(cache_dir=cache, pretrain=cfg | kw)


def quiet() -> Console:
    return Console(file=io.StringIO(), width=200)


def test_tiny_pretrain_exports_a_loadable_model_and_a_packed_artifact(tmp_path, corpus_dir):
    s = tiny_settings(tmp_path, corpus_dir)
    hf = ensure_base_model(s, quiet())
    model, args = load_hf(hf)
    assert args.max_seq_len == 32 and args.n_experts == 4
    assert torch.isfinite(model(torch.tensor([[0, 7, 9, 11]]))).all()

    run = hf.parent
    assert verify_packed_roundtrip(run / "fp4", hf) == args.n_layers * args.n_experts * 3
    manifest = json.loads((run / "fp4" / "manifest.json").read_text())
    assert manifest["fp4_format"] == "nvfp4" and 4.5 <= manifest["fp4_bits_per_weight"] < 4.6
    dense, exported = load_packed_fp4(run / "fp4"), load_file(str(hf / "model.safetensors"))
    assert dense.keys() == exported.keys()
    assert all(torch.equal(dense[k], exported[k]) for k in dense)  # packed and HF folder agree, every tensor

    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["steps"] == 6 and metrics["fp4_tensors_roundtrip_checked"] > 0
    assert {"heldout_loss", "heldout_accuracy", "bigram_accuracy"} <= metrics.keys()

    out = quiet()
    assert ensure_base_model(s, out) == hf  # cached: no training
    assert "already trained" in out.file.getvalue()


def test_interrupted_run_resumes_to_the_same_weights(tmp_path, corpus_dir):
    straight = tiny_settings(tmp_path / "a", corpus_dir)
    ensure_base_model(straight, quiet())

    s = tiny_settings(tmp_path / "b", corpus_dir)
    cfg = s.pretrain
    corpus = load_training_corpus(cfg)
    folder = run_folder(s, cfg, corpus.fingerprint)

    def ctrl_c_at_step_3(step, metrics):
        if step == 3:
            os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(KeyboardInterrupt):
        train(corpus, cfg, folder, quiet(), on_step=ctrl_c_at_step_3)
    saved = torch.load(folder / CHECKPOINT, weights_only=False)
    assert saved["step"] == 3 and not (folder / "COMPLETE").exists()

    out = quiet()
    ensure_base_model(s, out)
    assert "resuming from step 3" in out.file.getvalue()
    a = torch.load(run_folder(straight, straight.pretrain, corpus.fingerprint) / CHECKPOINT, weights_only=False)
    b = torch.load(folder / CHECKPOINT, weights_only=False)
    assert a["step"] == b["step"] == 6 and [h["step"] for h in b["history"]] == [3, 6]
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])  # same as never interrupted
    assert torch.equal(a["optimizer"]["state"][0]["exp_avg"], b["optimizer"]["state"][0]["exp_avg"])

    # a larger budget continues the finished base instead of starting over
    more = tiny_settings(tmp_path / "b", corpus_dir, steps=8)
    out = quiet()
    ensure_base_model(more, out)
    assert "resuming from step 6" in out.file.getvalue()
    assert torch.load(folder / CHECKPOINT, weights_only=False)["step"] == 8


def test_bad_corpus_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        ensure_base_model(tiny_settings(tmp_path, tmp_path / "nope"), quiet())


def test_cli_missing_corpus_is_one_line(tmp_path):
    r = flywheel("pretrain", "--corpus", str(tmp_path / "missing"), "--set", f"cache_dir={tmp_path}", tmp_path=tmp_path)
    assert r.returncode == 1, r
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("flywheel: error: corpus folder") and "does not exist" in lines[0]
    assert "Traceback" not in r.stdout + r.stderr


def test_quality_rule_is_a_plain_function():
    metrics = {
        "heldout_accuracy": 0.18,
        "bigram_accuracy": 0.286,
        "heldout_loss": 5.42,
        "bigram_loss": 3.76,
        "train_tokens": 200_000,
        "tokens_per_s": 121.0,
        "precision": "bf16",
    }  # the fresh machine's run
    cfg = PretrainSection(min_steps=200)
    why = quality_problem(metrics, 46, cfg)
    assert "worse than its bigram baseline" in why and "18.0% vs 28.6%" in why and "121 tokens/s in bf16" in why
    good = metrics | {"heldout_accuracy": 0.526, "heldout_loss": 2.39}
    assert quality_problem(good, 1342, cfg) is None
    assert "fewer than pretrain.min_steps=200" in quality_problem(
        good, 46, cfg
    )  # better, but too few steps to mean anything
    assert quality_problem(metrics, 46, PretrainSection(quality_check=False)) is None


def test_a_base_worse_than_its_baseline_fails_loudly_and_is_never_reused(tmp_path, corpus_dir):
    s = tiny_settings(tmp_path, corpus_dir, steps=2, quality_check=True)  # 2 steps: still at random init
    with pytest.raises(UserError, match="worse than its bigram baseline") as e:
        ensure_base_model(s, quiet())
    assert "\n" not in str(e.value) and "flywheel pretrain --minutes" in str(e.value)
    with pytest.raises(UserError, match="worse than its bigram baseline"):  # the cached one, reused: refused too
        ensure_base_model(s, quiet())
    from learner.train.pretrain import find_base_model

    with pytest.raises(
        UserError, match="worse than its bigram baseline"
    ):  # the learner and `flywheel serve` look it up so
        find_base_model(s)
    r = flywheel(
        "pretrain",
        "--corpus",
        str(corpus_dir),
        "--steps",
        "2",
        "--set",
        f"cache_dir={tmp_path}",
        "--set",
        "pretrain.size=tiny",
        "--set",
        "pretrain.vocab_size=400",
        "--set",
        "pretrain.seq_len=32",
        "--set",
        "pretrain.batch_size=4",
        "--set",
        "pretrain.warmup_steps=2",
        "--set",
        "pretrain.eval_every=3",
        "--set",
        "pretrain.eval_windows=4",
        "--set",
        "pretrain.final_eval_windows=8",
        "--set",
        "pretrain.heldout_fraction=0.2",
        tmp_path=tmp_path,
    )
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 1 and len(lines) == 1 and "worse than its bigram baseline" in lines[0], (
        r.stdout[-2000:],
        r.stderr,
    )
    assert "Traceback" not in r.stdout + r.stderr


def test_loss_schedule_and_bigram_are_plain_functions():
    logits = torch.zeros(1, 3, 5)
    logits[0, :, 2] = 10.0
    loss, m = lm_loss(logits, torch.tensor([[2, 2, 1]]))
    assert m["accuracy"] == pytest.approx(2 / 3) and loss.item() > 0
    # weights: equal ones change nothing; all on one position gives that position's loss
    targets = torch.tensor([[2, 2, 1]])
    assert lm_loss(logits, targets, torch.full((1, 3), 3.0))[0].item() == pytest.approx(loss.item())
    only_last = lm_loss(logits, targets, torch.tensor([[0.0, 0.0, 1.0]]))[0].item()
    assert only_last == pytest.approx(torch.nn.functional.cross_entropy(logits[0, 2:], targets[0, 2:]).item())
    assert only_last > loss.item()  # the mispredicted position alone

    cfg = PretrainSection(lr=1.0, warmup_steps=10, min_lr_ratio=0.1, steps=100)
    assert lr_at(0, 0.0, cfg) == pytest.approx(0.1) and lr_at(9, 0.09, cfg) == pytest.approx(1.0)
    assert lr_at(50, 0.5, cfg) == pytest.approx(0.55) and lr_at(100, 1.0, cfg) == pytest.approx(0.1)

    stream = torch.tensor([1, 2, 1, 2, 1, 3])  # after 1 comes 2 most often
    r = bigram_baseline(stream, torch.tensor([[1, 2, 1, 3]]), vocab_size=4)
    assert r["accuracy"] == pytest.approx(2 / 3)


def test_short_rows_then_long_ones_with_the_same_tokens_a_step(tmp_path, corpus_dir):
    from learner.formats import own_format
    from learner.tokenizer import train_tokenizer

    corpus = load_training_corpus(PretrainSection(**tiny_pretrain(corpus_dir, heldout_fraction=0.2)))
    tok = train_tokenizer((f.text for f in corpus.train), 400)
    fmt = own_format(tok, 128)
    cfg = PretrainSection(**tiny_pretrain(corpus_dir, seq_len=128, short_seq_len=32, batch_size=2, long_fraction=0.25))
    c = Curriculum.of(tok, fmt, corpus.train, cfg)
    assert c.short is not None and c.long_from == 0.75 and c.short.stream is c.long.stream is c.stream
    assert c.at(0.0).batch(5).shape == c.at(0.74).batch(5).shape == (8, 33)  # 8 x 32 = 2 x 128 tokens
    assert c.at(0.75).batch(5).shape == c.at(1.0).batch(5).shape == (2, 129)
    assert torch.equal(c.at(0.1).batch(3), c.at(0.2).batch(3))  # rows are a function of (seed, step, phase)
    for one_phase in (dict(short_seq_len=128), dict(short_seq_len=512), dict(long_fraction=1.0)):
        single = Curriculum.of(tok, fmt, corpus.train, cfg.model_copy(update=one_phase))
        assert single.short is None and single.at(0.0).batch(0).shape == (2, 129)


def test_settings_validate_one_line():
    with pytest.raises(UserError, match="pretrain.size"):
        PretrainSettings.load(None, ["pretrain.size=huge"])
    with pytest.raises(UserError, match="fim_rate"):
        PretrainSettings.load(None, ["pretrain.fim_rate=0.8", "pretrain.summary_rate=0.5"])
