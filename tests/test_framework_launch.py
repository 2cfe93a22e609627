"""``hetctl launch`` of rendered framework plans, end to end, and resume from the frameworks' own checkpoints.

A torchrun plan on the demo's three local nodes runs a real training script
that knows nothing of hetctl (no hetctl import: the torchrun variables, gloo,
DDP, ``torch.distributed.checkpoint`` saves every few steps, a loss line per
step) exactly as ``plan/nodes/<node>.sh`` would run it. A rank killed with
kill -9 is restarted from the newest complete DCP folder (the script says which
step it loaded; the restart event says which step hetctl chose), a
SIGSTOPped rank is found as a hang from its log lines alone, and ``hetctl
resume`` continues the failed run from its newest complete DCP folder. A
DeepSpeed plan runs as rendered, DeepSpeed's own code placing each rank.

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
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hetctl.files.eventlog import read_events
from tests.helpers.sites import local_cli, local_site, wait_while_running

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
    from hetctl.plan.candidates import Pins

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
        ckpt = Path(yaml.safe_load((run / "run.yaml").read_text())["inputs"]["checkpoint_dir"])
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

    # hetctl resume continues from the newest complete DCP folder, on a fresh plan, to a new total.
    from hetctl.elastic import fwckpt

    newest = fwckpt.scan("torchrun", ckpt).newest.step
    r = local_cli(site, "resume", str(run), "--steps", str(newest + 3), "--json", timeout=300)
    assert r.returncode == 0, r.stderr
    assert events(run, "resumed")[-1]["resume_step"] == newest and json.loads(r.stdout)["state"] == "succeeded"
    logs = [p.read_text() for p in run.glob("logs/*/rank-*.log")]
    assert any(f"resumed from step {newest} ({ckpt / f'step-{newest}'})" in t.split("==> hetctl attempt 2")[-1]
               for t in logs if "==> hetctl attempt 2" in t)


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


def megatron_layout_folder(ckpt: Path) -> None:
    """What Megatron-LM's save_checkpoint leaves after saves at 10 and 20 and one killed mid-save at 30."""
    for step in (10, 20, 30):
        d = ckpt / f"iter_{step:07d}"
        d.mkdir(parents=True)
        (d / "common.pt").write_bytes(b"common")
        (d / "__0_0.distcp").write_bytes(b"shard")
        if step < 30:
            (d / ".metadata").write_bytes(b"dcp metadata")
            (d / "metadata.json").write_text('{"sharded_backend": "torch_dist", "sharded_backend_version": 1}')
    (ckpt / "latest_checkpointed_iteration.txt").write_text("20")


needs_megatron_lm = pytest.mark.skipif(
    __import__("tests.test_frameworks", fromlist=["FLAG_SCALE"]).FLAG_SCALE is None,
    reason="FlagScale not installed (pip install --no-deps flag-scale==0.8.0): it carries Megatron-LM's "
    "training code (pretrain_gpt.py, parse_args, validate_args)")


@pytest.mark.timeout(900)
@needs_megatron_lm
def test_resume_picks_up_a_megatron_checkpoint_folder_and_megatron_accepts_the_resume_flags(tmp_path):
    """launch a Megatron plan as rendered, then `hetctl resume` it from a folder in Megatron's layout.

    Each rank runs the rendered command with Megatron's own argument code standing in for the
    training loop (tests/helpers/framework_check.py: parse_args, validate_args, the rank generator and layout
    parser): CUDA is needed past that and this machine has none.
    """
    from hetctl.files.cluster import Cluster
    from hetctl.files.plan import Plan
    from hetctl.files.yamlio import load_model
    from hetctl.plan.models import load_model as load_preset
    from hetctl.plan.planner import plan_cluster
    from hetctl.plan.render import write_plan_dir
    from hetctl.plan.candidates import Pins
    from tests.test_frameworks import FLAG_SCALE, HERE

    site = local_site(tmp_path)
    out = tmp_path / "records"
    out.mkdir()
    wrapper = tmp_path / "megatron-python"
    wrapper.write_text(f'#!/bin/sh\ncase "$1" in -c) exec {sys.executable} "$@";; esac\n'  # launch's argument check
                       f'exec {sys.executable} {HERE / "helpers" / "framework_check.py"} "$CHECK_OUT" "$@"\n')
    wrapper.chmod(0o755)
    inv = yaml.safe_load((site / "inventory.yaml").read_text())
    mlm = FLAG_SCALE / "third_party/Megatron-LM"
    inv["defaults"]["env"].update({"HETCTL_PYTHON": str(wrapper), "MEGATRON_DIR": str(mlm), "CHECK_OUT": str(out),
                                   "PYTHONPATH": f"{FLAG_SCALE}:{mlm}:{os.environ.get('PYTHONPATH', '')}"})
    (site / "inventory.yaml").write_text(yaml.safe_dump(inv))
    cluster = load_model(site / "cluster.yaml", Cluster)
    plan = plan_cluster(cluster, load_preset("tiny"), pins=Pins(pp=3, dp=1), framework="megatron",
                        cluster_path=site / "cluster.yaml")
    write_plan_dir(plan, site / "plan-megatron")
    args = ["--args", f"--mock-data --tokenizer-type NullTokenizer --vocab-size {plan.model.vocab_size} "
            "--distributed-backend gloo --no-rope-fusion"]
    r = local_cli(site, "launch", "plan-megatron", "--run-dir", "runs", "--steps", "40", "--checkpoint-every", "10",
                  "--json", *args, timeout=600)
    assert r.returncode == 0, r.stderr  # Megatron's own argument checks passed on every rank
    summary = json.loads(r.stdout)
    first = {f.name: json.loads(f.read_text()) for f in out.glob("rank-*.json")}
    assert len(first) == 3 and all(v["ckpt_step"] is None and v["ckpt_format"] == "torch_dist" for v in first.values())
    run = Path(summary["run_dir"])
    ckpt = Path(yaml.safe_load((run / "run.yaml").read_text())["inputs"]["checkpoint_dir"])
    megatron_layout_folder(ckpt)
    for f in out.glob("rank-*.json"):
        f.unlink()

    r = local_cli(site, "resume", str(run), "--json", timeout=600)
    assert r.returncode == 0, r.stderr
    assert "checkpoint step 30 skipped" in r.stderr and "did not finish" in r.stderr
    resumed = events(run, "resumed")[-1]
    assert resumed["resume_step"] == 20 and events(run, "launched")[-1]["resume_step"] == 20
    records = [json.loads(f.read_text()) for f in out.glob("rank-*.json")]
    # resume re-plans on the re-probed nodes; torch_dist loads onto another shape, so any plan may run
    again = load_model(run / "attempts" / "1" / "plan.yaml", Plan)
    assert again.framework == "megatron" and len(records) == len(again.ranks)
    for rec in records:  # Megatron parsed and validated the resume flags: load iteration 20 of the run's folder
        assert rec["ckpt_step"] == 20 and rec["load"] == str(ckpt) and rec["ckpt_format"] == "torch_dist"
        assert rec["optim_fully_reshardable"]  # the optimizer state loads onto the new shape too
        assert rec["train_iters"] == 40


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="no GPU on this machine: megatron-core's "
                    "torch_dist save needs CUDA (torch.cuda.current_device() in save_state_dict_async_finalize)")
def test_a_folder_saved_by_megatron_core_itself_is_found(tmp_path):
    prog = r'''
import os, sys, torch, torch.distributed as dist
def main():
    dist.init_process_group("nccl")
    from megatron.core import parallel_state as ps, dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    ps.initialize_model_parallel(1, 1)
    w = torch.arange(12.0, device="cuda").reshape(3, 4)
    os.makedirs(sys.argv[1], exist_ok=True)  # save() lists the folder first; Megatron-LM's own save makes iter_N
    dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("decoder.w", w, replica_id=0)}, sys.argv[1])
    dist.destroy_process_group()
if __name__ == "__main__":
    main()
'''
    from hetctl.elastic import fwckpt
    from tests.test_frameworks import free_port

    (tmp_path / "save.py").write_text(prog)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1"}
    subprocess.run([sys.executable, str(tmp_path / "save.py"), str(tmp_path / "iter_0000007")], env=env, check=True,
                   timeout=300)
    (tmp_path / fwckpt.MEGATRON_TRACKER).write_text("7")
    found = fwckpt.scan("megatron", tmp_path).newest
    assert found.step == 7 and found.format == "torch_dist"


def test_script_options_are_refused_where_they_would_be_ignored(tmp_path):
    site = local_site(tmp_path)
    r = local_cli(site, "launch", "plan", "--dry-run", "--script", "train.py")  # the demo's plan: framework hetctl
    assert r.returncode != 0 and "this plan runs the reference trainer" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.timeout(900)
@pytest.mark.skipif(__import__("importlib").util.find_spec("deepspeed") is None,
                    reason="DeepSpeed not installed (pip install -e '.[frameworks]')")
def test_a_deepspeed_plan_launched_as_rendered_places_every_rank_by_deepspeeds_own_account(tmp_path):
    """Each rank's rendered DeepSpeed command under the agents; DeepSpeed's own code (tests/helpers/deepspeed_check.py:
    init_distributed over gloo, the topology and grid, the config, PipelineModule's partition) says where it sits.
    """
    from hetctl.files.cluster import Cluster
    from hetctl.files.plan import Plan
    from hetctl.files.yamlio import load_model
    from hetctl.plan.models import load_model as load_preset
    from hetctl.plan.planner import plan_cluster
    from hetctl.plan.fwlayout import framework_rank
    from hetctl.plan.render import write_plan_dir
    from hetctl.plan.candidates import Pins
    from tests.test_frameworks import HERE

    site = local_site(tmp_path)
    cluster = load_model(site / "cluster.yaml", Cluster)
    plan = plan_cluster(cluster, load_preset("tiny"), pins=Pins(pp=3, dp=1), framework="deepspeed",
                        cluster_path=site / "cluster.yaml")
    write_plan_dir(plan, site / "plan-ds")
    out = tmp_path / "records"
    out.mkdir()
    args = f"--out {out} --tp 1 --pp {plan.parallel.pp} --num-layers {plan.model.num_layers}"
    r = local_cli(site, "launch", "plan-ds", "--run-dir", "runs", "--steps", "5", "--json",
                  "--script", str(HERE / "helpers" / "deepspeed_check.py"), "--args", args, timeout=600)
    assert r.returncode == 0, r.stderr
    run = Path(json.loads(r.stdout)["run_dir"])
    assert load_model(run / "attempts" / "0" / "plan.yaml", Plan) == plan
    records = {int(f.stem.split("-")[1]): json.loads(f.read_text()) for f in out.glob("rank-*.json")}
    assert sorted(records) == list(range(len(plan.ranks)))
    for rank in plan.ranks:
        rec = records[framework_rank(plan, rank)]
        stage = plan.stages_of(rank.replica)[rank.stage]
        assert (rec["stage"], rec["replica"], tuple(rec["layers"])) == (rank.stage, rank.replica, tuple(stage.layers))
        assert (rec["train_batch_size"], rec["grad_acc"]) == (plan.parallel.global_batch, plan.parallel.micro_batches)
        assert rec["local_rank"] == rec["env_local_rank"]
    # the config each rank read lies in the attempt's folder on its node, not in a stray temp file
    assert sorted(p.name for p in site.glob("nodes/*/runs/*/0/hb/ds-config-rank-*.json")) == \
        sorted(f"ds-config-rank-{framework_rank(plan, r)}.json" for r in plan.ranks)


HEARTBEAT_TRAINER = r'''
import os, time
import torch
import torch.distributed as dist
from hetctl.runtime import heartbeat

dist.init_process_group("gloo")
x = torch.ones(4)
for step in range(1, int(os.environ["HETCTL_STEPS"]) + 1):
    dist.all_reduce(x)
    x /= dist.get_world_size()
    time.sleep(0.1)
    heartbeat(step, loss=1.0 / step)
dist.destroy_process_group()
'''


def test_a_torchrun_script_that_writes_heartbeats_is_watched_without_progress_patterns(tmp_path):
    """No --progress: the rendered command's HETCTL_HEARTBEAT_FILE is the one the agent follows."""
    from hetctl.launch.inject import rank_procs

    site = local_site(tmp_path)
    plan_dir = torchrun_plan(site)
    (site / "train_hb.py").write_text(HEARTBEAT_TRAINER)
    proc = subprocess.Popen([sys.executable, "-m", "hetctl", "launch", str(plan_dir), "--run-dir", "runs",
                             "--steps", "100000", "--script", str(site / "train_hb.py"), "--hang-timeout", "6",
                             "--max-restarts", "0", "--json"],
                            cwd=site, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "COLUMNS": "200"})
    try:
        run = wait_while_running(proc, lambda: next(iter((site / "runs").glob("*/events.jsonl")), None),
                                 "a run folder", 120).parent
        wait_while_running(proc, lambda: any(e.get("step", 0) >= 5 for e in events(run, "progress")),
                           "heartbeat progress", 180)
        os.kill(next(p for p in rank_procs(run.name) if p.rank == 0).pid, signal.SIGSTOP)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 5, err
    failed = events(run, "rank_failed")
    assert failed[0]["rank"] == 0 and "hang" in failed[0]["reason"] and "SIGSTOP" in failed[0]["reason"]


def megatron_site(tmp_path: Path, mlm: Path, pythonpath: str) -> tuple[Path, Path]:
    """The demo's three local nodes with a Megatron-LM plan (PP=3) in ``plan-megatron``, ``MEGATRON_DIR`` = ``mlm``.

    The ranks' python (``HETCTL_PYTHON``) is this one behind a wrapper that leaves a file in ``starts/`` each time
    it runs: ``check.*`` for launch's argument check (``python -c``), ``rank.*`` for a rank.
    """
    from hetctl.files.cluster import Cluster
    from hetctl.files.yamlio import load_model
    from hetctl.plan.models import load_model as load_preset
    from hetctl.plan.planner import plan_cluster
    from hetctl.plan.render import write_plan_dir
    from hetctl.plan.candidates import Pins

    site = local_site(tmp_path)
    starts = tmp_path / "starts"
    starts.mkdir()
    wrapper = tmp_path / "ranks-python"
    wrapper.write_text(f'#!/bin/sh\ncase "$1" in -c) kind=check;; *) kind=rank;; esac\n'
                       f'mktemp {shlex.quote(str(starts))}/"$kind".XXXXXX >/dev/null\n'
                       f'exec {shlex.quote(sys.executable)} "$@"\n')
    wrapper.chmod(0o755)
    inv = yaml.safe_load((site / "inventory.yaml").read_text())
    inv["defaults"]["env"].update({"HETCTL_PYTHON": str(wrapper), "MEGATRON_DIR": str(mlm), "PYTHONPATH": pythonpath})
    (site / "inventory.yaml").write_text(yaml.safe_dump(inv))
    cluster = load_model(site / "cluster.yaml", Cluster)
    plan = plan_cluster(cluster, load_preset("tiny"), pins=Pins(pp=3, dp=1), framework="megatron",
                        cluster_path=site / "cluster.yaml")
    write_plan_dir(plan, site / "plan-megatron")
    return site, starts


def refused_before_any_rank(r: subprocess.CompletedProcess, site: Path, starts: Path) -> str:
    """The launch's one error line, after checking that it exited 3 with no rank started, logged or beating."""
    assert r.returncode == 3, r.stderr
    assert "Traceback" not in r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "cannot launch on 3 nodes: " in errors[0], r.stderr
    assert "hint: nothing was started on any node" in r.stderr
    assert sorted(p.name.split(".")[0] for p in starts.iterdir()) == ["check"]  # once for the 3 nodes; no rank
    assert not list(site.glob("runs/*/logs/*/rank-*.log"))
    assert not [p for p in site.glob("nodes/*/runs/**/*") if p.parent.name in ("hb", "logs")]
    return errors[0]


@pytest.mark.timeout(600)
@needs_megatron_lm
def test_a_flag_megatron_does_not_know_in_args_is_refused_by_its_own_parser_before_any_rank_starts(tmp_path):
    from tests.test_frameworks import FLAG_SCALE

    mlm = FLAG_SCALE / "third_party/Megatron-LM"
    site, starts = megatron_site(tmp_path, mlm, f"{FLAG_SCALE}:{mlm}")
    r = local_cli(site, "launch", "plan-megatron", "--run-dir", "runs", "--steps", "5", "--args",
                  "--mock-data --tokenizer-type NullTokenizer --vocab-size 256 --bogus-flag 1", timeout=600)
    line = refused_before_any_rank(r, site, starts)
    assert all(n in line for n in ("node-a", "node-b", "node-c"))
    assert (f"Megatron-LM at {mlm} rejects the ranks' arguments: unrecognized arguments: --bogus-flag 1 "
            "(--bogus-flag comes from --args: fix --args)") in line
    assert "update Megatron-LM" not in line  # every flag hetctl rendered was accepted


def older_megatron(tmp_path: Path, mlm: Path, unknown: list[str]) -> Path:
    """The installed Megatron-LM as a release that predates ``unknown``: the same files, linked (the scripts
    copied, so that Python puts this folder first on sys.path), with a parser that has other names for them."""
    old = tmp_path / "Megatron-LM-older"
    for sub, own in (("", "megatron"), ("megatron", "training"), ("megatron/training", "arguments.py")):
        (old / sub).mkdir(exist_ok=True)
        for src in (mlm / sub).iterdir():
            dst = old / sub / src.name
            if src.name == own:  # made here
                continue
            if src.suffix == ".py" and not sub:
                dst.write_bytes(src.read_bytes())
            else:
                dst.symlink_to(src)
    text = (mlm / "megatron/training/arguments.py").read_text()
    for flag in unknown:
        assert text.count(f"'{flag}'") == 1, flag
        text = text.replace(f"'{flag}'", f"'--not-yet{flag[1:]}'")
    (old / "megatron/training/arguments.py").write_text(text)
    return old


@pytest.mark.timeout(600)
@needs_megatron_lm
def test_a_megatron_lm_older_than_the_flags_hetctl_renders_is_refused_naming_the_release_that_has_them(tmp_path):
    from tests.test_frameworks import FLAG_SCALE

    new = ["--pipeline-model-parallel-layout", "--dist-ckpt-optim-fully-reshardable"]
    old = older_megatron(tmp_path, FLAG_SCALE / "third_party/Megatron-LM", new)
    site, starts = megatron_site(tmp_path, old, str(FLAG_SCALE))  # its Megatron-LM imports flagscale
    r = local_cli(site, "launch", "plan-megatron", "--run-dir", "runs", "--steps", "5", timeout=600)
    line = refused_before_any_rank(r, site, starts)
    assert f"Megatron-LM at {old} rejects the ranks' arguments: unrecognized arguments: " \
        "--pipeline-model-parallel-layout E," in line
    assert ("hetctl renders --pipeline-model-parallel-layout (new in Megatron-LM core_v0.13.0) and "
            "--dist-ckpt-optim-fully-reshardable (new in core_v0.15.0): update Megatron-LM on the node to "
            "core_v0.15.0 or later") in line
    assert "--args" not in line


def test_a_megatron_lm_path_without_an_importable_megatron_is_one_clear_line(tmp_path):
    mlm = tmp_path / "Megatron-LM"
    mlm.mkdir()
    (mlm / "pretrain_gpt.py").write_text("# a checkout's script without its megatron package\n")
    site, starts = megatron_site(tmp_path, mlm, str(tmp_path / "nothing-here"))
    r = local_cli(site, "launch", "plan-megatron", "--run-dir", "runs", "--steps", "5", timeout=600)
    line = refused_before_any_rank(r, site, starts)
    assert f"Megatron-LM at {mlm} cannot be imported by the ranks' python: ModuleNotFoundError: No module " \
        "named 'megatron" in line
    assert "set MEGATRON_DIR in the inventory's env: to a working checkout" in line


def test_a_dry_run_says_megatrons_argument_check_is_not_run(tmp_path):
    site, starts = megatron_site(tmp_path, tmp_path / "Megatron-LM", str(tmp_path))
    r = local_cli(site, "launch", "plan-megatron", "--dry-run")
    assert r.returncode == 0, r.stderr
    note = ("not checked in a dry run: that each node has megatron's files and modules, and that Megatron-LM's own "
            "parse_args there accepts a rank's arguments (once per python and checkout)")
    assert note in " ".join(r.stdout.split())
    r = local_cli(site, "launch", "plan-megatron", "--dry-run", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["not_checked"] == note
    assert not list(starts.iterdir())
