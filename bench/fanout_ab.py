"""A/B of ``hetctl probe`` between source trees, interleaved with ``pdsh`` on the same hosts.

``bench/fanout.py`` compares hetctl with pdsh; on a shared machine its wall times move
with the load more than a start-up change moves them. This runs, on one set of real
sshd hosts and in rotating order, ``pdsh`` and ``hetctl probe --json`` from each tree
given (``PYTHONPATH`` pointing at it, e.g. ``/work/main`` against a branch's clone), so
that every tool sees the same load; it prints the medians, each tree's ratio to pdsh,
and the ratio of the last tree to the first, which is what the change bought.
Same commands and checks as ``bench/fanout.py`` (one JSON answer per host from each).

    python bench/fanout_ab.py --trees old=/work/main,new=. --counts 4,16 --reps 9
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from fanout import _children_cpu, write_ssh_config  # noqa: E402

from hetctl.probe.gather import collector_args  # noqa: E402
from hetctl.probe.nodescript import node_script  # noqa: E402
from tests.helpers.sshd import SshdCluster  # noqa: E402


def _run(argv: list[str], env: dict[str, str]) -> tuple[float, float, subprocess.CompletedProcess]:
    c0, t0 = _children_cpu(), time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env)
    return time.perf_counter() - t0, _children_cpu() - c0, proc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trees", required=True, help="name=path,… source trees to compare (first is the baseline)")
    ap.add_argument("--counts", default="4,16", help="comma-separated host counts")
    ap.add_argument("--reps", type=int, default=9, help="repetitions per tool and host count")
    ap.add_argument("--fanout", type=int, default=64)
    opts = ap.parse_args()
    trees = {k: str(Path(v).resolve()) for k, _, v in (t.partition("=") for t in opts.trees.split(","))}
    counts = [int(x) for x in opts.counts.split(",")]
    kinds = ["pdsh", *trees]
    with tempfile.TemporaryDirectory(prefix="hetctl-ab-") as tmp:
        tmp_path = Path(tmp)
        home = tmp_path / "home"
        (home / ".ssh").mkdir(parents=True)
        names = [f"h{i + 1:03d}" for i in range(max(counts))]
        with SshdCluster(tmp_path / "sshd", names=names) as cluster:
            ssh_config = write_ssh_config(cluster, tmp_path / "ssh_config")
            env = {**os.environ, "HOME": str(home), "PDSH_SSH_ARGS": f"-F {ssh_config} -x -a %h"}
            env.pop("SSH_AUTH_SOCK", None)
            remote = shlex.join(["python3", "-c", node_script("collector.py").decode(), collector_args()])
            print(f"trees: {trees}; {opts.reps} reps; {os.cpu_count()} CPUs; load average before: {os.getloadavg()[0]:.2f}")
            for n in counts:
                inv = tmp_path / f"inventory-{n}.yaml"
                data = cluster.inventory()
                data["nodes"] = data["nodes"][:n]
                data["ssh"]["fanout"] = opts.fanout
                inv.write_text(yaml.safe_dump(data))
                hosts = ",".join(h.name for h in cluster.hosts[:n])
                res: dict[str, list[tuple[float, float]]] = {k: [] for k in kinds}
                for rep in range(opts.reps):
                    for kind in kinds[rep % len(kinds):] + kinds[:rep % len(kinds)]:
                        if kind == "pdsh":
                            wall, cpu, proc = _run(["pdsh", "-R", "ssh", "-f", str(opts.fanout), "-w", hosts, remote], env)
                            ok = proc.returncode == 0 and proc.stdout.count('"collector":1') == n
                        else:
                            wall, cpu, proc = _run([sys.executable, "-m", "hetctl", "probe", "-i", str(inv), "--json"],
                                                   {**env, "PYTHONPATH": trees[kind]})
                            ok = proc.returncode == 0 and sum(x["reachable"] for x in json.loads(proc.stdout)["nodes"]) == n
                        if not ok:
                            raise SystemExit(f"{kind} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
                        res[kind].append((wall, cpu))
                med = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in res.items()}
                cols = "  ".join(f"{k} {w:.3f} s / {c:.2f} cpu s" for k, (w, c) in med.items())
                ratios = "  ".join(f"{k}/pdsh {med[k][0] / med['pdsh'][0]:.2f}" for k in trees)
                first, last = list(trees)[0], list(trees)[-1]
                print(f"{n:>3} hosts: {cols} | {ratios}  {last}/{first} {med[last][0] / med[first][0]:.2f} "
                      f"(load {os.getloadavg()[0]:.1f})", flush=True)


if __name__ == "__main__":
    main()
