"""Feed fan-out: N SSE subscribers on one gateway while events are appended at a steady rate.

Prints commit-to-client latency percentiles over every (event, subscriber) delivery. The
commit point is when `append` returns (the store has committed and woken the tailer); the
client point is when the subscriber has read the frame carrying that event's cursor. Server,
appender and all subscribers share one process and one event loop on loopback, so the figure
includes the clients' own parsing; the target is p99 < 100 ms.

    .venv/bin/python bench/feeds_fanout.py --quick
    .venv/bin/python bench/feeds_fanout.py --subscribers 1000 --rate 500 --seconds 20

Durable commits (fsync, synchronous_commit on: the defaults). With no --database-url an
embedded PostgreSQL is started in a temporary directory.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import aiohttp
from aiohttp import web

from actors.workspace import workspace_key
from eventstore.embedded import EmbeddedPostgres
from eventstore.records import NewEvent
from gateway.app import create_app
from gateway.auth import generate_key, hash_key
from gateway.bootstrap import ensure_workspace
from gateway.settings import Settings
from gateway.state import PROJECTIONS, RUNTIME, STORE, TAILER
from schemas.workspace import IssueApiKey

WORKSPACE = "bench"


@dataclass
class Tally:
    committed: dict[str, float] = field(default_factory=dict)
    """Cursor -> when its append returned (the commit is acknowledged)."""
    deliveries: list[tuple[str, float]] = field(default_factory=list)
    """(cursor, when a subscriber read it), matched with `committed` at the end: under load
    the tailer may fan an event out before its appender resumes after the commit."""
    cut_off: int = 0
    errors: int = 0
    expected: int | None = None
    all_received: asyncio.Event = field(default_factory=asyncio.Event)

    def got(self, cursor: str, at: float) -> None:
        self.deliveries.append((cursor, at))
        if self.expected is not None and len(self.deliveries) >= self.expected:
            self.all_received.set()

    def latencies_ms(self) -> list[float]:
        """Commit-to-client; a frame read before its append returned counts as 0."""
        out = []
        for cursor, at in self.deliveries:
            sent = self.committed.get(cursor)
            if sent is not None:
                out.append(max(0.0, (at - sent) * 1000))
        return out


@contextlib.asynccontextmanager
async def database(url: str | None) -> AsyncIterator[str]:
    if url:
        yield url
        return
    with tempfile.TemporaryDirectory(prefix="svc-bench-") as tmp:
        await asyncio.to_thread(Path(tmp).chmod, 0o755)
        server = EmbeddedPostgres(Path(tmp))
        try:
            yield await asyncio.to_thread(server.start)
        finally:
            await asyncio.to_thread(server.stop)


async def issue_key(app: web.Application) -> str:
    runtime = app[RUNTIME]
    await ensure_workspace(runtime, WORKSPACE)
    key = generate_key()
    outcome = await runtime.ask(
        workspace_key(WORKSPACE),
        IssueApiKey(
            command_id=uuid.uuid4().hex,
            workspace_id=WORKSPACE,
            key_id="key_bench",
            name="bench",
            key_hash=hash_key(key),
            prefix=key[:8],
            scopes=("*",),
            at=datetime.now(UTC),
        ),
    )
    await app[PROJECTIONS].wait_for(outcome.cursor, 10.0)
    return key


async def subscriber(
    http: aiohttp.ClientSession, url: str, key: str, tally: Tally, ready: asyncio.Event
) -> None:
    headers = {"Authorization": f"Bearer {key}"}
    try:
        async with http.get(url, headers=headers, params={"start": "latest"}) as resp:
            resp.raise_for_status()
            ready.set()
            buffer = b""
            async for chunk in resp.content.iter_any():
                now = time.perf_counter()
                buffer += chunk
                *frames, buffer = buffer.split(b"\n\n")
                for frame in frames:
                    if frame.startswith(b"id: "):
                        cursor = frame[4 : frame.index(b"\n")].decode()
                        if b"\nevent: error\n" in frame:
                            tally.cut_off += 1
                            return
                        tally.got(cursor, now)
    except (aiohttp.ClientError, ConnectionError):
        tally.errors += 1
        ready.set()


async def append_one(app: web.Application, n: int, tally: Tally) -> None:
    # One stream per event: concurrent appends never contend on a stream version.
    result = await app[STORE].append(
        f"bench:{uuid.uuid4().hex}",
        [NewEvent("bench.tick", {"n": n})],
        expected_version=0,
        command_id=uuid.uuid4().hex,
        workspace_id=WORKSPACE,
    )
    tally.committed[result.cursor] = time.perf_counter()


async def append_at_rate(app: web.Application, rate: float, seconds: float, tally: Tally) -> int:
    """Open loop: one append is started every 1/rate s whether or not earlier ones finished,
    the way independent writers would commit."""
    interval = 1.0 / rate
    start = time.perf_counter()
    pending: set[asyncio.Task[None]] = set()
    sent = 0
    while time.perf_counter() - start < seconds:
        task = asyncio.create_task(append_one(app, sent, tally))
        pending.add(task)
        task.add_done_callback(pending.discard)
        sent += 1
        delay = start + sent * interval - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
    await asyncio.gather(*pending)
    return sent


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return statistics.quantiles(values, n=1000, method="inclusive")[int(q * 10) - 1]


async def run(args: argparse.Namespace) -> None:
    async with database(args.database_url) as url, contextlib.AsyncExitStack() as stack:
        data_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="svc-bench-data-"))
        settings = Settings({"SVC_DATABASE_URL": url, "SVC_DATA_DIR": data_dir})
        app = create_app(settings)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=5.0)
        await runner.setup()
        stack.push_async_callback(runner.cleanup)
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        feed_url = f"http://127.0.0.1:{port}/v1/events/stream"
        key = await issue_key(app)

        tally = Tally()
        connector = aiohttp.TCPConnector(limit=0)
        http = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout())
        stack.push_async_callback(http.close)
        readies = [asyncio.Event() for _ in range(args.subscribers)]
        tasks = [
            asyncio.create_task(subscriber(http, feed_url, key, tally, ready)) for ready in readies
        ]
        for ready in readies:
            await ready.wait()
        print(
            f"{args.subscribers} subscribers connected; appending {args.rate}/s "
            f"for {args.seconds} s"
        )
        began = time.perf_counter()
        sent = await append_at_rate(app, args.rate, args.seconds, tally)
        took = time.perf_counter() - began
        expected = tally.expected = sent * args.subscribers
        if len(tally.deliveries) < expected:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(tally.all_received.wait(), args.drain)
        at_head = app[TAILER].live_cursor == await app[STORE].head()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

        lat = tally.latencies_ms()
        print(f"appended {sent} events in {took:.1f} s ({sent / took:.0f}/s)")
        print(
            f"deliveries {len(lat)}/{expected} "
            f"({100.0 * len(lat) / max(expected, 1):.1f} %), "
            f"cut off {tally.cut_off}, connection errors {tally.errors}, "
            f"tailer at the log head: {'yes' if at_head else 'no'}"
        )
        if lat:
            print(
                f"commit-to-client ms: p50 {percentile(lat, 50):.1f}  "
                f"p90 {percentile(lat, 90):.1f}  p99 {percentile(lat, 99):.1f}  "
                f"max {max(lat):.1f}  (target p99 < 100)"
            )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--subscribers", type=int, default=1000)
    parser.add_argument("--rate", type=float, default=500.0, help="events appended per second")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument(
        "--drain", type=float, default=10.0, help="at most this many seconds for the last frames"
    )
    parser.add_argument("--database-url", default=None)
    parser.add_argument("--quick", action="store_true", help="50 subscribers, 200/s, 5 s")
    args = parser.parse_args(argv)
    if args.quick:
        args.subscribers, args.rate, args.seconds = 50, 200.0, 5.0
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
