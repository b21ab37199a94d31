"""Tiny random checkpoints of each supported family, saved as Hugging Face folders, as a user's
model would arrive: built with the family's transformers config class, with a tokenizer whose
special tokens carry the family's real names at ids far from 0 (EOS near the end of the
vocabulary, as in Qwen, whose id 0 is "!"), and a config vocabulary padded beyond the tokenizer.

`make_family_model(folder, family)` writes config.json, generation_config.json, model.safetensors,
tokenizer.json and tokenizer_config.json. `eos_bias` lifts "!" (id 0) and the EOS token above the
rest of the vocabulary, so sampling writes "!" often and ends at EOS soon: what shows that
generation stops at the family's EOS and not at id 0.
"""

from __future__ import annotations

import inspect
import json
import textwrap
from pathlib import Path

import torch

from tests.helpers import family_tokenizer

QWEN_SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
]
NO_FIM_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

COMMON = dict(
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    initializer_range=0.1,  # wide logits: clear greedy margins across precisions
)
# family -> (transformers config class name, its arguments)
FAMILIES = {
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True),
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=96,
            intermediate_size=96,
            norm_topk_prob=False,
        ),
    ),
    "qwen3": ("Qwen3Config", dict(head_dim=32, intermediate_size=128)),
    "qwen2": ("Qwen2Config", dict(intermediate_size=128, tie_word_embeddings=True)),  # Qwen2.5-Coder-1.5B ties
}
ARCHITECTURES = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}


def training_texts() -> list[str]:
    return [inspect.getsource(m) for m in (json.decoder, json.encoder, textwrap)]


def make_family_model(
    folder: Path,
    family: str,
    *,
    fim: bool = True,
    seed: int = 0,
    eos_bias: bool = False,
    chat_eos: bool = False,
    config_overrides: dict | None = None,
) -> Path:
    """Write a tiny random `family` checkpoint into `folder` (see the module docstring).
    `chat_eos`: generation_config lists `<|im_end|>` before `<|endoftext|>`, as an instruct model's does."""
    import transformers

    tok = family_tokenizer(training_texts(), 600, QWEN_SPECIALS if fim else NO_FIM_SPECIALS)
    eos, im_end = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
    cls_name, extra = FAMILIES[family]
    vocab = (tok.get_vocab_size() // 64 + 2) * 64  # padded past the tokenizer, as Qwen's 151936 is
    config = getattr(transformers, cls_name)(
        vocab_size=vocab,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=None,
        **{**COMMON, **extra, **(config_overrides or {})},
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if eos_bias:
        # about half of the samples "!", a sixth EOS, the rest spread over the vocabulary
        _lift(model, [(tok.token_to_id("!"), 6.9), (eos, 5.7)])
    folder = Path(folder)
    model.save_pretrained(folder)
    (folder / "generation_config.json").write_text(
        json.dumps({"bos_token_id": eos, "eos_token_id": [im_end, eos] if chat_eos else eos, "pad_token_id": eos})
    )
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|im_end|>" if chat_eos else "<|endoftext|>",
                "pad_token": "<|endoftext|>",
                "bos_token": None,
                "add_bos_token": False,
                "clean_up_tokenization_spaces": False,
                "model_max_length": COMMON["max_position_embeddings"],
            }
        )
    )
    return folder


@torch.no_grad()
def _lift(model, tokens: list[tuple[int, float]]) -> None:
    """Raise some tokens' logits by about `lift` nats at every position. Every embedding gets a
    constant on dimension 0 that the layers neither read (their input norms weigh it 0) nor write
    (o_proj and down_proj rows 0 are zero), so the final hidden state carries it everywhere; the
    lifted tokens' output rows weigh it. With tied embeddings the output rows are the input rows:
    the common part shifts every logit alike."""
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    emb[:, 0] = 4.0
    for name, p in model.named_parameters():
        if "layers." in name and name.endswith("layernorm.weight"):
            p[0] = 0.0
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            p[0, :] = 0.0
    if head.data_ptr() != emb.data_ptr():
        head[:, 0] = 0.0
    ids = torch.randint(0, emb.shape[0], (4, 64), generator=torch.Generator().manual_seed(0))
    h0 = model.model(ids).last_hidden_state[..., 0].mean().item()  # after the final norm
    for t, lift in tokens:
        head[t, 0] += lift / h0


def hf_logits(folder: Path, ids: list[list[int]]) -> torch.Tensor:
    """transformers' own forward in float32 on the saved checkpoint: the reference."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor(ids)).logits
