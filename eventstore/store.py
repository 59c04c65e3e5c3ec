"""The PostgreSQL adapter of the event store port (eventstore/port.py)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import asyncpg

from eventstore.coalescer import Coalescer
from eventstore.cursor import ORIGIN, LogPoint, decode_cursor, encode_cursor
from eventstore.db import Connection, Database, is_unavailable_state, translate_errors
from eventstore.errors import (
    ConcurrencyConflict,
    InvalidAppend,
    InvalidCursor,
    StoreError,
    StoreUnavailable,
)
from eventstore.metrics import APPEND_SECONDS
from eventstore.port import EventStore
from eventstore.reads import EVENT_COLUMNS, log_head, read_log, rows_to_events
from eventstore.records import AppendResult, NewEvent, RecordedEvent, Snapshot
from schemas.text import is_utf8

log = logging.getLogger(__name__)

_MAX_INT8 = 2**63 - 1
_MAX_VERSION = 2**31 - 1
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


# Every append is one statement run in an implicit transaction: one round trip (Bind/Execute/
# Sync of a statement asyncpg keeps prepared per connection) where BEGIN + claim + insert +
# COMMIT took four. Appends that arrive while others are in flight share one statement,
# `svc_append_set` (migration 0006): one round trip and one durable commit for all of them,
# each still succeeding or failing on its own. What every append is guaranteed (migrations
# 0004-0006):
# - The idempotency ledger row `(workspace_id, command_id)` is claimed in the append's own
#   transaction: a concurrent duplicate of the same command blocks on this row until the
#   first append commits (then sees it and returns the first result, `duplicate`) or rolls back
#   (then acts itself). Events and ledger row commit or vanish together, so a command can never
#   take effect twice or be recorded without effect. A duplicate wins over a stale version.
# - The single-writer fence is `UNIQUE (stream_id, version)` (never ON CONFLICT on events):
#   the append takes versions head+1.., and a second writer of a version fails with a unique
#   violation on events_stream_version. An expected version other than the head fails with
#   SV409 before writing; a stream of another workspace with SV403. Any failure rolls the
#   claim back with the rest, so a failed command leaves no ledger row and may be retried.
# - A wait on either row is bounded well inside the statement timeout (migration 0008): an
#   append still waiting then fails alone with lock_not_available (55P03), reported as a
#   retryable StoreUnavailable, and the other appends of its statement are written.
# An append sent alone goes to `svc_append` (migration 0004; the one-by-one path of
# `svc_append_set` runs it per item): for one append it costs less server CPU than the
# set-based path (about 150-200 us less per call, measured on the 2-core machine).
_APPEND = """
SELECT duplicate, stream_id, first_version, last_version, last_tx, last_position
FROM svc_append($1, $2, $3, $4, $5, $6, $7, $8, $9)
"""
_APPEND_SET = """
SELECT item, error_state, error_constraint, duplicate, stream_id, first_version, last_version,
       last_tx, last_position
FROM svc_append_set($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)
"""
_MAX_APPENDS_PER_BATCH = 32
"""When a batch takes the one-by-one path, each item takes a subtransaction id; a backend
caches 64 of them before its snapshots overflow and slow every other session (migration
0005)."""
_ANY_VERSION_ATTEMPTS = 16
"""How often an append without an expected version is sent again after losing the next
version of its stream to another writer: each loss means another append succeeded."""
_STATE_UNIQUE = "23505"
_CLASS_DATA = "22"
_STATE_CONFLICT = "SV409"
_STATE_FOREIGN_STREAM = "SV403"
_STATE_LOCK_TIMEOUT = "55P03"
_READ_STREAM = f"""
SELECT {EVENT_COLUMNS} FROM events
WHERE stream_id = $1 AND version >= $2 AND version <= $3
ORDER BY version
"""
_READ_STREAM_WS = f"""
SELECT {EVENT_COLUMNS} FROM events
WHERE stream_id = $1 AND version >= $2 AND version <= $3 AND workspace_id = $4
ORDER BY version
"""
# The size as JSON text, rendered by the server and not sent (pg_column_size would be the
# stored size, which compression makes up to ninety times smaller than the value).
_STREAM_SIZES = """
SELECT version, octet_length(data::text) + octet_length(metadata::text) FROM events
WHERE stream_id = $1 AND version >= $2 AND version <= $3
  AND ($4::text IS NULL OR workspace_id = $4)
ORDER BY version
"""
# On the (stream_id, version) index: one entry read, however long the stream. A stream of
# another workspace has no events in this one.
_STREAM_VERSION = """
SELECT coalesce(max(version), 0) FROM events
WHERE stream_id = $1 AND ($2::text IS NULL OR workspace_id = $2)
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
_PROCESSED = """
SELECT stream_id, first_version, last_version, last_tx, last_position
FROM processed_commands WHERE workspace_id = $1 AND command_id = $2
"""
_NEWEST_TX = "SELECT tx FROM events ORDER BY tx DESC LIMIT 1"
_NEXT_XID = "SELECT pg_snapshot_xmax(pg_current_snapshot())"


def _unstorable_data() -> InvalidAppend:
    # The driver's message would quote the data, which may hold anything: keep it out.
    return InvalidAppend(
        "event data or metadata cannot be stored as JSON "
        "(a value that is not JSON, or a \\u0000 character in a string)"
    )


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
    for name, value in (
        ("stream id", stream_id),
        ("workspace id", workspace_id),
        ("command id", command_id),
    ):
        _check_id(name, value)
    _check_ledger_key(workspace_id, command_id)
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
        _check_id("event type", e.type)
        # A list would reach the driver as one more array dimension and be flattened.
        if not isinstance(e.data, dict) or not isinstance(e.metadata, dict):
            raise InvalidAppend(f"event {e.type!r}: data and metadata must be JSON objects")
        if not 0 < e.schema_version < 2**15:
            raise InvalidAppend(f"event {e.type!r} has schema version {e.schema_version}")


_MAX_ID_CHARS = 500
"""Ids and types are keys of B-tree indexes, whose entries hold at most about 2,700 bytes:
500 characters of UTF-8 stay under that whatever they are."""


_MAX_LEDGER_KEY_BYTES = 2400
"""The ledger is keyed by (workspace id, command id) together: two ids of 500 characters of
four UTF-8 bytes each would pass the index's limit that each alone stays under."""


def _check_ledger_key(workspace_id: str, command_id: str) -> None:
    if workspace_id.isascii() and command_id.isascii():
        return  # at most 1,000 bytes
    size = len(workspace_id.encode()) + len(command_id.encode())
    if size > _MAX_LEDGER_KEY_BYTES:
        raise InvalidAppend(
            f"the workspace id and the command id take {size:,} bytes of UTF-8 together; "
            f"the processed-commands ledger keys at most {_MAX_LEDGER_KEY_BYTES:,}"
        )


def _check_id(name: str, value: str) -> None:
    """Refuse an id the tables cannot key, naming it (a NUL or a lone surrogate, which
    PostgreSQL text cannot hold; one too long for its index)."""
    if len(value) > _MAX_ID_CHARS:
        raise InvalidAppend(f"the {name} is longer than {_MAX_ID_CHARS} characters")
    if "\x00" in value or not is_utf8(value):
        raise InvalidAppend(f"the {name} holds a NUL or a lone surrogate, which cannot be stored")


_AppendRow = tuple[bool, str, int, int, int, int]
"""duplicate, stream_id, first_version, last_version, last_tx, last_position"""


@dataclass(frozen=True, slots=True)
class _Append:
    stream_id: str
    events: Sequence[NewEvent]
    expected_version: int | None
    command_id: str
    workspace_id: str

    @property
    def expected_parameter(self) -> int | None:
        """The expected version as the bigint parameter: one past int8 is as unreachable."""
        expected = self.expected_version
        return expected if expected is None or expected <= _MAX_INT8 else _MAX_INT8


async def _append_one(conn: Connection, item: _Append) -> _AppendRow | StoreError:
    """One append through `svc_append`; the item's own failure is returned, not raised."""
    events = item.events
    try:
        row = await conn.fetchrow(
            _APPEND,
            item.workspace_id,
            item.command_id,
            item.stream_id,
            item.expected_parameter,
            [e.event_id for e in events],
            [e.type for e in events],
            [e.schema_version for e in events],
            [e.data for e in events],
            [e.metadata for e in events],
        )
    except asyncpg.DataError:
        return _unstorable_data()
    except asyncpg.PostgresError as exc:
        failure = _item_failure(item, exc.sqlstate, getattr(exc, "constraint_name", None))
        if failure is None:
            raise
        return failure
    return (row[0], row[1], row[2], row[3], row[4], row[5])


async def _append_many(conn: Connection, batch: list[_Append]) -> list[_AppendRow | Exception]:
    """Several appends through `svc_append_set`: one round trip, one commit; set-based when
    no item depends on or conflicts with another, one by one otherwise (migration 0006)."""
    try:
        rows = await conn.fetch(_APPEND_SET, *_set_arguments(batch))
    except (asyncpg.DataError, asyncpg.ProgramLimitExceededError):
        # Parameters are parsed before the function runs, so one item's unstorable JSON
        # fails the whole statement, and nothing was written: send them one by one so only
        # that item fails. The same when the batch's data, one jsonb document, is over
        # jsonb's 256 MB: one by one, each event's data is a jsonb of its own.
        return await _append_each(conn, batch)
    outcomes: list[_AppendRow | Exception] = []
    for item, row in zip(batch, rows, strict=True):
        state = row[1]
        if state is None:
            outcomes.append((row[3], row[4], row[5], row[6], row[7], row[8]))
        else:
            failure = _item_failure(item, state, row[2])
            outcomes.append(failure or _unexpected_failure(item, state))
    return outcomes


async def _append_each(conn: Connection, batch: list[_Append]) -> list[_AppendRow | Exception]:
    """The items one by one, each in its own transaction, so each outcome is its own: those
    sent before a failure that is not about its item (connection lost, statement timeout)
    stay committed and are reported so; that item gets the failure; the rest is not sent,
    since the connection may be unusable, and each of them says it was not made."""
    outcomes: list[_AppendRow | Exception] = []
    for index, item in enumerate(batch):
        try:
            with translate_errors():
                outcomes.append(await _append_one(conn, item))
        except StoreError as exc:
            outcomes.append(exc)
            outcomes.extend(_not_sent(rest, exc) for rest in batch[index + 1 :])
            break
    return outcomes


def _not_sent(item: _Append, cause: StoreError) -> StoreUnavailable:
    # The cause's own words (the driver's, the server's, an address) are detail, for the log
    # only: this message reaches the client, and a chat turn's failure record.
    return StoreUnavailable.with_detail(
        f"the append to {item.stream_id!r} was not made: it was never sent, because an "
        "append sent before it on the same connection failed; retry shortly",
        str(cause),
    )


async def _append_in_stream_order(
    conn: Connection, batch: list[_Append]
) -> list[_AppendRow | Exception]:
    """`_append_many` with the items sorted by stream id, outcomes in the batch's order.

    Two batches in flight that touch the same streams (two processes, or lanes of one) wait
    for each other's rows on the version fence and the ledger. Taken in arrival order, those
    waits could cross (A holds s1 and waits for s2, B holds s2 and waits for s1): a deadlock,
    which PostgreSQL breaks only after `deadlock_timeout` and then fails the items as
    unavailable. Every batch taking its streams in one global order cannot cross. The sort
    is stable, so appends of one stream keep their order, as the batch path requires."""
    order = sorted(range(len(batch)), key=lambda i: batch[i].stream_id)
    sorted_outcomes = await _append_many(conn, [batch[i] for i in order])
    outcomes: list[_AppendRow | Exception] = [*sorted_outcomes]
    for position, index in enumerate(order):
        outcomes[index] = sorted_outcomes[position]
    return outcomes


def _set_arguments(batch: list[_Append]) -> tuple[list[Any], ...]:
    """The columns of `svc_append_set`. Data and metadata go as one JSON array each: the
    connection's jsonb codec serialises each list in one orjson call (eventstore/db.py)."""
    events = [e for item in batch for e in item.events]
    return (
        [item.workspace_id for item in batch],
        [item.command_id for item in batch],
        [item.stream_id for item in batch],
        [item.expected_parameter for item in batch],
        [len(item.events) for item in batch],
        [e.event_id for e in events],
        [e.type for e in events],
        [e.schema_version for e in events],
        [e.data for e in events],
        [e.metadata for e in events],
    )


def _item_failure(item: _Append, state: str, constraint: str | None) -> StoreError | None:
    """The store's error for an append that failed on its own; None when the failure is not
    about this append (the caller treats it as the database's)."""
    if state == _STATE_UNIQUE and constraint == "events_stream_version":
        return ConcurrencyConflict(item.stream_id, item.expected_version)
    if state == _STATE_UNIQUE and constraint == "events_event_id_key":
        return InvalidAppend("an event with one of these event ids is already recorded")
    if state == _STATE_CONFLICT:
        return ConcurrencyConflict(item.stream_id, item.expected_version)
    if state == _STATE_FOREIGN_STREAM:
        return InvalidAppend(f"stream {item.stream_id!r} belongs to another workspace")
    if state.startswith(_CLASS_DATA):
        return _unstorable_data()
    if state == _STATE_LOCK_TIMEOUT:
        return _blocked(item)
    return None


def _blocked(item: _Append) -> StoreUnavailable:
    """An append whose wait on a row another transaction holds uncommitted ran out
    (migration 0008): that transaction is writing the same command or the same stream version,
    and is slow to finish (a stalled process). Nothing of this append was written."""
    return StoreUnavailable(
        f"the append to {item.stream_id!r} was not made: it waited too long on another "
        "transaction, still open, that writes the same command or the same stream version; "
        "retry shortly with the same command id (it then acts once, or returns that other "
        "append's result if it was the same command)"
    )


def _unexpected_failure(item: _Append, state: str) -> StoreError:
    if is_unavailable_state(state):
        return StoreUnavailable(
            f"the append to {item.stream_id!r} was rolled back by the database "
            f"(SQLSTATE {state}); retry shortly"
        )
    return StoreError(f"the append to {item.stream_id!r} failed (SQLSTATE {state})")


class PostgresEventStore:
    """Append-only log in PostgreSQL; the single-writer fence and the idempotency ledger.

    `on_commit` runs right after each append commits (the commit notifier's wake-up);
    `subscriber` serves `subscribe` (the process's log tailer); `on_close` callbacks run on
    `close()`, in order, to stop what `open_store` started. At most `append_lanes` appends
    (or batches of them) are in flight at once, each holding a pooled connection.
    """

    def __init__(
        self,
        db: Database,
        *,
        append_lanes: int = 4,
        on_commit: Callable[[], None] = _noop,
        subscriber: LogSubscriber | None = None,
        on_close: Sequence[Callable[[], Awaitable[None]]] = (),
    ) -> None:
        self._db = db
        self._on_commit = on_commit
        self._subscriber = subscriber
        self._on_close = list(on_close)
        self._appends: Coalescer[_Append, _AppendRow] = Coalescer(
            self._send_appends, lanes=append_lanes, max_batch=_MAX_APPENDS_PER_BATCH
        )

    @property
    def db(self) -> Database:
        return self._db

    async def close(self, appends_wait_s: float | None = None) -> None:
        """Wait for the appends in flight (up to `appends_wait_s`, None: as long as they
        take), then stop what the store was opened with (the notifier, the pool, which
        closes within its own bound under an append still out). A close that is cancelled
        while it waits (a shutdown step out of time) still stops them."""
        try:
            try:
                async with asyncio.timeout(appends_wait_s):
                    await self._appends.wait_idle()
            except TimeoutError:
                log.warning(
                    "appends still in flight after %.0f s; closing the store under them",
                    appends_wait_s,
                )
        finally:
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

        Appends that arrive while others are in flight share a round trip and a commit
        (eventstore/coalescer.py); each still succeeds or fails on its own. A
        `StoreUnavailable` raised while committing leaves the outcome unknown; retrying with
        the same command id is safe: it either acts or returns the first result.
        """
        _validate_append(stream_id, events, expected_version, command_id, workspace_id)
        request = _Append(stream_id, events, expected_version, command_id, workspace_id)
        started = time.perf_counter()
        try:
            row = await self._submit(request)
        finally:
            APPEND_SECONDS.observe(time.perf_counter() - started)
        duplicate, *ledger_row = row
        return _append_result(ledger_row, duplicate=duplicate)

    async def _submit(self, request: _Append) -> _AppendRow:
        """One append through the coalescer. Without an expected version ("do not check") a
        collision on the fence only means another writer took the next version first: the
        append is sent again, reading the new head, up to `_ANY_VERSION_ATTEMPTS` times."""
        attempt = 1
        while True:
            try:
                return await self._appends.submit(request)
            except ConcurrencyConflict:
                if request.expected_version is not None or attempt >= _ANY_VERSION_ATTEMPTS:
                    raise
                attempt += 1

    async def _send_appends(self, batch: list[_Append]) -> list[_AppendRow | Exception]:
        async with self._db.acquire(stateless=True) as conn:
            outcomes: list[_AppendRow | Exception]
            if len(batch) == 1:  # a quiet store: svc_append is the shorter path for one
                outcomes = [await _append_one(conn, batch[0])]
            else:
                outcomes = await _append_in_stream_order(conn, batch)
        if any(not isinstance(outcome, Exception) and not outcome[0] for outcome in outcomes):
            self._on_commit()
        return outcomes

    async def processed(self, command_id: str, workspace_id: str) -> AppendResult | None:
        async with self._db.acquire(stateless=True) as conn:
            row = await conn.fetchrow(_PROCESSED, workspace_id, command_id)
        return None if row is None else _append_result(row, duplicate=True)

    async def read_stream(
        self,
        stream_id: str,
        from_version: int = 1,
        *,
        workspace_id: str | None = None,
        to_version: int | None = None,
    ) -> list[RecordedEvent]:
        # Stream versions are dense and each commits only after the previous one did (the
        # fence), so a plain read of committed rows has no gaps: no snapshot filter needed.
        # Versions are int4: a bound past the column's range is the same as no bound.
        first = min(max(from_version, 1), _MAX_VERSION)
        last = _MAX_VERSION if to_version is None else min(to_version, _MAX_VERSION)
        async with self._db.log_reading(workspace_id) as conn:
            if workspace_id is None:
                rows = await conn.fetch(_READ_STREAM, stream_id, first, last)
            else:
                rows = await conn.fetch(_READ_STREAM_WS, stream_id, first, last, workspace_id)
        return rows_to_events(rows)

    async def stream_sizes(
        self,
        stream_id: str,
        from_version: int,
        to_version: int,
        *,
        workspace_id: str | None = None,
    ) -> list[tuple[int, int]]:
        first = min(max(from_version, 1), _MAX_VERSION)
        last = min(to_version, _MAX_VERSION)
        async with self._db.log_reading(workspace_id) as conn:
            rows = await conn.fetch(_STREAM_SIZES, stream_id, first, last, workspace_id)
        return [(int(r[0]), int(r[1])) for r in rows]

    async def stream_version(self, stream_id: str, *, workspace_id: str | None = None) -> int:
        async with self._db.log_reading(workspace_id) as conn:
            version: int = await conn.fetchval(_STREAM_VERSION, stream_id, workspace_id)
        return version

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
        async with self._db.log_reading(workspace_id) as conn:
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

    async def head(self, workspace_id: str | None = None) -> str:
        async with self._db.log_reading(workspace_id) as conn:
            point = await log_head(conn, workspace_id)
        return "" if point == ORIGIN else encode_cursor(point)


def _append_result(ledger_row: Sequence[Any], *, duplicate: bool) -> AppendResult:
    """An append's result from its ledger columns: stream_id, first_version, last_version,
    last_tx, last_position."""
    stream_id, first_version, last_version, last_tx, last_position = ledger_row
    return AppendResult(
        stream_id=stream_id,
        first_version=first_version,
        last_version=last_version,
        cursor=encode_cursor(LogPoint(last_tx, last_position)),
        duplicate=duplicate,
    )


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
        past = newest + 1
        raise StoreError(
            f"the event store's newest transaction id ({newest}) is ahead of this database "
            f"cluster's transaction counter ({next_xid}), as after restoring a logical dump "
            "into a new cluster. New events would be invisible to log readers. Restore from a "
            "physical backup instead, or (an expert step, on a copy first; see "
            "docs/operations.md) advance the cluster's counter past it with the server "
            f"stopped: pg_resetwal --epoch={past >> 32} "
            f"--next-transaction-id={max(past & 0xFFFFFFFF, 3)}, then start again."
        )


if TYPE_CHECKING:
    # mypy proves the adapter satisfies the port.
    def _conforms(store: PostgresEventStore) -> EventStore:
        return store
