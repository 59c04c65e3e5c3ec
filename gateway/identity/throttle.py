"""Failed-login limits per account and per client address, shared by every gateway process.

Only failures count. They go into the gateway's fixed-minute windows (`rate_limit_windows`,
gateway/ratelimit.py) under `login-fail:` keys, summed over the last `WINDOW_MINUTES` (the
gateway's pruner keeps three minutes of windows); an account or an address with too many
recent failures is refused with 429 before its password is checked.
"""

from __future__ import annotations

import hashlib

from eventstore.db import Database
from schemas.errors import RateLimited

MAX_PER_ACCOUNT = 5
MAX_PER_ADDRESS = 20
WINDOW_MINUTES = 2

_COUNT = """
SELECT coalesce(sum(count), 0)::int FROM rate_limit_windows
WHERE key_id = $1 AND window_start > now() - make_interval(mins => $2)
"""
_HIT = """
INSERT INTO rate_limit_windows AS w (key_id, window_start, count)
VALUES ($1, date_trunc('minute', now()), 1)
ON CONFLICT (key_id, window_start) DO UPDATE SET count = w.count + 1
"""
_CLEAR = "DELETE FROM rate_limit_windows WHERE key_id = $1"


def _account_key(workspace_id: str, user_name: str) -> str:
    digest = hashlib.sha256(f"{workspace_id}\0{user_name.casefold()}".encode()).hexdigest()
    return f"login-fail:acct:{digest[:32]}"


def _address_key(address: str) -> str:
    return f"login-fail:ip:{address}"


class LoginThrottle:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def check(self, workspace_id: str, user_name: str, address: str) -> None:
        async with self._db.acquire() as conn:
            account = await conn.fetchval(
                _COUNT, _account_key(workspace_id, user_name), WINDOW_MINUTES
            )
            by_address = await conn.fetchval(_COUNT, _address_key(address), WINDOW_MINUTES)
        if account >= MAX_PER_ACCOUNT or by_address >= MAX_PER_ADDRESS:
            raise RateLimited(
                "too many failed logins; try again in a few minutes",
                retry_after_s=60.0,
                code="login_rate_limited",
            )

    async def failed(self, workspace_id: str, user_name: str, address: str) -> None:
        async with self._db.acquire() as conn:
            await conn.execute(_HIT, _account_key(workspace_id, user_name))
            await conn.execute(_HIT, _address_key(address))

    async def succeeded(self, workspace_id: str, user_name: str) -> None:
        async with self._db.acquire() as conn:
            await conn.execute(_CLEAR, _account_key(workspace_id, user_name))
