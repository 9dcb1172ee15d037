"""The messages between tiers: gateway -> decode worker -> prefill worker and back.

    GenerateRequest   router -> decode      its deltas go back on the gateway's delta
                                            channel (cluster/serving/delta_channel.py); the call
                                            returns how many it sent
    PrefillRequest    decode -> prefill     compute this prompt, send me these blocks
                      router -> prefill     (no decode worker) compute this one-token request
    PrefillStarted    prefill -> decode     (streamed first, for a prompt of several chunks)
                                            the transfer to receive: its first part is ready
    PrefillResult     prefill -> decode     the first token and the transfer to receive
                      prefill -> router     the finished one-token request

Each carries the RouteHint Serve's request router reads (router/replica_router.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.engine.outputs import RequestOutput, TokenLogprob
from cluster.engine.sampling_params import SamplingParams
from cluster.host.rendezvous import StoreAddress
from cluster.serving.delta_channel import DeltaAddress
from cluster.serving.routing import RouteHint


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    reply_to: DeltaAddress  # the gateway's DeltaReceiver: where the deltas go
    route: RouteHint = RouteHint()  # which decode replica
    prefill_route: RouteHint = RouteHint()  # which prefill replica the decode worker should call
    generated: tuple[int, ...] = ()  # output already streamed to the client: a migrated request resumes after it
    local_prefill: bool = False  # the decode worker computes the prompt itself (router/placement.py: computes_locally)


@dataclass(frozen=True)
class PrefillRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    decode_id: str | None  # the decode worker waiting for the KV; None: the request ends here
    decode_addresses: tuple[StoreAddress, ...] | None  # its ranks' rendezvous stores (one per TP rank)
    num_cached_tokens: int  # prompt tokens the decode already holds (whole blocks)
    num_blocks: int  # blocks the decode reserved: the KV of tokens [num_cached_tokens, prompt end)
    route: RouteHint = RouteHint()  # which prefill replica
    generated: tuple[int, ...] = ()  # as GenerateRequest.generated ("prompt end" is after them)


@dataclass(frozen=True)
class PrefillStarted:
    """The transfer a decode worker receives its prompt's KV by, sent as soon as its first
    part is on its way (the rest follows as the prompt's chunks compute)."""

    request_id: str
    prefill_id: str
    session: str  # names the (prefill, decode) process groups the KV travels on
    transfer_id: int  # matches the decode's receive to this send (-1: nothing is sent)
    prefill_tp: int  # the prefill replica's ranks: which of them send which KV heads


@dataclass(frozen=True)
class PrefillResult(PrefillStarted):
    first_token_id: int = -1
    first_logprob: TokenLogprob | None = None
    output: RequestOutput | None = None  # the whole request's last delta, when it ended here
