"""Opening and closing the platform behind the gateway: database, store, actors, projections.

`open_platform(settings)` is shared by the HTTP app (gateway/app.py) and the `svc` command
line, so both see the same wiring. Startup order:

1. the database: `SVC_DATABASE_URL`, else the embedded PostgreSQL under `SVC_DATA_DIR`
   (shared per data directory: a CLI next to a running server joins the same cluster);
2. migrations (store, projections, gateway), the xid-horizon check, the commit notifier,
   the log tailer and the event store;
3. stored settings (so R settings set with `svc settings set` apply from this start on);
4. model providers, the activation table and the local runtime;
5. the default workspace (created through the workspace actor when missing);
6. the projection runner and the background tasks (live settings, rate-limit pruning, the
   sweep of turns left running by a stopped process: gateway/turn_sweep.py).

Shutdown runs the same steps backwards: background tasks, the runtime, projections (caught up
to the head, then stopped), providers, the store, the embedded database. The runtime is stopped
through `Platform.shutdown`, which holds the one budget of `SVC_SHUTDOWN_GRACE_SEC`: the
server starts it at the signal and stops the runtime before draining its handlers
(gateway/app.py), so the step here only waits for that same stop; `shutdown.report` is what
the final log line of `svc serve` says.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from typing import TYPE_CHECKING, Any

from actors.agent import AgentBehaviour
from actors.behaviour import ActorKey, Behaviour
from actors.conversation import ConversationBehaviour
from actors.identity import identity_behaviours
from actors.local import LocalRuntime
from actors.models.port import ModelProvider
from actors.models.registry import ModelConfig, ProviderSet, build_providers, optional_float
from actors.runtime import ActorRuntime
from actors.settings import SettingsBehaviour
from actors.shards import SHARD_MIGRATIONS
from actors.table import ActivationTable
from actors.workspace import KIND as WORKSPACE_KIND
from actors.workspace import WorkspaceBehaviour
from eventstore import OpenedStore, StoreError, open_store_parts
from eventstore.db import Database
from eventstore.embedded import EmbeddedPostgres
from eventstore.errors import StoreUnavailable
from eventstore.migrate import STORE_MIGRATIONS, MigrationSource
from eventstore.store import PostgresEventStore
from eventstore.tailer import LogTailer, SubscriberTooSlow
from eventstore.tasks import cancel_and_wait, cancel_unless_done
from gateway.cursor_keys import load_cursor_seal
from gateway.cursor_seal import CursorSeal
from gateway.log_levels import apply_log_level, log_to_stderr
from gateway.ratelimit import RateLimiter
from gateway.secrets import DatabaseVault
from gateway.settings import Settings, SettingsService, read_stored_layer
from gateway.shutdown import PROJECTION_FLUSH_S, Shutdown, ShutdownReport, bounded
from gateway.turn_sweep import SWEEP_EVERY_S, AbandonedTurnSweep, call_budget_s
from projections import PROJECTION_MIGRATIONS, ProjectionRunner, default_projectors
from projections.errors import ProjectionFailed
from projections.identity import IdentityProjector
from schemas.commands import service_command_id
from schemas.errors import Conflict, SvcError
from schemas.events import EventFromNewerVersion
from schemas.settings import INSTANCE_WORKSPACE_ID, SettingChanged, SettingUnset
from schemas.workspace import CreateWorkspace

if TYPE_CHECKING:
    from actors.ray import RaySettings

log = logging.getLogger(__name__)

GATEWAY_MIGRATIONS = MigrationSource("gateway", "gateway.migrations")
MIGRATIONS = (STORE_MIGRATIONS, PROJECTION_MIGRATIONS, GATEWAY_MIGRATIONS, SHARD_MIGRATIONS)
"""Every migration source, the store's first (open_store_parts applies it itself)."""
PRUNE_EVERY_S = 300.0
STORE_STOP_S = 25.0
"""Closing the store waits for the appends in flight (STORE_APPENDS_WAIT_S), then stops the
sampler, the tailer and the notifier, then the pool (which gives borrowed connections 10 s
before terminating them): within this, whatever an append does."""
STORE_APPENDS_WAIT_S = 10.0


@dataclass
class Platform:
    settings: Settings
    db: Database
    store: PostgresEventStore
    tailer: LogTailer
    runtime: ActorRuntime
    projections: ProjectionRunner
    providers: ProviderSet
    settings_service: SettingsService
    limiter: RateLimiter
    shutdown: Shutdown
    cursors: CursorSeal


def model_config(settings: Settings) -> ModelConfig:
    return ModelConfig(
        gateway_url=settings.text("SVC_LLM_GATEWAY_URL"),
        model=settings.text("SVC_LLM_MODEL"),
        provider=settings.text("SVC_LLM_PROVIDER"),
        call_timeout_s=call_budget_s(settings),
        retries=settings.integer("SVC_LLM_RETRIES"),
        temperature=optional_float(
            settings.text("SVC_LLM_TEMPERATURE"), low=0.0, high=2.0, key="SVC_LLM_TEMPERATURE"
        ),
        top_p=optional_float(
            settings.text("SVC_LLM_TOP_P"), low=0.0, high=1.0, key="SVC_LLM_TOP_P"
        ),
        api_key=settings.text("SVC_NATIVE_API_KEY") or None,
        started_at=settings.stored_version_at_start,
        read_at=settings.stored_version,
    )


@asynccontextmanager
async def database_url(settings: Settings) -> AsyncIterator[str]:
    """The database's URL, starting the embedded server for as long as the caller needs it."""
    async with AsyncExitStack() as stack:
        yield await _database_url(settings, stack)


async def _database_url(settings: Settings, stack: AsyncExitStack) -> str:
    if settings.database_url:
        return settings.database_url
    embedded = EmbeddedPostgres(settings.data_dir.resolve())
    url = await _started(embedded)
    stack.push_async_callback(asyncio.to_thread, embedded.stop)
    _background(stack, _keep_running(embedded), "embedded-postgres-watch")  # stopped first
    return url


async def _started(embedded: EmbeddedPostgres) -> str:
    """`embedded.start()`, in a thread, which a cancellation (a signal during `svc serve`'s
    start) cannot stop: the cancelled caller waits for it (a crash recovery may take
    minutes) and stops the server it started, rather than return with both still running
    behind it, out of reach of the process's clean-up."""
    start = asyncio.ensure_future(asyncio.to_thread(embedded.start))
    try:
        return await asyncio.shield(start)
    except asyncio.CancelledError:
        log.info("cancelled while the embedded PostgreSQL starts: stopping it once started")
        with contextlib.suppress(Exception):  # a start that failed has nothing to stop
            await start
            await asyncio.to_thread(embedded.stop)
        raise


EMBEDDED_CHECK_S = 5.0
"""How often the embedded PostgreSQL is looked at while the process runs."""
EMBEDDED_RETRY_MAX_S = 60.0


async def _keep_running(embedded: EmbeddedPostgres) -> None:
    """Start the embedded server again when it died under this process: the pool comes
    back by itself once it answers (as it does for an external database), where before
    every request was a 503 until something restarted the process. A start that fails (a
    full disk its recovery needs) is tried again, less and less often."""
    wait_s = EMBEDDED_CHECK_S
    while True:
        await asyncio.sleep(wait_s)
        try:
            if embedded.running():
                if embedded.shutting_down():
                    log.warning(
                        "the embedded PostgreSQL in %s is shutting down (something sent it a "
                        "stop signal): ending its sessions so that it stops, then starting it "
                        "again",
                        embedded.pgdata,
                    )
                    await asyncio.to_thread(embedded.hasten_stop)
                    continue  # seen stopped at the next look, and started again
                await asyncio.to_thread(embedded.stay_listed)
                wait_s = EMBEDDED_CHECK_S
                continue
            log.warning("the embedded PostgreSQL in %s stopped; starting it again", embedded.pgdata)
            await asyncio.to_thread(embedded.revive)
        except Exception as exc:  # a StoreUnavailable saying why, or its lock unreachable
            wait_s = min(EMBEDDED_RETRY_MAX_S, wait_s * 2)
            reason = exc.message if isinstance(exc, StoreUnavailable) else repr(exc)
            log.error("%s; trying again in %.0f s", reason, wait_s)
            continue
        log.info("the embedded PostgreSQL in %s runs again", embedded.pgdata)
        wait_s = EMBEDDED_CHECK_S


async def open_store(
    settings: Settings, stack: AsyncExitStack, report: ShutdownReport | None = None
) -> tuple[OpenedStore, str]:
    """The store with its notifier and tailer, closed by `stack`; and the database URL.
    A close that overruns its deadline is noted in `report`."""
    dsn = await _database_url(settings, stack)
    opened = await open_store_parts(
        dsn, migrations=MIGRATIONS[1:], max_size=settings.integer("SVC_DB_POOL_SIZE")
    )

    close = functools.partial(opened.store.close, appends_wait_s=STORE_APPENDS_WAIT_S)
    stack.push_async_callback(bounded, "event store", close, STORE_STOP_S, report)
    return opened, dsn


async def load_stored_settings(settings: Settings, store: PostgresEventStore) -> DatabaseVault:
    """Put the stored settings in force over the environment's (decision 7's precedence);
    returns the vault their secret values are read from."""
    vault = DatabaseVault(store.db)
    layer = await read_stored_layer(store, vault)
    settings.load_stored(layer.values, layer.version)
    return vault


def behaviours(
    providers: ModelProvider, call_budget_s: Callable[[], float]
) -> list[Behaviour[Any]]:
    """Every actor kind of SVC. `call_budget_s()` is the model-call time budget in force (a
    live setting), in seconds, 0 for none."""
    return [
        WorkspaceBehaviour(),
        ConversationBehaviour([providers], call_budget_s=call_budget_s),
        AgentBehaviour(),
        SettingsBehaviour(),
        *identity_behaviours(),
    ]


UNBOUNDED_CALLS_CLOSED_AFTER_S = 3600.0
"""When model calls had no time limit (SVC_LLM_CALL_TIMEOUT_S 0), replaced providers are
closed this long after the change, cutting off any call of theirs still running."""


@dataclass(frozen=True)
class HostConfig:
    """What every gateway keeps the Ray hosts in line with (docs/ray.md): the model
    settings, and the log level (`SVC_LOG_LEVEL`, live), each part kept from the sender that
    read the newer stored settings."""

    model: ModelConfig
    log_level: str = "info"
    log_read_at: int = 0
    """The version of the stored settings `log_level` was read at."""
    log_format: str = "text"
    """`SVC_LOG_FORMAT` of the gateway that made the host: fixed for the host's life."""

    def newest(self, sent: HostConfig) -> HostConfig:
        log_part = sent if sent.log_read_at >= self.log_read_at else self
        return HostConfig(
            self.model.newest(sent.model),
            log_part.log_level,
            log_part.log_read_at,
            self.log_format,
        )


def host_config(settings: Settings) -> HostConfig:
    return HostConfig(
        model_config(settings),
        settings.text("SVC_LOG_LEVEL"),
        settings.stored_version,
        settings.text("SVC_LOG_FORMAT"),
    )


class HostBehaviours:
    """What each Ray host runs: the actor kinds over the host's own model providers, built
    from `config`, at its log level. `reconfigure` (sent by the gateway: actors/ray/host.py)
    applies a new log level and swaps in providers for new model settings; turns under way
    finish on the old ones, closed once their call timeout has passed. Pickled with its
    settings only."""

    def __init__(self, config: HostConfig) -> None:
        self.config = config
        self._providers: ProviderSet | None = None
        self._closing: set[asyncio.Task[None]] = set()

    def __call__(self) -> list[Behaviour[Any]]:
        # In the host's process: to its Ray worker log, as its creator logs, at its level.
        log_to_stderr(self.config.log_format)
        apply_log_level(self.config.log_level)
        self._providers = ProviderSet.from_config(self.config.model)
        return behaviours(self._providers, lambda: self.config.model.call_timeout_s)

    def reconfigure(self, config: HostConfig) -> None:
        config = self.config.newest(config)
        built = self._providers
        # Built first: settings that cannot be built (FeatureDisabled) change nothing.
        fresh = (
            None
            if built is None or config.model.same_values(self.config.model)
            else build_providers(config.model)
        )
        if built is not None and config.log_level != self.config.log_level:
            apply_log_level(config.log_level)
        # Calls under way keep the time budget they started with: the old one.
        budget = self.config.model.call_timeout_s
        self.config = config  # not built yet: built from these settings
        if built is None or fresh is None:
            return
        previous = built.replace(fresh)
        delay = budget + 5.0 if budget > 0 else UNBOUNDED_CALLS_CLOSED_AFTER_S
        task = asyncio.ensure_future(_close_after(previous, delay))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def __reduce__(self) -> tuple[type[HostBehaviours], tuple[HostConfig]]:
        return (HostBehaviours, (self.config,))


async def _close_after(providers: Sequence[ModelProvider], delay_s: float) -> None:
    await asyncio.sleep(delay_s)
    await ProviderSet(providers).aclose()


def _table_options(settings: Settings) -> dict[str, Any]:
    return {
        "idle_s": float(settings.integer("SVC_ACTOR_IDLE_SEC")),
        "max_active": settings.integer("SVC_ACTOR_MAX_ACTIVE"),
    }


def _runtime(
    settings: Settings,
    dsn: str,
    store: PostgresEventStore,
    providers: ProviderSet,
    *,
    local_only: bool,
) -> ActorRuntime:
    if settings.text("SVC_ACTOR_RUNTIME") == "ray" and not local_only:
        return _ray_runtime(settings, dsn)
    budget = partial(call_budget_s, settings)
    table = ActivationTable(store, behaviours(providers, budget), **_table_options(settings))
    return LocalRuntime(table)


def ray_settings(settings: Settings) -> RaySettings:
    # Imported here: importing actors.ray imports Ray, which the local runtime never needs.
    from actors.ray import RaySettings

    return RaySettings(
        address=settings.text("SVC_RAY_ADDRESS").strip(),  # as its rule reads it
        cluster=settings.text("SVC_RAY_CLUSTER") or "svc",
        hosts=settings.integer("SVC_ACTOR_HOSTS") or None,
        store_pool_size=settings.integer("SVC_ACTOR_HOST_POOL_SIZE"),
        table_options=_table_options(settings),
    )


def ray_host_behaviours(settings: Settings) -> HostBehaviours:
    """The picklable factory each Ray host calls to build its actor kinds."""
    return HostBehaviours(host_config(settings))


def _ray_runtime(settings: Settings, dsn: str) -> ActorRuntime:
    from actors.ray import RayRuntime

    runtime = RayRuntime(dsn, ray_host_behaviours(settings), ray_settings(settings))
    runtime.configure(host_config(settings))  # hosts that exist may have older settings
    return runtime


async def ensure_workspace(
    runtime: ActorRuntime, workspace_id: str, name: str | None = None
) -> bool:
    """Create `workspace_id` through its actor when it does not exist. True when created.
    The command id is derived from the id, so racing processes create it once."""
    command = CreateWorkspace(
        command_id=service_command_id("create-workspace", workspace_id),
        workspace_id=workspace_id,
        name=name or workspace_id,
        at=datetime.now(UTC),
    )
    try:
        outcome = await runtime.ask(ActorKey(WORKSPACE_KIND, workspace_id), command)
    except Conflict:
        return False
    return bool(getattr(outcome, "events", ())) and not getattr(outcome, "duplicate", False)


def _initial_workspaces(settings: Settings) -> list[str]:
    """The default workspace, and the static compatible key's when that key is set."""
    out = [settings.default_workspace_id]
    compat = settings.text("SVC_NATIVE_COMPAT_WORKSPACE").strip()
    if settings.text("SVC_NATIVE_COMPAT_KEY") and compat and compat not in out:
        out.append(compat)
    return out


async def _flush_and_stop(
    runner: ProjectionRunner, report: ShutdownReport, wrote: Callable[[], Awaitable[bool]]
) -> None:
    """Bring the read models up to what was written, then stop. A CLI command that wrote
    nothing (a status, a replay, a refused argument) does not flush: it must not spend
    seconds projecting other processes' events after it has answered."""
    try:
        if await wrote():
            async with asyncio.timeout(PROJECTION_FLUSH_S):
                await runner.catch_up()
    except TimeoutError:
        report.projections_behind = f"not caught up within {PROJECTION_FLUSH_S:.0f} s"
    except Exception as exc:  # the database gone, most often: they catch up at next start
        reason = exc.message if isinstance(exc, SvcError) else type(exc).__name__
        report.projections_behind = f"not caught up: {reason}"
    await runner.stop()


async def _identity_up_to_date(projections: ProjectionRunner) -> None:
    """Bring the identity read model to the log's head before serving. Credentials are
    checked against it: one far behind (rebuilt from the log after a migration emptied it)
    would refuse every session and take users' keys for keys of no user."""
    log.info("bringing the identity read model up to date before serving")
    catching_up = asyncio.ensure_future(projections.catch_up(names=[IdentityProjector.name]))
    try:
        while not (await asyncio.wait({catching_up}, timeout=CATCH_UP_PROGRESS_EVERY_S))[0]:
            log.info("identity read model: %s", await _identity_lag(projections))
        await catching_up
    except ProjectionFailed as exc:
        # Serving goes on, degraded, as it would with the projector stopped while running.
        log.error("identity read model stopped: %s", exc)
    except EventFromNewerVersion as exc:
        # A rollback or a mixed deploy: the model stays where it is, as it would in a
        # running process, and credentials recorded before that event still work.
        log.error("identity read model waits on an event a newer version wrote: %s", exc)
    finally:
        await cancel_unless_done(catching_up)


CATCH_UP_PROGRESS_EVERY_S = 5.0
"""How often a start that waits on the identity read model says how far behind it is: a
read model rebuilt from a long log (after a migration emptied it) takes minutes."""


async def _identity_lag(projections: ProjectionRunner) -> str:
    try:
        (status,) = [s for s in await projections.status() if s.name == IdentityProjector.name]
    except StoreError as exc:
        return f"still catching up (its lag unknown: {exc.message})"
    more = "at least " if status.lag_at_least else ""
    return (
        f"still catching up, {more}{status.lag_events:,} events behind "
        f"(the oldest {status.lag_seconds:,.0f} s old)"
    )


async def _watch_settings(store: PostgresEventStore, service: SettingsService) -> None:
    """Apply changes made by other processes (the CLI, another gateway) as they commit."""
    types = [SettingChanged.type_name, SettingUnset.type_name]
    after: str | None = None
    stale = True  # until a refresh has succeeded since the last failure
    while True:
        try:
            if after is None:
                after = await store.head()
            if stale:
                await service.refresh()
                stale = False
            async for event in store.subscribe(
                after, workspace_id=INSTANCE_WORKSPACE_ID, types=types
            ):
                # A refresh that fails (the database away for a moment) is made again before
                # the next subscription: the start's first one too, which was not retried.
                stale = True
                changed = await service.refresh()
                stale = False
                after = event.cursor
                if changed:
                    log.info("settings changed: %s", ", ".join(changed))
            return
        except SubscriberTooSlow as exc:
            after = exc.last_cursor or after
            stale = True  # whatever the subscription dropped, a whole re-read covers
        except Exception as exc:
            log.warning("settings watcher: %s; retrying", exc)
            await asyncio.sleep(1.0)


async def _every(interval_s: float, job: Callable[[], Awaitable[object]], what: str) -> None:
    """Run `job` every `interval_s`. A database away is one line naming the job (the outage
    is logged elsewhere too); anything else, the job's defect, comes with its traceback."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            await job()
        except StoreUnavailable as exc:
            log.warning("%s: %s; trying again in %.0f s", what, exc, interval_s)
        except Exception:
            log.exception("%s failed; trying again in %.0f s", what, interval_s)


def _background(stack: AsyncExitStack, coro: Coroutine[Any, Any, None], name: str) -> None:
    stack.push_async_callback(cancel_and_wait, asyncio.create_task(coro, name=name))


def _apply_live(
    settings: Settings, providers: ProviderSet, runtime: ActorRuntime, *, serving: bool
) -> Callable[[str], None]:
    def on_change(key: str) -> None:
        if key.startswith("SVC_LLM_"):
            providers.apply_live(model_config(settings))
        if key == "SVC_LOG_LEVEL" and serving:
            # A stored level is the service's. A command's level is fixed at its start
            # (gateway/cli.py: warnings and errors, debug when its environment asks): one it
            # stored, or read in a refresh, printed INFO lines amid its own output.
            apply_log_level(settings.text("SVC_LOG_LEVEL"))
        if key.startswith("SVC_LLM_") or key == "SVC_LOG_LEVEL":
            runtime.configure(host_config(settings))  # the Ray hosts'; the local one ignores it

    return on_change


@asynccontextmanager
async def open_platform(settings: Settings, *, background: bool = True) -> AsyncIterator[Platform]:
    """Everything behind the gateway, opened in order and closed in reverse.
    `background=False` (the CLI) runs no projection loops and no watchers, and hosts the
    actors it asks in this process whatever SVC_ACTOR_RUNTIME says: a short command must
    not start or join Ray (with SVC_RAY_ADDRESS blank it would start a private Ray and
    create hosts). Its appends meet those of the Ray hosts at the store's version fence,
    as two gateways' would."""
    async with AsyncExitStack() as stack:
        report = ShutdownReport(settings.shutdown_grace_s)
        opened, dsn = await open_store(settings, stack, report)
        store, notifier, tailer = opened.store, opened.notifier, opened.tailer
        vault = await load_stored_settings(settings, store)
        cursors = await load_cursor_seal(store.db)
        providers = ProviderSet.from_config(model_config(settings))
        stack.push_async_callback(providers.aclose)
        projections = ProjectionRunner(store.db, default_projectors(), notifier=notifier)
        runtime = _runtime(settings, dsn, store, providers, local_only=not background)

        async def wrote() -> bool:
            return background or (await runtime.stats()).events_appended > 0

        stack.push_async_callback(_flush_and_stop, projections, report, wrote)
        await runtime.start()
        shutdown = Shutdown(runtime, settings.shutdown_grace_s, report)
        stack.push_async_callback(shutdown.stop_runtime)
        service = SettingsService(settings, runtime, store, vault, serving=background)
        settings.on_live_change(_apply_live(settings, providers, runtime, serving=background))
        # Who set each stored value, and when, for the listings; after the listener above,
        # so a live change another process made since the settings were loaded is applied.
        await service.refresh()
        for workspace in _initial_workspaces(settings):
            await ensure_workspace(runtime, workspace)
        limiter = RateLimiter(store.db)
        if background:
            await _identity_up_to_date(projections)
            await projections.start()
            _background(stack, _watch_settings(store, service), "svc-settings-watcher")
            prune = _every(PRUNE_EVERY_S, limiter.prune, "the rate limits' prune")
            _background(stack, prune, "svc-rate-limit-prune")
            sweep = AbandonedTurnSweep(settings, store.db, runtime).sweep
            swept = _every(SWEEP_EVERY_S, sweep, "the abandoned-turn sweep")
            _background(stack, swept, "svc-abandoned-turn-sweep")
        yield Platform(
            settings,
            store.db,
            store,
            tailer,
            runtime,
            projections,
            providers,
            service,
            limiter,
            shutdown,
            cursors,
        )
