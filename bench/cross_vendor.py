"""Benchmark: compressed gradient sync across a shaped link between two "vendors" (issue 35).

Two replicas of one model (data parallel, PP=1), each one rank of ``python -m hetctl.train``
started with the rank contract ``hetctl launch`` sets (``tests/helpers/rankrunner.py``). The plan
labels replica 0 ``nvidia`` and replica 1 ``ascend``, so their gradient all-reduce is the
cross-vendor one: gloo over TCP, where ``--grad-compress`` applies. Replica 1 runs in a
network namespace of its own, joined to this one by a veth pair; both ends are shaped with
``tc``'s token bucket (``tbf``) to ``--rate`` (1 Gbit/s by default), and each rank's gloo binds
to its end (``GLOO_SOCKET_IFNAME``). Every gradient byte between the vendors crosses that link.

In one run, for ``--grad-compress none`` (the peer: what the run sends without
compression), ``bf16``, ``powersgd:4`` and ``int8``, it trains ``--steps`` steps and measures:

* the bytes across the link: the veth pair's own counters (every TCP byte each way,
  headers and retransmissions included), and the trainer's own count of the gradient
  bytes it sent across vendors (``xv_bytes``, its heartbeats);
* the step time: the median of the steady steps' ``step_ms`` on the last rank;
* the final loss: the validation loss after the last step (``--eval-iters`` held-out batches of
  the corpus, the same windows for every mode); one step's training loss moves by a few percent
  from batch to batch, more than the modes differ. The last 5 steps' mean training loss is shown
  beside it.

The data is the shipped ``tinyshakespeare.txt``, prepared by ``hetctl data prepare … --tokenizer
bytes`` (as ``bench/engine_quality.py`` does), read with ``--data``.

The model is small in arithmetic and large in gradient bytes (a 32,000-token vocabulary,
untied, over a 256-wide model of 2 layers: 18 M parameters, 72 MB of fp32 gradients a step),
as the embedding tables of a real model are (the bytes corpus uses 257 of the ids; the tables'
gradients are sent whole all the same), so that on a 2-CPU machine the link, not
the arithmetic, decides the step.

Requirements: root (network namespaces, ``tc``), ``ip`` and ``tc`` (iproute2), and a kernel
with the ``tbf`` qdisc. This machine's kernel has no ``netem``, so the link has no added
delay; ``--rate`` is its only shape. Nothing is simulated but the slow link itself.

Goals (issue 35): bytes across the link ≤ 25% of uncompressed for the best mode; its
final loss within 2% of uncompressed; its step time ≤ 0.6× uncompressed.

Last line: ``cross_vendor: bytes_ratio=<r> loss_gap=<pct> step_ratio=<r>`` for the best
mode (the fewest bytes among the modes that keep the loss within 2%).

    sudo python bench/cross_vendor.py                 # 1 Gbit/s, 30 steps, ~5 min
    sudo python bench/cross_vendor.py --rate 10gbit   # a faster link
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.engine_quality import prepare
from tests.helpers.rankrunner import Ranks, tiny_plan

MODES = ("none", "bf16", "powersgd:4", "powersgd:16", "int8")
MODEL = {"name": "xv-bench", "num_layers": 2, "hidden_size": 256, "ffn_hidden_size": 688, "num_attention_heads": 4,
         "num_query_groups": 4, "vocab_size": 32000, "seq_len": 64}
A_ADDR, B_ADDR = "10.231.0.1", "10.231.0.2"


def sh(*argv: str) -> None:
    r = subprocess.run(list(argv), capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"cross_vendor: `{' '.join(argv)}` failed: {r.stderr.strip() or r.stdout.strip()}")


class Link:
    """A veth pair between this namespace (end ``a``) and a new one (end ``b``), both ends shaped with tbf."""

    def __init__(self, rate: str) -> None:
        tag = uuid.uuid4().hex[:6]
        self.ns, self.a, self.b, self.rate = f"hxv-{tag}", f"hxa-{tag}", f"hxb-{tag}", rate

    def __enter__(self) -> "Link":
        sh("ip", "netns", "add", self.ns)
        try:
            sh("ip", "link", "add", self.a, "type", "veth", "peer", "name", self.b)
            sh("ip", "link", "set", self.b, "netns", self.ns)
            sh("ip", "addr", "add", f"{A_ADDR}/30", "dev", self.a)
            sh("ip", "link", "set", self.a, "up")
            sh("ip", "netns", "exec", self.ns, "ip", "addr", "add", f"{B_ADDR}/30", "dev", self.b)
            sh("ip", "netns", "exec", self.ns, "ip", "link", "set", self.b, "up")
            sh("ip", "netns", "exec", self.ns, "ip", "link", "set", "lo", "up")
            shape = ("root", "tbf", "rate", self.rate, "burst", "256kb", "limit", "32mb")
            sh("tc", "qdisc", "add", "dev", self.a, *shape)
            sh("ip", "netns", "exec", self.ns, "tc", "qdisc", "add", "dev", self.b, *shape)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        subprocess.run(["ip", "link", "del", self.a], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)

    def bytes(self) -> int:
        """Bytes through end ``a``, both ways (what crossed the link)."""
        stats = Path("/sys/class/net") / self.a / "statistics"
        return sum(int((stats / f).read_text()) for f in ("tx_bytes", "rx_bytes"))


class LinkedRanks(Ranks):
    """The ranks of the plan, replica 1's inside the link's namespace, each gloo on its end of the link."""

    def __init__(self, link: Link, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.link = link

    def env(self, r: dict[str, Any], port: int) -> dict[str, str]:
        env = super().env(r, port)
        env.update(MASTER_ADDR=A_ADDR, GLOO_SOCKET_IFNAME=self.link.b if r["replica"] == 1 else self.link.a)
        return env

    def argv(self, r: dict[str, Any]) -> list[str]:
        return (["ip", "netns", "exec", self.link.ns] if r["replica"] == 1 else []) + self.cmd


def two_vendor_plan(micro_batch: int, micro_batches: int) -> dict:
    plan = tiny_plan([MODEL["num_layers"]], dp=2, micro_batch=micro_batch, micro_batches=micro_batches, model=MODEL)
    for stage in plan["stages"]:
        stage["vendor"] = "nvidia" if stage["replica"] == 0 else "ascend"
    return plan


def run_mode(mode: str, o: argparse.Namespace, work: Path, data: Path) -> dict[str, float]:
    with Link(o.rate) as link:
        before = link.bytes()
        args = ("--grad-compress", mode, "--threads", "1", "--data", str(data), "--eval-every", str(o.steps),
                "--eval-iters", str(o.eval_iters), "--lr", repr(o.lr), "--warmup-steps", str(min(o.warmup_steps, o.steps - 1)),
                "--decay", "cosine")
        with LinkedRanks(link, two_vendor_plan(o.micro_batch, o.micro_batches), work / mode.replace(":", ""),
                         steps=o.steps, args=args) as ranks:
            ranks.start()
            codes = ranks.wait(o.timeout)
            if any(codes.values()):
                raise SystemExit(f"cross_vendor: {mode}: ranks exited {codes}\n{ranks.logs()}")
        wire = link.bytes() - before
    ms, losses = [], []
    for line in ranks.stdout(1).splitlines():
        if line.startswith("step="):
            f = dict(kv.split("=", 1) for kv in line.split())
            ms.append(float(f["step_ms"]))
            losses.append(float(f["loss"]))
    hb = ranks.heartbeat(1) or {}
    steady = ms[2:] or ms
    return {"wire": wire, "xv": float(hb.get("xv_bytes") or 0), "xv_raw": float(hb.get("xv_raw_bytes") or 0),
            "step_ms": statistics.median(steady), "loss": float(hb["eval_loss"]), "train": statistics.fmean(losses[-5:])}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", default="1gbit", help="the link's rate each way, as tc writes it (default 1gbit)")
    ap.add_argument("--steps", type=int, default=30, help="training steps per mode (default 30)")
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--micro-batches", type=int, default=1, help="per replica (default 1)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated (default {','.join(MODES)})")
    ap.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default 1e-3; cosine decay to a tenth)")
    ap.add_argument("--warmup-steps", type=int, default=10, help="linear warm-up (default 10)")
    ap.add_argument("--eval-iters", type=int, default=16,
                    help="held-out batches of the final validation loss, the loss compared (default 16)")
    ap.add_argument("--timeout", type=float, default=900.0, help="per mode, seconds")
    o = ap.parse_args(argv)
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if os.geteuid() != 0 or missing:
        print(f"cross_vendor: needs root and iproute2's ip and tc (missing: {', '.join(missing) or 'root'})",
              file=sys.stderr)
        return 2
    modes = [m.strip() for m in o.modes.split(",") if m.strip()]
    if "none" not in modes:
        modes.insert(0, "none")
    params = sum(v for v in (MODEL["vocab_size"] * MODEL["hidden_size"] * 2,
                             MODEL["num_layers"] * (4 * MODEL["hidden_size"] ** 2
                                                    + 3 * MODEL["hidden_size"] * MODEL["ffn_hidden_size"])))
    print(f"cross_vendor: 2 replicas (nvidia | ascend, one rank each, gloo across a veth pair shaped to {o.rate} "
          f"each way, no added delay), {params / 1e6:.1f} M parameters, {o.steps} steps, "
          f"micro-batch {o.micro_batch} x {o.micro_batches}, seq {MODEL['seq_len']}", flush=True)
    results = {}
    with tempfile.TemporaryDirectory(prefix="hetctl-xv-") as tmp:
        data = prepare(Path(tmp))  # the shipped corpus, by `hetctl data prepare` (bytes): a loss that means something
        for mode in modes:
            results[mode] = r = run_mode(mode, o, Path(tmp), data)
            print(f"  {mode:<11} link {r['wire'] / 1e6:9.1f} MB   trainer xv {r['xv'] / 1e6:8.1f} MB "
                  f"(of {r['xv_raw'] / 1e6:.1f} MB fp32)   step {r['step_ms']:8.1f} ms   validation loss {r['loss']:.4f} "
                  f"(train {r['train']:.4f})",
                  flush=True)
    base = results["none"]
    print(f"{'mode':<11} {'bytes ratio':>11} {'loss gap':>9} {'step ratio':>10}")
    rows = {}
    for mode, r in results.items():
        rows[mode] = (r["wire"] / base["wire"], 100 * (r["loss"] - base["loss"]) / base["loss"],
                      r["step_ms"] / base["step_ms"])
        print(f"{mode:<11} {rows[mode][0]:11.3f} {rows[mode][1]:+8.2f}% {rows[mode][2]:10.3f}")
    keep = [m for m in rows if m != "none" and rows[m][1] <= 2.0]
    best = min(keep or [m for m in rows if m != "none"] or ["none"], key=lambda m: rows[m][0])
    ratio, gap, step = rows[best]
    print(f"best mode: {best} (" + ("the fewest bytes of the modes within 2% of the loss)" if keep else
                                    "no mode kept the loss within 2%: the fewest bytes)"))
    print(f"cross_vendor: bytes_ratio={ratio:.3f} loss_gap={gap:+.2f}% step_ratio={step:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
