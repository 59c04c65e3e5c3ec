"""The CLI's platform flushes the read models on exit only after a command that wrote."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

from platform_support import settings_for

from eventstore.records import NewEvent
from gateway.bootstrap import ensure_workspace, open_platform
from schemas.events import EVENTS
from schemas.workspace import WorkspaceCreated


async def _lag(database_url: str) -> int:
    async with open_platform(settings_for(database_url), background=False) as platform:
        return max(s.lag_events for s in await platform.projections.status())


async def test_a_command_that_wrote_nothing_leaves_the_read_models_alone(
    database_url: str,
) -> None:
    await _lag(database_url)  # the first start creates the default workspace, and flushes
    # Another process's write, not projected yet (no gateway is running).
    type_name, version, data = EVENTS.encode(
        WorkspaceCreated(workspace_id="w-other", name="other", at=datetime.now(UTC))
    )
    async with open_platform(settings_for(database_url), background=False) as platform:
        await platform.store.append(
            "workspace:w-other",
            [NewEvent(type=type_name, data=data, schema_version=version)],
            expected_version=0,
            command_id=uuid.uuid4().hex,
            workspace_id="w-other",
        )
    # A status (a read) twice: it reports the lag and leaves it for the gateway to project.
    assert await _lag(database_url) > 0
    assert await _lag(database_url) > 0
    # A command that writes brings the read models up to date before it returns.
    async with open_platform(settings_for(database_url), background=False) as platform:
        assert await ensure_workspace(platform.runtime, "w-cli")
    assert await _lag(database_url) == 0
