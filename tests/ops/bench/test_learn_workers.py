"""`flywheel bench learn-workers` on a tiny base: samples/s with 1 and 2 workers on the same batches,
and the loss curves side by side (equal to float rounding)."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from feedback.core.errors import UserError
from learner.train.pretrain import ensure_base_model
from ops.bench.learn_workers import run_bench
from tests.learner.train.learn_support import make_corpus, tiny_learn_settings


@pytest.fixture(scope="module")
def settings(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench-workers")
    s = tiny_learn_settings(tmp, make_corpus(tmp / "corpus"), tmp / "cache", batch_size=4, lr=1e-4)
    ensure_base_model(s, Console(file=io.StringIO()))
    return s


def test_bad_arguments_are_refused(settings):
    with pytest.raises(UserError, match="at least 2"):
        run_bench(
            settings, Console(file=io.StringIO()), workers=(1,), updates=1, temperature=0.7, out=None, command="t"
        )
    with pytest.raises(UserError, match=r"--workers 5 exceeds learn.batch_size \(4\)"):
        run_bench(
            settings, Console(file=io.StringIO()), workers=(1, 5), updates=2, temperature=0.7, out=None, command="t"
        )


@pytest.mark.extended
@pytest.mark.slow
def test_one_and_two_workers_train_the_same_batches_alike(settings, tmp_path):
    out = io.StringIO()
    result = run_bench(
        settings,
        Console(file=out, width=200),
        workers=(1, 2),
        updates=3,
        temperature=0.7,
        out=str(tmp_path / "bench.json"),
        command="test",
    )
    one, two = result["runs"]["1"], result["runs"]["2"]
    assert result["ratio"]["1"] == 1.0 and result["ratio"]["2"] == pytest.approx(
        two["samples_per_s"] / one["samples_per_s"]
    )
    # The same batches from the same weights: the losses agree to float rounding (test_data_parallel's bound).
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-3, abs=1e-6)
    assert all(r["samples_per_s"] > 0 and r["samples_per_s_with_save"] <= r["samples_per_s"] for r in (one, two))
    assert json.loads((tmp_path / "bench.json").read_text())["updates"] == 3
    assert "loss, 2 worker(s)" in out.getvalue()
