"""`flywheel bench delta --swap`: the swap plan and the per-mode summary (the swaps themselves run
vLLM under load; serving.hotswap's tests cover what each mode does)."""

import math

import pytest

from ops.bench.delta import SWAP_COMPARISONS, swap_plan, swap_summary


def test_the_swaps_go_back_and_forth_and_the_modes_are_balanced():
    plan = swap_plan(8, 2)
    assert [v for v, _ in plan] == [1, 0, 1, 0, 1, 0, 1, 0]  # every swap changes the weights
    assert [m for _, m in plan] == ["wait", "restart", "restart", "wait"] * 2
    for mode in ("wait", "restart"):  # as many of each direction in each mode
        assert sorted(v for v, m in plan if m == mode) == [0, 0, 1, 1]
    assert [v for v, _ in swap_plan(6, 3)] == [1, 2, 0, 1, 2, 0]
    assert [m for _, m in swap_plan(4, 2, SWAP_COMPARISONS["reload"])] == ["vllm", "prepared", "prepared", "vllm"]
    with pytest.raises(ValueError):
        swap_plan(4, 1)


def swap(mode: str, start: float, end: float, pause: float, restarted: int = 0) -> dict:
    return {
        "mode": mode,
        "start": start,
        "end": end,
        "pause_s": pause,
        "drain_s": pause - 0.01,
        "reload_s": 0.01,
        "restarted": restarted,
    }


def test_each_mode_gets_its_pauses_and_the_requests_that_overlapped_its_swaps():
    swaps = [swap("wait", 10.0, 11.0, 0.8), swap("restart", 20.0, 20.2, 0.05, restarted=3)]
    done = [
        (1.0, 1.5, True, 0),  # steady, before the first swap
        (2.0, 2.2, True, 0),
        (10.5, 12.0, True, 1),  # overlaps the wait swap
        (19.9, 21.0, True, 0),  # overlaps the restart swap
        (19.95, 20.5, False, -1),  # failed: in no latency
        (30.0, 30.1, True, 0),  # after both
    ]
    s = swap_summary(done, swaps, t_first=10.0)
    assert s["steady"]["n"] == 2 and s["steady"]["p50_s"] == pytest.approx(0.35)
    w, r = s["modes"]["wait"], s["modes"]["restart"]
    assert (w["swaps"], w["pause_max_s"], w["restarted"], w["during"]["n"]) == (1, 0.8, 0, 1)
    assert w["during"]["p99_s"] == pytest.approx(1.5)
    assert (r["pause_max_s"], r["restarted"], r["during"]["n"]) == (0.05, 3, 1)
    assert r["during"]["p99_s"] == pytest.approx(1.1)
    assert s["ratio_of"] == "wait / restart" and s["pause_ratio"] == pytest.approx(16.0)
    assert s["during_p99_ratio"] == pytest.approx(1.5 / 1.1)


def test_one_mode_alone_has_no_ratio():
    s = swap_summary([(0.0, 1.0, True, 0)], [swap("restart", 5.0, 5.1, 0.1)], t_first=5.0)
    assert set(s["modes"]) == {"restart"} and "pause_ratio" not in s
    assert s["modes"]["restart"]["during"]["n"] == 0 and math.isnan(s["modes"]["restart"]["during"]["p50_s"])


def test_the_table_says_when_a_prepared_swap_reloaded_the_vllm_way():
    from ops.bench.delta import _swap_table

    swaps = [
        {**swap("vllm", 10.0, 10.1, 0.08), "frm": 0, "to": 1, "tensors": 3, "reload_bytes": 10, "prepare_s": 0.1},
        {**swap("prepared", 20.0, 20.1, 0.03), "frm": 1, "to": 0, "tensors": 3, "reload_bytes": 10, "prepare_s": 0.2},
    ]
    s = {"clients": 8, "max_tokens": 32, "lr": 1e-6, "preempt_after_ms": 20.0, "compare": "reload", "requests": 4}
    s |= {"failed": 0, "swaps": swaps, **swap_summary([(0.0, 1.0, True, 0)], swaps, t_first=10.0)}
    swaps[1]["prepared"] = True
    assert "vLLM way" not in _swap_table(s).caption and "vllm / prepared" in _swap_table(s).caption
    swaps[1]["prepared"] = False
    assert "1 swap(s) meant to be prepared reloaded the vLLM way" in _swap_table(s).caption


def test_checkpoint_series_changes_only_the_weights_the_learner_trains(tmp_path):
    """The benchmark's versions are the learner's: with learn.train_weights unset, an MoE model's
    routed experts change and nothing else, so each delta is the size the learner publishes."""
    import re

    import torch

    from learner.corpus import TrainingData, load_corpus
    from learner.formats import own_format
    from learner.model import ModelArgs, Transformer
    from learner.tokenizer import train_tokenizer
    from learner.train.learn import EXPERTS
    from learner.train.pretrain_settings import PretrainSection
    from ops.bench.delta import checkpoint_series
    from tests.learner.test_corpus import write_corpus

    corpus = load_corpus(write_corpus(tmp_path), heldout_fraction=0.2)
    tok = train_tokenizer((f.text for f in corpus.train), 400)
    data = TrainingData(
        tok, own_format(tok, 64), corpus.train, seq_len=64, batch_size=2, fim_rate=0.5, summary_rate=0.0, seed=0
    )
    torch.manual_seed(0)
    model = Transformer(ModelArgs.from_name("tiny", vocab_size=tok.get_vocab_size(), max_seq_len=64))
    cfg = PretrainSection(size="tiny")
    for patterns, expect in ((None, lambda n: re.search(EXPERTS, n)), ([".*"], lambda n: True)):
        v0, v1 = checkpoint_series(model, data, cfg, 1e-3, 2, 1, patterns)
        changed = {n for n in v0 if not torch.equal(v0[n], v1[n])}
        assert changed and all(expect(n) for n in changed), sorted(changed)
        if patterns is None:
            assert any(not re.search(EXPERTS, n) for n in v0)  # there were others to leave alone
        else:
            assert any(not re.search(EXPERTS, n) for n in changed)
