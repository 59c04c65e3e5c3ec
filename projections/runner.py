"""Runs projectors over the global log: checkpointed, exactly-once, crash-safe.

Each projector has one row in `projection_checkpoints`: the last log point it has consumed.
Projectors whose checkpoints are at the same point form a group, and a batch advances a whole
group in one transaction that

1. reads the next events after the group's point in the gap-free order (eventstore/reads.py;
   this read may run before the transaction: the log after a visible point never changes),
2. moves every member's checkpoint with one compare-and-set on that point, locking their
   rows in name order,
3. applies the events to each member's tables,

and commits all of it at once (ARCHITECTURE.md decision 4). Because the read-model rows and
the checkpoints commit or vanish together, a process killed at any instant leaves every read
model exactly as of some committed checkpoint: after a restart each event has had exactly one
effect. Handlers therefore need not be idempotent (a message counter is a plain `+ 1`).

Normally every projector is at the same point, so one batch costs a handful of round trips and
one durable commit for all the read models together, not one transaction per projector. A
projector that is behind (rebuilt, added, or stopped and retried) is its own group; its reads
are capped at the next group's point, so once it has caught up the two merge.

The compare-and-set makes several runners (processes, or a rebuild's switch next to a running
service) safe without a lease: a runner whose checkpoints were moved by another one since it
last read them updates fewer rows than it expects, rolls its batch back and reloads. Moving the
checkpoints *before* applying takes the checkpoint row locks first (always in name order, so
two runners never deadlock on them), so a second runner waits on those rows instead of
interleaving its writes with ours, and a rebuild's switch (which also locks its row before it
replaces the tables' rows; projections/rebuild.py) never deadlocks with a batch.

A batch is a writing transaction, and every writing transaction holds back gap-free readers of
the log until it ends; `batch_size` and `BATCH_BYTES` bound how long that is. Within a batch,
runs of the same statement are pipelined (`Pipeline`); each projector applies the whole batch
in turn, so its runs are long and a batch costs a few round trips, not one per event.

An event a projector cannot apply (its handler raises for a reason other than the database
being unavailable) is a poison event: the group's batch is rolled back and retried projector by
projector; the failing one commits the events before the poison event, logs its position and
stops with a failure in `status()`, recorded on its checkpoint row for every process to see.
It never skips an event silently. `retry(name)` (after a fix) or `rebuild(name)` starts it
again; so does a rebuild in another process, which clears the recorded stop.

A handler's statement the database gave up on (`StatementAborted`: a statement or lock
timeout, a deadlock, a serialization failure) is the handler's, not the database's: the
session that ran it is sound. It is isolated like a poison event (the others go on), but
retried after a backoff, since contention passes; the `_MAX_ABORTS`th failure in a row on the
same event stops the projector as a poison event. Only the database itself being unavailable
(the connection lost, the server down or refusing connections), or an abort outside the
handlers (the checkpoints' compare-and-set waiting on a rebuild's switch), fails the whole
step, which the background loop retries with a backoff and records nowhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Collection, Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Protocol

from eventstore.cursor import ORIGIN, LogPoint, decode_cursor, encode_cursor
from eventstore.db import Database
from eventstore.errors import StatementAborted, StoreError, StoreUnavailable
from eventstore.outage_log import OutageLog
from eventstore.reads import log_head, read_log_cut
from eventstore.records import RecordedEvent
from eventstore.tasks import cancel_and_wait, wait_set
from projections import metrics
from projections.errors import ProjectionFailed, aborted_reason, database_down, failure_reason
from projections.pipeline import Pipeline
from projections.projector import Projector
from projections.rebuild import Progress, rebuild_beside
from schemas.errors import InvalidInput
from schemas.events import EventFromNewerVersion

log = logging.getLogger(__name__)


BATCH_BYTES = 8 * 1024 * 1024
"""A batch also ends at this many bytes of stored event data (compressed, as PostgreSQL
keeps it; the first event always taken): what a batch holds in memory and writes in one
transaction, which every gap-free reader of the log waits on, stays bounded when events are
large (500 one-megabyte messages were half a gigabyte at once). Text that compresses well
takes more than this once decoded (docs/projections.md)."""
_MAX_BACKOFF_S = 5.0
_MAX_ABORTS = 5  # a handler's statement aborted this many times in a row on one event: poison
_FIRST_ABORT_BACKOFF_S = 0.1  # then doubling, up to _MAX_BACKOFF_S
_RESUME_CHECK_S = 1.0  # how often a stopped projector looks whether its stop was cleared

_READ = """
SELECT name, tx, position, failure FROM projection_checkpoints WHERE name = ANY($1::text[])
"""
# Creates the missing checkpoint rows and reads them all in one round trip (rows a statement
# inserts are not visible to its own SELECT, hence the union).
_LOAD = """
WITH created AS (
    INSERT INTO projection_checkpoints (name) SELECT unnest($1::text[])
    ON CONFLICT (name) DO NOTHING
    RETURNING name, tx, position
)
SELECT name, tx, position FROM created
UNION ALL
SELECT name, tx, position FROM projection_checkpoints WHERE name = ANY($1::text[])
"""
_ENSURE = "INSERT INTO projection_checkpoints (name) VALUES ($1) ON CONFLICT (name) DO NOTHING"
# The compare-and-set of a group: lock its rows in name order first (two runners locking
# overlapping groups in different orders could deadlock), then move those still at the old
# point. A row moved by another runner meanwhile fails the recheck after the lock and is not
# counted, so the status says "UPDATE n" with n the group's size only if none was.
_MOVE = """
WITH locked AS MATERIALIZED (
    SELECT name FROM projection_checkpoints WHERE name = ANY($1::text[])
    ORDER BY name FOR UPDATE
)
UPDATE projection_checkpoints c
SET tx = $4::xid8, position = $5, updated_at = now(), failure = NULL
FROM locked WHERE c.name = locked.name AND c.tx = $2::xid8 AND c.position = $3
"""
# Records the poison event a projector stopped on; returns the one recorded before, so a
# stop that another process (or an earlier run) already reported is not reported in full.
_RECORD_FAILURE = """
UPDATE projection_checkpoints c SET failure = $2::jsonb
FROM (SELECT name, failure FROM projection_checkpoints WHERE name = $1 FOR UPDATE) before
WHERE c.name = before.name AND c.tx = $3::xid8 AND c.position = $4
RETURNING before.failure
"""
_VISIBLE = "tx < pg_snapshot_xmin(pg_current_snapshot())"
LAG_BOUND = 100_000
"""The most events the lag counts: beyond it a lag is reported as "at least" that many. The
status is sampled every few seconds, and a projector at the start of a large log (new, or
reset by a migration) would otherwise count the whole log each time. Above the lag alert's
threshold (ops/prometheus/svc-rules.yaml), so the alert still fires."""
# Both parts run on the (tx, position) index and stop early: the count reads at most
# LAG_BOUND + 1 entries ($3), and the age is the first pending event's in log order (an
# event's `recorded_at` is its transaction's start, so this is the oldest but for
# transactions that overlapped, within a statement's duration of it).
_LAG = f"""
SELECT (SELECT count(*) FROM (
            SELECT FROM events WHERE (tx, position) > ($1::xid8, $2::int8) AND {_VISIBLE}
            ORDER BY tx, position LIMIT $3
        ) pending),
       coalesce((
            SELECT greatest(extract(epoch FROM clock_timestamp() - recorded_at), 0)
            FROM events WHERE (tx, position) > ($1::xid8, $2::int8) AND {_VISIBLE}
            ORDER BY tx, position LIMIT 1
       ), 0)::float8
"""


class CommitSignal(Protocol):
    """Where commit wake-ups come from: `eventstore.notify.CommitNotifier` in the service."""

    def add_listener(self, cb: Callable[[], None]) -> None: ...

    def remove_listener(self, cb: Callable[[], None]) -> None: ...


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
    """Committed events after the checkpoint, counted up to `LAG_BOUND`."""
    lag_seconds: float
    """Age of the first committed event after the checkpoint (in log order: the oldest but
    for transactions that overlapped); 0 when caught up."""
    running: bool
    failure: PoisonEvent | None
    lag_at_least: bool = False
    """More than `LAG_BOUND` events are after the checkpoint: `lag_events` (`LAG_BOUND`) is
    a lower bound."""


class _CheckpointMoved(Exception):
    """Another runner moved a checkpoint of the group since this runner read it."""


@dataclass(frozen=True, slots=True)
class _Aborts:
    """The database gave up on a projector's statement for the event at `point`, `count`
    times in a row, or (`newer`) the event was written by a newer version of SVC than this
    process; the projector is left out of the steps until `retry_at` (loop time)."""

    point: LogPoint
    count: int
    retry_at: float
    newer: EventFromNewerVersion | None = None


@dataclass(eq=False)
class _Slot:
    projector: Projector
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    """Held by whichever task of this process is moving this checkpoint."""
    point: LogPoint = ORIGIN
    """The checkpoint as this process last read or wrote it."""
    loaded: bool = False
    """False until `point` is read from the database, and again whenever another runner may
    have moved the checkpoint (a lost compare-and-set, an idle poll, a new catch-up)."""
    failure: PoisonEvent | None = None
    aborts: _Aborts | None = None
    """Set while the next event's statement is being retried after the database gave up on
    it; cleared once the checkpoint passes that event."""
    landed: bool = False
    """Its last batch ended on the checkpoint of the group ahead of it (its cap)."""

    @property
    def name(self) -> str:
        return self.projector.name

    def backing_off(self, now: float) -> bool:
        return self.aborts is not None and now < self.aborts.retry_at

    @property
    def newer(self) -> EventFromNewerVersion | None:
        """The newer version's event it waits on, if that is why it waits."""
        return None if self.aborts is None else self.aborts.newer

    def moved_to(self, point: LogPoint) -> None:
        self.point = point
        if self.aborts is not None and point >= self.aborts.point:
            self.aborts = None


def _attempt(slot: _Slot, event: RecordedEvent) -> int:
    """Which attempt in a row at `event` the one that just failed was."""
    aborts = slot.aborts
    return aborts.count + 1 if aborts is not None and aborts.point == event.point else 1


def _back_off(
    slot: _Slot, event: RecordedEvent, count: int, newer: EventFromNewerVersion | None = None
) -> float:
    """Leave `slot` out of the steps for a while before its `count`+1th attempt at `event`:
    doubling from _FIRST_ABORT_BACKOFF_S, at most _MAX_BACKOFF_S. Returns the wait."""
    delay: float = min(_FIRST_ABORT_BACKOFF_S * 2.0 ** min(count - 1, 32), _MAX_BACKOFF_S)
    retry_at = asyncio.get_running_loop().time() + delay
    slot.aborts = _Aborts(event.point, count, retry_at, newer)
    return delay


def _poison(recorded: object) -> PoisonEvent | None:
    """A stop as `_record_failure` stored it; None for none, or for a shape it cannot read."""
    if not isinstance(recorded, dict):
        return None
    try:
        return PoisonEvent(**{f.name: recorded[f.name] for f in fields(PoisonEvent)})
    except (KeyError, TypeError):
        return None


def _cursor(point: LogPoint) -> str:
    return "" if point == ORIGIN else encode_cursor(point)


def _groups(slots: Sequence[_Slot]) -> list[tuple[list[_Slot], LogPoint | None]]:
    """`slots` grouped by checkpoint, each group with the point its batch must not pass: the
    next group's checkpoint, so that a group catching up lands on it and the two merge instead
    of one chasing the other forever."""
    by_point: dict[LogPoint, list[_Slot]] = {}
    for slot in slots:
        by_point.setdefault(slot.point, []).append(slot)
    points = sorted(by_point)
    caps: list[LogPoint | None] = [*points[1:], None]
    return [(by_point[point], cap) for point, cap in zip(points, caps, strict=True)]


async def _all(batches: Iterable[Awaitable[int | None]]) -> list[int | None]:
    """Run batches side by side and wait for every one of them, even when one fails (the
    caller releases the projectors' locks when this returns), then raise the first error."""
    results = await asyncio.gather(*batches, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return [result for result in results if not isinstance(result, BaseException)]


def _run_timed_out(exc: Exception, exact: bool) -> bool:
    """A pipelined run (`Pipeline`, one `executemany`) that outlasted the driver's command
    timeout: one timer covers the whole run, where the server times each statement, so a
    run of many sound but slow statements times out on the client's clock alone. That is
    the run's, not the database's: redone a statement at a time (`_isolate`), each under
    its own timer, where a statement too slow for the server's timeout is a projector's
    (`StatementAborted`) and a database that is down is found down again."""
    return (
        not exact and isinstance(exc, StoreUnavailable) and isinstance(exc.__cause__, TimeoutError)
    )


def _combine(results: Sequence[int | None]) -> int | None:
    """Several batches as one result: None if any lost its compare-and-set, else the most
    events one consumed."""
    if any(result is None for result in results):
        return None
    return max((result for result in results if result is not None), default=0)


def _up_to(events: list[RecordedEvent], cap: LogPoint) -> list[RecordedEvent]:
    return [event for event in events if (event.tx, event.position) <= cap]


class ProjectionRunner:
    def __init__(
        self,
        db: Database,
        projectors: Sequence[Projector],
        *,
        notifier: CommitSignal | None = None,
        poll_interval_s: float = 0.075,
        batch_size: int = 500,
        batch_bytes: int = BATCH_BYTES,
        linger_s: float = 0.01,
        metrics_interval_s: float = 5.0,
    ) -> None:
        """`linger_s`: under a steady stream of commits, how long the background loop lets
        events gather after a batch before the next one (bigger batches, fewer round trips
        and commits per event). Never while a `wait_for` is waiting, and never for the first
        commit after an idle spell, so isolated writes and read-your-writes are not delayed."""
        if batch_size < 1 or batch_bytes < 1:
            raise ValueError("batch_size and batch_bytes must be at least 1")
        if linger_s < 0:
            raise ValueError("linger_s must not be negative")
        self._db = db
        self._slots: dict[str, _Slot] = {}
        for projector in projectors:
            if projector.name in self._slots:
                raise ValueError(f"two projectors are named {projector.name!r}")
            self._slots[projector.name] = _Slot(projector)
        self._notifier = notifier
        self._poll_interval_s = poll_interval_s
        self._batch_size = batch_size
        self._batch_bytes = batch_bytes
        self._linger_s = linger_s
        self._metrics_interval_s = metrics_interval_s
        self._progress = asyncio.Condition()
        self._wake = asyncio.Event()
        self._hurry = asyncio.Event()
        self._readers_waiting = 0
        self._task: asyncio.Task[None] | None = None
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
        self._task = asyncio.create_task(self._run(), name="svc-projections")
        self._metrics_task = asyncio.create_task(self._sample_metrics(), name="svc-proj-metrics")
        if self._notifier is not None:
            self._notifier.add_listener(self.wake)

    async def stop(self) -> None:
        if not self._running:
            return
        self._running = False
        if self._notifier is not None:
            self._notifier.remove_listener(self.wake)
        tasks = (self._task, self._metrics_task)
        self._task = self._metrics_task = None
        await cancel_and_wait(*tasks)

    def wake(self) -> None:
        """Commit listener: something was appended, look at the log now."""
        self._wake.set()

    async def _run(self) -> None:
        """The background loop: one step over every projector per wake-up, as long as
        batches come back full."""
        slots = list(self._slots.values())
        first_delay = min(self._poll_interval_s, _MAX_BACKOFF_S)
        delay = first_delay
        next_resume_check = 0.0
        outage = OutageLog(log, "projections step")
        while self._running:  # besides the cancellation: a stop must end the loop
            self._wake.clear()
            now = asyncio.get_running_loop().time()
            if now >= next_resume_check:
                # Busy or idle, a stop cleared elsewhere is seen within the interval.
                next_resume_check = now + _RESUME_CHECK_S
                with contextlib.suppress(StoreError):  # the step below reports an outage
                    await self._resume_if_cleared(slots)
            try:
                consumed = await self._step(slots, wait=False)
            except StoreError as exc:
                outage.failed(exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, _MAX_BACKOFF_S)
                continue
            except Exception:
                log.exception("projections: batch failed (retrying in %.2fs)", delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, _MAX_BACKOFF_S)
                continue
            outage.succeeded()
            delay = first_delay
            await self._notify_progress()
            if consumed is None or consumed >= self._batch_size:
                continue
            if consumed > 0:
                await self._linger()
            if self._wake.is_set():
                continue
            # The fallback poll covers commits whose wake-up never came (another process
            # without a working NOTIFY, or a notifier that is not wired in). An idle poll also
            # rereads the checkpoints, which another process's rebuild may have moved back.
            if not await wait_set(self._wake, self._poll_interval_s):
                for slot in slots:
                    slot.loaded = False

    async def _linger(self) -> None:
        """Let the commits of the next `linger_s` gather into the next batch, unless a reader
        is waiting for the read models (`wait_for`), who cuts the wait short."""
        if self._linger_s == 0 or self._readers_waiting:
            return
        self._hurry.clear()
        await wait_set(self._hurry, self._linger_s)

    async def _sample_metrics(self) -> None:
        while self._running:
            try:
                await self.status()
            except StoreError as exc:
                log.warning("could not sample projection lag: %s", exc.message)
            await asyncio.sleep(self._metrics_interval_s)

    async def _notify_progress(self) -> None:
        async with self._progress:
            self._progress.notify_all()

    # -- one step: a batch per group ----------------------------------------------------------

    async def _step(self, slots: Sequence[_Slot], *, wait: bool) -> int | None:
        """Advance each group of `slots` (same checkpoint) by one batch, groups side by side.

        Returns the most events a group consumed, or None when another runner moved a
        checkpoint first (nothing lost; the next step reloads it). With `wait`, waits for the
        projectors another task of this process is moving (a rebuild, a catch-up); without,
        leaves them out. Locks are taken in name order, so that tasks stepping overlapping
        sets of projectors never deadlock; a stopped projector is left out, and so is one
        backing off after the database gave up on its statement.
        """
        now = asyncio.get_running_loop().time()
        async with contextlib.AsyncExitStack() as held:
            ready: list[_Slot] = []
            for slot in sorted(slots, key=lambda s: s.name):
                if not wait and slot.lock.locked():
                    continue
                await held.enter_async_context(slot.lock)
                if slot.failure is None and not slot.backing_off(now):
                    ready.append(slot)
            if not ready:
                return 0  # every projector busy elsewhere in this process, or stopped
            await self._load([slot for slot in ready if not slot.loaded])
            groups = _groups(ready)
            if len(groups) == 1:
                ((group, cap),) = groups
                return await self._advance(group, cap=cap)
            return await self._advance_groups(groups)

    async def _advance_groups(
        self, groups: list[tuple[list[_Slot], LogPoint | None]]
    ) -> int | None:
        """Several groups side by side, each up to the next one's point. Once the group right
        behind the leader has landed on the leader's point, the leader has moved on in that
        same step, and would stay ahead for as long as events keep coming (every batch two
        reads and two commits): it is held back for one step, in which that group lands on
        its point again, and they are one group from the next."""
        *behind, _ = groups
        if any(slot.landed for slot in behind[-1][0]):
            return _combine(await _all(self._advance(group, cap=cap) for group, cap in behind))
        return _combine(await _all(self._advance(group, cap=cap) for group, cap in groups))

    async def _load(self, slots: Sequence[_Slot]) -> None:
        """Read the checkpoints of `slots` (creating missing rows) into their `point`."""
        if not slots:
            return
        names = [slot.name for slot in slots]
        async with self._db.acquire(stateless=True) as conn:
            rows = await conn.fetch(_LOAD, names)
            if len(rows) < len(names):
                # Another runner was creating a row: this statement waited for it and did
                # nothing, but its snapshot predates that row. The next statement sees it.
                rows = await conn.fetch(_READ, names)
        points = {row[0]: LogPoint(row[1], row[2]) for row in rows}
        for slot in slots:
            slot.moved_to(points[slot.name])
            slot.loaded = True

    async def _advance(self, group: Sequence[_Slot], cap: LogPoint | None = None) -> int | None:
        """Apply the next batch to every projector of `group`, all at the same checkpoint
        (the caller holds their locks).

        Returns how many events were consumed (0: caught up, or stopped on a poison event),
        or None when another runner moved a checkpoint first (nothing done; reload and try
        again). A partial batch (the live case) is one transaction for the whole group. A
        full one means the group is catching up, where time matters more than round trips:
        its projectors then apply it side by side, each in its own transaction, so that
        the database works on them on several cores.
        """
        old = group[0].point
        size = self._batch_size
        # Outside the transaction: the log after a visible point is final, and an idle poll
        # then costs one round trip.
        async with self._db.acquire(stateless=True) as conn:
            events, more = await read_log_cut(conn, old, size, self._batch_bytes)
        if cap is not None:
            events = _up_to(events, cap)
        for slot in group:
            slot.landed = bool(events) and events[-1].point == cap
        if not events:
            return 0
        if len(group) == 1 or not more:
            consumed = await self._apply(group, old, events)
        else:
            consumed = _combine(await _all(self._apply([slot], old, events) for slot in group))
        # A batch cut by its bytes is as full as one cut by its count: the next follows at once.
        return size if more and consumed == len(events) else consumed

    async def _apply(
        self,
        group: Sequence[_Slot],
        old: LogPoint,
        events: list[RecordedEvent],
        *,
        exact: bool = False,
    ) -> int | None:
        """One transaction: move the group's checkpoints from `old` past `events`, apply them.

        Normally the handlers' statements are pipelined (`Pipeline`); when that fails, a
        group's batch is redone without the projector at fault, and that one's `exact`ly, one
        round trip per statement, to find the event at fault (`_isolate`).
        """
        new = events[-1].point
        names = [slot.name for slot in group]
        applying: tuple[_Slot, RecordedEvent] | None = None
        in_apply = False
        try:
            async with self._db.acquire(stateless=True) as conn, conn.transaction():
                status = await conn.execute(
                    _MOVE, names, old.tx, old.position, new.tx, new.position
                )
                if status != f"UPDATE {len(group)}":
                    raise _CheckpointMoved
                in_apply = True
                target = conn if exact else Pipeline(conn)
                # Projector by projector, so each one's runs of one statement stay long.
                for slot in group:
                    projector = slot.projector
                    for event in events:
                        if projector.handles(event.type):
                            applying = (slot, event)
                            await projector.apply(target, event)
                    if isinstance(target, Pipeline):
                        await target.flush()
                in_apply = False
        except _CheckpointMoved:
            log.info("projections %s: checkpoint moved by another runner, reloading", names)
            for slot in group:
                slot.loaded = False
            return None
        except Exception as exc:
            # Only what went wrong in a handler is a projector's; the database being down
            # (not a statement it gave up on) or a failing compare-and-set is the whole step's.
            if not in_apply or (database_down(exc) and not _run_timed_out(exc, exact)):
                raise
            return await self._isolate(group, old, events, applying, exc, exact=exact)
        for slot in group:
            slot.moved_to(new)
        return len(events)

    async def _isolate(
        self,
        group: Sequence[_Slot],
        old: LogPoint,
        events: list[RecordedEvent],
        applying: tuple[_Slot, RecordedEvent] | None,
        exc: Exception,
        *,
        exact: bool,
    ) -> int | None:
        """After a failed `_apply`: the batch again without the projector at fault, then that
        one alone, one statement at a time, to stop (or back off) on the event at fault.

        `applying` names the projector whose handler or pipelined run raised: each
        projector's run is flushed before the next one's starts, so the error is its own."""
        if len(group) > 1:
            if applying is None:  # not expected: then projector by projector
                return _combine([await self._apply([slot], old, events) for slot in group])
            culprit = applying[0]
            others = [slot for slot in group if slot is not culprit]
            # The others first: the culprit's attempt may last a statement timeout.
            done = [await self._apply(others, old, events)]
            done.append(await self._apply([culprit], old, events, exact=True))
            return _combine(done)
        if not exact:
            return await self._apply(group, old, events, exact=True)
        if applying is None:
            raise exc
        slot, event = applying
        if not await self._commit_before(slot, old, events, event):
            return 0  # moved by another runner, or stopped earlier: look again
        consumed = events.index(event)
        if isinstance(exc, StatementAborted):
            await self._aborted_on(slot, event, exc)
        elif isinstance(exc, EventFromNewerVersion):
            self._wait_for_newer(slot, event, exc)
        else:
            await self._stop_at(slot, event, failure_reason(exc), exc)
        return consumed

    async def _commit_before(
        self, slot: _Slot, old: LogPoint, events: list[RecordedEvent], event: RecordedEvent
    ) -> bool:
        """Commit `slot`'s events before `event`; False if they did not all commit (another
        runner moved the checkpoint first, or one of them failed in turn and was handled)."""
        index = events.index(event)
        if index == 0:
            return True
        return await self._apply([slot], old, events[:index]) == index

    async def _aborted_on(self, slot: _Slot, event: RecordedEvent, exc: StatementAborted) -> None:
        """The database gave up on `slot`'s statement for `event` (its checkpoint is just
        before it): back off and try again, or stop on it the `_MAX_ABORTS`th time in a row.
        Contention passes (a deadlock, a lock held for a while); a handler too slow for the
        statement timeout fails every time, and retrying it forever would hide it."""
        count = _attempt(slot, event)
        if count >= _MAX_ABORTS:
            slot.aborts = None
            await self._stop_at(slot, event, aborted_reason(exc, count, slot.name), exc)
            return
        delay = _back_off(slot, event, count)
        log.warning(
            "projection %s: the database gave up on its statement for the event at cursor %s "
            "(attempt %d of %d; again in %.2fs): %s",
            slot.name,
            event.cursor,
            count,
            _MAX_ABORTS,
            delay,
            exc.detail,
        )

    def _wait_for_newer(
        self, slot: _Slot, event: RecordedEvent, exc: EventFromNewerVersion
    ) -> None:
        """`event` was written by a newer version of SVC (after a rollback, or mid-deploy):
        not poison, since a process of that version can apply it, and a stop would be
        recorded for every process, that one included. This projector waits, backing off;
        the others go on."""
        count = _attempt(slot, event)
        _back_off(slot, event, count, newer=exc)
        level = logging.WARNING if count == 1 else logging.DEBUG
        log.log(level, "projection %s waits at cursor %s: %s", slot.name, event.cursor, exc)

    async def _stop_at(
        self, slot: _Slot, poison: RecordedEvent, error: str, exc: Exception
    ) -> None:
        """Stop the projector on `poison` (its checkpoint is just before it)."""
        if slot.failure is not None:
            return
        before = slot.point
        slot.failure = PoisonEvent(
            projection=slot.name,
            cursor=poison.cursor,
            tx=poison.tx,
            position=poison.position,
            event_type=poison.type,
            stream_id=poison.stream_id,
            error=error,
        )
        news = await self._record_failure(slot.failure, before)
        if news is None:
            # The checkpoint moved past `before` meanwhile (a rebuild's switch): no stop here.
            slot.failure, slot.loaded = None, False
            return
        if news:
            log.error(
                "projection %s stopped: cannot apply event at position %d (tx %d, cursor %s, "
                "type %s, stream %s); it will not advance until fixed: %s",
                slot.name,
                poison.position,
                poison.tx,
                poison.cursor,
                poison.type,
                poison.stream_id,
                next_step(slot.name),
                exc_info=exc,
            )
        else:
            log.warning(
                "projection %s is stopped on the event at cursor %s (already reported): %s; %s",
                slot.name,
                poison.cursor,
                slot.failure.error,
                next_step(slot.name),
            )
        metrics.STALLED.labels(projection=slot.name).set(1)

    async def _record_failure(self, failure: PoisonEvent, at: LogPoint) -> bool | None:
        """Record `failure` on its checkpoint row, still at `at` (the point before the poison
        event), for every process to see. True when it is news, False when that stop was
        already recorded there (by this process or another), None when the checkpoint has
        moved on (this stop no longer stands)."""
        try:
            async with self._db.acquire(stateless=True) as conn:
                row = await conn.fetchrow(
                    _RECORD_FAILURE, failure.projection, asdict(failure), at.tx, at.position
                )
        except StoreError as exc:
            log.warning("could not record the stop of %s: %s", failure.projection, exc.message)
            return True
        if row is None:
            return None
        before = row[0]
        return not (isinstance(before, dict) and before.get("cursor") == failure.cursor)

    async def _resume_if_cleared(self, slots: Sequence[_Slot]) -> None:
        """A projector stopped here whose recorded stop was cleared elsewhere (a rebuild in
        another process moved its checkpoint) runs again, from where that left it."""
        stopped = [slot for slot in slots if slot.failure is not None]
        if not stopped:
            return
        async with self._db.acquire(stateless=True) as conn:
            rows = await conn.fetch(_READ, [slot.name for slot in stopped])
        cleared = {row[0] for row in rows if row[3] is None}
        for slot in stopped:
            if slot.name in cleared:
                log.info("projection %s: its stop was cleared elsewhere; running again", slot.name)
                slot.failure, slot.loaded = None, False
                metrics.STALLED.labels(projection=slot.name).set(0)

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

        Raises `ProjectionFailed` if a projector stops on a poison event before `until` (the
        others still reach it); a stop after `until` is left for the next caller to meet. A
        cursor that is not yet visible (an older transaction still open) is waited for by
        polling; bound the wait with `asyncio.timeout` or use `wait_for`.
        """
        target = decode_cursor(until) if until else await self._head()
        slots = self._select(names)
        # The first step rereads the checkpoints, which another process's rebuild may have
        # moved back since this process last saw them.
        for slot in slots:
            slot.loaded = False
        while True:
            consumed = await self._step(slots, wait=True)
            await self._notify_progress()
            for slot in slots:  # a wait this call cannot end: the caller is told
                if slot.newer is not None:
                    raise slot.newer
            behind = [s for s in slots if s.failure is None and s.point < target]
            if consumed is not None and not behind:
                break
            if consumed == 0:
                await asyncio.sleep(self._poll_interval_s)
        for slot in slots:
            # A stop past `until` is no reason to fail this wait: what it asked for is applied.
            if slot.failure is not None and slot.point < target:
                raise ProjectionFailed(
                    f"projection {slot.name} is stopped at "
                    f"{slot.failure.cursor}: {slot.failure.error}; {next_step(slot.name)}"
                )

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
        when one of them is stopped on a poison event (see `status()`) or waits on an event a
        newer version wrote (`waiting_on_newer`). When the runner is not started, the
        caller's task does the catching up itself (and that wait raises
        EventFromNewerVersion).
        """
        target = decode_cursor(cursor)
        slots = self._select(names)
        if not self._running:
            try:
                async with asyncio.timeout(timeout):
                    await self.catch_up(cursor, names=names)
            except (TimeoutError, ProjectionFailed):
                return False
            return True

        def settled() -> bool:
            # Reached, or not to be reached by waiting: stopped on a poison event, or waiting
            # on a newer version's event (`not_applied_by` tells the caller which).
            return all(
                s.point >= target or s.failure is not None or s.newer is not None for s in slots
            )

        self._readers_waiting += 1
        self._hurry.set()
        self._wake.set()
        try:
            async with asyncio.timeout(timeout), self._progress:
                await self._progress.wait_for(settled)
        except TimeoutError:
            return False
        finally:
            self._readers_waiting -= 1
        return all(s.point >= target for s in slots)

    def stopped(self, names: Collection[str] | None = None) -> list[str]:
        """The selected projectors this process knows to be stopped on a poison event."""
        return [s.name for s in self._select(names) if s.failure is not None]

    def waiting_on_newer(
        self, names: Collection[str] | None = None
    ) -> EventFromNewerVersion | None:
        """Why one of the selected projectors waits, when it waits on an event a newer
        version of SVC wrote (only upgrading this process lets it on)."""
        for slot in self._select(names):
            if slot.newer is not None:
                return slot.newer
        return None

    def retry(self, name: str) -> None:
        """Clear a projector's poison-event stop so it tries that event again."""
        (slot,) = self._select([name])
        slot.failure = slot.aborts = None
        slot.loaded = False
        metrics.STALLED.labels(projection=name).set(0)
        self._wake.set()

    async def rebuild(self, name: str, progress: Progress | None = None) -> int:
        """Replay the whole log into copies of the projector's tables and switch them in
        (projections/rebuild.py): readers see the old read model until the switch commits
        and the rebuilt one after, never a partial one. Returns how many events of the
        projector's types were replayed. Raises `ProjectionFailed` when the replay stops on
        a poison event, leaving the live model as it was.

        A projector stopped on a poison event in this process starts again from the
        rebuilt model.
        """
        (slot,) = self._select([name])
        async with self._db.acquire(stateless=True) as conn:
            await conn.execute(_ENSURE, name)
        point, done = await rebuild_beside(
            self._db,
            slot.projector,
            batch_size=self._batch_size,
            batch_bytes=self._batch_bytes,
            switching=slot.lock,
            progress=progress,
        )
        slot.point, slot.loaded, slot.failure, slot.aborts = point, True, None, None
        metrics.STALLED.labels(projection=name).set(0)
        self._wake.set()
        await self._notify_progress()
        log.info("projection %s rebuilt from %d events", name, done)
        return done

    # -- status -------------------------------------------------------------------------------

    async def status(self) -> list[ProjectionStatus]:
        """Checkpoint and lag of every projector; also refreshes the lag gauges."""
        async with self._db.acquire(stateless=True) as conn:
            rows = await conn.fetch(_READ, list(self._slots))
            points = {row[0]: LogPoint(row[1], row[2]) for row in rows}
            recorded = {row[0]: _poison(row[3]) for row in rows}
            # Usually all projectors share one checkpoint: one lag query each distinct one.
            lags: dict[LogPoint, tuple[int, float]] = {}
            for point in {points.get(name, ORIGIN) for name in self._slots}:
                lag = await conn.fetchrow(_LAG, point.tx, point.position, LAG_BOUND + 1)
                counted = int(lag[0])  # LAG_BOUND + 1: more than LAG_BOUND
                lags[point] = (counted, float(lag[1]) if counted else 0.0)
        running = self._running and self._task is not None and not self._task.done()
        out: list[ProjectionStatus] = []
        for name, slot in self._slots.items():
            point = points.get(name, ORIGIN)
            counted, lag_seconds = lags[point]
            lag_events = min(counted, LAG_BOUND)
            # This process's own stop, else the one recorded (by the process that stopped).
            failure = slot.failure or recorded.get(name)
            metrics.record_lag(name, lag_events, lag_seconds, failure is not None)
            out.append(
                ProjectionStatus(
                    name=name,
                    cursor=_cursor(point),
                    lag_events=lag_events,
                    lag_seconds=lag_seconds,
                    running=running,
                    failure=failure,
                    lag_at_least=counted > LAG_BOUND,
                )
            )
        return out


def next_step(name: str) -> str:
    """What an operator does about the stopped projection `name`."""
    return (
        "deploy the fix (code or an upcaster) and restart the service, or run "
        f"`svc projections rebuild {name}`"
    )
