"""`[pretrain]`: the typed config of `flywheel pretrain` (and of the base model the demo reuses).

Light on purpose (no torch), so the CLI can parse and validate it before importing anything heavy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Self

from pydantic import Field, field_validator, model_validator

from feedback.core.config import FlywheelSettings, Section
from learner.base_settings import ModelSection
from learner.sizes import SIZES

# Fields that change how long or how visibly a run goes, not which model it makes: they stay
# out of the cache key, so `--minutes 30` continues a 20-minute base instead of starting over.
# The precision changes speed and rounding, not the recipe: a base is valid on any machine.
NOT_IN_CACHE_KEY = frozenset(
    {
        "corpus",
        "steps",
        "minutes",
        "threads",
        "device",
        "precision",
        "eval_every",
        "eval_windows",
        "final_eval_windows",
        "checkpoint_minutes",
        "quality_check",
        "min_steps",
        "continue_lr",  # continuing an imported model only
    }
)

# Fields added to the recipe later, with the value that trains as before they existed: at that
# value they stay out of the cache key, so the bases trained before them stay valid.
KEYED_UNLESS = {"fim_middle_weight": 1.0}


class PretrainSection(Section):
    corpus: Path | None = None
    """Folder of source files to train on. Empty: the running Python's standard library
    (its *.py files minus tests). The cache key uses the files' contents, not this path."""
    size: str = "small"
    """Named model size from learner.sizes.SIZES: `tiny` (tests), `small` (the demo)
    or `medium` (for more minutes than the demo has: README, "The base model")."""
    vocab_size: int = Field(default=4096, ge=264, le=65536)
    """BPE vocabulary size (256 bytes + 8 special tokens at least); also the model's vocabulary."""
    seq_len: int = Field(default=2048, ge=16, le=8192)
    """Training sequence length in tokens; also the exported model's max_position_embeddings, so
    the served window. 2048 holds most of a source file around the cursor (serving's default
    prompt budget is three quarters of it); on 2 CPU cores a step of 2 x 2048 tokens costs about
    what 16 x 256 did, since the output layer and the experts, not attention, dominate at this size."""
    batch_size: int = Field(default=2, ge=1)
    """Sequences of seq_len per optimizer step (2 x 2048 = 4096 tokens)."""
    short_seq_len: int = Field(default=256, ge=16)
    """Short to long: until the last `long_fraction` of the budget, rows are this long, as many per
    step as keep the step's tokens (batch_size x seq_len); then seq_len rows teach the whole window.
    Two 2048-token rows a step are a few files' worth of gradient, noisier than sixteen 256-token
    ones from as many places: measured, 318 such steps ended below the bigram baseline. At least
    seq_len: one phase."""
    long_fraction: float = Field(default=0.25, ge=0, le=1)
    """The last part of the budget (by steps or minutes) trained on seq_len rows."""
    minutes: float = Field(default=26.0, gt=0)
    """Training time budget in minutes, summed over resumed runs; the learning-rate schedule
    follows it when `steps` is not set. Tokenizer, final evaluation and export come on top."""
    steps: int | None = Field(default=None, ge=1)
    """Train exactly this many optimizer steps (the schedule follows steps); `minutes` still caps the run."""
    lr: float = Field(default=3e-3, gt=0, le=1)
    """Peak AdamW learning rate, reached after warmup, then cosine decay to lr * min_lr_ratio."""
    continue_lr: float = Field(default=1e-5, gt=0, le=1)
    """Peak learning rate when continuing an imported model's pretraining (`flywheel pretrain --base`):
    far below training from scratch, so the model keeps what it knows."""
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1)
    """Final learning rate as a fraction of `lr`."""
    warmup_steps: int = Field(default=50, ge=0)
    """Linear warmup, in steps."""
    weight_decay: float = Field(default=0.1, ge=0)
    """AdamW weight decay on the matrices (not on the norms)."""
    grad_clip: float = Field(default=1.0, gt=0)
    """Gradient-norm clipping threshold."""
    fp4: Literal["nvfp4", "mxfp4", "off"] = "nvfp4"
    """Quantization-aware training format for the FP4 targets (expert weights); `off` trains in bf16 only."""
    router_replay: bool = True
    """Route with a no-grad high-precision forward and replay that routing in the FP4 forward."""
    balance_coef: float = Field(default=0.01, ge=0)
    """Weight of the MoE load-balancing loss (1.0 when balanced), which keeps every expert in use."""
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    """Matmul precision (bf16 autocast or fp32); master weights and optimizer state are always fp32.
    `auto`: bf16 only where this machine's bf16 matmul is not slower than its fp32 one
    (feedback/core/precision.py measures both at start)."""
    fim_rate: float = Field(default=0.5, ge=0, le=1)
    """Fraction of training rows that are fill-in-the-middle examples."""
    fim_middle_weight: float = Field(default=1.0, ge=1.0, le=100.0)
    """Loss weight of a FIM example's middle and the end-of-text after it, against 1 for every
    other token of the row. The middle is what serving asks the model to write, and only a few
    percent of a FIM row's tokens."""
    fim_template: Literal["qwen-spm", "qwen"] = "qwen-spm"
    """The FIM layout the base is trained in, and which its exported tokenizer_config.json names
    (learner/formats.py): `qwen-spm` puts the suffix first, so the middle continues the prefix;
    `qwen` is Qwen's prefix-suffix-middle order (recipes before 5)."""
    context_rate: float = Field(default=0.3, ge=0, le=1)
    """Fraction of FIM examples that carry other files of the same folder before the file's header,
    laid out as serving lays out an editor's repository context (Tabby's snippets, llama.cpp's
    `input_extra`), so the model learns to read them."""
    summary_rate: float = Field(default=0.15, ge=0, le=1)
    """Fraction of training rows that are self-summarization examples (Python files)."""
    heldout_fraction: float = Field(default=0.05, gt=0, lt=0.5)
    """Fraction of files (chosen by a hash of their path) held out for evaluation."""
    max_file_kb: int = Field(default=256, ge=1)
    """Skip source files larger than this (generated tables, data dumps)."""
    eval_every: int = Field(default=250, ge=1)
    """Evaluate on held-out data every this many steps (and at the end)."""
    eval_windows: int = Field(default=8, ge=1)
    """Held-out windows of seq_len tokens for the periodic evaluation."""
    final_eval_windows: int = Field(default=32, ge=1)
    """Held-out windows for the final evaluation (and the bigram baseline)."""
    checkpoint_minutes: float = Field(default=2.0, ge=0)
    """Save a resumable checkpoint at least this often; 0 saves after every step."""
    quality_check: bool = True
    """Refuse a base that ends no better than its bigram baseline or with fewer than `min_steps`
    steps (a one-line error, also when a cached one is reused). Off only for throwaway test models."""
    min_steps: int = Field(default=200, ge=1)
    """Fewest optimizer steps for a base to count as trained (with `quality_check`)."""
    seed: int = 0
    """Seeds the weights and the data order; a rerun with the same settings gives the same rows."""
    threads: int = Field(default=2, ge=1)
    """torch.set_num_threads; the 30-minute budget of `small` is sized for 2 cores."""
    device: str = "cpu"
    """torch device for training (`cpu`, `cuda`)."""

    @field_validator("size")
    @classmethod
    def _known_size(cls, v: str) -> str:
        if v not in SIZES:
            raise ValueError(f"unknown size {v!r}; choose one of {sorted(SIZES)}")
        return v

    @model_validator(mode="after")
    def _rates(self) -> Self:
        if self.fim_rate + self.summary_rate > 1:
            raise ValueError("fim_rate + summary_rate must be at most 1")
        return self

    def cache_key_fields(self) -> dict:
        fields = self.model_dump(mode="json", exclude=set(NOT_IN_CACHE_KEY))
        return {k: v for k, v in fields.items() if KEYED_UNLESS.get(k, object()) != v}


class PretrainSettings(FlywheelSettings):
    """`flywheel pretrain` and `flywheel bench fp4`: the shared settings plus `[pretrain]`."""

    pretrain: PretrainSection = PretrainSection()
    model: ModelSection = ModelSection()
