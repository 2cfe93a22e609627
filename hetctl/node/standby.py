"""Warm standby: per rank, a spare Python process that has already imported torch and the trainer.

A restart is mostly new Python processes importing torch (seconds on a small
host, far more on a cluster's shared file system). The agent therefore keeps, for
each of its ranks, one spare: ``python -c <this module's source> FD <the rank's argv[1:]>``,
started with the rank's own environment and working directory, in its own
session, with the agent's death signal. The spare imports what the rank will
import (:func:`preload`), says ``ready`` on its status pipe (fd ``FD``), and
blocks reading one line on stdin. A restart writes the rank's spec there
(``argv``, ``env``, ``cwd``); the spare replaces its environment, working
directory and ``sys.argv`` with the spec's and runs the entry exactly as
``python -m MOD`` or ``python SCRIPT`` would (:mod:`runpy`), so its output,
heartbeat file and exit code are the rank's. EOF on stdin (the agent is gone or
let it go) ends a spare at once; so does the agent's death (``PR_SET_PDEATHSIG``).

Which spare fits which rank: the same argv and cwd, and an environment that
differs only in the keys a rank reads after start-up (:data:`PER_ATTEMPT`:
``HETCTL_*``, ``MASTER_*``, ``RANK`` and friends). Anything else (a visible-devices
variable, ``OMP_NUM_THREADS``, ``PYTHONPATH``) may be read at import time, so a
spare started under another value is not used: the rank starts cold and the
``standby`` event says why.

One fact the rank contract does not hide: ``/proc/<pid>/environ`` is the
environment a process was *started* with, so for a rank that began as a spare it
shows the spare's start values of the per-attempt keys (the next attempt's number,
an earlier ``MASTER_PORT``); ``os.environ`` in the rank, and every child it starts,
has the rank's. While waiting, a spare's ``/proc/<pid>/comm`` is ``hetctl-spare``.

Standard library only: this module ships to the nodes with the agent.
"""

from __future__ import annotations

import ast
import math
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from typing import Any, Callable

SPARE_COMM = "hetctl-spare"
PER_ATTEMPT = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK")
PER_ATTEMPT_PREFIXES = ("HETCTL_", "MASTER_", "TORCHELASTIC_")
SPARE_AFTER_BEATS = 2  # a new spare starts once its rank's heartbeat moved this often (after its first step)…
SPARE_AFTER_S = 30.0  # …or this long after the rank started (a script that never heartbeats)
SPARE_WAIT_S = 10.0  # how long a start waits for a spare still importing (under the node timeout: the agent is busy)
PR_SET_NAME = 15


# -- the spare process ----------------------------------------------------------
def _entry(argv: list[str]) -> tuple[str, str] | None:
    """``("module", name)`` for ``python -m name …``, ``("script", path)`` for ``python file.py …``; else None."""
    if len(argv) >= 3 and argv[1] == "-m" and argv[2] and not argv[2].startswith("-"):
        return "module", argv[2]
    if len(argv) >= 2 and argv[1].endswith(".py") and not argv[1].startswith("-"):
        return "script", argv[1]
    return None


def _imports(source: str, package: str | None) -> list[str]:
    """Every absolute module name ``source`` imports anywhere (functions included), relative ones resolved."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                if not package:
                    continue
                parts = package.split(".")
                if node.level > 1:
                    parts = parts[: len(parts) - node.level + 1]
                base = ".".join(p for p in (*parts, base) if p)
            names.append(base)
            names += [f"{base}.{a.name}" for a in node.names if a.name != "*"]  # submodules among the names
    return [n for n in dict.fromkeys(names) if n]


def _source(name: str) -> tuple[str, str | None, bool] | None:
    """(source, package, is_package) of module ``name`` without importing it; None when not found as source."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError, AttributeError):
        return None
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        return None
    try:
        with open(spec.origin, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError):
        try:  # inside a zipapp
            text = spec.loader.get_source(name) or ""  # type: ignore[union-attr]
        except (ImportError, OSError, AttributeError):
            return None
    is_pkg = spec.submodule_search_locations is not None
    return text, (name if is_pkg else name.rpartition(".")[0] or None), is_pkg


def preload(argv: list[str]) -> list[str]:
    """The modules a spare imports for the rank ``argv``: torch, then what the entry imports.

    The entry itself is never run: for ``-m pkg`` the package and what its
    ``__main__`` imports; for ``-m mod`` or a script, what its source imports.
    Modules of the entry's own top-level package are followed transitively (the
    reference trainer imports torch inside functions), other packages are only
    imported.
    """
    kind, target = _entry(argv) or ("", "")
    out: list[str] = ["torch", "torch.distributed"]
    todo: list[tuple[str, str | None]] = []
    top = None
    if kind == "module":
        top = target.split(".")[0]
        found = _source(target)
        if found and found[2]:
            out.append(target)
            main = _source(target + ".__main__")
            if main:
                todo.append((main[0], target))
        elif found:
            if "." in target:
                out.append(target.rpartition(".")[0])
            todo.append((found[0], found[1]))
    elif kind == "script":
        try:
            with open(target, encoding="utf-8") as f:
                todo.append((f.read(), None))
        except (OSError, UnicodeDecodeError):
            pass
    seen: set[str] = set()
    while todo and len(seen) < 200:
        text, package = todo.pop()
        for name in _imports(text, package):
            if name in seen or name == target:
                continue
            seen.add(name)
            out.append(name)
            if top and name.split(".")[0] == top:
                found = _source(name)
                if found:
                    todo.append((found[0], found[1]))
    return [n for n in dict.fromkeys(out) if n != "__main__" and not n.endswith(".__main__")]


def _warm_torch() -> str | None:
    """One optimizer step on a constant tensor: torch imports most of itself lazily, at the first step.

    The rank's own optimizer (:class:`hetctl.train.adamw.AdamW`): its first step imports
    the functional Adam and the kernels it picks, work a restarted rank would do before
    its first step. No random numbers are drawn (the rank's generator state is its own),
    no device other than the CPU is touched.
    """
    try:
        import torch

        from hetctl.train.adamw import AdamW

        p = torch.nn.Parameter(torch.ones(4, 4))
        opt = AdamW([p], lr=1e-3)
        (p @ torch.ones(4, 2)).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return None
    except Exception as e:  # noqa: BLE001 - a warm-up only: the rank does the real work either way
        return f"{type(e).__name__}: {e}"[:200]


def _set_comm(name: str) -> None:
    """Name this process in ``/proc/<pid>/comm`` (Linux, best effort): how tools tell a waiting spare."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
    except (OSError, AttributeError, ImportError):
        pass


def serve(status_fd: int, argv_tail: list[str]) -> None:
    """The spare's life: import, report ready, wait for the spec, become the rank (never returns normally)."""
    status = os.fdopen(status_fd, "w", buffering=1)
    try:
        with open("/proc/self/comm") as f:
            comm = f.read().strip()
    except OSError:
        comm = "python"
    _set_comm(SPARE_COMM)
    t0 = time.monotonic()
    imported, failed = 0, 0
    for name in preload([sys.executable, *argv_tail]):
        try:
            if importlib.util.find_spec(name) is None:
                continue
        except Exception:  # noqa: BLE001 - ``from mod import function`` names no module: nothing to import
            continue
        try:
            importlib.import_module(name)
            imported += 1
        except Exception:  # noqa: BLE001 - an optional import of the entry (inside a try) may fail here too
            failed += 1
    warm = _warm_torch() if "torch" in sys.modules else None
    status.write(json.dumps({"ready": True, "imported": imported, "failed": failed, "warm": warm,
                             "import_s": round(time.monotonic() - t0, 3)}) + "\n")
    line = sys.stdin.buffer.readline()
    if not line.strip():
        os._exit(0)  # the agent let this spare go (or died): nothing to clean up
    spec = json.loads(line)
    os.environ.clear()
    os.environ.update({str(k): str(v) for k, v in spec["env"].items()})
    if spec.get("cwd"):
        os.chdir(spec["cwd"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # a rank's stdin is /dev/null
    os.close(null)
    _set_comm(comm)
    status.write(json.dumps({"active": True, "t": time.time()}) + "\n")
    status.close()
    argv = [str(a) for a in spec["argv"]]
    kind, target = _entry(argv) or ("", "")
    import runpy

    if kind == "module":
        sys.argv = [target, *argv[3:]]
        sys.path[0] = os.getcwd()  # as ``python -m`` puts it
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv[1:]
        sys.path[0] = os.path.dirname(os.path.abspath(target))
        runpy.run_path(target, run_name="__main__")
    sys.exit(0)


# -- the agent's side -------------------------------------------------------------
def is_spare(pid: int) -> bool:
    """A warm spare still waiting for its rank (it names itself so): not a rank, and no stray to sweep.

    Nodes may share a host (the tests, ``transport: local``): one agent's sweep for the
    run's processes must not end another agent's spares.
    """
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip() == SPARE_COMM
    except OSError:
        return False


def fits(spawn_env: dict[str, str], env: dict[str, str]) -> str | None:
    """Why a spare started under ``spawn_env`` cannot become a rank with ``env`` (None: it can)."""
    keys = set(spawn_env) | set(env)
    for k in sorted(keys):
        if k in PER_ATTEMPT or k.startswith(PER_ATTEMPT_PREFIXES):
            continue
        if spawn_env.get(k) != env.get(k):
            return f"environment variable {k} changed since the spare started"
    return None


class Spare:
    """One pre-started spare, as the agent holds it."""

    def __init__(self, rank: int, proc: subprocess.Popen, status_r: int, argv: list[str], env: dict[str, str],
                 cwd: str | None, put: Callable[[tuple], None]) -> None:
        self.rank, self.proc, self.argv, self.env, self.cwd = rank, proc, argv, env, cwd
        self.ready = False
        self.ready_evt = threading.Event()  # set by the reader: take() may wait for a spare still importing
        self.taken = False
        self.info: dict[str, Any] = {}
        self._put = put
        self._status = os.fdopen(status_r, "rb")
        threading.Thread(target=self._read, name=f"spare-{rank}", daemon=True).start()

    def _read(self) -> None:
        for raw in iter(self._status.readline, b""):
            try:
                msg = json.loads(raw)
            except ValueError:
                continue
            if msg.get("ready"):
                self.ready_evt.set()
                self._put(("spare", (self, "ready", msg)))
        self._status.close()
        if not self.taken:  # died while waiting: reap it here (a taken one is the rank's, reaped as such)
            self._put(("spare", (self, "gone", {"code": self.proc.wait()})))

    def hand(self, argv: list[str], env: dict[str, str], cwd: str | None) -> bool:
        """Give the spare its rank; False when it is already gone."""
        self.taken = True
        try:
            self.proc.stdin.write((json.dumps({"argv": argv, "env": env, "cwd": cwd}) + "\n").encode())
            self.proc.stdin.close()
            return True
        except (OSError, ValueError):
            return False

    def kill(self) -> None:
        import signal

        try:
            self.proc.stdin.close()
        except (OSError, ValueError):
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _own_source() -> str:
    """This module's text, run by the spare as ``python -c``: the agent's own code, whatever the node has installed."""
    global _SOURCE
    if _SOURCE is None:
        spec = importlib.util.find_spec(__name__)
        _SOURCE = spec.loader.get_source(__name__) if spec and spec.loader else None  # type: ignore[union-attr]
        if not _SOURCE:
            with open(__file__, encoding="utf-8") as f:
                _SOURCE = f.read()
    return _SOURCE


_SOURCE: str | None = None


class Standby:
    """The agent's spares, one per rank: start them, hand them out, end them (from the agent's main thread)."""

    def __init__(self, hook: Callable[[], None] | None, put: Callable[[tuple], None],
                 emit: Callable[..., bool]) -> None:
        self.hook, self.put, self.emit = hook, put, emit
        self.spares: dict[int, Spare] = {}
        self.wanted: dict[int, tuple[dict, float, int, int]] = {}  # rank → (spec, started, beats, last mtime)

    def pids(self) -> set[int]:
        return {s.proc.pid for s in self.spares.values()}

    def take(self, rank: int, argv: list[str], env: dict[str, str], cwd: str | None) -> subprocess.Popen | None:
        """The ready spare of ``rank`` handed the rank's spec, or None (the ``standby`` event says why)."""
        spare = self.spares.pop(rank, None)
        why = None
        if spare is None:
            why = "no spare for this rank yet"
        elif not (spare.ready or spare.ready_evt.wait(SPARE_WAIT_S)):  # still importing: it is still ahead
            why = "the spare is still importing"
        elif spare.argv != argv or (spare.cwd or None) != (cwd or None):
            why = "the rank's command or working directory changed since the spare started"
        else:
            why = fits(spare.env, env)
        if why is None and spare is not None and spare.hand(argv, env, cwd):
            self.emit("standby", rank=rank, state="used", pid=spare.proc.pid)
            return spare.proc
        if spare is not None:
            spare.kill()
            why = why or "the spare is gone"
        self.emit("standby", rank=rank, state="cold", reason=why)
        return None

    def want(self, spec: dict, env: dict[str, str]) -> None:
        """Start a spare for this rank once it is past its first step (see :meth:`tick`)."""
        argv = [str(a) for a in spec["argv"]]
        rank = int(spec["rank"])
        if _entry(argv) is None:
            self.emit("standby", rank=rank, state="none",
                      reason="the rank's command is neither `python -m MODULE` nor `python SCRIPT.py`")
            return
        nxt = dict(env)
        if nxt.get("HETCTL_ATTEMPT", "").isdigit():
            nxt["HETCTL_ATTEMPT"] = str(int(nxt["HETCTL_ATTEMPT"]) + 1)  # what /proc shows once it is used
        self.wanted[rank] = ({**spec, "argv": argv, "env": nxt}, time.monotonic(), 0, 0)

    def tick(self, hb_mtimes: dict[int, int], now_all: bool = False) -> None:
        """Start the spares that are due: their rank has stepped, or waited long enough (or all, ``now_all``)."""
        now = math.inf if now_all else time.monotonic()
        for rank, (spec, since, beats, mtime) in list(self.wanted.items()):
            seen = hb_mtimes.get(rank, 0)
            if seen != mtime and seen:
                beats += 1
                self.wanted[rank] = (spec, since, beats, seen)
            if beats >= SPARE_AFTER_BEATS or now - since >= SPARE_AFTER_S:
                del self.wanted[rank]
                self.spawn(rank, spec)

    def spawn(self, rank: int, spec: dict) -> None:
        old = self.spares.pop(rank, None)
        if old is not None:
            old.kill()
        argv, env = spec["argv"], spec["env"]
        r, w = os.pipe()
        try:
            proc = subprocess.Popen(
                [argv[0], "-c", _own_source(), str(w), *argv[1:]], env=env, cwd=spec.get("cwd") or None,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, pass_fds=(w,),
                start_new_session=True, preexec_fn=self.hook)
        except OSError as e:
            os.close(r)
            self.emit("standby", rank=rank, state="none", reason=f"cannot start a spare: {e.strerror}")
            return
        finally:
            os.close(w)
        self.spares[rank] = Spare(rank, proc, r, argv, env, spec.get("cwd"), self.put)
        self.emit("standby", rank=rank, state="importing", pid=proc.pid)  # the controller's straggler watch waits

    def on_status(self, spare: Spare, what: str, msg: dict) -> None:
        if what == "ready":
            spare.ready = True
            self.emit("standby", rank=spare.rank, state="ready", pid=spare.proc.pid,
                      import_s=msg.get("import_s"), imported=msg.get("imported"))
        elif what == "gone" and self.spares.get(spare.rank) is spare:
            del self.spares[spare.rank]
            tail = b""
            try:
                tail = spare.proc.stdout.read(4096) or b""
            except (OSError, ValueError):
                pass
            last = (tail.decode(errors="replace").strip().splitlines() or [""])[-1][:200]
            self.emit("standby", rank=spare.rank, state="gone",
                      reason=f"the spare exited with code {msg.get('code')}" + (f": {last}" if last else ""))

    def close(self) -> None:
        """End every spare (the run is over, or the agent stops for good)."""
        self.wanted.clear()
        for spare in self.spares.values():
            spare.kill()
        for spare in self.spares.values():
            try:
                spare.proc.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                pass
        self.spares.clear()


if __name__ == "__main__":
    serve(int(sys.argv[1]), sys.argv[2:])
