"""Failed-login limits per account and per client address, shared by every gateway process.

Attempts go into the gateway's fixed-minute windows (`rate_limit_windows`,
gateway/ratelimit.py) under `login-fail:` keys, summed over the last `WINDOW_MINUTES` (the
gateway's pruner keeps three minutes of windows). `reserve` counts an attempt *before* its
password is checked, atomically, so a burst of parallel guesses cannot all pass a check made
before any of them failed; an attempt over the limit is refused with 429 (and not counted).
A success gives its reservation back (`succeeded`, which also clears the account's count), so
in effect only failures count.

The account key is the login normalised the way directories compare it (case, surrounding and
repeated spaces, Unicode compatibility forms): `Alice`, ` alice ` and its full-width form share one
count. A directory whose user filter matches more than one attribute (`uid` or `mail`) reaches
one entry under several names; once the search has named the entry, the attempt is counted
under the entry's own login too (`count_also`), so every name of an account shares its limit.
An IPv6 client counts by its /64, which one host usually holds whole.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from datetime import datetime

from eventstore.db import Connection, Database
from gateway.security import address_group
from schemas.errors import RateLimited
from schemas.identity import user_name_key

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
RETURNING window_start
"""
_UNDO = """
UPDATE rate_limit_windows SET count = count - 1
WHERE key_id = $1 AND window_start = $2 AND count > 0
"""
_CLEAR = "DELETE FROM rate_limit_windows WHERE key_id = $1"
_WINDOWS = """
SELECT count, extract(epoch FROM window_start + make_interval(mins => $2) - now())::float8
FROM rate_limit_windows
WHERE key_id = $1 AND window_start > now() - make_interval(mins => $2) AND count > 0
ORDER BY window_start
"""
"""The counted windows of a key, oldest first, with the seconds until each stops counting."""


def account_key(workspace_id: str, user_name: str) -> str:
    digest = hashlib.sha256(f"{workspace_id}\0{user_name_key(user_name)}".encode()).hexdigest()
    return f"login-fail:acct:{digest[:32]}"


def address_key(address: str) -> str:
    return f"login-fail:ip:{address_group(address)}"


async def _until_under(conn: Connection, key: str, limit: int) -> float:
    """Seconds until `key`'s counted attempts leave room for one more (0: they do now). Its
    windows stop counting oldest first, each WINDOW_MINUTES after it began."""
    windows = await conn.fetch(_WINDOWS, key, WINDOW_MINUTES)
    counted = sum(count for count, _ in windows)
    wait_s = 0.0
    for count, left_s in windows:
        if counted < limit:
            break
        counted -= count
        wait_s = left_s
    return float(math.ceil(wait_s))


@dataclass(slots=True)
class Reservation:
    """One counted login attempt: the keys it was counted under and the windows it went to.
    `also` holds the further account keys `count_also` added, in the order counted (the one
    part that changes: not frozen, so as not to claim otherwise)."""

    account: str
    address: str
    account_window: datetime
    address_window: datetime
    also: list[tuple[str, datetime]] = field(default_factory=list)


class LoginThrottle:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def reserve(self, workspace_id: str, user_name: str, address: str) -> Reservation:
        """Count one attempt, or refuse it with 429 when the account or the address already
        has its limit of recent failures (or attempts in flight)."""
        account, by_address = account_key(workspace_id, user_name), address_key(address)
        async with self._db.acquire() as conn, conn.transaction():
            account_window = await conn.fetchval(_HIT, account)
            address_window = await conn.fetchval(_HIT, by_address)
            account_count = await conn.fetchval(_COUNT, account, WINDOW_MINUTES)
            address_count = await conn.fetchval(_COUNT, by_address, WINDOW_MINUTES)
            over = account_count > MAX_PER_ACCOUNT or address_count > MAX_PER_ADDRESS
            if over:
                await conn.execute(_UNDO, account, account_window)
                await conn.execute(_UNDO, by_address, address_window)
                wait_s = max(
                    await _until_under(conn, account, MAX_PER_ACCOUNT),
                    await _until_under(conn, by_address, MAX_PER_ADDRESS),
                )
        if over:
            raise _too_many(wait_s)
        return Reservation(account, by_address, account_window, address_window)

    async def count_also(self, attempt: Reservation, workspace_id: str, user_name: str) -> None:
        """Count `attempt` under `user_name`'s account as well (nothing more when that is the
        key it was reserved under). Over that account's limit the attempt is refused with 429
        and given back everywhere it was counted."""
        key = account_key(workspace_id, user_name)
        if key == attempt.account or any(key == counted for counted, _ in attempt.also):
            return
        async with self._db.acquire() as conn, conn.transaction():
            window = await conn.fetchval(_HIT, key)
            over = await conn.fetchval(_COUNT, key, WINDOW_MINUTES) > MAX_PER_ACCOUNT
            if over:
                counted = [(key, window), *_counted(attempt)]
                for each_key, each_window in counted:
                    await conn.execute(_UNDO, each_key, each_window)
                wait_s = await _until_under(conn, key, MAX_PER_ACCOUNT)
        if over:
            raise _too_many(wait_s)
        attempt.also.append((key, window))

    async def unanswered(self, reservation: Reservation) -> None:
        """The password could not be checked (the directory was down): the account gets
        the attempt back, and its earlier failures stay. The address keeps it: while the
        directory is down a local name answers 401 and any other 503, and probing names
        so must stay within the address's limit (review finding)."""
        async with self._db.acquire() as conn:
            for key, window in _counted(reservation):
                if key != reservation.address:
                    await conn.execute(_UNDO, key, window)

    async def failed(self, reservation: Reservation) -> None:
        """The attempt failed: it stays counted (nothing to do; kept for the reader)."""

    async def succeeded(self, reservation: Reservation) -> None:
        """The attempt succeeded: the account's failures are forgiven and the address gets
        this attempt back."""
        async with self._db.acquire() as conn:
            for account in (reservation.account, *(key for key, _ in reservation.also)):
                await conn.execute(_CLEAR, account)
            await conn.execute(_UNDO, reservation.address, reservation.address_window)


def _counted(attempt: Reservation) -> list[tuple[str, datetime]]:
    return [
        (attempt.account, attempt.account_window),
        (attempt.address, attempt.address_window),
        *attempt.also,
    ]


def _too_many(wait_s: float) -> RateLimited:
    return RateLimited(
        "too many failed logins; try again in a few minutes",
        retry_after_s=max(1.0, wait_s),
        code="login_rate_limited",
    )
