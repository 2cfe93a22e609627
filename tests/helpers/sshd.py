"""Real OpenSSH servers on loopback addresses, for integration tests.

:class:`SshdCluster` starts one ``/usr/sbin/sshd -D -e`` per test host on
``127.0.0.<N>:<free port>`` (all of 127/8 is loopback on Linux), each with its own
ed25519 host key, one shared client key pair, and a ``known_hosts`` that lists
every host. Sessions on a host get, through ``SetEnv``:

* ``PATH`` = the host's ``bin/`` first, then this interpreter's folder and this
  process's PATH — so :meth:`SshdHost.install_tool` can put vendor tools that
  replay real captured output in front of everything else;
* ``HOME`` = the host's own home folder, so ``~`` differs per host;
* ``HETCTL_SYSFS_ROOT`` = the host's fake root (``<root>/sys/bus/pci/devices``,
  ``<root>/dev``), read by :mod:`hetctl.node.collector` instead of ``/``;
* ``HETCTL_TEST_SSHD`` = a marker naming cluster and host, by which
  :meth:`SshdCluster.leftovers` finds any process a test left behind, even one
  that left the sshd process tree.

A node loss is :meth:`SshdHost.kill`: SIGKILL to the host's sshd and to every
process started under it. Stopping the cluster does that for every host.

Site variants (keyword arguments of :class:`SshdCluster`): ``sftp=False`` (no sftp
subsystem, as on hardened sites), ``shared_home=True`` (every host's ``HOME`` is the
same folder, like an NFS home), ``host_ca=True`` (host certificates signed by a CA made
with ``ssh-keygen -s``; :attr:`SshdCluster.host_ca`), ``user_ca=True`` (the servers
trust user certificates signed by :attr:`SshdCluster.user_ca`), ``sshd_extra`` (per host
name, more ``sshd_config`` lines: a ``Banner``, a ``ForceCommand``).

Needs root (sshd's privilege separation) and ``ssh-keygen``.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import psutil
import yaml

from tests.helpers import procscan

SSHD = "/usr/sbin/sshd"
MARKER_ENV = "HETCTL_TEST_SSHD"
SYSFS_ENV = "HETCTL_SYSFS_ROOT"


@dataclass(frozen=True)
class Replay:
    """What a replay tool prints for one argument pattern.

    Args:
        stdout: a capture file (its first ``# source:`` line is dropped) or literal text.
        stderr: literal text for stderr.
        rc: the exit code.
    """

    stdout: Path | str = ""
    stderr: str = ""
    rc: int = 0


def strip_source_header(text: str) -> str:
    """Drop the first line of a capture when it is the ``# source:`` provenance line."""
    first, sep, rest = text.partition("\n")
    return rest if first.startswith("# source:") else text


def _case_pattern(glob: str) -> str:
    """A ``case`` pattern matching ``glob``: ``*`` and ``?`` stay wild, the rest is quoted."""
    parts = re.split(r"([*?])", glob)
    return "".join(p if p in ("*", "?") else (shlex.quote(p) if p else "") for p in parts) or "''"


_ACCEPTOR_READY = "hetctl-test-acceptor listening"
# inetd for one host: accept TCP here and run the command (sshd -i, in another network
# namespace) on each connection; that sshd's forwarding then starts from inside that namespace.
_ACCEPTOR = f"""
import signal, socket, subprocess, sys
signal.signal(signal.SIGCHLD, signal.SIG_IGN)
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen(64)
print({_ACCEPTOR_READY!r}, flush=True)
while True:
    c, _ = s.accept()
    subprocess.Popen(sys.argv[3:], stdin=c, stdout=c)
    c.close()
"""


class NetNs:
    """A network namespace with only its own loopback (``unshare --net``), held by one sleeping process.

    Hosts placed in it (``SshdCluster(netns=…)``) cannot be reached from the test
    process: only through a gateway host whose sessions run inside it.
    """

    def __init__(self) -> None:
        self.proc = subprocess.Popen(["unshare", "--net", "sh", "-c", "ip link set lo up && echo ready && exec sleep 86400"],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
        if self.proc.stdout.readline() != b"ready\n":
            self.proc.kill()
            raise RuntimeError("cannot make a network namespace (unshare --net)")

    @property
    def enter(self) -> list[str]:
        """The argv prefix that runs a command inside this namespace."""
        return ["nsenter", f"--net=/proc/{self.proc.pid}/ns/net"]

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.proc.stdout.close()


class ShapedNetNs(NetNs):
    """A :class:`NetNs` joined to this namespace by a veth pair whose two ends are rate-limited (``tc`` tbf).

    A host placed in it (``SshdCluster(netns={name: (ns, ns)}, addrs={name: ns.inner})``)
    reaches the hosts at :meth:`outer` addresses, and is reached by them and by the
    test process, only through the veth: a real slow link, both ways. Addresses are
    in 198.18.0.0/15 (RFC 2544's benchmarking range), one random /24 per instance.
    Needs root, ``ip`` and ``tc``.
    """

    def __init__(self, rate: str = "50mbit") -> None:
        import random

        super().__init__()
        used = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True).stdout
        free = [i for i in range(256) if f" 198.18.{i}." not in used]
        self.net = f"198.18.{random.choice(free)}"
        tag = f"{os.getpid() % 100000}{random.randrange(100)}"
        self.dev, peer = f"hxr{tag}"[:15], f"hxn{tag}"[:15]
        self.inner = f"{self.net}.2"
        self._outer = 10
        inside = self.enter
        try:
            for argv in (
                ["ip", "link", "add", self.dev, "type", "veth", "peer", "name", peer, "netns", str(self.proc.pid)],
                ["ip", "addr", "add", f"{self.net}.1/24", "dev", self.dev],
                ["ip", "link", "set", self.dev, "up"],
                [*inside, "ip", "addr", "add", f"{self.inner}/24", "dev", peer],
                [*inside, "ip", "link", "set", peer, "up"],
                ["tc", "qdisc", "add", "dev", self.dev, "root", "tbf", "rate", rate, "burst", "32kbit", "latency", "100ms"],
                [*inside, "tc", "qdisc", "add", "dev", peer, "root", "tbf", "rate", rate, "burst", "32kbit",
                 "latency", "100ms"],
            ):
                subprocess.run(argv, check=True, capture_output=True)
        except subprocess.CalledProcessError as e:
            self.stop()
            raise RuntimeError(f"cannot make the shaped link: {shlex.join(e.cmd)}: {e.stderr.decode().strip()}") from None

    def outer(self) -> str:
        """A new address on this namespace's end of the veth: a host listening there is reached through the link."""
        self._outer += 1
        addr = f"{self.net}.{self._outer}"
        subprocess.run(["ip", "addr", "add", f"{addr}/32", "dev", self.dev], check=True, capture_output=True)
        return addr

    def stop(self) -> None:
        subprocess.run(["ip", "link", "del", self.dev], capture_output=True)  # gone already when never made
        super().stop()


def _wait_all(jobs: list[subprocess.Popen]) -> None:
    for j in jobs:
        if j.wait() != 0:
            raise RuntimeError(f"ssh-keygen failed: {j.stderr.read().decode()}")
        j.stderr.close()


def _sign(ca: Path, key: Path, identity: str, principals: str, *, host: bool) -> subprocess.Popen:
    """``ssh-keygen -s``: write ``<key>-cert.pub`` signed by ``ca`` for ``principals``."""
    argv = ["ssh-keygen", "-q", "-s", str(ca), "-I", identity, "-n", principals, "-V", "-5m:+1d"]
    return subprocess.Popen(argv + (["-h"] if host else []) + [str(key.with_suffix(".pub"))],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def sign_user_key(ca: Path, key: Path, user: str) -> Path:
    """Sign ``key`` as a user certificate for ``user``; returns ``<key>-cert.pub``."""
    _wait_all([_sign(ca, key, f"hetctl-test-user-{user}", user, host=False)])
    return key.parent / f"{key.name}-cert.pub"


def _free_port(addr: str) -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def _keygen(path: Path, comment: str) -> subprocess.Popen:
    return subprocess.Popen(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


class SshdHost:
    """One test host: a running sshd and the folders its sessions see."""

    def __init__(self, cluster: SshdCluster, index: int, name: str, addr: str) -> None:
        self.cluster, self.index, self.name, self.addr = cluster, index, name, addr
        self.dir = cluster.root / name
        self.bin = self.dir / "bin"
        self.home = cluster.root / "shared-home" if cluster.shared_home else self.dir / "home"
        self.workdir = self.home / "work"
        self.sysfs_root = self.dir / "fakeroot"
        self.host_key = self.dir / "ssh_host_ed25519_key"
        self.config = self.dir / "sshd_config"
        self.log = self.dir / "sshd.log"
        self.port = 0
        self.env: dict[str, str] = {}
        self._ready_line: str | None = None
        self.proc: subprocess.Popen | None = None
        for d in (self.bin, self.workdir, self.sysfs_root / "sys/bus/pci/devices", self.sysfs_root / "dev", self.dir / "replay"):
            d.mkdir(parents=True, exist_ok=True)

    def __repr__(self) -> str:
        return f"SshdHost({self.name} {self.addr}:{self.port})"

    @property
    def marker(self) -> str:
        return f"{self.cluster.id}:{self.name}"

    @property
    def known_hosts_name(self) -> str:
        return f"[{self.addr}]:{self.port}"

    @property
    def host_public_key(self) -> str:
        """``ssh-ed25519 AAAA…`` (no comment), as it appears in known_hosts."""
        return " ".join(self.host_key.with_suffix(".pub").read_text().split()[:2])

    # --- lifecycle -------------------------------------------------------------

    def _write_config(self, extra_env: Mapping[str, str]) -> None:
        path = os.pathsep.join([str(self.bin), os.path.dirname(sys.executable), os.environ.get("PATH", "/usr/bin:/bin")])
        self.env = {"PATH": path, "HOME": str(self.home), SYSFS_ENV: str(self.sysfs_root), MARKER_ENV: self.marker, **extra_env}
        setenv = " ".join(f'"{k}={v}"' for k, v in self.env.items())
        extra = "Subsystem sftp internal-sftp\n" if self.cluster.sftp else "# no sftp subsystem\n"
        if self.cluster.host_ca:
            extra += f"HostCertificate {self.host_key}-cert.pub\n"
        if self.cluster.user_ca:
            extra += f"TrustedUserCAKeys {self.cluster.user_ca}.pub\n"
        extra += "".join(f"{line}\n" for line in self.cluster.sshd_extra.get(self.name, ()))
        self.config.write_text(
            f"""# sshd for hetctl tests: host {self.name}
ListenAddress {self.addr}
Port {self.port}
HostKey {self.host_key}
PidFile {self.dir / 'sshd.pid'}
AuthorizedKeysFile {self.cluster.authorized_keys}
StrictModes no
UsePAM no
PermitRootLogin yes
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
AllowTcpForwarding yes
UseDNS no
PrintMotd no
MaxStartups 200
MaxSessions 100
LogLevel INFO
{extra}SetEnv {setenv}
"""
        )

    def _spawn(self) -> None:
        try:
            self.port = _free_port(self.addr)
        except OSError:  # an address only another network namespace has
            self.port = _free_port("127.0.0.1")
        self._write_config(self.cluster.extra_env.get(self.name, {}))
        listen_ns, session_ns = self.cluster.netns.get(self.name, (None, None))
        sshd = [SSHD, "-D", "-e", "-f", str(self.config)]
        if session_ns is not listen_ns:  # a gateway: accept here, run each connection's sshd -i there
            sshd = [sys.executable, "-c", _ACCEPTOR, self.addr, str(self.port), *session_ns.enter,
                    SSHD, "-i", "-e", "-f", str(self.config)]
        argv = (listen_ns.enter if listen_ns else []) + sshd
        self._ready_line = None if not (listen_ns or session_ns) else (
            f"Server listening on {self.addr} port {self.port}" if session_ns is listen_ns else _ACCEPTOR_READY)
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log)

    def _wait_ready(self, deadline: float) -> bool:
        """Poll the port until sshd accepts; False when sshd exited (e.g. the port was taken).

        A host in another network namespace cannot be dialled from here: its log says when it listens.
        """
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            if self._ready_line is not None:
                if self._ready_line in self.log.read_text(errors="replace"):
                    return True
                time.sleep(0.02)
                continue
            try:
                with socket.create_connection((self.addr, self.port), timeout=0.5):
                    return True
            except OSError:
                time.sleep(0.02)
        raise RuntimeError(f"{self}: sshd did not listen in time; log:\n{self.log.read_text()}")

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def processes(self) -> list[psutil.Process]:
        """This host's sshd, every descendant, any sshd on its config, anything carrying its marker."""
        found: dict[int, psutil.Process] = {}
        if self.proc is not None and self.proc.poll() is None:  # once reaped, its pid may be reused
            try:
                root = psutil.Process(self.proc.pid)
                found[root.pid] = root
                for p in root.children(recursive=True):
                    found[p.pid] = p
            except psutil.NoSuchProcess:
                pass
        for p in _marked(self.marker, self.config):
            found.setdefault(p.pid, p)
        return list(found.values())

    def _signal_all(self, sig: int) -> list[psutil.Process]:
        """Send ``sig`` to the whole set until no new process appears (fork races)."""
        signalled: dict[int, psutil.Process] = {}
        while True:
            fresh = [p for p in self.processes() if p.pid not in signalled]
            if not fresh:
                return list(signalled.values())
            for p in fresh:
                try:
                    p.send_signal(sig)
                except psutil.NoSuchProcess:
                    pass
                signalled[p.pid] = p

    def kill(self) -> None:
        """Lose this node: freeze sshd and everything under it, then SIGKILL them all."""
        self._signal_all(signal.SIGSTOP)
        procs = self._signal_all(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(5)
        deadline = time.monotonic() + 5
        while any(_running(p) for p in procs) and time.monotonic() < deadline:
            time.sleep(0.01)  # dead but not yet reaped by init counts as gone

    def pause(self) -> None:
        """Cut the node off without closing anything: its processes stop, TCP stays open."""
        self._signal_all(signal.SIGSTOP)

    def resume(self) -> None:
        """Undo :meth:`pause`."""
        self._signal_all(signal.SIGCONT)

    # --- what sessions see -----------------------------------------------------

    def install_script(self, name: str, text: str) -> Path:
        """Put an executable called ``name`` first on this host's PATH."""
        path = self.bin / name
        path.write_text(text)
        path.chmod(0o755)
        return path

    def install_tool(self, name: str, cases: Mapping[str, Path | str | Replay]) -> Path:
        """Install a vendor tool that replays captured output, chosen by its arguments.

        Args:
            name: the program name (``nvidia-smi``).
            cases: glob pattern over the space-joined arguments (``"-L"``,
                ``"--query-gpu=*"``, ``"*"`` for anything) → a capture file
                (``Path``; its ``# source:`` line is dropped), literal text, or a
                :class:`Replay`. First match wins; no match prints a message to
                stderr and exits 2, as a real tool does on bad arguments.
        """
        lines = ["#!/bin/sh", f"# replay of {name} for hetctl tests: prints captured output chosen by the arguments", 'case "$*" in']
        for i, (pattern, value) in enumerate(cases.items()):
            rep = value if isinstance(value, Replay) else Replay(stdout=value)
            out = self.dir / "replay" / f"{name}.{i}.out"
            text = strip_source_header(rep.stdout.read_text()) if isinstance(rep.stdout, Path) else rep.stdout
            out.write_text(text)
            body = f"cat {shlex.quote(str(out))}"
            if rep.stderr:
                err = out.with_suffix(".err")
                err.write_text(rep.stderr)
                body += f"; cat {shlex.quote(str(err))} >&2"
            lines.append(f"  {_case_pattern(pattern)}) {body}; exit {rep.rc} ;;")
        lines.append(f'  *) echo "{name}: no capture for arguments: $*" >&2; exit 2 ;;')
        lines.append("esac")
        return self.install_script(name, "\n".join(lines) + "\n")


def _marked(marker: str, config: Path | None = None) -> list[psutil.Process]:
    """Live processes carrying ``HETCTL_TEST_SSHD=marker`` (or ``marker:…``), or running with ``config`` (sshd
    rewrites its argv into one title, which still names it)."""
    cfg = str(config).encode() if config else None
    return procscan.marked(MARKER_ENV, marker, lambda cmd: cfg is not None and cfg in cmd)


class Members:
    """A test cluster's hosts by index or name, iterable, and a context manager that starts and stops it.

    Subclasses set ``members`` and define ``start`` and ``stop``.
    """

    members: list

    def __getitem__(self, key: int | str):
        return self.members[key] if isinstance(key, int) else next(m for m in self.members if m.name == key)

    def __iter__(self):
        return iter(self.members)

    def __len__(self) -> int:
        return len(self.members)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class SshdCluster(Members):
    """``n`` real sshd hosts under ``root``; use as a context manager or call start/stop.

    Args:
        root: an empty folder for keys, configs, logs and the hosts' folders.
        n: how many hosts.
        names: node names (default ``node-1`` … ``node-n``).
        extra_env: per host name, more variables for its sessions (``SetEnv``).
        first_octet: hosts listen on ``127.0.0.<first_octet + i>``.
        sftp: run the sftp subsystem (False: like a hardened site without it).
        shared_home: every host's ``HOME`` is one folder (an NFS home).
        host_ca: sign every host key with :attr:`host_ca` (``HostCertificate``).
        user_ca: trust user certificates signed by :attr:`user_ca` (``TrustedUserCAKeys``).
        netns: per host name, ``(listen_in, sessions_in)`` :class:`NetNs` (None: this
            namespace). Different values make a gateway: it listens in the first, and
            each connection's sshd (and so its TCP forwarding) runs in the second.
        addrs: per host name, the address it listens on instead of ``127.0.0.<N>``
            (a :class:`ShapedNetNs` address).
        sshd_extra: per host name, more ``sshd_config`` lines (before ``SetEnv``, which must
            stay last: a ``Match`` block would swallow it).
    """

    def __init__(
        self,
        root: Path,
        n: int = 3,
        *,
        names: list[str] | None = None,
        extra_env: Mapping[str, Mapping[str, str]] | None = None,
        first_octet: int = 2,
        sftp: bool = True,
        shared_home: bool = False,
        host_ca: bool = False,
        user_ca: bool = False,
        netns: Mapping[str, tuple[NetNs | None, NetNs | None]] | None = None,
        addrs: Mapping[str, str] | None = None,
        sshd_extra: Mapping[str, list[str]] | None = None,
    ) -> None:
        self.root = Path(root)
        self.sshd_extra = {k: list(v) for k, v in (sshd_extra or {}).items()}
        self.root.mkdir(parents=True, exist_ok=True)
        self.sftp, self.shared_home = sftp, shared_home
        self.netns = dict(netns or {})
        self.host_ca = self.root / "host_ca" if host_ca else None
        self.user_ca = self.root / "user_ca" if user_ca else None
        self.id = uuid.uuid4().hex[:12]
        self.extra_env = {k: dict(v) for k, v in (extra_env or {}).items()}
        names = names or [f"node-{i + 1}" for i in range(n)]
        addrs = dict(addrs or {})
        self.hosts = [SshdHost(self, i, nm, addrs.get(nm, f"127.0.0.{first_octet + i}")) for i, nm in enumerate(names)]
        self.client_key = self.root / "id_ed25519"
        self.authorized_keys = self.root / "authorized_keys"
        self.known_hosts = self.root / "known_hosts"

    @property
    def members(self) -> list[SshdHost]:
        return self.hosts

    def start(self) -> SshdCluster:
        """Make keys, write configs and start every sshd in parallel; return when all listen."""
        Path("/run/sshd").mkdir(mode=0o755, parents=True, exist_ok=True)  # privilege-separation dir
        jobs = [_keygen(self.client_key, "hetctl-test-client")]
        jobs += [_keygen(h.host_key, f"hetctl-test-{h.name}") for h in self.hosts]
        jobs += [_keygen(ca, f"hetctl-test-{ca.name}") for ca in (self.host_ca, self.user_ca) if ca]
        _wait_all(jobs)
        if self.host_ca:  # principal: the address clients dial (known_hosts names it [addr]:port)
            _wait_all([_sign(self.host_ca, h.host_key, h.name, h.addr, host=True) for h in self.hosts])
        self.authorized_keys.write_text(self.client_key.with_suffix(".pub").read_text())
        pending = list(self.hosts)
        for _attempt in range(3):  # a port taken between probing and binding: retry on a new one
            for h in pending:
                h._spawn()
            deadline = time.monotonic() + 15
            pending = [h for h in pending if not h._wait_ready(deadline)]
            if not pending:
                break
        if pending:
            self.stop()
            raise RuntimeError(f"sshd failed to start on {pending}: {pending[0].log.read_text()}")
        self.write_known_hosts()
        return self

    def write_known_hosts(self, path: Path | None = None) -> Path:
        """known_hosts listing every host as ``[addr]:port keytype key``."""
        path = path or self.known_hosts
        path.write_text("".join(f"{h.known_hosts_name} {h.host_public_key}\n" for h in self.hosts))
        return path

    def stop(self) -> None:
        """Kill every host (sshd and all it started). Idempotent."""
        for h in self.hosts:
            h.kill()

    def leftovers(self) -> list[psutil.Process]:
        """Live processes started by this cluster: sshd trees, marked sessions, sshd with our configs."""
        found = {p.pid: p for h in self.hosts for p in h.processes() if _running(p)}
        for p in _marked(self.id):
            found.setdefault(p.pid, p)
        return list(found.values())

    def session_processes(self) -> list[psutil.Process]:
        """Live processes started through this cluster's SSH sessions (agents, ranks, pre-flight)."""
        return [p for p in _marked(self.id) if _running(p)]

    def wait_no_session_processes(self, timeout: float) -> list[psutil.Process]:
        """Poll until no session process is left or ``timeout`` passes; return what is left."""
        deadline = time.monotonic() + timeout
        left = self.session_processes()
        while left and time.monotonic() < deadline:
            time.sleep(0.1)
            left = self.session_processes()
        return left

    def inventory(self, **overrides: object) -> dict:
        """An inventory dict reaching every host as root with the client key, strict host keys.

        ``overrides`` replace top-level keys (``ssh=…``, ``defaults=…``, ``nodes=…``).
        """
        data = {
            "defaults": {"user": "root", "identity_file": str(self.client_key)},
            "ssh": {"config": None, "known_hosts": str(self.known_hosts), "host_key_policy": "strict", "connect_timeout": 5},
            "nodes": [{"name": h.name, "host": h.addr, "port": h.port, "workdir": str(h.workdir)} for h in self.hosts],
        }
        data.update(overrides)
        return data

    def write_inventory(self, path: Path | None = None, **overrides: object) -> Path:
        """Write :meth:`inventory` as YAML (default ``<root>/inventory.yaml``) and return its path."""
        path = path or self.root / "inventory.yaml"
        path.write_text(yaml.safe_dump(self.inventory(**overrides), sort_keys=False))
        return path


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
