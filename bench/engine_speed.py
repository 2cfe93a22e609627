"""Benchmark: the reference engine's training speed against a plain, tuned torch loop, same model and batch.

In one run, on one device:

(a) **hetctl's engine** at PP=1: one real rank of ``python -m hetctl.train`` with
    the rank contract ``hetctl launch`` sets (``tests/helpers/rankrunner.py``), on a
    one-stage plan of the model; its final heartbeat gives the mean step time
    (the first step, warm-up, left out);
(b) **the peer**: a single-process loop written here, independent of hetctl's
    code: the same architecture (Llama: RMSNorm, RoPE, GQA attention through
    ``scaled_dot_product_attention``, SwiGLU, untied head), the same batch shape
    and step count, AdamW (fused on CUDA, foreach elsewhere), bf16 autocast on
    accelerators, ``torch.compile`` of the model where ``--compile`` asks and it
    works. The same number of CPU threads as the engine's rank.

Printed: tokens/s of each, their ratio, and MFU = model FLOPs per second ÷ the
device's measured matmul rate (bf16 on accelerators, fp32 on CPU), and ÷ its
datasheet peak where hetctl's chip table knows the device. Model FLOPs per token
are ``6·N + 12·L·h·s`` (N: matmul parameters, head included, embedding lookup
excluded; the attention term as PaLM counts it).

From the repository root::

    python bench/engine_speed.py                          # CPU: a small model, 1 thread
    python bench/engine_speed.py --device cuda --model scripts/model-1b.yaml --micro-batch 8

Goals (issue 30): on CPU engine ≥ 0.95× the plain loop; on a GPU ≥ 0.9× and MFU
vs datasheet ≥ 40% for a 1 B model. The last line, for scripts:
``engine_speed: device=<name> mfu=<pct> vs_peer=<ratio>``.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from tests.helpers.rankrunner import Ranks, tiny_plan  # noqa: E402

CPU_MODEL = {"name": "cpu-bench", "num_layers": 4, "hidden_size": 256, "ffn_hidden_size": 688,
             "num_attention_heads": 8, "num_query_groups": 4, "vocab_size": 2048, "seq_len": 128}


# --- the peer: a plain Llama, written for this bench -------------------------------------------------
class _Norm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.w, self.eps = nn.Parameter(torch.ones(d)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.w


def _rope(s: int, d: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / theta ** (torch.arange(0, d, 2, device=device).float() / d)
    ang = torch.outer(torch.arange(s, device=device).float(), inv)
    ang = torch.cat((ang, ang), -1)
    return ang.cos(), ang.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, -1)
    return x * cos + torch.cat((-b, a), -1) * sin


class _Block(nn.Module):
    def __init__(self, m: dict) -> None:
        super().__init__()
        h, self.nh = m["hidden_size"], m["num_attention_heads"]
        self.ng, self.hd = m.get("num_query_groups") or self.nh, h // self.nh
        self.n1, self.n2 = _Norm(h), _Norm(h)
        self.qkv = nn.Linear(h, (self.nh + 2 * self.ng) * self.hd, bias=False)
        self.o = nn.Linear(h, h, bias=False)
        self.gu = nn.Linear(h, 2 * m["ffn_hidden_size"], bias=False)
        self.down = nn.Linear(m["ffn_hidden_size"], h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(self.n1(x)).split([self.nh * self.hd, self.ng * self.hd, self.ng * self.hd], -1)
        q = _rotate(q.view(b, s, self.nh, self.hd).transpose(1, 2), cos, sin)
        k = _rotate(k.view(b, s, self.ng, self.hd).transpose(1, 2), cos, sin)
        v = v.view(b, s, self.ng, self.hd).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.ng != self.nh)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, -1))
        g, u = self.gu(self.n2(x)).chunk(2, -1)
        return x + self.down(F.silu(g) * u)


class PlainLlama(nn.Module):
    def __init__(self, m: dict) -> None:
        super().__init__()
        self.emb = nn.Embedding(m["vocab_size"], m["hidden_size"])
        self.blocks = nn.ModuleList(_Block(m) for _ in range(m["num_layers"]))
        self.norm = _Norm(m["hidden_size"])
        self.head = nn.Linear(m["hidden_size"], m["vocab_size"], bias=False)
        self.theta = float(m.get("rope_theta") or 10000.0)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, 0.0, 0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        cos, sin = _rope(ids.shape[1], x.shape[-1] // self.blocks[0].nh, self.theta, ids.device)
        for blk in self.blocks:
            x = blk(x, cos, sin)
        return self.head(self.norm(x))


def peer_tokens_per_s(m: dict, device: torch.device, mb: int, micro: int, steps: int, bf16: bool,
                      compile_: bool) -> tuple[float, float, str]:
    """Mean tokens/s of the plain loop over ``steps`` (the first step left out), its last loss, and what ran."""
    torch.manual_seed(0)
    model = PlainLlama(m).to(device)
    what = "eager"
    fwd = model
    if compile_:
        try:
            fwd = torch.compile(model)
            what = "compiled"
        except Exception as e:  # noqa: BLE001 - a backend without compile runs eager, and says so
            what = f"eager (compile failed: {type(e).__name__})"
    fused = {"fused": True} if device.type == "cuda" else {"foreach": True}
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.0, **fused)
    seq, vocab = m["seq_len"], m["vocab_size"]
    gen = torch.Generator(device="cpu").manual_seed(1)
    data = torch.randint(0, vocab, (micro, mb, seq + 1), generator=gen).to(device)
    amp = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else torch.autocast("cpu", enabled=False)
    times, loss = [], None
    for _ in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        total = torch.zeros((), device=device)
        for i in range(micro):
            with amp:
                logits = fwd(data[i, :, :-1])
                lo = F.cross_entropy(logits.float().reshape(-1, vocab), data[i, :, 1:].reshape(-1)) / micro
            lo.backward()
            total += lo.detach()
        opt.step()
        loss = float(total.item())  # one host sync a step, as the engine's loss report
        _sync(device)
        times.append(time.perf_counter() - t0)
    steady = times[1:] or times
    return mb * micro * seq / (sum(steady) / len(steady)), loss, what


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.get_device_module(device.type).synchronize()


# --- the engine ----------------------------------------------------------------------------------------
def engine_plan(m: dict, device: str, mb: int, micro: int, precision: str) -> dict:
    """The one-stage plan of ``m`` (rankrunner's plan builder), its stage moved to ``device``."""
    plan = tiny_plan([m["num_layers"]], micro_batch=mb, micro_batches=micro, model=m)
    if device != "cpu":
        plan["stages"][0].update(vendor="nvidia", chips=[0], device_type=device)
    plan["stages"][0]["precision"] = precision
    return plan


def engine_tokens_per_s(m: dict, device: str, mb: int, micro: int, steps: int, precision: str, threads: int,
                        work: Path) -> tuple[float, float]:
    plan = engine_plan(m, device, mb, micro, precision)
    with Ranks(plan, work, steps=steps, run_id="engine-speed", args=("--threads", str(threads))) as ranks:
        ranks.start()
        codes = ranks.wait(3600)
        if any(codes.values()):
            raise SystemExit(f"the engine failed: exit codes {codes}\n{ranks.logs()}")
        hb = ranks.heartbeat(0)
    return float(hb["tokens_per_s"]), float(hb["loss"])


# --- FLOPs and the device's rates ----------------------------------------------------------------------
def flops_per_token(m: dict) -> float:
    h, f, L, s = m["hidden_size"], m["ffn_hidden_size"], m["num_layers"], m["seq_len"]
    heads = m["num_attention_heads"]
    kv = (m.get("num_query_groups") or heads) * (h // heads)
    per_layer = h * h * 2 + 2 * h * kv + 3 * h * f
    n = L * per_layer + h * m["vocab_size"]
    return 6.0 * n + 12.0 * L * h * s


def measured_matmul_tflops(device: torch.device, bf16: bool) -> float:
    n = 8192 if device.type != "cpu" else 1024
    dt = torch.bfloat16 if bf16 else torch.float32
    a, b = torch.randn(n, n, device=device, dtype=dt), torch.randn(n, n, device=device, dtype=dt)
    for _ in range(3):
        a @ b
    _sync(device)
    reps, t0 = 20 if device.type != "cpu" else 10, time.perf_counter()
    for _ in range(reps):
        a @ b
    _sync(device)
    return 2 * n ** 3 * reps / (time.perf_counter() - t0) / 1e12


def datasheet_tflops(device: torch.device, bf16: bool) -> tuple[str, float | None]:
    if device.type == "cpu":
        return "cpu", None
    name = torch.get_device_module(device.type).get_device_name(device)
    from hetctl.probe import specs

    row = specs.lookup("nvidia" if device.type == "cuda" else device.type, name)
    if row is None:
        return name, None
    t = row.tflops
    return name, (t.bf16 if bf16 else t.fp32) if t else None


def load_spec(arg: str | None) -> dict:
    if not arg:
        return dict(CPU_MODEL)
    from hetctl.plan.models import load_model

    return load_model(arg).model_dump(mode="json", exclude_none=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", help="cpu, cuda… (default cpu)")
    ap.add_argument("--model", help="a preset name or model file (default: a small CPU model)")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--micro-batches", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8, help="steps of each (the first is warm-up)")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads of each (default 1, the engine's rank default)")
    ap.add_argument("--compile", action="store_true", help="torch.compile the peer's model where it works")
    ap.add_argument("--pairs", type=int, default=2, help="engine/peer pairs, alternating order; medians are compared")
    o = ap.parse_args()
    m = load_spec(o.model)
    device = torch.device(o.device)
    bf16 = device.type != "cpu"
    torch.set_num_threads(o.threads)
    tokens = o.micro_batch * o.micro_batches * m["seq_len"]
    print(f"engine speed on {device.type} ({os.cpu_count()} CPUs, {o.threads} thread(s) each), model {m.get('name')}: "
          f"{m['num_layers']} layers, hidden {m['hidden_size']}, seq {m['seq_len']}; {tokens} tokens a step "
          f"({o.micro_batches} x {o.micro_batch}), {o.steps} steps; load average {os.getloadavg()[0]:.2f}", flush=True)
    engs, peers = [], []
    with tempfile.TemporaryDirectory(prefix="hetctl-bench-engine-") as tmp:
        for pair in range(o.pairs):
            for who in (("engine", "peer") if pair % 2 == 0 else ("peer", "engine")):
                if who == "engine":
                    eng, eng_loss = engine_tokens_per_s(m, device.type, o.micro_batch, o.micro_batches, o.steps,
                                                        "bf16" if bf16 else "fp32", o.threads, Path(tmp) / str(pair))
                    engs.append(eng)
                else:
                    peer, peer_loss, what = peer_tokens_per_s(m, device, o.micro_batch, o.micro_batches, o.steps, bf16,
                                                              o.compile)
                    peers.append(peer)
            print(f"  pair {pair + 1}: engine {engs[-1]:.1f}, peer {peers[-1]:.1f} tokens/s", flush=True)
    eng, peer = statistics.median(engs), statistics.median(peers)
    fpt = flops_per_token(m)
    rate = measured_matmul_tflops(device, bf16)
    name, sheet = datasheet_tflops(device, bf16)
    mfu = eng * fpt / 1e12 / rate
    print(f"  engine (PP=1):  {eng:12.1f} tokens/s (median), final loss {eng_loss:.4f}")
    print(f"  peer ({what}): {peer:12.1f} tokens/s (median), final loss {peer_loss:.4f} (its own random tokens)")
    print(f"  model {fpt / 1e9:.3f} GFLOP a token; {'bf16' if bf16 else 'fp32'} matmul measured {rate:.2f} TFLOPS"
          + (f", datasheet {sheet:.0f} TFLOPS" if sheet else ", no datasheet figure"))
    print(f"  MFU vs measured matmul: engine {mfu:.1%}, peer {peer * fpt / 1e12 / rate:.1%}"
          + (f"; vs datasheet: engine {eng * fpt / 1e12 / sheet:.1%}" if sheet else ""))
    ratio = eng / peer
    goal = 0.95 if device.type == "cpu" else 0.9
    print(f"  engine / peer: {ratio:.3f} (goal >= {goal}: {'met' if ratio >= goal else 'not met'})")
    shown = mfu if not sheet else eng * fpt / 1e12 / sheet
    print(f"engine_speed: device={name.replace(' ', '_')} mfu={shown * 100:.1f} vs_peer={ratio:.3f}")
    if not math.isfinite(eng_loss) or not math.isfinite(peer_loss):
        raise SystemExit("a loss was not finite")


if __name__ == "__main__":
    main()
