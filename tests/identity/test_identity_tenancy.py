"""Workspace isolation of identity (users, SCIM, audit, sessions), audit retention, and no
secret in any log line of a full login / SCIM / OAuth round."""

from __future__ import annotations

import logging

import pytest
from identity_support import WHOAMI, running, settings_for

from gateway.identity.service import IDENTITY
from projections.identity_queries import list_users, prune_audit

pytestmark = [pytest.mark.filterwarnings("ignore::asyncpg.InterfaceWarning")]

PASSWORD = "correct horse battery staple"


async def test_workspaces_do_not_see_each_other(database_url: str) -> None:
    async with running(settings_for(database_url)) as svc:
        key_a = await svc.issue_key("ws-a")
        key_b = await svc.issue_key("ws-b")
        user_a = await svc.create_user(key_a, "same-name", PASSWORD, roles=["admin"])
        user_b = await svc.create_user(key_b, "same-name", "another password!", roles=["member"])
        assert user_a["id"] != user_b["id"]

        _, listed, _ = await svc.request("GET", "/v1/admin/users", key_a)
        assert [u["id"] for u in listed["items"]] == [user_a["id"]]
        assert (await svc.request("GET", f"/v1/admin/users/{user_b['id']}", key_a))[0] == 404
        status, _, _ = await svc.request(
            "PATCH", f"/v1/admin/users/{user_b['id']}", key_a, json={"active": False}
        )
        assert status == 404

        _, token_a, _ = await svc.request("POST", "/v1/admin/scim/token", key_a)
        _, scim, _ = await svc.request("GET", "/scim/v2/Users", token_a["token"])
        assert [r["id"] for r in scim["Resources"]] == [user_a["id"]]
        status, _, _ = await svc.request("GET", f"/scim/v2/Users/{user_b['id']}", token_a["token"])
        assert status == 404

        status, _body, browser = await svc.login("same-name", PASSWORD, workspace_id="ws-a")
        async with browser:
            assert status == 200
            _, who, _ = await svc.request("GET", WHOAMI, session=browser)
            assert who["workspace_id"] == "ws-a"
        status, _, browser = await svc.login("same-name", PASSWORD, workspace_id="ws-b")
        await browser.close()
        assert status == 401

        _, audit_b, _ = await svc.request("GET", "/v1/admin/audit", key_b)
        assert all(i["user_id"] != user_a["id"] for i in audit_b["items"])
        # The read model itself: a scoped read of B sees only B's users.
        users, total = await list_users(svc.app[IDENTITY].db, "ws-b")
        assert total == 1 and users[0].user_id == user_b["id"]


async def test_only_the_default_workspace_manages_instance_secrets_and_settings(
    database_url: str,
) -> None:
    """The LDAP bind password, the SAML key and the settings serve every workspace: an owner
    of another workspace must not be able to change them."""
    async with running(settings_for(database_url)) as svc:
        tenant = await svc.issue_key("ws-tenant")
        owner = await svc.issue_key()  # the default workspace's
        secret = "/v1/admin/identity/secrets/ldap/bind_password"
        status, body, _ = await svc.request("PUT", secret, tenant, json={"value": "tenant-pw"})
        assert status == 403 and body["error"]["code"] == "instance_admin_required"
        assert "'default' workspace" in body["error"]["message"]
        for method, path, payload in (
            ("GET", "/v1/admin/settings", None),
            ("PUT", "/v1/admin/settings/SVC_LOG_LEVEL", {"value": "debug"}),
        ):
            status, body, _ = await svc.request(method, path, tenant, json=payload)
            assert status == 403 and body["error"]["code"] == "instance_admin_required"
        status, _, _ = await svc.request("PUT", secret, owner, json={"value": "owner-pw"})
        assert status == 204
        # On record, who set which one, never its value (review finding: no trace at all);
        # the refused attempt is not.
        _, audit, _ = await svc.request(
            "GET", "/v1/admin/audit?action=identity.sso_secret_set", owner
        )
        (entry,) = audit["items"]
        assert (entry["detail"]["scope"], entry["detail"]["name"]) == ("ldap", "bind_password")
        assert entry["detail"]["by"].startswith("key:"), entry
        assert "owner-pw" not in str(audit)


async def test_audit_retention(database_url: str) -> None:
    async with running(settings_for(database_url, SVC_AUDIT_RETENTION_DAYS="30")) as svc:
        key = await svc.issue_key()
        for n in range(5):
            await svc.create_user(key, f"old-timer-{n}", PASSWORD)
        db = svc.app[IDENTITY].db
        async with db.acquire() as conn:
            await conn.execute(
                "UPDATE identity_audit_log SET at = at - interval '40 days' "
                "WHERE action = 'identity.user_provisioned'"
            )
        assert await prune_audit(db, 0) == 0
        # A few rows a transaction (a long one would hold back every reader of the log).
        assert await prune_audit(db, 30, batch=2) == 5
        assert await prune_audit(db, 30, batch=2) == 0
        _, audit, _ = await svc.request("GET", "/v1/admin/audit", key)
        actions = [i["action"] for i in audit["items"]]
        assert "identity.user_provisioned" not in actions
        assert "identity.password_set" in actions


async def test_no_secret_in_any_log_line(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    secrets: list[str] = [PASSWORD, "wrong password here"]
    async with running(settings_for(database_url)) as svc:
        key = await svc.issue_key()
        secrets.append(key)
        await svc.create_user(key, "logged", PASSWORD, roles=["admin"])
        _status, body, browser = await svc.login("logged", PASSWORD)
        async with browser:
            secrets += [body["csrf_token"]]
            secrets += [c.value for c in browser.cookie_jar if c.key == "svc_session"]
        _, _, b = await svc.login("logged", "wrong password here")
        await b.close()
        _, scim, _ = await svc.request("POST", "/v1/admin/scim/token", key)
        secrets.append(scim["token"])
        await svc.request("GET", "/scim/v2/Users", scim["token"])
        _, client, _ = await svc.request(
            "POST", "/v1/admin/oauth/clients", key, json={"name": "c", "scopes": ["admin:read"]}
        )
        secrets.append(client["client_secret"])
        await svc.request("GET", WHOAMI, "svc_" + "x" * 40)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert caplog.records
    for secret in secrets:
        assert secret not in text
