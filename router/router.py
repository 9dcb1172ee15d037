"""Router: the ingress. Validates and tokenizes at the edge, then streams a request's
deltas from a decode worker (which pairs itself with a prefill worker).

The gateways (HTTP, gRPC) depend only on `generate(prompt, params) -> AsyncIterator`.
Which replicas serve a request is Ray Serve's choice for now (its default router
balances by queue length); KV-cache-aware pairing replaces it in the routing work.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import AsyncIterator

from cluster.config import EngineConfig
from cluster.engine.engine import RequestOutput
from cluster.engine.input_processor import InputProcessor, Prompt
from cluster.engine.sampling_params import SamplingParams
from decode_worker.messages import GenerateRequest


class Router:
    def __init__(self, engine_config: EngineConfig, decode_handle, prefill_handle=None):
        self.inputs = InputProcessor.from_model_dir(engine_config.model, engine_config.max_model_len)
        self.decode = decode_handle
        self.prefill = prefill_handle
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:6]

    async def generate(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Stream deltas; bad input raises InvalidRequestError before any worker is involved."""
        params = params or SamplingParams()
        ids = self.inputs.process(prompt, params)
        request_id = request_id or f"{self._prefix}-{next(self._ids)}"
        stream = self.decode.options(stream=True).generate.remote(GenerateRequest(request_id, ids, params))
        async for out in stream:
            yield out

    async def worker_stats(self) -> dict:
        """{tier: {worker_id: stats}} for every running replica of each tier.

        A handle cannot address one replica, so this asks until it has heard from as
        many distinct workers as Serve reports running (bounded number of calls).
        """
        from ray import serve

        app = serve.status().applications[serve.get_replica_context().app_name]
        out: dict[str, dict] = {}
        for tier, name, handle in (("decode", "DecodeWorker", self.decode), ("prefill", "PrefillWorker", self.prefill)):
            if handle is None:
                continue
            running = app.deployments[name].replica_states.get("RUNNING", 0)
            seen: dict[str, dict] = {}
            for _ in range(64):
                s = await handle.stats.remote()
                seen[s["worker_id"]] = s
                if len(seen) >= running:
                    break
            out[tier] = seen
        return out
