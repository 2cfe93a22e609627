"""The memory model checked against a layer profile's peak (``hetctl/plan/profmem.py``).

The pure tests plan on ``tests/fixtures/profiles/cuda-mid.yaml`` (two A100s, 40
and 80 GB, profiled at the shape of ``mid.yaml``; the file says where its peak
comes from) with the peak as recorded, at the analytic figure, within the
tolerance, and at twice it; and on the recorded CPU profile (no peak). The e2e
tests count what layerprof really allocates (``tests/helpers/memcount.py``) and check
both the fixture's figure and the analytic figure against it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hetctl.errors import PlanInfeasible
from hetctl.files.cluster import Cluster
from hetctl.files.yamlio import load_model as load_file, save_model
from hetctl.plan.workload import Workload, memory_terms
from hetctl.plan.models import load_model, model_cost
from hetctl.plan.planner import plan_cluster
from hetctl.plan.profmem import TOLERANCE, check, profile_peak
from hetctl.plan.candidates import Pins

FIX = Path(__file__).parent / "fixtures" / "profiles"
MID = load_model(str(FIX / "mid.yaml"))
RECORDED = load_file(FIX / "cuda-mid.yaml", Cluster)
PINS = Pins(pp=2, dp=1)
ANALYTIC_GB = check(RECORDED.nodes[0].chips[0].profile, MID).analytic_gb


def with_peaks(peaks: dict[str, float | None]) -> Cluster:
    """The fixture cluster with the named nodes' profile peaks replaced."""
    nodes = []
    for n in RECORDED.nodes:
        if n.name in peaks:
            chip = n.chips[0]
            prof = chip.profile.model_copy(update={"peak_memory_gb": peaks[n.name]})
            n = n.model_copy(update={"chips": [chip.model_copy(update={"profile": prof})]})
        nodes.append(n)
    return Cluster(nodes=nodes)


def layers(plan) -> dict[str, int]:
    """Layers per node (all chunks under interleaving)."""
    return {s.node: sum(b - a for a, b in (s.chunks or [s.layers])) for s in plan.stages}


def shape(plan) -> list:
    return [(s.node, s.layers, s.chunks, s.memory_gb) for s in plan.stages] + [plan.estimate.step_time_s]


def memory_line(plan, label: str) -> str:
    lines = [n for n in plan.notes if n.startswith(f"nvidia {label} memory:")]
    assert len(lines) == 1, plan.notes
    return lines[0]


def test_the_profile_figure_is_the_planner_memory_terms_for_what_layerprof_holds():
    """At fp32 the optimizer step holds exactly the model's per-layer state, the edges' weights and gradients
    (half their 16 B/param state) and six hidden-state tensors; the edges step adds the model's fp32 logits."""
    tiny = load_model("tiny")
    t = memory_terms(Workload(cost=model_cost(tiny), micro_batch=3, global_batch=3), "fp32")
    phases = profile_peak(tiny, 3, "fp32")
    assert phases["optimizer step"] == pytest.approx(t.mem_layer + (t.mem_first + t.mem_last - t.logits) / 2
                                                     + 6 * t.act_first)
    assert phases["embedding and head"] == pytest.approx(t.mem_layer / 2 + (t.mem_first + t.mem_last - t.logits) / 2
                                                         + 7 * t.act_first + t.logits)
    # Two graphs are alive in the forward timing (the previous output still holds one).
    assert phases["forward"] == pytest.approx(t.mem_layer / 4 + 2 * t.act_layer + 4 * t.act_first)
    # 16-bit: layerprof's AdamW keeps gradients and moments in the parameters' dtype (2 B each).
    half = profile_peak(tiny, 3, "bf16")
    assert half["optimizer step"] == pytest.approx(phases["optimizer step"] / 2)


def test_a_peak_at_or_near_the_analytic_figure_leaves_the_plan_unchanged():
    base = plan_cluster(with_peaks({"a100-40": None, "a100-80": None}), MID, global_batch=8, pins=PINS)
    for peak in (ANALYTIC_GB, 0.5 * ANALYTIC_GB, 0.99 * TOLERANCE * ANALYTIC_GB):
        plan = plan_cluster(with_peaks({"a100-40": peak, "a100-80": peak}), MID, global_batch=8, pins=PINS)
        assert shape(plan) == shape(base), peak
        assert memory_line(plan, "NVIDIA A100-SXM4-40GB").endswith(": used analytic")
    assert "memory: no device peak reported; analytic" in memory_line(base, "NVIDIA A100-SXM4-40GB")


def test_a_peak_twice_the_analytic_figure_takes_layers_off_the_kind_that_was_near_its_limit():
    analytic = plan_cluster(with_peaks({"a100-40": ANALYTIC_GB, "a100-80": ANALYTIC_GB}), MID, global_batch=8,
                            pins=PINS)
    tight = next(s for s in analytic.stages if s.node == "a100-40")
    assert tight.memory_gb > 0.9 * tight.memory_limit_gb  # the premise: it fit, near the limit
    plan = plan_cluster(with_peaks({"a100-40": 2 * ANALYTIC_GB, "a100-80": ANALYTIC_GB}), MID, global_batch=8,
                        pins=PINS)
    assert layers(plan)["a100-40"] < layers(analytic)["a100-40"], (layers(plan), layers(analytic))
    assert sum(layers(plan).values()) == MID.num_layers
    assert all(s.memory_gb <= s.memory_limit_gb for s in plan.stages)
    line = memory_line(plan, "NVIDIA A100-SXM4-40GB")
    assert (f"analytic {ANALYTIC_GB:.3g} GB, profile peak {2 * ANALYTIC_GB:.3g} GB at the profile's shape (ratio 2): "
            "scaled by 2") in line, line
    assert memory_line(plan, "NVIDIA A100-SXM4-80GB").endswith("(ratio 1): used analytic")


def test_the_recorded_peak_scales_both_kinds_and_an_infeasible_plan_says_so():
    """The fixture's counted peak is 1.73x the analytic figure (the loss's copies of the logits)."""
    ratio = RECORDED.nodes[0].chips[0].profile.peak_memory_gb / ANALYTIC_GB
    assert ratio > TOLERANCE
    shorter = MID.model_copy(update={"num_layers": 200})
    plain = plan_cluster(with_peaks({"a100-40": None, "a100-80": None}), shorter, global_batch=8, pins=PINS)
    plan = plan_cluster(RECORDED, shorter, global_batch=8, pins=PINS)
    assert f"(ratio {ratio:.3g}): scaled by {ratio:.3g}" in memory_line(plan, "NVIDIA A100-SXM4-80GB")
    assert layers(plan)["a100-40"] < layers(plain)["a100-40"]
    with pytest.raises(PlanInfeasible, match=f"memory model scaled by {ratio:.3g}"):
        plan_cluster(RECORDED, MID, global_batch=8, pins=PINS)


def test_the_inventory_tflops_does_not_turn_the_check_off():
    """The user's TFLOPS figure wins over the profile's rate; the profile's peak still checks the memory."""
    cluster = with_peaks({"a100-40": 2 * ANALYTIC_GB, "a100-80": ANALYTIC_GB})
    pinned = Cluster(nodes=[n.model_copy(update={"tflops_override": 150.0}) for n in cluster.nodes])
    plan = plan_cluster(pinned, MID, global_batch=8, pins=PINS)
    assert "(ratio 2): scaled by 2" in memory_line(plan, "NVIDIA A100-SXM4-40GB")
    assert "(inventory tflops)" in " ".join(plan.notes)


def test_a_profile_at_another_shape_checks_nothing():
    """Micro-batch 2 was never profiled: neither its rate nor its peak counts."""
    plain = plan_cluster(with_peaks({"a100-40": None, "a100-80": None}), MID, global_batch=8, micro_batch=2, pins=PINS)
    plan = plan_cluster(with_peaks({"a100-40": 2 * ANALYTIC_GB}), MID, global_batch=8, micro_batch=2, pins=PINS)
    assert shape(plan) == shape(plain)
    assert not any("memory: analytic" in n or "memory: no device peak" in n for n in plan.notes), plan.notes


def test_a_cpu_profile_reports_no_peak():
    from tests.test_profile import TINY, _pp3, cpu_node

    plan = plan_cluster(Cluster(nodes=[cpu_node(n, "full") for n in ("n1", "n2", "n3")]), TINY, global_batch=4,
                        micro_batch=1, pins=_pp3())  # the recorded profile's micro-batch
    assert "cpu AMD EPYC memory: no device peak reported; analytic" in plan.notes


def test_plan_explain_prints_both_figures(tmp_path):
    save_model(tmp_path / "cluster.yaml", with_peaks({"a100-40": 2 * ANALYTIC_GB, "a100-80": ANALYTIC_GB}))
    r = subprocess.run([sys.executable, "-m", "hetctl", "plan", "-c", str(tmp_path / "cluster.yaml"), "-m",
                        str(FIX / "mid.yaml"), "--pp", "2", "--dp", "1", "--global-batch", "8", "--explain", "-o",
                        str(tmp_path / "plan")], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "COLUMNS": "300"})
    assert r.returncode == 0, r.stderr
    out = " ".join(r.stdout.split())
    assert f"A100-SXM4-40GB memory: analytic {ANALYTIC_GB:.3g} GB, profile peak {2 * ANALYTIC_GB:.3g} GB" in out, out
    assert "(ratio 2): scaled by 2" in out and "A100-SXM4-80GB memory: analytic" in out
    assert "(ratio 1): used analytic" in out


@pytest.mark.e2e
def test_the_fixture_peak_is_what_layerprof_allocates():
    """Recount the fixture's peak (layerprof's own units on the CPU, counted as tests/helpers/memcount.py says)."""
    pytest.importorskip("torch")
    from tests.helpers.memcount import layerprof_peak

    spec = {k: v for k, v in MID.model_dump().items() if k != "source"}
    counted = layerprof_peak(spec, 1, "bf16")
    assert counted / 1e9 == pytest.approx(RECORDED.nodes[0].chips[0].profile.peak_memory_gb, rel=0.01)


@pytest.mark.e2e
@pytest.mark.parametrize("micro_batch, precision", [(1, "fp32"), (8, "fp32"), (1, "bf16")])
def test_where_the_edges_do_not_dominate_the_analytic_figure_is_within_the_tolerance(micro_batch, precision):
    """The tiny model (vocabulary 256): optimizer- (micro-batch 1) or forward-bound (8, two graphs alive)."""
    pytest.importorskip("torch")
    from tests.helpers.memcount import layerprof_peak

    tiny = load_model("tiny")
    counted = layerprof_peak(json.loads(tiny.model_dump_json()), micro_batch, precision)
    analytic = max(profile_peak(tiny, micro_batch, precision).values())
    assert 1.0 <= counted / analytic <= TOLERANCE, counted / analytic
