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
logprobs, the ratio of serving-route replay to own routing (the target is at most 1/2) with its
bootstrap interval over the completions (learner.train.mismatch, which also measures each
version on what it served), and how often vLLM's experts differ from the FP4 forward's own. No
Kafka or HTTP: the record's trace is the same string (feedback.routing) the engine puts in the
completion record.
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
    from learner.train.learn import Sample, k3_BT, make_batch, model_from_packed, token_logprobs
    from learner.train.mismatch import by_length, served_mismatch
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
    # own routing and serving's routes replayed: learner.train.mismatch, as `flywheel eval
    # --served-mismatch` measures a version, but on the master weights FP4 at use, as rl_update trains
    samples, n = by_length(samples), len(samples)  # the high-precision pass batches them as served_mismatch does
    with console.status("the learner's forwards") as status:
        m = served_mismatch(
            master,
            args,
            model_format,
            samples,
            version=0,
            batch_size=8,
            fp4=hook,
            progress=lambda k: status.update(f"own routing and serving's routes replayed: {k}/{n} completions"),
        )
        if m is None:
            raise UserError("vLLM sampled no completion token at these sites: nothing to measure")
        high_precision = 0.0  # pretraining's replay: the routing of a forward without FP4
        with torch.no_grad():
            for i in range(0, n, 8):
                batch = make_batch(samples[i : i + 8], args, model_format)
                _, hp_r = master(batch.input_BS, return_routing=True)
                logp = token_logprobs(master(batch.input_BS, routing=hp_r, fp4=hook), batch)
                high_precision += float(k3_BT(logp, batch.behaviour_BT, batch.mask_BT).sum())
                status.update(f"high-precision routing replayed: {min(i + 8, n)}/{n} completions")
    mean = {"own": m.own, "high_precision": high_precision / m.tokens, "serving": m.replay}
    result = {
        "command": command,
        "base": str(base_dir),
        "completions": len(samples),
        "tokens": m.tokens,
        "traced": traced,
        "mismatch_kl": mean,
        "serving_over_own": m.ratio,
        "serving_over_own_interval": m.ratio_interval,
        "routes_differing_from_own_fp4": m.rerouted if traced else None,
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
        ratio = r["serving_over_own"] if key == "serving" else (m[key] / m["own"] if m["own"] else None)
        t.add_row(name, f"{m[key]:.2e}", "-" if ratio is None else f"{ratio:.2f}x")
    console.print(t)
    if r["traced"] and r["serving_over_own"] is None:
        console.print("no route vLLM took differs from the forward's own: replaying them changes nothing")
    if r["serving_over_own_interval"] is not None:
        lo, hi = r["serving_over_own_interval"]
        console.print(
            f"serving routes replayed / own routing: {r['serving_over_own']:.2f}x, 95% interval [{lo:.2f}, {hi:.2f}] "
            f"(bootstrap over the completions; the mismatch is token-weighted over {r['tokens']} tokens)"
        )
    if r["routes_differing_from_own_fp4"] is not None:
        console.print(
            f"vLLM's experts differ from the FP4 forward's own at {r['routes_differing_from_own_fp4']:.2%} of (position, layer) pairs"
        )
