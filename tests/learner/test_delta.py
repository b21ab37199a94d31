"""The XOR delta codec on a tiny model's packed checkpoint before and after real optimizer steps."""

import dataclasses
import json
import struct
from unittest import mock

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import example, given, settings
from hypothesis import strategies as st

from learner import delta as D
from learner import fp4
from learner.model import ModelArgs, Transformer
from learner.store import pack_checkpoint, to_hf_tensors
from learner.train.pretrain import fp4_hook


def train_steps(model: Transformer, steps: int, lr: float, seed: int = 0) -> None:
    """AdamW steps of FP4 QAT on random tokens: the kind of update the learner makes."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    g = torch.Generator().manual_seed(seed)
    hook = fp4_hook("nvfp4")
    for _ in range(steps):
        ids = torch.randint(0, model.args.vocab_size, (4, 33), generator=g)
        logits = model(ids[:, :-1], fp4=hook)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()


@pytest.fixture(scope="module")
def versions():
    """Packed checkpoints v0, v1 (after 3 AdamW steps at lr 1e-5) and the model args."""
    torch.manual_seed(0)
    model = Transformer(ModelArgs.from_name("tiny", vocab_size=512, max_seq_len=64))
    model.init_weights(0.02)
    v0 = pack_checkpoint(model.state_dict())
    train_steps(model, 3, lr=1e-5)
    return v0, pack_checkpoint(model.state_dict())


def same_bits(a: D.Entry, b: D.Entry) -> bool:
    pa, pb = D.parts(a), D.parts(b)
    return len(pa) == len(pb) and all(
        x.dtype == y.dtype and x.shape == y.shape and torch.equal(x.view(torch.uint8), y.view(torch.uint8))
        for x, y in zip(pa, pb)
    )


def test_round_trip_is_bit_exact(versions):
    v0, v1 = versions
    d = D.decode(D.encode(D.diff(v0, v1, base_version=0, version=1), level=3, threads=0))
    assert (d.base_version, d.version) == (0, 1)
    out = D.apply(v0, d)
    assert out.keys() == v1.keys()
    for name in v1:
        assert type(out[name]) is type(v1[name]) and same_bits(out[name], v1[name]), name
    assert D.tensor_hashes(out) == D.tensor_hashes(v1)
    # and the base is untouched
    assert D.checkpoint_digest(D.tensor_hashes(v0)) == d.base_digest


def test_delta_is_much_smaller_than_the_full_checkpoint(versions):
    v0, v1 = versions
    d = D.diff(v0, v1)
    blob = D.encode(d)
    full = D.checkpoint_nbytes(v1)
    changed_fp4 = sum(isinstance(v1[n], fp4.PackedTensor) for n in d.changed)
    print(
        f"\ntiny model, 3 AdamW steps at lr 1e-5: delta {len(blob)} B / full {full} B = 1/{full / len(blob):.1f}; "
        f"{len(d.changed)}/{len(v1)} tensors changed ({changed_fp4} FP4)"
    )
    assert len(blob) * 5 < full
    assert d.changed, "training changed nothing?"


def test_unchanged_tensors_are_skipped(versions):
    v0, _ = versions
    d = D.diff(v0, v0)
    assert d.changed == {} and d.digest == d.base_digest
    blob = D.encode(d)
    assert len(blob) < 256  # the header alone: versions, two digests, the hash's name
    assert D.apply(v0, D.decode(blob)).keys() == v0.keys()


def test_mxfp4_and_plain_bf16_checkpoints(versions):
    torch.manual_seed(1)
    a = {"w.weight": torch.randn(8, 64), "mlp.experts.0.up_proj.weight": torch.randn(8, 64)}
    b = {k: v + 0.01 * torch.randn_like(v) for k, v in a.items()}
    for fmt in ("mxfp4", "nvfp4"):
        pa, pb = pack_checkpoint(a, fmt), pack_checkpoint(b, fmt)
        out = D.apply(pa, D.decode(D.encode(D.diff(pa, pb))))
        assert all(same_bits(out[n], pb[n]) for n in pb)
    v0, v1 = versions  # the bf16 (HF) form: dense tensors only
    h0, h1 = to_hf_tensors(v0), to_hf_tensors(v1)
    out = D.apply(h0, D.decode(D.encode(D.diff(h0, h1))))
    assert all(torch.equal(out[n].view(torch.uint8), h1[n].view(torch.uint8)) for n in h1)


def corrupt(blob: bytes, at: int) -> bytes:
    b = bytearray(blob)
    b[at] ^= 0x5A
    return bytes(b)


@pytest.mark.parametrize("background", [False, True])  # refused by decode, or by apply as it reads
def test_corrupt_bytes_are_rejected(versions, background):
    v0, v1 = versions
    blob = D.encode(D.diff(v0, v1))
    for bad in (
        b"",
        blob[:20],
        blob[: len(blob) // 2],
        corrupt(blob, 0),
        corrupt(blob, 14),
        corrupt(blob, len(blob) - 100),
        corrupt(blob, len(blob) - 1),
    ):
        with pytest.raises(D.DeltaError):
            D.apply(v0, D.decode(bad, background=background))


def test_a_background_decode_applies_as_the_eager_one(versions):
    v0, v1 = versions
    blob = D.encode(D.diff(v0, v1))
    eager, late = D.decode(blob), D.decode(blob, background=True)
    out = D.apply(v0, late)
    assert all(same_bits(out[n], v1[n]) for n in v1)
    assert list(late.changed) == list(eager.changed)
    for name, td in late.wait().changed.items():
        assert [(p.mask.tobytes(), p.values.tobytes()) for p in td.parts] == [
            (p.mask.tobytes(), p.values.tobytes()) for p in eager.changed[name].parts
        ]


def test_the_delta_lists_its_tensors_largest_first(versions):
    v0, v1 = versions
    d = D.decode(D.encode(D.diff(v0, v1)))
    sizes = [sum(p.nbytes for p in td.parts) for td in d.changed.values()]
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) > 1


def reframed(blob: bytes, payload: bytes) -> bytes:
    """`blob` with its payload frame replaced by `payload`, zstd-compressed (the header kept)."""
    (n,) = struct.unpack_from("<I", blob, len(D.MAGIC))
    frame = zstandard.ZstdCompressor(write_checksum=True, write_content_size=True).compress(payload)
    return blob[: len(D.MAGIC) + 4 + n] + frame


@pytest.mark.parametrize("background", [False, True])
def test_a_payload_longer_or_shorter_than_its_header_says_is_refused(versions, background):
    v0, v1 = versions
    blob = D.encode(D.diff(v0, v1))
    payload = zstandard_payload(blob)
    assert D.apply(v0, D.decode(reframed(blob, payload), background=background)).keys() == v1.keys()
    with pytest.raises(D.DeltaError, match="the header says"):
        D.apply(v0, D.decode(reframed(blob, payload[:-3]), background=background))
    with pytest.raises(D.DeltaError, match="the header says"):
        D.apply(v0, D.decode(reframed(blob, payload + b"\0"), background=background))


def zstandard_payload(blob: bytes) -> bytes:
    return zstandard.ZstdDecompressor().decompress(blob[D.read_header(blob)["_payload_offset"] :])


def test_a_bad_mask_in_a_later_piece_is_refused_by_apply_after_a_background_decode(versions):
    v0, v1 = versions
    d = D.diff(v0, v1)
    name = list(d.changed)[-1]  # in the payload's last piece
    td = d.changed[name]
    part = td.parts[0]
    flags = part.changed().copy()
    flags[np.flatnonzero(~flags)[0]] = True  # one flag more than values
    bad = dataclasses.replace(
        td, parts=(dataclasses.replace(part, mask=np.packbits(flags, bitorder="little")), *td.parts[1:])
    )
    late = D.decode(D.encode(dataclasses.replace(d, changed={**d.changed, name: bad})), background=True)
    with pytest.raises(D.DeltaError, match=f"{name}: corrupt delta payload"):
        D.apply(v0, late)


def test_wrong_base_is_rejected(versions):
    v0, v1 = versions
    d = D.diff(v0, v1, base_version=0, version=1)
    with pytest.raises(D.DeltaError, match="wrong base"):
        D.apply(v1, d)  # already at v1
    with pytest.raises(D.DeltaError, match="wrong base"):
        D.apply({k: v for k, v in v0.items() if k != "lm_head.weight"}, d)


@pytest.mark.parametrize("algorithm", D.HASHES)
def test_checksum_mismatches_are_rejected(versions, algorithm):
    v0, v1 = versions
    d = D.diff(v0, v1, algorithm=algorithm)
    name = next(iter(d.changed))
    # a flipped bit in the XOR bytes: the result is not the recorded new tensor
    td = d.changed[name]
    values = td.parts[0].values.copy()
    values[0] ^= 1
    flipped = (dataclasses.replace(td.parts[0], values=values), *td.parts[1:])
    bad = dataclasses.replace(d, changed={**d.changed, name: dataclasses.replace(td, parts=flipped)})
    with pytest.raises(D.DeltaError, match="result hash"):
        D.apply(v0, bad)
    # a base tensor modified behind the caller's back (its stale hash passed in)
    hashes = D.tensor_hashes(v0, algorithm)
    base = dict(v0)
    entry = base[name]
    first = D.parts(entry)[0].clone()
    first.view(torch.uint8).view(-1)[0] ^= 1
    base[name] = dataclasses.replace(entry, weight_packed=first) if isinstance(entry, fp4.PackedTensor) else first
    with pytest.raises(D.DeltaError, match="base tensor"):
        D.apply(base, d, base_hashes=hashes)


def test_a_part_of_the_wrong_width_or_count_is_a_delta_error_not_a_crash(versions):
    v0, v1 = versions
    d = D.diff(v0, v1)
    name, td = next((n, t) for n, t in d.changed.items() if t.parts[0].w > 1)
    first = td.parts[0]
    narrow = dataclasses.replace(first, n=first.n * first.w, w=1)  # same bytes, other width
    bad = dataclasses.replace(d, changed={**d.changed, name: dataclasses.replace(td, parts=(narrow, *td.parts[1:]))})
    with pytest.raises(D.DeltaError, match="width"):
        D.apply(v0, bad)
    fewer = dataclasses.replace(d, changed={**d.changed, name: dataclasses.replace(td, parts=td.parts[1:])})
    with pytest.raises(D.DeltaError, match="parts"):
        D.apply(v0, fewer)


def test_parts_hold_exactly_the_changed_elements_and_apply_only_them():
    g = torch.Generator().manual_seed(3)
    old = {
        "w": torch.randn(13, 7, generator=g).bfloat16(),
        "s": torch.tensor(1.5),
        "b": torch.zeros(5, dtype=torch.bool),
    }
    new = {k: v.clone() for k, v in old.items()}
    new["w"].view(-1)[[0, 17, 90]] += 1  # 3 of 91 elements (91 is not a multiple of 8)
    new["s"] += 1
    new["b"][4] = True
    d = D.diff(old, new)
    part = d.changed["w"].parts[0]
    assert (part.n, part.w, part.k) == (91, 2, 3)
    assert np.flatnonzero(part.changed()).tolist() == [0, 17, 90]
    assert np.array_equal(part.xor(), np.bitwise_xor(D._bytes(old["w"]), D._bytes(new["w"])))
    assert d.xor_nbytes == 91 * 2 + 4 + 5
    out = D.apply(old, D.decode(D.encode(d)))
    assert all(
        torch.equal(out[k], new[k]) and (out[k].dtype, out[k].shape) == (new[k].dtype, new[k].shape) for k in new
    )


def test_unchanged_parts_of_a_changed_tensor_are_shared_with_the_base(versions):
    v0, v1 = versions
    d = D.decode(D.encode(D.diff(v0, v1)))
    out = D.apply(v0, d)
    shared = kept = 0
    for name, td in d.changed.items():
        for a, b, part in zip(D.parts(v0[name]), D.parts(out[name]), td.parts, strict=True):
            if part.k == 0:
                assert b is a
                shared += 1
            else:
                assert b.data_ptr() != a.data_ptr()  # a copy: the base is never modified
                kept += 1
    assert shared and kept  # the global scales stay; codes and bf16 weights change
    assert all(same_bits(out[n], v1[n]) for n in v1)


def test_blake3_hashes_a_large_tensor_on_many_threads_to_the_same_digest(monkeypatch):
    t = torch.arange(1 << 16, dtype=torch.int32)  # 256 KiB
    one = D.tensor_hash(t)
    monkeypatch.setattr(D, "_PARALLEL_HASH_BYTES", 1024)
    assert D.tensor_hash(t) == one
    assert D.tensor_hash(t, "sha256") != one and len(D.tensor_hash(t, "sha256")) == len(one) == 64
    with pytest.raises(D.DeltaError, match="unknown tensor hash 'md5'"):
        D.tensor_hash(t, "md5")


def test_a_delta_keeps_its_hash_on_the_wire_and_a_wire_version_1_delta_still_applies(versions):
    v0, v1 = versions
    for algorithm in D.HASHES:
        d = D.decode(D.encode(D.diff(v0, v1, algorithm=algorithm)))
        assert d.algorithm == algorithm and d.digest == D.checkpoint_digest(D.tensor_hashes(v1, algorithm), algorithm)
        assert all(same_bits(D.apply(v0, d)[n], v1[n]) for n in v1)
    # what Flywheel wrote before BLAKE3: wire version 1, sha256 under the keys of then
    blob = D.encode(D.diff(v0, v1, algorithm="sha256"))
    header = D.read_header(blob)
    header.pop("_payload_offset")
    header["wire_version"] = 1
    del header["hash"]
    for e in header["changed"]:
        e["base_sha256"], e["sha256"] = e.pop("base_hash"), e.pop("hash")
    (n,) = struct.unpack_from("<I", blob, len(D.MAGIC))
    hdr = zstandard.ZstdCompressor().compress(json.dumps(header).encode())
    old = D.MAGIC + struct.pack("<I", len(hdr)) + hdr + blob[len(D.MAGIC) + 4 + n :]
    d = D.decode(old, background=True)
    assert d.algorithm == "sha256"
    assert all(same_bits(D.apply(v0, d)[n], v1[n]) for n in v1)
    header["wire_version"], header["hash"] = 2, "md5"
    hdr = zstandard.ZstdCompressor().compress(json.dumps(header).encode())
    with pytest.raises(D.DeltaError, match="unknown tensor hash 'md5'"):
        D.decode(D.MAGIC + struct.pack("<I", len(hdr)) + hdr + blob[len(D.MAGIC) + 4 + n :])


def test_a_mask_bit_past_the_last_element_is_corrupt():
    old = {"w": torch.zeros(3, 3, dtype=torch.bfloat16)}  # 9 elements: 7 spare mask bits
    new = {"w": torch.ones(3, 3, dtype=torch.bfloat16)}
    d = D.diff(old, new)
    td = d.changed["w"]
    part = td.parts[0]
    mask = part.mask.copy()
    mask[-1] |= 0x80  # element 15 of 9
    bad = dataclasses.replace(td, parts=(dataclasses.replace(part, mask=mask),))
    with pytest.raises(D.DeltaError, match="mask and values disagree"):
        D.decode(D.encode(dataclasses.replace(d, changed={"w": bad})))


def test_masks_wrong_by_opposite_counts_pass_decode_and_are_refused_by_apply(versions):
    # decode checks the masks' total bit count; apply finds what that lets through
    v0, v1 = versions
    d = D.diff(v0, v1)
    widths = {}  # tensors whose first part changed in some elements, not all, by element width
    for n, td in d.changed.items():
        if 0 < td.parts[0].k < td.parts[0].n:
            widths.setdefault(td.parts[0].w, []).append(n)

    def moved(name: str, more: bool) -> D.TensorDelta:
        """The tensor's delta with one element more (or fewer) flagged in its first part's mask."""
        td = d.changed[name]
        flags = td.parts[0].changed().copy()
        flags[np.flatnonzero(~flags if more else flags)[0]] = more
        first = dataclasses.replace(td.parts[0], mask=np.packbits(flags, bitorder="little"))
        return dataclasses.replace(td, parts=(first, *td.parts[1:]))

    def applied(changes: dict) -> None:
        D.apply(v0, D.decode(D.encode(dataclasses.replace(d, changed={**d.changed, **changes}))))

    (_, (a, b, *_)), (_, (c, *_)) = sorted(widths.items(), key=lambda kv: -len(kv[1]))[:2]
    # one width: its count is right, unless apply XORs a and b in different groups of tensors
    with pytest.raises(D.DeltaError, match="result hash|mask and values disagree"):
        applied({a: moved(a, True), b: moved(b, False)})
    with pytest.raises(D.DeltaError, match="mask and values disagree"):  # two widths: each is off
        applied({a: moved(a, True), c: moved(c, False)})


def test_a_changed_layout_needs_a_full_snapshot():
    a = {"x": torch.zeros(4, 4, dtype=torch.bfloat16)}
    with pytest.raises(D.DeltaError, match="full snapshot"):
        D.diff(a, {"x": torch.zeros(2, 8, dtype=torch.bfloat16)})
    with pytest.raises(D.DeltaError, match="full snapshot"):
        D.diff(a, {"y": torch.zeros(4, 4, dtype=torch.bfloat16)})


def test_bench_methods_round_trip_and_flywheel_is_smallest(versions):
    """`flywheel bench delta`'s methods on one pair: each one checks its own round trip."""
    from ops.bench import delta as B

    v0, v1 = versions
    methods = ["flywheel", "xor+zstd", "zstd (full)"]
    methods += [
        m
        for m, mod in (
            ("arc_v2", "fireworks_delta_compression"),
            ("arc_v3", "fireworks_delta_compression"),
            ("zipnn", "zipnn"),
        )
        if _importable(mod)
    ]
    sizes = {m: B.RUNNERS[m](v0, v1, 3, 1, 1)["bytes"] for m in methods}
    print("\n" + ", ".join(f"{m} {b} B" for m, b in sizes.items()))
    assert sizes["flywheel"] == min(sizes.values())


def test_bench_times_flywheel_beside_raw_zstd_of_the_same_bytes(versions):
    from ops.bench import delta as B

    r = B.flywheel_vs_zstd(*versions, level=3, threads=1, repeats=2)
    assert r["flywheel_MBps"] > 0 and r["zstd_MBps"] > 0
    assert r["ratio"] == pytest.approx(r["flywheel_MBps"] / r["zstd_MBps"])


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


@st.composite
def part_deltas(draw) -> list[D.PartDelta]:
    """Parts of one width, each with its own size and share of changed elements (none to all)."""
    w = draw(st.sampled_from([1, 2, 3, 4]))
    parts = []
    for _ in range(draw(st.integers(1, 6))):
        n = draw(st.integers(1, 300))
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        changed = rng.random(n) < draw(st.sampled_from([0.0, 0.003, 0.05, 0.3, 1.0]))
        values = rng.integers(1, 256, (w, int(changed.sum())), dtype=np.uint8).reshape(-1)
        parts.append(D.PartDelta(n, w, np.packbits(changed, bitorder="little"), values))
    return parts


@given(part_deltas())
@settings(max_examples=200, deadline=None)
def test_changed_index_and_xor_bytes_of_parts_laid_end_to_end(ps):
    # both ways of finding the changed elements (only the nonzero mask bytes, or every element)
    # against one flag per element, and the XOR words against the byte planes transposed
    want = np.flatnonzero(np.concatenate([np.unpackbits(p.mask, count=p.n, bitorder="little") for p in ps]))
    for map_cost in (0, 10**9):  # mapping free: always the nonzero bytes; dear: always every element
        with mock.patch.object(D, "_MAP_COST", map_cost):
            assert np.array_equal(D.changed_index(ps), want)
    words = np.concatenate([p.values.reshape(p.w, -1).T for p in ps])
    assert np.array_equal(D._words(ps), words)
    raws = [np.random.default_rng(i).integers(0, 256, p.nbytes, dtype=np.uint8) for i, p in enumerate(ps)]
    for raw, p, got in zip(raws, ps, D.xor_parts(list(zip(raws, ps))), strict=True):
        flags = np.unpackbits(p.mask, count=p.n, bitorder="little").view(bool)
        full = np.zeros((p.n, p.w), dtype=np.uint8)
        full[flags] = p.values.reshape(p.w, -1).T
        assert np.array_equal(got, raw ^ full.reshape(-1))


@given(st.lists(st.integers(0, 1000), min_size=1, max_size=40), st.integers(1, 16))
@example([0, 0, 0], 1)
@example([1000, 1, 1, 1], 2)
def test_groups_cover_every_tensor_once_in_order(sizes, count):
    groups = D._groups(sizes, count)
    assert [i for g in groups for i in g] == list(range(len(sizes))) and 1 <= len(groups) <= count
    assert all(len(g) for g in groups)


@given(part_deltas(), st.data())
@settings(max_examples=100, deadline=None)
def test_decode_keeps_every_part_and_rejects_a_flipped_mask_bit(ps, data):
    def wire(parts):
        td = D.TensorDelta({"kind": "dense"}, "a" * 64, "b" * 64, tuple(parts))
        return D.encode(D.Delta(1, 2, "c" * 64, "d" * 64, {"t": td, "u": td}))

    got = D.decode(wire(ps))
    for td in got.changed.values():
        assert [(p.n, p.w, p.mask.tobytes(), p.values.tobytes()) for p in td.parts] == [
            (p.n, p.w, p.mask.tobytes(), p.values.tobytes()) for p in ps
        ]
    i = data.draw(st.integers(0, len(ps) - 1))
    bit = data.draw(st.integers(0, 8 * ps[i].mask.size - 1))  # an element's bit or a spare one past n
    mask = ps[i].mask.copy()
    mask[bit // 8] ^= 1 << (bit % 8)
    bad = [*ps[:i], dataclasses.replace(ps[i], mask=mask), *ps[i + 1 :]]
    with pytest.raises(D.DeltaError, match="t: corrupt delta payload"):
        D.decode(wire(bad))
