"""Fill-in-the-middle prompts in PSM order (prefix, suffix, middle): the one definition that
pretraining trains on and serving prompts with.

    prompt  = [<|fim_prefix|>] + encode(header + prefix) + [<|fim_suffix|>] + encode(suffix) + [<|fim_middle|>]
    example = prompt + encode(middle) + [<|endoftext|>]

The model writes the middle after `<|fim_middle|>` and ends it with `<|endoftext|>`
(EOS_ID), where generation stops. `header` is optional: one line naming the language and
the file, `fim_header(language="python", path="pkg/mod.py")` -> "# python: pkg/mod.py\\n".
It sits at the start of the prefix, so a prompt without it is still in the trained format
(pretraining adds it to half of its FIM examples).
"""

from __future__ import annotations

from tokenizers import Tokenizer

from learner.tokenizer import EOS_ID, FIM_MIDDLE_ID, FIM_PREFIX_ID, FIM_SUFFIX_ID


def fim_header(*, language: str | None = None, path: str | None = None) -> str:
    """ "# {language}: {path}\\n", "# {language}\\n", "# {path}\\n", or "" when neither is known."""
    if language and path:
        return f"# {language}: {path}\n"
    if language or path:
        return f"# {language or path}\n"
    return ""


def fim_prompt_ids(tok: Tokenizer, prefix: str, suffix: str, header: str = "") -> list[int]:
    """Token ids of a FIM prompt; the model continues with the middle, then EOS_ID."""
    if header and not header.endswith("\n"):
        header += "\n"
    return (
        [FIM_PREFIX_ID] + tok.encode(header + prefix).ids + [FIM_SUFFIX_ID] + tok.encode(suffix).ids + [FIM_MIDDLE_ID]
    )


def fim_example_ids(tok: Tokenizer, prefix: str, middle: str, suffix: str, header: str = "") -> list[int]:
    """One training example: the prompt, the middle, end of text."""
    return fim_prompt_ids(tok, prefix, suffix, header) + tok.encode(middle).ids + [EOS_ID]
