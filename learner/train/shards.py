"""A data-parallel learner's checkpoint folder (torch.distributed.checkpoint) to and from a
one-process learner's weights and AdamW state: the worker count may change between runs
(learner/train/data_parallel.py writes and reads these folders with every rank; learn.py converts)."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch


def write_shards(folder: Path, model_state: dict, optimizer_state: dict, names: list[str]) -> None:
    """A one-process learner's weights and AdamW state_dict (state by parameter index; `names` in
    that order) as a checkpoint folder the replicas load, written by this process alone."""
    import torch.distributed.checkpoint as dcp

    sd = {f"model/{k}": v for k, v in model_state.items()}
    for i, st in optimizer_state["state"].items():
        for field, v in st.items():
            sd[f"optim/{names[i]}/{field}"] = v
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized, assuming ... a single process": meant
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(sd, checkpoint_id=str(folder), no_dist=True)


def read_shards(folder: Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """The inverse, for one process: load a checkpoint folder the replicas wrote into `model` and its
    AdamW (`opt` over model.parameters(), in order; its hyperparameters stay)."""
    import torch.distributed.checkpoint as dcp

    saved = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    sd = {f"model/{k}": v for k, v in model.state_dict().items()}
    sd |= {k: torch.empty(md.size, dtype=md.properties.dtype) for k, md in saved.items() if k.startswith("optim/")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(sd, checkpoint_id=str(folder), no_dist=True)
    index = {name: i for i, (name, _) in enumerate(model.named_parameters())}
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, t in sd.items():
        kind, name, field = (key.split("/") + ["", ""])[:3]
        if kind == "optim":
            state.setdefault(index[name], {})[field] = t
    opt.load_state_dict({"state": state, "param_groups": opt.state_dict()["param_groups"]})
