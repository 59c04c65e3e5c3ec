"""The floor under any aiohttp gateway on this machine: a pass-through proxy that persists
nothing, checks nothing and forwards each chat request to the stub model server, streaming
the answer back chunk by chunk as it arrives.

What it costs per request is what SVC's gateway pays before it authenticates, records a turn
or projects anything, so its requests/s at a concurrency bound what `gateway_chat.py` can
report there. Run it beside the stub and point `gateway_chat.py` at it:

    python bench/stub_upstream.py --port 8790 --tokens 16 &
    python bench/proxy_floor.py --port 8781 --upstream http://127.0.0.1:8790/v1 &
    python bench/gateway_chat.py --gateway http://127.0.0.1:8781 --key unused \\
        --gateway-pid <proxy pid> --concurrency 1,32 --no-baseline

It serves `POST /v1/chat/completions` only.

`--record` adds the least a gateway that records turns durably must do: before forwarding,
one append of two events (the user message and the turn start) to a new stream, and after
the answer, one append of the outcome, each through the real `PostgresEventStore` with
durable commits, in a throw-away database on an embedded PostgreSQL (or on the server
`SVC_BENCH_DATABASE_URL` names). No actor, no projection, no validation, no authentication:
its requests/s bound what SVC can reach with the two durable appends per turn that the chat
issue asks for.
"""

from __future__ import annotations

import argparse
import uuid
from collections.abc import AsyncIterator, Callable

import aiohttp
from aiohttp import web
from pg_support import create_database, drop_database, durability, server

from eventstore.db import Database
from eventstore.migrate import STORE_MIGRATIONS, apply_migrations
from eventstore.records import NewEvent
from eventstore.store import PostgresEventStore

SESSION: web.AppKey[aiohttp.ClientSession] = web.AppKey("session", aiohttp.ClientSession)
UPSTREAM: web.AppKey[str] = web.AppKey("upstream", str)
STORE: web.AppKey[PostgresEventStore] = web.AppKey("store", PostgresEventStore)
_HOP_BY_HOP = {"content-length", "transfer-encoding", "connection", "content-encoding"}


async def record(request: web.Request) -> web.StreamResponse:
    """Two durable appends around the forwarded call, as a recorded turn needs."""
    store = request.app[STORE]
    body = await request.read()
    stream = f"floor-{uuid.uuid4().hex}"
    started = [
        NewEvent("UserMessage", {"body": body.decode()}),
        NewEvent("TurnStarted", {"turn": 1}),
    ]
    await store.append(
        stream, started, expected_version=0, command_id=uuid.uuid4().hex, workspace_id="floor"
    )
    response = await forward(request)
    outcome = [NewEvent("TurnCompleted", {"status": response.status})]
    await store.append(
        stream, outcome, expected_version=2, command_id=uuid.uuid4().hex, workspace_id="floor"
    )
    return response


async def forward(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    url = request.app[UPSTREAM] + "/chat/completions"
    headers = {"Content-Type": "application/json"}
    async with request.app[SESSION].post(url, data=body, headers=headers) as upstream:
        response = web.StreamResponse(status=upstream.status)
        for name, value in upstream.headers.items():
            if name.lower() not in _HOP_BY_HOP:
                response.headers[name] = value
        await response.prepare(request)
        # Each piece the upstream sends goes out as it comes: no merging, as SVC forwards.
        async for piece in upstream.content.iter_any():
            await response.write(piece)
        await response.write_eof()
        return response


async def _session(app: web.Application) -> AsyncIterator[None]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        app[SESSION] = session
        yield


def _recording(url: str) -> Callable[[web.Application], AsyncIterator[None]]:
    """A cleanup context that opens a store on a new database of `url` and drops it after."""

    async def store_context(app: web.Application) -> AsyncIterator[None]:
        dsn = await create_database(url)
        db = await Database.connect(dsn, min_size=4, max_size=20)
        try:
            await apply_migrations(db, [STORE_MIGRATIONS])
            print(f"proxy_floor: recording turns ({await durability(dsn)})", flush=True)
            app[STORE] = PostgresEventStore(db)
            yield
        finally:
            await db.close()
            await drop_database(url, dsn)

    return store_context


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8781)
    parser.add_argument("--upstream", default="http://127.0.0.1:8790/v1")
    parser.add_argument(
        "--record", action="store_true", help="append each turn durably (two appends)"
    )
    args = parser.parse_args()
    app = web.Application()
    app[UPSTREAM] = args.upstream.rstrip("/")
    app.cleanup_ctx.append(_session)
    if not args.record:
        app.router.add_post("/v1/chat/completions", forward)
        web.run_app(app, host=args.host, port=args.port, access_log=None, print=None)
        return
    with server() as url:
        app.cleanup_ctx.append(_recording(url))
        app.router.add_post("/v1/chat/completions", record)
        web.run_app(app, host=args.host, port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
