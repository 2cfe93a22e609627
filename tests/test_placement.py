"""Every rank lands where the plan puts it, by the frameworks' own launcher code (issue 37).

DeepSpeed: the rendered ``hostfile`` and ``hostfile.include`` go through
DeepSpeed's runner (``fetch_hostfile``, ``parse_inclusion_exclusion``,
``encode_world_info``), and each launcher the node scripts name
(``--node_rank``) runs DeepSpeed's ``launch.main`` in this process with its
``Popen`` recording what each rank would get (``RANK``, ``LOCAL_RANK``, the
visible devices): the rank's node is the one whose script names that
launcher, its chip the visible device at ``LOCAL_RANK`` (what DeepSpeed's
engine selects), its stage and layers DeepSpeed's topology and
``PipelineModule`` partition for that ``RANK``.

Megatron-LM, FlagScale and torchrun: the node scripts are the launcher; a
rank's chip is the visible device at its ``LOCAL_RANK`` (Megatron's
``torch.cuda.set_device(args.local_rank)``, the torchrun contract), read back
from the rendered script; Megatron's ``RankGenerator`` and layout parser give
its stage and layers.

The tests' clusters run in the fast lane; the bench's (up to 10,240 chips) are e2e.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import shlex
import signal
import time
import types
from functools import cache

import pytest

from hetctl.plan.fwlayout import framework_rank, meshes
from hetctl.plan.render import write_plan_dir
from hetctl.plan.render import script_name
from tests.helpers.placement import clusters, hosts_of, plan_for, script_ranks

needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason="DeepSpeed not installed (pip install -e '.[frameworks]')")
needs_mcore = pytest.mark.skipif(importlib.util.find_spec("megatron.core") is None
                                 if importlib.util.find_spec("megatron") else True,
                                 reason="megatron-core not installed (pip install -e '.[frameworks]')")


def _cases() -> list:
    return [pytest.param(name, marks=[pytest.mark.e2e] if name.startswith("bench-") else [])
            for name in clusters()]


class _Recorded:
    """Stands in for ``subprocess.Popen`` inside DeepSpeed's launch.py: records the rank's command and env."""

    started: list[tuple[list[str], dict[str, str]]] = []
    returncode = 0
    pid = 0

    def __init__(self, cmd, env=None, **_):
        _Recorded.started.append((list(cmd), dict(env)))

    def poll(self):
        return 0


def deepspeed_launch(plan_dir, monkeypatch) -> dict[int, tuple[str, int | None, str]]:
    """DeepSpeed's runner and launch.py on the rendered files: RANK → (node, chip, LOCAL_RANK argument)."""
    from deepspeed.launcher import launch, runner

    pool = runner.fetch_hostfile(str(plan_dir / "hostfile"))
    include = (plan_dir / "hostfile.include").read_text().strip()
    world_info = runner.encode_world_info(runner.parse_inclusion_exclusion(pool, include, ""))
    launchers = {}
    for script in (plan_dir / "nodes").glob("*.sh"):
        text = script.read_text()
        listed = text.split("once for each --node_rank in ", 1)[1].split(":", 1)[0]
        for n in listed.split():
            launchers[int(n)] = script.stem
    assert sorted(launchers) == list(range(len(json.loads(base64.urlsafe_b64decode(world_info)))))
    monkeypatch.setattr(launch.subprocess, "Popen", _Recorded)
    monkeypatch.setattr(launch, "time", types.SimpleNamespace(sleep=lambda s: None, strftime=time.strftime,
                                                              localtime=time.localtime))
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    out = {}
    try:
        for node_rank, script in launchers.items():
            _Recorded.started = []
            monkeypatch.setattr("sys.argv", ["launch", f"--world_info={world_info}", f"--node_rank={node_rank}",
                                             "--master_addr=127.0.0.1", "--master_port=29500", "--quiet", "train.py"])
            launch.main()
            for cmd, env in _Recorded.started:
                visible = env["CUDA_VISIBLE_DEVICES"].split(",")
                local = int(env["LOCAL_RANK"])
                assert cmd[-1] == f"--local_rank={local}"
                out[int(env["RANK"])] = (script, int(visible[local]), env["WORLD_SIZE"])
    finally:
        signal.signal(signal.SIGINT, handlers[0])
        signal.signal(signal.SIGTERM, handlers[1])
    return out


@cache
def _deepspeed_grid(tp: int, pp: int, world: int, num_layers: int):
    """DeepSpeed's pipe-data-model topology and its balanced partition of equal layer weights."""
    from deepspeed.runtime import utils as ds_utils
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    topo = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=world // (pp * tp))
    # PipelineModule(partition_method="type:DecoderLayer"): weight 1 per decoder layer, balanced.
    return topo, ds_utils.partition_balanced(weights=[1] * num_layers, num_parts=pp)


def deepspeed_stage(plan, rank: int) -> tuple[int, int, tuple[int, int]]:
    """DeepSpeed's topology and PipelineModule partition for RANK: (stage, replica, layers)."""
    topo, parts = _deepspeed_grid(plan.stages[0].tp, plan.parallel.pp, len(plan.ranks), plan.model.num_layers)
    coord = topo.get_coord(rank)
    return coord.pipe, coord.data, (parts[coord.pipe], parts[coord.pipe + 1])


@needs_deepspeed
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", _cases())
def test_deepspeeds_launcher_places_every_rank_as_planned(tmp_path, monkeypatch, name):
    plan = plan_for(name, "deepspeed")
    if plan is None:
        pytest.skip(f"{name}: no DeepSpeed plan fits")
    write_plan_dir(plan, tmp_path, hosts_of(name))
    placed = deepspeed_launch(tmp_path, monkeypatch)
    mesh_list = meshes(plan, by_type=False)
    assert sorted(placed) == list(range(len(plan.ranks)))
    for r in plan.ranks:
        rank = framework_rank(plan, r, mesh_list)
        script, chip, world = placed[rank]
        assert (script, chip, world) == (script_name(r.node)[:-3], r.chip, str(len(plan.ranks))), (rank, r)
        stage, replica, layers = deepspeed_stage(plan, rank)
        assert (stage, replica, layers) == (r.stage, r.replica, plan.stages_of(r.replica)[r.stage].layers)


@cache
def _megatron_grid(tp: int, pp: int, world: int, layout_text: str):
    """Megatron-core's rank generator (tp-cp-ep-dp-pp) and layout parser: RANK → index per group, stage → layers."""
    from megatron.core.parallel_state import RankGenerator
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    gen = RankGenerator(tp=tp, ep=1, dp=world // (tp * pp), pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    index = {mode: {r: g.index(r) for g in gen.get_ranks(mode) for r in g} for mode in ("pp", "dp", "tp")}
    layout = PipelineParallelLayerLayout(layout_text, pp)
    vp = 0 if layout.virtual_pipeline_model_parallel_size else None
    layers = {s: layout.get_layer_id_list(pp_rank=s, vp_stage=vp) for s in range(pp)}
    return index, {s: (ids[0], ids[-1] + 1) for s, ids in layers.items()}


def _megatron_place(text: str, rank: int, world: int) -> tuple[int, int, int, tuple[int, int]]:
    """Megatron-core's own answer for RANK under a rendered script: (stage, replica, TP index, first chunk's layers)."""
    words = shlex.split(text.split("MEGATRON_ARGS=(", 1)[1].split(")", 1)[0])
    arg = {w: words[i + 1] for i, w in enumerate(words[:-1]) if w.startswith("--")}
    index, layers = _megatron_grid(int(arg["--tensor-model-parallel-size"]), int(arg["--pipeline-model-parallel-size"]),
                                   world, arg["--pipeline-model-parallel-layout"])
    stage = index["pp"][rank]
    return stage, index["dp"][rank], index["tp"][rank], layers[stage]


def _check_node_scripts(name: str, fw: str) -> None:
    from hetctl.plan.render import render_node_scripts

    plan = plan_for(name, fw)
    if plan is None:
        return
    mesh_list = meshes(plan, by_type=fw == "flagscale") if not plan.replicas else []
    scripts = render_node_scripts(plan, hosts_of(name))
    envs = {n: {e["RANK"]: e for e in script_ranks(t)} for n, t in scripts.items()}
    for r in plan.ranks:
        rank = framework_rank(plan, r, mesh_list) if fw != "torchrun" else r.rank
        env = envs[r.node][str(rank)]
        stage = plan.stages_of(r.replica)[r.stage]
        if stage.visible_devices_env:  # the device the framework selects: the visible one at LOCAL_RANK
            assert int(env[stage.visible_devices_env].split(",")[int(env["LOCAL_RANK"])]) == r.chip, (name, fw, r)
        if fw == "megatron":
            tp_index = stage.chips.index(r.chip) if r.chip is not None else int(env["HETCTL_TP_RANK"])
            first = stage.chunks[0] if stage.chunks else stage.layers
            assert _megatron_place(scripts[r.node], rank, len(plan.ranks)) == \
                (r.stage, r.replica, tp_index, tuple(first)), (name, r)
        elif fw == "torchrun":
            assert (env["HETCTL_STAGE"], env["HETCTL_REPLICA"], env["HETCTL_LAYERS"]) == \
                (str(r.stage), str(r.replica), f"{stage.layers[0]}:{stage.layers[1]}")


@needs_mcore
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", _cases())
def test_node_scripts_place_each_rank_on_its_node_chip_and_layers(name):
    """Every framework's node scripts: the rank's chip is the visible device at its LOCAL_RANK (what Megatron,
    DeepSpeed's engine and the torchrun contract select); Megatron-core's rank generator and layout parser put
    it on its stage, replica, TP index and layers; the torchrun contract says the same."""
    for fw in ("megatron", "flagscale", "deepspeed", "torchrun"):
        _check_node_scripts(name, fw)


FLAGSCALE_OFFSETS = """
import json, sys
import torch
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
out = []
for split, mesh_pp, stage in json.loads(sys.argv[1]):
    # What FSTrainArguments leaves a rank: its mesh's pp as pipeline_model_parallel_size, the job's split.
    config = TransformerConfig(num_layers=sum(split), hidden_size=64, num_attention_heads=4, enable_hetero=True,
                               pipeline_model_parallel_size=mesh_pp, hetero_pipeline_layer_split=split,
                               pipeline_dtype=torch.bfloat16)
    out.append(get_transformer_layer_offset(config, pp_rank=stage))
print(json.dumps(out))
"""


def _flag_scale_dir():
    from tests.test_frameworks import FLAG_SCALE

    return FLAG_SCALE


@pytest.mark.e2e  # FlagScale's Megatron is imported in a child process
@pytest.mark.skipif(_flag_scale_dir() is None, reason="FlagScale not installed (pip install --no-deps flag-scale==0.8.0)")
def test_flagscale_numbers_every_stages_layers_from_its_place_in_the_model():
    """FlagScale's own layer offset, per stage with its mesh's pp (as its hetero mode sets it), is the plan's."""
    import os
    import subprocess
    import sys

    fs = _flag_scale_dir()
    asked, want = [], []
    for name in (n for n in clusters() if not n.startswith("bench-six")):
        plan = plan_for(name, "flagscale")
        if plan is None:
            continue
        split = [b - a for a, b in (s.layers for s in plan.stages_of(0))]
        for m in meshes(plan):
            for stage in range(m.first, m.first + m.stages):
                asked.append((split, m.stages, stage))
                want.append((name, stage, plan.stages_of(0)[stage].layers[0]))
    env = {**os.environ, "PYTHONPATH": f"{fs}:{fs / 'third_party/Megatron-LM'}"}
    res = subprocess.run([sys.executable, "-c", FLAGSCALE_OFFSETS, json.dumps(asked)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert [(n, s, o) for (n, s, _), o in zip(want, got)] == want


def test_a_flagscale_plan_with_a_one_stage_mesh_past_the_first_is_refused_with_exit_4():
    from hetctl.errors import PlanInfeasible
    from hetctl.plan.render import render_node_scripts

    from hetctl.plan.fwlayout import meshes

    # The first of the tests' torchrun plans whose meshes include a one-stage mesh past the first (a planner
    # change may move which cluster that is; one must remain for the refusal to be tested at all).
    plan = next(p for name in clusters() if not name.startswith("bench-") for p in [plan_for(name, "torchrun")]
                if p is not None and p.parallel.pp > 1 and any(m.stages == 1 and m.first > 0 for m in meshes(p)))
    plan = plan.model_copy(update={"framework": "flagscale"})
    with pytest.raises(PlanInfeasible, match="holds one pipeline stage") as e:
        render_node_scripts(plan)
    assert e.value.exit_code == 4 and "--framework hetctl" in e.value.hint
