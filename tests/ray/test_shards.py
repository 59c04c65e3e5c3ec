"""The shard map's pure parts: the stable hash and the move planner."""

from __future__ import annotations

from collections import Counter

from actors import ActorKey
from actors.shards import NUM_SHARDS, host_index, host_name, plan_moves, shard_of


def test_shard_of_is_stable_and_spread() -> None:
    # Fixed values: every gateway process and version must route a key the same way, so a
    # salted or changed hash (two gateways sending one key to two hosts) fails here.
    assert shard_of(ActorKey("conversation", "c-1")) == 249
    assert shard_of(ActorKey("workspace", "default")) == 518
    assert shard_of(ActorKey("agent", "a-42")) == 445
    counts = Counter(shard_of(ActorKey("counter", str(i))) for i in range(20_000))
    assert len(counts) == NUM_SHARDS
    assert max(counts.values()) < 3 * 20_000 / NUM_SHARDS


def test_host_names_round_trip() -> None:
    assert host_index("svc", host_name("svc", 7)) == 7
    assert host_index("svc", "other-host-1") is None


def _apply(owners: list[str], hosts: list[str]) -> tuple[list[str], int]:
    moves = plan_moves(owners, hosts)
    after = list(owners)
    for move in moves:
        assert after[move.shard] == move.source
        after[move.shard] = move.target
    return after, len(moves)


def test_scale_out_moves_only_what_it_must() -> None:
    one = ["h0"] * NUM_SHARDS
    three, moved = _apply(one, ["h0", "h1", "h2"])
    assert sorted(Counter(three).values()) == [341, 341, 342]
    assert moved == NUM_SHARDS - 342
    assert _apply(three, ["h0", "h1", "h2"])[1] == 0


def test_scale_in_moves_the_removed_hosts_shards_first() -> None:
    three = [f"h{s % 3}" for s in range(NUM_SHARDS)]
    moves = plan_moves(three, ["h0", "h1"])
    assert all(m.source == "h2" for m in moves)
    assert len(moves) == Counter(three)["h2"]
    two, _ = _apply(three, ["h0", "h1"])
    assert sorted(Counter(two).values()) == [512, 512]


def test_busy_shards_move_last() -> None:
    owners = ["h0"] * NUM_SHARDS
    load = {s: 100.0 for s in range(NUM_SHARDS // 2)}
    moves = plan_moves(owners, ["h0", "h1"], load)
    assert len(moves) == NUM_SHARDS // 2
    assert all(m.shard >= NUM_SHARDS // 2 for m in moves)
