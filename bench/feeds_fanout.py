"""Feed fan-out: N SSE subscribers on one gateway process while events are appended at a rate.

Three kinds of process, so that the figure is the gateway's and not the load generator's:

- the gateway (`--role gateway`): the service as it runs, serving `GET /v1/events/stream`;
- subscriber processes (`--role clients`, `--client-processes` of them): raw asyncio
  connections that only find each frame's `id:` and note when it arrived;
- this process: starts the others, appends `--rate` events/s for `--seconds` (open loop, one
  durable commit each, through its own store connection pool), then collects the results.

Commit-to-client latency is measured over every (event, subscriber) delivery, from when the
event's `append` returned to when a subscriber process read the frame carrying its cursor
(`time.perf_counter` is CLOCK_MONOTONIC, one clock for every process of the machine); also
the part of it until the gateway's tailer read the event. Each subscriber must receive every
event exactly once, in log order: its frame count equals the events appended and the CRC32 of
its cursors in arrival order equals that of the appended cursors in log order. Gateway CPU is
read from /proc over the append window; RSS after the run.

    .venv/bin/python bench/feeds_fanout.py --quick
    .venv/bin/python bench/feeds_fanout.py --subscribers 1000 --rate 500 --seconds 20

Durable commits (fsync, synchronous_commit on: the defaults). With no --database-url an
embedded PostgreSQL is started in a temporary directory.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import pickle
import re
import resource
import signal
import statistics
import sys
import tempfile
import time
import uuid
import zlib
from array import array
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from aiohttp import web

from actors.workspace import workspace_key
from eventstore import open_store
from eventstore.cursor import decode_cursor
from eventstore.embedded import temporary_server
from eventstore.records import NewEvent, RecordedEvent
from eventstore.store import PostgresEventStore
from eventstore.tailer import LogTailer
from gateway.app import create_app
from gateway.auth import generate_key, hash_key
from gateway.bootstrap import ensure_workspace, load_cursor_seal
from gateway.heap import settle_after_startup
from gateway.settings import Settings
from gateway.state import PROJECTIONS, RUNTIME, TAILER
from schemas.workspace import IssueApiKey

WORKSPACE = "bench"
FEED_PATH = "/v1/events/stream"
CONNECT_CONCURRENCY = 50
BIN_S = 0.0001  # latency histogram resolution: 0.1 ms
CLK_TCK = os.sysconf("SC_CLK_TCK")


def raise_fd_limit() -> None:
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


# -- gateway process --------------------------------------------------------------------------


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


async def serve_gateway(database_url: str, out: Path) -> None:
    """Run the service until stdin closes; first print its port and an API key as JSON. For
    the latency breakdown, note when the tailer read each event and write it to `out`."""
    tailer_read: list[tuple[str, float]] = []

    def note(batch: Sequence[RecordedEvent]) -> None:
        now = time.perf_counter()
        tailer_read.extend((event.cursor, now) for event in batch)

    with tempfile.TemporaryDirectory(prefix="svc-bench-data-") as data_dir:
        # Every subscriber opens its feed with the one key: no bound on an owner's feeds.
        settings = Settings(
            {
                "SVC_DATABASE_URL": database_url,
                "SVC_DATA_DIR": data_dir,
                "SVC_FEEDS_PER_OWNER": "0",
            }
        )
        app = create_app(settings)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=5.0)
        await runner.setup()
        try:
            site = web.TCPSite(runner, "127.0.0.1", 0, backlog=1024)
            await site.start()
            port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            settle_after_startup()  # as `svc serve` does (gateway/heap.py)
            key = await issue_key(app)
            tailer = app[TAILER]
            assert isinstance(tailer, LogTailer)
            tailer.add_batch_listener(note)
            print(json.dumps({"port": port, "key": key}), flush=True)
            await asyncio.to_thread(sys.stdin.read)
            await asyncio.to_thread(out.write_bytes, pickle.dumps(dict(tailer_read)))
        finally:
            await runner.cleanup()


# -- subscriber processes ---------------------------------------------------------------------

# A frame as gateway/sse.py encodes it starts `id: <cursor>\nevent: <type>\n`; the closing
# frames (`event: feed_error` / `event: shutdown`) carry the cursor to resume from, not an
# event, and so does the first (`retry: 3000\nid: <the start>\nevent: cursor`).
# Literal-prefixed patterns: the regex engine skips to each "\nid: " at C speed.
_ID_LINE = re.compile(rb"\nid: ([^\n]+)\nevent: (?!cursor\n)")
_CLOSING = re.compile(rb"\nid: [^\n]*\nevent: (feed_error|shutdown)\n")
_CLOSING_MARKS = (b"\nevent: feed_error\n", b"\nevent: shutdown\n")


class FeedClient(asyncio.Protocol):
    """One SSE subscriber on a raw connection: an HTTP/1.1 request, then frames.

    Kept cheap per frame so that the subscriber processes are not what saturates: per read
    it notes the time and how many event frames completed, and folds their cursors, in order,
    into a running CRC32. Events arrive in log order, so the k-th frame is the k-th appended
    event; equal count and CRC with the appended sequence mean every event exactly once."""

    def __init__(self, request: bytes, connected: asyncio.Event) -> None:
        self.request = request
        self.connected = connected
        self.tail = b""
        self.count = 0
        self.crc = 0
        self.read_at = array("d")
        self.frames_read = array("q")
        self.status_ok: bool | None = None
        self.closing_event: str | None = None
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        if self.status_ok is None:
            self.status_ok = data.startswith(b"HTTP/1.1 200")
        buf = self.tail + data if self.tail else data
        end = buf.rfind(b"\n\n") + 2
        if end < 2:
            self.tail = buf
            return
        self.tail = buf[end:]
        if not self.connected.is_set() and b"\nretry: " in buf:
            self.connected.set()
        ids = _ID_LINE.findall(buf, 0, end)
        if _CLOSING_MARKS[0] in buf or _CLOSING_MARKS[1] in buf:
            closing = _CLOSING.search(buf, 0, end)
            if closing is not None:
                self.closing_event = closing.group(1).decode()
                ids = _ID_LINE.findall(buf, 0, closing.start())
        if ids:
            self.count += len(ids)
            self.crc = zlib.crc32(b"".join(ids), self.crc)
            self.read_at.append(now)
            self.frames_read.append(len(ids))

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.connected.set()


async def open_clients(
    port: int, key: str, count: int
) -> tuple[list[FeedClient], list[asyncio.Transport]]:
    request = (
        f"GET {FEED_PATH}?start=latest HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Authorization: Bearer {key}\r\nAccept: text/event-stream\r\n\r\n"
    ).encode()
    loop = asyncio.get_running_loop()
    gate = asyncio.Semaphore(CONNECT_CONCURRENCY)

    async def connect() -> tuple[FeedClient, asyncio.Transport]:
        async with gate:
            connected = asyncio.Event()
            transport, client = await loop.create_connection(
                lambda: FeedClient(request, connected), "127.0.0.1", port
            )
            await asyncio.wait_for(connected.wait(), 30.0)
            return client, transport

    pairs = await asyncio.gather(*(connect() for _ in range(count)))
    return [client for client, _ in pairs], [transport for _, transport in pairs]


async def wait_for_count(clients: list[FeedClient], expected: int, timeout_s: float) -> None:
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        if all(c.count >= expected or c.lost or c.closing_event for c in clients):
            return
        await asyncio.sleep(0.05)


async def run_clients(port: int, key: str, count: int, out: Path) -> None:
    """Connect, say `connected`, then on `expect <n> <timeout>` wait and dump the results."""
    clients, transports = await open_clients(port, key, count)
    bad = sum(1 for c in clients if not c.status_ok or c.lost)
    print(f"connected {bad}", flush=True)
    command = await asyncio.to_thread(sys.stdin.readline)
    _, expected, timeout_s = command.split()
    await wait_for_count(clients, int(expected), float(timeout_s))
    usage = resource.getrusage(resource.RUSAGE_SELF)
    result = {
        "subscribers": [
            (c.count, c.crc, c.read_at.tobytes(), c.frames_read.tobytes()) for c in clients
        ],
        "closing": [c.closing_event for c in clients if c.closing_event],
        "lost": sum(1 for c in clients if c.lost),
        "cpu_s": usage.ru_utime + usage.ru_stime,
    }
    for transport in transports:
        transport.close()
    await asyncio.to_thread(out.write_bytes, pickle.dumps(result))
    print("done", flush=True)


# -- this process: orchestration and appends --------------------------------------------------


@dataclass
class Commits:
    at: dict[str, float] = field(default_factory=dict)
    """Cursor -> when its append returned (the commit is acknowledged)."""


async def append_one(store: PostgresEventStore, n: int, commits: Commits) -> None:
    # One stream per event: concurrent appends never contend on a stream version.
    result = await store.append(
        f"bench:{uuid.uuid4().hex}",
        [NewEvent("bench.tick", {"n": n})],
        expected_version=0,
        command_id=uuid.uuid4().hex,
        workspace_id=WORKSPACE,
    )
    commits.at[result.cursor] = time.perf_counter()


async def append_at_rate(
    store: PostgresEventStore, rate: float, seconds: float, commits: Commits
) -> int:
    """Open loop: one append is started every 1/rate s whether or not earlier ones finished,
    the way independent writers would commit."""
    interval = 1.0 / rate
    start = time.perf_counter()
    pending: set[asyncio.Task[None]] = set()
    sent = 0
    while time.perf_counter() - start < seconds:
        task = asyncio.create_task(append_one(store, sent, commits))
        pending.add(task)
        task.add_done_callback(pending.discard)
        sent += 1
        delay = start + sent * interval - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
    await asyncio.gather(*pending)
    return sent


@contextlib.asynccontextmanager
async def database(url: str | None) -> AsyncIterator[str]:
    if url:
        yield url
        return
    # Started and stopped in a thread: the event loop keeps serving meanwhile.
    stack = contextlib.ExitStack()
    try:
        yield await asyncio.to_thread(stack.enter_context, temporary_server("svc-bench-"))
    finally:
        await asyncio.to_thread(stack.close)


async def spawn(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        __file__,
        *args,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )


async def read_line(proc: asyncio.subprocess.Process, timeout_s: float) -> str:
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), timeout_s)
    if not line:
        raise RuntimeError(f"bench process {proc.pid} exited (code {await proc.wait()})")
    return line.decode().strip()


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def memory_mb(pid: int) -> dict[str, float]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            out[name] = int(value.split()[0]) / 1024
    return out


@dataclass
class Outcome:
    sent: int
    took_s: float
    gateway_cpu_s: float
    gateway_memory: dict[str, float]
    appender_cpu_s: float
    commits: dict[str, float]
    sealed: dict[str, str]
    """Each appended event's cursor as its feed frames carry it."""
    results: list[dict[str, Any]]


async def run(args: argparse.Namespace) -> None:
    # SIGTERM (e.g. from `timeout`) cancels the run, so the embedded server and the other
    # processes are still stopped on the way out.
    main_task = asyncio.current_task()
    assert main_task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, main_task.cancel)
    with tempfile.TemporaryDirectory(prefix="svc-bench-out-") as tmp:
        tailer_out = Path(tmp) / "tailer.pickle"
        async with database(args.database_url) as url:
            gateway = await spawn(
                "--role", "gateway", "--database-url", url, "--out", str(tailer_out)
            )  # fmt: skip
            try:
                hello = json.loads(await read_line(gateway, 120.0))
                outcome = await drive(args, url, gateway.pid, hello["port"], hello["key"])
            finally:
                assert gateway.stdin is not None
                gateway.stdin.close()
                try:
                    await asyncio.wait_for(gateway.wait(), 30.0)
                except TimeoutError:
                    gateway.kill()
                    await gateway.wait()
        tailer_read = pickle.loads(await asyncio.to_thread(tailer_out.read_bytes))
    report(args, outcome, tailer_read)


async def drive(
    args: argparse.Namespace, url: str, gateway_pid: int, port: int, key: str
) -> Outcome:
    with tempfile.TemporaryDirectory(prefix="svc-bench-out-") as tmp:
        shares = split(args.subscribers, args.client_processes)
        outs = [Path(tmp) / f"clients-{i}.pickle" for i in range(len(shares))]
        clients: list[asyncio.subprocess.Process] = []
        try:
            for n, out in zip(shares, outs, strict=True):
                clients.append(
                    await spawn("--role", "clients", "--port", str(port), "--key", key,
                                "--subscribers", str(n), "--out", str(out))
                )  # fmt: skip
            outcome = await measure(args, url, gateway_pid, clients)
        finally:
            for proc in clients:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
        outcome.results = [pickle.loads(await asyncio.to_thread(out.read_bytes)) for out in outs]
    return outcome


async def measure(
    args: argparse.Namespace, url: str, gateway_pid: int, clients: list[asyncio.subprocess.Process]
) -> Outcome:
    """Wait for every subscriber, append for the run, then let the subscribers drain."""
    bad = sum([int((await read_line(c, 300.0)).split()[1]) for c in clients])
    print(f"[{time.strftime('%H:%M:%S')}] {args.subscribers} subscribers connected ({bad} "
          f"failed) in {len(clients)} client processes; appending {args.rate}/s for "
          f"{args.seconds} s", flush=True)  # fmt: skip
    store = await open_store(url, max_size=args.pool)
    commits = Commits()
    try:
        cpu0, own0, began = cpu_seconds(gateway_pid), time.process_time(), time.perf_counter()
        sent = await append_at_rate(store, args.rate, args.seconds, commits)
        took = time.perf_counter() - began
        gateway_cpu, own_cpu = cpu_seconds(gateway_pid) - cpu0, time.process_time() - own0
        seal = await load_cursor_seal(store.db)  # the key the gateway made on its start
    finally:
        await store.close()
    sealed = {cursor: seal.seal(cursor) for cursor in commits.at}
    print(f"[{time.strftime('%H:%M:%S')}] appends done; waiting for the subscribers", flush=True)
    for proc in clients:
        assert proc.stdin is not None
        proc.stdin.write(f"expect {sent} {args.drain}\n".encode())
        await proc.stdin.drain()
    for proc in clients:
        await read_line(proc, args.drain + 120.0)
        await proc.wait()
    return Outcome(sent, took, gateway_cpu, memory_mb(gateway_pid), own_cpu, commits.at, sealed, [])


def split(total: int, parts: int) -> list[int]:
    parts = max(1, min(parts, total))
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def histogram(
    commits: dict[str, float],
    sealed: dict[str, str],
    subscribers: list[tuple[int, int, bytes, bytes]],
) -> tuple[list[int], int]:
    """Latency counts per BIN_S bucket over every delivery to the subscribers that got every
    event exactly once (the others are reported, not timed), and how many those were. A frame
    read before its append returned (the tailer may fan it out first) counts as 0."""
    in_log_order = sorted(commits, key=decode_cursor)
    sent_at = [commits[cursor] for cursor in in_log_order]
    expected_crc = zlib.crc32("".join(sealed[cursor] for cursor in in_log_order).encode())
    bins = [0] * int(60.0 / BIN_S)
    last = len(bins) - 1
    exact = 0
    for count, crc, raw_times, raw_counts in subscribers:
        if count != len(sent_at) or crc != expected_crc:
            continue
        exact += 1
        read_at, frames_read = array("d"), array("q")
        read_at.frombytes(raw_times)
        frames_read.frombytes(raw_counts)
        k = 0
        for at, n in zip(read_at, frames_read, strict=True):
            for sent in sent_at[k : k + n]:
                bins[min(last, max(0, int((at - sent) / BIN_S)))] += 1
            k += n
    return bins, exact


def percentile_ms(bins: list[int], q: float) -> float:
    total = sum(bins)
    rank, seen = q / 100.0 * total, 0
    for i, n in enumerate(bins):
        seen += n
        if n and seen >= rank:
            return (i + 0.5) * BIN_S * 1000
    return float("nan")


def report(args: argparse.Namespace, outcome: Outcome, tailer_read: dict[str, float]) -> None:
    commits, results = outcome.commits, outcome.results
    subscribers = [sub for r in results for sub in r["subscribers"]]
    counts = [sub[0] for sub in subscribers]
    closing = [e for r in results for e in r["closing"]]
    bins, exact = histogram(commits, outcome.sealed, subscribers)
    print(f"appended {outcome.sent} events in {outcome.took_s:.1f} s "
          f"({outcome.sent / outcome.took_s:.0f}/s), appender CPU "
          f"{100 * outcome.appender_cpu_s / outcome.took_s:.0f} %")  # fmt: skip
    print(f"deliveries {sum(counts)}/{outcome.sent * len(counts)}; per subscriber min "
          f"{min(counts, default=0)} max {max(counts, default=0)} of {outcome.sent}; every "
          f"event exactly once in log order: {exact}/{len(counts)} subscribers; closed early "
          f"{len(closing)} ({', '.join(sorted(set(closing))) or '-'}); connections lost "
          f"{sum(r['lost'] for r in results)}")  # fmt: skip
    print(f"commit-to-client ms over {sum(bins)} deliveries: p50 {percentile_ms(bins, 50):.1f}  "
          f"p90 {percentile_ms(bins, 90):.1f}  p99 {percentile_ms(bins, 99):.1f}  "
          f"max {percentile_ms(bins, 100):.1f}  (target p99 < 100)")  # fmt: skip
    to_tailer = [
        max(0.0, tailer_read[c] - at) * 1000 for c, at in commits.items() if c in tailer_read
    ]
    if to_tailer:
        q = statistics.quantiles(to_tailer, n=100, method="inclusive")
        print(f"of which commit to the gateway's tailer read, ms: p50 {q[49]:.1f}  p99 {q[98]:.1f}")
    client_cpu = [r["cpu_s"] for r in results]
    print(f"gateway CPU {100 * outcome.gateway_cpu_s / outcome.took_s:.0f} % of one core over "
          f"the append window; RSS {outcome.gateway_memory.get('VmRSS', 0):.0f} MB "
          f"(peak {outcome.gateway_memory.get('VmHWM', 0):.0f} MB); subscriber processes "
          f"CPU {', '.join(f'{s:.1f}' for s in client_cpu)} s in all; load average "
          f"{os.getloadavg()[0]:.1f}")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--subscribers", type=int, default=1000)
    parser.add_argument("--rate", type=float, default=500.0, help="events appended per second")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--client-processes", type=int, default=2)
    parser.add_argument("--pool", type=int, default=20, help="the appender's pool size")
    parser.add_argument(
        "--drain", type=float, default=10.0, help="at most this many seconds for the last frames"
    )
    parser.add_argument("--database-url", default=None)
    parser.add_argument("--quick", action="store_true", help="50 subscribers, 200/s, 5 s")
    parser.add_argument("--role", choices=("bench", "gateway", "clients"), default="bench")
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--key", default="", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.subscribers, args.rate, args.seconds = 50, 200.0, 5.0
    logging.basicConfig(level=logging.WARNING)
    raise_fd_limit()
    if args.role == "gateway":
        asyncio.run(serve_gateway(args.database_url, args.out))
    elif args.role == "clients":
        asyncio.run(run_clients(args.port, args.key, args.subscribers, args.out))
    else:
        asyncio.run(run(args))


if __name__ == "__main__":
    main()
