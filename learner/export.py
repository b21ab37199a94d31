"""Export to, and load from, a Hugging Face folder that vLLM and transformers read as is;
and the packed FP4 artifact for storage and transport.

A folder holds `config.json` (Qwen3MoeForCausalLM), `generation_config.json`, the
tokenizer files and `model.safetensors`. The state dict already uses checkpoint names
(see learner.model), so the tensors are written without renaming. FP4-trained tensors go
there dequantized (`fp4_dequantized`), which is exact in bf16 (see learner.fp4).

The packed artifact is a separate folder (vLLM would otherwise load both safetensors files):

    model.fp4.safetensors   FP4 targets in compressed-tensors' layout (learner.fp4.to_safetensors_dict):
                              {module}.weight_packed [N, K/2] uint8, {module}.weight_scale,
                              {module}.weight_global_scale (nvfp4); every other tensor in bf16
                              under its checkpoint name
    manifest.json           written last: format, layout, the tensors and their shapes,
                              bits per weight, the file's sha256 and the HF config

`verify_packed_roundtrip` checks packed -> bf16 -> packed is bit-identical.
"""

import hashlib
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from learner import fp4
from learner.model import ModelArgs, Transformer
from learner.tokenizer import save_tokenizer, special_token_ids

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PACKED_FILE = "model.fp4.safetensors"
MANIFEST_FILE = "manifest.json"


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


def generation_config(tokenizer: Tokenizer) -> dict:
    """The `generation_config.json` of an exported model: its tokenizer's special tokens."""
    return special_token_ids(tokenizer)


def export_hf(
    model: Transformer,
    args: ModelArgs,
    tokenizer: Tokenizer,
    folder: str | Path,
    *,
    dtype: torch.dtype = torch.bfloat16,
    weight_fn: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
    fim: str | None = None,
) -> Path:
    """Write a Qwen3MoeForCausalLM folder; returns its path. The weights go last, so a
    folder with `model.safetensors` is complete (the weight store adds its own marker).
    `fim`: the FIM template the model was trained in, named in its tokenizer_config.json."""
    if tokenizer.get_vocab_size() > args.vocab_size:
        raise ValueError(
            f"tokenizer has {tokenizer.get_vocab_size()} tokens but the model only {args.vocab_size}; "
            "build the model with vocab_size >= the tokenizer's"
        )
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    _write_json(folder / "config.json", args.to_hf_config(dtype) | special_token_ids(tokenizer))
    _write_json(folder / "generation_config.json", generation_config(tokenizer))
    save_tokenizer(tokenizer, folder, model_max_length=args.max_seq_len, fim=fim)
    tensors = checkpoint_tensors(model, dtype=dtype, weight_fn=weight_fn)
    save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    return folder


def weight_files(folder: str | Path) -> list[Path]:
    """The safetensors files of a Hugging Face folder: `model.safetensors`, or the shards that
    `model.safetensors.index.json` names. ValueError naming what is missing."""
    folder = Path(folder)
    index = folder / INDEX_FILE
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise ValueError(
                f"{folder}: {len(missing)} of the {len(names)} shards {INDEX_FILE} names are missing "
                f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); finish the download"
            )
        return [folder / n for n in names]
    if (folder / WEIGHTS_FILE).is_file():
        return [folder / WEIGHTS_FILE]
    raise ValueError(f"{folder} has no weights: neither {WEIGHTS_FILE} nor {INDEX_FILE}")


def read_hf_tensors(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face folder (one file or its shards), as stored."""
    out: dict[str, torch.Tensor] = {}
    for f in weight_files(folder):
        out.update(load_file(str(f)))
    return out


def load_hf(folder: str | Path, *, dtype: torch.dtype = torch.float32) -> tuple[Transformer, ModelArgs]:
    """Load a folder written by `export_hf`, or any checkpoint of a family learner.model
    supports (one safetensors file or shards), into a `Transformer` of `dtype`."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise ValueError(f"{folder} is not a model folder: it has no config.json")
    args = ModelArgs.from_hf_config(json.loads((folder / "config.json").read_text()))
    tensors = read_hf_tensors(folder)
    if args.tie_embeddings:  # some writers store the tied output layer anyway
        tensors.pop("lm_head.weight", None)
    with torch.device("meta"):
        model = Transformer(args)
    model.load_state_dict(tensors, strict=True, assign=True)
    return model.to(dtype), args


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


# --- the packed FP4 artifact ---------------------------------------------------------------------


def fp4_dequantized(
    fmt: fp4.FP4Format | str, patterns: Sequence[str] = fp4.DEFAULT_FP4_TARGETS
) -> Callable[[str, torch.Tensor], torch.Tensor]:
    """A `weight_fn` for export_hf: FP4 targets become their FP4 values (exact in bf16)."""
    fmt = fp4.get_format(fmt)
    return lambda name, t: fp4.quantize_dequantize(t.float(), fmt) if fp4.is_fp4_target(name, patterns) else t


def export_packed_fp4(
    model: Transformer,
    args: ModelArgs,
    folder: str | Path,
    *,
    fmt: fp4.FP4Format | str,
    patterns: Sequence[str] = fp4.DEFAULT_FP4_TARGETS,
) -> Path:
    """Write the packed artifact (see the module docstring); the manifest goes last."""
    fmt = fp4.get_format(fmt)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    fp4_entries, dense_entries, fp4_bits = {}, {}, 0.0
    for name, t in model.state_dict().items():
        t = t.detach().to("cpu")
        if fp4.is_fp4_target(name, patterns):
            p = fp4.pack(fp4.quantize(t.float(), fmt))
            tensors.update(fp4.to_safetensors_dict(name, p))
            fp4_entries[name] = {"shape": list(t.shape), "dtype": "bfloat16"}
            fp4_bits += fp4.packed_bits_per_weight(p) * t.numel()
        else:
            tensors[name] = t.to(torch.bfloat16).contiguous()
            dense_entries[name] = {"shape": list(t.shape), "dtype": "bfloat16"}
    path = folder / PACKED_FILE
    save_file(tensors, str(path), metadata={"format": "pt", "fp4_format": fmt.name})
    n_fp4 = sum(math.prod(e["shape"]) for e in fp4_entries.values())
    manifest = {
        "file": PACKED_FILE,
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "fp4_format": fmt.name,
        "block_size": fmt.block_size,
        "layout": (
            f"compressed-tensors {fmt.name}-pack-quantized. For an FP4 weight [N, K] of module M: "
            "M.weight_packed uint8 [N, K/2], two E2M1 codes a byte, low nibble = even column; "
            + (
                "M.weight_scale float8_e4m3fn [N, K/16]; M.weight_global_scale float32 [1], the divisor. "
                "weight = e2m1(code) * weight_scale / weight_global_scale."
                if fmt == fp4.NVFP4
                else "M.weight_scale uint8 [N, K/32], E8M0 biased exponents. weight = e2m1(code) * 2**(weight_scale - 127)."
            )
            + " E2M1 codes 0..15 = +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}, bit 3 the sign. Other tensors: bf16 under their checkpoint names."
        ),
        "fp4_tensors": fp4_entries,
        "dense_tensors": dense_entries,
        "fp4_bits_per_weight": fp4_bits / max(1, n_fp4),
        "hf_config": args.to_hf_config(),
    }
    _write_json(folder / MANIFEST_FILE, manifest)
    return folder


def _read_packed(folder: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    manifest_path = folder / MANIFEST_FILE
    if not manifest_path.is_file():
        raise ValueError(f"{folder} is not a packed FP4 artifact: it has no {MANIFEST_FILE}")
    manifest = json.loads(manifest_path.read_text())
    return manifest, load_file(str(folder / manifest["file"]))


def load_packed_fp4(folder: str | Path, *, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The dense state dict of a packed artifact: FP4 tensors dequantized, others as stored."""
    manifest, tensors = _read_packed(Path(folder))
    out = {name: tensors[name].to(dtype) for name in manifest["dense_tensors"]}
    for name in manifest["fp4_tensors"]:
        out[name] = fp4.decode(fp4.from_safetensors_dict(tensors, name), dtype=dtype)
    return out


def verify_packed_roundtrip(folder: str | Path, hf_folder: str | Path | None = None) -> int:
    """Check packed -> bf16 -> packed is bit-identical for every FP4 tensor (and, given an HF
    folder, that its bf16 tensors equal the dequantized ones). Returns the number checked."""
    manifest, tensors = _read_packed(Path(folder))
    hf = load_file(str(Path(hf_folder) / WEIGHTS_FILE)) if hf_folder is not None else None
    for name in manifest["fp4_tensors"]:
        p = fp4.from_safetensors_dict(tensors, name)
        dense = fp4.decode(p, dtype=torch.bfloat16)
        again = fp4.pack(fp4.quantize(dense, p.fmt))
        for a, b in (
            (p.weight_packed, again.weight_packed),
            (p.weight_scale, again.weight_scale),
            (p.weight_global_scale, again.weight_global_scale),
        ):
            if (a is None) != (b is None) or (a is not None and not torch.equal(_bits(a), _bits(b))):
                raise ValueError(f"{name}: packed -> bf16 -> packed is not bit-identical")
        if hf is not None and not torch.equal(_bits(hf[name]), _bits(dense)):
            raise ValueError(f"{name}: the HF folder's bf16 tensor differs from the dequantized packed one")
    return len(manifest["fp4_tensors"])


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor, so comparisons are bitwise (-0.0 vs 0.0, NaN payloads)."""
    return t.contiguous().view(torch.uint8)
