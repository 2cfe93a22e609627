"""Start a program with environment values that never appear on a command line (stdlib only).

Runs on a node as ``python -c <this file> PROGRAM ARGS…`` with one JSON line on
stdin before anything else: ``{"NAME": "value", …}``. It reads exactly that line
(byte by byte, so not one byte of what follows is consumed: the program still
gets the rest of stdin, a collector's source or an agent's commands), adds the
values to the environment and replaces itself with ``PROGRAM``. The values
travel in the pipe, so no ``ps`` and no ``/proc/*/cmdline`` on the node or the
controller ever shows them; ``/proc/<pid>/environ`` is readable by the same
user only.
"""

import json
import os
import sys


def read_line(fd: int = 0, limit: int = 1 << 20) -> bytes:
    """One line from ``fd`` without reading past its newline."""
    out = bytearray()
    while len(out) < limit:
        b = os.read(fd, 1)
        if not b or b == b"\n":
            return bytes(out)
        out += b
    raise SystemExit("hetctl envexec: environment line longer than %d bytes" % limit)


def main(argv: list) -> None:
    if not argv:
        raise SystemExit("hetctl envexec: no program to run")
    env = json.loads(read_line() or b"{}")
    os.environ.update({str(k): str(v) for k, v in env.items()})
    try:
        os.execvp(argv[0], argv)
    except OSError as e:
        sys.stderr.write("hetctl: cannot run %s: %s\n" % (argv[0], e.strerror))
        raise SystemExit(127) from None


if __name__ == "__main__":
    main(sys.argv[1:])
