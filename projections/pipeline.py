"""Consecutive executions of one statement sent as one `executemany` (a projector's batch)."""

from __future__ import annotations

from typing import Any

from eventstore.db import Connection


class Pipeline:
    """Stands in for the connection while a batch is applied: consecutive executions of the
    same statement (a run of message events, say) reach the server as one `executemany`, one
    round trip instead of one per event. Statements still run in the order they were issued;
    a read flushes what is pending first."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._sql: str | None = None
        self._pending: list[tuple[Any, ...]] = []

    async def execute(self, sql: str, *args: Any) -> None:
        if sql != self._sql:
            await self.flush()
            self._sql = sql
        self._pending.append(args)

    async def flush(self) -> None:
        if self._sql is not None and self._pending:
            await self._conn.executemany(self._sql, self._pending)
        self._sql, self._pending = None, []

    async def fetch(self, sql: str, *args: Any) -> Any:
        await self.flush()
        return await self._conn.fetch(sql, *args)

    async def fetchrow(self, sql: str, *args: Any) -> Any:
        await self.flush()
        return await self._conn.fetchrow(sql, *args)

    async def fetchval(self, sql: str, *args: Any) -> Any:
        await self.flush()
        return await self._conn.fetchval(sql, *args)
