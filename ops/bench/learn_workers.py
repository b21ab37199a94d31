"""`flywheel bench learn-workers`: the learner's update throughput with 1 and with N data-parallel workers.

One run, the same data for every worker count:

    samples:   the base model (FP4, as served) samples completions at cursor sites of the training
               files; the simulated editor judges them (learner.judge) and feedback.reward scores them
    1 worker:  learner.train.learn.rl_update on each batch, then the one-process checkpoint
               (save_state), in this process: what `flywheel learn` does per update
    N workers: Ray Train workers (learner/train/learn_workers.py) with data_parallel.Replica: each
               rank its share of the same batches, then the sharded checkpoint (DCP)

Reported per worker count: samples/s over the updates after the first (warm-up), with and without
the checkpoint each update writes, the ratio to one worker, and each update's loss side by side
(the curves agree to float rounding: tests/learner/train/test_data_parallel.py bounds it). No SQL,
Kafka, gate or publishing: this measures training, not the loop around it.
"""

from __future__ import annotations

import copy
import json
import random
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from learner.train.learn_settings import LearnSettings


def run_bench(
    s: LearnSettings,
    console: Console,
    *,
    workers: tuple[int, ...],
    updates: int,
    temperature: float,
    out: str | None,
    command: str,
) -> dict:
    from feedback.core.errors import UserError

    if updates < 2:
        raise UserError("--updates must be at least 2: the first update is a warm-up and is not timed")
    if max(workers) > s.learn.batch_size:
        raise UserError(
            f"--workers {max(workers)} exceeds learn.batch_size ({s.learn.batch_size}): raise the batch size"
        )
    data = _samples(s, console, n=updates * s.learn.batch_size, temperature=temperature)
    batches = [data["samples"][i : i + s.learn.batch_size] for i in range(0, len(data["samples"]), s.learn.batch_size)]
    runs = {}
    for n in workers:
        with console.status(f"{n} worker(s): {updates} updates of {s.learn.batch_size} samples"):
            runs[n] = _one_process(data, batches, s) if n == 1 else _workers(data, batches, s, n)
        r = runs[n]
        console.print(
            f"{n} worker(s): {r['samples_per_s']:.2f} samples/s training, "
            f"{r['samples_per_s_with_save']:.2f} with the checkpoint after each update"
        )
    ref_n = 1 if 1 in runs else workers[0]
    first = runs[ref_n]
    table = Table("workers", "samples/s", "with checkpoint", f"vs {ref_n} worker(s)", title="update throughput")
    for n, r in runs.items():
        table.add_row(
            str(n),
            f"{r['samples_per_s']:.2f}",
            f"{r['samples_per_s_with_save']:.2f}",
            f"{r['samples_per_s'] / first['samples_per_s']:.2f}x",
        )
    console.print(table)
    curves = Table("update", *[f"loss, {n} worker(s)" for n in runs], title="loss per update (the same batches)")
    for i in range(len(batches)):
        curves.add_row(str(i + 1), *[f"{r['losses'][i]:+.6e}" for r in runs.values()])
    console.print(curves)
    result = {
        "command": command,
        "base": data["base"],
        "batch_size": s.learn.batch_size,
        "updates": len(batches),
        "temperature": temperature,
        "runs": {str(n): r for n, r in runs.items()},
        "ratio": {str(n): r["samples_per_s"] / first["samples_per_s"] for n, r in runs.items()},
    }
    if out:
        Path(out).write_text(json.dumps(result, indent=1) + "\n")
    return result


def _samples(s: LearnSettings, console: Console, *, n: int, temperature: float) -> dict:
    """n rewarded completions of the served base at training cursor sites, and what training them needs."""
    import torch

    from feedback.core.errors import UserError
    from feedback.reward import reward
    from learner import eval as E
    from learner import fp4
    from learner import store as S
    from learner.decode import decode, room
    from learner.formats import read_format
    from learner.judge import cursor_sites, judge
    from learner.languages import editor_stops
    from learner.tokenizer import load_tokenizer
    from learner.train.data_parallel import Setup
    from learner.train.learn import Sample, model_from_packed
    from learner.train.pretrain import find_base_model, load_master_weights, load_training_corpus, pretrain_section

    base_dir = find_base_model(s)
    if base_dir is None:
        raise UserError("no pretrained base model for these [pretrain] settings: run `flywheel pretrain` first")
    master, args = load_master_weights(base_dir)
    fmt = json.loads((base_dir / "run.json").read_text())["settings"].get("fp4", "off")
    fmt = None if fmt == "off" else fmt
    targets = fp4.DEFAULT_FP4_TARGETS if fmt else ()
    tok, model_format = load_tokenizer(base_dir / "hf"), read_format(base_dir / "hf")
    corpus = load_training_corpus(pretrain_section(s))
    sites = cursor_sites(corpus.train, n, random.Random(7))
    builder = E.prompt_builder(tok, model_format, args.max_seq_len)
    served = model_from_packed(S.pack_checkpoint(master.state_dict(), fmt or "nvfp4", targets), args)
    gen = torch.Generator().manual_seed(0)
    samples = []
    with console.status("sampling completions from the base") as status:
        for i, site in enumerate(sites):
            prompt = E.site_prompt(builder, site)[0]
            c = decode(
                served,
                tok,
                prompt,
                room(args.max_seq_len, len(prompt), s.learn.gate.max_tokens),
                stop_ids=model_format.eos_ids,
                temperature=temperature,
                generator=gen,
                stop=editor_stops(site.language, site.prefix),
            )
            r, parts = reward(E.editor_feedback(c.text, judge(c.text, site.truth)))
            samples.append(Sample(i, f"b{i}", 0, 0, prompt, c.ids, c.logprobs, r, parts["outcome"]))
            status.update(f"sampling completions from the base: {i + 1}/{len(sites)}")
    setup = Setup(args, model_format, fmt, tuple(targets), s.learn)
    return {"base": str(base_dir), "weights": master.state_dict(), "setup": setup, "samples": samples}


def _one_process(data: dict, batches: list, s: LearnSettings) -> dict:
    import torch

    from learner.model import Transformer
    from learner.train.learn import LearnerState, ReplayBuffer, make_batch, rl_update, save_state
    from learner.train.pretrain import fp4_hook

    setup = data["setup"]
    model = Transformer(setup.args)
    model.load_state_dict(data["weights"])
    ref = copy.deepcopy(model).eval().requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=s.learn.lr, betas=(0.9, 0.95), weight_decay=s.learn.weight_decay)
    hook = fp4_hook(setup.fp4, setup.fp4_targets) if setup.fp4 else None
    with tempfile.TemporaryDirectory() as tmp:

        def step(batch):
            m = rl_update(model, ref, opt, make_batch(batch, setup.args, setup.format), hook=hook, cfg=s.learn)
            return m, lambda: save_state(Path(tmp) / "state.pt", model, opt, LearnerState(), ReplayBuffer(1, 1))

        return _timed(batches, step)


def _timed(batches: list, step) -> dict:
    """Run `step(batch) -> (metrics, save)` on each batch; time the updates after the first, with and without save()."""
    losses, train_s, save_s = [], 0.0, 0.0
    for i, batch in enumerate(batches):
        t0 = time.perf_counter()
        m, save = step(batch)
        t1 = time.perf_counter()
        save()
        t2 = time.perf_counter()
        losses.append(m["loss"])
        if i > 0:
            train_s, save_s = train_s + t1 - t0, save_s + t2 - t1
    n = sum(len(b) for b in batches[1:])
    return {
        "losses": losses,
        "train_s": train_s,
        "save_s": save_s,
        "samples_per_s": n / train_s,
        "samples_per_s_with_save": n / (train_s + save_s),
    }


def _workers(data: dict, batches: list, s: LearnSettings, n: int) -> dict:
    from ray.util.queue import Queue

    from learner.train.learn_workers import local_ray, torch_trainer

    cfg = s.learn.model_copy(update={"workers": n})
    with local_ray(n), tempfile.TemporaryDirectory() as tmp:
        results = Queue()
        config = {"data": data, "batches": batches, "cfg": cfg, "folder": tmp, "results": results}
        torch_trainer(_rank, config, cfg, Path(tmp) / "ray").fit()
        return results.get(timeout=60)


def _rank(config: dict) -> None:
    """One Ray Train worker of the benchmark: every rank trains its share; rank 0 reports the timings."""
    import torch.distributed as dist

    from learner.model import Transformer
    from learner.train.data_parallel import Replica
    from learner.train.learn_workers import worker_device

    data, cfg = config["data"], config["cfg"]
    model = Transformer(data["setup"].args)
    model.load_state_dict(data["weights"])
    replica = Replica(model, data["setup"], worker_device(cfg))

    def step(batch):
        m = replica.update(batch)  # returns once every rank has its new weights (ZeRO broadcasts them)
        return m, lambda: (replica.save(Path(config["folder"]) / f"shards-{time.monotonic_ns()}"), dist.barrier())

    timed = _timed(config["batches"], step)
    if dist.get_rank() == 0:
        config["results"].put(timed)
