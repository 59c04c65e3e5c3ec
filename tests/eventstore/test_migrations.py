"""Migrations, the reader role and the startup checks, on real PostgreSQL databases."""

from __future__ import annotations

import asyncio
import logging
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

from eventstore import migrate
from eventstore.cursor import ORIGIN
from eventstore.db import Database
from eventstore.errors import StoreError
from eventstore.migrate import STORE_MIGRATIONS, MigrationSource, apply_migrations
from eventstore.records import NewEvent
from eventstore.store import PostgresEventStore, check_xid_horizon
from eventstore.tailer import LogTailer

STORE_LABELS = [
    "eventstore/0001_event_store",
    "eventstore/0002_roles",
    "eventstore/0003_append_function",
    "eventstore/0004_append_precomputed",
    "eventstore/0005_append_batch",
    "eventstore/0006_append_set",
    "eventstore/0007_log_order_key",
    "eventstore/0008_append_lock_waits",
    "eventstore/0009_log_reader",
]


@pytest.fixture
async def db(database_url: str) -> AsyncIterator[Database]:
    db = await Database.connect(database_url, max_size=4)
    try:
        yield db
    finally:
        await db.close()


@pytest.fixture
def make_source(tmp_path: Path) -> Iterator[type[MigrationSource]]:
    """Builds throwaway migration packages: `make(files)` -> MigrationSource."""
    sys.path.insert(0, str(tmp_path))
    yield MigrationSource
    sys.path.remove(str(tmp_path))


def write_package(root: Path, files: dict[str, str]) -> MigrationSource:
    name = "svc_test_migrations_" + uuid.uuid4().hex[:8]
    package = root / name
    package.mkdir()
    (package / "__init__.py").write_text("")
    for file_name, sql in files.items():
        (package / file_name).write_text(sql)
    return MigrationSource(name, name)


async def recorded(db: Database) -> list[tuple[str, int, str]]:
    async with db.acquire() as conn:
        rows = await conn.fetch(
            "SELECT namespace, version, name FROM schema_migrations ORDER BY namespace, version"
        )
    return [tuple(r) for r in rows]


async def test_store_migrations_are_found_in_order() -> None:
    found = STORE_MIGRATIONS.migrations()
    assert [m.label for m in found] == STORE_LABELS


async def test_concurrent_runs_on_a_fresh_database_apply_each_migration_once(
    database_url: str,
) -> None:
    dbs = [await Database.connect(database_url, max_size=2) for _ in range(3)]
    try:
        results = await asyncio.gather(*(apply_migrations(d, [STORE_MIGRATIONS]) for d in dbs))
        # Each migration applied by exactly one of the runs, whichever got there first.
        assert sorted(label for r in results for label in r) == STORE_LABELS
        assert await recorded(dbs[0]) == [
            ("eventstore", 1, "event_store"),
            ("eventstore", 2, "roles"),
            ("eventstore", 3, "append_function"),
            ("eventstore", 4, "append_precomputed"),
            ("eventstore", 5, "append_batch"),
            ("eventstore", 6, "append_set"),
            ("eventstore", 7, "log_order_key"),
            ("eventstore", 8, "append_lock_waits"),
            ("eventstore", 9, "log_reader"),
        ]
        assert await apply_migrations(dbs[1], [STORE_MIGRATIONS]) == []
    finally:
        for d in dbs:
            await d.close()


async def test_a_log_written_before_the_order_key_reads_the_same_after_it(
    db: Database, tmp_path: Path, make_source: type[MigrationSource]
) -> None:
    # The store as it was before migration 0007: its first six files, in its namespace.
    earlier = {
        f"{m.version:04d}_{m.name}.sql": m.sql
        for m in STORE_MIGRATIONS.migrations()
        if m.version < 7
    }
    package = write_package(tmp_path, earlier).package
    await apply_migrations(db, [make_source("eventstore", package)])
    store = PostgresEventStore(db)
    for n in range(30):
        events = [NewEvent("t", {"n": n, "k": k}) for k in range(3)]
        await store.append(
            f"s-{n % 4}", events, expected_version=None, command_id=f"c{n}", workspace_id="w"
        )
    before = await store.read_all(limit=1000)

    applied = await apply_migrations(db, [STORE_MIGRATIONS])
    assert applied[0] == "eventstore/0007_log_order_key"

    assert [(e.event_id, e.tx, e.position) for e in await store.read_all(limit=1000)] == [
        (e.event_id, e.tx, e.position) for e in before
    ]
    async with db.acquire() as conn:
        key = await conn.fetchval(
            "SELECT pg_get_constraintdef(oid) FROM pg_constraint"
            " WHERE conrelid = 'events'::regclass AND contype = 'p'"
        )
    assert key == 'PRIMARY KEY (tx, "position")'
    appended = NewEvent("t", {})
    await store.append(
        "s-0", [appended], expected_version=None, command_id="c-after", workspace_id="w"
    )
    newer = await store.read_all(after=before[-1].cursor)
    assert [e.event_id for e in newer] == [appended.event_id]


async def test_sources_apply_in_order_and_a_failing_migration_leaves_no_trace(
    db: Database, tmp_path: Path, make_source: type[MigrationSource]
) -> None:
    good = write_package(
        tmp_path,
        {
            "0002_add_column.sql": "ALTER TABLE widgets ADD COLUMN size int;",
            "0001_create.sql": "CREATE TABLE widgets (id int PRIMARY KEY);",
            "README.txt": "not a migration",
        },
    )
    bad = write_package(
        tmp_path,
        {
            "0001_fine.sql": "CREATE TABLE gadgets (id int);",
            "0002_broken.sql": "CREATE TABLE half_done (id int); SELECT no_such_function();",
        },
    )
    applied = await apply_migrations(db, [STORE_MIGRATIONS, good])
    assert applied == [
        *STORE_LABELS,
        f"{good.namespace}/0001_create",
        f"{good.namespace}/0002_add_column",
    ]
    with pytest.raises(StoreError, match="no_such_function"):
        await apply_migrations(db, [STORE_MIGRATIONS, good, bad])
    async with db.acquire() as conn:
        assert await conn.fetchval("SELECT to_regclass('half_done')") is None
        assert await conn.fetchval("SELECT to_regclass('gadgets')") is not None
    assert (bad.namespace, 2, "broken") not in await recorded(db)
    assert (bad.namespace, 1, "fine") in await recorded(db)


async def test_a_failed_migration_names_itself_and_what_was_applied_before_it(
    db: Database,
    tmp_path: Path,
    make_source: type[MigrationSource],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`svc migrate` shows each migration as it starts; one that fails is named, with those
    this run applied before it (they stay: each runs in its own transaction)."""
    source = write_package(
        tmp_path,
        {
            "0001_a.sql": "CREATE TABLE mig_a (x int);",
            "0002_b.sql": "CREATE TABLE mig_b (x int);",
            "0003_again.sql": "CREATE TABLE mig_a (x int);",
        },
    )
    ns = source.namespace
    with caplog.at_level(logging.INFO, logger="eventstore.migrate"), pytest.raises(StoreError):
        await apply_migrations(db, [source])
    said = [r.getMessage() for r in caplog.records if r.name == "eventstore.migrate"]
    assert said[:3] == [f"applying migration {ns}/000{n}" for n in ("1_a", "2_b", "3_again")]
    assert said[3].startswith(f"migration {ns}/0003_again failed and is not recorded as applied; ")
    assert (
        f"the 2 applied before it in this run stay applied: {ns}/0001_a, {ns}/0002_b" in (said[3])
    )
    assert [version for space, version, _ in await recorded(db) if space == ns] == [1, 2]


async def test_a_version_defined_twice_is_refused(
    tmp_path: Path, make_source: type[MigrationSource]
) -> None:
    source = write_package(tmp_path, {"0001_a.sql": "SELECT 1;", "0001_b.sql": "SELECT 1;"})
    with pytest.raises(StoreError, match="defined twice"):
        source.migrations()


async def test_scoped_transactions_run_as_the_reader_in_one_workspace(db: Database) -> None:
    await apply_migrations(db, [STORE_MIGRATIONS])
    async with db.scoped("ws-1") as conn:
        who, ws = await conn.fetchrow(
            "SELECT current_user, current_setting('svc.workspace_id', true)"
        )
    assert (who, ws) == ("svc_reader", "ws-1")
    # Both settings were transaction-local: the pooled connection is back to normal.
    async with db.acquire() as conn:
        assert await conn.fetchval("SELECT current_user") != "svc_reader"
        assert await conn.fetchval("SELECT current_setting('svc.workspace_id', true)") in (
            None,
            "",
        )
    # The reader role sees nothing of the store's own tables.
    for table in ("events", "processed_commands", "snapshots"):
        with pytest.raises(StoreError, match="permission denied"):
            async with db.scoped("ws-1") as conn:
                await conn.fetch(f"SELECT * FROM {table} LIMIT 1")


async def test_one_workspaces_reads_of_the_log_see_only_its_events(db: Database) -> None:
    """QA finding: the log's per-workspace reads (event history, feed catch-up) were scoped by
    their query alone, as the service's login; a query that lost its condition would have
    read every tenant's events. As the log reader, the database keeps them to one."""
    await apply_migrations(db, [STORE_MIGRATIONS])
    store = PostgresEventStore(db)
    mine, theirs = f"ws-{uuid.uuid4().hex[:8]}", f"ws-{uuid.uuid4().hex[:8]}"
    for workspace in (mine, theirs):
        await store.append(
            f"s-{workspace}",
            [NewEvent("t.Said", {"by": workspace})],
            expected_version=0,
            command_id=f"c-{workspace}",
            workspace_id=workspace,
        )
    async with db.log_reading(mine) as conn:
        who = await conn.fetchval("SELECT current_user")
        seen = {r[0] for r in await conn.fetch("SELECT DISTINCT workspace_id FROM events")}
    assert (who, seen) == ("svc_log_reader", {mine})
    assert await store.read_stream(f"s-{theirs}", workspace_id=mine) == []
    assert await store.stream_version(f"s-{theirs}", workspace_id=mine) == 0
    assert [e.data for e in await store.read_all(workspace_id=mine)] == [{"by": mine}]
    # Each read of one workspace goes through the log reader (the query's own condition
    # alone would return the same rows: this pins the role the reads run as).
    scoped: list[str | None] = []
    reading = db.log_reading

    def spied(workspace_id: str | None) -> Any:
        scoped.append(workspace_id)
        return reading(workspace_id)

    db.log_reading = spied  # type: ignore[method-assign]
    try:
        await store.head(workspace_id=mine)
        await store.stream_sizes(f"s-{mine}", 1, 9, workspace_id=mine)
        await LogTailer(db, cast(Any, None)).history_page(ORIGIN, mine, None, 10)
    finally:
        db.log_reading = reading  # type: ignore[method-assign]
    assert scoped == [mine, mine, mine]
    # The service's own reads of the whole log see every workspace, as the projections must.
    async with db.log_reading(None) as conn:
        every = {r[0] for r in await conn.fetch("SELECT DISTINCT workspace_id FROM events")}
    assert {mine, theirs} <= every


async def test_a_store_restored_into_a_new_cluster_is_refused(db: Database) -> None:
    await apply_migrations(db, [STORE_MIGRATIONS])
    await check_xid_horizon(db)
    async with db.acquire() as conn:
        await conn.execute(
            "INSERT INTO events (stream_id, version, event_id, workspace_id, type, data)"
            " VALUES ('s', 1, $1, 'w', 't', '{}')",
            uuid.uuid4(),
        )
    await check_xid_horizon(db)
    async with db.acquire() as conn:
        # As if written by an older cluster that had consumed far more transaction ids.
        await conn.execute("UPDATE events SET tx = '100000000000'::xid8")
    with pytest.raises(StoreError, match="logical dump") as refused:
        await check_xid_horizon(db)
    # The 64-bit id split as pg_resetwal takes it: 23 * 2**32 + 1215752192 = 100000000000.
    assert "pg_resetwal --epoch=23 --next-transaction-id=1215752193" in str(refused.value)


async def test_open_store_migrates_wires_the_tailer_and_closes(database_url: str) -> None:
    from eventstore import open_store

    store = await open_store(database_url, max_size=4, sample_open_tx_every_s=0.05)
    try:
        feed = store.subscribe()
        result = await store.append(
            "s-1",
            [NewEvent(type="t.Done", data={"a": 1})],
            expected_version=0,
            command_id="c-1",
            workspace_id="w",
        )
        first = await asyncio.wait_for(anext(aiter(feed)), timeout=30)
        assert (first.stream_id, first.cursor) == ("s-1", result.cursor)
        await feed.aclose()  # type: ignore[attr-defined]
    finally:
        await asyncio.wait_for(store.close(), timeout=30)
    check = await asyncpg.connect(database_url)
    try:
        assert await check.fetchval("SELECT count(*) FROM schema_migrations") == len(STORE_LABELS)
    finally:
        await check.close()


@asynccontextmanager
async def own_login(pg_server_url: str) -> AsyncIterator[tuple[str, str, asyncpg.Connection]]:
    """A new login owning a new database of its name: (name, its URL, an admin connection
    open for setting it up). Both are dropped afterwards, memberships included."""
    name = "t_" + uuid.uuid4().hex[:12]
    admin = await asyncpg.connect(pg_server_url)
    try:
        await admin.execute(f"CREATE ROLE \"{name}\" LOGIN PASSWORD 'pw-{name}'")
    except asyncpg.InsufficientPrivilegeError:
        await admin.close()
        pytest.skip("the test database's user may not create roles")
    try:
        await admin.execute(f'CREATE DATABASE "{name}" OWNER "{name}"')
        parts = urlsplit(pg_server_url)
        where = parts.netloc.rpartition("@")[2]  # host:port, or nothing for a Unix socket
        url = urlunsplit(parts._replace(netloc=f"{name}:pw-{name}@{where}", path="/" + name))
        yield name, url, admin
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.execute(f'DROP OWNED BY "{name}" CASCADE')
        await admin.execute(f'DROP ROLE IF EXISTS "{name}"')
        await admin.close()


async def test_another_databases_login_reads_no_events_as_the_log_reader(
    db: Database, database_url: str, pg_server_url: str
) -> None:
    """Review finding: `svc_log_reader` is one role for the whole cluster; another SVC
    database's login, a member of it too, connected here and read a workspace's events,
    credential hashes included. The policy also asks that the login may act as the log's
    owner."""
    await apply_migrations(db, [STORE_MIGRATIONS])
    workspace = f"ws-{uuid.uuid4().hex[:8]}"
    await PostgresEventStore(db).append(
        "s-1", [NewEvent("t.Said", {})], expected_version=0, command_id="c", workspace_id=workspace
    )
    async with own_login(pg_server_url) as (name, url, admin):
        await admin.execute(f'GRANT svc_log_reader TO "{name}"')
        here = urlunsplit(urlsplit(url)._replace(path=urlsplit(database_url).path))
        other = await asyncpg.connect(here)
        try:
            async with other.transaction():
                await other.execute("SET LOCAL ROLE svc_log_reader")
                await other.execute("SELECT set_config('svc.workspace_id', $1, true)", workspace)
                assert await other.fetchval("SELECT count(*) FROM events") == 0
        finally:
            await other.close()
        await admin.execute(f'REVOKE svc_log_reader FROM "{name}"')
    async with db.log_reading(workspace) as conn:  # this database's own login still reads
        assert await conn.fetchval("SELECT count(*) FROM events") == 1


async def _migration_refusal(url: str) -> str:
    """The message with which the store's migrations refuse to run as `url`'s login."""
    db = await Database.connect(url, max_size=2)
    try:
        with pytest.raises(StoreError) as caught:
            await apply_migrations(db, [STORE_MIGRATIONS])
    finally:
        await db.close()
    return caught.value.message


async def test_a_missing_privilege_names_the_migration_and_where_to_read(
    pg_server_url: str,
) -> None:
    """A login that owns its database but may not create or grant roles: the first
    migration's `svc_reader` step needs one or the other (docs/operations.md)."""
    async with own_login(pg_server_url) as (_, url, _admin):
        message = await _migration_refusal(url)
    assert message.startswith("migration eventstore/0002_roles needs a privilege"), message
    assert "docs/operations.md" in message


async def test_a_login_that_does_not_own_its_database_is_told_the_dbas_command(
    pg_server_url: str,
) -> None:
    """QA finding: such a login met "event store query failed (42501 ... permission denied
    for schema public)", with no migration named and nothing to do."""
    async with own_login(pg_server_url) as (name, url, admin):
        await admin.execute(f'ALTER DATABASE "{name}" OWNER TO CURRENT_USER')
        message = await _migration_refusal(url)
    assert "must own its database" in message, message
    assert f'ALTER DATABASE "{name}" OWNER TO "{name}";' in message
    assert "pw-" not in message


async def test_a_server_older_than_supported_is_named_and_one_too_old_refused(
    db: Database, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """QA ran on Debian's PostgreSQL 15, which operations.md calls unsupported, and nothing
    said so. (This server's version stands in, the floors raised above it.)"""
    monkeypatch.setattr(migrate, "_OLDEST_SUPPORTED", 10_000_000)
    with caplog.at_level(logging.WARNING, logger="eventstore.migrate"):
        await apply_migrations(db, [STORE_MIGRATIONS])
    assert "older than 16, the oldest release SVC supports" in caplog.text
    monkeypatch.setattr(migrate, "_OLDEST_WORKING", 10_000_000)
    with pytest.raises(StoreError, match="too old for the event store"):
        await apply_migrations(db, [STORE_MIGRATIONS])


async def test_a_login_that_only_administers_the_reader_role_is_given_set(
    pg_server_url: str,
) -> None:
    """PostgreSQL 16+: a role's creator holds it with ADMIN only (no SET), which passes
    0002's membership test; the migrations still leave the login able to switch to it."""
    async with own_login(pg_server_url) as (name, url, admin):
        if await admin.fetchval("SHOW server_version_num") < "160000":
            pytest.skip("membership options (SET, INHERIT) exist from PostgreSQL 16")
        readers = ("svc_reader", "svc_log_reader")
        for reader in readers:
            if not await admin.fetchval("SELECT 1 FROM pg_roles WHERE rolname = $1", reader):
                await admin.execute(f"CREATE ROLE {reader} NOLOGIN")
            # What CREATE ROLE gives its creator on PostgreSQL 16 and later.
            await admin.execute(
                f'GRANT {reader} TO "{name}" WITH ADMIN TRUE, INHERIT FALSE, SET FALSE'
            )
        db = await Database.connect(url, max_size=2)
        try:
            await apply_migrations(db, [STORE_MIGRATIONS])
            for reader in readers:
                async with db.transaction() as conn:
                    await conn.execute(f"SET LOCAL ROLE {reader}")
                    assert await conn.fetchval("SELECT current_user") == reader
        finally:
            await db.close()
        for reader in readers:
            await admin.execute(f'REVOKE {reader} FROM "{name}" CASCADE')


async def test_a_database_that_does_not_exist_is_named_as_such(pg_server_url: str) -> None:
    parts = urlsplit(pg_server_url)
    url = urlunsplit(parts._replace(path="/no_such_database_" + uuid.uuid4().hex[:8]))
    with pytest.raises(StoreError) as caught:
        await Database.connect(url, max_size=1)
    assert "does not exist" in caught.value.message and "createdb" in caught.value.message


async def test_a_database_migrated_by_a_newer_version_is_refused(
    db: Database, tmp_path: Path, make_source: type[MigrationSource]
) -> None:
    """Review finding: a rolled-back process applied nothing, said "up to date" and ran on
    tables a newer version had changed. The other namespaces' rows are not this run's."""
    older = write_package(tmp_path, {"0001_first.sql": "CREATE TABLE t_first (id int)"})
    assert await apply_migrations(db, [older]) == [f"{older.namespace}/0001_first"]
    async with db.acquire() as conn:
        await conn.execute(
            "INSERT INTO schema_migrations (namespace, version, name) VALUES ($1, 2, 'x'), "
            "('someone_else', 7, 'theirs')",
            older.namespace,
        )
    with pytest.raises(StoreError) as refused:
        await apply_migrations(db, [older])
    assert f"migrated by a newer version of SVC ({older.namespace}/0002_x)" in str(refused.value)
    assert "someone_else" not in str(refused.value)


async def test_a_run_waiting_for_anothers_migrations_says_so_once(
    db: Database, database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Review finding: every command waited silently behind another process's index build."""
    caplog.set_level(logging.WARNING, logger="eventstore.migrate")
    await apply_migrations(db, [STORE_MIGRATIONS])
    holder = await asyncpg.connect(database_url)
    try:
        async with holder.transaction():
            await holder.execute("SELECT pg_advisory_xact_lock($1)", migrate._LOCK_KEY)
            waiting = asyncio.ensure_future(apply_migrations(db, [STORE_MIGRATIONS]))
            async with asyncio.timeout(10):
                while "waiting for another process's migrations" not in caplog.text:  # noqa: ASYNC110
                    await asyncio.sleep(0.02)
            assert not waiting.done()
        assert await waiting == []
    finally:
        await holder.close()
    said = [r for r in caplog.records if "another process's migrations" in r.getMessage()]
    assert len(said) == 1
