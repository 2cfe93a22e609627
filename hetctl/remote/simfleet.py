"""Simulated nodes at scale: one child process plays every node's agent over real sockets.

:class:`SimFleet` is the ``connect`` a controller takes, like
:class:`~hetctl.remote.testing.FakeFleet`, but built for a thousand nodes and for
measuring the controller, not the fake:

- the nodes live in a **child process** (``python -m hetctl.remote.simfleet``), a
  single-threaded ``selectors`` loop, so the controller's process holds only the
  controller's work: its CPU, memory and threads are what ``hetctl launch`` would have;
- every agent is a **real file descriptor** in the controller, as an ``ssh`` client's
  streams are: stdin and stdout on one Unix socket, stderr in a file
  (:mod:`hetctl.remote.stdio`) — one per node; or, for a caller that passes no
  ``stderr_to``, three (the socket, its duplicate for stdin, a stderr pipe), as three pipes are;
- every connection and every command costs ``latency_s`` (a handshake, a remote
  shell), and each agent speaks the protocol of :mod:`hetctl.node.agent`: ``hello``,
  ``started``, a heartbeat per rank every ``step_s`` (one ``heartbeats`` line per node,
  sent within the agent's 0.2 s heartbeat poll after a step boundary common to the whole
  job, as synchronous training does), ``alive`` every second, ``port``, ``stop`` with and without ``keep``.

A crash is injected on demand with :meth:`SimFleet.crash`; the rank's ``exited`` line
carries the node's clock at the crash, as the real agent's does. What is not simulated:
the ``ssh`` client processes and their masters (outside the controller's process
either way), rank logs (the ranks print nothing), warm spares. Relays: :mod:`hetctl.remote.simrelay`.
"""

from __future__ import annotations

import heapq
import json
import os
import random
import selectors
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from hetctl.remote.base import Result
from hetctl.remote.simrelay import RelayMixin
from hetctl.remote.testing import preflight_answer

HB_POLL_S = 0.2  # the real agent's heartbeat poll: a rank's heartbeat leaves within it after the step


class SimProcess:
    """An agent's :class:`~hetctl.remote.base.Process`: stdin/stdout on a Unix socket, stderr on a pipe; or, with
    ``stderr_path`` (a transport's ``stderr_to``), stdin and stdout on the one socket and stderr in that file, as
    :mod:`hetctl.remote.stdio` gives a real agent."""

    def __init__(self, sock: socket.socket, err: socket.socket | None, stderr_path: Path | None = None) -> None:
        self.sock, self.err = sock, err
        self.stdout = sock.makefile("rb")
        self.stderr_path, self.stderr_from = stderr_path, 0
        if err is None:
            self.stdin = sock.makefile("wb")
            self.stderr = None
        else:
            self.stdin = os.fdopen(os.dup(sock.fileno()), "wb", buffering=0)  # a pipe's own descriptor, as over ssh
            self.stderr = err.makefile("rb")  # silent, open while the agent lives (its reader waits, as over ssh)
        self.code: int | None = None

    def poll(self) -> int | None:
        return self.code

    def wait(self, timeout: float | None = None) -> int:
        return 0 if self.code is None else self.code

    def close_stdin(self) -> None:
        """EOF for the agent (a shut write side; closing only our descriptor would not tell it)."""
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        self.stdin.close()

    def kill(self) -> None:
        for s in (self.sock, self.err):
            try:
                if s is not None:
                    s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.code = -9

    def close(self) -> None:
        for f in (self.stdin, self.stderr, self.stdout, self.sock, self.err):
            try:
                if f is not None:
                    f.close()
            except OSError:
                pass


class SimTransport:
    """A Transport to one simulated node; every call costs the fleet's ``latency_s``."""

    relayable = True  # it stands for ssh: agents may go through relays (hetctl.remote.relay)

    def __init__(self, node: Any, fleet: "SimFleet") -> None:
        self.node, self.fleet = node.name, fleet
        self.procs: list[SimProcess] = []

    def run(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, cwd: str | None = None,
            input: bytes | None = None, timeout: float | None = None, check: bool = True) -> Result:
        time.sleep(self.fleet.latency_s)
        answer = preflight_answer(argv, {})
        if answer is None:
            return Result(self.node, " ".join(argv), 127, "", f"simulated node: no script for {argv[0]}")
        return Result(self.node, " ".join(argv), 0, json.dumps(answer) + "\n", "")

    def start(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, cwd: str | None = None,
              input: bytes | None = None, stderr_to: str | Path | None = None) -> SimProcess:
        time.sleep(self.fleet.latency_s)
        relay = "--relay" in argv  # a relay's stepmux (hetctl.remote.relay): it carries its group's agents
        headers = [{"relay" if relay else "node": self.node, "step_s": self.fleet.step_s}]
        if stderr_to is None:
            headers.insert(0, {"stderr_of": self.node})
        else:
            Path(stderr_to).parent.mkdir(parents=True, exist_ok=True)
            Path(stderr_to).touch(mode=0o600)  # the simulated agent writes nothing on stderr
        socks = []
        for header in headers:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(str(self.fleet.address))
            sock.sendall((json.dumps(header) + "\n").encode())
            socks.append(sock)
        proc = SimProcess(socks[-1], socks[0] if stderr_to is None else None,
                          Path(stderr_to) if stderr_to is not None else None)
        self.procs.append(proc)
        return proc

    def put(self, data: bytes | Path, remote_path: str, mode: int = 0o644) -> None:
        time.sleep(self.fleet.latency_s)
        self.fleet.put_bytes += len(data) if isinstance(data, (bytes, bytearray)) else data.stat().st_size

    def close(self) -> None:
        for p in self.procs:
            p.close()
        self.procs.clear()


class SimFleet:
    """Simulated nodes in a child process; use as a context manager, pass :meth:`connect` to the controller.

    Args:
        latency_s: the cost of a connection and of each command over it.
        step_s: seconds between two steps of the job (one heartbeat per rank each).
    """

    def __init__(self, latency_s: float = 0.05, step_s: float = 1.0) -> None:
        self.latency_s, self.step_s = latency_s, step_s
        self.put_bytes = 0
        self._tmp = tempfile.TemporaryDirectory(prefix="hetctl-simfleet-")
        self.address = Path(self._tmp.name) / "fleet.sock"
        self.proc: subprocess.Popen | None = None
        self.epoch = 0.0
        self._lock = threading.Lock()

    def __enter__(self) -> "SimFleet":
        root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        self.proc = subprocess.Popen([sys.executable, "-m", "hetctl.remote.simfleet", str(self.address)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        ready = self.proc.stdout.readline().split()
        if ready[:1] != [b"ready"]:
            raise RuntimeError(f"the simulated fleet did not start (exit {self.proc.wait()})")
        self.epoch = float(ready[1])  # the job's step boundaries are epoch + k * step_s
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def connect(self, node: Any) -> SimTransport:
        time.sleep(self.latency_s)  # the handshake
        return SimTransport(node, self)

    def crash(self, node: str, rank: int, code: int = 1) -> float:
        """Make ``rank`` on ``node`` exit with ``code`` now; the node's clock at the exit."""
        with self._lock:
            self.proc.stdin.write((json.dumps({"crash": node, "rank": rank, "code": code}) + "\n").encode())
            self.proc.stdin.flush()
            reply = json.loads(self.proc.stdout.readline())
        if "t" not in reply:
            raise RuntimeError(f"no crash on {node} rank {rank}: {reply.get('error')}")
        return float(reply["t"])

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._tmp.cleanup()


# -- the child process: every node's agent in one selectors loop ----------------------------------------------


class _Node:
    """One simulated agent's state in the child."""

    def __init__(self, sock: socket.socket | None) -> None:
        self.sock, self.name = sock, ""
        self.carrier: _Node | None = None  # a relayed agent's relay (hetctl.remote.simrelay); its label there
        self.label = 0
        self.members: dict[str, _Node] | None = None  # a relay's agents
        self.inbuf, self.out = b"", bytearray()
        self.step_s = 1.0
        self.ranks: dict[int, dict] = {}  # rank → {"step", "steps", "attempt"}
        self.starts = 0
        self.gen = 0  # bumps at each start/stop: timers of an older generation are void
        self.poll_phase = random.uniform(0.0, HB_POLL_S)


class _Fleet(RelayMixin):
    def __init__(self, address: str) -> None:
        self.sel = selectors.DefaultSelector()
        self.lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.lsock.bind(address)
        self.lsock.listen(4096)
        self.lsock.setblocking(False)
        self.sel.register(self.lsock, selectors.EVENT_READ, "accept")
        os.set_blocking(sys.stdin.fileno(), False)
        self.sel.register(sys.stdin.fileno(), selectors.EVENT_READ, "control")
        self.ctl_buf = b""
        self.timers: list = []  # (when, seq, node, gen, kind)
        self.seq = 0
        self.epoch = time.time()  # the job's step boundaries: epoch + k * step_s, for every node alike
        self.nodes: dict[str, _Node] = {}
        self.stderrs: dict[str, _Node] = {}  # node → its agent's stderr connection

    # -- sending ----------------------------------------------------------------------
    def emit(self, n: _Node, ev: str, **fields: Any) -> None:
        n.out += (json.dumps({"ev": ev, "t": time.time(), **fields}, separators=(",", ":")) + "\n").encode()

    @staticmethod
    def make(sock: socket.socket | None) -> _Node:
        return _Node(sock)

    def flush(self, n: _Node) -> None:
        if n.sock is None:
            return self.relay_flush(n)  # a relayed agent: through its relay
        if n.out:
            try:
                sent = n.sock.send(n.out)
                del n.out[:sent]
            except BlockingIOError:
                pass
            except OSError:
                n.out.clear()
        self.sel.modify(n.sock, selectors.EVENT_READ | (selectors.EVENT_WRITE if n.out else 0), n)

    def at(self, when: float, n: _Node, kind: str) -> None:
        self.seq += 1
        heapq.heappush(self.timers, (when, self.seq, n, n.gen, kind))

    # -- the agent protocol -------------------------------------------------------------
    def command(self, n: _Node, msg: dict) -> None:
        if not n.name and "stderr_of" in msg:  # the agent's stderr: silent; it closes with the agent
            n.name = f"stderr of {msg['stderr_of']}"
            self.stderrs[str(msg["stderr_of"])] = n
            return
        if not n.name and "relay" in msg:
            self.relay_open(n, msg)
            return
        if not n.name:
            n.name, n.step_s = str(msg["node"]), float(msg.get("step_s", 1.0))
            self.nodes[n.name] = n
            self.emit(n, "hello", pid=os.getpid(), python="3", host=n.name, protocol=1)
            return
        cmd = msg.get("cmd")
        if cmd == "start":
            n.gen += 1
            if n.starts:
                self.emit(n, "hello", pid=os.getpid(), python="3", host=n.name, protocol=1, kept=True)
            n.starts += 1
            for i, spec in enumerate(msg.get("ranks", [])):
                env = spec.get("env") or {}
                rank = int(spec["rank"])
                n.ranks[rank] = {"step": int(env.get("HETCTL_RESUME_STEP", "0") or 0),
                                 "steps": int(env.get("HETCTL_STEPS", "1000000")),
                                 "attempt": int(env.get("HETCTL_ATTEMPT", "0") or 0)}
                self.emit(n, "started", rank=rank, pid=20_000 + i)
            # the trainer's "ready" heartbeat at its resume step
            self.heartbeats(n, [[rank, self.hb(n, rank, r, phase="ready")] for rank, r in n.ranks.items()])
            now = time.time()
            nxt = self.epoch + (int((now - self.epoch) / n.step_s) + 1) * n.step_s
            self.at(nxt + n.poll_phase, n, "step")
            self.at(now + 1.0, n, "alive")
        elif cmd == "port":
            self.emit(n, "port", port=29500)
        elif cmd == "stop":
            n.gen += 1
            for rank in sorted(n.ranks):
                self.emit(n, "exited", rank=rank, code=None, signal=15)
            n.ranks.clear()
            self.emit(n, "stopped", reason="stop requested")
            if not msg.get("keep"):  # the agent exits: every line it wrote reaches the controller first
                if n.sock is not None:
                    n.sock.setblocking(True)
                    try:
                        n.sock.sendall(n.out)
                    except OSError:
                        pass
                    n.out.clear()
                self.drop(n)
        else:
            self.emit(n, "error", message=f"unknown command {cmd!r}")

    @staticmethod
    def hb(n: _Node, rank: int, r: dict, **extra: Any) -> dict:
        ms = n.step_s * 1000.0
        return {"step": r["step"], "time": time.time(), "rank": rank, "attempt": r["attempt"], "step_ms": ms,
                "compute_ms": round(ms * 0.9, 3), "loss": 4.0 / (1 + r["step"]), "grad_norm": 1.25, "lr": 3e-4,
                **extra}

    def heartbeats(self, n: _Node, hbs: list[list]) -> None:
        """What one poll of the real agent sends: ``heartbeat`` for one rank, ``heartbeats`` for several."""
        if len(hbs) == 1:
            self.emit(n, "heartbeat", rank=hbs[0][0], hb=hbs[0][1])
        elif hbs:
            self.emit(n, "heartbeats", hbs=hbs)

    def tick(self, n: _Node, kind: str, when: float) -> None:
        if kind == "alive":
            self.emit(n, "alive", ranks={str(r): "S" for r in n.ranks})
            self.at(when + 1.0, n, "alive")
            return
        hbs, done = [], []
        for rank in sorted(n.ranks):
            r = n.ranks[rank]
            r["step"] += 1
            hbs.append([rank, self.hb(n, rank, r)])
            if r["step"] >= r["steps"]:
                done.append(rank)
        self.heartbeats(n, hbs)
        for rank in done:
            self.heartbeats(n, [[rank, self.hb(n, rank, n.ranks[rank], done=True)]])
            self.emit(n, "exited", rank=rank, code=0, signal=None)
            del n.ranks[rank]
        if n.ranks:
            self.at(when + n.step_s, n, "step")

    def crash(self, msg: dict) -> dict:
        n = self.nodes.get(str(msg.get("crash")))
        rank = int(msg.get("rank", -1))
        if n is None or rank not in n.ranks:
            return {"error": "no such running rank"}
        t = time.time()
        del n.ranks[rank]
        self.emit(n, "exited", rank=rank, code=int(msg.get("code", 1)), signal=None)
        self.flush(n)
        return {"t": t}

    def drop(self, n: _Node) -> None:
        if n.sock is None:
            return self.relay_drop(n)
        for member in list((n.members or {}).values()):  # a relay's end ends its agents
            self.drop(member)
        n.gen += 1
        n.ranks.clear()
        if self.nodes.get(n.name) is n:
            del self.nodes[n.name]
            err = self.stderrs.pop(n.name, None)
            if err is not None:
                self.drop(err)
        try:
            self.sel.unregister(n.sock)
        except (KeyError, ValueError):
            pass
        n.sock.close()

    # -- the loop ----------------------------------------------------------------------
    def serve(self) -> None:
        print(f"ready {self.epoch!r}", flush=True)
        while True:
            timeout = max(0.0, self.timers[0][0] - time.time()) if self.timers else 1.0
            for key, mask in self.sel.select(timeout):
                if key.data == "accept":
                    while True:
                        try:
                            sock, _ = self.lsock.accept()
                        except BlockingIOError:
                            break
                        sock.setblocking(False)
                        self.sel.register(sock, selectors.EVENT_READ, _Node(sock))
                elif key.data == "control":
                    if not self.control():
                        return
                else:
                    self.ready(key.data, mask)
            now = time.time()
            touched = set()
            while self.timers and self.timers[0][0] <= now:
                when, _, n, gen, kind = heapq.heappop(self.timers)
                if gen == n.gen:
                    self.tick(n, kind, when)
                    touched.add(n)
            for n in touched:
                if self.open(n):
                    self.flush(n)

    def control(self) -> bool:
        data = os.read(sys.stdin.fileno(), 65536)
        if not data:
            return False
        self.ctl_buf += data
        while b"\n" in self.ctl_buf:
            line, self.ctl_buf = self.ctl_buf.split(b"\n", 1)
            reply = self.crash(json.loads(line))
            sys.stdout.write(json.dumps(reply) + "\n")
            sys.stdout.flush()
        return True

    def ready(self, n: _Node, mask: int) -> None:
        if mask & selectors.EVENT_READ:
            try:
                data = n.sock.recv(65536)
            except OSError:
                data = b""
            if not data:  # the controller closed our stdin: the real agent stops its ranks and exits
                self.drop(n)
                return
            n.inbuf += data
            while b"\n" in n.inbuf:
                line, n.inbuf = n.inbuf.split(b"\n", 1)
                if line.strip():
                    (self.relay_command if n.members is not None else self.command)(n, json.loads(line))
                if n.sock.fileno() < 0:
                    return
        if n.sock.fileno() >= 0:
            self.flush(n)


def _main() -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # one socket per simulated node
    _Fleet(sys.argv[1]).serve()


if __name__ == "__main__":
    _main()
