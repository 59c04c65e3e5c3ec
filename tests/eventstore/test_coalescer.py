"""The coalescer alone: batching only under load, order, per-request outcomes, cancellation."""

from __future__ import annotations

import asyncio

import pytest

from eventstore.coalescer import Coalescer


class Recorder:
    """A sender that records its batches and holds each send until released."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.release = asyncio.Event()

    async def send(self, batch: list[int]) -> list[int | Exception]:
        self.batches.append(batch)
        await self.release.wait()
        return [ValueError(f"odd {n}") if n % 2 else n * 10 for n in batch]


async def test_a_request_on_a_quiet_coalescer_goes_alone_at_once() -> None:
    recorder = Recorder()
    recorder.release.set()
    coalescer: Coalescer[int, int] = Coalescer(recorder.send, lanes=2, max_batch=8)
    assert await coalescer.submit(2) == 20
    assert recorder.batches == [[2]]


async def test_requests_arriving_while_lanes_are_busy_leave_together_in_order() -> None:
    recorder = Recorder()
    coalescer: Coalescer[int, int] = Coalescer(recorder.send, lanes=1, max_batch=3)
    first = asyncio.create_task(coalescer.submit(0))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    queued = [asyncio.create_task(coalescer.submit(n)) for n in (2, 4, 6, 8)]
    await asyncio.sleep(0)
    recorder.release.set()
    assert await first == 0
    assert [await t for t in queued] == [20, 40, 60, 80]
    # One lane: the first alone, then the queue in arrival order, at most three at a time.
    assert recorder.batches == [[0], [2, 4, 6], [8]]


async def test_each_request_gets_its_own_outcome() -> None:
    recorder = Recorder()
    coalescer: Coalescer[int, int] = Coalescer(recorder.send, lanes=1, max_batch=8)
    tasks = [asyncio.create_task(coalescer.submit(n)) for n in range(4)]
    await asyncio.sleep(0)
    recorder.release.set()
    outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    assert outcomes[0] == 0 and outcomes[2] == 20
    assert isinstance(outcomes[1], ValueError) and isinstance(outcomes[3], ValueError)


async def test_a_failed_send_fails_every_request_of_its_batch_only() -> None:
    calls: list[list[int]] = []

    async def send(batch: list[int]) -> list[int | Exception]:
        calls.append(batch)
        await asyncio.sleep(0)
        if 13 in batch:
            raise ConnectionError("lost")
        return list(batch)

    coalescer: Coalescer[int, int] = Coalescer(send, lanes=1, max_batch=2)
    tasks = [asyncio.create_task(coalescer.submit(n)) for n in (1, 13, 14, 2)]
    # All four queue before the lane's drain runs: two batches of two.
    outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    assert calls == [[1, 13], [14, 2]]
    assert outcomes[2:] == [14, 2]
    assert all(isinstance(o, ConnectionError) for o in outcomes[:2])


async def test_a_caller_cancelled_while_queued_is_never_sent() -> None:
    recorder = Recorder()
    coalescer: Coalescer[int, int] = Coalescer(recorder.send, lanes=1, max_batch=8)
    first = asyncio.create_task(coalescer.submit(0))
    await asyncio.sleep(0)
    doomed = asyncio.create_task(coalescer.submit(2))
    kept = asyncio.create_task(coalescer.submit(4))
    await asyncio.sleep(0)
    doomed.cancel()
    recorder.release.set()
    assert (await first, await kept) == (0, 40)
    with pytest.raises(asyncio.CancelledError):
        await doomed
    assert recorder.batches == [[0], [4]]


async def test_wait_idle_returns_once_everything_submitted_is_answered() -> None:
    recorder = Recorder()
    coalescer: Coalescer[int, int] = Coalescer(recorder.send, lanes=2, max_batch=8)
    tasks = [asyncio.create_task(coalescer.submit(n)) for n in (2, 4, 6)]
    await asyncio.sleep(0)
    idle = asyncio.create_task(coalescer.wait_idle())
    await asyncio.sleep(0)
    assert not idle.done()
    recorder.release.set()
    await asyncio.wait_for(idle, timeout=5)
    assert all(t.done() for t in tasks)


def test_a_coalescer_needs_a_lane() -> None:
    async def send(batch: list[int]) -> list[int | Exception]:
        return list(batch)

    with pytest.raises(ValueError):
        Coalescer(send, lanes=0, max_batch=1)


async def test_a_cancelled_send_cancels_its_callers_instead_of_leaving_them_waiting() -> None:
    recorder = Recorder()
    coalescer: Coalescer[int, int] = Coalescer(recorder.send, lanes=1, max_batch=8)
    callers = [asyncio.create_task(coalescer.submit(n)) for n in (2, 4)]
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    for drain in list(coalescer._drains):
        drain.cancel()
    outcomes = await asyncio.wait_for(asyncio.gather(*callers, return_exceptions=True), 5)
    assert all(isinstance(o, asyncio.CancelledError) for o in outcomes)


async def test_a_waiter_out_of_time_leaves_the_sends_and_the_queue_to_finish() -> None:
    """A shutdown step out of time cancelled `wait_idle`, which took the sends in flight
    with it (their callers got CancelledError though the append may have committed) and
    left the queued ones with nothing to send them, for good."""
    sent: list[list[int]] = []

    async def slow(batch: list[int]) -> list[int]:
        await asyncio.sleep(0.3)
        sent.append(batch)
        return batch

    coalescer: Coalescer[int, int] = Coalescer(slow, lanes=1, max_batch=1)
    first = asyncio.ensure_future(coalescer.submit(1))
    second = asyncio.ensure_future(coalescer.submit(2))
    await asyncio.sleep(0)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            await coalescer.wait_idle()
    async with asyncio.timeout(10):  # a bound on a hang, not a measurement
        assert await asyncio.gather(first, second) == [1, 2]
    assert sent == [[1], [2]]


async def test_a_cancelled_last_lane_cancels_what_still_waits() -> None:
    """Loop teardown cancels the drain: what it would have sent next is cancelled too, not
    left for a caller to wait on forever."""

    async def never(batch: list[int]) -> list[int]:
        await asyncio.Event().wait()
        return batch

    coalescer: Coalescer[int, int] = Coalescer(never, lanes=1, max_batch=1)
    first = asyncio.ensure_future(coalescer.submit(1))
    second = asyncio.ensure_future(coalescer.submit(2))
    await asyncio.sleep(0.05)  # the drain is sending the first
    for drain in list(coalescer._drains):
        drain.cancel()
    async with asyncio.timeout(10):  # a bound on a hang, not a measurement
        outcomes = await asyncio.gather(first, second, return_exceptions=True)
    assert all(isinstance(o, asyncio.CancelledError) for o in outcomes), outcomes
