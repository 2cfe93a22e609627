"""Trust no node, no shared folder and no terminal (issue 33).

Kind 1, a node speaks only for itself: the monitor is fed forged and malformed agent
messages (scripted, and fuzzed with Hypothesis), and the controller's reader is fed a
real process's hostile output through a real pipe.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hetctl.files.eventlog import read_events
from hetctl.files.events import StorageWarning
from hetctl.launch import wire
from hetctl.launch.agentlink import AgentLink
from hetctl.launch.status import RankState
from hetctl.launch.outcome import AttemptOutcome, RunState
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


def test_a_nodes_batch_of_heartbeats_moves_its_own_ranks_only(plan, spec, tmp_path):
    """The agent sends one ``heartbeats`` line per poll for its ranks; the whole batch is refused when one entry
    names a rank of another node (a node speaks only for itself)."""
    clock = Clock()
    mon, run = make_monitor(plan, spec, tmp_path, clock)
    start_all(mon, clock, plan)
    feed(mon, clock, "n1", "heartbeats", hbs=[[1, {"step": 4, "loss": 2.5}]])
    assert (mon.ranks[1].step, mon.ranks[1].loss) == (4, 2.5)
    feed(mon, clock, "n1", "heartbeats", hbs=[[1, {"step": 5}], [4, {"step": 99}]])
    assert mon.ranks[1].step == 4 and mon.ranks[4].step is None
    assert bad_messages(run) == [("n1", "heartbeats for rank 4, which the plan puts on another node")]


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
    ({"ev": "heartbeats", "hbs": [[1, {"step": 3}], [0, {"step": 3}]]},
     "heartbeats for rank 0, which the plan puts on another node"),
    ({"ev": "heartbeats", "hbs": [[1, {"step": -1}]]}, "heartbeat of rank 1: step is -1"),
    ({"ev": "heartbeats", "hbs": [[1, {"step": 3}, 9]]}, "heartbeats: field hbs is [[1, {'step': 3}, 9]]"),
    ({"ev": "heartbeats", "hbs": {"1": {"step": 3}}}, "heartbeats: field hbs is {'1': {'step': 3}}"),
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
_field = st.sampled_from(["rank", "hb", "hbs", "lines", "dropped", "ranks", "state", "pid", "code", "signal", "error",
                          "oom", "left", "message", "reason", "t", "import_s"])
_messages = st.fixed_dictionaries(
    {"ev": st.sampled_from(["hello", "started", "heartbeat", "heartbeats", "log", "alive", "standby", "exited",
                            "stopped", "error", "port", "x"]) | _json},
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
        self.stderr_path, self.stderr_from = None, 0


def test_the_reader_survives_a_real_hostile_agent_with_bounded_memory():
    import queue

    popen = subprocess.Popen([sys.executable, "-I", "-c", HOSTILE_AGENT], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    agent = AgentLink("n1", None, _Proc(popen), inbox)
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
    from tests.helpers.rankrunner import tiny_plan
    from tests.test_attempt import attempt, inventory

    plan3 = Plan.model_validate(tiny_plan([2, 2, 2]))
    fleet = FakeFleet({"n0": NodeScript(preflight=answer)})
    with pytest.raises(StartFailed) as e:
        attempt(plan3, inventory.__wrapped__(plan3), tmp_path, fleet)
    assert [f.node for f in e.value.failures] == ["n0"] and said in e.value.message


# -- kind 2: only the run's own files are deleted or written, never through a link ----
def test_a_planted_jit_link_in_the_checkpoint_store_deletes_nothing_outside(tmp_path):
    """discard() used to rmtree <victim>/<n> through a `jit` link, on every restart and resume."""
    from hetctl.node import jitstate

    victim = tmp_path / "home" / "projects"
    (victim / "3").mkdir(parents=True)
    (victim / "3" / "thesis.tex").write_text("years of work\n")
    ck = tmp_path / "store" / "run-1"
    ck.mkdir(parents=True)
    (ck / jitstate.JIT_DIR).symlink_to(victim)
    jitstate.discard(ck, 5)
    assert (victim / "3" / "thesis.tex").read_text() == "years of work\n"
    own = tmp_path / "store" / "run-2"
    (own / jitstate.JIT_DIR / "2" / "rank-0").mkdir(parents=True)
    (own / jitstate.JIT_DIR / "2" / "rank-0" / "x").write_text("dump")
    (own / jitstate.JIT_DIR / "1").symlink_to(victim / "3")
    jitstate.discard(own, 5)  # its own dumps go; a link among them is removed as a link, not followed
    assert not (own / jitstate.JIT_DIR / "2").exists() and (victim / "3" / "thesis.tex").exists()


def test_promote_refuses_a_step_folder_that_is_a_planted_link(tmp_path):
    from hetctl.files.safefs import UnsafePath
    from hetctl.node import jitstate, manifest

    ck, elsewhere = tmp_path / "ck", tmp_path / "elsewhere"
    ck.mkdir()
    elsewhere.mkdir()
    (elsewhere / manifest.MANIFEST).write_text("the victim's own\n")
    (ck / "step-7").symlink_to(elsewhere)
    choice = jitstate.JitChoice(attempt=0, step=7, sources={}, skipped=())
    with pytest.raises(UnsafePath, match="step-7: a symbolic link"):
        jitstate.promote(ck, choice, "d1g3st")
    assert (elsewhere / manifest.MANIFEST).read_text() == "the victim's own\n"
    assert isinstance(UnsafePath("x"), OSError)  # peers.decide handles it as a failed promotion


def _run_folder(tmp_path):
    import time

    from hetctl.files.run import RunDir, RunInfo, RunInputs

    run = RunDir.create(tmp_path / "runs", "r-1")
    run.save_info(RunInfo(run_id="r-1", created=time.time(), updated=time.time(),
                          inputs=RunInputs(steps=3, checkpoint_every=0, checkpoint_dir=str(tmp_path / "ck"))))
    return run


@pytest.mark.parametrize("where", ["default", "-o"])
def test_report_replaces_a_planted_link_instead_of_writing_through_it(tmp_path, where):
    import os

    from typer.testing import CliRunner

    from hetctl.cli import app

    run = _run_folder(tmp_path)
    secret = tmp_path / "secret"
    secret.write_text("private key\n")
    os.chmod(secret, 0o600)
    target = run.path / "report.html" if where == "default" else tmp_path / "out.html"
    target.symlink_to(secret)
    args = ["report", str(run.path)] + (["-o", str(target)] if where == "-o" else [])
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    assert secret.read_text() == "private key\n" and (secret.stat().st_mode & 0o777) == 0o600
    assert not target.is_symlink() and "<html" in target.read_text()


def _plan_dir(tmp_path, force=False, names=("a", "b")):
    from hetctl.files.cluster import Chip, Cluster, NodeFacts
    from hetctl.plan.models import load_model
    from hetctl.plan.planner import plan_cluster
    from hetctl.plan.render import write_plan_dir

    cl = Cluster(nodes=[NodeFacts(name=n, host=n, tflops_override=1.0, memory_gb=16.0,
                                  chips=[Chip(index=0, vendor="cpu", memory_gb=16.0)]) for n in names])
    return write_plan_dir(plan_cluster(cl, load_model("tiny")), tmp_path / "plan", force=force)


def test_plan_o_keeps_a_script_the_user_edited_unless_forced(tmp_path):
    from hetctl.errors import ConfigError

    _plan_dir(tmp_path)
    script = tmp_path / "plan" / "nodes" / "a.sh"
    edited = script.read_text().replace("set -euo pipefail", "set -euo pipefail\nexport NCCL_IB_HCA=mlx5_1  # mine")
    assert edited != script.read_text()
    script.write_text(edited)
    with pytest.raises(ConfigError, match=r"nodes/a.sh: changed since hetctl wrote it.*--force"):
        _plan_dir(tmp_path)
    assert script.read_text() == edited
    with pytest.raises(ConfigError, match=r"nodes/a.sh: changed"):  # nor removed as an earlier plan's script
        _plan_dir(tmp_path, names=("b", "c"))
    assert script.read_text() == edited
    _plan_dir(tmp_path, force=True)
    assert "# mine" not in script.read_text()
    _plan_dir(tmp_path)  # hetctl's own, unchanged: replaced without a word


def test_plan_o_replaces_a_planted_link_and_leaves_its_target_alone(tmp_path):
    import os

    victim = tmp_path / "bashrc"
    victim.write_text("alias ls='ls -F'\n")
    os.chmod(victim, 0o600)
    _plan_dir(tmp_path)
    link = tmp_path / "plan" / "nodes" / "b.sh"
    link.unlink()
    link.symlink_to(victim)
    with pytest.raises(Exception, match="nodes/b.sh: changed"):
        _plan_dir(tmp_path)
    _plan_dir(tmp_path, force=True)
    assert victim.read_text() == "alias ls='ls -F'\n" and (victim.stat().st_mode & 0o777) == 0o600
    assert not link.is_symlink() and (link.stat().st_mode & 0o777) == 0o755


# -- kinds 3 and 5: what nodes print is text, never terminal control -------------
HOSTILE = "boom \x1b]0;pwned\x07\x1b[2J\x1b]52;c;ZXZpbA==\x07\u202eevil"


def _hostile_run(tmp_path):
    from hetctl.files.events import RankFailed
    from hetctl.files.eventlog import EventLog

    run = _run_folder(tmp_path)
    with EventLog(run.events_path) as ev:
        ev.emit(RankFailed(attempt=0, node="n1", rank=1, reason=HOSTILE))
    (run.path / "logs" / "n1").mkdir()
    (run.path / "logs" / "n1" / "rank-1.log").write_text(
        "==> hetctl attempt 0, rank 1 on n1 <==\nhi \x1b[2J\x1b]8;;http://x\x1b\\link\x1b]8;;\x1b\\ \x9b2J\n")
    return run


def _in_a_pty(args, cwd) -> bytes:
    """Run ``python -m hetctl ARGS`` on a real pseudo-terminal; everything it wrote there."""
    import os
    import pty

    pid, fd = pty.fork()
    if pid == 0:  # the child: its stdout and stderr are the terminal
        os.chdir(cwd)
        os.environ["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
        os.environ.pop("NO_COLOR", None)
        os.execv(sys.executable, [sys.executable, "-m", "hetctl", *args])
    chunks = []
    while True:
        try:
            data = os.read(fd, 65536)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    os.waitpid(pid, 0)
    os.close(fd)
    return b"".join(chunks)


@pytest.mark.parametrize("command", ["status", "logs"])
def test_node_strings_reach_a_real_terminal_as_visible_text(tmp_path, command):
    run = _hostile_run(tmp_path)
    seen = _in_a_pty([command, str(run.path)], tmp_path)
    assert b"\x1b]" not in seen and b"\x1b[2J" not in seen and b"\xc2\x9b" not in seen, seen  # no OSC, no clear
    assert b"\xe2\x80\xae" not in seen  # no right-to-left override
    text = seen.decode(errors="replace")
    if command == "status":
        assert "boom \\x1b]0;pwned" in text and "\\x1b[2J" in text and "\\u202eevil" in text
    else:
        assert "hi \\x1b[2J\\x1b]8;;http://x" in text and "\\x9b2J" in text


def test_json_output_escapes_what_json_leaves_raw(capsys):
    from hetctl.cli.base import print_json

    print_json(json.dumps({"chip": "A100\x9b2J\u202e"}, ensure_ascii=False))
    out = capsys.readouterr().out
    assert json.loads(out) == {"chip": "A100\x9b2J\u202e"} and "\x9b" not in out and "\u202e" not in out


def test_the_console_cleans_every_renderable_but_keeps_its_own_styles():
    import io

    from rich.table import Table
    from rich.text import Text

    from hetctl.textsafe import safe_console

    buf = io.StringIO()
    con = safe_console(file=buf, force_terminal=True, width=200)
    t = Table()
    t.add_column("chip")
    t.add_row(Text("H100\x1b]0;x\x07\x1b[31m"))
    con.print(t)
    con.print(Text("red", style="red"), Text("\x1b[2J"))
    out = buf.getvalue()
    assert "\x1b]" not in out and "\x1b[2J" not in out and "\x1b[31m" in out  # rich's own red, not the node's
    assert "H100\\x1b]0;x" in out


# -- kind 10: every output stays valid ------------------------------------------
def test_status_json_of_a_nan_loss_is_valid_json(tmp_path):
    from typer.testing import CliRunner

    from hetctl.cli import app
    from hetctl.files.events import Progress, StageProgress
    from hetctl.files.eventlog import EventLog

    run = _run_folder(tmp_path)
    with EventLog(run.events_path) as ev:
        ev.emit(Progress(attempt=0, step=2, loss=float("nan"), stages=[StageProgress(0, 0, 2, float("nan"), 3.0)]))
    r = CliRunner().invoke(app, ["status", str(run.path), "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout, parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))
    assert data["loss"] is None


def test_report_and_status_skip_an_event_without_ts(tmp_path):
    from typer.testing import CliRunner

    from hetctl.cli import app

    run = _run_folder(tmp_path)
    with open(run.events_path, "a") as f:
        f.write('{"kind": "rank_failed", "attempt": 0, "node": "n1", "rank": 1, "reason": "x"}\n')
        f.write('{"ts": "soon", "kind": "node_lost", "attempt": 0, "node": "n1", "reason": "x"}\n')
    for args in (["report", str(run.path)], ["status", str(run.path)]):
        r = CliRunner().invoke(app, args)
        assert r.exit_code == 0 and r.exception is None, (args, r.output)


# -- kind 8: stop and resume never race ---------------------------------------------
def test_a_stop_sent_while_the_run_prepares_is_not_lost(tmp_path):
    """`hetctl stop` from another machine lands after the lock is taken, before the loop starts: it stops the run."""
    from hetctl.elastic.loop import ElasticRun
    from tests.test_elastic import prepared, site

    prep = prepared(site.__wrapped__(tmp_path))  # holds the run's lock, as resume's preparation does
    prep.run.stop_path.write_text("requested by pid 1 on elsewhere\n")

    def attempt(req, **kwargs):
        stopped = kwargs["stop"].wait(5)
        return AttemptOutcome(RunState.STOPPED if stopped else RunState.SUCCEEDED, last_step=0 if stopped else 20)

    assert ElasticRun(prep, attempt_fn=attempt).run().summary.state == "stopped"


# -- kind 9: only the run's owner counts ----------------------------------------------
@pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0, reason="needs root to start another user's process")
def test_another_users_process_with_the_run_id_does_not_count(tmp_path):
    import subprocess

    from hetctl.node.alive import alive

    env = {"HETCTL_RUN_ID": "r-owner-test", "PATH": "/usr/bin:/bin"}
    theirs = subprocess.Popen(["sleep", "30"], env=env, user=65534, group=65534)
    mine = subprocess.Popen(["sleep", "30"], env=env)
    try:
        import time

        deadline = time.monotonic() + 5
        while mine.pid not in [p for p, _, _ in alive("r-owner-test")["pids"]] and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = [p for p, _, _ in alive("r-owner-test")["pids"]]
        assert mine.pid in pids and theirs.pid not in pids
    finally:
        for p in (theirs, mine):
            p.kill()
            p.wait()


# -- kind 4: no code runs from folders other users can write -----------------------------
def test_probe_from_a_folder_with_a_planted_module_never_imports_it(tmp_path):
    """A local node's helpers (collector, pre-flight) run as `python -c`/`python -` in hetctl's current
    folder; a json.py planted there used to run in each of them."""
    import subprocess

    planted = tmp_path / "shared-checkout"
    planted.mkdir()
    mark = tmp_path / "RAN"
    (planted / "json.py").write_text(f"open({str(mark)!r}, 'a').write('x')\nraise SystemExit('planted')\n")
    (planted / "inv.yaml").write_text(f"nodes:\n  - name: me\n    host: localhost\n    transport: local\n"
                                      f"    workdir: {tmp_path / 'wd'}\n")
    launcher = tmp_path / "bin" / "hetctl-here.py"  # like the installed `hetctl`: no current folder on sys.path
    launcher.parent.mkdir()
    launcher.write_text(f"import sys\nsys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})\n"
                        "from hetctl.cli import main\nmain()\n")
    r = subprocess.run([sys.executable, str(launcher), "probe", "-i", "inv.yaml", "-o", str(tmp_path / "c.yaml")],
                       cwd=planted, capture_output=True, text=True, timeout=300, env={"PATH": "/usr/bin:/bin"})
    assert not mark.exists(), r.stderr
    assert r.returncode == 0 and "did not answer" not in r.stderr, r.stderr


@pytest.mark.parametrize("mode", [0o1777, 0o1770, 0o770])
def test_a_sticky_or_group_writable_workdir_is_refused_by_the_real_preflight(tmp_path, mode):
    """Sticky (/tmp's 1777) keeps others from deleting our files, not from planting a torch.py beside them.
    A folder writable only by the user's own private group (umask 002) is the user's: accepted (mode 770)."""
    import grp

    from hetctl.files.inventory import Node
    from hetctl.launch import materialize as mat
    from hetctl.remote import connect

    wd = tmp_path / "wd"
    wd.mkdir()
    os.chmod(wd, mode)
    shared_gid = next((g.gr_gid for g in grp.getgrall() if g.gr_mem), None)  # a group with members
    if mode == 0o1770:
        if shared_gid is None:
            pytest.skip("no group with members on this machine")
        os.chown(wd, -1, shared_gid)
    node = Node(name="me", host="localhost", transport="local", python=sys.executable, workdir=str(wd))
    t = connect(node, None)
    try:
        res = t.run(mat.preflight_argv(sys.executable, str(wd), False, ()), timeout=60, check=False)
    finally:
        t.close()
    info = mat.parse_preflight(res.stdout)
    if mode == 0o770:  # our own group (as root: root's, which no other user has)
        assert info["unsafe"] is None, info
    else:
        assert info["unsafe"] and "writable by" in info["unsafe"], info


# -- kind 7: faults of the run's own storage are not node faults ------------------------------
@pytest.fixture
def full_disk(tmp_path):
    """A 64 KiB tmpfs: a real file system that fills up (needs root; skipped where mount is refused)."""
    import subprocess

    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_full_disk_under_the_run_folder_is_a_warning_not_a_crash(plan, spec, full_disk):
    clock = Clock()
    mon, run = make_monitor(plan, spec, full_disk, clock)
    start_all(mon, clock, plan)
    seen = []
    mon.events.listeners.append(seen.append)
    for i in range(40):  # 40 × 4 KiB lines: well past 64 KiB
        mon.handle("n1", {"ev": "log", "rank": 1, "lines": ["x" * 4000], "t": float(i)})
    mon.handle("n1", {"ev": "exited", "rank": 1, "code": 0, "signal": None})
    assert mon.failures == [] and mon.ranks[1].state == RankState.DONE
    warned = [e for e in seen if isinstance(e, StorageWarning)]
    assert len(warned) == 1 and warned[0].path.endswith("rank-1.log") and "space" in warned[0].reason
    mon.logs.close()
    mon.events.close()


# -- kinds 3 and 11: plan/slurm.sbatch quotes what it writes, and runs for one chip kind ----------
def _one_kind_plan(model_name="tiny", chip_model="cpu"):
    from hetctl.files.plan import Plan
    from tests.helpers.rankrunner import tiny_plan

    raw = tiny_plan([2, 2, 2])
    raw["model"]["name"] = model_name
    for s in raw["stages"]:
        s["model"] = chip_model
    return Plan.model_validate(raw)


def test_sbatch_of_one_chip_kind_is_a_plain_job_that_needs_no_arguments():
    from hetctl.plan.sbatch import render_sbatch

    text = render_sbatch(_one_kind_plan(), "/site/plan")
    srun = [ln for ln in text.splitlines() if ln.startswith("srun ")]
    assert len(srun) == 1 and "--het-group" not in srun[0] and "#SBATCH hetjob" not in text
    assert "export HETCTL_STEPS=${HETCTL_STEPS:-100}" in text


def test_sbatch_comment_lines_cannot_be_ended_by_a_chip_or_model_name(tmp_path):
    import subprocess

    from hetctl.plan.sbatch import render_sbatch

    mark = tmp_path / "PWNED"
    evil = f"X\ntouch {mark}\n#"
    text = render_sbatch(_one_kind_plan(chip_model=evil), str(tmp_path))
    assert f"\ntouch {mark}" not in text and "X\\ntouch" in text
    script = tmp_path / "s.sh"
    script.write_text(text)
    # the script's own commands up to the first srun, run for real (srun stubbed out): no planted command runs
    head = text.split("\npids=()")[0]
    subprocess.run(["bash", "-c", head.replace("set -euo pipefail", "set -uo pipefail")], env={"PATH": "/usr/bin:/bin",
                   "SLURM_JOB_ID": "1"}, cwd=tmp_path, capture_output=True, timeout=30)
    assert not mark.exists()


@pytest.mark.e2e
def test_sbatch_of_one_chip_kind_runs_as_written_on_the_mini_cluster(tmp_path_factory):
    """All-CPU nodes (one chip kind): `sbatch slurm.sbatch` with no argument trains to the end."""
    from hetctl.node import manifest as ckpt
    from tests.helpers.rankrunner import free_port
    from tests.helpers.slurm import NodeSpec, SlurmCluster, skip_reason
    from tests.test_slurm import CPU_NODES, allocate, allocation_env, hetctl, write_site

    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    d = tmp_path_factory.mktemp("sbatch-one-kind")
    c = SlurmCluster(d / "slurm", [NodeSpec(n, 2, "", "cpu") for n in CPU_NODES]).start()
    try:
        job = allocate(c, "-N3")
        env = allocation_env(c, job, d / "home")
        write_site(d, {"slurm": {}})
        for args in (("probe", "-i", "inventory.yaml", "-o", "cluster.yaml"),
                     ("plan", "-c", "cluster.yaml", "--model", "tiny", "--pp", "3", "--dp", "1", "-o", "plan")):
            r = hetctl(d, env, *args)
            assert r.returncode == 0, r.stderr
        script = d / "plan" / "slurm.sbatch"
        assert "#SBATCH hetjob" not in script.read_text()
        submit = {k: v for k, v in env.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}
        submit.update(HETCTL_PYTHON=sys.executable, MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1",
                      HETCTL_STEPS="6", HETCTL_CKPT_EVERY="3")  # the script's defaults, made short
        r = subprocess.run(["sbatch", "--wait", "--parsable", "-D", str(d), "-o", str(d / "job-%j.out"), str(script)],
                           cwd=d, env=submit, capture_output=True, text=True, timeout=240)
        out = "".join(p.read_text() for p in d.glob("job-*.out"))
        assert r.returncode == 0, (r.stderr, out)
        jid = r.stdout.strip().split(";")[0]
        assert "step=6 loss=" in out
        assert ckpt.latest_valid(d / "checkpoints" / f"slurm-{jid}")[0] == 6
    finally:
        c.stop()


# -- kind 10: --dry-run shows no env value the user did not mark public ----------------------------
def test_dry_run_masks_every_env_value_unless_the_inventory_marks_it_public(tmp_path):
    """S3_CREDS and MY_PASS slipped past the name-based mask; now no value shows unless public_env lists it."""
    from hetctl.files.inventory import load_inventory
    from hetctl.launch.materialize import mask_env

    (tmp_path / "inventory.yaml").write_text(
        "public_env: [NCCL_SOCKET_IFNAME]\n"
        "defaults: {transport: local, env: {S3_CREDS: 'ak:sk', MY_PASS: hunter2, NCCL_SOCKET_IFNAME: bond0}}\n"
        "nodes: [{name: a, host: localhost}]\n")
    inv = load_inventory(tmp_path / "inventory.yaml")
    shown = mask_env(inv.nodes[0].env, inv.public_env)
    assert shown == {"S3_CREDS": "***", "MY_PASS": "***", "NCCL_SOCKET_IFNAME": "bond0"}


# -- kind 6: bounded resources against a node's output --------------------------------------------
def test_a_node_command_that_prints_without_end_keeps_a_bounded_part(tmp_path):
    """Real local transport, real process: 80 MiB on stdout (and stderr); hetctl keeps 64 MiB of each and finishes."""
    from hetctl.files.inventory import Node
    from hetctl.remote import connect
    from hetctl.remote.startline import MAX_OUTPUT

    node = Node(name="me", host="localhost", transport="local", python=sys.executable, workdir=str(tmp_path))
    t = connect(node, None)
    code = ("import sys\nblock = b'y' * (1 << 20)\nfor _ in range(80):\n"
            "    sys.stdout.buffer.write(block); sys.stderr.buffer.write(block)\n")
    try:
        res = t.run([sys.executable, "-c", code], timeout=120, check=False)
    finally:
        t.close()
    assert res.exit_code == 0
    for text in (res.stdout, res.stderr):
        assert MAX_OUTPUT <= len(text) < MAX_OUTPUT + 200 and text.rstrip().endswith(f"dropped: over {MAX_OUTPUT}]")


def test_a_start_line_search_does_not_grow_with_the_output():
    from hetctl.remote.startline import Started

    s = Started()
    for _ in range(2000):
        s.see(b"z" * 4096)
    assert len(s._seen) <= 512 and not s.wait(0)
    s.see(b"\nhetctl-pid:")
    s.see(b"4242\n")  # a start line split across reads is still found
    assert s.wait(0) and s.pid == 4242


_blank_lines = st.lists(st.one_of(st.text(max_size=40),
                                  st.builds(lambda a, n, b: a + " " * n + b, st.text(max_size=20),
                                            st.integers(0, 70_000), st.text(max_size=20)),
                                  st.builds(lambda n: "\t" * n, st.integers(0, 70_000))), max_size=8)


@FUZZ
@given(key=st.sampled_from(sorted(__import__("hetctl.probe.tools", fromlist=["PARSERS"]).PARSERS)), lines=_blank_lines)
def test_fuzz_every_parser_with_long_lines_returns_chips_or_nothing(key, lines):
    """Never a crash, whatever a node's tool prints (the speed bound is bench/parsers_long_lines.py's)."""
    from hetctl.probe.tools import parse_tool

    assert isinstance(parse_tool(key, "\n".join(lines)), list)


def test_a_padded_line_in_real_rocminfo_output_reads_as_the_unpadded_one():
    from hetctl.probe.parsers._common import MAX_BLANK, MAX_LINE, tame
    from hetctl.probe.tools import parse_tool

    path = Path(__file__).parent / "fixtures" / "smi-samples" / "rocminfo_mi300x-x4_thamada-sim.txt"
    lines = path.read_text().splitlines()
    padded = [ln.replace(":", ":" + " " * 60_000, 1) for ln in lines]
    assert parse_tool("rocminfo", "\n".join(padded)) == parse_tool("rocminfo", "\n".join(lines)) != []
    held = tame("\n".join(padded))
    assert max(map(len, held.split("\n"))) <= MAX_LINE and " " * (MAX_BLANK + 1) not in held


@pytest.mark.parametrize("first, final, shown", [(5.5, float("nan"), "5.5000 → nan (diverged)"),
                                                 (5.5, None, "5.5000 → -"), (None, None, "-")])
def test_the_run_summary_says_a_nan_loss_diverged(first, final, shown):
    from hetctl.cli.runview import loss_span

    assert loss_span(first, final) == shown


def test_the_edge_checks_exactly_the_protocols_events_and_fields():
    """wire's field table and hetctl.node.protocol's types say the same thing: each event the monitor handles,
    its required and its optional fields (the monitor dispatches on ``ev`` to one handler each)."""
    from hetctl.launch.monitor import Monitor
    from hetctl.node.protocol import EVENTS

    assert set(wire._FIELDS) == set(EVENTS)
    for ev, shape in EVENTS.items():
        required = {f for f, (req, _) in wire._FIELDS[ev].items() if req}
        optional = {f for f, (req, _) in wire._FIELDS[ev].items() if not req}
        assert (required, optional) == (set(shape.__required_keys__) - {"ev"}, set(shape.__optional_keys__)), ev
        assert callable(getattr(Monitor, "_on_" + ev, None)), ev
