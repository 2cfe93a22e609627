"""Node-side layer profile for ``hetctl probe --bench --model M`` (stdlib + torch + hetctl.train).

Shipped like the benchmark: ``python3 - ARGS`` with this file on stdin, where
``ARGS`` is one JSON object::

    {"device_type": "cuda", "plugin": null, "precision": "bf16", "budget_s": 2.0,
     "micro_batch": 1, "spec": {"name": "tiny", "hidden_size": 256, ...}}

On device ordinal 0 it times the reference trainer's own units at the plan's
shapes and dtype (``hetctl.train.model``: one transformer ``Block``, the
``Embedding`` and the ``Head`` with its cross-entropy), forward and backward
separately, and one AdamW step over the block's parameters; and prints one JSON
object::

    {"error": null, "profile": {"layer_fwd_ms": 1.2, "layer_bwd_ms": 2.5, "head_fwd_ms": ...,
     "embed_fwd_ms": ..., "optimizer_ns_per_param": 3.1, "peak_memory_gb": null, "repeats": 12}}

Each figure is the median of five timed chunks of repeats that together fill a
quarter of the budget (a chunk spans a CPU quota's periods; one stalled chunk
does not count). ``peak_memory_gb`` is the
device's peak allocated memory where it reports one (CUDA-like modules), else
null. Nothing is estimated: a unit that fails is an ``error``.
"""

import json
import statistics
import sys
import time

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _first_line(exc):
    text = str(exc).strip().splitlines()
    return "%s: %s" % (type(exc).__name__, text[0] if text else "")


def _device(torch, device_type, plugin):
    if plugin:
        import importlib

        importlib.import_module(plugin)
    if device_type == "cpu":
        return torch.device("cpu"), (lambda: None), None
    module = getattr(torch, device_type, None)
    if module is None or not module.is_available():
        raise RuntimeError("torch.%s is not available (torch %s)" % (device_type, torch.__version__))
    module.set_device(0)
    peak = getattr(module, "max_memory_allocated", None)
    return torch.device("%s:0" % device_type), module.synchronize, peak


def _median_ms(fn, sync, budget_s, chunks=5):
    """Milliseconds of one ``fn()``: the median of ``chunks`` timed runs of k calls, k filling the budget.

    Chunks, not single calls: under a CPU quota (a container, a cgroup) a call of
    a millisecond fits inside one period's allowance and runs at full speed while
    the node as a whole does not; a chunk of a fifth of the budget spans periods.
    """
    fn()  # warm-up: kernel selection, allocation
    sync()
    one = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        sync()
        one = min(one, time.perf_counter() - t0)
    k = max(1, min(10000, int(budget_s / chunks / max(one, 1e-6))))
    times = []
    for _ in range(chunks):
        t0 = time.perf_counter()
        for _ in range(k):
            fn()
        sync()
        times.append((time.perf_counter() - t0) / k)
    return 1000.0 * statistics.median(times), k * chunks


def profile(args):
    import torch

    from hetctl.train.model import Block, Embedding, Head

    spec = dict(args["spec"])
    mb, seq = int(args["micro_batch"]), int(spec["seq_len"])
    dtype = getattr(torch, DTYPES[args.get("precision", "fp32")])
    budget = float(args.get("budget_s", 2.0)) / 4  # four timed parts share the budget
    dev, sync, peak = _device(torch, args.get("device_type", "cpu"), args.get("plugin"))
    torch.manual_seed(0)
    out = {}

    block = Block(spec).to(dev, dtype)
    x = torch.randn(mb, seq, spec["hidden_size"], device=dev, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)
    held = {}

    def layer_fwd():
        held["y"] = block(x)

    def layer_bwd():
        held["y"].backward(grad)

    def layer_both():
        layer_fwd()
        layer_bwd()

    # Forward alone, then the backward of a fresh forward each time (its graph is used once).
    out["layer_fwd_ms"], n = _median_ms(layer_fwd, sync, budget)
    both, _ = _median_ms(layer_both, sync, budget)
    out["layer_bwd_ms"] = max(both - out["layer_fwd_ms"], 0.0)

    emb = Embedding(spec).to(dev, dtype)
    head = Head({**spec, "tie_embeddings": False}).to(dev, dtype)  # a tied head projects the same way
    ids = torch.randint(0, spec["vocab_size"], (mb, seq), device=dev)
    hx = torch.randn(mb, seq, spec["hidden_size"], device=dev, dtype=dtype, requires_grad=True)

    def edge_both():
        emb(ids).sum().backward()
        logits = head(hx)
        torch.nn.functional.cross_entropy(logits.float().view(-1, logits.shape[-1]), ids.view(-1)).backward()

    edges, _ = _median_ms(edge_both, sync, budget)
    out["edges_fwd_bwd_ms"] = edges

    from hetctl.train.adamw import AdamW

    opt = AdamW(block.parameters(), lr=1e-4)  # the trainer's own optimizer
    for p in block.parameters():
        p.grad = torch.zeros_like(p)
    params = sum(p.numel() for p in block.parameters())
    step_ms, _ = _median_ms(opt.step, sync, budget)
    out["optimizer_ns_per_param"] = step_ms * 1e6 / max(params, 1)
    out["peak_memory_gb"] = (peak(dev) / 1e9) if peak else None
    out["repeats"] = n
    return {k: (float("%.4g" % v) if isinstance(v, float) else v) for k, v in out.items()}


def main(argv):
    args = json.loads(argv[0]) if argv else {}
    report = {"error": None, "profile": None}
    try:
        import torch  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means "no torch"
        report["error"] = "torch is not importable: %s" % _first_line(e)
        return report
    try:
        import hetctl.train.model  # noqa: F401
    except Exception as e:  # noqa: BLE001
        report["error"] = "the profile times hetctl's own layer: hetctl[train] is not importable (%s)" % _first_line(e)
        return report
    try:
        report["profile"] = profile(args)
    except Exception as e:  # noqa: BLE001 - a device or dtype that cannot run the layer raises anything
        report["error"] = _first_line(e)
    return report


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
