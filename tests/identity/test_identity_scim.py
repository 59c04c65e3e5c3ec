"""SCIM 2.0: the tenant token (issue, rotate, revoke, shown once), Users CRUD and PATCH, filters,
pagination, discovery documents, SCIM error format, and deprovisioning that ends access at once."""

from __future__ import annotations

from typing import Any

import pytest
from identity_support import WHOAMI, Running, running, settings_for

from gateway.identity.service import IDENTITY
from gateway.state import DATABASE

pytestmark = [pytest.mark.filterwarnings("ignore::asyncpg.InterfaceWarning")]

USER = "urn:ietf:params:scim:schemas:core:2.0:User"
ERROR = "urn:ietf:params:scim:api:messages:2.0:Error"
PATCH = "urn:ietf:params:scim:api:messages:2.0:PatchOp"
LIST = "urn:ietf:params:scim:api:messages:2.0:ListResponse"


async def scim_token(svc: Running, key: str, action: str = "issue") -> Any:
    status, body, headers = await svc.request(
        "POST", "/v1/admin/scim/token", key, json={"action": action}
    )
    assert status in (200, 201), body
    if action != "revoke":
        assert headers["Cache-Control"] == "no-store"
    return body


def scim_user(user_name: str, **extra: Any) -> dict[str, Any]:
    return {"schemas": [USER], "userName": user_name, **extra}


async def test_token_issue_rotate_revoke(database_url: str) -> None:
    async with running(settings_for(database_url)) as svc:
        key = await svc.issue_key()
        first = (await scim_token(svc, key))["token"]
        status, body, headers = await svc.request("GET", "/scim/v2/Users", first)
        assert status == 200 and body["schemas"] == [LIST]
        assert headers["Content-Type"].startswith("application/scim+json")

        second = (await scim_token(svc, key, "rotate"))["token"]
        assert second != first
        status, body, _ = await svc.request("GET", "/scim/v2/Users", first)
        assert status == 401 and body["schemas"] == [ERROR] and body["status"] == "401"
        assert first not in str(body)
        assert (await svc.request("GET", "/scim/v2/Users", second))[0] == 200

        await scim_token(svc, key, "revoke")
        assert (await svc.request("GET", "/scim/v2/Users", second))[0] == 401
        assert (await svc.request("GET", "/scim/v2/Users"))[0] == 401
        # An API key is not a SCIM token, and the token is not an API key.
        assert (await svc.request("GET", "/scim/v2/Users", key))[0] == 401
        reader = await svc.issue_key(scopes=["admin:read"])
        status, body, _ = await svc.request("POST", "/v1/admin/scim/token", reader)
        assert status == 403 and body["error"]["type"] == "permission_error"


async def test_users_crud_patch_and_errors(database_url: str) -> None:
    async with running(settings_for(database_url)) as svc:
        token = (await scim_token(svc, await svc.issue_key()))["token"]
        new = scim_user(
            "jdoe@example.com",
            name={"givenName": "Jane", "familyName": "Doe"},
            emails=[{"value": "jdoe@example.com", "primary": True, "type": "work"}],
            externalId="ext-1",
            active=True,
        )
        status, created, headers = await svc.request("POST", "/scim/v2/Users", token, json=new)
        assert status == 201, created
        uid = created["id"]
        assert headers["Location"].endswith(f"/scim/v2/Users/{uid}")
        assert created["meta"]["resourceType"] == "User"
        assert created["name"] == {"givenName": "Jane", "familyName": "Doe"}

        status, err, _ = await svc.request(
            "POST", "/scim/v2/Users", token, json=scim_user("JDOE@example.com")
        )
        assert status == 409 and err["scimType"] == "uniqueness" and err["schemas"] == [ERROR]

        status, err, _ = await svc.request(
            "POST", "/scim/v2/Users", token, json={"schemas": [USER]}
        )
        assert status == 400 and err["schemas"] == [ERROR]

        status, got, _ = await svc.request("GET", f"/scim/v2/Users/{uid}", token)
        assert status == 200 and got["userName"] == "jdoe@example.com"

        replaced = scim_user("jane@example.com", displayName="Jane D", active=True)
        status, put, _ = await svc.request("PUT", f"/scim/v2/Users/{uid}", token, json=replaced)
        assert status == 200 and put["userName"] == "jane@example.com"
        assert put["displayName"] == "Jane D" and "name" not in put

        patch = {
            "schemas": [PATCH],
            "Operations": [
                {"op": "Replace", "path": "name.givenName", "value": "Janet"},
                {"op": "add", "value": {"displayName": "Janet D"}},
                {"op": "replace", "path": "active", "value": "False"},
            ],
        }
        status, patched, _ = await svc.request("PATCH", f"/scim/v2/Users/{uid}", token, json=patch)
        assert status == 200, patched
        assert patched["name"]["givenName"] == "Janet"
        assert patched["displayName"] == "Janet D"
        assert patched["active"] is False

        bad = {"schemas": [PATCH], "Operations": [{"op": "remove", "path": "userName"}]}
        status, err, _ = await svc.request("PATCH", f"/scim/v2/Users/{uid}", token, json=bad)
        assert status == 400 and err["schemas"] == [ERROR]

        status, _, _ = await svc.request("DELETE", f"/scim/v2/Users/{uid}", token)
        assert status == 204
        status, err, _ = await svc.request("GET", f"/scim/v2/Users/{uid}", token)
        assert status == 404 and err["schemas"] == [ERROR] and err["status"] == "404"
        status, err, _ = await svc.request("DELETE", f"/scim/v2/Users/{uid}", token)
        assert status == 404


async def test_filter_and_pagination(database_url: str) -> None:
    async with running(settings_for(database_url)) as svc:
        token = (await scim_token(svc, await svc.issue_key()))["token"]
        for i in range(7):
            status, _, _ = await svc.request(
                "POST", "/scim/v2/Users", token, json=scim_user(f"user{i}@example.com")
            )
            assert status == 201
        status, page, _ = await svc.request("GET", "/scim/v2/Users?startIndex=3&count=2", token)
        assert status == 200
        assert page["totalResults"] == 7 and page["startIndex"] == 3
        assert page["itemsPerPage"] == 2
        assert [r["userName"] for r in page["Resources"]] == [
            "user2@example.com",
            "user3@example.com",
        ]
        status, page, _ = await svc.request("GET", "/scim/v2/Users?startIndex=7&count=5", token)
        assert [r["userName"] for r in page["Resources"]] == ["user6@example.com"]
        status, page, _ = await svc.request("GET", "/scim/v2/Users?count=0", token)
        assert page["totalResults"] == 7 and page["Resources"] == []

        status, found, _ = await svc.request(
            "GET", '/scim/v2/Users?filter=userName eq "USER4@example.com"', token
        )
        assert status == 200 and found["totalResults"] == 1
        assert found["Resources"][0]["userName"] == "user4@example.com"
        status, none, _ = await svc.request(
            "GET", '/scim/v2/Users?filter=userName eq "nobody"', token
        )
        assert none["totalResults"] == 0 and none["Resources"] == []
        status, err, _ = await svc.request("GET", '/scim/v2/Users?filter=userName co "user"', token)
        assert status == 400 and err["scimType"] == "invalidFilter"


async def test_discovery_documents(database_url: str) -> None:
    async with running(settings_for(database_url)) as svc:
        token = (await scim_token(svc, await svc.issue_key()))["token"]
        status, spc, _ = await svc.request("GET", "/scim/v2/ServiceProviderConfig", token)
        assert status == 200 and spc["patch"]["supported"] is True
        assert spc["filter"]["supported"] is True
        status, types, _ = await svc.request("GET", "/scim/v2/ResourceTypes", token)
        assert [t["id"] for t in types["Resources"]] == ["User"]
        status, schemas, _ = await svc.request("GET", "/scim/v2/Schemas", token)
        assert schemas["Resources"][0]["id"] == USER
        status, one, _ = await svc.request("GET", f"/scim/v2/Schemas/{USER}", token)
        assert status == 200 and one["name"] == "User"


async def test_deprovisioned_user_loses_sessions_at_once(database_url: str) -> None:
    async with running(settings_for(database_url)) as svc:
        key = await svc.issue_key()
        token = (await scim_token(svc, key))["token"]
        body = scim_user("sam@example.com", password="s3cret password", active=True)
        status, created, _ = await svc.request("POST", "/scim/v2/Users", token, json=body)
        assert status == 201
        assert "password" not in created
        status, _, _ = await svc.request(
            "POST", f"/v1/admin/users/{created['id']}/roles", key, json={"role": "admin"}
        )
        assert status == 200
        status, login, browser = await svc.login("sam@example.com", "s3cret password")
        async with browser:
            assert status == 200, login
            assert (await svc.request("GET", WHOAMI, session=browser))[0] == 200
            deactivate = {
                "schemas": [PATCH],
                "Operations": [{"op": "replace", "value": {"active": False}}],
            }
            status, _, _ = await svc.request(
                "PATCH", f"/scim/v2/Users/{created['id']}", token, json=deactivate
            )
            assert status == 200
            status, err, _ = await svc.request("GET", WHOAMI, session=browser)
            assert status == 401 and err["error"]["code"] == "unauthorized"
        status, _, browser = await svc.login("sam@example.com", "s3cret password")
        await browser.close()
        assert status == 401
        status, _, _ = await svc.request("DELETE", f"/scim/v2/Users/{created['id']}", token)
        assert status == 204
        status, audit, _ = await svc.request("GET", "/v1/admin/audit", key)
        actions = {i["action"] for i in audit["items"]}
        gone = next(i for i in audit["items"] if i["action"] == "identity.user_deprovisioned")
        assert gone["detail"]["by"].startswith("scim:")
        assert {"identity.user_deprovisioned", "identity.scim_token_issued"} <= actions
        assert "s3cret" not in str(audit)


async def test_deprovisioning_revokes_the_users_api_keys(database_url: str) -> None:
    async with running(settings_for(database_url)) as svc:
        admin_key = await svc.issue_key()
        token = (await scim_token(svc, admin_key))["token"]
        status, created, _ = await svc.request(
            "POST", "/scim/v2/Users", token, json=scim_user("kay@example.com")
        )
        assert status == 201
        issued = await svc.issue_user_key(admin_key, created["id"], ["chat"])
        personal = issued["key"]
        status, who, _ = await svc.request("GET", WHOAMI, personal)
        assert status == 200 and who["scopes"] == ["chat"]

        status, _, _ = await svc.request("DELETE", f"/scim/v2/Users/{created['id']}", token)
        assert status == 204
        status, err, _ = await svc.request("GET", WHOAMI, personal)
        assert status == 401 and err["error"]["code"] == "unauthorized"
        status, keys, _ = await svc.request("GET", "/v1/admin/apikeys", admin_key)
        revoked = [k for k in keys["api_keys"] if k["id"] == issued["key_id"]]
        assert revoked and revoked[0]["revoked_at"] is not None
        # Other keys are untouched.
        assert (await svc.request("GET", WHOAMI, admin_key))[0] == 200


async def test_a_user_key_is_refused_once_its_owner_is_inactive_even_while_cached(
    database_url: str,
) -> None:
    """The owner check runs on every request of a user's key, even while the key's own record
    sits in the key cache: here the user row turns inactive the way another gateway process's
    projection would write it, with no revocation through this process."""
    async with running(settings_for(database_url)) as svc:
        admin_key = await svc.issue_key()
        token = (await scim_token(svc, admin_key))["token"]
        _, created, _ = await svc.request(
            "POST", "/scim/v2/Users", token, json=scim_user("lee@example.com")
        )
        issued = await svc.issue_user_key(admin_key, created["id"], ["admin:read"])
        personal = issued["key"]
        assert (await svc.request("GET", WHOAMI, personal))[0] == 200
        assert (await svc.request("GET", WHOAMI, admin_key))[0] == 200
        unowned = svc.app[IDENTITY].unowned_keys
        # The workspace key, seen to belong to no user, skips the owner check from now on;
        # the user's key is checked on every request.
        assert len(unowned) == 1 and issued["key_id"] not in unowned

        async with svc.app[DATABASE].acquire() as conn:
            await conn.execute(
                "UPDATE identity_users SET active = false WHERE user_id = $1", created["id"]
            )
        status, err, _ = await svc.request("GET", WHOAMI, personal)
        assert status == 401 and err["error"]["code"] == "unauthorized"
        assert (await svc.request("GET", WHOAMI, admin_key))[0] == 200
