"""Prometheus gauges of the projections, registered in the default registry at import.

Labelled by projection name only: a projector's name is configuration, never tenant data.
"""

from __future__ import annotations

from prometheus_client import Gauge

LAG_EVENTS = Gauge(
    "svc_projection_lag_events",
    "Committed events in the log after the projection's checkpoint, counted up to a bound "
    "(100000): a value at the bound means at least that many.",
    ["projection"],
)
LAG_SECONDS = Gauge(
    "svc_projection_lag_seconds",
    "Age of the oldest committed event the projection has not applied yet; 0 when caught up.",
    ["projection"],
)
STALLED = Gauge(
    "svc_projection_stalled",
    "1 while the projection is stopped on an event it cannot apply (see the log), else 0.",
    ["projection"],
)


def record_lag(name: str, events: int, seconds: float, stalled: bool) -> None:
    LAG_EVENTS.labels(projection=name).set(events)
    LAG_SECONDS.labels(projection=name).set(seconds)
    STALLED.labels(projection=name).set(1 if stalled else 0)
