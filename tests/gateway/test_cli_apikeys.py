"""`svc apikeys` in process, on the test's PostgreSQL: what `list`, `create` and `revoke` say
about keys the command line itself cannot make (an expired one) or cannot confirm."""

from __future__ import annotations

import argparse
import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import pytest
from platform_support import settings_for, stop_the_api_keys_model, uid

from actors.workspace import workspace_key
from eventstore.errors import StoreUnavailable
from eventstore.records import NewEvent
from gateway import cli
from gateway.auth import generate_key, hash_key
from gateway.bootstrap import Platform, ensure_workspace, open_platform
from schemas.errors import InvalidInput
from schemas.workspace import IssueApiKey


@pytest.fixture
async def platform(database_url: str) -> AsyncIterator[Platform]:
    async with open_platform(settings_for(database_url), background=False) as opened:
        yield opened


async def _issue(
    platform: Platform, workspace: str, expires_at: datetime | None, name: str = ""
) -> str:
    """A key issued through the workspace actor, as if at the start of 2000: so it may
    expire in 2001, which is past now (the API takes only a future expiry)."""
    await ensure_workspace(platform.runtime, workspace)
    key = generate_key()
    command = IssueApiKey(
        command_id=uid("cmd-"),
        workspace_id=workspace,
        key_id=uid("key_"),
        name=name or uid("name-"),
        key_hash=hash_key(key),
        prefix=key[:8],
        scopes=("chat",),
        expires_at=expires_at,
        at=datetime(2000, 1, 1, tzinfo=UTC),
    )
    outcome = await platform.runtime.ask(workspace_key(workspace), command)
    assert await platform.projections.wait_for(outcome.cursor, 10.0)
    return command.key_id


def _listed(capsys: pytest.CaptureFixture[str]) -> dict[str, str]:
    return {line.split("\t")[0]: line for line in capsys.readouterr().out.splitlines()}


async def test_list_says_expired_and_shows_the_expiry(
    platform: Platform, capsys: pytest.CaptureFixture[str]
) -> None:
    ws = uid("ws-")
    past = datetime(2001, 1, 1, tzinfo=UTC)
    future = datetime.now(UTC) + timedelta(days=30)
    expired, later, never = [await _issue(platform, ws, at) for at in (past, future, None)]
    args = argparse.Namespace(workspace=ws, json=False)
    assert await cli._apikeys_list(args, platform) == 0
    lines = _listed(capsys)
    assert "\texpires=2001-01-01T00:00:00+00:00\texpired\t" in lines[expired]
    assert f"\texpires={future.isoformat()}\tactive\t" in lines[later]
    assert "\texpires=-\tactive\t" in lines[never]

    args = argparse.Namespace(workspace=ws, json=True)
    assert await cli._apikeys_list(args, platform) == 0
    rows = {row["id"]: row for row in json.loads(capsys.readouterr().out)}
    assert rows[expired]["expires_at"] == "2001-01-01T00:00:00Z"
    assert rows[never]["expires_at"] is None
    assert set(rows[later]) == {
        "id", "name", "prefix", "scopes", "rate_limit_rpm", "expires_at", "created_at",
        "revoked_at", "user_id",
    }  # fmt: skip
    assert rows[never]["user_id"] is None  # a workspace key acts as no user
    assert lines[never].split("\t")[-2] == "workspace"


async def test_the_list_goes_on_with_a_warning_when_the_identity_model_is_stopped(
    platform: Platform, capsys: pytest.CaptureFixture[str]
) -> None:
    """Review finding: the list waited for the identity model (whose each key is) too, and
    its stop refused the whole list."""
    ws = uid("ws-")
    key_id = await _issue(platform, ws, None)
    await platform.store.append(  # an event the identity model cannot apply: it stops
        uid("identity:"),
        [NewEvent("identity.user_api_key_linked", {"workspace_id": "x"}, 1)],
        expected_version=0,
        command_id=uid("cmd-"),
        workspace_id=uid("ws-"),
    )
    args = argparse.Namespace(workspace=ws, json=False)
    assert await cli._apikeys_list(args, platform) == 0
    out, err = capsys.readouterr()
    assert key_id in out and "whose each key is may be out of date" in err, err


async def test_revoke_not_applied_by_the_read_models_warns_and_fails(
    platform: Platform, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Keys are authenticated from the read models: "revoked" with status 0 while they have
    not applied it told the operator a key was dead that still worked."""
    monkeypatch.setattr(cli, "KEY_APPLY_TIMEOUT_S", 1.0)  # they never will, here
    ws = uid("ws-")
    key_id = await _issue(platform, ws, None)
    await stop_the_api_keys_model(platform.store)  # the one a revocation waits for
    args = argparse.Namespace(workspace=ws, key_id=key_id)
    assert await cli._apikeys_revoke(args, platform) == cli.FAILURE
    out, err = capsys.readouterr()
    assert "revoked" not in out
    assert f"API key {key_id} is revoked, but the read models have not applied it" in err

    # A key issued then is shown (only this once), and said not to work yet.
    args = argparse.Namespace(
        workspace=ws, scopes="chat", name=None, rate_limit_rpm=None, action="create"
    )
    assert await cli._apikeys_create(args, platform) == cli.FAILURE
    out, err = capsys.readouterr()
    assert out.startswith("svc_") and len(out.split()) == 1
    assert "the API key above is issued, but the read models have not applied it" in err


async def test_a_key_is_shown_even_when_the_wait_for_the_read_models_fails(
    platform: Platform, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The key was printed only after the read models applied it: a database outage during
    that wait left an issued key (`*` scope, say) that nobody ever saw."""

    async def outage(*_: object, **__: object) -> bool:
        raise StoreUnavailable("the database went away")

    monkeypatch.setattr(platform.projections, "wait_for", outage)
    args = argparse.Namespace(
        workspace=uid("ws-"), scopes="*", name=None, rate_limit_rpm=None, action="create"
    )
    with pytest.raises(StoreUnavailable):
        await cli._apikeys_create(args, platform)
    out = capsys.readouterr().out
    assert out.startswith("svc_") and len(out.split()) == 1


async def test_a_name_recorded_with_control_characters_lists_on_one_line(
    platform: Platform, capsys: pytest.CaptureFixture[str]
) -> None:
    """Names are refused with them now; one recorded before still cannot forge a line."""
    ws = uid("ws-")
    await _issue(platform, ws, None, name="a\nkey_forged\tx\u202egnp.ex\u200be")
    assert await cli._apikeys_list(argparse.Namespace(workspace=ws, json=False), platform) == 0
    keys = capsys.readouterr().out.splitlines()
    # A direction override shows as its escape too: it would make the line read otherwise;
    # and so does a character that shows as nothing.
    assert len(keys) == 1 and keys[0].endswith("a\\nkey_forged\\tx\\u202egnp.ex\\u200be")


async def test_a_workspace_created_for_a_key_is_said_to_be_new(
    platform: Platform, capsys: pytest.CaptureFixture[str]
) -> None:
    """QA finding: a mistyped --workspace made a workspace of its own without a word."""
    ws = uid("ws-")
    args = argparse.Namespace(
        workspace=ws, scopes="chat", name=None, rate_limit_rpm=None, action="create"
    )
    assert await cli._apikeys_create(args, platform) == 0
    err = capsys.readouterr().err
    assert f"workspace {ws} did not exist; created it" in err, err
    assert await cli._apikeys_create(args, platform) == 0
    assert "did not exist" not in capsys.readouterr().err  # only the first time


async def test_the_command_line_records_its_user_as_the_settings_commands_do(
    platform: Platform, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """QA finding: keys issued and revoked from the command line were recorded `by: cli`,
    settings changed from it `cli:<user>`: the audit could not say which operator."""
    monkeypatch.setenv("LOGNAME", "ops-ann")
    ws = uid("ws-")
    args = argparse.Namespace(
        workspace=ws, scopes="chat", name=None, rate_limit_rpm=None, action="create"
    )
    assert await cli._apikeys_create(args, platform) == 0
    capsys.readouterr()
    events = await platform.store.read_stream(workspace_key(ws).stream_id)
    issued = [e for e in events if e.type == "workspace.api_key_issued"]
    assert [e.data["by"] for e in issued] == ["cli:ops-ann"], issued
    revoke = argparse.Namespace(workspace=ws, key_id=issued[0].data["key_id"], action="revoke")
    assert await cli._apikeys_revoke(revoke, platform) == 0
    events = await platform.store.read_stream(workspace_key(ws).stream_id)
    assert [e.data["by"] for e in events if e.type == "workspace.api_key_revoked"] == [
        "cli:ops-ann"
    ]


@pytest.mark.parametrize(
    ("scopes", "said"),
    [
        ("chat,,admin:read", "invalid --scopes 'chat,,admin:read': an empty scope in the list"),
        ("chat,", "invalid --scopes 'chat,': an empty scope in the list"),
        ("", "no scope in --scopes"),
    ],
)
def test_a_scope_list_with_an_empty_item_is_refused(scopes: str, said: str) -> None:
    """QA finding: the empty item was dropped and the key issued; the admin API refuses an
    empty scope."""
    args = cli.build_parser().parse_args(["apikeys", "create", "--scopes", scopes])
    with pytest.raises(InvalidInput) as refused:
        cli.check_apikeys_args(args, cli.Settings({}))
    assert refused.value.message.startswith(said), refused.value.message
    assert cli.exit_code(refused.value) == cli.USAGE_ERROR


def test_spaces_around_scopes_are_forgiven() -> None:
    args = cli.build_parser().parse_args(["apikeys", "create", "--scopes", "chat, admin:read"])
    assert cli._scopes(args.scopes) == ("chat", "admin:read")


@pytest.mark.parametrize(
    ("twice", "said"),
    [
        (["--scopes", "*"], "argument --scopes: given more than once"),
        (["--workspace", "a", "--workspace", "b"], "argument --workspace: given more than once"),
        (["--name", "a", "--name", "b"], "argument --name: given more than once"),
    ],
)
def test_an_option_of_a_new_key_given_twice_is_refused(
    twice: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """QA finding: `--scopes chat --scopes '*'` issued a full-access key, the last value
    winning without a word."""
    with pytest.raises(SystemExit) as exited:
        cli.build_parser().parse_args(["apikeys", "create", "--scopes", "chat", *twice])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and said in err and "give it once" in err, err
