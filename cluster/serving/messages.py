"""The messages between tiers: gateway -> decode worker -> prefill worker and back.

    GenerateRequest   router -> decode      its deltas go back on the gateway's delta
                                            channel (cluster/serving/delta_channel.py); the
                                            call returns how many it sent
    PrefillRequest    decode -> prefill     compute this prompt, send me these blocks
    PrefillStarted    prefill -> decode     (streamed first, for a prompt of several chunks)
                                            the transfer to receive: its first part is ready
    PrefillResult     prefill -> decode     the first token and the transfer to receive
    OneTokenRequest   router -> prefill     a request that ends with its next token: no
                                            decode worker; the answer is its RequestOutput

Each request carries the RouteHint Serve's request router reads (router/replica_router.py).
KV endpoints are the transports' own (cluster/kv/transport/): the tiers carry them, one
per tensor-parallel rank, and never read them.
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.engine.input_processor import TokenizedRequest
from cluster.engine.outputs import TokenLogprob
from cluster.kv.transport.interface import KVEndpoint
from cluster.serving.delta_channel import DeltaAddress
from cluster.serving.routing import RouteHint


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    request: TokenizedRequest  # made (validated) at the gateway
    reply_to: DeltaAddress  # the gateway's DeltaReceiver: where the deltas go
    route: RouteHint = RouteHint()  # which decode replica
    prefill_route: RouteHint = RouteHint()  # which prefill replica the decode worker should call
    generated: tuple[int, ...] = ()  # output already streamed to the client: a migrated request resumes after it
    local_prefill: bool = False  # the decode worker computes the prompt itself (router/placement.py: computes_locally)
    trace: tuple[tuple[str, str], ...] = ()  # the sender's span (cluster/serving/tracing.py); () when off


@dataclass(frozen=True)
class PrefillRequest:
    request_id: str
    request: TokenizedRequest
    decode_id: str  # the decode worker waiting for the KV
    decode_endpoints: tuple[KVEndpoint, ...]  # where its ranks receive (one per TP rank)
    num_cached_tokens: int  # prompt tokens the decode already holds (whole blocks)
    num_blocks: int  # blocks the decode reserved: the KV of tokens [num_cached_tokens, prompt end)
    route: RouteHint = RouteHint()  # which prefill replica
    generated: tuple[int, ...] = ()  # as GenerateRequest.generated ("prompt end" is after them)
    trace: tuple[tuple[str, str], ...] = ()  # as GenerateRequest.trace


@dataclass(frozen=True)
class PrefillStarted:
    """The transfer a decode worker receives its prompt's KV by, sent as soon as its first
    part is on its way (the rest follows as the prompt's chunks compute)."""

    request_id: str
    prefill_id: str
    prefill_endpoints: tuple[KVEndpoint, ...]  # where its ranks send from (one per TP rank: which send which KV heads)
    transfer_id: int  # matches the decode's receive to this send


@dataclass(frozen=True)
class PrefillResult(PrefillStarted):
    first_token_id: int = -1
    first_logprob: TokenLogprob | None = None


@dataclass(frozen=True)
class OneTokenRequest:
    """A request that ends with its next token (max_tokens=1, or one left after a
    migration): a prefill worker computes and finishes it, with its own stop conditions."""

    request_id: str
    request: TokenizedRequest
    route: RouteHint = RouteHint()  # which prefill replica
    generated: tuple[int, ...] = ()  # as GenerateRequest.generated
    trace: tuple[tuple[str, str], ...] = ()  # as GenerateRequest.trace
