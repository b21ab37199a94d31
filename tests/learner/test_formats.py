"""ModelFormat: EOS, pad, bos and the window read from a model's own files, never fixed ids."""

import json

import pytest

from learner.fim import fim_prompt_ids
from learner.formats import ModelFormat, own_format, parse_rendered_fim, read_format
from tests.helpers import family_tokenizer

QWEN_SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
]
CODE = "def add(a, b):\n    return a + b\n"


@pytest.fixture(scope="module")
def qwen_tok():
    return family_tokenizer([CODE] * 4, 300, QWEN_SPECIALS)


def test_eos_ids_come_from_generation_config_then_config_then_the_tokenizer(qwen_tok):
    tok = qwen_tok
    endoftext, im_end = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
    assert endoftext > 256 and tok.token_to_id("!") == 0  # as in Qwen: id 0 is "!", EOS far from it
    fmt = ModelFormat.of(
        tok,
        config={"max_position_embeddings": 4096, "eos_token_id": im_end, "vocab_size": 512},
        generation_config={"eos_token_id": [im_end, endoftext]},
        tokenizer_config={"eos_token": {"content": "<|im_end|>"}, "pad_token": "<|endoftext|>"},
    )
    assert fmt.eos_ids == (im_end, endoftext) and fmt.eos_id == im_end and fmt.pad_id == endoftext
    assert fmt.window == 4096 and fmt.bos_ids == () and 0 not in fmt.eos_ids
    stops = {tok.id_to_token(i) for i in fmt.fim.stop_ids}
    assert {"<|fim_pad|>", "<|file_sep|>", "<|repo_name|>"} <= stops

    only_tokenizer = ModelFormat.of(
        tok, config={"max_position_embeddings": 64}, tokenizer_config={"eos_token": "<|endoftext|>"}
    )
    assert only_tokenizer.eos_ids == (endoftext,) and only_tokenizer.pad_id == endoftext


def test_bad_special_tokens_are_refused(qwen_tok):
    with pytest.raises(ValueError, match="no end-of-sequence token"):
        ModelFormat.of(qwen_tok, config={"max_position_embeddings": 64})
    with pytest.raises(ValueError, match="outside the vocabulary"):
        ModelFormat.of(qwen_tok, config={"max_position_embeddings": 64, "eos_token_id": 10**6})
    with pytest.raises(ValueError, match="does not have"):
        ModelFormat.of(qwen_tok, config={"max_position_embeddings": 64}, tokenizer_config={"eos_token": "</s>"})
    with pytest.raises(ValueError, match="max_position_embeddings"):
        ModelFormat.of(qwen_tok, config={"eos_token_id": 1})


def test_a_tokenizer_that_adds_bos_gets_it_once_at_the_start():
    from tokenizers import processors

    tok = family_tokenizer([CODE] * 4, 300, ["<s>", "</s>", "<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    fmt = ModelFormat.of(tok, config={"max_position_embeddings": 64}, tokenizer_config={"eos_token": "</s>"})
    assert fmt.bos_ids == (tok.token_to_id("<s>"),)
    ids = fim_prompt_ids(fmt, tok, "x = ", "\n")
    assert ids[0] == tok.token_to_id("<s>") and ids.count(ids[0]) == 1


def test_own_format_is_what_the_export_reads(tok, tmp_path):
    from learner.export import export_hf
    from learner.model import ModelArgs, Transformer

    args = ModelArgs.from_name("tiny", vocab_size=tok.get_vocab_size(), max_seq_len=128)
    export_hf(Transformer(args), args, tok, tmp_path)
    assert read_format(tmp_path) == own_format(tok, 128)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["eos_token_id"] == tok.token_to_id("<|endoftext|>")


@pytest.mark.parametrize(
    "rendered, template, prefix, suffix",
    [
        ("<|fim_prefix|>def f(x):\n    <|fim_suffix|>\n<|fim_middle|>", "qwen", "def f(x):\n    ", "\n"),
        ("<fim_prefix>def f(x):\n    <fim_suffix>\n<fim_middle>", "starcoder", "def f(x):\n    ", "\n"),
        ("<｜fim▁begin｜>def f(x):\n    <｜fim▁hole｜>\n<｜fim▁end｜>", "deepseek", "def f(x):\n    ", "\n"),
        ("[SUFFIX]\n[PREFIX]def f(x):\n    ", "codestral", "def f(x):\n    ", "\n"),
        ("<PRE> def f(x):\n     <SUF>\n <MID>", "codellama", "def f(x):\n    ", "\n"),
        # text after the middle marker is the start of the middle: it ends the prefix
        ("<|fim_prefix|>def f(x):\n<|fim_suffix|>\n<|fim_middle|>    ret", "qwen", "def f(x):\n    ret", "\n"),
    ],
)
def test_a_client_rendered_fim_prompt_is_read_back(rendered, template, prefix, suffix):
    parsed = parse_rendered_fim(rendered)
    assert (parsed.template, parsed.prefix, parsed.suffix) == (template, prefix, suffix)


def test_qwen_repository_level_prompt_gives_repo_path_and_other_files():
    rendered = (
        "<|repo_name|>shop\n<|file_sep|>shop/util.py\ndef helper(a):\n    return a\n"
        "<|file_sep|>shop/models.py\nclass User: ...\n"
        "<|file_sep|>shop/app.py\n<|fim_prefix|>import util\n<|fim_suffix|>\n<|fim_middle|>"
    )
    p = parse_rendered_fim(rendered)
    assert (p.repo, p.path, p.prefix, p.suffix) == ("shop", "shop/app.py", "import util\n", "\n")
    assert p.context == (("shop/util.py", "def helper(a):\n    return a"), ("shop/models.py", "class User: ..."))


@pytest.mark.parametrize(
    "text",
    [
        "x = 1\n",
        "marker = '<|fim_prefix|>'\n",  # mentions one marker
        "<|fim_suffix|>a<|fim_prefix|>b<|fim_middle|>",  # out of order
        "<|fim_prefix|>a<|fim_suffix|>b<|fim_middle|>c<|fim_prefix|>",  # twice
    ],
)
def test_a_plain_prompt_is_not_read_as_fim(text):
    assert parse_rendered_fim(text) is None
