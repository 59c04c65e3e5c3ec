"""The helpers every background loop is stopped and woken with (eventstore/tasks.py)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from eventstore.tasks import cancel_and_wait, wait_set


async def test_wait_set_tells_a_wake_up_from_a_timeout() -> None:
    event = asyncio.Event()
    assert await wait_set(event, 0.01) is False
    asyncio.get_running_loop().call_soon(event.set)
    assert await wait_set(event, 5.0) is True


async def test_a_waiter_cancelled_as_its_event_is_set_stays_cancelled() -> None:
    """The trap `wait_set` avoids: on Python 3.11, `wait_for` could return instead."""
    event = asyncio.Event()
    waiter = asyncio.create_task(wait_set(event, 5.0))
    await asyncio.sleep(0)
    event.set()
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter


async def test_cancel_and_wait_ends_every_task_and_logs_their_errors(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def fails() -> None:
        raise RuntimeError("boom")

    async def sleeps() -> None:
        await asyncio.sleep(60)

    failing = asyncio.create_task(fails(), name="failing")
    sleeping = asyncio.create_task(sleeps(), name="sleeping")
    await asyncio.sleep(0)
    with caplog.at_level(logging.ERROR, logger="eventstore.tasks"):
        await cancel_and_wait(failing, None, sleeping)
    assert failing.done() and sleeping.cancelled()
    assert "failing" in caplog.text and "boom" in caplog.text
