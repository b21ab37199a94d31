"""`flywheel bench routes`: does replaying the serving engine's own routing remove the train-inference
mismatch (router replay, R3)?

One run, one process, on the pretrained base:

    vLLM (the FP4-dequantized base, as replicas serve it, routes captured: serving/routes.py)
      samples completions at held-out cursor sites, as editors get them (temperature 0.7)
    the learner's FP4 forward (its bf16 master weights, FP4 at use, as `rl_update` trains)
      recomputes each completion's logprobs three ways:
        own routing        the FP4 forward routes itself
        high-precision     the routing of a forward without FP4, replayed (pretraining's replay)
        serving routes     the experts vLLM chose, replayed (R3; the learner's default when a
                           record carries them)

Reported: the mismatch KL (k3 estimator, per completion token) of each against vLLM's own
logprobs, the ratio of serving-route replay to own routing (the target is at most 1/2), and how
often vLLM's experts differ from the FP4 forward's own. No Kafka or HTTP: the record's trace is
the same string (feedback.routing) the engine puts in the completion record.
"""

from __future__ import annotations

import asyncio
import json
import random
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from learner.train.pretrain_settings import PretrainSettings


def run_bench(
    s: PretrainSettings,
    console: Console,
    *,
    sites: int,
    temperature: float,
    max_tokens: int,
    out: str | None,
    command: str,
) -> dict:
    import torch

    from feedback.core.errors import UserError
    from learner import eval as E
    from learner import store as S
    from learner.export import export_hf
    from learner.formats import read_format
    from learner.judge import cursor_sites
    from learner.tokenizer import load_tokenizer
    from learner.train.learn import Sample, _k3, make_batch, model_from_packed, token_logprobs
    from learner.train.pretrain import (
        find_base_model,
        fp4_hook,
        load_master_weights,
        load_training_corpus,
        pretrain_section,
    )
    from serving.engine import SamplingSpec, VLLMEngine
    from serving.settings import EngineSettings

    base_dir = find_base_model(s)
    if base_dir is None:
        raise UserError("no pretrained base model for these [pretrain] settings: run `flywheel pretrain` first")
    master, args = load_master_weights(base_dir)
    if not args.moe_layers:
        raise UserError("the base model has no MoE layers: there is no routing to replay")
    tok = load_tokenizer(base_dir / "hf")
    model_format = read_format(base_dir / "hf")
    fmt = json.loads((base_dir / "run.json").read_text())["settings"].get("fp4", "nvfp4")
    hook = fp4_hook(fmt)
    corpus = load_training_corpus(pretrain_section(s))
    builder = E.prompt_builder(tok, model_format, args.max_seq_len)
    held = cursor_sites(corpus.heldout, sites, random.Random(11))
    prompts = [E.site_prompt(builder, site)[0] for site in held]

    served = model_from_packed(S.pack_checkpoint(master.state_dict(), fmt), args)
    with tempfile.TemporaryDirectory() as tmp:
        folder = export_hf(served, args, tok, Path(tmp) / "hf")
        console.print(f"vLLM on the FP4-dequantized base ({len(prompts)} held-out sites, temperature {temperature})")
        engine = VLLMEngine(folder, EngineSettings(max_model_len=args.max_seq_len, max_num_seqs=16))
        try:
            t0 = time.perf_counter()
            results = asyncio.run(
                _sample(engine, prompts, SamplingSpec(max_tokens=max_tokens, temperature=temperature, stream=False))
            )
            console.print(f"sampled {len(results)} completions in {time.perf_counter() - t0:.0f} s")
        finally:
            engine.shutdown()

    samples = [
        Sample(i, f"b{i}", 0, 0, p, r.token_ids, r.logprobs, 0.0, None, r.routing)
        for i, (p, r) in enumerate(zip(prompts, results, strict=True))
        if r.token_ids
    ]
    traced = sum(s.routing is not None for s in samples)
    master.eval()
    totals = {"own": [], "high_precision": [], "serving": []}
    flips, positions = 0, 0
    with torch.no_grad():
        for i in range(0, len(samples), 8):
            batch = make_batch(samples[i : i + 8], args, model_format)
            x = batch.input_BS
            _, own_r = master(x, fp4=hook, return_routing=True)
            _, hp_r = master(x, return_routing=True)
            totals["own"].append(_k3(token_logprobs(master(x, fp4=hook), batch), batch.behaviour_BT, batch.mask_BT))
            totals["high_precision"].append(
                _k3(token_logprobs(master(x, routing=hp_r, fp4=hook), batch), batch.behaviour_BT, batch.mask_BT)
            )
            srv = own_r if batch.routing is None else [torch.where(r < 0, o, r) for r, o in zip(batch.routing, own_r)]
            totals["serving"].append(
                _k3(token_logprobs(master(x, routing=srv, fp4=hook), batch), batch.behaviour_BT, batch.mask_BT)
            )
            if batch.routing is not None:
                for r, o in zip(batch.routing, own_r, strict=True):
                    known = (r >= 0).all(-1)
                    differ = (r.sort(-1).values != o.sort(-1).values).any(-1)
                    flips += int((differ & known).sum())
                    positions += int(known.sum())
    mean = {k: sum(v) / len(v) for k, v in totals.items()}
    result = {
        "command": command,
        "base": str(base_dir),
        "completions": len(samples),
        "traced": traced,
        "mismatch_kl": mean,
        "serving_over_own": mean["serving"] / mean["own"] if mean["own"] else None,
        "routes_differing_from_own_fp4": flips / positions if positions else None,
    }
    _print(console, result)
    if out:
        Path(out).write_text(json.dumps(result, indent=2))
    return result


async def _sample(engine, prompts, spec):
    async def one(i, p):
        final = []
        async for final in engine.generate(p, spec, f"bench-routes-{i}"):
            pass
        return final[0]

    return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


def _print(console: Console, r: dict) -> None:
    t = Table(title=f"Mismatch KL to vLLM's logprobs, {r['completions']} completions ({r['traced']} with routes)")
    for col in ("learner FP4 forward", "mismatch KL / token", "vs own routing"):
        t.add_column(col)
    m = r["mismatch_kl"]
    for key, name in (
        ("own", "own routing"),
        ("high_precision", "high-precision routing replayed"),
        ("serving", "serving routes replayed (R3)"),
    ):
        t.add_row(name, f"{m[key]:.2e}", f"{m[key] / m['own']:.2f}x" if m["own"] else "-")
    console.print(t)
    if r["routes_differing_from_own_fp4"] is not None:
        console.print(
            f"vLLM's experts differ from the FP4 forward's own at {r['routes_differing_from_own_fp4']:.2%} of (position, layer) pairs"
        )
