"""How a background loop that retries against the database logs an outage: its first failure
as a warning, then one line a minute while it lasts, and one line when it is over.

A loop retrying every half second logged a warning each time (about a hundred lines a minute
per loop while the database was down) and never said when it came back.
"""

from __future__ import annotations

import logging
import time

OUTAGE_REMINDER_S = 60.0


def doubling_backoff(first_s: float, cap_s: float, failures: int) -> float:
    """The wait after the n-th failure in a row: doubling from `first_s`, at most `cap_s`.
    The exponent is capped too: an outage of half an hour is a thousand failures, and
    2.0 ** 1024 does not fit a float (the tailer once died of the OverflowError for good)."""
    return min(cap_s, first_s * 2.0 ** min(failures, 32))


class OutageLog:
    def __init__(self, logger: logging.Logger, what: str) -> None:
        self._log = logger
        self._what = what
        self.failures = 0
        self._last_warned = 0.0

    def failed(self, exc: BaseException) -> None:
        """One more failure in a row: a warning for the first, and a minute after the last."""
        self.failures += 1
        now = time.monotonic()
        remind = self.failures == 1 or now - self._last_warned >= OUTAGE_REMINDER_S
        if remind:
            self._last_warned = now
        self._log.log(
            logging.WARNING if remind else logging.DEBUG,
            "%s failed (%d in a row)%s: %s: %s",
            self._what,
            self.failures,
            ", retrying" if remind else "",
            type(exc).__name__,
            exc,
        )

    def succeeded(self) -> None:
        """The loop works again: said once, after a failure."""
        if self.failures:
            failures = "1 failure" if self.failures == 1 else f"{self.failures} failures"
            self._log.info("%s works again after %s", self._what, failures)
            self.failures = 0
