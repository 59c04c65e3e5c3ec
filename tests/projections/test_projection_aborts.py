"""A handler's statement the database gives up on (statement or lock timeout, deadlock) is
that projector's problem, not the database's: the others go on, the statement is retried,
and one that fails every time stops its projector like a poison event. The database itself
going away is retried by everyone and recorded nowhere."""

from __future__ import annotations

from typing import ClassVar

import pytest
from projection_events import append, workspace_created

from eventstore import Database, PostgresEventStore
from eventstore.db import Connection
from eventstore.records import RecordedEvent
from projections import ProjectionFailed, ProjectionRunner, WorkspacesProjector, queries
from projections.projector import Handler, Projector
from schemas.events import Event
from schemas.workspace import WorkspaceCreated

PATIENCE_S = 30.0
SLOW = "slow"


class _Troubled(Projector):
    """Reads the workspace it is told about; on the workspace named "slow" its statement
    meets trouble the first `times` attempts (every one by default)."""

    name: ClassVar[str] = "troubled"
    tables: ClassVar[tuple[str, ...]] = ("workspaces",)

    def __init__(self, times: int | None = None) -> None:
        super().__init__()
        self.times = times
        self.attempts = 0

    def handlers(self) -> dict[type[Event], Handler]:
        return {WorkspaceCreated: self._created}

    async def _created(self, conn: Connection, rec: RecordedEvent, ev: WorkspaceCreated) -> None:
        if ev.name != SLOW:
            return
        self.attempts += 1
        if self.times is None or self.attempts <= self.times:
            await self.trouble(conn)

    async def trouble(self, conn: Connection) -> None:
        # Slower than the statement timeout: the database cancels the statement (57014).
        await conn.execute("SELECT set_config('statement_timeout', '50', true)")
        await conn.fetchval("SELECT pg_sleep(10)")


class _Disconnecting(_Troubled):
    async def trouble(self, conn: Connection) -> None:
        # The database going away: the backend is terminated under the statement.
        await conn.fetchval("SELECT pg_terminate_backend(pg_backend_pid())")


async def _workspaces(store: PostgresEventStore) -> list[str]:
    """Three workspaces, the middle one named "slow"; their events' cursors."""
    cursors = []
    for i, name in enumerate(["first", SLOW, "last"]):
        result = await append(store, f"w{i}", f"workspace:w{i}", workspace_created(f"w{i}", name))
        cursors.append(result.cursor)
    return cursors


async def test_a_statement_too_slow_every_time_stops_only_its_projector(
    store: PostgresEventStore, db: Database
) -> None:
    before, slow, head = await _workspaces(store)
    troubled = _Troubled()
    runner = ProjectionRunner(db, [WorkspacesProjector(), troubled])
    await runner.start()
    try:
        # The projector beside it, in the same group, is not held back by its timeouts.
        assert await runner.wait_for(head, PATIENCE_S, names=["workspaces"])
        # Settles (False) once the troubled one is stopped: five attempts, then the stop.
        assert not await runner.wait_for(head, PATIENCE_S, names=["troubled"])
    finally:
        await runner.stop()
    for i in range(3):
        assert await queries.get_workspace(db, f"w{i}") is not None
    status = {s.name: s for s in await runner.status()}
    failure = status["troubled"].failure
    assert failure is not None and failure.cursor == slow
    assert "5 times in a row" in failure.error and "57014" in failure.error
    assert "svc projections rebuild troubled" in failure.error
    # The events before the one at fault are applied; the checkpoint waits just before it.
    assert status["troubled"].cursor == before
    assert status["workspaces"].failure is None and status["workspaces"].cursor == head
    # Another process sees the stop too: it is recorded on the checkpoint row.
    (elsewhere,) = await ProjectionRunner(db, [_Troubled()]).status()
    assert elsewhere.failure == failure


async def test_a_statement_that_times_out_a_few_times_is_retried_then_applied(
    store: PostgresEventStore, db: Database
) -> None:
    """Contention passes: fewer aborts in a row than the limit cost a retry, no stop."""
    *_, head = await _workspaces(store)
    troubled = _Troubled(times=3)
    runner = ProjectionRunner(db, [WorkspacesProjector(), troubled])
    await runner.catch_up()
    assert troubled.attempts > 3
    status = await runner.status()
    assert [(s.cursor, s.failure) for s in status] == [(head, None), (head, None)]


async def test_the_database_going_away_is_retried_by_all_and_never_recorded(
    store: PostgresEventStore, db: Database
) -> None:
    """A lost connection is no statement's fault: however often it happens (more times than
    an aborted statement is allowed), nothing is recorded and the projector goes on."""
    *_, head = await _workspaces(store)
    troubled = _Disconnecting(times=7)
    runner = ProjectionRunner(db, [WorkspacesProjector(), troubled])
    await runner.start()
    try:
        assert await runner.wait_for(head, PATIENCE_S)
    finally:
        await runner.stop()
    assert troubled.attempts == 8
    assert all(s.failure is None and s.cursor == head for s in await runner.status())


async def test_a_rebuild_names_the_event_whose_statement_the_database_gave_up_on(
    store: PostgresEventStore, db: Database
) -> None:
    _, slow, _ = await _workspaces(store)
    runner = ProjectionRunner(db, [_Troubled()])
    with pytest.raises(ProjectionFailed, match=f"cursor {slow}.*57014"):
        await runner.rebuild("troubled")
