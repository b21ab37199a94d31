"""The weight store: published model versions as full snapshots and XOR deltas, STABLE last.

The learner publishes, serving replicas read; both use this module and learner.delta, so
there is one codec. A store lives at a URI: `file://` (or a plain path), `s3://bucket/prefix`
(s3fs) or `gs://bucket/prefix` (gcsfs, an optional extra). Every scheme goes through one code
path over fsspec; the local filesystem only adds owner-only modes, fsync and an flock.

One folder per version; inside it one folder per publish attempt (a random id), so no two
publishers ever write the same object:

    v000007/
        STABLE                  the commit, written last and only if absent: "<sha256 of the
                                manifest> <attempt>/manifest.json"
        <attempt>/manifest.json see `FORMAT` below: every payload's name, sha256 and size, and the
                                per-tensor hash of the whole checkpoint (BLAKE3: learner.delta.HASH)
        <attempt>/delta.zst     learner.delta's wire form against `parent` (every version with a parent)
        <attempt>/full.safetensors  the packed checkpoint (kind "full": no parent, a changed layout, or
                                every `full_every` versions), in the packed artifact's layout
                                (learner.export): FP4 targets as compressed-tensors
                                {module}.weight_packed / .weight_scale / .weight_global_scale, every
                                other tensor bf16 under its checkpoint name

Stores written before attempts existed (format 1: manifest.json and the payloads beside STABLE,
which holds the sha256 alone) still open and read; new versions are written as above. Stores
written before BLAKE3 (formats 1 and 2: no "tensor_hash", per-tensor "sha256") read too, and a
version keeps its parent's tensor hash, so such a store goes on in sha256 (deltas and digests
stay comparable along a chain); a fresh store (an import, a new data_dir) uses BLAKE3.

A full version keeps its delta too, so a replica one version behind always fetches a delta;
the full snapshots only bound how far back a cold reader must go (`materialize`, `plan`).

Beside the versions, `model/` holds the files every version shares: config.json,
generation_config.json, the tokenizer files and `base.json` (where version 0 came from: an
imported Hugging Face folder or Flywheel's pretrained base, its FP4 format and targets, the
version the learner starts from). It is written once, before version 0, and read by serving
(`export_version` writes a folder vLLM loads) and the learner, so both serve and train the
model the store holds, never an unrelated folder.

Publishing writes the payloads, then the manifest, then creates STABLE only if it does not
exist: on S3 a PUT with `If-None-Match: *`, on a local disk a hard link (each local file is
written whole and fsynced first). Readers list only versions with STABLE, check the manifest
against STABLE's sha256 and every payload against the manifest before use, so a crash at any
point leaves nothing half-written visible, and the next publish of that number (another
attempt folder) goes through. Cleanup removes what crashed publishes left.

Two learners pointed at one store by mistake never both get a version: the conditional create
of STABLE lets exactly one publisher commit it; the other gets a StoreError and removes only
its own attempt folder. Without an explicit number each takes the next free one; with one (v0,
a recovered version), the second finds it taken. A local store also has a publish lock
(`_exclusive_lock`: an flock on `.publish.lock`, released by the kernel when its holder dies)
held for a whole publish and for cleanup, so there publishers queue and cleanup removes
leftovers at once. An object store has no lock: cleanup leaves uncommitted objects younger
than `debris_age_s` alone (they may be a publish in progress).

Where an S3-compatible server ignores `If-None-Match` (a probe on the first commit finds out,
and a warning says so), the commit is a check, a PUT and a read-back: two publishers racing
for one version within one round trip could then both believe they won. The store still holds
exactly one whole version (the last writer's STABLE names its own manifest and payloads,
checked by sha256), never a mix. AWS S3 (documented) and SeaweedFS (checked by the tests) honour
the header; gcsfs's `mode="create"` is not checked here.
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
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Protocol
from urllib.parse import unquote, urlparse

import torch
from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from feedback.core.errors import first_line
from feedback.core.files import PRIVATE_DIR, PRIVATE_FILE, open_private, private_dir
from feedback.schemas import ModelVersion
from learner import delta as codec
from learner import fp4

log = logging.getLogger(__name__)

MANIFEST, STABLE, DELTA_FILE, FULL_FILE = "manifest.json", "STABLE", "delta.zst", "full.safetensors"
MODEL_DIR, BASE_FILE, EXPORT_MARKER = "model", "base.json", "FLYWHEEL_VERSION"
LOCK_FILE = ".publish.lock"
FORMAT = "flywheel-weight-store/3"
DESCRIPTION = (
    "One folder per version, one folder per publish attempt inside it (<attempt>/). manifest.json: version, "
    "parent, kind (full|delta), base_version (the parent the delta applies to), created_at, fp4_format, "
    "tensor_hash (blake3, or sha256 in a store begun before format 3), digest (that hash of the sorted "
    "name\\thash lines), chain_length (deltas since the last full snapshot), "
    "tensors {name: {hash (learner.delta.tensor_hash), kind fp4|dense, shape, dtype, nbytes}}, "
    "full_size_bytes (raw tensor bytes), files {delta|full: {name (relative to the version's folder), sha256, "
    "size}}. delta.zst: learner.delta wire form (XOR of packed bytes per changed tensor, changed-element mask + "
    "byte planes, zstd). full.safetensors: compressed-tensors nvfp4/mxfp4-pack-quantized layout for FP4 targets, "
    "bf16 for the rest. STABLE, created last and only if absent, holds the manifest's sha256 and name."
)
_VERSION_DIR = re.compile(r"^v(\d{6,})$")
_STABLE_KEY = re.compile(r"^v(\d{6,})/STABLE$")
_SAFE_NAME = re.compile(r"^(?:[0-9a-f]{12}/)?[A-Za-z0-9_][A-Za-z0-9_.-]*$")  # a file, or a file in an attempt's folder


def _vdir(version: int) -> str:
    return f"v{version:06d}"


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


def _hash_algorithm(manifest: dict) -> str:
    """The hash a manifest's tensors and digest were made with: formats 1 and 2 name none (sha256)."""
    return manifest.get("tensor_hash", "sha256")


def _tensor_hashes(manifest: dict) -> dict[str, str]:
    key = "hash" if "tensor_hash" in manifest else "sha256"
    return {n: t[key] for n, t in manifest["tensors"].items()}


@dataclass
class _Materialized:
    version: int
    ckpt: dict[str, codec.Entry]
    hashes: dict[str, str]


class Producer(Protocol):
    def send(self, topic: str, msg) -> object: ...


# --- where the bytes live: fsspec ----------------------------------------------------------------


class _LocalFiles(LocalFileSystem):
    """fsspec's local filesystem as the store needs it: folders and files owner-only
    (feedback.core.files), every file written whole (temp file, fsync, rename, its folders
    fsynced), and `pipe_file(mode="create")` atomic: a hard link, which fails when the name
    exists (fsspec's own looks for the file first and then writes, which two writers can both pass)."""

    def pipe_file(self, path, value, mode="overwrite", **kwargs) -> None:
        path = Path(self._strip_protocol(path))
        missing, p = [], path.parent
        while not p.exists():
            missing.append(p)
            p = p.parent
        private_dir(path.parent)
        tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
        try:
            _write_synced(tmp, value)
            if mode == "create":
                os.link(tmp, path)  # FileExistsError when another writer has the name
            else:
                os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        for folder in dict.fromkeys([path.parent, *(m.parent for m in missing)]):
            _fsync_dir(folder)

    def rm_file(self, path) -> None:
        path = Path(self._strip_protocol(path))
        path.unlink()
        _fsync_dir(path.parent)


def _filesystem(uri: str | Path, options: Mapping[str, object]) -> tuple[AbstractFileSystem, str, str]:
    """(filesystem, root path in it, protocol) of a store URI: `file://` or a plain path, `s3://`
    (s3fs; `options` are its keyword arguments), `gs://` (gcsfs, an optional extra)."""
    s = str(uri)
    scheme = urlparse(s).scheme if "://" in s else ""
    if scheme in ("", "file"):
        path = unquote(urlparse(s).path) if scheme else s
        return _LocalFiles(), private_dir(Path(path).expanduser().absolute()).as_posix(), "file"
    if scheme == "s3":
        import s3fs

        # No listing cache: a reader polls for new versions, and a cached listing would hide them.
        fs = s3fs.S3FileSystem(use_listings_cache=False, skip_instance_cache=True, **options)
    elif scheme in ("gs", "gcs"):
        try:
            import gcsfs
        except ImportError:
            raise ValueError(
                f"weight store URI {s!r}: gs:// stores need gcsfs (pip install 'flywheel-rl[gcs]')"
            ) from None
        fs = gcsfs.GCSFileSystem(skip_instance_cache=True, **options)
    else:
        raise ValueError(f"weight store URI {s!r}: the scheme must be file://, s3:// or gs:// (or a local path)")
    root = fs._strip_protocol(s).rstrip("/")
    if not root:
        raise ValueError(f"weight store URI {s!r} names no bucket")
    return fs, root, scheme


def _precondition_failed(e: BaseException) -> bool:
    """Whether an error is the server's 412 to a conditional write. s3fs turns it into a
    FileExistsError only when the server names the If-None-Match condition, as AWS does;
    SeaweedFS does not, and s3fs makes that an OSError(EINVAL) caused by the client error."""
    response = getattr(e.__cause__, "response", None) or {}
    return (
        response.get("Error", {}).get("Code") == "PreconditionFailed"
        or response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 412
    )


def _mtime(info: Mapping) -> float:
    """An object's last change (seconds since the epoch) from an fsspec listing; now if unknown."""
    if "mtime" in info:
        return float(info["mtime"])
    when = info.get("LastModified") or info.get("updated")
    if isinstance(when, datetime):
        return when.timestamp()
    if isinstance(when, str):
        return datetime.fromisoformat(when.replace("Z", "+00:00")).timestamp()
    return time.time()


class _PayloadCache:
    """A reader's own copies of the payloads it fetched from an object store, named by their
    sha256 and checked again on every use; beyond `max_bytes`, the least recently used leave."""

    def __init__(self, folder: Path, max_bytes: int):
        self.folder = folder
        self.max_bytes = max_bytes

    def get(self, sha256: str) -> bytes | None:
        path = self.folder / sha256
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        if hashlib.sha256(data).hexdigest() != sha256:
            log.warning("the cached payload %s is damaged; fetching it from the store again", path)
            path.unlink(missing_ok=True)
            return None
        os.utime(path)
        return data

    def put(self, sha256: str, data: bytes) -> None:
        private_dir(self.folder)
        tmp = self.folder / f".{sha256}.tmp-{uuid.uuid4().hex[:8]}"
        with open_private(tmp) as f:
            f.write(data)
        os.replace(tmp, self.folder / sha256)
        entries = []
        for p in self.folder.iterdir():
            if not p.name.startswith("."):
                with contextlib.suppress(FileNotFoundError):  # another replica's eviction
                    st = p.stat()
                    entries.append((st.st_mtime, st.st_size, p))
        total = 0
        for _, size, p in sorted(entries, key=lambda e: e[0], reverse=True):
            total += size
            if total > self.max_bytes:
                p.unlink(missing_ok=True)


# --- the store --------------------------------------------------------------------------------


class Store:
    """A weight store at a URI: the publishing protocol, planning, verification and retention,
    over an fsspec filesystem, one code path for every scheme (see the module docstring)."""

    def __init__(
        self,
        uri: str | Path,
        *,
        storage_options: Mapping[str, object] | None = None,
        cache_dir: str | Path | None = None,
        cache_max_bytes: int = 4 * 2**30,
        debris_age_s: float = 3600.0,
        full_every: int = 8,
        zstd_level: int = 3,
        zstd_threads: int = -1,
        lock_timeout_s: float = 600.0,
    ):
        """`storage_options`: the filesystem's keyword arguments (s3fs: endpoint_url, key, secret,
        client_kwargs). `cache_dir`: where a reader keeps the payloads it fetched from an object
        store (`_PayloadCache`; a local store is read in place). `debris_age_s`: on an object store,
        the age after which cleanup removes a publish that never committed. `lock_timeout_s`: how
        long a publish or cleanup on a local store waits for another writer's lock before it gives
        up with a StoreError."""
        if full_every < 1:
            raise ValueError(f"full_every must be at least 1, got {full_every}")
        self.fs, self.root, self.protocol = _filesystem(uri, storage_options or {})
        self.local = self.protocol == "file"
        self.full_every = full_every
        self.zstd_level = zstd_level
        self.zstd_threads = zstd_threads
        self.lock_timeout_s = lock_timeout_s
        self.debris_age_s = debris_age_s
        self.cache = (
            _PayloadCache(Path(cache_dir), cache_max_bytes) if cache_dir is not None and not self.local else None
        )
        self.corrupt = 0  # objects refused because their sha256 did not match
        self._conditional: bool | None = True if self.local else None  # probed on an object store's first commit
        self._manifests: dict[int, tuple[dict, str]] = {}  # versions are immutable once STABLE
        self._markers: dict[int, tuple[str, str]] = {}
        self._cache: _Materialized | None = None
        self._lock = threading.RLock()
        self._writing = 0  # depth of this object's hold on the publish lock

    # where things are ----------------------------------------------------------------------------
    def uri(self, version: int | None = None) -> str:
        """The store's URI, or one version's."""
        path = self.root if version is None else self._path(_vdir(version))
        return Path(path).as_uri() if self.local else f"{self.protocol}://{path}"

    def _path(self, *parts: str) -> str:
        return "/".join((self.root, *parts))

    def _objects(self, under: str = "") -> dict[str, dict]:
        """Every object under the root (or its folder `under`): {path relative to the root: info}."""
        try:
            found = self.fs.find(self._path(under) if under else self.root, detail=True)
        except FileNotFoundError:
            return {}
        except PermissionError as e:
            raise StoreError(
                f"the weight store {self.uri()} refused access ({first_line(e)}): check the store.s3 "
                "credentials or the AWS environment"
            ) from None
        prefix = self.root + "/"
        return {p[len(prefix) :]: info for p, info in found.items() if p.startswith(prefix)}

    # the storage primitives --------------------------------------------------------------------
    def _stable(self) -> list[int]:
        """Versions whose STABLE marker exists, ascending."""
        return sorted(int(m.group(1)) for rel in self._objects() if (m := _STABLE_KEY.match(rel)))

    def _read(self, version: int, name: str) -> bytes:
        if not _SAFE_NAME.match(name):
            raise codec.DeltaError(f"version {version}: {name!r} is not a file name of this store's layout")
        try:
            return self.fs.cat_file(self._path(_vdir(version), name))
        except FileNotFoundError:
            raise StoreError(f"version {version}: {name} is missing from {self.uri(version)}") from None

    def _marker(self, version: int) -> tuple[str, str]:
        """(the manifest's sha256, its name) from the version's STABLE. Format 1's STABLE holds the
        sha256 alone, of `manifest.json` beside it; format 2's names the publish's own manifest."""
        if version not in self._markers:
            fields = self._read(version, STABLE).decode(errors="replace").split()
            if not fields or len(fields) > 2:
                raise codec.DeltaError(f"version {version}: its STABLE marker is not 'sha256 [manifest]' (corrupt)")
            self._markers[version] = (fields[0], fields[1] if len(fields) == 2 else MANIFEST)
        return self._markers[version]

    def _create(self, path: str, data: bytes) -> None:
        """Write the object `path` only if it does not exist (FileExistsError otherwise). On S3
        this is a PUT with If-None-Match: *; on a server that ignores that header (found by a
        probe on the first commit) it is a check, a PUT and a read-back, which two writers
        racing within one round trip can both pass (the module docstring says what holds then)."""
        if self._conditional is None:
            self._conditional = self._probe_conditional()
        if self._conditional:
            try:
                self.fs.pipe_file(path, data, mode="create")
            except OSError as e:
                if _precondition_failed(e):
                    raise FileExistsError(path) from e
                raise
            return
        if self.fs.exists(path):
            raise FileExistsError(path)
        self.fs.pipe_file(path, data)
        if self.fs.cat_file(path) != data:
            raise FileExistsError(path)  # another writer's landed after ours

    def _probe_conditional(self) -> bool:
        """Whether the server refuses a second create of one object (honours If-None-Match)."""
        probe = self._path(f".probe-{uuid.uuid4().hex[:12]}")
        try:
            try:
                self.fs.pipe_file(probe, b"1", mode="create")
            except PermissionError:
                raise
            except (OSError, NotImplementedError) as e:  # the server refuses the header itself
                log.warning("the weight store %s refused a conditional write (%s)", self.uri(), e)
                return False
            try:
                self.fs.pipe_file(probe, b"2", mode="create")
            except OSError as e:
                if isinstance(e, FileExistsError) or _precondition_failed(e):
                    return True
                raise
        finally:
            with contextlib.suppress(OSError):
                self.fs.rm_file(probe)
        log.warning(
            "the weight store %s does not honour If-None-Match: two publishers racing for one version "
            "within one round trip could both believe they won (the store holds one whole version)",
            self.uri(),
        )
        return False

    def _write_version(self, version: int, attempt: str, files: Mapping[str, bytes], marker: bytes) -> None:
        """Write this publish's `files` (under its own `attempt` folder), then create STABLE =
        `marker` only if no other publisher has (StoreError then, and only this publish's own
        objects are removed)."""
        folder = self._path(_vdir(version))
        try:
            for name, data in files.items():
                self.fs.pipe_file(f"{folder}/{name}", data)
            self._create(f"{folder}/{STABLE}", marker)
        except FileExistsError:
            self._remove(f"{_vdir(version)}/{attempt}")
            raise StoreError(
                f"version {version} is already in the store {self.uri()}: another publisher wrote it "
                "(is a second learner using this store?); this publish removed only its own objects"
            ) from None
        except Exception:
            self._remove(f"{_vdir(version)}/{attempt}")
            raise

    def _remove(self, rel: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self._path(rel), recursive=True)

    def _delete(self, version: int) -> None:
        """Remove STABLE first (readers stop seeing the version), then the rest."""
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._path(_vdir(version), STABLE))
        self._remove(_vdir(version))
        self._manifests.pop(version, None)
        self._markers.pop(version, None)

    def unfinished(self) -> dict[str, float]:
        """What publishes that never committed left (or are writing now): {folder or file relative
        to the root: seconds since its newest object changed}."""
        objects = self._objects()
        newest: dict[str, float] = {}
        for rel, info in objects.items():
            parts = rel.split("/")
            top = parts[0]
            if top.startswith(".tmp-v"):  # format 1's temporary folder
                key = top
            elif not _VERSION_DIR.match(top) or parts[1:] == [STABLE]:
                continue
            elif parts[-1].startswith("."):  # a temporary file the local filesystem left
                key = rel
            elif len(parts) == 2:  # format 1's file beside STABLE
                key = rel
                if self._committed_here(objects, top, ""):
                    continue
            else:  # an attempt's folder
                key = "/".join(parts[:2])
                if self._committed_here(objects, top, parts[1]):
                    continue
            newest[key] = max(newest.get(key, 0.0), _mtime(info))
        now = time.time()
        return {key: max(0.0, now - t) for key, t in sorted(newest.items())}

    def _committed_here(self, objects: Mapping[str, dict], vdir: str, attempt: str) -> bool:
        """Whether version folder `vdir` is committed by `attempt` ("": format 1's files beside STABLE)."""
        if f"{vdir}/{STABLE}" not in objects:
            return False
        manifest = self._marker(int(vdir[1:]))[1]
        return manifest.startswith(attempt + "/") if attempt else "/" not in manifest

    def _remove_debris(self) -> list[str]:
        """Remove what crashed publishes left: everything uncommitted on a local store (the
        caller holds its lock, so no publish is writing), on an object store what is older than
        `debris_age_s` (a younger one may be a publish in progress)."""
        gone = [key for key, age in self.unfinished().items() if self.local or age >= self.debris_age_s]
        for key in gone:
            self._remove(key)
        return gone

    @contextlib.contextmanager
    def _exclusive_lock(self) -> Iterator[None]:
        """Hold the store's publish lock for the block. A local store has one: an flock on
        `.publish.lock`, across the processes of its machine, released by the kernel when its
        holder dies. An object store has none: the conditional create of STABLE decides which
        publisher gets a version, and cleanup leaves young uncommitted objects alone."""
        if not self.local:
            yield
            return
        fd = os.open(Path(self.root) / LOCK_FILE, os.O_RDWR | os.O_CREAT, PRIVATE_FILE)
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
        """Who holds a local store's publish lock right now (its "pid N on host" line), or None when
        nobody does (always None on an object store, which has no lock). A probe, for tools that
        watch the store: it takes the lock for an instant when it is free."""
        if not self.local:
            return None
        fd = os.open(Path(self.root) / LOCK_FILE, os.O_RDWR | os.O_CREAT, PRIVATE_FILE)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
            return None
        finally:
            os.close(fd)  # releases the lock if this probe took it

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

    def _write_model(self, files: Mapping[str, bytes]) -> None:
        # Each file lands whole; base.json goes last, so model files without it are an import
        # that did not finish.
        for name in sorted(files, key=lambda n: n == BASE_FILE):
            self.fs.pipe_file(self._path(MODEL_DIR, name), files[name])

    def _read_model(self) -> dict[str, bytes]:
        names = sorted(
            rel.split("/", 1)[1]
            for rel in self._objects(MODEL_DIR)
            if rel.count("/") == 1 and not rel.split("/", 1)[1].startswith(".")
        )
        if BASE_FILE not in names:
            return {}
        return {name: self.fs.cat_file(self._path(MODEL_DIR, name)) for name in names}

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

    def show_policy(self, version: int):
        """The show policy published with `version` (learner/show.py), or None: it has none (a
        base, or a learner that had too few outcomes to fit one). StoreError if it is unreadable."""
        from learner.show import ShowPolicy

        d = self.manifest(version).get("show_policy")
        if d is None:
            return None
        try:
            return ShowPolicy.from_dict(d)
        except ValueError as e:
            raise StoreError(f"version {version}: its show policy cannot be applied: {e}") from None

    def _manifest(self, version: int) -> tuple[dict, str]:
        if version not in self._manifests:
            if version not in self._stable():
                raise StoreError(f"version {version} is not in the store {self.uri()} (stable: {self._stable()[-5:]})")
            marker, name = self._marker(version)
            raw = self._read(version, name)
            sha = hashlib.sha256(raw).hexdigest()
            if sha != marker:
                self.corrupt += 1
                raise codec.DeltaError(
                    f"version {version}: {self.uri(version)}/{name} sha256 {sha[:12]} is not the STABLE marker's "
                    f"{marker[:12]} (corrupt object)"
                )
            self._manifests[version] = (json.loads(raw), sha)
        return self._manifests[version]

    def _payload(self, version: int, kind: str) -> bytes:
        """A payload of `version`, checked against its manifest's sha256: from this reader's cache
        when it holds it, else fetched (and then kept)."""
        info = self.manifest(version)["files"][kind]
        if self.cache is not None and (data := self.cache.get(info["sha256"])) is not None:
            return data
        data = self._read(version, info["name"])
        if hashlib.sha256(data).hexdigest() != info["sha256"]:
            self.corrupt += 1
            raise codec.DeltaError(
                f"version {version}: {self.uri(version)}/{info['name']} does not match the sha256 in its manifest "
                "(corrupt object)"
            )
        if self.cache is not None:
            self.cache.put(info["sha256"], data)
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
                dict(base_hashes)
                if base_hashes is not None
                else codec.tensor_hashes(base, self.hash_algorithm(plan.have)),
                plan.have,
            )
        for v in plan.deltas:
            d = codec.decode(self._payload(v, "delta"), background=True)  # apply XORs as it decompresses
            if d.version != v or d.base_version != prev:
                raise codec.DeltaError(
                    f"version {v}: its delta goes from {d.base_version} to {d.version}, expected {prev} -> {v}"
                )
            ckpt = codec.apply(ckpt, d, base_hashes=hashes)
            hashes, prev = d.new_hashes(hashes), v
        if hashes != self.hashes(plan.target):
            raise codec.DeltaError(f"version {plan.target}: the result's tensor checksums differ from its manifest")
        return ckpt, hashes

    def _load_full(self, version: int) -> tuple[dict[str, codec.Entry], dict[str, str]]:
        m = self.manifest(version)
        tensors = st_load(self._payload(version, "full"))
        kinds = {n: t["kind"] for n, t in m["tensors"].items()}
        ckpt = from_safetensors(
            tensors, [n for n, k in kinds.items() if k == "fp4"], [n for n, k in kinds.items() if k == "dense"]
        )
        hashes, expected = codec.tensor_hashes(ckpt, _hash_algorithm(m)), _tensor_hashes(m)
        bad = [n for n in hashes if hashes[n] != expected[n]]
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
            self._markers.pop(version, None)
            cache, self.cache = self.cache, None  # read storage itself, not this reader's copies
            try:
                for kind in self.manifest(version)["files"]:
                    self._payload(version, kind)
                self.fetch(self.plan(version))
            finally:
                self.cache = cache

    def hashes(self, version: int) -> dict[str, str]:
        """`version`'s (name, tensor hash) table, made with `hash_algorithm(version)`."""
        return _tensor_hashes(self.manifest(version))

    def hash_algorithm(self, version: int) -> str:
        """The hash `version`'s tensors and digest were made with (learner.delta.HASHES)."""
        return _hash_algorithm(self.manifest(version))

    # publishing ------------------------------------------------------------------------------
    def publish(
        self,
        ckpt: Mapping[str, codec.Entry],
        parent: int | None,
        *,
        version: int | None = None,
        show_policy: Mapping | None = None,
    ) -> ModelVersion:
        """Write `ckpt` as the next version (or `version`): a delta against `parent`, plus a
        full snapshot when there is no parent, the layout changed, or `full_every` versions
        have passed since the last one; `show_policy` (learner/show.py, as_dict) goes into its
        manifest. Returns the ModelVersion to announce (gate fields at
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
            # a chain keeps one hash, so that a delta's base table is its parent's
            algorithm = self.hash_algorithm(parent) if parent is not None else codec.HASH
            hashes = codec.tensor_hashes(ckpt, algorithm)
            attempt = uuid.uuid4().hex[:12]  # this publish's own folder: no other writer's object is ever touched
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
                        algorithm=algorithm,
                    )
                    files[f"{attempt}/{DELTA_FILE}"] = codec.encode(d, level=self.zstd_level, threads=self.zstd_threads)
                    info["changed_tensors"], info["xor_nbytes"] = len(d.changed), d.xor_nbytes
                    chain_length = self.manifest(parent)["chain_length"] + 1
                    if chain_length >= self.full_every:
                        full_reason = f"full snapshot every {self.full_every} versions"
                else:
                    full_reason = "the tensor layout changed"
            if full_reason is not None:
                chain_length = 0
                files[f"{attempt}/{FULL_FILE}"] = st_save(
                    to_safetensors(ckpt), metadata={"format": "pt", "fp4_format": _fp4_format(ckpt) or ""}
                )
            manifest = self._manifest_for(
                version, parent, ckpt, algorithm, hashes, files, full_reason, chain_length, info
            )
            if show_policy is not None:
                manifest["show_policy"] = dict(show_policy)
            raw = (json.dumps(manifest, indent=1) + "\n").encode()
            files[f"{attempt}/{MANIFEST}"] = raw
            sha = hashlib.sha256(raw).hexdigest()
            self._write_version(version, attempt, files, f"{sha} {attempt}/{MANIFEST}\n".encode())
            self._manifests[version] = (manifest, sha)
            self._cache = _Materialized(version, ckpt, hashes)
            log.info(
                "published v%d (%s, %s) to %s", version, manifest["kind"], full_reason or "delta", self.uri(version)
            )
            return self.model_version(version)

    def _manifest_for(self, version, parent, ckpt, algorithm, hashes, files, full_reason, chain_length, info) -> dict:
        file_info = {
            kind: {"name": name, "sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
            for name, data in files.items()
            for kind, suffix in (("delta", DELTA_FILE), ("full", FULL_FILE))
            if name.endswith("/" + suffix)
        }
        return {
            "format": FORMAT,
            "description": DESCRIPTION,
            "version": version,
            "parent": parent,
            "kind": "full" if full_reason else "delta",
            "full_reason": full_reason,
            "base_version": parent if "delta" in file_info else None,
            "created_at": datetime.now(UTC).isoformat(),
            "fp4_format": _fp4_format(ckpt),
            "tensor_hash": algorithm,
            "digest": codec.checkpoint_digest(hashes, algorithm),
            "chain_length": chain_length,
            "full_size_bytes": codec.checkpoint_nbytes(ckpt),
            "files": file_info,
            "delta_stats": info,
            "tensors": {
                n: {
                    "hash": hashes[n],
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
            debris = self._remove_debris()
            if doomed or debris:
                log.info(
                    "store cleanup: deleted versions %s and %d leftover(s) of unfinished publishes", doomed, len(debris)
                )
            return doomed


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
    """The store at `uri`: `file:///abs/path` or a plain path, `s3://bucket/prefix`, `gs://bucket/prefix`.
    `opts`: Store's keyword arguments (storage_options, cache_dir, full_every, zstd_level, ...)."""
    return Store(uri, **opts)


def settings_store(settings, **opts) -> Store:
    """The store a FlywheelSettings names (`store.uri`, its S3 connection, this machine's payload
    cache). `opts`: more of Store's keyword arguments (full_every, zstd_level, ...)."""
    uri = settings.store_uri
    options = settings.store.s3.storage_options() if uri.startswith("s3://") else {}
    return Store(
        uri,
        storage_options=options,
        cache_dir=settings.store_cache_dir,
        cache_max_bytes=settings.store.cache_max_bytes,
        debris_age_s=settings.store.debris_age_s,
        **opts,
    )


def default_store_uri(settings) -> str:
    """The weight store's URI of a FlywheelSettings: `store.uri`, else `<data_dir>/weights` as a file:// URI."""
    return settings.store_uri


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
