"""A conversation's event history: GET /v1/admin/conversations/events?id=&at_version=N.

Reads the conversation's stream from the event store (not a read model) and rebuilds its state
by folding the conversation behaviour's pure `evolve` over the events up to version N: exactly
what the actor held at that version (ARCHITECTURE.md decision 5).
"""

from __future__ import annotations

from aiohttp import web

from actors.behaviour import ActorKey
from actors.conversation import ConversationBehaviour, ConversationState, conversation_key
from eventstore.records import RecordedEvent
from gateway.admin_common import READ, acting, ok
from gateway.errors import read_query
from gateway.feed_frames import redact, redact_model
from gateway.state import STORE
from schemas.admin import ConversationHistory, HistoryEvent, HistoryQuery
from schemas.errors import InvalidInput, NotFound
from schemas.events import EVENTS


def fold(key: ActorKey, records: list[RecordedEvent]) -> ConversationState:
    behaviour = ConversationBehaviour()
    state = behaviour.initial_state(key)
    for r in records:
        state = behaviour.evolve(state, EVENTS.decode(r.type, r.schema_version, r.data))
    return state


def history_event(record: RecordedEvent) -> HistoryEvent:
    return HistoryEvent(
        version=record.version,
        type=record.type,
        data=redact(EVENTS.upcast(record.type, record.schema_version, record.data)),
        recorded_at=record.recorded_at,
        cursor=record.cursor,
    )


async def conversation_events(request: web.Request) -> web.Response:
    principal = await acting(request, READ)
    params = read_query(request, HistoryQuery)
    key = conversation_key(params.id)
    # Scoped read: another workspace's stream reads as empty, so it is a 404 like an unknown id.
    records = await request.app[STORE].read_stream(
        key.stream_id, workspace_id=principal.workspace_id
    )
    if not records:
        raise NotFound(f"conversation {params.id!r} not found", code="conversation_not_found")
    newest = records[-1].version
    at_version = newest if params.at_version is None else params.at_version
    if at_version > newest:
        raise InvalidInput(
            f"at_version: the conversation's newest version is {newest}", code="invalid_version"
        )
    upto = [r for r in records if r.version <= at_version]
    # A page of the events (a long conversation's whole history could be gigabytes of text);
    # the state is always the fold of every event up to at_version.
    listed = [r for r in upto if r.version > params.after_version][: params.limit]
    more = bool(listed) and listed[-1].version < at_version
    return ok(
        ConversationHistory(
            conversation_id=params.id,
            version=newest,
            at_version=at_version,
            events=[history_event(r) for r in listed],
            next_after_version=listed[-1].version if more else None,
            state=redact_model(fold(key, upto)),
        )
    )
