"""Structured outputs through the `openai` SDK on the built-in model (SmolLM2-135M-Instruct),
colocated and disaggregated: `client.chat.completions.parse(response_format=Model)` for 20
schemas (nested objects, arrays, enums, bounded numbers, required and optional fields) gives
answers that parse and validate, the same greedy answers in both modes and after the decode
replica streaming them is killed; and the 400s for what cannot be compiled."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
from concurrent.futures import ThreadPoolExecutor
from enum import StrEnum
from typing import Literal

import grpc
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from cluster.config import RoutingConfig
from cluster.engine.engine import Engine
from cluster.engine.sampling_params import SamplingParams
from cluster.engine.structured_outputs import StructuredOutputs
from cluster.model.builtin import builtin_model_path
from protos.pdserve.v1 import generation_pb2 as pb
from protos.pdserve.v1 import generation_pb2_grpc as pb_grpc
from tests.e2e.conftest import API_KEY, MODEL_NAME
from tests.helpers import all_blocks_returned, metric, wait_until

MAX_TOKENS = 200
Short = Field(max_length=40)


class Color(StrEnum):
    red = "red"
    green = "green"
    blue = "blue"


class Person(BaseModel):
    name: str = Short
    age: int = Field(ge=0, le=120)


class City(BaseModel):
    name: str = Short
    country: str = Short
    population: int = Field(ge=0, le=50_000_000)


class Address(BaseModel):
    street: str = Short
    city: str = Short
    zip_code: str = Field(pattern=r"^[0-9]{5}$")


class Employee(BaseModel):
    person: Person
    address: Address
    title: str = Short


class Book(BaseModel):
    title: str = Short
    author: str = Short
    year: int = Field(ge=1400, le=2030)
    genres: list[str] = Field(max_length=3)


class Shopping(BaseModel):
    items: list[str] = Field(min_length=1, max_length=5)


class Paint(BaseModel):
    color: Color
    liters: float = Field(ge=0.5, le=20)


class Answer(BaseModel):
    answer: Literal["yes", "no"]
    confidence: float = Field(ge=0, le=1)


class Pet(BaseModel):
    species: Literal["cat", "dog", "bird"]
    name: str = Short
    nickname: str | None = Field(default=None, max_length=20)


class Point(BaseModel):
    x: int = Field(ge=-100, le=100)
    y: int = Field(ge=-100, le=100)


class Polygon(BaseModel):
    points: list[Point] = Field(min_length=3, max_length=4)


class Weather(BaseModel):
    city: str = Short
    temperature_c: float = Field(ge=-50, le=60)
    humidity: int = Field(ge=0, le=100)
    conditions: Literal["sunny", "cloudy", "rain", "snow"]


class Flight(BaseModel):
    code: str = Field(pattern=r"^[A-Z]{2}[0-9]{3}$")
    origin: str = Short
    destination: str = Short
    passengers: int = Field(ge=1, le=400)


class Recipe(BaseModel):
    name: str = Short
    ingredients: list[str] = Field(min_length=2, max_length=4)
    minutes: int = Field(ge=1, le=300)
    vegetarian: bool


class Team(BaseModel):
    name: str = Short
    members: list[Person] = Field(min_length=1, max_length=3)


class Review(BaseModel):
    product: str = Short
    stars: int = Field(ge=1, le=5)
    summary: str | None = Field(default=None, max_length=60)


class Rgb(BaseModel):
    r: int = Field(ge=0, le=255)
    g: int = Field(ge=0, le=255)
    b: int = Field(ge=0, le=255)


class Planet(BaseModel):
    name: str = Short
    moons: int = Field(ge=0, le=200)
    has_rings: bool


class Event(BaseModel):
    title: str = Short
    date: str = Field(pattern=r"^20[0-9]{2}-[01][0-9]-[0-3][0-9]$")
    attendees: list[str] = Field(max_length=3)


class Order(BaseModel):
    order_id: int = Field(ge=1, le=99999)
    status: Literal["pending", "shipped", "delivered"]
    customer: Person
    total: float = Field(ge=0, le=10000)


CASES = [
    (Person, "Describe a person."),
    (City, "Describe a big city."),
    (Address, "Give me an address."),
    (Employee, "Describe an employee with their address."),
    (Book, "Describe a famous book."),
    (Shopping, "Write a short shopping list."),
    (Paint, "Pick a paint color and an amount."),
    (Answer, "Is the sky blue?"),
    (Pet, "Describe a pet."),
    (Polygon, "Give the corners of a square."),
    (Weather, "What is the weather in Paris?"),
    (Flight, "Describe a flight."),
    (Recipe, "Give me a simple recipe."),
    (Team, "Describe a small team."),
    (Review, "Review a phone."),
    (Rgb, "Give the RGB values of orange."),
    (Planet, "Describe Saturn."),
    (Event, "Describe a meeting next year."),
    (Order, "Describe an online order."),
    (Color, "Pick a color."),
]


def _messages(model, question: str) -> list[dict]:
    return [{"role": "system", "content": "Answer in JSON."}, {"role": "user", "content": question}]


def _wrapped(model):
    """An enum on its own is not an object: wrap it, as a user of parse() would."""
    if isinstance(model, type) and issubclass(model, BaseModel):
        return model
    return type(f"{model.__name__}Choice", (BaseModel,), {"__annotations__": {"value": model}})


# Two decode replicas (one to kill), every prompt prefilled on the prefill tier.
DISAGGREGATED = {"decodes": 2, "routing": RoutingConfig(max_local_prefill_tokens=0)}


@pytest.fixture(scope="module")
def engine_config(engine_config):
    """The built-in model (a real one: random weights would say nothing of whether a small
    model's constrained answers end), served under the module's model name."""
    return dataclasses.replace(engine_config, model=str(builtin_model_path()), max_model_len=1024)


@pytest.fixture(scope="module")
def client(live):
    with openai.OpenAI(base_url=live.http_url + "/v1", api_key=API_KEY, max_retries=0, timeout=300) as c:
        yield c


def parse_one(client, model, question: str) -> tuple[str, str]:
    completion = client.chat.completions.parse(
        model=MODEL_NAME, messages=_messages(model, question), response_format=_wrapped(model),
        temperature=0, max_completion_tokens=MAX_TOKENS,
    )
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop", (model.__name__, message.content)
    assert message.parsed is not None  # the SDK parsed and validated it with the pydantic model
    jsonschema.validate(json.loads(message.content), _wrapped(model).model_json_schema())
    return model.__name__, message.content


def parse_all(client) -> list[tuple[str, str]]:
    """Four at a time: the engines batch them (a row's greedy tokens do not depend on its batch)."""
    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(lambda case: parse_one(client, *case), CASES))


@pytest.fixture(scope="module")
def colocated_answers(live, client):
    live.redeploy(colocated=True)
    return parse_all(client)


def test_twenty_schemas_parse_and_validate_colocated(colocated_answers):
    assert len(colocated_answers) == 20
    assert len({content for _, content in colocated_answers}) == 20


def test_disaggregated_answers_are_the_colocated_ones(live, client, colocated_answers):
    """The first token is sampled under the grammar on the prefill side and replayed into the
    decode side's matcher: the greedy answers are identical."""
    live.redeploy(**DISAGGREGATED)
    assert parse_all(client) == colocated_answers
    stats = live.handle.worker_stats.remote().result()
    (prefill,) = stats["prefill"].values()
    assert all(d["local_prefills"] == 0 and d["computed_here"] == 0 for d in stats["decode"].values())
    assert sum(prefill["finished"].values()) >= len(CASES)  # every first token sampled there
    assert wait_until(lambda: all_blocks_returned(live.handle), timeout_s=30)


def test_a_constrained_stream_survives_its_decode_replica_being_killed(live, client, engine_config):
    """Killed mid-stream, the request moves with the tokens it streamed; the new decode
    replica replays them into its grammar, and the answer is the one an undisturbed run gives."""
    live.redeploy(**DISAGGREGATED)  # (the previous test's: nothing restarts)
    migrations = metric(live.scrape(), "pdserve_request_migrations_total")
    schema = {"type": "object", "properties": {"fruits": {"type": "array", "items": {"type": "string", "maxLength": 30},
                                                          "minItems": 12, "maxItems": 12}},
              "required": ["fruits"], "additionalProperties": False}
    messages = [{"role": "user", "content": "List twelve fruits as JSON."}]
    prompt = Engine(engine_config).tokenizer.encode_chat(messages)
    expected = Engine(engine_config).generate([prompt], SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0, structured=StructuredOutputs.json_schema(schema)))[0].text
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, temperature=0, max_completion_tokens=MAX_TOKENS, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "fruits", "schema": schema, "strict": True}},
    )
    text, killed = "", False
    for chunk in stream:
        text += chunk.choices[0].delta.content or "" if chunk.choices else ""
        if not killed and len(text) > 10:
            decodes = list(live.handle.worker_stats.remote().result()["decode"].values())
            victim = max(decodes, key=lambda s: s["running"])
            assert victim["running"] == 1
            os.kill(victim["pid"], signal.SIGKILL)
            killed = True
    assert killed and text == expected
    jsonschema.validate(json.loads(text), schema)
    assert metric(live.scrape(), "pdserve_request_migrations_total") == migrations + 1


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
         "response_format", "Invalid type: foo"),
        ({"extra_body": {"structured_outputs": {"regex": "a(b"}}}, "structured_outputs.regex", "unclosed group"),
        ({"extra_body": {"structured_outputs": {"grammar": "start: nowhere"}}}, "structured_outputs.grammar", "unknown name"),
        ({"response_format": {"type": "json_object"}, "extra_body": {"structured_outputs": {"choice": ["a"]}}},
         "structured_outputs.choice", "at most one output constraint"),
    ],
)
def test_a_constraint_that_cannot_compile_is_a_400_naming_it(live, client, body, param, says):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_completion_tokens=5, **body)
    error = e.value.body
    assert error["param"] == param and says in error["message"]


def test_a_grammar_that_outgrows_the_parser_mid_way_is_the_clients_error(live, client):
    """A schema that compiles but whose parse outgrows llguidance's limits once generation
    starts: a 400 saying so, not a 503 asking to retry."""
    schema = {"type": "object", "properties": {f"field_{i}": {"type": "string"} for i in range(600)}}
    with pytest.raises(openai.BadRequestError, match="constraint failed after"):
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "JSON please."}],
                                       max_completion_tokens=12, temperature=0,
                                       response_format={"type": "json_schema", "json_schema": {"name": "wide", "schema": schema}})


def test_completions_take_vllm_structured_outputs(live, client):
    out = client.completions.create(model=MODEL_NAME, prompt="The capital of France is", max_tokens=10, temperature=0,
                                    extra_body={"structured_outputs": {"choice": ["Paris", "Rome"]}})
    assert out.choices[0].text in ("Paris", "Rome") and out.choices[0].finish_reason == "stop"


def test_grpc_generate_takes_a_structured_output(live):
    with grpc.insecure_channel(live.grpc_target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        metadata = (("authorization", f"Bearer {API_KEY}"),)
        request = pb.GenerateRequest(text="A number between 1 and 99:", params=pb.SamplingParameters(
            max_tokens=10, temperature=0, structured=pb.StructuredOutput(regex="[1-9][0-9]?")))
        text = "".join(m.text for m in stub.Generate(request, metadata=metadata))
        assert 1 <= int(text) <= 99
        bad = pb.GenerateRequest(text="x", params=pb.SamplingParameters(structured=pb.StructuredOutput(json_schema="{")))
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(bad, metadata=metadata))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not JSON" in e.value.details()


# ---- tool calls ---------------------------------------------------------------------------


class GetWeather(BaseModel):
    """The current weather in a city."""

    city: str = Short
    unit: Literal["celsius", "fahrenheit"]


class Add(BaseModel):
    """Add two integers."""

    a: int = Field(ge=-1000, le=1000)
    b: int = Field(ge=-1000, le=1000)


class SendEmail(BaseModel):
    """Send an email."""

    to: str = Field(pattern=r"^[a-z]{1,12}@[a-z]{1,12}\.com$")
    subject: str = Short


TOOLS = [openai.pydantic_function_tool(m) for m in (GetWeather, Add, SendEmail)]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTIONS = ["What is the weather in Paris?", "What is 17 plus 25?", "Email bob@example.com to say hello.",
             "Is it raining in Tokyo?", "Add 3 and 4.", "Tell Alice that the meeting moved.", "How warm is Rome today?",
             "What is -8 plus 100?", "Write to carol@mail.com about lunch.", "Weather in Oslo in fahrenheit?"]


def _check_calls(message, allowed: set[str]) -> list:
    assert message.tool_calls, message.content
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return message.tool_calls


@pytest.mark.parametrize("choice", ["required", "required-one", "named"])
def test_tool_choice_required_and_a_named_function_always_give_valid_calls(live, client, choice):
    """Every answer holds valid calls. A named function, or `required` without parallel
    calls, gives exactly one; `required` with them lets the model make more, and this small
    one sometimes repeats calls until max_tokens (finish `length`, the complete calls kept)."""
    names = list(SCHEMAS)

    def ask(i: int):
        name = names[i % len(names)]
        tool_choice = {"type": "function", "function": {"name": name}} if choice == "named" else "required"
        return name, client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": QUESTIONS[i]}], tools=TOOLS, tool_choice=tool_choice,
            parallel_tool_calls=choice == "required", temperature=0, max_completion_tokens=MAX_TOKENS)

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, range(len(QUESTIONS))))
    for name, completion in answers:
        calls = _check_calls(completion.choices[0].message, {name} if choice == "named" else set(names))
        if choice == "required":
            assert completion.choices[0].finish_reason in ("tool_calls", "length")
        else:
            assert len(calls) == 1 and completion.choices[0].finish_reason == "tool_calls"
            assert completion.choices[0].message.content is None


def _weather(arguments: str) -> str:
    args = json.loads(arguments)
    return json.dumps({"city": args["city"], "temperature": 18 if args["unit"] == "celsius" else 64, "sky": "sunny"})


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_round_trip_through_the_sdk(live, client, stream):
    """Call, tool result, final answer; streamed, the SDK assembles the calls from the
    chunks' delta.tool_calls and gets the same call as without streaming."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    weather = [openai.pydantic_function_tool(GetWeather)]
    asked = {"model": MODEL_NAME, "tools": weather, "parallel_tool_calls": False, "temperature": 0, "max_completion_tokens": MAX_TOKENS}
    if stream:
        with client.chat.completions.stream(messages=messages, tool_choice="required", **asked) as s:
            events = [e.type for e in s]
            first = s.get_final_completion()
        assert "tool_calls.function.arguments.done" in events
    else:
        first = client.chat.completions.create(messages=messages, tool_choice="required", **asked)
    (call,) = _check_calls(first.choices[0].message, {"GetWeather"})
    assert first.choices[0].finish_reason == "tool_calls"
    assert json.loads(call.function.arguments)["city"] == "Paris"
    messages += [first.choices[0].message,  # as the SDK returned it (parse()'s fields too)
                 {"role": "tool", "tool_call_id": call.id, "content": _weather(call.function.arguments)}]
    final = client.chat.completions.create(messages=messages, tool_choice="none", **asked)
    assert final.choices[0].finish_reason in ("stop", "length") and final.choices[0].message.content
    assert not final.choices[0].message.tool_calls


def test_under_auto_a_plain_answer_stays_text(live, client):
    """Nothing constrains `auto`: this small model answers in prose, which stays the content
    (the parser's cases, calls among text included, are in tests/unit/test_tool_calls.py)."""
    free = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Say hello."}],
                                          tools=TOOLS, temperature=0, max_completion_tokens=30)
    assert free.choices[0].message.content and not free.choices[0].message.tool_calls
    assert free.choices[0].finish_reason in ("stop", "length")


def test_a_tool_choice_naming_an_unknown_function_is_a_400(live, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    assert e.value.body["param"] == "tool_choice" and "'nope'" in e.value.body["message"]
