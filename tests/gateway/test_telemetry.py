"""OTLP trace export (SVC_OTEL_ENDPOINT) to a collector on loopback that decodes what the
OpenTelemetry SDK's own exporter sends: request spans named by route, a chat turn as their
child with its usage, nothing tenant-specific or secret, and nothing at all when unset."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from platform_support import running, settings_for
from stub_upstream import Fault, StubUpstream

from gateway import telemetry
from gateway.telemetry import TRACER, traces_url

CALLER_TRACE, CALLER_SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
CALLER_TRACEPARENT = f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"


class Collector:
    """The OTLP/HTTP traces endpoint of a collector: every span it receives, decoded."""

    def __init__(self) -> None:
        self.spans: list[Any] = []
        self.resources: list[dict[str, Any]] = []

    async def traces(self, request: web.Request) -> web.Response:
        assert request.content_type == "application/x-protobuf"
        export = ExportTraceServiceRequest.FromString(await request.read())
        for resource_spans in export.resource_spans:
            self.resources.append(_attributes(resource_spans.resource.attributes))
            for scope_spans in resource_spans.scope_spans:
                self.spans.extend(scope_spans.spans)
        body = ExportTraceServiceResponse().SerializeToString()
        return web.Response(body=body, content_type="application/x-protobuf")

    @asynccontextmanager
    async def running(self) -> AsyncIterator[str]:
        app = web.Application()
        app.router.add_post("/v1/traces", self.traces)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        try:
            yield f"http://127.0.0.1:{runner.addresses[0][1]}"
        finally:
            await runner.cleanup()


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


def _attributes(pairs: Any) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs}


def test_traces_url_follows_the_otlp_convention() -> None:
    assert traces_url("http://collector:4318") == "http://collector:4318/v1/traces"
    assert traces_url("http://collector:4318/") == "http://collector:4318/v1/traces"
    assert traces_url("https://c.example/v1/traces") == "https://c.example/v1/traces"


async def test_requests_and_turns_are_exported_as_spans(database_url: str) -> None:
    collector = Collector()
    async with collector.running() as endpoint:
        settings = settings_for(database_url, SVC_OTEL_ENDPOINT=endpoint)
        async with running(settings) as svc:
            ws = "ws-otel-secret-tenant"
            key, _ = await svc.issue_key(ws)
            secret_text = "my private question about payroll"
            chat = {"model": "svc-offline", "messages": [{"role": "user", "content": secret_text}]}
            status, _, _ = await svc.request("POST", "/v1/chat/completions", key, json=chat)
            assert status == 200
            status, _, _ = await svc.request(
                "GET", "/v1/admin/users/u-hidden-id?token=query-secret", key
            )
            assert status == 400  # an unknown query parameter, refused
            status, _, _ = await svc.request("GET", "/no/such/path")
            assert status == 404
            not_sampled = CALLER_TRACEPARENT[:-2] + "00"  # the caller's flag: not recorded
            for traceparent in (CALLER_TRACEPARENT, "00-not-a-trace-01", not_sampled):
                headers = {"traceparent": traceparent, "tracestate": "leak=caller-chosen-text"}
                status, _, _ = await svc.request("GET", "/v1/models", key, headers=headers)
                assert status == 200
        # Leaving `running` closed the app, which flushed the last batch to the collector.

    assert collector.resources and collector.resources[0]["service.name"] == "svc"
    by_name: dict[str, list[Any]] = {}
    for span in collector.spans:
        by_name.setdefault(span.name, []).append(span)
    (request_span,) = by_name["POST /v1/chat/completions"]
    request_attrs = _attributes(request_span.attributes)
    assert request_attrs["http.route"] == "/v1/chat/completions"
    assert request_attrs["http.response.status_code"] == 200
    (turn,) = by_name["chat turn"]
    assert turn.trace_id == request_span.trace_id and turn.parent_span_id == request_span.span_id
    usage = _attributes(turn.attributes)
    assert usage["gen_ai.usage.input_tokens"] > 0 and usage["gen_ai.usage.output_tokens"] > 0
    assert usage["gen_ai.response.finish_reasons"] == ["stop"]
    (user_span,) = by_name["GET /v1/admin/users/{id}"]
    assert _attributes(user_span.attributes)["http.response.status_code"] == 400
    assert _attributes(by_name["GET unmatched"][0].attributes)["http.response.status_code"] == 404
    # A caller's traceparent makes the request span its child; a malformed one starts anew.
    continued, fresh, unsampled = by_name["GET /v1/models"]
    assert (continued.trace_id.hex(), continued.parent_span_id.hex()) == (CALLER_TRACE, CALLER_SPAN)
    assert all(not span.trace_state for span in collector.spans)  # the caller's text: not kept
    # A caller cannot switch the tracing of its requests off: traced all the same.
    assert unsampled.trace_id.hex() == CALLER_TRACE
    assert fresh.trace_id.hex() != CALLER_TRACE and not fresh.parent_span_id
    assert request_span.trace_id.hex() != CALLER_TRACE and not request_span.parent_span_id

    everything = repr([(s.name, _attributes(s.attributes)) for s in collector.spans])
    for private in (ws, key, secret_text, "u-hidden-id", "query-secret"):
        assert private not in everything, private


@asynccontextmanager
async def _traced_service(
    database_url: str, stub: StubUpstream, collector: Collector
) -> AsyncIterator[Any]:
    """A service whose model server is `stub` (stopped afterwards), traced to `collector`;
    leaving it flushes the last spans."""
    try:
        async with collector.running() as endpoint:
            settings = settings_for(
                database_url,
                SVC_OTEL_ENDPOINT=endpoint,
                SVC_LLM_GATEWAY_URL=stub.base_url,
                SVC_LLM_MODEL="upstream-model",
            )
            async with running(settings) as svc:
                yield svc
    finally:
        await stub.stop()


def _chat(stream: bool) -> dict[str, Any]:
    return {
        "model": "upstream-model",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": stream,
    }


async def _traced_upstream_turn(
    database_url: str, stub: StubUpstream, workspace: str, *, stream: bool
) -> tuple[Collector, int, Any]:
    """One chat turn against `stub`, traced to a collector: the spans, status and body."""
    collector = Collector()
    async with _traced_service(database_url, stub, collector) as svc:
        key, _ = await svc.issue_key(workspace)
        status, body, _ = await svc.request("POST", "/v1/chat/completions", key, json=_chat(stream))
    return collector, status, body


async def test_a_failed_turn_is_recorded_by_its_code_without_its_message(
    database_url: str,
) -> None:
    """An upstream's error text can echo a credential: the span gets the error code only."""
    stub = await StubUpstream().start()
    upstream_text = "context window exceeded for key sk-pro****wxyz"
    stub.faults.append(Fault(400, upstream_text))
    collector, status, body = await _traced_upstream_turn(
        database_url, stub, "ws-otel-failure", stream=False
    )
    assert status == 502 and body["error"]["code"] == "upstream_rejected"

    (turn,) = [span for span in collector.spans if span.name == "chat turn"]
    # The model server was told the turn's trace context: its spans join the turn's trace.
    sent = {h.get("traceparent", "")[:52] for h in stub.headers}  # version, trace id, span id
    assert sent == {f"00-{turn.trace_id.hex()}-{turn.span_id.hex()}"}, stub.headers
    assert turn.status.code == turn.status.STATUS_CODE_ERROR
    assert _attributes(turn.attributes)["error.type"] == "upstream_rejected"
    assert list(turn.events) == []  # no exception event: it would carry message and traceback
    everything = repr(collector.spans)
    assert "sk-pro" not in everything and "context window" not in everything


async def test_a_stream_that_fails_after_its_first_chunk_is_a_failed_span(
    database_url: str,
) -> None:
    """Review finding: once a stream's 200 is out, its failure is an error frame the handler
    writes itself; the turn's span closed as a success, while the metrics counted a failure."""
    stub = await StubUpstream().start()
    stub.drop_after = 2
    collector, status, text = await _traced_upstream_turn(
        database_url, stub, "ws-otel-stream", stream=True
    )
    assert status == 200 and "upstream_interrupted" in text, text

    (turn,) = [span for span in collector.spans if span.name == "chat turn"]
    assert turn.status.code == turn.status.STATUS_CODE_ERROR
    assert _attributes(turn.attributes)["error.type"] == "upstream_interrupted"
    assert list(turn.events) == []


async def test_a_client_that_leaves_is_a_499_and_its_turn_no_failure(database_url: str) -> None:
    """QA finding: a stream whose client left before its first chunk made the turn span a
    failure (`ClientConnectionResetError`), and a JSON request's span said 200 where the
    access log and the metrics said 499. The turns ran on and were recorded."""
    stub = await StubUpstream(delay_s=0.5).start()
    collector = Collector()
    async with _traced_service(database_url, stub, collector) as svc:
        key, _ = await svc.issue_key("ws-otel-leaving")
        before = await _hang_ups(svc)  # the counter is the process's: other tests' too
        for stream in (True, False):
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.2):  # leaves while the model thinks
                    await svc.request("POST", "/v1/chat/completions", key, json=_chat(stream))
        async with asyncio.timeout(10):
            while len(stub.headers) < 2 or await _hang_ups(svc) < before + 2:  # noqa: ASYNC110
                await asyncio.sleep(0.05)

    requests = [span for span in collector.spans if span.name == "POST /v1/chat/completions"]
    assert [_attributes(span.attributes)["http.response.status_code"] for span in requests] == [
        499,
        499,
    ]
    turns = [span for span in collector.spans if span.name == "chat turn"]
    assert len(turns) == 2
    assert all(turn.status.code != turn.status.STATUS_CODE_ERROR for turn in turns), turns


async def _hang_ups(svc: Any) -> float:
    _, text, _ = await svc.request("GET", "/metrics")
    found = re.search(r'^svc_http_errors_total\{status="499"\} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


async def test_no_endpoint_no_tracing(database_url: str) -> None:
    async with running(settings_for(database_url)) as svc:
        assert TRACER not in svc.app
        assert all(m.__name__ != "tracing_middleware" for m in svc.app.middlewares)


async def test_a_collector_that_never_answers_holds_a_stop_a_bounded_time(
    database_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The SDK exports every queued batch at shutdown, each with its own deadline, and waits
    up to 30 s: a stop outlasted an orchestrator's grace. The flush now has a bound."""
    monkeypatch.setattr(telemetry, "FLUSH_BOUND_S", 0.5)
    held: list[asyncio.StreamWriter] = []

    async def accept_and_say_nothing(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(accept_and_say_nothing, "127.0.0.1", 0)
    endpoint = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        async with asyncio.timeout(25):  # liveness bound, below the SDK's own wait of 30 s
            async with running(settings_for(database_url, SVC_OTEL_ENDPOINT=endpoint)) as svc:
                for _ in range(20):
                    assert (await svc.request("GET", "/v1/ping"))[0] == 200
    finally:
        for writer in held:
            writer.close()
        server.close()
    assert "not exported within" in caplog.text
