"""The gateway's parts without a cluster: admission slots (fair between keys), request size
limits, API keys, the error table, request schemas (strict), gRPC Abort's timing against the
task that streams and its scoping per key, readiness at a bounded rate, the Redis token
bucket against a real redis-server, and what the gateway imports."""

import asyncio
from contextlib import asynccontextmanager
from types import SimpleNamespace

import grpc
import pytest
from prometheus_client import CollectorRegistry, Counter
from pydantic import ValidationError

from cluster.engine.input_processor import TokenizedRequest
from cluster.engine.outputs import RequestOutput
from cluster.errors import InvalidRequestError, KVCacheFullError
from cluster.launch.redis_server import PrivateRedis
from protos.pdserve.v1 import generation_pb2 as pb
from router.admission import Admission, RequestLimits
from router.auth import ApiKeyAuth, load_api_keys
from router.errors import (
    Aborted,
    AlreadyExists,
    BadRequest,
    GatewayError,
    NotFound,
    Overloaded,
    RateLimited,
    Unauthorized,
    Unavailable,
    from_exception,
)
from router.grpc_serving import GrpcServing
from router.metrics import GatewayMetrics
from router.protocol import ChatCompletionRequest, CompletionRequest
from router.rate_limit import RateLimiter
from router.readiness import Readiness
from tests.helpers import fresh_imports

# ---- imports -----------------------------------------------------------------------------


def test_the_gateway_imports_no_torch():
    """The gateway relays tokens and text: torch (and what comes with it: triton, sympy)
    would cost each gateway replica seconds of start and hundreds of MB for nothing."""
    assert fresh_imports("import router.gateway", ("torch", "triton", "sympy"))[0] == []


# ---- admission ---------------------------------------------------------------------------


def test_admission_runs_queues_then_refuses():
    async def scenario():
        admission = Admission(max_running=1, max_queued=1, queue_timeout_s=5, retry_after_s=3)
        release_first = asyncio.Event()
        order = []

        async def request(name, hold=None):
            async with admission.slot():
                order.append(f"{name} runs")
                if hold is not None:
                    await hold.wait()

        first = asyncio.create_task(request("first", release_first))
        await asyncio.sleep(0)
        second = asyncio.create_task(request("second"))
        await asyncio.sleep(0)
        assert (admission.running, admission.queued) == (1, 1)
        with pytest.raises(Overloaded) as refused:
            await request("third")
        assert refused.value.retry_after_s == 3 and refused.value.status == 503
        release_first.set()
        await asyncio.gather(first, second)
        assert order == ["first runs", "second runs"]
        assert (admission.running, admission.queued) == (0, 0)

    asyncio.run(scenario())


def test_a_queued_request_gives_up_after_the_queue_timeout_and_frees_its_place():
    async def scenario():
        admission = Admission(max_running=1, max_queued=1, queue_timeout_s=0.05, retry_after_s=1)
        hold = asyncio.Event()

        async def holder():
            async with admission.slot():
                await hold.wait()

        task = asyncio.create_task(holder())
        await asyncio.sleep(0)
        with pytest.raises(Overloaded, match="no slot freed"):
            async with admission.slot():
                pass
        assert admission.queued == 0
        hold.set()
        await task
        async with admission.slot():  # the slot came back
            assert admission.running == 1

    asyncio.run(scenario())


def test_a_failing_request_returns_its_slot():
    async def scenario():
        admission = Admission(max_running=1, max_queued=0, queue_timeout_s=1, retry_after_s=1)
        with pytest.raises(RuntimeError):
            async with admission.slot():
                raise RuntimeError("boom")
        async with admission.slot():
            pass
        assert admission.running == 0

    asyncio.run(scenario())


def test_a_freed_slot_goes_to_the_key_that_holds_the_fewest():
    """Key a holds every slot and has two requests waiting; key b's request, later, runs
    next: one key at its limit does not starve another."""

    async def scenario():
        admission = Admission(max_running=2, max_queued=8, queue_timeout_s=30, retry_after_s=1)
        release = {name: asyncio.Event() for name in ("a1", "a2", "a3", "a4", "b1")}
        order = []

        async def request(key, name):
            async with admission.slot(key):
                order.append(name)
                await release[name].wait()

        tasks = [asyncio.create_task(request("a", name)) for name in ("a1", "a2", "a3", "a4")]
        await asyncio.sleep(0)
        tasks.append(asyncio.create_task(request("b", "b1")))
        await asyncio.sleep(0)
        assert order == ["a1", "a2"] and (admission.running, admission.queued) == (2, 3)
        release["a1"].set()
        await asyncio.sleep(0.01)
        assert order == ["a1", "a2", "b1"]  # before a3, which waited longer
        for event in release.values():
            event.set()
        await asyncio.gather(*tasks)
        assert order == ["a1", "a2", "b1", "a3", "a4"] and (admission.running, admission.queued) == (0, 0)

    asyncio.run(scenario())


def test_each_key_with_work_keeps_at_most_its_share_of_the_queue():
    """Alone, key a may fill the queue; when key b comes, a's newest waiter gives way (503),
    and a's further requests are refused at its share (429), naming the limit."""

    async def scenario():
        admission = Admission(max_running=1, max_queued=4, queue_timeout_s=30, retry_after_s=2)
        hold = asyncio.Event()

        async def request(key):
            async with admission.slot(key):
                await hold.wait()

        a = [asyncio.create_task(request("a")) for _ in range(5)]  # one runs, four wait: the queue is full
        await asyncio.sleep(0)
        assert (admission.running, admission.queued) == (1, 4)
        b = asyncio.create_task(request("b"))
        await asyncio.sleep(0)
        assert (admission.running, admission.queued) == (1, 4)
        with pytest.raises(Overloaded, match="share"):
            await a[-1]  # displaced
        with pytest.raises(RateLimited, match=r"share of the queue is 2 \(max_queued_requests 4 over 2 keys with work\)"):
            await request("a")
        hold.set()
        await asyncio.gather(*a[:-1], b)
        assert (admission.running, admission.queued) == (0, 0)

    asyncio.run(scenario())


def test_a_request_of_many_choices_waits_for_all_its_slots_and_is_not_overtaken():
    async def scenario():
        admission = Admission(max_running=4, max_queued=8, queue_timeout_s=30, retry_after_s=1)
        holds = [asyncio.Event() for _ in range(3)]
        order = []

        async def request(name, cost, hold=None):
            async with admission.slot("a", cost):
                order.append(name)
                if hold is not None:
                    await hold.wait()

        held = [asyncio.create_task(request(f"h{i}", 1, hold)) for i, hold in enumerate(holds)]
        await asyncio.sleep(0)
        big = asyncio.create_task(request("big", 3))
        await asyncio.sleep(0)
        small = asyncio.create_task(request("small", 1))
        await asyncio.sleep(0)
        assert order == ["h0", "h1", "h2"]  # one slot free: neither the big one nor the small one behind it runs
        for hold in holds:
            hold.set()
        await asyncio.gather(*held, big, small)
        assert order == ["h0", "h1", "h2", "big", "small"]
        with pytest.raises(BadRequest, match=r"at most 4 run at once \(max_running_requests\)"):
            async with admission.slot("a", 5):
                pass

    asyncio.run(scenario())


def test_a_key_at_its_own_cap_waits_while_others_run():
    async def scenario():
        admission = Admission(max_running=8, max_queued=8, queue_timeout_s=30, retry_after_s=1, max_running_per_key=2)
        release = asyncio.Event()
        order = []

        async def request(key, name):
            async with admission.slot(key):
                order.append(name)
                await release.wait()

        tasks = [asyncio.create_task(request("a", f"a{i}")) for i in range(3)] + [asyncio.create_task(request("b", "b0"))]
        await asyncio.sleep(0.01)
        assert order == ["a0", "a1", "b0"] and (admission.running, admission.queued) == (3, 1)  # a2 waits for a's own
        release.set()
        await asyncio.gather(*tasks)
        assert order[-1] == "a2"
        with pytest.raises(BadRequest, match=r"an API key runs at most 2 at once \(max_running_per_key\)"):
            async with admission.slot("a", 3):
                pass
        # A wait that outlasts the queue timeout because of the key's own cap is the key's limit (429), not overload.
        admission.queue_timeout_s = 0.05
        holders = [admission.slot("a") for _ in range(2)]
        for holder in holders:
            await holder.__aenter__()
        with pytest.raises(RateLimited, match=r"its cap is 2 \(max_running_per_key\)"):
            async with admission.slot("a"):
                pass
        for holder in holders:
            await holder.__aexit__(None, None, None)
        assert admission.running == 0

    asyncio.run(scenario())


def test_a_client_that_leaves_while_queued_frees_its_place():
    async def scenario():
        admission = Admission(max_running=1, max_queued=2, queue_timeout_s=30, retry_after_s=1)
        hold = asyncio.Event()

        async def request(key):
            async with admission.slot(key):
                await hold.wait()

        first = asyncio.create_task(request("a"))
        await asyncio.sleep(0)
        waiting = asyncio.create_task(request("b"))
        await asyncio.sleep(0)
        assert admission.queued == 1
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert admission.queued == 0
        hold.set()
        await first
        assert admission.running == 0

    asyncio.run(scenario())


def test_request_limits_name_the_limit():
    assert LIMITS.check_size(4, 2) == 8
    with pytest.raises(BadRequest, match=r"5 prompts in one request; the limit is 4 \(max_prompts_per_request\)"):
        LIMITS.check_size(5, 1)
    with pytest.raises(BadRequest, match=r"3 prompt\(s\) x n=3 is 9 choices; the limit is 8 \(max_choices_per_request\)"):
        LIMITS.check_size(3, 3)
    LIMITS.check_input_tokens(100)
    with pytest.raises(BadRequest, match=r"101 tokens; the limit is 100 \(max_request_input_tokens\)"):
        LIMITS.check_input_tokens(101)


# ---- API keys ----------------------------------------------------------------------------


def test_api_keys_from_flags_file_and_environment(tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text("# team keys\nsk-file-1\n\n  sk-file-2  \nsk-flag\n")
    keys = load_api_keys(["sk-flag"], str(key_file), env={"PDSERVE_API_KEY": "sk-env-1, sk-env-2"})
    assert keys == ("sk-flag", "sk-file-1", "sk-file-2", "sk-env-1", "sk-env-2")
    assert load_api_keys(None, None, env={}) == ()


def test_api_key_check():
    auth = ApiKeyAuth(("sk-a", "sk-b"))
    assert auth.check("Bearer sk-b") == "sk-b" and auth.check("bearer  sk-a") == "sk-a"
    for bad in (None, "", "Bearer", "Bearer ", "sk-a", "Basic sk-a", "Bearer sk-c", "Bearer sk-a2"):
        with pytest.raises(Unauthorized) as e:
            auth.check(bad)
        assert "sk-a" not in e.value.message and "sk-b" not in e.value.message
    assert ApiKeyAuth(()).check(None) == ""  # no keys configured: open


# ---- errors ------------------------------------------------------------------------------


def test_error_table_maps_http_and_grpc_alike():
    assert (BadRequest("x").status, BadRequest("x").grpc_code) == (400, grpc.StatusCode.INVALID_ARGUMENT)
    assert (Unauthorized("x").status, Unauthorized("x").grpc_code) == (401, grpc.StatusCode.UNAUTHENTICATED)
    assert (Overloaded("x").status, Overloaded("x").grpc_code) == (503, grpc.StatusCode.UNAVAILABLE)
    assert Aborted("x").grpc_code == grpc.StatusCode.CANCELLED
    assert Overloaded("x", retry_after_s=2).headers() == {"Retry-After": "2"}
    assert BadRequest("bad temperature", param="temperature").body() == {
        "error": {"message": "bad temperature", "type": "invalid_request_error", "param": "temperature", "code": None}
    }


def test_unexpected_errors_reveal_nothing():
    class Secret(Exception):
        pass

    error = from_exception(Secret(f"object at {hex(id(object()))} in /work/main/x.py"))
    assert type(error) is GatewayError and error.status == 500
    assert "0x" not in error.message and "/work" not in error.message
    assert isinstance(from_exception(InvalidRequestError("max_tokens must be >= 1")), BadRequest)

    assert isinstance(from_exception(KVCacheFullError("full")), Unavailable)


# ---- gRPC Abort --------------------------------------------------------------------------


class EndlessRouter:
    """What GrpcServing uses of the Router: a stream of one token per tick until closed."""

    def __init__(self):
        self.inputs = SimpleNamespace(process=lambda prompt, params: TokenizedRequest([1, 2, 3], params))
        self.metrics = GatewayMetrics(replica="test")  # its phase histograms
        self.closed = asyncio.Event()

    def new_request_id(self) -> str:
        return "internal"

    async def stream(self, request, request_id, trace=None):
        try:
            while True:
                await asyncio.sleep(0.001)
                yield RequestOutput(request_id, [7], "x", False, None, len(request.prompt_token_ids), 1, 0)
        finally:
            self.closed.set()


@asynccontextmanager
async def always_admitted(api_key, choices):
    yield


LIMITS = RequestLimits(max_prompts=4, max_choices=8, max_input_tokens=100)


def abortable_stream(api_key=""):
    router = EndlessRouter()
    serving = GrpcServing(router, "m", always_admitted, LIMITS)
    return router, serving, serving.stream(pb.GenerateRequest(text="hi", request_id="client-1"), api_key)


def test_an_abort_between_two_messages_spares_the_streaming_task_and_ends_at_the_next():
    """Between two messages the streaming task runs its server's code (grpc writing the
    last message, with user code on Serve's main loop): the abort must not cancel it."""

    async def scenario():
        router, serving, stream = abortable_stream()
        written, outcome = asyncio.Event(), {}

        async def server():  # stands for the task that takes messages and writes them
            await anext(stream)
            await written.wait()  # writing the message when the Abort comes
            outcome["write"] = "done"
            try:
                await anext(stream)
            except Aborted as e:
                outcome["next"] = e

        task = asyncio.create_task(server())
        await asyncio.sleep(0.01)
        serving.abort(pb.AbortRequest(request_id="client-1"))
        written.set()
        await task
        assert outcome["write"] == "done" and isinstance(outcome["next"], Aborted)
        assert router.closed.is_set()  # the stream is closed: aborted on every tier
        with pytest.raises(NotFound):
            serving.abort(pb.AbortRequest(request_id="client-1"))

    asyncio.run(scenario())


def test_an_abort_while_the_stream_waits_ends_it_with_a_status_not_a_cancellation():
    async def scenario():
        router, serving, stream = abortable_stream()
        first = asyncio.Event()

        async def server():
            await anext(stream)
            first.set()
            await anext(stream)  # waits inside the stream for the next token when the Abort comes

        task = asyncio.create_task(server())
        await first.wait()
        serving.abort(pb.AbortRequest(request_id="client-1"))
        with pytest.raises(Aborted):
            await task
        assert not task.cancelled() and task.cancelling() == 0
        assert router.closed.is_set()

    asyncio.run(scenario())


def test_request_ids_are_each_keys_own():
    """Another key's Abort of a running id is NOT_FOUND, as for an id nobody runs; the same
    id under another key is no conflict; under the same key it is."""

    async def scenario():
        router, serving, stream = abortable_stream(api_key="sk-a")
        await anext(stream)
        with pytest.raises(NotFound) as other:
            serving.abort(pb.AbortRequest(request_id="client-1"), "sk-b")
        with pytest.raises(NotFound) as nobody:
            serving.abort(pb.AbortRequest(request_id="no-such-id"), "sk-b")
        assert other.value.message == nobody.value.message.replace("no-such-id", "client-1")
        same_id_other_key = serving.stream(pb.GenerateRequest(text="hi", request_id="client-1"), "sk-b")
        await anext(same_id_other_key)
        with pytest.raises(AlreadyExists):
            await anext(serving.stream(pb.GenerateRequest(text="hi", request_id="client-1"), "sk-a"))
        serving.abort(pb.AbortRequest(request_id="client-1"), "sk-a")
        with pytest.raises(Aborted):
            await anext(stream)
        await same_id_other_key.aclose()

    asyncio.run(scenario())


def test_readiness_checks_at_most_once_per_interval():
    async def scenario():
        outcomes = [None, RuntimeError("down"), None]

        async def check():
            await asyncio.sleep(0.01)
            if (outcome := outcomes.pop(0)) is not None:
                raise outcome

        readiness = Readiness(check, timeout_s=5, interval_s=3600)
        assert await asyncio.gather(*(readiness.status() for _ in range(50))) == [None] * 50
        assert readiness.checks == 1  # fifty calls, one real check
        readiness.interval_s = 0  # every answer is stale now: each call starts a check if none runs
        assert await readiness.status() is None  # the last result at once; a check starts behind it
        await asyncio.sleep(0.05)
        assert await readiness.status() == "RuntimeError"  # and the third check starts
        await asyncio.sleep(0.05)
        assert await readiness.status() is None and readiness.checks == 3

    asyncio.run(scenario())


# ---- request schemas ---------------------------------------------------------------------


def test_requests_are_strict():
    ok = CompletionRequest.model_validate({"model": "m", "prompt": [1, 2, 3], "temperature": 1})
    assert ok.prompt == [1, 2, 3] and ok.max_tokens == 16
    for bad in (
        {"model": "m", "prompt": "hi", "max_tokens": "5"},  # no coercion from strings
        {"model": "m", "prompt": "hi", "surprise": True},  # no unknown fields
        {"model": "m", "prompt": [[]]},  # empty token list
        {"model": "m", "prompt": "hi", "n": 17},
        {"model": "m", "prompt": "hi", "temperature": 2.5},
        {"prompt": "hi"},
    ):
        with pytest.raises(ValidationError):
            CompletionRequest.model_validate(bad)
    chat = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "logprobs": True}
    )
    assert chat.messages[0].content[0].text == "hi"
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"model": "m", "messages": []})
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "robot", "content": "hi"}]})


# ---- rate limit --------------------------------------------------------------------------


def test_token_bucket_in_redis_is_per_key_and_refills():
    async def scenario(url):
        # 4 tokens/s: a token comes back every 250 ms, far longer than a few Redis round
        # trips on a busy machine (at 100/s one came back before the 4th call, now and then).
        limiter = RateLimiter(url, rate_per_s=4.0, burst=3)
        other = RateLimiter(url, rate_per_s=4.0, burst=3)  # a second gateway replica
        first = [await limiter.acquire("sk-a") for _ in range(2)] + [await other.acquire("sk-a")]
        assert first == [None, None, None]  # the burst, shared by both replicas
        retry = await other.acquire("sk-a")
        assert retry is not None and 0 < retry <= 0.25
        assert await limiter.acquire("sk-b") is None  # another key, another bucket
        await asyncio.sleep(retry + 0.02)
        assert await limiter.acquire("sk-a") is None  # refilled

    with PrivateRedis() as redis:
        asyncio.run(scenario(redis.url))


def test_a_request_takes_a_token_per_choice():
    async def scenario(url):
        limiter = RateLimiter(url, rate_per_s=0.01, burst=5)
        assert await limiter.acquire("sk-a", 4) is None
        assert await limiter.acquire("sk-a", 2) is not None  # one token left
        assert await limiter.acquire("sk-a", 1) is None
        with pytest.raises(RateLimited, match=r"needs 6 rate-limit tokens, and this API key's bucket holds 5 \(rate_limit_burst\)"):
            await limiter.acquire("sk-a", 6)

    with PrivateRedis() as redis:
        asyncio.run(scenario(redis.url))


def test_rate_limiter_lets_requests_through_when_redis_is_down():
    errors = Counter("errors", "", registry=CollectorRegistry())
    with PrivateRedis() as redis:
        url = redis.url
    limiter = RateLimiter(url, rate_per_s=1.0, burst=1, errors=errors)
    assert asyncio.run(limiter.acquire("sk-a")) is None
    assert errors._value.get() == 1
