"""`flywheel bench fp4`: every FP4 number next to its baseline, measured in the same run.

(a) quantization error, NVFP4 vs MXFP4 (baseline), on Gaussian data and on the expert
    weights of the cached trained base (its fp32 master weights), or of a random `tiny`
    model when no base is cached (the output says which);
(b) encode / decode and nibble pack / unpack throughput vs `tensor.clone()` of the same bytes;
    decode by table lookup (learner.fp4.decode) also beside the formula evaluated element by
    element, as the codec decoded before;
(c) held-out loss after the same steps of NVFP4 QAT (+ router replay) vs bf16 training,
    on a reduced config with the same data and seed; also bf16 training quantized after
    the fact (PTQ) and QAT without replay;
(d) router replay: KL(high-precision forward || FP4 forward), replaying the high-precision
    routing vs letting the FP4 forward route itself, and how many routing decisions flip.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from feedback.core.config import FlywheelSettings
from learner import fp4
from learner.corpus import TrainingData, heldout_windows, token_stream
from learner.formats import own_format
from learner.model import ModelArgs, Transformer
from learner.tokenizer import load_tokenizer, train_tokenizer
from learner.train.pretrain import (
    evaluate,
    find_base_model,
    fp4_hook,
    load_master_weights,
    load_training_corpus,
    lr_at,
    make_optimizer,
    pretrain_section,
    train_step,
)

# (c) runs on this reduced config: big enough to have real routing, small enough for minutes.
REDUCED = dict(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, n_experts=8, top_k=2, moe_dim=128)
REDUCED_SEQ_LEN, REDUCED_BATCH = 128, 8


# --- measurements (pure functions of tensors and models) ------------------------------------------


def quant_error(tensors: list[torch.Tensor], fmt: str) -> dict[str, float]:
    """Relative MSE sum|x - q(x)|^2 / sum|x|^2 over all tensors, and the SNR in dB."""
    err = ref = 0.0
    for x in tensors:
        x = x.detach().float()
        err += (x - fp4.quantize_dequantize(x, fmt)).pow(2).sum().item()
        ref += x.pow(2).sum().item()
    rel = err / ref
    return {"rel_mse": rel, "snr_db": -10 * torch.log10(torch.tensor(rel)).item()}


def seconds(fn: Callable[[], object], repeats: int = 5) -> float:
    """Median wall time of fn over `repeats` runs, after one warm-up run."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def kl_div(logits_p: torch.Tensor, logits_q: torch.Tensor) -> float:
    """Mean over tokens of KL(p || q), both given as logits [..., V]."""
    lp, lq = F.log_softmax(logits_p.float(), -1), F.log_softmax(logits_q.float(), -1)
    return (lp.exp() * (lp - lq)).sum(-1).mean().item()


@torch.no_grad()
def replay_kl(model: Transformer, ids_BS: torch.Tensor, fmt: str) -> dict[str, float]:
    """KL(high-precision || FP4) with and without replaying the high-precision routing, and
    the fraction of (token, layer) expert sets that differ when the FP4 forward routes itself."""
    hook = fp4_hook(fmt)
    hp, routing_hp = model(ids_BS, return_routing=True)
    free, routing_fp4 = model(ids_BS, fp4=hook, return_routing=True)
    replayed = model(ids_BS, fp4=hook, routing=routing_hp)
    flips = [
        (a.sort(-1).values != b.sort(-1).values).any(-1).float().mean().item() for a, b in zip(routing_hp, routing_fp4)
    ]
    return {
        "kl_no_replay": kl_div(hp, free),
        "kl_replay": kl_div(hp, replayed),
        "routing_flip_fraction": sum(flips) / len(flips),
        "routing_flip_fraction_per_layer": flips,
    }


# --- the benchmark ---------------------------------------------------------------------------------


def run_bench(
    settings: FlywheelSettings,
    console: Console,
    *,
    steps: int = 150,
    out: str | Path | None = None,
    command: str = "flywheel bench fp4",
    parts: str = "abcd",
) -> dict:
    """Run the `parts` of (a)-(d), print a table and the command, and write JSON to `out` if given.
    (d) without a trained base replays on the model (c) trains, so it runs (c) too."""
    cfg = pretrain_section(settings)
    torch.set_num_threads(cfg.threads)
    base = find_base_model(settings)
    t0 = time.perf_counter()
    results: dict = {"command": command, "threads": torch.get_num_threads()}
    if base is not None:
        model, _ = load_master_weights(base)
        results["weights"] = f"trained base {cfg.size} (fp32 master weights, {base})"
    else:
        torch.manual_seed(cfg.seed)
        model = Transformer(ModelArgs.from_name("tiny"))
        results["weights"] = "random tiny model (no trained base cached: run `flywheel pretrain` first)"
    console.print(f"weights for (a) and (d): {results['weights']}")

    if "d" in parts and base is None:
        parts += "c"
    if "a" in parts:
        with console.status("(a) quantization error"):
            results["quant_error"] = _bench_error(model)
    if "b" in parts:
        with console.status("(b) throughput"):
            results["throughput"] = _bench_throughput()
    if "c" in parts:
        with console.status(f"(c) QAT vs bf16, {steps} steps each"):
            results["qat_vs_bf16"], trained, windows = _bench_qat(settings, cfg, steps, base)
    if "d" in parts:
        with console.status("(d) router replay"):
            if base is None:
                model, results["replay_model"] = trained, "the (c) QAT model (reduced config)"
                ids = windows[:, :-1]
            else:
                results["replay_model"] = results["weights"]
                ids = _base_heldout(base, cfg)
            results["router_replay"] = {f: replay_kl(model, ids, f) for f in ("nvfp4", "mxfp4")}
    results["wall_s"] = time.perf_counter() - t0

    console.print(_table(results))
    console.print(f"command: [bold]{command}[/]  ({results['wall_s']:.0f} s, {results['threads']} threads)")
    if out:
        Path(out).write_text(json.dumps(results, indent=2) + "\n")
        console.print(f"results written to {out}")
    return results


def _bench_error(model: Transformer) -> dict:
    gauss = [torch.randn(1024, 4096, generator=torch.Generator().manual_seed(0))]
    experts = [p for n, p in model.named_parameters() if fp4.is_fp4_target(n)]
    return {
        name: {f: quant_error(ts, f) for f in ("nvfp4", "mxfp4")}
        for name, ts in (("gaussian 1024x4096", gauss), (f"expert weights ({len(experts)} matrices)", experts))
    }


def decode_by_formula(p: fp4.PackedTensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The baseline decoder: the formula element by element (unpack the nibbles, look each code's
    value up, multiply by its block's unit), as learner.fp4 decoded before it used tables."""
    q = fp4.unpack(p)
    values = fp4.E2M1_VALUES[q.codes.long()].unflatten(-1, (-1, p.fmt.block_size))  # [..., NB, B]
    if p.fmt == fp4.NVFP4:
        unit = q.scales.float() * q.global_scale
    else:
        unit = torch.exp2(q.scales.int().float() - 127)
    return (values * unit.unsqueeze(-1)).flatten(-2).to(dtype)


def seconds_beside(fn: Callable[[], object], baseline: Callable[[], object], repeats: int = 7) -> tuple[float, float]:
    """Median wall times of fn and of baseline, run alternately, so both see the same machine load."""
    fn(), baseline()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for f, out in ((fn, times[0]), (baseline, times[1])):
            t0 = time.perf_counter()
            f()
            out.append(time.perf_counter() - t0)
    return statistics.median(times[0]), statistics.median(times[1])


def _bench_throughput() -> dict:
    """Seconds per call of each codec step, each beside `clone()` of its input (or the formula)
    timed alternately with it."""
    x = torch.randn(2048, 4096, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    out: dict = {"bytes_bf16": x.numel() * 2}
    for f in ("nvfp4", "mxfp4"):
        p = fp4.pack(fp4.quantize(x, f))
        assert torch.equal(fp4.decode(p).view(torch.int16), decode_by_formula(p).view(torch.int16))
        out[f"{f}_encode_s"], out[f"{f}_encode_clone_s"] = seconds_beside(
            lambda f=f: fp4.pack(fp4.quantize(x, f)), x.clone
        )
        out[f"{f}_decode_s"], out[f"{f}_decode_clone_s"] = seconds_beside(lambda p=p: fp4.decode(p), x.clone)
        out[f"{f}_decode_table_s"], out[f"{f}_decode_formula_s"] = seconds_beside(
            lambda p=p: fp4.decode(p), lambda p=p: decode_by_formula(p)
        )
    codes = fp4.quantize(x, "nvfp4").codes
    packed = fp4.pack_codes(codes)
    out["bytes_codes"] = codes.numel()
    out["pack_codes_s"], out["pack_clone_s"] = seconds_beside(lambda: fp4.pack_codes(codes), codes.clone)
    out["unpack_codes_s"], out["unpack_clone_s"] = seconds_beside(lambda: fp4.unpack_codes(packed), codes.clone)
    return out


def _bench_qat(settings, cfg, steps: int, base: Path | None) -> tuple[dict, Transformer, torch.Tensor]:
    corpus = load_training_corpus(cfg)
    tok = (
        load_tokenizer(base / "tokenizer")
        if base is not None
        else train_tokenizer((f.text for f in corpus.train), cfg.vocab_size)
    )
    args = ModelArgs(vocab_size=tok.get_vocab_size(), max_seq_len=REDUCED_SEQ_LEN, **REDUCED)
    fmt = own_format(tok, REDUCED_SEQ_LEN, fim=cfg.fim_template)
    data = TrainingData(
        tok,
        fmt,
        corpus.train,
        seq_len=REDUCED_SEQ_LEN,
        batch_size=REDUCED_BATCH,
        fim_rate=cfg.fim_rate,
        summary_rate=cfg.summary_rate,
        seed=cfg.seed,
    )
    windows = heldout_windows(token_stream(fmt, tok, corpus.heldout), REDUCED_SEQ_LEN, 64)
    run_cfg = cfg.model_copy(update={"steps": steps, "minutes": 1e6, "warmup_steps": min(20, steps // 5)})

    def run(fmt: str, replay: bool) -> tuple[Transformer, float]:
        torch.manual_seed(cfg.seed)
        model = Transformer(args).train()
        opt = make_optimizer(model, run_cfg)
        c = run_cfg.model_copy(update={"fp4": fmt, "router_replay": replay})
        hook = fp4_hook(fmt)
        t0 = time.perf_counter()
        for step in range(steps):
            for g in opt.param_groups:
                g["lr"] = lr_at(step, step / steps, c)
            train_step(model, opt, data.batch(step), hook=hook, cfg=c)
        return model, time.perf_counter() - t0

    bf16, t_bf16 = run("off", False)
    qat, t_qat = run("nvfp4", True)
    qat_free, _ = run("nvfp4", False)
    res = {
        "config": {
            **REDUCED,
            "seq_len": REDUCED_SEQ_LEN,
            "batch_size": REDUCED_BATCH,
            "steps": steps,
            "vocab_size": args.vocab_size,
        },
        "heldout_tokens": int(windows[:, 1:].numel()),
        "bf16": evaluate(bf16, windows),
        "bf16_then_ptq_nvfp4": evaluate(bf16, windows, hook=fp4_hook("nvfp4")),
        "qat_nvfp4_replay": evaluate(qat, windows, hook=fp4_hook("nvfp4")),
        "qat_nvfp4_no_replay": evaluate(qat_free, windows, hook=fp4_hook("nvfp4")),
        "train_s_bf16": t_bf16,
        "train_s_qat_replay": t_qat,
    }
    return res, qat.eval(), windows


def _base_heldout(base: Path, cfg) -> torch.Tensor:
    corpus = load_training_corpus(cfg)
    tok = load_tokenizer(base / "tokenizer")
    return heldout_windows(token_stream(own_format(tok, cfg.seq_len), tok, corpus.heldout), cfg.seq_len, 16)[:, :-1]


DECODE_TARGET_GBS = 2.0
"""What decoding should sustain (GB/s of bf16): a whole small checkpoint in milliseconds."""


def _table(r: dict) -> Table:
    t = Table("", "measure", "FP4 / candidate", "baseline", "ratio", title="flywheel bench fp4")
    for data, e in r.get("quant_error", {}).items():
        nv, mx = e["nvfp4"], e["mxfp4"]
        t.add_row(
            "a",
            f"rel. MSE, {data}",
            f"NVFP4 {nv['rel_mse']:.2e} ({nv['snr_db']:.1f} dB)",
            f"MXFP4 {mx['rel_mse']:.2e} ({mx['snr_db']:.1f} dB)",
            f"{mx['rel_mse'] / nv['rel_mse']:.2f}x lower",
        )
    if "throughput" in r:
        _throughput_rows(t, r["throughput"])
    if "qat_vs_bf16" in r:
        q = r["qat_vs_bf16"]
        base_loss = q["bf16"]["loss"]
        steps = q["config"]["steps"]
        for name, label in (
            ("qat_nvfp4_replay", "NVFP4 QAT + replay, FP4 eval"),
            ("qat_nvfp4_no_replay", "NVFP4 QAT, no replay, FP4 eval"),
            ("bf16_then_ptq_nvfp4", "bf16 train, NVFP4 PTQ eval"),
        ):
            t.add_row(
                "c",
                f"held-out loss after {steps} steps: {label}",
                f"{q[name]['loss']:.4f}",
                f"bf16 {base_loss:.4f}",
                f"{q[name]['loss'] / base_loss:.4f}x",
            )
    for f, d in r.get("router_replay", {}).items():
        t.add_row(
            "d",
            f"KL(hp || {f}) with hp routing replayed",
            f"{d['kl_replay']:.2e}",
            f"no replay {d['kl_no_replay']:.2e}",
            f"{d['kl_no_replay'] / max(d['kl_replay'], 1e-30):.1f}x lower",
        )
        t.add_row(
            "d",
            f"routing decisions flipped by {f} (no replay)",
            f"{d['routing_flip_fraction']:.1%}",
            "0% with replay",
            "",
        )
    return t


def _throughput_rows(t: Table, th: dict) -> None:
    gbs = lambda n, s: n / s / 1e9  # noqa: E731
    for f in ("nvfp4", "mxfp4"):
        for op in ("encode", "decode"):
            v, clone = gbs(th["bytes_bf16"], th[f"{f}_{op}_s"]), gbs(th["bytes_bf16"], th[f"{f}_{op}_clone_s"])
            target = f" (target {DECODE_TARGET_GBS:g})" if op == "decode" else ""
            t.add_row(
                "b",
                f"{f} {op} (bf16 {'->' if op == 'encode' else '<-'} packed), GB/s of bf16{target}",
                f"{v:.2f}",
                f"clone {clone:.2f}",
                f"{v / clone:.3f}x",
            )
        table = gbs(th["bytes_bf16"], th[f"{f}_decode_table_s"])
        formula = gbs(th["bytes_bf16"], th[f"{f}_decode_formula_s"])
        t.add_row(
            "b",
            f"{f} decode by table lookup vs the formula element by element, GB/s",
            f"{table:.2f}",
            f"formula {formula:.2f}",
            f"{table / formula:.1f}x",
        )
    for op in ("pack", "unpack"):
        v, clone = gbs(th["bytes_codes"], th[f"{op}_codes_s"]), gbs(th["bytes_codes"], th[f"{op}_clone_s"])
        t.add_row("b", f"nibble {op}, GB/s of 1-byte codes", f"{v:.2f}", f"clone {clone:.2f}", f"{v / clone:.3f}x")
