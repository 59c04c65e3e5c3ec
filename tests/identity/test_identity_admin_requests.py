"""What the identity admin routes, SCIM and the OAuth token endpoint refuse of a request's
form rather than its content: unknown query parameters, a body where none is taken, and two
Authorization headers (docs/admin-api.md: a typo is not ignored). Real HTTP on loopback."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest
from identity_support import Running, running, settings_for, uid
from multidict import CIMultiDict

pytestmark = [pytest.mark.filterwarnings("ignore::asyncpg.InterfaceWarning")]

ADMIN = "/v1/admin"


async def _fixtures(svc: Running, key: str) -> dict[str, str]:
    """A user with a role bound, a custom role and an OAuth client, to aim the routes at."""
    user = await svc.create_user(key, uid("u-"), roles=["member"])
    role = {"name": uid("r-"), "permissions": {"users": "read"}}
    status, body, _ = await svc.request("POST", f"{ADMIN}/roles", key, json=role)
    assert status == 201, body
    client = {"name": "ci", "scopes": ["admin:read"]}
    status, body, _ = await svc.request("POST", f"{ADMIN}/oauth/clients", key, json=client)
    assert status == 201, body
    return {"user": user["id"], "client": body["client_id"], "secret": body["client_secret"]}


def _routes(ids: dict[str, str]) -> list[tuple[str, str, dict[str, Any] | None]]:
    """Every identity admin route that takes no query parameter, with a body it accepts."""
    user = f"{ADMIN}/users/{ids['user']}"
    return [
        ("POST", f"{ADMIN}/users", {"user_name": uid("u-")}),
        ("GET", user, None),
        ("PATCH", user, {"display_name": "Renamed"}),
        ("DELETE", user, None),
        ("PUT", f"{user}/password", {"password": "correct-horse-battery-9"}),
        ("POST", f"{user}/roles", {"role": "operator"}),
        ("DELETE", f"{user}/roles/member", None),
        ("POST", f"{user}/apikeys", {"name": "k", "scopes": ["chat"]}),
        ("GET", f"{ADMIN}/roles", None),
        ("POST", f"{ADMIN}/roles", {"name": uid("r-"), "permissions": {"users": "read"}}),
        ("POST", f"{ADMIN}/scim/token", {"action": "issue"}),
        ("PUT", f"{ADMIN}/identity/secrets/ldap/bind_password", {"value": "s3cret"}),
        ("POST", f"{ADMIN}/oauth/clients", {"name": "ci2", "scopes": ["chat"]}),
        ("DELETE", f"{ADMIN}/oauth/clients/{ids['client']}", None),
    ]


async def test_unknown_query_parameters_are_refused_and_nothing_is_done(
    database_url: str,
) -> None:
    """A typo (`?dry_run=1`, `?cascade=1`) was ignored and the write went ahead."""
    async with running(settings_for(database_url)) as svc:
        key = await svc.issue_key()
        ids = await _fixtures(svc, key)
        for method, path, body in _routes(ids):
            status, answer, _ = await svc.request(method, path + "?dry_run=1", key, json=body)
            assert status == 400, (method, path, answer)
            assert answer["error"]["code"] == "invalid_request", (method, path, answer)
            assert "dry_run" in answer["error"]["message"], (method, path, answer)
        # Refused before acting: the user stands with its role, the client still issues.
        status, user, _ = await svc.request("GET", f"{ADMIN}/users/{ids['user']}", key)
        assert status == 200 and user["roles"] == ["member"], user
        assert user["display_name"] is None
        assert await _token_status(svc, ids["client"], ids["secret"]) == 200
        # The routes that read their query with a model still do.
        for path in (f"{ADMIN}/users?limit=1", f"{ADMIN}/audit?limit=1"):
            assert (await svc.request("GET", path, key))[0] == 200, path
            assert (await svc.request("GET", path + "&dry_run=1", key))[0] == 400, path


async def test_a_body_sent_to_a_delete_is_refused_and_nothing_is_done(database_url: str) -> None:
    """A client sending fields it expects to act (a reason) must not believe they did."""
    async with running(settings_for(database_url)) as svc:
        key = await svc.issue_key()
        ids = await _fixtures(svc, key)
        user = f"{ADMIN}/users/{ids['user']}"
        client = f"{ADMIN}/oauth/clients/{ids['client']}"
        for path in (user, f"{user}/roles/member", client):
            status, answer, _ = await svc.request("DELETE", path, key, json={"reason": "x"})
            assert status == 400, (path, answer)
            assert "takes no body" in answer["error"]["message"], (path, answer)
        status, found, _ = await svc.request("GET", user, key)
        assert status == 200 and found["roles"] == ["member"], found
        assert await _token_status(svc, ids["client"], ids["secret"]) == 200
        for path in (f"{user}/roles/member", client, user):  # without a body, each goes ahead
            status, answer, _ = await svc.request("DELETE", path, key)
            assert status in (200, 204), (path, answer)


async def _token_status(svc: Running, client_id: str, secret: str) -> int:
    form = {"grant_type": "client_credentials"}
    auth = {"Authorization": aiohttp.encode_basic_auth(client_id, secret)}
    return (await svc.request("POST", "/v1/oauth/token", data=form, headers=auth))[0]


async def test_two_authorization_headers_are_a_401_on_scim_and_the_token_endpoint(
    database_url: str,
) -> None:
    """Of two, the first silently won: a proxy adding its own in front of a client's."""
    async with running(settings_for(database_url)) as svc:
        key = await svc.issue_key()
        ids = await _fixtures(svc, key)
        status, issued, _ = await svc.request("POST", f"{ADMIN}/scim/token", key)
        assert status == 201, issued
        scim = f"Bearer {issued['token']}"
        for headers in ([scim, scim], [scim, "Bearer other"]):
            sent = CIMultiDict(("Authorization", value) for value in headers)
            async with svc.http.get(svc.url("/scim/v2/Users"), headers=sent) as resp:
                body = await resp.json(content_type=None)
            assert resp.status == 401, body
            assert body["status"] == "401" and "one Authorization header" in body["detail"]
        basic = aiohttp.encode_basic_auth(ids["client"], ids["secret"])
        for headers in ([basic, basic], [basic, "Basic b3RoZXI6b3RoZXI="]):
            sent = CIMultiDict(("Authorization", value) for value in headers)
            form = {"grant_type": "client_credentials"}
            async with svc.http.post(svc.url("/v1/oauth/token"), data=form, headers=sent) as resp:
                body = await resp.json()
            assert resp.status == 401, body
            assert body["error"] == "invalid_client", body
            assert "one Authorization header" in body["error_description"]
        # One header each: both work.
        assert (await svc.request("GET", "/scim/v2/Users", issued["token"]))[0] == 200
        assert await _token_status(svc, ids["client"], ids["secret"]) == 200


async def test_a_users_key_is_held_to_a_workspace_keys_name_and_limit_rules(
    database_url: str,
) -> None:
    """Review finding: `POST /v1/admin/apikeys` refuses these, and both kinds of key are
    listed together, yet a user's key took a control character in its name and a boolean
    or a string for its limit (`true` became 1 request a minute)."""
    async with running(settings_for(database_url)) as svc:
        key = await svc.issue_key()
        ids = await _fixtures(svc, key)
        path = f"{ADMIN}/users/{ids['user']}/apikeys"
        for body in (
            {"name": " n\u0007", "scopes": ["chat"]},
            {"name": " padded ", "scopes": ["chat"]},
            {"name": "k", "scopes": ["chat"], "rate_limit_rpm": True},
            {"name": "k", "scopes": ["chat"], "rate_limit_rpm": "7"},
        ):
            status, answer, _ = await svc.request("POST", path, key, json=body)
            assert status == 400, (body, answer)
            assert answer["error"]["code"] == "invalid_request", (body, answer)
        good = {"name": "k", "scopes": ["chat"], "rate_limit_rpm": 7}
        assert (await svc.request("POST", path, key, json=good))[0] == 201
