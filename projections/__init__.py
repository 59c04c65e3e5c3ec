"""Projections: checkpointed consumers of the global log that maintain the read models.

Wiring (the composition root does this once per process):

    runner = ProjectionRunner(db, default_projectors(), notifier=notifier)
    await apply_migrations(db, [STORE_MIGRATIONS, PROJECTION_MIGRATIONS])
    await runner.start()          # background: one loop per projector
    ...
    await runner.wait_for(append_result.cursor, timeout=5.0)   # read-your-writes
    items, total = await queries.list_conversations(db, workspace_id, limit=50)
    await runner.stop()
"""

from __future__ import annotations

from eventstore.migrate import MigrationSource
from projections import queries
from projections.agents import AgentsProjector
from projections.apikeys import ApiKeysProjector
from projections.conversations import ConversationsProjector
from projections.errors import ProjectionFailed
from projections.identity import IdentityProjector
from projections.messages import MessagesProjector
from projections.projector import Projector
from projections.rebuild import Progress
from projections.runner import CommitSignal, PoisonEvent, ProjectionRunner, ProjectionStatus
from projections.turns import TURN_STATUSES, TurnsProjector
from projections.workspaces import WorkspacesProjector

PROJECTION_MIGRATIONS = MigrationSource("projections", "projections.migrations")


def default_projectors() -> list[Projector]:
    """Every read model of SVC, fresh instances."""
    return [
        WorkspacesProjector(),
        ApiKeysProjector(),
        ConversationsProjector(),
        MessagesProjector(),
        TurnsProjector(),
        AgentsProjector(),
        IdentityProjector(),
    ]


__all__ = [
    "PROJECTION_MIGRATIONS",
    "TURN_STATUSES",
    "AgentsProjector",
    "ApiKeysProjector",
    "CommitSignal",
    "ConversationsProjector",
    "IdentityProjector",
    "MessagesProjector",
    "PoisonEvent",
    "Progress",
    "ProjectionFailed",
    "ProjectionRunner",
    "ProjectionStatus",
    "Projector",
    "TurnsProjector",
    "WorkspacesProjector",
    "default_projectors",
    "queries",
]
