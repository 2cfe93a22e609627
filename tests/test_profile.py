"""Layer profiles (``probe --bench --model``): the record, the planner's use of it, and a real probe.

The pure tests read profiles recorded with ``hetctl/node/layerprof.py`` on this
machine (``tests/fixtures/profiles/cpu-tiny.json`` says how); the e2e test runs
the profile on local nodes for real.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from hetctl.files.cluster import Chip, Cluster, Nic, NodeFacts, Software, Tflops
from hetctl.files.yamlio import load_model as load_file
from hetctl.plan.devices import ProfileUse, chip_rate
from hetctl.plan.models import load_model, model_cost
from hetctl.plan.planner import plan_cluster
from hetctl.probe.assemble import ProfileShape, apply_profile, profile_request

RECORDED = json.loads((Path(__file__).parent / "fixtures/profiles/cpu-tiny.json").read_text())
# The shape the recording was measured at: `tiny` as it was then (vocabulary 256; the preset now has 320, room for
# the bytes tokenizer's 257 ids). A profile's embedding and head part depends on the vocabulary, so it is its own key.
TINY = load_model("tiny").model_copy(update={"vocab_size": RECORDED["args"]["spec"]["vocab_size"]})


def cpu_node(name: str, run: str | None, matmul_fp32: float = 0.02) -> NodeFacts:
    """A CPU node as probe --bench writes it; ``run`` picks a recorded profile (or none)."""
    facts = NodeFacts(
        name=name, host=name, memory_gb=16.0, software=Software(python="3.11.7", torch="2.13.0+cpu"),
        chips=[Chip(index=0, vendor="cpu", model="AMD EPYC", memory_gb=16.0, measured_tflops=Tflops(fp32=matmul_fp32),
                    source="cpu")],
        nics=[Nic(name="eth0", kind="ethernet", speed_gbps=10.0)],
    )
    if run is None:
        return facts
    request = profile_request(facts, ProfileShape(spec=RECORDED["args"]["spec"], micro_batch=1))
    return apply_profile(facts, request, RECORDED["runs"][run])


def test_recorded_profile_is_kept_with_the_shape_it_was_measured_at():
    facts = cpu_node("a", "full")
    prof = facts.chips[0].profile
    assert prof is not None and facts.bench_error is None
    assert (prof.model, prof.micro_batch, prof.seq_len, prof.precision) == ("tiny", 1, TINY.seq_len, "fp32")
    assert prof.layer_fwd_ms == RECORDED["runs"]["full"]["profile"]["layer_fwd_ms"]
    assert prof.matches(TINY, 1, "fp32")
    assert not prof.matches(TINY, 2, "fp32")  # another micro-batch is another measurement
    assert not prof.matches(TINY.model_copy(update={"seq_len": 64}), 1, "fp32")
    assert not prof.matches(TINY, 1, "bf16")


def test_a_resumes_re_probe_keeps_the_profile_and_matmul_figures_of_unchanged_chips():
    """``hetctl resume`` re-probes without --bench/--model: a chip of the same node, index, vendor and model keeps
    what was measured (else a CPU node planned from a profile alone has no TFLOPS); a changed chip does not."""
    from hetctl.elastic.replan import keep_measured

    def bare(name: str, model: str = "AMD EPYC") -> NodeFacts:
        n = cpu_node(name, None)
        return n.model_copy(update={"chips": [n.chips[0].model_copy(update={"measured_tflops": None, "model": model})]})

    profiled_only = cpu_node("a", "full")
    profiled_only = profiled_only.model_copy(update={"chips": [profiled_only.chips[0].model_copy(
        update={"measured_tflops": None})]})
    before = Cluster(nodes=[profiled_only, cpu_node("b", "full"), cpu_node("c", "full")])
    fresh = Cluster(nodes=[bare("a"), bare("b"), bare("c", model="AMD EPYC 9654")])
    kept, carried = keep_measured(fresh, before)
    a, b, c = (n.chips[0] for n in kept.nodes)
    assert a.profile == profiled_only.chips[0].profile and a.measured_tflops is None
    assert b.profile == before.nodes[1].chips[0].profile and b.measured_tflops == before.nodes[1].chips[0].measured_tflops
    assert c.profile is None and c.measured_tflops is None  # another chip model: measured again, not carried
    assert carried == ["a", "b"]
    use = ProfileUse(TINY, 1, model_cost(TINY).layer_flops)
    assert chip_rate(kept.nodes[0], a, use)[2] == "layer profile"


def test_a_failed_profile_says_why_and_keeps_the_matmul_figure():
    facts = cpu_node("a", None)
    request = profile_request(facts, ProfileShape(spec=RECORDED["args"]["spec"]))
    out = apply_profile(facts, request, {"error": "torch.cuda is not available (torch 2.13.0+cpu)", "profile": None})
    assert out.bench_error == "layer profile: torch.cuda is not available (torch 2.13.0+cpu)"
    assert out.chips[0].measured_tflops == facts.chips[0].measured_tflops and out.chips[0].profile is None
    bad = apply_profile(facts, request, {"error": None, "profile": {"layer_fwd_ms": float("nan"), "layer_bwd_ms": 1}})
    assert bad.bench_error.startswith("layer profile: unusable figures")


def test_the_rate_comes_from_the_profile_only_at_its_shape():
    node = cpu_node("a", "full")
    use = ProfileUse(spec=TINY, micro_batch=1, layer_flops=model_cost(TINY).layer_flops)
    rate, prec, src = chip_rate(node, node.chips[0], use)
    prof = RECORDED["runs"]["full"]["profile"]
    expected = 3 * TINY.seq_len * model_cost(TINY).layer_flops / ((prof["layer_fwd_ms"] + prof["layer_bwd_ms"]) / 1e3)
    assert (src, prec) == ("layer profile", "fp32") and rate == pytest.approx(expected / 1e12)
    assert chip_rate(node, node.chips[0], ProfileUse(TINY, 2, use.layer_flops))[2] == "bench×eff"
    assert chip_rate(node, node.chips[0])[2] == "bench×eff"  # no plan shape given
    pinned = node.model_copy(update={"tflops_override": 5.0})
    assert chip_rate(pinned, pinned.chips[0], use)[2] == "inventory tflops"  # the user's figure still wins


def test_plan_splits_by_the_measured_layer_times_where_the_matmul_sees_no_difference():
    """Three nodes with the same matmul figure; one was profiled inside a 25% CPU quota."""
    nodes = [cpu_node("n1", "full"), cpu_node("n2", "full"), cpu_node("n3", "cgroup-25pct")]
    plain = plan_cluster(Cluster(nodes=[cpu_node(n.name, None) for n in nodes]), TINY, global_batch=4,
                         micro_batch=1, pins=_pp3())
    profiled = plan_cluster(Cluster(nodes=nodes), TINY, global_batch=4, micro_batch=1, pins=_pp3())  # as recorded
    layers = {s.node: s.layers[1] - s.layers[0] for s in profiled.stages}
    assert sorted(s.layers[1] - s.layers[0] for s in plain.stages) == [2, 3, 3]
    assert layers["n3"] < min(layers["n1"], layers["n2"]), layers
    assert "layer profile" in " ".join(profiled.notes)
    # Micro-batch 2 was never profiled: the matmul figure counts again.
    other = plan_cluster(Cluster(nodes=nodes), TINY, global_batch=4, micro_batch=2, pins=_pp3())
    assert "layer profile" not in " ".join(other.notes)


def _pp3():
    from hetctl.plan.candidates import Pins

    return Pins(pp=3, dp=1)


@pytest.mark.e2e
def test_probe_bench_model_profiles_each_node_and_plan_uses_it(tmp_path):
    pytest.importorskip("torch")
    from tests.helpers.sites import local_cli

    inv = {"defaults": {"transport": "local", "python": sys.executable, "env": {"OMP_NUM_THREADS": "1"}},
           "nodes": [{"name": f"node-{c}", "host": "localhost", "workdir": str(tmp_path / c)} for c in "ab"]}
    (tmp_path / "inventory.yaml").write_text(yaml.safe_dump(inv))
    r = local_cli(tmp_path, "probe", "-i", "inventory.yaml", "--bench", "--model", "tiny", "-o", "cluster.yaml")
    assert r.returncode == 0, r.stderr
    cluster = load_file(tmp_path / "cluster.yaml", Cluster)
    for n in cluster.nodes:
        prof = n.chips[0].profile
        assert prof is not None, n.bench_error
        assert prof.layer_fwd_ms > 0 and prof.layer_bwd_ms > 0 and prof.micro_batch == 4  # the preset's, as plan's
        assert prof.optimizer_ns_per_param and prof.optimizer_ns_per_param > 0
    assert "layer profile (tiny, micro-batch 4" in r.stdout
    r = local_cli(tmp_path, "plan", "-c", "cluster.yaml", "-m", "tiny", "-o", "plan", "--explain")
    assert r.returncode == 0, r.stderr
    assert "(layer profile)" in r.stdout
    # The profile alone, without the matmul benchmark and the links.
    r = local_cli(tmp_path, "probe", "-i", "inventory.yaml", "--model", "tiny", "-o", "profiled.yaml")
    assert r.returncode == 0, r.stderr
    alone = load_file(tmp_path / "profiled.yaml", Cluster)
    assert all(n.chips[0].profile is not None and n.chips[0].measured_tflops is None for n in alone.nodes)
    assert alone.links == []
    bad = local_cli(tmp_path, "probe", "-i", "inventory.yaml", "--model", "no-such-model")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "no-such-model" in bad.stderr


def with_links(nodes: list[NodeFacts], gbps: dict[tuple[str, str], float]) -> Cluster:
    """A cluster whose ``links:`` are a measured ring (as probe --bench writes them)."""
    from hetctl.files.cluster import Link

    links = [Link(src=a, dst=b, address=b, streams=4, seconds=1.0, measured_gbps=g, rtt_ms=0.05, declared_gbps=10.0)
             for (a, b), g in gbps.items()]
    return Cluster(nodes=nodes, links=links)


def test_gloo_hops_are_costed_at_the_measured_tcp_rate():
    """Two CPU nodes (gloo between them): a measured 0.05 Gb/s ring makes the pipeline's hop dear."""
    nodes = [cpu_node("n1", None), cpu_node("n2", None)]
    spec = load_model("tiny")
    pins = __import__("hetctl.plan.search", fromlist=["Pins"]).Pins(pp=2, dp=1)
    declared = plan_cluster(Cluster(nodes=nodes), spec, global_batch=4, pins=pins)
    fast = plan_cluster(with_links(nodes, {("n1", "n2"): 8.0, ("n2", "n1"): 8.0}), spec, global_batch=4, pins=pins)
    slow = plan_cluster(with_links(nodes, {("n1", "n2"): 0.05, ("n2", "n1"): 8.0}), spec, global_batch=4, pins=pins)
    # Activations of one micro-batch: tokens × hidden × 4 bytes; at 0.05 Gb/s each hop costs that over 6.25 MB/s.
    hop = TINY.seq_len * TINY.hidden_size * 4 / (0.05e9 / 8)
    assert slow.estimate.step_time_s - fast.estimate.step_time_s > hop, (slow.estimate, fast.estimate)
    assert declared.estimate.step_time_s != fast.estimate.step_time_s  # the measured figure replaced the declared one
    assert any("measured by probe --bench" in n and "n1 0.05 Gb/s" in n for n in slow.notes), slow.notes
    # An NCCL-class link (same accelerator vendor across nodes) keeps its NIC figure: a TCP stream is not its path.
    from hetctl.plan.costmodel import link_seconds

    assert link_seconds(1e6, "nvidia", "nvidia", False, 50.0, tcp_gbs=0.01) == link_seconds(1e6, "nvidia", "nvidia",
                                                                                           False, 50.0)
    assert link_seconds(1e6, "nvidia", "ascend", False, 50.0, tcp_gbs=0.01) > 1e6 / (0.01 * 1e9)


def test_a_calibrated_speed_scales_a_profiled_chip_too():
    """``plan --calibrate`` and ``--rebalance`` scale a node by its measured speed; for a chip planned from its layer
    profile (which wins over the matmul figure) the profile's times are what must change, or nothing does."""
    from hetctl.elastic.replan import with_speeds

    cl = Cluster(nodes=[cpu_node("a", "full"), cpu_node("b", "full")])
    use = ProfileUse(TINY, 1, model_cost(TINY).layer_flops)
    before = chip_rate(cl.nodes[0], cl.nodes[0].chips[0], use)
    slow = with_speeds(cl, {"a": 0.5})
    a = slow.nodes[0]
    after = chip_rate(a, a.chips[0], use)
    assert before[2] == after[2] == "layer profile"
    assert after[0] == pytest.approx(before[0] * 0.5, rel=1e-4)
    assert a.chips[0].profile.layer_fwd_ms == pytest.approx(2 * cl.nodes[0].chips[0].profile.layer_fwd_ms, rel=1e-4)
    assert a.chips[0].profile.peak_memory_gb == cl.nodes[0].chips[0].profile.peak_memory_gb
    from hetctl.plan.candidates import Pins

    plan = plan_cluster(slow, TINY, global_batch=4, pins=Pins(pp=2, dp=1))
    layers = {s.node: s.layers[1] - s.layers[0] for s in plan.stages}
    assert layers["a"] < layers["b"], layers
