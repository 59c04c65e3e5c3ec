"""Group requests that arrive while others are in flight into one round trip.

A durable commit costs a WAL flush and a round trip costs two context switches on each side;
on a small machine both dwarf the work of one append. The coalescer keeps at most `lanes`
sends in flight. A request that finds a lane free goes out at once, alone (no added latency
when the store is quiet); requests that arrive while every lane is busy wait in a queue and
leave together, up to `max_batch` at a time, in the order they arrived, as soon as a lane
frees up. Under load batches grow by themselves; nothing ever waits on a timer.

A caller that is cancelled before its request left is dropped from the queue (it was never
sent). One cancelled after its request left gets `CancelledError` while the send completes:
the outcome is unknown to it, as with any append interrupted mid-commit, and retrying with the
same command id is safe.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

Request = TypeVar("Request")
Result = TypeVar("Result")

BatchSender = Callable[[list[Request]], Awaitable[Sequence[Result | Exception]]]
"""Sends a batch; returns one result or one exception per request, in order. Raising fails
every request of the batch with that exception."""


class Coalescer(Generic[Request, Result]):
    def __init__(self, send: BatchSender[Request, Result], *, lanes: int, max_batch: int) -> None:
        if lanes < 1 or max_batch < 1:
            raise ValueError("a coalescer needs at least one lane and a batch of at least one")
        self._send = send
        self._lanes = lanes
        self._max_batch = max_batch
        self._pending: deque[tuple[Request, asyncio.Future[Result]]] = deque()
        self._busy_lanes = 0
        self._drains: set[asyncio.Task[None]] = set()

    async def submit(self, request: Request) -> Result:
        future: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        self._pending.append((request, future))
        if self._busy_lanes < self._lanes:
            self._busy_lanes += 1
            drain = asyncio.create_task(self._drain())
            self._drains.add(drain)
            drain.add_done_callback(self._drains.discard)
        return await future

    async def wait_idle(self) -> None:
        """Wait until every request submitted so far has been sent and answered. A waiter
        cancelled (a shutdown step out of time) stops waiting; the sends go on, and their
        callers get their answers (`asyncio.gather` would have cancelled them too)."""
        while self._drains:
            await asyncio.wait(set(self._drains))

    async def _drain(self) -> None:
        try:
            while batch := self._take_batch():
                await self._send_batch(batch)
        except asyncio.CancelledError:
            if self._busy_lanes == 1:  # the last lane: nothing is left to send what waits
                for _, future in self._pending:
                    future.cancel()
                self._pending.clear()
            raise
        finally:
            self._busy_lanes -= 1

    def _take_batch(self) -> list[tuple[Request, asyncio.Future[Result]]]:
        batch: list[tuple[Request, asyncio.Future[Result]]] = []
        while self._pending and len(batch) < self._max_batch:
            request, future = self._pending.popleft()
            if not future.done():  # a caller cancelled while queued: never sent
                batch.append((request, future))
        return batch

    async def _send_batch(self, batch: list[tuple[Request, asyncio.Future[Result]]]) -> None:
        try:
            outcomes = await self._send([request for request, _ in batch])
            if len(outcomes) != len(batch):
                raise RuntimeError(f"a batch of {len(batch)} got {len(outcomes)} outcomes")
        except asyncio.CancelledError:  # the drain itself was cancelled (loop teardown)
            for _, future in batch:
                future.cancel()
            raise
        except Exception as exc:  # the whole batch failed: every caller learns why
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        for (_, future), outcome in zip(batch, outcomes, strict=True):
            if future.done():
                continue
            if isinstance(outcome, Exception):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)
