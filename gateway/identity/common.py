"""Small helpers shared by the identity handlers: ids, clocks, command ids, JSON views."""

from __future__ import annotations

import secrets
import uuid
from datetime import UTC, datetime
from typing import Any

import orjson
from aiohttp import web

from gateway.auth import PRINCIPAL
from gateway.identity.authn import identify
from gateway.identity.roles import require_access
from gateway.state import Principal
from projections.identity_queries import UserRow
from schemas.errors import InvalidInput
from schemas.identity import Access

SCIM_ACTOR: web.RequestKey[str] = web.RequestKey("svc_scim_actor", str)


def describe(principal: Principal) -> str:
    """Who a principal is, for the audit log (never a secret)."""
    if principal.user_id:
        return f"user:{principal.user_id}"
    if principal.key_id:
        return f"key:{principal.key_id}"
    client = principal.attributes.get("client_id")
    if client:
        return f"oauth:{client}"
    return principal.attributes.get("auth", "system")


def actor_of(request: web.Request) -> str:
    if SCIM_ACTOR in request:
        return request[SCIM_ACTOR]
    if PRINCIPAL in request:
        return describe(request[PRINCIPAL])
    return "system"


def now() -> datetime:
    return datetime.now(UTC)


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(10)


def command_id(request: web.Request) -> str:
    given = request.headers.get("Idempotency-Key", "").strip()
    if len(given) > 200:
        raise InvalidInput(
            "Idempotency-Key: at most 200 characters", code="invalid_idempotency_key"
        )
    return given or uuid.uuid4().hex


def json(body: Any, *, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        status=status,
        body=orjson.dumps(body),
        content_type="application/json",
        headers=headers,
    )


async def acting(request: web.Request, domain: str, access: Access) -> Principal:
    principal = await identify(request)
    require_access(principal, domain, access)
    return principal


def user_view(user: UserRow) -> dict[str, Any]:
    return {
        "id": user.user_id,
        "workspace_id": user.workspace_id,
        "user_name": user.user_name,
        "display_name": user.display_name,
        "given_name": user.given_name,
        "family_name": user.family_name,
        "emails": user.emails,
        "external_id": user.external_id,
        "active": user.active,
        "source": user.source,
        "roles": user.roles,
        "has_password": user.has_password,
        "totp_enrolled": user.totp_enrolled,
        "created_at": user.created_at.isoformat(),
        "updated_at": user.updated_at.isoformat(),
    }
