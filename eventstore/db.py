"""The connection pool and the one place where driver errors become the store's own.

Every asyncpg call inside `eventstore` runs under `translate_errors()` (the pool's
`acquire`/`transaction`/`scoped` already wrap their bodies in it), so no asyncpg or socket
exception leaves the package. A database that is down fails fast (short connect and acquire
timeouts) with `StoreUnavailable`; the pool drops dead connections and opens new ones on the
next acquire, so the service recovers by itself when the database comes back.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import ssl
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any, NamedTuple, TypeAlias
from urllib.parse import parse_qs, urlsplit

import asyncpg
import orjson

from eventstore.errors import StatementAborted, StoreError, StoreUnavailable

log = logging.getLogger(__name__)

Connection: TypeAlias = Any
"""An `asyncpg.Connection` (asyncpg ships no type information)."""

READER_ROLE = "svc_reader"
"""Least-privilege role for workspace-scoped reads; created by migration 0002."""
LOG_READER_ROLE = "svc_log_reader"
"""Least-privilege role for workspace-scoped reads of the log; created by migration 0009."""

# SQLSTATE classes and codes meaning "the database cannot serve us right now", as opposed to
# "this statement is wrong": connection exceptions (08), insufficient resources such as too
# many connections (53), operator intervention such as shutdown and statement timeout (57),
# idle-in-transaction timeout (25P03), serialization failure and deadlock (40), lock timeout
# (55P03).
_SCOPE = "SELECT set_config('role', $1, true), set_config('svc.workspace_id', $2, true)"
_UNAVAILABLE_CLASSES = ("08", "53", "57", "40")
_UNAVAILABLE_STATES = frozenset({"25P03", "55P03"})
# Among those, the ones where the server gave up on one statement and the session goes on
# (StatementAborted): the transaction-rollback class (40: serialization failure, deadlock),
# query canceled (57014: the statement timeout, or a cancel request) and lock not available
# (55P03: the lock timeout). The rest of class 57 (shutdown, crash, cannot connect now,
# database dropped), 08 and 25P03 end the session: the database, not the statement.
_ABORTED_CLASSES = ("40",)
_CREDENTIALS_REFUSED_CLASS = "28"
"""Invalid authorization specification: the server refused the user or its password."""
_TOO_MANY_CONNECTIONS = "53300"
"""No connection slot free: PostgreSQL's "too many clients already", "remaining connection
slots are reserved ..." once only the reserved ones are left, or a login's CONNECTION LIMIT."""
_ABORTED_STATES = frozenset({"57014", "55P03"})


class PoolStats(NamedTuple):
    size: int
    idle: int
    max: int


def is_unavailable_state(state: str) -> bool:
    """A SQLSTATE that says "the database could not do it now", not "this request is wrong"."""
    return state[:2] in _UNAVAILABLE_CLASSES or state in _UNAVAILABLE_STATES


def is_aborted_state(state: str) -> bool:
    """An unavailable SQLSTATE that ended one statement, the session still sound."""
    return state[:2] in _ABORTED_CLASSES or state in _ABORTED_STATES


def _sqlstate(exc: asyncpg.PostgresError) -> str:
    return getattr(exc, "sqlstate", "") or ""


_MALFORMED_DSN = (
    "the database URL is not a valid PostgreSQL URL (postgresql://user:password@host:port/db"
    "?options); percent-encode reserved characters such as / ? # @ : in the user name and "
    "password"
)


_CALLER_FAULTS = (
    "argument for this query",
    "arguments for this query",
    "number of query arguments",
)
"""asyncpg's words for a statement given the wrong number of parameters (an InterfaceError,
not a ValueError): a defect of the caller, never the connection's."""


@contextmanager
def translate_errors() -> Iterator[None]:
    """Map driver, socket and timeout errors to `eventstore.errors`.

    Messages carry the error class and the server's message, never the DSN (it may hold a
    password). Errors the caller must tell apart (a unique violation meaning a concurrency
    conflict) are caught by the caller inside this block before they reach it.
    """
    try:
        yield
    except StoreError:
        raise
    except asyncpg.PostgresError as exc:
        if is_aborted_state(_sqlstate(exc)):
            raise StatementAborted(f"{exc.sqlstate} {type(exc).__name__}: {exc}") from exc
        if _sqlstate(exc)[:2] == _CREDENTIALS_REFUSED_CLASS:
            # A new pooled connection after the password was rotated (or pg_hba changed)
            # while the service ran: the database's state, and not a retry's to cure.
            raise StoreUnavailable.with_detail(
                "the database refused this service's user and password (changed since it "
                "started?); check the database URL's credentials and that the user may "
                "connect, then restart the service",
                f"{type(exc).__name__}: {exc}",
            ) from exc
        if _sqlstate(exc) == _TOO_MANY_CONNECTIONS:
            # Unavailable to a client (it may pass), but a retry is not the operator's cure.
            raise StoreUnavailable.with_detail(
                "the event store database is unavailable; retry shortly",
                f"{type(exc).__name__}: {exc}; the server has no connection slot free for "
                "this login: raise its max_connections (or the login's CONNECTION LIMIT), or "
                "lower SVC_DB_POOL_SIZE (each gateway opens up to that many) or "
                "SVC_ACTOR_HOST_POOL_SIZE (each Ray actor host); docs/operations.md, "
                "Requirements",
            ) from exc
        if is_unavailable_state(_sqlstate(exc)):
            raise StoreUnavailable.with_detail(
                "the event store database is unavailable; retry shortly",
                f"{type(exc).__name__}: {exc}",
            ) from exc
        raise StoreError(
            f"event store query failed ({exc.sqlstate} {type(exc).__name__}: {exc})"
        ) from exc
    except asyncpg.InterfaceError as exc:
        if isinstance(exc, ValueError) or any(fault in str(exc) for fault in _CALLER_FAULTS):
            # The caller's defect, which a retry meets again: not the database's state.
            raise StoreError(f"event store query got bad parameters: {exc}") from exc
        if "released back to the pool" in str(exc):
            # The pool detaches a connection the server terminated from its holder, and says
            # so in words that point at the caller; the cause is the server's.
            raise StoreUnavailable(
                "the event store connection was closed by the database (terminated or lost); "
                "retry shortly"
            ) from exc
        # Closed connection or pool, connection lost mid-query: nothing a retry can't fix.
        raise StoreUnavailable.with_detail(
            "the event store connection is unusable; retry shortly",
            f"{type(exc).__name__}: {exc}",
        ) from exc
    except asyncpg.InternalClientError as exc:
        # What the driver raises on a connection whose server sent its shutdown message or
        # was terminated mid-exchange ("cannot switch to state ..."): the database going away.
        raise StoreUnavailable.with_detail(
            "the event store connection is unusable; retry shortly",
            f"{type(exc).__name__}: {exc}",
        ) from exc
    except OSError as exc:  # also TimeoutError (asyncio's included) on Python 3.11+
        # The address it could not reach is the operator's to read, not a client's.
        reason = "timed out" if isinstance(exc, TimeoutError) else "is unreachable"
        raise StoreUnavailable.with_detail(
            f"the event store database {reason}; retry shortly",
            f"{str(exc) or type(exc).__name__}; check that PostgreSQL is running and reachable",
        ) from exc


_TLS_FILES = ("sslrootcert", "sslcert", "sslkey", "sslcrl")


def _check_tls_files(dsn: str) -> None:
    """A TLS file the URL names that is not there: the driver reports it as a bare "No such
    file or directory", which would read as the database being unreachable."""
    try:
        query = parse_qs(urlsplit(dsn).query)
    except ValueError:
        return  # the driver refuses the URL itself, without quoting it (see `connect`)
    for name in _TLS_FILES:
        for path in query.get(name, []):
            if path != "system" and not Path(path).expanduser().is_file():
                raise StoreError(
                    f"the database URL's {name}= names {path!r}, which is not a readable "
                    "file here; correct the path, or mount the file"
                )


def _tls_options(dsn: str) -> dict[str, Any]:
    """`sslrootcert=system` (libpq 16's: the system's trusted roots; from the URL or
    PGSSLROOTCERT), which the driver would open as a file named "system": a TLS context of
    our own instead, verifying as libpq does with it (verify-full). The driver ignores its
    other TLS settings when given a context, so what it would have read (a client
    certificate and key, from the URL, the PG* variables or ~/.postgresql, the key's
    password, a CRL) is loaded into it here."""
    try:
        query = {name: values[-1] for name, values in parse_qs(urlsplit(dsn).query).items()}
    except ValueError:
        return {}

    def setting(name: str, variable: str) -> str:
        return query.get(name) or os.environ.get(variable, "")

    if setting("sslrootcert", "PGSSLROOTCERT") != "system":
        return {}
    mode = (setting("sslmode", "PGSSLMODE") or "verify-full").replace("_", "-")
    if mode != "verify-full":
        raise StoreError(
            f"the database URL's sslrootcert=system needs sslmode=verify-full, not {mode!r} "
            "(as libpq requires); change sslmode, or name a CA file in sslrootcert="
        )
    context = ssl.create_default_context()  # the system's roots, hostname checked
    context.set_alpn_protocols(["postgresql"])  # PostgreSQL 17's direct TLS requires it
    cert, key = _client_certificate(setting("sslcert", "PGSSLCERT"), setting("sslkey", "PGSSLKEY"))
    password = query.get("sslpassword") or None
    try:
        if cert is not None:
            context.load_cert_chain(cert, key, password=password)
        if crl := setting("sslcrl", "PGSSLCRL"):
            context.load_verify_locations(cafile=Path(crl).expanduser())
            context.verify_flags |= ssl.VERIFY_CRL_CHECK_CHAIN
    except OSError as exc:  # ssl.SSLError is one: a file that is no certificate or key
        raise StoreError(
            f"the database URL's sslcert=, sslkey= or sslcrl= file could not be loaded "
            f"({type(exc).__name__}); check that each is the PEM file it should be, and "
            "sslpassword= for an encrypted key"
        ) from None
    return {"ssl": context}


def _client_certificate(cert: str, key: str) -> tuple[Path | None, Path | None]:
    """The client certificate and key, as libpq finds them: named, or
    ~/.postgresql/postgresql.crt and .key when they exist."""
    home = Path("~/.postgresql").expanduser()
    cert_path = Path(cert).expanduser() if cert else home / "postgresql.crt"
    if not cert and not cert_path.is_file():
        return None, None
    key_path = Path(key).expanduser() if key else home / "postgresql.key"
    return cert_path, key_path if (key or key_path.is_file()) else None


_TLS_SETTING = re.compile(r"(?i)\b(ssl\w*|tls|certificate)\b")


@contextmanager
def _connect_errors() -> Iterator[None]:
    """What the errors of opening a connection mean for whoever wrote the database URL:
    its spelling (the driver's "invalid DSN" is a ValueError, refused as a malformed URL by
    `connect`) and its credentials. (A missing SSL certificate file and a missing Unix
    socket both come as a bare FileNotFoundError: left to read as unreachable.)"""
    try:
        yield
    except ssl.SSLCertVerificationError as exc:
        raise StoreError(
            f"the database's TLS certificate was not accepted ({exc.verify_message}); check "
            "that sslrootcert= names the CA that signed it (or is system, for a certificate "
            "of a public CA) and that the URL's host is the one the certificate names"
        ) from None
    except asyncpg.ClientConfigurationError as exc:
        if not _TLS_SETTING.search(str(exc)):
            raise ValueError from None  # the URL's spelling, which may quote the password
        # The URL's TLS settings name a file or mode the driver cannot use (`verify-full`
        # with no root certificate where it looks): its message names them, never the URL.
        reason = " ".join(str(exc).split())  # its HINT comes on a line of its own
        raise StoreError(
            f"the database URL's TLS settings cannot be used: {reason.rstrip('.')}. Set "
            "sslrootcert= to the CA certificate file (or sslrootcert=system), or change sslmode"
        ) from None
    except asyncpg.InterfaceError as exc:
        if isinstance(exc, ValueError):
            raise ValueError from None
        raise
    except (asyncpg.InvalidPasswordError, asyncpg.InvalidAuthorizationSpecificationError) as exc:
        raise StoreError(
            f"the database refused the user and password of the database URL ({exc.sqlstate} "
            f"{type(exc).__name__}); check them, and that the user may connect"
        ) from exc
    except asyncpg.InvalidCatalogNameError as exc:
        raise StoreError(
            f"the database the database URL names does not exist ({exc}); create it "
            "(`createdb -O <user> <name>`) or correct the URL's path"
        ) from exc


COMMAND_TIMEOUT_MARGIN_S = 5.0
"""How long past the server's statement timeout the client waits for an answer. The server
ends a slow statement itself; this bound is for a server that cannot answer at all (frozen,
or the network gone without a reset), where only the client can give up."""

NO_COMMAND_TIMEOUT_S = 7 * 24 * 3600.0
"""The `timeout` of a call that may legitimately wait for as long as it takes (migrations,
which take the migration lock and build indexes with no statement timeout)."""


def _command_timeout_s(statement_timeout_ms: int) -> float | None:
    if statement_timeout_ms <= 0:
        return None
    return statement_timeout_ms / 1000 + COMMAND_TIMEOUT_MARGIN_S


def _encode_jsonb(value: Any) -> str:
    return orjson.dumps(value).decode()


async def _init_connection(conn: Connection) -> None:
    # Text format so the decoder is orjson.loads itself, a C function called per value with
    # no Python frame in between: jsonb decoding is a large part of a catch-up read's cost.
    await conn.set_type_codec(
        "jsonb",
        encoder=_encode_jsonb,
        decoder=orjson.loads,
        schema="pg_catalog",
        format="text",
    )


class _StoreConnection(asyncpg.Connection):  # type: ignore[misc]  # asyncpg is untyped
    """A pooled connection that can skip the pool's reset query on one release.

    On release the pool normally sends `SELECT pg_advisory_unlock_all(); CLOSE ALL;
    UNLISTEN *; RESET ALL;`: a round trip as long as the one-statement append itself. A
    borrower that only ran statements leaving no session state behind (no SET, LISTEN,
    cursor or session advisory lock) says so with `skip_next_reset()`; everyone else still
    gets the full reset.
    """

    __slots__ = ("_svc_skip_reset",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._svc_skip_reset = False

    def skip_next_reset(self) -> None:
        self._svc_skip_reset = True

    def get_reset_query(self) -> str:
        if self._svc_skip_reset:
            self._svc_skip_reset = False
            return ""
        query: str = super().get_reset_query()
        return query


def _skip_reset(conn: Connection) -> None:
    """Skip the reset of a borrowed connection on its release. A connection the server
    terminated is detached from the pool's proxy (asyncpg's `_con` becomes None) and dropped
    on release: there is nothing to reset, and nothing to call it on. A body that reports such
    a loss as an outcome instead of raising (one-by-one appends) gets here with it."""
    if getattr(conn, "_con", None) is not None:
        conn.skip_next_reset()


class Database:
    """An asyncpg pool with the store's session settings and error translation."""

    def __init__(
        self,
        pool: Any,
        *,
        dsn: str,
        server_settings: dict[str, str],
        connect_timeout_s: float,
        acquire_timeout_s: float,
        command_timeout_s: float | None = None,
    ) -> None:
        self._pool = pool
        self._dsn = dsn
        self._server_settings = server_settings
        self._connect_timeout_s = connect_timeout_s
        self._acquire_timeout_s = acquire_timeout_s
        self._command_timeout_s = command_timeout_s
        self._answered_at = time.monotonic()

    @classmethod
    async def connect(
        cls,
        dsn: str,
        *,
        min_size: int = 1,
        max_size: int = 20,
        statement_timeout_ms: int = 30000,
        idle_in_tx_timeout_ms: int = 10000,
        connect_timeout_s: float = 5.0,
        acquire_timeout_s: float | None = None,
    ) -> Database:
        """Open the pool; raise `StoreUnavailable` quickly when the database is down.

        `idle_in_transaction_session_timeout` bounds how long a stuck client can hold a
        transaction open, because every open writing transaction holds back gap-free readers.
        """
        settings = {
            "statement_timeout": str(statement_timeout_ms),
            "idle_in_transaction_session_timeout": str(idle_in_tx_timeout_ms),
            "application_name": "svc",
            # Every date computed in SQL is a UTC one (day buckets, `date_trunc`, the steps of
            # `generate_series`), whatever time zone the server or database defaults to: with
            # one that keeps summer time a day is not always 24 hours.
            "TimeZone": "UTC",
        }
        _check_tls_files(dsn)
        try:
            with translate_errors(), _connect_errors():
                pool = await asyncpg.create_pool(
                    dsn,
                    **_tls_options(dsn),
                    min_size=min_size,
                    max_size=max_size,
                    timeout=connect_timeout_s,
                    command_timeout=_command_timeout_s(statement_timeout_ms),
                    server_settings=settings,
                    init=_init_connection,
                    connection_class=_StoreConnection,
                )
        except (ValueError, OverflowError):  # OverflowError: a port past 65535
            # The driver's URL parser quotes the part it could not read, which is often the
            # password: neither its message nor its traceback may travel further.
            raise StoreError(_MALFORMED_DSN) from None
        if acquire_timeout_s is None:
            acquire_timeout_s = connect_timeout_s + 1.0
        return cls(
            pool,
            dsn=dsn,
            server_settings=settings,
            connect_timeout_s=connect_timeout_s,
            acquire_timeout_s=acquire_timeout_s,
            command_timeout_s=_command_timeout_s(statement_timeout_ms),
        )

    async def connect_dedicated(self) -> Connection:
        """A connection outside the pool with the pool's settings and codecs, for a
        long-lived use such as LISTEN. The caller closes it, and runs its statements under
        `translate_errors`. Each statement waits for its answer no longer than the pool's
        do (a server cut off without a reset would otherwise hold the caller for ever); a
        caller that lifts `statement_timeout` for a long statement gives that one its own
        `timeout=`."""
        with translate_errors():
            conn = await asyncpg.connect(
                self._dsn,
                **_tls_options(self._dsn),
                timeout=self._connect_timeout_s,
                command_timeout=self._command_timeout_s,
                server_settings=self._server_settings,
            )
            try:
                await _init_connection(conn)
            except BaseException:
                conn.terminate()
                raise
        return conn

    async def close(self, timeout_s: float = 10.0) -> None:
        """Close the pool, waiting for borrowed connections to come back; after `timeout_s`
        terminate whatever is still out, so shutdown never hangs on a leaked connection."""
        with translate_errors():
            try:
                async with asyncio.timeout(timeout_s):
                    await self._pool.close()
            except TimeoutError:
                log.warning("event store pool did not close in %.1fs; terminating it", timeout_s)
                self._pool.terminate()

    @asynccontextmanager
    async def acquire(self, *, stateless: bool = False) -> AsyncIterator[Connection]:
        """Borrow a connection. `stateless=True` promises the body leaves no session state
        (no SET, LISTEN, open cursor or session-level advisory lock): when it finishes without
        an error the pool skips its reset query on release, saving a round trip."""
        lent = False
        with translate_errors():
            try:
                async with self._pool.acquire(timeout=self._acquire_timeout_s) as conn:
                    lent = True
                    yield conn
                    self._answered_at = time.monotonic()
                    if stateless:
                        _skip_reset(conn)
            except TimeoutError as exc:
                if lent or not self._exhausted():
                    raise  # the body's, or a new connection's: the database timed out
                raise self._no_free_connection() from exc

    def answered_within(self, seconds: float) -> bool:
        """Whether a borrower's work ended without error in the last `seconds`: a pool whose
        every connection is lent is busy while they do, stuck when none has for a while."""
        return time.monotonic() - self._answered_at <= seconds

    def _exhausted(self) -> bool:
        stats = self.pool_stats()
        return stats.size >= stats.max and stats.idle == 0

    def _no_free_connection(self) -> StoreUnavailable:
        """A wait for a connection that timed out with every one lent: the database is fine,
        the pool is too small for the load or its borrowers are slow. Said so, lest the
        operator go looking for a database that is down."""
        return StoreUnavailable.with_detail(
            "the event store is busy: no database connection was free in time; retry shortly",
            f"all {self.pool_stats().max} connections of the pool stayed in use for "
            f"{self._acquire_timeout_s:g} s: look for slow statements, or raise the pool "
            "size (SVC_DB_POOL_SIZE for a gateway, SVC_ACTOR_HOST_POOL_SIZE for a Ray host; "
            "docs/operations.md, the SvcDbPoolExhausted alert)",
        )

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[Connection]:
        async with self.acquire() as conn, conn.transaction():
            yield conn

    @asynccontextmanager
    async def scoped(self, workspace_id: str, role: str = READER_ROLE) -> AsyncIterator[Connection]:
        """A transaction as the least-privilege reader, seeing one workspace's rows.

        Read-model tables carry row-level security on `current_setting('svc.workspace_id')`
        (ARCHITECTURE.md decision 6) for `READER_ROLE`, the log for `LOG_READER_ROLE`. Both
        settings are made in one statement and are transaction-local (`set_config(...,
        true)` is `SET LOCAL`; the role is the `role` setting), so a pooled connection never
        carries one request's workspace or role into the next, and the pool's reset round
        trip is skipped on release.

        The transaction is REPEATABLE READ: every statement of it sees one snapshot, so a
        page and its total, or a row and its children, agree with each other while
        projections write. For a reader that costs nothing over READ COMMITTED (no locks;
        serialization failures concern writers, and the reader role may not write).
        """
        if not workspace_id:
            raise StoreError("a scoped transaction needs a workspace id")
        async with (
            self.acquire(stateless=True) as conn,
            conn.transaction(isolation="repeatable_read"),
        ):
            await conn.execute(_SCOPE, role, workspace_id)
            yield conn

    def log_reading(self, workspace_id: str | None) -> AbstractAsyncContextManager[Connection]:
        """A connection for a read of the log. One workspace's read runs as the log reader,
        which row-level security limits to that workspace's events whatever the query says
        (`scoped`); a read of the whole log (the projections, the live tail) as the service."""
        if workspace_id is None:
            return self.acquire(stateless=True)
        return self.scoped(workspace_id, LOG_READER_ROLE)

    def pool_stats(self) -> PoolStats:
        return PoolStats(
            self._pool.get_size(), self._pool.get_idle_size(), self._pool.get_max_size()
        )
