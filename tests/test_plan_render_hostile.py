"""Hostile values in every field that reaches a node script: real bash runs them, nothing injected runs.

Issue 17 item 1. Hypothesis puts newlines, ``$(…)``, backticks, quotes, ``;``,
Unicode line separators, NUL and the like into the model name, the node names,
the hosts, the chip model and vendor a node reports, the rank environment
(device type, backend, the visible-devices variable's name), the plan path,
the launch-time variables and the script's arguments. Every rendered script
must pass ``bash -n`` and, run by real bash with ``HETCTL_PYTHON`` set to a
recorder, never create the canary file any payload tries to touch, and hand
each rank exactly the intended argv and environment. A value no script can
carry (NUL, a variable name that is not one) is refused with a ConfigError
naming where it is.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hetctl.errors import ConfigError
from hetctl.plan.planner import plan_cluster
from hetctl.plan.fwlayout import device_label, framework_rank, meshes
from hetctl.plan.render import render_node_scripts, write_plan_dir
from hetctl.files.plan import Plan
from hetctl.files.cluster import Cluster
from tests.helpers.placement import rendered_anyway
from tests.test_plan_invariants import SMALL, node

FRAMEWORKS = ("hetctl", "megatron", "flagscale", "deepspeed", "torchrun")
WORK = Path(tempfile.mkdtemp(prefix="hetctl-hostile-"))
CANARY = WORK / "canary"
SECRET = "hf_s3cr3t-token-value"  # in the environment of the render and of bash; must reach no script

PAYLOADS = [
    f"$(touch {CANARY})", f"`touch {CANARY}`", f"\ntouch {CANARY}\n", f"';touch {CANARY};'", f'";touch {CANARY};"',
    f"\u2028touch {CANARY}", f"\u2029touch {CANARY}\u0085", f"}}; touch {CANARY}; {{", f"\r\ntouch {CANARY} #",
    f"$'\\n'touch {CANARY}", f"${{IFS}}; touch {CANARY}", f"\\\ntouch {CANARY}", f"\x1b[2K\x0btouch {CANARY}",
    f"\u202etouch {CANARY}", f"*; touch {CANARY} &", f"| touch {CANARY}",
]
# NUL and lone surrogates have their own test below: no program receives them as text, so they are refused.
PIECES = st.one_of(st.sampled_from(PAYLOADS), st.text(st.characters(blacklist_characters="\0", blacklist_categories=("Cs",)), max_size=6),
                   st.sampled_from(["'", '"', ";", "#", "\\", "$", "`", " ", "\t", "é", "模型", "-", "}"]))
HOSTILE = st.lists(PIECES, min_size=1, max_size=4).map("".join).filter(lambda s: s.strip())

# A recorder in bash (fast): argv and environment, NUL-separated, one pair of files per rank.
RECORDER = """#!/usr/bin/env bash
printf '%s\\0' "$@" >"$REC_DIR/argv-$RANK"
env -0 >"$REC_DIR/env-$RANK"
pwd >"$REC_DIR/cwd-$RANK"
"""


def base_plans() -> dict[str, Plan]:
    cluster = Cluster(nodes=[node("gpu-a", "nvidia", "NVIDIA A100-SXM4-80GB", 1, 80.0, 312.0, 312.0),
                             node("npu-b", "ascend", "910B2C", 1, 64.0, 376.0, 376.0)])
    # Megatron and DeepSpeed cannot run a plan across vendors: their scripts are written only --render-anyway.
    return {fw: rendered_anyway(plan_cluster(cluster, SMALL, global_batch=8, framework=fw, homogeneous=False))
            for fw in FRAMEWORKS}


PLANS = base_plans()


def hostile_plan(fw: str, v: dict[str, str]) -> Plan:
    """The framework's plan with hostile values put into every text field that a script shows or uses."""
    plan = PLANS[fw].model_copy(deep=True)
    rename = {"gpu-a": v["node_a"], "npu-b": v["node_b"]}
    plan.model.name = v["model"]
    plan.nodes = [rename[n] for n in plan.nodes]
    for r in plan.ranks:
        r.node = rename[r.node]
    for s in plan.stages:
        s.node = rename[s.node]
        s.model = v["chip_model"]
        s.device_type = v["device_type"]
        s.backend = v["backend"]
    return plan


def values_strategy():
    return st.fixed_dictionaries({
        "model": HOSTILE, "node_a": HOSTILE, "node_b": HOSTILE, "chip_model": HOSTILE, "device_type": HOSTILE,
        "backend": HOSTILE, "host": HOSTILE, "plan_path": HOSTILE, "ckpt_dir": HOSTILE, "script": HOSTILE,
        "arg1": HOSTILE, "arg2": HOSTILE,
    })


def read_nul(path: Path) -> list[str]:
    data = path.read_bytes()
    return data.decode("utf-8", "surrogateescape").split("\0")[:-1] if data else []


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fw=st.sampled_from(FRAMEWORKS), v=values_strategy())
def test_hostile_values_in_every_field_never_run_and_reach_ranks_intact(fw, v):
    plan = hostile_plan(fw, v)
    if v["node_a"] == v["node_b"]:
        return
    hosts = {plan.ranks[0].node: v["host"]}
    os.environ["HF_TOKEN"] = SECRET
    try:
        scripts = render_node_scripts(plan, hosts, plan_path=v["plan_path"])
    finally:
        del os.environ["HF_TOKEN"]
    run = Path(tempfile.mkdtemp(dir=WORK))
    try:
        _run_and_check(fw, plan, v, scripts, run)
    finally:
        shutil.rmtree(run)
    assert not CANARY.exists(), "an injected command ran"


def _run_and_check(fw: str, plan: Plan, v: dict[str, str], scripts: dict[str, str], run: Path) -> None:
    rec = run / "rec"
    rec.mkdir()
    (run / "FlagScale").mkdir()
    fake = run / "python"
    fake.write_text(RECORDER)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = {"PATH": os.environ["PATH"], "HETCTL_PYTHON": str(fake), "REC_DIR": str(rec),
           "HETCTL_HEARTBEAT_DIR": str(run / "hb"), "HF_TOKEN": SECRET,
           "HETCTL_CKPT_DIR": v["ckpt_dir"], "HETCTL_SCRIPT": v["script"]}
    args = [v["arg1"], v["arg2"]]
    for name, text in scripts.items():
        assert SECRET not in text
        path = run / f"{len(list(run.glob('*.sh')))}.sh"
        path.write_text(text)
        check = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert check.returncode == 0, (name, check.stderr)
        done = subprocess.run(["bash", str(path), *args], env=env, cwd=run, capture_output=True, timeout=60)
        assert done.returncode == 0, (name, done.stderr.decode(errors="replace"))
    mesh_list = meshes(plan, by_type=fw == "flagscale")
    for r in plan.ranks:
        rank = framework_rank(plan, r, mesh_list) if fw in ("megatron", "flagscale", "deepspeed") else r.rank
        argv = read_nul(rec / f"argv-{rank}")
        got = dict(item.split("=", 1) for item in read_nul(rec / f"env-{rank}"))
        stage = plan.stages_of(r.replica)[r.stage]
        cwd = (rec / f"cwd-{rank}").read_text().rstrip("\n")
        assert got["RANK"] == str(rank) and got["HETCTL_STAGE"] == str(r.stage)
        assert got["HETCTL_DEVICE_TYPE"] == v["device_type"] and got["HETCTL_BACKEND"] == v["backend"]
        assert got["MASTER_ADDR"] == v["host"]
        plan_path, ckpt = v["plan_path"], v["ckpt_dir"]
        if fw == "flagscale":  # made absolute before FlagScale's cd into its folder
            plan_path = plan_path if plan_path.startswith("/") else f"{run}/{plan_path}"
            ckpt = ckpt if ckpt.startswith("/") else f"{run}/{ckpt}"
            assert cwd == str(run / "FlagScale")
            assert got["PYTHONPATH"].split(":")[:2] == [str(run / "FlagScale"), str(run / "FlagScale/third_party/Megatron-LM")]
        assert got["HETCTL_PLAN"] == plan_path and got["HETCTL_CKPT_DIR"] == ckpt
        assert SECRET not in " ".join(argv)
        assert argv[-2:] == args, "the script's arguments reach the rank unchanged"
        if fw in ("torchrun", "deepspeed"):
            assert argv[0] == v["script"]
        if fw in ("megatron", "flagscale"):
            assert argv[argv.index("--load") + 1] == ckpt and argv[argv.index("--save") + 1] == ckpt
        if fw == "flagscale":
            label = argv[argv.index("--hetero-current-device-type") + 1]
            assert label.split("_")[0] == device_label(stage.vendor, stage.model)


@pytest.mark.parametrize("bad", ["CUDA_VISIBLE_DEVICES;touch x", "A B", "1ABC", "X\nY"])
def test_a_visible_devices_name_that_is_no_variable_name_is_refused(bad):
    plan = PLANS["torchrun"].model_copy(deep=True)
    for s in plan.stages:
        if s.visible_devices_env:
            s.visible_devices_env = bad
    with pytest.raises(ConfigError, match="not a valid variable name"):
        render_node_scripts(plan)


def test_node_names_that_share_a_script_file_are_refused(tmp_path):
    plan = hostile_plan("hetctl", {"model": "m", "node_a": "a;b", "node_b": "a b", "chip_model": "c",
                                   "device_type": "cuda", "backend": "nccl"})
    with pytest.raises(ConfigError, match="same script file"):
        write_plan_dir(plan, tmp_path)


@pytest.mark.parametrize("bad,why", [("x\0y", "NUL"), ("x\ud800", "lone surrogate")])
@pytest.mark.parametrize("field", ["model", "node_a", "chip_model", "device_type", "backend", "host", "plan_path"])
def test_a_nul_or_a_lone_surrogate_anywhere_is_refused_naming_where(field, bad, why):
    v = {"model": "m", "node_a": "a", "node_b": "b", "chip_model": "c", "device_type": "cuda", "backend": "nccl",
         "host": "h", "plan_path": "plan.yaml"}
    v[field] = bad
    plan = hostile_plan("torchrun", v)
    with pytest.raises(ConfigError, match=why) as e:
        render_node_scripts(plan, {plan.ranks[0].node: v["host"]}, plan_path=v["plan_path"])
    where = {"model": "plan.model.name", "node_a": "plan.nodes[", "chip_model": ".model", "device_type":
             ".device_type", "backend": ".backend", "host": "hosts", "plan_path": "plan path"}[field]
    assert where in e.value.message
