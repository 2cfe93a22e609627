"""Planner invariants on many generated mixed-vendor clusters, and the named cases of issue 3.

Every plan must cover every layer exactly once per replica with contiguous
stages, give every chip at most one rank and every rank a number, keep each
stage within its chips' memory, be identical when planned twice, and never be
slower than the uniform or proportional split of the same stages.
"""

from __future__ import annotations

import random

import pytest

from hetctl.errors import ConfigError, PlanInfeasible
from hetctl.plan.models import load_model
from hetctl.plan.planner import plan_cluster
from hetctl.files.plan import ModelSpec, Plan
from hetctl.plan.candidates import Pins
from hetctl.files.cluster import Chip, Cluster, Nic, NodeFacts, Tflops

# (vendor, model as the tool prints it, memory GB, bf16 TFLOPS or None, fp16 TFLOPS) — chips.md rows.
CHIPS = [
    ("nvidia", "NVIDIA H100 80GB HBM3", 79.6, 989.4, 989.4),
    ("nvidia", "NVIDIA A100-SXM4-80GB", 80.0, 312.0, 312.0),
    ("nvidia", "Tesla V100-SXM2-32GB", 32.0, None, 125.0),
    ("ascend", "910B2C", 64.0, 376.0, 376.0),
    ("metax", "MetaX C500", 64.0, 280.0, 280.0),
    ("mthreads", "MTT S4000", 48.0, 100.0, 100.0),
    ("hygon", "K100_AI", 63.98, 196.0, 196.0),
    ("cambricon", "MLU370-X8", 22.8, 48.0, 48.0),
    ("amd", "AMD Instinct MI300X OAM", 192.0, 1307.4, 1307.4),
]


def node(name: str, vendor: str, model: str, chips: int, memory: float, bf16: float | None, fp16: float | None,
         *, nic_gbps: float = 200.0, labels: dict | None = None, override: float | None = None,
         reachable: bool = True) -> NodeFacts:
    """A node's facts shaped like `hetctl probe` writes them."""
    if not reachable:
        return NodeFacts(name=name, host=name, reachable=False, error="ssh: connect timed out")
    return NodeFacts(
        name=name, host=f"10.0.{len(name)}.{sum(map(ord, name)) % 250}", labels=labels or {},
        tflops_override=override, memory_gb=512.0,
        chips=[Chip(index=i, vendor=vendor, model=model, memory_gb=memory, tflops=Tflops(bf16=bf16, fp16=fp16),
                    pci_bus_id=f"0000:{0x18 + i:02x}:00.0", source="spec") for i in range(chips)],
        nics=[Nic(name="lo", kind="loopback"), Nic(name="ib0", kind="ib", speed_gbps=nic_gbps)],
    )


def random_cluster(rng: random.Random) -> Cluster:
    nodes = []
    for v in range(rng.randint(1, 4)):
        vendor, model, mem, bf16, fp16 = rng.choice(CHIPS)
        chips = rng.choice([1, 2, 4, 8])
        for i in range(rng.randint(1, 4)):
            nodes.append(node(f"{vendor}-{v}-{i}", vendor, model, chips, mem, bf16, fp16,
                              labels={"switch": f"sw{rng.randint(0, 1)}"}, nic_gbps=rng.choice([25, 100, 400])))
    if rng.random() < 0.3:
        nodes.append(node("gone", "nvidia", "x", 8, 80, 1, 1, reachable=False))
    rng.shuffle(nodes)
    return Cluster(nodes=nodes)


SMALL = ModelSpec(name="small", num_layers=24, hidden_size=2048, ffn_hidden_size=5632, num_attention_heads=16,
                  num_query_groups=4, vocab_size=32000, seq_len=2048, swiglu=True)


def check_invariants(plan: Plan, cluster: Cluster) -> None:
    par, L = plan.parallel, plan.model.num_layers
    # Replicas of different shape (plan.replicas, tests/test_hetdp.py) have their own depth and micro-batches.
    depth = {r.replica: r.stages for r in plan.replicas} or {r: par.pp for r in range(par.dp)}
    micro = sum(r.micro_batches for r in plan.replicas) or par.micro_batches * par.dp
    assert par.global_batch == par.micro_batch * micro
    gone = {n.name for n in cluster.nodes if not n.reachable}
    first = plan.stages_of(0)
    assert len(first) == depth[0] and len(plan.stages) == sum(depth.values())
    for r in range(par.dp):
        stages = plan.stages_of(r)
        assert [s.stage for s in stages] == list(range(depth[r]))
        covered = []
        v = par.virtual_stages  # interleaved 1F1B: chunk c of stage s is virtual stage c·pp + s
        for c in range(v):
            for s in stages:
                covered.extend(range(*(s.chunks[c] if v > 1 else s.layers)))
        for s in stages:
            assert s.layers[0] < s.layers[1], "every stage holds a layer"
            assert (s.chunks[0] == s.layers and len(s.chunks) == v) if v > 1 else not s.chunks
            if not plan.replicas:
                ref = first[s.stage]
                assert (s.layers, s.chunks, s.tp) == (ref.layers, ref.chunks, ref.tp), \
                    "replicas share layers and TP per stage"
            assert len(s.chips) == s.tp
            assert s.memory_gb <= s.memory_limit_gb, f"stage {s.stage} on {s.node} exceeds memory"
            assert s.node not in gone
            assert (s.backend_next is None) == (s.stage == depth[r] - 1)
        assert covered == list(range(L)), "every layer exactly once per replica, contiguous"
    used = [(s.node, c) for s in plan.stages for c in s.chips]
    assert len(used) == len(set(used)), "a chip runs at most one stage"
    assert [r.rank for r in plan.ranks] == list(range(len(used)))
    keyed = sorted(plan.ranks, key=lambda r: (r.replica, r.stage))
    assert keyed == plan.ranks, "rank order is replica-major, then stage"
    for s in plan.stages:
        mine = [r for r in plan.ranks if (r.replica, r.stage) == (s.replica, s.stage)]
        assert all(r.node == s.node for r in mine) and len(mine) == s.tp
        if s.visible_devices_env:
            assert [r.chip for r in mine] == s.chips
    for n in plan.nodes:
        assert [r.local_rank for r in plan.ranks_on(n)] == list(range(len(plan.ranks_on(n))))
    assert plan.nodes == list(dict.fromkeys(r.node for r in plan.ranks))
    by_node = plan.ranks_by_node()  # the one-pass index the launch uses: the same ranks, in rank order
    assert {n: [r.rank for r in rs] for n, rs in by_node.items()} == {
        n: sorted(r.rank for r in plan.ranks_on(n)) for n in plan.nodes}
    est = plan.estimate
    assert 0 < est.utilization <= 1 and 0 <= est.bubble < 1
    assert est.tokens_per_s <= plan.ideal_tokens_per_s * (1 + 1e-9)
    for name, base in plan.baselines.items():
        if base.estimate is not None:
            assert est.tokens_per_s >= base.estimate.tokens_per_s * (1 - 1e-9), f"slower than {name}"
        else:
            assert base.infeasible


@pytest.mark.parametrize("seed", range(24))
def test_invariants_on_generated_clusters(seed):
    rng = random.Random(seed)
    cluster = random_cluster(rng)
    spec = rng.choice([SMALL, load_model("llama2-7b"), load_model("tiny")])
    framework = rng.choice(["flagscale", "hetctl", "megatron", "torchrun"])
    gb = rng.choice([64, 128, 256])
    try:
        plan = plan_cluster(cluster, spec, global_batch=gb, framework=framework)
    except PlanInfeasible as e:
        assert "GB" in e.message and e.hint, e.message  # only memory can make these clusters infeasible
        return
    check_invariants(plan, cluster)
    again = plan_cluster(cluster, spec, global_batch=gb, framework=framework)
    assert again.model_dump(exclude={"plan_time_s"}) == plan.model_dump(exclude={"plan_time_s"})
    if framework in ("hetctl", "megatron"):  # one tensor-parallel degree for every stage of every replica
        assert len({s.tp for s in plan.stages}) == 1
        assert all(spec.ffn_hidden_size % s.tp == 0 and spec.num_attention_heads % s.tp == 0 for s in plan.stages)


def test_most_generated_clusters_are_feasible():
    feasible = 0
    for seed in range(24):
        rng = random.Random(seed)
        cluster = random_cluster(rng)
        spec = rng.choice([SMALL, load_model("llama2-7b"), load_model("tiny")])
        try:
            plan_cluster(cluster, spec, global_batch=rng.choice([64, 128, 256]), framework="flagscale",
                         homogeneous=False)
            feasible += 1
        except PlanInfeasible:
            pass
    assert feasible >= 18


def four_to_one(fast_nodes: int = 1, slow_nodes: int = 1) -> Cluster:
    """4:1 sustained speeds: the inventory's figures (used as is; peaks would be scaled by kinds' efficiencies)."""
    nodes = [node(f"fast-{i}", "nvidia", "NVIDIA A100-SXM4-80GB", 1, 80, 400.0, 400.0, override=400.0)
             for i in range(fast_nodes)]
    nodes += [node(f"slow-{i}", "ascend", "910B4", 1, 64, 100.0, 100.0, override=100.0) for i in range(slow_nodes)]
    return Cluster(nodes=nodes)


# Compute-heavy with a small vocabulary, so layers dominate the stage times.
BALANCE = ModelSpec(name="balance", num_layers=40, hidden_size=2048, ffn_hidden_size=5504,
                    num_attention_heads=16, vocab_size=1024, seq_len=1024, swiglu=True)


def test_four_to_one_compute_gives_four_to_one_layers():
    plan = plan_cluster(four_to_one(), BALANCE, global_batch=64)
    layers = {s.vendor: s.layers[1] - s.layers[0] for s in plan.stages}
    assert layers == {"nvidia": 32, "ascend": 8}
    assert plan.baselines["proportional"].layers in ([32, 8], [8, 32])
    assert plan.baselines["uniform"].layers == [20, 20]
    assert plan.estimate.tokens_per_s > 2 * plan.baselines["uniform"].estimate.tokens_per_s
    assert plan.estimate.utilization_vs_homogeneous > 0.95


def test_four_to_one_with_two_replicas_keeps_the_ratio_in_each():
    plan = plan_cluster(four_to_one(2, 2), BALANCE, global_batch=64, pins=Pins(dp=2))
    assert plan.parallel.dp == 2
    for r in range(2):
        assert {s.vendor: s.layers[1] - s.layers[0] for s in plan.stages_of(r)} == {"nvidia": 32, "ascend": 8}
    assert {s.backend for s in plan.stages} == {"nccl", "hccl"}  # DP groups stay inside a vendor


def memory_tight() -> Cluster:
    """Fast chips with little memory (RTX 4090-like) beside slow chips with a lot (Hygon K100)."""
    fast = [node(f"g{i}", "nvidia", "NVIDIA GeForce RTX 4090", 8, 24.0, 165.2, 165.2, nic_gbps=100) for i in range(2)]
    slow = [node(f"d{i}", "hygon", "K100", 8, 64.0, None, 100.0, nic_gbps=100) for i in range(2)]
    return Cluster(nodes=fast + slow)


def test_memory_tight_cluster_never_exceeds_memory_where_the_baselines_would():
    # One chip per stage (--tp 1), so memory binds on the 24 GB chips.
    spec = load_model("llama2-13b")
    plan = plan_cluster(memory_tight(), spec, global_batch=128, framework="hetctl", pins=Pins(tp=1))
    check_invariants(plan, memory_tight())
    fast = [s for s in plan.stages_of(0) if s.vendor == "nvidia"]
    assert fast and max(s.memory_gb / s.memory_limit_gb for s in fast) > 0.9, "memory is what limits the fast chips"
    assert plan.stages_of(0)[0].vendor == "hygon", "the big-memory chips take the early stages (most in flight)"
    for rule in ("uniform", "proportional"):
        why = plan.baselines[rule].infeasible
        assert why and "NVIDIA GeForce RTX 4090) would need" in why and "has 24.0 GB" in why
    assert {s.precision for s in plan.stages if s.vendor == "hygon"} == {"fp16"}  # K100 has no bf16


def test_model_too_big_names_stage_chip_and_memory():
    small = Cluster(nodes=[node("a", "nvidia", "NVIDIA GeForce RTX 4090", 1, 24.0, 165.2, 165.2),
                           node("b", "mthreads", "MTT S4000", 1, 48.0, 100.0, 100.0)])
    with pytest.raises(PlanInfeasible) as e:
        plan_cluster(small, load_model("llama2-70b"), global_batch=64)
    msg = e.value.message
    assert msg.startswith("no plan fits in memory") and "GB per chip" in msg and "has " in msg
    assert ("RTX 4090" in msg and "on a" in msg) or ("S4000" in msg and "on b" in msg)
    assert "--micro-batch" in e.value.hint and e.value.exit_code == 4


def _wide(hidden: int) -> ModelSpec:
    return ModelSpec(name="wide", num_layers=4, hidden_size=hidden, ffn_hidden_size=4 * hidden, num_attention_heads=64,
                     num_query_groups=8, vocab_size=32000, seq_len=4096, swiglu=True)


def test_reference_trainer_plans_tensor_parallelism_where_one_chip_cannot_hold_a_layer():
    # One 40 GB chip cannot hold a layer of hidden 12288 with its optimizer state; eight
    # chips in tensor parallelism can, and the reference trainer now runs TP: one degree for every stage.
    one = Cluster(nodes=[node("a", "nvidia", "NVIDIA A100-SXM4-40GB", 8, 40.0, 312.0, 312.0)])
    plan = plan_cluster(one, _wide(12288), global_batch=16, framework="hetctl")
    assert plan.parallel.tp > 1 and {s.tp for s in plan.stages} == {plan.parallel.tp}
    assert all(s.node == "a" and len(s.chips) == s.tp for s in plan.stages)  # a TP group inside one node
    assert len(plan.ranks) == plan.parallel.pp * plan.parallel.dp * plan.parallel.tp
    assert any(n.startswith("stage order per replica:") and f"(tp {plan.parallel.tp})" in n for n in plan.notes)
    from hetctl.plan.rankenv import static_env

    for s in plan.stages:  # the rank contract names each rank's TP group: the stage's ranks, in rank order
        group = [r.rank for r in plan.ranks if (r.replica, r.stage) == (s.replica, s.stage)]
        for i, rank in enumerate(group):
            env = static_env(plan, rank)
            assert (env["HETCTL_TP_RANK"], env["HETCTL_TP_SIZE"]) == (str(i), str(s.tp))
            assert env["HETCTL_TP_RANKS"] == ",".join(map(str, group))


def test_infeasible_names_the_frameworks_and_degrees_that_fit():
    # A 256k vocabulary: the reference trainer keeps embedding and head whole on every TP rank, so the
    # head's state and logits do not fit a 40 GB chip, while Megatron splits them over the vocabulary.
    # The error must say which frameworks fit, at which degrees (the planner's own answer for them).
    one = Cluster(nodes=[node("a", "nvidia", "NVIDIA A100-SXM4-40GB", 8, 40.0, 312.0, 312.0)])
    big_vocab = ModelSpec(name="bigvocab", num_layers=4, hidden_size=8192, ffn_hidden_size=4 * 8192,
                          num_attention_heads=64, num_query_groups=8, vocab_size=256000, seq_len=4096, swiglu=True)
    with pytest.raises(PlanInfeasible) as e:
        plan_cluster(one, big_vocab, global_batch=16, framework="hetctl")
    assert "--framework hetctl gives every stage one tensor-parallel degree, and keeps the embedding and output " \
        "head whole on every tensor-parallel rank" in e.value.message
    mega = plan_cluster(one, big_vocab, global_batch=16, framework="megatron").parallel
    assert f"--framework megatron fits it as pp {mega.pp} × dp {mega.dp}, tp {mega.tp}" in e.value.hint
    assert mega.tp > 1 and "--micro-batch" in e.value.hint
    # Where no framework fits, nothing is suggested.
    with pytest.raises(PlanInfeasible) as e:
        plan_cluster(one, _wide(16384), global_batch=16, framework="hetctl")
    assert "--framework" not in e.value.hint


def test_chip_without_tflops_names_node_and_chip():
    c = Cluster(nodes=[node("mx-1", "metax", "MetaX C550", 2, 64.0, None, None)])
    with pytest.raises(ConfigError) as e:
        plan_cluster(c, load_model("tiny"))
    assert "node mx-1: chip 0 (metax MetaX C550) has no known TFLOPS" in e.value.message
    assert "hetctl probe --bench --model MODEL" in e.value.hint and "tflops:" in e.value.hint  # the best route
    c = Cluster(nodes=[node("mx-1", "metax", "MetaX C550", 2, 64.0, None, None, override=240.0)])
    assert plan_cluster(c, load_model("tiny")).stages[0].precision == "bf16"


def test_override_wins_then_calibrated_then_measured_then_spec_and_peaks_are_scaled():
    """The user's figure and a calibrated rate are sustained (as is); a measured matmul and a datasheet
    peak are peaks, scaled by the packaged efficiency (issue 31: the planner assumed every chip sustains
    its peak, so every absolute figure was about 2x optimistic)."""
    from hetctl.plan.devices import chip_rate
    from hetctl.plan.efficiency import lookup

    n = node("a", "nvidia", "NVIDIA A100-SXM4-80GB", 1, 80.0, 312.0, 312.0, override=200.0)
    n.chips[0].measured_tflops = Tflops(bf16=150.0)
    n.chips[0].calibrated_tflops = Tflops(bf16=90.0)
    assert chip_rate(n, n.chips[0]) == (200.0, "bf16", "inventory tflops")
    n.tflops_override = None
    assert chip_rate(n, n.chips[0]) == (90.0, "bf16", "calibrated")
    n.chips[0].calibrated_tflops = None
    assert chip_rate(n, n.chips[0]) == (pytest.approx(150.0 * lookup("bench", "nvidia", "A100").value), "bf16",
                                        "bench×eff")
    n.chips[0].measured_tflops = None
    rate, _, src = chip_rate(n, n.chips[0])
    assert src == "spec×eff" and rate == pytest.approx(312.0 * 0.45)  # the A100 row of efficiency.yaml
    assert 0.3 < rate / 312.0 < 0.6  # published MFU range, never the peak


def test_no_reachable_node_and_bad_pins_are_clear():
    c = Cluster(nodes=[node("x", "nvidia", "m", 1, 1, 1, 1, reachable=False)])
    with pytest.raises(PlanInfeasible, match="no usable chips: node x left out: unreachable"):
        plan_cluster(c, load_model("tiny"))
    ok = four_to_one()
    with pytest.raises(ConfigError, match="--dp 3: global batch 16 is not divisible"):
        plan_cluster(ok, load_model("tiny"), pins=Pins(dp=3))
    with pytest.raises(ConfigError, match="--tp 3: must be a power of two"):
        plan_cluster(ok, load_model("tiny"), pins=Pins(tp=3))
    narrow = ModelSpec(**{**load_model("tiny").model_dump(), "num_attention_heads": 8, "num_query_groups": 8,
                          "ffn_hidden_size": 172})  # 172 = 4 × 43: heads split 8 ways, the MLP does not
    with pytest.raises(ConfigError, match="ffn_hidden_size 172"):
        plan_cluster(ok, narrow, pins=Pins(tp=8))
    with pytest.raises(PlanInfeasible, match="pins"):
        plan_cluster(ok, load_model("tiny"), pins=Pins(pp=3))  # two chips cannot make three stages


def test_unreachable_nodes_are_left_out_and_said_so():
    c = four_to_one()
    c.nodes.append(node("down", "nvidia", "x", 8, 80, 1, 1, reachable=False))
    plan = plan_cluster(c, BALANCE, global_batch=64)
    assert "down" not in plan.nodes
    assert any("node down left out: unreachable (ssh: connect timed out)" in n for n in plan.notes)


def test_a_costly_pin_is_reported():
    plan = plan_cluster(four_to_one(), BALANCE, global_batch=64, pins=Pins(pp=1))
    assert plan.parallel.pp == 1
    assert any("the pin (--pp 1) costs" in n for n in plan.notes)


def issue15_cluster(a100_chips: int = 8) -> Cluster:
    """Issue 15's case: four A100 nodes and one Ascend 910B node (4 chips)."""
    nodes = [node(f"a100-{i}", "nvidia", "NVIDIA A100-SXM4-80GB", a100_chips, 80.0, 312.0, 312.0) for i in range(4)]
    return Cluster(nodes=nodes + [node("910b-0", "ascend", "910B2C", 4, 64.0, 376.0, 376.0)])


@pytest.mark.parametrize("a100_chips,gb", [(8, 512), (4, 256), (4, 512)])
def test_mixed_columns_never_reuse_another_tp_degree(a100_chips, gb):
    # Before the fix a column of (A100, 910B) scored under TP (4, 4) was reused
    # under TP (4, 1): a stage with tp 4 on one chip, ranks past WORLD_SIZE.
    cluster = issue15_cluster(a100_chips)
    plan = plan_cluster(cluster, load_model("llama2-7b"), global_batch=gb, framework="flagscale", homogeneous=False)
    check_invariants(plan, cluster)
    par = plan.parallel
    for s in plan.stages:
        assert s.tp == len(s.chips) <= len(next(n for n in cluster.nodes if n.name == s.node).chips)
    assert len(plan.ranks) == par.dp * sum(s.tp for s in plan.stages_of(0))
    for pos in range(par.pp):
        column = {(s.vendor, s.model, s.tp) for s in plan.stages if s.stage == pos}
        assert len(column) == 1, f"stage {pos} mixes chip types across replicas: FlagScale cannot express it"


def test_searcher_keys_stage_types_on_every_members_degree():
    from hetctl.plan.workload import Workload
    from hetctl.plan.devices import collect
    from hetctl.plan.models import model_cost
    from hetctl.plan.search import Searcher

    spec = load_model("llama2-7b")
    kinds = collect(issue15_cluster()).kinds
    work = Workload(cost=model_cost(spec), micro_batch=1, global_batch=64)
    a, b = (next(i for i, k in enumerate(kinds) if k.vendor == v) for v in ("nvidia", "ascend"))
    column = tuple(sorted(((a, 1), (b, 1))))
    tps = [0] * len(kinds)
    tps[a] = tps[b] = 4
    search = Searcher(kinds, spec, work, "torchrun", Pins())
    assert search.ctype(column, tuple(tps), 2).tp == 4
    tps[b] = 1
    assert search.ctype(column, tuple(tps), 2) is None, "members disagree on the TP degree"
    assert Searcher(kinds, spec, work, "flagscale", Pins()).ctype(((a, 1), (b, 1)), (4, 4), 2) is None
