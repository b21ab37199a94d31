"""`flywheel` commands of the learner package (registered by ops/cli/main.py; heavy imports stay inside the commands).

    flywheel pretrain [--corpus DIR] [--size small] [--minutes N] [--steps N] [--fp4 nvfp4|mxfp4|off] [--force]
    flywheel pretrain --base PATH --corpus DIR [--minutes N] [--steps N]
    flywheel base import PATH [--fp4 nvfp4|mxfp4|off]
    flywheel learn [--publish-every 3h] [--min-samples N] [--lr X] [--versions N]
    flywheel eval [--model RUN|HF|vN] [--corpus DIR] [--sites N] [--seed N] [--cursor C] [--compare-prefix] [--gate-curve P ...] [--json]
    flywheel bench fp4 [--steps N] [--out results.json]
    flywheel bench train [--steps N] [--warmup N] [--size small] [--out results.json]
    flywheel bench routes [--sites N] [--out results.json]

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
    p.add_argument(
        "--base",
        metavar="PATH",
        help="continue an imported Hugging Face model's pretraining instead (model.base; imported first if needed), "
        "and publish the result as a new version",
    )
    p.add_argument("--size", help="model size: tiny, small or medium (pretrain.size)")
    p.add_argument("--minutes", type=float, help="training time budget (pretrain.minutes)")
    p.add_argument("--steps", type=int, help="train exactly N steps (pretrain.steps)")
    p.add_argument("--fp4", choices=["nvfp4", "mxfp4", "off"], help="QAT format (pretrain.fp4)")
    p.add_argument("--force", action="store_true", help="retrain even if a finished base is cached")
    add_config_args(p)
    p.set_defaults(fn=cmd_pretrain)

    base = sub.add_parser(
        "base",
        help="bring your own model: a Hugging Face folder as the base",
        description="Bring your own model: a Hugging Face folder as the base the learner trains and serving serves.",
    )
    base_sub = base.add_subparsers(dest="base_command", required=True, metavar="ACTION", parser_class=type(base))
    imp = base_sub.add_parser(
        "import",
        help="make a Hugging Face folder version 0 of the weight store",
        description="Check a Hugging Face model folder (architecture, tokenizer, shards, memory), quantize its FP4 targets "
        "(an MoE's experts by default) and publish it as version 0 of the weight store, a full snapshot. "
        "Serving and the learner then use it. Settings: the [model] section.",
    )
    imp.add_argument("path", metavar="PATH", help="the model folder (config.json, safetensors, tokenizer.json)")
    imp.add_argument("--fp4", choices=["nvfp4", "mxfp4", "off"], help="FP4 format of the FP4 targets (model.fp4)")
    add_config_args(imp)
    imp.set_defaults(fn=cmd_base_import)

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
        "--workers",
        type=int,
        metavar="N",
        help="data-parallel training workers on Ray Train; 1 trains in this process (learn.workers)",
    )
    lp.add_argument(
        "--versions", type=int, metavar="N", help="stop after publishing N versions (default: run until Ctrl-C)"
    )
    lp.add_argument(
        "--until-idle", action="store_true", help="stop once every rewarded sample so far is trained (a batch run)"
    )
    add_config_args(lp)
    lp.set_defaults(fn=cmd_learn)

    ev = sub.add_parser(
        "eval",
        help="held-out evaluation: accept rate, accepted chars, suggestion rate, exact match, latency, with 95%% intervals",
        description="Replay held-out editor sites through the served prompt format, judged as the simulated editor does, "
        "and report each metric with its 95% confidence interval. Settings: the [eval] section.",
    )
    ev.add_argument(
        "--model",
        metavar="RUN|HF|vN",
        help="a pretraining run folder, a Hugging Face folder, or a weight-store version (v7); default: the cached base model",
    )
    ev.add_argument("--corpus", metavar="DIR", help="evaluate on the held-out split of this folder (pretrain.corpus)")
    ev.add_argument("--sites", type=int, help="held-out sites to replay (eval.sites, default 500)")
    ev.add_argument("--seed", type=int, help="picks the sites (eval.seed)")
    ev.add_argument("--max-tokens", type=int, help="longest suggestion (eval.max_tokens)")
    ev.add_argument(
        "--cursor",
        choices=("end_of_line", "in_brackets"),
        help="where each site's cursor is: after code on its line, or inside the brackets that close it (eval.cursor)",
    )
    ev.add_argument(
        "--compare-prefix",
        action="store_true",
        default=None,
        help="also replay the same sites prompted with the prefix alone, beside the FIM prompt (eval.compare_prefix)",
    )
    ev.add_argument(
        "--gate-curve",
        type=float,
        nargs="+",
        metavar="P",
        help="also show the confidence gate's trade-off at these model.min_confidence thresholds (eval.gate_curve)",
    )
    ev.add_argument(
        "--served-mismatch",
        type=int,
        metavar="N",
        help="with --model vN: also its train-inference mismatch on the newest N completions it served, "
        "serving's routes replayed and not (eval.served_mismatch)",
    )
    ev.add_argument("--json", action="store_true", help="print the report as JSON on stdout (progress on stderr)")
    add_config_args(ev)
    ev.set_defaults(fn=cmd_eval)

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

    tr = bench_subcommands(sub).add_parser(
        "train",
        help="pretraining tokens/s: grouped expert matmuls vs the loop over experts, side by side",
        description="Pretraining throughput of the grouped expert computation against the expert loop it replaced: "
        "two copies of one model take turns on the same batches in one process. Settings: the [pretrain] section.",
    )
    tr.add_argument("--steps", type=int, default=20, help="timed training steps per arm (default 20)")
    tr.add_argument("--warmup", type=int, default=2, help="untimed steps per arm first (default 2)")
    tr.add_argument("--size", help="model size: tiny, small or medium (pretrain.size)")
    tr.add_argument("--out", metavar="FILE", help="also write the results as JSON")
    add_config_args(tr)
    tr.set_defaults(fn=cmd_bench_train)

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
    d.add_argument(
        "--swaps",
        type=int,
        default=8,
        help="swaps with --swap, alternating the two ways of --swap-compare (default 8)",
    )
    d.add_argument(
        "--swap-compare",
        choices=("reload", "preempt"),
        default="reload",
        help="with --swap: `reload` alternates vLLM's reload inside the pause with the prepared reload; "
        "`preempt` alternates waiting for in-flight requests with restarting them (default reload)",
    )
    d.add_argument("--out", metavar="FILE", help="also write the results as JSON")
    add_config_args(d)
    d.set_defaults(fn=cmd_bench_delta)

    bl = bench_subcommands(sub).add_parser(
        "learn",
        help="learning curve: held-out reward, accept rate, suggestion rate, accepted chars over K versions vs the base",
        description="RL on simulated editor feedback with the learner's own update, each version replayed on held-out files beside the base model.",
    )
    bl.add_argument("--lr", type=_positive_float, nargs="+", help="learning rates, one curve each (default learn.lr)")
    bl.add_argument("--versions", type=_positive_int, default=3, help="versions per curve (default 3)")
    bl.add_argument(
        "--updates",
        type=_positive_int,
        help="updates per version (default: as the learner publishes, learn.min_samples / learn.batch_size)",
    )
    bl.add_argument(
        "--temperature",
        type=float,
        default=0.2,
        help="sampling temperature of the simulated traffic (default 0.2, serving's for an /infill request naming none)",
    )
    bl.add_argument(
        "--train-sites",
        type=_positive_int,
        default=1500,
        help="cursor sites on training files to sample from (default 1500: editors seldom ask twice at one cursor)",
    )
    bl.add_argument("--sites", type=int, help="held-out sites each version is evaluated on (default eval.sites)")
    bl.add_argument("--out", metavar="FILE", help="also write the results as JSON")
    add_config_args(bl)
    bl.set_defaults(fn=cmd_bench_learn)

    bs = bench_subcommands(sub).add_parser(
        "show",
        help="show policies side by side: suggestion rate, accept rate and accepted chars against the gate alone",
        description="The base's greedy suggestions at training and held-out sites, judged; show policies (logprob "
        "features alone and with the cursor's context, each under one bound and both) fitted on the training outcomes "
        "the gate shows, and replayed on the held-out ones beside the gate alone.",
    )
    bs.add_argument(
        "--train-sites", type=int, default=1500, help="cursor sites on training files to fit on (default 1500)"
    )
    bs.add_argument("--sites", type=int, help="held-out sites (default eval.sites)")
    bs.add_argument("--out", metavar="FILE", help="also write the results as JSON")
    add_config_args(bs)
    bs.set_defaults(fn=cmd_bench_show)

    br = bench_subcommands(sub).add_parser(
        "routes",
        help="router replay: the learner's mismatch to vLLM's logprobs with serving routes replayed vs its own routing",
        description="vLLM samples held-out completions with its routes captured; the learner's FP4 forward recomputes "
        "them with its own routing, high-precision routing replayed, and vLLM's routes replayed (R3).",
    )
    br.add_argument("--sites", type=int, default=200, help="held-out cursor sites (default 200)")
    br.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (default 0.7)")
    br.add_argument("--max-tokens", type=int, default=16, help="tokens per completion (default 16)")
    br.add_argument("--out", metavar="FILE", help="also write the results as JSON")
    add_config_args(br)
    br.set_defaults(fn=cmd_bench_routes)

    bw = bench_subcommands(sub).add_parser(
        "learn-workers",
        help="learner throughput: samples/s with 1 and N data-parallel workers on the same batches, loss curves side by side",
        description="The learner's update (and checkpoint) on the same simulated-feedback batches, in one process and on Ray Train workers.",
    )
    bw.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker counts, one run each (default 1 2)")
    bw.add_argument("--updates", type=int, default=8, help="updates per run; the first is not timed (default 8)")
    bw.add_argument(
        "--temperature", type=float, default=0.7, help="sampling temperature of the simulated traffic (default 0.7)"
    )
    bw.add_argument("--out", metavar="FILE", help="also write the results as JSON")
    add_config_args(bw)
    bw.set_defaults(fn=cmd_bench_learn_workers)


def _positive(convert, what: str):
    """An argparse type: `convert` of the argument, refused (one line) unless finite and above 0."""

    def parse(value: str):
        try:
            x = convert(value)
        except ValueError:
            x = 0
        if not 0 < x < float("inf"):
            raise argparse.ArgumentTypeError(f"{value!r}: give {what}")
        return x

    return parse


_positive_int = _positive(int, "a whole number of at least 1")
_positive_float = _positive(float, "a number above 0")


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
    from pathlib import Path

    if args.base is not None:
        args.overrides = [*args.overrides, f"model.base={json.dumps(str(Path(args.base).expanduser().absolute()))}"]
    s = _settings(
        args, {"corpus": args.corpus, "size": args.size, "minutes": args.minutes, "steps": args.steps, "fp4": args.fp4}
    )
    print_config(s, "flywheel pretrain")
    from learner.train.pretrain import continue_pretraining, ensure_base_model

    if s.model.base is not None:
        continue_pretraining(s, console)
    else:
        ensure_base_model(s, console, force=args.force)
    return 0


def cmd_learn(args: argparse.Namespace) -> int:
    from learner.train.learn_settings import LearnSettings

    flags = {
        "publish_every": args.publish_every,
        "min_samples": args.min_samples,
        "lr": args.lr,
        "workers": args.workers,
    }
    overrides = list(args.overrides) + [f"learn.{k}={json.dumps(v)}" for k, v in flags.items() if v is not None]
    s = LearnSettings.load(args.config, overrides)
    print_config(s, "flywheel learn")
    import signal
    import threading

    from learner.train.learn import Learner, describe

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with console.status("starting the learner") as status:

        def show(p):
            status.update(describe(p))
            if p.event.startswith("published"):
                console.print(describe(p))

        if s.learn.workers > 1:
            from learner.train.learn_workers import run_workers

            status.update(f"starting {s.learn.workers} learner workers on Ray Train")
            try:
                run_workers(s, progress=show, stop=stop, max_versions=args.versions, until_idle=args.until_idle)
            except KeyboardInterrupt:
                console.print("stopped; the learner's state is saved after every update")
            return 0
        learner = Learner(s, progress=show)
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


def cmd_eval(args: argparse.Namespace) -> int:
    from pathlib import Path

    from learner.train.eval_settings import EvalSettings
    from ops.cli.console import err_console

    flags = {
        "sites": args.sites,
        "seed": args.seed,
        "max_tokens": args.max_tokens,
        "cursor": args.cursor,
        "compare_prefix": args.compare_prefix,
        "gate_curve": args.gate_curve,
        "served_mismatch": args.served_mismatch,
    }
    overrides = list(args.overrides) + [f"eval.{k}={json.dumps(v)}" for k, v in flags.items() if v is not None]
    s = EvalSettings.load(args.config, overrides)
    out = err_console if args.json else console
    if not args.json:
        print_config(s, "flywheel eval")
    from learner.train.evaluate import run

    corpus = Path(args.corpus).expanduser() if args.corpus else None
    report = run(s, out, model=args.model, corpus=corpus, table=not args.json)
    if args.json:
        sys.stdout.write(json.dumps({"command": shlex.join(["flywheel", *sys.argv[1:]]), **report}, indent=1) + "\n")
    return 0


def cmd_bench_learn_workers(args: argparse.Namespace) -> int:
    from learner.train.learn_settings import LearnSettings
    from ops.bench.learn_workers import run_bench

    s = LearnSettings.load(args.config, list(args.overrides))
    print_config(s, "flywheel bench learn-workers")
    run_bench(
        s,
        console,
        workers=tuple(args.workers),
        updates=args.updates,
        temperature=args.temperature,
        out=args.out,
        command=shlex.join(["flywheel", *sys.argv[1:]]),
    )
    return 0


def cmd_bench_learn(args: argparse.Namespace) -> int:
    from ops.bench.learn import BenchLearnSettings, run_bench

    overrides = list(args.overrides) + ([f"eval.sites={args.sites}"] if args.sites is not None else [])
    s = BenchLearnSettings.load(args.config, overrides)
    print_config(s, "flywheel bench learn")

    run_bench(
        s,
        console,
        lrs=tuple(args.lr or [s.learn.lr]),
        versions=args.versions,
        updates=-(-s.learn.min_samples // s.learn.batch_size) if args.updates is None else args.updates,
        temperature=args.temperature,
        train_sites=args.train_sites,
        out=args.out,
        command=shlex.join(["flywheel", *sys.argv[1:]]),
    )
    return 0


def cmd_bench_show(args: argparse.Namespace) -> int:
    from ops.bench.show import BenchLearnSettings, run_bench

    overrides = list(args.overrides) + ([f"eval.sites={args.sites}"] if args.sites is not None else [])
    s = BenchLearnSettings.load(args.config, overrides)
    print_config(s, "flywheel bench show")
    run_bench(s, console, train_sites=args.train_sites, out=args.out, command=shlex.join(["flywheel", *sys.argv[1:]]))
    return 0


def cmd_bench_routes(args: argparse.Namespace) -> int:
    s = _settings(args, {})
    print_config(s, "flywheel bench routes")
    from ops.bench.routes import run_bench

    run_bench(
        s,
        console,
        sites=args.sites,
        temperature=args.temperature,
        max_tokens=args.max_tokens,
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


def cmd_bench_train(args: argparse.Namespace) -> int:
    from feedback.core.errors import UserError

    if args.steps < 1 or args.warmup < 0:
        raise UserError(f"--steps must be at least 1 and --warmup at least 0, got {args.steps} and {args.warmup}")
    s = _settings(args, {"size": args.size})
    print_config(s, "flywheel bench train")
    from ops.bench.train import run_bench

    run_bench(
        s,
        console,
        steps=args.steps,
        warmup=args.warmup,
        out=args.out,
        command=shlex.join(["flywheel", *sys.argv[1:]]),
    )
    return 0


def cmd_bench_delta(args: argparse.Namespace) -> int:
    from learner.train.learn_settings import LearnSettings

    s = LearnSettings.load(args.config, list(args.overrides))  # [learn]: which weights the learner trains
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
        swaps=args.swaps,
        swap_compare=args.swap_compare,
        out=args.out,
        command=shlex.join(["flywheel", *sys.argv[1:]]),
    )
    return 0


def cmd_base_import(args: argparse.Namespace) -> int:
    from pathlib import Path

    from feedback.core.errors import UserError
    from learner.train.learn_settings import LearnSettings
    from serving.settings import ServingSettings

    class ImportSettings(LearnSettings, ServingSettings):
        """`flywheel base import`: [model], the store's [learn] options, and [serve] for the replica count."""

    flags = {"base": str(Path(args.path).expanduser().absolute()), "fp4": args.fp4}
    overrides = list(args.overrides) + [f"model.{k}={json.dumps(v)}" for k, v in flags.items() if v is not None]
    s = ImportSettings.load(args.config, overrides)
    print_config(s, "flywheel base import")
    from feedback import db
    from feedback.producer import BufferedProducer
    from learner import store as S
    from learner.base import ensure_imported

    store = S.settings_store(
        s,
        full_every=s.learn.full_every,
        zstd_level=s.learn.zstd_level,
        zstd_threads=s.learn.zstd_threads,
    )
    engine = db.make_engine(s.database_url)
    db.upgrade(engine)
    producer = BufferedProducer(s.kafka)
    try:
        with console.status(f"checking and importing {flags['base']}"):
            base, published = ensure_imported(
                s.model, store, engine=engine, producer=producer, replicas=s.serve.replicas + s.serve.canary_replicas
            )
    except ValueError as e:
        raise UserError(str(e)) from None
    finally:
        producer.close(timeout_s=10)
    from rich.markup import escape

    v0, tensors = store.model_version(0), store.manifest(0)["tensors"]
    n_fp4 = sum(t["kind"] == "fp4" for t in tensors.values())
    fp4 = f"{n_fp4} of {len(tensors)} tensors in {base['fp4_format']}" if n_fp4 else "no FP4 tensors (bf16)"
    prompts = f"the {base['fim']} FIM template" if base["fim"] else "prefix-only (no FIM tokens)"
    console.print(
        f"[green]{'imported' if published else 'already imported'}[/] {escape(base['source'])} ({base['architecture']}, "
        f"{base['parameters'] / 1e6:,.1f}M parameters) as v0 of {escape(store.uri())}: {v0.full_size_bytes:,} bytes packed, "
        f"{fp4}; prompts: {prompts}, window {base['window']}. `flywheel serve` and `flywheel learn` now use it.",
        soft_wrap=True,
    )
    return 0
