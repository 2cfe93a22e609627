"""The conventions of the tools people know: -h, a version command, NO_COLOR, usage lines as written."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib import metadata

import pytest
import typer
from typer.testing import CliRunner

from hetctl.cli import app

COMMANDS = sorted(typer.main.get_command(app).commands)


def run(*args: str):
    return CliRunner(env={"COLUMNS": "120"}).invoke(app, list(args))


@pytest.mark.parametrize("command", [[]] + [[c] for c in COMMANDS])
def test_dash_h_is_help(command):
    r = run(*command, "-h")
    assert r.exit_code == 0 and "Usage:" in r.output
    assert r.output == run(*command, "--help").output


@pytest.mark.parametrize("command", COMMANDS)
def test_usage_lines_read_as_written(command):
    usage = next(line for line in run(command, "-h").output.splitlines() if "Usage:" in line)
    assert "{" not in usage and "[[" not in usage, usage
    assert re.search(rf"hetctl {command} \[OPTIONS\]", usage), usage


def test_hetctl_version_names_python_torch_and_plugins():
    r = run("version", "--json")
    assert r.exit_code == 0
    v = json.loads(r.stdout)
    assert v["python"] == ".".join(map(str, sys.version_info[:3]))
    assert v["torch"] == metadata.version("torch")
    assert isinstance(v["vendor_plugins"], dict)
    text = run("version").output
    assert f"torch: {v['torch']}" in text and "vendor plugins:" in text and f"hetctl: {v['hetctl']}" in text


def test_a_vendor_plugin_installed_is_named(tmp_path):
    """A plugin's distribution metadata (as pip leaves it) is found without importing the plugin."""
    dist = tmp_path / "torch_npu-2.5.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: torch_npu\nVersion: 2.5.1\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", "hetctl", "version", "--json"], capture_output=True, text=True,
                       env=env, timeout=120)
    assert json.loads(r.stdout)["vendor_plugins"] == {"torch_npu": "2.5.1"}


def _error_output(extra_env: dict[str, str]) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "FORCE_COLOR")}
    env.update(FORCE_COLOR="1", COLUMNS="120", **extra_env)
    r = subprocess.run([sys.executable, "-m", "hetctl", "plan", "no-such-cluster.yaml", "-m", "tiny"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2
    return r.stderr


COLOR = re.compile(r"\x1b\[(?:[0-9;]*;)?(?:3[0-9]|9[0-7]|4[0-9])(?:;[0-9;]*)?m")


def test_no_color_is_honoured():
    assert COLOR.search(_error_output({}))  # in colour when forced
    plain = _error_output({"NO_COLOR": "1"})
    assert "cluster file not found" in plain and not COLOR.search(plain)


def test_hetctl_environment_variables_stand_for_the_repeated_options(tmp_path):
    """HETCTL_INVENTORY is -i of probe/launch/resume, HETCTL_RUN_DIR is --run-dir of launch/status; the command
    line wins. Checked by what each command then reads (a missing file named in its error, the runs it lists)."""
    def run(*args, **env):
        return subprocess.run([sys.executable, "-m", "hetctl", *args], cwd=tmp_path, capture_output=True, text=True,
                              env={**os.environ, "COLUMNS": "200", **env}, timeout=60)

    r = run("probe", HETCTL_INVENTORY="from-env.yaml")
    assert r.returncode == 2 and "from-env.yaml" in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = run("probe", "-i", "from-flag.yaml", HETCTL_INVENTORY="from-env.yaml")
    assert r.returncode == 2 and "from-flag.yaml" in r.stderr and "from-env.yaml" not in r.stderr, r.stderr
    from hetctl.files.run import RunDir

    (tmp_path / "elsewhere").mkdir()
    made = RunDir.create(tmp_path / "elsewhere", "20261205-101010-abcd")
    (made.path / "run.yaml").write_text("run_id: 20261205-101010-abcd\ncreated: 0\nupdated: 0\n"
                                        "inputs: {steps: 1, checkpoint_every: 0, checkpoint_dir: c}\n")
    r = run("status", "--json", HETCTL_RUN_DIR="elsewhere")
    assert r.returncode == 0, r.stderr
    assert [v["run_id"] for v in json.loads(r.stdout)] == ["20261205-101010-abcd"]
    r = run("status", "--json", "--run-dir", "nowhere", HETCTL_RUN_DIR="elsewhere")
    assert r.returncode == 2 and "nowhere: no such run folder" in r.stderr, r.stderr
    r = run("launch", "plan", HETCTL_STANDBY="sometimes")  # HETCTL_STANDBY is launch's --standby
    assert r.returncode == 2 and "--standby 'sometimes': not a mode" in r.stderr, r.stderr


@pytest.mark.parametrize("columns", [80, 120])
def test_what_a_user_copies_is_never_cut_at_80_or_120_columns(tmp_path, columns):
    """Run ids, node names: whole at any width; columns a narrow terminal has no room for are left out and named."""
    from rich.console import Console

    from hetctl.cli.fit import Col, fitted
    from hetctl.files.run import RunDir

    rid = "20261205-101010-abcd"
    made = RunDir.create(tmp_path / "runs", rid)
    (made.path / "run.yaml").write_text(f"run_id: {rid}\ncreated: 0\nupdated: 0\n"
                                        "inputs: {steps: 100, checkpoint_every: 0, checkpoint_dir: c}\n")
    r = subprocess.run([sys.executable, "-m", "hetctl", "status"], cwd=tmp_path, capture_output=True, text=True,
                       env={**os.environ, "COLUMNS": str(columns)}, timeout=60)
    assert r.returncode == 0 and rid in r.stdout, r.stdout
    assert max(len(line) for line in r.stdout.splitlines()) <= columns
    assert ("left out at this width" in r.stdout) == (columns == 80), r.stdout
    long_node = "gpu-node-" + "x" * 40 + "-17"
    console = Console(width=columns, record=True)
    cols = [Col("node", keep=True), *(Col(f"figure {i}", "right", drop=i) for i in range(1, 8))]
    console.print(fitted(console, cols, [[long_node, *(f"{1000.5 * i:.1f}" for i in range(1, 8))]]))
    text = console.export_text()
    assert long_node in text and "…" not in text and max(len(line) for line in text.splitlines()) <= columns
    left = " ".join(text.split()).split("left out at this width: ")[1]
    assert left.startswith("figure") and "figure 7" in left and "figure 1" not in left  # the highest drop goes first
