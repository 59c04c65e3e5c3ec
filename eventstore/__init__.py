"""SVC's event store: an append-only log in PostgreSQL read gap-free by transaction id.

`open_store(dsn)` is the one way in: it connects, applies migrations, checks the xid horizon
and wires the commit notifier and the log tailer to the store. `open_store_parts(dsn)` does the
same and also hands back the notifier and the tailer, for a composition root that wires other
parts (projections, feeds) to them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from eventstore.cursor import ORIGIN, LogPoint, decode_cursor, encode_cursor
from eventstore.db import Database, PoolStats, translate_errors
from eventstore.errors import (
    ConcurrencyConflict,
    InvalidAppend,
    InvalidCursor,
    StatementAborted,
    StoreError,
    StoreUnavailable,
)
from eventstore.metrics import OpenTxAgeSampler
from eventstore.migrate import STORE_MIGRATIONS, MigrationSource, apply_migrations
from eventstore.notify import CommitNotifier
from eventstore.port import ANY_VERSION, EventStore
from eventstore.records import AppendResult, NewEvent, RecordedEvent, Snapshot
from eventstore.store import PostgresEventStore, check_xid_horizon
from eventstore.tailer import LogTailer, SubscriberTooSlow

__all__ = [
    "ANY_VERSION",
    "ORIGIN",
    "STORE_MIGRATIONS",
    "AppendResult",
    "CommitNotifier",
    "ConcurrencyConflict",
    "Database",
    "EventStore",
    "InvalidAppend",
    "InvalidCursor",
    "LogPoint",
    "LogTailer",
    "MigrationSource",
    "NewEvent",
    "OpenedStore",
    "PoolStats",
    "PostgresEventStore",
    "RecordedEvent",
    "Snapshot",
    "StatementAborted",
    "StoreError",
    "StoreUnavailable",
    "SubscriberTooSlow",
    "apply_migrations",
    "check_xid_horizon",
    "decode_cursor",
    "encode_cursor",
    "open_store",
    "open_store_parts",
    "translate_errors",
]


@dataclass(frozen=True, slots=True)
class OpenedStore:
    """A store with the parts started for it. `await store.close()` stops them all.
    `applied` names the migrations this opening applied (`namespace/NNNN_name`), in order."""

    store: PostgresEventStore
    notifier: CommitNotifier
    tailer: LogTailer
    applied: tuple[str, ...] = ()


async def open_store(dsn: str, **options: Any) -> PostgresEventStore:
    """The store alone; `options` as `open_store_parts`."""
    return (await open_store_parts(dsn, **options)).store


async def open_store_parts(
    dsn: str,
    *,
    migrations: Sequence[MigrationSource] = (),
    min_size: int = 1,
    max_size: int = 20,
    statement_timeout_ms: int = 30000,
    idle_in_tx_timeout_ms: int = 10000,
    connect_timeout_s: float = 5.0,
    poll_interval_s: float = 0.075,
    notify_channel: str = "svc_events",
    sample_open_tx_every_s: float = 5.0,
) -> OpenedStore:
    """Connect, migrate (the store's own migrations, then `migrations` in order), refuse a
    store restored from a logical dump, and start the commit notifier, the log tailer and the
    open-transaction sampler. `await store.close()` waits for appends in flight, stops them
    all in reverse order and closes the pool."""
    db = await Database.connect(
        dsn,
        min_size=min_size,
        max_size=max_size,
        statement_timeout_ms=statement_timeout_ms,
        idle_in_tx_timeout_ms=idle_in_tx_timeout_ms,
        connect_timeout_s=connect_timeout_s,
    )
    stops: list[Callable[[], Awaitable[None]]] = [db.close]
    try:
        applied = await apply_migrations(db, [STORE_MIGRATIONS, *migrations])
        await check_xid_horizon(db)
        notifier = CommitNotifier(db, channel=notify_channel)
        tailer = LogTailer(db, notifier, poll_interval_s=poll_interval_s)
        sampler = OpenTxAgeSampler(db, interval_s=sample_open_tx_every_s)
        await notifier.start()
        stops.insert(0, notifier.stop)
        await tailer.start()
        stops.insert(0, tailer.stop)
        sampler.start()
        stops.insert(0, sampler.stop)
    except BaseException:
        for stop in stops:
            await stop()
        raise
    store = PostgresEventStore(db, on_commit=notifier.committed, subscriber=tailer, on_close=stops)
    return OpenedStore(store, notifier, tailer, tuple(applied))
