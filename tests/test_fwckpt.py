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
