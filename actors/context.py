"""One activation of a logical actor: its state, its stream version and `execute`.

An `Activation` is the `ActorContext` a behaviour's handler receives. It owns the only copy of
the actor's state in this process; the table guarantees one command at a time per activation,
so nothing here needs a lock. Across processes the event store is the fence (ARCHITECTURE
decision 2): every append names the version this state was built from, and a stale writer
gets `ConcurrencyConflict` instead of forking the stream.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

from pydantic import BaseModel, ValidationError

from actors.behaviour import ActorKey, Behaviour, CommandOutcome
from actors.errors import ConflictRetriesExhausted, StoreRequired
from eventstore.errors import ConcurrencyConflict, StoreError
from eventstore.port import EventStore
from eventstore.records import AppendResult, NewEvent, RecordedEvent, Snapshot
from schemas.commands import Command
from schemas.errors import Conflict, SvcError
from schemas.events import Event, EventRegistry

log = logging.getLogger(__name__)

S = TypeVar("S", bound=BaseModel)


@dataclass(slots=True)
class Counters:
    """Monotonic counters shared by every activation of one table (read by `stats()`)."""

    activations: int = 0
    events_replayed: int = 0
    events_appended: int = 0
    snapshots_loaded: int = 0
    snapshots_ignored: int = 0
    snapshots_saved: int = 0
    conflicts_retried: int = 0
    duplicates: int = 0


DEFAULT_CONFLICT_RETRIES = 16
REPLAY_PAGE = 100
"""Events read per round trip when an activation replays its stream: a conversation of a
thousand turns of large messages, replayed in full (no snapshot, or one of an older state
schema), held all of them at once; now about this many events' data at a time."""


@dataclass(frozen=True, slots=True)
class ExecutionPolicy:
    """`conflict_retries`: how many times a stale activation catches up and decides again
    before the caller gets 409. Two processes writing one stream (two gateways taking turns
    of one conversation) each catch up and try again in lockstep; waiting a random time of
    up to `conflict_backoff_s` * 2^(n-2) (at most `CONFLICT_BACKOFF_CAP_S`) before the n-th
    retry (the first goes at once) breaks that step. bench/actor_contention.py, 40 turns
    from each of two processes at once: 135 of 800 given up with 3 immediate retries, 4 with
    8 of these, none with 16; see docs/performance.md."""

    snapshot_every: int = 100
    conflict_retries: int = DEFAULT_CONFLICT_RETRIES
    conflict_backoff_s: float = 0.002


CONFLICT_BACKOFF_CAP_S = 0.1


def snapshot_state(behaviour: Behaviour[S], snapshot: Snapshot) -> S | None:
    """The state `snapshot` holds, when it can stand for the fold up to its version: of the
    behaviour's state schema, and valid. A snapshot of an older schema is ignored, never
    migrated: the log is the truth and a full replay rebuilds the new shape from it."""
    if snapshot.schema_version != behaviour.state_schema_version:
        return None
    try:
        state = behaviour.state_type.model_validate(snapshot.state)
    except ValidationError:
        log.warning("snapshot of %s does not validate; replaying in full", snapshot.stream_id)
        return None
    return cast(S, state)


def conflict_backoff(policy: ExecutionPolicy, conflicts: int) -> float:
    """The random wait before catching up after the `conflicts`-th conflict in a row (full
    jitter: any value from zero to the exponential bound; none after the first)."""
    if conflicts < 2:
        return 0.0  # a single conflict is the common case: retry at once
    bound = min(CONFLICT_BACKOFF_CAP_S, policy.conflict_backoff_s * 2 ** (conflicts - 2))
    return random.uniform(0.0, bound)


class Activation(Generic[S]):
    """The live state of one logical actor (implements `ActorContext`)."""

    __slots__ = (
        "_behaviour",
        "_counters",
        "_key",
        "_policy",
        "_registry",
        "_state",
        "_store",
        "_version",
        "interruption",
        "snapshot_version",
        "streaming",
    )

    def __init__(
        self,
        key: ActorKey,
        behaviour: Behaviour[S],
        store: EventStore | None,
        registry: EventRegistry,
        policy: ExecutionPolicy,
        counters: Counters,
    ) -> None:
        self._key = key
        self._behaviour = behaviour
        self._store = store
        self._registry = registry
        self._policy = policy
        self._counters = counters
        self._state: S = behaviour.initial_state(key)
        self._version = 0
        self.snapshot_version = 0
        # Whether the command running now has a reader for its intermediate items (a
        # `stream`), or only for its last one (an `ask`, a `tell`); the table sets it per
        # command. A handler may skip work that only intermediate items need.
        self.streaming = True
        # What the caller of the running command is told should the runtime's stop cut it
        # short now (None: CommandInterrupted's own message); the table clears it per command.
        self.interruption: SvcError | None = None

    @property
    def key(self) -> ActorKey:
        return self._key

    @property
    def behaviour(self) -> Behaviour[S]:
        return self._behaviour

    @property
    def state(self) -> S:
        return self._state

    @property
    def version(self) -> int:
        return self._version

    @property
    def unsnapshotted(self) -> int:
        return self._version - self.snapshot_version

    # --- activation ---------------------------------------------------------------------

    def start_empty(self) -> None:
        """The state before any event, without reading the store (see `Command.new_stream`)."""
        self._counters.activations += 1
        self._state = self._behaviour.initial_state(self._key)
        self._version = 0
        self.snapshot_version = 0

    async def load(self) -> None:
        """Latest usable snapshot, then replay of every later event."""
        self.start_empty()
        if self._store is None:
            return
        snapshot = await self._store.load_snapshot(self._key.stream_id)
        if snapshot is not None:
            self._restore(snapshot)
        await self._catch_up()

    def _restore(self, snapshot: Snapshot) -> None:
        state = snapshot_state(self._behaviour, snapshot)
        if state is None:
            self._counters.snapshots_ignored += 1
            return
        self._state = state
        self._version = self.snapshot_version = snapshot.version
        self._counters.snapshots_loaded += 1

    async def refresh(self) -> bool:
        self._require_store()
        return await self._catch_up()

    async def _catch_up(self) -> bool:
        """Apply the events other writers appended since this state; True when there were.
        Versions are dense and immutable, so the state at version v plus the events after v
        equals a fresh load: catching up is the cheap form of "drop state and reload"."""
        assert self._store is not None
        caught_up = False
        while True:
            first = self._version + 1
            page = await self._store.read_stream(
                self._key.stream_id, first, to_version=first + REPLAY_PAGE - 1
            )
            state = self._state
            for rec in page:
                state = self._behaviour.evolve(state, self._decode(rec))
            if page:
                self._state, self._version = state, page[-1].version
                caught_up = True
            self._counters.events_replayed += len(page)
            if len(page) < REPLAY_PAGE:  # versions are dense: a short page is the head
                return caught_up

    def _decode(self, rec: RecordedEvent) -> Event:
        return self._registry.decode(rec.type, rec.schema_version, rec.data)

    # --- commands -----------------------------------------------------------------------

    async def execute(self, command: Command) -> CommandOutcome:
        """decide -> append(expected version, command id) -> evolve, retrying conflicts."""
        store = self._require_store()
        conflicts = 0
        while True:
            try:
                events = await self._decide(command)
            except SvcError:
                # Refused on a state its own first run may have made (a retried "create"
                # finds the name it created taken): a command id the ledger holds is a
                # retry, answered with the first run's events, not with the refusal.
                first = await self._first_run(command)
                if first is None:
                    raise
                return await self._duplicate(command, first)
            if not events:
                # Nothing to do on this state, which a first run of this command id may have
                # made (a retried rename finds the title set): a retry gets that run's result.
                first = await self._first_run(command)
                if first is not None:
                    return await self._duplicate(command, first)
                return CommandOutcome(self._key, (), self._version, self._version, "")
            try:
                result = await store.append(
                    self._key.stream_id,
                    [self._encode(e, command) for e in events],
                    expected_version=self._version,
                    command_id=command.command_id,
                    workspace_id=command.workspace_id,
                )
            except ConcurrencyConflict:
                conflicts += 1
                self._counters.conflicts_retried += 1
                giving_up = conflicts > self._policy.conflict_retries
                if not giving_up:
                    # Waited before catching up, not after: the other writer goes on
                    # appending meanwhile, and a state read before the wait would be stale
                    # again when the append comes.
                    await asyncio.sleep(conflict_backoff(self._policy, conflicts))
                await self._catch_up()  # the actor stays usable even when this one gives up
                if giving_up:
                    raise ConflictRetriesExhausted(
                        f"{self._key} could not record {type(command).__name__}: other writers "
                        f"moved the stream {conflicts} times in a row; retry the request"
                    ) from None
                continue
            if result.duplicate:
                return await self._duplicate(command, result)
            self._apply(events, result.last_version)
            await self._maybe_snapshot()
            return CommandOutcome(
                self._key, events, result.first_version, result.last_version, result.cursor
            )

    async def _decide(self, command: Command) -> tuple[Event, ...]:
        """The command's events on the current state. A refusal or a no-op might be wrong only
        because another process (a second gateway, the CLI) appended since this state was
        read, and neither meets the version fence that catches a stale write: before either
        stands, the stream is read once more and, when it had moved, the command decided
        again. When that read fails (the store is down), the decision stands as made."""
        try:
            events = tuple(self._behaviour.decide(self._state, command))
        except SvcError:
            if not await self._moved_since_read():
                raise
            return tuple(self._behaviour.decide(self._state, command))
        if not events and await self._moved_since_read():
            return tuple(self._behaviour.decide(self._state, command))
        return events

    async def _first_run(self, command: Command) -> AppendResult | None:
        """The append this command id made before, if the ledger can say (None when it
        cannot: the refusal then stands, as it would without the ledger)."""
        try:
            return await self._require_store().processed(command.command_id, command.workspace_id)
        except StoreError:
            return None

    async def recorded(self, command_id: str, workspace_id: str) -> tuple[Event, ...]:
        if self._store is None:
            return ()
        result = await self._store.processed(command_id, workspace_id)
        if result is None or result.stream_id != self._key.stream_id:
            return ()
        return tuple(self._decode(r) for r in await self._appended_by(result))

    async def _appended_by(self, result: AppendResult) -> list[RecordedEvent]:
        """The events of this stream that the append `result` names."""
        return await self._require_store().read_stream(
            self._key.stream_id, result.first_version, to_version=result.last_version
        )

    async def _moved_since_read(self) -> bool:
        try:
            return await self._catch_up()
        except StoreError:
            return False

    async def earlier_run(self, command: Command) -> CommandOutcome | None:
        """What `command`'s id did when it ran before, by the store's ledger (None if it
        never ran); Conflict `idempotency_key_reused` when it ran for another request. For a
        handler that must refuse a command (its model no longer served) unless it is a retry
        of one that ran."""
        if self._store is None:
            return None
        result = await self._store.processed(command.command_id, command.workspace_id)
        return None if result is None else await self._duplicate(command, result)

    async def _duplicate(self, command: Command, result: AppendResult) -> CommandOutcome:
        # The processed-commands ledger said this command id already ran: nothing was written.
        # The first run's events are in the store; catch up so the state includes them, and
        # hand back exactly those events.
        self._counters.duplicates += 1
        # The messages name no command id: one made from an Idempotency-Key carries a digest
        # of its owner, the service's business, and the client knows its own key.
        if result.stream_id != self._key.stream_id:
            raise Conflict(
                "this Idempotency-Key was already used for a request to "
                f"{named(result.stream_id)}; send a new Idempotency-Key for a different request",
                code="idempotency_key_reused",
            )
        await self._catch_up()
        first_run = await self._appended_by(result)
        if first_run and not _same_request(command, first_run[0]):
            # Told in the request's terms: the command's class name is the service's own.
            same_kind = first_run[0].metadata.get("command_type") == type(command).__name__
            other = "with another body" if same_kind else "of another kind"
            raise Conflict(
                f"this Idempotency-Key was already used for a request {other} to "
                f"{named(self._key.stream_id)}; send a new Idempotency-Key for a different "
                "request",
                code="idempotency_key_reused",
            )
        events = tuple(self._decode(r) for r in first_run)
        return CommandOutcome(
            self._key, events, result.first_version, result.last_version, result.cursor, True
        )

    def _apply(self, events: Sequence[Event], last_version: int) -> None:
        state = self._state
        for e in events:
            state = self._behaviour.evolve(state, e)
        self._state = state
        self._version = last_version
        self._counters.events_appended += len(events)

    def _encode(self, event: Event, command: Command) -> NewEvent:
        type_name, schema_version, data = self._registry.encode(event)
        metadata: dict[str, Any] = {
            "command_type": type(command).__name__,
            "command_id": command.command_id,
            "actor": self._key.stream_id,
        }
        digest = command.request_digest()
        if digest is not None:
            metadata["request_digest"] = digest
        return NewEvent(type_name, data, schema_version, metadata)

    # --- snapshots ----------------------------------------------------------------------

    async def _maybe_snapshot(self) -> None:
        if self.unsnapshotted >= self._policy.snapshot_every:
            await self.save_snapshot()

    async def save_snapshot(self) -> None:
        """Best effort: a failed snapshot costs a longer replay later, never a command."""
        if self._store is None or self.unsnapshotted <= 0:
            return
        snapshot = Snapshot(
            stream_id=self._key.stream_id,
            version=self._version,
            schema_version=self._behaviour.state_schema_version,
            state=self._state.model_dump(mode="json"),
        )
        try:
            await self._store.save_snapshot(snapshot)
        except SvcError as exc:
            log.warning("snapshot of %s at version %d failed: %s", self._key, self._version, exc)
            return
        self.snapshot_version = self._version
        self._counters.snapshots_saved += 1

    def _require_store(self) -> EventStore:
        if self._store is None:
            raise StoreRequired.of(self._key.stream_id)
        return self._store


def named(stream_id: str) -> str:
    """A stream as a person names it: `conversation:c-1` is conversation c-1."""
    kind, _, key = stream_id.partition(":")
    return f"{kind} {key}" if key else stream_id


def _same_request(command: Command, first_event: RecordedEvent) -> bool:
    """Whether the first run of this command id (its first event) was this request: the
    same command type, on the same target (Command.target_fields). The metadata says so
    (`request_digest`); an event recorded before it did is judged by the target fields its
    own data holds (an `ApiKeyRevoked` names its `key_id`)."""
    recorded_type = first_event.metadata.get("command_type")
    if recorded_type is not None and recorded_type != type(command).__name__:
        return False
    recorded_digest = first_event.metadata.get("request_digest")
    if recorded_digest is not None:
        return bool(recorded_digest == command.request_digest())
    target = command.model_dump(mode="json", include=set(command.target_fields))
    data = first_event.data
    # A target field left None asked for no change (an agent update's absent fields): the
    # event, which holds the whole result, says nothing against it.
    return all(
        data[name] == value for name, value in target.items() if name in data and value is not None
    )
