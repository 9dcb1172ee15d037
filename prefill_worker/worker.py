"""Prefill worker: computes prompts (chunked, reusing its prefix cache), samples the
first token, and pushes the KV blocks a decode worker lacks.

    decode --prefill(req)--> PrefillWorker
                             1. engine: prompt with max_tokens=1, hold_kv  -> first token
                             2. sender thread: every rank sends its KV heads of the
                                blocks to the decode ranks that hold them (pair groups),
                                then the held blocks are released (sent or failed)
    decode <--PrefillResult--  (returned at once; the decode's receive meets the send)

The send never blocks the reply: the decode worker posts its receive when the reply
arrives, and transfers are matched by transfer id, not by order.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from concurrent.futures import ThreadPoolExecutor

from cluster.config import EngineConfig, TransportConfig
from cluster.errors import EngineDeadError
from cluster.kv.transport import KVTransferError
from cluster.messages import PrefillRequest, PrefillResult
from cluster.worker import EngineWorker

log = logging.getLogger(__name__)

SENDER_THREADS = 8


class PrefillWorker(EngineWorker):
    tier = "prefill"

    def __init__(self, engine_config: EngineConfig, transport: TransportConfig, redis_url: str | None = None):
        super().__init__(engine_config, transport, redis_url)
        self.session = uuid.uuid4().hex[:8]  # new per process: a restarted worker gets fresh groups
        self._transfer_ids = itertools.count()
        # Several senders: a decode worker that stopped receiving stalls only its own
        # transfers (each bounded by the timeout), not everyone else's.
        self._sender = ThreadPoolExecutor(max_workers=SENDER_THREADS, thread_name_prefix="kv-send")

    async def prefill(self, req: PrefillRequest) -> PrefillResult:
        if req.decode_id is None:
            return await self._whole_request(req)
        out = None
        params = req.params.for_first_token(len(req.generated))
        async for out in self.engine.generate(req.prompt_token_ids, params, req.request_id, hold_kv=True, generated=req.generated):  # noqa: B007
            pass  # one delta: the first token
        self.publish_soon()  # the prompt's blocks are cached now
        blocks = out.held_block_ids
        if blocks is None:  # it ended without holding its KV (aborted): there is nothing to send
            raise EngineDeadError(f"the prefill of {req.request_id} ended without its KV ({out.finish_reason})")
        # Tokens [num_cached_tokens, prompt end) live in the blocks after the decode's cached ones.
        to_send = blocks[req.num_cached_tokens // self.block_size :][: req.num_blocks]
        transfer_id = next(self._transfer_ids)
        asyncio.get_running_loop().run_in_executor(self._sender, self._send_then_release, req, to_send, transfer_id)
        return PrefillResult(
            request_id=req.request_id,
            prefill_id=self.worker_id,
            session=self.session,
            transfer_id=transfer_id,
            prefill_tp=self.shard.size,
            first_token_id=out.new_token_ids[0],
            first_logprob=out.logprobs[0] if out.logprobs else None,
        )

    async def _whole_request(self, req: PrefillRequest) -> PrefillResult:
        """A request that ends with its next token (max_tokens=1, or one left after a
        migration): computed and finished here, with its own stop conditions; no decode worker, no KV transfer."""
        out = None
        async for out in self.engine.generate(req.prompt_token_ids, req.params, req.request_id, generated=req.generated):  # noqa: B007
            pass  # one step: one delta, finished
        self.publish_soon()
        return PrefillResult(
            request_id=req.request_id,
            prefill_id=self.worker_id,
            session=self.session,
            transfer_id=-1,
            prefill_tp=self.shard.size,
            first_token_id=out.new_token_ids[0],
            first_logprob=out.logprobs[0] if out.logprobs else None,
            output=out,
        )

    def _send_then_release(self, req: PrefillRequest, block_ids: list[int], transfer_id: int) -> None:
        try:
            self.send_kv(req.decode_id, req.decode_addresses, self.session, block_ids, transfer_id)
        except KVTransferError as e:
            log.warning("KV transfer %d of %s failed: %s", transfer_id, req.request_id, e)
        except Exception:  # nobody awaits this thread: say what broke
            log.exception("KV transfer %d of %s failed unexpectedly", transfer_id, req.request_id)
        finally:
            self.engine.abort(req.request_id)  # releases the held blocks, on the engine thread

    def stop_tier(self) -> None:
        self._sender.shutdown(wait=False, cancel_futures=True)
