"""What a wait on the read models that gave up tells the client (read-your-writes)."""

from __future__ import annotations

from collections.abc import Collection

from projections.runner import ProjectionRunner
from schemas.errors import Unavailable


def not_applied_by(
    runner: ProjectionRunner, names: Collection[str] | None, lagging: str
) -> Unavailable:
    """The error for a wait on `runner` that gave up: a stopped read model, or one waiting on
    an event a newer version wrote, which waiting cannot cure, is named as such; otherwise
    `lagging` says what to retry."""
    newer = runner.waiting_on_newer(names)
    if newer is not None:
        return newer  # 503 event_from_newer_version: "upgrade this process"
    stopped = runner.stopped(names)
    if stopped:
        return Unavailable(
            f"the read model(s) {', '.join(stopped)} stopped on an event they could not apply; "
            "an operator should run `svc projections status` (docs/projections.md says how "
            "to recover)",
            code="projection_failed",
        )
    return Unavailable(lagging, code="projection_lagging")
