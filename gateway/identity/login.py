"""Admin login, logout, the current session and TOTP enrolment.

`POST /v1/admin/auth/login` `{username, password, workspace_id?, totp_code?}`: the local
password (scrypt, vault) first; when that fails and SVC_LDAP_ENABLED, the directory (for users
that are unknown here or came from LDAP). Failed attempts are limited per account and per
client address (throttle.py) and recorded in the audit trail; every failure is the same 401
`unauthorized`, whether the user exists or not. A user with TOTP must send `totp_code`.
With SVC_REQUIRE_2FA a user without a second factor still gets a session, and the response
says `totp_enrolment_required: true` (the UI prompts them to enrol; they are not blocked).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, SecretStr

from actors.identity import audit_key, directory_key, session_key
from gateway.errors import read_json
from gateway.identity.authn import identify
from gateway.identity.common import (
    actor_of,
    command_id,
    first_attempt_ran,
    json,
    new_id,
    now,
    profile_of,
    retried_if_changed,
    signed_in_user,
    signs_in_elsewhere,
)
from gateway.identity.ldap import (
    BIND_SECRET,
    DirectoryUnavailable,
    config_from,
    ldap_authenticate,
    ldap_entry_exists,
    ldap_find,
    ldap_password_binds,
)
from gateway.identity.passwords import MAX_LENGTH, verify_password
from gateway.identity.service import Identity, identity
from gateway.identity.sessions import (
    SESSION_COOKIE,
    NewSession,
    clear_session_cookies,
    new_session,
    set_session_cookies,
)
from gateway.identity.throttle import Reservation
from gateway.identity.totp import REUSED, new_secret, provisioning_uri
from gateway.identity.vault import INSTANCE, PASSWORD, TOTP, TOTP_PENDING
from gateway.security import client_ip
from gateway.state import Principal
from projections.identity_queries import UserRow, find_user_by_name, get_user
from projections.queries import get_workspace
from schemas.errors import (
    Conflict,
    Forbidden,
    InvalidInput,
    RateLimited,
    SvcError,
    Unauthorized,
    Unavailable,
)
from schemas.identity import (
    ROLE_NAME_PATTERN,
    BindRole,
    LoginMethod,
    ProvisionUser,
    RecordLogin,
    RecordTotpEnrolled,
    RevokeSession,
    StartSession,
    UnbindRole,
    UpdateUser,
    UserProfile,
    secret_sized,
    user_name_key,
)

log = logging.getLogger(__name__)

BAD_CREDENTIALS = "invalid user name or password"


class InactiveAccount(Unauthorized):
    """The right password of a deactivated account: answered as any wrong one (the caller
    learns nothing of the account), recorded as what it was, so the audit does not show a
    user who tries to sign in after their deactivation as a guesser. (A deleted account is
    found by no name, and keeps no password.)"""

    reason = "sign_in_failed: user_deactivated"

    def __init__(self) -> None:
        super().__init__(BAD_CREDENTIALS, code="unauthorized")


@dataclass(frozen=True, slots=True)
class ExternalUser:
    """A user a directory (LDAP) or an identity provider (SAML) vouched for."""

    source: Literal["ldap", "saml"]
    login: str
    external_id: str
    display_name: str | None
    email: str | None
    role: str | None


class LoginRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    username: str = Field(min_length=1, max_length=256)
    password: Annotated[SecretStr, secret_sized(1, MAX_LENGTH)]
    workspace_id: str | None = Field(default=None, min_length=1, max_length=200)
    totp_code: str | None = Field(default=None, max_length=12)


class TotpCode(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    code: str = Field(min_length=6, max_length=12)


class TotpEnrolmentRequest(BaseModel):
    """The password the account signs in with: a session taken with its CSRF token must not
    enrol a second factor of its own, which would lock the real user out."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    current_password: Annotated[SecretStr, secret_sized(1, MAX_LENGTH)]


async def _record(
    request: web.Request,
    ident: Identity,
    workspace_id: str,
    user_name: str,
    user_id: str | None,
    method: LoginMethod,
    reason: str,
) -> None:
    command = RecordLogin(
        command_id=new_id("login-"),
        workspace_id=workspace_id,
        user_name=user_name,
        user_id=user_id,
        method=method,
        succeeded=not reason,
        reason=reason,
        client_ip=client_ip(request),
        at=now(),
    )
    await ident.ask(audit_key(workspace_id), command)


async def _refused(
    request: web.Request,
    ident: Identity,
    workspace_id: str,
    typed: str,
    user: UserRow | None,
    method: LoginMethod,
    exc: SvcError,
) -> None:
    """Audit a sign-in that did not end in a session (the attempt stays counted by the
    throttle): a wrong credential, and any other refusal too (a directory sign-in whose
    account sync failed: the directory had taken the password). A workspace that does not
    exist gets no record: a body naming made-up ones would grow the log for nothing."""
    default = ident.settings.default_workspace_id
    if workspace_id != default and await get_workspace(ident.db, workspace_id) is None:
        return
    if isinstance(exc, InactiveAccount):
        reason = exc.reason
    elif isinstance(exc, Unauthorized):
        reason = "bad_credentials" if user is None else "bad_second_factor"
    else:
        reason = f"sign_in_failed: {exc.code}"[:100]
    name, user_id = (typed, user.user_id) if user else await _typed_name(ident, workspace_id, typed)
    try:
        await _record(request, ident, workspace_id, name, user_id, method, reason)
    except SvcError as failure:
        if isinstance(exc, Unauthorized):
            raise  # as before: a refusal is answered only once it is on record
        log.warning("a refused sign-in could not be recorded: %s", failure.message)


async def record_refused_assertion(
    request: web.Request, ident: Identity, workspace_id: str, subject: str, exc: SvcError
) -> None:
    """Audit a SAML sign-in refused after its assertion was verified (an account that may
    not sign in with SAML, a failed sync): the IdP vouched for `subject`, so it is recorded
    as sent, with the refusal's code. Best effort: the refusal is answered either way."""
    try:
        reason = f"sign_in_failed: {exc.code}"[:100]
        await _record(request, ident, workspace_id, subject, None, "saml", reason)
    except SvcError as failure:
        log.warning("a refused sign-in could not be recorded: %s", failure.message)


async def _typed_name(ident: Identity, workspace_id: str, typed: str) -> tuple[str, str | None]:
    """The user name and id a failed login is recorded with: the user it was made against,
    so that reading a user's entries shows the guesses at their password. A name no user of
    the workspace has may be a password typed into the wrong field, and the audit trail is
    kept for good: only its first character and its length are recorded."""
    named = await find_user_by_name(ident.db, workspace_id, typed)
    if named is not None:
        return typed, named.user_id
    return f"{typed[:1]}... ({len(typed)} characters, no such user)", None


async def _local(ident: Identity, workspace_id: str, body: LoginRequest) -> UserRow | None:
    user = await find_user_by_name(ident.db, workspace_id, body.username)
    stored = None
    if user is not None and user.has_password and not signs_in_elsewhere(user, ident.settings):
        stored = await ident.vault.get(workspace_id, user.user_id, PASSWORD)
    ok = await verify_password(body.password.get_secret_value(), stored)
    if ok and user is not None and not user.usable:
        raise InactiveAccount()
    return user if ok else None


async def sync_external_user(
    ident: Identity,
    workspace_id: str,
    found: ExternalUser,
    existing: UserRow | None,
) -> UserRow:
    """Create or update the local user a directory or an IdP vouched for, with exactly the
    role its groups map to (none when nothing maps and there is no default). A user a SCIM
    client provisioned keeps the profile that client gave it (its `externalId` above all,
    by which the client finds it again): the sign-in brings the roles only."""
    at = now()
    key = directory_key(workspace_id)
    roles = (found.role,) if found.role else ()
    if found.role and re.fullmatch(ROLE_NAME_PATTERN, found.role) is None:
        # A mapping stored before role names were checked when set (schemas/settings_catalog
        # `new_rule`): no role has that name.
        raise _mapping_problem(found)

    def stamp() -> dict[str, Any]:
        """The fields every command of this sync shares; each command's own are typed."""
        return {
            "by": found.source,
            "command_id": new_id(f"{found.source}-"),
            "workspace_id": workspace_id,
            "at": at,
        }

    if existing is None:
        user_id = new_id("usr_")
        profile = _synced_profile(found, None)
        provision = ProvisionUser(
            **stamp(), user_id=user_id, profile=profile, source=found.source, roles=roles
        )
        await _with_mapped_roles(found, ident.ask(key, provision))
    else:
        user_id = existing.user_id
        # The mapped role is bound before any other is taken away: a role the workspace does
        # not have must not leave the user stripped of the ones it held.
        for role in roles:
            bind = BindRole(**stamp(), user_id=user_id, role=role)
            await _with_mapped_roles(found, ident.ask(key, bind))
        for role in existing.roles:
            if role not in roles:
                await ident.ask(key, UnbindRole(**stamp(), user_id=user_id, role=role))
        if existing.source != "scim":
            # Made from the read model's copy, as an admin's change is: one that landed since
            # (a deactivation while the directory answered) refuses it, not undone by it, and
            # the sign-in's own change is made again over it.
            first_read: UserRow | None = existing

            async def update() -> None:
                nonlocal first_read
                current = first_read or await get_user(ident.db, workspace_id, user_id)
                first_read = None  # a try after a refusal reads the user again
                if current is None or current.deleted:  # deprovisioned meanwhile
                    raise Unauthorized(BAD_CREDENTIALS)
                synced = _synced_profile(found, current)
                base = profile_of(current)
                await ident.ask(
                    key, UpdateUser(**stamp(), user_id=user_id, profile=synced, base=base)
                )

            await retried_if_changed(ident, update)
    user = await get_user(ident.db, workspace_id, user_id)
    if user is None:
        raise Unauthorized(BAD_CREDENTIALS)
    return user


def _synced_profile(found: ExternalUser, existing: UserRow | None) -> UserProfile:
    """The profile a sign-in leaves: the display name, address and entry the directory (or
    IdP) vouches for, over what the account holds besides. The given and family names its
    user set stay, and so do the other addresses an administrator added, after the
    directory's own (the primary one); what the directory sends nothing for is left as it is."""
    profile: dict[str, Any] = {"user_name": found.login, "external_id": found.external_id}
    if existing is not None:
        profile |= {
            "active": existing.active,
            "user_name": existing.user_name,
            "display_name": existing.display_name,
            "given_name": existing.given_name,
            "family_name": existing.family_name,
            "emails": existing.emails,
        }
    if found.display_name:
        profile["display_name"] = found.display_name
    if found.email:
        # The directory's address is the primary one: it replaces the primary before it (the
        # directory's old address, when it changed), and the others stay.
        others = [
            email
            for email in profile.get("emails", ())
            if not email.get("primary") and str(email["value"]).casefold() != found.email.casefold()
        ]
        profile["emails"] = [{"value": found.email, "primary": True}, *others]
    return UserProfile.model_validate(profile)


async def _with_mapped_roles(found: ExternalUser, asked: Awaitable[Any]) -> None:
    """`asked`, with a refusal of the mapped role told as the configuration problem it is:
    the sign-in itself was right, and only the instance's owner can fix it."""
    try:
        await asked
    except InvalidInput as exc:
        if exc.code != "unknown_role":
            raise
        raise _mapping_problem(found) from None


def _mapping_problem(found: ExternalUser) -> Unavailable:
    prefix = f"SVC_{found.source.upper()}"
    return Unavailable(
        f"{prefix}_ROLE_MAPPINGS or {prefix}_DEFAULT_ROLE names the role {found.role!r}, "
        "which this workspace does not have: create the role, or correct the setting",
        code=f"{found.source}_not_configured",
    )


def same_entry(recorded: str | None, presented: str) -> bool:
    """Whether an account's recorded external id (a DN, a NameID) names the entry that just
    proved itself; an account with none recorded is claimed by its first sign-in. DNs
    compare case-insensitively, as directories treat them."""
    return recorded is None or recorded.casefold() == presented.casefold()


async def _directory_applies(
    ident: Identity, workspace_id: str, body: LoginRequest
) -> tuple[bool, UserRow | None]:
    """Whether the directory is to be asked (what the audit then names as the method
    tried, whatever the outcome), and the account of that name, if any."""
    if not ident.settings.flag("SVC_LDAP_ENABLED") or not body.password.get_secret_value():
        return False, None
    existing = await find_user_by_name(ident.db, workspace_id, body.username)
    if existing is not None and (existing.source != "ldap" or not existing.usable):
        return False, None
    return True, existing


async def _ldap_sign_in(
    ident: Identity,
    workspace_id: str,
    body: LoginRequest,
    attempt: Reservation,
    existing: UserRow | None,
) -> UserRow | None:
    password = body.password.get_secret_value()
    secret = await ident.vault.get(INSTANCE, *BIND_SECRET) or ""
    config = config_from(ident.settings, secret)
    found = await ldap_find(config, body.username)
    if found is None:
        return None
    # The guess is the bind: counted first under the entry's own name, which every other
    # name the filter matches (an address, an alias) reaches too.
    await ident.throttle.count_also(attempt, workspace_id, found.login)
    if not await ldap_password_binds(config, found, password):
        return None
    if existing is None or user_name_key(existing.user_name) != user_name_key(found.login):
        # The directory matched the entry under a name other than the one typed (spaces it
        # ignores, a filter on another attribute): the account is the entry's own.
        existing = await find_user_by_name(ident.db, workspace_id, found.login)
        if existing is not None and (existing.source != "ldap" or not existing.usable):
            return None
    if existing is not None and not same_entry(existing.external_id, found.dn):
        # An account renamed onto this entry's name (by whoever may rename users) is still
        # the other entry's while that entry exists: taking it over would hand its sign-ins
        # to this one. An entry the directory moved (its DN changed) left no entry behind.
        recorded = existing.external_id or ""
        if await ldap_entry_exists(config, recorded):
            return None
    external = ExternalUser(
        source="ldap",
        login=found.login,
        external_id=found.dn,
        display_name=found.display_name,
        email=found.email,
        role=found.role,
    )
    user = await sync_external_user(ident, workspace_id, external, existing)
    # Deactivated or deprovisioned while the directory answered: no session.
    return user if user.usable else None


async def start_session(
    request: web.Request,
    ident: Identity,
    user: UserRow,
    method: LoginMethod,
    second_factor: bool,
) -> tuple[NewSession, dict[str, Any]]:
    """Record the session and the successful login; the caller sets the cookies."""
    session = new_session()
    await ident.ask(
        session_key(session.session_id),
        StartSession(
            command_id=new_id("ses-"),
            workspace_id=user.workspace_id,
            session_id=session.session_id,
            user_id=user.user_id,
            token_hash=session.token_hash,
            method=method,
            second_factor=second_factor,
            expires_at=session.expires_at,
            at=now(),
        ),
    )
    await _record(request, ident, user.workspace_id, user.user_name, user.user_id, method, "")
    prompt = ident.settings.flag("SVC_REQUIRE_2FA") and not user.totp_enrolled
    body: dict[str, Any] = {
        "user": {
            "id": user.user_id,
            "user_name": user.user_name,
            "workspace_id": user.workspace_id,
            "roles": user.roles,
        },
        "session_id": session.session_id,
        "csrf_token": session.csrf_token,
        "expires_at": session.expires_at.isoformat(),
        "second_factor": second_factor,
        "totp_enrolment_required": prompt,
    }
    if prompt:
        body["totp_enrolment_url"] = "/v1/admin/auth/totp/enrol"
    return session, body


async def _second_factor(ident: Identity, user: UserRow, code: str | None) -> bool:
    if not user.totp_enrolled:
        return False
    secret = await ident.vault.get(user.workspace_id, user.user_id, TOTP)
    if not code or secret is None:
        raise Unauthorized(
            "a valid TOTP code is required: send totp_code, the code the authenticator app "
            "shows, with the user name and password",
            code="unauthorized",
        )
    outcome = await ident.totp.check(user.workspace_id, user.user_id, secret, code)
    if outcome == "reused":
        raise Unauthorized(REUSED, code="unauthorized")
    if outcome == "wrong":
        raise Unauthorized(_WRONG_CODE, code="unauthorized")
    return True


_WRONG_CODE = (
    "the TOTP code does not match: send the code the authenticator app shows now (if it "
    "still fails, check the clock of the device)"
)


async def login(request: web.Request) -> web.Response:
    # Only application/json: a cross-site HTML form (text/plain, urlencoded) cannot send it
    # without a CORS preflight, so another site cannot sign a browser in as its own user.
    if request.content_type != "application/json":
        raise InvalidInput("the login body must be application/json", code="unsupported_media_type")
    body = await read_json(request, LoginRequest)
    ident = identity(request)
    workspace_id = body.workspace_id or ident.settings.default_workspace_id
    address = client_ip(request)
    attempt = await ident.throttle.reserve(workspace_id, body.username, address)
    method: LoginMethod = "password"
    user: UserRow | None = None
    try:
        user = await _local(ident, workspace_id, body)
        if (
            user is None
            and ident.settings.flag("SVC_LDAP_ENABLED")
            and workspace_id == ident.settings.default_workspace_id
        ):
            # The directory is the instance's, and its users belong to the default workspace,
            # as SAML's do: a body naming another workspace signs in with a local password
            # only. The audit names the method tried last: the directory only when it was.
            applies, existing = await _directory_applies(ident, workspace_id, body)
            if applies:
                method = "ldap"
                user = await _ldap_sign_in(ident, workspace_id, body, attempt, existing)
        if user is None:
            raise Unauthorized(BAD_CREDENTIALS)
        second = await _second_factor(ident, user, body.totp_code)
    except SvcError as exc:
        # Refused by the throttle, the attempt was given back: no record, as for one refused
        # before it began (a guesser at the limit would flood the log).
        if isinstance(exc, DirectoryUnavailable):
            await ident.throttle.unanswered(attempt)
        if not isinstance(exc, RateLimited):
            await _refused(request, ident, workspace_id, body.username, user, method, exc)
        raise exc from None
    await ident.throttle.succeeded(attempt)
    session, payload = await start_session(request, ident, user, method, second)
    response = json(payload, headers={"Cache-Control": "no-store"})
    set_session_cookies(request, response, session)
    return response


_NO_SESSION = "this endpoint needs an admin session cookie: sign in with POST /v1/admin/auth/login"


def _session_of(principal: Principal) -> str:
    session_id = principal.attributes.get("session_id")
    if principal.attributes.get("auth") != "session" or not session_id:
        raise Unauthorized(_NO_SESSION)
    return session_id


async def logout(request: web.Request) -> web.Response:
    if not request.cookies.get(SESSION_COOKIE) and "Authorization" not in request.headers:
        # Nothing sent: the refusal is the session's, not an API key's (QA finding).
        raise Unauthorized(_NO_SESSION)
    try:
        principal = await identify(request)
    except Unauthorized:
        if not request.cookies.get(SESSION_COOKIE) or "Authorization" in request.headers:
            raise  # not the session cookie's refusal: it may be live
        # A session already ended (this logout's retry after a lost answer, an expiry, a
        # revocation): the browser's cookies for it go, as the first logout's answer did.
        return _logged_out(request)
    session_id = _session_of(principal)
    await identity(request).ask(
        session_key(session_id),
        RevokeSession(
            by=actor_of(request),
            command_id=command_id(request),
            workspace_id=principal.workspace_id,
            reason="logout",
            at=now(),
        ),
    )
    return _logged_out(request)


def _logged_out(request: web.Request) -> web.Response:
    response = json({"logged_out": True})
    clear_session_cookies(request, response)
    return response


def _user_of(principal: Principal) -> str:
    user_id = signed_in_user(principal)
    if user_id is None:
        raise Unauthorized("this endpoint needs a signed-in user (session or OIDC token)")
    return user_id


async def current(request: web.Request) -> web.Response:
    principal = await identify(request)
    return json(
        {
            "workspace_id": principal.workspace_id,
            "user_id": principal.user_id,
            "user_name": principal.attributes.get("user_name"),
            "auth": principal.attributes.get("auth"),
            "scopes": sorted(principal.scopes),
        }
    )


_ALREADY_ENROLLED = (
    "a TOTP second factor is already enrolled; to replace it, an administrator removes it "
    "first (DELETE /v1/admin/users/{id}/totp)"
)


async def totp_enrol(request: web.Request) -> web.Response:
    principal = await identify(request)
    user_id = _user_of(principal)
    body = await read_json(request, TotpEnrolmentRequest)
    ident = identity(request)
    user = await get_user(ident.db, principal.workspace_id, user_id)
    if user is None or not user.usable:
        raise Unauthorized("invalid or expired session: log in again")
    if user.totp_enrolled:
        raise Conflict(_ALREADY_ENROLLED, code="totp_enrolled")
    await _check_sign_in_password(request, ident, user, body.current_password)
    secret = new_secret()
    await ident.vault.put(user.workspace_id, user_id, TOTP_PENDING, secret)
    return json(
        {"secret": secret, "otpauth_uri": provisioning_uri(secret, user.user_name)},
        headers={"Cache-Control": "no-store"},
    )


async def _check_sign_in_password(
    request: web.Request, ident: Identity, user: UserRow, given: SecretStr
) -> None:
    """`given` is the password `user` signs in with (this service's, or the directory's for
    an LDAP account), counted and limited as a login is: a stolen session must not become a
    way to guess it. TOTP guards password sign-ins: an account that signs in through an
    identity provider has none to give (its provider keeps its second factor)."""
    directory = user.source == "ldap" and ident.settings.flag("SVC_LDAP_ENABLED")
    if not directory and signs_in_elsewhere(user, ident.settings):
        raise Conflict(
            f"user {user.user_id} signs in through {user.source}, without a password here: "
            "its identity provider keeps its second factor",
            code="external_account",
        )
    if not directory and not user.has_password:
        raise Conflict(
            f"user {user.user_id} has no password to sign in with, which a TOTP second "
            "factor guards; set one first (PUT /v1/admin/users/{id}/password)",
            code="no_password",
        )
    if directory:
        await check_password_as_a_login(
            request, ident, user, given, _directory_password_matches, method="ldap"
        )
    else:
        await check_password_as_a_login(request, ident, user, given, local_password_matches)


PasswordCheck = Callable[[Identity, UserRow, str], Awaitable[bool]]


async def local_password_matches(ident: Identity, user: UserRow, password: str) -> bool:
    stored = await ident.vault.get(user.workspace_id, user.user_id, PASSWORD)
    return await verify_password(password, stored)


async def _directory_password_matches(ident: Identity, user: UserRow, password: str) -> bool:
    config = config_from(ident.settings, await ident.vault.get(INSTANCE, *BIND_SECRET) or "")
    found = await ldap_authenticate(config, user.user_name, password)
    return found is not None and same_entry(user.external_id, found.dn)


async def check_password_as_a_login(
    request: web.Request,
    ident: Identity,
    user: UserRow,
    given: SecretStr,
    matches: PasswordCheck,
    *,
    method: LoginMethod = "password",
) -> None:
    """`given` is `user`'s password (by `matches`), counted, limited and, when wrong,
    audited under the account's login name as a login is, the two sharing one limit: a
    stolen session must not become a way to guess it, unseen. 403 `wrong_password` when it
    is not."""
    attempt = await ident.throttle.reserve(user.workspace_id, user.user_name, client_ip(request))
    try:
        matched = await matches(ident, user, given.get_secret_value())
    except DirectoryUnavailable:
        await ident.throttle.unanswered(attempt)
        raise
    if not matched:
        await ident.throttle.failed(attempt)
        await _record(
            request,
            ident,
            user.workspace_id,
            user.user_name,
            user.user_id,
            method,
            "bad_current_password",
        )
        raise Forbidden("current_password is not the password in force", code="wrong_password")
    await ident.throttle.succeeded(attempt)


async def totp_verify(request: web.Request) -> web.Response:
    principal = await identify(request)
    user_id = _user_of(principal)
    body = await read_json(request, TotpCode)
    ident = identity(request)
    pending = await ident.vault.get(principal.workspace_id, user_id, TOTP_PENDING)
    recorded = RecordTotpEnrolled(
        by=actor_of(request),
        command_id=command_id(request),
        workspace_id=principal.workspace_id,
        user_id=user_id,
        at=now(),
    )
    if pending is None:
        if await first_attempt_ran(request, principal.workspace_id, recorded.command_id):
            # A retry (same Idempotency-Key) after its answer was lost: the enrolment it
            # confirmed is done, and the pending secret with it. Asked again, so that the
            # ledger answers it, the first run's outcome, or a 409 for a key another request
            # (another command, another user) used.
            await ident.ask(directory_key(principal.workspace_id), recorded)
            return json({"totp_enrolled": True})
        user = await get_user(ident.db, principal.workspace_id, user_id)
        if user is not None and user.totp_enrolled:
            raise Conflict(_ALREADY_ENROLLED, code="totp_enrolled")
        raise InvalidInput(
            "no TOTP enrolment is waiting to be confirmed: start one with "
            "POST /v1/admin/auth/totp/enrol, then send a code from it",
            code="totp_not_started",
        )
    outcome = await ident.totp.check(principal.workspace_id, user_id, pending, body.code)
    if outcome == "reused":
        raise InvalidInput(REUSED, code="totp_mismatch")
    if outcome == "wrong":
        raise InvalidInput(
            f"{_WRONG_CODE}; it must be the code of the secret enrolment just gave",
            code="totp_mismatch",
        )
    await ident.vault.put(principal.workspace_id, user_id, TOTP, pending)
    await ident.vault.delete(principal.workspace_id, user_id, TOTP_PENDING)
    await ident.ask(directory_key(principal.workspace_id), recorded)
    return json({"totp_enrolled": True})
