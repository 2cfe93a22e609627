"""Trust no node, no shared folder and no terminal (issue 33).

Kind 1, a node speaks only for itself: the monitor is fed forged and malformed agent
messages (scripted, and fuzzed with Hypothesis), and the controller's reader is fed a
real process's hostile output through a real pipe.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hetctl.files.events import read_events
from hetctl.launch import wire
from hetctl.launch.controller import _Agent
from hetctl.launch.monitor import RankState
from hetctl.launch.outcome import RunState
from tests import test_monitor as tm
from tests.test_monitor import Clock, feed, make_monitor, start_all

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture
def plan():
    return tm.plan.__wrapped__()  # ranks 0-5, rank r on node n<r>


@pytest.fixture
def spec(plan):
    return tm.spec.__wrapped__(plan, tm.nodes.__wrapped__(plan))


def bad_messages(run) -> list[tuple[str, str]]:
    return [(e["node"], e["reason"]) for e in read_events(run.events_path, "bad_message")]


# -- kind 1: a node speaks only for itself ------------------------------------
def test_a_forged_crash_of_another_nodes_rank_blames_no_one(plan, spec, tmp_path):
    """n1 says rank 0 (on n0) crashed: a warning about n1, rank 0 runs on, no failure."""
    clock = Clock()
    mon, run = make_monitor(plan, spec, tmp_path, clock)
    start_all(mon, clock, plan)
    feed(mon, clock, "n1", "exited", rank=0, code=1, signal=None)
    feed(mon, clock, "n1", "heartbeat", rank=4, hb={"step": 99})
    feed(mon, clock, "n1", "log", rank=3, lines=["planted line"])
    assert mon.failures == [] and mon.ranks[0].state == RankState.RUNNING and mon.ranks[4].step is None
    assert read_events(run.events_path, "rank_failed") == []
    assert bad_messages(run) == [
        ("n1", "exited for rank 0, which the plan puts on another node"),
        ("n1", "heartbeat for rank 4, which the plan puts on another node"),
        ("n1", "log for rank 3, which the plan puts on another node")]
    feed(mon, clock, "n1", "exited", rank=1, code=3, signal=None, t=12.5)  # its own rank: its own fault, as before
    assert [(f.node, f.rank, f.reason) for f in mon.failures] == [("n1", 1, "exit code 3")]


def test_forged_exit_zeros_do_not_end_the_run(plan, spec, tmp_path):
    """One node claiming every rank finished does not make the run succeed."""
    clock = Clock()
    mon, run = make_monitor(plan, spec, tmp_path, clock)
    start_all(mon, clock, plan)
    for r in plan.ranks:
        feed(mon, clock, "n1", "exited", rank=r.rank, code=0, signal=None)
    assert [st.rank for st in mon.ranks.values() if st.state == RankState.DONE] == [1]
    assert not all(st.state == RankState.DONE for st in mon.ranks.values())


@pytest.mark.parametrize("msg, reason", [
    ({"ev": "exited", "code": 1}, "exited: field rank missing"),
    ({"ev": "started"}, "started: field rank missing"),
    ({"ev": "heartbeat", "rank": "0"}, "heartbeat: field rank is '0'"),
    ({"ev": "exited", "rank": True, "code": 0}, "exited: field rank is True"),
    ({"ev": "heartbeat", "rank": 1, "hb": {"step": 3, "loss": "x"}}, "heartbeat of rank 1: loss is 'x'"),
    ({"ev": "heartbeat", "rank": 1, "hb": {"step": 3, "step_ms": float("inf")}}, "heartbeat of rank 1: step_ms is inf"),
    ({"ev": "alive", "ranks": {"1": "S", "0": "T"}}, "alive names rank '0', which the plan puts on another node"),
    ({"ev": "alive", "ranks": {"x": "S"}}, "alive names rank 'x', which the plan puts on another node"),
    ({"ev": "alive", "ranks": {"²": "S"}}, "alive names rank '²', which the plan puts on another node"),
    ({"ev": "standby", "rank": 1, "state": "ready", "import_s": "slow"}, "standby: field import_s is 'slow'"),
    ({"ev": "stopped", "left": ["1; rm -rf /"]}, "stopped: field left is ['1; rm -rf /']"),
    ({"ev": "exited", "rank": 1, "t": "yesterday"}, "exited: field t is 'yesterday', not a time"),
    ({"ev": 7}, "unknown event 7"),
    ({"ev": "nonsense"}, "unknown event 'nonsense'"),
])
def test_a_malformed_message_is_a_warning_not_a_crash(plan, spec, tmp_path, msg, reason):
    """Each used to raise (KeyError, ValueError, TypeError) in the controller, or was believed."""
    clock = Clock()
    mon, run = make_monitor(plan, spec, tmp_path, clock)
    start_all(mon, clock, plan)
    mon.handle("n1", msg)
    mon.check(clock.t)
    assert mon.failures == [] and bad_messages(run) == [("n1", reason)]
    assert mon.ranks[1].state == RankState.RUNNING and mon.ranks[1].proc_state == ""


def test_the_same_bad_message_is_written_once(plan, spec, tmp_path):
    clock = Clock()
    mon, run = make_monitor(plan, spec, tmp_path, clock)
    for _ in range(50):
        mon.handle("n1", {"ev": "exited", "rank": 0, "code": 1})
    for i in range(50):
        mon.handle("n1", {"ev": f"junk-{i}"})
    assert len(bad_messages(run)) == 1 + 19


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                     max_leaves=8)
_field = st.sampled_from(["rank", "hb", "lines", "dropped", "ranks", "state", "pid", "code", "signal", "error",
                          "oom", "left", "message", "reason", "t", "import_s"])
_messages = st.fixed_dictionaries(
    {"ev": st.sampled_from(["hello", "started", "heartbeat", "log", "alive", "standby", "exited", "stopped",
                            "error", "port", "x"]) | _json},
    optional={"rank": st.integers(-2, 8) | _json,
              "hb": st.fixed_dictionaries({}, optional={k: _json | st.floats() | st.integers(-1, 50) for k in
                                                         ("step", "loss", "step_ms", "time", "phase", "compute_ms",
                                                          "first_loss", "tokens_per_s")}) | _json},
) .flatmap(lambda base: st.dictionaries(_field, _json, max_size=4).map(lambda extra: {**extra, **base}))


@FUZZ
@given(stream=st.lists(st.tuples(st.sampled_from(["n0", "n1", "n2", "n3", "n4", "n5"]), _messages), max_size=25))
def test_fuzz_any_messages_never_crash_nor_blame_another_node(plan, spec, tmp_path_factory, stream):
    clock = Clock()
    mon, run = make_monitor(plan, spec, tmp_path_factory.mktemp("fuzz"), clock)
    start_all(mon, clock, plan)
    senders = set()
    for node, msg in stream:
        senders.add(node)
        mon.handle(node, msg)
        mon.check(clock.t)
        mon.progress(clock.t)
    mon.outcome(RunState.FAILED)
    assert {f.node for f in mon.failures} <= senders
    for st_ in mon.ranks.values():  # a rank changes state only by its own node's word
        if st_.state != RankState.RUNNING:
            assert st_.node in senders
    json.dumps(mon.snapshot().ranks, default=str)
    mon.logs.close()


# -- the controller's reader on a real pipe -------------------------------------
HOSTILE_AGENT = r"""
import json, sys
w = sys.stdout.buffer.write
w(b'{"ev": "hello"}\n')
w(b'x' * (9 << 20) + b'\n')                       # 9 MiB without a break
w(b'{"ev": "port", "port": "not a port"}\n')      # used to kill the reader thread
w(b'[1, 2]\n')
w(json.dumps({"ev": "exited", "rank": 0, "code": 1}).encode() + b'\n')
w(json.dumps({"ev": "stopped", "reason": "done"}).encode() + b'\n')
sys.stdout.flush()
"""


class _Proc:
    def __init__(self, popen: subprocess.Popen) -> None:
        self.stdout, self.stderr, self.stdin = popen.stdout, popen.stderr, popen.stdin


def test_the_reader_survives_a_real_hostile_agent_with_bounded_memory():
    import queue

    popen = subprocess.Popen([sys.executable, "-I", "-c", HOSTILE_AGENT], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    agent = _Agent("n1", None, _Proc(popen), inbox)
    assert agent.eof.wait(30)
    popen.wait(10)
    got = []
    while not inbox.empty():
        got.append(inbox.get()[1])
    assert got[0] == {"ev": "hello"}
    assert isinstance(got[1], wire.Refused) and got[1].reason.startswith("a line of 9437185 bytes")
    assert isinstance(got[2], wire.Refused) and got[2].reason == "not an event: b'[1, 2]\\n'"
    assert got[3] == {"ev": "exited", "rank": 0, "code": 1} and got[4]["ev"] == "stopped" and got[5] is None
    assert "not a port" in agent.tail() and not agent.port_answered.is_set()


def test_lines_hold_at_most_the_limit():
    import io

    class Counting(io.BytesIO):
        most = 0

        def readline(self, size=-1):
            line = super().readline(size)
            Counting.most = max(Counting.most, len(line))
            return line

    stream = Counting(b"a\n" + b"y" * 100_000 + b"\nb\n")
    out = list(wire.lines(stream, limit=1000))
    assert out[0] == b"a\n" and isinstance(out[1], wire.Refused) and out[2] == b"b\n"
    assert Counting.most == 1000



@pytest.mark.parametrize("answer, said", [
    ({"port": "29500; touch /tmp/x"}, "the pre-flight's answer has port = '29500; touch /tmp/x'"),
    ({"workdir": None}, "the pre-flight's answer has workdir = None"),
    ({"modules": ["torch"]}, "the pre-flight's answer has modules = ['torch']"),
])
def test_a_malformed_preflight_answer_fails_only_its_own_node(tmp_path, answer, said):
    """Each used to crash the controller (ValueError, TypeError, AttributeError) after the fan-out."""
    from hetctl.errors import StartFailed
    from hetctl.files.plan import Plan
    from hetctl.remote.testing import FakeFleet, NodeScript
    from tests.rankrunner import tiny_plan
    from tests.test_attempt import attempt, inventory

    plan3 = Plan.model_validate(tiny_plan([2, 2, 2]))
    fleet = FakeFleet({"n0": NodeScript(preflight=answer)})
    with pytest.raises(StartFailed) as e:
        attempt(plan3, inventory.__wrapped__(plan3), tmp_path, fleet)
    assert [f.node for f in e.value.failures] == ["n0"] and said in e.value.message
