"""Admin endpoints of identity: users, role bindings, roles, the SCIM token, OAuth clients and
the audit log. Reads need read, writes need write on the endpoint's domain (roles.py):
`users` for users, bindings and roles, `security` for the SCIM token and OAuth clients,
`audit` for the audit log. Only an owner (or an API key) may grant or remove `owner`, and no
principal grants a role, defines one, or manages a user carrying rights it lacks itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict
from typing import Annotated, Any, Literal, TypeVar

from aiohttp import web
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, SecretStr

from actors.behaviour import CommandOutcome
from actors.identity import directory_key, session_key
from actors.workspace import workspace_key
from eventstore.errors import InvalidCursor
from gateway.admin_keys import issue_command, new_key
from gateway.auth import (
    KEY_MODELS,
    check_delegation,
    generate_key,
    hash_key,
    holds_owner_power,
    require_instance_admin,
    writes_as_owner,
)
from gateway.cursor_seal import CursorSeal, open_audit_issued
from gateway.errors import read_json, read_query, refuse_body
from gateway.identity.authn import acting, identify
from gateway.identity.common import (
    DIRECTORY_MATCHED,
    DIRECTORY_SOURCES,
    actor_of,
    command_id,
    first_unshown,
    idempotency_key,
    json,
    new_id,
    now,
    profile_of,
    retried_if_changed,
    signed_in_user,
    signs_in_elsewhere,
    user_view,
)
from gateway.identity.login import check_password_as_a_login, local_password_matches
from gateway.identity.oauth import new_client_credentials, secret_hash
from gateway.identity.passwords import BLANK, MAX_LENGTH, MIN_LENGTH, hash_password, is_blank
from gateway.identity.roles import allowed, require_access
from gateway.identity.saml import sp_key_problem
from gateway.identity.service import APPLY_TIMEOUT_S, Identity, identity
from gateway.identity.vault import INSTANCE, PASSWORD, TOTP, TOTP_PENDING
from gateway.state import AUTH, CURSORS, PROJECTIONS, RUNTIME, Principal
from projections.identity import IdentityProjector
from projections.identity_queries import (
    DEACTIVATED,
    DEPROVISIONED,
    UserRow,
    active_owners,
    find_oauth_client,
    get_user,
    list_audit,
    list_custom_roles,
    list_oauth_clients,
    list_users,
    role_permissions,
    user_api_keys,
    user_session_ids,
)
from schemas.admin import (
    MAX_OFFSET,
    ApiKeyCreate,
    NoQuery,
    OneLineName,
    shown_name,
    shown_text,
)
from schemas.errors import (
    Conflict,
    Forbidden,
    InvalidInput,
    NotFound,
    SvcError,
    echoed,
    nearest,
    quoted,
)
from schemas.identity import (
    BUILTIN_ROLES,
    Access,
    BindRole,
    DefineCustomRole,
    DeprovisionUser,
    Email,
    Emails,
    IssueScimToken,
    LinkApiKey,
    Permissions,
    ProvisionUser,
    RecordPasswordSet,
    RecordSsoSecretSet,
    RegisterOAuthClient,
    ResetTotp,
    RevokeOAuthClient,
    RevokeScimToken,
    RevokeSession,
    RoleName,
    UnbindRole,
    UpdateUser,
    UserProfile,
    UserProvisioned,
    secret_sized,
)
from schemas.identity_api import IssuedUserKey, OAuthClientPage, OAuthClientView
from schemas.workspace import RevokeApiKey, unknown_scopes


def _not_blank(value: SecretStr) -> SecretStr:
    if is_blank(value.get_secret_value()):
        raise ValueError(BLANK)
    return value


Password = Annotated[SecretStr, secret_sized(MIN_LENGTH, MAX_LENGTH), AfterValidator(_not_blank)]
SCIM_TOKEN_PREFIX = "svc_scim_"
T = TypeVar("T")

log = logging.getLogger(__name__)


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


PAGE = 100
MAX_PAGE = 500


class UserListQuery(_Body):
    limit: int = Field(default=PAGE, ge=1, le=MAX_PAGE)
    offset: int = Field(default=0, ge=0, le=MAX_OFFSET)
    user_name: str | None = Field(
        default=None, max_length=256, description="only the user of this name"
    )


class OAuthClientListQuery(_Body):
    limit: int = Field(default=PAGE, ge=1, le=MAX_PAGE)
    offset: int = Field(default=0, ge=0, le=MAX_OFFSET)
    include_revoked: bool = Field(default=False, description="revoked clients too")


class AuditQuery(_Body):
    limit: int = Field(default=PAGE, ge=1, le=MAX_PAGE)
    before: str | None = Field(
        default=None,
        max_length=64,
        description="entries older than this one: the `next_cursor` of the page before, or "
        "an entry's `id`",
    )
    action: str | None = Field(
        default=None, max_length=200, description="only this action, e.g. identity.login_failed"
    )


UserNameText = Annotated[str, Field(min_length=1, max_length=256)]
ProfileText = Annotated[str, Field(max_length=500)]
ShownUserName = Annotated[UserNameText, AfterValidator(shown_name)]
ShownText = Annotated[ProfileText, AfterValidator(shown_text)]
"""A user's names as the admin API takes them: shown in the user list, the audit log and
SCIM, so without control characters or direction overrides (as key and agent names). A
PATCH checks only the values it changes (`first_unshown`): a name stored before the check,
sent again by a form that resends every field, is no new value."""


def _shown_emails(emails: tuple[Email, ...]) -> tuple[Email, ...]:
    """Addresses are shown in the same reads as names, and checked alike."""
    for email in emails:
        shown_text(email.value)
    return _distinct_emails(emails)


def _distinct_emails(emails: tuple[Email, ...]) -> tuple[Email, ...]:
    """One entry per address, compared as mail systems do, without case: two entries of one
    address (SCIM's add keeps one) left a sign-in's sync to pick between them."""
    seen: set[str] = set()
    for email in emails:
        folded = email.value.casefold()
        if folded in seen:
            raise ValueError(f"the address {quoted(email.value)} is given twice (in any case)")
        seen.add(folded)
    return emails


class NewUser(_Body):
    user_name: ShownUserName
    password: Password | None = None
    roles: tuple[RoleName, ...] = ()
    display_name: ShownText | None = None
    given_name: ShownText | None = None
    family_name: ShownText | None = None
    emails: Annotated[Emails, AfterValidator(_shown_emails)] = ()
    external_id: ShownText | None = None


class UserPatch(_Body):
    user_name: UserNameText | None = None
    display_name: ProfileText | None = None
    given_name: ProfileText | None = None
    family_name: ProfileText | None = None
    emails: Emails | None = None
    external_id: ProfileText | None = None
    active: bool | None = None


def _check_shown_changes(changes: dict[str, Any], user: UserRow) -> None:
    held = profile_of(user).model_dump()
    problem = first_unshown(changes, held)
    if problem is not None:
        where = problem.field if problem.index is None else f"emails.{problem.index}.value"
        raise InvalidInput(f"invalid request: {where}: {problem.reason}")
    emails = changes.get("emails")
    if emails is not None and list(emails) != list(held["emails"]):  # as held: taken
        try:
            _distinct_emails(tuple(Email.model_validate(e) for e in emails))
        except ValueError as exc:
            raise InvalidInput(f"invalid request: emails: {exc}") from None


SELF_EDITABLE = frozenset({"display_name", "given_name", "family_name"})
"""What a signed-in user may change on their own account with no right on `users`: how their
name is shown. Not `user_name` or `external_id`, which sign-ins match accounts by (a member
taking a directory user's name would receive that user's roles at their next sign-in), nor
`emails`, nor `active`."""


class PasswordBody(_Body):
    password: Password
    # One's own change needs the password in force: a session cookie taken with its CSRF
    # token could otherwise set a new one, and end the real user's sessions with it.
    current_password: Annotated[SecretStr, secret_sized(0, MAX_LENGTH)] | None = None


class RoleBody(_Body):
    role: RoleName


class CustomRoleBody(_Body):
    name: RoleName
    permissions: Permissions


class ScimTokenBody(_Body):
    action: Literal["issue", "rotate", "revoke"] = "issue"


class SecretBody(_Body):
    value: Annotated[SecretStr, secret_sized(1, 100_000)]


INSTANCE_SECRETS = frozenset({("ldap", "bind_password"), ("saml", "sp_key")})
"""Secrets the SSO settings name (scope, name); set here, kept in the identity vault."""

SECRET_CHECKS: dict[tuple[str, str], Callable[[str], str | None]] = {
    ("saml", "sp_key"): sp_key_problem
}
"""Per secret, why a value is unusable (None when it is usable); never quoting it."""


class OAuthClientBody(_Body):
    name: OneLineName
    scopes: tuple[str, ...] = Field(min_length=1, max_length=16)


def refuse_repeat(outcome: CommandOutcome, issued: str, find_it: str) -> None:
    """A retry (same Idempotency-Key) of a write whose answer showed a secret once: the
    secret was never kept, so the retry cannot be answered from the first attempt.
    `find_it` says where the first attempt's result shows (without its secret)."""
    if outcome.duplicate:
        raise Conflict(
            f"this Idempotency-Key already issued {issued}, which is shown only once; "
            f"{find_it}, or send the request with another Idempotency-Key",
            code="duplicate_request",
        )


async def live_user(ident: Identity, workspace_id: str, user_id: str) -> UserRow:
    user = await get_user(ident.db, workspace_id, user_id)
    if user is None or user.deleted:
        raise NotFound(f"user {echoed(user_id)} does not exist")
    return user


async def set_password(
    request: web.Request, ident: Identity, workspace_id: str, user_id: str, password: str
) -> None:
    await ident.vault.put(workspace_id, user_id, PASSWORD, await hash_password(password))
    await ident.ask(
        directory_key(workspace_id),
        RecordPasswordSet(
            by=actor_of(request),
            command_id=new_id("pwd-"),
            workspace_id=workspace_id,
            user_id=user_id,
            at=now(),
        ),
    )


async def revoke_sessions(
    ident: Identity,
    workspace_id: str,
    user_id: str,
    reason: str,
    by: str,
    keep: str | None = None,
) -> None:
    """Revoke the user's live sessions (all but `keep`, the caller's own, when given)."""
    for session_id in await user_session_ids(ident.db, workspace_id, user_id):
        if session_id == keep:
            continue
        await ident.ask(
            session_key(session_id),
            RevokeSession(
                by=by, command_id=new_id("rev-"), workspace_id=workspace_id, reason=reason, at=now()
            ),
        )


async def revoke_user_keys(request: web.Request, workspace_id: str, user_id: str) -> None:
    runtime, projections = request.app[RUNTIME], request.app[PROJECTIONS]
    for key_id in await user_api_keys(identity(request).db, workspace_id, user_id):
        command = RevokeApiKey(
            command_id=new_id("rk-"),
            workspace_id=workspace_id,
            key_id=key_id,
            at=now(),
            by=actor_of(request),
        )
        outcome = await runtime.ask(workspace_key(workspace_id), command)
        if outcome.cursor:
            await projections.wait_for(outcome.cursor, APPLY_TIMEOUT_S, names=KEY_MODELS)
        request.app[AUTH].forget_key(key_id)


async def cut_off(
    request: web.Request, ident: Identity, workspace_id: str, user_id: str, reason: str
) -> None:
    """A deactivated or deprovisioned user: end their sessions and revoke their API keys.
    (Both are also refused on every request from the moment the user row says so.)"""
    await revoke_sessions(ident, workspace_id, user_id, reason, actor_of(request))
    await revoke_user_keys(request, workspace_id, user_id)


async def finish_cut_off_before_reactivating(
    request: web.Request, ident: Identity, user: UserRow, active_after: bool | None
) -> None:
    """A deactivation is recorded first and cut off after; a cut-off that failed (a 503)
    leaves the user's keys and sessions refused only while the user stays inactive. While
    inactive, a user is issued no key and starts no session, so all they hold then is the
    deactivation's to end: a reactivation ends it first, and is not recorded if it cannot."""
    if user.active is False and not user.deleted and active_after is not False:
        await cut_off(request, ident, user.workspace_id, user.user_id, DEACTIVATED)


def _check_owner_rights(principal: Principal, roles: tuple[str, ...] | list[str]) -> None:
    if "owner" in roles and not holds_owner_power(principal):
        raise Forbidden(
            "only an owner may grant or remove the owner role, or manage an owner",
            code="owner_only",
        )


def _check_holds(principal: Principal, permissions: dict[str, Access], what: str) -> None:
    """A principal may only hand out, take away or wield rights it holds itself: without this,
    write on `users` alone (a custom role) could bind `admin` to its holder, redefine its own
    role, or set the password of an admin and sign in as them."""
    missing = sorted(d for d, a in permissions.items() if not allowed(principal, d, a))
    if missing:
        raise Forbidden(
            f"{what} needs rights the caller lacks on: {', '.join(missing)}",
            code="insufficient_scope",
        )


async def check_grantable(
    ident: Identity, principal: Principal, roles: tuple[str, ...] | list[str]
) -> None:
    """Granting or removing `roles` needs every right they carry (and owner for `owner`)."""
    _check_owner_rights(principal, roles)
    perms = await role_permissions(ident.db, principal.workspace_id, list(roles))
    _check_holds(principal, perms, "granting or removing these roles")


async def keep_an_owner(ident: Identity, workspace_id: str, leaving: str) -> None:
    """Refuse what would leave the workspace without an owner who can sign in: no one could
    then grant `owner`, mint a writing workspace key or change instance settings, and only
    `svc apikeys create` on the host would let anyone back in. (Read from the read model: two
    owners removing each other at the same instant can still both succeed.)"""
    owners = set(await active_owners(ident.db, workspace_id))
    if leaving in owners and owners <= {leaving}:
        raise Conflict(
            f"user {leaving} is the workspace's last owner who can sign in; make another user "
            "owner first",
            code="last_owner",
        )


async def check_manageable(ident: Identity, principal: Principal, user: UserRow) -> None:
    """Changing, deactivating, deleting a user or setting their password needs every right the
    user holds (and owner for an owner): no one takes over an account stronger than theirs."""
    if signed_in_user(principal) == user.user_id:
        return
    _check_owner_rights(principal, user.roles)
    perms = await role_permissions(ident.db, user.workspace_id, user.roles)
    _check_holds(principal, perms, f"managing user {user.user_id}")


async def list_users_handler(request: web.Request) -> web.Response:
    principal = await acting(request, "users", "read")
    page = read_query(request, UserListQuery)
    users, total = await list_users(
        identity(request).db,
        principal.workspace_id,
        user_name=page.user_name,
        offset=page.offset,
        limit=page.limit,
    )
    return json({"items": [user_view(u) for u in users], "total": total})


async def create_user(request: web.Request) -> web.Response:
    principal = await acting(request, "users", "write")
    read_query(request, NoQuery)
    body = await read_json(request, NewUser)
    ident = identity(request)
    await check_grantable(ident, principal, body.roles)
    ws = principal.workspace_id
    user_id = new_id("usr_")
    profile = UserProfile.model_validate(body.model_dump(exclude={"password", "roles"}))
    outcome = await ident.ask(
        directory_key(ws),
        ProvisionUser(
            by=actor_of(request),
            command_id=command_id(request),
            workspace_id=ws,
            user_id=user_id,
            profile=profile,
            source="local",
            roles=body.roles,
            at=now(),
        ),
    )
    if outcome.duplicate:  # a retry: the user its first attempt provisioned
        first = (e.user_id for e in outcome.events if isinstance(e, UserProvisioned))
        user_id = next(first, user_id)
    user = await live_user(ident, ws, user_id)
    # A retry sets the password only where its first attempt did not get that far, and only
    # on an account this principal may manage (the retry may come from another principal
    # with the key, and the account may have been made an owner since).
    if body.password is not None and not (outcome.duplicate and user.has_password):
        if outcome.duplicate:
            await check_manageable(ident, principal, user)
        await set_password(request, ident, ws, user_id, body.password.get_secret_value())
        user = await live_user(ident, ws, user_id)
    return json(user_view(user), status=201)


async def get_user_handler(request: web.Request) -> web.Response:
    principal = await acting(request, "users", "read")
    read_query(request, NoQuery)
    user = await live_user(identity(request), principal.workspace_id, request.match_info["id"])
    return json(user_view(user))


async def patch_user(request: web.Request) -> web.Response:
    principal = await identify(request)
    read_query(request, NoQuery)
    target = request.match_info["id"]
    oneself = signed_in_user(principal) == target
    if not oneself:
        require_access(principal, "users", "write")
    body = await read_json(request, UserPatch)
    changed = body.model_fields_set
    own_names_only = oneself and changed <= SELF_EDITABLE
    if not own_names_only:
        require_access(principal, "users", "write")
    if target == principal.user_id and "active" in changed:
        raise Forbidden(
            "you cannot deactivate or reactivate your own account; ask another admin",
            code="insufficient_scope",
        )
    ident = identity(request)
    changes = body.model_dump(exclude_unset=True)
    # Before anything is done: a refused Idempotency-Key must not follow a reactivation's
    # revocations (finish_cut_off_before_reactivating).
    cid = command_id(request)

    async def attempt() -> UserRow:
        user = await live_user(ident, principal.workspace_id, target)
        if not own_names_only:
            await check_manageable(ident, principal, user)
        if body.active is False and "owner" in user.roles:
            await keep_an_owner(ident, principal.workspace_id, user.user_id)
        _check_shown_changes(changes, user)
        renamed = {f for f in changed & DIRECTORY_MATCHED if getattr(body, f) != getattr(user, f)}
        if user.source in DIRECTORY_SOURCES | {"scim"} and renamed:
            # A sign-in through the directory finds the account by these and syncs its
            # roles: renamed onto another entry, the account (its keys, its sessions) would
            # receive that entry's roles, which no one who renamed it need hold.
            raise Conflict(
                f"user {user.user_id} is {user.source}'s: its user_name and external_id are "
                "the directory's (change them there)",
                code="external_account",
            )
        # Merged as plain data and validated whole: `model_copy(update=...)` would put the
        # dumped emails (dicts) into the profile unvalidated, which pydantic then warns about
        # on every dump. A field set to null is validated like any value (null user_name is
        # a 400).
        base = profile_of(user)
        profile = UserProfile.model_validate({**base.model_dump(), **changes})
        await finish_cut_off_before_reactivating(request, ident, user, profile.active)
        await ident.ask(
            directory_key(principal.workspace_id),
            UpdateUser(
                by=actor_of(request),
                command_id=cid,
                workspace_id=principal.workspace_id,
                user_id=user.user_id,
                profile=profile,
                at=now(),
                base=base,
            ),
        )
        return user

    user = await retried_if_changed(ident, attempt)
    ws = principal.workspace_id
    if body.active is False and not (await live_user(ident, ws, user.user_id)).usable:
        # Judged by the user as they are now, not by the body: a retried deactivation that
        # finds the user reactivated since must not revoke the credentials issued after
        # (the reactivation finished this deactivation's cut-off before it was recorded).
        await cut_off(request, ident, ws, user.user_id, DEACTIVATED)
    return json(user_view(await live_user(ident, ws, user.user_id)))


async def deprovision(
    ident: Identity, request: web.Request, workspace_id: str, user_id: str, command: str
) -> None:
    """`command`: the command id (the admin API's Idempotency-Key; SCIM's own). 404 when
    another request deleted the user first: this command then recorded nothing, so its
    retry, which the ledger does not know, would be a 404 too; both answers agree."""
    outcome = await ident.ask(
        directory_key(workspace_id), _deprovision(request, workspace_id, user_id, command)
    )
    if not outcome.events:
        raise NotFound(f"user {echoed(user_id)} does not exist in this workspace")
    await cut_off(request, ident, workspace_id, user_id, DEPROVISIONED)


def _deprovision(
    request: web.Request, workspace_id: str, user_id: str, command: str
) -> DeprovisionUser:
    return DeprovisionUser(
        by=actor_of(request),
        command_id=command,
        workspace_id=workspace_id,
        user_id=user_id,
        at=now(),
    )


async def delete_user(request: web.Request) -> web.Response:
    principal = await acting(request, "users", "write")
    read_query(request, NoQuery)
    await refuse_body(request)
    ident = identity(request)
    ws = principal.workspace_id
    gone = await get_user(ident.db, ws, request.match_info["id"])
    if gone is not None and gone.deleted and await _deleted_by_this_key(request, ident, gone):
        # A retried delete whose deprovisioning was recorded, its cut-off perhaps not (a
        # revocation that failed): finish that, and answer as the first attempt would have.
        await cut_off(request, ident, ws, gone.user_id, DEPROVISIONED)
        return web.Response(status=204)
    user = await live_user(ident, ws, request.match_info["id"])
    await check_manageable(ident, principal, user)
    if "owner" in user.roles:
        await keep_an_owner(ident, principal.workspace_id, user.user_id)
    await deprovision(ident, request, principal.workspace_id, user.user_id, command_id(request))
    return web.Response(status=204)


async def _deleted_by_this_key(request: web.Request, ident: Identity, gone: UserRow) -> bool:
    """Whether this request's Idempotency-Key is the one that deleted `gone`. Only the ledger
    knows: the command sent again is answered from its first run when it was this deletion,
    refused (409 `idempotency_key_reused`) when the key ran another request, and records
    nothing when the key never ran, the user being gone already."""
    if idempotency_key(request) is None:
        return False
    again = _deprovision(request, gone.workspace_id, gone.user_id, command_id(request))
    return (await ident.ask(directory_key(gone.workspace_id), again)).duplicate


async def _check_current_password(
    request: web.Request, ident: Identity, user: UserRow, given: SecretStr | None
) -> None:
    """The password in force, for one's own change: counted and limited as a login is (a
    stolen session must not become a way to guess it)."""
    if given is None:
        raise InvalidInput(
            "changing your own password needs current_password, the one in force now",
            code="current_password_required",
        )
    await check_password_as_a_login(request, ident, user, given, local_password_matches)


async def put_password(request: web.Request) -> web.Response:
    user_id = request.match_info["id"]
    principal = await identify(request)
    read_query(request, NoQuery)
    if signed_in_user(principal) != user_id:  # one's own password needs no right on users
        require_access(principal, "users", "write")
    body = await read_json(request, PasswordBody)
    ident = identity(request)
    user = await live_user(ident, principal.workspace_id, user_id)
    await check_manageable(ident, principal, user)
    if signs_in_elsewhere(user, ident.settings):
        raise Conflict(
            f"user {user_id} signs in through {user.source}, which keeps its password; "
            "change it there",
            code="external_account",
        )
    if principal.user_id == user_id and user.has_password:
        # Any credential of the user's own (a session, an OIDC token, a key the user issued
        # themselves from a session): each would otherwise be a way around the check.
        await _check_current_password(request, ident, user, body.current_password)

    async def end_other_sessions() -> None:
        await revoke_sessions(
            ident,
            principal.workspace_id,
            user_id,
            "password changed",
            actor_of(request),
            keep=principal.attributes.get("session_id"),
        )

    # A new password ends every other session of the user (a reset after a compromise must
    # also cut the intruder's session); the caller's own session stays. Ended before the
    # change too: should the change then fail half-way (the new password stored, its event
    # not answered), the retry is refused (its current_password is no longer in force) and
    # would never get to end them. Again after it, for a session started in between.
    await end_other_sessions()
    await set_password(
        request, ident, principal.workspace_id, user_id, body.password.get_secret_value()
    )
    await end_other_sessions()
    return web.Response(status=204)


async def reset_totp(request: web.Request) -> web.Response:
    """Remove a user's TOTP second factor (a lost authenticator, or one an intruder
    enrolled); the user's sessions end with it, as after a password reset."""
    principal = await acting(request, "users", "write")
    read_query(request, NoQuery)
    await refuse_body(request)
    ident = identity(request)
    ws = principal.workspace_id
    user = await live_user(ident, ws, request.match_info["id"])
    await check_manageable(ident, principal, user)
    command = ResetTotp(
        by=actor_of(request),
        command_id=command_id(request),
        workspace_id=ws,
        user_id=user.user_id,
        at=now(),
    )
    by = actor_of(request)
    if user.totp_enrolled:
        # Ended before the reset too: should it fail half-way (its event recorded, the
        # answer a 503), its retry finds nothing enrolled and would end none.
        await revoke_sessions(ident, ws, user.user_id, "second factor reset", by)
    outcome = await ident.ask(directory_key(ws), command)
    # After the event: should these fail, the user signs in without a code (the read model
    # says none is enrolled), and a secret left behind is never asked for again.
    for name in (TOTP, TOTP_PENDING):
        await ident.vault.delete(ws, user.user_id, name)
    if outcome.events:  # again, for a session started meanwhile; a retry's outcome (same
        # Idempotency-Key) carries the first run's events, so it finishes the job too
        await revoke_sessions(ident, ws, user.user_id, "second factor reset", by)
    return json(user_view(await live_user(ident, ws, user.user_id)))


async def bind_role(request: web.Request) -> web.Response:
    principal = await acting(request, "users", "write")
    read_query(request, NoQuery)
    body = await read_json(request, RoleBody)
    ident = identity(request)
    await check_grantable(ident, principal, (body.role,))
    user = await live_user(ident, principal.workspace_id, request.match_info["id"])
    await ident.ask(
        directory_key(principal.workspace_id),
        BindRole(
            by=actor_of(request),
            command_id=command_id(request),
            workspace_id=principal.workspace_id,
            user_id=user.user_id,
            role=body.role,
            at=now(),
        ),
    )
    return json(user_view(await live_user(ident, principal.workspace_id, user.user_id)))


async def unbind_role(request: web.Request) -> web.Response:
    principal = await acting(request, "users", "write")
    read_query(request, NoQuery)
    await refuse_body(request)
    role = request.match_info["role"]
    ident = identity(request)
    await check_grantable(ident, principal, (role,))
    user = await live_user(ident, principal.workspace_id, request.match_info["id"])
    if role == "owner" and role in user.roles:
        await keep_an_owner(ident, principal.workspace_id, user.user_id)
    await ident.ask(
        directory_key(principal.workspace_id),
        UnbindRole(
            by=actor_of(request),
            command_id=command_id(request),
            workspace_id=principal.workspace_id,
            user_id=user.user_id,
            role=RoleBody(role=role).role,
            at=now(),
        ),
    )
    return json(user_view(await live_user(ident, principal.workspace_id, user.user_id)))


async def issue_user_key(request: web.Request) -> web.Response:
    """An API key that belongs to a user: shown once, revoked with the user. A user principal
    cannot hand out admin scopes it does not hold itself."""
    principal = await acting(request, "apikeys", "write")
    read_query(request, NoQuery)
    # A workspace key's body and rules (name, scopes, limit, expiry): both kinds of key are
    # listed together, and answered alike.
    body = await read_json(request, ApiKeyCreate)
    scopes = tuple(body.scopes)
    check_delegation(principal, scopes, for_user=True)
    ident = identity(request)
    ws = principal.workspace_id
    user = await live_user(ident, ws, request.match_info["id"])
    if principal.user_id != user.user_id and not holds_owner_power(principal):
        # A key acts as its user, whatever roles the user holds later: one an admin kept of
        # another admin's account would carry owner once that admin were made owner.
        raise Forbidden(
            "only the user themselves or an owner may issue a key on a user's account",
            code="owner_only",
        )
    await check_manageable(ident, principal, user)
    if not user.usable:
        raise Conflict(
            f"user {user.user_id} is deactivated: no key can be issued on the account",
            code="user_inactive",
        )
    issue, key = issue_command(command_id(request), ws, body, actor_of(request))
    key_id = issue.key_id
    outcome = await request.app[RUNTIME].ask(workspace_key(ws), issue)
    refuse_repeat(outcome, "a key", "GET /v1/admin/apikeys lists it (its name and prefix)")
    if outcome.cursor:
        await request.app[PROJECTIONS].wait_for(outcome.cursor, APPLY_TIMEOUT_S, names=KEY_MODELS)
    link = LinkApiKey(
        by=actor_of(request),
        command_id=new_id("link-"),
        workspace_id=ws,
        user_id=user.user_id,
        key_id=key_id,
        at=now(),
    )
    try:
        await ident.ask(directory_key(ws), link)
    except Exception:
        await _revoke_unshown(request, ws, key_id)
        raise
    shown = new_key(request, issue, key, outcome.cursor).model_dump()
    issued = IssuedUserKey(**{**shown, "key_id": key_id, "user_id": user.user_id})
    return json(issued.model_dump(mode="json"), status=201, headers={"Cache-Control": "no-store"})


async def _revoke_unshown(request: web.Request, workspace_id: str, key_id: str) -> None:
    """A user's key whose link to the user failed (the database away, the user deactivated
    meanwhile) is never shown, so no one holds it; left live, it would stay a key of no
    user, which the user's deactivation would not revoke. Best effort: a revocation that
    fails too is logged, and the caller's error stands."""
    revoke = RevokeApiKey(
        command_id=new_id("rk-"),
        workspace_id=workspace_id,
        key_id=key_id,
        at=now(),
        by=actor_of(request),
    )
    try:
        outcome = await request.app[RUNTIME].ask(workspace_key(workspace_id), revoke)
        if outcome.cursor:
            await request.app[PROJECTIONS].wait_for(
                outcome.cursor, APPLY_TIMEOUT_S, names=KEY_MODELS
            )
    except SvcError as exc:
        log.warning("the unshown key %s could not be revoked: %s", key_id, exc.message)
    request.app[AUTH].forget_key(key_id)


async def list_roles(request: web.Request) -> web.Response:
    principal = await acting(request, "users", "read")
    read_query(request, NoQuery)
    custom = await list_custom_roles(identity(request).db, principal.workspace_id)
    items: list[dict[str, Any]] = [
        {"name": name, "builtin": True, "permissions": perms}
        for name, perms in BUILTIN_ROLES.items()
    ]
    items += [{"name": n, "builtin": False, "permissions": p} for n, p in custom.items()]
    return json({"items": items})


async def define_role(request: web.Request) -> web.Response:
    principal = await acting(request, "users", "write")
    read_query(request, NoQuery)
    body = await read_json(request, CustomRoleBody)
    ident = identity(request)
    # Defining (or redefining) a role needs every right it grants now and granted before.
    await check_grantable(ident, principal, (body.name,))
    _check_holds(principal, body.permissions, f"defining role {body.name}")
    await ident.ask(
        directory_key(principal.workspace_id),
        DefineCustomRole(
            by=actor_of(request),
            command_id=command_id(request),
            workspace_id=principal.workspace_id,
            role=body.name,
            permissions=body.permissions,
            at=now(),
        ),
    )
    return json({"name": body.name, "builtin": False, "permissions": body.permissions}, status=201)


async def scim_token(request: web.Request) -> web.Response:
    """Issue (or rotate: the same thing when one exists) or revoke the workspace's SCIM token.
    The token is in the response once and never again."""
    principal = await acting(request, "security", "write")
    if not principal.allows("admin:write"):
        # The token creates, changes and deletes any (non-owner) user and sets passwords: it is
        # worth write on every domain, so only such a principal may hold it.
        raise Forbidden(
            "the SCIM token needs write access on every domain (owner, admin or admin:write)",
            code="insufficient_scope",
        )
    read_query(request, NoQuery)
    body = ScimTokenBody()  # the body is optional: none issues (or rotates)
    if request.can_read_body:
        body = await read_json(request, ScimTokenBody)
    ident = identity(request)
    key = directory_key(principal.workspace_id)
    if body.action == "revoke":
        await ident.ask(
            key,
            RevokeScimToken(
                by=actor_of(request),
                command_id=command_id(request),
                workspace_id=principal.workspace_id,
                at=now(),
            ),
        )
        return json({"revoked": True})
    token = SCIM_TOKEN_PREFIX + generate_key().removeprefix("svc_")
    token_id = new_id("scim_")
    outcome = await ident.ask(
        key,
        IssueScimToken(
            by=actor_of(request),
            command_id=command_id(request),
            workspace_id=principal.workspace_id,
            token_id=token_id,
            token_hash=hash_key(token),
            prefix=token[:12],
            at=now(),
        ),
    )
    refuse_repeat(outcome, "a SCIM token", "rotate it to get a new one")
    return json(
        {"token": token, "token_id": token_id, "prefix": token[:12]},
        status=201,
        headers={"Cache-Control": "no-store"},
    )


async def put_secret(request: web.Request) -> web.Response:
    """Set an SSO secret (the LDAP bind password, the SAML SP key). Instance-wide, so only a
    principal of the default workspace with write on `security` (an owner, or a `*` or
    admin:write key). Write-only: no endpoint ever returns it."""
    principal = await acting(request, "security", "write")
    require_instance_admin(principal, request, "instance secrets")
    read_query(request, NoQuery)
    name = (request.match_info["scope"], request.match_info["name"])
    if name not in INSTANCE_SECRETS:
        known = ", ".join(f"{scope}/{secret}" for scope, secret in sorted(INSTANCE_SECRETS))
        raise NotFound(
            f"no secret {echoed(name[0])}/{echoed(name[1])}; the secrets are {known}",
            code="unknown_secret",
        )
    if not principal.allows("admin:write") or not holds_owner_power(principal):
        # An SSO secret (the LDAP bind password, the SAML key) decides who signs in as whom.
        raise Forbidden("instance secrets need an owner or an admin:write key", code="owner_only")
    body = await read_json(request, SecretBody)
    value = body.value.get_secret_value()
    problem = SECRET_CHECKS[name](value) if name in SECRET_CHECKS else None
    if problem:
        # Refused when set: pysaml2 read it only at the next SAML request, and failed there.
        raise InvalidInput(f"{name[0]}/{name[1]}: {problem}", code="invalid_secret")
    ident = identity(request)
    await ident.vault.put(INSTANCE, *name, value)
    await ident.ask(
        directory_key(principal.workspace_id),
        RecordSsoSecretSet(
            by=actor_of(request),
            command_id=new_id("sso-secret-"),
            workspace_id=principal.workspace_id,
            scope=name[0],
            name=name[1],
            at=now(),
        ),
    )
    return web.Response(status=204)


async def register_client(request: web.Request) -> web.Response:
    principal = await acting(request, "security", "write")
    read_query(request, NoQuery)
    body = await read_json(request, OAuthClientBody)
    problem = unknown_scopes(body.scopes)
    if problem:
        raise InvalidInput(problem, code="invalid_scope")
    check_delegation(principal, body.scopes)
    client_id, secret = new_client_credentials()
    outcome = await identity(request).ask(
        directory_key(principal.workspace_id),
        RegisterOAuthClient(
            by=actor_of(request),
            command_id=command_id(request),
            workspace_id=principal.workspace_id,
            client_id=client_id,
            name=body.name,
            secret_hash=secret_hash(secret),
            scopes=tuple(sorted(set(body.scopes))),
            at=now(),
        ),
    )
    refuse_repeat(
        outcome,
        "a client secret",
        "GET /v1/admin/audit?action=identity.oauth_client_registered names the client",
    )
    return json(
        {"client_id": client_id, "client_secret": secret, "scopes": sorted(set(body.scopes))},
        status=201,
        headers={"Cache-Control": "no-store"},
    )


async def list_clients(request: web.Request) -> web.Response:
    """The workspace's OAuth clients, to find the one to revoke (it had to be read from the
    audit log)."""
    principal = await acting(request, "security", "read")
    page = read_query(request, OAuthClientListQuery)
    clients, total = await list_oauth_clients(
        identity(request).db,
        principal.workspace_id,
        include_revoked=page.include_revoked,
        offset=page.offset,
        limit=page.limit,
    )
    items = [OAuthClientView.model_validate(asdict(client)) for client in clients]
    return json(OAuthClientPage(items=items, total=total).model_dump(mode="json"))


async def revoke_client(request: web.Request) -> web.Response:
    principal = await acting(request, "security", "write")
    read_query(request, NoQuery)
    await refuse_body(request)
    await _check_client_owner_rule(identity(request), principal, request.match_info["id"])
    await identity(request).ask(
        directory_key(principal.workspace_id),
        RevokeOAuthClient(
            by=actor_of(request),
            command_id=command_id(request),
            workspace_id=principal.workspace_id,
            client_id=request.match_info["id"],
            at=now(),
        ),
    )
    return web.Response(status=204)


async def _check_client_owner_rule(ident: Identity, principal: Principal, client_id: str) -> None:
    """A client that may write holds owner power (it answers to no role): revoking one is an
    owner's business, as registering one is, and as revoking such a workspace key is."""
    if holds_owner_power(principal):
        return
    client = await find_oauth_client(ident.db, client_id)
    if client is None or client.workspace_id != principal.workspace_id:
        return  # the directory actor answers for a client it does not know
    if writes_as_owner(client.scopes):
        raise Forbidden(
            "only an owner may revoke an OAuth client that holds owner power", code="owner_only"
        )


AUDIT_ACTIONS = IdentityProjector().audited_actions()


def _check_audit_action(action: str | None) -> None:
    """An action the log cannot hold is a mistake (`login_failed` for
    `identity.login_failed`), not an empty page."""
    if action is None or action in AUDIT_ACTIONS:
        return
    raise InvalidInput(
        f"action {quoted(action)} is not one the audit log holds"
        f"{nearest(action.lower(), AUDIT_ACTIONS)}; "
        "it holds " + ", ".join(sorted(AUDIT_ACTIONS))
    )


async def audit_log(request: web.Request) -> web.Response:
    principal = await acting(request, "audit", "read")
    page = read_query(request, AuditQuery)
    _check_audit_action(page.action)
    cursors = request.app[CURSORS]
    rows = await list_audit(
        identity(request).db,
        principal.workspace_id,
        limit=page.limit,
        before=await _audit_position(cursors, page.before),
        action=page.action,
    )
    # Entries are named by their sealed log position: the position itself would count the
    # events of every workspace (gateway/cursor_seal.py).
    items = [
        {
            "id": cursors.seal_audit(r.position),
            "at": r.at.isoformat(),
            "action": r.action,
            "user_id": r.user_id,
            "user_name": r.user_name,
            "client_ip": r.client_ip,
            "detail": r.detail,
        }
        for r in rows
    ]
    next_before = cursors.seal_audit(rows[-1].position) if len(rows) == page.limit else None
    return json({"items": items, "next_cursor": next_before})


async def _audit_position(cursors: CursorSeal, before: str | None) -> int | None:
    if not before:
        return None
    try:
        return await open_audit_issued(cursors, before.strip())
    except InvalidCursor as exc:
        raise InvalidCursor(f"before: {exc.message}") from None
