"""The reference trainer runs interleaved 1F1B (virtual pipeline stages) on real processes over gloo.

Each rank holds several chunks of layers and runs Megatron-LM's interleaved
order (:func:`hetctl.plan.interleave.schedule_interleaved`); micro-batches
cross from the last stage back to the first between chunks. Against a
single-rank run of the same model, data and global batch (8 sequences: 4
micro-batches of 2) the losses must agree within float32 rounding — relative
1e-4, absolute 1e-5 over 20 AdamW steps, the tolerance the data-parallel runs
are held to in tests/test_train.py; every chunk's backwards run in micro-batch
order, so in practice they agree bit for bit, and the test reports that too.
A kill -9 and a restart from the last checkpoint is bit-identical to the same
plan's undisturbed run, and a checkpoint written under the interleaved plan
loads under a plain split.
"""

from __future__ import annotations

import signal

import pytest

from hetctl.files.plan import Estimate, Parallel, Plan, Rank, Stage
from hetctl.node import manifest as checkpoint
from hetctl.node.runtime import RankContext
from hetctl.plan.rankenv import static_env
from hetctl.train.topology import topology
from tests.helpers.rankrunner import TINY, Ranks, run_plan, tiny_plan

torch = pytest.importorskip("torch")

STEPS = 20


def interleaved_plan(chunks: list[list[tuple[int, int]]], micro_batches: int = 4, group: int | None = None,
                     micro_batch: int = 2) -> dict:
    """One replica whose stage ``s`` holds the layer ranges ``chunks[s]`` (one per virtual stage)."""
    spec = Plan.model_fields["model"].annotation(**TINY)
    pp, v = len(chunks), len(chunks[0])
    stages = [Stage(replica=0, stage=s, node=f"n{s}", vendor="cpu", chips=[], tp=1, layers=row[0], chunks=row,
                    precision="fp32", backend="gloo", backend_next="gloo" if s < pp - 1 else None, device_type="cpu")
              for s, row in enumerate(chunks)]
    ranks = [Rank(rank=s, node=f"n{s}", local_rank=0, stage=s, replica=0) for s in range(pp)]
    plan = Plan(model=spec, parallel=Parallel(pp=pp, dp=1, tp=1, micro_batch=micro_batch, micro_batches=micro_batches,
                                              global_batch=micro_batch * micro_batches, virtual_stages=v,
                                              microbatch_group=group),
                nodes=[r.node for r in ranks], stages=stages, ranks=ranks,
                estimate=Estimate(step_time_s=0.0, bubble=0.0, utilization=0.0, tokens_per_s=0.0))
    plan.check_consistency()
    return plan.model_dump(mode="json")


# pp 3 × v 2: virtual stages 0..5 hold one layer each; 4 micro-batches in one group of 4 (Megatron's rule:
# 4 mod 3 is neither 0 nor ≥ 3, so the group is the whole batch).
PP3_V2 = [[(0, 1), (3, 4)], [(1, 2), (4, 5)], [(2, 3), (5, 6)]]
# pp 2 × v 3, uneven chunks as for a fast first rank, and an empty last chunk (it only passes micro-batches on).
PP2_V3 = [[(0, 2), (3, 4), (5, 5)], [(2, 3), (4, 5), (5, 6)]]


def test_rank_environment_and_topology_name_every_chunk(tmp_path):
    plan = Plan.model_validate(interleaved_plan(PP3_V2, group=4))
    env = static_env(plan, 1)
    assert env["HETCTL_LAYERS"] == "1:2" and env["HETCTL_VIRTUAL_LAYERS"] == "1:2,4:5"
    path = tmp_path / "plan.json"
    path.write_text(plan.model_dump_json())
    full = {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "HETCTL_RUN_ID": "r", "HETCTL_ATTEMPT": "0",
            "HETCTL_PLAN": str(path)}
    topo = topology(plan.model_dump(mode="json"), RankContext.from_env(full))
    assert topo.spans == ((1, 2), (4, 5)) and topo.virtual_stages == 2 and topo.microbatch_group == 4
    first = topology(plan.model_dump(mode="json"), RankContext.from_env({**full, **static_env(plan, 0)}))
    assert first.wrap_rank == 2 and first.backend_wrap == "gloo"  # chunk 1 of stage 0 follows stage 2's chunk 0


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """One rank, all six layers, four micro-batches of two: the reference."""
    return run_plan(tiny_plan([6]), tmp_path_factory.mktemp("single"), steps=STEPS)


@pytest.fixture(scope="module")
def interleaved(tmp_path_factory):
    """An interleaved plan's undisturbed run, once per module, saving every 5 steps: held to the single rank, and
    the killed run's twin."""
    runs: dict[str, object] = {}

    def get(name: str, chunks, group: int):
        if name not in runs:
            runs[name] = run_plan(interleaved_plan(chunks, group=group), tmp_path_factory.mktemp(name), steps=STEPS,
                                  ckpt_every=5)
        return runs[name]

    return get


@pytest.mark.e2e
@pytest.mark.parametrize("chunks, group", [(PP3_V2, 4), (PP2_V3, 2)], ids=["pp3-v2", "pp2-v3-empty-chunk"])
def test_interleaved_run_matches_a_single_rank(single, interleaved, tmp_path, chunks, group):
    run = interleaved(f"pp{len(chunks)}-g{group}", chunks, group)
    ours, ref = run.losses(), single.losses()
    assert sorted(ours) == sorted(ref) == list(range(1, STEPS + 1))
    for s in range(1, STEPS + 1):
        assert float(ours[s]) == pytest.approx(float(ref[s]), rel=1e-4, abs=1e-5), s
    print("bit-identical to the single rank:", ours == ref)
    # Layer-granular: the interleaved plan's checkpoint is complete and a plain 2+4 split resumes it.
    assert checkpoint.validate(run.ckpt_dir / "step-10", checkpoint.model_digest(TINY)) == []
    plain = run_plan(tiny_plan([2, 4]), tmp_path / "plain", steps=STEPS, resume_step=10, ckpt_dir=run.ckpt_dir)
    for s in range(11, STEPS + 1):
        assert float(plain.losses()[s]) == pytest.approx(float(ref[s]), rel=1e-4, abs=1e-5), s


@pytest.mark.e2e
def test_interleaved_run_killed_and_resumed_is_bit_identical(interleaved, tmp_path):
    plan = interleaved_plan(PP3_V2, group=4)
    calm = interleaved(f"pp{len(PP3_V2)}-g4", PP3_V2, 4)
    with Ranks(plan, tmp_path / "crash", steps=STEPS, ckpt_every=5) as crashed:
        crashed.start()
        crashed.wait_for_step(2, 12)
        crashed.wait_for_checkpoint(5)
        crashed.kill(0, signal.SIGKILL)  # the first stage, which holds the embedding and the wrap link, dies
        crashed.stop_all()
        assert crashed.procs[0].returncode == -signal.SIGKILL
    seen = crashed.losses()
    assert seen and all(seen[s] == calm.losses()[s] for s in seen)
    found = checkpoint.latest_valid(crashed.ckpt_dir, checkpoint.model_digest(TINY))
    assert found is not None and found[0] < STEPS
    resumed = run_plan(plan, tmp_path / "crash", steps=STEPS, ckpt_every=5, attempt=2, resume_step=found[0])
    assert resumed.losses() == {s: calm.losses()[s] for s in range(found[0] + 1, STEPS + 1)}
