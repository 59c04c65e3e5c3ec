"""The host's per-shard key sets stay bounded by the actors still active."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

import pytest

import actors.ray.host
from actors import ActorKey
from actors.ray import RayRuntime, RaySettings
from actors.ray.host import ActorHost, HostSpec
from actors.ray.wire import WrongEpoch
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


class _Assignments:
    """load_assignment as a database would answer it: `maps` in order, each read taking
    `delay_s`; a None in `maps` is a read that fails."""

    def __init__(self, maps: list[dict[int, int] | None], delay_s: float = 0.0) -> None:
        self.maps, self.delay_s, self.reads = maps, delay_s, 0

    async def __call__(self, *_: Any) -> dict[int, int]:
        answer = self.maps[min(self.reads, len(self.maps) - 1)]
        self.reads += 1
        await asyncio.sleep(self.delay_s)
        if answer is None:
            raise StoreUnavailable("the event store is unreachable")
        return answer


def _host_holding(shard: int, epoch: int) -> ActorHost:
    host = ActorHost(HostSpec("svc", "svc-host-0", "postgresql://unused", behaviours=list))
    host._store = cast(Any, SimpleNamespace(db=None))
    host._owned = {shard: epoch}
    host._releasing.hold([shard], 60.0)
    return host


async def test_a_reopen_reads_the_assignment_afresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """Review finding: reopen joined a read already under way (or skipped one just done),
    which could predate the move's commit; the shard, moved after all, was then taken back
    under its old epoch. The read in flight is waited out and a new one made."""
    host = _host_holding(5, 1)
    before_the_move, after_it = {5: 1}, {}
    reads = _Assignments([before_the_move, after_it], delay_s=0.05)
    monkeypatch.setattr(actors.ray.host, "load_assignment", reads)
    under_way = asyncio.create_task(host._reload_assignment())  # began before the commit
    await asyncio.sleep(0)
    await host.reopen([5])
    await under_way
    assert reads.reads == 2 and 5 not in host.owned()
    assert isinstance(await host._admit(5, 1), WrongEpoch)


async def test_a_reopen_that_cannot_read_the_assignment_keeps_its_hold(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The map as last read may predate the move: with no fresh read the shards stay held
    (refused here) rather than taken again; a blip shorter than the retries changes nothing."""
    monkeypatch.setattr(actors.ray.host, "REOPEN_READ_PAUSES_S", (0.01, 0.01))
    host = _host_holding(5, 1)
    monkeypatch.setattr(actors.ray.host, "load_assignment", _Assignments([None]))
    await host.reopen([5])
    assert 5 in host._releasing
    blip = _Assignments([None, {5: 1}])
    monkeypatch.setattr(actors.ray.host, "load_assignment", blip)
    await host.reopen([5])
    assert blip.reads == 2 and 5 not in host._releasing and host.owned() == {5: 1}
