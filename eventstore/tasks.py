"""Ending background tasks.

Every long-lived loop here (the tailer, the notifier, the projection runner, samplers,
sweepers) is stopped by cancelling its task and waiting for it to end. Two Python 3.11 traps
made such a stop hang, and this module and the project's lint keep them out:

- `asyncio.wait_for` returns the awaited result, dropping the cancellation, when a cancel
  lands just as the awaited thing finishes (fixed in 3.12, where it is built on
  `asyncio.timeout`). A loop that waited on a wake-up with it could go on forever after
  `cancel()`. Ruff bans it in the packages (pyproject.toml); `asyncio.timeout` is used instead.
- `with suppress(CancelledError): await task` swallows the cancellation of the *caller* too,
  so a stop bounded by `asyncio.timeout` never ended at its bound. `cancel_and_wait` tells the
  two apart.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger(__name__)


async def cancel_and_wait(*tasks: asyncio.Task[Any] | None) -> None:
    """Cancel `tasks` and wait until each has ended. An error a task ended with is logged,
    not raised (the stop goes on); the caller's own cancellation propagates."""
    running = [task for task in tasks if task is not None]
    for task in running:
        task.cancel()
    outcomes = await asyncio.gather(*running, return_exceptions=True)
    for task, outcome in zip(running, outcomes, strict=True):
        if isinstance(outcome, Exception):
            log.error("background task %s failed: %r", task.get_name(), outcome)


async def cancel_unless_done(task: asyncio.Task[Any]) -> None:
    """Cancel `task` and wait for it if it still runs. One that already ended is its awaiter's
    to read, which took its result or its error there: nothing is logged for it again."""
    if not task.done():
        await cancel_and_wait(task)
    elif not task.cancelled():
        task.exception()  # marked retrieved


async def wait_set(event: asyncio.Event, timeout_s: float) -> bool:
    """Wait up to `timeout_s` for `event`: True if it is set, False when the time ran out.
    Built on `asyncio.timeout`, so a cancellation of the waiter is never lost (see above)."""
    try:
        async with asyncio.timeout(timeout_s):
            await event.wait()
    except TimeoutError:
        return False
    return True
