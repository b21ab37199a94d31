"""Rewards for every event pattern, against values computed by hand (issue 5, acceptance 5)."""

from datetime import UTC, datetime, timedelta

import pytest

from feedback.reward import ChoiceFeedback, Event, RewardWeights, reward, similarity

T0 = datetime(2026, 1, 1, tzinfo=UTC)
TEXT = "hello world"  # 11 characters


def ev(type_, select_kind=None, accepted_chars=None, kept_text=None, at=0):
    return Event(type_, select_kind, accepted_chars, kept_text, T0 + timedelta(seconds=at))


VIEW, DISMISS = ev("view"), ev("dismiss")
FULL = ev("select", "full")

# (case, events, text, n_chars, weights, expected reward, expected outcome)
CASES = [
    ("empty completion", [VIEW, FULL], "", 0, None, 0.0, "no_suggestion"),
    ("no events", [], TEXT, 11, None, 0.0, "unseen"),
    ("view only: ignored", [VIEW], TEXT, 11, None, -0.25, "ignored"),
    ("dismissed", [VIEW, DISMISS], TEXT, 11, None, -0.25, "dismiss"),
    ("full accept", [VIEW, FULL], TEXT, 11, None, 0.75, "select"),
    ("full accept, count given", [ev("select", "full", 11)], TEXT, 11, None, 0.75, "select"),
    ("full accept, client counted 4", [ev("select", "full", 4)], TEXT, 11, None, 0.75 * 4 / 11, "select"),
    ("word accept 'hello'", [VIEW, ev("select", "word", 5)], TEXT, 11, None, 0.75 * 5 / 11, "select"),
    ("two word accepts add up", [ev("select", "word", 5), ev("select", "word", 6)], TEXT, 11, None, 0.75, "select"),
    (
        "partial accepts capped at whole",
        [ev("select", "line", 8), ev("select", "line", 8)],
        TEXT,
        11,
        None,
        0.75,
        "select",
    ),
    ("partial accept, unknown count", [ev("select", "line")], TEXT, 11, None, 0.0, "select"),
    (
        "word accept then dismiss: select wins",
        [ev("select", "word", 5), DISMISS],
        TEXT,
        11,
        None,
        0.75 * 5 / 11,
        "select",
    ),
    ("edit kept verbatim", [FULL, ev("edit", kept_text=TEXT)], TEXT, 11, None, 0.75, "edit"),
    # "hello world" vs "hello there": matching blocks "hello " (6) and "r" (1): 2*7/22.
    ("edit to 'hello there'", [FULL, ev("edit", kept_text="hello there")], TEXT, 11, None, 0.75 * 14 / 22, "edit"),
    # "hello world" vs "hello": one block of 5: 2*5/16.
    ("edit to 'hello'", [FULL, ev("edit", kept_text="hello")], TEXT, 11, None, 0.75 * 10 / 16, "edit"),
    ("edit deleted everything", [FULL, ev("edit", kept_text="")], TEXT, 11, None, 0.0, "edit"),
    ("edit beats dismiss", [DISMISS, ev("edit", kept_text=TEXT)], TEXT, 11, None, 0.75, "edit"),
    (
        "last edit wins",
        [ev("edit", kept_text=TEXT, at=9), ev("edit", kept_text="", at=3)],
        TEXT,
        11,
        None,
        0.75,
        "edit",
    ),
    ("edit after retention: counts as accept", [ev("edit", kept_text="x")], None, 11, None, 0.75, "select"),
    (
        "edit whose kept text was dropped: its select",
        [ev("select", "word", 5), ev("edit")],
        TEXT,
        11,
        None,
        0.75 * 5 / 11,
        "select",
    ),
    ("custom dismiss weight", [DISMISS], TEXT, 11, RewardWeights(dismissed=-1.0), -1.0, "dismiss"),
    (
        "custom accept weight, partial",
        [ev("select", "word", 5)],
        TEXT,
        11,
        RewardWeights(accepted=1.0),
        5 / 11,
        "select",
    ),
    (
        "edit below min_similarity",
        [ev("edit", kept_text="hello there")],
        TEXT,
        11,
        RewardWeights(min_similarity=0.7),
        0.0,
        "edit",
    ),
    ("custom ignored weight", [VIEW], TEXT, 11, RewardWeights(ignored=0.0), 0.0, "ignored"),
    ("custom unseen weight", [], TEXT, 11, RewardWeights(unseen=-0.1), -0.1, "unseen"),
]


@pytest.mark.parametrize("case, events, text, n_chars, weights, expected, outcome", CASES, ids=[c[0] for c in CASES])
def test_reward_table(case, events, text, n_chars, weights, expected, outcome):
    r, parts = reward(ChoiceFeedback(n_chars=n_chars, text=text, events=events), weights)
    assert r == pytest.approx(expected, abs=1e-9)
    assert parts["outcome"] == outcome
    assert parts["n_events"] == len(events)


def test_a_withheld_suggestion_scores_as_unseen_whatever_the_events_say():
    """The confidence gate kept it from the editor (learner/confidence.py): nobody saw it."""
    for events in ([], [VIEW, FULL], [VIEW, DISMISS]):
        r, parts = reward(ChoiceFeedback(0, "", events, withheld=True), RewardWeights(unseen=-0.1, no_suggestion=0.3))
        assert (r, parts["outcome"]) == (-0.1, "withheld")


def test_components_explain_the_reward():
    _, parts = reward(ChoiceFeedback(11, TEXT, [ev("select", "line")]))
    assert parts == {"outcome": "select", "fraction": 0.0, "n_events": 1, "unknown_partial": 1}
    _, parts = reward(ChoiceFeedback(11, TEXT, [ev("edit", kept_text="hello")]))
    assert parts == {"outcome": "edit", "similarity": 0.625, "n_events": 1}


def test_similarity_bounds():
    assert similarity("abc", "abc") == 1.0
    assert similarity("abc", "xyz") == 0.0
    assert similarity("", "") == 1.0


def test_reward_is_pure():
    choice = ChoiceFeedback(11, TEXT, (FULL,))
    assert reward(choice) == reward(choice)


def _indented_code(module, chars: int) -> str:
    """Deeply indented source: few distinct characters, the matcher's slowest realistic input."""
    import inspect
    import textwrap

    text = textwrap.indent(inspect.getsource(module), " " * 24)
    return (text * (chars // len(text) + 1))[:chars]


def test_a_100k_character_kept_text_is_scored_in_well_under_a_second():
    """The sink computes rewards in its single loop: one slow edit holds up all ingestion.
    SequenceMatcher over a 2,000-character suggestion and this 100,000-character kept text
    took 11 to 17 s on a 2-core machine before the bound (its time grows with the product of the lengths)."""
    import difflib
    import json.decoder
    import time

    suggested, kept = _indented_code(difflib, 2_000), _indented_code(json.decoder, 100_000)
    t0 = time.perf_counter()
    r, parts = reward(ChoiceFeedback(len(suggested), suggested, [FULL, ev("edit", kept_text=kept)]))
    elapsed = time.perf_counter() - t0
    assert elapsed < 2.0, f"scoring one edit took {elapsed:.1f}s"
    assert parts["outcome"] == "edit" and 0.0 <= parts["similarity"] < 0.05  # rewritten: little kept
    assert r == pytest.approx(0.75 * parts["similarity"], abs=1e-6)


@pytest.mark.parametrize("extra", [100_000 - 2_000, 10_000])
def test_long_kept_texts_still_score_what_they_share_with_the_suggestion(extra):
    """Beyond the exact budget the common start and end are matched directly: a suggestion kept
    verbatim, with a lot typed after it, scores as SequenceMatcher scores it (2*len(a) / total)."""
    import difflib

    suggested = _indented_code(difflib, 2_000)
    kept = suggested + "x = 1\n" * (extra // 6)
    assert similarity(suggested, kept) == pytest.approx(2 * len(suggested) / (len(suggested) + len(kept)))
    edited = suggested[:1000] + "changed" + suggested[1007:] + "\n" * extra  # 7 characters replaced
    expected = 2 * (len(suggested) - 7) / (len(suggested) + len(edited))
    assert similarity(suggested, edited) == pytest.approx(expected, abs=2e-4)


def test_similarity_stays_exact_within_the_budget_and_bounded_beyond():
    import difflib
    import random

    rng = random.Random(5)
    for _ in range(60):
        a = "".join(rng.choice("ab c\n") for _ in range(rng.randint(0, 600)))
        b = "".join(rng.choice("ab c\n") for _ in range(rng.randint(0, 600)))
        exact = difflib.SequenceMatcher(None, a, b, autojunk=False).ratio()
        assert similarity(a, b) == exact  # under the budget: difflib's ratio, unchanged
    for _ in range(10):
        a = "".join(rng.choice("ab c\n") for _ in range(rng.randint(1_001, 3_000)))
        b = "".join(rng.choice("ab c\n") for _ in range(rng.randint(1_001, 3_000)))
        assert 0.0 <= similarity(a, b) < 1.0 and similarity(a, b + "") == similarity(a, b)
        assert similarity(a, a[:-1]) == pytest.approx(2 * (len(a) - 1) / (2 * len(a) - 1))
