"""Benchmark: ``hetctl probe`` against ``pdsh`` running the same collector on the same hosts.

Starts ``--hosts`` real OpenSSH servers on loopback (``tests/helpers/sshd.py``), then,
for each host count in ``--counts`` and ``--reps`` times, alternating which goes
first:

* ``hetctl probe -i inventory.yaml --json`` (a fresh CLI process: imports,
  inventory, one SSH connection per node, the collector on stdin, parsing);
* ``pdsh -R ssh -f F -w <hosts> '<python> -c <collector source> <args>'`` with
  OpenSSH under a generated ssh_config (same key, same known_hosts, strict
  host keys) and the same fan-out;
* the Python floor: ``python -c <FLOOR>``, a stdlib-only Python process that starts
  exactly pdsh's ``ssh`` commands (same arguments, same fan-out) and collects their
  output, and does nothing else. No Python CLI can answer sooner than this one, so
  its ratio to pdsh is the lowest hetctl's can be on this machine; it is printed
  beside hetctl's, so that a goal below it is visible as such.

All three run the same collector with the same tool table on the same hosts, and
all are checked to have received one JSON answer per host, and after each
``hetctl probe`` no ssh process of it may be left (a master kept alive with
``ControlPersist`` would let a later repetition skip its handshakes). Prints the median
wall time of each, the ratio hetctl/pdsh, and the time per host, so that
growth with host count at fixed fan-out is visible. The CPU columns are the
client side only (the hetctl process; pdsh and its ssh processes): the server
side (sshd, the collector) is the same work for both. ``busy`` is how much of the
machine's cores pdsh's runs kept busy (all processes: with the servers on the same
cores, near 100% means the runs are CPU-bound), and ``cpu bound`` the lowest
hetctl/pdsh that hetctl's own CPU allows here: pdsh's run's machine CPU seconds plus
hetctl's client CPU beyond pdsh's, over the cores and pdsh's wall time (no run is
shorter than its machine CPU seconds over the cores, however its processes overlap).
Wall times on a shared machine move with its load; the load average is printed
before and after.

Needs root (sshd), ``/usr/sbin/sshd``, ``ssh`` and ``pdsh``. Run from the repo root::

    python bench/fanout.py --hosts 16 --reps 5
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hetctl.probe.gather import collector_args  # noqa: E402
from hetctl.probe.nodescript import node_script  # noqa: E402
from tests.helpers.sshd import SshdCluster  # noqa: E402


def write_ssh_config(cluster: SshdCluster, path: Path) -> Path:
    """An OpenSSH client config giving each host its alias, port, key and known_hosts."""
    blocks = []
    for h in cluster:
        blocks.append(
            f"Host {h.name}\n  HostName {h.addr}\n  Port {h.port}\n  User root\n"
            f"  IdentityFile {cluster.client_key}\n  IdentitiesOnly yes\n"
            f"  UserKnownHostsFile {cluster.known_hosts}\n  StrictHostKeyChecking yes\n"
            f"  BatchMode yes\n  ConnectTimeout 10\n  LogLevel ERROR\n"
        )
    path.write_text("\n".join(blocks))
    return path


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def machine_cpu() -> float:
    """Busy CPU seconds of the whole machine so far, every core: the servers' side (sshd, the collector) too."""
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)


def time_hetctl(inventory: Path, n: int) -> tuple[float, float]:
    """Wall seconds and client CPU seconds of one ``hetctl probe``."""
    c0, t0 = _children_cpu(), time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "hetctl", "probe", "-i", str(inventory), "--json"],
                          capture_output=True, text=True)
    elapsed, cpu = time.perf_counter() - t0, _children_cpu() - c0
    if proc.returncode != 0:
        raise SystemExit(f"hetctl probe failed ({proc.returncode}):\n{proc.stderr}")
    nodes = json.loads(proc.stdout)["nodes"]
    if len(nodes) != n or not all(x["reachable"] for x in nodes):
        raise SystemExit(f"hetctl probe: expected {n} reachable nodes, got {nodes}")
    return elapsed, cpu


def leftover_ssh(ports: set[int], grace_s: float = 2.0) -> list[str]:
    """Command lines of ssh clients still running towards this bench's hosts (by their ports)
    ``grace_s`` after a run ended (a master told to exit may take a moment to go)."""
    deadline = time.monotonic() + grace_s
    while True:
        found = []
        for p in psutil.process_iter(["name", "cmdline", "status"]):
            cmd = p.info["cmdline"] or []
            if p.info["name"] == "ssh" and p.info["status"] != psutil.STATUS_ZOMBIE and any(
                    f"Port={port}" in cmd for port in ports):
                found.append(" ".join(cmd))
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


# The Python floor (see the module's docstring): argv is PDSH_SSH_ARGS, the remote
# command, the fan-out, then the host names. A sliding window of ``fanout`` clients,
# as pdsh keeps; each answer is a few KiB, well under a pipe's buffer.
FLOOR = """
import shlex, subprocess, sys
args, remote, fanout, names = shlex.split(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4:]
running, rc = [], 0
def finish(p):
    global rc
    sys.stdout.buffer.write(p.communicate()[0])
    rc = max(rc, p.returncode)
for name in names:
    if len(running) >= fanout:
        finish(running.pop(0))
    running.append(subprocess.Popen(["ssh", *(a.replace("%h", name) for a in args), remote], stdout=subprocess.PIPE))
for p in running:
    finish(p)
sys.exit(rc)
"""


def time_answers(label: str, argv: list[str], env: dict[str, str], n: int) -> tuple[float, float]:
    """Wall seconds and client CPU seconds (the process and its ssh children) of one run of ``argv``,
    checked to print one collector answer for each of ``n`` hosts."""
    c0, t0 = _children_cpu(), time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env)
    elapsed, cpu = time.perf_counter() - t0, _children_cpu() - c0
    answers = [ln for ln in proc.stdout.splitlines() if '"collector":1' in ln]
    if proc.returncode != 0 or len(answers) != n:
        raise SystemExit(f"{label} failed ({proc.returncode}, {len(answers)} answers):\n{proc.stderr[-2000:]}")
    return elapsed, cpu


def time_floor(names: list[str], command: str, env: dict[str, str], fanout: int) -> tuple[float, float]:
    """One run of the Python floor (the process and its ssh processes)."""
    return time_answers("the Python floor", [sys.executable, "-c", FLOOR, env["PDSH_SSH_ARGS"], command, str(fanout),
                                             *names], env, len(names))


def time_pdsh(names: list[str], command: str, env: dict[str, str], fanout: int) -> tuple[float, float]:
    """One pdsh run (pdsh and its ssh processes)."""
    return time_answers("pdsh", ["pdsh", "-R", "ssh", "-f", str(fanout), "-w", ",".join(names), command], env, len(names))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, default=16, help="sshd hosts to start (>= 16 for the issue's check)")
    ap.add_argument("--reps", type=int, default=5, help="repetitions per tool and host count")
    ap.add_argument("--fanout", type=int, default=64, help="concurrent connections for both tools")
    ap.add_argument("--counts", default=None, help="comma-separated host counts (default 4,8,16,…,--hosts)")
    opts = ap.parse_args()
    counts = [int(x) for x in opts.counts.split(",")] if opts.counts else sorted(
        {c for c in (4, 8, 16, 32, 64, 128) if c < opts.hosts} | {opts.hosts})
    if max(counts) > opts.hosts:
        raise SystemExit("--counts cannot exceed --hosts")

    with tempfile.TemporaryDirectory(prefix="hetctl-bench-") as tmp:
        tmp_path = Path(tmp)
        home = tmp_path / "home"
        (home / ".ssh").mkdir(parents=True)
        names = [f"h{i + 1:03d}" for i in range(opts.hosts)]
        t0 = time.perf_counter()
        with SshdCluster(tmp_path / "sshd", names=names) as cluster:
            started = time.perf_counter() - t0
            ssh_config = write_ssh_config(cluster, tmp_path / "ssh_config")
            # The developer's own ssh setup stays out of both tools.
            env = {**os.environ, "HOME": str(home), "PDSH_SSH_ARGS": f"-F {ssh_config} -x -a %h"}
            env.pop("SSH_AUTH_SOCK", None)
            os.environ.update({"HOME": str(home)})
            os.environ.pop("SSH_AUTH_SOCK", None)
            remote = shlex.join(["python3", "-c", node_script("collector.py").decode(), collector_args()])
            print(f"{opts.hosts} sshd hosts on loopback started in {started:.2f} s; "
                  f"fan-out {opts.fanout}; {opts.reps} reps; {os.cpu_count()} CPUs")
            print(f"load average before: {os.getloadavg()[0]:.2f}")
            print(f"{'hosts':>5} {'hetctl s':>9} {'pdsh s':>8} {'ratio':>6} {'hetctl ms/host':>15} {'pdsh ms/host':>13}"
                  f" {'hetctl cpu s':>13} {'pdsh cpu s':>11} {'floor s':>8} {'floor/pdsh':>10} {'busy':>5} {'cpu bound':>9}")
            rows = []
            cpus = os.cpu_count() or 1
            for n in counts:
                sub = cluster.hosts[:n]
                inv = tmp_path / f"inventory-{n}.yaml"
                data = cluster.inventory()
                data["nodes"] = data["nodes"][:n]
                data["ssh"]["fanout"] = opts.fanout
                inv.write_text(yaml.safe_dump(data))
                het, pd, het_cpu, pd_cpu, floor, pd_machine = [], [], [], [], [], []
                for rep in range(opts.reps):
                    order = (0, 1, 2)[rep % 3:] + (0, 1, 2)[:rep % 3]  # each goes first in turn
                    for which in order:
                        if which == 0:
                            wall, cpu = time_hetctl(inv, n)
                            if left := leftover_ssh({h.port for h in sub}):
                                raise SystemExit(f"hetctl probe left {len(left)} ssh process(es) running, "
                                                 f"which later repetitions could reuse: {left[0]}")
                            het.append(wall)
                            het_cpu.append(cpu)
                        elif which == 1:
                            before = machine_cpu()
                            wall, cpu = time_pdsh([h.name for h in sub], remote, env, opts.fanout)
                            pd_machine.append(machine_cpu() - before)
                            pd.append(wall)
                            pd_cpu.append(cpu)
                        else:
                            floor.append(time_floor([h.name for h in sub], remote, env, opts.fanout)[0])
                mh, mp, mf = statistics.median(het), statistics.median(pd), statistics.median(floor)
                # The CPU bound: with the servers' work the same for both, hetctl's run costs the machine pdsh's
                # CPU seconds plus hetctl's client CPU beyond pdsh's, and no run is shorter than its machine
                # CPU seconds / cores, however its processes overlap.
                busy = statistics.median(pd_machine) / (cpus * mp)
                bound = (statistics.median(pd_machine) + statistics.median(het_cpu) - statistics.median(pd_cpu)) / cpus / mp
                rows.append((n, mh, mp, mf, busy, bound))
                print(f"{n:>5} {mh:>9.3f} {mp:>8.3f} {mh / mp:>6.2f} {1000 * mh / n:>15.1f} {1000 * mp / n:>13.1f}"
                      f" {statistics.median(het_cpu):>13.3f} {statistics.median(pd_cpu):>11.3f}"
                      f" {mf:>8.3f} {mf / mp:>10.2f} {100 * busy:>4.0f}% {bound:>9.2f}", flush=True)
            print(f"load average after: {os.getloadavg()[0]:.2f}")
            print("\nthe Python floor (a stdlib process starting pdsh's ssh commands, nothing else) against pdsh: "
                  + ", ".join(f"{f / p:.2f} at {k} hosts" for k, _, p, f, _, _ in rows))
            print("the CPU bound (pdsh's run's machine CPU plus hetctl's client CPU beyond pdsh's, over the cores: "
                  "the lowest hetctl/pdsh its own CPU allows here): "
                  + ", ".join(f"{b:.2f} at {k} hosts ({100 * u:.0f}% of the cores busy under pdsh)"
                              for k, _, _, _, u, b in rows))
            n, mh, mp, _, _, _ = rows[-1]
            print(f"ratio hetctl/pdsh at {n} hosts: {mh / mp:.2f} (goal <= 1.0)")
            if len(rows) > 1:
                n0, h0, p0 = rows[0][:3]
                print(f"growth {n0}->{n} hosts ({n / n0:.0f}x): hetctl {mh / h0:.2f}x, pdsh {mp / p0:.2f}x "
                      f"(linear would be {n / n0:.0f}x)")


if __name__ == "__main__":
    main()
