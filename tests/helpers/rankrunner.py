"""Start the ranks of a plan as local processes, the way the agent would.

A test helper, not a mock: every rank is a real ``python -m hetctl.train``
process with the full rank environment (``hetctl.node.runtime.TRAIN_ENV``), talking
gloo over loopback. It lets the trainer be tested without the agent and the
controller, and lets a test inject faults with real signals.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from hetctl.files.plan import Estimate, ModelSpec, Parallel, Plan, Rank, Stage
from hetctl.node.runtime import read_heartbeat

TINY = {"name": "tiny", "num_layers": 6, "hidden_size": 64, "ffn_hidden_size": 172,
        "num_attention_heads": 4, "num_query_groups": 2, "vocab_size": 256, "seq_len": 32}


def tiny_plan(split: list[int], dp: int = 1, micro_batch: int = 2, micro_batches: int = 4,
              model: dict[str, Any] | None = None, tp: int = 1) -> dict[str, Any]:
    """A plan dict (validated by the plan schema) with ``len(split)`` stages of ``split[i]`` layers, ``dp`` replicas.

    Ranks are numbered replica-major: rank ``(replica * pp + stage) * tp + tp_rank`` (a stage's ``tp`` ranks
    are its TP group, on one node).
    """
    spec = ModelSpec(**(model or TINY))
    assert sum(split) == spec.num_layers, (split, spec.num_layers)
    pp = len(split)
    stages, ranks = [], []
    for rep in range(dp):
        start = 0
        for st, n in enumerate(split):
            node = f"n{rep * pp + st}"
            stages.append(Stage(replica=rep, stage=st, node=node, vendor="cpu", chips=[], tp=tp,
                                layers=(start, start + n), precision="fp32", backend="gloo",
                                backend_next="gloo" if st < pp - 1 else None, device_type="cpu"))
            ranks += [Rank(rank=(rep * pp + st) * tp + i, node=node, local_rank=i, stage=st, replica=rep)
                      for i in range(tp)]
            start += n
    plan = Plan(model=spec, parallel=Parallel(pp=pp, dp=dp, tp=tp, micro_batch=micro_batch,
                                              micro_batches=micro_batches,
                                              global_batch=micro_batch * micro_batches * dp),
                nodes=list(dict.fromkeys(r.node for r in ranks)), stages=stages, ranks=ranks,
                estimate=Estimate(step_time_s=0.0, bubble=0.0, utilization=0.0, tokens_per_s=0.0))
    return plan.model_dump(mode="json")


def free_port() -> int:
    """A free port for a rendezvous, below the ephemeral range (as hetctl's pre-flight picks one)."""
    from hetctl.node.preflight import rendezvous_port

    return rendezvous_port()


class Ranks:
    """The processes of one attempt of a plan, started with the rank contract's environment.

    Use as a context manager: whatever is still running on exit is killed.
    """

    def __init__(self, plan: dict[str, Any], workdir: Path, *, steps: int, ckpt_every: int = 0, seed: int = 1234,
                 resume_step: int | None = None, attempt: int = 1, run_id: str = "test-run",
                 ckpt_dir: Path | None = None, args: tuple[str, ...] = ()) -> None:
        self.plan = plan
        self.dir = Path(workdir) / f"attempt-{attempt}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.plan_path = self.dir / "plan.json"
        self.plan_path.write_text(json.dumps(plan))
        self.ckpt_dir = Path(ckpt_dir) if ckpt_dir else Path(workdir) / "ckpt" / run_id
        self.cmd = [sys.executable, "-m", "hetctl.train", "--steps", str(steps), "--checkpoint-every",
                    str(ckpt_every), "--seed", str(seed), *args]
        self.resume_step, self.attempt, self.run_id = resume_step, attempt, run_id
        self.procs: dict[int, subprocess.Popen] = {}

    def env(self, r: dict[str, Any], port: int) -> dict[str, str]:
        """The rank contract exactly as ``hetctl launch`` builds it (:func:`hetctl.plan.rankenv.rank_env`)."""
        from hetctl.files.plan import Plan
        from hetctl.node.runtime import TRAIN_ENV
        from hetctl.plan.rankenv import rank_env

        contract = {k for k in TRAIN_ENV if not k.startswith("<")}
        base = {k: v for k, v in os.environ.items() if k not in contract and not k.endswith("_VISIBLE_DEVICES")}
        base.update(rank_env(
            Plan.model_validate(self.plan), int(r["rank"]), master_addr="127.0.0.1", master_port=port,
            run_id=self.run_id, attempt=self.attempt, plan_path=str(self.plan_path),
            heartbeat_file=str(self.heartbeat_path(r["rank"])), ckpt_dir=str(self.ckpt_dir),
            resume_step=self.resume_step or 0,
        ))
        base["OMP_NUM_THREADS"] = "1"
        return base

    def heartbeat_path(self, rank: int) -> Path:
        return self.dir / f"rank-{rank}.heartbeat.json"

    def argv(self, r: dict[str, Any]) -> list[str]:
        """The command of rank ``r`` (every rank runs the trainer; a subclass may wrap it)."""
        return self.cmd

    def start(self) -> "Ranks":
        port = free_port()
        from tests.helpers import zygote

        for r in self.plan["ranks"]:
            rank = r["rank"]
            argv, env = self.argv(r), self.env(r, port)
            with open(self.dir / f"rank-{rank}.out", "wb") as out, open(self.dir / f"rank-{rank}.err", "wb") as err:
                # Forked from a process that has imported torch already (the tests' fork server), else cold.
                forked = zygote.spawn(argv, env, out.name, err.name)
                self.procs[rank] = forked or subprocess.Popen(argv, env=env, stdout=out, stderr=err,
                                                              stdin=subprocess.DEVNULL, start_new_session=True)
        return self

    def heartbeat(self, rank: int) -> dict[str, Any] | None:
        return read_heartbeat(self.heartbeat_path(rank))

    def wait_for_step(self, rank: int, step: int, timeout: float = 120.0) -> dict[str, Any]:
        """Block until ``rank``'s heartbeat reports ``step`` or later (fails if any rank exits first)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            hb = self.heartbeat(rank)
            if hb and hb["step"] >= step and not hb.get("done"):
                return hb
            dead = {r: p.returncode for r, p in self.procs.items() if p.poll() is not None}
            if dead:
                raise AssertionError(f"ranks exited before step {step}: {dead}\n{self.logs()}")
            time.sleep(0.005)
        raise AssertionError(f"rank {rank} did not reach step {step} in {timeout}s\n{self.logs()}")

    def wait_for_checkpoint(self, step: int = 1, timeout: float = 120.0) -> int:
        """Block until a complete checkpoint of ``step`` or later exists; returns its step.

        Saves are asynchronous: under load a save can commit several steps after the one it
        snapshots, so a test that kills a rank "after step N" waits for the checkpoint it needs.
        """
        from hetctl.node import manifest

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = manifest.latest_valid(self.ckpt_dir)
            if found is not None and found[0] >= step:
                return found[0]
            time.sleep(0.02)
        raise AssertionError(f"no complete checkpoint of step >= {step} in {timeout}s\n{self.logs()}")

    def kill(self, rank: int, sig: int = signal.SIGKILL) -> None:
        os.killpg(self.procs[rank].pid, sig)

    def stop_all(self, grace: float = 5.0) -> None:
        """What the agent does when one rank fails: SIGTERM the rest, then SIGKILL after a grace period."""
        for p in self.procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in self.procs.values():
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    def wait(self, timeout: float = 180.0) -> dict[int, int]:
        """Exit codes of every rank; kills them all and fails the test if they outlive ``timeout``."""
        deadline = time.monotonic() + timeout
        try:
            return {r: p.wait(max(0.0, deadline - time.monotonic())) for r, p in self.procs.items()}
        except subprocess.TimeoutExpired:
            self.stop_all(grace=1.0)
            raise AssertionError(f"ranks still running after {timeout}s\n{self.logs()}") from None

    def stdout(self, rank: int) -> str:
        return (self.dir / f"rank-{rank}.out").read_text()

    def stderr(self, rank: int) -> str:
        return (self.dir / f"rank-{rank}.err").read_text()

    def logs(self) -> str:
        """Exit code and stderr tail of every rank, for assertion messages."""
        return "\n".join(f"--- rank {r} (exit {p.poll()}) stderr ---\n{self.stderr(r)[-2000:]}"
                         for r, p in sorted(self.procs.items()))

    def last_rank(self, replica: int = 0) -> int:
        rows = self.plan.get("replicas") or []
        pp = rows[replica]["stages"] if rows else self.plan["parallel"]["pp"]
        return next(r["rank"] for r in self.plan["ranks"] if r["replica"] == replica and r["stage"] == pp - 1)

    def losses(self, replica: int = 0) -> dict[int, str]:
        """``{step: loss}`` as the last stage printed it (9 significant digits: exact for float32)."""
        out = {}
        for line in self.stdout(self.last_rank(replica)).splitlines():
            if line.startswith("step="):
                fields = dict(kv.split("=", 1) for kv in line.split())
                out[int(fields["step"])] = fields["loss"]
        return out

    def __enter__(self) -> "Ranks":
        return self

    def __exit__(self, *exc: object) -> None:
        if any(p.poll() is None for p in self.procs.values()):
            self.stop_all(grace=1.0)


def run_plan(plan: dict[str, Any], workdir: Path, timeout: float = 180.0, **kw: Any) -> Ranks:
    """Start every rank, wait for all, and fail unless every rank exited 0."""
    with Ranks(plan, workdir, **kw) as ranks:
        ranks.start()
        codes = ranks.wait(timeout)
        assert all(c == 0 for c in codes.values()), f"exit codes {codes}\n{ranks.logs()}"
    return ranks
