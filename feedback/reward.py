"""The reward of one served choice, from the editor events about it: a pure function.

Defaults follow Cursor's Tab: an accepted suggestion earns +0.75, a rejected one -0.25, and
no suggestion (the model abstained: empty completion) earns 0, so the policy learns to
suggest only when it expects acceptance with probability above 0.25 / (0.75 + 0.25) = 25%.

Outcomes, in order of precedence (the first that applies decides):
  0. `withheld`: the confidence gate kept the suggestion from the editor (the record's
     finish_reason, learner/confidence.py). reward = unseen (0 by default): the user never saw
     it, so events about it (an implicit accept inferred from what the user typed) are ignored.
  1. `no_suggestion`: the choice is empty (`n_chars == 0`). Events about it are ignored.
  2. `edit`: the user accepted, then changed the text; an `edit` event carries what was kept.
     reward = accepted * similarity(suggested, kept), where similarity is difflib's
     `SequenceMatcher(None, suggested, kept, autojunk=False).ratio()`: 2*M / (len(a)+len(b)),
     M the characters of the matching blocks. Kept verbatim: 1.0; all deleted: 0.0. The
     matcher's time grows with len(a) * len(b), so beyond `EXACT_BUDGET` the texts' common
     start and end are matched directly and the matcher sees only a bounded window of what
     lies between (`similarity`): a kept text of 100,000 characters is scored in
     milliseconds, not the tens of seconds that held up the sink's single loop. The last
     `edit` (by created_at) wins: it is the latest view of what survived. The kept text is
     compared with the whole suggestion, also after a partial accept. When retention has
     dropped either text, the edit scores as a select: its selects, or a full accept.
  3. `select`: accepted. reward = accepted * fraction, fraction = min(1, accepted chars /
     n_chars). A `full` select accepts the whole suggestion (its `accepted_chars`, else
     `n_chars`); `line` / `word` selects add their `accepted_chars` (several partial accepts
     of one suggestion add up, capped at the whole). A partial select without
     `accepted_chars` adds 0: we know something was taken, not how much, and an unknown
     amount is not rewarded (counted in the components as `unknown_partial`).
  4. `dismiss`: rejected explicitly. reward = dismissed.
  5. `ignored`: shown (`view`) and neither accepted nor dismissed by the time the feedback
     window closed. Tab counts a suggestion the user typed past as a rejection, so the
     default is the same -0.25 (`ignored`).
  6. `unseen`: no events at all, e.g. the editor discarded it before showing it. reward =
     unseen (0 by default): nothing was learned about it.

Edit beats select because an `edit` follows the `select` it amends and says more; select
beats dismiss because accepting a word then dismissing the rest is a partial accept, which
the fraction already scores.

The caller (the sink) passes only the events inside the feedback window.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from pydantic import Field

from feedback.core.config import Section


class RewardWeights(Section):
    """Reward per outcome (section `[sink.reward]`); see the module docstring for the outcomes."""

    accepted: float = 0.75
    """Full accept; partial accepts and edits are scaled from it."""
    dismissed: float = -0.25
    """Explicit dismiss."""
    ignored: float = -0.25
    """Shown but neither accepted nor dismissed within the feedback window (Tab: a rejection)."""
    no_suggestion: float = 0.0
    """The model abstained (empty completion)."""
    unseen: float = 0.0
    """No events at all: never shown, so nothing learned."""
    min_similarity: float = Field(default=0.0, ge=0.0, le=1.0)
    """Edits whose similarity falls below this count as 0 (the user rewrote it)."""


@dataclass(frozen=True)
class Event:
    """The part of a FeedbackEvent (or an `events` row) the reward reads."""

    type: str
    select_kind: str | None = None
    accepted_chars: int | None = None
    kept_text: str | None = None
    created_at: datetime | None = None


@dataclass(frozen=True)
class ChoiceFeedback:
    """One served choice and the events about it inside its feedback window."""

    n_chars: int
    """len(text) as served; kept when retention drops the text."""
    text: str | None = None
    """The suggested text; None once retention dropped it (then an edit scores as a select)."""
    events: Sequence[Event] = field(default_factory=tuple)
    withheld: bool = False
    """The confidence gate kept it from the editor (finish_reason "withheld")."""


EXACT_BUDGET = 1_000_000
"""Largest len(a) * len(b) compared exactly: about 0.1 s in the worst case measured (few distinct
characters); a suggestion and its edit are far below it (256 tokens against their edit)."""
WINDOW = 1_000
"""Beyond the budget, the changed middle of the shorter text is cut to this many characters and
that of the longer one to twice as many (and 64): at most about 2e6, 0.3 s in the worst case."""


def similarity(suggested: str, kept: str) -> float:
    """difflib's ratio, 2*M / (len(a) + len(b)); 1.0 for two empty strings. Bounded in time.

    Exact (SequenceMatcher on the whole texts) while len(a) * len(b) <= EXACT_BUDGET. Beyond,
    M = the common prefix + the common suffix + SequenceMatcher's matches between what lies
    between them, each cut to its head and tail (`WINDOW`) so that their product stays bounded.
    The denominator is always the full lengths, so a long kept text still scores what it
    shares with the suggestion: characters outside the window count as unmatched (M is never
    more than the texts' longest common subsequence), and the result stays in [0, 1], 1.0 only
    for identical texts.
    """
    if suggested == kept:
        return 1.0
    if len(suggested) * len(kept) <= EXACT_BUDGET:
        return difflib.SequenceMatcher(None, suggested, kept, autojunk=False).ratio()
    head = _common_prefix(suggested, kept)
    tail = _common_prefix(suggested[head:][::-1], kept[head:][::-1])
    a, b = suggested[head : len(suggested) - tail], kept[head : len(kept) - tail]
    short, long_ = sorted((a, b), key=len)
    short = _window(short, WINDOW)
    # Room for all of `short` at either end of `long_`: where an edit's surviving text lies.
    long_ = _window(long_, 2 * len(short) + 64)
    matched = sum(m.size for m in difflib.SequenceMatcher(None, short, long_, autojunk=False).get_matching_blocks())
    return 2 * (head + tail + matched) / (len(suggested) + len(kept))


def _common_prefix(a: str, b: str) -> int:
    """Length of the common prefix, by bisection on slice equality (C-speed comparisons)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _window(text: str, size: int) -> str:
    """`text` if it is at most `size` characters, else its first and last size/2: an edit changes
    the suggestion near where the kept text starts to differ, or near where it rejoins it."""
    if len(text) <= size:
        return text
    return text[: size - size // 2] + text[len(text) - size // 2 :]


def reward(choice: ChoiceFeedback, weights: RewardWeights | None = None) -> tuple[float, dict[str, Any]]:
    """(reward, components) for one choice; components say which outcome applied and why."""
    w = weights or RewardWeights()
    by_type: dict[str, list[Event]] = {}
    for e in choice.events:
        by_type.setdefault(e.type, []).append(e)
    n_events = len(choice.events)

    if choice.withheld:
        return w.unseen, {"outcome": "withheld", "n_events": n_events}
    if choice.n_chars == 0:
        return w.no_suggestion, {"outcome": "no_suggestion", "n_events": n_events}

    if edits := by_type.get("edit"):
        last = max(edits, key=lambda e: (e.created_at is not None, e.created_at or 0))
        if choice.text is not None and last.kept_text is not None:
            sim = similarity(choice.text, last.kept_text)
            scale = sim if sim >= w.min_similarity else 0.0
            return w.accepted * scale, {"outcome": "edit", "similarity": round(sim, 6), "n_events": n_events}
        # Text already dropped by retention: the edit still proves an accept.

    # An edit that fell through (texts dropped) without any select counts as a full accept.
    if selects := by_type.get("select") or by_type.get("edit"):
        chars, unknown = 0, 0
        for e in selects:
            if e.type == "edit" or e.select_kind in (None, "full"):
                chars += choice.n_chars if e.accepted_chars is None else e.accepted_chars
            elif e.accepted_chars is None:
                unknown += 1
            else:
                chars += e.accepted_chars
        fraction = min(1.0, chars / choice.n_chars)
        parts = {"outcome": "select", "fraction": round(fraction, 6), "n_events": n_events}
        if unknown:
            parts["unknown_partial"] = unknown
        return w.accepted * fraction, parts

    if "dismiss" in by_type:
        return w.dismissed, {"outcome": "dismiss", "n_events": n_events}
    if "view" in by_type:
        return w.ignored, {"outcome": "ignored", "n_events": n_events}
    return w.unseen, {"outcome": "unseen", "n_events": n_events}
