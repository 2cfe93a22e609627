"""plan/ on disk: the Megatron layout string, framework rank orders, and the node scripts run by real bash.

The scripts are executed with ``HETCTL_PYTHON`` pointing at a stand-in that
records its argv and environment, so each rank's exact launch is checked
against :func:`hetctl.plan.rankenv.rank_env` and the framework's rules.
"""

from __future__ import annotations

import json
import os
import random
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hetctl.plan.models import load_model
from hetctl.plan.planner import plan_cluster
from hetctl.plan.rankenv import rank_env, static_env
from hetctl.plan.fwlayout import framework_rank, megatron_layout, meshes, parse_megatron_layout
from hetctl.plan.render import render_node_scripts, script_name, write_plan_dir
from hetctl.files.plan import Plan
from hetctl.plan.candidates import Pins
from hetctl.files.cluster import Cluster
from hetctl.files.yamlio import load_model as load_yaml_model
from tests.helpers.placement import rendered_anyway
from tests.test_plan_invariants import SMALL, node

CONTRACT = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "HETCTL_RUN_ID", "HETCTL_ATTEMPT", "HETCTL_PLAN", "HETCTL_STAGE", "HETCTL_REPLICA", "HETCTL_LAYERS", "HETCTL_MICRO_BATCHES",
            "HETCTL_TP_RANK", "HETCTL_TP_SIZE", "HETCTL_TP_RANKS",
            "HETCTL_DEVICE_TYPE", "HETCTL_BACKEND", "HETCTL_HEARTBEAT_FILE", "HETCTL_CKPT_DIR",
            "HETCTL_RESUME_STEP", "CUDA_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES")

RECORDER = """#!{python}
import json, os, sys, time
rank = os.environ["RANK"]
keys = {keys!r}
out = {{"argv": sys.argv[1:], "env": {{k: os.environ[k] for k in keys if k in os.environ}}, "cwd": os.getcwd(),
       "pythonpath": os.environ.get("PYTHONPATH", "")}}
if "--deepspeed_config" in sys.argv:  # the script removes its config when it ends: keep a copy
    with open(sys.argv[sys.argv.index("--deepspeed_config") + 1]) as f:
        out["ds_config"] = json.load(f)
with open(os.path.join(os.environ["REC_DIR"], "rank-" + rank + ".json"), "w") as f:
    json.dump(out, f)
if os.environ.get("REC_FAIL") == rank:
    time.sleep(0.5)
    sys.exit(3)
if os.environ.get("REC_FAIL"):
    time.sleep(60)
"""


def test_megatron_layout_has_e_first_l_last_and_parses_back():
    assert megatron_layout([3, 5, 4]) == "E,t*3|t*5|t*4,L"
    assert megatron_layout([7]) == "E,t*7,L"
    assert megatron_layout([1, 1]) == "E,t|t,L"
    rng = random.Random(0)
    for _ in range(200):
        counts = [rng.randint(1, 12) for _ in range(rng.randint(1, 20))]
        assert parse_megatron_layout(megatron_layout(counts)) == counts


def test_layout_parser_follows_megatron_grammar():
    # The example of Megatron-LM's docs: DeepSeek-V3, 61 decoder layers and one MTP layer, PP16 × VPP2.
    counts = parse_megatron_layout("Et*3|(tt|)*29,m|L")
    assert len(counts) == 32 and sum(counts) == 61
    assert parse_megatron_layout("E||t|L") == [0, 0, 1, 0]  # empty stages are legal
    for bad in ("t|L", "E|t", "Ext|L", "EE|t|L"):
        with pytest.raises(ValueError):
            parse_megatron_layout(bad)


def mixed_cluster() -> Cluster:
    return Cluster(nodes=[
        node("gpu-a", "nvidia", "NVIDIA A100-SXM4-80GB", 4, 80.0, 312.0, 312.0),
        node("gpu-b", "nvidia", "NVIDIA A100-SXM4-80GB", 4, 80.0, 312.0, 312.0),
        node("npu-c", "ascend", "910B2C", 4, 64.0, 376.0, 376.0),
    ])


@pytest.fixture(scope="module")
def plans() -> dict[str, Plan]:
    """Each framework's plan on the two-vendor cluster; Megatron's and DeepSpeed's as ``--render-anyway``
    writes them (refused otherwise: test_a_framework_that_cannot_run_a_plan_is_refused_unless_rendered_anyway)."""
    return {fw: rendered_anyway(plan_cluster(mixed_cluster(), SMALL, global_batch=32, framework=fw))
            for fw in ("hetctl", "megatron", "flagscale", "deepspeed", "torchrun")}


def run_scripts(tmp_path: Path, plan: Plan, hosts: dict[str, str] | None = None, fail: int | None = None,
                env: dict[str, str] | None = None, only: str | None = None) -> tuple[dict[int, dict], list[int]]:
    """Render and run the nodes' scripts with the recorder as python; return records by RANK and exit codes."""
    rec = tmp_path / "rec"
    rec.mkdir(exist_ok=True)
    fake = tmp_path / "python"
    fake.write_text(RECORDER.format(python=sys.executable, keys=CONTRACT))
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    written = write_plan_dir(plan, tmp_path / "plan", hosts or {})
    (tmp_path / "FlagScale").mkdir(exist_ok=True)  # FlagScale's scripts run from its folder
    base = {**os.environ, "HETCTL_PYTHON": str(fake), "REC_DIR": str(rec),
            "HETCTL_HEARTBEAT_DIR": str(tmp_path / "hb"), **(env or {})}
    if fail is not None:
        base["REC_FAIL"] = str(fail)
    scripts = [p for p in written[1:] if only is None or p.name == script_name(only)]
    procs = [subprocess.Popen(["bash", str(p)], env=base, cwd=tmp_path, start_new_session=True) for p in scripts]
    try:
        codes = [p.wait(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    records = {int(f.stem.split("-")[1]): json.loads(f.read_text()) for f in rec.glob("rank-*.json")}
    return records, codes


def test_hetctl_scripts_give_each_rank_exactly_rank_env(tmp_path, plans):
    plan = plans["hetctl"]
    launch = {"MASTER_ADDR": "10.9.8.7", "MASTER_PORT": "31337", "HETCTL_RUN_ID": "run-42", "HETCTL_ATTEMPT": "2",
              "HETCTL_PLAN": "/w/plan.json", "HETCTL_CKPT_DIR": "/ckpt/run-42", "HETCTL_RESUME_STEP": "20"}
    records, codes = run_scripts(tmp_path, plan, env=launch)
    assert codes == [0] * len(plan.nodes)
    assert sorted(records) == [r.rank for r in plan.ranks]
    for r in plan.ranks:
        want = rank_env(plan, r, master_addr="10.9.8.7", master_port=31337, run_id="run-42", attempt=2,
                        plan_path="/w/plan.json", heartbeat_file=str(tmp_path / "hb" / f"rank-{r.rank}.json"),
                        ckpt_dir="/ckpt/run-42", resume_step=20)
        got = records[r.rank]
        assert got["env"] == want
        assert got["argv"] == ["-m", "hetctl.train"]
        var = "CUDA_VISIBLE_DEVICES" if plan.stages_of(r.replica)[r.stage].vendor == "nvidia" else \
            "ASCEND_RT_VISIBLE_DEVICES"
        assert want[var] == str(r.chip)


def test_scripts_pass_arguments_and_defaults_serve_a_run_by_hand(tmp_path, plans):
    plan = plans["torchrun"]
    odd = "gpu a'$(touch pwned)"
    records, codes = run_scripts(tmp_path, plan, hosts={plan.ranks[0].node: odd},
                                 env={"HETCTL_SCRIPT": "my train.py"})
    assert set(codes) == {0}
    assert not (tmp_path / "pwned").exists()
    for rec in records.values():
        assert rec["env"]["MASTER_ADDR"] == odd and rec["env"]["MASTER_PORT"] == "29500"
        assert rec["env"]["HETCTL_ATTEMPT"] == "0" and rec["env"]["HETCTL_RESUME_STEP"] == "0"
        assert rec["argv"] == ["my train.py"]


def test_the_first_failing_rank_stops_the_others_and_sets_the_exit_code(tmp_path, plans):
    plan = plans["hetctl"]
    where = next(r.node for r in plan.ranks if r.rank == 1)
    assert len(plan.ranks_on(where)) >= 2
    start = time.monotonic()
    records, codes = run_scripts(tmp_path, plan, fail=1, only=where)
    assert codes == [3]
    assert time.monotonic() - start < 30, "the other ranks (sleeping a minute) were stopped"
    assert sorted(records) == sorted(r.rank for r in plan.ranks_on(where))


def test_megatron_scripts(tmp_path):
    one_vendor = Cluster(nodes=[node(f"gpu-{i}", "nvidia", "NVIDIA A100-SXM4-80GB", 4, 80.0, 312.0, 312.0)
                                for i in range(3)])
    plan = plan_cluster(one_vendor, SMALL, global_batch=32, framework="megatron", homogeneous=False)
    records, codes = run_scripts(tmp_path, plan)
    assert set(codes) == {0} and sorted(records) == list(range(len(plan.ranks)))
    v = plan.parallel.virtual_stages  # one layout segment per virtual stage: chunk c of stage s is c·pp + s
    counts = [b - a for c in range(v) for a, b in (s.chunks[c] if v > 1 else s.layers for s in plan.stages_of(0))]
    tp, dp = plan.stages[0].tp, plan.parallel.dp
    for r in plan.ranks:
        rec = records[framework_rank(plan, r)]
        argv = rec["argv"]
        assert argv[0].endswith("Megatron-LM/pretrain_gpt.py")
        layout = argv[argv.index("--pipeline-model-parallel-layout") + 1]
        assert parse_megatron_layout(layout) == counts
        assert int(argv[argv.index("--pipeline-model-parallel-size") + 1]) == plan.parallel.pp
        assert int(argv[argv.index("--tensor-model-parallel-size") + 1]) == tp
        assert argv[-5:] == ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size",
                             str(SMALL.vocab_size)]  # no arguments given: Megatron's mock data
        stage = plan.stages_of(r.replica)[r.stage]
        tp_idx = stage.chips.index(r.chip)
        assert int(rec["env"]["RANK"]) == tp_idx + tp * (r.replica + dp * r.stage)  # tp, then dp, then pp
        visible = rec["env"]["CUDA_VISIBLE_DEVICES"].split(",")
        assert visible[int(rec["env"]["LOCAL_RANK"])] == str(r.chip)
        assert rec["env"]["HETCTL_LAYERS"] == f"{stage.layers[0]}:{stage.layers[1]}"


def test_flagscale_meshes_and_ranks(tmp_path, plans):
    plan = plans["flagscale"]
    records, codes = run_scripts(tmp_path, plan)
    assert set(codes) == {0} and sorted(records) == list(range(len(plan.ranks)))
    mesh_list = meshes(plan)
    assert sum(m.stages for m in mesh_list) == plan.parallel.pp
    argv = records[0]["argv"]

    def values(flag: str) -> list[str]:
        i = argv.index(flag) + 1
        out = []
        while i < len(argv) and not argv[i].startswith("--"):
            out.append(argv[i])
            i += 1
        return out

    nums = [int(x) for x in values("--hetero-process-meshes")]
    assert len(nums) == 5 * len(mesh_list)
    assert [tuple(nums[i:i + 5]) for i in range(0, len(nums), 5)] == \
        [(m.tp, 1, 1, plan.parallel.dp, m.stages) for m in mesh_list]
    assert values("--hetero-device-types") == [m.label for m in mesh_list]
    split = [int(x) for x in values("--hetero-pipeline-layer-split")]
    assert split == [b - a for a, b in (s.layers for s in plan.stages_of(0))] and sum(split) == SMALL.num_layers
    assert "--hetero-use-cpu-communication" in argv  # two vendors: gloo between them
    for r in plan.ranks:
        rec = records[framework_rank(plan, r, mesh_list)]
        mesh = next(m for m in mesh_list if m.first <= r.stage < m.first + m.stages)
        assert rec["argv"][rec["argv"].index("--hetero-current-device-type") + 1] == mesh.label
        assert rec["env"]["HETCTL_STAGE"] == str(r.stage)


def test_deepspeed_script_writes_a_config_matching_the_plan(tmp_path, plans):
    plan = plans["deepspeed"]
    records, _ = run_scripts(tmp_path, plan)
    argv = records[0]["argv"]
    assert argv[0] == "train.py" and "--deepspeed" in argv and argv[1].startswith("--local_rank=")
    cfg = records[0]["ds_config"]
    assert not Path(argv[argv.index("--deepspeed_config") + 1]).exists(), "the temporary config is removed"
    par = plan.parallel
    assert cfg["train_batch_size"] == par.global_batch
    assert cfg["gradient_accumulation_steps"] == par.micro_batches
    assert cfg["train_batch_size"] == cfg["train_micro_batch_size_per_gpu"] * par.micro_batches * par.dp


def test_framework_ranks_are_a_permutation(plans):
    for fw, plan in plans.items():
        ranks = sorted(framework_rank(plan, r) for r in plan.ranks)
        assert ranks == list(range(len(plan.ranks))), fw


def test_plan_yaml_round_trips_and_odd_node_names_get_safe_file_names(tmp_path, plans):
    plan = plans["hetctl"]
    written = write_plan_dir(plan, tmp_path / "out")
    assert load_yaml_model(written[0], Plan) == plan
    assert all(os.access(p, os.X_OK) for p in written[1:])
    assert script_name("gpu a/../b") == "gpu_a_.._b.sh"


def test_static_env_node_visibility_indexes_with_local_rank(plans):
    plan = plans["flagscale"]
    for r in plan.ranks:
        env = static_env(plan, r, "node")
        var = next(k for k in env if k.endswith("VISIBLE_DEVICES"))
        assert env[var].split(",")[int(env["LOCAL_RANK"])] == str(r.chip)


def test_every_template_renders_for_a_cpu_plan():
    plan = plan_cluster(Cluster(nodes=[node("c1", "cpu", "Xeon", 1, 16.0, None, None, override=0.5),
                                       node("c2", "cpu", "Xeon", 1, 16.0, None, None, override=0.5)]),
                        load_model("tiny"), homogeneous=False)
    for fw in ("hetctl", "megatron", "flagscale", "deepspeed", "torchrun"):
        scripts = render_node_scripts(plan.model_copy(update={"framework": fw}))
        for text in scripts.values():
            assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0, fw
            assert "VISIBLE_DEVICES=" not in text  # CPU ranks have no visible-devices variable


def test_issue15_flagscale_ranks_fit_world_size_and_label_each_chip(tmp_path):
    from tests.test_plan_invariants import issue15_cluster

    plan = plan_cluster(issue15_cluster(4), load_model("llama2-7b"), global_batch=256, framework="flagscale",
                        homogeneous=False)
    records, codes = run_scripts(tmp_path, plan)
    assert set(codes) == {0}
    world = len(plan.ranks)
    assert sorted(records) == list(range(world))
    mesh_list = meshes(plan)
    assert sum(m.tp * plan.parallel.dp * m.stages for m in mesh_list) == world
    for r in plan.ranks:
        rec = records[framework_rank(plan, r, mesh_list)]
        stage = plan.stages_of(r.replica)[r.stage]
        assert rec["env"]["WORLD_SIZE"] == str(world)
        assert (rec["env"]["HETCTL_STAGE"], rec["env"]["HETCTL_REPLICA"]) == (str(r.stage), str(r.replica))
        label = rec["argv"][rec["argv"].index("--hetero-current-device-type") + 1]
        assert label.split("_")[0] == (stage.vendor + stage.model).replace("-", "").replace(" ", "")


def test_a_stage_mixing_chip_types_across_replicas_is_refused_for_flagscale(plans):
    from hetctl.errors import ConfigError

    plan = plans["flagscale"].model_copy(deep=True)
    if plan.parallel.dp < 2:
        plan = plan_cluster(mixed_cluster(), SMALL, global_batch=32, framework="flagscale",
                            pins=Pins(dp=2), homogeneous=False)
    other = next(s for s in plan.stages if s.replica == 1)
    other.model = "Some Other Chip"
    with pytest.raises(ConfigError, match=f"plan stage {other.stage}: replica 0 runs .* but replica 1 runs"):
        render_node_scripts(plan)
    assert meshes(plan, by_type=False)  # frameworks without device types only need the TP degrees to agree


def test_megatron_and_flagscale_defaults_can_start_training(tmp_path):
    # Issue 15 defect 3: the length, a learning rate and the run's checkpoint folder, from the launch variables.
    one_vendor = Cluster(nodes=[node(f"gpu-{i}", "nvidia", "NVIDIA A100-SXM4-80GB", 2, 80.0, 312.0, 312.0)
                                for i in range(2)])
    for fw in ("megatron", "flagscale"):
        plan = plan_cluster(one_vendor, SMALL, global_batch=16, framework=fw, homogeneous=False)
        for every, saves in (("5", True), ("0", False)):
            run = tmp_path / f"{fw}-{every}"
            run.mkdir()
            records, codes = run_scripts(run, plan, env={"HETCTL_STEPS": "7", "HETCTL_CKPT_EVERY": every,
                                                         "HETCTL_CKPT_DIR": "/ckpt/run-1"})
            assert set(codes) == {0}
            for rec in records.values():
                argv = rec["argv"]

                def value(flag: str) -> str:
                    return argv[argv.index(flag) + 1]

                assert value("--train-iters") == "7" and float(value("--lr")) > 0
                assert value("--load") == "/ckpt/run-1" and value("--ckpt-format") == "torch_dist"
                assert ("--save" in argv) == saves
                if saves:
                    assert value("--save") == "/ckpt/run-1" and value("--save-interval") == "5"


def test_flagscale_runs_from_its_folder_with_its_megatron_on_pythonpath(tmp_path, plans):
    # Issue 15 defect 2: FlagScale's own runner does `cd $ROOT; export PYTHONPATH=$ROOT:$ROOT/third_party/Megatron-LM`.
    records, codes = run_scripts(tmp_path, plans["flagscale"], env={"HETCTL_CKPT_DIR": "ckpt", "PYTHONPATH": "/mine"})
    assert set(codes) == {0}
    root = str(tmp_path / "FlagScale")
    for rec in records.values():
        assert rec["cwd"] == root
        assert rec["pythonpath"] == f"{root}:{root}/third_party/Megatron-LM:/mine"
        assert rec["argv"][0] == f"{root}/flagscale/train/train_gpt.py"
        assert rec["env"]["HETCTL_CKPT_DIR"] == str(tmp_path / "ckpt"), "relative paths made absolute before the cd"


def test_deepspeed_plans_deepspeeds_own_split_and_refuses_another(tmp_path, plans):
    from hetctl.errors import ConfigError
    from hetctl.plan.deepspeed_layout import deepspeed_split

    plan = plans["deepspeed"]
    split = [b - a for a, b in (s.layers for s in plan.stages_of(0))]
    assert split == deepspeed_split(SMALL.num_layers, plan.parallel.pp)
    bad = plan.model_copy(deep=True)
    for s in bad.stages:  # move one layer from stage 0 to stage 1
        if s.stage == 0:
            s.layers = (s.layers[0], s.layers[1] - 1)
        elif s.stage == 1:
            s.layers = (s.layers[0] - 1, s.layers[1])
    with pytest.raises(ConfigError, match="PipelineModule partitions only uniform, by parameters or by type:"):
        render_node_scripts(bad)


# DeepSpeed's launcher files: tests/test_placement.py runs DeepSpeed's runner and launch.py on them.


# -- issue 31, part 3: a framework that cannot run a plan is refused, not rendered ----------------------------


@pytest.mark.parametrize("fw", ["megatron", "deepspeed"])
def test_a_framework_that_cannot_run_a_plan_is_refused_unless_rendered_anyway(tmp_path, fw):
    from hetctl.errors import PlanInfeasible
    from hetctl.plan.render import render_rank_scripts, unrunnable

    plan = plan_cluster(mixed_cluster(), SMALL, global_batch=32, framework=fw, homogeneous=False)
    assert {s.vendor for s in plan.stages} == {"nvidia", "ascend"}
    why = unrunnable(plan)
    assert why.startswith(f"one {fw} job cannot span vendors (ascend, nvidia)")
    assert "use --framework hetctl (or flagscale; torchrun if your script spans vendors)" in why
    for render in (render_node_scripts, render_rank_scripts, lambda p: write_plan_dir(p, tmp_path / "out")):
        with pytest.raises(PlanInfeasible) as e:
            render(plan)
        assert e.value.exit_code == 4 and e.value.message == f"plan: {why}" and "\n" not in e.value.message
    assert not (tmp_path / "out").exists(), "nothing written"
    anyway = plan.model_copy(update={"rendered_anyway": why})
    written = write_plan_dir(anyway, tmp_path / "out")
    assert load_yaml_model(written[0], Plan).rendered_anyway == why
    for script in written[1:]:  # the scripts say so at the top
        assert "# WARNING: {} cannot run this plan: one job of it cannot span vendors\n# (ascend, nvidia)".format(
            fw) in script.read_text()


def test_frameworks_that_can_run_a_plan_across_vendors_are_not_refused():
    from hetctl.plan.render import unrunnable

    for fw in ("hetctl", "flagscale", "torchrun"):
        plan = plan_cluster(mixed_cluster(), SMALL, global_batch=32, framework=fw, homogeneous=False)
        assert len({s.vendor for s in plan.stages}) == 2 and unrunnable(plan) is None
        assert "WARNING: " not in "".join(render_node_scripts(plan).values()), fw
    one_vendor = Cluster(nodes=[node(f"gpu-{i}", "nvidia", "NVIDIA A100-SXM4-80GB", 4, 80.0, 312.0, 312.0)
                                for i in range(2)] + [node("gpu-h", "nvidia", "NVIDIA H100 80GB HBM3", 4, 79.65,
                                                            989.4, 989.4)])
    for fw in ("megatron", "deepspeed"):  # one vendor, two chip kinds: one collective library runs it
        plan = plan_cluster(one_vendor, SMALL, global_batch=32, framework=fw, homogeneous=False)
        assert len({s.model for s in plan.stages}) == 2 and unrunnable(plan) is None
        render_node_scripts(plan)


def test_the_refusal_names_frameworks_from_the_capability_table(monkeypatch):
    from hetctl.plan import frameworks

    assert frameworks.refusal("megatron", ["nvidia"]) is None
    assert frameworks.refusal("megatron", ["nvidia", "nvidia"]) is None
    monkeypatch.setitem(frameworks.CAPABILITIES, "flagscale", frameworks.Capability(tp="any", vendors="one"))
    assert frameworks.refusal("deepspeed", ["cpu", "nvidia"]).endswith(
        "use --framework hetctl (or torchrun if your script spans vendors)")
    assert frameworks.refusal("flagscale", ["amd", "nvidia"]) is not None


def test_a_replan_keeps_render_anyway_only_while_the_plan_still_spans_vendors():
    from hetctl.elastic.replan import replan
    from hetctl.plan.render import unrunnable

    plan = rendered_anyway(plan_cluster(mixed_cluster(), SMALL, global_batch=32, framework="megatron",
                                        homogeneous=False))
    both = replan(plan, mixed_cluster(), drop=["gpu-b"], reason="gpu-b lost")
    assert {s.vendor for s in both.stages} == {"nvidia", "ascend"}
    assert both.rendered_anyway == unrunnable(both) == plan.rendered_anyway
    nvidia = replan(plan, mixed_cluster(), drop=["npu-c"], reason="npu-c lost")
    assert nvidia.rendered_anyway is None and unrunnable(nvidia) is None
    for p in (both, nvidia):
        render_node_scripts(p)
