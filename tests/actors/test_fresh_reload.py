"""FreshReload: no caller is answered by a read that began before its call."""

from __future__ import annotations

import asyncio

import pytest

from actors.ray.reload import FreshReload


class GatedLoads:
    """A load that records when each run began and waits until the test lets it end."""

    def __init__(self) -> None:
        self.started = 0
        self.gates: list[asyncio.Event] = []
        self.finished = 0
        self.most_at_once = 0
        self.fail_next = False
        self._changed = asyncio.Condition()

    async def load(self) -> None:
        gate = asyncio.Event()
        self.gates.append(gate)
        await self._count("started")
        self.most_at_once = max(self.most_at_once, self.started - self.finished)
        failing, self.fail_next = self.fail_next, False
        await gate.wait()
        await self._count("finished")
        if failing:
            raise ConnectionError("store went away")

    async def _count(self, what: str) -> None:
        async with self._changed:
            setattr(self, what, getattr(self, what) + 1)
            self._changed.notify_all()

    async def until_started(self, runs: int) -> None:
        async with asyncio.timeout(5), self._changed:
            await self._changed.wait_for(lambda: self.started >= runs)

    async def until_finished(self, runs: int) -> None:
        async with asyncio.timeout(5), self._changed:
            await self._changed.wait_for(lambda: self.finished >= runs)


async def test_a_call_during_a_run_waits_for_a_run_that_starts_after_it() -> None:
    loads = GatedLoads()
    reload = FreshReload(loads.load)
    first = asyncio.create_task(reload())
    await loads.until_started(1)
    late = [asyncio.create_task(reload()) for _ in range(5)]
    await asyncio.sleep(0)
    loads.gates[0].set()
    await first
    await loads.until_started(2)
    assert not any(t.done() for t in late), "answered by the read that began before them"
    loads.gates[1].set()
    await asyncio.gather(*late)
    assert loads.started == 2  # the five late callers shared one run


async def test_a_failed_run_fails_its_callers_only() -> None:
    loads = GatedLoads()
    reload = FreshReload(loads.load)
    loads.fail_next = True
    first = asyncio.create_task(reload())
    await loads.until_started(1)
    late = asyncio.create_task(reload())
    loads.gates[0].set()
    with pytest.raises(ConnectionError):
        await first
    await loads.until_started(2)
    loads.gates[1].set()
    await late
    own = asyncio.create_task(reload())  # nothing running: a run of its own
    await loads.until_started(3)
    loads.gates[2].set()
    await own


async def test_a_cancelled_caller_does_not_cancel_the_run() -> None:
    loads = GatedLoads()
    reload = FreshReload(loads.load)
    impatient = asyncio.create_task(reload())
    await loads.until_started(1)
    impatient.cancel()
    await asyncio.sleep(0)
    loads.gates[0].set()
    await loads.until_finished(1)  # the run went on without its caller
    assert impatient.cancelled()


async def test_close_cancels_the_running_and_the_queued_run() -> None:
    loads = GatedLoads()
    reload = FreshReload(loads.load)
    running = asyncio.create_task(reload())
    await loads.until_started(1)
    queued = asyncio.create_task(reload())
    await asyncio.sleep(0)
    await reload.close()
    results = await asyncio.gather(running, queued, return_exceptions=True)
    assert all(isinstance(r, asyncio.CancelledError) for r in results)
    assert loads.started == 1


async def test_a_call_just_after_a_run_ends_joins_the_queued_run() -> None:
    """Between the end of a run and the start of the queued one there is a moment when the
    run is done and the queued one has not begun; the run's own caller resumes in it. A call
    made then must join the queued run, not start a third beside it (two reads at once, the
    older able to land last)."""
    loads = GatedLoads()
    reload = FreshReload(loads.load)

    async def twice() -> None:
        await reload()
        await reload()  # made in that moment: this caller wakes before the queued run

    first = asyncio.create_task(twice())
    await loads.until_started(1)
    queued = asyncio.create_task(reload())
    await asyncio.sleep(0)
    loads.gates[0].set()
    await loads.until_started(2)
    for gate in loads.gates[1:]:
        gate.set()
    async with asyncio.timeout(5):
        await asyncio.gather(first, queued)
    assert loads.started == 2 and loads.most_at_once == 1
