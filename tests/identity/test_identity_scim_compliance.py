"""The scim2-tester compliance checker against the running server: every check that applies
(Users; this server has no Groups, bulk, sort or etags) must pass."""

from __future__ import annotations

import asyncio

import pytest
from identity_support import running, settings_for

pytest.importorskip("scim2_tester")

from httpx2 import Client
from scim2_client.engines.httpx2 import SyncSCIMClient
from scim2_tester import Status, check_server

pytestmark = [pytest.mark.filterwarnings("ignore::asyncpg.InterfaceWarning")]

FAILING = {Status.ERROR, Status.CRITICAL}


def run_checker(base: str, token: str) -> list[str]:
    # Not httpx's 5 s default: a write waits up to 5 s for the identity read model under
    # load, and the checker reports a client timeout as a failed check.
    http = Client(
        base_url=f"{base}/scim/v2", headers={"Authorization": f"Bearer {token}"}, timeout=60.0
    )
    with http:
        results = check_server(SyncSCIMClient(http), resource_types=["User"])
    lines = [f"{r.status.name} {r.title}: {r.reason}" for r in results]
    print("\n".join(lines))
    return [line for r, line in zip(results, lines, strict=True) if r.status in FAILING]


async def test_scim2_tester_passes(database_url: str) -> None:
    async with running(settings_for(database_url)) as svc:
        key = await svc.issue_key()
        status, body, _ = await svc.request("POST", "/v1/admin/scim/token", key)
        assert status == 201
        failures = await asyncio.to_thread(run_checker, svc.base, body["token"])
        assert failures == []
