"""The soak's checks on hand-made evidence: each passes on a clean run and names what is wrong
when a row is missing or doubled, a 5xx falls outside a replica restart, a version has a gap or
does not verify, or a replica served a damaged version."""

from __future__ import annotations

import dataclasses
import io
from collections import Counter

from rich.console import Console

from ops.simulate import Call
from ops.soak import checks as C
from ops.soak.children import Exit
from ops.soak.faults import DONE, FAILED, SKIPPED, Fault


def call(kind, ident, status, at, failure=None, version="v1"):
    return Call(
        kind, ident, status, failure if status != 200 else None, at, at + 0.5, version if kind == "completion" else ""
    )


def clean() -> C.Evidence:
    calls = [
        call("completion", "c1", 200, 10),
        call("event", "e1", 200, 11),
        call("event", "e2", None, 12, failure="timeout"),  # sent again, accepted the second time
        call("event", "e2", 200, 13),
        call("completion", "c2", 200, 14),
        call("event", "e3", 200, 15),  # its completion never came: dead-lettered
        call("completion", "", 503, 101),  # while the replica restarted (100..130)
        call("completion", "", None, 102, failure="timeout"),
    ]
    faults = [
        Fault("replica", 100, 120, DONE, "killed", expect_503_until=130),
        Fault("postgres", 140, 141, SKIPPED, "the database is SQLite"),
    ]
    return C.Evidence(
        calls=calls,
        faults=faults,
        completion_rows=Counter({"c1": 1, "c2": 1}),
        served_by=Counter({0: 1, 1: 1}),
        event_rows=Counter({"e1": 1, "e2": 1}),
        dead_letters={"e3": ["unknown_completion: no completion within the grace period"]},
        pending=set(),
        recorded={0: "a", 1: "b", 2: "c"},
        stored={0: "a", 1: "b", 2: "c"},
        verify_errors={0: None, 1: None, 2: "DeltaError: v2: delta.zst does not match the sha256 in its manifest"},
        damaged={2},
        swaps=[C.Swap("stable", 1, True, None), C.Swap("canary", 2, False, "DeltaError: corrupt file")],
        processes={"sink": (1, []), "learner": (1, [])},
    )


def verdicts(ev) -> dict[str, C.Check]:
    return {c.name.split(":")[0]: c for c in C.check_all(ev)}


def test_a_clean_run_passes_every_check_and_says_how_much_it_saw():
    v = verdicts(clean())
    assert all(c.ok for c in v.values()), {k: c.evidence for k, c in v.items() if not c.ok}
    assert "2 served (200); in SQL: 2; missing 0; twice 0" in v["completions"].evidence
    assert (
        "3 sent in 4 calls (1 again under the same event_id); 3 accepted: 2 stored once, 1 dead-lettered (1 unknown_completion)"
        in v["events"].evidence
    )
    assert (
        "(1 of the 503s while a killed replica restarted)" in v["http"].evidence and "timeout x2" in v["http"].evidence
    )
    assert "damaged on purpose and refused: v2" in v["versions"].evidence and "2 verify" in v["versions"].evidence
    assert "1 of 1 attempts at v2" in v["serving"].evidence
    assert "skipped: postgres (the database is SQLite)" in v["faults"].evidence
    table = io.StringIO()
    Console(file=table, width=250).print(C.check_table(C.check_all(clean())))
    assert table.getvalue().count("pass") == 7


def test_a_lost_or_doubled_row_fails_its_check():
    ev = clean()
    lost = dataclasses.replace(ev, completion_rows=Counter({"c1": 1}))
    assert not verdicts(lost)["completions"].ok and "missing 1" in verdicts(lost)["completions"].evidence
    doubled = dataclasses.replace(ev, event_rows=Counter({"e1": 2, "e2": 1}))
    assert not verdicts(doubled)["events"].ok and "twice 1" in verdicts(doubled)["events"].evidence
    held = dataclasses.replace(ev, pending={"e1"})
    assert not verdicts(held)["events"].ok and "still held 1" in verdicts(held)["events"].evidence
    both = dataclasses.replace(ev, dead_letters={"e1": ["rejected: x"], "e3": ["unknown_completion: y"]})
    assert not verdicts(both)["events"].ok and "stored and dead-lettered 1" in verdicts(both)["events"].evidence
    silent = dataclasses.replace(ev, dead_letters={"e3": [""]})
    assert not verdicts(silent)["events"].ok  # dead-lettered without a reason


def test_a_5xx_outside_a_replica_restart_fails():
    ev = clean()
    late = dataclasses.replace(ev, calls=[*ev.calls, call("completion", "", 503, 200)])
    assert not verdicts(late)["http"].ok and "NOT ALLOWED: 503 x1" in verdicts(late)["http"].evidence, verdicts(late)[
        "http"
    ]
    crash = dataclasses.replace(ev, calls=[*ev.calls, call("event", "e9", 500, 105)])
    assert not verdicts(crash)["http"].ok  # a 500 is never a restart's


def test_versions_must_be_contiguous_recorded_stored_and_verify():
    ev = clean()
    gap = dataclasses.replace(ev, recorded={0: "a", 2: "c"}, stored={0: "a", 2: "c"})
    assert not verdicts(gap)["versions"].ok and "gaps v1" in verdicts(gap)["versions"].evidence
    unrecorded = dataclasses.replace(ev, recorded={0: "a", 1: "b"})
    assert "stored not recorded v2" in verdicts(unrecorded)["versions"].evidence
    rot = dataclasses.replace(ev, verify_errors={**ev.verify_errors, 1: "DeltaError: bit rot"})
    assert (
        not verdicts(rot)["versions"].ok
        and "FAIL to verify: v1 (DeltaError: bit rot)" in verdicts(rot)["versions"].evidence
    )
    undamaged = dataclasses.replace(ev, verify_errors={**ev.verify_errors, 2: None})
    assert not verdicts(undamaged)["versions"].ok  # the planted damage did not take: nothing was tested
    other = dataclasses.replace(ev, stored={**ev.stored, 1: "z"})
    assert "sha256 differs v1" in verdicts(other)["versions"].evidence


def test_a_replica_on_a_damaged_version_fails_serving():
    ev = clean()
    swapped = dataclasses.replace(ev, swaps=[*ev.swaps, C.Swap("canary", 2, True, None)])
    assert not verdicts(swapped)["serving"].ok
    served = dataclasses.replace(ev, served_by=Counter({1: 5, 2: 1}))
    assert not verdicts(served)["serving"].ok and "BY UNVERIFIED v2" in verdicts(served)["serving"].evidence
    untried = dataclasses.replace(ev, swaps=[C.Swap("stable", 1, True, None)])
    assert not verdicts(untried)["serving"].ok  # no replica ever tried the damaged version


def test_a_failed_fault_or_an_unexpected_exit_fails_the_soak():
    ev = clean()
    failed = dataclasses.replace(ev, faults=[*ev.faults, Fault("learner", 150, 400, FAILED, "did not publish")])
    assert (
        not verdicts(failed)["faults"].ok and "FAILED: learner (did not publish)" in verdicts(failed)["faults"].evidence
    )
    crashed = dataclasses.replace(ev, processes={"learner": (1, [Exit(160.0, 70, "internal error: OperationalError")])})
    assert not verdicts(crashed)["processes"].ok and "exit 70" in verdicts(crashed)["processes"].evidence


def test_outstanding_counts_what_sql_does_not_hold_yet():
    ev = clean()
    args = (ev.calls, ev.completion_rows, ev.event_rows, ev.dead_letters, ev.pending)
    assert C.outstanding(*args) == 0
    assert C.outstanding(ev.calls, Counter(), ev.event_rows, ev.dead_letters, {"e1"}) == 3
