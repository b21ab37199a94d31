"""Each supported family: learner.model reads the checkpoint transformers writes and computes
what transformers computes (the reference for the served logprobs), and trains on it."""

import pytest
import torch

from learner.export import load_hf
from learner.model import FAMILIES, ModelArgs
from tests.learner.family_models import ARCHITECTURES, hf_logits, make_family_model

IDS = [[5, 17, 300, 42, 7, 99, 250, 3, 11, 600], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]


@pytest.mark.parametrize("family", sorted(ARCHITECTURES))
def test_our_forward_is_transformers_forward(tmp_path, family):
    folder = make_family_model(tmp_path, family)
    model, args = load_hf(folder, dtype=torch.float32)
    assert args.architecture == ARCHITECTURES[family] in FAMILIES
    with torch.no_grad():
        ours = model(torch.tensor(IDS))
    ref = hf_logits(folder, IDS)
    assert ours.shape == ref.shape
    # float32 both sides, different summation orders: a few ulps of logits of size ~10
    assert (ours - ref).abs().max().item() < 1e-4, (ours - ref).abs().max().item()


def test_family_flags_come_from_config(tmp_path):
    import json

    def args_of(family, **overrides):
        folder = make_family_model(tmp_path / family, family, config_overrides=overrides)
        return ModelArgs.from_hf_config(json.loads((folder / "config.json").read_text()))

    q2moe = args_of("qwen2_moe", mlp_only_layers=[1])
    assert (q2moe.qkv_bias, q2moe.qk_norm, q2moe.norm_topk, q2moe.shared_expert_dim) == (True, False, False, 96)
    assert q2moe.moe_layers == [0] and q2moe.dense_layers == (1,) and q2moe.ffn_dim == 96
    q2 = args_of("qwen2")
    assert (q2.n_experts, q2.qkv_bias, q2.qk_norm, q2.tie_embeddings, q2.moe_layers) == (0, True, False, True, [])
    q3 = args_of("qwen3")
    assert (q3.n_experts, q3.qkv_bias, q3.qk_norm, q3.tie_embeddings) == (0, False, True, False)


def test_unsupported_features_are_named():
    base = {
        "architectures": ["Qwen2ForCausalLM"],
        "vocab_size": 64,
        "hidden_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "intermediate_size": 64,
    }
    with pytest.raises(ValueError, match="LlamaForCausalLM is not supported; supported: Qwen3MoeForCausalLM"):
        ModelArgs.from_hf_config({**base, "architectures": ["LlamaForCausalLM"]})
    with pytest.raises(ValueError, match="use_sliding_window"):
        ModelArgs.from_hf_config({**base, "use_sliding_window": True})
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        ModelArgs.from_hf_config({**base, "rope_scaling": {"type": "yarn", "factor": 4.0}})


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen2"])
def test_router_replay_and_training_on_the_family(tmp_path, family):
    model, args = load_hf(make_family_model(tmp_path, family), dtype=torch.float32)
    ids = torch.tensor(IDS)
    with torch.no_grad():
        logits, routing = model(ids, return_routing=True)
        assert len(routing) == len(args.moe_layers)
        assert torch.equal(model(ids, routing=routing), logits)
    loss = torch.nn.functional.cross_entropy(model(ids)[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    grads = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert "model.layers.0.self_attn.q_proj.bias" in grads  # Qwen2's q/k/v biases train
    if family == "qwen2_moe":
        assert {"model.layers.0.mlp.shared_expert_gate.weight", "model.layers.0.mlp.gate.weight"} <= grads
    else:
        assert "lm_head.weight" not in dict(model.named_parameters())  # tied: the embedding is the output layer
