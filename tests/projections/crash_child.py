"""Child process of test_projection_crash.py: projects conversations and messages, then hangs
mid-batch.

Usage: python crash_child.py DSN BATCH_SIZE HANG_AT

Runs the conversations and messages projectors with batches of BATCH_SIZE events (full batches
one transaction per projector, the last partial batch one transaction for both). When the
messages projector is about to apply its HANG_AT-th event of the log (counting from 1 across
batches), its batch transaction is open, the checkpoints have already been moved inside it and
earlier events of the batch are applied: the child prints "HANGING" and sleeps until the
parent SIGKILLs it.
"""

from __future__ import annotations

import asyncio
import sys

from eventstore import Database
from eventstore.db import Connection
from eventstore.records import RecordedEvent
from projections import ConversationsProjector, MessagesProjector, ProjectionRunner


class HangingProjector(MessagesProjector):
    def __init__(self, hang_at: int) -> None:
        super().__init__()
        self._hang_at = hang_at
        self._applied = 0

    def handles(self, event_type: str) -> bool:
        return True  # count every event of the log; the base class ignores unknown types

    async def apply(self, conn: Connection, event: RecordedEvent) -> None:
        self._applied += 1
        if self._applied == self._hang_at:
            print("HANGING", flush=True)
            await asyncio.sleep(3600)
        await super().apply(conn, event)


async def main(dsn: str, batch_size: int, hang_at: int) -> None:
    db = await Database.connect(dsn, max_size=4)
    runner = ProjectionRunner(
        db, [ConversationsProjector(), HangingProjector(hang_at)], batch_size=batch_size
    )
    await runner.catch_up()
    print("FINISHED", flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
