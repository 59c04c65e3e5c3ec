"""Appends commands in a loop and prints each acknowledged append, for test_crash.py.

Usage: python crash_writer.py DSN RUN_ID FIRST COUNT WRITERS

Command i (FIRST <= i < FIRST+COUNT) is deterministic: command id `RUN_ID-i`, stream
`crash-{i % 8}`, `1 + i % 3` events whose data names the command. Several writers share the
commands, so appends are in flight when the process is killed. One line per acknowledged
append, flushed before the next: `ack i stream first_version last_version duplicate`.
"""

from __future__ import annotations

import asyncio
import sys

from eventstore import ConcurrencyConflict, NewEvent, open_store

STREAMS = 8


def command(run_id: str, i: int) -> tuple[str, str, list[NewEvent]]:
    command_id = f"{run_id}-{i}"
    events = [NewEvent("CrashTested", {"command": command_id, "k": k}) for k in range(1 + i % 3)]
    return command_id, f"crash-{i % STREAMS}", events


async def main(dsn: str, run_id: str, first: int, count: int, writers: int) -> None:
    store = await open_store(dsn)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(first, first + count):
        queue.put_nowait(i)

    async def writer() -> None:
        while not queue.empty():
            i = queue.get_nowait()
            command_id, stream, events = command(run_id, i)
            while True:
                try:
                    result = await store.append(
                        stream,
                        events,
                        expected_version=None,
                        command_id=command_id,
                        workspace_id="crash",
                    )
                    break
                except ConcurrencyConflict:
                    # Two writers raced for the same stream version; the loser rolled back
                    # (ledger row included) and retries the same command.
                    continue
            sys.stdout.write(
                f"ack {i} {result.stream_id} {result.first_version} {result.last_version} "
                f"{int(result.duplicate)}\n"
            )
            sys.stdout.flush()

    try:
        await asyncio.gather(*(writer() for _ in range(writers)))
    finally:
        await store.close()
    sys.stdout.write("done\n")
    sys.stdout.flush()


if __name__ == "__main__":
    dsn, run_id, first, count, writers = sys.argv[1:6]
    asyncio.run(main(dsn, run_id, int(first), int(count), int(writers)))
