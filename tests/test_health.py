"""Health before launch: measured links (``probe --bench``) and ``launch --health-check``.

The slow link is real: one sshd host lives in its own network namespace, joined
to the others by a veth pair rate-limited with ``tc`` tbf (:class:`tests.sshd.ShapedNetNs`),
so every byte it sends or receives crosses a shaped link. The declared NIC speed
is what the collector reads from the host's fake sysfs (hardware we do not have).
"""

from __future__ import annotations

import pytest
import yaml

from hetctl.files.cluster import Cluster
from hetctl.files.yamlio import load_model
from tests.sshd import ShapedNetNs
from tests.test_collector import make_sysfs
from tests.test_probe_cli import hetctl

NAMES = ["cpu-1", "cpu-2", "cpu-3"]
ONE_GBE = [{"name": "eth0", "speed": "1000"}]


@pytest.fixture
def shaped():
    """A namespace behind a veth pair shaped to 50 Mbit/s each way."""
    try:
        ns = ShapedNetNs("50mbit")
    except (RuntimeError, OSError) as e:
        pytest.skip(f"no shaped veth here: {e}")
    yield ns
    ns.stop()


def _probe_bench(cluster, tmp_path, **inv) -> tuple[Cluster, str]:
    for h in cluster:
        make_sysfs(h.sysfs_root, nics=ONE_GBE)
    path = tmp_path / "inventory.yaml"
    path.write_text(yaml.safe_dump(cluster.inventory(**inv)))
    out = tmp_path / "cluster.yaml"
    proc = hetctl("probe", "-i", str(path), "--bench", "-o", str(out), timeout=600)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    return load_model(out, Cluster), proc.stdout


@pytest.mark.e2e
def test_bench_measures_a_ring_of_links_and_flags_the_node_behind_a_slowed_one(make_sshd_cluster, shaped, tmp_path):
    addrs = {"cpu-1": shaped.outer(), "cpu-2": shaped.inner, "cpu-3": shaped.outer()}
    c = make_sshd_cluster(names=NAMES, addrs=addrs, netns={"cpu-2": (shaped, shaped)})
    cluster, stdout = _probe_bench(c, tmp_path)

    links = {(lk.src, lk.dst): lk for lk in cluster.links}
    assert set(links) == {("cpu-1", "cpu-2"), ("cpu-2", "cpu-3"), ("cpu-3", "cpu-1")}  # a ring: one link per node
    assert all(lk.error is None and lk.measured_gbps and lk.rtt_ms for lk in links.values()), cluster.links
    assert {lk.address for lk in links.values()} == set(addrs.values())  # each receiver at its own address
    assert all(lk.declared_gbps == 1.0 and lk.method == "tcp" and lk.streams == 4 for lk in links.values())
    through = [links["cpu-1", "cpu-2"].measured_gbps, links["cpu-2", "cpu-3"].measured_gbps]
    assert max(through) < links["cpu-3", "cpu-1"].measured_gbps, cluster.links

    slow = [f for f in cluster.findings if f.kind == "slow_link"]
    assert [(f.key, f.nodes) for f in slow] == [("bandwidth", "cpu-2")], [f.message for f in cluster.findings]
    assert slow[0].message.startswith("cpu-2: every link far below the declared 1 Gb/s: cpu-1 → cpu-2 ")
    assert slow[0].message in stdout
    assert "links: 3/3 measured" in stdout


@pytest.mark.e2e
def test_bench_on_unslowed_hosts_measures_every_link_and_flags_none(make_sshd_cluster, tmp_path):
    c = make_sshd_cluster(names=NAMES)
    cluster, _ = _probe_bench(c, tmp_path)
    assert [(lk.src, lk.dst, lk.address) for lk in cluster.links] == [
        ("cpu-1", "cpu-2", c["cpu-2"].addr), ("cpu-2", "cpu-3", c["cpu-3"].addr), ("cpu-3", "cpu-1", c["cpu-1"].addr)]
    assert all(lk.measured_gbps and lk.error is None for lk in cluster.links), cluster.links
    assert [f.message for f in cluster.findings if f.kind == "slow_link"] == []
