"""Turns left running by a process that died, found without waiting for their conversation.

A conversation records a turn its previous incarnation never ended as `turn_abandoned` when
its next command arrives (actors/conversation.py). A conversation nobody touches again (its
client was cut off before it learnt the conversation id) would keep that turn `running` for
good, in the turns read model, the overview and the analytics. So every gateway looks, once
a minute, for running turns past the expiry each recorded as it started (its call's time
budget, plus a margin for the appends around it) and asks their conversations to record
them as abandoned.

Safe against a turn that is in fact still running: the command goes through the
conversation's mailbox, behind a turn this runtime is running, and is decided on the state
after it (a turn that ended meanwhile is left alone). A turn whose call had no time limit
(`SVC_LLM_CALL_TIMEOUT_S` 0 as it started) never expires: no age tells it dead from slow.
"""

from __future__ import annotations

import hashlib
import logging
from datetime import UTC, datetime, timedelta

from actors import conversation_key
from actors.conversation import turn_lifetime
from actors.runtime import ActorRuntime
from eventstore.db import Database
from gateway.settings import Settings
from projections.queries import RunningTurns, SweepKey, SweepWindow, stale_running_turns
from schemas.commands import service_command_id
from schemas.conversation import RecoverAbandonedTurns
from schemas.errors import SvcError

log = logging.getLogger(__name__)

SWEEP_EVERY_S = 60.0
MAX_CONVERSATIONS = 100
"""Per sweep; the next sweep takes the rest."""


def call_budget_s(settings: Settings) -> float:
    """The model-call time budget in force, in seconds; 0: calls have no time limit."""
    return float(settings.integer("SVC_LLM_CALL_TIMEOUT_S"))


def stale_after(settings: Settings) -> timedelta | None:
    """How long a turn may run before it is taken for abandoned; None: never."""
    return turn_lifetime(call_budget_s(settings))


OVERLAP = timedelta(minutes=5)
"""Each sweep looks back this far behind where the last one ended: turns a sweep missed
(its commands lost with a restarting host, say) are found again."""

FULL_SWEEP_EVERY = 60
"""After this many complete sweeps of the recent window, one looks DEEP_LOOKBACK back: a
turn whose row reached the read model more than OVERLAP after it expired (its projection
stopped for a while, say) is found within the hour."""

DEEP_LOOKBACK = timedelta(days=7)
"""How far back the hourly deep sweep looks: a bounded index range, where a sweep of every
turn ever recorded took 1.6 s over 2 million turns, in every gateway."""


class AbandonedTurnSweep:
    """The sweep of one process. Its first sweep looks at every stale turn, however old
    (left by a crash before this process started); later ones at the turns that went stale
    since, so each is a few index probes, not a scan of every turn ever recorded, and every
    FULL_SWEEP_EVERY-th at those that went stale in the last DEEP_LOOKBACK.

    A turn goes stale at the expiry it recorded as it started, which a budget changed since
    does not move, so the sweep names a turn exactly when its conversation will record it
    (`_decide_recover` leaves a turn whose expiry is still ahead). Turns recorded before
    turns carried an expiry go stale by age under the budget in force, as in the
    conversation."""

    def __init__(self, settings: Settings, db: Database, runtime: ActorRuntime) -> None:
        self._settings = settings
        self._db = db
        self._runtime = runtime
        self._swept: SweepWindow | None = None
        self._since_full = 0  # complete sweeps of the recent window since a full one
        self._after: SweepKey | None = None  # where an unfinished sweep's last page ended
        self._pass: SweepWindow | None = None  # the window of its first page

    async def sweep(self, now: datetime | None = None) -> int:
        """Ask the conversations of up to MAX_CONVERSATIONS stale running turns to record
        them as abandoned; returns how many were asked. Returns once the commands are in
        the mailboxes: one queued behind a turn still running does not hold the sweep up."""
        now = now or datetime.now(UTC)
        first = self._swept is None
        deep = not first and self._since_full >= FULL_SWEEP_EVERY
        window = self._window(now, deep)
        stale = await stale_running_turns(
            self._db, window, limit=MAX_CONVERSATIONS, after=self._after
        )
        for turns in stale:
            await _recover(self._runtime, turns, now)
        begun = self._pass or window
        if len(stale) < MAX_CONVERSATIONS:
            # Done as of the pass's first page: turns that reached the read model behind the
            # key meanwhile are within the next sweep's window, which starts from there.
            self._swept, self._after, self._pass = begun, None, None
            self._since_full = 0 if first or deep else self._since_full + 1
        else:  # the next sweep goes on after this page
            self._after, self._pass = stale[-1].key, begun
        if stale:
            count = sum(len(t.turn_ids) for t in stale)
            log.info("%d turn(s) running past their expiry: asking their conversations", count)
        return len(stale)

    def _window(self, now: datetime, deep: bool) -> SweepWindow:
        """From where the last complete sweep ended, less OVERLAP (from DEEP_LOOKBACK ago when
        `deep`; from the beginning on the first sweep), up to `now` (expiries) and `now` less
        the lifetime in force (starts of turns without an expiry; none when calls have no
        time limit)."""
        age = stale_after(self._settings)
        started_until = None if age is None else now - age
        last = self._swept

        def since(previous: datetime | None, until: datetime) -> datetime | None:
            if last is None or previous is None:
                return None
            return until - DEEP_LOOKBACK if deep else previous - OVERLAP

        expired_from = since(None if last is None else last.expired[1], now)
        if started_until is None:
            return SweepWindow((expired_from, now), None)
        started = None if last is None or last.started is None else last.started[1]
        return SweepWindow((expired_from, now), (since(started, started_until), started_until))


async def _recover(runtime: ActorRuntime, turns: RunningTurns, now: datetime) -> None:
    # The same id from every gateway sweeping at once: the turns are recorded once.
    seed = f"{turns.conversation_id}/{','.join(turns.turn_ids)}"
    command = RecoverAbandonedTurns(
        command_id=service_command_id("sweep", hashlib.sha256(seed.encode()).hexdigest()),
        workspace_id=turns.workspace_id,
        turn_ids=turns.turn_ids,
        at=now,
    )
    try:
        await runtime.tell(conversation_key(turns.conversation_id), command)
    except SvcError as exc:
        log.warning(
            "could not record the abandoned turns of conversation %s (%s); next sweep retries",
            turns.conversation_id,
            exc.code,
        )
