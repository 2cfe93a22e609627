"""Running a probe's vendor tools on the node: each in a thread with its own timeout, killed with
everything it started (stdlib only).

Part of the collector (:mod:`hetctl.node.collector`): shipped on stdin in front of it as one
program (:func:`hetctl.node.source`), so a node needs nothing but a Python interpreter. A tool
runs only when its ``argv[0]`` exists (on PATH or in the folders vendor installers use); its
output is kept raw (at most :data:`MAX_OUTPUT` bytes a stream), for the controller's parsers.
"""

import os
import shutil
import signal
import subprocess
import sys
import threading

# Vendor tools that installers leave outside the default PATH.
EXTRA_TOOL_DIRS = (
    "/usr/local/Ascend/driver/tools",
    "/usr/local/corex/bin",
    "/opt/hyhal/bin",
    "/opt/rocm/bin",
    "/usr/local/neuware/bin",
    "/opt/mxdriver/bin",
    "/opt/maca/bin",
)

MAX_OUTPUT = 1 << 20  # bytes kept per tool stream


def _which(name):
    if "/" in name:
        return name if os.access(name, os.X_OK) else None
    found = shutil.which(name)
    if found:
        return found
    for d in EXTRA_TOOL_DIRS:
        cand = os.path.join(d, name)
        if os.access(cand, os.X_OK):
            return cand
    return None


def _die_with_collector():
    """A preexec_fn: the tool gets SIGKILL when the collector dies (Linux ``PR_SET_PDEATHSIG``), else None.

    A tool's own children are reached another way: they stay in the collector's
    process group (see :func:`run_tool`).
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def hook():
        prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL
        if os.getppid() != parent:
            os._exit(137)

    return hook


def _children():
    """``{pid: [child pids]}`` of every process, from ``/proc``; empty where there is none."""
    kids = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return kids
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % name) as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(name))
    return kids


def _kill_tree(pid):
    """SIGKILL a tool and everything it started.

    Each process is stopped before its children are looked up, so none can start
    another behind the walk; then all of them are killed. Where there is no
    ``/proc`` only the tool itself is killed.
    """
    stopped, todo = [], [pid]
    while todo:
        for p in todo:
            try:
                os.kill(p, signal.SIGSTOP)
                stopped.append(p)
            except OSError:
                pass
        kids = _children()
        todo = [c for p in todo for c in kids.get(p, ()) if c not in stopped]
    for p in stopped or [pid]:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass


_TOOLS = set()  # tool processes running now
_TOOLS_LOCK = threading.Lock()


def on_term(signum, frame):
    """SIGTERM to the collector alone: end every running tool and what it started, then exit."""
    with _TOOLS_LOCK:
        for proc in list(_TOOLS):
            _kill_tree(proc.pid)
    os._exit(128 + signum)


def run_tool(argv, timeout):
    """Run one vendor tool; never raises. Returns the record for ``raw["tools"]``.

    The tool stays in the collector's process group, so whatever ends that group
    ends the tool and its children with it: the transports' timeouts and an
    interrupted probe kill the group (SIGTERM, then SIGKILL), and neither a tool
    nor a child it forked can outlive a collector killed that way. Its own timeout
    kills just the tool's tree (:func:`_kill_tree`).
    """
    rec = {"argv": list(argv), "rc": None, "stdout": "", "stderr": "", "timeout": False}
    exe = _which(argv[0])
    if exe is None:
        return None
    try:
        proc = subprocess.Popen(
            [exe] + list(argv[1:]), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, preexec_fn=_die_with_collector(),
        )
    except OSError as e:
        rec["stderr"] = "cannot start %s: %s" % (exe, e)
        return rec
    with _TOOLS_LOCK:
        _TOOLS.add(proc)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        rec["timeout"] = True
        _kill_tree(proc.pid)
        out, err = proc.communicate()
    with _TOOLS_LOCK:
        _TOOLS.discard(proc)
    rec["rc"] = proc.returncode
    rec["stdout"] = out[:MAX_OUTPUT].decode("utf-8", "replace")
    rec["stderr"] = err[-MAX_OUTPUT:].decode("utf-8", "replace")
    return rec


def collect_tools(commands, timeout):
    """Run every command whose binary exists, in parallel threads."""
    results = {}
    threads = []

    def work(key, argv):
        rec = run_tool(argv, timeout)
        if rec is not None:
            results[key] = rec

    for key, argv in sorted(commands.items()):
        if not argv or _which(argv[0]) is None:
            continue
        t = threading.Thread(target=work, args=(key, argv), daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join(timeout + 5)
    return results
