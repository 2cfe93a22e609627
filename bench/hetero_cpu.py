"""Benchmark: a real mixed-speed cluster on this machine, the plan's split against uniform and proportional, measured.

Three local nodes, each in a cgroup v1 ``cpu`` group of its own with a CFS quota
in the ratio ``--quotas`` (default 4:2:1; the largest ``--top-cpu`` of one CPU,
default 0.5, so that the three together stay well under this machine's two
cores and do not compete), one torch thread per rank: really different speeds,
not declared ones. The model is
``--layers`` transformer layers of the reference trainer's blocks. In one run:

1. probe the nodes with equal declared speeds and launch the **uniform** split
   (equal layers per stage, Megatron's default) — the run a user starts with;
2. ``hetctl plan --calibrate`` on that run: per-node speeds from its measured
   stage compute, and the per-message cost of its links from its measured step
   (:mod:`hetctl.runs.linkfit`); then, up to ``--rounds`` (3) calibrations in
   all, the plan just made is run and calibrated on again together with every run
   before it, as a user would (``plan --calibrate RUN --calibrate RUN2 ...``: each
   node's speed from the run it was busiest in, the links from the newest): a
   node whose stage waits computes in short bursts, which a CFS quota (like a
   chip's boost clock) runs faster than it sustains, so a node's speed is only
   right once a plan has made it the busy one. The rounds stop early when a
   calibration makes a plan that has run already. The **hetctl** plan is the one
   made on the last calibration, with its predicted tokens/s;
3. launch the hetctl plan; the **best plain pipeline** on the same figures (one
   shape, no replicas of different depth: the issue-12 comparison; when the
   hetctl plan is one, it is said so and not run twice); the **proportional**
   split (layers rounded in proportion to the calibrated speeds over every
   node, in the plain pipeline's stage order where it has every node, else the
   uniform split's);
4. launch the model on **each node alone**, the three at once (each in its own
   cgroup: the homogeneous references), the slowest for ``--alone-steps`` steps
   and the others for as many more as their calibrated speed allows in the same
   time, so that all three are busy together throughout, as in the mixed runs;
   with ``--pairs N`` the hetctl plan and the references are measured N times in
   turn, and the utilization is the median of each pair's ratio (the machine's
   drift between runs cancels within a pair).

Each node's group also gets a large CFS weight (``cpu.shares``), so that other
work on the machine cannot take it below its quota. The load average is printed
at the start and the end: on a shared machine it moves the figures.

**Cores of its own** (``--cpus-per-node 8,4,2``, issue 31): instead of quotas,
each node gets that many CPUs of this machine's, disjoint (``taskset``, no
cgroup, no CFS quota, no root), and as many torch threads (``OMP_NUM_THREADS``
in its inventory entry, which the trainer follows): node speeds come from core
counts and do not drift with bursts and waits. It needs as many cores as the
counts add up to (14 for 8,4,2: a 16-core GPU machine, from
``scripts/device_check.sh``); with fewer, the sets wrap around and share cores,
the bench still runs, and it says that its figures are not evidence.

Printed: measured tokens/s of each, hetctl's prediction error against its own
measured run, the speed-up over uniform and proportional, and measured
utilization against the homogeneous sum (the published metric for mixed-chip
training, here measured). Needs root and ``/sys/fs/cgroup/cpu``.

From the repo root::

    python bench/hetero_cpu.py            # 24 layers, global batch 64 in micro-batches of 2, 8 steps (3 alone)
    python bench/hetero_cpu.py --cpus-per-node 8,4,2 --pairs 2     # 14 cores of its own (no root needed)

Last line, for scripts::

    hetero_cpu: prediction_error=<percent> vs_uniform=<ratio> vs_proportional=<ratio> vs_homogeneous=<percent> \
vs_plain_pipeline=<ratio>
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hetctl.runs.calibrate import calibrate  # noqa: E402
from hetctl.files.cluster import Cluster  # noqa: E402
from hetctl.files.yamlio import dump_yaml, load_model, save_model  # noqa: E402
from hetctl.plan.models import load_model as load_spec  # noqa: E402
from hetctl.plan.partition import proportional_split  # noqa: E402
from hetctl.plan.planner import plan_cluster  # noqa: E402
from hetctl.plan.render import write_plan_dir  # noqa: E402
from hetctl.plan.candidates import Pins  # noqa: E402

CPU = Path("/sys/fs/cgroup/cpu")
NODES = ("node-a", "node-b", "node-c")
PERIOD_US = 10_000  # a short CFS period: throttling close to a uniformly slower CPU, not long stalls
SHARES = 16 * 1024  # CFS weight of each node's group against the rest of the machine (default 1024)


def cli(d: Path, *args: str, timeout: float = 1800) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "hetctl", *args], cwd=d, capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    if r.returncode != 0:
        raise SystemExit(f"hetctl {' '.join(args)} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return r


# ``--steady``: an idle-priority spinner in each node's cgroup, pinned to the node's CPU. It runs only while the
# node's own processes wait, and so spends the quota they leave; a burst after a wait then runs at the quota's
# rate, as a slower chip would, instead of at full speed on the quota the wait saved. argv: cgroup.procs, CPU,
# the bench's pid: the spinner dies with the bench (PR_SET_PDEATHSIG), also when the bench is killed.
SPIN = """
import ctypes, os, signal, sys
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[3]):
    sys.exit(0)  # the bench ended before the line above
with open(sys.argv[1], "w") as f:
    f.write(str(os.getpid()))
os.sched_setaffinity(0, {int(sys.argv[2])})
os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
while True:
    pass
"""
SPINNERS: list[subprocess.Popen] = []


def pin_cpus(quotas: list[int]) -> dict[str, int]:
    """Each node's CPU for ``--steady`` and ``--pin``: largest quota first, each on the CPU with the least quota so far."""
    load = [0.0] * (os.cpu_count() or 1)
    cpus = {}
    for node, q in sorted(zip(NODES, quotas), key=lambda x: -x[1]):
        cpus[node] = min(range(len(load)), key=lambda c: load[c])
        load[cpus[node]] += q
    return cpus


def core_sets(counts: list[int], allowed: list[int]) -> tuple[dict[str, list[int]], bool]:
    """``--cpus-per-node``: each node's CPUs, consecutive and disjoint from the CPUs this process may use; and
    whether they had to wrap around (more asked for than there are: the nodes then share cores)."""
    sets, i = {}, 0
    for node, n in zip(NODES, counts):
        sets[node] = [allowed[(i + k) % len(allowed)] for k in range(n)]
        i += n
    return sets, sum(counts) > len(allowed)


def make_groups(tag: str, quotas: list[int], top_cpu: float, cpus: dict[str, int] | None = None,
                spin: bool = True) -> dict[str, Path]:
    """One cgroup per node; the largest quota is ``top_cpu`` of one CPU (``cpus`` and ``spin``: a spinner pinned in
    each)."""
    top = max(quotas)
    groups = {}
    for node, q in zip(NODES, quotas):
        g = CPU / f"hetctl-bench-{tag}-{node}"
        g.mkdir()
        # (Tried: 1 ms of quota in a period of 1 ms ÷ share, 2/4/8 ms at 4:2:1, so that no burst runs over 1 ms at
        # full speed: every run and node alone ran 10-25% slower, 76% of the homogeneous sum; bench/README.)
        (g / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (g / "cpu.cfs_quota_us").write_text(str(int(PERIOD_US * top_cpu * q / top)))
        # A large weight, so that other work on the machine cannot take a node below its quota (with the
        # default 1024, a loaded machine gave node-a about node-b's share and the speeds read 2.6:2:1).
        (g / "cpu.shares").write_text(str(SHARES))
        groups[node] = g
        if cpus is not None and spin:
            SPINNERS.append(subprocess.Popen([sys.executable, "-c", SPIN, str(g / "cgroup.procs"), str(cpus[node]),
                                             str(os.getpid())]))
    return groups


def remove_groups(groups: dict[str, Path]) -> None:
    for spinner in SPINNERS:
        spinner.kill()
        spinner.wait()
    for g in groups.values():
        for pid in (g / "cgroup.procs").read_text().split():
            try:
                (CPU / "cgroup.procs").write_text(pid)
            except OSError:
                pass
        try:
            g.rmdir()
        except OSError as e:
            print(f"note: could not remove {g}: {e.strerror}", file=sys.stderr)


def write_site(d: Path, groups: dict[str, Path], layers: int, cpus: dict[str, int] | None = None,
               cores: dict[str, list[int]] | None = None) -> None:
    """Inventory (each node's python enters its cgroup first, pinned to its CPU with ``cpus``; or, with
    ``cores``, bound to its own CPUs with as many torch threads), the model file, and the probe."""
    nodes = []
    for node in NODES:
        wrap = d / f"python-{node}"
        enter = f"echo $$ > {groups[node] / 'cgroup.procs'}\n" if node in groups else ""
        pin = (f"taskset -c {_ranges(cores[node])} " if cores is not None
               else f"taskset -c {cpus[node]} " if cpus is not None else "")
        wrap.write_text(f"#!/bin/sh\n{enter}exec {pin}{sys.executable} \"$@\"\n")
        wrap.chmod(0o755)
        entry = {"name": node, "host": "localhost", "python": str(wrap), "workdir": f"nodes/{node}", "tflops": 1.0}
        if cores is not None:  # the trainer's torch threads follow OMP_NUM_THREADS (its --threads default)
            entry["env"] = {"OMP_NUM_THREADS": str(len(cores[node]))}
        nodes.append(entry)
    inv = {"defaults": {"transport": "local", "env": {"OMP_NUM_THREADS": "1"}}, "checkpoint_dir": "checkpoints",
           "nodes": nodes}
    (d / "inventory.yaml").write_text(dump_yaml(inv))
    spec = {"name": f"bench-{layers}l", "num_layers": layers, "hidden_size": 128, "ffn_hidden_size": 352,
            "num_attention_heads": 4, "num_query_groups": 2, "vocab_size": 512, "seq_len": 64, "swiglu": True}
    (d / "model.yaml").write_text(dump_yaml(spec))
    cli(d, "probe", "-i", "inventory.yaml", "-o", "cluster.yaml")


def with_split(plan, counts: list[int]):
    """The same plan (stages, ranks, order) with another layer split."""
    stages, start = [], 0
    for s, n in zip(plan.stages, counts):
        stages.append(s.model_copy(update={"layers": (start, start + n)}))
        start += n
    return plan.model_copy(update={"stages": stages})


def launch(d: Path, name: str, plan, steps: int, quiet: bool = False):
    """Launch ``plan`` and return its summary (``quiet``: start it and return the process, see :func:`finish`)."""
    folder = d / name
    write_plan_dir(plan, folder)
    args = [sys.executable, "-m", "hetctl", "launch", str(folder), "-i", "inventory.yaml", "--steps", str(steps),
            "--checkpoint-every", "0", "--run-dir", "runs", "--json", "--hang-timeout", "600",
            "--standby", "off"]  # a spare's torch import would run in the node's cgroup beside its rank
    proc = subprocess.Popen(args, cwd=d, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    STARTED.append(proc)
    return proc if quiet else finish(name, plan, proc)


STARTED: list[subprocess.Popen] = []  # every launch, stopped (SIGTERM: hetctl's clean stop) if the bench ends early


def stop_launches() -> None:
    for proc in STARTED:
        if proc.poll() is None:
            proc.terminate()
    for proc in STARTED:
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()


def finish(name: str, plan, proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"hetctl launch {name} failed ({proc.returncode}):\n{err[-3000:]}")
    summary = json.loads(out)
    print(f"  {name:<14} {split_of(plan):<34} {summary['tokens_per_s']:>10,.1f} tokens/s", flush=True)
    return summary


def alone_set(d: Path, plans: dict, steps: dict[str, int], tag: str) -> dict[str, dict]:
    """Each node alone, the three at once (each in its own cgroup): the homogeneous references' summaries."""
    procs = {node: launch(d, f"alone-{node}{tag}", plan, steps[node], quiet=True) for node, plan in plans.items()}
    return {node: finish(f"alone-{node}{tag}", plans[node], proc) for node, proc in procs.items()}


def alone_steps(rate: dict[str, float], slowest: int, matched: bool) -> dict[str, int]:
    """Steps of each node-alone run: ``slowest`` for the slowest node; with ``matched``, the others in proportion
    to their calibrated speed, so that the three run over about the same wall time, all busy together as in the
    mixed runs (otherwise the fast nodes finish early, and the slow one runs its last steps on an idle machine)."""
    low = min(rate[n] for n in NODES)
    return {n: max(slowest, round(slowest * rate[n] / low)) if matched else slowest for n in NODES}


def split_of(plan) -> str:
    """Layers per node, replica by replica ("|" between replicas)."""
    return " | ".join(" ".join(f"{s.node}:{s.layers[1] - s.layers[0]}" for s in plan.stages_of(r))
                      for r in range(plan.parallel.dp))


def shape_of(plan) -> str:
    if plan.replicas:
        return (f"{plan.parallel.dp} replicas of different shape, micro-batches "
                + "/".join(str(r.micro_batches) for r in plan.replicas))
    return f"pp {plan.parallel.pp} × dp {plan.parallel.dp}, {plan.parallel.micro_batches} micro-batches"


MIN_CORES = 14  # 8 + 4 + 2 pinned cores (issue 31): below this the nodes share cores and their speeds drift


def apparatus_noise(pairs: list) -> float | None:
    """The largest spread of one node's alone-reference tokens/s between pairs, (max − min) / median;
    None with one pair. What the apparatus itself moves between runs of the same work: a figure
    within it of its goal is no evidence either way."""
    if len(pairs) < 2:
        return None
    spreads = []
    for node in pairs[0][1]:
        rates = [refs[node]["tokens_per_s"] for _, refs in pairs]
        spreads.append((max(rates) - min(rates)) / statistics.median(rates))
    return max(spreads)


def _ranges(cpus: list[int]) -> str:
    """``[0, 1, 2, 5]`` → ``0-2,5``."""
    out, start = [], None
    for i, c in enumerate(cpus):
        if start is None:
            start = c
        if i + 1 == len(cpus) or cpus[i + 1] != c + 1:
            out.append(str(start) if start == c else f"{start}-{c}")
            start = None
    return ",".join(out)


def load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quotas", default="4:2:1", help="CPU quotas of node-a:node-b:node-c, relative")
    ap.add_argument("--top-cpu", type=float, default=0.5,
                    help="share of one CPU the largest quota gets; keep the sum of all quotas well under the "
                         "machine's cores, so that the nodes are as independent as separate machines")
    ap.add_argument("--layers", type=int, default=24,
                    help="layers of the model: 24 lets the split follow 4:2:1 closely (14:7:3; 12 layers allow 8:3:1 at best)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--global-batch", type=int, default=64,
                    help="32 micro-batches of 2: the 1F1B bubble of 3 stages is (3-1)/34 = 6%% (3%% at 128, whose "
                         "runs take half as long again: bench/README)")
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3,
                    help="calibrations before the measured hetctl run, at most: 1 = on the uniform run only; each "
                         "more runs the plan just made and calibrates on every run so far (a node's speed from the "
                         "run it was busiest in: a stage that waits runs in short bursts, faster than it sustains); "
                         "fewer when a calibration makes a plan that has run already")
    ap.add_argument("--alone-steps", type=int, default=3,
                    help="steps of the slowest node's alone run; the faster nodes run as many more as their calibrated "
                         "speed allows in the same time (see --no-matched-alone)")
    ap.add_argument("--no-matched-alone", dest="matched_alone", action="store_false",
                    help="every node-alone run takes --alone-steps steps (the fast ones then finish first, and the "
                         "slow ones' last steps run on a machine the others have left)")
    ap.add_argument("--pairs", type=int, default=1,
                    help="measure the hetctl plan and the node-alone references this many times, one after the other "
                         "(hetctl, alone, hetctl, alone, ...): the utilization is each pair's ratio, and its median is "
                         "reported, so that drift between runs on a shared machine cancels within a pair")
    ap.add_argument("--steady", action="store_true",
                    help="pin each node to a CPU with an idle-priority spinner in its cgroup that spends the quota its "
                         "ranks leave while they wait, so that a node computes at one speed whether or not its stage "
                         "waits (without it, a burst after a wait runs faster than back-to-back work: bench/README)")
    ap.add_argument("--pin", action="store_true",
                    help="pin each node to a CPU (largest quota first, each on the least-loaded CPU), no spinner: "
                         "pipeline neighbours wake each other with every message, and the scheduler's wake-affine "
                         "placement can put two nodes on one CPU while the other idles")
    ap.add_argument("--cpus-per-node", metavar="A,B,C",
                    help="give node-a, node-b, node-c that many CPUs each, disjoint, and as many torch threads, "
                         "instead of CFS quotas (no cgroup, no root): speeds from core counts, which do not drift; "
                         "needs their sum in cores (8,4,2: 14), else the sets share cores and the figures are no "
                         "evidence")
    ap.add_argument("--keep-run", metavar="DIR", help="copy the uniform run's folder here (a recorded run for tests)")
    ap.add_argument("--keep-runs", metavar="DIR", help="copy every run calibrated on here, as DIR/uniform, DIR/round1…")
    args = ap.parse_args()
    if args.pairs < 1:
        ap.error("--pairs must be at least 1")
    cores, shared = None, False
    if args.cpus_per_node is not None:
        try:
            counts = [int(x) for x in args.cpus_per_node.split(",")]
        except ValueError:
            counts = []
        if len(counts) != len(NODES) or min(counts) < 1:
            ap.error(f"--cpus-per-node takes {len(NODES)} positive CPU counts, e.g. 8,4,2 (got {args.cpus_per_node!r})")
        if args.steady or args.pin:
            ap.error("--cpus-per-node gives each node its own CPUs: --steady and --pin are for the quota mode")
        cores, shared = core_sets(counts, sorted(os.sched_getaffinity(0)))
    elif os.geteuid() != 0 or not (CPU / "cgroup.procs").exists():
        print("needs root and the cgroup v1 cpu controller at /sys/fs/cgroup/cpu (or --cpus-per-node, which needs "
              "neither)", file=sys.stderr)
        return 2
    quotas = [int(q) for q in args.quotas.split(":")]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the finally below runs
    cpus = pin_cpus(quotas) if args.steady or args.pin else None
    t0 = time.monotonic()
    groups: dict[str, Path] = {}
    try:
        if cores is None:
            groups = make_groups(uuid.uuid4().hex[:6], quotas, args.top_cpu, cpus, spin=args.steady)
        with tempfile.TemporaryDirectory(prefix="hetctl-hetero-") as tmp:
            d = Path(tmp)
            write_site(d, groups, args.layers, cpus, cores)
            facts = load_model(d / "cluster.yaml", Cluster)
            spec = load_spec(str(d / "model.yaml"))
            shape = {"global_batch": args.global_batch, "micro_batch": args.micro_batch}
            how = (f"cores of their own: {', '.join(f'{n} CPUs {_ranges(c)}' for n, c in cores.items())} "
                   f"(as many threads each{'; SHARED: more asked for than there are' if shared else ''})"
                   if cores is not None else
                   f"quotas {args.quotas} (largest {args.top_cpu:g} CPU), one thread per rank")
            print(f"cluster: {len(NODES)} CPU nodes, {how}, {os.cpu_count()} cores; model {args.layers} "
                  f"layers; global batch {args.global_batch}, micro-batch {args.micro_batch}; {args.steps} steps "
                  f"({args.alone_steps} alone); "
                  + (f"{'steady' if args.steady else 'pin'}: pinned {', '.join(f'{n} CPU {c}' for n, c in cpus.items())}"
                     + (", an idle spinner in each; " if args.steady else "; ") if cpus else "")
                  + load())
            base = plan_cluster(facts, spec, pins=Pins(pp=len(NODES), dp=1), cluster_path=d / "cluster.yaml", **shape)
            per = args.layers // len(NODES)
            uniform = with_split(base, [per + (1 if i < args.layers % len(NODES) else 0) for i in range(len(NODES))])
            print("measured:")
            u = launch(d, "uniform", uniform, args.steps)
            if args.keep_run:
                shutil.copytree(u["run_dir"], args.keep_run, dirs_exist_ok=True)
            runs, plans = [Path(u["run_dir"])], [uniform]
            cal = calibrate(*runs)
            save_model(d / "cluster.calibrated.yaml", cal.cluster)
            het = plan_cluster(cal.cluster, spec, cluster_path=d / "cluster.calibrated.yaml", **shape)
            for r in range(1, args.rounds):  # calibrate again on the calibrated plan's own run, as a user would
                if any(split_of(het) == split_of(ran) for ran in plans):
                    print(f"  {'':<14} (calibration {r}'s plan {split_of(het)} has run already: no new figures, "
                          "no more rounds)")
                    break
                first = launch(d, f"hetctl-round{r}", het, args.steps)
                print(f"  {'':<14} (predicted {het.estimate.tokens_per_s:,.1f} tokens/s; calibrated again on it "
                      "and the runs before: plan --calibrate RUN --calibrate RUN2)")
                runs.append(Path(first["run_dir"]))
                plans.append(het)
                cal = calibrate(*runs)
                save_model(d / f"cluster.calibrated-{r}.yaml", cal.cluster)
                het = plan_cluster(cal.cluster, spec, cluster_path=d / f"cluster.calibrated-{r}.yaml", **shape)
            if args.keep_runs:  # the runs calibrated on, with the facts each was planned from (a recorded set for tests)
                for i, (run, planned) in enumerate(zip(runs, plans)):
                    kept = Path(args.keep_runs) / ("uniform" if i == 0 else f"round{i}")
                    shutil.copytree(run, kept, dirs_exist_ok=True, ignore=shutil.ignore_patterns("controller.lock"))
                    shutil.copy(planned.cluster, kept / "attempts" / "0" / "cluster.yaml")
            predicted = het.estimate.tokens_per_s
            h = launch(d, "hetctl", het, args.steps)
            # The best plain pipeline (one shape, no replicas of different depth) on the same calibrated figures.
            plain = het if not het.replicas and het.parallel.dp == 1 else plan_cluster(
                cal.cluster, spec, pins=Pins(dp=1), cluster_path=d / "cluster.calibrated.yaml", **shape)
            pl = h if plain is het else launch(d, "plain-pipeline", plain, args.steps)
            rate = {n.name: n.tflops_override or 1.0 for n in cal.cluster.nodes}  # the calibrated speeds
            # Over every node (Megatron-style: each gets layers in proportion to its speed), in the plain
            # pipeline's stage order where it has every node, else the uniform split's.
            order = plain if len(plain.stages_of(0)) == len(NODES) else uniform
            counts = proportional_split(args.layers, [rate[s.node] for s in order.stages_of(0)])
            p = launch(d, "proportional", with_split(order, counts), args.steps) if counts else None
            # Each node alone, the three at once: each in its own cgroup, as independent as during the runs above.
            alone_plans = {}
            for node in NODES:
                one = cal.cluster.model_copy(update={"nodes": [n for n in cal.cluster.nodes if n.name == node]})
                alone_plans[node] = plan_cluster(one, spec, cluster_path=d / "cluster.yaml", **shape)
            steps_alone = alone_steps(rate, args.alone_steps, args.matched_alone)
            if args.matched_alone:
                print(f"  {'':<14} (node-alone steps, in proportion to the calibrated speeds: "
                      + ", ".join(f"{n} {k}" for n, k in steps_alone.items()) + ")", flush=True)
            pairs = [(h, alone_set(d, alone_plans, steps_alone, ""))]
            for k in range(2, args.pairs + 1):  # again, right after: hetctl, then the references
                pairs.append((launch(d, f"hetctl#{k}", het, args.steps), alone_set(d, alone_plans, steps_alone, f"#{k}")))
    finally:
        stop_launches()
        remove_groups(groups)

    sums = [sum(a["tokens_per_s"] for a in refs.values()) for _, refs in pairs]  # each pair's homogeneous sum
    ratios = [mixed["tokens_per_s"] / hom_k for (mixed, _), hom_k in zip(pairs, sums)]
    hom = sums[0]
    err = (predicted - h["tokens_per_s"]) / h["tokens_per_s"]
    vs_u = h["tokens_per_s"] / u["tokens_per_s"]
    vs_p = h["tokens_per_s"] / p["tokens_per_s"] if p else float("nan")
    vs_h = statistics.median(ratios)
    vs_pl = h["tokens_per_s"] / pl["tokens_per_s"]
    print(f"hetctl plan: {split_of(het)} ({shape_of(het)}); {cal.note()}")
    print(f"predicted {predicted:,.1f} tokens/s, measured {h['tokens_per_s']:,.1f}: error {100 * err:+.1f}%")
    if plain is het:
        print("best plain pipeline: the chosen layout is itself a plain pipeline (vs_plain_pipeline 1.000)")
    else:
        print(f"best plain pipeline: {split_of(plain)} ({shape_of(plain)}), predicted "
              f"{plain.estimate.tokens_per_s:,.1f} tokens/s, measured {pl['tokens_per_s']:,.1f}; chosen / plain {vs_pl:.3f}")
    print(f"hetctl / uniform {vs_u:.3f}; hetctl / proportional {vs_p:.3f}; "
          f"measured utilization vs the homogeneous sum ({hom:,.1f} tokens/s) {100 * ratios[0]:.1f}%")
    if len(pairs) > 1:
        print("utilization, pair by pair (hetctl / the sum of the node-alone runs right after it): "
              + ", ".join(f"{m['tokens_per_s']:,.1f} / {hom_k:,.1f} = {100 * x:.1f}%"
                          for (m, _), hom_k, x in zip(pairs, sums, ratios))
              + f"; median {100 * vs_h:.1f}% (the last line's vs_homogeneous)")
    noise = apparatus_noise(pairs)
    print("apparatus noise (largest spread of a node-alone reference between pairs): "
          + (f"{100 * noise:.1f}%" if noise is not None else "not measured (one pair: run --pairs 2 or more)"))
    if cores is not None and shared:
        print(f"--cpus-per-node {args.cpus_per_node} asks for {sum(len(c) for c in cores.values())} CPUs and this "
              f"process may use {len(os.sched_getaffinity(0))}: the nodes shared cores, so these figures are not "
              "evidence for the goals")
    elif cores is None and (os.cpu_count() or 1) < MIN_CORES:
        print(f"on {os.cpu_count()} cores the nodes share cores and their speeds drift: these figures are not "
              f"evidence for the goals (they need {MIN_CORES} or more cores, each node on its own: "
              "--cpus-per-node 8,4,2)")
    print(f"took {time.monotonic() - t0:.0f} s; at the end {load()}")
    print(f"hetero_cpu: prediction_error={100 * abs(err):.1f} vs_uniform={vs_u:.3f} vs_proportional={vs_p:.3f} "
          f"vs_homogeneous={100 * vs_h:.1f} vs_plain_pipeline={vs_pl:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
