"""The show policy (learner/show.py): features, the fit, its manifest form, exploration, and how
it joins the confidence gate (learner/confidence.py)."""

import json
import math
import random

import pytest

from learner import show
from learner.confidence import withheld
from tests.helpers import logprob_policy as policy  # p = sigmoid(2 * (first_logprob + 1)), shown from 0.25


def test_features_read_the_logprobs_and_the_text():
    f = show.features([-0.1, -2.0, -0.3], "  foo()\n")
    assert len(f) == len(show.FEATURES)
    assert f[:5] == pytest.approx([-0.1, -0.8, -2.0, math.log(4), math.log(6)])
    with pytest.raises(ValueError, match="without tokens"):
        show.features([], "")


def context(text: str, line: str) -> dict[str, float]:
    return dict(zip(show.FEATURES, show.features([-0.5], text, line)))


def test_the_context_features_read_how_the_suggestion_meets_the_cursors_line():
    f = context("items):", "        for x in (")
    assert f["line_ends_in_open_bracket"] == 1.0 and f["line_ends_in_word"] == f["line_ends_in_space"] == 0.0
    assert f["line_indent"] == 2.0 and f["log_line_chars"] == pytest.approx(math.log1p(len("for x in (")))
    assert f["text_starts_with_word"] == 1.0 and f["text_starts_with_space"] == 0.0 and f["text_ends_a_clause"] == 1.0
    f = context(" = 3", "    value")
    assert f["line_ends_in_word"] == 1.0 and f["text_starts_with_space"] == 1.0 and f["text_ends_a_clause"] == 0.0
    assert context("x", "self.")["line_ends_in_dot"] == 1.0
    assert context("x", "a = ")["line_ends_in_space"] == 1.0 and context("x", "f(a,")["line_ends_in_operator"] == 1.0
    # the start of a line ends in nothing: no ending is set, and it has no length
    empty = context("return x", "")
    assert [empty[n] for n in show.CONTEXT_FEATURES[:7]] == [0.0] * 7
    # only the line's last MAX_LINE characters count, as serving and the learner both cut it
    long = "    " + "y" * 500
    assert context("x", long) == context("x", show.cursor_line(long)) == context("x", long[-show.MAX_LINE :])


def test_the_cursor_line_is_the_prefixs_last_line():
    assert show.cursor_line("def f():\n    return a.") == "    return a."
    assert show.cursor_line("x = 1\n") == "" and show.cursor_line("abc") == "abc" and show.cursor_line("") == ""
    assert len(show.cursor_line("z" * 1000)) == show.MAX_LINE


def test_a_policy_reads_the_features_it_names():
    """A policy fitted on the logprobs alone (as every one before the context features) applies
    as it was fitted; one with the context reads the cursor's line."""
    rng = random.Random(6)
    rows = []
    for _ in range(3000):  # accepted after a dot, dismissed after a space; the logprobs are noise
        lps = [-rng.expovariate(1.0) for _ in range(rng.randint(1, 6))]
        line = rng.choice(["    self.", "    x = "])
        rows.append([*show.features(lps, "name", line), float(rng.random() < (0.8 if line.endswith(".") else 0.1))])
    kw = dict(threshold=0.25, l2=0.01, min_samples=64, min_each=8)
    with_context = show.fit(rows, **kw)
    logprobs_only = show.fit(rows, names=show.LOGPROB_FEATURES, **kw)
    assert with_context.features == show.FEATURES and logprobs_only.features == show.LOGPROB_FEATURES
    assert len(logprobs_only.weights) == 5 and len(with_context.weights) == len(show.FEATURES)
    assert with_context.p_accept([-1.0], "name", "    self.") == pytest.approx(0.8, abs=0.05)
    assert with_context.p_accept([-1.0], "name", "    x = ") == pytest.approx(0.1, abs=0.05)
    assert with_context.shows([-1.0], "name", "a.") and not with_context.shows([-1.0], "name", "a = ")
    # the logprobs alone cannot tell the two apart: one chance near the mean for both lines
    both = {logprobs_only.p_accept([-1.0], "name", line) for line in ("    self.", "    x = ")}
    assert len(both) == 1 and both.pop() == pytest.approx(0.45, abs=0.1)
    assert show.ShowPolicy.from_dict(json.loads(json.dumps(logprobs_only.as_dict()))) == logprobs_only
    with pytest.raises(ValueError, match="reads some of"):
        show.fit(rows, names=("first_logprob", "line_colour"), **kw)


def test_the_label_is_an_accept_that_kept_something():
    assert show.accepted("select", 0.75) and show.accepted("edit", 0.3)
    assert not show.accepted("edit", 0.0)  # the user deleted all of it
    assert not show.accepted("dismiss", -0.25) and not show.accepted("ignored", -0.25)


def test_the_policy_shows_from_its_threshold():
    p = policy()
    # sigmoid(2 * (lp + 1)) = 0.25 at lp = -1 - ln(3) / 2
    edge = -1 - math.log(3) / 2
    assert p.p_accept([edge], "x") == pytest.approx(0.25)
    assert p.shows([edge + 0.01], "x") and not p.shows([edge - 0.01], "x")
    assert p.shows([], "") and p.shows([-9.0], "")  # nothing to withhold


def fake_outcomes(n: int, seed: int) -> list[list[float]]:
    """Suggestions accepted with chance sigmoid(1.5 * first_logprob + 0.5), the rest noise."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        lps = [-rng.expovariate(1.0) for _ in range(rng.randint(1, 12))]
        text = "x" * rng.randint(1, 40)
        p = 1 / (1 + math.exp(-(1.5 * lps[0] + 0.5)))
        rows.append([*show.features(lps, text), float(rng.random() < p)])
    return rows


def test_the_fit_recovers_the_chance_of_an_accept():
    p = show.fit(fake_outcomes(4000, seed=0), threshold=0.25, l2=0.0, min_samples=64, min_each=8)
    assert p is not None and p.samples == 4000 and 0 < p.accepts < 4000
    for lp in (-0.1, -1.0, -2.0):
        truth = 1 / (1 + math.exp(-(1.5 * lp + 0.5)))
        # 4,000 outcomes: the fitted chance's standard error is about 0.02; 0.06 is 3 of them
        assert p.p_accept([lp, -1.0], "xx") == pytest.approx(truth, abs=0.06)
    # the first logprob carries the signal: its weight dominates the others
    assert abs(p.weights[0]) > 3 * max(abs(w) for w in p.weights[1:])


def test_no_fit_on_too_few_outcomes():
    rows = fake_outcomes(200, seed=1)
    assert show.fit(rows[:63], threshold=0.25, l2=0.01, min_samples=64, min_each=8) is None
    no_accepts = [r[:-1] + [0.0] for r in rows]
    assert show.fit(no_accepts, threshold=0.25, l2=0.01, min_samples=64, min_each=8) is None
    with pytest.raises(ValueError, match="features and a label"):
        show.fit([r[:-2] + [1.0] for r in rows], threshold=0.25, l2=0.0, min_samples=1, min_each=1)


def test_a_policy_round_trips_through_json_and_bad_ones_are_refused():
    p = show.fit(fake_outcomes(500, seed=2), threshold=0.3, l2=0.01, min_samples=64, min_each=8, explore=0.1)
    again = show.ShowPolicy.from_dict(json.loads(json.dumps(p.as_dict())))
    assert again == p
    d = p.as_dict()
    for broken, message in (
        ({k: v for k, v in d.items() if k != "bias"}, "not a show policy"),
        (d | {"features": [*d["features"][:-1], "line_colour"]}, "not distinct ones of this version"),
        (d | {"features": [*d["features"][:-1], d["features"][0]]}, "not distinct ones"),
        (d | {"features": ["first_logprob"]}, "for each of its 1 features"),
        (d | {"weights": d["weights"][:2]}, "for each of its 15 features"),
        (d | {"scale": [0.0] * 15}, "scales positive"),
        (d | {"bias": float("nan")}, "finite"),
        (d | {"threshold": 1.5}, "threshold"),
        (d | {"explore": -0.1}, "explore"),
    ):
        with pytest.raises(ValueError, match=message):
            show.ShowPolicy.from_dict(broken)


def test_exploration_picks_a_fixed_share_of_completions():
    p = policy(explore=0.05)
    keys = [f"cmpl-{i}" for i in range(20_000)]
    share = sum(map(p.explores, keys)) / len(keys)
    # binomial: sd = sqrt(0.05 * 0.95 / 20000) = 0.0015; 5 of them
    assert share == pytest.approx(0.05, abs=0.0075)
    assert [p.explores(k) for k in keys[:50]] == [p.explores(k) for k in keys[:50]]  # the same every time
    assert not any(map(policy().explores, keys[:1000]))  # explore 0: never


def test_the_policy_withholds_only_what_the_gate_shows():
    p = policy()
    sure, unsure = [math.log(0.9)], [math.log(0.2)]
    assert not withheld(sure, 0.25, "x", p)
    assert withheld(unsure, 0.25, "x", None)  # the gate alone
    assert withheld([-3.0], 0.0, "x", p)  # the policy alone: p(-3) = sigmoid(-4) < 0.25
    assert not withheld([-3.0], 0.0, "x", None)
    assert not withheld([], 0.25, "", p)  # an abstention has nothing to withhold


def test_max_withheld_lowers_the_threshold_to_withhold_at_most_that_share():
    rows = fake_outcomes(2000, seed=3)
    plain = show.fit(rows, threshold=0.5, l2=0.01, min_samples=64, min_each=8)
    bounded = show.fit(rows, threshold=0.5, l2=0.01, min_samples=64, min_each=8, max_withheld=0.3)
    assert plain.threshold == 0.5 and bounded.threshold < 0.5 and bounded.weights == plain.weights

    def withheld_share(p: show.ShowPolicy) -> float:
        z = [p.bias + sum(w * (v - m) / s for w, v, m, s in zip(p.weights, r[:-1], p.mean, p.scale)) for r in rows]
        return sum(1 / (1 + math.exp(-x)) < p.threshold for x in z) / len(rows)

    assert withheld_share(plain) > 0.3  # at 0.5 it would withhold more
    assert 0.3 - 1 / len(rows) <= withheld_share(bounded) <= 0.3  # the highest threshold within the bound
    # a threshold already within the bound is kept
    assert show.fit(rows, threshold=0.01, l2=0.01, min_samples=64, min_each=8, max_withheld=0.3).threshold == 0.01


def test_the_bound_counts_what_the_last_policy_withheld():
    """What the last policy withheld has no outcome, but the gate showed it: the bound is a share
    of the gate's, so successive policies do not each withhold another 30% of what is left."""
    rows = fake_outcomes(2000, seed=4)
    kw = dict(threshold=0.5, l2=0.01, min_samples=64, min_each=8, max_withheld=0.3)
    alone = show.fit(rows, **kw)
    # the 600 suggestions the last policy withheld: the least likely of the same kind
    unshown = [r[:-1] for r in sorted(fake_outcomes(2000, seed=5), key=lambda r: r[0])[:600]]
    counted = show.fit(rows, withheld=unshown, **kw)
    assert counted.weights == alone.weights and counted.threshold < alone.threshold
    everything = [r[:-1] for r in rows] + unshown
    z = [
        counted.bias + sum(w * (v - m) / s for w, v, m, s in zip(counted.weights, f, counted.mean, counted.scale))
        for f in everything
    ]
    share = sum(1 / (1 + math.exp(-x)) < counted.threshold for x in z) / len(everything)
    assert 0.3 - 1 / len(everything) <= share <= 0.3


def test_max_accepts_withheld_keeps_what_users_would_have_taken():
    """The bound on accepts: of the accepted suggestions the policy was fitted on, it withholds
    at most that share, however many of the others it could drop at its threshold."""
    rows = fake_outcomes(2000, seed=7)
    kw = dict(threshold=0.5, l2=0.01, min_samples=64, min_each=8)
    plain = show.fit(rows, **kw)
    bounded = show.fit(rows, max_accepts_withheld=0.05, **kw)
    assert bounded.weights == plain.weights and bounded.threshold < plain.threshold

    def withheld_accepts(p: show.ShowPolicy) -> float:
        accepted = [r for r in rows if r[-1] == 1.0]
        z = [p.bias + sum(w * (v - m) / s for w, v, m, s in zip(p.weights, r[:-1], p.mean, p.scale)) for r in accepted]
        return sum(1 / (1 + math.exp(-x)) < p.threshold for x in z) / len(accepted)

    assert withheld_accepts(plain) > 0.05
    # the bound is over out-of-fold scores; on 2,000 outcomes of a model with a few weights they
    # are within a few rows of the fit's own (about 700 accepts: 0.02 is 14 of them)
    assert withheld_accepts(bounded) == pytest.approx(0.05, abs=0.02)
    # both bounds: the lower threshold of the two
    both = show.fit(rows, max_accepts_withheld=0.05, max_withheld=0.3, **kw)
    alone = show.fit(rows, max_withheld=0.3, **kw)
    assert both.threshold == min(bounded.threshold, alone.threshold)


def test_the_accepts_bound_keeps_a_repeated_suggestion_in_one_fold():
    """One suggestion at one cursor, requested again, is one row many times; a fit that saw one
    copy would score another as known, and the bound would withhold more than it says. Equal
    rows share a fold: repeating every outcome leaves the threshold where it was."""
    rows = fake_outcomes(300, seed=11)
    kw = dict(threshold=0.9, l2=0.01, min_samples=8, min_each=2, max_accepts_withheld=0.05)
    repeated = rows * 4
    random.Random(0).shuffle(repeated)
    assert show.fit(repeated, **kw).threshold == pytest.approx(show.fit(rows, **kw).threshold, rel=1e-9)
    # two distinct suggestions: each scored by a fit that never saw it, nothing known, nothing crashes
    two = show.fit([rows[0][:-1] + [1.0]] * 5 + [rows[1][:-1] + [0.0]] * 5, **kw)
    assert two is not None and 0 < two.threshold < 0.9
