"""Prompt building: fill-in-the-middle in the model's template, and self-summarization past the budget.

Layout (the model's FIM template, learner.fim; for Qwen's):

    [<|file_sep|> other path \\n text ...]  [<|file_sep|> path]
    <|fim_prefix|> [<open> s_1 <close> ... s_k]  recent prefix  <|fim_suffix|> suffix <|fim_middle|>

Flywheel's own base (qwen-spm) has the suffix first: `... <|fim_suffix|> suffix <|fim_prefix|>
[summaries] recent prefix`, and writes the middle right after it.

Other files of the repository (an editor's snippets) go before the current file, within the
budget (`PromptBuilder._context`). A model without FIM tokens gets prefix-only prompts (the
suffix is dropped). When prefix + suffix exceed `budget` tokens, the prefix is cut at line
boundaries into an old part and a recent tail. The old part is split into chunks that the model itself summarizes (prompted
with the chunk followed by the summary's opening marker, the teacher task Flywheel's own
model was pretrained on), and the summaries stand in for the chunks, between the format's
markers (learner.formats.SummaryFormat: Flywheel's summary tokens, or plain text). Only the
newest few summaries fit, so chunks are summarized newest first until the room is full or
`max_summaries` were written for this request; older chunks are left out and counted.
Summaries are cached by chunk hash, for the version that wrote them and a few after it
(`SummaryCache`). If summarizing fails, the prefix is
truncated to the budget instead, and the fallback is counted. Serving writes missing summaries
off the request's path (`build(defer=...)`): a request whose summaries are not all cached is
truncated, and the file's next request finds them.

Everything here is pure except `build()`, which awaits the summarizer it is given.
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from tokenizers import Tokenizer

from learner.fim import context_block_ids, encode, fim_header_ids, fim_layout, plain_prompt_ids
from learner.formats import ModelFormat

EDITOR_STOP = "\n\n"
"""Where an editor's suggestion that starts a line ends when the client names no stop: at the
first blank line (a completion in an editor is the rest of a line or a short block); with the
language's own stops in learner.languages.editor_stops, which serving adds to editor-shaped
requests and the held-out replay cuts its greedy middles at, so both see the same text. A cursor
after code on its line ends at the newline instead (learner.languages.LINE_STOP)."""

CONTEXT_BUDGET = 1536
"""Prompt tokens a completion may use (the default of serve.context_budget); longer prefixes
are self-summarized into it. Three quarters of the default base's 2048-token window; a model
with a smaller window gets three quarters of its own (fit_budget)."""
SUMMARY_CHUNK_TOKENS = 192
"""Size of the prefix chunks that summaries replace (the default of serve.summary_chunk_tokens)."""
MAX_SUMMARIES = 4
"""Summaries one request may have the model write, when serving turns self-summaries on
(`serve.max_summaries_per_request`, 0 by default: truncation)."""
CONTEXT_TOKENS = 256
"""Prompt tokens other files of the repository keep even when the current file would fill the
budget (the default of serve.repo_context_tokens)."""

log = logging.getLogger(__name__)

Summarizer = Callable[[str], Awaitable[list[int]]]  # chunk text -> summary token ids
Deferrer = Callable[[list[tuple[str, str]]], None]
"""[(chunk hash, chunk text), ...], newest chunk first -> None: summaries to write later, off the
request's path."""


class _Deferred(Exception):
    """Summaries this prompt needs are not cached and were handed to the deferrer."""

    def __init__(self, n: int):
        self.n = n


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
    summaries_deferred: int = 0
    """Summaries this prompt needed that were not cached: handed to be written later, and the
    prefix truncated for this request (`build(defer=...)`)."""
    context_files: int = 0
    """Other files of the repository the prompt carries (whole or cut)."""


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
    """LRU of summary token ids by chunk hash, each with the model version that wrote it.

    A summary serves the version that wrote it and up to `reuse_versions` later ones: a replica
    that swaps to the next version keeps its summaries warm instead of writing them all again
    (a canary's first requests were slow, and its latency compared badly, for a cold cache). That
    is sound for training: a record carries the prompt ids the model really saw, summaries
    included, whichever version wrote them; and the versions a replica moves through are each
    a small step from the last. A summary is never served to a version older than its writer, so
    after a rollback the bad version's summaries are written again by the version rolled back to."""

    def __init__(self, capacity: int, reuse_versions: int = 0):
        self.capacity = capacity
        self.reuse_versions = reuse_versions
        self._d: OrderedDict[str, tuple[int, list[int]]] = OrderedDict()

    def get(self, chunk: str, version: int) -> list[int] | None:
        hit = self._d.get(chunk)
        if hit is None or not 0 <= version - hit[0] <= self.reuse_versions:
            return None
        self._d.move_to_end(chunk)
        return hit[1]

    def put(self, chunk: str, version: int, ids: list[int]) -> None:
        if self.capacity <= 0:
            return
        self._d[chunk] = (version, ids)
        self._d.move_to_end(chunk)
        while len(self._d) > self.capacity:
            self._d.popitem(last=False)


@dataclass
class PromptBuilder:
    tok: Tokenizer
    fmt: ModelFormat
    budget: int
    chunk_tokens: int
    cache: SummaryCache
    version: int
    max_summaries: int = MAX_SUMMARIES
    context_tokens: int = CONTEXT_TOKENS

    def encode(self, text: str) -> list[int]:
        return encode(self.tok, text)

    async def build(
        self,
        prefix: str,
        suffix: str | None,
        summarize: Summarizer | None,
        *,
        path: str | None = None,
        repo: str | None = None,
        context: Sequence[tuple[str, str]] = (),
        comment: str = "#",
        defer: Deferrer | None = None,
    ) -> Prompt:
        """A FIM prompt within `budget` tokens (plain left-to-right when `suffix` is None or the
        model has no FIM tokens). `path`, `repo`: the file's, for the template's header.
        `context`: other files as (path, text), the most relevant first, for the room
        `_context` gives them; `comment`: the language's line comment, for templates that
        mark a file by a commented header. `defer`: when given, summaries that are not cached
        are not written while the request waits: they go to `defer`, and this prompt is
        truncated (the file's next request finds them cached)."""
        fim = suffix is not None and self.fmt.fim is not None
        suffix_ids = (
            self.encode(suffix)[: self.budget // 4] if fim and suffix else []
        )  # the code right after the cursor matters most
        prefix_ids = self.encode(prefix)
        context_ids: list[int] = []

        def assemble(body: list[int]) -> list[int]:
            if fim:
                header = fim_header_ids(self.fmt, self.tok, path=path, repo=repo, context=context_ids)
                return fim_layout(self.fmt, header, body, suffix_ids)
            return [*self.fmt.bos_ids, *context_ids, *body] or plain_prompt_ids(self.fmt, self.tok, "")

        context_files = 0
        if context:
            context_ids, context_files = self._context(context, len(assemble(prefix_ids)), comment)
        whole = assemble(prefix_ids)  # exactly the trained format
        if len(whole) <= self.budget:
            return Prompt(whole, context_files=context_files)

        if self.max_summaries == 0:
            summarize = None
        room = self.budget - (len(assemble([])) if fim else len(self.fmt.bos_ids))

        deferred = 0
        if summarize is not None:
            try:
                body, stats = await self._summarized(prefix, room, summarize, defer)
                return Prompt(assemble(body), context_files=context_files, **stats)
            except _Deferred as d:
                deferred = d.n
            except Exception as e:  # any summarizer failure degrades to truncation, never fails the request
                log.warning("self-summarization failed (%s: %s); truncating the prefix instead", type(e).__name__, e)
        kept = prefix_ids[-room:]
        return Prompt(
            assemble(kept),
            context_files=context_files,
            truncated_tokens=len(prefix_ids) - len(kept),
            fallback=summarize is not None and not deferred,
            summaries_deferred=deferred,
        )

    def _defer_missing(self, spans: list[tuple[int, int]], lines: list[str], defer: Deferrer) -> int:
        """Hand the chunks of `spans` (newest first) that have no cached summary to `defer`, in
        one batch, newest first; how many."""
        texts = ("".join(lines[a:b]) for a, b in spans)
        missing = [
            (key, text)
            for key, text in ((chunk_hash(t), t) for t in texts)
            if self.cache.get(key, self.version) is None
        ]
        if missing:
            defer(missing)
        return len(missing)

    def _context(self, files: Sequence[tuple[str, str]], file_tokens: int, comment: str) -> tuple[list[int], int]:
        """Other files laid out for the prompt, and how many made it. They get what the current
        file leaves of the budget, and at least `context_tokens` (at most half the budget) of a
        long file's: the most relevant first, whole while they fit, then the first that does not
        cut at a line to fill the rest. Laid out the other way round, so the most relevant one
        sits right before the current file."""
        reserve = min(self.context_tokens, self.budget // 2)
        left = self.budget - min(file_tokens, self.budget - reserve)
        blocks: list[list[int]] = []
        for path, text in files:
            if not text.strip() or left <= 0:
                continue
            ids = context_block_ids(self.fmt, self.tok, path, text, comment=comment)
            if len(ids) > left:
                ids = self._cut_block(path, text, left, comment)
                if ids:
                    blocks.append(ids)
                break
            blocks.append(ids)
            left -= len(ids)
        return [t for ids in reversed(blocks) for t in ids], len(blocks)

    def _cut_block(self, path: str, text: str, room: int, comment: str) -> list[int] | None:
        """The file's block with as many of its first lines as fit in `room` tokens (None: not one)."""
        lines = text.splitlines(keepends=True)
        counts = [len(e.ids) for e in self.tok.encode_batch(lines, add_special_tokens=False)]
        spare = room - len(context_block_ids(self.fmt, self.tok, path, "", comment=comment))
        n, used = 0, 0
        while n < len(lines) and used + counts[n] <= spare:
            used += counts[n]
            n += 1
        while n > 0:  # tokens merge across a cut differently: check the block itself
            ids = context_block_ids(self.fmt, self.tok, path, "".join(lines[:n]).rstrip("\n"), comment=comment)
            if len(ids) <= room:
                return ids
            n -= 1
        return None

    async def _summarized(
        self, prefix: str, room: int, summarize: Summarizer, defer: Deferrer | None = None
    ) -> tuple[list[int], dict]:
        lines = prefix.splitlines(keepends=True)
        counts = [len(ids) for ids in (e.ids for e in self.tok.encode_batch(lines, add_special_tokens=False))]
        # The recent tail gets ~60% of the room, verbatim; summaries of older chunks share the rest.
        tail_budget, split, total = int(room * 0.6), len(lines), 0
        while split > 0 and total + counts[split - 1] <= tail_budget:
            split -= 1
            total += counts[split]
        recent = self.encode("".join(lines[split:]))[-room:]
        spans = split_lines_by_tokens(lines[:split], counts[:split], self.chunk_tokens)
        markers = self.fmt.summary
        # Newest chunk first, while its summary fits: only the newest few can, so the older ones
        # cost no generation (a prefix of 200,000 characters has hundreds of chunks).
        left, kept = room - len(recent), []
        cached = generated = deferred = 0
        newest_first = list(reversed(spans))
        for i, (a, b) in enumerate(newest_first):
            if left <= len(markers.open_ids) + len(markers.close_ids):  # full: no room for a marked summary
                break
            text = "".join(lines[a:b])
            key = chunk_hash(text)
            ids = self.cache.get(key, self.version)
            if ids is None and defer is not None:
                # Queue what is missing of the newest max_summaries chunks (the per-request cap
                # inline); this request uses the summaries before the gap, or truncates.
                deferred = self._defer_missing(newest_first[i : self.max_summaries], lines, defer)
                if not kept:
                    raise _Deferred(deferred)
                break
            if ids is None:
                if generated == self.max_summaries:
                    break
                ids = await summarize(text)
                if not ids:
                    raise ValueError("the model wrote an empty summary")
                self.cache.put(key, self.version, ids)
                generated += 1
            else:
                cached += 1
            block = [*markers.open_ids, *ids, *markers.close_ids]
            if len(block) > left:
                break
            kept.insert(0, (key, block))
            left -= len(block)
        left_out = spans[: len(spans) - len(kept)]
        body = [t for _, ids in kept for t in ids] + recent
        return body, dict(
            summary_ids=[h for h, _ in kept],
            summaries_cached=cached,
            summaries_generated=generated,
            summaries_skipped=len(left_out),
            summaries_deferred=deferred,
            truncated_tokens=sum(sum(counts[a:b]) for a, b in left_out),
        )
