"""``hetctl probe`` end to end: the real CLI against real sshd hosts on loopback.

Each host simulates one kind of node: vendor tools on its PATH replay real
captures from ``tests/fixtures/smi-samples``, and its ``HETCTL_SYSFS_ROOT`` holds
the PCI functions, ``/dev`` nodes and NICs it pretends to have. Everything else
(ssh, the collector, parsing, the cluster file) is hetctl's real code.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hetctl.files.cluster import Cluster, Tflops
from hetctl.probe.parsers.nvidia_smi import CSV_FIELDS
from hetctl.files.yamlio import load_model
from tests.helpers.sshd import SshdCluster
from tests.test_collector import make_sysfs

SAMPLES = Path(__file__).parent / "fixtures" / "smi-samples"
H200_CAPTURE = SAMPLES / "nvidia_gpu_exporter_captures" / "linux-x86_64__nvidia-h200__590.48.01.txt"


def nvidia_query_csv(capture: Path, fields: tuple[str, ...]) -> str:
    """What ``nvidia-smi --query-gpu=<fields> --format=csv,noheader,nounits`` prints on the captured machine.

    The exporter capture holds the real answer to a much wider query (with a
    header and units); this selects the asked-for columns and drops the units,
    as nvidia-smi itself does for ``noheader,nounits``.
    """
    lines = capture.read_text().splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("# $ nvidia-smi --query-gpu="))
    body = [ln for ln in lines[start + 1:] if not ln.startswith("#")]
    header = [h.strip() for h in body[0].split(",")]
    names = [h.split(" [")[0] for h in header]
    rows = []
    for ln in body[1:]:
        if not ln.strip():
            break
        cells = [c.strip() for c in ln.split(", ")]
        picked = []
        for f in fields:
            value = cells[names.index(f)]
            unit = header[names.index(f)].partition(" [")[2].rstrip("]")
            picked.append(value.removesuffix(f" {unit}") if unit else value)
        rows.append(", ".join(picked))
    return "\n".join(rows) + "\n"


def hetctl(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hetctl", *args], capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "COLUMNS": "200"},
    )


def fake_dist(folder: Path, name: str, version: str) -> Path:
    """Package metadata for ``name`` (a vendor torch plugin the node claims to have)."""
    info = folder / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return folder


MIXED = ["h200", "ascend", "mthreads", "metax", "cpu", "enflame", "biren"]


@pytest.fixture
def mixed(make_sshd_cluster, tmp_path_factory) -> SshdCluster:
    """Seven real sshd hosts, one kind of node each."""
    plugins = fake_dist(tmp_path_factory.mktemp("site"), "torch_musa", "1.3.0")
    # h200's CUDA runtime sees no device even where the test machine has a GPU: its chip is replayed.
    c = make_sshd_cluster(names=MIXED, extra_env={"mthreads": {"PYTHONPATH": str(plugins)},
                                                  "h200": {"CUDA_VISIBLE_DEVICES": ""}})
    c["h200"].install_tool("nvidia-smi", {
        "--query-gpu=*": nvidia_query_csv(H200_CAPTURE, CSV_FIELDS),
        "-L": SAMPLES / "nvidia-smi_L_h200.txt",
        "": SAMPLES / "nvidia-smi_plain_h200.txt",
    })
    make_sysfs(
        c["h200"].sysfs_root,
        pci=[("0000:83:00.0", "0x10de", "0x2335", "0x030200")],
        dev=["nvidia0", "nvidiactl"],
        nics=[{"name": "lo", "type": "772", "physical": False}, {"name": "eno1", "speed": "25000"},
              {"name": "ibp1", "type": "32"}],
        rdma=[{"name": "mlx5_0", "link_layer": "InfiniBand", "rate": "400 Gb/sec (4X NDR)", "netdev": "ibp1"}],
        modules={"nvidia": "590.48.01"},
    )
    c["ascend"].install_tool("npu-smi", {"info": SAMPLES / "npu-smi_info_910b2c_paddle-docs.txt"})
    make_sysfs(c["ascend"].sysfs_root, dev=["davinci0", "davinci1", "davinci_manager"],
               nics=[{"name": "enp1", "speed": "100000"}])
    c["mthreads"].install_tool("mthreads-gmi", {"": SAMPLES / "mthreads-gmi_s4000.txt"})
    c["metax"].install_tool("mx-smi", {"": SAMPLES / "mx-smi_c550x8.txt"})
    make_sysfs(c["enflame"].sysfs_root, pci=[("0000:01:00.0", "0x1e36", "0xc033", "0x120000"),
                                             ("0000:09:00.0", "0x1e36", "0xc033", "0x120000")])
    make_sysfs(c["biren"].sysfs_root, dev=["biren/card_0", "biren/card_1", "biren/card_2", "biren/card_3"])
    return c


def _chips(node):
    return [(c.index, c.vendor, c.model, c.memory_gb, c.pci_bus_id, c.source) for c in node.chips]


def test_probe_mixed_cluster_writes_the_right_cluster_file(mixed, tmp_path):
    inv = mixed.write_inventory(tmp_path / "inventory.yaml")
    out = tmp_path / "cluster.yaml"
    proc = hetctl("probe", "-i", str(inv), "-o", str(out))
    assert proc.returncode == 0, proc.stderr + proc.stdout
    cluster = load_model(out, Cluster, "cluster file")
    nodes = {n.name: n for n in cluster.nodes}
    assert [n.name for n in cluster.nodes] == MIXED
    assert all(n.reachable and n.error is None for n in cluster.nodes)
    assert cluster.inventory == str(inv)

    h200 = nodes["h200"]
    assert _chips(h200) == [(0, "nvidia", "NVIDIA H200", 140.4, "0000:83:00.0", "nvidia-smi-csv")]
    assert h200.chips[0].tflops == Tflops(bf16=989.4, fp16=989.4, fp32=66.9)
    assert h200.chips[0].measured_tflops is None
    assert h200.software.comm_library == "NCCL" and h200.software.driver == "nvidia 590.48.01"
    assert {(n.name, n.kind, n.speed_gbps) for n in h200.nics} == {
        ("lo", "loopback", None), ("eno1", "ethernet", 25.0), ("ibp1", "ib", 400.0)}

    assert _chips(nodes["ascend"]) == [(0, "ascend", "910B2C", 64.0, "0000:5a:00.0", "npu-smi"),
                                       (1, "ascend", "910B2C", 64.0, "0000:29:00.0", "npu-smi")]
    assert all(c.tflops == Tflops(bf16=376.0, fp16=376.0, fp32=None) for c in nodes["ascend"].chips)
    assert nodes["ascend"].software.comm_library == "HCCL"
    assert [(n.name, n.kind, n.speed_gbps) for n in nodes["ascend"].nics] == [("enp1", "ethernet", 100.0)]

    mt = nodes["mthreads"]
    assert _chips(mt) == [(0, "mthreads", "MTT S4000", 32.0, "0000:08:00.0", "mthreads-gmi")]
    assert mt.chips[0].tflops == Tflops(bf16=100.0, fp16=100.0, fp32=25.0)
    assert mt.software.vendor_plugin == "torch_musa 1.3.0" and mt.software.comm_library == "MCCL"

    metax = nodes["metax"].chips
    assert [(c.index, c.vendor, c.model, c.memory_gb) for c in metax] == [(i, "metax", "MetaX C550", 64.0) for i in range(8)]
    assert [c.pci_bus_id for c in metax] == ["0000:0f:00.0", "0000:34:00.0", "0000:48:00.0", "0000:5a:00.0",
                                             "0000:87:00.0", "0000:ae:00.0", "0000:c2:00.0", "0000:d7:00.0"]
    assert all(c.tflops == Tflops() for c in metax)  # no public figure: unknown, never guessed

    cpu = nodes["cpu"]
    assert [(c.index, c.vendor, c.model, c.source) for c in cpu.chips] == [(0, "cpu", cpu.cpu.model, "cpu")]
    assert cpu.memory_gb and cpu.memory_gb > 0 and cpu.chips[0].memory_gb == cpu.memory_gb
    assert cpu.software.comm_library == "gloo" and cpu.nics == []

    assert _chips(nodes["enflame"]) == [(0, "enflame", "unknown", None, "0000:01:00.0", "pci"),
                                        (1, "enflame", "unknown", None, "0000:09:00.0", "pci")]
    assert _chips(nodes["biren"]) == [(i, "biren", "unknown", None, None, "dev") for i in range(4)]

    for n in cluster.nodes:
        assert n.software.python == ".".join(map(str, sys.version_info[:3]))
        assert n.cpu.cores and n.cpu.cores >= 1

    table = proc.stdout
    assert "7/7 nodes answered" in table
    for text in ("NVIDIA H200", "910B2C", "MTT S4000", "MetaX C550", "enflame", "biren", "ib 400G"):
        assert text in table


def test_probe_json_prints_the_same_facts(mixed, tmp_path):
    inv = mixed.write_inventory(tmp_path / "inventory.yaml")
    out = tmp_path / "cluster.yaml"
    proc = hetctl("probe", "-i", str(inv), "--json", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    from_json = Cluster.model_validate(json.loads(proc.stdout))
    from_file = load_model(out, Cluster)
    assert from_json == from_file
    assert [len(n.chips) for n in from_json.nodes] == [1, 2, 1, 8, 1, 2, 4]


def test_failing_nodes_get_their_row_and_exit_1(make_sshd_cluster, tmp_path):
    c = make_sshd_cluster(names=["good", "down", "rekeyed", "wrongkey", "nopython", "brokenpy"])
    c["good"].install_tool("mx-smi", {"": SAMPLES / "mx-smi_c500_v2.3.1_newlayout.txt"})
    c["brokenpy"].install_script("python-broken", "#!/bin/sh\necho 'Fatal Python error: init_fs_encoding' >&2\nexit 1\n")
    # known_hosts lies about rekeyed's key (a reinstalled node, or an attack): strict policy must refuse.
    other = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    other_pub = " ".join(other.with_suffix(".pub").read_text().split()[:2])
    known = [f"{h.known_hosts_name} {other_pub if h.name == 'rekeyed' else h.host_public_key}" for h in c]
    c.known_hosts.write_text("\n".join(known) + "\n")
    before = c.known_hosts.read_text()
    c["down"].kill()  # its port is now closed
    data = c.inventory()
    overrides = {"wrongkey": {"identity_file": str(other)}, "nopython": {"python": "/nonexistent/python3"},
                 "brokenpy": {"python": "python-broken"}}
    for n in data["nodes"]:
        n.update(overrides.get(n["name"], {}))
    inv = tmp_path / "inventory.yaml"
    inv.write_text(yaml.safe_dump(data))
    out = tmp_path / "cluster.yaml"

    proc = hetctl("probe", "-i", str(inv), "-o", str(out))
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    cluster = load_model(out, Cluster)
    rows = {n.name: n for n in cluster.nodes}
    good = rows["good"]
    assert good.reachable and [(c.vendor, c.model) for c in good.chips] == [("metax", "MetaX C500")]
    errors = {n: rows[n].error for n in rows if n != "good"}
    assert all(not rows[n].reachable and rows[n].chips == [] for n in errors)
    assert all("\n" not in e for e in errors.values())
    assert "connection refused" in errors["down"]
    assert "known_hosts" in errors["rekeyed"] and "rekeyed" in errors["rekeyed"]
    assert "refused authentication" in errors["wrongkey"]
    assert "`/nonexistent/python3` not found" in errors["nopython"]
    assert "collector exited 1" in errors["brokenpy"] and "init_fs_encoding" in errors["brokenpy"]
    assert c.known_hosts.read_text() == before
    assert "5 of 6 node(s) did not answer" in proc.stderr
    assert "1/6 nodes answered" in proc.stdout


def test_bench_measures_where_torch_runs_and_says_why_elsewhere(mixed, tmp_path):
    mixed["metax"].install_script("python-notorch", f"#!/bin/sh\nexec {sys.executable} -S \"$@\"\n")
    data = mixed.inventory()
    data["nodes"] = [n for n in data["nodes"] if n["name"] in ("cpu", "h200", "mthreads", "metax", "biren")]
    for n in data["nodes"]:
        if n["name"] == "metax":
            n["python"] = "python-notorch"
    inv = tmp_path / "inventory.yaml"
    inv.write_text(yaml.safe_dump(data))
    out = tmp_path / "cluster.yaml"
    proc = hetctl("probe", "-i", str(inv), "--bench", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    rows = {n.name: n for n in load_model(out, Cluster).nodes}

    cpu = rows["cpu"]
    assert cpu.bench_error is None
    assert cpu.chips[0].measured_tflops is not None and cpu.chips[0].measured_tflops.fp32 > 0
    assert "torch.cuda is not available" in rows["h200"].bench_error
    assert rows["h200"].chips[0].measured_tflops is None and rows["h200"].chips[0].tflops.bf16 == 989.4
    assert "torch_musa is not importable" in rows["mthreads"].bench_error
    assert rows["metax"].software.torch is None and "no torch" in rows["metax"].bench_error
    assert all(c.measured_tflops is None for c in rows["metax"].chips)
    assert "torch_supa is not importable" in rows["biren"].bench_error
    assert "not measured: torch.cuda is not available" in proc.stdout


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("nodes:\n  - host: a\n    prot: 22\n", "nodes[0].prot: unknown key"),
        ("nodes:\n  - host: a\n    port: twenty\n", "nodes[0].port"),
        ("ssh:\n  fanout: 8\n", "nodes: required key is missing"),
        ("nodes: [\n", "not valid YAML"),
        (None, "inventory not found"),
    ],
)
def test_malformed_inventory_is_one_clear_line_and_exit_2(tmp_path, content, expected):
    inv = tmp_path / "inventory.yaml"
    if content is not None:
        inv.write_text(content)
    proc = hetctl("probe", "-i", str(inv))
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    first = proc.stderr.splitlines()[0]
    assert first.startswith("error: ") and str(inv) in first and expected in first, proc.stderr


def test_a_cluster_file_written_to_another_folder_still_finds_its_inventory(tmp_path):
    # `probe -i inventory.yaml -o out/cluster.yaml`, then `plan out/cluster.yaml`, then `launch`: the cluster file
    # recorded "inventory.yaml" as typed, and plan resolved it beside the cluster file (out/inventory.yaml: not found).
    from tests.helpers.sites import local_cli

    (tmp_path / "inventory.yaml").write_text(yaml.safe_dump({"nodes": [
        {"name": "here", "host": "localhost", "transport": "local", "python": sys.executable, "workdir": "w",
         "tflops": 1}]}))
    r = local_cli(tmp_path, "probe", "-i", "inventory.yaml", "-o", "out/cluster.yaml", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["inventory"] == "inventory.yaml"  # stdout: as typed, from here
    assert yaml.safe_load((tmp_path / "out/cluster.yaml").read_text())["inventory"] == "../inventory.yaml"
    r = local_cli(tmp_path, "plan", "out/cluster.yaml", "-m", "tiny", "-o", "p")
    assert r.returncode == 0, r.stderr
    r = local_cli(tmp_path, "launch", "p", "--dry-run", "--json")
    assert r.returncode == 0 and json.loads(r.stdout), r.stderr


def test_probe_without_inventory_says_what_to_pass():
    proc = hetctl("probe")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines()[0] == "error: no inventory given"
    assert "-i inventory.yaml" in proc.stderr


@pytest.mark.e2e
def test_findings_on_hosts_that_differ_and_plan_refuses_mixed_torch(make_sshd_cluster, tmp_path_factory, tmp_path):
    """Three MetaX C550 hosts: one with an older torch, one with another driver, one without the ib NIC."""
    old_torch = fake_dist(tmp_path_factory.mktemp("site"), "torch", "2.4.0")
    names = ["mx-01", "mx-02", "mx-03"]
    c = make_sshd_cluster(names=names, extra_env={"mx-02": {"PYTHONPATH": str(old_torch)}})
    ib = [{"name": "ib0", "type": "32"}]
    rdma = [{"name": "mlx5_0", "link_layer": "InfiniBand", "rate": "200 Gb/sec (4X HDR)", "netdev": "ib0"}]
    for h in c:
        h.install_tool("mx-smi", {"": SAMPLES / "mx-smi_c550x8.txt"})
        lacks_ib = h.name == "mx-03"
        make_sysfs(h.sysfs_root, nics=[{"name": "eth0", "speed": "25000"}] + ([] if lacks_ib else ib),
                   rdma=[] if lacks_ib else rdma, modules={"metax": "2.14.0" if h.name == "mx-01" else "2.15.9"})
    data = c.inventory()
    data["defaults"].update(env={"NCCL_SOCKET_IFNAME": "ib0"}, tflops=100)
    inv = tmp_path / "inventory.yaml"
    inv.write_text(yaml.safe_dump(data))
    out = tmp_path / "cluster.yaml"

    proc = hetctl("probe", "-i", str(inv), "-o", str(out))
    assert proc.returncode == 0, proc.stderr + proc.stdout
    cluster = load_model(out, Cluster, "cluster file")
    torch_here = cluster.nodes[0].software.torch.split("+")[0]  # the local build tag is not compared
    assert cluster.nodes[1].software.torch == "2.4.0" and torch_here != "2.4.0"
    got = {(f.kind, f.key): (f.nodes, f.message) for f in cluster.findings}
    assert got[("software", "torch")] == ("mx-02", f"torch {torch_here} on 2 nodes, 2.4.0 on mx-02")
    assert got[("software", "driver")] == ("mx-01", "metax driver 2.15.9 on 2 nodes, 2.14.0 on mx-01")
    assert got[("interface", "NCCL_SOCKET_IFNAME")] == ("mx-03", "NCCL_SOCKET_IFNAME=ib0 names an interface that mx-03 lacks")
    assert got[("network", "nic")][0] == "mx-03"
    assert set(got) == {("software", "torch"), ("software", "driver"), ("interface", "NCCL_SOCKET_IFNAME"),
                        ("network", "nic")}
    for _, message in got.values():
        assert message in proc.stdout

    as_json = Cluster.model_validate(json.loads(hetctl("probe", "-i", str(inv), "--json").stdout))
    assert as_json.findings == cluster.findings
    assert {c.spec for n in as_json.nodes for c in n.chips} == {"metax/c550"}

    refused = hetctl("plan", str(out), "-m", "tiny", "-o", str(tmp_path / "plan"))
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    first = refused.stderr.splitlines()[0]
    assert "mixed torch across the job" in first and "2.4 on mx-02" in first and str(out) in first
    assert "--allow-mixed-software" in refused.stderr
    allowed = hetctl("plan", str(out), "-m", "tiny", "-o", str(tmp_path / "plan"), "--allow-mixed-software")
    assert allowed.returncode == 0, allowed.stderr
    assert "mixed torch across the job" in allowed.stderr


CPU_CGROUP = Path("/sys/fs/cgroup/cpu")


def _cgroup(name: str, settings: dict[str, str]):
    """A cpu cgroup (v1) with ``settings`` written to its files; yields its folder, then moves out what is
    left in it and removes it."""
    group = CPU_CGROUP / f"hetctl-test-{name}-{os.getpid()}"
    try:
        group.mkdir()
        for key, value in settings.items():
            (group / key).write_text(f"{value}\n")
    except OSError as e:
        pytest.skip(f"no writable cpu cgroup here: {e}")
    yield group
    for pid in (int(p) for p in (group / "cgroup.procs").read_text().split()):
        try:
            (CPU_CGROUP / "cgroup.procs").write_text(f"{pid}\n")
        except OSError:
            pass  # exited meanwhile
    group.rmdir()


@pytest.fixture
def cpu_cgroup():
    """A cpu cgroup (v1) limited to 10% of one CPU; yields its folder.

    The period is short (10 ms) so that no timed chunk of the benchmark fits in one
    period's quota and runs at full speed.
    """
    yield from _cgroup("slow", {"cpu.cfs_period_us": "10000", "cpu.cfs_quota_us": "1000"})


@pytest.fixture
def first_cgroup():
    """A cpu cgroup (v1) with no quota and the largest weight: what runs in it is served before anything else
    on this machine (the other test worker, a bench beside the suite), so its speed is the machine's."""
    yield from _cgroup("first", {"cpu.shares": "262144"})


def _python_in(cgroup: Path, log: Path) -> str:
    """A ``python`` for one host: joins ``cgroup`` (or fails loudly), runs Python, and logs each run.

    Each line of ``log``: the arguments, the run's cpu cgroup, and the cgroup's
    throttled time (ns) before and after the run, so a test can tell whether the
    quota bit during the benchmark itself and not only during the collector.
    """
    q = {k: shlex.quote(str(v)) for k, v in
         {"procs": cgroup / "cgroup.procs", "stat": cgroup / "cpu.stat", "log": log, "py": sys.executable}.items()}
    return f"""#!/bin/sh
echo $$ > {q['procs']} || {{ echo "python-in-cgroup: cannot join the cpu cgroup" >&2; exit 97; }}
before=$(sed -n 's/^throttled_time //p' {q['stat']})
{q['py']} "$@"
rc=$?
after=$(sed -n 's/^throttled_time //p' {q['stat']})
group=$(grep -E '^[0-9]+:([a-z,]*,)?cpu(,[a-z,]*)?:' /proc/$$/cgroup)
printf '%s\t%s\t%s\t%s\n' "$*" "$group" "$before" "$after" >> {q['log']}
exit $rc
"""


@pytest.mark.e2e
def test_bench_flags_the_chip_slowed_by_a_cgroup(make_sshd_cluster, cpu_cgroup, first_cgroup, tmp_path):
    """Three CPU-only hosts; on one, the node's Python (collector and benchmark) runs in a cgroup with 10% of a CPU.

    The two others run theirs in a cgroup served first: under load from beside the suite (the other test
    worker, a bench) an unslowed host once measured slower than the slowed one, which says nothing of hetctl.
    """
    c = make_sshd_cluster(names=["cpu-1", "cpu-2", "cpu-3"])
    runs = tmp_path / "python-slowed.log"
    c["cpu-2"].install_script("python-slowed", _python_in(cpu_cgroup, runs))
    for name in ("cpu-1", "cpu-3"):
        c[name].install_script("python-first", _python_in(first_cgroup, tmp_path / f"python-first-{name}.log"))
    data = c.inventory()
    # One node at a time: the two unslowed hosts must not share this machine's cores while they measure.
    data.setdefault("ssh", {})["fanout"] = 1
    for n in data["nodes"]:
        n["python"] = "python-slowed" if n["name"] == "cpu-2" else "python-first"
    inv = tmp_path / "inventory.yaml"
    inv.write_text(yaml.safe_dump(data))
    out = tmp_path / "cluster.yaml"
    proc = hetctl("probe", "-i", str(inv), "--bench", "-o", str(out), timeout=600)
    assert proc.returncode == 0, proc.stderr
    cluster = load_model(out, Cluster)
    assert all(n.chips[0].measured_tflops is not None for n in cluster.nodes), [n.bench_error for n in cluster.nodes]
    # The benchmark on cpu-2 ran inside the group, and the quota bit while it ran.
    lines = [ln.split("\t") for ln in runs.read_text().splitlines()]
    bench = [ln for ln in lines if '"device_type"' in ln[0]]
    assert len(bench) == 1, lines
    _, group, before, after = bench[0]
    assert group.endswith("/" + cpu_cgroup.name), (group, lines)
    assert int(after) > int(before), ("the kernel did not throttle the benchmark", lines)
    fp32 = {n.name: n.chips[0].measured_tflops.fp32 for n in cluster.nodes}
    assert min(fp32, key=fp32.get) == "cpu-2", (fp32, lines)
    # The slowed host is flagged. The two others may be too: on this shared test machine
    # back-to-back CPU matmul runs differ by several times, and the 10% rule reports that.
    slow = {f.nodes: f.message for f in cluster.findings if f.kind == "slow_chip"}
    assert "cpu-2" in slow, [f.message for f in cluster.findings]
    assert slow["cpu-2"].startswith("cpu-2 chip 0 (") and "TFLOPS fp32" in slow["cpu-2"]
    assert slow["cpu-2"] in proc.stdout
