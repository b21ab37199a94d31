"""`[eval]`: the typed config of `flywheel eval` (learner/train/evaluate.py).

Light on purpose (no torch), so the CLI can parse and validate it before importing anything heavy.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from feedback.core.config import Section
from learner.train.pretrain_settings import PretrainSettings


class EvalSection(Section):
    """The held-out evaluation: simulated editor sites replayed through serving's prompt format
    and judged as the simulated editor does (learner/eval.py)."""

    sites: int = Field(default=500, ge=1)
    """Held-out cursor sites replayed. At 500 an accept rate near 20% is known to about ±3.5
    points (the 95% interval's half width); the interval narrows as 1/sqrt(sites)."""
    seed: int = 0
    """Picks the sites: the same seed and corpus give the same sites, so two models compare on them."""
    cursor: Literal["end_of_line", "in_brackets"] = "end_of_line"
    """Where each site's cursor is. `end_of_line`: after code on its line, nothing to its right
    (the suffix starts at the newline; the truth is the rest of the line). `in_brackets`: inside
    the bracket pair that closes its line, as an editor that auto-closes brackets leaves it (the
    suffix starts with the closing bracket; the truth is what goes between): the sites where the
    suffix says where a suggestion ends, so `compare_prefix` there shows whether the model uses it."""
    max_tokens: int = Field(default=32, ge=1)
    """Longest suggestion decoded per site (greedy), as the gate's learn.gate.max_tokens."""
    token_accuracy: bool = True
    """Also score each site's rest of the line teacher-forced (the share of its tokens the model
    predicts): finer-grained than accept rate for a weak model, at one more forward per site."""
    compare_prefix: bool = False
    """Also replay the same sites prompted with the prefix alone (no FIM template, no suffix), and
    report both: whether the fill-in-the-middle prompt helps the model or hurts it."""
    gate_curve: list[float] = []
    """Also report the confidence gate's trade-off at these thresholds (model.min_confidence
    values, each in [0, 1)): suggestion rate, accept rate and accepted characters per request at
    each, from the same replay (the gate only hides suggestions, so one replay gives them all)."""
    threads: int = Field(default=1, ge=1)
    """torch CPU threads while replaying: one token at a time is too little work to split."""
    served_mismatch: int = Field(default=0, ge=0)
    """With a store version (`--model vN`), also measure its train-inference mismatch on the
    newest this-many completions it served (from the database): the learner's forward of its
    served weights against vLLM's logprobs, with serving's routes replayed and without
    (learner/train/mismatch.py). 0: not measured."""

    @field_validator("gate_curve")
    @classmethod
    def _thresholds(cls, v: list[float]) -> list[float]:
        if any(not 0 <= x < 1 for x in v):
            raise ValueError(f"gate_curve: each threshold must be in [0, 1), got {v}")
        return sorted(set(v))


class EvalSettings(PretrainSettings):
    """`flywheel eval`: the shared settings, [pretrain] (which base model, which corpus and its
    held-out split) and [eval]."""

    eval: EvalSection = EvalSection()
