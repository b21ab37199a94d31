"""The long-context benchmark's example finder and scoring (pure parts)."""

import json
import random
import textwrap

import pytest

from learner.corpus import SourceFile
from learner.tokenizer import train_tokenizer
from ops.bench.longctx import far_back_examples, score


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
