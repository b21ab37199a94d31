"""Named model sizes as plain data: `pretrain.size` picks one.

Kept apart from learner.model so the settings (learner/train/pretrain_settings.py) validate
a size without importing torch; `ModelArgs.from_name` builds the model's arguments from it.
"""

SIZES: dict[str, dict[str, int]] = {
    # head_dim 32 even in `tiny`: vLLM's CPU attention supports head sizes 32, 64, ...
    "tiny": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, n_experts=4, top_k=2, moe_dim=64),
    "small": dict(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=32, n_experts=8, top_k=2, moe_dim=256),
    # about 2.5x small's compute per token: for a longer budget or a faster machine
    "medium": dict(dim=384, n_layers=6, n_heads=12, n_kv_heads=4, head_dim=32, n_experts=8, top_k=2, moe_dim=384),
}
