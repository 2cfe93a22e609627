"""The per-node agent: spawns a node's ranks, reports on them, and never leaves one behind.

Run as ``python -m hetctl.node.agent`` (or from the zipapp the controller ships to the
node's workdir, so a node needs only Python). Standard library only; the rank
processes themselves (spawn hook, log pump, process states) are :mod:`hetctl.node.rankproc`.

Protocol, one JSON object a line. The controller writes on the agent's stdin::

    {"cmd": "start", "grace_s": 5,
     "ranks": [{"rank": 0, "argv": [...], "env": {...}, "cwd": "...",
                "log": "/node/path/rank-0.log", "heartbeat": "/node/path/rank-0.json"}]}
    {"cmd": "stop"}                       stop the ranks and exit
    {"cmd": "stop", "keep": true}         stop the ranks, keep the agent and its spares for the next start
    {"cmd": "port"}                       answer ``port`` with a free TCP port (a kept agent's pre-flight)

With ``"standby": true`` in ``start``, each rank is handed to its warm spare when
one fits and a new spare is started behind it (:mod:`hetctl.node.standby`).

and reads on its stdout (every event carries ``ev`` and ``t``, the node's clock)::

    hello     pid, python, host, protocol        once, at startup
    started   rank, pid                          a rank was spawned
    log       rank, lines[, dropped]             batched output, rate-limited
    heartbeat rank, hb (the rank's heartbeat file as written by hetctl.node.runtime)
    heartbeats hbs [[rank, hb], ...]             what one poll found new for several ranks: one line, not one each
    alive     ranks {rank: process state letter} every ~1 s, so silence means a lost node
    exited    rank, code, signal[, error]        at once, from a thread blocked in waitpid
    error     message                            a bad command
    standby   rank, state (ready|used|cold|none|gone)[, pid, reason, import_s]
    port      port                               the answer to ``port``
    stopped   reason                             every rank is gone; the agent exits next (unless keep)

Stopping (on ``stop``, stdin EOF, SIGTERM/SIGHUP or a broken stdout): SIGTERM to
each rank's process group, ``grace_s``, then SIGKILL. Each rank runs in its own
session/process group, and on Linux gets ``PR_SET_PDEATHSIG(SIGKILL)`` so that it
dies with the agent even when the agent itself is SIGKILLed.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time

from hetctl.node.rankproc import Emitter, RankProc, _death_signal_hook, free_port, oom_kills, proc_state
from hetctl.node.standby import Standby, is_spare

PROTOCOL = 1
ALIVE_EVERY_S = 1.0
HEARTBEAT_POLL_S = 0.2
LOG_FLUSH_S = 0.2
DEFAULT_GRACE_S = 5.0

class Agent:
    """The agent's state and its single-threaded control loop (threads only feed the queue)."""

    def __init__(self, stdin, stdout) -> None:
        self.events: queue.SimpleQueue = queue.SimpleQueue()  # reentrant: safe from signal handlers
        self.emit = Emitter(stdout)
        self.stdin = stdin
        self.ranks: dict[int, RankProc] = {}
        self.grace_s = DEFAULT_GRACE_S
        self.hook = _death_signal_hook()
        self.run_id: str | None = None  # from the ranks' HETCTL_RUN_ID: what a stop sweeps for
        self.oom_kills_at_start = oom_kills()
        self.standby = Standby(self.hook, self.events.put, self.emit)
        self.starts = 0

    # -- feeders -------------------------------------------------------------
    def _read_commands(self) -> None:
        for raw in iter(self.stdin.readline, b""):
            raw = raw.strip()
            if not raw:
                continue
            try:
                msg = json.loads(raw)
                if not isinstance(msg, dict):
                    raise ValueError("not an object")
            except ValueError as e:
                self.events.put(("bad", f"unreadable command: {e}"))
                continue
            self.events.put(("cmd", msg))
        self.events.put(("eof", None))

    def _wait_rank(self, rp: RankProc) -> None:
        self.events.put(("exit", (rp.rank, rp.proc.wait())))

    def _on_signal(self, signum: int, frame) -> None:
        self.events.put(("signal", signum))

    # -- actions -------------------------------------------------------------
    def start(self, msg: dict) -> None:
        """Spawn every rank of the start command (from the main thread: PDEATHSIG is per thread)."""
        self.grace_s = float(msg.get("grace_s", DEFAULT_GRACE_S))
        warm = bool(msg.get("standby"))
        if self.starts:
            self.emit("hello", pid=os.getpid(), python=sys.version.split()[0], host=socket.gethostname(),
                      protocol=PROTOCOL, kept=True)  # the same agent serves the next attempt
        self.starts += 1
        for spec in msg.get("ranks", []):
            try:
                rank = int(spec["rank"])
                argv = [str(a) for a in spec["argv"]]
                env = {**os.environ, **{str(k): str(v) for k, v in (spec.get("env") or {}).items()}}
                self.run_id = self.run_id or env.get("HETCTL_RUN_ID")
            except (KeyError, TypeError, ValueError) as e:
                # Name the spec by its rank and keys only: its env holds the inventory's values (secrets).
                keys = sorted(spec) if isinstance(spec, dict) else type(spec).__name__
                who = spec.get("rank", "?") if isinstance(spec, dict) else "?"
                self.emit("error", message=f"bad rank spec (rank {who}, keys {keys}): {type(e).__name__}: {e}")
                continue
            for path in (spec.get("log"), spec.get("heartbeat")):
                if path:
                    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            if spec.get("heartbeat"):
                try:
                    os.unlink(spec["heartbeat"])  # a stale file must not look like progress
                except FileNotFoundError:
                    pass
            log = open(spec["log"], "ab") if spec.get("log") else open(os.devnull, "wb")  # noqa: SIM115
            proc = self.standby.take(rank, argv, env, spec.get("cwd") or None) if warm else None
            try:
                proc = proc or subprocess.Popen(
                    argv,
                    env=env,
                    cwd=spec.get("cwd") or None,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=self.hook,
                )
            except OSError as e:
                log.write(f"hetctl agent: cannot start {argv[0]}: {e.strerror}\n".encode())
                log.close()
                self.emit("exited", rank=rank, code=127, signal=None, error=f"cannot start {argv[0]}: {e.strerror}")
                continue
            rp = RankProc(spec, proc, log)
            self.ranks[rank] = rp
            self.emit("started", rank=rank, pid=proc.pid)
            if warm:
                self.standby.want({**spec, "argv": argv}, env)
            threading.Thread(target=self._wait_rank, args=(rp,), name=f"wait-{rank}", daemon=True).start()

    def on_exit(self, rank: int, code: int) -> None:
        rp = self.ranks[rank]
        rp.exited = True
        rp.signal_group(signal.SIGKILL)  # leave no member of its group behind
        self.poll_heartbeats(only=rp)  # its final heartbeat (done, final loss) precedes the exit
        if code == -signal.SIGKILL and oom_kills() > self.oom_kills_at_start:
            self.emit("exited", rank=rank, code=None, signal=-code, oom=True)  # the kernel's OOM killer ran
        elif code < 0:
            self.emit("exited", rank=rank, code=None, signal=-code)
        else:
            self.emit("exited", rank=rank, code=code, signal=None)
        self.flush_logs(only=rp, wait=True)  # after the report: detection latency comes first

    def flush_logs(self, only: RankProc | None = None, wait: bool = False) -> None:
        for rp in [only] if only else list(self.ranks.values()):
            if wait:
                rp.pump.join(timeout=0.5)
            lines, dropped = rp.take_lines()
            if lines or dropped:
                extra = {"dropped": dropped} if dropped else {}
                self.emit("log", rank=rp.rank, lines=lines, **extra)

    def poll_heartbeats(self, only: RankProc | None = None) -> None:
        """Emit what each rank's heartbeat file (or output) says that is new: one ``heartbeats`` line for a poll
        that found several (8 ranks of a node step together), so the controller handles a line per node."""
        found: list[list] = []
        for rp in [only] if only else list(self.ranks.values()):
            with rp._lock:
                from_log, rp.from_log = rp.from_log, None
            if from_log is not None and rp.hb_mtime == 0:  # a heartbeat file, once written, is the precise path
                found.append([rp.rank, from_log])
            if not rp.heartbeat:
                continue
            try:
                st = os.stat(rp.heartbeat)
            except OSError:
                continue
            if st.st_mtime_ns == rp.hb_mtime:
                continue
            try:
                with open(rp.heartbeat, "rb") as f:
                    hb = json.loads(f.read())
            except (OSError, ValueError):
                continue  # half-written by a non-atomic writer; the next poll reads it
            rp.hb_mtime = st.st_mtime_ns
            found.append([rp.rank, hb])
        if len(found) == 1:
            self.emit("heartbeat", rank=found[0][0], hb=found[0][1])
        elif found:
            self.emit("heartbeats", hbs=found)

    def alive(self) -> None:
        states = {str(r): ("X" if rp.exited else proc_state(rp.proc.pid)) for r, rp in self.ranks.items()}
        self.emit("alive", ranks=states)

    def _sweep(self, sig: int) -> list[int]:
        """Signal every process that carries this run's id but left its rank's group (a ``setsid`` daemon).

        Process groups and the death signal catch a rank and its children; a child that
        called ``setsid`` and was re-parented to init escapes both, but it still carries
        ``HETCTL_RUN_ID`` in its environment, which is how it is found. Returns the pids.
        """
        if not self.run_id:
            return []
        from hetctl.node.alive import alive

        pids = [pid for pid, _state, _cmd in alive(self.run_id)["pids"] if not is_spare(pid)]
        for pid in pids:
            for s in (sig, signal.SIGCONT) if sig == signal.SIGTERM else (sig,):
                try:
                    os.kill(pid, s)
                except (ProcessLookupError, PermissionError):
                    pass
        return pids

    def stop(self, reason: str, keep: bool = False) -> None:
        """SIGTERM every live rank group and stray of the run, wait ``grace_s``, SIGKILL the rest, report, return.
        SIGCONT follows each SIGTERM (as systemd does), so that a stopped process (state T: a debugger, a
        ``kill -STOP``) handles it now instead of being killed when the grace runs out.

        The ``stopped`` event lists under ``left`` any process of the run still alive at
        the end (an unkillable one in D state), so the controller can say so. With ``keep``
        the spares stay up for the next ``start``; otherwise they end too.
        """
        live = [rp for rp in self.ranks.values() if not rp.exited]
        for rp in live:
            rp.signal_group(signal.SIGTERM)
            rp.signal_group(signal.SIGCONT)
        self._sweep(signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        killed = False
        while any(not rp.exited for rp in self.ranks.values()):
            now = time.monotonic()
            if now >= deadline and not killed:
                for rp in self.ranks.values():
                    if not rp.exited:
                        rp.signal_group(signal.SIGKILL)
                killed = True
                deadline = now + 5.0
            elif now >= deadline:
                break  # unkillable (D state); report what we know
            try:
                kind, payload = self.events.get(timeout=0.05)
            except queue.Empty:
                continue
            if kind == "exit":
                self.on_exit(*payload)
            elif kind == "spare":
                self.standby.on_status(*payload)
        if not keep:
            self.standby.close()
        left = self._reap_strays()
        self.flush_logs(wait=True)
        self.emit("stopped", reason=reason, **({"left": left} if left else {}))
        if keep:
            self.ranks = {}
            self.standby.tick({}, now_all=True)  # the ranks are gone: their spares start now, for the next start

    def _reap_strays(self) -> list[int]:
        """After the ranks: SIGTERM, a short grace, then SIGKILL for what is left of the run; the survivors."""
        if not self._sweep(signal.SIGTERM):
            return []
        deadline = time.monotonic() + min(self.grace_s, 2.0)
        while time.monotonic() < deadline and self._sweep(0):
            time.sleep(0.05)
        if self._sweep(signal.SIGKILL):
            time.sleep(0.2)
        return self._sweep(0)

    # -- loop ----------------------------------------------------------------
    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, self._on_signal)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C belongs to the controller, which stops us
        threading.Thread(target=self._read_commands, name="stdin", daemon=True).start()
        self.emit(
            "hello", pid=os.getpid(), python=sys.version.split()[0], host=socket.gethostname(), protocol=PROTOCOL
        )
        next_alive = next_hb = next_log = 0.0
        while True:
            now = time.monotonic()
            if now >= next_hb:
                self.poll_heartbeats()
                next_hb = now + HEARTBEAT_POLL_S
            if now >= next_log:
                self.flush_logs()
                next_log = now + LOG_FLUSH_S
            if now >= next_alive:
                self.alive()
                next_alive = now + ALIVE_EVERY_S
            self.standby.tick({r: rp.hb_mtime for r, rp in self.ranks.items() if not rp.exited})
            if self.emit.broken:
                self.stop("controller gone (stdout closed)")
                return 0
            try:
                kind, payload = self.events.get(timeout=max(0.0, min(next_hb, next_log, next_alive) - time.monotonic()))
            except queue.Empty:
                continue
            if kind == "exit":
                self.on_exit(*payload)
            elif kind == "cmd" and payload.get("cmd") == "start":
                self.start(payload)
            elif kind == "spare":
                self.standby.on_status(*payload)
            elif kind == "cmd" and payload.get("cmd") == "port":
                self.emit("port", port=free_port())  # a kept agent's pre-flight for the next attempt
            elif kind == "cmd" and payload.get("cmd") == "stop" and payload.get("keep"):
                self.stop("stop requested", keep=True)
            elif kind == "cmd" and payload.get("cmd") == "stop":
                self.stop("stop requested")
                return 0
            elif kind == "cmd":
                self.emit("error", message=f"unknown command {payload.get('cmd')!r}")
            elif kind == "bad":
                self.emit("error", message=payload)
            elif kind == "eof":
                self.stop("controller gone (stdin closed)")
                return 0
            elif kind == "signal":
                self.stop(f"agent got signal {signal.Signals(payload).name}")
                return 0


def main() -> None:
    """Entry point: serve the protocol on stdin/stdout until stopped.

    Leaves with ``os._exit``: the stdin reader thread may still be blocked in a
    read, and interpreter shutdown would abort on its buffer lock.
    """
    code = Agent(sys.stdin.buffer, sys.stdout.buffer).run()
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    os._exit(code)


if __name__ == "__main__":
    main()
