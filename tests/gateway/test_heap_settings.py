"""The serving process's collector settings (gateway/heap.py)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from gateway.heap import OLDER_THRESHOLDS, YOUNG_THRESHOLD, settle_after_startup


@pytest.fixture
def restored_collector() -> Iterator[None]:
    thresholds = gc.get_threshold()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)


@pytest.mark.usefixtures("restored_collector")
def test_startup_objects_leave_the_collectors_view_and_collections_are_rarer() -> None:
    survivor = [object() for _ in range(3)]  # a container alive at startup
    settle_after_startup()
    assert gc.get_freeze_count() > 0
    assert gc.get_threshold() == (YOUNG_THRESHOLD, *OLDER_THRESHOLDS)
    assert not any(obj is survivor for obj in gc.get_objects())  # frozen, so not tracked
    assert survivor


@pytest.mark.usefixtures("restored_collector")
def test_cycles_made_after_startup_are_still_collected() -> None:
    settle_after_startup()

    class Node:
        peer: object

    first, second = Node(), Node()
    first.peer, second.peer = second, first
    del first, second
    assert gc.collect() >= 2
