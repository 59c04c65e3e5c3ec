"""The project's error tree.

Every error a client can cause or observe is an `SvcError`. Each class carries the HTTP
status, the envelope `type` and a default `code`; the gateway's one error middleware turns
any `SvcError` into the spec's envelope `{"error": {"message", "type", "code"}}`. Messages
must be safe to show a person: never include a secret, key, token or password.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable


class SvcError(Exception):
    http_status: int = 500
    error_type: str = "server_error"
    default_code: str = "internal_error"
    recorded_cursor: str | None = None
    """Set on a failure the log records (a failed turn): the cursor of the event recording
    it, which a client may wait for (`?min_cursor=`) as for a success."""
    final: bool = False
    """The same request will get this same answer again (a recorded failure replayed)."""
    retry_after_s: float | None = None
    """When to ask again, if the error knows (a rate limit's window, a model server's own
    `Retry-After`, a busy actor): the answer's `Retry-After`."""

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code or self.default_code

    @property
    def internal(self) -> bool:
        """A failure of the service itself (status 500), whose message may carry internal
        detail (a failed query's): no client is shown it, and no record keeps it. A final one
        is a recorded failure answered again, whose recorded message is the generic one."""
        return self.http_status == 500 and not self.final


class InvalidInput(SvcError):
    http_status = 400
    error_type = "invalid_request_error"
    default_code = "invalid_request"


class Unauthorized(SvcError):
    http_status = 401
    error_type = "authentication_error"
    default_code = "unauthorized"


class Forbidden(SvcError):
    http_status = 403
    error_type = "permission_error"
    default_code = "forbidden"


class NotFound(SvcError):
    http_status = 404
    error_type = "invalid_request_error"
    default_code = "not_found"


class Conflict(SvcError):
    http_status = 409
    error_type = "conflict_error"
    default_code = "conflict"


class PayloadTooLarge(SvcError):
    http_status = 413
    error_type = "invalid_request_error"
    default_code = "payload_too_large"


UNSUPPORTED_ENCODING_MESSAGE = (
    "the request's Content-Encoding is not one this service decodes: send the body "
    "uncompressed, or in one of gzip or deflate"
)


class UnsupportedEncoding(SvcError):
    """A request body in a Content-Encoding the service does not decode."""

    http_status = 415
    error_type = "invalid_request_error"
    default_code = "unsupported_media_type"


class RequestTimeout(SvcError):
    """The client took too long to send its request's body; the connection is closed after
    the answer (what is left of the body may still be on its way)."""

    http_status = 408
    error_type = "invalid_request_error"
    default_code = "request_timeout"


class RateLimited(SvcError):
    http_status = 429
    error_type = "rate_limit_error"
    default_code = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after_s: float, code: str | None = None) -> None:
        super().__init__(message, code=code)
        self.retry_after_s = retry_after_s


class FeatureDisabled(SvcError):
    http_status = 501
    error_type = "invalid_request_error"
    default_code = "feature_disabled"


class UpstreamError(SvcError):
    http_status = 502
    error_type = "upstream_error"
    default_code = "upstream_error"


UPSTREAM_REQUEST_PROBLEMS = frozenset(
    {
        "context_length_exceeded",
        "string_above_max_length",
        "content_policy_violation",
        "invalid_prompt",
    }
)
"""Error codes of a model server's HTTP 400 (OpenAI's) that name a problem of the request the
client sent (too long, refused content): the client's 400 `invalid_request_error` with that
code, not the server's 502, so the SDKs raise BadRequestError with the code and do not retry.
A 400 with any other code stays `upstream_rejected`."""


class UpstreamTimeout(SvcError):
    http_status = 504
    error_type = "upstream_error"
    default_code = "ErrCallTimeout"


class Unavailable(SvcError):
    http_status = 503
    error_type = "server_error"
    default_code = "unavailable"


_PLAIN = re.compile(r"[A-Za-z0-9_.:\-\[\]]{1,64}")


def nearest(word: str, choices: Iterable[str]) -> str:
    """` (did you mean X?)` for the choice closest to a mistyped `word`, or nothing."""
    near = closest(word, choices)
    return f" (did you mean {near}?)" if near else ""


def closest(word: str, choices: Iterable[str]) -> str | None:
    """The choice closest to a mistyped `word`, if any is close."""
    near = difflib.get_close_matches(word, list(choices), n=1)
    return near[0] if near else None


PEM_PRIVATE_KEY = re.compile(r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----")
"""The opening line of a PEM private key, of any kind (PKCS#8, RSA, EC, encrypted)."""

SECRET_SHAPED = re.compile(rf"svc_[A-Za-z0-9_-]{{40,}}|{PEM_PRIVATE_KEY.pattern}")
"""The form of the service's API keys, SCIM tokens and OAuth client secrets, and of a PEM
private key (pasted where a certificate goes)."""


def secret_shaped(text: str) -> bool:
    return SECRET_SHAPED.search(text) is not None


NOT_REPEATED = "(a value of the form of an API key or token, not repeated)"


def echoed(text: str) -> str:
    """Something a client sent (an id, a parameter's name) as a message quotes it: a plain
    word as written; anything else quoted, its control characters escaped, and cut short
    (a 404 for an id of 3,000 characters said all 3,000). A key or token pasted into the
    wrong field is not said back: an answer may be logged where the access log's
    redaction does not reach."""
    if _PLAIN.fullmatch(text) and not secret_shaped(text):
        return text
    return quoted(text)


def quoted(text: str) -> str:
    """As `echoed`, always in quotes (`'gpt-4o'`, as OpenAI's messages quote a model)."""
    if secret_shaped(text):
        return NOT_REPEATED
    if len(text) <= 64:
        return repr(text)
    return f"{text[:64]!r}... ({len(text):,} characters)"
