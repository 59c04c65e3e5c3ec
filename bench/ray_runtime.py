"""The `ray` actor runtime against `local`: throughput, latency, streaming, recovery, scaling.

    python bench/ray_runtime.py --quick                  # every part, small samples
    python bench/ray_runtime.py throughput streams       # some parts, full samples
    python bench/ray_runtime.py recovery --kills 30

Starts an embedded PostgreSQL (durable commits: fsync and synchronous_commit on) and a local
Ray (`node-loss` starts its own multi-node Ray, `ray.cluster_utils.Cluster`), then prints,
each on its own line, the figures of the parts asked for (all by default):

- throughput: commands/s, p50 and p99 of `ask` at 10, 100 and 1,000 commands in flight, for
  `local` and for `ray` with one host (the per-host figure), and of a Ray call that does
  nothing on the host (the ceiling Ray's per-call cost sets);
- streams: time to first delta and p99 gap between deltas of a 100-delta turn whose model
  yields a delta every 5 ms, through `local` and `ray`; then the most concurrent streams one
  host keeps (see `stream_capacity`);
- recovery: SIGKILL of a host process, many times: time until every affected logical actor
  (one on each of several shards of the killed host) has answered a command again (Ray
  restarts the host; the actors reactivate from snapshot + events);
- node-loss: a two-node Ray cluster with one host per node and no room for a second host on
  the head; the worker node is removed, and the time until its shards are on the live host and
  the affected actors answer again is measured;
- scaling: commands/s at 100 in flight with 1, 2 and 4 hosts;
- solo: one Ray actor per logical actor, at small N: what creating them costs (decision 1).

The behaviours and the scripted model are the test doubles (tests/actors/actor_doubles.py):
each command appends one event in its own transaction.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import signal
import sys
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
from ray.cluster_utils import Cluster  # noqa: E402

from actors import ActivationTable, ActorKey, ConversationBehaviour, LocalRuntime  # noqa: E402
from actors.models.port import TextDelta  # noqa: E402
from actors.ray import ActorHost, HostSpec, RayRuntime, RaySettings  # noqa: E402
from actors.shards import ShardMap, shard_of  # noqa: E402
from eventstore import open_store  # noqa: E402
from eventstore.embedded import temporary_server  # noqa: E402
from schemas.conversation import Message, RunTurn  # noqa: E402

WS = "bench"
PARTS = ("throughput", "streams", "recovery", "node-loss", "scaling", "solo")
AFFECTED = 8
"""Logical actors per kill whose answers are awaited, each on a different shard of the victim."""
STREAM_OK_GAP_S = 0.1
"""A host keeps N streams if their p99 gap between deltas stays within two batch windows."""


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


def ms(seconds: float) -> str:
    return f"{seconds * 1000:7.1f} ms"


def spread(samples: Sequence[float]) -> str:
    return (
        f"n={len(samples)}  p50 {pct(samples, 0.5):.2f} s  p99 {pct(samples, 0.99):.2f} s  "
        f"max {max(samples):.2f} s"
    )


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
        f"{len(latencies) / seconds:8.0f} cmd/s  p50 {ms(pct(latencies, 0.5))}  "
        f"p99 {ms(pct(latencies, 0.99))}"
    )


def behaviours(delay_s: float = 0.005) -> partial[list[Any]]:
    provider = ScriptedProvider(deltas=tuple(f"t{i} " for i in range(99)), delay_s=delay_s)
    return partial(list, (CounterBehaviour(), ConversationBehaviour([provider])))


def settings(hosts: int, **overrides: Any) -> RaySettings:
    values: dict[str, Any] = {
        "cluster": f"bench{uuid.uuid4().hex[:6]}",
        "hosts": hosts,
        "host_num_cpus": 0.1,
        "stop_hosts": True,
    }
    values.update(overrides)
    return RaySettings(**values)


def asker(runtime: Any) -> Callable[[ActorKey], Awaitable[Any]]:
    async def ask(k: ActorKey) -> Any:
        return await runtime.ask(k, add())

    return ask


def pinger(runtime: RayRuntime) -> Callable[[ActorKey], Awaitable[Any]]:
    """A Ray call that does nothing on the host: the ceiling Ray's per-call cost puts on
    one host's commands/s, whatever the table and the store do."""
    assert runtime.shard_map is not None
    host = ray.get_actor(runtime.shard_map.owners[0], namespace="svc")

    async def ping(_k: ActorKey) -> Any:
        return await host.ping.remote()

    return ping


# --- streams ------------------------------------------------------------------------------


async def one_stream(runtime: Any, firsts: list[float], gaps: list[float]) -> None:
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


async def stream_figures(runtime: Any, n: int) -> str:
    firsts: list[float] = []
    gaps: list[float] = []
    for _ in range(n):
        await one_stream(runtime, firsts, gaps)
    return (
        f"first delta p50 {ms(pct(firsts, 0.5))}  inter-delta p50 "
        f"{ms(pct(gaps, 0.5))}  p99 {ms(pct(gaps, 0.99))}"
    )


async def stream_capacity(runtime: Any, levels: Sequence[int]) -> list[str]:
    """N concurrent 100-delta turns on one host, each delta 20 ms apart (50 tokens/s, a fast
    model); N is kept if the p99 gap between deltas stays within `STREAM_OK_GAP_S`."""
    lines: list[str] = []
    kept = 0
    for n in levels:
        firsts: list[float] = []
        gaps: list[float] = []
        began = time.perf_counter()
        await asyncio.gather(*(one_stream(runtime, firsts, gaps) for _ in range(n)))
        seconds = time.perf_counter() - began
        ok = pct(gaps, 0.99) <= STREAM_OK_GAP_S
        kept = n if ok else kept
        lines.append(
            f"stream ray 1h {n:4d} concurrent  first delta p50 {ms(pct(firsts, 0.5))} "
            f"p99 {ms(pct(firsts, 0.99))}  gap p99 {ms(pct(gaps, 0.99))}  "
            f"{len(gaps) / seconds:7.0f} deltas/s  {'ok' if ok else 'over'}"
        )
        if not ok:
            break
    lines.append(f"max concurrent streams per host (gap p99 <= {ms(STREAM_OK_GAP_S)}): {kept}")
    return lines


# --- recovery -----------------------------------------------------------------------------


def keys_on(shard_map: ShardMap, host: str, n: int) -> list[ActorKey]:
    """`n` counters on distinct shards owned by `host`."""
    keys: list[ActorKey] = []
    shards: set[int] = set()
    while len(keys) < n:
        k = ActorKey("counter", uuid.uuid4().hex)
        shard = shard_of(k)
        if shard_map.route(shard)[0] == host and shard not in shards:
            shards.add(shard)
            keys.append(k)
    return keys


async def answered_after(runtime: RayRuntime, keys: Sequence[ActorKey], began: float) -> float:
    await asyncio.gather(*(runtime.ask(k, add()) for k in keys))
    return time.perf_counter() - began


async def kill_and_time(runtime: RayRuntime, victim: dict[str, Any]) -> float:
    assert runtime.shard_map is not None
    keys = keys_on(runtime.shard_map, victim["name"], AFFECTED)
    for _ in range(3):  # active, with a few events to replay
        await asyncio.gather(*(runtime.ask(k, add()) for k in keys))
    began = time.perf_counter()
    os.kill(victim["pid"], signal.SIGKILL)
    return await answered_after(runtime, keys, began)


async def recovery(runtime: RayRuntime, kills: int) -> str:
    samples: list[float] = []
    for i in range(kills):
        hosts = (await runtime.status())["hosts"]
        samples.append(await kill_and_time(runtime, hosts[i % len(hosts)]))
    return f"host kill -> {AFFECTED} affected actors answered  {spread(samples)}"


async def node_loss_trial(cluster: Cluster, dsn: str) -> float:
    """One loss of the node of one of two hosts; the survivor's node has no CPU left for a
    second host, so the shards must move (after `dead_after_s` of failed pings)."""
    worker = cluster.add_node(num_cpus=1, object_store_memory=80 * 1024 * 1024)
    cluster.wait_for_nodes()
    runtime = RayRuntime(dsn, behaviours(), settings(2, host_num_cpus=1.0, address="auto"))
    await runtime.start()
    hosts = (await runtime.status())["hosts"]
    victim = next(h for h in hosts if h["node"] == worker.node_id)
    try:
        assert runtime.shard_map is not None
        keys = keys_on(runtime.shard_map, victim["name"], AFFECTED)
        await asyncio.gather(*(runtime.ask(k, add()) for k in keys))
        began = time.perf_counter()
        # A lost machine takes every process with it; Ray's `remove_node` ends the raylet,
        # but a worker process (the host) outlives it for a while and keeps answering.
        cluster.remove_node(worker, allow_graceful=False)
        os.kill(victim["pid"], signal.SIGKILL)
        return await answered_after(runtime, keys, began)
    finally:
        # The lost host cannot be placed again: end it so that stopping does not wait on it.
        ray.kill(ray.get_actor(victim["name"], namespace="svc"), no_restart=True)
        await runtime.stop(deadline_s=2.0)


async def node_loss(cluster: Cluster, dsn: str, trials: int) -> str:
    samples = [await node_loss_trial(cluster, dsn) for _ in range(trials)]
    dead_after = RaySettings().dead_after_s
    return f"node loss -> {AFFECTED} affected actors answered  {spread(samples)}  " + (
        f"(dead_after_s {dead_after:.0f})"
    )


# --- scaling and the one-actor-per-logical-actor contrast ---------------------------------


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


async def scaling(dsn: str, total: int) -> None:
    for hosts in (1, 2, 4):
        runtime = RayRuntime(dsn, behaviours(), settings(hosts))
        await runtime.start()
        print(f"ray {hosts}h  100 in flight  {await load(asker(runtime), 100, total)}", flush=True)
        await runtime.stop()


# --- parts --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Plan:
    parts: tuple[str, ...]
    quick: bool
    kills: int
    node_trials: int


async def throughput(dsn: str, total: int) -> None:
    store = await open_store(dsn, max_size=40)
    local = LocalRuntime(ActivationTable(store, behaviours()()))
    await local.start()
    ray_one = RayRuntime(dsn, behaviours(), settings(1))
    await ray_one.start()
    for n in (10, 100, 1000):
        print(f"local   {n:5d} in flight  {await load(asker(local), n, total)}", flush=True)
        print(f"ray 1h  {n:5d} in flight  {await load(asker(ray_one), n, total)}", flush=True)
    print(f"ray ping  100 in flight  {await load(pinger(ray_one), 100, total)}", flush=True)
    await ray_one.stop()
    await local.stop()
    await store.close()


async def streams(dsn: str, quick: bool) -> None:
    store = await open_store(dsn, max_size=40)
    local = LocalRuntime(ActivationTable(store, behaviours()()))
    await local.start()
    ray_one = RayRuntime(dsn, behaviours(), settings(1))
    await ray_one.start()
    n = 3 if quick else 20
    print(f"stream local  {await stream_figures(local, n)}", flush=True)
    print(f"stream ray    {await stream_figures(ray_one, n)}", flush=True)
    await ray_one.stop()
    await local.stop()
    await store.close()
    wide = RayRuntime(dsn, behaviours(delay_s=0.02), settings(1))
    await wide.start()
    levels = (50, 200, 400) if quick else (50, 100, 200, 400, 800, 1600)
    for line in await stream_capacity(wide, levels):
        print(line, flush=True)
    await wide.stop()


async def local_ray_parts(dsn: str, plan: Plan) -> None:
    total = 2000 if plan.quick else 6000
    if "throughput" in plan.parts:
        await throughput(dsn, total)
    if "streams" in plan.parts:
        await streams(dsn, plan.quick)
    if "recovery" in plan.parts:
        runtime = RayRuntime(dsn, behaviours(), settings(2))
        await runtime.start()
        print(await recovery(runtime, plan.kills), flush=True)
        await runtime.stop()
    if "scaling" in plan.parts:
        await scaling(dsn, total)
    if "solo" in plan.parts:
        print(await one_actor_each(dsn, 5 if plan.quick else 20), flush=True)


def ray_env() -> dict[str, Any]:
    return {"env_vars": {"PYTHONPATH": ":".join(PATHS)}}


def run_local_ray(dsn: str, plan: Plan) -> None:
    ray.init(
        num_cpus=os.cpu_count() or 2,
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=128 * 1024 * 1024,
        namespace="svc",
        runtime_env=ray_env(),
    )
    try:
        asyncio.run(local_ray_parts(dsn, plan))
    finally:
        ray.shutdown()


def run_node_loss(dsn: str, trials: int) -> None:
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "object_store_memory": 96 * 1024 * 1024},
    )
    ray.init(address=cluster.address, namespace="svc", log_to_driver=False, runtime_env=ray_env())
    try:
        print(asyncio.run(node_loss(cluster, dsn, trials)), flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()  # type: ignore[no-untyped-call]


def run(plan: Plan) -> None:
    with temporary_server("svc-bench-") as dsn:
        if set(plan.parts) - {"node-loss"}:
            run_local_ray(dsn, plan)
        if "node-loss" in plan.parts:
            run_node_loss(dsn, plan.node_trials)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("parts", nargs="*", choices=PARTS, help="default: all")
    parser.add_argument("--quick", action="store_true", help="fewer commands, kills, streams")
    parser.add_argument("--kills", type=int, help="host kills for recovery (20; quick 5)")
    parser.add_argument("--node-trials", type=int, help="node losses (8; quick 2)")
    args = parser.parse_args()
    run(
        Plan(
            parts=tuple(args.parts or PARTS),
            quick=args.quick,
            kills=args.kills or (5 if args.quick else 20),
            node_trials=args.node_trials or (2 if args.quick else 8),
        )
    )
