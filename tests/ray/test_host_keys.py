"""The host's per-shard key sets stay bounded by the actors still active."""

from __future__ import annotations

from typing import Any

import pytest

from actors import ActorKey
from actors.ray import RayRuntime, RaySettings
from actors.ray.host import ActorHost, HostSpec
from eventstore.errors import StoreUnavailable


class _Table:
    """The activation table as the host's bookkeeping sees it: submit activates a key."""

    def __init__(self) -> None:
        self.active: set[ActorKey] = set()

    def submit(self, key: ActorKey, command: Any, *, stream: bool) -> object:
        self.active.add(key)
        return object()

    def is_active(self, key: ActorKey) -> bool:
        return key in self.active


def test_a_shard_keeps_the_keys_of_its_active_actors_not_of_every_one_seen() -> None:
    host = ActorHost(HostSpec("svc", "svc-host-0", "postgresql://unused", behaviours=list))
    table = _Table()
    still_active: list[ActorKey] = []
    for n in range(20_000):
        key = ActorKey("conversation", f"c{n}")
        host._submit(table, 7, key, None)  # type: ignore[arg-type]
        if n % 100 == 0:
            still_active.append(key)  # a few stay; the rest passivate (idle, LRU)
        else:
            table.active.discard(key)
    kept = host._keys[7]
    assert set(still_active) <= kept  # `release` still finds every active actor
    assert len(kept) <= 2 * 1024 + len(still_active)


class _BusyTable(_Table):
    """Passivates every actor but those still at work."""

    def __init__(self, busy: set[ActorKey]) -> None:
        super().__init__()
        self.busy = busy

    async def passivate(self, keys: list[ActorKey]) -> list[ActorKey]:
        gone = [k for k in keys if k not in self.busy]
        self.active.difference_update(gone)
        return gone


async def test_a_release_keeps_the_keys_of_actors_still_at_work() -> None:
    """The next release (a move waits while commands run) must find them to passivate
    them; forgotten, they stayed active on the old host after their shard moved."""
    host = ActorHost(HostSpec("svc", "svc-host-0", "postgresql://unused", behaviours=list))
    working, idle = ActorKey("conversation", "c-working"), ActorKey("conversation", "c-idle")
    table = _BusyTable({working})
    for key in (working, idle):
        host._submit(table, 5, key, None)  # type: ignore[arg-type]
    host._in_flight[5] = 1  # the working one's command runs on

    async def ensure() -> Any:
        return table

    host._ensure = ensure  # type: ignore[method-assign]
    assert await host.release([5], 0.01) == [5]
    assert host._keys[5] == {working}


async def test_a_move_that_fails_gives_the_busy_shards_back_too() -> None:
    """The busy ones stayed held while the idle ones moved; a failed move reopened only the
    idle ones, and the busy ones' commands were refused for a minute (503s past the
    routers' retry deadline)."""
    runtime = RayRuntime("postgresql://unused", list, RaySettings(address="auto"))
    told: list[tuple[str, str, tuple[Any, ...]]] = []

    async def release(source: str, shards: list[int], wait_s: float) -> list[int]:
        return [shards[-1]]

    async def hand_over(*_: Any, **__: Any) -> int:
        raise StoreUnavailable("the database went away")

    async def tell(name: str, method: str, *args: Any) -> None:
        told.append((name, method, args))

    runtime._release = release  # type: ignore[method-assign]
    runtime._hand_over = hand_over  # type: ignore[method-assign]
    runtime._tell = tell  # type: ignore[method-assign]
    with pytest.raises(StoreUnavailable):
        await runtime._move("host-a", "host-b", [3, 4], ["host-a"])
    assert ("host-a", "reopen", ([4],)) in told
