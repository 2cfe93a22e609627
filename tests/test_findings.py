"""Consistency findings on hand-made cluster files (pure: facts in, findings out)."""

from __future__ import annotations

from typing import Any

import pytest

from hetctl.errors import ConfigError
from hetctl.files.cluster import Cluster, Link
from hetctl.probe.findings import check_uniform_torch, find, flagged_nodes, link_findings, major_minor, ranges
from hetctl.probe.links import ring


def node(name: str, *, chips: int = 8, model: str = "NVIDIA H100 80GB HBM3", vendor: str = "nvidia",
         torch: str | None = "2.5.1+cu121", driver: str | None = "nvidia 550.54.15", python: str = "3.11.7",
         nics: list[dict[str, Any]] | None = None, measured: list[float] | None = None,
         reachable: bool = True) -> dict[str, Any]:
    """One node of a hand-written cluster file."""
    if not reachable:
        return {"name": name, "host": name, "reachable": False, "error": "connection refused"}
    return {
        "name": name, "host": name,
        "chips": [{"index": i, "vendor": vendor, "model": model,
                   **({"measured_tflops": {"bf16": measured[i]}} if measured else {})} for i in range(chips)],
        "nics": nics if nics is not None else [{"name": "lo", "kind": "loopback"},
                                                {"name": "ib0", "kind": "ib", "speed_gbps": 200.0}],
        "software": {"python": python, "torch": torch, "driver": driver},
    }


def cluster(*nodes: dict[str, Any]) -> Cluster:
    return Cluster.model_validate({"nodes": list(nodes)})


def messages(c: Cluster, env: dict | None = None) -> list[str]:
    return [f.message for f in find(c, env)]


def test_a_uniform_cluster_has_no_findings() -> None:
    assert find(cluster(*(node(f"gpu-{i:02d}") for i in range(1, 9)))) == []


def test_torch_and_driver_versions_that_differ() -> None:
    nodes = [node(f"npu-{i:02d}", torch="2.4.0" if i in (3, 4) else "2.5.1") for i in range(1, 17)]
    assert messages(cluster(*nodes)) == ["torch 2.5.1 on 14 nodes, 2.4.0 on npu-[03-04]"]
    nodes = [node(f"gpu-{i:02d}", driver="nvidia 535.104.05" if i == 8 else "nvidia 550.54.15") for i in range(1, 9)]
    (f,) = find(cluster(*nodes))
    assert (f.kind, f.key, f.nodes) == ("software", "driver", "gpu-08")
    assert f.message == "nvidia driver 550.54.15 on 7 nodes, 535.104.05 on gpu-08"


def test_local_build_tags_are_not_a_difference_but_a_missing_torch_is() -> None:
    same = cluster(node("a-1", torch="2.5.1+cu121"), node("b-1", torch="2.5.1+rocm6.2", vendor="amd",
                                                           model="AMD Instinct MI300X", driver="amdgpu 6.8.5"))
    assert [f.key for f in find(same)] == []
    missing = cluster(node("gpu-01"), node("gpu-02"), node("gpu-03", torch=None))
    assert messages(missing) == ["torch 2.5.1 on 2 nodes, none on gpu-03"]


def test_drivers_are_compared_only_within_one_vendor() -> None:
    c = cluster(node("gpu-01"), node("gpu-02"),
                node("mx-01", vendor="metax", model="MetaX C550", driver="metax 2.15.9"),
                node("mx-02", vendor="metax", model="MetaX C550", driver="metax 2.15.9"))
    assert find(c) == []


def test_chip_count_outlier_among_peers_of_the_same_model() -> None:
    nodes = [node(f"gpu-{i:02d}", chips=7 if i == 5 else 8) for i in range(1, 17)]
    (f,) = find(cluster(*nodes))
    assert (f.kind, f.nodes) == ("chip_count", "gpu-05")
    assert f.message == "gpu-05 has 7 NVIDIA H100 80GB HBM3 chips, its 15 peers 8"


def test_no_majority_no_outlier() -> None:
    assert find(cluster(node("gpu-01", chips=4), node("gpu-02", chips=8))) == []


def test_slow_nic_against_peers() -> None:
    eth = [{"name": "eth0", "kind": "ethernet", "speed_gbps": 25.0}]
    nodes = [node(f"mx-{i:02d}", vendor="metax", model="MetaX C550", nics=eth if i == 2 else None, driver=None)
             for i in range(1, 5)]
    (f,) = find(cluster(*nodes))
    assert (f.kind, f.nodes) == ("network", "mx-02")
    assert f.message == "no NIC faster than 25 Gb/s on mx-02 while its peers have 200 Gb/s InfiniBand"


def test_socket_interface_a_node_lacks() -> None:
    nodes = [node(f"gpu-{i:02d}", nics=[{"name": "lo", "kind": "loopback"},
                                        {"name": "eth1" if i == 3 else "ib0", "kind": "ib", "speed_gbps": 200.0}])
             for i in range(1, 5)]
    env = {f"gpu-{i:02d}": {"NCCL_SOCKET_IFNAME": "ib", "GLOO_SOCKET_IFNAME": "ib0"} for i in range(1, 5)}
    got = find(cluster(*nodes), env)
    assert [(f.kind, f.key, f.nodes) for f in got] == [
        ("interface", "GLOO_SOCKET_IFNAME", "gpu-03"), ("interface", "NCCL_SOCKET_IFNAME", "gpu-03")]
    assert got[1].message == "NCCL_SOCKET_IFNAME=ib names an interface that gpu-03 lacks"


@pytest.mark.parametrize(("value", "lacks"), [
    ("ib", False), ("=ib0", False), ("=ib", True), ("eth,ib", False), ("^docker,lo", False), ("bond", True),
])
def test_nccl_interface_syntax(value: str, lacks: bool) -> None:
    c = cluster(node("gpu-01"))
    assert bool(find(c, {"gpu-01": {"NCCL_SOCKET_IFNAME": value}})) is lacks


def test_slow_chip_from_the_benchmark() -> None:
    fast = [700.0, 702.0, 698.0, 701.0]
    c = cluster(node("gpu-01", chips=4, measured=fast), node("gpu-02", chips=4, measured=[700.0, 600.0, 699.0, 640.0]))
    got = find(c)
    assert [(f.kind, f.nodes) for f in got] == [("slow_chip", "gpu-02")]
    assert got[0].message.startswith("gpu-02 chip 1 (NVIDIA H100 80GB HBM3) measured 600 TFLOPS bf16, 14% below")
    assert "640" not in got[0].message  # 640 is 8.6% below the median: not flagged


def test_unreachable_nodes_are_left_out() -> None:
    c = cluster(node("gpu-01"), node("gpu-02"), node("gpu-03", reachable=False))
    assert find(c) == []


def test_findings_round_trip_through_the_cluster_file(tmp_path) -> None:
    from hetctl.probe.gather import with_findings
    from hetctl.files.yamlio import load_model, save_model

    c = with_findings(cluster(node("gpu-01"), node("gpu-02", torch="2.4.0")),
                      {"gpu-01": {"NCCL_SOCKET_IFNAME": "ib0", "HF_TOKEN": "secret"}})
    assert [f.key for f in c.findings] == ["torch"]
    path = tmp_path / "cluster.yaml"
    save_model(path, c)
    assert "secret" not in path.read_text() and "HF_TOKEN" not in path.read_text()
    assert load_model(path, Cluster, "cluster file").findings == c.findings


def test_mixed_torch_is_refused_unless_allowed() -> None:
    c = cluster(node("gpu-01"), node("gpu-02"), node("npu-01", torch="2.1.0", vendor="ascend", model="910B2",
                                                       driver=None))
    with pytest.raises(ConfigError, match=r"c\.yaml: mixed torch across the job: 2\.5 on gpu-\[01-02\], 2\.1 on npu-01") as e:
        check_uniform_torch(c, where="c.yaml")
    assert "--allow-mixed-software" in e.value.hint
    assert check_uniform_torch(c, allow_mixed=True) == "mixed torch across the job: 2.5 on gpu-[01-02], 2.1 on npu-01"
    same_minor = cluster(node("gpu-01", torch="2.5.0"), node("gpu-02", torch="2.5.1+cu124"))
    assert check_uniform_torch(same_minor) is None


def test_helpers() -> None:
    assert ranges(["gpu-08", "gpu-01", "gpu-02", "gpu-03"]) == "gpu-[01-03,08]"
    assert major_minor("2.5.1+cu121") == "2.5"


def test_cpus_are_compared_in_fp32_not_their_emulated_bf16() -> None:
    def cpu(name: str, fp32: float, bf16: float) -> dict[str, Any]:
        return {"name": name, "host": name, "chips": [{"index": 0, "vendor": "cpu", "model": "AMD EPYC",
                                                       "measured_tflops": {"fp32": fp32, "bf16": bf16}}]}
    same_fp32 = cluster(cpu("c-1", 1.0, 0.9), cpu("c-2", 1.0, 0.1), cpu("c-3", 1.0, 0.9))
    assert find(same_fp32) == []
    slow_fp32 = cluster(cpu("c-1", 1.0, 0.9), cpu("c-2", 0.5, 0.9), cpu("c-3", 1.0, 0.9))
    assert [(f.nodes, "TFLOPS fp32" in f.message) for f in find(slow_fp32)] == [("c-2", True)]


def links(*rows: tuple[str, str, float | None, float | None]) -> list[Link]:
    """Hand-made measured links: (src, dst, measured Gb/s or None for a failure, declared Gb/s)."""
    return [Link(src=s, dst=d, address=d, measured_gbps=m, declared_gbps=dec,
                 error=None if m is not None else "cannot reach: ConnectionRefusedError") for s, d, m, dec in rows]


def test_ring_pairs_are_one_link_per_node() -> None:
    assert ring(["a"]) == []
    assert ring(["a", "b"]) == [("a", "b"), ("b", "a")]
    assert ring(["a", "b", "c", "d"]) == [("a", "b"), ("b", "c"), ("c", "d"), ("d", "a")]


def test_a_node_whose_every_link_is_slow_is_named_alone() -> None:
    found = link_findings(links(("n1", "n2", 90.0, 100.0), ("n2", "n3", 4.0, 100.0), ("n3", "n4", 3.0, 100.0),
                                ("n4", "n1", 88.0, 100.0)))
    assert [(f.kind, f.key, f.nodes) for f in found] == [("slow_link", "bandwidth", "n3")]
    assert found[0].message == ("n3: every link far below the declared 100 Gb/s: n2 → n3 4 Gb/s, n3 → n4 3 Gb/s; "
                                "the other links 89 Gb/s")
    assert flagged_nodes(found) == {"n3": [found[0].message]}


def test_one_slow_link_between_healthy_nodes_names_the_pair() -> None:
    found = link_findings(links(("n1", "n2", 90.0, 100.0), ("n2", "n3", 9.0, 100.0), ("n3", "n1", 85.0, 100.0)))
    assert [f.nodes for f in found] == ["n[2-3]"]
    assert "the path between n2 and n3" in found[0].message
    assert set(flagged_nodes(found)) == {"n2", "n3"}


def test_a_ceiling_every_link_shares_is_not_a_fault() -> None:
    """A few TCP streams fill 40 of 400 Gb/s on every link: no link is below the others."""
    assert link_findings(links(("a", "b", 41.0, 400.0), ("b", "c", 38.0, 400.0), ("c", "a", 44.0, 400.0))) == []


def test_a_slower_nic_is_not_a_slow_link() -> None:
    """c has a 10 Gb/s NIC and its links measure 8 Gb/s: slower than the others, yet near what it declares."""
    assert link_findings(links(("a", "b", 80.0, 100.0), ("b", "c", 8.0, 10.0), ("c", "a", 8.5, 10.0))) == []


def test_without_a_declared_speed_a_link_is_recorded_but_never_flagged() -> None:
    """Bare figures vary too much from run to run on a busy machine to blame a node on them alone."""
    assert link_findings(links(("a", "b", 9.0, None), ("b", "c", 0.5, None), ("c", "a", 0.4, None))) == []
    assert [f.nodes for f in link_findings(links(("a", "b", 9.0, None), ("b", "c", 0.5, 10.0),
                                                 ("c", "a", 0.4, 10.0)))] == ["c"]


def test_two_nodes_far_below_their_declared_speed() -> None:
    found = link_findings(links(("a", "b", 0.05, 1.0), ("b", "a", 0.05, 1.0)))
    assert {f.nodes for f in found} == {"a", "b"}


def test_a_link_that_could_not_be_measured_names_both_ends() -> None:
    found = link_findings(links(("a", "b", 5.0, 10.0), ("b", "c", None, 10.0), ("c", "a", 5.0, 10.0)))
    assert [(f.key, f.nodes) for f in found] == [("unreachable", "b,c")]
    assert found[0].message == "link b → c (c) not measured: cannot reach: ConnectionRefusedError"


def test_links_round_trip_and_feed_find() -> None:
    c = cluster(node("gpu-01"), node("gpu-02"), node("gpu-03"))
    c = c.model_copy(update={"links": links(("gpu-01", "gpu-02", 190.0, 200.0), ("gpu-02", "gpu-03", 20.0, 200.0),
                                            ("gpu-03", "gpu-01", 21.0, 200.0))})
    again = Cluster.model_validate_json(c.model_dump_json())
    assert again.links == c.links
    assert [f.nodes for f in find(again) if f.kind == "slow_link"] == ["gpu-03"]
