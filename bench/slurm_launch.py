"""Benchmark: time to every rank's first heartbeat on Slurm, ``hetctl launch`` against ``srun torchrun``.

Starts a real Slurm mini-cluster (``tests/helpers/slurm.py``: munged, slurmctld, one slurmd
per node on loopback), takes one allocation of ``--nodes`` nodes (``salloc
--no-shell``) and plans the tiny model as a pipeline with one stage per node.
Then, on that same allocation, ``--reps`` times, alternating which goes first:

* ``hetctl launch plan/`` with the inventory ``slurm: {steps: …}`` inside the job (a fresh
  CLI process: inventory from ``scontrol``, one ``srun`` step per node for the
  pre-flight and the shipping of agent and plan, then the agents, which spawn the
  ranks: one step for all of them, or with ``--agent-steps node`` one step each);
* the way Slurm users launch today: ``srun --nodes N --ntasks-per-node 1 bash -c
  '. env-$SLURM_NODEID.sh && exec python -m torch.distributed.run --nnodes N
  --node-rank $SLURM_NODEID … -m hetctl.train …'`` with the per-node environment
  files written beforehand (not timed) from the same materialized plan and the
  rendezvous port picked beforehand (not timed).

Both start the same trainer with the same rank environment; the clock runs from
the command's start until every rank's heartbeat file exists. Then, once, the
crash detection over Slurm: kill -9 one rank of a ``hetctl launch`` and take the
``rank_failed`` event's timestamp. The last line, for scripts::

    slurm_launch: ratio=<hetctl/srun-torchrun median> detect_s=<seconds> sruns=<n> steps=<n> fds=<n>

(``sruns``, ``steps``, ``fds``: what the controller held while it trained, see :func:`held`.)

Needs root and the Slurm binaries (Debian: slurmctld slurmd slurm-client munge),
and torch. From the repo root::

    python bench/slurm_launch.py --nodes 3 --reps 3
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402

from hetctl.files.inventory import load_inventory  # noqa: E402
from hetctl.remote.slurmalloc import allocation  # noqa: E402
from hetctl.files.plan import Plan  # noqa: E402
from hetctl.files.run import LaunchOptions  # noqa: E402
from hetctl.launch import materialize as mat  # noqa: E402
from hetctl.files.eventlog import read_events  # noqa: E402
from hetctl.launch.inject import signal_rank  # noqa: E402
from hetctl.files.yamlio import save_model  # noqa: E402
from tests.helpers.rankrunner import TINY, tiny_plan  # noqa: E402
from tests.helpers.slurm import NodeSpec, SlurmCluster, skip_reason  # noqa: E402

TORCHRUN_SETS = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}


def build_plan(names: list[str], inventory: Path, out: Path) -> Plan:
    """One pipeline stage per node, layers spread evenly; saved as ``out/plan.yaml``."""
    n = len(names)
    layers = max(TINY["num_layers"], n)
    split = [layers // n + (1 if i < layers % n else 0) for i in range(n)]
    d = tiny_plan(split, model={**TINY, "num_layers": layers})
    for item in d["stages"] + d["ranks"]:
        item["node"] = names[int(item["node"][1:])]
    d["nodes"], d["inventory"] = names, str(inventory)
    plan = Plan.model_validate(d)
    save_model(out / "plan.yaml", plan)
    return plan


def wait_files(patterns: list[str], proc: subprocess.Popen, t0: float, timeout: float = 300) -> float:
    """Seconds from ``t0`` until every pattern matches a file; fails if the job exits first."""
    pending, deadline = list(patterns), time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
        pending = [p for p in pending if not glob.glob(p)]
        if not pending:
            break
        if proc.poll() is not None:
            _, err = proc.communicate()
            raise SystemExit(f"job exited {proc.returncode} before every rank's heartbeat:\n{err[-3000:]}")
        time.sleep(0.005)
    if pending:
        proc.kill()
        raise SystemExit(f"no heartbeat {pending[0]} within {timeout} s")
    return time.perf_counter() - t0


def finish(proc: subprocess.Popen, what: str) -> None:
    _, err = proc.communicate(timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"{what} exited {proc.returncode}:\n{err[-3000:]}")


def time_hetctl(d: Path, env: dict, plan: Plan, steps: int, rep: int) -> float:
    runs, workdir = d / f"runs-{rep}", d / "home" / ".hetctl"
    subprocess.run(["rm", "-rf", str(workdir / "runs")], check=True)  # the glob must only see this launch
    argv = [sys.executable, "-m", "hetctl", "launch", "plan", "--steps", str(steps), "--checkpoint-every", "0",
            "--run-dir", str(runs), "--json"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=d, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    patterns = [str(workdir / "runs" / "*" / "0" / "hb" / f"rank-{r.rank}.json") for r in plan.ranks]
    elapsed = wait_files(patterns, proc, t0)
    finish(proc, "hetctl launch")
    return elapsed


def env_files(plan: Plan, inventory: Path, env: dict, where: Path, steps: int) -> list[str]:
    """``env-<nodeid>.sh`` per node from the same materialized launch, minus what torchrun sets; heartbeat paths."""
    old = dict(os.environ)
    os.environ.update({k: v for k, v in env.items() if k.startswith("SLURM")})
    try:
        inv = load_inventory(inventory, slurm=allocation)
    finally:
        os.environ.clear()
        os.environ.update(old)
    where.mkdir(parents=True)
    (where / "hb").mkdir()
    plan_path = where / "plan.json"
    plan_path.write_bytes(mat.plan_json(plan))
    spec = mat.materialize(plan, {n.name: n for n in inv.nodes}, run_id="srun", attempt=0, master_addr="unused",
                           master_port=0,
                           options=LaunchOptions(steps=steps, checkpoint_every=0), ckpt_dir=str(where / "ckpt"))
    hbs = []
    for i, node in enumerate(spec.nodes):
        rank = node.ranks[0]
        e = {k: v for k, v in rank.env.items() if k not in TORCHRUN_SETS}
        e.update(node.env)
        e["HETCTL_PLAN"] = str(plan_path)
        e["HETCTL_HEARTBEAT_FILE"] = hb = str(where / "hb" / f"rank-{i}.json")
        hbs.append(hb)
        (where / f"env-{i}.sh").write_text("".join(f"export {k}={shlex.quote(v)}\n" for k, v in e.items()))
    return hbs


def time_srun(cluster: SlurmCluster, job: str, plan: Plan, inventory: Path, env: dict, where: Path, steps: int) -> float:
    hbs = env_files(plan, inventory, env, where, steps)
    addr0 = cluster[plan.nodes[0]].addr
    with socket.socket() as s:
        s.bind((addr0, 0))
        port = s.getsockname()[1]
    n = len(plan.nodes)
    task = (f'. {shlex.quote(str(where))}/env-$SLURM_NODEID.sh && exec {shlex.quote(sys.executable)} '
            f"-m torch.distributed.run --nnodes {n} --nproc-per-node 1 --node-rank $SLURM_NODEID "
            f"--master-addr {addr0} --master-port {port} -m hetctl.train --steps {steps} --checkpoint-every 0")
    argv = ["srun", f"--jobid={job}", f"--nodes={n}", "--ntasks-per-node=1", "--overlap", "-w", ",".join(plan.nodes),
            "bash", "-c", task]
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=where, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    elapsed = wait_files(hbs, proc, t0)
    finish(proc, "srun torchrun")
    return elapsed


def held(pid: int, job: str, cluster: SlurmCluster) -> dict[str, int]:
    """What a training ``hetctl launch`` holds: its srun processes (srun forks a helper: both count), its open
    descriptors, and the job's hetctl steps in slurmctld."""
    import psutil

    me = psutil.Process(pid)
    sruns = [p for p in me.children(recursive=True) if p.name() == "srun"]
    steps = cluster.client("squeue", "-h", "-s", "-j", job, "-o", "%j", check=False).stdout.split()
    return {"sruns": len(sruns), "fds": me.num_fds(), "steps": sum(s.startswith("hetctl-") for s in steps)}


def detection(d: Path, env: dict, plan: Plan, job: str, cluster: SlurmCluster) -> tuple[float, dict[str, int]]:
    """kill -9 the last rank of a running ``hetctl launch``; seconds until its ``rank_failed`` event, and what
    the controller held while it trained (:func:`held`)."""
    runs = d / "runs-detect"
    proc = subprocess.Popen([sys.executable, "-m", "hetctl", "launch", "plan", "--steps", "100000",
                             "--checkpoint-every", "0", "--run-dir", str(runs), "--json", "--max-restarts", "0",
                             "--grace", "1"], cwd=d, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t0 = time.perf_counter()
    wait_files([str(runs / "*" / "events.jsonl")], proc, t0)
    run = next(iter(runs.glob("*/events.jsonl"))).parent
    deadline = time.monotonic() + 300
    while not any(e.get("step", 0) >= 3 for e in read_events(run / "events.jsonl", "progress")):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"no progress before the kill: {proc.communicate()[1][-3000:]}")
        time.sleep(0.02)
    holds = held(proc.pid, job, cluster)
    t_kill = time.time()
    signal_rank(run.name, max(r.rank for r in plan.ranks), signal.SIGKILL)
    while not read_events(run / "events.jsonl", "rank_failed"):
        if time.monotonic() > deadline:
            raise SystemExit("no rank_failed event")
        time.sleep(0.002)
    ev = read_events(run / "events.jsonl", "rank_failed")[0]
    proc.communicate(timeout=120)
    return ev["ts"] - t_kill, holds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=3, help="Slurm nodes, one rank (pipeline stage) each")
    ap.add_argument("--reps", type=int, default=3, help="repetitions of each launcher")
    ap.add_argument("--steps", type=int, default=3, help="training steps per job after the first heartbeat")
    ap.add_argument("--agent-steps", choices=("component", "node"), default="component",
                    help="the inventory's slurm.steps: the agents in one srun step (default), or one step each")
    o = ap.parse_args()
    reason = skip_reason()
    if reason:
        raise SystemExit(f"slurm_launch: cannot run: {reason}")
    with tempfile.TemporaryDirectory(prefix="hetctl-bench-slurm-") as tmp:
        d = Path(tmp)
        (d / "home" / ".ssh").mkdir(parents=True)
        t0 = time.perf_counter()
        with SlurmCluster(d / "slurm", [NodeSpec(f"c{i + 1}", 2, "", "cpu") for i in range(o.nodes)]) as cluster:
            up = time.perf_counter() - t0
            r = cluster.client("salloc", "--no-shell", "--immediate=30", f"-N{o.nodes}")
            job = re.search(r"Granted job allocation (\d+)", r.stderr).group(1)
            env = {**os.environ, **cluster.env, "SLURM_JOB_ID": job, "HOME": str(d / "home")}
            env.pop("SLURM_JOB_NODELIST", None)  # hetctl asks slurmctld for the job's nodes
            inventory = d / "inventory.yaml"
            inventory.write_text(yaml.safe_dump({"defaults": {"python": sys.executable, "env": {"OMP_NUM_THREADS": "1"}},
                                                 "slurm": {"steps": o.agent_steps}}))
            plan = build_plan(cluster.names, inventory, d / "plan")
            print(f"Slurm mini-cluster up in {up:.2f} s: {o.nodes} nodes, job {job}, one rank each "
                  f"(tiny model, PP={o.nodes}); {o.reps} reps; {os.cpu_count()} CPUs; agents' steps: {o.agent_steps}")
            het, sr = [], []
            for rep in range(o.reps):
                for which in ((0, 1) if rep % 2 == 0 else (1, 0)):
                    if which == 0:
                        het.append(time_hetctl(d, env, plan, o.steps, rep))
                    else:
                        sr.append(time_srun(cluster, job, plan, inventory, env, d / f"srun-{rep}", o.steps))
                print(f"  rep {rep + 1}: hetctl launch {het[-1]:.2f} s, srun torchrun {sr[-1]:.2f} s", flush=True)
            detect, holds = detection(d, env, plan, job, cluster)
            mh, ms = statistics.median(het), statistics.median(sr)
            print(f"\ncommand → every rank's first heartbeat (median): hetctl launch {mh:.2f} s, srun torchrun {ms:.2f} s")
            print(f"kill -9 of a rank → rank_failed event: {detect:.3f} s")
            print(f"while training, hetctl held {holds['sruns']} srun processes and {holds['fds']} descriptors; "
                  f"slurmctld listed {holds['steps']} hetctl steps")
            print(f"slurm_launch: ratio={mh / ms:.2f} detect_s={detect:.3f} sruns={holds['sruns']} "
                  f"steps={holds['steps']} fds={holds['fds']}")


if __name__ == "__main__":
    main()
