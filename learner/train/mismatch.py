"""The train-inference mismatch of a served version, measured on what it served: router replay
(R3) version by version.

Each update of the learner records its batch's mismatch (learner.train.learn.rl_update), so a
version's figure covers the few dozen samples its updates took. The mismatch without replay is
heavy-tailed: the FP4 forward's own experts differ from the serving engine's at well under 1% of
(token, layer) pairs, and each such token's logprob moves by whole units. A version of three
updates may hold none of them, and replay then has nothing to remove.

This module measures it on everything a version served instead, with nothing else in the way:

    samples   the newest completions the version served (`completion_choices`, with the experts
              vLLM routed each token to and the logprobs it sampled them at)
    model     the version's served weights, FP4 dequantized (the store's packed checkpoint: what
              the replicas load), in the learner's fp32 forward
    mismatch  k3 KL per completion token against vLLM's logprobs, twice: the forward routing
              itself, and the forward replaying serving's routes (positions a record lacks route
              themselves)

Both run on the same weights as served, so no training drift enters either figure.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from sqlalchemy import select
from sqlalchemy.engine import Engine

from feedback import db
from learner.formats import ModelFormat
from learner.model import ModelArgs, Transformer, WeightHook
from learner.train.learn import Sample, in_vocabulary, k3_BT, make_batch, token_logprobs

RESAMPLES = 2000
"""Bootstrap resamples of the completions behind the interval of replay / own."""


@dataclass(frozen=True)
class ServedMismatch:
    """One version's mismatch KL per completion token on the completions it served."""

    version: int
    completions: int
    tokens: int
    replay: float  # serving's routes replayed (R3)
    own: float  # the FP4 forward's own routing
    rerouted: float  # share of the routed (position, layer) pairs where vLLM's experts differ from the forward's own
    ratio_interval: tuple[float, float] | None = None  # 95% percentile bootstrap over the completions

    @property
    def ratio(self) -> float | None:
        """replay / own; None where no route differs: both forwards then route alike, so replay
        had nothing to remove (a serving engine computing in float32 reproduces the forward's
        routes and logprobs: a ratio of two rounding errors says nothing of replay)."""
        return self.replay / self.own if self.own > 0 and self.rerouted > 0 else None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"ratio": self.ratio}


def served_samples(engine: Engine, version: int, limit: int, vocab_size: int) -> list[Sample]:
    """The newest `limit` choices `version` served that carry routes, oldest first. Rewarded or
    not, pinned or not: any completion vLLM produced has its logprobs and routes. A record of
    another model (token ids beyond `vocab_size`: a database or broker shared with another base)
    is passed over."""
    if limit < 1:
        return []
    c, ch = db.completions, db.completion_choices
    q = (
        select(c.c.completion_id, ch.c.choice_index, c.c.prompt_token_ids, ch.c.token_ids, ch.c.logprobs, ch.c.routing)
        .select_from(c.join(ch, ch.c.completion_id == c.c.completion_id))
        .where(c.c.model_version == version)
        .order_by(c.c.id.desc(), ch.c.choice_index)
    )
    samples = []
    with engine.connect() as conn:
        # a JSON column stores an absent trace as JSON null, which SQL cannot test portably: read
        # newest first, in pages, until enough carry one
        for row in conn.execution_options(yield_per=256).execute(q):
            if not (row.routing and row.token_ids and row.logprobs and len(row.logprobs) >= len(row.token_ids)):
                continue
            s = Sample(
                0,
                row.completion_id,
                row.choice_index,
                version,
                list(row.prompt_token_ids),
                list(row.token_ids),
                [float(x) for x in row.logprobs],
                0.0,
                None,
                row.routing,
            )
            if in_vocabulary(s, vocab_size):
                samples.append(s)
                if len(samples) == limit:
                    break
    return samples[::-1]


def by_length(samples: Sequence[Sample]) -> list[Sample]:
    """`samples` shortest first, so a batch of neighbours pads little: prompts run from a few dozen
    tokens to the window."""
    return sorted(samples, key=lambda s: len(s.prompt_ids) + len(s.token_ids))


def served_mismatch(
    model: Transformer,
    args: ModelArgs,
    fmt: ModelFormat,
    samples: Sequence[Sample],
    *,
    version: int,
    batch_size: int = 16,
    progress: Callable[[int], None] | None = None,
    fp4: WeightHook | None = None,
) -> ServedMismatch | None:
    """The mismatch of `model` (a version's served weights: learner.train.learn.model_from_packed)
    on `samples` it served, with and without their routes replayed; None without a completion token.
    `fp4` is the learner's FP4 hook, for a model of master weights quantized at use as `rl_update`
    trains them (`flywheel bench routes`); served weights are FP4 already and need none."""
    replay, own, tokens = [], [], []  # per completion: summed k3, its tokens
    differ, routed = 0, 0
    samples = by_length(samples)
    model.eval()
    with torch.no_grad():
        for i in range(0, len(samples), batch_size):
            batch = make_batch(samples[i : i + batch_size], args, fmt)
            x = batch.input_BS
            logits, own_routing = model(x, return_routing=True, fp4=fp4)
            if batch.routing is None:
                replayed = logits
            else:
                routing = [torch.where(r < 0, o, r) for r, o in zip(batch.routing, own_routing, strict=True)]
                replayed = model(x, routing=routing, fp4=fp4)
                for r, o in zip(batch.routing, own_routing, strict=True):
                    known = (r >= 0).all(-1)
                    differ += int(((r.sort(-1).values != o.sort(-1).values).any(-1) & known).sum())
                    routed += int(known.sum())
            own += _k3_rows(token_logprobs(logits, batch), batch)
            replay += _k3_rows(token_logprobs(replayed, batch), batch)
            tokens += batch.mask_BT.sum(1).tolist()
            if progress is not None:
                progress(min(i + batch_size, len(samples)))
    n = sum(tokens)
    if not n:
        return None
    return ServedMismatch(
        version,
        len(samples),
        int(n),
        sum(replay) / n,
        sum(own) / n,
        differ / routed if routed else 0.0,
        ratio_interval(np.array(replay), np.array(own)) if differ else None,
    )


def _k3_rows(logp_BT: torch.Tensor, batch) -> list[float]:
    """learner.train.learn.k3_BT summed over each row's completion tokens."""
    return k3_BT(logp_BT, batch.behaviour_BT, batch.mask_BT).sum(1).tolist()


def ratio_interval(
    replay: np.ndarray, own: np.ndarray, *, resamples: int = RESAMPLES, seed: int = 0
) -> tuple[float, float] | None:
    """The 95% percentile-bootstrap interval of sum(replay) / sum(own), resampling completions;
    None for fewer than two completions, or where a resample has no mismatch to divide by."""
    if len(own) < 2:
        return None
    idx = np.random.default_rng(seed).integers(0, len(own), size=(resamples, len(own)))
    r, o = replay[idx].sum(1), own[idx].sum(1)
    if (o <= 0).any():
        return None
    lo, hi = np.percentile(r / o, [2.5, 97.5])
    return float(lo), float(hi)
