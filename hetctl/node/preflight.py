"""Pre-flight of one node before an attempt starts: runs there as ``python -c`` (stdlib only).

Arguments: ``WORKDIR WANT_PORT MODULES`` (MODULES comma-separated). Prints one JSON
line: the python version and executable, the workdir as the node expands it and
whether it is writable (proved by creating a file), which modules are importable
(found, not imported: cheap), and with WANT_PORT=1 a free TCP port for the
rendezvous.
"""

import importlib.util
import json
import os
import socket
import sys
import tempfile


def main(argv: list) -> dict:
    wd = os.path.abspath(os.path.expanduser(argv[0]))
    r = {"python": sys.version.split()[0], "executable": sys.executable, "workdir": wd, "writable": False}
    try:
        os.makedirs(wd, exist_ok=True)
        fd, p = tempfile.mkstemp(dir=wd, prefix=".hetctl-probe-")
        os.close(fd)
        os.unlink(p)
        r["writable"] = True
    except OSError as e:
        r["error"] = "%s: %s" % (e.filename or wd, e.strerror)
    mods = {}
    for m in filter(None, argv[2].split(",")):
        try:
            mods[m] = importlib.util.find_spec(m) is not None
        except (ImportError, ValueError):
            mods[m] = False
    r["modules"] = mods
    if argv[1] == "1":
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.bind(("", 0))
        r["port"] = s.getsockname()[1]
        s.close()
    return r


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
