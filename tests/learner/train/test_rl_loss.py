"""The RL objective on tiny hand-made tensors."""

import math

import pytest
import torch

from learner.train.learn_settings import LearnSection
from learner.train.rl_loss import RLInputs, rl_loss


def inputs(logp, behaviour=None, ref=None, reward=(1.0, -1.0), mask=None, baseline=None):
    logp = torch.tensor(logp, requires_grad=True)
    return RLInputs(
        logp_BT=logp,
        behaviour_BT=torch.tensor(behaviour) if behaviour is not None else logp.detach().clone(),
        ref_BT=torch.tensor(ref) if ref is not None else logp.detach().clone(),
        reward_B=torch.tensor(reward),
        mask_BT=torch.tensor(mask) if mask is not None else torch.ones_like(logp),
        baseline=baseline,
    )


@pytest.mark.parametrize("importance", ["ppo_clip", "tis"])
def test_on_policy_gradient_raises_good_and_lowers_bad(importance):
    x = inputs([[-1.0, -1.0], [-1.0, -1.0]])
    loss, m = rl_loss(x, LearnSection(importance=importance, kl_coef=0.0))
    loss.backward()
    g = x.logp_BT.grad
    assert (g[0] < 0).all() and (g[1] > 0).all()  # descent raises logp of the rewarded sample
    assert m["ratio_mean"] == pytest.approx(1.0) and m["mismatch_kl"] == pytest.approx(0.0)
    # advantages +1 and -1, on-policy (ratio 1), 4 tokens: the gradient is -A/4 per token either way
    torch.testing.assert_close(g, torch.tensor([[-0.25, -0.25], [0.25, 0.25]]))


def test_padding_is_ignored():
    a, _ = rl_loss(inputs([[-1.0, -1.0], [-2.0, 0.0]], mask=[[1.0, 1.0], [1.0, 0.0]]), LearnSection())
    b, _ = rl_loss(inputs([[-1.0, -1.0], [-2.0, -9.0]], mask=[[1.0, 1.0], [1.0, 0.0]]), LearnSection())
    assert a.item() == pytest.approx(b.item())


def test_ppo_clip_stops_pushing_past_the_trust_region():
    # learner already far above behaviour on a positive-advantage token: clipped, no gradient
    x = inputs([[-0.1], [-1.0]], behaviour=[[-1.0], [-1.0]], reward=(1.0, 0.0))
    loss, m = rl_loss(x, LearnSection(clip_eps=0.2, kl_coef=0.0))
    loss.backward()
    assert x.logp_BT.grad[0, 0].item() == 0.0
    assert m["clip_frac"] == pytest.approx(0.5)
    assert m["ratio_mean"] == pytest.approx((math.exp(0.9) + 1) / 2, rel=1e-5)


def test_tis_caps_the_weight():
    x = inputs([[-0.1], [-1.0]], behaviour=[[-3.0], [-1.0]], reward=(1.0, 0.0))
    loss, _ = rl_loss(x, LearnSection(importance="tis", tis_cap=2.0, kl_coef=0.0))
    loss.backward()
    # weight min(e^2.9, 2) = 2, advantage 0.5, over 2 tokens
    assert x.logp_BT.grad[0, 0].item() == pytest.approx(-2 * 0.5 / 2)


def test_kl_penalty_pulls_towards_reference():
    x = inputs([[-0.5]], ref=[[-2.0]], reward=(0.0,))
    loss, m = rl_loss(x, LearnSection(kl_coef=1.0))
    loss.backward()
    d = -2.0 - -0.5
    assert m["kl_ref"] == pytest.approx(math.exp(d) - d - 1)
    assert x.logp_BT.grad[0, 0].item() > 0  # descent lowers logp towards the reference


def test_abstaining_beats_dismissed_suggestions():
    # B=3: an empty completion (just EOS, reward 0) and two dismissed suggestions (-0.25)
    x = inputs(
        [[-2.0, 0.0], [-1.0, -1.0], [-1.0, -1.0]], reward=(0.0, -0.25, -0.25), mask=[[1.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
    )
    loss, _ = rl_loss(x, LearnSection(kl_coef=0.0))
    loss.backward()
    assert x.logp_BT.grad[0, 0].item() < 0  # the EOS-first action is reinforced
    assert (x.logp_BT.grad[1:] > 0).all()


def test_explicit_baseline():
    _, m = rl_loss(inputs([[-1.0], [-1.0]], reward=(1.0, 1.0), baseline=0.5), LearnSection())
    assert m["advantage_abs"] == pytest.approx(0.5)
