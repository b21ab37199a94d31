"""Whether a suggestion is shown: the confidence gate (`model.min_confidence`).

An editor suggestion the user dismisses costs them a look, and the sink scores it -0.25; one
they accept scores up to +0.75. So a suggestion the model is unsure of is better not shown.
The gate reads the probability the model gave the suggestion's first token (its raw logprob,
before temperature, as the engine returns it with every token) and withholds the suggestion
below `min_confidence`: the editor gets an empty completion and shows nothing.

The default, 0.25, is where a full accept (+0.75) pays for a dismissal (-0.25) if the first
token's probability were the chance of an accept. It is not that chance (a suggestion needs more
than its first token right), but accept rate rises with it: README, "The confidence gate", has
the measured trade-off of suggestion rate, accept rate and accepted characters per request.

A version may carry a show policy learned from users' accepts (learner/show.py); it withholds
more of what the gate would show, never less.

Serving (serving/replica.py) and the held-out replay (learner/eval.py) both call `withheld`, so
`flywheel eval` scores what editors are shown. A withheld choice is recorded with its tokens and
`finish_reason: "withheld"`; the sink gives it the outcome `withheld` (feedback/reward.py), which
the learner does not train on: the user never saw it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from learner.show import ShowPolicy

MIN_CONFIDENCE = 0.25
"""`model.min_confidence`'s default (learner/base_settings.py)."""


def withheld(
    logprobs: Sequence[float],
    min_confidence: float,
    text: str = "",
    policy: ShowPolicy | None = None,
    line: str = "",
) -> bool:
    """Whether a suggestion whose tokens have these logprobs is withheld (not shown): its first
    token's probability is below `min_confidence`, or the version's show `policy` does not show
    `text` (the suggestion as served) after `line`, the line before the cursor
    (learner.show.cursor_line). An empty suggestion has nothing to withhold."""
    if not logprobs:
        return False
    if min_confidence > 0 and math.exp(logprobs[0]) < min_confidence:
        return True
    return policy is not None and bool(text) and not policy.shows(logprobs, text, line)
