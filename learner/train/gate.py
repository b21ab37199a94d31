"""The gate before publish: checks that block a candidate which games the online reward
instead of getting better at completion.

The candidate and the stable version are first replayed on the same held-out sites
(learner.eval.evaluate_candidate: simulated editor sessions, scored by the sink's reward);
`check` then compares the two replays' stats. Each failed check blocks the publish and says why:

    sites              too few sites, or candidate and stable replayed on different sites
    heldout_reward     held-out reward below stable's by more than `reward_tolerance`
    reward_divergence  online reward rising while held-out reward falls: reward hacking
    suggestion_rate    the candidate stops suggesting (abstaining earns 0, never -0.25)
    completion_length  mean suggestion length collapses or explodes relative to stable
    kl                 the policy moved too far from the reference in one publish

The thresholds are `[learn.gate]` (learner.train.learn_settings.GateThresholds). `check` is a
pure function of the two replays' stats; only the replay runs the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from learner.eval import ReplayStats, json_number
from learner.train.learn_settings import GateThresholds


@dataclass
class GateResult:
    passed: bool
    reasons: list[str]  # one line per failed check, starting with the check's name
    metrics: dict[str, Any]  # JSON-safe: goes into model_versions.metrics and flywheel.versions


def check(
    candidate: ReplayStats,
    stable: ReplayStats,
    *,
    online_reward_trend: float | None,
    kl: float,
    thresholds: GateThresholds | None = None,
) -> GateResult:
    """Whether to publish `candidate`, judged against `stable` on the same held-out sites.

    `online_reward_trend`: how the online (served) mean reward moved while the candidate trained,
    positive when rising; None when unknown. `kl`: the candidate's mean per-token KL from the
    reference model."""
    t = thresholds or GateThresholds()
    trend = online_reward_trend if online_reward_trend is not None and math.isfinite(online_reward_trend) else None
    failed: dict[str, str] = {}

    if candidate.n != stable.n:
        failed["sites"] = (
            f"candidate replayed {candidate.n} sites and stable {stable.n}: compare them on the same sites"
        )
    elif candidate.n < t.min_sites:
        failed["sites"] = f"only {candidate.n} held-out sites replayed; the gate needs at least {t.min_sites}"

    delta = candidate.mean_reward - stable.mean_reward
    if delta < -t.reward_tolerance:
        failed["heldout_reward"] = (
            f"held-out reward {candidate.mean_reward:.3f} is {-delta:.3f} below stable's "
            f"{stable.mean_reward:.3f} (tolerance {t.reward_tolerance})"
        )
    if trend is not None and trend > 0 and delta < -t.divergence_tolerance:
        failed["reward_divergence"] = (
            f"online reward rose by {trend:+.3f} while held-out reward fell by {-delta:.3f} "
            f"(tolerance {t.divergence_tolerance}): reward hacking, not better completions"
        )

    suggestion_ratio = _ratio(candidate.suggestion_rate, stable.suggestion_rate)
    if (suggestion_ratio is not None and suggestion_ratio < t.min_suggestion_ratio) or (
        candidate.suggestion_rate < t.min_suggestion_rate and candidate.suggestion_rate < stable.suggestion_rate
    ):
        failed["suggestion_rate"] = (
            f"candidate suggests on {candidate.suggestion_rate:.0%} of requests vs {stable.suggestion_rate:.0%} "
            f"for stable (floor: {t.min_suggestion_ratio:.0%} of stable, and {t.min_suggestion_rate:.0%}): "
            "it learned to abstain"
        )

    length_ratio = (
        _ratio(candidate.mean_completion_tokens, stable.mean_completion_tokens)
        if candidate.shown and stable.shown
        else None
    )
    if length_ratio is not None and not t.min_length_ratio <= length_ratio <= t.max_length_ratio:
        failed["completion_length"] = (
            f"mean suggestion length {candidate.mean_completion_tokens:.1f} tokens is {length_ratio:.2f}x "
            f"stable's {stable.mean_completion_tokens:.1f} (allowed {t.min_length_ratio}x to {t.max_length_ratio}x)"
        )

    if not math.isfinite(kl):
        failed["kl"] = f"KL to the reference is {kl}: the update diverged"
    elif kl > t.max_kl:
        failed["kl"] = f"KL to the reference {kl:.3f} nats/token exceeds {t.max_kl}"

    metrics = {
        "passed": not failed,
        "failed": list(failed),
        "candidate": candidate.summary(),
        "stable": stable.summary(),
        "reward_delta": json_number(delta),
        "suggestion_ratio": json_number(suggestion_ratio),
        "length_ratio": json_number(length_ratio),
        "kl": json_number(kl),
        "online_reward_trend": json_number(trend),
        "thresholds": t.model_dump(mode="json"),
    }
    return GateResult(not failed, [f"{name}: {why}" for name, why in failed.items()], metrics)


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None
