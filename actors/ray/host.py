"""An actor host: one detached async Ray actor wrapping an `ActivationTable`.

The host builds everything inside its own process (store connection from the DSN, behaviours
from a factory), so a host that Ray restarts after a crash comes back by itself: it reloads
the shards it owns from the shard map and reactivates actors lazily from snapshot + events.

Every command arrives with the (shard, epoch) the router routed it by. The host runs it only
if it holds exactly that shard at exactly that epoch and is not handing the shard over; else
it answers `WrongEpoch` and runs nothing (see actors/shards.py for why).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeAlias, runtime_checkable

import ray

from actors.behaviour import ActorKey, Behaviour
from actors.ray.wire import Failure, HostStatus, Ok, WrongEpoch, pack_error
from actors.shards import load_assignment
from actors.table import ActivationTable, Reply, TableStats
from eventstore.db import Database
from eventstore.errors import StoreError
from eventstore.notify import CommitNotifier
from eventstore.store import PostgresEventStore
from eventstore.tasks import wait_set
from schemas.commands import Command

log = logging.getLogger(__name__)

IN_FLIGHT_LOAD = 1_000_000.0
"""A command in progress weighs this in a shard's load, more than all its active actors
can (a host's table holds far fewer): a load of this or more is a shard with a command in
progress, and busy shards sort after every idle one, however many actors these hold."""

_PRUNE_MIN = 1024  # keys a shard's set may hold before its first pruning

BehaviourFactory: TypeAlias = Callable[[], Sequence[Behaviour[Any]]]
BehaviourSource: TypeAlias = "str | BehaviourFactory"
"""A picklable zero-argument callable returning the behaviours, or its import path
("package.module:function"); called once in each host process."""

Answer: TypeAlias = Ok | Failure | WrongEpoch


@dataclass(frozen=True, slots=True)
class HostSpec:
    cluster: str
    name: str
    dsn: str = field(repr=False)  # may hold the database password
    behaviours: BehaviourSource
    table_options: dict[str, Any] = field(default_factory=dict)
    batch_items: int = 10
    batch_s: float = 0.05
    store_pool_size: int = 10


@runtime_checkable
class Reconfigurable(Protocol):
    """A behaviour factory whose settings can change while the behaviours it built run (the
    model settings: gateway/bootstrap.py `HostBehaviours`). The router sends the current
    settings to each host (`ActorHost.configure`): a host is created, and restarted by Ray,
    with the settings of the process that created it."""

    def reconfigure(self, config: Any) -> None: ...


def resolve_factory(source: BehaviourSource) -> BehaviourFactory:
    if isinstance(source, str):
        module_name, _, attr = source.partition(":")
        factory: BehaviourFactory = getattr(importlib.import_module(module_name), attr)
        return factory
    return source


REOPEN_READ_PAUSES_S = (0.2, 0.5, 1.0, 2.0)
"""The pauses between the reads of the assignment a reopen tries before it gives up and
leaves its shards held: a database blip must not keep them refused for a whole hold."""
RELEASE_HOLD_GRACE_S = 60.0
"""How long past its deadline a release keeps refusing its shards' commands with nothing
more heard: the mover follows a release at once with `forget` (moved) or `reopen` (not);
one cancelled in between (a gateway stopping, an interrupted `svc cluster scale`) must not
leave the shards refused for good."""


class _Releasing:
    """The shards a release holds, each until its expiry (monotonic seconds)."""

    __slots__ = ("_until",)

    def __init__(self) -> None:
        self._until: dict[int, float] = {}

    def hold(self, shards: Iterable[int], for_s: float) -> None:
        until = time.monotonic() + for_s
        for shard in shards:
            self._until[shard] = until

    def let_go(self, shards: Iterable[int]) -> None:
        for shard in shards:
            self._until.pop(shard, None)

    def discard(self, shard: int) -> None:
        self._until.pop(shard, None)

    def __contains__(self, shard: object) -> bool:
        if not isinstance(shard, int):
            return False
        until = self._until.get(shard)
        if until is None:
            return False
        if time.monotonic() < until:
            return True
        del self._until[shard]  # expired: the shards' commands are taken again
        return False


class ActorHost:
    """The Ray actor class (made remote by the router with its resource options)."""

    def __init__(self, spec: HostSpec) -> None:
        self._spec = spec
        self._factory = resolve_factory(spec.behaviours)
        self._table: ActivationTable | None = None
        self._store: PostgresEventStore | None = None
        self._starting: asyncio.Task[ActivationTable] | None = None
        self._owned: dict[int, int] = {}
        self._releasing = _Releasing()
        self._gone: dict[int, int] = {}
        self._reload: asyncio.Task[None] | None = None
        self._reloaded_at = 0.0
        self._in_flight: dict[int, int] = {}
        # Per shard, the keys submitted here that may still be active (release passivates
        # them); pruned to the active ones whenever a shard's set doubles (`_track`).
        self._keys: dict[int, set[ActorKey]] = {}
        self._prune_at: dict[int, int] = {}
        self._background: set[asyncio.Task[Any]] = set()
        self._finished = 0
        self._rate_mark = (time.monotonic(), 0)
        self._node = ""
        self._refresher: asyncio.Task[None] | None = None
        self._progress = asyncio.Event()

    # --- lifecycle ----------------------------------------------------------------------

    async def _ensure(self) -> ActivationTable:
        if self._table is not None:
            return self._table
        if self._starting is None or (self._starting.done() and self._starting.exception()):
            self._starting = asyncio.create_task(self._start())
        # Every early call waits on the same task and resumes in arrival order.
        return await asyncio.shield(self._starting)

    async def _start(self) -> ActivationTable:
        """Open the store and the table. A start that fails closes what it opened: the next
        command starts again, and each failed start would otherwise keep its connections
        until the database had none left to give."""
        spec = self._spec
        db = await Database.connect(spec.dsn, min_size=1, max_size=spec.store_pool_size)
        notifier = CommitNotifier(db)
        store = PostgresEventStore(
            db, on_commit=notifier.committed, on_close=(notifier.stop, db.close)
        )
        table: ActivationTable | None = None
        try:
            await notifier.start()
            table = ActivationTable(store, list(self._factory()), **spec.table_options)
            await table.start()
            self._owned = await load_assignment(db, spec.cluster, spec.name)
            self._node = ray.get_runtime_context().get_node_id()
        except BaseException:
            if table is not None:
                await table.stop(0.0)
            await store.close()
            raise
        self._store, self._table = store, table
        self._refresher = asyncio.create_task(self._refresh_assignment())
        return table

    async def _refresh_assignment(self) -> None:
        # The shard map is the truth; pushes (`adopt`, `forget`) only make a host learn a move
        # sooner. Reading it now and then also ends a stale ownership left by a move whose
        # `forget` never reached this host (it was restarting).
        while True:
            await asyncio.sleep(2.0)
            try:
                await self._reload_assignment()
            except Exception as exc:
                log.warning("%s could not read its shard assignment: %s", self._spec.name, exc)

    async def ready(self) -> HostStatus:
        await self._ensure()
        return self.status()

    def ping(self) -> int:
        return os.getpid()

    async def configure(self, config: Any) -> bool:
        """Hand `config` to the behaviour factory (see `Reconfigurable`); False when it takes
        none. The behaviours it built follow from their next call."""
        if not isinstance(self._factory, Reconfigurable):
            return False
        self._factory.reconfigure(config)
        return True

    async def stop(self, deadline_s: float) -> None:
        """Stop the table: running commands finish (to the deadline), queued ones fail with
        RuntimeStopping, every active actor is snapshotted and passivated."""
        table = await self._ensure()
        if self._refresher is not None:
            self._refresher.cancel()
        await table.stop(deadline_s)
        if self._background:
            await asyncio.wait(list(self._background), timeout=deadline_s)
        if self._store is not None:
            await self._store.close()

    # --- admission ----------------------------------------------------------------------

    async def _admit(self, shard: int, epoch: int) -> WrongEpoch | None:
        if shard not in self._releasing and self._owned.get(shard) == epoch:
            return None
        held = self._owned.get(shard)
        if shard not in self._releasing and (held is None or epoch > held):
            # The router saw a newer map than this host (a move just committed, or this host
            # restarted): read our assignment again before refusing.
            await self._reload_assignment()
            held = self._owned.get(shard)
            if shard not in self._releasing and held == epoch:
                return None
        return WrongEpoch(shard, epoch, held)

    async def _reload_assignment(self) -> None:
        if self._reload is None or self._reload.done():
            if time.monotonic() - self._reloaded_at < 0.02 and self._reload is not None:
                return
            self._reload = asyncio.create_task(self._load_assignment())
        await asyncio.shield(self._reload)

    async def _fresh_assignment(self) -> None:
        """A read of the assignment that starts now. `_reload_assignment` may join a read
        already under way, or skip one just done, either of which can predate a move the
        caller must see; reads under way are waited out first, so that none of them,
        finishing after this one, puts its older map back."""
        while self._reload is not None and not self._reload.done():
            with contextlib.suppress(Exception):
                await asyncio.shield(self._reload)
        self._reload = asyncio.create_task(self._load_assignment())
        await asyncio.shield(self._reload)

    async def _load_assignment(self) -> None:
        assert self._store is not None
        owned = await load_assignment(self._store.db, self._spec.cluster, self._spec.name)
        self._reloaded_at = time.monotonic()
        # A read that started before a move committed may still show a shard this host has
        # since handed over (`forget`): never take back an epoch older than the hand-over.
        self._owned = {s: e for s, e in owned.items() if e >= self._gone.get(s, 0)}

    def _submit(
        self,
        table: ActivationTable,
        shard: int,
        key: ActorKey,
        cmd: Command,
        *,
        stream: bool = False,
    ) -> Reply:
        """`stream=False` (ask, tell): only the last item is read (`Activation.streaming`)."""
        reply = table.submit(key, cmd, stream=stream)
        self._in_flight[shard] = self._in_flight.get(shard, 0) + 1
        self._track(table, shard, key)
        return reply

    def _track(self, table: ActivationTable, shard: int, key: ActorKey) -> None:
        """Remember `key` under `shard`. The actors passivated since (idle, LRU) are dropped
        when the set has doubled since it was last pruned: amortised O(1) per command, and
        at most about twice the shard's active actors kept, however many ever came by."""
        keys = self._keys.setdefault(shard, set())
        keys.add(key)
        if len(keys) > self._prune_at.get(shard, _PRUNE_MIN):
            keys = self._keys[shard] = {k for k in keys if table.is_active(k)}
            self._prune_at[shard] = max(_PRUNE_MIN, 2 * len(keys))

    def _done(self, shard: int) -> None:
        self._in_flight[shard] -= 1
        self._finished += 1
        self._progress.set()

    # --- commands -----------------------------------------------------------------------

    async def ask(self, shard: int, epoch: int, key: ActorKey, command: Command) -> Answer:
        try:
            table = await self._ensure()
            refused = await self._admit(shard, epoch)
            if refused is not None:
                return refused
            reply = self._submit(table, shard, key, command)
        except Exception as exc:
            return pack_error(exc)
        try:
            return Ok(await reply.last())
        except Exception as exc:
            return pack_error(exc)
        finally:
            self._done(shard)

    async def tell(self, shard: int, epoch: int, key: ActorKey, command: Command) -> Answer:
        """Answers once the command is in the actor's mailbox; it then runs on its own."""
        try:
            table = await self._ensure()
            refused = await self._admit(shard, epoch)
            if refused is not None:
                return refused
            reply = self._submit(table, shard, key, command)
        except Exception as exc:
            return pack_error(exc)
        reply.discard()  # failures are logged by the reply
        self._spawn(self._drain(shard, reply))
        return Ok(None)

    @ray.method(num_returns="streaming")
    async def stream(
        self, shard: int, epoch: int, key: ActorKey, command: Command
    ) -> AsyncIterator[list[Any] | Failure | WrongEpoch]:
        """Yields batches of items (decision 5: one Ray yield costs about 0.5 ms, so deltas
        travel in lists of up to `batch_items` or `batch_s`), then a `Failure` if the handler
        failed. The first item goes alone, so time to first token is not delayed."""
        try:
            table = await self._ensure()
            refused = await self._admit(shard, epoch)
            if refused is None:
                reply = self._submit(table, shard, key, command, stream=True)
        except Exception as exc:
            yield pack_error(exc)
            return
        if refused is not None:
            yield refused
            return
        finished = False
        try:
            async for batch in _batches(reply, self._spec.batch_items, self._spec.batch_s):
                yield batch
            finished = True
        except Exception as exc:
            finished = True
            yield pack_error(exc)
        finally:
            if finished:
                self._done(shard)
            else:
                # The router stopped reading: the command still runs to its end.
                reply.discard()
                self._spawn(self._drain(shard, reply))

    async def _drain(self, shard: int, reply: Reply) -> None:
        try:
            await reply.last()
        except BaseException:
            pass  # logged by the discarded reply
        finally:
            self._done(shard)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # --- shard hand-over ----------------------------------------------------------------

    async def release(self, shards: list[int], deadline_s: float) -> list[int]:
        """Stop accepting `shards`, wait (to the deadline) for their commands in progress,
        then snapshot and passivate their actors. Returns the shards whose commands still
        run at the deadline (none normally): they stay held, and their working actors stay
        listed, for a later release to wait on or a `reopen` to give back."""
        table = await self._ensure()
        self._releasing.hold(shards, deadline_s + RELEASE_HOLD_GRACE_S)
        loop = asyncio.get_running_loop()
        end = loop.time() + deadline_s
        while self._busy(shards) and (remaining := end - loop.time()) > 0:
            self._progress.clear()
            await wait_set(self._progress, remaining)
        keys = {s: self._keys.pop(s, set()) for s in shards}
        gone = set(await table.passivate([k for held in keys.values() for k in held]))
        # An actor still at work is not passivated: kept under its shard, so that the next
        # release (the move is retried while any command runs) passivates it then.
        for shard, held in keys.items():
            working = {k for k in held - gone if table.is_active(k)}
            if working:
                self._keys.setdefault(shard, set()).update(working)
        return [shard for shard in shards if self._in_flight.get(shard, 0)]

    def _busy(self, shards: Iterable[int]) -> int:
        return sum(self._in_flight.get(s, 0) for s in shards)

    def adopt(self, assignment: dict[int, int]) -> None:
        for shard, epoch in assignment.items():
            if epoch >= self._owned.get(shard, 0):
                self._owned[shard] = epoch
                self._releasing.discard(shard)

    def forget(self, shards: list[int], epochs: dict[int, int]) -> None:
        """Drop shards that moved away (`epochs`: their new epochs, so an older owner record
        never wins over them)."""
        for shard in shards:
            new_epoch = epochs.get(shard, self._owned.get(shard, 0) + 1)
            self._gone[shard] = max(self._gone.get(shard, 0), new_epoch)
            if self._owned.get(shard, 0) < new_epoch:
                self._owned.pop(shard, None)
            self._releasing.discard(shard)

    async def reopen(self, shards: list[int]) -> None:
        """A move that failed after `release`: take the shards' commands again. The move may
        have landed all the same (its commit's answer lost with the connection): the
        assignment is read first, so a shard that moved is not taken back under its old
        epoch, which routers with a stale map still send."""
        if self._store is None:  # a process started since the release: it holds nothing
            self._releasing.let_go(shards)
            return
        for pause in (*REOPEN_READ_PAUSES_S, None):
            try:
                await self._fresh_assignment()
                break
            except StoreError as exc:
                if pause is None:
                    # The map as last read may predate the move: the shards stay held,
                    # refused here until the hold expires (see RELEASE_HOLD_GRACE_S).
                    log.warning(
                        "%s could not read its assignment before reopening shards %s; they "
                        "stay held until their hold expires: %s",
                        self._spec.name,
                        shards,
                        exc,
                    )
                    return
                await asyncio.sleep(pause)
        self._releasing.let_go(shards)

    def shard_load(self) -> dict[int, float]:
        """Per owned shard: IN_FLIGHT_LOAD for each command in progress, plus one for each
        active actor."""
        table = self._table
        load: dict[int, float] = {}
        for shard in self._owned:
            active = sum(1 for k in self._keys.get(shard, ()) if table and table.is_active(k))
            load[shard] = self._in_flight.get(shard, 0) * IN_FLIGHT_LOAD + active
        return load

    # --- introspection ------------------------------------------------------------------

    def status(self) -> HostStatus:
        now = time.monotonic()
        mark_t, mark_n = self._rate_mark
        rate = (self._finished - mark_n) / (now - mark_t) if now > mark_t else 0.0
        if now - mark_t >= 1.0:
            self._rate_mark = (now, self._finished)
        table = self._table
        return HostStatus(
            name=self._spec.name,
            node=self._node,
            pid=os.getpid(),
            shards=len(self._owned),
            active_actors=table.stats().active if table else 0,
            commands_per_s=round(rate, 1),
            in_flight=sum(self._in_flight.values()),
            log_level=logging.getLevelName(logging.getLogger("actors").getEffectiveLevel()).lower(),
        )

    async def stats(self) -> TableStats:
        return (await self._ensure()).stats()

    def owned(self) -> dict[int, int]:
        return dict(self._owned)


async def _batches(reply: Reply, max_items: int, max_s: float) -> AsyncIterator[list[Any]]:
    items = reply.__aiter__()
    loop = asyncio.get_running_loop()
    first = True
    while True:
        try:
            batch = [await items.__anext__()]
        except StopAsyncIteration:
            return
        end = loop.time() + (0.0 if first else max_s)
        first = False
        try:
            async with asyncio.timeout_at(end):
                while len(batch) < max_items and loop.time() < end:
                    batch.append(await items.__anext__())
        except TimeoutError:
            pass
        except StopAsyncIteration:
            yield batch
            return
        except Exception:
            yield batch
            raise
        yield batch
