"""Read model `agents`: the agents of every workspace, by id, with their current profile."""

from __future__ import annotations

from typing import ClassVar

from eventstore.db import Connection
from eventstore.records import RecordedEvent
from projections.projector import Handler, Projector
from schemas.agent import (
    AgentArchived,
    AgentCreated,
    AgentModelChanged,
    AgentParametersChanged,
    AgentProfileUpdated,
)
from schemas.events import Event


class AgentsProjector(Projector):
    name: ClassVar[str] = "agents"
    tables: ClassVar[tuple[str, ...]] = ("agents",)

    def handlers(self) -> dict[type[Event], Handler]:
        return {
            AgentCreated: self._created,
            AgentProfileUpdated: self._profile,
            AgentModelChanged: self._model,
            AgentParametersChanged: self._parameters,
            AgentArchived: self._archived,
        }

    async def _created(self, conn: Connection, rec: RecordedEvent, ev: AgentCreated) -> None:
        await conn.execute(
            """
            INSERT INTO agents (workspace_id, agent_id, name, description, model, system_prompt,
                                parameters, created_at, updated_at)
            VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $8)
            ON CONFLICT (workspace_id, agent_id) DO NOTHING
            """,
            rec.workspace_id,
            ev.agent_id,
            ev.name,
            ev.description,
            ev.model,
            ev.system_prompt,
            ev.parameters.model_dump(mode="json"),
            ev.at,
        )

    async def _profile(self, conn: Connection, rec: RecordedEvent, ev: AgentProfileUpdated) -> None:
        await conn.execute(
            """
            UPDATE agents SET name = $3, description = $4, system_prompt = $5,
                              updated_at = greatest(updated_at, $6)
            WHERE workspace_id = $1 AND agent_id = $2
            """,
            rec.workspace_id,
            ev.agent_id,
            ev.name,
            ev.description,
            ev.system_prompt,
            ev.at,
        )

    async def _model(self, conn: Connection, rec: RecordedEvent, ev: AgentModelChanged) -> None:
        await conn.execute(
            """
            UPDATE agents SET model = $3, updated_at = greatest(updated_at, $4)
            WHERE workspace_id = $1 AND agent_id = $2
            """,
            rec.workspace_id,
            ev.agent_id,
            ev.model,
            ev.at,
        )

    async def _parameters(
        self, conn: Connection, rec: RecordedEvent, ev: AgentParametersChanged
    ) -> None:
        await conn.execute(
            """
            UPDATE agents SET parameters = $3, updated_at = greatest(updated_at, $4)
            WHERE workspace_id = $1 AND agent_id = $2
            """,
            rec.workspace_id,
            ev.agent_id,
            ev.parameters.model_dump(mode="json"),
            ev.at,
        )

    async def _archived(self, conn: Connection, rec: RecordedEvent, ev: AgentArchived) -> None:
        await conn.execute(
            """
            UPDATE agents SET archived = true, archived_at = coalesce(archived_at, $3),
                              updated_at = greatest(updated_at, $3)
            WHERE workspace_id = $1 AND agent_id = $2
            """,
            rec.workspace_id,
            ev.agent_id,
            ev.at,
        )
