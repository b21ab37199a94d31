"""`flywheel eval`: one model replayed on held-out editor sites (learner/eval.py), reported with
95% confidence intervals.

    model     --model: a pretraining run folder (its `hf/`), an exported Hugging Face folder, or
              a version in the weight store (`v7` or `7`: its served weights, FP4 dequantized, on
              the base model's config and tokenizer, as a replica runs it); default: the base
              model of the [pretrain] settings
    sites     eval.sites cursor sites picked by eval.seed from the held-out split of the corpus,
              at the end of a line or inside its closing brackets (eval.cursor)
              (pretrain.corpus, or --corpus; the split is pretraining's, by a hash of each path,
              so a model pretrained on that corpus never saw these files)
    replay    learner.eval.evaluate: serving's prompt format, greedy decoding, the simulated
              editor's judge, the sink's reward; with eval.compare_prefix, the same sites again
              prompted with the prefix alone (learner.eval.prefix_only), reported beside it

The learner's gate, `flywheel bench learn` and the demo's summary replay with the same function.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from tokenizers import Tokenizer

from feedback.core.errors import UserError
from learner import eval as E
from learner.corpus import SourceFile, load_corpus
from learner.formats import ModelFormat
from learner.model import Transformer
from learner.show import ShowPolicy
from learner.train.eval_settings import EvalSection, EvalSettings

_VERSION = re.compile(r"v?(\d+)")


@dataclass
class EvalTarget:
    """A model ready to replay, and what it is (for the report)."""

    model: Transformer
    tok: Tokenizer
    fmt: ModelFormat  # its tokens, template and window: the prompts are built as serving builds them
    label: str  # where it came from
    name: str  # a column heading: base, v7, the folder's name
    show_policy: ShowPolicy | None = None  # a store version's learned show policy (learner/show.py)
    version: int | None = None  # the store version it is, if one


def load_target(spec: str | None, s: EvalSettings) -> EvalTarget:
    """The model `spec` names (see the module docstring); UserError (one line) if it names none."""
    if spec is None:
        if s.model.base is not None:  # an imported base: the folder the user named
            hf = Path(s.model.base).expanduser()
            model, tok, fmt = _load_folder(hf, "model.base", s.model.fim)
            return EvalTarget(model, tok, fmt, f"base model {hf}", "base")
        folder = _base_folder(s)
        model, tok, fmt = _load_folder(folder / "hf", "the base model", s.model.fim)
        return EvalTarget(model, tok, fmt, f"base model {folder / 'hf'}", "base")
    path = Path(spec).expanduser()
    if path.is_dir():
        hf = path if (path / "config.json").is_file() else path / "hf"
        if not (hf / "config.json").is_file():
            raise UserError(
                f"--model {spec}: neither a Hugging Face folder (config.json) nor a pretraining run folder (hf/config.json)"
            )
        model, tok, fmt = _load_folder(hf, f"--model {spec}", s.model.fim)
        return EvalTarget(model, tok, fmt, str(hf), path.name)
    m = _VERSION.fullmatch(spec)
    if m is None:
        raise UserError(f"--model {spec}: no such folder, and not a store version (v7 or 7)")
    return _store_version(int(m[1]), s)


def _load_folder(hf: Path, what: str, fim: str) -> tuple[Transformer, Tokenizer, ModelFormat]:
    from learner.export import load_hf
    from learner.formats import read_format
    from learner.tokenizer import load_tokenizer

    try:
        model, _ = load_hf(hf)
        return model.eval(), load_tokenizer(hf), read_format(hf, fim=fim)
    except (OSError, ValueError, KeyError) as e:
        raise UserError(f"{what}: cannot load the model in {hf}: {e}") from None


def _base_folder(s: EvalSettings) -> Path:
    from learner.train.pretrain import find_base_model

    folder = find_base_model(s)
    if folder is None:
        raise UserError(
            "no pretrained base model for these [pretrain] settings: run `flywheel pretrain` first, or pass --model"
        )
    return folder


def _store_version(version: int, s: EvalSettings) -> EvalTarget:
    """A published version as a replica serves it: the packed weights on the config and tokenizer
    the store keeps beside its versions (an imported base's), or else the pretrained base's."""
    import json
    import tempfile

    from learner.formats import read_format
    from learner.model import ModelArgs
    from learner.store import BASE_FILE, StoreError, settings_store
    from learner.tokenizer import load_tokenizer
    from learner.train.learn import model_from_packed

    store = settings_store(s)
    have = store.versions()
    if version not in have:
        listed = ", ".join(f"v{v}" for v in have[-8:]) or "none"
        raise UserError(f"--model v{version}: not in the weight store {store.uri()} (its newest versions: {listed})")
    with tempfile.TemporaryDirectory(prefix="flywheel-eval-") as tmp:
        files = store.model_files()
        if files:
            folder, where = Path(tmp), f"the model files of {store.uri()}"
            for name, data in files.items():
                if name != BASE_FILE:
                    (folder / name).write_bytes(data)
        else:
            folder = _base_folder(s) / "hf"
            where = f"the base model of these [pretrain] settings ({folder})"
        args = ModelArgs.from_hf_config(json.loads((folder / "config.json").read_text()))
        tok, fmt = load_tokenizer(folder), read_format(folder, fim=s.model.fim)
    try:
        packed = store.materialize(version)
    except StoreError as e:
        raise UserError(f"--model v{version}: {e}") from None
    try:
        model = model_from_packed(packed, args)
        policy = store.show_policy(version)
    except (RuntimeError, KeyError) as e:  # a store of another base: shapes or names differ
        raise UserError(f"--model v{version} does not fit {where}: {str(e).splitlines()[0]}") from None
    except StoreError as e:
        raise UserError(f"--model v{version}: {e}") from None
    label = f"v{version} ({store.uri(version)})"
    if policy is not None:
        label += f", with its show policy (fitted on {policy.samples} shown suggestions)"
    return EvalTarget(model, tok, fmt, label, f"v{version}", policy, version)


def heldout_files(s: EvalSettings, corpus: Path | None = None) -> tuple[list[SourceFile], str]:
    """The held-out split of `corpus` (default: pretrain.corpus) and a name for it."""
    cfg = s.pretrain
    root = corpus if corpus is not None else cfg.corpus
    try:
        c = load_corpus(root, heldout_fraction=cfg.heldout_fraction, max_file_bytes=cfg.max_file_kb * 1024)
    except ValueError as e:
        raise UserError(str(e)) from None
    if not c.heldout:
        raise UserError(
            f"the corpus {c.root} has no held-out files (pretrain.heldout_fraction={cfg.heldout_fraction}); "
            "pass a larger --corpus or raise the fraction"
        )
    return c.heldout, str(c.root)


def replay(
    target: EvalTarget,
    files: list[SourceFile],
    cfg: EvalSection,
    console: Console,
    *,
    fmt: ModelFormat | None = None,
    min_confidence: float = 0.0,
) -> E.ReplayStats:
    """`learner.eval.evaluate` with a progress bar on `console`; `fmt`: prompt in this format
    instead of the model's own (the prefix-only comparison); `min_confidence`: the confidence
    gate's threshold (model.min_confidence)."""
    with Progress(
        TextColumn("[bold]eval[/]" if fmt is None else "[bold]eval, prefix only[/]"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[line]}"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=console,
        transient=True,
    ) as progress:
        task = progress.add_task("eval", total=cfg.sites, line="")
        seen = {"shown": 0, "accepted": 0}

        def on_site(r: E.SiteResult) -> None:
            seen["shown"] += bool(r.text)
            seen["accepted"] += r.verdict == "select"
            progress.update(task, advance=1, line=f"{seen['shown']} shown, {seen['accepted']} accepted")

        return E.evaluate(
            target.model,
            target.tok,
            target.fmt if fmt is None else fmt,
            files,
            sites=cfg.sites,
            seed=cfg.seed,
            max_tokens=cfg.max_tokens,
            threads=cfg.threads,
            progress=on_site,
            token_accuracy=cfg.token_accuracy,
            min_confidence=min_confidence,
            cursor=cfg.cursor,
            show_policy=target.show_policy,
        )


def run(
    s: EvalSettings, console: Console, *, model: str | None, corpus: Path | None, table: bool = True
) -> dict[str, Any]:
    """Evaluate `model`, showing progress on `console`; print the report as a table there unless
    `table` is off; return it as JSON-safe data."""
    cfg = s.eval
    target = load_target(model, s)
    if cfg.served_mismatch and target.version is None:
        raise UserError(f"eval.served_mismatch needs a store version (--model vN), not {target.label}")
    files, corpus_name = heldout_files(s, corpus)
    gate = s.model.min_confidence
    # The gate only hides suggestions: a curve replays once without it and applies each threshold.
    open_ = replay(target, files, cfg, console) if cfg.gate_curve else None
    stats = open_.gated(gate) if open_ is not None else replay(target, files, cfg, console, min_confidence=gate)
    compare = cfg.compare_prefix and target.fmt.fim is not None
    if cfg.compare_prefix and not compare:
        console.print(f"{target.name} has no FIM template: its prompts are prefix-only already, nothing to compare")
    plain = replay(target, files, cfg, console, fmt=E.prefix_only(target.fmt), min_confidence=gate) if compare else None
    if stats.n < cfg.sites:
        console.print(f"only {stats.n} sites found in {len(files)} held-out files (eval.sites={cfg.sites})")
    report = {
        "model": target.label,
        "corpus": corpus_name,
        "heldout_files": len(files),
        "sites": stats.n,
        "seed": cfg.seed,
        "cursor": cfg.cursor,
        "max_tokens": cfg.max_tokens,
        "min_confidence": gate,
        "stats": stats.summary(),
    }
    if plain is not None:
        report["prefix_only_stats"] = plain.summary()
    curve = {th: open_.gated(th) for th in cfg.gate_curve} if open_ is not None else {}
    if curve:
        report["gate_curve"] = [{"min_confidence": th, **st.summary()} for th, st in curve.items()]
    mismatch = served_mismatch(target, s, console) if cfg.served_mismatch else None
    if cfg.served_mismatch:
        report["served_mismatch"] = None if mismatch is None else mismatch.as_dict()
    if not table:
        return report
    columns = (
        {target.name: stats} if plain is None else {f"{target.name}, FIM": stats, f"{target.name}, prefix only": plain}
    )
    console.print(E.report_table(columns, title="flywheel eval"))
    if curve:
        console.print(E.gate_curve_table(curve, current=gate))
    console.print(
        f"{target.name}: {target.label}; {stats.n} sites of {len(files)} held-out files in {corpus_name} "
        f"(seed {cfg.seed}, cursor {cfg.cursor}, max_tokens {cfg.max_tokens}), replayed in {stats.seconds:.0f} s; "
        + (
            f"the confidence gate (model.min_confidence={gate}) withheld {stats.withheld} suggestions"
            if gate
            else "no confidence gate (model.min_confidence=0)"
        ),
        markup=False,
        soft_wrap=True,
    )
    if mismatch is not None:
        lo, hi = mismatch.ratio_interval or (None, None)
        console.print(
            f"{target.name}'s train-inference mismatch KL per token on the newest {mismatch.completions} completions it "
            f"served ({mismatch.tokens} tokens): serving's routes replayed {mismatch.replay:.1e}, own routing "
            f"{mismatch.own:.1e}"
            + (f" = {mismatch.ratio:.2f}x" if mismatch.ratio is not None else "")
            + (f" [{lo:.2f}, {hi:.2f}]" if lo is not None else "")
            + f"; vLLM's experts differ from the forward's own at {mismatch.rerouted:.2%} of routed pairs"
            + (", so replay changes nothing" if not mismatch.rerouted else ""),
            markup=False,
            soft_wrap=True,
        )
    elif cfg.served_mismatch:
        console.print(f"{target.name} served no completion with routes in the database: no mismatch to measure")
    return report


def served_mismatch(target: EvalTarget, s: EvalSettings, console: Console):
    """The store version `target`'s mismatch on the newest `eval.served_mismatch` completions it
    served, read from the settings' database (learner.train.mismatch); None if it served none."""
    from sqlalchemy.exc import DBAPIError

    from feedback import db
    from feedback.core.errors import first_line
    from learner.train.mismatch import served_mismatch as measure
    from learner.train.mismatch import served_samples

    engine = db.make_engine(s.database_url)
    try:
        samples = served_samples(engine, target.version, s.eval.served_mismatch, target.model.args.vocab_size)
    except DBAPIError as e:  # unreachable, or no schema: nothing served there
        where = engine.url.render_as_string(hide_password=True)
        raise UserError(
            f"eval.served_mismatch: cannot read completions from {where}: {first_line(e, with_type=False)}"
        ) from None
    finally:
        engine.dispose()
    if not samples:
        return None
    with console.status(f"mismatch of {target.name} on {len(samples)} served completions") as status:
        return measure(
            target.model,
            target.model.args,
            target.fmt,
            samples,
            version=target.version,
            progress=lambda n: status.update(f"mismatch of {target.name}: {n}/{len(samples)} served completions"),
        )
