"""What every admin handler shares: the acting principal with a scope, typed JSON responses,
commands to actors and the read-your-writes wait. Query strings are read with
`gateway.errors.read_query`."""

from __future__ import annotations

from typing import Any

from aiohttp import web
from pydantic import BaseModel

from actors.behaviour import ActorKey
from gateway.auth import authenticate
from gateway.identity.roles import domain_for_path, require_access
from gateway.state import PROJECTIONS, RUNTIME, TAILER, Principal
from schemas.commands import Command
from schemas.errors import Unavailable

READ = "admin:read"
WRITE = "admin:write"
READ_YOUR_WRITES_TIMEOUT_S = 5.0


async def acting(request: web.Request, scope: str) -> Principal:
    principal = await authenticate(request)
    require_access(principal, domain_for_path(request.path), "write" if scope == WRITE else "read")
    return principal


def ok(model: BaseModel, *, status: int = 200) -> web.Response:
    return web.Response(
        status=status, body=model.model_dump_json(), content_type="application/json"
    )


async def ask(request: web.Request, key: ActorKey, command: Command) -> Any:
    return await request.app[RUNTIME].ask(key, command)


async def wait_applied(request: web.Request, cursor: str) -> bool:
    """Wait (bounded) until every read model has applied `cursor`; False on timeout."""
    reached: bool = await request.app[PROJECTIONS].wait_for(cursor, READ_YOUR_WRITES_TIMEOUT_S)
    return reached


async def min_cursor(request: web.Request) -> str | None:
    raw = request.query.get("min_cursor", "").strip()
    if not raw:
        return None
    await request.app[TAILER].issued_cursor(raw)
    return raw


async def read_your_writes(request: web.Request) -> None:
    """With `?min_cursor=<cursor>` (from a write's response or a feed), wait up to
    READ_YOUR_WRITES_TIMEOUT_S until the read models have applied it, so the read sees it."""
    cursor = await min_cursor(request)
    if cursor is not None and not await wait_applied(request, cursor):
        raise Unavailable(
            "the read models did not reach min_cursor in time; retry shortly",
            code="projection_lagging",
        )
