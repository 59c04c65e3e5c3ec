"""A short CLI command stopped by SIGTERM, SIGINT or SIGHUP still runs its clean-up (the embedded
database let go) and exits with 128 + the signal's number."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from gateway import cli, entry
from gateway.cli import _until_signalled


class LongCommand:
    """A command that runs until cancelled, then cleans up for `clean_up_s`."""

    def __init__(self, clean_up_s: float = 0.0) -> None:
        self.clean_up_s = clean_up_s
        self.started, self.cleaning = asyncio.Event(), asyncio.Event()
        self.cleaned = False

    async def __call__(self) -> int:
        try:
            self.started.set()
            await asyncio.sleep(60)
            return 0
        finally:
            self.cleaning.set()
            await asyncio.sleep(self.clean_up_s)  # letting go of the database
            self.cleaned = True


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
async def test_a_signal_cancels_the_command_and_its_clean_up_runs(sig: signal.Signals) -> None:
    command = LongCommand()
    running = asyncio.create_task(_until_signalled(command()))
    await command.started.wait()
    os.kill(os.getpid(), sig)
    async with asyncio.timeout(10):
        code = await running
    assert code == 128 + sig and command.cleaned
    # The handlers are gone again: the process's own default is back.
    assert signal.getsignal(sig) in (signal.SIG_DFL, signal.default_int_handler)


async def test_a_command_that_ends_gives_its_own_code() -> None:
    async def command() -> int:
        return 3

    assert await _until_signalled(command()) == 3


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
async def test_a_second_signal_does_not_cut_the_clean_up_short(
    sig: signal.Signals, capsys: pytest.CaptureFixture[str]
) -> None:
    """Review finding, for SIGINT: asyncio.run's own handler raised KeyboardInterrupt at a
    second Ctrl-C, in the middle of the clean-up."""
    command = LongCommand(clean_up_s=0.2)
    running = asyncio.create_task(_until_signalled(command()))
    await command.started.wait()
    os.kill(os.getpid(), sig)
    await command.cleaning.wait()
    os.kill(os.getpid(), sig)
    async with asyncio.timeout(10):
        assert await running == 128 + sig
    assert command.cleaned
    assert "already stopping" in capsys.readouterr().err


async def test_an_ignored_sighup_stays_ignored() -> None:
    """Under `nohup` a closed terminal must not stop the command."""
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        finished = asyncio.Event()

        async def command() -> int:
            await asyncio.sleep(0.3)
            finished.set()
            return 0

        running = asyncio.create_task(_until_signalled(command()))
        await asyncio.sleep(0.05)
        os.kill(os.getpid(), signal.SIGHUP)
        async with asyncio.timeout(10):
            assert await running == 0 and finished.is_set()
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_a_ctrl_c_before_the_command_runs_is_130_without_a_traceback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """QA finding: a Ctrl-C while the parser was being built (before the CLI's own handling)
    ended the process by the signal, with a traceback."""

    def interrupted() -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "main", interrupted)
    assert entry.main() == 130
