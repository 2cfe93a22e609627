"""The reference trainer's optimizer: AdamW, its learning-rate schedule, global-norm clipping, non-finite steps.

* **Schedule.** Linear warm-up from ``lr/warmup`` to ``--lr`` over ``--warmup-steps``,
  then cosine or linear decay to ``--min-lr`` at ``--decay-steps`` (counted from
  step 1, warm-up included, as Megatron-LM's ``lr_decay_iters``), then ``--min-lr``.
  :meth:`Schedule.lr_at` is a pure function of the step, so a resumed or re-planned
  run follows the same schedule bit for bit.
* **Weight decay** applies to parameters of two or more dimensions (projections and
  embeddings), never to norms or biases (Megatron-LM and nanoGPT's rule). Groups are
  chosen by shape alone, so every stage and split groups a parameter the same way;
  checkpoints key AdamW state by parameter name (:mod:`hetctl.train.ckpt`), never by group.
* **Global gradient norm** over the whole model, after the data-parallel reduce:
  each unit's (and TP shard's) sum of squares is computed by one rank only, the
  holder in the lowest replica, into its own slot of a vector with one slot per
  unit and TP rank (:attr:`Topology.unit_groups`); norms and other parameters that
  are whole on every TP rank count on TP rank 0 only. One gloo all-reduce of that
  vector adds each slot's value to zeros, which is exact, so every rank holds the
  same vector bit for bit, and sums it in slot order: the same norm on every rank,
  whatever the split, and the single-process norm up to float rounding. Gradients
  are scaled by ``clip / (norm + 1e-6)`` when the norm exceeds ``--clip-grad``
  (``torch.nn.utils.clip_grad_norm_``'s rule).
* **Non-finite steps.** A last-stage rank whose loss is not finite marks a slot of
  the same vector, so every rank decides on the same all-reduced value: the step is
  skipped everywhere (no update, AdamW's state untouched), reported, and after
  ``--max-skipped-steps`` in a row the rank stops with :class:`Diverged`.
* **Dynamic loss scaling** when any stage of the plan computes in fp16
  (:class:`LossScaler`, the rule of torch's ``GradScaler`` and Megatron-LM's
  ``DynamicGradScaler``): the last stage back-propagates the loss times a power of
  two, every rank divides its gradients by it before the data-parallel reduce (exact),
  and a step whose gradient norm is not finite while its loss is, is an fp16
  overflow: skipped everywhere and the scale halved, not counted towards
  ``--max-skipped-steps`` until the scale is down to 1. After ``--loss-scale-window``
  applied steps in a row the scale doubles. Every rank decides on the same
  all-reduced norm, so every rank holds the same scale; checkpoints record it.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Mapping, Sequence

from hetctl.errors import ConfigError, HetctlError

DECAYS = ("cosine", "linear", "constant")
BETAS, EPS = (0.9, 0.95), 1e-8
SCHEDULE_KEYS = ("lr", "min_lr", "warmup_steps", "decay", "decay_steps")


class Diverged(HetctlError):
    """Too many steps in a row had a non-finite loss or gradient norm; restarting would repeat them."""

    exit_code = 6


@dataclass(frozen=True)
class Schedule:
    """The learning-rate schedule (module docstring); ``explicit``: ``--decay-steps`` was given, not ``--steps``."""

    lr: float
    min_lr: float
    warmup_steps: int
    decay: str
    decay_steps: int
    explicit: bool = False

    def lr_at(self, step: int) -> float:
        """The learning rate that step ``step`` (1-based) applies."""
        if self.warmup_steps and step <= self.warmup_steps:
            return self.lr * step / self.warmup_steps
        if self.decay == "constant":
            return self.lr
        if step >= self.decay_steps:
            return self.min_lr
        # Megatron-LM's formulas, term for term (tests/test_optim.py compares them with its scheduler).
        ratio = (step - self.warmup_steps) / (self.decay_steps - self.warmup_steps)
        coeff = 1.0 - ratio if self.decay == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.lr - self.min_lr)

    def record(self) -> dict[str, Any]:
        """The schedule's part of ``state.json``'s optimizer record."""
        return {k: getattr(self, k) for k in SCHEDULE_KEYS}


@dataclass
class LossScaler:
    """The run's dynamic loss scale for fp16 stages (module docstring); the same on every rank.

    Args:
        scale: the factor the last stage multiplies the loss by (a power of two, so scaling is exact).
        good: applied steps in a row since the last change.
        window: after this many, the scale doubles.
    """

    INITIAL: ClassVar[float] = 2.0 ** 16  # torch's GradScaler; Megatron-LM starts at 2**32
    WINDOW: ClassVar[int] = 1000  # Megatron-LM's --loss-scale-window
    MAX: ClassVar[float] = 2.0 ** 32  # a bound on the growth: Megatron-LM's initial scale

    scale: float = INITIAL
    good: int = 0
    window: int = WINDOW

    def overflowed(self) -> None:
        """A step overflowed in fp16: halve the scale (down to 1)."""
        self.scale, self.good = max(1.0, self.scale / 2), 0

    def applied(self) -> None:
        """A step was applied: after ``window`` in a row, double the scale (up to :attr:`MAX`)."""
        self.good += 1
        if self.good >= self.window:
            self.scale, self.good = min(self.MAX, self.scale * 2), 0

    def record(self) -> dict[str, Any]:
        """``state.json``'s ``loss_scale``: what a resumed or re-planned run continues from."""
        return {"scale": self.scale, "good": self.good, "window": self.window}

    @classmethod
    def fresh(cls, cfg: "OptimConfig") -> "LossScaler":
        """A run's scale at its start (``--initial-loss-scale``, ``--loss-scale-window``)."""
        return cls(scale=cfg.initial_loss_scale, window=cfg.loss_scale_window)

    @classmethod
    def resumed(cls, recorded: Mapping[str, Any] | None, cfg: "OptimConfig") -> tuple["LossScaler", str]:
        """The scaler a run resumes with, and a note when the checkpoint had none (then it starts afresh)."""
        fresh = cls.fresh(cfg)
        if not recorded:
            return fresh, f"the checkpoint has no loss scale (no fp16 stage before): starting at {fresh.scale:g}"
        try:
            scale, good = float(recorded["scale"]), int(recorded["good"])
        except (KeyError, TypeError, ValueError):
            return fresh, f"the checkpoint's loss scale {recorded!r} is unreadable: starting at {fresh.scale:g}"
        if not (1.0 <= scale <= cls.MAX and math.log2(scale).is_integer()) or good < 0:
            return fresh, f"the checkpoint's loss scale {scale:g} is not a power of two in [1, 2**32]: " \
                          f"starting at {fresh.scale:g}"
        return cls(scale=scale, good=min(good, cfg.loss_scale_window), window=cfg.loss_scale_window), ""


@dataclass(frozen=True)
class OptimConfig:
    """Every optimizer setting of a run, from the command line (:func:`config`)."""

    schedule: Schedule
    weight_decay: float
    clip_grad: float
    max_skipped: int
    initial_loss_scale: float = 2.0 ** 16
    loss_scale_window: int = 1000

    def record(self) -> dict[str, Any]:
        """The ``state.json`` optimizer record (compared on resume by :func:`check_resume`)."""
        return {**self.schedule.record(), "betas": list(BETAS), "eps": EPS, "weight_decay": self.weight_decay,
                "no_decay": "parameters of fewer than 2 dimensions (norms, biases)", "clip_grad": self.clip_grad}


def add_args(ap: argparse.ArgumentParser) -> None:
    """The optimizer's options on the trainer's parser."""
    g = ap.add_argument_group("optimizer (AdamW, betas 0.9/0.95, eps 1e-8)")
    g.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    g.add_argument("--min-lr", type=float, default=None,
                   help="learning rate at the end of the decay (default: --lr / 10)")
    g.add_argument("--warmup-steps", type=int, default=0,
                   help="steps of linear warm-up from --lr/N to --lr (default 0)")
    g.add_argument("--decay", choices=DECAYS, default="constant",
                   help="after the warm-up: cosine or linear decay to --min-lr, or constant --lr (default constant)")
    g.add_argument("--decay-steps", type=int, default=None,
                   help="the step at which the decay reaches --min-lr, warm-up included (default: --steps)")
    g.add_argument("--weight-decay", type=float, default=0.1,
                   help="AdamW weight decay of 2-D weights; norms and biases get none (default 0.1)")
    g.add_argument("--clip-grad", type=float, default=1.0,
                   help="clip the global gradient norm (every stage, TP rank and replica) to this; 0: off "
                   "(default 1.0)")
    g.add_argument("--max-skipped-steps", type=int, default=5,
                   help="stop the run after this many steps in a row with a non-finite loss or gradient norm "
                   "(each one is skipped; default 5)")
    g.add_argument("--initial-loss-scale", type=float, default=LossScaler.INITIAL,
                   help="fp16 stages: the dynamic loss scale to start from, a power of two (default 65536); "
                   "unused when no stage of the plan is fp16")
    g.add_argument("--loss-scale-window", type=int, default=LossScaler.WINDOW,
                   help="fp16 stages: double the loss scale after this many steps in a row without overflow "
                   "(default 1000)")


def config(args: argparse.Namespace, ap: argparse.ArgumentParser) -> OptimConfig:
    """The run's :class:`OptimConfig` from parsed options; a bad combination is ``ap.error`` (exit 2)."""
    if args.lr <= 0 or not math.isfinite(args.lr):
        ap.error("--lr must be a positive number")
    min_lr = args.lr / 10 if args.min_lr is None else args.min_lr
    if not 0 <= min_lr <= args.lr:
        ap.error(f"--min-lr {min_lr:g} must be between 0 and --lr {args.lr:g}")
    if args.warmup_steps < 0:
        ap.error("--warmup-steps must be >= 0")
    decay_steps = args.steps if args.decay_steps is None else args.decay_steps
    if args.decay != "constant" and decay_steps <= args.warmup_steps:
        ap.error(f"--decay-steps {decay_steps} (default --steps) must be larger than --warmup-steps "
                 f"{args.warmup_steps} for a {args.decay} decay")
    if args.weight_decay < 0:
        ap.error("--weight-decay must be >= 0")
    if args.clip_grad < 0:
        ap.error("--clip-grad must be >= 0 (0 turns clipping off)")
    if args.max_skipped_steps < 1:
        ap.error("--max-skipped-steps must be >= 1")
    if not (1 <= args.initial_loss_scale <= LossScaler.MAX and math.log2(args.initial_loss_scale).is_integer()):
        ap.error(f"--initial-loss-scale {args.initial_loss_scale:g} must be a power of two from 1 to 2**32 "
                 "(e.g. 65536)")
    if args.loss_scale_window < 1:
        ap.error("--loss-scale-window must be >= 1")
    schedule = Schedule(lr=args.lr, min_lr=min_lr, warmup_steps=args.warmup_steps, decay=args.decay,
                        decay_steps=decay_steps, explicit=args.decay_steps is not None)
    return OptimConfig(schedule=schedule, weight_decay=args.weight_decay, clip_grad=args.clip_grad,
                       max_skipped=args.max_skipped_steps, initial_loss_scale=args.initial_loss_scale,
                       loss_scale_window=args.loss_scale_window)


# A checkpoint written before schedules existed trained at a constant --lr without clipping.
LEGACY = {"min_lr": None, "warmup_steps": 0, "decay": "constant", "decay_steps": None, "clip_grad": 0.0}


def check_resume(recorded: Mapping[str, Any] | None, cfg: OptimConfig, where: Any) -> list[str]:
    """Refuse a resume whose learning-rate schedule differs from the checkpoint's; list other changes.

    The schedule decides every later step's update, so a different one is not the run
    being continued: refused, naming the setting. Under ``constant`` decay the decay
    length does not matter; otherwise a longer ``--steps`` is accepted only when the
    decay length stays the same (give the old one with ``--decay-steps``). Changed
    weight decay or clipping are returned as warnings, as before schedules existed.
    """
    rec = {**LEGACY, **(recorded or {})}
    if rec["min_lr"] is None:
        rec["min_lr"] = rec.get("lr")
    want = cfg.schedule.record()
    if rec.get("decay") == "constant" and want["decay"] == "constant":
        rec["min_lr"] = want["min_lr"]  # unused by a constant schedule
        rec["decay_steps"] = want["decay_steps"]
    for key in ("decay", "lr", "min_lr", "warmup_steps", "decay_steps"):
        if rec.get(key) != want[key]:
            old, new = _show(rec.get(key)), _show(want[key])
            hint = f"pass --{key.replace('_', '-')} {old} to continue that run"
            if key == "decay_steps" and not cfg.schedule.explicit:
                hint = (f"the decay length defaults to --steps; pass --decay-steps {old} to keep the "
                        "checkpoint's schedule for a longer run")
            raise ConfigError(f"checkpoint {where}: its learning-rate schedule has {key}={old}, this run has {new}",
                              hint)
    mine = cfg.record()
    return [f"{k} {_show(rec.get(k))} -> {_show(mine[k])}" for k in ("weight_decay", "clip_grad", "betas", "eps")
            if k in rec and rec[k] != mine[k]]


def _show(v: Any) -> str:
    """A setting as the user would type it (``0.0003``, not ``0.00030000000000000003``)."""
    return f"{v:.10g}" if isinstance(v, float) else str(v)


def parse_test_nan(raw: str | None) -> range:
    """``HETCTL_TEST_NAN_GRAD=<step>[:<count>]``, test-only: rank 0 poisons its gradient at those steps.

    Unset (always, outside tests) it changes nothing. Raises ValueError when malformed.
    """
    if not raw:
        return range(0)
    step, _, count = raw.partition(":")
    first, n = int(step), int(count or 1)
    if first < 1 or n < 1:
        raise ValueError(raw)
    return range(first, first + n)


def param_groups(units: Any, extra: Sequence[Any] = ()) -> list[dict[str, Any]]:
    """AdamW parameter groups of a stage: ``decay`` (2-D and up), ``no_decay`` (norms, biases), by unit order.

    The weight-decay value is set by :func:`build`; the group a parameter lands in
    depends on its shape only, the same on any stage of any split.
    """
    decay, keep = [], []
    for p in [*(p for unit in units.values() for p in unit.parameters()), *extra]:
        (decay if p.dim() >= 2 else keep).append(p)
    return [{"name": "decay", "params": decay}, {"name": "no_decay", "params": keep, "weight_decay": 0.0}]


def build(units: Any, cfg: OptimConfig, extra: Sequence[Any] = ()):
    """The stage's AdamW over :func:`param_groups` (``extra``: a last stage's tied copy), at step 1's rate."""
    from hetctl.train.adamw import AdamW

    return AdamW(param_groups(units, extra), lr=cfg.schedule.lr_at(1), betas=BETAS, eps=EPS,
                 weight_decay=cfg.weight_decay)


@dataclass(frozen=True)
class StepReport:
    """What one step did, for the heartbeat and the printed line."""

    lr: float
    grad_norm: float
    applied: bool
    skipped_in_row: int
    skipped_total: int
    nonfinite: str = ""  # "loss", "grad_norm", "loss+grad_norm" or "fp16-overflow", on a skipped step
    loss_scale: float | None = None  # with fp16 stages: the scale the next step uses

    def metrics(self) -> dict[str, Any]:
        """The heartbeat fields: ``lr``, ``grad_norm`` (null when not finite), ``skipped`` (the run's count),
        and ``loss_scale`` when a stage is fp16."""
        out = {"lr": self.lr, "grad_norm": self.grad_norm if math.isfinite(self.grad_norm) else None,
               "skipped": self.skipped_total}
        if not self.applied:
            out["nonfinite"] = self.nonfinite
        if self.loss_scale is not None:
            out["loss_scale"] = self.loss_scale
        return out


class Stepper:
    """Applies one step of a stage: schedule, global norm, clipping, the skip of a non-finite step.

    Args:
        cfg: the run's optimizer settings.
        optimizer: the stage's AdamW (:func:`build`).
        units: the stage's units (named as the checkpoint units).
        topo: this rank's :class:`hetctl.train.topology.Topology`.
        group: a gloo group of every rank (None when the run has one rank).
        poison: test-only steps at which rank 0 writes NaN into a gradient (:func:`parse_test_nan`).
        extra: parameters clipped with the stage's but left out of the norm: a last stage's copy of a
            tied table, whose gradient equals the table's, counted once in the ``embedding`` unit.
        scaler: the run's loss scale when a stage of the plan is fp16, else None.
    """

    def __init__(self, cfg: OptimConfig, optimizer: Any, units: Any, topo: Any, group: Any = None,
                 poison: range = range(0), extra: Sequence[Any] = (), scaler: LossScaler | None = None) -> None:
        self.cfg, self.optimizer, self.units, self.group, self.scaler = cfg, optimizer, units, group, scaler
        self.extra = list(extra)
        self.poison = poison if topo.rank == 0 else range(0)
        self.skipped_in_row = self.skipped_total = 0
        self._first_skip = 0
        self.slots = len(topo.unit_groups)  # one per unit and TP rank; one more for non-finite losses
        self.mine = _counted(topo, units)

    def step(self, step: int, loss: Any, apply: Callable[[], None],
             on_skip: Callable[[int], None] | None = None) -> StepReport:
        """Set step ``step``'s learning rate, clip and ``apply()`` it, or skip it on every rank alike.

        Call after the data-parallel reduce. ``loss`` is this rank's loss share (None
        off the last stage); ``on_skip(step)`` tells the just-in-time writer that the
        step completed without an update. Raises :class:`Diverged` after
        ``max_skipped`` non-finite steps in a row.
        """
        import torch

        lr = self.cfg.schedule.lr_at(step)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        if step in self.poison:
            first = next(iter(self.units.values()))
            next(first.parameters()).grad.view(-1)[0] = float("nan")
        sq, bad_loss = self._sums(loss)
        norm = math.sqrt(sq)
        scaler = self.scaler
        if math.isfinite(norm) and not bad_loss:
            coef = self.cfg.clip_grad / (norm + 1e-6)
            if self.cfg.clip_grad and coef < 1.0:
                torch._foreach_mul_([p.grad for p in self._params()], coef)
            apply()
            self.skipped_in_row = 0
            if scaler is not None:
                scaler.applied()
            return StepReport(lr, norm, True, 0, self.skipped_total, loss_scale=self._scale())
        self.skipped_total += 1
        if scaler is not None and not bad_loss and scaler.scale > 1.0:
            # fp16 overflow: the scale was too large for some gradient. Not a divergence while it can shrink.
            scaler.overflowed()
            if on_skip is not None:
                on_skip(step)
            return StepReport(lr, norm, False, self.skipped_in_row, self.skipped_total, "fp16-overflow",
                              loss_scale=self._scale())
        self.skipped_in_row += 1
        if self.skipped_in_row == 1:
            self._first_skip = step
        what = "+".join(w for w, bad in (("loss", bad_loss), ("grad_norm", not math.isfinite(norm))) if bad)
        if on_skip is not None:
            on_skip(step)
        if self.skipped_in_row >= self.cfg.max_skipped:
            raise Diverged(
                f"training diverged: {self.skipped_in_row} steps in a row ({self._first_skip}-{step}) had a "
                f"non-finite {what.replace('+', ' and ')}; each was skipped, no update was applied",
                "the checkpoints hold the last finite weights: start again with a lower --lr or a longer "
                "--warmup-steps, or resume with a smaller --clip-grad; --max-skipped-steps sets how many skips "
                "in a row end the run")
        return StepReport(lr, norm, False, self.skipped_in_row, self.skipped_total, what, loss_scale=self._scale())

    def loss_scale(self) -> float:
        """The factor the last stage multiplies this step's loss by (1 without fp16 stages)."""
        return self.scaler.scale if self.scaler is not None else 1.0

    def unscale(self) -> None:
        """Divide this rank's gradients by the loss scale, right after the backward (before the reduce).

        A power of two, so exact: the reduce, its compression and the norm see true gradients,
        and an overflow's inf or NaN stays one.
        """
        if self.scaler is not None and self.scaler.scale != 1.0:
            import torch

            torch._foreach_mul_([p.grad for p in self._params()], 1.0 / self.scaler.scale)

    def _scale(self) -> float | None:
        return self.scaler.scale if self.scaler is not None else None

    def _params(self):
        return [p for p in [*(p for unit in self.units.values() for p in unit.parameters()), *self.extra]
                if p.grad is not None]

    def _sums(self, loss: Any) -> tuple[float, bool]:
        """The whole model's squared gradient norm and whether any last stage's loss was not finite."""
        import torch
        import torch.distributed as dist

        vec = torch.zeros(self.slots + 1, dtype=torch.float64)
        if self.mine:  # each counted unit's sum of squares, one transfer to the host
            sums = torch.stack([torch.stack([torch.linalg.vector_norm(p.grad.detach().float()) for p in params])
                                .double().pow(2).sum() for _, params in self.mine]).cpu()
            vec[[slot for slot, _ in self.mine]] = sums
        if loss is not None and not bool(torch.isfinite(loss.detach()).all()):
            vec[self.slots] = 1.0
        if self.group is not None:
            dist.all_reduce(vec, group=self.group)  # each slot has one non-zero term: exact, same on every rank
        total = 0.0
        for v in vec[:self.slots].tolist():  # slot order: the same sum on every rank, whatever the split
            total += v
        return total, vec[self.slots].item() > 0


def _counted(topo: Any, units: Any) -> list[tuple[int, list[Any]]]:
    """The slots this rank fills: ``(slot, parameters it counts)`` for the units it holds in the lowest replica.

    Under TP, a layer's split parameters count on every TP rank (each its shard), the
    rest (norms; embedding and head, whole on every TP rank) on TP rank 0 only.
    """
    from hetctl.train.tensor import SHARD_DIM

    tp_of: dict[str, int] = {}
    out = []
    for slot, (name, members, _lib) in enumerate(topo.unit_groups):
        i = tp_of[name] = tp_of.get(name, -1) + 1  # unit_groups lists a unit's TP ranks in order
        if name not in units or members[0] != topo.rank:
            continue
        split = topo.tp > 1 and name.startswith("layer-")
        counted = [p for pname, p in units[name].named_parameters()
                   if (split and pname in SHARD_DIM) or i == 0]
        if counted:
            out.append((slot, counted))
    return out
