"""Self-summarization teacher: a structural summary of a Python chunk, derived with `ast`.

`summarize_python(code)` lists, in source order, one line per item:

    import os, sys                      imports at column 0
    from typing import Any
    MAX_SIZE = 1024                     top-level assignments (the value when it is short, else `...`)
    cache: dict = ...
    class Reader(io.RawIOBase):         classes, with their bases
        def __init__(self, raw, *, size=8192)   methods, indented as in the source
        async def read(self, n=-1) -> bytes
    def open_reader(path)               functions (bodies and nested functions are left out)

Each item keeps its source column, so a method stays indented under its class even when
the chunk starts inside the class body. Chunks are arbitrary windows of a file, so most do
not parse: then a line scanner finds the same items with regexes and formats each one
through `ast` where its own text parses, so both paths print the same way. The summary is
empty when the chunk holds none of these items.

Training format (what `learner.train.pretrain` trains on; serving prompts the same way), with
the model's summary markers (learner.formats.SummaryFormat: Flywheel's `<|summary_start|>` and
`<|summary_end|>` tokens, or plain text for a vocabulary without them):

    ids = encode(code) + open + encode(summary) + close + [eos]

with no separator between the code and the marker; the summary has no trailing newline.
To make the model write a summary, prompt with `summary_prompt_ids(fmt, tok, code)`
(= encode(code) + open) and stop at the close marker.
"""

from __future__ import annotations

import ast
import re

from tokenizers import Tokenizer

from learner.fim import encode
from learner.formats import ModelFormat

SHORT_VALUE_CHARS = 40  # longer (or multi-line) assigned values print as `...`

_DEF = re.compile(r"^([ \t]*)(async[ \t]+)?def[ \t]+[A-Za-z_]\w*[ \t]*\(", re.M)
_CLASS = re.compile(r"^([ \t]*)class[ \t]+[A-Za-z_]\w*[ \t]*[(:]", re.M)
_IMPORT = re.compile(r"^(import[ \t]+\S|from[ \t]+[\w.]+[ \t]+import\b)", re.M)
_ASSIGN = re.compile(r"^([A-Za-z_][\w.]*)[ \t]*(?::[ \t]*([^=\n]+?)[ \t]*)?=(?!=)", re.M)


def summarize_python(code: str) -> str:
    """The structural summary of a Python chunk (see the module docstring); never raises."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):  # ValueError: NUL bytes
        return "\n".join(_scan(code))
    return "\n".join(_from_body(tree.body, top=True))


def summary_prompt_ids(fmt: ModelFormat, tok: Tokenizer, code: str) -> list[int]:
    """Prompt that makes the model summarize `code`: stop generating at the close marker."""
    return [*fmt.bos_ids, *encode(tok, code), *fmt.summary.open_ids]


def summary_example_ids(fmt: ModelFormat, tok: Tokenizer, code: str, summary: str | None = None) -> list[int]:
    """One training example: code, its summary between the markers, end of text."""
    summary = summarize_python(code) if summary is None else summary
    return summary_prompt_ids(fmt, tok, code) + encode(tok, summary) + [*fmt.summary.close_ids, fmt.eos_id]


# --- the ast path -------------------------------------------------------------------------------


def _from_body(body: list[ast.stmt], *, top: bool) -> list[str]:
    out = []
    for node in body:
        if isinstance(node, ast.ClassDef):
            out.append(_format(node))
            out += _from_body(node.body, top=False)
        elif (
            isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            or top
            and isinstance(node, (ast.Import, ast.ImportFrom, ast.Assign, ast.AnnAssign))
        ):
            out.append(_format(node))
    return out


def _format(node: ast.stmt, indent: str | None = None) -> str:
    """One summary line for a def, class, import or assignment."""
    pad = " " * node.col_offset if indent is None else indent
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        kw = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
        ret = f" -> {ast.unparse(node.returns)}" if node.returns else ""
        return f"{pad}{kw} {node.name}({ast.unparse(node.args)}){ret}"
    if isinstance(node, ast.ClassDef):
        bases = [ast.unparse(b) for b in node.bases] + [ast.unparse(k) for k in node.keywords]
        return f"{pad}class {node.name}" + (f"({', '.join(bases)})" if bases else "") + ":"
    if isinstance(node, ast.Assign):
        targets = " = ".join(ast.unparse(t) for t in node.targets)
        return f"{pad}{targets} = {_short(node.value)}"
    if isinstance(node, ast.AnnAssign):
        value = f" = {_short(node.value)}" if node.value is not None else ""
        return f"{pad}{ast.unparse(node.target)}: {ast.unparse(node.annotation)}{value}"
    return pad + ast.unparse(node)  # imports


def _short(value: ast.expr) -> str:
    s = ast.unparse(value)
    return s if len(s) <= SHORT_VALUE_CHARS and "\n" not in s else "..."


# --- the line-scanner path (chunks that do not parse) --------------------------------------------


def _scan(code: str) -> list[str]:
    """Find defs, classes, column-0 imports and assignments with regexes, in source order."""
    found: list[tuple[int, str, str, int]] = []  # (offset, kind, indent, end of the match)
    for kind, rx in (("def", _DEF), ("class", _CLASS), ("import", _IMPORT), ("assign", _ASSIGN)):
        found += [(m.start(), kind, m.group(1) if kind in ("def", "class") else "", m.end()) for m in rx.finditer(code)]
    strings = _docstring_spans(code)
    found = sorted(f for f in found if not any(a < f[0] < b for a, b in strings))

    out: list[str] = []
    scopes: list[tuple[int, str]] = []  # enclosing (indent width, kind) of defs and classes
    for start, kind, indent, end in found:
        if kind in ("import", "assign"):
            scopes.clear()  # column 0: every scope has ended
            line = _statement_line(code, start, kind)
            if line:
                out.append(line)
            continue
        width = len(indent.expandtabs(8))
        while scopes and scopes[-1][0] >= width:
            scopes.pop()
        inside_def = bool(scopes) and scopes[-1][1] == "def"
        scopes.append((width, kind))
        if inside_def:
            continue  # nested functions are implementation detail, as in the ast path
        out.append(_header_line(code, start, end, kind, indent))
    return out


def _docstring_spans(code: str) -> list[tuple[int, int]]:
    """Triple-quoted string spans, assuming the chunk starts outside one (a guess: a chunk
    that starts inside a docstring gets its strings and code swapped until the next quote)."""
    spans, open_at, quote = [], -1, ""
    for m in re.finditer(r'"""|\'\'\'', code):
        if not quote:
            open_at, quote = m.start(), m.group()
        elif m.group() == quote:
            spans.append((open_at, m.end()))
            quote = ""
    if quote:
        spans.append((open_at, len(code)))
    return spans


def _header_line(code: str, start: int, end: int, kind: str, indent: str) -> str:
    """`def name(args) -> ret` or `class Name(bases):`, formatted through ast when it parses."""
    head = code[start + len(indent) : end]  # "def name(" / "class Name(" / "class Name:"
    colon = _header_end(code, end - 1) if head.endswith("(") else end - 1
    if colon is not None:
        text = code[start + len(indent) : colon + 1] + " ..."
        try:
            node = ast.parse(text).body[0]
            return _format(node, indent)
        except (SyntaxError, ValueError, IndexError):
            pass
    name = head.rstrip("(:").split()[-1]
    return f"{indent}{'async def' if head.startswith('async') else kind} {name}(...)" + (":" if kind == "class" else "")


def _header_end(code: str, open_paren: int) -> int | None:
    """Offset of the `:` ending a def/class header whose argument list opens at `open_paren`."""
    close = _matching_paren(code, open_paren)
    if close is None:
        return None
    m = re.compile(r"[ \t]*(->[^:\n]+)?:").match(code, close + 1)
    return m.end() - 1 if m else None


def _matching_paren(code: str, i: int) -> int | None:
    depth, quote = 0, ""
    while i < len(code):
        c = code[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = ""
        elif c in "\"'":
            quote = c
        elif c == "#":
            nl = code.find("\n", i)
            i = len(code) if nl < 0 else nl
            continue
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def _statement_line(code: str, start: int, kind: str) -> str:
    """A column-0 import or assignment: formatted through ast when its text parses alone."""
    stop = code.find("\n", start)
    text = code[start : len(code) if stop < 0 else stop]
    if kind == "import" and "(" in text:  # from x import (a, b,\n c)
        close = _matching_paren(code, start + text.index("("))
        text = code[start : close + 1] if close is not None else text
    try:
        body = ast.parse(text).body
        if len(body) == 1 and isinstance(body[0], (ast.Import, ast.ImportFrom, ast.Assign, ast.AnnAssign)):
            return _format(body[0], "")
    except (SyntaxError, ValueError):
        pass
    if kind == "import":
        return ""  # cut off mid-statement: nothing reliable to say
    m = _ASSIGN.match(code, start)  # the value runs over several lines
    target, annotation = m.group(1), m.group(2)
    return f"{target}: {annotation} = ..." if annotation else f"{target} = ..."
