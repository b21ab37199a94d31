"""The gate's reward-hacking checks: each blocks with its reason, on constructed replay stats."""

from __future__ import annotations

import json

import pytest

from learner.eval import ReplayStats
from learner.train import gate as G
from learner.train.learn_settings import GateThresholds


def stats(n=48, shown=40, accepted=10, reward_sum=2.0, completion_tokens=400, **kw) -> ReplayStats:
    return ReplayStats(
        n=n,
        shown=shown,
        accepted=accepted,
        accepted_chars=accepted * 12,
        reward_sum=reward_sum,
        completion_tokens=completion_tokens,
        **kw,
    )


def failed(result: G.GateResult) -> set[str]:
    return {r.split(":", 1)[0] for r in result.reasons}


# --- check(): each rule on constructed stats ------------------------------------------------------------


def test_a_candidate_like_stable_passes_and_its_metrics_are_json():
    result = G.check(stats(reward_sum=2.5), stats(), online_reward_trend=0.05, kl=0.01, thresholds=GateThresholds())
    assert result.passed and result.reasons == []
    assert result.metrics["passed"] and result.metrics["failed"] == []
    assert result.metrics["reward_delta"] == pytest.approx(0.5 / 48, abs=1e-6)
    assert result.metrics["suggestion_ratio"] == 1.0 and result.metrics["length_ratio"] == 1.0
    json.dumps(result.metrics, allow_nan=False)  # model_versions.metrics is jsonb: no NaN


def test_heldout_reward_below_stable_blocks():
    result = G.check(stats(reward_sum=0.0), stats(reward_sum=2.0), online_reward_trend=None, kl=0.01)
    assert not result.passed and failed(result) == {"heldout_reward"}
    small_dip = G.check(
        stats(reward_sum=1.5), stats(reward_sum=2.0), online_reward_trend=None, kl=0.01
    )  # -0.010 > -0.03
    assert small_dip.passed


def test_online_reward_rising_while_heldout_falls_is_reward_hacking():
    # The same small dip passes while the online trend is flat, and is blocked while it rises.
    cand, stable = stats(reward_sum=1.0), stats(reward_sum=2.0)  # -0.021: within reward_tolerance
    assert G.check(cand, stable, online_reward_trend=-0.01, kl=0.01).passed
    result = G.check(cand, stable, online_reward_trend=0.1, kl=0.01)
    assert failed(result) == {"reward_divergence"}
    assert "reward hacking" in result.reasons[0] and result.metrics["online_reward_trend"] == 0.1


def test_suggestion_rate_collapse_blocks():
    half = G.check(stats(shown=15, completion_tokens=150), stats(shown=40), online_reward_trend=None, kl=0.0)
    assert failed(half) == {"suggestion_rate"}  # 31% of requests vs 83%: under half of stable's
    nothing = G.check(
        stats(shown=0, accepted=0, reward_sum=0.0, completion_tokens=0),
        stats(shown=2, accepted=0, reward_sum=-0.5, completion_tokens=20),
        online_reward_trend=None,
        kl=0.0,
    )
    assert "suggestion_rate" in failed(
        nothing
    )  # abstaining everywhere beats a dismissed stable on reward, and is still blocked
    assert nothing.metrics["length_ratio"] is None  # no suggestions: no length to compare
    weak_stable = stats(shown=1, accepted=0, reward_sum=-0.25, completion_tokens=10)
    assert G.check(
        weak_stable, weak_stable, online_reward_trend=None, kl=0.0
    ).passed  # under the floor, but no worse than stable


@pytest.mark.parametrize("tokens, ok", [(400, True), (190, False), (210, True), (800, True), (840, False)])
def test_completion_length_must_stay_within_half_and_twice_stable(tokens, ok):
    result = G.check(stats(completion_tokens=tokens), stats(completion_tokens=400), online_reward_trend=None, kl=0.0)
    assert result.passed == ok and (ok or failed(result) == {"completion_length"})


def test_kl_spike_and_non_finite_kl_block():
    assert failed(G.check(stats(), stats(), online_reward_trend=None, kl=0.5)) == {"kl"}
    nan = G.check(stats(), stats(), online_reward_trend=float("nan"), kl=float("nan"))
    assert failed(nan) == {"kl"} and nan.metrics["kl"] is None and nan.metrics["online_reward_trend"] is None
    json.dumps(nan.metrics, allow_nan=False)


def test_too_few_or_different_sites_block():
    assert failed(
        G.check(
            stats(n=8, shown=6, accepted=2, completion_tokens=60),
            stats(n=8, shown=6, accepted=2, completion_tokens=60),
            online_reward_trend=None,
            kl=0.0,
        )
    ) == {"sites"}
    assert "sites" in failed(G.check(stats(n=40), stats(n=48), online_reward_trend=None, kl=0.0))
    assert G.check(
        stats(n=8, shown=6, accepted=2, completion_tokens=60),
        stats(n=8, shown=6, accepted=2, completion_tokens=60),
        online_reward_trend=None,
        kl=0.0,
        thresholds=GateThresholds(min_sites=8),
    ).passed


def test_thresholds_validate():
    with pytest.raises(ValueError, match="min_length_ratio"):
        GateThresholds(min_length_ratio=3.0)
    with pytest.raises(ValueError):
        GateThresholds(max_kl=0)
