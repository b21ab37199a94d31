"""FIM prompts in each family's template, by token name; the header the way the family was trained."""

import pytest

from learner.fim import fim_example_ids, fim_prompt_ids, plain_prompt_ids, prefix_tail
from learner.formats import ModelFormat, own_format
from learner.tokenizer import EOS, FILE_SEP, FIM_MIDDLE, FIM_PREFIX, FIM_SUFFIX, REPO_NAME, train_tokenizer
from tests.helpers import family_tokenizer

CODE = "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n"
PREFIX, MIDDLE, SUFFIX = CODE[:22], CODE[22:32], CODE[32:]


def test_flywheel_tokenizer_uses_the_qwen_layout_with_the_path_as_a_file_sep_line():
    tok = train_tokenizer([CODE] * 4, 300)
    fmt = own_format(tok, 256)
    assert fmt.fim.name == "qwen" and fmt.bos_ids == ()
    prompt = fim_prompt_ids(fmt, tok, PREFIX, SUFFIX, path="pkg/add.py")
    assert tok.decode(prompt, skip_special_tokens=False) == (
        f"{FILE_SEP}pkg/add.py\n{FIM_PREFIX}{PREFIX}{FIM_SUFFIX}{SUFFIX}{FIM_MIDDLE}"
    )
    with_repo = fim_prompt_ids(fmt, tok, PREFIX, SUFFIX, path="pkg/add.py", repo="calc")
    assert tok.decode(with_repo, skip_special_tokens=False).startswith(f"{REPO_NAME}calc\n{FILE_SEP}pkg/add.py\n")
    bare = fim_prompt_ids(fmt, tok, PREFIX, SUFFIX)
    assert bare[0] == tok.token_to_id(FIM_PREFIX) and bare == prompt[prompt.index(bare[0]) :]

    ex = fim_example_ids(fmt, tok, PREFIX, MIDDLE, SUFFIX, path="pkg/add.py")
    assert ex[: len(prompt)] == prompt and ex[-1] == tok.token_to_id(EOS)
    assert tok.decode(ex[len(prompt) : -1]) == MIDDLE


def family(specials: list[str], *, eos: str, **config) -> tuple[object, ModelFormat]:
    tok = family_tokenizer([CODE] * 4, 300, specials)
    return tok, ModelFormat.of(
        tok, config={"max_position_embeddings": 256, **config}, generation_config={"eos_token_id": tok.token_to_id(eos)}
    )


def test_starcoder_deepseek_and_codestral_templates():
    tok, fmt = family(
        ["<|endoftext|>", "<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<file_sep>"], eos="<|endoftext|>"
    )
    assert fmt.fim.name == "starcoder"
    assert (
        tok.decode(fim_prompt_ids(fmt, tok, PREFIX, SUFFIX, path="a.py"), skip_special_tokens=False)
        == f"<file_sep>a.py\n<fim_prefix>{PREFIX}<fim_suffix>{SUFFIX}<fim_middle>"
    )

    tok, fmt = family(
        ["<｜end▁of▁sentence｜>", "<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"], eos="<｜end▁of▁sentence｜>"
    )
    assert fmt.fim.name == "deepseek"
    assert (
        tok.decode(fim_prompt_ids(fmt, tok, PREFIX, SUFFIX, path="a.py"), skip_special_tokens=False)
        == f"<｜fim▁begin｜># a.py\n{PREFIX}<｜fim▁hole｜>{SUFFIX}<｜fim▁end｜>"
    )

    tok, fmt = family(["</s>", "[PREFIX]", "[SUFFIX]"], eos="</s>")
    assert fmt.fim.name == "codestral" and fmt.fim.middle is None
    assert (
        tok.decode(fim_prompt_ids(fmt, tok, PREFIX, SUFFIX, path="a.py"), skip_special_tokens=False)
        == f"[SUFFIX]{SUFFIX}[PREFIX]{PREFIX}"  # suffix first, no path convention
    )


def test_a_vocabulary_without_fim_tokens_has_no_template():
    tok, fmt = family(["<|endoftext|>"], eos="<|endoftext|>")
    assert fmt.fim is None and fmt.describe()["prefix_only"]
    with pytest.raises(ValueError, match="prefix-only"):
        fim_prompt_ids(fmt, tok, PREFIX, SUFFIX)
    assert plain_prompt_ids(fmt, tok, PREFIX) == tok.encode(PREFIX).ids
    assert plain_prompt_ids(fmt, tok, "") == [tok.token_to_id("<|endoftext|>")]  # an empty prompt starts a document


def test_the_template_can_be_named_or_turned_off():
    tok = train_tokenizer([CODE] * 4, 300)
    config = {"max_position_embeddings": 256, "eos_token_id": 0}
    assert ModelFormat.of(tok, config=config, fim="none").fim is None
    assert ModelFormat.of(tok, config=config, fim="qwen").fim.name == "qwen"
    with pytest.raises(ValueError, match="lacks the starcoder FIM tokens"):
        ModelFormat.of(tok, config=config, fim="starcoder")
    with pytest.raises(ValueError, match="unknown FIM template"):
        ModelFormat.of(tok, config=config, fim="gpt")


def test_flywheel_base_template_puts_the_suffix_first_so_the_middle_continues_the_prefix(tmp_path):
    from learner.export import export_hf
    from learner.formats import read_format
    from learner.model import ModelArgs, Transformer

    tok = train_tokenizer([CODE] * 4, 300)
    fmt = own_format(tok, 256, fim="qwen-spm")
    assert fmt.fim.name == "qwen-spm" and fmt.fim.middle is None
    prompt = fim_prompt_ids(fmt, tok, PREFIX, SUFFIX, path="pkg/add.py", repo="calc")
    assert tok.decode(prompt, skip_special_tokens=False) == (
        f"{REPO_NAME}calc\n{FILE_SEP}pkg/add.py\n{FIM_SUFFIX}{SUFFIX}{FIM_PREFIX}{PREFIX}"
    )
    ex = fim_example_ids(fmt, tok, PREFIX, MIDDLE, SUFFIX, path="pkg/add.py")
    n = len(fim_prompt_ids(fmt, tok, PREFIX, SUFFIX, path="pkg/add.py"))
    assert tok.decode(ex[n:-1]) == MIDDLE and ex[-1] == tok.token_to_id(EOS)
    # The export names its template, and "auto" reads it back; a named template still wins.
    args = ModelArgs.from_name("tiny", vocab_size=tok.get_vocab_size(), max_seq_len=256)
    export_hf(Transformer(args), args, tok, tmp_path, fim="qwen-spm")
    assert read_format(tmp_path) == fmt
    assert read_format(tmp_path, fim="qwen").fim.name == "qwen"
    assert read_format(tmp_path, fim="none").fim is None


def test_an_unknown_declared_template_is_refused():
    tok = train_tokenizer([CODE] * 4, 300)
    config = {"max_position_embeddings": 256, "eos_token_id": 0}
    with pytest.raises(ValueError, match="unknown fim_template 'psm2'"):
        ModelFormat.of(tok, config=config, tokenizer_config={"fim_template": "psm2"})
    assert ModelFormat.of(tok, config=config, tokenizer_config={"fim_template": "psm2"}, fim="none").fim is None


@pytest.mark.parametrize("layout", ["qwen", "qwen-spm", "starcoder", "deepseek", "codestral", "prefix-only"])
def test_the_prefix_tail_reads_back_the_cursors_line_in_every_layout(layout):
    """The learner reads the line before a served request's cursor back from its prompt ids
    (learner.show's context features); serving read it from the request. Both must agree."""
    from learner.show import cursor_line

    specials = {
        "starcoder": (["<|endoftext|>", "<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<file_sep>"], "<|endoftext|>"),
        "deepseek": (
            ["<｜end▁of▁sentence｜>", "<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"],
            "<｜end▁of▁sentence｜>",
        ),
        "codestral": (["</s>", "[PREFIX]", "[SUFFIX]"], "</s>"),
        "prefix-only": (["<|endoftext|>"], "<|endoftext|>"),
    }
    if layout in specials:
        tok, fmt = family(specials[layout][0], eos=specials[layout][1])
    else:
        tok = train_tokenizer([CODE] * 4, 300)
        fmt = own_format(tok, 256, fim=layout)
    for prefix in (PREFIX, "x = ", "", CODE + "    y = [a,"):
        if fmt.fim is None:
            ids = plain_prompt_ids(fmt, tok, prefix)
        else:
            ids = fim_prompt_ids(fmt, tok, prefix, SUFFIX, path="pkg/a.py", repo="calc")
        assert cursor_line(prefix_tail(fmt, tok, ids)) == cursor_line(prefix), (layout, prefix)
