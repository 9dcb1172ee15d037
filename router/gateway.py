"""The gateway: pdserve's Serve ingress, serving the OpenAI HTTP API and the gRPC API.

    HTTP  --Serve proxy-->  Gateway (FastAPI routes)  --\\
                                                          Router.generate --> DecodeWorker ...
    gRPC  --Serve proxy-->  Gateway.Generate/Abort/...  --/

In front of every route and RPC (but /health and grpc.health.v1): the API key; in front of
every generation: its size (prompts, choices), the per-key rate limit (Redis), then
admission (running and queued slots of this replica, shared fairly between keys), each
counted in choices. Errors have one table (router/errors.py) for both APIs.
"""


import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from grpc_health.v1 import health_pb2
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.config import EngineConfig, GatewayConfig, RoutingConfig
from cluster.engine.sampling_params import LIMITS, SamplingParams
from cluster.serving import tracing
from protos.pdserve.v1 import generation_pb2 as pb
from router import protocol as p
from router.admission import Admission, RequestLimits
from router.auth import ApiKeyAuth, load_api_keys
from router.errors import (
    BadRequest,
    GatewayError,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    RateLimited,
    Unavailable,
    from_exception,
)
from router.grpc_service import MalformedMessage
from router.grpc_serving import GrpcServing, metadata, set_error
from router.metrics import CONTENT_TYPE, GatewayMetrics
from router.openai_serving import OpenAIServing
from router.planner_status import PlannerStatus
from router.rate_limit import RateLimiter
from router.readiness import Readiness
from router.router import Router

log = logging.getLogger(__name__)

PUBLIC_PATHS = frozenset({"/health"})  # liveness: says "ok" and nothing else
# A scrape waits this long for worker stats, well inside Prometheus' default 10 s scrape
# timeout: a hung worker costs its own figures (pdserve_workers_silent), not the scrape.
METRICS_STATS_DEADLINE_S = 3.0

ERRORS = {
    status: {"model": p.ErrorResponse, "description": description}
    for status, description in {
        400: "Invalid parameters, or prompt + max_tokens over the context length",
        401: "Missing or wrong API key",
        404: "Unknown model",
        413: "Request body over the limit",
        429: "Rate limit of this API key (see Retry-After)",
        500: "Internal error",
        503: "Overloaded or a worker unavailable (see Retry-After)",
    }.items()
}
# With stream=true: Server-Sent Events, each `data:` a JSON chunk (a completion, or a
# chat.completion.chunk), an error event if the stream fails midway, and finally [DONE].
SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {"data": {"type": "string", "description": "a JSON chunk, or [DONE] last"}, "event": {"type": "string"}},
}
STREAMED = {200: {"content": {"text/event-stream": {"schema": SSE_EVENT}}, "description": "JSON, or SSE with stream=true"}}


def _check_parsed(request) -> None:
    if isinstance(request, MalformedMessage):
        raise BadRequest(f"the request is not a valid {request.message_type} message ({request.reason})")


def _error_response(error: GatewayError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers())


def _respond(result):
    """A JSON body, or an SSE stream for an async iterator of events."""
    if isinstance(result, AsyncIterator):
        return StreamingResponse(result, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    return result


class EdgeGuard:
    """ASGI middleware: API key and body size, before any route runs. Pure ASGI (not
    BaseHTTPMiddleware) so streaming responses and client disconnects pass untouched."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS:
            return await self.app(scope, receive, send)
        gateway: Gateway = scope["app"].state.gateway
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            scope.setdefault("state", {})["api_key"] = gateway.auth.check(headers.get("authorization"))
            limit = gateway.config.max_body_bytes
            if int(headers.get("content-length") or 0) > limit:
                raise PayloadTooLarge(f"request body over the limit of {limit} bytes")
        except GatewayError as e:
            gateway.metrics.rejected.labels(gateway.metrics.replica, str(e.status)).inc()
            return await _error_response(e)(scope, receive, send)
        except ValueError:
            return await _error_response(BadRequest("invalid Content-Length"))(scope, receive, send)
        if "content-length" not in headers:  # a chunked body: read it here, within the limit
            body, more = b"", True
            while more:
                message = await receive()
                if message["type"] != "http.request":
                    return  # the client went away
                body += message.get("body", b"")
                more = message.get("more_body", False)
                if len(body) > limit:
                    error = PayloadTooLarge(f"request body over the limit of {limit} bytes")
                    return await _error_response(error)(scope, receive, send)
            replayed = False

            async def receive_buffered():
                nonlocal replayed
                if replayed:
                    return await receive()  # then: disconnect notices
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}

            return await self.app(scope, receive_buffered, send)
        return await self.app(scope, receive, send)


api = FastAPI(
    title="pdserve",
    summary="Disaggregated prefill/decode LLM serving: OpenAI-compatible API",
    description="Send `Authorization: Bearer <key>` when the server has API keys. Errors use OpenAI's JSON shape.",
    version="1",
)
api.add_middleware(EdgeGuard)


@api.exception_handler(GatewayError)
async def _gateway_error(request: Request, e: GatewayError):
    return _error_response(e)


# Request fields checked against a limit declared under another field's name.
_LIMIT_OF = {"top_logprobs": "logprobs", "max_completion_tokens": "max_tokens"}
_RANGE_ERRORS = frozenset({"greater_than", "greater_than_equal", "less_than", "less_than_equal"})


@api.exception_handler(RequestValidationError)
async def _validation_error(request: Request, e: RequestValidationError):
    first = e.errors()[0] if e.errors() else {}
    where = [str(x) for x in first.get("loc", ()) if x != "body"]
    field = where[-1] if where else None
    limit = LIMITS.get(_LIMIT_OF.get(field, field))
    if limit is not None and first.get("type") in _RANGE_ERRORS:
        message = limit.message(field, first.get("input"))  # the words the engine (and gRPC) use
    else:
        message = f"{'.'.join(where) or 'body'}: {first.get('msg', 'invalid request')}"
    return _error_response(BadRequest(message, param=where[0] if where else None))


@api.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, e: StarletteHTTPException):
    error = NotFound(f"no route {request.method} {request.url.path}") if e.status_code == 404 else GatewayError(str(e.detail))
    error.status = e.status_code
    if e.status_code < 500:
        error.type = "invalid_request_error" if e.status_code != 404 else error.type
    return _error_response(error)


@api.exception_handler(Exception)
async def _internal_error(request: Request, e: Exception):
    return _error_response(from_exception(e))


@serve.ingress(api)
class Gateway:
    def __init__(
        self,
        engine_config: EngineConfig,
        config: GatewayConfig,
        routing: RoutingConfig,
        redis_url: str | None,
        decode_handle,
        prefill_handle=None,
    ):
        self.config = config
        self.model_name = engine_config.model_id
        tracing.configure("pdserve-gateway")
        self.metrics = GatewayMetrics(replica=f"gateway-{uuid.uuid4().hex[:8]}")
        self.router = Router(engine_config, decode_handle, prefill_handle, self.metrics, routing, redis_url)
        self.auth = ApiKeyAuth(load_api_keys(config.api_keys, config.api_key_file))
        self.rate_limiter = RateLimiter(
            redis_url, config.rate_limit_rps, config.rate_limit_burst, self.metrics.rate_limit_errors.labels(self.metrics.replica)
        )
        self.planner = PlannerStatus(redis_url)
        self.admission = Admission(
            config.max_running_requests, config.max_queued_requests, config.queue_timeout_s, config.retry_after_s,
            config.max_running_per_key,
        )
        limits = RequestLimits.of(config)
        self.openai = OpenAIServing(self.router, self.model_name, self.admitted, limits)
        self.grpc = GrpcServing(self.router, self.model_name, self.admitted, limits)
        self.readiness = Readiness(self._through_every_tier, config.ready_timeout_s, config.ready_interval_s)
        api.state.gateway = self  # one replica per process: the EdgeGuard finds it here

    # ---- the narrow interface (Serve handles: tests, `pdserve status`) ----------------

    async def generate(self, prompt, params=None, request_id: str | None = None):
        """Stream a prompt's deltas (token ids or text; InvalidRequestError before any work)."""
        async for out in self.router.stream(self.router.inputs.process(prompt, params or SamplingParams()), request_id):
            yield out

    async def worker_stats(self) -> dict:
        return await self.router.worker_stats()

    async def poll_workers(self, deadline_s: float) -> tuple[dict, dict[str, int]]:
        return await self.router.poll_workers(deadline_s)

    async def live_workers(self) -> dict[str, list[str]]:
        return self.router.live_workers()

    async def planner_status(self) -> dict | None:
        """The SLO planner's last decision (None: no planner, or it has not published)."""
        return await self.planner.read()

    @asynccontextmanager
    async def admitted(self, api_key: str, choices: int = 1) -> AsyncIterator[None]:
        """Rate limit (per key, shared through Redis), then running slots of this replica,
        one per choice."""
        entered = False
        try:
            retry_after = await self.rate_limiter.acquire(api_key, choices)
            if retry_after is not None:
                raise RateLimited("rate limit exceeded for this API key", retry_after_s=max(1, round(retry_after + 0.5)))
            async with self.admission.slot(api_key, choices):
                entered = True
                yield
        except (RateLimited, Overloaded) as e:
            if not entered:  # refused here; the generation inside never raises these
                self.metrics.rejected.labels(self.metrics.replica, str(e.status)).inc()
            raise

    # ---- HTTP --------------------------------------------------------------------------

    @api.get("/health", response_model=p.Health, tags=["health"])
    async def health(self) -> p.Health:
        """Liveness: the gateway answers (no work, no key)."""
        return p.Health(status="ok")

    @api.get("/ready", response_model=p.Health, tags=["health"], responses={401: ERRORS[401], 503: {"model": p.Health}})
    async def ready(self):
        """Readiness: the last real check (router/readiness.py), at most `ready_interval_s` old."""
        detail = await self.readiness.status()
        if detail is not None:
            return JSONResponse(p.Health(status="unavailable", detail=detail).model_dump(), status_code=503)
        return p.Health(status="ok")

    async def _through_every_tier(self) -> None:
        """Real tokens through prefill, KV transfer and decode (two: a one-token request
        would end at the prefill worker)."""
        prompt = self.router.inputs.tokenizer.encode("ready")
        try:
            request = self.router.inputs.process(prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
            async for out in self.router.stream(request):
                if out.finished and out.finish_reason == "abort":
                    raise Unavailable("the readiness check was aborted")
        except Exception as e:
            raise from_exception(e) from None

    @api.get("/metrics", tags=["health"], response_class=Response, responses={200: {"content": {CONTENT_TYPE: {}}}})
    async def prometheus(self) -> Response:
        """Prometheus text: request latencies of this gateway replica, worker state of all."""
        try:
            stats, silent = await self.router.poll_workers(METRICS_STATS_DEADLINE_S)
        except Exception as e:  # noqa: BLE001 - gateway metrics still render
            log.warning("metrics: worker stats unavailable: %s", e)
            stats, silent = {}, {}
        if any(silent.values()):
            log.warning("metrics: running replicas silent past %g s: %s", METRICS_STATS_DEADLINE_S, silent)
        self.metrics.gateway_running.labels(self.metrics.replica).set(self.admission.running)
        self.metrics.gateway_queued.labels(self.metrics.replica).set(self.admission.queued)
        return Response(self.metrics.render(stats, silent, await self.planner.read()), media_type=CONTENT_TYPE)

    @api.get("/v1/models", response_model=p.ModelList, responses={401: ERRORS[401]})
    async def models(self) -> p.ModelList:
        return self.openai.models()

    @api.post("/v1/completions", response_model=p.CompletionResponse, responses={**ERRORS, **STREAMED})
    async def completions(self, body: p.CompletionRequest, request: Request):
        trace = tracing.start("completions", request.headers, stream=body.stream, model=body.model)
        try:
            return _respond(await self.openai.completion(body, request.state.api_key, trace))
        except Exception as e:
            trace.end(e)  # (a response or stream ends it once it is over)
            raise

    @api.post("/v1/chat/completions", response_model=p.ChatCompletionResponse, responses={**ERRORS, **STREAMED})
    async def chat_completions(self, body: p.ChatCompletionRequest, request: Request):
        trace = tracing.start("chat.completions", request.headers, stream=body.stream, model=body.model)
        try:
            return _respond(await self.openai.chat(body, request.state.api_key, trace))
        except Exception as e:
            trace.end(e)
            raise

    # ---- gRPC (Serve's proxy calls the method named like the RPC) -----------------------

    async def Generate(self, request: pb.GenerateRequest, grpc_context) -> AsyncIterator[pb.GenerateResponse]:
        try:
            api_key = self.auth.check(metadata(grpc_context, "authorization"))
            _check_parsed(request)
            trace = tracing.start("grpc.Generate", {h: metadata(grpc_context, h) or "" for h in tracing.TRACE_HEADERS})
            async for message in self.grpc.stream(request, api_key, trace):
                yield message
        except asyncio.CancelledError:
            raise
        except Exception as e:
            raise set_error(grpc_context, e) from None

    async def Abort(self, request: pb.AbortRequest, grpc_context) -> pb.AbortResponse:
        try:
            api_key = self.auth.check(metadata(grpc_context, "authorization"))
            _check_parsed(request)
            return self.grpc.abort(request, api_key)
        except Exception as e:
            raise set_error(grpc_context, e) from None

    async def ListModels(self, request: pb.ListModelsRequest, grpc_context) -> pb.ListModelsResponse:
        try:
            self.auth.check(metadata(grpc_context, "authorization"))
            _check_parsed(request)
            return self.grpc.list_models()
        except Exception as e:
            raise set_error(grpc_context, e) from None

    async def Check(self, request: health_pb2.HealthCheckRequest, grpc_context) -> health_pb2.HealthCheckResponse:
        """grpc.health.v1: liveness of the gateway (no key), for probes and grpcurl."""
        known = {"", "pdserve.v1.Generation"}
        if request.service not in known:
            raise set_error(grpc_context, NotFound(f"unknown service '{request.service}'"))
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)

    async def Watch(self, request: health_pb2.HealthCheckRequest, grpc_context) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        yield await self.Check(request, grpc_context)
        await asyncio.Event().wait()  # no further change until the gateway goes away
