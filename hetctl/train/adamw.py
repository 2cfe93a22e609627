"""AdamW for the ranks, without the second and a half of compiler import that torch's class costs.

``torch.optim.Optimizer.__init__`` imports ``torch._dynamo`` (and with it most of
``torch._inductor``'s configuration) to guard its hooks against compilation: about
1.3 s of CPU in every rank process on this machine, more than the training of a
short test run. The arithmetic is not in the class: it is the functional
``torch.optim.adam.adam``, which imports nothing more. :class:`AdamW` keeps the
parameter groups and per-parameter state in torch's own layout
(``param_groups[i]["lr"]``, ``state[p] = {"step", "exp_avg", "exp_avg_sq"}``, the
step counter a CPU scalar of torch's scalar dtype) and calls that function as ``torch.optim.AdamW``
does, with torch's choice of the foreach kernels per device. The updates are the
same bit for bit (``tests/test_optim.py``), and so are the checkpoints.

:func:`deterministic` is ``torch.use_deterministic_algorithms(True, warn_only=True)``
without the import of the inductor configuration that the public call makes to
mirror the flag there; the ranks never compile.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch


class AdamW:
    """Decoupled-weight-decay Adam over parameter groups, in ``torch.optim.AdamW``'s state format.

    Args:
        params: parameters, or groups (dicts with ``params`` and any of the defaults below).
        lr, betas, eps, weight_decay: the defaults of every group (torch's own defaults).
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2) -> None:
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        items = list(params)
        groups = items if items and isinstance(items[0], Mapping) else [{"params": items}]
        self.param_groups: list[dict[str, Any]] = [{**defaults, **g, "params": list(g["params"])} for g in groups]
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear every parameter's gradient: drop it (``set_to_none``) or zero it in place."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_()
                    p.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        """One AdamW update of every parameter that has a gradient (state made on its first)."""
        from torch.optim.adam import adam
        from torch.optim.optimizer import _get_scalar_dtype

        for group in self.param_groups:
            params, grads, avgs, sqs, steps = [], [], [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state.get(p)
                if not state:
                    state = self.state[p] = {
                        "step": torch.tensor(0.0, dtype=_get_scalar_dtype()),  # on the CPU, as torch keeps it
                        "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                        "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                    }
                params.append(p)
                grads.append(p.grad)
                avgs.append(state["exp_avg"])
                sqs.append(state["exp_avg_sq"])
                steps.append(state["step"])
            if not params:
                continue
            beta1, beta2 = group["betas"]
            adam(params, grads, avgs, sqs, [], steps, foreach=None, has_complex=False, decoupled_weight_decay=True,
                 amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
                 eps=group["eps"], maximize=False)


def deterministic() -> None:
    """Deterministic kernels, warnings only where an op has none (``use_deterministic_algorithms``)."""
    setter = getattr(torch._C, "_set_deterministic_algorithms", None)
    if setter is None:  # another torch: the public call, which imports the compiler's configuration
        torch.use_deterministic_algorithms(True, warn_only=True)
        return
    setter(True, warn_only=True)
