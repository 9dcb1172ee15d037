"""One streamed OpenAI request, timed the way `vllm bench serve` times it.

TTFT is the time to the first non-empty content delta (a chat stream's role-only first
chunk does not count); ITL the gaps between the streamed chunks after it. A request
succeeds only if its stream ends with a finish reason and `data: [DONE]`. An output with
no visible text at all (only special or undecodable tokens) still succeeds; its TTFT is
then its first chunk's, as vLLM counts, and it is flagged `empty_output`. Failures are
classified: `http_<status>`, `truncated_stream`, `stream_error`, `timeout`, `connection`;
a request the client gives up on itself (`abort_after`) is `aborted`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import aiohttp


@dataclass
class RequestResult:
    success: bool = False
    error: str | None = None  # failure class (see above)
    detail: str = ""
    start: float = 0.0  # perf_counter at send
    ttft: float = 0.0  # s
    itl: list[float] = field(default_factory=list)  # s, between content deltas
    latency: float = 0.0  # s, send to [DONE]
    prompt_len: int = 0
    output_len: int = 0
    text: str = ""
    token_times: list[float] = field(default_factory=list)  # perf_counter of each chunk from TTFT on
    empty_output: bool = False


async def send(
    session: aiohttp.ClientSession, endpoint: str, model: str, prompt: str | list[dict], max_tokens: int, ignore_eos: bool,
    prompt_len: int,
    abort_after: int | None = None,
    response_format: dict | None = None,
) -> RequestResult:
    """`abort_after`: disconnect after that many streamed chunks (0: as soon as the
    response starts, while the prompt is still being computed). `response_format`: OpenAI's,
    sent as given."""
    chat = endpoint.endswith("/chat/completions")
    body = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": ignore_eos,
    }
    if response_format is not None:
        body["response_format"] = response_format
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    else:  # completions take text; a conversation is sent as its concatenated turns
        body["prompt"] = prompt if isinstance(prompt, str) else "".join(m["content"] for m in prompt)
    result = RequestResult(prompt_len=prompt_len, start=time.perf_counter())
    finished = done = False
    chunk_times: list[float] = []  # every chunk carrying a choice
    first_content: int | None = None  # index into chunk_times of the first non-empty content
    try:
        async with session.post(endpoint, json=body) as response:
            if response.status != 200:
                result.error, result.detail = f"http_{response.status}", (await response.text())[:300]
                return result
            async for raw in response.content:  # one SSE line at a time
                if abort_after is not None and len(chunk_times) >= abort_after:
                    response.close()  # the connection goes: the server sees a disconnect
                    result.error, result.detail = "aborted", f"by the client after {len(chunk_times)} chunks"
                    return result
                line = raw.decode().rstrip("\r\n")
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error, result.detail = "stream_error", chunk["error"].get("message", "")
                    return result
                for choice in chunk.get("choices", []):
                    text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                    delta = choice.get("delta") or {}
                    if chat and not text and delta.get("role") and choice.get("finish_reason") is None:
                        continue  # the role announcement is not a token
                    chunk_times.append(time.perf_counter())
                    if text:
                        if first_content is None:
                            first_content = len(chunk_times) - 1
                        result.text += text
                    finished = finished or choice.get("finish_reason") is not None
                if chunk.get("usage"):
                    result.output_len = chunk["usage"]["completion_tokens"]
                    result.prompt_len = chunk["usage"]["prompt_tokens"]
    except (TimeoutError, aiohttp.ServerTimeoutError) as e:
        result.error, result.detail = "timeout", type(e).__name__
        return result
    except aiohttp.ClientError as e:
        result.error, result.detail = "connection", f"{type(e).__name__}: {e}"
        return result
    result.latency = time.perf_counter() - result.start
    if not (finished and done) or not chunk_times:
        result.error = "truncated_stream"
        result.detail = f"finish_reason seen: {finished}, [DONE] seen: {done}, chunks: {len(chunk_times)}"
        return result
    result.empty_output = first_content is None
    times = chunk_times[first_content or 0 :]
    result.ttft = times[0] - result.start
    result.itl = [b - a for a, b in zip(times, times[1:])]
    result.token_times = times
    result.success = True
    return result
