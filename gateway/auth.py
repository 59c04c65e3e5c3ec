"""Who is calling: bearer API keys, the static compatible key, scopes and per-key limits.

Keys are `svc_` + 40 url-safe characters, shown once; only their sha256 is stored (the
`api_keys` read model, found by hash). A lookup is cached for `CACHE_TTL_S`, so a revocation
made through another process takes effect within that time plus the projection lag
(milliseconds); the revoke path of this process calls `Authenticator.forget_key`, which drops
the key from the cache at once. Scopes: `admin:read`, `admin:write`, `*`, `mcp` and `chat`.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from aiohttp import web

from gateway.errors import BEARER_CHALLENGE
from gateway.ratelimit import RateDecision, RateLimiter
from gateway.settings import Settings
from gateway.state import AUTH, SETTINGS, Principal
from gateway.ttl_cache import TtlCache
from projections.apikeys import ApiKeysProjector
from schemas.errors import Forbidden, Unauthorized

KEY_PREFIX = "svc_"
KEY_RANDOM_CHARS = 40
CACHE_TTL_S = 2.0
CACHE_MAX = 10_000
CHAT_PATH = "/v1/chat/completions"
MODELS_PATH = "/v1/models"
COMPATIBLE_PATHS = frozenset({CHAT_PATH, MODELS_PATH})
"""The OpenAI-compatible endpoint, where SVC_PERSONAL_API_KEYS=off refuses issued keys
(with each model's own path under MODELS_PATH: `on_compatible_endpoint`)."""


def on_compatible_endpoint(path: str) -> bool:
    return path in COMPATIBLE_PATHS or path.startswith(MODELS_PATH + "/")


KEY_MODELS = (ApiKeysProjector.name,)
"""The read model keys are authenticated from: key writes and reads wait for it alone."""
CHAT_SCOPE = "chat"
SCOPES = frozenset({"admin:read", "admin:write", "*", "mcp", CHAT_SCOPE})


@dataclass(frozen=True, slots=True)
class KeyRecord:
    key_id: str
    workspace_id: str
    scopes: frozenset[str]
    rate_limit_rpm: int | None = None
    expires_at: datetime | None = None
    revoked_at: datetime | None = None


PRINCIPAL: web.RequestKey[Principal] = web.RequestKey("svc_principal", Principal)
RATE_DECISION: web.RequestKey[RateDecision] = web.RequestKey("svc_rate_limit", RateDecision)
RECHECK: web.RequestKey[bool] = web.RequestKey("svc_recheck", bool)
"""Set on a request that checks again a credential already admitted (an open SSE feed's):
every rule applies except the rate limit, which the admitting request counted."""

Identify = Callable[[web.Request], Awaitable[Principal]]
IDENTIFY: web.AppKey[Identify] = web.AppKey("svc_identify")
"""Optional: a wider resolver (sessions, OAuth and OIDC tokens; gateway/identity) that
`authenticate` delegates to. It may call `authenticate` again for API keys."""
_IDENTIFYING: web.RequestKey[bool] = web.RequestKey("svc_identifying", bool)

KeyLookup = Callable[[str], Awaitable[KeyRecord | None]]
"""Find an issued key by the sha256 hex digest of its text."""


def generate_key() -> str:
    # token_urlsafe(30) is exactly 40 characters of [A-Za-z0-9_-].
    return KEY_PREFIX + secrets.token_urlsafe(30)


class InvalidCredential(Unauthorized):
    """A bearer credential was sent and is not (or no longer) good: RFC 6750 section 3's
    `invalid_token`, which tells a client to get a new one rather than to send one."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.headers = {"WWW-Authenticate": f'{BEARER_CHALLENGE}, error="invalid_token"'}


class MissingScope(Forbidden):
    """RFC 6750 section 3's `insufficient_scope`, naming the scope that would do."""

    def __init__(self, scope: str, message: str | None = None) -> None:
        message = message or f"this API key lacks the {scope} scope"
        super().__init__(message, code="insufficient_scope")
        challenge = f'{BEARER_CHALLENGE}, error="insufficient_scope", scope="{scope}"'
        self.headers = {"WWW-Authenticate": challenge}


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def authorization_header(request: web.Request) -> str:
    """The request's one `Authorization` header ("" when none). Two are refused: which
    credential was meant cannot be guessed, and a proxy that adds its own in front of the
    client's must not have either one silently win."""
    headers = request.headers.getall("Authorization", ())
    if len(headers) > 1:
        raise Unauthorized(
            f"{len(headers)} Authorization headers: send one, Authorization: Bearer <API_KEY>"
        )
    return headers[0] if headers else ""


def bearer_token(request: web.Request) -> str:
    header = authorization_header(request)
    scheme, _, token = header.partition(" ")
    if not header:
        raise Unauthorized("missing API key: send the header Authorization: Bearer <API_KEY>")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthorized("malformed Authorization header: expected Bearer <API_KEY>")
    return token.strip()


class KeyCache:
    """Key records by hash, cached `ttl_s` (see `TtlCache` for what a forget guarantees)."""

    def __init__(self, lookup: KeyLookup, ttl_s: float = CACHE_TTL_S) -> None:
        self._lookup = lookup
        self._cache: TtlCache[str, KeyRecord | None] = TtlCache(ttl_s, CACHE_MAX)

    async def find(self, key_hash: str) -> KeyRecord | None:
        return await self._cache.get(key_hash, lambda: self._lookup(key_hash))

    def forget(self, key_id: str) -> None:
        """Drop every cached lookup of `key_id`: its next use reads the read model."""
        self._cache.forget_where(lambda record: record is not None and record.key_id == key_id)

    def clear(self) -> None:
        self._cache.clear()


def _check_usable(record: KeyRecord) -> None:
    # A revocation holds from its record on, whatever time it names: it is stamped by the
    # clock of the process that revoked, which may run ahead of this one.
    if record.revoked_at is not None:
        raise InvalidCredential("invalid API key: it has been revoked")
    if record.expires_at is not None and record.expires_at <= datetime.now(UTC):
        raise InvalidCredential("invalid API key: it has expired")


class Authenticator:
    def __init__(
        self, settings: Settings, lookup: KeyLookup, limiter: RateLimiter | None = None
    ) -> None:
        self._settings = settings
        self._keys = KeyCache(lookup)
        self._limiter = limiter
        self._on_forget: list[Callable[[str], None]] = []

    def on_forget(self, listener: Callable[[str], None]) -> None:
        """Call `listener(key_id)` after every `forget_key` (a key revoked or changed here)."""
        self._on_forget.append(listener)

    def forget_key(self, key_id: str) -> None:
        """Call after revoking `key_id` (or changing its scopes or limit) in this process."""
        self._keys.forget(key_id)
        for listener in self._on_forget:
            listener(key_id)

    def _static_principal(self, token: str) -> Principal | None:
        static = self._settings.text("SVC_NATIVE_COMPAT_KEY")
        if not static or not hmac.compare_digest(token.encode(), static.encode()):
            return None
        workspace = self._settings.text("SVC_NATIVE_COMPAT_WORKSPACE").strip()
        return Principal(
            workspace_id=workspace or self._settings.default_workspace_id,
            scopes=frozenset({CHAT_SCOPE}),
            attributes={"auth": "static"},
        )

    async def _key_principal(self, request: web.Request, token: str) -> Principal:
        record = await self._keys.find(hash_key(token))
        if record is None:
            raise InvalidCredential("invalid API key")
        _check_usable(record)
        if on_compatible_endpoint(request.path) and not self._settings.flag(
            "SVC_PERSONAL_API_KEYS"
        ):
            raise Unauthorized(
                "personal API keys are disabled on this endpoint (SVC_PERSONAL_API_KEYS=off)"
            )
        rpm, limiter = record.rate_limit_rpm, self._limiter
        if rpm is not None and limiter is not None and not request.get(RECHECK):
            request[RATE_DECISION] = await limiter.check(record.key_id, rpm)
        return Principal(
            workspace_id=record.workspace_id,
            scopes=record.scopes,
            key_id=record.key_id,
            rate_limit_rpm=record.rate_limit_rpm,
            attributes={"auth": "api_key"},
        )

    async def authenticate(self, request: web.Request) -> Principal:
        if PRINCIPAL in request:
            return request[PRINCIPAL]
        token = bearer_token(request)
        principal = self._static_principal(token) or await self._key_principal(request, token)
        request[PRINCIPAL] = principal
        return principal


async def authenticate(request: web.Request) -> Principal:
    """The acting principal of `request` (resolved once per request: limits count one hit).
    With an identity resolver installed (IDENTIFY), it decides; its own fallback call here
    resolves API keys and the static key."""
    if PRINCIPAL in request:
        return request[PRINCIPAL]
    identify = request.app.get(IDENTIFY)
    if identify is None or _IDENTIFYING in request:
        return await request.app[AUTH].authenticate(request)
    request[_IDENTIFYING] = True
    try:
        principal = await identify(request)
    except BaseException:
        # The platform's check, run inside the resolver, caches the key's own principal
        # before the resolver's checks refuse it (a key of a deactivated user): nothing of a
        # refused check may stay for a later call on this request to find.
        request.pop(PRINCIPAL, None)
        raise
    finally:
        del request[_IDENTIFYING]
    request[PRINCIPAL] = principal
    return principal


def require_scope(principal: Principal, scope: str) -> None:
    if principal.allows(scope):
        return
    if scope == "mcp":
        raise Unauthorized("this endpoint needs an API key with the mcp scope")
    raise MissingScope(scope, scope_refusal(principal, scope))


def scope_refusal(principal: Principal, scope: str) -> str:
    """The words of a refusal for want of `scope`, alike on every endpoint. A workspace key
    (no user behind it) holds scopes, not roles: it is told the scopes it has, which is
    what its holder can act on (issue a key with the one it lacks)."""
    if principal.key_id is not None and principal.user_id is None:
        held = ", ".join(sorted(principal.scopes)) or "none"
        return (
            f"insufficient scope: this API key lacks the scope {scope} (or *); its scopes: {held}"
        )
    return f"insufficient scope: this credential lacks the scope {scope}"


def require_instance_admin(principal: Principal, request: web.Request, what: str) -> None:
    """Instance-wide state (settings, SSO secrets) is managed from the default workspace: an
    admin of any other workspace administers only that workspace."""
    default = request.app[SETTINGS].default_workspace_id
    if principal.workspace_id != default:
        raise Forbidden(
            f"{what} are managed by admins of the {default!r} workspace",
            code="instance_admin_required",
        )


def holds_owner_power(principal: Principal) -> bool:
    """Whether the owner rule lets the principal act on owners. A credential of no user (a
    workspace key, an OAuth client) answers to no role, so it has no rule to be held to; a
    user's (a session, an OIDC token, a key of the user's) only when they are an owner."""
    return principal.user_id is None or "owner" in principal.attributes.get("roles", "").split(",")


def writes_as_owner(scopes: tuple[str, ...] | list[str]) -> bool:
    """Whether a credential of no user with `scopes` holds owner power: one that may write
    answers to no role, so nothing stops it from granting `owner` (see check_delegation)."""
    return any(s in ("*", "admin:write") for s in scopes)


def check_delegation(
    principal: Principal, scopes: tuple[str, ...], *, for_user: bool = False
) -> None:
    """No principal may mint a credential (API key, OAuth client) with admin scopes it lacks:
    otherwise write access to keys alone would be a path to every right. A credential of no
    user (`for_user` False) that may write (`*`, `admin:write`) holds owner power
    (`holds_owner_power`), so only a principal holding it may mint one: an admin who is no
    owner would otherwise mint a key that may grant them `owner`."""
    admin = [s for s in scopes if s.startswith("admin:") or s == "*"]
    if not all(principal.allows(s) for s in _admin_rights(admin)):
        raise Forbidden(
            "a credential cannot carry admin scopes its issuer lacks", code="insufficient_scope"
        )
    if writes_as_owner(admin) and not for_user and not holds_owner_power(principal):
        raise Forbidden(
            "only an owner may mint a credential of no user with admin write scopes (it is "
            "bound by no role); issue a key of your own user instead, which acts within your "
            "roles (POST /v1/admin/users/{id}/apikeys)",
            code="owner_only",
        )


def _admin_rights(scopes: list[str]) -> set[str]:
    """The admin scopes a credential with `scopes` carries. `*` carries every admin right
    (`admin:read`, `admin:write`) besides `chat` and `mcp`, which are no one's to withhold:
    an owner, whose roles grant both and never `*` itself, may delegate it."""
    return {r for s in scopes for r in (("admin:read", "admin:write") if s == "*" else (s,))}


async def add_rate_limit_headers(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: every answer to a limited key carries the window's state."""
    if RATE_DECISION in request:
        for name, value in request[RATE_DECISION].headers().items():
            response.headers.setdefault(name, value)
