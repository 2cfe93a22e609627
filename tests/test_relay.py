"""Relay agents over SSH (issue 36): past ``ssh.relay_above`` nodes, each group's agents through one session.

The pure tests check the groups and the relay's ssh line. On four real sshd hosts (``tests/helpers/sshd.py``)
the same plan trains with and without relays to the same loss, bit for bit, while each relay host's own ssh
carries its group's other agent; and the transport-level test stops one relayed node alone.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from hetctl.files.inventory import Node, SshSettings, load_inventory
from hetctl.remote import connect, mux, relay
from tests.helpers.sites import hetctl, probed_site
from tests.helpers.sshd import SshdCluster


def _node(name: str, **labels: str) -> Node:
    return Node(name=name, host=name, labels=labels)


def test_groups_of_about_the_root_of_the_nodes_led_by_their_first():
    groups = relay.relay_groups([_node(f"n{i:02d}") for i in range(10)])
    assert [[n.name for n in g] for g in groups] == [["n00", "n01", "n02", "n03"], ["n04", "n05", "n06", "n07"],
                                                     ["n08", "n09"]]
    # by switch where every node has one; a switch holding more than twice the root is cut
    nodes = [_node(f"a{i:02d}", switch="s1") for i in range(12)] + [_node(f"b{i}", switch="s2") for i in range(3)]
    sizes = [(g[0].labels["switch"], len(g)) for g in relay.relay_groups(nodes)]
    assert sizes == [("s1", 4), ("s1", 4), ("s1", 4), ("s2", 3)]
    assert all(len({n.labels["switch"] for n in g}) == 1 for g in relay.relay_groups(nodes))


def test_the_relays_ssh_line_keeps_every_value_a_word_of_its_own():
    node = Node(name="n2", host="-oProxyCommand=evil", port=2222, user="u", identity_file="/k/id key",
                transport="ssh")
    settings = SshSettings(config=None, known_hosts="/site/known hosts", connect_timeout=4.5)
    argv = relay.member_ssh(node, settings, ["python3", "-c", "x; y", "a b"], "~/w d")
    assert argv[:2] == ["ssh", "-T"] and argv[-3:-1] == ["--", "-oProxyCommand=evil"]  # a host is never an option
    assert argv[-1] == "cd \"$HOME\"/'w d' && exec python3 -c 'x; y' 'a b'"
    opts = [argv[i + 1] for i, w in enumerate(argv[:-3]) if w == "-o"]
    assert {"BatchMode=yes", "StrictHostKeyChecking=yes", "ConnectTimeout=5", "ForwardAgent=no", "ForwardX11=no",
            "ClearAllForwardings=yes", "User=u", "Port=2222", 'IdentityFile="/k/id key"', "IdentitiesOnly=yes",
            'UserKnownHostsFile="/site/known hosts" ~/.ssh/known_hosts'} <= set(opts)


def test_no_relays_at_or_below_the_threshold():
    ssh = SimpleNamespace(relay_above=None)
    assert relay.start_relayed([_node("a"), _node("b")], {}, {}, None, ssh) == {}
    assert relay.start_relayed([_node("a"), _node("b")], {}, {}, None, SimpleNamespace(relay_above=2)) == {}


# --- real sshd hosts ---------------------------------------------------------------------------------------

STEPS = 12


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = SshdCluster(tmp_path_factory.mktemp("relay-sshd"), 4, first_octet=60).start()
    yield c
    c.stop()
    assert not c.leftovers(), "processes left behind on the relay hosts"


@pytest.fixture(scope="module")
def site(cluster, tmp_path_factory) -> Path:
    d = probed_site(cluster, tmp_path_factory.mktemp("relay"), {h.name: 1.0 for h in cluster})
    inv = yaml.safe_load((d / "inventory.yaml").read_text())
    inv["ssh"]["relay_above"] = 2  # four nodes: two relays (node-1 for node-2, node-3 for node-4)
    (d / "inventory-relay.yaml").write_text(yaml.safe_dump(inv, sort_keys=False))
    r = hetctl(d, "plan", "-c", "cluster.yaml", "--model", "tiny", "--pp", "2", "--dp", "2", "-o", "plan")
    assert r.returncode == 0, r.stderr
    return d


def _relayed_sessions(cluster: SshdCluster) -> set[tuple[str, str]]:
    """(relay host, relayed host) for each ssh client that runs under one host's sshd towards another."""
    addrs = {h.addr: h.name for h in cluster}
    found = set()
    for h in cluster:
        for p in h.processes():
            try:
                cmd = p.cmdline()
            except Exception:  # noqa: BLE001 - gone meanwhile
                continue
            if cmd[:2] == ["ssh", "-T"]:
                found |= {(h.name, addrs[w]) for w in cmd if w in addrs}
    return found


@pytest.mark.sshd
def test_a_plan_trains_through_relays_to_the_loss_it_reaches_without_them(cluster, site):
    dry = hetctl(site, "launch", "plan", "--dry-run", "--json", "-i", "inventory-relay.yaml")
    assert json.loads(dry.stdout)["relays"] == {"node-1": "node-1", "node-2": "node-1", "node-3": "node-3",
                                               "node-4": "node-3"}, dry.stderr
    text = hetctl(site, "launch", "plan", "--dry-run", "-i", "inventory-relay.yaml").stdout
    assert "relay: node-1 (its agent over ssh from there)" in text and "relay: itself" in text
    assert "relays" not in json.loads(hetctl(site, "launch", "plan", "--dry-run", "--json").stdout)
    args = ("launch", "plan", "--steps", str(STEPS), "--checkpoint-every", "0", "--json")
    direct = hetctl(site, *args)
    assert direct.returncode == 0, direct.stderr
    seen: set = set()
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            seen.update(_relayed_sessions(cluster))
            time.sleep(0.2)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    try:
        relayed = hetctl(site, *args, "-i", "inventory-relay.yaml")
    finally:
        stop.set()
        t.join()
    assert relayed.returncode == 0, relayed.stderr
    a, b = json.loads(direct.stdout), json.loads(relayed.stdout)
    assert b["state"] == "succeeded" and b["steps"] == STEPS and b["final_loss"] == a["final_loss"]  # bit for bit
    assert seen == {("node-1", "node-2"), ("node-3", "node-4")}, seen
    run = Path(b["run_dir"])
    assert (run / "logs" / "node-1" / "relay.stderr").exists() and (run / "logs" / "node-3" / "relay.stderr").exists()
    assert cluster.wait_no_session_processes(10) == []


@pytest.mark.sshd
def test_one_relayed_node_stops_alone(cluster, site, tmp_path):
    inv = load_inventory(site / "inventory-relay.yaml")
    nodes = inv.nodes
    transports = {n.name: connect(n, inv.ssh) for n in nodes}
    prog = ["sh", "-c", 'echo "$HOME $K"; cat; echo bye; exit 4']
    launches = {n.name: SimpleNamespace(agent_argv=prog, env={"K": f"k-{n.name}"}, workdir=None) for n in nodes}
    run_dir = SimpleNamespace(path=tmp_path, agent_stderr_path=lambda n: tmp_path / "logs" / n / "agent.stderr")
    try:
        members = relay.start_relayed(nodes, transports, launches, run_dir, inv.ssh)
        assert set(members) == {n.name for n in nodes} and all(isinstance(m, mux.Member) for m in members.values())
        got: dict[str, list[bytes]] = {n: [] for n in members}
        ended = {n: threading.Event() for n in members}
        for n, m in members.items():
            m.subscribe(got[n].append, ended[n].set)
        deadline = time.monotonic() + 20
        while any(not v for v in got.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        homes = {h.name: str(h.home) for h in cluster}
        assert {n: v[0] for n, v in got.items()} == {n: f"{homes[n]} k-{n}\n".encode() for n in members}
        members["node-2"].stdin.write(b"through node-1\n" + b"z" * 3000 + b"\n")
        members["node-2"].close_stdin()
        assert ended["node-2"].wait(20) and members["node-2"].wait(5) == 4
        assert got["node-2"][1:] == [b"through node-1\n", b"z" * 3000 + b"\n", b"bye\n"]
        assert not ended["node-1"].is_set() and not ended["node-4"].is_set()  # the relay and the others go on
        members["node-4"].kill()
        assert ended["node-4"].is_set() and not ended["node-3"].is_set()
        for n in ("node-1", "node-3"):
            members[n].close_stdin()
            assert members[n].wait(20) == 4
    finally:
        for t in transports.values():
            t.close()
    assert cluster.wait_no_session_processes(10) == []


@pytest.mark.sshd
def test_a_lost_relay_is_dropped_and_its_group_is_not(cluster, site):
    """Kill the relay host node-1 mid-run (the last test here: node-1 stays down): node-1 is lost, node-2, whose
    agent went down with the relay's session, is not blamed; the run ends on the survivors, relayed again."""
    from tests.test_recovery import Launch, plan_of

    run = Launch(site, "lost-relay", "-i", "inventory-relay.yaml")
    run.wait_checkpoint(8)
    cluster["node-1"].kill()  # its sshd and every process under it: the relay, node-1's agent and ranks
    summary = run.finish()
    assert summary["state"] == "succeeded" and summary["steps"] == 24, run.story()
    assert [e["node"] for e in run.events("node_lost")] == ["node-1"], run.story()
    (carried,) = run.events("agent_lost")
    assert carried["node"] == "node-2" and "its relay node-1 was lost" in carried["reason"], run.story()
    (replan,) = run.events("replan")
    assert replan["dropped"] == ["node-1"], run.story()
    last = plan_of(run.run, run.events("launched")[-1]["attempt"])
    assert "node-2" in {r.node for r in last.ranks} and "node-1" not in {r.node for r in last.ranks}


@pytest.mark.parametrize("relay_silent", [True, False])
def test_a_node_silent_with_its_relay_is_not_blamed_one_silent_alone_is(tmp_path, relay_silent):
    from hetctl.files.eventlog import read_events
    from hetctl.launch.monitor import Monitor
    from hetctl.launch.outcome import FaultKind
    from hetctl.launch.wire import Carried
    from tests.test_monitor import Clock, start_all

    plan, clock = tm_plan(), Clock()
    mon, run = tm_monitor(plan, tmp_path, clock)
    assert isinstance(mon, Monitor)
    mon.carriers = {"n0": "n0", "n1": "n0"}  # n0 relays n1's agent
    start_all(mon, clock, plan)
    clock.t += 10  # past the node timeout (3 s) for the silent ones; the others spoke just now
    for node in sorted(set(mon.node_state) - ({"n0", "n1"} if relay_silent else {"n1"})):
        mon.handle(node, {"ev": "alive", "ranks": {}})
    mon.check(clock.t)
    lost = [e["node"] for e in read_events(run.events_path, "node_lost")]
    carried = [e["node"] for e in read_events(run.events_path, "agent_lost")]
    if relay_silent:
        assert (lost, carried) == (["n0"], ["n1"])
        assert {(f.node, f.kind) for f in mon.failures} == {("n0", FaultKind.NODE_LOST), ("n1", FaultKind.CRASH)}
        mon.handle("n1", Carried("its relay n0 was lost"))
        assert len(read_events(run.events_path, "agent_lost")) == 1  # the stream's later end adds nothing
    else:
        assert (lost, carried) == (["n1"], [])


def tm_plan():
    from hetctl.files.plan import Plan
    from tests.helpers.rankrunner import tiny_plan

    return Plan.model_validate(tiny_plan([2, 2, 2], dp=2))  # ranks 0-5 on n0-n5


def tm_monitor(plan, tmp_path, clock):
    from tests.test_monitor import make_monitor, nodes, spec

    return make_monitor(plan, spec.__wrapped__(plan, nodes.__wrapped__(plan)), tmp_path, clock, hang_timeout=100,
                        start_timeout=100)  # only the nodes' silence is judged here
