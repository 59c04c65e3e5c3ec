"""Chat-completions throughput and latency through the gateway, against the stub directly.

Self-contained: `--spawn` starts the stub model server and a gateway using it (a fresh data
directory, embedded PostgreSQL, a new chat key), measures, and stops both:

    python bench/gateway_chat.py --spawn --quick

Or against processes you started yourself:

    python bench/stub_upstream.py --port 8790 --tokens 16 &
    SVC_LLM_GATEWAY_URL=http://127.0.0.1:8790/v1 SVC_LLM_MODEL=stub svc serve &
    python bench/gateway_chat.py --key <API_KEY> --model stub --gateway-pid <PID> --quick

For each mode (JSON, streaming) and concurrency (1, 32, 128) it sends the same requests to
the stub (the baseline: what the model server alone costs) and to the gateway, and prints
requests/s, p50 and p99 latency (to the last byte), the latency the gateway adds at p50, and,
given `--gateway-pid`, the gateway's CPU time per request and its resident memory, read from
/proc/<pid>. Every gateway request is a new conversation turn: a user message, a turn start
and its outcome recorded with durable commits. `--quick` sends fewer requests per level.
`--postgres-cpu` adds the CPU that every PostgreSQL process on the machine spent per request
(run nothing else on a database meanwhile); `--process-tree` counts the gateway pid's child
processes too (a server with worker processes, as bench/reference_gateway.py runs one).

`--rss-conversations N` then sends N more JSON requests (at `--rss-concurrency`), each starting
a new conversation (none carries X-SVC-Conversation-Id), and prints the gateway's resident
memory before and after them (needs the gateway's pid: `--spawn` or `--gateway-pid`);
`--no-levels` skips the levels and measures only that:

    python bench/gateway_chat.py --spawn --no-levels --rss-conversations 10000
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class Target:
    name: str
    url: str
    headers: dict[str, str]
    pid: int | None
    tree: bool = False
    """Count the CPU and RSS of the pid's descendants too (a multi-worker server)."""
    database: bool = False
    """Also measure the CPU of every PostgreSQL server process on the machine."""

    def pids(self) -> list[int]:
        if self.pid is None:
            return []
        return process_tree(self.pid) if self.tree else [self.pid]

    def cpu(self) -> float:
        """CPU seconds so far; for a tree, those of workers that ended too (see cpu_seconds)."""
        return cpu_seconds(self.pids(), reaped=self.tree)


@dataclass(frozen=True, slots=True)
class Result:
    requests: int
    errors: int
    seconds: float
    latencies: list[float]
    cpu_s: float | None
    rss_mb: float | None
    db_cpu_s: float | None = None

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0

    def percentile(self, q: float) -> float:
        if not self.latencies:
            return float("nan")
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _stat(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _live_pids() -> list[int]:
    return [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]


def process_tree(pid: int) -> list[int]:
    """`pid` and every live process descended from it (a multi-worker server's workers)."""
    children: dict[int, list[int]] = {}
    for each in _live_pids():
        with contextlib.suppress(OSError, IndexError):
            children.setdefault(int(_stat(each)[1]), []).append(each)
    tree: list[int] = []
    todo = [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        todo.extend(children.get(current, []))
    return tree


def postgres_pids() -> list[int]:
    """Every PostgreSQL server process on the machine (the postmaster and its children)."""
    pids = []
    for each in _live_pids():
        with contextlib.suppress(OSError):
            if Path(f"/proc/{each}/comm").read_text().strip() == "postgres":
                pids.append(each)
    return pids


def cpu_seconds(pids: list[int], *, reaped: bool = False) -> float:
    """CPU seconds spent by `pids`. With `reaped`, also by their children that ended and were
    reaped: listed again at the end of a measurement, a process family's total then counts
    the processes that came and went during it (a pool's new database connections), as long
    as the family's root lives throughout."""
    total = 0
    for each in pids:
        with contextlib.suppress(OSError):
            fields = _stat(each)
            total += int(fields[11]) + int(fields[12])
            if reaped:
                total += int(fields[13]) + int(fields[14])
    return total / TICKS


def postgres_cpu() -> float:
    return cpu_seconds(postgres_pids(), reaped=True)


def rss_mb(pids: list[int]) -> float:
    total = 0
    for each in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{each}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
    return total / 1024 if total else float("nan")


def body(model: str, stream: bool, n: int) -> bytes:
    request: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": f"benchmark request {n}: say something"}],
        "stream": stream,
    }
    if stream:
        request["stream_options"] = {"include_usage": True}
    return json.dumps(request).encode()


async def one(
    session: aiohttp.ClientSession, target: Target, model: str, stream: bool, n: int
) -> float | None:
    started = time.perf_counter()
    async with session.post(target.url, data=body(model, stream, n), headers=target.headers) as r:
        payload = await r.read()
        if r.status != 200 or (stream and not payload.rstrip().endswith(b"data: [DONE]")):
            return None
    return time.perf_counter() - started


async def run_level(
    target: Target, model: str, stream: bool, concurrency: int, total: int
) -> Result:
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    latencies: list[float] = []
    errors = 0
    counter = iter(range(total))
    async with aiohttp.ClientSession(connector=connector) as session:
        await one(session, target, model, stream, -1)  # warm the connection and the path

        async def worker() -> None:
            nonlocal errors
            for n in counter:
                try:
                    latency = await one(session, target, model, stream, n)
                except aiohttp.ClientError:
                    latency = None
                if latency is None:
                    errors += 1
                else:
                    latencies.append(latency)

        # Both read again at the end, so processes started meanwhile count (the gateway's
        # pool opens most of its connections once the load starts).
        cpu_before = target.cpu() if target.pid else None
        db_before = postgres_cpu() if target.database else None
        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        seconds = time.perf_counter() - started
        cpu = None
        if cpu_before is not None:
            cpu = target.cpu() - cpu_before
        db_cpu = None if db_before is None else postgres_cpu() - db_before
    return Result(
        requests=len(latencies),
        errors=errors,
        seconds=seconds,
        latencies=latencies,
        cpu_s=cpu,
        rss_mb=rss_mb(target.pids()) if target.pid else None,
        db_cpu_s=db_cpu,
    )


def report(mode: str, concurrency: int, target: Target, r: Result, base: Result | None) -> None:
    added = ""
    if base is not None:
        added = f"  added p50 {1000 * (r.percentile(0.5) - base.percentile(0.5)):7.2f} ms"
    resources = ""
    if r.cpu_s is not None and r.requests:
        resources = f"  cpu/req {1000 * r.cpu_s / r.requests:6.2f} ms  rss {r.rss_mb:6.1f} MB"
    if r.db_cpu_s is not None and r.requests:
        resources += f"  postgres cpu/req {1000 * r.db_cpu_s / r.requests:6.2f} ms"
    print(
        f"{mode:6} c={concurrency:<4} {target.name:8} {r.requests:6d} ok {r.errors:4d} err  "
        f"{r.rps:8.1f} req/s  p50 {1000 * r.percentile(0.5):7.2f} ms  "
        f"p99 {1000 * r.percentile(0.99):7.2f} ms{added}{resources}",
        flush=True,
    )


@contextlib.contextmanager
def spawned(args: argparse.Namespace) -> Any:
    """Start the stub and a gateway in a fresh data directory; stop both on exit."""
    bin_dir = Path(sys.executable).parent
    with tempfile.TemporaryDirectory(prefix="svc-bench-") as data_dir:
        env = {
            **os.environ,
            "SVC_DATA_DIR": data_dir,
            "SVC_GATEWAY_ADDR": f"127.0.0.1:{args.gateway_port}",
            "SVC_LLM_GATEWAY_URL": f"http://127.0.0.1:{args.stub_port}/v1",
            "SVC_LLM_MODEL": args.model,
        }
        stub_script = Path(__file__).with_name("stub_upstream.py")
        stub = subprocess.Popen(
            [sys.executable, str(stub_script), "--port", str(args.stub_port), "--tokens", "16"]
        )
        key = subprocess.run(
            [str(bin_dir / "svc"), "apikeys", "create", "--scopes", "chat"],
            env=env,
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        log = Path(data_dir, "serve.log").open("w")
        gateway = subprocess.Popen(
            [str(bin_dir / "svc"), "serve"], env=env, stdout=log, stderr=subprocess.STDOUT
        )
        try:
            args.key = key
            args.gateway = f"http://127.0.0.1:{args.gateway_port}"
            args.stub = f"http://127.0.0.1:{args.stub_port}/v1"
            args.gateway_pid, args.stub_pid = gateway.pid, stub.pid
            yield
        finally:
            for process in (gateway, stub):
                process.terminate()
            for process in (gateway, stub):
                process.wait(30)
            log.close()


async def wait_until_up(url: str) -> None:
    async with aiohttp.ClientSession() as session:
        for _ in range(300):
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(url):
                    return
            await asyncio.sleep(0.1)
    raise SystemExit(f"{url} did not come up")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gateway", default="http://127.0.0.1:8780")
    parser.add_argument("--stub", default="http://127.0.0.1:8790/v1")
    parser.add_argument("--key", default=os.environ.get("SVC_BENCH_KEY", ""))
    parser.add_argument("--model", default="stub")
    parser.add_argument("--gateway-pid", type=int)
    parser.add_argument("--label", default="gateway", help="the gateway's name in the report")
    parser.add_argument("--stub-pid", type=int)
    parser.add_argument(
        "--process-tree",
        action="store_true",
        help="count the CPU and RSS of the gateway pid's child processes too",
    )
    parser.add_argument(
        "--postgres-cpu",
        action="store_true",
        help="also report the CPU of every PostgreSQL process on the machine per request",
    )
    parser.add_argument("--concurrency", default="1,32,128")
    parser.add_argument(
        "--modes", default="json,stream", help="comma-separated: json, stream (default both)"
    )
    parser.add_argument("--requests", type=int, default=2000, help="requests per level")
    parser.add_argument("--quick", action="store_true", help="a few requests per level")
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument("--spawn", action="store_true", help="start stub and gateway here")
    parser.add_argument("--no-levels", action="store_true", help="skip the per-level runs")
    parser.add_argument(
        "--rss-conversations",
        type=int,
        default=0,
        help="then start this many new conversations and report the gateway RSS",
    )
    parser.add_argument("--rss-concurrency", type=int, default=32)
    parser.add_argument("--gateway-port", type=int, default=8787)
    parser.add_argument("--stub-port", type=int, default=8797)
    args = parser.parse_args()
    if args.spawn:
        with spawned(args):
            await wait_until_up(args.stub)
            await wait_until_up(args.gateway + "/healthz")
            await run(args)
    else:
        await run(args)


async def run(args: argparse.Namespace) -> None:
    gateway = Target(
        args.label,
        args.gateway.rstrip("/") + "/v1/chat/completions",
        {"Authorization": f"Bearer {args.key}", "Content-Type": "application/json"},
        args.gateway_pid,
        tree=args.process_tree,
        database=args.postgres_cpu,
    )
    stub = Target(
        "stub",
        args.stub.rstrip("/") + "/chat/completions",
        {"Content-Type": "application/json"},
        args.stub_pid,
    )
    setup = "SVC on embedded defaults: durable commits" if args.spawn else args.label
    print(f"# {os.cpu_count()} CPUs; {setup}")
    if not args.no_levels:
        await run_levels(args, gateway, stub)
    if args.rss_conversations > 0:
        await report_rss(args, gateway)


async def report_rss(args: argparse.Namespace, gateway: Target) -> None:
    """Gateway memory after `--rss-conversations` new conversations (one turn each)."""
    if gateway.pid is None:
        raise SystemExit("--rss-conversations needs the gateway's pid (--spawn or --gateway-pid)")
    before = rss_mb(gateway.pids())
    total, concurrency = args.rss_conversations, args.rss_concurrency
    result = await run_level(gateway, args.model, False, concurrency, total)
    print(
        f"rss    c={concurrency:<4} {gateway.name} {result.requests:6d} ok {result.errors:4d} err  "
        f"{result.rps:8.1f} req/s  new conversations {total}  "
        f"rss {before:6.1f} MB before, {result.rss_mb:6.1f} MB after",
        flush=True,
    )


async def run_levels(args: argparse.Namespace, gateway: Target, stub: Target) -> None:
    levels = [int(c) for c in args.concurrency.split(",")]
    for mode in args.modes.split(","):
        if mode not in ("json", "stream"):
            raise SystemExit(f"--modes: unknown mode {mode!r} (json, stream)")
        stream = mode == "stream"
        for concurrency in levels:
            total = max(20, 4 * concurrency) if args.quick else max(args.requests, concurrency)
            base = None
            if not args.no_baseline:
                base = await run_level(stub, args.model, stream, concurrency, total)
                report(mode, concurrency, stub, base, None)
            result = await run_level(gateway, args.model, stream, concurrency, total)
            report(mode, concurrency, gateway, result, base)


if __name__ == "__main__":
    asyncio.run(main())
