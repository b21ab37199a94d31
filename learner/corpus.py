"""The pretraining corpus: source files, a deterministic split by file, and training rows.

Default corpus: the running Python's standard library (`sysconfig.get_paths()["stdlib"]`),
its `*.py` files minus test folders and `site-packages`. Any other folder of source files
works too (`flywheel pretrain --corpus DIR`); there only hidden, vendored and cache folders
are skipped. Files larger than `max_file_bytes` (generated tables, data dumps) are skipped.

Split: a file is held out when the first 8 bytes of sha256(relative path) fall under
`heldout_fraction`. That depends on the path alone, so the split is the same on every run
and every machine, train and held-out never share a file, and adding a file never moves
another one across.

Training rows (`TrainingData.batch(step)`) are [B, S+1] token ids built from the train
files. Each row is one of three kinds:
  - FIM (`fim_rate`): fill-in-the-middle examples in the model's template (learner.fim; half
    of them with the file's path in the template's header), then a plain window; in
    `summary_context_rate` of the Python ones the older part of the prefix is replaced by
    its summary between the format's markers, as serving's self-summarization shows long
    files; in `context_rate` of them, parts of one or two other files of the same folder come
    first, laid out as serving lays out an editor's repository context (learner.prompts), the
    most relevant right before the file. A model without FIM tokens gets plain rows instead;
  - summary (`summary_rate`, Python files only): code chunks followed by their structural
    summary (learner.summary), then a plain window;
  - plain: a window of the train token stream (files joined by the model's end-of-document token).
`TrainingData.weighted(step)` also gives each target position its loss weight: with
`middle_weight` above 1 the FIM middles and the end-of-text after them (what serving asks the
model to write) weigh that much more than the rest of the row.
Everything about a batch derives from (seed, step), so the data position of a resumed run
is its step: no iterator state to save, and a resumed run sees the same rows as an
uninterrupted one.
"""

from __future__ import annotations

import bisect
import hashlib
import posixpath
import random
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from learner.fim import context_block_ids, encode, fim_example_ids
from learner.formats import ModelFormat, SummaryFormat
from learner.summary import summarize_python, summary_example_ids

LANGUAGES = {
    ".py": "python",
    ".pyi": "python",
    ".js": "javascript",
    ".mjs": "javascript",
    ".jsx": "javascript",
    ".ts": "typescript",
    ".tsx": "typescript",
    ".go": "go",
    ".rs": "rust",
    ".java": "java",
    ".kt": "kotlin",
    ".scala": "scala",
    ".c": "c",
    ".h": "c",
    ".cc": "cpp",
    ".cpp": "cpp",
    ".cxx": "cpp",
    ".hpp": "cpp",
    ".cs": "csharp",
    ".rb": "ruby",
    ".php": "php",
    ".swift": "swift",
    ".lua": "lua",
    ".sh": "shell",
    ".bash": "shell",
    ".sql": "sql",
    ".r": "r",
    ".jl": "julia",
    ".hs": "haskell",
    ".ml": "ocaml",
    ".ex": "elixir",
    ".erl": "erlang",
    ".clj": "clojure",
    ".dart": "dart",
    ".m": "objective-c",
    ".pl": "perl",
    ".zig": "zig",
    ".nim": "nim",
    ".vue": "vue",
    ".css": "css",
    ".html": "html",
}
ALWAYS_SKIPPED_DIRS = frozenset({"__pycache__", "node_modules", "site-packages", "dist-packages", "venv", "vendor"})
STDLIB_SKIPPED_DIRS = ALWAYS_SKIPPED_DIRS | {"test", "tests", "idle_test"}


@dataclass(frozen=True)
class SourceFile:
    path: str  # relative to the corpus root, with "/" separators
    text: str

    @property
    def language(self) -> str:
        return LANGUAGES.get(Path(self.path).suffix.lower(), "text")


@dataclass(frozen=True)
class Corpus:
    root: Path
    train: list[SourceFile]
    heldout: list[SourceFile]
    fingerprint: str  # sha256 over (path, content) of every file: the corpus part of a cache key


def default_corpus_dir() -> Path:
    """The running Python's standard library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(rel_path: str, fraction: float) -> bool:
    """Whether a file belongs to the held-out split: a pure function of its relative path."""
    h = int.from_bytes(hashlib.sha256(rel_path.encode()).digest()[:8], "big")
    return h < fraction * 2**64


def list_source_files(
    root: Path, *, suffixes: Sequence[str], skip_dirs: frozenset[str], max_file_bytes: int
) -> list[Path]:
    """Source files under root, sorted; hidden and `skip_dirs` folders and large files left out."""
    out = []
    for p in root.rglob("*"):
        rel_parts = p.relative_to(root).parts
        if any(part in skip_dirs or part.startswith(".") for part in rel_parts[:-1]):
            continue
        if p.suffix.lower() in suffixes and p.is_file() and 0 < p.stat().st_size <= max_file_bytes:
            out.append(p)
    return sorted(out)


def load_corpus(root: Path | None = None, *, heldout_fraction: float = 0.05, max_file_bytes: int = 256_000) -> Corpus:
    """Read and split a corpus; `root=None` is the standard library. ValueError on bad input."""
    stdlib = root is None
    root = default_corpus_dir() if stdlib else Path(root).expanduser()
    if not root.is_dir():
        raise ValueError(f"corpus folder {root} does not exist; pass --corpus DIR with source files")
    paths = list_source_files(
        root,
        suffixes=(".py",) if stdlib else tuple(LANGUAGES),
        skip_dirs=STDLIB_SKIPPED_DIRS if stdlib else ALWAYS_SKIPPED_DIRS,
        max_file_bytes=max_file_bytes,
    )
    files, digest = [], hashlib.sha256()
    for p in paths:
        raw = p.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue  # binary or another encoding: not worth guessing
        rel = p.relative_to(root).as_posix()
        if text.strip():
            files.append(SourceFile(rel, text))
            digest.update(f"{rel}\0{hashlib.sha256(raw).hexdigest()}\n".encode())
    if len(files) < 2:
        exts = " ".join(sorted(set(LANGUAGES.values()))[:6])
        raise ValueError(
            f"corpus folder {root} has {len(files)} usable source file(s); pretraining needs at least 2 "
            f"(UTF-8, 1 byte to {max_file_bytes} bytes; languages such as {exts}, ...)"
        )
    heldout = [f for f in files if is_heldout(f.path, heldout_fraction)]
    if not heldout:  # a small corpus: hold out the file whose hash is smallest, still deterministic
        heldout = [min(files, key=lambda f: hashlib.sha256(f.path.encode()).digest())]
    train = [f for f in files if f not in heldout]
    if not train:
        raise ValueError(f"heldout_fraction={heldout_fraction} leaves no training files in {root}; lower it")
    return Corpus(root, train, heldout, digest.hexdigest())


def token_stream(fmt: ModelFormat, tok: Tokenizer, files: Sequence[SourceFile]) -> torch.Tensor:
    """All files encoded and joined, each one the model's bos (if any), its text and its
    end-of-document token: [N] int64."""
    ids: list[int] = []
    for enc in tok.encode_batch([f.text for f in files], add_special_tokens=False):
        ids += [*fmt.bos_ids, *enc.ids, fmt.eos_id]
    return torch.tensor(ids, dtype=torch.long)


def heldout_windows(stream: torch.Tensor, seq_len: int, n: int) -> torch.Tensor:
    """n evenly spaced, non-overlapping windows [n, seq_len + 1] of a token stream."""
    L = seq_len + 1
    available = len(stream) // L
    if available < 1:
        raise ValueError(f"held-out split has {len(stream)} tokens, fewer than one window of {L}; use a larger corpus")
    picks = torch.linspace(0, available - 1, min(n, available)).round().long()
    return torch.stack([stream[i * L : (i + 1) * L] for i in picks.tolist()])


class TrainingData:
    """Training rows from the train split: a pure function of (seed, step); see the module docstring."""

    def __init__(
        self,
        tok: Tokenizer,
        fmt: ModelFormat,
        files: Sequence[SourceFile],
        *,
        seq_len: int,
        batch_size: int,
        fim_rate: float,
        summary_rate: float,
        seed: int,
        stream: torch.Tensor | None = None,
        summary_context_rate: float = 0.3,
        context_rate: float = 0.0,
        middle_weight: float = 1.0,
    ):
        self.tok, self.fmt, self.files = tok, fmt, list(files)
        self.seq_len, self.batch_size = seq_len, batch_size
        self.fim_rate, self.summary_rate, self.seed = fim_rate, summary_rate, seed
        self.summary_context_rate = summary_context_rate  # share of Python FIM rows with a summarized prefix
        self.context_rate = context_rate  # share of FIM rows with other files of the folder before the file
        self.middle_weight = middle_weight  # loss weight of a FIM middle's tokens and its end-of-text
        self.stream = token_stream(fmt, tok, files) if stream is None else stream
        if len(self.stream) <= seq_len + 1:
            raise ValueError(
                f"train split has {len(self.stream)} tokens; it needs more than seq_len + 1 = {seq_len + 1}"
            )
        self._ends = list(_cumsum(len(f.text) for f in self.files))  # pick files in proportion to size
        self._python = [i for i, f in enumerate(self.files) if f.language == "python"]
        self._folders: dict[str, list[int]] = {}
        for i, f in enumerate(self.files):
            self._folders.setdefault(posixpath.dirname(f.path), []).append(i)

    def batch(self, step: int) -> torch.Tensor:
        """Rows [B, S+1] for this step; identical for the same (seed, step)."""
        return self.weighted(step)[0]

    def weighted(self, step: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The rows of `batch(step)` and each target position's loss weight [B, S] (the target
        of position t is row[t + 1]): `middle_weight` where the target is a FIM middle's token
        or its end-of-text, 1 elsewhere; None when `middle_weight` is 1."""
        rng = random.Random(f"{self.seed}:{step}")
        rows, spans = zip(*(self._row(rng) for _ in range(self.batch_size)), strict=True)
        ids = torch.tensor(rows, dtype=torch.long)
        if self.middle_weight == 1.0:
            return ids, None
        weights = torch.ones(ids.shape[0], ids.shape[1] - 1)
        for r, row_spans in enumerate(spans):
            for a, b in row_spans:
                weights[r, a - 1 : b - 1] = self.middle_weight
        return ids, weights

    def _row(self, rng: random.Random) -> tuple[list[int], list[tuple[int, int]]]:
        """One row's ids and its FIM middles' [start, end) positions in it."""
        L = self.seq_len + 1
        u = rng.random()
        fim = self._fim if self.fmt.fim is not None else None
        make = fim if u < self.fim_rate else self._summary if u < self.fim_rate + self.summary_rate else None
        ids: list[int] = []
        spans: list[tuple[int, int]] = []
        while make is not None:
            made = make(rng)
            if made is None or len(ids) + len(made[0]) > L:
                break
            ex, middle = made
            ids += ex
            if middle:
                spans.append((len(ids) - middle, len(ids)))
        start = rng.randrange(len(self.stream) - (L - len(ids)) + 1)
        return ids + self.stream[start : start + L - len(ids)].tolist(), spans

    def _chunk(self, rng: random.Random, file_ids: Sequence[int] | None, max_chars: int) -> tuple[SourceFile, str]:
        """Whole lines of one file, about max_chars long at most, from a random line."""
        if file_ids is None:
            f = self.files[bisect.bisect_right(self._ends, rng.randrange(self._ends[-1]))]
        else:
            f = self.files[rng.choice(file_ids)]
        lines = f.text.splitlines(keepends=True)
        first = rng.randrange(len(lines))
        out, n = [], 0
        for line in lines[first:]:
            if out and n + len(line) > max_chars:
                break
            out.append(line)
            n += len(line)
        return f, "".join(out)[: max_chars * 2]

    def _fim(self, rng: random.Random) -> tuple[list[int], int] | None:
        """One FIM example and how many of its last tokens are the middle and its end-of-text."""
        f, text = self._chunk(rng, None, rng.randint(self.seq_len, 3 * self.seq_len))
        if len(text) < 2:
            return None
        a, b = fim_span(text, rng)
        path = f.path if rng.random() < 0.5 else None
        prefix = text[:a]
        if f.language == "python" and rng.random() < self.summary_context_rate:
            prefix = summarized_prefix(prefix, rng, self.fmt.summary)
        ids = fim_example_ids(self.fmt, self.tok, prefix, text[a:b], text[b:], path=path)
        if len(ids) > self.seq_len + 1:
            return None
        if self.context_rate and rng.random() < self.context_rate:
            context = self._context(rng, f, self.seq_len + 1 - len(ids))
            if context:
                ids = fim_example_ids(self.fmt, self.tok, prefix, text[a:b], text[b:], path=path, context=context)
        return ids, len(encode(self.tok, text[a:b])) + 1

    def _context(self, rng: random.Random, f: SourceFile, room: int) -> list[int]:
        """Parts of one or two other files of `f`'s folder, as serving lays out repository context
        (context_block_ids, the first one picked right before the file), within `room` tokens;
        [] when the folder has no other file or nothing fits."""
        siblings = [i for i in self._folders.get(posixpath.dirname(f.path), ()) if self.files[i].path != f.path]
        if not siblings or room < 32:
            return []
        blocks: list[list[int]] = []
        for i in rng.sample(siblings, min(len(siblings), rng.choice((1, 1, 2)))):
            other, text = self._chunk(rng, [i], rng.randint(self.seq_len // 4, self.seq_len))
            ids = context_block_ids(self.fmt, self.tok, other.path, text.rstrip("\n"))
            if len(ids) > room:
                break
            blocks.append(ids)
            room -= len(ids)
        return [t for ids in reversed(blocks) for t in ids]

    def _summary(self, rng: random.Random) -> tuple[list[int], int] | None:
        """One summary example (0: no middle in it), or a FIM one where no Python file is."""
        if not self._python:
            return self._fim(rng) if self.fmt.fim is not None else None
        for _ in range(4):  # chunks inside one function body summarize to nothing: try another
            _, text = self._chunk(rng, self._python, rng.randint(self.seq_len, 2 * self.seq_len))
            summary = summarize_python(text)
            if summary:
                ids = summary_example_ids(self.fmt, self.tok, text, summary)
                return (ids, 0) if len(ids) <= self.seq_len + 1 else None
        return None


def fim_span(text: str, rng: random.Random) -> tuple[int, int]:
    """Where the middle of a FIM example goes, [a, b).

    Mostly what an editor asks for, as a held-out site (learner.judge) and an editor's request
    look: the cursor inside a line of code after its indentation, and the middle its rest (45%) or its
    rest and up to three more lines (20%), never the newline after it, so the suffix starts
    with "\\n" as it does while a user types at the end of a line. A cursor at the end of the
    line gives an empty middle: the model learns to write end-of-text at once. The other 35%
    end anywhere after a random cursor, as in the FIM paper: long middles are what teach a small
    model to read the suffix.
    """
    u = rng.random()
    lines, pos = [], 0  # (start, end) of each line with code; end: its newline, or the text's end
    for piece in text.split("\n") if u < 0.65 else ():
        if piece.strip():
            lines.append((pos, pos + len(piece)))
        pos += len(piece) + 1
    if not lines:
        a = rng.randrange(len(text))
        return a, rng.randint(a + 1, len(text))
    line, end = rng.choice(lines)
    indent = end - len(text[line:end].lstrip())
    a = rng.randint(indent, end)
    b = end
    for _ in range(rng.randint(1, 3) if u >= 0.45 else 0):
        nl = text.find("\n", b + 1)
        b = len(text) if nl < 0 else nl
    return a, b


def summarized_prefix(prefix: str, rng: random.Random, markers: SummaryFormat) -> str:
    """The prefix with its older lines replaced by their summary between the markers.

    This is how serving shows a long file (learner/prompts.py): older chunks as
    `<open>summary<close>`, then the recent code verbatim. Training on it teaches the model to
    read summaries in place of the code they stand for. The markers' text encodes to their
    tokens (Flywheel's special tokens) or is the plain-text form.
    """
    lines = prefix.splitlines(keepends=True)
    if len(lines) < 4:
        return prefix
    k = rng.randint(1, len(lines) // 2)
    summary = summarize_python("".join(lines[:k]))
    if not summary:
        return prefix
    return f"{markers.open_text}{summary}{markers.close_text}" + "".join(lines[k:])


def _cumsum(xs):
    total = 0
    for x in xs:
        total += x
        yield total
