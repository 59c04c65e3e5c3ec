"""A conversation's event history: GET /v1/admin/conversations/events?id=&at_version=N.

Reads the conversation's stream from the event store (not a read model) and rebuilds its state
by folding the conversation behaviour's pure `evolve` over the events up to version N: exactly
what the actor held at that version (ARCHITECTURE.md decision 5).

A conversation's stream may be long (gigabytes of text), so nothing here reads it whole: the
page asked for is read by its version range and cut at about `PAGE_BYTES` of data, the state
is folded from the stream's snapshot when that is at or below N (as an actor activates) and
otherwise from the start, in reads sized to hold about `PAGE_BYTES`, and the newest version
is read from the stream's index. `svc conversations replay` (gateway/cli.py) reads through
the same functions.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import orjson
from aiohttp import web

from actors.behaviour import ActorKey
from actors.context import snapshot_state
from actors.conversation import ConversationBehaviour, ConversationState, conversation_key
from eventstore.port import EventStore
from eventstore.records import RecordedEvent, Snapshot
from gateway.admin_common import READ, acting, ok
from gateway.errors import read_query
from gateway.feed_frames import redact, redact_model
from gateway.state import CURSORS, STORE
from schemas.admin import ConversationHistory, HistoryEvent, HistoryQuery
from schemas.errors import InvalidInput, NotFound
from schemas.events import EVENTS

FOLD_PAGE = 1000
"""Events read at once at most, while folding or listing."""
FIRST_PAGE = 16
"""Events of the first read of a range: its sizes then size the next reads."""
PAGE_BYTES = 8 * 1024 * 1024
"""About the event data one read holds: a conversation's events may carry a megabyte of
text each, so a thousand of them are not read at once unless they are small. It also
bounds a page of the listing (beyond its first event)."""


@dataclass(frozen=True, slots=True)
class Stream:
    """A conversation's stream as read by one caller: `workspace_id` None reads unscoped."""

    store: EventStore
    key: ActorKey
    workspace_id: str | None

    async def newest_version(self) -> int:
        """0 when the stream has no events (in the workspace, when scoped)."""
        return await self.store.stream_version(self.key.stream_id, workspace_id=self.workspace_id)

    async def read(self, first: int, last: int) -> list[RecordedEvent]:
        return await self.store.read_stream(
            self.key.stream_id, first, workspace_id=self.workspace_id, to_version=last
        )

    async def pages(self, first: int, last: int) -> AsyncIterator[list[RecordedEvent]]:
        """Versions `first`..`last`, in reads of about PAGE_BYTES (at most FOLD_PAGE events):
        each read is sized by the events the last one met, growing at most twofold."""
        limit = min(FIRST_PAGE, FOLD_PAGE)
        while first <= last:
            page = await self.read(first, min(last, first + limit - 1))
            if not page:
                return
            yield page
            first = page[-1].version + 1
            per_event = max(1, data_bytes(page) // len(page))
            limit = max(1, min(PAGE_BYTES // per_event, 2 * limit, FOLD_PAGE))


def data_bytes(records: list[RecordedEvent]) -> int:
    """The size of the events' data as JSON: what they hold in memory, near enough."""
    return sum(len(orjson.dumps(r.data)) for r in records)


async def listing(stream: Stream, first: int, last: int) -> list[RecordedEvent]:
    """Versions `first`..`last`, ending early once about PAGE_BYTES of data are listed (the
    first event always is, so a listing moves on)."""
    listed: list[RecordedEvent] = []
    total = 0
    async for page in stream.pages(first, last):
        for record in page:
            size = len(orjson.dumps(record.data))
            if listed and total + size > PAGE_BYTES:
                return listed
            listed.append(record)
            total += size
    return listed


def _evolve(state: ConversationState, records: list[RecordedEvent]) -> ConversationState:
    behaviour = ConversationBehaviour()
    for r in records:
        state = behaviour.evolve(state, EVENTS.decode(r.type, r.schema_version, r.data))
    return state


def _restored(snapshot: Snapshot | None, version: int) -> ConversationState | None:
    """The snapshot's state when it can stand for the fold up to `version`: at or below it,
    and usable as an actor's activation would use it."""
    if snapshot is None or snapshot.version > version:
        return None
    return snapshot_state(ConversationBehaviour(), snapshot)


async def snapshot_of(stream: Stream) -> Snapshot | None:
    # Snapshots are not scoped by workspace: callers first see the stream in theirs.
    return await stream.store.load_snapshot(stream.key.stream_id)


async def state_at(
    stream: Stream, version: int, snapshot: Snapshot | None = None
) -> ConversationState:
    """The fold of every event up to `version`, from the snapshot when it is usable."""
    restored = _restored(snapshot, version)
    if restored is None or snapshot is None:
        state, start = ConversationBehaviour().initial_state(stream.key), 1
    else:
        state, start = restored, snapshot.version + 1
    async for page in stream.pages(start, version):
        state = _evolve(state, page)
    return state


def history_event(record: RecordedEvent, cursor: str) -> HistoryEvent:
    """The event as the history shows it, with `cursor`, its public form."""
    return HistoryEvent(
        version=record.version,
        type=record.type,
        data=redact(EVENTS.upcast(record.type, record.schema_version, record.data)),
        recorded_at=record.recorded_at,
        cursor=cursor,
    )


async def conversation_events(request: web.Request) -> web.Response:
    principal = await acting(request, READ)
    params = read_query(request, HistoryQuery)
    cursors = request.app[CURSORS]
    # Scoped reads: another workspace's stream reads as empty, so it is a 404 like an unknown id.
    stream = Stream(request.app[STORE], conversation_key(params.id), principal.workspace_id)
    newest = await stream.newest_version()
    if not newest:
        raise NotFound(f"conversation {params.id!r} not found", code="conversation_not_found")
    snapshot = await snapshot_of(stream)
    at_version = newest if params.at_version is None else params.at_version
    if at_version > newest:
        raise InvalidInput(
            f"at_version: the conversation's newest version is {newest}", code="invalid_version"
        )
    # A page of the events; the state is always the fold of every event up to at_version.
    first = params.after_version + 1
    listed = await listing(stream, first, min(at_version, params.after_version + params.limit))
    more = bool(listed) and listed[-1].version < at_version
    return ok(
        ConversationHistory(
            conversation_id=params.id,
            version=newest,
            at_version=at_version,
            events=[history_event(r, cursors.seal_point(r.point)) for r in listed],
            next_after_version=listed[-1].version if more else None,
            state=redact_model(await state_at(stream, at_version, snapshot)),
        )
    )
