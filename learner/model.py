"""The Qwen decoder family in one file: HF `Qwen3MoeForCausalLM` (Flywheel's own model, and
Qwen3-Coder-30B-A3B), `Qwen2MoeForCausalLM`, `Qwen3ForCausalLM` and `Qwen2ForCausalLM`
(Qwen2.5-Coder), with their parameter layout and math. They differ by a few flags of
`ModelArgs`, read from config.json by `from_hf_config` (FAMILIES lists them):

    qk_norm          RMSNorm per head on q and k (Qwen3, Qwen3-MoE)
    qkv_bias         a bias on the q, k, v projections (Qwen2, Qwen2-MoE)
    n_experts        0: a dense SwiGLU MLP in every layer; else routed experts, except in
                     `dense_layers` (config's mlp_only_layers / decoder_sparse_step)
    shared_expert_dim  Qwen2-MoE's shared expert beside the routed ones, gated by sigmoid(x W)
    norm_topk        renormalize the top-k gate weights to sum to 1 (Qwen3-MoE: yes, Qwen2-MoE: no)
    tie_embeddings   the output layer is the embedding (no lm_head.weight)

`state_dict()` names equal the names in the family's safetensors checkpoint, so an export
needs no renaming and vLLM / transformers load it unchanged:

    model.embed_tokens.weight                          [V, D]
    model.layers.{i}.input_layernorm.weight            [D]
    model.layers.{i}.self_attn.{q,k,v,o}_proj.weight   [H*Hd, D] [Hkv*Hd, D] [Hkv*Hd, D] [D, H*Hd]
    model.layers.{i}.self_attn.{q,k,v}_proj.bias       [H*Hd] [Hkv*Hd] [Hkv*Hd]    qkv_bias
    model.layers.{i}.self_attn.{q,k}_norm.weight       [Hd]      RMSNorm per head; qk_norm
    model.layers.{i}.post_attention_layernorm.weight   [D]
    model.layers.{i}.mlp.gate.weight                   [E, D]    router                (MoE layer)
    model.layers.{i}.mlp.experts.{e}.{gate,up}_proj.weight  [F, D]
    model.layers.{i}.mlp.experts.{e}.down_proj.weight  [D, F]
    model.layers.{i}.mlp.shared_expert.{gate,up,down}_proj.weight, .shared_expert_gate.weight [1, D]
    model.layers.{i}.mlp.{gate,up}_proj.weight         [Fd, D]   dense MLP             (dense layer)
    model.layers.{i}.mlp.down_proj.weight              [D, Fd]
    model.norm.weight                                  [D]
    lm_head.weight                                     [V, D]    unless tied

Shape legend: B batch, S sequence, T = B*S tokens, D model dim, H / Hkv query / kv heads,
Hd head dim, E experts, K experts per token, R = T*K routed (token, expert) slots, U experts
with tokens routed to them, F expert hidden dim, Fd dense MLP hidden dim, V vocabulary, P positions
held in a KV cache.

Router replay: `forward(..., return_routing=True)` also returns the experts each token
chose, per MoE layer ([B, S, K] int64; a dense model has none). Passing such a list back as `routing=` forces those
experts; the gate weights still come from the router's own softmax at the forced
indices, so the router keeps its gradient (as in R3 / Megatron's RouterReplay). A token
whose ids are -1 chooses its own experts (a position the serving engine's trace lacks).

KV cache: `forward(ids, cache=KVCache())` runs `ids` at the positions after those already in
the cache and appends their keys and values, so one forward serves training (no cache), a
prefill (an empty cache) and decoding (one new token against the cache); learner.decode
decodes with it.

FP4 hook: `fp4(param_name, weight) -> weight` is applied to every matrix weight at use
time (embedding, projections, router, experts, lm_head); the callable decides by name.

Load balancing: pass a list as `balance_losses=` and each MoE layer appends its
Switch-Transformer auxiliary loss E * sum_e f_e * P_e (f_e: share of the layer's expert
slots routed to e, P_e: mean router probability of e; 1.0 when perfectly balanced). Without
it a small MoE trained from scratch routes most tokens to a few experts.
"""

from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from learner.sizes import SIZES

WeightHook = Callable[[str, torch.Tensor], torch.Tensor]


# The architectures from_hf_config reads, and what sets each apart (see the module docstring).
FAMILIES: dict[str, dict] = {
    "Qwen3MoeForCausalLM": {"moe": True, "qk_norm": True},
    "Qwen2MoeForCausalLM": {"moe": True, "qk_norm": False},
    "Qwen3ForCausalLM": {"moe": False, "qk_norm": True},
    "Qwen2ForCausalLM": {"moe": False, "qk_norm": False},
}


@dataclass
class ModelArgs:
    vocab_size: int = 4096
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4
    head_dim: int = 32
    n_experts: int = 8  # 0: a dense model
    top_k: int = 2
    moe_dim: int = 256
    ffn_dim: int = 0  # hidden dim of the dense MLP layers
    dense_layers: tuple[int, ...] = ()  # layers of an MoE model that have a dense MLP instead
    shared_expert_dim: int = 0
    norm_topk: bool = True
    qk_norm: bool = True
    qkv_bias: bool = False
    tie_embeddings: bool = False
    architecture: str = "Qwen3MoeForCausalLM"
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    max_seq_len: int = 2048
    init_std: float = 0.02

    def __post_init__(self):
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.n_experts and not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k ({self.top_k}) must be between 1 and n_experts ({self.n_experts})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for RoPE")
        if (self.n_experts == 0 or self.dense_layers) and self.ffn_dim < 1:
            raise ValueError("dense MLP layers need ffn_dim (config.json's intermediate_size)")
        self.dense_layers = tuple(self.dense_layers)

    def is_moe(self, layer: int) -> bool:
        return self.n_experts > 0 and layer not in self.dense_layers

    @property
    def moe_layers(self) -> list[int]:
        """The layers with routed experts: what router replay's routing lists hold, in order."""
        return [i for i in range(self.n_layers) if self.is_moe(i)]

    @classmethod
    def from_name(cls, name: str, **overrides) -> "ModelArgs":
        if name not in SIZES:
            raise ValueError(f"unknown model size {name!r}; choose one of {sorted(SIZES)}")
        return cls(**{**SIZES[name], **overrides})

    def to_hf_config(self, dtype: torch.dtype = torch.bfloat16) -> dict:
        """The `config.json` of the equivalent `Qwen3MoeForCausalLM` (learner.export adds the
        tokenizer's special token ids). Flywheel's own layout only: an imported model keeps its
        own config.json."""
        own = ModelArgs(**{**asdict(self), **{k: getattr(ModelArgs, k) for k in _FAMILY_FLAGS}})
        if own != self or not self.n_experts:
            raise ValueError(f"to_hf_config writes Flywheel's own Qwen3-MoE layout, not {self.architecture}'s flags")
        return {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "vocab_size": self.vocab_size,
            "hidden_size": self.dim,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "num_experts": self.n_experts,
            "num_experts_per_tok": self.top_k,
            "moe_intermediate_size": self.moe_dim,
            "intermediate_size": self.moe_dim,  # unused: no dense MLP layers
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "norm_topk_prob": True,
            "hidden_act": "silu",
            "rms_norm_eps": self.norm_eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "max_position_embeddings": self.max_seq_len,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "sliding_window": None,
            "tie_word_embeddings": False,
            "output_router_logits": False,
            "router_aux_loss_coef": 0.001,
            "initializer_range": self.init_std,
            "use_cache": True,
            "torch_dtype": str(dtype).removeprefix("torch."),
        }

    @classmethod
    def from_hf_config(cls, config: dict) -> "ModelArgs":
        """Read the `config.json` of a FAMILIES architecture; ValueError, naming the setting, for
        features this model does not implement."""
        arch = (config.get("architectures") or ["Qwen3MoeForCausalLM"])[0]
        if arch not in FAMILIES:
            raise ValueError(f"architecture {arch} is not supported; supported: {', '.join(FAMILIES)}")
        fam = FAMILIES[arch]
        unsupported = {
            "hidden_act": (config.get("hidden_act", "silu"), "silu"),
            "use_sliding_window": (config.get("use_sliding_window", False), False),
        }
        if arch.startswith("Qwen3"):  # Qwen3's attention_bias would put a bias on o_proj too
            unsupported["attention_bias"] = (config.get("attention_bias", False), False)
        for key, (got, want) in unsupported.items():
            if got != want:
                raise ValueError(f"config.json has {key}={got!r}; this model needs {key}={want!r}")
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"rope_type {rope_type!r} is not supported; use 'default'")
        n_layers = config["num_hidden_layers"]
        moe = {}
        if fam["moe"]:
            step, only = config.get("decoder_sparse_step", 1) or 1, set(config.get("mlp_only_layers") or [])
            moe = dict(
                n_experts=config.get("num_experts", config.get("num_local_experts")),
                top_k=config["num_experts_per_tok"],
                moe_dim=config["moe_intermediate_size"],
                dense_layers=tuple(i for i in range(n_layers) if i in only or (i + 1) % step),
                shared_expert_dim=config.get("shared_expert_intermediate_size", 0)
                if arch == "Qwen2MoeForCausalLM"
                else 0,
                norm_topk=bool(config.get("norm_topk_prob", False)),
            )
        return cls(
            vocab_size=config["vocab_size"],
            dim=config["hidden_size"],
            n_layers=n_layers,
            n_heads=config["num_attention_heads"],
            n_kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
            head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
            **({"n_experts": 0} | moe),
            ffn_dim=config.get("intermediate_size", 0) if not moe or moe["dense_layers"] else 0,
            qk_norm=fam["qk_norm"],
            qkv_bias=arch == "Qwen2ForCausalLM" or (arch == "Qwen2MoeForCausalLM" and config.get("qkv_bias", True)),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            architecture=arch,
            rope_theta=rope.get("rope_theta", config.get("rope_theta", 10000.0)),
            norm_eps=config.get("rms_norm_eps", 1e-6),
            max_seq_len=config.get("max_position_embeddings", 2048),
            init_std=config.get("initializer_range", 0.02),
        )

    def to_dict(self) -> dict:
        return asdict(self)


_FAMILY_FLAGS = (
    "ffn_dim",
    "dense_layers",
    "shared_expert_dim",
    "norm_topk",
    "qk_norm",
    "qkv_bias",
    "tie_embeddings",
    "architecture",
)


@dataclass
class KVCache:
    """The keys and values of the positions a forward already ran, one (k, v) pair per layer,
    each [B, Hkv, P, Hd] for P cached positions. `Transformer.forward(..., cache=)` appends to it.
    A forward that raises before its first layer (a bad argument) leaves it unchanged."""

    kv: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def __len__(self) -> int:
        """Positions cached."""
        return self.kv[0][0].shape[2] if self.kv else 0

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new positions' k, v of `layer`; returns all of that layer's k, v."""
        if layer == len(self.kv):
            self.kv.append((k, v))
        else:
            old_k, old_v = self.kv[layer]
            self.kv[layer] = (torch.cat([old_k, k], dim=2), torch.cat([old_v, v], dim=2))
        return self.kv[layer]


def _w(module: nn.Module, fp4: WeightHook | None) -> torch.Tensor:
    """A module's weight as used in the forward pass, through the FP4 hook if any."""
    return module.weight if fp4 is None else fp4(module.weight_name, module.weight)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 and scale in the input dtype, exactly as transformers does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_cos_sin(seq_len: int, head_dim: int, theta: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [S, Hd] in fp32 (rotate-half layout: each frequency appears twice)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device=device) / head_dim))
    freqs = torch.arange(seq_len, device=device).float()[:, None] * inv_freq  # [S, Hd/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, S, Hd]; cos, sin [S, Hd] in x's dtype."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """q [B, H, S, Hd] at positions start..start+S-1; k, v [B, Hkv, start+S, Hd] of every
    position so far -> [B, H, S, Hd], each query attending to its own position and those before."""
    S = q.shape[2]
    if start == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    if S == 1:  # a new token attends to everything before it: no mask to build
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    # [S, start+S]: query i (at position start+i) sees the positions up to its own
    allowed = torch.arange(start + S, device=q.device) <= torch.arange(start, start + S, device=q.device)[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.layer = layer  # its slot in a KVCache
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.q_proj = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=args.qkv_bias)
        self.k_proj = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.v_proj = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.o_proj = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        if args.qk_norm:
            self.q_norm = RMSNorm(args.head_dim, args.norm_eps)
            self.k_norm = RMSNorm(args.head_dim, args.norm_eps)
        else:
            self.q_norm = self.k_norm = nn.Identity()

    def forward(
        self, x: torch.Tensor, cos, sin, fp4: WeightHook | None, cache: KVCache | None = None, start: int = 0
    ) -> torch.Tensor:
        """x [B, S, D] at positions start..start+S-1 (cos, sin [S, Hd] of those positions); with
        a cache, its `start` positions are attended to and x's are appended."""
        B, S, _ = x.shape
        q = self.q_norm(F.linear(x, _w(self.q_proj, fp4), self.q_proj.bias).view(B, S, self.n_heads, self.head_dim))
        k = self.k_norm(F.linear(x, _w(self.k_proj, fp4), self.k_proj.bias).view(B, S, self.n_kv_heads, self.head_dim))
        v = F.linear(x, _w(self.v_proj, fp4), self.v_proj.bias).view(B, S, self.n_kv_heads, self.head_dim)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H(kv), S, Hd]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.extend(self.layer, k, v)  # [B, Hkv, start+S, Hd]
        y = causal_attention(q, k, v, start)  # [B, H, S, Hd]
        return F.linear(y.transpose(1, 2).reshape(B, S, -1), _w(self.o_proj, fp4))


class Expert(nn.Module):
    """A SwiGLU MLP: each routed expert, Qwen2-MoE's shared expert, and a dense layer's MLP."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor, fp4: WeightHook | None) -> torch.Tensor:
        h = F.silu(F.linear(x, _w(self.gate_proj, fp4))) * F.linear(x, _w(self.up_proj, fp4))
        return F.linear(h, _w(self.down_proj, fp4))


_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what torch's grouped_mm multiplies


class MoE(nn.Module):
    # The reference computation, one expert at a time (HF's Qwen3MoeSparseMoeBlock loops so):
    # `flywheel bench train` measures against it and the tests check the grouped one equals it.
    expert_loop: bool = False

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k = args.top_k
        self.norm_topk = args.norm_topk
        self.gate = nn.Linear(args.dim, args.n_experts, bias=False)
        self.experts = nn.ModuleList(Expert(args.dim, args.moe_dim) for _ in range(args.n_experts))
        if args.shared_expert_dim:
            self.shared_expert = Expert(args.dim, args.shared_expert_dim)
            self.shared_expert_gate = nn.Linear(args.dim, 1, bias=False)

    def shared(self, x_TD: torch.Tensor, fp4: WeightHook | None) -> torch.Tensor | None:
        """Qwen2-MoE's shared expert, which every token uses, scaled by its sigmoid gate; None without one."""
        if not hasattr(self, "shared_expert"):
            return None
        return torch.sigmoid(F.linear(x_TD, _w(self.shared_expert_gate, fp4))) * self.shared_expert(x_TD, fp4)

    def forward(
        self,
        x_TD: torch.Tensor,
        fp4: WeightHook | None,
        forced_TK: torch.Tensor | None = None,
        balance_losses: list | None = None,
    ):
        """Returns (out_TD, idx_TK): the mixed expert outputs and the experts chosen."""
        logits_TE = F.linear(x_TD, _w(self.gate, fp4))
        probs_TE = F.softmax(logits_TE, dim=-1, dtype=torch.float)
        if forced_TK is None:
            w_TK, idx_TK = torch.topk(probs_TE, self.top_k, dim=-1)
        else:
            idx_TK = forced_TK
            unknown_T1 = (forced_TK < 0).any(dim=-1, keepdim=True)
            if unknown_T1.any():  # a token without a recorded route (-1) chooses its own experts
                idx_TK = torch.where(unknown_T1, torch.topk(probs_TE, self.top_k, dim=-1).indices, forced_TK)
            w_TK = probs_TE.gather(-1, idx_TK)  # differentiable: the router still learns
        if self.norm_topk:
            w_TK = w_TK / w_TK.sum(dim=-1, keepdim=True)
        w_TK = w_TK.to(x_TD.dtype)
        if balance_losses is not None:
            E = probs_TE.shape[-1]
            f_E = torch.bincount(idx_TK.flatten(), minlength=E).float() / idx_TK.numel()
            balance_losses.append(E * (f_E * probs_TE.mean(0)).sum())
        mix = self._experts_looped if self.expert_loop else self._experts_grouped
        return mix(x_TD, fp4, idx_TK, w_TK), idx_TK

    def _experts_grouped(self, x_TD, fp4, idx_TK, w_TK) -> torch.Tensor:
        """All experts at once. The R = T*K (token, choice) slots are sorted by expert, so
        each expert's tokens are one block of rows; one grouped matmul per projection multiplies
        every block by its expert's weights, stacked [U, F, D] for the U experts with tokens
        (`offs_U`: where each block ends)."""
        K = idx_TK.shape[1]
        # Autocast does not cover grouped_mm: cast as it casts F.linear, so the math is the loop's.
        dev = x_TD.device.type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x_TD.dtype
        if dtype not in _GROUPED_MM_DTYPES:  # float64: an exact reference in the tests, speed moot
            return self._experts_looped(x_TD, fp4, idx_TK, w_TK)
        expert_R = idx_TK.flatten()
        order_R = expert_R.argsort(stable=True)  # by expert; within one, in token order
        tok_R = order_R // K
        count_E = torch.bincount(expert_R, minlength=len(self.experts))
        # Only experts with tokens take part, as in the loop: an expert without any keeps no
        # gradient (None, not zeros), so AdamW leaves it alone that step instead of decaying it.
        used = [e for e, c in enumerate(count_E.tolist()) if c]
        offs_U = count_E[used].cumsum(0).to(torch.int32)

        def stacked(proj: str) -> torch.Tensor:  # [U, out, in]; the FP4 hook is keyed by each expert's name
            return torch.stack([_w(getattr(self.experts[e], proj), fp4) for e in used]).to(dtype)

        x_RD = x_TD[tok_R]
        # Cast once per matmul, as autocast does: the two input gradients then meet in x's dtype.
        gate_RF = F.grouped_mm(x_RD.to(dtype), stacked("gate_proj").mT, offs=offs_U)
        h_RF = F.silu(gate_RF) * F.grouped_mm(x_RD.to(dtype), stacked("up_proj").mT, offs=offs_U)
        y_RD = F.grouped_mm(h_RF, stacked("down_proj").mT, offs=offs_U) * w_TK.flatten()[order_R, None]
        return torch.zeros_like(x_TD).index_add(0, tok_R, y_RD.to(x_TD.dtype))

    def _experts_looped(self, x_TD, fp4, idx_TK, w_TK) -> torch.Tensor:
        out_TD = torch.zeros_like(x_TD)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(idx_TK == e)
            if tok.numel() == 0:
                continue
            y = expert(x_TD[tok], fp4) * w_TK[tok, slot, None]
            out_TD = out_TD.index_add(0, tok, y)
        return out_TD


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.self_attn = Attention(args, layer)
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.mlp = MoE(args) if args.is_moe(layer) else Expert(args.dim, args.ffn_dim)

    def forward(self, x, cos, sin, fp4, forced_BSK, balance_losses=None, cache=None, start=0):
        """-> (x, the experts chosen [B, S, K], or None in a dense layer)."""
        B, S, D = x.shape
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, fp4, cache, start)
        h_TD = self.post_attention_layernorm(x).reshape(B * S, D)
        if not isinstance(self.mlp, MoE):
            return x + self.mlp(h_TD, fp4).view(B, S, D), None
        forced_TK = None if forced_BSK is None else forced_BSK.reshape(B * S, -1)
        out_TD, idx_TK = self.mlp(h_TD, fp4, forced_TK, balance_losses)
        if (shared_TD := self.mlp.shared(h_TD, fp4)) is not None:
            out_TD = out_TD + shared_TD
        return x + out_TD.view(B, S, D), idx_TK.view(B, S, -1)


class Decoder(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args, i) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = Decoder(args)
        if not args.tie_embeddings:
            self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
        # Each matrix knows its checkpoint name, which is what the FP4 hook is keyed on.
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight_name = f"{name}.weight"
        self.init_weights()

    @torch.no_grad()
    def init_weights(self, std: float | None = None) -> None:
        """Normal(0, std) matrices, zero biases and unit norms, as `Qwen3MoePreTrainedModel` does."""
        std = self.args.init_std if std is None else std
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.normal_(0.0, std)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)

    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        cache: KVCache | None = None,
        logits_to_keep: int = 0,
        routing: list[torch.Tensor] | None = None,
        return_routing: bool = False,
        fp4: WeightHook | None = None,
        balance_losses: list[torch.Tensor] | None = None,
    ):
        """input_ids [B, S] -> logits [B, S, V], plus the routing ([B, S, K] per layer)
        when `return_routing` is set. `cache`: the tokens follow the cache's positions, whose
        keys and values they attend to, and theirs are appended (an empty cache: a prefill);
        `logits_to_keep`: only the last that many positions' logits (0: all), as a decoder
        needs only the last one. `routing` forces the experts chosen in each layer (of the S
        new tokens); `balance_losses`, a list, receives each layer's load-balancing loss."""
        B, S = input_ids.shape
        start = 0 if cache is None else len(cache)
        if self.args.max_seq_len < start + S:
            raise ValueError(
                f"sequence of {start + S} tokens is longer than max_seq_len={self.args.max_seq_len}"
                + (f" ({start} cached, {S} new)" if start else "")
            )
        self._check_routing(routing, B, S)
        x = F.embedding(input_ids, _w(self.model.embed_tokens, fp4))  # [B, S, D]
        cos, sin = rope_cos_sin(start + S, self.args.head_dim, self.args.rope_theta, x.device)
        cos, sin = cos[start:].to(x.dtype), sin[start:].to(x.dtype)
        chosen = []
        for layer in self.model.layers:
            forced = None if routing is None or not isinstance(layer.mlp, MoE) else routing[len(chosen)]
            x, idx_BSK = layer(x, cos, sin, fp4, forced, balance_losses, cache, start)
            if idx_BSK is not None:
                chosen.append(idx_BSK.detach())
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        head = self.model.embed_tokens if self.args.tie_embeddings else self.lm_head
        logits = F.linear(self.model.norm(x), _w(head, fp4))  # [B, S or logits_to_keep, V]
        return (logits, chosen) if return_routing else logits

    def _check_routing(self, routing, B: int, S: int) -> None:
        if routing is None:
            return
        a = self.args
        if len(routing) != len(a.moe_layers):
            raise ValueError(f"routing has {len(routing)} layers; the model has {len(a.moe_layers)} MoE layers")
        for r in routing:
            if r.shape != (B, S, a.top_k) or r.dtype != torch.int64:
                raise ValueError(f"routing entries must be int64 [{B}, {S}, {a.top_k}], got {r.dtype} {tuple(r.shape)}")
            if r.numel() and (int(r.min()) < -1 or int(r.max()) >= a.n_experts):
                raise ValueError(f"routing holds expert ids outside [0, {a.n_experts}) (or -1: route it yourself)")

    def num_params(self, *, active: bool = False) -> int:
        """All parameters, or those one token uses (top_k of n_experts experts)."""
        n = sum(p.numel() for p in self.parameters())
        moe = self.args.moe_layers
        if active and moe:
            per_expert = sum(p.numel() for p in self.model.layers[moe[0]].mlp.experts[0].parameters())
            n -= len(moe) * (self.args.n_experts - self.args.top_k) * per_expert
        return n
