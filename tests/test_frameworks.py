"""The rendered scripts, checked by the frameworks' own code (issue 15).

Each node script is run by real bash, every rank at once, with the framework's
code standing where the training script would be (``tests/helpers/framework_check.py``
for Megatron-LM and FlagScale, ``tests/helpers/deepspeed_check.py`` for DeepSpeed):
Megatron's ``parse_args``/``validate_args``, its rank generator and layout
parser; FlagScale's hetero checks, ``RankMapper`` and ``ParallelContext`` over
gloo; DeepSpeed's ``init_distributed`` over gloo, topology, grid, config and
``PipelineModule`` partition. Each rank must land on the stage, replica and
layers of ``plan.yaml``, and tp·pp·dp must equal WORLD_SIZE. The training
loops need CUDA and are not run.

Needs the ``frameworks`` extra (``pip install -e '.[frameworks]'``) and
FlagScale, whose wheel pins another torch: ``pip install --no-deps
flag-scale==0.8.0`` (its wheel carries its patched Megatron-LM, the only
Megatron-LM training code on PyPI). Skipped, saying which, when absent.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hetctl.files.run import LaunchOptions
from hetctl.plan.planner import plan_cluster
from hetctl.plan.fwlayout import framework_rank, meshes
from hetctl.plan.render import write_plan_dir
from hetctl.files.plan import Plan
from hetctl.plan.candidates import Pins
from hetctl.files.cluster import Cluster
from tests.test_plan_invariants import SMALL, node

HERE = Path(__file__).parent


def _flag_scale_dir() -> Path | None:
    spec = importlib.util.find_spec("flag_scale")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(list(spec.submodule_search_locations)[0])
    return root if (root / "third_party/Megatron-LM/megatron/training/arguments.py").exists() else None


FLAG_SCALE = _flag_scale_dir()
needs_flagscale = pytest.mark.skipif(
    FLAG_SCALE is None, reason="FlagScale not installed (pip install --no-deps flag-scale==0.8.0): it carries "
    "the Megatron-LM training code (parse_args, validate_args) and FlagScale's hetero checks")
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason="DeepSpeed not installed (pip install -e '.[frameworks]')")
needs_mcore = pytest.mark.skipif(importlib.util.find_spec("megatron") is None
                                 or importlib.util.find_spec("megatron.core") is None,
                                 reason="megatron-core not installed (pip install -e '.[frameworks]')")


def a100s(nodes: int, chips: int) -> list:
    return [node(f"gpu-{i}", "nvidia", "NVIDIA A100-SXM4-80GB", chips, 80.0, 312.0, 312.0) for i in range(nodes)]


def free_port() -> int:
    """A free port for a rendezvous, below the ephemeral range (as hetctl's pre-flight picks one)."""
    from hetctl.node.preflight import rendezvous_port

    return rendezvous_port()


def run_plan(tmp_path: Path, plan: Plan, env: dict[str, str], args: list[str]) -> dict[int, dict]:
    """Run every node script of the plan at once (all ranks meet over gloo); the checkers' records by rank."""
    out = tmp_path / "out"
    out.mkdir()
    written = write_plan_dir(plan, tmp_path / "plan")
    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
            "HETCTL_HEARTBEAT_DIR": str(tmp_path / "hb"), "HETCTL_CKPT_DIR": str(tmp_path / "ckpt"),
            "HETCTL_STEPS": "20", "HETCTL_CKPT_EVERY": "5", "CHECK_OUT": str(out), **env}
    procs = [subprocess.Popen(["bash", str(p), *args], env=base, cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, start_new_session=True) for p in written[1:]]
    try:
        logs = [p.communicate(timeout=400)[0].decode(errors="replace") for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    return {int(f.stem.split("-")[1]): json.loads(f.read_text()) for f in out.glob("rank-*.json")}


def megatron_python(tmp_path: Path) -> Path:
    """``HETCTL_PYTHON`` for Megatron/FlagScale scripts: this Python running the framework checker."""
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} {HERE / "helpers" / "framework_check.py"} "$CHECK_OUT" "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def check_ranks(plan: Plan, records: dict[int, dict]) -> None:
    """Every rank where plan.yaml puts it, by the framework's own account."""
    world = len(plan.ranks)
    assert sorted(records) == list(range(world))
    mesh_list = meshes(plan, by_type=plan.framework == "flagscale")
    for r in plan.ranks:
        rec = records[framework_rank(plan, r, mesh_list)]
        stage = plan.stages_of(r.replica)[r.stage]
        assert (rec["stage"], rec["replica"]) == (r.stage, r.replica)
        assert tuple(rec["layers"]) == tuple(stage.layers)
        assert rec["tp_rank"] == stage.chips.index(r.chip)


# Mock data from the script's arguments; gloo, and no fused RoPE (Transformer Engine), on this CPU machine.
CPU_ARGS = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(SMALL.vocab_size),
            "--distributed-backend", "gloo", "--no-rope-fusion"]


@needs_mcore
def test_megatron_core_parses_every_rendered_layout(tmp_path):
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    from tests.test_plan_render import run_scripts

    for i, (nodes, chips) in enumerate([(2, 2), (3, 4), (1, 8)]):
        plan = plan_cluster(Cluster(nodes=a100s(nodes, chips)), SMALL, global_batch=32, framework="megatron",
                            homogeneous=False)
        run = tmp_path / str(i)
        run.mkdir()
        records, codes = run_scripts(run, plan)
        assert set(codes) == {0}
        for r in plan.ranks:
            argv = records[framework_rank(plan, r)]["argv"]
            pp = int(argv[argv.index("--pipeline-model-parallel-size") + 1])
            layout = PipelineParallelLayerLayout(argv[argv.index("--pipeline-model-parallel-layout") + 1], pp)
            layout.validate_layer_layout(num_layers=SMALL.num_layers, mtp_num_layers=0)
            ids = layout.get_layer_id_list(pp_rank=r.stage)
            assert (ids[0], ids[-1] + 1) == tuple(plan.stages_of(r.replica)[r.stage].layers)


@needs_mcore
def test_megatron_core_parses_the_interleaved_layout(tmp_path):
    """An interleaved plan's layout has pp × v segments; Megatron's parser gives each rank its chunks."""
    from megatron.core import parallel_state
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    from tests.test_plan_render import run_scripts

    plan = plan_cluster(Cluster(nodes=a100s(2, 4)), SMALL, global_batch=32, framework="megatron", homogeneous=False)
    v = plan.parallel.virtual_stages
    assert v > 1, "interleaving is faster here and Megatron runs it"
    records, codes = run_scripts(tmp_path, plan)
    assert set(codes) == {0}
    parallel_state.set_virtual_pipeline_model_parallel_world_size(v)
    try:
        for r in plan.ranks:
            argv = records[framework_rank(plan, r)]["argv"]
            pp = int(argv[argv.index("--pipeline-model-parallel-size") + 1])
            layout = PipelineParallelLayerLayout(argv[argv.index("--pipeline-model-parallel-layout") + 1], pp)
            layout.validate_layer_layout(num_layers=SMALL.num_layers, mtp_num_layers=0)
            assert layout.virtual_pipeline_model_parallel_size == v
            stage = plan.stages_of(r.replica)[r.stage]
            for c, (a, b) in enumerate(stage.chunks):
                assert layout.get_layer_id_list(pp_rank=r.stage, vp_stage=c) == list(range(a, b))
            group = plan.parallel.microbatch_group
            if group != pp:
                assert argv[argv.index("--microbatch-group-size-per-virtual-pipeline-stage") + 1] == str(group)
    finally:
        parallel_state.set_virtual_pipeline_model_parallel_world_size(None)


def test_frameworks_that_cannot_interleave_never_get_it_and_refuse_an_interleaved_plan(tmp_path):
    from hetctl.errors import ConfigError
    from hetctl.plan.frameworks import CAPABILITIES

    interleaved = plan_cluster(Cluster(nodes=a100s(2, 4)), SMALL, global_batch=32, framework="megatron",
                               homogeneous=False)
    assert interleaved.parallel.virtual_stages > 1
    for fw in ("flagscale", "deepspeed"):
        assert not CAPABILITIES[fw].interleave
        plan = plan_cluster(Cluster(nodes=a100s(2, 4)), SMALL, global_batch=32, framework=fw, homogeneous=False)
        assert plan.parallel.virtual_stages == 1 and all(not s.chunks for s in plan.stages)
        with pytest.raises(ConfigError, match="interleaved 1F1B"):
            write_plan_dir(interleaved.model_copy(update={"framework": fw}), tmp_path / fw)


@pytest.mark.e2e
@pytest.mark.timeout(900)
@needs_flagscale
def test_megatron_accepts_an_interleaved_plan(tmp_path):
    """Megatron-LM's own parse_args/validate_args take the virtual stages from the rendered layout."""
    plan = plan_cluster(Cluster(nodes=a100s(2, 4)), SMALL, global_batch=32, framework="megatron", homogeneous=False)
    assert plan.parallel.virtual_stages > 1
    env = {"HETCTL_PYTHON": str(megatron_python(tmp_path)), "MEGATRON_DIR": str(FLAG_SCALE / "third_party/Megatron-LM"),
           "PYTHONPATH": f"{FLAG_SCALE}:{FLAG_SCALE / 'third_party/Megatron-LM'}"}
    records = run_plan(tmp_path, plan, env, CPU_ARGS)
    check_ranks(plan, records)
    for rec in records.values():
        assert rec["vpp"] == plan.parallel.virtual_stages
        assert rec["tp"] * rec["pp"] * rec["dp"] == rec["world_size"] == len(plan.ranks)


@pytest.mark.e2e
@pytest.mark.timeout(900)
@needs_flagscale
def test_megatron_accepts_the_rendered_scripts_and_places_every_rank(tmp_path):
    plan = plan_cluster(Cluster(nodes=a100s(2, 2)), SMALL, global_batch=16, framework="megatron", homogeneous=False,
                        pins=Pins(tp=2))
    env = {"HETCTL_PYTHON": str(megatron_python(tmp_path)), "MEGATRON_DIR": str(FLAG_SCALE / "third_party/Megatron-LM"),
           # FlagScale's Megatron-LM imports flagscale: its root goes on the path too.
           "PYTHONPATH": f"{FLAG_SCALE}:{FLAG_SCALE / 'third_party/Megatron-LM'}"}
    records = run_plan(tmp_path, plan, env, CPU_ARGS)
    check_ranks(plan, records)
    for rec in records.values():
        assert rec["tp"] * rec["pp"] * rec["dp"] == rec["world_size"] == len(plan.ranks)
        assert (rec["train_iters"], rec["save_interval"], rec["ckpt_format"]) == (20, 5, "torch_dist")
        assert rec["save"] == rec["load"] == str(tmp_path / "ckpt") and rec["lr"] > 0


@pytest.mark.e2e
@pytest.mark.timeout(900)
@needs_flagscale
def test_flagscale_accepts_the_rendered_hetero_scripts_and_places_every_rank(tmp_path):
    # Four Ascend chips: FlagScale plans no one-stage mesh past the first (it would number its layers from 0).
    cluster = Cluster(nodes=[node("gpu-a", "nvidia", "NVIDIA A100-SXM4-80GB", 4, 80.0, 312.0, 312.0),
                             node("npu-b", "ascend", "910B2C", 4, 64.0, 376.0, 376.0)])
    plan = plan_cluster(cluster, SMALL, global_batch=16, framework="flagscale", homogeneous=False, pins=Pins(dp=2))
    assert len({s.tp for s in plan.stages}) > 1, "two meshes with different TP degrees"
    assert [m.stages for m in meshes(plan)] == [1, 2], "a one-stage mesh first: its layers start at 0 anyway"
    records = run_plan(tmp_path, plan, {"HETCTL_PYTHON": str(megatron_python(tmp_path)),
                                        "FLAGSCALE_DIR": str(FLAG_SCALE), "HETCTL_RESUME_STEP": "10"}, CPU_ARGS)
    check_ranks(plan, records)
    mesh_list = meshes(plan)
    assert sum(tp * cp * dp * pp for tp, cp, ep, dp, pp in records[0]["meshes"]) == len(plan.ranks)
    for r in plan.ranks:
        rank = framework_rank(plan, r, mesh_list)
        rec = records[rank]
        stage = plan.stages_of(r.replica)[r.stage]
        assert rec["logical_rank"] == rank and rec["tp"] == stage.tp and rec["dp"] == plan.parallel.dp
        assert rec["device_type"] == next(m.label for m in mesh_list if m.first <= r.stage < m.first + m.stages)
        assert rec["save"] == str(tmp_path / "ckpt")
        assert rec["ckpt_step"] == 10 and rec["optim_fully_reshardable"]  # the resume flags, as FlagScale parses them


@pytest.mark.e2e
@pytest.mark.timeout(900)
@needs_deepspeed
def test_deepspeed_accepts_the_rendered_scripts_and_places_every_rank(tmp_path):
    plan = plan_cluster(Cluster(nodes=a100s(2, 2)), SMALL, global_batch=16, framework="deepspeed", homogeneous=False)
    tp, pp = plan.stages[0].tp, plan.parallel.pp
    env = {"HETCTL_PYTHON": sys.executable, "HETCTL_SCRIPT": str(HERE / "helpers" / "deepspeed_check.py")}
    args = ["--out", str(tmp_path / "out"), "--tp", str(tp), "--pp", str(pp), "--num-layers", str(SMALL.num_layers)]
    records = run_plan(tmp_path, plan, env, args)
    check_ranks(plan, records)
    par = plan.parallel
    for rec in records.values():
        assert rec["world"] == tp * pp * par.dp == len(plan.ranks)
        assert (rec["train_batch_size"], rec["micro_batch"], rec["grad_acc"]) == \
            (par.global_batch, par.micro_batch, par.micro_batches)
        assert rec["local_rank"] == rec["env_local_rank"]


def launch_check(tmp_path: Path, plan: Plan, env: dict[str, str], args: list[str]) -> tuple[dict, list[str]]:
    """``hetctl launch``'s argument check for the node of the plan's rank 0, run through the local transport.

    Returns its answer and the argv the same rank gets on a restart (``HETCTL_RESUME_STEP`` set, as in the
    check), from the rank's own command with a python that prints its arguments.
    """
    from hetctl.files.inventory import Node
    from hetctl.launch import fwargs
    from hetctl.launch.controller import AttemptRequest
    from hetctl.launch.materialize import materialize
    from hetctl.remote.local import LocalTransport

    printer = tmp_path / "print-argv"
    printer.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[2:]))\n")
    printer.chmod(0o755)
    nodes = {n: Node(name=n, host="localhost", transport="local", python=sys.executable, workdir=str(tmp_path),
                     env=env) for n in plan.nodes}
    req = AttemptRequest(plan=plan, attempt=0, ckpt_dir=str(tmp_path / "ckpt"),
                         options=LaunchOptions(steps=20, checkpoint_every=5, script_args=tuple(args)))
    name = min(plan.ranks, key=lambda r: r.rank).node
    t = LocalTransport(nodes[name])
    argv, check_env = fwargs.command(req, nodes, name, str(tmp_path), "run-1", hetctl_found=True)
    res = t.run(argv, env=check_env, cwd=str(tmp_path), timeout=600, check=False)
    assert fwargs.problem(plan.framework, res.stdout, res.stderr, res.exit_code, args) is None, res.stderr[-3000:]
    answer = json.loads(res.stdout.strip().splitlines()[-1])
    spec = materialize(plan, nodes, run_id="run-1", attempt=1, master_addr="127.0.0.1", master_port=0,
                       options=LaunchOptions(steps=20, checkpoint_every=5, script_args=tuple(args)), resume_step=1,
                       ckpt_dir=str(tmp_path / "ckpt"),
                       workdirs={name: str(tmp_path)})
    rank = spec.node(name).ranks[0]
    res = t.run(list(rank.argv), env={**rank.env, "HETCTL_PYTHON": str(printer)}, cwd=str(tmp_path), timeout=60)
    return answer, json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.e2e
@pytest.mark.timeout(900)
@needs_flagscale
def test_the_installed_megatron_lm_accepts_every_rendered_plans_exact_argv_in_launchs_check(tmp_path):
    """Plain, tensor-parallel, interleaved and FlagScale hetero plans, with and without --args: the node's own
    parse_args (FlagScale's Megatron-LM) takes the very argv a rank runs, resume flags included."""
    mlm = FLAG_SCALE / "third_party/Megatron-LM"
    megatron_env = {"MEGATRON_DIR": str(mlm), "PYTHONPATH": f"{FLAG_SCALE}:{mlm}"}
    hetero = Cluster(nodes=[node("gpu-a", "nvidia", "NVIDIA A100-SXM4-80GB", 4, 80.0, 312.0, 312.0),
                            node("npu-b", "ascend", "910B2C", 2, 64.0, 376.0, 376.0)])
    cases = [
        (plan_cluster(Cluster(nodes=a100s(2, 2)), SMALL, global_batch=16, framework="megatron", homogeneous=False,
                      pins=Pins(tp=2)), megatron_env, CPU_ARGS),
        (plan_cluster(Cluster(nodes=a100s(2, 4)), SMALL, global_batch=32, framework="megatron", homogeneous=False),
         megatron_env, []),
        (plan_cluster(hetero, SMALL, global_batch=16, framework="flagscale", homogeneous=False, pins=Pins(dp=2)),
         {"FLAGSCALE_DIR": str(FLAG_SCALE)}, CPU_ARGS),
    ]
    assert cases[1][0].parallel.virtual_stages > 1
    for i, (plan, env, args) in enumerate(cases):
        d = tmp_path / str(i)
        d.mkdir()
        answer, rank_argv = launch_check(d, plan, env, args)
        assert answer["ok"] and answer["megatron"] == str(mlm)
        assert answer["argv"] == rank_argv
        rendered = rank_argv[:len(rank_argv) - len(args)] if args else rank_argv
        assert {"--ckpt-format", "--dist-ckpt-optim-fully-reshardable", "--ckpt-step"} <= set(rendered)
        assert ("--pipeline-model-parallel-layout" in rendered) == (plan.framework == "megatron")
        assert ("--mock-data" in rendered) == (not args)  # the script's own default without --args


def test_a_refusal_says_who_passed_each_flag_and_which_release_has_it():
    from hetctl.launch.fwargs import problem

    argv = ["--num-layers", "8", "--pipeline-model-parallel-layout", "E,t*4|t*4,L", "--ckpt-step", "3",
            "--lr", "3e-4", "--mock-data", "--lr", "x", "--typo", "1"]
    user = ["--mock-data", "--lr", "x", "--typo", "1"]

    def answer(message: str, framework: str = "megatron", args: list[str] = user) -> str:
        report = {"script": "/opt/mlm/pretrain_gpt.py", "megatron": "/opt/mlm", "argv": argv, "rejected": message}
        line, hint = problem(framework, json.dumps(report), "", 0, args)
        what = {"megatron": "Megatron-LM", "flagscale": "FlagScale's Megatron-LM"}[framework]
        assert line == f"{what} at /opt/mlm rejects the ranks' arguments: {message}"
        return hint

    assert answer("unrecognized arguments: --pipeline-model-parallel-layout E,t*4|t*4,L --ckpt-step 3 --typo 1") == (
        "hetctl renders --pipeline-model-parallel-layout (new in Megatron-LM core_v0.13.0) and --ckpt-step (new in "
        "core_v0.6.0, passed when resuming): update Megatron-LM on the node to core_v0.13.0 or later; "
        "--typo comes from --args: fix --args")
    assert answer("argument --lr: invalid float value: 'x'") == "--lr comes from --args: fix --args"
    assert answer("unrecognized arguments: --mock-data", args=[]) == \
        "hetctl renders --mock-data (new in Megatron-LM core_v0.5.0): update Megatron-LM on the node to core_v0.5.0 " \
        "or later"
    assert answer("unrecognized arguments: --num-layers 8", "flagscale") == \
        "hetctl renders --num-layers: update FlagScale (its third_party/Megatron-LM) on the node"
    # no answer in time: the ranks' own parse decides; an answer of import trouble is one line with what to do
    assert problem("megatron", "", "hetctl: timed out after 120 s", 124) is None
    line, hint = problem("flagscale", json.dumps({"script": "/fs/flagscale/train/train_gpt.py",
                                                  "import": "ModuleNotFoundError: No module named 'torch'"}), "", 0)
    assert line == "FlagScale's Megatron-LM at /fs cannot be imported by the ranks' python: ModuleNotFoundError: " \
        "No module named 'torch'" and "FLAGSCALE_DIR" in hint
