"""The SSE event feeds: GET /v1/events/stream and GET /v1/web/stream.

Both tail the global log through the process's one `LogTailer` (ARCHITECTURE.md decision 4)
and its one `FeedFanout` (gateway/feed_fanout.py), strictly filtered to the principal's
workspace. Every frame carries `id: <cursor>`, where the
cursor is the opaque `(tx, position)` of the gap-free order (decision 3), so a client that
resumes with `Last-Event-ID` (or `?cursor=`) gets exactly the events after the last one it saw.

- /v1/events/stream: every event of the acting workspace.
- /v1/web/stream: what the web UI's live views need, the events of conversation streams.

A consumer that falls behind is cut off by the fan-out (`SubscriberTooSlow`) with a final
`event: error` frame carrying its cursor; other consumers are never slowed. See docs/feeds.md.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from eventstore.cursor import decode_cursor
from eventstore.errors import InvalidCursor
from eventstore.records import RecordedEvent
from eventstore.tailer import LogTailer
from gateway.auth import authenticate
from gateway.feed_fanout import FeedFanout, FeedFilter
from gateway.feed_frames import (
    REDACTED,
    FrameCache,
    closing_payload,
    frame_payload,
    is_secret_field,
    redact,
)
from gateway.openapi import document
from gateway.sse import open_sse, send_retry
from gateway.state import STORE, TAILER
from schemas.admin import FeedEvent, FeedQuery
from schemas.errors import InvalidInput

__all__ = [
    "EVENTS_FEED",
    "FEED_HUB",
    "FEED_SPECS",
    "REDACTED",
    "WEB_FEED",
    "FeedSpec",
    "FrameCache",
    "add_routes",
    "closing_payload",
    "frame_payload",
    "is_secret_field",
    "redact",
]

log = logging.getLogger(__name__)

RETRY_MS = 3000
MAX_TYPES = 64
_TYPE_NAME = re.compile(r"^[A-Za-z0-9_.:\-]{1,200}$")
_MAX_INT8 = 2**63 - 1


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


FEED_HUB: web.AppKey[FeedFanout] = web.AppKey("svc_feed_hub", FeedFanout)


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


def _tailer(app: web.Application) -> LogTailer:
    tailer = app[TAILER]
    if not isinstance(tailer, LogTailer):
        raise TypeError("the SSE feeds fan out from the process's LogTailer")
    return tailer


def _handler(spec: FeedSpec) -> Callable[[web.Request], Any]:
    async def serve(request: web.Request) -> web.StreamResponse:
        principal = await authenticate(request)
        cursor = await start_cursor(request)
        types = requested_types(request)
        hub = request.app[FEED_HUB]
        hub.attach(_tailer(request.app))
        feed_filter = FeedFilter(
            principal.workspace_id,
            spec.name,
            spec.selects,
            frozenset(types) if types is not None else None,
        )
        resp = await open_sse(request)
        # Also sends the headers: the fan-out writes below aiohttp's writer from here on.
        await send_retry(resp, RETRY_MS)
        try:
            await hub.serve(request, resp, feed_filter, cursor)
        except (TimeoutError, ConnectionError):
            log.debug("feed %s of workspace %s dropped", spec.name, principal.workspace_id)
        return resp

    serve.__name__ = f"{spec.name}_feed"
    return serve


async def _close_feeds(app: web.Application) -> None:
    app[FEED_HUB].close_all()


def add_routes(app: web.Application) -> None:
    app[FEED_HUB] = FeedFanout()
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
