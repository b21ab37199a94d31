"""Ollama's /api/generate, /api/tags, /api/version as Twinny and Continue's Ollama provider call them."""

import json

from learner.fim import fim_prompt_ids
from tests.serving.conftest import make_client

PREFIX = "def area(r):\n    return "
SUFFIX = "\n"
# Twinny (src/extension/provider-options.ts, fim-templates.ts): the Qwen template rendered by the
# plugin, streamed, with its temperature and FIM token limit.
TWINNY = {
    "model": "qwen2.5-coder:1.5b",
    "prompt": f"<|fim_prefix|>{PREFIX}<|fim_suffix|>{SUFFIX}<|fim_middle|>",
    "stream": True,
    "keep_alive": "5m",
    "options": {"temperature": 0.2, "num_predict": 512},
}


def test_twinny_streams_ndjson_through_flywheels_prompt(tok, fmt):
    client, sink, engine = make_client(tok)
    with client.stream("POST", "/api/generate", json=TWINNY) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(ln) for ln in r.iter_lines() if ln]
    # What Twinny reads: `response` of each line until `done`.
    assert "".join(ln["response"] for ln in lines) == "return x"
    assert all(ln["done"] is False for ln in lines[:-1]) and lines[-1]["done"] is True
    assert lines[-1]["done_reason"] == "stop" and lines[-1]["eval_count"] > 0 and lines[0]["model"] == TWINNY["model"]
    prompt_ids, spec, _ = engine.calls[0]
    assert prompt_ids == fim_prompt_ids(fmt, tok, PREFIX, SUFFIX)
    assert spec.max_tokens == 256 and spec.temperature == 0.2  # num_predict cut to serve.max_tokens_limit
    ((_, rec),) = sink.sent
    assert rec.completion_id == lines[-1]["completion_id"] and rec.prompt_token_ids == prompt_ids


def test_continue_ollama_fim_with_a_suffix_whole(tok, fmt):
    client, sink, engine = make_client(tok)
    body = {
        "model": "flywheel",
        "prompt": PREFIX,
        "suffix": SUFFIX,
        "raw": True,
        "stream": False,
        "options": {"num_predict": 64, "temperature": 0.01, "top_p": 0.9, "seed": 7, "stop": ["\n\n", "```"]},
        "keep_alive": 1800,
    }
    r = client.post("/api/generate", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["response"] == "return x" and out["done"] is True and out["done_reason"] == "stop"
    prompt_ids, spec, _ = engine.calls[0]
    assert prompt_ids == fim_prompt_ids(fmt, tok, PREFIX, SUFFIX)
    assert (spec.max_tokens, spec.top_p, spec.seed, spec.stop) == (64, 0.9, 7, ("\n\n", "```"))
    assert len(sink.sent) == 1


def test_a_plain_prompt_is_continued(tok):
    client, _, engine = make_client(tok)
    r = client.post("/api/generate", json={"model": "flywheel", "prompt": "x = ", "stream": False})
    assert r.status_code == 200 and tok.decode(engine.calls[0][0], skip_special_tokens=False) == "x = "


def test_load_call_generates_nothing(tok):
    client, sink, engine = make_client(tok)
    r = client.post("/api/generate", json={"model": "flywheel"})
    assert r.status_code == 200 and r.json()["done_reason"] == "load" and r.json()["response"] == ""
    assert not engine.calls and not sink.sent


def test_num_predict_0_is_a_warm_up_that_records_nothing(tok, fmt):
    client, sink, engine = make_client(tok)
    body = {"model": "flywheel", "prompt": PREFIX, "suffix": SUFFIX, "stream": False, "options": {"num_predict": 0}}
    r = client.post("/api/generate", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["response"] == "" and out["done"] is True and out["eval_count"] == 0 and "completion_id" not in out
    ((prompt_ids, spec, _),) = engine.calls
    assert prompt_ids == fim_prompt_ids(fmt, tok, PREFIX, SUFFIX) and out["prompt_eval_count"] == len(prompt_ids)
    assert (spec.max_tokens, spec.temperature) == (1, 0.0)  # prefilled, one greedy token thrown away
    assert not sink.sent


def test_tags_and_version(tok):
    client, _, _ = make_client(tok)
    tags = client.get("/api/tags").json()["models"]
    assert [t["name"] for t in tags] == ["flywheel:latest", "flywheel:v3"] and all("details" in t for t in tags)
    client.headers.pop("Authorization")
    assert client.get("/api/tags").status_code == 401
    assert client.get("/api/version").json()["version"].count(".") == 2


def test_show_tells_the_window_and_that_it_fills_in_the_middle(tok):
    client, _, _ = make_client(tok)
    client.app.state.api.prompt_format = {"fim": "qwen", "window": 8192}
    shown = client.post("/api/show", json={"model": "flywheel:latest"}).json()
    assert "insert" in shown["capabilities"] and shown["model_info"]["flywheel.context_length"] == 2048  # the engine's
    assert "<|fim_prefix|>{{ .Prompt }}<|fim_suffix|>{{ .Suffix }}<|fim_middle|>" in shown["template"]
    assert client.post("/api/show", json={"name": "flywheel"}).status_code == 200  # older clients' field
    r = client.post("/api/show", json={"model": "llama3"})
    assert r.status_code == 404 and "flywheel" in r.json()["error"]["message"]


def test_a_version_tag_pins_the_version(tok):
    client, _, _ = make_client(tok)
    ok = client.post("/api/generate", json={"model": "flywheel:v3", "prompt": "x", "stream": False})
    assert ok.status_code == 200, ok.text
    r = client.post("/api/generate", json={"model": "flywheel:v9", "prompt": "x", "stream": False})
    assert r.status_code == 404 and "version 9" in r.json()["error"]["message"]


def test_bad_generate_input_is_4xx_naming_the_field(tok):
    client, sink, engine = make_client(tok)
    cases = [
        ({"prompt": "x"}, 422, "model"),
        ({**TWINNY, "options": {"temperature": "hot"}}, 422, "options.temperature"),
        ({**TWINNY, "options": {"stop": [f"s{i}" for i in range(40)]}}, 422, "options.stop"),
        ({**TWINNY, "prompt": "x" * 300_000}, 413, "prompt"),
    ]
    for body, status, field in cases:
        r = client.post("/api/generate", json=body)
        assert r.status_code == status and r.json()["error"]["message"].startswith(field), r.text
    client.headers.pop("Authorization")
    assert client.post("/api/generate", json=TWINNY).status_code == 401
    assert not sink.sent and not engine.calls
