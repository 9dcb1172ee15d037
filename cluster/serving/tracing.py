"""A trace of every request across the tiers (OpenTelemetry), off unless an OTLP endpoint is
configured (`--otlp-endpoint`).

    configure(service, endpoint)     once per process: a replica's constructor
    start(name, carrier, **attrs)    a span whose parent is in `carrier` (W3C trace context:
                                     an incoming `traceparent`, or what another tier sent)
    span.child(name, **attrs)        a span under it; span.carrier() for the next tier
    span.child(name, phases)         a phase (PHASES): a span that also times itself into its
                                     tier's histograms, traced or not

Parents are always explicit (never the "current span" of a context variable): a request's
code runs in async generators, on the engine's and the KV senders' threads, where an
implicit context would not follow it. Off, a span that is no phase is NO_SPAN, whose calls do
nothing (nothing imported, allocated or exported); a phase only times itself.

Each process exports its own spans (OTLP over HTTP, batched every 0.5 s); one trace id ties
them together: gateway `request` > `admission`, `tokenize`, `generate` > `attempt` >
`route`; decode `decode` > `reserve`, `prefill_call`, `kv_receive`, `handoff` (its first token
to its second); prefill `prefill` > `kv_send`.
"""

from __future__ import annotations

import atexit
import logging
import os
import time
from collections.abc import Iterable, Mapping
from typing import Any

from cluster.engine.step_times import Histograms

log = logging.getLogger(__name__)

TRACE_HEADERS = ("traceparent", "tracestate")  # W3C trace context
# A request's phases, each a span and, traced or not, a duration in its tier's histogram
# (`pdserve_request_phase_seconds{tier, phase}`): what a trace shows for one request, the
# histograms show for all.
PHASES = {
    "gateway": ("admission", "tokenize", "route"),
    "decode": ("reserve", "prefill_call", "kv_receive", "handoff"),
    "prefill": ("prefill", "kv_send"),
}
ENDPOINT_ENV = "PDSERVE_OTLP_ENDPOINT"  # set in every replica's environment by the app (ClusterConfig.otlp_endpoint)
EXPORT_DELAY_MS = 500

_tracer = None  # an opentelemetry Tracer once configured with an endpoint


def configure(service: str, endpoint: str | None = None) -> None:
    """Export this process's spans to `endpoint` (an OTLP/HTTP collector's base URL, e.g.
    http://collector:4318; default: $PDSERVE_OTLP_ENDPOINT) as service `service`; none
    leaves tracing off."""
    global _tracer
    endpoint = endpoint or os.environ.get(ENDPOINT_ENV)
    if not endpoint or _tracer is not None:
        return
    # Imported only when tracing is on: the SDK and the exporter cost ~0.1 s to import.
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # noqa: PLC0415
    from opentelemetry.sdk.resources import Resource  # noqa: PLC0415
    from opentelemetry.sdk.trace import TracerProvider  # noqa: PLC0415
    from opentelemetry.sdk.trace.export import BatchSpanProcessor  # noqa: PLC0415

    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    exporter = OTLPSpanExporter(endpoint=endpoint.rstrip("/") + "/v1/traces")
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=EXPORT_DELAY_MS))
    atexit.register(provider.shutdown)  # what is still batched goes out at a clean stop
    _tracer = provider.get_tracer("pdserve")
    log.info("tracing: %s's spans go to %s", service, endpoint)


def enabled() -> bool:
    return _tracer is not None


class Span:
    """A span, or nothing (NO_SPAN) when tracing is off; a phase span (`phases` given) also
    times itself into that histogram, traced or not. A context manager that ends it,
    recording an exception that escapes. Once ended it takes no more attributes, but may
    still have children (a KV part sent after its prompt's span ended)."""

    __slots__ = ("_span", "_open", "_phase", "_started")

    def __init__(self, span=None, phase: tuple[Histograms, str] | None = None):
        self._span = span
        self._open = span is not None
        self._phase = phase
        self._started = time.perf_counter() if phase is not None else 0.0

    def child(self, name: str, phases: Histograms | None = None, **attributes: Any) -> Span:
        """A span under this one; with `phases`, also the phase `name`'s duration there."""
        phase = (phases, name) if phases is not None else None
        if self._span is None:
            return NO_SPAN if phase is None else Span(None, phase)
        from opentelemetry.trace import set_span_in_context  # noqa: PLC0415 - on only

        span = _tracer.start_span(name, context=set_span_in_context(self._span), attributes=_clean(attributes))
        return Span(span, phase)

    def set(self, **attributes: Any) -> None:
        if self._open:
            self._span.set_attributes(_clean(attributes))

    def event(self, name: str, **attributes: Any) -> None:
        if self._open:
            self._span.add_event(name, _clean(attributes))

    def end(self, error: BaseException | None = None) -> None:
        """End it (recording `error`) and observe its phase's duration; a second end does nothing."""
        if self._phase is not None:
            histograms, name = self._phase
            self._phase = None
            histograms.observe_as(name, time.perf_counter() - self._started)
        if not self._open:
            return
        self._open = False
        if error is not None:
            from opentelemetry.trace import Status, StatusCode  # noqa: PLC0415 - on only

            self._span.record_exception(error)
            self._span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
        self._span.end()

    def carrier(self) -> tuple[tuple[str, str], ...]:
        """This span as W3C trace context, for a message to another tier (() when off)."""
        if self._span is None:
            return ()
        from opentelemetry.trace import set_span_in_context  # noqa: PLC0415 - on only
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator  # noqa: PLC0415

        out: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(out, context=set_span_in_context(self._span))
        return tuple(out.items())

    def __enter__(self) -> Span:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        self.end(error if isinstance(error, Exception) else None)


NO_SPAN = Span()


def start(name: str, carrier: Mapping[str, str] | Iterable[tuple[str, str]] = (), phases: Histograms | None = None,
          **attributes: Any) -> Span:
    """A span continuing the trace in `carrier` (W3C headers, or Span.carrier() of another
    tier), or the first of a new trace; with `phases`, as Span.child's."""
    phase = (phases, name) if phases is not None else None
    if _tracer is None:
        return NO_SPAN if phase is None else Span(None, phase)
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator  # noqa: PLC0415 - on only

    headers = dict(carrier.items() if isinstance(carrier, Mapping) else carrier)
    context = TraceContextTextMapPropagator().extract({k: v for k, v in headers.items() if k.lower() in TRACE_HEADERS})
    return Span(_tracer.start_span(name, context=context, attributes=_clean(attributes)), phase)


def _clean(attributes: dict[str, Any]) -> dict[str, Any]:
    """OTel takes str, bool, int, float (or sequences of them): drop None, str() the rest."""
    return {k: v if isinstance(v, str | bool | int | float) else str(v) for k, v in attributes.items() if v is not None}
