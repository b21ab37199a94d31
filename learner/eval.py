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
              does), stopping at the model's EOS tokens or at the site language's editor stops
              (learner.languages.editor_stops: a blank line, the next top-level definition), as
              serving stops editor requests
    gate      the confidence gate serving applies (`min_confidence`, model.min_confidence;
              learner/confidence.py): a suggestion whose first token the model gave a lower
              probability is withheld, as the editor gets it: not shown
    judge     learner.judge against the true continuation: accept fully, by line or by word,
              or dismiss; an empty completion is not shown (the model abstained)
    reward    feedback.reward on the events the simulated editor sends for that verdict
              (learner.judge.editor_events), as the sink scores them

This is the one evaluation: `flywheel eval` (learner/train/evaluate.py), the learner's gate
(learner/train/gate.py, on `evaluate_candidate`'s two replays of the same sites), the learning
benchmark (ops/bench/learn.py) and the demo's summary all replay with `heldout_replay` and report
`ReplayStats.intervals()`, each with its own number of sites.

Reported with 95% confidence intervals over the sites (`intervals`):

    accept rate                 accepted / shown suggestions        Wilson score interval
    suggestion rate             shown / requests                    Wilson
    exact match                 requests whose suggestion's first   Wilson
                                line is the rest of the line
    accepted chars / request    mean over requests                  Student's t interval
    mean reward                 mean over requests                  Student's t
    latency ms                  prompt + greedy decode per request, Student's t
                                in-process on this CPU (not serving's: `flywheel bench serve`)
    token accuracy              teacher-forced: of the rest of the      Student's t
    (with `token_accuracy`)     line's tokens, the share the model's
                                argmax predicts given the prompt and
                                the true tokens before; mean over sites

`prefix_only(fmt)` is the same model prompted without its FIM template (the suffix left out), so
`flywheel eval --compare-prefix` replays both prompt forms on the same sites: the check that
the fill-in-the-middle format helps rather than hurts.

Wilson, not the normal approximation, because accept rates near 0 are the common case and the
normal interval would reach below 0; t on the means, since with hundreds of sites the sample
mean is close to normal even for the zero-heavy accepted characters, and it is exact to check.
"""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from rich.table import Table
from rich.text import Text
from tokenizers import Tokenizer

from feedback.core.stats import percentile
from feedback.reward import ChoiceFeedback, RewardWeights, reward
from learner.confidence import withheld as below_confidence
from learner.corpus import SourceFile
from learner.decode import decode, room
from learner.fim import encode
from learner.formats import ModelFormat
from learner.judge import Site, Verdict, cursor_sites, editor_events, judge
from learner.languages import editor_stops
from learner.model import Transformer, WeightHook
from learner.prompts import CONTEXT_BUDGET, SUMMARY_CHUNK_TOKENS, PromptBuilder, SummaryCache, fit_budget
from learner.show import ShowPolicy, cursor_line

# --- confidence intervals ---------------------------------------------------------------------------

CONFIDENCE = 0.95


@dataclass(frozen=True)
class Interval:
    """A metric's value and its two-sided confidence interval over `n` observations; the bounds
    are None where they are undefined (no observations; a mean of one)."""

    value: float | None
    low: float | None
    high: float | None
    n: int
    method: str  # wilson | t

    def as_dict(self) -> dict[str, Any]:
        return {
            "value": _maybe(self.value),
            "low": _maybe(self.low),
            "high": _maybe(self.high),
            "n": self.n,
            "method": self.method,
        }


def _maybe(x: float | None) -> float | None:
    return None if x is None else json_number(x)


def wilson(k: int, n: int, confidence: float = CONFIDENCE) -> Interval:
    """Wilson score interval of the proportion k/n: (p + z²/2n ± z·sqrt(p(1-p)/n + z²/4n²)) / (1 + z²/n)."""
    if not 0 <= k <= n:
        raise ValueError(f"a proportion needs 0 <= k <= n, got {k} of {n}")
    if n == 0:
        return Interval(None, None, None, 0, "wilson")
    z = statistics.NormalDist().inv_cdf(0.5 + confidence / 2)
    p, z2 = k / n, z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    # At k = 0 (k = n) the bound is exactly 0 (1); rounding would leave it a hair off.
    low = 0.0 if k == 0 else max(0.0, centre - half)
    high = 1.0 if k == n else min(1.0, centre + half)
    return Interval(p, low, high, n, "wilson")


def t_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> Interval:
    """Student's t interval of the mean: mean ± t(confidence, n-1) · s / sqrt(n)."""
    n = len(values)
    if n == 0:
        return Interval(None, None, None, 0, "t")
    mean = statistics.fmean(values)
    if n == 1:
        return Interval(mean, None, None, 1, "t")
    half = t_quantile(confidence, n - 1) * statistics.stdev(values) / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n, "t")


@dataclass(frozen=True)
class PairedRatio:
    """One replay's accept rate (of shown) against another's on the same sites: the ratio (None
    where the base had no accept), its percentile-bootstrap interval, and the one-sided p of "no
    higher"."""

    ratio: float | None
    low: float | None
    high: float | None
    p: float | None
    rounds: int

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def ratio_text(self) -> str:
        """The ratio as printed, with its interval: "1.23x [0.99, 1.48]" ("" without a ratio)."""
        if self.ratio is None:
            return ""
        if self.low is None or self.high is None:
            return f"{self.ratio:.2f}x"
        return f"{self.ratio:.2f}x [{self.low:.2f}, {self.high:.2f}]"

    def p_text(self) -> str:
        """p as printed: below the resolution of the resamples, as a bound ("< 0.0001")."""
        if self.p is None:
            return ""
        return f"< {1 / self.rounds:.4f}" if self.p == 0 else f"{self.p:.4f}"


def paired_accept_ratio(
    base: Sequence[SiteResult],
    new: Sequence[SiteResult],
    *,
    rounds: int = 10_000,
    confidence: float = CONFIDENCE,
    seed: int = 0,
) -> PairedRatio:
    """Is `new`'s accept rate of shown suggestions higher than `base`'s, replayed on the same
    sites (`base[i]` and `new[i]` are one site)? A paired bootstrap: `rounds` resamples of the
    sites with replacement, each taking both replays' results at the sites drawn, so a site that
    both show and both get accepted counts once on each side, as it happened. Two independent
    samples' tests (ops.rollout.stats.two_proportion_ztest) ignore that pairing, and where one
    version shows a subset of what the other shows, they overstate the variance of the
    difference. p: the share of resamples whose new rate is not above base's (a resample where
    either shows nothing counts as not above). Deterministic for a `seed`."""
    import numpy as np

    if len(base) != len(new):
        raise ValueError(f"paired_accept_ratio needs the same sites: {len(base)} against {len(new)} results")
    if not base:
        return PairedRatio(None, None, None, None, 0)

    def columns(results: Sequence[SiteResult]) -> tuple[np.ndarray, np.ndarray]:
        return (
            np.array([bool(r.text) for r in results], dtype=np.float64),
            np.array([r.verdict == "select" for r in results], dtype=np.float64),
        )

    (bs, ba), (ns, na) = columns(base), columns(new)
    if not bs.sum() or not ns.sum():
        return PairedRatio(None, None, None, None, 0)
    # no ratio to a base that had nothing accepted; the test still says whether new is above it
    ratio = float((na.sum() / ns.sum()) / (ba.sum() / bs.sum())) if ba.sum() else None
    rng = np.random.default_rng(seed)
    n, above, ratios = len(base), 0, []
    for start in range(0, rounds, 1000):  # 1,000 resamples at a time: n x 1,000 indices in memory
        idx = rng.integers(0, n, size=(min(1000, rounds - start), n))
        b_shown, b_acc, n_shown, n_acc = bs[idx].sum(1), ba[idx].sum(1), ns[idx].sum(1), na[idx].sum(1)
        both = (b_shown > 0) & (n_shown > 0)
        b_rate = np.divide(b_acc, b_shown, out=np.zeros_like(b_acc), where=both)
        n_rate = np.divide(n_acc, n_shown, out=np.zeros_like(n_acc), where=both)
        above += int((both & (n_rate > b_rate)).sum())
        keep = both & (b_rate > 0)
        ratios.append(n_rate[keep] / b_rate[keep])
    r = np.concatenate(ratios)
    tail = (1 - confidence) / 2
    low, high = (float(x) for x in np.quantile(r, [tail, 1 - tail])) if len(r) else (None, None)
    return PairedRatio(ratio, low, high, 1 - above / rounds, rounds)


def t_quantile(confidence: float, df: int) -> float:
    """The t with P(|T| <= t) = `confidence` for Student's t with `df` degrees of freedom: the
    two-sided critical value (2.262 for 95% and df 9). Bisection on the exact distribution
    function; beyond 1000 degrees of freedom, the Cornish-Fisher expansion in 1/df (Abramowitz
    and Stegun 26.7.5), whose first omitted term is below 1e-12 there."""
    if not 0 < confidence < 1 or df < 1:
        raise ValueError(f"t_quantile needs 0 < confidence < 1 and df >= 1, got {confidence}, {df}")
    if df > 1000:
        z = statistics.NormalDist().inv_cdf(0.5 + confidence / 2)
        g = (
            (z**3 + z) / 4,
            (5 * z**5 + 16 * z**3 + 3 * z) / 96,
            (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384,
            (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160,
        )
        return z + sum(gi / df ** (i + 1) for i, gi in enumerate(g))
    lo, hi = 0.0, 1.0
    while _t_within(hi, df) < confidence:
        lo, hi = hi, 2 * hi
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _t_within(mid, df) < confidence else (lo, mid)
        if hi - lo < 1e-13 * hi:
            break
    return (lo + hi) / 2


def _t_within(t: float, df: int) -> float:
    """P(|T| <= t) for Student's t with integer `df`, in closed form (Abramowitz and Stegun
    26.7.3-4): with θ = atan(t / sqrt(df)), odd df: (2/π)(θ + sin θ Σ a_j cos^(2j+1) θ),
    a_0 = 1, a_j = a_(j-1) 2j/(2j+1), j < (df-1)/2; even df: sin θ Σ b_j cos^(2j) θ, b_0 = 1,
    b_j = b_(j-1) (2j-1)/(2j), j < df/2."""
    theta = math.atan(t / math.sqrt(df))
    s, c = math.sin(theta), math.cos(theta)
    total, term = 0.0, 1.0
    if df % 2:
        term = c
        for j in range((df - 1) // 2):
            if j:
                term *= c * c * (2 * j) / (2 * j + 1)
            total += term
        return 2 / math.pi * (theta + s * total)
    for j in range(df // 2):
        if j:
            term *= c * c * (2 * j - 1) / (2 * j)
        total += term
    return s * total


# --- the replay ------------------------------------------------------------------------------------


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
    exact: bool = False  # the suggestion's first line is the rest of the line (exact_match)
    truth_tokens: int = 0  # rest-of-line tokens scored teacher-forced (0: not measured)
    truth_hits: int = 0  # of them, predicted by the model's argmax
    withheld: bool = False  # the confidence gate kept the suggestion from the editor (`text` is "")
    first_logprob: float | None = None  # the model's logprob of the suggestion's first token (None: no token)
    policy_withholds: bool = False  # the version's show policy (learner/show.py) does not show it
    logprobs: tuple[float, ...] = field(default=(), compare=False, repr=False)  # the suggestion's tokens' (raw)
    # A measurement, not an outcome: two replays of one model agree on everything else.
    latency_s: float = field(default=0.0, compare=False)


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
    exact: int = 0  # requests whose suggestion's first line is the rest of the line
    truncated_prompts: int = 0  # prompts whose prefix was cut to the budget
    withheld: int = 0  # suggestions the confidence gate kept from the editor (not shown)
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
    def exact_match(self) -> float:
        """Requests whose suggestion's first line equals the rest of the line / requests."""
        return self.exact / self.n if self.n else 0.0

    @property
    def mean_completion_tokens(self) -> float:
        """Mean length of the shown suggestions (abstentions are the suggestion rate's business)."""
        return self.completion_tokens / self.shown if self.shown else 0.0

    def site_token_accuracies(self) -> list[float]:
        """Per site scored teacher-forced, the share of the rest of the line's tokens the model
        predicts ([] when not measured)."""
        return [r.truth_hits / r.truth_tokens for r in self.results if r.truth_tokens]

    @property
    def token_accuracy(self) -> float | None:
        """Mean of `site_token_accuracies` (None: not measured)."""
        scored = self.site_token_accuracies()
        return sum(scored) / len(scored) if scored else None

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
            exact=sum(r.exact for r in results),
            truncated_prompts=sum(r.truncated_tokens > 0 for r in results),
            withheld=sum(r.withheld for r in results),
            seconds=seconds,
            outcomes=dict(Counter(r.outcome for r in results)),
            results=list(results),
        )

    def gated(self, min_confidence: float, weights: RewardWeights | None = None) -> ReplayStats:
        """These sites as the confidence gate at `min_confidence` would have served them: the gate
        only hides suggestions, so one replay without it (min_confidence 0) gives every threshold's."""
        return ReplayStats.of([gated(r, min_confidence, weights) for r in self.results], self.seconds)

    def intervals(self, confidence: float = CONFIDENCE) -> dict[str, Interval]:
        """The reported metrics with their confidence intervals (see the module docstring).
        The means need the per-site results; stats built without them get no bounds for those."""
        per_site = len(self.results) == self.n

        def mean(values: list[float], aggregate: float) -> Interval:
            return t_interval(values, confidence) if per_site else Interval(aggregate, None, None, self.n, "t")

        return {
            "accept_rate": wilson(self.accepted, self.shown, confidence),
            "accepted_chars_per_request": mean(
                [r.accepted_chars for r in self.results], self.accepted_chars_per_request
            ),
            "suggestion_rate": wilson(self.shown, self.n, confidence),
            "exact_match": wilson(self.exact, self.n, confidence),
            "mean_reward": mean([r.reward for r in self.results], self.mean_reward),
            "latency_ms": mean([r.latency_s * 1e3 for r in self.results], float("nan")),
            "token_accuracy": t_interval(self.site_token_accuracies(), confidence),  # no value where not measured
        }

    def latency_percentiles_ms(self) -> dict[str, float | None]:
        """p50 and p99 of the per-request latency (nearest rank), in ms."""
        ms = [r.latency_s * 1e3 for r in self.results]
        return {"p50": json_number(percentile(ms, 0.5)), "p99": json_number(percentile(ms, 0.99))}

    def summary(self) -> dict[str, Any]:
        """JSON-safe aggregates (no per-site results), with the confidence intervals."""
        return {
            "n": self.n,
            "shown": self.shown,
            "accepted": self.accepted,
            "exact": self.exact,
            "mean_reward": json_number(self.mean_reward),
            "accept_rate": json_number(self.accept_rate),
            "suggestion_rate": json_number(self.suggestion_rate),
            "accepted_chars_per_request": json_number(self.accepted_chars_per_request),
            "exact_match": json_number(self.exact_match),
            "mean_completion_tokens": json_number(self.mean_completion_tokens),
            "length_capped": self.length_capped,
            "truncated_prompts": self.truncated_prompts,
            "withheld": self.withheld,
            "outcomes": dict(self.outcomes),
            "seconds": json_number(self.seconds),
            "confidence": CONFIDENCE,
            "intervals": {name: i.as_dict() for name, i in self.intervals().items()},
            "latency_ms": self.latency_percentiles_ms(),
        }


# How each reported metric is printed: its label and how to format a value of it.
_REPORT_ROWS: tuple[tuple[str, str, Callable[[float], str]], ...] = (
    ("accept_rate", "accept rate (of shown)", lambda x: f"{x:.1%}"),
    ("accepted_chars_per_request", "accepted chars / request", lambda x: f"{x:.2f}"),
    ("suggestion_rate", "suggestion rate", lambda x: f"{x:.1%}"),
    ("exact_match", "exact match, rest of line", lambda x: f"{x:.1%}"),
    ("mean_reward", "mean reward", lambda x: f"{x:+.3f}"),
    ("latency_ms", "latency ms (in-process)", lambda x: f"{x:.0f}"),
    ("token_accuracy", "token accuracy, rest of line (teacher-forced)", lambda x: f"{x:.1%}"),
)


_MEASURED_ON_REQUEST = frozenset({"token_accuracy"})
"""Rows left out of the table when no column measured them."""


def report_table(columns: Mapping[str, ReplayStats], *, title: str) -> Table:
    """The evaluation as a table, one column per replayed model: each metric with its
    confidence interval, then the sites, suggestions shown and latency percentiles."""
    t = Table("metric", *columns, title=title, caption=Text(f"[low, high]: {CONFIDENCE:.0%} confidence interval"))
    intervals = {name: st.intervals() for name, st in columns.items()}
    for key, label, fmt in _REPORT_ROWS:
        if key in _MEASURED_ON_REQUEST and all(intervals[name][key].n == 0 for name in columns):
            continue
        t.add_row(label, *(_cell(intervals[name][key], fmt) for name in columns))
    t.add_row("sites (requests)", *(str(st.n) for st in columns.values()))
    t.add_row("suggestions shown, accepted", *(f"{st.shown}, {st.accepted}" for st in columns.values()))
    t.add_row(
        "latency p50 / p99 ms",
        *(
            f"{p['p50']:.0f} / {p['p99']:.0f}" if p["p50"] is not None else "-"
            for p in (st.latency_percentiles_ms() for st in columns.values())
        ),
    )
    return t


def gate_curve_table(curve: Mapping[float, ReplayStats], *, current: float) -> Table:
    """The confidence gate's trade-off, one row per threshold (`ReplayStats.gated` of one replay):
    what is shown, what is accepted of it, and what the user gets per request."""
    fmts = dict((key, fmt) for key, _, fmt in _REPORT_ROWS)
    t = Table(
        "min_confidence",
        "suggestion rate",
        "accept rate (of shown)",
        "accepted chars / request",
        "mean reward",
        "withheld",
        title="the confidence gate's trade-off (the same sites)",
        caption=Text(f"[low, high]: {CONFIDENCE:.0%} confidence interval; * the current setting"),
    )
    for th, st in curve.items():
        i = st.intervals()
        t.add_row(
            f"{th:g}{' *' if th == current else ''}",
            *(
                _cell(i[k], fmts[k])
                for k in ("suggestion_rate", "accept_rate", "accepted_chars_per_request", "mean_reward")
            ),
            str(st.withheld),
        )
    return t


def _cell(i: Interval, fmt: Callable[[float], str]) -> Text:
    if i.value is None or not math.isfinite(i.value):
        return Text("-")
    if i.low is None or i.high is None:
        return Text(fmt(i.value))
    return Text(f"{fmt(i.value)} [{fmt(i.low)}, {fmt(i.high)}]")  # Text: the brackets are not markup


def json_number(x: float | None) -> float | None:
    """A JSON-safe number: None for missing or non-finite values (PostgreSQL's jsonb has no NaN)."""
    return None if x is None or not math.isfinite(x) else round(float(x), 6)


def heldout_sites(
    files: Sequence[SourceFile], n: int = 48, *, seed: int = 0, cursor: str = "end_of_line"
) -> list[Site]:
    """The replay's cursor sites: a pure function of (files, n, seed, cursor), so candidate and
    stable see the same ones. Pass the held-out split pretraining used (pretrain.load_training_corpus)."""
    return cursor_sites(files, n, random.Random(seed), cursor=cursor)


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


def prefix_only(fmt: ModelFormat) -> ModelFormat:
    """The model's format without its FIM template: prompts are the prefix alone, as for a
    model without FIM tokens (the suffix is left out)."""
    return dataclasses.replace(fmt, fim=None)


@torch.no_grad()
def truth_accuracy(
    model: Transformer, prompt: list[int], truth: list[int], window: int, fp4: WeightHook | None
) -> tuple[int, int]:
    """(tokens of `truth` the model's argmax predicts, tokens scored), teacher-forced after
    `prompt`: one forward over prompt + truth, as far as the window allows."""
    truth = truth[: max(0, window - len(prompt))]
    if not truth:
        return 0, 0
    device = next(model.parameters()).device
    ids = torch.tensor([prompt + truth[:-1]], device=device)
    logits = model(ids, logits_to_keep=len(truth), fp4=fp4)[0]
    hits = (logits.argmax(-1) == torch.tensor(truth, device=device)).sum().item()
    return int(hits), len(truth)


def line_matches(suggestion: str, truth: str) -> bool:
    """Whether the suggestion's first line is the rest of the line (trailing whitespace aside).
    An empty suggestion matches nothing: abstaining is not a match."""
    first_line = suggestion.split("\n", 1)[0]
    return bool(first_line.strip()) and first_line.rstrip() == truth.rstrip()


def editor_feedback(text: str, verdict: Verdict, *, withheld: bool = False) -> ChoiceFeedback:
    """The served choice and the events the simulated editor sends about it, as the sink sees them
    (`withheld`: the confidence gate kept it from the editor)."""
    return ChoiceFeedback(n_chars=len(text), text=text, events=editor_events(verdict), withheld=withheld)


def gated(result: SiteResult, min_confidence: float, weights: RewardWeights | None = None) -> SiteResult:
    """`result` as serving's confidence gate at `min_confidence` and the version's show policy
    leave it: withheld (not shown, scored as the sink scores a withheld choice) when its first
    token is below the threshold or the policy does not show it."""
    if not result.text or result.first_logprob is None:
        return result
    if not result.policy_withholds and not below_confidence([result.first_logprob], min_confidence):
        return result
    r, parts = reward(editor_feedback("", Verdict("none"), withheld=True), weights)
    return dataclasses.replace(
        result,
        text="",
        verdict="none",
        select_kind=None,
        accepted_chars=0,
        outcome=parts["outcome"],
        reward=r,
        exact=False,
        withheld=True,
    )


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
    progress: Callable[[SiteResult], None] | None = None,
    token_accuracy: bool = False,
    min_confidence: float = 0.0,
    show_policy: ShowPolicy | None = None,
) -> ReplayStats:
    """Simulated editor sessions on `sites` with `model` in-process (see the module docstring).

    `max_tokens`: per completion (serving gives editor requests `serve.default_max_tokens`);
    `fp4_hook`: the learner's QAT hook, so the replay sees the weights as served; `weights`:
    the sink's reward weights; `context_budget`, `summary_chunk_tokens`: the serve settings
    whose prompt budget to mirror; `threads`: torch's CPU threads while replaying (None: leave
    them). One token at a time is too little work to split, and next to busy vLLM workers the
    thread pool's waits made a 2-thread replay of the small model take 570 s instead of 4 s.
    `progress` is called with each site's result as it is done. `token_accuracy`: also score the
    rest of each line teacher-forced (one more forward per site). `min_confidence`: the confidence
    gate's threshold (model.min_confidence; 0: every suggestion is shown); `show_policy`: the
    version's learned show policy (learner/show.py), applied after the gate as serving applies it."""
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
            started = time.perf_counter()
            prompt, truncated = site_prompt(builder, site)
            c = decode(
                model,
                tok,
                prompt,
                room(window, len(prompt), max_tokens),
                stop_ids=fmt.eos_ids,
                stop=editor_stops(site.language, site.prefix),
                fp4=hook,
            )
            latency = time.perf_counter() - started
            verdict = judge(c.text, site.truth)
            r, parts = reward(editor_feedback(c.text, verdict), weights)
            hits, scored = (
                truth_accuracy(model, prompt, encode(tok, site.truth), window, hook) if token_accuracy else (0, 0)
            )
            results.append(
                gated(
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
                        exact=line_matches(c.text, site.truth),
                        truth_tokens=scored,
                        truth_hits=hits,
                        first_logprob=c.logprobs[0] if c.logprobs else None,
                        logprobs=tuple(c.logprobs),
                        policy_withholds=bool(c.text)
                        and show_policy is not None
                        and not show_policy.shows(c.logprobs, c.text, cursor_line(site.prefix)),
                        latency_s=latency,
                    ),
                    min_confidence,
                    weights,
                )
            )
            if progress is not None:
                progress(results[-1])
    finally:
        model.train(was_training)
        torch.set_num_threads(was_threads)
    return ReplayStats.of(results, time.perf_counter() - t0)


def evaluate(
    model: Transformer,
    tok: Tokenizer,
    fmt: ModelFormat,
    files: Sequence[SourceFile],
    *,
    sites: int,
    seed: int,
    max_tokens: int,
    fp4_hook: WeightHook | None = None,
    threads: int | None = 1,
    progress: Callable[[SiteResult], None] | None = None,
    token_accuracy: bool = False,
    min_confidence: float = 0.0,
    cursor: str = "end_of_line",
    show_policy: ShowPolicy | None = None,
) -> ReplayStats:
    """The evaluation: `sites` cursor sites of the held-out `files` picked by `seed` (`cursor`: where
    in a line, learner.judge.cursor_sites), replayed with
    `model` (heldout_replay, serve settings at their defaults) and its version's `show_policy`. `flywheel eval`, the learning
    benchmark and the demo's summary call it; the gate replays the same sites for two models."""
    return heldout_replay(
        model,
        tok,
        fmt,
        heldout_sites(files, sites, seed=seed, cursor=cursor),
        max_tokens=max_tokens,
        fp4_hook=fp4_hook,
        threads=threads,
        progress=progress,
        token_accuracy=token_accuracy,
        min_confidence=min_confidence,
        show_policy=show_policy,
    )


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
    min_confidence: float = 0.0,
    candidate_policy: ShowPolicy | None = None,
    stable_policy: ShowPolicy | None = None,
) -> tuple[ReplayStats, ReplayStats]:
    """Replay both models on the same `sites` with the same settings, each with its own show
    policy: (stable stats, candidate stats), for the gate's `check` to compare.

    Pass `stable_stats` from an earlier call to skip replaying an unchanged stable model again."""
    replay = dict(
        max_tokens=max_tokens,
        fp4_hook=fp4_hook,
        weights=weights,
        context_budget=context_budget,
        summary_chunk_tokens=summary_chunk_tokens,
        threads=threads,
        min_confidence=min_confidence,
    )
    if stable_stats is None:
        stable_stats = heldout_replay(stable_model, tok, fmt, sites, **replay, show_policy=stable_policy)
    return stable_stats, heldout_replay(candidate_model, tok, fmt, sites, **replay, show_policy=candidate_policy)


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
