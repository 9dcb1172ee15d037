"""Tool calling on the chat route: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`.

    plan_tools(req)            the request's tools and choice, checked (a 400 names the field)
    check_tool_parameters(req) their parameters' schemas compile (off the event loop)
    template_messages(...)     the conversation as the chat template takes it, tools included
    ToolPlan.constraint()      `required` or a named function: the grammar the output must match
    ToolCallParser             the model's calls out of its text, whole or as it streams

One format, Hermes-style: Qwen2.5's chat template asks for it and writes it.

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A template that reads `tools` renders them itself; for one that does not (SmolLM2's), the
tools and the format go into the system message, in the words Qwen2.5's template uses. The
parser also takes SmolLM2's own form, a JSON list of calls in one block. Under `auto` nothing
constrains the model: a block that is not a call of a known tool stays text.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from cluster.engine.structured_outputs import JSON_OPTIONS, StructuredOutputs
from cluster.errors import InvalidRequestError
from router import protocol as p
from router.errors import BadRequest

OPEN, CLOSE = "<tool_call>", "</tool_call>"

SYSTEM_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


@dataclass(frozen=True)
class ToolPlan:
    tools: tuple[dict, ...]  # OpenAI's tool definitions, as the template and the prompt show them
    choice: str  # "auto", "required", or the name of the one function to call
    parallel: bool

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t["function"]["name"] for t in self.tools)

    def constraint(self) -> StructuredOutputs | None:
        """The grammar of `required` (one or more calls; one unless parallel) or a named
        function (exactly one call of it); None under `auto`."""
        if self.choice == "auto":
            return None
        chosen = [t["function"] for t in self.tools if self.choice == "required" or t["function"]["name"] == self.choice]
        calls = {"anyOf": [_call_schema(f) for f in chosen], "x-guidance": JSON_OPTIONS}
        call = f'"{OPEN}\\n" %json {json.dumps(calls)} "\\n{CLOSE}"'
        repeat = ' ("\\n" call)*' if self.choice == "required" and self.parallel else ""
        return StructuredOutputs("grammar", spec=f"start: call{repeat}\ncall: {call}\n")


def _call_schema(function: dict) -> dict:
    arguments = function.get("parameters") or {"type": "object"}
    return {"type": "object", "properties": {"name": {"const": function["name"]}, "arguments": arguments},
            "required": ["name", "arguments"], "additionalProperties": False}


def plan_tools(req: p.ChatCompletionRequest) -> ToolPlan | None:
    """The request's tool plan; None when no tool is offered or `tool_choice` is `none`."""
    choice = req.tool_choice
    if not req.tools:
        if choice is not None and choice != "none":
            raise BadRequest("tool_choice needs tools", param="tool_choice")
        return None
    if choice == "none":
        return None
    names = [t.function.name for t in req.tools]
    if len(set(names)) != len(names):
        raise BadRequest("tools must have distinct function names", param="tools")
    if isinstance(choice, p.NamedToolChoice):
        if choice.function.name not in names:
            raise BadRequest(f"tool_choice names {choice.function.name!r}, which is not in tools", param="tool_choice")
        choice = choice.function.name
    tools = tuple({"type": "function", "function": t.function.model_dump(exclude_none=True)} for t in req.tools)
    return ToolPlan(tools, choice or "auto", req.parallel_tool_calls)


def check_tool_parameters(req: p.ChatCompletionRequest) -> None:
    """A 400 naming the first tool whose parameters are no JSON schema pdserve can compile
    (run off the event loop: compiling takes up to tens of ms)."""
    for i, tool in enumerate(req.tools or ()):
        if tool.function.parameters is not None:
            try:
                StructuredOutputs.json_schema(tool.function.parameters).validate()
            except InvalidRequestError as e:
                raise BadRequest(f"{tool.function.name}: {e}", param=f"tools[{i}].function.parameters") from None


def template_messages(messages: list[p.ChatMessage], plan: ToolPlan | None, native: bool) -> tuple[list[dict], dict]:
    """(messages, extra template variables). `native`: the template reads `tools` and renders
    tool calls and results itself (their arguments as objects, as Hugging Face templates
    expect); otherwise calls are written in the format above and results as user turns."""
    out = []
    for m in messages:
        content = m.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        entry = {"role": m.role, "content": content or ""}
        if m.name is not None:
            entry["name"] = m.name
        if m.tool_calls:
            if native:
                entry["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.function.name,
                                        "arguments": _arguments(c.function.arguments)}} for c in m.tool_calls]
            else:
                blocks = [f"{OPEN}\n{json.dumps({'name': c.function.name, 'arguments': _arguments(c.function.arguments)})}\n{CLOSE}"
                          for c in m.tool_calls]
                entry["content"] = "\n".join(filter(None, [entry["content"], *blocks]))
        if m.role == "tool":
            if native:
                entry["tool_call_id"] = m.tool_call_id
            else:
                entry = {"role": "user", "content": f"<tool_response>\n{entry['content']}\n</tool_response>"}
        out.append(entry)
    if plan is None:
        return out, {}
    if native:
        return out, {"tools": list(plan.tools)}
    prompt = SYSTEM_PROMPT.format(tools="\n".join(json.dumps(t) for t in plan.tools))
    if out and out[0]["role"] in ("system", "developer"):
        out[0] = {**out[0], "role": "system", "content": f"{out[0]['content']}\n\n{prompt}"}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out, {}


def _arguments(text: str):
    try:
        return json.loads(text)
    except ValueError:
        raise BadRequest(f"a tool call's arguments are not JSON: {text[:80]!r}", param="messages") from None


@dataclass(frozen=True)
class ParsedCall:
    id: str
    name: str
    arguments: str  # JSON text


class ToolCallParser:
    """Splits a choice's text into content and tool calls as it arrives. `feed` returns what
    may be shown now: content up to a possible opening tag (held back until it is or is not
    one) and the calls whose block has closed. Whitespace around calls is not content."""

    def __init__(self, plan: ToolPlan):
        self.names = plan.names
        self.parallel = plan.parallel
        self.calls: list[ParsedCall] = []
        self._buffer = ""
        self._inside = False
        self._held = ""  # trailing whitespace not shown yet: content only if more text follows

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        self._buffer += text
        content, calls = "", []
        while True:
            if self._inside:
                end = self._buffer.find(CLOSE)
                if end < 0:
                    break
                body, self._buffer, self._inside = self._buffer[:end], self._buffer[end + len(CLOSE):], False
                parsed = self._parse(body)
                if parsed is None:
                    content += self._content(OPEN + body + CLOSE)
                else:
                    calls += parsed
                continue
            start = self._buffer.find(OPEN)
            if start >= 0:
                content += self._content(self._buffer[:start])
                self._buffer, self._inside = self._buffer[start + len(OPEN):], True
                continue
            keep = _partial_tag(self._buffer)
            content += self._content(self._buffer[: len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep:]
            break
        return content, calls

    def finish(self) -> str:
        """The content still held (an unfinished block is text); calls end with their blocks."""
        tail = (OPEN if self._inside else "") + self._buffer
        self._buffer, self._inside = "", False
        content = self._content(tail)
        if not self.calls and self._held:
            content, self._held = content + self._held, ""
        return content

    def _content(self, text: str) -> str:
        """Text outside blocks, but its trailing whitespace only once more text follows (it
        may be the line break before a call's block, which is not content)."""
        text = self._held + text
        body = text.rstrip()
        self._held = text[len(body):]
        return body.lstrip() if self.calls else body  # not the line break after a call's block

    def _parse(self, body: str) -> list[ParsedCall] | None:
        try:
            value = json.loads(body)
        except ValueError:
            return None
        items = value if isinstance(value, list) else [value]
        calls = []
        for item in items:
            if not isinstance(item, dict) or item.get("name") not in self.names:
                return None
            arguments = item.get("arguments", {})
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments)
                except ValueError:
                    return None
            if not isinstance(arguments, dict):
                return None
            calls.append(ParsedCall(f"call_{uuid.uuid4().hex[:24]}", item["name"], json.dumps(arguments, ensure_ascii=False)))
        if not self.parallel:
            calls = calls[: max(0, 1 - len(self.calls))]
        self.calls += calls
        return calls


def _partial_tag(text: str) -> int:
    """Length of the longest end of `text` that begins the opening tag."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0
