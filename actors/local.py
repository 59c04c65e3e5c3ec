"""The `local` runtime: the activation table inside the gateway process (the embedded default)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from actors.behaviour import ActorKey
from actors.errors import AskTimeout
from actors.table import ActivationTable, Reply, StopSummary, TableStats
from schemas.commands import Command


class LocalRuntime:
    """`ActorRuntime` over one in-process `ActivationTable`.

    A command is queued in the actor's mailbox as soon as `ask`, `stream` or `tell` is
    called, and runs to completion there whatever the caller does next: a timed-out `ask` or
    a stream the client stopped reading leaves the command running, and its events recorded.
    """

    def __init__(self, table: ActivationTable) -> None:
        self._table = table

    @property
    def table(self) -> ActivationTable:
        return self._table

    # The port (actors/runtime.py) fixes the `timeout` parameter.
    async def ask(
        self,
        key: ActorKey,
        command: Command,
        *,
        timeout: float | None = None,
    ) -> Any:
        reply = self._table.submit(key, command, stream=False)
        try:
            async with asyncio.timeout(timeout):
                return await reply.last()
        except TimeoutError:
            reply.discard()
            raise AskTimeout(
                f"{key} did not answer {type(command).__name__} within {timeout} s; the "
                "command keeps running and a retry with the same Idempotency-Key returns "
                "its result once recorded"
            ) from None
        except asyncio.CancelledError:
            reply.discard()
            raise

    def stream(self, key: ActorKey, command: Command) -> AsyncIterator[Any]:
        return _follow(self._table.submit(key, command))

    async def tell(self, key: ActorKey, command: Command) -> None:
        self._table.submit(key, command, stream=False).discard()

    async def start(self) -> None:
        await self._table.start()

    async def stop(self, deadline_s: float = 10.0) -> StopSummary | None:
        return await self._table.stop(deadline_s)

    async def stats(self) -> TableStats:
        return self._table.stats()

    def configure(self, config: Any) -> None:
        pass  # the behaviours are the caller's own objects, updated by the caller

    async def host_stats(self) -> dict[str, TableStats]:
        return {}  # the actors run in this process: see `table`


async def _follow(reply: Reply) -> AsyncIterator[Any]:
    try:
        async for item in reply:
            yield item
    finally:
        # The consumer went away (or finished): stop buffering for it, the actor goes on.
        reply.discard()
