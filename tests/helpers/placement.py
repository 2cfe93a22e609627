"""Clusters and plans for the placement checks (issue 37): the tests' own shapes and the bench's.

Every cluster shape the planner is judged on (``bench/clusters/*.yaml``, with
the bench's models and first batch) and the tests' own ones, with nodes that
share an address among them. The bench files use YAML anchors, which hetctl's
cluster loader refuses for user files, so they are read with PyYAML here, as
``bench/plan_quality.py`` does.
"""

from __future__ import annotations

import random
import shlex
import sys
from functools import cache
from pathlib import Path

import yaml

from hetctl.errors import PlanInfeasible
from hetctl.files.cluster import Cluster
from hetctl.files.plan import ModelSpec, Plan
from hetctl.plan.models import load_model
from hetctl.plan.planner import plan_cluster
from tests.test_plan_invariants import CHIPS, SMALL, four_to_one, issue15_cluster, memory_tight, node, random_cluster

ROOT = Path(__file__).resolve().parents[2]
FRAMEWORKS = ("megatron", "flagscale", "deepspeed", "torchrun")


def _bench() -> dict[str, tuple[Cluster, ModelSpec, int]]:
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from plan_quality import CASES
    finally:
        sys.path.remove(str(ROOT / "bench"))
    out = {}
    for case in CASES:
        text = (ROOT / "bench/clusters" / f"{case.name}.yaml").read_text()
        cluster = Cluster.model_validate(yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)))  # noqa: S506 (a safe loader)
        spec = case.model if isinstance(case.model, ModelSpec) else load_model(case.model)
        out[f"bench-{case.name}"] = (cluster, spec, case.batches[0])
    return out


def _kind(name: str, row: int, chips: int, host: str | None = None):
    vendor, model, memory, bf16, fp16 = CHIPS[row]
    n = node(name, vendor, model, chips, memory, bf16, fp16)
    return n.model_copy(update={"host": host}) if host else n


def _tests() -> dict[str, tuple[Cluster, ModelSpec, int]]:
    a100 = 1
    one_machine = [_kind(f"local-{i}", a100, 2, host="127.0.0.1") for i in range(3)]  # nodes sharing an address
    three = [_kind(f"h100-{i}", 0, 8) for i in range(2)] + [_kind("asc-0", 3, 8), _kind("mx-0", 4, 8)]
    out = {
        "a100-2x2": (Cluster(nodes=[_kind(f"gpu-{i}", a100, 2) for i in range(2)]), SMALL, 16),
        "a100-2x4": (Cluster(nodes=[_kind(f"gpu-{i}", a100, 4) for i in range(2)]), SMALL, 32),
        "a100-2x8": (Cluster(nodes=[_kind(f"gpu-{i}", a100, 8) for i in range(2)]), SMALL, 64),
        "h100-uneven": (Cluster(nodes=[_kind("h100-a", 0, 8), _kind("h100-b", 0, 6)]), SMALL, 64),
        "a100-ascend": (Cluster(nodes=[_kind("gpu-a", a100, 4), _kind("npu-b", 3, 2)]), SMALL, 16),
        "shared-address": (Cluster(nodes=one_machine), SMALL, 24),
        "three-vendors": (Cluster(nodes=three), load_model("llama3-8b"), 256),
        "four-to-one": (four_to_one(2, 2), SMALL, 64),
        "memory-tight": (memory_tight(), load_model("llama2-13b"), 256),
        "issue15": (issue15_cluster(4), load_model("llama3-8b"), 256),
    }
    for seed in range(4):
        out[f"random-{seed}"] = (random_cluster(random.Random(seed)), SMALL, 64)
    return out


@cache
@cache
def clusters() -> dict[str, tuple[Cluster, ModelSpec, int]]:
    """Name → (cluster, model, global batch): the tests' shapes, then the bench's (read once per process: the
    bench's 10,240-chip file is most of the collection time of the tests that take these)."""
    return {**_tests(), **_bench()}


def rendered_anyway(plan: Plan) -> Plan:
    """``plan`` as ``hetctl plan --render-anyway`` writes it: a Megatron or DeepSpeed plan across vendors is
    refused otherwise, yet the scripts written anyway must still place every rank as planned."""
    from hetctl.plan.render import unrunnable

    return plan.model_copy(update={"rendered_anyway": unrunnable(plan)})


@cache
def plan_for(name: str, framework: str) -> Plan | None:
    """The plan of cluster ``name`` for ``framework`` (rendered anyway where it spans vendors); None where no
    plan fits."""
    cluster, spec, batch = clusters()[name]
    try:
        return rendered_anyway(plan_cluster(cluster, spec, global_batch=batch, framework=framework))
    except PlanInfeasible:
        return None


def hosts_of(name: str) -> dict[str, str]:
    return {n.name: n.host for n in clusters()[name][0].nodes}


def script_ranks(text: str) -> list[dict[str, str]]:
    """Each rank's plan-decided environment in a rendered node script, read back as the shell reads it."""
    out = []
    for block in text.split("\nenv ")[1:]:
        words = shlex.split(block.split(" \\\n    \"$HETCTL_PYTHON\"")[0].replace("\\\n", " "))
        out.append(dict(w.split("=", 1) for w in words if "=" in w and not w.split("=", 1)[1].startswith("$")))
    return out
