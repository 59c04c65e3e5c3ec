"""The SSE event feeds: GET /v1/events/stream and GET /v1/web/stream.

Both tail the global log through the process's one `LogTailer` (ARCHITECTURE.md decision 4)
and its one `FeedFanout` (gateway/feed_fanout.py), strictly filtered to the principal's
workspace. Every frame carries `id: <cursor>`, where the cursor is the `(tx, position)` of
the gap-free order (decision 3), sealed (gateway/cursor_seal.py), so a client that resumes
with `Last-Event-ID` (or `?cursor=`) gets exactly the events after the last one it saw, and
learns nothing from it of the rest of the instance's log.

- /v1/events/stream: every event of the acting workspace; needs `admin:read` (read on every
  resource domain), the right to read all of it through the admin API.
- /v1/web/stream: what the web UI's live views need, the events of conversation streams;
  needs read access to conversations, as GET /v1/admin/conversations/events does.

A feed's credential is checked again while it is open (by the fan-out's sweep, and at once
on `FeedFanout.recheck_soon`, for a revocation made in this process): a feed whose credential
a new request would be refused with is closed with a final `event: feed_error` frame. A
consumer that falls behind is cut off by the fan-out (`SubscriberTooSlow`) the same way, with
its cursor; other consumers are never slowed. See docs/feeds.md.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from eventstore.cursor import ORIGIN, encode_cursor
from eventstore.records import RecordedEvent
from gateway.auth import RECHECK, authenticate, require_scope
from gateway.cursor_seal import open_issued
from gateway.feed_fanout import Credential, FeedFanout, FeedFilter
from gateway.feed_frames import (
    FrameCache,
    closing_payload,
    frame_payload,
    is_secret_field,
    opening_frame,
    redact,
)
from gateway.identity.roles import require_access
from gateway.openapi import document
from gateway.sse import open_sse
from gateway.state import AUTH, CURSORS, SETTINGS, STORE, TAILER, Principal
from schemas.admin import FeedEvent, FeedQuery
from schemas.errors import InvalidInput
from schemas.redaction import REDACTED

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


# -- feed selection ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FeedSpec:
    name: str
    path: str
    summary: str
    selects: Callable[[RecordedEvent], bool]
    authorize: Callable[[Principal], None]
    """Raises Forbidden unless the principal may read everything the feed selects."""
    rights: str


def _every_event(record: RecordedEvent) -> bool:
    return True


def _web_ui_event(record: RecordedEvent) -> bool:
    return record.stream_id.startswith("conversation:")


def _reads_everything(principal: Principal) -> None:
    # Every event of the workspace spans every resource domain (keys, users, settings...):
    # plain admin:read, which a user principal holds only with read on every domain.
    require_scope(principal, "admin:read")


def _reads_conversations(principal: Principal) -> None:
    require_access(principal, "conversations", "read")


EVENTS_FEED = FeedSpec(
    "events",
    "/v1/events/stream",
    "Every event of the acting workspace, secret fields redacted.",
    _every_event,
    _reads_everything,
    "admin:read",
)
WEB_FEED = FeedSpec(
    "web",
    "/v1/web/stream",
    "Events of the workspace's conversation streams (messages, turns): the web UI's live view.",
    _web_ui_event,
    _reads_conversations,
    "admin:read, or a user's read access to conversations",
)
FEED_SPECS = (EVENTS_FEED, WEB_FEED)


FEED_HUB: web.AppKey[FeedFanout] = web.AppKey("svc_feed_hub", FeedFanout)


# -- request parsing --------------------------------------------------------------------------

FEED_PARAMETERS = ("cursor", "types", "start", "lastEventId", "_")
"""What a feed's query may hold; only `types` may repeat (`?types=a&types=b`).
`lastEventId` is how EventSource polyfills (which send headers, hence bearer keys) pass the
resume point on reconnection, and is read as `cursor`; `_` is a cache-buster, ignored."""


def check_feed_query(request: web.Request) -> None:
    """Refuse what the feed would otherwise ignore, as the admin API does: a misspelt filter
    (`?type=`) streamed the whole log to a client that meant to filter it, and of a
    repeated `cursor` or `start` the first silently won."""
    query = request.query
    unknown = sorted({name for name in query if name not in FEED_PARAMETERS})
    if unknown:
        names = ", ".join(repr(name[:50]) for name in unknown[:5])
        raise InvalidInput(
            f"unknown query parameter {names}; a feed takes cursor (or lastEventId), types "
            "and start"
        )
    for name in ("cursor", "start", "lastEventId"):
        if len(query.getall(name, [])) > 1:
            raise InvalidInput(f"query parameter {name} is given more than once; give it once")


async def resume_cursor(request: web.Request) -> str | None:
    """`Last-Event-ID` (sent by a reconnecting EventSource) wins over `?lastEventId=` (a
    polyfill's reconnection), which wins over `?cursor=`. Validated
    here, before the stream starts, so a malformed cursor is a plain 400 envelope, and so is
    one this log never issued: a feed from there would wait forever for events after it."""
    query = request.query
    candidates = (
        ("the Last-Event-ID header", request.headers.get("Last-Event-ID")),
        ("lastEventId", query.get("lastEventId")),
        ("cursor", query.get("cursor")),
    )
    # Blank is absent, as an empty value is anywhere in the API: `?lastEventId=%20` must not
    # win over a good ?cursor= and start the feed at the beginning of the log.
    stripped = ((name, (value or "").strip()) for name, value in candidates)
    found = next(((name, value) for name, value in stripped if value), None)
    if found is None:
        return None
    # A refusal names its input: an EventSource resends a Last-Event-ID the page never sees,
    # which then silently wins over a good ?cursor=.
    source, given = found
    return await open_issued(request.app[CURSORS], request.app[TAILER], given, source)


def requested_types(request: web.Request) -> list[str] | None:
    """The `types` filter: None when the parameter is absent or empty (`?types=`, as an empty
    value is anywhere in the API). A value that names no type (`?types=,`) is refused: a
    filter list that came out empty is not a request for every event."""
    given = [value for value in request.query.getall("types", []) if value.strip()]
    if not given:
        return None
    names = list(
        dict.fromkeys(name.strip() for value in given for name in value.split(",") if name.strip())
    )
    if not names:
        raise InvalidInput(
            "types: name at least one event type, or leave the parameter out for every event",
            code="invalid_types",
        )
    if len(names) > MAX_TYPES:
        raise InvalidInput(f"types: at most {MAX_TYPES} event types", code="invalid_types")
    for name in names:
        if not _TYPE_NAME.match(name):
            raise InvalidInput(
                f"types: {name[:50]!r} is not an event type name", code="invalid_types"
            )
    return names


async def start_cursor(request: web.Request, workspace_id: str) -> str:
    """Where the feed starts: the resume cursor; with none, the start of the workspace's log,
    or its current head with `?start=latest`: the workspace's newest event, never the
    instance's, whose every move the first frame's id would tell (an event of the workspace
    committed later has a later point than either, so the feed is the same)."""
    cursor = await resume_cursor(request)
    start = request.query.get("start", "").strip() or "earliest"
    if start not in ("earliest", "latest"):
        raise InvalidInput("start: use earliest or latest", code="invalid_start")
    if cursor is not None or start == "earliest":
        # A cursor given wins over `start`, the origin's included: a `start=latest` feed of
        # an empty workspace resumes from it, not from the head of its reconnection.
        return cursor or ""
    # An empty workspace's head is the log's origin, said as a cursor all the same: an
    # EventSource reconnecting from it misses nothing committed since.
    return await request.app[STORE].head(workspace_id) or encode_cursor(ORIGIN)


# -- serving ----------------------------------------------------------------------------------


async def _authorize(request: web.Request, spec: FeedSpec) -> Principal:
    principal = await authenticate(request)
    spec.authorize(principal)
    return principal


async def _open_hub(app: web.Application) -> None:
    """The process's fan-out, made once the cleanup contexts have opened the platform (it
    seals cursors with the deployment's key). A key revoked (or changed) in this process has
    its feeds checked at once, not at the next sweep."""
    hub = app[FEED_HUB] = FeedFanout(app[CURSORS])
    app[AUTH].on_forget(lambda _key_id: hub.recheck_soon())


def credential(request: web.Request, spec: FeedSpec) -> Credential:
    """The feed's credential, checked again by the fan-out as a new request with the same
    headers would be: every rule of `authenticate` (key revoked or expired, its user
    deactivated, a session ended...) and the feed's rights."""

    async def check() -> None:
        fresh = request.clone()
        for name in list(fresh):
            del fresh[name]  # the principal resolved when the feed opened, and its marks
        fresh[RECHECK] = True  # not counted against the key's rate: it was, when it opened
        await _authorize(fresh, spec)

    headers = request.headers
    key = (spec.name, headers.get("Authorization", ""), headers.get("Cookie", ""))
    return Credential(key, check)


def _handler(spec: FeedSpec) -> Callable[[web.Request], Any]:
    async def serve(request: web.Request) -> web.StreamResponse:
        principal = await _authorize(request, spec)
        check_feed_query(request)
        cursor = await start_cursor(request, principal.workspace_id)
        types = requested_types(request)
        hub = request.app[FEED_HUB]
        hub.attach(request.app[TAILER])
        feed_filter = FeedFilter(
            principal.workspace_id,
            spec.name,
            spec.selects,
            frozenset(types) if types is not None else None,
        )
        most = request.app[SETTINGS].integer("SVC_FEEDS_PER_OWNER")
        owner = (principal.workspace_id, principal.owner())
        await hub.make_room(owner, most)
        with hub.admitted(owner, most):
            resp = await open_sse(request)
            # Also sends the headers: the fan-out writes below aiohttp's writer from here on.
            # The frame's id is where the feed starts: an EventSource that reconnects before
            # the first event it selects (hours, with a rare ?types=) resumes from there,
            # where a `start=latest` feed would otherwise start again at the new head,
            # skipping all that was committed between. A feed from the start names the origin.
            start_id = request.app[CURSORS].seal(cursor or encode_cursor(ORIGIN))
            await resp.write(opening_frame(RETRY_MS, start_id))
            try:
                await hub.serve(request, resp, feed_filter, credential(request, spec), cursor)
            except (TimeoutError, ConnectionError):
                log.debug("feed %s of workspace %s dropped", spec.name, principal.workspace_id)
        return resp

    serve.__name__ = f"{spec.name}_feed"
    return serve


async def _close_feeds(app: web.Application) -> None:
    if FEED_HUB in app:  # else the platform never opened
        app[FEED_HUB].close_all()


def add_routes(app: web.Application) -> None:
    app.on_startup.append(_open_hub)
    app.on_shutdown.append(_close_feeds)
    for spec in FEED_SPECS:
        # No HEAD: a feed is all body, and a body after HEAD would be read as the next response.
        app.router.add_get(spec.path, _handler(spec), name=f"feed_{spec.name}", allow_head=False)
        document(
            "GET",
            spec.path,
            summary=f"SSE feed ({spec.rights}): {spec.summary} Frames: id = cursor, "
            "event = type, data = FeedEvent; the first frame, event: cursor, names where the "
            "feed starts ({cursor}); a final event: feed_error (too slow, credential no longer "
            "valid) or shutdown carries FeedClosing. See docs/feeds.md.",
            tag="Events",
            query=FeedQuery,
            response=FeedEvent,
            content_type="text/event-stream",
            request_headers=(
                (
                    "Last-Event-ID",
                    "resume after this cursor (an EventSource sends it when it reconnects); "
                    "wins over ?cursor=",
                ),
            ),
        )
