"""Health before launch: measured links (``probe --bench``) and ``launch --health-check``.

The slow link is real: one sshd host lives in its own network namespace, joined
to the others by a veth pair rate-limited with ``tc`` tbf (:class:`tests.helpers.sshd.ShapedNetNs`),
so every byte it sends or receives crosses a shaped link. The declared NIC speed
is what the collector reads from the host's fake sysfs (hardware we do not have).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from hetctl.errors import StartFailed
from hetctl.files.cluster import Cluster, Link
from hetctl.files.eventlog import read_events
from hetctl.files.plan import Plan
from hetctl.files.yamlio import load_model
from hetctl.elastic.health import gate
from hetctl.elastic.policy import Tally
from hetctl.probe.health import HealthReport
from tests.helpers import sites
from tests.helpers.sshd import ShapedNetNs
from tests.test_collector import make_sysfs
from tests.test_probe_cli import _python_in, cpu_cgroup, first_cgroup, hetctl  # noqa: F401 - fixtures

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


class _Plan:
    """What :func:`gate` reads of a plan: its ranks' nodes."""

    def __init__(self, *nodes: str) -> None:
        self.ranks = [type("Rank", (), {"node": n})() for n in nodes]


def _report(flagged: dict[str, list[str]]) -> HealthReport:
    links = [Link(src="a", dst="b", address="b", measured_gbps=0.05, declared_gbps=1.0)]
    return HealthReport(Cluster(nodes=[{"name": "a", "host": "a"}], links=links), flagged, 1.5)


def test_gate_passes_refuses_or_drops_by_policy() -> None:
    events: list = []
    plan = _Plan("a", "b", "a", "c")
    checked: list = []

    def check(inv, names):
        checked.append(names)
        return _report({})

    assert gate(plan, None, "refuse", tally=Tally(), emit=events.append, replan=None, check=check) is plan
    assert checked == [["a", "b", "c"]]  # each node once, in plan order
    assert [(e.kind, e.action, e.flagged) for e in events] == [("health_check", "passed", {})]

    events.clear()
    slow = {"b": ["b chip 0 (CPU) measured 0.001 TFLOPS fp32, 90% below the median 0.01 of its 2 peers"]}
    with pytest.raises(StartFailed) as refused:
        gate(plan, None, "refuse", tally=Tally(), emit=events.append, replan=None, check=lambda i, n: _report(slow))
    assert refused.value.message == f"health check flagged b: {slow['b'][0]}; nothing started"
    assert "--health-check drop" in refused.value.hint
    assert [(e.kind, e.action) for e in events] == [("health_check", "refused")]
    assert events[0].links == [{"src": "a", "dst": "b", "measured_gbps": 0.05, "declared_gbps": 1.0, "error": None}]

    events.clear()
    tally, asked = Tally(), []

    def replan(old, decision, outcome, t):
        asked.append((old, decision.drop, list(t.dropped)))
        return "the new plan"

    assert gate(plan, None, "drop", tally=tally, emit=events.append, replan=replan, attempt=0,
                check=lambda i, n: _report(slow)) == "the new plan"
    assert asked == [(plan, ("b",), ["b"])] and tally.dropped == ["b"] and tally.membership_changes == 1
    assert [(e.kind, getattr(e, "action", None)) for e in events] == [("health_check", "dropped"), ("replan", None)]
    assert events[1].dropped == ["b"] and events[1].reason == "health check flagged b"


def _slowed_site(make_sshd_cluster, cgroup: Path, first: Path, tmp_path: Path) -> tuple[Path, Path]:
    """Three real sshd hosts, one (cpu-2) whose Python runs in a cgroup with 10% of a CPU, the others' in one
    served first (so that load from beside the suite cannot make them the slow ones); probed and planned."""
    c = make_sshd_cluster(names=NAMES)
    log = tmp_path / "python-slowed.log"
    c["cpu-2"].install_script("python-slowed", _python_in(cgroup, log))
    for name in NAMES:
        if name != "cpu-2":
            c[name].install_script("python-first", _python_in(first, tmp_path / f"python-first-{name}.log"))
    d = sites.probed_site(c, tmp_path / "site", {n: 1.0 for n in NAMES})
    inv = yaml.safe_load((d / "inventory.yaml").read_text())
    inv["ssh"]["fanout"] = 1  # one benchmark at a time: the unslowed hosts must not share the cores
    for n in inv["nodes"]:
        n["python"] = "python-slowed" if n["name"] == "cpu-2" else "python-first"
    (d / "inventory.yaml").write_text(yaml.safe_dump(inv, sort_keys=False))
    r = sites.hetctl(d, "plan", "-c", "cluster.yaml", "--model", "tiny", "--pp", "3", "-o", "plan")
    assert r.returncode == 0, r.stderr
    assert {s.node for s in load_model(d / "plan" / "plan.yaml", Plan).stages} == set(NAMES)
    return d, log


def _events(d: Path, run_dir: str = "runs") -> list[dict]:
    (run,) = (d / run_dir).iterdir()
    return read_events(run / "events.jsonl")


@pytest.mark.e2e
def test_launch_health_check_drops_the_slowed_node_and_trains_on_the_rest(make_sshd_cluster, cpu_cgroup,  # noqa: F811
                                                                          first_cgroup, tmp_path):  # noqa: F811
    d, log = _slowed_site(make_sshd_cluster, cpu_cgroup, first_cgroup, tmp_path)
    r = sites.hetctl(d, "launch", "plan", "--health-check", "drop", "--steps", "4", "--checkpoint-every", "2",
                     "--json", timeout=600)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["state"] == "succeeded" and summary["steps"] == 4
    events = _events(d)
    kinds = [e["kind"] for e in events]
    assert kinds[:3] == ["health_check", "replan_layout", "replan"] and kinds[3] == "launched", kinds
    check = events[0]
    assert check["policy"] == "drop" and check["action"] == "dropped" and check["nodes"] == NAMES
    assert "cpu-2" in check["flagged"], check
    assert any(m.startswith("cpu-2 chip 0 (") for m in check["flagged"]["cpu-2"]), check
    assert [(lk["src"], lk["dst"]) for lk in check["links"]] == [("cpu-1", "cpu-2"), ("cpu-2", "cpu-3"),
                                                                 ("cpu-3", "cpu-1")]
    assert all(lk["measured_gbps"] for lk in check["links"]), check["links"]
    assert set(check["tflops"]) == set(NAMES) and all(v[0] for v in check["tflops"].values())
    assert events[2]["dropped"] == sorted(check["flagged"]) or set(events[2]["dropped"]) == set(check["flagged"])
    assert "cpu-2" not in events[3]["nodes"] and events[3]["nodes"]
    attempt0 = load_model(Path(summary["run_dir"]) / "attempts" / "0" / "plan.yaml", Plan)
    assert "cpu-2" not in {s.node for s in attempt0.stages}
    # The benchmark's own run (not the envexec wrapper that starts it, which also logs): once, in the cgroup.
    bench = [ln.split("\t") for ln in log.read_text().splitlines() if ln.startswith('- {"device_type"')]
    assert len(bench) == 1 and bench[0][1].endswith("/" + cpu_cgroup.name), bench
    assert "health check of 3 nodes" in r.stderr and "dropped" in r.stderr


@pytest.mark.e2e
def test_launch_health_check_refuses_with_one_line_naming_the_node(make_sshd_cluster, cpu_cgroup,  # noqa: F811
                                                                  first_cgroup, tmp_path):  # noqa: F811
    d, _ = _slowed_site(make_sshd_cluster, cpu_cgroup, first_cgroup, tmp_path)
    r = sites.hetctl(d, "launch", "plan", "--health-check", "refuse", "--steps", "4", timeout=600)
    assert r.returncode == 3, r.stderr
    assert "Traceback" not in r.stderr
    line = next(ln for ln in r.stderr.splitlines() if ln.startswith("error: "))
    assert line.startswith("error: health check flagged ") and "cpu-2" in line and line.endswith("nothing started")
    assert "--health-check drop" in r.stderr
    events = _events(d)
    assert [e["kind"] for e in events] == ["health_check", "failed"]
    assert events[0]["action"] == "refused" and "cpu-2" in events[0]["flagged"]
    (run,) = (d / "runs").iterdir()
    assert yaml.safe_load((run / "run.yaml").read_text())["state"] == "failed"


def test_health_check_policy_is_checked(tmp_path) -> None:
    r = hetctl("launch", str(tmp_path), "--health-check", "maybe")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.splitlines()[0] == "error: --health-check 'maybe': not a policy"


def test_measure_links_streams_between_local_nodes_in_a_ring_of_the_reachable_ones() -> None:
    """Real linkbench processes on this machine (local transport); the unreachable node is left out of the ring."""
    from hetctl.files.cluster import Nic, NodeFacts
    from hetctl.files.inventory import load_inventory
    from hetctl.probe.links import measure_links

    inv = load_inventory(Path(__file__).parent.parent / "inventories" / "local.yaml")
    facts = {n.name: NodeFacts(name=n.name, host=n.host, nics=[Nic(name="eth0", speed_gbps=speed)])
             for n, speed in zip(inv.nodes, (1.0, 10.0, 1.0))}
    facts["node-c"] = facts["node-c"].model_copy(update={"reachable": False, "error": "connection refused"})
    found = measure_links(inv.nodes, facts, inv.ssh, seconds=0.2, streams=2)
    assert [(lk.src, lk.dst, lk.address, lk.streams, lk.declared_gbps) for lk in found] == [
        ("node-a", "node-b", "127.0.0.1", 2, 1.0), ("node-b", "node-a", "127.0.0.1", 2, 1.0)]
    assert all(lk.error is None and lk.measured_gbps > 0 and lk.seconds > 0 and lk.rtt_ms > 0 for lk in found), found


def test_check_flags_silent_nodes_and_the_findings_nodes_and_the_live_line_says_so() -> None:
    from dataclasses import replace

    from hetctl.cli.live import event_line
    from hetctl.files.cluster import Finding
    from hetctl.files.events import HealthChecked
    from hetctl.files.inventory import load_inventory
    from hetctl.probe.health import check

    inv = load_inventory(Path(__file__).parent.parent / "inventories" / "local.yaml")
    asked = []

    def probe(subset, bench):
        asked.append(([n.name for n in subset.nodes], bench))
        return Cluster(nodes=[{"name": "node-a", "host": "localhost"},
                              {"name": "node-c", "host": "localhost", "reachable": False, "error": "timed out"}],
                       findings=[Finding(kind="slow_link", key="bandwidth", nodes="node-a", message="node-a: slow"),
                                 Finding(kind="software", key="torch", nodes="node-a", message="not a health finding")])

    report = check(inv, ["node-c", "node-a"], probe=probe)
    assert asked == [(["node-a", "node-c"], True)]  # only the asked nodes, benchmarked
    assert report.flagged == {"node-c": ["did not answer the health check: timed out"], "node-a": ["node-a: slow"]}
    ev = HealthChecked(policy="drop", nodes=["node-a", "node-c"], flagged=report.flagged, action="dropped",
                       check_s=12.34)
    assert event_line(ev) == ("health check of 2 nodes (12.3 s): node-c, node-a flagged (did not answer the health "
                              "check: timed out; node-a: slow); dropped")
    assert event_line(replace(ev, flagged={}, action="passed")) == "health check of 2 nodes (12.3 s): passed"
