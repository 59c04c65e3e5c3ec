"""Two processes driving turns of one conversation at once. Prints figures; asserts nothing.

    .venv/bin/python bench/actor_contention.py [--rounds 20] [--turns 10]

Each round starts one conversation, then two worker processes (two gateways sharing the
database) each run `--turns` turns of it at once, both starting at the same moment. Each
process has its own activation of the conversation, so their appends meet at the store's
version fence: a stale one catches up and decides again, up to the table's
`conflict_retries`. Printed: turns recorded, turns given up (`ConflictRetriesExhausted`, a
409 to the client; for the answer's append, a paid answer recorded as a failure), conflicts
retried, and the wall time. The model answers at once unless BENCH_MODEL_MS says how long
it takes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pg_support import create_database, drop_database, durability, server

from actors import (
    ActivationTable,
    ConflictRetriesExhausted,
    ConversationBehaviour,
    LocalRuntime,
    conversation_key,
)
from actors.models.port import Finished, ModelEvent, ModelRequest, TextDelta, Usage
from eventstore import STORE_MIGRATIONS, Database, PostgresEventStore, apply_migrations
from schemas.conversation import Message, RunTurn, StartConversation

WS = "bench"
MODEL_S = float(os.environ.get("BENCH_MODEL_MS", "0")) / 1000


class QuickModel:
    name = "bench"

    def serves(self, model: str) -> bool:
        return True

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelEvent]:
        await asyncio.sleep(MODEL_S)  # a model call: the other process appends meanwhile
        yield TextDelta("forty-two")
        yield Finished("stop", Usage(5, 1))


def run_turn(tag: str) -> RunTurn:
    return RunTurn(
        command_id=uuid.uuid4().hex,
        workspace_id=WS,
        turn_id=f"turn-{tag}",
        message_id=f"msg-{tag}",
        model="bench",
        messages=(Message(role="user", content=f"question {tag}"),),
        at=datetime.now(UTC),
    )


async def worker(
    dsn: str, conversation: str, turns: int, name: str, start_at: float
) -> dict[str, int]:
    db = await Database.connect(dsn, max_size=4)
    table = ActivationTable(
        PostgresEventStore(db), [ConversationBehaviour([QuickModel()], call_budget_s=lambda: 60.0)]
    )
    runtime = LocalRuntime(table)
    await runtime.start()
    # Both processes are ready (imports, pool) before either sends a turn, so their turns
    # overlap from the first.
    await asyncio.sleep(max(0.0, start_at - time.time()))
    outcomes = await asyncio.gather(
        *(
            runtime.ask(conversation_key(conversation), run_turn(f"{name}-{i}"))
            for i in range(turns)
        ),
        return_exceptions=True,
    )
    conflicts = table.stats().conflicts_retried
    await runtime.stop()
    await db.close()
    unexpected = [o for o in outcomes if isinstance(o, BaseException)]
    exhausted = [o for o in unexpected if isinstance(o, ConflictRetriesExhausted)]
    if len(exhausted) != len(unexpected):
        raise next(o for o in unexpected if not isinstance(o, ConflictRetriesExhausted))
    return {"ok": turns - len(exhausted), "gave_up": len(exhausted), "conflicts": conflicts}


async def one_round(dsn: str, turns: int) -> dict[str, int]:
    conversation = uuid.uuid4().hex
    db = await Database.connect(dsn, max_size=1)
    runtime = LocalRuntime(ActivationTable(PostgresEventStore(db), [ConversationBehaviour()]))
    await runtime.start()
    start = StartConversation(command_id=uuid.uuid4().hex, workspace_id=WS, at=datetime.now(UTC))
    await runtime.ask(conversation_key(conversation), start)
    await runtime.stop()
    await db.close()
    start_at = time.time() + 2.5  # both workers are up by then on this machine
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            __file__,
            "--worker",
            dsn,
            conversation,
            str(turns),
            name,
            str(start_at),
            stdout=asyncio.subprocess.PIPE,
        )
        for name in ("a", "b")
    ]
    totals = {"ok": 0, "gave_up": 0, "conflicts": 0}
    for proc in procs:
        out, _ = await proc.communicate()
        if proc.returncode != 0:
            raise SystemExit(f"worker failed with exit code {proc.returncode}")
        for k, v in json.loads(out).items():
            totals[k] += v
    return totals


async def main(rounds: int, turns: int) -> None:
    with server() as url:
        dsn = await create_database(url)
        try:
            db = await Database.connect(dsn, max_size=1)
            await apply_migrations(db, [STORE_MIGRATIONS])
            await db.close()
            print(
                f"PostgreSQL {await durability(dsn)}; {rounds} rounds, "
                f"2 processes x {turns} concurrent turns on one conversation"
            )
            totals = {"ok": 0, "gave_up": 0, "conflicts": 0}
            started = time.perf_counter()
            for i in range(rounds):
                got = await one_round(dsn, turns)
                print(f"  round {i + 1}: {got}", flush=True)
                for k, v in got.items():
                    totals[k] += v
            elapsed = time.perf_counter() - started
            print(
                f"turns recorded {totals['ok']}, given up {totals['gave_up']}, "
                f"conflicts retried {totals['conflicts']}, {elapsed:.1f} s"
            )
        finally:
            await drop_database(url, dsn)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _, _, dsn, conversation, turns, name, start_at = sys.argv
        outcome = asyncio.run(worker(dsn, conversation, int(turns), name, float(start_at)))
        print(json.dumps(outcome))
    else:
        parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
        parser.add_argument("--rounds", type=int, default=20)
        parser.add_argument("--turns", type=int, default=10)
        args = parser.parse_args()
        asyncio.run(main(args.rounds, args.turns))
