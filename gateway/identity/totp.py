"""TOTP (RFC 6238 over RFC 4226): SHA-1, 30-second steps, 6 digits, one step of clock drift.

A code is accepted once: each user's last used time step is kept in the database (migration
gateway/0101), shared by every gateway process, and only a later step's code is accepted.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import struct
import time
from typing import Literal
from urllib.parse import quote, urlencode

from eventstore.db import Database

STEP_S = 30
DIGITS = 6
DRIFT_STEPS = 1
_CLAIM_STEP = """
INSERT INTO identity_totp_last_step AS t (workspace_id, user_id, last_step) VALUES ($1, $2, $3)
ON CONFLICT (workspace_id, user_id) DO UPDATE SET last_step = excluded.last_step
WHERE t.last_step < excluded.last_step
RETURNING last_step
"""


def new_secret() -> str:
    return base64.b32encode(secrets.token_bytes(20)).decode("ascii").rstrip("=")


def _key(secret: str) -> bytes:
    padded = secret.upper() + "=" * (-len(secret) % 8)
    return base64.b32decode(padded)


def code_at(secret: str, step: int) -> str:
    digest = hmac.new(_key(secret), struct.pack(">Q", step), hashlib.sha1).digest()
    offset = digest[-1] & 0x0F
    value = struct.unpack(">I", digest[offset : offset + 4])[0] & 0x7FFFFFFF
    return str(value % 10**DIGITS).zfill(DIGITS)


def now_code(secret: str, at: float | None = None) -> str:
    return code_at(secret, int((time.time() if at is None else at) // STEP_S))


def provisioning_uri(secret: str, account: str, issuer: str = "SVC") -> str:
    label = quote(f"{issuer}:{account}")
    query = urlencode({"secret": secret, "issuer": issuer, "digits": DIGITS, "period": STEP_S})
    return f"otpauth://totp/{label}?{query}"


def matching_step(secret: str, code: str, at: float | None = None) -> int | None:
    """The time step within the allowed drift whose code `code` is, if any."""
    code = code.strip().replace(" ", "")
    # ASCII digits only: str.isdigit() also takes other scripts' digits (Arabic-Indic,
    # full-width, superscripts), which are no code and which hmac.compare_digest refuses
    # with a TypeError (non-ASCII str).
    if len(code) != DIGITS or not (code.isascii() and code.isdigit()):
        return None
    step = int((time.time() if at is None else at) // STEP_S)
    for candidate in range(step - DRIFT_STEPS, step + DRIFT_STEPS + 1):
        if hmac.compare_digest(code_at(secret, candidate), code):
            return candidate
    return None


class TotpVerifier:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def verify(
        self, workspace_id: str, user_id: str, secret: str, code: str, at: float | None = None
    ) -> bool:
        """Whether `code` is the user's current code and no code of this step or a later one
        was accepted before; accepting it records its step."""
        return await self.check(workspace_id, user_id, secret, code, at) == "accepted"

    async def check(
        self, workspace_id: str, user_id: str, secret: str, code: str, at: float | None = None
    ) -> TotpOutcome:
        """As `verify`, saying why a code is refused: not the current code (`wrong`), or one
        of a step already used (`reused`: the user should wait for the next)."""
        step = matching_step(secret, code, at)
        if step is None:
            return "wrong"
        async with self._db.acquire() as conn:
            claimed = await conn.fetchval(_CLAIM_STEP, workspace_id, user_id, step)
        return "reused" if claimed is None else "accepted"


TotpOutcome = Literal["accepted", "wrong", "reused"]

REUSED = f"this TOTP code was already used: wait for the next one (codes change every {STEP_S} s)"
"""The refusal of a code of a step already used, for whoever holds the authenticator."""
