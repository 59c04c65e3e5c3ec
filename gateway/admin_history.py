"""A conversation's event history: GET /v1/admin/conversations/events?id=&at_version=N.

Reads the conversation's stream from the event store (not a read model) and rebuilds its state
by folding the conversation behaviour's pure `evolve` over the events up to version N: exactly
what the actor held at that version (ARCHITECTURE.md decision 5).

A conversation's stream may be long (gigabytes of text, an event up to a megabyte), so
nothing here reads it whole, nor a thousand large events at once: every read is cut to
`PAGE_BYTES` by the events' sizes, asked of the database first (`Stream.read_cut`). The
page asked for is read by its version range, the state is folded from the stream's snapshot
when that is at or below N (as an actor activates) and otherwise from the start, and the
newest version is read from the stream's index. `svc conversations replay` (gateway/cli.py)
reads through the same functions.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from aiohttp import web

from actors.behaviour import ActorKey
from actors.context import snapshot_state
from actors.conversation import ConversationBehaviour, ConversationState, conversation_key
from eventstore.paging import cut_page
from eventstore.port import EventStore
from eventstore.records import RecordedEvent, Snapshot
from gateway.admin_common import READ, acting, ok
from gateway.errors import read_query
from gateway.feed_frames import redact, redact_model
from gateway.state import CURSORS, STORE
from schemas.admin import ConversationHistory, HistoryEvent, HistoryQuery
from schemas.errors import InvalidInput, NotFound, quoted
from schemas.events import EVENTS

FOLD_PAGE = 1000
"""Events read at once at most, while folding or listing."""
PAGE_BYTES = 4 * 1024 * 1024
"""The event data (as JSON text) one read holds at most, unless its first event alone is
larger: a conversation's events may carry a megabyte of text each. It also bounds a page
of the listing."""
FIRST_LOOKAHEAD = 16
"""Events sized ahead by the first read of a range; then twice what the last read took:
the database renders each event it sizes, so sizing runs at most about twice what is read."""


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

    async def read_cut(
        self, first: int, last: int, *, lookahead: int, budget: int, must_fit: bool = False
    ) -> tuple[list[RecordedEvent], int]:
        """Versions `first`..`last`, at most `lookahead` of them, ending early at `budget`
        bytes by the events' sizes, asked for first (the first event always is read, so a
        reader moves on, unless `must_fit`: a later read of a page, whose first event over
        the budget ends the page); with the bytes read."""
        lookahead = min(lookahead, FOLD_PAGE)
        last = min(last, first + lookahead - 1)
        sizes = await self.store.stream_sizes(
            self.key.stream_id, first, last, workspace_id=self.workspace_id
        )
        end, _ = cut_page(sizes, lookahead, budget)
        if end is None or (must_fit and sizes[0][1] > budget):
            return [], 0
        return await self.read(first, end), sum(size for v, size in sizes if v <= end)

    async def pages(
        self, first: int, last: int, *, budget: int | None = None
    ) -> AsyncIterator[list[RecordedEvent]]:
        """Versions `first`..`last`, in reads of at most PAGE_BYTES and FOLD_PAGE events;
        with `budget`, ending before the event that would take them past it (the first
        event is read whatever its size, so that a reader moves on)."""
        lookahead, left = min(FIRST_LOOKAHEAD, FOLD_PAGE), budget
        while first <= last and (left is None or left > 0):
            cap = PAGE_BYTES if left is None else min(PAGE_BYTES, left)
            page, size = await self.read_cut(
                first, last, lookahead=lookahead, budget=cap, must_fit=left != budget
            )
            if not page:
                return
            yield page
            first = page[-1].version + 1
            lookahead = min(FOLD_PAGE, 2 * len(page))
            left = None if left is None else left - size


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
        raise NotFound(f"conversation {quoted(params.id)} not found", code="conversation_not_found")
    at_version = newest if params.at_version is None else params.at_version
    if at_version > newest:
        raise InvalidInput(
            f"at_version: the conversation's newest version is {newest}", code="invalid_version"
        )
    # A page of the events; the state, the fold of every event up to at_version.
    first = params.after_version + 1
    last = min(at_version, params.after_version + params.limit)
    listed = [r async for page in stream.pages(first, last, budget=PAGE_BYTES) for r in page]
    more = bool(listed) and listed[-1].version < at_version
    state = None
    if params.state:
        # Folded from the first event when at_version is below the stream's snapshot: a
        # client paging at a fixed version asks for it once, not with every page.
        state = redact_model(await state_at(stream, at_version, await snapshot_of(stream)))
    return ok(
        ConversationHistory(
            conversation_id=params.id,
            version=newest,
            at_version=at_version,
            events=[history_event(r, cursors.seal_point(r.point)) for r in listed],
            next_after_version=listed[-1].version if more else None,
            state=state,
        )
    )
