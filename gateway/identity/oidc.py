"""OIDC bearer tokens: JWTs from an external issuer, verified with PyJWT against its JWKS.

Enabled when SVC_OIDC_ISSUER is set. The key set from SVC_OIDC_JWKS_URL is cached; a token
naming an unknown `kid` refreshes it, through a token bucket of `REFRESH_BURST` refreshes that
refills one per `MIN_REFRESH_S` (a rotated key is picked up on its first use, yet a flood of
forged kids cannot turn the gateway into a load generator against the IdP); the set is
refreshed anyway after `MAX_AGE_S`.

Algorithm confusion is closed by construction: the only algorithm accepted for a token is the
algorithm of the JWK its `kid` selects (its `alg`, or the one its key type implies), symmetric
keys (`kty: oct`) are never loaded, and `none` and every HS* header are refused before any
key is looked at. `aud` is required on every token and, when SVC_OIDC_AUDIENCE is set, must
contain it; `iss` must equal SVC_OIDC_ISSUER; `exp` is required; `exp`/`nbf`/`iat` are
checked with `LEEWAY_S` of clock skew.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import jwt

from gateway.auth import InvalidCredential
from schemas.errors import Unavailable

log = logging.getLogger(__name__)

LEEWAY_S = 30
MIN_REFRESH_S = 10.0
REFRESH_BURST = 3.0
MAX_AGE_S = 3600.0
FETCH_TIMEOUT_S = 5.0
_SYMMETRIC = ("HS", "none")


@dataclass(frozen=True, slots=True)
class OidcConfig:
    issuer: str
    jwks_url: str
    audience: str
    tenant_claim: str


@dataclass(frozen=True, slots=True)
class OidcIdentity:
    subject: str
    tenant: str | None
    claims: dict[str, Any]


class JwksCache:
    def __init__(self, url: str, *, min_refresh_s: float = MIN_REFRESH_S) -> None:
        self._url = url
        self._min_refresh_s = min_refresh_s
        self._keys: dict[str | None, jwt.PyJWK] = {}
        self._fetched_at: float | None = None
        self._budget = REFRESH_BURST
        self._budget_at = time.monotonic()
        self._lock = asyncio.Lock()
        self._unreachable = False
        """The last fetch of the key set failed."""

    async def key(self, kid: str | None) -> jwt.PyJWK:
        now = time.monotonic()
        stale = self._fetched_at is None or now - self._fetched_at > MAX_AGE_S
        if stale or kid not in self._keys:
            await self._refresh(force=stale)
        found = self._keys.get(kid)
        if found is None and kid is None and len(self._keys) == 1:
            found = next(iter(self._keys.values()))
        if found is None and self._unreachable:
            # Not the token's fault: a good one would be thrown away on `invalid_token`.
            raise Unavailable(
                "the identity provider's signing keys (SVC_OIDC_JWKS_URL) could not be "
                "fetched; retry shortly",
                code="oidc_keys_unavailable",
            )
        if found is None:
            raise InvalidCredential("invalid token: signing key not found")
        return found

    def _spend(self, now: float) -> bool:
        refill = (now - self._budget_at) / self._min_refresh_s
        self._budget = min(REFRESH_BURST, self._budget + refill)
        self._budget_at = now
        if self._budget < 1.0:
            return False
        self._budget -= 1.0
        return True

    async def _refresh(self, *, force: bool) -> None:
        async with self._lock:
            now = time.monotonic()
            if not self._spend(now) and not force:
                return
            self._fetched_at = now
            try:
                self._keys = await self._fetch()
            except (aiohttp.ClientError, TimeoutError, ValueError, RecursionError) as exc:
                # RecursionError: JSON nested past the parser's depth.
                log.warning("OIDC: fetching the JWKS failed (%s)", type(exc).__name__)
                # Unreachable, or not answering 200; a document that is no key set is the
                # provider's answer, and a token it does not vouch for is refused.
                self._unreachable = isinstance(exc, aiohttp.ClientError | TimeoutError)
            else:
                self._unreachable = False

    async def _fetch(self) -> dict[str | None, jwt.PyJWK]:
        timeout = aiohttp.ClientTimeout(total=FETCH_TIMEOUT_S)
        async with (
            aiohttp.ClientSession(timeout=timeout) as http,
            http.get(self._url) as resp,
        ):
            resp.raise_for_status()
            body = await resp.json(content_type=None)
        keys: dict[str | None, jwt.PyJWK] = {}
        listed = body.get("keys") if isinstance(body, dict) else None
        if not isinstance(listed, list):  # not a JWK Set (`"keys": null`, an error object)
            # Raised, so that the keys fetched before stay in use (`_refresh`).
            raise ValueError("the JWKS document holds no list of keys")
        for data in listed:
            if not isinstance(data, dict) or data.get("kty") == "oct":
                continue
            kid = data.get("kid")
            if data.get("use") not in (None, "sig") or not isinstance(kid, str | None):
                continue
            try:
                keys[kid] = jwt.PyJWK(data)
            except (jwt.PyJWTError, TypeError, ValueError):  # `"alg": ["RS256"]`, say
                continue
        return keys


class OidcVerifier:
    def __init__(self, config: OidcConfig, cache: JwksCache | None = None) -> None:
        self._config = config
        self._cache = cache or JwksCache(config.jwks_url)

    @property
    def config(self) -> OidcConfig:
        return self._config

    async def verify(self, token: str) -> OidcIdentity:
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError:
            raise InvalidCredential("invalid token: malformed JWT") from None
        alg = header.get("alg")
        if not isinstance(alg, str) or alg.startswith(_SYMMETRIC) or alg.lower() == "none":
            raise InvalidCredential("invalid token: algorithm not allowed")
        kid = header.get("kid")
        jwk = await self._cache.key(kid if isinstance(kid, str) else None)
        if jwk.algorithm_name != alg:
            raise InvalidCredential("invalid token: algorithm does not match the signing key")
        claims = self._decode(token, jwk)
        sub = claims.get("sub")
        if not isinstance(sub, str) or not sub:
            raise InvalidCredential("invalid token: no subject")
        tenant: str | None = None
        if self._config.tenant_claim:
            raw = claims.get(self._config.tenant_claim)
            if not isinstance(raw, str) or not raw:
                raise InvalidCredential("invalid token: the tenant claim is missing")
            tenant = raw
        return OidcIdentity(sub, tenant, claims)

    def _decode(self, token: str, jwk: jwt.PyJWK) -> dict[str, Any]:
        audience = self._config.audience or None
        try:
            claims: dict[str, Any] = jwt.decode(
                token,
                key=jwk.key,
                algorithms=[jwk.algorithm_name],
                audience=audience,
                issuer=self._config.issuer,
                leeway=LEEWAY_S,
                options={
                    "require": ["exp", "iss", "aud", "sub"],
                    "verify_aud": audience is not None,
                },
            )
        except jwt.ExpiredSignatureError:
            raise InvalidCredential("invalid token: expired") from None
        except jwt.InvalidAudienceError:
            expected = f": it must hold {self._config.audience}" if self._config.audience else ""
            raise InvalidCredential(f"invalid token: wrong audience{expected}") from None
        except jwt.InvalidIssuerError:
            raise InvalidCredential("invalid token: wrong issuer") from None
        except jwt.MissingRequiredClaimError as exc:
            raise InvalidCredential(f"invalid token: missing claim {exc.claim}") from None
        except jwt.ImmatureSignatureError:
            raise InvalidCredential(
                f"invalid token: not valid yet (its nbf or iat is more than {LEEWAY_S} s "
                "ahead: check the clocks of the identity provider and of this gateway)"
            ) from None
        except jwt.InvalidSignatureError:
            raise InvalidCredential("invalid token: its signature does not verify") from None
        except jwt.DecodeError as exc:
            # pyjwt raises it for a time claim that is no number too, once the signature
            # holds: named by the claim, in words of ours.
            claim = next((c for c in _TIME_CLAIMS if f"({c})" in str(exc)), None)
            said = f"its {claim} claim is not a number" if claim else "not a well-formed JWT"
            raise InvalidCredential(f"invalid token: {said}") from None
        except jwt.PyJWTError as exc:
            # A claim of the wrong type (`exp` a string), a critical extension: named by its
            # kind, since pyjwt's words may quote what the token holds.
            kind = type(exc).__name__.removesuffix("Error")
            raise InvalidCredential(f"invalid token: its claims were refused ({kind})") from None
        return claims


_TIME_CLAIMS = ("exp", "nbf", "iat")


def looks_like_jwt(token: str) -> bool:
    return token.count(".") == 2 and token[:2] == "ey"
