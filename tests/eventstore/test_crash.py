"""A writer process killed mid-run loses no acknowledged append and, restarted with the same
command ids, writes nothing twice (the idempotency ledger commits with the events)."""

from __future__ import annotations

import asyncio
import os
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import asyncpg

HELPER = Path(__file__).with_name("crash_writer.py")
ROOT = Path(__file__).resolve().parents[2]
WRITERS = 8
ACKS_BEFORE_KILL = 300
PATIENCE_S = 60.0


@dataclass(frozen=True)
class Ack:
    i: int
    stream: str
    first: int
    last: int
    duplicate: bool


def parse(lines: list[bytes]) -> dict[int, Ack]:
    acks: dict[int, Ack] = {}
    for raw in lines:
        parts = raw.decode().split()
        # A line cut short by the kill was never acknowledged as a whole.
        if len(parts) != 6 or parts[0] != "ack" or not raw.endswith(b"\n"):
            continue
        ack = Ack(int(parts[1]), parts[2], int(parts[3]), int(parts[4]), parts[5] == "1")
        assert ack.i not in acks, f"command {ack.i} acknowledged twice by one process"
        acks[ack.i] = ack
    return acks


async def spawn(dsn: str, first: int, count: int) -> asyncio.subprocess.Process:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return await asyncio.create_subprocess_exec(
        sys.executable,
        str(HELPER),
        dsn,
        "run",
        str(first),
        str(count),
        str(WRITERS),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=ROOT,
        env=env,
    )


async def sessions(dsn: str) -> list[dict[str, object]]:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(
            "SELECT pid, backend_type, state, wait_event_type, wait_event, backend_xid::text, "
            "left(query, 80) AS query FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
    finally:
        await conn.close()
    return [dict(r) for r in rows]


def expected_events(i: int) -> int:
    return 1 + i % 3


async def stored(dsn: str) -> dict[str, list[tuple[int, str, int]]]:
    """stream -> [(version, command id, k)] in version order."""
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(
            "SELECT stream_id, version, data::json->>'command' AS command, "
            "(data::json->>'k')::int AS k FROM events ORDER BY stream_id, version"
        )
    finally:
        await conn.close()
    out: dict[str, list[tuple[int, str, int]]] = defaultdict(list)
    for row in rows:
        out[row["stream_id"]].append((row["version"], row["command"], row["k"]))
    return out


async def killed_writer_gone(dsn: str) -> None:
    """Until no session of the killed writer is left. A batch it had sent whole before the
    kill still commits after it (PostgreSQL notices a dead client only when it replies), so
    the log is read for what was stored only once its sessions have ended."""
    async with asyncio.timeout(PATIENCE_S):
        while True:
            if all(s["backend_type"] != "client backend" for s in await sessions(dsn)):
                return
            await asyncio.sleep(0.05)


def check_log(streams: dict[str, list[tuple[int, str, int]]]) -> dict[int, tuple[str, int, int]]:
    """Checks dense versions and whole commands; returns command -> (stream, first, last)."""
    placed: dict[int, tuple[str, int, int]] = {}
    for stream, rows in streams.items():
        assert [v for v, _, _ in rows] == list(range(1, len(rows) + 1)), f"gap in {stream}"
        n = 0
        while n < len(rows):
            version, command, _ = rows[n]
            i = int(command.rsplit("-", 1)[1])
            size = expected_events(i)
            block = rows[n : n + size]
            assert [c for _, c, _ in block] == [command] * size, f"{command} split or partial"
            assert [k for _, _, k in block] == list(range(size))
            assert i not in placed, f"{command} written twice"
            placed[i] = (stream, version, version + size - 1)
            n += size
    return placed


async def test_sigkill_mid_run_then_restart_loses_nothing_and_writes_nothing_twice(
    database_url: str,
) -> None:
    proc = await spawn(database_url, 0, 1_000_000)
    assert proc.stdout is not None and proc.stderr is not None
    lines: list[bytes] = []
    try:
        while len(lines) < ACKS_BEFORE_KILL:
            line = await asyncio.wait_for(proc.stdout.readline(), PATIENCE_S)
            if not line:
                problem = (await proc.stderr.read()).decode()
                raise AssertionError(f"writer ended before the kill:\n{problem}")
            lines.append(line)
    finally:
        proc.kill()
    lines.extend((await proc.stdout.read()).splitlines(keepends=True))
    await proc.wait()
    await killed_writer_gone(database_url)
    acked = parse(lines)
    assert len(acked) >= ACKS_BEFORE_KILL

    placed = check_log(await stored(database_url))
    for i, ack in acked.items():
        assert placed.get(i) == (ack.stream, ack.first, ack.last), f"acknowledged {i} not stored"
    # Committed but never acknowledged (killed between commit and print) is allowed; anything
    # else stored must be a command the writer had taken: at most WRITERS beyond those acked.
    taken = len(acked) + WRITERS
    assert max(placed) < taken

    restart = await spawn(database_url, 0, taken)
    try:
        out, err = await asyncio.wait_for(restart.communicate(), PATIENCE_S)
    except TimeoutError:
        stuck = await sessions(database_url)
        raise AssertionError(f"restarted writer stuck; sessions: {stuck}") from None
    finally:
        if restart.returncode is None:
            restart.kill()
            await restart.wait()
    assert restart.returncode == 0, err.decode()
    replayed = parse(out.splitlines(keepends=True))
    assert sorted(replayed) == list(range(taken))
    for i, (stream, first, last) in placed.items():
        again = replayed[i]
        assert again.duplicate, f"command {i} ran twice"
        assert (again.stream, again.first, again.last) == (stream, first, last)
    for i in set(replayed) - set(placed):
        assert not replayed[i].duplicate

    final = check_log(await stored(database_url))
    assert sorted(final) == list(range(taken))
    assert all(final[i] == p for i, p in placed.items())
    total = sum(len(rows) for rows in (await stored(database_url)).values())
    assert total == sum(expected_events(i) for i in range(taken))
