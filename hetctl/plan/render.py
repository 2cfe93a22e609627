"""Write ``plan/``: ``plan.yaml`` and one launch script per node, from Jinja2 templates.

The templates live in the package (``hetctl/templates/<framework>.sh.j2``) so
they ship in the wheel. Every value that reaches a script goes through
:mod:`hetctl.plan.shell` (one quoted word on one line, comments included);
values decided at launch time (rendezvous address, run id,
checkpoint folder…) are read from the script's environment with defaults for a
run by hand.

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
from hetctl.plan.rankenv import LAUNCH_TIME, stage_of, static_env
from hetctl.files.plan import Plan, Rank
from hetctl.files.yamlio import written_by
from hetctl.plan.shell import Shell, assignment, check_script, env_name, environment, word

DEFAULT_PORT = 29500


# -- Megatron's pipeline layout ---------------------------------------------


def megatron_layout(counts: list[int]) -> str:
    """``--pipeline-model-parallel-layout`` for decoder layers ``counts`` per stage.

    >>> megatron_layout([3, 5, 4])
    'E,t*3|t*5|t*4,L'
    """
    segs = []
    for i, n in enumerate(counts):
        parts = []
        if i == 0:
            parts.append("E")
        if n:
            parts.append("t" if n == 1 else f"t*{n}")
        if i == len(counts) - 1:
            parts.append("L")
        segs.append(",".join(parts))
    return "|".join(segs)


def parse_megatron_layout(layout: str) -> list[int]:
    """Decoder layers per stage of a layout string, by Megatron's grammar.

    Commas are cosmetic, ``(…)*N`` and ``x*N`` repeat, ``|`` splits stages,
    ``E``/``L``/``t``/``m`` are embedding, loss, decoder and MTP layers. The
    embedding must come first and the loss last, each exactly once.

    Raises:
        ValueError: the string does not follow the grammar.
    """
    text = layout.replace(",", "")
    text = re.sub(r"\(([^)]+)\)\*(\d+)", lambda x: x.group(1) * int(x.group(2)), text)
    text = re.sub(r"(.)\*(\d+)", lambda x: x.group(1) * int(x.group(2)), text)
    stages = text.split("|")
    flat = "".join(stages)
    bad = set(flat) - set("ELtm")
    if bad:
        raise ValueError(f"invalid layer character(s) {''.join(sorted(bad))!r} in {layout!r}")
    if not flat.startswith("E") or not flat.endswith("L") or flat.count("E") != 1 or flat.count("L") != 1:
        raise ValueError(f"{layout!r}: the embedding must come first and the loss last, once each")
    return [s.count("t") for s in stages]


# -- FlagScale meshes and framework rank orders ---------------------------------


@dataclass(frozen=True)
class Mesh:
    """Consecutive stages with one device type and TP degree (FlagScale's process mesh)."""

    label: str
    tp: int
    first: int
    stages: int


def _device_label(vendor: str, model: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "", f"{vendor}{model}") or vendor


def meshes(plan: Plan, by_type: bool = True) -> list[Mesh]:
    """FlagScale process meshes of the plan, checked across every replica.

    A mesh holds the same stages, device type and TP degree in every replica
    (FlagScale's ``--hetero-process-meshes`` has one ``dp`` per mesh), so a
    stage position whose replicas run different chip models or degrees cannot
    be expressed; built from replica 0 alone it would label the other
    replicas' ranks with the wrong device type. With ``by_type`` off (the
    frameworks that know no device types) only the TP degrees must agree.

    Raises:
        ConfigError: a stage position differs between replicas.
    """
    out: list[Mesh] = []
    for s in plan.stages_of(0):
        label = _device_label(s.vendor, s.model)
        for other in (o for o in plan.stages if o.stage == s.stage and o.replica):
            if other.tp != s.tp or (by_type and _device_label(other.vendor, other.model) != label):
                raise ConfigError(
                    f"plan stage {s.stage}: replica 0 runs {s.vendor} {s.model} (tp {s.tp}) but replica "
                    f"{other.replica} runs {other.vendor} {other.model} (tp {other.tp}); the replicas of a stage "
                    "share its TP degree, and under FlagScale its device type (one per process mesh)",
                    "plan again with `hetctl plan --framework flagscale` (it keeps each stage on one chip type)",
                )
        if out and out[-1].tp == s.tp and out[-1].label.split("_")[0] == label:
            last = out[-1]
            out[-1] = Mesh(last.label, last.tp, last.first, last.stages + 1)
        else:
            seen = sum(1 for m in out if m.label.split("_")[0] == label)
            out.append(Mesh(label if not seen else f"{label}_{seen + 1}", s.tp, s.stage, 1))
    return out


def framework_rank(plan: Plan, rank: Rank, mesh_list: list[Mesh] | None = None) -> int:
    """The rank in Megatron/FlagScale/DeepSpeed order: per mesh, TP fastest, then DP, then PP.

    With one mesh (one TP degree) this is Megatron's ``tp-cp-ep-dp-pp`` and
    DeepSpeed's ``pipe-data-model`` topology.
    """
    mesh_list = mesh_list or meshes(plan, by_type=plan.framework == "flagscale")
    stage = stage_of(plan, rank)
    tp_idx = stage.chips.index(rank.chip) if rank.chip in stage.chips else 0
    if rank.chip is None:  # CPU stages: the TP index is the rank's place in its stage
        peers = sorted(r.rank for r in plan.ranks if r.replica == rank.replica and r.stage == rank.stage)
        tp_idx = peers.index(rank.rank)
    base = 0
    for m in mesh_list:
        if m.first <= rank.stage < m.first + m.stages:
            return base + tp_idx + m.tp * (rank.replica + plan.parallel.dp * (rank.stage - m.first))
        base += m.tp * plan.parallel.dp * m.stages
    raise ValueError(f"stage {rank.stage} is in no mesh")


# -- rendering ---------------------------------------------------------------------

# Megatron/FlagScale training defaults that validate_args needs to start (the
# script's own arguments come later on the command line and win). torch_dist
# checkpoints with the distributed optimizer's state saved fully reshardable
# (TP/PP/DP, not DP alone), so a re-plan onto other chips can load them.
TRAIN_ARGS = ["--lr", "3e-4", "--min-lr", "3e-5", "--lr-decay-style", "cosine", "--lr-warmup-fraction", "0.01",
              "--weight-decay", "0.1", "--clip-grad", "1.0", "--log-interval", "1", "--ckpt-format", "torch_dist",
              "--dist-ckpt-optim-fully-reshardable"]


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


def _rope_norm_args(m) -> list[str]:
    """Megatron's RoPE base, llama3 scaling and norm epsilon where the model's differ from its defaults.

    Megatron-LM's ``--use-rope-scaling`` is Llama 3.1's (low/high frequency factors 1 and 4 from an
    8192 context): other llama3 scalings have no Megatron flag and are left to ``--args``.
    """
    args: list = []
    if m.rope_theta != 10000.0:
        args += ["--rotary-base", int(m.rope_theta) if float(m.rope_theta).is_integer() else m.rope_theta]
    r = m.rope_scaling
    if r is not None and (r.low_freq_factor, r.high_freq_factor, r.original_max_position_embeddings) == (1, 4, 8192):
        args += ["--use-rope-scaling", "--rope-scaling-factor", r.factor]
    if m.norm_eps != 1e-5:
        args += ["--norm-epsilon", m.norm_eps]
    return args


def _model_args(plan: Plan) -> list[str]:
    m, par = plan.model, plan.parallel
    args = [
        "--num-layers", m.num_layers, "--hidden-size", m.hidden_size, "--ffn-hidden-size", m.ffn_hidden_size,
        "--num-attention-heads", m.num_attention_heads,
    ]
    if m.num_query_groups:
        args += ["--group-query-attention", "--num-query-groups", m.num_query_groups]
    args += ["--seq-length", m.seq_len, "--max-position-embeddings", m.seq_len,
             "--micro-batch-size", par.micro_batch, "--global-batch-size", par.global_batch]
    if m.swiglu:
        args += ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
                 "--disable-bias-linear"]
        args += _rope_norm_args(m)
    if m.qkv_bias:
        args.append("--add-qkv-bias")
    if not m.tie_embeddings:
        args.append("--untie-embeddings-and-output-weights")
    args.append("--use-distributed-optimizer")
    prec = {s.precision for s in plan.stages}
    if "bf16" in prec and len(prec) == 1:
        args.append("--bf16")
    elif prec & {"bf16", "fp16"}:
        args.append("--fp16")
    return [str(a) for a in args]


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
        _check_flagscale_meshes(plan, mesh_list)
    common = {
        "plan": plan, "framework": fw, "world": len(plan.ranks),
        "master_addr": hosts.get(first.node, first.node), "master_port": DEFAULT_PORT, "plan_path": plan_path,
        "model_args": _model_args(plan), "train_args": TRAIN_ARGS, "layout": megatron_layout(virtual),
        "meshes": mesh_list, "vendors": vendors, "layer_split": split,
        "mesh_args": [n for m in mesh_list for n in (m.tp, 1, 1, plan.parallel.dp, m.stages)],
        "uniform_tp": len({s.tp for s in plan.stages}) == 1, "check": False, "unrunnable": unrunnable(plan),
        "ds_config": json.dumps(_ds_config(plan), sort_keys=True),
        "ds_launcher": _ds_launcher(plan, mesh_list) if fw == "deepspeed" else None,
    }
    by_node = {}
    for node in plan.nodes:
        ranks = []
        for r in sorted(plan.ranks_on(node), key=lambda r: r.rank):
            stage = stage_of(plan, r)
            e = static_env(plan, r, visible)
            if reorder:
                e["RANK"] = str(framework_rank(plan, r, mesh_list))
            e.update({k: "" for k in LAUNCH_TIME})
            e["HETCTL_HEARTBEAT_FILE"] = f"rank-{e['RANK']}.json"
            label = next((m.label for m in mesh_list if m.first <= r.stage < m.first + m.stages),
                         _device_label(stage.vendor, stage.model))
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


def _check_flagscale_meshes(plan: Plan, mesh_list: list[Mesh]) -> None:
    """Refuse a FlagScale plan with a one-stage process mesh in a deeper pipeline.

    FlagScale sets each rank's ``pipeline_model_parallel_size`` to its mesh's
    ``pp``, and its ``get_transformer_layer_offset`` adds the earlier stages'
    layers only when that size is above 1: the ranks of a one-stage mesh would
    number their layers from 0 (wrong layer numbers, wrong checkpoint keys).

    Raises:
        PlanInfeasible: such a mesh (exit 4), naming the framework that runs the plan.
    """
    if plan.parallel.pp == 1:
        return
    for m in mesh_list:
        if m.stages == 1 and m.first > 0:  # the first stage's offset is 0 anyway
            a, b = plan.stages_of(0)[m.first].layers
            raise PlanInfeasible(
                f"plan: FlagScale's process mesh {m.label} holds one pipeline stage (stage {m.first}, layers "
                f"[{a}, {b})); FlagScale numbers a one-stage mesh's layers from 0, not from {a} "
                "(get_transformer_layer_offset counts earlier stages only for meshes of two or more)",
                "run this split with --framework hetctl (hetctl plan --framework hetctl), or plan FlagScale on "
                "nodes where each chip type holds two or more stages",
            )


def _ds_launcher(plan: Plan, mesh_list: list[Mesh]) -> Launcher:
    """DeepSpeed's launcher files for the plan, ranks in its pipe-data-model order."""
    return launcher_files(plan, lambda r: framework_rank(plan, r, mesh_list))


def _ds_config(plan: Plan) -> dict:
    par = plan.parallel
    prec = {s.precision for s in plan.stages}
    return {
        "train_batch_size": par.global_batch,
        "train_micro_batch_size_per_gpu": par.micro_batch,
        "gradient_accumulation_steps": par.micro_batches,
        "bf16": {"enabled": prec == {"bf16"}},
        "fp16": {"enabled": "fp16" in prec},
        "zero_optimization": {"stage": 1},
    }


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
