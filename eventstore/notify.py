"""Commit wake-ups: an in-process after-commit signal plus PostgreSQL NOTIFY between processes.

ARCHITECTURE.md decision 4: readers of the log are woken right after a commit in this process,
and by a `NOTIFY` for commits made by other processes. The NOTIFY is sent after the commit,
never inside the append transaction: a NOTIFY inside the transaction takes a cluster-wide lock
at commit and serialises every writer. Many commits in one burst share one NOTIFY, sent on the
LISTEN connection the notifier holds (never queued behind appends for a pool connection). A
lost or late notification only costs latency: readers also poll (see tailer.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import uuid
from collections.abc import Callable
from typing import Any

import asyncpg

from eventstore.db import Connection, Database
from eventstore.outage_log import OutageLog, doubling_backoff
from eventstore.tasks import cancel_and_wait, wait_set

log = logging.getLogger(__name__)

Listener = Callable[[], None]

_CHANNEL = re.compile(r"[a-z_][a-z0-9_]{0,62}")
RECONNECT_CAP_S = 5.0
"""The longest wait between two attempts to listen again while the database is away."""


class CommitNotifier:
    def __init__(
        self,
        db: Database,
        channel: str = "svc_events",
        *,
        coalesce_s: float = 0.001,
        reconnect_s: float = 0.5,
        ping_s: float = 10.0,
    ) -> None:
        self._db = db
        self._channel = channel
        self._coalesce_s = coalesce_s
        self._reconnect_s = reconnect_s
        self._outage = OutageLog(log, f"LISTEN {channel} connection")
        self._ping_s = ping_s
        # A NOTIFY from this process also reaches its own LISTEN connection; the payload names
        # the sender so local listeners, already woken by committed(), are not woken twice.
        self._token = uuid.uuid4().hex
        if not _CHANNEL.fullmatch(channel):
            raise ValueError(f"notify channel must match {_CHANNEL.pattern}, got {channel!r}")
        # NOTIFY gives its transaction an xid, so its commit is a WAL flush like an append's.
        # Losing a wake-up in a crash costs nothing (readers poll), so it commits
        # asynchronously; one simple-protocol round trip.
        self._notify_sql = (
            "BEGIN; SET LOCAL synchronous_commit = off; "
            f"SELECT pg_notify('{channel}', '{self._token}'); COMMIT"
        )
        self._listeners: list[Listener] = []
        self._dirty = asyncio.Event()
        self._lost = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._listen_conn: Connection | None = None
        self._listen_lock = asyncio.Lock()
        self._running = False
        self.notifies_sent = 0
        self.notifies_received = 0
        self.listen_sessions = 0

    @property
    def channel(self) -> str:
        return self._channel

    @property
    def listening(self) -> bool:
        """True while the LISTEN connection is up (other processes' commits reach us)."""
        return self._listen_conn is not None and not _closed(self._listen_conn)

    def add_listener(self, cb: Listener) -> None:
        self._listeners.append(cb)

    def remove_listener(self, cb: Listener) -> None:
        with contextlib.suppress(ValueError):
            self._listeners.remove(cb)

    def committed(self) -> None:
        """Called after every commit in this process: wake local listeners, schedule a NOTIFY."""
        self._wake_local()
        if self._running:
            self._dirty.set()

    async def start(self) -> None:
        if self._running:
            return
        self._running = True
        self._tasks = [
            asyncio.create_task(self._send_loop(), name="svc-notify-send"),
            asyncio.create_task(self._listen_loop(), name="svc-notify-listen"),
        ]

    async def stop(self) -> None:
        self._running = False
        # Should a loop have lost its cancellation (see _send_notify), this wakes it to see
        # `_running` and end.
        self._dirty.set()
        self._lost.set()
        tasks, self._tasks = self._tasks, []
        await cancel_and_wait(*tasks)

    def _wake_local(self) -> None:
        for cb in list(self._listeners):
            try:
                cb()
            except Exception:
                log.exception("commit listener failed")

    async def _send_loop(self) -> None:
        while self._running:
            await self._dirty.wait()
            # Coalesce: commits landing in the next millisecond ride on this NOTIFY.
            await asyncio.sleep(self._coalesce_s)
            self._dirty.clear()
            try:
                await self._send_notify()
                self.notifies_sent += 1
            except Exception as exc:
                # Other processes fall back to their poll; nothing is lost.
                log.debug("NOTIFY %s failed: %r", self._channel, exc)

    async def _send_notify(self) -> None:
        # Sent on the LISTEN connection, which the notifier holds anyway: under a busy pool a
        # NOTIFY would otherwise queue for a connection behind the very appends it announces,
        # and every other process would hear of their commits that much later. The lock keeps
        # it from overlapping the liveness ping on the same connection.
        conn = self._listen_conn
        if conn is not None and not _closed(conn):
            # asyncio.timeout rather than wait_for: on Python 3.11, wait_for swallows a
            # cancellation that lands as the awaited call finishes, and stop() then waited
            # for this loop forever.
            try:
                async with asyncio.timeout(self._ping_s):
                    await self._on_listen_conn(conn, self._notify_sql)
            except TimeoutError:
                self._lost.set()  # half-open: the listener reconnects
                raise
            return
        async with self._db.acquire() as pooled:
            await pooled.execute(self._notify_sql)

    async def _listen_loop(self) -> None:
        while self._running:
            try:
                await self._listen_once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    # An error raised while unwinding a cancellation (e.g. on releasing the
                    # connection) must not turn stop() into an endless reconnect loop.
                    raise asyncio.CancelledError from exc
                self._outage.failed(exc)
            # Doubling while the database stays away, as the tailer's reads do.
            failures = self._outage.failures
            await asyncio.sleep(doubling_backoff(self._reconnect_s, RECONNECT_CAP_S, failures))

    async def _listen_once(self) -> None:
        # The LISTEN connection is borrowed from the pool for as long as it lives; releasing it
        # runs the pool's reset, which UNLISTENs.
        self._lost.clear()
        async with self._db.acquire() as conn:
            conn.add_termination_listener(self._on_terminated)
            try:
                await conn.add_listener(self._channel, self._on_notification)
                self._listen_conn = conn
                self.listen_sessions += 1
                self._outage.succeeded()
                # Commits made while we were not listening sent notifications nobody heard.
                self._wake_local()
                await self._watch(conn)
            finally:
                self._listen_conn = None
                # On a terminated connection asyncpg has already detached the pool's proxy,
                # and this raises InterfaceError, which would hide why the session ended.
                with contextlib.suppress(Exception):
                    conn.remove_termination_listener(self._on_terminated)
                if not _closed(conn):
                    # asyncpg warns about a connection released with a listener attached.
                    with contextlib.suppress(Exception):
                        async with asyncio.timeout(1.0):
                            await conn.remove_listener(self._channel, self._on_notification)

    async def _watch(self, conn: Connection) -> None:
        while self._running:
            await wait_set(self._lost, self._ping_s)
            if self._lost.is_set() or _closed(conn):
                return
            # A half-open TCP connection never reports termination; a ping does. The deadline
            # covers the wait for the lock too: a NOTIFY stuck on the same connection counts.
            async with asyncio.timeout(self._ping_s):
                await self._on_listen_conn(conn, "SELECT 1")

    async def _on_listen_conn(self, conn: Connection, sql: str) -> None:
        async with self._listen_lock:
            await conn.execute(sql)

    def _on_terminated(self, _conn: Any) -> None:
        self._lost.set()

    def _on_notification(self, _conn: Any, _pid: int, _channel: str, payload: str) -> None:
        if payload == self._token:
            return
        self.notifies_received += 1
        self._wake_local()


def _closed(conn: Connection) -> bool:
    """Whether the connection is gone. Once the server terminated it, the pool detaches it
    from its holder and every call on it raises InterfaceError, `is_closed` included."""
    try:
        return bool(conn.is_closed())
    except asyncpg.InterfaceError:
        return True
