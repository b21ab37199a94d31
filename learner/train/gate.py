"""The gate before publish: a held-out replay of simulated editor sessions, then checks that
block a candidate which games the online reward instead of getting better at completion.

Held-out replay (`heldout_replay`): the cursor sites of ops.simulate on held-out files (never
trained on), run in-process with the learner's torch model. Each site goes through the steps
serving and the simulated editor take, so the replay scores the candidate as users would:

    prompt    serving's PromptBuilder with the serve budget fitted to the model's window, the
              header editor requests get (`fim_header(language, path)`); a prefix past the
              budget is truncated, as serving's summarization fallback does (summarizing
              every older chunk, as serving does, would take minutes per site here)
    decode    learner.decode, greedy, up to `max_tokens` (clamped to the window, as the replica
              does), stopping at <|endoftext|> or at "\\n\\n" (the stop string serving gives
              editor requests, serving/api.py)
    judge     learner.judge against the true continuation: accept fully, by line or by
              word, or dismiss; an empty completion is not shown (the model abstained)
    reward    feedback.reward on the events the simulated editor sends for that verdict
              (learner.judge.editor_events), as the sink scores them

Checks (`check`), each of which blocks the publish and says why:

    sites              too few sites, or candidate and stable replayed on different sites
    heldout_reward     held-out reward below stable's by more than `reward_tolerance`
    reward_divergence  online reward rising while held-out reward falls: reward hacking
    suggestion_rate    the candidate stops suggesting (abstaining earns 0, never -0.25)
    completion_length  mean suggestion length collapses or explodes relative to stable
    kl                 the policy moved too far from the reference in one publish

The checks are a pure function of the two replays' stats; only the replay runs the model.
"""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Self

import torch
from pydantic import Field, model_validator
from tokenizers import Tokenizer

from feedback.core.config import Section
from feedback.reward import ChoiceFeedback, RewardWeights, reward
from learner.corpus import SourceFile
from learner.decode import decode, room
from learner.fim import fim_header
from learner.judge import Site, Verdict, cursor_sites, editor_events, judge
from learner.model import Transformer, WeightHook
from learner.prompts import EDITOR_STOP, PromptBuilder, SummaryCache
from serving.settings import ServeSettings

# --- replay -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SiteResult:
    """One replayed request: what the model suggested and what the simulated user did with it."""

    path: str
    text: str  # the suggestion as served: cut before the stop string
    tokens: int  # completion tokens generated (the stop string's included, <|endoftext|> not)
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
            "mean_reward": _num(self.mean_reward),
            "accept_rate": _num(self.accept_rate),
            "suggestion_rate": _num(self.suggestion_rate),
            "accepted_chars_per_request": _num(self.accepted_chars_per_request),
            "mean_completion_tokens": _num(self.mean_completion_tokens),
            "length_capped": self.length_capped,
            "truncated_prompts": self.truncated_prompts,
            "outcomes": dict(self.outcomes),
            "seconds": _num(self.seconds),
        }


def heldout_sites(files: Sequence[SourceFile], n: int = 48, *, seed: int = 0) -> list[Site]:
    """The replay's cursor sites: a pure function of (files, n, seed), so candidate and stable
    see the same ones. Pass the held-out split pretraining used (pretrain.load_training_corpus)."""
    return cursor_sites(files, n, random.Random(seed))


def replay_window(window: int, serve: ServeSettings | None = None) -> ServeSettings:
    """The serve settings a replica of a model with this context window runs with."""
    return (serve or ServeSettings()).fitted_to(window)


def prompt_builder(tok: Tokenizer, window: int, serve: ServeSettings | None = None) -> PromptBuilder:
    """Serving's prompt builder as a replica of a `window`-token model sets it up."""
    cfg = replay_window(window, serve)
    return PromptBuilder(tok, cfg.context_budget, cfg.summary_chunk_tokens, SummaryCache(0), version=0)


def site_prompt(builder: PromptBuilder, site: Site) -> tuple[list[int], int]:
    """(prompt ids, prefix tokens truncated) for a site, as serving builds it for an editor request."""
    coro = builder.build(site.prefix, site.suffix, fim_header(language=site.language, path=site.path), None)
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
    sites: Sequence[Site],
    *,
    max_tokens: int,
    fp4_hook: WeightHook | None = None,
    weights: RewardWeights | None = None,
    serve: ServeSettings | None = None,
    threads: int | None = 1,
) -> ReplayStats:
    """Simulated editor sessions on `sites` with `model` in-process (see the module docstring).

    `max_tokens`: per completion (serving gives editor requests `serve.default_max_tokens`);
    `fp4_hook`: the learner's QAT hook, so the replay sees the weights as served; `weights`:
    the sink's reward weights; `serve`: the serve settings whose prompt budget to mirror;
    `threads`: torch's CPU threads while replaying (None: leave them). One token at a time is
    too little work to split, and next to busy vLLM workers the thread pool's waits made a
    2-thread replay of the small model take 570 s instead of 4 s."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    t0 = time.perf_counter()
    window = model.args.max_seq_len
    builder = prompt_builder(tok, window, serve)
    hook = _frozen(fp4_hook)
    was_training, was_threads = model.training, torch.get_num_threads()
    model.eval()
    if threads is not None:
        torch.set_num_threads(threads)
    results = []
    try:
        for site in sites:
            prompt, truncated = site_prompt(builder, site)
            c = decode(model, tok, prompt, room(window, len(prompt), max_tokens), stop=EDITOR_STOP, fp4=hook)
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


# --- checks -----------------------------------------------------------------------------------------


class GateThresholds(Section):
    """When the gate blocks a candidate (section `[learn.gate]`). Rewards are per request, in the
    sink's units (accepted +0.75, dismissed -0.25, abstained 0)."""

    min_sites: int = Field(default=16, ge=1)
    """Fewest replayed sites the gate decides on; fewer blocks (the comparison would be noise)."""
    reward_tolerance: float = Field(default=0.03, ge=0)
    """How far the candidate's held-out mean reward may fall below stable's. 0.03 lets about one
    of 48 sites flip from accepted to dismissed (1/48 of a 1.0 swing is 0.021)."""
    divergence_tolerance: float = Field(default=0.01, ge=0)
    """The same, while the online reward trend is rising: online up and held-out down is the
    signature of reward hacking, so the gate is stricter then."""
    min_suggestion_ratio: float = Field(default=0.5, ge=0, le=1)
    """The candidate's suggestion rate must be at least this share of stable's."""
    min_suggestion_rate: float = Field(default=0.05, ge=0, le=1)
    """Absolute floor on the suggestion rate: below it the candidate abstains almost everywhere.
    Applies only when the candidate is also below stable (a weak stable does not block itself)."""
    min_length_ratio: float = Field(default=0.5, gt=0)
    """Mean suggestion length (tokens) of the candidate over stable's: lower bound."""
    max_length_ratio: float = Field(default=2.0, gt=0)
    """Upper bound of the same ratio (a model that repeats itself runs to max_tokens)."""
    max_kl: float = Field(default=0.2, gt=0)
    """Mean per-token KL (nats; the k3 estimate rl_loss reports as `kl_ref`) from the reference
    above which the candidate moved too far for one publish."""

    @model_validator(mode="after")
    def _ordered(self) -> Self:
        if self.min_length_ratio > self.max_length_ratio:
            raise ValueError(
                f"min_length_ratio ({self.min_length_ratio}) must not exceed max_length_ratio ({self.max_length_ratio})"
            )
        return self


@dataclass
class GateResult:
    passed: bool
    reasons: list[str]  # one line per failed check, starting with the check's name
    metrics: dict[str, Any]  # JSON-safe: goes into model_versions.metrics and flywheel.versions


def check(
    candidate: ReplayStats,
    stable: ReplayStats,
    *,
    online_reward_trend: float | None,
    kl: float,
    thresholds: GateThresholds | None = None,
) -> GateResult:
    """Whether to publish `candidate`, judged against `stable` on the same held-out sites.

    `online_reward_trend`: how the online (served) mean reward moved while the candidate trained,
    positive when rising; None when unknown. `kl`: the candidate's mean per-token KL from the
    reference model."""
    t = thresholds or GateThresholds()
    trend = online_reward_trend if online_reward_trend is not None and math.isfinite(online_reward_trend) else None
    failed: dict[str, str] = {}

    if candidate.n != stable.n:
        failed["sites"] = (
            f"candidate replayed {candidate.n} sites and stable {stable.n}: compare them on the same sites"
        )
    elif candidate.n < t.min_sites:
        failed["sites"] = f"only {candidate.n} held-out sites replayed; the gate needs at least {t.min_sites}"

    delta = candidate.mean_reward - stable.mean_reward
    if delta < -t.reward_tolerance:
        failed["heldout_reward"] = (
            f"held-out reward {candidate.mean_reward:.3f} is {-delta:.3f} below stable's "
            f"{stable.mean_reward:.3f} (tolerance {t.reward_tolerance})"
        )
    if trend is not None and trend > 0 and delta < -t.divergence_tolerance:
        failed["reward_divergence"] = (
            f"online reward rose by {trend:+.3f} while held-out reward fell by {-delta:.3f} "
            f"(tolerance {t.divergence_tolerance}): reward hacking, not better completions"
        )

    suggestion_ratio = _ratio(candidate.suggestion_rate, stable.suggestion_rate)
    if (suggestion_ratio is not None and suggestion_ratio < t.min_suggestion_ratio) or (
        candidate.suggestion_rate < t.min_suggestion_rate and candidate.suggestion_rate < stable.suggestion_rate
    ):
        failed["suggestion_rate"] = (
            f"candidate suggests on {candidate.suggestion_rate:.0%} of requests vs {stable.suggestion_rate:.0%} "
            f"for stable (floor: {t.min_suggestion_ratio:.0%} of stable, and {t.min_suggestion_rate:.0%}): "
            "it learned to abstain"
        )

    length_ratio = (
        _ratio(candidate.mean_completion_tokens, stable.mean_completion_tokens)
        if candidate.shown and stable.shown
        else None
    )
    if length_ratio is not None and not t.min_length_ratio <= length_ratio <= t.max_length_ratio:
        failed["completion_length"] = (
            f"mean suggestion length {candidate.mean_completion_tokens:.1f} tokens is {length_ratio:.2f}x "
            f"stable's {stable.mean_completion_tokens:.1f} (allowed {t.min_length_ratio}x to {t.max_length_ratio}x)"
        )

    if not math.isfinite(kl):
        failed["kl"] = f"KL to the reference is {kl}: the update diverged"
    elif kl > t.max_kl:
        failed["kl"] = f"KL to the reference {kl:.3f} nats/token exceeds {t.max_kl}"

    metrics = {
        "passed": not failed,
        "failed": list(failed),
        "candidate": candidate.summary(),
        "stable": stable.summary(),
        "reward_delta": _num(delta),
        "suggestion_ratio": _num(suggestion_ratio),
        "length_ratio": _num(length_ratio),
        "kl": _num(kl),
        "online_reward_trend": _num(trend),
        "thresholds": t.model_dump(mode="json"),
    }
    return GateResult(not failed, [f"{name}: {why}" for name, why in failed.items()], metrics)


def evaluate_candidate(
    candidate_model: Transformer,
    stable_model: Transformer,
    tok: Tokenizer,
    sites: Sequence[Site],
    *,
    max_tokens: int,
    kl: float,
    online_reward_trend: float | None = None,
    thresholds: GateThresholds | None = None,
    fp4_hook: WeightHook | None = None,
    weights: RewardWeights | None = None,
    serve: ServeSettings | None = None,
    threads: int | None = 1,
    stable_stats: ReplayStats | None = None,
) -> tuple[GateResult, ReplayStats, ReplayStats]:
    """Replay both models on `sites` and check the candidate: (result, stable stats, candidate stats).

    Pass `stable_stats` from an earlier call to skip replaying an unchanged stable model again."""
    replay = dict(max_tokens=max_tokens, fp4_hook=fp4_hook, weights=weights, serve=serve, threads=threads)
    if stable_stats is None:
        stable_stats = heldout_replay(stable_model, tok, sites, **replay)
    candidate_stats = heldout_replay(candidate_model, tok, sites, **replay)
    result = check(candidate_stats, stable_stats, online_reward_trend=online_reward_trend, kl=kl, thresholds=thresholds)
    return result, stable_stats, candidate_stats


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def _num(x: float | None) -> float | None:
    """A JSON-safe number: None for missing or non-finite values (PostgreSQL's jsonb has no NaN)."""
    return None if x is None or not math.isfinite(x) else round(float(x), 6)
