"""Reloading the shard map so that no caller is answered by a read older than its call.

A router reloads the map when it is told a move committed (NOTIFY), when a host refuses a
command's epoch, and right after it moved shards itself. Each of these callers needs a read
that *began after* its call: a read already running may have started before the commit it
is reacting to. Sharing that running read (as the router once did) left the map stale, so
a scale-in that had just moved every shard off a host read it as an owner still and would
not end it.

One read runs at a time; callers arriving while it runs share the next one, which starts
as soon as the running one ends. A burst of any number of callers costs at most two reads.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

from eventstore.tasks import cancel_and_wait


class FreshReload:
    """Call it to run `load` (or join a run) that starts no earlier than the call."""

    def __init__(self, load: Callable[[], Coroutine[Any, Any, None]]) -> None:
        self._load = load
        self._running: asyncio.Task[None] | None = None
        self._next: asyncio.Task[None] | None = None

    async def __call__(self) -> None:
        """Return once a run that started after this call has ended; raise what it raised.
        The run goes on if the caller is cancelled: other callers may share it."""
        if self._next is not None:
            # Queued, its read not begun (it begins once the one before has ended, which
            # may have just happened): it begins after this call, so it answers it.
            await asyncio.shield(self._next)
            return
        running = self._running
        if running is None or running.done():
            self._running = asyncio.create_task(self._load())
            await asyncio.shield(self._running)
            return
        self._next = asyncio.create_task(self._after(running))
        await asyncio.shield(self._next)

    async def _after(self, running: asyncio.Task[None]) -> None:
        await asyncio.wait([running])  # however it ended: its own callers see its outcome
        self._running, self._next = self._next, None
        await self._load()

    async def close(self) -> None:
        """Cancel the runs still going (the caller is about to close what `load` reads)."""
        running, queued = self._running, self._next
        self._running = self._next = None
        await cancel_and_wait(queued, running)
