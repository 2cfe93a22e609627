"""ZB-H1 against 1F1B on real ranks: the same pipeline, data and steps, each stage pinned to its own CPU.

```
python bench/zb_cpu.py                     # pp 2 (one CPU per stage), 8 micro-batches; no root
python bench/zb_cpu.py --pp 3 --pairs 4 --json
```

Both runs are hetctl's trainer (``python -m hetctl.train``) on the same plan, started with the rank
contract ``hetctl launch`` sets (``tests/helpers/rankrunner.py``), one with ``parallel.schedule: 1f1b``
(Megatron's order: the peer) and one with ``zb-h1`` (stage ``s`` holding back ``s`` W passes). They
alternate ``--pairs`` times, which one goes first alternating too. The step time is the last stage's own
``step_ms`` (median of the steps after the first two).

The prediction is the planner's: each stage's compute per micro-batch, measured in the 1F1B runs (the
ranks' heartbeats, ``compute_ms``), split as the cost model splits it (forward a third, W the linear
layers' share of the forward again, B the rest: :mod:`hetctl.plan.zerobubble`), simulated under both
schedules. The bench prints the measured and predicted speed-up and the error.

Last line: ``zb_cpu: measured_speedup=<x> predicted_speedup=<y> error=<pct>``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hetctl.files.plan import ModelSpec  # noqa: E402
from hetctl.plan.models import model_cost  # noqa: E402
from hetctl.plan.simulate import simulate_1f1b  # noqa: E402
from hetctl.plan.zerobubble import simulate_zbh1  # noqa: E402
from tests.helpers.rankrunner import Ranks, tiny_plan  # noqa: E402


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=2, help="pipeline stages, one CPU each (default 2)")
    ap.add_argument("--layers", type=int, default=8, help="model layers (default 8)")
    ap.add_argument("--hidden", type=int, default=256, help="hidden size (default 256)")
    ap.add_argument("--seq-len", type=int, default=128, help="tokens per sample (default 128)")
    ap.add_argument("--micro-batch", type=int, default=2, help="sequences per micro-batch (default 2)")
    ap.add_argument("--micro-batches", type=int, default=8, help="micro-batches per step (default 8)")
    ap.add_argument("--steps", type=int, default=20, help="steps per run (default 20)")
    ap.add_argument("--pairs", type=int, default=3, help="1F1B / ZB-H1 pairs (default 3)")
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON object before the last line")
    o = ap.parse_args(argv)
    if o.pp < 2 or o.layers < o.pp or o.steps < 4 or o.pairs < 1:
        ap.error("need --pp >= 2, --layers >= --pp, --steps >= 4 and --pairs >= 1")
    return o


def spec(o: argparse.Namespace) -> dict:
    ffn = (8 * o.hidden // 3 + 63) // 64 * 64
    return {"name": "zb-bench", "num_layers": o.layers, "hidden_size": o.hidden, "ffn_hidden_size": ffn,
            "num_attention_heads": max(1, o.hidden // 64), "num_query_groups": max(1, o.hidden // 128),
            "vocab_size": 256, "seq_len": o.seq_len}


def plan_for(o: argparse.Namespace, schedule: str) -> dict:
    base, extra = divmod(o.layers, o.pp)
    split = [base + (1 if s < extra else 0) for s in range(o.pp)]
    plan = tiny_plan(split, micro_batch=o.micro_batch, micro_batches=o.micro_batches, model=spec(o))
    plan["parallel"]["schedule"] = schedule
    for st in plan["stages"]:
        st["defer"] = st["stage"] if schedule == "zb-h1" else 0
    return plan


def run(o: argparse.Namespace, schedule: str, work: Path) -> dict:
    """One run: the last stage's step times and each stage's compute per step (from its heartbeats)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    compute: dict[int, dict[int, float]] = {}
    with Ranks(plan_for(o, schedule), work, steps=o.steps, run_id=f"zb-{schedule}") as ranks:
        ranks.start()
        if cpus:
            for rank, proc in ranks.procs.items():
                os.sched_setaffinity(proc.pid, {cpus[rank % len(cpus)]})
        deadline = time.monotonic() + 900
        while any(p.poll() is None for p in ranks.procs.values()):
            for rank in ranks.procs:
                hb = ranks.heartbeat(rank) or {}
                if "compute_ms" in hb and isinstance(hb.get("step"), int):
                    compute.setdefault(rank, {})[hb["step"]] = float(hb["compute_ms"])
            if time.monotonic() > deadline:
                raise SystemExit(f"{schedule}: the ranks did not finish in 900 s\n{ranks.logs()}")
            time.sleep(0.02)
        codes = ranks.wait(60)
        if any(codes.values()):
            raise SystemExit(f"{schedule}: exit codes {codes}\n{ranks.logs()}")
        steps = {}
        for line in ranks.stdout(ranks.last_rank()).splitlines():
            if line.startswith("step="):
                f = dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
                steps[int(f["step"])] = float(f["step_ms"])
    steady = [ms for s, ms in sorted(steps.items()) if s > 2]
    return {"step_ms": statistics.median(steady),
            "compute_ms": [statistics.median(v for s, v in sorted(compute.get(r, {}).items()) if s > 2)
                           for r in range(o.pp)]}


def main(argv: list[str] | None = None) -> None:
    o = parse(argv)
    import tempfile

    ncpu = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"zb_cpu: pp {o.pp} on {ncpu} CPU(s) (stage s on CPU s mod {ncpu}), {o.layers} layers of hidden "
          f"{o.hidden}, seq {o.seq_len}, {o.micro_batches} micro-batches of {o.micro_batch}, {o.steps} steps, "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    runs: dict[str, list[dict]] = {"1f1b": [], "zb-h1": []}
    with tempfile.TemporaryDirectory(prefix="zb-cpu-") as tmp:
        for i in range(o.pairs):
            for schedule in (("1f1b", "zb-h1") if i % 2 == 0 else ("zb-h1", "1f1b")):
                r = run(o, schedule, Path(tmp) / f"{i}-{schedule}")
                runs[schedule].append(r)
                print(f"  pair {i + 1} {schedule:>5}: step {r['step_ms']:.1f} ms, compute by stage "
                      f"{', '.join(f'{c:.1f}' for c in r['compute_ms'])} ms", flush=True)
    plain = statistics.median(r["step_ms"] for r in runs["1f1b"])
    zb = statistics.median(r["step_ms"] for r in runs["zb-h1"])
    m = o.micro_batches
    per_mb = [statistics.median(r["compute_ms"][s] for r in runs["1f1b"]) / m / 1e3 for s in range(o.pp)]
    lam = model_cost(ModelSpec(**spec(o))).weight_share
    fwd = [x / 3 for x in per_mb]
    wgt = [lam * x / 3 for x in per_mb]
    bwd = [2 * x / 3 - w for x, w in zip(per_mb, wgt)]
    p_plain = simulate_1f1b(fwd, [2 * x / 3 for x in per_mb], m).makespan
    p_zb = simulate_zbh1(fwd, bwd, wgt, m, list(range(o.pp))).makespan
    measured, predicted = plain / zb, p_plain / p_zb
    err = 100 * (predicted / measured - 1)
    print(f"  1F1B {plain:.1f} ms/step, ZB-H1 {zb:.1f} ms/step (medians of {o.pairs}): measured speed-up "
          f"{measured:.3f}x; predicted from the 1F1B runs' compute (W {100 * lam / 2:.0f}% of the backward): "
          f"{predicted:.3f}x, {p_plain * 1e3:.1f} -> {p_zb * 1e3:.1f} ms of pipeline")
    if o.json:
        print(json.dumps({"runs": runs, "measured_speedup": measured, "predicted_speedup": predicted,
                          "error_pct": err}))
    print(f"zb_cpu: measured_speedup={measured:.3f} predicted_speedup={predicted:.3f} error={err:+.1f}%")


if __name__ == "__main__":
    main()
