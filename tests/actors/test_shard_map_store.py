"""The Ray runtime's shard map as the database keeps it (actors/shards.py), without Ray."""

from __future__ import annotations

from collections import Counter

import pytest

from actors.shards import (
    NUM_SHARDS,
    SHARD_MIGRATIONS,
    create_cluster,
    desired_hosts,
    host_name,
    load_map,
    move_shards,
    reset_cluster,
)
from eventstore import Database, StoreError, apply_migrations


async def test_a_private_rays_start_lays_the_map_out_for_the_hosts_it_asks_for(
    store_db: Database,
) -> None:
    """A start that stored four hosts the machine could not place left the count at four
    for good: later starts reused it, whatever SVC_ACTOR_HOSTS said."""
    await apply_migrations(store_db, [SHARD_MIGRATIONS])
    assert await create_cluster(store_db, "c", 4) == 4
    assert await create_cluster(store_db, "c", 1) == 4  # joined: the stored count wins
    before = await load_map(store_db, "c")
    assert before is not None

    assert await reset_cluster(store_db, "c", 1) == 1
    after = await load_map(store_db, "c")
    assert after is not None and await desired_hosts(store_db, "c") == 1
    assert Counter(after.owners) == {host_name("c", 0): NUM_SHARDS}
    # Every shard one epoch later: a host of the old layout is refused, never obeyed.
    assert all(new == old + 1 for new, old in zip(after.epochs, before.epochs, strict=True))
    # And on a database that never held the cluster, it is created.
    assert await reset_cluster(store_db, "fresh", 2) == 2
    fresh = await load_map(store_db, "fresh")
    assert fresh is not None and set(fresh.epochs) == {1}


async def test_a_move_that_cannot_notify_the_routers_moves_nothing(store_db: Database) -> None:
    """The routers' notification went out after the move's commit, so a move reported failed
    (the old owner then takes its shards back) could have committed. It is now sent in the
    move's transaction: failing, it fails the move. Made to fail here by a cluster name
    longer than a notification's payload may be (8,000 bytes)."""
    await apply_migrations(store_db, [SHARD_MIGRATIONS])
    cluster = "c" * 8_100
    source, target = host_name(cluster, 0), host_name(cluster, 1)
    async with store_db.transaction() as conn:  # as create_cluster lays it out, unnotified
        await conn.execute("INSERT INTO actor_clusters (cluster, hosts) VALUES ($1, 1)", cluster)
        await conn.executemany(
            "INSERT INTO actor_shards (cluster, shard, host, epoch) VALUES ($1, $2, $3, 1)",
            [(cluster, s, source) for s in range(NUM_SHARDS)],
        )
    with pytest.raises(StoreError, match="payload string too long"):
        await move_shards(store_db, cluster, [0, 1], source, target)
    after = await load_map(store_db, cluster)
    assert after is not None and set(after.owners) == {source} and set(after.epochs) == {1}
