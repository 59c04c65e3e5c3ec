"""The SSE event feeds: GET /v1/events/stream and GET /v1/web/stream.

Both tail the global log through the process's one `LogTailer` (ARCHITECTURE.md decision 4),
strictly filtered to the principal's workspace. Every frame carries `id: <cursor>`, where the
cursor is the opaque `(tx, position)` of the gap-free order (decision 3), so a client that
resumes with `Last-Event-ID` (or `?cursor=`) gets exactly the events after the last one it saw.

- /v1/events/stream: every event of the acting workspace.
- /v1/web/stream: what the web UI's live views need, the events of conversation streams.

A consumer that falls behind is cut off by the tailer (`SubscriberTooSlow`) with a final
`event: error` frame carrying its cursor; other consumers are never slowed. See docs/feeds.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from eventstore.cursor import decode_cursor
from eventstore.errors import InvalidCursor
from eventstore.records import RecordedEvent
from eventstore.tailer import SubscriberTooSlow
from gateway.auth import authenticate
from gateway.openapi import document
from gateway.sse import encode_event, open_sse, send_comment, send_event, send_retry
from gateway.state import STORE, TAILER
from schemas.admin import FeedEvent, FeedQuery
from schemas.errors import InvalidInput, SvcError, Unavailable
from schemas.events import EVENTS

log = logging.getLogger(__name__)

RETRY_MS = 3000
HEARTBEAT_S = 15.0
WRITE_TIMEOUT_S = 10.0
TICK_S = 5.0
MAX_TYPES = 64
_TYPE_NAME = re.compile(r"^[A-Za-z0-9_.:\-]{1,200}$")
_SECRET_WORDS = frozenset({"hash", "secret", "token", "password", "passwd", "credential"})
_WORD_SPLIT = re.compile(r"[_\-.\s]+|(?<=[a-z0-9])(?=[A-Z])")
REDACTED = "[redacted]"
_MAX_INT8 = 2**63 - 1
_SHUTDOWN_ERROR = Unavailable(
    "the service is shutting down; reconnect with the last cursor to resume", code="shutdown"
)


# -- frames -----------------------------------------------------------------------------------


def is_secret_field(name: str) -> bool:
    """True for a field named like a secret: a word of its name is hash, secret, token,
    password (key_hash, push_token, clientSecret). Counters such as `prompt_tokens` stay."""
    return any(word.lower() in _SECRET_WORDS for word in _WORD_SPLIT.split(name) if word)


def redact(value: Any) -> Any:
    if isinstance(value, dict):
        return {
            key: REDACTED if is_secret_field(str(key)) else redact(item)
            for key, item in value.items()
        }
    if isinstance(value, list):
        return [redact(item) for item in value]
    return value


def _current_data(record: RecordedEvent) -> dict[str, Any]:
    """The event's data at its current schema version (upcast), when the type is known."""
    try:
        return EVENTS.upcast(record.type, record.schema_version, record.data)
    except SvcError:
        return record.data


def frame_payload(record: RecordedEvent) -> dict[str, Any]:
    return {
        "type": record.type,
        "stream_id": record.stream_id,
        "version": record.version,
        "data": redact(_current_data(record)),
        "recorded_at": record.recorded_at.isoformat(),
        "cursor": record.cursor,
    }


def closing_payload(cursor: str, message: str, error_type: str, code: str) -> str:
    body = {"error": {"message": message, "type": error_type, "code": code}, "cursor": cursor}
    return orjson.dumps(body).decode()


class FrameCache:
    """Encoded SSE frame per log position, shared by every connection of the process: an
    event fanned out to a thousand feeds is redacted and serialised once. Bounded by count
    and by bytes (an assistant message may be large)."""

    def __init__(self, size: int = 4096, max_bytes: int = 32 * 1024 * 1024) -> None:
        self._size = size
        self._max_bytes = max_bytes
        self._bytes = 0
        self._frames: OrderedDict[int, bytes] = OrderedDict()

    def frame(self, record: RecordedEvent) -> bytes:
        frame = self._frames.get(record.position)
        if frame is None:
            data = orjson.dumps(frame_payload(record))
            frame = encode_event(data, event=record.type, id=record.cursor)
            self._frames[record.position] = frame
            self._bytes += len(frame)
            while len(self._frames) > self._size or self._bytes > self._max_bytes:
                self._bytes -= len(self._frames.popitem(last=False)[1])
        return frame


# -- feed selection ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FeedSpec:
    name: str
    path: str
    summary: str
    selects: Callable[[RecordedEvent], bool]


def _every_event(record: RecordedEvent) -> bool:
    return True


def _web_ui_event(record: RecordedEvent) -> bool:
    return record.stream_id.startswith("conversation:")


EVENTS_FEED = FeedSpec(
    "events",
    "/v1/events/stream",
    "Every event of the acting workspace, secret fields redacted.",
    _every_event,
)
WEB_FEED = FeedSpec(
    "web",
    "/v1/web/stream",
    "Events of the workspace's conversation streams (messages, turns): the web UI's live view.",
    _web_ui_event,
)
FEED_SPECS = (EVENTS_FEED, WEB_FEED)


# -- connection registry (graceful shutdown) --------------------------------------------------


@dataclass(eq=False)
class Feed:
    """One open feed connection. `cursor` is the newest point it has consumed; times are the
    event loop's clock."""

    cursor: str
    closing: asyncio.Event = field(default_factory=asyncio.Event)
    last_write: float = 0.0
    writing_since: float | None = None


@dataclass
class FeedHub:
    frames: FrameCache = field(default_factory=FrameCache)
    active: set[Feed] = field(default_factory=set)
    shutting_down: bool = False

    def open(self, cursor: str) -> Feed:
        feed = Feed(cursor)
        if self.shutting_down:
            feed.closing.set()
        self.active.add(feed)
        return feed

    def close(self, feed: Feed) -> None:
        self.active.discard(feed)

    def close_all(self) -> None:
        self.shutting_down = True
        for feed in self.active:
            feed.closing.set()


FEED_HUB: web.AppKey[FeedHub] = web.AppKey("svc_feed_hub", FeedHub)


# -- request parsing --------------------------------------------------------------------------


def resume_cursor(request: web.Request) -> str:
    """`Last-Event-ID` (sent by a reconnecting EventSource) wins over `?cursor=`. Validated
    here, before the stream starts, so a malformed cursor is a plain 400 envelope."""
    raw = (request.headers.get("Last-Event-ID") or request.query.get("cursor") or "").strip()
    point = decode_cursor(raw)
    if max(point) > _MAX_INT8:
        raise InvalidCursor("malformed cursor: it points outside the log; omit it to start over")
    return raw


def requested_types(request: web.Request) -> list[str] | None:
    names = [
        name.strip()
        for value in request.query.getall("types", [])
        for name in value.split(",")
        if name.strip()
    ]
    if not names:
        return None
    if len(names) > MAX_TYPES:
        raise InvalidInput(f"types: at most {MAX_TYPES} event types", code="invalid_types")
    for name in names:
        if not _TYPE_NAME.match(name):
            raise InvalidInput(
                f"types: {name[:50]!r} is not an event type name", code="invalid_types"
            )
    return list(dict.fromkeys(names))


async def start_cursor(request: web.Request) -> str:
    """Where the feed starts: the resume cursor; with none, the start of the workspace's log,
    or its current head with `?start=latest`."""
    cursor = resume_cursor(request)
    start = request.query.get("start", "earliest")
    if start not in ("earliest", "latest"):
        raise InvalidInput("start: use earliest or latest", code="invalid_start")
    if cursor or start == "earliest":
        return cursor
    return await request.app[STORE].head()


# -- serving ----------------------------------------------------------------------------------


async def _forward(
    resp: web.StreamResponse,
    events: AsyncIterator[RecordedEvent],
    feed: Feed,
    spec: FeedSpec,
    frames: FrameCache,
) -> None:
    """Write every selected event as it comes; runs until the subscription ends or raises."""
    loop = asyncio.get_running_loop()
    async for record in events:
        feed.cursor = record.cursor
        if spec.selects(record):
            feed.writing_since = loop.time()
            await resp.write(frames.frame(record))
            feed.writing_since = None
            feed.last_write = loop.time()


async def _pump(
    request: web.Request,
    resp: web.StreamResponse,
    events: AsyncIterator[RecordedEvent],
    feed: Feed,
    spec: FeedSpec,
    frames: FrameCache,
) -> None:
    """Forward events in one task; this one supervises it: heartbeats when idle, the final
    frame on shutdown or cut-off, and dropping a socket that accepts nothing."""
    loop = asyncio.get_running_loop()
    feed.last_write = loop.time()
    forward = asyncio.ensure_future(_forward(resp, events, feed, spec, frames))
    closing: asyncio.Future[Any] = asyncio.ensure_future(feed.closing.wait())
    try:
        while True:
            await asyncio.wait({forward, closing}, timeout=TICK_S, return_when="FIRST_COMPLETED")
            if forward.done():
                break
            if closing.done():
                await _stop(forward)
                await _close_frame(request, resp, feed, "shutdown", _SHUTDOWN_ERROR)
                return
            now = loop.time()
            if feed.writing_since is not None and now - feed.writing_since > WRITE_TIMEOUT_S:
                log.info("feed dropped: its socket accepted nothing for %.0f s", WRITE_TIMEOUT_S)
                _abort(request)
                return
            if feed.writing_since is None and now - feed.last_write >= HEARTBEAT_S:
                await send_comment(resp, "heartbeat")
                feed.last_write = now
        try:
            forward.result()
        except SubscriberTooSlow as exc:
            feed.cursor = exc.last_cursor or feed.cursor
            await _close_frame(request, resp, feed, "error", exc)
            return
        # The tailer ends its subscriptions only when it stops: the process is going away.
        await _close_frame(request, resp, feed, "shutdown", _SHUTDOWN_ERROR)
    finally:
        closing.cancel()
        await _stop(forward)
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(Exception):
                await aclose()


async def _stop(task: asyncio.Future[Any]) -> None:
    task.cancel()
    with contextlib.suppress(BaseException):
        await task


async def _close_frame(
    request: web.Request, resp: web.StreamResponse, feed: Feed, event: str, error: SvcError
) -> None:
    data = closing_payload(feed.cursor, error.message, error.error_type, error.code)
    try:
        async with asyncio.timeout(WRITE_TIMEOUT_S):
            await send_event(resp, data, event=event, id=feed.cursor or None)
    except TimeoutError:
        _abort(request)
    except ConnectionError:
        pass


def _abort(request: web.Request) -> None:
    """Drop a connection whose socket accepts nothing: nothing more can be written to it."""
    if request.transport is not None:
        request.transport.abort()


def _handler(spec: FeedSpec) -> Callable[[web.Request], Any]:
    async def serve(request: web.Request) -> web.StreamResponse:
        principal = await authenticate(request)
        cursor = await start_cursor(request)
        types = requested_types(request)
        tailer = request.app[TAILER]
        hub = request.app[FEED_HUB]
        events = tailer.subscribe(cursor or None, workspace_id=principal.workspace_id, types=types)
        resp = await open_sse(request)
        await send_retry(resp, RETRY_MS)
        feed = hub.open(cursor)
        try:
            await _pump(request, resp, events, feed, spec, hub.frames)
        except (TimeoutError, ConnectionError):
            log.debug("feed %s of workspace %s dropped", spec.name, principal.workspace_id)
        finally:
            hub.close(feed)
        return resp

    serve.__name__ = f"{spec.name}_feed"
    return serve


async def _close_feeds(app: web.Application) -> None:
    app[FEED_HUB].close_all()


def add_routes(app: web.Application) -> None:
    app[FEED_HUB] = FeedHub()
    app.on_shutdown.append(_close_feeds)
    for spec in FEED_SPECS:
        app.router.add_get(spec.path, _handler(spec), name=f"feed_{spec.name}")
        document(
            "GET",
            spec.path,
            summary=f"SSE feed (any valid key): {spec.summary} Frames: id = cursor, "
            "event = type, data = FeedEvent; a final event: error or shutdown carries "
            "FeedClosing. See docs/feeds.md.",
            tag="Events",
            query=FeedQuery,
            response=FeedEvent,
            content_type="text/event-stream",
        )
