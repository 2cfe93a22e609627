"""The reference trainer runs tensor parallelism (TP = 2) on real processes over gloo.

Every layer is split Megatron-style over a stage's two ranks (column-parallel
q/k/v and gate/up, row-parallel o and down, :mod:`hetctl.train.tensor`).
Against a single-rank run of the same model, data and global batch (8
sequences: 4 micro-batches of 2) the per-step losses must agree within float32
rounding: relative 1e-5 over 10 AdamW steps. Bit-equality is not expected —
the row-parallel all-reduce adds the two halves of each product in another
order than one matrix product does (measured: identical for the first steps,
then about 5e-7 relative). A kill -9 and a restart under TP = 2 is bit-identical
to its own undisturbed run; a checkpoint written under TP = 2 resumes under
TP = 1 (and under another pipeline split), and one written under TP = 1 resumes
under TP = 2, weights and AdamW state both.
"""

from __future__ import annotations

import signal

import pytest

from hetctl.files.plan import Plan
from hetctl.node import manifest as checkpoint
from hetctl.node.runtime import RankContext
from hetctl.plan.rankenv import static_env
from hetctl.train.topology import topology
from tests.helpers.rankrunner import TINY, Ranks, run_plan, tiny_plan

torch = pytest.importorskip("torch")

STEPS = 10
REL, ABS = 1e-5, 1e-6


def _close(ours: dict[int, str], ref: dict[int, str], steps) -> None:
    for s in steps:
        assert float(ours[s]) == pytest.approx(float(ref[s]), rel=REL, abs=ABS), (s, ours[s], ref[s])


def _ctx(plan: dict, rank: int, tmp_path, **extra) -> RankContext:
    env = {**static_env(Plan.model_validate(plan), rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1",
           "HETCTL_RUN_ID": "r", "HETCTL_ATTEMPT": "0", "HETCTL_PLAN": str(tmp_path / "plan.json"), **extra}
    return RankContext.from_env(env)


def test_rank_environment_and_topology_pair_tp_ranks_across_stages(tmp_path):
    plan = tiny_plan([2, 4], dp=2, tp=2)  # ranks (replica·2 + stage)·2 + tp_rank
    env = static_env(Plan.model_validate(plan), 3)
    assert (env["HETCTL_TP_RANK"], env["HETCTL_TP_SIZE"], env["HETCTL_TP_RANKS"]) == ("1", "2", "2,3")
    topo = topology(plan, _ctx(plan, 3, tmp_path))
    assert (topo.stage, topo.replica, topo.tp, topo.tp_rank, topo.tp_ranks) == (1, 0, 2, 1, (2, 3))
    assert (topo.prev_rank, topo.next_rank) == (1, None)  # TP rank 1 of stage 0, not its TP rank 0
    mine = {name: members for name, members, _ in topo.unit_groups if topo.rank in members}
    assert mine["layer-00003"] == (3, 7) and mine["head"] == (3, 7)  # the same shard in every replica
    assert len(topo.unit_groups) == 2 * (TINY["num_layers"] + 2)  # every unit, once per TP rank
    assert topo.tp_groups == ((0, 1), (2, 3), (4, 5), (6, 7))


def test_topology_refuses_tp_plans_it_cannot_run(tmp_path):
    from hetctl.errors import ConfigError

    plan = tiny_plan([2, 4], tp=2)
    with pytest.raises(ConfigError, match="HETCTL_TP_RANK=0"):
        topology(plan, _ctx(plan, 1, tmp_path, HETCTL_TP_RANK="0"))
    mixed = tiny_plan([2, 4], tp=2)
    mixed["stages"][1]["tp"] = 1
    with pytest.raises(ConfigError, match=r"tp=1 but ranks\[\] has 2 ranks"):
        topology(mixed, _ctx(plan, 0, tmp_path))
    odd = tiny_plan([6], tp=4)  # ffn 172 / 4 is whole, but 2 KV groups are not
    with pytest.raises(ConfigError, match="num_query_groups=2 is not divisible by tp=4"):
        topology(odd, _ctx(odd, 0, tmp_path))


def test_shards_reassemble_the_whole_layer():
    """Slicing a layer for each TP rank and joining the shards gives back the very tensors (pure)."""
    from hetctl.train.model import build_units
    from hetctl.train.tensor import SHARD_DIM, shard_payload

    whole = build_units(TINY, (0, 1), False, False, seed=7)["layer-00000"].state_dict()
    payload = {"params": whole, "optim": {k: {"step": torch.tensor(3.0), "exp_avg": v * 2} for k, v in whole.items()}}
    parts = [shard_payload("layer-00000", payload, r, 2) for r in range(2)]
    for k, v in whole.items():
        dim = SHARD_DIM.get(k)
        joined = torch.cat([p["params"][k] for p in parts], dim) if dim is not None else parts[1]["params"][k]
        assert torch.equal(joined, v), k
        assert parts[0]["params"][k].shape[dim or 0] == (v.shape[dim] // 2 if dim is not None else v.shape[0])
        assert parts[1]["optim"][k]["step"].item() == 3.0
    assert shard_payload("head", payload, 1, 2) == payload  # embedding and head stay whole


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """One rank, all six layers, four micro-batches of two: the reference."""
    return run_plan(tiny_plan([6]), tmp_path_factory.mktemp("single"), steps=STEPS, ckpt_every=5)


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    """A TP = 2 plan's undisturbed run, once per module, saving every 5 steps: held to the single rank, and the
    killed run's twin."""
    runs: dict[str, object] = {}

    def get(split: list[int]):
        name = "pp" + "-".join(map(str, split))
        if name not in runs:
            runs[name] = run_plan(tiny_plan(split, tp=2), tmp_path_factory.mktemp(name), steps=STEPS, ckpt_every=5)
        return runs[name]

    return get


@pytest.mark.e2e
@pytest.mark.parametrize("split", [[6], [2, 4]], ids=["pp1-tp2", "pp2-tp2"])
def test_tp2_run_matches_a_single_rank_and_its_checkpoint_loads_under_tp1(single, tp2, tmp_path, split):
    run = tp2(split)
    ours, ref = run.losses(), single.losses()
    assert sorted(ours) == sorted(ref) == list(range(1, STEPS + 1))
    _close(ours, ref, range(1, STEPS + 1))
    print("bit-identical to the single rank:", ours == ref)
    # TP-independent checkpoints: complete, and the same files (names, shapes) a TP=1 run writes.
    step5 = run.ckpt_dir / "step-5"
    assert checkpoint.validate(step5, checkpoint.model_digest(TINY)) == []
    mine = torch.load(step5 / "layer-00003.pt", weights_only=True)
    theirs = torch.load(single.ckpt_dir / "step-5" / "layer-00003.pt", weights_only=True)
    assert {k: v.shape for k, v in mine["params"].items()} == {k: v.shape for k, v in theirs["params"].items()}
    assert {k: v["exp_avg"].shape for k, v in mine["optim"].items()} == \
        {k: v["exp_avg"].shape for k, v in theirs["optim"].items()}
    # Resumed under TP = 1 on another split, it goes on as the single rank did.
    plain = run_plan(tiny_plan([3, 3]), tmp_path / "tp1", steps=STEPS, resume_step=5, ckpt_dir=run.ckpt_dir)
    _close(plain.losses(), ref, range(6, STEPS + 1))


@pytest.mark.e2e
def test_tp1_checkpoint_resumes_under_tp2(single, tmp_path):
    resumed = run_plan(tiny_plan([2, 4], tp=2), tmp_path, steps=STEPS, resume_step=5, ckpt_dir=single.ckpt_dir)
    assert sorted(resumed.losses()) == list(range(6, STEPS + 1))
    _close(resumed.losses(), single.losses(), range(6, STEPS + 1))


@pytest.mark.e2e
def test_tp2_run_killed_and_resumed_is_bit_identical(tp2, tmp_path):
    plan = tiny_plan([2, 4], tp=2)
    calm = tp2([2, 4])
    with Ranks(plan, tmp_path / "crash", steps=STEPS, ckpt_every=5) as crashed:
        crashed.start()
        crashed.wait_for_step(1, 7)
        crashed.wait_for_checkpoint()  # the first save is asynchronous: under load it commits steps later
        crashed.kill(1, signal.SIGKILL)  # TP rank 1 of the first stage dies; its TP peer is stuck in a collective
        crashed.stop_all()
        assert crashed.procs[1].returncode == -signal.SIGKILL
    seen = crashed.losses()
    assert seen and all(seen[s] == calm.losses()[s] for s in seen)
    found = checkpoint.latest_valid(crashed.ckpt_dir, checkpoint.model_digest(TINY))
    assert found is not None and found[0] < STEPS
    resumed = run_plan(plan, tmp_path / "crash", steps=STEPS, ckpt_every=5, attempt=2, resume_step=found[0])
    assert resumed.losses() == {s: calm.losses()[s] for s in range(found[0] + 1, STEPS + 1)}


def with_tp(plan: dict, tp: int) -> dict:
    """``plan`` (a TP = 1 plan dict) with every stage split over ``tp`` ranks on its node, ranks renumbered."""
    out = {**plan, "parallel": {**plan["parallel"], "tp": tp}}
    out["stages"] = [{**s, "tp": tp} for s in plan["stages"]]
    out["ranks"] = [{**r, "rank": r["rank"] * tp + i, "local_rank": r["local_rank"] * tp + i}
                    for r in sorted(plan["ranks"], key=lambda r: r["rank"]) for i in range(tp)]
    return Plan.model_validate(out).model_dump(mode="json")


@pytest.mark.e2e
def test_tp2_runs_under_interleaving_and_uneven_replicas(single, tmp_path):
    """TP composes with the other layouts: interleaved 1F1B (pp 2 × v 3, an empty chunk), two replicas of
    different depth and micro-batch count, and replicas of two vendors whose gradients go hierarchically
    (a layer's shard per TP rank: hetctl.train.dpreduce), each under tp 2, match the single rank."""
    from tests.test_train_hetdp import PARTS, SHAPES, VENDORS, uneven_plan
    from tests.test_train_interleave import PP2_V3, interleaved_plan

    for name, plan in (("interleaved", interleaved_plan(PP2_V3, group=2)), ("uneven", uneven_plan(SHAPES)),
                       ("hierarchical", uneven_plan(PARTS, vendors=VENDORS))):
        run = run_plan(with_tp(plan, 2), tmp_path / name, steps=STEPS)
        assert sorted(run.losses()) == list(range(1, STEPS + 1)), name
        _close(run.losses(), single.losses(), range(1, STEPS + 1))
        if name == "hierarchical":
            assert "dp_reduce: hierarchical 8 of 8 units" in run.stdout(1)  # TP rank 1 of the first replica
