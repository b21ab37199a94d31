"""The weight store: published model versions as full snapshots and XOR deltas, STABLE last.

The learner publishes, serving replicas read; both use this module and learner.delta, so
there is one codec. A store lives at a URI; `file://` (or a plain path) is the local
implementation, and `Store` names the few primitives an object store would implement.

One folder per version:

    v000007/
        manifest.json       see `FORMAT` below; per-tensor sha256 of the whole checkpoint
        delta.zst           learner.delta's wire form against `parent` (every version with a parent)
        full.safetensors    the packed checkpoint (kind "full": no parent, a changed layout, or every
                            `full_every` versions), in the packed artifact's layout (learner.export):
                            FP4 targets as compressed-tensors {module}.weight_packed / .weight_scale /
                            .weight_global_scale, every other tensor bf16 under its checkpoint name
        STABLE              written last; holds the manifest's sha256

A full version keeps its delta too, so a replica one version behind always fetches a delta;
the full snapshots only bound how far back a cold reader must go (`materialize`, `plan`).

Beside the versions, `model/` holds the files every version shares: config.json,
generation_config.json, the tokenizer files and `base.json` (where version 0 came from: an
imported Hugging Face folder or Flywheel's pretrained base, its FP4 format and targets, the
version the learner starts from). It is written once, before version 0, and read by serving
(`export_version` writes a folder vLLM loads) and the learner, so both serve and train the
model the store holds, never an unrelated folder.

Publishing writes every file into a temporary folder, fsyncs them, renames the folder into
place, then writes STABLE (temp file, fsync, rename). Readers list only versions with
STABLE, so a crash at any point leaves nothing half-written visible; the next publish of
that number replaces the leftover folder. Any number of processes read.

Writers take the store's publish lock (`_exclusive`: an flock on `.publish.lock` in the local
store's folder) for a whole publish and for cleanup, and decide the version number under it.
Two learners pointed at one store by mistake therefore never write the same version: without
an explicit number each takes the next free one; with one (v0, a recovered version), the
second finds it taken and gets a StoreError, having touched nothing. The lock is released by
the kernel when its holder dies, so a crashed publisher never blocks the next, and the
unmarked folder it left is a leftover only the lock holder may replace. Cleanup under the same
lock never mistakes a publish in progress for a leftover.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Protocol
from urllib.parse import unquote, urlparse

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from feedback.core.files import PRIVATE_DIR, PRIVATE_FILE, open_private, private_dir
from feedback.schemas import ModelVersion
from learner import delta as codec
from learner import fp4

log = logging.getLogger(__name__)

MANIFEST, STABLE, DELTA_FILE, FULL_FILE = "manifest.json", "STABLE", "delta.zst", "full.safetensors"
MODEL_DIR, BASE_FILE, EXPORT_MARKER = "model", "base.json", "FLYWHEEL_VERSION"
LOCK_FILE = ".publish.lock"
FORMAT = "flywheel-weight-store/1"
DESCRIPTION = (
    "One folder per version. manifest.json: version, parent, kind (full|delta), base_version (the parent the "
    "delta applies to), created_at, fp4_format, digest (sha256 of the sorted name\\tsha256 lines), chain_length "
    "(deltas since the last full snapshot), tensors {name: {sha256 (learner.delta.tensor_sha256), kind fp4|dense, "
    "shape, dtype, nbytes}}, full_size_bytes (raw tensor bytes), files {delta|full: {name, sha256, size}}. "
    "delta.zst: learner.delta wire form (XOR of packed bytes per changed tensor, changed-element mask + byte "
    "planes, zstd). full.safetensors: compressed-tensors nvfp4/mxfp4-pack-quantized layout for FP4 targets, "
    "bf16 for the rest. STABLE, written last, holds the sha256 of manifest.json."
)
_VERSION_DIR = re.compile(r"^v(\d{6,})$")


# --- the packed checkpoint (pure) ----------------------------------------------------------------


def pack_checkpoint(
    state: Mapping[str, torch.Tensor],
    fmt: fp4.FP4Format | str = fp4.NVFP4,
    patterns: Sequence[str] = fp4.DEFAULT_FP4_TARGETS,
) -> dict[str, codec.Entry]:
    """A model's state dict (checkpoint names, e.g. fp32 master weights) in packed form: FP4
    targets quantized from fp32 and packed exactly as learner.export does, the rest bf16."""
    fmt = fp4.get_format(fmt)
    out: dict[str, codec.Entry] = {}
    for name, t in state.items():
        t = t.detach().to("cpu")
        if fp4.is_fp4_target(name, patterns):
            # dtype: what the tensor is served as (the layout does not store it; see fp4.from_safetensors_dict)
            out[name] = dataclasses.replace(fp4.pack(fp4.quantize(t.float(), fmt)), dtype=torch.bfloat16)
        else:
            out[name] = t.to(torch.bfloat16).contiguous()
    return out


def to_hf_tensors(packed: Mapping[str, codec.Entry], names: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
    """The bf16 tensors vLLM loads (checkpoint names): FP4 targets dequantized (exact in bf16).
    `names` restricts it to some tensors, e.g. the ones a swap changed."""
    out = {}
    for name in packed if names is None else names:
        e = packed[name]
        out[name] = fp4.decode(e, torch.bfloat16) if isinstance(e, fp4.PackedTensor) else e.to(torch.bfloat16)
    return out


def to_safetensors(packed: Mapping[str, codec.Entry]) -> dict[str, torch.Tensor]:
    """The tensors of the packed artifact's safetensors file (learner.export's layout)."""
    out: dict[str, torch.Tensor] = {}
    for name, e in packed.items():
        out.update(fp4.to_safetensors_dict(name, e) if isinstance(e, fp4.PackedTensor) else {name: e.contiguous()})
    return out


def from_safetensors(
    tensors: Mapping[str, torch.Tensor], fp4_names: Sequence[str], dense_names: Sequence[str]
) -> dict[str, codec.Entry]:
    """Inverse of to_safetensors, given which names are FP4 (a manifest lists them)."""
    out: dict[str, codec.Entry] = {name: fp4.from_safetensors_dict(tensors, name) for name in fp4_names}
    out.update({name: tensors[name] for name in dense_names})
    return out


def load_packed_artifact(folder: str | Path) -> dict[str, codec.Entry]:
    """The packed checkpoint of a packed FP4 artifact folder (learner.export.export_packed_fp4,
    e.g. the pretrained base's `fp4/`), to publish it as version 0."""
    from learner.export import MANIFEST_FILE

    folder = Path(folder)
    manifest = json.loads((folder / MANIFEST_FILE).read_text())
    data = (folder / manifest["file"]).read_bytes()
    if hashlib.sha256(data).hexdigest() != manifest["sha256"]:
        raise ValueError(f"{folder / manifest['file']}: sha256 does not match its manifest; re-export the artifact")
    return from_safetensors(st_load(data), list(manifest["fp4_tensors"]), list(manifest["dense_tensors"]))


def _fp4_format(packed: Mapping[str, codec.Entry]) -> str | None:
    names = {e.fmt.name for e in packed.values() if isinstance(e, fp4.PackedTensor)}
    return ",".join(sorted(names)) or None


# --- planning what to fetch ---------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """How to reach `target`: start from `have` (held in memory) or from the full snapshot of
    version `full`, then apply the deltas of `deltas` in order. `nbytes`: payload to fetch."""

    target: int
    have: int | None
    full: int | None
    deltas: tuple[int, ...]
    nbytes: int


class StoreError(ValueError):
    """A version that is not in the store, or that cannot be reached from what is there."""


@dataclass
class _Materialized:
    version: int
    ckpt: dict[str, codec.Entry]
    hashes: dict[str, str]


class Producer(Protocol):
    def send(self, topic: str, msg) -> object: ...


# --- the store --------------------------------------------------------------------------------


class Store(ABC):
    """A weight store. Subclasses implement the storage primitives (the `_`-methods); the
    publishing protocol, planning, verification and retention live here, once."""

    def __init__(
        self, *, full_every: int = 8, zstd_level: int = 3, zstd_threads: int = -1, lock_timeout_s: float = 600.0
    ):
        """`lock_timeout_s`: how long a publish or cleanup waits for another writer's (see the
        module docstring) before it gives up with a StoreError."""
        if full_every < 1:
            raise ValueError(f"full_every must be at least 1, got {full_every}")
        self.full_every = full_every
        self.zstd_level = zstd_level
        self.zstd_threads = zstd_threads
        self.lock_timeout_s = lock_timeout_s
        self._manifests: dict[int, tuple[dict, str]] = {}  # versions are immutable once STABLE
        self._cache: _Materialized | None = None
        self._lock = threading.RLock()
        self._writing = 0  # depth of this object's hold on the publish lock

    # storage primitives --------------------------------------------------------------------
    @abstractmethod
    def uri(self, version: int | None = None) -> str:
        """The store's URI, or one version's."""

    @abstractmethod
    def _stable(self) -> list[int]:
        """Versions whose STABLE marker exists, ascending."""

    @abstractmethod
    def _read(self, version: int, name: str) -> bytes: ...

    @abstractmethod
    def _write_version(self, version: int, files: Mapping[str, bytes], marker: bytes) -> None:
        """Make `files` visible as `version`, atomically, then write STABLE = `marker` last."""

    @abstractmethod
    def _delete(self, version: int) -> None:
        """Remove STABLE first (readers stop seeing the version), then the rest."""

    def _remove_debris(self) -> list[str]:
        """Remove what crashed publishes left (temporary and unmarked folders)."""
        return []

    @abstractmethod
    def _exclusive_lock(self) -> contextlib.AbstractContextManager:
        """Hold the store's publish lock for the block, across processes and hosts that share the
        store; released even if the holder dies. StoreError after `lock_timeout_s`."""

    @contextlib.contextmanager
    def _writer(self) -> Iterator[None]:
        """This object's exclusive right to write the store (reentrant within the object)."""
        with self._lock:
            if self._writing:
                self._writing += 1
                try:
                    yield
                finally:
                    self._writing -= 1
                return
            with self._exclusive_lock():
                self._writing = 1
                try:
                    yield
                finally:
                    self._writing = 0

    @abstractmethod
    def _write_model(self, files: Mapping[str, bytes]) -> None:
        """Make `files` visible as the model files, atomically (replacing any)."""

    @abstractmethod
    def _read_model(self) -> dict[str, bytes]:
        """The model files, {} when there are none."""

    # the model files ---------------------------------------------------------------------------
    def write_model_files(self, files: Mapping[str, bytes]) -> None:
        """Store the files every version shares (see the module docstring); `base.json` among them.
        Before version 0 only: afterwards they describe published weights and never change,
        except `base.json` through `update_base`."""
        if BASE_FILE not in files:
            raise ValueError(f"the model files need a {BASE_FILE}")
        with self._writer():
            if self._stable():
                raise StoreError(f"the weight store {self.uri()} holds versions already: its model files are fixed")
            self._write_model(files)

    def model_files(self) -> dict[str, bytes]:
        return self._read_model()

    def base(self) -> dict | None:
        """`base.json`: what version 0 is (None for a store without model files)."""
        raw = self._read_model().get(BASE_FILE)
        return json.loads(raw) if raw is not None else None

    def update_base(self, **fields) -> dict:
        """Change fields of `base.json` (the learner's start version after continued pretraining)."""
        with self._writer():
            files = self._read_model()
            if BASE_FILE not in files:
                raise StoreError(f"the weight store {self.uri()} has no {BASE_FILE}")
            base = json.loads(files[BASE_FILE]) | fields
            self._write_model(files | {BASE_FILE: (json.dumps(base, indent=1) + "\n").encode()})
            return base

    # reading ---------------------------------------------------------------------------------
    def versions(self) -> list[int]:
        return self._stable()

    def latest(self) -> int | None:
        v = self._stable()
        return v[-1] if v else None

    def manifest(self, version: int) -> dict:
        return self._manifest(version)[0]

    def _manifest(self, version: int) -> tuple[dict, str]:
        if version not in self._manifests:
            if version not in self._stable():
                raise StoreError(f"version {version} is not in the store {self.uri()} (stable: {self._stable()[-5:]})")
            raw, marker = self._read(version, MANIFEST), self._read(version, STABLE).decode().strip()
            sha = hashlib.sha256(raw).hexdigest()
            if sha != marker:
                raise codec.DeltaError(
                    f"version {version}: manifest.json sha256 {sha[:12]} is not the STABLE marker's {marker[:12]} (corrupt)"
                )
            self._manifests[version] = (json.loads(raw), sha)
        return self._manifests[version]

    def _payload(self, version: int, kind: str) -> bytes:
        info = self.manifest(version)["files"][kind]
        data = self._read(version, info["name"])
        if hashlib.sha256(data).hexdigest() != info["sha256"]:
            raise codec.DeltaError(
                f"version {version}: {info['name']} does not match the sha256 in its manifest (corrupt file)"
            )
        return data

    def plan(self, target: int, have: int | None = None) -> Plan:
        """The cheapest way to `target` in bytes fetched: the deltas after `have` (a version the
        caller holds), or the nearest full snapshot back along target's chain plus the deltas
        after it. `have` counts only if it is an ancestor of `target`."""
        stable = set(self._stable())
        if target not in stable:
            raise StoreError(f"version {target} is not in the store {self.uri()} (stable: {sorted(stable)[-5:]})")
        v, after, cost, full_plan = target, [], 0, None
        while True:
            if v == have:
                return min(
                    (p for p in (full_plan, Plan(target, have, None, tuple(reversed(after)), cost)) if p),
                    key=lambda p: p.nbytes,
                )
            if v not in stable:
                break
            m = self.manifest(v)
            files = m["files"]
            if "full" in files and full_plan is None:
                full_plan = Plan(target, None, v, tuple(reversed(after)), cost + files["full"]["size"])
                if have is None or have > v:
                    break
            if "delta" not in files or (full_plan is not None and cost + files["delta"]["size"] >= full_plan.nbytes):
                break
            after.append(v)
            cost += files["delta"]["size"]
            v = m["parent"]
        if full_plan is None:
            raise StoreError(f"version {target} cannot be reached: no full snapshot left on its chain")
        return full_plan

    def fetch(
        self, plan: Plan, base: Mapping[str, codec.Entry] | None = None, base_hashes: Mapping[str, str] | None = None
    ) -> tuple[dict[str, codec.Entry], dict[str, str]]:
        """Carry out `plan`: the target's packed checkpoint and its (verified) sha256 table.
        `base` is the checkpoint of `plan.have` when the plan starts there. Raises DeltaError
        on any corruption or mismatch; nothing the caller holds is modified."""
        if plan.full is not None:
            ckpt, hashes = self._load_full(plan.full)
            prev = plan.full
        else:
            if base is None:
                raise ValueError(f"the plan starts from version {plan.have}: pass its checkpoint as base")
            ckpt, hashes, prev = (
                dict(base),
                dict(base_hashes) if base_hashes is not None else codec.tensor_hashes(base),
                plan.have,
            )
        for v in plan.deltas:
            d = codec.decode(self._payload(v, "delta"))
            if d.version != v or d.base_version != prev:
                raise codec.DeltaError(
                    f"version {v}: its delta goes from {d.base_version} to {d.version}, expected {prev} -> {v}"
                )
            ckpt = codec.apply(ckpt, d, base_hashes=hashes)
            hashes, prev = d.new_hashes(hashes), v
        expected = {n: t["sha256"] for n, t in self.manifest(plan.target)["tensors"].items()}
        if hashes != expected:
            raise codec.DeltaError(f"version {plan.target}: the result's tensor checksums differ from its manifest")
        return ckpt, hashes

    def _load_full(self, version: int) -> tuple[dict[str, codec.Entry], dict[str, str]]:
        m = self.manifest(version)
        tensors = st_load(self._payload(version, "full"))
        kinds = {n: t["kind"] for n, t in m["tensors"].items()}
        ckpt = from_safetensors(
            tensors, [n for n, k in kinds.items() if k == "fp4"], [n for n, k in kinds.items() if k == "dense"]
        )
        hashes = codec.tensor_hashes(ckpt)
        bad = [n for n in hashes if hashes[n] != m["tensors"][n]["sha256"]]
        if bad:
            raise codec.DeltaError(
                f"version {version}: full snapshot tensors do not match their manifest checksums: {bad[:3]}"
            )
        return ckpt, hashes

    def materialize(self, version: int) -> dict[str, codec.Entry]:
        """The packed checkpoint of `version`, verified. The latest materialized state stays in
        memory, so walking forward costs one delta per version. Treat the tensors as read-only."""
        with self._lock:
            c = self._cache
            if c is None or c.version != version:
                plan = self.plan(version, have=c.version if c is not None else None)
                ckpt, hashes = self.fetch(plan, c.ckpt if c is not None else None, c.hashes if c is not None else None)
                self._cache = c = _Materialized(version, ckpt, hashes)
            return dict(c.ckpt)

    def verify(self, version: int) -> None:
        """Read `version` back from storage and check it end to end, trusting nothing in memory: its
        manifest against the sha256 in STABLE, each of its files against the manifest, and the
        checkpoint rebuilt from the nearest full snapshot against every tensor checksum. Raises
        DeltaError if anything is corrupt, StoreError if it is missing or unreachable."""
        with self._lock:
            self._manifests.pop(version, None)
            for kind in self.manifest(version)["files"]:
                self._payload(version, kind)
            self.fetch(self.plan(version))

    def hashes(self, version: int) -> dict[str, str]:
        return {n: t["sha256"] for n, t in self.manifest(version)["tensors"].items()}

    # publishing ------------------------------------------------------------------------------
    def publish(
        self, ckpt: Mapping[str, codec.Entry], parent: int | None, *, version: int | None = None
    ) -> ModelVersion:
        """Write `ckpt` as the next version (or `version`): a delta against `parent`, plus a
        full snapshot when there is no parent, the layout changed, or `full_every` versions
        have passed since the last one. Returns the ModelVersion to announce (gate fields at
        their defaults). The store keeps references to `ckpt`'s tensors: do not modify them.
        StoreError if `version` is taken (another publisher wrote it) or not newer than the latest."""
        with self._writer():
            stable = self._stable()
            version = version if version is not None else (stable[-1] + 1 if stable else 0)
            if version in stable:
                raise StoreError(
                    f"version {version} is already in the store {self.uri()}: another publisher wrote it "
                    "(is a second learner using this store?); nothing was written"
                )
            if stable and version <= stable[-1]:
                raise StoreError(f"version {version} is not newer than the latest stable version {stable[-1]}")
            if parent is not None and parent not in stable:
                raise StoreError(f"parent {parent} is not in the store {self.uri()}")
            ckpt = dict(ckpt)
            hashes = codec.tensor_hashes(ckpt)
            files: dict[str, bytes] = {}
            info: dict = {}
            full_reason = "no parent" if parent is None else None
            chain_length = 0
            if parent is not None:
                base = self.materialize(parent)
                same_layout = set(base) == set(ckpt) and all(
                    codec.layout(base[n]) == codec.layout(ckpt[n]) for n in ckpt
                )
                if same_layout:
                    d = codec.diff(
                        base,
                        ckpt,
                        base_version=parent,
                        version=version,
                        old_hashes=self._cache.hashes,
                        new_hashes=hashes,
                    )
                    files[DELTA_FILE] = codec.encode(d, level=self.zstd_level, threads=self.zstd_threads)
                    info["changed_tensors"], info["xor_nbytes"] = len(d.changed), d.xor_nbytes
                    chain_length = self.manifest(parent)["chain_length"] + 1
                    if chain_length >= self.full_every:
                        full_reason = f"full snapshot every {self.full_every} versions"
                else:
                    full_reason = "the tensor layout changed"
            if full_reason is not None:
                chain_length = 0
                files[FULL_FILE] = st_save(
                    to_safetensors(ckpt), metadata={"format": "pt", "fp4_format": _fp4_format(ckpt) or ""}
                )
            manifest = self._manifest_for(version, parent, ckpt, hashes, files, full_reason, chain_length, info)
            raw = (json.dumps(manifest, indent=1) + "\n").encode()
            files[MANIFEST] = raw
            sha = hashlib.sha256(raw).hexdigest()
            self._write_version(version, files, (sha + "\n").encode())
            self._manifests[version] = (manifest, sha)
            self._cache = _Materialized(version, ckpt, hashes)
            log.info(
                "published v%d (%s, %s) to %s", version, manifest["kind"], full_reason or "delta", self.uri(version)
            )
            return self.model_version(version)

    def _manifest_for(self, version, parent, ckpt, hashes, files, full_reason, chain_length, info) -> dict:
        file_info = {
            kind: {"name": name, "sha256": hashlib.sha256(files[name]).hexdigest(), "size": len(files[name])}
            for kind, name in (("delta", DELTA_FILE), ("full", FULL_FILE))
            if name in files
        }
        return {
            "format": FORMAT,
            "description": DESCRIPTION,
            "version": version,
            "parent": parent,
            "kind": "full" if full_reason else "delta",
            "full_reason": full_reason,
            "base_version": parent if DELTA_FILE in files else None,
            "created_at": datetime.now(UTC).isoformat(),
            "fp4_format": _fp4_format(ckpt),
            "digest": codec.checkpoint_digest(hashes),
            "chain_length": chain_length,
            "full_size_bytes": codec.checkpoint_nbytes(ckpt),
            "files": file_info,
            "delta_stats": info,
            "tensors": {
                n: {
                    "sha256": hashes[n],
                    "kind": codec.layout(e)["kind"],
                    "shape": list(e.shape),
                    "dtype": str(e.dtype).removeprefix("torch."),
                    "nbytes": sum(p.numel() * p.element_size() for p in codec.parts(e)),
                }
                for n, e in sorted(ckpt.items())
            },
        }

    def model_version(self, version: int, **gate) -> ModelVersion:
        """The `flywheel.versions` message of a stored version. `gate`: gate_passed, gate_reason, metrics."""
        m, sha = self._manifest(version)
        files = m["files"]
        fetched = files.get("delta") or files["full"]  # what a replica on the parent fetches
        return ModelVersion(
            version=version,
            parent=m["parent"],
            kind=m["kind"],
            uri=self.uri(version),
            sha256=sha,
            size_bytes=fetched["size"],
            full_size_bytes=m["full_size_bytes"],
            created_at=datetime.fromisoformat(m["created_at"]),
            **gate,
        )

    # retention -------------------------------------------------------------------------------
    def cleanup(self, keep: int, protect: Iterable[int] = ()) -> list[int]:
        """Delete stable versions beyond the newest `keep`, except the versions in `protect` (what
        serving needs: learner.publish.cleanup) and what the chains of both back to a full
        snapshot need; also remove leftovers of crashed publishes. Returns the deleted versions."""
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        with self._writer():
            stable = self._stable()
            needed: set[int] = set()
            for v in [*stable[-keep:], *(p for p in set(protect) if p in stable)]:
                while v is not None and v not in needed:
                    needed.add(v)
                    m = self.manifest(v)
                    v = None if "full" in m["files"] else m["parent"]
            doomed = [v for v in stable if v not in needed]
            for v in doomed:
                self._delete(v)
                self._manifests.pop(v, None)
            debris = self._remove_debris()
            if doomed or debris:
                log.info("store cleanup: deleted versions %s and %d leftover folder(s)", doomed, len(debris))
            return doomed


class LocalStore(Store):
    """A store in a local folder (`file://` URIs)."""

    def __init__(self, root: str | Path, **opts):
        super().__init__(**opts)
        self.root = private_dir(Path(root).expanduser().absolute())

    @contextlib.contextmanager
    def _exclusive_lock(self) -> Iterator[None]:
        fd = os.open(self.root / LOCK_FILE, os.O_RDWR | os.O_CREAT, PRIVATE_FILE)
        try:
            deadline = time.monotonic() + self.lock_timeout_s
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
                        raise StoreError(
                            f"the weight store {self.uri()} is being written by another process ({holder}) "
                            f"for over {self.lock_timeout_s:g} s; is a second learner using it?"
                        ) from None
                    time.sleep(0.05)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
            yield
        finally:
            os.close(fd)  # releases the lock

    def publishing(self) -> str | None:
        """Who holds the publish lock right now (its "pid N on host" line), or None when nobody does.
        A probe, for tools that watch the store: it takes the lock for an instant when it is free."""
        fd = os.open(self.root / LOCK_FILE, os.O_RDWR | os.O_CREAT, PRIVATE_FILE)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
            return None
        finally:
            os.close(fd)  # releases the lock if this probe took it

    def uri(self, version: int | None = None) -> str:
        return (self.root if version is None else self._dir(version)).as_uri()

    def _dir(self, version: int) -> Path:
        return self.root / f"v{version:06d}"

    def _stable(self) -> list[int]:
        out = []
        for p in self.root.iterdir():
            m = _VERSION_DIR.match(p.name)
            if m and (p / STABLE).is_file():
                out.append(int(m.group(1)))
        return sorted(out)

    def _read(self, version: int, name: str) -> bytes:
        try:
            return (self._dir(version) / name).read_bytes()
        except FileNotFoundError:
            raise StoreError(f"version {version}: {name} is missing from {self._dir(version)}") from None

    def _write_version(self, version: int, files: Mapping[str, bytes], marker: bytes) -> None:
        assert self._writing, "publish holds the store's lock"
        tmp = self.root / f".tmp-v{version:06d}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir(mode=PRIVATE_DIR)
        os.chmod(tmp, PRIVATE_DIR)
        try:
            for name, data in files.items():
                _write_synced(tmp / name, data)
            _fsync_dir(tmp)
            final = self._dir(version)
            if (final / STABLE).exists():  # publish checked under the lock; never remove a version
                raise StoreError(f"version {version} appeared in {self.root} while this process held its lock")
            if final.exists():  # an unmarked folder a crashed publish left: its writer is gone (we hold the lock)
                shutil.rmtree(final)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _fsync_dir(self.root)
        _write_synced(final / (STABLE + ".tmp"), marker)
        os.rename(final / (STABLE + ".tmp"), final / STABLE)
        _fsync_dir(final)

    def _delete(self, version: int) -> None:
        d = self._dir(version)
        (d / STABLE).unlink(missing_ok=True)
        _fsync_dir(d)
        shutil.rmtree(d, ignore_errors=True)

    def _remove_debris(self) -> list[str]:
        gone = []
        for p in self.root.iterdir():
            if p.is_dir() and (
                p.name.startswith(".tmp-v") or (_VERSION_DIR.match(p.name) and not (p / STABLE).is_file())
            ):
                shutil.rmtree(p, ignore_errors=True)
                gone.append(p.name)
        return gone

    def _write_model(self, files: Mapping[str, bytes]) -> None:
        # Each file lands whole (temp file, fsync, rename); base.json goes last, so model files
        # without it are an import that did not finish.
        folder = self.root / MODEL_DIR
        folder.mkdir(mode=PRIVATE_DIR, exist_ok=True)
        for name in sorted(files, key=lambda n: n == BASE_FILE):
            _write_synced(folder / (name + ".tmp"), files[name])
            os.rename(folder / (name + ".tmp"), folder / name)
        _fsync_dir(folder)

    def _read_model(self) -> dict[str, bytes]:
        folder = self.root / MODEL_DIR
        if not (folder / BASE_FILE).is_file():
            return {}
        return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file() and not p.name.endswith(".tmp")}


def _write_synced(path: Path, data: bytes) -> None:
    with open_private(path) as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def export_version(store: Store, version: int, folder: str | Path) -> Path:
    """A Hugging Face folder of `version` that vLLM and transformers load: the store's model files
    and `model.safetensors` with the bf16 tensors (FP4 targets dequantized, exact). A folder that
    already holds exactly that version (its marker names the version's digest) is reused."""
    from safetensors.torch import save_file

    folder = Path(folder)
    digest = store.manifest(version)["digest"]
    marker = folder / EXPORT_MARKER
    if marker.is_file() and marker.read_text().strip() == f"{version} {digest}":
        return folder
    files = store.model_files()
    if not files:
        raise StoreError(
            f"the weight store {store.uri()} has no model files (config.json, tokenizer): nothing to export"
        )
    tmp = folder.with_name(f".{folder.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir(parents=True, mode=PRIVATE_DIR)
    try:
        for name, data in files.items():
            if name != BASE_FILE:
                (tmp / name).write_bytes(data)
        save_file(to_hf_tensors(store.materialize(version)), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / EXPORT_MARKER).write_text(f"{version} {digest}\n")
        if folder.exists():
            shutil.rmtree(folder)
        os.rename(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def open_store(uri: str | Path, **opts) -> Store:
    """The store at `uri`: `file:///abs/path` or a plain path. `opts`: full_every, zstd_level, zstd_threads."""
    s = str(uri)
    parsed = urlparse(s)
    if parsed.scheme == "file":
        return LocalStore(unquote(parsed.path), **opts)
    if parsed.scheme in ("", None) or re.match(r"^[A-Za-z]:[\\/]", s):
        return LocalStore(s, **opts)
    raise ValueError(
        f"weight store URI {s!r}: only file:// (or a local path) is supported so far; object stores are not implemented yet"
    )


def default_store_uri(settings) -> str:
    """`<data_dir>/weights` of a FlywheelSettings, as a file:// URI (published versions are state, not cache)."""
    return (Path(settings.data_dir).expanduser().absolute() / "weights").as_uri()


# --- announcing ----------------------------------------------------------------------------------


def announce(msg: ModelVersion, producer: Producer) -> ModelVersion:
    """Send a published version to `flywheel.versions` (after its STABLE marker: `publish` returns
    only then). `producer`: feedback.producer.BufferedProducer or anything with send(topic, msg)."""
    from feedback import bus

    producer.send(bus.VERSIONS, msg)
    return msg


def record(msg: ModelVersion, engine) -> None:
    """Upsert a version into the `model_versions` table (a re-record updates gate and metrics)."""
    from feedback import db

    row = msg.model_dump(mode="python")
    stmt = db.upsert_insert(engine, db.model_versions).values(**row)
    stmt = stmt.on_conflict_do_update(
        index_elements=[db.model_versions.c.version],
        set_={
            k: stmt.excluded[k]
            for k in ("gate_passed", "gate_reason", "metrics", "size_bytes", "full_size_bytes", "uri", "sha256")
        },
    )
    with engine.begin() as conn:
        conn.execute(stmt)
