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
