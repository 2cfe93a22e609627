"""The reference trainer on real processes: gloo over loopback, real checkpoints, real signals.

The undisturbed PP=3 run is the reference every other run is compared with:
a run killed mid-way and resumed, a different split, a checkpoint loaded into a
different split, and a data-parallel run of the same global batch.
"""

from __future__ import annotations

import json
import re
import signal

import pytest

from hetctl.errors import ConfigError
from hetctl.node import manifest as checkpoint
from hetctl.node.runtime import TRAIN_ENV, RankContext, load_plan, read_heartbeat, write_heartbeat
from hetctl.train.topology import topology
from tests.helpers.rankrunner import TINY, Ranks, run_plan, tiny_plan

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.e2e  # real torch training processes over gloo

STEPS, EVERY = 40, 10


def rank_env(plan_path, rank=0, world=1, stage=0, replica=0, layers="0:6", **extra):
    env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "HETCTL_RUN_ID": "r1", "HETCTL_ATTEMPT": "1",
           "HETCTL_PLAN": str(plan_path), "HETCTL_STAGE": str(stage), "HETCTL_REPLICA": str(replica),
           "HETCTL_LAYERS": layers, "HETCTL_DEVICE_TYPE": "cpu", "HETCTL_BACKEND": "gloo"}
    env.update(extra)
    return env


# --- hetctl.node.runtime ----------------------------------------------------------------


def test_context_from_env_reads_the_contract(tmp_path):
    ctx = RankContext.from_env(rank_env(tmp_path / "plan.json", rank=2, world=4, stage=1, replica=1, layers="2:5",
                                        HETCTL_RESUME_STEP="20", HETCTL_HEARTBEAT_FILE=str(tmp_path / "hb"),
                                        HETCTL_STEPS="100"))
    assert (ctx.rank, ctx.world_size, ctx.stage, ctx.replica, ctx.layers) == (2, 4, 1, 1, (2, 5))
    assert ctx.resume_step == 20 and ctx.steps == 100 and ctx.ckpt_dir is None
    assert RankContext.from_env(rank_env("p", HETCTL_RESUME_STEP="0")).resume_step is None
    for name in ("RANK", "HETCTL_PLAN", "HETCTL_LAYERS", "HETCTL_DEVICE_TYPE"):
        assert name in TRAIN_ENV


@pytest.mark.parametrize("change, needle", [
    ({"HETCTL_LAYERS": None}, "HETCTL_LAYERS is not set"),
    ({"HETCTL_LAYERS": "5-9"}, "HETCTL_LAYERS='5-9' is not 'start:end'"),
    ({"HETCTL_LAYERS": "6:2"}, "start <= end"),
    ({"RANK": "4"}, "RANK=4 is not below WORLD_SIZE=1"),
    ({"MASTER_PORT": "x"}, "MASTER_PORT='x' is not an integer"),
    ({"HETCTL_DEVICE_TYPE": "tpu"}, "HETCTL_DEVICE_TYPE='tpu' is not one of"),
])
def test_context_names_the_bad_variable(change, needle):
    env = {k: v for k, v in {**rank_env("p"), **change}.items() if v is not None}
    with pytest.raises(ConfigError, match=re.escape(needle)):
        RankContext.from_env(env)


def test_heartbeat_is_atomic_json(tmp_path):
    hb = tmp_path / "hb.json"
    for step in range(50):
        write_heartbeat(hb, step, loss=1.5, step_ms=3.0)
    data = read_heartbeat(hb)
    assert data["step"] == 49 and data["loss"] == 1.5 and data["time"] > 0
    assert [p.name for p in tmp_path.iterdir()] == ["hb.json"]  # no temp files left behind
    assert read_heartbeat(tmp_path / "none.json") is None
    write_heartbeat(tmp_path / "hb" / "rank-3.json", 0, phase="ready")  # the folder appears on first write
    assert read_heartbeat(tmp_path / "hb" / "rank-3.json")["phase"] == "ready"


def test_load_plan_json_and_yaml(tmp_path):
    plan = tiny_plan([3, 3])
    (tmp_path / "p.json").write_text(json.dumps(plan))
    import yaml

    (tmp_path / "p.yaml").write_text(yaml.safe_dump(plan))
    assert load_plan(tmp_path / "p.json") == load_plan(tmp_path / "p.yaml") == plan
    (tmp_path / "bad.json").write_text("{nope")
    with pytest.raises(ConfigError, match=r"bad.json:1: not valid JSON"):
        load_plan(tmp_path / "bad.json")


# --- topology and schedule (pure) ------------------------------------------------------


def test_topology_neighbours_and_dp_groups(tmp_path):
    plan = tiny_plan([1, 3, 2], dp=2, micro_batches=2)
    ctx = RankContext.from_env(rank_env(tmp_path / "p.json", rank=4, world=6, stage=1, replica=1, layers="1:4"))
    topo = topology(plan, ctx)
    assert (topo.prev_rank, topo.next_rank) == (3, 5)
    assert topo.dp_groups == ((0, 3), (1, 4), (2, 5)) and topo.dp_group == (1, 4)
    assert not topo.is_first and not topo.is_last and topo.backend_next == "gloo"


@pytest.mark.parametrize("mutate, needle", [
    (lambda p: p["stages"][1].update(layers=[3, 6]), "does not follow 2"),
    (lambda p: p["stages"][1].update(tp=2), r"stages\[replica=0, stage=1\].tp=2 but ranks\[\] has 1 ranks"),
    (lambda p: p["parallel"].update(global_batch=7), "global_batch=7 is not"),
    (lambda p: p["ranks"].pop(), "plan has 2 ranks but WORLD_SIZE=3"),
])
def test_topology_refuses_inconsistent_plans(tmp_path, mutate, needle):
    plan = tiny_plan([2, 2, 2])
    mutate(plan)
    ctx = RankContext.from_env(rank_env(tmp_path / "p.json", rank=0, world=3, layers="0:2"))
    with pytest.raises(ConfigError, match=needle):
        topology(plan, ctx)


def test_topology_catches_stale_layers(tmp_path):
    ctx = RankContext.from_env(rank_env(tmp_path / "p.json", rank=1, world=3, stage=1, layers="2:5"))
    with pytest.raises(ConfigError, match="has layers 2:4 but HETCTL_LAYERS=2:5"):
        topology(tiny_plan([2, 2, 2]), ctx)


@pytest.mark.parametrize("stages, micro", [(1, 4), (3, 4), (4, 2), (3, 8)])
def test_1f1b_schedule(stages, micro):
    from hetctl.train.pipeline import schedule_1f1b

    for s in range(stages):
        ops = schedule_1f1b(s, stages, micro)
        assert sorted(ops) == sorted([("F", m) for m in range(micro)] + [("B", m) for m in range(micro)])
        assert [m for op, m in ops if op == "F"] == list(range(micro))
        assert [m for op, m in ops if op == "B"] == list(range(micro))
        in_flight = peak = 0
        for op, _ in ops:
            in_flight += 1 if op == "F" else -1
            peak = max(peak, in_flight)
        assert peak == min(stages - s, micro)  # 1F1B's memory bound, not GPipe's M


# --- real runs -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """The undisturbed reference: PP=3 (2+2+2 layers), DP=1, 4 micro-batches of 2, 40 steps, checkpoint every 10."""
    return run_plan(tiny_plan([2, 2, 2]), tmp_path_factory.mktemp("baseline"), steps=STEPS, ckpt_every=EVERY)


def test_pp3_trains_and_checkpoints(baseline):
    losses = baseline.losses()
    assert sorted(losses) == list(range(1, STEPS + 1))
    first, last = [float(losses[s]) for s in range(1, 6)], [float(losses[s]) for s in range(STEPS - 4, STEPS + 1)]
    assert sum(last) / 5 < 0.8 * sum(first) / 5, (first, last)  # from ln 256 = 5.5 to about 3.5
    notes = lambda r: [ln for ln in baseline.stdout(r).splitlines() if not ln.startswith("checkpoint: ")]  # noqa: E731
    assert notes(0) == notes(1) == []  # only the last stage prints steps; every rank notes its saves
    final = baseline.heartbeat(2)
    assert final["done"] and final["step"] == STEPS and f"{final['loss']:.9g}" == losses[STEPS]
    assert all(baseline.heartbeat(r)["done"] for r in (0, 1))
    ckpt = baseline.ckpt_dir
    assert [s for s, _ in checkpoint.steps(ckpt)] == [40, 30, 20, 10]
    digest = checkpoint.model_digest(TINY)
    for _, path in checkpoint.steps(ckpt):
        assert checkpoint.validate(path, digest) == []
    man = checkpoint.read_manifest(ckpt / "step-20")
    assert set(man["files"]) == {"embedding.pt", "head.pt", "state.json"} | {f"layer-{i:05d}.pt" for i in range(6)}
    assert json.loads((ckpt / "step-20" / "state.json").read_text())["data"]["next_step"] == 21
    assert checkpoint.latest_valid(ckpt, digest) == (40, ckpt / "step-40")


def test_rank_killed_then_resumed_is_bit_identical(baseline, tmp_path):
    with Ranks(tiny_plan([2, 2, 2]), tmp_path, steps=STEPS, ckpt_every=EVERY) as crashed:
        crashed.start()
        hb = crashed.wait_for_step(2, 23)
        assert {"loss", "step_ms", "compute_ms", "stage", "replica"} <= set(hb) and hb["compute_ms"] <= hb["step_ms"]
        crashed.wait_for_checkpoint(20)  # the step-20 save is asynchronous: under load it commits after step 23
        crashed.kill(1, signal.SIGKILL)  # the middle stage dies mid-run
        crashed.stop_all()
        assert crashed.procs[1].returncode == -signal.SIGKILL
    seen = crashed.losses()
    assert seen and all(seen[s] == baseline.losses()[s] for s in seen)
    found = checkpoint.latest_valid(crashed.ckpt_dir, checkpoint.model_digest(TINY))
    assert found is not None and 20 <= found[0] < STEPS
    resumed = run_plan(tiny_plan([2, 2, 2]), tmp_path, steps=STEPS, ckpt_every=EVERY, attempt=2,
                       resume_step=found[0])
    expected = {s: baseline.losses()[s] for s in range(found[0] + 1, STEPS + 1)}
    assert resumed.losses() == expected
    assert resumed.heartbeat(2)["loss"] == baseline.heartbeat(2)["loss"]
    assert [resumed.stderr(r) for r in range(3)] == ["", "", ""]  # same seed, batch and optimizer: no warning


def test_async_saves_write_what_blocking_saves_write(baseline, tmp_path, monkeypatch):
    """Every checkpoint file is byte for byte the blocking save's, though training ran on while it was written."""
    blocking = run_plan(tiny_plan([2, 2, 2]), tmp_path / "blocking", steps=STEPS, ckpt_every=EVERY,
                        args=("--save-mode", "blocking"))
    # Test-only: the background write of step 20 pauses before serializing its snapshot, so the
    # live weights have moved on by then; a snapshot that were not a copy would write theirs.
    monkeypatch.setenv("HETCTL_TEST_SAVE_DELAY", "20:1.5")
    slow = run_plan(tiny_plan([2, 2, 2]), tmp_path / "slow", steps=STEPS, ckpt_every=EVERY)
    assert blocking.losses() == baseline.losses() == slow.losses()
    assert blocking.heartbeat(2)["loss"] == slow.heartbeat(2)["loss"] == baseline.heartbeat(2)["loss"]
    for r in range(3):
        assert blocking.heartbeat(r)["save_mode"] == "blocking" and blocking.heartbeat(r)["saves"] == STEPS // EVERY
        assert slow.heartbeat(r)["save_mode"] == baseline.heartbeat(r)["save_mode"] == "async"
    digest = checkpoint.model_digest(TINY)
    for step in range(EVERY, STEPS + 1, EVERY):
        files = [checkpoint.read_manifest(run.ckpt_dir / f"step-{step}")["files"] for run in (blocking, slow, baseline)]
        assert files[0] == files[1] == files[2], step
        assert checkpoint.validate(slow.ckpt_dir / f"step-{step}", digest) == []
    assert "checkpoint: 4 saves (async)" in slow.stdout(0) and "checkpoint: 4 saves (blocking)" in blocking.stdout(0)


def test_other_split_same_dp_is_bit_identical(baseline, tmp_path):
    fresh = run_plan(tiny_plan([4, 2]), tmp_path / "fresh", steps=20)
    assert fresh.losses() == {s: baseline.losses()[s] for s in range(1, 21)}
    single = run_plan(tiny_plan([6]), tmp_path / "single", steps=5)  # no pipeline at all
    assert single.losses() == {s: baseline.losses()[s] for s in range(1, 6)}
    # A checkpoint written by the 2+2+2 split, resumed by a 1+5 split (a re-plan onto fewer nodes).
    replanned = run_plan(tiny_plan([1, 5]), tmp_path / "replan", steps=STEPS, resume_step=20,
                         ckpt_dir=baseline.ckpt_dir)
    assert replanned.losses() == {s: baseline.losses()[s] for s in range(21, STEPS + 1)}


def test_data_parallel_matches_within_float_tolerance(baseline, tmp_path):
    # Same global batch (8) as the baseline: 2 replicas × 2 micro-batches × 2 instead of 1 × 4 × 2.
    dp = run_plan(tiny_plan([3, 3], dp=2, micro_batches=2), tmp_path, steps=20, ckpt_every=10)
    ours, ref = dp.losses(), baseline.losses()
    assert dp.losses(replica=1) == ours  # both replicas report the all-reduced loss
    for s in range(1, 21):
        assert float(ours[s]) == pytest.approx(float(ref[s]), rel=1e-4, abs=1e-5), s
    assert checkpoint.validate(dp.ckpt_dir / "step-20", checkpoint.model_digest(TINY)) == []


def _one_line_error(ranks, needle):
    codes = ranks.wait(120)
    assert set(codes.values()) == {2}, codes
    for r in codes:
        err = ranks.stderr(r)
        assert needle in err and "Traceback" not in err, err


def test_refuses_stages_of_different_tensor_parallel_degrees(tmp_path):
    plan = tiny_plan([3, 3], tp=2)  # stage 0: ranks 0, 1; stage 1 keeps one rank at tp 1
    plan["stages"][1]["tp"] = 1
    plan["ranks"].pop()
    with Ranks(plan, tmp_path, steps=5) as ranks:
        _one_line_error(ranks.start(), "stages have tensor-parallel degrees [1, 2]; the reference trainer runs one "
                        "degree for every stage")


def test_resume_from_missing_or_foreign_checkpoint(baseline, tmp_path):
    with Ranks(tiny_plan([3, 3]), tmp_path / "missing", steps=STEPS, resume_step=15,
               ckpt_dir=baseline.ckpt_dir) as ranks:
        _one_line_error(ranks.start(), "step-15: no manifest.json")
    with Ranks(tiny_plan([3, 3]), tmp_path / "seed", steps=STEPS, resume_step=20, ckpt_dir=baseline.ckpt_dir,
               args=("--seed", "99")) as ranks:
        _one_line_error(ranks.start(), "written with --seed 1234, this run has --seed 99")
    other = tiny_plan([3, 3], model={**TINY, "hidden_size": 32})
    with Ranks(other, tmp_path / "foreign", steps=STEPS, resume_step=20, ckpt_dir=baseline.ckpt_dir) as ranks:
        _one_line_error(ranks.start(), "this plan's model is")


def test_a_verified_file_that_cannot_load_exits_7_with_the_ranks_own_error(baseline, tmp_path):
    """Issue 33, kind 7: the sha256 matches (the manifest was rewritten), the tensors fit no layer."""
    import io
    import shutil

    import torch

    ckpt = tmp_path / "ckpt"
    shutil.copytree(baseline.ckpt_dir / "step-20", ckpt / "step-20")
    layer = ckpt / "step-20" / "layer-00004.pt"  # stage 1's in a 3+3 split
    buf = io.BytesIO()
    torch.save({"params": {"not.a.weight": torch.zeros(3)}, "optim": {}}, buf)
    layer.write_bytes(buf.getvalue())
    man = json.loads((ckpt / "step-20" / checkpoint.MANIFEST).read_text())
    man["files"]["layer-00004.pt"] = checkpoint.file_entry(buf.getvalue())
    (ckpt / "step-20" / checkpoint.MANIFEST).write_text(json.dumps(man))
    assert checkpoint.validate(ckpt / "step-20", checkpoint.model_digest(TINY)) == []
    with Ranks(tiny_plan([3, 3]), tmp_path, steps=STEPS, resume_step=20, ckpt_dir=ckpt) as ranks:
        ranks.start()
        assert ranks.procs[1].wait(120) == 7
        err = ranks.stderr(1)
        assert "hetctl.train: error: checkpoint step 20 cannot be loaded: RuntimeError: " in err, err
        assert "Traceback" not in err


def test_corrupted_file_is_refused_by_the_rank_that_needs_it(baseline, tmp_path):
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(baseline.ckpt_dir / "step-20", ckpt / "step-20")
    layer = ckpt / "step-20" / "layer-00004.pt"  # stage 1's in a 3+3 split
    data = bytearray(layer.read_bytes())
    data[len(data) // 2] ^= 0xFF
    layer.write_bytes(bytes(data))
    with Ranks(tiny_plan([3, 3]), tmp_path, steps=STEPS, resume_step=20, ckpt_dir=ckpt) as ranks:
        ranks.start()
        assert ranks.procs[1].wait(120) == 2
        err = ranks.stderr(1)
        assert "layer-00004.pt: size or sha256 differs from the manifest (corrupted)" in err, err
        assert "Traceback" not in err
        # Rank 0 verified its own files and waits for its peer; the agent would now stop it.
