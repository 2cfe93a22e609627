"""Pre-flight of one node before an attempt starts: runs there as ``python -c`` (stdlib only).

Arguments: ``WORKDIR WANT_PORT MODULES`` (MODULES comma-separated). Prints one JSON
line: the python version and executable, the workdir as the node expands it and
whether it is writable (proved by creating a file), which modules are importable
(found, not imported: cheap) and their installed versions, and with WANT_PORT=1 a free TCP port for the
rendezvous.
"""

import importlib.util
import json
import os
import socket
import sys
import tempfile


def unsafe(wd: str):
    """Why another user could plant code in ``wd`` (ranks run there), or None when only we can write it.

    Ranks start in the workdir, so a ``torch.py`` planted there would be imported.
    """
    try:
        st = os.stat(wd)
    except OSError:
        return None
    if st.st_uid != os.getuid():
        return "owned by uid %d, not by this user (uid %d)" % (st.st_uid, os.getuid())
    if st.st_mode & 0o022 and not st.st_mode & 0o1000:
        return "writable by %s (mode %o)" % ("others" if st.st_mode & 0o002 else "its group", st.st_mode & 0o7777)
    return None


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
    r["unsafe"] = unsafe(wd)
    mods = {}
    for m in filter(None, argv[2].split(",")):
        try:
            mods[m] = importlib.util.find_spec(m) is not None
        except (ImportError, ValueError):
            mods[m] = False
    r["modules"] = mods
    versions = {}
    for m in mods:
        try:
            from importlib import metadata

            versions[m] = metadata.version(m)  # from the package's metadata: torch is not imported
        except Exception:  # noqa: BLE001 - not installed as a distribution (a source tree): no version
            pass
    r["versions"] = versions
    if argv[1] == "1":
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.bind(("", 0))
        r["port"] = s.getsockname()[1]
        s.close()
    return r


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
