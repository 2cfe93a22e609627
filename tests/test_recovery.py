"""Recovery end to end: real faults (kill -9, SIGSTOP, killed sshd, killed controller, corrupted checkpoint).

The first tests cover ``hetctl resume``'s pre-checks on real processes and real
checkpoint folders; the e2e tests below run the reference trainer on real sshd hosts.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from hetctl.run import checkpoint as ckpt
from hetctl.run.resume import ResumeRefused, check_checkpoint, check_no_rank_alive, find_alive

MODEL = {"name": "tiny", "num_layers": 4, "hidden_size": 64, "ffn_hidden_size": 256,
         "num_attention_heads": 4, "vocab_size": 256, "seq_len": 32}


class _LocalNode:
    def __init__(self, name: str) -> None:
        self.name = name
        self.python = sys.executable
        self.env: dict[str, str] = {}
        self.transport = "local"


def _local(node):
    from hetctl.remote.local import LocalTransport

    return LocalTransport(node)


# --- resume pre-checks --------------------------------------------------------------------


def test_a_live_rank_of_the_run_is_found_and_refuses_resume():
    env = {**os.environ, "HETCTL_RUN_ID": "run-alive-1"}
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)
    try:
        node = _LocalNode("n1")
        found = find_alive(_local(node), node.python, "run-alive-1")
        assert [p.pid for p in found] == [proc.pid]
        assert find_alive(_local(node), node.python, "run-other") == []
        with pytest.raises(ResumeRefused, match=rf"1 live process: n1 pid {proc.pid}"):
            check_no_rank_alive([node], "run-alive-1", _local)
        os.kill(proc.pid, signal.SIGSTOP)  # a hung rank is alive too
        with pytest.raises(ResumeRefused):
            check_no_rank_alive([node], "run-alive-1", _local)
    finally:
        proc.kill()
        proc.wait()
    assert check_no_rank_alive([_LocalNode("n1")], "run-alive-1", _local) == []


def _write_step(d, step, model=MODEL, payload=b"weights"):
    sd = ckpt.step_dir(d, step)
    sd.mkdir(parents=True)
    (sd / "layer-00000.pt").write_bytes(payload * 100)
    (sd / "state.json").write_bytes(b'{"step": %d}' % step)
    ckpt.write_manifest(sd, step, ckpt.model_digest(model))
    return sd


def test_checkpoint_choice_skips_a_corrupted_newest_step(tmp_path):
    _write_step(tmp_path, 4)
    newest = _write_step(tmp_path, 8)
    data = bytearray((newest / "layer-00000.pt").read_bytes())
    data[10] ^= 0xFF
    (newest / "layer-00000.pt").write_bytes(bytes(data))
    choice = check_checkpoint(tmp_path, MODEL)
    assert choice.step == 4
    assert [(s.step, s.problems) for s in choice.skipped] == [(8, ["layer-00000.pt: sha256 mismatch (corrupted)"])]


def test_checkpoint_refusals_name_the_problem(tmp_path):
    with pytest.raises(ResumeRefused, match="no checkpoint to resume from"):
        check_checkpoint(tmp_path / "none", MODEL)
    _write_step(tmp_path, 4, model={**MODEL, "hidden_size": 128})
    with pytest.raises(ResumeRefused, match="written for another model"):
        check_checkpoint(tmp_path, MODEL)
    sd = ckpt.step_dir(tmp_path, 6)
    sd.mkdir()
    (sd / "layer-00000.pt").write_bytes(b"x")
    other = tmp_path / "only-partial"
    ckpt.step_dir(other, 2).mkdir(parents=True)
    with pytest.raises(ResumeRefused, match=r"no valid checkpoint \(step-2: no manifest.json"):
        check_checkpoint(other, MODEL)
