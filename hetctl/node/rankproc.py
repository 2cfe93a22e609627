"""A node's rank processes, seen from the agent: spawn hooks, log pumps, states, ports.

Split from :mod:`hetctl.node.agent` (which drives them) so that each stays short.
Standard library only; psutil is used when present to also catch descendants that
left a rank's process group. Ships in the agent's zipapp with the rest of
``hetctl/node/``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

from hetctl.node.progress import LineProgress

try:  # optional: only to catch descendants that escaped the rank's process group
    import psutil  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - the shipped zipapp may run without site-packages
    psutil = None

LOG_BUDGET_BYTES_PER_S = 256 * 1024  # per rank; beyond it lines are counted, not forwarded
LOG_LINE_MAX = 4096
LOG_READ_MAX = 1 << 16  # bytes read at most per line from a rank's output (longer lines are split)
PR_SET_PDEATHSIG = 1


def _death_signal_hook(sig: int = int(signal.SIGKILL)):
    """A preexec_fn that makes the child get ``sig`` when this thread dies (Linux), or None elsewhere.

    The libc function is resolved here, before any fork, so the child only makes
    one foreign call between fork and exec. The parent-pid check closes the race
    where the agent dies before the prctl takes effect.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # pragma: no cover - non-glibc oddities
        return None
    parent = os.getpid()

    def hook() -> None:
        prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(137)

    return hook


def proc_state(pid: int) -> str:
    """The kernel's one-letter state of ``pid`` (R, S, D, T, Z…), or ``?``."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        return data[data.rindex(b")") + 2 : data.rindex(b")") + 3].decode() or "?"
    except (OSError, ValueError):
        if psutil is not None:
            try:
                return {"stopped": "T", "zombie": "Z", "running": "R"}.get(psutil.Process(pid).status(), "S")
            except psutil.Error:
                return "?"
        return "?"


class Emitter:
    """Writes events to stdout, one JSON line each; remembers when the reader is gone."""

    def __init__(self, stream) -> None:
        self._stream = stream
        self._lock = threading.Lock()
        self.broken = False

    def __call__(self, ev: str, **fields) -> bool:
        if self.broken:
            return False
        line = json.dumps({"ev": ev, "t": time.time(), **fields}, separators=(",", ":")) + "\n"
        with self._lock:
            try:
                self._stream.write(line.encode())
                self._stream.flush()
            except (OSError, ValueError):
                self.broken = True
        return not self.broken


class RankProc:
    """One spawned rank: its process, its log pump and its pending forwarded lines."""

    def __init__(self, spec: dict, proc: subprocess.Popen, log) -> None:
        self.rank = int(spec["rank"])
        self.heartbeat = spec.get("heartbeat")
        self.proc = proc
        self.pgid = proc.pid  # start_new_session makes the rank its group leader
        self.log = log
        self.exited = False
        self.hb_mtime = 0
        self.lines: list[str] = []
        self.dropped = 0
        self._budget = float(LOG_BUDGET_BYTES_PER_S)
        self._refill = time.monotonic()
        self._lock = threading.Lock()
        try:
            self.progress = LineProgress(spec["progress"]) if spec.get("progress") else None
        except (ValueError, re.error):
            self.progress = None  # the controller checked the pattern; a bad one only loses log progress
        self.from_log = None  # the newest heartbeat read from the rank's output (see hetctl.node.progress)
        self.pump = threading.Thread(target=self._pump, name=f"log-{self.rank}", daemon=True)
        self.pump.start()

    def _pump(self) -> None:
        """Copy the rank's output to its node-side log and queue it for forwarding."""
        # readline(limit): a rank that prints megabytes without a newline is read in bounded pieces,
        # so the agent's memory stays bounded whatever the rank writes.
        for raw in iter(lambda: self.proc.stdout.readline(LOG_READ_MAX), b""):
            try:
                self.log.write(raw)
                self.log.flush()
            except (OSError, ValueError):
                pass
            text = raw.decode(errors="replace").rstrip("\n")[:LOG_LINE_MAX]
            hb = self.progress.feed(text) if self.progress is not None else None
            with self._lock:
                if hb is not None:
                    self.from_log = hb
                now = time.monotonic()
                self._budget = min(LOG_BUDGET_BYTES_PER_S, self._budget + (now - self._refill) * LOG_BUDGET_BYTES_PER_S)
                self._refill = now
                if self._budget >= len(text):
                    self._budget -= len(text)
                    self.lines.append(text)
                else:
                    self.dropped += 1
        self.proc.stdout.close()
        try:
            self.log.close()
        except OSError:
            pass

    def take_lines(self) -> tuple[list[str], int]:
        with self._lock:
            lines, dropped = self.lines, self.dropped
            self.lines, self.dropped = [], 0
        return lines, dropped

    def signal_group(self, sig: int) -> None:
        """Signal the rank's process group and any descendant that left it."""
        strays = []
        if psutil is not None and not self.exited:
            try:
                strays = psutil.Process(self.proc.pid).children(recursive=True)
            except psutil.Error:
                strays = []
        try:
            os.killpg(self.pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        for child in strays:
            try:
                child.send_signal(sig)
            except psutil.Error:
                pass


def free_port() -> int:
    """A free TCP port on this node for the next rendezvous, picked as the pre-flight picks one."""
    from hetctl.node.preflight import rendezvous_port

    return rendezvous_port()


def oom_kills() -> int:
    """The kernel's count of OOM kills on this node (``oom_kill`` in /proc/vmstat; 0 where unknown).

    A rank killed by SIGKILL while this count grew was, in all likelihood, the OOM
    killer's victim: the exit is then reported as out of memory, not as a crash.
    """
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0
