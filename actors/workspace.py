"""The workspace actor (`workspace:<id>`): the tenant's name, settings and API keys.

Only hashes of API keys ever reach this actor (schemas/workspace.py); the state is what the
gateway needs to check a key's scopes and rate limit without another lookup.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from pydantic import AwareDatetime, BaseModel, ConfigDict

from actors.behaviour import ActorKey, Behaviour
from schemas.commands import Command
from schemas.errors import Conflict, InvalidInput, NotFound
from schemas.events import Event
from schemas.workspace import (
    ApiKeyIssued,
    ApiKeyRevoked,
    ChangeWorkspaceSetting,
    CreateWorkspace,
    IssueApiKey,
    RevokeApiKey,
    WorkspaceCreated,
    WorkspaceSettingChanged,
)

KIND = "workspace"


def workspace_key(workspace_id: str) -> ActorKey:
    return ActorKey(KIND, workspace_id)


class SettingValue(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    value: str | None
    secret: bool
    at: AwareDatetime


class ApiKeyRecord(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    key_id: str
    name: str
    key_hash: str
    prefix: str
    scopes: tuple[str, ...]
    rate_limit_rpm: int | None
    expires_at: AwareDatetime | None
    issued_at: AwareDatetime
    revoked_at: AwareDatetime | None = None


class WorkspaceState(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    workspace_id: str
    created_by: str | None = None
    name: str | None = None
    created_at: AwareDatetime | None = None
    updated_at: AwareDatetime | None = None
    settings: dict[str, SettingValue] = {}
    api_keys: dict[str, ApiKeyRecord] = {}

    @property
    def exists(self) -> bool:
        return self.created_by is not None


def _require_exists(state: WorkspaceState, command: Command) -> None:
    if not state.exists or command.workspace_id != state.workspace_id:
        raise NotFound(f"workspace {command.workspace_id} does not exist")


def _decide_create(state: WorkspaceState, c: CreateWorkspace) -> list[Event]:
    if c.workspace_id != state.workspace_id:
        raise InvalidInput(
            f"CreateWorkspace for {c.workspace_id} was sent to workspace {state.workspace_id}"
        )
    if state.exists:
        if state.created_by == c.command_id:
            return []
        raise Conflict(f"workspace {state.workspace_id} already exists")
    return [
        WorkspaceCreated(workspace_id=c.workspace_id, name=c.name, command_id=c.command_id, at=c.at)
    ]


def _decide_setting(state: WorkspaceState, c: ChangeWorkspaceSetting) -> list[Event]:
    _require_exists(state, c)
    current = state.settings.get(c.key)
    # A secret's value is not in the log, so a repeated secret change is always recorded.
    if current is not None and not c.secret and (current.value, current.secret) == (c.value, False):
        return []
    if current is None and c.value is None and not c.secret:
        return []
    return [
        WorkspaceSettingChanged(
            workspace_id=state.workspace_id, key=c.key, value=c.value, secret=c.secret, at=c.at
        )
    ]


def _decide_issue(state: WorkspaceState, c: IssueApiKey) -> list[Event]:
    _require_exists(state, c)
    if c.key_id in state.api_keys:
        raise Conflict(f"API key id {c.key_id} is already used in this workspace")
    if c.expires_at is not None and c.expires_at <= c.at:
        raise InvalidInput("expires_at must be in the future")
    return [
        ApiKeyIssued(
            workspace_id=state.workspace_id,
            key_id=c.key_id,
            name=c.name,
            key_hash=c.key_hash,
            prefix=c.prefix,
            scopes=c.scopes,
            rate_limit_rpm=c.rate_limit_rpm,
            expires_at=c.expires_at,
            at=c.at,
            by=c.by,
        )
    ]


def _decide_revoke(state: WorkspaceState, c: RevokeApiKey) -> list[Event]:
    _require_exists(state, c)
    key = state.api_keys.get(c.key_id)
    if key is None:
        # The id is not quoted: a key pasted where its id goes is a secret.
        raise NotFound(
            f"no API key of workspace {state.workspace_id} has the id given (the key's id, "
            "not the key itself: listed by GET /v1/admin/apikeys and `svc apikeys list`)"
        )
    if key.revoked_at is not None:
        return []
    return [ApiKeyRevoked(workspace_id=state.workspace_id, key_id=c.key_id, at=c.at, by=c.by)]


_DECIDERS: dict[type[Command], Callable[[WorkspaceState, Any], list[Event]]] = {
    CreateWorkspace: _decide_create,
    ChangeWorkspaceSetting: _decide_setting,
    IssueApiKey: _decide_issue,
    RevokeApiKey: _decide_revoke,
}


def _evolve(state: WorkspaceState, event: Event) -> WorkspaceState:
    if isinstance(event, WorkspaceCreated):
        return state.model_copy(
            update={
                "created_by": event.command_id or "",
                "name": event.name,
                "created_at": event.at,
                "updated_at": event.at,
            }
        )
    if isinstance(event, WorkspaceSettingChanged):
        settings = dict(state.settings)
        if event.value is None and not event.secret:
            settings.pop(event.key, None)
        else:
            settings[event.key] = SettingValue(value=event.value, secret=event.secret, at=event.at)
        return state.model_copy(update={"settings": settings, "updated_at": event.at})
    if isinstance(event, ApiKeyIssued):
        keys = dict(state.api_keys)
        keys[event.key_id] = ApiKeyRecord(
            key_id=event.key_id,
            name=event.name,
            key_hash=event.key_hash,
            prefix=event.prefix,
            scopes=event.scopes,
            rate_limit_rpm=event.rate_limit_rpm,
            expires_at=event.expires_at,
            issued_at=event.at,
        )
        return state.model_copy(update={"api_keys": keys, "updated_at": event.at})
    if isinstance(event, ApiKeyRevoked):
        keys = dict(state.api_keys)
        keys[event.key_id] = keys[event.key_id].model_copy(update={"revoked_at": event.at})
        return state.model_copy(update={"api_keys": keys, "updated_at": event.at})
    return state


class WorkspaceBehaviour(Behaviour[WorkspaceState]):
    kind: ClassVar[str] = KIND
    state_type: ClassVar[type[BaseModel]] = WorkspaceState

    def initial_state(self, key: ActorKey) -> WorkspaceState:
        return WorkspaceState(workspace_id=key.id)

    def decide(self, state: WorkspaceState, command: Command) -> Sequence[Event]:
        decider = _DECIDERS.get(type(command))
        if decider is None:
            raise InvalidInput(f"a workspace does not handle {type(command).__name__}")
        return decider(state, command)

    def evolve(self, state: WorkspaceState, event: Event) -> WorkspaceState:
        return _evolve(state, event)
