import pytest
import torch

from learner.model import KVCache, ModelArgs, Transformer
from learner.sizes import SIZES

V = 300


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Transformer(ModelArgs.from_name("tiny", vocab_size=V)).eval()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(1))


def test_shapes_and_routing(model, ids):
    logits, routing = model(ids, return_routing=True)
    a = model.args
    assert logits.shape == (2, 12, V)
    assert len(routing) == a.n_layers
    for r in routing:
        assert r.shape == (2, 12, a.top_k) and r.dtype == torch.int64
        assert int(r.min()) >= 0 and int(r.max()) < a.n_experts
        assert (r[..., 0] != r[..., 1]).all()


def test_state_dict_uses_checkpoint_names(model):
    names = set(model.state_dict())
    a = model.args
    expected = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for i in range(a.n_layers):
        p = f"model.layers.{i}."
        expected |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight", p + "mlp.gate.weight"}
        expected |= {p + f"self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")}
        expected |= {
            p + f"mlp.experts.{e}.{n}.weight" for e in range(a.n_experts) for n in ("gate_proj", "up_proj", "down_proj")
        }
    assert names == expected
    assert model.state_dict()["model.layers.0.mlp.gate.weight"].shape == (a.n_experts, a.dim)


def test_replaying_recorded_routing_reproduces_logits(model, ids):
    with torch.no_grad():
        logits, routing = model(ids, return_routing=True)
        replayed, routing2 = model(ids, routing=routing, return_routing=True)
        assert torch.equal(logits, replayed)
        assert all(torch.equal(a, b) for a, b in zip(routing, routing2))

        shifted = [(r + 1) % model.args.n_experts for r in routing]
        forced = model(ids, routing=shifted)
        assert (forced - logits).abs().max() > 1e-3


def test_router_gets_gradient_under_replay(model, ids):
    with torch.no_grad():
        _, routing = model(ids, return_routing=True)
    model.zero_grad()
    logits = model(ids, routing=routing)
    torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1)).backward()
    for layer in model.model.layers:
        assert layer.mlp.gate.weight.grad is not None
        assert layer.mlp.gate.weight.grad.abs().sum() > 0
    model.zero_grad()


def test_fp4_hook_sees_every_matrix_by_name(model, ids):
    seen = {}

    def hook(name, w):
        seen[name] = seen.get(name, 0) + 1
        return w.half().float() if ".experts." in name else w

    with torch.no_grad():
        plain = model(ids)
        hooked = model(ids, fp4=hook)
    matrices = {n for n, p in model.named_parameters() if p.ndim == 2}
    assert set(seen) == matrices
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in seen
    assert not torch.equal(plain, hooked)  # the hook's output is what the forward used
    assert (plain - hooked).abs().max() < 1e-2


def test_causal(model, ids):
    with torch.no_grad():
        a = model(ids)
        changed = ids.clone()
        changed[:, 8] = (changed[:, 8] + 1) % V
        b = model(changed)
    # Not bit-equal: the expert matmuls see a different set of rows, so they block the
    # sums differently. Anything causal leaks far above rounding.
    torch.testing.assert_close(a[:, :8], b[:, :8], atol=1e-6, rtol=0)
    assert (a[:, 8:] - b[:, 8:]).abs().amax(dim=-1).min() > 1e-3


def test_batch_rows_are_independent(model, ids):
    with torch.no_grad():
        both = model(ids)
        first = model(ids[:1])
    torch.testing.assert_close(both[:1], first, atol=1e-5, rtol=0)


def test_bad_routing_is_rejected(model, ids):
    with torch.no_grad():
        _, routing = model(ids, return_routing=True)
    with pytest.raises(ValueError):
        model(ids, routing=routing[:1])
    with pytest.raises(ValueError):
        model(ids, routing=[r + model.args.n_experts for r in routing])
    with pytest.raises(ValueError):
        model(ids[:, :5], routing=routing)


def test_hf_config_round_trip():
    for name in SIZES:
        args = ModelArgs.from_name(name, vocab_size=1000, rope_theta=50000.0)
        cfg = args.to_hf_config()
        assert cfg["model_type"] == "qwen3_moe" and cfg["torch_dtype"] == "bfloat16"
        assert ModelArgs.from_hf_config(cfg) == args
    assert ModelArgs.from_hf_config({**cfg, "tie_word_embeddings": True}).tie_embeddings  # a family flag now
    with pytest.raises(ValueError, match="use_sliding_window"):
        ModelArgs.from_hf_config({**cfg, "use_sliding_window": True})
    with pytest.raises(ValueError, match="Flywheel's own Qwen3-MoE layout"):
        ModelArgs.from_hf_config({**cfg, "tie_word_embeddings": True}).to_hf_config()
    with pytest.raises(ValueError):
        ModelArgs.from_name("huge")


def test_transformers_config_accepts_ours():
    from transformers import Qwen3MoeConfig

    args = ModelArgs.from_name("tiny", vocab_size=V)
    cfg = Qwen3MoeConfig(**args.to_hf_config())
    assert cfg.num_experts == args.n_experts and cfg.head_dim == args.head_dim
    assert cfg.rope_parameters["rope_theta"] == args.rope_theta
    assert cfg.sliding_window is None


def test_active_params(model):
    assert model.num_params(active=True) < model.num_params()


# --- the KV cache: one forward for training, prefill and decoding ----------------------------------------


def test_prefill_then_one_token_steps_equal_the_forward_without_cache(model, ids):
    from learner.train.pretrain import fp4_hook

    for hook in (None, fp4_hook("nvfp4")):
        with torch.no_grad():
            want, want_routing = model(ids, fp4=hook, return_routing=True)
            cache = KVCache()
            got = [model(ids[:, :8], cache=cache, fp4=hook)]
            routing = [model(ids[:, :8], return_routing=True, fp4=hook)[1]]
            for t in range(8, ids.shape[1]):
                logits, r = model(ids[:, t : t + 1], cache=cache, fp4=hook, return_routing=True)
                got.append(logits)
                routing.append(r)
        assert len(cache) == ids.shape[1] and cache.kv[0][0].shape == (
            2,
            model.args.n_kv_heads,
            12,
            model.args.head_dim,
        )
        torch.testing.assert_close(torch.cat(got, dim=1), want, atol=1e-5, rtol=1e-4)
        for i in range(model.args.n_layers):
            assert torch.equal(torch.cat([r[i] for r in routing], dim=1), want_routing[i])


def test_a_prefill_in_chunks_equals_one_prefill(model, ids):
    with torch.no_grad():
        want = model(ids)
        cache = KVCache()
        first = model(ids[:, :5], cache=cache)
        rest = model(ids[:, 5:], cache=cache)  # 7 new positions after 5 cached ones: causal within them
        last = model(ids, cache=KVCache(), logits_to_keep=1)
    torch.testing.assert_close(torch.cat([first, rest], dim=1), want, atol=1e-5, rtol=1e-4)
    assert last.shape == (2, 1, V)
    torch.testing.assert_close(last, want[:, -1:], atol=1e-6, rtol=0)


def test_the_cache_refuses_positions_past_the_window():
    torch.manual_seed(0)
    small = Transformer(ModelArgs.from_name("tiny", vocab_size=V, max_seq_len=16)).eval()
    cache = KVCache()
    with torch.no_grad():
        small(torch.zeros((1, 16), dtype=torch.long), cache=cache)
        with pytest.raises(ValueError, match="max_seq_len=16 .16 cached, 1 new"):
            small(torch.zeros((1, 1), dtype=torch.long), cache=cache)
    assert len(cache) == 16  # unchanged by the refused forward


# --- the grouped expert computation is the loop's math ------------------------------------------------


def _loop_copy(m: Transformer) -> Transformer:
    import copy

    from learner.model import MoE

    loop = copy.deepcopy(m)
    for mod in loop.modules():
        if isinstance(mod, MoE):
            mod.expert_loop = True
    return loop


def _assert_same(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    # The same products, summed in the same order: equal on the machines this was written on. The
    # tolerance leaves room for a matmul kernel that blocks a sum differently: a few roundings of
    # the dtype the matmuls run in, relative to the tensor's largest value.
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(a, b, rtol=4 * eps, atol=4 * eps * float(b.abs().max()) + 1e-30)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_grouped_experts_equal_the_loop_forward_and_backward_with_fp4_and_replay(autocast):
    """Random weights, the small size's expert layout (8 experts, top-2), FP4 QAT hook and router
    replay as in pretraining: the same logits, routing and every parameter's gradient."""
    from learner.train.pretrain import fp4_hook

    torch.manual_seed(0)
    grouped = Transformer(ModelArgs.from_name("small", vocab_size=V, max_seq_len=64)).train()
    loop = _loop_copy(grouped)
    ids = torch.randint(0, V, (3, 48), generator=torch.Generator().manual_seed(2))
    hook = fp4_hook("nvfp4")
    got = {}
    for name, m in (("grouped", grouped), ("loop", loop)):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            with torch.no_grad():
                _, routing = m(ids, return_routing=True)
            balance: list[torch.Tensor] = []
            logits, chosen = m(ids, routing=routing, fp4=hook, return_routing=True, balance_losses=balance)
            loss = torch.nn.functional.cross_entropy(logits.float()[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        (loss + 0.01 * torch.stack(balance).mean()).backward()
        got[name] = (logits.detach(), routing, chosen, {n: p.grad for n, p in m.named_parameters()})
    (lg, rg, cg, gg), (ll, rl, cl, gl) = got["grouped"], got["loop"]
    dtype = torch.bfloat16 if autocast else torch.float32
    _assert_same(lg, ll, dtype)
    assert all(torch.equal(a, b) for a, b in zip(rg + cg, rl + cl))  # replay forced the same experts
    assert all(torch.equal(a, b) for a, b in zip(cg, rg))
    for n in gl:
        _assert_same(gg[n], gl[n], dtype)
    assert all(gg[f"model.layers.{i}.mlp.gate.weight"].abs().sum() > 0 for i in range(4))  # the router learns


def test_grouped_experts_leave_experts_without_tokens_alone_as_the_loop_does(ids):
    """Routing that sends every token to experts 0 and 1: the others take no part, so their
    gradients stay None as in the loop and an AdamW step (with weight decay) leaves them where
    they were; every parameter after the step equals the loop's."""
    torch.manual_seed(0)
    grouped = Transformer(ModelArgs.from_name("tiny", vocab_size=V)).train()
    loop = _loop_copy(grouped)
    before = {n: p.detach().clone() for n, p in grouped.named_parameters()}
    routing = [torch.tensor([0, 1]).expand(*ids.shape, 2).contiguous() for _ in range(grouped.args.n_layers)]
    for m in (grouped, loop):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
        m(ids, routing=routing).float().pow(2).mean().backward()
        assert {n for n, p in m.named_parameters() if p.grad is None} == {
            f"model.layers.{i}.mlp.experts.{e}.{proj}.weight"
            for i in range(m.args.n_layers)
            for e in range(2, m.args.n_experts)
            for proj in ("gate_proj", "up_proj", "down_proj")
        }
        opt.step()
    after_g, after_l = dict(grouped.named_parameters()), dict(loop.named_parameters())
    assert all(torch.equal(after_g[n], after_l[n]) for n in after_g)
    assert torch.equal(
        after_g["model.layers.0.mlp.experts.3.up_proj.weight"], before["model.layers.0.mlp.experts.3.up_proj.weight"]
    )
    assert not torch.equal(
        after_g["model.layers.0.mlp.experts.0.up_proj.weight"], before["model.layers.0.mlp.experts.0.up_proj.weight"]
    )


def test_float64_takes_the_loop_and_still_runs(model, ids):
    """grouped_mm has no float64; a float64 copy (the exact reference of the logprob tolerance) computes."""
    import copy

    exact = copy.deepcopy(model).double()
    with torch.no_grad():
        # fp32 against float64 through two tiny layers: each of the few hundred roundings on a logit's
        # path is at most 6e-8 relative, far inside 1e-4.
        torch.testing.assert_close(exact(ids).float(), model(ids), rtol=1e-4, atol=1e-4)
