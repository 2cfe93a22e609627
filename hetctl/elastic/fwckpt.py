"""The frameworks' own checkpoints: find the newest complete one, and say how to resume from it (pure).

hetctl's reference trainer writes manifests (:mod:`hetctl.node.manifest`); a
Megatron-LM, FlagScale, DeepSpeed or torchrun job writes its framework's
layout, and ``hetctl resume`` and elastic restarts read that instead. Each rule
below follows the framework's own save code:

- **Megatron-LM / FlagScale** (``megatron/training/checkpointing.py``): the
  ``--save`` folder holds ``iter_{N:07d}/`` per save and
  ``latest_checkpointed_iteration.txt`` (an iteration number, or ``release``).
  ``save_checkpoint`` writes the tracker after every rank's files are written
  (a barrier, or the async save's finalize step), so an ``iter_N`` newer than
  the tracker is a save that never finished. Inside ``iter_N``: ``torch_dist``
  has ``metadata.json`` (``megatron.core.dist_checkpointing``) and torch DCP's
  ``.metadata`` (written by the coordinator once every rank's shard is down);
  the legacy ``torch`` format has ``mp_rank_XX[_YYY]/model_optim_rng.pt``.
  Megatron resumes with ``--load DIR`` (the tracker's iteration) or
  ``--ckpt-step N``; ``torch_dist`` loads onto another TP/PP shape.
- **DeepSpeed** (``deepspeed/runtime/engine.py: save_checkpoint``): the
  ``save_dir`` holds one folder per tag (``global_step{N}`` by default) with
  ``mp_rank_XX_model_states.pt`` (and ZeRO's ``*_optim_states.pt``), and rank 0
  writes ``latest`` (the tag) at the end of the save. A tag newer than the one
  ``latest`` names is a save that never finished; older ones finished when
  ``latest`` moved past them. DeepSpeed resumes with ``load_checkpoint(dir,
  tag)``; its checkpoints load only onto the same pipeline/ZeRO shape (another
  shape needs its offline ``ds_to_universal`` conversion).
- **torch DCP** (``torch.distributed.checkpoint``, a torchrun script's own
  saves): one folder per save under ``HETCTL_CKPT_DIR`` named ``step-N``
  (``step_N``, ``iter_N``, ``global_stepN`` are read too), complete when its
  ``.metadata`` is there (DCP writes it last, after every rank's
  ``__R_0.distcp``). DCP loads by key, so a script that names its tensors
  globally loads onto any shape.

Nothing here imports torch: the rules read names and files only, and change nothing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from hetctl.node.manifest import StepStatus

if TYPE_CHECKING:
    from hetctl.files.plan import Plan

MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"
_MEGATRON_ITER = re.compile(r"^iter_(\d{7,})$")
_DCP_STEP = re.compile(r"^(?:step[-_]?|iter[-_]?|global_step)(\d+)$")
_DS_STEP = re.compile(r"(\d+)$")

# Which frameworks read which layout, and whether their checkpoints load onto another shape.
LAYOUTS = {"megatron": "megatron", "flagscale": "megatron", "deepspeed": "deepspeed", "torchrun": "dcp"}
RESHARDS = {"hetctl": True, "megatron": True, "flagscale": True, "deepspeed": False, "torchrun": True}


@dataclass(frozen=True)
class Found:
    """One complete checkpoint of a framework.

    Attributes:
        step: the iteration / global step it holds.
        path: its folder (``iter_N``, the DeepSpeed tag folder, the DCP folder).
        root: the folder the framework loads from (``--load``, ``load_checkpoint``'s dir).
        tag: DeepSpeed's tag (the folder's name); None elsewhere.
        format: ``torch_dist``, ``torch``, ``torch_dcp`` (Megatron), ``deepspeed`` or ``dcp``.
    """

    step: int
    path: Path
    root: Path
    tag: str | None
    format: str


@dataclass
class Scan:
    """What a checkpoint folder holds: complete checkpoints (newest first) and the skipped ones."""

    found: list[Found] = field(default_factory=list)
    skipped: list[StepStatus] = field(default_factory=list)  # incomplete ones, and why

    @property
    def newest(self) -> Found | None:
        return self.found[0] if self.found else None

    def at(self, step: int) -> Found | None:
        return next((f for f in self.found if f.step == step), None)


def reshards(framework: str) -> bool:
    """Whether a checkpoint of ``framework`` loads onto a plan of another shape (see the module docstring)."""
    return RESHARDS.get(framework, False)


def scan(framework: str, ckpt_dir: str | Path) -> Scan:
    """The complete checkpoints of ``framework`` under ``ckpt_dir`` (newest first) and the incomplete ones."""
    layout = LAYOUTS.get(framework)
    d = Path(ckpt_dir)
    if layout is None or not d.is_dir():
        return Scan()
    return {"megatron": _megatron, "deepspeed": _deepspeed, "dcp": _dcp}[layout](d)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def megatron_format(folder: Path) -> str | None:
    """The format of a Megatron ``iter_N`` folder as Megatron's ``_get_checkpoint_format`` tells it, or None."""
    try:
        names = [p.name for p in folder.iterdir()]
    except OSError:
        return None
    if "metadata.json" in names and ".metadata" in names:
        return "torch_dist"
    if any(n.startswith("mp_rank_0") and any((folder / n).glob("*.pt")) for n in names):
        return "torch"
    if ".metadata" in names:
        return "torch_dcp"
    return None


def _megatron(d: Path) -> Scan:
    out = Scan()
    tracker = _read(d / MEGATRON_TRACKER)
    last: int | None = None
    if tracker is not None and tracker != "release":
        try:
            last = int(tracker)
        except ValueError:
            last = None
    iters = sorted(((int(m.group(1)), p) for p in d.iterdir()
                    if (m := _MEGATRON_ITER.match(p.name)) and p.is_dir()), reverse=True)
    for step, path in iters:
        problems = []
        if tracker is None:
            problems.append(f"no {MEGATRON_TRACKER}: Megatron writes it when a save has finished")
        elif last is None:
            problems.append(f"{MEGATRON_TRACKER} says {tracker!r}, not an iteration")
        elif step > last:
            problems.append(f"newer than {MEGATRON_TRACKER} ({last}): the save did not finish")
        fmt = megatron_format(path)
        if fmt is None:
            problems.append("holds neither a torch_dist checkpoint (metadata.json and .metadata) "
                            "nor mp_rank_XX/*.pt files")
        if problems:
            out.skipped.append(StepStatus(step, path, problems))
        else:
            out.found.append(Found(step, path, d, None, fmt))
    return out


def _ds_complete(folder: Path) -> bool:
    return any(folder.glob("*mp_rank_*_model_states.pt")) or any(folder.glob("layer_*-model_states.pt"))


def _deepspeed(d: Path) -> Scan:
    out = Scan()
    latest = _read(d / "latest")
    m = _DS_STEP.search(latest or "")
    last = int(m.group(1)) if m else None
    tags = []
    for p in d.iterdir():
        sm = _DS_STEP.search(p.name)
        if p.is_dir() and sm:
            tags.append((int(sm.group(1)), p))
    for step, path in sorted(tags, reverse=True):
        problems = []
        if latest is None:
            problems.append("no `latest` file: DeepSpeed writes it when a save has finished")
        elif last is None:
            problems.append(f"`latest` names tag {latest!r}, which carries no step number")
        elif step > last or (step == last and path.name != latest):
            problems.append(f"newer than the `latest` tag ({latest}): the save did not finish")
        if not _ds_complete(path):
            problems.append("holds no *mp_rank_XX_model_states.pt")
        if problems:
            out.skipped.append(StepStatus(step, path, problems))
        else:
            out.found.append(Found(step, path, d, path.name, "deepspeed"))
    return out


def _dcp(d: Path) -> Scan:
    out = Scan()
    steps = sorted(((int(m.group(1)), p) for p in d.iterdir()
                    if (m := _DCP_STEP.match(p.name)) and p.is_dir()), reverse=True)
    for step, path in steps:
        meta = path / ".metadata"
        problems = []
        if not meta.is_file() or meta.stat().st_size == 0:
            problems.append("no .metadata: torch.distributed.checkpoint writes it when every rank has saved")
        elif not any(path.glob("*.distcp")):
            problems.append("no *.distcp data files beside .metadata")
        if problems:
            out.skipped.append(StepStatus(step, path, problems))
        else:
            out.found.append(Found(step, path, d, None, "dcp"))
    return out


def resume_env(found: Found | None) -> dict[str, str]:
    """The rank-contract variables that say where to resume (empty when training starts from scratch).

    ``HETCTL_RESUME_STEP`` (the step), ``HETCTL_RESUME_DIR`` (the folder to load:
    the DCP folder, or the framework's load root) and for DeepSpeed
    ``HETCTL_RESUME_TAG``. The rendered Megatron/FlagScale scripts turn the step
    into ``--ckpt-step`` (``--load`` is always the run's checkpoint folder).
    """
    if found is None:
        return {}
    env = {"HETCTL_RESUME_STEP": str(found.step),
           "HETCTL_RESUME_DIR": str(found.path if found.format == "dcp" else found.root)}
    if found.tag:
        env["HETCTL_RESUME_TAG"] = found.tag
    return env


def same_shape_only(old: Plan, new: Plan, ckpt_dir: str | Path) -> None:
    """Refuse a re-plan whose shape a framework's checkpoint cannot load (DeepSpeed: same PP, DP, TP, split).

    Raises:
        PlanInfeasible: the framework cannot reshard, a checkpoint exists, and the shapes differ.
    """
    from hetctl.errors import PlanInfeasible
    from hetctl.elastic.replan import layer_split

    fw = old.framework
    if reshards(fw) or plan_shape(old) == plan_shape(new) or scan(fw, ckpt_dir).newest is None:
        return
    raise PlanInfeasible(
        f"{fw} checkpoints load only onto the same shape (pp {old.parallel.pp}, dp {old.parallel.dp}, "
        f"split {layer_split(old)}); the survivors would need pp {new.parallel.pp}, dp {new.parallel.dp}, "
        f"split {layer_split(new)}",
        "bring the lost nodes back and resume on the same shape, or convert the checkpoint "
        "(DeepSpeed's ds_to_universal) and start anew",
    )


def plan_shape(plan: Plan) -> tuple:
    """What a checkpoint of a framework that cannot reshard depends on: PP, DP, each stage's TP, the split."""
    from hetctl.elastic.replan import layer_split

    return (plan.parallel.pp, plan.parallel.dp, tuple(s.tp for s in plan.stages_of(0)), tuple(layer_split(plan)))
