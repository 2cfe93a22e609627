"""The memory model checked against a layer profile's measured peak (``probe --bench --model``).

``hetctl/node/layerprof.py`` records ``peak_memory_gb``: the device's peak
allocated memory (``torch.<device>.max_memory_allocated``, a fresh process, no
reset) over the whole profile. :func:`profile_peak` is the planner's memory
model (:func:`hetctl.plan.workload.memory_terms`, nothing else) applied to what
layerprof holds at each step, in its order:

1. *forward timing* (``held["y"] = block(x)`` again and again): the new forward
   runs while the previous output still holds its graph, so the block's weights,
   **two** micro-batches' activations, ``x``, its upstream gradient and both outputs;
2. *forward + backward timing*: the first call's forward is again step 1's
   state; after it the backward has freed the graph and left the block's
   gradients and ``x.grad``: weights, gradients, one graph, four hidden-state tensors;
3. *embedding and head, forward and backward*: step 2's tensors (the graph
   freed), the embedding's and head's weights and gradients, their input,
   output and input gradient, and the fp32 logits;
4. *the AdamW step over the block*: the block's weights, gradients and both
   moments; the embedding's and head's weights and gradients; six hidden-state tensors.

The figure is the largest of the four. Parameters count at the bytes layerprof
holds them in: plain ``torch.optim.AdamW`` on parameters of the profile's dtype
keeps gradients and both moments in that dtype (no fp32 master copy), which at
fp32 is exactly the model's 4 + 4 + 8 bytes per parameter; activations, hidden
states and logits are the model's own terms. Layerprof's block is always the
reference trainer's SwiGLU block, so the figure is for a SwiGLU MLP. The model
leaves out, knowingly, the optimizer's temporaries (torch's default foreach
AdamW on an accelerator holds one more parameter-sized buffer: at most a quarter
of the block's 4 parameter-sized tensors), the RoPE cos/sin tables and the
allocator's rounding; :data:`TOLERANCE` covers them. A peak above it means the
model misses something real on that chip, and the planner scales the kind's
memory terms (not the runtime reserve) by the ratio; never down.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hetctl.plan.models import model_cost
from hetctl.plan.workload import Workload, elem_bytes, memory_terms

GB = 1e9
TOLERANCE = 1.25  # measured/analytic above this: scaled (the foreach temporary alone is ≤ 25 %, see above)


@dataclass(frozen=True)
class MemoryCheck:
    """A chip kind's profile peak against the model's figure for the same work.

    Attributes:
        analytic_gb: the model's figure for layerprof's peak (:func:`profile_peak`).
        peak_gb: what the device reported; None where it reports none (CPUs).
        phase: which of layerprof's steps the analytic peak falls in.
    """

    analytic_gb: float
    peak_gb: float | None
    phase: str

    @property
    def ratio(self) -> float | None:
        return None if self.peak_gb is None or self.analytic_gb <= 0 else self.peak_gb / self.analytic_gb

    @property
    def scale(self) -> float:
        """What the kind's memory terms are multiplied by: the ratio above :data:`TOLERANCE`, else 1."""
        r = self.ratio
        return r if r is not None and r > TOLERANCE else 1.0

    def line(self) -> str:
        """The ``--explain`` words (after ``memory:``)."""
        if self.ratio is None:
            return "no device peak reported; analytic"
        r = self.ratio
        used = f"scaled by {r:.3g}" if self.scale > 1.0 else "used analytic"
        return (f"analytic {self.analytic_gb:.3g} GB, profile peak {self.peak_gb:.3g} GB at the profile's shape "
                f"(ratio {r:.3g}): {used}")


def profile_peak(spec: Any, micro_batch: int, precision: str) -> dict[str, float]:
    """Bytes the memory model gives each of layerprof's four steps (module docstring) at this shape.

    ``spec``: a :class:`hetctl.files.plan.ModelSpec` of the profiled shape (``num_layers`` does not count).
    """
    cost = model_cost(spec.model_copy(update={"swiglu": True}))  # layerprof's Block is always SwiGLU
    t = memory_terms(Workload(cost=cost, micro_batch=micro_batch, global_batch=micro_batch), precision)
    eb = float(elem_bytes(precision))
    w_block, w_edges = cost.layer_params * eb, (cost.embed_params + cost.head_params) * eb
    act, hidden = t.act_layer, t.act_first  # one micro-batch's activations of one block; one hidden-state tensor
    return {
        "forward": w_block + 2 * act + 4 * hidden,
        "forward and backward": 2 * w_block + act + 4 * hidden,  # weights, gradients
        "embedding and head": 2 * w_block + 2 * w_edges + 7 * hidden + t.logits,
        "optimizer step": 4 * w_block + 2 * w_edges + 6 * hidden,  # weights, gradients, two moments
    }


def check(prof: Any, spec: Any) -> MemoryCheck:
    """Compare a :class:`hetctl.files.cluster.LayerProfile` measured at ``spec``'s shape with the model."""
    phases = profile_peak(spec, prof.micro_batch, prof.precision)
    phase = max(phases, key=lambda k: phases[k])
    return MemoryCheck(analytic_gb=phases[phase] / GB, peak_gb=prof.peak_memory_gb, phase=phase)


def strongest(checks: list[MemoryCheck | None]) -> MemoryCheck | None:
    """The check that scales most (then the highest ratio): what a kind of several chips or groups uses."""
    have = [c for c in checks if c is not None]
    return max(have, key=lambda c: (c.scale, c.ratio or 0.0, c.peak_gb is not None), default=None)
