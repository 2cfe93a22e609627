"""``hetctl plan`` end to end: the real CLI on cluster files, including one written by a real probe.

The probe test runs ``hetctl probe`` against real sshd hosts on loopback whose
vendor tools replay captured output (as ``tests/test_probe_cli.py`` does), then
plans on the cluster file it wrote.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hetctl.files.plan import Plan
from hetctl.files.cluster import Cluster
from hetctl.files.yamlio import load_model, save_model
from tests.test_plan_invariants import check_invariants, node

SAMPLES = Path(__file__).parent / "fixtures" / "smi-samples"


def hetctl(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hetctl", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout, env={**os.environ, "COLUMNS": "200"})


@pytest.fixture
def site(tmp_path: Path) -> Path:
    """A cluster file as probe writes it: two H100 servers, one Ascend server, one unreachable node."""
    cluster = Cluster(inventory="inventory.yaml", nodes=[
        node("gpu-01", "nvidia", "NVIDIA H100 80GB HBM3", 8, 79.65, 989.4, 989.4, labels={"switch": "leaf-1"}),
        node("gpu-02", "nvidia", "NVIDIA H100 80GB HBM3", 8, 79.65, 989.4, 989.4, labels={"switch": "leaf-1"}),
        node("npu-1", "ascend", "910B2C", 8, 64.0, 376.0, 376.0, labels={"switch": "leaf-2"}),
        node("npu-2", "ascend", "910B2C", 8, 64.0, 376.0, 376.0, reachable=False),
    ])
    save_model(tmp_path / "cluster.yaml", cluster, header="hetctl probe -i inventory.yaml")
    (tmp_path / "inventory.yaml").write_text("nodes: []\n")
    return tmp_path


def test_plan_writes_plan_and_scripts_and_prints_the_estimate(site):
    r = hetctl("plan", "--cluster", "cluster.yaml", "--model", "llama2-7b", "--global-batch", "256",
               "--framework", "flagscale", "-o", "out", "--explain", cwd=site)
    assert r.returncode == 0, r.stderr
    plan = load_model(site / "out" / "plan.yaml", Plan)
    check_invariants(plan, load_model(site / "cluster.yaml", Cluster))
    assert plan.inventory == str((site / "inventory.yaml").resolve())
    assert plan.cluster == "cluster.yaml" and plan.framework == "flagscale"
    assert sorted(p.name for p in (site / "out" / "nodes").iterdir()) == sorted(f"{n}.sh" for n in plan.nodes)
    assert "npu-2" not in plan.nodes
    assert "warning: node npu-2 left out: unreachable (ssh: connect timed out)" in r.stderr
    for text in ("llama2-7b: pp", "estimate (1F1B simulation)", "uniform", "proportional", "ideal",
                 "• layout:", "• stage order per replica", "• pipeline p2p bytes per step:"):
        assert text in r.stdout
    assert "Traceback" not in r.stderr


def test_json_is_the_plan_file_and_the_cluster_may_be_positional(site):
    r = hetctl("plan", "cluster.yaml", "-m", "tiny", "--json", "-o", "p", cwd=site)
    assert r.returncode == 0, r.stderr
    printed = Plan.model_validate(json.loads(r.stdout))
    assert printed == load_model(site / "p" / "plan.yaml", Plan)
    assert len({s.tp for s in printed.stages}) == 1  # hetctl's reference trainer: one TP degree for every stage


def test_pins_are_honoured(site):
    # pp 3 × dp 2 × tp 4 needs the Ascend node too, which one Megatron job cannot join: --render-anyway.
    r = hetctl("plan", "-m", "llama2-7b", "--global-batch", "64", "--pp", "3", "--dp", "2",
               "--framework", "megatron", "--tp", "4", "-o", "p", "--render-anyway", cwd=site)
    assert r.returncode == 0, r.stderr
    plan = load_model(site / "p" / "plan.yaml", Plan)
    assert (plan.parallel.pp, plan.parallel.dp) == (3, 2) and {s.tp for s in plan.stages} == {4}
    assert r.stderr.splitlines()[-1].startswith("warning: one megatron job cannot span vendors")


@pytest.mark.parametrize("args, code, text", [
    (["-m", "llama2-70b", "--global-batch", "8", "--pp", "1", "--framework", "hetctl"], 4, "no plan fits in memory"),
    (["-m", "gpt-9"], 2, "unknown model 'gpt-9'"),
    (["-m", "tiny", "--dp", "3"], 2, "--dp 3: global batch 16 is not divisible"),
    (["-m", "tiny", "--framework", "jax"], 2, "--framework jax: unknown"),
    (["-m", "tiny", "-c", "missing.yaml"], 2, "missing.yaml: cluster file not found"),
])
def test_mistakes_are_one_clear_line_and_an_exit_code(site, args, code, text):
    r = hetctl("plan", *args, cwd=site)
    assert r.returncode == code, r.stderr
    assert text in r.stderr and "Traceback" not in r.stderr
    assert r.stderr.startswith("error:")


def test_a_malformed_cluster_file_names_file_line_and_key(site):
    data = yaml.safe_load((site / "cluster.yaml").read_text())
    data["nodes"][0]["chips"][0]["vendr"] = "nvidia"
    (site / "bad.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    r = hetctl("plan", "bad.yaml", "-m", "tiny", cwd=site)
    assert r.returncode == 2
    assert "bad.yaml:" in r.stderr and "nodes[0].chips[0].vendr: unknown key" in r.stderr


# -- probe → plan on real sshd hosts ---------------------------------------------------

needs_sshd = pytest.mark.sshd


@needs_sshd
def test_plan_on_the_cluster_file_a_real_probe_wrote(make_sshd_cluster, tmp_path):
    from tests.test_collector import make_sysfs
    from tests.test_probe_cli import H200_CAPTURE, nvidia_query_csv
    from hetctl.probe.parsers.nvidia_smi import CSV_FIELDS

    names = ["h200", "ascend", "metax", "cpu"]
    c = make_sshd_cluster(names=names, extra_env={"h200": {"CUDA_VISIBLE_DEVICES": ""}})
    c["h200"].install_tool("nvidia-smi", {
        "--query-gpu=*": nvidia_query_csv(H200_CAPTURE, CSV_FIELDS),
        "-L": SAMPLES / "nvidia-smi_L_h200.txt",
        "": SAMPLES / "nvidia-smi_plain_h200.txt",
    })
    make_sysfs(c["h200"].sysfs_root, pci=[("0000:83:00.0", "0x10de", "0x2335", "0x030200")],
               dev=["nvidia0", "nvidiactl"], nics=[{"name": "eno1", "speed": "25000"}])
    c["ascend"].install_tool("npu-smi", {"info": SAMPLES / "npu-smi_info_910b2c_paddle-docs.txt"})
    make_sysfs(c["ascend"].sysfs_root, dev=["davinci0", "davinci1", "davinci_manager"],
               nics=[{"name": "enp1", "speed": "100000"}])
    c["metax"].install_tool("mx-smi", {"": SAMPLES / "mx-smi_c550x8.txt"})
    inv = c.inventory()
    for n in inv["nodes"]:  # MetaX C550 has no public TFLOPS and a CPU none at all: the inventory says
        n["tflops"] = {"metax": 240.0, "cpu": 0.5}.get(n["name"])
        if n["tflops"] is None:
            del n["tflops"]
    (tmp_path / "inventory.yaml").write_text(yaml.safe_dump(inv, sort_keys=False))
    r = hetctl("probe", "-i", "inventory.yaml", "-o", "cluster.yaml", cwd=tmp_path)
    assert r.returncode == 0, r.stderr

    r = hetctl("plan", "-c", "cluster.yaml", "-m", "llama2-7b", "--global-batch", "64", "--framework",
               "flagscale", "--explain", "-o", "plan", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    cluster = load_model(tmp_path / "cluster.yaml", Cluster)
    plan = load_model(tmp_path / "plan" / "plan.yaml", Plan)
    check_invariants(plan, cluster)
    assert plan.inventory == str(tmp_path / "inventory.yaml")
    used = {s.vendor for s in plan.stages}
    assert "nvidia" in used and used <= {"nvidia", "ascend", "metax", "cpu"}
    assert "metax" in used  # 8 chips at 240 TFLOPS: a plan without them would be a planner bug
    assert "metax MetaX C550: bf16 at 240 TFLOPS per chip (inventory tflops)" in r.stdout
    by_vendor = {s.vendor: s for s in plan.stages}
    assert by_vendor["nvidia"].memory_limit_gb == cluster.nodes[0].chips[0].memory_gb
    assert by_vendor["nvidia"].visible_devices_env == "CUDA_VISIBLE_DEVICES"
    assert by_vendor["ascend"].device_type == "npu" and by_vendor["ascend"].backend == "hccl"
    for n in plan.nodes:
        text = (tmp_path / "plan" / "nodes" / f"{n}.sh").read_text()
        assert "--enable-hetero" in text and subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0


# -- issue 31, part 3: a framework that cannot run a plan is refused, not rendered ----------------------------


def hetctl_merged(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``hetctl`` with stdout and stderr in one stream, in the order a terminal shows them."""
    return subprocess.run([sys.executable, "-m", "hetctl", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, cwd=cwd, timeout=300, env={**os.environ, "COLUMNS": "200"})


@pytest.fixture
def three_vendors(tmp_path: Path) -> Path:
    """The reporter's cluster: H100, Ascend 910B and MI300X, with an inventory of local nodes (for launch --dry-run)."""
    cluster = Cluster(inventory="inventory.yaml", nodes=[
        node("gpu-01", "nvidia", "NVIDIA H100 80GB HBM3", 8, 79.65, 989.4, 989.4),
        node("npu-01", "ascend", "910B2C", 8, 64.0, 376.0, 376.0),
        node("mi-01", "amd", "AMD Instinct MI300X", 8, 192.0, 1307.4, 1307.4),
    ])
    save_model(tmp_path / "cluster.yaml", cluster, header="hetctl probe -i inventory.yaml")
    (tmp_path / "inventory.yaml").write_text(yaml.safe_dump({
        "defaults": {"transport": "local", "workdir": str(tmp_path / "work")},
        "nodes": [{"name": n.name, "host": "localhost"} for n in cluster.nodes]}))
    return tmp_path


REFUSED = ("one {fw} job cannot span vendors ({vendors}): it runs one collective library for every rank; "
           "use --framework hetctl (or flagscale; torchrun if your script spans vendors)")


@pytest.mark.parametrize("fw, model, vendors", [("megatron", "llama3-70b", "amd, ascend, nvidia"),
                                                ("deepspeed", "llama2-7b", "amd, nvidia")])
@pytest.mark.parametrize("json_out", [False, True])
def test_a_plan_across_vendors_is_refused_for_megatron_and_deepspeed(three_vendors, fw, model, vendors, json_out):
    r = hetctl("plan", "-m", model, "--framework", fw, "-o", "out", *(["--json"] if json_out else []),
               cwd=three_vendors)
    assert r.returncode == 4, r.stderr
    first, *rest = r.stderr.splitlines()
    assert first == f"error: plan: {REFUSED.format(fw=fw, vendors=vendors)}"  # one line naming the frameworks that can run it
    assert len(rest) == 1 and rest[0].startswith("hint:") and "--render-anyway" in rest[0]
    assert r.stdout == "" and not (three_vendors / "out").exists(), "nothing printed or written"


def test_a_single_vendor_megatron_plan_is_unaffected(three_vendors):
    one = load_model(three_vendors / "cluster.yaml", Cluster)
    save_model(three_vendors / "gpu.yaml", one.model_copy(update={"nodes": one.nodes[:1]}))
    r = hetctl("plan", "gpu.yaml", "-m", "llama2-7b", "--framework", "megatron", "-o", "out", cwd=three_vendors)
    assert r.returncode == 0, r.stderr
    assert "vendors" not in r.stderr and r.stderr.splitlines()[-1].startswith("wrote ")
    plan = load_model(three_vendors / "out" / "plan.yaml", Plan)
    assert plan.rendered_anyway is None
    assert "WARNING" not in (three_vendors / "out" / "nodes" / "gpu-01.sh").read_text()


def test_render_anyway_writes_the_scripts_and_warns_last_and_launch_dry_run_repeats_it(three_vendors):
    d, why = three_vendors, REFUSED.format(fw="megatron", vendors="amd, ascend, nvidia")
    r = hetctl_merged("plan", "-m", "llama3-70b", "--framework", "megatron", "-o", "out", "--render-anyway",
                      "--explain", cwd=d)
    assert r.returncode == 0, r.stdout
    lines = r.stdout.splitlines()
    assert lines[-1] == f"warning: {why}; the scripts were written anyway (--render-anyway)"
    assert lines[-2].startswith("wrote ") and sum("cannot span vendors" in line for line in lines) == 1
    plan = load_model(d / "out" / "plan.yaml", Plan)
    assert plan.rendered_anyway == why and {s.vendor for s in plan.stages} == {"amd", "ascend", "nvidia"}
    assert sorted(p.name for p in (d / "out" / "nodes").iterdir()) == ["gpu-01.sh", "mi-01.sh", "npu-01.sh"]

    r = hetctl("plan", "-m", "llama3-70b", "--framework", "megatron", "-o", "out2", "--render-anyway", "--json",
               cwd=d)
    assert r.returncode == 0, r.stderr
    assert Plan.model_validate(json.loads(r.stdout)).rendered_anyway == why
    assert r.stderr.splitlines()[-1] == f"warning: {why}; the scripts were written anyway (--render-anyway)"

    warning = f"warning: {why}; launch runs it only because `hetctl plan --render-anyway` wrote it"
    r = hetctl_merged("launch", "out", "--dry-run", cwd=d)
    assert r.returncode == 0, r.stdout
    assert r.stdout.startswith("dry run") and r.stdout.splitlines()[-1] == warning
    r = hetctl("launch", "out", "--dry-run", "--json", cwd=d)
    assert r.returncode == 0, r.stderr
    assert "warning: " + json.loads(r.stdout)["warning"] == warning and r.stderr.splitlines()[-1] == warning


def test_launch_refuses_a_plan_across_vendors_that_was_not_rendered_anyway(three_vendors):
    """A hand-made or older plan.yaml: refused before anything starts, dry run or not."""
    d = three_vendors
    assert hetctl("plan", "-m", "llama3-70b", "--framework", "megatron", "-o", "out", "--render-anyway",
                  cwd=d).returncode == 0
    data = yaml.safe_load((d / "out" / "plan.yaml").read_text())
    del data["rendered_anyway"]
    (d / "out" / "plan.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    for extra in (["--dry-run"], ["--json"]):
        r = hetctl("launch", "out", *extra, cwd=d)
        assert r.returncode == 4, r.stderr
        assert r.stderr.splitlines()[0] == f"error: plan: {REFUSED.format(fw='megatron', vendors='amd, ascend, nvidia')}" and r.stdout == ""
    assert not (d / "runs").exists() and not (d / "work").exists(), "nothing started"
    r = hetctl("launch", "out", "--dry-run", "--entry", "train.py", cwd=d)  # the user's own entry: not Megatron
    assert r.returncode == 0 and "cannot span vendors" not in r.stdout + r.stderr, r.stderr


def test_plan_schedule_option_zb_h1_and_its_refusal(site):
    r = hetctl("plan", "--cluster", "cluster.yaml", "--model", "llama2-7b", "--global-batch", "64",
               "--framework", "hetctl", "--schedule", "zb-h1", "-o", "zb", cwd=site)
    assert r.returncode == 0, r.stderr
    plan = load_model(site / "zb" / "plan.yaml", Plan)
    assert plan.parallel.schedule == "zb-h1" and "estimate (ZB-H1 simulation)" in r.stdout, r.stdout
    assert "ZB-H1 schedule" in r.stdout and any(s.defer for s in plan.stages)
    bad = hetctl("plan", "--cluster", "cluster.yaml", "--model", "llama2-7b", "--framework", "megatron",
                 "--schedule", "zb-h1", "-o", "mg", cwd=site)
    assert bad.returncode != 0 and "--schedule zb-h1: megatron has no zero-bubble schedule" in bad.stderr
    assert "Traceback" not in bad.stderr and not (site / "mg" / "plan.yaml").exists()
