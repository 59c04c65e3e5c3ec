"""The fan-out behind the SSE feeds: the process's log tailer to every open feed connection.

ARCHITECTURE.md decision 4, at a thousand connections. The tailer hands each batch it reads
to `FeedFanout` (one per application), which keeps the open connections in a dict by
workspace, so routing an event is one dict lookup whatever the number of connections. Batches
are gathered into a *round*, flushed at most every `flush_interval_s` (at once when the last
flush is older than that): per round and per workspace, each event's frame comes from the
process's `FrameCache` (redacted and serialised once), and the frames a given feed filter
selects are joined into one payload, HTTP-chunk-framed once, then written with one
`transport.write` to every live connection with that filter. A live connection costs no
database read, no task wake-up and no serialisation per event.

A connection that starts behind the tailer's live point catches up on its own: it reads the
log from the database, scoped to its workspace (and types) in the query, while the fan-out
queues what arrives meanwhile in its bounded `pending` list; then it joins the live writes.
Handoff without gap or duplicate is the tailer's rule (`LogTailer.add_batch_listener`): the
connection is registered before it reads history, so every event after the live point at
registration reaches `pending`, and history read after registration covers everything up to
that point; events at or before the connection's `point` are dropped on either side. If
`pending` overflows during catch-up it is reset and history read again from `point`.

Slow consumers: a live connection's only buffer is its transport's. One holding more than
`max_buffer_bytes` unsent, or whose socket took none of its unsent data for `write_timeout_s`
(a client that reads slowly but steadily, a large frame over a slow link, is not one), is cut
off: it gets a final `event: feed_error` frame with the cursor of the last event written to it,
after the events already buffered, and its socket is aborted if that does not drain within
`write_timeout_s`. Nothing ever waits for it. A sweep every `tick_s` sends heartbeats to idle
connections and notices closed sockets.

Credentials: a feed is authorised when it opens, and its credential is checked again by every
sweep (and at once on `recheck_soon`, for a revocation made in this process), one check per
distinct credential, under the rules of a new request. A feed whose credential is refused
(revoked, expired, its user deactivated, its rights withdrawn) gets a final `event: feed_error`
frame with the refusal and its cursor, and nothing after it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Literal

from aiohttp import hdrs, web

from eventstore.cursor import LogPoint, decode_cursor
from eventstore.records import RecordedEvent
from eventstore.tailer import LogTailer, SubscriberTooSlow
from eventstore.tasks import cancel_and_wait
from gateway.cursor_seal import CursorSeal
from gateway.errors import abort_connection, internal_failure
from gateway.feed_frames import FEED_ERROR_EVENT, HEARTBEAT_FRAME, FrameCache, closing_frame
from schemas.errors import RateLimited, SvcError, Unavailable

log = logging.getLogger(__name__)

EndReason = Literal["shutdown", "too_slow", "unauthorized", "failed", "gone"]

SHUTDOWN_ERROR = Unavailable(
    "the service is shutting down; reconnect with the last cursor to resume", code="shutdown"
)


CATCH_UP_FIRST_PAGE = 100
CATCH_UP_MIN_PAGE = 8
CATCH_UP_MAX_PAGE = 1000
CATCH_UP_PAGE_BYTES = 4 * 1024 * 1024
"""A catching-up feed reads history in pages of about this many bytes of frames (as many
events as the last page's frames averaged, within the bounds above), each page also cut at
this many bytes of the events' stored data, and writes them in pieces of about
CATCH_UP_WRITE_BYTES: its memory stays near these however large the events."""
CATCH_UP_WRITE_BYTES = 1024 * 1024


@dataclass(frozen=True, slots=True)
class FeedFilter:
    """What one connection receives: its workspace's events that the feed selects and, when
    `types` is given, of those types. Connections with equal `key`s share payloads."""

    workspace_id: str
    feed: str
    selects: Callable[[RecordedEvent], bool]
    types: frozenset[str] | None = None

    @property
    def key(self) -> tuple[str, frozenset[str] | None]:
        return (self.feed, self.types)

    def accepts(self, event: RecordedEvent) -> bool:
        return (self.types is None or event.type in self.types) and self.selects(event)


@dataclass(frozen=True, slots=True, eq=False)
class Credential:
    """What opened a feed, to be checked again while it is open. `check` raises the
    `SvcError` a new request with this credential would get (401, 403) once it is no longer
    accepted; feeds whose credentials have equal `key`s share one check."""

    key: Hashable
    check: Callable[[], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Payload:
    """Bytes for the socket, in both body framings: raw (HTTP/1.0, close-delimited) and as
    one HTTP/1.1 chunk. Built once per round and filter, written to many connections."""

    raw: bytes
    chunk: bytes

    @classmethod
    def of(cls, raw: bytes) -> Payload:
        return cls(raw, b"%x\r\n%b\r\n" % (len(raw), raw))


class Outlet:
    """Direct writes to a feed's socket, below aiohttp's per-response writer so that one
    round costs one non-blocking `transport.write` per connection. Valid only once the
    response's headers went out (after its first `resp.write`); feeds are never compressed
    (sse.py sets `no-transform`), so the body is the frames as they are, chunk-framed under
    HTTP/1.1."""

    __slots__ = ("chunked", "transport", "writer")

    def __init__(self, request: web.Request, resp: web.StreamResponse) -> None:
        if resp.headers.get(hdrs.CONTENT_ENCODING):
            raise ValueError("an SSE feed is never content-encoded")
        transport = request.transport
        if transport is None:
            raise ConnectionResetError("the feed's connection is already closed")
        self.transport = transport
        self.writer = request.writer
        self.chunked = resp.headers.get(hdrs.TRANSFER_ENCODING, "").lower() == "chunked"

    def send(self, payload: Payload) -> None:
        data = payload.chunk if self.chunked else payload.raw
        self.transport.write(data)
        # Counted as the response's writer counts its own writes: the access log's size.
        self.writer.output_size += len(data)

    @property
    def unsent(self) -> int:
        return self.transport.get_write_buffer_size()

    @property
    def taken(self) -> int:
        """Bytes of the response the socket has taken so far: grows while the client reads,
        however slowly."""
        return self.writer.output_size - self.transport.get_write_buffer_size()

    @property
    def closing(self) -> bool:
        return self.transport.is_closing()


class FeedConnection:
    """One open feed. `point`/`cursor` are the newest log point it has consumed (written, or
    skipped by its filter); `pending` is its catch-up queue, None once it is live."""

    __slots__ = (
        "credential",
        "cursor",
        "end_error",
        "ended",
        "filter",
        "final_sent",
        "last_write",
        "outlet",
        "overflowed",
        "pending",
        "pending_bytes",
        "pending_through",
        "point",
        "taken_before",
        "unsent_since",
    )

    def __init__(
        self,
        feed_filter: FeedFilter,
        credential: Credential,
        outlet: Outlet,
        cursor: str,
        now: float,
    ) -> None:
        self.filter = feed_filter
        self.credential = credential
        self.outlet = outlet
        self.cursor = cursor
        self.point: LogPoint = decode_cursor(cursor)
        self.pending: list[RecordedEvent] | None = []
        self.pending_bytes = 0
        self.pending_through: tuple[LogPoint, str] | None = None
        """The last event the queue has seen, selected or not: consumed once it is written."""
        self.overflowed = False
        self.ended: asyncio.Future[EndReason] = asyncio.get_running_loop().create_future()
        self.end_error: SvcError | None = None  # what ended it: a refusal, a failed read
        self.final_sent = False
        self.last_write = now
        self.unsent_since: float | None = None
        """Since when the socket has taken none of the unsent data (None: nothing unsent)."""
        self.taken_before = 0
        """`outlet.taken` when `unsent_since` was last set."""

    def consumed(self, point: LogPoint, cursor: str) -> None:
        self.point = point
        self.cursor = cursor


class FeedFanout:
    def __init__(self, cursors: CursorSeal) -> None:
        self.cursors = cursors
        self.frames = FrameCache(cursors)
        # A round's cost is about one socket write per connection. The interval between
        # rounds is the last round's cost over `flush_duty`, within the bounds: with a few
        # connections events go out at once; with thousands, rounds batch more events each so
        # that the fan-out keeps to about a quarter of the process's time, and it self-adjusts
        # when the machine is busy.
        self.min_flush_interval_s = 0.002
        self.max_flush_interval_s = 0.025
        self.flush_duty = 0.25
        self._flush_interval_s = self.min_flush_interval_s
        self.heartbeat_s = 15.0
        self.tick_s = 5.0
        self.write_timeout_s = 10.0
        self.max_buffer_bytes = 4 * 1024 * 1024
        self.max_pending = 10_000
        self.max_pending_bytes = 16 * 1024 * 1024
        self.recheck_concurrency = 8
        # Feeds reading history from the database at once: each read holds a pooled
        # connection, and a thousand clients reconnecting after a restart would otherwise
        # take the whole pool from the chat turns. Only the read holds a slot, not the
        # writing of its page: a client that reads slowly (and so is never cut off) must not
        # keep other feeds, of any workspace, from catching up.
        self.catch_up_concurrency = 8
        self._catch_up_slots: asyncio.Semaphore | None = None
        self._by_owner: Counter[Hashable] = Counter()
        self._place_freed = asyncio.Event()
        # How long a feed over its owner's places waits for the places of feeds whose
        # clients are gone to be given back (their handlers end within a few loop turns).
        self.make_room_s = 1.0
        # A round waits this long for its checks; one still running then (a slow identity
        # provider, a busy pool) finishes on its own and its credential sits out later rounds
        # until it has, so one slow check never holds back every other feed's.
        self.recheck_round_s = 2.0
        # A check still running after this long is given up (and logged): it would otherwise
        # hold a slot of `recheck_concurrency` and keep its credential out of every later
        # round. Its feeds stay open, as on any failure of the check itself.
        self.check_timeout_s = 30.0
        self.shutting_down = False
        self.cut_off_total = 0
        self.unauthorized_total = 0
        self._by_ws: dict[str, set[FeedConnection]] = {}
        self._round: dict[str, list[RecordedEvent]] = {}
        self._flush_handle: asyncio.Handle | None = None
        self._last_flush = 0.0
        self._tailer: LogTailer | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._rechecker: asyncio.Task[None] | None = None
        self._recheck_again = False
        self._checks: dict[Hashable, asyncio.Task[None]] = {}  # running, by credential
        self._check_after: set[Hashable] = set()  # credentials owed a check once theirs ends
        self._check_limit: asyncio.Semaphore | None = None

    @property
    def connection_count(self) -> int:
        return sum(len(conns) for conns in self._by_ws.values())

    def attach(self, tailer: LogTailer) -> None:
        """Start receiving the tailer's batches (idempotent; done on the first feed)."""
        if self._tailer is tailer or self.shutting_down:
            return
        self._tailer = tailer
        tailer.add_batch_listener(self._on_batch)
        self._sweeper = asyncio.create_task(self._sweep(), name="svc-feed-sweeper")

    def close_all(self) -> None:
        """Graceful shutdown: every feed gets a final `shutdown` frame with its cursor."""
        self.shutting_down = True
        if self._tailer is not None:
            self._tailer.remove_batch_listener(self._on_batch)
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._rechecker is not None:
            self._rechecker.cancel()
        for check in self._checks.values():
            check.cancel()
        self._flush()
        for conns in list(self._by_ws.values()):
            for conn in list(conns):
                self._end(conn, "shutdown")

    async def make_room(self, owner: Hashable, most: int) -> None:
        """Before `admitted` of an owner at its `most` places: ends the feeds whose clients
        are gone (a socket closed, that the sweep would find within `tick_s`), and waits
        a moment for their places. A browser reconnects 3 s after its connection dropped,
        before the sweep has freed the place of the feed it dropped, and an EventSource
        answered 429 never tries again: the feed would be over for good."""
        if not most or self._by_owner[owner] < most:
            return
        for conns in list(self._by_ws.values()):
            for conn in list(conns):
                if conn.outlet.closing:
                    self._end(conn, "gone")
        with suppress(TimeoutError):
            async with asyncio.timeout(self.make_room_s):
                while self._by_owner[owner] >= most:
                    freed = self._place_freed
                    await freed.wait()

    def _free_place(self, owner: Hashable) -> None:
        self._by_owner[owner] -= 1
        if not self._by_owner[owner]:
            del self._by_owner[owner]
        # Wakes every wait of `make_room`; later waits take a new event.
        self._place_freed.set()
        self._place_freed = asyncio.Event()

    @contextmanager
    def admitted(self, owner: Hashable, most: int) -> Iterator[None]:
        """One of `owner`'s `most` places (0: no bound) while its feed is open; 429
        `too_many_feeds` when every one is taken (before the response starts, so the client
        gets the envelope). Each feed holds a socket, and one catching up a page of history
        and a send buffer of megabytes: without a bound one member's script could open
        thousands and take the process's memory."""
        if most and self._by_owner[owner] >= most:
            raise RateLimited(
                f"{most} feeds of this user or key are open on this gateway already, the "
                "most it serves one owner at once (SVC_FEEDS_PER_OWNER); close one (each "
                "browser tab or consumer holds one) and connect again",
                code="too_many_feeds",
                retry_after_s=self.tick_s,
            )
        self._by_owner[owner] += 1
        try:
            yield
        finally:
            self._free_place(owner)

    # -- one connection ---------------------------------------------------------------------

    async def serve(
        self,
        request: web.Request,
        resp: web.StreamResponse,
        feed_filter: FeedFilter,
        credential: Credential,
        cursor: str,
    ) -> None:
        """Run one feed from `cursor` until it ends; `resp` is prepared and has been written
        to. Raises ConnectionError or TimeoutError when the client goes away mid-catch-up."""
        loop = asyncio.get_running_loop()
        outlet = Outlet(request, resp)
        conn = FeedConnection(feed_filter, credential, outlet, cursor, loop.time())
        self._add(conn)
        try:
            if self.shutting_down or self._tailer is None:
                self._end(conn, "shutdown")
            else:
                await self._catch_up_or_end(request, conn, resp, self._tailer)
            reason = await conn.ended
            if reason != "gone":
                await self._finish(request, resp, conn, reason)
        finally:
            self._remove(conn)

    async def _catch_up_or_end(
        self,
        request: web.Request,
        conn: FeedConnection,
        resp: web.StreamResponse,
        tailer: LogTailer,
    ) -> None:
        """`_catch_up`, ending the feed with its final frame when that cannot go on. The
        response's headers are long sent, so no error may escape to the HTTP layer, which
        would write a second response into the event stream."""
        try:
            await self._catch_up(conn, resp, tailer)
        except TimeoutError:
            # The socket took nothing for write_timeout_s: cut off as on the live path.
            self._end(conn, "too_slow")
        except SvcError as exc:
            # The history read failed: the database is out or the pool exhausted (a 503 the
            # client may read), or anything else (a 500: logged, and named to it by an id).
            failure = (
                exc if exc.http_status != 500 else internal_failure("feed catch-up", exc, request)
            )
            self._end(conn, "failed", failure)

    async def _catch_up(
        self, conn: FeedConnection, resp: web.StreamResponse, tailer: LogTailer
    ) -> None:
        """History from the database, then what queued meanwhile, then live (see the module
        docstring for the handoff)."""
        while not conn.ended.done():
            conn.pending, conn.pending_bytes, conn.overflowed = [], 0, False
            conn.pending_through = None
            if conn.point < tailer.live_point:
                await self._read_history(conn, resp, tailer)
                if conn.ended.done():
                    return
            while conn.pending_through and not conn.overflowed and not conn.ended.done():
                queued, through = conn.pending, conn.pending_through
                conn.pending, conn.pending_bytes, conn.pending_through = [], 0, None
                await self._write_catch_up(conn, resp, queued or [])
                if through[0] > conn.point and not conn.ended.done():
                    conn.consumed(*through)  # past the queued events its filter passed over
            if not conn.overflowed:
                # No await since `pending` was seen empty: from here the rounds write to it.
                conn.pending = None
                return

    async def _read_history(
        self, conn: FeedConnection, resp: web.StreamResponse, tailer: LogTailer
    ) -> None:
        """The log after `conn.point` up to a short page, written as it is read. Pages are
        sized by the bytes the last one wrote: a page of a thousand messages of a megabyte
        each held a gigabyte per feed catching up."""
        types = sorted(conn.filter.types) if conn.filter.types else None
        limit = CATCH_UP_FIRST_PAGE
        if self._catch_up_slots is None:
            self._catch_up_slots = asyncio.Semaphore(self.catch_up_concurrency)
        while not conn.ended.done():
            read = self._history_page(conn, tailer, types, limit)
            page, more = await self._heartbeating(conn, resp, asyncio.create_task(read))
            written, frames = await self._write_catch_up(conn, resp, page)
            if not more:
                return
            if frames:  # else nothing to go by: the same size again
                # The frames' average stands for the page's events: the ones the feed does
                # not select (not its kind of event) are not framed, so not measured. At most
                # double the last size: small events met so far say little of what follows.
                per_event = max(1, written // frames)
                grown = min(CATCH_UP_PAGE_BYTES // per_event, 2 * limit, CATCH_UP_MAX_PAGE)
                limit = max(CATCH_UP_MIN_PAGE, grown)

    async def _history_page(
        self, conn: FeedConnection, tailer: LogTailer, types: list[str] | None, limit: int
    ) -> tuple[list[RecordedEvent], bool]:
        """A page cut by count (sized by what the last one wrote) and by stored bytes: the
        count comes from events met so far, and a run of large ones after small ones would
        otherwise fill a page sized for the small."""
        assert self._catch_up_slots is not None
        async with self._catch_up_slots:
            ws = conn.filter.workspace_id
            return await tailer.history_page(conn.point, ws, types, limit, CATCH_UP_PAGE_BYTES)

    async def _heartbeating(
        self,
        conn: FeedConnection,
        resp: web.StreamResponse,
        read: asyncio.Task[tuple[list[RecordedEvent], bool]],
    ) -> tuple[list[RecordedEvent], bool]:
        """`read`'s page, with a heartbeat after each `heartbeat_s` of silence meanwhile: the
        sweep's heartbeats skip a feed catching up (its writes are the catch-up's own), and
        a feed waiting for a catch-up slot behind a crowd of reconnecting clients, or for a
        slow read, would otherwise look dead to a proxy's idle timeout."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                quiet_s = loop.time() - conn.last_write
                await asyncio.wait(
                    (read, conn.ended),
                    timeout=max(0.0, self.heartbeat_s - quiet_s),
                    return_when=asyncio.FIRST_COMPLETED,
                )
                if read.done():
                    return read.result()
                if conn.ended.done():  # shut down or refused meanwhile: no page, no beats
                    return [], False
                await self._write_chunk(conn, resp, [HEARTBEAT_FRAME])
        finally:
            if read.done():
                if not read.cancelled():
                    read.exception()  # retrieved: a write's error is the one that goes on
            else:
                await cancel_and_wait(read)

    async def _write_catch_up(
        self, conn: FeedConnection, resp: web.StreamResponse, events: list[RecordedEvent]
    ) -> tuple[int, int]:
        """Write the frames of `events` past `conn.point`, in writes of about
        CATCH_UP_WRITE_BYTES; returns the bytes and the frames written."""
        written = frames = 0
        chunk: list[bytes] = []
        size = 0
        for event in events:
            if event.point <= conn.point or conn.ended.done():
                continue
            if conn.filter.accepts(event):
                frame = self.frames.frame(event)
                chunk.append(frame)
                size += len(frame)
                frames += 1
            # Consumed before the write, with no await between them: once write() is entered
            # its bytes are in the transport's buffer and reach the client ahead of any final
            # frame (the timeout can only cut the drain short), so that frame's cursor must be
            # past them, or a resume repeats them. (The connection can only end during an
            # await, so the frames consumed since the last write are all written.)
            conn.consumed(event.point, event.cursor)
            if size >= CATCH_UP_WRITE_BYTES:
                written += await self._write_chunk(conn, resp, chunk)
                chunk, size = [], 0
        if chunk:
            written += await self._write_chunk(conn, resp, chunk)
        return written, frames

    async def _write_chunk(
        self, conn: FeedConnection, resp: web.StreamResponse, frames: list[bytes]
    ) -> int:
        payload = b"".join(frames)
        await self._written(conn, asyncio.create_task(resp.write(payload)))
        conn.last_write = asyncio.get_running_loop().time()
        return len(payload)

    async def _written(self, conn: FeedConnection, write: asyncio.Task[None]) -> None:
        """Until `write` drains; TimeoutError once the socket takes nothing of it for
        `write_timeout_s`. A whole piece (a megabyte, or one large event) need not drain in
        that time: a client on a slow link that reads steadily was cut off at every attempt
        and never got past the event."""
        await asyncio.sleep(0)  # the write hands its bytes to the socket first: no progress
        taken = conn.outlet.taken
        try:
            while True:
                await asyncio.wait(
                    (write, conn.ended),
                    timeout=self.write_timeout_s,
                    return_when=asyncio.FIRST_COMPLETED,
                )
                if write.done():
                    write.result()
                    return
                if conn.ended.done():
                    return  # shut down, or refused: its final frame follows what is queued
                if conn.outlet.taken <= taken:
                    raise TimeoutError
                taken = conn.outlet.taken
        finally:
            if not write.done():
                await cancel_and_wait(write)  # its bytes are the transport's: only the wait ends

    async def _finish(
        self,
        request: web.Request,
        resp: web.StreamResponse,
        conn: FeedConnection,
        reason: EndReason,
    ) -> None:
        """Make sure the final frame is written, then wait for the socket to take it."""
        try:
            async with asyncio.timeout(self.write_timeout_s):
                if not conn.final_sent:
                    error = _closing_error(conn, reason)
                    await resp.write(self._closing_frame(conn, reason, error))
                await resp.write_eof()
        except TimeoutError:
            abort_connection(request)  # its socket accepts nothing more
        except ConnectionError:
            pass

    def _closing_frame(self, conn: FeedConnection, reason: EndReason, error: SvcError) -> bytes:
        return closing_frame(_closing_event(reason), self.cursors.seal(conn.cursor), error)

    def _add(self, conn: FeedConnection) -> None:
        self._by_ws.setdefault(conn.filter.workspace_id, set()).add(conn)

    def _remove(self, conn: FeedConnection) -> None:
        conns = self._by_ws.get(conn.filter.workspace_id)
        if conns is not None:
            conns.discard(conn)
            if not conns:
                del self._by_ws[conn.filter.workspace_id]

    def _end(self, conn: FeedConnection, reason: EndReason, error: SvcError | None = None) -> None:
        """Stop writing to `conn`; a live one gets its final frame here, in order after
        everything already written (a catching-up one gets it from its own task). `error` is
        the refusal of an unauthorized one or the failure that ended a catch-up."""
        if conn.ended.done():
            return
        self._remove(conn)
        conn.end_error = error
        if reason == "too_slow":
            self.cut_off_total += 1
        elif reason == "unauthorized":
            self.unauthorized_total += 1
        if reason != "gone" and conn.pending is None and not conn.outlet.closing:
            final = _closing_error(conn, reason)
            conn.outlet.send(Payload.of(self._closing_frame(conn, reason, final)))
            conn.final_sent = True
        conn.ended.set_result(reason)

    # -- rounds -----------------------------------------------------------------------------

    def _on_batch(self, batch: Sequence[RecordedEvent]) -> None:
        by_ws, pending = self._by_ws, self._round
        for event in batch:
            if event.workspace_id in by_ws:
                pending.setdefault(event.workspace_id, []).append(event)
        if pending and self._flush_handle is None:
            loop = asyncio.get_running_loop()
            delay = self._last_flush + self._flush_interval_s - loop.time()
            if delay > 0:
                self._flush_handle = loop.call_later(delay, self._flush)
            else:
                self._flush_handle = loop.call_soon(self._flush)

    def _flush(self) -> None:
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        if not self._round:
            return
        round_, self._round = self._round, {}
        loop = asyncio.get_running_loop()
        now = self._last_flush = loop.time()
        for ws, events in round_.items():
            conns = self._by_ws.get(ws)
            if conns:
                self._deliver(list(conns), events, now)
        cost = loop.time() - now
        self._flush_interval_s = min(
            self.max_flush_interval_s, max(self.min_flush_interval_s, cost / self.flush_duty)
        )

    def _deliver(
        self, conns: list[FeedConnection], events: list[RecordedEvent], now: float
    ) -> None:
        """One workspace's events of a round to its connections, payload built once per
        filter. A connection already past the round's first event (it just caught up) gets
        only the events after its point."""
        first, last = events[0].point, (events[-1].point, events[-1].cursor)
        payloads: dict[tuple[str, frozenset[str] | None], Payload | None] = {}
        for conn in conns:
            if conn.pending is not None:
                self._queue(conn, events)
                continue
            if conn.point < first:
                key = conn.filter.key
                if key in payloads:
                    payload = payloads[key]
                else:
                    payload = payloads[key] = self._payload(conn.filter, events)
            else:
                fresh = [event for event in events if event.point > conn.point]
                if not fresh:
                    continue
                payload = self._payload(conn.filter, fresh)
            self._write_live(conn, payload, *last, now)

    def _payload(self, feed_filter: FeedFilter, events: list[RecordedEvent]) -> Payload | None:
        frames = [self.frames.frame(event) for event in events if feed_filter.accepts(event)]
        return Payload.of(b"".join(frames)) if frames else None

    def _write_live(
        self,
        conn: FeedConnection,
        payload: Payload | None,
        last_point: LogPoint,
        last_cursor: str,
        now: float,
    ) -> None:
        outlet = conn.outlet
        if outlet.closing:
            self._end(conn, "gone")
            return
        if payload is not None:
            if outlet.unsent > self.max_buffer_bytes:
                self._end(conn, "too_slow")
                return
            outlet.send(payload)
            conn.last_write = now
        conn.consumed(last_point, last_cursor)

    def _queue(self, conn: FeedConnection, events: list[RecordedEvent]) -> None:
        """Keep what a catching-up feed will write: the events its filter selects, bounded by
        count and by the bytes of their frames (a slow catch-up under large messages held
        ten thousand of them), and the point of the last one seen."""
        pending = conn.pending
        assert pending is not None
        if conn.overflowed:
            return
        selected = [event for event in events if conn.filter.accepts(event)]
        size = sum(len(self.frames.frame(event)) for event in selected)
        conn.pending_through = (events[-1].point, events[-1].cursor)
        over_count = len(pending) + len(selected) > self.max_pending
        if over_count or conn.pending_bytes + size > self.max_pending_bytes:
            # The catch-up reads history again from its point (see _catch_up).
            conn.overflowed = True
            pending.clear()
            conn.pending_bytes = 0
        else:
            pending.extend(selected)
            conn.pending_bytes += size

    # -- heartbeats and stalled sockets -----------------------------------------------------

    async def _sweep(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.tick_s)
            now = loop.time()
            for conns in list(self._by_ws.values()):
                for conn in list(conns):
                    if conn.pending is None:
                        self._check(conn, now)
            self.recheck_soon()

    def _check(self, conn: FeedConnection, now: float) -> None:
        outlet = conn.outlet
        if outlet.closing:
            self._end(conn, "gone")
            return
        if outlet.unsent:
            taken = outlet.taken
            if conn.unsent_since is None or taken > conn.taken_before:
                # Nothing was waiting before, or the client took some since: it keeps up,
                # however slowly (`max_buffer_bytes` bounds what it may fall behind).
                conn.unsent_since, conn.taken_before = now, taken
            elif now - conn.unsent_since >= self.write_timeout_s:
                log.info("feed cut off: its client took nothing for %.0f s", self.write_timeout_s)
                self._end(conn, "too_slow")
            return
        conn.unsent_since = None
        if now - conn.last_write >= self.heartbeat_s:
            outlet.send(HEARTBEAT)
            conn.last_write = now

    # -- credentials ------------------------------------------------------------------------

    def recheck_soon(self) -> None:
        """Check every open feed's credential again, now (a check already running may have
        read the state before a revocation, so one more follows it)."""
        self._recheck_again = True
        if self._connections_open() and (self._rechecker is None or self._rechecker.done()):
            self._rechecker = asyncio.create_task(self._recheck(), name="svc-feed-recheck")

    def _connections_open(self) -> bool:
        return bool(self._by_ws) and not self.shutting_down

    async def _recheck(self) -> None:
        if self._check_limit is None:
            self._check_limit = asyncio.Semaphore(self.recheck_concurrency)
        while self._recheck_again and self._connections_open():
            self._recheck_again = False
            by_credential: dict[Hashable, list[FeedConnection]] = {}
            for conns in self._by_ws.values():
                for conn in conns:
                    by_credential.setdefault(conn.credential.key, []).append(conn)
            started = []
            for key, holders in by_credential.items():
                if key in self._checks:
                    # A check from an earlier round still runs; it may have read the state
                    # before what asked for this round, so another follows when it ends.
                    self._check_after.add(key)
                    continue
                check = asyncio.create_task(self._recheck_one(holders, self._check_limit))
                self._checks[key] = check
                check.add_done_callback(functools.partial(self._check_done, key))
                started.append(check)
            if started:
                await asyncio.wait(started, timeout=self.recheck_round_s)

    def _check_done(self, key: Hashable, check: asyncio.Task[None]) -> None:
        if self._checks.get(key) is check:
            del self._checks[key]
        if key in self._check_after and not check.cancelled():
            self._check_after.discard(key)
            self.recheck_soon()

    async def _recheck_one(self, conns: list[FeedConnection], limit: asyncio.Semaphore) -> None:
        """One credential's check; its feeds end only on a refusal of the credential (401,
        403), never because the check itself failed (the database briefly out, say)."""
        async with limit:
            try:
                async with asyncio.timeout(self.check_timeout_s):
                    await conns[0].credential.check()
            except TimeoutError:
                log.warning("feed credential check gave up after %.0f s", self.check_timeout_s)
            except SvcError as exc:
                if exc.http_status not in (401, 403):
                    log.warning("feed credential check failed: %s", exc.message)
                    return
                for conn in conns:
                    self._end(conn, "unauthorized", exc)
            except Exception as exc:
                log.warning("feed credential check failed: %r", exc)


HEARTBEAT = Payload.of(HEARTBEAT_FRAME)


def _closing_event(reason: EndReason) -> str:
    return "shutdown" if reason == "shutdown" else FEED_ERROR_EVENT


def _closing_error(conn: FeedConnection, reason: EndReason) -> SvcError:
    if conn.end_error is not None:
        return conn.end_error
    return SubscriberTooSlow(conn.cursor) if reason == "too_slow" else SHUTDOWN_ERROR
