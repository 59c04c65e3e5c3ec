"""The commit-signal side of eventstore's CommitNotifier, without its connections: the
projection tests fire `committed()` themselves."""

from __future__ import annotations

from collections.abc import Callable


class CommitSignal:
    def __init__(self) -> None:
        self.listeners: list[Callable[[], None]] = []

    def add_listener(self, cb: Callable[[], None]) -> None:
        self.listeners.append(cb)

    def remove_listener(self, cb: Callable[[], None]) -> None:
        self.listeners.remove(cb)

    def committed(self) -> None:
        for cb in self.listeners:
            cb()
