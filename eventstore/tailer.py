"""One log tailer per process, fanning the global log out in memory to every subscriber.

ARCHITECTURE.md decision 4: the tailer reads the gap-free global log (reads.read_log_cut, by
`(tx, position)` below the oldest running transaction) when a commit wakes it or when the
fallback poll fires, and hands each batch to every live subscriber's bounded queue. A
subscriber that starts behind reads history itself, with its own filters, then joins the live
fan-out; a subscriber whose queue fills up is cut off with its last cursor, so one slow SSE
client never slows the tailer or the other subscribers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence

from eventstore.cursor import ORIGIN, LogPoint, decode_cursor, encode_cursor
from eventstore.db import Connection, Database
from eventstore.errors import InvalidCursor, StoreError
from eventstore.notify import CommitNotifier
from eventstore.outage_log import OutageLog, doubling_backoff
from eventstore.reads import log_head, point_issued, read_log_cut
from eventstore.records import RecordedEvent
from eventstore.tasks import cancel_and_wait, wait_set
from schemas.errors import Unavailable

log = logging.getLogger(__name__)


class SubscriberTooSlow(StoreError, Unavailable):
    """The subscriber fell too far behind the live log; resume from `last_cursor`."""

    default_code = "subscriber_too_slow"

    def __init__(self, last_cursor: str) -> None:
        super().__init__(
            "the event feed was closed because this reader fell too far behind; "
            "reconnect with the last cursor to resume"
        )
        self.last_cursor = last_cursor


class _Subscription:
    """A subscriber's bounded queue, filled by the tailer's fan-out."""

    __slots__ = ("buffer", "closed", "live", "max_queue", "overflowed", "types", "wake")

    def __init__(self, types: frozenset[str] | None, max_queue: int) -> None:
        self.types = types
        self.max_queue = max_queue
        self.buffer: deque[RecordedEvent] = deque()
        self.wake = asyncio.Event()
        self.overflowed = False
        self.closed = False
        self.live = False

    def offer(self, events: Sequence[RecordedEvent]) -> None:
        if self.types is not None:
            events = [e for e in events if e.type in self.types]
        if not events:
            return
        if len(self.buffer) + len(events) > self.max_queue:
            self.overflowed = True
            self.buffer.clear()
        else:
            self.buffer.extend(events)
        self.wake.set()

    def close(self) -> None:
        self.closed = True
        self.wake.set()


FAILED_READ_BACKOFF_CAP_S = 2.0


def _backoff(poll_interval_s: float, failures: int) -> float:
    """The wait after the n-th failed read in a row: doubling from the poll interval."""
    return doubling_backoff(poll_interval_s, FAILED_READ_BACKOFF_CAP_S, failures)


HISTORY_PAGE_BYTES = 8 * 1024 * 1024
"""The stored event data after which a page of history is cut (the event that crosses it
included, so a page holds at most this plus one event): a reader
catching up holds a page whole."""

LIVE_BATCH_BYTES = 4 * 1024 * 1024
"""The stored event data after which a live batch is cut (the event that crosses it
included). A batch goes to
every live feed of its workspaces at once, each writing it whole to its socket: after a
stall, a thousand large messages read in one batch were a copy of that much per feed."""

BatchListener = Callable[[Sequence[RecordedEvent]], None]
"""Called with each batch the tailer reads, in log order, before it reads the next one."""


class LogTailer:
    def __init__(
        self,
        db: Database,
        notifier: CommitNotifier,
        *,
        poll_interval_s: float = 0.075,
        batch_size: int = 1000,
        max_queue: int = 10_000,
        history_page: int = 1000,
    ) -> None:
        self._db = db
        self._notifier = notifier
        self._poll_interval_s = poll_interval_s
        self._batch_size = batch_size
        self._max_queue = max_queue
        self._history_page = history_page
        self._live = ORIGIN
        # Subscribers keyed by their workspace filter; None holds the unfiltered ones.
        self._subs: dict[str | None, set[_Subscription]] = {}
        self._batch_listeners: list[BatchListener] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._running = False
        self._head_reached_at = time.monotonic()
        self.cut_off_total = 0
        self.events_fanned_out = 0

    @property
    def live_point(self) -> LogPoint:
        """The newest point fanned out; every event at or before it reached live subscribers."""
        return self._live

    @property
    def live_cursor(self) -> str:
        return "" if self._live == ORIGIN else encode_cursor(self._live)

    @property
    def lag(self) -> float:
        """Seconds since the tailer last read up to the visible head of the log.

        Stays below the poll interval on a healthy store; grows while the database is out or
        while the tailer works through a backlog."""
        return time.monotonic() - self._head_reached_at

    @property
    def subscriber_count(self) -> int:
        return sum(len(subs) for subs in self._subs.values())

    @property
    def running(self) -> bool:
        """Started, not stopped, and its reading task alive."""
        return self._running and self._task is not None and not self._task.done()

    async def start(self) -> None:
        if self._running:
            return
        async with self._db.acquire() as conn:
            self._live = await log_head(conn)
        self._head_reached_at = time.monotonic()
        self._running = True
        self._notifier.add_listener(self.wake)
        self._task = asyncio.create_task(self._run(), name="svc-log-tailer")

    async def stop(self) -> None:
        self._running = False
        self._notifier.remove_listener(self.wake)
        task, self._task = self._task, None
        await cancel_and_wait(task)
        for subs in self._subs.values():
            for sub in subs:
                sub.close()
        self._subs.clear()

    def wake(self) -> None:
        self._wake.set()

    async def issued(self, point: LogPoint) -> bool:
        """Whether `point` was handed out by this log. A point at or before the live point
        was; one past it costs a query: a cursor an append has just returned may be ahead of
        the live point and even of the visible head (an older transaction still running holds
        xmin back), and it is valid; a point never issued (another database's, made up) would
        leave a reader waiting for events that never come after it."""
        if point <= self._live:
            return True
        async with self._db.acquire(stateless=True) as conn:
            return await point_issued(conn, point)

    async def issued_cursor(self, cursor: str) -> LogPoint:
        """A client's cursor decoded, refused with InvalidCursor unless this log issued it
        (see `issued`): waiting for events after a point never issued would never end."""
        point = decode_cursor(cursor)
        if not await self.issued(point):
            raise InvalidCursor(
                "cursor ahead of the log: this service never issued it; pass back a cursor "
                "this service returned (an SSE id or a write's cursor), or omit it"
            )
        return point

    def add_batch_listener(self, listener: BatchListener) -> None:
        """Hand every batch read from now on to `listener`, synchronously, in the same step
        that moves `live_point` past it: a listener registered while `live_point` is L gets
        exactly the events after L (the handoff rule of `_stream`, for in-process fan-outs
        such as the SSE feeds that keep their own per-connection state)."""
        self._batch_listeners.append(listener)

    def remove_batch_listener(self, listener: BatchListener) -> None:
        with contextlib.suppress(ValueError):
            self._batch_listeners.remove(listener)

    def history(
        self, after: LogPoint, workspace_id: str | None, types: Sequence[str] | None = None
    ) -> AsyncIterator[RecordedEvent]:
        """Events after `after` read from the database, in pages, scoped in the query; ends
        at the first short page (catch-up for a reader that starts behind the live point)."""
        return self._history(after, workspace_id, frozenset(types) if types is not None else None)

    def subscribe(
        self,
        after: str | None = None,
        *,
        workspace_id: str | None = None,
        types: Sequence[str] | None = None,
    ) -> AsyncIterator[RecordedEvent]:
        """Events after `after` (a cursor; None or "" for the start of the log), then live.

        Raises InvalidCursor here, before any iteration, for a malformed cursor. The iterator
        raises SubscriberTooSlow when its queue overflows and ends when the tailer stops."""
        start = decode_cursor(after)
        wanted = frozenset(types) if types is not None else None
        return self._stream(start, workspace_id, wanted)

    async def _stream(
        self, start: LogPoint, workspace_id: str | None, types: frozenset[str] | None
    ) -> AsyncIterator[RecordedEvent]:
        sub = _Subscription(types, self._max_queue)
        last = start
        try:
            # Handoff without gap or duplicate: register first, so every event the tailer fans
            # out after its current live point L0 lands in our queue; then read history until a
            # short page. That page's snapshot began after registration, so its xmin is above
            # L0.tx and it returned everything up to L0. Queue events at or before the last
            # point we yielded are the overlap and are dropped. If the queue overflowed while
            # we read history, the queue is incomplete: register again and read on.
            while True:
                if not self._running:
                    return
                self._register(sub, workspace_id)
                async for event in self._history(last, workspace_id, types):
                    yield event
                    last = event.point
                if not self._running:
                    # History stopped with the tailer, maybe short of the live point: the
                    # queue's events may lie past events never read. End, as a stop does.
                    return
                if not sub.overflowed:
                    break
            sub.live = True
            while True:
                while sub.buffer:
                    event = sub.buffer.popleft()
                    if event.point <= last:
                        continue
                    yield event
                    last = event.point
                if sub.overflowed:
                    raise SubscriberTooSlow(encode_cursor(last) if last != ORIGIN else "")
                if sub.closed:
                    return
                sub.wake.clear()
                await sub.wake.wait()
        finally:
            self._unregister(sub, workspace_id)

    async def history_page(
        self,
        after: LogPoint,
        workspace_id: str | None,
        types: Sequence[str] | None,
        limit: int,
        max_bytes: int = HISTORY_PAGE_BYTES,
    ) -> tuple[list[RecordedEvent], bool]:
        """One page of `history`: up to `limit` events after `after` and `max_bytes` of their
        stored data (the first always taken), one workspace's read as the log reader, which
        row-level security limits to it; and whether more may follow. For a reader that
        sizes its pages itself (the feeds, by the bytes they write): a page is held whole,
        so large events must make it short."""
        async with self._db.log_reading(workspace_id) as conn:
            return await read_log_cut(conn, after, limit, max_bytes, types, workspace_id)

    async def _history(
        self, after: LogPoint, workspace_id: str | None, types: frozenset[str] | None
    ) -> AsyncIterator[RecordedEvent]:
        type_list = sorted(types) if types is not None else None
        while self._running:
            page, more = await self.history_page(after, workspace_id, type_list, self._history_page)
            for event in page:
                yield event
            if not more:
                return
            after = page[-1].point

    def _register(self, sub: _Subscription, workspace_id: str | None) -> None:
        sub.buffer.clear()
        sub.overflowed = False
        self._subs.setdefault(workspace_id, set()).add(sub)

    def _unregister(self, sub: _Subscription, workspace_id: str | None) -> None:
        subs = self._subs.get(workspace_id)
        if subs is not None:
            subs.discard(sub)
            if not subs:
                del self._subs[workspace_id]

    async def _run(self) -> None:
        # The tailer keeps one pooled connection: under a busy pool its reads must not queue
        # behind appends. Reads are single statements, so holding it pins no snapshot.
        outage = OutageLog(log, "log tailer read")
        while self._running:
            try:
                async with self._db.acquire() as conn:
                    while self._running:
                        self._wake.clear()
                        await self._read_to_head(conn)
                        outage.succeeded()
                        await wait_set(self._wake, self._poll_interval_s)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                outage.failed(exc)
                await asyncio.sleep(_backoff(self._poll_interval_s, outage.failures))

    async def _read_to_head(self, conn: Connection) -> None:
        while True:
            batch, more = await read_log_cut(conn, self._live, self._batch_size, LIVE_BATCH_BYTES)
            if batch:
                self._fan_out(batch)
            if not more:
                self._head_reached_at = time.monotonic()
                return

    def _fan_out(self, batch: list[RecordedEvent]) -> None:
        # Runs without an await: registration and the live point move together (see _stream).
        self._live = batch[-1].point
        self.events_fanned_out += len(batch)
        for listener in list(self._batch_listeners):
            try:
                listener(batch)
            except Exception:
                log.exception("log tailer batch listener failed")
        if not self._subs:
            return
        for sub in list(self._subs.get(None, ())):
            self._offer(sub, None, batch)
        if len(self._subs) > (1 if None in self._subs else 0):
            by_ws: dict[str, list[RecordedEvent]] = {}
            for event in batch:
                by_ws.setdefault(event.workspace_id, []).append(event)
            for ws, events in by_ws.items():
                for sub in list(self._subs.get(ws, ())):
                    self._offer(sub, ws, events)

    def _offer(self, sub: _Subscription, ws: str | None, events: list[RecordedEvent]) -> None:
        sub.offer(events)
        if sub.overflowed:
            # Cut off: it gets nothing more; a live subscriber raises SubscriberTooSlow, one
            # still reading history re-registers (see _stream).
            self._unregister(sub, ws)
            if sub.live:
                self.cut_off_total += 1
