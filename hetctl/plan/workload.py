"""The workload being planned and what it holds in memory per chip: the analytic memory model.

:class:`Workload` is the model's cost, the batch shape and how the reference trainer
compresses what crosses vendors; :func:`memory_terms` gives a stage's bytes per chip
(weights, gradients and optimizer state per layer, activations per micro-batch in flight,
the embedding, the head and its fp32 logits; the assumptions are :mod:`hetctl.plan.costmodel`'s).
Both the cost model's stage types and the check of the model against a layer profile's
measured peak (:mod:`hetctl.plan.profmem`) use them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from hetctl.plan.models import ModelCost, model_cost
from hetctl.train.gradmode import Mode, p2p_elem_bytes, parse_mode, wire_fraction

if TYPE_CHECKING:
    from hetctl.files.plan import Plan


@dataclass(frozen=True)
class Workload:
    """The model and batch shape being planned."""

    cost: ModelCost
    micro_batch: int
    global_batch: int
    compress: Mode = Mode()
    """``--grad-compress`` of the reference trainer: how the gradient reduces that cross vendors are sent."""
    p2p: str | None = None
    """``--p2p-compress`` of the reference trainer (``none``, ``bf16``): what its pipeline links carry
    (:func:`hetctl.train.gradmode.p2p_elem_bytes`); None for another framework, which sends in the stages'
    own precision."""
    schedule: str = "auto"
    """``plan --schedule``: ``auto`` (ZB-H1 where the framework runs it, the chips are not CPUs and it simulates
    faster), ``1f1b`` (never ZB-H1) or ``zb-h1`` (wherever the framework runs it, CPUs included, when faster)."""

    @classmethod
    def of_plan(cls, plan: "Plan") -> "Workload":
        """A written plan's model, batch and ``grad_compress``, as the cost model takes them."""
        return cls(cost=model_cost(plan.model), micro_batch=plan.parallel.micro_batch,
                   global_batch=plan.parallel.global_batch, compress=parse_mode(plan.grad_compress),
                   p2p=plan.p2p_compress if plan.framework == "hetctl" else None)

    def p2p_bytes(self, precision_a: str, precision_b: str, crosses_vendors: bool) -> int:
        """Bytes per element on a pipeline link: the reference trainer's rule, or another framework's own
        (it sends in the sending stage's precision)."""
        if self.p2p is None:
            return elem_bytes(precision_a)
        return p2p_elem_bytes(precision_a, precision_b, crosses_vendors, self.p2p)

    def wire(self, unit: str, d: int) -> float:
        """Fraction of fp32's bytes a cross-vendor reduce of one ``unit`` (``embed``, ``layer``, ``head``) over
        ``d`` ranks sends under :attr:`compress` (:func:`hetctl.train.gradmode.wire_fraction`)."""
        if self.compress.kind == "none":
            return 1.0
        c = self.cost
        if unit == "layer":
            return wire_fraction(self.compress, d, c.layer_params, c.layer_matrices)
        return wire_fraction(self.compress, d, c.embed_params if unit == "embed" else c.head_params,
                             ((c.vocab, c.hidden),))

    @property
    def tokens(self) -> int:
        """Tokens in one micro-batch."""
        return self.micro_batch * self.cost.seq_len


def elem_bytes(precision: str) -> int:
    return 4 if precision == "fp32" else 2


def param_bytes(precision: str, dp: int) -> tuple[float, float, float]:
    """Bytes per parameter per chip of the weights, the gradients and the optimizer state (module docstring)."""
    if precision == "fp32":
        return 4.0, 4.0, 8.0
    return 2.0, 4.0, 12.0 / dp


class MemoryTerms(NamedTuple):
    """The memory model's per-chip terms in bytes (see :class:`hetctl.plan.costmodel.StageType`; ``logits``: the
    fp32 part of ``mem_last``)."""

    mem_layer: float
    act_layer: float
    mem_first: float
    act_first: float
    mem_last: float
    logits: float


def memory_terms(work: Workload, precision: str, tp: int = 1, dp: int = 1, vt: int = 1) -> MemoryTerms:
    """The analytic memory terms of a ``tp``-chip stage with ``dp`` replicas, embedding and head split ``vt`` ways."""
    c = work.cost
    eb = elem_bytes(precision)
    state = sum(param_bytes(precision, dp))
    logits = work.tokens * c.vocab * 4.0 / vt
    return MemoryTerms(
        mem_layer=c.layer_params / tp * state, act_layer=work.tokens * c.hidden * c.act_coeff * (eb / 2.0) / tp,
        mem_first=c.embed_params / vt * state, act_first=work.tokens * c.hidden * eb / vt,
        mem_last=c.head_params / vt * state + logits, logits=logits,
    )
