"""Who is calling, with every credential the identity subsystem adds to API keys.

`identify(request)` resolves, in order:

1. no Authorization header and an `svc_session` cookie: the admin session (CSRF checked on
   writes, see sessions.py);
2. a bearer JWT whose issuer is ours: an OAuth access token (oauth.py);
3. any other bearer JWT while SVC_OIDC_ISSUER is set: an OIDC token (oidc.py), naming a user
   of the workspace in SVC_OIDC_TENANT_CLAIM;
4. anything else: the platform's `Authenticator` (API keys, the static compatible key).

It calls `app[AUTH].authenticate` (not the module function gateway.auth.authenticate), so
gateway.auth.authenticate may itself delegate here (docs/identity-wiring.md) without a loop.
Without the identity subsystem (no IDENTITY in the app) it is exactly the platform's check.

A user principal's scopes come from the user's role bindings (roles.py). A session or an OIDC
token of a user who is deactivated, deprovisioned or unknown is refused with 401 at once.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from datetime import UTC, datetime

from aiohttp import web

from gateway.auth import PRINCIPAL, InvalidCredential, authorization_header
from gateway.identity.common import storable
from gateway.identity.oauth import is_oauth_token, verify_access_token
from gateway.identity.oidc import OidcConfig, OidcIdentity, OidcVerifier, looks_like_jwt
from gateway.identity.roles import require_access, scopes_for, within_rights
from gateway.identity.service import IDENTITY, Identity, identity
from gateway.identity.sessions import check_csrf, session_token, token_hash
from gateway.state import AUTH, Principal
from projections.identity_queries import (
    AmbiguousSubject,
    UserRow,
    find_session,
    find_user_by_subject,
    get_user,
    key_owner,
    role_permissions,
)
from schemas.errors import Unauthorized
from schemas.identity import Access

log = logging.getLogger(__name__)


async def user_principal(ident: Identity, user: UserRow, attributes: dict[str, str]) -> Principal:
    permissions = await role_permissions(ident.db, user.workspace_id, user.roles)
    return Principal(
        workspace_id=user.workspace_id,
        scopes=scopes_for(permissions),
        user_id=user.user_id,
        attributes={"user_name": user.user_name, "roles": ",".join(user.roles), **attributes},
    )


async def session_principal(request: web.Request, ident: Identity, token: str) -> Principal:
    session = await find_session(ident.db, token_hash(token))
    now = datetime.now(UTC)
    if session is None or session.revoked_at is not None or session.expires_at <= now:
        raise Unauthorized("invalid or expired session: log in again")
    user = await get_user(ident.db, session.workspace_id, session.user_id)
    if user is None or not user.usable:
        raise Unauthorized("invalid or expired session: log in again")
    check_csrf(request, token)
    return await user_principal(ident, user, {"auth": "session", "session_id": session.session_id})


def oidc_verifier(ident: Identity) -> OidcVerifier | None:
    settings = ident.settings
    issuer = settings.text("SVC_OIDC_ISSUER").strip()
    if not issuer:
        return None
    config = OidcConfig(
        issuer=issuer,
        jwks_url=settings.text("SVC_OIDC_JWKS_URL").strip(),
        audience=settings.text("SVC_OIDC_AUDIENCE").strip(),
        tenant_claim=settings.text("SVC_OIDC_TENANT_CLAIM").strip(),
    )
    current = ident.extras.get("oidc")
    if isinstance(current, OidcVerifier) and current.config == config:
        return current
    verifier = OidcVerifier(config)
    ident.extras["oidc"] = verifier
    return verifier


def _check_usable_claims(found: OidcIdentity) -> None:
    """The subject and tenant claims are looked up as PostgreSQL text, which cannot hold NUL
    or a lone surrogate (JSON allows both): even a token the IdP validly signed is refused
    with 401 when they carry one, before any query."""
    if not all(storable(v) for v in (found.subject, found.tenant or "")):
        raise InvalidCredential("invalid token: its claims are not usable (NUL or invalid Unicode)")


async def oidc_principal(ident: Identity, verifier: OidcVerifier, token: str) -> Principal:
    found = await verifier.verify(token)
    _check_usable_claims(found)
    workspace = found.tenant or ident.settings.default_workspace_id
    try:
        user = await find_user_by_subject(ident.db, workspace, found.subject)
    except AmbiguousSubject:
        log.warning(
            "OIDC: two users of workspace %s hold the token's subject as external id", workspace
        )
        raise InvalidCredential(
            "invalid token: its subject is the external id of more than one user; an "
            "administrator must give each user a distinct externalId"
        ) from None
    if user is None or not user.usable:
        raise InvalidCredential("invalid token: the subject is not an active user of the workspace")
    return await user_principal(ident, user, {"auth": "oidc"})


async def key_principal(request: web.Request, ident: Identity) -> Principal:
    """The platform's check (API keys, static key), then, for a key that belongs to a user:
    refused at once when the user is deactivated or deprovisioned (its revocation may still
    sit in a key cache), and its admin scopes cut to what the user's roles grant now
    (`within_rights`). A key seen to belong to no user skips this from then on."""
    principal = await request.app[AUTH].authenticate(request)
    key_id = principal.key_id
    if not key_id or key_id in ident.unowned_keys:
        return principal
    owner = await key_owner(ident.db, principal.workspace_id, key_id)
    if owner is None:
        ident.unowned_keys.add(key_id)
        return principal
    if owner.blocked:
        raise InvalidCredential("invalid API key: it has been revoked")
    rights = scopes_for(await role_permissions(ident.db, principal.workspace_id, owner.roles))
    # The key acts as its user: the owner rule and every other check that looks at who the
    # user is (their roles, the accounts stronger than theirs) apply to it as to a session.
    return replace(
        principal,
        scopes=within_rights(principal.scopes, rights),
        user_id=owner.user_id,
        attributes={
            **principal.attributes,
            "user_name": owner.user_name,
            "roles": ",".join(owner.roles),
        },
    )


async def _resolve(request: web.Request) -> Principal:
    if IDENTITY not in request.app:
        return await request.app[AUTH].authenticate(request)
    ident = identity(request)
    header = authorization_header(request)
    if not header:
        token = session_token(request)
        if token is not None:
            return await session_principal(request, ident, token)
        return await key_principal(request, ident)
    scheme, _, raw = header.partition(" ")
    raw = raw.strip()
    jwt_shaped = scheme.lower() == "bearer" and looks_like_jwt(raw)
    if jwt_shaped:
        if is_oauth_token(raw):
            return await verify_access_token(ident, raw)
        verifier = oidc_verifier(ident)
        if verifier is not None:
            return await oidc_principal(ident, verifier, raw)
    try:
        return await key_principal(request, ident)
    except InvalidCredential:
        if not jwt_shaped:
            raise
        # A token shaped as a JWT is no API key (those have no dots): "invalid API key"
        # sent its holder looking in the wrong place.
        raise InvalidCredential(
            "invalid token: not an access token this service issued (damaged, or from "
            "elsewhere; POST /v1/oauth/token issues one), and no OIDC provider is configured "
            "to verify others"
        ) from None


async def identify(request: web.Request) -> Principal:
    """The acting principal (resolved once per request)."""
    if PRINCIPAL in request:
        return request[PRINCIPAL]
    try:
        principal = await _resolve(request)
    except BaseException:
        request.pop(PRINCIPAL, None)  # the key's own, cached by the platform's check
        raise
    request[PRINCIPAL] = principal
    return principal


async def acting(request: web.Request, domain: str, access: Access) -> Principal:
    """The acting principal, refused unless it has `access` on `domain` (roles.py)."""
    principal = await identify(request)
    require_access(principal, domain, access)
    return principal
