"""Which process each host runs in, as the router last saw it: restart detection.

When a host process dies, a Ray call that was in flight to it (or sent while Ray was
restarting it) does not fail at once: Ray answers `ActorUnavailableError` only after its own
timeouts, measured here at 0.5 to 1.5 s after the restarted host was already answering. A
ping sent while the host restarts, on the other hand, is queued by Ray and answered by the new
process as soon as it is up. So the router pings every host often (`poll`, fire and forget)
and, when a ping comes back from a different process id, abandons every command attempt still
waiting on the old process (`Attempts`) and resolves the host's `restarted` future (retries
backing off wake up): they are retried at once against the new one. Abandoning is safe for
the same reason any retry is (the command id is the ledger key), and certain: the process the
attempt went to is gone.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import ray.exceptions

T = TypeVar("T")
log = logging.getLogger(__name__)

# Raised by Ray when the host process is dead, restarting or unreachable, or (ValueError) when
# a named host does not exist (yet): nothing a retry against the current map can't fix.
HOST_ERRORS: tuple[type[BaseException], ...] = (
    ray.exceptions.RayActorError,
    ray.exceptions.ActorUnavailableError,
    ray.exceptions.ObjectLostError,
    ValueError,
)
HOST_ERRORS_OR_TIMEOUT: tuple[type[BaseException], ...] = (TimeoutError, *HOST_ERRORS)


async def answer_within(timeout_s: float, ref: Any) -> Any:
    """The result of the remote call `ref`; TimeoutError after `timeout_s`. (Not
    `asyncio.wait_for`: see eventstore/tasks.py.)"""
    async with asyncio.timeout(timeout_s):
        return await ref


def _ignore(_host: str) -> None:
    pass


class HostRestarted(Exception):
    """The process a command attempt went to was replaced, or the attempt's shard moved away
    from its host: the attempt will never answer usefully."""


class Attempts:
    """Command attempts in flight, by host and by shard, so they can be abandoned.

    Costs two set operations per attempt, nothing shared to wait on: a future every attempt
    awaited would cost each completion a scan of a thousand callbacks at high concurrency."""

    def __init__(self) -> None:
        self._by_key: defaultdict[str | int, set[asyncio.Future[Any]]] = defaultdict(set)
        self._abandoned: set[asyncio.Future[Any]] = set()

    async def answer(self, host: str, shard: int, ref: Any) -> Any:
        """Await the attempt `ref`; HostRestarted if `abandon(host)` or `abandon(shard)` is
        called meanwhile (a lost node: Ray fails calls to it only after its own timeouts)."""
        return await self.step(host, shard, ref.as_future(_internal=True))

    async def step(self, host: str, shard: int, step: Awaitable[T]) -> T:
        """Await `step` of an attempt (an answer, or a stream's next part), abandoned as
        `answer` is."""
        call: asyncio.Future[T] = asyncio.ensure_future(step)
        tracked = (self._by_key[host], self._by_key[shard])
        for attempts in tracked:
            attempts.add(call)
        try:
            return await call
        except asyncio.CancelledError:
            if call in self._abandoned:
                raise HostRestarted(host) from None
            raise
        finally:
            for attempts in tracked:
                attempts.discard(call)
            self._abandoned.discard(call)

    def abandon(self, key: str | int) -> None:
        for call in self._by_key.pop(key, set()):
            if not call.done():
                self._abandoned.add(call)
                call.cancel()


class HostWatch:
    def __init__(self, attempts: Attempts, on_restart: Callable[[str], None] = _ignore) -> None:
        self._attempts = attempts
        self._on_restart = on_restart
        self._pids: dict[str, int] = {}
        self._restarted: dict[str, asyncio.Future[None]] = {}
        self._pinging: dict[str, int] = {}
        self._answered: dict[str, float] = {}
        # Pings run concurrently, so answers may arrive out of order: a late answer from a
        # process that has since died must not count after one from its replacement.
        self._sent: dict[str, int] = {}
        self._newest_answered: dict[str, int] = {}
        self._pings: set[asyncio.Task[None]] = set()

    def restarted(self, host: str) -> asyncio.Future[None]:
        """Resolves when `host` is next seen in a process other than the one known now."""
        future = self._restarted.get(host)
        if future is None or future.done():
            future = asyncio.get_running_loop().create_future()
            self._restarted[host] = future
        return future

    def answered_at(self, host: str) -> float | None:
        """Loop time of the host's latest answer to a watch ping."""
        return self._answered.get(host)

    def seen(self, host: str, pid: int) -> None:
        self._answered[host] = asyncio.get_running_loop().time()
        known = self._pids.get(host)
        self._pids[host] = pid
        if known is not None and known != pid:
            # The only word of it in the gateway's log: Ray reports the death in its own.
            log.warning(
                "actor host %s restarted (process %d is gone, %d answers now): the commands "
                "sent to the old process are sent again; a chat turn it was running is "
                "recorded as turn_abandoned once past its expiry (never by itself when "
                "SVC_LLM_CALL_TIMEOUT_S is 0: `svc conversations abandon`)",
                host,
                known,
                pid,
            )
            self._attempts.abandon(host)
            self._on_restart(host)
            future = self._restarted.pop(host, None)
            if future is not None and not future.done():
                future.set_result(None)

    def forget(self, host: str) -> None:
        self._pids.pop(host, None)
        self._answered.pop(host, None)
        # Attempts waiting on its `restarted` future keep waiting for their own answer.
        self._restarted.pop(host, None)

    def poll(self, host: str, handle: Any, timeout_s: float, max_pending: int) -> bool:
        """Ping `host` without waiting for the answer; True if sent. A ping to a dead process
        hangs until Ray gives up on it, so up to `max_pending` may be outstanding per host,
        and a new one still goes out while older ones hang."""
        if self._pinging.get(host, 0) >= max_pending:
            return False
        self._pinging[host] = self._pinging.get(host, 0) + 1
        ping = self._sent[host] = self._sent.get(host, 0) + 1
        task = asyncio.ensure_future(self._ping(host, handle, timeout_s, ping))
        self._pings.add(task)
        task.add_done_callback(lambda done: self._pinged(host, done))
        return True

    async def stop(self) -> None:
        """Cancel the pings still waiting (one to a dead host waits up to its timeout)."""
        pending = list(self._pings)
        for task in pending:
            task.cancel()
        if pending:  # bounded: a stop never waits on a host's answer
            await asyncio.wait(pending, timeout=1.0)

    async def _ping(self, host: str, handle: Any, timeout_s: float, ping: int) -> None:
        try:
            pid = await answer_within(timeout_s, handle.ping.remote())
        except HOST_ERRORS_OR_TIMEOUT:
            return  # dead, restarting or gone: the supervisor's pings judge liveness
        if ping < self._newest_answered.get(host, 0):
            return  # overtaken by a newer ping's answer
        self._newest_answered[host] = ping
        self.seen(host, pid)

    def _pinged(self, host: str, task: asyncio.Task[None]) -> None:
        self._pinging[host] -= 1
        self._pings.discard(task)

    async def until_restarted(self, host: str, timeout_s: float) -> None:
        """Sleep up to `timeout_s`, less if `host` is seen restarted meanwhile."""
        await asyncio.wait((self.restarted(host),), timeout=timeout_s)
