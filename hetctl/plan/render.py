"""Write ``plan/``: ``plan.yaml`` and one launch script per node, from Jinja2 templates.

The templates live in the package (``hetctl/templates/<framework>.sh.j2``) so
they ship in the wheel. Every value that reaches a script goes through
:mod:`hetctl.plan.shell` (one quoted word on one line, comments included);
values decided at launch time (rendezvous address, run id,
checkpoint folder…) are read from the script's environment with defaults for a
run by hand. What each framework is told of the plan (its layout string, process meshes, rank
order and arguments) comes from :mod:`hetctl.plan.fwlayout`.

Frameworks:

- ``hetctl`` — the reference trainer, ``python -m hetctl.train``, one chip
  visible per rank, plan rank order.
- ``megatron`` — Megatron-LM's ``pretrain_gpt.py`` with
  ``--pipeline-model-parallel-layout`` (one ``|``-separated segment per stage,
  ``E`` in the first, ``L`` in the last, ``t*N`` decoder layers; grammar of
  ``megatron/core/transformer/pipeline_parallel_layer_layout.py``), ranks in
  Megatron's ``tp-cp-ep-dp-pp`` order.
- ``flagscale`` — FlagScale's heterogeneous mode: ``--enable-hetero``,
  ``--hetero-process-meshes`` (``tp cp ep dp pp`` per mesh, a mesh being a run
  of stages with one device type and TP degree), ``--hetero-device-types``,
  ``--hetero-current-device-type`` per rank and
  ``--hetero-pipeline-layer-split``; logical ranks mesh by mesh.
- ``deepspeed`` / ``torchrun`` — the user's script (``$HETCTL_SCRIPT``) with the
  rank contract; DeepSpeed also gets ``--local_rank`` and a config matching the
  plan's batch and precision, ranks in its ``pipe-data-model`` order.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from hetctl.errors import ConfigError, PlanInfeasible
from hetctl.plan.deepspeed_layout import Launcher, check_deepspeed_split, launcher_files
from hetctl.plan.frameworks import capability, refusal
from hetctl.plan.fwlayout import (
    TRAIN_ARGS, Mesh, check_flagscale_meshes, device_label, ds_config, framework_rank, megatron_layout, meshes, model_args,
)
from hetctl.plan.rankenv import LAUNCH_TIME, stage_of, static_env
from hetctl.files.plan import Plan
from hetctl.files.yamlio import written_by
from hetctl.plan.shell import Shell, assignment, check_script, env_name, environment, word

DEFAULT_PORT = 29500


def _env_words(env: dict[str, str]) -> Shell:
    """``NAME=value`` words for ``env``: plan values quoted, launch-time ones read from the script's variables."""
    words_ = []
    for key, value in env.items():
        key = env_name(key, "plan: rank environment variable")
        if key == "HETCTL_HEARTBEAT_FILE":
            words_.append(f'{key}="$HETCTL_HEARTBEAT_DIR"/{word(value)}')
        elif key in LAUNCH_TIME:
            words_.append(f'{key}="${key}"')
        else:
            words_.append(assignment(key, value))
    return Shell(" \\\n    ".join(words_))


def _check_values(plan: Plan, hosts: dict[str, str], plan_path: str) -> None:
    """Refuse a NUL or a lone surrogate anywhere in what reaches a script (no program can receive
    either as text), naming the key."""
    def walk(value, where: str) -> None:
        if isinstance(value, str):
            if "\0" in value:
                raise ConfigError(f"{where}: holds a NUL character", "remove it from the plan, cluster or inventory")
            if any("\ud800" <= ch <= "\udfff" for ch in value):
                raise ConfigError(f"{where}: holds a lone surrogate (not valid Unicode text)",
                                  "remove it from the plan, cluster or inventory")
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(k, where)
                walk(v, f"{where}.{k}")
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(v, f"{where}[{i}]")

    walk(plan.model_dump(), "plan")
    walk(dict(hosts), "hosts")
    walk(plan_path, "plan path")


def render_node_scripts(plan: Plan, hosts: dict[str, str] | None = None, plan_path: str = "plan.yaml") -> dict[str, str]:
    """One launch script per node of the plan, for ``plan.framework``.

    Every value reaches the script through :mod:`hetctl.plan.shell` (one
    quoted word on one line, in code and comments alike).

    Args:
        plan: the plan.
        hosts: node name → address (rank 0's becomes the default MASTER_ADDR).
        plan_path: default for ``HETCTL_PLAN``.

    Returns:
        node name → script text.

    Raises:
        ConfigError: a value that no script can carry (NUL, a bad variable
            name), a FlagScale plan whose replicas differ at a stage, or a
            DeepSpeed plan whose split DeepSpeed would not make.
        PlanInfeasible: a plan the framework cannot run (a Megatron or
            DeepSpeed job across vendors) that ``hetctl plan --render-anyway``
            did not render, or a FlagScale one-stage process mesh.
    """
    template, common, by_node = _prepare(plan, hosts or {}, plan_path)
    return {node: check_script(template.render(node=node, ranks=ranks, single=False, **common), script_name(node))
            for node, ranks in by_node.items()}


@dataclass(frozen=True)
class RankScript:
    """One rank's part of its node script, alone: what ``hetctl launch`` runs for that rank.

    Attributes:
        rank: the rank's number in the plan (``plan.yaml``, the run's logs).
        framework_rank: its ``RANK`` in the framework's order (the script's environment).
        node: the node it runs on.
        heartbeat: the heartbeat file's name in ``HETCTL_HEARTBEAT_DIR``.
        text: the script: the node script's setup, then ``exec`` of this rank's command.
    """

    rank: int
    framework_rank: int
    node: str
    heartbeat: str
    text: str


def render_rank_scripts(plan: Plan, hosts: dict[str, str] | None = None, plan_path: str = "plan.yaml", *,
                        only: set[int] | None = None, check: bool = False) -> dict[int, RankScript]:
    """Per plan rank (those in ``only``), its node script rendered for that rank alone (the same template and values).

    The script runs the node script's setup (paths, framework arguments, the
    DeepSpeed config) and then execs the rank's command with the rank's
    environment, so the agent's child *is* the rank: its exit status and
    signals, its process state (a SIGSTOP), its output. One source of truth:
    :func:`render_node_scripts` renders the same per-rank values. With ``check``
    (Megatron-LM, FlagScale) the command runs ``$HETCTL_ARGCHECK`` as ``python -c``
    in front of the training script, with the same arguments, and the script
    creates no folder (``hetctl/node/fwargs.py``).
    """
    template, common, by_node = _prepare(plan, hosts or {}, plan_path)
    out = {}
    for node, ranks in by_node.items():
        for r in (r for r in ranks if only is None or r["plan_rank"] in only):
            text = check_script(template.render(node=node, ranks=[r], single=True, **{**common, "check": check}),
                                script_name(node))
            out[r["plan_rank"]] = RankScript(r["plan_rank"], r["rank"], node, r["heartbeat"], text)
    return out


def _prepare(plan: Plan, hosts: dict[str, str], plan_path: str):
    """The template, the values every script shares, and per node its ranks' values (checked)."""
    _check_values(plan, hosts, plan_path)
    fw = plan.framework
    env = environment()
    try:
        template = env.get_template(f"{fw}.sh.j2")
    except Exception as e:  # jinja2.TemplateNotFound
        raise ConfigError(f"--framework {fw}: no launch template", "use hetctl, megatron, flagscale, deepspeed or torchrun") from e
    check_runnable(plan)
    if plan.replicas and not capability(fw).uneven_dp:
        raise ConfigError(f"plan: its replicas differ in shape or micro-batches, which --framework {fw} cannot run",
                          "plan again for this framework (hetctl plan keeps one shape there)")
    if plan.parallel.virtual_stages > 1 and not capability(fw).interleave:
        raise ConfigError(f"plan: interleaved 1F1B ({plan.parallel.virtual_stages} virtual stages per rank), which "
                          f"--framework {fw} cannot run", "plan again for this framework (it gets plain 1F1B)")
    if plan.parallel.schedule == "zb-h1" and not capability(fw).zero_bubble:
        raise ConfigError(f"plan: the ZB-H1 schedule, which --framework {fw} cannot run",
                          "plan again for this framework (it gets 1F1B), or use --framework hetctl")
    # Replicas of different shape have no common process meshes; each rank's label is its own chip type.
    mesh_list = [] if plan.replicas else meshes(plan, by_type=fw == "flagscale")
    first = min(plan.ranks, key=lambda r: r.rank)
    visible = "rank" if fw == "hetctl" else "node"
    reorder = fw in ("megatron", "flagscale", "deepspeed")
    vendors = sorted({s.vendor for s in plan.stages})
    split = [b - a for a, b in (s.layers for s in plan.stages_of(0))]
    # Megatron's layout lists virtual stages in model order: chunk c of stage s is segment c·pp + s.
    row0 = plan.stages_of(0)
    virtual = [b - a for c in range(plan.parallel.virtual_stages) for s in row0
               for a, b in [s.chunks[c] if s.chunks else s.layers]]
    if fw == "deepspeed":
        check_deepspeed_split(split, plan.parallel.pp)
    if fw == "flagscale":
        check_flagscale_meshes(plan, mesh_list)
    common = {
        "plan": plan, "framework": fw, "world": len(plan.ranks),
        "master_addr": hosts.get(first.node, first.node), "master_port": DEFAULT_PORT, "plan_path": plan_path,
        "model_args": model_args(plan), "train_args": TRAIN_ARGS, "layout": megatron_layout(virtual),
        "meshes": mesh_list, "vendors": vendors, "layer_split": split,
        "mesh_args": [n for m in mesh_list for n in (m.tp, 1, 1, plan.parallel.dp, m.stages)],
        "uniform_tp": len({s.tp for s in plan.stages}) == 1, "check": False, "unrunnable": unrunnable(plan),
        "ds_config": json.dumps(ds_config(plan), sort_keys=True),
        "ds_launcher": _ds_launcher(plan, mesh_list) if fw == "deepspeed" else None,
    }
    by_node = {}
    node_ranks = plan.ranks_by_node()
    for node in plan.nodes:
        ranks = []
        for r in node_ranks.get(node, []):
            stage = stage_of(plan, r)
            e = static_env(plan, r, visible)
            if reorder:
                e["RANK"] = str(framework_rank(plan, r, mesh_list))
            e.update({k: "" for k in LAUNCH_TIME})
            e["HETCTL_HEARTBEAT_FILE"] = f"rank-{e['RANK']}.json"
            label = next((m.label for m in mesh_list if m.first <= r.stage < m.first + m.stages),
                         device_label(stage.vendor, stage.model))
            ranks.append({
                "rank": int(e["RANK"]), "plan_rank": r.rank, "local_rank": int(e["LOCAL_RANK"]),
                "env": _env_words(e), "device_label": label, "replica": r.replica, "stage": r.stage,
                "start": stage.layers[0], "end": stage.layers[1], "vendor": stage.vendor, "model": stage.model,
                "chip": r.chip if r.chip is not None else "-", "tp": stage.tp, "precision": stage.precision,
                "backend": stage.backend, "heartbeat": e["HETCTL_HEARTBEAT_FILE"],
            })
        by_node[node] = ranks
    return template, common, by_node


def unrunnable(plan: Plan) -> str | None:
    """Why ``plan.framework`` cannot run ``plan`` (:func:`hetctl.plan.frameworks.refusal`), or None."""
    return refusal(plan.framework, (s.vendor for s in plan.stages))


def check_runnable(plan: Plan) -> None:
    """Refuse the plan of a framework that cannot run it, unless ``hetctl plan --render-anyway`` rendered it.

    Raises:
        PlanInfeasible: a Megatron or DeepSpeed plan across vendors (exit 4), in one line naming
            the frameworks that can run it.
    """
    why = unrunnable(plan)
    if why and not plan.rendered_anyway:
        raise PlanInfeasible(f"plan: {why}", "or plan on one vendor's nodes; `hetctl plan --render-anyway` writes "
                             "the scripts regardless (and launch then warns)")


def _ds_launcher(plan: Plan, mesh_list: list[Mesh]) -> Launcher:
    """DeepSpeed's launcher files for the plan, ranks in its pipe-data-model order."""
    return launcher_files(plan, lambda r: framework_rank(plan, r, mesh_list))


_SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]")


def script_name(node: str) -> str:
    """File name of a node's script (characters outside ``[A-Za-z0-9._-]`` become ``_``)."""
    return _SAFE_NAME.sub("_", node) + ".sh"


def _rendered_by_hetctl(path: Path) -> bool:
    """Whether ``path`` is a node script this module wrote (its second line says so), not a user's file."""
    return written_by(path, "rendered by `hetctl plan`")


def write_plan_dir(plan: Plan, out_dir: str | Path, hosts: dict[str, str] | None = None,
                   force: bool = False) -> list[Path]:
    """Write ``plan.yaml`` and ``nodes/<node>.sh`` (executable) under ``out_dir``.

    For DeepSpeed also ``hostfile`` and ``hostfile.include`` (the ``--include`` value):
    under them DeepSpeed's own launcher places every rank as planned (see
    :func:`hetctl.plan.deepspeed_layout.launcher_files`).
    A script or hostfile the user changed since hetctl wrote it is not replaced
    (nor an earlier plan's script removed) without ``force``; a link in its place
    is replaced, never written through (:mod:`hetctl.files.safefs`).

    Returns:
        The paths written: the plan, then the node scripts.
    """
    from hetctl.files.safefs import write_owned
    from hetctl.files.yamlio import save_model

    out = Path(out_dir)
    plan_file = out / "plan.yaml"
    # Render (and so check) everything before writing anything.
    scripts = render_node_scripts(plan, hosts, plan_path=str(plan_file.resolve()))
    names: dict[str, str] = {}
    for node in scripts:
        other = names.setdefault(script_name(node), node)
        if other != node:
            raise ConfigError(f"nodes {other!r} and {node!r} would share the same script file "
                              f"nodes/{script_name(node)}", "rename one of them in the inventory")
    ds = _ds_launcher(plan, meshes(plan, by_type=False)) if plan.framework == "deepspeed" else None
    header = (f"hetctl plan: {plan.model.name} on {len(plan.nodes)} nodes, pp {plan.parallel.pp} × "
              f"dp {plan.parallel.dp}, framework {plan.framework}")
    files: dict[str, str] = {f"nodes/{script_name(node)}": text for node, text in scripts.items()}
    nodes_dir = out / "nodes"
    # An earlier plan's scripts go; a user's own files stay.
    stale = tuple(f"nodes/{old.name}" for old in (nodes_dir.glob("*.sh") if nodes_dir.is_dir() else ())
                  if f"nodes/{old.name}" not in files and _rendered_by_hetctl(old))
    for name, text in (("hostfile", ds and ds.hostfile), ("hostfile.include", ds and ds.include + "\n")):
        if text:
            files[name] = text
        elif os.path.lexists(out / name):
            stale += (name,)
    owned = write_owned(out, files, modes={rel: 0o755 for rel in files if rel.startswith("nodes/")}, force=force,
                        remove=stale, legacy=lambda p: p.name in ("hostfile", "hostfile.include") or _rendered_by_hetctl(p))
    written = [save_model(plan_file, plan, header=header)]
    return written + [p for p in owned if p.parent.name == "nodes"]
