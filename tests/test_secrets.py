"""Secrets from an inventory's ``env:`` never reach a command line, a log, an event or a run file.

A poller reads every ``/proc/*/cmdline`` on this machine while real commands run
through the local transport (the controller's side and a node's side are the
same machine here), so a value that is ever on a command line, even for the
milliseconds before an ``exec``, is caught.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
from pathlib import Path

from hetctl.files.inventory import Node
from hetctl.launch.materialize import mask_env
from hetctl.remote.local import LocalTransport

SECRET = "hf_Zq9Secret_value_0123456789"
DIGEST = hashlib.sha256(SECRET.encode()).hexdigest()


class CmdlinePoller:
    """Reads every process's command line in a loop until stopped; remembers the ones holding ``needle``."""

    def __init__(self, needle: str) -> None:
        self.needle = needle.encode()
        self.hits: list[str] = []
        self.scans = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        me = str(os.getpid())
        while not self._stop.is_set():
            for pid in os.listdir("/proc"):
                if not pid.isdigit() or pid == me:
                    continue
                try:
                    data = Path(f"/proc/{pid}/cmdline").read_bytes()
                except OSError:
                    continue
                if self.needle in data:
                    self.hits.append(data.replace(b"\0", b" ").decode(errors="replace"))
            self.scans += 1

    def __enter__(self) -> "CmdlinePoller":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def test_env_values_travel_on_stdin_not_on_any_command_line(tmp_path):
    node = Node(name="here", host="localhost", transport="local", python=sys.executable, workdir=str(tmp_path),
                env={"HF_TOKEN": SECRET, "PYTHONPATH": str(tmp_path / "lib")})
    t = LocalTransport(node)
    # The programs compare a digest: the secret itself must not be on their own command lines either.
    probe = ("import hashlib, os, sys, time; data = sys.stdin.read(); time.sleep(0.3); "
             "print(hashlib.sha256(os.environ['HF_TOKEN'].encode()).hexdigest() == %r, os.environ['PYTHONPATH'], "
             "os.environ['EXTRA'], repr(data))" % DIGEST)
    with CmdlinePoller(SECRET) as poller:
        for _ in range(5):
            res = t.run([sys.executable, "-c", probe], env={"EXTRA": "x y"}, input=b"the input\n", timeout=60)
            assert res.stdout.split() == ["True", str(tmp_path / "lib"), "x", "y", "'the", "input\\n'"]
        proc = t.start([sys.executable, "-c", "import hashlib, os, sys; "
                        "print(hashlib.sha256(os.environ['HF_TOKEN'].encode()).hexdigest() == %r); "
                        "print(sys.stdin.readline().strip())" % DIGEST])
        proc.stdin.write(b"after the env line\n")
        proc.close_stdin()
        assert proc.stdout.read().decode().split("\n")[:2] == ["True", "after the env line"]
        proc.wait(30)
    assert poller.scans > 10  # the poller really ran while the commands did
    assert poller.hits == []


def test_dry_run_masks_names_that_look_secret():
    env = {"HF_TOKEN": "a", "WANDB_API_KEY": "b", "DATABASE_URL": "postgres://u:pw@h/db", "AWS_SECRET_ACCESS_KEY": "c",
           "MY_PASSWORD": "d", "NCCL_SOCKET_IFNAME": "bond0", "OMP_NUM_THREADS": "4"}
    masked = mask_env(env, public=["NCCL_SOCKET_IFNAME", "OMP_NUM_THREADS", "HF_TOKEN"])
    assert {k for k, v in masked.items() if v == "***"} == {"HF_TOKEN", "WANDB_API_KEY", "DATABASE_URL",
                                                            "AWS_SECRET_ACCESS_KEY", "MY_PASSWORD"}
    assert masked["NCCL_SOCKET_IFNAME"] == "bond0"
