"""What the operator commands answer in process: exit codes a script can act on, and tables
that say what they show."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from datetime import UTC, datetime, timedelta

import pytest
from platform_support import settings_for, stop_the_api_keys_model

from actors.errors import ConflictRetriesExhausted
from eventstore import NewEvent
from eventstore.errors import ConcurrencyConflict, StoreUnavailable
from gateway import cli
from gateway.bootstrap import open_platform
from projections.errors import ProjectionFailed
from projections.identity_queries import prune_audit
from schemas.errors import Conflict, InvalidInput, SvcError
from schemas.events import EVENTS
from schemas.identity import UserProfile, UserProvisioned


async def test_status_exits_1_while_a_projection_is_stopped(
    database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The runbooks send operators (and deploy checks) to this command: it printed STOPPED
    and exited 0, so `svc projections status || alert` passed over a stalled read model."""
    settings = settings_for(database_url)
    args = argparse.Namespace(action="status")
    assert await cli.cmd_projections(args, settings) == 0
    async with open_platform(settings, background=False) as platform:
        await stop_the_api_keys_model(platform.store)
        # What to do is said wherever the stop is met, not only in the first log line.
        with pytest.raises(ProjectionFailed, match="`svc projections rebuild api_keys`"):
            await platform.projections.catch_up(names=["api_keys"])
    capsys.readouterr()
    assert await cli.cmd_projections(args, settings) == cli.FAILURE
    assert "STOPPED" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (ConflictRetriesExhausted("other writers kept the stream moving"), cli.FAILURE),
        (ConcurrencyConflict("conversation:c1", 3), cli.FAILURE),
        (Conflict("the name is taken"), cli.USAGE_ERROR),
        (InvalidInput("no such scope"), cli.USAGE_ERROR),
        (StoreUnavailable("the database went away"), cli.FAILURE),
    ],
)
def test_a_conflict_that_passes_exits_1_not_2(error: SvcError, code: int) -> None:
    """Exit 2 says the same command fails again; a write that lost to other writers'
    appends each time it was retried is worth running again (exit 1)."""
    assert cli.exit_code(error) == code


def test_cluster_status_shows_each_hosts_state() -> None:
    """A host that did not answer showed as a row of `None`s, alive as far as anyone could
    tell from the table."""
    status = {
        "hosts": [
            {"name": "svc-host-0", "state": "alive", "node": "n1", "pid": 41, "shards": 512},
            {"name": "svc-host-1", "state": "unreachable (ActorDiedError)", "shards": 512},
        ]
    }
    header, alive, dead = cli._status_table(status).splitlines()
    assert header.split("\t")[:2] == ["host", "state"]
    assert alive.split("\t")[:4] == ["svc-host-0", "alive", "n1", "41"]
    assert dead.split("\t")[:4] == ["svc-host-1", "unreachable (ActorDiedError)", "-", "-"]


async def test_an_identity_rebuild_keeps_to_the_audit_retention(
    database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Review finding: a rebuilt identity model holds an audit entry for every event, also
    those past SVC_AUDIT_RETENTION_DAYS that the daily prune had removed; they were back
    (`GET /v1/admin/audit`) until the next prune, up to a day later."""
    settings = settings_for(database_url, SVC_AUDIT_RETENTION_DAYS="30")
    old = datetime.now(UTC) - timedelta(days=40)
    async with open_platform(settings, background=False) as platform:
        for user_id, at in (("long-ago", old), ("lately", datetime.now(UTC))):
            provisioned = UserProvisioned(
                workspace_id="ws-audit",
                user_id=user_id,
                profile=UserProfile(user_name=user_id),
                source="local",
                at=at,
            )
            kind, version, data = EVENTS.encode(provisioned)
            await platform.store.append(
                f"identity:ws-audit:{user_id}",
                [NewEvent(type=kind, data=data, schema_version=version)],
                expected_version=0,
                command_id=f"provision-{user_id}",
                workspace_id="ws-audit",
            )
        await platform.projections.catch_up(names=["identity"])
        assert await prune_audit(platform.db, 30) == 1  # the daily prune
    capsys.readouterr()
    args = argparse.Namespace(action="rebuild", name="identity")
    assert await cli.cmd_projections(args, settings) == 0
    assert "removed 1 audit entries older than 30 days again" in capsys.readouterr().out
    async with open_platform(settings, background=False) as platform:
        async with platform.db.acquire() as conn:
            users = await conn.fetch("SELECT user_id FROM identity_audit_log ORDER BY user_id")
    assert [row["user_id"] for row in users] == ["lately"]


async def test_a_stored_default_workspace_is_named_where_the_cli_takes_it(
    database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Review finding: moved by `svc settings set` (a restart setting), the default
    workspace was taken at once by the commands, while a running server keeps the former
    one: a key issued without --workspace went, unsaid, to a workspace not yet the
    instance's. Now it is named on stderr."""
    stored = argparse.Namespace(action="set", key="SVC_DEFAULT_WORKSPACE_ID", value="acme")
    assert await cli.cmd_settings(stored, settings_for(database_url)) == 0
    create = {"action": "create", "scopes": "chat", "rate_limit_rpm": None, "name": None}
    capsys.readouterr()
    args = argparse.Namespace(workspace=None, **create)
    assert await cli.cmd_apikeys(args, settings_for(database_url)) == 0
    said = capsys.readouterr()
    assert "svc: note: workspace acme, the SVC_DEFAULT_WORKSPACE_ID stored" in said.err
    assert said.out.startswith("svc_") and said.out.count("\n") == 1
    args = argparse.Namespace(workspace="acme", **create)
    assert await cli.cmd_apikeys(args, settings_for(database_url)) == 0
    assert "note" not in capsys.readouterr().err


async def test_a_rebuild_interrupted_ends_its_line_and_says_the_model_is_unchanged(
    database_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """QA finding: Ctrl-C during `svc projections rebuild` exited 130 without a word, the
    progress line left unended. The rebuild replays into copies (projections/rebuild.py):
    interrupted before its switch, the live read model is as it was."""
    settings = settings_for(database_url)
    create = argparse.Namespace(
        action="create", scopes="chat", workspace="w", rate_limit_rpm=None, name="kept"
    )
    assert await cli.cmd_apikeys(create, settings) == 0
    listing = argparse.Namespace(action="list", workspace="w", json=False)
    assert await cli.cmd_apikeys(listing, settings) == 0
    listed = capsys.readouterr().out.splitlines()[-1]
    monkeypatch.setenv("TERM", "xterm")
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # the bar, drawn in place
    draw = cli._RebuildProgress.__call__

    def interrupting(self: cli._RebuildProgress, done: int, total: int, phase: str) -> None:
        draw(self, done, total, phase)
        if phase == "replaying" and not signalled:
            signalled.append(True)
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, taken by _until_signalled

    signalled: list[bool] = []
    monkeypatch.setattr(cli._RebuildProgress, "__call__", interrupting)
    rebuild = argparse.Namespace(action="rebuild", name="api_keys")
    code = await cli._until_signalled(cli.cmd_projections(rebuild, settings))
    assert code == 130
    err = capsys.readouterr().err
    bar, said = err.rstrip("\n").rsplit("\n", 1)
    assert bar.startswith("\r[") and err.endswith("\n"), err
    assert said == (
        "svc: rebuild of api_keys interrupted: the live read model is unchanged (the rebuild "
        "worked on copies, now dropped); `svc projections rebuild api_keys` starts it again"
    )
    monkeypatch.undo()
    assert await cli.cmd_apikeys(listing, settings) == 0
    assert capsys.readouterr().out.splitlines()[-1] == listed


def test_a_rebuild_interrupted_while_switching_does_not_promise_the_old_model() -> None:
    progress = cli._RebuildProgress(terminal=False)
    progress(3, 3, "switching")
    said = progress.interrupted("messages")
    assert "either the old one or the rebuilt one, whole" in said and "unchanged" not in said


@pytest.mark.parametrize("columns", [1, 12, 20, 40, 60, 80, 200])
def test_the_rebuild_bar_fits_the_terminal(
    columns: int, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """QA finding: in a 60-column terminal the 105-character line wrapped, and each redraw
    (a carriage return) left a trail of bars."""
    monkeypatch.setenv("COLUMNS", str(columns))
    progress = cli._RebuildProgress(terminal=True)
    for phase in ("checking", "replaying", "switching"):
        progress(4000, 18603, phase)
        drawn = capsys.readouterr().err
        assert drawn.startswith("\r") and drawn.endswith("\x1b[K"), drawn
        assert len(drawn) - len("\r\x1b[K") <= max(columns - 1, 1), drawn
    if columns >= 200:  # room enough: the whole bar and the whole text
        assert drawn == (
            "\r[######------------------------] 4000/18603 events: switching the rebuilt rows "
            "in (one transaction; readers see the old rows)\x1b[K"
        )


@pytest.mark.parametrize(("term", "in_place"), [("xterm-256color", True), ("dumb", False)])
def test_a_dumb_terminal_gets_the_plain_progress_lines(
    term: str, in_place: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """QA finding: with TERM=dumb the bar still sent ESC[K, which such a terminal shows."""
    monkeypatch.setenv("TERM", term)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert cli._draws_in_place() is in_place
