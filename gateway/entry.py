"""The `svc` console script. It loads nothing but this module before its `try`: a Ctrl-C
while the CLI's modules load (a second or two on a cold start) ends the process with 130
and no traceback, as one does once they are loaded."""

from __future__ import annotations


def main() -> int:
    try:
        from gateway.cli import main as run
    except KeyboardInterrupt:
        return 130
    return run()
