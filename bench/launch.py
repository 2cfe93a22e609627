"""Benchmark: time to every rank's first heartbeat, ``hetctl launch`` against ``pdsh`` + ``torchrun``.

Starts ``--hosts`` real OpenSSH servers on loopback (``tests/helpers/sshd.py``) and plans
the tiny model as a pipeline with one stage per host. Then, ``--reps`` times,
alternating which goes first:

* ``hetctl launch plan/ -i inventory.yaml`` — a fresh CLI process: inventory,
  one SSH connection per node, pre-flight (python, workdir, free port), shipping
  the agent zipapp and the plan, starting the agents, which spawn the ranks;
* DeepSpeed's way: ``pdsh -R ssh -w <hosts> '. env-%n.sh && exec python -m
  torch.distributed.run --nnodes N --node-rank %n … -m hetctl.train …'`` with
  OpenSSH (same key, same known_hosts, strict host keys), the per-node
  environment files written beforehand (not timed) from the same materialized
  plan, and the rendezvous port picked beforehand (not timed).

Both start the same trainer (``python -m hetctl.train``) with the same rank
environment; the clock runs from the command's start until every rank's
heartbeat file exists (the trainer writes it once its process group is up), as
seen by polling the hosts' folders from here. Both jobs then train a few steps
and must exit 0. Prints the median of each, and the ratio hetctl/pdsh.

Needs root (sshd), ``/usr/sbin/sshd``, ``ssh``, ``pdsh`` and torch. From the repo root::

    python bench/launch.py --hosts 4 --reps 3
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hetctl.files.inventory import load_inventory  # noqa: E402
from hetctl.files.plan import Plan  # noqa: E402
from hetctl.files.run import LaunchOptions  # noqa: E402
from hetctl.launch import materialize as mat  # noqa: E402
from hetctl.files.eventlog import read_events  # noqa: E402
from hetctl.files.yamlio import save_model  # noqa: E402
from tests.helpers.rankrunner import TINY, tiny_plan  # noqa: E402
from tests.helpers.sshd import SshdCluster  # noqa: E402

TORCHRUN_SETS = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}


def ssh_config(cluster: SshdCluster, path: Path) -> Path:
    """An OpenSSH client config for pdsh: alias, port, key, known_hosts, strict host keys."""
    path.write_text("\n".join(
        f"Host {h.name}\n  HostName {h.addr}\n  Port {h.port}\n  User root\n  IdentityFile {cluster.client_key}\n"
        f"  IdentitiesOnly yes\n  UserKnownHostsFile {cluster.known_hosts}\n  StrictHostKeyChecking yes\n"
        f"  BatchMode yes\n  LogLevel ERROR\n" for h in cluster))
    return path


def build_plan(cluster: SshdCluster, inventory: Path, out: Path) -> Plan:
    """One pipeline stage per host, layers spread evenly; saved as ``out/plan.yaml``."""
    n = len(cluster.hosts)
    layers = max(TINY["num_layers"], n)
    split = [layers // n + (1 if i < layers % n else 0) for i in range(n)]
    d = tiny_plan(split, model={**TINY, "num_layers": layers})
    names = [h.name for h in cluster]
    for item in d["stages"] + d["ranks"]:
        item["node"] = names[int(item["node"][1:])]
    d["nodes"], d["inventory"] = names, str(inventory)
    plan = Plan.model_validate(d)
    save_model(out / "plan.yaml", plan)
    return plan


def wait_heartbeats(pattern_of: list[str], proc: subprocess.Popen, t0: float) -> float:
    """Seconds from ``t0`` until every pattern matches a file; fails if the job exits first."""
    pending = list(pattern_of)
    while pending:
        pending = [p for p in pending if not glob.glob(p)]
        if not pending:
            break
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise SystemExit(f"job exited {proc.returncode} before every rank's heartbeat:\n{err[-3000:]}")
        time.sleep(0.005)
    return time.perf_counter() - t0


def finish(proc: subprocess.Popen, what: str) -> None:
    _, err = proc.communicate(timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"{what} exited {proc.returncode}:\n{err[-3000:]}")


def time_hetctl(plan_dir: Path, inventory: Path, cluster: SshdCluster, runs: Path, steps: int) -> tuple[float, float]:
    """(seconds to every rank's first heartbeat, seconds to the ``launched`` event: ranks spawned)."""
    for h in cluster:  # a clean slate: the glob must only see this launch's heartbeats
        subprocess.run(["rm", "-rf", str(h.workdir / "runs")], check=True)
    argv = [sys.executable, "-m", "hetctl", "launch", str(plan_dir), "-i", str(inventory), "--steps", str(steps),
            "--checkpoint-every", "0", "--run-dir", str(runs), "--json"]
    wall0, t0 = time.time(), time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    patterns = [str(h.workdir / "runs" / "*" / "0" / "hb" / f"rank-{i}.json") for i, h in enumerate(cluster)]
    elapsed = wait_heartbeats(patterns, proc, t0)
    out, err = proc.communicate(timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"hetctl launch exited {proc.returncode}:\n{err[-3000:]}")
    launched = read_events(Path(json.loads(out)["run_dir"]) / "events.jsonl", "launched")[0]["ts"]
    return elapsed, launched - wall0


def pdsh_env_files(plan: Plan, inventory: Path, where: Path, steps: int) -> tuple[str, list[str]]:
    """Per node-rank ``env-<n>.sh`` from the same materialized launch, minus what torchrun sets."""
    inv = load_inventory(inventory)
    where.mkdir(parents=True)
    (where / "hb").mkdir()
    plan_path = where / "plan.json"
    plan_path.write_bytes(mat.plan_json(plan))
    spec = mat.materialize(plan, {n.name: n for n in inv.nodes}, run_id="pdsh", attempt=0,
                           master_addr="unused", master_port=0,
                           options=LaunchOptions(steps=steps, checkpoint_every=0), ckpt_dir=str(where / "ckpt"))
    hbs = []
    for n, node in enumerate(spec.nodes):
        rank = node.ranks[0]
        env = {k: v for k, v in rank.env.items() if k not in TORCHRUN_SETS}
        env.update(node.env)
        env["HETCTL_PLAN"] = str(plan_path)
        env["HETCTL_HEARTBEAT_FILE"] = hb = str(where / "hb" / f"rank-{n}.json")
        hbs.append(hb)
        (where / f"env-{n}.sh").write_text("".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items()))
    return str(where / "env-%n.sh"), hbs


def time_pdsh(cluster: SshdCluster, plan: Plan, inventory: Path, where: Path, steps: int, env: dict) -> float:
    envfile, hbs = pdsh_env_files(plan, inventory, where, steps)
    with socket.socket() as s:
        s.bind((cluster.hosts[0].addr, 0))
        port = s.getsockname()[1]
    n = len(cluster.hosts)
    remote = (f". {envfile} && exec {shlex.quote(sys.executable)} -m torch.distributed.run --nnodes {n} "
              f"--nproc-per-node 1 --node-rank %n --master-addr {cluster.hosts[0].addr} --master-port {port} "
              f"-m hetctl.train --steps {steps} --checkpoint-every 0")
    argv = ["pdsh", "-R", "ssh", "-f", "64", "-w", ",".join(h.name for h in cluster), remote]
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    elapsed = wait_heartbeats(hbs, proc, t0)
    finish(proc, "pdsh + torchrun")
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, default=4, help="sshd hosts, one rank (pipeline stage) each")
    ap.add_argument("--reps", type=int, default=3, help="repetitions of each launcher")
    ap.add_argument("--steps", type=int, default=3, help="training steps per job after the first heartbeat")
    opts = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="hetctl-bench-launch-") as tmp:
        tmp_path = Path(tmp)
        home = tmp_path / "home"
        (home / ".ssh").mkdir(parents=True)
        os.environ["HOME"] = str(home)  # the developer's own ssh setup stays out of both
        os.environ.pop("SSH_AUTH_SOCK", None)
        with SshdCluster(tmp_path / "sshd", opts.hosts) as cluster:
            inventory = cluster.write_inventory(
                tmp_path / "inventory.yaml",
                defaults={"user": "root", "identity_file": str(cluster.client_key), "python": sys.executable,
                          "env": {"OMP_NUM_THREADS": "1"}})
            plan = build_plan(cluster, inventory, tmp_path / "plan")
            env = {**os.environ, "PDSH_SSH_ARGS": f"-F {ssh_config(cluster, tmp_path / 'ssh_config')} -x -a %h"}
            print(f"{opts.hosts} sshd hosts on loopback, one rank each (tiny model, PP={opts.hosts}); "
                  f"{opts.reps} reps; {os.cpu_count()} CPUs")
            het, pd, spawned = [], [], []
            load0 = os.getloadavg()[0]
            for rep in range(opts.reps):
                for which in ((0, 1) if rep % 2 == 0 else (1, 0)):
                    if which == 0:
                        t, launched = time_hetctl(tmp_path / "plan", inventory, cluster, tmp_path / "runs", opts.steps)
                        het.append(t)
                        spawned.append(launched)
                    else:
                        pd.append(time_pdsh(cluster, plan, inventory, tmp_path / f"pdsh-{rep}", opts.steps, env))
                print(f"  rep {rep + 1}: hetctl launch {het[-1]:.2f} s (ranks spawned at {spawned[-1]:.2f} s), "
                      f"pdsh+torchrun {pd[-1]:.2f} s", flush=True)
            mh, mp = statistics.median(het), statistics.median(pd)
            print(f"load average before {load0:.2f}, after {os.getloadavg()[0]:.2f}")
            print(f"\ncommand → every rank's first heartbeat (median): hetctl launch {mh:.2f} s, "
                  f"pdsh+torchrun {mp:.2f} s")
            print(f"hetctl's own part (command → every rank spawned, the 'launched' event): "
                  f"{statistics.median(spawned):.2f} s")
            print(f"ratio hetctl/pdsh: {mh / mp:.2f} (goal <= 1.0)")

if __name__ == "__main__":
    main()
