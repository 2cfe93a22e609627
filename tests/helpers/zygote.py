"""A fork server for the tests' rank processes: torch imported once, every rank forked from it.

Each rank of :mod:`tests.helpers.rankrunner` is a ``python -m hetctl.train``
process, and importing torch is most of a short rank's life (about 1.9 CPU-s
of a 2-core CI machine, for a few hundred ranks a suite). The zygote is one
Python per test process that has imported torch and nothing of hetctl, and
forks a child per request. The child becomes the rank as a fresh
``python -m hetctl.train`` would: its own session, stdin from ``/dev/null``,
stdout and stderr to the given files (new ``sys.stdout``/``sys.stderr`` with
Python's own buffering), the rank's environment and argv, and the module run
by :mod:`runpy` as ``__main__``, which imports hetctl from scratch. Its exit is
Python's: ``SystemExit`` and an uncaught exception end it as they end any
interpreter, with ``atexit`` handlers and non-daemon threads joined.

The zygote is single-threaded (a fork from a threaded process may copy a held
lock). It reaps its children and writes ``pid status`` lines, which
:class:`Forked` (a :class:`subprocess.Popen` stand-in with ``pid``, ``poll``,
``wait`` and ``returncode``) reads. Signals go to the rank's pid or process
group directly, as before.

Used only where the environment matches the one the zygote imported torch
under (the keys torch and its thread pools read at import); any other rank
starts cold. Only with ``HETCTL_TEST_ZYGOTE=1`` (``tests/conftest.py`` sets it): the benches that
time ranks (``bench/engine_quality.py`` and others import the rank runner) start them cold, as
``hetctl launch`` does.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import threading
import time

# Read by torch or its thread pools at import: a rank with other values must not inherit the zygote's.
IMPORT_KEYS = ("OMP_", "MKL_", "KMP_", "GOMP_", "TORCH_", "PYTORCH_", "ATEN_", "CUDA_", "LD_", "PYTHON")

SERVER = r'''
import json, os, select, signal, sys
import torch, torch.distributed  # the point of it

def child(req, told):
    os.setsid()
    os.close(told)  # the parent replies once the session exists, so a killpg right after never misses
    fd = os.open(os.devnull, os.O_RDONLY)
    os.dup2(fd, 0)
    os.close(fd)
    for target, path in ((1, req["out"]), (2, req["err"])):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    import io, runpy
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)),
                                                   encoding="utf-8", write_through=unbuffered)
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.BufferedWriter(io.FileIO(2, "w", closefd=False)),
                                                   encoding="utf-8", errors="backslashreplace", line_buffering=True)
    sys.argv = [req["module"], *req["args"]]
    runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
    sys.exit(0)

def main():
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    inbox = os.fdopen(os.dup(0), "rb", buffering=0)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)  # a child's end wakes select at once
    reply.write("ready\n")
    buf = b""
    while True:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if not pid:
                break
            reply.write(f"exit {pid} {os.waitstatus_to_exitcode(status)}\n")
        ready, _, _ = select.select([inbox, wake_r], [], [], 1.0)
        if wake_r in ready:
            os.read(wake_r, 4096)
        if inbox not in ready:
            continue
        data = inbox.read(65536)
        if not data:
            return
        buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            req = json.loads(line)
            sid_r, sid_w = os.pipe()
            pid = os.fork()
            if pid == 0:
                reply.close()
                inbox.close()
                signal.set_wakeup_fd(-1)
                for fd in (wake_r, wake_w, sid_r):
                    os.close(fd)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                child(req, sid_w)
            os.close(sid_w)
            os.read(sid_r, 1)  # EOF: the child has its own session (or has died)
            os.close(sid_r)
            reply.write(f"started {pid}\n")

main()
'''


def _import_env(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(IMPORT_KEYS)))


class Forked:
    """A rank forked by the zygote, as much of :class:`subprocess.Popen` as the tests use."""

    def __init__(self, zygote: "Zygote", pid: int) -> None:
        self.zygote, self.pid, self.returncode = zygote, pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.exits.get(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.zygote.cond:
            while self.poll() is None:
                if self.zygote.dead:
                    raise RuntimeError(f"the test zygote ended; rank pid {self.pid}'s exit is unknown")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout)
                self.zygote.cond.wait(0.2 if left is None else min(left, 0.2))
        return self.returncode


class Zygote:
    """One fork server (started on first use; ended with the test process)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = dict(env)
        self.proc = subprocess.Popen([sys.executable, "-c", SERVER], env=self.env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, start_new_session=True)
        self.exits: dict[int, int] = {}
        self.dead = False
        self.cond = threading.Condition()
        self.started: list[int] = []
        if self.proc.stdout.readline() != b"ready\n":
            raise RuntimeError("the test zygote did not start")
        threading.Thread(target=self._read, daemon=True, name="zygote-reader").start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            word, pid, *rest = line.decode().split()
            with self.cond:
                if word == "exit":
                    self.exits[int(pid)] = int(rest[0])
                else:  # a reused pid: an earlier child's exit is not this one's
                    self.exits.pop(int(pid), None)
                    self.started.append(int(pid))
                self.cond.notify_all()
        with self.cond:  # the zygote is gone: its children can no longer be reported
            self.dead = True
            self.cond.notify_all()

    def spawn(self, module: str, args: list[str], env: dict[str, str], out: str, err: str) -> Forked:
        req = {"module": module, "args": args, "env": env, "cwd": os.getcwd(), "out": out, "err": err}
        with self.cond:
            seen = len(self.started)
            self.proc.stdin.write(json.dumps(req).encode() + b"\n")
            self.proc.stdin.flush()
            deadline = time.monotonic() + 60
            while len(self.started) == seen:
                if self.dead or time.monotonic() > deadline:
                    raise RuntimeError("the test zygote did not fork")
                self.cond.wait(0.2)
            return Forked(self, self.started[seen])

    def close(self) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()


_ZYGOTES: dict[tuple, Zygote] = {}
_LOCK = threading.Lock()


def spawn(argv: list[str], env: dict[str, str], out: str, err: str) -> Forked | None:
    """The rank ``argv`` (``python -m MODULE …``) forked from a zygote; None where it must start cold."""
    if os.environ.get("HETCTL_TEST_ZYGOTE") != "1" or not hasattr(os, "fork"):
        return None
    if len(argv) < 3 or argv[0] != sys.executable or argv[1] != "-m":
        return None
    key = _import_env(env)
    with _LOCK:
        z = _ZYGOTES.get(key)
        if z is None or z.proc.poll() is not None:
            z = _ZYGOTES[key] = Zygote(env)
    return z.spawn(argv[2], list(argv[3:]), env, out, err)


@atexit.register
def _close_all() -> None:
    for z in _ZYGOTES.values():
        z.close()
