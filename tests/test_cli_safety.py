"""The CLI with hostile strings from outside: printed as text, never as markup; user files never overwritten."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hetctl.errors import ConfigError


def cli(cwd, *args):
    return subprocess.run([sys.executable, "-m", "hetctl", *args], cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("name", ["[/]", "[bold]x[/bold]", "[red", "a[/]b[link=file:/etc/passwd]c"])
def test_markup_in_a_path_is_printed_as_it_is(tmp_path, name):
    r = cli(tmp_path, "plan", "-c", f"{name}.yaml", "-m", "tiny")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "MarkupError" not in r.stderr
    assert f"{name}.yaml" in r.stderr


def test_markup_in_what_a_node_reports_is_printed_as_it_is(tmp_path):
    """A node whose tool output (the chip model) and error carry markup: the probe table shows them verbatim."""
    from rich.console import Console

    from hetctl.cli import probeview
    from hetctl.files.cluster import Chip, Cluster, NodeFacts

    cluster = Cluster(nodes=[
        NodeFacts(name="n[/]1", host="h", chips=[Chip(index=0, vendor="nvidia", model="H100 [/]")]),
        NodeFacts(name="n2", host="h", reachable=False, error="ssh: [/bold] refused"),
    ])
    console = Console(record=True, width=200)
    old, probeview.out = probeview.out, console
    try:
        probeview.print_probe(cluster, bench=False)
    finally:
        probeview.out = old
    text = console.export_text()
    assert "n[/]1" in text and "H100 [/]" in text and "ssh: [/bold] refused" in text


def test_demo_never_overwrites_a_users_inventory(tmp_path):
    from hetctl.cli.demo import write_inventory

    mine = tmp_path / "inventory.yaml"
    mine.write_text("nodes: [{host: gpu-01}]\n")
    with pytest.raises(ConfigError, match="was not written by `hetctl demo`"):
        write_inventory(tmp_path)
    assert mine.read_text() == "nodes: [{host: gpu-01}]\n"
    fresh = tmp_path / "demo"
    assert write_inventory(fresh) == write_inventory(fresh)  # an earlier demo's folder is fine


def test_plan_keeps_a_users_own_scripts_in_the_nodes_folder(tmp_path):
    from hetctl.files.cluster import Chip, Cluster, NodeFacts
    from hetctl.plan.models import load_model
    from hetctl.plan.planner import plan_cluster
    from hetctl.plan.render import write_plan_dir

    cl = Cluster(nodes=[NodeFacts(name=n, host=n, tflops_override=1.0, memory_gb=16.0,
                                  chips=[Chip(index=0, vendor="cpu", memory_gb=16.0)]) for n in ("a", "b", "zz")])
    mine = tmp_path / "plan" / "nodes" / "my-helper.sh"
    mine.parent.mkdir(parents=True)
    mine.write_text("#!/bin/sh\necho mine\n")
    write_plan_dir(plan_cluster(cl, load_model("tiny")), tmp_path / "plan")
    first = sorted(p.name for p in mine.parent.glob("*.sh"))
    two = Cluster(nodes=cl.nodes[:2])
    write_plan_dir(plan_cluster(two, load_model("tiny")), tmp_path / "plan")  # zz's old script goes, mine stays
    assert "zz.sh" in first and sorted(p.name for p in mine.parent.glob("*.sh")) == ["a.sh", "b.sh", "my-helper.sh"]
    assert mine.read_text() == "#!/bin/sh\necho mine\n"


def test_a_planted_link_in_the_checkpoint_folder_is_never_followed(tmp_path):
    from hetctl.node import manifest

    ck = tmp_path / "ck"
    real = tmp_path / "elsewhere" / "step-9"
    real.mkdir(parents=True)
    (real / "w.pt").write_bytes(b"x")
    manifest.write_manifest(real, 9, "digest")
    ck.mkdir()
    (ck / "step-9").symlink_to(real)
    skipped = []
    assert manifest.latest_valid(ck, "digest", on_skip=skipped.append) is None
    assert "symbolic link" in skipped[0].problems[0]


def test_version_needs_no_command(tmp_path):
    """``hetctl --version`` prints the version and exits 0, as ``ssh -V`` or ``torchrun --version`` do."""
    from hetctl import __version__

    r = cli(tmp_path, "--version")
    assert (r.returncode, r.stdout.strip()) == (0, __version__), r.stderr
