"""OpenAI completions and chat on top of `Router.generate`.

Each request becomes one generation per (prompt, choice). Its size is checked first
(prompts, choices: RequestLimits), then it is admitted for all its choices (rate limit,
slots), then its prompts are rendered and tokenized off the event loop and validated
(the input-token cap among them) before any generation starts; they run concurrently and
merge into one response or one SSE stream. A stream yields nothing until its first token
exists, so every error that can happen before that (bad input, a limit, no worker) is a
proper HTTP status, not a broken stream; after it, a failure ends the stream with an
error event, then `[DONE]`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field

from cluster.engine.input_processor import TokenizedRequest
from cluster.engine.outputs import RequestOutput, TokenLogprob
from cluster.engine.sampling_params import SamplingParams
from cluster.engine.structured_outputs import StructuredOutputs
from cluster.errors import InvalidRequestError
from cluster.serving import tracing
from cluster.text.tokenizer import ChatTemplateError
from router import protocol as p
from router.admission import RequestLimits
from router.errors import BadRequest, NotFound, Unavailable, from_exception
from router.router import Router
from router.tool_calls import ToolCallParser, ToolPlan, check_tool_parameters, plan_tools, template_messages


@dataclass
class _Job:
    """One generation: a prompt's tokens with one choice's parameters."""

    index: int  # the choice index clients see: prompt_index * n + choice
    request: TokenizedRequest


@dataclass
class _Batch:
    """A request's generations before they are made: how many (its admission cost), for
    whom, and how (`jobs`, which tokenizes and validates: run off the event loop)."""

    choices: int
    api_key: str
    jobs: Callable[[], list[_Job]]
    trace: tracing.Span = tracing.NO_SPAN  # the request's span: its generations' go under it


@dataclass
class _Choice:
    """What has streamed so far for one choice (non-streaming responses)."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    num_prompt_tokens: int = 0


_DONE = object()


class OpenAIServing:
    def __init__(self, router: Router, model_name: str, admitted: Callable[[str, int], AbstractAsyncContextManager],
                 limits: RequestLimits):
        """`admitted(api_key, choices)`: held around each request's generations (rate limit, slots)."""
        self.router = router
        self.admitted = admitted
        self.limits = limits
        self.model_name = model_name
        self.tokenizer = router.inputs.tokenizer
        # A template that reads `tools` renders tools, calls and results itself (router/tool_calls.py).
        self.template_reads_tools = "tools" in (self.tokenizer.chat_template or "")
        self.max_model_len = router.inputs.max_model_len
        self.created = int(time.time())

    # ---- models ----------------------------------------------------------------------

    def models(self) -> p.ModelList:
        return p.ModelList(data=[p.ModelCard(id=self.model_name, created=self.created, max_model_len=self.max_model_len)])

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise NotFound(f"The model '{name}' does not exist; this server serves '{self.model_name}'", param="model")

    # ---- completions -----------------------------------------------------------------

    async def completion(self, req: p.CompletionRequest, api_key: str = "", trace: tracing.Span = tracing.NO_SPAN
                         ) -> p.CompletionResponse | AsyncIterator[str]:
        """`trace`: the request's span (ended with the response or its stream)."""
        self.check_model(req.model)
        prompts = _prompt_list(req.prompt)
        params = self._params(req, req.max_tokens, req.logprobs)
        self.limits.check_size(len(prompts), req.n)

        def jobs() -> list[_Job]:
            checked = self._validated(req, params)
            return self._jobs([self._tokenize(x, checked) for x in prompts], req.n)

        batch = _Batch(len(prompts) * req.n, api_key, jobs, trace)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        if req.stream:
            return await _primed(self._completion_stream(request_id, created, batch, params, req.n, _include_usage(req)))
        choices = await self._collect(batch)
        return p.CompletionResponse(
            id=request_id,
            created=created,
            model=self.model_name,
            choices=[
                p.CompletionChoice(
                    index=i, text=c.text, finish_reason=c.finish_reason,
                    logprobs=self._completion_logprobs(c.logprobs, 0) if req.logprobs is not None else None,
                )
                for i, c in enumerate(choices)
            ],
            usage=_usage(choices, req.n),
        )

    async def _completion_stream(
        self, request_id: str, created: int, batch: _Batch, params: SamplingParams, n: int, include_usage: bool
    ) -> AsyncIterator[str]:
        offsets = [0] * batch.choices
        totals = [_Choice() for _ in range(batch.choices)]
        async for index, out in self._merged(batch):
            _account(totals[index], out)
            logprobs = None
            if params.logprobs is not None:
                logprobs = self._completion_logprobs(out.logprobs or [], offsets[index])
            offsets[index] += len(out.new_text)
            choice = p.CompletionChoice(index=index, text=out.new_text, logprobs=logprobs, finish_reason=_finish(out))
            yield _sse(p.CompletionResponse(id=request_id, created=created, model=self.model_name, choices=[choice]))
        if include_usage:
            yield _sse(p.CompletionResponse(id=request_id, created=created, model=self.model_name, choices=[], usage=_usage(totals, n)))

    # ---- chat ------------------------------------------------------------------------

    async def chat(self, req: p.ChatCompletionRequest, api_key: str = "", trace: tracing.Span = tracing.NO_SPAN
                   ) -> p.ChatCompletionResponse | AsyncIterator[str]:
        """`trace`: as completion's."""
        self.check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise BadRequest("top_logprobs requires logprobs to be true", param="top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        tools = plan_tools(req)
        calls_grammar = tools.constraint() if tools is not None else None
        self._params(req, req.max_completion_tokens or req.max_tokens or 1, logprobs, calls_grammar)  # the parameters' errors, now
        self.limits.check_size(1, req.n)
        messages, template_vars = template_messages(req.messages, tools, self.template_reads_tools)

        def jobs() -> list[_Job]:
            if tools is not None:
                check_tool_parameters(req)
            try:
                prompt_ids = self.tokenizer.encode_chat(messages, **template_vars)
            except (ChatTemplateError, ValueError) as e:
                raise BadRequest(f"messages could not be rendered with the model's chat template: {e}", param="messages") from None
            max_tokens = req.max_completion_tokens or req.max_tokens or max(1, self.max_model_len - len(prompt_ids))
            params = self._validated(req, self._params(req, max_tokens, logprobs, calls_grammar), calls_grammar)
            return self._jobs([self._tokenize(prompt_ids, params)], req.n)

        batch = _Batch(req.n, api_key, jobs, trace)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        if req.stream:
            return await _primed(self._chat_stream(request_id, created, batch, logprobs, req.n, _include_usage(req), tools))
        choices = await self._collect(batch)
        return p.ChatCompletionResponse(
            id=request_id,
            created=created,
            model=self.model_name,
            choices=[
                p.ChatChoice(
                    index=i, message=message, finish_reason=finish_reason,
                    logprobs=self._chat_logprobs(c.logprobs) if req.logprobs else None,
                )
                for i, c in enumerate(choices)
                for message, finish_reason in [_assistant_message(c, tools)]
            ],
            usage=_usage(choices, req.n),
        )

    async def _chat_stream(
        self, request_id: str, created: int, batch: _Batch, logprobs: int | None, n: int, include_usage: bool,
        tools: ToolPlan | None,
    ) -> AsyncIterator[str]:
        totals = [_Choice() for _ in range(batch.choices)]
        parsers = [ToolCallParser(tools) for _ in range(batch.choices)] if tools is not None else None

        def chunk(choices: list[p.ChatChunkChoice], usage: p.Usage | None = None) -> str:
            return _sse(p.ChatCompletionChunk(id=request_id, created=created, model=self.model_name, choices=choices, usage=usage))

        async for index, out in self._merged(batch):
            if not totals[index].token_ids:  # the first delta of a choice carries the role
                yield chunk([p.ChatChunkChoice(index=index, delta=p.DeltaMessage(role="assistant", content=""))])
            _account(totals[index], out)
            chat_logprobs = self._chat_logprobs(out.logprobs or []) if logprobs is not None else None
            finish_reason = _finish(out)
            if parsers is None:
                delta = p.DeltaMessage(content=out.new_text) if out.new_text or not out.finished else p.DeltaMessage()
            else:  # content as it is known not to be a call; each call once its block closes
                parser = parsers[index]
                called = len(parser.calls)
                content, calls = parser.feed(out.new_text)
                if out.finished:
                    content += parser.finish()
                    finish_reason = _tool_finish(finish_reason, parser.calls)
                if calls:
                    yield chunk([p.ChatChunkChoice(index=index, delta=p.DeltaMessage(tool_calls=[
                        p.DeltaToolCall(index=called + j, id=c.id, type="function",
                                        function=p.DeltaFunctionCall(name=c.name, arguments=c.arguments))
                        for j, c in enumerate(calls)]))])
                delta = p.DeltaMessage(content=content) if content else p.DeltaMessage()
                if not content and not out.finished and chat_logprobs is None:
                    continue
            yield chunk([p.ChatChunkChoice(index=index, delta=delta, logprobs=chat_logprobs, finish_reason=finish_reason)])
        if include_usage:
            yield chunk([], _usage(totals, n))

    # ---- shared ----------------------------------------------------------------------

    def _params(self, req: p.CompletionRequest | p.ChatCompletionRequest, max_tokens: int | None, logprobs: int | None,
                calls_grammar: StructuredOutputs | None = None) -> SamplingParams:
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or ())
        asked = structured_outputs_of(req, calls_grammar)
        try:
            return SamplingParams(
                max_tokens=max_tokens if max_tokens is not None else 16,
                min_tokens=req.min_tokens,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=req.top_k or 0,
                min_p=req.min_p or 0.0,
                presence_penalty=req.presence_penalty or 0.0,
                frequency_penalty=req.frequency_penalty or 0.0,
                repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
                seed=req.seed,
                stop=tuple(stop),
                stop_token_ids=tuple(req.stop_token_ids or ()),
                ignore_eos=req.ignore_eos,
                logprobs=logprobs,
                structured=asked[1] if asked is not None else None,
            )
        except InvalidRequestError as e:
            raise BadRequest(str(e), param=e.param) from None

    @staticmethod
    def _validated(req, params: SamplingParams, calls_grammar: StructuredOutputs | None = None) -> SamplingParams:
        """`params` once its output constraint compiles (on a thread: up to tens of ms for a
        large schema); else a 400 naming the field that asked for it."""
        if params.structured is not None:
            param, spec = structured_outputs_of(req, calls_grammar)
            try:
                spec.validate()
            except InvalidRequestError as e:
                raise BadRequest(str(e), param=param) from None
        return params

    def _tokenize(self, prompt: str | Sequence[int], params: SamplingParams) -> TokenizedRequest:
        try:
            return self.router.inputs.process(prompt, params)
        except InvalidRequestError as e:
            raise BadRequest(str(e), param="prompt") from None

    def _jobs(self, requests: list[TokenizedRequest], n: int) -> list[_Job]:
        """n choices per prompt; seeded choices get distinct seeds (seed + choice)."""
        self.limits.check_input_tokens(sum(len(r.prompt_token_ids) for r in requests))
        jobs = []
        for i, request in enumerate(requests):
            seed = request.params.seed
            for j in range(n):
                choice = request if seed is None or j == 0 else dataclasses.replace(
                    request, params=dataclasses.replace(request.params, seed=seed + j))
                jobs.append(_Job(i * n + j, choice))
        return jobs

    async def _merged(self, batch: _Batch) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Every job's deltas as they come, tagged with the choice index, while admitted.
        Leaving early (client gone, error) cancels every generation, which aborts it on
        every tier."""
        span = batch.trace
        phases = self.router.metrics.phases
        admission = span.child("admission", phases, choices=batch.choices)
        try:
            async with self.admitted(batch.api_key, batch.choices):
                admission.end()
                # Tokenizing a long prompt takes seconds of CPU: on a thread, where the tokenizer
                # lets go of the GIL, so every other stream of this gateway goes on meanwhile.
                with span.child("tokenize", phases):
                    jobs = await asyncio.to_thread(batch.jobs)
                span.set(prompt_tokens=sum(len(job.request.prompt_token_ids) for job in jobs))
                if len(jobs) == 1:  # the common case needs no tasks
                    async for out in self._generate(jobs[0], span):
                        yield 0, out
                else:
                    async for item in self._interleaved(jobs, span):
                        yield item
        except Exception as e:
            admission.end(e)
            span.end(e)
            raise
        finally:
            span.end()

    async def _interleaved(self, jobs: list[_Job], span: tracing.Span) -> AsyncIterator[tuple[int, RequestOutput]]:
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(job: _Job) -> None:
            try:
                async for out in self._generate(job, span):
                    queue.put_nowait((job.index, out))
                queue.put_nowait((job.index, _DONE))
            except Exception as e:  # noqa: BLE001 - handed to the consumer
                queue.put_nowait((job.index, e))

        tasks = [asyncio.create_task(pump(job)) for job in jobs]
        try:
            remaining = len(tasks)
            while remaining:
                index, item = await queue.get()
                if item is _DONE:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _generate(self, job: _Job, span: tracing.Span) -> AsyncIterator[RequestOutput]:
        finished = False
        async for out in self.router.stream(job.request, self.router.new_request_id(), span):
            if out.finished and out.error:
                raise BadRequest(out.error)  # the request's own (its grammar), not the server's
            if out.finished and out.finish_reason == "abort":
                raise Unavailable("the request was aborted by the server; retry", retry_after_s=1)
            finished = finished or out.finished
            yield out
        if not finished:
            raise Unavailable("the generation ended without a finish reason; retry", retry_after_s=1)

    async def _collect(self, batch: _Batch) -> list[_Choice]:
        choices = [_Choice() for _ in range(batch.choices)]
        async for index, out in self._merged(batch):
            _account(choices[index], out)
        return choices

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _completion_logprobs(self, logprobs: list[TokenLogprob], offset: int) -> p.CompletionLogprobs:
        tokens, offsets = [], []
        for lp in logprobs:
            text = self._token_text(lp.token_id)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
        return p.CompletionLogprobs(
            tokens=tokens,
            token_logprobs=[lp.logprob for lp in logprobs],
            top_logprobs=[{self._token_text(t): v for t, v in lp.top} for lp in logprobs],
            text_offset=offsets,
        )

    def _chat_logprobs(self, logprobs: list[TokenLogprob]) -> p.ChatLogprobs:
        def top(token_id: int, value: float) -> p.TopLogprob:
            text = self._token_text(token_id)
            return p.TopLogprob(token=text, logprob=value, bytes=list(text.encode()))

        return p.ChatLogprobs(
            content=[
                p.ChatTokenLogprob(**top(lp.token_id, lp.logprob).model_dump(), top_logprobs=[top(t, v) for t, v in lp.top])
                for lp in logprobs
            ]
        )


# ---- helpers ---------------------------------------------------------------------------


def structured_outputs_of(req: p.CompletionRequest | p.ChatCompletionRequest,
                          calls_grammar: StructuredOutputs | None = None) -> tuple[str, StructuredOutputs] | None:
    """The one output constraint the request asks for, and the field that asked for it:
    `tool_choice`'s grammar (`calls_grammar`), `response_format` (OpenAI) or
    `structured_outputs` (vLLM); None if none. Not yet compiled: `OpenAIServing._validated`."""
    asked: list[tuple[str, StructuredOutputs]] = [("tool_choice", calls_grammar)] if calls_grammar is not None else []
    param = "response_format"
    try:
        fmt = req.response_format
        if fmt is not None and fmt.type == "json_object":
            asked.append((param, StructuredOutputs("json_object")))
        elif fmt is not None and fmt.type == "json_schema":
            schema = fmt.json_schema.schema_
            asked.append((param, StructuredOutputs("json_object") if schema is None else StructuredOutputs.json_schema(schema)))
        so = req.structured_outputs
        if so is not None:
            for name, value in (("json", so.json_), ("regex", so.regex), ("choice", so.choice), ("grammar", so.grammar)):
                param = f"structured_outputs.{name}"
                if name == "json" and value is not None:
                    asked.append((param, StructuredOutputs.json_schema(value)))
                elif name == "choice" and value is not None:
                    asked.append((param, StructuredOutputs("choice", choices=tuple(value))))
                elif value is not None:
                    asked.append((param, StructuredOutputs(name, spec=value)))
            if so.json_object:
                asked.append(("structured_outputs.json_object", StructuredOutputs("json_object")))
    except InvalidRequestError as e:
        raise BadRequest(str(e), param=param) from None
    if len(asked) > 1:
        raise BadRequest(f"at most one output constraint per request; got {', '.join(name for name, _ in asked)}", param=asked[1][0])
    return asked[0] if asked else None


def _prompt_list(prompt) -> list[str | list[int]]:
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    if not prompt:
        raise BadRequest("prompt must not be empty", param="prompt")
    return list(prompt)


def _assistant_message(choice: _Choice, tools: ToolPlan | None) -> tuple[p.AssistantMessage, str | None]:
    """A whole choice's message and finish reason: its text, or its tool calls (and any text
    beside them; None if there is none) with finish reason `tool_calls`."""
    if tools is None:
        return p.AssistantMessage(content=choice.text), choice.finish_reason
    parser = ToolCallParser(tools)
    content, _ = parser.feed(choice.text)
    content += parser.finish()
    if not parser.calls:
        return p.AssistantMessage(content=content), choice.finish_reason
    calls = [p.ToolCall(id=c.id, function=p.FunctionCall(name=c.name, arguments=c.arguments)) for c in parser.calls]
    return p.AssistantMessage(content=content or None, tool_calls=calls), _tool_finish(choice.finish_reason, parser.calls)


def _tool_finish(finish_reason: str | None, calls: list) -> str | None:
    return "tool_calls" if calls and finish_reason == "stop" else finish_reason


def _include_usage(req) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


def _account(choice: _Choice, out: RequestOutput) -> None:
    choice.token_ids += out.new_token_ids
    choice.text += out.new_text
    choice.logprobs += out.logprobs or []
    choice.num_prompt_tokens = out.num_prompt_tokens
    if out.finished:
        choice.finish_reason = out.finish_reason


def _finish(out: RequestOutput) -> str | None:
    return out.finish_reason if out.finished else None


def _usage(choices: list[_Choice], n: int) -> p.Usage:
    """Prompt tokens count once per prompt (not per choice), as OpenAI counts them."""
    prompt = sum(c.num_prompt_tokens for c in choices[::n])
    completion = sum(len(c.token_ids) for c in choices)
    return p.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _sse(model) -> str:
    return f"data: {model.model_dump_json()}\n\n"


def sse_error(e: BaseException) -> str:
    return f"data: {json.dumps(from_exception(e).body())}\n\n"


async def _primed(stream: AsyncIterator[str]) -> AsyncIterator[str]:
    """Run `stream` up to its first event now, so errors before the first token raise
    here (and become an HTTP status); then a stream that replays it and goes on. After
    the first event, a failure ends the stream with an error event; always `[DONE]`."""
    first = await anext(stream, None)

    async def rest() -> AsyncIterator[str]:
        try:
            if first is not None:
                yield first
            async for event in stream:
                yield event
        except Exception as e:  # noqa: BLE001 - reported to the client in-band
            yield sse_error(e)
        finally:
            await stream.aclose()
        yield "data: [DONE]\n\n"

    return rest()
