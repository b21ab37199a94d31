"""`flywheel bench learn` evaluates each version with `flywheel eval`'s evaluation (a tiny base
trained in the test, one short curve)."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from learner import eval as E
from learner import store as S
from learner.formats import read_format
from learner.tokenizer import load_tokenizer
from learner.train.learn import model_from_packed
from learner.train.pretrain import ensure_base_model, find_base_model, load_master_weights, load_training_corpus
from ops.bench.learn import BenchLearnSettings, run_bench
from tests.helpers import logprob_policy
from tests.learner.train.learn_support import make_corpus, tiny_learn_settings


def test_each_version_is_scored_by_the_one_evaluation(tmp_path):
    tiny = tiny_learn_settings(tmp_path, make_corpus(tmp_path / "corpus"), tmp_path / "cache")
    s = BenchLearnSettings(**tiny.model_dump(), eval={"sites": 6, "max_tokens": 8})
    ensure_base_model(s, Console(file=io.StringIO()))
    out = io.StringIO()
    result = run_bench(
        s,
        Console(file=out, width=400),
        lrs=(1e-4,),
        versions=1,
        updates=1,
        temperature=0.7,
        train_sites=8,
        out=str(tmp_path / "curve.json"),
        command="test",
    )
    base_row, v1 = result["rows"]
    assert result["heldout_sites"] == 6 and base_row["sites"] == v1["sites"] == 6

    # The base row is learner.eval.evaluate on the base's served weights, the sites eval.seed picks.
    folder = find_base_model(s)
    master, args = load_master_weights(folder)
    served = model_from_packed(S.pack_checkpoint(master.state_dict(), "nvfp4"), args)
    here = E.evaluate(
        served,
        load_tokenizer(folder / "hf"),
        read_format(folder / "hf"),
        load_training_corpus(s.pretrain).heldout,
        sites=6,
        seed=s.eval.seed,
        max_tokens=8,
        min_confidence=s.model.min_confidence,  # serving's confidence gate, as the benchmark scores
    )
    assert s.model.min_confidence > 0
    assert base_row["accept_rate"] == here.accept_rate and base_row["exact_match"] == here.exact_match
    assert base_row["reward"] == pytest.approx(here.mean_reward)
    assert base_row["intervals"]["suggestion_rate"] == pytest.approx(here.intervals()["suggestion_rate"].as_dict())
    assert v1["intervals"]["accept_rate"]["method"] == "wilson" and v1["intervals"]["latency_ms"]["n"] == 6
    assert "accept rate [95% CI]" in out.getvalue() and (tmp_path / "curve.json").is_file()
    # Each version's delta against the one before, as the store would publish it.
    assert base_row["delta_bytes"] is None and 0 < v1["delta_bytes"] < v1["full_bytes"] == base_row["full_bytes"]
    assert f"(1/{v1['full_bytes'] / v1['delta_bytes']:.0f})" in out.getvalue()
    # Against the base on the same sites: the paired change in accepted characters is the change
    # of the means; the accept rate's test needs a suggestion shown by both.
    chars = v1["chars_vs_base"]
    assert chars["mean"] == pytest.approx(v1["accepted_chars_per_request"] - base_row["accepted_chars_per_request"])
    assert v1["accept_p_vs_base"] is None or 0 <= v1["accept_p_vs_base"] <= 1
    # the paired test (learner.eval.paired_accept_ratio) on the two replays' sites
    paired = v1["accept_ratio_vs_base"]
    if base_row["accept_rate"] and v1["accept_rate"]:
        assert paired["ratio"] == pytest.approx(v1["accept_rate"] / base_row["accept_rate"])
    assert paired["rounds"] in (0, 10_000) and (paired["p"] is None) == (paired["rounds"] == 0)
    assert base_row["show_policy_samples"] is None and "show policy (outcomes)" in out.getvalue()


def test_training_traffic_passes_through_serving_confidence_gate(tmp_path, monkeypatch):
    """What the simulated editors never see is never trained on, as in the learner: a sampled
    suggestion the gate withholds is drawn again, and counted."""
    import learner.confidence
    import learner.train.learn as L

    tiny = tiny_learn_settings(tmp_path, make_corpus(tmp_path / "corpus"), tmp_path / "cache")
    s = BenchLearnSettings(
        **{**tiny.model_dump(), "model": {**tiny.model.model_dump(), "min_confidence": 0.5}},
        eval={"sites": 4, "max_tokens": 8},
    )
    ensure_base_model(s, Console(file=io.StringIO()))
    trained: list = []
    make_batch = L.make_batch
    monkeypatch.setattr(
        L, "make_batch", lambda samples, *a, **k: trained.extend(samples) or make_batch(samples, *a, **k)
    )

    def curve() -> dict:
        trained.clear()
        kw = dict(lrs=(1e-4,), versions=1, updates=2, temperature=0.7, train_sites=8, out=None, command="test")
        return run_bench(s, Console(file=io.StringIO(), width=240), **kw)["rows"][1]

    # serving's gate: the tiny model is unsure of every first token, so what it trains on is what
    # it shows: empty suggestions, or a first token at 0.5 or more
    v1 = curve()
    gate = learner.confidence.withheld
    assert trained and all(x.outcome == "no_suggestion" or not gate(x.behaviour, 0.5) for x in trained)
    assert 0.5 < v1["train_withheld"] < 1

    # every other sampled suggestion withheld (an empty one is never asked about): full batches all
    # the same, and at most half the draws counted withheld
    draws = iter(range(10**6))
    monkeypatch.setattr(learner.confidence, "withheld", lambda logprobs, gate, *policy: next(draws) % 2 == 0)
    v1 = curve()
    assert len(trained) == 2 * s.learn.batch_size and 0 < v1["train_withheld"] <= 0.5


def test_a_version_is_evaluated_and_served_with_the_show_policy_fitted_on_its_traffic(tmp_path, monkeypatch):
    """As the learner does (learner/show.py): the outcomes of the suggestions shown to the
    simulated editors are fitted after each version; the evaluation applies the fit, and so does
    the next version's traffic."""
    from learner import show

    tiny = tiny_learn_settings(tmp_path, make_corpus(tmp_path / "corpus"), tmp_path / "cache")
    s = BenchLearnSettings(
        **{**tiny.model_dump(), "model": {**tiny.model.model_dump(), "min_confidence": 0.0}},
        eval={"sites": 6, "max_tokens": 8},
    )
    ensure_base_model(s, Console(file=io.StringIO()))
    fitted_on: list[int] = []
    never = logprob_policy(weights=(0.0,) * 5, bias=-10.0, samples=0, accepts=0)

    def fit(rows, **kw):
        fitted_on.append(len(rows))
        return never

    monkeypatch.setattr(show, "fit", fit)
    kw = dict(lrs=(1e-4,), versions=2, updates=1, temperature=0.7, train_sites=8, out=None, command="test")
    base_row, v1, v2 = run_bench(s, Console(file=io.StringIO(), width=240), **kw)["rows"]
    assert base_row["suggestion_rate"] > 0 and v1["suggestion_rate"] == v2["suggestion_rate"] == 0
    # v1's traffic was shown under no policy: every suggestion that was not empty is an outcome;
    # v2's under `never`, which withholds all but what it explores (5%): most draws withheld, and
    # the outcomes accumulate
    assert 0 < fitted_on[0] <= s.learn.batch_size and fitted_on[1] >= fitted_on[0]
    assert v1["train_withheld"] == 0 and v2["train_withheld"] > 0.5
