"""`flywheel bench train`: pretraining tokens/s with the grouped expert computation against the
expert loop it replaced, side by side in one process.

Two copies of the same model (same seed, the [pretrain] size, dtype, FP4 QAT and router replay),
one computing its experts with the grouped matmul (learner/model.py, the default) and one with
the reference loop (`MoE.expert_loop`), take turns on the same pretraining batches
(learner.corpus.TrainingData) with `learner.train.pretrain.train_step`; which goes first
alternates each step, so a machine shared with other jobs slows both alike. The first `warmup`
steps are not timed. Reported: each arm's median step time as tokens/s, and the ratio; the median
of the per-step ratios (each step's two arms ran back to back, under about the same load); and
the ratio from the process's CPU time per step (both threads' time, spin-waits included), which
other jobs on the machine disturb less than wall time. The two compute the same math, so their
losses are compared at every step too.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from learner.train.pretrain_settings import PretrainSettings

ARMS = ("grouped", "loop")


def run_bench(s: PretrainSettings, console: Console, *, steps: int, warmup: int, out: str | None, command: str) -> dict:
    import torch

    from feedback.core.precision import training as training_precision
    from learner.corpus import TrainingData
    from learner.formats import own_format
    from learner.model import MoE, Transformer
    from learner.tokenizer import load_tokenizer, train_tokenizer
    from learner.train.pretrain import (
        fp4_hook,
        load_training_corpus,
        lr_at,
        make_optimizer,
        model_args,
        pretrain_section,
        run_folder,
        train_step,
    )

    cfg = pretrain_section(s)
    torch.set_num_threads(cfg.threads)
    precision = training_precision(cfg.precision, device=cfg.device)
    cfg = cfg.model_copy(update={"precision": precision.short})
    corpus = load_training_corpus(cfg)
    cached = run_folder(s, cfg, corpus.fingerprint) / "tokenizer"
    with console.status("tokenizer and training rows"):
        if (cached / "tokenizer.json").is_file():
            tok, tok_from = load_tokenizer(cached), f"the base's ({cached})"
        else:
            tok, tok_from = train_tokenizer((f.text for f in corpus.train), cfg.vocab_size), "trained here"
        data = TrainingData(
            tok,
            own_format(tok, model_args(cfg).max_seq_len, fim=cfg.fim_template),
            corpus.train,
            seq_len=cfg.seq_len,
            batch_size=cfg.batch_size,
            fim_rate=cfg.fim_rate,
            summary_rate=cfg.summary_rate,
            seed=cfg.seed,
        )
    args = model_args(cfg)
    device = torch.device(cfg.device)
    hook = fp4_hook(cfg.fp4)
    arms = {}
    for arm in ARMS:
        torch.manual_seed(cfg.seed)
        model = Transformer(args).to(device).train()
        for m in model.modules():
            if isinstance(m, MoE):
                m.expert_loop = arm == "loop"
        arms[arm] = (model, make_optimizer(model, cfg))
    console.print(
        f"{cfg.size}: {args.n_layers} layers, {args.n_experts} experts (top-{args.top_k}), batch {cfg.batch_size} x "
        f"{cfg.seq_len} tokens; precision {precision}; fp4 {cfg.fp4}, router replay {cfg.router_replay}; "
        f"{cfg.threads} threads; tokenizer {tok_from}",
        markup=False,
    )

    tokens = cfg.batch_size * cfg.seq_len
    seconds: dict[str, list[float]] = {a: [] for a in ARMS}
    cpu_seconds: dict[str, list[float]] = {a: [] for a in ARMS}
    losses: dict[str, list[float]] = {a: [] for a in ARMS}
    with console.status("") as status:
        for step in range(warmup + steps):
            batch = data.batch(step).to(device)
            for arm in ARMS if step % 2 == 0 else ARMS[::-1]:
                model, opt = arms[arm]
                for group in opt.param_groups:
                    group["lr"] = lr_at(step, step / (warmup + steps), cfg)
                t0, c0 = time.perf_counter(), time.process_time()
                m = train_step(model, opt, batch, hook=hook, cfg=cfg)
                took, cpu = time.perf_counter() - t0, time.process_time() - c0
                losses[arm].append(m["loss"])
                if step >= warmup:
                    seconds[arm].append(took)
                    cpu_seconds[arm].append(cpu)
            status.update(
                f"step {step + 1}/{warmup + steps}"
                + (
                    ""
                    if step < warmup
                    else " · " + ", ".join(f"{a} {tokens / seconds[a][-1]:,.0f} tok/s" for a in ARMS)
                )
            )

    rows = {a: _arm(seconds[a], cpu_seconds[a], tokens) for a in ARMS}
    ratio = rows["grouped"]["tokens_per_s"] / rows["loop"]["tokens_per_s"]
    cpu_ratio = rows["grouped"]["tokens_per_cpu_s"] / rows["loop"]["tokens_per_cpu_s"]
    # Each step's two arms ran back to back, under about the same load: the median of the
    # per-step ratios is the comparison that a load changing over minutes disturbs least.
    paired = statistics.median(lp / g for g, lp in zip(seconds["grouped"], seconds["loop"], strict=True))
    same = losses["grouped"] == losses["loop"]
    worst = max(abs(a - b) for a, b in zip(losses["grouped"], losses["loop"], strict=True))
    t = Table(
        "experts",
        "tokens/s",
        "step ms: median",
        "min",
        "max",
        "tokens / CPU s",
        title=f"pretraining throughput: {steps} timed steps of {tokens:,} tokens, arms alternating (medians)",
    )
    for a in ARMS:
        r = rows[a]
        t.add_row(
            "grouped matmul (default)" if a == "grouped" else "loop over experts (before)",
            f"{r['tokens_per_s']:,.0f}",
            f"{r['median_ms']:.0f}",
            f"{r['min_ms']:.0f}",
            f"{r['max_ms']:.0f}",
            f"{r['tokens_per_cpu_s']:,.0f}",
        )
    console.print(t)
    console.print(
        f"grouped / loop: [bold]{ratio:.2f}x[/] tokens/s (median steps); {paired:.2f}x the median per-step ratio; "
        f"{cpu_ratio:.2f}x per CPU second. Training losses "
        + ("identical at every step" if same else f"differ by at most {worst:.2e}")
    )
    result = {
        "command": command,
        "size": cfg.size,
        "precision": precision.dtype,
        "fp4": cfg.fp4,
        "router_replay": cfg.router_replay,
        "threads": cfg.threads,
        "batch_tokens": tokens,
        "steps": steps,
        "warmup": warmup,
        "arms": rows,
        "ratio": ratio,
        "cpu_ratio": cpu_ratio,
        "paired_ratio": paired,
        "losses_identical": same,
        "max_loss_difference": worst,
    }
    if out:
        Path(out).write_text(json.dumps(result, indent=1) + "\n")
    return result


def _arm(seconds: list[float], cpu_seconds: list[float], tokens: int) -> dict:
    median = statistics.median(seconds)
    return {
        "tokens_per_s": tokens / median,
        "tokens_per_cpu_s": tokens / statistics.median(cpu_seconds),
        "median_ms": median * 1e3,
        "min_ms": min(seconds) * 1e3,
        "max_ms": max(seconds) * 1e3,
        "steps": len(seconds),
    }
