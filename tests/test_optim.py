"""The reference trainer's optimizer (hetctl.train.optim): schedule, weight-decay groups, global-norm clipping,
skipped non-finite steps, the resume check; and, on real processes, the clipped update of a pipeline against a
single-process torch loop, and a poisoned gradient skipped everywhere or ending the run.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import types
import warnings
from pathlib import Path

import pytest

from hetctl.errors import ConfigError
from hetctl.node import manifest
from hetctl.train import optim
from tests.helpers.rankrunner import TINY, Ranks, run_plan, tiny_plan

torch = pytest.importorskip("torch")


def cfg(*argv: str, steps: int = 20) -> optim.OptimConfig:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=steps)
    optim.add_args(ap)
    return optim.config(ap.parse_args(list(argv)), ap)


# --- the schedule ----------------------------------------------------------------------


def megatron_lr(style: str, lr: float, min_lr: float, warmup: int, decay: int, step: int) -> float:
    """Megatron-LM's own scheduler (megatron-core), after ``step`` increments: the LR of our step ``step``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    holder = types.SimpleNamespace(param_groups=[{}])
    s = OptimizerParamScheduler(holder, init_lr=0.0, max_lr=lr, min_lr=min_lr, lr_warmup_steps=warmup,
                                lr_decay_steps=decay, lr_decay_style=style, start_wd=0.1, end_wd=0.1,
                                wd_incr_steps=decay, wd_incr_style="constant")
    s.num_steps = step
    return s.get_lr({})


@pytest.mark.parametrize("style", ["cosine", "linear", "constant"])
def test_schedule_is_megatrons_bit_for_bit(style):
    pytest.importorskip("megatron.core")
    c = cfg("--lr", "3e-3", "--min-lr", "3e-4", "--warmup-steps", "5", "--decay", style, "--decay-steps", "30")
    got = [c.schedule.lr_at(s) for s in range(1, 41)]
    assert got == [megatron_lr(style, 3e-3, 3e-4, 5, 30, s) for s in range(1, 41)]
    assert got[0] == 3e-3 / 5 and got[4] == 3e-3  # warm-up from lr/N to lr
    if style != "constant":
        assert got[29:] == [3e-4] * 11 and len(set(got[5:29])) == 24  # decays, then holds --min-lr


def test_schedule_is_a_function_of_the_step_alone():
    """A resumed run rebuilds the schedule from its options: every step's LR is the undisturbed run's."""
    a = cfg("--decay", "cosine", "--warmup-steps", "3", steps=50)
    b = cfg("--decay", "cosine", "--warmup-steps", "3", steps=50)
    forward = [a.schedule.lr_at(s) for s in range(1, 51)]
    assert [b.schedule.lr_at(s) for s in range(50, 0, -1)][::-1] == forward
    assert cfg("--decay", "cosine", steps=50).schedule.lr_at(50) == 3e-3 / 10  # --min-lr defaults to lr/10


@pytest.mark.parametrize("argv, says", [
    (("--min-lr", "1"), "--min-lr 1 must be between 0 and --lr"),
    (("--decay", "cosine", "--warmup-steps", "20"), "--decay-steps 20 (default --steps) must be larger"),
    (("--clip-grad", "-1"), "--clip-grad must be >= 0"),
    (("--max-skipped-steps", "0"), "--max-skipped-steps must be >= 1"),
    (("--lr", "nan"), "--lr must be a positive number"),
    (("--initial-loss-scale", "1000"), "--initial-loss-scale 1000 must be a power of two from 1 to 2**32"),
    (("--initial-loss-scale", str(2.0 ** 40)), "must be a power of two from 1 to 2**32"),
    (("--loss-scale-window", "0"), "--loss-scale-window must be >= 1"),
])
def test_bad_options_are_one_line(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        cfg(*argv)
    assert e.value.code == 2 and says in capsys.readouterr().err


# --- weight decay groups ---------------------------------------------------------------


def test_decay_goes_to_2d_weights_only_the_same_on_any_split():
    from hetctl.train.model import build_units

    seen = {}
    for layers, first, last in (((0, 6), True, True), ((0, 2), True, False), ((2, 6), False, True)):
        units = build_units(TINY, layers, first, last, 1)
        groups = optim.param_groups(units)
        names = {id(p): f"{u}.{n}" for u, unit in units.items() for n, p in unit.named_parameters()}
        for g in groups:
            for p in g["params"]:
                assert seen.setdefault(names[id(p)], g["name"]) == g["name"]
    assert {n for n, g in seen.items() if g == "no_decay"} == (
        {f"layer-{i:05d}.{k}_norm.weight" for i in range(6) for k in ("attn", "mlp")} | {"head.norm.weight"})
    assert seen["embedding.tokens.weight"] == seen["layer-00003.q.weight"] == seen["head.out.weight"] == "decay"
    opt = optim.build(units, cfg("--weight-decay", "0.1"))
    assert [(g["name"], g["weight_decay"]) for g in opt.param_groups] == [("decay", 0.1), ("no_decay", 0.0)]


def test_checkpoint_state_does_not_depend_on_the_groups():
    """A stage's AdamW state saved from grouped parameters loads by name, and both go on identically."""
    from hetctl.train import ckpt
    from hetctl.train.model import build_units

    def trained(units, opt):
        for _ in range(2):
            opt.zero_grad()
            sum((p * p).sum() for p in units.parameters()).backward()
            opt.step()

    c = cfg("--weight-decay", "0.1")
    units = build_units(TINY, (0, 2), True, False, 1)
    opt = optim.build(units, c)
    trained(units, opt)
    snap = ckpt.snapshot(units, opt)
    blobs = {f"{n}.pt": _saved(payload) for n, payload in snap.items()} | {"state.json": b"{}"}
    again = build_units(TINY, (0, 2), True, False, 99)  # other weights until loaded
    opt2 = optim.build(again, c)
    ckpt.load(blobs, again, opt2)
    trained(units, opt)
    trained(again, opt2)
    for (n, a), b in zip(units.named_parameters(), again.parameters()):
        assert torch.equal(a, b), n


def test_the_trainers_adamw_is_torchs_bit_for_bit():
    """hetctl.train.adamw.AdamW against torch.optim.AdamW: same weights and state, in torch's format."""
    from hetctl.train.adamw import AdamW

    def run(make):
        gen = torch.Generator().manual_seed(7)
        params = [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in ((5, 3), (3,), (4, 4), (2,))]
        opt = make([{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:], "weight_decay": 0.0}],
                   lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
        for step in range(1, 6):
            for g in opt.param_groups:
                g["lr"] = 3e-3 * step / 5
            opt.zero_grad(set_to_none=step % 2 == 0)
            loss = sum((p * torch.arange(p.numel()).view_as(p)).pow(2).sum() for p in params[:-1])  # one has no grad
            loss.backward()
            opt.step()
        return params, opt

    mine, theirs = run(AdamW), run(torch.optim.AdamW)
    for a, b in zip(mine[0], theirs[0]):
        assert torch.equal(a, b)
    assert mine[0][-1] not in mine[1].state and theirs[0][-1] not in theirs[1].state
    for p, q in zip(mine[0][:-1], theirs[0][:-1]):
        sa, sb = mine[1].state[p], theirs[1].state[q]
        assert sa.keys() == sb.keys() == {"step", "exp_avg", "exp_avg_sq"}
        for k in sa:
            assert torch.equal(sa[k], sb[k]) and (sa[k].dtype, sa[k].device) == (sb[k].dtype, sb[k].device), k


@pytest.mark.e2e
def test_a_rank_builds_and_steps_without_importing_the_compiler():
    """A stage's units, optimizer and deterministic kernels leave torch._dynamo unimported (a second per rank)."""
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "from hetctl.train import optim\n"
        "from hetctl.train.adamw import deterministic\n"
        "from hetctl.train.model import StageModule, build_units\n"
        "from tests.helpers.rankrunner import TINY\n"
        "deterministic()\n"
        "assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()\n"
        "units = build_units(TINY, (0, TINY['num_layers']), True, True, 1)\n"
        "from tests.test_optim import cfg\n"
        "opt = optim.build(units, cfg())\n"
        "x = torch.randint(0, TINY['vocab_size'], (2, TINY['seq_len']))\n"
        "torch.nn.functional.cross_entropy(StageModule(units)(x).flatten(0, 1), x.flatten()).backward()\n"
        "opt.step(); opt.zero_grad()\n"
        "print(sorted(m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=str(Path(__file__).resolve().parents[1]))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", r.stdout


def _saved(payload) -> bytes:
    buf = io.BytesIO()
    torch.save(payload, buf)
    return buf.getvalue()


# --- the step: norm, clipping, skipping --------------------------------------------------


def one_process(units):
    """The topology fields the stepper reads, for one rank holding ``units`` (no TP, no replicas)."""
    return types.SimpleNamespace(rank=0, tp=1, unit_groups=tuple((n, (0,), "gloo") for n in units))


def with_grads(seed=1):
    from hetctl.train.model import StageModule, build_units

    units = build_units(TINY, (0, 6), True, True, seed)
    x = torch.randint(0, TINY["vocab_size"], (2, TINY["seq_len"]), generator=torch.Generator().manual_seed(seed))
    torch.nn.functional.cross_entropy(StageModule(units)(x).flatten(0, 1), x.flatten()).backward()
    return units


def test_clipping_is_torchs_clip_grad_norm():
    units, ref = with_grads(), with_grads()
    want = torch.nn.utils.clip_grad_norm_(list(ref.parameters()), 0.1)
    opt = optim.build(units, cfg("--clip-grad", "0.1"))
    applied = []
    done = optim.Stepper(cfg("--clip-grad", "0.1"), opt, units, one_process(units)).step(1, None,
                                                                                         lambda: applied.append(1))
    assert applied == [1] and done.applied and want > 0.1
    assert done.grad_norm == pytest.approx(float(want), rel=1e-6)
    for a, b in zip(units.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=0)


def test_a_non_finite_loss_or_norm_skips_and_k_in_a_row_stop():
    units = with_grads()
    c = cfg("--max-skipped-steps", "2")
    stepper = optim.Stepper(c, optim.build(units, c), units, one_process(units), poison=range(3, 4))
    applied, skipped = [], []
    before = [p.grad.clone() for p in units.parameters()]
    done = stepper.step(1, torch.tensor(float("nan")), lambda: applied.append(1), skipped.append)
    assert (done.applied, done.nonfinite, done.skipped_in_row, applied, skipped) == (False, "loss", 1, [], [1])
    assert done.metrics() == {"lr": 3e-3, "grad_norm": done.grad_norm, "skipped": 1, "nonfinite": "loss"}
    assert all(torch.equal(a, p.grad) for a, p in zip(before, units.parameters()))  # not even clipped
    assert stepper.step(2, torch.tensor(1.0), lambda: applied.append(2)).applied and applied == [2]
    with pytest.raises(optim.Diverged) as e:  # step 3's gradient is poisoned; then step 4's loss is inf
        stepper.step(3, torch.tensor(1.0), lambda: applied.append(3), skipped.append)
        stepper.step(4, torch.tensor(float("inf")), lambda: applied.append(4), skipped.append)
    assert applied == [2] and skipped == [1, 3, 4] and e.value.exit_code == 6
    assert "2 steps in a row (3-4) had a non-finite loss" in e.value.message


@pytest.mark.parametrize("precision, dtype", [("bf16", "bfloat16"), ("fp16", "float16"), ("fp32", "float32")])
def test_a_stages_autocast_keeps_fp32_weights_gradients_and_moments(precision, dtype):
    """``pipeline.autocast`` of a stage's precision (the CPU's autocast here; ``torch.autocast`` on an accelerator
    alike): 16-bit products, fp32 master weights, gradients and AdamW state."""
    from hetctl.train.model import StageModule, build_units
    from hetctl.train.pipeline import autocast

    units = build_units(TINY, (0, 2), True, False, 1)
    x = torch.randint(0, TINY["vocab_size"], (2, TINY["seq_len"]))
    seen = []
    units["layer-00000"].q.register_forward_hook(lambda mod, args, out: seen.append(out.dtype))
    with autocast(torch.device("cpu"), precision):
        y = StageModule(units)(x)
    assert seen == [getattr(torch, dtype)] and y.dtype == torch.float32  # 16-bit products, fp32 residual stream
    y.float().square().mean().backward()
    c = cfg()
    opt = optim.build(units, c)
    assert optim.Stepper(c, opt, units, one_process(units)).step(1, None, opt.step).applied
    assert {p.dtype for p in units.parameters()} == {p.grad.dtype for p in units.parameters()} == {torch.float32}
    assert {v.dtype for st in opt.state.values() for k, v in st.items() if k != "step"} == {torch.float32}


# --- the loss scale of fp16 stages ------------------------------------------------------


def test_the_loss_scale_halves_on_overflow_doubles_after_its_window_and_resumes_from_its_record():
    c = cfg("--initial-loss-scale", "1024", "--loss-scale-window", "2")
    s = optim.LossScaler(scale=c.initial_loss_scale, window=c.loss_scale_window)
    s.overflowed()
    assert (s.scale, s.good) == (512, 0)
    s.applied()
    assert (s.scale, s.good) == (512, 1)
    s.applied()
    assert (s.scale, s.good) == (1024, 0)
    s.applied()
    again, note = optim.LossScaler.resumed(json.loads(json.dumps(s.record())), c)
    assert again == s and note == ""
    for _ in range(20):
        s.overflowed()
    assert s.scale == 1.0  # never below 1
    for bad in (None, {"scale": 3.0, "good": 0}, {"scale": "x"}, {"scale": 2.0 ** 40, "good": 0}):
        fresh, note = optim.LossScaler.resumed(bad, c)
        assert (fresh.scale, fresh.good) == (1024, 0) and "starting at 1024" in note


def test_an_fp16_overflow_is_skipped_and_backed_off_not_counted_as_divergence_until_the_scale_is_1():
    units = with_grads()
    c = cfg("--max-skipped-steps", "1", "--initial-loss-scale", "4")
    scaler = optim.LossScaler(scale=4.0, window=c.loss_scale_window)
    stepper = optim.Stepper(c, optim.build(units, c), units, one_process(units), scaler=scaler)
    assert stepper.loss_scale() == 4.0
    grads = [p.grad.clone() for p in units.parameters()]
    stepper.unscale()
    assert all(torch.equal(p.grad, g / 4) for p, g in zip(units.parameters(), grads))  # a power of two: exact
    applied, skipped = [], []
    next(units.parameters()).grad.view(-1)[0] = float("inf")  # what an fp16 gradient that overflowed becomes
    for step, scale in ((1, 2.0), (2, 1.0)):
        done = stepper.step(step, torch.tensor(1.0), lambda: applied.append(step), skipped.append)
        assert (done.applied, done.nonfinite, done.skipped_in_row) == (False, "fp16-overflow", 0)
        assert done.metrics()["loss_scale"] == scale == stepper.loss_scale()
    with pytest.raises(optim.Diverged):  # at a scale of 1 the overflow is the model's, not the scale's
        stepper.step(3, torch.tensor(1.0), lambda: applied.append(3), skipped.append)
    assert applied == [] and skipped == [1, 2, 3]


# --- the resume check ------------------------------------------------------------------


def test_resume_refuses_another_schedule_but_allows_a_longer_run_with_explicit_decay_steps():
    rec = cfg("--decay", "cosine", "--warmup-steps", "2", steps=20).record()
    with pytest.raises(ConfigError, match="decay_steps=20, this run has 40") as e:
        optim.check_resume(rec, cfg("--decay", "cosine", "--warmup-steps", "2", steps=40), "ck/step-10")
    assert "--decay-steps 20" in e.value.hint
    assert optim.check_resume(rec, cfg("--decay", "cosine", "--warmup-steps", "2", "--decay-steps", "20",
                                       steps=40), "ck") == []
    with pytest.raises(ConfigError, match="lr=0.003, this run has 0.001"):
        optim.check_resume(rec, cfg("--decay", "cosine", "--warmup-steps", "2", "--lr", "1e-3"), "ck")
    with pytest.raises(ConfigError, match="decay=cosine, this run has linear"):
        optim.check_resume(rec, cfg("--decay", "linear", "--warmup-steps", "2"), "ck")
    assert optim.check_resume(rec, cfg("--decay", "cosine", "--warmup-steps", "2", "--clip-grad", "0.5"),
                              "ck") == ["clip_grad 1 -> 0.5"]
    # A constant schedule does not depend on the run's length.
    assert optim.check_resume(cfg(steps=20).record(), cfg(steps=40), "ck") == []
    # A checkpoint from before schedules (constant --lr, no clipping): continued only at a constant lr.
    legacy = {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0}
    assert optim.check_resume(legacy, cfg(), "ck") == ["weight_decay 0 -> 0.1", "clip_grad 0 -> 1"]
    with pytest.raises(ConfigError, match="decay=constant, this run has cosine"):
        optim.check_resume(legacy, cfg("--decay", "cosine"), "ck")


# --- real ranks --------------------------------------------------------------------------

CLIP = 0.2  # the tiny model's gradient norm is about 1 early on: every step clips


def reference(steps: int, global_micro: int, micro_batch: int, seed: int = 1234):
    """The whole model in one process with plain torch: clip_grad_norm_, AdamW over hand-made groups."""
    from hetctl.train import data
    from hetctl.train.model import StageModule, build_units

    units = build_units(TINY, (0, TINY["num_layers"]), True, True, seed)
    model = StageModule(units)
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim > 1], "weight_decay": 0.1},
                             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                            lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
    norms = []
    for step in range(1, steps + 1):
        opt.zero_grad()
        for m in range(global_micro):
            x, y = data.micro_batch(seed, step, 0, m, micro_batch, global_micro, TINY["seq_len"], TINY["vocab_size"])
            logits = model(x).float()
            (torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()) / global_micro).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, CLIP)))
        opt.step()
    return units, opt, norms


def printed(run, field: str) -> dict[int, float]:
    out = {}
    for line in run.stdout(run.last_rank()).splitlines():
        if line.startswith("step="):
            kv = dict(x.split("=", 1) for x in line.split())
            out[int(kv["step"])] = float(kv[field])
    return out


@pytest.mark.e2e
@pytest.mark.parametrize("split, dp, tp", [([2, 2, 2], 1, 1), ([3, 3], 2, 1), ([3, 3], 1, 2)],
                         ids=["pp3", "pp2-dp2", "pp2-tp2"])
def test_clipped_pipeline_update_equals_one_process(tmp_path, split, dp, tp):
    steps = 3
    run = run_plan(tiny_plan(split, dp=dp, tp=tp, micro_batches=4 // dp), tmp_path, steps=steps, ckpt_every=steps,
                   args=("--clip-grad", str(CLIP), "--weight-decay", "0.1"))
    units, opt, norms = reference(steps, 4, 2)
    assert min(norms) > CLIP  # clipping acted on every step
    got = printed(run, "grad_norm")
    assert [got[s] for s in range(1, steps + 1)] == pytest.approx(norms, rel=2e-5)  # printed with 6 digits
    d = manifest.step_dir(run.ckpt_dir, steps)
    # Under TP the layers' sums run in another order, and AdamW's normalised update magnifies the rounding of
    # near-zero gradients (up to lr per step where a gradient's sign flips); the first moment is the clipped
    # gradients' own average, linear in them, so it is held to the rounding of the sums. A wrong shard or a
    # missed clip moves whole tensors by about lr (3e-3) per step, far outside either tolerance.
    atol = 1e-4 if tp > 1 else 1e-6
    for name, unit in units.items():
        saved = torch.load(d / f"{name}.pt", weights_only=True)
        for k, v in unit.state_dict().items():
            torch.testing.assert_close(saved["params"][k], v, rtol=1e-5, atol=atol, msg=lambda m, n=f"{name}.{k}": f"{n}: {m}")
        for k, p in unit.named_parameters():
            torch.testing.assert_close(saved["optim"][k]["exp_avg"], opt.state[p]["exp_avg"], rtol=1e-4,
                                       atol=1e-6 if tp > 1 else 1e-8,
                                       msg=lambda m, n=f"{name}.{k}": f"{n} exp_avg: {m}")
    rec = json.loads((d / "state.json").read_text())["optimizer"]
    assert (rec["clip_grad"], rec["decay"], rec["weight_decay"]) == (CLIP, "constant", 0.1)


@pytest.mark.e2e
def test_a_poisoned_gradient_skips_the_step_on_every_rank(tmp_path, monkeypatch):
    """Rank 0 (stage 0 of replica 0) alone gets a NaN at step 3: every rank skips it, jit writer included."""
    monkeypatch.setenv("HETCTL_TEST_NAN_GRAD", "3")
    run = run_plan(tiny_plan([3, 3], dp=2, micro_batches=2), tmp_path, steps=4, ckpt_every=1)
    lines = run.stdout(run.last_rank()).splitlines()
    assert any(ln.startswith("step=3 ") and "grad_norm=nan" in ln and "skipped=non-finite-grad_norm in_a_row=1" in ln
               for ln in lines), lines
    assert all(run.heartbeat(r)["skipped"] == 1 for r in range(4))
    assert math.isfinite(printed(run, "loss")[4])  # step 4 trains on
    s2, s3 = (manifest.step_dir(run.ckpt_dir, s) for s in (2, 3))
    for name in ["embedding", "head"] + [f"layer-{i:05d}" for i in range(6)]:
        a, b = (torch.load(d / f"{name}.pt", weights_only=True) for d in (s2, s3))
        for k in a["params"]:
            assert torch.equal(a["params"][k], b["params"][k]), (name, k)
        for p in a["optim"]:
            assert all(torch.equal(a["optim"][p][x], b["optim"][p][x]) for x in a["optim"][p]), (name, p)


@pytest.mark.e2e
def test_k_poisoned_steps_in_a_row_stop_every_rank_with_exit_6(tmp_path, monkeypatch):
    monkeypatch.setenv("HETCTL_TEST_NAN_GRAD", "2:3")
    with Ranks(tiny_plan([3, 3]), tmp_path, steps=10, args=("--max-skipped-steps", "3")) as ranks:
        codes = ranks.start().wait(180)
        assert codes == {0: 6, 1: 6}, ranks.logs()
        for r in codes:
            err = ranks.stderr(r)
            assert "hetctl.train: error: training diverged: 3 steps in a row (2-4) had a non-finite grad_norm" in err
            assert "Traceback" not in err
