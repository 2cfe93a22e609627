"""Benchmark: recovery from a rank killed with ``kill -9``, ``hetctl launch`` against ``torchrun --max-restarts 1``.

Both run the same trainer (``python -m hetctl.train``), the same two-stage
pipeline of the tiny model on this one host, with checkpoints every
``--every`` steps. Once the last stage reports step ``--kill-step``, rank 1 gets
``SIGKILL`` from outside (found in ``/proc`` by its environment). Measured from
the kill:

(a) detection — hetctl: the ``rank_failed`` event's timestamp in
    ``events.jsonl``; torchrun: arrival of its agent's first log line about the
    failure (it logs when it stops the surviving workers or reports the exit);
(b) recovery — the first completed step after the restart: the last stage's
    heartbeat file of the new attempt reporting a step past the one it resumed
    from, polled every 2 ms from here for both.

hetctl runs its two "nodes" with ``transport: local`` (the agent path is the
same one SSH nodes use); torchrun runs its two workers under its elastic agent
through a small wrapper that gives each rank the hetctl rank environment and
resumes from the newest valid checkpoint (what a torchrun training script does
on restart). hetctl's restart re-uses the plan (a crash is not a membership
change), so no re-planning time is involved; the re-plan time for a lost node is
printed from the planner for reference.

From the repo root::

    python bench/recovery.py --reps 2
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hetctl.files.inventory import load_inventory  # noqa: E402
from hetctl.files.plan import Plan  # noqa: E402
from hetctl.launch import materialize as mat  # noqa: E402
from hetctl.files.events import read_events  # noqa: E402
from hetctl.launch.inject import rank_procs, signal_rank  # noqa: E402
from hetctl.node.runtime import read_heartbeat  # noqa: E402
from hetctl.files.yamlio import dump_yaml, save_model  # noqa: E402
from tests.rankrunner import tiny_plan  # noqa: E402

NODES = ("node-a", "node-b")

# The torchrun worker: rank environment from hetctl's materialized launch, resume from the
# newest valid checkpoint, then exec the trainer (same pid, so torchrun watches the trainer).
WRAPPER = r"""
import json, os, sys
from hetctl.node.manifest import latest_valid
restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
env = json.load(open(os.path.join(sys.argv[1], "rank-%s.json" % os.environ["RANK"])))
env = {k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                  "MASTER_ADDR", "MASTER_PORT")}
env["HETCTL_ATTEMPT"] = str(restart)
env["HETCTL_HEARTBEAT_FILE"] = env["HETCTL_HEARTBEAT_FILE"].replace("/0/", "/%d/" % restart)
found = latest_valid(env["HETCTL_CKPT_DIR"])
env["HETCTL_RESUME_STEP"] = str(found[0] if found else 0)
os.environ.update(env)
# The trainer opens its own rendezvous store; keep it off torchrun's agent store port.
os.environ["MASTER_PORT"] = str(int(os.environ["MASTER_PORT"]) + 1 + restart)
os.makedirs(os.path.dirname(env["HETCTL_HEARTBEAT_FILE"]), exist_ok=True)
os.execv(sys.executable, [sys.executable, "-m", "hetctl.train", *sys.argv[2:]])
"""


def setup(tmp: Path) -> tuple[Path, Plan]:
    """Inventory with two local nodes and shared checkpoints; a pp 2 plan of the tiny model."""
    inv = {
        "defaults": {"transport": "local", "python": sys.executable, "env": {"OMP_NUM_THREADS": "1"}},
        "checkpoint_dir": str(tmp / "ckpt"),
        "nodes": [{"name": n, "host": "localhost", "workdir": str(tmp / "nodes" / n)} for n in NODES],
    }
    inv_path = tmp / "inventory.yaml"
    inv_path.write_text(dump_yaml(inv))
    d = tiny_plan([3, 3], micro_batch=2, micro_batches=8)
    for item in d["stages"] + d["ranks"]:
        item["node"] = NODES[int(item["node"][1:])]
    d["nodes"], d["inventory"] = list(NODES), str(inv_path)
    plan = Plan.model_validate(d)
    save_model(tmp / "plan" / "plan.yaml", plan)
    return inv_path, plan


def poll(fn, what: str, proc: subprocess.Popen, timeout: float = 300.0, every: float = 0.002):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = fn()
        if v is not None and v is not False:
            return v
        if proc.poll() is not None:
            _, err = proc.communicate()
            raise SystemExit(f"job exited {proc.returncode} before {what}:\n{(err or '')[-3000:]}")
        time.sleep(every)
    proc.kill()
    raise SystemExit(f"no {what} within {timeout} s")


def step_of(path: Path) -> int:
    hb = read_heartbeat(path) if path.exists() else None
    return int(hb["step"]) if hb and isinstance(hb.get("step"), int) else -1


def run_hetctl(tmp: Path, inv: Path, plan: Plan, o: argparse.Namespace, rep: int) -> dict:
    runs = tmp / f"runs-{rep}"
    proc = subprocess.Popen([sys.executable, "-m", "hetctl", "launch", str(tmp / "plan"), "-i", str(inv),
                             "--steps", str(o.steps), "--checkpoint-every", str(o.every), "--run-dir", str(runs),
                             "--json", "--grace", "2", "--max-restarts", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run = poll(lambda: next(iter(runs.glob("*/run.yaml")), None), "the run folder", proc).parent
    last = max(r.rank for r in plan.ranks)
    node = next(r.node for r in plan.ranks if r.rank == last)
    hb = lambda a: tmp / "nodes" / node / "runs" / run.name / str(a) / "hb" / f"rank-{last}.json"  # noqa: E731
    poll(lambda: step_of(hb(0)) >= o.kill_step or None, f"step {o.kill_step}", proc)
    t_kill = time.time()
    signal_rank(run.name, 1, signal.SIGKILL)
    ev = poll(lambda: next(iter(read_events(run / "events.jsonl", "rank_failed")), None), "rank_failed", proc)
    restart = poll(lambda: next(iter(read_events(run / "events.jsonl", "restart")), None), "restart", proc)
    resume = int(restart.get("resume_step") or 0)
    poll(lambda: step_of(hb(1)) >= resume or None, "the restarted ranks", proc)
    t_ready = time.time()
    poll(lambda: step_of(hb(1)) > resume or None, "the first step after the restart", proc)
    t_step = time.time()
    out, err = proc.communicate(timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"hetctl launch exited {proc.returncode}:\n{err[-3000:]}")
    launched = [e for e in read_events(run / "events.jsonl", "launched") if e["attempt"] == 1][0]
    return {"detect": ev["ts"] - t_kill, "recover": t_step - t_kill, "resume": resume, "ready": t_ready - t_kill,
            "restart_event": restart["ts"] - t_kill, "launched": launched["ts"] - t_kill,
            "final_loss": f"{json.loads(out)['final_loss']:.9g}"}


def run_torchrun(tmp: Path, inv: Path, plan: Plan, o: argparse.Namespace, rep: int) -> dict:
    where = tmp / f"torchrun-{rep}"
    (where / "env").mkdir(parents=True)
    plan_path = where / "plan.json"
    plan_path.write_bytes(mat.plan_json(plan))
    inventory = load_inventory(inv)
    spec = mat.materialize(plan, {n.name: n for n in inventory.nodes}, run_id=f"torchrun-{rep}", attempt=0,
                           master_addr="127.0.0.1", master_port=0, steps=o.steps, checkpoint_every=o.every,
                           ckpt_dir=str(where / "ckpt"))
    for n in spec.nodes:
        for r in n.ranks:
            env = {**r.env, **n.env, "HETCTL_PLAN": str(plan_path),
                   "HETCTL_HEARTBEAT_FILE": str(where / "hb" / "0" / f"rank-{r.rank}.json")}
            (where / "env" / f"rank-{r.rank}.json").write_text(json.dumps(env))
    wrapper = where / "rank.py"
    wrapper.write_text(WRAPPER)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(len(plan.ranks)),
            "--max-restarts", "1", str(wrapper), str(where / "env"), "--steps", str(o.steps),
            "--checkpoint-every", str(o.every)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: lines.extend((time.time(), ln) for ln in iter(proc.stderr.readline, "")),
                              daemon=True)
    reader.start()
    stdout: list[str] = []
    threading.Thread(target=lambda: stdout.extend(iter(proc.stdout.readline, "")), daemon=True).start()
    last = max(r.rank for r in plan.ranks)
    hb = lambda a: where / "hb" / str(a) / f"rank-{last}.json"  # noqa: E731
    poll(lambda: step_of(hb(0)) >= o.kill_step or None, f"step {o.kill_step}", proc)
    t_kill = time.time()
    signal_rank(f"torchrun-{rep}", 1, signal.SIGKILL)
    markers = ("SIGTERM", "exitcode", "FAILED", "Signals.SIGKILL")
    t_detect = poll(lambda: next((t for t, ln in list(lines) if t >= t_kill and any(m in ln for m in markers)), None),
                    "torchrun's failure log line", proc)
    ready = poll(lambda: read_heartbeat(hb(1)) if hb(1).exists() else None, "the restarted ranks", proc)
    t_ready = time.time()
    resume = int(ready["step"])
    poll(lambda: step_of(hb(1)) > resume or None, "the first step after the restart", proc)
    t_step = time.time()
    proc.wait(timeout=600)
    reader.join(timeout=5)
    if proc.returncode != 0:
        raise SystemExit(f"torchrun exited {proc.returncode}:\n{''.join(ln for _, ln in lines)[-3000:]}")
    final = [ln for ln in stdout if ln.startswith("done steps=")]
    loss = final[-1].split("final_loss=")[1].split()[0] if final else None
    marker = next(ln for t, ln in lines if t >= t_kill and any(m in ln for m in markers)).strip()
    return {"detect": t_detect - t_kill, "recover": t_step - t_kill, "resume": resume, "ready": t_ready - t_kill,
            "final_loss": loss, "marker": marker}


def replan_time(plan: Plan) -> float:
    """Seconds the planner takes to re-plan the tiny model on one survivor (for a lost node)."""
    from hetctl.plan.models import load_model
    from hetctl.plan.planner import plan_cluster
    from hetctl.files.cluster import Chip, Cluster, NodeFacts

    node = NodeFacts(name="node-a", host="localhost", tflops_override=1.0, memory_gb=8.0,
                     chips=[Chip(index=0, vendor="cpu", model="cpu", memory_gb=8.0)])
    t0 = time.perf_counter()
    plan_cluster(Cluster(nodes=[node]), load_model("tiny"), global_batch=plan.parallel.global_batch,
                 micro_batch=plan.parallel.micro_batch, homogeneous=False)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=2, help="repetitions of each launcher, alternating order")
    ap.add_argument("--steps", type=int, default=30, help="training steps of each job")
    ap.add_argument("--every", type=int, default=5, help="checkpoint interval in steps")
    ap.add_argument("--kill-step", type=int, default=12, help="kill rank 1 once the last stage reports this step")
    o = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="hetctl-bench-recovery-") as tmp_s:
        tmp = Path(tmp_s)
        inv, plan = setup(tmp)
        print(f"tiny model, pp 2 on one host ({os.cpu_count()} CPUs), {o.steps} steps, checkpoint every {o.every}, "
              f"kill -9 rank 1 at step {o.kill_step}; {o.reps} reps")
        load0 = os.getloadavg()[0]
        het, tr = [], []
        for rep in range(o.reps):
            for which in ((0, 1) if rep % 2 == 0 else (1, 0)):
                if which == 0:
                    het.append(run_hetctl(tmp, inv, plan, o, rep))
                else:
                    tr.append(run_torchrun(tmp, inv, plan, o, rep))
            h, t = het[-1], tr[-1]
            print(f"  rep {rep + 1}: hetctl detect {h['detect']:.3f} s, restart event {h['restart_event']:.2f} s, "
                  f"relaunched {h['launched']:.2f} s, ranks ready {h['ready']:.2f} s, first step {h['recover']:.2f} s "
                  f"(from step {h['resume']}) | torchrun detect {t['detect']:.3f} s, ranks ready {t['ready']:.2f} s, "
                  f"first step {t['recover']:.2f} s (from step {t['resume']})", flush=True)
            leftovers = rank_procs(f"torchrun-{rep}")
            if leftovers:
                raise SystemExit(f"torchrun left ranks behind: {leftovers}")
        hd, td = statistics.median(x["detect"] for x in het), statistics.median(x["detect"] for x in tr)
        hr, trr = statistics.median(x["recover"] for x in het), statistics.median(x["recover"] for x in tr)
        rp = replan_time(plan)
        print(f"load average before {load0:.2f}, after {os.getloadavg()[0]:.2f}")
        print(f"\nkill → detection (median): hetctl {hd:.3f} s, torchrun {td:.3f} s; ratio hetctl/torchrun "
              f"{hd / td:.2f} (goal: hetctl <= 0.2 s)")
        print(f"kill → first step after restart (median): hetctl {hr:.2f} s, torchrun {trr:.2f} s; ratio "
              f"hetctl/torchrun {hr / trr:.2f} (goal: <= torchrun + re-plan time; re-plan here {rp * 1000:.0f} ms)")
        losses = {x["final_loss"] for x in het} | {x["final_loss"] for x in tr}
        print(f"final losses after recovery (float32): {sorted(str(x) for x in losses)} "
              f"({'identical' if len(losses) == 1 else 'differ'})")
        print(f"torchrun's detection line: {tr[-1]['marker'][:160]}")


if __name__ == "__main__":
    main()
