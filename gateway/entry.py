"""The `svc` console script. It loads nothing but this module before its `try`: a Ctrl-C
while the CLI's modules load (a second or two on a cold start), or while it reads its
arguments and settings before its own handling begins, ends the process with 130 and no
traceback, as one does once a command runs."""

from __future__ import annotations


def main() -> int:
    try:
        from gateway.cli import main as run

        return run()
    except KeyboardInterrupt:  # QA: one came while the parser was built, and was a traceback
        return 130
