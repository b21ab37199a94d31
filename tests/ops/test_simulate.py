"""Simulated editor sessions over HTTP: they start nothing after their deadline, and go on when
the API is slow or failing."""

import asyncio
import itertools
import random
import time
import uuid
from collections import Counter

from feedback.implicit import judge_next
from feedback.pools import STABLE
from learner.corpus import SourceFile
from learner.formats import own_format
from learner.judge import Site, file_walks
from learner.tokenizer import train_tokenizer
from ops.simulate import SimulateSection, run_sessions
from serving.http.app import build_app
from serving.http.deps import ApiState
from serving.http.routing import RoutingState
from serving.replica import CompletionService
from serving.settings import ServeSettings
from tests.helpers import scaled, uvicorn_server
from tests.serving.conftest import FakeEngine, ListSink, LocalPool

CODE = "import os\n\n\ndef join_all(parts):\n    result = os.path.join(*parts)\n    return result.strip()\n\n\nclass Box:\n    size = 3\n"


def test_sessions_start_nothing_after_their_deadline():
    sites = [Site("a.py", "python", "x = ", "\n", "1")] * 5
    # the deadline has passed: no request is sent (nothing listens at this URL), all are counted
    stats = asyncio.run(
        run_sessions("http://127.0.0.1:9", "t", sites, SimulateSection(rate=1000.0), deadline=time.monotonic() - 1)
    )
    assert (stats.requests, stats.skipped, stats.errors) == (0, 5, 0)


def test_editors_survive_a_replica_slower_than_their_timeout(tmp_path):
    """The real API app in front of an engine that answers some requests after the editors gave
    up, fails others, and answers the rest: every failure is counted with its reason, and the
    sessions go on to the end (no exception, as a slow request once ended `make demo`)."""
    tok = train_tokenizer([CODE * 20], vocab_size=300)
    # The editors' timeout, and the slow answers well past it. Every other call must finish within
    # it on a loaded machine, so it scales with the suite's factor like every other wait.
    timeout_s = scaled(2.0)

    class MisbehavingEngine(FakeEngine):
        """Request 0, 3, 6...: slower than the timeout; 1, 4, 7...: fails; the rest answer at once."""

        n = itertools.count()

        async def generate(self, prompt_ids, spec, request_id):
            i = next(self.n)
            if i % 3 == 0:
                await asyncio.sleep(3 * timeout_s)
            elif i % 3 == 1:
                raise RuntimeError("replica restarting")
            async for out in super().generate(prompt_ids, spec, request_id):
                yield out

    cfg = ServeSettings(auth_tokens=["t"])
    app = build_app()
    app.state.api = ApiState(
        cfg=cfg,
        replicas={
            STABLE: LocalPool(
                CompletionService(
                    MisbehavingEngine(tok, text="join(*parts)"), tok, own_format(tok, 2048), cfg, version=0
                )
            )
        },
        routing=RoutingState(serving={STABLE: 0}),
        producer=ListSink(),
        editor_tokens={"t"},
        decode=tok.decode,
    )
    sites = [Site("m.py", "python", "result = os.path.", "\n", "join(*parts)")] * 9
    seen = []
    with uvicorn_server(app) as port:
        stats = asyncio.run(
            run_sessions(
                f"http://127.0.0.1:{port}",
                "t",
                sites,
                SimulateSection(users=3, rate=100.0, edit_delay_s=0.0, timeout_s=timeout_s),
                progress=lambda st: seen.append(st.errors),
            )
        )
    assert stats.requests == 9 and stats.skipped == 0
    assert stats.failures["completion: timeout"] == 3 and stats.failures["completion: HTTP 503"] == 3, stats.failures
    assert stats.failed_completions == 6 and sum(v["requests"] for v in stats.by_version.values()) == 3
    assert stats.accepted == 3 and stats.events == 3 * 3  # view, select, edit for each answered one
    assert "3 completion: timeout" in stats.failure_line() and max(seen) == 6  # the progress line saw them as they came
    assert stats.latency_summary()["v0"]["n"] == 3
    # Where the answered ones' time went, as the API's Server-Timing said (the demo prints it).
    stages = stats.stage_summary()
    assert stages["all"]["engine"]["n"] == 3 and stages["slowest"]["client"]["n"] == 1
    assert stages["slowest"]["client"]["mean_ms"] == max(stats.latency_ms["v0"])


def test_editors_record_every_call_and_retry_an_event_under_its_own_id(tmp_path):
    """Each editor keeps its own ledger: the completion ids it was served, the event ids it chose,
    and the status of every call. An event whose call fails with a 5xx is sent again with the same
    event_id, so the server can store it once."""
    tok = train_tokenizer([CODE * 20], vocab_size=300)

    class FlakyProducer(ListSink):
        """Refuses the first delivery of every event (its buffer for Kafka is full: the route answers
        503), takes the second. (A refusal, not a raised error: uvicorn closes the connection after
        an unhandled error's 500, and the editor's retry could then meet the closed connection.)"""

        def __init__(self):
            super().__init__()
            self.tries = Counter()

        def send(self, topic, msg):
            key = getattr(msg, "event_id", None)
            if key is not None:
                self.tries[key] += 1
                if self.tries[key] == 1:
                    return False
            return super().send(topic, msg)

    cfg = ServeSettings(auth_tokens=["t"])
    producer = FlakyProducer()
    app = build_app()
    app.state.api = ApiState(
        cfg=cfg,
        replicas={
            STABLE: LocalPool(
                CompletionService(FakeEngine(tok, text="join(*parts)"), tok, own_format(tok, 2048), cfg, version=0)
            )
        },
        routing=RoutingState(serving={STABLE: 0}),
        producer=producer,
        editor_tokens={"t"},
        decode=tok.decode,
    )
    sites = [Site("m.py", "python", "result = os.path.", "\n", "join(*parts)")] * 2
    with uvicorn_server(app, log_level="critical") as port:
        stats = asyncio.run(
            run_sessions(
                f"http://127.0.0.1:{port}",
                "t",
                sites,
                SimulateSection(users=2, rate=100.0, edit_delay_s=0.0, timeout_s=scaled(10.0), event_retries=2),
                requests=4,  # round the two sites twice
            )
        )
    completions = [c for c in stats.calls if c.kind == "completion"]
    events = [c for c in stats.calls if c.kind == "event"]
    assert [c.status for c in completions] == [200] * 4 and all(c.version == "v0" for c in completions)
    stored = {m.completion_id for _, m in producer.sent if not hasattr(m, "event_id")}
    assert {c.id for c in completions} == stored  # the ids the editors hold are the ones served
    per_event = Counter(c.id for c in events)
    sent = [(c.id[:8], c.status, c.failure) for c in events]
    assert len(per_event) == 4 * 3 and set(per_event.values()) == {2}, sent  # view, select, edit; each sent twice
    assert Counter(c.status for c in events) == {503: 12, 200: 12}
    assert {m.event_id for _, m in producer.sent if hasattr(m, "event_id")} == {uuid.UUID(i) for i in per_event}
    assert all(c.started <= c.ended for c in stats.calls) and stats.events == 12


def test_same_file_walks_request_in_order_and_can_send_no_events(tmp_path):
    """Each simulated editor walks down one file: its requests come one after another, under one
    user, and each prefix holds the previous line whole, so the next request says what became of
    the previous suggestion (the sink's implicit feedback reads it). Without explicit events the
    editors send none, as Continue or llama.vscode do."""
    tok = train_tokenizer([CODE * 20], vocab_size=300)
    cfg = ServeSettings(auth_tokens=["t"])
    producer = ListSink()
    app = build_app()
    app.state.api = ApiState(
        cfg=cfg,
        replicas={
            STABLE: LocalPool(
                CompletionService(FakeEngine(tok, text="result"), tok, own_format(tok, 2048), cfg, version=0)
            )
        },
        routing=RoutingState(serving={STABLE: 0}),
        producer=producer,
        editor_tokens={"t"},
        decode=tok.decode,
    )
    text = "".join(f"result_{i} = os.path.join(part_{i}, name)\n" for i in range(40))
    walks = file_walks([SourceFile("w.py", text), SourceFile("v.py", text)], 12, random.Random(1), per_file=4)
    with uvicorn_server(app) as port:
        stats = asyncio.run(
            run_sessions(
                f"http://127.0.0.1:{port}",
                "t",
                [],
                SimulateSection(users=2, rate=100.0, timeout_s=scaled(10.0), explicit_events=False),
                walks=walks,
            )
        )
    records = [m for _, m in producer.sent]
    assert stats.requests == len(records) == 12 and stats.events == 0 and stats.skipped == 0
    assert all(not hasattr(m, "event_id") for m in records)  # no events at all
    by_user: dict[str, list] = {}
    for m in records:
        by_user.setdefault(m.user_hash, []).append(m)
    assert sorted(len(v) for v in by_user.values()) == sorted(len(w) for w in walks)
    for walk_records in by_user.values():
        assert len({m.filepath for m in walk_records}) == 1
        for prev, nxt in zip(walk_records, walk_records[1:]):
            assert prev.created_at <= nxt.created_at
            # The suggestion "result" never continues these lines: judged, and not kept.
            j = judge_next("result", prev.before_cursor, prev.after_cursor, nxt.before_cursor, nxt.after_cursor)
            assert j.outcome == "none", j
