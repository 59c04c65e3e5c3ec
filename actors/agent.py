"""The agent actor (`agent:<id>`): a named model configuration of one workspace."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from pydantic import AwareDatetime, BaseModel, ConfigDict

from actors.behaviour import ActorKey, Behaviour
from schemas.agent import (
    AgentArchived,
    AgentCreated,
    AgentModelChanged,
    AgentParameters,
    AgentParametersChanged,
    AgentProfileUpdated,
    ArchiveAgent,
    ChangeAgentModel,
    ChangeAgentParameters,
    CreateAgent,
    UpdateAgent,
    UpdateAgentProfile,
)
from schemas.commands import Command
from schemas.errors import Conflict, InvalidInput, NotFound
from schemas.events import Event

KIND = "agent"


def agent_key(agent_id: str) -> ActorKey:
    return ActorKey(KIND, agent_id)


class AgentState(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    agent_id: str
    workspace_id: str | None = None
    created_by: str | None = None
    archived: bool = False
    name: str = ""
    description: str = ""
    model: str = ""
    system_prompt: str = ""
    parameters: AgentParameters = AgentParameters()
    created_at: AwareDatetime | None = None
    updated_at: AwareDatetime | None = None

    @property
    def exists(self) -> bool:
        return self.created_by is not None


def _require_active(state: AgentState, command: Command) -> None:
    if not state.exists or state.workspace_id != command.workspace_id:
        raise NotFound(f"agent {state.agent_id} does not exist")
    if state.archived:
        raise Conflict(
            f"agent {state.agent_id} is archived; an archived agent cannot change: create a "
            "new one (its name is free again)",
            code="agent_archived",
        )


def _decide_create(state: AgentState, c: CreateAgent) -> list[Event]:
    if state.exists:
        if state.created_by == c.command_id:
            return []
        raise Conflict(f"agent {state.agent_id} already exists")
    return [
        AgentCreated(
            agent_id=state.agent_id,
            workspace_id=c.workspace_id,
            name=c.name,
            description=c.description,
            model=c.model,
            system_prompt=c.system_prompt,
            parameters=c.parameters,
            command_id=c.command_id,
            at=c.at,
        )
    ]


def _decide_profile(state: AgentState, c: UpdateAgentProfile) -> list[Event]:
    _require_active(state, c)
    if c.name is None and c.description is None and c.system_prompt is None:
        raise InvalidInput("give at least one of name, description, system_prompt to change")
    name = state.name if c.name is None else c.name
    description = state.description if c.description is None else c.description
    prompt = state.system_prompt if c.system_prompt is None else c.system_prompt
    if (name, description, prompt) == (state.name, state.description, state.system_prompt):
        return []
    return [
        AgentProfileUpdated(
            agent_id=state.agent_id,
            name=name,
            description=description,
            system_prompt=prompt,
            at=c.at,
        )
    ]


def _decide_model(state: AgentState, c: ChangeAgentModel) -> list[Event]:
    _require_active(state, c)
    if state.model == c.model:
        return []
    return [AgentModelChanged(agent_id=state.agent_id, model=c.model, at=c.at)]


def _decide_parameters(state: AgentState, c: ChangeAgentParameters) -> list[Event]:
    _require_active(state, c)
    if state.parameters == c.parameters:
        return []
    return [AgentParametersChanged(agent_id=state.agent_id, parameters=c.parameters, at=c.at)]


def _decide_update(state: AgentState, c: UpdateAgent) -> list[Event]:
    _require_active(state, c)
    changes = (c.name, c.description, c.model, c.system_prompt, c.parameters)
    if all(value is None for value in changes):
        raise InvalidInput(
            "give at least one of name, description, model, system_prompt, parameters to change"
        )
    ids = {"command_id": c.command_id, "workspace_id": c.workspace_id, "at": c.at}
    events: list[Event] = []
    if (c.name, c.description, c.system_prompt) != (None, None, None):
        profile = UpdateAgentProfile(
            name=c.name, description=c.description, system_prompt=c.system_prompt, **ids
        )
        events += _decide_profile(state, profile)
    if c.model is not None:
        events += _decide_model(state, ChangeAgentModel(model=c.model, **ids))
    if c.parameters is not None:
        events += _decide_parameters(state, ChangeAgentParameters(parameters=c.parameters, **ids))
    return events


def _decide_archive(state: AgentState, c: ArchiveAgent) -> list[Event]:
    # Archiving is idempotent: archiving an archived agent changes nothing.
    if state.archived and state.workspace_id == c.workspace_id:
        return []
    _require_active(state, c)
    return [AgentArchived(agent_id=state.agent_id, at=c.at)]


_DECIDERS: dict[type[Command], Callable[[AgentState, Any], list[Event]]] = {
    CreateAgent: _decide_create,
    UpdateAgentProfile: _decide_profile,
    ChangeAgentModel: _decide_model,
    ChangeAgentParameters: _decide_parameters,
    UpdateAgent: _decide_update,
    ArchiveAgent: _decide_archive,
}


def _evolve(state: AgentState, event: Event) -> AgentState:
    if isinstance(event, AgentCreated):
        return state.model_copy(
            update={
                "workspace_id": event.workspace_id,
                "created_by": event.command_id or "",
                "name": event.name,
                "description": event.description,
                "model": event.model,
                "system_prompt": event.system_prompt,
                "parameters": event.parameters,
                "created_at": event.at,
                "updated_at": event.at,
            }
        )
    if isinstance(event, AgentProfileUpdated):
        update: dict[str, Any] = {
            "name": event.name,
            "description": event.description,
            "system_prompt": event.system_prompt,
        }
    elif isinstance(event, AgentModelChanged):
        update = {"model": event.model}
    elif isinstance(event, AgentParametersChanged):
        update = {"parameters": event.parameters}
    elif isinstance(event, AgentArchived):
        update = {"archived": True}
    else:
        return state
    return state.model_copy(update={**update, "updated_at": event.at})


class AgentBehaviour(Behaviour[AgentState]):
    kind: ClassVar[str] = KIND
    state_type: ClassVar[type[BaseModel]] = AgentState

    def initial_state(self, key: ActorKey) -> AgentState:
        return AgentState(agent_id=key.id)

    def decide(self, state: AgentState, command: Command) -> Sequence[Event]:
        decider = _DECIDERS.get(type(command))
        if decider is None:
            raise InvalidInput(f"an agent does not handle {type(command).__name__}")
        return decider(state, command)

    def evolve(self, state: AgentState, event: Event) -> AgentState:
        return _evolve(state, event)
