"""Benchmark: recovery from a rank killed with ``kill -9``, ``hetctl launch`` against ``torchrun --max-restarts 1``.

hetctl runs twice per repetition: with warm standby (``--standby on``: the
restarted ranks are handed to spare processes that already imported torch and
the trainer) and without (``--standby off``: new processes, as torchrun does).
With standby the kill waits until each rank's spare reported ``ready`` (in a job
longer than one import that is the normal state). All three run the same trainer (``python -m hetctl.train``), the same two-stage
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

The kill's time is taken just before ``os.kill`` (the rank was found in /proc
before). For hetctl the run's own ``recovery`` event is printed too: detection,
stop, restart (ranks handed over or started), ready (group formed, checkpoint
loaded) and first step, each in seconds from the agent's view of the exit, and
the steps lost (the event's figure: from the just-in-time path where it ran,
else the step in flight minus the resume step). The checkpoint stall ratio of
the last line is measured by ``bench/ckpt_stall.py``'s own job (tiny model, one
repetition per mode, run here), not copied.

hetctl runs its two "nodes" with ``transport: local`` (the agent path is the
same one SSH nodes use); torchrun runs its two workers under its elastic agent
through a small wrapper that gives each rank the hetctl rank environment and
resumes from the newest valid checkpoint (what a torchrun training script does
on restart). hetctl's restart re-uses the plan (a crash is not a membership
change), so no re-planning time is involved; the re-plan time for a lost node is
printed from the planner for reference.

From the repo root::

    python bench/recovery.py --reps 2

The last line, for scripts: ``recovery: first_step_s=<hetctl with standby> torchrun_first_step_s=<torchrun>
steps_lost=<n> async_stall_ratio=<ratio>`` (medians; steps lost: the largest seen in the pp 2 × dp 2 runs).
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
from hetctl.files.run import LaunchOptions  # noqa: E402
from hetctl.launch import materialize as mat  # noqa: E402
from hetctl.files.eventlog import read_events  # noqa: E402
from hetctl.launch.inject import rank_procs  # noqa: E402
from hetctl.node.runtime import read_heartbeat  # noqa: E402
from hetctl.files.yamlio import dump_yaml, save_model  # noqa: E402
from tests.helpers.rankrunner import tiny_plan  # noqa: E402

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


def setup(tmp: Path, dp: int = 1) -> tuple[Path, Plan]:
    """Inventory with 2 × ``dp`` local nodes and shared checkpoints; a pp 2 × dp ``dp`` plan of the tiny model.

    The plan goes to ``tmp/plan`` (dp 1) or ``tmp/plan-dp<dp>``.
    """
    nodes = NODES if dp == 1 else tuple(f"node-{i}" for i in range(2 * dp))
    inv = {
        "defaults": {"transport": "local", "python": sys.executable, "env": {"OMP_NUM_THREADS": "1"}},
        "checkpoint_dir": str(tmp / "ckpt"),
        "nodes": [{"name": n, "host": "localhost", "workdir": str(tmp / "nodes" / n)} for n in nodes],
    }
    inv_path = tmp / ("inventory.yaml" if dp == 1 else f"inventory-dp{dp}.yaml")
    inv_path.write_text(dump_yaml(inv))
    d = tiny_plan([3, 3], dp=dp, micro_batch=2, micro_batches=8)
    for item in d["stages"] + d["ranks"]:
        item["node"] = nodes[int(item["node"][1:])]
    d["nodes"], d["inventory"] = list(nodes), str(inv_path)
    plan = Plan.model_validate(d)
    save_model(tmp / ("plan" if dp == 1 else f"plan-dp{dp}") / "plan.yaml", plan)
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


def kill_rank(run_id: str, rank: int) -> float:
    """SIGKILL one rank (found in /proc first); the time just before the kill."""
    victim = next(p for p in rank_procs(run_id) if p.rank == rank)
    t = time.time()
    os.kill(victim.pid, signal.SIGKILL)
    return t


def ckpt_read_s(ckpt_dir: Path, step: int, plan: Plan) -> float:
    """Seconds the slowest stage takes to read and verify its part of checkpoint ``step`` (as a rank does first)."""
    from hetctl.node.manifest import model_digest, read_verified
    from hetctl.train.units import unit_files

    last = max(s.stage for s in plan.stages)
    worst = 0.0
    for s in plan.stages:
        t0 = time.perf_counter()
        read_verified(ckpt_dir, step, unit_files(tuple(s.layers), s.stage == 0, s.stage == last),
                      model_digest(plan.model.model_dump()))
        worst = max(worst, time.perf_counter() - t0)
    return worst


def spares_ready(run: Path, ranks: int) -> bool | None:
    ready = {e["rank"] for e in read_events(run / "events.jsonl", "standby") if e["state"] == "ready"}
    return len(ready) >= ranks or None


def run_hetctl(tmp: Path, inv: Path, plan: Plan, o: argparse.Namespace, rep: int, standby: str = "on") -> dict:
    dp = plan.parallel.dp
    runs = tmp / f"runs-{standby}-{rep}-dp{dp}"
    plan_dir = tmp / ("plan" if dp == 1 else f"plan-dp{dp}")
    proc = subprocess.Popen([sys.executable, "-m", "hetctl", "launch", str(plan_dir), "-i", str(inv),
                             "--steps", str(o.steps), "--checkpoint-every", str(o.every), "--run-dir", str(runs),
                             "--json", "--grace", "2", "--max-restarts", "1", "--standby", standby],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run = poll(lambda: next(iter(runs.glob("*/run.yaml")), None), "the run folder", proc).parent
    last = max(r.rank for r in plan.ranks)
    node = next(r.node for r in plan.ranks if r.rank == last)
    hb = lambda a: tmp / "nodes" / node / "runs" / run.name / str(a) / "hb" / f"rank-{last}.json"  # noqa: E731
    poll(lambda: step_of(hb(0)) >= o.kill_step or None, f"step {o.kill_step}", proc)
    if standby == "on":
        poll(lambda: spares_ready(run, len(plan.ranks)), "every rank's spare ready", proc)
    killed_at = step_of(hb(0))
    t_kill = kill_rank(run.name, 1)
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
    rec = next(iter(read_events(run / "events.jsonl", "recovery")), {})
    used = [e for e in read_events(run / "events.jsonl", "standby") if e["attempt"] == 1 and e["state"] == "used"]
    return {"detect": ev["ts"] - t_kill, "recover": t_step - t_kill, "resume": resume, "ready": t_ready - t_kill,
            "restart_event": restart["ts"] - t_kill, "launched": launched["ts"] - t_kill, "killed_at": killed_at,
            "handed": (max(e["t"] for e in used) - t_kill) if used else None, "warm": len(used), "rec": rec,
            "ckpt_s": ckpt_read_s(tmp / "ckpt" / run.name, resume, plan) if resume else 0.0,
            "final_loss": f"{json.loads(out)['final_loss']:.9g}"}


def run_torchrun(tmp: Path, inv: Path, plan: Plan, o: argparse.Namespace, rep: int) -> dict:
    where = tmp / f"torchrun-{rep}"
    (where / "env").mkdir(parents=True)
    plan_path = where / "plan.json"
    plan_path.write_bytes(mat.plan_json(plan))
    inventory = load_inventory(inv)
    spec = mat.materialize(plan, {n.name: n for n in inventory.nodes}, run_id=f"torchrun-{rep}", attempt=0,
                           master_addr="127.0.0.1", master_port=0,
                           options=LaunchOptions(steps=o.steps, checkpoint_every=o.every), ckpt_dir=str(where / "ckpt"))
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
    t_kill = kill_rank(f"torchrun-{rep}", 1)
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


def stall_ratio(tmp: Path, reps: int) -> tuple[float, float, float]:
    """async ÷ blocking checkpoint stall per save on the tiny model: bench/ckpt_stall.py's job, run here."""
    sys.path.insert(0, str(ROOT / "bench"))
    import ckpt_stall  # the sibling benchmark's measurement, not a copy of it

    model, split = ckpt_stall.MODELS["tiny"]
    med = {}
    for mode in ("blocking", "async"):
        med[mode] = statistics.median(ckpt_stall.run_job(tmp / f"stall-{mode}-{r}", model, split, mode, 40, 5)["stall"]
                                      for r in range(reps))
    return med["async"] / med["blocking"], med["async"], med["blocking"]


def _f(x: float | None, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=2, help="repetitions of each launcher, alternating order")
    ap.add_argument("--steps", type=int, default=80, help="training steps of each job")
    ap.add_argument("--every", type=int, default=5, help="checkpoint interval in steps")
    ap.add_argument("--kill-step", type=int, default=12, help="kill rank 1 once the last stage reports this step "
                    "(with standby: and every spare is ready)")
    ap.add_argument("--stall-reps", type=int, default=1, help="repetitions of the checkpoint stall job per mode")
    o = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="hetctl-bench-recovery-") as tmp_s:
        tmp = Path(tmp_s)
        inv, plan = setup(tmp)
        print(f"tiny model, pp 2 on one host ({os.cpu_count()} CPUs), {o.steps} steps, checkpoint every {o.every}, "
              f"kill -9 rank 1 at step >= {o.kill_step}; {o.reps} reps")
        load0 = os.getloadavg()
        res: dict[str, list[dict]] = {"on": [], "off": [], "torchrun": []}
        for rep in range(o.reps):
            order = ["on", "off", "torchrun"] if rep % 2 == 0 else ["torchrun", "off", "on"]
            for which in order:
                load = os.getloadavg()[0]
                r = run_torchrun(tmp, inv, plan, o, rep) if which == "torchrun" else \
                    run_hetctl(tmp, inv, plan, o, rep, standby=which)
                r["load"] = load
                res[which].append(r)
                if which == "torchrun":
                    print(f"  rep {rep + 1} torchrun: detect {r['detect']:.3f} s, ranks ready {r['ready']:.2f} s, "
                          f"first step {r['recover']:.3f} s (from step {r['resume']}); load {load:.2f}", flush=True)
                    leftovers = rank_procs(f"torchrun-{rep}")
                    if leftovers:
                        raise SystemExit(f"torchrun left ranks behind: {leftovers}")
                    continue
                rec = r["rec"]
                print(f"  rep {rep + 1} hetctl standby {which:3s}: detect {r['detect']:.3f} s, restart event "
                      f"{r['restart_event']:.3f} s, relaunched {r['launched']:.3f} s, handed to spares "
                      f"{_f(r['handed'])} s ({r['warm']} warm), ranks ready {r['ready']:.3f} s, first step "
                      f"{r['recover']:.3f} s (killed at step {r['killed_at']}, from step {r['resume']}); load "
                      f"{load:.2f}", flush=True)
                print(f"      its recovery event: detection {_f(rec.get('detection_s'))}, stop {_f(rec.get('stop_s'))}, "
                      f"restart {_f(rec.get('restart_s'))}, ready {_f(rec.get('ready_s'))}, first step "
                      f"{_f(rec.get('first_step_s'))} s; steps lost {rec.get('steps_lost')} "
                      f"({rec.get('steps_lost_from')}); checkpoint read+verify alone {r['ckpt_s'] * 1000:.1f} ms",
                      flush=True)
        med = {k: {f: statistics.median(x[f] for x in v) for f in ("detect", "recover", "ready")} for k, v in res.items()}
        lost = max(int(x["rec"].get("steps_lost") or 0) for x in res["on"])
        rp = replan_time(plan)
        print(f"load average (1, 5, 15 min) before {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}, after "
              f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        on, off, tr = med["on"], med["off"], med["torchrun"]
        print(f"\nkill → detection (median): hetctl {on['detect']:.3f} s (standby off {off['detect']:.3f} s), "
              f"torchrun {tr['detect']:.3f} s")
        print(f"kill → ranks ready (median): hetctl standby {on['ready']:.3f} s, standby off {off['ready']:.3f} s, "
              f"torchrun {tr['ready']:.3f} s")
        print(f"kill → first step after restart (median): hetctl standby {on['recover']:.3f} s (goal <= 0.5 s), "
              f"standby off {off['recover']:.3f} s, torchrun {tr['recover']:.3f} s; ratio standby/torchrun "
              f"{on['recover'] / tr['recover']:.2f} (goal <= 0.2), off/torchrun {off['recover'] / tr['recover']:.2f}; "
              f"re-plan for a lost node would add {rp * 1000:.0f} ms")
        print(f"steps lost (largest, hetctl standby): {lost}; checkpoint every {o.every}")
        losses = {x["final_loss"] for v in res.values() for x in v}
        print(f"final losses after recovery (float32): {sorted(str(x) for x in losses)} "
              f"({'identical' if len(losses) == 1 else 'differ'})")
        print(f"torchrun's detection line: {res['torchrun'][-1]['marker'][:160]}")
        load = os.getloadavg()[0]
        ratio, a_ms, b_ms = stall_ratio(tmp, o.stall_reps)
        print(f"checkpoint stall per save (bench/ckpt_stall.py's tiny job): async {a_ms:.1f} ms, blocking "
              f"{b_ms:.1f} ms, ratio {ratio:.3f}; load {load:.2f}")
        # Steps lost with data parallelism: the same kill under pp 2 × dp 2 (four ranks), where the
        # survivors' just-in-time state replaces the checkpoint (the issue's "steps lost <= 1 with dp >= 2").
        inv2, plan2 = setup(tmp, dp=2)
        dp2 = []
        for rep in range(o.reps):
            load = os.getloadavg()[0]
            r = run_hetctl(tmp, inv2, plan2, o, rep, standby="on")
            dp2.append(r)
            rec = r["rec"]
            print(f"  rep {rep + 1} hetctl pp 2 x dp 2: killed at step {r['killed_at']}, resumed from step "
                  f"{r['resume']} ({rec.get('recovery_path')}), steps lost {rec.get('steps_lost')} "
                  f"({rec.get('steps_lost_from')}), first step {r['recover']:.3f} s; load {load:.2f}", flush=True)
        lost2 = max(int(x["rec"].get("steps_lost") or 0) for x in dp2)
        print(f"steps lost (largest) with dp 2: {lost2} (goal <= 1); with dp 1 (checkpoint every {o.every}): {lost}")
        print(f"recovery: first_step_s={on['recover']:.3f} torchrun_first_step_s={tr['recover']:.3f} "
              f"steps_lost={lost2} async_stall_ratio={ratio:.3f}")


if __name__ == "__main__":
    main()
