"""The one place exceptions become HTTP responses: the spec's envelope on every non-2xx status.

`{"error": {"message", "type", "code"}}`. Handlers raise (an `SvcError`, a pydantic
`ValidationError`, an aiohttp `HTTPException`); they never build error bodies themselves. An
unexpected exception, or an `SvcError` of status 500, is a 500 whose message carries only an
id (`svc-<uuid>`) that is also in the log line with the traceback, so an operator can find it;
the process keeps serving. A NUL character in the URL or in a JSON string is a 400
`invalid_character` (PostgreSQL text cannot store it).
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import typing
import uuid
from collections.abc import AsyncIterator, Callable, Collection, Mapping
from contextlib import asynccontextmanager
from typing import Any, TypeVar, overload

import orjson
from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage
from aiohttp.typedefs import Handler
from aiohttp.web_protocol import RequestPayloadError
from pydantic import BaseModel, ValidationError

from gateway.metrics import HTTP_ERRORS
from gateway.validation_words import merged_unions, said
from schemas.errors import (
    InvalidInput,
    PayloadTooLarge,
    RequestTimeout,
    SvcError,
    echoed,
    nearest,
)
from schemas.text import is_utf8

log = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)

_HTTP_CODES: dict[int, tuple[str, str]] = {
    400: ("invalid_request_error", "invalid_request"),
    401: ("authentication_error", "unauthorized"),
    403: ("permission_error", "forbidden"),
    404: ("invalid_request_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    406: ("invalid_request_error", "not_acceptable"),
    408: ("invalid_request_error", "request_timeout"),
    411: ("invalid_request_error", "length_required"),
    413: ("invalid_request_error", "payload_too_large"),
    415: ("invalid_request_error", "unsupported_media_type"),
    417: ("invalid_request_error", "expectation_failed"),
    429: ("rate_limit_error", "rate_limit_exceeded"),
}


CLIENT_CLOSED = 499
CLIENT_GONE: web.RequestKey[bool] = web.RequestKey("svc_client_gone", bool)
"""Request key set by `client_gone`: the access log shows the response as CLIENT_CLOSED."""


def error_body(message: str, error_type: str, code: str | None) -> dict[str, Any]:
    """The spec's error object, wherever one is sent: a response, an SSE frame, a redirect."""
    return {"error": {"message": message, "type": error_type, "code": code}}


def count_error(status: int) -> None:
    """`svc_http_errors_total`: every error response, in the envelope or in a protocol's own
    format (SCIM, OAuth)."""
    HTTP_ERRORS.labels(status=str(status)).inc()


def envelope(status: int, message: str, error_type: str, code: str | None) -> web.Response:
    count_error(status)
    if not is_utf8(message):
        # Quoted client input with lone surrogates (undecodable bytes aiohttp kept): JSON
        # cannot carry them, so they become "?" rather than a failed error response.
        message = message.encode("utf-8", "replace").decode()
    body = orjson.dumps(error_body(message, error_type, code))
    return web.Response(status=status, body=body, content_type="application/json")


RESPONSE_STARTED: web.RequestKey[bool] = web.RequestKey("svc_response_started", bool)


async def note_response_started(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: from here on, an error cannot be answered with a response of its
    own (`error_middleware`)."""
    request[RESPONSE_STARTED] = True


def abort_connection(request: web.BaseRequest) -> None:
    """Drop the connection at once, for a response under way that can be neither finished
    (its socket accepts nothing, or what it writes failed) nor replaced by an error answer
    (its status line is out): its client sees the transfer cut short."""
    if request.transport is not None:
        request.transport.abort()


def status_shown(request: web.BaseRequest, response: web.StreamResponse) -> int:
    """The status a response is logged and traced with: CLIENT_CLOSED (499) when its client
    left before it was out (`client_gone`), else its own."""
    return CLIENT_CLOSED if request.get(CLIENT_GONE) else response.status


def client_gone(request: web.BaseRequest) -> None:
    """The client left while its response was being written (a stream): the access log
    (gateway/http_server.py) and the metrics show it as a hang-up, like one before the
    response (`error_middleware`). Counted once per response, however many paths see it."""
    if request.get(CLIENT_GONE):
        return
    request[CLIENT_GONE] = True
    HTTP_ERRORS.labels(status=str(CLIENT_CLOSED)).inc()


def describe_validation(exc: ValidationError) -> str:
    """One readable clause per problem, naming the field: `max_tokens: must be at least 1`."""
    return "invalid request: " + validation_problems(exc, whole="body")


MAX_PROBLEMS_SHOWN = 20


def validation_problems(
    exc: ValidationError, *, whole: str, names: Mapping[str, str] | None = None
) -> str:
    """The problems of `exc`, `field: message` each (`whole` names a problem of no field,
    `names` the fields as the client spells them), without pydantic's "Value error, " before
    the messages of the project's own checks."""
    parts = []
    errors = merged_unions(exc.errors(include_url=False))
    for error in errors[:MAX_PROBLEMS_SHOWN]:
        path = [str(loc) for loc in error["loc"]]
        if path and names:
            path[0] = names.get(path[0], path[0])
        where = ".".join(path) or whole
        parts.append(f"{where}: {said(error)}")
    if len(errors) > MAX_PROBLEMS_SHOWN:
        # A body of a million bad items made an answer of 70 MB, built while others waited.
        parts.append(f"and {len(errors) - MAX_PROBLEMS_SHOWN:,} more problems")
    return "; ".join(parts)


RETRY_CANNOT_HELP = frozenset(
    {
        "upstream_rejected",
        "upstream_auth_failed",
        "upstream_model_not_found",
        "upstream_bad_stream",
        "upstream_bad_response",
        "upstream_misconfigured",
        "upstream_quota_exceeded",
        "idempotency_key_reused",
        "idempotency_key_expired",
        "not_built",
        "duplicate_request",
        "uniqueness",
        "agent_name_taken",
        "agent_archived",
        "external_account",
        "projection_failed",
        "turn_abandoned",
    }
)
"""Codes of 409 and 5xx answers that the same request will meet again. The OpenAI SDKs
retry every 409 and 5xx (twice by default, each a new turn: they send no Idempotency-Key)
unless the answer says `x-should-retry: false`."""


BEARER_CHALLENGE = 'Bearer realm="svc"'


def from_svc_error(exc: SvcError) -> web.Response:
    response = envelope(exc.http_status, exc.message, exc.error_type, exc.code)
    final = exc.final or exc.code in RETRY_CANNOT_HELP
    if final and (exc.http_status >= 500 or exc.http_status == 409):
        response.headers["x-should-retry"] = "false"
    if exc.retry_after_s is not None:
        response.headers["Retry-After"] = _whole_seconds(exc.retry_after_s)
    extra: Any = getattr(exc, "headers", None)
    if isinstance(extra, dict):
        response.headers.update(extra)
    if exc.http_status == 401:
        # RFC 9110 section 15.5.2: a 401 names the scheme that would do (an API key as a
        # bearer token, unless the error named its own).
        response.headers.setdefault("WWW-Authenticate", BEARER_CHALLENGE)
    if isinstance(exc, RequestTimeout):
        # The rest of the body may still arrive: this connection's bytes are out of step.
        response.force_close()
    return response


def _whole_seconds(seconds: float) -> str:
    """A `Retry-After` value: whole seconds, rounded up, at least 1."""
    return str(max(1, math.ceil(seconds)))


def status_envelope(status: int, message: str) -> web.Response:
    """The envelope of an HTTP status that no project error names, typed by its status."""
    error_type, code = _HTTP_CODES.get(
        status, ("invalid_request_error" if status < 500 else "server_error", None)
    )
    return envelope(status, message, error_type, code)


def from_http_exception(exc: web.HTTPException) -> web.Response:
    response = status_envelope(exc.status, _http_message(exc))
    for name in ("Allow", "Retry-After", "WWW-Authenticate"):
        if name in exc.headers:
            response.headers[name] = exc.headers[name]
    return response


def _http_message(exc: web.HTTPException) -> str:
    if exc.status == 404:
        return "not found: no such endpoint"
    if exc.status == 405:
        allowed = exc.headers.get("Allow", "")
        return f"method not allowed; allowed: {allowed}" if allowed else "method not allowed"
    if exc.status == 413:
        return "request body too large (limit set by SVC_MAX_BODY_BYTES)"
    if exc.status == 417:
        return (
            "the Expect header names an expectation this server does not meet (only "
            "100-continue); send the request without it"
        )
    return exc.reason or f"HTTP {exc.status}"


REQUEST_ID: web.RequestKey[str] = web.RequestKey("svc_request_id", str)
REQUEST_ID_HEADER = "X-Request-Id"


def request_id(request: web.BaseRequest) -> str:
    """This request's id, made on first use: its response's X-Request-Id, its access log
    line's last field, and the id a 500 (or a stream's internal error frame) names, under
    which the log holds the traceback. The service makes it; one a client or proxy sends is
    not taken, so that an id in the log is always one this service gave once."""
    known = request.get(REQUEST_ID)
    if known is None:
        known = f"svc-{uuid.uuid4()}"
        request[REQUEST_ID] = known
    return known


async def add_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: every response the application makes names its request."""
    response.headers[REQUEST_ID_HEADER] = request_id(request)


def internal_failure(what: str, exc: BaseException, request: web.BaseRequest) -> SvcError:
    """An internal failure as a client may see it once its response has begun (a stream's
    error frame): the request's id to quote; the detail, with its traceback, in the log
    under that id."""
    error_id = request_id(request)
    log.error("%s failed (%s)", what, error_id, exc_info=(type(exc), exc, exc.__traceback__))
    return SvcError(f"internal error (id {error_id})")


def logged_path(request: web.BaseRequest) -> str:
    """The path as a log line may hold it: still percent-encoded (a decoded %0A would start
    a forged line), without the query (which may carry a token)."""
    return request.rel_url.raw_path


def internal_error(request: web.BaseRequest, exc: BaseException) -> web.Response:
    error_id = request_id(request)
    log.error(
        "unhandled error %s on %s %s",
        error_id,
        request.method,
        logged_path(request),
        exc_info=(type(exc), exc, exc.__traceback__),
    )
    return envelope(500, f"internal error (id {error_id})", "server_error", "internal_error")


NUL = "\x00"
_NUL_MESSAGE = "the NUL character (\\u0000) is not accepted in {where}"


def reject_nul_in_url(request: web.Request) -> None:
    """PostgreSQL text cannot hold NUL: a path or query parameter carrying one is the client's
    mistake (400), not a database failure (500)."""
    if NUL in request.path or any(NUL in k or NUL in v for k, v in request.query.items()):
        raise InvalidInput(_NUL_MESSAGE.format(where="the URL"), code="invalid_character")


MAX_JSON_DEPTH = 64
"""Deepest nesting of arrays and objects a request body may have: far beyond any document
this API takes, and far below the interpreter's recursion limit that validating a deeper one
would reach (a 500 for the client's mistake)."""


def _check_json_value(value: Any) -> None:
    """Refuse NUL in any string or key (PostgreSQL text cannot hold it) and nesting deeper
    than MAX_JSON_DEPTH; an explicit stack, so the check itself never recurses."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            if NUL in item:
                raise InvalidInput(
                    _NUL_MESSAGE.format(where="JSON strings"), code="invalid_character"
                )
            continue
        if isinstance(item, dict):
            children: list[Any] = [*item.keys(), *item.values()]
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > MAX_JSON_DEPTH:
            raise InvalidInput(
                f"JSON body nested too deeply: at most {MAX_JSON_DEPTH} levels of arrays and "
                "objects",
                code="invalid_json",
            )
        stack.extend((child, depth + 1) for child in children)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    response = await _answer(request, handler)
    if request.get(RESPONSE_STARTED) and not response.prepared:
        # The handler failed after its own response began (a stream): its status line is
        # out, and another response would be written into that one's body. The failure is
        # logged; the client sees the transfer cut short. (aiohttp then finds the socket
        # closed when it writes the answer, and only logs the access.)
        abort_connection(request)
        return response
    gone = request.transport is None and not request.get(CLIENT_GONE)
    if gone and response.status < 400 and not response.prepared:
        # The client left while the handler worked (a chat turn runs on and is recorded):
        # its answer reaches no one, and the access log shows a hang-up, not a 200. (An error
        # answer meets the same in `_answer`, before it is counted.) A stream already under
        # way (a feed, whose normal end is its client leaving) is not.
        return _hung_up(request, response.status)
    return response


def _hung_up(request: web.Request, status: int | None = None) -> web.Response:
    """The answer to a client that left while its handler worked (before its answer of
    `status`, or mid-body: None): nobody reads it, and a client's hang-up is not the
    service's error to log. Logged at INFO and counted once, as 499, the status proxies
    record for it, in the access log too."""
    before = "" if status is None else f" before its answer ({status})"
    log.info(
        "%s %s: the client closed the connection%s", request.method, logged_path(request), before
    )
    client_gone(request)
    return web.Response(status=CLIENT_CLOSED)


async def _answer(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        reject_nul_in_url(request)
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return from_http_exception(exc)
    except SvcError as exc:
        if exc.internal:
            # An internal failure (a store query that failed, say): its message may carry
            # database detail or parameter values, so the client gets the opaque id and the
            # log the traceback, as for any unexpected exception.
            return internal_error(request, exc)
        if exc.http_status > 500 and exc.code != "not_built":
            # str(): with what only the log may see (a StoreUnavailable's driver detail). A
            # capability not built is the client's news, as a 404 is, not the operator's.
            # The request's id ties the line to its access log line and the client's
            # X-Request-Id (the access log is INFO: at SVC_LOG_LEVEL=warning, only this).
            log.warning(
                "%s %s -> %d %s (%s): %s",
                request.method,
                logged_path(request),
                exc.http_status,
                exc.code,
                request_id(request),
                exc,
            )
        if request.transport is None:  # its client left meanwhile: no one gets the answer
            return _hung_up(request, exc.http_status)
        return from_svc_error(exc)
    except ValidationError as exc:
        return envelope(400, describe_validation(exc), "invalid_request_error", "invalid_request")
    except ConnectionResetError:  # mid-body, or before a stream's headers went out
        return _hung_up(request)
    except Exception as exc:
        return internal_error(request, exc)


BODY_DEADLINE_S = 60.0
"""A request's whole body must arrive within this (SVC_MAX_BODY_BYTES, 4 MiB by default, at
about 70 KB/s): a client that trickles its body would otherwise hold a handler, and a
connection, for as long as it liked."""


@asynccontextmanager
async def body_deadline() -> AsyncIterator[None]:
    """Around a read of the request's body: past BODY_DEADLINE_S, RequestTimeout (408)."""
    try:
        async with asyncio.timeout(BODY_DEADLINE_S) as deadline:
            yield
    except TimeoutError:
        if not deadline.expired():
            raise
        raise RequestTimeout(
            f"the request body did not arrive within {BODY_DEADLINE_S:.0f} s; send it "
            "whole, at once, and retry"
        ) from None


async def read_body(request: web.Request, *, max_bytes: int | None = None) -> bytes:
    """The request body; larger than the app's client_max_size (or `max_bytes`, a route's
    own smaller limit, checked as the bytes arrive, chunked or not) -> PayloadTooLarge
    (413); one that does not decode as its Content-Encoding or chunked framing says -> 400;
    one that does not arrive within BODY_DEADLINE_S -> RequestTimeout (408)."""
    # A route's own limit only lowers the operator's (SVC_MAX_BODY_BYTES), never raises it.
    # Read through a clone, which shares the body's stream: call once, before any read.
    reader = (
        request
        if max_bytes is None
        else request.clone(client_max_size=min(max_bytes, request.client_max_size))
    )
    try:
        async with body_deadline():
            return await reader.read()
    except web.HTTPRequestEntityTooLarge:
        own = max_bytes is not None and max_bytes < request.client_max_size
        setting = " for this endpoint" if own else " (SVC_MAX_BODY_BYTES)"
        raise PayloadTooLarge(
            f"request body too large: the limit is {reader.client_max_size} bytes{setting}"
        ) from None
    except RequestPayloadError as exc:
        raise undecodable_body(exc) from None


def undecodable_body(exc: RequestPayloadError) -> InvalidInput:
    """The 400 for a body aiohttp could not decode: not in its Content-Encoding, or a broken
    chunked framing. aiohttp's text names the encoding, never the bytes."""
    cause = exc.__cause__ if isinstance(exc.__cause__, BadHttpMessage) else exc
    detail = cause.message if isinstance(cause, BadHttpMessage) else str(cause)
    return InvalidInput(
        f"the request body could not be read ({detail.strip() or 'undecodable'}); send "
        "it as its Content-Encoding says, or without a Content-Encoding",
        code="invalid_body",
    )


def _json_problem(body: bytes, exc: orjson.JSONDecodeError) -> str:
    """What is wrong with a body orjson refused: its message, but for bytes that are not
    UTF-8, of which it speaks of surrogates whatever the bytes."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as bad:
        return (
            f"not UTF-8 text (byte {bad.object[bad.start]:#04x} at offset {bad.start}); "
            "send JSON encoded as UTF-8"
        )
    return str(exc)


@overload
async def read_json(request: web.Request, *, max_bytes: int | None = None) -> Any: ...


@overload
async def read_json(request: web.Request, model: type[M], *, max_bytes: int | None = None) -> M: ...


async def read_json(
    request: web.Request, model: type[M] | None = None, *, max_bytes: int | None = None
) -> M | Any:
    """Parse a JSON body and, given `model`, validate it: malformed JSON and schema violations
    are 400s whose message names the problem (and the field). Without `model`, the parsed
    JSON value is returned as is. `max_bytes`: see `read_body`."""
    body = await read_body(request, max_bytes=max_bytes)
    if not body:
        raise InvalidInput("request body is empty: expected a JSON object", code="invalid_json")
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidInput(
            f"malformed JSON body: {_json_problem(body, exc)}", code="invalid_json"
        ) from None
    _check_json_value(data)
    if model is None:
        return data
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise InvalidInput(describe_validation(exc)) from None


async def refuse_body(request: web.Request) -> None:
    """A route that takes no body refuses one: a client sending fields it expects to act
    (a reason, a "cascade") must not believe they did."""
    if await read_body(request):
        raise InvalidInput("this request takes no body; send it without one")


def read_header(
    request: web.Request, name: str, read: Callable[[str], str] = str.strip
) -> str | None:
    """Header `name`, stripped (or as `read` reads each value); None when absent. Sent twice
    with different values, it is refused: which one was meant cannot be guessed (the same
    value twice is that value)."""
    values = {read(value) for value in request.headers.getall(name, ())}
    if len(values) > 1:
        raise InvalidInput(
            f"{name} was sent more than once, with different values", code="invalid_header"
        )
    return values.pop() if values else None


_CLIENT_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


def _unquoted(value: str) -> str:
    """A header value stripped, and without the quotes of a structured-field string: the
    IETF draft sends Idempotency-Key so, and `"k-1"` and `k-1` are one key."""
    value = value.strip()
    return value[1:-1] if len(value) >= 2 and value[0] == value[-1] == '"' else value


def read_header_id(request: web.Request, name: str) -> str | None:
    """Header `name` holding an id a client chose (`Idempotency-Key`,
    `X-SVC-Conversation-Id`), as `read_header` reads it; None when absent. One rule on every
    endpoint, so that a client's way of making keys works on all or fails on all: 1 to 128
    letters, digits, '.', '_', ':' or '-' (a UUID, a ULID, `order-17:retry`), bare or quoted
    as a structured-field string. An empty value
    is refused too: a client whose key variable is empty would otherwise run its request
    again on every retry without knowing it."""
    value = read_header(request, name, _unquoted)
    if value is not None and not _CLIENT_ID.match(value):
        raise InvalidInput(
            f"{name} must be 1-128 characters of letters, digits, '.', '_', ':' or '-'",
            code="invalid_header",
        )
    return value


def _query_names(model: type[BaseModel]) -> set[str]:
    return {field.alias or name for name, field in model.model_fields.items()}


def _refuse_unknown_parameters(model: type[BaseModel], given: Collection[str]) -> None:
    """A parameter the route does not take, said with the ones it takes (and the nearest, for
    a typo): pydantic's "Extra inputs are not permitted" left the client to guess them."""
    known = sorted(_query_names(model))
    unknown = [name for name in given if name not in known]
    if not unknown:
        return
    named = ", ".join(echoed(name) for name in unknown[:5])
    if not known:
        raise InvalidInput(f"this request takes no query parameters; leave out {named}")
    raise InvalidInput(
        f"query parameter {named} is not one this request takes{_meant(unknown[0], known)}; "
        f"it takes {', '.join(known)}"
    )


def _meant(name: str, known: list[str]) -> str:
    """The parameter a wrong `name` most likely meant: the nearest in spelling, or the one
    that names the same id another way (the messages read takes `id`, the export
    `conversation_id`, as the spec names them)."""
    if name.lower() in known:
        return f" (did you mean {name.lower()}?)"
    spelt = nearest(name, known)
    if spelt:
        return spelt
    ids = [k for k in known if k == "id" or k.endswith("_id")]
    if (name == "id" or name.endswith("_id")) and len(ids) == 1:
        return f" (did you mean {ids[0]}?)"
    return ""


def _refuse_a_missing_parameter(
    request: web.Request, model: type[BaseModel], values: dict[str, str]
) -> None:
    """A required parameter left out or given empty, said in words (pydantic's "Field
    required" read oddly for `?id=`). Called once no name is unknown: a misspelt required
    parameter is both, and the typo is what the client needs to hear of."""
    for name, field in model.model_fields.items():
        key = field.alias or name
        if field.is_required() and key not in values:
            state = "empty" if key in request.query else "missing"
            raise InvalidInput(f"query parameter {key} is {state}: give it a value")


def read_query(request: web.Request, model: type[M]) -> M:
    """Validate the query string against `model`; an empty value counts as absent. Unknown
    parameters are refused (models forbid extra fields), so that a typo is a 400 rather than
    a silently ignored filter. A parameter given twice is refused too: which of the two a
    client meant is not ours to guess."""
    repeated = sorted({k for k in request.query if len(request.query.getall(k)) > 1})
    if repeated:
        raise InvalidInput(
            f"query parameter {', '.join(repeated)} is given more than once; give it once"
        )
    # Empty values count as absent, but an unknown name is refused even when empty
    # (`?lmit=`): the model would never see it.
    known = _query_names(model)
    values = {k: v for k, v in request.query.items() if v != "" or k not in known}
    _refuse_unknown_parameters(model, values)
    _refuse_a_missing_parameter(request, model, values)
    _refuse_loose_integers(model, values)
    try:
        return model.model_validate(values)
    except ValidationError as exc:
        raise InvalidInput("invalid request: " + validation_problems(exc, whole="query")) from None


_WHOLE_NUMBER = re.compile(r"-?[0-9]+")


def _refuse_loose_integers(model: type[BaseModel], values: dict[str, str]) -> None:
    """An integer parameter in ASCII digits only (a minus sign aside): pydantic reads
    `1_0` as 10, `1.0` as 1 and ` 5` as 5, so `at_version=3_0` asked for version 30."""
    for name, field in model.model_fields.items():
        raw = values.get(field.alias or name)
        if raw is not None and _takes_integer(field.annotation):
            if not _WHOLE_NUMBER.fullmatch(raw):
                raise InvalidInput(
                    f"query parameter {field.alias or name} must be a whole number in digits "
                    f"(such as 10), not {echoed(raw)}"
                )


def _takes_integer(annotation: Any) -> bool:
    """Whether a query field reads an integer: `int`, `int | None`, either with bounds
    (`Annotated[int, Field(ge=1)] | None`, whose bounds pydantic leaves on the member)."""
    annotation = _bare(annotation)
    if annotation is int:
        return True
    members = [_bare(member) for member in typing.get_args(annotation)]
    return int in members and all(m in (int, type(None)) for m in members)


def _bare(annotation: Any) -> Any:
    if typing.get_origin(annotation) is typing.Annotated:
        return typing.get_args(annotation)[0]
    return annotation
