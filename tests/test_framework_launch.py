"""``hetctl launch`` of rendered framework plans, end to end, and resume from the frameworks' own checkpoints.

A torchrun plan on the demo's three local nodes runs a real training script
that knows nothing of hetctl (no hetctl import: the torchrun variables, gloo,
DDP, ``torch.distributed.checkpoint`` saves every few steps, a loss line per
step) exactly as ``plan/nodes/<node>.sh`` would run it. A rank killed with
kill -9 is restarted from the newest complete DCP folder (the script says which
step it loaded; the restart event says which step hetctl chose), and a
SIGSTOPped rank is found as a hang from its log lines alone.

Megatron-LM: a checkpoint folder in Megatron's layout is found by ``hetctl
resume``'s discovery, and the resume arguments the rendered script passes are
accepted by Megatron's own ``parse_args``/``validate_args`` (FlagScale's
Megatron-LM; skipped when absent). Megatron-core's ``torch_dist`` save needs
CUDA past writing its shards (``torch.cuda.current_device()`` in
``save_state_dict_async_finalize``), so its folder is made by that code only
where a GPU is present.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hetctl.files.events import read_events
from tests.sites import local_cli, local_site, wait_while_running

pytestmark = pytest.mark.e2e

# A torchrun-style script: nothing of hetctl but the documented environment (HETCTL_CKPT_DIR to save
# into, HETCTL_RESUME_DIR to load from, HETCTL_STEPS).
DCP_TRAINER = r'''
import os, time
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = DDP(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
steps, every = int(os.environ["HETCTL_STEPS"]), 3
start = 0
resume = os.environ.get("HETCTL_RESUME_DIR")
if resume:
    state = {"model": model.state_dict(), "step": torch.tensor(0)}
    dcp.load(state, checkpoint_id=resume)
    model.load_state_dict(state["model"])
    start = int(state["step"])
    print(f"resumed from step {start} ({resume})", flush=True)
g = torch.Generator().manual_seed(1)
w_true = torch.randn(8, 1, generator=g)
for step in range(start + 1, steps + 1):
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step * world + rank))
    loss = ((model(x) - x @ w_true) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    time.sleep(0.15)
    print(f"step {step} loss {loss.item():.5f}", flush=True)
    if step % every == 0:
        dcp.save({"model": model.state_dict(), "step": torch.tensor(step)},
                 checkpoint_id=os.path.join(os.environ["HETCTL_CKPT_DIR"], f"step-{step}"))
dist.destroy_process_group()
'''
PROGRESS = r"^step (?P<step>\d+) loss (?P<loss>\S+)"


def torchrun_plan(d: Path) -> Path:
    """The demo site re-planned for ``--framework torchrun`` (three stages, one rank a node)."""
    from hetctl.files.cluster import Cluster
    from hetctl.files.yamlio import load_model
    from hetctl.plan.models import load_model as load_preset
    from hetctl.plan.planner import plan_cluster
    from hetctl.plan.render import write_plan_dir
    from hetctl.plan.search import Pins

    cluster = load_model(d / "cluster.yaml", Cluster)
    plan = plan_cluster(cluster, load_preset("tiny"), pins=Pins(pp=3, dp=1), framework="torchrun",
                        cluster_path=d / "cluster.yaml")
    write_plan_dir(plan, d / "plan-torchrun", hosts={n.name: n.host for n in cluster.nodes})
    return d / "plan-torchrun"


def events(run: Path, kind: str | None = None) -> list[dict]:
    return [e for e in read_events(run / "events.jsonl") if kind is None or e["kind"] == kind]


def test_an_unmodified_dcp_script_survives_kill_9_from_its_own_checkpoint_and_a_hang_is_found(tmp_path):
    from hetctl.launch.inject import rank_procs

    site = local_site(tmp_path)
    plan_dir = torchrun_plan(site)
    script = site / "train_dcp.py"
    script.write_text(DCP_TRAINER)
    assert "hetctl" not in DCP_TRAINER.replace("HETCTL_", "")
    proc = subprocess.Popen([sys.executable, "-m", "hetctl", "launch", str(plan_dir), "--run-dir", "runs",
                             "--steps", "100000", "--script", str(script), "--progress", PROGRESS,
                             "--hang-timeout", "8", "--max-restarts", "1", "--json"],
                            cwd=site, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "COLUMNS": "200"})
    try:
        run = wait_while_running(proc, lambda: next(iter((site / "runs").glob("*/events.jsonl")), None),
                                 "a run folder", 120).parent
        ckpt = Path(json.loads(json.dumps(__import__("yaml").safe_load((run / "run.yaml").read_text())))
                    ["inputs"]["checkpoint_dir"])
        wait_while_running(proc, lambda: (ckpt / "step-6" / ".metadata").exists()
                           and any(e.get("step", 0) >= 7 for e in events(run, "progress")), "step 7", 180)
        victim = next(p for p in rank_procs(run.name, attempt=0) if p.rank == 1)
        os.kill(victim.pid, signal.SIGKILL)
        restart = wait_while_running(proc, lambda: events(run, "restart"), "the restart", 120)[0]
        k = restart["resume_step"]
        assert k >= 6 and (ckpt / f"step-{k}" / ".metadata").exists()
        # The restarted attempt trains on from step k: wait for a step beyond it, then stop rank 2.
        wait_while_running(proc, lambda: any(e.get("attempt") == 1 and e.get("step", 0) > k + 1
                                             for e in events(run, "progress")), "progress after the restart", 180)
        stopped = next(p for p in rank_procs(run.name, attempt=1) if p.rank == 2)
        os.kill(stopped.pid, signal.SIGSTOP)
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 5, err
    summary = json.loads(out)
    assert summary["restarts"] == 1 and summary["attempts"] == 2
    failed = events(run, "rank_failed")
    assert failed[0]["rank"] == 1 and failed[0]["attempt"] == 0
    assert failed[-1]["rank"] == 2 and "hang" in failed[-1]["reason"] and "SIGSTOP" in failed[-1]["reason"]
    launched = events(run, "launched")
    assert [e["resume_step"] for e in launched] == [0, k]
    for r in range(3):  # every rank of the restart loaded step k from the DCP folder hetctl named
        node = next(n for n in ("node-a", "node-b", "node-c") if (run / "logs" / n / f"rank-{r}.log").exists())
        log = (run / "logs" / node / f"rank-{r}.log").read_text()
        after = log.split("==> hetctl attempt 1")[1]
        assert f"resumed from step {k} ({ckpt / f'step-{k}'})" in after
        assert f"step {k + 1} loss " in after and f"step {k} loss " not in after
    assert any(e.get("loss") is not None for e in events(run, "progress"))
    assert f"hetctl resume {summary['run_dir']}" in err


def test_a_missing_script_or_framework_is_one_line_and_nothing_starts(tmp_path):
    site = local_site(tmp_path)
    plan_dir = torchrun_plan(site)
    r = local_cli(site, "launch", str(plan_dir), "--run-dir", "runs", "--steps", "3", "--script", "no-such.py")
    assert r.returncode == 3, r.stderr
    assert "script not found: no-such.py does not exist on the node" in r.stderr
    assert "Traceback" not in r.stderr
    assert not list((site / "runs").glob("*/logs/*/rank-*.log"))


def test_dry_run_shows_the_rendered_command_per_rank(tmp_path):
    site = local_site(tmp_path)
    plan_dir = torchrun_plan(site)
    r = local_cli(site, "launch", str(plan_dir), "--dry-run", "--json", "--script", "train.py", "--args", "--lr 0.1")
    assert r.returncode == 0, r.stderr
    spec = json.loads(r.stdout)
    rank = spec["nodes"][0]["ranks"][0]
    assert rank["argv"][:2] == ["bash", "-c"] and rank["argv"][-2:] == ["--lr", "0.1"]
    assert 'exec env RANK=0' in rank["argv"][2] and '"$HETCTL_PYTHON" "$HETCTL_SCRIPT" "$@"' in rank["argv"][2]
    assert rank["env"]["HETCTL_SCRIPT"] == "train.py" and rank["heartbeat"].endswith("/hb/rank-0.json")
