"""aiohttp's HTTP server under the application, with its own error answers in the envelope.

aiohttp answers some requests before any handler or middleware runs: a request its parser
refuses (a request line or header that is not HTTP, a line over 8,190 bytes, a bad chunked
body), an `Expect` header it does not know (417) and a handler that fails outside the
middleware chain. It writes those as plain text;
here they carry the spec's envelope like every other error, and the connection is still closed
after them (the byte stream may be out of step with the requests).

aiohttp has no public hook for this. Its answer comes from `RequestHandler.handle_error` (a
public method of a public class), and the request handlers are made by the `Server` that
`AppRunner._make_server` returns; both are overridden below. tests/gateway/
test_platform_errors.py sends such requests, so an aiohttp upgrade that moves them fails there.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any, cast

from aiohttp import web
from aiohttp.http_exceptions import ContentEncodingError
from aiohttp.web_log import AccessLogger
from aiohttp.web_protocol import RequestHandler, RequestPayloadError
from multidict import CIMultiDict, CIMultiDictProxy

from gateway.control_chars import one_line
from gateway.errors import (
    REQUEST_ID_HEADER,
    client_gone,
    from_http_exception,
    internal_error,
    request_id,
    status_envelope,
    status_shown,
)
from gateway.security import client_ip, security_headers
from gateway.settings import Settings
from gateway.state import SETTINGS
from schemas.errors import UNSUPPORTED_ENCODING_MESSAGE
from schemas.redaction import redact

log = logging.getLogger(__name__)

_RawHandler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]

MALFORMED_REQUEST = (
    "malformed HTTP request: the request line, a header or the chunked body could not be "
    "parsed (a request or header line may be at most 8,190 bytes, and a request may carry at "
    "most 128 header lines); the connection is closed"
)

UNSUPPORTED_ENCODING = f"{UNSUPPORTED_ENCODING_MESSAGE}; the connection is closed"


class EnvelopeRequestHandler(RequestHandler):
    """aiohttp's per-connection handler, answering its own errors with the envelope."""

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if request.writer.output_size > 0:
            # As aiohttp: a response already under way cannot be replaced by another one.
            raise ConnectionError("the response was already started; closing the connection")
        if status >= 500:  # a failure outside the middleware chain, not the client's doing
            response = internal_error(request, exc or RuntimeError(f"aiohttp answered {status}"))
        else:
            # The parser's own message may quote the bytes it refused (a header's value, which
            # can be a credential): neither the client nor the log gets it.
            response = (
                status_envelope(415, UNSUPPORTED_ENCODING)
                if isinstance(exc, ContentEncodingError)
                else status_envelope(status, MALFORMED_REQUEST)
            )
            log.info(
                "refused a malformed HTTP request from %s with %d (%s)",
                request.remote,
                response.status,
                type(exc).__name__ if exc is not None else "no detail",
            )
        # No application saw the request, so none of its response hooks run: the headers
        # every response carries are set here.
        response.headers.update(security_headers(cast(_EnvelopeServer, self._manager).settings))
        response.headers[REQUEST_ID_HEADER] = request_id(request)
        response.force_close()
        return response

    async def finish_response(
        self, request: web.BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        """aiohttp's, with the wait for the client to take the answer bounded: a handler's
        answer (a JSON body of megabytes) goes to the connection at once, and aiohttp then
        waits, with no time limit, until the client has read all but 16 KiB of it."""
        with watching_stalls(request):
            return await super().finish_response(request, resp, start_time)

    def log_exception(self, *args: Any, **kw: Any) -> None:
        # After a response, aiohttp reads what is left of the request body, and a body that
        # does not decode (the handler answered 400 for it) raises again there: the client's
        # doing, not an error of the service to log with a traceback.
        if isinstance(kw.get("exc_info"), RequestPayloadError):
            log.info("dropped a connection whose request body does not decode")
            self.force_close()
            return
        super().log_exception(*args, **kw)


RESPONSE_STALL_S = 30.0
"""How long a client may take none of an answer's bytes waiting to be sent before its
connection is closed: checked every RESPONSE_STALL_S, so a stalled client is cut off between
one and two of them after it stopped reading. As with the chat stream's writes, a client
reading 2 KB/s or more is never cut off."""


@contextmanager
def watching_stalls(request: web.BaseRequest) -> Iterator[None]:
    """While the block runs, a client that takes none of the answer's unsent bytes for
    RESPONSE_STALL_S is cut off (`_StallWatch`): the block's pending write then raises
    ConnectionError, as for a client that left. For handlers that write their own answer
    (a download), as aiohttp's writing of a returned one is watched."""
    transport = request.transport
    if transport is None:
        yield
        return
    watch = _StallWatch(request, transport)
    try:
        yield
    finally:
        watch.stop()


class _StallWatch:
    """Aborts `transport` when the client has taken none of the answer's bytes between two
    checks while some wait to be sent: it neither reads nor leaves, and is logged and counted
    as one that left (499). Judged by the bytes taken (written to the connection less those
    still waiting), not by those waiting, which a handler writing page after page refills.
    One timer per answer, re-armed while bytes move, so an answer that goes out at once
    costs a timer set and cancelled."""

    def __init__(self, request: web.BaseRequest, transport: asyncio.Transport) -> None:
        self._request = request
        self._transport = transport
        self._taken: int | None = None
        self._timer = asyncio.get_running_loop().call_later(RESPONSE_STALL_S, self._check)

    def _check(self) -> None:
        unsent = self._transport.get_write_buffer_size()
        taken = self._request.writer.output_size - unsent
        if unsent and self._taken is not None and taken <= self._taken:
            log.info(
                "a client took none of its answer for %g s; its connection is closed",
                RESPONSE_STALL_S,
            )
            client_gone(self._request)
            self._transport.abort()
            return
        self._taken = taken
        self._timer = asyncio.get_running_loop().call_later(RESPONSE_STALL_S, self._check)

    def stop(self) -> None:
        self._timer.cancel()


class _EnvelopeServer(web.Server):
    settings: Settings | None = None
    """The application's, for the answers the server makes without it."""

    def __call__(self) -> RequestHandler:
        return EnvelopeRequestHandler(self, loop=self._loop, **self._kwargs)


def _enveloping(handler: _RawHandler) -> _RawHandler:
    """The application's entry point, with the HTTP errors it raises before its middleware
    chain runs (a route's expect handler refusing an `Expect` header: 417) in the envelope."""

    async def handle(request: web.BaseRequest) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return from_http_exception(exc)

    return handle


class _AsSent:
    """A response as the access log shows it: 499 if its client left while it was written,
    and as its size (`%b`) every byte that went out for it. aiohttp records that size when
    the response ends normally (`write_eof`), so a response cut short showed 0, as did a
    feed, whose usual end is its client leaving; the writer's count covers both, and a live
    feed's frames, written below the writer, are added to it (`feed_fanout.Outlet`)."""

    def __init__(self, response: web.StreamResponse, status: int, sent: int) -> None:
        self.status = status
        self.body_length = max(response.body_length, sent)
        self.headers = response.headers


class _AsLogged:
    """A request as the access log shows it: credentials in its URL and its Referer (a feed's
    `?access_token=`, a key pasted into a URL, a secret setting's value) redacted, and the
    client's address as the trusted proxies say (`gateway.security.client_ip`), not the
    proxy's. Everything the client wrote is shown on one line (`one_line`): the parser
    refuses CR and LF in a header, not NEL or U+2028, which log viewers break lines at, nor
    an ESC sequence for the terminal that tails the log."""

    def __init__(self, request: web.BaseRequest) -> None:
        self._request = request

    def __getattr__(self, name: str) -> Any:
        return getattr(self._request, name)

    @property
    def path_qs(self) -> str:
        # The raw, still percent-encoded form: a decoded path's %0A would start a forged line.
        return one_line(self._redacted(self._request.raw_path))

    @property
    def headers(self) -> Any:
        headers = self._request.headers
        shown = [(name, value, self._header_shown(name, value)) for name, value in headers.items()]
        if all(value is original for _, original, value in shown):
            return headers
        return CIMultiDictProxy(CIMultiDict((name, value) for name, _, value in shown))

    def _header_shown(self, name: str, value: str) -> str:
        """`value` itself when it shows as it is, so that the usual request costs no copy."""
        shown = one_line(self._redacted(value) if name.lower() == "referer" else value)
        return value if shown == value else shown

    @property
    def remote(self) -> str | None:
        request = self._request
        if isinstance(request, web.Request) and _settings_of(request) is not None:
            # From X-Forwarded-For behind a trusted proxy: the client's writing, not an address.
            return one_line(client_ip(request))
        return request.remote  # refused by the parser before any application saw it

    def _redacted(self, url: str) -> str:
        settings = _settings_of(self._request)
        return redact(url, settings.secret_values() if settings is not None else ())


def _settings_of(request: web.BaseRequest) -> Settings | None:
    """The settings of the application that routed `request`; None for a request the HTTP
    parser refused. aiohttp makes that one a `web.Request` too, never routed, whose `app`
    fails an assertion: the access log then lost its line to "Error in logging"."""
    if not isinstance(request, web.Request) or request._match_info is None:
        return None
    return request.app.get(SETTINGS)


class GatewayAccessLogger(AccessLogger):
    """aiohttp's access log; a response whose client went away while it was written
    (`gateway.errors.client_gone`) is logged as 499, like a hang-up before the response."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        shown: Any = _AsSent(response, status_shown(request, response), request.writer.output_size)
        logged: Any = _AsLogged(request)
        super().log(logged, shown, time)


IDLE_CONNECTION_S = 75.0
"""A connection must bring a whole request's headers within this of opening, or of its last
response, else it is closed. aiohttp's own default is an hour, for which a client that never
finishes its headers would hold a socket. Longer than the idle upstream connections that
reverse proxies keep (nginx: 60 s), so a proxy never reuses one the gateway has closed."""


ACCESS_LOG_FORMAT = AccessLogger.LOG_FORMAT + " %{X-Request-Id}o"
"""aiohttp's own line, then the response's X-Request-Id (`gateway.errors.request_id`)."""


class GatewayRunner(web.AppRunner):
    """`web.AppRunner` whose server answers aiohttp's own errors with the envelope, logs
    with `GatewayAccessLogger` and closes connections idle for IDLE_CONNECTION_S."""

    def __init__(self, app: web.Application, **kwargs: Any) -> None:
        kwargs.setdefault("access_log_class", GatewayAccessLogger)
        kwargs.setdefault("access_log_format", ACCESS_LOG_FORMAT)
        kwargs.setdefault("keepalive_timeout", IDLE_CONNECTION_S)
        super().__init__(app, **kwargs)

    async def _make_server(self) -> web.Server:
        plain = await super()._make_server()  # runs the application's startup
        server = _EnvelopeServer(
            _enveloping(plain.request_handler),
            request_factory=plain.request_factory,
            handler_cancellation=plain.handler_cancellation,
            loop=asyncio.get_running_loop(),
            **plain._kwargs,
        )
        server.settings = self._app.get(SETTINGS)
        return server
