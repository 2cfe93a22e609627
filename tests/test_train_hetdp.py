"""The reference trainer runs replicas of different shape and micro-batch count (hetero data parallelism).

Real processes over gloo on loopback: a plan whose replica 0 is one stage of all
six layers running three micro-batches and whose replica 1 is two stages of
three layers running one, against a single-rank run of the same model, data and
global batch (8 sequences). The gradients are summed over both replicas and
divided by the global batch, so the losses agree within float32 rounding; the
tolerance (relative 1e-4, absolute 1e-5 over 20 AdamW steps) is the one the
uniform data-parallel run is held to in tests/test_train.py. The same holds for
a plan whose replicas are labelled with two vendors, whose gradients then go
through the hierarchical all-reduce (hetctl.train.dpreduce), and it matches the
same plan run with ``--dp-reduce flat``; killed and resumed, it is bit-identical
to its own undisturbed run.
"""

from __future__ import annotations

import signal

import pytest

from hetctl.files.plan import Estimate, Parallel, Plan, Rank, Replica, Stage
from hetctl.node import manifest as checkpoint
from tests.helpers.rankrunner import TINY, Ranks, run_plan, tiny_plan

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.e2e  # real torch training processes over gloo

STEPS = 20


def uneven_plan(shapes: list[tuple[list[int], int]], micro_batch: int = 2, vendors: list[str] | None = None) -> dict:
    """One replica per ``(layer split, micro-batches)``; ranks replica-major, one node per rank.

    ``vendors``: per replica, the vendor its stages are labelled with (CPU ranks all the same; the label is
    what groups a unit's holders for the hierarchical all-reduce), and its ``part`` (one per vendor).
    """
    vendors = vendors or ["cpu"] * len(shapes)
    part = {v: k for k, v in enumerate(dict.fromkeys(vendors))}
    spec = Plan.model_fields["model"].annotation(**TINY)
    stages, ranks, rows = [], [], []
    for rep, (split, micro) in enumerate(shapes):
        start = 0
        for st, n in enumerate(split):
            node = f"n{len(ranks)}"
            stages.append(Stage(replica=rep, stage=st, node=node, vendor=vendors[rep], chips=[], tp=1,
                                layers=(start, start + n), precision="fp32", backend="gloo",
                                backend_next="gloo" if st < len(split) - 1 else None, device_type="cpu"))
            ranks.append(Rank(rank=len(ranks), node=node, local_rank=0, stage=st, replica=rep))
            start += n
        rows.append(Replica(replica=rep, stages=len(split), micro_batches=micro, part=part[vendors[rep]],
                            nodes=[f"n{i}" for i in range(len(ranks) - len(split), len(ranks))]))
    plan = Plan(model=spec, parallel=Parallel(pp=max(len(s) for s, _ in shapes), dp=len(shapes), tp=1,
                                              micro_batch=micro_batch, micro_batches=max(m for _, m in shapes),
                                              global_batch=micro_batch * sum(m for _, m in shapes)),
                nodes=[r.node for r in ranks], stages=stages, ranks=ranks, replicas=rows,
                estimate=Estimate(step_time_s=0.0, bubble=0.0, utilization=0.0, tokens_per_s=0.0))
    plan.check_consistency()
    return plan.model_dump(mode="json")


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """One rank, all six layers, four micro-batches of two: the reference."""
    return run_plan(tiny_plan([6]), tmp_path_factory.mktemp("single"), steps=STEPS)


SHAPES = [([6], 3), ([3, 3], 1)]  # replica 0: one stage, 3 micro-batches; replica 1: two stages, 1


@pytest.fixture(scope="module")
def uneven(tmp_path_factory):
    """The uneven plan's undisturbed run, saving every 5 steps: held to the single rank, and the killed run's twin."""
    return run_plan(uneven_plan(SHAPES), tmp_path_factory.mktemp("uneven"), steps=STEPS, ckpt_every=5)


def test_replicas_of_different_shape_match_a_single_rank(single, uneven, tmp_path):
    run = uneven
    ours, ref = run.losses(0), single.losses()
    assert sorted(ref) == list(range(1, STEPS + 1))
    assert run.losses(1) == ours  # both replicas' last stages report the all-reduced loss
    for s in range(1, STEPS + 1):
        assert float(ours[s]) == pytest.approx(float(ref[s]), rel=1e-4, abs=1e-5), s
    # Replica 0 holds every layer, so the checkpoint is complete and loads under a plain split.
    assert checkpoint.validate(run.ckpt_dir / "step-20", checkpoint.model_digest(TINY)) == []
    again = run_plan(tiny_plan([2, 4]), tmp_path / "replan", steps=STEPS + 2, resume_step=20, ckpt_dir=run.ckpt_dir)
    assert sorted(again.losses()) == [21, 22]


def test_uneven_run_killed_and_resumed_is_bit_identical(uneven, tmp_path):
    plan = uneven_plan(SHAPES)
    calm = uneven
    with Ranks(plan, tmp_path / "crash", steps=STEPS, ckpt_every=5) as crashed:
        crashed.start()
        crashed.wait_for_step(2, 12)
        crashed.wait_for_checkpoint(5)
        crashed.kill(2, signal.SIGKILL)  # replica 1's last stage dies mid-run
        crashed.stop_all()
    found = checkpoint.latest_valid(crashed.ckpt_dir, checkpoint.model_digest(TINY))
    assert found is not None and found[0] < STEPS
    resumed = run_plan(plan, tmp_path / "crash", steps=STEPS, ckpt_every=5, attempt=2, resume_step=found[0])
    assert resumed.losses() == {s: calm.losses()[s] for s in range(found[0] + 1, STEPS + 1)}


# Two "vendors" (CPU ranks labelled nvidia and ascend): two one-stage replicas of one, a two-stage replica of the
# other. Every unit's holders span both, so the gradients go hierarchically (hetctl.train.dpreduce): a
# reduce-scatter inside the nvidia pair, each half all-reduced with the ascend rank over gloo, an all-gather.
PARTS = [([6], 1), ([6], 1), ([3, 3], 2)]
VENDORS = ["nvidia", "nvidia", "ascend"]


@pytest.fixture(scope="module")
def hier(tmp_path_factory):
    """The two-vendor plan's undisturbed run, saving every 5 steps: held to the single rank and the flat reduce,
    and the killed run's twin."""
    return run_plan(uneven_plan(PARTS, vendors=VENDORS), tmp_path_factory.mktemp("hier"), steps=STEPS, ckpt_every=5)


def test_hierarchical_allreduce_across_two_parts_matches_a_single_rank_and_the_flat_one(single, hier, tmp_path):
    from hetctl.train.dpreduce import pieces

    plan = uneven_plan(PARTS, vendors=VENDORS)
    assert len(pieces(1000, [2, 1])) == 2  # the nvidia halves, each reduced with the ascend rank's whole
    flat = run_plan(plan, tmp_path / "flat", steps=STEPS, args=("--dp-reduce", "flat"))
    ours, ref, plain = hier.losses(0), single.losses(), flat.losses(0)
    assert sorted(ours) == list(range(1, STEPS + 1))
    assert hier.losses(1) == ours == hier.losses(2)  # every replica reports the same all-reduced loss
    # The hierarchical path ran (and only where asked): each rank says how it reduces its units.
    assert "dp_reduce: hierarchical 8 of 8 units" in hier.stdout(0)
    assert "dp_reduce: hierarchical 4 of 4 units" in hier.stdout(3)  # the ascend replica's last stage
    assert "dp_reduce: hierarchical 0 of 8 units" in flat.stdout(0)
    for s in range(1, STEPS + 1):
        assert float(ours[s]) == pytest.approx(float(ref[s]), rel=1e-4, abs=1e-5), s
        assert float(ours[s]) == pytest.approx(float(plain[s]), rel=1e-4, abs=1e-5), s


def test_hierarchical_run_killed_and_resumed_is_bit_identical(hier, tmp_path):
    plan = uneven_plan(PARTS, vendors=VENDORS)
    calm = hier
    with Ranks(plan, tmp_path / "crash", steps=STEPS, ckpt_every=5) as crashed:
        crashed.start()
        crashed.wait_for_step(3, 12)
        crashed.wait_for_checkpoint(5)
        crashed.kill(3, signal.SIGKILL)  # the ascend replica's last stage dies mid-run
        crashed.stop_all()
    found = checkpoint.latest_valid(crashed.ckpt_dir, checkpoint.model_digest(TINY))
    assert found is not None and found[0] < STEPS
    resumed = run_plan(plan, tmp_path / "crash", steps=STEPS, ckpt_every=5, attempt=2, resume_step=found[0])
    assert resumed.losses() == {s: calm.losses()[s] for s in range(found[0] + 1, STEPS + 1)}
