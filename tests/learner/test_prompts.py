"""Prompt building: FIM layout, budget, self-summaries with a cache, fallback to truncation."""

import asyncio

from learner.fim import fim_prompt_ids
from learner.formats import ModelFormat
from learner.prompts import PromptBuilder, SummaryCache, split_lines_by_tokens
from tests.helpers import family_tokenizer

LONG = "".join(f"def function_{i}(a, b):\n    return a * {i} + b\n\n" for i in range(200))


def builder(tok, fmt, budget=256, version=1, cache=None, max_summaries=100):
    return PromptBuilder(
        tok,
        fmt,
        budget=budget,
        chunk_tokens=64,
        cache=cache or SummaryCache(100),
        version=version,
        max_summaries=max_summaries,
    )


def run(coro):
    return asyncio.run(coro)


def test_short_prompt_is_plain_fim(tok, fmt):
    b = builder(tok, fmt)
    p = run(b.build("x = 1\n", "\ny = 2", None, path="m.py"))
    assert p.ids == fim_prompt_ids(fmt, tok, "x = 1\n", "\ny = 2", path="m.py")  # the format the model was trained on
    text = tok.decode(p.ids, skip_special_tokens=False)
    assert text == "<|file_sep|>m.py\n<|fim_prefix|>x = 1\n<|fim_suffix|>\ny = 2<|fim_middle|>"
    assert not p.summary_ids and not p.fallback and p.truncated_tokens == 0


def test_long_prefix_is_summarized_within_budget_and_cached(tok, fmt):
    calls = []

    async def summarize(chunk):
        calls.append(chunk)
        return tok.encode("def f(a, b)", add_special_tokens=False).ids

    cache = SummaryCache(100)
    p = run(builder(tok, fmt, cache=cache).build(LONG, "", summarize))
    assert len(p.ids) <= 256
    assert p.summary_ids and p.summaries_generated == len(calls) > 0 and not p.fallback
    text = tok.decode(p.ids, skip_special_tokens=False)
    assert text.count("<|summary_start|>") == len(p.summary_ids)
    assert text.endswith("<|fim_suffix|><|fim_middle|>")
    assert "return a * 199 + b" in text  # the code right before the cursor stays verbatim

    n = len(calls)
    again = run(builder(tok, fmt, cache=cache).build(LONG, "", summarize))
    assert len(calls) == n and again.summaries_cached == p.summaries_generated and again.ids == p.ids
    other_version = run(builder(tok, fmt, cache=cache, version=2).build(LONG, "", summarize))
    assert len(calls) > n and other_version.summaries_generated > 0  # no reuse across versions by default


def test_a_swap_to_the_next_versions_keeps_the_summaries_warm_a_rollback_does_not(tok, fmt):
    calls = []

    async def summarize(chunk):
        calls.append(chunk)
        return tok.encode("def f(a, b)", add_special_tokens=False).ids

    cache = SummaryCache(100, reuse_versions=2)
    first = run(builder(tok, fmt, cache=cache, version=5).build(LONG, "", summarize))
    n = len(calls)
    for later in (6, 7):  # the canary moves on: every summary served from the cache
        warm = run(builder(tok, fmt, cache=cache, version=later).build(LONG, "", summarize))
        assert len(calls) == n and warm.summaries_cached == first.summaries_generated and warm.ids == first.ids
    assert run(builder(tok, fmt, cache=cache, version=8).build(LONG, "", summarize)).summaries_generated > 0
    n = len(calls)
    # version 8 wrote them again; rolled back to 6, it writes its own rather than serve 8's
    back = run(builder(tok, fmt, cache=cache, version=6).build(LONG, "", summarize))
    assert back.summaries_generated > 0 and len(calls) > n


def test_summarizer_failure_falls_back_to_truncation(tok, fmt):
    async def broken(chunk):
        raise RuntimeError("no")

    p = run(builder(tok, fmt).build(LONG, "", broken))
    assert p.fallback and p.truncated_tokens > 0 and len(p.ids) <= 256
    assert "return a * 199 + b" in tok.decode(p.ids)


def test_no_summarizer_truncates_without_counting_a_fallback(tok, fmt):
    p = run(builder(tok, fmt).build(LONG, None, None))
    assert not p.fallback and p.truncated_tokens > 0 and len(p.ids) <= 256


def test_split_lines_by_tokens():
    assert split_lines_by_tokens(["a", "b", "c", "d"], [3, 3, 3, 3], 6) == [(0, 2), (2, 4)]
    assert split_lines_by_tokens(["a"], [10], 6) == [(0, 1)]


def test_empty_plain_prompt_starts_a_document(tok, fmt):
    assert run(builder(tok, fmt).build("", None, None)).ids == [tok.token_to_id("<|endoftext|>")]


def test_a_model_without_fim_tokens_gets_the_prefix_only(fmt):
    tok = family_tokenizer([LONG[:2000]], 400, ["<|endoftext|>"])
    plain = ModelFormat.of(
        tok, config={"max_position_embeddings": 512, "eos_token_id": tok.token_to_id("<|endoftext|>")}
    )
    p = run(builder(tok, plain).build("x = 1\n", "\ny = 2", None, path="m.py"))
    assert tok.decode(p.ids, skip_special_tokens=False) == "x = 1\n"  # suffix and path dropped


def test_plain_text_summary_markers_where_the_vocabulary_has_no_summary_tokens():
    tok = family_tokenizer([LONG[:4000]], 400, ["<|endoftext|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>"])
    fmt = ModelFormat.of(tok, config={"max_position_embeddings": 512, "eos_token_id": tok.token_to_id("<|endoftext|>")})

    async def summarize(chunk):
        return tok.encode("def f(a, b)", add_special_tokens=False).ids

    p = run(builder(tok, fmt).build(LONG, "", summarize))
    text = tok.decode(p.ids, skip_special_tokens=False)
    assert p.summary_ids and text.count("[summary of the code above") == len(p.summary_ids) == text.count(
        "[end of summary]"
    )
    assert len(p.ids) <= 256 and text.startswith("<|fim_prefix|>")


# Distinct lines, so the order of the chunks summarized is visible; ~36,000 characters.
NUMBERED = "".join(f"value_{i:04d} = compute({i})\n" for i in range(1200))


def test_summarizes_newest_chunks_first_and_stops_at_the_cap(tok, fmt):
    calls = []

    async def summarize(chunk):  # short summaries: dozens would fit the room
        calls.append(chunk)
        return tok.encode("x", add_special_tokens=False).ids

    cache = SummaryCache(100)
    p = run(builder(tok, fmt, cache=cache, max_summaries=3).build(NUMBERED, "", summarize))
    assert len(calls) == p.summaries_generated == len(p.summary_ids) == 3
    starts = [NUMBERED.index(c) for c in calls]
    assert starts == sorted(starts, reverse=True)  # newest first
    recent = NUMBERED[starts[0] + len(calls[0]) :]
    assert recent and tok.decode(p.ids).endswith(recent)  # the first chunk summarized is the one before the tail
    assert p.summaries_skipped > 50 and p.truncated_tokens > 0 and len(p.ids) <= 256
    text = tok.decode(p.ids, skip_special_tokens=False)
    assert text.count("<|summary_start|>") == 3 and "value_1199 = compute(1199)" in text

    # The next request takes the cached summaries for free and writes at most 3 more.
    again = run(builder(tok, fmt, cache=cache, max_summaries=3).build(NUMBERED, "", summarize))
    assert again.summaries_cached == 3 and again.summaries_generated == 3 and len(calls) == 6
    assert len(again.summary_ids) == 6 and again.summary_ids[-3:] == p.summary_ids


def test_a_deferring_request_truncates_and_queues_the_newest_missing_chunks(tok, fmt):
    async def summarize(chunk):
        raise AssertionError("a deferring request writes no summary itself")

    queued = []
    cache = SummaryCache(100)
    b = builder(tok, fmt, cache=cache, max_summaries=3)
    p = run(b.build(NUMBERED, "", summarize, defer=queued.extend))
    assert p.summaries_deferred == 3 and len(queued) == 3 and not p.summary_ids and not p.fallback
    assert p.truncated_tokens > 0 and len(p.ids) <= 256
    starts = [NUMBERED.index(text) for _, text in queued]
    assert starts == sorted(starts, reverse=True)  # newest first, as they would be written inline

    # Written in the background; the file's next request uses them and queues the next ones.
    for key, _ in queued:
        cache.put(key, b.version, tok.encode("x", add_special_tokens=False).ids)
    queued.clear()
    again = run(b.build(NUMBERED, "", summarize, defer=queued.extend))
    assert again.summaries_cached == 3 and len(again.summary_ids) == 3 and again.summaries_generated == 0
    assert queued == []  # the newest three are cached: nothing older is queued beyond the cap


def test_summarizing_stops_when_the_room_is_full(tok, fmt):
    calls = []

    async def summarize(chunk):  # long summaries: two fit the room
        calls.append(chunk)
        return tok.encode("y = 1\n" * 10, add_special_tokens=False).ids[:40]

    p = run(builder(tok, fmt, max_summaries=100).build(NUMBERED, "", summarize))
    assert 0 < len(p.summary_ids) < len(calls) == len(p.summary_ids) + 1  # the one that did not fit ends it
    assert p.summaries_skipped > 50 and len(p.ids) <= 256


def test_no_summaries_allowed_truncates(tok, fmt):
    async def summarize(chunk):
        raise AssertionError("must not be called")

    p = run(builder(tok, fmt, max_summaries=0).build(NUMBERED, "", summarize))
    assert not p.summary_ids and not p.fallback and p.truncated_tokens > 0 and len(p.ids) <= 256


UTIL = "def helper(a):\n    return a + 1\n"
MODELS = "class User:\n    name: str\n"


def test_other_files_go_before_the_current_file_the_most_relevant_nearest(tok, fmt):
    p = run(
        builder(tok, fmt).build("x = ", "\n", None, path="app.py", context=[("util.py", UTIL), ("models.py", MODELS)])
    )
    text = tok.decode(p.ids, skip_special_tokens=False)
    assert text == (
        f"<|file_sep|>models.py\n{MODELS}\n<|file_sep|>util.py\n{UTIL}\n"
        "<|file_sep|>app.py\n<|fim_prefix|>x = <|fim_suffix|>\n<|fim_middle|>"
    )
    assert p.context_files == 2


def test_other_files_are_trimmed_to_fit_the_budget_least_relevant_dropped(tok, fmt):
    big = "".join(f"def f_{i}(a):\n    return a * {i}\n" for i in range(60))
    files = [("util.py", UTIL), ("big.py", big), ("never.py", MODELS)]
    b = builder(tok, fmt, budget=256)
    p = run(b.build(LONG, "\n", None, path="app.py", context=files))
    text = tok.decode(p.ids, skip_special_tokens=False)
    assert len(p.ids) <= 256 and p.context_files == 2  # util.py whole, big.py cut, never.py left out
    assert f"<|file_sep|>util.py\n{UTIL}\n<|file_sep|>app.py" in text and "never.py" not in text
    kept = text.split("<|file_sep|>big.py\n")[1].split("<|file_sep|>")[0]
    assert kept and big.startswith(kept.removesuffix("\n")) and kept.endswith("\n")  # its first lines, whole
    # A long file leaves the others their reserved room (at most half the budget), less the part
    # of a line that did not fit (a line of big.py is at most 16 tokens); the file gets the rest.
    others = len(tok.encode(text.split("<|file_sep|>app.py")[0]).ids)
    assert 128 - 16 <= others <= 128
    assert p.truncated_tokens > 0


def test_a_short_file_leaves_other_files_the_rest_of_the_budget(tok, fmt):
    many = [(f"m{i}.py", UTIL.replace("helper", f"helper_{i}")) for i in range(40)]
    b = builder(tok, fmt, budget=512)
    b.context_tokens = 64
    p = run(b.build("x = ", "\n", None, path="app.py", context=many))
    assert 400 < len(p.ids) <= 512 and p.context_files > 64 // 16


def test_without_file_separators_other_files_get_a_commented_header(fmt):
    tok = family_tokenizer([LONG[:2000]], 400, ["<|endoftext|>"])
    plain = ModelFormat.of(
        tok, config={"max_position_embeddings": 512, "eos_token_id": tok.token_to_id("<|endoftext|>")}
    )
    p = run(builder(tok, plain).build("x = 1\n", None, None, context=[("util.js", "let a = 1")], comment="//"))
    assert tok.decode(p.ids, skip_special_tokens=False) == "// util.js\nlet a = 1\nx = 1\n"
