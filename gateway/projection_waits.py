"""What a wait on the read models that gave up tells the client (read-your-writes)."""

from __future__ import annotations

from collections.abc import Collection

from projections.runner import ProjectionRunner
from schemas.errors import Unavailable


def not_applied_by(
    runner: ProjectionRunner,
    names: Collection[str] | None,
    lagging: str,
    *,
    recorded: str | None = None,
) -> Unavailable:
    """The error for a wait on `runner` that gave up: a stopped read model, or one waiting on
    an event a newer version wrote, which waiting cannot cure, is named as such; otherwise
    `lagging` says what to retry.

    `recorded` says what the request wrote before it waited: it opens every answer, so a
    client told to upgrade or to call an operator still learns its write landed, and such
    an answer says `x-should-retry: false` (a retry would write it again)."""
    newer = runner.waiting_on_newer(names)
    if newer is not None:
        # A new error each time: the runner's is shared, and each raise would grow its
        # traceback with the frames of every request that met it.
        return _after(recorded, newer.message, "event_from_newer_version")
    stopped = runner.stopped(names)
    if stopped:
        return _after(
            recorded,
            f"the read model(s) {', '.join(stopped)} stopped on an event they could not "
            "apply; an operator should run `svc projections status` (docs/projections.md "
            "says how to recover)",
            "projection_failed",
        )
    return _after(recorded, lagging, "projection_lagging")


def _after(recorded: str | None, reason: str, code: str) -> Unavailable:
    error = Unavailable(reason if recorded is None else f"{recorded}; {reason}", code=code)
    error.final = recorded is not None
    return error
