"""A store's close that runs out of time still stops what the store was opened with."""

from __future__ import annotations

import asyncio

import pytest

from eventstore import Database, PostgresEventStore


async def test_a_close_cancelled_waiting_for_appends_still_runs_its_callbacks(
    store_db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shutdown step bounds `close()`; cancelled while an append hung, it never reached its
    callbacks: the notifier and the pool stayed open under the stopping service."""
    stopped: list[str] = []

    async def stop_notifier() -> None:
        stopped.append("notifier")

    store = PostgresEventStore(store_db, on_close=(stop_notifier,))

    async def an_append_that_hangs() -> None:
        await asyncio.Event().wait()

    monkeypatch.setattr(store._appends, "wait_idle", an_append_that_hangs)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            await store.close()
    assert stopped == ["notifier"]
