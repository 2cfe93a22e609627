"""One LaunchOptions from the command line to the ranks (issue 34): the dry run is what runs, and no option
`hetctl launch` accepts is dropped on the way."""

from __future__ import annotations

import json
import threading

import pytest
from typer.main import get_command

from hetctl.elastic.loop import ElasticRun
from hetctl.elastic.start import dry_run, prepare_launch
from hetctl.files.inventory import Inventory, Node
from hetctl.files.plan import Plan
from hetctl.files.run import FaultOptions, LaunchOptions, RunDir
from hetctl.launch import materialize as mat
from hetctl.remote.testing import FakeFleet
from tests.helpers.rankrunner import tiny_plan

# Each `hetctl launch` option: the LaunchOptions field it becomes (it reaches the ranks through materialize),
# the FaultOptions field (the fault policy, run.yaml's inputs.faults), or what else takes it and why it is
# not the ranks'. A new option that is none of these fails here until it is carried.
RUN_LEVEL = {
    "plan_dir": "the plan's folder (run.yaml's plan_dir)",
    "inventory": "the inventory file (run.yaml's inventory)",
    "run_dir": "where runs/<id>/ is made",
    "dry_run": "prints materialize of the same options instead of launching",
    "json_out": "the summary's format",
    "health_check": "Prepared.health_check: checks nodes before the first attempt",
    "export": "after a successful run, hetctl export of the last checkpoint",
}
FAULTS = {"grace": "grace", "max_restarts": "max_restarts", "hang_timeout": "hang_timeout",
          "node_timeout": "node_timeout", "max_node_failures": "max_node_failures", "rebalance": "rebalance"}
AS_FIELD = {"script_args": "script_args"}  # --args


def test_every_launch_option_is_carried_or_named():
    from hetctl.cli import app

    launch = get_command(app).commands["launch"]
    names = {p.name for p in launch.params}
    launch_fields = set(LaunchOptions.model_fields)
    carried = {n for n in names if n in launch_fields or AS_FIELD.get(n) in launch_fields}
    assert names - carried - set(FAULTS) - set(RUN_LEVEL) == set()
    assert set(FAULTS.values()) <= set(FaultOptions.model_fields)
    assert launch_fields <= carried, "a LaunchOptions field that no launch option sets"


def _plan(framework: str = "hetctl") -> Plan:
    return Plan.model_validate({**tiny_plan([3, 3]), "framework": framework})


def _nodes(plan: Plan) -> dict[str, Node]:
    return {n: Node(name=n, host=n, python="/py", workdir=f"/w/{n}") for n in plan.nodes}


def _spec(plan: Plan, options: LaunchOptions) -> dict:
    spec = mat.materialize(plan, _nodes(plan), run_id="r", attempt=0, master_addr="a",
                           master_port=options.master_port or 29500, options=options, ckpt_dir="/ck")
    return spec.to_dict(mask_secrets=False)


# What each field is set to, on which plan, to show it reaches the ranks' spec.
CHANGED = {
    "steps": ("hetctl", 7),
    "checkpoint_every": ("hetctl", 3),
    "entry": ("hetctl", ("train.py", "--x")),
    "progress": ("hetctl", "megatron"),
    "script": ("torchrun", "mytrain.py"),
    "script_args": ("hetctl", ("--lr", "0.01")),
    "master_port": ("hetctl", 29533),
    "init_from": ("hetctl", "/shared/hf"),
}
# Fields that act in the controller, not in the spec, and the test that holds each to it.
ELSEWHERE = {
    "allow_mixed_software": "tests/test_attempt.py::test_nodes_with_another_torch_are_refused_at_launch_unless_allowed",
    "standby": "tests/test_standby.py (the agent pool) and test_the_dry_run_is_what_the_first_attempt_ran",
}


def test_each_launch_option_changes_what_the_ranks_run():
    assert set(CHANGED) | set(ELSEWHERE) == set(LaunchOptions.model_fields)
    for field, (framework, value) in CHANGED.items():
        plan = _plan(framework)
        base = LaunchOptions(steps=5, checkpoint_every=0)
        assert _spec(plan, base) != _spec(plan, base.model_copy(update={field: value})), field


def test_the_dry_run_is_what_the_first_attempt_ran(tmp_path):
    """`launch --dry-run` and a launch materialize the same options: the attempt's launch.json is the dry run
    with the run id, and nothing else, filled in."""
    plan = _plan()
    inv = Inventory(checkpoint_dir=str(tmp_path / "ck"), nodes=list(_nodes(plan).values()))
    options = LaunchOptions(steps=4, checkpoint_every=2, master_port=29533, script_args=("--lr", "0.01"),
                            init_from="/shared/hf", standby="off")
    shown = dry_run(plan, inv, options, run_root=tmp_path / "runs").to_dict(public=inv.public_env)
    prepared = prepare_launch(plan, inv, options, run_root=tmp_path / "runs", plan_path=None)
    fleet = FakeFleet({})
    result = ElasticRun(prepared, connect=fleet.connect).run(threading.Event())
    assert result.summary.state == "succeeded"
    ran = json.loads((prepared.run.attempt_dir(0) / "launch.json").read_text())
    assert json.loads(json.dumps(shown).replace("<run-id>", prepared.run.run_id)) == ran
    info = RunDir.open(prepared.run.path).load_info()
    assert info.inputs.options() == options  # and run.yaml keeps them for restarts and resume


@pytest.mark.parametrize("field", ["steps", "script_args", "standby"])
def test_the_options_are_frozen(field):
    with pytest.raises(ValueError):
        setattr(LaunchOptions(steps=1, checkpoint_every=0), field, None)
