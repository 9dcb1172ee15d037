"""The gRPC API (protos/pdserve/v1/generation.proto) on top of `Router.generate`.

Serve's gRPC proxy decodes each call and hands it to the gateway deployment's method
of the same name (Generate, Abort, ListModels, and Check/Watch of grpc.health.v1);
errors set the status code on the call's context and raise, as Serve expects.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing

from cluster.engine.input_processor import TokenizedRequest
from cluster.engine.outputs import RequestOutput
from cluster.engine.sampling_params import SamplingParams
from cluster.engine.structured_outputs import StructuredOutputs
from cluster.errors import InvalidRequestError
from cluster.serving import tracing
from protos.pdserve.v1 import generation_pb2 as pb
from router.admission import RequestLimits
from router.errors import Aborted, AlreadyExists, BadRequest, GatewayError, NotFound, Unavailable, from_exception

FINISH_REASONS = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH}


def metadata(context, key: str) -> str | None:
    return next((v for k, v in context.invocation_metadata() if k.lower() == key), None)


def set_error(context, e: BaseException) -> GatewayError:
    """Put `e`'s status on the call (Serve sends it when the method raises)."""
    error = from_exception(e)
    context.set_code(error.grpc_code)
    context.set_details(error.message)
    return error


def sampling_params(msg: pb.SamplingParameters) -> SamplingParams:
    try:
        return SamplingParams(
            max_tokens=msg.max_tokens if msg.HasField("max_tokens") else 16,
            min_tokens=msg.min_tokens,
            temperature=msg.temperature if msg.HasField("temperature") else 1.0,
            top_p=msg.top_p if msg.HasField("top_p") else 1.0,
            top_k=msg.top_k,
            min_p=msg.min_p,
            presence_penalty=msg.presence_penalty,
            frequency_penalty=msg.frequency_penalty,
            repetition_penalty=msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0,
            seed=msg.seed if msg.HasField("seed") else None,
            stop=tuple(msg.stop),
            stop_token_ids=tuple(msg.stop_token_ids),
            ignore_eos=msg.ignore_eos,
            logprobs=msg.logprobs if msg.HasField("logprobs") else None,
            structured=structured_output(msg.structured) if msg.HasField("structured") else None,
        )
    except InvalidRequestError as e:
        raise BadRequest(str(e), param=e.param) from None


def structured_output(msg: pb.StructuredOutput) -> StructuredOutputs:
    kind = msg.WhichOneof("kind")
    if kind is None:
        raise InvalidRequestError("structured names no constraint", "structured")
    if kind == "json_schema":
        return StructuredOutputs.json_schema(msg.json_schema)
    if kind == "json_object":
        return StructuredOutputs("json_object")
    if kind == "choice":
        return StructuredOutputs("choice", choices=tuple(msg.choice.choices))
    return StructuredOutputs(kind, spec=getattr(msg, kind))


def response(request_id: str, out: RequestOutput) -> pb.GenerateResponse:
    msg = pb.GenerateResponse(request_id=request_id, token_ids=out.new_token_ids, text=out.new_text)
    for lp in out.logprobs or ():
        msg.logprobs.add(
            token_id=lp.token_id, logprob=lp.logprob, top_token_ids=[t for t, _ in lp.top], top_logprobs=[v for _, v in lp.top]
        )
    if out.finished:
        msg.finish_reason = FINISH_REASONS[out.finish_reason]
        msg.usage.CopyFrom(
            pb.Usage(
                prompt_tokens=out.num_prompt_tokens,
                completion_tokens=out.num_output_tokens,
                cached_prompt_tokens=out.num_cached_tokens,
            )
        )
    return msg


class _Running:
    """The abort switch of one streaming Generate, kept by its own generator.

    The task that iterates the generator belongs to Serve, and between two messages it runs
    Serve's and grpc's code: with user code on the replica's main loop it is grpc's handler
    task, writing the last message. A cancellation landing there ends the call with no
    status at all, so `abort` cancels the task only while it waits inside this request's
    own code; an abort that finds it at a yield takes effect when the stream resumes."""

    def __init__(self):
        self.task = asyncio.current_task()
        self.at_yield = False
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True
        if not self.at_yield:
            self.task.cancel()


class GrpcServing:
    def __init__(self, router, model_name: str, admitted, limits: RequestLimits):
        """`admitted(api_key, choices)`: held around each generation (rate limit, slot)."""
        self.router = router
        self.admitted = admitted
        self.limits = limits
        self.model_name = model_name
        # (API key, client request_id) -> its stream's abort switch. Ids are the client's
        # own, per key: another key can neither abort a request nor learn that its id runs.
        self._running: dict[tuple[str, str], _Running] = {}

    def list_models(self) -> pb.ListModelsResponse:
        return pb.ListModelsResponse(models=[pb.Model(id=self.model_name, max_model_len=self.router.inputs.max_model_len)])

    async def stream(self, request: pb.GenerateRequest, api_key: str = "", trace: tracing.Span = tracing.NO_SPAN
                     ) -> AsyncIterator[pb.GenerateResponse]:
        """Validate the request, admit it, tokenize it (off the event loop) and validate its
        prompt, all before any work; then stream. `trace`: the call's span (ended here)."""
        try:
            # aclosing: a cancelled call closes the inner stream now (aborting the request on
            # every tier), not whenever the abandoned generator is collected.
            async with aclosing(self._stream(request, api_key, trace)) as messages:
                async for message in messages:
                    yield message
        except Exception as e:
            trace.end(e)
            raise
        finally:
            trace.end()

    async def _stream(self, request: pb.GenerateRequest, api_key: str, trace: tracing.Span) -> AsyncIterator[pb.GenerateResponse]:
        if request.model and request.model != self.model_name:
            raise NotFound(f"The model '{request.model}' does not exist; this server serves '{self.model_name}'")
        which = request.WhichOneof("prompt")
        if which is None:
            raise BadRequest("set a prompt: text or token_ids")
        prompt = request.text if which == "text" else list(request.token_ids.ids)
        params = sampling_params(request.params)
        client_id = request.request_id or self.router.new_request_id()
        key = (api_key, client_id)
        if key in self._running:
            raise AlreadyExists(f"request_id '{client_id}' is already running")
        running = self._running[key] = _Running()
        admission = trace.child("admission", self.router.metrics.phases, choices=1)
        try:
            async with self.admitted(api_key, 1):
                admission.end()
                with trace.child("tokenize", self.router.metrics.phases):
                    tokenized = await asyncio.to_thread(self._tokenize, prompt, params)
                # Internal ids are always the gateway's own: clients cannot collide in the workers.
                stream = self.router.stream(tokenized, self.router.new_request_id(), trace)
                async with aclosing(stream):  # closing it aborts it on every tier
                    async for out in stream:
                        if out.finished and out.error:
                            raise BadRequest(out.error)  # the request's own (its grammar), not the server's
                        if out.finished and out.finish_reason == "abort":
                            raise Unavailable("the request was aborted by the server; retry", retry_after_s=1)
                        running.at_yield = True
                        yield response(client_id, out)
                        running.at_yield = False
                        if running.aborted:
                            break  # an abort that came between two messages
        except asyncio.CancelledError:
            if not running.aborted:
                raise  # Serve's cancellation (the client went away)
            running.task.uncancel()  # the abort's own cancellation, answered with a status below
        finally:
            self._running.pop(key, None)
            admission.end()  # (refused: it ends here)
        if running.aborted:
            raise Aborted(f"request '{client_id}' was aborted")

    def _tokenize(self, prompt, params: SamplingParams) -> TokenizedRequest:
        """On a thread: tokenizing, and compiling an output constraint, take milliseconds."""
        try:
            if params.structured is not None:
                params.structured.validate()
            request = self.router.inputs.process(prompt, params)
        except InvalidRequestError as e:
            raise BadRequest(str(e)) from None
        self.limits.check_input_tokens(len(request.prompt_token_ids))
        return request

    def abort(self, request: pb.AbortRequest, api_key: str = "") -> pb.AbortResponse:
        """Abort the caller's own request of that id; any other is NOT_FOUND, whoever runs it."""
        running = self._running.get((api_key, request.request_id))
        if running is None:
            raise NotFound(f"no running request '{request.request_id}' on this gateway")
        running.abort()
        return pb.AbortResponse()
