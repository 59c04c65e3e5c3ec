"""The sweep of turns left running by a stopped process (gateway/turn_sweep.py).

Two platforms share one database. The first plays a process that stopped mid-turn: its
model server never finishes the answer, and its turn stays `running` in the log. The second
sweeps, as every gateway does once a minute, with its clock moved past the turn's expiry.
Where the two have different call budgets, the second plays the first after its budget was
changed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from importlib import resources
from typing import Any

import aiohttp
import pytest
from platform_support import Running, StallingUpstream, running, settings_for, uid

from actors.conversation import TURN_MARGIN_S
from eventstore.db import translate_errors
from eventstore.tasks import cancel_and_wait
from gateway import bootstrap, turn_sweep
from gateway.cli import build_parser, cmd_conversations
from gateway.settings import Settings
from gateway.state import DATABASE, RUNTIME, SETTINGS
from gateway.turn_sweep import AbandonedTurnSweep
from projections.queries import Turn, analytics, list_turns, overview
from schemas.errors import InvalidInput, NotFound, Unavailable

MODEL = "stub-model"
LATER = timedelta(minutes=10)
"""Past SVC_LLM_CALL_TIMEOUT_S (60 s here) and the sweep's margin."""


def _settings(database_url: str, upstream: str, budget_s: int = 60) -> Settings:
    return settings_for(
        database_url,
        SVC_LLM_GATEWAY_URL=upstream,
        SVC_LLM_MODEL=MODEL,
        SVC_LLM_RETRIES="0",
        SVC_LLM_CALL_TIMEOUT_S=str(budget_s),
        SVC_SHUTDOWN_GRACE_SEC="1",  # the stalled turns are failed on the way out
    )


async def _start_stalled_turn(svc: Running, key: str) -> tuple[aiohttp.ClientResponse, str]:
    """A streamed turn whose model call is under way (its first chunk arrived)."""
    resp = await svc.http.post(
        svc.url("/v1/chat/completions"),
        headers={"Authorization": f"Bearer {key}"},
        json={"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert resp.status == 200
    await resp.content.readline()
    return resp, resp.headers["X-SVC-Conversation-Id"]


async def _turn(svc: Running, workspace: str, conversation: str, status: str) -> Turn:
    async with asyncio.timeout(20):
        while True:
            turns = await list_turns(svc.app[DATABASE], workspace, conversation)
            if turns and turns[0].status == status:
                return turns[0]
            await asyncio.sleep(0.05)


def _sweeper(svc: Running) -> AbandonedTurnSweep:
    return AbandonedTurnSweep(svc.app[SETTINGS], svc.app[DATABASE], svc.app[RUNTIME])


async def test_a_turn_of_a_stopped_process_is_recorded_abandoned(database_url: str) -> None:
    workspace = uid("ws-")
    async with StallingUpstream(MODEL).running() as stub:
        settings = _settings(database_url, stub.base_url)
        async with running(settings) as stopped, running(settings) as sweeper:
            key, _ = await stopped.issue_key(workspace, ["chat", "admin:read"])
            resp, conversation = await _start_stalled_turn(stopped, key)
            await _turn(sweeper, workspace, conversation, "running")
            sweep = _sweeper(sweeper).sweep
            assert await sweep(datetime.now(UTC)) == 0  # not stale yet

            assert await sweep(datetime.now(UTC) + LATER) == 1
            turn = await _turn(sweeper, workspace, conversation, "failed")
            assert turn.error_code == "turn_abandoned"
            db = sweeper.app[DATABASE]
            assert (await overview(db, workspace)).turns_running == 0
            day = timedelta(days=1)
            now = datetime.now(UTC)
            figures = (await analytics(db, workspace, since=now - day, until=now + day)).totals
            assert figures.failed == 1 and figures.avg_duration_ms is None
            assert await sweep(datetime.now(UTC) + LATER) == 0
            resp.close()


async def test_a_turn_whose_row_came_after_its_window_is_found_by_a_full_sweep(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sweeps look back OVERLAP behind the last one; a turn whose row reached the read
    model later than that (here: after a sweep long past its expiry) is missed by them and
    found by the next full sweep."""
    monkeypatch.setattr(turn_sweep, "FULL_SWEEP_EVERY", 1)
    workspace = uid("ws-")
    async with StallingUpstream(MODEL).running() as stub:
        settings = _settings(database_url, stub.base_url)
        async with running(settings) as stopped, running(settings) as sweeper:
            sweep = _sweeper(sweeper).sweep
            now = datetime.now(UTC)
            await sweep(now + 2 * LATER)  # a full sweep, before the turn exists
            key, _ = await stopped.issue_key(workspace, ["chat"])
            resp, conversation = await _start_stalled_turn(stopped, key)
            await _turn(sweeper, workspace, conversation, "running")
            assert await sweep(now + 3 * LATER) == 0  # its expiry is behind this window
            assert await sweep(now + 4 * LATER) == 1  # the full sweep
            await _turn(sweeper, workspace, conversation, "failed")
            resp.close()


class _FailingFor:
    """The runtime, but a tell to one conversation always fails (its host is gone, say)."""

    def __init__(self, runtime: Any, conversation: str) -> None:
        self._runtime, self._conversation = runtime, conversation

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runtime, name)

    async def tell(self, key: Any, command: Any) -> None:
        if key.id == self._conversation:
            raise Unavailable("the conversation's host is unavailable")
        await self._runtime.tell(key, command)


async def test_a_conversation_that_stays_stale_does_not_hold_the_sweep_back(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full page sent the next sweep back to the same first page: conversations whose
    recovery kept failing held it, and the turns after them were never asked about."""
    monkeypatch.setattr(turn_sweep, "MAX_CONVERSATIONS", 1)
    workspace = uid("ws-")
    async with StallingUpstream(MODEL).running() as stub:
        settings = _settings(database_url, stub.base_url)
        async with running(settings) as stopped, running(settings) as sweeper:
            key, _ = await stopped.issue_key(workspace, ["chat"])
            first, stuck = await _start_stalled_turn(stopped, key)
            second, later = await _start_stalled_turn(stopped, key)
            await _turn(sweeper, workspace, later, "running")
            runtime = _FailingFor(sweeper.app[RUNTIME], stuck)
            sweep = AbandonedTurnSweep(sweeper.app[SETTINGS], sweeper.app[DATABASE], runtime)
            now = datetime.now(UTC) + LATER
            assert await sweep.sweep(now) == 1  # the stuck one: its tell fails
            assert await sweep.sweep(now) == 1  # then the one after it
            await _turn(sweeper, workspace, later, "failed")
            assert (await _turn(sweeper, workspace, stuck, "running")).status == "running"
            first.close()
            second.close()


async def test_a_turn_still_running_here_is_left_to_finish(database_url: str) -> None:
    workspace = uid("ws-")
    async with StallingUpstream(MODEL).running() as stub:
        async with running(_settings(database_url, stub.base_url)) as svc:
            key, _ = await svc.issue_key(workspace, ["chat"])
            resp, conversation = await _start_stalled_turn(svc, key)
            await _turn(svc, workspace, conversation, "running")
            # Queued behind the running turn in its conversation's mailbox: the sweep does not
            # wait for it, and it finds the turn ended by the time it runs.
            async with asyncio.timeout(10):
                assert await _sweeper(svc).sweep(datetime.now(UTC) + LATER) == 1
            stub.release()
            turn = await _turn(svc, workspace, conversation, "failed")
            assert turn.error_code != "turn_abandoned"
            resp.close()


@dataclass(frozen=True)
class Stalled:
    svc: Running
    """The process that sweeps."""
    workspace: str
    conversation: str
    turn: Turn


@asynccontextmanager
async def stalled_turn(database_url: str, started_under_s: int) -> AsyncIterator[Stalled]:
    """A turn left running by a process whose call budget was `started_under_s`, and a
    process with a budget of 60 s to sweep it."""
    workspace = uid("ws-")
    async with StallingUpstream(MODEL).running() as stub:
        before = _settings(database_url, stub.base_url, budget_s=started_under_s)
        async with (
            running(before) as stopped,
            running(_settings(database_url, stub.base_url)) as svc,
        ):
            key, _ = await stopped.issue_key(workspace, ["chat"])
            resp, conversation = await _start_stalled_turn(stopped, key)
            turn = await _turn(svc, workspace, conversation, "running")
            yield Stalled(svc, workspace, conversation, turn)
            resp.close()


async def test_a_turn_is_swept_at_its_own_expiry_after_the_budget_was_lowered(
    database_url: str,
) -> None:
    """Started under a 600 s budget (expiry 11 minutes on), swept by a process whose budget
    is 60 s: not named at 10 minutes, when its conversation would leave it running, and
    still found by a sweep long after, whatever sweeps ran in between."""
    async with stalled_turn(database_url, started_under_s=600) as stalled:
        sweep = _sweeper(stalled.svc).sweep
        now = datetime.now(UTC)
        assert await sweep(now + LATER) == 0
        assert await sweep(now + 3 * LATER) == 1
        turn = await _turn(stalled.svc, stalled.workspace, stalled.conversation, "failed")
        assert turn.error_code == "turn_abandoned"


async def test_a_turn_whose_call_had_no_time_limit_is_never_swept(database_url: str) -> None:
    async with stalled_turn(database_url, started_under_s=0) as stalled:
        assert await _sweeper(stalled.svc).sweep(datetime.now(UTC) + timedelta(days=30)) == 0


async def test_an_operator_abandons_a_turn_that_never_expires(
    database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`svc conversations abandon`: the way out for a dead turn no age can end."""
    async with stalled_turn(database_url, started_under_s=0) as stalled:
        settings = stalled.svc.app[SETTINGS]
        abandon = ["conversations", "abandon", stalled.conversation]
        # Without --workspace, the default workspace's, as its help says (QA finding: any
        # workspace's conversation was reached).
        unscoped = build_parser().parse_args(abandon)
        with pytest.raises(NotFound, match="name its workspace with --workspace"):
            await cmd_conversations(unscoped, settings)
        abandon += ["--workspace", stalled.workspace]
        wrong = build_parser().parse_args([*abandon, "--turn", "no-such-turn"])
        with pytest.raises(InvalidInput, match="not running in conversation"):
            await cmd_conversations(wrong, settings)

        args = build_parser().parse_args(abandon)
        assert await cmd_conversations(args, settings) == 0
        assert stalled.turn.turn_id in capsys.readouterr().out
        turn = await _turn(stalled.svc, stalled.workspace, stalled.conversation, "failed")
        assert turn.error_code == "turn_abandoned"
        assert await cmd_conversations(args, settings) == 0
        assert "no turn is running" in capsys.readouterr().out


async def test_abandoning_a_turn_within_its_lifetime_asks_for_force(
    database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """QA finding: an operator abandoned a turn the service was still running, which lost
    its answer, and nothing said that its expiry would have ended it anyway."""
    async with stalled_turn(database_url, started_under_s=600) as stalled:
        settings = stalled.svc.app[SETTINGS]
        abandon = ["conversations", "abandon", stalled.conversation]
        abandon += ["--workspace", stalled.workspace]
        with pytest.raises(InvalidInput, match="may still be running in a live process") as said:
            await cmd_conversations(build_parser().parse_args(abandon), settings)
        assert "pass --force" in said.value.message and stalled.turn.turn_id in said.value.message
        await _turn(stalled.svc, stalled.workspace, stalled.conversation, "running")
        assert (
            await cmd_conversations(build_parser().parse_args([*abandon, "--force"]), settings) == 0
        )
        assert stalled.turn.turn_id in capsys.readouterr().out
        turn = await _turn(stalled.svc, stalled.workspace, stalled.conversation, "failed")
        assert turn.error_code == "turn_abandoned"
        # QA finding: its retry said the turn's process had stopped, which it had not.
        assert turn.error_message is not None and "by an operator" in turn.error_message


async def test_a_turn_without_a_recorded_expiry_is_swept_by_its_age(database_url: str) -> None:
    """A read-model row from before turns recorded an expiry (NULL), and the migration that
    gives the rows of turns still running their recorded one, run again as a later start
    does: idempotent."""
    async with stalled_turn(database_url, started_under_s=60) as stalled:
        svc, turn_id = stalled.svc, stalled.turn.turn_id
        async with svc.app[DATABASE].acquire() as conn:
            await conn.execute("UPDATE turns SET expires_at = NULL WHERE turn_id = $1", turn_id)
            assert await _sweeper(svc).sweep(datetime.now(UTC) + LATER) == 1
            await _turn(svc, stalled.workspace, stalled.conversation, "failed")
            await conn.execute(
                "UPDATE turns SET expires_at = NULL, status = 'running' WHERE turn_id = $1",
                turn_id,
            )
            await conn.execute(_migration("0151_turn_expiry_index.sql"))
            expiry = await conn.fetchval(
                "SELECT expires_at - started_at FROM turns WHERE turn_id = $1", turn_id
            )
            await conn.execute("UPDATE turns SET status = 'failed' WHERE turn_id = $1", turn_id)
        assert expiry == timedelta(seconds=60 + TURN_MARGIN_S)


def _migration(name: str) -> str:
    return resources.files("projections.migrations").joinpath(name).read_text()


async def test_a_periodic_job_in_an_outage_is_one_line_naming_it(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """QA finding: with the database frozen, the sweep logged "periodic job failed" and a
    50-line traceback every round, naming itself only inside it, and the store's message
    read "retry shortly (; check ...)" for an error with no text (a bare TimeoutError)."""
    failures: list[BaseException] = []

    async def job() -> None:
        with translate_errors():
            raise failures.pop(0)

    failures += [TimeoutError(), KeyError("defect")]
    task = asyncio.create_task(bootstrap._every(0.01, job, "the abandoned-turn sweep"))
    with caplog.at_level(logging.WARNING, logger="gateway.bootstrap"):
        async with asyncio.timeout(10):
            while len(caplog.records) < 2:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
    await cancel_and_wait(task)
    outage, defect = caplog.records[:2]
    assert outage.levelno == logging.WARNING and outage.exc_info is None
    assert outage.getMessage().startswith(
        "the abandoned-turn sweep: the event store database timed out; retry shortly "
        "(TimeoutError; check that PostgreSQL is running and reachable)"
    ), outage.getMessage()
    assert defect.levelno == logging.ERROR and defect.exc_info is not None
    assert defect.getMessage().startswith("the abandoned-turn sweep failed")
