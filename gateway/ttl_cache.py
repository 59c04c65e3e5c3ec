"""A small per-process read-through cache with a time to live, for lookups that may be a
little stale (API keys, a workspace's agents) but must reflect this process's own writes."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class TtlCache(Generic[K, V]):
    """Values loaded on a miss and kept `ttl_s`; at most `max_entries` (all dropped when
    full). `None` is never kept: a miss asks again.

    `forget` drops entries at once, for a process that has just changed what they hold. A load
    that was already running when anything was forgotten may have read the old state, so it is
    returned to its caller but not kept.
    """

    def __init__(self, ttl_s: float, max_entries: int) -> None:
        self._ttl_s = ttl_s
        self._max_entries = max_entries
        self._entries: dict[K, tuple[float, V]] = {}
        self._generation = 0  # bumped by every forget

    async def get(self, key: K, load: Callable[[], Awaitable[V]]) -> V:
        now = time.monotonic()
        hit = self._entries.get(key)
        if hit is not None and hit[0] > now:
            return hit[1]
        generation = self._generation
        value = await load()
        if value is not None and generation == self._generation:
            if len(self._entries) >= self._max_entries:
                self._entries.clear()
            self._entries[key] = (now + self._ttl_s, value)
        return value

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
