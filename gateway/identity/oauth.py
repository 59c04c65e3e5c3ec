"""OAuth 2.0 token endpoint (RFC 6749), client-credentials grant, and its access tokens.

`POST /v1/oauth/token` takes `application/x-www-form-urlencoded` (`grant_type=client_credentials`,
optional `scope`), the client authenticated by HTTP Basic or by `client_id`/`client_secret` in
the body (section 2.3.1). It answers `{access_token, token_type: "Bearer", expires_in, scope}`
with `Cache-Control: no-store`. Errors use RFC 6749 section 5.2 bodies
(`{"error": "invalid_client", "error_description": ...}`), not the service's envelope, because
OAuth clients parse those; `invalid_client` is a 401 with `WWW-Authenticate`.
No refresh token is issued: section 4.4.3 says a client-credentials grant should not get one
(the client simply asks again).

Access tokens are JWTs signed HS256 with a 256-bit key kept in the identity vault (created on
first use), issuer `OAUTH_ISSUER`, audience `svc`, life `TOKEN_TTL_S`. The gateway accepts them
as bearer credentials; each use checks that the client still exists and is not revoked, and the
granted scopes are cut to the client's scopes at that moment.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import unquote

import jwt
import orjson
from aiohttp import web
from pydantic import BaseModel, Field

from gateway.auth import SCOPES, InvalidCredential, authorization_header
from gateway.errors import count_error
from gateway.identity.common import Form, read_form
from gateway.identity.service import Identity, identity
from gateway.identity.vault import INSTANCE
from gateway.state import Principal
from projections.identity_queries import find_oauth_client
from schemas.errors import SvcError, Unauthorized
from schemas.workspace import unknown_scopes

OAUTH_ISSUER = "svc-oauth"
AUDIENCE = "svc"
TOKEN_TTL_S = 600
CLIENT_PREFIX = "svc_cli_"
SECRET_PREFIX = "svc_cs_"


def new_client_credentials() -> tuple[str, str]:
    return CLIENT_PREFIX + secrets.token_hex(10), SECRET_PREFIX + secrets.token_urlsafe(32)


def secret_hash(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


async def signing_key(ident: Identity) -> bytes:
    cached = ident.extras.get("oauth_key")
    if isinstance(cached, bytes):
        return cached
    stored = await ident.vault.get_or_create(
        INSTANCE, "oauth", "signing_key", secrets.token_urlsafe(32)
    )
    key = stored.encode("utf-8")
    ident.extras["oauth_key"] = key
    return key


def is_oauth_token(token: str) -> bool:
    try:
        claims = jwt.decode(token, options={"verify_signature": False})
    except jwt.PyJWTError:
        return False
    return claims.get("iss") == OAUTH_ISSUER


async def verify_access_token(ident: Identity, token: str) -> Principal:
    try:
        claims: dict[str, Any] = jwt.decode(
            token,
            key=await signing_key(ident),
            algorithms=["HS256"],
            audience=AUDIENCE,
            issuer=OAUTH_ISSUER,
            leeway=5,
            options={"require": ["exp", "iat", "sub", "iss", "aud"]},
        )
    except jwt.ExpiredSignatureError:
        raise InvalidCredential(
            "invalid access token: expired; request a new one (POST /v1/oauth/token)"
        ) from None
    except jwt.PyJWTError:
        raise InvalidCredential(
            "invalid access token: its signature or claims do not check out (damaged, or "
            "signed with a key since replaced); request a new one (POST /v1/oauth/token)"
        ) from None
    client = await find_oauth_client(ident.db, str(claims["sub"]))
    if client is None or client.revoked_at is not None:
        raise InvalidCredential("invalid access token: the client is no longer registered")
    # The client's scopes now, not when the token was issued: a narrowed client's tokens
    # narrow with it.
    granted = {s for s in str(claims.get("scope", "")).split() if _covers(client.scopes, s)}
    return Principal(
        workspace_id=client.workspace_id,
        scopes=frozenset(granted),
        attributes={"auth": "oauth", "client_id": client.client_id},
    )


class TokenRequestForm(BaseModel):
    """The token request's form fields (documentation: the endpoint reads the form itself)."""

    grant_type: str = Field(description="client_credentials")
    scope: str | None = Field(default=None, description="space-separated; default all")
    client_id: str | None = Field(default=None, description="unless sent by HTTP Basic")
    client_secret: str | None = Field(default=None, description="unless sent by HTTP Basic")


class TokenResponse(BaseModel):
    access_token: str
    token_type: str = "Bearer"
    expires_in: int
    scope: str


class OAuthErrorBody(BaseModel):
    """RFC 6749 section 5.2: the error responses of the token endpoint."""

    error: str = Field(description="invalid_request, invalid_client, invalid_scope, ...")
    error_description: str


class OAuthError(Exception):
    def __init__(self, status: int, error: str, description: str) -> None:
        super().__init__(description)
        self.status = status
        self.error = error
        self.description = description


def _oauth_response(status: int, body: dict[str, Any], headers: dict[str, str]) -> web.Response:
    return web.Response(
        status=status,
        body=orjson.dumps(body),
        content_type="application/json",
        headers={"Cache-Control": "no-store", "Pragma": "no-cache", **headers},
    )


def _basic_credentials(request: web.Request) -> tuple[str, str] | None:
    try:
        header = authorization_header(request)
    except Unauthorized:  # two: which client was meant is not guessed
        raise OAuthError(
            401, "invalid_client", "send one Authorization header: Basic <credentials>"
        ) from None
    scheme, _, value = header.partition(" ")
    if not header:
        return None
    if scheme.lower() != "basic":
        raise OAuthError(401, "invalid_client", "client authentication must use HTTP Basic")
    try:
        # ValueError covers binascii.Error (bad base64), a non-ASCII header value (b64decode
        # takes ASCII text only) and UnicodeDecodeError (credentials that are not UTF-8).
        decoded = base64.b64decode(value.strip(), validate=True).decode("utf-8")
    except ValueError:
        raise OAuthError(401, "invalid_client", "malformed Basic credentials") from None
    client_id, sep, secret = decoded.partition(":")
    if not sep:
        raise OAuthError(401, "invalid_client", "malformed Basic credentials")
    return unquote(client_id), unquote(secret)


async def _form(request: web.Request) -> Form:
    """The token request's form; a body that is no readable form is RFC 6749's
    invalid_request (with the status read_form gives it), not the service's envelope."""
    try:
        return await read_form(request)
    except SvcError as exc:
        raise OAuthError(exc.http_status, "invalid_request", exc.message) from None


def _covers(held: Sequence[str], scope: str) -> bool:
    """Whether a client holding `held` may have `scope` in a token: `*` stands for every
    scope there is, as on an API key."""
    return scope in held or ("*" in held and scope in SCOPES)


async def _client_credentials(request: web.Request, form: Form) -> tuple[str, str, bool]:
    basic = _basic_credentials(request)
    if basic is not None:
        # RFC 6749 3.2.1: an authenticated client may still name itself in the body; only a
        # second secret is a second authentication method. An empty parameter is an absent
        # one (3.2).
        if form.get("client_secret"):
            raise OAuthError(400, "invalid_request", "use one client authentication method only")
        if form.get("client_id") not in (None, "", basic[0]):
            raise OAuthError(400, "invalid_request", "client_id is not the client authenticated")
        return basic[0], basic[1], True
    client_id, secret = form.get("client_id"), form.get("client_secret")
    if not isinstance(client_id, str) or not isinstance(secret, str):
        raise OAuthError(401, "invalid_client", "client authentication failed")
    return client_id, secret, False


async def _issue(request: web.Request) -> dict[str, Any]:
    if request.content_type != "application/x-www-form-urlencoded":
        raise OAuthError(
            400, "invalid_request", "the body must be application/x-www-form-urlencoded"
        )
    form = await _form(request)
    repeated = sorted({name for name in form if len(form.getall(name)) > 1})
    if repeated:
        # RFC 6749 3.1 and 3.2: parameters must not be included more than once.
        raise OAuthError(400, "invalid_request", f"repeated parameter: {', '.join(repeated)}")
    grant = form.get("grant_type")
    if not isinstance(grant, str) or not grant:
        raise OAuthError(400, "invalid_request", "grant_type is required")
    client_id, secret, _ = await _client_credentials(request, form)
    if "\x00" in client_id or "\x00" in secret:
        # PostgreSQL text cannot hold NUL; such a client can never exist.
        raise OAuthError(401, "invalid_client", "client authentication failed")
    ident = identity(request)
    client = await find_oauth_client(ident.db, client_id)
    if (
        client is None
        or client.revoked_at is not None
        or not hmac.compare_digest(client.secret_hash, secret_hash(secret))
    ):
        raise OAuthError(401, "invalid_client", "client authentication failed")
    if grant != "client_credentials":
        raise OAuthError(400, "unsupported_grant_type", f"grant_type {grant} is not supported")
    requested = form.get("scope")
    scopes = set(client.scopes)
    if isinstance(requested, str) and requested.strip():
        scopes = set(requested.split())
        problem = unknown_scopes(scopes)
        if problem:
            raise OAuthError(400, "invalid_scope", problem)
        beyond = sorted(scope for scope in scopes if not _covers(client.scopes, scope))
        if beyond:
            raise OAuthError(
                400,
                "invalid_scope",
                f"scope {' '.join(beyond)} exceeds what the client may request "
                f"({' '.join(sorted(client.scopes))})",
            )
    now = int(time.time())
    claims = {
        "iss": OAUTH_ISSUER,
        "aud": AUDIENCE,
        "sub": client.client_id,
        "ws": client.workspace_id,
        "scope": " ".join(sorted(scopes)),
        "iat": now,
        "exp": now + TOKEN_TTL_S,
        "jti": secrets.token_hex(12),
    }
    token = jwt.encode(claims, await signing_key(ident), algorithm="HS256")
    return {
        "access_token": token,
        "token_type": "Bearer",
        "expires_in": TOKEN_TTL_S,
        "scope": claims["scope"],
    }


async def token_endpoint(request: web.Request) -> web.Response:
    try:
        body = await _issue(request)
    except OAuthError as exc:
        count_error(exc.status)
        headers = {"WWW-Authenticate": 'Basic realm="svc"'} if exc.status == 401 else {}
        return _oauth_response(
            exc.status, {"error": exc.error, "error_description": exc.description}, headers
        )
    return _oauth_response(200, body, {})
