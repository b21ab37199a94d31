"""`flywheel bench routes`: vLLM's captured routes reach the learner's replay (a tiny base trained
in the test, a few held-out sites)."""

from __future__ import annotations

import io
import json
import math

import pytest
from rich.console import Console

from learner.train.pretrain import ensure_base_model
from ops.bench.routes import run_bench
from tests.learner.train.learn_support import make_corpus, tiny_learn_settings


@pytest.mark.extended
@pytest.mark.slow
def test_every_vllm_completion_carries_routes_the_learner_replays(tmp_path):
    s = tiny_learn_settings(tmp_path, make_corpus(tmp_path / "corpus"), tmp_path / "cache")
    ensure_base_model(s, Console(file=io.StringIO()))
    out = io.StringIO()
    r = run_bench(
        s,
        Console(file=out, width=200),
        sites=6,
        temperature=0.7,
        max_tokens=6,
        out=str(tmp_path / "r.json"),
        command="t",
    )
    assert r["completions"] > 0 and r["traced"] == r["completions"]  # vLLM recorded every one
    m = r["mismatch_kl"]
    assert all(math.isfinite(v) and v >= 0 for v in m.values())
    assert r["tokens"] >= r["completions"]
    assert 0.0 <= r["routes_differing_from_own_fp4"] <= 1.0
    if r["routes_differing_from_own_fp4"]:
        assert r["serving_over_own"] == pytest.approx(m["serving"] / m["own"])
        lo, hi = r["serving_over_own_interval"]
        assert lo <= r["serving_over_own"] <= hi
    else:  # an engine computing in float32 can route every token as the forward does
        assert r["serving_over_own"] is None and r["serving_over_own_interval"] is None
        # the same experts, perhaps listed in another order: the same sums up to rounding
        assert m["serving"] == pytest.approx(m["own"], rel=1e-3, abs=1e-9)
        assert "replaying them changes nothing" in out.getvalue()
    assert "serving routes replayed (R3)" in out.getvalue()
    assert json.loads((tmp_path / "r.json").read_text())["traced"] == r["traced"]
