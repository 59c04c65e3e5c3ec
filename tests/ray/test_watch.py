"""Restart detection and abandoned attempts (actors/ray/watch.py), without a Ray cluster.

An attempt is awaited through `ObjectRef.as_future`; `PendingRef` stands in for the ref of a
call that has not answered yet (the only part of an ObjectRef the watch uses).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

import pytest

from actors.ray.watch import Attempts, HostRestarted, HostWatch


class PendingRef:
    def __init__(self) -> None:
        self.future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

    def as_future(self, _internal: bool = False) -> asyncio.Future[Any]:
        return self.future


async def started(coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
    task = asyncio.create_task(coro)
    await asyncio.sleep(0)
    return task


async def test_an_attempt_answers_its_result() -> None:
    attempts = Attempts()
    ref = PendingRef()
    task = await started(attempts.answer("h0", 7, ref))
    ref.future.set_result("ok")
    assert await task == "ok"


async def test_a_new_process_abandons_the_attempts_sent_to_the_old_one() -> None:
    attempts = Attempts()
    watch = HostWatch(attempts)
    watch.seen("h0", 100)
    on_h0 = await started(attempts.answer("h0", 1, PendingRef()))
    on_h1 = await started(attempts.answer("h1", 2, PendingRef()))
    watch.seen("h0", 100)  # the same process: nothing happens
    await asyncio.sleep(0)
    assert not on_h0.done()
    watch.seen("h0", 101)
    with pytest.raises(HostRestarted):
        await on_h0
    assert not on_h1.done()
    on_h1.cancel()


async def test_the_first_sighting_of_a_host_is_not_a_restart() -> None:
    attempts = Attempts()
    watch = HostWatch(attempts)
    task = await started(attempts.answer("h0", 1, PendingRef()))
    watch.seen("h0", 100)
    await asyncio.sleep(0)
    assert not task.done()
    task.cancel()


async def test_a_restart_is_reported_once_per_new_process(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """QA finding: the gateway's log said nothing of a host killed and restarted; only Ray's
    own lines told of it. It is logged once, at warning, naming both processes."""
    restarted: list[str] = []
    watch = HostWatch(Attempts(), on_restart=restarted.append)
    with caplog.at_level(logging.WARNING, logger="actors.ray.watch"):
        watch.seen("h0", 100)
        watch.seen("h1", 200)
        watch.seen("h0", 100)
        assert restarted == [] and not caplog.records
        watch.seen("h0", 101)
        watch.seen("h0", 101)
    assert restarted == ["h0"]
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("actor host h0 restarted (process 100 is gone, 101 answers now)")


async def test_a_moved_shard_abandons_only_its_own_attempts() -> None:
    attempts = Attempts()
    moved = await started(attempts.answer("h0", 5, PendingRef()))
    stays = await started(attempts.answer("h0", 6, PendingRef()))
    attempts.abandon(5)
    with pytest.raises(HostRestarted):
        await moved
    assert not stays.done()
    stays.cancel()


async def test_cancelling_the_caller_is_not_reported_as_a_restart() -> None:
    attempts = Attempts()
    task = await started(attempts.answer("h0", 1, PendingRef()))
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    attempts.abandon("h0")  # nothing left to abandon


async def test_a_restart_wakes_a_retry_that_is_backing_off() -> None:
    watch = HostWatch(Attempts())
    watch.seen("h0", 100)
    waiting = await started(watch.until_restarted("h0", 3600.0))
    watch.seen("h0", 101)
    for _ in range(10):  # a few turns of the loop, not an hour
        await asyncio.sleep(0)
    assert waiting.done()


class PingHandle:
    """A host handle whose pings answer when the test says, in any order."""

    def __init__(self) -> None:
        self.answers: list[asyncio.Future[int]] = []
        self.ping = self

    def remote(self) -> asyncio.Future[int]:
        self.answers.append(asyncio.get_running_loop().create_future())
        return self.answers[-1]


async def test_a_late_answer_from_the_old_process_does_not_undo_the_restart() -> None:
    attempts = Attempts()
    watch = HostWatch(attempts)
    watch.seen("h0", 100)
    handle = PingHandle()
    assert watch.poll("h0", handle, timeout_s=5.0, max_pending=4)
    assert watch.poll("h0", handle, timeout_s=5.0, max_pending=4)
    await asyncio.sleep(0)
    sent_before_restart = await started(attempts.answer("h0", 7, PendingRef()))
    handle.answers[1].set_result(101)  # the newer ping, answered by the new process
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    ref = PendingRef()
    sent_after_restart = await started(attempts.answer("h0", 8, ref))
    handle.answers[0].set_result(100)  # the older ping, answered late by the old process
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert not sent_after_restart.done()  # not abandoned by the stale answer
    ref.future.set_result("ok")
    assert await sent_after_restart == "ok"
    with pytest.raises(HostRestarted):
        await sent_before_restart


async def test_stop_cancels_the_pings_still_waiting() -> None:
    watch = HostWatch(Attempts())
    handle = PingHandle()
    assert watch.poll("h0", handle, timeout_s=60.0, max_pending=4)
    assert watch.poll("h1", handle, timeout_s=60.0, max_pending=4)
    await asyncio.sleep(0)
    await watch.stop()
    assert all(answer.cancelled() for answer in handle.answers)
    # Their slots are free again: a new ping to the same host goes out.
    assert watch.poll("h0", handle, timeout_s=60.0, max_pending=1)
    await watch.stop()
