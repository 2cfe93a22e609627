"""Which processes of a run are alive on this node: runs there as ``python -c`` (stdlib only).

Arguments: the run id, and optionally a signal number to send them (``hetctl
stop`` when the run's controller is gone). Lists every process whose initial environment carries
``HETCTL_RUN_ID=<id>`` (every rank and anything a rank started, daemons included) and that
belongs to this user (another local user could start a process with that variable to block a resume)
and prints one JSON line: ``{"proc": true, "pids": [[pid, state, command], …]}``
(``proc`` false where there is no ``/proc`` to read, so the caller cannot tell).
Zombies are left out: they hold nothing.
"""

import json
import os
import sys


def alive(run_id: str) -> dict:
    want = ("HETCTL_RUN_ID=" + run_id).encode()
    me = os.getpid()
    found = []
    if not os.path.isdir("/proc"):
        return {"proc": False, "pids": found}
    uid = os.getuid()
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == me:
            continue
        try:
            if os.stat("/proc/%s" % d).st_uid != uid:
                continue  # only the run owner's processes count: another user can set HETCTL_RUN_ID too
        except OSError:
            continue
        try:
            with open("/proc/%s/environ" % d, "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if want not in env:
            continue
        try:
            with open("/proc/%s/cmdline" % d, "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
        except OSError:
            cmd = ""
        try:
            with open("/proc/%s/stat" % d) as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            state = "?"
        if state != "Z":
            found.append([int(d), state, cmd[:200]])
    return {"proc": True, "pids": found}


def signal_all(found: dict, sig: int) -> dict:
    """Send ``sig`` to every process found; ``killed`` lists those it reached."""
    killed = []
    for pid, _state, _cmd in found["pids"]:
        try:
            os.kill(pid, sig)
            killed.append(pid)
        except OSError:
            pass
    return {**found, "signalled": killed}


if __name__ == "__main__":
    found = alive(sys.argv[1])
    if len(sys.argv) > 2 and found["proc"]:
        found = signal_all(found, int(sys.argv[2]))
    print(json.dumps(found))
