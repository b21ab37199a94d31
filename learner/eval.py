"""The held-out evaluation: simulated editor sessions replayed in-process on held-out files.

The cursor sites of ops.simulate on held-out files (never trained on) are run with the
learner's torch model. Each site goes through the steps serving and the simulated editor
take, so the replay scores a model as users would:

    prompt    serving's PromptBuilder with the serve budget fitted to the model's window
              (learner.prompts.fit_budget, serve.context_budget and serve.summary_chunk_tokens
              at their defaults unless passed), in the model's FIM template with the file's
              path, as editor requests get it; a prefix past the budget is truncated, as
              serving's summarization fallback does (summarizing every older chunk, as
              serving does, would take minutes per site here)
    decode    learner.decode, greedy, up to `max_tokens` (clamped to the window, as the replica
              does), stopping at the model's EOS tokens or at "\\n\\n" (the stop string serving gives
              editor requests, serving/http/completions.py)
    judge     learner.judge against the true continuation: accept fully, by line or by word,
              or dismiss; an empty completion is not shown (the model abstained)
    reward    feedback.reward on the events the simulated editor sends for that verdict
              (learner.judge.editor_events), as the sink scores them

`evaluate_candidate` replays a candidate and the stable model on the same sites; the learner's
gate (learner/train/gate.py) then decides on the two replays' stats, and the learning benchmark
(ops/bench/learn.py) draws its curve from them.
"""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tokenizers import Tokenizer

from feedback.reward import ChoiceFeedback, RewardWeights, reward
from learner.corpus import SourceFile
from learner.decode import decode, room
from learner.formats import ModelFormat
from learner.judge import Site, Verdict, cursor_sites, editor_events, judge
from learner.model import Transformer, WeightHook
from learner.prompts import CONTEXT_BUDGET, EDITOR_STOP, SUMMARY_CHUNK_TOKENS, PromptBuilder, SummaryCache, fit_budget


@dataclass(frozen=True)
class SiteResult:
    """One replayed request: what the model suggested and what the simulated user did with it."""

    path: str
    text: str  # the suggestion as served: cut before the stop string
    tokens: int  # completion tokens generated (the stop string's included, the EOS token not)
    finish: str  # stop | length
    verdict: str  # judge(): select | dismiss | none (empty: not shown)
    select_kind: str | None
    accepted_chars: int
    outcome: str  # feedback.reward's outcome: edit | select | dismiss | no_suggestion
    reward: float
    prompt_tokens: int
    truncated_tokens: int  # prefix tokens dropped to fit the budget


@dataclass
class ReplayStats:
    """Aggregates of one replay; the rates are per request unless named otherwise."""

    n: int = 0  # requests (sites)
    shown: int = 0  # non-empty suggestions
    accepted: int = 0  # shown and accepted (fully, by line or by word)
    accepted_chars: int = 0
    reward_sum: float = 0.0
    completion_tokens: int = 0  # summed over the shown suggestions
    length_capped: int = 0  # suggestions that ran to max_tokens
    truncated_prompts: int = 0  # prompts whose prefix was cut to the budget
    seconds: float = 0.0
    outcomes: dict[str, int] = field(default_factory=dict)
    results: list[SiteResult] = field(default_factory=list, repr=False)

    @property
    def mean_reward(self) -> float:
        return self.reward_sum / self.n if self.n else 0.0

    @property
    def accept_rate(self) -> float:
        """Accepted / shown."""
        return self.accepted / self.shown if self.shown else 0.0

    @property
    def suggestion_rate(self) -> float:
        """Non-empty suggestions / requests."""
        return self.shown / self.n if self.n else 0.0

    @property
    def accepted_chars_per_request(self) -> float:
        return self.accepted_chars / self.n if self.n else 0.0

    @property
    def mean_completion_tokens(self) -> float:
        """Mean length of the shown suggestions (abstentions are the suggestion rate's business)."""
        return self.completion_tokens / self.shown if self.shown else 0.0

    @classmethod
    def of(cls, results: Sequence[SiteResult], seconds: float = 0.0) -> ReplayStats:
        shown = [r for r in results if r.text]
        return cls(
            n=len(results),
            shown=len(shown),
            accepted=sum(r.verdict == "select" for r in results),
            accepted_chars=sum(r.accepted_chars for r in results),
            reward_sum=sum(r.reward for r in results),
            completion_tokens=sum(r.tokens for r in shown),
            length_capped=sum(r.finish == "length" for r in shown),
            truncated_prompts=sum(r.truncated_tokens > 0 for r in results),
            seconds=seconds,
            outcomes=dict(Counter(r.outcome for r in results)),
            results=list(results),
        )

    def summary(self) -> dict[str, Any]:
        """JSON-safe aggregates (no per-site results)."""
        return {
            "n": self.n,
            "shown": self.shown,
            "accepted": self.accepted,
            "mean_reward": json_number(self.mean_reward),
            "accept_rate": json_number(self.accept_rate),
            "suggestion_rate": json_number(self.suggestion_rate),
            "accepted_chars_per_request": json_number(self.accepted_chars_per_request),
            "mean_completion_tokens": json_number(self.mean_completion_tokens),
            "length_capped": self.length_capped,
            "truncated_prompts": self.truncated_prompts,
            "outcomes": dict(self.outcomes),
            "seconds": json_number(self.seconds),
        }


def json_number(x: float | None) -> float | None:
    """A JSON-safe number: None for missing or non-finite values (PostgreSQL's jsonb has no NaN)."""
    return None if x is None or not math.isfinite(x) else round(float(x), 6)


def heldout_sites(files: Sequence[SourceFile], n: int = 48, *, seed: int = 0) -> list[Site]:
    """The replay's cursor sites: a pure function of (files, n, seed), so candidate and stable
    see the same ones. Pass the held-out split pretraining used (pretrain.load_training_corpus)."""
    return cursor_sites(files, n, random.Random(seed))


def prompt_builder(
    tok: Tokenizer,
    fmt: ModelFormat,
    window: int,
    *,
    context_budget: int = CONTEXT_BUDGET,
    summary_chunk_tokens: int = SUMMARY_CHUNK_TOKENS,
) -> PromptBuilder:
    """Serving's prompt builder as a replica of a `window`-token model sets it up (the budget
    and chunk size are serve.context_budget and serve.summary_chunk_tokens)."""
    budget, chunk = fit_budget(window, context_budget, summary_chunk_tokens)
    return PromptBuilder(tok, fmt, budget, chunk, SummaryCache(0), version=0)


def site_prompt(builder: PromptBuilder, site: Site) -> tuple[list[int], int]:
    """(prompt ids, prefix tokens truncated) for a site, as serving builds it for an editor request."""
    coro = builder.build(site.prefix, site.suffix, None, path=site.path)
    # Without a summarizer build() never suspends, so one send() runs it to the end: no event
    # loop needed, and the learner may call this from inside one.
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value.ids, done.value.truncated_tokens
    coro.close()
    raise AssertionError("PromptBuilder.build suspended without a summarizer")


def editor_feedback(text: str, verdict: Verdict) -> ChoiceFeedback:
    """The served choice and the events the simulated editor sends about it, as the sink sees them."""
    return ChoiceFeedback(n_chars=len(text), text=text, events=editor_events(verdict))


def heldout_replay(
    model: Transformer,
    tok: Tokenizer,
    fmt: ModelFormat,
    sites: Sequence[Site],
    *,
    max_tokens: int,
    fp4_hook: WeightHook | None = None,
    weights: RewardWeights | None = None,
    context_budget: int = CONTEXT_BUDGET,
    summary_chunk_tokens: int = SUMMARY_CHUNK_TOKENS,
    threads: int | None = 1,
) -> ReplayStats:
    """Simulated editor sessions on `sites` with `model` in-process (see the module docstring).

    `max_tokens`: per completion (serving gives editor requests `serve.default_max_tokens`);
    `fp4_hook`: the learner's QAT hook, so the replay sees the weights as served; `weights`:
    the sink's reward weights; `context_budget`, `summary_chunk_tokens`: the serve settings
    whose prompt budget to mirror; `threads`: torch's CPU threads while replaying (None: leave
    them). One token at a time is too little work to split, and next to busy vLLM workers the
    thread pool's waits made a 2-thread replay of the small model take 570 s instead of 4 s."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    t0 = time.perf_counter()
    window = model.args.max_seq_len
    builder = prompt_builder(tok, fmt, window, context_budget=context_budget, summary_chunk_tokens=summary_chunk_tokens)
    hook = _frozen(fp4_hook)
    was_training, was_threads = model.training, torch.get_num_threads()
    model.eval()
    if threads is not None:
        torch.set_num_threads(threads)
    results = []
    try:
        for site in sites:
            prompt, truncated = site_prompt(builder, site)
            c = decode(
                model,
                tok,
                prompt,
                room(window, len(prompt), max_tokens),
                stop_ids=fmt.eos_ids,
                stop=EDITOR_STOP,
                fp4=hook,
            )
            verdict = judge(c.text, site.truth)
            r, parts = reward(editor_feedback(c.text, verdict), weights)
            results.append(
                SiteResult(
                    site.path,
                    c.text,
                    len(c.content_ids),
                    c.finish,
                    verdict.type,
                    verdict.select_kind,
                    verdict.accepted_chars,
                    parts["outcome"],
                    r,
                    len(prompt),
                    truncated,
                )
            )
    finally:
        model.train(was_training)
        torch.set_num_threads(was_threads)
    return ReplayStats.of(results, time.perf_counter() - t0)


def evaluate_candidate(
    candidate_model: Transformer,
    stable_model: Transformer,
    tok: Tokenizer,
    fmt: ModelFormat,
    sites: Sequence[Site],
    *,
    max_tokens: int,
    fp4_hook: WeightHook | None = None,
    weights: RewardWeights | None = None,
    context_budget: int = CONTEXT_BUDGET,
    summary_chunk_tokens: int = SUMMARY_CHUNK_TOKENS,
    threads: int | None = 1,
    stable_stats: ReplayStats | None = None,
) -> tuple[ReplayStats, ReplayStats]:
    """Replay both models on the same `sites` with the same settings: (stable stats, candidate
    stats), for the gate's `check` to compare.

    Pass `stable_stats` from an earlier call to skip replaying an unchanged stable model again."""
    replay = dict(
        max_tokens=max_tokens,
        fp4_hook=fp4_hook,
        weights=weights,
        context_budget=context_budget,
        summary_chunk_tokens=summary_chunk_tokens,
        threads=threads,
    )
    if stable_stats is None:
        stable_stats = heldout_replay(stable_model, tok, fmt, sites, **replay)
    return stable_stats, heldout_replay(candidate_model, tok, fmt, sites, **replay)


def _frozen(hook: WeightHook | None) -> WeightHook | None:
    """The hook memoized by weight name: weights do not change during a replay, and fake-quantizing
    every expert on every decoding step would make the replay several times slower."""
    if hook is None:
        return None
    cache: dict[str, torch.Tensor] = {}

    def frozen(name: str, w: torch.Tensor) -> torch.Tensor:
        if name not in cache:
            cache[name] = hook(name, w)
        return cache[name]

    return frozen
