"""Cluster files written by hand: ``count:``, chips named as people name them, anchors, and every example file."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hetctl.cli import app
from hetctl.errors import HetctlError
from hetctl.files.cluster import Cluster
from hetctl.files.inventory import load_inventory
from hetctl.files.yamlio import dump_yaml, load_model
from hetctl.plan.models import load_model as load_spec
from hetctl.plan.models import presets
from hetctl.probe import specs

ROOT = Path(__file__).resolve().parent.parent


def cluster(tmp_path: Path, chips: str) -> Cluster:
    p = tmp_path / "cluster.yaml"
    p.write_text(f"nodes:\n  - name: n1\n    host: 10.0.0.1\n    chips:\n{chips}")
    return load_model(p, Cluster, "cluster file")


def error(tmp_path: Path, chips: str) -> str:
    with pytest.raises(HetctlError) as e:
        cluster(tmp_path, chips)
    return e.value.message


@pytest.mark.parametrize("name, row", [
    ("NVIDIA H100 80GB HBM3", "nvidia/h100-sxm5"), ("H100", "nvidia/h100-sxm5"), ("nvidia/h100-sxm5", "nvidia/h100-sxm5"),
    ("MI300X", "amd/instinct-mi300x"), ("AMD Instinct MI300X", "amd/instinct-mi300x"), ("910B3", "ascend/ascend-910b3"),
    ("Ascend 910B2C", "ascend/ascend-910b2"), ("BI-V150", "iluvatar/bi-v150"), ("Gaudi2", "gaudi/gaudi2-hl-225"),
])
def test_names_people_write_find_their_row(name, row):
    assert specs.find(name).id == row


@pytest.mark.parametrize("name", ["910B", "MLU370"])
def test_a_name_that_fits_rows_with_different_figures_is_refused(name):
    with pytest.raises(specs.AmbiguousSpec, match=f"'{name}' fits [0-9]+ rows"):
        specs.find(name)


def test_count_expands_and_the_table_fills_the_figures(tmp_path):
    c = cluster(tmp_path, "      - {model: NVIDIA H100 80GB HBM3, count: 8}\n      - {spec: MI300X, count: 2}\n")
    chips = c.nodes[0].chips
    assert [(ch.vendor, ch.index) for ch in chips] == [("nvidia", i) for i in range(8)] + [("amd", 0), ("amd", 1)]
    h100 = specs.find("H100")
    assert chips[0].tflops == h100.tflops and chips[0].memory_gb == h100.memory_gb and chips[0].spec == h100.id
    assert chips[0].model == "NVIDIA H100 80GB HBM3" and chips[-1].model == "Instinct MI300X"


def test_written_values_win_and_indices_continue(tmp_path):
    c = cluster(tmp_path, "      - {spec: 910B3, count: 2, memory_gb: 60, index: 4}\n      - {spec: 910B3}\n")
    assert [(ch.index, ch.memory_gb) for ch in c.nodes[0].chips] == [(4, 60), (5, 60), (6, 64)]


@pytest.mark.parametrize("chips, needle", [
    ("      - {spec: 910B, count: 8}\n", ":5: nodes[0].chips[0].spec: '910B' fits 4 rows of the chip table"),
    ("      - {spec: H1000}\n", ":5: nodes[0].chips[0].spec: 'H1000' is not in the chip table"),
    ("      - {spec: H100, vendor: amd}\n", ":5: nodes[0].chips[0].vendor: 'H100' is nvidia's H100 SXM5"),
    ("      - {spec: H100, count: 0}\n", ":5: nodes[0].chips[0].count: count must be a whole number"),
    ("      - {spec: H100, count: true}\n", ":5: nodes[0].chips[0].count: count must be a whole number"),
    ("      - {spec: H100, count: 1000000000}\n", ":5: nodes[0].chips[0].count: more than 4096 chips on one node"),
])
def test_bad_hand_written_chips_are_one_line_naming_the_entry(tmp_path, chips, needle):
    assert needle in error(tmp_path, chips)


def test_a_probe_written_file_is_read_as_written(tmp_path):
    """Files probe wrote give every figure: nothing is looked up, a spec id the table no longer has is kept."""
    chip = {"index": 3, "vendor": "nvidia", "model": "NVIDIA H100 80GB HBM3", "memory_gb": 79.6,
            "tflops": {"bf16": 1.0, "fp16": None, "fp32": None}, "spec": "nvidia/retired-row"}
    p = tmp_path / "c.yaml"
    p.write_text(dump_yaml({"nodes": [{"name": "a", "host": "a", "chips": [chip]}]}))
    assert load_model(p, Cluster).nodes[0].chips[0].model_dump(include=set(chip)) == chip


def test_anchors_share_a_chip_list_between_nodes(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("nodes:\n  - {name: a, host: a, chips: &c [{spec: MI300X, count: 4}]}\n"
                 "  - {name: b, host: b, chips: *c}\n  - {name: c, host: c, chips: [{<<: {spec: H100}, count: 2}]}\n")
    nodes = load_model(p, Cluster).nodes
    assert [len(n.chips) for n in nodes] == [4, 4, 2] and nodes[2].chips[1].vendor == "nvidia"


def test_the_docs_example_cluster_loads_and_plans(tmp_path):
    text = (ROOT / "docs" / "cluster.md").read_text()
    example = re.search(r"## Writing a cluster file by hand\n.*?```yaml\n(.*?)```", text, flags=re.S).group(1)
    (tmp_path / "cluster.yaml").write_text(example)
    r = CliRunner().invoke(app, ["plan", str(tmp_path / "cluster.yaml"), "-m", "llama3-8b", "-o", str(tmp_path / "plan"),
                                 "--json"])
    assert r.exit_code == 0, r.output
    assert {s["vendor"] for s in json.loads(r.stdout)["stages"]} <= {"nvidia", "amd", "ascend"}


def _examples() -> list[Path]:
    skip = {"tests", "site", ".git", "hetctl"}  # hetctl/data is the tables, loaded by their own tests
    return sorted(p for p in ROOT.rglob("*.y*ml") if not skip & set(p.relative_to(ROOT).parts))


LOADERS = {
    "bench/clusters": lambda p: load_model(p, Cluster, "cluster file"),
    "inventories": load_inventory,
    "scripts": lambda p: load_spec(str(p)),
}


def test_every_example_file_in_the_repository_loads():
    """A new example YAML must load with hetctl's own loader (and be listed here by its folder)."""
    seen = []
    for path in _examples():
        if path.name == "mkdocs.yml":
            continue
        folder = str(path.parent.relative_to(ROOT))
        assert folder in LOADERS, f"{path}: an example YAML in a folder this test does not know; add its loader"
        LOADERS[folder](path)
        seen.append(folder)
    assert set(seen) == set(LOADERS)


def test_hetctl_plan_takes_the_repositorys_own_example(tmp_path):
    r = CliRunner().invoke(app, ["plan", str(ROOT / "bench/clusters/four-to-one.yaml"), "-m", "llama2-7b",
                                 "-o", str(tmp_path / "plan"), "--json"])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "plan" / "plan.yaml").exists()


def test_hetctl_chips_lists_and_finds():
    r = CliRunner().invoke(app, ["chips", "--json"])
    assert r.exit_code == 0
    assert [row["id"] for row in json.loads(r.stdout)] == [row.id for row in specs.table()]
    r = CliRunner().invoke(app, ["chips", "NVIDIA H100 80GB HBM3", "--json"])
    assert [row["id"] for row in json.loads(r.stdout)] == ["nvidia/h100-sxm5"]
    r = CliRunner().invoke(app, ["chips", "910B"])
    assert r.exit_code == 2 and "fits 4 rows" in r.output
    r = CliRunner().invoke(app, ["chips", "--vendor", "ascend", "--json"])
    assert {row["vendor"] for row in json.loads(r.stdout)} == {"ascend"}


def test_hetctl_models_lists_the_presets():
    r = CliRunner().invoke(app, ["models", "--json"])
    assert r.exit_code == 0
    rows = json.loads(r.stdout)
    assert [row["name"] for row in rows] == list(presets())
    assert {row["name"]: row["global_batch"] for row in rows} == {n: p.global_batch for n, p in presets().items()}
    r = CliRunner(env={"COLUMNS": "80"}).invoke(app, ["models"])
    assert r.exit_code == 0 and all(name in r.output for name in presets())
