"""A file's language, as prompts and suggestions need it: its line comment, and where a suggestion ends.

An editor's suggestion is the rest of a line or a short block (`editor_stops`):
- With code before the cursor on its line, it is the rest of that line: it ends at the newline,
  as editors' single-line completions do (the base does not learn in pretraining to stop where
  the suffix goes on; without this it writes past the line to the token cap, see the README's
  "The line stop").
- At the start of a line (nothing but indentation before the cursor) it may be a block. Besides
  the blank line (learner.prompts.EDITOR_STOP), it ends where the model starts the next
  top-level definition: a newline followed by one of the language's top-level keywords
  (`\\ndef`, `\\nclass` in Python). Indented code (a method, a nested function) starts with
  spaces after the newline, so it never matches.
Languages are named as editors name them (VS Code's language ids, which Tabby sends). Serving
stops editor requests at `editor_stops`, and the held-out replay cuts its greedy middles there,
so both see the same text.
"""

from __future__ import annotations

from dataclasses import dataclass

from learner.prompts import EDITOR_STOP


@dataclass(frozen=True)
class Language:
    comment: str
    top_level: tuple[str, ...] = ()

    @property
    def stops(self) -> tuple[str, ...]:
        return tuple(f"\n{k}" for k in self.top_level)


_C_LIKE = ("#include", "#define", "struct ", "typedef ", "static ", "extern ", "int ", "void ")
_JS = ("function ", "class ", "export ", "import ", "const ", "let ", "var ", "async function ")
_TS = (*_JS, "interface ", "type ", "enum ", "declare ", "abstract class ")

LANGUAGES: dict[str, Language] = {
    "python": Language("#", ("def ", "class ", "import ", "from ", "if __name__", "@")),
    "javascript": Language("//", _JS),
    "javascriptreact": Language("//", _JS),
    "typescript": Language("//", _TS),
    "typescriptreact": Language("//", _TS),
    "go": Language("//", ("func ", "type ", "package ", "import ", "var ", "const ")),
    "rust": Language(
        "//", ("fn ", "pub ", "impl ", "struct ", "enum ", "trait ", "mod ", "use ", "const ", "static ", "#[")
    ),
    "java": Language("//", ("public ", "private ", "protected ", "class ", "interface ", "import ", "package ", "@")),
    "kotlin": Language("//", ("fun ", "class ", "object ", "interface ", "import ", "package ", "val ", "private ")),
    "csharp": Language("//", ("public ", "private ", "internal ", "class ", "namespace ", "using ", "[")),
    "c": Language("//", _C_LIKE),
    "cpp": Language("//", (*_C_LIKE, "class ", "namespace ", "template", "using ")),
    "ruby": Language("#", ("def ", "class ", "module ", "require ")),
    "php": Language("//", ("function ", "class ", "namespace ", "use ", "interface ")),
    "lua": Language("--", ("function ", "local function ", "local ")),
    "shellscript": Language("#", ("function ",)),
    "sql": Language("--", ("SELECT ", "CREATE ", "INSERT ", "UPDATE ", "DELETE ", "WITH ")),
}
UNKNOWN = Language("#")
"""Any other language: no keyword stops, and `#` for a commented header (DeepSeek-Coder's own)."""


def language(name: str | None) -> Language:
    return LANGUAGES.get((name or "").lower(), UNKNOWN)


LINE_STOP = "\n"
"""Where a suggestion that completes a line of code ends."""


def editor_stops(name: str | None, prefix: str) -> tuple[str, ...]:
    """Where a suggestion ends in a file of language `name` whose text before the cursor is
    `prefix`: at the end of the line when the cursor's line has code before it, else at a blank
    line or the next top-level definition."""
    if prefix.rsplit("\n", 1)[-1].strip():
        return (LINE_STOP,)
    return (EDITOR_STOP, *language(name).stops)
