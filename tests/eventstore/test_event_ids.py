"""Event ids are time-ordered UUIDv7s, unique within a process, across threads and forks."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
import uuid
from typing import Any

import pytest

from eventstore.records import NewEvent, new_event_id

_COUNTER_MASK = (1 << 62) - 1


def _process_part(event_id: uuid.UUID) -> tuple[int, int]:
    """The bits that are not the timestamp: 12 drawn per process, and the 62-bit counter."""
    return (event_id.int >> 64) & 0xFFF, event_id.int & _COUNTER_MASK


def test_an_event_id_is_a_uuid7_carrying_the_current_millisecond() -> None:
    before = time.time_ns() // 1_000_000
    event_id = new_event_id()
    after = time.time_ns() // 1_000_000
    assert isinstance(event_id, uuid.UUID)
    assert event_id.version == 7
    assert event_id.variant == uuid.RFC_4122
    assert before <= event_id.int >> 80 <= after
    assert uuid.UUID(str(event_id)) == event_id
    assert hash(uuid.UUID(str(event_id))) == hash(event_id)


def test_new_events_get_increasing_ids() -> None:
    ids = [NewEvent("thing.Happened", {}).event_id for _ in range(20_000)]
    assert ids == sorted(ids)
    assert len(set(ids)) == len(ids)


def test_ids_stay_unique_when_the_clock_stands_still_or_steps_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    readings = iter([5_000_000_000, 5_000_000_000, 4_000_000_000, 4_000_000_000] * 500)
    monkeypatch.setattr(time, "time_ns", lambda: next(readings))
    ids = [new_event_id() for _ in range(2000)]
    assert len(set(ids)) == len(ids)
    assert {i.int >> 80 for i in ids} == {5000, 4000}


def test_ids_made_by_concurrent_threads_are_unique() -> None:
    made: list[list[uuid.UUID]] = [[] for _ in range(4)]

    def make(out: list[uuid.UUID]) -> None:
        out.extend(new_event_id() for _ in range(20_000))

    threads = [threading.Thread(target=make, args=(out,)) for out in made]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    everything = [i for out in made for i in out]
    assert len(set(everything)) == len(everything)


def _make_in_child(out: Any) -> None:
    out.put([new_event_id() for _ in range(1000)])


@pytest.mark.skipif("fork" not in mp.get_all_start_methods(), reason="needs fork")
def test_a_forked_child_does_not_continue_its_parents_sequence() -> None:
    new_event_id()  # the parent's state exists before the fork
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_make_in_child, args=(out,))
    child.start()
    theirs = out.get(timeout=30)
    child.join(timeout=30)
    ours = [new_event_id() for _ in range(1000)]
    # Without a fresh draw in the child both would make the very same sequence of process
    # bits and counters, and collide whenever they share a millisecond.
    assert not {_process_part(i) for i in ours} & {_process_part(i) for i in theirs}
