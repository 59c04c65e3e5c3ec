"""The pure identity cores: decide/evolve without I/O, and replay giving the same state."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from actors.behaviour import ActorKey
from actors.identity import (
    AuditBehaviour,
    DirectoryBehaviour,
    DirectoryState,
    SessionBehaviour,
    directory_key,
)
from schemas.commands import Command
from schemas.errors import Conflict, InvalidInput, NotFound
from schemas.events import EVENTS
from schemas.identity import (
    BindRole,
    DefineCustomRole,
    DeprovisionUser,
    IssueScimToken,
    LinkApiKey,
    ProvisionUser,
    RecordLogin,
    RevokeScimToken,
    RevokeSession,
    ScimTokenRotated,
    StartSession,
    UnbindRole,
    UpdateUser,
    UserProfile,
    UserProvisioned,
)

AT = datetime(2026, 1, 1, tzinfo=UTC)
WS = "ws"
H = "a" * 64


def cmd(cls: type[Command], **kw: Any) -> Any:
    return cls(command_id="c", workspace_id=WS, **{"at": AT, **kw})


def run(state: DirectoryState, command: Command) -> tuple[DirectoryState, list[Any]]:
    behaviour = DirectoryBehaviour()
    events = list(behaviour.decide(state, command))
    for event in events:
        state = behaviour.evolve(state, event)
    return state, events


def profile(name: str, **kw: Any) -> UserProfile:
    return UserProfile(user_name=name, **kw)


def test_directory_lifecycle_and_replay() -> None:
    behaviour = DirectoryBehaviour()
    state = behaviour.initial_state(directory_key(WS))
    log: list[Any] = []
    for command in (
        cmd(ProvisionUser, user_id="u1", profile=profile("Ann"), source="local", roles=("member",)),
        cmd(BindRole, user_id="u1", role="operator"),
        cmd(UnbindRole, user_id="u1", role="member"),
        cmd(DefineCustomRole, role="kb", permissions={"knowledge": "write"}),
        cmd(BindRole, user_id="u1", role="kb"),
        cmd(UpdateUser, user_id="u1", profile=profile("ann2", active=False)),
        cmd(IssueScimToken, token_id="t1", token_hash=H, prefix="svc_scim_x"),
        cmd(IssueScimToken, token_id="t2", token_hash=H, prefix="svc_scim_y"),
        cmd(DeprovisionUser, user_id="u1"),
    ):
        state, events = run(state, command)
        log += events
    assert isinstance(log[-2], ScimTokenRotated) and log[-2].old_token_id == "t1"
    assert state.users["u1"].deleted and state.users["u1"].roles == ()
    assert state.scim_token_id == "t2"
    # Replaying the encoded log rebuilds the same state.
    replayed = behaviour.initial_state(directory_key(WS))
    for event in log:
        type_name, version, data = EVENTS.encode(event)
        replayed = behaviour.evolve(replayed, EVENTS.decode(type_name, version, data))
    assert replayed == state


def test_an_update_made_from_an_older_profile_is_refused_not_written_whole() -> None:
    """A read-modify-write names the profile it read: written whole after a deactivation
    that landed in between, it brought the user back."""
    state = DirectoryBehaviour().initial_state(directory_key(WS))
    state, _ = run(state, cmd(ProvisionUser, user_id="u1", profile=profile("Bo"), source="scim"))
    read = state.users["u1"].profile
    state, _ = run(state, cmd(UpdateUser, user_id="u1", profile=profile("Bo", active=False)))
    renamed = profile("Bo", display_name="Bo B")
    with pytest.raises(Conflict) as refused:
        run(state, cmd(UpdateUser, user_id="u1", profile=renamed, base=read))
    assert refused.value.code == "user_changed"
    assert state.users["u1"].profile.active is False
    fresh = state.users["u1"].profile
    changed = fresh.model_copy(update={"display_name": "Bo B"})
    state, events = run(state, cmd(UpdateUser, user_id="u1", profile=changed, base=fresh))
    assert len(events) == 1 and state.users["u1"].profile.active is False


def test_directory_refusals_and_idempotent_no_ops() -> None:
    state = DirectoryBehaviour().initial_state(directory_key(WS))
    state, _ = run(state, cmd(ProvisionUser, user_id="u1", profile=profile("Bo"), source="scim"))
    with pytest.raises(Conflict):
        run(state, cmd(ProvisionUser, user_id="u2", profile=profile("BO"), source="scim"))
    with pytest.raises(InvalidInput):
        run(state, cmd(BindRole, user_id="u1", role="no-such-role"))
    with pytest.raises(Conflict):
        run(state, cmd(DefineCustomRole, role="owner", permissions={}))
    with pytest.raises(NotFound):
        run(state, cmd(BindRole, user_id="nobody", role="member"))
    with pytest.raises(NotFound):
        run(state, cmd(RevokeScimToken))
    state, events = run(state, cmd(BindRole, user_id="u1", role="member"))
    assert len(events) == 1
    assert run(state, cmd(BindRole, user_id="u1", role="member"))[1] == []
    assert run(state, cmd(UpdateUser, user_id="u1", profile=profile("Bo")))[1] == []
    with pytest.raises(InvalidInput):
        DirectoryBehaviour().decide(
            state,
            ProvisionUser(
                command_id="c",
                workspace_id="other",
                user_id="u9",
                profile=profile("x"),
                source="local",
                at=AT,
            ),
        )


def test_session_and_audit_cores() -> None:
    sessions = SessionBehaviour()
    state = sessions.initial_state(ActorKey("session", "s1"))
    with pytest.raises(NotFound):
        sessions.decide(state, cmd(RevokeSession, reason="logout"))
    start = cmd(
        StartSession,
        session_id="s1",
        user_id="u1",
        token_hash=H,
        method="password",
        second_factor=False,
        expires_at=AT + timedelta(hours=8),
    )
    (started,) = sessions.decide(state, start)
    state = sessions.evolve(state, started)
    with pytest.raises(Conflict):
        sessions.decide(state, start)
    (revoked,) = sessions.decide(state, cmd(RevokeSession, reason="logout"))
    state = sessions.evolve(state, revoked)
    assert state.revoked and list(sessions.decide(state, cmd(RevokeSession, reason="x"))) == []

    audit = AuditBehaviour()
    a_state = audit.initial_state(ActorKey("audit", WS))
    (failed,) = audit.decide(
        a_state,
        cmd(
            RecordLogin,
            user_name="x",
            user_id=None,
            method="password",
            succeeded=False,
            reason="bad_credentials",
            client_ip="127.0.0.1",
        ),
    )
    assert audit.evolve(a_state, failed).failures == 1
    assert "password" not in failed.model_dump_json().replace('"method":"password"', "")


def test_users_recorded_under_names_one_key_now_joins_can_still_be_updated() -> None:
    """Before user_name_key, `info` and its fullwidth form were two names: both may exist in a
    log, and each keeps its own name through an update (a new name is still checked)."""
    behaviour = DirectoryBehaviour()
    state = behaviour.initial_state(directory_key(WS))
    for user_id, name in (("u1", "info"), ("u2", "\uff49\uff4e\uff46\uff4f"), ("u3", "boss")):
        recorded = UserProvisioned(
            workspace_id=WS, user_id=user_id, profile=profile(name), source="local", at=AT
        )
        state = behaviour.evolve(state, recorded)
    state, events = run(
        state,
        cmd(
            UpdateUser,
            user_id="u2",
            profile=profile("\uff49\uff4e\uff46\uff4f", display_name="Info"),
        ),
    )
    assert len(events) == 1
    with pytest.raises(Conflict):
        run(state, cmd(UpdateUser, user_id="u2", profile=profile("BOSS")))


def test_no_key_is_linked_to_a_deactivated_user() -> None:
    """Review finding: a key linked while (or after) the user was deactivated escaped the
    deactivation's revocations and came back to life with a reactivation."""
    state, _ = run(
        DirectoryBehaviour().initial_state(directory_key(WS)),
        cmd(ProvisionUser, user_id="u1", profile=profile("ada"), source="local"),
    )
    state, linked = run(state, cmd(LinkApiKey, user_id="u1", key_id="key_1"))
    assert len(linked) == 1
    state, _ = run(state, cmd(UpdateUser, user_id="u1", profile=profile("ada", active=False)))
    with pytest.raises(Conflict) as refused:
        run(state, cmd(LinkApiKey, user_id="u1", key_id="key_2"))
    assert refused.value.code == "user_inactive"
    assert run(state, cmd(LinkApiKey, user_id="u1", key_id="key_1"))[1] == []  # a retry
