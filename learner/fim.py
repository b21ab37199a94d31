"""Fill-in-the-middle prompts in the model's own template (learner.formats): the one definition
that pretraining trains on and serving prompts with.

    prompt  = bos + layout(header, encode(prefix), encode(suffix))
    example = prompt + encode(middle) + [eos]

For the Qwen template (and Flywheel's own tokenizer, which has the same tokens):

    [<|file_sep|> path \\n] <|fim_prefix|> prefix <|fim_suffix|> suffix <|fim_middle|>

and for the suffix-first `qwen-spm`, which Flywheel's own base is pretrained in:

    [<|file_sep|> path \\n] <|fim_suffix|> suffix <|fim_prefix|> prefix

The model writes the middle and ends it with an EOS token, where generation stops. The header
carries the file path (and repository) the way the family was trained: a `<|file_sep|>` line
before the FIM tokens for Qwen and StarCoder 2, a `# path` comment at the start of the prefix
for DeepSeek-Coder, nothing for Codestral. It is optional: a prompt without it is still in the
trained format (pretraining adds it to half of its FIM examples). Other files of the repository
(an editor's snippets) go before the current file's header (`context_block_ids`).

Everything is encoded without the tokenizer's own special tokens, so a Llama-style tokenizer's
`<s>` appears once, at the start (ModelFormat.bos_ids), never in the middle of a prompt.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer

from learner.formats import FimIds, ModelFormat


def encode(tok: Tokenizer, text: str) -> list[int]:
    """Token ids of `text` with nothing added around it."""
    return tok.encode(text, add_special_tokens=False).ids if text else []


def _fim(fmt: ModelFormat) -> FimIds:
    if fmt.fim is None:
        raise ValueError("this model has no fill-in-the-middle tokens: it takes prefix-only prompts")
    return fmt.fim


def fim_header_ids(
    fmt: ModelFormat,
    tok: Tokenizer,
    *,
    path: str | None = None,
    repo: str | None = None,
    context: Sequence[int] = (),
) -> list[int]:
    """The file's path (and repository) in the template's own way, after `context` (other files,
    already laid out by `context_block_ids`); [] when none is known or the template has no place
    for them."""
    f = _fim(fmt)
    ids: list[int] = []
    if f.template.path_comment:
        return [*context, *(encode(tok, f"# {path}\n") if path else [])]
    if repo and f.repo_name is not None:
        ids += [f.repo_name, *encode(tok, f"{repo}\n")]
    ids += context
    if path and f.file_sep is not None:
        ids += [f.file_sep, *encode(tok, f"{path}\n")]
    return ids


def context_block_ids(fmt: ModelFormat, tok: Tokenizer, path: str, text: str, *, comment: str = "#") -> list[int]:
    """One other file of the repository, as the prompt carries it before the current file: a
    `<|file_sep|>path` block where the template has file separators (Qwen's and StarCoder 2's
    repository-level format), else the text under a commented header line (`# path`), as
    DeepSeek-Coder's repository-level data starts each file."""
    f = fmt.fim
    if f is not None and f.file_sep is not None:
        return [f.file_sep, *encode(tok, f"{path}\n{text}\n")]
    return encode(tok, f"{comment} {path}\n{text}\n")


def fim_layout(fmt: ModelFormat, header: list[int], prefix: list[int], suffix: list[int]) -> list[int]:
    """The template's layout over already-encoded parts (a prefix may hold summary blocks)."""
    f = _fim(fmt)
    bos = list(fmt.bos_ids)
    if f.template.suffix_first:
        if f.template.file_sep:  # repository layout: the files come first, the current one last
            return [*bos, *header, f.suffix, *suffix, f.prefix, *prefix]
        return [*bos, f.suffix, *suffix, f.prefix, *header, *prefix]
    middle = [f.middle] if f.middle is not None else []
    if f.template.path_comment:  # the header is the first line of the prefix
        return [*bos, f.prefix, *header, *prefix, f.suffix, *suffix, *middle]
    return [*bos, *header, f.prefix, *prefix, f.suffix, *suffix, *middle]


def fim_prompt_ids(
    fmt: ModelFormat,
    tok: Tokenizer,
    prefix: str,
    suffix: str,
    *,
    path: str | None = None,
    repo: str | None = None,
    context: Sequence[int] = (),
) -> list[int]:
    """Token ids of a FIM prompt; the model continues with the middle, then an EOS token.
    `context`: other files of the repository, laid out by `context_block_ids`."""
    header = fim_header_ids(fmt, tok, path=path, repo=repo, context=context)
    return fim_layout(fmt, header, encode(tok, prefix), encode(tok, suffix))


def fim_example_ids(
    fmt: ModelFormat,
    tok: Tokenizer,
    prefix: str,
    middle: str,
    suffix: str,
    *,
    path: str | None = None,
    context: Sequence[int] = (),
) -> list[int]:
    """One training example: the prompt, the middle, end of text."""
    return fim_prompt_ids(fmt, tok, prefix, suffix, path=path, context=context) + encode(tok, middle) + [fmt.eos_id]


def plain_prompt_ids(fmt: ModelFormat, tok: Tokenizer, text: str) -> list[int]:
    """A left-to-right prompt: bos and `text`. An empty one starts a document: bos, or the
    document-ending token where the tokenizer adds no bos (as pretraining joins documents)."""
    return list(fmt.bos_ids) + encode(tok, text) or [fmt.eos_id]


def prefix_tail(fmt: ModelFormat, tok: Tokenizer, prompt_ids: Sequence[int], tokens: int = 256) -> str:
    """The text of the last `tokens` of the prompt's prefix (the code before the cursor), read
    back from a prompt laid out by `fim_layout` or `plain_prompt_ids`: what the learner knows of
    a served request's cursor (learner.show.cursor_line reads its last line). The prefix ends
    where the suffix token follows it (prefix first), or with the prompt (suffix first, or a
    prefix-only prompt), and begins after the prefix token."""
    ids = list(prompt_ids)
    end = len(ids)
    f = fmt.fim
    if f is not None and f.prefix in ids:
        if not f.template.suffix_first and f.suffix in ids:
            end = len(ids) - 1 - ids[::-1].index(f.suffix)
        head = ids[:end]
        start = len(head) - head[::-1].index(f.prefix) if f.prefix in head else 0
    else:
        start = len(fmt.bos_ids) if ids[: len(fmt.bos_ids)] == list(fmt.bos_ids) else 0
    return tok.decode(ids[max(start, end - tokens) : end])
