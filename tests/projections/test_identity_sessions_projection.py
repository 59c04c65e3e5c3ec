"""The identity model whatever order the log gives: sessions follow their user's state, and a
user's change time never goes back."""

from __future__ import annotations

from datetime import timedelta

from projection_events import append, at, key_hash

from eventstore import Database, PostgresEventStore
from projections import ProjectionRunner
from projections.identity import IdentityProjector
from projections.identity_queries import find_session, get_user
from schemas.identity import (
    SessionStarted,
    UserDeprovisioned,
    UserProfile,
    UserProvisioned,
    UserUpdated,
)

WS = "ws-sessions"


def _profile(active: bool) -> UserProfile:
    return UserProfile(user_name="ada", active=active)


def _session(user_id: str, token: str, minutes: float) -> SessionStarted:
    return SessionStarted(
        workspace_id=WS,
        session_id=f"s-{token}",
        user_id=user_id,
        token_hash=key_hash(token),
        method="password",
        second_factor=False,
        expires_at=at(minutes) + timedelta(days=3650),
        at=at(minutes),
    )


async def test_a_session_recorded_after_deactivation_stays_revoked_on_reactivation(
    store: PostgresEventStore, db: Database
) -> None:
    """A login that checked its user just before a deactivation commits after it: its
    session must not come to life when the user is reactivated."""
    stream = f"identity:{WS}"
    user = UserProvisioned(
        workspace_id=WS, user_id="u1", profile=_profile(True), source="local", at=at(0)
    )
    off = UserUpdated(workspace_id=WS, user_id="u1", profile=_profile(False), at=at(1))
    session = _session("u1", "late-session", 2)
    on = UserUpdated(workspace_id=WS, user_id="u1", profile=_profile(True), at=at(3))
    await append(store, WS, stream, user, off)
    await append(store, WS, f"session:{WS}:late", session)
    await append(store, WS, stream, on)
    await ProjectionRunner(db, [IdentityProjector()]).catch_up()
    row = await find_session(db, key_hash("late-session"))
    assert row is not None and row.user_id == "u1"
    assert row.revoked_at == at(2)


async def test_a_session_of_an_active_user_is_live(store: PostgresEventStore, db: Database) -> None:
    user = UserProvisioned(
        workspace_id=WS, user_id="u2", profile=_profile(True), source="local", at=at(0)
    )
    session = _session("u2", "live-session", 1)
    await append(store, WS, f"identity:{WS}", user)
    await append(store, WS, f"session:{WS}:live", session)
    await ProjectionRunner(db, [IdentityProjector()]).catch_up()
    row = await find_session(db, key_hash("live-session"))
    assert row is not None and row.revoked_at is None


async def test_a_session_recorded_after_deprovisioning_is_stored_revoked(
    store: PostgresEventStore, db: Database
) -> None:
    user = UserProvisioned(
        workspace_id=WS, user_id="u3", profile=_profile(True), source="scim", at=at(0)
    )
    gone = UserDeprovisioned(workspace_id=WS, user_id="u3", at=at(1))
    await append(store, WS, f"identity:{WS}", user, gone)
    await append(store, WS, f"session:{WS}:gone", _session("u3", "gone-session", 2))
    await ProjectionRunner(db, [IdentityProjector()]).catch_up()
    row = await find_session(db, key_hash("gone-session"))
    assert row is not None and row.revoked_at == at(2)


async def test_a_users_last_change_time_never_goes_back(
    store: PostgresEventStore, db: Database
) -> None:
    """SCIM clients sync by `meta.lastModified`: an update whose writer's clock lagged must
    not move it back (events apply in commit order, not by their times)."""
    stream = f"identity:{WS}"
    user = UserProvisioned(
        workspace_id=WS, user_id="u9", profile=_profile(True), source="scim", at=at(0)
    )
    update = UserUpdated(workspace_id=WS, user_id="u9", profile=_profile(True), at=at(5))
    lagging = UserUpdated(workspace_id=WS, user_id="u9", profile=_profile(False), at=at(2))
    await append(store, WS, stream, user, update, lagging)
    await append(store, WS, stream, UserDeprovisioned(workspace_id=WS, user_id="u9", at=at(3)))
    await ProjectionRunner(db, [IdentityProjector()]).catch_up()
    row = await get_user(db, WS, "u9")
    assert row is not None and not row.active and row.updated_at == at(5)
