"""The folder replicas load: the weight store's version of the model, never an unrelated folder.

    the store has model files   the store's `serve.model_version` (0 by default), exported to
    (learner/store.py "model/") <data_dir>/served/v<N>/ (or serve.replica_dir's) by
                                learner.store.export_version (kept
                                while it still holds that version), by `flywheel serve` and again
                                by each replica on its own machine (`replica_model_folder`);
                                a `serve.model_dir` set as
                                well must hold exactly that version's weights, else serving
                                refuses to start
    model.base set, store empty serving refuses: `flywheel base import` it first
    otherwise                   None: the caller serves `serve.model_dir` or Flywheel's pretrained
                                base (the learner publishes that as v0 when it starts: the same
                                tensors, and then the store's model files)

The replicas then swap to their pool's targets from there (serving/hotswap.py), and their first
swap sends only what changed: the folder holds exactly a stored version.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from feedback.core.errors import UserError
from serving.settings import ServingSettings

REPLICA_DIR_ENV = "FLYWHEEL_SERVE__REPLICA_DIR"
"""A node's own `serve.replica_dir`, read by the replicas on that node (`node_settings`)."""


def store_model_folder(s: ServingSettings) -> Path | None:
    """The exported folder of the store's version to serve, or None (see the module docstring)."""
    from learner import store as S

    store = S.settings_store(s)
    base = store.base()
    if base is None:
        if s.model.base is not None:
            raise UserError(
                f"model.base is {s.model.base} but the weight store {store.uri()} holds no imported model: "
                f"run `flywheel base import {s.model.base}` first (or `flywheel learn`, which imports it)"
            )
        return None
    if s.model.base is not None and base.get("source") != str(Path(s.model.base).expanduser().absolute()):
        raise UserError(
            f"model.base is {s.model.base}, but the weight store {store.uri()} holds {base.get('kind')} {base.get('source')}: "
            "use the data_dir of that import"
        )
    version = s.serve.model_version
    if version not in store.versions():
        raise UserError(
            f"serve.model_version {version} is not in the weight store {store.uri()} ({store.versions()[-5:]})"
        )
    if s.serve.model_dir is not None:
        if not same_weights(Path(s.serve.model_dir), store, version):
            raise UserError(
                f"serve.model_dir {s.serve.model_dir} is not v{version} of the weight store {store.uri()} "
                f"({base.get('kind')} {base.get('source')}): unset serve.model_dir to serve the store's version"
            )
        return Path(s.serve.model_dir)
    return S.export_version(store, version, served_folder(s, version))


def served_folder(s: ServingSettings, version: int) -> Path:
    """Where this machine keeps its export of the store's `version`: `<serve.replica_dir or
    data_dir>/served/v<N>/`."""
    root = s.serve.replica_dir if s.serve.replica_dir is not None else s.data_dir
    return Path(root).expanduser() / "served" / f"v{version:06d}"


def node_settings(s: ServingSettings, environ: Mapping[str, str] = os.environ) -> ServingSettings:
    """The settings a replica uses for its own files on the node it runs on: `serve.replica_dir`
    from this node's environment (REPLICA_DIR_ENV, as `ray start` passed it to Ray's workers)
    when set there, else as configured; when there is one, the replica's weight-store payload
    cache is its `store/` folder. `s` itself is resolved where `flywheel serve` ran."""
    raw = environ.get(REPLICA_DIR_ENV, "").strip()
    replica_dir = Path(raw).expanduser() if raw else s.serve.replica_dir
    if replica_dir is None:
        return s
    return s.model_copy(
        update={
            "serve": s.serve.model_copy(update={"replica_dir": replica_dir}),
            "store": s.store.model_copy(update={"cache_dir": replica_dir / "store"}),
        }
    )


def replica_model_folder(s: ServingSettings, store, version: int, model_dir: str | Path, node: ServingSettings) -> Path:
    """The folder a replica loads, on its own machine. When `flywheel serve` exported `version`
    from the store (`store_model_folder`, into `served_folder(s, ...)`), the replica exports it
    again from the store into its own node's folder (`served_folder(node, ...)`, `node` from
    `node_settings`; a no-op where that folder holds it already, as on the machine that ran
    `flywheel serve`), so no replica reads a path that only exists on another machine. Any other
    `model_dir` (serve.model_dir, the cached base) is the operator's, used as given."""
    from learner.store import export_version

    if s.serve.model_dir is not None or Path(model_dir) != served_folder(s, version):
        return Path(model_dir)
    return export_version(store, version, served_folder(node, version))


def same_weights(folder: Path, store, version: int) -> bool:
    """Whether `folder` holds exactly `version`'s bf16 tensors (as vLLM would load them)."""
    import torch

    from learner.export import read_hf_tensors
    from learner.store import to_hf_tensors

    try:
        loaded = read_hf_tensors(folder)
    except (OSError, ValueError):
        return False
    stored = to_hf_tensors(store.materialize(version))
    return loaded.keys() == stored.keys() and all(
        loaded[k].dtype == stored[k].dtype and torch.equal(loaded[k], stored[k]) for k in stored
    )
