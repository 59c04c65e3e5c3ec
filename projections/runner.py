"""Runs projectors over the global log: checkpointed, exactly-once, crash-safe.

Each projector has one row in `projection_checkpoints`: the last log point it has consumed.
A batch is one transaction that

1. reads the checkpoint,
2. reads the next events after it in the gap-free order (eventstore/reads.py),
3. moves the checkpoint with a compare-and-set on the value read in 1,
4. applies the events to the projector's tables,

and commits all of it at once (ARCHITECTURE.md decision 4). Because the read-model rows and
the checkpoint commit or vanish together, a process killed at any instant leaves the read model
exactly as of some committed checkpoint: after a restart each event has had exactly one effect.
Handlers therefore need not be idempotent (a message counter is a plain `+ 1`).

The compare-and-set makes several runners (processes, or a rebuild next to a running service)
safe without a lease: a runner whose checkpoint was moved by another one since it read it
updates zero rows, rolls its batch back and reloads. Moving the checkpoint *before* applying
takes the checkpoint row lock first, so a second runner waits on that row instead of
interleaving its writes with ours, and a rebuild (which also locks the row before truncating)
never deadlocks with a batch.

A batch is a writing transaction, and every writing transaction holds back gap-free readers of
the log until it ends; `batch_size` bounds how long that is. Within a batch, runs of the same
statement are pipelined (`_Pipeline`), so a batch costs a few round trips, not one per event.

An event a projector cannot apply (its handler raises for a reason other than the database
being unavailable) is a poison event: the runner commits the events before it, logs the
event's position and stops that projector with a failure in `status()`. It never skips an
event silently. `retry(name)` (after a fix) or `rebuild(name)` starts it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from eventstore.cursor import ORIGIN, LogPoint, decode_cursor, encode_cursor
from eventstore.db import Connection, Database
from eventstore.errors import StoreError, StoreUnavailable
from eventstore.reads import log_head, read_log
from eventstore.records import RecordedEvent
from projections import metrics
from projections.projector import Projector
from schemas.errors import InvalidInput, Unavailable

log = logging.getLogger(__name__)

Progress = Callable[[int, int], None]
"""`progress(done, total)`: events replayed so far and the size of the log to replay."""

_MAX_BACKOFF_S = 5.0
_MAX_ERROR_CHARS = 500

_LOAD = "SELECT tx, position FROM projection_checkpoints WHERE name = $1"
_ENSURE = "INSERT INTO projection_checkpoints (name) VALUES ($1) ON CONFLICT (name) DO NOTHING"
_MOVE = """
UPDATE projection_checkpoints SET tx = $4::xid8, position = $5, updated_at = now()
WHERE name = $1 AND tx = $2::xid8 AND position = $3
"""
_RESET = """
UPDATE projection_checkpoints SET tx = '0', position = 0, updated_at = now() WHERE name = $1
"""
_VISIBLE = "tx < pg_snapshot_xmin(pg_current_snapshot())"
_LAG = f"""
SELECT count(*),
       coalesce(greatest(extract(epoch FROM clock_timestamp() - min(recorded_at)), 0), 0)::float8
FROM events WHERE (tx, position) > ($1::xid8, $2::int8) AND {_VISIBLE}
"""


class CommitSignal(Protocol):
    """Where commit wake-ups come from: `eventstore.notify.CommitNotifier` in the service."""

    def add_listener(self, cb: Callable[[], None]) -> None: ...

    def remove_listener(self, cb: Callable[[], None]) -> None: ...


class ProjectionFailed(Unavailable):
    """A projection is stopped on an event it cannot apply; its read model is stale."""

    default_code = "projection_failed"


@dataclass(frozen=True, slots=True)
class PoisonEvent:
    """The event a projector stopped on, and why."""

    projection: str
    cursor: str
    tx: int
    position: int
    event_type: str
    stream_id: str
    error: str


@dataclass(frozen=True, slots=True)
class ProjectionStatus:
    name: str
    cursor: str
    """Checkpoint as an opaque cursor; "" before the first event."""
    lag_events: int
    """Committed events after the checkpoint."""
    lag_seconds: float
    """Age of the oldest committed event after the checkpoint; 0 when caught up."""
    running: bool
    failure: PoisonEvent | None


class _CheckpointMoved(Exception):
    """Another runner moved the checkpoint since this batch read it."""


@dataclass(eq=False)
class _Slot:
    projector: Projector
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    point: LogPoint = ORIGIN
    """The checkpoint as this process last read or wrote it."""
    failure: PoisonEvent | None = None
    task: asyncio.Task[None] | None = None


class _Pipeline:
    """Stands in for the connection while a batch is applied: consecutive executions of the
    same statement (a run of message events, say) reach the server as one `executemany`, one
    round trip instead of one per event. Statements still run in the order they were issued;
    a read flushes what is pending first."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._sql: str | None = None
        self._pending: list[tuple[Any, ...]] = []

    async def execute(self, sql: str, *args: Any) -> None:
        if sql != self._sql:
            await self.flush()
            self._sql = sql
        self._pending.append(args)

    async def flush(self) -> None:
        if self._sql is not None and self._pending:
            await self._conn.executemany(self._sql, self._pending)
        self._sql, self._pending = None, []

    async def fetch(self, sql: str, *args: Any) -> Any:
        await self.flush()
        return await self._conn.fetch(sql, *args)

    async def fetchrow(self, sql: str, *args: Any) -> Any:
        await self.flush()
        return await self._conn.fetchrow(sql, *args)

    async def fetchval(self, sql: str, *args: Any) -> Any:
        await self.flush()
        return await self._conn.fetchval(sql, *args)


def _cursor(point: LogPoint) -> str:
    return "" if point == ORIGIN else encode_cursor(point)


class ProjectionRunner:
    def __init__(
        self,
        db: Database,
        projectors: Sequence[Projector],
        *,
        notifier: CommitSignal | None = None,
        poll_interval_s: float = 0.075,
        batch_size: int = 500,
        metrics_interval_s: float = 5.0,
    ) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        self._db = db
        self._slots: dict[str, _Slot] = {}
        for projector in projectors:
            if projector.name in self._slots:
                raise ValueError(f"two projectors are named {projector.name!r}")
            self._slots[projector.name] = _Slot(projector)
        self._notifier = notifier
        self._poll_interval_s = poll_interval_s
        self._batch_size = batch_size
        self._metrics_interval_s = metrics_interval_s
        self._progress = asyncio.Condition()
        self._metrics_task: asyncio.Task[None] | None = None
        self._running = False

    @property
    def names(self) -> list[str]:
        return list(self._slots)

    @property
    def running(self) -> bool:
        return self._running

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        if self._running:
            return
        self._running = True
        for name, slot in self._slots.items():
            slot.task = asyncio.create_task(self._run(slot), name=f"svc-projection-{name}")
        self._metrics_task = asyncio.create_task(self._sample_metrics(), name="svc-proj-metrics")
        if self._notifier is not None:
            self._notifier.add_listener(self.wake)

    async def stop(self) -> None:
        if not self._running:
            return
        self._running = False
        if self._notifier is not None:
            self._notifier.remove_listener(self.wake)
        tasks = [slot.task for slot in self._slots.values() if slot.task is not None]
        if self._metrics_task is not None:
            tasks.append(self._metrics_task)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for slot in self._slots.values():
            slot.task = None
        self._metrics_task = None

    def wake(self) -> None:
        """Commit listener: something was appended, look at the log now."""
        for slot in self._slots.values():
            slot.wake.set()

    async def _run(self, slot: _Slot) -> None:
        name = slot.projector.name
        first_delay = min(self._poll_interval_s, _MAX_BACKOFF_S)
        delay = first_delay
        while True:
            slot.wake.clear()
            try:
                async with slot.lock:
                    consumed = await self._advance(slot)
            except StoreError as exc:
                log.warning("projection %s: %s (retrying in %.2fs)", name, exc.message, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, _MAX_BACKOFF_S)
                continue
            except Exception:
                log.exception("projection %s: batch failed (retrying in %.2fs)", name, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, _MAX_BACKOFF_S)
                continue
            delay = first_delay
            await self._notify_progress()
            if consumed is None or consumed >= self._batch_size:
                continue
            # The fallback poll covers commits whose wake-up never came (another process
            # without a working NOTIFY, or a notifier that is not wired in).
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(slot.wake.wait(), self._poll_interval_s)

    async def _sample_metrics(self) -> None:
        while True:
            try:
                await self.status()
            except StoreError as exc:
                log.warning("could not sample projection lag: %s", exc.message)
            await asyncio.sleep(self._metrics_interval_s)

    async def _notify_progress(self) -> None:
        async with self._progress:
            self._progress.notify_all()

    # -- one batch ----------------------------------------------------------------------------

    async def _advance(
        self, slot: _Slot, limit: int | None = None, *, exact: bool = False
    ) -> int | None:
        """Apply the next batch of `slot` (caller holds `slot.lock`).

        Returns how many events were consumed (0: caught up, or stopped on a poison event),
        or None when another runner moved the checkpoint first (nothing done; try again).
        Normally the handlers' statements are pipelined (`_Pipeline`); when the batch fails,
        it is retried `exact`ly, one round trip per statement, to find the event at fault.
        """
        if slot.failure is not None:
            return 0
        projector = slot.projector
        events: list[RecordedEvent] = []
        applying: RecordedEvent | None = None
        in_apply = False
        new = ORIGIN
        try:
            async with self._db.transaction() as conn:
                old = await self._load(conn, projector.name)
                events = await read_log(conn, old, limit or self._batch_size)
                if not events:
                    slot.point = old
                    return 0
                new = events[-1].point
                status = await conn.execute(
                    _MOVE, projector.name, old.tx, old.position, new.tx, new.position
                )
                if status != "UPDATE 1":
                    raise _CheckpointMoved
                in_apply = True
                target = conn if exact else _Pipeline(conn)
                for event in events:
                    if projector.handles(event.type):
                        applying = event
                        await projector.apply(target, event)
                if isinstance(target, _Pipeline):
                    await target.flush()
                in_apply = False
        except _CheckpointMoved:
            log.info("projection %s: checkpoint moved by another runner, reloading", projector.name)
            return None
        except StoreUnavailable:
            raise
        except Exception as exc:
            if not in_apply:
                raise
            if not exact:
                return await self._advance(slot, limit, exact=True)
            if applying is None:
                raise
            return await self._stop_at(slot, events, applying, exc)
        slot.point = new
        return len(events)

    async def _load(self, conn: Connection, name: str) -> LogPoint:
        row = await conn.fetchrow(_LOAD, name)
        if row is None:
            await conn.execute(_ENSURE, name)
            row = await conn.fetchrow(_LOAD, name)
        return LogPoint(row[0], row[1])

    async def _stop_at(
        self, slot: _Slot, events: list[RecordedEvent], poison: RecordedEvent, exc: Exception
    ) -> int:
        """Commit the events before `poison`, then stop the projector on it."""
        index = events.index(poison)
        consumed = 0
        if index > 0:
            consumed = await self._advance(slot, limit=index) or 0
        if slot.failure is not None:
            return consumed
        message = exc.message if isinstance(exc, StoreError) else f"{type(exc).__name__}: {exc}"
        slot.failure = PoisonEvent(
            projection=slot.projector.name,
            cursor=poison.cursor,
            tx=poison.tx,
            position=poison.position,
            event_type=poison.type,
            stream_id=poison.stream_id,
            error=message[:_MAX_ERROR_CHARS],
        )
        log.error(
            "projection %s stopped: cannot apply event at position %d (tx %d, cursor %s, "
            "type %s, stream %s); it will not advance until fixed (retry or rebuild)",
            slot.projector.name,
            poison.position,
            poison.tx,
            poison.cursor,
            poison.type,
            poison.stream_id,
            exc_info=exc,
        )
        metrics.STALLED.labels(projection=slot.projector.name).set(1)
        return consumed

    # -- callers ------------------------------------------------------------------------------

    def _select(self, names: Collection[str] | None) -> list[_Slot]:
        if names is None:
            return list(self._slots.values())
        unknown = sorted(set(names) - set(self._slots))
        if unknown:
            raise InvalidInput(f"unknown projection(s) {unknown}; known: {sorted(self._slots)}")
        return [self._slots[name] for name in names]

    async def _head(self) -> LogPoint:
        async with self._db.acquire() as conn:
            point: LogPoint = await log_head(conn)
        return point

    async def catch_up(
        self, until: str | None = None, *, names: Collection[str] | None = None
    ) -> None:
        """Apply the log up to `until` (a cursor; default: the log's head now) in this task.

        Raises `ProjectionFailed` if a projector stops on a poison event first. A cursor that
        is not yet visible (an older transaction still open) is waited for by polling; bound
        the wait with `asyncio.timeout` or use `wait_for`.
        """
        target = decode_cursor(until) if until else await self._head()
        # Projectors are independent (own tables, own checkpoint): they catch up side by side.
        results = await asyncio.gather(
            *(self._catch_up_one(slot, target) for slot in self._select(names)),
            return_exceptions=True,
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def _catch_up_one(self, slot: _Slot, target: LogPoint) -> None:
        # At least one batch: it reloads the checkpoint, which another process's rebuild may
        # have moved back since this process last saw it.
        consumed: int | None = None
        while consumed is None or slot.point < target:
            async with slot.lock:
                consumed = await self._advance(slot)
            await self._notify_progress()
            if slot.failure is not None:
                raise ProjectionFailed(
                    f"projection {slot.projector.name} is stopped at "
                    f"{slot.failure.cursor}: {slot.failure.error}"
                )
            if consumed == 0 and slot.point < target:
                await asyncio.sleep(self._poll_interval_s)

    # `timeout` is part of the gateway's read-your-writes contract (a bool, not an exception).
    async def wait_for(
        self,
        cursor: str,
        timeout: float,
        *,
        names: Collection[str] | None = None,
    ) -> bool:
        """Wait until the read models have applied `cursor` (read-your-writes).

        True once every selected projector's checkpoint is at or past it; False on timeout or
        when one of them is stopped on a poison event (see `status()`). When the runner is not
        started, the caller's task does the catching up itself.
        """
        target = decode_cursor(cursor)
        slots = self._select(names)
        if not self._running:
            try:
                await asyncio.wait_for(self.catch_up(cursor, names=names), timeout)
            except (TimeoutError, ProjectionFailed):
                return False
            return True

        def settled() -> bool:
            return all(s.point >= target or s.failure is not None for s in slots)

        for slot in slots:
            slot.wake.set()
        try:
            async with self._progress:
                await asyncio.wait_for(self._progress.wait_for(settled), timeout)
        except TimeoutError:
            return False
        return all(s.point >= target for s in slots)

    def retry(self, name: str) -> None:
        """Clear a projector's poison-event stop so it tries that event again."""
        (slot,) = self._select([name])
        slot.failure = None
        metrics.STALLED.labels(projection=name).set(0)
        slot.wake.set()

    async def rebuild(self, name: str, progress: Progress | None = None) -> int:
        """Empty the projector's tables, move its checkpoint to the start of the log and replay
        the whole log. Returns the number of events replayed.

        The reset is one transaction (checkpoint row locked first, then the tables truncated),
        so readers see the old read model or an empty one, never a half-reset one; the replay
        then runs batch by batch, like normal operation, so it never holds back log readers
        for long. Raises `ProjectionFailed` when the replay stops on a poison event.
        """
        (slot,) = self._select([name])
        async with slot.lock:
            async with self._db.transaction() as conn:
                await conn.execute(_ENSURE, name)
                await conn.execute(_RESET, name)
                await slot.projector.reset(conn)
            slot.point = ORIGIN
            slot.failure = None
            metrics.STALLED.labels(projection=name).set(0)
            done = 0
            total = (await self._lag(ORIGIN))[0]
            if progress is not None:
                progress(done, total)
            while True:
                consumed = await self._advance(slot)
                if slot.failure is not None:
                    raise ProjectionFailed(
                        f"rebuild of {name} stopped at {slot.failure.cursor}: {slot.failure.error}"
                    )
                if consumed is None:
                    continue
                if consumed == 0:
                    break
                done += consumed
                total = max(total, done)
                if progress is not None:
                    progress(done, total)
        await self._notify_progress()
        log.info("projection %s rebuilt from %d events", name, done)
        return done

    # -- status -------------------------------------------------------------------------------

    async def _lag(self, point: LogPoint) -> tuple[int, float]:
        async with self._db.acquire() as conn:
            row = await conn.fetchrow(_LAG, point.tx, point.position)
        return int(row[0]), float(row[1])

    async def status(self) -> list[ProjectionStatus]:
        """Checkpoint and lag of every projector; also refreshes the lag gauges."""
        out: list[ProjectionStatus] = []
        for name, slot in self._slots.items():
            async with self._db.acquire() as conn:
                row = await conn.fetchrow(_LOAD, name)
                point = ORIGIN if row is None else LogPoint(row[0], row[1])
                lag = await conn.fetchrow(_LAG, point.tx, point.position)
            lag_events, lag_seconds = int(lag[0]), float(lag[1])
            if lag_events == 0:
                lag_seconds = 0.0
            metrics.record_lag(name, lag_events, lag_seconds, slot.failure is not None)
            out.append(
                ProjectionStatus(
                    name=name,
                    cursor=_cursor(point),
                    lag_events=lag_events,
                    lag_seconds=lag_seconds,
                    running=self._running and slot.task is not None and not slot.task.done(),
                    failure=slot.failure,
                )
            )
        return out
