"""OAuth client-credentials tokens accepted by the gateway, RFC 6749 errors; TOTP enrolment
and a login that needs the second factor."""

from __future__ import annotations

import asyncio
import base64
import time

import aiohttp
import jwt
import pytest
from identity_support import GUARDED, WHOAMI, running, settings_for

from gateway.identity.service import IDENTITY
from gateway.identity.totp import TotpVerifier, matching_step, new_secret, now_code

pytestmark = [pytest.mark.filterwarnings("ignore::asyncpg.InterfaceWarning")]

PASSWORD = "correct horse battery staple"


def basic(client_id: str, secret: str) -> dict[str, str]:
    return {"Authorization": aiohttp.encode_basic_auth(client_id, secret)}


async def test_client_credentials_grant(database_url: str) -> None:
    async with running(settings_for(database_url)) as svc:
        key = await svc.issue_key()
        status, client, _ = await svc.request(
            "POST",
            "/v1/admin/oauth/clients",
            key,
            json={"name": "ci", "scopes": ["admin:read", "chat"]},
        )
        assert status == 201
        cid, secret = client["client_id"], client["client_secret"]

        form = {"grant_type": "client_credentials", "scope": "admin:read"}
        status, token, headers = await svc.request(
            "POST", "/v1/oauth/token", data=form, headers=basic(cid, secret)
        )
        assert status == 200, token
        assert headers["Cache-Control"] == "no-store"
        assert token["token_type"] == "Bearer" and token["expires_in"] > 0
        assert token["scope"] == "admin:read"
        assert "refresh_token" not in token
        access = token["access_token"]
        status, who, _ = await svc.request("GET", WHOAMI, access)
        assert status == 200 and who["auth"] == "oauth" and who["scopes"] == ["admin:read"]
        assert (await svc.request("GET", GUARDED.format(domain="users"), access))[0] == 200
        assert (await svc.request("POST", GUARDED.format(domain="users"), access))[0] == 403

        # Client secret in the body works too.
        body = {"grant_type": "client_credentials", "client_id": cid, "client_secret": secret}
        assert (await svc.request("POST", "/v1/oauth/token", data=body))[0] == 200

        status, err, headers = await svc.request(
            "POST",
            "/v1/oauth/token",
            data={"grant_type": "client_credentials"},
            headers=basic(cid, "wrong"),
        )
        assert status == 401 and err["error"] == "invalid_client"
        assert "WWW-Authenticate" in headers
        # A NUL can never name a stored client: refused as such, never a 500.
        nul = {"grant_type": "client_credentials", "client_id": "a\x00b", "client_secret": "x"}
        status, err, _ = await svc.request("POST", "/v1/oauth/token", data=nul)
        assert status == 401 and err["error"] == "invalid_client"
        status, err, _ = await svc.request(
            "POST", "/v1/oauth/token", data=form, headers=basic("a\x00b", "x")
        )
        assert status == 401 and err["error"] == "invalid_client"
        status, err, _ = await svc.request(
            "POST",
            "/v1/oauth/token",
            data={"grant_type": "password"},
            headers=basic(cid, secret),
        )
        assert status == 400 and err["error"] == "unsupported_grant_type"
        status, err, _ = await svc.request(
            "POST",
            "/v1/oauth/token",
            data={"grant_type": "client_credentials", "scope": "*"},
            headers=basic(cid, secret),
        )
        assert status == 400 and err["error"] == "invalid_scope"
        status, err, _ = await svc.request(
            "POST", "/v1/oauth/token", data={}, headers=basic(cid, secret)
        )
        assert status == 400 and err["error"] == "invalid_request"
        assert secret not in str(err)

        # A token we did not sign, or an expired one, is a 401 in the service's envelope.
        forged = jwt.encode(
            {
                "iss": "svc-oauth",
                "aud": "svc",
                "sub": cid,
                "scope": "admin:read",
                "iat": int(time.time()),
                "exp": int(time.time()) + 60,
            },
            "not-the-key-not-the-key-not-the-key",
            algorithm="HS256",
        )
        status, err, _ = await svc.request("GET", WHOAMI, forged)
        assert status == 401 and err["error"]["code"] == "unauthorized"

        # Revoking the client ends its tokens at once.
        status, _, _ = await svc.request("DELETE", f"/v1/admin/oauth/clients/{cid}", key)
        assert status == 204
        assert (await svc.request("GET", WHOAMI, access))[0] == 401


async def test_totp_enrolment_and_login(database_url: str) -> None:
    async with running(settings_for(database_url)) as svc:
        key = await svc.issue_key()
        await svc.create_user(key, "tina", PASSWORD, roles=["admin"])
        status, body, browser = await svc.login("tina", PASSWORD)
        async with browser:
            csrf = {"X-CSRF-Token": body["csrf_token"]}
            status, enrol, _ = await svc.request(
                "POST", "/v1/admin/auth/totp/enrol", session=browser, headers=csrf
            )
            assert status == 200 and enrol["otpauth_uri"].startswith("otpauth://totp/")
            secret = enrol["secret"]
            status, err, _ = await svc.request(
                "POST",
                "/v1/admin/auth/totp/verify",
                session=browser,
                headers=csrf,
                json={"code": "000000" if now_code(secret) != "000000" else "111111"},
            )
            assert status == 400
            status, ok, _ = await svc.request(
                "POST",
                "/v1/admin/auth/totp/verify",
                session=browser,
                headers=csrf,
                json={"code": now_code(secret)},
            )
            assert status == 200 and ok["totp_enrolled"] is True

        status, err, b = await svc.login("tina", PASSWORD)
        await b.close()
        assert status == 401 and err["error"]["code"] == "unauthorized"
        # The code used for enrolment cannot be replayed; the next step's code works.
        code = now_code(secret, time.time() + 30)
        status, body, b = await svc.login("tina", PASSWORD, totp_code=code)
        await b.close()
        assert status == 200, body
        assert body["second_factor"] is True
        status, err, b = await svc.login("tina", PASSWORD, totp_code=code)
        await b.close()
        assert status == 401


def test_codes_match_rfc_6238_vectors() -> None:
    """RFC 6238 appendix B, SHA-1 seed "12345678901234567890", cut to six digits."""
    secret = base64.b32encode(b"12345678901234567890").decode()
    for at, code in ((59, "287082"), (1111111109, "081804"), (1234567890, "005924")):
        assert now_code(secret, at) == code
        assert matching_step(secret, code, at) == int(at // 30)
        assert matching_step(secret, code, at + 30) == int(at // 30)  # one step of drift
        assert matching_step(secret, code, at + 90) is None
    assert matching_step(secret, "28708", 59) is None
    assert matching_step(secret, "28708x", 59) is None


async def test_a_code_is_accepted_once_across_processes(database_url: str) -> None:
    """Each gateway process has its own verifier; the used step is in the database, so a code
    accepted by one is refused by another, an older code is refused after a newer one, and two
    processes checking the same code at once accept it once."""
    async with running(settings_for(database_url)) as svc:
        db = svc.app[IDENTITY].db
        first, second = TotpVerifier(db), TotpVerifier(db)
        secret, t = new_secret(), time.time()
        assert await first.verify("ws-a", "u1", secret, now_code(secret, t), t)
        assert not await second.verify("ws-a", "u1", secret, now_code(secret, t), t)
        # Another user (or workspace) with a code of the same step is not affected.
        assert await second.verify("ws-b", "u1", secret, now_code(secret, t), t)

        later = now_code(secret, t + 30)
        assert await second.verify("ws-a", "u1", secret, later, t + 30)
        assert not await first.verify("ws-a", "u1", secret, now_code(secret, t), t + 30)

        racing = now_code(secret, t + 60)
        outcomes = await asyncio.gather(
            *(v.verify("ws-a", "u1", secret, racing, t + 60) for v in (first, second) * 4)
        )
        assert sorted(outcomes) == [False] * 7 + [True]
