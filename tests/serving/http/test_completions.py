"""POST /v1/completions as real editor clients send it: Continue (a client-rendered FIM prompt, many
stop strings, streaming) and Tabby's agent (declarations and snippets, language stops, CRLF)."""

import dataclasses
import json

from feedback import bus
from learner.fim import fim_prompt_ids
from tests.serving.conftest import FakeEngine, make_client

# Continue's autocomplete with an OpenAI-compatible provider and a Qwen2.5-Coder model: it renders
# the Qwen FIM template itself and sends it as the prompt, without a suffix, streaming, with the
# template's stop tokens and its common stops (core/autocomplete: getStopTokens).
CONTINUE_PREFIX = "import math\n\n\ndef area(r):\n    return "
CONTINUE_SUFFIX = "\n\n\nprint(area(2))\n"
CONTINUE_BODY = {
    "model": "flywheel",
    "prompt": f"<|fim_prefix|>{CONTINUE_PREFIX}<|fim_suffix|>{CONTINUE_SUFFIX}<|fim_middle|>",
    "max_tokens": 64,
    "temperature": 0.01,
    "stop": ["<|endoftext|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "/src/", "#- coding: utf-8", "```"],
    "stream": True,
}


def test_continue_streams_a_completion_of_its_rendered_fim_prompt_through_flywheels_prompt(tok, fmt):
    client, sink, engine = make_client(tok)
    with client.stream("POST", "/v1/completions", json=CONTINUE_BODY) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    # What Continue's OpenAI provider reads: `data:` chunks of choices[0].text, then [DONE].
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "return x"
    prompt_ids, spec, _ = engine.calls[0]
    assert prompt_ids == fim_prompt_ids(fmt, tok, CONTINUE_PREFIX, CONTINUE_SUFFIX)  # read back, prompted our way
    assert spec.stop == tuple(CONTINUE_BODY["stop"]) and spec.max_tokens == 64
    ((topic, rec),) = sink.sent
    assert topic == bus.COMPLETIONS and rec.completion_id == chunks[0]["id"] and rec.prompt_token_ids == prompt_ids


def test_the_confidence_gate_withholds_an_unsure_suggestion_at_a_cursor_and_records_what_it_hid(tok):
    """model.min_confidence (learner/confidence.py): a first token below it means an empty
    completion that ends normally; the record keeps the tokens with finish_reason "withheld"."""
    import math

    from serving import metrics

    body = {"prompt": "x = ", "suffix": "\n", "max_tokens": 8}
    unsure = FakeEngine(tok, first_logprob=math.log(0.2))
    client, sink, _ = make_client(tok, unsure, min_confidence=0.25)
    counted = metrics.WITHHELD.labels("3")._value.get()
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0] | {"logprobs": None} == {
        "index": 0,
        "text": "",
        "logprobs": None,
        "finish_reason": "stop",
    }
    with client.stream("POST", "/v1/completions", json=body | {"stream": True}) as s:
        chunks = [json.loads(ln[6:]) for ln in s.iter_lines() if ln.startswith("data: {")]
    assert (
        "".join(c["choices"][0]["text"] for c in chunks) == "" and chunks[-1]["choices"][0]["finish_reason"] == "stop"
    )
    records = [m for t, m in sink.sent if t == bus.COMPLETIONS]
    assert [(c.finish_reason, c.text, len(c.token_ids)) for rec in records for c in rec.choices] == [
        ("withheld", "", len(tok.encode("return x", add_special_tokens=False).ids))
    ] * 2
    assert metrics.WITHHELD.labels("3")._value.get() == counted + 2  # flywheel_withheld_suggestions_total{version}

    # a sure one is shown; a plain continuation (no cursor) is never gated; 0 turns the gate off
    sure = FakeEngine(tok, first_logprob=math.log(0.3))
    assert (
        make_client(tok, sure, min_confidence=0.25)[0].post("/v1/completions", json=body).json()["choices"][0]["text"]
        == "return x"
    )
    plain = client.post("/v1/completions", json={"prompt": "x = ", "max_tokens": 8}).json()["choices"][0]
    assert plain["text"] == "return x"
    assert make_client(tok, unsure)[0].post("/v1/completions", json=body).json()["choices"][0]["text"] == "return x"

    # an abstention (or a suggestion a stop string cut to nothing) has nothing to withhold
    from serving.engine import Sample
    from serving.replica import _gated

    empty = Sample(index=0, token_ids=[5], logprobs=[math.log(0.01)], text="", finish_reason="stop")
    assert _gated(empty, 0.25) is empty


def test_the_versions_show_policy_withholds_after_the_gate_and_explores_a_share(tok):
    """learner/show.py: the served version's policy withholds a suggestion the gate would show
    (recorded "withheld", as the gate's); a completion it explores is shown; streamed, a
    suggestion under a policy arrives whole, since the policy reads all of it."""
    from serving.http.routing import STABLE
    from tests.helpers import logprob_policy

    never = logprob_policy(weights=(0.0,) * 5, bias=-10.0, samples=64, accepts=8)
    body = {"prompt": "x = ", "suffix": "\n", "max_tokens": 8}
    client, sink, _ = make_client(tok, min_confidence=0.25)
    service = client.app.state.api.replicas[STABLE].service
    service.show_policy = never
    assert client.post("/v1/completions", json=body).json()["choices"][0]["text"] == ""
    assert client.post("/v1/completions", json={"prompt": "x = ", "max_tokens": 8}).json()["choices"][0]["text"] == (
        "return x"  # a plain continuation is never gated
    )
    records = [m for t, m in sink.sent if t == bus.COMPLETIONS]
    assert [c.finish_reason for c in records[0].choices] == ["withheld"]

    service.show_policy = dataclasses.replace(never, explore=1.0)  # explores every completion
    assert client.post("/v1/completions", json=body).json()["choices"][0]["text"] == "return x"

    service.show_policy = dataclasses.replace(never, bias=10.0)  # shows everything
    with client.stream("POST", "/v1/completions", json=body | {"stream": True}) as s:
        chunks = [json.loads(ln[6:]) for ln in s.iter_lines() if ln.startswith("data: {")]
    texts = [c["choices"][0]["text"] for c in chunks]
    assert "".join(texts) == "return x" and texts.count("return x") == 1  # one piece, not token by token


def test_the_show_policy_reads_the_line_before_the_requests_cursor(tok):
    """A policy with the cursor context (learner.show.CONTEXT_FEATURES) reads the request's last
    line of prefix: here it shows a suggestion after a dot and withholds one after a space."""
    from learner.show import FEATURES, ShowPolicy
    from serving.http.routing import STABLE

    after_dot = ShowPolicy(
        mean=(0.0,) * len(FEATURES),
        scale=(1.0,) * len(FEATURES),
        weights=tuple(20.0 if n == "line_ends_in_dot" else 0.0 for n in FEATURES),
        bias=-10.0,
        threshold=0.25,
        samples=64,
        accepts=8,
    )
    client, _, _ = make_client(tok, min_confidence=0.25)
    client.app.state.api.replicas[STABLE].service.show_policy = after_dot
    text = lambda prompt: client.post(  # noqa: E731
        "/v1/completions", json={"prompt": prompt, "suffix": "\n", "max_tokens": 8}
    ).json()["choices"][0]["text"]
    assert text("def f(x):\n    y = x.") == "return x" and text("def f(x):\n    y = ") == ""


def test_a_rendered_prompt_with_the_repository_keeps_its_files_and_path(tok):
    client, sink, engine = make_client(tok)
    prompt = (
        "<|repo_name|>shop\n<|file_sep|>shop/util.py\ndef helper(a):\n    return a\n"
        "<|file_sep|>shop/app.py\n<|fim_prefix|>x = <|fim_suffix|>\n<|fim_middle|>"
    )
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8})
    assert r.status_code == 200, r.text
    text = tok.decode(engine.calls[0][0], skip_special_tokens=False)
    assert text == prompt  # Flywheel's own model has Qwen's layout, so its prompt is the client's
    assert sink.sent[0][1].filepath == "shop/app.py"


def test_a_plain_prompt_stays_a_plain_continuation(tok):
    client, _, engine = make_client(tok)
    r = client.post("/v1/completions", json={"prompt": "marker = '<|fim_prefix|>'\n", "max_tokens": 8})
    assert r.status_code == 200, r.text
    assert tok.decode(engine.calls[0][0], skip_special_tokens=False) == "marker = '<|fim_prefix|>'\n"
    assert tok.token_to_id("<|fim_middle|>") not in engine.calls[0][0]


def test_stop_strings_up_to_the_setting_then_422_naming_the_field(tok):
    client, sink, engine = make_client(tok, max_stop_strings=8)
    ok = client.post("/v1/completions", json={"prompt": "x", "stop": [f"s{i}" for i in range(8)]})
    assert ok.status_code == 200, ok.text
    r = client.post("/v1/completions", json={"prompt": "x", "stop": [f"s{i}" for i in range(9)]})
    assert r.status_code == 422 and r.json()["error"]["message"].startswith("stop: 9 stop strings")
    assert len(sink.sent) == 1 and len(engine.calls) == 1


# Tabby's agent (clients/tabby-agent): its completion request with the repository context it collects.
TABBY_BODY = {
    "language": "python",
    "segments": {
        "prefix": "from shop.util import helper\n\n\ndef total(items):\n    ",
        "suffix": "\n",
        "filepath": "shop/app.py",
        "git_url": "https://github.com/acme/shop.git",
        "declarations": [{"filepath": "shop/util.py", "body": "def helper(a):\n    return a + 1"}],
        "relevant_snippets_from_changed_files": [
            {"filepath": "shop/cart.py", "body": "def cart_sum(c):\n    return sum(c)", "score": 0.4},
            {"filepath": "shop/models.py", "body": "class Item:\n    price: int", "score": 0.9},
        ],
        "relevant_snippets_from_recently_opened_files": [
            {"filepath": "shop/db.py", "body": "def connect():\n    return None", "score": 0.7}
        ],
        "clipboard": "",
    },
    "temperature": 0.2,
    "mode": "standard",
}


def test_tabby_declarations_and_snippets_reach_the_prompt_nearest_first(tok):
    client, sink, engine = make_client(tok)
    r = client.post("/v1/completions", json=TABBY_BODY)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "return x"
    text = tok.decode(engine.calls[0][0], skip_special_tokens=False)
    # Farthest first, so the most relevant (the declarations) sits right before the current file.
    order = ["shop/db.py", "shop/cart.py", "shop/models.py", "shop/util.py", "shop/app.py"]
    assert text.startswith("<|repo_name|>shop\n<|file_sep|>shop/db.py\ndef connect():\n    return None\n")
    assert [text.index(f"<|file_sep|>{p}\n") for p in order] == sorted(text.index(f"<|file_sep|>{p}\n") for p in order)
    assert text.endswith(
        "<|file_sep|>shop/app.py\n<|fim_prefix|>" + TABBY_BODY["segments"]["prefix"] + "<|fim_suffix|>\n<|fim_middle|>"
    )
    spec = engine.calls[0][1]
    assert "\n\n" in spec.stop and "\ndef " in spec.stop and "\nclass " in spec.stop  # Python's top level ends it
    assert sink.sent[0][1].language == "python" and sink.sent[0][1].filepath == "shop/app.py"


def test_tabby_context_is_trimmed_to_the_budget(tok):
    client, _, engine = make_client(tok, context_budget=256, repo_context_tokens=96)
    big = "".join(f"def f_{i}(a):\n    return a * {i}\n" for i in range(200))
    body = json.loads(json.dumps(TABBY_BODY))
    body["segments"]["prefix"] = big + body["segments"]["prefix"]
    body["segments"]["relevant_snippets_from_changed_files"].append({"filepath": "big.py", "body": big[:9000]})
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    ids = next(c[0] for c in engine.calls if not c[2].startswith("sum-"))  # not a summary written after it
    text = tok.decode(ids, skip_special_tokens=False)
    assert len(ids) <= 256 and "<|file_sep|>shop/util.py\n" in text  # the declaration, the most relevant, stays
    assert "shop/db.py" not in text  # the least relevant does not fit


def test_tabby_crlf_file_gets_a_crlf_suggestion(tok):
    client, _, engine = make_client(tok, engine=FakeEngine(tok, text="a = 1\nb = 2"))
    body = {"language": "python", "segments": {"prefix": "def f():\r\n    ", "suffix": "\r\n"}}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert "\r" not in tok.decode(engine.calls[0][0]) and r.json()["choices"][0]["text"] == "a = 1\r\nb = 2"


def test_tabby_cursor_after_code_gets_the_rest_of_the_line(tok):
    # After code on the cursor's line the suggestion ends at the newline (CRLF files too); at the
    # start of a line (TABBY_BODY: only indentation before the cursor) it may be a block.
    client, _, engine = make_client(tok)
    for prefix in ("def total(items):\n    return sum(", "def total(items):\r\n    return sum("):
        body = {"language": "python", "segments": {"prefix": prefix, "suffix": ")\n"}}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert engine.calls[-1][1].stop == ("\n",)


def test_tabby_next_edit_suggestion_is_refused_clearly(tok):
    client, sink, engine = make_client(tok)
    r = client.post("/v1/completions", json={**TABBY_BODY, "mode": "next_edit_suggestion"})
    assert r.status_code == 400 and "next_edit_suggestion" in r.json()["error"]["message"]
    assert "not supported" in r.json()["error"]["message"] and not sink.sent and not engine.calls


def test_the_record_carries_the_engines_routing_trace_unless_it_is_too_long(tok):
    from feedback.routing import encode_routing
    from serving import metrics

    trace = encode_routing([[[0, 1]] * 5])
    client, sink, engine = make_client(tok, FakeEngine(tok, routing=trace), max_routing_chars=len(trace))
    before = metrics.ROUTES.labels("too_long")._value.get()
    assert client.post("/v1/completions", json={"prompt": "def f(", "max_tokens": 4}).status_code == 200
    engine.routing = trace + "A" * 8  # one the record may not carry: left out, counted
    assert client.post("/v1/completions", json={"prompt": "def g(", "max_tokens": 4}).status_code == 200
    records = [m for t, m in sink.sent if t == bus.COMPLETIONS]
    assert [r.routing for r in records] == [trace, None]
    assert metrics.ROUTES.labels("too_long")._value.get() == before + 1


def test_every_completion_route_records_the_text_either_side_of_the_cursor(tok):
    """What the sink's implicit feedback compares with the next request: bounded on both sides."""
    from feedback.schemas import CURSOR_CONTEXT_CHARS

    client, sink, _ = make_client(tok)
    long_prefix = "x = 1\n" * 400 + CONTINUE_PREFIX  # longer than the bound
    body = CONTINUE_BODY | {
        "stream": False,
        "prompt": f"<|fim_prefix|>{long_prefix}<|fim_suffix|>{CONTINUE_SUFFIX}<|fim_middle|>",
    }
    assert client.post("/v1/completions", json=body).status_code == 200
    tabby = {"language": "python", "segments": {"prefix": "a\r\nb = ", "suffix": "\r\nc\r\n", "filepath": "m.py"}}
    assert client.post("/v1/completions", json=tabby).status_code == 200
    infill = {"input_prefix": "def f():\n", "prompt": "    return ", "input_suffix": "\n\nf()\n", "n_predict": 4}
    assert client.post("/infill", json=infill).status_code == 200
    ollama = {"model": "flywheel", "prompt": "y = ", "suffix": "\nz = 2\n", "stream": False}
    assert client.post("/api/generate", json=ollama).status_code == 200
    cursors = [(rec.before_cursor, rec.after_cursor) for topic, rec in sink.sent if topic == bus.COMPLETIONS]
    assert cursors == [
        (long_prefix[-CURSOR_CONTEXT_CHARS:], CONTINUE_SUFFIX),
        ("a\nb = ", "\nc\n"),  # line endings as the prompt is built: one newline
        ("def f():\n    return ", "\n\nf()\n"),
        ("y = ", "\nz = 2\n"),
    ]
    assert [rec.filepath for _, rec in sink.sent] == [None, "m.py", None, None]
