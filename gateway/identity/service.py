"""The identity subsystem's shared state, opened by `identity_ctx` after the platform.

It hosts the identity actor kinds and the identity projector. When the platform's own
activation table and projection runner already carry them (the wiring in
docs/identity-wiring.md), it uses those; otherwise it opens a second activation table over the
same event store and a second projection runner over the same database. Both are safe: the
store is the single-writer fence per stream and each projector has its own checkpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from actors.behaviour import ActorKey, CommandOutcome
from actors.identity import DIRECTORY_KIND, identity_behaviours
from actors.local import LocalRuntime
from actors.runtime import ActorRuntime
from actors.table import ActivationTable
from eventstore.cursor import encode_cursor
from eventstore.db import Database
from eventstore.reads import log_head
from eventstore.tasks import cancel_and_wait
from gateway.identity.throttle import LoginThrottle
from gateway.identity.totp import TotpVerifier
from gateway.identity.vault import IdentityVault
from gateway.projection_waits import not_applied_by
from gateway.settings import Settings
from gateway.state import DATABASE, PROJECTIONS, RUNTIME, SETTINGS, STORE
from projections.identity import IdentityProjector
from projections.identity_queries import prune_audit
from projections.runner import ProjectionRunner
from schemas.commands import Command

log = logging.getLogger(__name__)

APPLY_TIMEOUT_S = 5.0
AUDIT_PRUNE_EVERY_S = 24 * 3600.0
UNOWNED_KEYS_MAX = 10_000


class UnownedKeys:
    """API keys seen to belong to no user, whose requests then skip the check that their
    owner is still active (a statement per request otherwise).

    "No owner" never turns into "owner": a user's key is linked to the user, and the link
    projected (`Identity.ask`), before the key is handed out (`admin.issue_user_key`), and a
    link is never removed. So nobody can present a key that is unlinked now and linked later,
    and the set needs no expiry; it is only bounded (cleared when full)."""

    def __init__(self, max_entries: int = UNOWNED_KEYS_MAX) -> None:
        self._max_entries = max_entries
        self._keys: set[str] = set()

    def __contains__(self, key_id: object) -> bool:
        return key_id in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, key_id: str) -> None:
        if len(self._keys) >= self._max_entries:
            self._keys.clear()
        self._keys.add(key_id)


@dataclass
class Identity:
    settings: Settings
    db: Database
    runtime: ActorRuntime
    projections: ProjectionRunner
    vault: IdentityVault
    throttle: LoginThrottle
    totp: TotpVerifier
    unowned_keys: UnownedKeys = field(default_factory=UnownedKeys)
    extras: dict[str, Any] = field(default_factory=dict)
    """Lazily built helpers (the OIDC key cache, the SAML client), by name."""

    async def ask(self, key: ActorKey, command: Command) -> CommandOutcome:
        """Run `command` and wait until the identity read models show its events, so the
        caller's next lookup (a session, a role) already sees them."""
        outcome: CommandOutcome = await self.runtime.ask(key, command)
        if outcome.cursor:
            # Not `recorded=`: an identity change is often one step of several (a
            # deactivation then cuts off sessions and keys), which a retry completes.
            await self._applied(outcome.cursor)
        return outcome

    async def caught_up(self) -> None:
        """Wait until the identity read models show every event committed so far (the log's
        head now), another caller's included."""
        async with self.db.acquire(stateless=True) as conn:
            head = await log_head(conn)
        await self._applied(encode_cursor(head))

    async def _applied(self, cursor: str) -> None:
        names = [IdentityProjector.name]
        if not await self.projections.wait_for(cursor, APPLY_TIMEOUT_S, names=names):
            # Stopped on an event it cannot apply: said so, since retrying cannot help.
            raise not_applied_by(
                self.projections,
                names,
                "the identity read model did not catch up in time; retry shortly",
            )


IDENTITY: web.AppKey[Identity] = web.AppKey("svc_identity", Identity)


def identity(request: web.Request) -> Identity:
    return request.app[IDENTITY]


def _platform_hosts_identity(runtime: ActorRuntime) -> bool:
    """A local table says which kinds it hosts. Any other runtime (Ray hosts) builds its
    tables from gateway.bootstrap.behaviours(), which the wiring extends with the identity
    kinds: it is then trusted to host them (docs/identity-wiring.md)."""
    if isinstance(runtime, LocalRuntime):
        return DIRECTORY_KIND in runtime.table.kinds
    return True


async def _prune_audit_daily(db: Database, settings: Settings) -> None:
    while True:
        try:
            removed = await prune_audit(db, settings.integer("SVC_AUDIT_RETENTION_DAYS"))
            if removed:
                log.info("audit log: removed %d entries past retention", removed)
        except Exception:
            log.exception("audit log pruning failed; will retry")
        await asyncio.sleep(AUDIT_PRUNE_EVERY_S)


async def identity_ctx(app: web.Application) -> AsyncIterator[None]:
    """cleanup_ctx: must run after the platform's (gateway.app.platform_ctx)."""
    db, runtime, runner = app[DATABASE], app[RUNTIME], app[PROJECTIONS]
    own_runtime: LocalRuntime | None = None
    own_runner: ProjectionRunner | None = None
    if not _platform_hosts_identity(runtime):
        own_runtime = LocalRuntime(ActivationTable(app[STORE], identity_behaviours()))
        await own_runtime.start()
        runtime = own_runtime
    if IdentityProjector.name not in runner.names:
        own_runner = ProjectionRunner(db, [IdentityProjector()])
        await own_runner.start()
        runner = own_runner
    app[IDENTITY] = Identity(
        app[SETTINGS], db, runtime, runner, IdentityVault(db), LoginThrottle(db), TotpVerifier(db)
    )
    pruner = asyncio.create_task(_prune_audit_daily(db, app[SETTINGS]), name="svc-audit-prune")
    try:
        yield
    finally:
        await cancel_and_wait(pruner)
        if own_runtime is not None:
            await own_runtime.stop()
        if own_runner is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(5.0):
                    await own_runner.catch_up()
            await own_runner.stop()
