"""Replicas of different shape (hetero data parallelism, issue 12 part one).

The planner may give replicas different depths, chip kinds and micro-batch
counts, but only for a framework that can run them (hetctl.plan.frameworks),
and never a slower plan than one shape for every replica: a property test on
generated clusters holds this, beside a named cluster where the mixed shapes win.
"""

from __future__ import annotations

import random

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hetctl.errors import ConfigError, PlanInfeasible
from hetctl.files.plan import Plan
from hetctl.files.cluster import Cluster
from hetctl.plan.workload import Workload
from hetctl.plan.devices import collect, plan_use
from hetctl.plan.frameworks import CAPABILITIES
from hetctl.plan.hetdp import HeteroSearch, dp_allreduce, share
from hetctl.plan.layout import Part
from hetctl.plan.models import model_cost
from hetctl.plan.planner import plan_cluster
from hetctl.plan.rankenv import static_env
from hetctl.plan.candidates import Pins
from hetctl.plan.search import Searcher
from tests.test_plan_invariants import CHIPS, SMALL, node


def mixed() -> Cluster:
    """Three nodes of two MI300X and two of two MetaX C500: one shape for every replica is slower here."""
    amd, metax = CHIPS[8], CHIPS[4]
    # The scenario's speeds are sustained ones (the inventory's figure, used as is: docs/efficiency.md).
    nodes = [node(f"amd-{i}", *amd[:2], 2, *amd[2:], nic_gbps=g, override=amd[3]) for i, g in enumerate((400, 100, 400))]
    nodes += [node(f"metax-{i}", *metax[:2], 2, *metax[2:], nic_gbps=g, override=metax[3])
              for i, g in enumerate((400, 100))]
    return Cluster(nodes=nodes)


def fast_slow() -> Cluster:
    """Two nodes of four H100 and two of four V100: for the reference trainer, one shape for every replica
    is slower here (the gradient all-reduce stays inside one vendor's library)."""
    h100, v100 = CHIPS[0], CHIPS[2]
    nodes = [node(f"h100-{i}", *h100[:2], 4, *h100[2:], nic_gbps=400, override=h100[3]) for i in range(2)]
    nodes += [node(f"v100-{i}", *v100[:2], 4, *v100[2:], nic_gbps=400, override=v100[3] or v100[4]) for i in range(2)]
    return Cluster(nodes=nodes)


def uniform_step(cluster: Cluster, gb: int, framework: str) -> float:
    """Step seconds of the best plan with one shape for every replica (the planner before hetero DP)."""
    work = Workload(cost=model_cost(SMALL), micro_batch=1, global_batch=gb,
                    p2p="none" if framework == "hetctl" else None)  # the links as the planner prices them
    # the speeds the planner uses: sustained at this shape (hetctl.plan.efficiency)
    return Searcher(collect(cluster, plan_use(SMALL, 1)).kinds, SMALL, work, framework, Pins()).run().best.step


def check_hetero(plan: Plan) -> None:
    """What must hold of any plan whose replicas differ."""
    par = plan.parallel
    plan.check_consistency()
    assert [r.replica for r in plan.replicas] == list(range(par.dp))
    assert sum(r.micro_batches for r in plan.replicas) * par.micro_batch == par.global_batch
    for row in plan.replicas:
        stages = plan.stages_of(row.replica)
        assert len(stages) == row.stages
        assert stages[0].layers[0] == 0 and stages[-1].layers[1] == plan.model.num_layers
        assert all(a.layers[1] == b.layers[0] for a, b in zip(stages, stages[1:]))
        assert list(dict.fromkeys(s.node for s in stages)) == row.nodes
    assert plan.estimate.step_time_s <= plan.baselines["uniform-replicas"].estimate.step_time_s


def test_mixed_cluster_gets_replicas_of_different_shape():
    cluster = fast_slow()
    plan = plan_cluster(cluster, SMALL, global_batch=1024, framework="hetctl")
    assert plan.replicas, "replicas of different shape were expected to win on this cluster"
    check_hetero(plan)
    assert plan.estimate.step_time_s < uniform_step(cluster, 1024, "hetctl")
    # --explain says how the gradients are reduced: the reference trainer starts each stage's reduction after
    # its own last backward (frameworks.py: overlap_cross_vendor_dp), here inside one vendor's library.
    assert any("one bucket, one ring over the vendor library (gloo on CPU); each stage starts it after its own last "
               "backward" in n for n in plan.notes)
    # A faster chip kind's replica runs more micro-batches per step than a slower one of the same depth would.
    by_model = {}
    for row in plan.replicas:
        by_model.setdefault(plan.stages_of(row.replica)[0].model, []).append(row)
    assert len(by_model) == 2 and len({r.part for r in plan.replicas}) >= 2
    speed = {m: sum(r.micro_batches for r in rows) for m, rows in by_model.items()}
    assert speed["NVIDIA H100 80GB HBM3"] > speed["Tesla V100-SXM2-32GB"]
    # The plan file says what each replica does, and survives a round trip.
    again = Plan.model_validate(yaml.safe_load(yaml.safe_dump(plan.model_dump(mode="json"))))
    again.check_consistency()
    assert again.replicas == plan.replicas
    assert any(n.startswith("layout: hetero data parallelism") for n in plan.notes)
    assert sum(n.startswith("part ") for n in plan.notes) == len({r.part for r in plan.replicas})
    assert any(n.startswith(f"gradient all-reduce over all {plan.parallel.dp} replicas") for n in plan.notes)
    assert plan.estimate.cross_vendor_sync_s == 0  # one vendor: no CPU path
    # Each rank is told its own replica's micro-batch count.
    for rank in plan.ranks:
        assert static_env(plan, rank)["HETCTL_MICRO_BATCHES"] == str(plan.replicas[rank.replica].micro_batches)


def test_only_frameworks_that_can_run_it_get_it():
    cluster = fast_slow()
    for framework, cap in CAPABILITIES.items():
        try:
            plan = plan_cluster(cluster, SMALL, global_batch=1024, framework=framework)
        except (PlanInfeasible, ConfigError):
            continue
        if not cap.uneven_dp:
            assert not plan.replicas, framework
            assert plan.parallel.micro_batches * plan.parallel.dp == 1024


def test_a_plan_that_does_not_add_up_is_refused():
    plan = plan_cluster(fast_slow(), SMALL, global_batch=1024, framework="hetctl")
    data = plan.model_dump(mode="json")
    data["replicas"][0]["micro_batches"] += 1
    try:
        Plan.model_validate(data).check_consistency()
    except Exception as e:  # noqa: BLE001 - the error type is the files' Invalid
        assert "global_batch" in str(e) or "micro" in str(e)
    else:
        raise AssertionError("a replicas table that misses the global batch was accepted")


def test_share_gives_out_every_micro_batch_and_balances_the_parts():
    work = Workload(cost=model_cost(SMALL), micro_batch=1, global_batch=1024)
    kinds = collect(mixed()).kinds
    search = HeteroSearch(kinds, SMALL, work, "torchrun")
    parts = [search.part((i,), 512) for i in range(len(kinds))]
    assert all(parts)
    for total in (len(kinds) * 4, 257, 1024):
        assert share(parts, total)
        assert sum(sum(p.micro) for p in parts) == total
        for p in parts:
            assert len(p.micro) == p.lay.dp and min(p.micro) >= 1 and max(p.micro) - min(p.micro) <= 1
        # No single micro-batch moved from one part to another makes the slowest part finish earlier.
        given = [sum(p.micro) for p in parts]

        def worst(alloc):
            return max(p.linear(-(-n // p.lay.dp)) for p, n in zip(parts, alloc))

        for i in range(len(parts)):
            for j in range(len(parts)):
                if i != j and given[i] > parts[i].lay.dp:
                    moved = list(given)
                    moved[i] -= 1
                    moved[j] += 1
                    assert worst(moved) >= worst(given) - 1e-12
    assert not share(parts, 1)


def test_cross_vendor_allreduce_costs_what_it_moves():
    work = Workload(cost=model_cost(SMALL), micro_batch=1, global_batch=1024)
    search = HeteroSearch(collect(mixed()).kinds, SMALL, work, "torchrun")
    a, b = search.part((0,), 512), search.part((1,), 512)
    two = dp_allreduce([a, b], work)
    assert two > 0
    wide = SMALL.model_copy(update={"hidden_size": 4096, "ffn_hidden_size": 11264})
    big = Workload(cost=model_cost(wide), micro_batch=1, global_batch=1024)
    assert dp_allreduce([a, b], big) > two  # more parameters per layer, more bytes
    assert dp_allreduce([a, b, a], work) >= two  # more replicas in the ring
    # The same parts on one vendor skip the host copies and gloo's efficiency: cheaper.
    same = search.part((0,), 512)
    assert dp_allreduce([same, same], work) < dp_allreduce([same, b], work)


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 10_000), gb=st.sampled_from([64, 256, 1024]), framework=st.sampled_from(["torchrun", "hetctl"]))
def test_never_slower_than_one_shape_for_every_replica(seed, gb, framework):
    from tests.test_plan_invariants import random_cluster

    cluster = random_cluster(random.Random(seed))
    try:
        plan = plan_cluster(cluster, SMALL, global_batch=gb, framework=framework, homogeneous=False)
    except (PlanInfeasible, ConfigError):
        return
    # step_time_s is rounded to the microsecond in the plan file
    assert plan.estimate.step_time_s <= uniform_step(cluster, gb, framework) * (1 + 1e-6) + 1e-6
    if plan.replicas:
        check_hetero(plan)
    else:
        plan.check_consistency()


def test_scripts_render_for_the_trainer_and_refuse_a_framework_that_cannot_run_it(tmp_path):
    from hetctl.plan.render import render_node_scripts

    plan = plan_cluster(fast_slow(), SMALL, global_batch=1024, framework="hetctl")
    assert plan.replicas
    scripts = render_node_scripts(plan, {})
    assert sorted(scripts) == sorted(plan.nodes)
    for row in plan.replicas:
        for node_name in row.nodes:
            assert f"HETCTL_MICRO_BATCHES={row.micro_batches} " in scripts[node_name]
    try:
        render_node_scripts(plan.model_copy(update={"framework": "flagscale"}), {})
    except ConfigError as e:
        assert "flagscale cannot run" in str(e)
    else:
        raise AssertionError("a FlagScale script was rendered for replicas of different shape")


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 10_000), wide=st.booleans())
def test_hierarchical_allreduce_is_never_slower_than_flat_and_is_flat_for_one_vendor(seed, wide):
    """The cost model of hetctl.train.dpreduce: per unit and over a whole step, against the flat all-reduce."""
    from hetctl.plan.costmodel import stage_type
    from hetctl.plan.gradsync import member_seconds
    from tests.test_plan_invariants import random_cluster

    rng = random.Random(seed)
    kinds = [k for k in collect(random_cluster(rng)).kinds if len(k.vendors) == 1]
    spec = SMALL.model_copy(update={"hidden_size": 4096, "ffn_hidden_size": 11264}) if wide else SMALL
    work = Workload(cost=model_cost(spec), micro_batch=1, global_batch=256)
    # One TP degree for every holder of a unit (their gradient slices must line up), and at least two chips of
    # each vendor. A vendor with a single holder beside a large group of another can make the hierarchy cost
    # more than the flat ring (7 + 1 chips at one NIC speed: 1.86 against 1.75 unit-bytes / gloo rate): the
    # cost model says so, and the planner charges what the trainer does.
    tp = rng.choice([1, 2])
    members = [(stage_type(k, tp, work, 2), rng.randint(2, 6)) for k in kinds for _ in range(rng.randint(1, 2))]
    # Units of a real model (millions of parameters) are bandwidth-bound; a unit of a few thousand would be
    # latency-bound, and there the extra collectives of the hierarchy cost more (the model says so too).
    for params in (work.cost.embed_params, work.cost.layer_params, work.cost.head_params):
        hier, flat = member_seconds(params, members, True), member_seconds(params, members, False)
        assert max(hier) <= max(flat) * (1 + 1e-12), (params, members)
        for v in {k.vendors for k in kinds}:  # one vendor's holders alone: the same all-reduce, exactly
            one = [(s, n) for s, n in members if s.kind.vendors == v]
            assert member_seconds(params, one, True) == member_seconds(params, one, False)


def test_whole_embedding_and_head_are_reduced_whole_under_tp():
    """The reference trainer keeps embedding and head whole on every TP rank (tp_vocab False): each chip
    all-reduces all of their gradients, while a layer's are split tp ways; a vocab-parallel framework splits both."""
    from hetctl.plan.costmodel import stage_type
    from hetctl.plan.gradsync import member_seconds

    work = Workload(cost=model_cost(SMALL), micro_batch=1, global_batch=256)
    kinds = collect(mixed()).kinds
    params = work.cost.head_params
    for vocab_tp in (False, True):
        one = [(stage_type(k, 1, work, 2, vocab_tp), 2) for k in kinds]
        two = [(stage_type(k, 2, work, 2, vocab_tp), 2) for k in kinds]
        for hier in (False, True):
            whole = max(member_seconds(params, one, hier, vocab=True))
            split = max(member_seconds(params, two, hier, vocab=True))
            assert split < whole if vocab_tp else split == whole, (vocab_tp, hier)
            layer1, layer2 = max(member_seconds(params, one, hier)), max(member_seconds(params, two, hier))
            assert layer2 < layer1  # a layer's gradients are always split


def test_hierarchical_and_overlapped_reduction_costs_less_and_one_part_is_flat():
    work = Workload(cost=model_cost(SMALL), micro_batch=1, global_batch=1024)
    search = HeteroSearch(collect(mixed()).kinds, SMALL, work, "hetctl")
    a, b = search.part((0,), 512), search.part((1,), 512)
    assert (a.lay.dp, b.lay.dp) == (1, 2)
    two = [a, Part(kinds=a.kinds, lay=a.lay), b]  # two AMD replicas beside the two MetaX ones
    assert share(two, 1024)
    flat, hier = dp_allreduce(two, work, False, False), dp_allreduce(two, work, True, False)
    assert 0 < hier < flat  # two vendors with two chips or more each: only a shard crosses gloo
    assert dp_allreduce(two, work, True, True) <= hier  # a late stage's reduction hides behind the drain
    # One AMD replica beside two MetaX ones: its single chip carries the whole unit over gloo after the MetaX
    # pair's reduce-scatter, so here the hierarchy costs more than the flat ring, and is charged so.
    assert dp_allreduce([a, b], work, True, False) > dp_allreduce([a, b], work, False, False)
    assert dp_allreduce([a], work, True, False) == dp_allreduce([a], work, False, False)


def test_shards_of_groups_of_different_size_are_cut_into_pieces_held_once_per_group():
    """hetctl.train.dpreduce: where a unit of n elements is cut, and which member of each vendor group holds a piece."""
    import pytest

    pytest.importorskip("torch")
    from hetctl.train.dpreduce import pieces

    # Groups of 3 (shards of 4: [0,4) [4,8) [8,10)) and of 2 (shards of 5: [0,5) [5,10)).
    assert pieces(10, [3, 2]) == [(0, 4, (0, 0)), (4, 5, (1, 0)), (5, 8, (1, 1)), (8, 10, (2, 1))]
    for n in (1, 2, 7, 1000, 4099):
        for sizes in ([2, 1], [2, 2], [3, 2], [8, 5, 1], [4, 4, 3]):
            cut = pieces(n, sizes)
            assert cut[0][0] == 0 and cut[-1][1] == n
            assert all(a < b and b == c for (a, b, _), (c, _, _) in zip(cut, cut[1:] + [(n, n, ())]))
            for a, b, at in cut:  # each piece lies inside one shard of every group
                for g, i in zip(sizes, at):
                    s = -(-n // g)
                    assert i * s <= a and b <= (i + 1) * s and i < g
