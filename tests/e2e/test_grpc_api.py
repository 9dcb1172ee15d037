"""Generated gRPC stubs against a real local cluster: the same tokens as the offline
engine, status codes mapped like HTTP's, Abort and cancellation free every block, and
the standard health and reflection services answer."""

import threading

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from cluster.engine.engine import Engine
from cluster.engine.sampling_params import SamplingParams
from protos.pdserve.v1 import generation_pb2 as pb
from protos.pdserve.v1 import generation_pb2_grpc as pb_grpc
from tests.e2e.conftest import API_KEY, MODEL_NAME
from tests.helpers import all_blocks_returned, wait_until

AUTH = (("authorization", f"Bearer {API_KEY}"),)
PROMPT = "You are a helpful assistant. What is the capital of France?"
LONG = 480  # tokens: a stream that is still running when its cancellation arrives


@pytest.fixture(scope="module")
def channel(live):
    with grpc.insecure_channel(live.grpc_target) as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(channel):
    return pb_grpc.GenerationStub(channel)


def greedy(max_tokens=12):
    return pb.SamplingParameters(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def test_generate_streams_the_offline_engines_tokens(stub, engine_config):
    (want,) = Engine(engine_config).generate([PROMPT], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    messages = list(stub.Generate(pb.GenerateRequest(model=MODEL_NAME, text=PROMPT, params=greedy()), metadata=AUTH))
    assert [t for m in messages for t in m.token_ids] == want.token_ids
    assert "".join(m.text for m in messages) == want.text
    assert [m.finish_reason for m in messages][-1] == pb.FINISH_REASON_LENGTH
    assert {m.finish_reason for m in messages[:-1]} <= {pb.FINISH_REASON_UNSPECIFIED}
    usage = messages[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(want.prompt_token_ids), 12)
    # Token ids in, the same tokens out; the model may be left empty.
    by_ids = list(stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=want.prompt_token_ids), params=greedy()), metadata=AUTH))
    assert [t for m in by_ids for t in m.token_ids] == want.token_ids


def test_list_models(stub):
    (model,) = stub.ListModels(pb.ListModelsRequest(), metadata=AUTH).models
    assert model.id == MODEL_NAME and model.max_model_len == 512


@pytest.mark.parametrize(
    "request_, code",
    [
        (pb.GenerateRequest(text=PROMPT, params=pb.SamplingParameters(max_tokens=100_000)), grpc.StatusCode.INVALID_ARGUMENT),
        (pb.GenerateRequest(text=PROMPT, params=pb.SamplingParameters(temperature=-1)), grpc.StatusCode.INVALID_ARGUMENT),
        (pb.GenerateRequest(params=greedy()), grpc.StatusCode.INVALID_ARGUMENT),  # no prompt
        (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[10**9])), grpc.StatusCode.INVALID_ARGUMENT),
        (pb.GenerateRequest(model="other", text=PROMPT), grpc.StatusCode.NOT_FOUND),
    ],
)
def test_bad_requests_get_their_status_code(stub, request_, code):
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(request_, metadata=AUTH))
    assert e.value.code() == code and e.value.details()
    assert "Traceback" not in e.value.details()


def test_bytes_that_are_no_message_are_a_clients_error(channel):
    """Garbage in place of a message is INVALID_ARGUMENT on every RPC (grpc's own answer, an
    UNKNOWN "Unexpected DecodeError", was a server error), and says which message."""
    for method, streams in (("Generate", True), ("Abort", False), ("ListModels", False)):
        make = channel.unary_stream if streams else channel.unary_unary
        call = make(f"/pdserve.v1.Generation/{method}", request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as e:
            reply = call(b"\xff\xff\xff\xff not a message", metadata=AUTH, timeout=60)
            list(reply) if streams else reply
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method
        assert e.value.details().startswith(f"the request is not a valid pdserve.v1.{method}Request message")


def test_every_rpc_refuses_a_missing_or_wrong_key(stub):
    calls = [
        lambda md: list(stub.Generate(pb.GenerateRequest(text=PROMPT, params=greedy(2)), metadata=md)),
        lambda md: stub.ListModels(pb.ListModelsRequest(), metadata=md),
        lambda md: stub.Abort(pb.AbortRequest(request_id="x"), metadata=md),
    ]
    for call in calls:
        for md in ((), (("authorization", "Bearer wrong-key"),), (("authorization", API_KEY),)):
            with pytest.raises(grpc.RpcError) as e:
                call(md)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_health_needs_no_key_and_reflection_lists_the_services(channel):
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "pdserve.v1.Generation"):
        assert health.Check(health_pb2.HealthCheckRequest(service=service)).status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as e:
        health.Check(health_pb2.HealthCheckRequest(service="no.Such"))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    services = ProtoReflectionDescriptorDatabase(channel).get_services()
    assert {"pdserve.v1.Generation", "grpc.health.v1.Health"} <= set(services)


def _first_message_then(stub, request_id: str, started: threading.Event, outcome: dict):
    call = stub.Generate(pb.GenerateRequest(text="Hi", params=greedy(LONG), request_id=request_id), metadata=AUTH)
    outcome["call"] = call
    try:
        for i, _ in enumerate(call):
            outcome["received"] = i + 1
            started.set()
    except grpc.RpcError as e:
        outcome["code"] = e.code()
    finally:
        started.set()


def test_abort_ends_the_stream_and_frees_every_block(live, stub):
    started, outcome = threading.Event(), {}
    reader = threading.Thread(target=_first_message_then, args=(stub, "client-req-1", started, outcome))
    reader.start()
    assert started.wait(60)
    with pytest.raises(grpc.RpcError) as e:  # the id is taken while it runs
        list(stub.Generate(pb.GenerateRequest(text="Hi", params=greedy(2), request_id="client-req-1"), metadata=AUTH))
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
    stub.Abort(pb.AbortRequest(request_id="client-req-1"), metadata=AUTH)
    reader.join(60)
    assert outcome["code"] == grpc.StatusCode.CANCELLED and outcome["received"] < LONG
    assert wait_until(lambda: all_blocks_returned(live.handle), timeout_s=30)
    with pytest.raises(grpc.RpcError) as e:
        stub.Abort(pb.AbortRequest(request_id="client-req-1"), metadata=AUTH)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_another_keys_abort_finds_nothing(live, channel):
    """Request ids are each API key's own: another key's Abort of a running id is NOT_FOUND,
    word for word as for an id nobody runs, and the stream goes on."""
    other = (("authorization", "Bearer sk-other-tenant"),)
    live.redeploy(live.gateway_config(api_keys=(API_KEY, "sk-other-tenant")))
    stub = pb_grpc.GenerationStub(channel)
    try:
        started, outcome = threading.Event(), {}
        reader = threading.Thread(target=_first_message_then, args=(stub, "tenant-a-1", started, outcome))
        reader.start()
        assert started.wait(60)
        errors = []
        for request_id in ("tenant-a-1", "nobody-runs-this"):
            with pytest.raises(grpc.RpcError) as e:
                stub.Abort(pb.AbortRequest(request_id=request_id), metadata=other)
            errors.append((e.value.code(), e.value.details().replace(request_id, "ID")))
        assert errors[0] == errors[1] and errors[0][0] == grpc.StatusCode.NOT_FOUND
        # the same id under the other key is no conflict
        same_id = list(stub.Generate(pb.GenerateRequest(text="Hi", params=greedy(2), request_id="tenant-a-1"), metadata=other))
        assert same_id[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert reader.is_alive()  # still streaming: nothing of the other key's reached it
        stub.Abort(pb.AbortRequest(request_id="tenant-a-1"), metadata=AUTH)
        reader.join(60)
        assert outcome["code"] == grpc.StatusCode.CANCELLED
    finally:
        live.redeploy()


def test_a_client_that_cancels_its_call_aborts_the_request_on_every_tier(live, stub):
    """Through the default (direct) ingress; Serve's proxy ingress can lose a cancel that
    lands while it writes a message (README Limitations; tests/integration/test_serve_cli.py
    checks that no block is lost there either). The tiny model streams its LONG tokens in
    about a second: a test process stalled that long on a busy machine sees its request end
    by length before the cancel lands, so a lost race is tried again (a cancel that never
    aborts loses every round)."""
    def finished(reason: str) -> int:
        return sum(s["finished"].get(reason, 0) for s in live.handle.worker_stats.remote().result()["decode"].values())

    for _ in range(3):
        aborted_before, ended_before = finished("abort"), finished("length")
        call = stub.Generate(pb.GenerateRequest(text="Hi", params=greedy(LONG)), metadata=AUTH)
        next(call)  # the first token comes from the prefill side:
        next(call)  # the second from decode, so the request is there when the cancel lands
        call.cancel()
        assert wait_until(lambda: all_blocks_returned(live.handle), timeout_s=30)
        if finished("length") == ended_before:  # the cancel landed while it ran
            break
    assert finished("abort") == aborted_before + 1


@pytest.mark.parametrize(
    "http_field, value, grpc_params",
    [
        ("temperature", 3.0, pb.SamplingParameters(temperature=3.0)),
        ("top_p", 0.0, pb.SamplingParameters(top_p=0.0)),
        ("logprobs", 30, pb.SamplingParameters(logprobs=30)),
        ("stop", [f"s{i}" for i in range(17)], pb.SamplingParameters(stop=[f"s{i}" for i in range(17)])),
    ],
)
def test_limits_are_refused_in_the_same_words_on_both_apis(live, auth, stub, http_field, value, grpc_params):
    r = httpx.post(live.http_url + "/v1/completions", headers=auth, timeout=30,
                   json={"model": MODEL_NAME, "prompt": "hi", http_field: value})
    assert r.status_code == 400
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(pb.GenerateRequest(text="hi", params=grpc_params), metadata=AUTH))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert r.json()["error"]["message"] == e.value.details()
    assert r.json()["error"]["param"] == http_field
