from learner.fim import fim_example_ids, fim_header, fim_prompt_ids
from learner.tokenizer import EOS_ID, FIM_MIDDLE_ID, FIM_PREFIX_ID, FIM_SUFFIX_ID, train_tokenizer

CODE = "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n"


def test_psm_layout_with_and_without_header():
    tok = train_tokenizer([CODE] * 4, 300)
    prefix, middle, suffix = CODE[:22], CODE[22:32], CODE[32:]
    header = fim_header(language="python", path="pkg/add.py")
    assert header == "# python: pkg/add.py\n"
    assert fim_header() == "" and fim_header(language="go") == "# go\n"

    prompt = fim_prompt_ids(tok, prefix, suffix, header)
    assert prompt[0] == FIM_PREFIX_ID and prompt[-1] == FIM_MIDDLE_ID
    cut = prompt.index(FIM_SUFFIX_ID)
    assert tok.decode(prompt[1:cut]) == header + prefix
    assert tok.decode(prompt[cut + 1 : -1]) == suffix
    # a header without its newline gets one
    assert fim_prompt_ids(tok, prefix, suffix, header.rstrip("\n")) == prompt
    assert fim_prompt_ids(tok, prefix, suffix)[1:cut] != prompt[1:cut]

    ex = fim_example_ids(tok, prefix, middle, suffix, header)
    assert ex[: len(prompt)] == prompt and ex[-1] == EOS_ID
    assert tok.decode(ex[len(prompt) : -1]) == middle
