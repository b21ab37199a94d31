"""A model replica: one model version, its prompt builder and summary cache, an engine.

`CompletionService` is plain Python around an `Engine`, so it runs the same under Ray
Serve (`ModelReplica` below), in a benchmark, or in a unit test with a fake engine. What it
knows of the model's tokens (EOS, FIM template, summary markers) comes from the model's own
files (learner.formats.ModelFormat), never from fixed ids.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import Tokenizer

from learner.confidence import withheld
from learner.formats import ModelFormat
from learner.prompts import PromptBuilder, SummaryCache
from learner.show import ShowPolicy, cursor_line
from serving.engine import Engine, Sample, SamplingSpec
from serving.settings import ServeSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerateRequest:
    """What the ingress asks a replica for (crosses the Ray boundary, so plain data)."""

    completion_id: str
    prefix: str
    suffix: str | None  # None: plain left-to-right continuation of `prefix`
    path: str | None  # the file's path, for the FIM template's header ("" or None: unknown)
    spec: SamplingSpec
    repo: str | None = None  # the repository's name, for templates with repo context
    context: tuple[tuple[str, str], ...] = ()  # other files as (path, text), the most relevant first
    comment: str = "#"  # the language's line comment, for context under a commented header


@dataclass
class GenerateResult:
    completion_id: str
    model_version: int
    prompt_token_ids: list[int]
    samples: list[Sample]
    summary_ids: list[str] = field(default_factory=list)
    summaries_cached: int = 0
    summaries_generated: int = 0
    summaries_skipped: int = 0
    summaries_deferred: int = 0  # not cached: queued to be written in the background, prefix truncated
    truncated_tokens: int = 0
    summary_fallback: bool = False
    context_files: int = 0
    latency_ms: float = 0.0  # in the replica: from the request's arrival to this result
    prompt_ms: float = 0.0  # the part of latency_ms spent building the prompt
    first_token_ms: float | None = None  # prompt building + the engine's time to first token, when it reports it
    cached_tokens: int = 0  # prompt tokens the engine's prefix cache held (a warm-up or an earlier request ran them)
    done: bool = True


class CompletionService:
    def __init__(
        self,
        engine: Engine,
        tok: Tokenizer,
        fmt: ModelFormat,
        cfg: ServeSettings,
        version: int,
        *,
        min_confidence: float = 0.0,
    ):
        self.engine = engine
        self.min_confidence = min_confidence  # model.min_confidence: the confidence gate (learner/confidence.py)
        self.show_policy: ShowPolicy | None = None  # the served version's (learner/show.py); set on each swap
        self.tok = tok
        self.fmt = fmt
        self.cfg = cfg
        self.version = version
        self.prompts = PromptBuilder(
            tok,
            fmt,
            cfg.context_budget,
            cfg.summary_chunk_tokens,
            SummaryCache(cfg.summary_cache_size, cfg.summary_reuse_versions),
            version,
            max_summaries=cfg.max_summaries_per_request,
            context_tokens=cfg.repo_context_tokens,
        )
        self._deferred: OrderedDict[str, str] = OrderedDict()  # chunk hash -> text, newest last
        self._writer: asyncio.Task | None = None

    async def summarize(self, chunk: str) -> list[int]:
        """The model's own summary of `chunk` (greedy), prompted as Flywheel's pretraining taught
        it: the chunk, then the summary's opening marker (a token, or plain text)."""
        markers, bos = self.fmt.summary, list(self.fmt.bos_ids)
        keep = self.cfg.engine.max_model_len - self.cfg.summary_max_tokens - len(markers.open_ids) - len(bos) - 1
        ids = [*bos, *self.prompts.encode(chunk)[-keep:], *markers.open_ids]
        stops = (*markers.stop_ids, *self.fmt.eos_ids)
        spec = SamplingSpec(
            max_tokens=self.cfg.summary_max_tokens,
            temperature=0.0,
            stop_token_ids=stops,
            stop=(markers.stop_text,) if markers.stop_text else (),
        )
        final: list[Sample] = []
        async for final in self.engine.generate(ids, spec, f"sum-{uuid.uuid4().hex}"):
            pass
        if not final:
            return []
        if markers.stop_text:  # plain-text markers: the text before the closing one
            return self.prompts.encode(final[0].text.strip("\n"))
        return [t for t in final[0].token_ids if t not in stops]

    # --- summaries written off the request's path (serve.summarize_in_background) ------------------

    def defer_summaries(self, chunks: list[tuple[str, str]]) -> None:
        """Queue one request's missing summaries, (hash, text) newest chunk first, to be written in
        the background, and start the writer if it is not running. The latest request's newest
        chunk is written first (a prompt uses no summary older than a missing one); beyond
        serve.summary_queue the oldest queued are dropped."""
        for key, chunk in reversed(chunks):
            self._deferred.pop(key, None)
            self._deferred[key] = chunk
        while len(self._deferred) > self.cfg.summary_queue:
            self._deferred.popitem(last=False)
        if self._writer is None or self._writer.done():
            self._writer = asyncio.get_running_loop().create_task(self._write_deferred(), name="summaries")

    async def _write_deferred(self) -> None:
        """Write queued summaries one at a time, so they take at most one sequence of each engine
        step from the completions beside them."""
        while self._deferred:
            key, chunk = self._deferred.popitem(last=True)
            if self.prompts.cache.get(key, self.version) is not None:
                continue
            version = self.version  # the weights it starts on; a swap drains it first (serving/hotswap.py)
            try:
                ids = await self.summarize(chunk)
            except Exception as e:  # the next request of that file truncates again and queues it again
                log.warning("a background summary failed (%s: %s)", type(e).__name__, e)
                continue
            if ids:
                self.prompts.cache.put(key, version, ids)

    async def stream(self, req: GenerateRequest) -> AsyncIterator[GenerateResult]:
        """Cumulative results as tokens arrive; the last one has `done=True`."""
        t0 = time.perf_counter()
        prompt = await self.prompts.build(
            req.prefix,
            req.suffix,
            self.summarize,
            path=req.path or None,
            repo=req.repo,
            context=req.context,
            comment=req.comment,
            defer=self.defer_summaries if self.cfg.summarize_in_background else None,
        )
        spec = req.spec
        # Generation ends at the model's EOS tokens; a middle also at its FIM template's own tokens.
        stops = self.fmt.eos_ids
        if req.suffix is not None and self.fmt.fim is not None:
            stops += self.fmt.fim.stop_ids
        spec = dataclasses.replace(spec, stop_token_ids=(*spec.stop_token_ids, *stops))
        # Generation ends at the context window; vLLM refuses a request that asks for more.
        room = self.cfg.engine.max_model_len - len(prompt.ids)
        if spec.max_tokens > room:
            spec = dataclasses.replace(spec, max_tokens=max(1, room))
        samples: list[Sample] = []
        built_ms = (time.perf_counter() - t0) * 1000
        cursor = req.suffix is not None  # a suggestion at a cursor: the gate and the show policy apply
        gate, policy = (self.min_confidence, self.show_policy) if cursor else (0.0, None)
        async for samples in self.engine.generate(prompt.ids, spec, req.completion_id):
            # Under a policy nothing is sent before the end: it reads the whole suggestion, and what
            # was streamed could not be taken back. So only the finished samples are gated then.
            if policy is None:
                yield self._result(req, prompt, [_gated(s, gate) for s in samples], t0, built_ms, done=False)
        line = cursor_line(req.prefix)  # what the policy reads of the cursor, as the learner reads it back
        samples = [_gated(s, gate, policy, req.completion_id, line) for s in samples]
        yield self._result(req, prompt, samples, t0, built_ms, done=True)

    async def served_version(self) -> int:
        """The version it serves (an in-process service is a pool of one: serving.http.deps.ReplicaClient)."""
        return self.version

    async def complete(self, req: GenerateRequest) -> GenerateResult:
        result = None
        async for result in self.stream(dataclasses.replace(req, spec=dataclasses.replace(req.spec, stream=False))):
            pass
        assert result is not None
        return result

    def _result(self, req, prompt, samples, t0, built_ms: float, *, done: bool) -> GenerateResult:
        first = samples[0].first_token_s if samples else None
        return GenerateResult(
            completion_id=req.completion_id,
            model_version=self.version,
            prompt_token_ids=prompt.ids,
            samples=samples,
            summary_ids=prompt.summary_ids,
            summaries_cached=prompt.summaries_cached,
            summaries_generated=prompt.summaries_generated,
            summaries_skipped=prompt.summaries_skipped,
            summaries_deferred=prompt.summaries_deferred,
            truncated_tokens=prompt.truncated_tokens,
            summary_fallback=prompt.fallback,
            context_files=prompt.context_files,
            latency_ms=(time.perf_counter() - t0) * 1000,
            prompt_ms=built_ms,
            first_token_ms=built_ms + first * 1000 if first is not None else None,
            cached_tokens=(samples[0].cached_tokens or 0) if samples else 0,
            done=done,
        )


def _gated(
    sample: Sample, min_confidence: float, policy: ShowPolicy | None = None, key: str = "", line: str = ""
) -> Sample:
    """The sample as the client gets it: no text when the confidence gate withholds it, or the
    version's show policy does (at a cursor after `line`) and does not explore completion `key`
    (learner/show.py). Its tokens
    and logprobs stay for the record, finishing with reason "withheld". An empty one (the model
    abstained, or a stop string cut everything) has nothing to withhold, as in the replay."""
    if not sample.text or not withheld(sample.logprobs, min_confidence, sample.text, policy, line):
        return sample
    if policy is not None and policy.explores(key) and not withheld(sample.logprobs, min_confidence):
        return sample
    return dataclasses.replace(sample, text="", finish_reason="withheld" if sample.finish_reason else None)


def model_window(model_dir: Path) -> int:
    """The model's context window (`max_position_embeddings` of its config.json)."""
    import json

    return json.loads((Path(model_dir) / "config.json").read_text())["max_position_embeddings"]


def format_line(fmt: ModelFormat) -> str:
    """One line on how this model is prompted, for the start log."""
    how = (
        f"{fmt.fim.name} fill-in-the-middle template"
        if fmt.fim
        else "prefix-only (no FIM tokens: suffixes are ignored)"
    )
    marks = "its summary tokens" if fmt.summary.tokens else "plain-text markers"
    return f"prompts: {how}; EOS ids {list(fmt.eos_ids)}; self-summaries with {marks}; window {fmt.window}"


def load_service(
    model_dir: Path, cfg: ServeSettings, version: int, *, fim: str = "auto", min_confidence: float = 0.0
) -> CompletionService:
    from learner.formats import read_format
    from learner.tokenizer import load_tokenizer
    from serving.engine import VLLMEngine

    fmt = read_format(model_dir, fim=fim)
    (log.warning if fmt.fim is None else log.info)("%s: %s", model_dir, format_line(fmt))
    cfg = cfg.fitted_to(fmt.window)
    return CompletionService(
        VLLMEngine(model_dir, cfg.engine), load_tokenizer(model_dir), fmt, cfg, version, min_confidence=min_confidence
    )
