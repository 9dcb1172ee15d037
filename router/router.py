"""Router: the one narrow interface the gateways use.

    generate(prompt, params) -> AsyncIterator[RequestOutput]

It validates and tokenizes at the edge (bad input raises InvalidRequestError before any
worker is involved), places the request on a (prefill, decode) pair by the routing
policy (router/placement.py), streams its deltas from the decode worker (which calls
the chosen prefill worker; a one-token request goes to the prefill worker alone), and
observes each stream's latency. A stream its consumer
abandons is cancelled, which aborts the request on every tier.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import AsyncIterator

from ray import serve

from cluster.config import EngineConfig, RoutingConfig
from cluster.engine.engine import RequestOutput
from cluster.engine.input_processor import InputProcessor, Prompt
from cluster.engine.sampling_params import SamplingParams
from cluster.messages import GenerateRequest, PrefillRequest
from router.metrics import GatewayMetrics
from router.placement import Placer


class Router:
    def __init__(
        self,
        engine_config: EngineConfig,
        decode_handle,
        prefill_handle=None,
        metrics: GatewayMetrics | None = None,
        routing: RoutingConfig = RoutingConfig(),
        redis_url: str | None = None,
    ):
        self.inputs = InputProcessor.from_model(engine_config.model, engine_config.max_model_len)
        # .options() initializes a handle: its request router starts following Serve's
        # replica set now, so placement knows every replica before the first request.
        self.decode = decode_handle.options()
        self.prefill = prefill_handle.options() if prefill_handle is not None else None
        self.metrics = metrics or GatewayMetrics(replica=uuid.uuid4().hex[:8])
        self.placer = Placer(engine_config, routing, redis_url, colocated=prefill_handle is None, metrics=self.metrics)
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:6]

    def new_request_id(self) -> str:
        return f"{self._prefix}-{next(self._ids)}"

    async def generate(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        params = params or SamplingParams()
        ids = self.inputs.process(prompt, params)
        request_id = request_id or self.new_request_id()
        timer = self.metrics.track()
        placement = await self.placer.place(ids)
        one_token = self.prefill is not None and params.max_tokens == 1
        if one_token:
            placement.decode_worker = None  # it ends with its first token: no decode worker is involved
        self.placer.started(placement)
        if one_token:
            prefill = PrefillRequest(request_id, ids, params, None, None, 0, 0, route=placement.prefill)
            stream = self.prefill.prefill.remote(prefill)
            outputs = _last_output(stream)
        else:
            request = GenerateRequest(request_id, ids, params, route=placement.decode, prefill_route=placement.prefill)
            stream = outputs = self.decode.options(stream=True).generate.remote(request)
        status, finish_reason = "error", None
        try:
            async for out in outputs:
                if out.new_token_ids:
                    if timer.last is None:
                        self.placer.first_token(placement)
                    timer.output()
                if out.finished:
                    status, finish_reason = ("ok" if out.finish_reason != "abort" else "aborted"), out.finish_reason
                yield out
        except (asyncio.CancelledError, GeneratorExit):
            status = "cancelled"
            raise
        finally:
            if finish_reason is None:
                stream.cancel()  # abandoned or failed: abort on every tier
            self.placer.finished(placement)
            timer.finish(status, finish_reason)

    def live_workers(self) -> dict[str, list[str]]:
        """{tier: worker ids} of the replicas Serve routes to now, as placement sees them."""
        return self.placer.live_workers()

    async def worker_stats(self) -> dict:
        """{tier: {worker_id: stats}} for every running replica of each tier.

        A handle cannot address one replica, so this asks until it has heard from as
        many distinct workers as Serve reports running (bounded number of calls).
        """
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


async def _last_output(call) -> AsyncIterator[RequestOutput]:
    """The finished output a prefill worker returns for a one-token request, as a stream."""
    result = await call
    yield result.output
