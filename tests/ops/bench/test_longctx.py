"""The long-context benchmark's example finder and scoring (pure parts)."""

import json
import random
import textwrap

import pytest

from learner.corpus import SourceFile
from learner.tokenizer import train_tokenizer
from ops.bench.longctx import StrategyResult, far_back_examples, paired, score


@pytest.fixture(scope="module")
def tok():
    import inspect

    return train_tokenizer([inspect.getsource(m) for m in (json.decoder, json.encoder, textwrap)], vocab_size=512)


def test_examples_need_context_from_far_back(tok):
    filler = "".join(f"value_{i} = compute({i}, {i + 1})\n" for i in range(15))
    text = (
        "import collections\n\n\ndef normalise_path(p):\n    return p\n\n\n" + filler + "result = normalise_path(raw)\n"
    )
    examples = far_back_examples(tok, [SourceFile("m.py", text)], budget=60, window=400, n=5, rng=random.Random(0))
    assert [e.name for e in examples] == ["normalise_path"]
    ex = examples[0]
    assert ex.prefix.endswith("result = no") and ex.truth == "rmalise_path(raw)"
    assert 60 < ex.distance_tokens <= 384
    assert "normalise_path" not in ex.prefix[-200:]
    assert far_back_examples(tok, [SourceFile("m.py", text)], budget=1000, window=2000, n=5, rng=random.Random(0)) == []


def test_score():
    assert score("rmalise_path(raw)\nmore", "rmalise_path(raw)") == (True, 1.0)
    exact, sim = score("rmalise(raw)", "rmalise_path(raw)")
    assert not exact and 0.5 < sim < 1.0
    assert score("", "x") == (False, 0.0)


def test_examples_beyond_the_window_in_long_files(tok):
    filler = "".join(f"value_{i} = compute({i}, {i + 1})\n" for i in range(40))
    text = "def normalise_path(p):\n    return p\n\n\n" + filler + "result = normalise_path(raw)\n"
    files = [SourceFile("m.py", text)]
    n_tokens = len(tok.encode(text).ids)
    far = far_back_examples(tok, files, budget=100, window=100, n=5, rng=random.Random(0), max_distance=4 * n_tokens)
    assert [e.name for e in far] == ["normalise_path"] and far[0].distance_tokens > 100
    assert far_back_examples(tok, files, budget=100, window=100, n=5, rng=random.Random(0)) == []  # within the window
    assert (
        far_back_examples(
            tok,
            files,
            budget=100,
            window=100,
            n=5,
            rng=random.Random(0),
            max_distance=10**6,
            min_file_tokens=n_tokens + 1,
        )
        == []
    )


def test_paired_comparison_by_hand():
    def result(name, rows):
        return StrategyResult(name, len(rows), 0.0, 0.0, 0.0, 0, rows)

    summary = result("self-summary", [(True, 1.0), (True, 1.0), (False, 0.5), (False, 0.4), (True, 1.0)])
    trunc = result("truncation", [(False, 0.5), (False, 0.6), (False, 0.5), (False, 0.2), (True, 1.0)])
    c = paired(summary, trunc)
    assert (c["exact_only_better"], c["exact_only_other"]) == (2, 0) and c["exact_p"] == pytest.approx(0.25)
    # differences 0.5, 0.4, 0.0, 0.2, 0.0: mean 0.22, sd 0.2280, t = 2.157 with 4 degrees of freedom
    assert c["similarity_diff"] == pytest.approx(0.22) and c["similarity_p"] == pytest.approx(0.0486, abs=5e-4)
    same = paired(trunc, trunc)
    assert same["similarity_p"] == 1.0 and same["exact_p"] == 1.0
