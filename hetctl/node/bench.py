"""Node-side matmul benchmark for ``hetctl probe --bench`` (stdlib + torch).

Shipped like the collector: ``python3 - ARGS`` with this file on stdin, where
``ARGS`` is one JSON object::

    {"device_type": "cuda", "count": 8, "budget_s": 0.5, "plugin": null}

``plugin`` is the module that registers the device type with torch (``torch_npu``…),
from hetctl's vendor table; null when torch has it built in.

For each device ordinal ``0 .. count-1`` of ``device_type`` (cuda, npu, musa,
mlu, gcu, hpu, supa, cpu) it times square ``torch.matmul`` in fp32 and, where
the device runs them, bf16 and fp16, and prints one JSON object::

    {"device_type": "cuda", "torch": "2.4.0", "error": null,
     "results": [{"ordinal": 0, "tflops": {"fp32": 51.2, "bf16": 702.1, "fp16": 710.4},
                  "size": {"fp32": 8192, ...}, "errors": {}}]}

The matrix size grows from a small start until one multiply takes about a
twentieth of the time budget, then the multiply repeats for ``budget_s`` in a
few timed chunks, the median of which counts; a CPU node stays near one second
in total. A dtype that fails (no kernel, no
support) is listed under ``errors`` and left out of ``tflops``: nothing is ever
estimated or filled in. When torch or the device plugin is missing, ``error``
says so and ``results`` is empty.
"""

import json
import sys
import time


# (first size, largest size) per device class.
SIZES = {"cpu": (256, 2048)}
DEFAULT_SIZES = (1024, 8192)


def _first_line(exc):
    text = str(exc).strip().splitlines()
    return "%s: %s" % (type(exc).__name__, text[0] if text else "")


class Device:
    """A torch device of one type and ordinal, with the type's synchronize."""

    def __init__(self, torch, device_type, ordinal, plugin):
        self.torch = torch
        self.type = device_type
        self.name = device_type if device_type == "cpu" else "%s:%d" % (device_type, ordinal)
        self.ordinal = ordinal
        self.module = getattr(torch, device_type, None)
        self.plugin = plugin
        if device_type != "cpu" and self.module is not None and hasattr(self.module, "set_device"):
            self.module.set_device(ordinal)

    def sync(self):
        if self.type == "hpu" and hasattr(self.plugin, "mark_step"):
            self.plugin.mark_step()
        if self.type != "cpu" and hasattr(self.module, "synchronize"):
            self.module.synchronize()


def _timed(dev, a, b, c, count):
    """Seconds for ``count`` multiplies into ``c``, synchronised at both ends."""
    dev.sync()
    t0 = time.perf_counter()
    for _ in range(count):
        dev.torch.matmul(a, b, out=c)
    dev.sync()
    return time.perf_counter() - t0


def measure(dev, dtype, budget_s, chunks=5):
    """Return (TFLOPS, size) of square matmul of ``dtype`` on ``dev``.

    The size grows while the fastest of three single multiplies stays under a
    twentieth of the budget, and again when the timed chunks then run far faster
    than those multiplies foretold (all three were stalled). The budget is spent
    in ``chunks`` timed runs and the median one counts. Not the best: under a CPU quota (a container's limit,
    a cgroup) a short chunk can fall inside one period's allowance and run at full
    speed while the node as a whole runs at a tenth of it. Not the mean either: a
    CPU matmul whose threads lose their core stalls far beyond the time lost, and
    one such chunk would dominate.
    """
    torch = dev.torch
    n, n_max = SIZES.get(dev.type, DEFAULT_SIZES)
    while True:
        a = torch.randn(n, n, device=dev.name).to(dtype)
        b = torch.randn(n, n, device=dev.name).to(dtype)
        c = torch.matmul(a, b)  # warm-up: kernel selection, allocation
        one = max(min(_timed(dev, a, b, c, 1) for _ in range(3)), 1e-9)
        if one * 20 < budget_s and n < n_max:
            n *= 2
            continue
        # Fewer chunks when one multiply is already long, so the budget holds.
        count = max(1, min(chunks, int(budget_s / one)))
        per_chunk = max(1, int(budget_s / count / one))
        times = sorted(_timed(dev, a, b, c, per_chunk) for _ in range(count))
        median = times[len(times) // 2]
        # A chunk far shorter than its single multiplies foretold: those were
        # stalled, and a chunk this small fits in a quota's allowance. Grow.
        if median * 4 >= per_chunk * one or n >= n_max:
            return 2.0 * n ** 3 * per_chunk / median / 1e12, n
        n *= 2


def _native_bf16(torch):
    """Whether the CUDA device multiplies bf16 in hardware. Since torch 2.3 ``is_bf16_supported()``
    also says yes where bf16 is emulated (a V100), which would plan the chip at a slow bf16 rate
    instead of its fast fp16 one."""
    try:
        return torch.cuda.is_bf16_supported(including_emulation=False)
    except TypeError:  # older torch: no emulation, so its answer is the hardware's
        return torch.cuda.is_bf16_supported()


def bench(args):
    device_type = args.get("device_type", "cpu")
    count = int(args.get("count", 1))
    budget = float(args.get("budget_s", 0.3 if device_type == "cpu" else 0.5))
    report = {"device_type": device_type, "torch": None, "error": None, "results": []}
    plugin_name = args.get("plugin")
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - any import failure means "no torch"
        report["error"] = "torch is not importable: %s" % _first_line(e)
        return report
    report["torch"] = torch.__version__
    plugin = None
    if plugin_name:
        try:
            import importlib

            plugin = importlib.import_module(plugin_name)
        except Exception as e:  # noqa: BLE001
            report["error"] = "%s is not importable: %s" % (plugin_name, _first_line(e))
            return report
    module = getattr(torch, device_type, None)
    if device_type != "cpu":
        available = module is not None and getattr(module, "is_available", lambda: False)()
        if not available:
            report["error"] = "torch.%s is not available (torch %s)" % (device_type, torch.__version__)
            return report
        count = min(count, module.device_count())
    else:
        count = 1
    dtypes = [("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)]
    for ordinal in range(count):
        entry = {"ordinal": ordinal, "tflops": {}, "size": {}, "errors": {}}
        try:
            dev = Device(torch, device_type, ordinal, plugin)
        except Exception as e:  # noqa: BLE001
            entry["errors"]["device"] = _first_line(e)
            report["results"].append(entry)
            continue
        for key, dtype in dtypes:
            if key == "bf16" and device_type == "cuda" and not _native_bf16(torch):
                entry["errors"][key] = "no native bf16 on this device (torch would emulate it)"
                continue
            try:
                tflops, size = measure(dev, dtype, budget)
            except Exception as e:  # noqa: BLE001 - an unsupported dtype raises anything
                entry["errors"][key] = _first_line(e)
                continue
            entry["tflops"][key] = float("%.4g" % tflops)
            entry["size"][key] = size
        report["results"].append(entry)
    return report


def main(argv):
    try:
        args = json.loads(argv[1]) if len(argv) > 1 else {}
    except ValueError as e:
        sys.stderr.write("hetctl bench: bad argument JSON: %s\n" % e)
        return 2
    json.dump(bench(args), sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
