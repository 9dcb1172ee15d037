"""Prefill worker: computes prompts (chunked, reusing its prefix cache), samples the first
token, and pushes the KV blocks a decode worker lacks while the prompt computes.

    decode --prefill(req)--> PrefillWorker                           (a streaming call)
                             1. engine: prompt with max_tokens=1, hold_kv, stream_kv
                             2. each chunk's blocks, once computed, go to a sender thread:
                                every rank sends its KV heads of them to the decode ranks
                                that hold them (pair groups), part after part
    decode <--PrefillStarted-- (when the first part goes: a prompt of several chunks)
    decode <--PrefillResult--  (the first token; the sender sends the last part, then
                                the held blocks are released: sent or failed)

    router --complete(req)--> PrefillWorker  a request that ends with its next token:
                                             computed and finished here, no decode worker

The decode worker posts its receive at the first message, and transfers are matched by
transfer id, not by order: the transfer of a long prompt ends shortly after its last chunk.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from cluster.config import EngineConfig, TransportConfig
from cluster.engine.outputs import RequestOutput
from cluster.errors import EngineDeadError
from cluster.kv.tp_transfer import Part
from cluster.kv.transport.interface import KVTransferError
from cluster.serving import tracing
from cluster.serving.messages import OneTokenRequest, PrefillRequest, PrefillResult, PrefillStarted
from cluster.serving.worker import EngineWorker

log = logging.getLogger(__name__)

SENDER_THREADS = 8


class PrefillWorker(EngineWorker):
    tier = "prefill"

    def __init__(self, engine_config: EngineConfig, transport: TransportConfig, redis_url: str | None = None):
        super().__init__(engine_config, transport, redis_url)
        self._transfer_ids = itertools.count()
        # Several senders: a decode worker that stopped receiving stalls only its own
        # transfers (each bounded by the timeout), not everyone else's.
        self._sender = ThreadPoolExecutor(max_workers=SENDER_THREADS, thread_name_prefix="kv-send")

    async def prefill(self, req: PrefillRequest) -> AsyncIterator[PrefillStarted | PrefillResult]:
        """For a decode worker: PrefillStarted once the first part of the KV is on its way
        (a prompt of several chunks), then PrefillResult with the first token."""
        transfer = PrefillStarted(req.request_id, self.worker_id, self.rank_endpoints, next(self._transfer_ids))
        span = tracing.start("prefill", req.trace, self.phases, worker=self.worker_id, request_id=req.request_id,
                             prompt_tokens=len(req.request.prompt_token_ids), transfer_id=transfer.transfer_id)
        send = _KVSend(self, req, transfer.transfer_id, span)
        out, started, chunks = None, False, 0
        try:
            first_token = dataclasses.replace(req.request, params=req.request.params.for_first_token(len(req.generated)))
            stream = self.engine.stream(first_token, req.request_id, hold_kv=True, generated=req.generated, stream_kv=True)
            async for out in stream:
                if out.kv_progress is not None:
                    chunks += 1
                    if send.computed(*out.kv_progress) and not started:
                        started = send.announced = True
                        yield transfer  # the decode worker receives from now on
                    continue
            self.publish_soon()  # the prompt's blocks are cached now
            if out is None or out.held_block_ids is None:  # it ended without holding its KV (aborted): nothing to send
                raise EngineDeadError(f"the prefill of {req.request_id} ended without its KV ({out and out.finish_reason})")
            span.set(chunks=chunks + 1, prefix_hit_tokens=out.num_cached_tokens)
            send.announced = True  # (by the PrefillResult below, if not before)
            send.finish(out.held_block_ids)  # the last part
        except BaseException as e:
            send.abandon()  # (the engine freed the blocks with the request; the receiver fails at once)
            span.end(e if isinstance(e, Exception) else None)
            raise
        finally:
            send.close()  # after the last part (or the abandon): the held blocks, if any, are released
            span.end()  # (its kv_send parts may end after it: they are sent on the sender's thread)
        yield PrefillResult(
            **vars(transfer), first_token_id=out.new_token_ids[0], first_logprob=out.logprobs[0] if out.logprobs else None,
        )

    async def complete(self, req: OneTokenRequest) -> RequestOutput:
        """A request that ends with its next token, computed and finished here (no decode
        worker, no KV transfer): its one delta."""
        out = None
        with tracing.start("prefill", req.trace, self.phases, worker=self.worker_id, request_id=req.request_id,
                           prompt_tokens=len(req.request.prompt_token_ids), one_token=True) as span:
            async for out in self.engine.stream(req.request, req.request_id, generated=req.generated):  # noqa: B007
                pass  # one step: one delta, finished
            span.set(prefix_hit_tokens=out.num_cached_tokens if out is not None else None)
        self.publish_soon()
        return out

    def stop_tier(self) -> None:
        self._sender.shutdown(wait=False, cancel_futures=True)


_CLOSED = object()  # no more parts: release what the request holds, end the thread
_ABANDONED = object()  # the transfer ends here: tell the receiver


class _KVSend:
    """One prompt's KV on its way to a decode worker, a part per computed chunk. The decode
    worker wants the blocks after its own cached prefix: `total` of them, from the
    request's block `skip` on. Full blocks go as their chunk completes; the last part,
    with the prompt's last (partial) block, once the prompt is done. One sender thread sends
    the parts in order, then releases the held blocks (engine.abort) whatever happened to
    the sends: a part that failed ends the sending (the receiver has failed too, and the
    decode worker recomputes or fails the request by its policy), never the prefill."""

    def __init__(self, worker: PrefillWorker, req: PrefillRequest, transfer_id: int, trace: tracing.Span = tracing.NO_SPAN):
        self.worker, self.req, self.transfer_id, self.trace = worker, req, transfer_id, trace
        self.skip, self.total = req.num_cached_tokens // worker.block_size, req.num_blocks
        self.queued = 0  # blocks handed to the thread so far (of `total`)
        self.abandoned = False  # nothing more is queued
        # The decode worker was sent the transfer's id (it may receive): only then does an
        # abandoned transfer send its failure notice (at once, or at close if it was told
        # after: a preempted prompt still finishes). One it never heard of has no receiver.
        self.announced = False
        self.parts: queue.SimpleQueue = queue.SimpleQueue()
        worker._sender.submit(self._run)

    def computed(self, num_tokens: int, table: list[int]) -> bool:
        """The prompt's KV now covers `num_tokens` tokens in blocks `table`: queue the newly
        completed full blocks. True if a part was queued. Fewer tokens than before (the
        request was preempted: its KV so far is gone) abandons the transfer."""
        if self.abandoned:
            return False
        if num_tokens < (self.skip + self.queued) * self.worker.block_size:
            self.abandon()
            return False
        end = min(num_tokens // self.worker.block_size - self.skip, self.total)
        if end <= self.queued:
            return False
        self._queue(table, end)
        return True

    def finish(self, table: list[int]) -> None:
        """The prompt is done, its blocks held: the rest of them."""
        if not self.abandoned:
            self._queue(table, self.total)

    def close(self) -> None:
        """Nothing more comes: once the queued parts are sent, release what the request
        holds (after an abandon too: a preempted prompt still finishes and holds its
        blocks) and end the thread. Called once, last."""
        self.parts.put(_CLOSED)

    def abandon(self) -> None:
        if not self.abandoned:
            self.abandoned = True
            self.parts.put(_ABANDONED)

    def _queue(self, table: list[int], end: int) -> None:
        blocks = table[self.skip + self.queued : self.skip + end]
        self.parts.put(Part(blocks, self.queued, self.total))
        self.queued = end

    def _run(self) -> None:
        failed, sent, notice_due = False, 0, False
        while True:
            item = self.parts.get()
            if item is _CLOSED:
                if notice_due and self.announced:  # abandoned before the decode worker heard of it, told since
                    self._send(Part((), sent, self.total), abandon=True)
                self.worker.engine.abort(self.req.request_id)  # releases held blocks, on the engine thread (else a no-op)
                return
            if item is _ABANDONED:
                if not failed and self.announced:  # the receiver still waits for the next part: it fails at once now
                    self._send(Part((), sent, self.total), abandon=True)
                else:  # (a preempted prompt still finishes, and its PrefillResult then tells the decode worker)
                    notice_due = not failed
                failed = True
            elif not failed:
                failed = not self._send(item)
                sent = item.end

    def _send(self, part: Part, abandon: bool = False) -> bool:
        req = self.req
        try:
            with self.trace.child("kv_send", self.worker.phases, first_block=part.first, abandon=abandon,
                                  **self.worker.transfer_attributes(len(part.block_ids), req.decode_endpoints[0])):
                self.worker.send_kv(req.decode_id, req.decode_endpoints, part, self.transfer_id, abandon)
            return True
        except KVTransferError as e:
            log.warning("KV transfer %d of %s failed: %s", self.transfer_id, req.request_id, e)
        except Exception:  # nobody awaits this thread: say what broke
            log.exception("KV transfer %d of %s failed unexpectedly", self.transfer_id, req.request_id)
        return False
