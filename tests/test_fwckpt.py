"""Finding the frameworks' own checkpoints (hetctl.elastic.fwckpt) on their real folder layouts.

The Megatron-LM layouts follow ``megatron/training/checkpointing.py``
(``iter_{N:07d}``, ``latest_checkpointed_iteration.txt`` written after the
save; torch_dist's ``metadata.json`` + DCP ``.metadata``, legacy
``mp_rank_XX[_YYY]/model_optim_rng.pt``); DeepSpeed's follow
``runtime/engine.py: save_checkpoint`` (tag folders, ``latest``). The DCP
folders are written by ``torch.distributed.checkpoint.save`` itself.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hetctl.elastic import fwckpt


def megatron_iter(root: Path, step: int, fmt: str = "torch_dist", complete: bool = True) -> Path:
    d = root / f"iter_{step:07d}"
    d.mkdir(parents=True)
    if fmt == "torch_dist":
        (d / "common.pt").write_bytes(b"x")
        (d / "__0_0.distcp").write_bytes(b"x")
        if complete:  # DCP's coordinator writes .metadata last; Megatron then writes metadata.json
            (d / ".metadata").write_bytes(b"meta")
            (d / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    else:  # legacy torch: one folder per (tp, pp) rank
        for tp in range(2):
            sub = d / f"mp_rank_{tp:02d}_000"
            sub.mkdir()
            (sub / "model_optim_rng.pt").write_bytes(b"x")
    return d


def test_megatron_takes_the_tracker_iteration_and_skips_an_unfinished_newer_save(tmp_path):
    for step in (10, 20):
        megatron_iter(tmp_path, step)
    megatron_iter(tmp_path, 30, complete=False)  # killed during the save: no .metadata, tracker still at 20
    (tmp_path / fwckpt.MEGATRON_TRACKER).write_text("20")
    scan = fwckpt.scan("megatron", tmp_path)
    assert [f.step for f in scan.found] == [20, 10]
    assert scan.newest.format == "torch_dist" and scan.newest.root == tmp_path
    (skip,) = scan.skipped
    assert skip.step == 30 and any("did not finish" in p for p in skip.problems)
    env = fwckpt.resume_env(scan.newest)
    assert env == {"HETCTL_RESUME_STEP": "20", "HETCTL_RESUME_DIR": str(tmp_path)}


def test_megatron_data_written_but_tracker_not_yet_moved_is_not_resumed(tmp_path):
    megatron_iter(tmp_path, 10)
    megatron_iter(tmp_path, 20)  # every file down, but rank 0 died before it wrote the tracker
    (tmp_path / fwckpt.MEGATRON_TRACKER).write_text("10")
    assert fwckpt.scan("flagscale", tmp_path).newest.step == 10


def test_megatron_legacy_format_and_a_missing_tracker(tmp_path):
    megatron_iter(tmp_path, 5, fmt="torch")
    scan = fwckpt.scan("megatron", tmp_path)
    assert scan.newest is None and "no latest_checkpointed_iteration.txt" in scan.skipped[0].problems[0]
    (tmp_path / fwckpt.MEGATRON_TRACKER).write_text("5\n")
    assert fwckpt.scan("megatron", tmp_path).newest.format == "torch"


def test_deepspeed_latest_tag(tmp_path):
    for step in (40, 80, 120):
        d = tmp_path / f"global_step{step}"
        d.mkdir()
        (d / "mp_rank_00_model_states.pt").write_bytes(b"x")
        (d / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"x")
    (tmp_path / "latest").write_text("global_step80")  # the save of 120 never reached `latest`
    scan = fwckpt.scan("deepspeed", tmp_path)
    assert [f.step for f in scan.found] == [80, 40] and [s.step for s in scan.skipped] == [120]
    assert fwckpt.resume_env(scan.newest) == {"HETCTL_RESUME_STEP": "80", "HETCTL_RESUME_DIR": str(tmp_path),
                                              "HETCTL_RESUME_TAG": "global_step80"}
    assert not fwckpt.reshards("deepspeed") and fwckpt.reshards("megatron")


def test_dcp_folders_written_by_torch_itself(tmp_path):
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    for step in (3, 6):
        dcp.save({"w": torch.arange(6.0), "step": torch.tensor(step)}, checkpoint_id=str(tmp_path / f"step-{step}"))
    torn = tmp_path / "step-9"
    torn.mkdir()
    (torn / "__0_0.distcp").write_bytes(b"partial")  # a rank wrote its data; the coordinator never finished
    scan = fwckpt.scan("torchrun", tmp_path)
    assert [f.step for f in scan.found] == [6, 3] and scan.skipped[0].step == 9
    assert fwckpt.resume_env(scan.newest)["HETCTL_RESUME_DIR"] == str(tmp_path / "step-6")
    state = {"w": torch.zeros(6), "step": torch.tensor(0)}
    dcp.load(state, checkpoint_id=fwckpt.resume_env(scan.newest)["HETCTL_RESUME_DIR"])
    assert int(state["step"]) == 6


def test_nothing_there(tmp_path):
    assert fwckpt.scan("megatron", tmp_path / "absent").newest is None
    assert fwckpt.scan("hetctl", tmp_path).found == [] and fwckpt.resume_env(None) == {}


def _ds_plan(nodes: int):
    from hetctl.files.cluster import Cluster
    from hetctl.plan.planner import plan_cluster
    from tests.test_frameworks import a100s
    from tests.test_plan_invariants import SMALL

    return plan_cluster(Cluster(nodes=a100s(nodes, 2)), SMALL, global_batch=16, framework="deepspeed",
                        homogeneous=False)


def test_deepspeed_is_not_re_planned_onto_another_shape_once_it_has_a_checkpoint(tmp_path):
    from hetctl.errors import PlanInfeasible

    old, new = _ds_plan(2), _ds_plan(1)
    assert fwckpt.plan_shape(old) != fwckpt.plan_shape(new)
    fwckpt.same_shape_only(old, new, tmp_path)  # no checkpoint yet: a new shape starts from scratch
    tag = tmp_path / "global_step10"
    tag.mkdir()
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"x")
    (tmp_path / "latest").write_text("global_step10")
    with pytest.raises(PlanInfeasible, match="deepspeed checkpoints load only onto the same shape"):
        fwckpt.same_shape_only(old, new, tmp_path)
    fwckpt.same_shape_only(old, _ds_plan(2), tmp_path)  # the same shape again is fine
    megatron_old = old.model_copy(update={"framework": "megatron"})
    fwckpt.same_shape_only(megatron_old, new, tmp_path)  # torch_dist reshards


def test_each_ranks_script_is_its_part_of_the_node_script():
    """One source of truth: the rank's script carries the node script's setup and its exact command."""
    from hetctl.plan.render import render_node_scripts, render_rank_scripts

    for fw in ("megatron", "deepspeed", "torchrun"):
        plan = _ds_plan(2).model_copy(update={"framework": fw})
        nodes, ranks = render_node_scripts(plan), render_rank_scripts(plan)
        assert sorted(ranks) == sorted(r.rank for r in plan.ranks)
        for rs in ranks.values():
            node_text = nodes[rs.node]
            body = rs.text.split("exec env ", 1)[1].rstrip("\n")
            assert f"env {body} &\n" in node_text  # the same environment and command, backgrounded there
            def setup(text: str) -> str:
                return text.split("set -euo pipefail\n", 1)[1].split("\npids=()")[0]

            if fw != "deepspeed":  # DeepSpeed's config goes to the attempt's folder instead of a temp file
                assert setup(rs.text) == setup(node_text) and len(setup(rs.text)) > 100
            assert f"HETCTL_HEARTBEAT_DIR\"/{rs.heartbeat}" in rs.text and f"RANK={rs.framework_rank} " in rs.text


def test_a_missing_framework_is_named_with_what_to_set():
    from hetctl.launch import fwcheck

    spec = fwcheck.requirements("megatron", "/w")
    report = '{"files": [["Megatron-LM/pretrain_gpt.py", false]], "modules": {"torch": true}}'
    why = fwcheck.problem("megatron", spec, report)
    assert why.startswith("Megatron-LM not found: Megatron-LM/pretrain_gpt.py does not exist on the node")
    assert "MEGATRON_DIR" in why
    spec = fwcheck.requirements("deepspeed", "/w", "train.py")
    why = fwcheck.problem("deepspeed", spec, '{"files": [["train.py", true]], "modules": {"torch": true}}')
    assert "`import deepspeed` fails" in why
    assert fwcheck.problem("deepspeed", spec, '{"files": [["train.py", true]], '
                                              '"modules": {"torch": true, "deepspeed": true}}') is None
