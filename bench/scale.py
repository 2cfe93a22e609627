"""Benchmark: one controller against N simulated nodes × 8 ranks (issue 36): launch, watch, detect, restart.

The controller is the real one: :class:`~hetctl.elastic.loop.ElasticRun` (policy,
agent pool, recovery clock, event log) running real
:class:`~hetctl.launch.controller.AttemptController` attempts, with the live view's
update hook called as ``hetctl launch`` calls it. Only the nodes are simulated
(:class:`hetctl.remote.simfleet.SimFleet`): one child process plays every node's
agent over real sockets, three file descriptors per node in the controller as an
``ssh`` client's pipes are, ``--latency`` per connection and per command, one
heartbeat per rank every ``--step`` seconds (one ``heartbeats`` line per node, as the real
agent's poll sends them) and ``alive`` per node every second.

Each N runs in a fresh process (so peak memory, threads and descriptors are that
N's alone) and measures:

- launch: ``ElasticRun.run`` called → the controller has seen every rank's first heartbeat
  (polled through the live view's update hook, every 0.25 s);
- steady: over ``--window`` seconds of training, the controller process's CPU
  (``getrusage(RUSAGE_SELF)``: the simulated nodes run in the child, whose CPU is
  printed apart), the events file's growth (→ per hour and per day);
- peak RSS (``ru_maxrss``), threads and open descriptors (``/proc/self``, sampled every 0.2 s);
- detection: a rank made to exit 1 (the node's clock at its exit) → the controller's
  ``rank_failed`` event; the exit is timed 0.1 s after a step boundary, amid the heartbeat
  burst of that step (the worst case: it waits behind them);
- restart: that exit → every rank's first heartbeat of the next attempt (seen by the
  controller), and the run's own ``recovery`` event.

There is no peer: no other launcher runs here against simulated nodes; the figures are
set against the issue's goals and each one's growth from the smallest N is printed
(linear would be the ratio of the node counts).

From the repo root::

    python bench/scale.py                       # 64, 256, 1024 nodes (~3 min on 2 cores)
    python bench/scale.py --nodes 64,2048 --window 20

The last line: ``scale: nodes=<largest> launch_s=… detect_s=… cpu_cores=… rss_mb=… fds=…``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hetctl.files.events import Event, Launched, RankFailed, Recovery  # noqa: E402

RANKS_PER_NODE = 8
# In the growth, a detection under 1 ms counts as 1 ms: at the smallest N it is one line's transit through an empty
# queue (0.2-0.3 ms), so a ratio from it measures the scheduler, not the controller's growth.
FLOOR = {"detect_s": 0.001}
GOALS = {"launch_s": 30.0, "detect_s": 0.5, "cpu_cores": 0.5, "rss_mb": 2048.0, "fds": 2048, "events_mb_day": 100.0}


def build_plan(nodes: int):
    """A plan of ``nodes`` nodes × 8 ranks: pp 2 (1 if ``nodes`` is odd) × dp, each stage 8-way TP on one node."""
    from hetctl.files.plan import Plan
    from tests.helpers.rankrunner import TINY, tiny_plan

    model = {**TINY, "num_attention_heads": 8, "num_query_groups": 8}
    split = [3, 3] if nodes % 2 == 0 else [6]
    return Plan.model_validate(tiny_plan(split, dp=nodes // len(split), tp=RANKS_PER_NODE, model=model))


class Watch:
    """What the bench sees of the run: the live view's updates and the events, with the controller's clock."""

    def __init__(self) -> None:
        self.all_seen: dict[int, float] = {}  # attempt → when every rank had a heartbeat
        self.events: list[Event] = []
        self.cond = threading.Condition()

    def update(self, snap) -> None:
        if snap.attempt not in self.all_seen and all(r.step is not None for r in snap.ranks):
            with self.cond:
                self.all_seen[snap.attempt] = time.time()
                self.cond.notify_all()

    def event(self, ev: Event) -> None:
        with self.cond:
            self.events.append(ev)
            self.cond.notify_all()

    def wait(self, what, timeout: float):
        with self.cond:
            if not self.cond.wait_for(what, timeout):
                raise SystemExit(f"timed out after {timeout:.0f} s waiting for {what.__doc__ or what}")
            return what()

    def first(self, cls: type[Event]) -> Any:
        return next((e for e in self.events if isinstance(e, cls)), None)


class Peaks(threading.Thread):
    """Samples the process's threads and open descriptors every 0.2 s; keeps the largest."""

    def __init__(self) -> None:
        super().__init__(daemon=True, name="bench-peaks")
        self.threads = self.fds = 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.2):
            self.sample()

    def sample(self) -> None:
        with open("/proc/self/status") as f:
            threads = next(int(ln.split()[1]) for ln in f if ln.startswith("Threads:"))
        self.threads = max(self.threads, threads)
        self.fds = max(self.fds, len(os.listdir("/proc/self/fd")))


def child_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def self_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def measure(nodes: int, o: argparse.Namespace) -> dict:
    """One N, in this process: the run, the crash, the restart; the figures as a dict."""
    from hetctl.elastic.loop import ElasticRun
    from hetctl.elastic.policy import PolicyConfig
    from hetctl.elastic.start import prepare_launch
    from hetctl.files.inventory import Inventory, Node, SshSettings
    from hetctl.files.run import LaunchOptions
    from hetctl.remote.simfleet import SimFleet

    plan = build_plan(nodes)
    peaks = Peaks()
    peaks.start()
    with tempfile.TemporaryDirectory(prefix="hetctl-bench-scale-") as tmp_s, \
            SimFleet(latency_s=o.latency, step_s=o.step) as fleet:
        tmp = Path(tmp_s)
        (tmp / "ck").mkdir()
        inv = Inventory(checkpoint_dir=str(tmp / "ck"), ssh=SshSettings(relay_above=getattr(o, "relay_above", None)),
                        nodes=[Node(name=n, host=n, python="/usr/bin/python3", workdir=f"/w/{n}") for n in plan.nodes])
        prepared = prepare_launch(plan, inv, LaunchOptions(steps=10**7, checkpoint_every=0), run_root=tmp / "runs",
                                  plan_path=None, policy=PolicyConfig(max_restarts=3))
        watch, stop, out = Watch(), threading.Event(), {}
        t0 = time.time()

        def drive() -> None:
            try:
                out["result"] = ElasticRun(prepared, connect=fleet.connect).run(
                    stop, listeners=[watch.event], on_update=watch.update)
            except BaseException as e:  # noqa: BLE001 - reported by the main thread
                out["error"] = e
            finally:
                with watch.cond:
                    watch.cond.notify_all()

        runner = threading.Thread(target=drive, name="bench-controller")
        runner.start()
        limit = 120 + nodes * 0.1

        def beating(attempt: int):
            def every_rank() -> bool:
                """every rank's first heartbeat of the attempt"""
                if "error" in out:
                    raise SystemExit(f"the run failed: {out['error']!r}")
                return attempt in watch.all_seen
            return every_rank

        watch.wait(beating(0), limit)
        launch_s = watch.all_seen[0] - t0
        ev_launched = watch.first(Launched).ts - t0
        time.sleep(o.settle)
        events = prepared.run.events_path
        cpu0, sim0, size0, w0 = self_cpu(), child_cpu(fleet.proc.pid), events.stat().st_size, time.time()
        time.sleep(o.window)
        cpu1, sim1, size1, w1 = self_cpu(), child_cpu(fleet.proc.pid), events.stat().st_size, time.time()
        peaks.sample()
        victim = plan.nodes[len(plan.nodes) // 2]
        rank = next(r.rank for r in plan.ranks if r.node == victim)
        # The crash lands mid-burst (0.1 s after a step boundary, half the agents' 0.2 s heartbeat poll): its
        # exit waits behind the heartbeats already queued, the worst case for detection.
        boundary = fleet.epoch + (int((time.time() - fleet.epoch) / o.step) + 1) * o.step
        time.sleep(max(0.0, boundary + min(0.1, o.step / 2) - time.time()))
        t_crash = fleet.crash(victim, rank, code=1)

        def failed():
            """the rank_failed event"""
            return watch.first(RankFailed)

        detect_s = watch.wait(failed, 60).ts - t_crash

        watch.wait(beating(1), limit)
        restart_s = watch.all_seen[1] - t_crash
        rec = watch.wait(lambda: watch.first(Recovery), 30)
        t_stop = time.time()
        stop.set()
        runner.join(timeout=120)
        stop_s = time.time() - t_stop
        peaks.done.set()
        peaks.sample()
        if "error" in out:
            raise SystemExit(f"the run failed: {out['error']!r}")
        state = out["result"].summary.state
        rate = (size1 - size0) / (w1 - w0)
        return {
            "nodes": nodes, "ranks": len(plan.ranks), "launch_s": launch_s, "launched_event_s": ev_launched,
            "detect_s": detect_s, "restart_s": restart_s, "stop_s": stop_s, "state": state,
            "recovery": {k: getattr(rec, k) for k in ("detection_s", "stop_s", "restart_s", "ready_s", "first_step_s")},
            "cpu_cores": (cpu1 - cpu0) / (w1 - w0), "sim_cores": (sim1 - sim0) / (w1 - w0),
            "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
            "threads": peaks.threads, "fds": peaks.fds, "events_mb_h": rate * 3600 / 1e6,
            "events_mb_day": rate * 86400 / 1e6, "events_lines": sum(1 for _ in events.open()),
            "load": os.getloadavg()[0],
        }


def fmt_table(rows: list[dict]) -> list[str]:
    cols = [("nodes", "nodes", "d"), ("ranks", "ranks", "d"), ("launch_s", "launch s", ".2f"),
            ("detect_s", "detect s", ".3f"), ("restart_s", "restart s", ".2f"), ("cpu_cores", "cpu cores", ".3f"),
            ("sim_cores", "sim cores", ".2f"), ("rss_mb", "rss MB", ".0f"), ("threads", "threads", "d"),
            ("fds", "fds", "d"), ("events_mb_day", "events MB/day", ".0f"), ("load", "load", ".1f")]
    out = ["  ".join(f"{h:>13}" for _, h, _ in cols)]
    for r in rows:
        out.append("  ".join(f"{format(r[k], f):>13}" for k, _, f in cols))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", default="64,256,1024", help="node counts, comma-separated (8 ranks each)")
    ap.add_argument("--latency", type=float, default=0.05, help="seconds per connection and per command")
    ap.add_argument("--step", type=float, default=1.0, help="seconds per training step (one heartbeat per rank)")
    ap.add_argument("--settle", type=float, default=3.0, help="seconds after launch before the steady window")
    ap.add_argument("--window", type=float, default=10.0, help="seconds of steady training measured")
    ap.add_argument("--relay-above", type=int, default=None,
                    help="the inventory's ssh.relay_above: past this many nodes the agents go through relays")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a child: measure one N, print JSON
    o = ap.parse_args()
    if o.one:
        print(json.dumps(measure(o.one, o)), flush=True)
        return
    counts = [int(x) for x in o.nodes.split(",")]
    print(f"{RANKS_PER_NODE} ranks per node, {o.latency * 1000:.0f} ms per connection and command, a step every "
          f"{o.step:g} s, steady window {o.window:g} s; relays past {o.relay_above or 'never'} nodes; {os.cpu_count()} "
          f"CPUs, load {os.getloadavg()[0]:.2f}")
    rows = []
    for n in counts:
        argv = [sys.executable, __file__, "--one", str(n), "--latency", str(o.latency), "--step", str(o.step),
                "--settle", str(o.settle), "--window", str(o.window),
                *(["--relay-above", str(o.relay_above)] if o.relay_above else [])]
        proc = subprocess.run(argv, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{n} nodes: exit {proc.returncode}\n{proc.stderr[-3000:]}")
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        rows.append(r)
        rec = r["recovery"]
        print(f"  {n} nodes: launch {r['launch_s']:.2f} s (launched event {r['launched_event_s']:.2f} s), detect "
              f"{r['detect_s']:.3f} s, restart {r['restart_s']:.2f} s (recovery event: detection "
              f"{rec['detection_s']}, stop {rec['stop_s']}, restart {rec['restart_s']}, ready {rec['ready_s']} s), "
              f"stop {r['stop_s']:.2f} s, {r['events_lines']} event lines, ended {r['state']}", flush=True)
    print()
    for line in fmt_table(rows):
        print(line)
    base = rows[0]
    print(f"\ngrowth from {base['nodes']} nodes (linear would be the node ratio; a detection under 1 ms counts as 1 ms):")
    for r in rows[1:]:
        ratio = r["nodes"] / base["nodes"]
        parts = [f"{k} {r[k] / max(base[k], FLOOR.get(k, 0)):.2f}x" for k in (
            "launch_s", "detect_s", "restart_s", "cpu_cores", "rss_mb", "threads", "fds", "events_mb_day") if base[k]]
        print(f"  {r['nodes']} nodes ({ratio:g}x): " + ", ".join(parts))
    last = max(rows, key=lambda r: r["nodes"])
    missed = [f"{k} {last[k]:.3g} > {g:g}" for k, g in GOALS.items() if last[k] > g]
    print(f"\ngoals at {last['nodes']} nodes: " + ("all met" if not missed else "not met: " + ", ".join(missed)))
    print(f"scale: nodes={last['nodes']} launch_s={last['launch_s']:.2f} detect_s={last['detect_s']:.3f} "
          f"cpu_cores={last['cpu_cores']:.3f} rss_mb={last['rss_mb']:.0f} fds={last['fds']}")


if __name__ == "__main__":
    main()
