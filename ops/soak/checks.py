"""What a soak must show, judged from evidence gathered after it (pure: numbers in, verdicts out).

The editors' own ledger (every call, its id, its HTTP status) is compared with SQL and the
weight store:

    completions  every completion an editor was served (200) is in SQL exactly once
    events       every event the API accepted (200) is stored exactly once, or dead-lettered
                 with a reason; none is left waiting
    http         no 5xx other than a 503, and a 503 only while a killed replica restarted
    versions     version numbers are contiguous from 0, each is both recorded and stored, its
                 stored manifest is the recorded sha256, and each verifies; a version the soak
                 damaged on purpose must fail
    serving      no replica swapped to or served a version that does not verify
    faults       every fault was injected and the loop came back (a skipped one says why)
    processes    the sink and the learner ended only when the soak killed them

Each verdict carries its evidence as counts, so a passing table says how much was checked.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from rich.table import Table

from ops.simulate import Call
from ops.soak.children import Exit
from ops.soak.faults import DONE, FAILED, SKIPPED, Fault


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    evidence: str


@dataclass(frozen=True)
class Swap:
    pool: str
    to_version: int
    ok: bool
    error: str | None


@dataclass
class Evidence:
    """Everything the checks read, gathered once after the loop stopped."""

    calls: Sequence[Call]
    faults: Sequence[Fault]
    completion_rows: Counter  # completion_id -> rows in `completions`
    served_by: Counter  # model_version -> rows in `completions` (all of the soak's database)
    event_rows: Counter  # event_id -> rows in `events`
    dead_letters: Mapping[str, list[str]]  # event_id -> the reasons of its dead letters
    pending: set[str]  # event ids still held in `pending_events`
    recorded: Mapping[int, str]  # model_versions: version -> sha256
    stored: Mapping[int, str]  # the weight store: version -> the sha256 in its STABLE marker
    verify_errors: Mapping[int, str | None]  # stored version -> None if it verified, else why not
    damaged: set[int]  # versions the soak damaged on purpose
    swaps: Sequence[Swap]
    processes: Mapping[str, tuple[int, list[Exit]]] = field(default_factory=dict)  # name -> (SIGKILLs, other exits)


def outstanding(calls: Sequence[Call], completion_rows, event_rows, dead_letters, pending) -> int:
    """Answered calls whose rows are not in SQL yet: served completions, and accepted events neither
    stored nor dead-lettered (or still held for their completion)."""
    served = {c.id for c in calls if c.kind == "completion" and c.status == 200}
    accepted = {c.id for c in calls if c.kind == "event" and c.status == 200}
    return sum(1 for i in served if not completion_rows[i]) + sum(
        1 for i in accepted if i in pending or (not event_rows[i] and i not in dead_letters)
    )


def check_all(ev: Evidence) -> list[Check]:
    return [
        completions(ev),
        events(ev),
        http(ev),
        versions(ev),
        serving(ev),
        faults(ev),
        processes(ev),
    ]


def completions(ev: Evidence) -> Check:
    served = {c.id for c in ev.calls if c.kind == "completion" and c.status == 200}
    missing = [i for i in served if ev.completion_rows[i] == 0]
    twice = [i for i in served if ev.completion_rows[i] > 1]
    unanswered = sum(1 for c in ev.calls if c.kind == "completion" and c.status is None)
    extra = sum(1 for i in ev.completion_rows if i not in served)
    evidence = (
        f"{len(served)} served (200); in SQL: {len(served) - len(missing)}; missing {len(missing)}; twice {len(twice)}"
    )
    if extra:
        evidence += (
            f"; {extra} more in SQL whose answer never reached the editor ({unanswered} calls without an answer)"
        )
    if missing:
        evidence += f"; e.g. {sorted(missing)[0]}"
    return Check(
        "completions: every one served is in SQL exactly once", bool(served) and not missing and not twice, evidence
    )


def events(ev: Evidence) -> Check:
    calls = [c for c in ev.calls if c.kind == "event"]
    sent = {c.id for c in calls}
    accepted = {c.id for c in calls if c.status == 200}
    stored_once = [i for i in accepted if ev.event_rows[i] == 1 and i not in ev.dead_letters]
    dead = [i for i in accepted if ev.event_rows[i] == 0 and i in ev.dead_letters]
    reasonless = [i for i in dead if not all(ev.dead_letters[i])]
    twice = [i for i in sent if ev.event_rows[i] > 1]
    both = [i for i in accepted if ev.event_rows[i] and i in ev.dead_letters]
    waiting = [i for i in accepted if i in ev.pending]
    missing = [i for i in accepted if ev.event_rows[i] == 0 and i not in ev.dead_letters]
    never = sent - accepted
    stored_anyway = sum(1 for i in never if ev.event_rows[i])
    reasons = Counter(r.split(":")[0] for i in dead for r in ev.dead_letters[i])
    retried = len(calls) - len(sent)
    evidence = (
        f"{len(sent)} sent in {len(calls)} calls ({retried} again under the same event_id); {len(accepted)} accepted: "
        f"{len(stored_once)} stored once, {len(dead)} dead-lettered"
        + (f" ({', '.join(f'{n} {r}' for r, n in reasons.most_common())})" if reasons else "")
        + f"; missing {len(missing)}, still held {len(waiting)}, twice {len(twice)}, stored and dead-lettered {len(both)}"
    )
    if never:
        evidence += f"; {len(never)} never accepted, {stored_anyway} of them stored (an answer lost on its way back)"
    ok = bool(accepted) and not (missing or twice or both or reasonless or waiting)
    return Check("events: each accepted one stored exactly once or dead-lettered with a reason", ok, evidence)


def http(ev: Evidence) -> Check:
    windows = [(f.started, f.expect_503_until) for f in ev.faults if f.expect_503_until is not None]

    def during_restart(c: Call) -> bool:
        return any(start <= c.ended and c.started <= until for start, until in windows)

    statuses = Counter(c.status for c in ev.calls if c.status is not None)
    unanswered = Counter(c.failure for c in ev.calls if c.status is None)
    bad = [
        c for c in ev.calls if c.status is not None and c.status >= 500 and not (c.status == 503 and during_restart(c))
    ]
    ok_503 = sum(1 for c in ev.calls if c.status == 503 and during_restart(c))
    shown = ", ".join(f"{s} x{n}" for s, n in sorted(statuses.items()))
    evidence = f"{len(ev.calls)} calls: {shown or 'none'}"
    if ok_503:
        evidence += f" ({ok_503} of the 503s while a killed replica restarted)"
    if unanswered:
        evidence += "; no answer: " + ", ".join(f"{r} x{n}" for r, n in unanswered.most_common())
    if bad:
        worst = Counter(c.status for c in bad)
        evidence += "; NOT ALLOWED: " + ", ".join(f"{s} x{n}" for s, n in sorted(worst.items()))
    return Check("http: no 5xx but a 503 while a replica restarted", bool(ev.calls) and not bad, evidence)


def versions(ev: Evidence) -> Check:
    recorded, stored = set(ev.recorded), set(ev.stored)
    top = max(recorded | stored, default=-1)
    gaps = sorted(set(range(top + 1)) - recorded)
    unstored, unrecorded = sorted(recorded - stored), sorted(stored - recorded)
    mismatch = sorted(v for v in recorded & stored if ev.recorded[v] != ev.stored[v])
    good = sorted(v for v in stored if ev.verify_errors.get(v) is None and v not in ev.damaged)
    broken = sorted(v for v in stored if ev.verify_errors.get(v) is not None and v not in ev.damaged)
    planted_ok = sorted(v for v in ev.damaged if v in stored and ev.verify_errors.get(v) is not None)
    planted_bad = sorted(v for v in ev.damaged if v not in planted_ok)
    evidence = (
        f"v0-v{top}: {len(recorded)} recorded, {len(stored)} stored; gaps {_vs(gaps)}; recorded not stored {_vs(unstored)}; "
        f"stored not recorded {_vs(unrecorded)}; sha256 differs {_vs(mismatch)}; {len(good)} verify (every file against its sha256, "
        f"every tensor against its hash)"
    )
    if planted_ok:
        evidence += f"; damaged on purpose and refused: {_vs(planted_ok)}"
    if broken:
        evidence += f"; FAIL to verify: {_vs(broken)} ({ev.verify_errors[broken[0]]})"
    if planted_bad:
        evidence += f"; damaged on purpose yet verifying: {_vs(planted_bad)}"
    ok = top >= 0 and not (gaps or unstored or unrecorded or mismatch or broken or planted_bad)
    return Check("versions: contiguous, recorded and stored, each verifies", ok, evidence)


def serving(ev: Evidence) -> Check:
    verified = {v for v, err in ev.verify_errors.items() if err is None} - ev.damaged
    swapped = [w for w in ev.swaps if w.ok]
    to_unverified = [w for w in swapped if w.to_version not in verified]
    at_damaged = [w for w in ev.swaps if w.to_version in ev.damaged]
    served_bad = {v: n for v, n in ev.served_by.items() if v not in verified}
    evidence = (
        f"{len(swapped)} swaps in place, {len(to_unverified)} to a version that does not verify; "
        f"{len(ev.swaps) - len(swapped)} refused"
    )
    if ev.damaged:
        refused = sum(1 for w in at_damaged if not w.ok)
        evidence += f" ({refused} of {len(at_damaged)} attempts at {_vs(sorted(ev.damaged))}, the damaged)"
    evidence += "; completions by " + (", ".join(f"v{v} x{n}" for v, n in sorted(ev.served_by.items())) or "no version")
    if served_bad:
        evidence += f"; BY UNVERIFIED {_vs(sorted(served_bad))}"
    damaged_refused = not ev.damaged or (at_damaged and all(not w.ok for w in at_damaged))
    ok = bool(ev.served_by) and not to_unverified and not served_bad and bool(damaged_refused)
    return Check("serving: no replica served a version that does not verify", ok, evidence)


def faults(ev: Evidence) -> Check:
    by = Counter(f.outcome for f in ev.faults)
    kinds = Counter(f.kind for f in ev.faults if f.outcome == DONE)
    evidence = f"{len(ev.faults)} scheduled: {by[DONE]} injected and recovered"
    if kinds:
        evidence += " (" + ", ".join(f"{k} x{n}" for k, n in kinds.items()) + ")"
    skipped = [f for f in ev.faults if f.outcome == SKIPPED]
    failed = [f for f in ev.faults if f.outcome == FAILED]
    if skipped:
        evidence += "; skipped: " + "; ".join(f"{f.kind} ({f.detail})" for f in skipped)
    if failed:
        evidence += "; FAILED: " + "; ".join(f"{f.kind} ({f.detail})" for f in failed)
    return Check("faults: each injected, and the loop came back", by[DONE] > 0 and not failed, evidence)


def processes(ev: Evidence) -> Check:
    parts, ok = [], True
    for name, (kills, exits) in ev.processes.items():
        part = f"{name}: {kills} SIGKILL(s) by the soak, {len(exits)} other exit(s)"
        if exits:
            ok = False
            part += f" (exit {exits[0].code}: {exits[0].last_line})"
        parts.append(part)
    return Check("processes: the sink and the learner ended only when killed", ok, "; ".join(parts) or "none watched")


def _vs(versions: Sequence[int]) -> str:
    if not versions:
        return "none"
    return ", ".join(f"v{v}" for v in versions[:8]) + (f" and {len(versions) - 8} more" if len(versions) > 8 else "")


# --- the tables -------------------------------------------------------------------------------------


def fault_table(fs: Sequence[Fault], t0: float) -> Table:
    t = Table("at", "fault", "took", "outcome", "what happened", title="faults injected")
    for f in fs:
        t.add_row(
            f"{f.started - t0:.0f} s",
            f.kind,
            f"{f.ended - f.started:.0f} s",
            f.outcome,
            f.detail,
            style=_style(f.outcome),
        )
    return t


def check_table(checks: Sequence[Check]) -> Table:
    t = Table("check", "result", "evidence", title="checks (the editors' ledger against SQL and the weight store)")
    for c in checks:
        t.add_row(c.name, "pass" if c.ok else "FAIL", c.evidence, style=None if c.ok else "red")
    return t


def _style(outcome: str) -> str | None:
    return {FAILED: "red", SKIPPED: "yellow"}.get(outcome)
