"""OAuth client-credentials tokens accepted by the gateway, RFC 6749 errors; TOTP enrolment
and a login that needs the second factor."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import jwt
import orjson
import pytest
from identity_support import GUARDED, WHOAMI, Running, running, settings_for

from actors.identity import audit_key
from gateway.identity.service import IDENTITY
from gateway.identity.throttle import MAX_PER_ACCOUNT
from gateway.identity.totp import TotpVerifier, matching_step, new_secret, now_code
from gateway.metrics import HTTP_ERRORS
from gateway.state import STORE
from schemas.identity_api import SessionInfo

pytestmark = [pytest.mark.filterwarnings("ignore::asyncpg.InterfaceWarning")]

PASSWORD = "correct horse battery staple"
WRONG = {"current_password": "not the password at all"}


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
        status, info, _ = await svc.request("GET", "/v1/admin/auth/session", access)
        assert status == 200 and SessionInfo.model_validate(info).auth == "oauth"
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
        assert "exceeds what the client may request (" in err["error_description"], err
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
        # QA finding: a token that is no JWT this service can read was answered "invalid API
        # key", a credential it never was.
        header, claims, signature = access.split(".")
        # One character inside the signature changed: still base64 of 32 bytes (the last
        # character's spare bits would make some changes unreadable instead).
        swapped = "A" if signature[10] != "A" else "B"
        damaged = f"{header}.{claims}.{signature[:10]}{swapped}{signature[11:]}"
        for token, says in (
            (damaged, "invalid access token: its signature or claims do not check out"),
            (f"{header}.{claims}.!", "invalid token: not an access token this service"),
            (f"{header}.e30.{signature}", "invalid token: not an access token this service"),
        ):
            status, err, _ = await svc.request("GET", WHOAMI, token)
            assert status == 401, err
            assert err["error"]["message"].startswith(says), err
        status, err, _ = await svc.request("GET", WHOAMI, "svc_notakey")
        assert status == 401 and err["error"]["message"] == "invalid API key", err

        # Revoking the client ends its tokens at once.
        status, _, _ = await svc.request("DELETE", f"/v1/admin/oauth/clients/{cid}", key)
        assert status == 204
        assert (await svc.request("GET", WHOAMI, access))[0] == 401


async def test_a_client_with_every_scope_gets_a_narrower_token(database_url: str) -> None:
    """`*` stands for every scope, on a client as on a key: a token asking for `chat` alone
    is that client's to have, and carries `chat` alone."""
    async with running(settings_for(database_url)) as svc:
        key = await svc.issue_key()
        body = {"name": "all", "scopes": ["*"]}
        status, client, _ = await svc.request("POST", "/v1/admin/oauth/clients", key, json=body)
        assert status == 201, client
        auth = basic(client["client_id"], client["client_secret"])
        form = {"grant_type": "client_credentials", "scope": "chat admin:read"}
        status, token, _ = await svc.request("POST", "/v1/oauth/token", data=form, headers=auth)
        assert status == 200 and token["scope"] == "admin:read chat", token
        status, who, _ = await svc.request("GET", WHOAMI, token["access_token"])
        assert status == 200 and who["scopes"] == ["admin:read", "chat"], who
        write = GUARDED.format(domain="users")
        status, _, headers = await svc.request("POST", write, token["access_token"])
        assert status == 403  # and the scope that would do is named (RFC 6750)
        assert 'error="insufficient_scope", scope="admin:write"' in headers["WWW-Authenticate"]
        form = {"grant_type": "client_credentials", "scope": "chat telepathy"}
        status, err, _ = await svc.request("POST", "/v1/oauth/token", data=form, headers=auth)
        assert status == 400 and err["error"] == "invalid_scope"
        # Named as unknown, not as beyond the client's (QA finding, for a `*` client).
        assert err["error_description"].startswith("unknown scope 'telepathy'; the scopes are")


async def test_a_client_authenticated_by_basic_may_name_itself_in_the_body(
    database_url: str,
) -> None:
    """RFC 6749 3.2.1: only a second secret is a second authentication method."""
    async with running(settings_for(database_url)) as svc:
        key = await svc.issue_key()
        body = {"name": "ci", "scopes": ["chat"]}
        status, client, _ = await svc.request("POST", "/v1/admin/oauth/clients", key, json=body)
        cid, secret = client["client_id"], client["client_secret"]
        for named in (cid, ""):
            form = {"grant_type": "client_credentials", "client_id": named}
            status, token, _ = await svc.request(
                "POST", "/v1/oauth/token", data=form, headers=basic(cid, secret)
            )
            assert status == 200, token
        refused = (
            ({"client_id": "someone-else"}, "is not the client authenticated"),
            ({"client_secret": secret}, "one client authentication method"),
        )
        for extra, says in refused:
            form = {"grant_type": "client_credentials", **extra}
            status, err, _ = await svc.request(
                "POST", "/v1/oauth/token", data=form, headers=basic(cid, secret)
            )
            assert status == 400 and err["error"] == "invalid_request", err
            assert says in err["error_description"] and secret not in str(err)


async def test_totp_enrolment_and_login(database_url: str) -> None:
    async with running(settings_for(database_url)) as svc:
        key = await svc.issue_key()
        await svc.create_user(key, "tina", PASSWORD, roles=["admin"])
        status, body, browser = await svc.login("tina", PASSWORD)
        async with browser:
            csrf = {"X-CSRF-Token": body["csrf_token"]}
            status, err, _ = await svc.request(
                "POST",
                "/v1/admin/auth/totp/verify",
                session=browser,
                headers=csrf,
                json={"code": "123456"},
            )
            assert (status, err["error"]["code"]) == (400, "totp_not_started"), err
            assert "POST /v1/admin/auth/totp/enrol" in err["error"]["message"], err
            status, enrol, _ = await svc.request(
                "POST",
                "/v1/admin/auth/totp/enrol",
                session=browser,
                headers=csrf,
                json={"current_password": PASSWORD},
            )
            assert status == 200 and enrol["otpauth_uri"].startswith("otpauth://totp/")
            secret = enrol["secret"]
            # A session taken with its CSRF token, without the password, enrols nothing: it
            # would have locked the real user out with its own authenticator.
            for refused, code in (({}, "invalid_request"), (WRONG, "wrong_password")):
                status, err, _ = await svc.request(
                    "POST",
                    "/v1/admin/auth/totp/enrol",
                    session=browser,
                    headers=csrf,
                    json=refused,
                )
                assert (status, err["error"]["code"])[1] == code, err
                assert status in (400, 403), err
            status, err, _ = await svc.request(
                "POST",
                "/v1/admin/auth/totp/verify",
                session=browser,
                headers=csrf,
                json={"code": "000000" if now_code(secret) != "000000" else "111111"},
            )
            assert status == 400 and "authenticator app shows now" in err["error"]["message"]
            retry = {**csrf, "Idempotency-Key": "verify-tina-1"}
            for _ in range(2):  # the retry of an answer lost: the first attempt's outcome
                status, ok, _ = await svc.request(
                    "POST",
                    "/v1/admin/auth/totp/verify",
                    session=browser,
                    headers=retry,
                    json={"code": now_code(secret)},
                )
                assert status == 200 and ok["totp_enrolled"] is True, ok
            status, err, _ = await svc.request(  # without the key: a new request
                "POST",
                "/v1/admin/auth/totp/verify",
                session=browser,
                headers=csrf,
                json={"code": now_code(secret)},
            )
            # Enrolled, nothing waits to be confirmed: the answer says so, as enrol's does.
            assert (status, err["error"]["code"]) == (409, "totp_enrolled"), err
            assert "DELETE /v1/admin/users/{id}/totp" in err["error"]["message"], err
            # A key another request used is no retry of this one: not a 200 for nothing.
            elsewhere = {"Idempotency-Key": "provision-tom-1"}
            made = {"user_name": "tom", "roles": ["member"]}
            status, _, _ = await svc.request(
                "POST", "/v1/admin/users", key, headers=elsewhere, json=made
            )
            assert status == 201
            status, err, _ = await svc.request(
                "POST",
                "/v1/admin/auth/totp/verify",
                session=browser,
                headers={**csrf, **elsewhere},
                json={"code": now_code(secret)},
            )
            assert (status, err["error"]["code"]) == (409, "idempotency_key_reused"), err

        status, err, b = await svc.login("tina", PASSWORD)
        await b.close()
        assert status == 401 and err["error"]["code"] == "unauthorized"
        assert "send totp_code" in err["error"]["message"], err
        # The code used for enrolment cannot be replayed; the next step's code works.
        code = now_code(secret, time.time() + 30)
        status, body, b = await svc.login("tina", PASSWORD, totp_code=code)
        await b.close()
        assert status == 200, body
        assert body["second_factor"] is True
        status, err, b = await svc.login("tina", PASSWORD, totp_code=code)
        await b.close()
        # Said as what it is (QA finding: "a valid TOTP code is required" left the user
        # retyping the code they had just used).
        assert status == 401 and "already used: wait for the next" in err["error"]["message"]


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


FORM = "application/x-www-form-urlencoded"


async def raw_post(svc: Running, path: str, headers: bytes, body: bytes) -> tuple[int, Any]:
    """POST exact bytes over a plain socket (no client library re-encodes the headers)."""
    url = urlsplit(svc.base)
    reader, writer = await asyncio.open_connection(url.hostname, url.port)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {url.netloc}\r\nConnection: close\r\n"
        f"Content-Length: {len(body)}\r\n"
    ).encode()
    writer.write(head + headers + b"\r\n" + body)
    await writer.drain()
    answer = await reader.read()
    writer.close()
    await writer.wait_closed()
    status_line, _, rest = answer.partition(b"\r\n")
    return int(status_line.split()[1]), orjson.loads(rest.partition(b"\r\n\r\n")[2])


def assert_oauth_error(status: int, body: Any, expected: int, error: str) -> None:
    """RFC 6749 section 5.2's shape, not the service's envelope."""
    assert status == expected, body
    assert set(body) == {"error", "error_description"}, body
    assert body["error"] == error and isinstance(body["error_description"], str)


async def test_unreadable_token_forms_are_invalid_request(database_url: str) -> None:
    """Bodies that are no form in the declared charset: 400 invalid_request, never a 500."""
    async with running(settings_for(database_url)) as svc:
        cases = {
            "invalid UTF-8": (FORM, b"grant_type=\xff\xfe&client_id=a&client_secret=b"),
            "unknown charset": (f"{FORM}; charset=bogus", b"grant_type=client_credentials"),
            "not a text charset": (f"{FORM}; charset=rot13", b"grant_type=client_credentials"),
            # An odd count of bytes: no UTF-16 text (an even one decodes, to other names).
            "undecodable in its charset": (f"{FORM}; charset=utf-16", b"grant_type=xy"),
            # A lenient codec can produce a lone surrogate, which has no UTF-8 form to query.
            "lone surrogate": (
                f"{FORM}; charset=raw_unicode_escape",
                b"grant_type=client_credentials&client_id=\\ud800&client_secret=b",
            ),
            # RFC 6749 3.2: a parameter must not be sent twice.
            "repeated parameter": (
                FORM,
                b"grant_type=client_credentials&client_id=a&client_id=a&client_secret=b",
            ),
        }
        for case, (content_type, body) in cases.items():
            status, err, headers = await svc.request(
                "POST", "/v1/oauth/token", data=body, headers={"Content-Type": content_type}
            )
            assert_oauth_error(status, err, 400, "invalid_request")
            assert headers["Cache-Control"] == "no-store", case
            if case != "repeated parameter":
                assert err["error_description"].startswith("malformed form body"), (case, err)


async def test_non_ascii_basic_credentials_are_invalid_client(database_url: str) -> None:
    async with running(settings_for(database_url)) as svc:
        form = f"Content-Type: {FORM}\r\n".encode()
        body = b"grant_type=client_credentials"
        # UTF-8 "é" (bytes that are not UTF-8 are refused for every route, gateway/security.py).
        for value in ("é".encode(), "Zm9v\u00e9OmJhcg==".encode()):
            header = b"Authorization: Basic " + value + b"\r\n"
            status, err = await raw_post(svc, "/v1/oauth/token", form + header, body)
            assert_oauth_error(status, err, 401, "invalid_client")


async def test_oauth_and_scim_refusals_are_counted_as_http_errors(database_url: str) -> None:
    """They answer in their protocols' own formats, not the envelope: brute force on the
    token endpoint or the SCIM token showed nowhere in `svc_http_errors_total`."""
    refused = HTTP_ERRORS.labels(status="401")
    before = refused._value.get()
    async with running(settings_for(database_url)) as svc:
        form = {"grant_type": "client_credentials"}
        status, _, _ = await svc.request(
            "POST", "/v1/oauth/token", data=form, headers=basic("nobody", "wrong")
        )
        assert status == 401
        status, _, _ = await svc.request(
            "GET", "/scim/v2/Users", headers={"Authorization": "Bearer not-a-token"}
        )
        assert status == 401
    assert refused._value.get() - before == 2


async def enrolled_user(svc: Running, key: str, name: str) -> tuple[str, aiohttp.ClientSession]:
    """A user with a TOTP secret pending (enrolment started, not verified): the secret and
    the user's signed-in browser (CSRF header set on every request)."""
    await svc.create_user(key, name, PASSWORD, roles=["admin"])
    status, body, browser = await svc.login(name, PASSWORD)
    assert status == 200, body
    browser.headers["X-CSRF-Token"] = body["csrf_token"]
    status, enrol, _ = await svc.request(
        "POST", "/v1/admin/auth/totp/enrol", session=browser, json={"current_password": PASSWORD}
    )
    assert status == 200, enrol
    return enrol["secret"], browser


async def confirm_enrolment(svc: Running, browser: aiohttp.ClientSession, secret: str) -> None:
    """Verify the pending enrolment with the current code of `secret`."""
    status, ok, _ = await svc.request(
        "POST", "/v1/admin/auth/totp/verify", session=browser, json={"code": now_code(secret)}
    )
    assert status == 200 and ok["totp_enrolled"] is True


NOT_ASCII_DIGITS = (
    "\u0661\u0662\u0663\u0664\u0665\u0666",
    "\uff11\uff12\uff13\uff14\uff15\uff16",
    "\u00b2" * 6,
)
"""Six Arabic-Indic, full-width and superscript digits: str.isdigit() says yes to each."""


async def test_only_ascii_digits_are_totp_codes(database_url: str) -> None:
    async with running(settings_for(database_url)) as svc:
        key = await svc.issue_key()
        secret, browser = await enrolled_user(svc, key, "uma")
        async with browser:
            for code in NOT_ASCII_DIGITS:
                status, err, _ = await svc.request(
                    "POST", "/v1/admin/auth/totp/verify", session=browser, json={"code": code}
                )
                assert status == 400, err
                assert err["error"]["code"] == "totp_mismatch"
            await confirm_enrolment(svc, browser, secret)

        # At login they are wrong codes: 401, recorded as failed logins, counted by the throttle.
        for code in NOT_ASCII_DIGITS:
            status, err, b = await svc.login("uma", PASSWORD, totp_code=code)
            await b.close()
            assert status == 401, err
            assert err["error"]["code"] == "unauthorized"
        status, audit, _ = await svc.request(
            "GET", "/v1/admin/audit?action=identity.login_failed", key
        )
        assert status == 200
        reasons = [i["detail"]["reason"] for i in audit["items"] if i["user_name"] == "uma"]
        assert reasons == ["bad_second_factor"] * len(NOT_ASCII_DIGITS)
        for _ in range(MAX_PER_ACCOUNT - len(NOT_ASCII_DIGITS)):
            status, _, b = await svc.login("uma", PASSWORD, totp_code=NOT_ASCII_DIGITS[0])
            await b.close()
            assert status == 401
        status, err, b = await svc.login(
            "uma", PASSWORD, totp_code=now_code(secret, time.time() + 30)
        )
        await b.close()
        assert status == 429 and err["error"]["code"] == "login_rate_limited"


async def test_a_failed_sign_in_to_a_workspace_that_does_not_exist_is_not_recorded(
    database_url: str,
) -> None:
    """Review finding: each failed sign-in naming a made-up workspace started an audit
    actor and recorded an event under it, so anyone could grow the log with new ids."""
    async with running(settings_for(database_url)) as svc:
        for made_up in ("nowhere-1", "nowhere-2"):
            status, err, browser = await svc.login("x", PASSWORD, workspace_id=made_up)
            await browser.close()
            assert status == 401 and err["error"]["code"] == "unauthorized", err
            stream = audit_key(made_up).stream_id
            assert await svc.app[STORE].read_stream(stream, workspace_id=made_up) == []
        status, err, browser = await svc.login("x", PASSWORD)  # the default workspace: kept
        await browser.close()
        assert status == 401
        events = await svc.app[STORE].read_stream(audit_key("default").stream_id)
        assert [e.type for e in events][-1:] == ["identity.login_failed"]


def test_non_ascii_digits_match_no_step() -> None:
    secret = base64.b32encode(b"12345678901234567890").decode()
    for code in NOT_ASCII_DIGITS:
        assert matching_step(secret, code, 59) is None


async def test_an_administrator_resets_a_users_second_factor(database_url: str) -> None:
    """A lost authenticator, or one an intruder enrolled, locked the user out for good:
    no path cleared it. An administrator removes it; the user's sessions end with it, and
    the password alone signs in until the user enrols again."""
    async with running(settings_for(database_url)) as svc:
        key = await svc.issue_key()
        secret, browser = await enrolled_user(svc, key, "lena")
        async with browser:
            await confirm_enrolment(svc, browser, secret)
            status, users, _ = await svc.request("GET", "/v1/admin/users?user_name=lena", key)
            (lena,) = users["items"]
            assert lena["totp_enrolled"] is True
            status, _, b = await svc.login("lena", PASSWORD)
            await b.close()
            assert status == 401  # the code is asked for

            totp = f"/v1/admin/users/{lena['id']}/totp"
            status, reset, _ = await svc.request("DELETE", totp, key)
            assert status == 200 and reset["totp_enrolled"] is False, reset
            status, _, _ = await svc.request("GET", "/v1/admin/auth/session", session=browser)
            assert status == 401  # the user's sessions ended with it
        status, body, b = await svc.login("lena", PASSWORD)
        async with b:
            assert status == 200 and body["second_factor"] is False, body
            # Again: nothing enrolled, nothing recorded (review finding: the user's sessions
            # were ended all the same), the same answer.
            _, audit, _ = await svc.request("GET", "/v1/admin/audit", key)
            status, again, _ = await svc.request("DELETE", totp, key)
            assert status == 200 and again["totp_enrolled"] is False
            assert (await svc.request("GET", "/v1/admin/auth/session", session=b))[0] == 200
            _, audit_after, _ = await svc.request("GET", "/v1/admin/audit", key)
            assert audit_after["items"] == audit["items"]


async def test_oauth_clients_are_listed_without_their_secrets(database_url: str) -> None:
    """QA finding: a client could be registered and revoked, not listed: its id had to be
    dug out of the audit log."""
    async with running(settings_for(database_url)) as svc:
        key = await svc.issue_key()
        made = []
        for name in ("ci-deploy", "ci-reports"):
            body = {"name": name, "scopes": ["admin:read"]}
            status, client, _ = await svc.request("POST", "/v1/admin/oauth/clients", key, json=body)
            assert status == 201, client
            made.append(client)
        path = f"/v1/admin/oauth/clients/{made[0]['client_id']}"
        assert (await svc.request("DELETE", path, key))[0] == 204
        reader = await svc.issue_key(scopes=("admin:read",))
        status, page, _ = await svc.request("GET", "/v1/admin/oauth/clients", reader)
        assert status == 200, page
        assert [(c["name"], c["revoked_at"]) for c in page["items"]] == [("ci-reports", None)]
        assert page["total"] == 1 and page["items"][0]["scopes"] == ["admin:read"]
        status, page, _ = await svc.request(
            "GET", "/v1/admin/oauth/clients?include_revoked=true", reader
        )
        assert [c["name"] for c in page["items"]] == ["ci-reports", "ci-deploy"], page
        assert page["items"][1]["revoked_at"] is not None
        listed = json.dumps(page)
        assert all(c["client_secret"] not in listed for c in made)
        assert "secret" not in listed
        status, refused, _ = await svc.request("GET", "/v1/admin/oauth/clients?limt=5", reader)
        assert status == 400 and "did you mean limit?" in refused["error"]["message"]
