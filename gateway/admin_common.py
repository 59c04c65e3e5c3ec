"""What every admin handler shares: the acting principal with a scope, typed JSON responses,
commands to actors and the read-your-writes wait. Query strings are read with
`gateway.errors.read_query`."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from aiohttp import web
from pydantic import BaseModel

from actors.behaviour import ActorKey
from gateway.auth import authenticate
from gateway.cursor_seal import open_issued
from gateway.identity.roles import domain_for_path, require_access
from gateway.projection_waits import not_applied_by
from gateway.state import CURSORS, PROJECTIONS, RUNTIME, TAILER, Principal
from schemas.commands import Command
from schemas.errors import Unavailable

READ = "admin:read"
WRITE = "admin:write"
READ_YOUR_WRITES_TIMEOUT_S = 5.0


async def acting(request: web.Request, scope: str) -> Principal:
    principal = await authenticate(request)
    require_access(principal, domain_for_path(request.path), "write" if scope == WRITE else "read")
    return principal


def ok(
    model: BaseModel, *, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        status=status,
        body=model.model_dump_json(),
        content_type="application/json",
        headers=headers,
    )


async def ask(request: web.Request, key: ActorKey, command: Command) -> Any:
    return await request.app[RUNTIME].ask(key, command)


# Each read waits for the read models it reads, not for all: one stopped on an event it
# cannot apply holds up only the reads that need it (docs/admin-api.md).
CONVERSATION_MODELS = ("conversations", "messages", "turns")
"""All three conversation read models: the overview's counts read each."""
CONVERSATION_LIST_MODELS = ("conversations",)
"""The conversation list."""
MESSAGE_MODELS = ("conversations", "messages")
"""A conversation's messages, and its export: the conversation row, then its messages."""
CONVERSATION_TURN_MODELS = ("conversations", "turns")
"""A conversation's turns: the conversation row, then its turns."""
TURN_MODELS = ("turns",)
"""Analytics, and the turns of the whole workspace."""


async def wait_applied(
    request: web.Request, cursor: str, names: Collection[str] | None = None
) -> bool:
    """Wait (bounded) until the read models `names` (all by default) have applied `cursor`;
    False on timeout or when one of them is stopped on a poison event."""
    reached: bool = await request.app[PROJECTIONS].wait_for(
        cursor, READ_YOUR_WRITES_TIMEOUT_S, names=names
    )
    return reached


def not_applied(
    request: web.Request,
    names: Collection[str] | None,
    lagging: str,
    *,
    recorded: str | None = None,
) -> Unavailable:
    """`not_applied_by` this app's runner, for a wait that `wait_applied` gave up."""
    return not_applied_by(request.app[PROJECTIONS], names, lagging, recorded=recorded)


def public_cursor(request: web.Request, cursor: str) -> str:
    """`cursor` as a response may carry it: sealed (gateway/cursor_seal.py)."""
    return request.app[CURSORS].seal(cursor)


async def min_cursor(request: web.Request) -> str | None:
    """`?min_cursor=` opened into the internal cursor; None when not given."""
    raw = request.query.get("min_cursor", "").strip()
    if not raw:
        return None
    cursors, tailer = request.app[CURSORS], request.app[TAILER]
    return await open_issued(cursors, tailer, raw, "min_cursor", _READ_WITHOUT_WAITING)


_READ_WITHOUT_WAITING = "leave min_cursor out to read without waiting"


async def read_your_writes(request: web.Request, names: Collection[str] | None = None) -> None:
    """With `?min_cursor=<cursor>` (from a write's response or a feed), wait up to
    READ_YOUR_WRITES_TIMEOUT_S until the read models `names` (those the read draws on; all
    by default) have applied it, so the read sees it. A read model stopped elsewhere in the
    log does not hold up the others' reads."""
    cursor = await min_cursor(request)
    if cursor is not None and not await wait_applied(request, cursor, names):
        raise not_applied(
            request, names, "the read models did not reach min_cursor in time; retry shortly"
        )
