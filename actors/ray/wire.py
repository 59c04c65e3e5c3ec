"""What crosses the Ray boundary between a router and a host, besides commands and items.

Host methods never raise for a command's own failure: they return a `Failure`, so the
router re-raises the project's original error (class, message, code and attributes) rather
than a `RayTaskError` wrapper the gateway's error mapping would not recognise. Exceptions
raised by Ray itself (a dead or unreachable host) are the router's to retry.
"""

from __future__ import annotations

import logging
import pickle
from dataclasses import dataclass
from typing import Any

from schemas.errors import SvcError

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WrongEpoch:
    """The host does not hold `shard` at `epoch` (it moved, is moving, or the router's map
    is stale): nothing ran; reload the map and route again."""

    shard: int
    epoch: int
    held: int | None


@dataclass(frozen=True, slots=True)
class Ok:
    value: Any


@dataclass(frozen=True, slots=True)
class Failure:
    error_type: type[BaseException]
    message: str
    state: dict[str, Any]

    def rebuild(self) -> BaseException:
        if issubclass(self.error_type, SvcError):
            # SvcError subclasses take varying constructor arguments; rebuild without calling
            # them, exactly as raised on the host.
            error: BaseException = self.error_type.__new__(self.error_type)
            Exception.__init__(error, self.message)
            error.__dict__.update(self.state)
            return error
        try:
            return self.error_type(self.message)
        except Exception:
            return SvcError(f"{self.error_type.__name__} on an actor host: {self.message}")


def pack_error(error: BaseException) -> Failure:
    if not isinstance(error, SvcError) or error.internal:
        # A fault of the code (a behaviour's `None.x`, a turn that crashed on one): its
        # traceback, and the cause chained to it, stay on this side of the wire, where the
        # gateway's log of it cannot reach: logged here, in the host's log.
        log.error("a command failed on this actor host", exc_info=error)
    if isinstance(error, SvcError):
        state = {k: v for k, v in error.__dict__.items() if _picklable(v)}
        return Failure(type(error), error.message, state)
    return Failure(type(error), str(error), {})


def ray_failure_summary(error: BaseException) -> str:
    """One line for a failure Ray raised, whose str() is a whole traceback: the host's own
    exception where Ray carries it (a RayTaskError's `cause`; a nested remote call's, its
    own cause in turn), else the last line of Ray's text, the `SomeError: message` line its
    tracebacks end with."""
    cause = getattr(error, "cause", None)
    if isinstance(cause, BaseException) and cause is not error:
        if hasattr(cause, "cause"):
            return ray_failure_summary(cause)
        return f"{type(cause).__name__}: {' '.join(_lines(cause))}"[:400]
    lines = _lines(error)
    return (lines[-1] if lines else type(error).__name__)[:400]


def _lines(error: BaseException) -> list[str]:
    """The non-blank lines of `error`'s text, control characters made spaces."""
    printable = (
        "".join(c if c.isprintable() else " " for c in line.strip())
        for line in str(error).splitlines()
    )
    return [line for line in printable if line]


def _picklable(value: Any) -> bool:
    try:
        pickle.dumps(value)
    except Exception:
        return False
    return True


@dataclass(frozen=True, slots=True)
class HostStatus:
    name: str
    node: str
    pid: int
    shards: int
    active_actors: int
    commands_per_s: float
    in_flight: int
    log_level: str = "info"
    """The level the host's own loggers log at (the gateways send SVC_LOG_LEVEL)."""
