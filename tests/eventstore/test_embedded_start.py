"""Starting the embedded PostgreSQL on a data directory a crash or root has been through."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import stat
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, cast

import asyncpg
import pytest

from eventstore import embedded
from eventstore.embedded import EmbeddedPostgres, _set_aside_interrupted_init
from eventstore.errors import StoreUnavailable
from eventstore.tasks import cancel_and_wait
from gateway import bootstrap
from gateway.settings import Settings


async def _answers(url: str) -> bool:
    conn = await asyncpg.connect(url)
    try:
        return bool(await conn.fetchval("SELECT 1"))
    finally:
        await conn.close()


async def test_a_first_start_killed_during_initdb_is_initialised_anew(tmp_path: Path) -> None:
    """initdb writes PG_VERSION first; a cluster with it but without the `postgres` database
    is one whose initdb died. It used to fail every later start for good."""
    data_dir = tmp_path / "svc"
    (data_dir / "pgdata").mkdir(parents=True)
    (data_dir / "pgdata" / "PG_VERSION").write_text("18\n")
    server = EmbeddedPostgres(data_dir)
    try:
        assert await _answers(server.start())
    finally:
        server.stop()
    aside = [p.name for p in data_dir.iterdir() if p.name.startswith("pgdata.interrupted-")]
    assert len(aside) == 1
    assert (data_dir / aside[0] / "PG_VERSION").exists()  # kept, not deleted


@pytest.mark.skipif(os.name != "posix" or os.geteuid() != 0, reason="the wheel's root path")
async def test_started_by_root_the_parents_are_traversable_but_not_listable(
    tmp_path: Path,
) -> None:
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    server = EmbeddedPostgres(private / "svc")
    try:
        assert await _answers(server.start())
    finally:
        server.stop()
    mode = stat.S_IMODE(private.stat().st_mode)
    assert mode & stat.S_IXOTH  # the server's own user must pass through
    assert not mode & (stat.S_IROTH | stat.S_IRGRP), oct(mode)


def test_a_cluster_that_has_run_is_never_set_aside(tmp_path: Path) -> None:
    """One whose `postgres` database was dropped and made again (a restore with --clean)
    has no `base/5` either; a server has run there, which initdb's never did."""
    pgdata = tmp_path / "pgdata"
    pgdata.mkdir()
    (pgdata / "PG_VERSION").write_text("18\n")
    (pgdata / "postmaster.opts").write_text("postgres -D pgdata\n")
    _set_aside_interrupted_init(pgdata)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pgdata"]


@pytest.mark.skipif(not Path("/proc/self/cwd").exists(), reason="needs Linux's /proc")
def test_a_lock_file_naming_another_clusters_postgres_is_stale(tmp_path: Path) -> None:
    """After a reboot the pid may be another PostgreSQL's (a system one, another data
    directory's): the wheel would take it for ours and stop it. A postgres is ours only
    when it works in our data directory."""
    pgdata, elsewhere = tmp_path / "pgdata", tmp_path / "other-cluster"
    pgdata.mkdir()
    elsewhere.mkdir()
    postgres = tmp_path / "postgres"  # a process the system names "postgres"
    shutil.copy(shutil.which("sleep") or "/bin/sleep", postgres)
    lock = pgdata / "postmaster.pid"
    for cwd, kept in ((elsewhere, False), (pgdata, True)):
        proc = subprocess.Popen([str(postgres), "60"], cwd=cwd)
        try:
            # Popen may return before the kernel has renamed the child after the program it
            # runs (with vfork the parent resumes mid-exec): until then it is still "python".
            comm = Path(f"/proc/{proc.pid}/comm")
            for _ in range(500):
                if comm.read_text().strip() == "postgres":
                    break
                time.sleep(0.01)
            lock.write_text(f"{proc.pid}\n{pgdata}\n")
            embedded._forget_stale_postmaster(pgdata)
            assert lock.exists() == kept, cwd
            assert proc.poll() is None  # never signalled
        finally:
            proc.kill()
            proc.wait()


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


async def test_a_stop_stops_the_server_though_a_user_of_it_was_killed(tmp_path: Path) -> None:
    """A `svc` command killed beside the server stays listed as a user: the wheel stops the
    server only for its last user, so a clean stop left PostgreSQL running."""
    server = EmbeddedPostgres(tmp_path / "svc")
    assert await _answers(server.start())
    users = server.pgdata / ".handle_pids.json"
    users.write_text(json.dumps([*json.loads(users.read_text()), _dead_pid()]))
    server.stop()
    assert not (server.pgdata / "postmaster.pid").exists()


async def test_an_unreadable_list_of_users_does_not_stop_every_start(tmp_path: Path) -> None:
    """Written in place, a full disk or a kill midway left it empty, and every start after
    failed on the wheel's JSON error."""
    server = EmbeddedPostgres(tmp_path / "svc")
    try:
        assert await _answers(server.start())
    finally:
        server.stop()
    (server.pgdata / ".handle_pids.json").write_text("")
    again = EmbeddedPostgres(tmp_path / "svc")
    try:
        assert await _answers(again.start())
    finally:
        again.stop()


async def _until_answering(url: str, bound_s: float) -> None:
    """Until the server at `url` answers, or `bound_s` (a liveness bound) has passed."""
    for _ in range(int(bound_s * 10)):
        try:
            if await _answers(url):
                return
        except (OSError, asyncpg.PostgresError):
            pass
        await asyncio.sleep(0.1)


async def test_a_server_that_died_under_the_process_is_started_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing brought it back before: every request was a 503 until the process restarted."""
    monkeypatch.setattr(bootstrap, "EMBEDDED_CHECK_S", 0.1)
    settings = Settings(environment={"SVC_DATA_DIR": str(tmp_path / "svc")})
    async with bootstrap.database_url(settings) as url:
        lock = tmp_path / "svc" / "pgdata" / "postmaster.pid"
        first = int(lock.read_text().split("\n", 1)[0])
        os.kill(first, signal.SIGKILL)
        await _until_answering(url, 60.0)
        assert await _answers(url)
        assert int(lock.read_text().split("\n", 1)[0]) != first
    assert not lock.exists()  # the server started again is the one the stop stops


async def test_a_server_told_to_stop_under_held_sessions_is_started_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """QA finding: a plain SIGTERM asks PostgreSQL for a smart shutdown, which waits for
    every session to end; the gateway's pool keeps its own open, so the server refused every
    new session (the CLI, the pool's growth) and never stopped, while the pool's sessions
    still answered. The watch makes it a fast stop, then starts it again."""
    monkeypatch.setattr(bootstrap, "EMBEDDED_CHECK_S", 0.1)
    settings = Settings(environment={"SVC_DATA_DIR": str(tmp_path / "svc")})
    async with bootstrap.database_url(settings) as url:
        held = await asyncpg.connect(url)  # as a pool's session
        lock = tmp_path / "svc" / "pgdata" / "postmaster.pid"
        first = int(lock.read_text().split("\n", 1)[0])
        os.kill(first, signal.SIGTERM)
        try:
            await _until_answering(url, 30.0)
            assert int(lock.read_text().split("\n", 1)[0]) != first
            assert await _answers(url)
        finally:
            held.terminate()


def test_a_server_still_recovering_is_waited_for(tmp_path: Path) -> None:
    """The wheel gives a start 10 s; crash recovery on a slow disk takes longer, and the
    start failed with a message about an unreadable lock file, the server recovering on."""
    lock = tmp_path / "postmaster.pid"

    def write(status: str, pid: int = os.getpid()) -> None:
        lines = [str(pid), str(tmp_path), str(int(time.time())), "", str(tmp_path), "", "0 0"]
        lock.write_text("\n".join([*lines, status]) + "\n")

    lock.write_text(f"{os.getpid()}\n")  # cut short as it is written: looked at again
    ready = threading.Timer(0.5, write, args=("ready",))
    ready.start()
    try:
        assert embedded.wait_for_recovery(tmp_path, 30.0)
    finally:
        ready.cancel()
    write("starting", _dead_pid())  # no server at all: nothing to wait for
    assert not embedded.wait_for_recovery(tmp_path, 30.0)
    write("starting")
    assert not embedded.wait_for_recovery(tmp_path, 0.3)  # still starting at the bound
    # Shutting down is no start to wait for (a CLI waited 600 s, calling it a recovery).
    write("stopping")
    with pytest.raises(StoreUnavailable, match="is shutting down"):
        embedded.wait_for_recovery(tmp_path, 30.0)


async def test_a_process_missing_from_the_list_of_users_is_put_back(tmp_path: Path) -> None:
    """The list started afresh (cut short on disk) no longer names the server: the next
    other `svc` to exit would take itself for the last user and stop the database under it."""
    server = EmbeddedPostgres(tmp_path / "svc")
    users = server.pgdata / ".handle_pids.json"
    try:
        assert await _answers(server.start())
        users.write_text("[]")
        server.stay_listed()
        assert os.getpid() in json.loads(users.read_text())
    finally:
        server.stop()
    # One that runs after the stop (a thread the stop did not wait for) lists nobody again:
    # the server would outlive its last user.
    server.stay_listed()
    assert not users.exists() or os.getpid() not in json.loads(users.read_text())


class _FlakyServer:
    """An embedded server whose first look fails (its lock's directory gone), then dead."""

    pgdata = Path("/nowhere")

    def __init__(self) -> None:
        self.looks = 0
        self.revived = asyncio.Event()

    def running(self) -> bool:
        self.looks += 1
        if self.looks == 1:
            raise PermissionError("the lock file's directory is gone")
        return self.revived.is_set()

    def revive(self) -> None:
        self.revived.set()

    def stay_listed(self) -> None:
        pass


async def test_a_watch_that_fails_once_goes_on_watching(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any error ended the watch for good: the database died later, and stayed dead."""
    monkeypatch.setattr(bootstrap, "EMBEDDED_CHECK_S", 0.01)
    server = _FlakyServer()
    watch = asyncio.create_task(bootstrap._keep_running(cast(Any, server)))
    try:
        async with asyncio.timeout(10):  # liveness bound
            await server.revived.wait()
    finally:
        await cancel_and_wait(watch)
    assert server.looks >= 2


async def test_a_revive_that_outlasted_the_wheels_wait_follows_the_new_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review finding: when the wheel gave up on a restart still recovering, revive waited
    for the server and returned, but the handle still named the dead postmaster: the watch
    took the live server for dead, and a stop skipped it."""
    server = EmbeddedPostgres(tmp_path / "svc")
    try:
        assert await _answers(server.start())
        lock = server.pgdata / "postmaster.pid"
        os.kill(int(lock.read_text().split("\n", 1)[0]), signal.SIGKILL)
        for _ in range(100):  # liveness bound: 10 s
            if not server.running():
                break
            await asyncio.sleep(0.1)
        assert not server.running()
        wheel = server._server
        real = wheel.ensure_postgres_running
        tries: list[int] = []

        def gives_up_once_started() -> None:
            """The first try starts the server but gives up before noting it (pg_ctl's
            wait ran out while the server recovered)."""
            tries.append(1)
            noted = wheel._postmaster_info
            real()
            if len(tries) == 1:
                wheel._postmaster_info = noted
                raise subprocess.TimeoutExpired("pg_ctl", 10)

        monkeypatch.setattr(wheel, "ensure_postgres_running", gives_up_once_started)
        await asyncio.to_thread(server.revive)
        assert server.running()
    finally:
        server.stop()
    assert not (server.pgdata / "postmaster.pid").exists()


def test_a_server_gone_again_after_its_recovery_is_told_as_unavailable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The look at the server after its recovery may fail too (it went away again): told
    as the failed start it is, not the wheel's raw exception."""

    class GivesUp:
        def ensure_postgres_running(self) -> None:
            raise subprocess.TimeoutExpired("pg_ctl", 10)

    server = EmbeddedPostgres(tmp_path / "svc")
    server.pgdata.mkdir(parents=True)
    server._server = GivesUp()
    monkeypatch.setattr(embedded, "wait_for_recovery", lambda pgdata, wait_s: True)
    with pytest.raises(StoreUnavailable, match="could not start the embedded PostgreSQL"):
        server.revive()


def test_a_list_of_users_holding_what_is_no_pid_is_cleaned_not_a_crash(tmp_path: Path) -> None:
    """Review finding: entries JSON holds but a set or a sort cannot (a dict, a string beside
    a number) stopped every start with a raw TypeError; they are dropped like dead pids."""
    users = tmp_path / ".handle_pids.json"
    for entries in ([99_999_999, "x", 4.5], [{"pid": 1}, os.getpid()]):
        users.write_text(json.dumps(entries))
        embedded._forget_dead_users(users)
        assert json.loads(users.read_text()) == [p for p in entries if p == os.getpid()]
