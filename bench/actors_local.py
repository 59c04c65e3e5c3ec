"""Benchmarks of the local actor runtime. Prints figures; asserts nothing.

    .venv/bin/python bench/actors_local.py [--quick]

(a) commands/s through mailboxes with no store (a behaviour whose handler yields at once);
    target >= 50,000/s.
(b) activation of a 1,000-event conversation: from a snapshot at its head (target p99 <= 2 ms)
    and by full replay.
(c) end-to-end commands/s with one append each on an embedded PostgreSQL (durable commits).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors import (
    ActivationTable,
    ActorContext,
    ActorKey,
    Behaviour,
    ConversationBehaviour,
    ConversationState,
    LocalRuntime,
    conversation_key,
)
from actors.context import Activation, Counters, ExecutionPolicy
from actors.models.port import Finished, ModelEvent, ModelRequest, TextDelta, Usage
from eventstore import STORE_MIGRATIONS, Database, PostgresEventStore, apply_migrations
from eventstore.embedded import temporary_server
from schemas.commands import Command
from schemas.conversation import (
    Message,
    RenameConversation,
    RunTurn,
    StartConversation,
)
from schemas.events import EVENTS, Event

WS = "bench"


# --- (a) mailboxes only ---------------------------------------------------------------------


class Ping(Command):
    pass


class EchoState(BaseModel):
    model_config = ConfigDict(frozen=True)


class EchoBehaviour(Behaviour[EchoState]):
    kind: ClassVar[str] = "echo"
    state_type: ClassVar[type[BaseModel]] = EchoState

    def initial_state(self, key: ActorKey) -> EchoState:
        return EchoState()

    def decide(self, state: EchoState, command: Command) -> Sequence[Event]:
        return []

    def evolve(self, state: EchoState, event: Event) -> EchoState:
        return state

    async def handle(self, ctx: ActorContext[EchoState], command: Command) -> AsyncIterator[Any]:
        yield command.command_id


async def bench_mailboxes(total: int, actors: int) -> None:
    table = ActivationTable(None, [EchoBehaviour()])
    runtime = LocalRuntime(table)
    await runtime.start()
    keys = [ActorKey("echo", str(i)) for i in range(actors)]
    commands = [Ping(command_id=str(i), workspace_id=WS) for i in range(total)]
    for k in keys:  # activate first: (a) measures steady-state commands
        await runtime.ask(k, commands[0])

    started = time.perf_counter()
    replies = [table.submit(keys[i % actors], c) for i, c in enumerate(commands)]
    for reply in replies:
        await reply.last()
    elapsed = time.perf_counter() - started
    print(f"(a) submit+reply, {actors} actors: {total / elapsed:,.0f} commands/s")

    batch = 1_000
    started = time.perf_counter()
    for lo in range(0, total, batch):
        chunk = range(lo, min(lo + batch, total))
        await asyncio.gather(*(runtime.ask(keys[i % actors], commands[i]) for i in chunk))
    elapsed = time.perf_counter() - started
    print(f"(a) runtime.ask (gathered by {batch}): {total / elapsed:,.0f} commands/s")
    stats = table.stats()
    print(f"    processed {stats.commands_processed:,}, failed {stats.commands_failed}")
    await runtime.stop()


# --- (b) activation -------------------------------------------------------------------------


class OneWordProvider:
    name = "bench"

    def serves(self, model: str) -> bool:
        return True

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelEvent]:
        yield TextDelta("The answer is forty-two, as it was the last time you asked.")
        yield Finished("stop", Usage(12, 14))


class FullReplay(ConversationBehaviour):
    state_schema_version: ClassVar[int] = 999  # no snapshot has this schema: full replay


def run_turn(n: int) -> RunTurn:
    return RunTurn(
        command_id=uuid.uuid4().hex,
        workspace_id=WS,
        turn_id=f"turn-{n}",
        message_id=f"msg-{n}",
        model="bench",
        messages=(Message(role="user", content=f"question number {n}: what is the answer?"),),
        at=datetime.now(UTC),
    )


async def build_conversation(store: PostgresEventStore, events: int) -> ActorKey:
    key = conversation_key(uuid.uuid4().hex)
    table = ActivationTable(store, [ConversationBehaviour([OneWordProvider()])])
    await table.start()
    n = 0
    # The first turn appends 4 events (it starts the conversation), every later one 3.
    while 1 + 3 * n < events:
        await table.submit(key, run_turn(n)).last()
        n += 1
    await table.stop()  # passivation snapshots the head
    return key


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def time_loads(
    store: PostgresEventStore, key: ActorKey, behaviour: ConversationBehaviour, rounds: int
) -> tuple[list[float], int]:
    samples: list[float] = []
    version = 0
    for _ in range(rounds):
        activation: Activation[ConversationState] = Activation(
            key, behaviour, store, EVENTS, ExecutionPolicy(), Counters()
        )
        started = time.perf_counter()
        await activation.load()
        samples.append((time.perf_counter() - started) * 1000)
        version = activation.version
    return samples, version


async def bench_activation(store: PostgresEventStore, rounds: int) -> None:
    key = await build_conversation(store, 1_000)
    snapshot = await store.load_snapshot(key.stream_id)
    for label, behaviour in (
        ("from snapshot", ConversationBehaviour()),
        ("full replay  ", FullReplay()),
    ):
        samples, version = await time_loads(store, key, behaviour, rounds)
        print(
            f"(b) activation {label} ({version} events, snapshot at "
            f"{snapshot.version if snapshot else '-'}): p50 {statistics.median(samples):.2f} ms, "
            f"p99 {percentile(samples, 0.99):.2f} ms, max {max(samples):.2f} ms ({rounds} runs)"
        )


# --- (c) end to end -------------------------------------------------------------------------


async def bench_end_to_end(store: PostgresEventStore, total: int, actors: int) -> None:
    runtime = LocalRuntime(ActivationTable(store, [ConversationBehaviour()]))
    await runtime.start()
    keys = [conversation_key(uuid.uuid4().hex) for _ in range(actors)]
    now = datetime.now(UTC)
    await asyncio.gather(
        *(
            runtime.ask(k, StartConversation(command_id=uuid.uuid4().hex, workspace_id=WS, at=now))
            for k in keys
        )
    )
    renames = [
        RenameConversation(command_id=uuid.uuid4().hex, workspace_id=WS, title=f"title {i}", at=now)
        for i in range(total)
    ]

    async def one_actor(j: int) -> None:
        for i in range(j, total, actors):
            await runtime.ask(keys[j], renames[i])

    started = time.perf_counter()
    await asyncio.gather(*(one_actor(j) for j in range(actors)))
    elapsed = time.perf_counter() - started
    print(
        f"(c) end to end, {actors} actors, one append per command, durable commits: "
        f"{total / elapsed:,.0f} commands/s ({total} commands in {elapsed:.2f} s)"
    )
    await runtime.stop()


async def main(quick: bool) -> None:
    await bench_mailboxes(200_000 if quick else 1_000_000, 1_000)
    with temporary_server("svc-bench-pg-") as url:
        db = await Database.connect(url, max_size=20)
        try:
            await apply_migrations(db, [STORE_MIGRATIONS])
            store = PostgresEventStore(db)
            await bench_activation(store, 100 if quick else 1_000)
            await bench_end_to_end(store, 2_000 if quick else 20_000, 32)
        finally:
            await db.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller runs (minutes -> seconds)")
    asyncio.run(main(parser.parse_args().quick))
