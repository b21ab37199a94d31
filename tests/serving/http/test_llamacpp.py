"""POST /infill as llama.vscode sends it (src/llama-server.ts): its warm-up, its completions, their fields."""

import asyncio
import inspect
import json
import textwrap
from dataclasses import dataclass

import pytest

from serving.engine import Sample
from tests.serving.conftest import FakeEngine, make_client

# llama.vscode's ring buffer of chunks from files the user opened or edited, the most recent last.
CHUNKS = [
    {"text": "def helper(a):\n    return a + 1\n", "time": 1733140000000, "filename": "/home/ana/shop/util.py"},
    {"text": "class Item:\n    price: int\n", "time": 1733140005000, "filename": "/home/ana/shop/models.py"},
]
WARM_UP = {
    "id_slot": 0,
    "input_prefix": "",
    "input_suffix": "",
    "input_extra": CHUNKS,
    "prompt": "",
    "n_predict": 0,
    "samplers": [],
    "cache_prompt": True,
    "t_max_prompt_ms": 500,
    "t_max_predict_ms": 1,
}
INFILL = {
    "id_slot": 0,
    "input_prefix": "from shop.util import helper\n\n\ndef total(items):\n",
    "input_suffix": "\n",
    "input_extra": CHUNKS,
    "prompt": "    ",  # the current line up to the cursor
    "n_predict": 128,
    "n_cmpl": 3,
    "top_k": 40,
    "top_p": 0.99,
    "stream": False,
    "samplers": ["top_k", "top_p", "infill"],
    "cache_prompt": True,
    "n_indent": 4,
    "t_max_prompt_ms": 500,
    "t_max_predict_ms": 2500,
}


def test_a_warm_up_prefills_the_prompt_of_the_next_request_and_records_nothing(tok):
    client, sink, engine = make_client(tok)
    same = {k: INFILL[k] for k in ("input_prefix", "input_suffix", "input_extra", "prompt")}
    r = client.post("/infill", json={**WARM_UP, **same})
    assert r.status_code == 200, r.text
    warm = r.json()
    # the shape llama.vscode reads, empty: no completion to show, none to send events for
    assert warm["content"] == "" and warm["tokens_predicted"] == 0 and warm["stop"] is True
    assert warm["generation_settings"]["n_ctx"] > 0 and warm["timings"]["predicted_n"] == 0
    assert "completion_id" not in warm
    ((prompt_ids, spec, request_id),) = engine.calls
    assert (spec.max_tokens, spec.temperature, spec.n) == (1, 0.0, 1) and request_id.startswith("warmup-")
    assert warm["tokens_evaluated"] == warm["timings"]["prompt_n"] == len(prompt_ids)
    assert sink.sent == []  # no record on Kafka, so no reward
    # the real request with those fields runs the very prompt the warm-up put in the cache
    assert client.post("/infill", json={**INFILL, "n_cmpl": 1}).status_code == 200
    assert engine.calls[1][0] == prompt_ids and len(sink.sent) == 1


def test_llama_vscodes_own_warm_up_prefills_its_chunks(tok):
    """llama.vscode warms up with the chunks alone: they open every prompt it sends next."""
    client, sink, engine = make_client(tok)
    r = client.post("/infill", json=WARM_UP)
    assert r.status_code == 200 and r.json()["content"] == "" and r.json()["tokens_predicted"] == 0
    assert client.post("/infill", json={**INFILL, "n_cmpl": 1}).status_code == 200
    (warmed, _, _), (prompted, _, _) = engine.calls
    chunks = tok.encode(
        "<|file_sep|>/home/ana/shop/util.py\ndef helper(a):\n    return a + 1\n\n"
        "<|file_sep|>/home/ana/shop/models.py\nclass Item:\n    price: int\n\n",
        add_special_tokens=False,
    ).ids
    assert warmed[: len(chunks)] == prompted[: len(chunks)] == chunks
    assert len(sink.sent) == 1  # the completion's record only


def test_a_warm_up_obeys_the_token_the_rate_limit_and_the_prompt_limit(tok):
    client, sink, engine = make_client(tok, limits={"completions": "2/minute"})
    assert client.post("/infill", json=WARM_UP, headers={"Authorization": "Bearer nope"}).status_code == 401
    big = {**WARM_UP, "input_prefix": "x" * 150_000, "prompt": "y" * 60_000}
    r = client.post("/infill", json=big)
    assert r.status_code == 413 and "exceeds the limit" in r.json()["error"]["message"]
    assert not engine.calls  # refused before the engine
    assert client.post("/infill", json=WARM_UP).status_code == 200
    r = client.post("/infill", json=WARM_UP)  # a warm-up counts as a completion request
    assert r.status_code == 429 and "retry-after" in r.headers
    assert len(engine.calls) == 1 and not sink.sent


def test_a_warm_up_the_replica_fails_is_a_503(tok):
    client, sink, engine = make_client(tok, engine=FakeEngine(tok, fail=True))
    r = client.post("/infill", json=WARM_UP)
    assert r.status_code == 503 and "unavailable" in r.json()["error"]["message"] and not sink.sent


def test_llama_vscode_infill_gets_its_completions_and_is_recorded(tok):
    client, sink, engine = make_client(tok)
    r = client.post("/infill", json=INFILL)
    assert r.status_code == 200, r.text
    answers = r.json()  # n_cmpl > 1: an array, each with the `content` llama.vscode reads
    assert [a["content"] for a in answers] == ["return x"] * 3 and [a["index"] for a in answers] == [0, 1, 2]
    a = answers[0]
    assert a["stop"] is True and a["tokens_predicted"] > 0 and a["tokens_evaluated"] > 0
    assert a["generation_settings"]["n_ctx"] > 0 and a["timings"]["predicted_n"] == a["tokens_predicted"]
    assert isinstance(a["tokens_cached"], int) and a["truncated"] is False
    text = tok.decode(engine.calls[0][0], skip_special_tokens=False)
    # The chunks are other files, the most recent nearest the cursor; the prompt ends the prefix.
    assert text == (
        "<|file_sep|>/home/ana/shop/util.py\ndef helper(a):\n    return a + 1\n\n"
        "<|file_sep|>/home/ana/shop/models.py\nclass Item:\n    price: int\n\n"
        "<|fim_prefix|>from shop.util import helper\n\n\ndef total(items):\n    <|fim_suffix|>\n<|fim_middle|>"
    )
    spec = engine.calls[0][1]
    assert spec.n == 3 and spec.max_tokens == 128 and spec.top_p == 0.99
    ((_, rec),) = sink.sent
    assert rec.completion_id == a["completion_id"] and len(rec.choices) == 3


def test_one_completion_is_one_object(tok):
    client, _, _ = make_client(tok)
    r = client.post("/infill", json={**INFILL, "n_cmpl": 1})
    assert r.status_code == 200 and r.json()["content"] == "return x"


@dataclass
class SlowEngine(FakeEngine):
    """Writes one token every `delay_s`, as a loaded replica does."""

    delay_s: float = 0.05

    async def generate(self, prompt_ids, spec, request_id):
        self.calls.append((prompt_ids, spec, request_id))
        ids = self.tok.encode(self.text, add_special_tokens=False).ids
        for k in range(1, len(ids) + 1):
            await asyncio.sleep(self.delay_s)
            done = k == len(ids)
            yield [Sample(0, ids[:k], [-0.5] * k, [], self.tok.decode(ids[:k]), "stop" if done else None)]


def test_t_max_predict_ms_ends_a_completion_at_a_new_line_after_the_time(tok):
    long_text = "a = 1\nb = 2\nc = 3\nd = 4\ne = 5\nf = 6\n"
    client, sink, _ = make_client(tok, engine=SlowEngine(tok, text=long_text))
    r = client.post("/infill", json={**INFILL, "n_cmpl": 1, "t_max_predict_ms": 1})
    assert r.status_code == 200, r.text
    content = r.json()["content"]
    assert "\n" in content and long_text.startswith(content) and len(content) < len(long_text)
    assert r.json()["stop_type"] == "limit"
    choice = sink.sent[0][1].choices[0]  # the record holds exactly what was answered
    assert choice.text == content and tok.decode(choice.token_ids) == content and choice.finish_reason == "length"


def test_streaming_infill_sends_content_then_a_stop_event(tok):
    client, sink, _ = make_client(tok)
    with client.stream("POST", "/infill", json={**INFILL, "n_cmpl": 1, "stream": True}) as r:
        assert r.status_code == 200
        events = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: ")]
    assert "".join(e["content"] for e in events) == "return x"
    assert events[-1]["stop"] is True and events[-1]["tokens_predicted"] > 0
    assert all(e["stop"] is False for e in events[:-1]) and len(sink.sent) == 1


def test_crlf_prefix_gets_a_crlf_answer(tok):
    client, _, engine = make_client(tok, engine=FakeEngine(tok, text="a = 1\nb = 2"))
    r = client.post("/infill", json={"input_prefix": "def f():\r\n", "prompt": "    ", "input_suffix": "\r\n"})
    assert r.status_code == 200 and r.json()["content"] == "a = 1\r\nb = 2"
    assert "\r" not in tok.decode(engine.calls[0][0])


def test_bad_infill_input_is_4xx_naming_the_field(tok):
    client, sink, engine = make_client(tok)
    cases = [
        ({**INFILL, "n_cmpl": 9}, 400, "n_cmpl"),
        ({**INFILL, "input_extra": [{"filename": "a.py", "text": "x" * 20_000}]}, 422, "input_extra.0.text"),
        ({**INFILL, "n_predict": -5}, 422, "n_predict"),
        ({**INFILL, "stop": [f"s{i}" for i in range(40)]}, 422, "stop"),
    ]
    for body, status, field in cases:
        r = client.post("/infill", json=body)
        assert r.status_code == status and r.json()["error"]["message"].startswith(field), r.text
    client.headers.pop("Authorization")
    assert client.post("/infill", json=INFILL).status_code == 401
    assert not sink.sent and not engine.calls


# --- with vLLM ------------------------------------------------------------------------------------


def _source_prefix(module, tok, n_tokens: int) -> str:
    """The first lines of `module`'s source, at least `n_tokens` tokens of them."""
    lines = inspect.getsource(module).splitlines(keepends=True)
    for k in range(1, len(lines) + 1):
        if len(tok.encode("".join(lines[:k]), add_special_tokens=False).ids) >= n_tokens:
            return "".join(lines[:k])
    raise AssertionError(f"{module.__name__} is shorter than {n_tokens} tokens")


@pytest.mark.slow
def test_a_warm_up_fills_vllms_prefix_cache_for_the_next_request(tok, vllm_engine):
    """After a warm-up, the same request finds all of its prompt's full KV blocks but the one
    holding its last token (which vLLM always recomputes) in vLLM's prefix cache; a request
    that nothing warmed finds none."""
    block = vllm_engine.llm.vllm_config.cache_config.block_size
    client, sink, _ = make_client(tok, engine=vllm_engine)
    # two prompts that differ from their first token (no chunks, which would open both) and span
    # a few blocks, within serve.context_budget so that nothing is summarized
    budget = client.app.state.api.cfg.context_budget
    cold = {"input_prefix": _source_prefix(json.decoder, tok, 2 * block + 8), "input_suffix": "\n", "prompt": ""}
    warm = {"input_prefix": _source_prefix(textwrap, tok, 2 * block + 8), "input_suffix": "\n", "prompt": ""}
    ask = {"n_predict": 4, "n_cmpl": 1, "temperature": 0.0}
    with client:  # one event loop for every request: the engine's output handler lives on it
        unwarmed = client.post("/infill", json={**cold, **ask}).json()
        warm_up = client.post("/infill", json={**warm, "n_predict": 0}).json()
        warmed = client.post("/infill", json={**warm, **ask}).json()
    n = warmed["tokens_evaluated"]
    print(
        f"\nvLLM block size {block}: unwarmed {unwarmed['tokens_cached']} of {unwarmed['tokens_evaluated']} "
        f"prompt tokens cached; after a warm-up {warmed['tokens_cached']} of {n}"
    )
    assert 2 * block < n <= budget and unwarmed["tokens_evaluated"] > 2 * block
    assert unwarmed["tokens_cached"] == 0
    assert warm_up["content"] == "" and warm_up["tokens_predicted"] == 0 and warm_up["tokens_evaluated"] == n
    assert warm_up["tokens_cached"] == 0  # nothing had run this prompt before the warm-up
    assert warmed["tokens_cached"] == (n - 1) // block * block
    assert [rec.completion_id for _, rec in sink.sent] == [unwarmed["completion_id"], warmed["completion_id"]]
