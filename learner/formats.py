"""Tokens by name, prompts by family: how to prompt a model, read from the model's own files.

A `ModelFormat` is what serving, the learner and pretraining need to know about a model's
tokens, and nothing here is a fixed id:

    eos_ids     generation stops at any of them: generation_config.json's `eos_token_id` (an
                id or a list), then config.json's, then tokenizer_config.json's `eos_token`;
                the first one also ends a document in training rows
    pad_id      generation_config / config `pad_token_id`, tokenizer_config `pad_token`, else eos
    bos_ids     what the tokenizer's own post-processor puts before a text (Llama-style `<s>`;
                none for Qwen): prompts are encoded without special tokens and start with these
    window      config.json's `max_position_embeddings`
    fim         the fill-in-the-middle template (below) with its tokens' ids; None when the
                vocabulary has none: such a model serves prefix-only completions
    summary     how self-summaries are marked: Flywheel's `<|summary_start|>`/`<|summary_end|>`
                tokens when the vocabulary has them, else plain text a code model reads as prose

FIM templates, a small registry detected from the vocabulary (the first whose tokens are all
there) or chosen by name (`model.fim`):

    qwen       [<|repo_name|>repo\\n] [<|file_sep|>path\\n] <|fim_prefix|>prefix<|fim_suffix|>suffix<|fim_middle|>
               Qwen2.5-Coder / Qwen3-Coder, and Flywheel's own tokenizer (same names, same layout)
    starcoder  [<repo_name>repo] [<file_sep>path\\n] <fim_prefix>prefix<fim_suffix>suffix<fim_middle>   (StarCoder 2)
    deepseek   <｜fim▁begin｜>[# path\\n]prefix<｜fim▁hole｜>suffix<｜fim▁end｜>   (DeepSeek-Coder: its
               repo-level data starts each file with a path comment)
    codestral  [SUFFIX]suffix[PREFIX]prefix   (suffix first; the model writes the middle next)
    qwen-spm   [<|repo_name|>repo\\n] [<|file_sep|>path\\n] <|fim_suffix|>suffix<|fim_prefix|>prefix
               Qwen's tokens, suffix first (SPM): Flywheel's own base since recipe 5. The prefix
               ends the prompt, so writing the middle is continuing it, the skill a small model
               learns first; in PSM the suffix stands between the prefix and the middle.

A model folder may name its template: `fim_template` in tokenizer_config.json (Flywheel's own
base does), which "auto" takes before looking at the vocabulary.

The file path goes in the way the family was trained; a family with no known convention
(Codestral) gets none. The model ends the middle with an EOS token; the template's own tokens
(`<|file_sep|>`, `<|fim_pad|>`, ...) also end it when a model writes them.

`ModelFormat.of` is pure (a tokenizer and three dicts); `read_format` reads them from a folder.

Editor clients that render the FIM template themselves (Continue, Twinny) send the rendered
string as a plain prompt; `parse_rendered_fim` reads it back into prefix, suffix, the file's
path and the other files it carries, so the server can prompt its own model its own way.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from learner.tokenizer import SUMMARY_END, SUMMARY_START, load_tokenizer, special_token_ids, tokenizer_config

CONFIG, GENERATION_CONFIG, TOKENIZER_CONFIG = "config.json", "generation_config.json", "tokenizer_config.json"

TEXT_SUMMARY_OPEN = "\n[summary of the code above: its imports, classes and signatures]\n"
TEXT_SUMMARY_CLOSE = "\n[end of summary]\n"
"""Plain-text markers of a self-summary, for a vocabulary without Flywheel's summary tokens.
Language-neutral prose rather than a comment, so they read the same in any file."""


@dataclass(frozen=True)
class FimTemplate:
    """A family's fill-in-the-middle layout, by token text."""

    name: str
    prefix: str
    suffix: str
    middle: str | None  # None: the model writes the middle right after the prompt (Codestral)
    suffix_first: bool = False  # SPM order: suffix token, suffix, prefix token, prefix
    file_sep: str | None = None  # the path goes `file_sep path \n` before the FIM tokens
    repo_name: str | None = None  # the repository goes `repo_name repo \n` before the files
    path_comment: bool = False  # the path goes `# path \n` at the start of the prefix
    stops: tuple[str, ...] = ()  # further tokens that end a middle when the model writes them


QWEN_STOPS = ("<|fim_pad|>", "<|file_sep|>", "<|repo_name|>", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")

FIM_TEMPLATES: tuple[FimTemplate, ...] = (
    FimTemplate(
        "qwen",
        "<|fim_prefix|>",
        "<|fim_suffix|>",
        "<|fim_middle|>",
        file_sep="<|file_sep|>",
        repo_name="<|repo_name|>",
        stops=QWEN_STOPS,
    ),
    FimTemplate(
        "starcoder",
        "<fim_prefix>",
        "<fim_suffix>",
        "<fim_middle>",
        file_sep="<file_sep>",
        repo_name="<repo_name>",
        stops=("<fim_pad>", "<file_sep>", "<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    ),
    FimTemplate("deepseek", "<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>", path_comment=True),
    FimTemplate("codestral", "[PREFIX]", "[SUFFIX]", None, suffix_first=True),
    # Qwen's tokens in suffix-prefix-middle order: the prefix ends the prompt, so the middle
    # continues it directly. Flywheel's own base is pretrained in it (pretrain.fim_template) and
    # says so in its tokenizer_config.json; the vocabulary alone never selects it.
    FimTemplate(
        "qwen-spm",
        "<|fim_prefix|>",
        "<|fim_suffix|>",
        None,
        suffix_first=True,
        file_sep="<|file_sep|>",
        repo_name="<|repo_name|>",
        stops=QWEN_STOPS,
    ),
)
FIM_NAMES = tuple(t.name for t in FIM_TEMPLATES)

CLIENT_TEMPLATES: tuple[FimTemplate, ...] = (
    *(t for t in FIM_TEMPLATES if t.name != "qwen-spm"),  # Flywheel's own: no client renders it
    # Code Llama's: no model family here has it, but Twinny and Continue render it by default.
    FimTemplate("codellama", "<PRE>", "<SUF>", "<MID>"),
)
"""Templates a client may have rendered a prompt in (parse_rendered_fim)."""


@dataclass(frozen=True)
class FimIds:
    """A FimTemplate resolved against a vocabulary."""

    template: FimTemplate
    prefix: int
    suffix: int
    middle: int | None
    file_sep: int | None  # None where the template has none or the vocabulary lacks it
    repo_name: int | None
    stop_ids: tuple[int, ...]

    @property
    def name(self) -> str:
        return self.template.name


@dataclass(frozen=True)
class SummaryFormat:
    """How a self-summary is marked in a prompt: `open_ids summary close_ids`. `tokens`: the
    markers are Flywheel's two special tokens; else plain text (TEXT_SUMMARY_*)."""

    tokens: bool
    open_ids: tuple[int, ...]
    close_ids: tuple[int, ...]
    open_text: str
    close_text: str

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Token ids that end a summary the model writes (the close token)."""
        return self.close_ids if self.tokens else ()

    @property
    def stop_text(self) -> str | None:
        """The text that ends a summary the model writes, when the markers are plain text."""
        return None if self.tokens else self.close_text.strip("\n")


@dataclass(frozen=True)
class ModelFormat:
    """What prompting a model needs to know about its tokens (see the module docstring)."""

    eos_ids: tuple[int, ...]
    pad_id: int
    bos_ids: tuple[int, ...]
    window: int
    fim: FimIds | None
    summary: SummaryFormat

    @property
    def eos_id(self) -> int:
        """The token that ends a document in training rows (and an empty suggestion)."""
        return self.eos_ids[0]

    def describe(self) -> dict:
        """What /v1/health and the start log show."""
        return {
            "fim": self.fim.name if self.fim else None,
            "prefix_only": self.fim is None,
            "summary_markers": "tokens" if self.summary.tokens else "text",
            "eos_ids": list(self.eos_ids),
            "window": self.window,
        }

    @classmethod
    def of(
        cls,
        tok: Tokenizer,
        *,
        config: Mapping,
        generation_config: Mapping | None = None,
        tokenizer_config: Mapping | None = None,
        fim: str = "auto",
    ) -> ModelFormat:
        """The format of a model from its tokenizer and its three JSON files (as dicts).
        `fim`: "auto" (the template tokenizer_config's `fim_template` names, else detected
        from the vocabulary), a template name, or "none" (prefix-only).
        ValueError when the files name no end-of-sequence token, or a token the vocabulary lacks."""
        gen, tcfg = generation_config or {}, tokenizer_config or {}
        vocab = tok.get_vocab_size()

        def named(key: str) -> list[int]:
            text = _token_text(tcfg.get(key))
            if text is None:
                return []
            i = tok.token_to_id(text)
            if i is None:
                raise ValueError(f"{TOKENIZER_CONFIG} names {key} {text!r}, which tokenizer.json does not have")
            return [i]

        eos = _unique(_ids(gen.get("eos_token_id")) + _ids(config.get("eos_token_id")) + named("eos_token"))
        if not eos:
            raise ValueError(
                f"no end-of-sequence token: {GENERATION_CONFIG}, {CONFIG} and {TOKENIZER_CONFIG} name none "
                "(set eos_token_id in generation_config.json)"
            )
        pad = (_ids(gen.get("pad_token_id")) + _ids(config.get("pad_token_id")) + named("pad_token") + eos)[0]
        bad = [i for i in (*eos, pad) if not 0 <= i < max(vocab, int(config.get("vocab_size", 0)))]
        if bad:
            raise ValueError(f"special token ids {bad} are outside the vocabulary of {vocab} tokens")
        window = config.get("max_position_embeddings")
        if not isinstance(window, int) or window < 16:
            raise ValueError(f"{CONFIG} has no usable max_position_embeddings (got {window!r})")
        declared = tcfg.get("fim_template")
        if fim == "auto" and declared is not None:
            if declared not in FIM_NAMES:
                raise ValueError(f"{TOKENIZER_CONFIG} names an unknown fim_template {declared!r}")
            fim = declared
        return cls(
            eos_ids=tuple(eos),
            pad_id=pad,
            bos_ids=tuple(tok.encode("", add_special_tokens=True).ids),
            window=window,
            fim=resolve_fim(tok, fim),
            summary=summary_format(tok),
        )


def resolve_fim(tok: Tokenizer, choice: str = "auto") -> FimIds | None:
    """The FIM template `choice` names ("auto": the first whose tokens the vocabulary has;
    "none": no FIM) with its ids; ValueError when a named one does not fit the vocabulary."""
    if choice == "none":
        return None
    if choice != "auto" and choice not in FIM_NAMES:
        raise ValueError(f"unknown FIM template {choice!r}; choose auto, none or one of {', '.join(FIM_NAMES)}")
    for t in FIM_TEMPLATES:
        if choice not in ("auto", t.name):
            continue
        core = [tok.token_to_id(x) for x in (t.prefix, t.suffix, t.middle) if x is not None]
        if None in core:
            if choice == "auto":
                continue
            raise ValueError(f"the vocabulary lacks the {t.name} FIM tokens ({t.prefix}, {t.suffix}, {t.middle})")
        stops = _unique([i for s in t.stops if (i := tok.token_to_id(s)) is not None])
        return FimIds(
            t,
            tok.token_to_id(t.prefix),
            tok.token_to_id(t.suffix),
            tok.token_to_id(t.middle) if t.middle else None,
            tok.token_to_id(t.file_sep) if t.file_sep else None,
            tok.token_to_id(t.repo_name) if t.repo_name else None,
            tuple(stops),
        )
    return None


def summary_format(tok: Tokenizer) -> SummaryFormat:
    """Flywheel's summary tokens when the vocabulary has both, else the plain-text markers."""
    start, end = tok.token_to_id(SUMMARY_START), tok.token_to_id(SUMMARY_END)
    if start is not None and end is not None:
        return SummaryFormat(True, (start,), (end,), SUMMARY_START, SUMMARY_END)
    enc = lambda s: tuple(tok.encode(s, add_special_tokens=False).ids)  # noqa: E731
    return SummaryFormat(False, enc(TEXT_SUMMARY_OPEN), enc(TEXT_SUMMARY_CLOSE), TEXT_SUMMARY_OPEN, TEXT_SUMMARY_CLOSE)


@dataclass(frozen=True)
class RenderedFim:
    """A prompt a client rendered in a FIM template, read back (parse_rendered_fim)."""

    template: str
    prefix: str
    suffix: str
    path: str | None = None
    repo: str | None = None
    context: tuple[tuple[str, str], ...] = ()
    """Other files the prompt carried before the current one, as (path, text), in its order."""


def parse_rendered_fim(text: str) -> RenderedFim | None:
    """`text` read back as a FIM prompt of one of CLIENT_TEMPLATES, or None when it is not one.

    A prompt is read as rendered only when each of the template's markers occurs exactly once and
    in the template's order, so code that merely mentions a marker stays a plain prompt. Text after
    the middle marker (the start of the middle the client already wrote) ends the prefix. In
    Qwen's and StarCoder 2's layout, `<repo_name>` names the repository and each file separator
    starts `path\\ntext`: the last one is the current file (its text opens the prefix), the others
    are returned as context. Any other text before the prefix (a client's comment header) opens
    the prefix."""
    for t in CLIENT_TEMPLATES:
        markers = (t.suffix, t.prefix) if t.suffix_first else (t.prefix, t.suffix, *((t.middle,) if t.middle else ()))
        if any(text.count(m) != 1 for m in markers):
            continue
        where = [text.index(m) for m in markers]
        if where != sorted(where):
            continue
        first, second = where[0], where[1]
        between = text[first + len(markers[0]) : second]
        if t.suffix_first:
            head, suffix, prefix, tail = text[:first], between, text[second + len(markers[1]) :], ""
        else:
            end = where[2] if t.middle else len(text)
            head, prefix, suffix = text[:first], between, text[second + len(markers[1]) : end]
            tail = text[end + len(t.middle) :] if t.middle else ""
        if t.name == "codellama":  # `<PRE> prefix <SUF>suffix <MID>`: the spaces belong to the markers
            prefix = prefix.removeprefix(" ").removesuffix(" ")
            suffix = suffix.removesuffix(" ")
        repo = path = None
        context: list[tuple[str, str]] = []
        if t.repo_name and head.startswith(t.repo_name):
            head = head[len(t.repo_name) :]
            cut = min(i for i in (head.find("\n"), head.find(t.file_sep or "\n"), len(head)) if i >= 0)
            repo, head = head[:cut].strip() or None, head[cut:].removeprefix("\n")
        if t.file_sep and t.file_sep in head:
            free, *files = head.split(t.file_sep)
            *others, current = files
            for f in others:
                name, _, body = f.partition("\n")
                if name.strip() and body.strip():
                    context.append((name.strip(), body.removesuffix("\n")))
            name, newline, opening = current.partition("\n")
            path = name.strip() if newline else None
            head = free + (opening if newline else current)
        return RenderedFim(t.name, head + prefix + tail, suffix, path or None, repo, tuple(context))
    return None


def read_json(folder: Path, name: str) -> dict:
    """A JSON file of a model folder, {} when absent."""
    path = Path(folder) / name
    return json.loads(path.read_text()) if path.is_file() else {}


def read_format(folder: str | Path, *, fim: str = "auto") -> ModelFormat:
    """The ModelFormat of a Hugging Face model folder (see the module docstring)."""
    folder = Path(folder)
    return ModelFormat.of(
        load_tokenizer(folder),
        config=read_json(folder, CONFIG),
        generation_config=read_json(folder, GENERATION_CONFIG),
        tokenizer_config=read_json(folder, TOKENIZER_CONFIG),
        fim=fim,
    )


def own_format(tok: Tokenizer, window: int, *, fim: str | None = None) -> ModelFormat:
    """The format of a model with Flywheel's own tokenizer (learner.tokenizer), exactly as
    `read_format` reads its export (written with the same `fim` template name): what pretraining
    uses before there is a folder. None: the one the vocabulary has (qwen)."""
    ids = special_token_ids(tok)
    return ModelFormat.of(
        tok,
        config={"max_position_embeddings": window, **ids},
        generation_config=ids,
        tokenizer_config=tokenizer_config(window, fim=fim),
    )


def _ids(v) -> list[int]:
    if v is None:
        return []
    if isinstance(v, int) and not isinstance(v, bool):
        return [v]
    if isinstance(v, Sequence) and all(isinstance(i, int) for i in v):
        return list(v)
    raise ValueError(f"a token id must be an integer or a list of integers, got {v!r}")


def _token_text(v) -> str | None:
    """tokenizer_config's token entries are a string or {"content": ...}."""
    if isinstance(v, Mapping):
        v = v.get("content")
    return v if isinstance(v, str) and v else None


def _unique(ids: list[int]) -> list[int]:
    return list(dict.fromkeys(ids))
