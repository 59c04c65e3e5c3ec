"""OTLP trace export when `SVC_OTEL_ENDPOINT` is set: the spec's optional telemetry push.

With the setting blank nothing is installed: no middleware, no provider, no thread. With it set,
every HTTP request is a server span named `METHOD route`, where the route is the pattern
(`/v1/admin/users/{id}`), so ids in paths never become span names, and the child of the
caller's span when the request carries a W3C `traceparent`; a chat turn is a child span
with its token usage and finish reason. Spans carry no workspace, key, user, query string,
header or message text: only the method, the route, the status and the timing; a failure is
recorded by its error code or exception type (`error.type`), never its message or traceback.

Spans leave in batches over OTLP/HTTP (protobuf) to `<endpoint>/v1/traces` from the SDK's
background thread, so a slow or unreachable collector costs dropped spans and a warning in the
log, never a request. Metrics stay on `/metrics` (Prometheus); OTLP carries traces only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

from aiohttp import web
from aiohttp.typedefs import Handler
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer, get_current_span
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from actors.conversation import TurnResult
from gateway.errors import status_shown
from gateway.metrics import build_version
from gateway.state import SETTINGS
from schemas.errors import SvcError

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

log = logging.getLogger(__name__)

TRACER: web.AppKey[Tracer] = web.AppKey("svc_tracer")
EXPORT_TIMEOUT_S = 5.0
FLUSH_BOUND_S = 5.0
"""The most a stop waits for the last spans to be exported."""
UNMATCHED_ROUTE = "unmatched"
_W3C_TRACE_CONTEXT = TraceContextTextMapPropagator()


def otel_endpoint(app: web.Application) -> str:
    return app[SETTINGS].text("SVC_OTEL_ENDPOINT").strip()


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of a collector endpoint, as OTel's own exporters read
    `OTEL_EXPORTER_OTLP_ENDPOINT`: the base URL plus `/v1/traces`, unless it is already there."""
    base = endpoint.rstrip("/")
    return base if base.endswith("/v1/traces") else f"{base}/v1/traces"


def _shown(url: str) -> str:
    """The URL for the log, without any user:password it may carry."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:  # IPv6
        host = f"[{host}]"
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit(parts._replace(netloc=netloc))


async def telemetry_ctx(app: web.Application) -> AsyncIterator[None]:
    """Opens the tracer provider and its exporter; on close, exports what is left. The SDK
    and the exporter (with `requests` and `protobuf`) are imported only when tracing is on."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ALWAYS_ON

    url = traces_url(otel_endpoint(app))
    resource = Resource.create({"service.name": "svc", "service.version": build_version()})
    # Every request is traced: the SDK's default would follow the caller's sampled flag, and
    # any client could switch the tracing of its own requests off with a `traceparent`.
    provider = TracerProvider(resource=resource, sampler=ALWAYS_ON)
    exporter = OTLPSpanExporter(endpoint=url, timeout=EXPORT_TIMEOUT_S)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    app[TRACER] = provider.get_tracer("svc.gateway", build_version())
    log.info("telemetry: spans go over OTLP/HTTP to %s", _shown(url))
    try:
        yield
    finally:
        await _flushed(provider)


async def _flushed(provider: TracerProvider) -> None:
    """Export what is left, for at most FLUSH_BOUND_S. The SDK exports every queued batch,
    each with its own deadline, and waits up to 30 s: a collector that takes connections
    and never answers held a stop that long, past an orchestrator's grace. The flush runs
    in a daemon thread, which an exit does not wait for; spans it has not sent are dropped."""
    done = threading.Event()

    def flush() -> None:
        try:
            provider.shutdown()
        finally:
            done.set()

    threading.Thread(target=flush, name="svc-otel-flush", daemon=True).start()
    if not await asyncio.to_thread(done.wait, FLUSH_BOUND_S):
        log.warning(
            "telemetry: the last spans were not exported within %.0f s and are dropped",
            FLUSH_BOUND_S,
        )


def _route(request: web.Request) -> str:
    resource = request.match_info.route.resource
    return UNMATCHED_ROUTE if resource is None else resource.canonical


@web.middleware
async def tracing_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Outermost, so the span sees the status the client gets (errors are responses by then)."""
    tracer = request.app.get(TRACER)
    if tracer is None:  # the context has not opened yet, or is closing
        return await handler(request)
    route = _route(request)
    attributes = {"http.request.method": request.method, "http.route": route}
    # A caller's W3C `traceparent` makes this span a child of the caller's, so a trace runs
    # through the service; a malformed one is ignored (a new trace starts). Its `tracestate`
    # is not taken: the SDK would export that text, the caller's choice, on every span.
    parent = request.headers.get("traceparent")
    caller = _W3C_TRACE_CONTEXT.extract({} if parent is None else {"traceparent": parent})
    name = f"{request.method} {route}"
    with _span(tracer, name, SpanKind.SERVER, attributes, parent=caller) as span:
        response = await handler(request)
        status = status_shown(request, response)  # as the access log shows it
        span.set_attribute("http.response.status_code", status)
        if status >= 500:
            span.set_status(Status(StatusCode.ERROR))
            span.set_attribute("error.type", str(status))  # OpenTelemetry's HTTP convention
        return response


@contextlib.contextmanager
def turn_span(request: web.Request, streamed: bool) -> Iterator[Span | None]:
    """A child span of the request's for one chat turn, or None when tracing is off."""
    tracer = request.app.get(TRACER)
    if tracer is None:
        yield None
        return
    attributes: dict[str, str | bool] = {
        "gen_ai.operation.name": "chat",
        "svc.turn.streamed": streamed,
    }
    with _span(tracer, "chat turn", SpanKind.INTERNAL, attributes) as span:
        yield span


@contextlib.contextmanager
def _span(
    tracer: Tracer,
    name: str,
    kind: SpanKind,
    attributes: Mapping[str, str | bool],
    parent: Context | None = None,
) -> Iterator[Span]:
    """A span that records a failure by its type or error code only: the SDK's own exception
    event would carry the message and traceback, which can hold an upstream's error text,
    database detail or a key an upstream echoed back."""
    with tracer.start_as_current_span(
        name,
        context=parent,
        kind=kind,
        attributes=attributes,
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        try:
            yield span
        except ConnectionResetError:
            # A client's hang-up is not the service's failure: the answer is a 499, and a
            # turn goes on in its actor and is recorded.
            raise
        except BaseException as exc:
            _mark_failed(span, exc)
            raise


def _mark_failed(span: Span, exc: BaseException) -> None:
    span.set_status(Status(StatusCode.ERROR))
    span.set_attribute("error.type", exc.code if isinstance(exc, SvcError) else type(exc).__name__)


def record_failure(exc: BaseException) -> None:
    """A failure the handler answered itself (a stream's error frame, once its 200 went out)
    on the current span, by its code or type as a raised one is (a no-op when tracing is off)."""
    span = get_current_span()
    if span.is_recording():
        _mark_failed(span, exc)


def current_traceparent() -> str | None:
    """The W3C `traceparent` of the current span (the turn's), or None when tracing is off."""
    carrier: dict[str, str] = {}
    _W3C_TRACE_CONTEXT.inject(carrier)
    return carrier.get("traceparent")


def record_turn(result: TurnResult) -> None:
    """Usage and finish reason on the current turn span (a no-op when tracing is off)."""
    span = get_current_span()
    if not span.is_recording():
        return
    span.set_attribute("gen_ai.usage.input_tokens", result.usage.prompt_tokens)
    span.set_attribute("gen_ai.usage.output_tokens", result.usage.completion_tokens)
    if result.finish_reason:
        span.set_attribute("gen_ai.response.finish_reasons", (result.finish_reason,))


def install(app: web.Application) -> None:
    """Tracing when `SVC_OTEL_ENDPOINT` is set; nothing at all otherwise."""
    if not otel_endpoint(app):
        return
    app.middlewares.insert(0, tracing_middleware)
    app.cleanup_ctx.append(telemetry_ctx)
