"""The `ray` actor runtime against `local`: throughput, latency, streaming, recovery.

    python bench/ray_runtime.py --quick

Starts an embedded PostgreSQL (durable commits: fsync and synchronous_commit on) and a local
Ray, then prints, each on its own line:

- commands/s, p50 and p99 of `ask` at 10, 100 and 1,000 commands in flight, for `local` and
  for `ray` with one host (the per-host figure);
- throughput with 1, 2 and 4 hosts (on a 2-core machine more hosts mostly add contention);
- one Ray actor per logical actor, at small N: what creating them costs (decision 1);
- streaming: time to first delta and p99 gap between deltas of a 100-delta turn whose
  model yields a delta every 5 ms, through `local` and `ray`;
- recovery: from SIGKILL of a host process to the next successful command on one of its
  actors (Ray restarts the host; the actor reactivates from snapshot + events).

The behaviours and the scripted model are the test doubles (tests/actors/actor_doubles.py):
each command appends one event in its own transaction.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PATHS = [str(ROOT), str(ROOT / "tests" / "actors")]
sys.path[:0] = PATHS

import ray  # noqa: E402
from actor_doubles import (  # type: ignore[import-not-found]  # noqa: E402
    AddToCounter,
    CounterBehaviour,
    ScriptedProvider,
)

from actors import ActivationTable, ActorKey, ConversationBehaviour, LocalRuntime  # noqa: E402
from actors.models.port import TextDelta  # noqa: E402
from actors.ray import ActorHost, HostSpec, RayRuntime, RaySettings  # noqa: E402
from eventstore import open_store  # noqa: E402
from eventstore.embedded import EmbeddedPostgres  # noqa: E402
from schemas.conversation import Message, RunTurn  # noqa: E402

WS = "bench"


def add() -> AddToCounter:
    return AddToCounter(command_id=uuid.uuid4().hex, workspace_id=WS, amount=1)


def turn() -> RunTurn:
    t = uuid.uuid4().hex
    return RunTurn(
        command_id=uuid.uuid4().hex,
        workspace_id=WS,
        turn_id=f"turn-{t}",
        message_id=f"msg-{t}",
        model="scripted",
        messages=(Message(role="user", content="hello"),),
        at=datetime.now(UTC),
    )


def pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def load(ask: Callable[[ActorKey], Awaitable[Any]], in_flight: int, total: int) -> str:
    keys = [ActorKey("counter", uuid.uuid4().hex) for _ in range(max(in_flight, 1))]
    latencies: list[float] = []
    sent = 0

    async def worker(k: ActorKey) -> None:
        nonlocal sent
        while sent < total:
            sent += 1
            began = time.perf_counter()
            await ask(k)
            latencies.append(time.perf_counter() - began)

    began = time.perf_counter()
    await asyncio.gather(*(worker(k) for k in keys))
    seconds = time.perf_counter() - began
    return (
        f"{len(latencies) / seconds:8.0f} cmd/s  p50 {pct(latencies, 0.5) * 1000:7.1f} ms  "
        f"p99 {pct(latencies, 0.99) * 1000:7.1f} ms"
    )


def behaviours(delay_s: float = 0.005) -> partial[list[Any]]:
    provider = ScriptedProvider(deltas=tuple(f"t{i} " for i in range(99)), delay_s=delay_s)
    return partial(list, (CounterBehaviour(), ConversationBehaviour([provider])))


def settings(hosts: int) -> RaySettings:
    return RaySettings(
        cluster=f"bench{uuid.uuid4().hex[:6]}",
        hosts=hosts,
        host_num_cpus=0.1,
        stop_hosts=True,
        dead_after_s=10.0,
    )


async def stream_figures(runtime: Any, n: int) -> str:
    firsts: list[float] = []
    gaps: list[float] = []
    for _ in range(n):
        began = time.perf_counter()
        last = None
        async for item in runtime.stream(ActorKey("conversation", uuid.uuid4().hex), turn()):
            now = time.perf_counter()
            if not isinstance(item, TextDelta):
                continue
            if last is None:
                firsts.append(now - began)
            else:
                gaps.append(now - last)
            last = now
    return (
        f"first delta p50 {pct(firsts, 0.5) * 1000:6.1f} ms  inter-delta p50 "
        f"{pct(gaps, 0.5) * 1000:5.1f} ms  p99 {pct(gaps, 0.99) * 1000:5.1f} ms"
    )


async def recovery(runtime: RayRuntime) -> str:
    k = ActorKey("counter", uuid.uuid4().hex)
    for _ in range(20):
        await runtime.ask(k, add())
    victim = (await runtime.status())["hosts"][0]
    began = time.perf_counter()
    os.kill(victim["pid"], signal.SIGKILL)
    await runtime.ask(k, add())
    return f"host kill -> next command answered: {time.perf_counter() - began:.2f} s"


async def one_actor_each(dsn: str, n: int) -> str:
    remote: Any = ray.remote(ActorHost)
    began = time.perf_counter()
    handles = [
        remote.options(num_cpus=0.01).remote(HostSpec("bench-solo", f"solo-{i}", dsn, behaviours()))
        for i in range(n)
    ]
    await asyncio.gather(*(h.ready.remote() for h in handles))
    seconds = time.perf_counter() - began
    for h in handles:
        ray.kill(h)
    return f"{n} Ray actors (one per logical actor): {seconds:.1f} s, {seconds / n:.2f} s each"


def asker(runtime: Any) -> Callable[[ActorKey], Awaitable[Any]]:
    async def ask(k: ActorKey) -> Any:
        return await runtime.ask(k, add())

    return ask


async def main(dsn: str, quick: bool) -> None:
    levels = (10, 100, 1000)
    total = 2000 if quick else 20000
    ray.init(
        num_cpus=os.cpu_count() or 2,
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=128 * 1024 * 1024,
        namespace="svc",
        runtime_env={"env_vars": {"PYTHONPATH": ":".join(PATHS)}},
    )
    try:
        store = await open_store(dsn, max_size=40)
        local = LocalRuntime(ActivationTable(store, behaviours()()))
        await local.start()
        ray_one = RayRuntime(dsn, behaviours(), settings(1))
        await ray_one.start()
        for n in levels:
            print(f"local   {n:5d} in flight  {await load(asker(local), n, total)}")
            print(f"ray 1h  {n:5d} in flight  {await load(asker(ray_one), n, total)}")
        streams = 3 if quick else 20
        print(f"stream local  {await stream_figures(local, streams)}")
        print(f"stream ray    {await stream_figures(ray_one, streams)}")
        print(await recovery(ray_one))
        await ray_one.stop()
        await local.stop()
        for hosts in (1, 2, 4):
            runtime = RayRuntime(dsn, behaviours(), settings(hosts))
            await runtime.start()
            print(f"ray {hosts}h  100 in flight  {await load(asker(runtime), 100, total)}")
            await runtime.stop()
        print(await one_actor_each(dsn, 5 if quick else 20))
        await store.close()
    finally:
        ray.shutdown()


def run(quick: bool) -> None:
    with tempfile.TemporaryDirectory(prefix="svc-bench-") as tmp:
        Path(tmp).chmod(0o755)
        server = EmbeddedPostgres(Path(tmp))
        dsn = server.start()
        try:
            asyncio.run(main(dsn, quick))
        finally:
            server.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer commands per level")
    run(parser.parse_args().quick)
