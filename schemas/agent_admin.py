"""Requests and responses of the agent administration API (/v1/admin/agents).

An agent's `name` is what a client sends as `model` to /v1/chat/completions, so it follows the
same bounds as that field and has no leading or trailing whitespace.
"""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field, model_validator

from schemas.admin import MAX_OFFSET, AdminRead, OneLineName
from schemas.agent import AgentParameters, Description, Id, SystemPrompt

AgentName = OneLineName
"""Listed on one line (GET /v1/models, the agents list), as key names are. Checked when
given, not when read: an agent named before the rule still reads and answers."""


class _Wire(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class AgentCreate(_Wire):
    name: AgentName = Field(description="unique per workspace; usable as `model` in chat")
    description: Description = ""
    model: Id = Field(description="the model the agent's turns run on")
    system_prompt: SystemPrompt = Field(
        default="", description="sent as the first message of every turn of the agent"
    )
    parameters: AgentParameters = Field(
        default=AgentParameters(),
        description="defaults of the agent's turns; values in a chat request win",
    )

    @model_validator(mode="before")
    @classmethod
    def _null_takes_the_default(cls, data: object) -> object:
        """A null optional field is its default, as null keeps a field in an update: a form
        that sends every field sends `"description": null` for one left blank."""
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items() if v is not None or k not in _DEFAULTED}


_DEFAULTED = ("description", "system_prompt", "parameters")


class AgentUpdate(_Wire):
    """Fields to change; absent fields stay. `parameters`, when given, replaces the full set."""

    name: AgentName | None = None
    description: Description | None = None
    model: Id | None = None
    system_prompt: SystemPrompt | None = None
    parameters: AgentParameters | None = None

    @model_validator(mode="after")
    def _something(self) -> AgentUpdate:
        nulls = sorted(name for name in self.model_fields_set if getattr(self, name) is None)
        if nulls and len(nulls) == len(self.model_fields_set):
            # Null keeps a field (as clients that send every field expect), but a body of
            # nulls only changes nothing: a client clearing a prompt with null was told it
            # had sent nothing.
            cleared = [name for name in nulls if name in _CLEARED_BY_EMPTY]
            clear = f'; send "" to clear {" and ".join(cleared)}' if cleared else ""
            raise ValueError(
                f"{', '.join(nulls)}: null keeps a field as it is, so this changes nothing; "
                f"give a value to change{clear}"
            )
        if not self.model_fields_set:
            raise ValueError(
                "give at least one of name, description, model, system_prompt, parameters"
            )
        return self


_CLEARED_BY_EMPTY = ("description", "system_prompt")


MAX_AGENTS_PAGE = 200
"""Agents per page at most: each may carry a system prompt of 100,000 characters, and an
unbounded list of them was one response of any size."""


class AgentListQuery(AdminRead):
    include_archived: bool = False
    limit: int = Field(default=MAX_AGENTS_PAGE, ge=1, le=MAX_AGENTS_PAGE)
    offset: int = Field(default=0, ge=0, le=MAX_OFFSET)


class AgentRecord(_Wire):
    id: str
    name: str
    description: str
    model: str
    system_prompt: str
    parameters: AgentParameters
    archived: bool
    created_at: datetime
    updated_at: datetime
    archived_at: datetime | None = None


class WrittenAgent(AgentRecord):
    cursor: str = Field(description="log cursor of the change; pass as min_cursor to read it")


class AgentList(_Wire):
    agents: list[AgentRecord] = Field(description="by name; archived ones last, when included")
    total: int = Field(description="agents the query selects, over every page")
    limit: int
    offset: int
