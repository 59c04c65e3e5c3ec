"""TOTP (RFC 6238 over RFC 4226): SHA-1, 30-second steps, 6 digits, one step of clock drift.

A used step is remembered per secret for the process's life, so a code cannot be replayed
within its window on this process.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import struct
import time
from urllib.parse import quote, urlencode

STEP_S = 30
DIGITS = 6
DRIFT_STEPS = 1
_USED_MAX = 10_000


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


class TotpVerifier:
    def __init__(self) -> None:
        self._used: dict[tuple[str, int], None] = {}

    def verify(self, secret: str, code: str, at: float | None = None) -> bool:
        code = code.strip().replace(" ", "")
        if len(code) != DIGITS or not code.isdigit():
            return False
        step = int((time.time() if at is None else at) // STEP_S)
        fingerprint = hashlib.sha256(secret.encode()).hexdigest()
        for candidate in range(step - DRIFT_STEPS, step + DRIFT_STEPS + 1):
            if hmac.compare_digest(code_at(secret, candidate), code):
                if (fingerprint, candidate) in self._used:
                    return False
                if len(self._used) >= _USED_MAX:
                    self._used.clear()
                self._used[(fingerprint, candidate)] = None
                return True
        return False
