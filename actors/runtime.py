"""The actor runtime port, shared by the `local` and `ray` runtimes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from actors.behaviour import ActorKey
from actors.table import StopSummary, TableStats
from schemas.commands import Command


class ActorRuntime(Protocol):
    async def ask(self, key: ActorKey, command: Command, *, timeout: float | None = None) -> Any:
        """Deliver `command` to the actor's mailbox and return the last item its handler yields."""
        ...

    def stream(self, key: ActorKey, command: Command) -> AsyncIterator[Any]:
        """Deliver `command` and yield every item its handler yields, in order."""
        ...

    async def tell(self, key: ActorKey, command: Command) -> None:
        """Deliver `command` without waiting for its result (failures are logged)."""
        ...

    async def start(self) -> None: ...

    async def stop(self, deadline_s: float = 10.0) -> StopSummary | None:
        """Stop taking commands, let running ones finish up to the deadline, fail the rest
        with `RuntimeStopping`, snapshot and passivate every active actor. Returns what
        became of the commands in flight when they ran in this process, else None."""
        ...

    def configure(self, config: Any) -> None:
        """New settings for the behaviours (the model settings), where the runtime built them
        apart from the caller: the `ray` hosts. The `local` runtime's behaviours share the
        caller's objects, which the caller updates itself."""
        ...

    async def stats(self) -> TableStats:
        """The actor table counters summed over every host (this process for `local`)."""
        ...

    async def host_stats(self) -> dict[str, TableStats]:
        """The actor table counters of each host process the actors are spread over, by host
        name (for metrics); empty when they run in this process."""
        ...
