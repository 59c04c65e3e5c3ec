"""A database that is down, slow or exhausted gives StoreUnavailable quickly, never a driver
error, and the same Database recovers by itself when PostgreSQL comes back."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import ssl
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest
from self_signed import key_and_cert

from eventstore.db import Database, translate_errors
from eventstore.embedded import EmbeddedPostgres
from eventstore.errors import StatementAborted, StoreError, StoreUnavailable
from eventstore.migrate import STORE_MIGRATIONS, apply_migrations
from eventstore.records import NewEvent
from eventstore.store import PostgresEventStore

T = TypeVar("T")

# Generous bounds on "fails fast" and "recovers": far above what a healthy run takes (well
# under a second each) yet far below a hang; they are not measurements.
FAST_S = 5.0
RECOVERY_S = 30.0


async def fails_fast(op: Callable[[], Awaitable[object]]) -> StoreUnavailable:
    started = time.monotonic()
    with pytest.raises(StoreUnavailable) as info:
        await op()
    assert time.monotonic() - started < FAST_S
    return info.value


async def eventually(op: Callable[[], Awaitable[T]]) -> T:
    deadline = time.monotonic() + RECOVERY_S
    while True:
        try:
            return await op()
        except StoreUnavailable:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


async def test_an_unreachable_server_fails_fast(tmp_path: Path) -> None:
    for dsn in (
        "postgresql://svc@127.0.0.1:1/svc",
        f"postgresql://svc@/svc?host={tmp_path / 'no-such-socket-dir'}",
    ):

        async def connect(dsn: str = dsn) -> Database:
            return await Database.connect(dsn, connect_timeout_s=1.0)

        error = await fails_fast(connect)
        assert dsn not in str(error)  # a DSN may carry a password
        # The address tried is the operator's to read (str(), the log), not a client's.
        assert "unreachable" in error.message and "127.0.0.1" not in error.message
        assert "check that PostgreSQL is running" in str(error)


async def test_a_closed_database_is_unavailable(database_url: str) -> None:
    db = await Database.connect(database_url, max_size=2)
    await db.close()

    async def use() -> None:
        async with db.acquire() as conn:
            await conn.fetchval("SELECT 1")

    await fails_fast(use)


async def test_an_exhausted_pool_times_out_as_unavailable(database_url: str) -> None:
    db = await Database.connect(database_url, min_size=1, max_size=1, acquire_timeout_s=0.2)
    try:
        async with db.acquire():
            assert db.pool_stats() == (1, 0, 1)

            async def second() -> None:
                async with db.acquire():
                    pass

            await fails_fast(second)
        assert db.pool_stats() == (1, 1, 1)
    finally:
        await db.close()


async def test_a_statement_timeout_is_unavailable(database_url: str) -> None:
    db = await Database.connect(database_url, max_size=1, statement_timeout_ms=100)
    try:

        async def slow() -> None:
            async with db.acquire() as conn:
                await conn.execute("SELECT pg_sleep(3)")

        await fails_fast(slow)
        async with db.acquire() as conn:
            assert await conn.fetchval("SELECT 1") == 1
    finally:
        await db.close()


async def test_a_statement_given_up_on_is_told_from_the_database_going_away(
    database_url: str,
) -> None:
    """A statement or lock timeout ends one statement of a sound session (StatementAborted,
    still unavailable to the client, in the store's words, not the server's); a terminated
    backend is the database going away."""
    db = await Database.connect(database_url, max_size=2)
    try:
        with pytest.raises(StatementAborted, match="57014") as timed_out:
            async with db.transaction() as conn:
                await conn.execute("SET LOCAL statement_timeout = 50")
                await conn.execute("SELECT pg_sleep(3)")
        # The client's words are the store's own; the server's stay in the detail.
        assert "57014" not in timed_out.value.message
        assert "statement timeout" in timed_out.value.detail
        async with db.transaction() as holder:
            await holder.execute("CREATE TABLE held (x int)")
        async with db.transaction() as holder:
            await holder.execute("LOCK TABLE held")
            with pytest.raises(StatementAborted, match="55P03"):
                async with db.transaction() as conn:
                    await conn.execute("SET LOCAL lock_timeout = 50")
                    await conn.execute("LOCK TABLE held")
        with pytest.raises(StoreUnavailable) as gone:
            async with db.acquire() as conn:
                await conn.execute("SELECT pg_terminate_backend(pg_backend_pid())")
        assert not isinstance(gone.value, StatementAborted)
    finally:
        await db.close()


@pytest.fixture
def private_server(tmp_path: Path) -> Iterator[EmbeddedPostgres]:
    tmp_path.chmod(0o755)
    server = EmbeddedPostgres(tmp_path / "pg")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def outage_store(private_server: EmbeddedPostgres) -> AsyncIterator[PostgresEventStore]:
    url = private_server.start()  # already running: returns its URL
    db = await Database.connect(url, min_size=2, max_size=4, connect_timeout_s=1.0)
    try:
        await apply_migrations(db, [STORE_MIGRATIONS])
        yield PostgresEventStore(db)
    finally:
        await db.close()


async def test_the_store_fails_fast_while_the_server_is_down_and_recovers(
    private_server: EmbeddedPostgres, outage_store: PostgresEventStore
) -> None:
    store = outage_store
    stream = "s-" + uuid.uuid4().hex

    def append(version: int) -> Callable[[], Awaitable[object]]:
        return lambda: store.append(
            stream,
            [NewEvent(type="t.Happened", data={"v": version})],
            expected_version=version,
            command_id=f"c-{stream}-{version}",
            workspace_id="w",
        )

    await append(0)()
    url = private_server.start()
    await asyncio.to_thread(private_server.stop)
    for _ in range(3):
        await fails_fast(append(1))
        await fails_fast(store.read_all)
        await fails_fast(store.head)

    assert await asyncio.to_thread(private_server.start) == url
    await eventually(append(1))
    assert [e.version for e in await store.read_stream(stream)] == [1, 2]
    assert len(await store.read_all()) == 2


async def test_a_terminated_connection_is_unavailable_not_a_driver_error(
    store_db: Database, database_url: str
) -> None:
    """A pooled connection whose backend was terminated (an administrator, a failover) is
    the database going away. Depending on when the backend's goodbye arrives, the next
    append finds the connection closed (the pool opens another one), loses it mid-query,
    or meets the driver mid-exchange; each is StoreUnavailable or success, never a driver
    error, and the store goes on working."""
    db = await Database.connect(database_url, min_size=1, max_size=1)
    store = PostgresEventStore(db)
    admin = await asyncpg.connect(database_url)
    outcomes: set[str] = set()

    def append() -> Awaitable[object]:
        return store.append(
            "s-" + uuid.uuid4().hex,
            [NewEvent(type="t.Happened", data={})],
            expected_version=0,
            command_id=uuid.uuid4().hex,
            workspace_id="w",
        )

    try:
        for _ in range(10):
            async with db.acquire() as conn:
                backend = conn.get_server_pid()
            await admin.execute("SELECT pg_terminate_backend($1)", backend)
            try:
                await append()
                outcomes.add("ok")
            except StoreUnavailable:
                outcomes.add("unavailable")
            await eventually(append)
    finally:
        await admin.close()
        await db.close()
    assert outcomes <= {"ok", "unavailable"}


async def test_a_statement_given_the_wrong_number_of_parameters_is_a_defect(
    store_db: Database,
) -> None:
    """A caller's bug, met again by every retry: not the database being unavailable, which
    a projection runner would retry for every projector without end."""
    async with store_db.acquire() as conn:
        for args in ((), (1, 2)):
            with pytest.raises(StoreError, match="bad parameters") as caught, translate_errors():
                await conn.fetchval("SELECT $1::int", *args)
            assert not isinstance(caught.value, StoreUnavailable)
        assert await conn.fetchval("SELECT 1") == 1  # the connection is sound


def test_a_drivers_timeout_is_unavailable_and_keeps_its_cause() -> None:
    """asyncpg's command timeout raises asyncio's TimeoutError; the projection runner tells
    a pipelined run that timed out on the client's clock by that cause."""
    with pytest.raises(StoreUnavailable, match="timed out") as caught, translate_errors():
        raise TimeoutError
    assert isinstance(caught.value.__cause__, TimeoutError)


def test_the_drivers_mid_exchange_failure_is_unavailable() -> None:
    """What asyncpg raises on a connection whose server said goodbye while a query started:
    its words are the log's (`str()`), not a client's (`message`)."""
    with pytest.raises(StoreUnavailable, match="retry shortly") as caught, translate_errors():
        raise asyncpg.InternalClientError(
            "cannot switch to state 12; another operation is in progress"
        )
    assert "state 12" not in caught.value.message and "state 12" in str(caught.value)


async def test_a_server_that_stops_answering_is_unavailable_after_the_statement_timeout(
    store_db: Database, database_url: str
) -> None:
    """The server's statement timeout cannot fire when its backend is frozen; the client's
    own bound (statement timeout plus a margin) ends the wait as StoreUnavailable."""
    db = await Database.connect(database_url, min_size=1, max_size=1, statement_timeout_ms=200)
    store = PostgresEventStore(db)
    async with db.acquire() as conn:
        backend = conn.get_server_pid()
    os.kill(backend, signal.SIGSTOP)
    try:
        async with asyncio.timeout(RECOVERY_S):
            with pytest.raises(StoreUnavailable, match="timed out"):
                await store.append(
                    "s-" + uuid.uuid4().hex,
                    [NewEvent(type="t.Happened", data={})],
                    expected_version=0,
                    command_id=uuid.uuid4().hex,
                    workspace_id="w",
                )
    finally:
        os.kill(backend, signal.SIGCONT)
        await db.close()


async def test_a_pool_with_every_connection_lent_says_so(database_url: str) -> None:
    """A wait for a connection that times out with all of them in use is no database down:
    the detail says the pool is full and names its setting, not "check that PostgreSQL is
    running". A body's own timeout is the database's still."""
    db = await Database.connect(database_url, min_size=1, max_size=1, acquire_timeout_s=0.2)
    try:
        async with db.acquire():
            with pytest.raises(StoreUnavailable, match="no database connection was free") as e:
                async with db.acquire():
                    pass
        assert "SVC_DB_POOL_SIZE" in e.value.detail and "PostgreSQL is running" not in str(e.value)
        with pytest.raises(StoreUnavailable, match="timed out"):
            async with db.acquire():
                raise TimeoutError
    finally:
        await db.close()


async def test_a_dedicated_connection_is_bounded_as_the_pools_are(database_url: str) -> None:
    """A connection of its own (the Ray router's cluster claim, its LISTEN) had no client
    bound: a server frozen or cut off without a reset held its caller for ever."""
    db = await Database.connect(database_url, min_size=1, max_size=1, statement_timeout_ms=200)
    conn = await db.connect_dedicated()
    backend = conn.get_server_pid()
    os.kill(backend, signal.SIGSTOP)
    try:
        async with asyncio.timeout(RECOVERY_S):
            with pytest.raises(StoreUnavailable, match="timed out"), translate_errors():
                await conn.fetchval("SELECT 1")
    finally:
        os.kill(backend, signal.SIGCONT)
        conn.terminate()
        await db.close()


@pytest.mark.parametrize(
    ("query", "named"),
    [
        ("sslmode=verify-full&sslrootcert=/nonexistent/ca.crt", "sslrootcert= names"),
        ("sslmode=require&sslcert=/nonexistent/client.crt", "sslcert= names"),
        ("sslmode=bogus", "`sslmode` parameter must be one of"),
    ],
)
async def test_tls_settings_the_driver_cannot_use_are_named(query: str, named: str) -> None:
    """Not a "malformed URL" to percent-encode, nor an unreachable database: the setting."""
    url = f"postgresql://svc:pw-not-shown@127.0.0.1:1/svc?{query}"
    with pytest.raises(StoreError) as caught:
        await Database.connect(url, max_size=1)
    message = caught.value.message
    assert named in message and "percent-encode" not in message, message
    assert "pw-not-shown" not in message
    assert not isinstance(caught.value, StoreUnavailable)


@pytest.mark.parametrize("where", ["url", "environment"])
async def test_sslrootcert_system_verifies_against_the_system_roots(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """The driver read `system` as a file name, and the missing file came out as "database
    unreachable". Against a server whose certificate no public CA signed, the handshake is
    now attempted and refused, and the refusal says so."""
    key_pem, cert_pem = key_and_cert("127.0.0.1", ip_address="127.0.0.1")
    (tmp_path / "server.key").write_text(key_pem)
    (tmp_path / "server.crt").write_text(cert_pem)
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(tmp_path / "server.crt", tmp_path / "server.key")

    async def postgres_ssl_request(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        try:
            await reader.readexactly(8)  # SSLRequest
            writer.write(b"S")
            await writer.drain()
            await writer.start_tls(server_tls)
        except (OSError, asyncio.IncompleteReadError):
            pass  # the client refused the certificate, as it must
        finally:
            writer.close()

    server = await asyncio.start_server(postgres_ssl_request, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    url = f"postgresql://svc:pw-not-shown@127.0.0.1:{port}/svc?sslmode=verify_full"
    if where == "url":
        url += "&sslrootcert=system"
    else:  # as libpq, from PGSSLROOTCERT
        monkeypatch.setenv("PGSSLROOTCERT", "system")
    try:
        with pytest.raises(StoreError) as caught:
            await Database.connect(url, max_size=1)
    finally:
        server.close()
    message = caught.value.message
    assert "TLS certificate was not accepted" in message, message
    assert not isinstance(caught.value, StoreUnavailable)
    with pytest.raises(StoreError, match="needs sslmode=verify-full"):
        await Database.connect(url.replace("verify_full", "require"), max_size=1)


@contextlib.asynccontextmanager
async def _own_login(database_url: str, options: str = "") -> AsyncIterator[tuple[str, Any]]:
    """A login of its own (password `pw-<role>`, `options` added to CREATE ROLE): its URL
    to `database_url`'s database, and an admin connection; both dropped afterwards."""
    role = f"svc_login_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(database_url)
    try:
        await admin.execute(f"CREATE ROLE {role} LOGIN PASSWORD 'pw-{role}' {options}")
        parts = urlsplit(database_url)
        host = parts.netloc.rsplit("@", 1)[-1]
        yield urlunsplit(parts._replace(netloc=f"{role}:pw-{role}@{host}")), admin
    finally:
        await admin.execute(f"DROP ROLE IF EXISTS {role}")
        await admin.close()


async def test_credentials_refused_while_running_are_unavailable_and_say_what_to_check(
    database_url: str,
) -> None:
    """Review finding: the user's password rotated (or its login taken away) while the
    service ran, each request that opened a new pooled connection was a 500 with nothing to
    act on; only startup said what was wrong."""
    async with _own_login(database_url) as (url, admin):
        db = await Database.connect(url, min_size=0)  # running, no connection open yet
        try:
            role = urlsplit(url).username
            await admin.execute(f"ALTER ROLE {role} NOLOGIN")
            with pytest.raises(StoreUnavailable) as caught:
                async with db.acquire() as conn:
                    await conn.fetchval("SELECT 1")
            assert "refused this service's user and password" in caught.value.message
            assert "pw-" not in str(caught.value)
        finally:
            await db.close()


async def test_no_connection_slot_free_names_the_limits_to_raise(database_url: str) -> None:
    """QA finding: a server out of connection slots read "unavailable; retry shortly" in the
    operator's log and CLI, and the cause went unnamed where the retries were logged."""
    async with _own_login(database_url, "CONNECTION LIMIT 1") as (url, _):
        db = await Database.connect(url, min_size=1, max_size=2)  # its one slot taken
        try:
            with pytest.raises(StoreUnavailable) as caught:
                async with db.acquire() as first, db.acquire() as second:
                    await first.fetchval("SELECT 1")
                    await second.fetchval("SELECT 1")
            assert "retry shortly" in caught.value.message  # what a client is told
            assert "max_connections" in caught.value.detail
            assert "SVC_DB_POOL_SIZE" in caught.value.detail
            assert "pw-" not in str(caught.value)
        finally:
            await db.close()


async def test_the_pool_notes_when_a_borrowers_work_last_ended(store_db: Database) -> None:
    """What the readiness probe (gateway/system.py) reads to tell a busy pool from one
    whose every connection is stuck on a frozen database."""
    store_db._answered_at -= 100  # nothing ended for a while
    assert not store_db.answered_within(10)
    with contextlib.suppress(RuntimeError):
        async with store_db.acquire() as conn:
            await conn.fetchval("SELECT 1")
            raise RuntimeError("a borrower's work that failed is no answer")
    assert not store_db.answered_within(10)
    async with store_db.acquire() as conn:
        await conn.fetchval("SELECT 1")
    assert store_db.answered_within(10)
