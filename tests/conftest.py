"""Shared fixtures: one real PostgreSQL per test session, a fresh database per test.

The server is the embedded one (started in a temporary directory) unless
SVC_TEST_DATABASE_URL points at an external server, whose user may create databases.
"""

from __future__ import annotations

import asyncio
import gc
import os
import threading
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Iterator
from types import AsyncGeneratorType, CoroutineType, FrameType
from typing import Any, Protocol
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

from eventstore import STORE_MIGRATIONS, Database, apply_migrations
from eventstore.embedded import temporary_server

_WAITING = pytest.StashKey[str]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    """Shortly before pytest-timeout fails a test, note where its coroutines wait: the
    plugin's own dump shows only thread stacks, where the event loop sits in select()."""
    marker = item.get_closest_marker("timeout")
    configured = item.config.getoption("timeout", None) or item.config.getini("timeout")
    timeout_s = float(marker.args[0] if marker and marker.args else configured or 0)
    if timeout_s <= 0:  # no timeout: nothing to explain
        yield
        return
    watchdog = threading.Timer(
        max(timeout_s - 10.0, timeout_s * 0.9),
        lambda: item.stash.setdefault(_WAITING, _waiting_coroutines()),
    )
    watchdog.daemon = True
    watchdog.start()
    try:
        yield
    finally:
        watchdog.cancel()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item) -> Generator[None, Any, None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if report.failed and _WAITING in item.stash:
        report.sections.append(
            ("coroutines waiting shortly before the timeout", item.stash[_WAITING])
        )


def _waiting_coroutines() -> str:
    """Where this tree's suspended coroutines and async generators wait. Read from the
    watchdog's thread while the loop's thread sits in select(): good enough for a diagnosis.
    (A task's own stack would stop at the first await of an async generator's step.)"""
    lines = []
    for obj in gc.get_objects():
        frame: FrameType | None = None
        if isinstance(obj, CoroutineType) and obj.cr_await is not None:
            frame = obj.cr_frame
        elif isinstance(obj, AsyncGeneratorType) and obj.ag_await is not None:
            frame = obj.ag_frame
        if frame is not None and frame.f_code.co_filename.startswith(_ROOT):
            where = f"{frame.f_code.co_filename[len(_ROOT) :]}:{frame.f_lineno}"
            lines.append(f"  {where} in {frame.f_code.co_qualname}")
    return "\n".join(sorted(lines))


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _with_database(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path="/" + name))


@pytest.fixture(scope="session")
def pg_server_url() -> Iterator[str]:
    external = os.environ.get("SVC_TEST_DATABASE_URL")
    if external:
        yield external
        return
    with temporary_server("svc-test-pg-") as url:
        yield url


@pytest.fixture
async def database_url(pg_server_url: str) -> AsyncIterator[str]:
    """A fresh, empty database for one test, dropped afterwards."""
    name = "t_" + uuid.uuid4().hex[:16]
    admin = await asyncpg.connect(pg_server_url)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    yield _with_database(pg_server_url, name)
    await drop_database(pg_server_url, name)


async def drop_database(pg_server_url: str, name: str, tries: int = 20) -> None:
    """Drops `name`, ending its sessions. An external server's user that is neither a
    superuser nor in `pg_signal_backend` may not end an autovacuum worker's session (QA: one
    run in three on PostgreSQL 15), which ends by itself within moments: tried again."""
    admin = await asyncpg.connect(pg_server_url)
    try:
        for attempt in range(tries):
            try:
                await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
                return
            except asyncpg.InsufficientPrivilegeError:
                if attempt == tries - 1:
                    raise
                await asyncio.sleep(0.25)
    finally:
        await admin.close()


class WokenLoop(Protocol):
    """A background loop that waits for wake-ups and is stopped by cancellation."""

    async def start(self) -> None: ...
    def wake(self) -> None: ...
    async def stop(self) -> None: ...


StopCheck = Callable[[Callable[[], WokenLoop]], Awaitable[None]]


@pytest.fixture
def stops_wherever_cancelled() -> StopCheck:
    """Start a fresh loop from `make`, wake it, and stop it N event-loop steps into that
    wake-up, for each N in turn: the stop must end the loop wherever its cancellation lands.
    (Python 3.11's `asyncio.wait_for` dropped one that landed as the wake-up finished, and
    the stop then waited forever: see eventstore/tasks.py.)"""

    async def check(make: Callable[[], WokenLoop]) -> None:
        for steps in range(8):
            woken = make()
            await woken.start()
            await asyncio.sleep(0.05)  # into its wait for a wake-up
            woken.wake()
            for _ in range(steps):
                await asyncio.sleep(0)
            async with asyncio.timeout(30.0):  # a bound on a hang, not a measurement
                await woken.stop()

    return check


@pytest.fixture
async def store_db(database_url: str) -> AsyncIterator[Database]:
    """A pool on the test's fresh database, with the event store's migrations applied."""
    db = await Database.connect(database_url, max_size=10)
    try:
        await apply_migrations(db, [STORE_MIGRATIONS])
        yield db
    finally:
        await db.close()
