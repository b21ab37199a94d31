"""`flywheel bench implicit`: the agreement table (pure), and one small run on a stack of its own."""

from __future__ import annotations

import pytest

from learner.eval import wilson
from ops.bench.implicit import agreement


def test_agreement_per_explicit_outcome_with_wilson_intervals():
    pairs = [("full", "full")] * 8 + [("full", "partial")] * 2 + [("partial", "partial")] * 3
    pairs += [("partial", "none")] + [("none", "none")] * 20
    r = agreement(pairs)
    full, partial, none = (r["per_outcome"][o] for o in ("full", "partial", "none"))
    assert (full["n"], full["agree"], full["rate"]) == (10, 8, 0.8)
    ci = wilson(8, 10)
    assert (full["low"], full["high"]) == (ci.low, ci.high)
    assert (ci.low, ci.high) == (pytest.approx(0.4902, abs=1e-4), pytest.approx(0.9433, abs=1e-4))  # by hand
    assert (partial["n"], partial["agree"]) == (4, 3) and (none["n"], none["agree"], none["rate"]) == (20, 20, 1.0)
    assert none["high"] == 1.0 and none["low"] == pytest.approx(wilson(20, 20).low)
    assert r["confusion"]["full"] == {"full": 8, "partial": 2} and r["confusion"]["partial"] == {
        "partial": 3,
        "none": 1,
    }
    assert (r["overall"]["n"], r["overall"]["agree"]) == (34, 31)
    empty = agreement([])["per_outcome"]["full"]
    assert (empty["n"], empty["rate"], empty["low"]) == (0, None, None)


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.kafka
def test_a_small_run_measures_agreement_on_its_own_stack(tmp_path):
    """Kafka, SQLite, the sink and Ray Serve with a tiny vLLM model, started and stopped by the
    bench; the numbers it reports are the rows of v_inferred_agreement and the judge's reasons."""
    import inspect
    import json
    import textwrap

    import torch
    from rich.console import Console

    from learner.export import export_hf
    from learner.model import ModelArgs, Transformer
    from learner.tokenizer import train_tokenizer
    from ops.bench.implicit import BenchImplicitSettings, run_bench
    from tests.helpers import make_settings
    from tests.learner.train.learn_support import make_corpus

    tok = train_tokenizer([inspect.getsource(m) for m in (json.decoder, json.encoder, textwrap)], vocab_size=512)
    args = ModelArgs.from_name("tiny", vocab_size=tok.get_vocab_size(), max_seq_len=2048)
    torch.manual_seed(0)
    model_dir = export_hf(Transformer(args), args, tok, tmp_path / "model")
    base = make_settings(tmp_path)
    s = BenchImplicitSettings(
        data_dir=base.data_dir,
        cache_dir=base.cache_dir,
        pretrain={"corpus": str(make_corpus(tmp_path / "corpus")), "heldout_fraction": 0.4},
        model={
            "min_confidence": 0.0
        },  # a random test model is unsure of nearly every token: show all (the gate has tests of its own)
        serve={"ray_num_cpus": 2, "context_budget": 256, "summary_chunk_tokens": 64, "engine": {"max_model_len": 512}},
        simulate={"requests": 16, "walk_sites": 4, "users": 2, "rate": 20.0, "edit_delay_s": 0.0, "max_tokens": 8},
    )
    out = tmp_path / "implicit.json"
    r = run_bench(s, Console(width=140), model_dir=model_dir, out=str(out))
    assert json.loads(out.read_text()) == json.loads(json.dumps(r))
    assert r["run"]["requests"] == 16 and r["run"]["failed"] == "none"
    judged = r["overall"]["n"]
    assert judged == sum(p["n"] for p in r["per_outcome"].values())
    # Each walk's last request has no next one; every other shown suggestion was judged or has a reason.
    assert sum(r["not_judged"]["no_next_request"].values()) >= 1
    not_judged = sum(n for by in r["not_judged"].values() for n in by.values())
    assert judged + not_judged >= r["run"]["shown"]


def test_a_model_dir_without_a_model_is_refused_in_one_line(tmp_path):
    from tests.helpers import flywheel

    r = flywheel("bench", "implicit", "--model-dir", str(tmp_path / "nothing"), tmp_path=tmp_path)
    assert r.returncode != 0
    assert "holds no Hugging Face model" in r.stderr + r.stdout and "Traceback" not in r.stderr
    assert not (tmp_path / "data" / "bench").exists()  # refused before starting anything
