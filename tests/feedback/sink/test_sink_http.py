"""Issue 5, acceptance 1 over HTTP: the API app, the real buffered producer, Kafka, the sink, SQL.

The model engine is a deterministic fake (the API is what is under test, not vLLM); the
producer is the real one, pointed at this test's own topics. Completion records are held
back until the events are in Kafka, so every event arrives before its completion.
"""

from __future__ import annotations

import inspect
import json
import uuid

import pytest
from sqlalchemy import select

from feedback import bus, db
from feedback.producer import BufferedProducer
from learner.formats import own_format
from tests.feedback.sink.sink_support import count, private_topics, running_sink, sink_settings, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.kafka]

TOKEN = "sink-http-test-token"


class FakeEngine:
    """Always suggests `text`, tokenized for real."""

    def __init__(self, tok, text: str = "return x"):
        self.tok, self.text = tok, text

    async def generate(self, prompt_ids, spec, request_id):
        from serving.engine import Sample

        ids = self.tok.encode(self.text, add_special_tokens=False).ids[: spec.max_tokens]
        yield [
            Sample(
                index=i,
                token_ids=ids,
                logprobs=[-0.5] * len(ids),
                top_logprobs=[],
                text=self.tok.decode(ids),
                finish_reason="stop",
            )
            for i in range(spec.n)
        ]

    async def abort(self, request_id):
        pass


class OwnTopics:
    """The API sends to the shared topic names; this maps them to the test's own, holding completions back."""

    def __init__(self, producer: BufferedProducer, topics: tuple[str, str]):
        self.producer, self.topics, self.held = producer, dict(zip((bus.COMPLETIONS, bus.EVENTS), topics)), []

    def send(self, topic, msg) -> bool:
        if topic == bus.COMPLETIONS:
            self.held.append(msg)
            return True
        return self.producer.send(self.topics[topic], msg)

    def release(self) -> None:
        for msg in self.held:
            self.producer.send(self.topics[bus.COMPLETIONS], msg)


@pytest.fixture(scope="module")
def tok():
    from learner.tokenizer import train_tokenizer

    return train_tokenizer([inspect.getsource(m) for m in (json.decoder, json.encoder)], vocab_size=512)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database_url(request, tmp_path):
    return f"sqlite:///{tmp_path / 'http.db'}" if request.param == "sqlite" else request.getfixturevalue("postgres_url")


def test_events_over_http_are_stored_exactly_once(kafka_settings, database_url, tok):
    from fastapi.testclient import TestClient

    from serving.http.app import build_app
    from serving.http.deps import ApiState
    from serving.replica import CompletionService
    from serving.settings import ServeSettings

    with private_topics(kafka_settings) as topics:
        producer = BufferedProducer(kafka_settings.kafka)
        sink_to = OwnTopics(producer, topics)
        cfg = ServeSettings(auth_tokens=[TOKEN])
        app = build_app()
        service = CompletionService(FakeEngine(tok), tok, own_format(tok, 2048), cfg, version=3)
        app.state.api = ApiState(
            cfg=cfg,
            replicas={"stable": service},
            producer=sink_to,
            editor_tokens=cfg.editor_tokens(),
            decode=tok.decode,
        )
        client = TestClient(app)
        client.headers["Authorization"] = f"Bearer {TOKEN}"

        cids = []
        for i in range(10):
            r = client.post(
                "/v1/completions",
                json={
                    "language": "python",
                    "segments": {"prefix": f"def f{i}(x):\n    ", "suffix": "\n"},
                    "user": f"u{i % 3}",
                },
            )
            assert r.status_code == 200, r.text
            cids.append(r.json()["id"])
        sent: dict[str, dict] = {}
        for cid in cids:
            for body in (
                {"type": "view"},
                {"type": "select", "select_kind": "full"},
                {"type": "edit", "kept_text": "return x + 1"},
            ):
                eid = str(uuid.uuid4())
                sent[eid] = {"completion_id": cid, "event_id": eid, **body}
                for _ in range(2 if body["type"] == "select" else 1):  # a client retry: same event_id twice
                    assert client.post("/v1/events", json=sent[eid]).status_code == 200
        assert producer.flush(30)

        engine = db.make_engine(database_url)
        db.upgrade(engine)
        with running_sink(sink_settings(kafka_settings, database_url, topics, feedback_window_s=5)):
            wait_until(
                lambda: count(engine, "pending_events") == len(sent), 30, "events held until their completions arrive"
            )
            sink_to.release()
            assert producer.flush(30)
            wait_until(
                lambda: count(engine, "events") == len(sent) and count(engine, "rewards") == len(cids),
                60,
                "every row and reward",
            )
        producer.close()

        with engine.connect() as conn:
            stored = {r.event_id: r for r in conn.execute(select(db.events))}
            comps = {r.completion_id: r for r in conn.execute(select(db.completions))}
            rewards = {r.completion_id: r for r in conn.execute(select(db.rewards))}
        assert stored.keys() == sent.keys() and comps.keys() == set(cids)
        assert all(
            stored[e].type == body["type"] and stored[e].completion_id == body["completion_id"]
            for e, body in sent.items()
        )
        assert {c.model_version for c in comps.values()} == {3} and {c.language for c in comps.values()} == {"python"}
        # An edit keeping "return x + 1" of "return x": 2*8/20 similar.
        assert all(r.outcome == "edit" and r.reward == pytest.approx(0.75 * 16 / 20) for r in rewards.values())
        assert count(engine, "dead_letters") == 0 and count(engine, "pending_events") == 0
        engine.dispose()
