"""The `ray` runtime's shard map: which host runs which logical actors, and since when.

A logical actor's key hashes to one of `NUM_SHARDS` shards with a stable hash (blake2b of
"kind:id": Python's `hash()` is salted per process, so two gateways would disagree). Each
shard has one owning host and an epoch that grows by one every time the shard changes owner.
The map lives in PostgreSQL (`actor_shards`, migration `actors/0001`); routers cache it and
reload it on `NOTIFY svc_shards` or when a host answers `WrongEpoch`.

Why epochs: a router's cached map can be stale. Every command carries the (shard, epoch) it
was routed with, and a host runs it only when that is exactly the assignment it holds; a
moved shard's old owner refuses its old epoch, so during and after a move a command is
retried by the router against the new owner instead of running on two hosts. The event
store's expected-version fence (ARCHITECTURE decision 2) remains the last line for a host
that is cut off but still alive.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

from actors.behaviour import ActorKey
from eventstore.db import Connection, Database, translate_errors
from eventstore.migrate import MigrationSource

NUM_SHARDS = 1024
NOTIFY_CHANNEL = "svc_shards"
SHARD_MIGRATIONS = MigrationSource("actors", "actors.migrations")


def shard_of(key: ActorKey, shards: int = NUM_SHARDS) -> int:
    digest = hashlib.blake2b(key.stream_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % shards


def host_name(cluster: str, index: int) -> str:
    return f"{cluster}-host-{index}"


def host_index(cluster: str, name: str) -> int | None:
    prefix = f"{cluster}-host-"
    if not name.startswith(prefix) or not name[len(prefix) :].isdigit():
        return None
    return int(name[len(prefix) :])


@dataclass(frozen=True, slots=True)
class ShardMap:
    """Owner and epoch of every shard of one cluster (index = shard number)."""

    cluster: str
    owners: tuple[str, ...]
    epochs: tuple[int, ...]

    def route(self, shard: int) -> tuple[str, int]:
        return self.owners[shard], self.epochs[shard]

    def shards_of(self, host: str) -> list[int]:
        return [s for s, owner in enumerate(self.owners) if owner == host]

    def counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for owner in self.owners:
            counts[owner] = counts.get(owner, 0) + 1
        return counts


@dataclass(frozen=True, slots=True)
class Move:
    shard: int
    source: str
    target: str


def plan_moves(
    owners: Sequence[str], hosts: Sequence[str], load: Mapping[int, float] | None = None
) -> list[Move]:
    """The fewest moves that spread the shards evenly over `hosts`.

    Shards of hosts not in `hosts` (removed or dead) move first; then hosts over their share
    give away their least loaded shards (`load`: in-flight commands plus active actors, so
    idle shards move first and a busy conversation is rarely interrupted)."""
    if not hosts:
        raise ValueError("plan_moves needs at least one host")
    load = load or {}
    held: dict[str, list[int]] = {h: [] for h in hosts}
    orphans: list[int] = []
    for shard, owner in enumerate(owners):
        (held[owner] if owner in held else orphans).append(shard)
    base, extra = divmod(len(owners), len(hosts))
    # The hosts holding most keep the remainder: fewer moves.
    ranked = sorted(hosts, key=lambda h: -len(held[h]))
    target = {h: base + (1 if i < extra else 0) for i, h in enumerate(ranked)}
    giving: list[int] = sorted(orphans, key=lambda s: (load.get(s, 0.0), s))
    for h in hosts:
        surplus = len(held[h]) - target[h]
        if surplus > 0:
            by_load = sorted(held[h], key=lambda s: (load.get(s, 0.0), s))
            giving.extend(by_load[:surplus])
            held[h] = by_load[surplus:]
    moves: list[Move] = []
    receivers = iter([(h, target[h] - len(held[h])) for h in hosts if len(held[h]) < target[h]])
    want = 0
    receiver = ""
    for shard in giving:
        while want <= 0:
            receiver, want = next(receivers)
        moves.append(Move(shard, owners[shard], receiver))
        want -= 1
    return moves


# --- persistence ----------------------------------------------------------------------------


async def load_map(db: Database, cluster: str) -> ShardMap | None:
    async with db.acquire() as conn:
        rows = await conn.fetch(
            "SELECT shard, host, epoch FROM actor_shards WHERE cluster = $1 ORDER BY shard",
            cluster,
        )
    if len(rows) != NUM_SHARDS:
        return None
    return ShardMap(cluster, tuple(r["host"] for r in rows), tuple(int(r["epoch"]) for r in rows))


async def load_assignment(db: Database, cluster: str, host: str) -> dict[int, int]:
    """The shards `host` owns, with their epochs (what a host accepts commands for)."""
    async with db.acquire() as conn:
        rows = await conn.fetch(
            "SELECT shard, epoch FROM actor_shards WHERE cluster = $1 AND host = $2",
            cluster,
            host,
        )
    return {int(r["shard"]): int(r["epoch"]) for r in rows}


async def desired_hosts(db: Database, cluster: str) -> int | None:
    async with db.acquire() as conn:
        value = await conn.fetchval("SELECT hosts FROM actor_clusters WHERE cluster = $1", cluster)
    return None if value is None else int(value)


async def create_cluster(db: Database, cluster: str, hosts: int) -> int:
    """Create the cluster row and a round-robin map over `hosts` hosts at epoch 1, unless the
    cluster exists; returns the cluster's host count (the stored one wins)."""
    async with db.transaction() as conn:
        inserted = await conn.fetchval(
            "INSERT INTO actor_clusters (cluster, hosts) VALUES ($1, $2) "
            "ON CONFLICT (cluster) DO NOTHING RETURNING hosts",
            cluster,
            hosts,
        )
        if inserted is None:
            return int(
                await conn.fetchval("SELECT hosts FROM actor_clusters WHERE cluster = $1", cluster)
            )
        await conn.executemany(
            "INSERT INTO actor_shards (cluster, shard, host, epoch) VALUES ($1, $2, $3, 1)",
            [(cluster, s, host_name(cluster, s % hosts)) for s in range(NUM_SHARDS)],
        )
        await _notify_on_commit(conn, cluster)
    return hosts


async def reset_cluster(db: Database, cluster: str, hosts: int) -> int:
    """Lay the map out afresh over `hosts` hosts, round-robin, every shard one epoch later
    (created when missing), and make `hosts` the cluster's count; returns it. For a start on
    a Ray of this process's own, where no host of an earlier start survives: the setting
    decides, not a count stored by a start that could not place its hosts."""
    async with db.transaction() as conn:
        await conn.execute(
            "INSERT INTO actor_clusters (cluster, hosts) VALUES ($1, $2) "
            "ON CONFLICT (cluster) DO UPDATE SET hosts = $2, updated_at = now()",
            cluster,
            hosts,
        )
        await conn.executemany(
            "INSERT INTO actor_shards (cluster, shard, host, epoch) VALUES ($1, $2, $3, 1) "
            "ON CONFLICT (cluster, shard) DO UPDATE "
            "SET host = excluded.host, epoch = actor_shards.epoch + 1, moved_at = now()",
            [(cluster, s, host_name(cluster, s % hosts)) for s in range(NUM_SHARDS)],
        )
        await _notify_on_commit(conn, cluster)
    return hosts


async def set_desired_hosts(db: Database, cluster: str, hosts: int) -> None:
    async with db.acquire() as conn:
        await conn.execute(
            "UPDATE actor_clusters SET hosts = $2, updated_at = now() WHERE cluster = $1",
            cluster,
            hosts,
        )


async def move_shards(
    db: Database, cluster: str, shards: Sequence[int], source: str, target: str
) -> dict[int, int]:
    """Give `shards` (still owned by `source`) to `target`, one epoch later each; returns the
    new epochs of the shards that moved. Routers are notified by the commit itself."""
    async with db.transaction() as conn:
        rows = await conn.fetch(
            "UPDATE actor_shards SET host = $4, epoch = epoch + 1, moved_at = now() "
            "WHERE cluster = $1 AND shard = ANY($2::integer[]) AND host = $3 "
            "RETURNING shard, epoch",
            cluster,
            list(shards),
            source,
            target,
        )
        await _notify_on_commit(conn, cluster)
    return {int(r["shard"]): int(r["epoch"]) for r in rows}


async def _notify_on_commit(conn: Connection, cluster: str) -> None:
    """Tell the routers that the map changed, in the transaction that changes it: PostgreSQL
    sends the notification when (and only if) the transaction commits. A notification sent
    after the commit could fail on its own, and a move reported failed after it committed
    had the old owner take its shards back (`RayRuntime._move` reopens them on failure)."""
    await conn.execute("SELECT pg_notify($1, $2)", NOTIFY_CHANNEL, cluster)


async def drop_cluster(db: Database, cluster: str) -> None:
    async with db.acquire() as conn:
        await conn.execute("DELETE FROM actor_clusters WHERE cluster = $1", cluster)


def _lock_key(cluster: str) -> int:
    digest = hashlib.blake2b(f"svc_shards:{cluster}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


CLAIM_KEEPALIVES = (
    "SET tcp_keepalives_idle = 10; SET tcp_keepalives_interval = 5; SET tcp_keepalives_count = 3"
)


async def claim_cluster(db: Database, cluster: str, *, private: bool) -> Connection | None:
    """A connection of its own holding this process's use of `cluster` until it is closed
    (a session advisory lock; the server lets go of it when the process dies): shared by
    gateways routing over one Ray, exclusive to one whose Ray is its own. Host names are the
    same in every Ray (`<cluster>-host-<i>`), so two private Rays on one map would each run
    one shard's actors, and each would lay the map out again at its start. None when another
    process holds the cluster against this use."""
    key = _lock_key(f"use:{cluster}")
    conn = await db.connect_dedicated()
    take = "pg_try_advisory_lock" if private else "pg_try_advisory_lock_shared"
    try:
        with translate_errors():
            # A machine that dies without closing its socket holds the lock until the server
            # finds the connection dead: in seconds with these, not the system's two hours.
            await conn.execute(CLAIM_KEEPALIVES)
            if await conn.fetchval(f"SELECT {take}($1)", key):
                return conn
    except BaseException:
        conn.terminate()
        raise
    conn.terminate()
    return None


@asynccontextmanager
async def cluster_lock(db: Database, cluster: str, *, wait_s: float) -> AsyncIterator[bool]:
    """A session advisory lock serialising map changes of one cluster across gateways (a
    move spans several transactions and host calls). Yields False if not had in `wait_s`."""
    key = _lock_key(cluster)
    async with db.acquire() as conn:
        got = await _try_lock(conn, key, wait_s)
        try:
            yield got
        finally:
            if got:
                await conn.execute("SELECT pg_advisory_unlock($1)", key)


async def _try_lock(conn: Connection, key: int, wait_s: float) -> bool:
    loop = asyncio.get_running_loop()
    end = loop.time() + wait_s
    while True:
        if await conn.fetchval("SELECT pg_try_advisory_lock($1)", key):
            return True
        if loop.time() >= end:
            return False
        await asyncio.sleep(0.05)
