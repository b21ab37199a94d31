"""Bring your own model: a Hugging Face folder becomes version 0 of the weight store.

    check_base(folder)   what `flywheel base import` refuses, cheapest check first, each a
                         one-line ValueError that says what to do:
                           no config.json; an architecture learner.model does not implement
                           (the message lists those it does); an already-quantized checkpoint;
                           no tokenizer.json; special tokens its own files do not define
                           (learner.formats); shards that model.safetensors.index.json names but
                           the folder lacks; tensors that are not the architecture's
    check_memory(...)    the memory the learner and the replicas would need (`memory_estimate`)
                         against what this machine has; refused with the estimate
    import_base(...)     quantizes the FP4 targets (an MoE's experts by default; configurable)
                         shard by shard into the packed form, stores the model files (config,
                         generation config, tokenizer, base.json) and publishes the weights as
                         version 0, a full snapshot, through learner/publish.py (the one publish
                         path: store, `model_versions` row, `flywheel.versions` message)

Importing the same folder again into the same store changes nothing (version 0 is recorded and
announced again); a store that holds another model is refused.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from learner import fp4
from learner.export import INDEX_FILE, weight_files
from learner.formats import ModelFormat, read_format
from learner.model import FAMILIES, ModelArgs
from learner.store import BASE_FILE, Store

BASE_FORMAT = "flywheel-base/1"
LEARNER_BYTES_PER_PARAM = 28
"""What the learner holds per parameter, all fp32: master weights 4, gradients 4, AdamW's two
moments 8, the reference policy 4, and the gate's two models (stable and candidate) 8."""
REPLICA_BYTES_PER_PARAM = 2  # a vLLM replica's bf16 weights
MODEL_FILE_SUFFIXES = (".json", ".txt", ".model", ".tiktoken", ".jinja")
"""The small files of a model folder the store keeps beside the weights (config, tokenizer, templates)."""


@dataclass(frozen=True)
class BaseInfo:
    """A checked Hugging Face folder."""

    folder: Path
    config: dict
    args: ModelArgs
    format: ModelFormat
    parameters: int
    weight_files: list[Path]


def check_base(folder: str | Path, *, fim: str = "auto") -> BaseInfo:
    """Validate `folder` as a base to import (see the module docstring); ValueError otherwise."""
    folder = Path(folder).expanduser().absolute()
    if not (folder / "config.json").is_file():
        raise ValueError(f"{folder} is not a Hugging Face model folder: it has no config.json")
    config = json.loads((folder / "config.json").read_text())
    arch = (config.get("architectures") or ["?"])[0]
    if arch not in FAMILIES:
        raise ValueError(f"{folder}: architecture {arch} is not supported; supported: {', '.join(FAMILIES)}")
    if q := config.get("quantization_config"):
        raise ValueError(
            f"{folder} is already quantized ({q.get('quant_method', 'quantization_config')}): import the bf16 checkpoint; "
            "Flywheel quantizes the FP4 targets itself"
        )
    args = ModelArgs.from_hf_config(config)
    if not (folder / "tokenizer.json").is_file():
        raise ValueError(
            f"{folder} has no tokenizer.json: download the model's tokenizer files too (or write one with "
            f"transformers: AutoTokenizer.from_pretrained(PATH).save_pretrained(PATH))"
        )
    fmt = read_format(folder, fim=fim)
    files = weight_files(folder)
    return BaseInfo(folder, config, args, fmt, parameter_count(args), files)


def parameter_count(args: ModelArgs) -> int:
    """Parameters of a model of these arguments (counted without allocating it)."""
    import torch

    from learner.model import Transformer

    with torch.device("meta"):
        return Transformer(args).num_params()


def memory_estimate(parameters: int, replicas: int) -> dict[str, int]:
    """Bytes the learner (LEARNER_BYTES_PER_PARAM) and `replicas` vLLM replicas (bf16) need for a
    model of `parameters`, activations and KV caches aside."""
    learner = parameters * LEARNER_BYTES_PER_PARAM
    served = parameters * REPLICA_BYTES_PER_PARAM * replicas
    return {"learner": learner, "replicas": served, "total": learner + served}


def physical_memory() -> int:
    """This machine's memory in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_memory(info: BaseInfo, *, replicas: int, available: int) -> dict[str, int]:
    """The estimate, or ValueError when it exceeds `available` bytes."""
    need = memory_estimate(info.parameters, replicas)
    if need["total"] > available:
        gib = 2**30
        raise ValueError(
            f"{info.args.architecture} with {info.parameters / 1e9:.2f}B parameters needs about {need['total'] / gib:.1f} GiB "
            f"(learner {need['learner'] / gib:.1f} GiB: fp32 weights, gradients, AdamW moments, the reference and the gate's two "
            f"copies, {LEARNER_BYTES_PER_PARAM} bytes a parameter; {replicas} vLLM replica(s) {need['replicas'] / gib:.1f} GiB "
            f"in bf16), more than the {available / gib:.1f} GiB here: use a machine with more memory, or set model.memory_gib "
            "to what the machines that run the learner and the replicas have"
        )
    return need


def fp4_targets(args: ModelArgs, patterns: list[str] | None) -> tuple[str, ...]:
    """The FP4 target patterns: those given, else an MoE's experts (none in a dense model)."""
    if patterns is not None:
        return tuple(patterns)
    return fp4.DEFAULT_FP4_TARGETS if args.moe_layers else ()


def model_files(folder: Path) -> dict[str, bytes]:
    """The small files of the folder the store keeps (MODEL_FILE_SUFFIXES), without the shard index."""
    return {
        p.name: p.read_bytes()
        for p in sorted(folder.iterdir())
        if p.is_file() and p.suffix in MODEL_FILE_SUFFIXES and p.name not in (INDEX_FILE, BASE_FILE)
    }


def pack_base(info: BaseInfo, *, fp4_format: str, patterns: tuple[str, ...]) -> dict:
    """The packed checkpoint of the folder, one shard at a time (peak memory: one shard plus the
    packed result). ValueError when its tensors are not the architecture's."""
    import torch
    from safetensors.torch import load_file

    from learner.model import Transformer
    from learner.store import pack_checkpoint

    with torch.device("meta"):
        want = {n: t.shape for n, t in Transformer(info.args).state_dict().items()}
    packed: dict = {}
    fmt = fp4.get_format(fp4_format) if fp4_format != "off" else fp4.NVFP4
    for f in info.weight_files:
        tensors = load_file(str(f))
        if info.args.tie_embeddings:  # some writers store the tied output layer anyway
            tensors.pop("lm_head.weight", None)
        unexpected = [n for n in tensors if n not in want]
        if unexpected:
            raise ValueError(
                f"{f.name} holds tensors {info.args.architecture} does not have: {', '.join(unexpected[:3])}"
                + (", ..." if len(unexpected) > 3 else "")
            )
        wrong = [n for n, t in tensors.items() if tuple(t.shape) != tuple(want[n])]
        if wrong:
            n = wrong[0]
            raise ValueError(f"{f.name}: {n} is {tuple(tensors[n].shape)}, config.json makes it {tuple(want[n])}")
        packed.update(pack_checkpoint(tensors, fmt, patterns if fp4_format != "off" else ()))
        del tensors
    missing = [n for n in want if n not in packed]
    if missing:
        raise ValueError(
            f"{info.folder}: the weights lack {len(missing)} tensors of {info.args.architecture} "
            f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})"
        )
    return packed


def base_record(info: BaseInfo, *, fp4_format: str, patterns: tuple[str, ...]) -> dict:
    """What `base.json` says about an imported folder."""
    return {
        "format": BASE_FORMAT,
        "kind": "imported",
        "source": str(info.folder),
        "architecture": info.args.architecture,
        "parameters": info.parameters,
        "fp4_format": fp4_format if fp4_format != "off" and patterns else None,  # None: nothing in FP4
        "fp4_targets": list(patterns) if fp4_format != "off" else [],
        "fim": info.format.fim.name if info.format.fim else None,
        "window": info.format.window,
        "imported_at": datetime.now(UTC).isoformat(),
        "start_version": 0,
    }


def import_base(
    info: BaseInfo,
    store: Store,
    *,
    engine,
    producer,
    fp4_format: str = "nvfp4",
    patterns: list[str] | None = None,
) -> tuple[dict, bool]:
    """Make the checked folder version 0 of `store` (see the module docstring): (base.json, whether
    it published; False when the store held this very import already). ValueError when the store
    holds another model."""
    from learner import delta as codec
    from learner.publish import publish_version

    targets = fp4_targets(info.args, patterns)
    existing = store.base()
    if existing is not None and existing.get("source") != str(info.folder):
        raise ValueError(
            f"the weight store {store.uri()} holds another model ({existing.get('kind')}: {existing.get('source')}); "
            "import into a fresh data_dir"
        )
    packed = pack_base(info, fp4_format=fp4_format, patterns=targets)
    stable = store.versions()
    if stable and not (stable[0] == 0 and store.hashes(0) == codec.tensor_hashes(packed, store.hash_algorithm(0))):
        raise ValueError(
            f"the weight store {store.uri()} already holds versions {stable[-3:]} of other weights; import into a fresh data_dir"
        )
    if existing is None:
        record = base_record(info, fp4_format=fp4_format, patterns=targets)
        store.write_model_files(model_files(info.folder) | {BASE_FILE: (json.dumps(record, indent=1) + "\n").encode()})
    else:
        record = existing
    publish_version(
        store,
        None if stable else packed,  # stored already: record and announce it again
        parent=None,
        version=0,
        engine=engine,
        producer=producer,
        gate_passed=True,
        gate_reason=f"imported base: {info.folder.name} ({info.args.architecture})",
    )
    return record, not stable


def ensure_imported(
    model, store: Store, *, engine, producer, replicas: int, available: int | None = None
) -> tuple[dict, bool]:
    """The store's base.json for `model` (a ModelSection whose `base` is set), importing the folder
    first when the store has no model yet (after `check_base` and `check_memory` with `replicas`
    replicas beside the learner). (base.json, whether this call published version 0.)
    ValueError when the store holds another model or a check refuses."""
    source = Path(model.base).expanduser().absolute()
    existing = store.base()
    if existing is not None:
        if existing.get("source") != str(source):
            raise ValueError(
                f"model.base is {source}, but the weight store {store.uri()} holds {existing.get('kind')} "
                f"{existing.get('source')}: use a fresh data_dir for another model"
            )
        return existing, False
    info = check_base(source, fim=model.fim)
    memory = available if available is not None else int(model.memory_gib * 2**30) if model.memory_gib else None
    check_memory(info, replicas=replicas, available=memory if memory is not None else physical_memory())
    return import_base(info, store, engine=engine, producer=producer, fp4_format=model.fp4, patterns=model.fp4_targets)
