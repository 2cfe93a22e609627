"""A real Slurm mini-cluster on this machine, for integration tests.

:class:`SlurmCluster` starts, under one temp folder and without systemd:

* one ``munged`` with its own key and socket (``AuthInfo=socket=…`` in slurm.conf,
  so clients never look at ``/run/munge``);
* one ``slurmctld`` on ``127.0.0.1:<free port>``;
* one ``slurmd -D -N <node>`` per node (Debian's slurm-wlm is built with
  multiple-slurmd support), each with ``NodeAddr=127.0.0.<N>`` and its own
  ``Port=``, in a private UTS+mount namespace so that ``hostname`` in a step is
  the node name and resolves through a bind-mounted copy of ``/etc/hosts``.

Nodes differ the way a mixed site does: ``Gres=`` (``gpu:2``, ``npu:2``, none)
backed by fake device files (character devices 1:3, ``/dev/null``'s numbers) in
the node's fake root, and ``Features=`` (``nvidia``, ``ascend``, ``cpu``). A
``TaskProlog`` gives every task of a node the same environment the sshd fixture
gives a session: the node's ``bin/`` first on ``PATH`` (replayed vendor tools,
:meth:`SlurmNode.install_tool`), ``HETCTL_SYSFS_ROOT`` = the node's fake root,
and the marker ``HETCTL_TEST_SLURM=<cluster>:<node>``. The marker is also in each
slurmd's environment, which its slurmstepds inherit: :meth:`SlurmCluster.leftovers`
finds every daemon, step daemon and task the cluster started, even after a slurmd
was killed (slurmstepd outlives slurmd by design).

Clients need :attr:`SlurmCluster.env` (``SLURM_CONF``). Nodes share this
machine's network namespace, so ranks on two nodes cannot bind the same port.
Needs root and the ``slurmctld``, ``slurmd``, ``srun`` and ``munged`` binaries
(Debian: ``slurmctld slurmd slurm-client munge``). Starting takes a few seconds.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import psutil

from tests.helpers import procscan
from tests.helpers.sshd import Members, SshdHost

MARKER_ENV = "HETCTL_TEST_SLURM"
BINARIES = ("slurmctld", "slurmd", "srun", "salloc", "scontrol", "munged", "unshare")


def missing_binaries() -> list[str]:
    """The programs the fixture needs that are not on PATH (empty when it can run)."""
    return [b for b in BINARIES if shutil.which(b) is None]


def skip_reason() -> str | None:
    """Why a real Slurm cluster cannot be started here, or None when it can."""
    if os.geteuid() != 0:
        return "needs root to run slurmctld/slurmd/munged"
    missing = missing_binaries()
    if missing:
        return (f"Slurm binaries missing ({', '.join(missing)}): apt-get install -y --no-install-recommends "
                "slurmctld slurmd slurm-client munge")
    return None


@dataclass(frozen=True)
class NodeSpec:
    """One node as slurm.conf will describe it."""

    name: str
    cpus: int = 4
    gres: str = ""  # "gpu:2": type and count; device files are made for it
    features: str = ""
    memory_mb: int = 1000


DEFAULT_NODES = (
    NodeSpec("n1", 4, "gpu:2", "nvidia"),
    NodeSpec("n2", 4, "npu:2", "ascend"),
    NodeSpec("n3", 2, "", "cpu"),
)
# The device files a Gres type stands for, as the collector looks for them in /dev.
GRES_DEVICE = {"gpu": "nvidia", "npu": "davinci"}


def _free_port(addr: str) -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def marked(marker: str, needle_paths: tuple[str, ...] = ()) -> list[psutil.Process]:
    """Live processes with ``HETCTL_TEST_SLURM=marker[:…]`` in their environment, or a path in their argv."""
    paths = tuple(p.encode() for p in needle_paths)
    return [p for p in procscan.marked(MARKER_ENV, marker, lambda cmd: any(x in cmd for x in paths)) if _running(p)]


class SlurmNode:
    """One slurmd and the folders its tasks see."""

    # Replay tools work exactly as on an sshd host: they need only ``dir``, ``bin``, ``install_script``.
    install_script = SshdHost.install_script
    install_tool = SshdHost.install_tool

    def __init__(self, cluster: SlurmCluster, index: int, spec: NodeSpec) -> None:
        self.cluster, self.index, self.spec = cluster, index, spec
        self.name = spec.name
        self.addr = f"127.0.0.{2 + index}"
        self.dir = cluster.root / "nodes" / spec.name
        self.bin = self.dir / "bin"
        self.sysfs_root = self.dir / "fakeroot"
        self.spool = self.dir / "spool"
        self.log = self.dir / "slurmd.log"
        self.port = 0
        self.proc: subprocess.Popen | None = None
        for d in (self.bin, self.sysfs_root / "dev", self.sysfs_root / "sys/bus/pci/devices", self.spool, self.dir / "replay"):
            d.mkdir(parents=True, exist_ok=True)

    def __repr__(self) -> str:
        return f"SlurmNode({self.name} {self.addr}:{self.port})"

    @property
    def marker(self) -> str:
        return f"{self.cluster.id}:{self.name}"

    @property
    def gres_files(self) -> list[Path]:
        """The fake device files behind this node's Gres (``<fakeroot>/dev/nvidia0`` …)."""
        if not self.spec.gres:
            return []
        kind, _, count = self.spec.gres.partition(":")
        prefix = GRES_DEVICE.get(kind, kind)
        return [self.sysfs_root / "dev" / f"{prefix}{i}" for i in range(int(count or 1))]

    def make_devices(self) -> None:
        for path in self.gres_files:
            if not path.exists():
                os.mknod(path, 0o666 | 0o020000, os.makedev(1, 3))  # S_IFCHR, like /dev/null

    def start(self) -> None:
        """Start this node's slurmd (in its own UTS+mount namespace); returns at once."""
        body = (f"hostname {self.name} && mount --bind {self.cluster.hosts_file} /etc/hosts && "
                f"exec slurmd -D -N {self.name}")
        env = {**os.environ, **self.cluster.env, MARKER_ENV: self.marker}
        with self.log.with_suffix(".out").open("ab") as out:
            self.proc = subprocess.Popen(
                ["unshare", "--uts", "--mount", "--propagation", "private", "sh", "-c", body],
                stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env, start_new_session=True,
            )

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def processes(self) -> list[psutil.Process]:
        """This node's slurmd, its slurmstepds and their tasks (all carry the node's marker)."""
        return marked(self.marker)

    def kill(self) -> None:
        """Lose this node: SIGSTOP then SIGKILL its slurmd, its step daemons and every task."""
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            seen: set[int] = set()
            while True:  # until no new process appears (a stepd forking a task)
                fresh = [p for p in self.processes() if p.pid not in seen]
                if not fresh:
                    break
                for p in fresh:
                    seen.add(p.pid)
                    try:
                        p.send_signal(sig)
                    except psutil.NoSuchProcess:
                        pass
        if self.proc is not None:
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + 5
        while self.processes() and time.monotonic() < deadline:
            time.sleep(0.05)


class SlurmCluster(Members):
    """munged + slurmctld + one slurmd per node under ``root``; a context manager, or call start/stop.

    Args:
        root: an empty folder (it holds the config, state, logs, key and the nodes' folders).
        nodes: the nodes (default: n1 ``gpu:2``/nvidia, n2 ``npu:2``/ascend, n3 cpu).
    """

    def __init__(self, root: Path, nodes: tuple[NodeSpec, ...] | list[NodeSpec] = DEFAULT_NODES,
                 topology: str | None = None) -> None:
        self.topology = topology  # topology.conf's text: then TopologyPlugin=topology/tree
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.id = uuid.uuid4().hex[:12]
        self.nodes = [SlurmNode(self, i, s) for i, s in enumerate(nodes)]
        self.conf = self.root / "slurm.conf"
        self.hosts_file = self.root / "hosts"
        # munged wants every folder above its socket to be o+x (a pytest tmp folder is 0700): its own one in /tmp
        self.munge_dir = Path(tempfile.mkdtemp(prefix=f"hetctl-munge-{self.id}-"))
        self.munge_socket = self.munge_dir / "munge.sock"
        self.task_prolog = self.root / "task-prolog.sh"
        self.ctld_port = 0
        self.ctld: subprocess.Popen | None = None
        self.munged_pid: int | None = None
        self.env = {"SLURM_CONF": str(self.conf)}

    @property
    def members(self) -> list[SlurmNode]:
        return self.nodes

    @property
    def names(self) -> list[str]:
        return [n.name for n in self.nodes]

    # --- configuration ---------------------------------------------------------

    def _write_configs(self) -> None:
        for d in ("state", "log", "run", "jobs"):
            (self.root / d).mkdir(exist_ok=True)
        self.munge_dir.mkdir(mode=0o755, exist_ok=True)
        os.chmod(self.munge_dir, 0o755)  # o+x, no g/o write
        key = self.munge_dir / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(1024))
            key.chmod(0o400)
        hosts = Path("/etc/hosts").read_text().rstrip("\n") + "\n"
        node_lines, gres_lines, gres_types = [], [], []
        for n in self.nodes:
            n.port = _free_port(n.addr)
            n.make_devices()
            s = n.spec
            line = (f"NodeName={s.name} NodeHostname={s.name} NodeAddr={n.addr} Port={n.port} "
                    f"CPUs={s.cpus} RealMemory={s.memory_mb}")
            if s.features:
                line += f" Features={s.features}"
            if s.gres:
                kind = s.gres.partition(":")[0]
                line += f" Gres={s.gres}"
                files = n.gres_files
                # gres.conf File= is what makes a gpu count (without it the node goes INVAL)
                gres_lines.append(f"NodeName={s.name} Name={kind} File={files[0].parent}/"
                                  f"{GRES_DEVICE.get(kind, kind)}[0-{len(files) - 1}]")
                if kind not in gres_types:
                    gres_types.append(kind)
            node_lines.append(line)
            hosts += f"{n.addr} {s.name}\n"
        self.hosts_file.write_text(hosts)
        (self.root / "gres.conf").write_text("".join(ln + "\n" for ln in gres_lines))
        # The prolog's "export K=V" lines become the task's environment: per-node PATH, fake root, marker.
        cases = "".join(
            f"  {n.name}) echo 'export PATH={n.bin}:'\"$PATH\"; echo 'export HETCTL_SYSFS_ROOT={n.sysfs_root}';"
            f" echo 'export {MARKER_ENV}={n.marker}' ;;\n" for n in self.nodes)
        self.task_prolog.write_text(f'#!/bin/sh\ncase "$SLURMD_NODENAME" in\n{cases}esac\n')
        self.task_prolog.chmod(0o755)
        self.ctld_port = _free_port("127.0.0.1")
        r = self.root
        if self.topology is not None:
            (r / "topology.conf").write_text(self.topology)
        self.conf.write_text(f"""# slurm.conf for hetctl tests (cluster {self.id})
ClusterName=hetctl{self.id[:6]}
SlurmctldHost={socket.gethostname().split('.')[0]}(127.0.0.1)
SlurmctldPort={self.ctld_port}
SlurmdPort={_free_port('127.0.0.1')}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/nodes/%n/spool
SlurmctldPidFile={r}/run/slurmctld.pid
SlurmdPidFile={r}/run/slurmd.%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/nodes/%n/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
MailProg={shutil.which('true')}
TaskProlog={self.task_prolog}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
SlurmdTimeout=10
SlurmctldTimeout=10
MessageTimeout=10
InactiveLimit=0
KillWait=2
MinJobAge=300
JobRequeue=0
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=1
{('GresTypes=' + ','.join(gres_types)) if gres_types else ''}
{'TopologyPlugin=topology/tree' if self.topology is not None else ''}
{chr(10).join(node_lines)}
PartitionName=all Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")

    # --- lifecycle -------------------------------------------------------------

    def client(self, *argv: str, timeout: float = 30, check: bool = True) -> subprocess.CompletedProcess:
        """Run a Slurm client command (``sinfo``, ``scontrol``…) against this cluster."""
        return subprocess.run(list(argv), env={**os.environ, **self.env}, capture_output=True, text=True,
                              timeout=timeout, check=check)

    def _start_munge(self) -> None:
        pidfile = self.munge_dir / "munged.pid"
        r = subprocess.run(["munged", f"--key-file={self.munge_dir / 'munge.key'}", f"--socket={self.munge_socket}",
                            f"--pid-file={pidfile}", f"--log-file={self.root / 'log' / 'munged.log'}",
                            f"--seed-file={self.munge_dir / 'munged.seed'}", "--num-threads=4"],
                           capture_output=True, text=True, env={**os.environ, MARKER_ENV: self.id})
        if r.returncode != 0:
            raise RuntimeError(f"slurm fixture: munged failed: {r.stderr.strip()}")
        self.munged_pid = int(pidfile.read_text().strip())

    def _wait(self, what: str, ok, timeout: float, log: Path) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ok():
                return
            time.sleep(0.1)
        tail = log.read_text()[-2000:] if log.exists() else "(no log)"
        self.stop()
        raise RuntimeError(f"slurm fixture: {what} not ready after {timeout:g} s; {log}:\n{tail}")

    def _ctld_up(self) -> bool:
        r = self.client("scontrol", "ping", check=False, timeout=10)
        return "UP" in r.stdout

    def node_states(self) -> dict[str, str]:
        """Node name → state as sinfo prints it (``idle``, ``alloc``, ``down*`` …)."""
        r = self.client("sinfo", "-h", "-N", "-o", "%N %T", check=False)
        return dict(ln.split(None, 1) for ln in r.stdout.splitlines() if ln.strip())

    def wait_idle(self, names: list[str] | None = None, timeout: float = 40) -> None:
        want = names or self.names

        def ready() -> bool:
            states = self.node_states()
            return all(states.get(n, "").rstrip("*~#") in ("idle", "mixed", "allocated") and not states[n].endswith("*")
                       for n in want)

        self._wait(f"nodes {want}", ready, timeout, self.root / "log" / "slurmctld.log")

    def start(self) -> SlurmCluster:
        """Write the configs, start munged, slurmctld and every slurmd; return when all nodes are idle."""
        self._write_configs()
        self._start_munge()
        env = {**os.environ, **self.env, MARKER_ENV: self.id}
        with (self.root / "log" / "slurmctld.out").open("ab") as out:
            self.ctld = subprocess.Popen(["slurmctld", "-D", "-i"], stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                         env=env, start_new_session=True)
        self._wait("slurmctld", self._ctld_up, 30, self.root / "log" / "slurmctld.log")
        for n in self.nodes:
            n.start()
        self.wait_idle()
        return self

    def start_node(self, name: str, wait: bool = True) -> None:
        """(Re)start one node's slurmd, e.g. after :meth:`SlurmNode.kill`."""
        self[name].start()
        if wait:
            self.wait_idle([name], timeout=60)

    def cancel_all(self) -> None:
        """Cancel every job and wait (briefly) for the queue to empty."""
        if self.ctld is None or self.ctld.poll() is not None:
            return
        self.client("scancel", "--full", "--user=root", check=False)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and self.client("squeue", "-h", check=False).stdout.strip():
            time.sleep(0.2)

    def kill_controller(self) -> None:
        """SIGKILL slurmctld (the nodes and their steps keep running, as on a real site)."""
        if self.ctld is not None and self.ctld.poll() is None:
            self.ctld.kill()
            self.ctld.wait(5)

    def stop(self) -> None:
        """Cancel jobs, then kill every node (slurmd, stepds, tasks), slurmctld and munged. Idempotent."""
        try:
            self.cancel_all()
        except (OSError, subprocess.SubprocessError):
            pass
        for n in self.nodes:
            n.kill()
        if self.ctld is not None and self.ctld.poll() is None:
            self.ctld.terminate()
            try:
                self.ctld.wait(10)
            except subprocess.TimeoutExpired:
                self.ctld.kill()
                self.ctld.wait(5)
        if self.munged_pid is not None:
            try:
                p = psutil.Process(self.munged_pid)
                if p.name() == "munged":
                    p.terminate()
                    p.wait(5)
            except (psutil.NoSuchProcess, psutil.TimeoutExpired):
                pass
            self.munged_pid = None
        deadline = time.monotonic() + 5
        while self.leftovers() and time.monotonic() < deadline:
            time.sleep(0.05)
        shutil.rmtree(self.munge_dir, ignore_errors=True)

    def leftovers(self) -> list[psutil.Process]:
        """Live processes this cluster started: daemons, step daemons, tasks (marker or our paths in argv)."""
        return marked(self.id, (str(self.conf), str(self.munge_socket)))

    def steps(self) -> list[str]:
        """Running job steps (``jobid.stepid``), as squeue lists them."""
        r = self.client("squeue", "-h", "-s", "-o", "%i", check=False)
        return [s for s in r.stdout.split() if "." in s]
