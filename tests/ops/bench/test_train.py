"""`flywheel bench train`: both arms train the same model on the same batches, so their losses agree
at every step, and the report has each arm's throughput and the ratio."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from learner.train.pretrain_settings import PretrainSettings
from ops.bench.train import run_bench
from tests.helpers import flywheel
from tests.learner.train.learn_support import make_corpus


def test_grouped_and_loop_arms_train_identically_and_are_timed(tmp_path):
    corpus = make_corpus(tmp_path / "corpus")
    s = PretrainSettings(
        cache_dir=tmp_path / "cache",
        pretrain=dict(corpus=str(corpus), size="tiny", vocab_size=400, seq_len=64, batch_size=4, precision="fp32"),
    )
    out = io.StringIO()
    result = run_bench(s, Console(file=out, width=200), steps=3, warmup=1, out=str(tmp_path / "r.json"), command="t")
    assert result["losses_identical"] and result["max_loss_difference"] == 0.0
    assert set(result["arms"]) == {"grouped", "loop"} and all(a["steps"] == 3 for a in result["arms"].values())
    g, lp = result["arms"]["grouped"], result["arms"]["loop"]
    assert result["ratio"] == g["tokens_per_s"] / lp["tokens_per_s"] and g["tokens_per_s"] > 0
    assert result["paired_ratio"] > 0 and result["cpu_ratio"] > 0
    assert g["tokens_per_s"] == pytest.approx(4 * 64 / (g["median_ms"] / 1e3))
    assert json.loads((tmp_path / "r.json").read_text())["batch_tokens"] == 256
    assert "grouped / loop" in out.getvalue() and "identical at every step" in out.getvalue()


def test_bad_steps_is_one_line(tmp_path):
    r = flywheel("bench", "train", "--steps", "0", tmp_path=tmp_path)
    assert r.returncode == 1 and r.stderr.startswith("flywheel: error: --steps") and "Traceback" not in r.stderr
