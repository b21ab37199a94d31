"""Routes from serving (serving/routes.py): the book's bookkeeping, and the round trip from vLLM's
worker through the record to the learner's replay."""

from __future__ import annotations

import asyncio
import os
import time

import numpy as np
import pytest
import torch

from feedback.routing import decode_routing
from serving.routes import UNKNOWN, RouteBook, StepRow, internal_ids


def _step(book: RouteBook, rows: list[StepRow], ids_LTK: np.ndarray) -> None:
    for i, layer in enumerate(ids_LTK):
        book.add_layer(i, layer)
    book.end_step(rows)


def _ids(L: int, T: int, K: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 8, size=(L, T, K)).astype(np.int16)


def test_steps_are_cut_per_request_and_appended_at_their_positions():
    book = RouteBook(layers=2, top_k=2, block_size=4)
    a_tokens, b_tokens = np.arange(10, 16), np.arange(20, 23)
    prefill = _ids(2, 9, 2, 0)  # a's 6 prompt tokens, then b's 3, in the batch's order
    _step(book, [StepRow("a", 0, 6, a_tokens), StepRow("b", 0, 3, b_tokens)], prefill)
    decode = _ids(2, 2, 2, 1)  # one token each, b first this time
    _step(book, [StepRow("b", 3, 1, np.arange(20, 24)), StepRow("a", 6, 1, np.arange(10, 17))], decode)
    a, b = book.take("a"), book.take("b")
    assert a.shape == (2, 7, 2) and b.shape == (2, 4, 2)
    assert np.array_equal(a[:, :6], prefill[:, :6]) and np.array_equal(a[:, 6], decode[:, 1])
    assert np.array_equal(b[:, :3], prefill[:, 6:]) and np.array_equal(b[:, 3], decode[:, 0])
    assert book.take("a") is None  # taken once


def test_a_cached_prefix_is_filled_from_the_blocks_another_request_ran():
    book = RouteBook(layers=1, top_k=2, block_size=4)
    prompt = np.arange(100, 110)  # 10 tokens: two full blocks and a part
    first = _ids(1, 10, 2, 2)
    _step(book, [StepRow("first", 0, 10, prompt)], first)
    # vLLM served the same prompt's first 8 tokens from its cache and runs the rest
    rest = _ids(1, 2, 2, 3)
    _step(book, [StepRow("second", 8, 2, prompt)], rest)
    got = book.take("second")
    assert np.array_equal(got[:, :8], first[:, :8]) and np.array_equal(got[:, 8:], rest)


def test_a_whole_cached_prompt_fills_the_block_its_last_token_sits_in():
    book = RouteBook(layers=1, top_k=1, block_size=4)
    prompt = np.arange(8)
    first = _ids(1, 8, 1, 4)
    _step(book, [StepRow("first", 0, 8, prompt)], first)
    _step(book, [StepRow("again", 7, 1, prompt)], _ids(1, 1, 1, 5))  # vLLM reruns the last token
    assert np.array_equal(book.take("again")[:, :7], first[:, :7])


def test_a_prefix_nobody_ran_here_stays_unknown_and_a_swap_forgets_the_blocks():
    book = RouteBook(layers=1, top_k=1, block_size=4)
    prompt = np.arange(8)
    _step(book, [StepRow("late", 4, 4, prompt)], _ids(1, 4, 1, 6))  # cached before capture began
    assert (book.take("late")[:, :4] == UNKNOWN).all()
    _step(book, [StepRow("full", 0, 8, prompt)], _ids(1, 8, 1, 7))
    book.clear()
    _step(book, [StepRow("after-swap", 4, 4, prompt)], _ids(1, 4, 1, 8))
    assert (book.take("after-swap")[:, :4] == UNKNOWN).all()


def test_a_step_a_layer_did_not_report_records_nothing():
    book = RouteBook(layers=2, top_k=1, block_size=4)
    book.add_layer(0, np.zeros((3, 1), np.int16))
    book.end_step([StepRow("a", 0, 3, np.arange(3))])
    assert book.take("a") is None


def test_the_book_is_bounded_dropping_the_oldest_untaken_requests():
    book = RouteBook(layers=1, top_k=1, block_size=4, max_requests=2, max_blocks=1)
    for i, rid in enumerate(("a", "b", "c")):
        _step(book, [StepRow(rid, 0, 8, np.arange(i * 8, i * 8 + 8))], _ids(1, 8, 1, i))
    assert list(book.requests) == ["b", "c"] and len(book.blocks) == 1


def test_vllms_internal_ids_are_matched_first_sample_first():
    seen = ["x-req-1-1a2b3c4d", "1_req-1-aaaaaaaa", "0_req-1-bbbbbbbb", "req-10-cccccccc", "sum-req-1-dddddddd"]
    assert internal_ids("req-1", seen) == ["0_req-1-bbbbbbbb", "1_req-1-aaaaaaaa"]
    assert internal_ids("req-10", seen) == ["req-10-cccccccc"]


# --- with vLLM ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_routes_round_trip_from_the_vllm_worker_to_the_learners_replay(tok, tmp_path):
    """vLLM's worker records the experts of every token it ran; the record carries them; the
    learner's batch replays them, and they are the experts the learner's own forward picks on the
    same (FP4-dequantized) weights wherever routing margins are clear."""
    from learner import store as S
    from learner.export import export_hf, fp4_dequantized
    from learner.formats import own_format
    from learner.model import ModelArgs, Transformer
    from learner.train.learn import Sample, make_batch
    from serving.engine import SamplingSpec, VLLMEngine
    from serving.settings import EngineSettings
    from tests.learner.test_export import spread_routers
    from tests.serving.test_hotswap import model_from

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    args = ModelArgs.from_name("tiny", vocab_size=tok.get_vocab_size(), max_seq_len=512)
    torch.manual_seed(3)
    model = Transformer(args)
    model.init_weights(0.1)
    spread_routers(model, 0.5)  # clear routing margins: bf16 and fp32 pick the same experts
    hf = S.to_hf_tensors(S.pack_checkpoint(model.state_dict()))
    folder = export_hf(model_from(hf, args), args, tok, tmp_path / "hf", weight_fn=fp4_dequantized("nvfp4"))
    served = model_from(hf, args)  # the learner's view of the served weights

    engine = VLLMEngine(folder, EngineSettings(max_model_len=512, max_num_seqs=8))
    try:
        block = engine.llm.vllm_config.cache_config.block_size
        text = "def parse(line):\n    key, value = line.split('=')\n    return key.strip(), value\n"
        prompt = tok.encode(text * 40, add_special_tokens=False).ids[: block + block // 2 + 5]
        greedy = SamplingSpec(max_tokens=10, temperature=0.0)

        async def run(request_id: str):
            final = []
            async for final in engine.generate(prompt, greedy, request_id):
                pass
            return final[0]

        async def seeded_and_busy():
            """More prompt tokens at once than a step takes, so prompts are prefilled in chunks: with a
            seed, that killed vLLM's CPU engine (serving/engine.py: seeds)."""
            seeded = SamplingSpec(max_tokens=4, temperature=1.0, seed=7)
            prompts = [tok.encode(text * 40, add_special_tokens=False).ids[i : i + 400] for i in range(8)]

            async def one(i, p):
                final = []
                async for final in engine.generate(p, seeded, f"s{i}-{time.time_ns()}"):
                    pass
                return final

            return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

        async def all_of_it():  # one event loop: the engine's output handler lives on it
            # the same prompt twice: the second's prefix comes from vLLM's cache
            return await run(f"r1-{time.time_ns()}"), await run(f"r2-{time.time_ns()}"), await seeded_and_busy()

        first, second, busy = asyncio.run(all_of_it())
        assert all(out and out[0].token_ids for out in busy)
    finally:
        engine.shutdown()

    n = len(first.token_ids)
    trace = decode_routing(first.routing)
    assert trace.shape == (len(args.moe_layers), len(prompt) + n - 1, args.top_k)
    assert (trace >= 0).all() and (trace < args.n_experts).all()

    # the learner's own choice on the same weights and tokens
    with torch.no_grad():
        _, own = served(torch.tensor([prompt + first.token_ids[:-1]]), return_routing=True)
    own_LPK = torch.stack([r[0] for r in own]).numpy()
    same = (np.sort(trace, -1) == np.sort(own_LPK, -1)).all(-1).mean()
    print(
        f"\nrouting recorded by vLLM: {trace.shape}, block size {block}; same experts as the learner's forward at {same:.1%} of positions"
    )
    assert same >= 0.95  # margins are clear (spread_routers): only a near-tie may flip

    # the second request's cached prefix was filled from the blocks the first one ran
    again = decode_routing(second.routing)
    cached = (len(prompt) // block) * block
    assert cached > 0 and np.array_equal(again[:, :cached], trace[:, :cached])

    # the learner's batch replays it
    fmt = own_format(tok, args.max_seq_len)
    s = Sample(1, "c", 0, 0, prompt, first.token_ids, first.logprobs, 1.0, "accepted", first.routing)
    batch = make_batch([s], args, fmt)
    assert batch.routing is not None
    for layer, got in zip(trace, batch.routing, strict=True):
        assert torch.equal(got[0, : len(prompt) + n - 1], torch.from_numpy(layer.astype(np.int64)))
