"""Implicit feedback: whether a suggestion was kept, read from the next request in the same file.

Editor plugins that send no events (Continue, llama.vscode, Ollama clients) still send the
code around the cursor with every request. When the next request from the same user and file
arrives, the text at the previous request's cursor says what became of its suggestion:

  1. find the old cursor in the new text: the end of the text that stood before it (`before`),
     anchored on its last characters and lengthened until it occurs once; edits elsewhere in the
     file do not move it, an anchor that occurs nowhere or more than once is not judged;
  2. `here` = the new text from that point on; the suggestion is
       - kept fully when `here` starts with all of it,
       - kept partly when `here` starts with its first words (whole words, at least one that is
         not blank; its first line is one such case), `accepted_chars` of them,
       - not kept otherwise.

A kept stretch must end where a word of the suggestion ends and the user's text does not go on
with the same word: `r` suggested before `return` typed is not a kept `r` (typing and accepting
look alike), nor is `ret` of a suggested `return` a partial accept. Such a stretch, inside a word,
is not judged (`mid_word`); a kept blank (a lone space) is not an accept. A suggestion that is
blank is not judged, nor one whose kept stretch already stood after the cursor (`after` starts
with it: the text says nothing about the suggestion), nor one that runs past the end of the new
text's window.

Everything here is pure: the sink (feedback/sink/ingest.py `infer_feedback`) gathers the
previous completions and the new requests' text and records what this returns.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

MIN_ANCHOR = 24
"""Characters of the text before the old cursor the search starts with (doubled while ambiguous)."""

_WORD = re.compile(r"\s*(?:\w+|[^\w\s])")  # a word: an identifier or one punctuation mark, after any blanks

Outcome = Literal["full", "partial", "none"]
NotJudged = Literal["blank", "no_anchor", "anchor_missing", "anchor_ambiguous", "mid_word", "already_there", "window"]


@dataclass(frozen=True)
class Judgement:
    """What the next request says of a suggestion: an `outcome` with the characters kept, or
    `outcome` None and the reason it could not be judged (`not_judged`)."""

    outcome: Outcome | None
    accepted_chars: int = 0
    select_kind: Literal["full", "line", "word"] | None = None
    not_judged: NotJudged | None = None


def find_cursor(before: str, text: str) -> tuple[int | None, NotJudged | None]:
    """Where the old cursor is in `text`: (index just after the unique occurrence of `before`'s
    tail, None), or (None, why not)."""
    if not before.strip():
        return None, "no_anchor"
    size = min(MIN_ANCHOR, len(before))
    while True:
        anchor = before[-size:]
        first = text.find(anchor)
        if first < 0:
            return None, "anchor_missing" if size == min(MIN_ANCHOR, len(before)) else "anchor_ambiguous"
        if text.find(anchor, first + 1) < 0:
            return first + len(anchor), None
        if size == len(before):
            return None, "anchor_ambiguous"
        size = min(2 * size, len(before))


def kept_prefix(suggestion: str, here: str) -> int:
    """Characters of `suggestion` that `here` starts with, cut back to where one of its words ends
    (and `here` does not go on with the same word): 0 when no whole word was kept."""
    if not suggestion:
        return 0
    ends = [m.end() for m in _WORD.finditer(suggestion)]
    if not ends or ends[-1] != len(suggestion):
        ends.append(len(suggestion))  # trailing blanks belong to the whole suggestion
    for k in reversed(ends):
        if not here.startswith(suggestion[:k]):
            continue
        if k < len(here) and _is_word(suggestion[k - 1]) and _is_word(here[k]):
            continue  # the user's word goes on: `return` typed, not `r` kept
        return k
    return 0


def judge_next(suggestion: str, before: str, after: str, new_before: str, new_after: str) -> Judgement:
    """Judge `suggestion`, served with `before` | `after` around the cursor, from the next
    request's text `new_before` | `new_after` (see the module docstring)."""
    if not suggestion.strip():
        return Judgement(None, not_judged="blank")
    text = new_before + new_after
    at, why = find_cursor(before, text)
    if at is None:
        return Judgement(None, not_judged=why)
    here = text[at:]
    if len(here) < len(suggestion) and suggestion.startswith(here):
        return Judgement(None, not_judged="window")  # the new text ends inside the suggestion
    k = kept_prefix(suggestion, here)
    kept = suggestion[:k]
    if not kept.strip():
        if _common_prefix(suggestion, here).strip():
            return Judgement(None, not_judged="mid_word")
        return Judgement("none")
    if after.startswith(kept):
        return Judgement(None, not_judged="already_there")
    if k == len(suggestion):
        return Judgement("full", k, "full")
    first_line = suggestion.split("\n", 1)[0]
    return Judgement("partial", k, "line" if kept.rstrip() == first_line.rstrip() else "word")


def _is_word(ch: str) -> bool:
    return ch.isalnum() or ch == "_"


def _common_prefix(a: str, b: str) -> str:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return a[:n]
