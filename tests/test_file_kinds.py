"""Each file says what it is, and a file of the wrong kind is refused as such, with the command that makes the right one."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from hetctl.cli import app
from hetctl.files.cluster import Cluster
from hetctl.files.kinds import kind_of
from hetctl.files.plan import Plan
from hetctl.files.yamlio import dump_yaml

INVENTORY = "nodes:\n  - {name: a, host: localhost, transport: local, workdir: /tmp/x}\n"
CLUSTER = "inventory: inv.yaml\nnodes:\n  - {name: a, host: localhost, chips: [{spec: H100, count: 2}]}\n"


def run(*args: str):
    return CliRunner(env={"COLUMNS": "300"}).invoke(app, list(args))


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    (tmp_path / "inv.yaml").write_text(INVENTORY)
    (tmp_path / "cluster.yaml").write_text(CLUSTER)
    r = run("plan", str(tmp_path / "cluster.yaml"), "-m", "llama2-7b", "-o", str(tmp_path / "plan"))
    assert r.exit_code == 0, r.output
    return {"inv": tmp_path / "inv.yaml", "cluster": tmp_path / "cluster.yaml", "plan": tmp_path / "plan" / "plan.yaml"}


def test_hetctl_writes_the_kind_line_first(files):
    body = [line for line in files["plan"].read_text().splitlines() if not line.startswith("#")]
    assert body[0] == "kind: plan"
    assert dump_yaml(Cluster(nodes=[]).model_dump(mode="json")).startswith("kind: cluster\n")
    assert list(Plan.model_fields)[0] == "kind"


@pytest.mark.parametrize("data, kind", [
    ({"nodes": [{"host": "a", "workdir": "/w"}]}, "inventory"), ({"defaults": {}, "nodes": []}, "inventory"),
    ({"nodes": [{"name": "a", "host": "a", "chips": []}]}, "cluster"), ({"probed_at": 1.0, "nodes": []}, "cluster"),
    ({"stages": [], "ranks": []}, "plan"), ({"kind": "plan"}, "plan"), ({"nodes": [{"host": "a"}]}, None),
    ({"defaults": {}, "findings": []}, None), ([1, 2], None),
])
def test_a_file_without_a_kind_line_is_known_by_its_keys(data, kind):
    assert kind_of(data) == kind


def test_an_inventory_given_to_plan(files):
    r = run("plan", str(files["inv"]), "-m", "tiny")
    assert r.exit_code == 2
    assert f"{files['inv']} is an inventory; plan takes a cluster file: run `hetctl probe -i {files['inv']} " \
           "-o cluster.yaml` first" in r.output
    assert "unknown key" not in r.output


def test_a_cluster_file_given_as_an_inventory(files):
    for args in (["probe", "-i", str(files["cluster"])], ["launch", str(files["plan"].parent), "-i", str(files["cluster"]),
                                                         "--dry-run"]):
        r = run(*args)
        assert r.exit_code == 2, r.output
        assert f"{files['cluster']} is a cluster file; -i takes an inventory" in r.output
        assert f"use `-i {files['inv']}`" in r.output and "probed_at" not in r.output


def test_the_wrong_file_given_to_launch(files):
    r = run("launch", str(files["cluster"]), "--dry-run")
    assert r.exit_code == 2 and f"{files['cluster']} is a cluster file; launch takes a plan: run `hetctl plan" in r.output
    r = run("launch", str(files["inv"]), "--dry-run")
    assert r.exit_code == 2 and f"{files['inv']} is an inventory; launch takes a plan" in r.output


def test_a_plan_given_to_plan_names_launch(files):
    r = run("plan", str(files["plan"]), "-m", "tiny")
    assert r.exit_code == 2 and f"to run this plan: `hetctl launch {files['plan'].parent}`" in r.output


def test_the_advice_works(files, tmp_path):
    """The command the refusal names, run as written, makes the right file."""
    r = run("plan", str(files["inv"]), "-m", "tiny")
    assert "hetctl probe -i" in r.output
    out = tmp_path / "probed.yaml"
    r = run("probe", "-i", str(files["inv"]), "-o", str(out))
    assert r.exit_code == 0, r.output
    assert kind_of(yaml.safe_load(out.read_text())) == "cluster"


def test_a_missing_cluster_file_names_probe_with_o(tmp_path):
    r = run("plan", str(tmp_path / "cluster.yaml"), "-m", "tiny")
    assert r.exit_code == 2
    assert "cluster file not found" in r.output and f"hetctl probe -i INVENTORY -o {tmp_path / 'cluster.yaml'}" in r.output
