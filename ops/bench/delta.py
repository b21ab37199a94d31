"""`flywheel bench delta`: how small a published version is, and how fast it encodes and applies.

Checkpoint pairs come from real optimizer steps: the cached pretrained base's fp32 master
weights (a random model of `pretrain.size` when none is cached; the output says which) take `steps`
AdamW steps of FP4 QAT with router replay (learner.train.pretrain.train_step, batches of the
code corpus) per version, at each learning rate asked for, for `versions` versions. Adam's
update size is about the learning rate whatever the loss, so these steps stand in for the
learner's RL updates. They change only the weights the learner would (`learn.train_weights`; by
default a mixture-of-experts model's routed experts), so each delta is the size the learner's is.

For every pair (v-1, v), in the packed FP4 form the store publishes and in the bf16 form
vLLM loads, side by side in one run:

  flywheel      learner.delta: XOR per changed tensor, changed-element mask + byte planes, zstd
  xor+zstd      the same XOR bytes, all tensors, straight into zstd at the same level
  zstd (full)   zstd of the new checkpoint's bytes: no delta at all
  arc_v2        fireworks-delta-compression: per-tensor XOR + zstd
  arc_v3        fireworks-delta-compression: changed indices + mantissa transforms, best of zstd/bz2
  zipnn         ZipNN delta mode (XOR, byte grouping, Huffman) per tensor

With `swap`, the versions of the first learning rate are also published to a temporary
weight store and swapped into a vLLM engine (serving.hotswap) `swaps` times while simulated
clients keep requesting completions, alternating between the two ways a swap treats in-flight
requests (`wait` for them, or `restart` them after `serve.swap_preempt_after_ms`) on the same
engine and load: the pause of each swap (wait + reload), request latency p50/p99 in steady
state against requests that overlapped each mode's swaps, restarted and failed requests.

Sizes are reported as full / delta (1/x: larger is better). Throughput is MB/s of full
checkpoint bytes: encode from the two in-memory checkpoints (hashing included where the
method checksums), decode+apply from the compressed bytes and the old checkpoint, verified.
Flywheel's decode+apply is also timed alternately with raw zstd decompression of the same
checkpoint bytes (the `zstd (full)` frame, no delta, no checks): the floor any zstd-based
transport of these bytes pays, as a ratio (the target is >= 0.5). The peers' packages
(fireworks, zipnn) are optional: a method whose package is not installed is left out and said so.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
import zstandard
from rich.console import Console
from rich.table import Table

from feedback.core.config import FlywheelSettings
from learner import delta as codec
from learner import fp4
from learner.corpus import TrainingData, load_corpus
from learner.formats import own_format
from learner.model import ModelArgs, Transformer
from learner.store import pack_checkpoint, to_hf_tensors, to_safetensors
from learner.tokenizer import load_tokenizer, train_tokenizer
from learner.train.learn import train_only, train_weights
from learner.train.learn_settings import LearnSection
from learner.train.pretrain import find_base_model, fp4_hook, load_master_weights, train_step
from learner.train.pretrain_settings import PretrainSection

VS_ZSTD_ROUNDS = 15
"""Alternations of Flywheel's decode+apply and raw zstd per pair (the median of each is reported):
a few milliseconds each, so enough rounds that one slow round on a shared machine moves nothing."""
SEQ_LEN, BATCH = 128, 4  # RL-sized batches: short completions, few per update
METHODS = ("flywheel", "xor+zstd", "zstd (full)", "arc_v2", "arc_v3", "zipnn")


def timed(fn: Callable[[], object], repeats: int) -> tuple[object, float]:
    """fn's result and its median wall time over `repeats` runs."""
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return out, statistics.median(times)


# --- the compared methods: each (old, new) -> (compressed bytes, encode s, decode+apply s) ----------


def _raw(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def flat_tensors(ckpt: dict) -> dict[str, torch.Tensor]:
    """The plain tensors a checkpoint is stored as (the packed form in its safetensors layout)."""
    return to_safetensors(ckpt) if any(isinstance(e, fp4.PackedTensor) for e in ckpt.values()) else dict(ckpt)


def flywheel_vs_zstd(old: dict, new: dict, level: int, threads: int, repeats: int) -> dict:
    """Flywheel's decode+apply (verified) and raw zstd decompression of the new checkpoint's
    bytes, timed alternately (so both see the same machine load); MB/s of checkpoint bytes."""
    old_h = codec.tensor_hashes(old)
    blob = codec.encode(codec.diff(old, new, old_hashes=old_h), level=level, threads=threads)
    b = flat_tensors(new)
    frame = zstandard.ZstdCompressor(level=level, threads=threads).compress(
        b"".join(_raw(b[n]).tobytes() for n in sorted(b))
    )
    times: dict[str, list[float]] = {"flywheel": [], "zstd": []}
    for i in range(repeats + 1):  # the first round warms up (thread pools, allocator) and is not counted
        for k, fn in (
            ("flywheel", lambda: codec.apply(old, codec.decode(blob, background=True), base_hashes=old_h)),
            ("zstd", lambda: zstandard.ZstdDecompressor().decompress(frame)),
        ):
            t0 = time.perf_counter()
            fn()
            if i:
                times[k].append(time.perf_counter() - t0)
    full = codec.checkpoint_nbytes(new)
    fly, raw = statistics.median(times["flywheel"]), statistics.median(times["zstd"])
    return {"flywheel_MBps": full / fly / 1e6, "zstd_MBps": full / raw / 1e6, "ratio": raw / fly}


def run_flywheel(old: dict, new: dict, level: int, threads: int, repeats: int) -> dict:
    old_h = codec.tensor_hashes(old)  # the publisher and the replica already hold their base's table

    def enc():
        return codec.encode(
            codec.diff(old, new, old_hashes=old_h, new_hashes=codec.tensor_hashes(new)), level=level, threads=threads
        )

    blob, t_enc = timed(enc, repeats)
    out, t_dec = timed(lambda: codec.apply(old, codec.decode(blob, background=True), base_hashes=old_h), repeats)
    assert codec.tensor_hashes(out) == codec.tensor_hashes(new)
    return {"bytes": len(blob), "encode_s": t_enc, "decode_apply_s": t_dec}


def run_xor_zstd(old: dict, new: dict, level: int, threads: int, repeats: int) -> dict:
    a, b = flat_tensors(old), flat_tensors(new)
    names = sorted(b)

    def enc():
        x = np.concatenate([np.bitwise_xor(_raw(a[n]), _raw(b[n])) for n in names])
        return zstandard.ZstdCompressor(level=level, threads=threads).compress(x.tobytes())

    blob, t_enc = timed(enc, repeats)

    def dec():
        x = np.frombuffer(zstandard.ZstdDecompressor().decompress(blob), dtype=np.uint8)
        out, pos = {}, 0
        for n in names:
            raw = _raw(a[n])
            out[n] = np.bitwise_xor(raw, x[pos : pos + raw.size])
            pos += raw.size
        return out

    out, t_dec = timed(dec, repeats)
    assert all(np.array_equal(out[n], _raw(b[n])) for n in names)
    return {"bytes": len(blob), "encode_s": t_enc, "decode_apply_s": t_dec}


def run_zstd_full(old: dict, new: dict, level: int, threads: int, repeats: int) -> dict:
    b = flat_tensors(new)
    data = b"".join(_raw(b[n]).tobytes() for n in sorted(b))
    blob, t_enc = timed(lambda: zstandard.ZstdCompressor(level=level, threads=threads).compress(data), repeats)
    out, t_dec = timed(lambda: zstandard.ZstdDecompressor().decompress(blob), repeats)
    assert out == data
    return {"bytes": len(blob), "encode_s": t_enc, "decode_apply_s": t_dec}


def run_fireworks(fmt: str) -> Callable:
    def run(old: dict, new: dict, level: int, threads: int, repeats: int) -> dict:
        import warnings

        from fireworks_delta_compression import delta_compress_dicts, delta_decompress

        warnings.filterwarnings(
            "ignore", message="The given buffer is not writable"
        )  # arc2 wraps read-only bytes; harmless here
        a, b = flat_tensors(old), flat_tensors(new)
        (diffs, sums), t_enc = timed(lambda: delta_compress_dicts(a, b, fmt), repeats)

        def dec():
            return {
                k: delta_decompress(src=a[k], compressed_diff=diffs[k], checksum=sums[k], compression_format=fmt)
                for k in diffs
            }

        out, t_dec = timed(dec, repeats)
        assert all(torch.equal(out[k].view(torch.uint8), b[k].view(torch.uint8)) for k in b)
        return {"bytes": sum(d.numel() for d in diffs.values()), "encode_s": t_enc, "decode_apply_s": t_dec}

    return run


# zipnn's byte mode rejects uint8; a 1-byte float type gives the same byte handling
_ZIPNN_DTYPE = {
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
    torch.float8_e4m3fn: "float8_e4m3fn",
    torch.uint8: "float8_e4m3fn",
}


def run_zipnn(old: dict, new: dict, level: int, threads: int, repeats: int) -> dict:
    from zipnn import ZipNN

    a, b = flat_tensors(old), flat_tensors(new)
    z = {
        dt: ZipNN(input_format="byte", bytearray_dtype=name, delta_compressed_type="byte", threads=max(1, threads))
        for dt, name in _ZIPNN_DTYPE.items()
    }
    raw_a = {k: _raw(t).tobytes() for k, t in a.items()}
    blobs, t_enc = timed(
        lambda: {k: bytes(z[t.dtype].compress(_raw(t).tobytes(), delta_second_data=raw_a[k])) for k, t in b.items()},
        repeats,
    )
    out, t_dec = timed(
        lambda: {k: bytes(z[b[k].dtype].decompress(c, delta_second_data=raw_a[k])) for k, c in blobs.items()}, repeats
    )
    assert all(out[k] == _raw(b[k]).tobytes() for k in b)
    return {"bytes": sum(len(c) for c in blobs.values()), "encode_s": t_enc, "decode_apply_s": t_dec}


RUNNERS = {
    "flywheel": run_flywheel,
    "xor+zstd": run_xor_zstd,
    "zstd (full)": run_zstd_full,
    "arc_v2": run_fireworks("arc_v2"),
    "arc_v3": run_fireworks("arc_v3"),
    "zipnn": run_zipnn,
}


def part_ratios(old: dict, new: dict, level: int) -> dict:
    """The flywheel delta of the FP4 tensors alone and of the high-precision ones alone, each
    against its share of the full checkpoint: what a model with another mix would see."""
    d = codec.diff(old, new)
    out = {}
    for part, keep in (
        ("fp4", lambda e: isinstance(e, fp4.PackedTensor)),
        ("dense", lambda e: not isinstance(e, fp4.PackedTensor)),
    ):
        names = {n for n, e in new.items() if keep(e)}
        sub = codec.Delta(
            d.base_version, d.version, d.base_digest, d.digest, {n: td for n, td in d.changed.items() if n in names}
        )
        full = codec.checkpoint_nbytes({n: new[n] for n in names})
        out[part] = {
            "full_bytes": full,
            "delta_bytes": len(codec.encode(sub, level=level)),
            "changed_tensors": len(sub.changed),
            "tensors": len(names),
        }
    return out


def changed_fraction(old: dict, new: dict) -> dict:
    """Share of bytes of packed FP4 codes and of bf16 elements that differ."""
    codes = dense = codes_n = dense_n = 0
    for n, e in new.items():
        if isinstance(e, fp4.PackedTensor):
            codes += int((old[n].weight_packed != e.weight_packed).sum())
            codes_n += e.weight_packed.numel()
        else:
            dense += int((old[n].view(torch.int16) != e.view(torch.int16)).sum())
            dense_n += e.numel()
    return {"fp4_code_bytes": codes / max(1, codes_n), "bf16_elements": dense / max(1, dense_n)}


# --- checkpoint pairs ------------------------------------------------------------------------------


def checkpoint_series(
    model: Transformer,
    data: TrainingData,
    cfg,
    lr: float,
    steps: int,
    versions: int,
    train_weights: Sequence[str] | None = (".*",),
) -> list[dict[str, torch.Tensor]]:
    """State dicts after 0, steps, 2*steps, ... AdamW steps of FP4 QAT at a constant `lr`,
    changing only the weights `train_weights` names (learner.train.learn.train_weights: None is
    the learner's default)."""
    model = copy.deepcopy(model).train()
    train_only(model, train_weights)
    c = cfg.model_copy(update={"lr": lr})
    params = [p for p in model.parameters() if p.requires_grad]
    decay, no_decay = [p for p in params if p.ndim >= 2], [p for p in params if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": c.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
    )
    hook = fp4_hook(cfg.fp4 if cfg.fp4 != "off" else "nvfp4")
    out = [{k: v.detach().clone() for k, v in model.state_dict().items()}]
    step = 0
    for _ in range(versions):
        for _ in range(steps):
            train_step(model, opt, data.batch(step), hook=hook, cfg=c)
            step += 1
        out.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return out


def _base(settings: FlywheelSettings, cfg, console: Console):
    corpus = load_corpus(cfg.corpus, heldout_fraction=cfg.heldout_fraction, max_file_bytes=cfg.max_file_kb * 1024)
    base = find_base_model(settings)
    if base is not None:
        model, _ = load_master_weights(base)
        tok, what = load_tokenizer(base / "tokenizer"), f"trained base {cfg.size} (fp32 master weights, {base})"
    else:
        tok = train_tokenizer((f.text for f in corpus.train[:300]), cfg.vocab_size)
        torch.manual_seed(cfg.seed)
        model = Transformer(ModelArgs.from_name(cfg.size, vocab_size=tok.get_vocab_size(), max_seq_len=SEQ_LEN))
        what = f"random {cfg.size} model (no trained base cached: run `flywheel pretrain` first)"
    console.print(f"weights: {what}")
    data = TrainingData(
        tok,
        own_format(tok, SEQ_LEN, fim=cfg.fim_template),
        corpus.train,
        seq_len=SEQ_LEN,
        batch_size=BATCH,
        fim_rate=cfg.fim_rate,
        summary_rate=cfg.summary_rate,
        seed=cfg.seed + 1,
    )
    return model, data, what, tok, corpus


# --- the benchmark ---------------------------------------------------------------------------------


def run_bench(
    settings: FlywheelSettings,
    console: Console,
    *,
    lrs: tuple[float, ...] = (1e-6, 1e-5),
    steps: int = 10,
    versions: int = 2,
    level: int = 3,
    threads: int = -1,
    repeats: int = 3,
    methods: tuple[str, ...] = METHODS,
    swap: bool = False,
    swaps: int = 8,
    swap_compare: str = "reload",
    out: str | Path | None = None,
    command: str = "flywheel bench delta",
) -> dict:
    cfg = getattr(settings, "pretrain", None) or PretrainSection()
    torch.set_num_threads(cfg.threads)
    t0 = time.perf_counter()
    missing = [m for m in methods if not _installed(m)]
    if missing:
        console.print(f"left out (install with `pip install -e .[bench]`): {', '.join(missing)}", markup=False)
        methods = tuple(m for m in methods if m not in missing)
    model, data, what, tok, corpus = _base(settings, cfg, console)
    results: dict = {
        "command": command,
        "weights": what,
        "steps_per_version": steps,
        "versions": versions,
        "zstd_level": level,
        "zstd_threads": threads,
        "torch_threads": torch.get_num_threads(),
        "tensor_hash": codec.HASH,  # what encode and apply hash each tensor with
        "batch": [BATCH, SEQ_LEN],
        "runs": [],
    }
    learn = getattr(settings, "learn", None) or LearnSection()
    trained = train_weights(model, learn.train_weights)
    results["train_weights"] = trained
    console.print(f"training the weights learn.train_weights names: {trained}", markup=False)
    series = []
    for lr in lrs:
        with console.status(f"lr {lr:g}: {steps * versions} training steps"):
            states = checkpoint_series(model, data, cfg, lr, steps, versions, trained)
        packed = [pack_checkpoint(s, cfg.fp4 if cfg.fp4 != "off" else "nvfp4") for s in states]
        series.append(packed)
        for v in range(1, len(states)):
            pair = {"lr": lr, "pair": [v - 1, v], "forms": {}}
            forms = {
                "packed fp4": (packed[v - 1], packed[v]),
                "bf16": (to_hf_tensors(packed[v - 1]), to_hf_tensors(packed[v])),
            }
            for form, (old, new) in forms.items():
                full = codec.checkpoint_nbytes(new)
                row = {"full_bytes": full, "methods": {}}
                for m in methods:
                    with console.status(f"lr {lr:g}, v{v - 1}->v{v}, {form}: {m}"):
                        r = RUNNERS[m](old, new, level, threads, repeats if m not in ("arc_v3", "zipnn") else 1)
                    r["ratio"] = full / r["bytes"]
                    r["encode_MBps"] = full / r["encode_s"] / 1e6
                    r["decode_apply_MBps"] = full / r["decode_apply_s"] / 1e6
                    row["methods"][m] = r
                with console.status(f"lr {lr:g}, v{v - 1}->v{v}, {form}: flywheel beside raw zstd"):
                    row["vs_zstd"] = flywheel_vs_zstd(old, new, level, threads, max(VS_ZSTD_ROUNDS, repeats))
                pair["forms"][form] = row
            pair["flywheel_parts"] = part_ratios(packed[v - 1], packed[v], level)
            pair["changed"] = changed_fraction(packed[v - 1], packed[v])
            results["runs"].append(pair)
    if swap:
        with console.status("swap: starting vLLM, then swaps under load"):
            results["swap"] = asyncio.run(
                bench_swap(
                    model.args,
                    tok,
                    series[0],
                    [f.text for f in corpus.heldout],
                    settings,
                    lr=lrs[0],
                    swaps=swaps,
                    compare=swap_compare,
                )
            )
    results["wall_s"] = time.perf_counter() - t0
    console.print(_table(results))
    for line in _notes(results):
        console.print(line)
    if swap:
        console.print(_swap_table(results["swap"]))
    console.print(
        f"command: [bold]{command}[/]  ({results['wall_s']:.0f} s; torch threads {results['torch_threads']}, "
        f"tensor hash {results['tensor_hash']}, zstd threads {threads})"
    )
    if out:
        Path(out).write_text(json.dumps(results, indent=2) + "\n")
        console.print(f"results written to {out}")
    return results


def _table(r: dict) -> Table:
    t = Table(
        title=f"flywheel bench delta: full / delta ({r['steps_per_version']} AdamW steps per version, zstd level {r['zstd_level']})"
    )
    for i, name in enumerate(
        (
            "lr",
            "pair",
            "method",
            "packed\n1/x",
            "bf16\n1/x",
            "packed\nenc MB/s",
            "packed\ndec+apply",
            "bf16\nenc MB/s",
            "bf16\ndec+apply",
        )
    ):
        t.add_column(name, no_wrap=i < 3, justify="left" if i < 3 else "right")
    for p in r["runs"]:
        packed, bf16 = p["forms"]["packed fp4"], p["forms"]["bf16"]
        for i, m in enumerate(packed["methods"]):
            a, b = packed["methods"][m], bf16["methods"][m]
            t.add_row(
                f"{p['lr']:g}" if i == 0 else "",
                f"v{p['pair'][0]}->v{p['pair'][1]}" if i == 0 else "",
                m,
                f"{a['ratio']:.1f}",
                f"{b['ratio']:.1f}",
                f"{a['encode_MBps']:.0f}",
                f"{a['decode_apply_MBps']:.0f}",
                f"{b['encode_MBps']:.0f}",
                f"{b['decode_apply_MBps']:.0f}",
                end_section=i == len(packed["methods"]) - 1,
            )
    return t


def _installed(method: str) -> bool:
    import importlib.util

    module = {"arc_v2": "fireworks_delta_compression", "arc_v3": "fireworks_delta_compression", "zipnn": "zipnn"}
    return method not in module or importlib.util.find_spec(module[method]) is not None


def _notes(r: dict) -> list[str]:
    out = []
    for p in r["runs"]:
        for form, row in p["forms"].items():
            z = row["vs_zstd"]
            out.append(
                f"lr {p['lr']:g} v{p['pair'][0]}->v{p['pair'][1]} {form}: flywheel decode+apply (verified) "
                f"{z['flywheel_MBps']:.0f} MB/s beside raw zstd decode of the same checkpoint bytes "
                f"{z['zstd_MBps']:.0f} MB/s, timed alternately: {z['ratio']:.2f}x (target >= 0.5)"
            )
    for p in r["runs"]:
        parts, ch, full = p["flywheel_parts"], p["changed"], p["forms"]["packed fp4"]["full_bytes"]
        out.append(
            f"lr {p['lr']:g} v{p['pair'][0]}->v{p['pair'][1]}: packed checkpoint {full / 1e6:.2f} MB; flywheel delta of the FP4 tensors "
            f"1/{parts['fp4']['full_bytes'] / parts['fp4']['delta_bytes']:.0f} of their bytes, of the bf16 tensors "
            f"1/{parts['dense']['full_bytes'] / parts['dense']['delta_bytes']:.1f} (bf16 is {parts['dense']['full_bytes'] / full:.0%} of this model's "
            f"packed bytes); changed: {ch['fp4_code_bytes']:.2%} of FP4 code bytes, {ch['bf16_elements']:.1%} of bf16 elements"
        )
    return out


# --- swaps under load --------------------------------------------------------------------------


SWAP_COMPARISONS = {"reload": ("vllm", "prepared"), "preempt": ("wait", "restart")}
"""The two ways of swapping each comparison alternates (serving.hotswap). `reload`: `vllm` runs
vLLM's in-place reload inside the pause, `prepared` builds the new weights beside the live model
while serving goes on and only copies them in during the pause (`engine.prepared_reload`), both
restarting in-flight requests. `preempt`: `wait` lets every request in flight finish on the old
weights, `restart` gives them `serve.swap_preempt_after_ms`, then aborts those whose client saw
nothing and runs them again on the new version, both with the prepared reload."""


def swap_plan(swaps: int, versions: int, modes: tuple[str, str] = SWAP_COMPARISONS["preempt"]) -> list[tuple[int, str]]:
    """(target version, mode) of each swap: back and forth over the versions (v1, v2, ..., v0,
    v1, ...: each swap is one version's change), with the two modes in ABBA order, so each mode
    gets as many of each direction and of the run's early and late load."""
    if versions < 2:
        raise ValueError("swaps need at least 2 versions")
    a, b = modes
    abba = (a, b, b, a)
    return [((i + 1) % versions, abba[i % 4]) for i in range(swaps)]


def swap_summary(done: list[tuple[float, float, bool, int]], swaps: list[dict], t_first: float) -> dict:
    """Per mode: the swaps' pause, wait for in-flight requests and reload (median and max, as a
    replica's p99 over a handful of swaps is its max), requests restarted, and the latency of the
    requests that overlapped that mode's swaps; and the steady latency before the first swap.
    `done`: (start, end, ok, version) per request; `swaps`: dicts with mode, start, end, pause_s,
    drain_s, reload_s and restarted."""
    pct = lambda xs, q: float(np.percentile(xs, q)) if xs else float("nan")  # noqa: E731

    def latencies(windows: list[tuple[float, float]]) -> list[float]:
        return [e - s for s, e, ok, _ in done if ok and any(s < we and e > ws for ws, we in windows)]

    steady = [e - s for s, e, ok, _ in done if ok and e < t_first]
    modes = {}
    for mode in dict.fromkeys(w["mode"] for w in swaps):  # in the order they first ran
        mine = [w for w in swaps if w["mode"] == mode]
        during = latencies([(w["start"], w["end"]) for w in mine])
        modes[mode] = {
            "swaps": len(mine),
            "pause_p50_s": pct([w["pause_s"] for w in mine], 50),
            "pause_max_s": max(w["pause_s"] for w in mine),
            "drain_p50_s": pct([w["drain_s"] for w in mine], 50),
            "reload_p50_s": pct([w["reload_s"] for w in mine], 50),
            "restarted": sum(w["restarted"] for w in mine),
            "during": {"n": len(during), "p50_s": pct(during, 50), "p99_s": pct(during, 99)},
        }
    out = {"steady": {"n": len(steady), "p50_s": pct(steady, 50), "p99_s": pct(steady, 99)}, "modes": modes}
    if len(modes) == 2:
        (a, w), (b, r) = modes.items()
        out["ratio_of"] = f"{a} / {b}"
        out["pause_ratio"] = w["pause_max_s"] / r["pause_max_s"] if r["pause_max_s"] > 0 else float("inf")
        out["during_p99_ratio"] = w["during"]["p99_s"] / r["during"]["p99_s"] if r["during"]["n"] else float("nan")
    return out


async def bench_swap(
    args: ModelArgs,
    tok,
    packed: list[dict],
    texts: list[str],
    settings,
    *,
    lr: float,
    clients: int = 8,
    max_tokens: int = 32,
    swaps: int = 8,
    compare: str = "reload",
    steady_s: float = 8.0,
    gap_s: float = 3.0,
) -> dict:
    """Publish `packed` (v0, v1, ...) to a temporary store, serve v0 with vLLM, keep `clients`
    concurrent greedy completions going, and swap `swaps` times (`swap_plan`), alternating the two
    modes of `SWAP_COMPARISONS[compare]` on the same engine and load."""
    from learner.export import export_hf
    from learner.formats import read_format
    from learner.store import open_store
    from serving.engine import SamplingSpec, VLLMEngine
    from serving.hotswap import HotSwapper
    from serving.replica import CompletionService, GenerateRequest
    from serving.settings import EngineSettings, ServeSettings

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    serve = getattr(settings, "serve", None) or ServeSettings()
    preempt_s = max(0, serve.swap_preempt_after_ms) / 1000  # `restart` mode even where the setting says -1
    tmp = Path(tempfile.mkdtemp(prefix="flywheel-bench-swap-"))
    store = open_store(tmp / "store")
    for v, c in enumerate(packed):
        store.publish(c, parent=v - 1 if v else None)
    with torch.device("meta"):
        served = Transformer(args)
    served.load_state_dict({k: t.float() for k, t in to_hf_tensors(packed[0]).items()}, assign=True)
    folder = export_hf(served, args, tok, tmp / "hf")  # exactly v0's bf16 tensors
    n_ctx = args.max_seq_len  # vLLM refuses a window beyond the model's positions
    cfg = ServeSettings(
        engine=EngineSettings(max_model_len=n_ctx, max_num_seqs=16),
        context_budget=n_ctx - max_tokens - 16,
        summary_chunk_tokens=32,
    )
    t_start = time.perf_counter()
    engine = VLLMEngine(folder, cfg.engine)
    started_s = time.perf_counter() - t_start
    plan = swap_plan(swaps, len(packed), SWAP_COMPARISONS[compare])
    try:
        service = CompletionService(engine, tok, read_format(folder), cfg, version=0)
        swapper = HotSwapper(service, store)
        swapper.adopt(0)
        prompts = [t[:200] for t in texts if len(t) > 200][:64] or ["def f(x):\n    return "]
        spec = SamplingSpec(max_tokens=max_tokens, temperature=0.0, stream=False)
        done: list[tuple[float, float, bool, int]] = []  # start, end, ok, version
        stop = asyncio.Event()

        async def client(c: int) -> None:
            i = 0
            while not stop.is_set():
                t0 = time.perf_counter()
                try:
                    r = await service.complete(
                        GenerateRequest(f"b{c}-{i}", prompts[(c * 7 + i) % len(prompts)], None, None, spec)
                    )
                    done.append((t0, time.perf_counter(), True, r.model_version))
                except Exception:
                    done.append((t0, time.perf_counter(), False, -1))
                i += 1

        await service.complete(GenerateRequest("warmup", prompts[0], None, None, spec))
        tasks = [asyncio.create_task(client(c)) for c in range(clients)]
        await asyncio.sleep(steady_s)
        rows = []
        for v, mode in plan:
            swapper.preempt_after_s = None if mode == "wait" else preempt_s
            engine.prepared_reload = mode != "vllm"
            t0 = time.perf_counter()
            r = await swapper.swap_to(v)
            rows.append(
                {
                    "mode": mode,
                    "frm": r.from_version,
                    "to": r.target,
                    "start": t0,
                    "end": time.perf_counter(),
                    "tensors": r.tensors_reloaded,
                    "reload_bytes": r.reload_bytes,
                    "prepare_s": r.prepare_s,
                    "stage_s": r.stage_s,
                    "pause_s": r.pause_s,
                    "drain_s": r.drain_s,
                    "reload_s": r.reload_s,
                    "restarted": r.restarted,
                    "prepared": r.prepared,
                }
            )
            await asyncio.sleep(gap_s)
        stop.set()
        await asyncio.gather(*tasks)
    finally:
        engine.shutdown()

    return {
        "lr": lr,
        "clients": clients,
        "max_tokens": max_tokens,
        "preempt_after_ms": preempt_s * 1000,
        "compare": compare,
        "engine_start_s": started_s,
        "requests": len(done),
        "failed": sum(not ok for *_, ok, _ in done),
        "swaps": rows,
        **swap_summary(done, rows, rows[0]["start"] if rows else float("inf")),
    }


def _swap_table(s: dict) -> Table:
    what = {
        "reload": "`vllm` reloads inside the pause, `prepared` only copies in weights built while serving",
        "preempt": f"`wait` lets in-flight requests finish, `restart` restarts them after {s['preempt_after_ms']:g} ms",
    }[s.get("compare", "preempt")]
    t = Table(
        title=f"swaps under load: {s['clients']} clients, {s['max_tokens']}-token greedy completions, lr {s['lr']:g} "
        f"versions; {what}"
    )
    for name in ("swap", "mode", "tensors", "MB", "prepare s", "pause s", "drain s", "reload s", "restarted"):
        t.add_column(name, justify="right")
    for w in s["swaps"]:
        t.add_row(
            f"v{w['frm']}->v{w['to']}",
            w["mode"],
            str(w["tensors"]),
            f"{w['reload_bytes'] / 1e6:.2f}",
            f"{w['prepare_s']:.3f}",
            f"{w['pause_s']:.3f}",
            f"{w['drain_s']:.3f}",
            f"{w['reload_s']:.3f}",
            str(w["restarted"]),
        )
    st = s["steady"]
    lines = [f"steady latency p50/p99 {st['p50_s']:.2f}/{st['p99_s']:.2f} s (n={st['n']})"]
    for mode, m in s["modes"].items():
        du = m["during"]
        lines.append(
            f"{mode}: pause p50 {m['pause_p50_s'] * 1000:.0f} ms, max {m['pause_max_s'] * 1000:.0f} ms (target 100); "
            f"requests overlapping its swaps p50/p99 {du['p50_s']:.2f}/{du['p99_s']:.2f} s (n={du['n']}); "
            f"{m['restarted']} restarted"
        )
    if "pause_ratio" in s:
        lines.append(
            f"{s['ratio_of']}: max pause x{s['pause_ratio']:.1f}, p99 of overlapping requests x{s['during_p99_ratio']:.2f}"
        )
    fell_back = sum(1 for w in s["swaps"] if w["mode"] != "vllm" and not w.get("prepared", True))
    if fell_back:
        lines.append(f"{fell_back} swap(s) meant to be prepared reloaded the vLLM way (see the log for why)")
    lines.append(f"failed {s['failed']} of {s['requests']} requests")
    t.caption = "\n".join(lines)
    return t
