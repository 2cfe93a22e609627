"""The per-node agent on real processes: spawn, report, forward, stop, and leave nothing behind.

Each test starts ``python -m hetctl.node.agent`` (or the shipped zipapp) as a real
subprocess, speaks its JSON-lines protocol, and checks the rank processes with
psutil. The ranks are small Python scripts written per test.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from hetctl.launch.materialize import agent_zipapp

REPO = Path(__file__).resolve().parents[1]


class AgentProc:
    """A running agent plus the events it has emitted so far."""

    def __init__(self, argv: list[str], cwd: Path, env: dict | None = None) -> None:
        self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  cwd=cwd, env=env)
        self.events: list[dict] = []
        self.cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.p.stdout:
            with self.cond:
                self.events.append(json.loads(line))
                self.cond.notify_all()

    def send(self, obj: dict) -> None:
        self.p.stdin.write((json.dumps(obj) + "\n").encode())
        self.p.stdin.flush()

    def wait_for(self, pred, timeout: float = 20.0) -> dict:
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for ev in self.events:
                    if pred(ev):
                        return ev
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no matching event in {timeout}s; got {[e['ev'] for e in self.events]}")
                self.cond.wait(left)

    def of(self, kind: str) -> list[dict]:
        with self.cond:
            return [e for e in self.events if e["ev"] == kind]

    def close(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait(timeout=10)


def rank_spec(tmp: Path, rank: int, script: str, argv_prefix: list[str] | None = None, env: dict | None = None):
    path = tmp / f"rank{rank}.py"
    path.write_text(textwrap.dedent(script))
    return {
        "rank": rank,
        "argv": [*(argv_prefix or [sys.executable]), str(path)],
        "env": {"HB": str(tmp / "hb" / f"rank-{rank}.json"), "RANKNO": str(rank), **(env or {})},
        "cwd": str(tmp),
        "log": str(tmp / "logs" / f"rank-{rank}.log"),
        "heartbeat": str(tmp / "hb" / f"rank-{rank}.json"),
    }


STEPPER = """
    import json, os, sys, time
    hb = os.environ["HB"]
    for step in range(1, 4):
        print(f"rank {os.environ['RANKNO']} step {step}", flush=True)
        with open(hb + ".tmp", "w") as f:
            json.dump({"step": step, "time": time.time(), "loss": 10.0 / step}, f)
        os.replace(hb + ".tmp", hb)
        time.sleep(0.25)
    sys.exit(int(os.environ.get("CODE", "0")))
"""

# Ignores SIGTERM and starts a child in its own group that ignores it too, plus one that
# escapes the group with setsid: stopping must still leave nothing behind.
STUBBORN = """
    import os, signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
    a = subprocess.Popen([sys.executable, "-c", code])
    b = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    print("children", a.pid, b.pid, flush=True)
    time.sleep(600)
"""


def gone(pids: list[int], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def agent(tmp_path):
    started: list[AgentProc] = []

    def make(argv: list[str] | None = None, env: dict | None = None) -> AgentProc:
        a = AgentProc(argv or [sys.executable, "-m", "hetctl.node.agent"], REPO if argv is None else tmp_path, env)
        started.append(a)
        a.wait_for(lambda e: e["ev"] == "hello")
        return a

    yield make
    for a in started:
        a.close()


def test_runs_ranks_forwards_heartbeats_logs_and_exit_codes(agent, tmp_path):
    a = agent()
    a.send({"cmd": "start", "grace_s": 1,
            "ranks": [rank_spec(tmp_path, 0, STEPPER), rank_spec(tmp_path, 1, STEPPER, env={"CODE": "3"})]})
    exits = {r: a.wait_for(lambda e, r=r: e["ev"] == "exited" and e["rank"] == r) for r in (0, 1)}
    assert (exits[0]["code"], exits[0]["signal"]) == (0, None)
    assert (exits[1]["code"], exits[1]["signal"]) == (3, None)
    assert {e["rank"] for e in a.of("started")} == {0, 1}
    beats = [(e["rank"], e["hb"]) for e in a.events if e["ev"] == "heartbeat"] + \
        [(r, hb) for e in a.events if e["ev"] == "heartbeats" for r, hb in e["hbs"]]  # one line a poll for both
    last = next(hb for r, hb in beats if r == 1 and hb["step"] == 3)
    assert last["loss"] == pytest.approx(10.0 / 3)
    a.wait_for(lambda e: e["ev"] == "log" and "rank 1 step 3" in e["lines"])
    forwarded = [ln for e in a.of("log") if e["rank"] == 0 for ln in e["lines"]]
    assert forwarded == ["rank 0 step 1", "rank 0 step 2", "rank 0 step 3"]
    assert (tmp_path / "logs" / "rank-0.log").read_text().splitlines() == forwarded
    a.send({"cmd": "stop"})
    a.wait_for(lambda e: e["ev"] == "stopped")
    assert a.p.wait(timeout=10) == 0


def test_reports_death_by_signal_and_process_state(agent, tmp_path):
    a = agent()
    a.send({"cmd": "start", "ranks": [
        rank_spec(tmp_path, 0, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)\n"),
        rank_spec(tmp_path, 1, "import time; time.sleep(600)\n"),
    ]})
    ev = a.wait_for(lambda e: e["ev"] == "exited" and e["rank"] == 0)
    assert ev["signal"] == signal.SIGKILL and ev["code"] is None
    pid = a.wait_for(lambda e: e["ev"] == "started" and e["rank"] == 1)["pid"]
    os.kill(pid, signal.SIGSTOP)  # a hang as the controller sees it: state T in the agent's alive events
    a.wait_for(lambda e: e["ev"] == "alive" and e["ranks"].get("1") == "T")
    a.send({"cmd": "stop"})
    a.wait_for(lambda e: e["ev"] == "stopped")
    assert gone([pid])
    # SIGCONT follows SIGTERM: the stopped rank ends on SIGTERM at once, not on SIGKILL when the grace runs out
    assert a.wait_for(lambda e: e["ev"] == "exited" and e["rank"] == 1)["signal"] == signal.SIGTERM


def test_stop_escalates_to_sigkill_and_leaves_no_descendant(agent, tmp_path):
    a = agent()
    a.send({"cmd": "start", "grace_s": 0.5, "ranks": [rank_spec(tmp_path, 0, STUBBORN)]})
    line = a.wait_for(lambda e: e["ev"] == "log" and any(x.startswith("children") for x in e["lines"]))
    kids = [int(x) for x in next(x for x in line["lines"] if x.startswith("children")).split()[1:]]
    pid = a.of("started")[0]["pid"]
    a.send({"cmd": "stop"})
    ev = a.wait_for(lambda e: e["ev"] == "exited")
    assert ev["signal"] == signal.SIGKILL  # SIGTERM was ignored; the grace ran out
    a.wait_for(lambda e: e["ev"] == "stopped")
    assert gone([pid, *kids])


def test_stdin_closing_stops_the_ranks(agent, tmp_path):
    a = agent()
    a.send({"cmd": "start", "grace_s": 2, "ranks": [rank_spec(tmp_path, r, "import time; time.sleep(600)\n")
                                                    for r in range(2)]})
    pids = [a.wait_for(lambda e, r=r: e["ev"] == "started" and e["rank"] == r)["pid"] for r in range(2)]
    a.p.stdin.close()  # the controller died or the SSH session dropped
    ev = a.wait_for(lambda e: e["ev"] == "stopped")
    assert "stdin closed" in ev["reason"]
    assert {e["signal"] for e in a.of("exited")} == {signal.SIGTERM}
    assert gone(pids)


def test_ranks_die_with_a_sigkilled_agent(agent, tmp_path):
    a = agent()
    a.send({"cmd": "start", "ranks": [rank_spec(tmp_path, r, "import time; time.sleep(600)\n") for r in range(2)]})
    pids = [a.wait_for(lambda e, r=r: e["ev"] == "started" and e["rank"] == r)["pid"] for r in range(2)]
    assert all(psutil.Process(p).ppid() == a.p.pid for p in pids)
    a.p.kill()  # no chance to clean up: PR_SET_PDEATHSIG must do it
    a.p.wait(timeout=10)
    assert gone(pids, timeout=5)


def test_unstartable_rank_is_reported_as_exit_127(agent, tmp_path):
    a = agent()
    spec = rank_spec(tmp_path, 0, "")
    spec["argv"] = [str(tmp_path / "no-such-python")]
    a.send({"cmd": "start", "ranks": [spec]})
    ev = a.wait_for(lambda e: e["ev"] == "exited")
    assert ev["code"] == 127 and "no-such-python" in ev["error"]


def test_log_flood_is_rate_limited_but_kept_whole_on_the_node(agent, tmp_path):
    a = agent()
    flood = "import sys\nfor i in range(40000):\n    sys.stdout.write('x' * 60 + ' %d\\n' % i)\n"
    a.send({"cmd": "start", "ranks": [rank_spec(tmp_path, 0, flood)]})
    a.wait_for(lambda e: e["ev"] == "exited")
    a.send({"cmd": "stop"})
    a.wait_for(lambda e: e["ev"] == "stopped")
    logs = a.of("log")
    forwarded = sum(len(e["lines"]) for e in logs)
    dropped = sum(e.get("dropped", 0) for e in logs)
    assert dropped > 0 and forwarded + dropped == 40000
    assert len((tmp_path / "logs" / "rank-0.log").read_text().splitlines()) == 40000


def test_shipped_zipapp_runs_without_site_packages(agent, tmp_path):
    pyz = tmp_path / "hetctl-agent.pyz"
    pyz.write_bytes(agent_zipapp())
    # -S: no site-packages, so neither an installed hetctl nor psutil can help.
    a = agent([sys.executable, "-S", str(pyz)], env={"PATH": os.environ["PATH"]})
    script = """
        import os, hetctl.node.runtime
        assert hetctl.node.runtime.__file__.startswith(os.environ["PYTHONPATH"])
        hetctl.node.runtime.heartbeat(7, loss=1.5)
        print("runtime ok", flush=True)
    """
    spec = rank_spec(tmp_path, 0, script, argv_prefix=[sys.executable, "-S"],
                     env={"PYTHONPATH": str(pyz), "HETCTL_HEARTBEAT_FILE": str(tmp_path / "hb" / "rank-0.json")})
    a.send({"cmd": "start", "ranks": [spec]})
    assert a.wait_for(lambda e: e["ev"] == "exited")["code"] == 0
    hb = a.wait_for(lambda e: e["ev"] == "heartbeat")["hb"]
    assert (hb["step"], hb["loss"]) == (7, 1.5)
    a.send({"cmd": "stop"})
    a.wait_for(lambda e: e["ev"] == "stopped")
    assert "runtime ok" in (tmp_path / "logs" / "rank-0.log").read_text()


def test_bad_command_is_an_error_event_not_a_crash(agent):
    a = agent()
    a.p.stdin.write(b"not json\n{\"cmd\": \"dance\"}\n")
    a.p.stdin.flush()
    a.wait_for(lambda e: e["ev"] == "error" and "unreadable" in e["message"])
    a.wait_for(lambda e: e["ev"] == "error" and "dance" in e["message"])
    a.send({"cmd": "stop"})
    a.wait_for(lambda e: e["ev"] == "stopped")


def test_a_bad_rank_spec_is_named_without_its_environment(agent):
    """The error event names the rank and its keys; the inventory's env values (secrets) never reach it."""
    a = agent()
    a.send({"cmd": "start", "ranks": [{"rank": 4, "env": {"HF_TOKEN": "hf_s3cr3t_value"}}]})  # no argv
    ev = a.wait_for(lambda e: e["ev"] == "error")
    assert "rank 4" in ev["message"] and "'argv'" in ev["message"]
    assert "hf_s3cr3t_value" not in json.dumps(a.events)
    a.send({"cmd": "stop"})
    a.wait_for(lambda e: e["ev"] == "stopped")


DAEMON = """
import os, sys, time
if os.fork() == 0:            # a daemon, the classic way: fork, setsid, fork again; init adopts it
    os.setsid()
    if os.fork() == 0:
        time.sleep(600)
        os._exit(0)
    os._exit(0)
time.sleep(0.5)
print("daemon started", flush=True)
time.sleep(600)
"""


def test_stop_also_ends_a_daemon_that_left_the_rank_s_session(agent, tmp_path):
    a = agent()
    a.send({"cmd": "start", "grace_s": 1, "ranks": [rank_spec(tmp_path, 0, DAEMON, env={"HETCTL_RUN_ID": "run-dmn"})]})
    a.wait_for(lambda e: e["ev"] == "log" and any("daemon started" in x for x in e["lines"]))

    def of_run():
        found = []
        for p in psutil.process_iter():
            try:
                if p.environ().get("HETCTL_RUN_ID") == "run-dmn" and p.status() != psutil.STATUS_ZOMBIE:
                    found.append(p)
            except psutil.Error:
                continue
        return found

    daemons = [p for p in of_run() if p.ppid() == 1 or p.pid != a.of("started")[0]["pid"]]
    assert any(p.ppid() != a.p.pid for p in daemons)  # really escaped: not the agent's child
    a.send({"cmd": "stop"})
    stopped = a.wait_for(lambda e: e["ev"] == "stopped")
    assert "left" not in stopped
    assert gone([p.pid for p in daemons])


def test_output_without_newlines_keeps_the_agent_small(agent, tmp_path):
    """100 MB on one line: read in bounded pieces, the agent's memory does not grow with it."""
    a = agent()
    flood = "import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(100):\n    sys.stdout.write(chunk)\nsys.stdout.flush()\n"
    a.send({"cmd": "start", "grace_s": 1, "ranks": [rank_spec(tmp_path, 0, flood)]})
    proc = psutil.Process(a.p.pid)
    peak = 0
    deadline = time.monotonic() + 120
    while not a.of("exited") and time.monotonic() < deadline:
        peak = max(peak, proc.memory_info().rss)
        time.sleep(0.02)
    assert a.wait_for(lambda e: e["ev"] == "exited")["code"] == 0
    assert peak < 80 * (1 << 20), f"agent grew to {peak / (1 << 20):.0f} MiB"
    assert (tmp_path / "logs" / "rank-0.log").stat().st_size == 100 * (1 << 20)  # the node's log keeps it all
    a.send({"cmd": "stop"})
    a.wait_for(lambda e: e["ev"] == "stopped")


def test_the_rendezvous_port_is_free_and_below_the_ephemeral_range():
    """The pre-flight's (and a kept agent's) rendezvous port: one that no outgoing connection on the node can
    take as its source port before rank 0 binds it (a port-0 pick is ephemeral, and lost that race under load)."""
    import socket

    from hetctl.node.preflight import rendezvous_port

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {rendezvous_port() for _ in range(20)}
    assert all(1024 <= p < low for p in ports), ports
    assert len(ports) > 1  # picked at random, not one fixed port every run and node shares
    with socket.socket() as s:
        s.bind(("", ports.pop()))  # free when picked


def test_one_poll_sends_one_line_for_all_the_ranks_it_found_stepping(tmp_path):
    """8 ranks of a node step together: one ``heartbeats`` line, not eight (the controller's work is per line)."""
    import io
    import threading
    from types import SimpleNamespace

    from hetctl.node.agent import Agent

    out = io.BytesIO()
    a = Agent(io.BytesIO(), out)
    for r in range(3):
        path = tmp_path / f"rank-{r}.json"
        path.write_text(json.dumps({"step": 5, "loss": 1.0 + r}))
        a.ranks[r] = SimpleNamespace(rank=r, heartbeat=str(path), hb_mtime=0, from_log=None, _lock=threading.Lock())
    a.poll_heartbeats()
    a.poll_heartbeats()  # nothing new: nothing sent
    (tmp_path / "rank-1.json").write_text(json.dumps({"step": 6, "loss": 0.5}))
    os.utime(tmp_path / "rank-1.json", ns=(1, 10**18))
    a.poll_heartbeats()
    lines = [json.loads(x) for x in out.getvalue().splitlines()]
    assert [e["ev"] for e in lines] == ["heartbeats", "heartbeat"]
    assert lines[0]["hbs"] == [[r, {"step": 5, "loss": 1.0 + r}] for r in range(3)]
    assert (lines[1]["rank"], lines[1]["hb"]) == (1, {"step": 6, "loss": 0.5})
