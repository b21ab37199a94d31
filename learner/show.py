"""The show policy: whether a suggestion is shown, learned from what users accepted.

The confidence gate (learner/confidence.py) withholds a suggestion whose first token the model
gave less than `model.min_confidence`. That is a fixed rule on one number. The sink's rewards
(+0.75 accepted, -0.25 dismissed, 0 not shown) say what the rule stands in for: show a
suggestion when the chance that it is accepted is at least 0.25 / (0.75 + 0.25) = 25%.

The show policy estimates that chance from what users did. The learner fits a logistic
regression of "accepted" on features of the suggestions users were shown (the logprobs the
serving engine returned with every token, the suggestion's length, and how it meets the line
before the cursor: `CONTEXT_FEATURES`), on the feedback of its
recent samples, and publishes it with each version, in the version's manifest (about a
kilobyte; learner/store.py). Serving withholds a suggestion the gate would show when the policy puts
its chance of an accept below the policy's threshold, and `flywheel eval` replays a version with
its policy, so the held-out accept rate measures what editors of that version are shown.

The threshold is the reward's break-even (`learn.show.threshold`, 25%) or lower: the policy
withholds at most `learn.show.max_withheld` (30%) of what the gate showed (the suggestions it
was fitted on, and those the last policy withheld). At the break-even alone the policy maximizes
the reward, and on this project's base it withheld three in five of the suggestions the gate
showed, a fifth of the accepted characters with them (README, "Learning when to show"): users
would feel fewer completions rather than better ones. Cursor reports
21% fewer suggestions for its +28% accept rate on Tab; the bound keeps Flywheel's policy near
that trade-off, and removes the suggestions it is surest users dismiss. A second bound,
`learn.show.max_accepts_withheld` (5%), lowers the threshold until the policy withholds at most
that share of the accepted suggestions it was fitted on: what users feel of a withheld
suggestion is the one they would have taken. On the logprobs alone that bound leaves little to
withhold (accepted and dismissed suggestions overlap); with the cursor's context it withholds
about a quarter of what the gate showed (README, "Show policies side by side").

Learning when to abstain is part of what online RL learns on Tab; the weights learn it slowly
(README, "Learning with the confidence gate on"), the policy from a few hundred outcomes.

Only suggestions users saw have outcomes, so the policy is fitted on those the gate showed,
and it only ever withholds more: a suggestion below `model.min_confidence` stays withheld.
What the policy withholds has no outcome either, so serving shows a small share of it anyway
(`learn.show.explore`, picked by the completion id): without those, each fit would know less of
what the last one hid, and a policy that withheld too much could never learn it had.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

LOGPROB_FEATURES = ("first_logprob", "mean_logprob", "min_logprob", "log_tokens", "log_chars")
"""What the policy reads of a suggestion; every one is known when the engine finishes it."""

CONTEXT_FEATURES = (
    "line_ends_in_word",
    "line_ends_in_space",
    "line_ends_in_open_bracket",
    "line_ends_in_dot",
    "line_ends_in_operator",
    "log_line_chars",
    "line_indent",
    "text_starts_with_space",
    "text_starts_with_word",
    "text_ends_a_clause",
)
"""What it reads of where the suggestion goes: the line before the cursor (`cursor_line`), how
it ends (a word character, a space, one of `( [ {`, a dot, one of `= , :`), its length (log
characters after its indent) and indent (in 4s), and how the suggestion meets it (starts with a
space, with a word character; ends with one of `: ) ] }`). A suggestion that starts a new word
right after a space is where the model guesses; one that finishes a word or a call it began is
where it knows. Fitted on the same 575 outcomes and bounded as `learn.show` bounds it, the
logprobs alone raised the held-out accept rate of what is shown to 1.09x the gate's alone, these
with them to 1.37x, and neither withheld an accepted suggestion (`flywheel bench show`; README,
"Show policies side by side")."""

FEATURES = LOGPROB_FEATURES + CONTEXT_FEATURES
"""Every feature `features` computes, in its order; a policy reads the ones it names."""

MAX_LINE = 128
"""Characters of the cursor's line the context features read: the last ones, up to the cursor."""

SHOWN = frozenset({"select", "edit", "dismiss", "ignored"})
"""feedback.reward outcomes of a suggestion the user saw: the ones the policy learns from."""

_WORD = re.compile(r"\w")


def cursor_line(prefix: str) -> str:
    """The line before the cursor: what `prefix` has after its last newline, at most MAX_LINE
    characters of it. Serving reads it from the request, the learner from the prompt's token ids
    (learner.fim.prefix_tail)."""
    return prefix[prefix.rfind("\n") + 1 :][-MAX_LINE:]


def features(logprobs: Sequence[float], text: str, line: str = "") -> list[float]:
    """FEATURES of a suggestion with these token logprobs (raw, as the engine returns them) and
    text, at a cursor after `line` (`cursor_line`; "" at the start of a line)."""
    if not logprobs:
        raise ValueError("a suggestion without tokens has no features")
    n = len(logprobs)
    line = line[-MAX_LINE:]
    last = line[-1:]
    body = line.lstrip()
    end = text.rstrip()[-1:]
    return [
        float(logprobs[0]),
        float(sum(logprobs)) / n,
        float(min(logprobs)),
        math.log1p(n),
        math.log1p(len(text.strip())),
        float(bool(_WORD.match(last))),
        float(last == " "),
        float(last != "" and last in "([{"),
        float(last == "."),
        float(last != "" and last in "=,:"),
        math.log1p(len(body.rstrip())),
        (len(line) - len(body)) / 4.0,
        float(text[:1] == " "),
        float(bool(_WORD.match(text[:1]))),
        float(end != "" and end in ":)]}"),
    ]


def accepted(outcome: str | None, reward: float) -> bool:
    """The label: the user kept some of the suggestion (a select, or an edit that kept text)."""
    return outcome in ("select", "edit") and reward > 0


@dataclass(frozen=True)
class ShowPolicy:
    """A fitted logistic regression over its standardized `features` (names of FEATURES), and the
    chance it must reach."""

    mean: tuple[float, ...]
    scale: tuple[float, ...]
    weights: tuple[float, ...]
    bias: float
    threshold: float  # show when the estimated chance of an accept is at least this
    samples: int  # shown suggestions it was fitted on
    accepts: int  # of them, accepted
    explore: float = 0.0  # share of what it withholds that serving shows anyway (`explores`)
    features: tuple[str, ...] = FEATURES

    def p_accept(self, logprobs: Sequence[float], text: str, line: str = "") -> float:
        """The chance that a suggestion is accepted, at a cursor after `line` (`cursor_line`)."""
        every = features(logprobs, text, line)
        x = [every[FEATURES.index(name)] for name in self.features]
        z = self.bias + sum(w * (v - m) / s for w, v, m, s in zip(self.weights, x, self.mean, self.scale, strict=True))
        return 1.0 / (1.0 + math.exp(-max(-60.0, min(60.0, z))))

    def shows(self, logprobs: Sequence[float], text: str, line: str = "") -> bool:
        """Whether a suggestion is shown; an empty one has nothing to withhold."""
        return not logprobs or not text or self.p_accept(logprobs, text, line) >= self.threshold

    def explores(self, key: str) -> bool:
        """Whether serving shows the suggestion of completion `key` although the policy withholds
        it: a deterministic pick of `explore` of all keys, so every chunk of a stream agrees."""
        if self.explore <= 0:
            return False
        u = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2**64
        return u < self.explore

    def as_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, d: Mapping) -> ShowPolicy:
        """The policy a manifest holds; ValueError if it is not one this code can apply. A policy
        names its features, so one fitted on LOGPROB_FEATURES alone (as before CONTEXT_FEATURES
        were added) applies as it was fitted."""
        try:
            names = tuple(d["features"])
            unknown = [x for x in names if x not in FEATURES]
            if unknown or not names or len(set(names)) != len(names):
                raise ValueError(
                    f"its features {list(names)} are not distinct ones of this version of Flywheel's {list(FEATURES)}"
                )
            policy = cls(
                mean=tuple(float(x) for x in d["mean"]),
                scale=tuple(float(x) for x in d["scale"]),
                weights=tuple(float(x) for x in d["weights"]),
                bias=float(d["bias"]),
                threshold=float(d["threshold"]),
                samples=int(d["samples"]),
                accepts=int(d["accepts"]),
                explore=float(d.get("explore", 0.0)),
                features=names,
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"not a show policy ({type(e).__name__}: {e})") from None
        n = len(names)
        if not (len(policy.mean) == len(policy.scale) == len(policy.weights) == n):
            raise ValueError(f"a show policy needs a mean, scale and weight for each of its {n} features")
        if any(not math.isfinite(x) for x in (*policy.mean, *policy.weights, policy.bias)) or any(
            not (math.isfinite(s) and s > 0) for s in policy.scale
        ):
            raise ValueError("a show policy's numbers must be finite, its scales positive")
        if not (0 < policy.threshold < 1 and 0 <= policy.explore <= 1):
            raise ValueError("a show policy's threshold must lie in (0, 1) and its explore share in [0, 1]")
        return policy


def fit(
    rows: Sequence[Sequence[float]],
    *,
    threshold: float,
    l2: float,
    min_samples: int,
    min_each: int,
    max_withheld: float | None = None,
    withheld: Sequence[Sequence[float]] = (),
    explore: float = 0.0,
    names: Sequence[str] = FEATURES,
    max_accepts_withheld: float | None = None,
) -> ShowPolicy | None:
    """The policy on the features `names` (of FEATURES) fitted on `rows` (every one of FEATURES,
    in its order, then the label, 1.0 accepted), or None when there
    are fewer than `min_samples` rows or fewer than `min_each` accepted or not accepted ones
    (the fit would be noise). `l2`: the penalty on the standardized weights (not the bias).
    The policy's threshold is `threshold`, or with `max_withheld` lower where that would withhold
    more than that share of what the gate showed: `rows` and `withheld`, the features of the
    suggestions the last policy withheld (no outcome, so not in `rows`); then the highest that
    withholds at most `max_withheld` of them. Without `withheld` each policy's share would be
    of what the last one left, and the shares would compound. With `max_accepts_withheld` the
    threshold is also at most the highest that withholds no more than that share of the accepted
    suggestions in `rows` (what users would have taken), each scored out of fold. `explore`:
    the policy's."""
    import torch  # here, so that settings (learn.show.features) read FEATURES without it

    if len(rows) < min_samples:
        return None
    data = torch.tensor([list(r) for r in rows], dtype=torch.float64)
    if data.shape[1] != len(FEATURES) + 1:
        raise ValueError(f"rows need {len(FEATURES)} features and a label, got {data.shape[1]} columns")
    names = tuple(names)
    if not names or any(n not in FEATURES for n in names):
        raise ValueError(f"a show policy reads some of {list(FEATURES)}, not {list(names)}")
    columns = [FEATURES.index(n) for n in names]
    x, y = data[:, columns], data[:, -1]
    accepts = int(y.sum().item())
    if min(accepts, len(rows) - accepts) < min_each:
        return None
    mean, scale = x.mean(0), x.std(0, correction=0).clamp_min(1e-6)
    xs = (x - mean) / scale
    w = _logistic(xs, y, l2)
    if max_withheld is not None:  # p[k] withholds the k suggestions below it (ties aside), k <= max_withheld * n
        hidden = torch.tensor([list(r) for r in withheld], dtype=torch.float64).reshape(-1, len(FEATURES))
        shown = torch.cat([x, hidden[:, columns]])
        p = torch.sigmoid((shown - mean) / scale @ w[:-1] + w[-1]).sort().values
        threshold = min(threshold, float(p[min(len(p) - 1, int(max_withheld * len(p)))]))
    if max_accepts_withheld is not None:
        # The same over the accepted rows, each scored by a fit without it (FOLDS-fold): scored by
        # the fit that saw them, accepts look surer than the next ones will, and a threshold from
        # them withholds more of what users would take. Equal rows (one suggestion at one cursor,
        # requested again) share a fold, or the fit would have seen the row it scores.
        fold = torch.tensor([hash(tuple(r)) % FOLDS for r in x.tolist()])
        oof = torch.empty(len(rows), dtype=torch.float64)
        for k in range(FOLDS):
            wk = _logistic(xs[fold != k], y[fold != k], l2) if (fold != k).any() else w
            oof[fold == k] = torch.sigmoid(xs[fold == k] @ wk[:-1] + wk[-1])
        p = oof[y == 1].sort().values
        threshold = min(threshold, float(p[min(len(p) - 1, int(max_accepts_withheld * len(p)))]))
    return ShowPolicy(
        mean=tuple(mean.tolist()),
        scale=tuple(scale.tolist()),
        weights=tuple(w[:-1].tolist()),
        bias=float(w[-1]),
        threshold=threshold,
        samples=len(rows),
        accepts=accepts,
        explore=explore,
        features=names,
    )


FOLDS = 5
"""Folds of the out-of-fold scores `max_accepts_withheld` is taken over."""


def _logistic(xs: torch.Tensor, y: torch.Tensor, l2: float) -> torch.Tensor:
    """Weights then bias of the L2-penalized logistic regression of `y` on `xs` (standardized)."""
    import torch

    w = torch.zeros(xs.shape[1] + 1, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w], max_iter=200, tolerance_grad=1e-9, line_search_fn="strong_wolfe")

    def loss() -> torch.Tensor:
        opt.zero_grad()
        value = torch.nn.functional.binary_cross_entropy_with_logits(xs @ w[:-1] + w[-1], y) + l2 * (w[:-1] ** 2).sum()
        value.backward()
        return value

    opt.step(loss)
    return w.detach()
