"""Tenant isolation at the SQL level (ARCHITECTURE.md decision 6): a session scoped to one
workspace sees nothing of another in any read-model table, whatever the query, and the reader
role cannot reach the log at all."""

from __future__ import annotations

import pytest
from projection_events import append, chat, key_issued, turn_failed, workspace_created

from eventstore import Database, PostgresEventStore, StoreError
from projections import ProjectionRunner, default_projectors, queries

A, B = "ws-a", "ws-b"

# Every workspace-scoped read-model table, with the columns svc_reader may select.
TABLES = {
    "workspaces": "*",
    "conversations": "*",
    "messages": "*",
    "turns": "*",
    "api_keys": "workspace_id, key_id, name, prefix, scopes, rate_limit_rpm, created_at, "
    "expires_at, revoked_at",
}


async def _two_tenants(store: PostgresEventStore, db: Database) -> None:
    for ws in (A, B):
        await append(store, ws, f"workspace:{ws}", workspace_created(ws, ws.upper()))
        await append(store, ws, f"workspace:{ws}", key_issued(ws, f"{ws}-k", f"svc_key_{ws}"))
        await chat(store, ws, f"{ws}-c1", 2)
        await chat(store, ws, f"{ws}-c2", 1)
        await append(store, ws, f"conversation:{ws}-c2", turn_failed(f"{ws}-c2", f"{ws}-tx"))
    await ProjectionRunner(db, default_projectors()).catch_up()


async def test_scoped_session_sees_only_its_workspace_in_every_table(
    store: PostgresEventStore, db: Database
) -> None:
    await _two_tenants(store, db)
    for table, columns in TABLES.items():
        async with db.acquire() as conn:
            everything = await conn.fetchval(f"SELECT count(*) FROM {table}")
            of_a = await conn.fetchval(f"SELECT count(*) FROM {table} WHERE workspace_id = $1", A)
        assert 0 < of_a < everything, table
        for ws in (A, B):
            async with db.scoped(ws) as conn:
                # Hostile: no WHERE at all.
                rows = await conn.fetch(f"SELECT {columns} FROM {table}")
                assert {r["workspace_id"] for r in rows} == {ws}, table
                assert len(rows) == everything - of_a if ws == B else of_a
                # Hostile: asking for the other workspace explicitly.
                other = B if ws == A else A
                assert (
                    await conn.fetchval(
                        f"SELECT count(*) FROM {table} WHERE workspace_id = $1", other
                    )
                    == 0
                )
        async with db.scoped("ws-nobody") as conn:
            assert await conn.fetchval(f"SELECT count(*) FROM {table}") == 0


async def test_reader_role_without_workspace_sees_nothing(
    store: PostgresEventStore, db: Database
) -> None:
    await _two_tenants(store, db)
    async with db.transaction() as conn:
        await conn.execute("SET LOCAL ROLE svc_reader")
        for table in ("workspaces", "conversations", "messages", "turns"):
            assert await conn.fetchval(f"SELECT count(*) FROM {table}") == 0, table


@pytest.mark.parametrize(
    "statement",
    [
        "SELECT * FROM events",
        "SELECT count(*) FROM events",
        "SELECT * FROM processed_commands",
        "SELECT * FROM snapshots",
        "SELECT * FROM projection_checkpoints",
        "SELECT key_hash FROM api_keys",
        "SELECT * FROM api_keys",
        "INSERT INTO conversations (workspace_id, id, created_at, updated_at) "
        "VALUES ('ws-a', 'x', now(), now())",
        "UPDATE conversations SET title = 'pwned'",
        "DELETE FROM messages",
        "TRUNCATE turns",
    ],
)
async def test_reader_role_cannot_read_the_log_or_write(
    store: PostgresEventStore, db: Database, statement: str
) -> None:
    await _two_tenants(store, db)
    with pytest.raises(StoreError, match="permission denied"):
        async with db.scoped(A) as conn:
            await conn.execute(statement)


async def test_queries_never_cross_workspaces(store: PostgresEventStore, db: Database) -> None:
    await _two_tenants(store, db)
    items, total = await queries.list_conversations(db, A)
    assert total == 2 and {c.workspace_id for c in items} == {A}
    assert await queries.get_messages(db, A, f"{B}-c1") == []
    assert await queries.get_conversation(db, A, f"{B}-c1") is None
    assert {t.conversation_id for t in await queries.list_turns(db, A)} == {f"{A}-c1", f"{A}-c2"}
    assert await queries.list_turns(db, A, f"{B}-c1") == []
    assert [k.key_id for k in await queries.list_api_keys(db, A)] == [f"{A}-k"]
    workspace = await queries.get_workspace(db, B)
    assert workspace is not None and workspace.name == "WS-B"
    overview_a = await queries.overview(db, A)
    assert (overview_a.conversations, overview_a.messages, overview_a.turns) == (2, 6, 4)
    assert overview_a.api_keys_active == 1


async def test_every_table_svc_reader_can_read_is_under_a_workspace_policy(db: Database) -> None:
    """A guard for tables added later: whatever carries tenant rows and is readable by
    svc_reader has row-level security on, with a policy on svc.workspace_id."""
    async with db.acquire() as conn:
        rows = await conn.fetch(
            """
            SELECT c.relname, c.relrowsecurity,
                   EXISTS (SELECT 1 FROM pg_policy p WHERE p.polrelid = c.oid
                           AND pg_get_expr(p.polqual, p.polrelid) LIKE '%svc.workspace_id%')
            FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
            WHERE n.nspname = 'public' AND c.relkind = 'r'
              AND (has_table_privilege('svc_reader', c.oid, 'SELECT')
                   OR has_any_column_privilege('svc_reader', c.oid, 'SELECT'))
            ORDER BY 1
            """
        )
    readable = {r[0]: (r[1], r[2]) for r in rows}
    assert set(TABLES) <= set(readable)
    assert {name for name, (rls, policy) in readable.items() if not (rls and policy)} == set()


async def test_a_scoped_read_sees_one_snapshot_while_projections_write(
    store: PostgresEventStore, db: Database
) -> None:
    """A page and its total come from two statements: both must see the same rows."""
    await _two_tenants(store, db)
    async with db.scoped(A) as conn:
        before = await conn.fetchval("SELECT count(*) FROM conversations")
        await chat(store, A, f"{A}-c3", 1)
        await ProjectionRunner(db, default_projectors()).catch_up()  # commits meanwhile
        assert await conn.fetchval("SELECT count(*) FROM conversations") == before
    _, total = await queries.list_conversations(db, A)
    assert total == before + 1
