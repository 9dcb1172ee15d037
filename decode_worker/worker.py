"""Decode worker: reserves blocks, has a prefill worker compute the prompt, receives the
KV it lacks, and streams tokens from its continuous batch.

    router --generate(req)--> DecodeWorker    (deltas: the gateway's delta channel)
        1. engine: reserve blocks (its own prefix cache covers what it can)
        2. prefill.prefill(...)            -> [the transfer once its first part goes,]
                                              then the first token   (a streaming Ray call;
                                              if the prefill worker fails: policy)
        3. engine: accept the first token  -> its delta streams to the client at once
        4. transport: receive the blocks   (bulk, over the pair's process groups, every
                                            rank its KV heads, part by part as the prompt's
                                            chunks compute; runs from step 2's first
                                            message on, in a receiver thread)
        5. engine: commit (KV arrived, or recompute per policy) and stream deltas

In colocated mode it runs both phases on its own engine (the baseline and reference), and so
does a request the router placed with `local_prefill` (the prefill tier's queue would start
its prompt later than this worker finishes it: router/placement.py).
A stream that its consumer abandons aborts the request here and at the prefill.
Every path returns the request's blocks: finish, abort, failed transfer, error.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from cluster.config import EngineConfig, TransportConfig
from cluster.engine.outputs import RequestOutput
from cluster.errors import EngineDeadError, KVCacheFullError, TransferFailedError
from cluster.host import engine_cores
from cluster.kv.transport.interface import KVTransferError
from cluster.serving import tracing
from cluster.serving.delta_channel import DeltaSender
from cluster.serving.faults import is_worker_fault
from cluster.serving.messages import GenerateRequest, PrefillRequest, PrefillResult, PrefillStarted
from cluster.serving.routing import RouteHint
from cluster.serving.worker import EngineWorker

log = logging.getLogger(__name__)

RESERVE_TIMEOUT_S = 60.0
RECEIVER_THREADS = 32  # receives wait on peers; a stalled one must not queue the others
RECEIVER_NAME = "kv-recv"  # their threads' name (on every core: cluster/host/engine_cores.py)
PREFILL_ATTEMPTS = 3  # kv_failure_policy=retry: prefill replicas asked before computing here
PREFILL_RETRY_BACKOFF_S = 0.2


@dataclass
class _Receive:
    """A request's KV receive: its thread's future once started (by the prefill's first
    message), None until then; `arrived` is set by that thread once the whole KV is in
    (read on the engine thread: AsyncEngine.accept_first_token)."""

    future: asyncio.Future | None = None
    arrived: threading.Event = field(default_factory=threading.Event)

    async def settle(self) -> None:
        """Wait for the receive to end, however it ends; then there is none."""
        if self.future is not None:
            await asyncio.wait([self.future])
            if not self.future.cancelled():
                self.future.exception()  # retrieved: the failed attempt it belonged to is over
            self.future = None
            self.arrived.clear()  # that attempt's KV: the next attempt writes the blocks again


class DecodeWorker(EngineWorker):
    tier = "decode"

    def __init__(self, engine_config: EngineConfig, transport: TransportConfig, prefill_handle=None, redis_url: str | None = None):
        """Without a prefill handle the worker is colocated (it moves no KV)."""
        self.colocated = prefill_handle is None
        super().__init__(engine_config, None if self.colocated else transport, redis_url)
        self.policy = transport.failure_policy
        # .options() initializes the handle (as the gateway's Router does its own): its request
        # router follows Serve's prefill replicas from now on, not from the first request on
        # (a fresh cluster's first first-token: 108-149 ms against 134-166 ms, 4 starts each).
        self.prefill = prefill_handle.options() if prefill_handle is not None else None
        self._receivers = ThreadPoolExecutor(max_workers=RECEIVER_THREADS, thread_name_prefix=RECEIVER_NAME,
                                             initializer=engine_cores.share_decode_cores, initargs=(RECEIVER_NAME,))
        self.deltas = DeltaSender()
        # Faults survived: transfers that failed (recomputed here), prefill calls that failed
        # (retried or computed here); and prompts placed here to compute (local_prefill).
        # The transport counts its own transfers.
        # How often a request joined the batch only after its first token (its KV not yet in
        # when the first token was accepted: the second token waits one step longer).
        self._counts = {"recomputed": 0, "prefill_faults": 0, "computed_here": 0, "local_prefills": 0,
                        "joined_after_first_token": 0}

    async def decode(self, req: GenerateRequest) -> int:
        """Run the request, its deltas going to the gateway's delta channel at
        `req.reply_to` (with every other delta of the same step for that gateway); returns
        how many it sent. Cancelling the call aborts the request."""
        channel = self.deltas.connection(req.reply_to)
        span = tracing.start("decode", req.trace, worker=self.worker_id, request_id=req.request_id,
                             local_prefill=req.local_prefill or self.colocated, resumes_after=len(req.generated))
        sent = tokens = 0
        self.load.arrived(len(req.request.prompt_token_ids))
        self.load.generated(len(req.generated))  # (a migrated request's tokens before it came here)
        last = time.perf_counter()  # the call's start, then each delta's
        try:
            async for out in self._outputs(req, span):
                channel.send(out)  # DeltaChannelError: the gateway is gone; the request aborts
                now = time.perf_counter()
                if sent == 0:
                    self.publish_soon()  # the prompt's blocks are cached now
                    if not req.generated:  # (a resumed request's first delta is not a first token)
                        self.load.first_token(now - last)
                else:
                    self.load.token_gap(now - last)
                last = now
                sent += 1
                tokens += len(out.new_token_ids)
                self.load.generated(len(out.new_token_ids))
                if out.finished:
                    self.load.finished(len(req.generated) + tokens)
        except Exception as e:
            span.end(e)
            raise
        finally:
            self.load.ended(len(req.generated) + tokens)
            self.publish_soon()  # its output's blocks too (or all freed)
            span.set(output_tokens=tokens)
            span.end()
        return sent

    async def _outputs(self, req: GenerateRequest, span: tracing.Span) -> AsyncIterator[RequestOutput]:
        """The request's deltas: computed here (colocated, or a prompt placed here), or
        prefilled by a prefill worker, its first token streamed at once and its KV received
        while it streams, then decoded here."""
        if self.colocated or req.local_prefill:
            if req.local_prefill:
                self._counts["local_prefills"] += 1
            first = True
            async for out in self.engine.stream(req.request, req.request_id, generated=req.generated):
                if first:
                    span.set(prefix_hit_tokens=out.num_cached_tokens)
                    span.event("first_token")
                    first = False
                yield out
            return
        receive = _Receive()  # the thread receiving the KV into the reserved blocks, once started
        abort_on_exit = True
        handoff = tracing.NO_SPAN  # the first token to the second: the KV's rest, the join, a step
        try:
            # Inside the try: a cancellation while reserving still aborts (the inbox keeps
            # the reserve-then-abort order on the engine thread).
            with span.child("reserve", self.phases) as reserving:
                await self.engine.prepare(req.request)
                _, block_ids, num_cached = await self._reserve(req)
                reserving.set(blocks=len(block_ids), prefix_hit_tokens=num_cached)
            result = await self._prefill(req, block_ids, num_cached, receive, span)
            if result is None:  # no prefill worker computed it: this one does, in the reserved blocks
                abort_on_exit = False
                async for out in self.engine.compute_here(req.request_id):
                    yield out
                return
            try:
                first, decoded, joined = await self.engine.accept_first_token(
                    req.request_id, result.first_token_id, result.first_logprob, kv_arrived=receive.arrived.is_set)
                if first is None:
                    raise EngineDeadError(f"request {req.request_id} stopped waiting for its KV")
                span.event("first_token")
                if not first.finished:
                    handoff = span.child("handoff", self.phases, joined_with_first_token=joined)
                yield first  # the client's first token, while the KV may still be in flight
                if not first.finished and not joined:  # (the receiving thread joins it once the KV is in)
                    kv_received = await asyncio.shield(receive.future)
            except BaseException:
                # Cancelled, abandoned or failed while the receiving thread writes into the
                # reserved blocks: free them only after it ends.
                abort_on_exit = False
                self._abort_after(receive.future, req.request_id)
                raise
            abort_on_exit = False  # from here the engine owns the request (and its abort)
            if first.finished:  # its first token ended it: the blocks go once the receive is over
                self._abort_after(receive.future, req.request_id)
                return
            if not joined:  # the KV came after the first token (or failed: then it is recomputed here)
                self._counts["joined_after_first_token"] += 1
                if not kv_received:
                    self.engine.kv_in(req.request_id, False)
            async for out in decoded:
                handoff.end()  # (once: a second end does nothing)
                yield out
        finally:
            handoff.end()
            if abort_on_exit:  # cancelled or failed before joining the batch: free the reservation ...
                if receive.future is not None:
                    self._abort_after(receive.future, req.request_id)  # ... once nothing writes into it
                else:
                    self.engine.abort(req.request_id)

    async def _prefill(self, req: GenerateRequest, block_ids: list[int], num_cached: int, receive: _Receive,
                       trace: tracing.Span = tracing.NO_SPAN) -> PrefillResult | None:
        """The prefill worker's result (first token, transfer to receive); the receive starts
        at its first message (PrefillStarted for a prompt of several chunks: the KV comes
        while the rest computes). When the prefill worker fails before it replies (it died,
        its engine stopped), by policy: `retry` asks another prefill replica (PREFILL_ATTEMPTS
        in all), then computes here; `recompute` computes here at once (None); `fail`
        raises. Before another attempt, or this worker, writes into the reserved blocks,
        the failed attempt's receive ends."""
        route = req.prefill_route
        attempts = PREFILL_ATTEMPTS if self.policy == "retry" else 1
        for attempt in range(1, attempts + 1):
            call_span = trace.child("prefill_call", self.phases, attempt=attempt)
            stream = self.prefill.options(stream=True).prefill.remote(
                PrefillRequest(
                    request_id=f"{req.request_id}.p{attempt}" if attempt > 1 else req.request_id,
                    request=req.request,
                    decode_id=self.worker_id,
                    decode_endpoints=self.rank_endpoints,
                    num_cached_tokens=num_cached,
                    num_blocks=len(block_ids),
                    route=route,
                    generated=req.generated,
                    trace=call_span.carrier(),
                )
            )
            result = None
            try:
                async for message in stream:
                    if receive.future is None:  # the first message names the transfer
                        received = trace.child("kv_receive", self.phases, transfer_id=message.transfer_id,
                                               **self.transfer_attributes(len(block_ids), message.prefill_endpoints[0]))
                        receive.future = asyncio.get_running_loop().run_in_executor(
                            self._receivers, self._receive, req.request_id, message, block_ids, receive.arrived, received
                        )
                    if isinstance(message, PrefillResult):
                        result = message
                        break
                if result is None:
                    raise EngineDeadError(f"the prefill of {req.request_id} ended without its first token")
                return result
            except Exception as e:
                call_span.end(e)
                if not is_worker_fault(e):
                    raise
                if self.policy == "fail":
                    raise TransferFailedError(f"the prefill of {req.request_id} failed: {e}") from e
                log.warning("prefill of %s failed (attempt %d of %d): %s", req.request_id, attempt, attempts, e)
                self._counts["prefill_faults"] += 1
                await receive.settle()
                if attempt < attempts:
                    route = RouteHint()  # any live replica: Serve's router drops a dead one ...
                    await asyncio.sleep(PREFILL_RETRY_BACKOFF_S * attempt)  # ... once it has noticed
            finally:
                call_span.end()
                if result is None:
                    stream.cancel()  # abandoned or failed: the prefill stops there too
        self._counts["computed_here"] += 1
        return None

    async def _reserve(self, req: GenerateRequest) -> tuple[str, list[int], int]:
        """Blocks for the prompt; while the cache is full, wait for running requests to
        finish (they always do) up to RESERVE_TIMEOUT_S."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + RESERVE_TIMEOUT_S
        while True:
            reserved = await self.engine.call(
                lambda e: e.add_remote_request(req.request, req.request_id, req.generated)
            )
            if reserved is not None:
                return reserved
            if loop.time() > deadline:
                raise KVCacheFullError(f"decode worker {self.worker_id} had no room for {len(req.request.prompt_token_ids)} tokens")
            await asyncio.sleep(0.02)

    def _abort_after(self, receiving: asyncio.Future, request_id: str) -> None:
        def abort(done: asyncio.Future) -> None:
            if not done.cancelled():
                done.exception()  # retrieved: a failed receive ends here (the request is over)
            self.engine.abort(request_id)

        receiving.add_done_callback(abort)

    def _receive(self, request_id: str, result: PrefillStarted, block_ids: list[int], arrived: threading.Event,
                 span: tracing.Span = tracing.NO_SPAN) -> bool:
        """Receive the blocks, then join the request to the batch if its first token is in
        (else it joins with it); on failure apply the policy (recompute: False; fail: raise)."""
        try:
            with span:
                self.recv_kv(result.prefill_id, result.prefill_endpoints, block_ids, result.transfer_id)
            arrived.set()  # (before kv_in: a first token accepted after this joins at once)
            self.engine.kv_in(request_id, True)
            return True
        except KVTransferError as e:
            if self.policy == "fail":
                raise TransferFailedError(f"KV transfer from {result.prefill_id} failed: {e}") from e
            log.warning("KV transfer %d failed, recomputing the prompt here: %s", result.transfer_id, e)
            self._counts["recomputed"] += 1
            return False

    def tier_stats(self) -> dict:
        return {**self._counts, "delta_channel": dict(self.deltas.counts)}

    def stop_tier(self) -> None:
        self._receivers.shutdown(wait=False, cancel_futures=True)
        self.deltas.close()
