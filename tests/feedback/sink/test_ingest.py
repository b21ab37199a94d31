"""The sink's database side without Kafka: idempotent batches, held events, dead letters, rewards."""

from __future__ import annotations

import socket
import threading
from datetime import UTC, datetime, timedelta

import numpy as np
import pytest
from sqlalchemy import select

from feedback import db
from feedback.core.errors import UserError
from feedback.reward import RewardWeights
from feedback.routing import encode_routing
from feedback.schemas import CompletionChoice, FeedbackEvent, encode
from feedback.sink import ingest
from feedback.sink.ingest import Batch, Origin
from feedback.sink.loop import SinkSettings, _sweep, _write, _write_until_done, database_unavailable
from tests.feedback.sink.sink_support import completion, count, events_for

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
WINDOW = 60.0


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def engine(request, tmp_path):
    url = f"sqlite:///{tmp_path / 'i.db'}" if request.param == "sqlite" else request.getfixturevalue("postgres_url")
    e = db.make_engine(url)
    db.upgrade(e)
    yield e
    e.dispose()


class Offsets:
    def __init__(self):
        self.n = 0

    def __call__(self, msg, topic="t") -> tuple:
        self.n += 1
        return msg, Origin(topic, 0, self.n, b"k", encode(msg))


@pytest.fixture
def unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write(engine, now=T0, **parts) -> ingest.Counts:
    with engine.begin() as conn:
        return ingest.write_batch(conn, Batch(**parts), now=now, feedback_window_s=WINDOW)


def sweep(engine, now, grace_s=300.0) -> tuple[int, int]:
    with engine.begin() as conn:
        dead = ingest.expire_pending(conn, now=now, grace_s=grace_s)
        rewards = ingest.compute_due_rewards(conn, now=now, feedback_window_s=WINDOW, weights=RewardWeights())
    return dead, rewards


def rewards_of(engine) -> dict[str, float]:
    with engine.connect() as conn:
        return {r.completion_id: r.reward for r in conn.execute(select(db.rewards))}


def test_a_batch_written_twice_leaves_the_same_rows(engine):
    o = Offsets()
    comps = [o(completion(f"c{i}", created_at=T0)) for i in range(3)]
    evs = [o(e) for e in events_for("c0", "view", "select") + events_for("c1", "dismiss")]
    first = write(engine, completions=comps, events=evs + evs[:1])  # and a retry inside the batch
    assert (first.completions, first.events) == (3, 3)
    again = write(engine, completions=comps, events=evs)
    assert (again.completions, again.events, again.held) == (0, 0, 0)
    assert [count(engine, t) for t in ("completions", "completion_choices", "events", "reward_due")] == [3, 3, 3, 3]


def test_a_pinned_completion_is_stored_as_pinned(engine):
    o = Offsets()
    write(engine, completions=[o(completion("routed")), o(completion("pinned").model_copy(update={"pinned": True}))])
    with engine.connect() as conn:
        assert dict(conn.execute(select(db.completions.c.completion_id, db.completions.c.pinned)).all()) == {
            "routed": False,
            "pinned": True,
        }


def test_an_event_before_its_completion_is_held_then_promoted(engine):
    o = Offsets()
    ev = o(events_for("late", "select")[0])
    assert write(engine, events=[ev]).held == 1
    assert write(engine, events=[ev]).held == 0  # a retry while held
    assert (count(engine, "events"), count(engine, "pending_events")) == (0, 1)
    assert write(engine, completions=[o(completion("late", created_at=T0))]).promoted == 1
    assert (count(engine, "events"), count(engine, "pending_events")) == (1, 0)


def test_a_completion_written_by_another_sink_is_found_by_the_sweep(engine):
    o = Offsets()
    write(engine, events=[o(events_for("other", "view")[0])])
    with engine.begin() as conn:  # another group member stores the completion (its batch promotes nothing it can see)
        conn.execute(
            db.completions.insert().values(**ingest.completion_rows(completion("other", created_at=T0), T0)[0])
        )
    assert sweep(engine, T0 + timedelta(seconds=1)) == (0, 0)
    assert (count(engine, "events"), count(engine, "pending_events")) == (1, 0)


def test_an_unknown_completion_becomes_a_dead_letter_after_the_grace_period(engine):
    o = Offsets()
    ev, origin = o(events_for("ghost", "view")[0], topic="flywheel.events")
    write(engine, events=[(ev, origin)])
    assert sweep(engine, T0 + timedelta(seconds=299)) == (0, 0)
    assert sweep(engine, T0 + timedelta(seconds=301)) == (1, 0)
    assert count(engine, "pending_events") == 0
    with engine.connect() as conn:
        d = conn.execute(select(db.dead_letters)).one()
    assert (d.reason, d.completion_id, d.event_id, d.kafka_topic, d.kafka_offset) == (
        "unknown_completion",
        "ghost",
        str(ev.event_id),
        "flywheel.events",
        1,
    )
    assert bytes(d.payload) == encode(ev) and "300s" in d.error


def test_malformed_messages_are_dead_letters_with_their_bytes(engine):
    class Raw:
        def __init__(self, topic, offset, value):
            self.topic, self.partition, self.offset, self.key, self.value = topic, 2, offset, b"\xffkey", value

    msgs = [Raw("E", 7, b"{oops"), Raw("C", 8, b'{"completion_id": "c"}'), Raw("E", 9, None), Raw("other", 1, b"{}")]
    batch = ingest.decode_batch(msgs, completions_topic="C", events_topic="E")
    assert len(batch.malformed) == 4
    with engine.begin() as conn:
        assert ingest.write_batch(conn, batch, now=T0, feedback_window_s=WINDOW).dead_letters == {"malformed": 4}
    with engine.begin() as conn:  # replayed after a crash: still four
        assert ingest.write_batch(conn, batch, now=T0, feedback_window_s=WINDOW).dead_letters == {}
    with engine.connect() as conn:
        rows = conn.execute(select(db.dead_letters).order_by(db.dead_letters.c.kafka_offset)).all()
    assert [(r.kafka_topic, r.kafka_partition, r.kafka_offset) for r in rows] == [
        ("other", 2, 1),
        ("E", 2, 7),
        ("C", 2, 8),
        ("E", 2, 9),
    ]
    assert rows[1].payload == b"{oops" and rows[3].payload is None and rows[1].key == "\\xffkey"
    assert "invalid FeedbackEvent" in rows[1].error and "unexpected topic" in rows[0].error


def test_rewards_wait_for_the_window_and_count_only_events_inside_it(engine):
    o = Offsets()
    c = completion("r1", "hello world", created_at=T0)
    inside = FeedbackEvent(
        completion_id="r1", type="select", select_kind="word", accepted_chars=5, created_at=T0 + timedelta(seconds=30)
    )
    outside = FeedbackEvent(completion_id="r1", type="select", created_at=T0 + timedelta(seconds=61))
    write(engine, completions=[o(c)], events=[o(inside), o(outside)])
    assert sweep(engine, T0 + timedelta(seconds=59)) == (0, 0)
    assert sweep(engine, T0 + timedelta(seconds=61)) == (0, 1)
    assert rewards_of(engine) == {"r1": pytest.approx(0.75 * 5 / 11)}
    assert count(engine, "reward_due") == 0


def test_a_late_arriving_event_recomputes_the_reward(engine):
    o = Offsets()
    write(
        engine,
        completions=[o(completion("r2", created_at=T0))],
        events=[o(FeedbackEvent(completion_id="r2", type="view", created_at=T0))],
    )
    sweep(engine, T0 + timedelta(seconds=120))
    assert rewards_of(engine) == {"r2": -0.25}  # shown, ignored
    # The select happened inside the window but reached the sink late (it lagged).
    write(
        engine,
        now=T0 + timedelta(seconds=200),
        events=[o(FeedbackEvent(completion_id="r2", type="select", created_at=T0 + timedelta(seconds=5)))],
    )
    assert sweep(engine, T0 + timedelta(seconds=200)) == (0, 1)
    assert rewards_of(engine) == {"r2": 0.75}
    with engine.connect() as conn:
        r = conn.execute(select(db.rewards)).one()
    assert (r.outcome, r.model_version, r.components["outcome"]) == ("select", 1, "select")


def test_code_and_model_output_with_nul_are_stored_with_it_spelled_out(engine):
    """A model can sample the NUL byte and a file can hold it; a served completion must reach SQL,
    and PostgreSQL text cannot hold NUL: it is spelled out, on every backend alike."""
    o = Offsets()
    rec = completion("nul", "x\x00y", created_at=T0).model_copy(
        update={"prompt_text": "a\x00b", "filepath": "f\x00.py"}
    )
    edit = FeedbackEvent(completion_id="nul", type="edit", kept_text="x\x00", created_at=T0)
    counts = write(engine, completions=[o(rec)], events=[o(edit)])
    assert (counts.completions, counts.events, counts.dead_letters) == (1, 1, {})
    with engine.connect() as conn:
        c = conn.execute(select(db.completions)).one()
        ch = conn.execute(select(db.completion_choices)).one()
        ev = conn.execute(select(db.events)).one()
    assert (c.prompt_text, c.filepath, ch.text, ev.kept_text) == ("a\\x00b", "f\\x00.py", "x\\x00y", "x\\x00")
    assert ch.n_chars == 3 and list(ch.token_ids) == rec.choices[0].token_ids  # as served; the ids are exact


def test_a_batch_stores_the_same_values_as_rows_written_one_by_one(engine):
    """Several rows go to the database in one statement (on PostgreSQL, an array per column), one
    row alone as a VALUES: both store the same values, JSON (lists, dicts, null), NUL spelled out,
    bytes, timestamps, and both skip a row already there."""
    o = Offsets()

    routing = encode_routing(np.array([[[1, 2]] * 3]))

    def records(tag):
        return [
            completion(
                f"{tag}{i}",
                f"x{i}\x00",
                created_at=T0 + timedelta(seconds=i),
                summary_ids=[f"s{i}", "t"][: i + 1],
                routing=routing if i else None,
                session_id=None if i else "sess",
            )
            for i in range(3)
        ]

    batch = write(engine, completions=[o(r) for r in records("b")])
    for r in records("s"):
        write(engine, completions=[o(r)])
    assert batch.completions == 3
    again = write(engine, completions=[o(r) for r in records("b") + records("n")])
    assert again.completions == 3  # only the new ones
    dead = [ingest.dead_letter_row(Origin("t", 0, i, b"k\x00", b"\x00\xff"), "malformed", "e", T0) for i in range(2)]
    with engine.begin() as conn:
        assert len(ingest.insert_new(conn, db.dead_letters, dead, returning=db.dead_letters.c.id)) == 2
        assert ingest.insert_new(conn, db.dead_letters, dead, returning=db.dead_letters.c.id) == []

    def stored(tag):
        with engine.connect() as conn:
            c, ch = db.completions, db.completion_choices
            rows = conn.execute(
                select(c, ch.c.token_ids, ch.c.logprobs, ch.c.routing, ch.c.text, ch.c.n_chars)
                .join(ch, ch.c.completion_id == c.c.completion_id)
                .where(c.c.completion_id.like(f"{tag}%"))
                .order_by(c.c.completion_id)
            ).mappings()
            return [{k: v for k, v in r.items() if k not in ("id", "completion_id", "ingested_at")} for r in rows]

    assert stored("b") == stored("s") == stored("n")
    assert [r["routing"] for r in stored("b")] == [None, routing, routing]
    assert [r["summary_ids"] for r in stored("b")] == [["s0"], ["s1", "t"], ["s2", "t"]]
    assert [r["text"] for r in stored("b")] == ["x0\\x00", "x1\\x00", "x2\\x00"]
    with engine.connect() as conn:
        assert [(d.key, d.payload) for d in conn.execute(select(db.dead_letters))] == [("k\\x00", b"\x00\xff")] * 2


@pytest.mark.postgres
def test_a_message_the_database_refuses_is_set_aside_alone(postgres_url):
    """PostgreSQL text cannot hold NUL characters; content is spelled out (above), an id is not
    rewritten (SQLite stores it, so it has no such case)."""
    engine = db.make_engine(postgres_url)
    db.upgrade(engine)
    o = Offsets()
    bad = completion("nul", created_at=T0).model_copy(update={"user_hash": "a\x00b"})
    good = [o(completion(f"ok{i}", created_at=T0)) for i in range(3)]
    s = SinkSettings(database={"url": engine.url.render_as_string(hide_password=False)})
    counts = _write(engine, Batch(completions=good[:2] + [o(bad)] + good[2:]), s)
    assert (counts.completions, counts.dead_letters) == (3, {"rejected": 1})
    with engine.connect() as conn:
        d = conn.execute(select(db.dead_letters)).one()
    assert d.reason == "rejected" and d.completion_id == "nul" and "database refused it" in d.error


def test_an_unreachable_database_keeps_the_batch_and_retries():
    s = SinkSettings(database={"url": "postgresql+psycopg://nobody:x@127.0.0.1:1/none"}, sink={"db_retry_s": 0.05})
    engine = db.make_engine(s.database_url)
    stop = threading.Event()
    threading.Timer(0.5, stop.set).start()
    assert _write_until_done(engine, Batch(completions=[Offsets()(completion("x"))]), s, stop) is None


def test_sink_settings_from_toml_env_and_overrides(tmp_path, monkeypatch):
    from feedback.core.errors import UserError

    f = tmp_path / "flywheel.toml"
    f.write_text(
        "[sink]\nbatch_size = 200\nfeedback_window_s = 120\n[sink.reward]\naccepted = 1.0\n[serve]\nwhatever = 1\n"
    )
    monkeypatch.setenv("FLYWHEEL_SINK__GRACE_PERIOD_S", "30")
    s = SinkSettings.load(f, ["sink.retention_days=7"])
    assert (s.sink.batch_size, s.sink.feedback_window_s, s.sink.reward.accepted, s.sink.reward.dismissed) == (
        200,
        120,
        1.0,
        -0.25,
    )
    assert (s.sink.grace_period_s, s.sink.retention_days) == (30, 7)
    with pytest.raises(UserError, match="sink.batch_size"):
        SinkSettings.load(f, ["sink.batch_size=0"])
    with pytest.raises(UserError, match="sink.reward.acepted"):
        SinkSettings.load(f, ["sink.reward.acepted=1"])  # a typo is an error, not ignored


# --- a poison message never stops the sink (reliability finding 1b) ------------------------------


def _unvalidated_select(cid: str, accepted_chars: int) -> FeedbackEvent:
    """An event as a producer with looser (or no) schemas could have sent it: validation bypassed."""
    import uuid

    return FeedbackEvent.model_construct(
        event_id=uuid.uuid4(),
        completion_id=cid,
        type="select",
        choice_index=0,
        select_kind="full",
        accepted_chars=accepted_chars,
        kept_text=None,
        view_id=None,
        elapsed_ms=None,
        created_at=T0,
    )


def test_the_metrics_server_listens_on_this_machine_only_unless_told(unused_port):
    from feedback.sink.loop import SinkSection, serve_metrics

    assert serve_metrics(SinkSection()) is None  # no port: no server
    server = serve_metrics(SinkSection(metrics_port=unused_port))
    try:
        assert server.server_address == ("127.0.0.1", unused_port)
    finally:
        server.shutdown()
        server.server_close()
    server = serve_metrics(SinkSection(metrics_port=unused_port, metrics_host="0.0.0.0"))
    try:
        assert server.server_address == ("0.0.0.0", unused_port)
        with pytest.raises(UserError, match=f"cannot listen on 127.0.0.1:{unused_port}"):
            serve_metrics(SinkSection(metrics_port=unused_port))  # taken: one line, not a traceback
    finally:
        server.shutdown()
        server.server_close()


def test_a_value_the_database_cannot_hold_is_a_dead_letter_not_a_crash(engine):
    """2**63 made sqlite3 raise OverflowError (SQLAlchemy does not wrap it), which the write path
    did not catch: the sink exited before committing, and every restart replayed the batch.
    PostgreSQL refuses it as a DataError (integer out of range)."""
    o = Offsets()
    write(engine, completions=[o(completion("known", created_at=T0))])
    poison, valid = o(_unvalidated_select("known", 2**63)), o(events_for("known", "view")[0])
    s = SinkSettings(database={"url": engine.url.render_as_string(hide_password=False)})
    counts = _write(engine, Batch(events=[poison, valid]), s)
    assert (counts.events, counts.dead_letters) == (1, {"rejected": 1})
    with engine.connect() as conn:
        d = conn.execute(select(db.dead_letters)).one()
        stored = conn.execute(select(db.events.c.event_id)).scalars().all()
    assert stored == [str(valid[0].event_id)]
    assert d.reason == "rejected" and d.event_id == str(poison[0].event_id) and d.kafka_offset == poison[1].offset
    assert "database refused it" in d.error
    assert ("OverflowError" if engine.dialect.name == "sqlite" else "out of range") in d.error, d.error


def test_a_held_event_that_no_longer_validates_is_set_aside_by_the_sweep(engine):
    """Held by an older sink whose schemas let 2**63 through: decoding it raised out of the sweep
    (a ValueError, not a database error), every second, and the sink died."""
    o = Offsets()
    stale, origin = o(_unvalidated_select("later", 2**63))
    write(engine, events=[(stale, origin)])
    assert count(engine, "pending_events") == 1
    with engine.begin() as conn:  # its completion arrives through another sink member
        conn.execute(
            db.completions.insert().values(**ingest.completion_rows(completion("later", created_at=T0), T0)[0])
        )
    s = SinkSettings(database={"url": engine.url.render_as_string(hide_password=False)})
    counts = _sweep(engine, s)
    assert counts.dead_letters == {"malformed": 1} and counts.promoted == 0
    assert (count(engine, "pending_events"), count(engine, "events")) == (0, 0)
    with engine.connect() as conn:
        d = conn.execute(select(db.dead_letters)).one()
    assert d.reason == "malformed" and "no longer valid" in d.error and "accepted_chars" in d.error
    assert (d.completion_id, d.event_id, bytes(d.payload)) == ("later", str(stale.event_id), origin.payload)


@pytest.mark.postgres
def test_a_held_event_the_database_refuses_does_not_take_its_completion_down(postgres_url):
    """The event waited for its completion; promoting it (a NUL character in an id) once failed the
    completion's transaction, and the completion itself became the dead letter."""
    engine = db.make_engine(postgres_url)
    db.upgrade(engine)
    o = Offsets()
    nul = o(FeedbackEvent(completion_id="held", type="view", view_id="a\x00b", created_at=T0))
    fine = o(FeedbackEvent(completion_id="held", type="view", created_at=T0))
    assert write(engine, events=[nul, fine]).held == 2
    s = SinkSettings(database={"url": postgres_url})
    counts = _write(engine, Batch(completions=[o(completion("held", created_at=T0))]), s)
    assert (counts.completions, counts.promoted, counts.dead_letters) == (1, 1, {"rejected": 1})
    with engine.connect() as conn:
        d = conn.execute(select(db.dead_letters)).one()
        assert conn.execute(select(db.events.c.event_id)).scalars().all() == [str(fine[0].event_id)]
    assert (d.reason, d.event_id, d.completion_id) == ("rejected", str(nul[0].event_id), "held")
    assert count(engine, "pending_events") == 0
    engine.dispose()


def test_a_dead_letter_always_stores_even_when_its_key_and_error_hold_nul(engine):
    """The error quotes what the sender wrote; a NUL in it (or in the key) must not make setting
    the message aside fail the way the message did."""
    origin = Origin("t", 0, 1, b"k\x00ey", b"\x00")
    with engine.begin() as conn:
        row = ingest.dead_letter_row(origin, "malformed", "bad \x00 value", T0)
        assert ingest.insert_new(conn, db.dead_letters, [row], returning=db.dead_letters.c.id)
    with engine.connect() as conn:
        d = conn.execute(select(db.dead_letters)).one()
    assert (d.key, d.error, bytes(d.payload)) == ("k\\x00ey", "bad \\x00 value", b"\x00")


def _wrapped(cls, orig: Exception):
    return cls("INSERT ...", {}, orig)


def test_only_an_unavailable_database_is_retried():
    import sqlite3

    import psycopg
    from sqlalchemy import exc

    from feedback.schemas import MalformedMessage

    retried = [
        _wrapped(exc.OperationalError, sqlite3.OperationalError("database is locked")),
        _wrapped(exc.OperationalError, psycopg.errors.AdminShutdown("terminating connection")),
        _wrapped(exc.OperationalError, psycopg.OperationalError("connection failed: Connection refused")),
        _wrapped(exc.OperationalError, psycopg.errors.DiskFull("could not extend file")),
        exc.TimeoutError("QueuePool limit reached"),
        exc.DisconnectionError("gone"),
    ]
    refused = [
        OverflowError("Python int too large to convert to SQLite INTEGER"),
        ValueError("bad"),
        MalformedMessage("invalid FeedbackEvent"),
        _wrapped(exc.DataError, psycopg.errors.NumericValueOutOfRange("integer out of range")),
        _wrapped(exc.DataError, psycopg.DataError("PostgreSQL text fields cannot contain NUL (0x00) bytes")),
        _wrapped(exc.IntegrityError, sqlite3.IntegrityError("NOT NULL constraint failed")),
        _wrapped(exc.OperationalError, psycopg.errors.ProgramLimitExceeded("index row size exceeds maximum")),
        _wrapped(exc.InterfaceError, sqlite3.InterfaceError("Error binding parameter 1")),
    ]
    assert [database_unavailable(e) for e in retried] == [True] * len(retried)
    assert [database_unavailable(e) for e in refused] == [False] * len(refused)


# --- implicit feedback: the next request in the same user's file says what became of a suggestion ---

BEFORE, AFTER = "def area(r):\n    ", "\n\nprint(area(2))\n"


def served(cid: str, at, before: str, text: str = "return 3.14 * r * r", *, user="u", path="a.py", after=AFTER):
    rec = completion(cid, text, created_at=at, before_cursor=before, after_cursor=after)
    return rec.model_copy(update={"user_hash": user, "filepath": path})


def kept_then_next(first="c1", second="c2", gap_s: float = 5.0, **kw):
    """A suggestion, then the next request with the cursor after it: kept fully."""
    return served(first, T0, BEFORE, **kw), served(
        second, T0 + timedelta(seconds=gap_s), BEFORE + "return 3.14 * r * r\n    ", "x", **kw
    )


def events_of(engine) -> list:
    with engine.connect() as conn:
        return conn.execute(select(db.events).order_by(db.events.c.completion_id, db.events.c.source)).all()


def test_the_next_request_in_the_same_file_infers_a_kept_suggestion(engine):
    o = Offsets()
    a, b = kept_then_next()
    assert write(engine, completions=[o(a), o(b)]).inferred == 1
    (ev,) = events_of(engine)
    assert (ev.completion_id, ev.source, ev.type, ev.select_kind, ev.accepted_chars) == (
        "c1",
        "inferred",
        "select",
        "full",
        len("return 3.14 * r * r"),
    )
    assert ev.event_id == ingest.inferred_event_id("c1") and ev.elapsed_ms == 5000
    sweep(engine, T0 + timedelta(seconds=WINDOW + 10))
    with engine.connect() as conn:
        r = conn.execute(select(db.rewards).where(db.rewards.c.completion_id == "c1")).one()
    assert (r.reward, r.outcome, r.components["source"]) == (0.75, "select", "inferred")


def test_partly_kept_and_not_kept(engine):
    o = Offsets()
    recs = [
        served("p1", T0, BEFORE, "return math.pi * r"),
        served("p2", T0 + timedelta(seconds=1), BEFORE + "return math.tau", "x"),
        served("n1", T0, BEFORE, "pass", path="b.py"),
        served("n2", T0 + timedelta(seconds=1), BEFORE + "return 0", "x", path="b.py"),
    ]
    assert write(engine, completions=[o(r) for r in recs]).inferred == 2
    got = {e.completion_id: (e.type, e.select_kind, e.accepted_chars) for e in events_of(engine)}
    assert got == {"p1": ("select", "word", len("return math.")), "n1": ("dismiss", None, None)}


def test_inference_is_idempotent_across_replays_and_batches(engine):
    o = Offsets()
    a, b = kept_then_next()
    write(engine, completions=[o(a)])  # the previous completion came in an earlier batch
    assert write(engine, completions=[o(b)]).inferred == 1
    assert write(engine, completions=[o(a), o(b)]).inferred == 0  # the whole batch replayed
    # Another sink member (or a replay after a crash) judging the same pair writes the same id.
    with engine.begin() as conn:
        assert ingest.infer_feedback(conn, [b], now=T0, feedback_window_s=WINDOW) == 0
    assert count(engine, "events") == 1


def test_only_the_same_user_and_file_within_the_window_is_judged(engine):
    o = Offsets()
    pairs = [
        kept_then_next("late1", "late2", gap_s=WINDOW + 1, path="late.py"),
        (
            served("u1", T0, BEFORE, path="u.py"),
            served("u2", T0 + timedelta(seconds=1), BEFORE + "return 3.14 * r * r", user="v", path="u.py"),
        ),
        (
            served("f1", T0, BEFORE, path="f.py"),
            served("f2", T0 + timedelta(seconds=1), BEFORE + "return 3.14 * r * r", path="z"),
        ),
    ]
    assert write(engine, completions=[o(r) for pair in pairs for r in pair]).inferred == 0
    # Without a file path, a user's requests are one file (llama.vscode sends none).
    a, b = kept_then_next("n1", "n2", path=None)
    assert write(engine, completions=[o(a), o(b)]).inferred == 1
    # Each completion is judged by the next one only: a third request judges the second.
    c = served("n3", T0 + timedelta(seconds=9), BEFORE + "return 3.14 * r * r\n    x = 1", "y", path=None)
    c = c.model_copy(update={"before_cursor": BEFORE + "return 3.14 * r * r\n    x", "after_cursor": AFTER})
    assert write(engine, completions=[o(c)]).inferred == 1
    assert {e.completion_id for e in events_of(engine)} == {"n1", "n2"}


def test_an_explicit_event_wins_whichever_arrives_first(engine):
    o = Offsets()
    a, b = kept_then_next("e1", "e2")
    dismiss = FeedbackEvent(completion_id="e1", type="dismiss", created_at=T0 + timedelta(seconds=1))
    write(engine, completions=[o(a), o(b)])  # inferred first: kept fully
    write(engine, events=[o(dismiss)])  # then the editor's own word
    c, d = kept_then_next("x1", "x2", path="other.py")
    write(engine, events=[o(FeedbackEvent(completion_id="x1", type="view", created_at=T0))])  # held: explicit first
    write(engine, completions=[o(c), o(d)])
    sweep(engine, T0 + timedelta(seconds=WINDOW + 10))
    with engine.connect() as conn:
        rewards = {r.completion_id: r for r in conn.execute(select(db.rewards))}
    assert (rewards["e1"].outcome, rewards["e1"].reward) == ("dismiss", -0.25)
    assert (rewards["x1"].outcome, rewards["x1"].reward) == ("ignored", -0.25)
    assert "source" not in rewards["e1"].components and "source" not in rewards["x1"].components
    assert sorted((e.completion_id, e.source) for e in events_of(engine)) == [
        ("e1", "explicit"),
        ("e1", "inferred"),
        ("x1", "explicit"),
        ("x1", "inferred"),
    ]


def test_analyst_views_keep_explicit_and_inferred_apart(engine):
    o = Offsets()
    a, b = kept_then_next("v1", "v2")
    write(engine, completions=[o(a), o(b)], events=[o(e) for e in events_for("v1", "view", "select")])
    c, d = kept_then_next("w1", "w2", path="w.py")
    write(engine, completions=[o(c), o(d)], events=[o(e) for e in events_for("w1", "view", "dismiss")])
    with engine.connect() as conn:

        def rows(sql):
            return {r[0]: tuple(r[1:]) for r in conn.exec_driver_sql(sql)}

        explicit = rows("SELECT completion_id, shown, accepted FROM v_choice_feedback")
        inferred = rows("SELECT completion_id, shown, accepted FROM v_choice_feedback_inferred")
        agreement = rows(
            "SELECT completion_id, explicit_outcome, inferred_outcome, agree, inferred_accepted_chars "
            "FROM v_inferred_agreement"
        )
        daily = conn.exec_driver_sql("SELECT SUM(shown), SUM(accepted) FROM v_daily_acceptance_inferred").one()
    assert explicit["v1"] == (1, 1) and explicit["w1"] == (1, 0) and explicit["v2"] == (0, 0)
    assert inferred["v1"] == (1, 1) and inferred["w1"] == (1, 1) and inferred["v2"] == (0, 0)
    n = len("return 3.14 * r * r")
    assert agreement == {"v1": ("full", "full", 1, n), "w1": ("none", "full", 0, n)}
    assert tuple(daily) == (2, 2)


def test_inference_takes_a_fixed_number_of_queries_per_batch(engine):
    from sqlalchemy import event

    def statements(n_users: int) -> int:
        recs = []
        for u in range(n_users):
            a, b = kept_then_next(f"q{n_users}-{u}-a", f"q{n_users}-{u}-b", user=f"user{n_users}-{u}")
            recs += [a, b]
        seen = []
        listener = lambda *args: seen.append(args[2])  # noqa: E731
        with engine.begin() as conn:
            ingest.write_batch(
                conn,
                Batch(completions=[(r, Origin("c", 0, i, None, None)) for i, r in enumerate(recs)]),
                now=T0,
                feedback_window_s=WINDOW,
            )
            event.listen(conn, "before_cursor_execute", listener)
            assert ingest.infer_feedback(conn, recs, now=T0, feedback_window_s=WINDOW) == 0  # written above
            event.remove(conn, "before_cursor_execute", listener)
        return len(seen)

    assert statements(3) == statements(60) <= 4  # candidates, their text, the insert, the reward queue


def test_cursor_text_with_nul_is_stored_spelled_out_and_judged(engine):
    o = Offsets()
    a = served("z1", T0, "s = '\x00'\n", "t = 1")
    b = served("z2", T0 + timedelta(seconds=1), "s = '\x00'\nt = 1\n", "u")
    assert write(engine, completions=[o(a), o(b)]).inferred == 1
    with engine.connect() as conn:
        assert (
            conn.execute(select(db.completions.c.before_cursor).where(db.completions.c.completion_id == "z1")).scalar()
            == "s = '\\x00'\n"
        )


def test_a_withheld_choice_is_rewarded_as_withheld_whatever_events_claim(engine):
    """The confidence gate kept it from the editor: an event about it (an implicit accept inferred
    from what the user typed, a buggy client) cannot make it an accept the learner trains on."""
    o = Offsets()
    c = completion("w1", "", created_at=T0)
    c = c.model_copy(
        update={
            "choices": [
                CompletionChoice(index=0, token_ids=[7, 8], logprobs=[-2.0, -0.1], text="", finish_reason="withheld")
            ]
        }
    )
    accept = FeedbackEvent(completion_id="w1", type="select", created_at=T0 + timedelta(seconds=1))
    write(engine, completions=[o(c)], events=[o(accept)])
    assert sweep(engine, T0 + timedelta(seconds=61)) == (0, 1)
    with engine.connect() as conn:
        row = conn.execute(select(db.rewards)).one()
        choice = conn.execute(select(db.completion_choices)).one()
    assert (row.outcome, row.reward) == ("withheld", 0.0)
    assert (choice.finish_reason, choice.token_ids, choice.n_chars) == ("withheld", [7, 8], 0)
