"""The shutdown budget of `svc serve`: one `SVC_SHUTDOWN_GRACE_SEC` counted from the signal,
however many steps ask for the actor runtime to stop, and the report its last log line gives.

The server starts the budget at the signal and stops the runtime before it drains its
handlers (gateway/app.py); the platform's exit stack (gateway/bootstrap.py) then waits for that
same stop and closes the rest, each step `bounded` so that one that hangs never keeps the
database from being stopped.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from actors.runtime import ActorRuntime
from actors.table import INTERRUPT_RECORD_S, StopSummary

log = logging.getLogger(__name__)

PROJECTION_FLUSH_S = 5.0
"""How long the projections get to catch up with the log before they stop."""
STOP_STEP_S = 10.0
"""The deadline of a shutdown step that names none of its own."""
RUNTIME_STOP_MARGIN_S = INTERRUPT_RECORD_S + 5.0
"""Past the grace, the most the runtime's stop may take: cancelled turns record their failure
(the table bounds that), actors save their snapshots. A stop that hangs longer is left behind."""


@dataclass
class ShutdownReport:
    """What the shutdown did, filled in as it goes (for the final log line of `svc serve`)."""

    grace_s: float
    feeds_closed: int = 0
    commands: StopSummary | None = None
    """None until the runtime stopped, and with the `ray` runtime's own hosts (they count
    their own); with a shared Ray cluster's hosts, the calls this process left running."""
    runtime_stopped: bool = False
    projections_behind: str | None = None
    """Why the read models were left behind the log (a flush that timed out or failed)."""
    overran: list[str] = field(default_factory=list)
    """Shutdown steps that hit their deadline and were left behind."""
    failed: list[str] = field(default_factory=list)
    """Shutdown steps that raised (logged with their traceback)."""

    def summary(self) -> str:
        parts = [self._commands(), f"{_plural(self.feeds_closed, 'feed')} closed"]
        if self.projections_behind is not None:
            parts.append(f"projections {self.projections_behind}")
        if self.overran:
            parts.append(f"steps left behind at their deadline: {', '.join(self.overran)}")
        if self.failed:
            parts.append(f"steps that failed: {', '.join(self.failed)}")
        return "; ".join(parts)

    def _commands(self) -> str:
        if not self.runtime_stopped:
            return "actor runtime not stopped"
        done = self.commands
        if done is None:
            return "actor hosts stopped (their logs count the commands they interrupted)"
        text = (
            f"{_plural(done.finished, 'in-flight command')} (chat turns and others) finished "
            f"within the {self.grace_s:.0f} s grace, {done.interrupted} interrupted (turns "
            f"recorded as failed, clients told to retry), {done.refused} queued refused"
        )
        if done.left_running:
            text += (
                f", {done.left_running} left running on the shared actor hosts (clients told "
                "to collect the answer with the same Idempotency-Key)"
            )
        return text


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


class Shutdown:
    """The one shutdown budget: commands in flight get `grace_s` from `begin()` (the signal)
    to finish, however many steps then ask for the runtime to stop, and it stops once."""

    def __init__(
        self, runtime: ActorRuntime, grace_s: float, report: ShutdownReport | None = None
    ) -> None:
        self._runtime = runtime
        self.grace_s = grace_s
        self.report = report or ShutdownReport(grace_s)
        self._deadline: float | None = None
        self._stopping: asyncio.Future[None] | None = None

    def begin(self) -> None:
        """Start the budget now, unless it has already started."""
        if self._deadline is None:
            self._deadline = asyncio.get_running_loop().time() + self.grace_s

    @property
    def begun(self) -> bool:
        return self._deadline is not None

    def remaining_s(self) -> float:
        """What is left of the budget (the whole grace before `begin`)."""
        if self._deadline is None:
            return self.grace_s
        return max(0.0, self._deadline - asyncio.get_running_loop().time())

    async def stop_runtime(self) -> None:
        """Stop the runtime within what is left of the budget; a second call waits for the
        same stop. Shielded: a caller cancelled meanwhile does not cut the stop short."""
        self.begin()
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._stop_runtime())
        await asyncio.shield(self._stopping)

    async def _stop_runtime(self) -> None:
        # Never raises: it runs in an aiohttp on_shutdown hook, and a failure there would
        # skip the rest of the shutdown (closing the store, stopping the database).
        remaining = self.remaining_s()

        async def stop() -> None:
            self.report.commands = await self._runtime.stop(remaining)

        deadline_s = remaining + RUNTIME_STOP_MARGIN_S
        try:
            stopped = await bounded("actor runtime", stop, deadline_s, self.report)
        except Exception:
            log.exception("stopping the actor runtime failed; continuing shutdown")
            self.report.failed.append("actor runtime")
        else:
            self.report.runtime_stopped = stopped


async def bounded(
    what: str,
    stop: Callable[[], Awaitable[object]],
    deadline_s: float = STOP_STEP_S,
    report: ShutdownReport | None = None,
) -> bool:
    """Run one shutdown step with a deadline: a step that hangs is logged (and noted in
    `report`) and left behind, so that the steps after it (closing the pool, stopping the
    database) still run. False when it was left behind."""
    try:
        async with asyncio.timeout(deadline_s):
            await stop()
    except TimeoutError:
        log.error("stopping the %s took more than %.0f s; continuing shutdown", what, deadline_s)
        if report is not None:
            report.overran.append(what)
        return False
    return True
