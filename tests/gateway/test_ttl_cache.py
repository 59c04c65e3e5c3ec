"""The per-process read-through cache behind API keys and agents (gateway.ttl_cache)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from gateway.ttl_cache import TtlCache


async def settle() -> None:
    """Let every ready task run up to its next wait (a caller, then the load it started)."""
    for _ in range(5):
        await asyncio.sleep(0)


def new_cache(ttl_s: float = 60.0) -> TtlCache[str, str | None]:
    return TtlCache[str, str | None](ttl_s, 10)


class Source:
    """A value per key behind a gate, counting loads, so a test decides when loads land."""

    def __init__(self) -> None:
        self.values: dict[str, str | None] = {}
        self.loads = 0
        self.gate = asyncio.Event()
        self.gate.set()

    def ask(self, cache: TtlCache[str, str | None], key: str) -> asyncio.Future[str | None]:
        """A caller looking `key` up in `cache`, running as its own task."""
        return asyncio.ensure_future(cache.get(key, self.loader(key)))

    def loader(self, key: str) -> Callable[[], Awaitable[str | None]]:
        async def load() -> str | None:
            self.loads += 1
            value = self.values.get(key)  # read when the load starts, answered at the gate
            await self.gate.wait()
            if key == "boom":
                raise RuntimeError("database unavailable")
            return value

        return load


async def test_concurrent_misses_share_one_load() -> None:
    source, cache = Source(), new_cache()
    source.values["a"] = "A"
    source.gate.clear()
    waiting = [source.ask(cache, "a") for _ in range(20)]
    await settle()
    source.gate.set()
    assert await asyncio.gather(*waiting) == ["A"] * 20
    assert source.loads == 1
    assert await source.ask(cache, "a") == "A"
    assert source.loads == 1


async def test_a_failed_load_reaches_every_waiter_and_is_not_kept() -> None:
    source, cache = Source(), new_cache()
    source.gate.clear()
    waiting = [source.ask(cache, "boom") for _ in range(3)]
    await settle()
    source.gate.set()
    results = await asyncio.gather(*waiting, return_exceptions=True)
    assert all(isinstance(r, RuntimeError) for r in results)
    with pytest.raises(RuntimeError):
        await source.ask(cache, "boom")
    assert source.loads == 2


async def test_a_load_that_raced_a_forget_is_returned_but_not_kept() -> None:
    source, cache = Source(), new_cache()
    source.values["a"] = "old"
    source.gate.clear()
    first = source.ask(cache, "a")
    await settle()
    source.values["a"] = "new"
    cache.forget("a")
    # A caller after the forget does not join the stale load: it starts its own.
    second = source.ask(cache, "a")
    await settle()
    source.gate.set()
    assert await first == "old"
    assert await second == "new"
    assert source.loads == 2
    assert await source.ask(cache, "a") == "new"
    assert source.loads == 2


async def test_a_cancelled_caller_does_not_cancel_the_shared_load() -> None:
    source, cache = Source(), new_cache()
    source.values["a"] = "A"
    source.gate.clear()
    quitter = source.ask(cache, "a")
    stayer = source.ask(cache, "a")
    await settle()
    quitter.cancel()
    source.gate.set()
    assert await stayer == "A"
    assert quitter.cancelled()
    assert source.loads == 1


async def test_none_is_never_kept_while_a_value_is() -> None:
    source, cache = Source(), new_cache()
    source.values["a"] = "A"
    for _ in range(2):
        assert await source.ask(cache, "missing") is None
        assert await source.ask(cache, "a") == "A"
    assert source.loads == 3  # "missing" twice, "a" once


async def test_an_expired_value_is_read_again(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr("gateway.ttl_cache.time.monotonic", lambda: now[0])
    source, cache = Source(), new_cache(ttl_s=5.0)
    source.values["a"] = "A"
    await source.ask(cache, "a")
    now[0] += 4.9
    await source.ask(cache, "a")
    assert source.loads == 1
    source.values["a"] = "B"
    now[0] += 0.2
    assert await source.ask(cache, "a") == "B"
    assert source.loads == 2


async def test_a_full_cache_drops_what_expired_and_keeps_what_is_live(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Expired entries used to stay until the cache filled, then every entry went, the live
    ones too: the agents of up to 10,000 workspaces held, and each fill a burst of reads."""
    clock = [1000.0]
    monkeypatch.setattr("gateway.ttl_cache.time.monotonic", lambda: clock[0])
    source, cache = Source(), new_cache(ttl_s=10.0)  # at most 10 entries
    for n in range(8):
        source.values[f"old{n}"] = "stale"
        assert await source.ask(cache, f"old{n}") == "stale"
    clock[0] += 11.0  # those eight have expired
    for n in range(2):
        source.values[f"live{n}"] = "fresh"
        assert await source.ask(cache, f"live{n}") == "fresh"
    loads = source.loads
    source.values["one-more"] = "x"
    assert await source.ask(cache, "one-more") == "x"  # the cache was full: it swept
    for key in ("live0", "live1", "one-more"):
        assert await source.ask(cache, key) in ("fresh", "x")
    assert source.loads == loads + 1  # the live entries were kept, not loaded again
    # Full of live entries, it starts afresh (each later sweep is then half a cache away).
    for n in range(7):
        source.values[f"more{n}"] = "y"
        await source.ask(cache, f"more{n}")
    loads = source.loads
    source.values["last"] = "z"
    assert await source.ask(cache, "last") == "z"
    assert await source.ask(cache, "live0") == "fresh"
    assert source.loads == loads + 2  # live0 was dropped with the rest
