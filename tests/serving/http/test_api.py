"""The HTTP API with a fake engine: shapes, records, auth, bad input."""

import json
import re

import pytest

from feedback import bus
from feedback.schemas import CompletionRecord, FeedbackEvent
from tests.serving.conftest import FakeEngine, make_client


def test_openai_shape_with_suffix_records_the_completion(tok):
    client, sink, engine = make_client(tok)
    r = client.post(
        "/v1/completions", json={"prompt": "def f(x):\n    ", "suffix": "\n", "max_tokens": 8, "user": "ana"}
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == "return x"
    assert body["model"] == "flywheel@v3" and body["id"].startswith("cmpl-")
    ((topic, rec),) = sink.sent
    assert topic == bus.COMPLETIONS and isinstance(rec, CompletionRecord)
    assert rec.completion_id == body["id"] and rec.model_version == 3
    assert len(rec.choices[0].logprobs) == len(rec.choices[0].token_ids) > 0
    prompt_ids, spec, _ = engine.calls[0]
    assert prompt_ids[0] == tok.token_to_id("<|fim_prefix|>") and prompt_ids[-1] == tok.token_to_id("<|fim_middle|>")
    assert rec.prompt_token_ids == prompt_ids and rec.user_hash != "ana"


def test_openai_logprobs_and_n(tok):
    client, _, _ = make_client(tok)
    r = client.post("/v1/completions", json={"prompt": "x = ", "max_tokens": 4, "n": 2, "logprobs": 1})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    lp = choices[0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"])


def test_tabby_shape_gets_tabby_answer(tok):
    client, sink, engine = make_client(tok)
    req = {
        "language": "python",
        "segments": {"prefix": "def f(x):\n    ", "suffix": "\n", "filepath": "a/b.py"},
        "user": "u1",
    }
    r = client.post("/v1/completions", json=req)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"] and body["choices"][0] == {**body["choices"][0], "index": 0, "text": "return x"}
    rec = sink.sent[0][1]
    assert rec.language == "python" and rec.filepath == "a/b.py"
    header = tok.decode(engine.calls[0][0], skip_special_tokens=False)
    assert header.startswith("<|file_sep|>a/b.py\n<|fim_prefix|>")  # the path as Qwen's FIM format has it


def test_streaming_sse(tok):
    client, sink, _ = make_client(tok)
    with client.stream("POST", "/v1/completions", json={"prompt": "y = ", "suffix": "", "stream": True}) as r:
        assert r.status_code == 200
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "return x"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert len(sink.sent) == 1


@pytest.mark.parametrize("kind", ["line", "word"])
def test_events_tabby_shape_and_extensions(tok, kind):
    client, sink, _ = make_client(tok)
    r = client.post(
        f"/v1/events?select_kind={kind}",
        json={"type": "select", "completion_id": "cmpl-1", "choice_index": 0, "view_id": "v", "elapsed": 120},
    )
    assert r.status_code == 200, r.text
    for ev in (
        {"type": "view", "completion_id": "cmpl-1"},
        {"type": "dismiss", "completion_id": "cmpl-1"},
        {"type": "edit", "completion_id": "cmpl-1", "kept_text": "kept"},
    ):
        assert client.post("/v1/events", json=ev).status_code == 200
    events = [m for t, m in sink.sent if t == bus.EVENTS]
    assert [e.type for e in events] == ["select", "view", "dismiss", "edit"]
    assert events[0].select_kind == kind and events[0].elapsed_ms == 120
    assert all(isinstance(e, FeedbackEvent) for e in events)


def test_event_id_from_client_is_kept(tok):
    client, sink, _ = make_client(tok)
    eid = "6f1c4c1e-3f4e-4f7a-9d0e-1b2c3d4e5f60"
    r = client.post("/v1/events", json={"type": "view", "completion_id": "c", "event_id": eid})
    assert r.json()["event_id"] == eid and str(sink.sent[0][1].event_id) == eid


def test_health_is_public_and_metrics_count(tok):
    client, _, _ = make_client(tok)
    client.headers.pop("Authorization")
    h = client.get("/v1/health")
    assert h.status_code == 200 and h.json()["model"] == "flywheel" and h.json()["device"] == "cpu"
    m = client.get("/metrics")
    assert m.status_code == 200 and "flywheel_http_requests_total" in m.text


def test_public_health_never_shows_the_database_error(tok):
    client, _, _ = make_client(tok)
    client.headers.pop("Authorization")
    client.app.state.api.routing.error = 'connection to server at "db.internal" (10.0.0.7), user "flywheel" failed'
    health = client.get("/v1/health").json()["flywheel"]
    assert health["routing_error"] and "db.internal" not in json.dumps(health) and "10.0.0.7" not in json.dumps(health)


@pytest.mark.parametrize(
    "headers, status",
    [({}, 401), ({"Authorization": "Bearer wrong"}, 401), ({"Authorization": "Basic abc"}, 401)],
)
def test_auth_refusals(tok, headers, status):
    client, sink, _ = make_client(tok)
    client.headers.pop("Authorization")
    for path, body in (("/v1/completions", {"prompt": "x"}), ("/v1/events", {"type": "view", "completion_id": "c"})):
        r = client.post(path, json=body, headers=headers)
        assert r.status_code == status and "error" in r.json()
    assert sink.sent == []


@pytest.mark.parametrize(
    "raw, status",
    [
        (b"{not json", 422),
        (b"\xff\xfe\x00garbage", 422),
        (json.dumps({}).encode(), 422),
        (json.dumps({"prompt": 5}).encode(), 422),
        (json.dumps({"prompt": "x", "max_tokens": 100000}).encode(), 400),
        (json.dumps({"prompt": "x", "max_tokens": 0}).encode(), 422),
        (json.dumps({"prompt": "x", "n": 50}).encode(), 400),
        (json.dumps({"prompt": "x", "temperature": "hot"}).encode(), 422),
        (json.dumps({"prompt": "x" * 300_000}).encode(), 413),
        (json.dumps({"language": "python", "segments": {"suffix": "x"}}).encode(), 422),
        (json.dumps({"prompt": "x", "model": "flywheel@v99"}).encode(), 404),
    ],
)
def test_bad_completion_input_is_4xx_with_message(tok, raw, status):
    client, sink, _ = make_client(tok)
    r = client.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    assert r.json()["error"]["message"]
    assert sink.sent == []


@pytest.mark.parametrize(
    "body",
    [
        {"type": "explode", "completion_id": "c"},
        {"type": "edit", "completion_id": "c"},
        {"type": "view"},
        {"type": "view", "completion_id": "bad id with spaces"},
        # beyond what the INTEGER columns hold: it used to be accepted (200) and stop the sink
        {"type": "select", "completion_id": "c", "accepted_chars": 10**30},
        {"type": "view", "completion_id": "c", "elapsed": 2**31},
    ],
)
def test_bad_events_are_422(tok, body):
    client, sink, _ = make_client(tok)
    r = client.post("/v1/events", json=body)
    assert r.status_code == 422 and r.json()["error"]["message"]
    assert sink.sent == []
    for field in ("accepted_chars", "elapsed"):
        if field in body:
            assert field in r.json()["error"]["message"]


def test_engine_failure_is_503_not_500(tok):
    client, sink, _ = make_client(tok, engine=FakeEngine(tok, fail=True))
    r = client.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 503 and sink.sent == []


def test_a_prefix_at_the_size_cap_costs_a_bounded_number_of_engine_calls(tok):
    client, sink, engine = make_client(tok, max_summaries_per_request=3, summarize_in_background=False)
    cap = client.app.state.api.cfg.max_prompt_chars
    lines = "".join(f"value_{i} = compute({i})\n" for i in range(cap // 10))  # distinct: no cached summary
    prefix = lines[: cap - 1]
    r = client.post("/v1/completions", json={"prompt": prefix, "suffix": "\n", "max_tokens": 4})
    assert r.status_code == 200, r.text
    summaries = [c for c in engine.calls if c[2].startswith("sum-")]
    assert len(summaries) == 3 and len(engine.calls) == 4  # three summaries, then the completion
    rec = sink.sent[0][1]
    assert len(rec.summary_ids) == 3 and len(rec.prompt_token_ids) <= client.app.state.api.cfg.context_budget


def test_missing_summaries_are_written_after_the_answer_and_the_files_next_request_uses_them(tok):
    """serve.summarize_in_background: the first request of a long file is answered at once with its
    prefix truncated; the replica then writes the summaries, and the next request carries them."""
    import time

    client, sink, engine = make_client(tok, max_summaries_per_request=3)
    lines = "".join(f"value_{i} = compute({i})\n" for i in range(2000))
    body = {"prompt": lines, "suffix": "\n", "max_tokens": 4}
    with client:  # one event loop for both requests, as a served app has
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        first = sink.sent[0][1]
        assert first.summary_ids == [] and len(first.prompt_token_ids) <= client.app.state.api.cfg.context_budget
        assert not [c for c in engine.calls[:1] if c[2].startswith("sum-")]  # the answer came first
        deadline = time.monotonic() + 30
        while sum(c[2].startswith("sum-") for c in engine.calls) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        written = [c[0] for c in engine.calls if c[2].startswith("sum-")]
        assert len(written) == 3
        newest = [max(int(n) for n in re.findall(r"value_(\d+)", tok.decode(ids))) for ids in written]
        assert newest == sorted(newest, reverse=True)  # the chunk nearest the cursor first
        calls = len(engine.calls)
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
    second = sink.sent[1][1]
    assert len(second.summary_ids) == 3 and len(engine.calls) == calls + 1  # cached: only the completion
