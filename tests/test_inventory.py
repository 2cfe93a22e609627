"""Inventory loading: ranges, defaults, ssh config, paths, and errors that name file:line: key."""

from __future__ import annotations

import getpass
import subprocess
import textwrap
from pathlib import Path

import pytest

from hetctl.errors import ConfigError
from hetctl.files.inventory import Inventory, Node, load_inventory
from hetctl.remote.sshconfig import effective_settings, parse_dump

REPO = Path(__file__).resolve().parent.parent


def write(tmp_path: Path, text: str, name: str = "inventory.yaml") -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text).lstrip("\n"))
    return p


def error_of(path: Path) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_inventory(path)
    return info.value


def test_host_range_expands_and_names_default_to_hosts(tmp_path):
    inv = load_inventory(write(tmp_path, """
        nodes:
          - host: gpu-[01-03],login
    """))
    assert inv.names == ["gpu-01", "gpu-02", "gpu-03", "login"]
    assert [n.host for n in inv.nodes] == inv.names
    # port and user stay unset: ssh_config (or ssh's own default) decides them
    assert all(n.hostname == n.host and n.port is None and n.user is None and n.transport == "ssh" for n in inv.nodes)


def test_name_range_is_zipped_with_host_range(tmp_path):
    inv = load_inventory(write(tmp_path, """
        nodes:
          - name: npu-[1-3]
            host: 10.20.0.[11-13]
    """))
    assert [(n.name, n.host) for n in inv.nodes] == [
        ("npu-1", "10.20.0.11"), ("npu-2", "10.20.0.12"), ("npu-3", "10.20.0.13"),
    ]


def test_name_and_host_ranges_of_different_length(tmp_path):
    p = write(tmp_path, """
        nodes:
          - host: a
          - name: n-[1-2]
            host: h-[1-3]
    """)
    e = error_of(p)
    assert e.message.startswith(f"{p}:3: nodes[1].name: ")
    assert "2 name(s) for 3 host(s)" in e.message


def test_defaults_apply_and_node_values_win_with_env_and_labels_merged(tmp_path):
    inv = load_inventory(write(tmp_path, """
        defaults:
          user: train
          port: 2200
          python: /opt/py/bin/python
          env: {NCCL_DEBUG: INFO, OMP_NUM_THREADS: 4}
          labels: {rack: a1}
        nodes:
          - host: n1
          - host: n2
            user: ops
            port: 22
            env: {NCCL_DEBUG: WARN, EXTRA: "x y"}
            labels: {switch: leaf-2}
            tflops: 312.5
    """))
    n1, n2 = inv.nodes
    assert (n1.user, n1.port, n1.python) == ("train", 2200, "/opt/py/bin/python")
    assert n1.env == {"NCCL_DEBUG": "INFO", "OMP_NUM_THREADS": "4"}
    assert (n2.user, n2.port, n2.tflops) == ("ops", 22, 312.5)
    assert n2.env == {"NCCL_DEBUG": "WARN", "OMP_NUM_THREADS": "4", "EXTRA": "x y"}
    assert n2.labels == {"rack": "a1", "switch": "leaf-2"}
    assert n1.tflops is None
    assert n1.workdir == "~/.hetctl"


def test_unknown_key_names_file_line_and_key_path(tmp_path):
    p = write(tmp_path, """
        nodes:
          - host: a
          - host: b
            prot: 22
    """)
    e = error_of(p)
    assert e.message == f"{p}:4: nodes[1].prot: unknown key, did you mean port?"
    assert e.hint


def test_unknown_key_in_ssh_block(tmp_path):
    p = write(tmp_path, """
        ssh:
          host_key_policy: strict
          timeout: 5
        nodes:
          - host: a
    """)
    assert error_of(p).message == f"{p}:3: ssh.timeout: unknown key, did you mean connect_timeout?"


@pytest.mark.parametrize(
    ("snippet", "key", "line"),
    [
        ("    port: twenty-two", "nodes[0].port", 3),
        ("    port: 70000", "nodes[0].port", 3),
        ("    transport: telnet", "nodes[0].transport", 3),
        ("    env: {FLAG: true}", "nodes[0].env.FLAG", 3),
        ("    tflops: -1", "nodes[0].tflops", 3),
    ],
)
def test_bad_types_name_the_key(tmp_path, snippet, key, line):
    p = tmp_path / "inv.yaml"
    p.write_text("nodes:\n  - host: a\n" + snippet + "\n")
    e = error_of(p)
    assert e.message.startswith(f"{p}:{line}: {key}: "), e.message


def test_bad_host_policy_value(tmp_path):
    p = write(tmp_path, """
        ssh:
          host_key_policy: yolo
        nodes: [{host: a}]
    """)
    assert error_of(p).message.startswith(f"{p}:2: ssh.host_key_policy: ")


@pytest.mark.parametrize("bad", ["gpu-[05-01]", "gpu-[01-", "gpu-[a-c]"])
def test_bad_range_names_line_and_key(tmp_path, bad):
    p = write(tmp_path, f"""
        nodes:
          - host: ok-1
          - host: "{bad}"
    """)
    e = error_of(p)
    assert e.message.startswith(f"{p}:3: nodes[1].host: bad host range '{bad}'"), e.message
    assert "gpu-[01-16]" in e.hint


def test_duplicate_node_from_overlapping_ranges(tmp_path):
    p = write(tmp_path, """
        nodes:
          - host: gpu-[01-04]
          - host: gpu-03
    """)
    e = error_of(p)
    assert e.message == f"{p}:3: nodes[1].host: duplicate node 'gpu-03' (also at nodes[0].host)"


def test_duplicate_explicit_names(tmp_path):
    p = write(tmp_path, """
        nodes:
          - {name: x, host: 10.0.0.1}
          - {name: x, host: 10.0.0.2}
    """)
    assert error_of(p).message.startswith(f"{p}:3: nodes[1].name: duplicate node 'x'")


def test_duplicate_yaml_key_is_refused(tmp_path):
    p = write(tmp_path, """
        nodes:
          - host: a
            port: 22
            port: 23
    """)
    e = error_of(p)
    assert e.message.startswith(f"{p}:") and "duplicate key 'port'" in e.message


@pytest.mark.parametrize(
    ("text", "needle"),
    [("", "inventory is empty"), ("defaults: {}\n", "nodes: required key is missing"), ("nodes: []\n", "nodes: ")],
)
def test_empty_or_nodeless_inventory(tmp_path, text, needle):
    p = tmp_path / "inv.yaml"
    p.write_text(text)
    assert needle in error_of(p).message


def test_missing_file(tmp_path):
    e = error_of(tmp_path / "nope.yaml")
    assert "inventory not found" in e.message and "nope.yaml" in e.message


def test_bad_node_name_characters(tmp_path):
    p = write(tmp_path, """
        nodes:
          - {name: "a/b", host: h}
    """)
    assert error_of(p).message.startswith(f"{p}:2: nodes[0].name: node name 'a/b'")


def test_ssh_config_fills_what_the_inventory_leaves_open(tmp_path):
    key = tmp_path / "keys" / "id_cluster"
    key.parent.mkdir()
    key.write_text("not read at load time")
    (tmp_path / "ssh_config").write_text(textwrap.dedent(f"""
        Host bastion
          HostName bastion.example.org
        Host gpu-*
          HostName %h.cluster.internal
          User alice
          Port 2222
          IdentityFile {tmp_path}/keys/missing_key
          IdentityFile {key}
          ProxyJump ops@bastion
    """))
    inv = load_inventory(write(tmp_path, """
        ssh: {config: ssh_config}
        nodes:
          - host: gpu-[1-2]
          - host: gpu-9
            user: bob
            port: 22
            identity_file: keys/other
            proxy_jump: none
          - host: cpu-1
    """))
    g1, g2, g9, cpu = inv.nodes
    assert inv.ssh.config == str(tmp_path / "ssh_config")
    # The inventory keeps only what it sets; ssh itself (ssh -G) resolves the rest.
    assert (g1.user, g1.port, g1.identity_file, g1.proxy_jump) == (None, None, None, None)
    e1, e2, e9, ecpu = (effective_settings(n, inv.ssh, jumps=False) for n in inv.nodes)
    assert (e1.hostname, e1.user, e1.port, e1.proxy_jump) == ("gpu-1.cluster.internal", "alice", 2222, "ops@bastion")
    # OpenSSH offers every IdentityFile in order (a missing one is skipped with a warning), not just the first existing one.
    assert e1.identity_files == (f"{tmp_path}/keys/missing_key", str(key))
    assert e2.hostname == "gpu-2.cluster.internal"
    # Values written in the inventory win over the ssh config; IdentityFile adds to the config's list, first.
    assert (e9.user, e9.port, e9.proxy_jump) == ("bob", 22, None)
    assert e9.identity_files[0] == str(tmp_path / "keys/other") and g9.proxy_jump == "none"
    assert (ecpu.hostname, ecpu.user, ecpu.port, ecpu.proxy_jump) == ("cpu-1", getpass.getuser(), 22, None)
    # Exactly what plain `ssh -G` says for the same config, where the inventory sets nothing.
    plain = parse_dump(subprocess.run(["ssh", "-F", str(tmp_path / "ssh_config"), "-G", "gpu-1"],
                                      capture_output=True, text=True, check=True).stdout)
    assert (e1.hostname, e1.user, str(e1.port), e1.proxy_jump, e1.identity_files) == (
        plain["hostname"][0], plain["user"][0], plain["port"][0], plain["proxyjump"][0], plain["identityfile"])


def test_missing_explicit_ssh_config_is_an_error_but_default_one_is_optional(tmp_path):
    p = write(tmp_path, """
        ssh: {config: /nonexistent/ssh_config}
        nodes: [{host: a}]
    """)
    assert error_of(p).message.startswith(f"{p}:1: ssh.config: ssh config /nonexistent/ssh_config does not exist")
    # The default is kept as written: ssh reads ~/.ssh/config (and the system file) itself when they exist.
    assert load_inventory(write(tmp_path, "nodes: [{host: a}]\n", "b.yaml")).ssh.config == "~/.ssh/config"
    assert load_inventory(write(tmp_path, "ssh: {config: null}\nnodes: [{host: a}]\n", "c.yaml")).ssh.config is None


def test_paths_resolve_against_the_inventory_folder(tmp_path, monkeypatch):
    sub = tmp_path / "conf"
    sub.mkdir()
    monkeypatch.chdir(tmp_path)  # the current directory must not matter
    inv = load_inventory(write(sub, """
        defaults: {identity_file: keys/id}
        ssh: {known_hosts: kh}
        nodes:
          - {name: l1, host: localhost, transport: local, workdir: work/l1}
          - {name: l2, host: localhost, transport: local, workdir: ~/w}
          - {name: r1, host: r, workdir: jobs}
          - {name: r2, host: r2, workdir: ~/x}
          - {name: r3, host: r3, workdir: /scratch/x}
    """))
    l1, l2, r1, r2, r3 = inv.nodes
    assert inv.ssh.known_hosts == str(sub / "kh")
    assert l1.workdir == str(sub / "work/l1")
    assert l2.workdir == str(Path.home() / "w")
    assert (r1.workdir, r2.workdir, r3.workdir) == ("~/jobs", "~/x", "/scratch/x")
    assert r1.identity_file == str(sub / "keys/id")
    assert l1.identity_file is None and l1.user == getpass.getuser()


def test_tilde_user_workdir_is_refused(tmp_path):
    p = write(tmp_path, """
        nodes:
          - host: a
            workdir: ~bob/x
    """)
    assert error_of(p).message.startswith(f"{p}:3: nodes[0].workdir: '~bob/x'")


def test_relative_checkpoint_dir_needs_all_local_nodes(tmp_path):
    p = write(tmp_path, """
        checkpoint_dir: ckpt
        nodes: [{host: remote-1}]
    """)
    e = error_of(p)
    assert e.message.startswith(f"{p}:1: checkpoint_dir: 'ckpt' is relative")
    inv = load_inventory(write(tmp_path, """
        checkpoint_dir: ckpt
        nodes: [{host: localhost, transport: local}]
    """, "local.yaml"))
    assert inv.checkpoint_dir == str(tmp_path / "ckpt")


def test_node_lookup_names_the_node_and_file(tmp_path):
    p = write(tmp_path, "nodes: [{host: a}, {host: b}]\n")
    inv = load_inventory(p)
    assert inv.node("b").host == "b"
    with pytest.raises(ConfigError) as info:
        inv.node("c")
    assert info.value.message == f"{p}: no node named 'c'"
    assert info.value.hint == "known nodes: a, b"
    assert inv.source == p


def test_shipped_local_inventory():
    inv = load_inventory(REPO / "inventories" / "local.yaml")
    assert inv.names == ["node-a", "node-b", "node-c"]
    assert {n.transport for n in inv.nodes} == {"local"}
    assert len({n.workdir for n in inv.nodes}) == 3
    assert all(Path(n.workdir).is_absolute() for n in inv.nodes)
    assert inv.checkpoint_dir and Path(inv.checkpoint_dir).is_absolute()


def test_shipped_mixed_example(tmp_path):
    inv = load_inventory(REPO / "inventories" / "example-mixed.yaml")
    vendors = {n.labels.get("vendor") for n in inv.nodes}
    assert {"nvidia", "ascend", "metax"} <= vendors
    assert inv.node("npu-4").host == "10.20.0.14"
    assert inv.node("mx-02").proxy_jump and inv.node("mx-02").port == 2222
    assert inv.node("controller").transport == "local"
    assert inv.checkpoint_dir == "/mnt/lustre/hetctl/ckpt"
    assert inv.ssh.host_key_policy == "strict"


def test_models_build_in_code_with_defaults():
    n = Node(name="x", host="10.0.0.1")
    assert (n.hostname, n.port, n.user, n.python, n.transport) == ("10.0.0.1", None, None, "python3", "ssh")
    assert Inventory(nodes=[n]).node("x") is n


def test_a_slurm_block_becomes_the_nodes_the_callers_function_reports(tmp_path):
    """files/ expands ``slurm:`` from what the caller asked Slurm (remote/slurmalloc.allocation in the commands):
    the defaults, the slurm_* labels, the topology's switch unless defaults set one, a het job's component; and a
    mismatch with the allocation is located below ``slurm:``."""
    from hetctl.files.allocation import AllocatedNode, Allocation, AllocationError

    asked = []

    def ask(s):
        asked.append(s)
        return Allocation("7", (AllocatedNode("n1", "10.0.0.1", cpus=8, memory_mb=1024, gres="gpu:2", features=("a", "b"),
                                              het_group=0, het_component="7", switch="leaf1"),
                                AllocatedNode("n2", "10.0.0.2", het_group=1, het_component="8")))

    path = write(tmp_path, """
        defaults: {user: me, workdir: /scratch/h, env: {A: "1"}, labels: {rack: r1}}
        slurm: {partition: gpu, nodes: 2}
        nodes:
          - host: login
    """)
    inv = load_inventory(path, slurm=ask)
    assert [s.partition for s in asked] == ["gpu"]
    assert inv.names == ["n1", "n2", "login"]
    n1, n2 = inv.node("n1"), inv.node("n2")
    assert (n1.transport, n1.hostname, n1.workdir, n1.user, n1.slurm_job, n1.env) == ("slurm", "10.0.0.1", "/scratch/h",
                                                                                       None, "7", {"A": "1"})
    assert n1.labels == {"switch": "leaf1", "rack": "r1", "slurm_gres": "gpu:2", "slurm_features": "a,b",
                         "slurm_cpus": "8", "slurm_memory_mb": "1024"}
    assert (n1.slurm_het_group, n1.slurm_het_component, n2.slurm_het_group, n2.slurm_het_component) == (0, "7", 1, "8")
    assert "switch" not in n2.labels and inv.node("login").transport == "ssh"

    def refuse(s):
        raise AllocationError(("nodes",), "job 7 has 1 node(s), the inventory asks for 2", "lower slurm.nodes")

    with pytest.raises(ConfigError) as info:
        load_inventory(path, slurm=refuse)
    assert "slurm.nodes" in info.value.message and "1 node(s)" in info.value.message
    assert "slurm" in error_of(path).message  # a reader that does not ask Slurm refuses the block
