"""Per-key request limits (`rate_limit_rpm`), exact across processes sharing the database.

The window is a fixed minute aligned to the epoch minute of the database clock
(`date_trunc('minute', now())`). Every request of a limited key runs one atomic
`INSERT ... ON CONFLICT DO UPDATE SET count = count + 1 RETURNING count`: PostgreSQL serialises
the increments on the row, so with N concurrent requests exactly `rate_limit_rpm` of them see
a count within the limit, whichever gateway process they reached. Rejected requests count
too (they are requests); the counter restarts at the next minute. A fixed window admits at
most 2 x rpm around a minute boundary; that is the documented trade for one row per key and
minute (docs/gateway-platform.md, "Per-key rate limits").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from eventstore.db import Database
from schemas.errors import RateLimited

WINDOW_S = 60
KEEP_WINDOWS_S = 180

_HIT = """
INSERT INTO rate_limit_windows AS w (key_id, window_start, count)
VALUES ($1, date_trunc('minute', now()), 1)
ON CONFLICT (key_id, window_start) DO UPDATE SET count = w.count + 1
RETURNING w.count, extract(epoch FROM now() - w.window_start)::float8 AS elapsed
"""

_PRUNE = "DELETE FROM rate_limit_windows WHERE window_start < now() - make_interval(secs => $1)"


@dataclass(frozen=True, slots=True)
class RateDecision:
    limit: int
    count: int
    reset_after_s: float

    @property
    def allowed(self) -> bool:
        return self.count <= self.limit

    @property
    def remaining(self) -> int:
        return max(0, self.limit - self.count)

    def headers(self) -> dict[str, str]:
        """The common convention: limit, remaining in this window, seconds until it resets."""
        return {
            "X-RateLimit-Limit": str(self.limit),
            "X-RateLimit-Remaining": str(self.remaining),
            "X-RateLimit-Reset": str(math.ceil(self.reset_after_s)),
        }


class RateLimitExceeded(RateLimited):
    def __init__(self, decision: RateDecision) -> None:
        super().__init__(
            f"rate limit exceeded: this key allows {decision.limit} requests per minute; "
            f"retry in {math.ceil(decision.reset_after_s)} s",
            retry_after_s=decision.reset_after_s,
        )
        self.headers = decision.headers()


class RateLimiter:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def hit(self, key_id: str, limit: int) -> RateDecision:
        # One statement, no session state left behind: the pool may skip its reset query.
        async with self._db.acquire(stateless=True) as conn:
            row = await conn.fetchrow(_HIT, key_id)
        reset_after = max(0.0, WINDOW_S - float(row["elapsed"]))
        return RateDecision(limit=limit, count=int(row["count"]), reset_after_s=reset_after)

    async def check(self, key_id: str, limit: int) -> RateDecision:
        """Count one request; raise `RateLimitExceeded` (429) when it is over the limit."""
        decision = await self.hit(key_id, limit)
        if not decision.allowed:
            raise RateLimitExceeded(decision)
        return decision

    async def prune(self) -> int:
        async with self._db.acquire(stateless=True) as conn:
            status: str = await conn.execute(_PRUNE, float(KEEP_WINDOWS_S))
        return int(status.rsplit(" ", 1)[-1])
