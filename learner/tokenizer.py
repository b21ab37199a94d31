"""Byte-level BPE tokenizer for source code.

Trained with Hugging Face `tokenizers` and saved as `tokenizer.json` plus a
`tokenizer_config.json`, so that `transformers.AutoTokenizer` and vLLM load the folder
unchanged. Every byte is in the base alphabet, so any text (tabs, CRLF, emoji, invalid
identifiers, trailing newlines) encodes and decodes back exactly: there is no normalizer,
no added prefix space and no post-processor that adds tokens.

The special tokens take the first ids, in the order of `SPECIAL_TOKENS`. Their names are
Qwen's (and Qwen2.5-Coder's fill-in-the-middle format is the one pretraining teaches), so
learner.formats reads this tokenizer exactly as it reads a Qwen model's:

    <|endoftext|>     end of document; also the pad token
    <|fim_prefix|>    fill-in-the-middle: the code before the cursor follows
    <|fim_suffix|>    the code after the cursor follows
    <|fim_middle|>    the model writes the middle from here
    <|repo_name|>     the repository name follows (repo-level context)
    <|file_sep|>      a file's path follows, then its code
    <|summary_start|> / <|summary_end|>  bracket a self-summary of earlier context (Flywheel's own)

Nothing looks them up by id: prompts and stop tokens come from learner.formats, by name.
"""

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

EOS = "<|endoftext|>"
FIM_PREFIX = "<|fim_prefix|>"
FIM_SUFFIX = "<|fim_suffix|>"
FIM_MIDDLE = "<|fim_middle|>"
REPO_NAME = "<|repo_name|>"
FILE_SEP = "<|file_sep|>"
SUMMARY_START = "<|summary_start|>"
SUMMARY_END = "<|summary_end|>"
SPECIAL_TOKENS = [EOS, FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE, REPO_NAME, FILE_SEP, SUMMARY_START, SUMMARY_END]

# The Qwen2 / GPT-4 split pattern: contractions, words with one leading non-letter,
# digits one at a time, punctuation runs, and newlines kept apart from the indentation
# that follows them, so an indent level becomes a token of its own.
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
DEFAULT_MODEL_MAX_LENGTH = 2048


def build_untrained_tokenizer() -> Tokenizer:
    """The tokenizer pipeline with an empty BPE model (what `train_tokenizer` fills)."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = None
    return tok


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE on `texts`; the result may be smaller than `vocab_size`
    when the corpus runs out of merges."""
    min_size = 256 + len(SPECIAL_TOKENS)
    if vocab_size < min_size:
        raise ValueError(f"vocab_size must be at least {min_size} (256 bytes + special tokens)")
    tok = build_untrained_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    return tok


def tokenizer_config(model_max_length: int = DEFAULT_MODEL_MAX_LENGTH, *, fim: str | None = None) -> dict:
    """The `tokenizer_config.json` that makes `AutoTokenizer` load `tokenizer.json` as is;
    `fim`: the FIM template the model was trained in (learner.formats reads it back as
    `fim_template`), None to leave it to the vocabulary."""
    return ({"fim_template": fim} if fim else {}) | {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS,
        "pad_token": EOS,
        "unk_token": None,
        "additional_special_tokens": SPECIAL_TOKENS[1:],
        "model_max_length": model_max_length,
        "add_prefix_space": False,
        # Decoding must give the source text back byte for byte.
        "clean_up_tokenization_spaces": False,
    }


def special_token_ids(tok: Tokenizer) -> dict[str, int]:
    """The token ids an exported config.json and generation_config.json name: `<|endoftext|>`
    ends a document and doubles as bos and pad."""
    eos = tok.token_to_id(EOS)
    if eos is None:
        raise ValueError(f"the tokenizer has no {EOS} token")
    return {"bos_token_id": eos, "eos_token_id": eos, "pad_token_id": eos}


def save_tokenizer(
    tok: Tokenizer, folder: str | Path, *, model_max_length: int = DEFAULT_MODEL_MAX_LENGTH, fim: str | None = None
) -> None:
    """Write `tokenizer.json` and `tokenizer_config.json` (see tokenizer_config) into `folder`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = tokenizer_config(model_max_length, fim=fim)
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def load_tokenizer(folder: str | Path) -> Tokenizer:
    """Read the `tokenizer.json` that `save_tokenizer` wrote."""
    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"no tokenizer.json in {folder}; write one with save_tokenizer()")
    return Tokenizer.from_file(str(path))
