"""The PostgreSQL adapter of the event store port (eventstore/port.py)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import asyncpg

from eventstore.cursor import ORIGIN, LogPoint, decode_cursor, encode_cursor
from eventstore.db import Connection, Database
from eventstore.errors import ConcurrencyConflict, InvalidAppend, InvalidCursor, StoreError
from eventstore.metrics import APPEND_SECONDS
from eventstore.port import EventStore
from eventstore.reads import EVENT_COLUMNS, log_head, read_log, rows_to_events
from eventstore.records import AppendResult, NewEvent, RecordedEvent, Snapshot

_MAX_INT8 = 2**63 - 1
_MAX_BATCH = 10_000
_MAX_READ_LIMIT = 10_000


class LogSubscriber(Protocol):
    """What `subscribe` delegates to: the process's log tailer (eventstore/tailer.py)."""

    def subscribe(
        self,
        after: str | None = None,
        *,
        workspace_id: str | None = None,
        types: Sequence[str] | None = None,
    ) -> AsyncIterator[RecordedEvent]: ...


# The whole append is one statement, `svc_append` (migration 0003), run in an implicit
# transaction: one round trip (Bind/Execute/Sync of a statement asyncpg keeps prepared per
# connection) where BEGIN + claim + insert + COMMIT took four. What it guarantees:
# - The idempotency ledger row `(workspace_id, command_id)` is claimed first, in the append's
#   own transaction: a concurrent duplicate of the same command blocks on this row until the
#   first append commits (then sees it and returns the first result, `duplicate`) or rolls back
#   (then acts itself). Events and ledger row commit or vanish together, so a command can never
#   take effect twice or be recorded without effect. A duplicate wins over a stale version.
# - The single-writer fence is `UNIQUE (stream_id, version)` (never ON CONFLICT on events):
#   the batch takes versions head+1.., and a second writer of a version fails with a unique
#   violation on events_stream_version. An expected version other than the head fails with
#   SV409 before writing; a stream of another workspace with SV403. Any failure rolls the
#   claim back with the rest, so a failed command leaves no ledger row and may be retried.
_APPEND = """
SELECT duplicate, stream_id, first_version, last_version, last_tx, last_position
FROM svc_append($1, $2, $3, $4, $5, $6, $7, $8, $9)
"""
_STATE_CONFLICT = "SV409"
_STATE_FOREIGN_STREAM = "SV403"
_READ_STREAM = f"""
SELECT {EVENT_COLUMNS} FROM events
WHERE stream_id = $1 AND version >= $2
ORDER BY version
"""
_READ_STREAM_WS = f"""
SELECT {EVENT_COLUMNS} FROM events
WHERE stream_id = $1 AND version >= $2 AND workspace_id = $3
ORDER BY version
"""
# Snapshots only move forward: a slow writer holding an older state never replaces a newer one.
_SAVE_SNAPSHOT = """
INSERT INTO snapshots (stream_id, version, schema_version, state)
VALUES ($1, $2, $3, $4)
ON CONFLICT (stream_id) DO UPDATE
SET version = excluded.version, schema_version = excluded.schema_version,
    state = excluded.state, recorded_at = now()
WHERE (snapshots.version, snapshots.schema_version)
    < (excluded.version, excluded.schema_version)
"""
_LOAD_SNAPSHOT = """
SELECT stream_id, version, schema_version, state FROM snapshots WHERE stream_id = $1
"""
_NEWEST_TX = "SELECT tx FROM events ORDER BY tx DESC LIMIT 1"
_NEXT_XID = "SELECT pg_snapshot_xmax(pg_current_snapshot())"


def _noop() -> None:
    pass


def _validate_append(
    stream_id: str,
    events: Sequence[NewEvent],
    expected_version: int | None,
    command_id: str,
    workspace_id: str,
) -> None:
    if not stream_id:
        raise InvalidAppend("an append needs a stream id")
    if not workspace_id:
        raise InvalidAppend("an append needs a workspace id")
    if not command_id:
        raise InvalidAppend("an append needs a command id (the idempotency key)")
    if not events:
        raise InvalidAppend(f"append to {stream_id!r} has no events")
    if len(events) > _MAX_BATCH:
        raise InvalidAppend(f"append to {stream_id!r} has more than {_MAX_BATCH} events")
    if expected_version is not None and expected_version < 0:
        raise InvalidAppend(f"expected version must be 0 or more, got {expected_version}")
    if len({e.event_id for e in events}) != len(events):
        raise InvalidAppend(f"append to {stream_id!r} repeats an event id")
    for e in events:
        if not e.type:
            raise InvalidAppend(f"append to {stream_id!r} has an event without a type")
        if not 0 < e.schema_version < 2**15:
            raise InvalidAppend(f"event {e.type!r} has schema version {e.schema_version}")


class PostgresEventStore:
    """Append-only log in PostgreSQL; the single-writer fence and the idempotency ledger.

    `on_commit` runs right after each append commits (the commit notifier's wake-up);
    `subscriber` serves `subscribe` (the process's log tailer); `on_close` callbacks run on
    `close()`, in order, to stop what `open_store` started.
    """

    def __init__(
        self,
        db: Database,
        *,
        on_commit: Callable[[], None] = _noop,
        subscriber: LogSubscriber | None = None,
        on_close: Sequence[Callable[[], Awaitable[None]]] = (),
    ) -> None:
        self._db = db
        self._on_commit = on_commit
        self._subscriber = subscriber
        self._on_close = list(on_close)

    @property
    def db(self) -> Database:
        return self._db

    async def close(self) -> None:
        callbacks, self._on_close = self._on_close, []
        for callback in callbacks:
            await callback()

    async def append(
        self,
        stream_id: str,
        events: Sequence[NewEvent],
        *,
        expected_version: int | None,
        command_id: str,
        workspace_id: str,
    ) -> AppendResult:
        """Append `events` to `stream_id` in one transaction, once per `command_id`.

        A `StoreUnavailable` raised while committing leaves the outcome unknown; retrying with
        the same command id is safe: it either acts or returns the first result.
        """
        _validate_append(stream_id, events, expected_version, command_id, workspace_id)
        started = time.perf_counter()
        try:
            async with self._db.acquire(stateless=True) as conn:
                row = await self._call_append(
                    conn, stream_id, events, expected_version, command_id, workspace_id
                )
        finally:
            APPEND_SECONDS.observe(time.perf_counter() - started)
        duplicate, recorded_stream, first_version, last_version, last_tx, last_position = row
        if not duplicate:
            self._on_commit()
        return AppendResult(
            stream_id=recorded_stream,
            first_version=first_version,
            last_version=last_version,
            cursor=encode_cursor(LogPoint(last_tx, last_position)),
            duplicate=duplicate,
        )

    @staticmethod
    async def _call_append(
        conn: Connection,
        stream_id: str,
        events: Sequence[NewEvent],
        expected_version: int | None,
        command_id: str,
        workspace_id: str,
    ) -> Any:
        expected = expected_version
        if expected is not None and expected > _MAX_INT8:
            expected = _MAX_INT8  # as unreachable as the caller's, and fits the bigint parameter
        try:
            return await conn.fetchrow(
                _APPEND,
                workspace_id,
                command_id,
                stream_id,
                expected,
                [e.event_id for e in events],
                [e.type for e in events],
                [e.schema_version for e in events],
                [e.data for e in events],
                [e.metadata for e in events],
            )
        except asyncpg.UniqueViolationError as exc:
            if exc.constraint_name == "events_stream_version":
                raise ConcurrencyConflict(stream_id, expected_version) from None
            if exc.constraint_name == "events_event_id_key":
                raise InvalidAppend(
                    "an event with one of these event ids is already recorded"
                ) from None
            raise
        except asyncpg.DataError:
            # The driver's message quotes the data, which may hold anything: keep it out.
            raise InvalidAppend(
                "event data or metadata cannot be stored as JSON "
                "(a value that is not JSON, or a \\u0000 character in a string)"
            ) from None
        except asyncpg.PostgresError as exc:
            if exc.sqlstate == _STATE_CONFLICT:
                raise ConcurrencyConflict(stream_id, expected_version) from None
            if exc.sqlstate == _STATE_FOREIGN_STREAM:
                raise InvalidAppend(f"stream {stream_id!r} belongs to another workspace") from None
            raise

    async def read_stream(
        self, stream_id: str, from_version: int = 1, *, workspace_id: str | None = None
    ) -> list[RecordedEvent]:
        # Stream versions are dense and each commits only after the previous one did (the
        # fence), so a plain read of committed rows has no gaps: no snapshot filter needed.
        async with self._db.acquire(stateless=True) as conn:
            if workspace_id is None:
                rows = await conn.fetch(_READ_STREAM, stream_id, max(from_version, 1))
            else:
                rows = await conn.fetch(
                    _READ_STREAM_WS, stream_id, max(from_version, 1), workspace_id
                )
        return rows_to_events(rows)

    async def read_all(
        self,
        after: str | None = None,
        limit: int = 1000,
        *,
        workspace_id: str | None = None,
        types: Sequence[str] | None = None,
    ) -> list[RecordedEvent]:
        point = _checked_point(after)
        if limit < 1:
            return []
        limit = min(limit, _MAX_READ_LIMIT)
        async with self._db.acquire(stateless=True) as conn:
            return await read_log(conn, point, limit, workspace_id, types)

    def subscribe(
        self,
        after: str | None = None,
        *,
        workspace_id: str | None = None,
        types: Sequence[str] | None = None,
    ) -> AsyncIterator[RecordedEvent]:
        if self._subscriber is None:
            raise StoreError(
                "this event store has no log tailer, so it cannot serve subscriptions; "
                "open it with eventstore.open_store() or pass subscriber=LogTailer(...)"
            )
        _checked_point(after)
        return self._subscriber.subscribe(after, workspace_id=workspace_id, types=types)

    async def save_snapshot(self, snapshot: Snapshot) -> None:
        async with self._db.acquire(stateless=True) as conn:
            await conn.execute(
                _SAVE_SNAPSHOT,
                snapshot.stream_id,
                snapshot.version,
                snapshot.schema_version,
                snapshot.state,
            )

    async def load_snapshot(self, stream_id: str) -> Snapshot | None:
        async with self._db.acquire(stateless=True) as conn:
            row = await conn.fetchrow(_LOAD_SNAPSHOT, stream_id)
        return None if row is None else Snapshot(*row)

    async def head(self) -> str:
        async with self._db.acquire(stateless=True) as conn:
            point = await log_head(conn)
        return "" if point == ORIGIN else encode_cursor(point)


def _checked_point(after: str | None) -> LogPoint:
    point = decode_cursor(after)
    if point.tx > _MAX_INT8 or point.position > _MAX_INT8:
        raise InvalidCursor("malformed cursor: it points outside the log; omit it to start over")
    return point


async def check_xid_horizon(db: Database) -> None:
    """Refuse a store whose newest event is ahead of the cluster's transaction counter.

    The gap-free read shows only rows below the oldest running xid. A logical dump
    (pg_dump/pg_restore) restored into a new cluster keeps the stored `tx` values while the
    new cluster counts xids from low numbers again: every new event would sort before the old
    ones and readers past the old head would never see them. Physical backups keep xid order.
    """
    async with db.acquire() as conn:
        newest = await conn.fetchval(_NEWEST_TX)
        next_xid = await conn.fetchval(_NEXT_XID)
    if newest is not None and newest >= next_xid:
        raise StoreError(
            f"the event store's newest transaction id ({newest}) is ahead of this database "
            f"cluster's transaction counter ({next_xid}), as after restoring a logical dump "
            "into a new cluster. New events would be invisible to log readers. Restore from a "
            "physical backup instead, or advance the cluster's xid counter past it "
            "(pg_resetwal --next-transaction-id with the server stopped), then start again."
        )


if TYPE_CHECKING:
    # mypy proves the adapter satisfies the port.
    def _conforms(store: PostgresEventStore) -> EventStore:
        return store
