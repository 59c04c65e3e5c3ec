"""Admin sessions: the cookie, its lookup, and CSRF protection for cookie-authenticated writes.

The session token is 256 random bits in the `svc_session` cookie (HttpOnly, SameSite=Strict,
Secure when the request came over HTTPS, Max-Age = the session's life); only its sha256 is
recorded (`SessionStarted.token_hash`). Every request looks the session up in the read model,
joined with its user, so a logout, a revocation or a deprovisioned user takes effect at once.

CSRF: a write (POST, PUT, PATCH, DELETE) authenticated by the cookie must carry the header
`X-CSRF-Token` equal to HMAC-SHA256(session token, "svc-csrf"). The login response returns that
value in its body and in the `svc_csrf` cookie (readable by the page's script, same site only).
A cross-site page can make the browser send the session cookie (not with SameSite=Strict, but
defence in depth) yet can neither read the CSRF value nor compute it.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from aiohttp import web

from gateway.security import _is_secure
from gateway.state import SETTINGS
from schemas.errors import Forbidden

SESSION_COOKIE = "svc_session"
CSRF_COOKIE = "svc_csrf"
CSRF_HEADER = "X-CSRF-Token"
SESSION_TTL = timedelta(hours=8)
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


@dataclass(frozen=True, slots=True)
class NewSession:
    session_id: str
    token: str
    token_hash: str
    csrf_token: str
    expires_at: datetime


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def csrf_for(token: str) -> str:
    return hmac.new(token.encode("utf-8"), b"svc-csrf", hashlib.sha256).hexdigest()


def new_session(now: datetime | None = None) -> NewSession:
    token = secrets.token_urlsafe(32)
    at = now or datetime.now(UTC)
    return NewSession(
        session_id="ses_" + secrets.token_hex(12),
        token=token,
        token_hash=token_hash(token),
        csrf_token=csrf_for(token),
        expires_at=at + SESSION_TTL,
    )


def session_token(request: web.Request) -> str | None:
    token = request.cookies.get(SESSION_COOKIE, "").strip()
    return token or None


def check_csrf(request: web.Request, token: str) -> None:
    if request.method in SAFE_METHODS:
        return
    sent = request.headers.get(CSRF_HEADER, "")
    if not sent or not hmac.compare_digest(sent.encode(), csrf_for(token).encode()):
        raise Forbidden(
            f"missing or invalid {CSRF_HEADER} header for a session-authenticated write",
            code="csrf_failed",
        )


def set_session_cookies(request: web.Request, response: web.StreamResponse, s: NewSession) -> None:
    secure = _is_secure(request, request.app[SETTINGS])
    max_age = int(SESSION_TTL.total_seconds())
    response.set_cookie(
        SESSION_COOKIE,
        s.token,
        max_age=max_age,
        path="/",
        secure=secure,
        httponly=True,
        samesite="Strict",
    )
    response.set_cookie(
        CSRF_COOKIE,
        s.csrf_token,
        max_age=max_age,
        path="/",
        secure=secure,
        httponly=False,
        samesite="Strict",
    )


def clear_session_cookies(request: web.Request, response: web.StreamResponse) -> None:
    secure = _is_secure(request, request.app[SETTINGS])
    for name, http_only in ((SESSION_COOKIE, True), (CSRF_COOKIE, False)):
        response.set_cookie(
            name, "", max_age=0, path="/", secure=secure, httponly=http_only, samesite="Strict"
        )
