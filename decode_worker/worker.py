"""Decode worker: reserves blocks, has a prefill worker compute the prompt, receives the
KV it lacks, and streams tokens from its continuous batch.

    router --generate(req)--> DecodeWorker
        1. engine: reserve blocks (its own prefix cache covers what it can)
        2. prefill.prefill(...)            -> first token, transfer id   (Ray call)
        3. engine: accept the first token  -> its delta streams to the client at once
        4. transport: receive the blocks   (bulk, over the pair's process group; runs
                                            from step 2 on, in a receiver thread)
        5. engine: commit (KV arrived, or recompute per policy) and stream deltas

In colocated mode it runs both phases on its own engine (the baseline and reference).
A stream that its consumer abandons aborts the request here and at the prefill.
Every path returns the request's blocks: finish, abort, failed transfer, error.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from cluster.config import EngineConfig, TransportConfig
from cluster.engine.engine import RequestOutput
from cluster.errors import EngineDeadError, KVCacheFullError, TransferFailedError
from cluster.kv.transport import KVTransferError
from cluster.messages import GenerateRequest, PrefillRequest, PrefillResult
from cluster.worker import EngineWorker

log = logging.getLogger(__name__)

RESERVE_TIMEOUT_S = 60.0
RECEIVER_THREADS = 32  # receives wait on peers; a stalled one must not queue the others


class DecodeWorker(EngineWorker):
    tier = "decode"

    def __init__(self, engine_config: EngineConfig, transport: TransportConfig, prefill_handle=None, redis_url: str | None = None):
        """Without a prefill handle the worker is colocated (it moves no KV)."""
        self.colocated = prefill_handle is None
        super().__init__(engine_config, None if self.colocated else transport, redis_url)
        self.policy = transport.failure_policy
        self.prefill = prefill_handle
        self._receivers = ThreadPoolExecutor(max_workers=RECEIVER_THREADS, thread_name_prefix="kv-recv")
        self._counts = {"recomputed": 0}  # transfer failures: see the transport's counters

    async def generate(self, req: GenerateRequest) -> AsyncIterator[RequestOutput]:
        first = True
        try:
            async for out in self._generate(req):
                if first:
                    self.publish_soon()  # the prompt's blocks are cached now
                first = False
                yield out
        finally:
            self.publish_soon()  # its output's blocks too (or all freed)

    async def _generate(self, req: GenerateRequest) -> AsyncIterator[RequestOutput]:
        if self.colocated:
            async for out in self.engine.generate(req.prompt_token_ids, req.params, req.request_id):
                yield out
            return
        abort_on_exit = True
        try:
            # Inside the try: a cancellation while reserving still aborts (the inbox keeps
            # the reserve-then-abort order on the engine thread).
            _, block_ids, num_cached = await self._reserve(req)
            result: PrefillResult = await self.prefill.prefill.remote(
                PrefillRequest(
                    request_id=req.request_id,
                    prompt_token_ids=req.prompt_token_ids,
                    params=req.params,
                    decode_id=self.worker_id,
                    decode_address=self.transport.address,
                    num_cached_tokens=num_cached,
                    num_blocks=len(block_ids),
                    route=req.prefill_route,
                )
            )
            receiving = asyncio.get_running_loop().run_in_executor(self._receivers, self._receive, result, block_ids)
            try:
                first = await self.engine.call(
                    lambda e: e.accept_first_token(req.request_id, result.first_token_id, result.first_logprob)
                )
                if first is None:
                    raise EngineDeadError(f"request {req.request_id} stopped waiting for its KV")
                yield first  # the client's first token, while the KV is still in flight
                if not first.finished:
                    kv_received = await asyncio.shield(receiving)
            except BaseException:
                # Cancelled, abandoned or failed while the receiving thread writes into the
                # reserved blocks: free them only after it ends.
                abort_on_exit = False
                self._abort_after(receiving, req.request_id)
                raise
            abort_on_exit = False  # from here the engine owns the request (and its abort)
            if first.finished:  # its first token ended it: the blocks go once the receive is over
                self._abort_after(receiving, req.request_id)
                return
            async for out in self.engine.commit_remote(req.request_id, kv_received):
                yield out
        finally:
            if abort_on_exit:  # cancelled or failed before joining the batch: free the reservation
                self.engine.abort(req.request_id)

    async def _reserve(self, req: GenerateRequest) -> tuple[str, list[int], int]:
        """Blocks for the prompt; while the cache is full, wait for running requests to
        finish (they always do) up to RESERVE_TIMEOUT_S."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + RESERVE_TIMEOUT_S
        while True:
            reserved = await self.engine.call(lambda e: e.add_remote_request(req.prompt_token_ids, req.params, req.request_id))
            if reserved is not None:
                return reserved
            if loop.time() > deadline:
                raise KVCacheFullError(f"decode worker {self.worker_id} had no room for {len(req.prompt_token_ids)} tokens")
            await asyncio.sleep(0.02)

    def _abort_after(self, receiving: asyncio.Future, request_id: str) -> None:
        def abort(done: asyncio.Future) -> None:
            if not done.cancelled():
                done.exception()  # retrieved: a failed receive ends here (the request is over)
            self.engine.abort(request_id)

        receiving.add_done_callback(abort)

    def _receive(self, result: PrefillResult, block_ids: list[int]) -> bool:
        """Receive the blocks; on failure apply the policy (recompute: False; fail: raise)."""
        try:
            self.transport.ensure_group(result.prefill_id, self.transport.address, result.session)
            self.transport.recv_blocks(result.prefill_id, self.kv_caches, block_ids, result.transfer_id)
            return True
        except KVTransferError as e:
            if self.policy == "fail":
                raise TransferFailedError(f"KV transfer from {result.prefill_id} failed: {e}") from e
            log.warning("KV transfer %d failed, recomputing the prompt here: %s", result.transfer_id, e)
            self._counts["recomputed"] += 1
            return False

    def tier_stats(self) -> dict:
        return dict(self._counts)

    def stop_tier(self) -> None:
        self._receivers.shutdown(wait=False, cancel_futures=True)
