"""A gateway's start brings the identity read model up to date before serving; an event a
newer version wrote (a rollback, a mixed deploy) must not keep it from serving at all."""

from __future__ import annotations

import logging

import pytest
from projection_events import append, at

from eventstore import Database, NewEvent, PostgresEventStore
from gateway import bootstrap
from projections import ProjectionRunner
from projections.identity import IdentityProjector
from projections.identity_queries import get_user
from schemas.identity import UserProfile, UserProvisioned

WS = "ws-identity-start"


def _provisioned(user_id: str, minute: float) -> UserProvisioned:
    profile = UserProfile(user_name=user_id, active=True)
    return UserProvisioned(
        workspace_id=WS, user_id=user_id, profile=profile, source="local", at=at(minute)
    )


async def test_a_start_serves_with_the_identity_model_waiting_on_a_newer_event(
    store: PostgresEventStore, db: Database, caplog: pytest.LogCaptureFixture
) -> None:
    """Review finding: the start caught only a poison event, so `svc serve` of the older
    version refused to start at all. It now serves, the model applied up to that event, and
    says why it stays there."""
    stream = f"identity:{WS}"
    await append(store, WS, stream, _provisioned("before", 0))
    future = NewEvent(type="identity.from_a_newer_version", data={"workspace_id": WS})
    await append(store, WS, stream, future)
    await append(store, WS, stream, _provisioned("after", 1))
    runner = ProjectionRunner(db, [IdentityProjector()], batch_size=100)
    with caplog.at_level(logging.ERROR, logger=bootstrap.log.name):
        await bootstrap._identity_up_to_date(runner)
    logged = " ".join(r.getMessage() for r in caplog.records if r.name == bootstrap.log.name)
    assert "waits on an event a newer version wrote" in logged
    assert "upgrade this process" in logged
    assert await get_user(db, WS, "before") is not None
    assert await get_user(db, WS, "after") is None
