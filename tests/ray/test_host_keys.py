"""The host's per-shard key sets stay bounded by the actors still active."""

from __future__ import annotations

from typing import Any

from actors import ActorKey
from actors.ray.host import ActorHost, HostSpec


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
