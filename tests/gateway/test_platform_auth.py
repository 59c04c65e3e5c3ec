"""Bearer keys, scopes, the static compatible key, SVC_PERSONAL_API_KEYS, and per-key rate
limits that are exact under concurrency and across gateway processes sharing the database."""

from __future__ import annotations

import asyncio
import logging
import re
from collections import Counter
from datetime import UTC, datetime, timedelta
from typing import Any, cast
from urllib.parse import quote, quote_plus

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request
from platform_support import (
    WHOAMI,
    Running,
    clear_of_minute_boundary,
    revoke_key,
    running,
    settings_for,
    uid,
)

from gateway.auth import (
    IDENTIFY,
    KEY_PREFIX,
    PRINCIPAL,
    InvalidCredential,
    KeyCache,
    KeyRecord,
    _check_usable,
    authenticate,
    generate_key,
)
from gateway.state import AUTH, Principal
from schemas.errors import Unauthorized


def test_generated_keys_have_the_documented_shape() -> None:
    key = generate_key()
    assert key.startswith(KEY_PREFIX)
    assert re.fullmatch(r"svc_[A-Za-z0-9_\-]{40}", key)
    assert generate_key() != key


async def test_missing_invalid_and_revoked_keys_are_401(database_url: str) -> None:
    async with running(settings_for(database_url)) as svc:
        status, body, headers = await svc.request("GET", WHOAMI)
        assert status == 401 and body["error"]["code"] == "unauthorized"
        assert headers["WWW-Authenticate"] == 'Bearer realm="svc"'  # the scheme that would do
        # RFC 6750 section 3: a key sent and not good is an invalid token (get a new one).
        status, body, headers = await svc.request("GET", WHOAMI, key=generate_key())
        assert status == 401 and body["error"]["code"] == "unauthorized"
        assert headers["WWW-Authenticate"] == 'Bearer realm="svc", error="invalid_token"'
        status, body, _ = await svc.request("GET", WHOAMI, headers={"Authorization": "Basic x"})
        assert status == 401

        ws = uid("ws-")
        key, key_id = await svc.issue_key(ws, ["chat"])
        status, body, _ = await svc.request("GET", WHOAMI, key=key)
        assert status == 200 and body == {"workspace_id": ws, "scopes": ["chat"]}
        await revoke_key(svc.app, ws, key_id)
        await asyncio.sleep(2.1)  # the lookup cache's TTL (gateway.auth.CACHE_TTL_S)
        status, body, headers = await svc.request("GET", WHOAMI, key=key)
        assert status == 401 and "revoked" in body["error"]["message"]
        assert 'error="invalid_token"' in headers["WWW-Authenticate"]


async def test_insufficient_scope_is_403(database_url: str) -> None:
    async with running(settings_for(database_url)) as svc:
        key, _ = await svc.issue_key(uid("ws-"), ["chat"])
        status, body, headers = await svc.request("GET", "/v1/admin/settings", key=key)
        assert status == 403
        assert body["error"]["type"] == "permission_error"
        challenge = 'Bearer realm="svc", error="insufficient_scope", scope="admin:read"'
        assert headers["WWW-Authenticate"] == challenge


async def test_static_compatible_key_maps_to_its_workspace(database_url: str) -> None:
    settings = settings_for(
        database_url,
        SVC_NATIVE_COMPAT_KEY="static-compat-key-123",
        SVC_NATIVE_COMPAT_WORKSPACE="compat-ws",
    )
    async with running(settings) as svc:
        status, body, _ = await svc.request("GET", WHOAMI, key="static-compat-key-123")
        assert status == 200 and body == {"workspace_id": "compat-ws", "scopes": ["chat"]}


async def test_the_access_log_never_shows_a_secret_setting_pasted_into_a_url(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The static key has no shape a pattern knows: its value itself is what is redacted,
    as it is and percent-encoded."""
    secret = "static compat/key+123"
    settings = settings_for(database_url, SVC_NATIVE_COMPAT_KEY=secret)
    caplog.set_level(logging.INFO, logger="aiohttp.access")
    async with running(settings) as svc:
        for path in (
            f"/v1/models?key={quote(secret, safe='')}",
            f"/v1/models?key={quote_plus(secret)}",
            f"/v1/models/{quote(secret, safe='')}",
        ):
            await svc.request("GET", path)
        # The page a browser came from, in the Referer the log also shows.
        referer = f"https://app.example/?key={quote(secret, safe='').lower()}&token=abc"
        await svc.request("GET", "/v1/models", headers={"Referer": referer})
    lines = [r.getMessage() for r in caplog.records if r.name == "aiohttp.access"]
    assert len([line for line in lines if "/v1/models" in line]) == 4, lines
    assert any("https://app.example/?key=[redacted]" in line for line in lines), lines
    for line in lines:
        for form in (secret, quote(secret, safe=""), quote_plus(secret), "compat"):
            assert form not in line, line


def test_a_revocation_stamped_by_a_clock_ahead_of_this_one_holds_at_once() -> None:
    ahead = datetime.now(UTC) + timedelta(seconds=60)
    with pytest.raises(Unauthorized):
        _check_usable(KeyRecord("key-a", "ws", frozenset({"chat"}), revoked_at=ahead))


async def test_static_key_workspace_defaults_to_default_workspace(database_url: str) -> None:
    settings = settings_for(database_url, SVC_NATIVE_COMPAT_KEY="static-compat-key-123")
    async with running(settings) as svc:
        status, body, _ = await svc.request("GET", WHOAMI, key="static-compat-key-123")
        assert status == 200 and body["workspace_id"] == "default"


async def test_personal_keys_off_disables_them_on_the_chat_endpoint(database_url: str) -> None:
    settings = settings_for(database_url, SVC_PERSONAL_API_KEYS="off")
    async with running(settings) as svc:
        key, _ = await svc.issue_key(uid("ws-"), ["chat"])
        body = {"model": "svc-offline", "messages": [{"role": "user", "content": "hi"}]}
        status, answer, _ = await svc.request("POST", "/v1/chat/completions", key=key, json=body)
        assert status == 401, answer
        assert "SVC_PERSONAL_API_KEYS" in answer["error"]["message"]
        for path in ("/v1/models", "/v1/models/svc-offline"):
            status, answer, _ = await svc.request("GET", path, key=key)
            assert status == 401, (path, answer)  # the compatible endpoint's models too
        status, _, _ = await svc.request("GET", WHOAMI, key=key)
        assert status == 200


async def _burst(svc: Running, key: str, n: int) -> list[int]:
    async def one() -> int:
        status, _, _ = await svc.request("GET", WHOAMI, key=key)
        return status

    return list(await asyncio.gather(*(one() for _ in range(n))))


async def test_burst_of_40_on_a_20_rpm_key_admits_exactly_20(database_url: str) -> None:
    async with running(settings_for(database_url)) as svc:
        key, _ = await svc.issue_key(uid("ws-"), ["chat"], rate_limit_rpm=20)
        await clear_of_minute_boundary()
        statuses = Counter(await _burst(svc, key, 40))
        assert statuses == {200: 20, 429: 20}

        status, body, headers = await svc.request("GET", WHOAMI, key=key)
        assert status == 429
        assert body["error"]["type"] == "rate_limit_error"
        assert 1 <= int(headers["Retry-After"]) <= 60
        assert headers["X-RateLimit-Limit"] == "20"
        assert headers["X-RateLimit-Remaining"] == "0"
        assert 0 <= int(headers["X-RateLimit-Reset"]) <= 60


async def test_admitted_responses_carry_rate_limit_headers(database_url: str) -> None:
    async with running(settings_for(database_url)) as svc:
        key, _ = await svc.issue_key(uid("ws-"), ["chat"], rate_limit_rpm=5)
        await clear_of_minute_boundary()
        status, _, headers = await svc.request("GET", WHOAMI, key=key)
        assert status == 200
        assert headers["X-RateLimit-Limit"] == "5"
        assert headers["X-RateLimit-Remaining"] == "4"


async def test_key_without_rate_limit_is_not_limited(database_url: str) -> None:
    async with running(settings_for(database_url)) as svc:
        key, _ = await svc.issue_key(uid("ws-"), ["chat"])
        statuses = Counter(await _burst(svc, key, 60))
        assert statuses == {200: 60}


async def test_rate_limit_is_shared_by_two_gateways_on_one_database(database_url: str) -> None:
    settings_a, settings_b = settings_for(database_url), settings_for(database_url)
    async with running(settings_a) as first, running(settings_b) as second:
        key, _ = await first.issue_key(uid("ws-"), ["chat"], rate_limit_rpm=20)
        await clear_of_minute_boundary()
        results = await asyncio.gather(_burst(first, key, 20), _burst(second, key, 20))
        statuses = Counter(results[0] + results[1])
        assert statuses == {200: 20, 429: 20}


async def test_key_cache_serves_within_its_ttl_and_forget_drops_a_key_at_once() -> None:
    lookups: Counter[str] = Counter()
    records = {
        "hash-a": KeyRecord("key-a", "ws", frozenset({"chat"})),
        "hash-b": KeyRecord("key-b", "ws", frozenset({"chat"})),
    }

    async def lookup(key_hash: str) -> KeyRecord | None:
        lookups[key_hash] += 1
        return records[key_hash]

    cache = KeyCache(lookup, ttl_s=60.0)
    for _ in range(3):
        assert await cache.find("hash-a") == records["hash-a"]
        assert await cache.find("hash-b") == records["hash-b"]
    assert lookups == {"hash-a": 1, "hash-b": 1}

    records["hash-a"] = KeyRecord("key-a", "ws", frozenset({"chat"}), revoked_at=datetime.now(UTC))
    cache.forget("key-a")
    assert (await cache.find("hash-a")).revoked_at is not None  # type: ignore[union-attr]
    assert await cache.find("hash-b") == records["hash-b"]
    assert lookups == {"hash-a": 2, "hash-b": 1}


async def test_a_lookup_in_flight_when_its_key_is_forgotten_is_not_cached() -> None:
    revoked = KeyRecord("key-a", "ws", frozenset({"chat"}), revoked_at=datetime.now(UTC))
    answers = [KeyRecord("key-a", "ws", frozenset({"chat"})), revoked]
    release = asyncio.Event()

    async def lookup(key_hash: str) -> KeyRecord | None:
        answer = answers.pop(0)
        if answer is not revoked:
            await release.wait()  # read before the revocation, answered after it
        return answer

    cache = KeyCache(lookup, ttl_s=60.0)
    stale = asyncio.create_task(cache.find("hash-a"))
    await asyncio.sleep(0)
    cache.forget("key-a")
    release.set()
    assert (await stale).revoked_at is None  # the caller that asked before gets what it read
    assert (await cache.find("hash-a")).revoked_at is not None  # type: ignore[union-attr]


async def test_a_refused_identity_check_leaves_no_principal_behind() -> None:
    """Review finding: the platform's key check, run inside the identity resolver, cached
    the key's own principal on the request before the resolver refused it (a key of a
    deactivated user). A second call on that request then skipped the resolver and got the
    cached principal, with the key's full scopes."""
    key_principal = Principal(workspace_id="ws", scopes=frozenset({"*"}), key_id="key_1")

    class PlatformCheck:
        async def authenticate(self, request: web.Request) -> Principal:
            request[PRINCIPAL] = key_principal
            return key_principal

    async def refusing_resolver(request: web.Request) -> Principal:
        await request.app[AUTH].authenticate(request)
        raise InvalidCredential("invalid API key: it has been revoked")

    app = web.Application()
    app[AUTH] = cast(Any, PlatformCheck())
    app[IDENTIFY] = refusing_resolver
    request = make_mocked_request("GET", "/v1/models", app=app)
    for _ in range(2):
        with pytest.raises(InvalidCredential, match="revoked"):
            await authenticate(request)
    assert PRINCIPAL not in request
