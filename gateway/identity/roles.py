"""Role-based access on the admin API, for API keys and user principals alike.

A user's roles resolve to read or write per resource domain (schemas/identity.py). They are
carried on the `Principal` as scopes: `admin:read:<domain>` / `admin:write:<domain>` for each
granted domain, plus the plain `admin:read` / `admin:write` only when granted on every domain.
So a user principal passes the existing `require_scope(p, "admin:write")` checks only when its
roles would allow every write, and `require_access(p, domain, access)` is the precise check:

    require_access(principal, "apikeys", "write")

passes for an API key with `admin:write` or `*`, and for a user whose roles grant write on
`apikeys`. Reads need read, writes need write; write includes read.
"""

from __future__ import annotations

from collections.abc import Mapping

from gateway.auth import MissingScope, scope_refusal
from gateway.state import Principal
from schemas.errors import Forbidden
from schemas.identity import DOMAINS, Access
from schemas.workspace import API_KEY_SCOPES

NON_ADMIN_SCOPES = frozenset(s for s in API_KEY_SCOPES if s != "*" and not s.startswith("admin:"))
"""What a key may carry beyond the admin API (`chat`, `mcp`): no role governs these."""


def scopes_for(permissions: Mapping[str, Access]) -> frozenset[str]:
    scopes: set[str] = set()
    for domain, access in permissions.items():
        scopes.add(f"admin:read:{domain}")
        if access == "write":
            scopes.add(f"admin:write:{domain}")
    if all(d in permissions for d in DOMAINS):
        scopes.add("admin:read")
        if all(permissions[d] == "write" for d in DOMAINS):
            scopes.add("admin:write")
    return frozenset(scopes)


def within_rights(key_scopes: frozenset[str], rights: frozenset[str]) -> frozenset[str]:
    """The scopes a user's own API key acts with. The key acts as its user, so its admin
    scopes are cut to what the user's roles grant now (`rights`, from `scopes_for`):
    `*` and `admin:write` reach all of them (write includes read), `admin:read` the read
    ones. Its other scopes (`chat`, `mcp`; all of them under `*`) stand."""
    if "*" in key_scopes or "admin:write" in key_scopes:
        admin = rights
    elif "admin:read" in key_scopes:
        admin = frozenset(r for r in rights if r == "admin:read" or r.startswith("admin:read:"))
    else:
        admin = frozenset()
    others = NON_ADMIN_SCOPES if "*" in key_scopes else key_scopes & NON_ADMIN_SCOPES
    return others | admin


def allowed(principal: Principal, domain: str, access: Access) -> bool:
    if principal.allows(f"admin:{access}") or principal.allows(f"admin:{access}:{domain}"):
        return True
    return access == "read" and principal.allows(f"admin:write:{domain}")


def require_access(principal: Principal, domain: str, access: Access) -> None:
    if domain not in DOMAINS:
        raise ValueError(f"unknown resource domain {domain!r}")
    if not allowed(principal, domain, access):
        refusal = _refusal(principal, domain, access)
        if principal.key_id is None and principal.attributes.get("auth") != "oauth":
            # A session's (an OIDC token's) rights come from roles: no scope would do.
            raise Forbidden(refusal, code="insufficient_scope")
        raise MissingScope(f"admin:{access}", refusal)


def _refusal(principal: Principal, domain: str, access: Access) -> str:
    # A workspace key holds scopes (`scope_refusal`); a user's rights, and a user's own
    # key's, come from roles granted per domain.
    if principal.key_id is not None and principal.user_id is None:
        return scope_refusal(principal, f"admin:{access}")
    return f"insufficient rights: {access} access to {domain} is required"


ADMIN_PATH_DOMAINS: dict[str, str] = {
    "overview": "analytics",
    "analytics": "analytics",
    "conversations": "conversations",
    "apikeys": "apikeys",
    "agents": "agents",
    "knowledge": "knowledge",
    "memory": "memory",
    "modules": "modules",
    "security": "security",
    "channels": "channels",
    "artifacts": "artifacts",
    "voice": "voice",
    "media": "media",
    "settings": "settings",
    "users": "users",
    "roles": "users",
    "scim": "security",
    "oauth": "security",
    "identity": "security",
    "audit": "audit",
}


def domain_for_path(path: str) -> str:
    """The resource domain of an admin path: `/v1/admin/<segment>/...` by its first segment;
    an unknown segment counts as `system` (so a new endpoint is covered, by owners/admins)."""
    segment = path.removeprefix("/v1/admin/").split("/", 1)[0]
    return ADMIN_PATH_DOMAINS.get(segment, "system")
