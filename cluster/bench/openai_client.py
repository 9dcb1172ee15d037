"""One streamed OpenAI request, timed the way `vllm bench serve` times it.

TTFT is the time to the first non-empty content delta; ITL the gaps between later
content deltas; a request succeeds only if its stream ends with a finish reason and
`data: [DONE]`. Failures are classified: `http_<status>`, `truncated_stream`, `timeout`,
`connection`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx


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
    token_times: list[float] = field(default_factory=list)  # perf_counter of each content delta


async def send(
    client: httpx.AsyncClient, endpoint: str, model: str, prompt: str | list[dict], max_tokens: int, ignore_eos: bool,
    prompt_len: int,
) -> RequestResult:
    chat = endpoint.endswith("/chat/completions")
    body = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": ignore_eos,
    }
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    else:  # completions take text; a conversation is sent as its concatenated turns
        body["prompt"] = prompt if isinstance(prompt, str) else "".join(m["content"] for m in prompt)
    result = RequestResult(prompt_len=prompt_len, start=time.perf_counter())
    finished = done = False
    last = result.start
    try:
        async with client.stream("POST", endpoint, json=body) as response:
            if response.status_code != 200:
                result.error, result.detail = f"http_{response.status_code}", (await response.aread()).decode()[:300]
                return result
            async for line in response.aiter_lines():
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
                    if text:
                        now = time.perf_counter()
                        if not result.text:
                            result.ttft = now - result.start
                        else:
                            result.itl.append(now - last)
                        last = now
                        result.token_times.append(now)
                        result.text += text
                    finished = finished or choice.get("finish_reason") is not None
                if chunk.get("usage"):
                    result.output_len = chunk["usage"]["completion_tokens"]
                    result.prompt_len = chunk["usage"]["prompt_tokens"]
    except httpx.TimeoutException as e:
        result.error, result.detail = "timeout", type(e).__name__
        return result
    except httpx.HTTPError as e:
        result.error, result.detail = "connection", f"{type(e).__name__}: {e}"
        return result
    result.latency = time.perf_counter() - result.start
    if not (finished and done) or not result.text:
        result.error = "truncated_stream"
        result.detail = f"finish_reason seen: {finished}, [DONE] seen: {done}, content: {bool(result.text)}"
        return result
    result.success = True
    return result
