import ast

from learner.formats import TEXT_SUMMARY_CLOSE, TEXT_SUMMARY_OPEN, ModelFormat, own_format
from learner.summary import summarize_python, summary_example_ids, summary_prompt_ids
from learner.tokenizer import EOS, SUMMARY_END, SUMMARY_START, train_tokenizer

SAMPLE = '''"""Module docstring: def not_a_function(x): and X = 1 inside a string."""
import os, sys
from collections import (OrderedDict,
                         defaultdict)

MAX = 10
TABLE: dict[str, int] = {"a": 1, "b": 2, "c": 3, "d": 4, "e": 5, "f": 6, "g": 7}


class Reader(io.RawIOBase, metaclass=Meta):
    size = 3

    def __init__(self, raw, *, size: int = 8192):
        def helper():
            pass
        self.raw = raw

    async def read(self, n=-1) -> bytes:
        return b""

    class Inner:
        def deep(self): ...


def open_reader(path,
                mode="rb"):
    return Reader(open(path, mode))
'''

EXPECTED = """import os, sys
from collections import OrderedDict, defaultdict
MAX = 10
TABLE: dict[str, int] = ...
class Reader(io.RawIOBase, metaclass=Meta):
    def __init__(self, raw, *, size: int=8192)
    async def read(self, n=-1) -> bytes
    class Inner:
        def deep(self)
def open_reader(path, mode='rb')"""


def test_summary_of_parseable_code():
    assert summarize_python(SAMPLE) == EXPECTED


def test_chunk_that_does_not_parse_gives_the_same_lines():
    # Cut inside the docstring-free part: starts mid-class (indented), ends mid-signature.
    start = SAMPLE.index("    def __init__")
    chunk = SAMPLE[start:] + "\ndef broken(a, b"
    try:
        ast.parse(chunk)
        raise AssertionError("the chunk was meant not to parse")
    except SyntaxError:
        pass
    lines = summarize_python(chunk).splitlines()
    assert lines == [
        "    def __init__(self, raw, *, size: int=8192)",  # formatted as the ast path formats it
        "    async def read(self, n=-1) -> bytes",
        "    class Inner:",
        "        def deep(self)",
        "def open_reader(path, mode='rb')",
        "def broken(...)",  # cut off: name only
    ]


def test_scanner_skips_nested_functions_and_docstrings_and_handles_garbage():
    chunk = 'x = (1,\n  2\ndef f(a):\n    """\ndef fake(): pass\n"""\n    def inner(): pass\n    return a\n  ) ]]'
    assert summarize_python(chunk).splitlines() == ["x = ...", "def f(a)"]
    assert summarize_python("") == ""
    assert summarize_python("    return x\n") == ""
    assert summarize_python("\x00 def (((") == ""


def test_training_format_and_prompt():
    tok = train_tokenizer([SAMPLE] * 3, 400)
    fmt = own_format(tok, 256)
    ids = summary_example_ids(fmt, tok, SAMPLE)
    prompt = summary_prompt_ids(fmt, tok, SAMPLE)
    start, end, eos = (tok.token_to_id(t) for t in (SUMMARY_START, SUMMARY_END, EOS))
    assert prompt[-1] == start and ids[: len(prompt)] == prompt
    assert ids[-2:] == [end, eos]
    assert tok.decode(ids[len(prompt) : -2]) == EXPECTED


def test_a_vocabulary_without_summary_tokens_gets_plain_text_markers():
    from tests.helpers import family_tokenizer

    tok = family_tokenizer([SAMPLE] * 3, 400, ["<|endoftext|>"])
    fmt = ModelFormat.of(tok, config={"max_position_embeddings": 512, "eos_token_id": tok.token_to_id("<|endoftext|>")})
    assert not fmt.summary.tokens and fmt.summary.stop_ids == () and fmt.summary.stop_text == "[end of summary]"
    ids = summary_example_ids(fmt, tok, SAMPLE)
    assert tok.decode(ids[:-1]) == SAMPLE + TEXT_SUMMARY_OPEN + EXPECTED + TEXT_SUMMARY_CLOSE
