"""One task of a shared Slurm step: the node's end of :mod:`hetctl.remote.slurmstep` (stdlib only).

Runs on every node of one ``srun`` step (one task per node, one step per
heterogeneous component, issue 36) as ``python -c <this file> NODE``. srun gives
every task the same stdin, so each line on it names the node it is for,
``{"n": NODE, "op": …}``; this task acts on the lines that name its node and skips
the rest unread (a prefix test, no JSON decoding of other nodes' lines):

* ``spawn`` ``{"argv": […], "cwd": …}``: start the node's program (its agent) in a session of its own;
* ``in`` ``{"z": base64(zlib(bytes))}``: bytes for the program's stdin;
* ``eof``: close the program's stdin (an agent then stops its ranks and exits);
* ``kill``: SIGKILL the program's process group (its ranks die with it: ``PR_SET_PDEATHSIG``).

Out, on stdout, every line the program writes, in pieces that stay under Slurm's
1,024-byte I/O message (slurmstepd cuts a longer line, and ``srun --label`` would
label each cut piece as a line of its own): one piece per line, ``KIND MORE PAYLOAD``,
``KIND`` ``o`` (the program's stdout), ``e`` (its stderr) or ``x`` (this task's own JSON
record), ``MORE`` ``+`` when the line goes on in the next piece and ``.`` on its last.
``x`` records: ``{"hello": NODE, "pid": PID}`` first, then ``{"spawned": PID}``,
``{"exit": CODE}`` once the program has ended and both its streams are drained.

Its stdin ends (the controller's srun closed it, or the controller died): the
program's stdin is closed, as a step of its own would close it, and this task ends
with the program. SIGTERM (``scancel --signal=TERM`` of the step) is passed on to it.
"""

import base64
import json
import os
import signal
import subprocess
import sys
import threading
import zlib

PIECE = 900  # payload bytes per piece: with its kind, flag and newline well under slurmstepd's 1,024
_out = threading.Lock()


def _write_all(data: bytes) -> None:
    while data:
        data = data[os.write(1, data):]


def emit(kind: bytes, line: bytes, more: bool = False, label: bytes = b"") -> None:
    """One line of ``kind`` (without its newline) as pieces; ``more``: the line is not complete yet;
    ``label``: what goes in front of each piece (a relay's task label; srun puts its own)."""
    pieces = [line[i:i + PIECE] for i in range(0, len(line), PIECE)] or [b""]
    with _out:
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1 and not more
            _write_all(label + kind + (b"." if last else b"+") + piece + b"\n")


def record(obj: dict, label: bytes = b"") -> None:
    emit(b"x", json.dumps(obj, separators=(",", ":")).encode(), label=label)


def pump(fd: int, kind: bytes, label: bytes = b"") -> None:
    """Every line of ``fd`` out as ``kind`` pieces; a line longer than a piece goes out as it comes."""
    buf = b""
    while True:
        try:
            data = os.read(fd, 1 << 16)
        except OSError:
            data = b""
        if not data:
            break
        buf += data
        *lines, buf = buf.split(b"\n")
        for line in lines:
            emit(kind, line, label=label)
        if len(buf) >= PIECE:  # a long line: send what is here, keep the memory bounded
            cut = len(buf) - len(buf) % PIECE
            emit(kind, buf[:cut], more=True, label=label)
            buf = buf[cut:]
    if buf:
        emit(kind, buf, label=label)
    os.close(fd)


class Task:
    """One node's program and what the stdin asks of it; ``label`` goes in front of its pieces (a relay's),
    ``ended`` is called once it has ended and its streams are drained."""

    def __init__(self, me: str, label: bytes = b"", ended=None) -> None:
        self.me, self.label, self.ended = me, label, ended
        self.prefix = ('{"n": ' + json.dumps(me) + ",").encode()
        self.proc = None

    def handle(self, msg: dict) -> None:
        op = msg.get("op")
        if op == "spawn" and self.proc is None:
            self.spawn([str(a) for a in msg.get("argv") or []], msg.get("cwd"))
        elif self.proc is None:
            return
        elif op == "in":
            try:
                self.proc.stdin.write(zlib.decompress(base64.b64decode(msg.get("z") or "")))
                self.proc.stdin.flush()
            except (OSError, ValueError, zlib.error):
                pass  # it exited: its exit record says so
        elif op == "eof":
            self.close()
        elif op == "kill":
            self.signal(signal.SIGKILL, group=True)

    def spawn(self, argv: list, cwd) -> None:
        if argv and argv[0].startswith("~/"):
            argv[0] = os.path.expanduser(argv[0])
        try:
            self.proc = subprocess.Popen(argv, cwd=os.path.expanduser(cwd) if cwd else None, stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        except (OSError, ValueError) as e:
            what = "cannot enter %s" % cwd if isinstance(e, OSError) and e.filename == cwd and cwd else \
                "cannot run %s" % (argv[:1] or ["nothing"])[0]
            emit(b"e", ("hetctl: %s: %s" % (what, getattr(e, "strerror", None) or e)).encode(), label=self.label)
            self.finish(127)
            return
        record({"spawned": self.proc.pid}, self.label)
        pumps = [threading.Thread(target=pump, args=(s.fileno(), k, self.label), daemon=True)
                 for s, k in ((self.proc.stdout, b"o"), (self.proc.stderr, b"e"))]
        for t in pumps:
            t.start()
        threading.Thread(target=self._reap, args=(pumps,), daemon=True).start()

    def _reap(self, pumps: list) -> None:
        code = self.proc.wait()
        for t in pumps:
            t.join()
        self.finish(code if code >= 0 else 128 - code)

    def finish(self, code: int) -> None:
        record({"exit": code}, self.label)
        if self.ended is not None:
            self.ended(self)

    def close(self) -> None:
        try:
            self.proc.stdin.close()
        except (OSError, AttributeError):
            pass

    def signal(self, sig: int, group: bool = False) -> None:
        if self.proc is not None:
            try:
                (os.killpg if group else os.kill)(self.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


def main(me: str) -> None:
    """A task of a Slurm step: this node's program, addressed by the node's name."""
    task = Task(me, ended=lambda t: os._exit(0))
    signal.signal(signal.SIGTERM, lambda signum, frame: task.signal(signal.SIGTERM) if task.proc else os._exit(143))
    record({"hello": me, "pid": os.getpid()})
    for line in sys.stdin.buffer:
        if not line.startswith(task.prefix):
            continue  # another node's line
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        if isinstance(msg, dict) and msg.get("n") == me:
            task.handle(msg)
    if task.proc is None:
        os._exit(0)
    task.close()  # the step's stdin ended: as a node's own step would, end the program's
    threading.Event().wait()  # the task's end ends this process


class Relay:
    """A relay (``--relay``): the programs of a group of nodes, each spawned with its label ``t``; it ends once
    its stdin has ended and every program with it."""

    def __init__(self) -> None:
        self.tasks: dict = {}
        self.done: set = set()  # the names of the tasks whose program has ended
        self.lock = threading.Lock()
        self.closed = False

    def ended(self, task: Task) -> None:
        with self.lock:
            self.done.add(task.me)
            if self.closed and len(self.done) == len(self.tasks):
                os._exit(0)

    def run(self) -> None:
        signal.signal(signal.SIGTERM, lambda signum, frame: [t.signal(signal.SIGTERM) for t in list(self.tasks.values())])
        for line in sys.stdin.buffer:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if not isinstance(msg, dict) or not isinstance(msg.get("n"), str):
                continue
            task = self.tasks.get(msg["n"])
            if task is None and msg.get("op") == "spawn" and isinstance(msg.get("t"), int):
                with self.lock:
                    task = self.tasks[msg["n"]] = Task(msg["n"], b"%d: " % msg["t"], self.ended)
            if task is not None:
                task.handle(msg)
        with self.lock:
            self.closed = True
            tasks = list(self.tasks.values())
            if len(self.done) == len(tasks):
                os._exit(0)
        for task in tasks:
            task.close()  # the controller's link ended: end every program's stdin, as its own link would
        threading.Event().wait()


if __name__ == "__main__":
    Relay().run() if sys.argv[1] == "--relay" else main(sys.argv[1])
