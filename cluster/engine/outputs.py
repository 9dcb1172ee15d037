"""What the engine hands out per step: plain data, torch-free, so that the gateway, which
only relays it, imports no torch (tests/unit/test_gateway_parts.py checks)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TokenLogprob:
    """A sampled token, as the sampler returns it and requests report it."""

    token_id: int
    # log-softmax of the raw (unprocessed) logits at token_id; None when the request asked
    # for no logprobs (params.logprobs None): a logsumexp over the vocabulary per row is not
    # free (8 rows of a 49152-token vocabulary: ~0.4 ms on one core).
    logprob: float | None
    # top-N (token_id, logprob) alternatives from the raw logits, most likely first;
    # N = params.logprobs (empty if None or 0).
    top: list[tuple[int, float]]


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request (a delta, not the whole history)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" once finished
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    logprobs: list[TokenLogprob] | None = None
    # Finished and hold_kv: the blocks that keep its KV until it is released (a prefill
    # worker sends them without another trip to the engine thread, a whole step later).
    held_block_ids: list[int] | None = None
    # A stream_kv request's prompt progress, on an output of its own (no tokens) after each
    # step that computed a chunk of it: (tokens whose KV is in its blocks, those blocks).
    # (0, []) after a preemption: the KV reported so far is gone.
    kv_progress: tuple[int, list[int]] | None = None
    # Why an aborted request ended, when it was the request's own doing (its grammar broke
    # mid-generation): the client's error, not the server's.
    error: str | None = None
