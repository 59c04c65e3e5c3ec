"""What sealing a cursor costs (gateway/cursor_seal.py), beside the plain encoding it wraps:

    python bench/cursor_seal.py          # best of 5 repeats of 200,000 calls each

A feed frame seals its event's log point once per process (the frame cache); a chat turn
seals its internal cursor string once; a request bringing a cursor opens it once.
"""

from __future__ import annotations

import argparse
import os
import timeit
from collections.abc import Callable

from eventstore.cursor import LogPoint, decode_cursor, encode_cursor
from gateway.cursor_seal import CursorSeal


def microseconds(call: Callable[[], object], number: int, repeat: int) -> float:
    return min(timeit.repeat(call, number=number, repeat=repeat)) / number * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--number", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    seal = CursorSeal(os.urandom(16))
    point = LogPoint(123_456_789, 987_654_321)
    internal = encode_cursor(point)
    public = seal.seal_point(point)
    cases: dict[str, Callable[[], object]] = {
        "plain encode_cursor(point)": lambda: encode_cursor(point),
        "plain decode_cursor(cursor)": lambda: decode_cursor(internal),
        "seal_point(point) (a feed frame)": lambda: seal.seal_point(point),
        "seal(cursor) (a chat turn's header)": lambda: seal.seal(internal),
        "open(public) (a request's cursor)": lambda: seal.open(public),
    }
    print(f"# {os.cpu_count()} CPUs; best of {args.repeat} x {args.number:,} calls")
    for name, call in cases.items():
        print(f"{name:40s} {microseconds(call, args.number, args.repeat):6.2f} us")


if __name__ == "__main__":
    main()
