"""Router: the one narrow interface the gateways use.

    stream(request) -> AsyncIterator[RequestOutput]

It takes a request made at the edge (`inputs.process`: validated and tokenized, bad input
raised InvalidRequestError before any worker was involved), places it on a (prefill, decode) pair by the routing
policy (router/placement.py), calls the decode worker (which calls the chosen prefill
worker; a one-token request goes to the prefill worker alone) and streams the deltas
that worker sends to this gateway's delta channel (cluster/serving/delta_channel.py: one
message per engine step for all of this gateway's requests there, while the Ray call
carries cancellation, faults and the end), and observes each stream's latency. A stream
its consumer abandons cancels its call, which aborts the request on every tier. A worker that fails a request mid-stream (dies, errs,
stalls) does not end it: the request is re-issued elsewhere after the tokens already
streamed (migration), and the client sees one unbroken stream.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from collections.abc import AsyncIterator

import ray.util
from ray import serve
from ray.exceptions import RayActorError

from cluster.config import EngineConfig, RoutingConfig
from cluster.engine.input_processor import InputProcessor, TokenizedRequest
from cluster.engine.outputs import RequestOutput
from cluster.errors import EngineDeadError, StalledError
from cluster.serving import tracing
from cluster.serving.delta_channel import DeltaReceiver
from cluster.serving.faults import can_migrate, is_worker_fault
from cluster.serving.messages import GenerateRequest, OneTokenRequest
from cluster.serving.routing import TIER_DEPLOYMENTS, RouteHint, replica_of
from router.metrics import GatewayMetrics
from router.placement import Placer

log = logging.getLogger(__name__)

MIGRATION_BACKOFF_S = 0.5  # x attempt: later re-issues give Serve time to replace a dead replica
STATS_CALLS_PER_TIER = 64  # bounds worker_stats' asking when Serve's replica count is stale
STATS_CALL_S = 1.0  # with a deadline: one stats call's wait, before asking again


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
        self.routing = routing
        self.placer = Placer(engine_config, routing, redis_url, colocated=prefill_handle is None, metrics=self.metrics)
        self.deltas = DeltaReceiver(ray.util.get_node_ip_address())  # decode workers send deltas here
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:6]

    def new_request_id(self) -> str:
        return f"{self._prefix}-{next(self._ids)}"

    async def stream(
        self, request: TokenizedRequest, request_id: str | None = None, trace: tracing.Span = tracing.NO_SPAN
    ) -> AsyncIterator[RequestOutput]:
        """Stream the request's deltas. A worker fault mid-stream (see _attempt) re-issues
        it to other workers with the tokens streamed so far, up to migration_limit times:
        the stream goes on with the next token, never a repeated or a missing one.
        `trace`: the span this generation's belongs under."""
        request_id = request_id or self.new_request_id()
        timer = self.metrics.track()
        generated: list[int] = []  # output the consumer has received
        avoid: set[str] = set()  # workers that failed this request
        status, finish_reason = "error", None
        span = trace.child("generate", request_id=request_id, prompt_tokens=len(request.prompt_token_ids),
                           max_tokens=request.params.max_tokens)
        try:
            for attempt in itertools.count():
                try:
                    async for out in self._attempt(request, _attempt_id(request_id, attempt), generated, avoid, span):
                        if out.new_token_ids:
                            timer.output()
                        if out.finished:
                            status, finish_reason = ("ok" if out.finish_reason != "abort" else "aborted"), out.finish_reason
                        generated += out.new_token_ids
                        yield out
                    return
                except Exception as e:
                    if not can_migrate(e) or attempt >= self.routing.migration_limit:
                        raise
                    reason = _migration_reason(e)
                    self.metrics.migrations.labels(reason).inc()
                    span.event("migration", reason=reason, after_tokens=len(generated))
                    log.warning("request %s migrates after %d tokens (%s): %s", request_id, len(generated), reason, e)
                    await asyncio.sleep(MIGRATION_BACKOFF_S * attempt)  # 0 at first: the next replica is live
        except (asyncio.CancelledError, GeneratorExit):
            status = "cancelled"
            raise
        finally:
            timer.finish(status, finish_reason)
            span.set(status=status, finish_reason=finish_reason, output_tokens=len(generated))
            span.end()

    async def _attempt(
        self, request: TokenizedRequest, request_id: str, generated: list[int], avoid: set[str],
        trace: tracing.Span = tracing.NO_SPAN,
    ) -> AsyncIterator[RequestOutput]:
        """One placement of the request, resuming after `generated`. Raises a worker fault
        (cluster/errors.py) when a worker fails it, or StalledError when no token comes for
        stall_timeout_s once it streams; the workers it used are added to `avoid`."""
        span = trace.child("attempt", request_id=request_id, resumes_after=len(generated))
        with span.child("route", self.metrics.phases, policy=self.routing.policy) as route:
            placement = await self.placer.place(request.prompt_token_ids, avoid=frozenset(avoid))
            route.set(prefill_worker=placement.prefill_worker, decode_worker=placement.decode_worker,
                      local_prefill=placement.local_prefill, fallback=placement.fallback,
                      predicted_hit_tokens=max(placement.predicted_hits.values(), default=0))
        # (Not when the decode worker computes the prompt: the prefill tier may have no replica.)
        one_token = self.prefill is not None and not placement.local_prefill and request.params.max_tokens - len(generated) == 1
        if one_token:
            placement.decode_worker = None  # it ends with its next token: no decode worker is involved
        self.placer.started(placement)
        resume = tuple(generated)
        if one_token:
            call = self.prefill.complete.remote(OneTokenRequest(request_id, request, route=placement.prefill, generated=resume,
                                                                trace=span.carrier()))
            outputs = _output_of(call)
        else:
            message = GenerateRequest(
                request_id, request, await self.deltas.start(), route=placement.decode, prefill_route=placement.prefill,
                generated=resume, local_prefill=placement.local_prefill, trace=span.carrier(),
            )
            deltas = self.deltas.subscribe(request_id)  # before the call: no delta can come first
            call = self.decode.decode.remote(message)
            outputs = self._delivered(request_id, call, deltas)
        finished = streaming = False
        try:
            while not finished:
                try:
                    async with asyncio.timeout(self.routing.stall_timeout_s if streaming else None):
                        out = await anext(outputs)
                except StopAsyncIteration:
                    raise EngineDeadError(f"the stream of {request_id} ended before its request finished") from None
                except TimeoutError:
                    raise StalledError(f"no token for {self.routing.stall_timeout_s} s") from None
                if out.new_token_ids and not streaming:
                    self.placer.first_token(placement)
                    span.event("first_token")
                    streaming = True
                finished = out.finished
                yield out
        except Exception as e:
            avoid.update(w for w in (placement.decode_worker, placement.prefill_worker) if w)
            span.end(e)
            raise
        finally:
            if not finished:
                call.cancel()  # abandoned or failed: abort on every tier
            await outputs.aclose()
            self.placer.finished(placement)
            span.end()  # (a second end is a no-op)

    async def _delivered(self, request_id: str, call, deltas: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        """The deltas of the decode worker's `call` as its delta channel delivers them, up
        to the finished one. The call's failure (a worker fault) raises here; once it has
        returned, the deltas it sent but that have not arrived get a stall timeout more."""
        ended = asyncio.ensure_future(call)
        ended.add_done_callback(lambda _: deltas.put_nowait(_CALL_ENDED))
        received, sent = 0, None
        try:
            while True:
                async with asyncio.timeout(self.routing.stall_timeout_s if sent is not None else None):
                    item = await deltas.get()
                if item is _CALL_ENDED:
                    sent = ended.result()  # raises the worker's failure
                    if received >= sent:
                        raise EngineDeadError(f"the stream of {request_id} ended before its request finished")
                    continue
                received += 1
                yield item
        except TimeoutError:
            raise StalledError(f"{sent - received} deltas of {request_id} never arrived") from None
        finally:
            self.deltas.unsubscribe(request_id)
            ended.add_done_callback(_retrieve)  # a cancelled or late failure is not an error here

    def live_workers(self) -> dict[str, list[str]]:
        """{tier: worker ids} of the replicas Serve routes to now, as placement sees them."""
        return self.placer.live_workers()

    async def worker_stats(self) -> dict:
        """{tier: {worker_id: stats}} for every running replica of each tier."""
        stats, _ = await self.poll_workers()
        return stats

    async def poll_workers(self, deadline_s: float | None = None) -> tuple[dict, dict[str, int]]:
        """({tier: {worker_id: stats}}, {tier: running replicas not heard}).

        Each replica the request router routes to gets one call aimed at it (RouteHint),
        all at once: a hung replica holds only its own call, and a busy one has the whole
        deadline to answer. Left to power of two choices, the calls could all go to the
        hung replica (its cancelled streams leave it looking the least loaded). Replicas
        Serve reports running beyond those (the request router's set lags Serve's for a
        moment) are asked untargeted until heard from, a bounded number of calls. Without
        `deadline_s` a hung replica holds the poll until it wakes.
        """
        app = serve.status().applications[serve.get_replica_context().app_name]
        live = self.placer.live_workers()
        tiers = [
            (tier, handle, app.deployments[TIER_DEPLOYMENTS[tier]].replica_states.get("RUNNING", 0))
            for tier, handle in (("decode", self.decode), ("prefill", self.prefill))
            if handle is not None
        ]
        heard = await asyncio.gather(*(
            _hear_from(handle, [replica_of(w) for w in live.get(tier, ())], running, deadline_s)
            for tier, handle, running in tiers
        ))
        stats = {tier: seen for (tier, _, _), seen in zip(tiers, heard)}
        silent = {tier: max(0, running - len(seen)) for (tier, _, running), seen in zip(tiers, heard)}
        return stats, silent


async def _hear_from(handle, replicas: list[str], running: int, deadline_s: float | None) -> dict[str, dict]:
    """{worker_id: stats} of `replicas` (one call aimed at each), then of up to `running`
    distinct replicas behind `handle`. A worker fault leaves its replica unheard."""
    loop = asyncio.get_running_loop()
    end = None if deadline_s is None else loop.time() + deadline_s
    seen: dict[str, dict] = {}
    aimed = [asyncio.ensure_future(_stats_or_none(handle, RouteHint(replica=r))) for r in replicas]
    if aimed:
        done, pending = await asyncio.wait(aimed, timeout=None if end is None else max(0.0, end - loop.time()))
        for call in pending:
            call.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for call in done:
            if (s := call.result()) is not None:  # raises what is not a worker fault: a broken invariant
                seen[s["worker_id"]] = s
    for _ in range(STATS_CALLS_PER_TIER):
        if len(seen) >= running or (end is not None and loop.time() >= end):
            break
        try:
            async with asyncio.timeout_at(None if end is None else min(end, loop.time() + STATS_CALL_S)):
                s = await handle.stats.remote()
        except TimeoutError:
            continue
        seen[s["worker_id"]] = s
    return seen


async def _stats_or_none(handle, route: RouteHint) -> dict | None:
    try:
        return await handle.stats.remote(route)
    except Exception as e:
        if is_worker_fault(e):
            return None
        raise


def _attempt_id(request_id: str, attempt: int) -> str:
    """Each attempt gets its own id: a worker may still be aborting the previous one."""
    return request_id if attempt == 0 else f"{request_id}.m{attempt}"


def _migration_reason(e: BaseException) -> str:
    e = getattr(e, "cause", None) or e
    if isinstance(e, StalledError):
        return "stalled"
    if isinstance(e, RayActorError):
        return "worker_died"
    return "worker_error"


_CALL_ENDED = object()  # put on a request's delta queue when its decode call returns or fails


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


async def _output_of(call) -> AsyncIterator[RequestOutput]:
    """The one delta a prefill worker answers a one-token request with."""
    yield await call
