"""The calls a router leaves running when it stops without stopping its hosts
(actors.ray.open_calls): those that end within the deadline are answered, the rest are
given up with AnswerAbandoned, which tells the client how to collect the result."""

from __future__ import annotations

import asyncio

import pytest

from actors.errors import AnswerAbandoned, RuntimeStopping
from actors.ray.open_calls import OpenCalls


async def call(calls: OpenCalls, answer: asyncio.Future[str]) -> str:
    with calls.opened():
        return await calls.until_abandoned(answer)


async def test_calls_that_end_within_the_deadline_are_answered_and_the_rest_given_up() -> None:
    calls = OpenCalls()
    loop = asyncio.get_running_loop()
    quick, slow = loop.create_future(), loop.create_future()
    quick_call = asyncio.create_task(call(calls, quick))
    slow_call = asyncio.create_task(call(calls, slow))
    await asyncio.sleep(0)
    loop.call_later(0.05, quick.set_result, "answered")
    assert await calls.settle(1.0) == (1, 1)
    assert await quick_call == "answered"
    with pytest.raises(AnswerAbandoned) as given_up:
        await slow_call
    assert isinstance(given_up.value, RuntimeStopping)  # a 503 the client may retry
    assert "same Idempotency-Key" in given_up.value.message
    assert slow.cancelled()  # the local wait ends; the command is the host's


async def test_settle_returns_at_once_when_nothing_is_open() -> None:
    calls = OpenCalls()
    async with asyncio.timeout(5):
        assert await calls.settle(60.0) == (0, 0)


async def test_a_call_after_the_calls_were_given_up_is_refused_at_once() -> None:
    calls = OpenCalls()
    await calls.settle(0.0)
    never = asyncio.get_running_loop().create_future()
    with pytest.raises(AnswerAbandoned):
        await call(calls, never)


async def test_a_caller_cancelled_while_waiting_cancels_only_its_wait() -> None:
    calls = OpenCalls()
    answer = asyncio.get_running_loop().create_future()
    waiting = asyncio.create_task(call(calls, answer))
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    async with asyncio.timeout(5):
        assert await calls.settle(60.0) == (0, 0)  # its call closed on the way out


async def test_a_step_offered_after_the_calls_were_given_up_is_closed_not_left_unawaited() -> None:
    """A stream's next part is a coroutine (Ray's `__anext__`): refused unstarted, it must be
    closed, or Python warns that it was never awaited when it is collected."""
    calls = OpenCalls()
    await calls.settle(0.0)

    async def next_part() -> str:
        return "part"

    step = next_part()
    with pytest.raises(AnswerAbandoned):
        await calls.until_abandoned(step)
    assert step.cr_frame is None  # closed
