"""The OpenAI-compatible HTTP contract: request and response bodies.

These models are the schema `/openapi.json` publishes. Requests are strict (no unknown
fields, no type coercion): what the schema refuses, the gateway refuses with 400.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from cluster.engine.sampling_params import LIMITS, MAX_STOP_STRINGS

Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
NonEmptyTokens = Annotated[list[TokenId], Field(min_length=1)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Request):
    include_usage: bool = False


class ResponseFormatText(_Request):
    type: Literal["text"]


class ResponseFormatJsonObject(_Request):
    type: Literal["json_object"]


class JsonSchemaFormat(_Request):
    name: str = Field(max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict | bool | None = Field(None, alias="schema", description="a JSON schema; none: any JSON object")
    strict: bool | None = None


class ResponseFormatJsonSchema(_Request):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[ResponseFormatText | ResponseFormatJsonObject | ResponseFormatJsonSchema, Field(discriminator="type")]


class StructuredOutputsParams(_Request):
    """vLLM's `structured_outputs`: exactly one of these constrains the output."""

    json_: dict | bool | str | None = Field(None, alias="json", description="a JSON schema")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = Field(None, description="a Lark grammar (llguidance's dialect)")


class _SamplingRequest(_Request):
    """Fields that completions and chat share (OpenAI's names, plus vLLM's extensions)."""

    model: str
    temperature: float | None = Field(None, **LIMITS["temperature"].bounds(), description="0 is greedy")
    top_p: float | None = Field(None, **LIMITS["top_p"].bounds())
    top_k: int | None = Field(None, **LIMITS["top_k"].bounds(), description="vLLM extension; 0 or -1 disables")
    min_p: float | None = Field(None, **LIMITS["min_p"].bounds(), description="vLLM extension")
    presence_penalty: float | None = Field(None, **LIMITS["presence_penalty"].bounds())
    frequency_penalty: float | None = Field(None, **LIMITS["frequency_penalty"].bounds())
    repetition_penalty: float | None = Field(None, **LIMITS["repetition_penalty"].bounds(), description="vLLM extension; 1 is off")
    seed: Int64 | None = None
    stop: str | list[str] | None = Field(None, description=f"up to {MAX_STOP_STRINGS} stop strings")
    stop_token_ids: list[TokenId] | None = Field(None, description="vLLM extension")
    ignore_eos: bool = Field(False, description="vLLM extension")
    min_tokens: int = Field(0, **LIMITS["min_tokens"].bounds(), description="vLLM extension")
    n: int = Field(1, **LIMITS["n"].bounds(), description="choices per prompt")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = Field(None, description="vLLM extension")


class CompletionRequest(_SamplingRequest):
    prompt: str | NonEmptyTokens | list[str] | list[NonEmptyTokens] = Field(
        description="text, token ids, or a list of either (one completion per prompt)"
    )
    max_tokens: int | None = Field(16, **LIMITS["max_tokens"].bounds())
    logprobs: int | None = Field(None, **LIMITS["logprobs"].bounds(), description="top alternatives per token")


class TextPart(_Request):
    type: Literal["text"]
    text: str


FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]


class FunctionCallIn(_Request):
    name: FunctionName
    arguments: str = Field(description="JSON text, as the model wrote it")
    parsed_arguments: Any = Field(None, description="ignored: the SDK's parse() adds it to the calls it returns")


class ToolCallIn(_Request):
    """A call an earlier assistant message made (the conversation's history)."""

    id: str = Field(max_length=256)
    type: Literal["function"]
    function: FunctionCallIn
    index: int | None = Field(None, description="ignored: the SDK's streamed calls carry it")


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = Field(None, description="assistant messages: the calls it made")
    tool_call_id: str | None = Field(None, max_length=256, description="tool messages: the call this answers")
    # Ignored: fields of the SDK's own response message, sent back when a client appends it.
    refusal: str | None = None
    annotations: list | None = None
    audio: Any = None
    function_call: Any = None
    parsed: Any = None


class FunctionDefinition(_Request):
    name: FunctionName
    description: str | None = None
    parameters: dict | None = Field(None, description="a JSON schema of the arguments; none: any object")
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: FunctionName


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, **LIMITS["max_tokens"].bounds(), description="deprecated by OpenAI; max_completion_tokens wins")
    max_completion_tokens: int | None = Field(None, **LIMITS["max_tokens"].bounds())
    logprobs: bool = False
    top_logprobs: int | None = Field(None, **LIMITS["logprobs"].bounds())
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="default: auto with tools, none without")
    parallel_tool_calls: bool = True


# ---- responses ------------------------------------------------------------------------

FinishReason = Literal["stop", "length", "tool_calls"]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A streamed piece of a tool call: the first carries its id and name."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    """One SSE event of a streamed chat completion (`data: {...}`)."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pdserve"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: `{"error": {"message", "type", "param", "code"}}`."""

    error: ErrorDetail


class Health(BaseModel):
    status: Literal["ok", "unavailable"]
    detail: str | None = None
