"""OIDC bearer tokens minted with PyJWT against a JWKS served on loopback by the test, and the
hostile cases: expired, not yet valid, wrong audience, missing aud, wrong issuer, alg none,
HS256 signed with the public key, unknown kid (with a bounded refresh rate)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import jwt
import pytest
from aiohttp import web
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from identity_support import GUARDED, WHOAMI, running, settings_for

from gateway.settings import Settings
from schemas.identity_api import SessionInfo

pytestmark = [pytest.mark.filterwarnings("ignore::asyncpg.InterfaceWarning")]

ISSUER = "https://idp.example.test"
AUDIENCE = "svc-admin"
PASSWORD = "correct horse battery staple"


@dataclass
class Idp:
    keys: list[dict[str, Any]] = field(default_factory=list)
    fetches: int = 0
    url: str = ""


def _rsa() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def jwk_of(private: Any, kid: str, alg: str | None = None) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(private.public_key()))
    data.update({"kid": kid, "use": "sig"})
    if alg:
        data["alg"] = alg
    return data


@asynccontextmanager
async def serve_jwks(idp: Idp) -> AsyncIterator[Idp]:
    async def jwks(request: web.Request) -> web.Response:
        idp.fetches += 1
        return web.json_response({"keys": idp.keys})

    app = web.Application()
    app.router.add_get("/jwks", jwks)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    idp.url = f"http://127.0.0.1:{runner.addresses[0][1]}/jwks"
    try:
        yield idp
    finally:
        await runner.cleanup()


def oidc_settings(database_url: str, idp: Idp) -> Settings:
    """OIDC against `idp`, the workspace taken from the token's `ws` claim."""
    return settings_for(
        database_url,
        SVC_OIDC_ISSUER=ISSUER,
        SVC_OIDC_JWKS_URL=idp.url,
        SVC_OIDC_AUDIENCE=AUDIENCE,
        SVC_OIDC_TENANT_CLAIM="ws",
    )


def claims(**over: Any) -> dict[str, Any]:
    now = int(time.time())
    base: dict[str, Any] = {
        "iss": ISSUER,
        "aud": AUDIENCE,
        "sub": "sub-ada",
        "ws": "default",
        "iat": now,
        "nbf": now,
        "exp": now + 300,
    }
    base.update(over)
    return {k: v for k, v in base.items() if v is not None}


def b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def forged(header: dict[str, Any], payload: dict[str, Any], key: bytes | None) -> str:
    signing = b64(json.dumps(header).encode()) + "." + b64(json.dumps(payload).encode())
    sig = b"" if key is None else hmac.new(key, signing.encode(), hashlib.sha256).digest()
    return signing + "." + b64(sig)


async def test_oidc_tokens_and_hostile_cases(database_url: str) -> None:
    key1 = _rsa()
    idp = Idp(keys=[jwk_of(key1, "k1")])
    async with serve_jwks(idp):
        settings = oidc_settings(database_url, idp)
        async with running(settings) as svc:
            api_key = await svc.issue_key()
            status, ada, _ = await svc.request(
                "POST",
                "/v1/admin/users",
                api_key,
                json={"user_name": "ada", "external_id": "sub-ada", "roles": ["operator"]},
            )
            assert status == 201

            status, grace, _ = await svc.request(
                "POST", "/v1/admin/users", api_key, json={"user_name": "grace"}
            )
            assert status == 201

            def sign(payload: dict[str, Any], kid: str = "k1", key: Any = key1) -> str:
                return jwt.encode(payload, key, algorithm="RS256", headers={"kid": kid})

            good = sign(claims())
            status, who, _ = await svc.request("GET", WHOAMI, good)
            assert status == 200, who
            assert who["auth"] == "oidc" and who["user_id"] == ada["id"]
            # A user linked to no external id is matched by the exact user name.
            status, who, _ = await svc.request("GET", WHOAMI, sign(claims(sub="grace")))
            assert status == 200 and who["user_id"] == grace["id"], who
            status, info, _ = await svc.request("GET", "/v1/admin/auth/session", good)
            assert status == 200 and SessionInfo.model_validate(info).auth == "oidc"
            # The token carries the user's role bindings: operator writes conversations but
            # only reads users.
            assert (await svc.request("POST", GUARDED.format(domain="conversations"), good))[
                0
            ] == 200
            assert (await svc.request("POST", GUARDED.format(domain="users"), good))[0] == 403

            public_pem = key1.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
            for twin in ("twin-1", "twin-2"):  # SCIM's externalId is not unique
                body = {"user_name": twin, "external_id": "sub-twin"}
                status, _, _ = await svc.request("POST", "/v1/admin/users", api_key, json=body)
                assert status == 201
            hostile = {
                # QA finding: the oldest of the two signed in, silently.
                "a subject two users hold": sign(claims(sub="sub-twin")),
                "an exp that is no number": sign(claims(exp="soon")),
                "expired": sign(claims(exp=int(time.time()) - 600, iat=int(time.time()) - 900)),
                "not yet valid": sign(claims(nbf=int(time.time()) + 600)),
                "wrong audience": sign(claims(aud="someone-else")),
                "missing aud": sign(claims(aud=None)),
                "wrong issuer": sign(claims(iss="https://evil.example.test")),
                "missing exp": sign(claims(exp=None)),
                "alg none": forged({"alg": "none", "kid": "k1", "typ": "JWT"}, claims(), None),
                "HS256 with the public key": forged(
                    {"alg": "HS256", "kid": "k1", "typ": "JWT"}, claims(), public_pem
                ),
                "unknown kid": sign(claims(), kid="nope", key=_rsa()),
                "right kid, other key": sign(claims(), key=_rsa()),
                "unknown tenant": sign(claims(ws="other-workspace")),
                "unknown subject": sign(claims(sub="sub-nobody")),
                # Review finding: the user name matched too, folded, even for a user linked
                # to another subject: other subjects at the IdP took ada's account.
                "another subject named as the user": sign(claims(sub="ada")),
                "the user's name in capitals": sign(claims(sub="ADA")),
                "the user's name in full width": sign(claims(sub="\uff41\uff44\uff41")),
                "an unlinked user's name folded": sign(claims(sub="GRACE")),
                "no tenant claim": sign(claims(ws=None)),
            }
            said = {  # QA finding: "signature or claims rejected" for a token not valid yet
                "not yet valid": "not valid yet",
                "expired": "expired",
                "wrong audience": f"wrong audience: it must hold {AUDIENCE}",
                "right kid, other key": "signature does not verify",
                "a subject two users hold": "external id of more than one user",
                "an exp that is no number": "its exp claim is not a number",
            }
            for case, token in hostile.items():
                status, body, headers = await svc.request("GET", WHOAMI, token)
                assert status == 401, case
                assert body["error"]["code"] == "unauthorized", case
                assert said.get(case, "") in body["error"]["message"], (case, body)
                assert token not in json.dumps(body), case
                # RFC 6750: a token sent and not good; the client gets a new one.
                assert 'error="invalid_token"' in headers["WWW-Authenticate"], case

            # Unknown kids refresh the key set at a bounded rate, not once per token.
            before = idp.fetches
            for _ in range(5):
                await svc.request("GET", WHOAMI, sign(claims(), kid="flood", key=_rsa()))
            assert idp.fetches - before <= 1

            # A deprovisioned user's token stops working at once.
            status, _, _ = await svc.request("DELETE", f"/v1/admin/users/{ada['id']}", api_key)
            assert status == 204
            status, body, _ = await svc.request("GET", WHOAMI, good)
            assert status == 401


async def test_a_rotated_key_is_fetched_on_its_first_use(database_url: str) -> None:
    key1, key2 = _rsa(), ec.generate_private_key(ec.SECP256R1())
    idp = Idp(keys=[jwk_of(key1, "k1", "RS256")])
    async with serve_jwks(idp):
        settings = settings_for(
            database_url,
            SVC_OIDC_ISSUER=ISSUER,
            SVC_OIDC_JWKS_URL=idp.url,
            SVC_OIDC_TENANT_CLAIM="ws",
        )
        async with running(settings) as svc:
            api_key = await svc.issue_key()
            await svc.create_user(api_key, "sub-ada", roles=["member"])
            first = jwt.encode(
                claims(aud="anything"), key1, algorithm="RS256", headers={"kid": "k1"}
            )
            assert (await svc.request("GET", WHOAMI, first))[0] == 200
            ec_jwk = json.loads(jwt.algorithms.ECAlgorithm.to_jwk(key2.public_key()))
            idp.keys.append({**ec_jwk, "kid": "k2", "use": "sig"})
            second = jwt.encode(claims(aud="x"), key2, algorithm="ES256", headers={"kid": "k2"})
            status, who, _ = await svc.request("GET", WHOAMI, second)
            assert status == 200, who
            # Signed by the EC key but labelled RS256: the JWK's algorithm wins, refused.
            confused = forged({"alg": "RS256", "kid": "k2"}, claims(aud="x"), None)
            assert (await svc.request("GET", WHOAMI, confused))[0] == 401
            # Without SVC_OIDC_AUDIENCE an aud claim is still required.
            no_aud = jwt.encode(claims(aud=None), key1, algorithm="RS256", headers={"kid": "k1"})
            assert (await svc.request("GET", WHOAMI, no_aud))[0] == 401


async def test_a_jwks_document_without_a_key_list_refuses_tokens_without_a_500(
    database_url: str,
) -> None:
    rsa_key = jwk_of(_rsa(), "k1")
    for keys in (
        None,
        5,
        [{"kty": "RSA", "kid": {"no": "hashable"}}],
        [[[[]]]],
        [{**rsa_key, "alg": ["RS256"]}],
    ):
        idp = Idp(keys=keys)  # type: ignore[arg-type]  # served as {"keys": ...}
        async with serve_jwks(idp), running(oidc_settings(database_url, idp)) as svc:
            token = jwt.encode(claims(), _rsa(), algorithm="RS256", headers={"kid": "k1"})
            status, body, _ = await svc.request("GET", WHOAMI, token)
            assert status == 401, (keys, body)
            assert idp.fetches >= 1


async def test_oidc_is_off_without_an_issuer(database_url: str) -> None:
    key1 = _rsa()
    async with running(settings_for(database_url)) as svc:
        token = jwt.encode(claims(), key1, algorithm="RS256", headers={"kid": "k1"})
        status, body, _ = await svc.request("GET", WHOAMI, token)
        assert status == 401 and body["error"]["code"] == "unauthorized"
        assert PASSWORD not in json.dumps(body)


async def test_validly_signed_claims_postgresql_cannot_hold_are_401(database_url: str) -> None:
    """NUL or a lone surrogate (JSON's \\u0000, \\ud800) in the subject or the tenant claim of
    a token the IdP really signed: 401, never a database error."""
    key1 = _rsa()
    idp = Idp(keys=[jwk_of(key1, "k1")])
    async with serve_jwks(idp):
        settings = oidc_settings(database_url, idp)
        async with running(settings) as svc:
            await svc.create_user(await svc.issue_key(), "sub-ada", roles=["member"])

            def sign(**over: Any) -> str:
                return jwt.encode(claims(**over), key1, algorithm="RS256", headers={"kid": "k1"})

            assert (await svc.request("GET", WHOAMI, sign()))[0] == 200
            for case in (
                {"sub": "sub-ada\x00"},
                {"sub": "\ud800"},
                {"ws": "default\x00"},
                {"ws": "\udfff"},
            ):
                status, body, _ = await svc.request("GET", WHOAMI, sign(**case))
                assert status == 401, (case, body)
                assert body["error"]["code"] == "unauthorized", case
                assert "claims are not usable" in body["error"]["message"], case


async def test_an_unreachable_key_set_is_a_503_not_an_invalid_token(database_url: str) -> None:
    """A token no fetched key can check, the provider's keys unreachable: the token may be
    good, and `invalid_token` would have the client throw it away."""
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there
    settings = settings_for(
        database_url,
        SVC_OIDC_ISSUER=ISSUER,
        SVC_OIDC_JWKS_URL=f"http://127.0.0.1:{port}/jwks",
        SVC_OIDC_AUDIENCE=AUDIENCE,
        SVC_OIDC_TENANT_CLAIM="ws",
    )
    async with running(settings) as svc:
        token = jwt.encode(claims(), _rsa(), algorithm="RS256", headers={"kid": "k1"})
        status, body, headers = await svc.request("GET", WHOAMI, token)
        assert status == 503 and body["error"]["code"] == "oidc_keys_unavailable", body
        assert "invalid_token" not in headers.get("WWW-Authenticate", "")
