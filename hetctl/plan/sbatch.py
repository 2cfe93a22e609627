"""``plan/slurm.sbatch``: the plan as one Slurm heterogeneous batch job, for users who submit themselves.

One het group per chip kind (vendor and model of the node's stages): its nodes
pinned with ``--nodelist``, one task per node (a plan of one chip kind is a plain job:
no ``hetjob`` line, no ``--het-group``), and the nodes' Gres when the
cluster file came from a Slurm inventory (``slurm_gres`` labels), so the chips
are granted to the job. The script starts one ``srun --het-group=G`` per group;
each task runs its node's ``nodes/<node>.sh`` (which already sets every rank's
environment and visible-devices variable), so ``sbatch plan/slurm.sbatch`` runs
the planned job without hetctl on the login node. Arguments after the script
name reach every rank.

Written by ``hetctl plan`` when the cluster file's nodes came from Slurm. Every
value that reaches the shell is quoted with :func:`shlex.quote`.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hetctl.plan.render import DEFAULT_PORT, script_name
from hetctl.files.plan import Plan

SBATCH_NAME = "slurm.sbatch"
DEFAULT_STEPS, DEFAULT_CKPT_EVERY = 100, 10  # `hetctl launch`'s --steps and --checkpoint-every
_SAFE_JOB_NAME = re.compile(r"[^A-Za-z0-9._-]")


@dataclass(frozen=True)
class HetGroup:
    """The nodes of one chip kind."""

    vendor: str
    model: str
    nodes: tuple[str, ...]
    gres: str
    visible_devices_env: str | None
    device_type: str
    ranks: tuple[int, ...]


def het_groups(plan: Plan, gres: dict[str, str] | None = None) -> list[HetGroup]:
    """Nodes grouped by chip kind, in plan node order (the group of rank 0's node first).

    Args:
        plan: the plan.
        gres: node → its Slurm Gres (``gpu:8``), when known.
    """
    gres = gres or {}
    kind: dict[str, tuple[str, str, str | None, str]] = {}
    for s in plan.stages:
        kind.setdefault(s.node, (s.vendor, s.model, s.visible_devices_env, s.device_type))
    rank0 = min(plan.ranks, key=lambda r: r.rank).node
    order = [rank0] + [n for n in plan.nodes if n != rank0]
    groups: dict[tuple[str, str], list[str]] = {}
    for node in order:
        if node in kind:
            groups.setdefault(kind[node][:2], []).append(node)
    out = []
    for (vendor, model), nodes in groups.items():
        node_gres = {gres.get(n, "") for n in nodes}
        first = kind[nodes[0]]
        out.append(HetGroup(
            vendor=vendor, model=model, nodes=tuple(nodes),
            gres=node_gres.pop() if len(node_gres) == 1 else "",  # differing Gres: ask for none rather than a wrong one
            visible_devices_env=first[2], device_type=first[3],
            ranks=tuple(sorted(r.rank for r in plan.ranks if r.node in nodes)),
        ))
    return out


def _comment(text: str) -> str:
    """A comment line whose text (chip names from vendor tools, the model's name) can never end it:
    a line break or control character in it is written as an escape, not as a new line of shell."""
    from hetctl.files.yamlio import one_line

    return "# " + one_line(text)


def render_sbatch(plan: Plan, plan_dir: str | Path, gres: dict[str, str] | None = None) -> str:
    """The batch script text for ``plan`` written in ``plan_dir``."""
    groups = het_groups(plan, gres)
    het = len(groups) > 1  # `srun --het-group` in a job of one component is refused by Slurm
    rank0 = min(plan.ranks, key=lambda r: r.rank).node
    job_name = _SAFE_JOB_NAME.sub("_", f"hetctl-{plan.model.name}")
    lines = [
        "#!/usr/bin/env bash",
        _comment(f"Slurm {'heterogeneous ' if het else ''}job for plan {plan.model.name}: pp {plan.parallel.pp} x "
                 f"dp {plan.parallel.dp}, {len(plan.ranks)} ranks on {len(plan.nodes)} nodes, rendered by `hetctl plan`."),
        "# One het group per chip kind; each task runs its node's nodes/<node>.sh.",
        "# Submit: sbatch slurm.sbatch [arguments for every rank]",
        f"#SBATCH --job-name={job_name}",
    ]
    for i, g in enumerate(groups):
        if i:
            lines.append("#SBATCH hetjob")
        opts = f"--nodes={len(g.nodes)} --nodelist={','.join(g.nodes)} --ntasks-per-node=1"
        if g.gres:
            opts += f" --gres={g.gres}"
        lines.append(f"#SBATCH {opts}")
    lines += [
        "set -euo pipefail",
        "",
        f"PLAN_DIR=${{HETCTL_PLAN_DIR:-{shlex.quote(str(Path(plan_dir).resolve()))}}}",
        f"export MASTER_ADDR=${{MASTER_ADDR:-{shlex.quote(rank0)}}}",
        f"export MASTER_PORT=${{MASTER_PORT:-{DEFAULT_PORT}}}",
        'export HETCTL_RUN_ID=${HETCTL_RUN_ID:-slurm-$SLURM_JOB_ID}',
        'export HETCTL_CKPT_DIR=${HETCTL_CKPT_DIR:-$PWD/checkpoints/$HETCTL_RUN_ID}',
        # The reference trainer's defaults, as `hetctl launch` has them: `sbatch slurm.sbatch` alone runs.
        f"export HETCTL_STEPS=${{HETCTL_STEPS:-{DEFAULT_STEPS}}}",
        f"export HETCTL_CKPT_EVERY=${{HETCTL_CKPT_EVERY:-{DEFAULT_CKPT_EVERY}}}",
        "",
        "pids=()",
        "stop_all() { local p; for p in \"${pids[@]}\"; do kill -TERM \"$p\" 2>/dev/null || true; done; }",
        "trap 'stop_all; wait; exit 143' TERM INT",
        "",
    ]
    scripts = {n: script_name(n) for g in groups for n in g.nodes}
    case = " ".join(f"{shlex.quote(n)}) s={shlex.quote(s)} ;;" for n, s in scripts.items())
    # $SLURMD_NODENAME is the task's own node: the single quotes keep it for the task's shell
    task = (f'case $SLURMD_NODENAME in {case} *) echo "no launch script for $SLURMD_NODENAME" >&2; exit 2 ;; esac; '
            'exec bash "$0/nodes/$s" "$@"')
    for i, g in enumerate(groups):
        vis = f", visible devices via {g.visible_devices_env}" if g.visible_devices_env else ""
        lines += [
            _comment(f"group {i}: {g.vendor} {g.model} on {','.join(g.nodes)} (ranks {','.join(map(str, g.ranks))}, "
                     f"device {g.device_type}{vis})"),
            f"srun {f'--het-group={i} ' if het else ''}--nodes={len(g.nodes)} --ntasks-per-node=1 "
            f"--export=ALL,HETCTL_HET_GROUP={i} bash -c {shlex.quote(task)} \"$PLAN_DIR\" \"$@\" &",
            'pids+=("$!")',
        ]
    lines += [
        "",
        "# The first failing group stops the others; its status is the job's.",
        "status=0",
        'for _ in "${pids[@]}"; do',
        "  rc=0",
        "  wait -n || rc=$?",
        '  if [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then status=$rc; stop_all; fi',
        "done",
        'exit "$status"',
        "",
    ]
    return "\n".join(lines)


def slurm_gres(facts: Any) -> dict[str, str] | None:
    """node → Gres from a cluster file probed through a Slurm inventory; None when it was not."""
    nodes = getattr(facts, "nodes", None) or []
    labelled = {n.name: n.labels.get("slurm_gres", "") for n in nodes if "slurm_gres" in (n.labels or {})}
    return labelled or None


def write_sbatch(plan: Plan, facts: Any, out_dir: str | Path, force: bool = False) -> Path | None:
    """Write ``out_dir/slurm.sbatch`` when the cluster came from Slurm; its path, or None.

    One the user changed since hetctl wrote it is not replaced without ``force`` (:mod:`hetctl.files.safefs`).
    """
    gres = slurm_gres(facts)
    if gres is None:
        return None
    from hetctl.files.safefs import write_owned
    from hetctl.files.yamlio import written_by

    return write_owned(out_dir, {SBATCH_NAME: render_sbatch(plan, out_dir, gres)}, modes={SBATCH_NAME: 0o755},
                       force=force, legacy=lambda p: written_by(p, "rendered by `hetctl plan`"))[0]
