"""Sessions and domain roles on the platform's own admin endpoints (not only identity's):
gateway.auth.authenticate delegates to the identity resolver, and gateway/admin_common.py
checks read/write per resource domain for keys and sessions alike."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest
from identity_support import running, settings_for

from projections.identity import IdentityProjector

pytestmark = [pytest.mark.filterwarnings("ignore::asyncpg.InterfaceWarning")]

PASSWORD = "correct horse battery staple"


async def test_sessions_on_existing_admin_endpoints(database_url: str) -> None:
    async with running(settings_for(database_url)) as svc:
        key = await svc.issue_key()
        await svc.create_user(key, "boss", PASSWORD, roles=["admin"])
        await svc.create_user(key, "reader", PASSWORD, roles=["member"])
        new_key = {"name": "from a session", "scopes": ["admin:read"]}

        status, body, browser = await svc.login("boss", PASSWORD)
        async with browser:
            csrf = {"X-CSRF-Token": body["csrf_token"]}
            assert (await svc.request("GET", "/v1/admin/overview", session=browser))[0] == 200
            status, issued, _ = await svc.request(
                "POST", "/v1/admin/apikeys", session=browser, headers=csrf, json=new_key
            )
            assert status in (200, 201), issued
            status, err, _ = await svc.request(
                "POST", "/v1/admin/apikeys", session=browser, json=new_key
            )
            assert status == 403 and err["error"]["code"] == "csrf_failed"

        status, body, browser = await svc.login("reader", PASSWORD)
        async with browser:
            csrf = {"X-CSRF-Token": body["csrf_token"]}
            assert (await svc.request("GET", "/v1/admin/overview", session=browser))[0] == 200
            status, err, _ = await svc.request(
                "POST", "/v1/admin/apikeys", session=browser, headers=csrf, json=new_key
            )
            assert status == 403 and err["error"]["type"] == "permission_error"
        # Keys behave as before.
        assert (await svc.request("GET", "/v1/admin/overview", key))[0] == 200
        assert (await svc.request("GET", "/v1/admin/overview"))[0] == 401


async def test_domain_roles_on_existing_admin_endpoints(database_url: str) -> None:
    async with running(settings_for(database_url)) as svc:
        key = await svc.issue_key()
        await svc.create_user(key, "otto", PASSWORD, roles=["operator"])
        status, body, browser = await svc.login("otto", PASSWORD)
        async with browser:
            csrf = {"X-CSRF-Token": body["csrf_token"]}
            assert (await svc.request("GET", "/v1/admin/conversations", session=browser))[0] == 200
            status, _, _ = await svc.request(
                "POST",
                "/v1/admin/apikeys",
                session=browser,
                headers=csrf,
                json={"name": "x", "scopes": ["*"]},
            )
            assert status == 403


async def test_a_gateway_serves_only_once_its_identity_model_is_current(database_url: str) -> None:
    """Migration 0170 empties the identity read model for the projector to build again from
    the log. Credentials are checked against it: a gateway that served meanwhile refused
    every sign-in (and took users' keys for keys of no user)."""
    async with running(settings_for(database_url)) as svc:
        key = await svc.issue_key()
        await svc.create_user(key, "rosa", PASSWORD, roles=["member"])
    admin = await asyncpg.connect(database_url)
    try:
        tables = [name for name in IdentityProjector.tables]
        await admin.execute(
            "".join(f"DELETE FROM {table}; " for table in tables)
            + "UPDATE projection_checkpoints SET tx = '0', position = 0 WHERE name = 'identity'"
        )
        # The projector can read but not write until this lets go, a second from now.
        held = admin.transaction()
        await held.start()
        await admin.execute("LOCK TABLE identity_users IN EXCLUSIVE MODE")
        release = asyncio.get_running_loop().call_later(
            1.0, lambda: asyncio.ensure_future(held.rollback())
        )
        async with running(settings_for(database_url)) as svc:
            status, body, browser = await svc.login("rosa", PASSWORD)
            await browser.close()
            assert status == 200, body
        release.cancel()
    finally:
        await admin.close()
