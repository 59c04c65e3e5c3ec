"""A small per-process read-through cache with a time to live, for lookups that may be a
little stale (API keys, a workspace's agents) but must reflect this process's own writes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class TtlCache(Generic[K, V]):
    """Values loaded on a miss and kept `ttl_s`; at most `max_entries`. When full, the
    expired entries are dropped, and every entry if that does not free half of it (an
    expired entry otherwise stays until the cache fills: at a 1 s TTL, the lists of every
    workspace that ever chatted). `None` is never kept: a miss asks again.

    Concurrent misses of one key share one load: when an entry expires under load, one read
    goes to the database instead of one per waiting request.

    `forget` drops entries at once, for a process that has just changed what they hold. A load
    that was already running when anything was forgotten may have read the old state, so it is
    returned to the callers already waiting for it but not kept, and later callers start a new
    one.
    """

    def __init__(self, ttl_s: float, max_entries: int) -> None:
        self._ttl_s = ttl_s
        self._max_entries = max_entries
        self._entries: dict[K, tuple[float, V]] = {}
        self._loading: dict[K, tuple[int, asyncio.Task[V]]] = {}
        self._generation = 0  # bumped by every forget

    async def get(self, key: K, load: Callable[[], Awaitable[V]]) -> V:
        hit = self._entries.get(key)
        if hit is not None and hit[0] > time.monotonic():
            return hit[1]
        flight = self._loading.get(key)
        if flight is None or flight[0] != self._generation:
            flight = (self._generation, asyncio.ensure_future(load()))
            self._loading[key] = flight
            flight[1].add_done_callback(lambda task: self._landed(key, flight[0], task))
        # Shielded: a caller that gives up does not cancel the load the others wait for.
        return await asyncio.shield(flight[1])

    def _landed(self, key: K, generation: int, task: asyncio.Task[V]) -> None:
        if self._loading.get(key, (None, None))[1] is task:
            del self._loading[key]
        if task.cancelled() or task.exception() is not None:
            return  # the exception went to every waiting caller; nothing is kept
        value = task.result()
        if value is None or generation != self._generation:
            return
        now = time.monotonic()
        if len(self._entries) >= self._max_entries:
            self._drop_expired(now)
        self._entries[key] = (now + self._ttl_s, value)

    def _drop_expired(self, now: float) -> None:
        # Cleared outright when the live entries fill more than half: the sweep then runs
        # at most once per max_entries / 2 loads, never on every load of a full cache.
        live = {k: entry for k, entry in self._entries.items() if entry[0] > now}
        self._entries = live if len(live) <= self._max_entries // 2 else {}

    def forget(self, key: K) -> None:
        self._generation += 1
        self._entries.pop(key, None)

    def forget_where(self, stale: Callable[[V], bool]) -> None:
        self._generation += 1
        for key in [k for k, (_, value) in self._entries.items() if stale(value)]:
            del self._entries[key]

    def clear(self) -> None:
        self._generation += 1
        self._entries.clear()
