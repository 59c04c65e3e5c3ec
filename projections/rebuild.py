"""A rebuild made beside the live read model and switched in by one transaction at the end.

The projector replays the log into copies of its tables: temporary tables of one database
session, created `LIKE` the live ones. PostgreSQL resolves an unqualified table name in
`pg_temp` first, so in that session the projector's own statements write to the copies
unchanged. Meanwhile the live read model is read as usual and kept current by the running
service's runner. At the end one transaction locks the projector's checkpoint row (the live
runner's batches of this projector wait on it), applies what was committed since the last
pass, replaces the live tables' rows with the copies' and moves the checkpoint to the point
the copies reached. Readers see the old read model until that commit and the rebuilt one
after it, never one half replayed (an API key's model replayed in place accepted a revoked
key between the replay of its issue and of its revocation).

The switch deletes the live rows and copies the rebuilt ones in one transaction. Readers of
the tables go on reading the old rows meanwhile (plain MVCC: no lock they would wait on),
but the log's gap-free readers (feeds, the other projections) wait on its transaction id
for as long as the copy takes. A rebuild that fails (a poison event, the database going
away) leaves the live model as it was; its copies end with their session, a connection of
its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from eventstore.cursor import ORIGIN, LogPoint
from eventstore.db import Connection, Database, translate_errors
from eventstore.errors import StoreError
from eventstore.reads import log_head, read_log_cut
from eventstore.records import RecordedEvent
from projections.errors import ProjectionFailed, database_down, failure_reason
from projections.pipeline import Pipeline
from projections.projector import Projector
from schemas.events import EVENTS

log = logging.getLogger(__name__)

Progress = Callable[[int, int, str], None]
"""`progress(done, total, phase)`: events replayed so far, how many there are to replay (done
plus those left, counted again every `RECOUNT_EVERY_S` while the log grows), and the phase:
`checking` (0 of 0: one pass over the log for event types this version does not know),
`replaying`, then `switching` (the last events and the copies' rows into the live tables,
one transaction as long as the tables are large), then `done`."""

RECOUNT_EVERY_S = 2.0

LONG_STATEMENT_S = 3600.0
"""How long the client waits for the answer to one of the rebuild's whole-log or
whole-table statements (the scan for unknown types, the count, a read of the log for its
types, the copy into the live tables), which the server runs without a statement timeout.
Every other statement of the rebuild waits no longer than the pool's do: a database cut off
without a reset (a frozen host, a failover that dropped the address) while the rebuild
writes ends it with an error, not a progress bar stopped for ever."""

# The live table a name means for the service: the first schema of the search path holding
# it. `pg_temp` is not among `current_schemas(false)`, so a copy never answers for it.
_LIVE_SCHEMA = """
SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE c.relname = $1 AND c.relkind IN ('r', 'p') AND n.nspname = ANY(current_schemas(false))
ORDER BY array_position(current_schemas(false), n.nspname)
LIMIT 1
"""
# Events of the projector's types in ((tx0, pos0), (tx1, pos1)]: the whole log up to its
# visible head once, then only what committed since the last count (the log grows at its
# head), so the total stays exact without scanning the log again every RECOUNT_EVERY_S.
_COUNT_BETWEEN = """
SELECT count(*) FROM events
WHERE type = ANY($1::text[]) AND (tx, position) > ($2::xid8, $3::int8)
  AND (tx, position) <= ($4::xid8, $5::int8)
"""
_LOCK = "SELECT tx, position FROM projection_checkpoints WHERE name = $1 FOR UPDATE"
_MOVE = """
UPDATE projection_checkpoints SET tx = $2::xid8, position = $3, updated_at = now(), failure = NULL
WHERE name = $1
"""


def _ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


_UNKNOWN_TYPE = """
SELECT type FROM events
WHERE split_part(type, '.', 1) = ANY($1::text[]) AND type <> ALL($2::text[])
LIMIT 1
"""


async def _refuse_unknown_types(conn: Connection, projector: Projector) -> None:
    """A rebuild replays its projector's types: one of its namespaces that this process
    does not know (a newer version wrote it, and it may be the projector's) would be left out
    of the copies for good. Looked for once, before the replay (one pass over the log, as
    the replay is; a newer version writing meanwhile is a mixed deployment, which
    docs/operations.md rules out)."""
    found = await conn.fetchval(
        _UNKNOWN_TYPE,
        sorted(projector.namespaces),
        EVENTS.known_types(),
        timeout=LONG_STATEMENT_S,
    )
    if found is not None:
        raise ProjectionFailed(
            f"the log holds events of type {found!r}, which this version of SVC does not "
            f"know (a newer version wrote them) and which {projector.name} may read: run the "
            "rebuild with the newest version; nothing was changed"
        )


@dataclass
class _Replay:
    """The copies' progress through the log: the events of the projector's types only."""

    projector: Projector
    batch_size: int
    batch_bytes: int
    point: LogPoint = ORIGIN
    done: int = 0

    async def batch(self, conn: Connection) -> bool:
        """Apply the next batch to the copies; False once caught up with the visible log."""
        types = sorted(self.projector.event_types)
        # The events of rare types (API keys, identity) may lie far apart: the read after
        # the last of them scans the rest of the log, as the count does.
        events, more = await read_log_cut(
            conn, self.point, self.batch_size, self.batch_bytes, types, timeout=LONG_STATEMENT_S
        )
        if events:
            await self._apply(conn, events)
            self.point = events[-1].point
            self.done += len(events)
        return more

    async def _apply(self, conn: Connection, events: list[RecordedEvent]) -> None:
        """In one transaction (a savepoint inside the switch's), pipelined."""
        try:
            with translate_errors():
                async with conn.transaction():
                    pipeline = Pipeline(conn)
                    for event in events:
                        await self.projector.apply(pipeline, event)
                    await pipeline.flush()
        except Exception as exc:
            # A statement the database gave up on (a lock timeout, a deadlock) is named like
            # any other failure of a handler; only the database going away is not an event's.
            if database_down(exc):
                raise
            await self._apply_exactly(conn, events)

    async def _apply_exactly(self, conn: Connection, events: list[RecordedEvent]) -> None:
        """One statement at a time, to name the event at fault."""
        async with conn.transaction():
            for event in events:
                try:
                    with translate_errors():
                        await self.projector.apply(conn, event)
                except Exception as exc:
                    if database_down(exc):
                        raise
                    raise self._failed(event, exc) from exc

    def _failed(self, event: RecordedEvent, exc: Exception) -> ProjectionFailed:
        return ProjectionFailed(
            f"rebuild of {self.projector.name} stopped at the event at cursor {event.cursor} "
            f"(type {event.type}, stream {event.stream_id}): {failure_reason(exc)}; the "
            "live read model is unchanged: fix the cause and run the rebuild again"
        )


async def rebuild_beside(
    db: Database,
    projector: Projector,
    *,
    batch_size: int,
    batch_bytes: int,
    switching: contextlib.AbstractAsyncContextManager[object],
    progress: Progress | None = None,
) -> tuple[LogPoint, int]:
    """Rebuild `projector`'s read model from the whole log and switch it in (module
    docstring); `switching` is held around the switch. Returns the checkpoint the live model
    has then and how many events of the projector's types were replayed."""
    replay = _Replay(projector, batch_size, batch_bytes)
    # A session of its own, closed at the end: its temporary tables never reach a pooled
    # connection, and no statement it runs was prepared while `pg_temp` held no copy (a
    # plan cached then would go on writing to the live table of the same name).
    conn = await db.connect_dedicated()
    try:
        # Every statement below, driver errors included, leaves as the store's own errors.
        with translate_errors():
            # An operator's job, watched by its progress: the pool's statement timeout, meant
            # for requests, would end the first count or the switch of a large log.
            await conn.execute("SET statement_timeout = 0")
            _report(progress, 0, 0, "checking")
            await _refuse_unknown_types(conn, projector)
            live = await _make_copies(conn, projector.tables)
            types = sorted(projector.event_types)
            counted, total = ORIGIN, 0
            loop = asyncio.get_running_loop()
            recount_at = loop.time()
            while True:
                if loop.time() >= recount_at:  # the log may have grown meanwhile
                    head = await log_head(conn)
                    between = await conn.fetchval(
                        _COUNT_BETWEEN, types, *counted, *head, timeout=LONG_STATEMENT_S
                    )
                    total += int(between)
                    counted, recount_at = head, loop.time() + RECOUNT_EVERY_S
                _report(progress, replay.done, max(total, replay.done), "replaying")
                if not await replay.batch(conn):
                    break
            _report(progress, replay.done, max(total, replay.done), "switching")
            async with switching:
                point = await _switch(conn, replay, live)
            _report(progress, replay.done, replay.done, "done")
    except BaseException:
        conn.terminate()
        raise
    try:
        await conn.close(timeout=5.0)  # the copies end with the session
    except Exception:
        conn.terminate()  # the switch has committed: this only ends the session sooner
    return point, replay.done


async def _make_copies(conn: Connection, tables: tuple[str, ...]) -> list[str]:
    """A temporary copy of each table, empty; returns the live tables' qualified names."""
    live: list[str] = []
    for table in tables:
        schema = await conn.fetchval(_LIVE_SCHEMA, table)
        if schema is None:
            raise StoreError(
                f"read-model table {table} does not exist; start the service once (it runs "
                "the migrations) before rebuilding"
            )
        qualified = f"{_ident(schema)}.{_ident(table)}"
        await conn.execute(f"CREATE TEMP TABLE {_ident(table)} (LIKE {qualified} INCLUDING ALL)")
        live.append(qualified)
    return live


async def _switch(conn: Connection, replay: _Replay, live: list[str]) -> LogPoint:
    """One transaction: the last events into the copies, the copies' rows into the live
    tables, the checkpoint to where the copies are."""
    name = replay.projector.name
    started = time.monotonic()
    async with conn.transaction():
        # The copy is as long as the tables are large: no statement timeout on it.
        await conn.execute("SET LOCAL statement_timeout = 0")
        current = await conn.fetchrow(_LOCK, name)
        head = await log_head(conn)
        while await replay.batch(conn):
            pass
        # Every event up to `head` was visible to the passes since: none of the projector's
        # types is left before the later of the two points.
        point = max(replay.point, head)
        if current is not None and LogPoint(current[0], current[1]) > point:
            raise StoreError(
                f"rebuild of {name}: the live checkpoint is ahead of the log's visible head; "
                "run the rebuild again"
            )
        rows = await _replace_rows(conn, replay.projector.tables, live)
        await conn.execute(_MOVE, name, point.tx, point.position)
    log.info(
        "projection %s: rebuilt model switched in, %d rows in %.2f s",
        name,
        rows,
        time.monotonic() - started,
    )
    return point


async def _replace_rows(conn: Connection, tables: tuple[str, ...], live: list[str]) -> int:
    """Each live table's rows replaced by its copy's; returns how many rows were copied.
    DELETE, not TRUNCATE: a reader whose snapshot predates the switch's commit (a REPEATABLE
    READ admin read) must go on seeing the old rows; after a TRUNCATE it would find none."""
    rows = 0
    for table, qualified in zip(tables, live, strict=True):
        await conn.execute(f"DELETE FROM {qualified}", timeout=LONG_STATEMENT_S)
        status = await conn.execute(
            f"INSERT INTO {qualified} SELECT * FROM pg_temp.{_ident(table)}",
            timeout=LONG_STATEMENT_S,
        )
        rows += int(status.rsplit(" ", 1)[1])
    return rows


def _report(progress: Progress | None, done: int, total: int, phase: str) -> None:
    if progress is not None:
        progress(done, total, phase)
