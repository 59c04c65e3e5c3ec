"""Every JSON body an identity route answers with matches the model its OpenAPI description
names for its status (gateway/identity/routes.py RESPONSES and OTHER_RESPONSES,
schemas/identity_api.py): the models forbid unknown fields, so a field added to a handler
and not to its model, or the other way round, fails here."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from identity_support import running, settings_for

from gateway.identity.routes import OTHER_RESPONSES, RESPONSES, ROUTE_DOCS
from gateway.identity.totp import now_code

pytestmark = [pytest.mark.filterwarnings("ignore::asyncpg.InterfaceWarning")]

ADMIN = "/v1/admin"
PASSWORD = "correct horse battery staple"


DOCUMENTED = {
    **{(m, p, status): RESPONSES[(m, p)] for m, p, *_, status in ROUTE_DOCS if (m, p) in RESPONSES},
    **{(m, p, s): model for (m, p), others in OTHER_RESPONSES.items() for s, model in others},
}
"""(method, route template, status) -> the documented body."""


class Checked:
    """Validates each answer against the documented model of its route and status."""

    def __init__(self) -> None:
        self.answers: set[tuple[str, str, int]] = set()

    def __call__(self, method: str, template: str, status: int, body: Any) -> Any:
        model = DOCUMENTED.get((method, template, status))
        assert model is not None, (method, template, status, body)
        model.model_validate(body)
        self.answers.add((method, template, status))
        return body


async def test_every_documented_identity_body_is_what_the_route_answers(
    database_url: str,
) -> None:
    check = Checked()
    async with running(settings_for(database_url)) as svc:
        key = await svc.issue_key()

        async def call(method: str, template: str, path: str | None = None, **kw: Any) -> Any:
            status, body, _ = await svc.request(method, path or template, key, **kw)
            return check(method, template, status, body)

        users = f"{ADMIN}/users"
        body = {"user_name": "rita", "password": PASSWORD, "roles": ["admin"]}
        rita = (await call("POST", users, json=body))["id"]
        one = f"{users}/{{id}}"
        await call("GET", users)
        await call("GET", one, f"{users}/{rita}")
        emails = [{"value": "rita@example.com", "primary": True, "type": "work"}]
        patch = {"display_name": "Rita R.", "emails": emails}
        patched = await call("PATCH", one, f"{users}/{rita}", json=patch)
        assert patched["display_name"] == "Rita R." and patched["emails"] == emails
        role = {"name": "auditor", "permissions": {"audit": "read"}}
        await call("POST", f"{ADMIN}/roles", json=role)
        await call("GET", f"{ADMIN}/roles")
        await call("POST", f"{one}/roles", f"{users}/{rita}/roles", json={"role": "auditor"})
        await call("DELETE", f"{one}/roles/{{role}}", f"{users}/{rita}/roles/auditor")
        issued = {"name": "ci", "scopes": ["admin:read"]}
        await call("POST", f"{one}/apikeys", f"{users}/{rita}/apikeys", json=issued)
        await call("POST", f"{ADMIN}/scim/token", json={"action": "issue"})
        await call("POST", f"{ADMIN}/scim/token", json={"action": "revoke"})
        client = {"name": "etl", "scopes": ["admin:read"]}
        await call("POST", f"{ADMIN}/oauth/clients", json=client)
        await call("GET", f"{ADMIN}/oauth/clients")

        status, session, browser = await svc.login("rita", PASSWORD)
        async with browser:
            check("POST", f"{ADMIN}/auth/login", status, session)
            csrf = {"X-CSRF-Token": session["csrf_token"]}

            async def in_session(method: str, template: str, **kw: Any) -> Any:
                status, body, _ = await svc.request(
                    method, template, session=browser, headers=csrf, **kw
                )
                return check(method, template, status, body)

            assert (await in_session("GET", f"{ADMIN}/auth/session"))["auth"] == "session"
            enrol = await in_session(
                "POST", f"{ADMIN}/auth/totp/enrol", json={"current_password": PASSWORD}
            )
            code = {"code": now_code(enrol["secret"])}
            await in_session("POST", f"{ADMIN}/auth/totp/verify", json=code)
            await in_session("POST", f"{ADMIN}/auth/logout")
        reset = await call("DELETE", f"{one}/totp", f"{users}/{rita}/totp")
        assert reset["totp_enrolled"] is False

        await call("GET", f"{ADMIN}/audit")
        assert (await call("GET", f"{ADMIN}/auth/session"))["auth"] == "api_key"

    assert check.answers == set(DOCUMENTED)


async def test_two_primary_emails_are_refused_by_the_admin_api_as_by_scim(
    database_url: str,
) -> None:
    """QA finding: the admin API took two primary addresses, and SCIM then served both as
    primary, which RFC 7643 section 2.4 forbids."""
    async with running(settings_for(database_url)) as svc:
        key = await svc.issue_key()
        body = {"user_name": "pat", "password": PASSWORD}
        status, pat, _ = await svc.request("POST", f"{ADMIN}/users", key, json=body)
        assert status == 201, pat
        two = [{"value": "a@b.test", "primary": True}, {"value": "c@d.test", "primary": True}]
        for method, path, payload in (
            ("PATCH", f"{ADMIN}/users/{pat['id']}", {"emails": two}),
            ("POST", f"{ADMIN}/users", {"user_name": "sam", "password": PASSWORD, "emails": two}),
        ):
            status, refused, _ = await svc.request(method, path, key, json=payload)
            assert status == 400, refused
            assert "at most one email may be primary" in refused["error"]["message"]


async def test_a_password_of_the_wrong_length_is_refused_in_characters(
    database_url: str,
) -> None:
    """QA finding: pydantic's bound on a SecretStr spoke of "items"."""
    async with running(settings_for(database_url)) as svc:
        key = await svc.issue_key()
        body = {"user_name": "shorty", "password": "short"}
        status, refused, _ = await svc.request("POST", f"{ADMIN}/users", key, json=body)
        assert status == 400, refused
        message = refused["error"]["message"]
        assert "password: must be 8 to 1024 characters" in message and "short'" not in message
        # Eight spaces pass the length rule, and are no password (QA finding).
        spaces = {"user_name": "blank", "password": " " * 8}
        status, refused, _ = await svc.request("POST", f"{ADMIN}/users", key, json=spaces)
        assert status == 400 and "password: must not be white space only" in str(refused)
        login = {"username": "x", "password": "p" * 1025}
        status, refused, _ = await svc.request("POST", f"{ADMIN}/auth/login", json=login)
        assert status == 400 and "must be 1 to 1024 characters" in refused["error"]["message"]


async def test_a_users_key_issued_and_revoked_by_a_deactivation_says_who(
    database_url: str,
) -> None:
    """QA finding: the audit's entries of a user's key, issued through the user's route and
    revoked by the user's deactivation, had no `by`, which every change carries."""
    async with running(settings_for(database_url)) as svc:
        key = await svc.issue_key()
        body = {"user_name": "kim", "password": PASSWORD, "roles": ["member"]}
        status, kim, _ = await svc.request("POST", f"{ADMIN}/users", key, json=body)
        assert status == 201, kim
        issued = {"name": "kims", "scopes": ["chat"]}
        status, answer, _ = await svc.request(
            "POST", f"{ADMIN}/users/{kim['id']}/apikeys", key, json=issued
        )
        assert status == 201, answer
        status, answer, _ = await svc.request(
            "PATCH", f"{ADMIN}/users/{kim['id']}", key, json={"active": False}
        )
        assert status == 200, answer
        for action in ("workspace.api_key_issued", "workspace.api_key_revoked"):
            # The audit is the identity read model's, which the revocation does not wait for.
            async with asyncio.timeout(30):
                while True:
                    _, audit, _ = await svc.request("GET", f"{ADMIN}/audit?action={action}", key)
                    mine = [i for i in audit["items"] if i["detail"].get("name", "kims") == "kims"]
                    if mine:
                        break
                    await asyncio.sleep(0.05)
            assert all(i["detail"].get("by", "").startswith("key:") for i in mine), audit


async def test_a_users_key_takes_an_expiry_as_a_workspace_key_does(database_url: str) -> None:
    """QA finding: the user's route had no `expires_at`, and refused it as an unknown field;
    its other rules were a copy of the workspace key's, worded apart."""
    async with running(settings_for(database_url)) as svc:
        key = await svc.issue_key()
        body = {"user_name": "lee", "password": PASSWORD, "roles": ["member"]}
        status, lee, _ = await svc.request("POST", f"{ADMIN}/users", key, json=body)
        assert status == 201, lee
        path = f"{ADMIN}/users/{lee['id']}/apikeys"
        past = {"name": "old", "scopes": ["chat"], "expires_at": "2020-01-01T00:00:00Z"}
        status, refused, _ = await svc.request("POST", path, key, json=past)
        assert status == 400, refused
        assert "expires_at: must lie in the future" in refused["error"]["message"], refused
        status, refused, _ = await svc.request("POST", path, key, json={"name": "n", "scopes": []})
        assert status == 400 and refused["error"]["message"].endswith("scopes: must not be empty")
        later = datetime.now(UTC) + timedelta(seconds=2)
        soon = {"name": "soon", "scopes": ["chat"], "expires_at": later.isoformat()}
        status, issued, _ = await svc.request("POST", path, key, json=soon)
        assert status == 201 and issued["expires_at"] is not None, issued
        status, shown, _ = await svc.request("GET", f"{ADMIN}/apikeys/{issued['id']}", key)
        assert status == 200 and shown["expires_at"] == issued["expires_at"], shown
        status, session, _ = await svc.request("GET", "/v1/admin/auth/session", issued["key"])
        assert status == 200, session
        await asyncio.sleep(max(0.0, (later - datetime.now(UTC)).total_seconds()) + 0.1)
        status, refused, _ = await svc.request("GET", "/v1/admin/auth/session", issued["key"])
        assert status == 401 and "expired" in refused["error"]["message"], refused


async def test_a_logout_with_nothing_sent_asks_for_a_session(database_url: str) -> None:
    """QA finding: it asked for an API key, which the next answer then refused."""
    async with running(settings_for(database_url)) as svc:
        status, refused, _ = await svc.request("POST", f"{ADMIN}/auth/logout")
        assert status == 401, refused
        assert "needs an admin session cookie" in refused["error"]["message"], refused
        assert "POST /v1/admin/auth/login" in refused["error"]["message"], refused


async def test_a_404_quotes_a_long_or_odd_id_cut_short(database_url: str) -> None:
    """QA finding: a 404 said the whole 3,000-character id it was sent."""
    async with running(settings_for(database_url)) as svc:
        key = await svc.issue_key()
        for path, kind in (("/v1/admin/users/", "user"), ("/v1/admin/agents/", "agent")):
            status, err, _ = await svc.request("GET", path + "x" * 3000, key)
            assert status == 404, err
            message = err["error"]["message"]
            assert message == f"{kind} {'x' * 64!r}... (3,000 characters) does not exist"
            status, err, _ = await svc.request("GET", path + "usr_nobody", key)
            assert err["error"]["message"] == f"{kind} usr_nobody does not exist", err
            status, err, _ = await svc.request("GET", path + "a%1Bb", key)
            assert err["error"]["message"] == f"{kind} 'a\\x1bb' does not exist", err


async def test_a_deactivated_users_right_password_is_audited_as_such(database_url: str) -> None:
    """QA finding: it was recorded as `bad_credentials`, which an operator reads as a guess.
    The caller is answered as for any wrong password, learning nothing of the account."""
    async with running(settings_for(database_url)) as svc:
        key = await svc.issue_key()
        body = {"user_name": "dee", "password": PASSWORD}
        status, dee, _ = await svc.request("POST", f"{ADMIN}/users", key, json=body)
        assert status == 201, dee
        status, _, _ = await svc.request(
            "PATCH", f"{ADMIN}/users/{dee['id']}", key, json={"active": False}
        )
        assert status == 200
        answers = []
        for password in (PASSWORD, "not the password"):
            status, refused, browser = await svc.login("dee", password)
            await browser.close()
            answers.append((status, refused))
        assert answers[0] == answers[1] and answers[0][0] == 401, answers
        _, audit, _ = await svc.request("GET", f"{ADMIN}/audit?action=identity.login_failed", key)
        reasons = [(i["user_id"], i["detail"]["reason"]) for i in audit["items"]]
        assert sorted(reasons) == [
            (dee["id"], "bad_credentials"),
            (dee["id"], "sign_in_failed: user_deactivated"),
        ], reasons


async def test_audit_entries_of_a_user_by_id_name_the_user(database_url: str) -> None:
    """QA finding: a role bound or a second factor reset was listed with `user_name: null`,
    though every other entry of the user names them; and `IDENTITY.ROLE_BOUND` as an action
    was refused without the nearest."""
    async with running(settings_for(database_url)) as svc:
        key = await svc.issue_key()
        body = {"user_name": "nia", "password": PASSWORD}
        status, nia, _ = await svc.request("POST", f"{ADMIN}/users", key, json=body)
        assert status == 201, nia
        bind = {"role": "operator"}
        status, _, _ = await svc.request("POST", f"{ADMIN}/users/{nia['id']}/roles", key, json=bind)
        assert status == 200
        async with asyncio.timeout(30):  # the audit is the identity read model's
            while True:
                _, audit, _ = await svc.request(
                    "GET", f"{ADMIN}/audit?action=identity.role_bound", key
                )
                if audit["items"]:
                    break
                await asyncio.sleep(0.05)
        assert [(i["user_id"], i["user_name"]) for i in audit["items"]] == [(nia["id"], "nia")]
        status, refused, _ = await svc.request(
            "GET", f"{ADMIN}/audit?action=IDENTITY.ROLE_BOUND", key
        )
        assert status == 400 and "did you mean identity.role_bound?" in refused["error"]["message"]


async def test_an_address_given_twice_in_any_case_is_refused(database_url: str) -> None:
    """Left from the last session: the admin API kept `A@x.io` and `a@x.io` as two entries
    (SCIM's add keeps one), leaving a directory sign-in's sync to choose."""
    async with running(settings_for(database_url)) as svc:
        key = await svc.issue_key()
        twice = [{"value": "A@x.io", "primary": True}, {"value": "a@X.io"}]
        body = {"user_name": "eve", "emails": twice}
        status, refused, _ = await svc.request("POST", f"{ADMIN}/users", key, json=body)
        assert status == 400 and "given twice" in refused["error"]["message"], refused
        body = {"user_name": "eve", "emails": twice[:1]}
        status, eve, _ = await svc.request("POST", f"{ADMIN}/users", key, json=body)
        assert status == 201, eve
        path = f"{ADMIN}/users/{eve['id']}"
        status, refused, _ = await svc.request("PATCH", path, key, json={"emails": twice})
        assert status == 400 and "given twice" in refused["error"]["message"], refused
        # The addresses held, sent back as they are (a form that resends every field): taken.
        status, same, _ = await svc.request("PATCH", path, key, json={"emails": eve["emails"]})
        assert status == 200, same
