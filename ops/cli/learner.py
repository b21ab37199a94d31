"""`flywheel` commands of the learner package (registered by ops/cli/main.py; heavy imports stay inside the commands).

    flywheel pretrain [--corpus DIR] [--size small] [--minutes N] [--steps N] [--fp4 nvfp4|mxfp4|off] [--force]
    flywheel learn [--publish-every 3h] [--min-samples N] [--lr X] [--versions N]
    flywheel bench fp4 [--steps N] [--out results.json]

`flywheel bench` is shared: each package adds its benchmarks with ops.cli.console.bench_subcommands(sub).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys

from ops.cli.console import add_config_args, bench_subcommands, console, print_config


def register(sub: argparse._SubParsersAction) -> None:
    """Add this package's commands to the `flywheel` parser."""
    p = sub.add_parser(
        "pretrain",
        help="train (or reuse) the base model: tokenizer, FP4 QAT with router replay, export",
        description="Train the base code model on a corpus (default: the Python standard library), "
        "resuming an interrupted run and reusing a finished one. Settings: the [pretrain] section.",
    )
    p.add_argument("--corpus", metavar="DIR", help="folder of source files (pretrain.corpus)")
    p.add_argument("--size", help="model size: tiny or small (pretrain.size)")
    p.add_argument("--minutes", type=float, help="training time budget (pretrain.minutes)")
    p.add_argument("--steps", type=int, help="train exactly N steps (pretrain.steps)")
    p.add_argument("--fp4", choices=["nvfp4", "mxfp4", "off"], help="QAT format (pretrain.fp4)")
    p.add_argument("--force", action="store_true", help="retrain even if a finished base is cached")
    add_config_args(p)
    p.set_defaults(fn=cmd_pretrain)

    lp = sub.add_parser(
        "learn",
        help="the RL learner: rewarded feedback in, gated model versions out (as deltas)",
        description="Train the model on rewarded completions from SQL (FP4 QAT with router replay, PPO-clip/TIS, KL to the base) "
        "and publish a gated version every publish_every. Resumes from its checkpoint. Settings: the [learn] section.",
    )
    lp.add_argument("--publish-every", metavar="DURATION", help="publish cadence, e.g. 3h, 90s (learn.publish_every)")
    lp.add_argument("--min-samples", type=int, help="samples trained before a publish (learn.min_samples)")
    lp.add_argument("--lr", type=float, help="AdamW learning rate (learn.lr)")
    lp.add_argument(
        "--versions", type=int, metavar="N", help="stop after publishing N versions (default: run until Ctrl-C)"
    )
    lp.add_argument(
        "--until-idle", action="store_true", help="stop once every rewarded sample so far is trained (a batch run)"
    )
    add_config_args(lp)
    lp.set_defaults(fn=cmd_learn)

    b = bench_subcommands(sub).add_parser(
        "fp4",
        help="NVFP4 vs MXFP4 error, pack/unpack speed, QAT vs bf16 loss, router replay KL",
        description="FP4 benchmark: each number beside its baseline from the same run, as a ratio.",
    )
    b.add_argument("--steps", type=int, default=150, help="training steps for the QAT-vs-bf16 comparison (default 150)")
    b.add_argument("--out", metavar="FILE", help="also write the results as JSON")
    b.add_argument(
        "--parts",
        default="abcd",
        type=_bench_parts,
        help="which parts to run: a error, b codec throughput, c QAT vs bf16, d router replay (default abcd)",
    )
    add_config_args(b)
    b.set_defaults(fn=cmd_bench_fp4)

    d = bench_subcommands(sub).add_parser(
        "delta",
        help="published delta size / full checkpoint (packed FP4 and bf16), codec speed, vs zstd, fireworks arc_v2/v3, zipnn",
        description="Weight-delta benchmark on checkpoint pairs from real training steps: Flywheel's codec beside its baselines, one run.",
    )
    d.add_argument(
        "--lr", type=float, nargs="+", default=[1e-6, 1e-5], help="learning rates, one series each (default 1e-6 1e-5)"
    )
    d.add_argument("--steps", type=int, default=10, help="AdamW steps between versions (default 10)")
    d.add_argument("--versions", type=int, default=2, help="versions per learning rate (default 2)")
    d.add_argument("--level", type=int, default=3, help="zstd level for every zstd-based method (default 3)")
    d.add_argument("--threads", type=int, default=-1, help="zstd threads (-1: all cores)")
    d.add_argument(
        "--swap", action="store_true", help="also swap the versions into vLLM under load: pause, p99, failures"
    )
    d.add_argument("--out", metavar="FILE", help="also write the results as JSON")
    add_config_args(d)
    d.set_defaults(fn=cmd_bench_delta)

    bl = bench_subcommands(sub).add_parser(
        "learn",
        help="learning curve: held-out reward, accept rate, suggestion rate, accepted chars over K versions vs the base",
        description="RL on simulated editor feedback with the learner's own update, each version replayed on held-out files beside the base model.",
    )
    bl.add_argument(
        "--lr", type=float, nargs="+", default=[1e-6, 1e-5], help="learning rates, one curve each (default 1e-6 1e-5)"
    )
    bl.add_argument("--versions", type=int, default=4, help="versions per curve (default 4)")
    bl.add_argument("--updates", type=int, default=6, help="updates per version (default 6)")
    bl.add_argument(
        "--temperature", type=float, default=0.7, help="sampling temperature of the simulated traffic (default 0.7)"
    )
    bl.add_argument(
        "--train-sites", type=int, default=400, help="cursor sites on training files to sample from (default 400)"
    )
    bl.add_argument("--out", metavar="FILE", help="also write the results as JSON")
    add_config_args(bl)
    bl.set_defaults(fn=cmd_bench_learn)


def _bench_parts(value: str) -> str:
    if not value or set(value) - set("abcd"):
        raise argparse.ArgumentTypeError(f"{value!r}: give some of the letters a, b, c, d (e.g. `--parts b`)")
    return value


def _settings(args: argparse.Namespace, flags: dict[str, object]):
    from learner.train.pretrain_settings import PretrainSettings

    overrides = list(args.overrides) + [
        f"pretrain.{k}={json.dumps(str(v) if k == 'corpus' else v)}" for k, v in flags.items() if v is not None
    ]
    return PretrainSettings.load(args.config, overrides)


def cmd_pretrain(args: argparse.Namespace) -> int:
    s = _settings(
        args, {"corpus": args.corpus, "size": args.size, "minutes": args.minutes, "steps": args.steps, "fp4": args.fp4}
    )
    print_config(s, "flywheel pretrain")
    from learner.train.pretrain import ensure_base_model

    ensure_base_model(s, console, force=args.force)
    return 0


def cmd_learn(args: argparse.Namespace) -> int:
    from learner.train.learn_settings import LearnSettings

    flags = {"publish_every": args.publish_every, "min_samples": args.min_samples, "lr": args.lr}
    overrides = list(args.overrides) + [f"learn.{k}={json.dumps(v)}" for k, v in flags.items() if v is not None]
    s = LearnSettings.load(args.config, overrides)
    print_config(s, "flywheel learn")
    import signal
    import threading

    from learner.train.learn import Learner, describe

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with console.status("starting the learner") as status:
        learner = Learner(
            s,
            progress=lambda p: (
                status.update(describe(p)),
                p.event.startswith("published") and console.print(describe(p)),
            ),
        )
        try:
            learner.start()
            status.update(
                f"learner at v{learner.state.version}, step {learner.state.step}; waiting for rewarded samples"
            )
            learner.run(stop, max_versions=args.versions, until_idle=args.until_idle)
        except KeyboardInterrupt:
            console.print("stopped; the learner's state is saved after every update")
        finally:
            learner.close()
    return 0


def cmd_bench_learn(args: argparse.Namespace) -> int:
    from learner.train.learn_settings import LearnSettings

    s = LearnSettings.load(args.config, list(args.overrides))
    print_config(s, "flywheel bench learn")
    from ops.bench.learn import run_bench

    run_bench(
        s,
        console,
        lrs=tuple(args.lr),
        versions=args.versions,
        updates=args.updates,
        temperature=args.temperature,
        train_sites=args.train_sites,
        out=args.out,
        command=shlex.join(["flywheel", *sys.argv[1:]]),
    )
    return 0


def cmd_bench_fp4(args: argparse.Namespace) -> int:
    s = _settings(args, {})
    print_config(s, "flywheel bench fp4")
    from ops.bench.fp4 import run_bench

    run_bench(
        s, console, steps=args.steps, out=args.out, command=shlex.join(["flywheel", *sys.argv[1:]]), parts=args.parts
    )
    return 0


def cmd_bench_delta(args: argparse.Namespace) -> int:
    s = _settings(args, {})
    print_config(s, "flywheel bench delta")
    from ops.bench.delta import run_bench

    run_bench(
        s,
        console,
        lrs=tuple(args.lr),
        steps=args.steps,
        versions=args.versions,
        level=args.level,
        threads=args.threads,
        swap=args.swap,
        out=args.out,
        command=shlex.join(["flywheel", *sys.argv[1:]]),
    )
    return 0
