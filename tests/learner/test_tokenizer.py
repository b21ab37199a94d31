import inspect
import json
import textwrap
from json import decoder, encoder
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from learner.tokenizer import (
    EOS,
    SPECIAL_TOKENS,
    load_tokenizer,
    save_tokenizer,
    train_tokenizer,
)

TRICKY = [
    "def f(x):\n\treturn x  # tab indent\n",
    "    if a:\r\n        b = 'é ü ß 日本語 🚀'\r\n",
    "\n\n\n",
    "x = 1\n\n\n",
    " leading space and trailing spaces   ",
    'fn main() { println!("{}", "\\u{1F600}"); }\n',
    "a\u00a0b\u200bc\ufeffd",  # no-break space, zero-width space, BOM: no normalization
    "   \t \n \t\t",
    "",
]


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    return [inspect.getsource(m) for m in (decoder, encoder, textwrap)]


@pytest.fixture(scope="module")
def tok(corpus):
    return train_tokenizer(corpus, vocab_size=600)


def test_special_tokens_take_the_first_ids(tok):
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    assert 256 + len(SPECIAL_TOKENS) < tok.get_vocab_size() <= 600


def test_special_tokens_are_single_ids(tok):
    text = (
        "<|repo_name|>r\n<|file_sep|>f.py\n<|fim_prefix|>def f(<|fim_suffix|>)\n<|fim_middle|>"
        "<|summary_start|>s<|summary_end|><|endoftext|>"
    )
    ids = tok.encode(text).ids
    for i, t in enumerate(SPECIAL_TOKENS):
        assert ids.count(i) == 1, t
    assert tok.decode(ids, skip_special_tokens=False) == text


@pytest.mark.parametrize("text", TRICKY)
def test_round_trip_is_exact(tok, text):
    ids = tok.encode(text).ids
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_round_trip_on_unseen_code(tok):
    src = Path(textwrap.__file__).read_text()[:4000] + "\n"
    assert tok.decode(tok.encode(src).ids) == src


def test_training_compresses(tok, corpus):
    ids = tok.encode(corpus[0]).ids
    assert len(ids) < len(corpus[0].encode()) / 2


def test_save_load_and_auto_tokenizer(tok, tmp_path):
    save_tokenizer(tok, tmp_path, model_max_length=256)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["eos_token"] == config["pad_token"] == EOS

    again = load_tokenizer(tmp_path)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    assert hf.eos_token_id == hf.pad_token_id == tok.token_to_id(EOS)
    assert hf.model_max_length == 256
    for text in TRICKY + ["<|fim_prefix|>a<|fim_suffix|>b<|fim_middle|>"]:
        ids = tok.encode(text).ids
        assert again.encode(text).ids == ids
        assert hf(text)["input_ids"] == ids
        assert hf.decode(ids) == text


def test_rejects_too_small_vocab(corpus):
    with pytest.raises(ValueError):
        train_tokenizer(corpus, vocab_size=100)


def test_load_missing_folder(tmp_path):
    with pytest.raises(ValueError):
        load_tokenizer(tmp_path)
