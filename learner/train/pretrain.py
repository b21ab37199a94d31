"""Pretraining the base model: tokenizer, then FP4 quantization-aware training with
high-precision router replay, then export. `ensure_base_model` is the entry point; it trains
only when no finished base matches the settings.

Each step (see `train_step`):
  1. a no-grad high-precision forward (bf16 autocast or fp32, no FP4) records each token's experts;
  2. the FP4 forward fake-quantizes the FP4 targets (expert weights, straight-through
     estimator) and replays that routing, so FP4 noise cannot flip expert choices while the
     router still gets its gradient from the gate weights at the replayed experts;
  3. AdamW on fp32 master weights on the next-token loss plus the MoE load-balancing loss,
     gradient clipping, warmup then cosine decay.

Run folder `<cache_dir>/base/<size>/<key>/`, key = sha256 of the corpus contents, the model
size, RECIPE_VERSION and every setting that changes the model (pretrain_settings.NOT_IN_CACHE_KEY
lists the ones that do not):

    run.json            the settings and corpus of this key
    tokenizer/          trained once, before the first step
    checkpoint.pt       fp32 model + optimizer + step + elapsed time + RNG + eval history;
                        the data position is the step (learner.corpus); kept after the end
    hf/                 the Hugging Face folder (FP4 targets dequantized to bf16)
    fp4/                the packed FP4 artifact and its manifest (learner.export)
    metrics.json        final held-out loss and accuracy, the bigram baseline, timings
    COMPLETE            written last: the base is finished for the budget it records

A run interrupted (Ctrl-C, SIGTERM, or a kill between checkpoints) continues from its last
checkpoint when rerun. A finished base is reused when it trained at least the requested
budget; a larger budget continues training it from its checkpoint.

`continue_pretraining` (`flywheel pretrain --base PATH`) runs the same loop on an imported
model (learner/base.py) instead of a new one: it starts from the weights of the store's start
version (FP4 targets dequantized), trains on `pretrain.corpus` in the model's own prompt format
(learner.formats: its FIM template, plain-text summary markers where it has no summary tokens)
at `pretrain.continue_lr`, and publishes the result as the next version of the weight store, a
delta against the base, where the learner then starts. Its run folder is
`<data_dir>/pretrain/<key>/` (key: the imported v0, the corpus, the settings); it resumes the
same way.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text
from tokenizers import Tokenizer

from feedback.core.config import FlywheelSettings
from feedback.core.errors import UserError
from feedback.core.precision import training as training_precision
from learner import fp4 as fp4_codec
from learner.corpus import Corpus, SourceFile, TrainingData, heldout_windows, load_corpus, token_stream
from learner.decode import decode
from learner.export import export_hf, export_packed_fp4, fp4_dequantized, load_hf, verify_packed_roundtrip
from learner.fim import plain_prompt_ids
from learner.formats import ModelFormat, own_format
from learner.model import ModelArgs, Transformer, WeightHook
from learner.tokenizer import load_tokenizer, save_tokenizer, train_tokenizer
from learner.train.pretrain_settings import PretrainSection

CHECKPOINT, COMPLETE, METRICS, RUN_INFO = "checkpoint.pt", "COMPLETE", "metrics.json", "run.json"
# Part of the cache key: bump it when the training recipe in code changes (data mix, loss),
# so a cached base made by the old recipe is not reused.
RECIPE_VERSION = 5  # 3: the FIM rows in Qwen's template, the path as `<|file_sep|>path`; 4: repository context;
# 5: suffix-first FIM (pretrain.fim_template), middles shaped like editors' requests (corpus.fim_span)


# --- pure pieces ------------------------------------------------------------------------------------


def lm_loss(
    logits_BSV: torch.Tensor, targets_BS: torch.Tensor, weights_BS: torch.Tensor | None = None
) -> tuple[torch.Tensor, dict[str, float]]:
    """Next-token cross-entropy, its mean over every position (weighted by `weights_BS` when
    given: sum(w * ce) / sum(w)), and accuracy (argmax == target) over every position."""
    if weights_BS is None:
        loss = F.cross_entropy(logits_BSV.float().flatten(0, 1), targets_BS.flatten())
    else:
        ce = F.cross_entropy(logits_BSV.float().flatten(0, 1), targets_BS.flatten(), reduction="none")
        w = weights_BS.flatten().to(ce.dtype)
        loss = (ce * w).sum() / w.sum()
    accuracy = (logits_BSV.argmax(-1) == targets_BS).float().mean()
    return loss, {"loss": loss.item(), "accuracy": accuracy.item()}


def fp4_hook(fmt: str, patterns=fp4_codec.DEFAULT_FP4_TARGETS) -> WeightHook | None:
    """The model's `fp4=` hook for QAT: fake-quantize (STE) the targets, pass the rest; None for "off"."""
    if fmt == "off":
        return None
    f = fp4_codec.get_format(fmt)
    cache: dict[str, bool] = {}

    def hook(name: str, w: torch.Tensor) -> torch.Tensor:
        if name not in cache:
            cache[name] = fp4_codec.is_fp4_target(name, patterns)
        return fp4_codec.fake_quantize(w, f) if cache[name] else w

    return hook


def progress_of(step: int, elapsed_s: float, cfg: PretrainSection) -> float:
    """How far training is, in [0, 1+): by steps when `steps` is set, else by time."""
    return step / cfg.steps if cfg.steps is not None else elapsed_s / (cfg.minutes * 60)


@dataclass
class Curriculum:
    """Short rows, then long ones (pretrain.short_seq_len, pretrain.long_fraction): which
    TrainingData a step draws from, by how far training is. Both hold the same tokens per step,
    over one token stream."""

    long: TrainingData
    short: TrainingData | None = None
    long_from: float = 0.0  # progress from which rows are long

    @classmethod
    def of(cls, tok, fmt: ModelFormat, files, cfg: PretrainSection, *, seq_len: int | None = None) -> Curriculum:
        seq_len = seq_len or cfg.seq_len
        common = dict(
            fim_rate=cfg.fim_rate,
            context_rate=cfg.context_rate,
            summary_rate=cfg.summary_rate,
            seed=cfg.seed,
            middle_weight=cfg.fim_middle_weight,
        )
        long = TrainingData(tok, fmt, files, seq_len=seq_len, batch_size=cfg.batch_size, **common)
        if cfg.short_seq_len >= seq_len or cfg.long_fraction >= 1:
            return cls(long)
        rows = max(1, cfg.batch_size * seq_len // cfg.short_seq_len)
        short = TrainingData(tok, fmt, files, seq_len=cfg.short_seq_len, batch_size=rows, stream=long.stream, **common)
        return cls(long, short, 1 - cfg.long_fraction)

    @property
    def stream(self) -> torch.Tensor:
        return self.long.stream

    def at(self, progress: float) -> TrainingData:
        return self.long if self.short is None or progress >= self.long_from else self.short


def is_done(step: int, elapsed_s: float, cfg: PretrainSection) -> bool:
    return (cfg.steps is not None and step >= cfg.steps) or elapsed_s >= cfg.minutes * 60


def lr_at(step: int, progress: float, cfg: PretrainSection) -> float:
    """Linear warmup over `warmup_steps`, then cosine from lr to lr * min_lr_ratio over the budget."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    cos = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cos)


def bigram_baseline(
    train_stream: torch.Tensor, windows: torch.Tensor, vocab_size: int, smoothing: float = 0.1
) -> dict[str, float]:
    """Count-based bigram model on the train stream, scored on the same held-out targets as the model.

    Accuracy: predict the most frequent successor of the previous token. Loss: add-`smoothing`
    estimate of p(next | previous)."""
    V = vocab_size
    counts_VV = torch.bincount(train_stream[:-1] * V + train_stream[1:], minlength=V * V).view(V, V).float()
    prev, nxt = windows[:, :-1].flatten(), windows[:, 1:].flatten()
    accuracy = (counts_VV.argmax(-1)[prev] == nxt).float().mean().item()
    probs = (counts_VV[prev, nxt] + smoothing) / (counts_VV[prev].sum(-1) + smoothing * V)
    return {"loss": -probs.log().mean().item(), "accuracy": accuracy}


def _autocast(device: torch.device, precision: str):
    """bf16 autocast when `precision` resolves to bf16 on this device (feedback/core/precision.py), else fp32."""
    chosen = training_precision(precision, device=device.type)
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=chosen.dtype == "bfloat16")


def quality_problem(metrics: dict, steps: int, cfg: PretrainSection) -> str | None:
    """Why a finished base is not worth serving, or None: no better than its bigram baseline
    (held-out accuracy or loss), or fewer than `cfg.min_steps` steps. Pure: the pretraining run
    and every reuse of a cached base apply the same rule."""
    if not cfg.quality_check:
        return None
    acc, bacc = metrics["heldout_accuracy"], metrics["bigram_accuracy"]
    loss, bloss = metrics["heldout_loss"], metrics["bigram_loss"]
    how = f"{steps} steps, {metrics.get('train_tokens', 0) / 1e6:.1f}M tokens"
    if tps := metrics.get("tokens_per_s"):
        how += f" at {tps:,.0f} tokens/s"
    if prec := metrics.get("precision"):
        how += f" in {prec}"
    if acc <= bacc or loss >= bloss:
        return (
            f"the base model is worse than its bigram baseline (held-out accuracy {acc:.1%} vs {bacc:.1%}, loss {loss:.2f} vs "
            f"{bloss:.2f}) after {how}"
        )
    if steps < cfg.min_steps:
        return f"the base model trained only {how}, fewer than pretrain.min_steps={cfg.min_steps}"
    return None


def check_quality(folder: Path, done: dict, cfg: PretrainSection) -> None:
    """Raise UserError (one line, with what to do) if the finished base in `folder` fails `quality_problem`."""
    problem = quality_problem(done["metrics"], done["step"], cfg)
    if problem:
        raise UserError(
            f"{problem}; not using it ({folder}). Train longer: `flywheel pretrain --minutes N` continues it (or --force starts "
            f"over); on a CPU without fast bf16 keep pretrain.precision=auto or fp32"
        )


def train_step(
    model: Transformer,
    opt: torch.optim.Optimizer,
    batch_BS1: torch.Tensor,
    *,
    hook: WeightHook | None,
    cfg: PretrainSection,
    weights_BS: torch.Tensor | None = None,
) -> dict[str, float]:
    """One optimizer step of FP4 QAT with high-precision router replay (see the module docstring);
    `weights_BS`: each target's loss weight (TrainingData.weighted), None for all equal."""
    x, y = batch_BS1[:, :-1], batch_BS1[:, 1:]
    with _autocast(x.device, cfg.precision):
        routing = None
        if hook is not None and cfg.router_replay:
            with torch.no_grad():
                _, routing = model(x, return_routing=True)
        balance: list[torch.Tensor] = []
        logits = model(x, routing=routing, fp4=hook, balance_losses=balance)
        loss, metrics = lm_loss(logits, y, weights_BS)
        balance_loss = torch.stack(balance).mean() if balance else torch.zeros((), device=x.device)  # dense: none
    (loss + cfg.balance_coef * balance_loss).backward()
    metrics["balance_loss"] = balance_loss.item()
    metrics["grad_norm"] = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip).item()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return metrics


@torch.no_grad()
def evaluate(
    model: Transformer, windows_NS1: torch.Tensor, *, hook: WeightHook | None = None, batch_size: int = 16
) -> dict[str, float]:
    """Held-out loss and next-token accuracy in fp32, the model routing itself (as served)."""
    was_training = model.training
    model.eval()
    total_loss = total_acc = 0.0
    for i in range(0, len(windows_NS1), batch_size):
        w = windows_NS1[i : i + batch_size].to(next(model.parameters()).device)
        _, m = lm_loss(model(w[:, :-1], fp4=hook), w[:, 1:])
        total_loss += m["loss"] * len(w)
        total_acc += m["accuracy"] * len(w)
    model.train(was_training)
    return {"loss": total_loss / len(windows_NS1), "accuracy": total_acc / len(windows_NS1)}


# --- the run folder ------------------------------------------------------------------------------


def model_args(cfg: PretrainSection) -> ModelArgs:
    return ModelArgs.from_name(cfg.size, vocab_size=cfg.vocab_size, max_seq_len=cfg.seq_len)


def cache_key(cfg: PretrainSection, corpus_fingerprint: str) -> str:
    blob = {
        "settings": cfg.cache_key_fields(),
        "model": model_args(cfg).to_dict(),
        "corpus": corpus_fingerprint,
        "recipe": RECIPE_VERSION,
    }
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()


def run_folder(settings: FlywheelSettings, cfg: PretrainSection, corpus_fingerprint: str) -> Path:
    return Path(settings.cache_dir).expanduser() / "base" / cfg.size / cache_key(cfg, corpus_fingerprint)[:16]


def pretrain_section(settings: FlywheelSettings) -> PretrainSection:
    return getattr(settings, "pretrain", None) or PretrainSection()


def load_training_corpus(cfg: PretrainSection) -> Corpus:
    try:
        return load_corpus(cfg.corpus, heldout_fraction=cfg.heldout_fraction, max_file_bytes=cfg.max_file_kb * 1024)
    except ValueError as e:
        raise UserError(str(e)) from None


def finished_base(folder: Path, cfg: PretrainSection) -> dict | None:
    """The COMPLETE record of a base in `folder` that trained at least `cfg`'s budget, else None."""
    marker = folder / COMPLETE
    if not marker.is_file():
        return None
    done = json.loads(marker.read_text())
    return done if is_done(done["step"], done["elapsed_s"], cfg) else None


def find_base_model(settings: FlywheelSettings) -> Path | None:
    """The finished base's run folder for these settings, or None; never trains."""
    cfg = pretrain_section(settings)
    folder = run_folder(settings, cfg, load_training_corpus(cfg).fingerprint)
    done = finished_base(folder, cfg)
    if done is None:
        return None
    check_quality(folder, done, cfg)
    return folder


def ensure_base_model(settings: FlywheelSettings, console: Console, *, force: bool = False) -> Path:
    """The exported HF folder of the base model for `settings` ([pretrain] section), training
    it first (or resuming its interrupted training) unless a finished one is cached.

    Raises UserError (one line) on a missing or empty corpus."""
    cfg = pretrain_section(settings)
    torch.set_num_threads(cfg.threads)
    corpus = load_training_corpus(cfg)
    folder = run_folder(settings, cfg, corpus.fingerprint)
    if force and folder.exists():
        shutil.rmtree(folder)
    done = finished_base(folder, cfg)
    if done is not None:
        check_quality(folder / "hf", done, cfg)
        m = done["metrics"]
        console.print(
            f"base model already trained: {folder / 'hf'} (step {done['step']}, held-out loss {m['heldout_loss']:.3f}, "
            f"accuracy {m['heldout_accuracy']:.1%} vs bigram {m['bigram_accuracy']:.1%}); reusing it (--force retrains)"
        )
        return folder / "hf"
    metrics = train(corpus, cfg, folder, console)
    check_quality(folder / "hf", {"metrics": metrics, "step": metrics["steps"]}, cfg)
    return folder / "hf"


# --- training ---------------------------------------------------------------------------------------


@dataclass
class _State:
    step: int = 0
    elapsed_s: float = 0.0  # training time summed over runs
    tokens: int = 0
    history: list | None = None


def train(
    corpus: Corpus,
    cfg: PretrainSection,
    folder: Path,
    console: Console,
    *,
    on_step: Callable[[int, dict], None] | None = None,
) -> dict:
    """Train (or resume) in `folder`, then export and evaluate; returns the final metrics."""
    t_start = time.perf_counter()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / COMPLETE).unlink(missing_ok=True)  # continuing a finished base re-exports it
    _write_json(
        folder / RUN_INFO,
        {
            "settings": cfg.model_dump(mode="json"),
            "corpus": str(corpus.root),
            "corpus_sha256": corpus.fingerprint,
            "train_files": len(corpus.train),
            "heldout_files": len(corpus.heldout),
        },
    )
    device = torch.device(cfg.device)
    tok = _tokenizer(folder, corpus.train, cfg, console)
    args = model_args(cfg)
    fmt = own_format(tok, args.max_seq_len, fim=cfg.fim_template)
    data = Curriculum.of(tok, fmt, corpus.train, cfg)
    windows = heldout_windows(token_stream(fmt, tok, corpus.heldout), cfg.seq_len, cfg.final_eval_windows)
    periodic = windows[torch.linspace(0, len(windows) - 1, min(cfg.eval_windows, len(windows))).long()]

    torch.manual_seed(cfg.seed)
    model = Transformer(args).to(device).train()
    opt = make_optimizer(model, cfg)
    state = _State(history=[])
    if (folder / CHECKPOINT).is_file():
        state = _load_checkpoint(folder / CHECKPOINT, model, opt)
        console.print(f"resuming from step {state.step} ({state.elapsed_s / 60:.1f} min trained) in {folder}")
    else:
        console.print(
            f"training {cfg.size} ({model.num_params() / 1e6:.1f}M parameters, {model.num_params(active=True) / 1e6:.1f}M active) "
            f"on {len(corpus.train)} files ({len(data.stream) / 1e6:.2f}M tokens), {len(corpus.heldout)} held out; run folder {folder}"
        )

    precision = training_precision(cfg.precision, device=device.type)
    console.print(f"precision: {precision}")
    cfg = cfg.model_copy(update={"precision": precision.short})
    hook = fp4_hook(cfg.fp4)
    _train_loop(model, opt, data, periodic, hook, cfg, state, folder, console, on_step)
    prompts = completion_prompts(corpus.heldout, 1)
    return _finish(
        model, args, tok, fmt, data, windows, prompts, cfg, state, folder, console, time.perf_counter() - t_start
    )


def _train_loop(
    model, opt, data, periodic, hook, cfg, state: _State, folder: Path, console: Console, on_step, label: str = ""
) -> None:
    last_ckpt = time.perf_counter()
    ema_loss = None
    with _progress(console) as progress, _stop_on_signal() as stop:
        task = progress.add_task(
            label or f"pretrain {cfg.size}", total=1000, step=state.step, loss=float("nan"), tps=0.0
        )
        while not is_done(state.step, state.elapsed_s, cfg):
            t0 = time.perf_counter()
            for group in opt.param_groups:
                group["lr"] = lr_at(state.step, progress_of(state.step, state.elapsed_s, cfg), cfg)
            rows = data.at(progress_of(state.step, state.elapsed_s, cfg))
            batch, weights = rows.weighted(state.step)
            device = next(model.parameters()).device
            batch, weights = batch.to(device), None if weights is None else weights.to(device)
            tokens_per_step = batch.shape[0] * (batch.shape[1] - 1)
            m = train_step(model, opt, batch, hook=hook, cfg=cfg, weights_BS=weights)
            tps = tokens_per_step / (time.perf_counter() - t0)
            state.step += 1
            state.tokens += tokens_per_step
            if state.step % cfg.eval_every == 0:
                ev = evaluate(model, periodic, hook=hook)
                state.history.append(
                    {
                        "step": state.step,
                        "train_loss": m["loss"],
                        "heldout_loss": ev["loss"],
                        "heldout_accuracy": ev["accuracy"],
                    }
                )
                progress.console.print(
                    f"step {state.step}: train loss {m['loss']:.3f}, held-out loss {ev['loss']:.3f}, "
                    f"accuracy {ev['accuracy']:.1%}, {state.elapsed_s / 60:.1f} min"
                )
            state.elapsed_s += time.perf_counter() - t0
            ema_loss = m["loss"] if ema_loss is None else 0.95 * ema_loss + 0.05 * m["loss"]
            frac = min(1.0, max(progress_of(state.step, state.elapsed_s, cfg), state.elapsed_s / (cfg.minutes * 60)))
            progress.update(task, completed=1000 * frac, step=state.step, loss=ema_loss, tps=tps)
            if on_step is not None:
                on_step(state.step, m)
            if stop.requested:
                _save_checkpoint(folder / CHECKPOINT, model, opt, state)
                progress.console.print(
                    f"interrupted at step {state.step}; checkpoint saved, rerun the same command to resume"
                )
                raise KeyboardInterrupt
            if time.perf_counter() - last_ckpt >= cfg.checkpoint_minutes * 60:
                _save_checkpoint(folder / CHECKPOINT, model, opt, state)
                last_ckpt = time.perf_counter()
        progress.update(task, completed=1000)
    _save_checkpoint(folder / CHECKPOINT, model, opt, state)


def _finish(
    model,
    args,
    tok,
    fmt: ModelFormat,
    data,
    windows,
    held_prompts,
    cfg,
    state: _State,
    folder: Path,
    console: Console,
    wall_s: float,
) -> dict:
    """Export, verify, evaluate the exported model against the bigram baseline, mark COMPLETE."""
    t0 = time.perf_counter()
    model = model.to("cpu")
    weight_fn = fp4_dequantized(cfg.fp4) if cfg.fp4 != "off" else None
    hf = export_hf(model, args, tok, folder / "hf", weight_fn=weight_fn, fim=cfg.fim_template)
    checked = 0
    if cfg.fp4 != "off":
        export_packed_fp4(model, args, folder / "fp4", fmt=cfg.fp4)
        checked = verify_packed_roundtrip(folder / "fp4", hf)
    served, _ = load_hf(hf)  # evaluate exactly what serving loads
    ev = evaluate(served, windows)
    bigram = bigram_baseline(data.stream, windows, args.vocab_size)
    metrics = {
        "heldout_loss": ev["loss"],
        "heldout_accuracy": ev["accuracy"],
        "bigram_loss": bigram["loss"],
        "bigram_accuracy": bigram["accuracy"],
        "heldout_tokens": int(windows[:, 1:].numel()),
        "steps": state.step,
        "train_tokens": state.tokens,
        "train_minutes": state.elapsed_s / 60,
        "this_run_wall_minutes": (wall_s + time.perf_counter() - t0) / 60,
        "tokens_per_s": state.tokens / state.elapsed_s if state.elapsed_s else 0.0,
        "precision": cfg.precision,
        "fp4": cfg.fp4,
        "router_replay": cfg.router_replay,
        "fp4_tensors_roundtrip_checked": checked,
        "history": state.history,
    }
    _write_json(folder / METRICS, metrics)
    _write_json(
        folder / COMPLETE, {"step": state.step, "elapsed_s": state.elapsed_s, "metrics": metrics}
    )  # last: the base is finished

    t = Table(
        "held-out (exported model)", "loss", "next-token accuracy", title=f"base model {cfg.size}: {folder / 'hf'}"
    )
    t.add_row(
        f"{args.n_layers}-layer {'MoE' if args.moe_layers else 'dense model'}, {state.step} steps, {state.tokens / 1e6:.1f}M tokens",
        f"{ev['loss']:.3f}",
        f"{ev['accuracy']:.1%}",
    )
    t.add_row("bigram baseline (train split counts)", f"{bigram['loss']:.3f}", f"{bigram['accuracy']:.1%}")
    console.print(t)
    extra = f"; packed FP4 in {folder / 'fp4'} (round trip bit-identical on {checked} tensors)" if checked else ""
    console.print(f"trained {state.elapsed_s / 60:.1f} min, this run {metrics['this_run_wall_minutes']:.1f} min{extra}")
    if held_prompts:
        prompt = held_prompts[0]
        completion = decode(served, tok, plain_prompt_ids(fmt, tok, prompt), 48, stop_ids=fmt.eos_ids).text
        console.print("greedy completion of held-out code ([dim]prompt[/], then the model's continuation):")
        console.print(Text(prompt[-300:], style="dim") + Text(completion))
    return metrics


def completion_prompts(files: list[SourceFile], n: int, context_lines: int = 8) -> list[str]:
    """Prompts from held-out files: the lines before a function's first body line, so the
    model writes the body. One per file, from files that have a def after line `context_lines`."""
    out = []
    for f in files:
        lines = f.text.splitlines(keepends=True)
        i = next(
            (
                i
                for i in range(context_lines, len(lines) - 1)
                if lines[i].lstrip().startswith("def ") and lines[i].rstrip().endswith(":")
            ),
            None,
        )
        if i is not None:
            out.append("".join(lines[i - context_lines : i + 1]))
        if len(out) == n:
            break
    return out


def _tokenizer(folder: Path, files: list[SourceFile], cfg: PretrainSection, console: Console) -> Tokenizer:
    path = folder / "tokenizer"
    if (path / "tokenizer.json").is_file():
        return load_tokenizer(path)
    t0 = time.perf_counter()
    tok = train_tokenizer((f.text for f in files), cfg.vocab_size)
    save_tokenizer(tok, path, model_max_length=cfg.seq_len)
    console.print(f"trained a {tok.get_vocab_size()}-token BPE tokenizer in {time.perf_counter() - t0:.1f} s")
    return tok


def make_optimizer(model: Transformer, cfg: PretrainSection) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95))


def _save_checkpoint(path: Path, model: Transformer, opt: torch.optim.Optimizer, state: _State) -> None:
    blob = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "step": state.step,  # also the data position: batches are a function of (seed, step)
        "elapsed_s": state.elapsed_s,
        "tokens": state.tokens,
        "history": state.history,
        "torch_rng": torch.get_rng_state(),
    }
    tmp = path.with_suffix(".tmp")
    torch.save(blob, tmp)
    os.replace(tmp, path)  # atomic: a kill mid-save leaves the previous checkpoint


def _load_checkpoint(path: Path, model: Transformer, opt: torch.optim.Optimizer) -> _State:
    blob = torch.load(path, map_location="cpu", weights_only=False)
    model.load_state_dict(blob["model"])
    opt.load_state_dict(blob["optimizer"])
    torch.set_rng_state(blob["torch_rng"])
    return _State(blob["step"], blob["elapsed_s"], blob["tokens"], blob["history"])


def load_master_weights(folder: Path) -> tuple[Transformer, ModelArgs]:
    """The fp32 master weights of a run folder (before FP4): what the benchmark quantizes."""
    cfg = PretrainSection(**json.loads((folder / RUN_INFO).read_text())["settings"])
    args = model_args(cfg)
    model = Transformer(args)
    model.load_state_dict(torch.load(folder / CHECKPOINT, map_location="cpu", weights_only=False)["model"])
    return model.eval(), args


def _progress(console: Console) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}[/]"),
        BarColumn(),
        TaskProgressColumn(),
        TextColumn("step {task.fields[step]}  loss {task.fields[loss]:.3f}  {task.fields[tps]:,.0f} tok/s"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=console,
    )


class _StopFlag:
    requested = False


@contextlib.contextmanager
def _stop_on_signal() -> Iterator[_StopFlag]:
    """First Ctrl-C or SIGTERM: finish the step, checkpoint, stop. A second Ctrl-C stops at once."""
    flag = _StopFlag()
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return

    def handler(signum, frame):
        if flag.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        flag.requested = True

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield flag
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


# --- continuing an imported model ---------------------------------------------------------------------


def continue_pretraining(
    settings: FlywheelSettings,
    console: Console,
    *,
    producer=None,
    on_step: Callable[[int, dict], None] | None = None,
) -> dict:
    """`flywheel pretrain --base PATH`: see the module docstring. Imports `model.base` first if
    the store has no model yet. Returns the run's record (steps, held-out metrics, the version
    published). UserError (one line) when the learner already published after the base, or the
    corpus or the base is refused."""
    from feedback import db
    from learner import store as S
    from learner.base import ensure_imported
    from learner.formats import read_format
    from learner.publish import publish_version

    cfg = pretrain_section(settings)
    torch.set_num_threads(cfg.threads)
    corpus = load_training_corpus(cfg)
    store = S.settings_store(settings)
    engine = db.make_engine(settings.database_url)
    db.upgrade(engine)
    own_producer = producer is None
    if own_producer:
        from feedback.producer import BufferedProducer

        producer = BufferedProducer(settings.kafka)
    try:
        try:
            base, _ = ensure_imported(settings.model, store, engine=engine, producer=producer, replicas=0)
        except ValueError as e:
            raise UserError(str(e)) from None
        start = base["start_version"]
        later = [v for v in store.versions() if v > start]
        if later:
            raise UserError(
                f"the learner already published v{later[-1]} after the base's v{start} in {store.uri()}: continued "
                "pretraining starts from the base, before the learner runs (or use a fresh data_dir)"
            )
        key = hashlib.sha256(
            json.dumps(
                {
                    "base": store.manifest(0)["digest"],
                    "settings": cfg.cache_key_fields(),
                    "corpus": corpus.fingerprint,
                    "recipe": RECIPE_VERSION,
                },
                sort_keys=True,
            ).encode()
        ).hexdigest()[:16]
        folder = Path(settings.data_dir).expanduser() / "pretrain" / key
        done = finished_base(folder, cfg)
        if done is not None and done.get("version") in store.versions():
            console.print(
                f"already continued on this corpus: v{done['version']} (step {done['step']}, held-out loss "
                f"{done['metrics']['base_heldout_loss']:.3f} -> {done['metrics']['heldout_loss']:.3f}); {folder}"
            )
            return done
        folder.mkdir(parents=True, exist_ok=True)
        (folder / COMPLETE).unlink(missing_ok=True)
        model_dir = folder / "model"
        model_dir.mkdir(exist_ok=True)
        for name, data in store.model_files().items():
            (model_dir / name).write_bytes(data)
        tok, fmt = load_tokenizer(model_dir), read_format(model_dir, fim=settings.model.fim)
        args = ModelArgs.from_hf_config(json.loads((model_dir / "config.json").read_text()))
        with torch.device("meta"):
            model = Transformer(args)
        model.load_state_dict({k: v.float() for k, v in S.to_hf_tensors(store.materialize(start)).items()}, assign=True)
        record = _continue(model.train(), args, tok, fmt, corpus, cfg, base, folder, console, on_step)
        packed = S.pack_checkpoint(
            model.state_dict(), base["fp4_format"] or "nvfp4", base["fp4_targets"] if base["fp4_format"] else ()
        )
        m = record["metrics"]
        msg = publish_version(
            store,
            packed,
            parent=start,
            engine=engine,
            producer=producer,
            gate_passed=True,
            gate_reason=(
                f"continued pretraining on {corpus.root.name} ({record['step']} steps; held-out loss "
                f"{m['base_heldout_loss']:.3f} -> {m['heldout_loss']:.3f})"
            ),
            metrics={k: float(v) for k, v in m.items() if isinstance(v, int | float)},
        )
        store.update_base(start_version=msg.version)
        record["version"] = msg.version
        _write_json(folder / COMPLETE, record)  # last: published and recorded
        console.print(
            f"published v{msg.version} ({msg.size_bytes:,} B delta against v{start}, {msg.full_size_bytes:,} B full); "
            "the learner starts from it"
        )
        return record
    finally:
        if own_producer:
            producer.close(timeout_s=10)


def _continue(model, args, tok, fmt, corpus, cfg: PretrainSection, base: dict, folder: Path, console, on_step) -> dict:
    """The training loop of `continue_pretraining` on `model` (resumed from `folder`'s checkpoint)."""
    seq_len = min(cfg.seq_len, fmt.window - 1)
    data = Curriculum.of(tok, fmt, corpus.train, cfg, seq_len=seq_len)
    windows = heldout_windows(token_stream(fmt, tok, corpus.heldout), seq_len, cfg.final_eval_windows)
    periodic = windows[torch.linspace(0, len(windows) - 1, min(cfg.eval_windows, len(windows))).long()]
    precision = training_precision(cfg.precision, device="cpu")
    run_cfg = cfg.model_copy(update={"lr": cfg.continue_lr, "precision": precision.short, "seq_len": seq_len})
    hook = fp4_hook(base["fp4_format"], tuple(base["fp4_targets"])) if base["fp4_format"] else None
    before = evaluate(model, windows, hook=hook)
    opt = make_optimizer(model, run_cfg)
    state = _State(history=[])
    if (folder / CHECKPOINT).is_file():
        state = _load_checkpoint(folder / CHECKPOINT, model, opt)
        console.print(f"resuming from step {state.step} ({state.elapsed_s / 60:.1f} min trained) in {folder}")
    else:
        console.print(
            f"continuing {args.architecture} ({model.num_params() / 1e6:.1f}M parameters) from v{base['start_version']} on "
            f"{len(corpus.train)} files ({len(data.stream) / 1e6:.2f}M tokens), {len(corpus.heldout)} held out; "
            f"lr {cfg.continue_lr:g}, precision {precision}; run folder {folder}"
        )
    _train_loop(
        model,
        opt,
        data,
        periodic,
        hook,
        run_cfg,
        state,
        folder,
        console,
        on_step,
        label=f"pretrain {args.architecture}",
    )
    after = evaluate(model, windows, hook=hook)
    metrics = {
        "base_heldout_loss": before["loss"],
        "base_heldout_accuracy": before["accuracy"],
        "heldout_loss": after["loss"],
        "heldout_accuracy": after["accuracy"],
        "steps": state.step,
        "train_tokens": state.tokens,
        "train_minutes": state.elapsed_s / 60,
    }
    console.print(
        f"held-out loss {before['loss']:.3f} -> {after['loss']:.3f}, accuracy {before['accuracy']:.1%} -> "
        f"{after['accuracy']:.1%} after {state.step} steps"
    )
    return {"step": state.step, "elapsed_s": state.elapsed_s, "metrics": metrics}
