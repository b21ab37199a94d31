"""The RL objective: a pure function from an inputs dataclass and the `[learn]` parameters
(`RLParams`: LearnSection itself in the learner) to `(loss, metrics)`.

Shapes: B completions, T completion tokens (right-padded; `mask_BT` marks real tokens,
including the final <|endoftext|>, which is the "stop here" action).

    advantage_B = reward_B - baseline             (baseline: the batch mean, or a running mean)
    ratio_BT    = exp(logp_BT - behaviour_BT)     (learner vs the serving policy that sampled)
    ppo_clip:  pg_BT = -min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A)
    tis:       pg_BT = -min(ratio, cap).detach() * A * logp_BT   (truncated importance sampling)
    kl_BT      = exp(ref - logp) - (ref - logp) - 1   (k3 estimator of KL(learner || reference))
    loss       = sum((pg + kl_coef * kl) * mask) / sum(mask)     (token-level mean)

An empty completion (just <|endoftext|>) is a legal action: its reward is 0, so when the
other suggestions in the batch are dismissed (negative rewards) abstaining gets a positive
advantage, and the model learns not to suggest where it would be dismissed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import torch


class RLParams(Protocol):
    """What the loss reads of its configuration: the `[learn]` keys of the same names
    (learner.train.learn_settings.LearnSection, where their defaults and bounds live)."""

    importance: Literal["ppo_clip", "tis"]
    clip_eps: float  # PPO clip range for the importance ratio
    tis_cap: float  # upper bound on the truncated importance weight
    kl_coef: float  # weight of the KL penalty to the reference (base) model


@dataclass
class RLInputs:
    logp_BT: torch.Tensor  # learner's logprobs of the sampled tokens (requires grad)
    behaviour_BT: torch.Tensor  # serving's logprobs of the same tokens, as recorded
    ref_BT: torch.Tensor  # reference model's logprobs of the same tokens
    reward_B: torch.Tensor
    mask_BT: torch.Tensor  # 1.0 for completion tokens, 0.0 for padding
    baseline: float | None = None  # None: the batch mean reward


def rl_loss(x: RLInputs, cfg: RLParams) -> tuple[torch.Tensor, dict[str, float]]:
    mask = x.mask_BT.to(x.logp_BT.dtype)
    n_tokens = mask.sum().clamp_min(1.0)
    baseline = x.reward_B.mean() if x.baseline is None else torch.tensor(x.baseline, dtype=x.reward_B.dtype)
    adv_B1 = (x.reward_B - baseline).unsqueeze(1).to(x.logp_BT.dtype)

    log_ratio = (x.logp_BT - x.behaviour_BT) * mask
    ratio = torch.exp(log_ratio)
    if cfg.importance == "ppo_clip":
        clipped = torch.clamp(ratio, 1 - cfg.clip_eps, 1 + cfg.clip_eps)
        pg = -torch.minimum(ratio * adv_B1, clipped * adv_B1)
        clip_frac = (((ratio - clipped).abs() > 0) & (mask > 0)).sum() / n_tokens
    else:
        weight = torch.clamp(ratio, max=cfg.tis_cap).detach()
        pg = -weight * adv_B1 * x.logp_BT
        clip_frac = ((ratio > cfg.tis_cap) & (mask > 0)).sum() / n_tokens

    d = (x.ref_BT - x.logp_BT) * mask
    kl = torch.exp(d) - d - 1
    loss = ((pg + cfg.kl_coef * kl) * mask).sum() / n_tokens

    with torch.no_grad():
        # Train-vs-behaviour mismatch on the same tokens: k3 estimate of KL(behaviour || learner).
        m = (x.logp_BT - x.behaviour_BT) * mask
        mismatch = ((torch.exp(m) - m - 1) * mask).sum() / n_tokens
        metrics = {
            "loss": loss.item(),
            "pg": (pg * mask).sum().item() / n_tokens.item(),
            "kl_ref": (kl * mask).sum().item() / n_tokens.item(),
            "mismatch_kl": mismatch.item(),
            "ratio_mean": (ratio * mask).sum().item() / n_tokens.item(),
            "clip_frac": clip_frac.item(),
            "advantage_abs": adv_B1.abs().mean().item(),
            "reward_mean": x.reward_B.float().mean().item(),
            "tokens": n_tokens.item(),
        }
    return loss, metrics
