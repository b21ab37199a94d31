"""`[model]`: which base model the learner, serving, pretraining and the demo start from.

Light on purpose (no torch): every process's settings take this section, and the CLI validates
it before importing anything heavy. Empty `base` keeps Flywheel's own pretrained model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from feedback.core.config import Section
from learner.confidence import MIN_CONFIDENCE


class ModelSection(Section):
    base: Path | None = None
    """A Hugging Face model folder (config.json, safetensors, tokenizer.json, generation_config.json)
    to start from instead of Flywheel's pretrained base. `flywheel base import` makes it version 0
    of the weight store; the learner does so on its first start if nobody has. Serving then serves
    the store's versions of it."""
    fim: str = Field(default="auto", pattern="^(auto|none|qwen|starcoder|deepseek|codestral|qwen-spm)$")
    """Fill-in-the-middle template (learner/formats.py). `auto`: the one the model folder's
    tokenizer_config.json names (`fim_template`, as Flywheel's own base does), else detected from
    the vocabulary; `none`: prefix-only completions, whatever tokens the model has."""
    fp4: Literal["nvfp4", "mxfp4", "off"] = "nvfp4"
    """FP4 format the import quantizes the FP4 targets to (and the learner trains them in)."""
    fp4_targets: list[str] | None = None
    """Regexes of the tensor names stored and trained in FP4. Empty: the experts of an MoE
    (learner/fp4.py DEFAULT_FP4_TARGETS), nothing in a dense model."""
    min_confidence: float = Field(default=MIN_CONFIDENCE, ge=0, lt=1)
    """Withhold an editor suggestion (answer an empty completion) when the model gave its first
    token a probability below this (learner/confidence.py). Serving applies it to completions at
    a cursor; `flywheel eval`, the learner's gate, `flywheel bench learn` and the demo's summary
    score with it. 0: show every suggestion."""
    memory_gib: float | None = Field(default=None, gt=0)
    """Memory the learner and the replicas may use on this machine, in GiB, for the import's
    check. Empty: this machine's physical memory."""
