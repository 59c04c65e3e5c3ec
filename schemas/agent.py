"""Agent commands and events: a named model configuration (model, system prompt, parameters).

An agent is one logical actor (`agent:<id>`). Commands carry `at`, stamped by the caller, so
that `decide()` stays pure (see schemas/conversation.py).
"""

from __future__ import annotations

from typing import Annotated, ClassVar

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field

from schemas.commands import Command
from schemas.conversation import ReasoningEffort
from schemas.events import Event, event

Id = Annotated[str, Field(min_length=1, max_length=200)]
Name = Annotated[str, Field(min_length=1, max_length=200)]
Description = Annotated[str, Field(max_length=2_000)]
SystemPrompt = Annotated[str, Field(max_length=100_000)]


class AgentParameters(BaseModel):
    """Sampling parameters; None means "use the instance setting" (e.g. SVC_LLM_TEMPERATURE)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    max_tokens: int | None = Field(default=None, ge=1, le=1_000_000)
    reasoning_effort: ReasoningEffort | None = None


# --- commands -------------------------------------------------------------------------------


class CreateAgent(Command):
    # The whole request: a key reused with another body is another request (409), not a
    # retry answered with the first agent.
    target_fields = ("name", "description", "model", "system_prompt", "parameters")
    name: Name
    description: Description = ""
    model: Id
    system_prompt: SystemPrompt = ""
    parameters: AgentParameters = AgentParameters()
    at: AwareDatetime


class UpdateAgentProfile(Command):
    """Change the fields that are given; None leaves a field as it is."""

    name: Name | None = None
    description: Description | None = None
    system_prompt: SystemPrompt | None = None
    at: AwareDatetime


class ChangeAgentModel(Command):
    model: Id
    at: AwareDatetime


class ChangeAgentParameters(Command):
    """Replace the agent's parameters with `parameters` (the full set)."""

    parameters: AgentParameters
    at: AwareDatetime


class UpdateAgent(Command):
    """Change every field that is given in one atomic step (one append, one command id, as a
    PATCH needs); None leaves a field as it is. `parameters`, when given, replaces the full set.
    """

    target_fields = ("name", "description", "model", "system_prompt", "parameters")
    name: Name | None = None
    description: Description | None = None
    model: Id | None = None
    system_prompt: SystemPrompt | None = None
    parameters: AgentParameters | None = None
    at: AwareDatetime


class ArchiveAgent(Command):
    at: AwareDatetime


# --- events ---------------------------------------------------------------------------------


@event
class AgentCreated(Event):
    type_name: ClassVar[str] = "agent.created"
    agent_id: Id
    workspace_id: Id
    name: Name
    description: Description
    model: Id
    system_prompt: SystemPrompt
    parameters: AgentParameters
    # The creating command's id: a retried create is recognised even after a replay.
    command_id: Id | None = None
    at: AwareDatetime


@event
class AgentProfileUpdated(Event):
    """Carries the full profile after the change."""

    type_name: ClassVar[str] = "agent.profile_updated"
    agent_id: Id
    name: Name
    description: Description
    system_prompt: SystemPrompt
    at: AwareDatetime


@event
class AgentModelChanged(Event):
    type_name: ClassVar[str] = "agent.model_changed"
    agent_id: Id
    model: Id
    at: AwareDatetime


@event
class AgentParametersChanged(Event):
    type_name: ClassVar[str] = "agent.parameters_changed"
    agent_id: Id
    parameters: AgentParameters
    at: AwareDatetime


@event
class AgentArchived(Event):
    type_name: ClassVar[str] = "agent.archived"
    agent_id: Id
    at: AwareDatetime
