"""The canary's statistics against hand-computed numbers, and the decision rules."""

import dataclasses
import json
import math
import random

import pytest

from ops.rollout.stats import (
    ADVANCE,
    HOLD,
    PROMOTE,
    ROLLBACK,
    Arm,
    Policy,
    beta_greater,
    decide,
    expected_loss,
    non_inferiority,
    normal_sf,
    t_sf,
    two_proportion_ztest,
    welch_ttest,
)


def test_normal_tail():
    assert normal_sf(0.0) == pytest.approx(0.5)
    assert normal_sf(1.6448536) == pytest.approx(0.05, abs=1e-7)
    assert normal_sf(-1.959964) == pytest.approx(0.975, abs=1e-7)


@pytest.mark.parametrize(
    "t, df, p",
    [
        (2.0, 10, 0.036694),  # tables: two-sided 0.0734 for t = 2, 10 df
        (2.228139, 10, 0.025),  # the 97.5% quantile of t(10)
        (12.7062, 1, 0.025),  # t(1) 97.5% quantile
        (2.0, 1, 0.5 - math.atan(2.0) / math.pi),  # t(1) is Cauchy
        (0.0, 7, 0.5),
        (-2.0, 10, 1 - 0.036694),
    ],
)
def test_student_t_tail(t, df, p):
    assert t_sf(t, df) == pytest.approx(p, abs=2e-6)


def test_t_tail_approaches_normal():
    assert t_sf(1.96, 1e6) == pytest.approx(normal_sf(1.96), abs=1e-6)


def test_two_proportion_pooled_by_hand():
    # 45/100 vs 55/100: pooled p = 0.5, se = sqrt(0.25 * (1/100 + 1/100)) = sqrt(0.005), z = 0.1 / se = sqrt(2)
    t = two_proportion_ztest(45, 100, 55, 100)
    assert t.stat == pytest.approx(math.sqrt(2))
    assert t.p == pytest.approx(0.5 * math.erfc(1.0))  # = 0.0786496
    assert t.p == pytest.approx(0.0786496, abs=1e-7)
    assert t.diff == pytest.approx(-0.10)


def test_two_proportion_with_margin_uses_agresti_caffo():
    # 46/102 vs 56/102: se = sqrt(2 * (46/102) * (56/102) / 102) = 0.0696767;
    # z = (10/102 - 0.02) / se = 1.120019
    t = two_proportion_ztest(45, 100, 55, 100, margin=0.02)
    assert t.stat == pytest.approx(1.120019, abs=1e-6)
    assert t.p == pytest.approx(0.131353, abs=1e-5)
    assert (t.canary, t.stable) == (0.45, 0.55)  # reported as observed
    # a canary at 0 of 8 against 7 of 34: the Wald se would be stable's alone (z = 2.68, p = 0.004)
    small = two_proportion_ztest(0, 8, 7, 34, margin=0.02)
    assert small.p > 0.05 and small.stat == pytest.approx(
        (8 / 36 - 1 / 10 - 0.02) / math.sqrt(0.1 * 0.9 / 10 + (8 / 36) * (28 / 36) / 36)
    )


def test_two_proportion_lower_is_better():
    # errors 8/100 vs 2/100: pooled 0.05, se = sqrt(.05 * .95 * .02) = 0.0308221, z = 0.06 / se = 1.946657
    t = two_proportion_ztest(8, 100, 2, 100, higher_is_better=False)
    assert t.stat == pytest.approx(1.946657, abs=1e-6)
    assert t.p == pytest.approx(0.025788, abs=1e-5)
    better = two_proportion_ztest(2, 100, 8, 100, higher_is_better=False)
    assert better.p == pytest.approx(1 - t.p)


def test_two_proportion_without_spread():
    assert two_proportion_ztest(0, 50, 0, 50, higher_is_better=False).p == 1.0  # no errors anywhere: no evidence
    # all vs none: no spread in either arm, still overwhelming evidence (Agresti-Caffo's se is not 0)
    assert two_proportion_ztest(50, 50, 0, 50, margin=0.1, higher_is_better=False).p < 1e-100


def test_welch_by_hand():
    # v_c = .04/50 = .0008, v_s = .09/60 = .0015; se = sqrt(.0023); t = 0.1 / se = 2.085144
    # df = .0023^2 / (.0008^2/49 + .0015^2/59) = 103.3267
    t = welch_ttest(0.1, 0.04, 50, 0.2, 0.09, 60)
    assert t.stat == pytest.approx(2.085144, abs=1e-6)
    assert t.df == pytest.approx(103.3267, abs=1e-3)
    assert t.p == pytest.approx(0.019760, abs=1e-5)
    assert t.p > normal_sf(t.stat)  # Student's tail is heavier than the normal's
    shifted = welch_ttest(0.1, 0.04, 50, 0.2, 0.09, 60, margin=0.05)
    assert shifted.stat == pytest.approx(0.05 / math.sqrt(0.0023))


# --- decisions ------------------------------------------------------------------------------------

POLICY = Policy(min_samples=100, alpha=0.05, max_holds=3)


def arm(
    shown=1000,
    rate=0.4,
    choices=None,
    errors=0,
    rewards=None,
    reward_mean=0.1,
    reward_var=0.2,
    p99=100.0,
    latency=50.0,
    log_sd=0.5,
):
    choices = choices if choices is not None else shown
    return Arm(
        completions=choices,
        p99_latency_ms=p99,
        choices=choices,
        errors=errors,
        choices_shown=shown,
        shown=shown,
        accepted=round(shown * rate),
        rewards=rewards if rewards is not None else choices,
        reward_mean=reward_mean,
        reward_var=reward_var,
        log_latency_mean=math.log(latency),
        log_latency_var=log_sd**2,
    )


def test_equal_arms_advance_then_promote():
    d = decide(arm(), arm(), POLICY, holds=0, last_step=False)
    assert (d.action, d.rule) == (ADVANCE, "no_harm")
    json.dumps(d.evidence, allow_nan=False)  # strict JSON for the evidence column
    assert d.evidence["tests"]["accept_rate"]["tested"] and d.evidence["tests"]["accept_rate"]["p"] > 0.05
    # 1,000 shown choices an arm at 40%: the drop's upper bound (3.6 points) is above the margin
    last = decide(arm(), arm(), POLICY, holds=0, last_step=True)
    assert (last.action, last.rule) == (HOLD, "non_inferiority") and "hold 1 of 3" in last.reason
    big = decide(arm(shown=6000), arm(shown=6000), POLICY, holds=0, last_step=True)
    assert (big.action, big.rule) == (PROMOTE, "non_inferior") and big.evidence["non_inferiority"]["shown"]
    json.dumps(big.evidence, allow_nan=False)
    no_harm = dataclasses.replace(POLICY, promote_rule="no_harm")
    assert decide(arm(), arm(), no_harm, holds=0, last_step=True).action == PROMOTE


def test_promotion_needs_the_canary_shown_non_inferior_not_just_harm_not_shown():
    """The demo's case: 3 of 28 shown accepted against 14 of 105 passed "no significant harm" and
    was promoted. Non-inferiority holds it, and rolls it back once its holds are spent."""
    policy = Policy(min_samples=8, alpha=0.05, max_holds=3)
    thin_c, thin_s = Arm(shown=28, accepted=3), Arm(shown=105, accepted=14)
    assert (
        decide(thin_c, thin_s, dataclasses.replace(policy, promote_rule="no_harm"), holds=0, last_step=True).action
        == PROMOTE
    )
    d = decide(thin_c, thin_s, policy, holds=0, last_step=True)
    ni = d.evidence["non_inferiority"]
    assert (d.action, d.rule) == (HOLD, "non_inferiority") and not ni["shown"] and ni["drop_upper"] > 0.10
    assert "10.7% of 28 vs 13.3% of 105" in d.reason
    d = decide(thin_c, thin_s, policy, holds=3, last_step=True)
    assert (d.action, d.rule) == (ROLLBACK, "not_non_inferior") and "after 3 holds" in d.reason


@pytest.mark.parametrize(
    "x_c, n_c, x_s, n_s, shown",
    [
        (120, 1200, 120, 1200, False),  # 10% each: the bound (2.02 points) just misses the 2-point margin
        (130, 1300, 130, 1300, True),  # a little more traffic shows it
        (0, 8, 0, 8, False),  # nothing accepted anywhere: Wald's interval would be 0 wide
        (0, 400, 0, 400, True),
        (500, 2000, 400, 2000, True),  # better than stable
        (380, 2000, 400, 2000, False),  # 1 point worse: the bound reaches past 2
    ],
)
def test_non_inferiority_bound(x_c, n_c, x_s, n_s, shown):
    r = non_inferiority(x_c, n_c, x_s, n_s, Policy())
    assert r["shown"] == shown and (r["drop_upper"] < r["margin"]) == shown
    a_c, a_s = (x_c + 1) / (n_c + 2), (x_s + 1) / (n_s + 2)  # Agresti-Caffo, by hand
    se = math.sqrt(a_c * (1 - a_c) / (n_c + 2) + a_s * (1 - a_s) / (n_s + 2))
    assert r["drop_upper"] == pytest.approx(a_s - a_c + 1.6448536 * se)


def test_a_canary_that_shows_nothing_rolls_back_on_its_suggestion_rate():
    """The demo's injected fault (lm_head negated) shows nothing: the accept rate never gets a
    shown choice, so without this guard it only rolled back, slowly, for insufficient traffic."""
    policy = Policy(min_samples=8)
    silent = Arm(completions=16, choices=16, choices_shown=0, shown=0)
    stable = Arm(completions=30, choices=30, choices_shown=12, shown=12, accepted=3)
    d = decide(silent, stable, policy, holds=0, last_step=False)
    t = d.evidence["tests"]["suggestion_rate"]
    assert (d.action, d.rule) == (ROLLBACK, "suggestion_rate") and t["worse"] and t["canary"] == 0.0
    assert "suggestion rate 0.0% vs 40.0%" in d.reason
    fewer = arm(shown=120, choices=1000)  # under a third of stable's 40%: beyond half, significantly
    assert decide(fewer, arm(shown=400, choices=1000), POLICY, holds=0, last_step=False).rule == "suggestion_rate"


def test_learning_to_abstain_is_not_harm_to_the_suggestion_rate():
    """A show policy withholds what users would dismiss: 40% to 23% in one demo run, 17 points,
    more than the absolute 15-point tolerance this guard had, which therefore rolled policies back
    whenever a small sample leaned its way (2 shown of 17 against 9 of 14 at a first look, p =
    0.016). The guard is relative now: harm is a rate significantly below half of stable's."""

    def worse(c, s, policy=Policy(min_samples=8)) -> bool:
        return decide(c, s, policy, holds=0, last_step=False).evidence["tests"]["suggestion_rate"]["worse"]

    policy_like = arm(shown=230, choices=1000)  # 23% against 40%, many choices: not harm
    assert not worse(policy_like, arm(shown=400, choices=1000))
    first_look = Arm(completions=17, choices=17, choices_shown=2, shown=2, accepted=1)
    lucky_stable = Arm(completions=14, choices=14, choices_shown=9, shown=9, accepted=1)
    assert not worse(first_look, lucky_stable)  # z = -1.5 against half of stable's: p = 0.07
    # the same test by hand: Agresti-Caffo rates, the canary's against half of stable's
    a_c, a_s = 3 / 19, 10 / 16
    se = math.sqrt(a_c * (1 - a_c) / 19 + 0.25 * a_s * (1 - a_s) / 16)
    t = two_proportion_ztest(2, 17, 9, 14, ratio=0.5)
    assert t.stat == pytest.approx((0.5 * a_s - a_c) / se) and 0.05 < t.p < 0.1
    # A rollout begun before the ratio keeps its absolute tolerance, and there the first look is harm.
    old = Policy.from_row(8, {"suggestion_rate_drop": 0.15, "promote_rule": "expected_loss"})
    assert old.suggestion_rate_ratio == 1.0 and worse(first_look, lucky_stable, old)


@pytest.mark.parametrize(
    "a1, b1, a2, b2, p",
    [
        (1, 1, 1, 1, 1 / 2),
        (2, 1, 1, 1, 2 / 3),  # the integral of x * 2x over [0, 1]
        (1, 2, 1, 1, 1 / 3),
        (3, 1, 1, 1, 3 / 4),  # the integral of x * 3x^2
        (2, 1, 2, 1, 1 / 2),
        (1, 1, 2, 1, 1 / 3),  # summed the other way round (a2 < a1 swaps)
    ],
)
def test_beta_greater_against_hand_computed_integrals(a1, b1, a2, b2, p):
    assert beta_greater(a1, b1, a2, b2) == pytest.approx(p, abs=1e-12)


def test_expected_loss_by_hand_and_by_sampling():
    # nothing observed: two uniforms, E[max(S - C, 0)] = E|S - C| / 2 = 1/6
    r = expected_loss(0, 0, 0, 0, Policy())
    assert r["loss"] == pytest.approx(1 / 6, abs=1e-12) and r["p_better"] == pytest.approx(0.5)
    # Monte Carlo with a fixed seed: the difference's sd is at most 0.14 here (the two Beta variances
    # summed), so the mean of 200,000 draws has a standard error under 0.14 / sqrt(200,000) = 3.2e-4;
    # five of them bound the check.
    rng = random.Random(0)
    for x_c, n_c, x_s, n_s in [(17, 66, 12, 54), (5, 20, 9, 22)]:
        draws = [
            max(rng.betavariate(x_s + 1, n_s - x_s + 1) - rng.betavariate(x_c + 1, n_c - x_c + 1), 0.0)
            for _ in range(200_000)
        ]
        assert expected_loss(x_c, n_c, x_s, n_s, Policy())["loss"] == pytest.approx(sum(draws) / len(draws), abs=1.6e-3)
    # past 20,000 accepted per arm the normal approximation takes over, continuously
    exact = expected_loss(19_990, 70_000, 19_990, 70_000, Policy())
    approx = expected_loss(20_010, 70_000, 20_010, 70_000, Policy())
    assert approx["loss"] == pytest.approx(exact["loss"], rel=2e-3) and approx["p_better"] == pytest.approx(0.5)


def test_expected_loss_rule_promotes_at_demo_traffic_only_what_looks_no_worse():
    """About 60 shown choices per arm, as the demo's last step gathers: a canary that looks better
    promotes at a 2-point expected loss, an equal one needs more traffic, a worse one rolls back."""
    policy = Policy(min_samples=8, max_holds=3, promote_rule="expected_loss", accept_rate_loss=0.02)
    better = decide(Arm(shown=66, accepted=17), Arm(shown=54, accepted=12), policy, holds=0, last_step=True)
    el = better.evidence["expected_loss"]
    assert (better.action, better.rule) == (PROMOTE, "expected_loss") and 0.015 < el["loss"] < 0.02
    assert "25.8% of 66 vs 22.2% of 54" in better.reason and el["p_better"] > 0.5
    equal = decide(Arm(shown=60, accepted=15), Arm(shown=60, accepted=15), policy, holds=0, last_step=True)
    assert (equal.action, equal.rule) == (HOLD, "expected_loss") and equal.evidence["expected_loss"]["loss"] > 0.02
    more = decide(Arm(shown=200, accepted=50), Arm(shown=200, accepted=50), policy, holds=1, last_step=True)
    assert more.action == PROMOTE  # an equal canary, once each arm has ~150 shown choices
    worse = decide(Arm(shown=60, accepted=11), Arm(shown=60, accepted=15), policy, holds=3, last_step=True)
    assert (worse.action, worse.rule) == (ROLLBACK, "expected_loss_high") and "after 3 holds" in worse.reason
    assert not worse.evidence["expected_loss"]["within"]
    json.dumps(better.evidence, allow_nan=False)


def test_a_rollout_recorded_before_the_rule_keeps_no_harm():
    assert Policy.from_row(200, {"alpha": 0.05}).promote_rule == "no_harm"
    assert Policy.from_row(200, Policy().thresholds()).promote_rule == "non_inferior"
    with pytest.raises(ValueError, match="promote_rule"):
        Policy(promote_rule="hope")


def test_worse_accept_rate_rolls_back():
    d = decide(arm(rate=0.30), arm(rate=0.40), POLICY, holds=0, last_step=False)
    assert (d.action, d.rule) == (ROLLBACK, "accept_rate")
    assert d.evidence["tests"]["accept_rate"]["p"] < 0.05 and "accept rate 30.0% vs 40.0%" in d.reason


def test_a_significant_drop_within_tolerance_is_not_harm():
    big = 200_000  # 39.5% vs 40% is significant at this n, but inside the 2-point tolerance
    d = decide(arm(shown=big, rate=0.395), arm(shown=big, rate=0.40), POLICY, holds=0, last_step=False)
    assert d.action == ADVANCE
    assert two_proportion_ztest(round(big * 0.395), big, round(big * 0.4), big).p < 0.05


def test_too_few_samples_hold_then_roll_back():
    few = arm(shown=40)
    d = decide(few, arm(), POLICY, holds=0, last_step=False)
    assert (d.action, d.rule) == (HOLD, "min_samples")
    assert "canary 40" in d.reason and not d.evidence["tests"]["accept_rate"]["tested"]
    d = decide(few, arm(), POLICY, holds=3, last_step=False)
    assert (d.action, d.rule) == (ROLLBACK, "insufficient_traffic")


def test_guards_act_before_the_primary_metric_has_its_samples():
    # few shown suggestions yet, but plenty of aborted choices
    d = decide(
        arm(shown=10, choices=500, errors=100), arm(shown=10, choices=500, errors=2), POLICY, holds=0, last_step=False
    )
    assert (d.action, d.rule) == (ROLLBACK, "error_rate")


def test_slower_canary_rolls_back_and_a_p99_spike_alone_does_not():
    d = decide(arm(latency=200.0, p99=400.0), arm(latency=50.0), POLICY, holds=0, last_step=False)
    assert (d.action, d.rule) == (ROLLBACK, "latency")
    t = d.evidence["tests"]["latency"]
    assert t["ratio"] == pytest.approx(4.0) and t["p"] < 0.05 and t["canary_p99_ms"] == 400.0
    assert (
        decide(arm(latency=65.0), arm(latency=50.0), POLICY, holds=0, last_step=False).action == ADVANCE
    )  # x1.3 < x1.5
    # one queueing spike makes the canary's p99 4x stable's, but its latencies are stable's
    assert decide(arm(p99=400.0), arm(p99=100.0), POLICY, holds=0, last_step=False).action == ADVANCE
    # x2 with a handful of very noisy samples is not evidence yet
    few = decide(
        arm(latency=100.0, log_sd=2.0, shown=100),
        arm(latency=50.0, log_sd=2.0, shown=100),
        POLICY,
        holds=0,
        last_step=False,
    )
    assert few.action == ADVANCE and few.evidence["tests"]["latency"]["p"] > 0.05


def test_worse_reward_rolls_back_and_can_be_required():
    d = decide(arm(reward_mean=-0.1), arm(reward_mean=0.1), POLICY, holds=0, last_step=False)
    assert (d.action, d.rule) == (ROLLBACK, "reward")
    assert d.evidence["tests"]["reward"]["df"] > 1
    no_rewards = arm(rewards=0, reward_mean=None, reward_var=None)
    assert decide(no_rewards, arm(), POLICY, holds=0, last_step=False).action == ADVANCE  # reward lags: not required
    strict = Policy(min_samples=100, require_reward=True)
    assert decide(no_rewards, arm(), strict, holds=0, last_step=False).action == HOLD


def test_policy_round_trips_through_the_rollout_row():
    p = Policy(min_samples=50, alpha=0.01, max_holds=4, reward_drop=0.1)
    assert Policy.from_row(50, json.loads(json.dumps(p.thresholds() | {"mode": "canary"}))) == p
