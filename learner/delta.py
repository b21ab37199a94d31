"""XOR weight deltas between two packed checkpoints. Pure functions: no files, no clocks.

A packed checkpoint is `dict[name, Tensor | PackedTensor]` under checkpoint (HF) names:
FP4 targets as `learner.fp4.PackedTensor` (codes, block scales, global scale), every other
tensor in high precision (bf16). An entry is a list of byte "parts": a PackedTensor has
weight_packed, weight_scale and (NVFP4) weight_global_scale; a plain tensor is one part.

    diff(old, new)      per changed entry, the XOR of each part's raw bytes, kept sparse: which
                        elements changed (a bit mask) and their XOR bytes; unchanged entries
                        (equal hash) are left out. XOR of bit patterns is lossless.
    apply(base, delta)  base XOR delta, checked: the base's digest must be the delta's base
                        digest, each result tensor its new hash and, when it is not, its base
                        tensor its recorded hash (to say which was wrong); any mismatch raises
                        DeltaError. Never modifies base.
                        A result tensor is a copy of the base's with only the changed elements
                        XORed (gathered and scattered by index: no per-element Python, and no
                        full-size XOR array), hashed right after it is built.
    encode / decode     the wire form (below), zstd-compressed; decoding keeps the sparse form.
                        `decode(background=True)` returns after the header, while a thread
                        decompresses the payload (zstd's streaming decoder releases the GIL), and
                        `apply` builds each group of tensors as soon as its bytes are in.

Order: a delta lists its tensors largest first (`diff`), on the wire too, and `apply` builds them
in that order, so the first group's bytes are a small share of the payload.

Checksums: `tensor_hash` hashes an entry's layout (kind, format, shapes, dtypes) and its bytes;
`checkpoint_digest` hashes the sorted (name, tensor hash) table: the identity of a whole
checkpoint. A delta carries the base's version and digest, the new checkpoint's digest, and
per changed tensor its base and new hash. The hash is BLAKE3 (`HASH`): as strong as sha256
for this (256 bits, collision resistant) and, where a CPU has SHA extensions, still about
twice as fast on one core (3.2 against 6.0 ms for the 9.3 MB `small` checkpoint, 135 tensors),
more where it has none; its tree lets one large tensor use every core. A delta names its
hash, and sha256 (what Flywheel used before) still reads.

Wire form (`encode`):

    b"FWXDELTA" | u32 little-endian header length | header (zstd frame of JSON) | payload (zstd frame)

The header holds the hash's name, the versions, the two digests, and per changed tensor its
layout, its base and new hash and, per part, the element width `w` (bytes), the element count `n` and how
many elements changed `k`. The new checkpoint's table is the base's with the changed
entries replaced, so unchanged tensors cost nothing. The zstd frame (with zstd's content checksum) decompresses
to, for each part in header order:

    mask    ceil(n / 8) bytes, bit i (little bit order) set when element i changed
    values  the changed elements' XOR bytes as w byte planes: all first bytes, then all
            second bytes, ... (k * w bytes)

Why mask + planes rather than zstd on the raw XOR: zstd spends at least one bit per literal
byte and finds few long matches in scattered changes. Dropping the unchanged elements and
grouping bytes of equal significance (a bf16's sign/exponent byte rarely changes; its
mantissa byte does) made deltas of the small model after 10 AdamW steps 15-35% smaller at
zstd level 3 than byte planes alone, and 25-40% smaller than raw XOR, while encoding
faster (`flywheel bench delta` measures it).

Shapes: parts are flattened to bytes [nbytes]; elements [n, w] with w = element size.
"""

from __future__ import annotations

import hashlib
import json
import struct
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field

import blake3
import numpy as np
import torch
import zstandard

from learner import fp4

MAGIC = b"FWXDELTA"
WIRE_VERSION = 2
"""2: the header names its hash ("hash") and each tensor's "base_hash" and "hash". 1 (read, not
written): sha256, under "base_sha256" and "sha256"."""
Entry = torch.Tensor | fp4.PackedTensor
Checkpoint = Mapping[str, Entry]


class DeltaError(ValueError):
    """A delta that does not apply: wrong base, corrupt bytes, or a checksum mismatch."""


# --- entries: parts, layout, checksums ------------------------------------------------------------


def parts(entry: Entry) -> list[torch.Tensor]:
    """The tensors an entry is stored as, in a fixed order."""
    if isinstance(entry, fp4.PackedTensor):
        out = [entry.weight_packed, entry.weight_scale]
        return out + ([entry.weight_global_scale] if entry.weight_global_scale is not None else [])
    return [entry]


def layout(entry: Entry) -> dict:
    """What must match for two entries to be XORed: kind, format, shape, dtype of each part."""
    ps = [[str(p.dtype).removeprefix("torch."), list(p.shape)] for p in parts(entry)]
    if isinstance(entry, fp4.PackedTensor):
        return {
            "kind": "fp4",
            "fmt": entry.fmt.name,
            "shape": list(entry.shape),
            "dtype": str(entry.dtype).removeprefix("torch."),
            "parts": ps,
        }
    return {"kind": "dense", "shape": list(entry.shape), "dtype": ps[0][0], "parts": ps}


def _bytes(t: torch.Tensor) -> np.ndarray:
    """The raw bytes of a tensor [nbytes] uint8 (a view when t is contiguous on the CPU)."""
    t = t.detach().cpu().contiguous()
    # numpy's reshape costs less than torch's (a delta touches hundreds of small tensors)
    return (t.view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)).numpy().reshape(-1)


HASH = "blake3"
"""The hash new checkpoints are identified by. Stores and deltas written before it was chosen
name none and use "sha256", which still reads (`HASHES`)."""

HASHES = ("blake3", "sha256")

_PARALLEL_HASH_BYTES = 8 << 20
"""An entry at least this big is hashed by BLAKE3 on every core (its tree splits the input;
the digest is the same on any number of threads). Below it, starting threads costs more than
they save."""


def tensor_hash(entry: Entry, algorithm: str = HASH) -> str:
    """The hash of an entry's layout and bytes (so a reshaped or retyped tensor hashes differently)."""
    return _hash(algorithm, layout(entry), [_bytes(p) for p in parts(entry)])


def _hash(algorithm: str, entry_layout: dict, raws: list[np.ndarray]) -> str:
    h = _hasher(algorithm, sum(r.size for r in raws))
    h.update(_layout_json(entry_layout))
    for raw in raws:
        h.update(raw)
    return h.hexdigest()


_LAYOUT_JSON: dict[str, bytes] = {}
"""Canonical JSON of the layouts seen, by their repr: a checkpoint has few distinct layouts
(7 among the `small` model's 135 tensors), and repr costs half what sorted JSON does."""


def _layout_json(entry_layout: dict) -> bytes:
    """`entry_layout` as sorted JSON: what a tensor hash starts with."""
    key = repr(entry_layout)  # str, int, list, dict and None only: equal reprs, equal layouts
    out = _LAYOUT_JSON.get(key)
    if out is None:
        if len(_LAYOUT_JSON) >= 4096:  # bounded, whatever a process loads
            _LAYOUT_JSON.clear()
        out = _LAYOUT_JSON[key] = json.dumps(entry_layout, sort_keys=True).encode()
    return out


def _hasher(algorithm: str, nbytes: int = 0):
    if algorithm == "blake3":
        return blake3.blake3(max_threads=blake3.blake3.AUTO if nbytes >= _PARALLEL_HASH_BYTES else 1)
    if algorithm == "sha256":
        return hashlib.sha256()
    raise DeltaError(f"unknown tensor hash {algorithm!r} (known: {', '.join(HASHES)})")


def tensor_hashes(ckpt: Checkpoint, algorithm: str = HASH) -> dict[str, str]:
    return {name: tensor_hash(e, algorithm) for name, e in ckpt.items()}


def checkpoint_digest(hashes: Mapping[str, str], algorithm: str = HASH) -> str:
    """The identity of a checkpoint: the hash of its sorted (name, tensor hash) table."""
    h = _hasher(algorithm)
    h.update("".join(f"{n}\t{hashes[n]}\n" for n in sorted(hashes)).encode())
    return h.hexdigest()


def checkpoint_nbytes(ckpt: Checkpoint) -> int:
    """Bytes of the raw tensors (what a full snapshot stores, headers aside)."""
    return sum(_entry_nbytes(e) for e in ckpt.values())


def _entry_nbytes(entry: Entry) -> int:
    return sum(p.numel() * p.element_size() for p in parts(entry))


def _rebuild(base: Entry, new_parts: list[torch.Tensor]) -> Entry:
    if isinstance(base, fp4.PackedTensor):
        gs = new_parts[2] if len(new_parts) > 2 else None
        return fp4.PackedTensor(new_parts[0], new_parts[1], gs, base.fmt, base.shape, base.dtype)
    return new_parts[0]


# --- the delta ---------------------------------------------------------------------------------


_WORD = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


@dataclass(frozen=True, eq=False)
class PartDelta:
    """One part's XOR, sparse: which of its `n` elements (of `w` bytes) changed, and their XOR
    bytes as `w` byte planes (all first bytes, then all second bytes, ...), as on the wire."""

    n: int
    w: int
    mask: np.ndarray  # [ceil(n / 8)] uint8, bit i (little bit order) set when element i changed
    values: np.ndarray  # [w * k] uint8

    @property
    def k(self) -> int:
        """How many elements changed."""
        return self.values.size // self.w

    @property
    def nbytes(self) -> int:
        return self.n * self.w

    def changed(self) -> np.ndarray:
        """Which elements changed [n] bool."""
        return np.unpackbits(self.mask, count=self.n, bitorder="little").view(bool)

    def xor_words(self) -> np.ndarray:
        """The changed elements' XOR [k, w] bytes, one row per element (planes transposed back)."""
        return _words([self])

    def apply_to(self, raw: np.ndarray) -> np.ndarray:
        """`raw` [n * w] bytes XOR this part, as a new array."""
        return xor_parts([(raw, self)])[0]

    def xor(self) -> np.ndarray:
        """The full XOR bytes [n * w] (zero where nothing changed); for inspection."""
        return self.apply_to(np.zeros(self.nbytes, dtype=np.uint8))

    @classmethod
    def from_xor(cls, x: np.ndarray, w: int) -> PartDelta:
        """The sparse form of full XOR bytes [n * w]."""
        word = _WORD.get(w)
        changed = x.view(word) != 0 if word is not None else x.reshape(-1, w).any(axis=1)  # [n]
        values = x.reshape(-1, w)[changed].T  # [w, k]
        return cls(x.size // w, w, np.packbits(changed, bitorder="little"), np.ascontiguousarray(values).reshape(-1))


@dataclass(frozen=True, eq=False)
class TensorDelta:
    layout: dict
    base_hash: str
    hash: str
    parts: tuple[PartDelta, ...]  # one per part of the entry, in `parts()` order


@dataclass(frozen=True, eq=False)
class Delta:
    base_version: int | None
    version: int | None
    base_digest: str
    digest: str  # of the new checkpoint
    changed: dict[str, TensorDelta]  # largest first (`diff`), as on the wire
    algorithm: str = HASH  # what the hashes and digests were made with
    payload: _Payload | None = field(default=None, repr=False)  # set by `decode(background=True)`

    def wait(self) -> Delta:
        """Block until a background decode is done and checked (raises its DeltaError); self."""
        if self.payload is not None:
            self.payload.result()
        return self

    @property
    def xor_nbytes(self) -> int:
        """Bytes of the tensors the delta touches (what a full-size XOR would hold)."""
        return sum(p.nbytes for td in self.changed.values() for p in td.parts)

    def new_hashes(self, base_hashes: Mapping[str, str]) -> dict[str, str]:
        """The new checkpoint's (name, tensor hash) table, given its base's."""
        return {**base_hashes, **{name: td.hash for name, td in self.changed.items()}}


def diff(
    old: Checkpoint,
    new: Checkpoint,
    *,
    base_version: int | None = None,
    version: int | None = None,
    old_hashes: Mapping[str, str] | None = None,
    new_hashes: Mapping[str, str] | None = None,
    algorithm: str = HASH,
) -> Delta:
    """The delta that turns `old` into `new`. Both must have the same names and layouts
    (else DeltaError: publish a full snapshot instead). Known hashes (made with `algorithm`)
    skip rehashing."""
    if set(old) != set(new):
        missing, added = sorted(set(old) - set(new)), sorted(set(new) - set(old))
        raise DeltaError(
            f"checkpoints differ in tensors (removed {missing[:3]}, added {added[:3]}); publish a full snapshot instead"
        )
    old_hashes = dict(old_hashes) if old_hashes is not None else tensor_hashes(old, algorithm)
    new_hashes = dict(new_hashes) if new_hashes is not None else tensor_hashes(new, algorithm)
    changed = {}
    # largest first: the order `encode` writes and `apply` builds in, so that a background
    # decode has the first group of tensors ready while most of the payload is still to come
    for name in sorted(new, key=lambda n: (-_entry_nbytes(new[n]), n)):
        if old_hashes[name] == new_hashes[name]:
            continue
        lo, ln = layout(old[name]), layout(new[name])
        if lo != ln:
            raise DeltaError(f"{name}: layout changed ({lo} -> {ln}); publish a full snapshot instead")
        part_deltas = tuple(
            PartDelta.from_xor(np.bitwise_xor(_bytes(a), _bytes(b)), b.element_size())
            for a, b in zip(parts(old[name]), parts(new[name]), strict=True)
        )
        changed[name] = TensorDelta(ln, old_hashes[name], new_hashes[name], part_deltas)
    return Delta(
        base_version,
        version,
        checkpoint_digest(old_hashes, algorithm),
        checkpoint_digest(new_hashes, algorithm),
        changed,
        algorithm,
    )


def apply(base: Checkpoint, delta: Delta, *, base_hashes: Mapping[str, str] | None = None) -> dict[str, Entry]:
    """base XOR delta, verified (see the module docstring). `base_hashes` (made with the delta's
    algorithm), when the caller already verified `base`, skips hashing it: a touched tensor
    whose result is right had the right base, and one whose result is wrong is hashed to tell a
    modified base from a corrupt delta. Unchanged entries, and the unchanged parts of changed
    ones (an FP4 tensor's global scale when its codes changed), are shared with `base`, not
    copied."""
    algorithm = delta.algorithm
    hashed = tensor_hashes(base, algorithm) if base_hashes is None else None  # by us, so it is the base's own
    hashes = dict(base_hashes) if base_hashes is not None else dict(hashed)
    if set(hashes) != set(base):
        raise ValueError("base_hashes must name exactly the base's tensors")
    if not set(delta.changed) <= set(base):
        raise DeltaError(
            f"wrong base: it lacks tensors the delta changes, e.g. {sorted(set(delta.changed) - set(base))[:3]}"
        )
    if checkpoint_digest(hashes, algorithm) != delta.base_digest:
        raise DeltaError(
            f"wrong base: the delta applies to version {delta.base_version} (digest {delta.base_digest[:12]}), "
            f"this base has digest {checkpoint_digest(hashes, algorithm)[:12]}"
        )
    names = list(delta.changed)
    touched = [parts(base[n]) for n in names]
    for name, ps in zip(names, touched, strict=True):
        td = delta.changed[name]
        if layout(base[name]) != td.layout:
            raise DeltaError(f"{name}: the delta's layout {td.layout} does not match the base's {layout(base[name])}")
        if len(td.parts) != len(ps):
            raise DeltaError(f"{name}: the delta has {len(td.parts)} parts, the base {len(ps)}")
        for p, part in zip(ps, td.parts, strict=True):
            if part.w != p.element_size():
                raise DeltaError(f"{name}: delta part of width {part.w}, the base part's is {p.element_size()}")
        if hashed is not None and hashed[name] != td.base_hash:
            raise _modified_base(name)
    raws = [[_bytes(p) for p in ps] for ps in touched]
    sizes = [sum(r.size for r in rs) for rs in raws]
    # In the delta's order (largest first, as `diff` makes and the wire keeps), a group of
    # tensors at a time: XORed, then hashed while their bytes are still in the cache. After
    # `decode(background=True)`, a thread decompresses the later groups meanwhile. (Hashing on
    # other threads was measured and lost: they need the GIL between tensors, which the XOR's
    # numpy calls mostly hold. BLAKE3 hashes a large tensor on every core by itself.)
    out = dict(base)
    for group in (g for g in _groups(sizes, _APPLY_GROUPS) if len(g)):
        if delta.payload is not None:
            delta.payload.wait([names[i] for i in group])
        built = {i: list(raws[i]) for i in group}  # a part with no change keeps the base's bytes, shared
        items, at = [], []  # the parts with a change, and where each one's result goes
        for i in group:
            for j, (raw, part) in enumerate(zip(raws[i], delta.changed[names[i]].parts, strict=True)):
                if part.k:
                    items.append((raw, part))
                    at.append((i, j))
                elif raw.size != part.nbytes:
                    raise DeltaError(f"{names[i]}: a delta part has {part.nbytes} bytes, its base part {raw.size}")
        for (i, j), b in zip(at, xor_parts(items), strict=True):
            built[i][j] = b
        for i in group:
            name, td = names[i], delta.changed[names[i]]
            if _hash(algorithm, td.layout, built[i]) != td.hash:  # XOR keeps the layout: the base's is the result's
                if _hash(algorithm, td.layout, raws[i]) != td.base_hash:
                    raise _modified_base(name)
                raise DeltaError(f"{name}: result hash mismatch after applying the delta (corrupt delta)")
            new_parts = [p if b is r else _like(b, p) for p, r, b in zip(touched[i], raws[i], built[i], strict=True)]
            out[name] = _rebuild(base[name], new_parts)
            hashes[name] = td.hash
    delta.wait()  # the payload's end: zstd's content checksum, no trailing bytes
    if checkpoint_digest(hashes, algorithm) != delta.digest:
        raise DeltaError("result digest mismatch: the delta's checksums are inconsistent (corrupt delta)")
    return out


def xor_parts(items: list[tuple[np.ndarray, PartDelta]]) -> list[np.ndarray]:
    """Each base part's bytes [n * w] XOR its PartDelta, as new arrays, for all parts at once.

    Per element width, the bases are concatenated into one buffer (the copy the results need
    anyway), the changed elements' indices come from the concatenated masks (`changed_index`),
    and one indexed XOR updates every changed element; the results are views into that buffer.
    A handful of numpy calls per width, and two per part: a checkpoint has hundreds of small
    parts, where calls cost more than bytes."""
    out: list[np.ndarray | None] = [None] * len(items)
    by_width: dict[int, list[int]] = {}
    for i, (raw, part) in enumerate(items):
        if raw.size != part.nbytes:
            raise DeltaError(f"a delta part has {part.nbytes} bytes, its base part {raw.size}")
        by_width.setdefault(part.w, []).append(i)
    for w, which in by_width.items():
        ps = [items[i][1] for i in which]
        buf = np.concatenate([items[i][0] for i in which])
        n = np.array([p.n for p in ps], dtype=np.int64)
        if sum(p.k for p in ps):
            index = changed_index(ps)  # [K] ascending: part order, then element order
            xor = _words(ps)  # [K, w] in the same order
            if index.size != len(xor):  # decode checks the total over all widths, not per width
                raise DeltaError("corrupt delta payload (mask and values disagree)")
            word = _WORD.get(w)
            if word is not None:
                buf.view(word)[index] ^= xor.view(word).reshape(-1)
            else:
                buf.reshape(-1, w)[index] ^= xor
        ends = np.cumsum(n * w).tolist()
        for i, start, end in zip(which, [0, *ends[:-1]], ends, strict=True):
            out[i] = buf[start:end]
    return out  # type: ignore[return-value]


def changed_index(ps: list[PartDelta]) -> np.ndarray:
    """The changed elements of parts laid end to end [K] int64, ascending (each part's elements
    counted from the sum of the earlier parts' n).

    Where few mask bytes have a change (most of a checkpoint is FP4 codes, of which a step
    changes well under 1%), only those bytes are unpacked, and the positions are mapped back to
    parts after. Where many do, every part's mask is unpacked to one flag per element, which
    needs no mapping. Finding the set flags costs about the same per flag either way, and
    mapping costs `_MAP_COST` flags per changed element: the cheaper of the two is taken."""
    masks = np.concatenate([p.mask for p in ps])  # a part's padding bits past n are 0 (decode checks)
    if 8 * np.count_nonzero(masks) + _MAP_COST * sum(p.k for p in ps) > 8 * masks.size:
        return np.flatnonzero(np.concatenate([p.changed() for p in ps]))
    # np.flatnonzero is several times faster on bool than on uint8 arrays
    nonzero = np.flatnonzero(masks != 0)  # [M] mask bytes with a change
    mask_bit = 8 * np.cumsum([0] + [p.mask.size for p in ps[:-1]], dtype=np.int64)  # [P] where each part's bits start
    first = np.cumsum([0] + [p.n for p in ps[:-1]], dtype=np.int64)  # [P] each part's first element
    bits = np.flatnonzero(np.unpackbits(masks[nonzero], bitorder="little").view(bool))  # [K] in those bytes' bits
    at = nonzero[bits >> 3] * 8 + (bits & 7)  # [K] ascending bit positions in `masks`
    per_part = np.diff(np.searchsorted(at, mask_bit), append=at.size)  # [P] changed elements per part
    return at + np.repeat(first - mask_bit, per_part)


def _words(ps: list[PartDelta]) -> np.ndarray:
    """The parts' changed elements' XOR laid end to end [K, w] bytes: each part's byte planes
    written into the columns (strided copies, about ten times faster than numpy's transposed copy)."""
    w = ps[0].w
    if w == 1:
        return np.concatenate([p.values for p in ps]).reshape(-1, 1)
    out = np.empty((sum(p.k for p in ps), w), dtype=np.uint8)
    pos = 0
    for p in ps:
        for i, plane in enumerate(p.values.reshape(w, -1)):
            out[pos : pos + p.k, i] = plane
        pos += p.k
    return out


_MAP_COST = 7
"""What mapping one changed element back to its part costs, in unpacked mask bits to search
(measured on checkpoint pairs of the small model: about 1 ns a bit, 7 ns an element)."""


_APPLY_GROUPS = 4
"""`apply` builds the tensors in about this many groups of equal size: enough that the first
waits for a small share of a background decode, few enough that each group's XOR is a handful
of numpy calls."""


def _groups(sizes: list[int], count: int) -> list[range]:
    """Consecutive runs of indices into `sizes`, at most `count`, of about equal total size."""
    total, out, start, acc = sum(sizes), [], 0, 0
    for i, size in enumerate(sizes):
        acc += size
        if len(out) + 1 < count and acc * count >= total * (len(out) + 1) and i + 1 < len(sizes):
            out.append(range(start, i + 1))
            start = i + 1
    return [*out, range(start, len(sizes))]


def _like(raw: np.ndarray, p: torch.Tensor) -> torch.Tensor:
    """Bytes [nbytes] as a tensor of p's dtype and shape (the inverse of `_bytes`)."""
    if p.dim() == 0:
        return torch.from_numpy(raw).view(p.dtype).reshape(())
    return torch.from_numpy(raw.reshape(*p.shape[:-1], -1)).view(p.dtype)


def _modified_base(name: str) -> DeltaError:
    return DeltaError(
        f"{name}: the base tensor's hash is not the one the delta was made against (corrupt or modified base)"
    )


# --- wire form ----------------------------------------------------------------------------------


def encode(delta: Delta, *, level: int = 3, threads: int = -1) -> bytes:
    """The wire form of a delta (module docstring). `threads`: zstd workers, -1 = all cores, 0 = none."""
    entries, chunks = [], []
    for name, td in delta.changed.items():
        for part in td.parts:
            chunks += [part.mask, part.values]
        part_meta = [{"w": part.w, "n": part.n, "k": part.k} for part in td.parts]
        entries.append(
            {"name": name, "layout": td.layout, "base_hash": td.base_hash, "hash": td.hash, "parts": part_meta}
        )
    payload = b"".join(c.tobytes() for c in chunks)
    header = {
        "format": "flywheel-xor-delta",
        "wire_version": WIRE_VERSION,
        "hash": delta.algorithm,
        "base_version": delta.base_version,
        "version": delta.version,
        "base_digest": delta.base_digest,
        "digest": delta.digest,
        "changed": entries,
        "payload_nbytes": len(payload),
    }
    hdr = zstandard.ZstdCompressor(level=max(level, 3), write_checksum=True).compress(
        json.dumps(header, separators=(",", ":")).encode()
    )
    frame = zstandard.ZstdCompressor(
        level=level, threads=threads, write_checksum=True, write_content_size=True
    ).compress(payload)
    return MAGIC + struct.pack("<I", len(hdr)) + hdr + frame


def read_header(data: bytes) -> dict:
    """The JSON header of an encoded delta (cheap: nothing is decompressed)."""
    if len(data) < len(MAGIC) + 4 or data[: len(MAGIC)] != MAGIC:
        raise DeltaError("not a Flywheel delta (bad magic bytes)")
    (n,) = struct.unpack_from("<I", data, len(MAGIC))
    start = len(MAGIC) + 4
    try:
        header = json.loads(zstandard.ZstdDecompressor().decompress(data[start : start + n]))
    except (zstandard.ZstdError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DeltaError(f"corrupt delta header: {e}") from None
    if (
        not isinstance(header, dict)
        or header.get("format") != "flywheel-xor-delta"
        or header.get("wire_version") not in (1, WIRE_VERSION)
    ):
        raise DeltaError(f"unsupported delta format {header.get('format') if isinstance(header, dict) else header!r}")
    if header["wire_version"] == 1:
        header["hash"] = "sha256"
    if header.get("hash") not in HASHES:
        raise DeltaError(f"corrupt delta header: unknown tensor hash {header.get('hash')!r}")
    header["_payload_offset"] = start + n
    return header


def decode(data: bytes, *, background: bool = False) -> Delta:
    """Inverse of encode. Corrupt bytes raise DeltaError (zstd's checksum, sizes, the header).

    `background`: return once the header is read, while a thread decompresses the payload (zstd's
    streaming decoder releases the GIL); `apply` waits for each group of tensors it builds, so
    it XORs the first while the rest decompress. The returned delta's masks and values must not
    be read before `Delta.wait()` (which `apply` calls); a corrupt payload raises there, or in
    `apply`, instead of here."""
    h = read_header(data)
    base_key, hash_key = ("base_sha256", "sha256") if h["wire_version"] == 1 else ("base_hash", "hash")
    pos, changed, pieces, piece, piece_of = 0, {}, [], [], {}
    try:
        nbytes = h["payload_nbytes"]
        frame = data[h["_payload_offset"] :]
        try:
            size = zstandard.frame_content_size(frame)  # encode writes it; -1 would be unknown
        except zstandard.ZstdError as e:
            raise DeltaError(f"corrupt delta payload: {e}") from None
        if size != nbytes:  # before allocating what the header says
            raise DeltaError(f"corrupt delta payload: {size} bytes, the header says {nbytes}")
        buf = np.empty(nbytes, dtype=np.uint8)
        for e in h["changed"]:
            part_deltas = []
            for p in e["parts"]:
                n, w, k = p["n"], p["w"], p["k"]
                mask_end = pos + (n + 7) // 8
                end = mask_end + k * w
                if w < 1 or n < 0 or not 0 <= k <= n or end > buf.size:
                    raise DeltaError(f"{e['name']}: corrupt delta payload (mask and values disagree)")
                part_deltas.append(PartDelta(n, w, buf[pos:mask_end], buf[mask_end:end]))
                pos = end
            changed[e["name"]] = td = TensorDelta(e["layout"], e[base_key], e[hash_key], tuple(part_deltas))
            piece_of[e["name"]] = len(pieces)  # the piece its bytes end in
            piece.append((e["name"], td))
            if pos >= (len(pieces) + 1) * nbytes / _PIECES:
                pieces.append((pos, piece))
                piece = []
        if pos != buf.size:
            raise DeltaError(f"corrupt delta payload: {buf.size - pos} trailing bytes")
        if piece or not pieces:
            pieces.append((pos, piece))
    except (KeyError, TypeError) as e:
        raise DeltaError(f"corrupt delta header: {e!r}") from None
    payload = _Payload(frame, buf, pieces, piece_of)
    delta = Delta(h["base_version"], h["version"], h["base_digest"], h["digest"], changed, h["hash"], payload)
    return delta if background else delta.wait()


_PIECES = 8
"""A background decode hands the payload over in about this many pieces (at tensor boundaries):
`apply` waits for its first group's pieces only, and each hand-over costs a GIL round trip."""


class _Payload:
    """A delta's payload, decompressed into `buf` piece by piece by a thread of its own, which
    needs the GIL only between pieces. The caller's thread checks a piece's masks
    (`_check_masks`) before it reads the piece."""

    def __init__(
        self,
        frame: bytes,
        buf: np.ndarray,
        pieces: list[tuple[int, list[tuple[str, TensorDelta]]]],
        piece_of: dict[str, int],
    ) -> None:
        self._buf, self._pieces, self._piece_of = buf, pieces, piece_of
        self._ready, self._error = 0, None  # pieces decompressed; the DeltaError that stopped it
        self._checked = 0  # pieces whose masks were checked
        self._done = threading.Condition()
        self._thread = threading.Thread(target=self._run, args=(frame,), name="delta-decode", daemon=True)
        self._thread.start()

    def _run(self, frame: bytes) -> None:
        try:
            reader = zstandard.ZstdDecompressor().stream_reader(frame, read_size=max(1, len(frame)))
            view, pos = memoryview(self._buf), 0
            for i, (end, _) in enumerate(self._pieces):
                while pos < end:
                    got = reader.readinto(view[pos:end])
                    if not got:
                        raise DeltaError(f"corrupt delta payload: {pos} bytes, the header says {self._buf.size}")
                    pos += got
                with self._done:
                    self._ready = i + 1
                    self._done.notify_all()
            if reader.read(1):  # also has zstd check the frame's content checksum
                raise DeltaError(f"corrupt delta payload: more than the {self._buf.size} bytes the header says")
        except zstandard.ZstdError as e:
            self._fail(DeltaError(f"corrupt delta payload: {e}"))
        except DeltaError as e:
            self._fail(e)
        except BaseException as e:  # never leave a waiter hanging
            self._fail(DeltaError(f"delta payload: {e!r}"))

    def _fail(self, error: DeltaError) -> None:
        with self._done:
            self._error = error
            self._done.notify_all()

    def wait(self, names: list[str]) -> None:
        """Block until the tensors `names` are decompressed, and check their masks."""
        self._through(1 + max((self._piece_of[n] for n in names), default=0))

    def result(self) -> None:
        """Block until the whole payload is decompressed, and check what is left of it."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        self._through(len(self._pieces))

    def _through(self, need: int) -> None:
        """Block until the first `need` pieces are decompressed; check the masks of those not yet checked."""
        if self._ready < need:
            with self._done:
                self._done.wait_for(lambda: self._ready >= need or self._error is not None)
        if self._ready < need:
            raise self._error  # type: ignore[misc]
        while self._checked < need:
            _check_masks(self._pieces[self._checked][1])
            self._checked += 1


def _check_masks(tensors: list[tuple[str, TensorDelta]]) -> None:
    """Each part's mask has exactly k bits set and none past its last element (DeltaError naming
    the tensor otherwise)."""
    ps = [(name, p) for name, td in tensors for p in td.parts]
    if not ps:
        return
    n_k = np.array([(p.n, p.k) for _, p in ps], dtype=np.int64).reshape(-1, 2)
    bad = _bad_masks([p.mask for _, p in ps], n_k[:, 0], n_k[:, 1])
    if bad.size:
        raise DeltaError(f"{ps[bad[0]][0]}: corrupt delta payload (mask and values disagree)")


def _bad_masks(masks: list[np.ndarray], n: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Which parts' masks [P] (of n [P] elements, k [P] of them changed) do not have exactly k
    bits set, or set a bit past their last element. All masks' bits are counted at once, 64 at a
    time; only when the total is wrong are they counted part by part, to name the part. (Two
    parts wrong by opposite counts pass here; their XOR lands on the wrong elements, and the
    result's hash check in `apply` refuses it.)"""
    sizes = (n + 7) // 8
    ends = np.cumsum(sizes)
    flat = np.zeros((int(ends[-1]) // 8 + 1) * 8, dtype=np.uint8)  # a spare word: every start is inside
    np.concatenate(masks, out=flat[: ends[-1]])
    spare = n % 8  # bits of the last mask byte that are elements (0: the part has no such byte to check)
    past = (spare > 0) & (flat[np.maximum(ends - 1, 0)].astype(np.int64) >> spare != 0)
    if int(np.bitwise_count(flat.view(np.uint64)).sum(dtype=np.int64)) == int(k.sum()):
        return np.flatnonzero(past)
    # reduceat sums flat[start_i:start_(i+1)], the last to the end (zeros past the masks); an empty
    # mask gives the byte at its start instead, so it is masked out
    ones = np.where(sizes > 0, np.add.reduceat(np.bitwise_count(flat), ends - sizes), 0)
    return np.flatnonzero((ones != k) | past)
