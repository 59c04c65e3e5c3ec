"""The activation table: hosts many logical actors in one process (ARCHITECTURE decision 1).

Each active actor has a mailbox (a deque) and one worker task that runs its commands one at a
time, in arrival order. An actor is activated on its first command (latest snapshot, then the
later events), passivated when idle for `idle_s` or when the table holds `max_active` actors
and it is the least recently used one without work. The table is plain asyncio and
everything it hands out (replies, outcomes, stats) is a dataclass or pydantic record, so the
`ray` runtime can host the same table inside each of its host actors.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from actors.behaviour import ActorKey, Behaviour
from actors.context import DEFAULT_CONFLICT_RETRIES, Activation, Counters, ExecutionPolicy
from actors.errors import (
    CommandInterrupted,
    MailboxFull,
    RuntimeNotStarted,
    RuntimeStopping,
    UnknownActorKind,
)
from eventstore.port import EventStore
from eventstore.tasks import cancel_and_wait
from schemas.commands import Command
from schemas.errors import SvcError
from schemas.events import EVENTS, EventRegistry

log = logging.getLogger(__name__)

_DONE = object()

MAILBOX_LIMIT = 1000
"""Commands queued for one actor at most: each holds its request (and a streamed reply its
deltas), and a caller that gave up leaves its command queued."""

MAILBOX_CHARS = 64 * 1024 * 1024
"""Text (a chat turn's messages, `Command.held_chars`) one actor's mailbox may hold waiting
beyond its first command: 1,000 turns of 4 MiB each behind one long turn held 4 GB."""
TABLE_QUEUED_CHARS = 512 * 1024 * 1024
"""Text the commands in every mailbox of the table may hold together: the same flood spread
over many conversations is bounded as a whole."""

INTERRUPT_RECORD_S = 5.0
"""After the stop deadline: how long the cancelled commands get to record their failure (a
chat turn appends one `turn_failed`, a few milliseconds) before the table gives up on them."""


@dataclass(frozen=True, slots=True)
class StopSummary:
    """What one `ActivationTable.stop` did with the work it found."""

    finished: int
    """Commands that ended (answered or failed on their own) between the stop and its deadline."""
    interrupted: int
    """Commands still running at the deadline, cancelled (their callers get CommandInterrupted)."""
    refused: int
    """Commands queued behind others, failed with RuntimeStopping without running."""
    left_running: int = 0
    """Commands still running at the deadline in actor hosts the stopping process does not
    stop (a shared Ray cluster): they go on, and are recorded, there; their callers get
    AnswerAbandoned."""


class Reply:
    """The items one command's handler yields, consumed as an async iterator.

    The worker never waits for the consumer: items are buffered, so a slow or vanished client
    cannot stall the actor (a turn whose client disconnected is still recorded). `discard()`
    says nobody will read any more: later items are dropped and a failure is logged instead.
    """

    __slots__ = ("_discard", "_error", "_finished", "_items", "_waiter", "description")

    def __init__(self, description: str) -> None:
        self.description = description
        self._items: deque[Any] = deque()
        self._finished = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._discard = False

    @property
    def finished(self) -> bool:
        return self._finished

    def push(self, item: Any) -> None:
        if not self._discard:
            self._items.append(item)
            self._wake()

    def close(self) -> None:
        self._finished = True
        self._wake()

    def fail(self, error: BaseException) -> None:
        if self._finished:
            return
        self._error = error
        self._finished = True
        if self._discard:
            _log_failure(self.description, error)
        self._wake()

    def discard(self) -> None:
        self._discard = True
        self._items.clear()
        if self._error is not None:
            _log_failure(self.description, self._error)
            self._error = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def __aiter__(self) -> Reply:
        return self

    async def __anext__(self) -> Any:
        while True:
            if self._items:
                return self._items.popleft()
            if self._finished:
                if self._error is not None:
                    error, self._error = self._error, None
                    raise error
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    async def last(self) -> Any:
        """Drain the reply and return the last item (None when the handler yielded nothing)."""
        last: Any = None
        async for item in self:
            last = item
        return last


def _log_failure(description: str, error: BaseException) -> None:
    if isinstance(error, SvcError) and not error.internal:
        log.warning("%s failed: %s", description, error.message)
    else:
        # An internal failure (a TurnCrashed chains the defect's own traceback): its
        # traceback is the only account of it when no caller reads the reply.
        log.error("%s failed", description, exc_info=error)


@dataclass(slots=True)
class _Envelope:
    command: Command
    reply: Reply
    stream: bool
    chars: int


class _Slot:
    """Mailbox and worker of one active actor."""

    __slots__ = (
        "activation",
        "busy",
        "closing",
        "last_submit",
        "last_used",
        "mailbox",
        "queued_chars",
        "running",
        "task",
        "wake",
    )

    def __init__(self, activation: Activation[Any], now: float) -> None:
        self.activation = activation
        self.mailbox: deque[_Envelope] = deque()
        self.queued_chars = 0
        self.busy = False
        self.closing = False
        self.last_submit = now
        self.last_used = now
        self.wake: asyncio.Future[None] | None = None
        self.task: asyncio.Task[None] | None = None
        self.running: Reply | None = None
        """The reply of the command in progress."""

    @property
    def idle(self) -> bool:
        return not self.busy and not self.mailbox

    def notify(self) -> None:
        wake = self.wake
        if wake is not None and not wake.done():
            wake.set_result(None)


@dataclass(frozen=True, slots=True)
class TableStats:
    """A point-in-time copy of the table's gauges and counters (metrics, cluster status)."""

    active: int
    busy: int
    queued: int
    activations: int
    passivations: int
    passivations_idle: int
    passivations_lru: int
    commands_processed: int
    commands_failed: int
    events_appended: int
    events_replayed: int
    snapshots_loaded: int
    snapshots_ignored: int
    snapshots_saved: int
    conflicts_retried: int
    duplicates: int


class ActivationTable:
    """Hosts logical actors of the registered behaviours, looked up by `ActorKey.kind`.

    `store=None` makes a table without persistence, for behaviours that never call
    `ctx.execute` (the mailbox benchmark); `execute` then raises `StoreRequired`.
    """

    def __init__(
        self,
        store: EventStore | None,
        behaviours: Iterable[Behaviour[Any]],
        *,
        snapshot_every: int = 100,
        idle_s: float = 300.0,
        max_active: int = 10_000,
        conflict_retries: int = DEFAULT_CONFLICT_RETRIES,
        registry: EventRegistry = EVENTS,
        mailbox_limit: int = MAILBOX_LIMIT,
    ) -> None:
        if snapshot_every < 1 or max_active < 1 or idle_s <= 0 or conflict_retries < 0:
            raise ValueError(
                f"snapshot_every ({snapshot_every}) and max_active ({max_active}) must be at "
                f"least 1, idle_s ({idle_s}) above 0 and conflict_retries "
                f"({conflict_retries}) 0 or more"
            )
        if mailbox_limit < 1:
            raise ValueError("mailbox_limit must be positive")
        self._mailbox_limit = mailbox_limit
        self._queued_chars = 0  # every mailbox's, together
        self._store = store
        self._behaviours = {b.kind: b for b in behaviours}
        self._policy = ExecutionPolicy(snapshot_every, conflict_retries)
        self._idle_s = idle_s
        self._max_active = max_active
        self._registry = registry
        self._counters = Counters()
        self._active: OrderedDict[ActorKey, _Slot] = OrderedDict()
        self._closing: dict[asyncio.Task[None], _Slot] = {}
        """Workers of passivated actors still finishing, with their slots."""
        self._reaper: asyncio.Task[None] | None = None
        self._accepting = False
        self._stopped = False
        self._passivations_idle = 0
        self._passivations_lru = 0
        self._processed = 0
        self._failed = 0
        self._interrupted = 0

    @property
    def kinds(self) -> list[str]:
        return sorted(self._behaviours)

    # --- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        if self._accepting:
            return
        self._accepting = True
        self._stopped = False
        self._reaper = asyncio.create_task(self._reap_idle(), name="actor-table-reaper")

    async def stop(self, deadline_s: float = 10.0) -> StopSummary:
        """Refuse new commands, fail queued ones, let running ones finish until the deadline
        (then cancel them: their callers get CommandInterrupted), snapshot and passivate every
        active actor. Takes at most `deadline_s + INTERRUPT_RECORD_S`; returns what happened
        to the work in flight."""
        self._accepting = False
        self._stopped = True
        ended_before = self._processed + self._failed
        interrupted_before = self._interrupted
        reaper, self._reaper = self._reaper, None
        await cancel_and_wait(reaper)
        refused = 0
        for slot in list(self._active.values()):
            while slot.mailbox:
                self._take(slot).reply.fail(RuntimeStopping())
                refused += 1
        for key in list(self._active):
            self._passivate(key)
        await self._wait_closing(max(0.0, deadline_s))
        interrupted = self._interrupted - interrupted_before
        ended = self._processed + self._failed - ended_before
        summary = StopSummary(ended - interrupted, interrupted, refused)
        if interrupted or refused:
            log.warning(
                "actor table stopped: %d commands in flight finished within the %.0f s "
                "deadline, %d interrupted, %d queued refused",
                summary.finished,
                deadline_s,
                interrupted,
                refused,
            )
        return summary

    def _forget_closed(self, task: asyncio.Task[None]) -> None:
        self._closing.pop(task, None)

    async def _wait_closing(self, deadline_s: float) -> None:
        tasks = [t for t in self._closing if not t.done()]
        if not tasks:
            return
        _, running = await asyncio.wait(tasks, timeout=deadline_s)
        for task in running:
            task.cancel()
        if not running:
            return
        # A cancelled turn records its failure on the way out: give that one short append a
        # bounded grace period. A command still not done after it (its store stalled) is
        # given up on: its caller is told now rather than whenever the store answers.
        _, stuck = await asyncio.wait(running, timeout=INTERRUPT_RECORD_S)
        for task in stuck:
            slot = self._closing.get(task)
            reply = slot.running if slot is not None else None
            if reply is not None:
                self._interrupt(reply, slot.activation.interruption if slot else None)
            task.cancel()

    def _interrupt(self, reply: Reply, error: SvcError | None = None) -> None:
        """Fail `reply` with `error` (by default CommandInterrupted) and count it, once."""
        if reply.finished:
            return
        reply.fail(error or CommandInterrupted())
        self._failed += 1
        self._interrupted += 1

    # --- commands -----------------------------------------------------------------------

    def submit(self, key: ActorKey, command: Command, *, stream: bool = True) -> Reply:
        """Queue `command` in the actor's mailbox; the reply yields what its handler yields.
        `stream=False` says only the last item will be read (`Activation.streaming`)."""
        if not self._accepting:
            raise RuntimeStopping() if self._stopped else RuntimeNotStarted()
        chars = command.held_chars()
        if chars and self._queued_chars and self._queued_chars + chars > TABLE_QUEUED_CHARS:
            # Before any activation: a refusal must not cost a replay or an eviction.
            raise MailboxFull.of_text("this process")
        slot = self._active.get(key)
        now = time.monotonic()
        if slot is None:
            slot = self._activate(key, now)
        else:
            self._active.move_to_end(key)
            slot.last_submit = now
            if len(slot.mailbox) >= self._mailbox_limit:
                raise MailboxFull.of(key.kind, self._mailbox_limit)
            if chars and slot.mailbox and slot.queued_chars + chars > MAILBOX_CHARS:
                # An actor with nothing waiting always takes one: the budget bounds what waits.
                raise MailboxFull.of_text("this " + key.kind)
        reply = Reply(f"{type(command).__name__} to {key}")
        slot.mailbox.append(_Envelope(command, reply, stream, chars))
        slot.queued_chars += chars
        self._queued_chars += chars
        slot.notify()
        return reply

    def _take(self, slot: _Slot) -> _Envelope:
        """The next command of `slot`'s mailbox, out of the budgets' account."""
        envelope = slot.mailbox.popleft()
        slot.queued_chars -= envelope.chars
        self._queued_chars -= envelope.chars
        return envelope

    def _activate(self, key: ActorKey, now: float) -> _Slot:
        behaviour = self._behaviours.get(key.kind)
        if behaviour is None:
            raise UnknownActorKind.of(key.kind, self.kinds)
        if len(self._active) >= self._max_active:
            self._evict_lru(room_for=1)
        activation = Activation(
            key, behaviour, self._store, self._registry, self._policy, self._counters
        )
        slot = _Slot(activation, now)
        self._active[key] = slot
        slot.task = asyncio.create_task(self._work(key, slot), name=f"actor {key}")
        return slot

    async def _work(self, key: ActorKey, slot: _Slot) -> None:
        try:
            slot.busy = True
            # The command that activated the actor is already queued (submit queues it right
            # after activating, before this task first runs).
            if slot.mailbox and slot.mailbox[0].command.new_stream:
                slot.activation.start_empty()
            else:
                await slot.activation.load()
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # this worker is being stopped
            # One the load met in something it awaited: as in `_run`, ending the worker
            # with the slot registered would leave its mailbox waiting for good.
            cut = SvcError(f"{key} could not be loaded: a cancelled operation cut it short")
            self._drop_unloaded(key, slot, cut)
            return
        except Exception as exc:
            self._drop_unloaded(key, slot, exc)
            return
        finally:
            slot.busy = False
        while True:
            if not slot.mailbox:
                if slot.closing:
                    break
                slot.wake = asyncio.get_running_loop().create_future()
                try:
                    await slot.wake
                finally:
                    slot.wake = None
                continue
            slot.busy = True
            try:
                # No local for the envelope: an idle actor waits in this frame, which would
                # otherwise keep its last command and reply (the answer) alive meanwhile.
                await self._run(slot, self._take(slot))
            finally:
                slot.busy = False
                slot.last_used = time.monotonic()
        try:
            await slot.activation.save_snapshot()
        except Exception:
            log.exception("snapshot of %s on passivation failed", key)

    def _drop_unloaded(self, key: ActorKey, slot: _Slot, exc: BaseException) -> None:
        """An actor that cannot load takes no commands; the next submit activates afresh."""
        if self._active.get(key) is slot:
            del self._active[key]
        while slot.mailbox:
            self._take(slot).reply.fail(exc)

    async def _run(self, slot: _Slot, envelope: _Envelope) -> None:
        reply = slot.running = envelope.reply
        try:
            activation = slot.activation
            activation.streaming = envelope.stream
            activation.interruption = None
            async for item in activation.behaviour.handle(activation, envelope.command):
                reply.push(item)
        except asyncio.CancelledError as exc:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                # This worker is being stopped (shutdown, eviction).
                self._interrupt(reply, slot.activation.interruption)
                raise
            # A CancelledError the handler met in something it awaited (a future another
            # task cancelled) is that command's failure: ending the worker here would leave
            # the actor registered with no one to run its mailbox, every later command
            # waiting for good.
            log.error(
                "command of %s failed on a cancelled operation", slot.activation.key, exc_info=exc
            )
            self._settle(
                reply,
                SvcError(
                    f"a command of {slot.activation.key} was cut short by a cancelled operation"
                ),
            )
        except Exception as exc:
            self._settle(reply, exc)
        else:
            self._settle(reply, None)
        finally:
            slot.running = None

    def _settle(self, reply: Reply, error: BaseException | None) -> None:
        """End `reply` as the command ended, and count the command: once. One given up on at
        a stop (`_interrupt`) was answered and counted failed then, whatever it does after."""
        if reply.finished:
            return
        if error is None:
            reply.close()
            self._processed += 1
        else:
            reply.fail(error)
            self._failed += 1

    # --- passivation --------------------------------------------------------------------

    async def passivate(
        self, keys: Iterable[ActorKey], *, timeout_s: float = 10.0
    ) -> list[ActorKey]:
        """Snapshot and passivate those of `keys` that are active and idle, and wait (up to
        `timeout_s`) until they are gone; returns them. An actor with work is left alone:
        call again once it is idle (a shard handing its actors to another host does)."""
        done: list[ActorKey] = []
        tasks: list[asyncio.Task[None]] = []
        for key in keys:
            slot = self._active.get(key)
            if slot is None or not slot.idle:
                continue
            self._passivate(key)
            done.append(key)
            if slot.task is not None and not slot.task.done():
                tasks.append(slot.task)
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)
        return done

    def _passivate(self, key: ActorKey) -> None:
        slot = self._active.pop(key)
        slot.closing = True
        slot.notify()
        if slot.task is not None and not slot.task.done():
            self._closing[slot.task] = slot
            slot.task.add_done_callback(self._forget_closed)

    def _evict_lru(self, room_for: int = 0) -> None:
        """Passivate idle actors, least recently used first, until `room_for` more fit under
        the cap. Never one with a command queued or in progress: while too many are busy the
        table runs over its cap, and the next activation or reaper pass brings it back."""
        excess = len(self._active) + room_for - self._max_active
        if excess <= 0:
            return
        # The table is in least-recently-submitted order, so the idle actors to evict come
        # first and the scan stops after `excess` of them (plus any busy ones ahead): at the
        # cap every new actor evicts one, and a walk of the whole table (10,000 slots by
        # default) per activation cost several times the rest of a chat turn.
        idle_first = (key for key, slot in self._active.items() if slot.idle)
        idle = list(itertools.islice(idle_first, excess))
        for key in idle:
            self._passivate(key)
        self._passivations_lru += len(idle)
        if len(idle) < excess and room_for:  # said once per activation, not per reaper pass
            log.warning("actor table over its cap of %d: every actor is busy", self._max_active)

    async def _reap_idle(self) -> None:
        interval = max(0.01, min(self._idle_s / 4, 5.0))
        while True:
            await asyncio.sleep(interval)
            self.passivate_idle()
            self._evict_lru()  # back under the cap once a burst of busy actors is over

    def passivate_idle(self) -> int:
        """Passivate actors idle for `idle_s`; returns how many (the reaper calls this)."""
        cutoff = time.monotonic() - self._idle_s
        expired: list[ActorKey] = []
        # The dict is in submit order, so the scan stops at the first actor that received a
        # command after the cutoff: it and every later one are not idle long enough.
        for key, slot in self._active.items():
            if slot.last_submit >= cutoff:
                break
            if slot.idle and slot.last_used < cutoff:
                expired.append(key)
        for key in expired:
            self._passivate(key)
        self._passivations_idle += len(expired)
        return len(expired)

    # --- introspection ------------------------------------------------------------------

    def stats(self) -> TableStats:
        c = self._counters
        return TableStats(
            active=len(self._active),
            busy=sum(1 for s in self._active.values() if s.busy),
            queued=sum(len(s.mailbox) for s in self._active.values()),
            activations=c.activations,
            passivations=self._passivations_idle + self._passivations_lru,
            passivations_idle=self._passivations_idle,
            passivations_lru=self._passivations_lru,
            commands_processed=self._processed,
            commands_failed=self._failed,
            events_appended=c.events_appended,
            events_replayed=c.events_replayed,
            snapshots_loaded=c.snapshots_loaded,
            snapshots_ignored=c.snapshots_ignored,
            snapshots_saved=c.snapshots_saved,
            conflicts_retried=c.conflicts_retried,
            duplicates=c.duplicates,
        )

    def is_active(self, key: ActorKey) -> bool:
        return key in self._active
