"""The calls a router waits on, for a stop that leaves the hosts running.

A router that joined a shared cluster does not stop its hosts when it stops: other routers
use them, and the commands this one sent run on there to their end and are recorded. Its
callers (HTTP handlers) still wait on their answers. `OpenCalls` lets those calls finish up
to the stop's deadline and then answers the rest with `AnswerAbandoned`, which tells the
client how to collect the result, instead of leaving them to the HTTP server, which would
cancel them and close their connections without a word.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from actors.errors import AnswerAbandoned

T = TypeVar("T")


class OpenCalls:
    def __init__(self) -> None:
        self._open = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._given_up = False
        # The steps being awaited, cancelled by `settle`: per call a set entry, not a waiter
        # on a shared future (each finished call would search that future's list of waiters:
        # the cost per call grew with the calls in flight).
        self._steps: set[asyncio.Future[Any]] = set()

    @contextmanager
    def opened(self) -> Iterator[None]:
        """One call (an ask, a tell or a stream) for as long as the block runs."""
        self._open += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._open -= 1
            if not self._open:
                self._idle.set()

    async def until_abandoned(self, step: Awaitable[T]) -> T:
        """`step` (an answer, or a stream's next part), unless `settle` gives the calls up
        first: then `AnswerAbandoned`. The step's own awaiting is cancelled, not the command:
        that runs in its host."""
        if self._given_up:
            if inspect.iscoroutine(step):
                step.close()  # never started: closed, not left unawaited
            raise AnswerAbandoned()
        waiting = asyncio.ensure_future(step)
        self._steps.add(waiting)
        try:
            return await waiting
        except asyncio.CancelledError:
            caller = asyncio.current_task()
            if self._given_up and waiting.cancelled() and not (caller and caller.cancelling()):
                raise AnswerAbandoned() from None
            raise
        finally:
            self._steps.discard(waiting)

    async def settle(self, deadline_s: float) -> tuple[int, int]:
        """Let the open calls end for up to `deadline_s`, then give up the rest. Returns how
        many ended and how many were given up (their commands go on in their hosts)."""
        at_start = self._open
        try:
            async with asyncio.timeout(max(0.0, deadline_s)):
                await self._idle.wait()
        except TimeoutError:
            pass
        left = self._open
        self._given_up = True
        for step in list(self._steps):
            step.cancel()
        return max(0, at_start - left), left
