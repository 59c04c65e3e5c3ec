"""The feeds read by a real SSE client library: the npm `eventsource` package under node
(QA found that it ignores a frame without data, so the feed's first frame must carry its
cursor as data for the package to resume from it).

The package is installed once per machine with npm into a cache directory; without node or
npm (or the registry) the test skips, except under CI, where a skip would pass for a test
that never ran."""

from __future__ import annotations

import asyncio
import fcntl
import os
import shutil
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from test_admin_support import Service, service, uid

EVENTSOURCE = "eventsource@3.0.7"  # node 18 and later (Debian 12 ships 18)
HARNESS = Path(__file__).with_name("eventsource_harness.mjs")
EVENTS = "/v1/events/stream"

__all__ = ["service"]


def _unavailable(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"{reason}: CI must run the SSE client tests")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def eventsource_dir() -> Iterator[Path]:
    """A directory holding the harness beside its own node_modules/eventsource."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        _unavailable("node or npm is not installed")
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    root = cache / "svc-tests" / EVENTSOURCE.replace("@", "-")
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:  # test workers install it once between them
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / "node_modules" / "eventsource" / "package.json").exists():
            done = _npm_install(root)
            if done is not None:
                _unavailable(f"npm could not install {EVENTSOURCE}: {done}")
    shutil.copy(HARNESS, root / HARNESS.name)
    yield root


def _npm_install(root: Path) -> str | None:
    try:
        subprocess.run(
            ["npm", "install", "--prefix", str(root), "--no-audit", "--no-fund", EVENTSOURCE],
            check=True,
            capture_output=True,
            timeout=180,
        )
    except (subprocess.SubprocessError, OSError) as exc:
        return str(exc)
    return None


@pytest.fixture
async def consumer(
    eventsource_dir: Path, service: Service
) -> AsyncIterator[tuple[asyncio.subprocess.Process, str]]:
    """A node consumer of a `start=latest` feed of one rare type, and its workspace."""
    ws = uid("ws-")
    key = await service.issue_key(ws)
    await service.append_pings(ws, 3)
    url = service.url(EVENTS) + "?start=latest&types=test.rare"
    process = await asyncio.create_subprocess_exec(
        "node",
        str(eventsource_dir / HARNESS.name),
        url,
        key,
        "test.rare",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        yield process, ws
    finally:
        if process.returncode is None:
            process.kill()
        await process.wait()


async def _lines(process: asyncio.subprocess.Process, *kinds: str) -> dict[str, dict[str, Any]]:
    """The consumer's next line of each of `kinds`, in whatever order they come (the cut
    and the dispatch of the frame it follows race in node); other lines are passed over."""
    assert process.stdout is not None and process.stderr is not None
    found: dict[str, dict[str, Any]] = {}
    while len(found) < len(kinds):
        raw = await process.stdout.readline()
        if not raw:
            raise AssertionError(f"node ended before {kinds}: {await process.stderr.read()!r}")
        line: dict[str, Any] = orjson.loads(raw)
        if line["kind"] in kinds and line["kind"] not in found:
            found[line["kind"]] = line
    return found


async def test_the_npm_eventsource_resumes_a_latest_feed_from_its_first_frame(
    service: Service, consumer: tuple[asyncio.subprocess.Process, str]
) -> None:
    """Its connection dropped before the first event the feed selects, the package
    reconnects (after the feed's `retry: 3000`) with the first frame's cursor, and gets the
    event committed while it was away; with a bare `id:` it sent none, and a `start=latest`
    feed started again at the new head, past that event."""
    process, ws = consumer
    async with asyncio.timeout(30):
        first = await _lines(process, "connect", "cursor", "cut")
        missed = await service.append_pings(ws, 1, kind="test.rare")
        await service.append_pings(ws, 2)
        later = await _lines(process, "connect", "event")
    assert first["connect"]["lastEventId"] is None
    assert later["connect"]["lastEventId"] == first["cursor"]["id"]
    assert later["event"]["id"] == missed
