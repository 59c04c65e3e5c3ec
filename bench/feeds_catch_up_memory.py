"""Gateway RSS while event feeds catch up over large messages.

Starts `svc serve` on the embedded defaults in its own data directory, records `--turns`
chat turns of about `--chars` characters each on the offline model (4 at a time), then opens
`--feeds` (a comma list of counts) event feeds from the start of the log at once and reads
each to the end of what was recorded, sampling the gateway's resident memory every 50 ms.
Prints RSS before, peak and after for each count.

    python bench/feeds_catch_up_memory.py --turns 300 --chars 900000 --feeds 1,4
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

SVC = str(Path(sys.executable).with_name("svc"))


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    return 0.0


async def record_turns(
    http: aiohttp.ClientSession, base: str, key: str, n: int, chars: int
) -> None:
    limit = asyncio.Semaphore(4)
    auth = {"Authorization": f"Bearer {key}"}

    async def one(i: int) -> None:
        text = f"turn {i} " + "lorem ipsum " * (chars // 12)
        body = {"model": "svc-offline", "messages": [{"role": "user", "content": text}]}
        async with limit, http.post(f"{base}/v1/chat/completions", json=body, headers=auth) as r:
            await r.read()
            if r.status != 200:
                raise SystemExit(f"turn {i}: HTTP {r.status}")

    await asyncio.gather(*(one(i) for i in range(n)))


async def read_feed(http: aiohttp.ClientSession, base: str, key: str, until: str) -> int:
    """Frames read until the one whose id is `until` (the log's head when the load ended).
    Only `id:` lines are looked at; the megabyte `data:` lines are skipped as they stream."""
    frames = -1  # the first frame (`event: cursor`) names where the feed starts: no event
    headers = {"Authorization": f"Bearer {key}"}
    timeout = aiohttp.ClientTimeout(total=900)
    line = b""
    async with http.get(f"{base}/v1/events/stream", headers=headers, timeout=timeout) as r:
        async for chunk in r.content.iter_any():
            *complete, line = (line + chunk).split(b"\n")
            for text in complete:
                if text.startswith(b"id: "):
                    frames += 1
                    if text[4:].strip().decode() == until:
                        return frames
            if not line.startswith(b"id:"[: len(line)]):
                line = b""  # part of a data line: not needed
    return frames


async def measure(args: argparse.Namespace, pid: int, base: str, key: str) -> None:
    async with aiohttp.ClientSession() as http:
        t0 = time.monotonic()
        await record_turns(http, base, key, args.turns, args.chars)
        took = time.monotonic() - t0
        print(f"recorded {args.turns} turns of ~{args.chars:,} characters in {took:.1f} s")
        head = await head_cursor(http, base, key)
        for feeds in (int(n) for n in args.feeds.split(",")):
            before = peak = rss_mb(pid)
            reads = asyncio.gather(*(read_feed(http, base, key, head) for _ in range(feeds)))
            while not reads.done():
                peak = max(peak, rss_mb(pid))
                await asyncio.sleep(0.05)
            counts = reads.result()
            print(
                f"{feeds} feed(s), {counts[0]} frames each: RSS before {before:.0f} MB, "
                f"peak {peak:.0f} MB, after {rss_mb(pid):.0f} MB"
            )


async def head_cursor(http: aiohttp.ClientSession, base: str, key: str) -> str:
    """A cursor at the log's head once the load is recorded: a key issued now answers with
    the cursor of its own event, the newest."""
    headers = {"Authorization": f"Bearer {key}"}
    body = {"name": "bench-head", "scopes": ["admin:read"]}
    async with http.post(f"{base}/v1/admin/apikeys", json=body, headers=headers) as r:
        cursor: str = (await r.json())["cursor"]
    return cursor


async def wait_ready(base: str) -> None:
    async with aiohttp.ClientSession() as http:
        for _ in range(600):
            try:
                async with http.get(f"{base}/readyz") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise SystemExit("svc serve did not become ready")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--turns", type=int, default=300)
    parser.add_argument("--chars", type=int, default=900_000)
    parser.add_argument("--feeds", default="1,4")
    parser.add_argument("--port", type=int, default=19082)
    args = parser.parse_args()
    data = Path(tempfile.mkdtemp(prefix="svc-bench-feedmem-"))
    env = {
        **os.environ,
        "SVC_DATA_DIR": str(data),
        "SVC_GATEWAY_ADDR": f"127.0.0.1:{args.port}",
        "SVC_FEEDS_PER_OWNER": "0",  # --feeds may open more than one owner's bound
    }
    server = subprocess.Popen(
        [SVC, "serve"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        base = f"http://127.0.0.1:{args.port}"
        asyncio.run(wait_ready(base))
        made = subprocess.run(
            [SVC, "apikeys", "create", "--scopes", "*"],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        asyncio.run(measure(args, server.pid, base, made.stdout.strip()))
    finally:
        server.terminate()
        server.wait(60)
        shutil.rmtree(data, ignore_errors=True)


if __name__ == "__main__":
    main()
