"""Long context: full context vs truncation vs self-summary, on held-out files.

Each example is a cursor in a held-out Python file right after the first characters of a
name (a function, class or import) that the file defined far back: more than `budget`
tokens before the cursor, and not mentioned since. Truncating the prefix to `budget` tokens
loses the definition; a self-summary can keep it (summaries list imports and signatures);
full context keeps everything, where the whole prompt fits the model's window. The three
strategies run on the same vLLM engine, prompts and sampling (greedy), in one run.

Scores on the first line of the completion against the true rest of the line: exact match
and edit similarity (difflib ratio), plus the prompt tokens each strategy used.
"""

from __future__ import annotations

import asyncio
import difflib
import random
import re
import statistics
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from learner.corpus import SourceFile
from learner.prompts import MAX_SUMMARIES, PromptBuilder, SummaryCache
from serving.engine import SamplingSpec

_DEFINES = re.compile(
    r"^(?:\s*(?:async\s+)?def|\s*class)\s+([A-Za-z_]\w{3,})|^\s*import\s+([A-Za-z_]\w{3,})|^\s*from\s+\S+\s+import\s+([A-Za-z_]\w{3,})",
    re.M,
)


@dataclass(frozen=True)
class Example:
    path: str
    prefix: str
    suffix: str
    truth: str  # the rest of the cursor's line
    name: str
    distance_tokens: int  # from the definition to the cursor


def far_back_examples(
    tok,
    files: list[SourceFile],
    *,
    budget: int,
    window: int,
    n: int,
    rng: random.Random,
    max_distance: int | None = None,
    min_file_tokens: int = 0,
) -> list[Example]:
    """Cursors whose answer is a name defined between `budget` and `window` tokens back (or
    `max_distance`, beyond the window), unused since; in files of at least `min_file_tokens`."""
    farthest = max_distance if max_distance is not None else window - 16
    out: list[Example] = []
    for f in rng.sample(files, len(files)):
        if f.language != "python":
            continue
        text = f.text
        if min_file_tokens and len(tok.encode(text).ids) < min_file_tokens:
            continue
        for m in _DEFINES.finditer(text):
            name = next(g for g in m.groups() if g)
            for use in re.finditer(rf"\b{re.escape(name)}\b", text[m.end() :]):
                pos = m.end() + use.start()
                between = text[m.end() : pos]
                distance = len(tok.encode(text[m.start() : pos]).ids)
                if not budget < distance <= farthest or name in between:
                    continue
                line_end = text.find("\n", pos)
                line_end = len(text) if line_end < 0 else line_end
                cut = pos + 2  # the user typed the first two characters
                if line_end - cut < 2:
                    continue
                prefix = text[:cut]
                out.append(Example(f.path, prefix, text[line_end:], text[cut:line_end], name, distance))
                break
            if len(out) >= n:
                return out
    return out


def score(completion: str, truth: str) -> tuple[bool, float]:
    first = completion.split("\n", 1)[0]
    return first == truth, difflib.SequenceMatcher(None, first, truth, autojunk=False).ratio()


@dataclass
class StrategyResult:
    strategy: str
    examples: int
    exact_match: float
    edit_similarity: float
    prompt_tokens: float
    fallbacks: int
    per_example: list[tuple[bool, float]] | None = None  # (exact, similarity), in the examples' order


def paired(a: StrategyResult, b: StrategyResult) -> dict:
    """Is `a` better than `b` on the same examples? One-sided tests: edit similarity by a paired
    t-test, exact match by McNemar's exact test on the examples where exactly one is right."""
    from math import comb, sqrt

    from ops.rollout.stats import t_sf

    pairs = list(zip(a.per_example or [], b.per_example or [], strict=True))
    diffs = [sa - sb for (_, sa), (_, sb) in pairs]
    n = len(diffs)
    mean = statistics.mean(diffs) if diffs else 0.0
    sd = statistics.stdev(diffs) if n > 1 else 0.0
    if n < 2:
        p_sim = 1.0
    elif sd == 0:  # every difference the same: the sign is the answer
        p_sim = 0.0 if mean > 0 else 1.0
    else:
        p_sim = t_sf(mean / (sd / sqrt(n)), n - 1)
    only_a = sum(ea and not eb for (ea, _), (eb, _) in pairs)
    only_b = sum(eb and not ea for (ea, _), (eb, _) in pairs)
    k = only_a + only_b
    p_exact = sum(comb(k, i) for i in range(only_a, k + 1)) / 2**k if k else 1.0
    return {
        "better": a.strategy,
        "than": b.strategy,
        "examples": n,
        "similarity_diff": mean,
        "similarity_p": p_sim,
        "exact_only_better": only_a,
        "exact_only_other": only_b,
        "exact_p": p_exact,
    }


async def _evaluate(
    service, builders: dict[str, PromptBuilder], examples: list[Example], max_tokens: int
) -> list[StrategyResult]:
    spec = SamplingSpec(max_tokens=max_tokens, temperature=0.0, stream=False, stop=("\n",))
    results = []
    for name, builder in builders.items():
        summarize = service.summarize if name == "self-summary" else None
        em, sim, tokens, fallbacks = [], [], [], 0
        for ex in examples:
            prompt = await builder.build(ex.prefix, ex.suffix, summarize, path=ex.path)
            fallbacks += prompt.fallback
            final = []
            async for final in service.engine.generate(prompt.ids, spec, uuid.uuid4().hex):
                pass
            exact, similarity = score(final[0].text if final else "", ex.truth)
            em.append(exact)
            sim.append(similarity)
            tokens.append(len(prompt.ids))
        results.append(
            StrategyResult(
                name,
                len(examples),
                statistics.mean(em),
                statistics.mean(sim),
                statistics.mean(tokens),
                fallbacks,
                list(zip(em, sim, strict=True)),
            )
        )
    return results


def run(
    settings,
    model_dir: Path,
    *,
    n: int,
    budget: int,
    max_tokens: int,
    seed: int,
    progress,
    beyond_window: bool = False,
) -> dict:
    """The three strategies at `budget`; or, `beyond_window`, truncation against self-summary as
    serving builds them (its own budget, chunk and summary limit), on cursors in files of at least
    4 windows whose answer was defined beyond the window (at most 4 windows back), where full
    context cannot be had."""
    from learner.corpus import load_corpus
    from serving.replica import load_service, model_window

    window = model_window(model_dir) - max_tokens
    if not beyond_window and budget >= window:
        raise ValueError(
            f"--budget {budget} must be below the model's window ({window} tokens after {max_tokens} for the completion)"
        )
    corpus = load_corpus(getattr(getattr(settings, "pretrain", None), "corpus", None))
    service = load_service(model_dir, settings.serve, version=0)
    try:
        tok = service.tok
        if beyond_window:
            served = service.prompts
            budget, chunk, most = served.budget, served.chunk_tokens, served.max_summaries
            examples = far_back_examples(
                tok,
                corpus.heldout,
                budget=window,
                window=window,
                n=n,
                rng=random.Random(seed),
                max_distance=4 * window,
                min_file_tokens=4 * window,
            )
        else:
            chunk, most = max(16, budget // 3), MAX_SUMMARIES
            examples = far_back_examples(
                tok, corpus.heldout, budget=budget, window=window, n=n, rng=random.Random(seed)
            )
        if not examples:
            raise ValueError("no held-out example needs context from that far back; lower --budget")
        progress(
            f"{len(examples)} held-out examples; definitions {min(e.distance_tokens for e in examples)}-"
            f"{max(e.distance_tokens for e in examples)} tokens before the cursor; budget {budget}, window {window}"
        )
        builders = (
            {}
            if beyond_window
            else {"full context": PromptBuilder(tok, service.fmt, window, chunk, SummaryCache(0), 0)}
        )
        builders["truncation"] = PromptBuilder(tok, service.fmt, budget, chunk, SummaryCache(0), 0, max_summaries=most)
        builders["self-summary"] = PromptBuilder(
            tok, service.fmt, budget, chunk, SummaryCache(4096), 0, max_summaries=most
        )
        results = asyncio.run(_evaluate(service, builders, examples, max_tokens))
    finally:
        service.engine.shutdown()
    by_name = {r.strategy: r for r in results}
    return {
        "model_dir": str(model_dir),
        "mode": "beyond the window" if beyond_window else "within the window",
        "budget": budget,
        "window": window,
        "summary_chunk_tokens": chunk,
        "max_summaries": most,
        "examples": len(examples),
        "distance_tokens": [min(e.distance_tokens for e in examples), max(e.distance_tokens for e in examples)],
        "results": [asdict(r) for r in results],
        "summary_vs_truncation": paired(by_name["self-summary"], by_name["truncation"]),
    }
