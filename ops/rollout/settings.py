"""The `[rollout]` section: the policy a new rollout begins with, and how the controller runs.

A rollout copies its policy (weights, interval, min_samples, thresholds) into its row when it
starts, so changing these settings affects the rollouts started afterwards, never a running one.
"""

from __future__ import annotations

from typing import Literal, Self

from pydantic import Field, model_validator

from feedback.core.config import FlywheelSettings, Seconds, Section
from ops.rollout.stats import Policy


class Thresholds(Section):
    """How much worse than stable the canary may look before a significant difference counts as harm."""

    accept_rate_drop: float = Field(default=0.02, ge=0, le=1)
    """Tolerated drop in accept rate (accepted / shown), absolute: 0.02 is 2 percentage points."""
    accept_rate_loss: float = Field(default=0.005, gt=0, le=1)
    """`promote_rule = "expected_loss"`: the largest expected loss of accept rate, absolute, a promotion may carry."""
    suggestion_rate_ratio: float = Field(default=0.5, gt=0, le=1)
    """The suggestion rate (shown / choices) counts as harmed when it is significantly below this share of
    stable's (less `suggestion_rate_drop`). Relative and wide, as a version may learn to abstain: its show
    policy withholds what users would dismiss, 40% to 23% in one demo run, more than an absolute 15 points.
    The learner's gate bounds the same ratio (`learn.gate.min_suggestion_ratio`, 0.5). A version that shows
    nothing is rolled back on it."""
    suggestion_rate_drop: float = Field(default=0.0, ge=0, le=1)
    """A further tolerated drop in suggestion rate, absolute (with `suggestion_rate_ratio = 1`: the absolute
    tolerance alone, the rule before the ratio)."""
    reward_drop: float = Field(default=0.05, ge=0)
    """Tolerated drop in mean reward per choice, in reward units (sink.reward: accepted = 0.75)."""
    error_rate_increase: float = Field(default=0.01, ge=0, le=1)
    """Tolerated rise in the share of aborted choices, absolute."""
    p99_latency_ratio: float = Field(default=1.5, ge=1)
    """Roll back when the canary's latency is significantly above stable's times this factor (Welch's t-test on
    log latency: a ratio of geometric means); each arm's p99 is kept in the evidence."""


class RolloutSection(Section):
    """Section `[rollout]`: the policy new rollouts get, and how the controller runs."""

    mode: Literal["canary", "all"] = "canary"
    """`canary`: step through `weights`, testing at each; `all`: make the version stable at once (no canary)."""
    weights: list[float] = [5.0, 25.0, 50.0, 100.0]
    """Canary share of users per step, percent, increasing; passing the last step promotes."""
    interval_s: Seconds = Field(default=60.0, gt=0)
    """How long each step runs before it is evaluated (and between evaluations of a holding step)."""
    min_samples: int = Field(default=200, ge=2)
    """Observations per arm below which a metric is not tested; the step holds until the accept rate has them."""
    alpha: float = Field(default=0.05, gt=0, lt=0.5)
    """Significance level of each one-sided test (canary worse than stable beyond the threshold)."""
    max_per_user: int = Field(default=20, ge=1)
    """Most samples one user (`user_hash`) contributes to an arm per step: completions, choices, shown
    choices and rewards each, the user's earliest in the step's window; the rest is left out of the
    evidence and counted (`capped_shown`, `capped_rewards`). One editor token can post any number of
    accepts for its own completions; with this, a single client cannot supply an arm's samples.
    Arms need min_samples / max_per_user users each (10 at the defaults)."""
    max_holds: int = Field(default=30, ge=0)
    """Under-sampled evaluations a step may hold before the rollout is rolled back for insufficient traffic."""
    require_reward: bool = False
    """Also hold until mean reward has `min_samples` per arm. Rewards appear sink.feedback_window_s after
    a completion, so set this only with `interval_s` well above that window; otherwise reward still guards
    (rolls back) whenever it has the samples."""
    thresholds: Thresholds = Thresholds()
    """Tolerances of the guarded metrics (section `[rollout.thresholds]`)."""
    promote_rule: Literal["non_inferior", "expected_loss", "no_harm"] = "non_inferior"
    """What the last step needs to promote. `non_inferior`: the canary's accept rate shown to be within
    `thresholds.accept_rate_drop` of stable's (the upper confidence bound of its drop below that margin;
    the step holds until it is, and rolls back after `max_holds` holds). At a 10% accept rate and a
    2-point margin that takes about 1,200 shown choices per arm. `expected_loss`: the expected loss of
    accept rate if the canary is promoted, under each arm's Beta posterior, at most
    `thresholds.accept_rate_loss` (holds and rolls back likewise); for traffic too thin to show
    non-inferiority. `no_harm`: no metric significantly worse, however few the samples beyond
    `min_samples` (the oldest rule)."""
    poll_s: float = Field(default=5.0, gt=0)
    """How often the controller checks the active rollout (and, in auto mode, the versions topic)."""
    auto: bool = False
    """Start a rollout for every version announced on flywheel.versions that passed the learner's gate."""
    group_id: str = Field(default="flywheel-rollout", min_length=1)
    """Kafka consumer group of the auto-mode controller (a restart resumes from its committed offset)."""
    unannounced_after_s: float = Field(default=60.0, gt=0)
    """Auto mode: a version the learner recorded this long ago (model_versions), newer than stable and
    than every rollout's candidate, with no rollout yet, is started as if announced. An announcement
    lost on the way (a broker outage, a consumer that never joined its group) delays a rollout, never
    stops it."""

    @model_validator(mode="after")
    def _weights_increase(self) -> Self:
        w = self.weights
        if not w or any(not 0 < x <= 100 for x in w) or any(b <= a for a, b in zip(w, w[1:])):
            raise ValueError(
                f"rollout.weights must be increasing percentages in (0, 100], e.g. [5, 25, 50, 100]; got {w}"
            )
        return self

    def policy(self) -> Policy:
        return Policy(
            min_samples=self.min_samples,
            alpha=self.alpha,
            max_holds=self.max_holds,
            require_reward=self.require_reward,
            max_per_user=self.max_per_user,
            promote_rule=self.promote_rule,
            **self.thresholds.model_dump(),
        )


class RolloutSettings(FlywheelSettings):
    """`flywheel rollout`: the canary controller and its commands."""

    rollout: RolloutSection = RolloutSection()


def parse_weights(value: str) -> list[float]:
    """`5,25,50,100` -> [5.0, 25.0, 50.0, 100.0]; ValueError otherwise."""
    try:
        return [float(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"bad weights {value!r}: expected comma-separated percentages, e.g. 5,25,50,100") from None
