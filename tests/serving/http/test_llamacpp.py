"""POST /infill as llama.vscode sends it (src/llama-server.ts): its warm-up, its completions, their fields."""

import asyncio
import json
from dataclasses import dataclass

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


def test_warm_up_answers_at_once_and_generates_nothing(tok):
    client, sink, engine = make_client(tok)
    r = client.post("/infill", json=WARM_UP)
    assert r.status_code == 200, r.text
    assert r.json()["content"] == "" and r.json()["tokens_predicted"] == 0
    assert not engine.calls and not sink.sent


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
