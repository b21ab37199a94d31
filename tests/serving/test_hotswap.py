"""Hot swap: a replica moves between weight-store versions in place.

The fast tests drive the real HotSwapper, store and codec against an engine that holds
weights the way vLLM does (it loads the update file by path) and tags every token with the
weights that produced it. The slow test does it with vLLM itself and checks the logprobs."""

import asyncio
import dataclasses
import functools
import hashlib
import json
import os
import time
from pathlib import Path

import pytest
import torch
from prometheus_client import REGISTRY
from safetensors.torch import load_file, save_file

from learner import delta as D
from learner import store as S
from learner.formats import own_format, read_format
from learner.model import ModelArgs, Transformer
from serving.engine import Sample, SamplingSpec
from serving.hotswap import GatedEngine, HotSwapper, OutOfService, SwapError, reload_set, vllm_layer
from serving.replica import CompletionService, GenerateRequest
from serving.settings import EngineSettings, ServeSettings
from tests.helpers import served_logprob_tolerance
from tests.learner.test_delta import train_steps
from tests.learner.test_export import spread_routers


def sync(fn):
    """Run an async test function on a fresh event loop (no pytest-asyncio here)."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        return asyncio.run(fn(*args, **kwargs))

    return run


class WeightsEngine:
    """A fake engine with weights: `stage_weights` checks the file and `update_weights` loads it,
    as vLLM's worker does, and every generated token id is the version of the weights that
    produced it. `abort` ends a request's stream with a final output (finish reason "abort"), as
    vLLM's AsyncLLM does. `tamper`: the next staged file has a byte changed on disk first."""

    def __init__(self, weights: dict, version: int, token_delay_s: float = 0.0):
        self.weights, self.version, self.delay = dict(weights), version, token_delay_s
        self.reloads: list[list[str]] = []
        self.fail_reloads = 0
        self.hold: asyncio.Event | None = None  # when set up, requests wait for it before each token
        self.aborted: set[str] = set()
        self.started: list[str] = []  # request ids, as the engine got them
        self.staged: list[str] = []  # paths, as the engine got them
        self.prepare: list[bool] = []  # whether each staging asked for a prepared reload
        self.tamper = False

    async def generate(self, prompt_ids, spec: SamplingSpec, request_id):
        self.started.append(request_id)
        ids = []
        for k in range(spec.max_tokens):
            await asyncio.sleep(self.delay)
            while self.hold is not None and not self.hold.is_set() and request_id not in self.aborted:
                await asyncio.sleep(0.002)
            if request_id in self.aborted:
                yield [Sample(index=0, token_ids=list(ids), logprobs=[0.0] * len(ids), text="", finish_reason="abort")]
                return
            ids.append(self.version)
            done = k == spec.max_tokens - 1
            yield [
                Sample(
                    index=0,
                    token_ids=list(ids),
                    logprobs=[0.0] * len(ids),
                    text="",
                    finish_reason="length" if done else None,
                )
            ]

    async def abort(self, request_id):
        self.aborted.add(request_id)

    async def stage_weights(self, path: str, sha256: str, *, prepare: bool = True) -> dict:
        if self.tamper:
            self.tamper = False
            data = bytearray(Path(path).read_bytes())
            data[-1] ^= 1
            Path(path).write_bytes(bytes(data))
        if hashlib.sha256(Path(path).read_bytes()).hexdigest() != sha256:
            raise ValueError(f"{path}: sha256 mismatch, refusing to load")
        self.staged.append(path)
        self.prepare.append(prepare)
        return {}

    async def update_weights(self, path: str, sha256: str, version: int) -> dict:
        with open(path, "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == sha256
        tensors = load_file(path)
        if self.fail_reloads:
            self.fail_reloads -= 1
            self.weights.update(dict(list(tensors.items())[:1]))  # broke off after one tensor
            raise RuntimeError("worker died mid-reload")
        self.weights.update(tensors)
        self.version = version
        self.reloads.append(sorted(tensors))
        return {"tensors": len(tensors)}


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """A store with v0..v3 of a tiny model (2 AdamW steps apart; v3 a full snapshot), and the checkpoints."""
    torch.manual_seed(0)
    model = Transformer(ModelArgs.from_name("tiny", vocab_size=512, max_seq_len=64))
    model.init_weights(0.02)
    ckpts = [S.pack_checkpoint(model.state_dict())]
    for v in range(1, 4):
        train_steps(model, 2, lr=1e-5, seed=v)
        ckpts.append(S.pack_checkpoint(model.state_dict()))
    root = tmp_path_factory.mktemp("store")
    store = S.open_store(root, full_every=3)
    for v, c in enumerate(ckpts):
        store.publish(c, parent=v - 1 if v else None)
    return root, ckpts


def make_service(tok, engine) -> CompletionService:
    return CompletionService(engine, tok, own_format(tok, 2048), ServeSettings(), version=0)


def on_v0(tok, published) -> tuple[WeightsEngine, CompletionService, HotSwapper]:
    """A fake engine serving v0 of `published`, its service, and a swapper that knows it is v0."""
    root, ckpts = published
    engine = WeightsEngine(S.to_hf_tensors(ckpts[0]), version=0)
    service = make_service(tok, engine)
    swapper = HotSwapper(service, S.open_store(root))
    swapper.adopt(0)
    return engine, service, swapper


def request(i: int, max_tokens: int = 4) -> GenerateRequest:
    return GenerateRequest(
        completion_id=f"c{i}",
        prefix="def f(x):\n    return ",
        suffix=None,
        path=None,
        spec=SamplingSpec(max_tokens=max_tokens),
    )


def bits_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in a)


@sync
async def test_swaps_reload_only_changed_tensors(tok, published):
    root, ckpts = published
    engine = WeightsEngine(S.to_hf_tensors(ckpts[0]), version=0)
    service = make_service(tok, engine)
    swapper = HotSwapper(service, S.open_store(root))

    r1 = await swapper.swap_to(1)  # weights not known yet: everything is reloaded
    assert r1.ok and service.version == 1 and r1.tensors_reloaded == len(ckpts[1])
    assert bits_equal(engine.weights, S.to_hf_tensors(ckpts[1]))
    assert (await service.complete(request(0))).model_version == 1

    r2 = await swapper.swap_to(2)  # now a delta away: only what changed
    changed = set(D.diff(ckpts[1], ckpts[2]).changed)
    assert r2.plan == {"have": 1, "full": None, "deltas": [2], "nbytes": r2.plan["nbytes"]}
    assert set(engine.reloads[-1]) == set(reload_set(changed, ckpts[2])) and 0 < len(changed) < len(ckpts[2])
    assert bits_equal(engine.weights, S.to_hf_tensors(ckpts[2]))
    r3 = await swapper.swap_to(3)  # v3 is a full snapshot that still carries its delta
    assert r3.plan["deltas"] == [3] and r3.plan["full"] is None
    assert bits_equal(engine.weights, S.to_hf_tensors(ckpts[3]))
    print(
        f"\nswap pauses (fake engine): {r1.pause_s * 1e3:.1f} / {r2.pause_s * 1e3:.1f} / {r3.pause_s * 1e3:.1f} ms; "
        f"{r2.tensors_reloaded} tensors, {r2.reload_bytes} B for v1 -> v2"
    )


@sync
async def test_adopt_and_a_replica_far_behind(tok, published):
    root, ckpts = published
    engine = WeightsEngine(S.to_hf_tensors(ckpts[0]), version=0)
    swapper = HotSwapper(make_service(tok, engine), S.open_store(root))
    swapper.adopt(0)
    r = await swapper.swap_to(3)
    assert r.plan["have"] == 0 and r.plan["deltas"] == [1, 2, 3]  # the deltas are far smaller than a snapshot
    changed = {n for n in ckpts[3] if D.tensor_hash(ckpts[3][n]) != D.tensor_hash(ckpts[0][n])}
    assert set(engine.reloads[-1]) == set(reload_set(changed, ckpts[3]))
    assert bits_equal(engine.weights, S.to_hf_tensors(ckpts[3]))


@sync
async def test_a_swap_brings_the_versions_show_policy_and_an_unreadable_one_fails_it(tok, published, tmp_path):
    """learner/show.py: the policy travels in the version's manifest; the replica applies the one
    of the version it serves, from adopt() and every swap; one it cannot read fails the swap
    before anything changes (the replica keeps its version, weights and policy)."""
    from tests.helpers import logprob_policy

    _, ckpts = published
    policy = logprob_policy(weights=(1.0, 0, 0, 0, 0), bias=0.5, samples=80, accepts=20)
    store = S.open_store(tmp_path, full_every=100)
    store.publish(ckpts[0], parent=None, show_policy=policy.as_dict())
    store.publish(ckpts[1], parent=0)
    store.publish(ckpts[2], parent=1, show_policy=dataclasses.replace(policy, bias=-0.5).as_dict())
    store.publish(ckpts[3], parent=2, show_policy=policy.as_dict() | {"features": ["first_logprob"]})
    engine = WeightsEngine(S.to_hf_tensors(ckpts[0]), version=0)
    service = make_service(tok, engine)
    swapper = HotSwapper(service, S.open_store(tmp_path))
    swapper.adopt(0)
    assert service.show_policy == policy
    assert (await swapper.swap_to(1)).ok and service.show_policy is None  # v1 has none: the gate alone
    assert (await swapper.swap_to(2)).ok and service.show_policy.bias == -0.5
    with pytest.raises(
        SwapError, match="swap v2 -> v3 failed: StoreError: version 3: its show policy cannot be applied"
    ):
        await swapper.swap_to(3)
    assert service.version == 2 and service.show_policy.bias == -0.5
    assert bits_equal(engine.weights, S.to_hf_tensors(ckpts[2]))


@sync
async def test_a_replica_started_from_the_stored_weights_swaps_only_changes(tok, published, tmp_path):
    from safetensors.torch import save_file

    root, ckpts = published
    save_file(S.to_hf_tensors(ckpts[0]), str(tmp_path / "model.safetensors"))  # the folder vLLM loaded: v0 exactly
    engine = WeightsEngine(S.to_hf_tensors(ckpts[0]), version=0)
    r = await HotSwapper(make_service(tok, engine), S.open_store(root), loaded_from=tmp_path).swap_to(1)
    changed = {n for n in ckpts[1] if D.tensor_hash(ckpts[1][n]) != D.tensor_hash(ckpts[0][n])}
    assert (
        r.plan["have"] == 0
        and r.plan["deltas"] == [1]
        and set(engine.reloads[-1]) == set(reload_set(changed, ckpts[1]))
    )

    other = S.to_hf_tensors(ckpts[0]) | {"lm_head.weight": S.to_hf_tensors(ckpts[1])["lm_head.weight"]}
    save_file(other, str(tmp_path / "model.safetensors"))  # not v0: everything is reloaded, as without a folder
    engine = WeightsEngine(other, version=0)
    r = await HotSwapper(make_service(tok, engine), S.open_store(root), loaded_from=tmp_path).swap_to(1)
    assert r.plan["have"] is None and r.tensors_reloaded == len(ckpts[1])
    assert bits_equal(engine.weights, S.to_hf_tensors(ckpts[1]))


def test_a_swap_reloads_whole_vllm_layers():
    names = [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkvo"] + ["model.layers.0.self_attn.q_norm.weight"]
    names += [
        f"model.layers.{i}.mlp.experts.{e}.{p}_proj.weight"
        for i in (0, 1)
        for e in range(3)
        for p in ("gate", "up", "down")
    ]
    names += ["model.layers.0.mlp.gate.weight", "lm_head.weight"]
    assert vllm_layer("model.layers.0.self_attn.k_proj.weight") == "model.layers.0.self_attn.qkv_proj"
    assert vllm_layer("model.layers.1.mlp.experts.2.up_proj.weight") == "model.layers.1.mlp.experts"
    assert (
        vllm_layer("model.layers.0.mlp.gate.weight") == "model.layers.0.mlp.gate.weight"
    )  # the router is its own layer
    got = reload_set(
        ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.experts.1.down_proj.weight", "lm_head.weight"],
        names,
    )
    assert got == sorted(
        [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"]
        + ["lm_head.weight"]
        + [f"model.layers.1.mlp.experts.{e}.{p}_proj.weight" for e in range(3) for p in ("gate", "up", "down")]
    )


def test_whole_layers_of_the_other_families():
    """Qwen2's q/k/v biases, a dense MLP's gate/up and Qwen2-MoE's shared expert load fused too."""
    attn = [f"model.layers.0.self_attn.{p}_proj.{k}" for p in "qkv" for k in ("weight", "bias")]
    mlp = [f"model.layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    shared = [f"model.layers.1.mlp.shared_expert.{p}_proj.weight" for p in ("gate", "up", "down")]
    names = attn + mlp + shared + ["model.layers.1.mlp.shared_expert_gate.weight", "model.embed_tokens.weight"]
    assert vllm_layer("model.layers.0.self_attn.v_proj.bias") == "model.layers.0.self_attn.qkv_proj"
    assert (
        vllm_layer("model.layers.1.mlp.shared_expert.up_proj.weight") == "model.layers.1.mlp.shared_expert.gate_up_proj"
    )
    assert reload_set(["model.layers.0.self_attn.k_proj.bias"], names) == sorted(attn)
    assert reload_set(["model.layers.0.mlp.up_proj.weight"], names) == sorted(mlp[:2])
    assert reload_set(["model.layers.1.mlp.shared_expert.gate_proj.weight"], names) == sorted(shared[:2])
    assert reload_set(["model.layers.1.mlp.shared_expert_gate.weight"], names) == [
        "model.layers.1.mlp.shared_expert_gate.weight"
    ]


@sync
async def test_in_flight_requests_finish_on_old_weights_new_ones_wait(tok, published):
    root, ckpts = published
    engine = WeightsEngine(S.to_hf_tensors(ckpts[0]), version=0, token_delay_s=0.03)
    service = make_service(tok, engine)
    swapper = HotSwapper(service, S.open_store(root), preempt_after_s=None)  # wait for every request
    swapper.adopt(0)

    old = [asyncio.create_task(service.complete(request(i, max_tokens=20))) for i in range(3)]
    await asyncio.sleep(0.05)  # they are generating
    swap = asyncio.create_task(swapper.swap_to(1))
    while swapper.gate.admitting:  # the swap has fetched and verified v1 and closed admission
        await asyncio.sleep(0.001)
    draining = swapper.gate.inflight
    new = [asyncio.create_task(service.complete(request(10 + i))) for i in range(3)]  # arrive during the drain
    report = await swap
    results = await asyncio.gather(*old, *new)
    for r in results:
        # every token came from one version, and the result says which
        assert set(r.samples[0].token_ids) == {r.model_version}, (r.model_version, r.samples[0].token_ids)
    assert [r.model_version for r in results] == [0, 0, 0, 1, 1, 1]
    assert report.pause_s >= report.drain_s > (0.01 if draining else 0)


def streamed_request(i: int, max_tokens: int) -> GenerateRequest:
    r = request(i, max_tokens)
    return dataclasses.replace(r, spec=dataclasses.replace(r.spec, stream=True))


async def collect(results: list, agen) -> None:
    async for r in agen:
        results.append(r)


@sync
async def test_a_swap_restarts_requests_whose_client_saw_nothing_and_lets_started_streams_finish(tok, published):
    root, ckpts = published
    engine = WeightsEngine(S.to_hf_tensors(ckpts[0]), version=0, token_delay_s=0.01)
    service = make_service(tok, engine)
    swapper = HotSwapper(service, S.open_store(root), preempt_after_s=0.02, pool="canary")
    swapper.adopt(0)
    before = REGISTRY.get_sample_value("flywheel_swap_restarts_total", {"pool": "canary"}) or 0

    streamed: list = []
    stream_req = streamed_request(0, max_tokens=30)
    stream = asyncio.create_task(collect(streamed, service.stream(stream_req)))
    while not streamed:  # the stream's client has seen tokens of v0
        await asyncio.sleep(0.001)
    # non-streamed: 400 tokens at 10 ms or more each, seconds from done when the swap starts
    long = [asyncio.create_task(service.complete(request(1 + i, max_tokens=400))) for i in range(3)]
    await asyncio.sleep(0.05)
    report = await swapper.swap_to(1)
    results = await asyncio.gather(*long)
    await stream

    assert report.restarted == 3
    for r in results:  # run again, whole, on v1: every token, and the result's version
        assert r.model_version == 1 and r.samples[0].token_ids == [1] * 400
    final = streamed[-1]  # the stream kept its version: all 30 tokens of v0
    assert final.done and final.model_version == 0 and final.samples[0].token_ids == [0] * 30
    # the pause waited for the stream (30 tokens), not for the 400-token requests: sleeps only get
    # longer under load, so waiting for them would take at least 400 x 10 ms less the ~0.1 s they ran
    assert report.drain_s < 3.5, report
    assert REGISTRY.get_sample_value("flywheel_swap_restarts_total", {"pool": "canary"}) == before + 3
    assert [i for i in engine.started if "~" in i] == ["c1~1", "c2~1", "c3~1"]  # a restart's own engine id


@sync
async def test_a_stream_that_has_sent_nothing_is_restarted_and_a_client_abort_reaches_the_restart(tok, published):
    root, ckpts = published
    engine = WeightsEngine(S.to_hf_tensors(ckpts[0]), version=0)
    engine.hold = asyncio.Event()  # no token comes out until it is set
    service = make_service(tok, engine)
    swapper = HotSwapper(service, S.open_store(root), preempt_after_s=0.0)
    swapper.adopt(0)
    streamed: list = []
    req = streamed_request(0, max_tokens=3)
    stream = asyncio.create_task(collect(streamed, service.stream(req)))
    gone = asyncio.create_task(service.complete(request(1, max_tokens=3)))
    while len(engine.started) < 2:
        await asyncio.sleep(0.001)
    report = await swapper.swap_to(1)  # would wait for ever without the restart: the tokens are held
    assert report.restarted == 2 and not streamed
    while len(engine.started) < 4:  # both run again
        await asyncio.sleep(0.001)
    await swapper.gate.abort("c1")  # the client of c1 left: the abort reaches the engine id it runs under
    assert "c1~1" in engine.aborted
    engine.hold.set()
    await stream
    assert streamed[-1].model_version == 1 and streamed[-1].samples[0].token_ids == [1, 1, 1]
    assert all(r.model_version == 1 for r in streamed)  # nothing of v0 reached the stream's client
    assert (await gone).samples[0].finish_reason == "abort"


@sync
async def test_a_request_whose_last_output_came_out_is_not_restarted(published):
    root, ckpts = published
    gate = GatedEngine(WeightsEngine(S.to_hf_tensors(ckpts[0]), version=0))
    outs = gate.generate([1], SamplingSpec(max_tokens=2, stream=False), "r")
    last = [await outs.__anext__(), await outs.__anext__()][-1]
    assert last[0].finish_reason == "length"  # done, its generator not yet closed

    async def rest() -> list:
        await asyncio.sleep(0.01)
        return [o async for o in outs]

    rest_task = asyncio.create_task(rest())
    async with gate.paused(5.0, preempt_after_s=0.0) as waited:
        pass
    assert waited["restarted"] == 0 and await rest_task == []  # not run again


@sync
async def test_a_corrupt_delta_leaves_the_replica_on_its_version(tok, published, tmp_path):
    root, ckpts = published
    store = S.open_store(tmp_path, full_every=10)
    for v in range(3):
        store.publish(ckpts[v], parent=v - 1 if v else None)
    (f,) = (tmp_path / "v000002").glob("*/delta.zst")
    f.write_bytes(f.read_bytes()[:-7] + b"garbage")
    engine = WeightsEngine(S.to_hf_tensors(ckpts[0]), version=0)
    service = make_service(tok, engine)
    swapper = HotSwapper(service, S.open_store(tmp_path), pool="canary")
    await swapper.swap_to(1)
    failed = {"pool": "canary", "outcome": "failed"}
    reloads, before = len(engine.reloads), REGISTRY.get_sample_value("flywheel_swaps_total", failed) or 0
    with pytest.raises(SwapError, match="corrupt"):
        await swapper.swap_to(2)
    assert (
        service.version == 1
        and len(engine.reloads) == reloads
        and bits_equal(engine.weights, S.to_hf_tensors(ckpts[1]))
    )
    assert "v1 -> v2" in swapper.last_swap_error and swapper.status()["failures"] == 1
    assert f"{f.parent.name}/delta.zst" in swapper.last_swap_error and swapper.status()["corrupt_objects"] == 1
    assert REGISTRY.get_sample_value("flywheel_store_corrupt_objects_total", {"pool": "canary"}) >= 1
    assert REGISTRY.get_sample_value("flywheel_swaps_total", failed) == before + 1
    assert REGISTRY.get_sample_value("flywheel_swaps_total", {"pool": "canary", "outcome": "ok"}) >= 1
    assert (await service.complete(request(1))).model_version == 1  # and it keeps serving
    # a version that is not in the store, and a drain that does not finish, fail the same way
    report = await swapper.swap_report(9)
    assert not report["ok"] and report["version"] == 1 and "not in the store" in report["error"]
    engine.hold = asyncio.Event()
    swapper.drain_timeout_s, swapper.preempt_after_s = 0.05, None
    stuck = asyncio.create_task(service.complete(request(2, max_tokens=3)))
    await asyncio.sleep(0.01)
    with pytest.raises(SwapError, match="did not finish"):
        await swapper.swap_to(0)
    engine.hold.set()
    assert (await stuck).model_version == 1 and (
        await service.complete(request(3))
    ).model_version == 1  # admission reopened


@sync
async def test_a_file_that_fails_its_check_when_staged_stops_the_swap_before_the_pause(tok, published):
    engine, service, swapper = on_v0(tok, published)
    engine.tamper = True
    with pytest.raises(SwapError, match="sha256 mismatch"):
        await swapper.swap_to(1)
    report = swapper.last_report
    assert (report.pause_s, report.drain_s, engine.reloads, engine.staged) == (0.0, 0.0, [], [])
    assert swapper.gate.admitting and (await service.complete(request(0))).model_version == 0
    report = await swapper.swap_to(1)  # the next swap writes the file again, and it goes through
    assert report.ok and len(engine.staged) == len(engine.reloads) == 1 and service.version == 1


@sync
async def test_a_reload_that_breaks_off_restores_the_old_tensors(tok, published):
    _, ckpts = published
    engine, service, swapper = on_v0(tok, published)
    engine.fail_reloads = 1
    with pytest.raises(SwapError, match="mid-reload"):
        await swapper.swap_to(1)
    assert service.version == 0 and bits_equal(engine.weights, S.to_hf_tensors(ckpts[0]))
    assert (await swapper.swap_to(1)).ok and bits_equal(engine.weights, S.to_hf_tensors(ckpts[1]))


@sync
async def test_warming_reloads_the_first_layer_the_engine_holds_once_and_only_before_any_swap(tok, published, tmp_path):
    root, ckpts = published
    v0 = S.to_hf_tensors(ckpts[0])
    save_file(v0, str(tmp_path / "model.safetensors"))
    engine = WeightsEngine(v0, version=0)
    service = make_service(tok, engine)
    swapper = HotSwapper(service, S.open_store(root), loaded_from=tmp_path)
    assert await swapper.warm() is not None
    (warmed,) = engine.reloads
    assert warmed and all(n.startswith("model.layers.0.") for n in warmed) and engine.staged
    assert service.version == 0 and bits_equal(engine.weights, v0) and swapper.gate.admitting
    assert await swapper.warm() is None and len(engine.reloads) == 1  # once
    # after a swap the engine no longer holds the folder's weights: no warming then
    swapped = WeightsEngine(v0, version=0)
    late = HotSwapper(make_service(tok, swapped), S.open_store(root), loaded_from=tmp_path)
    assert (await late.swap_to(1)).ok and await late.warm() is None
    assert bits_equal(swapped.weights, S.to_hf_tensors(ckpts[1]))
    # a folder without the weights file: a warning, and the replica serves on
    empty = tmp_path / "empty"
    empty.mkdir()
    cold = HotSwapper(make_service(tok, WeightsEngine(v0, version=0)), S.open_store(root), loaded_from=empty)
    assert await cold.warm() is None and cold.out_of_service is None


@sync
async def test_a_first_full_reload_that_breaks_off_is_undone_from_the_model_folder(tok, published, tmp_path):
    """Before its first swap a replica keeps no checkpoint, so it reloads every tensor; when that
    breaks off, it reloads the folder its engine started from and serves on, unmixed."""
    from safetensors.torch import save_file

    root, ckpts = published
    started = S.to_hf_tensors(ckpts[0]) | {"lm_head.weight": S.to_hf_tensors(ckpts[2])["lm_head.weight"]}
    save_file(started, str(tmp_path / "model.safetensors"))  # not v0 exactly: the first swap reloads all
    engine = WeightsEngine(started, version=0)
    service = make_service(tok, engine)
    swapper = HotSwapper(service, S.open_store(root), loaded_from=tmp_path)
    engine.fail_reloads = 1
    with pytest.raises(SwapError, match="mid-reload"):
        await swapper.swap_to(1)
    assert service.version == 0 and bits_equal(engine.weights, started) and swapper.out_of_service is None
    assert (await service.complete(request(0))).model_version == 0
    assert (await swapper.swap_to(1)).ok and bits_equal(engine.weights, S.to_hf_tensors(ckpts[1]))


@sync
async def test_mixed_weights_that_cannot_be_undone_take_the_replica_out_of_service(tok, published):
    """No copy of the old weights (a first swap, no model folder), or putting them back fails too:
    the replica refuses every request instead of answering as v0 on mixed weights, until a swap
    that reloads every tensor succeeds."""
    root, ckpts = published
    engine = WeightsEngine(S.to_hf_tensors(ckpts[0]), version=0)
    service = make_service(tok, engine)
    swapper = HotSwapper(service, S.open_store(root))
    engine.fail_reloads = 1
    with pytest.raises(SwapError, match="mid-reload"):
        await swapper.swap_to(1)
    assert not bits_equal(engine.weights, S.to_hf_tensors(ckpts[0]))  # one tensor of v1 went in
    assert "weights are mixed" in swapper.out_of_service and swapper.status()["out_of_service"]
    with pytest.raises(OutOfService, match="broke off"):
        await service.complete(request(0))
    r = await swapper.swap_to(2)  # every tensor, since nothing is known: whole again
    assert r.ok and r.tensors_reloaded == len(ckpts[2]) and swapper.out_of_service is None
    # ... the vLLM way: a broken-off reload can leave live tensors without storage, so no
    # preparation is built beside them (measured: one copied into such a tensor killed the engine)
    assert engine.prepare == [True, False]
    assert bits_equal(engine.weights, S.to_hf_tensors(ckpts[2]))
    assert (await service.complete(request(1))).model_version == 2

    engine.fail_reloads = 2  # the swap breaks off, and so does putting v2's tensors back
    with pytest.raises(SwapError):
        await swapper.swap_to(3)
    assert swapper.out_of_service and service.version == 2
    with pytest.raises(OutOfService):
        await service.complete(request(2))

    from serving.app import ModelReplica

    replica = object.__new__(ModelReplica.func_or_class)  # the Ray Serve deployment's class, without vLLM
    replica.service, replica.swapper = service, swapper
    with pytest.raises(RuntimeError, match="out of service"):
        replica.check_health()  # Ray Serve replaces it
    with pytest.raises(RuntimeError, match="out of service"):
        replica.version()  # the ingress routes no canary or pinned users to it


# --- with vLLM -------------------------------------------------------------------------------------


def teacher_forced(model: Transformer, prompt_ids: list[int], gen: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + gen]))[0, len(prompt_ids) - 1 : -1]
    return torch.log_softmax(logits.float(), -1)[torch.arange(len(gen)), gen]


def model_from(hf: dict, args: ModelArgs) -> Transformer:
    with torch.device("meta"):
        m = Transformer(args)
    m.load_state_dict({k: v.float() for k, v in hf.items()}, assign=True)
    return m.eval()


@pytest.mark.slow
@pytest.mark.numerics
@sync
async def test_vllm_hot_swap_serves_the_new_weights(tok, tmp_path):
    await _hot_swap_serves_the_new_weights(tok, tmp_path)


@pytest.mark.extended
@pytest.mark.slow
@sync
async def test_vllm_hot_swap_under_tensor_parallelism(tok, tmp_path):
    """Two workers each hold half of every matrix; each reloads its half from the one file."""
    await _hot_swap_serves_the_new_weights(tok, tmp_path, executor="mp", tensor_parallel_size=2)


async def _hot_swap_serves_the_new_weights(tok, tmp_path, **parallel):
    from learner.export import export_hf, fp4_dequantized
    from serving.engine import VLLMEngine

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    args = ModelArgs.from_name("tiny", vocab_size=tok.get_vocab_size(), max_seq_len=256)
    torch.manual_seed(1)
    model = Transformer(args)
    model.init_weights(0.1)  # as in test_export: wide logits, clear greedy margins
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.5)
    spread_routers(model, 0.5)  # clear routing margins, as in test_export
    v0 = S.pack_checkpoint(model.state_dict())
    train_steps(model, 10, lr=3e-3, seed=5)  # big steps, so v1's logprobs differ clearly
    v1 = S.pack_checkpoint(model.state_dict())
    with torch.no_grad():  # v2 changes two tensors only: a partial reload (whole vLLM layers)
        model.model.layers[0].self_attn.q_proj.weight.mul_(1.5)
        model.model.layers[1].mlp.experts[0].up_proj.weight.mul_(-1.0)
    v2 = S.pack_checkpoint(model.state_dict())
    train_steps(model, 1, lr=3e-3, seed=6)
    v3 = S.pack_checkpoint(model.state_dict())
    store = S.open_store(tmp_path / "store")
    for v, c in enumerate((v0, v1, v2, v3)):
        store.publish(c, parent=v - 1 if v else None)
    (f,) = (tmp_path / "store" / "v000003").glob("*/delta.zst")
    f.write_bytes(f.read_bytes()[:-1] + b"\x00")  # v3 arrives corrupt
    folder = export_hf(
        model_from(S.to_hf_tensors(v0), args), args, tok, tmp_path / "hf", weight_fn=fp4_dequantized("nvfp4")
    )

    cfg = ServeSettings(
        engine=EngineSettings(max_model_len=256, max_num_seqs=8, **parallel),
        context_budget=200,
        summary_chunk_tokens=64,
    )
    t0 = time.perf_counter()
    engine = VLLMEngine(folder, cfg.engine)
    print(f"\nvLLM engine started in {time.perf_counter() - t0:.1f} s")
    try:
        service = CompletionService(engine, tok, read_format(folder), cfg, version=0)
        swapper = HotSwapper(service, store, loaded_from=folder)
        swapper.adopt(0)
        greedy = SamplingSpec(max_tokens=12, temperature=0.0)
        prompts = ["def parse(s):\n    ", "import json\n\nclass Encoder:\n", "return {'key': value, "]

        async def served() -> list:
            return [
                await service.complete(GenerateRequest(f"p{i}-{time.time_ns()}", p, None, None, greedy))
                for i, p in enumerate(prompts)
            ]

        dtype = engine.precision.dtype

        def max_diff(results, hf: dict) -> tuple[float, float]:
            """The worst |served - learner| logprob against `hf`'s weights, and the tolerance for it."""
            m = model_from(hf, args)
            seqs = [(r.prompt_token_ids, r.samples[0].token_ids) for r in results]
            worst = max(
                (teacher_forced(m, p, g) - torch.tensor(r.samples[0].logprobs)).abs().max().item()
                for (p, g), r in zip(seqs, results)
            )
            return worst, served_logprob_tolerance(m, seqs, dtype)

        before = await served()
        assert {r.model_version for r in before} == {0}
        d, tol = max_diff(before, S.to_hf_tensors(v0))
        print(f"served in {engine.precision}: |logprob - learner v0| max {d:.4f} (tolerance {tol:.4f})")
        assert d < tol

        took = await swapper.warm()  # reloads the first layer's own values: nothing served changes
        again = await served()
        assert took is not None and service.version == 0
        assert [(r.samples[0].token_ids, r.samples[0].logprobs) for r in again] == [
            (r.samples[0].token_ids, r.samples[0].logprobs) for r in before
        ]

        # staging prepares v1 in a shadow of the model while serving goes on: the live weights do
        # not change until the pause copies them in
        digest = await engine.weights_digest()
        staged = tmp_path / "staged.safetensors"
        save_file(S.to_hf_tensors(v1), str(staged))
        state = await engine.stage_weights(str(staged), hashlib.sha256(staged.read_bytes()).hexdigest())
        assert state["prepared"] and state["error"] is None, state
        assert await engine.weights_digest() == digest
        assert [r.samples[0].logprobs for r in await served()] == [r.samples[0].logprobs for r in before]

        report = await swapper.swap_to(1)
        assert report.prepared  # the pause only copied prepared tensors in
        after = await served()
        (d_new, tol), (d_old, _) = max_diff(after, S.to_hf_tensors(v1)), max_diff(after, S.to_hf_tensors(v0))
        print(
            f"swap v0 -> v1: {report.tensors_reloaded} tensors, {report.reload_bytes} B, pause {report.pause_s * 1e3:.1f} ms "
            f"(reload {report.reload_s * 1e3:.1f} ms); |logprob - learner v1| max {d_new:.4f} (tolerance {tol:.4f}), vs v0 weights {d_old:.3f}"
        )
        assert {r.model_version for r in after} == {1}
        assert d_new < tol and d_old > 5 * tol  # the new weights answered, not the old ones with a new tag

        report = await swapper.swap_to(2)
        after = await served()
        (d_new, tol), (d_old, _) = max_diff(after, S.to_hf_tensors(v2)), max_diff(after, S.to_hf_tensors(v1))
        print(
            f"swap v1 -> v2: {report.tensors_reloaded} tensors, {report.reload_bytes} B, pause {report.pause_s * 1e3:.1f} ms "
            f"(reload {report.reload_s * 1e3:.1f} ms); |logprob - learner v2| max {d_new:.4f} (tolerance {tol:.4f}), vs v1 weights {d_old:.3f}"
        )
        assert report.tensors_reloaded == 3 + 3 * args.n_experts  # q, k, v and layer 1's experts
        assert {r.model_version for r in after} == {2} and d_new < tol and d_old > tol
        assert report.prepared

        # vLLM's own reload of the same versions ends in the same kernel tensors, bit for bit
        prepared_digest = await engine.weights_digest()
        engine.prepared_reload = False
        digests = {}
        for v in (1, 2):
            assert not (await swapper.swap_to(v)).prepared
            digests[v] = await engine.weights_digest()
        assert digests[2] == prepared_digest
        assert [(r.samples[0].token_ids, r.samples[0].logprobs) for r in await served()] == [
            (r.samples[0].token_ids, r.samples[0].logprobs) for r in after
        ]
        engine.prepared_reload = True  # and prepared again after vLLM's reload ran (it leaves wrappers behind)
        assert (await swapper.swap_to(1)).prepared
        assert await engine.weights_digest() == digests[1]
        assert await swapper.swap_to(2)

        if not parallel:  # the worker refuses a file that is not the one the replica wrote (staged or not)
            # (with two workers, vLLM 0.32's engine answered no request after such a refusal: not
            # a case a replica meets, as it writes the file itself and the sha256 check comes first)
            other = tmp_path / "other.safetensors"
            save_file(S.to_hf_tensors(v1, ["model.norm.weight"]), str(other))
            for call in (engine.stage_weights(str(other), "0" * 64), engine.update_weights(str(other), "0" * 64, 1)):
                with pytest.raises(Exception, match="sha256 mismatch"):
                    await call

        with pytest.raises(SwapError):
            await swapper.swap_to(3)
        still = await served()
        assert {r.model_version for r in still} == {2} and service.version == 2
        d, tol = max_diff(still, S.to_hf_tensors(v2))
        assert d < tol
        assert swapper.last_swap_error and "v2 -> v3" in swapper.last_swap_error
    finally:
        engine.shutdown()


@pytest.mark.slow
@pytest.mark.numerics
@sync
async def test_vllm_a_reload_that_breaks_off_never_serves_mixed_weights_as_the_old_version(tok, tmp_path):
    """vLLM reloads tensors in the order it is sent them: an update whose last tensor has the wrong
    shape breaks off after the others went in. The replica then either answers exactly as before
    (the old tensors went back in) or answers nothing (out of service, health check failing), never
    v1's tensors under v0's name. Measured with vLLM 0.32 on a CPU: a reload that broke off leaves
    the model unable to reload at all ('Parameter' object has no attribute 'weight_loader'), so
    putting v0 back fails and only a new replica (Ray Serve's restart) serves again."""
    from learner.export import export_hf, fp4_dequantized
    from serving.app import ModelReplica
    from serving.engine import VLLMEngine

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    args = ModelArgs.from_name("tiny", vocab_size=tok.get_vocab_size(), max_seq_len=256)
    torch.manual_seed(1)
    model = Transformer(args)
    model.init_weights(0.1)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.5)
    spread_routers(model, 0.5)  # clear routing margins, as in test_export
    v0 = S.pack_checkpoint(model.state_dict())
    train_steps(model, 3, lr=3e-3, seed=5)
    v1 = S.pack_checkpoint(model.state_dict())
    store = S.open_store(tmp_path / "store")
    store.publish(v0, parent=None)
    store.publish(v1, parent=0)
    folder = export_hf(
        model_from(S.to_hf_tensors(v0), args), args, tok, tmp_path / "hf", weight_fn=fp4_dequantized("nvfp4")
    )
    cfg = ServeSettings(
        engine=EngineSettings(max_model_len=256, max_num_seqs=8), context_budget=200, summary_chunk_tokens=64
    )
    engine = VLLMEngine(folder, cfg.engine)
    try:
        service = CompletionService(engine, tok, read_format(folder), cfg, version=0)
        swapper = HotSwapper(service, store, loaded_from=folder)
        swapper._recognize = lambda: None  # as if the folder were no stored version: the first swap reloads all
        replica = object.__new__(ModelReplica.func_or_class)
        replica.service, replica.swapper = service, swapper
        greedy = SamplingSpec(max_tokens=12, temperature=0.0)
        prompts = ["def parse(s):\n    ", "import json\n\nclass Encoder:\n"]

        async def served() -> list:
            return [
                await service.complete(GenerateRequest(f"p{i}-{time.time_ns()}", p, None, None, greedy))
                for i, p in enumerate(prompts)
            ]

        def max_diff(results, hf: dict) -> tuple[float, float]:
            m = model_from(hf, args)
            seqs = [(r.prompt_token_ids, r.samples[0].token_ids) for r in results]
            worst = max(
                (teacher_forced(m, p, g) - torch.tensor(r.samples[0].logprobs)).abs().max().item()
                for (p, g), r in zip(seqs, results)
            )
            return worst, served_logprob_tolerance(m, seqs, engine.precision.dtype)

        real_write = HotSwapper._write

        def poisoned(tensors, save):
            del swapper._write  # once: putting the old tensors back writes a good file
            last = sorted(tensors)[-1]
            bad = {n: tensors[n] for n in sorted(tensors)} | {last: torch.zeros(3, 5, dtype=torch.bfloat16)}
            return real_write(bad, save)

        before = await served()
        swapper._write = poisoned
        with pytest.raises(SwapError):
            await swapper.swap_to(1)
        if swapper.out_of_service is None:  # the old tensors went back in: it answers exactly as before
            after = await served()
            d, tol = max_diff(after, S.to_hf_tensors(v0))
            print(f"\nbroken-off reload undone from {folder.name}: |logprob - learner v0| max {d:.4f} (tol {tol:.4f})")
            assert [r.samples[0].token_ids for r in after] == [r.samples[0].token_ids for r in before] and d < tol
            replica.check_health()
        else:
            print(f"\nout of service: {swapper.out_of_service}")
            with pytest.raises(OutOfService):
                await served()
            with pytest.raises(RuntimeError, match="out of service"):
                replica.check_health()

        try:  # a swap that reloads every tensor: whole again, or still out of service
            report = await swapper.swap_to(1)
        except SwapError as e:
            print(f"a full reload afterwards fails too: {e}")
            assert swapper.out_of_service
            with pytest.raises(OutOfService):
                await served()
        else:
            whole = await served()
            d, tol = max_diff(whole, S.to_hf_tensors(v1))
            assert report.ok and swapper.out_of_service is None and {r.model_version for r in whole} == {1} and d < tol
    finally:
        engine.shutdown()


@pytest.mark.slow  # not `numerics`: the tolerances are test_vllm_hot_swap_serves_the_new_weights's, checked there on both ISAs
@sync
async def test_vllm_replica_swaps_to_a_delta_fetched_from_s3(tok, tmp_path, s3_server, s3_uri):
    """The learner publishes to a real S3 server; a replica that has only the store's URI and folders
    of its own exports v0 from S3, starts vLLM on it, fetches v1's delta into its own cache and swaps
    in place. A corrupt v2 on S3 is refused, named and counted; the replica keeps serving v1."""
    import shutil

    from learner.export import export_hf
    from serving.engine import VLLMEngine

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    args = ModelArgs.from_name("tiny", vocab_size=tok.get_vocab_size(), max_seq_len=256)
    torch.manual_seed(1)
    model = Transformer(args)
    model.init_weights(0.1)  # as in test_export: wide logits, clear greedy margins
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.5)
    spread_routers(model, 0.5)
    v0 = S.pack_checkpoint(model.state_dict())
    train_steps(model, 10, lr=3e-3, seed=5)  # big steps, so v1's logprobs differ clearly
    v1 = S.pack_checkpoint(model.state_dict())
    train_steps(model, 1, lr=3e-3, seed=6)
    v2 = S.pack_checkpoint(model.state_dict())

    # the learner's machine: the model files and three versions on S3, then its folders are gone
    learner = S.open_store(s3_uri, storage_options=s3_server.storage_options())
    hf = export_hf(model_from(S.to_hf_tensors(v0), args), args, tok, tmp_path / "learner" / "hf")
    files = {p.name: p.read_bytes() for p in hf.iterdir() if p.name != "model.safetensors"}
    learner.write_model_files(files | {S.BASE_FILE: json.dumps({"kind": "test", "source": "s3"}).encode()})
    for v, c in enumerate((v0, v1, v2)):
        learner.publish(c, parent=v - 1 if v else None)
    attempt = learner.fs.cat_file(f"{learner.root}/v000002/STABLE").decode().split()[1].split("/")[0]
    corrupt = f"{learner.root}/v000002/{attempt}/delta.zst"
    learner.fs.pipe_file(corrupt, learner.fs.cat_file(corrupt)[:-1] + b"\x00")  # v2 arrives corrupt
    shutil.rmtree(tmp_path / "learner")

    # the replica's machine: its own cache and export folder
    store = S.open_store(s3_uri, storage_options=s3_server.storage_options(), cache_dir=tmp_path / "replica" / "cache")
    folder = S.export_version(store, 0, tmp_path / "replica" / "served" / "v000000")
    cfg = ServeSettings(
        engine=EngineSettings(max_model_len=256, max_num_seqs=8), context_budget=200, summary_chunk_tokens=64
    )
    engine = VLLMEngine(folder, cfg.engine)
    try:
        service = CompletionService(engine, tok, read_format(folder), cfg, version=0)
        swapper = HotSwapper(service, store, loaded_from=folder, pool="stable")
        greedy = SamplingSpec(max_tokens=12, temperature=0.0)
        prompts = ["def parse(s):\n    ", "import json\n\nclass Encoder:\n"]

        async def served() -> list:
            return [
                await service.complete(GenerateRequest(f"p{i}-{time.time_ns()}", p, None, None, greedy))
                for i, p in enumerate(prompts)
            ]

        def max_diff(results, hf_tensors: dict) -> tuple[float, float]:
            m = model_from(hf_tensors, args)
            seqs = [(r.prompt_token_ids, r.samples[0].token_ids) for r in results]
            worst = max(
                (teacher_forced(m, p, g) - torch.tensor(r.samples[0].logprobs)).abs().max().item()
                for (p, g), r in zip(seqs, results)
            )
            return worst, served_logprob_tolerance(m, seqs, engine.precision.dtype)

        assert {r.model_version for r in await served()} == {0}
        report = await swapper.swap_to(1)
        v1_delta = store.manifest(1)["files"]["delta"]
        assert report.plan == {
            "have": 0,
            "full": None,
            "deltas": [1],
            "nbytes": v1_delta["size"],
        }  # a delta, not a snapshot
        assert (tmp_path / "replica" / "cache" / v1_delta["sha256"]).is_file()
        after = await served()
        (d_new, tol), (d_old, _) = max_diff(after, S.to_hf_tensors(v1)), max_diff(after, S.to_hf_tensors(v0))
        print(
            f"\nswap v0 -> v1 from S3: {v1_delta['size']} B delta, {report.tensors_reloaded} tensors, pause "
            f"{report.pause_s * 1e3:.1f} ms; |logprob - learner v1| max {d_new:.4f} (tolerance {tol:.4f}), vs v0 {d_old:.3f}"
        )
        assert {r.model_version for r in after} == {1} and d_new < tol and d_old > 5 * tol

        with pytest.raises(SwapError, match=f"{s3_uri}/v000002/{attempt}/delta.zst does not match"):
            await swapper.swap_to(2)
        still = await served()
        assert {r.model_version for r in still} == {1} and swapper.status()["corrupt_objects"] == 1
        assert max_diff(still, S.to_hf_tensors(v1))[0] < tol
        assert REGISTRY.get_sample_value("flywheel_store_corrupt_objects_total", {"pool": "stable"}) >= 1
    finally:
        engine.shutdown()
