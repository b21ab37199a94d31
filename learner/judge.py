"""What a simulated editor user does: where the cursor goes in a held-out file, and what the
user keeps of a suggestion there.

Each site is a cursor inside a non-trivial line of a real file: the prefix is the code before
the cursor, the suffix the code after the line, the truth the rest of that line. With
`cursor="in_brackets"` the cursor sits instead inside the brackets that close the line, as an
editor that auto-closes brackets leaves it: the suffix then begins with the closing bracket and
the truth is what goes between. `judge()`
accepts what matches the truth (all of it, its first line, or its first words) and dismisses
the rest; `editor_events()` is what the editor then reports about the suggestion. All are
pure, so the simulated editors (ops/simulate.py), which send those events over HTTP, and the
held-out replay (learner/eval.py), which scores them as the sink would, judge and report
suggestions the same way.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

from feedback.reward import Event
from learner.corpus import SourceFile

_WORD = re.compile(r"\s*(?:\w+|[^\w\s])")  # a word: an identifier or one punctuation mark


@dataclass(frozen=True)
class Site:
    """One cursor position in a file: what the editor sends, and what the user would type."""

    path: str
    language: str | None
    prefix: str
    suffix: str
    truth: str


@dataclass(frozen=True)
class Verdict:
    """What the simulated user does with a suggestion."""

    type: str  # select | dismiss | none (nothing shown)
    select_kind: str | None = None
    accepted_chars: int = 0
    kept_text: str | None = None


CURSORS = ("end_of_line", "in_brackets")
_OPEN, _CLOSE = "([{", ")]}"


def cursor_sites(
    files: Sequence[SourceFile], n: int, rng: random.Random, *, min_chars: int = 4, cursor: str = "end_of_line"
) -> list[Site]:
    """n cursor positions: inside a non-trivial line, after its leading indentation and a few
    characters (`end_of_line`: nothing after the cursor on its line), or inside the innermost
    bracket pair that closes the line (`in_brackets`: the closing bracket after the cursor)."""
    if cursor not in CURSORS:
        raise ValueError(f"cursor must be one of {', '.join(CURSORS)}, not {cursor!r}")
    pick = _site if cursor == "end_of_line" else _bracket_site
    sites: list[Site] = []
    candidates = [f for f in files if f.text.count("\n") > 5]
    attempts = 0
    while len(sites) < n and candidates and attempts < n * 50:
        attempts += 1
        f = rng.choice(candidates)
        lines = f.text.splitlines(keepends=True)
        site = pick(f, lines, rng.randrange(1, len(lines)), rng, min_chars)
        if site is not None:
            sites.append(site)
    return sites


def file_walks(
    files: Sequence[SourceFile], n: int, rng: random.Random, *, per_file: int = 8, max_gap: int = 3, min_chars: int = 4
) -> list[list[Site]]:
    """Walks down files, n sites in all: each walk is one file's cursor positions in order, 1 to
    `max_gap` lines apart (more where blank or comment lines lie between), up to `per_file` of them,
    as an editor moves down a file it writes.

    The simulated user completes each line before moving on (it keeps what it accepted and types
    the rest of the line, or types the line itself after a dismiss), so each site's prefix holds
    every earlier line whole: the next request carries what became of the previous suggestion."""
    walks: list[list[Site]] = []
    candidates = [f for f in files if f.text.count("\n") > 5]
    total, attempts = 0, 0
    while total < n and candidates and attempts < n * 50:
        attempts += 1
        f = rng.choice(candidates)
        lines = f.text.splitlines(keepends=True)
        i, walk = rng.randrange(1, len(lines)), []
        while i < len(lines) and len(walk) < min(per_file, n - total):
            site = _site(f, lines, i, rng, min_chars)
            if site is not None:
                walk.append(site)
                i += rng.randint(1, max_gap)
            else:
                i += 1
        if walk:
            walks.append(walk)
            total += len(walk)
    return walks


def _site(f: SourceFile, lines: list[str], i: int, rng: random.Random, min_chars: int) -> Site | None:
    """The cursor inside line i (None for a trivial or comment line)."""
    line = lines[i]
    body = line.strip()
    if len(body) < min_chars + 4 or body.startswith("#"):
        return None
    indent = len(line) - len(line.lstrip())
    cut = indent + rng.randint(min_chars // 2, max(min_chars // 2, len(body) // 2))
    prefix = "".join(lines[:i]) + line[:cut]
    truth = line[cut:].rstrip("\n")
    suffix = "\n" + "".join(lines[i + 1 :])
    return Site(f.path, f.language, prefix, suffix, truth)


def _bracket_site(f: SourceFile, lines: list[str], i: int, rng: random.Random, min_chars: int) -> Site | None:
    """The cursor inside the innermost bracket pair that closes line i (`foo(a, |b)` in
    `x = foo(a, b)` or `def f(|x, y):`), at least `min_chars` before the closing bracket; None
    where the line is a comment or no such pair holds a word."""
    line = lines[i]
    body = line.rstrip()
    if body.lstrip().startswith("#"):
        return None
    end = len(body.rstrip(":;,"))
    close = end
    while close > 0 and body[close - 1] in _CLOSE:
        close -= 1
    if close == end:
        return None
    depth, opener = 0, None
    for k in range(close, -1, -1):  # the opener of the closing run's first (innermost) bracket
        ch = body[k]
        if ch in _CLOSE:
            depth += 1
        elif ch in _OPEN:
            depth -= 1
            if depth == 0:
                opener = k
                break
    if opener is None or _OPEN.index(body[opener]) != _CLOSE.index(body[close]):
        return None
    if close - opener - 1 < min_chars or not re.search(r"\w", body[opener + 1 : close]):
        return None
    cut = rng.randint(opener + 1, close - min_chars)
    prefix = "".join(lines[:i]) + line[:cut]
    suffix = line[close:] + "".join(lines[i + 1 :])
    return Site(f.path, f.language, prefix, suffix, line[cut:close])


def judge(suggestion: str, truth: str) -> Verdict:
    """Accept what matches the true continuation: all of it, its first line, or its first words."""
    if not suggestion:
        return Verdict("none")
    first_line = suggestion.split("\n", 1)[0]
    if truth.startswith(first_line) and first_line == suggestion:
        return Verdict("select", "full", len(suggestion), suggestion)
    if first_line and truth.startswith(first_line):
        return Verdict("select", "line", len(first_line), first_line)
    kept = ""
    for m in _WORD.finditer(suggestion):
        if not truth.startswith(kept + m.group()):
            break
        kept += m.group()
    if kept.strip():
        return Verdict("select", "word", len(kept), kept)
    return Verdict("dismiss")


def editor_events(verdict: Verdict) -> tuple[Event, ...]:
    """The events the simulated editor sends about a suggestion it judged so: `view`, then for
    an accept `select` (its kind and accepted characters) and `edit` (the text kept), else
    `dismiss`; nothing for an empty suggestion, which is never shown."""
    if verdict.type == "select":
        return (
            Event("view"),
            Event("select", select_kind=verdict.select_kind, accepted_chars=verdict.accepted_chars),
            Event("edit", kept_text=verdict.kept_text),
        )
    if verdict.type == "dismiss":
        return (Event("view"), Event("dismiss"))
    return ()
