"""Reads of the `agents` read model (projections/agents.py), returning typed records.

Every read runs in `Database.scoped(workspace_id)` (row-level security, ARCHITECTURE.md
decision 6), like projections/queries.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from eventstore.db import Database
from projections.queries import PagedSelect
from schemas.agent import AgentParameters


@dataclass(frozen=True, slots=True)
class Agent:
    agent_id: str
    workspace_id: str
    name: str
    description: str
    model: str
    system_prompt: str
    parameters: AgentParameters
    archived: bool
    created_at: datetime
    updated_at: datetime
    archived_at: datetime | None


_COLUMNS = (
    "agent_id, workspace_id, name, description, model, system_prompt, parameters, archived, "
    "created_at, updated_at, archived_at"
)


def _agent(row: Any) -> Agent:
    values = list(row)
    values[6] = AgentParameters.model_validate(values[6])
    return Agent(*values)


async def list_agents(
    db: Database, workspace_id: str, *, include_archived: bool = False
) -> list[Agent]:
    """The workspace's agents by name (archived ones last when included)."""
    archived = "" if include_archived else "AND NOT archived"
    async with db.scoped(workspace_id) as conn:
        rows = await conn.fetch(
            f"""
            SELECT {_COLUMNS} FROM agents WHERE workspace_id = $1 {archived}
            ORDER BY archived, name, agent_id
            """,
            workspace_id,
        )
    return [_agent(r) for r in rows]


async def page_agents(
    db: Database, workspace_id: str, *, include_archived: bool, limit: int, offset: int
) -> tuple[list[Agent], int]:
    """A page of the workspace's agents in `list_agents`' order, and how many the query
    selects over every page."""
    archived = "" if include_archived else "AND NOT archived"
    page = PagedSelect(_COLUMNS, "agents", "archived, name, agent_id", archived)
    rows, total = await page.fetch(db, workspace_id, limit, offset)
    return [_agent(r) for r in rows], total


async def get_agent(db: Database, workspace_id: str, agent_id: str) -> Agent | None:
    """The agent, archived or not; None when this workspace has none by that id."""
    async with db.scoped(workspace_id) as conn:
        row = await conn.fetchrow(
            f"SELECT {_COLUMNS} FROM agents WHERE workspace_id = $1 AND agent_id = $2",
            workspace_id,
            agent_id,
        )
    return None if row is None else _agent(row)


async def find_active_agent(db: Database, workspace_id: str, name: str) -> Agent | None:
    """The workspace's active agent called exactly `name` (the oldest, should the log ever
    hold two: names are checked before an agent is created or renamed)."""
    async with db.scoped(workspace_id) as conn:
        row = await conn.fetchrow(
            f"""
            SELECT {_COLUMNS} FROM agents
            WHERE workspace_id = $1 AND name = $2 AND NOT archived
            ORDER BY created_at, agent_id LIMIT 1
            """,
            workspace_id,
            name,
        )
    return None if row is None else _agent(row)
