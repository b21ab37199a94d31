"""Prompt building: fill-in-the-middle with a header, and self-summarization past the budget.

Layout (PSM, the order the model was trained on):

    <|fim_prefix|> header  [<|summary_start|> s_1 <|summary_end|> ... s_k]  recent prefix
    <|fim_suffix|> suffix <|fim_middle|>

When prefix + suffix exceed `budget` tokens, the prefix is cut at line boundaries into an
old part and a recent tail. The old part is split into chunks that the model itself
summarizes (prompted with the chunk followed by `<|summary_start|>`, the teacher task it
was pretrained on), and the summaries stand in for the chunks. Only the newest few summaries
fit, so chunks are summarized newest first until the room is full or `max_summaries` were
written for this request; older chunks are left out and counted. Summaries are cached by
(chunk hash, model version). If summarizing fails, the prefix is truncated to the budget
instead, and the fallback is counted.

Everything here is pure except `build()`, which awaits the summarizer it is given.
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from tokenizers import Tokenizer

from learner.fim import fim_prompt_ids
from learner.tokenizer import EOS_ID, FIM_MIDDLE, FIM_PREFIX, FIM_SUFFIX, SUMMARY_END, SUMMARY_START

EDITOR_STOP = "\n\n"
"""Where an editor's suggestion ends when the client names no stop: at the first blank line (a
completion in an editor is the rest of a line or a short block). Serving adds it to editor-shaped
requests, and the held-out replay cuts its greedy middles there, so both see the same text."""

CONTEXT_BUDGET = 768
"""Prompt tokens a completion may use (the default of serve.context_budget); longer prefixes
are self-summarized into it."""
SUMMARY_CHUNK_TOKENS = 192
"""Size of the prefix chunks that summaries replace (the default of serve.summary_chunk_tokens)."""
MAX_SUMMARIES = 4
"""Most summaries one prompt may have the model write (the default of
serve.max_summaries_per_request): a generation each, and about as many as fit the default budget."""

log = logging.getLogger(__name__)

Summarizer = Callable[[str], Awaitable[list[int]]]  # chunk text -> summary token ids


@dataclass
class SpecialIds:
    fim_prefix: int
    fim_suffix: int
    fim_middle: int
    summary_start: int
    summary_end: int

    @classmethod
    def of(cls, tok: Tokenizer) -> SpecialIds:
        ids = [tok.token_to_id(t) for t in (FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE, SUMMARY_START, SUMMARY_END)]
        if any(i is None for i in ids):
            raise ValueError("the tokenizer lacks Flywheel's special tokens (fim_*, summary_*)")
        return cls(*ids)


@dataclass
class Prompt:
    ids: list[int]
    summary_ids: list[str] = field(default_factory=list)
    """Hashes of the chunks that summaries replaced."""
    summaries_cached: int = 0
    summaries_generated: int = 0
    summaries_skipped: int = 0
    """Older chunks left out: no room for their summaries, or `max_summaries` were written."""
    truncated_tokens: int = 0
    fallback: bool = False
    """Summarization failed and the prefix was truncated instead."""


def fim_ids(sp: SpecialIds, header: list[int], prefix: list[int], suffix: list[int]) -> list[int]:
    """learner.fim's layout over already-encoded parts (the prefix may hold summary blocks)."""
    return [sp.fim_prefix, *header, *prefix, sp.fim_suffix, *suffix, sp.fim_middle]


def fit_budget(
    window: int, context_budget: int = CONTEXT_BUDGET, chunk_tokens: int = SUMMARY_CHUNK_TOKENS
) -> tuple[int, int]:
    """(context budget, summary chunk tokens) within a `window`-token context: a quarter of the
    window is kept for the completion, and a chunk is at most half the budget (16 tokens at
    least). Serving fits its settings to a replica's window with it, the held-out replay its
    prompts to the model's."""
    budget = min(context_budget, window * 3 // 4)
    return budget, min(chunk_tokens, max(16, budget // 2))


def chunk_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def split_lines_by_tokens(lines: list[str], counts: list[int], limit: int) -> list[tuple[int, int]]:
    """Group consecutive lines into [start, end) spans of at most ~`limit` tokens each."""
    spans, start, total = [], 0, 0
    for i, c in enumerate(counts):
        if total and total + c > limit:
            spans.append((start, i))
            start, total = i, 0
        total += c
    if start < len(lines):
        spans.append((start, len(lines)))
    return spans


class SummaryCache:
    """LRU of summary token ids keyed by (chunk hash, model version)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._d: OrderedDict[tuple[str, int], list[int]] = OrderedDict()

    def get(self, key: tuple[str, int]) -> list[int] | None:
        if key in self._d:
            self._d.move_to_end(key)
            return self._d[key]
        return None

    def put(self, key: tuple[str, int], ids: list[int]) -> None:
        if self.capacity <= 0:
            return
        self._d[key] = ids
        self._d.move_to_end(key)
        while len(self._d) > self.capacity:
            self._d.popitem(last=False)


@dataclass
class PromptBuilder:
    tok: Tokenizer
    budget: int
    chunk_tokens: int
    cache: SummaryCache
    version: int
    max_summaries: int = MAX_SUMMARIES

    def __post_init__(self) -> None:
        self.sp = SpecialIds.of(self.tok)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids if text else []

    async def build(self, prefix: str, suffix: str | None, header: str, summarize: Summarizer | None) -> Prompt:
        """A FIM prompt within `budget` tokens (plain left-to-right when `suffix` is None)."""
        suffix_ids = (
            self.encode(suffix)[: self.budget // 4] if suffix else []
        )  # the code right after the cursor matters most
        if suffix is not None:
            kept_suffix = suffix if len(suffix_ids) == len(self.encode(suffix)) else self.tok.decode(suffix_ids)
            whole = fim_prompt_ids(self.tok, prefix, kept_suffix, header)  # exactly the trained format
        else:
            # An empty plain prompt starts a document: <|endoftext|> doubles as BOS (learner.model).
            whole = self.encode(header + prefix) or [EOS_ID]
        if len(whole) <= self.budget:
            return Prompt(whole)

        if self.max_summaries == 0:
            summarize = None
        header_ids = self.encode(header)
        room = self.budget - len(header_ids) - len(suffix_ids) - (3 if suffix is not None else 0)
        prefix_ids = self.encode(prefix)

        def assemble(body: list[int]) -> list[int]:
            return fim_ids(self.sp, header_ids, body, suffix_ids) if suffix is not None else header_ids + body

        if summarize is not None:
            try:
                body, stats = await self._summarized(prefix, room, summarize)
                return Prompt(assemble(body), **stats)
            except Exception as e:  # any summarizer failure degrades to truncation, never fails the request
                log.warning("self-summarization failed (%s: %s); truncating the prefix instead", type(e).__name__, e)
        kept = prefix_ids[-room:]
        return Prompt(assemble(kept), truncated_tokens=len(prefix_ids) - len(kept), fallback=summarize is not None)

    async def _summarized(self, prefix: str, room: int, summarize: Summarizer) -> tuple[list[int], dict]:
        lines = prefix.splitlines(keepends=True)
        counts = [len(ids) for ids in (e.ids for e in self.tok.encode_batch(lines, add_special_tokens=False))]
        # The recent tail gets ~60% of the room, verbatim; summaries of older chunks share the rest.
        tail_budget, split, total = int(room * 0.6), len(lines), 0
        while split > 0 and total + counts[split - 1] <= tail_budget:
            split -= 1
            total += counts[split]
        recent = self.encode("".join(lines[split:]))[-room:]
        spans = split_lines_by_tokens(lines[:split], counts[:split], self.chunk_tokens)
        # Newest chunk first, while its summary fits: only the newest few can, so the older ones
        # cost no generation (a prefix of 200,000 characters has hundreds of chunks).
        left, kept = room - len(recent), []
        cached = generated = 0
        for a, b in reversed(spans):
            if left < 3:  # full: a summary block is at least its two markers and one token
                break
            text = "".join(lines[a:b])
            key = (chunk_hash(text), self.version)
            ids = self.cache.get(key)
            if ids is None:
                if generated == self.max_summaries:
                    break
                ids = await summarize(text)
                if not ids:
                    raise ValueError("the model wrote an empty summary")
                self.cache.put(key, ids)
                generated += 1
            else:
                cached += 1
            block = [self.sp.summary_start, *ids, self.sp.summary_end]
            if len(block) > left:
                break
            kept.insert(0, (key[0], block))
            left -= len(block)
        left_out = spans[: len(spans) - len(kept)]
        body = [t for _, ids in kept for t in ids] + recent
        return body, dict(
            summary_ids=[h for h, _ in kept],
            summaries_cached=cached,
            summaries_generated=generated,
            summaries_skipped=len(left_out),
            truncated_tokens=sum(sum(counts[a:b]) for a, b in left_out),
        )
