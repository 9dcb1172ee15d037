"""Tool calling's parts without a cluster (router/tool_calls.py): the plan and its 400s, the
grammar `required` and a named function compile to, the conversation as templates take it,
and the parser of the model's calls, whole and streamed in every split."""

from __future__ import annotations

import json

import pytest

from cluster.engine.structured_outputs import StructuredOutputs
from router import protocol as p
from router.errors import BadRequest
from router.tool_calls import OPEN, ToolCallParser, check_tool_parameters, plan_tools, template_messages

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}


def request(**fields) -> p.ChatCompletionRequest:
    return p.ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})


def plan(**fields):
    return plan_tools(request(**{"tools": [WEATHER, ADD], **fields}))


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": [WEATHER, WEATHER]}, "tools", "distinct"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "add"}}}, "tool_choice", "not in tools"),
    ],
)
def test_a_plan_that_cannot_be_served_is_a_400_naming_the_field(fields, param, says):
    with pytest.raises(BadRequest) as e:
        plan_tools(request(**fields))
    assert e.value.param == param and says in str(e.value)


def test_tool_parameters_that_are_no_schema_are_a_400_naming_the_tool():
    req = request(tools=[WEATHER, {"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}])
    with pytest.raises(BadRequest) as e:
        check_tool_parameters(req)
    assert e.value.param == "tools[1].function.parameters" and "Invalid type" in str(e.value)
    check_tool_parameters(request(tools=[WEATHER, ADD]))


def test_no_tools_or_tool_choice_none_is_no_plan():
    assert plan_tools(request()) is None
    assert plan_tools(request(tools=[WEATHER], tool_choice="none")) is None
    assert plan(tool_choice=None).choice == "auto"


def test_the_calls_grammar_takes_exactly_the_calls_the_choice_allows():
    import llguidance  # noqa: PLC0415 - only to run the grammar in a test

    def accepts(spec: StructuredOutputs, text: str) -> bool:
        matcher = llguidance.LLMatcher(_byte_tokenizer(), spec.grammar(), log_level=0)
        return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting()

    weather = f'{OPEN}\n{{"name": "get_weather", "arguments": {{"city": "Paris"}}}}\n</tool_call>'
    add = f'{OPEN}\n{{"name": "add", "arguments": {{"a": 1, "b": 2}}}}\n</tool_call>'
    required = plan(tool_choice="required").constraint()
    assert accepts(required, weather) and accepts(required, add) and accepts(required, weather + "\n" + add)
    assert not accepts(required, "Sunny.") and not accepts(required, weather.replace('"Paris"', "3"))
    assert not accepts(plan(tool_choice="required", parallel_tool_calls=False).constraint(), weather + "\n" + add)
    named = plan(tool_choice={"type": "function", "function": {"name": "add"}}).constraint()
    assert accepts(named, add) and not accepts(named, weather) and not accepts(named, add + "\n" + add)
    assert plan().constraint() is None  # auto: nothing constrains the model


def _byte_tokenizer():
    import llguidance  # noqa: PLC0415

    class Bytes:  # a tokenizer whose token t is byte t, plus an end token
        eos_token_id = 256
        bos_token_id = None
        tokens = [bytes([i]) for i in range(256)] + [b"<end>"]
        special_token_ids = [256]

        def __call__(self, text):
            return list(text.encode() if isinstance(text, str) else text)

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(Bytes()))


def test_templates_without_tools_get_them_in_the_system_message_and_history_as_text():
    req = request(tools=[WEATHER], messages=[
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    ])
    messages, extra = template_messages(req.messages, plan_tools(req), native=False)
    assert extra == {}
    assert messages[0]["role"] == "system" and messages[0]["content"].startswith("Be brief.\n\n# Tools")
    assert json.dumps(WEATHER) in messages[0]["content"]
    assert messages[2]["content"] == f'{OPEN}\n{{"name": "get_weather", "arguments": {{"city": "Paris"}}}}\n</tool_call>'
    assert messages[3] == {"role": "user", "content": "<tool_response>\n18 C, sunny\n</tool_response>"}
    native, extra = template_messages(req.messages, plan_tools(req), native=True)
    assert extra == {"tools": [WEATHER]} and native[0]["content"] == "Be brief."
    assert native[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}  # an object, as HF templates expect
    assert native[3] == {"role": "tool", "content": "18 C, sunny", "tool_call_id": "call_1"}


def test_history_with_arguments_that_are_not_json_is_a_400():
    req = request(messages=[{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}])
    with pytest.raises(BadRequest, match="not JSON"):
        template_messages(req.messages, None, native=False)


TEXT = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n[{"name": "add", "arguments": {"a": 1, "b": 2}}]\n</tool_call>')


def parse(text: str, pieces: list[int], **fields):
    parser = ToolCallParser(plan(**fields))
    content, calls, start = "", [], 0
    for end in [*pieces, len(text)]:
        c, new = parser.feed(text[start:end])
        content, calls, start = content + c, calls + new, end
    content += parser.finish()
    assert calls == parser.calls
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def test_calls_are_parsed_out_of_the_text_whole_and_in_every_split():
    expected = ("Let me check.", [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})])
    assert parse(TEXT, []) == expected
    for cut in range(1, len(TEXT)):
        assert parse(TEXT, [cut]) == expected, cut
    assert parse(TEXT, list(range(1, len(TEXT)))) == expected  # one character at a time


def test_only_the_first_call_without_parallel_tool_calls():
    assert parse(TEXT, [], parallel_tool_calls=False)[1] == [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize(
    "text",
    [
        "No tools needed: 2 < 3 and <tool is not a tag.",
        f'{OPEN}\n{{"name": "unknown", "arguments": {{}}}}\n</tool_call>',
        f"{OPEN}\nnot json\n</tool_call>",
        f'{OPEN}\n{{"name": "add", "arguments": ',  # cut short (max_tokens)
        "ends with a partial tag <tool_",
        "  spaced  \n",
    ],
)
def test_what_is_not_a_known_call_stays_text_exactly(text):
    for cut in range(0, len(text) + 1, 3):
        assert parse(text, [cut] if cut else []) == (text, [])
