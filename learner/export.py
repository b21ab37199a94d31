"""Export to, and load from, a Hugging Face folder that vLLM and transformers read as is.

A folder holds `config.json` (Qwen3MoeForCausalLM), `generation_config.json`, the
tokenizer files and `model.safetensors`. The state dict already uses checkpoint names
(see learner.model), so the tensors are written without renaming.
"""

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from learner.model import ModelArgs, Transformer
from learner.tokenizer import save_tokenizer

WEIGHTS_FILE = "model.safetensors"


def checkpoint_tensors(
    model: Transformer,
    *,
    dtype: torch.dtype = torch.bfloat16,
    weight_fn: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """The state dict as it goes to disk: optionally transformed by `weight_fn(name, t)`
    (e.g. FP4 weights stored dequantized), cast to `dtype`, contiguous, on the CPU."""
    out = {}
    for name, t in model.state_dict().items():
        t = t.detach()
        if weight_fn is not None:
            t = weight_fn(name, t)
        out[name] = t.to(device="cpu", dtype=dtype).contiguous()
    return out


def generation_config(args: ModelArgs) -> dict:
    return {"bos_token_id": args.eos_id, "eos_token_id": args.eos_id, "pad_token_id": args.eos_id}


def export_hf(
    model: Transformer,
    args: ModelArgs,
    tokenizer: Tokenizer,
    folder: str | Path,
    *,
    dtype: torch.dtype = torch.bfloat16,
    weight_fn: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
) -> Path:
    """Write a Qwen3MoeForCausalLM folder; returns its path. The weights go last, so a
    folder with `model.safetensors` is complete (the weight store adds its own marker)."""
    if tokenizer.get_vocab_size() > args.vocab_size:
        raise ValueError(
            f"tokenizer has {tokenizer.get_vocab_size()} tokens but the model only {args.vocab_size}; "
            "build the model with vocab_size >= the tokenizer's"
        )
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    _write_json(folder / "config.json", args.to_hf_config(dtype))
    _write_json(folder / "generation_config.json", generation_config(args))
    save_tokenizer(tokenizer, folder, model_max_length=args.max_seq_len)
    tensors = checkpoint_tensors(model, dtype=dtype, weight_fn=weight_fn)
    save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    return folder


def load_hf(folder: str | Path, *, dtype: torch.dtype = torch.float32) -> tuple[Transformer, ModelArgs]:
    """Load a folder written by `export_hf` (or any Qwen3-MoE checkpoint this model
    supports, in a single safetensors file) into a `Transformer` of `dtype`."""
    folder = Path(folder)
    if not (folder / "config.json").is_file() or not (folder / WEIGHTS_FILE).is_file():
        raise ValueError(f"{folder} is not an exported model: it needs config.json and {WEIGHTS_FILE}")
    args = ModelArgs.from_hf_config(json.loads((folder / "config.json").read_text()))
    with torch.device("meta"):
        model = Transformer(args)
    model.load_state_dict(load_file(str(folder / WEIGHTS_FILE)), strict=True, assign=True)
    return model.to(dtype), args


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")
