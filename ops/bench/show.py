"""`flywheel bench show`: which show policy keeps what users take? Policies side by side on the same sites.

One run, one process, the base model as serving runs it (FP4):

    suggestions  greedy (as `flywheel eval` replays), at --train-sites cursor sites of the training
                 files and at eval.sites held-out sites (flywheel eval's), each judged by the
                 simulated editor (learner.judge); neither the gate nor a policy applied yet
    fits         for each policy (its features and bounds, the rest `learn.show`), learner.show.fit
                 on the outcomes of the training suggestions the confidence gate shows (what users
                 saw, as the learner fits on them)
    replay       the held-out suggestions through the gate and each policy (learner.eval.gated),
                 against the gate alone on the same sites

The policies: the logprob features alone and with the cursor's context (learner.show), each under
the bound on what the gate showed (`max_withheld`) alone and with the bound on withheld accepts
(`max_accepts_withheld`, the default). Reported per policy: the suggestion rate, the accept rate of
shown against the gate's (the ratio with its interval and one-sided p from a paired bootstrap over
the sites, learner.eval.paired_accept_ratio), accepted characters per request and their paired
change with its 95% t interval, and the accepted suggestions the policy withheld. Every policy
sees the same suggestions, so the rows differ only in what each withholds.

No Kafka, vLLM or HTTP, and no learning: this measures the show policy, fitted on labelled
outcomes at once; `flywheel bench learn` fits it online, on the outcomes its traffic produced.
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ops.bench.learn import BenchLearnSettings, _against_base, _difference, load_base


def policies() -> list[tuple[str, dict]]:
    """(name, overrides of `learn.show`) of the compared policies; the last is the settings' own."""
    from learner.show import LOGPROB_FEATURES

    logprobs = {"features": list(LOGPROB_FEATURES)}
    one_bound = {"max_accepts_withheld": None}
    return [
        ("logprobs, max_withheld", logprobs | one_bound),
        ("logprobs, both bounds", logprobs),
        ("context, max_withheld", one_bound),
        ("context, both bounds (learn.show)", {}),
    ]


def run_bench(s: BenchLearnSettings, console: Console, *, train_sites: int, out: str | None, command: str) -> dict:
    from feedback.core.errors import UserError
    from learner import eval as E
    from learner import show
    from learner import store as S
    from learner.judge import cursor_sites
    from learner.train.learn import model_from_packed

    base_dir, master, args, tok, fmt, packing, corpus = load_base(s)
    served = model_from_packed(S.pack_checkpoint(master.state_dict(), packing), args)
    ev, gate = s.eval, s.model.min_confidence
    train = cursor_sites(corpus.train, train_sites, random.Random(7))  # as `flywheel bench learn` draws them
    held = E.heldout_sites(corpus.heldout, ev.sites, seed=ev.seed, cursor=ev.cursor)

    def replay(name: str, sites) -> E.ReplayStats:
        t0, done = time.perf_counter(), [0]
        with console.status(f"{name}: 0/{len(sites)} sites") as status:

            def progress(_) -> None:
                done[0] += 1
                status.update(f"{name}: {done[0]}/{len(sites)} sites, {time.perf_counter() - t0:.0f} s")

            stats = E.heldout_replay(served, tok, fmt, sites, max_tokens=ev.max_tokens, progress=progress)
        console.print(f"{name}: {len(sites)} suggestions in {time.perf_counter() - t0:.0f} s")
        return stats

    train_raw, held_raw = replay("training sites", train), replay("held-out sites", held)
    shown = [
        (r, site) for r, site in zip(train_raw.results, train, strict=True) if r.text and not E.gated(r, gate).withheld
    ]
    rows = [
        [*show.features(r.logprobs, r.text, show.cursor_line(site.prefix)), float(r.verdict == "select")]
        for r, site in shown
    ]
    console.print(
        f"fitted on the {len(rows)} training suggestions the gate (model.min_confidence={gate}) shows, "
        f"{sum(r[-1] for r in rows):.0f} of them accepted"
    )
    base = E.ReplayStats.of([E.gated(r, gate) for r in held_raw.results], held_raw.seconds)
    result_rows = [{"policy": "the gate alone", **_columns(base, base)}]
    for name, over in policies():
        cfg = s.learn.show.model_copy(update={"enabled": True, **over})
        policy = cfg.fit(rows)
        if policy is None:
            raise UserError(
                f"too few outcomes to fit a show policy on ({len(rows)}; learn.show.min_samples "
                f"{cfg.min_samples}, min_each {cfg.min_each}): raise --train-sites"
            )
        stats = E.ReplayStats.of(
            [
                E.gated(
                    dataclasses.replace(
                        r,
                        policy_withholds=bool(r.text)
                        and not policy.shows(r.logprobs, r.text, show.cursor_line(site.prefix)),
                    ),
                    gate,
                )
                for r, site in zip(held_raw.results, held, strict=True)
            ],
            held_raw.seconds,
        )
        result_rows.append({"policy": name, "threshold": policy.threshold, **_columns(stats, base)})
    table = Table(
        "policy",
        "shown",
        "accept rate of shown",
        "/ gate alone, paired [95% CI]",
        "p (not above)",
        "accepted chars / request",
        "chars - gate alone [95% CI]",
        "accepted suggestions withheld",
        title=f"show policies on {len(held)} held-out sites, fitted on {len(rows)} outcomes "
        f"({len(train)} training sites, greedy)",
    )
    for r in result_rows:
        paired = E.PairedRatio(**r["accept_ratio_vs_base"])
        table.add_row(
            r["policy"],
            f"{r['suggestion_rate']:.1%}",
            f"{r['accept_rate']:.1%}",
            paired.ratio_text() if r is not result_rows[0] else "1.00x",
            paired.p_text() if r is not result_rows[0] else "",
            f"{r['accepted_chars_per_request']:.3f}",
            _difference(r["chars_vs_base"]) if r is not result_rows[0] else "",
            f"{r['accepts_withheld']} of {base.accepted}",
        )
    console.print(table)
    result = {
        "command": command,
        "base": str(base_dir),
        "heldout_sites": len(held),
        "train_sites": len(train),
        "outcomes": len(rows),
        "rows": result_rows,
    }
    if out:
        Path(out).write_text(json.dumps(result, indent=1) + "\n")
    return result


def _columns(stats, base) -> dict:
    return {
        "suggestion_rate": stats.suggestion_rate,
        "accept_rate": stats.accept_rate,
        "accepted_chars_per_request": stats.accepted_chars_per_request,
        "accepts_withheld": sum(
            b.verdict == "select" and not r.text for r, b in zip(stats.results, base.results, strict=True)
        ),
        **_against_base(stats, base),
    }
