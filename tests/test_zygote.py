"""The tests' fork server (tests/helpers/zygote.py) starts a rank as a fresh ``python -m`` would."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import pytest

from tests.helpers import zygote

PROBE = r'''
import json, os, sys, time
had_torch = "torch" in sys.modules
what = sys.argv[1]
if what == "sleep":
    print("sleeping", flush=True)
    time.sleep(60)
if what == "raise":
    raise ValueError("a rank's own error")
print(json.dumps({"argv": sys.argv, "x": os.environ.get("ZYGOTE_X"), "cwd": os.getcwd(), "had_torch": had_torch,
                  "own_session": os.getsid(0) == os.getpid(), "name": __name__}))
sys.stderr.write("to stderr\n")
sys.exit(int(what))
'''


@pytest.mark.e2e
def test_a_forked_rank_has_its_argv_env_files_session_and_exit_code(tmp_path, monkeypatch):
    (tmp_path / "zprobe.py").write_text(PROBE)
    monkeypatch.setenv("HETCTL_TEST_ZYGOTE", "1")
    monkeypatch.chdir(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "ZYGOTE_X": "seen"}

    def run(arg: str) -> tuple[zygote.Forked, str, str]:
        out, err = tmp_path / f"{arg}.out", tmp_path / f"{arg}.err"
        out.touch()  # as the rank runner makes them before the start
        p = zygote.spawn([sys.executable, "-m", "zprobe", arg], env, str(out), str(err))
        assert p is not None
        return p, out, err

    p, out, err = run("3")
    assert p.wait(60) == 3 and p.returncode == 3 and p.poll() == 3
    got = json.loads(out.read_text())
    assert got == {"argv": [str(tmp_path / "zprobe.py"), "3"], "x": "seen", "cwd": str(tmp_path),
                   "had_torch": True, "own_session": True, "name": "__main__"}
    assert err.read_text() == "to stderr\n"

    p, _, err = run("raise")
    assert p.wait(60) == 1
    assert "ValueError: a rank's own error" in err.read_text() and "Traceback" in err.read_text()

    p, out, _ = run("sleep")
    try:
        deadline = time.monotonic() + 60
        while "sleeping" not in out.read_text() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert p.poll() is None
        os.killpg(p.pid, signal.SIGKILL)  # its own process group, as a test's fault injection sends it
        assert p.wait(60) == -signal.SIGKILL
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)


def test_only_a_python_dash_m_command_is_forked_and_only_when_asked(monkeypatch):
    monkeypatch.setenv("HETCTL_TEST_ZYGOTE", "1")
    assert zygote.spawn([sys.executable, "some_script.py"], dict(os.environ), "/dev/null", "/dev/null") is None
    assert zygote.spawn(["/bin/true", "-m", "x"], dict(os.environ), "/dev/null", "/dev/null") is None
    monkeypatch.setenv("HETCTL_TEST_ZYGOTE", "0")
    assert zygote.spawn([sys.executable, "-m", "x"], dict(os.environ), "/dev/null", "/dev/null") is None
