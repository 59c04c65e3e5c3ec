"""Consecutive executions of one statement sent as one `executemany` (a projector's batch)."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

from eventstore.db import Connection

Args = tuple[Any, ...]
Merge = Callable[[Args, Args], Args]


class Pipeline:
    """Stands in for the connection while a batch is applied: consecutive executions of the
    same statement (a run of message events, say) reach the server as one `executemany`, one
    round trip instead of one per event. Statements still run in the order they were issued;
    a read flushes what is pending first.

    A run of `fold`s goes further: executions of one statement on the same key (one row)
    merge into one, so a row touched by several events of a batch is written once. A fold run
    is flushed, like any run, before the next different statement, so a row's folded write
    still precedes every later statement of the batch on that row; within the run, rows are
    written in the order they first appeared.
    """

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._sql: str | None = None
        self._pending: list[Args] = []
        self._folded: dict[Hashable, Args] | None = None

    async def execute(self, sql: str, *args: Any) -> None:
        if sql != self._sql or self._folded is not None:
            await self.flush()
            self._sql = sql
        self._pending.append(args)

    async def fold(self, sql: str, key: Hashable, args: Args, merge: Merge) -> None:
        """Execute `sql` with `args`, or, when the current run already holds an execution of
        `sql` for `key`, replace that one's arguments with `merge(earlier, args)`."""
        if sql != self._sql or self._folded is None:
            await self.flush()
            self._sql, self._folded = sql, {}
        earlier = self._folded.get(key)
        self._folded[key] = args if earlier is None else merge(earlier, args)

    async def flush(self) -> None:
        pending = self._pending if self._folded is None else list(self._folded.values())
        if self._sql is not None and pending:
            await self._conn.executemany(self._sql, pending)
        self._sql, self._pending, self._folded = None, [], None

    async def fetch(self, sql: str, *args: Any) -> Any:
        await self.flush()
        return await self._conn.fetch(sql, *args)

    async def fetchrow(self, sql: str, *args: Any) -> Any:
        await self.flush()
        return await self._conn.fetchrow(sql, *args)

    async def fetchval(self, sql: str, *args: Any) -> Any:
        await self.flush()
        return await self._conn.fetchval(sql, *args)


async def fold(conn: Connection, sql: str, key: Hashable, args: Args, merge: Merge) -> None:
    """`Pipeline.fold` on a pipeline; on a plain connection (a batch applied one statement at
    a time, to name the event at fault) the statement runs at once, unmerged."""
    if isinstance(conn, Pipeline):
        await conn.fold(sql, key, args, merge)
    else:
        await conn.execute(sql, *args)
