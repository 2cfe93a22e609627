"""Benchmark: how long a checkpoint save holds training, asynchronous against blocking saves.

The same job twice per model and repetition, alternating the order: the
reference trainer (``python -m hetctl.train``) as a two-stage pipeline of real
rank processes over gloo on this host (``tests/helpers/rankrunner.py``, the rank
contract as ``hetctl launch`` sets it), checkpointing every ``--every`` steps,
once with ``--save-mode blocking`` (training waits while the stage serializes,
hashes, writes and fsyncs its files and rank 0 writes the manifest) and once with
``--save-mode async`` (training waits only for the copy to host memory; a
background thread does the rest). Each rank measures, around its call to the
save, how long its training loop was held, and reports the mean in its final
heartbeat; a pipeline is held as long as its slowest stage, so the figure per
job is the largest rank mean. Also printed: the background write time, how
many saves had to wait for the previous one, the mean step time, and the job's
wall time (on a small machine the background write competes with training for
the same cores, which the stall alone does not show).

Models: ``tiny`` (6 layers, hidden 64: about 0.6 MB a save) and a larger CPU
model (8 layers, hidden 384, vocab 4096: about 190 MB a save).

From the repo root::

    python bench/ckpt_stall.py --reps 2

The last line, for scripts:
``ckpt_stall: tiny_ratio=<r> large_ratio=<r> async_stall_ratio=<the larger of the two>``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.helpers.rankrunner import TINY, Ranks, tiny_plan  # noqa: E402

LARGE = {"name": "cpu-large", "num_layers": 8, "hidden_size": 384, "ffn_hidden_size": 1024,
         "num_attention_heads": 6, "num_query_groups": 3, "vocab_size": 4096, "seq_len": 64}
MODELS = {"tiny": (TINY, [3, 3]), "large": (LARGE, [4, 4])}


def run_job(workdir: Path, model: dict, split: list[int], mode: str, steps: int, every: int) -> dict:
    """One job; the save figures of its ranks' final heartbeats."""
    plan = tiny_plan(split, model=model, micro_batch=2, micro_batches=4)
    t0 = time.perf_counter()
    with Ranks(plan, workdir, steps=steps, ckpt_every=every, run_id=f"stall-{mode}",
               args=("--save-mode", mode)) as ranks:
        ranks.start()
        codes = ranks.wait(1800)
        if any(codes.values()):
            raise SystemExit(f"{mode} job failed: exit codes {codes}\n{ranks.logs()}")
        beats = [ranks.heartbeat(r["rank"]) for r in plan["ranks"]]
    wall = time.perf_counter() - t0
    assert all(b["save_mode"] == mode and b["saves"] == steps // every for b in beats), beats
    size = sum(p.stat().st_size for p in (ranks.ckpt_dir / f"step-{every}").iterdir())
    return {"stall": max(b["save_stall_ms"] for b in beats), "stall_max": max(b["save_stall_max_ms"] for b in beats),
            "write": max(b["save_write_ms"] for b in beats), "waits": max(b["save_waits"] for b in beats),
            "step_ms": max(b["step_ms"] for b in beats), "wall": wall, "mb": size / 1e6,
            "loss": next(f"{b['loss']:.9g}" for b in beats if "loss" in b)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=2, help="repetitions of each mode per model, alternating order")
    ap.add_argument("--tiny-steps", type=int, default=40, help="steps of a tiny job")
    ap.add_argument("--tiny-every", type=int, default=5, help="checkpoint interval of a tiny job")
    ap.add_argument("--large-steps", type=int, default=12, help="steps of a large job")
    ap.add_argument("--large-every", type=int, default=3, help="checkpoint interval of a large job")
    ap.add_argument("--models", default="tiny,large", help="comma-separated: tiny, large")
    o = ap.parse_args()
    print(f"checkpoint stall per save, async vs blocking; pp 2 on one host ({os.cpu_count()} CPUs), "
          f"{o.reps} reps; load average {os.getloadavg()[0]:.2f}", flush=True)
    ratios: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="hetctl-bench-ckpt-") as tmp_s:
        tmp = Path(tmp_s)
        for name in o.models.split(","):
            model, split = MODELS[name]
            steps, every = (o.tiny_steps, o.tiny_every) if name == "tiny" else (o.large_steps, o.large_every)
            res: dict[str, list[dict]] = {"blocking": [], "async": []}
            for rep in range(o.reps):
                for mode in (("blocking", "async") if rep % 2 == 0 else ("async", "blocking")):
                    r = run_job(tmp / f"{name}-{mode}-{rep}", model, split, mode, steps, every)
                    res[mode].append(r)
                    print(f"  {name} rep {rep + 1} {mode:8s}: held {r['stall']:8.1f} ms a save (max {r['stall_max']:.1f}), "
                          f"write {r['write']:7.1f} ms, waits {r['waits']}, step {r['step_ms']:7.1f} ms, "
                          f"job {r['wall']:.1f} s, {r['mb']:.1f} MB a save, final loss {r['loss']}", flush=True)
            med = {m: statistics.median(x["stall"] for x in rs) for m, rs in res.items()}
            losses = {x["loss"] for rs in res.values() for x in rs}
            ratios[name] = med["async"] / med["blocking"]
            print(f"{name}: training held per save (median of reps): async {med['async']:.1f} ms, blocking "
                  f"{med['blocking']:.1f} ms; ratio async/blocking {ratios[name]:.3f} (goal <= 0.10); job "
                  f"{statistics.median(x['wall'] for x in res['async']):.1f} s async, "
                  f"{statistics.median(x['wall'] for x in res['blocking']):.1f} s blocking; final losses "
                  f"{'identical' if len(losses) == 1 else 'differ: ' + str(sorted(losses))}", flush=True)
    print(f"load average after {os.getloadavg()[0]:.2f}")
    fields = " ".join(f"{n}_ratio={r:.3f}" for n, r in ratios.items())
    print(f"ckpt_stall: {fields} async_stall_ratio={max(ratios.values()):.3f}")


if __name__ == "__main__":
    main()
