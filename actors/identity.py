"""Identity actors (schemas/identity.py): the workspace directory, admin sessions, the audit trail.

- `identity:<workspace_id>` holds users, role bindings, custom roles, the SCIM token and the
  OAuth clients of one workspace. Its single mailbox is what keeps user names unique.
- `session:<session_id>` is one admin session: started once, revoked at most once.
- `audit:<workspace_id>` records login outcomes; it keeps only a counter as state.

All three are pure decide/evolve cores; hashing, the vault and clocks live in gateway/identity.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field

from actors.behaviour import ActorKey, Behaviour
from schemas.commands import Command
from schemas.errors import Conflict, InvalidInput, NotFound, nearest
from schemas.events import Event
from schemas.identity import (
    BUILTIN_ROLES,
    USER_CHANGED,
    Access,
    BindRole,
    CustomRoleDefined,
    DefineCustomRole,
    DeprovisionUser,
    IssueScimToken,
    LinkApiKey,
    LoginFailed,
    LoginSucceeded,
    OAuthClientRegistered,
    OAuthClientRevoked,
    PasswordSet,
    ProvisionUser,
    RecordLogin,
    RecordPasswordSet,
    RecordSsoSecretSet,
    RecordTotpEnrolled,
    RegisterOAuthClient,
    ResetTotp,
    RevokeOAuthClient,
    RevokeScimToken,
    RevokeSession,
    RoleBound,
    RoleUnbound,
    ScimTokenIssued,
    ScimTokenRevoked,
    ScimTokenRotated,
    SessionRevoked,
    SessionStarted,
    SsoSecretSet,
    StartSession,
    TotpEnrolled,
    TotpReset,
    UnbindRole,
    UpdateUser,
    UserApiKeyLinked,
    UserDeprovisioned,
    UserProfile,
    UserProvisioned,
    UserUpdated,
    user_name_key,
)

DIRECTORY_KIND = "identity"
SESSION_KIND = "session"
AUDIT_KIND = "audit"


def directory_key(workspace_id: str) -> ActorKey:
    return ActorKey(DIRECTORY_KIND, workspace_id)


def session_key(session_id: str) -> ActorKey:
    return ActorKey(SESSION_KIND, session_id)


def audit_key(workspace_id: str) -> ActorKey:
    return ActorKey(AUDIT_KIND, workspace_id)


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class UserRecord(_Frozen):
    profile: UserProfile
    roles: tuple[str, ...] = ()
    deleted: bool = False
    has_password: bool = False
    totp: bool = False
    api_keys: tuple[str, ...] = ()


class DirectoryState(_Frozen):
    workspace_id: str
    users: dict[str, UserRecord] = Field(default_factory=dict)
    custom_roles: dict[str, dict[str, Access]] = Field(default_factory=dict)
    scim_token_id: str | None = None
    oauth_clients: dict[str, bool] = Field(default_factory=dict)
    """client id -> revoked"""

    def live_user(self, user_id: str) -> UserRecord:
        user = self.users.get(user_id)
        if user is None or user.deleted:
            raise NotFound(f"user {user_id} does not exist in this workspace")
        return user

    def holder_of(self, user_name: str) -> str | None:
        wanted = user_name_key(user_name)
        for user_id, user in self.users.items():
            if not user.deleted and user_name_key(user.profile.user_name) == wanted:
                return user_id
        return None

    def knows_role(self, role: str) -> bool:
        return role in BUILTIN_ROLES or role in self.custom_roles


def _check_workspace(state: DirectoryState, c: Command) -> None:
    if c.workspace_id != state.workspace_id:
        raise InvalidInput(f"{type(c).__name__} for {c.workspace_id} sent to {state.workspace_id}")


def _check_name_free(state: DirectoryState, user_name: str, user_id: str) -> None:
    holder = state.holder_of(user_name)
    if holder is not None and holder != user_id:
        raise Conflict(f"user name {user_name!r} is already taken", code="uniqueness")


def _check_roles(state: DirectoryState, roles: Sequence[str]) -> None:
    unknown = sorted(r for r in roles if not state.knows_role(r))
    if unknown:
        known = sorted({*BUILTIN_ROLES, *state.custom_roles})
        raise InvalidInput(
            f"unknown role {', '.join(unknown)}{nearest(unknown[0], known)}; the workspace's "
            f"roles: {', '.join(known)}"
            " (GET /v1/admin/roles; POST /v1/admin/roles defines one)",
            code="unknown_role",
        )


def _provision(state: DirectoryState, c: ProvisionUser) -> list[Event]:
    if c.user_id in state.users:
        raise Conflict(f"user id {c.user_id} is already used", code="uniqueness")
    _check_name_free(state, c.profile.user_name, c.user_id)
    _check_roles(state, c.roles)
    ws = state.workspace_id
    events: list[Event] = [
        UserProvisioned(
            by=c.by, workspace_id=ws, user_id=c.user_id, profile=c.profile, source=c.source, at=c.at
        )
    ]
    for role in dict.fromkeys(c.roles):
        events.append(RoleBound(by=c.by, workspace_id=ws, user_id=c.user_id, role=role, at=c.at))
    return events


def _update(state: DirectoryState, c: UpdateUser) -> list[Event]:
    user = state.live_user(c.user_id)
    if c.base is not None and c.base != user.profile:
        # A read-modify-write that read before another change landed: writing its profile
        # whole would undo that change (a deactivation brought back by a rename).
        raise Conflict(
            f"user {c.user_id} changed while this change was being made; read it again and retry",
            code=USER_CHANGED,
        )
    if user_name_key(c.profile.user_name) != user_name_key(user.profile.user_name):
        # Only a new name is checked: two users recorded under names that one key now
        # takes as the same (before the key existed) may each still be updated.
        _check_name_free(state, c.profile.user_name, c.user_id)
    if user.profile == c.profile:
        return []
    return [
        UserUpdated(
            by=c.by, workspace_id=state.workspace_id, user_id=c.user_id, profile=c.profile, at=c.at
        )
    ]


def _deprovision(state: DirectoryState, c: DeprovisionUser) -> list[Event]:
    user = state.users.get(c.user_id)
    if user is None:
        raise NotFound(f"user {c.user_id} does not exist in this workspace")
    if user.deleted:
        return []
    return [UserDeprovisioned(by=c.by, workspace_id=state.workspace_id, user_id=c.user_id, at=c.at)]


def _bind(state: DirectoryState, c: BindRole) -> list[Event]:
    user = state.live_user(c.user_id)
    _check_roles(state, [c.role])
    if c.role in user.roles:
        return []
    return [
        RoleBound(by=c.by, workspace_id=state.workspace_id, user_id=c.user_id, role=c.role, at=c.at)
    ]


def _unbind(state: DirectoryState, c: UnbindRole) -> list[Event]:
    user = state.live_user(c.user_id)
    if c.role not in user.roles:
        # Removing a role the user does not hold changes nothing (a retry of a removal
        # lands here); a role no one could hold is a mistake in the request, as in a bind.
        _check_roles(state, (c.role,))
        return []
    return [
        RoleUnbound(
            by=c.by, workspace_id=state.workspace_id, user_id=c.user_id, role=c.role, at=c.at
        )
    ]


def _define_role(state: DirectoryState, c: DefineCustomRole) -> list[Event]:
    if c.role in BUILTIN_ROLES:
        raise Conflict(f"{c.role} is a built-in role and cannot be redefined")
    if state.custom_roles.get(c.role) == c.permissions:
        return []
    return [
        CustomRoleDefined(
            by=c.by,
            workspace_id=state.workspace_id,
            role=c.role,
            permissions=c.permissions,
            at=c.at,
        )
    ]


def _password(state: DirectoryState, c: RecordPasswordSet) -> list[Event]:
    state.live_user(c.user_id)
    return [PasswordSet(by=c.by, workspace_id=state.workspace_id, user_id=c.user_id, at=c.at)]


def _sso_secret(state: DirectoryState, c: RecordSsoSecretSet) -> list[Event]:
    return [
        SsoSecretSet(by=c.by, workspace_id=state.workspace_id, scope=c.scope, name=c.name, at=c.at)
    ]


def _link_key(state: DirectoryState, c: LinkApiKey) -> list[Event]:
    user = state.live_user(c.user_id)
    if c.key_id in user.api_keys:
        return []
    if user.profile.active is False:
        # The deactivation revoked the keys linked before it; one linked now would be
        # skipped by it and come back to life with a reactivation, unlike every other
        # credential of the user (the caller revokes the key it could not link).
        raise Conflict(
            f"user {c.user_id} is deactivated: no key can be issued on the account",
            code="user_inactive",
        )
    return [
        UserApiKeyLinked(
            by=c.by, workspace_id=state.workspace_id, user_id=c.user_id, key_id=c.key_id, at=c.at
        )
    ]


def _totp(state: DirectoryState, c: RecordTotpEnrolled) -> list[Event]:
    state.live_user(c.user_id)
    return [TotpEnrolled(by=c.by, workspace_id=state.workspace_id, user_id=c.user_id, at=c.at)]


def _reset_totp(state: DirectoryState, c: ResetTotp) -> list[Event]:
    if not state.live_user(c.user_id).totp:
        return []
    return [TotpReset(by=c.by, workspace_id=state.workspace_id, user_id=c.user_id, at=c.at)]


def _issue_scim(state: DirectoryState, c: IssueScimToken) -> list[Event]:
    ws = state.workspace_id
    if state.scim_token_id is None:
        return [
            ScimTokenIssued(
                by=c.by,
                workspace_id=ws,
                token_id=c.token_id,
                token_hash=c.token_hash,
                prefix=c.prefix,
                at=c.at,
            )
        ]
    return [
        ScimTokenRotated(
            by=c.by,
            workspace_id=ws,
            old_token_id=state.scim_token_id,
            token_id=c.token_id,
            token_hash=c.token_hash,
            prefix=c.prefix,
            at=c.at,
        )
    ]


def _revoke_scim(state: DirectoryState, c: RevokeScimToken) -> list[Event]:
    if state.scim_token_id is None:
        raise NotFound("this workspace has no SCIM token to revoke")
    return [
        ScimTokenRevoked(
            by=c.by, workspace_id=state.workspace_id, token_id=state.scim_token_id, at=c.at
        )
    ]


def _register_client(state: DirectoryState, c: RegisterOAuthClient) -> list[Event]:
    if c.client_id in state.oauth_clients:
        raise Conflict(f"OAuth client {c.client_id} already exists")
    return [
        OAuthClientRegistered(
            by=c.by,
            workspace_id=state.workspace_id,
            client_id=c.client_id,
            name=c.name,
            secret_hash=c.secret_hash,
            scopes=c.scopes,
            at=c.at,
        )
    ]


def _revoke_client(state: DirectoryState, c: RevokeOAuthClient) -> list[Event]:
    revoked = state.oauth_clients.get(c.client_id)
    if revoked is None:
        raise NotFound(f"OAuth client {c.client_id} does not exist")
    if revoked:
        return []
    return [
        OAuthClientRevoked(by=c.by, workspace_id=state.workspace_id, client_id=c.client_id, at=c.at)
    ]


_DIRECTORY_DECIDERS: dict[type[Command], Callable[[DirectoryState, Any], list[Event]]] = {
    ProvisionUser: _provision,
    UpdateUser: _update,
    DeprovisionUser: _deprovision,
    BindRole: _bind,
    UnbindRole: _unbind,
    DefineCustomRole: _define_role,
    RecordPasswordSet: _password,
    RecordSsoSecretSet: _sso_secret,
    RecordTotpEnrolled: _totp,
    ResetTotp: _reset_totp,
    LinkApiKey: _link_key,
    IssueScimToken: _issue_scim,
    RevokeScimToken: _revoke_scim,
    RegisterOAuthClient: _register_client,
    RevokeOAuthClient: _revoke_client,
}


def _with_user(state: DirectoryState, user_id: str, **changes: Any) -> DirectoryState:
    users = dict(state.users)
    users[user_id] = users[user_id].model_copy(update=changes)
    return state.model_copy(update={"users": users})


def _evolve_directory(state: DirectoryState, e: Event) -> DirectoryState:
    if isinstance(e, UserProvisioned):
        users = dict(state.users)
        users[e.user_id] = UserRecord(profile=e.profile)
        return state.model_copy(update={"users": users})
    if isinstance(e, UserUpdated):
        return _with_user(state, e.user_id, profile=e.profile)
    if isinstance(e, UserDeprovisioned):
        return _with_user(state, e.user_id, deleted=True, roles=())
    if isinstance(e, RoleBound):
        return _with_user(state, e.user_id, roles=(*state.users[e.user_id].roles, e.role))
    if isinstance(e, RoleUnbound):
        roles = tuple(r for r in state.users[e.user_id].roles if r != e.role)
        return _with_user(state, e.user_id, roles=roles)
    if isinstance(e, PasswordSet):
        return _with_user(state, e.user_id, has_password=True)
    if isinstance(e, UserApiKeyLinked):
        return _with_user(state, e.user_id, api_keys=(*state.users[e.user_id].api_keys, e.key_id))
    if isinstance(e, TotpEnrolled):
        return _with_user(state, e.user_id, totp=True)
    if isinstance(e, TotpReset):
        return _with_user(state, e.user_id, totp=False)
    if isinstance(e, CustomRoleDefined):
        return state.model_copy(
            update={"custom_roles": {**state.custom_roles, e.role: e.permissions}}
        )
    if isinstance(e, ScimTokenIssued | ScimTokenRotated):
        return state.model_copy(update={"scim_token_id": e.token_id})
    if isinstance(e, ScimTokenRevoked):
        return state.model_copy(update={"scim_token_id": None})
    if isinstance(e, OAuthClientRegistered):
        return state.model_copy(
            update={"oauth_clients": {**state.oauth_clients, e.client_id: False}}
        )
    if isinstance(e, OAuthClientRevoked):
        return state.model_copy(
            update={"oauth_clients": {**state.oauth_clients, e.client_id: True}}
        )
    return state


class DirectoryBehaviour(Behaviour[DirectoryState]):
    kind: ClassVar[str] = DIRECTORY_KIND
    state_type: ClassVar[type[BaseModel]] = DirectoryState

    def initial_state(self, key: ActorKey) -> DirectoryState:
        return DirectoryState(workspace_id=key.id)

    def decide(self, state: DirectoryState, command: Command) -> Sequence[Event]:
        decider = _DIRECTORY_DECIDERS.get(type(command))
        if decider is None:
            raise InvalidInput(f"the identity directory does not handle {type(command).__name__}")
        _check_workspace(state, command)
        return decider(state, command)

    def evolve(self, state: DirectoryState, event: Event) -> DirectoryState:
        return _evolve_directory(state, event)


# --- sessions ----------------------------------------------------------------------------------


class SessionState(_Frozen):
    session_id: str
    workspace_id: str | None = None
    user_id: str | None = None
    expires_at: AwareDatetime | None = None
    revoked: bool = False


class SessionBehaviour(Behaviour[SessionState]):
    kind: ClassVar[str] = SESSION_KIND
    state_type: ClassVar[type[BaseModel]] = SessionState

    def initial_state(self, key: ActorKey) -> SessionState:
        return SessionState(session_id=key.id)

    def decide(self, state: SessionState, command: Command) -> Sequence[Event]:
        if isinstance(command, StartSession):
            if state.user_id is not None:
                raise Conflict(f"session {state.session_id} already exists")
            return [
                SessionStarted(
                    workspace_id=command.workspace_id,
                    session_id=state.session_id,
                    user_id=command.user_id,
                    token_hash=command.token_hash,
                    method=command.method,
                    second_factor=command.second_factor,
                    expires_at=command.expires_at,
                    at=command.at,
                )
            ]
        if isinstance(command, RevokeSession):
            if state.user_id is None or state.workspace_id != command.workspace_id:
                raise NotFound(f"session {state.session_id} does not exist")
            if state.revoked:
                return []
            return [
                SessionRevoked(
                    by=command.by,
                    workspace_id=command.workspace_id,
                    session_id=state.session_id,
                    reason=command.reason,
                    at=command.at,
                    user_id=state.user_id,
                )
            ]
        raise InvalidInput(f"a session does not handle {type(command).__name__}")

    def evolve(self, state: SessionState, event: Event) -> SessionState:
        if isinstance(event, SessionStarted):
            return state.model_copy(
                update={
                    "workspace_id": event.workspace_id,
                    "user_id": event.user_id,
                    "expires_at": event.expires_at,
                }
            )
        if isinstance(event, SessionRevoked):
            return state.model_copy(update={"revoked": True})
        return state


# --- audit -------------------------------------------------------------------------------------


class AuditState(_Frozen):
    workspace_id: str
    logins: int = 0
    failures: int = 0


class AuditBehaviour(Behaviour[AuditState]):
    kind: ClassVar[str] = AUDIT_KIND
    state_type: ClassVar[type[BaseModel]] = AuditState

    def initial_state(self, key: ActorKey) -> AuditState:
        return AuditState(workspace_id=key.id)

    def decide(self, state: AuditState, command: Command) -> Sequence[Event]:
        if not isinstance(command, RecordLogin):
            raise InvalidInput(f"the audit trail does not handle {type(command).__name__}")
        common = {
            "workspace_id": state.workspace_id,
            "user_name": command.user_name,
            "user_id": command.user_id,
            "method": command.method,
            "client_ip": command.client_ip,
            "at": command.at,
        }
        if command.succeeded:
            return [LoginSucceeded(**common)]
        return [LoginFailed(reason=command.reason, **common)]

    def evolve(self, state: AuditState, event: Event) -> AuditState:
        if isinstance(event, LoginSucceeded):
            return state.model_copy(update={"logins": state.logins + 1})
        if isinstance(event, LoginFailed):
            return state.model_copy(update={"failures": state.failures + 1})
        return state


def identity_behaviours() -> list[Behaviour[Any]]:
    """The identity actor kinds, for the activation table."""
    return [DirectoryBehaviour(), SessionBehaviour(), AuditBehaviour()]
