"""Identity writes retried with the same Idempotency-Key (a client that lost the first
answer): never done twice. A retry gets the first attempt's outcome, or, where that answer
showed a secret once (a key, the SCIM token, an OAuth client secret), 409 duplicate_request:
the secret was never kept, and the retry must not hand out one that was never recorded."""

from __future__ import annotations

from typing import Any

import pytest
from identity_support import Running, asks_failing, running, settings_for, uid

from actors.behaviour import ActorKey
from eventstore.errors import StoreUnavailable
from gateway.identity import admin
from gateway.identity.service import IDENTITY
from gateway.state import RUNTIME
from projections.identity_queries import get_user
from schemas.commands import Command
from schemas.errors import Unavailable
from schemas.identity import LinkApiKey
from schemas.workspace import RevokeApiKey

pytestmark = [pytest.mark.filterwarnings("ignore::asyncpg.InterfaceWarning")]

ADMIN = "/v1/admin"
PASSWORD = "correct horse battery staple"


async def twice(
    svc: Running, key: str, path: str, body: dict[str, Any]
) -> tuple[tuple[int, Any], tuple[int, Any]]:
    """The same write sent twice with one Idempotency-Key."""
    headers = {"Idempotency-Key": uid("retry-")}
    answers = []
    for _ in range(2):
        status, answer, _ = await svc.request("POST", path, key, json=body, headers=headers)
        answers.append((status, answer))
    return answers[0], answers[1]


async def test_a_retried_user_creation_answers_with_the_user_it_created(
    database_url: str,
) -> None:
    async with running(settings_for(database_url)) as svc:
        key = await svc.issue_key()
        body = {"user_name": uid("ada-"), "password": PASSWORD}
        (first, created), (again, retried) = await twice(svc, key, f"{ADMIN}/users", body)

        assert (first, again) == (201, 201)
        assert retried["id"] == created["id"] and retried["user_name"] == body["user_name"]
        _, listing, _ = await svc.request(
            "GET", f"{ADMIN}/users?user_name={body['user_name']}", key
        )
        assert listing["total"] == 1
        status, _, browser = await svc.login(body["user_name"], PASSWORD)
        await browser.close()
        assert status == 200


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/scim/token", {"action": "issue"}),
        ("/oauth/clients", {"name": "etl", "scopes": ["admin:read"]}),
    ],
)
async def test_a_retried_secret_is_refused_not_made_up(
    database_url: str, path: str, body: dict[str, Any]
) -> None:
    async with running(settings_for(database_url)) as svc:
        key = await svc.issue_key()
        (first, issued), (again, refused) = await twice(svc, key, ADMIN + path, body)

        assert first == 201, issued
        assert again == 409 and refused["error"]["code"] == "duplicate_request", refused
        # The message says where the first attempt's result shows; for a client, that works.
        if "client_id" in issued:
            where = "/v1/admin/audit?action=identity.oauth_client_registered"
            assert where in refused["error"]["message"]
            status, audit, _ = await svc.request("GET", where, key)
            assert status == 200 and issued["client_id"] in str(audit), audit


async def test_a_retried_user_key_is_refused_and_the_user_can_still_be_removed(
    database_url: str,
) -> None:
    """The retry used to answer 201 with a key never recorded, and link its made-up id to
    the user, so deprovisioning the user later failed to revoke it (404)."""
    async with running(settings_for(database_url)) as svc:
        key = await svc.issue_key()
        _, user, _ = await svc.request(
            "POST", f"{ADMIN}/users", key, json={"user_name": uid("bob-")}
        )
        keys = f"{ADMIN}/users/{user['id']}/apikeys"
        body = {"name": "ci", "scopes": ["chat"]}
        (first, issued), (again, refused) = await twice(svc, key, keys, body)

        assert first == 201, issued
        assert again == 409 and refused["error"]["code"] == "duplicate_request", refused
        assert "GET /v1/admin/apikeys lists it" in refused["error"]["message"]
        status, listed, _ = await svc.request("GET", f"{ADMIN}/apikeys", key)
        assert status == 200, listed
        owners = {k["id"]: k["user_id"] for k in listed["api_keys"]}
        assert owners[issued["key_id"]] == user["id"], listed  # whose key it is
        assert list(owners.values()).count(None) == 1, listed  # the admin's workspace key
        # QA finding: the two issuing routes answered in two shapes (`key_id` and no more
        # here), and no route read one key. Now one shape, and `GET /v1/admin/apikeys/{id}`.
        (row,) = [k for k in listed["api_keys"] if k["id"] == issued["id"]]
        assert {k: issued[k] for k in row} == row, (issued, row)
        assert issued["key_id"] == issued["id"] and issued["cursor"], issued
        status, one, _ = await svc.request("GET", f"{ADMIN}/apikeys/{issued['id']}", key)
        assert status == 200 and one == row, one
        for wrong in ("key_nope", issued["key"]):  # the key pasted where its id goes
            status, err, _ = await svc.request("GET", f"{ADMIN}/apikeys/{wrong}", key)
            message = err["error"]["message"]
            assert status == 404 and "GET /v1/admin/apikeys lists them" in message, err
            assert issued["key"] not in message and issued["key"][:12] not in message
        status, _, _ = await svc.request("DELETE", f"{ADMIN}/users/{user['id']}", key)
        assert status == 204
        status, _, _ = await svc.request(
            "POST",
            "/v1/chat/completions",
            issued["key"],
            json={"model": "svc-offline", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert status == 401  # revoked with its user


async def test_a_user_key_whose_link_fails_is_revoked_not_left_to_no_user(
    database_url: str,
) -> None:
    """Review finding: the key was issued, then its link to the user failed (the database
    away a moment, the user deactivated meanwhile): the answer was an error, so no one held
    the key, yet it stayed live as a key of no user, one the user's deactivation would not
    revoke. It is now revoked with the failed answer."""
    async with running(settings_for(database_url)) as svc:
        key = await svc.issue_key()
        _, user, _ = await svc.request(
            "POST", f"{ADMIN}/users", key, json={"user_name": uid("kim-")}
        )
        unreachable = StoreUnavailable("the event store is unreachable")
        with asks_failing(svc.app[IDENTITY], LinkApiKey, unreachable):
            body = {"name": "unlinked", "scopes": ["chat"]}
            status, err, _ = await svc.request(
                "POST", f"{ADMIN}/users/{user['id']}/apikeys", key, json=body
            )
        assert status == 503, err
        status, listed, _ = await svc.request("GET", f"{ADMIN}/apikeys", key)
        (unlinked,) = [k for k in listed["api_keys"] if k["name"] == "unlinked"]
        assert unlinked["revoked_at"] is not None, unlinked


async def test_a_key_reused_to_create_another_user_is_refused(database_url: str) -> None:
    """Review finding: the key alone named the creation, so a request reusing it for another
    user got the first user back (201) and set its own password on that account when it had
    none, past the checks that guard who may manage whom."""
    async with running(settings_for(database_url)) as svc:
        key = await svc.issue_key()
        headers = {"Idempotency-Key": uid("create-")}
        first = {"user_name": uid("ceo-")}
        status, ceo, _ = await svc.request(
            "POST", f"{ADMIN}/users", key, json=first, headers=headers
        )
        assert status == 201 and not ceo["has_password"], ceo
        other = {"user_name": uid("x-"), "password": PASSWORD}
        status, err, _ = await svc.request(
            "POST", f"{ADMIN}/users", key, json=other, headers=headers
        )
        assert status == 409 and err["error"]["code"] == "idempotency_key_reused", err
        status, again, _ = await svc.request("GET", f"{ADMIN}/users/{ceo['id']}", key)
        assert status == 200 and not again["has_password"], again
        # The same request again is still its retry.
        status, retried, _ = await svc.request(
            "POST", f"{ADMIN}/users", key, json=first, headers=headers
        )
        assert status == 201 and retried["id"] == ceo["id"], retried


async def test_a_retried_deactivation_spares_what_a_reactivation_issued_since(
    database_url: str,
) -> None:
    """Review finding: the cut-off followed the body (`active: false`), not the user: a
    deactivation retried after the user was reactivated revoked the keys issued since."""
    async with running(settings_for(database_url)) as svc:
        key = await svc.issue_key()
        _, user, _ = await svc.request(
            "POST", f"{ADMIN}/users", key, json={"user_name": uid("kai-")}
        )
        path = f"{ADMIN}/users/{user['id']}"
        deactivate = {"Idempotency-Key": uid("off-")}
        status, _, _ = await svc.request(
            "PATCH", path, key, json={"active": False}, headers=deactivate
        )
        assert status == 200
        status, _, _ = await svc.request("PATCH", path, key, json={"active": True})
        assert status == 200
        status, issued, _ = await svc.request(
            "POST", f"{path}/apikeys", key, json={"name": "new", "scopes": ["chat"]}
        )
        assert status == 201, issued
        status, body, _ = await svc.request(
            "PATCH", path, key, json={"active": False}, headers=deactivate
        )
        assert status == 200 and body["active"] is True, body  # the retry: nothing new
        status, _, _ = await svc.request("GET", "/v1/models", issued["key"])
        assert status == 200  # the key issued after the reactivation still works
        # A deactivated account gets no new key at all.
        status, _, _ = await svc.request("PATCH", path, key, json={"active": False})
        assert status == 200
        status, err, _ = await svc.request(
            "POST", f"{path}/apikeys", key, json={"name": "late", "scopes": ["chat"]}
        )
        assert status == 409 and err["error"]["code"] == "user_inactive", err


async def test_a_retried_delete_finishes_revoking_the_users_keys(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review finding: a delete that recorded the deprovisioning and then failed to revoke
    a key (503) answered its retry 404 (the user is gone), and the key stayed listed live."""
    async with running(settings_for(database_url)) as svc:
        key = await svc.issue_key()
        _, user, _ = await svc.request(
            "POST", f"{ADMIN}/users", key, json={"user_name": uid("lea-")}
        )
        path = f"{ADMIN}/users/{user['id']}"
        status, issued, _ = await svc.request(
            "POST", f"{path}/apikeys", key, json={"name": "lea-key", "scopes": ["chat"]}
        )
        assert status == 201, issued
        runtime = svc.app[RUNTIME]
        ask = runtime.ask

        async def revocations_fail(actor: ActorKey, command: Command, **kw: Any) -> Any:
            if isinstance(command, RevokeApiKey):
                raise StoreUnavailable("the event store is unreachable")
            return await ask(actor, command, **kw)

        monkeypatch.setattr(runtime, "ask", revocations_fail)
        headers = {"Idempotency-Key": uid("delete-")}
        status, _, _ = await svc.request("DELETE", path, key, headers=headers)
        assert status == 503
        monkeypatch.undo()
        status, _, _ = await svc.request("DELETE", path, key, headers=headers)
        assert status == 204
        _, listed, _ = await svc.request("GET", f"{ADMIN}/apikeys", key)
        (lea,) = [k for k in listed["api_keys"] if k["name"] == "lea-key"]
        assert lea["revoked_at"] is not None, lea
        status, _, _ = await svc.request("DELETE", path, key)  # no key: no such user
        assert status == 404


async def test_only_the_key_that_deleted_a_user_deletes_them_again(database_url: str) -> None:
    """Review finding: any Idempotency-Key made the delete of a deleted user a 204, one
    never used as well as one used for another request."""
    async with running(settings_for(database_url)) as svc:
        key = await svc.issue_key()
        paths = []
        for name in ("ann-", "ben-"):
            _, user, _ = await svc.request(
                "POST", f"{ADMIN}/users", key, json={"user_name": uid(name)}
            )
            paths.append(f"{ADMIN}/users/{user['id']}")
        ann, ben = paths
        deleted_ann, deleted_ben = ({"Idempotency-Key": uid("delete-")} for _ in paths)
        assert (await svc.request("DELETE", ann, key, headers=deleted_ann))[0] == 204
        assert (await svc.request("DELETE", ben, key, headers=deleted_ben))[0] == 204
        fresh = {"Idempotency-Key": uid("delete-")}
        status, err, _ = await svc.request("DELETE", ann, key, headers=fresh)
        assert status == 404 and err["error"]["code"] == "not_found", err
        status, err, _ = await svc.request("DELETE", ann, key, headers=deleted_ben)
        assert status == 409 and err["error"]["code"] == "idempotency_key_reused", err
        assert (await svc.request("DELETE", ann, key, headers=deleted_ann))[0] == 204


async def test_a_reactivation_ends_what_a_failed_deactivation_left_live(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review finding: a deactivation recorded whose cut-off then failed (503) left the
    user's keys refused only while inactive; a reactivation, or a retry that found the
    user reactivated, brought them back to life."""
    async with running(settings_for(database_url)) as svc:
        key = await svc.issue_key()
        _, user, _ = await svc.request(
            "POST", f"{ADMIN}/users", key, json={"user_name": uid("lea-")}
        )
        personal = (await svc.issue_user_key(key, user["id"], ["chat"]))["key"]
        real_cut_off = admin.cut_off

        async def failing_once(*args: Any) -> None:
            monkeypatch.setattr(admin, "cut_off", real_cut_off)
            raise Unavailable("the store is unavailable; retry", code="store_unavailable")

        monkeypatch.setattr(admin, "cut_off", failing_once)
        path = f"{ADMIN}/users/{user['id']}"
        status, _, _ = await svc.request("PATCH", path, key, json={"active": False})
        assert status == 503
        status, _, _ = await svc.request("GET", "/v1/models", personal)
        assert status == 401  # refused while the user is inactive
        status, body, _ = await svc.request("PATCH", path, key, json={"active": True})
        assert status == 200 and body["active"] is True, body
        status, _, _ = await svc.request("GET", "/v1/models", personal)
        assert status == 401  # and after: the reactivation finished the cut-off


async def test_a_delete_that_lost_the_race_is_404_as_its_retry_is(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review finding: a delete whose read still showed the user live, decided after another
    delete, recorded nothing yet answered 204; its retry, unknown to the ledger, got 404."""
    async with running(settings_for(database_url)) as svc:
        key = await svc.issue_key()
        _, user, _ = await svc.request(
            "POST", f"{ADMIN}/users", key, json={"user_name": uid("zoe-")}
        )
        path = f"{ADMIN}/users/{user['id']}"
        db = svc.app[IDENTITY].db
        as_read = await get_user(db, "default", user["id"])
        assert as_read is not None
        first = {"Idempotency-Key": uid("delete-")}
        assert (await svc.request("DELETE", path, key, headers=first))[0] == 204

        async def stale(*args: Any) -> Any:
            return as_read  # read before the other delete landed

        monkeypatch.setattr(admin, "live_user", stale)
        late = {"Idempotency-Key": uid("delete-")}
        status, err, _ = await svc.request("DELETE", path, key, headers=late)
        assert status == 404 and err["error"]["code"] == "not_found", err
        monkeypatch.undo()
        assert (await svc.request("DELETE", path, key, headers=late))[0] == 404
