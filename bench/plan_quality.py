"""Benchmark: the planner's predicted throughput against the simple splits, the ideal and the clock.

For each cluster in ``bench/clusters/`` it plans a model and prints the
simulated tokens/s of hetctl's plan, of the same stages split uniformly (equal
layers per stage, Megatron-LM's default) and proportionally to compute (the
seed rule), and the ideal (total work ÷ total compute), with the ratios
between them, the utilization against the sum of what each chip type reaches
alone, and the planning time (wall and CPU seconds of ``plan_cluster``; the
cluster file's YAML load is timed separately).

Cases (issue 3):

- ``four-to-one`` — two chip types at a 4:1 compute ratio.
- ``mix-768`` — 128 accelerators of one vendor and 640 of another with a
  ~140B model, the shape of the published 768-accelerator mixed run.
- ``six-vendors-4096`` — 4096 accelerators of six vendors, Llama-2-70B.
- ``memory-tight`` — the fast chips have little memory.

Each case and batch is planned three times: for the case's framework (FlagScale,
whose rendered job gives every replica one shape), for ``torchrun`` (a user's own
script, which can run replicas of different shape and micro-batch count, so the
planner may choose hetero data parallelism there, costing a flat gradient
all-reduce; :mod:`hetctl.plan.frameworks`) and for ``hetctl`` (the reference
trainer: hetero data parallelism with the hierarchical, per-stage all-reduce of
:mod:`hetctl.train.dpreduce`, no tensor parallelism yet, so "no plan fits" where
the model needs it).
Each row also shows the pipeline bubble (under plain or interleaved 1F1B, with
the virtual stages per rank ``v`` where the framework interleaves: Megatron-LM,
the reference trainer and ``torchrun`` can, FlagScale's hetero mode cannot;
or under ZB-H1, which only the reference trainer runs; :mod:`hetctl.plan.frameworks`) and the share of the step spent in the
cross-vendor gradient all-reduce; the run ends with one
``plan_quality: case=… batch=… vs_homogeneous=… plan_s=… framework=… bubble=… cross_allreduce=…
virtual_stages=… vs_share=… mfu=… schedule=…`` line per case, batch and framework, for scripts. ``vs_homogeneous``
is E_Σ (each chip type alone at the whole global batch), ``vs_share`` is E_share (each type alone at its
speed-proportional share of the batch, the fair reference), ``mfu`` the model FLOPs utilization against
the chips' peaks (docs/efficiency.md).

Goals: never worse than either baseline; E_share ≥ 97.6 % on every case and batch; 4096 chips planned in under 1 s on a 2-core machine.

Run from the repo root::

    python bench/plan_quality.py                 # all cases
    python bench/plan_quality.py --case mix-768 --global-batch 4096
    python bench/plan_quality.py --write-clusters   # regenerate bench/clusters/*.yaml
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hetctl.files.yamlio import load_model as load_file  # noqa: E402
from hetctl.plan.models import load_model  # noqa: E402
from hetctl.plan.planner import plan_cluster  # noqa: E402
from hetctl.files.plan import ModelSpec  # noqa: E402
from hetctl.files.cluster import Cluster  # noqa: E402
from hetctl.errors import PlanInfeasible  # noqa: E402

CLUSTERS = Path(__file__).resolve().parent / "clusters"

# ~138B parameters: 88 layers of a GQA/SwiGLU decoder, hidden 12288.
HETERO_140B = ModelSpec(
    name="dense-140b", num_layers=88, hidden_size=12288, ffn_hidden_size=32768, num_attention_heads=96,
    num_query_groups=8, vocab_size=100352, seq_len=4096, swiglu=True,
    source="bench/plan_quality.py: a ~140B dense model for the 768-accelerator case",
)


@dataclass(frozen=True)
class Case:
    name: str
    model: str | ModelSpec
    batches: tuple[int, ...]
    framework: str = "flagscale"
    about: str = ""


CASES = (
    Case("four-to-one", "llama2-13b", (512, 2048), about="4 × 8 H100 (989.4 TF) and 4 × 8 Ascend 910B2C derated to 247.35 TF"),
    Case("mix-768", HETERO_140B, (1024, 2048),
         about="16 × 8 NVIDIA H800 and 80 × 8 Ascend 910B3, 8 × 200 Gb/s rails per node"),
    Case("six-vendors-4096", "llama2-70b", (1024, 8192),
         about="H100 1024, Ascend 910B2 1024, MetaX C500 512, MTT S4000 512, Hygon K100-AI 512, MLU590 512"),
    Case("six-vendors-10240", "llama2-70b", (2048,),
         about="the six-vendor mix at 10,240 chips (2.5x each type): the plan-time case (goal <= 2 s)"),
    Case("memory-tight", "llama2-70b", (256,),
         about="4 × 8 RTX 4090 (165 TF, 24 GB) and 4 × 8 Hygon K100 (100 TF fp16, 64 GB)"),
)


def _node(name: str, host: str, chips_anchor: str, switch: str, nics: str, override: float | None = None) -> str:
    extra = f", tflops_override: {override}" if override else ""
    return (f"  - {{name: {name}, host: {host}, labels: {{switch: {switch}}}, memory_gb: 1024, "
            f"chips: *{chips_anchor}, nics: *{nics}{extra}}}\n")


def _chips(vendor: str, model: str, memory: float, bf16: float | None, fp16: float | None, n: int = 8) -> str:
    tf = {k: v for k, v in (("bf16", bf16), ("fp16", fp16)) if v is not None}
    rows = [yaml.safe_dump({"index": i, "vendor": vendor, "model": model, "memory_gb": memory, "tflops": tf},
                           default_flow_style=True, width=1000).strip() for i in range(n)]
    return "[" + ", ".join(rows) + "]"


def _write(path: Path, title: str, groups: list[tuple]) -> None:
    """groups: (prefix, count, vendor, model, memory, bf16, fp16, nic_gbps, override)."""
    text = f"# {title}\n# Written by bench/plan_quality.py --write-clusters; chip figures from shared/reference/chips.md.\n"
    text += "version: 1\nnodes:\n"
    defined: set[str] = set()
    for g, (prefix, count, vendor, model, memory, bf16, fp16, nic, override) in enumerate(groups):
        anchor, nics = f"chips{g}", f"nics{g}"
        for i in range(count):
            name = f"{prefix}-{i:03d}"
            host = f"10.{g}.{i // 250}.{i % 250 + 1}"
            switch = f"{prefix}-leaf{i // 32}"
            if anchor not in defined:
                defined.add(anchor)
                text += (f"  - {{name: {name}, host: {host}, labels: {{switch: {switch}}}, memory_gb: 1024,"
                         f"{' tflops_override: ' + str(override) + ',' if override else ''}\n"
                         f"     chips: &{anchor} {_chips(vendor, model, memory, bf16, fp16)},\n"
                         f"     nics: &{nics} [{', '.join(f'{{name: ib{j}, kind: ib, speed_gbps: {nic}}}' for j in range(8))}]}}\n")
            else:
                text += _node(name, host, anchor, switch, nics, override)
    path.write_text(text)


def write_clusters() -> None:
    CLUSTERS.mkdir(exist_ok=True)
    _write(CLUSTERS / "four-to-one.yaml", "Two chip types at a 4:1 compute ratio (the Ascend nodes' tflops override "
           "derates them to exactly a quarter of an H100).", [
               ("h100", 4, "nvidia", "NVIDIA H100 80GB HBM3", 79.6, 989.4, 989.4, 200, None),
               ("npu", 4, "ascend", "910B2C", 64.0, 376.0, 376.0, 200, 247.35),
           ])
    _write(CLUSTERS / "mix-768.yaml", "768 accelerators of two vendors: 128 NVIDIA H800 and 640 Ascend 910B3.", [
        ("h800", 16, "nvidia", "NVIDIA H800", 79.6, 989.4, 989.4, 200, None),
        ("npu", 80, "ascend", "Ascend 910B3", 64.0, 313.0, 313.0, 200, None),
    ])
    _write(CLUSTERS / "six-vendors-4096.yaml", "4096 accelerators of six vendors.", [
        ("h100", 128, "nvidia", "NVIDIA H100 80GB HBM3", 79.6, 989.4, 989.4, 200, None),
        ("npu", 128, "ascend", "910B2", 64.0, 376.0, 376.0, 200, None),
        ("mx", 64, "metax", "MetaX C500", 64.0, 280.0, 280.0, 200, None),
        ("mt", 64, "mthreads", "MTT S4000", 48.0, 100.0, 100.0, 200, None),
        ("dcu", 64, "hygon", "K100_AI", 63.98, 196.0, 196.0, 200, None),
        ("mlu", 64, "cambricon", "MLU590", 80.0, 314.0, 314.0, 200, None),
    ])
    _write(CLUSTERS / "six-vendors-10240.yaml", "10240 accelerators of six vendors (the 4096 mix, 2.5x).", [
        ("h100", 320, "nvidia", "NVIDIA H100 80GB HBM3", 79.6, 989.4, 989.4, 200, None),
        ("npu", 320, "ascend", "910B2", 64.0, 376.0, 376.0, 200, None),
        ("mx", 160, "metax", "MetaX C500", 64.0, 280.0, 280.0, 200, None),
        ("mt", 160, "mthreads", "MTT S4000", 48.0, 100.0, 100.0, 200, None),
        ("dcu", 160, "hygon", "K100_AI", 63.98, 196.0, 196.0, 200, None),
        ("mlu", 160, "cambricon", "MLU590", 80.0, 314.0, 314.0, 200, None),
    ])
    _write(CLUSTERS / "memory-tight.yaml", "Fast chips with little memory (RTX 4090, 24 GB) beside slower ones "
           "with more (Hygon K100, 64 GB, no bf16).", [
               ("rtx", 4, "nvidia", "NVIDIA GeForce RTX 4090", 24.0, 165.2, 165.2, 100, None),
               ("dcu", 4, "hygon", "K100", 64.0, None, 100.0, 100, None),
           ])


# The framework whose rendered job can run replicas of different shape (hetero data
# parallelism, hetctl.plan.frameworks); the cases' own framework cannot.
HETERO_FRAMEWORK = "torchrun"
# The reference trainer: replicas of different shape with the hierarchical, per-stage gradient all-reduce
# (hetctl.train.dpreduce), but no tensor parallelism yet (frameworks.py: tp="none").
TRAINER = "hetctl"
SUMMARY: list[str] = []


def _shape(plan) -> str:
    par = plan.parallel
    tps = "/".join(map(str, sorted({s.tp for s in plan.stages})))
    if plan.replicas:
        depths = sorted({r.stages for r in plan.replicas})
        return f"{len({r.part for r in plan.replicas})} parts pp{depths[0]}-{depths[-1]} dp{par.dp} tp{tps}"
    vs = f" v{par.virtual_stages}" if par.virtual_stages > 1 else ""
    return f"pp{par.pp}×dp{par.dp} tp{tps} m{par.micro_batches}{vs}"


def run_case(case: Case, batch: int | None) -> None:
    path = CLUSTERS / f"{case.name}.yaml"
    t0 = time.perf_counter()
    # The bench's own files use YAML anchors to stay small; hetctl's loader bounds their expansion.
    cluster = load_file(path, Cluster, "cluster file")
    load_s = time.perf_counter() - t0
    spec = case.model if isinstance(case.model, ModelSpec) else load_model(case.model)
    chips = sum(len(n.chips) for n in cluster.nodes if n.reachable)
    batches = (batch,) if batch else case.batches
    print(f"\n== {case.name}: {chips} chips, {spec.name}, framework {case.framework}\n   {case.about}")
    print(f"   cluster file loaded in {load_s:.2f} s (YAML parsing, not planning)")
    print(f"   {'batch':>6} {'framework':<9} {'layout':<28} {'hetctl tok/s':>13} {'uniform':>11} {'proport.':>11} {'ideal':>11} "
          f"{'/unif':>6} {'/prop':>6} {'/ideal':>7} {'E_Σ':>7} {'E_share':>8} {'MFU':>6} {'plan s':>7} {'cpu s':>6}")
    for gb, framework in ((gb, fw) for gb in batches for fw in (case.framework, HETERO_FRAMEWORK, TRAINER)):
        w0, c0 = time.perf_counter(), time.process_time()
        try:
            plan = plan_cluster(cluster, spec, global_batch=gb, framework=framework, cluster_path=path)
        except PlanInfeasible as e:
            print(f"   {gb:>6} {framework:<9} no plan fits: {str(e).splitlines()[0][:150]}")
            SUMMARY.append(f"plan_quality: case={case.name} batch={gb} vs_homogeneous=- plan_s=- framework={framework} "
                           "bubble=- cross_allreduce=- virtual_stages=- vs_share=- mfu=- schedule=-")
            continue
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        est = plan.estimate
        shape = _shape(plan)

        def base(name: str) -> tuple[str, str]:
            b = plan.baselines[name]
            if b.estimate is None:
                return "infeasible", "-"
            return f"{b.estimate.tokens_per_s:,.0f}", f"{est.tokens_per_s / b.estimate.tokens_per_s:.2f}"

        (u, ur), (p, pr) = base("uniform"), base("proportional")
        vs_h = f"{100 * est.utilization_vs_homogeneous:.1f}%" if est.utilization_vs_homogeneous else "-"
        vs_s = f"{100 * est.utilization_vs_share:.1f}%" if est.utilization_vs_share else "-"
        mfu = f"{100 * est.mfu:.1f}%" if est.mfu else "-"
        print(f"   {gb:>6} {framework:<9} {shape:<28} {est.tokens_per_s:>13,.0f} {u:>11} {p:>11} {plan.ideal_tokens_per_s:>11,.0f} "
              f"{ur:>6} {pr:>6} {est.tokens_per_s / plan.ideal_tokens_per_s:>7.3f} {vs_h:>7} {vs_s:>8} {mfu:>6} "
              f"{wall:>7.3f} {cpu:>6.3f}")
        cross = est.cross_vendor_sync_s / est.step_time_s
        v = plan.parallel.virtual_stages
        schedule = (f"interleaved 1F1B, v {v}" if v > 1 else
                    "ZB-H1" if plan.parallel.schedule == "zb-h1" else "1F1B")
        print(f"          {framework}: bubble {100 * est.bubble:.1f}% ({schedule}), cross-vendor all-reduce "
              f"{100 * cross:.1f}% of the step" + (" (replicas of different shape)" if plan.replicas else ""))
        for note in plan.notes:
            if note.startswith("replicas of different shape") or (schedule != "1F1B" and note.startswith("schedule:")):
                print(f"          {framework}: {note}")
        if framework == case.framework:
            for name, b in plan.baselines.items():
                if b.infeasible:
                    print(f"          {name}: infeasible — {b.infeasible}")
        SUMMARY.append(f"plan_quality: case={case.name} batch={gb} vs_homogeneous={vs_h.rstrip('%')} "
                       f"plan_s={wall:.3f} framework={framework} bubble={100 * est.bubble:.1f} "
                       f"cross_allreduce={100 * cross:.1f} virtual_stages={plan.parallel.virtual_stages} "
                       f"vs_share={vs_s.rstrip('%')} mfu={mfu.rstrip('%')} schedule={plan.parallel.schedule}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", choices=[c.name for c in CASES], action="append")
    ap.add_argument("--global-batch", type=int)
    ap.add_argument("--write-clusters", action="store_true", help="regenerate bench/clusters/*.yaml and exit")
    args = ap.parse_args()
    if args.write_clusters:
        write_clusters()
        return
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
    for case in CASES:
        if not args.case or case.name in args.case:
            run_case(case, args.global_batch)
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")
    print("\n".join(SUMMARY))


if __name__ == "__main__":
    main()
