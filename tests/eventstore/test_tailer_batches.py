"""The tailer's in-process batch listeners and its scoped history reads, as the SSE fan-out
(gateway/feed_fanout.py) uses them: a listener registered at live point L receives exactly the
events after L, in log order, while writers commit concurrently; history is scoped in the
query by workspace and type."""

from __future__ import annotations

import asyncio
import os
import random
import uuid
from collections.abc import Sequence

import pytest
from test_subscribe import (
    Stack,
    append_one,
    assert_same_sequence,
    full_log,
    stack,
    store_writer,
    wait_until,
)

import eventstore.tailer
from eventstore.cursor import ORIGIN
from eventstore.records import NewEvent, RecordedEvent
from eventstore.tailer import FAILED_READ_BACKOFF_CAP_S, LogTailer, _backoff

__all__ = ["stack"]


async def test_a_listener_gets_every_event_after_its_live_point_once_in_order(
    stack: Stack,
) -> None:
    rng = random.Random(20261121)
    for n in range(50):
        await append_one(stack.store, f"pre-{n % 3}", ws=f"ws{n % 3}")
    writers = [
        asyncio.create_task(store_writer(stack.store, i, 40, random.Random(rng.random())))
        for i in range(4)
    ]
    await asyncio.sleep(0.05)
    received: list[RecordedEvent] = []
    # Registration and the live point are read in one step, as the fan-out does.
    start = stack.tailer.live_point
    stack.tailer.add_batch_listener(received.extend)
    await asyncio.gather(*writers)

    expected = [e for e in await full_log(stack.store) if e.point > start]
    assert expected, "the writers committed nothing after registration"
    await wait_until(lambda: len(received) >= len(expected), "the listener to see every event")
    stack.tailer.wake()
    await asyncio.sleep(0.3)
    assert_same_sequence(received, expected)


async def test_a_removed_listener_gets_nothing_more(stack: Stack) -> None:
    received: list[RecordedEvent] = []

    def listener(batch: Sequence[RecordedEvent]) -> None:
        received.extend(batch)

    stack.tailer.add_batch_listener(listener)
    await append_one(stack.store, "s-1")
    await wait_until(lambda: len(received) == 1, "the first event")
    stack.tailer.remove_batch_listener(listener)
    read_before = stack.tailer.events_fanned_out
    await append_one(stack.store, "s-1")
    await wait_until(
        lambda: stack.tailer.events_fanned_out > read_before, "the tailer to read the second"
    )
    assert len(received) == 1


async def test_a_failing_listener_does_not_stop_the_others(
    stack: Stack, caplog: pytest.LogCaptureFixture
) -> None:
    received: list[RecordedEvent] = []

    def broken(batch: Sequence[RecordedEvent]) -> None:
        raise RuntimeError("listener bug")

    stack.tailer.add_batch_listener(broken)
    stack.tailer.add_batch_listener(received.extend)
    await append_one(stack.store, "s-2")
    await wait_until(lambda: len(received) == 1, "the healthy listener's event")
    assert "batch listener failed" in caplog.text


async def test_history_is_scoped_by_workspace_and_type(stack: Stack) -> None:
    for n in range(30):
        await append_one(stack.store, f"h-{n % 3}", ws=f"ws{n % 3}")
    log = await full_log(stack.store)
    ws1 = [e async for e in stack.tailer.history(ORIGIN, "ws1")]
    assert_same_sequence(ws1, [e for e in log if e.workspace_id == "ws1"])
    typed = [e async for e in stack.tailer.history(ORIGIN, "ws2", ["Ticked", "Other"])]
    assert_same_sequence(typed, [e for e in log if e.workspace_id == "ws2"])
    assert [e async for e in stack.tailer.history(ORIGIN, "ws2", ["Other"])] == []
    after = log[10].point
    rest = [e async for e in stack.tailer.history(after, "ws0")]
    assert_same_sequence(rest, [e for e in log if e.workspace_id == "ws0" and e.point > after])


def test_the_wait_after_failed_reads_stays_capped_however_long_the_outage() -> None:
    """Half an hour of refused connections is about a thousand failed reads in a row."""
    waits = [_backoff(0.075, n) for n in (1, 2, 5, 1024, 10**6)]
    assert waits[0] == 0.15 and waits[1] == 0.3
    assert waits[2:] == [FAILED_READ_BACKOFF_CAP_S] * 3


async def test_a_live_batch_is_cut_by_the_bytes_of_its_events(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every live feed of a workspace writes a batch whole to its socket: a thousand large
    messages read at once after a stall were that much again per feed. A batch holds at most
    LIVE_BATCH_BYTES of stored data, its first event aside, and none is lost or repeated."""
    monkeypatch.setattr(eventstore.tailer, "LIVE_BATCH_BYTES", 50_000, raising=False)
    batches: list[list[RecordedEvent]] = []
    stack.tailer.add_batch_listener(lambda batch: batches.append(list(batch)))
    start = stack.tailer.live_point
    # One transaction of 12 events of about 20 kB each (random, so stored uncompressed):
    # one read would have taken them all.
    blobs = [NewEvent("Blob", {"text": os.urandom(10_000).hex()}) for _ in range(12)]
    await stack.store.append(
        "big-1", blobs, expected_version=None, command_id=uuid.uuid4().hex, workspace_id="ws1"
    )
    await wait_until(lambda: sum(map(len, batches)) >= 12, "the tailer to read every event")
    assert max(len(batch) for batch in batches) <= 3, [len(b) for b in batches]
    expected = [e for e in await full_log(stack.store) if e.point > start]
    assert_same_sequence([e for batch in batches for e in batch], expected)


async def test_a_subscriber_reading_history_as_the_tailer_stops_ends_without_a_gap(
    stack: Stack,
) -> None:
    """Its history loop ended with the tailer, short of the live point, and it went live:
    the queued events it yielded lay past events it never read, and a cursor saved from
    them skipped those for good. It ends instead."""
    tailer = LogTailer(stack.db, stack.notifier, history_page=2)
    await tailer.start()
    for n in range(6):
        await append_one(stack.store, f"gap-{n}")
    await wait_until(lambda: tailer.live_point == stack.tailer.live_point, "the head")
    events = tailer.subscribe(None)
    received = [await anext(events)]  # registered, the first history page read
    for n in range(2):  # fanned out to the subscriber's queue, past its history
        await append_one(stack.store, f"late-{n}")
    late = (await full_log(stack.store))[-1].point
    await wait_until(lambda: tailer.live_point == late, "the tailer to read the late events")
    await tailer.stop()
    received += [event async for event in events]
    log = await full_log(stack.store)
    assert [e.point for e in received] == [e.point for e in log[: len(received)]]
