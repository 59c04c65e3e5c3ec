"""A short CLI command stopped by SIGTERM or SIGHUP still runs its clean-up (the embedded
database let go) and exits with 128 + the signal's number."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from gateway.cli import _until_signalled


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
async def test_a_signal_cancels_the_command_and_its_clean_up_runs(sig: signal.Signals) -> None:
    cleaned: list[bool] = []
    started = asyncio.Event()

    async def command() -> int:
        try:
            started.set()
            await asyncio.sleep(60)
            return 0
        finally:
            cleaned.append(True)

    running = asyncio.create_task(_until_signalled(command()))
    await started.wait()
    os.kill(os.getpid(), sig)
    async with asyncio.timeout(10):
        code = await running
    assert code == 128 + sig and cleaned == [True]
    # The handlers are gone again: the process's own default is back.
    assert signal.getsignal(sig) in (signal.SIG_DFL, signal.default_int_handler)


async def test_a_command_that_ends_gives_its_own_code() -> None:
    async def command() -> int:
        return 3

    assert await _until_signalled(command()) == 3
