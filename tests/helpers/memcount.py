"""What a CUDA device's ``max_memory_allocated`` would report for ``layerprof``, counted on the CPU.

There is no accelerator on the dev machine, so the CUDA-like profile fixtures
(``tests/fixtures/profiles/cuda-mid.json``) take their ``peak_memory_gb`` from
this counter: ``hetctl/node/layerprof.py``'s own ``profile()`` runs on the CPU
under a dispatch mode that adds up the bytes of every live tensor storage (each
storage once, released when torch frees it) and keeps the largest sum, with the
two things a CUDA device does differently from the CPU made to match:

- torch's AdamW takes its ``foreach`` implementation (the default on CUDA; the
  CPU default is the per-tensor loop, with smaller temporaries);
- each storage counts rounded up to 512 bytes (the CUDA caching allocator's
  block size, which ``max_memory_allocated`` counts).

What it does not see: memory a CUDA kernel takes that is not a tensor storage
(cuBLAS workspaces), and kernels that save different tensors on CUDA than on
the CPU (attention picks its own kernel per device).

    python -m tests.helpers.memcount SPEC_JSON MICRO_BATCH PRECISION   # prints the peak in bytes
"""

from __future__ import annotations

import json
import sys
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

BLOCK = 512  # bytes: the CUDA caching allocator's smallest block


class LiveBytes(TorchDispatchMode):
    """Bytes of the live storages created under the mode, and their peak."""

    def __init__(self) -> None:
        super().__init__()
        self.current = self.peak = 0
        self._live: dict[int, int] = {}

    def _freed(self, key: int) -> None:
        self.current -= self._live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key == 0 or key in self._live:  # empty, or a view / in-place result of a counted storage
                continue
            size = -(-storage.nbytes() // BLOCK) * BLOCK
            self._live[key] = size
            self.current += size
            self.peak = max(self.peak, self.current)
            weakref.finalize(storage, self._freed, key)
        return out


def layerprof_peak(spec: dict[str, Any], micro_batch: int, precision: str) -> int:
    """The peak bytes of one ``layerprof.profile`` run at this shape, as above."""
    from hetctl.node import layerprof

    args = {"device_type": "cpu", "plugin": None, "precision": precision, "budget_s": 0.0,
            "micro_batch": micro_batch, "spec": spec}
    adamw = torch.optim.AdamW
    torch.optim.AdamW = lambda params, **kw: adamw(params, foreach=True, **kw)  # type: ignore[misc]
    try:
        with LiveBytes() as count:
            layerprof.profile(args)
    finally:
        torch.optim.AdamW = adamw  # type: ignore[misc]
    return count.peak


if __name__ == "__main__":
    print(layerprof_peak(json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3]))
