"""`flywheel learn` configuration: the `[learn]` section (see learner/train/learn.py)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal, Self

from pydantic import Field, field_validator, model_validator

from feedback.core.config import Seconds, Section
from learner.train.pretrain_settings import PretrainSettings


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


class GateSection(GateThresholds):
    """The gate before publish: held-out replay against the stable version (learner/eval.py),
    and the reward-hacking checks (learner/train/gate.py; the thresholds) that block a publish."""

    sites: int = Field(default=48, ge=1)
    """Held-out cursor positions replayed for the candidate and for stable (same sites, fixed seed)."""
    max_tokens: int = Field(default=32, ge=1)
    """Longest suggestion the replay decodes (greedy)."""
    seed: int = 1234
    """Picks the held-out sites; fixed so every gate compares on the same ones."""


class ShowSection(Section):
    """The show policy (section `[learn.show]`; learner/show.py): when a suggestion is shown,
    learned from the outcomes of the suggestions users saw, published with each version."""

    enabled: bool = True
    """Fit a show policy and publish it with each version; off: versions carry none, and only
    the confidence gate (model.min_confidence) decides what is shown."""
    threshold: float = Field(default=0.25, gt=0, lt=1)
    """Show a suggestion when its estimated chance of an accept is at least this (or the lower
    threshold `max_withheld` sets). 0.25 is where the sink's default rewards (+0.75 accepted,
    -0.25 dismissed or ignored, 0 not shown) make showing worth it; with other `[sink.reward]`
    weights, -dismissed / (accepted - dismissed)."""
    max_withheld: float | None = Field(default=0.3, ge=0, lt=1)
    """Lower the threshold as far as needed for the policy to withhold at most this share of the
    suggestions it is fitted on (the gate showed them); empty: the threshold alone (the reward's
    optimum, which withholds more of what users would have taken)."""
    max_accepts_withheld: float | None = Field(default=0.05, ge=0, lt=1)
    """Lower the threshold, too, as far as needed to withhold at most this share of the accepted
    suggestions it is fitted on: a withheld suggestion users would have taken is what they feel,
    as fewer accepted characters. Empty: no such bound."""
    explore: float = Field(default=0.05, ge=0, le=1)
    """Share of the suggestions the policy withholds that serving shows anyway, so that the next
    fit learns how those fare too (the gate's own withholdings are not explored)."""
    window: int = Field(default=4096, ge=1)
    """The newest outcomes of shown suggestions the policy is fitted on."""
    min_samples: int = Field(default=64, ge=1)
    """Fewest outcomes to fit on; below them a version keeps the last good version's policy."""
    min_each: int = Field(default=8, ge=1)
    """Fewest accepted, and fewest not accepted, among them."""
    l2: float = Field(default=0.1, ge=0)
    """Penalty on the policy's (standardized) weights, which keeps a fit on few outcomes tame.
    Chosen on training sites alone (fitted on 125 to 375 outcomes of the base's suggestions at
    1,000 sites, judged at 500 others): against 0.01, 0.1 gave the same accept rate of what is
    shown and withheld fewer accepted characters (-0.020 against -0.044 per request at 250
    outcomes, -0.004 against -0.008 at 375)."""
    features: list[str] = Field(default_factory=lambda: list(_show_features()), min_length=1)
    """What the policy reads (learner.show.FEATURES): the suggestion's logprobs and length, and
    how it meets the line before the cursor. The five of `learner.show.LOGPROB_FEATURES` alone
    are the policy before the context features (README, "The show policy", compares the two)."""

    @field_validator("features")
    @classmethod
    def _known_features(cls, v: list[str]) -> list[str]:
        known = _show_features()
        unknown = [x for x in v if x not in known]
        if unknown or len(set(v)) != len(v):
            raise ValueError(f"show features must be distinct ones of {list(known)}; got {v}")
        return v

    def fit(self, rows, withheld=()):
        """learner.show.fit on these outcomes (`rows`) and the features of what the last policy
        `withheld`, with these settings: the policy, or None when there are too few outcomes."""
        from learner import show

        return show.fit(
            rows,
            threshold=self.threshold,
            l2=self.l2,
            min_samples=self.min_samples,
            min_each=self.min_each,
            max_withheld=self.max_withheld,
            withheld=withheld,
            explore=self.explore,
            names=self.features,
            max_accepts_withheld=self.max_accepts_withheld,
        )


def _show_features() -> tuple[str, ...]:
    from learner.show import FEATURES

    return FEATURES


class LearnSection(Section):
    """The RL learner: feedback in, model versions out."""

    publish_every: Seconds = Field(default=3 * 3600.0, gt=0)
    """Publish a version this often ("3h", "90s", "1h30m" or seconds), once `min_samples` were trained."""
    min_samples: int = Field(default=256, ge=1)
    """Samples trained since the last version before the next may be published."""
    batch_size: int = Field(default=16, ge=1)
    """Samples per update."""
    lr: float = Field(default=1e-6, gt=0)
    """AdamW learning rate."""
    weight_decay: float = Field(default=0.0, ge=0)
    train_weights: list[str] | None = Field(default=None, min_length=1)
    """Which weights the updates change: regular expressions (re.search) over the checkpoint's
    weight names; the others stay the base's, so they add nothing to a published delta. Unset
    (the default): the routed experts of a mixture-of-experts model (`['\\.mlp\\.experts\\.']`,
    the FP4 tensors), every weight of a dense one (`['.*']`). With the routers: `['\\.mlp\\.']`.
    A pattern that matches no weight of the model stops the learner with an error."""
    grad_clip: float = Field(default=1.0, gt=0)
    max_staleness: int = Field(default=2, ge=0)
    """Drop samples whose behaviour version lags the learner's latest version by more than this."""
    buffer_capacity: int = Field(default=4096, ge=1)
    """Samples the replay buffer holds; beyond that the oldest are dropped (and counted)."""
    max_samples_per_user: int = Field(default=32, ge=1)
    """Most samples one user (`user_hash`) contributes toward each version; later ones are dropped and
    counted (`capped`), so one editor client posting accepts for its own completions cannot supply a
    version's rewards. Samples of requests that pinned their version (`model: flywheel@vN`) never train."""
    outcomes: list[str] = ["select", "edit", "dismiss", "ignored", "no_suggestion"]
    """Reward outcomes that train (feedback/reward.py); `unseen` and `withheld` suggestions (never
    shown) carry no signal."""
    importance: Literal["ppo_clip", "tis"] = "ppo_clip"
    """Off-policy correction: PPO-style clipped ratio, or truncated importance sampling."""
    clip_eps: float = Field(default=0.2, gt=0, lt=1)
    tis_cap: float = Field(default=2.0, gt=1)
    kl_coef: float = Field(default=0.05, ge=0)
    """Weight of the KL penalty to the reference (base) model."""
    router_replay: bool = True
    """Replay routing in the FP4 forward: the serving engine's when recorded, else a high-precision forward's."""
    poll_s: float = Field(default=2.0, gt=0)
    """How often to look for new rewarded samples when idle."""
    db_retry_s: float = Field(default=2.0, gt=0)
    """While the database is unavailable (restarting, unreachable), how long the learner waits before
    it tries again; its state is kept, and a version it stored but could not record is recorded then."""
    checkpoint_dir: Path | None = None
    """Learner state (weights, optimizer, step, cursor, buffer). Empty: <data_dir>/learner."""
    full_every: int = Field(default=8, ge=1)
    """A full snapshot every N versions; deltas in between."""
    zstd_level: int = Field(default=3, ge=1, le=22)
    zstd_threads: int = Field(default=-1, ge=-1)
    """zstd worker threads (-1: all cores, 0: single-threaded)."""
    keep_versions: int = Field(default=32, ge=1)
    """Newest versions the store keeps; also kept, however old: every version serving targets or serves,
    stable, the last good one, and what the delta chains of all of these need (learner/publish.py)."""
    workers: int = Field(default=1, ge=1)
    """Data-parallel training processes. 1: the learner trains in its own process (no Ray). N > 1: Ray
    Train runs N workers (torch.distributed: gloo on CPUs, NCCL on GPUs); each update's batch is split
    across them, the optimizer state is sharded, and checkpoints are sharded (torch.distributed.checkpoint)."""
    gpu: bool = False
    """With workers > 1: one GPU per worker (NCCL) instead of CPU workers (gloo)."""
    gate: GateSection = GateSection()
    show: ShowSection = ShowSection()

    @field_validator("train_weights")
    @classmethod
    def _regexes(cls, v: list[str] | None) -> list[str] | None:
        for pattern in v or ():
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"train_weights: {pattern!r} is not a regular expression ({e})") from None
        return v

    @model_validator(mode="after")
    def _batch_splits(self) -> Self:
        if self.workers > self.batch_size:
            raise ValueError(
                f"learn.workers ({self.workers}) must not exceed learn.batch_size ({self.batch_size}): "
                "each worker trains a share of every batch"
            )
        if self.gpu and self.workers == 1:
            raise ValueError("learn.gpu applies to data-parallel workers: set learn.workers > 1, or leave gpu off")
        return self


class LearnSettings(PretrainSettings):
    """`flywheel learn`: the learner; [pretrain] says which base model it starts from."""

    learn: LearnSection = LearnSection()

    @property
    def learner_dir(self) -> Path:
        return Path(self.learn.checkpoint_dir or self.data_dir / "learner").expanduser()
