"""A trace per request across the gateway, decode and prefill processes (OpenTelemetry, OTLP
over HTTP) to a real receiver this test runs: the client's W3C traceparent is continued, and
each request's spans from the three processes form one connected tree."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import openai
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from prometheus_client.parser import text_string_to_metric_families

from cluster.config import RoutingConfig
from cluster.serving import tracing
from protos.pdserve.v1 import generation_pb2 as pb
from protos.pdserve.v1 import generation_pb2_grpc as pb_grpc
from tests.e2e.conftest import API_KEY, MODEL_NAME
from tests.helpers import wait_until

SERVICES = {"pdserve-gateway", "pdserve-decode", "pdserve-prefill"}


class Collector:
    """An OTLP/HTTP trace receiver: POST /v1/traces (protobuf), spans kept by trace id."""

    def __init__(self):
        self.spans: dict[str, list[dict]] = defaultdict(list)
        self._lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = ExportTraceServiceRequest.FromString(body)
                collector._keep(request)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()
                self.wfile.write(b"")

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _keep(self, request: ExportTraceServiceRequest) -> None:
        with self._lock:
            for resource_spans in request.resource_spans:
                service = {a.key: a.value.string_value for a in resource_spans.resource.attributes}["service.name"]
                for scope in resource_spans.scope_spans:
                    for s in scope.spans:
                        self.spans[s.trace_id.hex()].append({
                            "service": service, "name": s.name, "id": s.span_id.hex(), "parent": s.parent_span_id.hex(),
                            "attributes": {a.key: _value(a.value) for a in s.attributes},
                            "events": [e.name for e in s.events], "error": s.status.code == 2,
                        })

    def trace(self, trace_id: str) -> list[dict]:
        with self._lock:
            return list(self.spans.get(trace_id, ()))


def _value(v):
    return getattr(v, v.WhichOneof("value"))


@pytest.fixture(scope="module")
def collector(live):
    c = Collector()
    # Every prompt to the prefill tier, so each trace crosses all three processes.
    live.redeploy(otlp_endpoint=c.url, routing=RoutingConfig(max_local_prefill_tokens=0))
    yield c
    c.server.shutdown()


def connected_tree(spans: list[dict], root_parent: str) -> dict[str, list[str]]:
    """{parent span id: child names}, after checking that exactly one span hangs from
    `root_parent` (the client's span) and every other span's parent is in the trace."""
    ids = {s["id"] for s in spans}
    roots = [s for s in spans if s["parent"] == root_parent]
    assert len(roots) == 1, [s["name"] for s in roots]
    for s in spans:
        assert s is roots[0] or s["parent"] in ids, f"{s['service']}/{s['name']} hangs from outside the trace"
    children = defaultdict(list)
    for s in spans:
        children[s["parent"]].append(s["name"])
    return children


def complete(collector: Collector, trace_id: str, names: set[str]) -> bool:
    spans = collector.trace(trace_id)
    return SERVICES <= {s["service"] for s in spans} and names <= {s["name"] for s in spans}


def test_a_chat_request_is_one_trace_across_the_three_processes(live, collector):
    trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    with openai.OpenAI(base_url=live.http_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60) as client:
        reply = client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "Tell me about foxes " * 8}], max_tokens=8,
            temperature=0, extra_headers={"traceparent": f"00-{trace_id}-{parent}-01"},
        )
    names = {"chat.completions", "admission", "tokenize", "generate", "attempt", "route",
             "decode", "reserve", "prefill_call", "kv_receive", "handoff", "prefill", "kv_send"}
    assert wait_until(lambda: complete(collector, trace_id, names), timeout_s=20)
    time.sleep(1)  # the last batches (parts sent after the prefill's span ended)
    spans = collector.trace(trace_id)
    children = connected_tree(spans, parent)
    by_name = {s["name"]: s for s in spans}
    assert by_name["chat.completions"]["service"] == "pdserve-gateway"
    assert set(children[by_name["chat.completions"]["id"]]) == {"admission", "tokenize", "generate"}
    assert by_name["decode"]["parent"] == by_name["attempt"]["id"] and by_name["decode"]["service"] == "pdserve-decode"
    assert by_name["prefill"]["parent"] == by_name["prefill_call"]["id"] and by_name["prefill"]["service"] == "pdserve-prefill"
    assert "first_token" in by_name["attempt"]["events"] and "first_token" in by_name["decode"]["events"]
    assert by_name["decode"]["attributes"]["output_tokens"] == reply.usage.completion_tokens == 8
    assert by_name["generate"]["attributes"]["prompt_tokens"] == reply.usage.prompt_tokens
    route = by_name["route"]["attributes"]
    assert {"prefill_worker", "decode_worker", "predicted_hit_tokens", "policy"} <= set(route)
    for part in (s for s in spans if s["name"] in ("kv_send", "kv_receive")):
        assert part["attributes"]["path"] == "shared_memory" and part["attributes"]["bytes_rank0"] > 0
    assert not any(s["error"] for s in spans)
    # The same phases, traced or not, as histograms per tier (every phase of this request seen).
    families = {f.name: f for f in text_string_to_metric_families(live.scrape())}
    seen = {(s.labels["tier"], s.labels["phase"]) for s in families["pdserve_request_phase_seconds"].samples
            if s.name.endswith("_count") and s.value > 0}
    assert {(tier, phase) for tier, phases in tracing.PHASES.items() for phase in phases} <= seen


def test_a_grpc_generate_continues_the_callers_trace(live, collector):
    trace_id, parent = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    with grpc.insecure_channel(live.grpc_target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        request = pb.GenerateRequest(text="Hello there", params=pb.SamplingParameters(max_tokens=4, temperature=0))
        list(stub.Generate(request, metadata=(("authorization", f"Bearer {API_KEY}"),
                                              ("traceparent", f"00-{trace_id}-{parent}-01"))))
    assert wait_until(lambda: complete(collector, trace_id, {"grpc.Generate", "decode", "prefill"}), timeout_s=20)
    children = connected_tree(collector.trace(trace_id), parent)
    assert "generate" in [name for names in children.values() for name in names]


def test_a_refused_request_ends_its_span_with_the_error(live, collector):
    trace_id, parent = "1af7651916cd43dd8448eb211c80319d", "c7ad6b7169203332"
    with openai.OpenAI(base_url=live.http_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60) as client:
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=5,
                                      extra_body={"structured_outputs": {"regex": "a(b"}},
                                      extra_headers={"traceparent": f"00-{trace_id}-{parent}-01"})
    assert wait_until(lambda: collector.trace(trace_id), timeout_s=20)
    (request,) = [s for s in collector.trace(trace_id) if s["name"] == "completions"]
    assert request["error"] and request["parent"] == parent


def test_off_by_default_a_span_is_nothing_and_messages_carry_no_context():
    assert not tracing.enabled()  # this process configured no endpoint
    span = tracing.start("request", {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"})
    assert span is tracing.NO_SPAN and span.child("x") is tracing.NO_SPAN and span.carrier() == ()
