"""The event store contract: every adapter of eventstore.port.EventStore must pass it.

`EventStoreContract` holds the tests against the port; a subclass provides the `store`
fixture for one adapter. The PostgreSQL adapter runs on the embedded server, or on
SVC_TEST_DATABASE_URL when set (see tests/conftest.py).
"""

from __future__ import annotations

import asyncio
import os
import pickle
import random
import tempfile
import uuid
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from eventstore import reads
from eventstore.cursor import LogPoint, decode_cursor, encode_cursor
from eventstore.db import Database
from eventstore.embedded import EmbeddedPostgres
from eventstore.errors import ConcurrencyConflict, InvalidAppend, InvalidCursor, StoreError
from eventstore.metrics import OLDEST_OPEN_TX_AGE, OpenTxAgeSampler
from eventstore.migrate import STORE_MIGRATIONS, apply_migrations
from eventstore.port import EventStore
from eventstore.records import NewEvent, RecordedEvent, Snapshot
from eventstore.store import PostgresEventStore
from schemas.errors import InvalidInput
from schemas.events import Event, EventFromNewerVersion, EventRegistry, StoredEventUnreadable

WS = "ws-a"
OTHER_WS = "ws-b"


def ev(type_: str = "thing.Happened", **data: Any) -> NewEvent:
    return NewEvent(type=type_, data=data or {"n": 1})


def cmd() -> str:
    return "cmd-" + uuid.uuid4().hex


def stream() -> str:
    return "stream-" + uuid.uuid4().hex[:12]


async def read_everything(store: EventStore, **filters: Any) -> list[RecordedEvent]:
    out: list[RecordedEvent] = []
    after: str | None = None
    while True:
        page = await store.read_all(after, 3, **filters)
        out.extend(page)
        if not page:
            return out
        after = page[-1].cursor


class EventStoreContract:
    """Tests against the port only; subclasses provide `store` (and `commits`, the number of
    after-commit signals the adapter has sent)."""

    # appends and the single-writer fence

    async def test_append_to_new_stream_numbers_versions_from_one(self, store: EventStore) -> None:
        s = stream()
        result = await store.append(
            s, [ev(n=1), ev(n=2)], expected_version=0, command_id=cmd(), workspace_id=WS
        )
        assert (result.stream_id, result.first_version, result.last_version) == (s, 1, 2)
        assert not result.duplicate
        events = await store.read_stream(s)
        assert [(e.version, e.data) for e in events] == [(1, {"n": 1}), (2, {"n": 2})]
        assert all(e.workspace_id == WS and e.stream_id == s for e in events)
        assert result.cursor == events[-1].cursor

    async def test_append_keeps_event_fields(self, store: EventStore) -> None:
        s = stream()
        new = NewEvent(
            type="thing.Described",
            data={"text": "héllo", "nested": {"a": [1, 2.5, None, True]}},
            schema_version=3,
            metadata={"actor": "user:1", "trace": "abc"},
        )
        await store.append(s, [new], expected_version=0, command_id=cmd(), workspace_id=WS)
        (got,) = await store.read_stream(s)
        assert got.event_id == new.event_id
        assert (got.type, got.schema_version) == ("thing.Described", 3)
        assert (got.data, got.metadata) == (new.data, new.metadata)
        assert got.recorded_at.tzinfo is not None

    async def test_expected_version_must_match(self, store: EventStore) -> None:
        s = stream()
        await store.append(s, [ev()], expected_version=0, command_id=cmd(), workspace_id=WS)
        for wrong in (0, 2, 5):
            with pytest.raises(ConcurrencyConflict) as info:
                await store.append(
                    s, [ev()], expected_version=wrong, command_id=cmd(), workspace_id=WS
                )
            assert info.value.stream_id == s
        await store.append(s, [ev()], expected_version=1, command_id=cmd(), workspace_id=WS)
        assert [e.version for e in await store.read_stream(s)] == [1, 2]

    async def test_any_version_appends_at_the_end(self, store: EventStore) -> None:
        s = stream()
        first = await store.append(
            s, [ev()], expected_version=None, command_id=cmd(), workspace_id=WS
        )
        second = await store.append(
            s, [ev(), ev()], expected_version=None, command_id=cmd(), workspace_id=WS
        )
        assert (first.first_version, second.first_version, second.last_version) == (1, 2, 3)

    async def test_a_conflicting_append_writes_nothing(self, store: EventStore) -> None:
        s = stream()
        await store.append(s, [ev()], expected_version=0, command_id=cmd(), workspace_id=WS)
        command_id = cmd()
        with pytest.raises(ConcurrencyConflict):
            await store.append(
                s, [ev(), ev()], expected_version=0, command_id=command_id, workspace_id=WS
            )
        assert len(await store.read_stream(s)) == 1
        # The failed command left no ledger row: a retry with the right version acts.
        retried = await store.append(
            s, [ev()], expected_version=1, command_id=command_id, workspace_id=WS
        )
        assert (retried.duplicate, retried.first_version) == (False, 2)

    async def test_concurrent_appenders_at_one_version_exactly_one_wins(
        self, store: EventStore
    ) -> None:
        for _round in range(5):
            s = stream()
            await store.append(s, [ev()], expected_version=0, command_id=cmd(), workspace_id=WS)
            outcomes = await asyncio.gather(
                *(
                    store.append(
                        s, [ev(w=i), ev(w=i)], expected_version=1, command_id=cmd(), workspace_id=WS
                    )
                    for i in range(6)
                ),
                return_exceptions=True,
            )
            winners = [o for o in outcomes if not isinstance(o, BaseException)]
            losers = [o for o in outcomes if isinstance(o, BaseException)]
            assert len(winners) == 1, outcomes
            assert all(isinstance(o, ConcurrencyConflict) for o in losers), losers
            events = await store.read_stream(s)
            assert [e.version for e in events] == [1, 2, 3]
            assert events[1].data == events[2].data

    async def test_concurrent_any_version_appenders_never_share_a_version(
        self, store: EventStore
    ) -> None:
        s = stream()
        outcomes = await asyncio.gather(
            *(
                store.append(s, [ev(w=i)], expected_version=None, command_id=cmd(), workspace_id=WS)
                for i in range(8)
            ),
            return_exceptions=True,
        )
        for o in outcomes:
            assert not isinstance(o, BaseException) or isinstance(o, ConcurrencyConflict), o
        wins = sum(1 for o in outcomes if not isinstance(o, BaseException))
        assert [e.version for e in await store.read_stream(s)] == list(range(1, wins + 1))

    # idempotency

    async def test_a_repeated_command_returns_the_first_result_and_writes_nothing(
        self, store: EventStore, commits: list[None]
    ) -> None:
        s = stream()
        command_id = cmd()
        first = await store.append(
            s, [ev(), ev()], expected_version=0, command_id=command_id, workspace_id=WS
        )
        signals = len(commits)
        again = await store.append(
            s, [ev(n=9)], expected_version=0, command_id=command_id, workspace_id=WS
        )
        assert again.duplicate
        assert (again.stream_id, again.first_version, again.last_version, again.cursor) == (
            first.stream_id,
            first.first_version,
            first.last_version,
            first.cursor,
        )
        assert len(await store.read_stream(s)) == 2
        assert len(commits) == signals

    async def test_concurrent_duplicates_of_one_command_act_once(self, store: EventStore) -> None:
        s = stream()
        command_id = cmd()
        results = await asyncio.gather(
            *(
                store.append(
                    s, [ev(k=i)], expected_version=0, command_id=command_id, workspace_id=WS
                )
                for i in range(8)
            )
        )
        assert sum(not r.duplicate for r in results) == 1
        assert {(r.first_version, r.last_version, r.cursor) for r in results} == {
            (1, 1, results[0].cursor)
        }
        assert len(await store.read_stream(s)) == 1

    async def test_command_ids_are_per_workspace(self, store: EventStore) -> None:
        command_id = cmd()
        a = await store.append(
            stream(), [ev()], expected_version=0, command_id=command_id, workspace_id=WS
        )
        b = await store.append(
            stream(), [ev()], expected_version=0, command_id=command_id, workspace_id=OTHER_WS
        )
        assert not a.duplicate and not b.duplicate

    async def test_the_ledger_says_what_a_command_id_appended(self, store: EventStore) -> None:
        s, command_id = stream(), cmd()
        first = await store.append(
            s, [ev(), ev()], expected_version=0, command_id=command_id, workspace_id=WS
        )
        found = await store.processed(command_id, WS)
        assert found is not None and found.duplicate
        assert (found.stream_id, found.first_version, found.last_version, found.cursor) == (
            first.stream_id,
            first.first_version,
            first.last_version,
            first.cursor,
        )
        assert await store.processed(command_id, OTHER_WS) is None
        assert await store.processed(cmd(), WS) is None

    # invalid appends

    @pytest.mark.parametrize(
        ("stream_id", "events", "command_id", "workspace_id"),
        [
            ("s", [], "c", WS),
            ("", [ev()], "c", WS),
            ("s", [ev()], "", WS),
            ("s", [ev()], "c", ""),
            ("s", [NewEvent(type="", data={})], "c", WS),
            # Data and metadata are JSON objects: a list would be flattened by the driver.
            ("s", [NewEvent(type="t", data=[1]), NewEvent(type="t", data=[2])], "c", WS),  # type: ignore[arg-type]
            ("s", [NewEvent(type="t", data={}, metadata=[1])], "c", WS),  # type: ignore[arg-type]
            # Ids the tables cannot key: a NUL, a lone surrogate, more than an index entry holds.
            ("s\x00", [NewEvent(type="t", data={})], "c", WS),
            ("s", [NewEvent(type="t\ud800", data={})], "c", WS),
            ("s", [NewEvent(type="t", data={})], "c" * 3_000, WS),
            ("s", [NewEvent(type="t", data={})], "c", "w\x00s"),
        ],
    )
    async def test_invalid_appends_are_refused(
        self,
        store: EventStore,
        stream_id: str,
        events: list[NewEvent],
        command_id: str,
        workspace_id: str,
    ) -> None:
        with pytest.raises(InvalidAppend):
            await store.append(
                stream_id,
                events,
                expected_version=None,
                command_id=command_id,
                workspace_id=workspace_id,
            )

    async def test_a_refused_id_is_named(self, store: EventStore) -> None:
        with pytest.raises(InvalidAppend, match="stream id holds a NUL"):
            await store.append(
                "s\x00", [ev()], expected_version=None, command_id=cmd(), workspace_id=WS
            )
        with pytest.raises(InvalidAppend, match="command id is longer"):
            await store.append(
                stream(), [ev()], expected_version=None, command_id="c" * 501, workspace_id=WS
            )
        # Each within its bound, both together past the ledger index's (not a bare 54000).
        rng = random.Random(7)  # four bytes of UTF-8 each, and no run an index compresses
        wide = ["".join(chr(0x20000 + rng.randrange(40_000)) for _ in range(499)) for _ in "ab"]
        with pytest.raises(InvalidAppend, match="ledger keys at most"):
            await store.append(
                stream(), [ev()], expected_version=None, command_id=wide[0], workspace_id=wide[1]
            )

    async def test_repeated_event_ids_are_refused(self, store: EventStore) -> None:
        one = ev()
        with pytest.raises(InvalidAppend):
            await store.append(
                stream(), [one, one], expected_version=0, command_id=cmd(), workspace_id=WS
            )
        await store.append(stream(), [one], expected_version=0, command_id=cmd(), workspace_id=WS)
        with pytest.raises(InvalidAppend):
            await store.append(
                stream(), [one], expected_version=0, command_id=cmd(), workspace_id=WS
            )

    async def test_a_stream_belongs_to_one_workspace(self, store: EventStore) -> None:
        s = stream()
        await store.append(s, [ev()], expected_version=0, command_id=cmd(), workspace_id=WS)
        with pytest.raises(InvalidAppend):
            await store.append(
                s, [ev()], expected_version=None, command_id=cmd(), workspace_id=OTHER_WS
            )
        assert await store.read_stream(s, workspace_id=OTHER_WS) == []
        assert len(await store.read_stream(s, workspace_id=WS)) == 1

    async def test_data_that_is_not_json_is_refused(self, store: EventStore) -> None:
        for bad in ({"x": object()}, {"x": "nul \u0000 byte"}):
            with pytest.raises(InvalidAppend):
                await store.append(
                    stream(),
                    [NewEvent(type="t", data=bad)],
                    expected_version=0,
                    command_id=cmd(),
                    workspace_id=WS,
                )

    async def test_a_refused_append_leaves_no_ledger_row(self, store: EventStore) -> None:
        s = stream()
        await store.append(s, [ev()], expected_version=0, command_id=cmd(), workspace_id=WS)
        command_id = cmd()
        with pytest.raises(InvalidAppend):
            await store.append(
                s, [ev()], expected_version=1, command_id=command_id, workspace_id=OTHER_WS
            )
        # The refusal rolled the claim back: the command id is still free in that workspace.
        acted = await store.append(
            stream(), [ev()], expected_version=0, command_id=command_id, workspace_id=OTHER_WS
        )
        assert not acted.duplicate

    async def test_an_unreachable_expected_version_is_a_conflict(self, store: EventStore) -> None:
        s = stream()
        command_id = cmd()
        first = await store.append(
            s, [ev()], expected_version=0, command_id=command_id, workspace_id=WS
        )
        for far in (2**31, 2**63, 2**70):
            with pytest.raises(ConcurrencyConflict):
                await store.append(
                    s, [ev()], expected_version=far, command_id=cmd(), workspace_id=WS
                )
            # A repeated command still gets its first result, whatever version it names.
            again = await store.append(
                s, [ev()], expected_version=far, command_id=command_id, workspace_id=WS
            )
            assert again.duplicate and again.cursor == first.cursor
        assert len(await store.read_stream(s)) == 1

    # reads

    async def test_read_stream_from_version(self, store: EventStore) -> None:
        s = stream()
        await store.append(
            s, [ev(n=i) for i in range(1, 6)], expected_version=0, command_id=cmd(), workspace_id=WS
        )
        assert [e.version for e in await store.read_stream(s, 3)] == [3, 4, 5]
        assert [e.version for e in await store.read_stream(s, 0)] == [1, 2, 3, 4, 5]
        assert await store.read_stream(s, 6) == []
        assert await store.read_stream(stream()) == []
        between = await store.read_stream(s, 2, to_version=4)
        assert [e.version for e in between] == [2, 3, 4]
        assert [e.version for e in await store.read_stream(s, 4, to_version=2**64)] == [4, 5]
        assert await store.read_stream(s, 3, to_version=2) == []
        only = await store.read_stream(s, 1, to_version=1, workspace_id=WS)
        assert [e.version for e in only] == [1]

    async def test_stream_version_is_the_newest_in_the_workspace(self, store: EventStore) -> None:
        s = stream()
        await store.append(
            s, [ev(n=i) for i in range(1, 4)], expected_version=0, command_id=cmd(), workspace_id=WS
        )
        assert await store.stream_version(s) == 3
        assert await store.stream_version(s, workspace_id=WS) == 3
        assert await store.stream_version(s, workspace_id="ws-other") == 0
        assert await store.stream_version(stream()) == 0

    async def test_stream_sizes_follow_the_events_data(self, store: EventStore) -> None:
        s = stream()
        events = [ev(n=1), ev(pad="x" * 500, n=2), ev(n=3)]
        await store.append(s, events, expected_version=0, command_id=cmd(), workspace_id=WS)
        sizes = await store.stream_sizes(s, 1, 3)
        assert [v for v, _ in sizes] == [1, 2, 3]
        assert sizes[1][1] > sizes[0][1] + 400 and sizes[0][1] > 0
        assert await store.stream_sizes(s, 2, 2**64, workspace_id=WS) == sizes[1:]
        assert await store.stream_sizes(s, 1, 3, workspace_id=OTHER_WS) == []
        assert await store.stream_sizes(s, 3, 2) == []

    async def test_read_all_pages_by_cursor_in_commit_order(self, store: EventStore) -> None:
        assert await store.head() == ""
        assert await store.read_all() == []
        written: list[tuple[str, int]] = []
        for i in range(4):
            s = stream()
            await store.append(
                s, [ev(i=i), ev(i=i)], expected_version=0, command_id=cmd(), workspace_id=WS
            )
            written += [(s, 1), (s, 2)]
        everything = await read_everything(store)
        assert [(e.stream_id, e.version) for e in everything] == written
        points = [decode_cursor(e.cursor) for e in everything]
        assert points == sorted(points) and len(set(points)) == len(points)
        assert await store.head() == everything[-1].cursor
        assert await store.read_all(everything[-1].cursor) == []
        middle = await store.read_all(everything[2].cursor, 2)
        assert [e.event_id for e in middle] == [e.event_id for e in everything[3:5]]
        assert await store.read_all(None, 0) == []

    async def test_read_all_filters_by_workspace_and_type(self, store: EventStore) -> None:
        for ws in (WS, OTHER_WS, WS):
            await store.append(
                stream(),
                [ev("a.One"), ev("a.Two"), ev("a.Three")],
                expected_version=0,
                command_id=cmd(),
                workspace_id=ws,
            )
        mine = await read_everything(store, workspace_id=WS)
        assert len(mine) == 6 and {e.workspace_id for e in mine} == {WS}
        ones_and_threes = await read_everything(store, types=["a.One", "a.Three"])
        assert [e.type for e in ones_and_threes] == ["a.One", "a.Three"] * 3
        both = await read_everything(store, workspace_id=OTHER_WS, types=["a.Two"])
        assert [(e.workspace_id, e.type) for e in both] == [(OTHER_WS, "a.Two")]
        assert await store.read_all(types=[]) == []
        assert await store.read_all(workspace_id="nobody") == []

    @pytest.mark.parametrize(
        "garbage",
        [
            "nonsense",
            "c1",
            "c1" + "!" * 22,
            "x1AAAAAAAAAwAAAAAAAAAAAg",
            encode_cursor(LogPoint(2**64 - 1, 2**64 - 1)),
            encode_cursor(LogPoint(1234, 5678))[:-1] + "h",  # spare bits set: decodes the same
            "c1AAA/AAAABNIAAAAAAAAWLg",  # the standard alphabet, which the decoder also takes
        ],
    )
    async def test_garbage_cursors_are_refused(self, store: EventStore, garbage: str) -> None:
        with pytest.raises(InvalidCursor):
            await store.read_all(garbage)

    # snapshots

    async def test_snapshots_only_move_forward(self, store: EventStore) -> None:
        s = stream()
        assert await store.load_snapshot(s) is None
        await store.save_snapshot(Snapshot(s, 5, 1, {"count": 5}))
        await store.save_snapshot(Snapshot(s, 3, 1, {"count": 3}))
        assert await store.load_snapshot(s) == Snapshot(s, 5, 1, {"count": 5})
        await store.save_snapshot(Snapshot(s, 8, 1, {"count": 8, "list": [1]}))
        assert await store.load_snapshot(s) == Snapshot(s, 8, 1, {"count": 8, "list": [1]})
        await store.save_snapshot(Snapshot(s, 8, 2, {"total": 8}))
        assert await store.load_snapshot(s) == Snapshot(s, 8, 2, {"total": 8})

    # schema evolution

    async def test_old_events_decode_through_upcasters(self, store: EventStore) -> None:
        registry = EventRegistry()

        @registry.register
        class ThingRenamed(Event):
            type_name = "test.ThingRenamed"
            schema_version = 2
            title: str
            by: str

        @registry.upcaster("test.ThingRenamed", 1)
        def _v1_to_v2(data: dict[str, Any]) -> dict[str, Any]:
            return {"title": data["name"], "by": "unknown"}

        s = stream()
        old = NewEvent(type="test.ThingRenamed", data={"name": "first"}, schema_version=1)
        type_, version, data = registry.encode(ThingRenamed(title="second", by="me"))
        new = NewEvent(type=type_, data=data, schema_version=version)
        await store.append(s, [old, new], expected_version=0, command_id=cmd(), workspace_id=WS)
        decoded = [
            registry.decode(e.type, e.schema_version, e.data) for e in await store.read_stream(s)
        ]
        assert decoded == [
            ThingRenamed(title="first", by="unknown"),
            ThingRenamed(title="second", by="me"),
        ]

    async def test_stored_events_this_code_cannot_read_are_not_the_clients_fault(
        self, store: EventStore
    ) -> None:
        """An event of a newer schema version (after a rollback, or in a mixed deploy) or of
        a type this code does not know is refused as written by a newer version (503, upgrade
        this process), not read as if current; stored data that does not match its schema is a
        server error (500). None of them is a 400: the client sent nothing wrong."""
        registry = EventRegistry()

        @registry.register
        class ThingNamed(Event):
            type_name = "test.ThingNamed"
            schema_version = 2
            title: str

        s = stream()
        events = [
            NewEvent(type="test.ThingNamed", data={"title": "from v3"}, schema_version=3),
            NewEvent(type="test.ThingCoined", data={}, schema_version=1),
            NewEvent(type="test.ThingNamed", data={"name": "no title"}, schema_version=2),
            NewEvent(type="test.ThingNamed", data={"title": "from v1"}, schema_version=1),
        ]
        await store.append(s, events, expected_version=0, command_id=cmd(), workspace_id=WS)
        newer, unknown, mismatched, no_upcaster = await store.read_stream(s)
        for recorded in (newer, unknown):
            for read in (registry.decode, registry.upcast):
                with pytest.raises(EventFromNewerVersion, match="newer version of SVC") as info:
                    read(recorded.type, recorded.schema_version, recorded.data)
                assert info.value.http_status == 503
        for recorded in (mismatched, no_upcaster):
            with pytest.raises(StoredEventUnreadable) as unreadable:
                registry.decode(recorded.type, recorded.schema_version, recorded.data)
            assert not isinstance(unreadable.value, InvalidInput | EventFromNewerVersion)
            assert unreadable.value.http_status == 500


class TestPostgresEventStore(EventStoreContract):
    @pytest.fixture
    def db(self, store_db: Database) -> Database:
        return store_db

    @pytest.fixture
    def commits(self) -> list[None]:
        return []

    @pytest.fixture
    def store(self, db: Database, commits: list[None]) -> PostgresEventStore:
        return PostgresEventStore(db, on_commit=lambda: commits.append(None))

    # Adapter-specific: the gap-free read and the after-commit signal.

    async def test_readers_never_pass_an_open_writing_transaction(
        self, db: Database, store: PostgresEventStore
    ) -> None:
        before = await read_everything(store)
        async with db.acquire() as slow:
            tx = slow.transaction()
            await tx.start()
            # An event taking its position now but committing last.
            await slow.execute(
                "INSERT INTO events (stream_id, version, event_id, workspace_id, type, data)"
                " VALUES ($1, 1, $2, $3, 'slow.Written', '{}')",
                stream(),
                uuid.uuid4(),
                WS,
            )
            fast = await store.append(
                stream(),
                [ev("fast.Written")],
                expected_version=0,
                command_id=cmd(),
                workspace_id=WS,
            )
            # The fast event is committed but behind the open transaction: not visible yet.
            assert await read_everything(store) == before
            assert await store.head() == (before[-1].cursor if before else "")
            await tx.commit()
        after = await read_everything(store)
        assert [e.type for e in after[len(before) :]] == ["slow.Written", "fast.Written"]
        assert after[-1].cursor == fast.cursor

    async def test_commit_signal_follows_each_append(
        self, store: PostgresEventStore, commits: list[None]
    ) -> None:
        s = stream()
        await store.append(s, [ev()], expected_version=0, command_id=cmd(), workspace_id=WS)
        with pytest.raises(ConcurrencyConflict):
            await store.append(s, [ev()], expected_version=0, command_id=cmd(), workspace_id=WS)
        assert len(commits) == 1

    @pytest.mark.parametrize("plan_mode", ["force_custom_plan", "force_generic_plan"])
    async def test_log_reads_stay_on_their_indexes(self, db: Database, plan_mode: str) -> None:
        async with db.transaction() as conn:
            await conn.execute(
                "INSERT INTO events (stream_id, version, event_id, workspace_id, type, data)"
                " SELECT 's' || (i / 10), i % 10 + 1, gen_random_uuid(), 'w' || (i % 40),"
                "        't' || (i % 3), '{}' FROM generate_series(0, 19999) AS i"
            )
        async with db.acquire() as conn:
            await conn.execute("ANALYZE events")
        async with db.transaction() as conn:
            await conn.execute(f"SET LOCAL plan_cache_mode = {plan_mode}")
            cases = [
                (reads._READ_ALL, "", "events_tx_position"),
                (reads._READ_ALL_TYPES, ", ARRAY['t1']", "events_tx_position"),
                (reads._READ_WORKSPACE, ", 'w3'", "events_ws_tx_position"),
                (reads._READ_WORKSPACE_TYPES, ", 'w3', ARRAY['t1']", "events_ws_tx_position"),
            ]
            for i, (query, more, index) in enumerate(cases):
                await conn.execute(f"PREPARE read_{i} AS {query}")
                plan = await conn.fetch(f"EXPLAIN EXECUTE read_{i}('0'::xid8, 0, 100{more})")
                text = "\n".join(row[0] for row in plan)
                assert f"Index Scan using {index} on events" in text, text
                assert "Sort" not in text, text
            # A workspace's newest event (a feed's start=latest): one descent of its index.
            await conn.execute(f"PREPARE head AS {reads._WORKSPACE_HEAD}")
            plan = await conn.fetch("EXPLAIN EXECUTE head('w3')")
            text = "\n".join(row[0] for row in plan)
            assert "Index Only Scan Backward using events_ws_tx_position" in text, text

    async def test_the_oldest_open_writing_transaction_is_measured(self, db: Database) -> None:
        sampler = OpenTxAgeSampler(db, interval_s=3600)
        async with db.acquire() as slow:
            async with slow.transaction():
                await slow.execute("SELECT pg_current_xact_id()")  # now it holds an xid
                await asyncio.sleep(0.2)
                assert await sampler.sample() >= 0.2
                (metric,) = OLDEST_OPEN_TX_AGE.collect()
                assert metric.samples[0].value >= 0.2
        assert await sampler.sample() < 0.2

    async def test_recorded_events_carry_the_stored_time_and_pickle(
        self, db: Database, store: PostgresEventStore
    ) -> None:
        s = stream()
        await store.append(
            s, [ev(n=1), ev(n=2)], expected_version=0, command_id=cmd(), workspace_id=WS
        )
        by_stream = await store.read_stream(s)
        by_log = [e for e in await read_everything(store) if e.stream_id == s]
        assert by_stream == by_log and len(by_log) == 2
        async with db.acquire() as conn:
            stored = await conn.fetchval(
                "SELECT recorded_at FROM events WHERE event_id = $1", by_log[0].event_id
            )
        assert by_log[0].recorded_at == stored and by_log[0].recorded_at.tzinfo is not None
        # Across the Ray runtime events travel pickled.
        copies = pickle.loads(pickle.dumps(by_log))
        assert copies == by_log and copies[0].recorded_at == stored
        assert "recorded_at=" in repr(copies[0])

    async def test_store_calls_skip_the_pool_reset_and_others_keep_it(
        self, database_url: str
    ) -> None:
        db = await Database.connect(database_url, max_size=1)
        try:
            await apply_migrations(db, [STORE_MIGRATIONS])
            store = PostgresEventStore(db)
            async with db.acquire() as conn:
                await conn.execute("SET application_name = 'borrowed'")
            await store.append(
                stream(), [ev()], expected_version=0, command_id=cmd(), workspace_id=WS
            )
            async with db.acquire() as conn:
                # The ordinary borrower's session setting was reset on release.
                assert await conn.fetchval("SHOW application_name") == "svc"
            assert len(await store.read_all()) == 1
        finally:
            await db.close()

    async def test_subscribe_without_a_tailer_says_so(self, store: PostgresEventStore) -> None:
        with pytest.raises(StoreError, match="tailer"):
            store.subscribe()


async def test_a_prepared_transaction_is_measured_as_open() -> None:
    """Review finding: a prepared (two-phase) transaction holds back every gap-free reader
    but has no session in pg_stat_activity, so the gauge read 0 while the feeds froze."""
    with tempfile.TemporaryDirectory(prefix="svc-2pc-") as tmp:
        os.chmod(tmp, 0o755)  # the embedded server's own user must traverse it
        server = EmbeddedPostgres(Path(tmp))
        url = await asyncio.to_thread(server.start)
        try:
            conn = await asyncpg.connect(url)
            await conn.execute("ALTER SYSTEM SET max_prepared_transactions = 2")
            await conn.close()
            await asyncio.to_thread(server.stop)
            url = await asyncio.to_thread(server.start)
            conn = await asyncpg.connect(url)
            try:
                await conn.execute("CREATE TABLE t (n int)")
                await conn.execute("BEGIN; INSERT INTO t VALUES (1); PREPARE TRANSACTION 'x'")
                await asyncio.sleep(0.2)
                db = await Database.connect(url)
                try:
                    assert await OpenTxAgeSampler(db, interval_s=3600).sample() >= 0.2
                finally:
                    await db.close()
                await conn.execute("ROLLBACK PREPARED 'x'")
            finally:
                await conn.close()
        finally:
            await asyncio.to_thread(server.stop)
