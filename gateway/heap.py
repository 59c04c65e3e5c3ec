"""The cyclic garbage collector's settings for a serving process.

CPython collects its youngest generation every 700 net allocations of container objects
and, about every hundredth time, makes a full pass over every tracked object in the
process. A turn leaves some 125 such objects more than it frees by the time the count is
checked (requests, pydantic models, events and database records in flight), almost none
of them in reference cycles; at 32 turns in flight the collector ran about 500 times and
its full pass 4-5 times per 2,800 turns: 0.65-0.9 s of the gateway's one core, and pauses
that showed in the p99 (docs/performance.md, session 11).

What the process builds while it starts (modules, the application, settings, compiled
validators) lives until it exits, so it is moved out of the collector's view, and the
generations are collected less often. Reference counting still frees every object outside
a cycle at once, frozen or not; cycles made after startup are still collected, only later.
The cost: a frozen object that later becomes part of an unreachable cycle (a startup object
dropped from a cache while it refers back to itself, say) is never collected, as the
collector no longer looks at it. What startup builds is meant to live as long as the
process, so that stays a handful of objects."""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 10_000
OLDER_THRESHOLDS = (50, 100)


def settle_after_startup() -> None:
    """Call once the process is ready to serve: what exists now is permanent."""
    gc.collect()  # nothing already garbage is frozen with the rest
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, *OLDER_THRESHOLDS)
