"""A store's close that runs out of time still stops what the store was opened with."""

from __future__ import annotations

import asyncio

import pytest

from eventstore import Database, PostgresEventStore


def _store_whose_append_hangs(
    db: Database, monkeypatch: pytest.MonkeyPatch, stopped: list[str]
) -> PostgresEventStore:
    """A store whose wait for its appends never ends, its close callback noting itself."""

    async def stop_notifier() -> None:
        stopped.append("notifier")

    async def an_append_that_hangs() -> None:
        await asyncio.Event().wait()

    store = PostgresEventStore(db, on_close=(stop_notifier,))
    monkeypatch.setattr(store._appends, "wait_idle", an_append_that_hangs)
    return store


async def test_a_close_cancelled_waiting_for_appends_still_runs_its_callbacks(
    store_db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shutdown step bounds `close()`; cancelled while an append hung, it never reached its
    callbacks: the notifier and the pool stayed open under the stopping service."""
    stopped: list[str] = []
    store = _store_whose_append_hangs(store_db, monkeypatch, stopped)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            await store.close()
    assert stopped == ["notifier"]


async def test_a_close_gives_appends_its_own_bound_then_stops_under_them(
    store_db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancelled only by its shutdown step's bound, the close then ran its callbacks past
    that bound (the pool's own 10 s under a hung append): it bounds its wait itself."""
    stopped: list[str] = []
    store = _store_whose_append_hangs(store_db, monkeypatch, stopped)
    async with asyncio.timeout(10):  # a bound on a hang, not a measurement
        await store.close(appends_wait_s=0.05)
    assert stopped == ["notifier"]
