"""Read model `workspaces`: one row per tenant."""

from __future__ import annotations

from typing import ClassVar

from eventstore.db import Connection
from eventstore.records import RecordedEvent
from projections.projector import Handler, Projector
from schemas.events import Event
from schemas.workspace import WorkspaceCreated


class WorkspacesProjector(Projector):
    name: ClassVar[str] = "workspaces"
    tables: ClassVar[tuple[str, ...]] = ("workspaces",)

    def handlers(self) -> dict[type[Event], Handler]:
        return {WorkspaceCreated: self._created}

    async def _created(self, conn: Connection, rec: RecordedEvent, ev: WorkspaceCreated) -> None:
        await conn.execute(
            """
            INSERT INTO workspaces (id, workspace_id, name, created_at) VALUES ($1, $1, $2, $3)
            ON CONFLICT (id) DO NOTHING
            """,
            rec.workspace_id,
            ev.name,
            ev.at,
        )
