"""A GGUF file's tokenizer, rebuilt from its metadata as a `tokenizers` pipeline.

A GGUF carries no tokenizer.json: llama.cpp stores the vocabulary (`tokenizer.ggml.tokens`,
`token_type`, `scores`, `merges`) and names the splitting rules (`tokenizer.ggml.pre`).
Two vocabulary kinds cover the supported families:

    gpt2   byte-level BPE (Llama 3, Qwen2/3, SmolLM): the file's merges; the text is split
           by llama.cpp's regexes for `pre`, then mapped to byte symbols
    llama  SentencePiece BPE (Llama 2, Mistral): merges recovered from the token scores,
           "▁" for spaces, a space prefix per text run, bytes as <0xNN> tokens

The regexes are llama.cpp's own (llama-vocab.cpp), so text splits exactly as llama.cpp
splits it for the file; an unknown `pre` is refused rather than guessed. Control tokens
(token type 3) become special tokens, user-defined ones (4) plain added tokens; both are
matched whole in the text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from cluster.config import GGUF_SUFFIX
from cluster.model.gguf_reader import MappedGGUFReader
from cluster.text.tokenizer import Tokenizer

NORMAL, CONTROL, USER_DEFINED, BYTE = 1, 3, 4, 6  # llama.cpp's token types

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class PreTokenizerRule:
    splits: tuple[str, ...]  # applied in order, each piece kept ("isolated")
    ignore_merges: bool = False  # a piece that is itself a token is not merged (Llama 3)
    nfc: bool = False  # NFC-normalize first (Qwen2)


# `tokenizer.ggml.pre` -> how llama.cpp splits the text before BPE.
PRE_TOKENIZERS = {
    "default": PreTokenizerRule((_GPT2,)),
    "gpt2": PreTokenizerRule((_GPT2,)),
    "smollm": PreTokenizerRule((r"\p{N}", _GPT2)),
    "starcoder": PreTokenizerRule((r"\p{N}", _GPT2)),
    "llama-bpe": PreTokenizerRule((_LLAMA3,), ignore_merges=True),
    "llama3": PreTokenizerRule((_LLAMA3,), ignore_merges=True),
    "smaug-bpe": PreTokenizerRule((_LLAMA3,)),
    "qwen2": PreTokenizerRule((_QWEN2,), nfc=True),
    "deepseek-r1-qwen": PreTokenizerRule((_QWEN2,), nfc=True),
    "tekken": PreTokenizerRule((_TEKKEN,)),
}


class GGUFTokenizerError(ValueError):
    pass


@dataclass(frozen=True)
class GGUFVocab:
    """The `tokenizer.*` metadata of a GGUF file."""

    model: str  # tokenizer.ggml.model
    pre: str | None
    tokens: Sequence[str]
    token_types: Sequence[int]
    scores: Sequence[float] | None
    merges: Sequence[str] | None
    bos_token_id: int | None
    eos_token_id: int | None
    unk_token_id: int | None
    pad_token_id: int | None
    add_bos_token: bool | None
    add_space_prefix: bool | None
    chat_template: str | None


def read_vocab(reader: MappedGGUFReader) -> GGUFVocab:
    def meta(key: str):
        field = reader.fields.get(key)
        return None if field is None else field.contents()

    return GGUFVocab(
        model=meta("tokenizer.ggml.model"),
        pre=meta("tokenizer.ggml.pre"),
        tokens=meta("tokenizer.ggml.tokens") or [],
        token_types=meta("tokenizer.ggml.token_type") or [],
        scores=meta("tokenizer.ggml.scores"),
        merges=meta("tokenizer.ggml.merges"),
        bos_token_id=meta("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta("tokenizer.ggml.eos_token_id"),
        unk_token_id=meta("tokenizer.ggml.unknown_token_id"),
        pad_token_id=meta("tokenizer.ggml.padding_token_id"),
        add_bos_token=meta("tokenizer.ggml.add_bos_token"),
        add_space_prefix=meta("tokenizer.ggml.add_space_prefix"),
        chat_template=meta("tokenizer.chat_template"),
    )


def load_tokenizer(model: str | Path) -> Tokenizer:
    """The tokenizer of a Hugging Face model directory or a .gguf file, without loading
    weights (or torch): for clients such as the serving benchmark."""
    path = Path(model)
    if path.suffix != GGUF_SUFFIX:
        return Tokenizer.from_pretrained(path)
    return build_tokenizer(read_vocab(MappedGGUFReader(path)))


def build_tokenizer(vocab: GGUFVocab) -> Tokenizer:
    if not vocab.tokens:
        raise GGUFTokenizerError("no tokenizer in the file (tokenizer.ggml.tokens is missing)")
    if vocab.model == "gpt2":
        backend = _byte_level_bpe(vocab)
        add_bos_default = False
    elif vocab.model == "llama":
        backend = _sentencepiece_bpe(vocab)
        add_bos_default = True  # llama.cpp's default for SentencePiece vocabularies
    else:
        raise GGUFTokenizerError(f"tokenizer model {vocab.model!r} is not supported; supported: gpt2, llama")
    _add_special_tokens(backend, vocab)

    def token(i: int | None) -> str | None:
        return vocab.tokens[i] if i is not None and 0 <= i < len(vocab.tokens) else None

    add_bos = vocab.add_bos_token if vocab.add_bos_token is not None else add_bos_default
    return Tokenizer(
        backend,
        bos_token=token(vocab.bos_token_id),
        eos_token=token(vocab.eos_token_id),
        pad_token=token(vocab.pad_token_id),
        add_bos_token=add_bos and vocab.bos_token_id is not None,
        chat_template=vocab.chat_template,
    )


def _byte_level_bpe(vocab: GGUFVocab) -> tokenizers.Tokenizer:
    pre = vocab.pre or "default"
    rule = PRE_TOKENIZERS.get(pre)
    if rule is None:
        raise GGUFTokenizerError(f"pre-tokenizer {pre!r} is not supported; supported: {', '.join(sorted(PRE_TOKENIZERS))}")
    if vocab.merges is None:
        raise GGUFTokenizerError("a gpt2 (byte-level BPE) vocabulary needs tokenizer.ggml.merges")
    merges = [tuple(m.split(" ", 1)) for m in vocab.merges]
    ids = {t: i for i, t in enumerate(vocab.tokens)}
    backend = tokenizers.Tokenizer(models.BPE(vocab=ids, merges=merges, ignore_merges=rule.ignore_merges))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in rule.splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    if rule.nfc:
        backend.normalizer = normalizers.NFC()
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(vocab: GGUFVocab) -> tokenizers.Tokenizer:
    if vocab.scores is None:
        raise GGUFTokenizerError("a llama (SentencePiece) vocabulary needs tokenizer.ggml.scores")
    ids = {t: i for i, t in enumerate(vocab.tokens)}
    unk = vocab.tokens[vocab.unk_token_id] if vocab.unk_token_id is not None else None
    model = models.BPE(vocab=ids, merges=_merges_from_scores(vocab), unk_token=unk, byte_fallback=True, fuse_unk=True)
    backend = tokenizers.Tokenizer(model)
    prefix = vocab.add_space_prefix is not False
    # llama.cpp prefixes a space to every text run (after each special token too).
    steps = ([normalizers.Prepend("▁")] if prefix else []) + [normalizers.Replace(" ", "▁")]
    backend.normalizer = normalizers.Sequence(steps)
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if prefix else [])
    )
    return backend


def _merges_from_scores(vocab: GGUFVocab) -> list[tuple[str, str]]:
    """SentencePiece BPE stores no merges: a token is made by merging two tokens that
    spell it, and tokens with higher scores are merged first."""
    ids = {t: i for i, t in enumerate(vocab.tokens)}
    ranked = []
    for token, kind, score in zip(vocab.tokens, vocab.token_types, vocab.scores):
        if kind != NORMAL or len(token) < 2:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ids and right in ids:
                ranked.append((-score, ids[left], ids[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _add_special_tokens(backend: tokenizers.Tokenizer, vocab: GGUFVocab) -> None:
    control = [t for t, k in zip(vocab.tokens, vocab.token_types) if k == CONTROL]
    user = [t for t, k in zip(vocab.tokens, vocab.token_types) if k == USER_DEFINED]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
