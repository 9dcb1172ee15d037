"""Prompt -> a TokenizedRequest: validated token ids and sampling parameters.

Made once, at the edge (the gateway; the offline engine's own API for its callers): the
tiers carry it and the engine takes it, checking only what costs nothing (its length
against the context). A request the engine would refuse is refused at the edge, before
any work."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cluster.engine.sampling_params import SamplingParams
from cluster.errors import InvalidRequestError
from cluster.model.checkpoints import open_checkpoint
from cluster.model.families import parse_arch, resolve_max_model_len
from cluster.text.tokenizer import Tokenizer

Prompt = str | Sequence[int]


@dataclass(frozen=True)
class TokenizedRequest:
    """A request's prompt token ids and sampling parameters, validated: every id in the
    vocabulary, prompt + max_tokens within the context. Made by InputProcessor.process."""

    prompt_token_ids: list[int]
    params: SamplingParams


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_model_len: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len

    @classmethod
    def from_model(cls, model: str | Path, max_model_len: int | None = None) -> InputProcessor:
        """Without loading weights: reads the checkpoint's config and tokenizer only."""
        checkpoint = open_checkpoint(model)
        arch = parse_arch(checkpoint.config())
        return cls(checkpoint.tokenizer(), arch.vocab_size, resolve_max_model_len(max_model_len, arch))

    def tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty")
            return self.tokenizer.encode(prompt)
        ids = list(prompt)
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size for t in ids):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {self.vocab_size})")
        return ids

    def validate_length(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        if num_prompt_tokens == 0:
            raise InvalidRequestError("prompt is empty")
        if num_prompt_tokens + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the prompt has "
                f"{num_prompt_tokens} tokens and max_tokens is {params.max_tokens}; "
                "shorten the prompt or lower max_tokens"
            )

    def process(self, prompt: Prompt, params: SamplingParams) -> TokenizedRequest:
        if not isinstance(prompt, str):  # a list too long for the model is refused before its ids are checked
            self.validate_length(len(prompt), params)
        ids = self.tokenize(prompt)
        self.validate_length(len(ids), params)
        return TokenizedRequest(ids, params)
