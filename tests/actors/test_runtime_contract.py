"""The actor runtime contract: every runtime (the `runtime`/`make_runtime` parameters) must
pass this suite over the real event store."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable

import pytest
from actor_doubles import (
    COUNTER,
    AddToCounter,
    CounterAdded,
    CounterBehaviour,
    CounterBehaviourV2,
    CounterView,
    MakeRuntime,
    ReadCounter,
    RuntimeUnderTest,
)

from actors import ActorKey, AskTimeout, CommandOutcome, RuntimeStopping
from eventstore import PostgresEventStore
from schemas.errors import InvalidInput

WS = "ws-1"


def key(name: str | None = None) -> ActorKey:
    return ActorKey(COUNTER, name or uuid.uuid4().hex)


def add(
    amount: int = 1, note: str = "", *, command_id: str | None = None, **kw: float
) -> AddToCounter:
    return AddToCounter(
        command_id=command_id or uuid.uuid4().hex, workspace_id=WS, amount=amount, note=note, **kw
    )


def read() -> ReadCounter:
    return ReadCounter(command_id=uuid.uuid4().hex, workspace_id=WS)


async def view(runtime: RuntimeUnderTest, k: ActorKey) -> CounterView:
    result = await runtime.ask(k, read())
    assert isinstance(result, CounterView)
    return result


async def eventually(
    check: Callable[[], Awaitable[bool]], what: str, limit_s: float = 20.0
) -> None:
    """Poll `check` until true; fails with `what` after `limit_s` (a liveness bound only)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + limit_s
    while not await check():
        if loop.time() > end:
            pytest.fail(f"not reached within {limit_s} s: {what}")
        await asyncio.sleep(0.02)


async def assert_dense(store: PostgresEventStore, k: ActorKey, count: int) -> list[int]:
    recorded = await store.read_stream(k.stream_id)
    assert [r.version for r in recorded] == list(range(1, count + 1))
    return [r.data["amount"] for r in recorded]


async def test_ask_returns_outcome_and_records(
    runtime: RuntimeUnderTest, store: PostgresEventStore
) -> None:
    k = key()
    outcome = await runtime.ask(k, add(5, "a"))
    assert isinstance(outcome, CommandOutcome)
    assert outcome.events == (CounterAdded(amount=5, note="a"),)
    assert (outcome.first_version, outcome.last_version, outcome.duplicate) == (1, 1, False)
    assert outcome.cursor
    recorded = await store.read_stream(k.stream_id)
    assert [(r.type, r.data, r.metadata["command_type"]) for r in recorded] == [
        ("test.counter_added", {"amount": 5, "note": "a"}, "AddToCounter")
    ]


async def test_domain_error_reaches_caller_and_records_nothing(
    runtime: RuntimeUnderTest, store: PostgresEventStore
) -> None:
    k = key()
    with pytest.raises(InvalidInput, match="adding 0"):
        await runtime.ask(k, add(0))
    assert await store.read_stream(k.stream_id) == []
    assert (await view(runtime, k)).version == 0


async def test_a_commands_own_error_reaches_caller_whether_asked_or_streamed(
    runtime: RuntimeUnderTest, store: PostgresEventStore
) -> None:
    """A defect of the command's (a plain ValueError), not of the runtime: no runtime may
    take it for a host gone away and run the command again."""
    k = key()
    with pytest.raises(ValueError, match="cannot take -1"):
        await runtime.ask(k, add(-1))
    with pytest.raises(ValueError, match="cannot take -2"):
        async for _ in runtime.stream(k, add(-2)):
            pass
    assert await store.read_stream(k.stream_id) == []
    assert getattr(runtime, "retries", 0) == 0


async def test_commands_to_one_actor_run_in_order(
    runtime: RuntimeUnderTest, store: PostgresEventStore
) -> None:
    k = key()
    for i in range(30):
        await runtime.tell(k, add(1, str(i), delay_s=0.01 if i % 7 == 0 else 0.0))
    final = await view(runtime, k)
    assert final.notes == tuple(str(i) for i in range(30))
    assert final.version == 30
    await assert_dense(store, k, 30)


async def test_stream_yields_every_item(runtime: RuntimeUnderTest) -> None:
    items = [item async for item in runtime.stream(key(), add(2))]
    assert len(items) == 1 and isinstance(items[0], CommandOutcome)


async def test_actors_run_concurrently_and_independently(
    runtime: RuntimeUnderTest, store: PostgresEventStore
) -> None:
    keys = [key() for _ in range(12)]
    await asyncio.gather(*(runtime.ask(k, add(i + 1, str(i))) for k in keys for i in range(8)))
    for k in keys:
        v = await view(runtime, k)
        assert v.total == sum(range(1, 9)) and v.version == 8
        assert sorted(await assert_dense(store, k, 8)) == list(range(1, 9))


async def test_snapshot_every_n_events(
    make_runtime: MakeRuntime, store: PostgresEventStore
) -> None:
    runtime = await make_runtime([CounterBehaviour()], snapshot_every=10)
    k = key()
    for i in range(25):
        await runtime.ask(k, add(1, str(i)))
    snapshot = await store.load_snapshot(k.stream_id)
    assert snapshot is not None
    assert snapshot.version == 20
    assert snapshot.state == {"total": 20, "notes": [str(i) for i in range(20)]}
    assert (await runtime.stats()).snapshots_saved == 2


async def test_activation_from_snapshot_plus_replay_equals_full_replay(
    make_runtime: MakeRuntime, store: PostgresEventStore
) -> None:
    writer = await make_runtime([CounterBehaviour()], snapshot_every=10)
    k = key()
    for i in range(25):
        await writer.ask(k, add(i + 1, str(i)))

    from_snapshot = await make_runtime([CounterBehaviour()])
    full_replay = await make_runtime([CounterBehaviourV2()])
    a, b = await view(from_snapshot, k), await view(full_replay, k)
    assert a == b == await view(writer, k)
    assert a.version == 25 and a.total == sum(range(1, 26))

    snap_stats, full_stats = await from_snapshot.stats(), await full_replay.stats()
    assert (snap_stats.snapshots_loaded, snap_stats.events_replayed) == (1, 5)
    assert (full_stats.snapshots_ignored, full_stats.events_replayed) == (1, 25)


async def test_idle_actors_are_passivated_and_come_back(
    make_runtime: MakeRuntime, store: PostgresEventStore
) -> None:
    runtime = await make_runtime([CounterBehaviour()], idle_s=0.2)
    keys = [key() for _ in range(3)]
    for k in keys:
        await runtime.ask(k, add(3))

    async def all_passivated() -> bool:
        stats = await runtime.stats()
        # Passivation snapshots on the way out, after the actor left the table.
        return stats.active == 0 and stats.snapshots_saved == 3

    await eventually(all_passivated, "idle actors passivated and snapshotted")
    stats = await runtime.stats()
    assert stats.passivations_idle >= 3
    # Passivation snapshots what the actor had not snapshotted yet.
    for k in keys:
        snapshot = await store.load_snapshot(k.stream_id)
        assert snapshot is not None and snapshot.version == 1

    assert (await view(runtime, keys[0])).total == 3
    assert (await runtime.stats()).activations == stats.activations + 1


async def test_lru_cap_passivates_least_recently_used(make_runtime: MakeRuntime) -> None:
    runtime = await make_runtime([CounterBehaviour()], max_active=3)
    keys = [key() for _ in range(5)]
    for i, k in enumerate(keys):
        await runtime.ask(k, add(i + 1))
    stats = await runtime.stats()
    assert stats.active <= 3
    assert stats.passivations_lru == 2
    # The first actor was passivated; it reactivates with its state from the store.
    assert (await view(runtime, keys[0])).total == 1
    assert (await runtime.stats()).active <= 3


async def test_lru_cap_never_passivates_an_actor_with_work(make_runtime: MakeRuntime) -> None:
    runtime = await make_runtime([CounterBehaviour()], max_active=1)
    slow, other = key(), key()
    # Long enough for `other` to activate while it still runs, over Ray's calls too.
    running = asyncio.create_task(runtime.ask(slow, add(7, delay_s=3.0)))

    async def slow_is_busy() -> bool:
        return (await runtime.stats()).busy >= 1

    await eventually(slow_is_busy, "slow command in progress")
    await runtime.ask(other, add(1))
    stats = await runtime.stats()
    assert stats.passivations_lru == 0
    assert stats.active == 2
    outcome = await running
    assert isinstance(outcome, CommandOutcome) and outcome.last_version == 1
    assert (await view(runtime, slow)).total == 7


async def test_conflicting_writers_retry_and_lose_nothing(
    make_runtime: MakeRuntime, store: PostgresEventStore
) -> None:
    first = await make_runtime([CounterBehaviour()])
    second = await make_runtime([CounterBehaviour()])
    k = key()
    await first.ask(k, add(1, "a"))
    await second.ask(k, add(2, "b"))  # activates at version 1, appends version 2
    outcome = await first.ask(k, add(3, "c"))  # stale at version 1: conflict, reload, retry
    assert isinstance(outcome, CommandOutcome) and outcome.last_version == 3
    assert (await first.stats()).conflicts_retried == 1
    assert await assert_dense(store, k, 3) == [1, 2, 3]
    assert (await view(first, k)).notes == ("a", "b", "c")


async def test_concurrent_writers_on_one_stream_keep_versions_dense(
    make_runtime: MakeRuntime, store: PostgresEventStore
) -> None:
    runtimes = [await make_runtime([CounterBehaviour()], conflict_retries=50) for _ in range(2)]
    k = key()
    await asyncio.gather(*(runtimes[i % 2].ask(k, add(i + 1)) for i in range(30)))
    amounts = await assert_dense(store, k, 30)
    assert sorted(amounts) == list(range(1, 31))


async def test_idempotent_retry_returns_first_result_and_appends_nothing(
    make_runtime: MakeRuntime, store: PostgresEventStore
) -> None:
    runtime = await make_runtime([CounterBehaviour()])
    k = key()
    first = await runtime.ask(k, add(4, "x", command_id="same-id"))
    await runtime.ask(k, add(1, "y"))
    again = await runtime.ask(k, add(4, "x", command_id="same-id"))
    assert isinstance(first, CommandOutcome) and isinstance(again, CommandOutcome)
    assert again.duplicate and not first.duplicate
    assert (again.events, again.first_version, again.last_version) == (
        first.events,
        first.first_version,
        first.last_version,
    )
    # A fresh activation elsewhere recognises it too.
    elsewhere = await make_runtime([CounterBehaviour()])
    third = await elsewhere.ask(k, add(4, "x", command_id="same-id"))
    assert isinstance(third, CommandOutcome) and third.duplicate and third.events == first.events
    assert await assert_dense(store, k, 2) == [4, 1]
    assert (await view(elsewhere, k)).total == 5


async def test_stop_lets_running_finish_and_fails_pending(
    make_runtime: MakeRuntime, store: PostgresEventStore
) -> None:
    runtime = await make_runtime([CounterBehaviour()])
    k = key()
    running = asyncio.create_task(runtime.ask(k, add(1, "running", delay_s=2.0)))

    async def busy() -> bool:
        return (await runtime.stats()).busy == 1

    # Submitted only once the slow command runs: a remote runtime need not deliver asks made
    # back to back in the order they were made.
    await eventually(busy, "the slow command running")
    pending = [asyncio.create_task(runtime.ask(k, add(1, f"pending{i}"))) for i in range(3)]

    async def queued() -> bool:
        stats = await runtime.stats()
        return stats.busy == 1 and stats.queued == 3

    await eventually(queued, "one running and three queued commands")
    await runtime.stop(deadline_s=10.0)
    outcome = await running
    assert isinstance(outcome, CommandOutcome) and outcome.last_version == 1
    for task in pending:
        with pytest.raises(RuntimeStopping):
            await task
    with pytest.raises(RuntimeStopping):
        await runtime.ask(k, add(1))
    assert await assert_dense(store, k, 1) == [1]
    snapshot = await store.load_snapshot(k.stream_id)
    assert snapshot is not None and snapshot.version == 1


async def test_ask_timeout_leaves_the_command_running(
    runtime: RuntimeUnderTest, store: PostgresEventStore
) -> None:
    k = key()
    with pytest.raises(AskTimeout, match="keeps running"):
        await runtime.ask(k, add(9, delay_s=0.5), timeout=0.05)

    async def recorded() -> bool:
        return len(await store.read_stream(k.stream_id)) == 1

    await eventually(recorded, "the timed-out command recorded its event")
    assert (await view(runtime, k)).total == 9
