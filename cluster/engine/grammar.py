"""Constrained decoding in the engine: compiled grammars and each request's matcher.

    GrammarCompiler.compile(spec)   once per distinct grammar, off the engine thread
                                    (AsyncEngine.prepare); LRU-cached
    GrammarCompiler.constraint(spec) a request's own matcher: a copy of the compiled one
    Constraint.fill(row)            the next token's allowed set, as a bitmask row
    Constraint.advance(tokens)      every accepted token, sampled here or replayed

A request's constraint lives in its engine's output state and sees every token the request
has, in order: tokens another worker streamed (`generated`, a migration) and a prefill
worker's first token are replayed into it, never sampled again. A token it refuses there
ends the request with an error, never an unconstrained continuation.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import llguidance
import numpy as np
import torch

from cluster.engine.structured_outputs import LIMITS, StructuredOutputs
from cluster.errors import InvalidRequestError
from cluster.text.tokenizer import Tokenizer

MAX_COMPILED = 256  # distinct grammars kept compiled per engine


def bitmask_words(vocab_size: int) -> int:
    """int32 words of one bitmask row: bit t of the row allows token t."""
    return (vocab_size + 31) // 32


class Constraint:
    """One request's grammar state (an llguidance matcher)."""

    def __init__(self, matcher: llguidance.LLMatcher, spec: StructuredOutputs):
        self._matcher = matcher
        self.spec = spec

    @property
    def done(self) -> bool:
        """The grammar is complete and nothing can extend it: the request stops here."""
        return self._matcher.is_stopped()

    def accepts(self, token_id: int) -> bool:
        return self._matcher.validate_tokens([token_id]) == 1

    def advance(self, token_ids: Sequence[int]) -> bool:
        """Consume tokens; False if the grammar refused one (the matcher is then broken)."""
        return self._matcher.consume_tokens(list(token_ids))

    def fill(self, row: torch.Tensor) -> None:
        """Write the allowed next tokens into `row`, a contiguous int32 CPU tensor."""
        self._matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())

    @property
    def error(self) -> str:
        return self._matcher.get_error()


class GrammarCompiler:
    """An engine's compiled grammars, for its tokenizer and vocabulary. Thread-safe: compiled
    on worker threads, copied into constraints on the engine thread."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Iterable[int]):
        # Built with the engine (~0.2 s, ~30 MB for a 49k vocabulary): built on first use, it
        # held the GIL for those 0.2 s and stalled every running request's step.
        self._tokenizer = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=sorted(eos_token_ids))
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.vocab_size = vocab_size
        self.compiles = 0  # grammars compiled (a repeated one is not compiled again)

    def compile(self, spec: StructuredOutputs) -> llguidance.LLMatcher:
        """The compiled grammar of `spec` (from the cache, or compiled now: up to tens of
        ms for a large schema, so callers that can run it off the engine thread do)."""
        key = spec.grammar()
        with self._lock:
            matcher = self._compiled.get(key)
            if matcher is not None:
                self._compiled.move_to_end(key)
                return matcher
        matcher = llguidance.LLMatcher(self._tokenizer, key, log_level=0, limits=LIMITS)  # lets go of the GIL
        if matcher.is_error():
            raise InvalidRequestError(f"invalid {spec.kind} constraint: {matcher.get_error().strip()}")
        with self._lock:
            self.compiles += 1
            self._compiled[key] = matcher
            while len(self._compiled) > MAX_COMPILED:
                self._compiled.popitem(last=False)
        return matcher

    def constraint(self, spec: StructuredOutputs) -> Constraint:
        """A fresh matcher for one request (a copy of the compiled one: microseconds)."""
        return Constraint(self.compile(spec).deep_copy(), spec)


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, words] int32 bitmasks -> [rows, vocab_size] bool (True: allowed). Bit j of word
    w is token 32w + j: little-endian bytes, each unpacked least significant bit first."""
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
    return torch.from_numpy(bits[:, :vocab_size]).bool()
