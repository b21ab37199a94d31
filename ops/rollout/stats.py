"""The canary's statistics and decision rules: pure functions, no I/O.

The controller (controller.py) reads one `Arm` per version from SQL (arms.py) for a step's time
window and asks `decide()` what to do. Everything here is arithmetic on those counts, so it
is tested with hand-computed numbers.

Metrics, each compared canary against stable (definitions match the `v_*` analyst views):

  accept rate   accepted / shown choices. Shown: the choice has at least one event;
                accepted: a `select` or `edit` event (v_choice_feedback). The primary metric.
  mean reward   mean of `rewards.reward` over the arm's choices (v_version_rewards). Rewards
                appear only once a choice's feedback window (sink.feedback_window_s) closes,
                so a short step may see none.
  suggestion    shown / choices: the share of choices the user saw at all (an empty or
  rate          withheld suggestion is never shown). A version may learn to abstain, so its
                tolerance is wide; a version that shows nothing (a broken head, a tokenizer
                mismatch: every suggestion empty) is rolled back on it, where the accept rate,
                which counts only shown choices, never gets its samples.
  error rate    share of served choices the engine aborted (finish_reason 'abort', or
                'error' should an engine report it). A request that fails outright (HTTP
                503) never becomes a completion record, so SQL cannot count it: this is the
                error rate of what was served; outright failures are in Prometheus.
  latency       completions.latency_ms: its log's mean and variance for the test, and the
                nearest-rank 99th percentile (as v_latency) as evidence.

Tests (one-sided: "is the canary worse than stable by more than the tolerance?"):

  rates   two-proportion z-test. With no tolerance it is the textbook pooled test; with a
          tolerance `m` the null hypothesis is `p_canary = p_stable - m` (for a rate where
          higher is better), which the pooled variance does not describe, so the unpooled
          (Wald) standard error is used, as in non-inferiority testing.
  means   Welch's t-test with Welch-Satterthwaite degrees of freedom; the p-value is the
          exact Student t tail (regularized incomplete beta), not a normal approximation.
  latency Welch's t-test on log latency: is the canary's typical (geometric-mean) latency
          above stable's by more than the factor `p99_latency_ratio`? A p99 from a step's few
          dozen completions is nearly the maximum, and on a loaded machine one queueing spike
          rolled harmless candidates back; the test weighs the whole distribution and its
          sample size instead. The p99 of each arm stays in the evidence.

Promotion (after the last step) needs more than "no significant harm" under the default rule
`non_inferior`: the canary's accept rate must be shown to be within `accept_rate_drop` of
stable's, that is, the one-sided (1 - alpha) upper confidence bound of its drop (stable minus
canary, on Agresti and Caffo's adjusted rates) must lie below the margin. "No significant
harm" alone let a step of a few dozen shown choices promote a canary whose accept rate looked
lower (10.7% of 28 against 13.3% of 105): absence of evidence of harm, not evidence of its
absence. Until the bound is below the margin the last step holds, gathering traffic; after
`max_holds` holds it rolls back ("not shown non-inferior"). At a 10% accept rate and a 2-point
margin that takes about 1,200 shown choices per arm.

`expected_loss` is the Bayesian rule for lower traffic: with a uniform prior each arm's accept
rate has a Beta posterior, and the canary is promoted once the expected loss of promoting it,
E[max(stable - canary, 0)], is at most `accept_rate_loss`: the accept rate users would lose on
average, were the canary in fact worse, weighted by how likely that is. It is computed exactly
(Evan Miller's sum for P(X > Y) of two Betas), not sampled. An equal canary at a 25% accept
rate gets there at 2 points with about 150 shown choices per arm; a canary that looks a few
points better, sooner; one that looks worse holds and is rolled back after `max_holds`. It
bounds the expected cost of a promotion, not the chance of a bad one, so it is the rule for a
demo or a small team's traffic, beside the guards above, which still roll back on significant
harm. `no_harm` keeps the oldest rule (a team that accepts the risk).

Each metric is tested at `alpha` on its own (no multiple-comparison correction): a false
alarm costs one rolled-back version, a missed regression costs users, so the controller errs
towards rolling back. The tolerances keep an equal candidate far from the rejection region.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from statistics import NormalDist
from typing import Any

ADVANCE, HOLD, PROMOTE, ROLLBACK = "advance", "hold", "promote", "rollback"
NON_INFERIOR, EXPECTED_LOSS, NO_HARM = "non_inferior", "expected_loss", "no_harm"
PROMOTE_RULES = (NON_INFERIOR, EXPECTED_LOSS, NO_HARM)


# --- distributions ------------------------------------------------------------------------------


def normal_sf(z: float) -> float:
    """P(Z > z) for a standard normal Z."""
    return 0.5 * math.erfc(z / math.sqrt(2.0))


def t_sf(t: float, df: float) -> float:
    """P(T > t) for Student's t with `df` (> 0, not necessarily whole) degrees of freedom."""
    if math.isinf(df):
        return normal_sf(t)
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))  # P(|T| > |t|) / 2
    return tail if t >= 0 else 1.0 - tail


def betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b), by its continued fraction (Lentz)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    # The fraction converges fast for x < (a + 1) / (a + b + 2); use the symmetry otherwise.
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _beta_fraction(a, b, x) / a
    return 1.0 - math.exp(log_front) * _beta_fraction(b, a, 1.0 - x) / b


def _beta_fraction(a: float, b: float, x: float, eps: float = 1e-15, max_iter: int = 10_000) -> float:
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, max_iter + 1):
        m2 = 2 * m
        for num in (
            m * (b - m) * x / ((a + m2 - 1.0) * (a + m2)),
            -(a + m) * (a + b + m) * x / ((a + m2) * (a + m2 + 1.0)),
        ):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            return h
    return h  # not reached for the arguments the t tail uses


def _log_beta(a: float, b: float) -> float:
    return math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)


def beta_greater(a1: int, b1: int, a2: int, b2: int) -> float:
    """P(X > Y) for independent X ~ Beta(a1, b1) and Y ~ Beta(a2, b2), whole positive parameters:
    the sum over i < a1 of B(a2 + i, b1 + b2) / ((b1 + i) B(1 + i, b1) B(a2, b2)) (Evan Miller,
    "Formulas for Bayesian A/B testing"), summed over the smaller of a1 and a2 (P(X > Y) = 1 - P(Y > X))."""
    if a2 < a1:
        return 1.0 - beta_greater(a2, b2, a1, b1)
    lb2 = _log_beta(a2, b2)
    total = math.fsum(
        math.exp(_log_beta(a2 + i, b1 + b2) - math.log(b1 + i) - _log_beta(1 + i, b1) - lb2) for i in range(a1)
    )
    return min(max(total, 0.0), 1.0)


# --- tests ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TestResult:
    """One one-sided test of "canary worse than stable by more than `margin`".

    `diff` is canary minus stable on the metric's own scale; `harm` is how much worse the
    canary looks (positive: worse), before the margin; `p` is the one-sided p-value.
    """

    canary: float
    stable: float
    diff: float
    margin: float
    stat: float | None
    p: float
    df: float | None = None


def two_proportion_ztest(
    x_c: int,
    n_c: int,
    x_s: int,
    n_s: int,
    *,
    margin: float = 0.0,
    higher_is_better: bool = True,
    ratio: float = 1.0,
) -> TestResult:
    """Is the canary's rate `x_c / n_c` worse than stable's `x_s / n_s` by more than `margin`?
    With `ratio` r (higher is better only): is it below r times stable's, less `margin`?

    Without a margin or a ratio, the pooled z-test. With one, the difference (canary's rate
    against r times stable's) and its standard error are Agresti and Caffo's (one success and
    one failure added to each arm): the plain Wald standard error is 0 for an arm at 0% or 100%,
    and at a canary's first few shown choices (0 accepted of 8 against 7 of 34) it called a
    difference significant (p = 0.004) that an exact test does not (p = 0.17)."""
    assert n_c > 0 and n_s > 0, "each arm needs observations"
    assert higher_is_better or ratio == 1.0, "a ratio bounds a rate that should not fall"
    p_c, p_s = x_c / n_c, x_s / n_s
    if margin == 0.0 and ratio == 1.0:
        harm = (p_s - p_c) if higher_is_better else (p_c - p_s)
        pooled = (x_c + x_s) / (n_c + n_s)
        se = math.sqrt(pooled * (1.0 - pooled) * (1.0 / n_c + 1.0 / n_s))
    else:
        a_c, a_s = (x_c + 1) / (n_c + 2), (x_s + 1) / (n_s + 2)
        harm = (ratio * a_s - a_c) if higher_is_better else (a_c - a_s)
        se = math.sqrt(a_c * (1.0 - a_c) / (n_c + 2) + ratio**2 * a_s * (1.0 - a_s) / (n_s + 2))
    z, p = _one_sided(harm - margin, se)
    return TestResult(canary=p_c, stable=p_s, diff=p_c - p_s, margin=margin, stat=z, p=p)


def welch_ttest(
    mean_c: float,
    var_c: float,
    n_c: int,
    mean_s: float,
    var_s: float,
    n_s: int,
    *,
    margin: float = 0.0,
    higher_is_better: bool = True,
) -> TestResult:
    """Is the canary's mean worse than stable's by more than `margin`? (sample variances, n >= 2 each)"""
    assert n_c >= 2 and n_s >= 2, "Welch's test needs two observations per arm"
    harm = (mean_s - mean_c) if higher_is_better else (mean_c - mean_s)
    v_c, v_s = var_c / n_c, var_s / n_s
    se = math.sqrt(v_c + v_s)
    if se == 0.0:
        z, p = _one_sided(harm - margin, 0.0)
        return TestResult(canary=mean_c, stable=mean_s, diff=mean_c - mean_s, margin=margin, stat=z, p=p, df=None)
    df = (v_c + v_s) ** 2 / (v_c**2 / (n_c - 1) + v_s**2 / (n_s - 1))
    t = (harm - margin) / se
    return TestResult(canary=mean_c, stable=mean_s, diff=mean_c - mean_s, margin=margin, stat=t, p=t_sf(t, df), df=df)


def _one_sided(excess: float, se: float) -> tuple[float | None, float]:
    """(z, P(Z > z)) for an observed excess harm; with no spread the observation is the answer."""
    if se == 0.0:
        return None, 0.0 if excess > 0 else 1.0
    z = excess / se
    return z, normal_sf(z)


# --- decisions ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Arm:
    """One version's traffic in a time window, as read from SQL."""

    completions: int = 0
    p99_latency_ms: float | None = None
    log_latency_mean: float | None = None  # mean of ln(latency_ms)
    log_latency_var: float | None = None  # its sample variance
    choices: int = 0
    errors: int = 0
    choices_shown: int = 0
    """Of `choices` (each user's first `max_per_user`), those shown: the suggestion rate's numerator.
    `shown` caps each user's shown choices on their own, so it is not a share of `choices`."""
    shown: int = 0
    accepted: int = 0
    rewards: int = 0
    reward_mean: float | None = None
    reward_var: float | None = None
    pinned: int = 0
    """Completions served for requests that pinned this version: not in any count above."""
    capped_shown: int = 0
    """Shown choices beyond `Policy.max_per_user` of one user: not in `shown` / `accepted`."""
    capped_rewards: int = 0
    """Rewards beyond `Policy.max_per_user` of one user: not in `rewards`."""


@dataclass(frozen=True)
class Policy:
    """What a rollout guards and how strictly; stored with the rollout (rollouts.min_samples and
    rollouts.thresholds), so a restarted controller applies the policy the rollout began with."""

    min_samples: int = 200
    alpha: float = 0.05
    max_holds: int = 30
    require_reward: bool = False
    accept_rate_drop: float = 0.02
    accept_rate_loss: float = 0.005
    """`expected_loss`: the largest expected loss of accept rate, absolute, a promotion may carry."""
    suggestion_rate_ratio: float = 0.5
    """The suggestion rate is harmed below this share of stable's (less `suggestion_rate_drop`)."""
    suggestion_rate_drop: float = 0.0
    reward_drop: float = 0.05
    error_rate_increase: float = 0.01
    p99_latency_ratio: float = 1.5
    max_per_user: int = 20
    """Most samples of each kind (completions, choices, shown choices, rewards) one user
    contributes to an arm in a step (ops/rollout/arms.py): no single client decides a rollout."""
    promote_rule: str = NON_INFERIOR
    """What the last step needs to promote: `non_inferior` (the accept rate shown to be within
    `accept_rate_drop` of stable's), `expected_loss` (the expected loss of accept rate at most
    `accept_rate_loss`) or `no_harm` (no metric significantly worse)."""

    def __post_init__(self) -> None:
        if self.promote_rule not in PROMOTE_RULES:
            raise ValueError(f"promote_rule must be one of {', '.join(PROMOTE_RULES)}, not {self.promote_rule!r}")

    def thresholds(self) -> dict[str, Any]:
        """The JSON kept in rollouts.thresholds (everything but min_samples, which has its own column)."""
        d = asdict(self)
        d.pop("min_samples")
        return d

    @classmethod
    def from_row(cls, min_samples: int, thresholds: dict[str, Any]) -> Policy:
        known = {k: v for k, v in thresholds.items() if k in cls.__dataclass_fields__ and k != "min_samples"}
        known.setdefault("promote_rule", NO_HARM)  # a rollout begun before the rule existed keeps its rule
        known.setdefault("suggestion_rate_ratio", 1.0)  # ... and before the ratio, its absolute tolerance
        return cls(min_samples=min_samples, **known)


@dataclass(frozen=True)
class Decision:
    action: str
    """advance | hold | promote | rollback"""
    rule: str
    """What fired: a metric name, `min_samples`, `insufficient_traffic` or `no_harm`."""
    reason: str
    """One line for people."""
    evidence: dict[str, Any] = field(default_factory=dict)


def decide(canary: Arm, stable: Arm, policy: Policy, *, holds: int, last_step: bool) -> Decision:
    """What to do with a rollout step, given each arm's traffic since the step began.

    1. Every metric with at least `min_samples` observations in both arms is tested; any that
       is significantly worse (p < alpha beyond its tolerance, latency included) rolls back. Guards act as soon as they have their samples, also while
       the step still waits for the primary metric.
    2. Otherwise, until the accept rate (and with `require_reward` the mean reward) has
       `min_samples` in both arms, the step holds; after `max_holds` holds it rolls back
       ("insufficient traffic") rather than wait forever.
    3. Otherwise the canary advances to the next weight. After the last one it is promoted,
       under `promote_rule = "non_inferior"` only once its accept rate is shown to be within
       `accept_rate_drop` of stable's (`non_inferiority`), under `expected_loss` once the expected
       loss of promoting it is at most `accept_rate_loss` (`expected_loss`); until then the step
       holds, and after `max_holds` holds it rolls back.
    """
    tests = metric_tests(canary, stable, policy)
    evidence = {
        "arms": {"canary": asdict(canary), "stable": asdict(stable)},
        "tests": tests,
        "policy": asdict(policy),
        "holds": holds,
    }
    harmful = [name for name, t in tests.items() if t.get("worse")]
    if harmful:
        reason = "; ".join(_describe(name, tests[name], policy) for name in harmful)
        return _decision(ROLLBACK, harmful[0], f"canary is worse: {reason}", evidence)

    required = ["accept_rate"] + (["reward"] if policy.require_reward else [])
    short = [name for name in required if not tests[name]["tested"]]
    if short:
        need = ", ".join(
            f"{_SAMPLE_NAMES[n]}: canary {tests[n]['n'][0]}, stable {tests[n]['n'][1]} of {policy.min_samples}"
            for n in short
        )
        if holds >= policy.max_holds:
            return _decision(
                ROLLBACK, "insufficient_traffic", f"insufficient traffic after {holds} holds ({need})", evidence
            )
        return _decision(
            HOLD, "min_samples", f"waiting for samples ({need}); hold {holds + 1} of {policy.max_holds}", evidence
        )

    passed = ", ".join(_describe(name, t, policy) for name, t in tests.items() if t["tested"])
    if not last_step:
        return _decision(ADVANCE, "no_harm", f"no significant harm ({passed})", evidence)
    rule = policy.promote_rule
    if rule == NO_HARM:
        return _decision(PROMOTE, "no_harm", f"no significant harm at the last step ({passed})", evidence)
    if rule == EXPECTED_LOSS:
        el = evidence["expected_loss"] = expected_loss(
            canary.accepted, canary.shown, stable.accepted, stable.shown, policy
        )
        ok = el["within"]
        detail = (
            f"expected loss {el['loss']:.2%} if promoted (at most {el['threshold']:.2%}), "
            f"P(canary better) {el['p_better']:.0%}"
        )
    else:
        ni = evidence["non_inferiority"] = non_inferiority(
            canary.accepted, canary.shown, stable.accepted, stable.shown, policy
        )
        ok = ni["shown"]
        detail = (
            f"its drop is at most {ni['drop_upper']:+.1%} ({1 - policy.alpha:.0%} upper bound), "
            f"margin {policy.accept_rate_drop:.1%}"
        )
    shown = (
        f"accept rate {canary.accepted / canary.shown:.1%} of {canary.shown} vs "
        f"{stable.accepted / stable.shown:.1%} of {stable.shown}: {detail}"
    )
    hold_rule, rollback_rule, promoted, waiting, not_promoted = _LAST_STEP[rule]
    if ok:
        return _decision(PROMOTE, rule, f"{promoted} at the last step ({shown}; {passed})", evidence)
    if holds >= policy.max_holds:
        return _decision(ROLLBACK, rollback_rule, f"{not_promoted} after {holds} holds ({shown})", evidence)
    return _decision(HOLD, hold_rule, f"{waiting} ({shown}); hold {holds + 1} of {policy.max_holds}", evidence)


_LAST_STEP = {
    # rule: (its hold's rule, its rollback's rule, promoted, still holding, rolled back)
    NON_INFERIOR: (
        "non_inferiority",
        "not_non_inferior",
        "non-inferior",
        "waiting for evidence the canary is not worse",
        "not shown non-inferior",
    ),
    EXPECTED_LOSS: (
        "expected_loss",
        "expected_loss_high",
        "expected loss within its bound",
        "waiting for the expected loss to fall",
        "expected loss still above its bound",
    ),
}
"""The words of the last step's outcomes under each promote rule that asks for evidence."""


def non_inferiority(x_c: int, n_c: int, x_s: int, n_s: int, policy: Policy) -> dict[str, Any]:
    """Is the canary's accept rate `x_c / n_c` shown to be no more than `accept_rate_drop` below
    stable's `x_s / n_s`? The one-sided test of H0: drop >= margin, on Agresti and Caffo's
    adjusted rates (one success and one failure added to each arm), whose interval keeps its
    coverage where the plain Wald one collapses: with no accepts in either arm Wald's standard
    error is 0, and 0 of 8 against 0 of 8 would "show" non-inferiority. `shown` when p < alpha,
    which is when the (1 - alpha) upper confidence bound of the drop, `drop_upper`, lies below
    the margin."""
    assert n_c > 0 and n_s > 0, "each arm needs observations"
    a_c, a_s = (x_c + 1) / (n_c + 2), (x_s + 1) / (n_s + 2)
    drop, margin = a_s - a_c, policy.accept_rate_drop
    se = math.sqrt(a_c * (1.0 - a_c) / (n_c + 2) + a_s * (1.0 - a_s) / (n_s + 2))
    z, p = _one_sided(margin - drop, se)
    upper = drop + NormalDist().inv_cdf(1.0 - policy.alpha) * se
    return {
        "canary": x_c / n_c,
        "stable": x_s / n_s,
        "drop": drop,  # of the adjusted rates
        "drop_upper": upper,
        "margin": margin,
        "stat": z,
        "p": p,
        "alpha": policy.alpha,
        "shown": p < policy.alpha,
    }


_EXACT_UP_TO = 20_000


def _beta_var(a: float, b: float) -> float:
    return a * b / ((a + b) ** 2 * (a + b + 1.0))


def expected_loss(x_c: int, n_c: int, x_s: int, n_s: int, policy: Policy) -> dict[str, Any]:
    """The expected loss of accept rate if the canary (`x_c` accepted of `n_c` shown) replaces
    stable (`x_s` of `n_s`): E[max(S - C, 0)] under uniform priors, C ~ Beta(x_c + 1, n_c - x_c + 1)
    and S likewise. As E[S 1{S > C}] = E[S] P(S+ > C) with S+ ~ Beta(a_s + 1, b_s) (and so for C),
    it is E[S] P(S+ > C) - E[C] P(S > C+), both exact; past 20,000 accepted (and not accepted) per
    arm, the normal approximation of the two posteriors. `within` when it is at most `accept_rate_loss`."""
    assert 0 <= x_c <= n_c and 0 <= x_s <= n_s, "accepted must lie between 0 and shown"
    a_c, b_c, a_s, b_s = x_c + 1, n_c - x_c + 1, x_s + 1, n_s - x_s + 1
    mean_c, mean_s = a_c / (a_c + b_c), a_s / (a_s + b_s)
    if min(a_c, b_c, a_s, b_s) > _EXACT_UP_TO:  # both posteriors normal to within rounding; the sum grows with them
        d = mean_s - mean_c
        sd = math.sqrt(_beta_var(a_c, b_c) + _beta_var(a_s, b_s))
        loss, p_better = d * NormalDist().cdf(d / sd) + sd * NormalDist().pdf(d / sd), normal_sf(d / sd)
    else:
        loss = mean_s * beta_greater(a_s + 1, b_s, a_c, b_c) - mean_c * beta_greater(a_s, b_s, a_c + 1, b_c)
        p_better = beta_greater(a_c, b_c, a_s, b_s)
    loss = max(loss, 0.0)  # rounding, where the canary is far better
    return {
        "canary": x_c / n_c if n_c else None,
        "stable": x_s / n_s if n_s else None,
        "loss": loss,
        "threshold": policy.accept_rate_loss,
        "p_better": p_better,
        "within": loss <= policy.accept_rate_loss,
    }


_SAMPLE_NAMES = {
    "accept_rate": "shown choices",
    "reward": "rewards",
    "suggestion_rate": "choices",
    "error_rate": "choices",
    "latency": "completions",
}


def metric_tests(canary: Arm, stable: Arm, policy: Policy) -> dict[str, dict[str, Any]]:
    """Each metric's test as JSON-ready evidence: n per arm, values, statistic, p, and `worse`."""
    k = policy.min_samples
    out: dict[str, dict[str, Any]] = {}

    n = (canary.shown, stable.shown)
    if min(n) >= k:
        t = two_proportion_ztest(
            canary.accepted, canary.shown, stable.accepted, stable.shown, margin=policy.accept_rate_drop
        )
        out["accept_rate"] = _tested(t, n, policy.alpha)
    else:
        out["accept_rate"] = _untested(
            n, _rate(canary.accepted, canary.shown), _rate(stable.accepted, stable.shown), policy.accept_rate_drop
        )

    n = (canary.rewards, stable.rewards)
    if min(n) >= max(k, 2) and canary.reward_mean is not None and stable.reward_mean is not None:
        c, s = (
            (canary.reward_mean, canary.reward_var or 0.0, canary.rewards),
            (stable.reward_mean, stable.reward_var or 0.0, stable.rewards),
        )
        t = welch_ttest(*c, *s, margin=policy.reward_drop)
        out["reward"] = _tested(t, n, policy.alpha)
    else:
        out["reward"] = _untested(n, canary.reward_mean, stable.reward_mean, policy.reward_drop)

    n = (canary.choices, stable.choices)
    if min(n) >= k:
        t = two_proportion_ztest(
            canary.choices_shown,
            canary.choices,
            stable.choices_shown,
            stable.choices,
            margin=policy.suggestion_rate_drop,
            ratio=policy.suggestion_rate_ratio,
        )
        out["suggestion_rate"] = _tested(t, n, policy.alpha)
    else:
        out["suggestion_rate"] = _untested(
            n,
            _rate(canary.choices_shown, canary.choices),
            _rate(stable.choices_shown, stable.choices),
            policy.suggestion_rate_drop,
        )

    if min(n) >= k:
        margin = policy.error_rate_increase
        t = two_proportion_ztest(
            canary.errors, canary.choices, stable.errors, stable.choices, margin=margin, higher_is_better=False
        )
        out["error_rate"] = _tested(t, n, policy.alpha)
    else:
        out["error_rate"] = _untested(
            n, _rate(canary.errors, canary.choices), _rate(stable.errors, stable.choices), policy.error_rate_increase
        )

    n = (canary.completions, stable.completions)
    c99, s99 = canary.p99_latency_ms, stable.p99_latency_ms
    limit = policy.p99_latency_ratio
    quantiles = {"canary_p99_ms": c99, "stable_p99_ms": s99, "threshold": limit}
    if min(n) >= max(k, 2) and canary.log_latency_mean is not None and stable.log_latency_mean is not None:
        t = welch_ttest(
            canary.log_latency_mean,
            canary.log_latency_var or 0.0,
            n[0],
            stable.log_latency_mean,
            stable.log_latency_var or 0.0,
            n[1],
            margin=math.log(limit),
            higher_is_better=False,
        )
        out["latency"] = _tested(t, n, policy.alpha) | quantiles | {"ratio": math.exp(t.diff)}
    else:
        out["latency"] = {
            "tested": False,
            "n": list(n),
            "ratio": None,
            "stat": None,
            "p": None,
            "worse": False,
        } | quantiles
    return out


def _tested(t: TestResult, n: tuple[int, int], alpha: float) -> dict[str, Any]:
    return {"tested": True, "n": list(n), **asdict(t), "alpha": alpha, "worse": t.p < alpha}


def _untested(n: tuple[int, int], canary: float | None, stable: float | None, margin: float) -> dict[str, Any]:
    diff = canary - stable if canary is not None and stable is not None else None
    return {
        "tested": False,
        "n": list(n),
        "canary": canary,
        "stable": stable,
        "diff": diff,
        "margin": margin,
        "stat": None,
        "p": None,
        "worse": False,
    }


def _rate(x: int, n: int) -> float | None:
    return x / n if n else None


def _describe(name: str, t: dict[str, Any], policy: Policy) -> str:
    if name == "latency":
        cmp = " < " if t["p"] < policy.alpha else " >= "
        return (
            f"latency x{t['ratio']:.2f} of stable's (geometric mean; limit x{t['threshold']:.2f}, p={t['p']:.2g}{cmp}{policy.alpha:g}; "
            f"p99 {t['canary_p99_ms']:.0f} vs {t['stable_p99_ms']:.0f} ms)"
        )
    label = {
        "accept_rate": "accept rate",
        "reward": "mean reward",
        "suggestion_rate": "suggestion rate",
        "error_rate": "error rate",
    }[name]
    if name == "reward":
        values = f"{t['canary']:.3f} vs {t['stable']:.3f}"
    else:
        values = f"{t['canary']:.1%} vs {t['stable']:.1%}"
    p = t["p"]
    return f"{label} {values} (p={p:.2g}{' < ' if p < policy.alpha else ' >= '}{policy.alpha:g})"


def _decision(action: str, rule: str, reason: str, evidence: dict[str, Any]) -> Decision:
    return Decision(
        action=action, rule=rule, reason=reason, evidence=json_safe({**evidence, "rule": rule, "decision": action})
    )


def json_safe(value: Any) -> Any:
    """Evidence as strict JSON: non-finite floats (an infinite latency ratio) become None."""
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    return str(value)
