"""`flywheel bench learn`: does the learner make completions better? A learning curve against the base.

One run, one process, the learner's own code path on simulated editor feedback:

    for each learning rate:                      (the base model is the baseline, replayed in the same run)
      for version 1..K:
        N updates: the FP4 policy (as served) samples completions at cursor sites of the
                   *training* files; serving's confidence gate withholds the unsure ones
                   (model.min_confidence), which no editor sees and the learner never trains
                   on, so they are drawn again; the simulated editor judges the rest
                   (learner.judge), feedback.reward scores them as the sink would,
                   learner.train.learn.rl_update trains
        publish:   pack to FP4, the delta against the previous version as the store encodes it
                   (learner.delta, zstd at learn.zstd_level), fit the show policy on the
                   outcomes of the suggestions shown so far (learner.show, as the learner
                   does; `learn.show`), then the evaluation
                   (learner.eval.evaluate, as `flywheel eval`: eval.sites held-out sites, or
                   --sites) of the served weights with their show policy

Only the weights `learn.train_weights` names are trained, as in the learner. Reported per version:
held-out reward, accept rate and accepted characters per request with their 95% confidence
intervals, suggestion rate, exact match, the KL to the base, and the delta's size as a share of
the full checkpoint, each beside the base model's: the trade-off of learning against delta size;
and the tests of what the issue asks of learning: the accept rate against the base's on the same
sites (the ratio and the one-sided p of a paired bootstrap, learner.eval.paired_accept_ratio, with
the unpaired two-proportion test's p beside it) and the paired change in accepted characters per
request.
Training traffic is served as serving serves it: the gate, then the version's show policy with
its exploration share.
No Kafka, vLLM or HTTP: this measures learning, not serving; the demo and the e2e test run the
same learner on real traffic.
"""

from __future__ import annotations

import copy
import json
import random
import time
from pathlib import Path
from typing import Any, NamedTuple

from rich.console import Console
from rich.table import Table
from rich.text import Text

from learner.train.eval_settings import EvalSettings
from learner.train.learn_settings import LearnSettings


class BenchLearnSettings(LearnSettings, EvalSettings):
    """`flywheel bench learn`: the learner's settings ([learn]) and the evaluation's ([eval])."""


def run_bench(
    s: BenchLearnSettings,
    console: Console,
    *,
    lrs: tuple[float, ...],
    versions: int,
    updates: int,
    temperature: float,
    train_sites: int,
    out: str | None,
    command: str,
) -> dict:
    import torch

    from feedback.core.errors import UserError
    from feedback.reward import reward
    from learner import delta as codec
    from learner import eval as E
    from learner import show
    from learner import store as S
    from learner.confidence import withheld
    from learner.decode import decode, room
    from learner.judge import cursor_sites, judge
    from learner.languages import editor_stops
    from learner.train.learn import (
        Sample,
        make_batch,
        model_from_packed,
        policy_kl,
        rl_update,
        train_only,
        train_weights,
    )
    from learner.train.pretrain import (
        fp4_hook,
    )

    base_dir, master, args, tok, model_format, fmt, corpus = load_base(s)
    hook = fp4_hook(fmt)
    g, ev = s.learn.gate, s.eval
    n_held = ev.sites

    def evaluate(model, policy=None) -> E.ReplayStats:
        return E.evaluate(
            model,
            tok,
            model_format,
            corpus.heldout,
            sites=n_held,
            seed=ev.seed,
            max_tokens=ev.max_tokens,
            min_confidence=s.model.min_confidence,
            cursor=ev.cursor,
            show_policy=policy,
        )

    train = cursor_sites(corpus.train, train_sites, random.Random(7))
    builder = E.prompt_builder(tok, model_format, args.max_seq_len)
    prompts = [E.site_prompt(builder, site)[0] for site in train]
    from learner.corpus import heldout_windows, token_stream

    windows = heldout_windows(token_stream(model_format, tok, corpus.heldout), args.max_seq_len - 1, 16)[:, :-1]

    base_packed = S.pack_checkpoint(master.state_dict(), fmt)
    base_served = model_from_packed(base_packed, args)
    t0 = time.perf_counter()
    base_stats = evaluate(base_served)
    console.print(f"base model: held-out replay of {base_stats.n} sites in {time.perf_counter() - t0:.0f} s")
    rows = [
        {
            "lr": None,
            "version": 0,
            "updates": 0,
            **_summary(base_stats),
            "kl_to_base": 0.0,
            "train_reward": None,
            "mismatch_kl_replay": None,
            "mismatch_kl_no_replay": None,
            "train_withheld": None,
            "show_policy_samples": None,
            "accept_p_vs_base": None,
            "accept_p_unpaired": None,
            "accept_ratio_vs_base": None,
            "chars_vs_base": None,
            "delta_bytes": None,
            "full_bytes": codec.checkpoint_nbytes(base_packed),
        }
    ]
    cfg = s.learn
    trained_patterns = train_weights(master, cfg.train_weights)
    for lr in lrs:
        policy = copy.deepcopy(master).train()
        trained, total = train_only(policy, trained_patterns)
        if trained < total:
            console.print(f"training {trained:,} of {total:,} parameters (learn.train_weights {trained_patterns})")
        previous = base_packed
        ref = copy.deepcopy(master).eval().requires_grad_(False)
        opt = torch.optim.AdamW(policy.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
        gen = torch.Generator().manual_seed(0)
        rng = random.Random(0)
        step = 0
        shown_rows: list[list[float]] = []  # the show policy's outcomes (learner.show), newest last
        policy_withheld: list[list[float]] = []  # features of what it withheld (the gate would have shown)
        show_policy = None  # the served version's: the base has none
        with console.status(f"lr {lr:g}") as status:
            for v in range(1, versions + 1):
                rewards, mism_replay, mism_none = [], [], []
                withheld_draws = 0  # the samples trained are `rewards`
                for _ in range(updates):
                    batch = []
                    behaviour = model_from_packed(
                        S.pack_checkpoint(policy.state_dict(), fmt), args
                    )  # what serving would run
                    for _draw in range(cfg.batch_size * _MAX_DRAWS):
                        if len(batch) == cfg.batch_size:
                            break
                        i = rng.randrange(len(train))
                        # Sampled like the replica samples (raw logprobs of the sampled tokens).
                        c = decode(
                            behaviour,
                            tok,
                            prompts[i],
                            room(args.max_seq_len, len(prompts[i]), g.max_tokens),
                            stop_ids=model_format.eos_ids,
                            temperature=temperature,
                            generator=gen,
                            stop=editor_stops(train[i].language, train[i].prefix),
                        )
                        line = show.cursor_line(train[i].prefix)
                        if c.text and withheld(c.logprobs, s.model.min_confidence, c.text, show_policy, line):
                            gated = show_policy is None or withheld(c.logprobs, s.model.min_confidence)
                            if gated or not show_policy.explores(f"b{step}-{_draw}"):
                                withheld_draws += 1  # as serving: never shown, so never trained
                                if not gated:  # the show policy's: part of what the gate showed
                                    policy_withheld.append(show.features(c.logprobs, c.text, line))
                                    del policy_withheld[: -cfg.show.window]
                                continue
                        r, parts = reward(E.editor_feedback(c.text, judge(c.text, train[i].truth)))
                        if c.text and cfg.show.enabled:
                            label = float(show.accepted(parts["outcome"], r))
                            shown_rows.append([*show.features(c.logprobs, c.text, line), label])
                            del shown_rows[: -cfg.show.window]
                        batch.append(
                            Sample(step, f"b{step}", 0, v - 1, prompts[i], c.ids, c.logprobs, r, parts["outcome"])
                        )
                        rewards.append(r)
                    if not batch:
                        raise UserError(
                            f"the confidence gate (model.min_confidence={s.model.min_confidence}) withheld all "
                            f"{cfg.batch_size * _MAX_DRAWS} sampled suggestions: nothing to train on"
                        )
                    m = rl_update(policy, ref, opt, make_batch(batch, args, model_format), hook=hook, cfg=cfg)
                    mism_replay.append(m["mismatch_kl_replay"])
                    mism_none.append(m["mismatch_kl_no_replay"])
                    step += 1
                    status.update(
                        f"lr {lr:g}: version {v}/{versions}, update {step}: train reward {m['reward_mean']:+.3f}, "
                        f"mismatch {m['mismatch_kl_replay']:.4f} (replay) / {m['mismatch_kl_no_replay']:.4f} (none)"
                    )
                packed = S.pack_checkpoint(policy.state_dict(), fmt)
                # what the learner would publish: the delta against the previous version, as the store encodes it
                delta_bytes = len(
                    codec.encode(codec.diff(previous, packed), level=cfg.zstd_level, threads=cfg.zstd_threads)
                )
                previous = packed
                served = model_from_packed(packed, args)
                if cfg.show.enabled:  # as the learner: a new fit, else the last one
                    fitted = cfg.show.fit(shown_rows, policy_withheld)
                    show_policy = fitted or show_policy
                stats = evaluate(served, show_policy)
                rows.append(
                    {
                        "lr": lr,
                        "version": v,
                        "updates": step,
                        **_summary(stats),
                        "kl_to_base": policy_kl(served, base_served, windows),
                        "train_reward": sum(rewards) / len(rewards),
                        "mismatch_kl_replay": sum(mism_replay) / len(mism_replay),
                        "mismatch_kl_no_replay": sum(mism_none) / len(mism_none),
                        "train_withheld": withheld_draws / (len(rewards) + withheld_draws),
                        "show_policy_samples": show_policy.samples if show_policy is not None else None,
                        **_against_base(stats, base_stats),
                        "delta_bytes": delta_bytes,
                        "full_bytes": codec.checkpoint_nbytes(packed),
                    }
                )
                console.print(_row_text(rows[-1], rows[0]))
    table = Table(
        "lr",
        "version",
        "updates",
        "held-out reward",
        "accept rate [95% CI]",
        "suggestion rate",
        "accepted chars / request [95% CI]",
        "KL to base",
        "withheld (training traffic)",
        "show policy (outcomes)",
        "accept rate / base, paired [95% CI]",
        "p (accept rate > base), paired / unpaired",
        "chars - base [95% CI]",
        "mismatch KL replay / none",
        "delta (share of full)",
        title=f"learning curve: {n_held} held-out sites (flywheel eval's replay), {cfg.batch_size} samples/update, "
        f"{updates} updates/version, training {trained_patterns}",
    )
    for r in rows:
        table.add_row(
            "base" if r["lr"] is None else f"{r['lr']:g}",
            str(r["version"]),
            str(r["updates"]),
            f"{r['reward']:+.3f}",
            _with_interval(r, "accept_rate", "{:.1%}"),
            f"{r['suggestion_rate']:.1%}",
            _with_interval(r, "accepted_chars_per_request", "{:.2f}"),
            f"{r['kl_to_base']:.2e}",
            "" if r["train_withheld"] is None else f"{r['train_withheld']:.0%}",
            "" if r["show_policy_samples"] is None else str(r["show_policy_samples"]),
            "" if r["accept_ratio_vs_base"] is None else E.PairedRatio(**r["accept_ratio_vs_base"]).ratio_text(),
            ""
            if r["accept_p_vs_base"] is None
            else f"{E.PairedRatio(**r['accept_ratio_vs_base']).p_text()} / {r['accept_p_unpaired']:.4f}",
            "" if r["chars_vs_base"] is None else _difference(r["chars_vs_base"]),
            ""
            if r["mismatch_kl_replay"] is None
            else f"{r['mismatch_kl_replay']:.2e} / {r['mismatch_kl_no_replay']:.2e}",
            "" if r["delta_bytes"] is None else _delta_share(r),
        )
    console.print(table)
    result = {
        "command": command,
        "base": str(base_dir),
        "heldout_sites": n_held,
        "train_sites": len(train),
        "temperature": temperature,
        "batch_size": cfg.batch_size,
        "updates_per_version": updates,
        "train_weights": trained_patterns,
        "zstd_level": cfg.zstd_level,
        "rows": rows,
    }
    if out:
        Path(out).write_text(json.dumps(result, indent=1) + "\n")
    return result


class Base(NamedTuple):
    """The pretrained base a benchmark runs on (`load_base`)."""

    dir: Path
    master: Any  # the master weights (learner.model)
    args: Any  # their ModelArgs
    tok: Any  # tokenizer
    model_format: Any  # learner.formats.ModelFormat
    packing: str  # FP4 packing, as its run recorded it
    corpus: Any  # its training corpus (train and held-out files)


def load_base(s: BenchLearnSettings) -> Base:
    """The pretrained base these settings name; a UserError (one line) where there is none."""
    from feedback.core.errors import UserError
    from learner.formats import read_format
    from learner.tokenizer import load_tokenizer
    from learner.train.pretrain import find_base_model, load_master_weights, load_training_corpus, pretrain_section

    base_dir = find_base_model(s)
    if base_dir is None:
        raise UserError("no pretrained base model for these [pretrain] settings: run `flywheel pretrain` first")
    master, args = load_master_weights(base_dir)
    return Base(
        base_dir,
        master,
        args,
        load_tokenizer(base_dir / "hf"),
        read_format(base_dir / "hf"),
        json.loads((base_dir / "run.json").read_text())["settings"].get("fp4", "nvfp4"),
        load_training_corpus(pretrain_section(s)),
    )


# Most draws per sample of an update: the gate may withhold most of an unsure model's suggestions.
_MAX_DRAWS = 100


def _summary(st) -> dict:
    """The curve's columns, from learner.eval.ReplayStats' own aggregates and intervals."""
    return {
        "reward": st.mean_reward,
        "accept_rate": st.accept_rate,
        "suggestion_rate": st.suggestion_rate,
        "accepted_chars_per_request": st.accepted_chars_per_request,
        "exact_match": st.exact_match,
        "sites": st.n,
        "intervals": {name: i.as_dict() for name, i in st.intervals().items()},
    }


def _against_base(st, base) -> dict:
    """What the issue asks of learning, on the same sites: is the accept rate (of shown) higher
    than the base's, and by how much (a paired bootstrap over the sites, learner.eval.
    paired_accept_ratio; the unpaired two-proportion test beside it, which ignores that both
    replays ran on the same sites), and the paired change in accepted characters per request
    with its 95% t interval. The p values are None when either showed nothing."""
    from learner import eval as E
    from ops.rollout.stats import two_proportion_ztest

    unpaired = (
        two_proportion_ztest(base.accepted, base.shown, st.accepted, st.shown).p if st.shown and base.shown else None
    )
    paired = E.paired_accept_ratio(base.results, st.results)
    diffs = [a.accepted_chars - b.accepted_chars for a, b in zip(st.results, base.results, strict=True)]
    i = E.t_interval(diffs)
    return {
        "accept_p_vs_base": paired.p,
        "accept_p_unpaired": unpaired,
        "accept_ratio_vs_base": paired.as_dict(),
        "chars_vs_base": {"mean": sum(diffs) / len(diffs), "low": i.low, "high": i.high},
    }


def _difference(d: dict) -> str:
    if d["low"] is None or d["high"] is None:
        return f"{d['mean']:+.2f}"
    return f"{d['mean']:+.2f} [{d['low']:+.2f}, {d['high']:+.2f}]"


def _delta_share(row: dict) -> str:
    """A version's delta against the previous one, as bytes and as the share of the full checkpoint."""
    d, full = row["delta_bytes"], row["full_bytes"]
    return f"{d:,} B (1/{full / d:.0f})" if d else "0 B (no weight changed)"


def _with_interval(row: dict, name: str, fmt: str) -> Text:
    i = row["intervals"][name]
    if i["low"] is None or i["high"] is None:
        return Text(fmt.format(row[name]))
    return Text(f"{fmt.format(row[name])} [{fmt.format(i['low'])}, {fmt.format(i['high'])}]")


def _row_text(r: dict, base: dict) -> str:
    return (
        f"lr {r['lr']:g} v{r['version']} ({r['updates']} updates): held-out reward {r['reward']:+.3f} (base {base['reward']:+.3f}), "
        f"accept {r['accept_rate']:.1%} (base {base['accept_rate']:.1%}), suggestions {r['suggestion_rate']:.1%} "
        f"(base {base['suggestion_rate']:.1%}), train reward {r['train_reward']:+.3f} ({r['train_withheld']:.0%} of "
        f"sampled suggestions withheld by the gate), delta {_delta_share(r)}"
    )
