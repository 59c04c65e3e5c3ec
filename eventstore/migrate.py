"""Versioned SQL migrations, applied once each, safe to run from several processes at once.

A source is a package directory of `NNNN_name.sql` files under a namespace (`eventstore`,
`projections`, ...). Each file runs in its own transaction together with its row in
`schema_migrations`, under one transaction-scoped advisory lock: a second process running the
migrations at the same time waits, then sees the row and skips the file.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources

import asyncpg

from eventstore.db import NO_COMMAND_TIMEOUT_S, Connection, Database
from eventstore.errors import StoreError

log = logging.getLogger(__name__)

_FILE_NAME = re.compile(r"^(\d{4})_([A-Za-z0-9_]+)\.sql$")

# Arbitrary but fixed: every SVC process must agree on it. b"SVCMIGR\0" as a signed int8.
_LOCK_KEY = 0x5356434D49475200

_LEDGER_DDL = """
CREATE TABLE IF NOT EXISTS schema_migrations (
    namespace  text NOT NULL,
    version    integer NOT NULL,
    name       text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (namespace, version)
)
"""


# The login must be able to `SET LOCAL ROLE` to the readers (db.py's scoped reads: svc_reader
# from migration 0002, svc_log_reader from 0009). The migrations grant the membership when
# the login is no member; but since PostgreSQL 16 a role's creator is a member with ADMIN
# only, neither SET nor INHERIT, so a login with CREATEROLE (the usual managed-database
# owner) passed that test and every scoped read then failed. Checked on every run, so
# databases migrated before this check are mended too.
_READER_MEMBERSHIP = """
DO $$
DECLARE
    modern boolean := current_setting('server_version_num')::int >= 160000;
    reader text;
BEGIN
    FOREACH reader IN ARRAY ARRAY['svc_reader', 'svc_log_reader'] LOOP
        IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = reader) THEN
            CONTINUE;
        END IF;
        IF modern AND NOT pg_has_role(current_user, reader, 'SET') THEN
            EXECUTE format('GRANT %I TO %I WITH INHERIT FALSE, SET TRUE', reader, current_user);
        ELSIF NOT modern AND NOT pg_has_role(current_user, reader, 'MEMBER') THEN
            EXECUTE format('GRANT %I TO %I', reader, current_user);
        END IF;
    END LOOP;
END
$$
"""


@dataclass(frozen=True, slots=True)
class Migration:
    namespace: str
    version: int
    name: str
    sql: str

    @property
    def label(self) -> str:
        return f"{self.namespace}/{self.version:04d}_{self.name}"


@dataclass(frozen=True, slots=True)
class MigrationSource:
    namespace: str
    package: str

    def migrations(self) -> list[Migration]:
        """The source's migrations in version order; a duplicated version is an error."""
        found: dict[int, Migration] = {}
        for entry in resources.files(self.package).iterdir():
            match = _FILE_NAME.match(entry.name)
            if match is None or not entry.is_file():
                continue
            version = int(match.group(1))
            if version in found:
                raise StoreError(
                    f"migration {self.namespace} version {version:04d} is defined twice "
                    f"({found[version].name} and {match.group(2)}) in {self.package}"
                )
            sql = entry.read_text(encoding="utf-8")
            found[version] = Migration(self.namespace, version, match.group(2), sql)
        return [found[v] for v in sorted(found)]


STORE_MIGRATIONS = MigrationSource("eventstore", "eventstore.migrations")


class _LockWait:
    """Whether this run has said yet that it waits for another process's migrations."""

    def __init__(self) -> None:
        self.said = False


async def _lock(conn: Connection, wait: _LockWait) -> None:
    # Migrations may build indexes for minutes and a second process may wait that long for
    # the lock: the pool's statement timeout does not apply here. A process that must wait
    # says so once, or a command waiting behind another's index build prints nothing.
    await conn.execute("SET LOCAL statement_timeout = 0")
    if await conn.fetchval("SELECT pg_try_advisory_xact_lock($1)", _LOCK_KEY):
        return
    if not wait.said:
        wait.said = True
        log.warning(
            "waiting for another process's migrations to end (its log names the one it is "
            "applying; an index on a large table may take minutes)"
        )
    await conn.execute("SELECT pg_advisory_xact_lock($1)", _LOCK_KEY, timeout=NO_COMMAND_TIMEOUT_S)


async def _apply_one(db: Database, migration: Migration, wait: _LockWait) -> bool:
    try:
        return await _apply_locked(db, migration, wait)
    except StoreError as exc:
        if isinstance(exc.__cause__, asyncpg.InsufficientPrivilegeError):
            raise StoreError(
                f"migration {migration.label} needs a privilege the database user lacks "
                f"({exc.__cause__}); docs/operations.md, 'Requirements', lists what the user "
                "needs and what a DBA can grant once instead"
            ) from exc
        raise


async def _apply_locked(db: Database, migration: Migration, wait: _LockWait) -> bool:
    async with db.transaction() as conn:
        await _lock(conn, wait)
        done = await conn.fetchval(
            "SELECT 1 FROM schema_migrations WHERE namespace = $1 AND version = $2",
            migration.namespace,
            migration.version,
        )
        if done:
            return False
        log.info("applying migration %s", migration.label)
        await conn.execute(migration.sql, timeout=NO_COMMAND_TIMEOUT_S)
        await conn.execute(
            "INSERT INTO schema_migrations (namespace, version, name) VALUES ($1, $2, $3)",
            migration.namespace,
            migration.version,
            migration.name,
        )
        return True


async def apply_migrations(db: Database, sources: Sequence[MigrationSource]) -> list[str]:
    """Apply every pending migration, source by source in the given order.

    Returns the labels (`namespace/NNNN_name`) of the migrations this call applied; an
    up-to-date database gives an empty list.
    """
    wait = _LockWait()
    async with db.transaction() as conn:
        server = await _check_server(conn)
        await _lock(conn, wait)
        await _create_ledger(conn, server)
        await _refuse_newer(conn, sources)
    applied: list[str] = []
    for source in sources:
        for migration in source.migrations():
            try:
                if await _apply_one(db, migration, wait):
                    applied.append(migration.label)
            except Exception:
                log.error(
                    "migration %s failed and is not recorded as applied; %s; fix the cause and "
                    "run the migrations again (`svc migrate`): they go on from %s",
                    migration.label,
                    _applied_before(applied),
                    migration.label,
                )
                raise
    await _ensure_reader_membership(db, wait)
    return applied


_OLDEST_WORKING = 130000
"""PostgreSQL 13 brought what the store's gap-free reads need: `xid8`, `pg_current_xact_id()`,
`pg_snapshot_xmin()`."""
_OLDEST_SUPPORTED = 160000


@dataclass(frozen=True)
class _Server:
    login: str
    database: str
    version: str


async def _check_server(conn: Connection) -> _Server:
    """Refuses a PostgreSQL the store cannot run on; warns of one older than we support (it
    runs, but its grants differ, and the tests do not run on it)."""
    row = await conn.fetchrow(
        "SELECT current_user AS login, current_database() AS database, "
        "current_setting('server_version') AS version, "
        "current_setting('server_version_num')::int AS number"
    )
    assert row is not None
    server = _Server(row["login"], row["database"], row["version"])
    if row["number"] < _OLDEST_WORKING:
        raise StoreError(
            f"PostgreSQL {server.version} is too old for the event store, which needs 13 or "
            "newer (xid8, pg_current_xact_id); use PostgreSQL 16 or newer "
            "(docs/operations.md, Requirements)"
        )
    if row["number"] < _OLDEST_SUPPORTED:
        log.warning(
            "PostgreSQL %s is older than 16, the oldest release SVC supports: the store runs "
            "on it, but its tests do not; upgrade it (docs/operations.md, Requirements)",
            server.version,
        )
    return server


async def _create_ledger(conn: Connection, server: _Server) -> None:
    try:
        await conn.execute(_LEDGER_DDL)
    except asyncpg.InsufficientPrivilegeError as exc:
        raise StoreError(
            f"the login {server.login} may not create SVC's tables in database "
            f"{server.database} ({exc}): SVC's login must own its database; a DBA runs "
            f'`ALTER DATABASE "{server.database}" OWNER TO "{server.login}";` '
            "(docs/operations.md, Requirements), then `svc migrate` again"
        ) from exc


async def _refuse_newer(conn: Connection, sources: Sequence[MigrationSource]) -> None:
    """A database migrated by a newer version (a rollback, or two versions side by side)
    holds migrations this code does not know: its tables may not be what this code reads
    and writes, so nothing runs on it (docs/operations.md, "Upgrading")."""
    known = {(m.namespace, m.version) for source in sources for m in source.migrations()}
    rows = await conn.fetch(
        "SELECT namespace, version, name FROM schema_migrations WHERE namespace = ANY($1) "
        "ORDER BY namespace, version",
        sorted({source.namespace for source in sources}),
    )
    unknown = [
        Migration(row["namespace"], row["version"], row["name"], "").label
        for row in rows
        if (row["namespace"], row["version"]) not in known
    ]
    if unknown:
        raise StoreError(
            f"the database was migrated by a newer version of SVC ({', '.join(unknown)}); "
            "run that version, or restore the backup taken before it"
        )


def _applied_before(applied: Sequence[str]) -> str:
    if not applied:
        return "none was applied before it in this run"
    return f"the {len(applied)} applied before it in this run stay applied: {', '.join(applied)}"


async def _ensure_reader_membership(db: Database, wait: _LockWait) -> None:
    try:
        async with db.transaction() as conn:
            await _lock(conn, wait)
            await conn.execute(_READER_MEMBERSHIP)
    except StoreError as exc:
        if isinstance(exc.__cause__, asyncpg.InsufficientPrivilegeError):
            raise StoreError(
                "the database user cannot switch to the roles svc_reader and svc_log_reader, "
                "which scoped reads need, and may not grant itself that right; have a DBA "
                "run: GRANT svc_reader, svc_log_reader TO <this user> WITH SET TRUE "
                "(PostgreSQL 16 and later; before 16, GRANT svc_reader, svc_log_reader TO "
                "<this user>), see docs/operations.md, 'Requirements'"
            ) from exc
        raise
