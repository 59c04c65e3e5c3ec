"""The projections' own errors."""

from __future__ import annotations

from schemas.errors import Unavailable


class ProjectionFailed(Unavailable):
    """A projection is stopped on an event it cannot apply; its read model is stale."""

    default_code = "projection_failed"
