"""Password hashing with scrypt from the standard library (RFC 7914).

Stored form: `scrypt$<n>$<r>$<p>$<salt b64>$<hash b64>`, so the cost can be raised later and
old hashes still verify. n=2**15, r=8, p=1 costs 32 MiB and tens of milliseconds per check;
hashing runs in a worker thread so the event loop keeps serving.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import hashlib
import hmac
import secrets

N, R, P = 2**15, 8, 1
SALT_BYTES = 16
DK_BYTES = 32
MIN_LENGTH = 8
MAX_LENGTH = 1024
_MAXMEM = 64 * 1024 * 1024

BLANK = "must not be white space only"
"""Why a password of spaces (or tabs) alone is refused: eight spaces pass the length rule,
and are the first thing a guesser tries after the empty one."""


def is_blank(password: str) -> bool:
    return not password.strip()


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def _derive(password: str, salt: bytes, n: int, r: int, p: int) -> bytes:
    return hashlib.scrypt(
        password.encode("utf-8"), salt=salt, n=n, r=r, p=p, maxmem=_MAXMEM, dklen=DK_BYTES
    )


def hash_password_sync(password: str) -> str:
    salt = secrets.token_bytes(SALT_BYTES)
    return f"scrypt${N}${R}${P}${_b64(salt)}${_b64(_derive(password, salt, N, R, P))}"


def verify_password_sync(password: str, stored: str) -> bool:
    try:
        scheme, n, r, p, salt, expected = stored.split("$")
        if scheme != "scrypt":
            return False
        derived = _derive(password, base64.b64decode(salt), int(n), int(r), int(p))
    except (ValueError, MemoryError):
        return False
    return hmac.compare_digest(derived, base64.b64decode(expected))


@functools.cache
def _dummy_hash() -> str:
    """What an unknown user's password is checked against. Made on first use, not at import:
    one scrypt, which every `svc` command would otherwise pay."""
    return hash_password_sync(secrets.token_urlsafe(16))


async def hash_password(password: str) -> str:
    return await asyncio.to_thread(hash_password_sync, password)


async def verify_password(password: str, stored: str | None) -> bool:
    """Constant work whether or not the account exists: an unknown user costs one scrypt too."""
    # The dummy is made in the worker too: its first use is a scrypt, which on the loop
    # would stall every request of the process.
    ok = await asyncio.to_thread(lambda: verify_password_sync(password, stored or _dummy_hash()))
    return ok and stored is not None
