"""The `ray` runtime: the router in the gateway process, in front of N actor hosts.

`RayRuntime` implements the `ActorRuntime` port. A command's key hashes to a shard, the
cached shard map names the owning host and the shard's epoch, and the command goes to that
host with (shard, epoch). The router retries, with the SAME command, bounded by
`retry_deadline_s` and with backoff, when the host is dead or restarting (a Ray actor error)
or answers `WrongEpoch` (the shard moved). Retrying is safe because the command id is the
key of the store's processed-commands ledger: a command that did run before the host died
is not run again, the retry returns the first run's result (a conversation turn that was
started answers "turn in progress" or its recorded result, never a second model call).

A supervisor loop pings the hosts, reassigns the shards of hosts that stay unreachable for
`dead_after_s` (a lost node, a host Ray cannot place) and gives shards back when they return.
`scale(n)` adds or removes hosts and moves shards a few at a time, least loaded first; each
move is: the old host stops accepting the shards and passivates their actors (snapshot), the
epoch moves in PostgreSQL, the new host adopts them (see `_move`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import signal
import socket
import threading
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import ray

from actors.behaviour import ActorKey
from actors.errors import AskTimeout, RuntimeNotStarted, RuntimeStopping
from actors.ray.host import (
    IN_FLIGHT_LOAD,
    ActorHost,
    BehaviourSource,
    HostSpec,
    Reconfigurable,
)
from actors.ray.open_calls import OpenCalls
from actors.ray.reload import FreshReload
from actors.ray.watch import (
    HOST_ERRORS,
    HOST_ERRORS_OR_TIMEOUT,
    Attempts,
    HostRestarted,
    HostWatch,
    answer_within,
)
from actors.ray.wire import Failure, HostStatus, Ok, WrongEpoch, ray_failure_summary
from actors.shards import (
    NOTIFY_CHANNEL,
    NUM_SHARDS,
    SHARD_MIGRATIONS,
    ShardMap,
    claim_cluster,
    cluster_lock,
    create_cluster,
    desired_hosts,
    host_index,
    host_name,
    load_map,
    move_shards,
    plan_moves,
    reset_cluster,
    set_desired_hosts,
    shard_of,
)
from actors.table import StopSummary, TableStats
from eventstore.db import Connection, Database, translate_errors
from eventstore.migrate import STORE_MIGRATIONS, apply_migrations
from eventstore.tasks import cancel_and_wait
from schemas.commands import Command
from schemas.errors import InvalidInput, Unavailable

log = logging.getLogger(__name__)

_HOST_ERRORS = HOST_ERRORS
_HOST_ERRORS_OR_TIMEOUT = HOST_ERRORS_OR_TIMEOUT
_STATS_TIMEOUT_S = 2.0
_STATUS_TIMEOUT_S = 3.0
"""How long `status` waits for one host (`stats`, `_STATS_TIMEOUT_S`): one that has not
answered by then is reported unreachable rather than holding up the operator."""
_PING_TIMEOUT_S = 4.0
SCALE_ROUNDS = 3
"""Rebalancing passes of one `scale`: a source still running commands at its release
deadline keeps its shards for the next pass (and the supervisor's, after these)."""
_CONFIGURE_TIMEOUT_S = 10.0
MOVE_GRACE_S = 1.0
"""How long a release waits for every shard of a batch to be idle before those that are
move without the ones still at work (see `_move`)."""
_NAME_RELEASE_S = 10.0
_LOOKUP_AGAIN_S = 0.5
"""A host name Ray did not know is not looked up again sooner (each lookup blocks the loop
on a call to Ray's control store)."""
_PROBE_TIMEOUT_S = 3.0


class HostUnavailable(Unavailable):
    default_code = "actor_host_unavailable"


class ClusterInUse(Unavailable):
    """The cluster cannot be routed by this process as configured (see `claim_cluster`)."""

    default_code = "actor_cluster_in_use"


@dataclass(frozen=True, slots=True)
class RaySettings:
    """How the runtime reaches Ray and shapes its hosts (`from_env` reads the SVC_ keys)."""

    address: str = ""
    """"" starts a local Ray in this process; "auto" or host:port joins a cluster."""
    hosts: int | None = None
    """Hosts of a new cluster; None = one per CPU Ray reports (at least 1). A cluster that
    exists keeps its stored count (changed by `scale`)."""
    cluster: str = "svc"
    namespace: str = "svc"
    host_num_cpus: float = 1.0
    spread: bool = True
    table_options: Mapping[str, Any] = field(default_factory=dict)
    object_store_mb: int = 256
    runtime_env: Mapping[str, Any] | None = None
    retry_deadline_s: float = 30.0
    dead_after_s: float = 3.0
    """A host whose pings stay unanswered this long loses its shards (a restart on the same
    node answers again within about 1.5 s; a lost node never does)."""
    supervise_every_s: float = 0.5
    watch_every_s: float = 0.1
    """How often the router pings each host to see a restarted process (see watch.py)."""
    move_batch: int = 32
    release_deadline_s: float = 30.0
    host_start_timeout_s: float = 120.0
    """How long a new host may take to be placed by Ray and open its store. A host Ray cannot
    place (no node has `host_num_cpus` free) never starts: `start` and `scale` give up after
    this long and end the hosts they created."""
    batch_items: int = 10
    batch_s: float = 0.05
    store_pool_size: int = 10
    max_concurrency: int = 10_000
    stop_hosts: bool | None = None
    """Stop and kill the hosts in `stop()`. None: only when this process started Ray."""

    @classmethod
    def from_env(cls, env: Mapping[str, str], **overrides: Any) -> RaySettings:
        hosts = env.get("SVC_ACTOR_HOSTS", "").strip()
        values: dict[str, Any] = {
            "address": env.get("SVC_RAY_ADDRESS", "").strip(),
            "hosts": int(hosts) if hosts else None,
        }
        values.update(overrides)
        return cls(**values)


def connect_ray(settings: RaySettings) -> bool:
    """Start or join Ray unless this process already did; True if it started a local Ray."""
    if ray.is_initialized():
        return False
    runtime_env = dict(settings.runtime_env) if settings.runtime_env else None
    if settings.address:
        _probe(settings.address)
        try:
            with _keeping_signal_handlers():
                ray.init(
                    address=settings.address,
                    namespace=settings.namespace,
                    log_to_driver=False,
                    runtime_env=runtime_env,
                )
        except ConnectionError as exc:  # "auto" with no local `ray start`, among others
            raise HostUnavailable(
                f"could not join the Ray cluster at {settings.address!r} (SVC_RAY_ADDRESS): "
                f"{exc}; start Ray (`ray start --head`) or correct the address"
            ) from None
        return False
    # "local" always starts a new Ray: a bare ray.init() would silently join a cluster that
    # `ray start` left on this machine, and `stop()` would then end hosts it does not own.
    with _keeping_signal_handlers(), _rays_own_process_groups():
        ray.init(
            address="local",
            namespace=settings.namespace,
            include_dashboard=False,
            log_to_driver=False,
            object_store_memory=settings.object_store_mb * 1024 * 1024,
            runtime_env=runtime_env,
        )
    return True


@contextmanager
def _keeping_signal_handlers() -> Iterator[None]:
    """ray.init installs its own SIGTERM handler (it exits at once), which would skip the
    gateway's graceful shutdown: the process's handlers are put back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread has handlers to set, and ray.init sets none elsewhere
        return
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


@contextmanager
def _rays_own_process_groups() -> Iterator[None]:
    """Each process Ray starts here (GCS, raylet and, through it, the actor hosts) leads a
    process group of its own. In this process's group, a SIGTERM to the whole group (`kill
    -- -PGID`, a supervisor stopping a group) ended them at once, and Ray's driver in this
    process exits the moment its raylet dies ("Raylet IPC connection failed"): the graceful
    stop, the embedded database's and the last log line never came. Out of it, they are
    ended by the gateway's stop, after the turns. Ray's fate sharing still ends them when
    this process dies, by SIGKILL too. Ray starts them with its `ConsolePopen`; a Ray that
    has none, or a system without fate sharing, is left as it is."""
    private: Any = getattr(ray, "_private", None)
    services: Any = getattr(private, "services", None)
    popen: Any = getattr(services, "ConsolePopen", None)
    fate_sharing: Any = getattr(
        getattr(private, "utils", None), "detect_fate_sharing_support", None
    )
    if popen is None or fate_sharing is None or not fate_sharing():
        # Without the kernel's fate sharing (not Linux), Ray's reaper ends Ray's processes
        # when this one dies, by ending its own process group: they must stay in it.
        yield
        return

    class OwnGroupPopen(popen):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("process_group", 0)
            super().__init__(*args, **kwargs)

    services.ConsolePopen = OwnGroupPopen
    try:
        yield
    finally:
        services.ConsolePopen = popen


def _probe(address: str) -> None:
    """Fail fast on a `host:port` nobody listens on: ray.init would retry for minutes."""
    if "://" in address:
        # Ray Client (ray://) joins, then fails every streaming generator: every streamed
        # chat would be a 500. The settings refuse it too; this guards RaySettings built in code.
        raise InvalidInput(
            f"SVC_RAY_ADDRESS {address!r} is a URL; give the host:port of the Ray head to join "
            "as a node (its GCS port, 6379 by default): Ray Client (ray://) cannot stream"
        )
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return  # "auto" (the address file of a local `ray start`)
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=_PROBE_TIMEOUT_S).close()
    except OSError as exc:
        raise HostUnavailable(
            f"no Ray cluster answers at {address} (SVC_RAY_ADDRESS): {exc.strerror or exc}; "
            "start Ray (`ray start --head`) or correct the address"
        ) from None


_RemoteHost: Any = None


def _remote_host() -> Any:
    global _RemoteHost
    if _RemoteHost is None:
        _RemoteHost = ray.remote(ActorHost)
    return _RemoteHost


class RayRuntime:
    """`ActorRuntime` over detached Ray actor hosts, each with its own `ActivationTable`.

    `behaviours` is called in every host process to build its behaviours (model providers
    included): a picklable zero-argument callable, or "module:function". The table options
    (`snapshot_every`, `idle_s`, `max_active`, `conflict_retries`) apply per host.
    """

    def __init__(
        self,
        dsn: str,
        behaviours: BehaviourSource,
        settings: RaySettings | None = None,
        *,
        supervise: bool = True,
    ) -> None:
        self._dsn = dsn
        self._behaviours = behaviours
        self._settings = settings or RaySettings()
        self._supervise_hosts = supervise
        self._db: Database | None = None
        self._map: ShardMap | None = None
        self._handles: dict[str, Any] = {}
        self._known: dict[str, Any] = {}
        """The last actor routed to per host name, kept when its handle is dropped: a lookup
        that finds another actor under the name has found a new one."""
        self._missing_at: dict[str, float] = {}
        self._ready_at: dict[str, float] = {}
        self._listener: Connection | None = None
        self._claimed: Connection | None = None
        """Holds this router's use of the cluster (`claim_cluster`) while it runs."""
        self._supervisor: asyncio.Task[None] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._attempts = Attempts()
        self._watch = HostWatch(self._attempts, on_restart=self._send_config)
        self._config: Any = None
        self._configuring: set[asyncio.Task[None]] = set()
        self._gathering_stats: asyncio.Future[dict[str, TableStats]] | None = None
        self._refresh = FreshReload(self._load_map)
        self._notified: set[asyncio.Future[None]] = set()
        self._moving = asyncio.Lock()
        self._started_ray = False
        self._accepting = False
        self._stopped = False
        self._calls = OpenCalls()
        self.retries = 0

    @property
    def settings(self) -> RaySettings:
        return self._settings

    @property
    def cluster(self) -> str:
        return self._settings.cluster

    @property
    def shard_map(self) -> ShardMap | None:
        """The router's cached copy of the shard map."""
        return self._map

    @property
    def routed_hosts(self) -> list[str]:
        """The hosts this router holds a handle to: it pings them and asks them for stats."""
        return sorted(self._handles)

    # --- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Join or start Ray, create the cluster's map and hosts if new (or find them),
        and start routing and supervising."""
        if self._accepting:
            return
        s = self._settings
        db = await self._connect()
        await self._claim(db, private=self._started_ray)
        async with cluster_lock(db, s.cluster, wait_s=60.0) as locked:
            if not locked:
                raise HostUnavailable(
                    f"the shard map of {s.cluster} stayed locked for 60 s: a `svc cluster "
                    "scale` or another gateway's rebalancing holds it (their logs say); start "
                    "this gateway again once it has finished"
                )
            wanted = s.hosts or _cpu_hosts(s.host_num_cpus)
            if self._started_ray:
                # A Ray of this process's own: no host of an earlier start survives it, so the
                # setting decides (a count stored by a start that failed would never change).
                count = await reset_cluster(db, s.cluster, wanted)
            else:
                count = await create_cluster(db, s.cluster, wanted)
            await self._ensure_hosts(range(count), all_ready=False)
        await self._open()

    async def _claim(self, db: Database, *, private: bool, attaching: bool = False) -> None:
        """Hold the cluster for as long as this router runs (see `claim_cluster`), or undo
        the start so far and say what to change."""
        cluster = self._settings.cluster
        self._claimed = await claim_cluster(db, cluster, private=private)
        if self._claimed is not None:
            return
        await db.close()
        self._db = None
        if self._started_ray:
            ray.shutdown()
        if private:
            raise ClusterInUse(
                f"the actor cluster {cluster!r} of this database is in use by another "
                "gateway, and a gateway that starts a Ray of its own (SVC_RAY_ADDRESS blank) "
                "needs its cluster to itself: give this gateway a cluster of its own "
                "(SVC_RAY_CLUSTER), or point every gateway at one Ray (SVC_RAY_ADDRESS)"
            )
        # Held exclusively: by a gateway whose Ray is its own, where no other process
        # reaches its hosts.
        owner = (
            f"the actor cluster {cluster!r} of this database is run by a gateway on a Ray of "
            "its own (its SVC_RAY_ADDRESS blank), which no other process can reach"
        )
        if attaching:
            raise ClusterInUse(
                f"{owner}: change that gateway's host count with its SVC_ACTOR_HOSTS and a "
                "restart, or run every gateway, and `svc cluster`, on one Ray (SVC_RAY_ADDRESS)"
            )
        raise ClusterInUse(
            f"{owner}: point that gateway at this Ray too (SVC_RAY_ADDRESS), or give this "
            "gateway a cluster of its own (SVC_RAY_CLUSTER)"
        )

    async def attach(self) -> None:
        """Route to an existing cluster without creating or supervising anything (for
        `svc cluster status|scale` from a separate process)."""
        if self._accepting:
            return
        db = await self._connect()
        # Shared, whatever Ray this process joined: a cluster a gateway runs on a Ray of its
        # own is not reachable from here, and scaling it would start hosts in another Ray.
        await self._claim(db, private=False, attaching=True)
        self._supervise_hosts = False
        await self._open()
        if self._map is None:
            await self.stop()
            raise HostUnavailable(f"no actor cluster {self._settings.cluster!r} in this database")

    async def _connect(self) -> Database:
        self._started_ray = connect_ray(self._settings)
        if self._started_ray:
            _check_hosts_fit(self._settings)
        self._db = db = await Database.connect(self._dsn, min_size=1, max_size=4)
        await apply_migrations(db, [STORE_MIGRATIONS, SHARD_MIGRATIONS])
        return db

    async def _open(self) -> None:
        assert self._db is not None
        await self._refresh()
        listener = await self._db.connect_dedicated()
        try:
            with translate_errors():
                await listener.add_listener(NOTIFY_CHANNEL, self._on_notify)
        except BaseException:
            listener.terminate()
            raise
        self._listener = listener
        if self._supervise_hosts:
            self._supervisor = asyncio.create_task(self._supervise(), name="ray-supervisor")
        self._watcher = asyncio.create_task(self._watch_hosts(), name="ray-host-watch")
        self._calls = OpenCalls()
        self._accepting = True
        self._stopped = False

    async def stop(self, deadline_s: float = 10.0) -> StopSummary | None:
        """Stop routing. When this runtime owns the hosts (`stop_hosts`), stop them too:
        running commands finish to the deadline, queued ones fail with RuntimeStopping, every
        active actor is snapshotted; then the host processes are ended. Returns None then:
        the hosts log what became of the commands. Hosts it does not own run on: the calls
        this process waits on get the deadline to end, the rest are answered AnswerAbandoned
        (their commands go on, and are recorded, in the hosts); that is what it returns."""
        self._accepting = False
        self._stopped = True
        stop_hosts = self._settings.stop_hosts
        owns_hosts = stop_hosts if stop_hosts is not None else self._started_ray
        summary = None
        if not owns_hosts:
            finished, left = await self._calls.settle(deadline_s)
            summary = StopSummary(finished, interrupted=0, refused=0, left_running=left)
        tasks = (self._supervisor, self._watcher)
        self._supervisor = self._watcher = None
        await cancel_and_wait(*tasks)
        await self._watch.stop()
        for task in list(self._configuring):
            task.cancel()  # not awaited: see _stop_hosts
        if self._listener is not None:
            self._listener.terminate()
            self._listener = None
        await self._refresh.close()
        if owns_hosts:
            # A private Ray (started here) ends with this process: no host is created under
            # these names again, so no waiting on Ray's name table, whose lookups block for a
            # minute once Ray's own processes are gone (a SIGTERM to the whole process group
            # ends them beside this one). On a shared cluster another router may create them.
            reused = not self._started_ray
            await self._stop_hosts(list(self._handles), deadline_s, names_reused=reused)
        if self._claimed is not None:  # once its hosts are stopped, not before
            self._claimed.terminate()
            self._claimed = None
        if self._db is not None:
            await self._db.close()
            self._db = None
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False
        return summary

    async def _stop_hosts(
        self, names: Sequence[str], deadline_s: float, *, names_reused: bool = True
    ) -> None:
        handles = [self._handles.pop(n) for n in names if n in self._handles]
        for name in names:
            self._watch.forget(name)
        stops = [asyncio.ensure_future(_answer(h.stop.remote(deadline_s))) for h in handles]
        try:
            # Calls still out at the deadline are cancelled and left behind, not awaited
            # again: the stop takes no longer than its deadline whatever a host does.
            _, late = await asyncio.wait(stops, timeout=deadline_s + 15.0) if stops else ((), ())
            if late:
                log.warning("hosts %s did not stop in time; ending them", ", ".join(names))
            for call in late:
                call.cancel()
        finally:
            await self._end(handles, names_reused)

    async def _end(self, handles: Sequence[Any], names_reused: bool = True) -> None:
        """Kill the host actors and, when their names may be used again (`names_reused`),
        wait (up to _NAME_RELEASE_S) until Ray stops resolving the names to them: a host
        created next under one of the names must be a new actor, not the dying one
        (`get_if_exists` and lookups would find that)."""
        for handle in handles:
            ray.kill(handle, no_restart=True)
        if not names_reused:
            return
        loop = asyncio.get_running_loop()
        end = loop.time() + _NAME_RELEASE_S
        dying = {h: n for n, h in self._known.items() if h in handles}
        while dying and loop.time() < end:
            await asyncio.sleep(0.1)
            dying = {h: n for h, n in dying.items() if self._still_named(n, h)}

    def _still_named(self, name: str, handle: Any) -> bool:
        try:
            return bool(self._look_up(name) == handle)
        except ValueError:
            return False

    # --- the port -----------------------------------------------------------------------

    def configure(self, config: Any) -> None:
        """New settings for the hosts' behaviour factory (actors/ray/host.py `Reconfigurable`:
        the model settings). Sent to every host now, to each host this router creates or
        finds, and again to a host seen restarted: Ray brings it back with the settings it
        was created with. The last router to send wins."""
        self._config = config
        if isinstance(self._behaviours, Reconfigurable):  # hosts created from now on
            self._behaviours.reconfigure(config)
        for name in list(self._handles):
            self._send_config(name)

    # The port (actors/runtime.py) fixes the `timeout` parameter.
    async def ask(
        self,
        key: ActorKey,
        command: Command,
        *,
        timeout: float | None = None,
    ) -> Any:
        try:
            async with asyncio.timeout(timeout):
                with self._calls.opened():
                    return await self._call("ask", key, command)
        except TimeoutError:
            raise AskTimeout(
                f"{key} did not answer {type(command).__name__} within {timeout} s; the "
                "command keeps running and a retry with the same Idempotency-Key returns "
                "its result once recorded"
            ) from None

    async def tell(self, key: ActorKey, command: Command) -> None:
        """Returns once the command is in the actor's mailbox (so tells to one actor keep
        their order); it then runs on its own and failures are logged by the host."""
        with self._calls.opened():
            await self._call("tell", key, command)

    async def stream(self, key: ActorKey, command: Command) -> AsyncIterator[Any]:
        with self._calls.opened():
            async for item in self._stream(key, command):
                yield item

    async def _stream(self, key: ActorKey, command: Command) -> AsyncIterator[Any]:
        shard = shard_of(key)
        attempt = 0
        deadline: float | None = None
        while True:
            host, epoch = self._route(shard)
            try:
                parts = self._handle(host).stream.remote(shard, epoch, key, command)
                while True:
                    # Abandoned as an ask's answer is (a host restarted, its shard moved):
                    # a host cut off but alive is never failed by Ray, and a lost node's
                    # calls fail only after Ray's own timeouts.
                    fetch = _next_part(parts)
                    try:
                        answer = await self._calls.until_abandoned(
                            self._attempts.step(host, shard, fetch)
                        )
                    finally:
                        if inspect.getcoroutinestate(fetch) == inspect.CORO_CREATED:
                            fetch.close()  # given up before it started: not left unawaited
                    if answer is _END_OF_STREAM:
                        return
                    if not isinstance(answer, list):
                        break
                    for item in answer:
                        yield item
            except _HOST_ERRORS as exc:
                problem = self._unavailable(host, exc)
            except HostRestarted:
                problem = f"host {host} was restarted, or shard {shard} moved away from it"
            else:
                # Outside the try: the command's own failure, rebuilt, may be a ValueError,
                # which is also among the errors of a host that went away.
                self._raise_unless_retryable(answer)
                problem = f"shard {shard} moved away from {host}"
            attempt += 1
            deadline = await self._before_retry(attempt, deadline, problem, host)

    async def _call(self, method: str, key: ActorKey, command: Command) -> Any:
        shard = shard_of(key)
        attempt = 0
        deadline: float | None = None
        while True:
            host, epoch = self._route(shard)
            try:
                ref = getattr(self._handle(host), method).remote(shard, epoch, key, command)
                answer = await self._calls.until_abandoned(self._attempts.answer(host, shard, ref))
            except _HOST_ERRORS as exc:
                problem = self._unavailable(host, exc)
            except HostRestarted:
                problem = f"host {host} was restarted"
            else:
                if isinstance(answer, Ok):
                    return answer.value
                self._raise_unless_retryable(answer)
                problem = f"shard {shard} moved away from {host}"
            attempt += 1
            deadline = await self._before_retry(attempt, deadline, problem, host)

    def _raise_unless_retryable(self, answer: Failure | WrongEpoch) -> None:
        if isinstance(answer, WrongEpoch):
            return
        error = answer.rebuild()
        # A host that is being stopped (scaled away) refuses with RuntimeStopping before it
        # starts the command: retry elsewhere, unless this runtime is the one stopping.
        if isinstance(error, RuntimeStopping) and self._accepting:
            return
        raise error

    def _route(self, shard: int) -> tuple[str, int]:
        if not self._accepting:
            raise RuntimeStopping() if self._stopped else RuntimeNotStarted()
        assert self._map is not None
        return self._map.route(shard)

    def _unavailable(self, host: str, exc: BaseException) -> str:
        """Why an attempt on `host` failed. A host actor that died for good (ended by
        `svc cluster scale` elsewhere, perhaps created again under its name) is dropped from
        the handle cache, so the next attempt looks its name up again."""
        handle = self._handles.get(host)
        if isinstance(exc, ray.exceptions.ActorDiedError) and handle is not None:
            # Only if it is the cached actor that died: a late answer from an actor already
            # replaced must not drop its successor.
            if exc.actor_id is None or exc.actor_id == handle._actor_id.hex():
                del self._handles[host]
        return f"host {host} is unavailable ({type(exc).__name__})"

    async def _before_retry(
        self, attempt: int, deadline: float | None, problem: str, host: str
    ) -> float:
        """Back off (5 ms doubling to 0.5 s), less if `host` is seen restarted meanwhile, then
        reload the shard map; the retries' deadline, which the first failure starts: the time
        a command waited in its actor's mailbox, or ran, is no time spent retrying."""
        self.retries += 1
        now = asyncio.get_running_loop().time()
        if deadline is None:
            deadline = now + self._settings.retry_deadline_s
        elif now >= deadline:
            raise HostUnavailable(
                f"{problem}; gave up after {attempt} attempts; retry with the same Idempotency-Key"
            )
        await self._watch.until_restarted(host, min(0.5, 0.005 * 2 ** min(attempt, 16)))
        await self._refresh()
        return deadline

    # --- hosts --------------------------------------------------------------------------

    def _send_config(self, name: str) -> None:
        """Send this router's settings to host `name`. Sent at once (not from a task), so they
        reach the host before any command this router sends it afterwards."""
        handle = self._handles.get(name)
        if self._config is None or self._stopped or handle is None:
            return
        ref = handle.configure.remote(self._config)
        task = asyncio.ensure_future(self._configured(name, ref))
        self._configuring.add(task)
        task.add_done_callback(self._configuring.discard)

    async def _configured(self, name: str, ref: Any) -> None:
        try:
            await answer_within(_CONFIGURE_TIMEOUT_S, ref)
        except Exception as exc:  # a host of an older build has no `configure`, for one
            # A restart is seen again when the host answers, and the settings go again then.
            log.warning("%s did not take the new settings (%s)", name, type(exc).__name__)

    def _handle(self, name: str) -> Any:
        """The cached handle of host `name`, else Ray's (ValueError: no such host now)."""
        handle = self._handles.get(name)
        if handle is None:
            handle = self._install(name, self._look_up(name))
        return handle

    def _install(self, name: str, handle: Any) -> Any:
        """Route to `handle` for host `name` from now on. An actor other than the one known
        before (ended and created again by another process) gets `dead_after_s` to answer,
        as at start; an actor seen for the first time gets this router's settings."""
        known = self._known.get(name)
        self._handles[name] = self._known[name] = handle
        if known != handle:  # handles compare by actor id
            if known is not None:
                log.info("%s is a new actor now; routing to it", name)
                self._ready_at[name] = asyncio.get_running_loop().time()
            self._send_config(name)
        return handle

    def _look_up(self, name: str) -> Any:
        now = asyncio.get_running_loop().time()
        if now - self._missing_at.get(name, -1e9) < _LOOKUP_AGAIN_S:
            raise ValueError(f"actor host {name} does not exist")
        try:
            handle = ray.get_actor(name, namespace=self._settings.namespace)
        except ValueError:
            self._missing_at[name] = now
            raise
        self._missing_at.pop(name, None)
        return handle

    def _spec(self, name: str) -> HostSpec:
        s = self._settings
        return HostSpec(
            cluster=s.cluster,
            name=name,
            dsn=self._dsn,
            behaviours=self._behaviours,
            table_options=dict(s.table_options),
            batch_items=s.batch_items,
            batch_s=s.batch_s,
            store_pool_size=s.store_pool_size,
        )

    async def _ensure_hosts(self, indexes: Sequence[int] | range, *, all_ready: bool) -> None:
        """Create (or find, after a gateway restart) the named hosts and wait until each has
        opened its store. Hosts created here that fail to, or are not ready within
        `host_start_timeout_s` (Ray found no node with room), are ended: HostUnavailable.
        Hosts that existed and are not ready fail the call only if `all_ready`; otherwise
        they are left to the supervisor, as a host that went down."""
        s = self._settings
        names = [host_name(s.cluster, i) for i in indexes]
        created = {name for name in names if self._create(name)}
        # A host that existed and answers is ready at once; one that does not (down, waiting
        # for room) is not waited for long unless every host must be ready: the cluster's
        # lock is held meanwhile, which the other gateways' supervisors need to move its
        # shards, and a gateway that waited two minutes to start would fail its probes.
        waits = {
            name: s.host_start_timeout_s
            if all_ready or name in created
            else min(s.host_start_timeout_s, EXISTING_HOST_WAIT_S)
            for name in names
        }
        outcomes = await asyncio.gather(*(self._ready(name, waits[name]) for name in names))
        failed = {n: o for n, o in zip(names, outcomes, strict=True) if isinstance(o, str)}
        unplaced = created.intersection(failed)
        await self._end([self._handles.pop(name) for name in unplaced])
        if failed and (all_ready or unplaced):
            raise HostUnavailable(_not_started(failed, s))
        now = asyncio.get_running_loop().time()
        for name, outcome in zip(names, outcomes, strict=True):
            if isinstance(outcome, str):
                log.warning("%s is not ready (%s); left to the supervisor", name, outcome)
                continue
            self._ready_at[name] = now
            self._watch.seen(name, outcome.pid)

    def _create(self, name: str) -> bool:
        """Route to Ray's actor named `name` (looked up again: a cached handle may be to an
        actor ended since), creating it when Ray has none; True when created here."""
        try:
            self._install(name, self._look_up(name))
            return False
        except ValueError:
            pass
        s = self._settings
        options: dict[str, Any] = {
            "name": name,
            "namespace": s.namespace,
            "lifetime": "detached",
            "get_if_exists": True,  # another gateway may be creating it at the same time
            "num_cpus": s.host_num_cpus,
            "max_restarts": -1,
            # The router retries (same command id, bounded by retry_deadline_s). It also
            # makes Ray refuse a call to a host it is restarting rather than queue it until
            # the host is placed, which for a host with no room anywhere is never
            # (tests/ray/test_cluster.py, `..._cannot_place_again_is_given_up`).
            "max_task_retries": 0,
            "max_concurrency": s.max_concurrency,
        }
        if s.spread:
            options["scheduling_strategy"] = "SPREAD"
        self._install(name, _remote_host().options(**options).remote(self._spec(name)))
        self._missing_at.pop(name, None)
        return True

    async def _ready(self, name: str, timeout: float) -> HostStatus | str:
        """The host's status once it has opened its store (within `timeout`), else why not."""
        try:
            status: HostStatus = await answer_within(timeout, self._handles[name].ready.remote())
        except TimeoutError:
            return f"not ready within {timeout:g} s"
        except Exception as exc:  # its store unreachable, the actor ended meanwhile, ...
            # The cause, not only its type: a module missing on the node, a database
            # address the node cannot reach, which advice about CPUs would not mend.
            return f"failed to start: {ray_failure_summary(exc)}"
        return status

    # --- the shard map ------------------------------------------------------------------

    def _on_notify(self, _conn: Any, _pid: int, _channel: str, payload: str) -> None:
        if payload == self._settings.cluster:
            task = asyncio.ensure_future(self._refresh())
            self._notified.add(task)
            task.add_done_callback(self._notified.discard)

    async def _load_map(self) -> None:
        if self._db is None:
            return
        loaded = await load_map(self._db, self._settings.cluster)
        if loaded is not None:
            before, self._map = self._map, loaded
            if before is not None:
                self._moved_away(before, loaded)

    def _moved_away(self, before: ShardMap, after: ShardMap) -> None:
        """Abandon attempts routed by the old map: their host refuses them (WrongEpoch) or,
        lost with its node, never answers."""
        if before.epochs == after.epochs:
            return
        for shard, (old, new) in enumerate(zip(before.epochs, after.epochs, strict=True)):
            if old != new:
                self._attempts.abandon(shard)

    # --- supervision and rebalancing ----------------------------------------------------

    async def _watch_hosts(self) -> None:
        every = self._settings.watch_every_s
        # Pings to a dead process hang until Ray's own timeout (about 2 s here): keep enough
        # outstanding that a new one still goes out every tick meanwhile.
        pending = max(4, int(4.0 / every))
        while True:
            await asyncio.sleep(every)
            # Only hosts this router has a handle for: looking one up is a blocking GCS call.
            for name, handle in list(self._handles.items()):
                self._watch.poll(name, handle, timeout_s=4.0, max_pending=pending)

    async def _supervise(self) -> None:
        while True:
            await asyncio.sleep(self._settings.supervise_every_s)
            try:
                await self._check_hosts()
            except Exception:
                log.exception("actor host supervision failed")

    async def _check_hosts(self) -> None:
        assert self._db is not None
        s = self._settings
        count = await desired_hosts(self._db, s.cluster) or 1
        await self._refresh()
        # Checked after the last await: a scale or a rebalance here owns the hosts meanwhile
        # (one could re-adopt a host the scale is ending, or let go of one it just created).
        if self._moving.locked():
            return
        names = [host_name(s.cluster, i) for i in range(count)]
        self._watch_all(names)
        self._forget_retired(names)
        live = self._live(names)
        if not live or self._map is None:
            return
        if plan_moves(self._map.owners, live):
            async with self._moving, cluster_lock(self._db, s.cluster, wait_s=0.0) as locked:
                if locked:
                    # Busy shards of a host that answers wait for a tick when they are idle:
                    # held for a move on every tick, their commands were refused most of
                    # the time a long turn ran (docs/ray.md).
                    await self._rebalance(live, self._live(self._watched(names)), patient=False)

    def _watch_all(self, names: Sequence[str]) -> None:
        """Have a current handle for every host, so the watch pings them (and restarts are
        seen). A host that stopped answering is looked up again: `svc cluster scale` in
        another process may have ended it and created a new actor under its name, which the
        old handle never reaches (see `_install`)."""
        stale = set(names).difference(self._live(names))
        for name in names:
            if name in self._handles and name not in stale:
                continue
            try:
                current = self._look_up(name)
            except ValueError:
                continue  # not created yet, or ended by `scale` elsewhere
            if self._handles.get(name) != current:  # handles compare by actor id
                self._install(name, current)

    def _forget_retired(self, names: Sequence[str]) -> None:
        """Drop the handles of hosts past the desired count that own no shard: ended by
        `svc cluster scale` in another process, they would otherwise be pinged and asked for
        stats for as long as this router runs. One that owns shards again is looked up."""
        owners = set(self._map.owners) if self._map is not None else set()
        for name in [n for n in self._handles if n not in names and n not in owners]:
            del self._handles[name]
            self._watch.forget(name)

    def _live(self, names: Sequence[str]) -> list[str]:
        now = asyncio.get_running_loop().time()
        dead_after = self._settings.dead_after_s
        return [n for n in names if now - self._answered_at(n) < dead_after]

    def _answered_at(self, name: str) -> float:
        watched = self._watch.answered_at(name)
        ready = self._ready_at.get(name, -1e9)
        return ready if watched is None else max(watched, ready)

    def _watched(self, names: Sequence[str]) -> list[str]:
        """`names` and every other host this router pings (surplus hosts that still own
        shards among them): the hosts whose liveness a move may ask about."""
        return [*names, *(n for n in self._handles if n not in names)]

    async def _rebalance(
        self, hosts: Sequence[str], live: Sequence[str], *, patient: bool = True
    ) -> int:
        """Move shards until they are spread evenly over `hosts`; the caller holds the locks.
        `live`: the hosts that answer, targets or not. A source among them releases its
        shards before they move; only a source that does not answer is skipped (nothing
        runs there), so a surplus host being scaled in is released like any other.
        Not `patient` (the supervisors): a live source's shards with a command in progress
        are left for a later pass, and one still busy after the short grace is given back
        at once, not waited for to the release deadline."""
        assert self._db is not None
        current = await load_map(self._db, self._settings.cluster)
        if current is None:
            return 0
        load = await self._shard_load(current, live)
        moves = plan_moves(current.owners, hosts, load)
        if not patient:
            moves = [
                m for m in moves if m.source not in live or load.get(m.shard, 0.0) < IN_FLIGHT_LOAD
            ]
        batches: dict[tuple[str, str], list[int]] = {}
        for move in moves:
            batches.setdefault((move.source, move.target), []).append(move.shard)
        moved = 0
        size = self._settings.move_batch
        for (source, target), shards in batches.items():
            for i in range(0, len(shards), size):
                batch = shards[i : i + size]
                moved += await self._move(source, target, batch, live, patient=patient)
        await self._refresh()
        return moved

    async def _shard_load(self, current: ShardMap, live: Sequence[str]) -> dict[int, float]:
        load: dict[int, float] = {}

        async def one(name: str) -> None:
            try:
                load.update(await answer_within(5.0, self._handle(name).shard_load.remote()))
            except _HOST_ERRORS_OR_TIMEOUT:
                return

        # Every owner that answers, a host being scaled in too: its shards move in any case,
        # and the load puts the busy ones last.
        await asyncio.gather(*(one(h) for h in set(current.owners) if h in live))
        return load

    async def _move(
        self,
        source: str,
        target: str,
        shards: list[int],
        live: Sequence[str],
        *,
        patient: bool = True,
    ) -> int:
        """Hand `shards` from `source` to `target`.

        1. `source.release`: it refuses new commands of the shards (WrongEpoch, so routers
           retry), waits for those in progress, snapshots and passivates their actors. A dead
           source is skipped: nothing runs there. The wait is short at first (MOVE_GRACE_S):
           the shards idle by then move at once, and only those still at work (a long turn)
           wait on, to the release deadline, rather than hold the whole batch that long.
        2. The epochs move in PostgreSQL (one transaction) and routers are notified: from
           here the old epoch is refused everywhere and the new one is accepted by `target`.
        3. `target.adopt` and `source.forget` tell both hosts at once; a host that misses it
           learns from the map when the next command with the new epoch arrives (or within
           its periodic reload).

        A shard still at work at the deadline is given back to `source` (`reopen`): moving
        it would run the same actors in two processes, as the routers would send the
        commands still running there again, to the new owner. A later pass moves it.
        """
        if source not in live:
            return await self._hand_over(source, target, shards, source_live=False)
        deadline_s = self._settings.release_deadline_s
        grace_s = min(deadline_s, MOVE_GRACE_S)
        busy = await self._release(source, shards, grace_s)
        if busy is None:
            return 0
        idle = [shard for shard in shards if shard not in busy]
        try:
            moved = await self._hand_over(source, target, idle, source_live=True)
        except BaseException:
            if busy:  # held meanwhile: given back with the idle ones
                await self._tell(source, "reopen", busy)
            raise
        if not busy:
            return moved
        if not patient:
            await self._tell(source, "reopen", busy)
            return moved
        still = await self._release(source, busy, deadline_s - grace_s)
        if still is None:
            return moved
        if still:
            log.info("%s still runs commands of %d shards; moving them later", source, len(still))
            await self._tell(source, "reopen", still)
        done = [shard for shard in busy if shard not in still]
        return moved + await self._hand_over(source, target, done, source_live=True)

    async def _release(self, source: str, shards: list[int], wait_s: float) -> list[int] | None:
        """The shards of `shards` whose commands still run on `source` after it waited up to
        `wait_s`; None (the shards given back) when it did not answer."""
        try:
            call = self._handle(source).release.remote(shards, wait_s)
            busy = await answer_within(wait_s + 10.0, call)
        except _HOST_ERRORS_OR_TIMEOUT as exc:
            log.warning("%s did not release shards (%s); trying later", source, exc)
            await self._tell(source, "reopen", shards)
            return None
        except asyncio.CancelledError:
            # This router stopping, or a scale interrupted: the source would refuse the
            # shards until its hold ran out (a minute), and no one else would move them.
            await self._tell(source, "reopen", shards)
            raise
        if isinstance(busy, int):  # a host of a release before this one: a count
            return list(shards) if busy else []
        return list(busy)

    async def _hand_over(
        self, source: str, target: str, shards: list[int], *, source_live: bool
    ) -> int:
        """Steps 2 and 3 of `_move` for shards `source` released (or, dead, cannot run)."""
        assert self._db is not None
        if not shards:
            return 0
        try:
            epochs = await move_shards(self._db, self._settings.cluster, shards, source, target)
        except BaseException:
            if source_live:
                await self._tell(source, "reopen", shards)
            raise
        await self._tell(target, "adopt", epochs)
        if source_live:
            await self._tell(source, "forget", shards, epochs)
        return len(epochs)

    async def _tell(self, name: str, method: str, *args: Any) -> None:
        """Call `method` on host `name`, best effort: a host that misses it reads the map."""
        try:
            await answer_within(10.0, getattr(self._handle(name), method).remote(*args))
        except _HOST_ERRORS_OR_TIMEOUT as exc:
            log.info("host notification not delivered (%s); the host reads the map itself", exc)

    async def scale(self, hosts: int) -> dict[str, Any]:
        """Run the cluster on `hosts` hosts: start new ones, move shards (least loaded
        first, a batch at a time), then stop and end the hosts that no longer own any."""
        if hosts < 1 or hosts > NUM_SHARDS:
            raise ValueError(f"hosts must be between 1 and {NUM_SHARDS}")
        if self._db is None:
            raise RuntimeNotStarted()
        db, s = self._db, self._settings
        async with self._moving, cluster_lock(db, s.cluster, wait_s=60.0) as locked:
            if not locked:
                raise HostUnavailable("another process is changing the shard map; try again")
            before = await desired_hosts(db, s.cluster) or hosts
            await set_desired_hosts(db, s.cluster, hosts)
            try:
                await self._ensure_hosts(range(hosts), all_ready=True)
            except BaseException:
                # Back to where it was (no shard has moved yet), also when cancelled (Ctrl-C
                # on `svc cluster scale` while new hosts wait for room): else the count
                # stays, and the hosts created, placed later, get shards nobody asked for.
                await set_desired_hosts(db, s.cluster, before)
                await self._remove_surplus(before, hosts)
                raise
            names = [host_name(s.cluster, i) for i in range(hosts)]
            moved = 0
            for _ in range(SCALE_ROUNDS):
                current = await load_map(db, s.cluster)
                sources = set(current.owners) if current is not None else set()
                live = await self._answering(sorted(sources | set(names)))
                moved += await self._rebalance(names, live)
                if self._map is None or set(self._map.owners) <= set(names):
                    break  # else a source was still busy at its release deadline: again
            removed = await self._remove_surplus(hosts, before)
            owners = set(self._map.owners) if self._map is not None else set()
            kept = sorted(n for n in owners if n not in names)
        # `kept`: hosts past the count still running commands after every pass. The
        # supervisors move their shards once they are idle; only a `scale` ends a host, so
        # the caller must run it again (`svc cluster scale` says so and exits 1).
        return {
            "hosts": hosts,
            "before": before,
            "shards_moved": moved,
            "removed": removed,
            "kept": kept,
        }

    async def _answering(self, names: Sequence[str]) -> list[str]:
        """The hosts of `names` that answer a ping now. A command-line `scale` has no watch
        history: going by it would take every source for dead and move its shards without
        a release."""

        async def answers(name: str) -> bool:
            try:
                handle = self._handle(name)
            except ValueError:  # no such host now
                return False
            try:
                await answer_within(_PING_TIMEOUT_S, handle.ping.remote())
            except _HOST_ERRORS_OR_TIMEOUT:
                return False
            return True

        found = await asyncio.gather(*(answers(n) for n in names))
        return [n for n, ok in zip(names, found, strict=True) if ok]

    async def _remove_surplus(self, hosts: int, before: int) -> list[str]:
        assert self._map is not None
        owners = set(self._map.owners)
        known = {host_index(self.cluster, n) for n in self._handles}
        top = max([before, *(i for i in known if i is not None)]) if known else before
        surplus: list[str] = []
        for i in range(hosts, top + 1):
            name = host_name(self.cluster, i)
            if name in owners:
                log.warning("%s still owns shards; not removing it", name)
                continue
            try:
                self._handle(name)
            except ValueError:
                continue
            surplus.append(name)
        await self._stop_hosts(surplus, self._settings.release_deadline_s)
        for name in surplus:
            self._ready_at.pop(name, None)
        return surplus

    # --- introspection ------------------------------------------------------------------

    async def stats(self) -> TableStats:
        """The table counters summed over every host that answered."""
        each = list((await self.host_stats()).values())
        fields = [f.name for f in dataclasses.fields(TableStats)]
        return TableStats(**{f: sum(getattr(st, f) for st in each) for f in fields})

    async def host_stats(self) -> dict[str, TableStats]:
        """The table counters of each host that answers within `_STATS_TIMEOUT_S`, by name.

        A host that is down, restarting or ended by another process (`svc cluster scale`)
        is left out: a scrape must not wait for Ray to give up on it. Callers that come
        while a round of questions is out share its answers: scrapes of /metrics (which
        needs no key) ask each host once however many arrive together."""
        if self._gathering_stats is None:
            self._gathering_stats = asyncio.ensure_future(self._gather_host_stats())
            self._gathering_stats.add_done_callback(self._host_stats_gathered)
        return dict(await asyncio.shield(self._gathering_stats))

    def _host_stats_gathered(self, _done: asyncio.Future[dict[str, TableStats]]) -> None:
        self._gathering_stats = None

    async def _gather_host_stats(self) -> dict[str, TableStats]:
        assert self._map is not None
        names = sorted(set(self._map.owners) | set(self._handles))
        answers = await asyncio.gather(
            *(self._host_stats(n) for n in names), return_exceptions=True
        )
        return {n: a for n, a in zip(names, answers, strict=True) if isinstance(a, TableStats)}

    async def _host_stats(self, name: str) -> TableStats:
        stats: TableStats = await answer_within(_STATS_TIMEOUT_S, self._handle(name).stats.remote())
        return stats

    async def status(self) -> dict[str, Any]:
        """Hosts (name, node, pid, shards, active actors, commands/s), nodes, shard map."""
        assert self._db is not None
        s = self._settings
        current = await load_map(self._db, s.cluster)
        count = await desired_hosts(self._db, s.cluster) or 0
        counts = current.counts() if current else {}
        names = sorted(
            {host_name(s.cluster, i) for i in range(count)} | set(counts),
            key=lambda n: host_index(s.cluster, n) or 0,
        )
        hosts = await asyncio.gather(*(self._host_status(n, counts.get(n, 0)) for n in names))
        return {
            "cluster": s.cluster,
            "desired_hosts": count,
            "shards": NUM_SHARDS,
            "max_epoch": max(current.epochs) if current else 0,
            "hosts": hosts,
            "nodes": _nodes(),
        }

    async def _host_status(self, name: str, shards: int) -> dict[str, Any]:
        try:
            st: HostStatus = await answer_within(
                _STATUS_TIMEOUT_S, self._handle(name).status.remote()
            )
        except _HOST_ERRORS_OR_TIMEOUT as exc:
            return {
                "name": name,
                "state": f"unreachable ({type(exc).__name__})",
                "node": None,
                "pid": None,
                "shards": shards,
                "active_actors": None,
                "commands_per_s": None,
                "log_level": None,
            }
        return {
            "name": name,
            "state": "alive",
            "node": st.node,
            "pid": st.pid,
            "shards": shards,
            "active_actors": st.active_actors,
            "commands_per_s": st.commands_per_s,
            "in_flight": st.in_flight,
            "log_level": st.log_level,
        }


_END_OF_STREAM = object()


async def _next_part(parts: Any) -> Any:
    """The next part of the host's stream `parts` (a Ray generator of object refs), fetched;
    `_END_OF_STREAM` after the last."""
    try:
        ref = await parts.__anext__()
    except StopAsyncIteration:
        return _END_OF_STREAM
    return await ref


def _nodes() -> list[dict[str, Any]]:
    return [
        {
            "node": n.get("NodeID"),
            "alive": bool(n.get("Alive")),
            "address": n.get("NodeManagerAddress"),
            "cpus": n.get("Resources", {}).get("CPU", 0.0),
        }
        for n in ray.nodes()  # type: ignore[no-untyped-call]
    ]


async def _answer(ref: Any) -> Any:
    try:
        return await ref
    except Exception as exc:  # a host that is gone answers its stop with an error: fine
        return exc


EXISTING_HOST_WAIT_S = 5.0
"""How long a gateway's start waits for a host that already existed (another gateway's, or
its own before a restart) to answer that it is ready, before leaving it to the supervisor."""


def _not_started(failed: Mapping[str, str], s: RaySettings) -> str:
    free = float(ray.available_resources().get("CPU", 0.0))  # type: ignore[no-untyped-call]
    total = _cluster_cpus()
    hosts = ", ".join(f"{name} ({why})" for name, why in failed.items())
    return (
        f"Ray did not start actor host(s) {hosts}. Each host reserves {s.host_num_cpus:g} CPU "
        f"and the cluster has {free:g} of {total:g} CPUs free (`ray status`); a host also "
        "needs to reach the database. "
        + (
            "Add nodes, or run `svc cluster scale N` with fewer hosts"
            if s.address
            else "Lower SVC_ACTOR_HOSTS (0: one host per CPU) or the CPU each host reserves"
        )
    )


def _check_hosts_fit(s: RaySettings) -> None:
    """A Ray of this process's own has this machine's CPUs and never more: hosts that need
    more never start, and the start would wait `host_start_timeout_s` (120 s) to say so."""
    total = _cluster_cpus()
    if s.hosts and s.hosts * s.host_num_cpus > total:
        ray.shutdown()
        raise HostUnavailable(
            f"SVC_ACTOR_HOSTS={s.hosts} asks for {s.hosts} actor hosts of "
            f"{s.host_num_cpus:g} CPU each, and the Ray this gateway starts has this "
            f"machine's {total:g} CPUs: lower SVC_ACTOR_HOSTS (0: one host per CPU), or join "
            "a larger cluster (SVC_RAY_ADDRESS)"
        )


def _cpu_hosts(per_host: float) -> int:
    cpus = _cluster_cpus()
    return max(1, int(cpus // per_host) if per_host > 0 else 1)


def _cluster_cpus() -> float:
    """The CPUs of the Ray this process joined or started, on every node."""
    return float(ray.cluster_resources().get("CPU", 0.0))  # type: ignore[no-untyped-call]


# --- `svc cluster` ------------------------------------------------------------------------


async def cluster_status(
    dsn: str, behaviours: BehaviourSource, settings: RaySettings
) -> dict[str, Any]:
    """For `svc cluster status [--json]`: joins the Ray cluster at `settings.address` ("auto"
    or host:port of a running cluster), reads the shard map of `settings.cluster` and asks
    each host. Creates nothing; raises HostUnavailable if the cluster has no map yet.
    `behaviours` is only used if hosts must be created (scale), as in `RayRuntime`."""
    runtime = RayRuntime(dsn, behaviours, dataclasses.replace(settings, stop_hosts=False))
    with _ray_failures_said_plainly("svc cluster status"):
        await runtime.attach()
        try:
            return await runtime.status()
        finally:
            await runtime.stop()


async def cluster_scale(
    dsn: str, hosts: int, behaviours: BehaviourSource, settings: RaySettings
) -> dict[str, Any]:
    """For `svc cluster scale N`: as `RayRuntime.scale`, from a separate process."""
    runtime = RayRuntime(dsn, behaviours, dataclasses.replace(settings, stop_hosts=False))
    with _ray_failures_said_plainly(f"svc cluster scale {hosts}"):
        await runtime.attach()
        try:
            return await runtime.scale(hosts)
        finally:
            await runtime.stop()


@contextmanager
def _ray_failures_said_plainly(command: str) -> Iterator[None]:
    """A failure Ray raises (a host that died or raised) as one line an operator can act on;
    its str() is a whole remote traceback, which the command line would print as it is."""
    try:
        yield
    except ray.exceptions.RayError as exc:
        raise HostUnavailable(
            f"the Ray cluster failed `{command}`: {ray_failure_summary(exc)}; the hosts' own "
            "logs (`ray logs`, or the Ray dashboard) hold the whole traceback"
        ) from None


__all__ = [
    "HostUnavailable",
    "RayRuntime",
    "RaySettings",
    "cluster_scale",
    "cluster_status",
    "connect_ray",
]
