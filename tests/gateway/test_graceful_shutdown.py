"""Graceful shutdown with chat turns in flight: one budget of SVC_SHUTDOWN_GRACE_SEC, then
the turns still running are interrupted, recorded as failed, and their clients answered (a 503
envelope, or an SSE error frame once the stream has started) instead of cut off.

Real servers on loopback with a stub upstream that stalls: the app's own shutdown path
(aiohttp's runner cleanup) in process, and `svc serve` as a subprocess stopped by SIGTERM.
The only timing assertions are generous bounds (3x what shutdown should take)."""

from __future__ import annotations

import asyncio
import os
import pickle
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar, cast

import aiohttp
import asyncpg
import orjson
import pytest
from aiohttp import web
from platform_support import StallingUpstream, issue_key, serving_url, uid
from pydantic import BaseModel

from actors import ActivationTable, ActorContext, ActorKey, Behaviour, RuntimeStopping
from actors.errors import CommandInterrupted
from eventstore import migrate
from eventstore.embedded import EmbeddedPostgres
from eventstore.errors import StoreUnavailable
from gateway import bootstrap
from gateway.app import HANDLER_DRAIN_S, SHUTDOWN, create_app
from gateway.http_server import GatewayRunner
from gateway.settings import Settings
from gateway.shutdown import ShutdownReport
from schemas.commands import Command
from schemas.events import Event

# Closing the store's LISTEN connection warns (asyncpg InterfaceWarning); under the suite's
# warnings-as-errors that warning would abort the platform's shutdown (see test_feeds.py).
pytestmark = pytest.mark.filterwarnings("ignore::asyncpg.InterfaceWarning")

GRACE_S = 2.0
MARGIN_S = 3.0
"""What shutdown may take past the grace on this machine: record the interrupted turns, drain
the handlers, flush projections, close the pool (well under a second when idle)."""
CALL_TIMEOUT_S = 300
"""The model call's own timeout: far longer than the test, so no turn ends on its own."""
MODEL = "stub-model"
CHAT = "/v1/chat/completions"
HELLO = [{"role": "user", "content": "hello, slow model"}]


def _config(database_url: str, upstream: str, tmp_path: Path) -> dict[str, str]:
    return {
        "SVC_DATABASE_URL": database_url,
        "SVC_DATA_DIR": str(tmp_path),
        "SVC_LLM_GATEWAY_URL": upstream,
        "SVC_LLM_MODEL": MODEL,
        "SVC_LLM_RETRIES": "0",
        "SVC_LLM_CALL_TIMEOUT_S": str(CALL_TIMEOUT_S),
        "SVC_SHUTDOWN_GRACE_SEC": str(int(GRACE_S)),
    }


def _settings(database_url: str, upstream: str, tmp_path: Path) -> Settings:
    return Settings(_config(database_url, upstream, tmp_path))


async def _turn_failures(database_url: str) -> list[str]:
    conn = await asyncpg.connect(database_url)
    try:
        rows = await conn.fetch(
            "SELECT data->>'error_code' AS code FROM events "
            "WHERE type = 'conversation.turn_failed' ORDER BY position"
        )
    finally:
        await conn.close()
    return [row["code"] for row in rows]


def _sse_payloads(raw: bytes) -> list[Any]:
    payloads: list[Any] = []
    for frame in raw.decode().split("\n\n"):
        data = [line[6:] for line in frame.splitlines() if line.startswith("data: ")]
        if data:
            text = "\n".join(data)
            payloads.append(text if text == "[DONE]" else orjson.loads(text))
    return payloads


async def _post(
    http: aiohttp.ClientSession, url: str, key: str, body: dict[str, Any]
) -> tuple[int, bytes]:
    headers = {"Authorization": f"Bearer {key}"}
    async with http.post(url + CHAT, json=body, headers=headers) as resp:
        return resp.status, await resp.read()


def _interrupted(status: int, raw: bytes) -> None:
    assert status == 503, raw
    error = orjson.loads(raw)["error"]
    assert error["code"] == "interrupted" and error["type"] == "server_error", error
    assert "new Idempotency-Key" in error["message"]


async def test_shutdown_answers_in_flight_turns_and_records_them(
    database_url: str, tmp_path: Path
) -> None:
    async with StallingUpstream().running() as stub:
        app = create_app(_settings(database_url, stub.base_url, tmp_path))
        runner = GatewayRunner(app, shutdown_timeout=HANDLER_DRAIN_S)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        key, _ = await issue_key(app, uid("ws-"), ("chat",))
        async with aiohttp.ClientSession() as http:
            json_reply = asyncio.create_task(
                _post(http, url, key, {"model": MODEL, "messages": HELLO})
            )
            stream_reply = asyncio.create_task(
                _post(http, url, key, {"model": MODEL, "messages": HELLO, "stream": True})
            )
            await stub.until_calls(2)
            started = time.monotonic()
            await runner.cleanup()
            took = time.monotonic() - started
            # Both handlers wrote their answer before the server closed their connections.
            _interrupted(*await json_reply)
            status, raw = await stream_reply
    assert status == 200, raw
    payloads = _sse_payloads(raw)
    # The stream had started: the text so far, then the error object, and no [DONE].
    assert payloads[0]["choices"][0]["delta"]["content"] == "Hel", payloads
    error = payloads[-1]["error"]
    assert error["code"] == "interrupted" and "new Idempotency-Key" in error["message"]
    assert "[DONE]" not in payloads
    assert took < 3 * (GRACE_S + MARGIN_S), f"shutdown took {took:.1f} s"
    report = app[SHUTDOWN].report
    assert report.runtime_stopped and report.commands is not None
    assert (report.commands.interrupted, report.commands.refused) == (2, 0)
    summary = report.summary()
    assert "2 interrupted" in summary and "0 feeds closed" in summary, summary
    assert await _turn_failures(database_url) == ["interrupted", "interrupted"]


# --- the activation table's stop -----------------------------------------------------------


class Pause(Command):
    seconds: float


class Nothing(BaseModel):
    pass


class PauseBehaviour(Behaviour[Nothing]):
    """Sleeps as long as each command says (no events, so the table needs no store)."""

    kind: ClassVar[str] = "pause"
    state_type: ClassVar[type[BaseModel]] = Nothing

    def initial_state(self, key: ActorKey) -> Nothing:
        return Nothing()

    def decide(self, state: Nothing, command: Command) -> Sequence[Event]:
        return []

    def evolve(self, state: Nothing, event: Event) -> Nothing:
        return state

    async def handle(self, ctx: ActorContext[Nothing], command: Command) -> AsyncIterator[Any]:
        assert isinstance(command, Pause)
        await asyncio.sleep(command.seconds)
        yield command.command_id


async def test_table_stop_counts_what_it_did_with_the_work_in_flight() -> None:
    table = ActivationTable(None, [PauseBehaviour()])
    await table.start()
    quick, stuck = ActorKey("pause", "quick"), ActorKey("pause", "stuck")
    done = table.submit(quick, Pause(command_id="quick", workspace_id="w", seconds=0.05))
    cut = table.submit(stuck, Pause(command_id="stuck", workspace_id="w", seconds=600))
    queued = table.submit(stuck, Pause(command_id="queued", workspace_id="w", seconds=0))
    await asyncio.sleep(0)  # both workers have taken their first command
    summary = await table.stop(deadline_s=1.0)
    assert await done.last() == "quick"
    with pytest.raises(CommandInterrupted) as interrupted:
        await cut.last()
    assert interrupted.value.code == "interrupted" and interrupted.value.http_status == 503
    # Not a chat turn, which is recorded as failed: nothing says whether it took effect, so
    # a new key could run it twice; the same key returns its result or runs it.
    assert "same Idempotency-Key" in interrupted.value.message
    assert "new Idempotency-Key" not in interrupted.value.message
    # The ray runtime raises it in a host process and again in the caller.
    copy = pickle.loads(pickle.dumps(interrupted.value))
    assert type(copy) is CommandInterrupted and copy.code == "interrupted"
    with pytest.raises(RuntimeStopping) as refused:
        await queued.last()
    assert refused.value.code == "runtime_stopping"
    assert (summary.finished, summary.interrupted, summary.refused) == (1, 1, 1)


# --- `svc serve` and SIGTERM -------------------------------------------------------------------

SVC = [sys.executable, "-c", "import sys; from gateway.cli import main; sys.exit(main())"]
ROOT = Path(__file__).resolve().parents[2]


def _env(database_url: str, upstream: str, tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SVC_")}
    config = _config(database_url, upstream, tmp_path)
    return {**env, **config, "SVC_GATEWAY_ADDR": "127.0.0.1:0"}


async def sigterm_mid_turn(
    env: dict[str, str],
    stub: StallingUpstream,
    log_path: Path,
    answered: Callable[[int, bytes], None] = _interrupted,
    *,
    whole_group: bool = False,
    before_signal: Callable[[int], Awaitable[None]] | None = None,
) -> tuple[int, float]:
    """`svc serve` with `env` (on `SVC_GATEWAY_ADDR=127.0.0.1:0`), a key made by `svc
    apikeys create`, a chat turn stalled at `stub`, then SIGTERM, to the server's whole
    process group when `whole_group`: the turn's client is `answered` (by default
    `interrupted`). Returns the server's exit code and the seconds from the signal to the
    exit. `before_signal` is given the server's pid, with the turn under way."""
    with log_path.open("wb") as log_file:
        server = await asyncio.create_subprocess_exec(
            *SVC, "serve", env=env, stdout=log_file, stderr=log_file, cwd=ROOT,
            start_new_session=whole_group,
        )  # fmt: skip
        try:
            url = await serving_url(server, log_path)
            created = await asyncio.to_thread(
                subprocess.run,
                [*SVC, "apikeys", "create", "--scopes", "chat"],
                env=env,
                capture_output=True,
                text=True,
                timeout=180,
                cwd=ROOT,
            )
            assert created.returncode == 0, created.stderr
            key = created.stdout.strip()
            async with aiohttp.ClientSession() as http:
                reply = asyncio.create_task(
                    _post(http, url, key, {"model": MODEL, "messages": HELLO})
                )
                await stub.until_calls(1)
                if before_signal is not None:
                    await before_signal(server.pid)
                if whole_group:
                    os.killpg(server.pid, signal.SIGTERM)
                else:
                    server.send_signal(signal.SIGTERM)
                signalled = time.monotonic()
                answered(*await reply)
                async with asyncio.timeout(120):
                    await server.wait()
                took = time.monotonic() - signalled
        finally:
            if server.returncode is None:
                server.kill()
                await server.wait()
    return server.returncode, took


async def test_sigterm_answers_in_flight_turns_within_one_grace(
    database_url: str, tmp_path: Path
) -> None:
    log_path = tmp_path / "serve.log"
    async with StallingUpstream().running() as stub:
        env = _env(database_url, stub.base_url, tmp_path)
        code, took = await sigterm_mid_turn(env, stub, log_path)
    log = log_path.read_text(errors="replace")
    assert code == 0, log
    assert took < 3 * (GRACE_S + MARGIN_S), f"exit {took:.1f} s after SIGTERM\n{log}"
    stopped = next(line for line in log.splitlines() if "svc stopped in" in line)
    assert "0 in-flight commands" in stopped and "1 interrupted" in stopped, stopped
    assert "0 feeds closed" in stopped, stopped
    assert await _turn_failures(database_url) == ["interrupted"]


class _FlushingRunner:
    def __init__(self, catch_up: Any) -> None:
        self.catch_up = catch_up
        self.stopped = False

    async def stop(self) -> None:
        self.stopped = True


async def _wrote() -> bool:
    return True


async def test_the_summary_says_why_the_read_models_were_left_behind(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A flush that fails at once (the database gone) is named as that, not as a flush that
    ran out of time; one that completes adds nothing."""

    async def database_gone() -> None:
        raise StoreUnavailable("the database is unreachable")

    async def slow() -> None:
        await asyncio.sleep(10)

    async def done() -> None:
        return None

    monkeypatch.setattr(bootstrap, "PROJECTION_FLUSH_S", 0.05)
    summaries = []
    for catch_up in (database_gone, slow, done):
        report = ShutdownReport(grace_s=10)
        runner = _FlushingRunner(catch_up)
        await bootstrap._flush_and_stop(cast(Any, runner), report, _wrote)
        assert runner.stopped
        summaries.append(report.summary())
    assert "projections not caught up: the database is unreachable" in summaries[0]
    assert "within" not in summaries[0]
    assert "projections not caught up within 0 s" in summaries[1]
    assert "projections" not in summaries[2]


async def test_sigterm_during_the_start_cancels_the_start(
    database_url: str, tmp_path: Path
) -> None:
    """Review finding: a signal during the start (here: waiting for another process's
    migrations, as behind an index build) was only acted on once the start ended, minutes
    later or never; an orchestrator then escalates to SIGKILL. Now the start is cancelled
    and the process exits cleanly."""
    env = _env(database_url, "http://127.0.0.1:9/v1", tmp_path)
    log_path = tmp_path / "serve.log"
    holder = await asyncpg.connect(database_url)
    try:
        async with holder.transaction():
            await holder.execute("SELECT pg_advisory_xact_lock($1)", migrate._LOCK_KEY)
            with log_path.open("wb") as log_file:
                server = await asyncio.create_subprocess_exec(
                    *SVC, "serve", env=env, stdout=log_file, stderr=log_file, cwd=ROOT
                )
                try:
                    async with asyncio.timeout(60):
                        while "another process's migrations" not in log_path.read_text():  # noqa: ASYNC110
                            await asyncio.sleep(0.05)
                    server.send_signal(signal.SIGTERM)
                    async with asyncio.timeout(30):
                        code = await server.wait()
                finally:
                    if server.returncode is None:
                        server.kill()
                        await server.wait()
    finally:
        await holder.close()
    log = log_path.read_text(errors="replace")
    assert code == 0, log
    assert "svc stopped during its start" in log and "Traceback" not in log, log


async def test_a_start_cancelled_while_the_embedded_database_starts_stops_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Review finding: a cancelled start left the thread starting the embedded database (a
    crash recovery may take minutes) running on, and the server it started with it, after
    the process had let go of its signal handlers and clean-up."""
    said: list[str] = []

    def slow_start(_self: EmbeddedPostgres) -> str:
        time.sleep(0.5)
        said.append("started")
        return "postgresql://svc@localhost/svc"

    monkeypatch.setattr(EmbeddedPostgres, "start", slow_start)
    monkeypatch.setattr(EmbeddedPostgres, "stop", lambda _self: said.append("stopped"))

    async def serve() -> None:
        async with bootstrap.database_url(Settings({"SVC_DATA_DIR": str(tmp_path)})):
            await asyncio.sleep(60)

    task = asyncio.create_task(serve())
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert said == ["started", "stopped"]
