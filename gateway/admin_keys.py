"""API key administration: issue (POST /v1/admin/apikeys), list (GET /v1/admin/apikeys) and
revoke (POST /v1/admin/apikeys/{key_id}/revoke).

Issuing and revoking are commands to the workspace actor; the handler never writes a table.
The key is generated here, returned once, and only its sha256 enters the log. Both writes wait
(bounded) for the read models to apply them before answering, so a new key authenticates at
once, and a revoked key is refused within the authenticator's cache TTL (gateway/auth.py).
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

from aiohttp import web

from actors.behaviour import CommandOutcome
from actors.workspace import workspace_key
from gateway.admin_common import (
    READ,
    WRITE,
    acting,
    ask,
    not_applied,
    ok,
    public_cursor,
    read_your_writes,
    wait_applied,
)
from gateway.auth import (
    KEY_MODELS,
    check_delegation,
    generate_key,
    hash_key,
    holds_owner_power,
    writes_as_owner,
)
from gateway.errors import read_json, read_query, refuse_body
from gateway.identity.common import command_id, describe
from gateway.state import AUTH, DATABASE, STORE, Principal
from projections import queries
from projections.identity import IdentityProjector
from projections.identity_queries import key_owner
from schemas.admin import (
    AdminRead,
    ApiKeyCreate,
    ApiKeyList,
    ApiKeyRecord,
    KeyListQuery,
    NewApiKey,
    NoQuery,
    RevokedApiKey,
)
from schemas.commands import Command
from schemas.errors import Conflict, Forbidden, NotFound, SvcError
from schemas.events import EVENTS
from schemas.workspace import ID_MAX_CHARS, ApiKeyRevoked, IssueApiKey, RevokeApiKey

PREFIX_LEN = 8

REVOCATION_SEARCH_PAGE = 200
"""Events of the workspace's stream read at a time while looking back for a revocation."""


async def _execute(request: web.Request, principal: Principal, command: Command) -> CommandOutcome:
    outcome = await ask(request, workspace_key(principal.workspace_id), command)
    if not isinstance(outcome, CommandOutcome):
        raise SvcError("the workspace actor answered without an outcome")
    return outcome


def record(key: queries.ApiKey) -> ApiKeyRecord:
    return ApiKeyRecord(
        id=key.key_id,
        name=key.name,
        prefix=key.prefix,
        scopes=list(key.scopes),
        rate_limit_rpm=key.rate_limit_rpm,
        expires_at=key.expires_at,
        created_at=key.created_at,
        revoked_at=key.revoked_at,
        user_id=key.user_id,
    )


async def issue_key(request: web.Request) -> web.Response:
    principal = await acting(request, WRITE)
    read_query(request, NoQuery)
    body = await read_json(request, ApiKeyCreate)
    check_delegation(principal, tuple(body.scopes))
    command, key = issue_command(
        command_id(request), principal.workspace_id, body, describe(principal)
    )
    outcome = await _execute(request, principal, command)
    # Not applied in time, the key is answered all the same, since it is shown only this
    # once; it authenticates as soon as the read models apply `cursor` (docs/admin-api.md).
    await wait_applied(request, outcome.cursor, KEY_MODELS)
    if outcome.duplicate:
        # The first request's key was shown once and never kept: it cannot be sent again.
        raise Conflict(
            "this Idempotency-Key already issued a key, which is shown only once; list the "
            "keys to find it, or issue a new one with another Idempotency-Key",
            code="duplicate_request",
        )
    return ok(
        new_key(request, command, key, outcome.cursor),
        status=201,
        headers={"Cache-Control": "no-store"},  # the only copy of the key there will be
    )


def issue_command(
    cid: str, workspace_id: str, body: ApiKeyCreate, by: str
) -> tuple[IssueApiKey, str]:
    """The command that issues a key of `body` (both issuing routes), and the key itself,
    which only its answer shows: the command carries its hash and prefix. `cid`: the
    request's command id (from its Idempotency-Key)."""
    key = generate_key()
    command = IssueApiKey(
        command_id=cid,
        workspace_id=workspace_id,
        key_id="key_" + uuid.uuid4().hex,
        name=body.name,
        key_hash=hash_key(key),
        prefix=key[:PREFIX_LEN],
        scopes=tuple(body.scopes),
        rate_limit_rpm=body.rate_limit_rpm,
        expires_at=body.expires_at,
        at=datetime.now(UTC),
        by=by,
    )
    return command, key


def new_key(request: web.Request, issued: IssueApiKey, key: str, cursor: str) -> NewApiKey:
    """The answer that shows an issued key, the only time it is shown (both issuing routes)."""
    return NewApiKey(
        id=issued.key_id,
        name=issued.name,
        prefix=issued.prefix,
        scopes=list(issued.scopes),
        rate_limit_rpm=issued.rate_limit_rpm,
        expires_at=issued.expires_at,
        created_at=issued.at,
        key=key,
        cursor=public_cursor(request, cursor),
    )


async def list_keys(request: web.Request) -> web.Response:
    # A read, so admin:read (the spec's rule): the list shows names, prefixes, scopes and
    # limits, never a key or its hash.
    principal = await acting(request, READ)
    page = read_query(request, KeyListQuery)
    await read_your_writes(request, KEY_MODELS)
    keys, total = await queries.page_api_keys(
        request.app[DATABASE], principal.workspace_id, limit=page.limit, offset=page.offset
    )
    return ok(
        ApiKeyList(
            api_keys=[record(k) for k in keys], total=total, limit=page.limit, offset=page.offset
        )
    )


async def _check_owner_rule(request: web.Request, principal: Principal, key_id: str) -> None:
    """Revoking a key that holds owner power (an owner's, or one of no user that may write,
    the bootstrap key among them) is an owner's business, as issuing one is.

    The key and its owner are read from the read models, which must first have applied the
    workspace's log: one not yet there (a key just issued, its owner's link behind a
    lagging identity read model) would be judged a key of no user, and the rule would fail
    open. When they cannot catch up, the revoke is refused (503), not let through."""
    if holds_owner_power(principal):
        return
    ws = principal.workspace_id
    head = await request.app[STORE].head(ws)
    if head and not await wait_applied(request, head, OWNER_RULE_MODELS):
        raise not_applied(
            request,
            OWNER_RULE_MODELS,
            "whose key this is cannot be told until the read models catch up; retry shortly",
        )
    db = request.app[DATABASE]
    key = await queries.get_api_key(db, ws, key_id)
    if key is None:
        return  # the workspace actor answers for an unknown key
    owner = await key_owner(db, ws, key_id)
    if owner is not None:
        owner_power = "owner" in owner.roles
    else:
        owner_power = writes_as_owner(key.scopes)
    if owner_power:
        raise Forbidden("only an owner may revoke a key that holds owner power", code="owner_only")


OWNER_RULE_MODELS = (*KEY_MODELS, IdentityProjector.name)
"""The read models the owner rule reads a key's owner from."""


async def get_key(request: web.Request) -> web.Response:
    """One key as the list shows it: never the key, never its hash."""
    principal = await acting(request, READ)
    read_query(request, AdminRead)
    await read_your_writes(request, KEY_MODELS)
    key_id = _path_key_id(request, principal.workspace_id)
    key = await queries.get_api_key(request.app[DATABASE], principal.workspace_id, key_id)
    if key is None:
        # Not quoted: a key pasted where its id goes is a secret (as revoke says).
        raise NotFound(
            f"no API key of workspace {principal.workspace_id} has the id given (the key's "
            "id, key_..., not the key itself; GET /v1/admin/apikeys lists them)"
        )
    return ok(record(key))


def _path_key_id(request: web.Request, workspace_id: str) -> str:
    """The path's key id. One longer than any id is no key of the workspace: a 404, as for
    any unknown id, not a 400 about the command's field (and not quoted: a key pasted where
    its id goes is a secret)."""
    key_id = request.match_info["key_id"]
    if len(key_id) > ID_MAX_CHARS:
        raise NotFound(
            f"no API key of workspace {workspace_id} has that id (ids are at most "
            f"{ID_MAX_CHARS} characters; GET /v1/admin/apikeys lists them)"
        )
    return key_id


async def revoke_key(request: web.Request) -> web.Response:
    principal = await acting(request, WRITE)
    read_query(request, NoQuery)
    await refuse_body(request)
    key_id = _path_key_id(request, principal.workspace_id)
    await _check_owner_rule(request, principal, key_id)
    command = RevokeApiKey(
        command_id=command_id(request),
        workspace_id=principal.workspace_id,
        key_id=key_id,
        at=datetime.now(UTC),
        by=describe(principal),
    )
    outcome = await _execute(request, principal, command)
    # The revocation this command recorded, now or on its first run (a retry's own time is
    # not when the key was revoked); or, revoked before by another command, the one that
    # stands (nothing was written this time).
    revoked = next((e for e in outcome.events if isinstance(e, ApiKeyRevoked)), None)
    if revoked is not None:
        revoked_at, cursor = revoked.at, outcome.cursor
    else:
        revoked_at, cursor = await _recorded_revocation(
            request, principal.workspace_id, command.key_id
        )
    # Keys are looked up in the read models: until they apply the revocation the key still
    # authenticates, and the caller must not be told it is done. The cache is dropped after
    # the wait, so that a lookup during it cannot keep the unrevoked key.
    applied = await wait_applied(request, cursor, KEY_MODELS)
    request.app[AUTH].forget_key(command.key_id)
    if not applied:
        raise not_applied(
            request,
            KEY_MODELS,
            "they have not yet; repeat the request to confirm",
            recorded=f"API key {command.key_id} is revoked, but it may still authenticate "
            "until the read models apply the revocation",
        )
    return ok(
        RevokedApiKey(
            id=command.key_id, revoked_at=revoked_at, cursor=public_cursor(request, cursor)
        )
    )


async def _recorded_revocation(
    request: web.Request, workspace_id: str, key_id: str
) -> tuple[datetime, str]:
    """When the key was revoked, and the cursor of that event: searched from the newest
    event back, a page at a time (the workspace's stream holds every key, setting and agent
    change it ever had; a revocation repeated is most often a recent one's)."""
    store, stream_id = request.app[STORE], workspace_key(workspace_id).stream_id
    last = await store.stream_version(stream_id, workspace_id=workspace_id)
    while last > 0:
        first = max(1, last - REVOCATION_SEARCH_PAGE + 1)
        page = await store.read_stream(stream_id, first, workspace_id=workspace_id, to_version=last)
        for event in reversed(page):
            if event.type == ApiKeyRevoked.type_name and event.data.get("key_id") == key_id:
                revoked = EVENTS.decode(event.type, event.schema_version, event.data)
                if isinstance(revoked, ApiKeyRevoked):
                    return revoked.at, event.cursor
        last = first - 1
    raise SvcError(f"API key {key_id} is revoked but its revocation is not in the log")
