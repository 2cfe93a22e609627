"""ZB-H1 in the reference trainer: weight gradients held back for W passes, the plan's order on real ranks.

In one process, a block's gradients with the weight gradients deferred (:mod:`hetctl.train.zbstore`) equal
its ordinary backward's. On real processes over gloo, a three-stage ZB-H1 plan (each stage holding back
as many W passes as its stage number, and none) trains the same losses as one rank with all the layers:
the W passes run oldest first, so every weight gradient is summed in micro-batch order as under 1F1B.
The order itself is the planner's (:func:`hetctl.plan.zerobubble.schedule_zbh1`), checked here for what
the trainer relies on: every operation once, a W after its B, and no more micro-batches held than the
plan's memory figure counts.
"""

from __future__ import annotations

import signal

import pytest

from hetctl.errors import ConfigError
from hetctl.files.plan import Plan
from hetctl.node import manifest as checkpoint
from hetctl.plan.simulate import BWD, FWD, simulate_1f1b
from hetctl.plan.zerobubble import WGT, peak_in_flight, schedule_zbh1, simulate_zbh1
from tests.helpers.rankrunner import TINY, Ranks, run_plan, tiny_plan

torch = pytest.importorskip("torch")

STEPS = 12


@pytest.mark.parametrize("p, m, d", [(1, 4, 0), (3, 4, 2), (4, 8, 1), (4, 2, 3), (6, 12, 5), (5, 5, 0)])
def test_order_runs_each_op_once_w_after_b_and_holds_what_memory_counts(p, m, d):
    for s in range(p):
        order = schedule_zbh1(s, p, m, min(d, s))
        for kind in (FWD, BWD, WGT):
            assert sorted(i for k, i in order if k == kind) == list(range(m))
        held = peak = 0
        pos = {op: n for n, op in enumerate(order)}
        for k, _ in order:
            held += k == FWD
            held -= k == WGT
            peak = max(peak, held)
        assert all(pos[(FWD, i)] < pos[(BWD, i)] < pos[(WGT, i)] for i in range(m))
        assert peak == peak_in_flight(s, p, m, min(d, s))


def test_equal_stages_reach_the_papers_bubble_and_no_w_is_1f1b():
    p, m, f, b, w = 4, 8, 1.0, 1.0, 1.0
    zb = simulate_zbh1([f] * p, [b] * p, [w] * p, m, list(range(p)))
    assert zb.makespan == pytest.approx(m * (f + b + w) + (p - 1) * (f + b - w))  # Qi et al., ZB-H1
    plain = simulate_1f1b([f] * p, [b + w] * p, m)
    assert plain.makespan == pytest.approx((m + p - 1) * (f + b + w)) and zb.makespan < plain.makespan
    same = simulate_zbh1([0.3, 0.5, 0.2], [0.7, 0.4, 0.9], [0.0] * 3, 6, [0, 0, 0])
    assert same.makespan == pytest.approx(simulate_1f1b([0.3, 0.5, 0.2], [0.7, 0.4, 0.9], 6).makespan)


@pytest.mark.parametrize("bias", [False, True], ids=["llama", "qkv-bias"])
def test_deferred_weight_gradients_equal_the_ordinary_backward(bias):
    from hetctl.train import zbstore
    from hetctl.train.model import Block

    torch.manual_seed(0)
    spec = {**TINY, "qkv_bias": bias}
    blk = Block(spec)
    with torch.no_grad():  # a Block is filled by build_units; here any fixed numbers do
        for prm in blk.parameters():
            prm.copy_(torch.randn_like(prm) * 0.1 + (1.0 if prm.dim() == 1 else 0.0))
    xs = [torch.randn(2, 32, 64) for _ in range(3)]
    for x in xs:  # the ordinary backward, micro-batch by micro-batch
        blk(x.clone().requires_grad_(True)).square().mean().backward()
    want = {n: p.grad.clone() for n, p in blk.named_parameters()}
    blk.zero_grad(set_to_none=True)
    with zbstore.deferring() as store:
        outs = []
        for i, x in enumerate(xs):
            xi = x.clone().requires_grad_(True)
            outs.append(xi)
            blk(xi).square().mean().backward()
            store.close(i)
            assert xi.grad is not None  # B gave the input's gradient at once
        assert blk.q.weight.grad is None and blk.attn_norm.weight.grad is not None  # linear weights wait for W
        for i in range(3):
            store.run(i)
    for n, p in blk.named_parameters():
        assert torch.allclose(p.grad, want[n], rtol=1e-5, atol=1e-7), n
    assert not zbstore.STORE.active


def test_under_autocast_the_products_run_in_its_dtype_and_the_master_weights_get_their_own():
    from hetctl.train import zbstore

    torch.manual_seed(1)
    lin = zbstore.Linear(16, 8)
    x = torch.randn(3, 5, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = torch.nn.functional.linear(x, lin.weight, lin.bias)
    (y.float() ** 2).sum().backward()
    want = (lin.weight.grad.clone(), lin.bias.grad.clone(), y.dtype)
    lin.zero_grad(set_to_none=True)
    with zbstore.deferring() as store:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = lin(x)
        (y.float() ** 2).sum().backward()
        store.close(0)
        store.run(0)
    assert y.dtype == want[2] == torch.bfloat16
    assert lin.weight.grad.dtype == torch.float32
    assert torch.allclose(lin.weight.grad, want[0], rtol=1e-2, atol=1e-2)
    assert torch.allclose(lin.bias.grad, want[1], rtol=1e-2, atol=1e-2)


def test_a_w_pass_never_run_is_a_schedule_bug_not_silence():
    from hetctl.train import zbstore

    lin = zbstore.Linear(4, 3)
    with pytest.raises(RuntimeError, match="never ran"):
        with zbstore.deferring() as store:
            lin(torch.randn(2, 4)).sum().backward()
            store.close(0)


def zb_plan(split: list[int], defers: list[int]) -> dict:
    plan = tiny_plan(split)
    plan["parallel"]["schedule"] = "zb-h1"
    for st, d in zip(plan["stages"], defers):
        st["defer"] = d
    Plan.model_validate(plan).check_consistency()
    return plan


def test_plan_file_refuses_more_held_back_passes_than_the_stage_number():
    plan = zb_plan([2, 2, 2], [0, 1, 2])
    plan["stages"][1]["defer"] = 2
    with pytest.raises(Exception, match="held-back weight passes at stage 1"):
        Plan.model_validate(plan).check_consistency()
    plan["stages"][1]["defer"] = 1
    plan["parallel"]["schedule"] = "1f1b"
    with pytest.raises(Exception, match="held-back weight passes at stage 1"):
        Plan.model_validate(plan).check_consistency()


def test_zb_with_interleaving_is_refused_by_the_trainer(tmp_path):
    from hetctl.node.runtime import RankContext
    from hetctl.plan.rankenv import static_env
    from hetctl.train.topology import topology

    plan = zb_plan([3, 3], [0, 1])
    env = {**static_env(Plan.model_validate(plan), 1), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1",
           "HETCTL_RUN_ID": "r", "HETCTL_ATTEMPT": "0", "HETCTL_PLAN": str(tmp_path / "plan.json")}
    topo = topology(plan, RankContext.from_env(env))
    assert (topo.schedule, topo.defer) == ("zb-h1", 1)
    plan["parallel"]["schedule"] = "gpipe"
    with pytest.raises(ConfigError, match="parallel.schedule=gpipe"):
        topology(plan, RankContext.from_env(env))


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return run_plan(tiny_plan([6]), tmp_path_factory.mktemp("single"), steps=STEPS)


@pytest.mark.e2e
@pytest.mark.parametrize("defers", [[0, 1, 2], [0, 0, 0]], ids=["defer-by-stage", "no-deferral"])
def test_zb_h1_pipeline_trains_the_single_ranks_losses(single, tmp_path, defers):
    run = run_plan(zb_plan([2, 2, 2], defers), tmp_path / "zb", steps=STEPS)
    ours, ref = run.losses(), single.losses()
    assert sorted(ours) == sorted(ref) == list(range(1, STEPS + 1))
    for s in range(1, STEPS + 1):
        assert float(ours[s]) == pytest.approx(float(ref[s]), rel=1e-4, abs=1e-5), s
    print("bit-identical to the single rank:", ours == ref)


@pytest.mark.e2e
def test_zb_h1_under_tensor_parallelism_trains_what_1f1b_does(tmp_path):
    """Two stages of two TP ranks: B carries the TP group's all-reduces, W is each rank's own shard."""
    plain = run_plan(tiny_plan([3, 3], tp=2), tmp_path / "1f1b", steps=6)
    plan = tiny_plan([3, 3], tp=2)
    plan["parallel"]["schedule"] = "zb-h1"
    plan["stages"][1]["defer"] = 1
    zb = run_plan(plan, tmp_path / "zb", steps=6)
    assert sorted(zb.losses()) == list(range(1, 7))
    for s in range(1, 7):
        assert float(zb.losses()[s]) == pytest.approx(float(plain.losses()[s]), rel=1e-5, abs=1e-6), s


@pytest.mark.e2e
def test_zb_h1_run_killed_and_resumed_is_bit_identical(tmp_path):
    plan = zb_plan([2, 2, 2], [0, 1, 2])
    calm = run_plan(plan, tmp_path / "calm", steps=STEPS, ckpt_every=4)
    with Ranks(plan, tmp_path / "crash", steps=STEPS, ckpt_every=4) as crashed:
        crashed.start()
        crashed.wait_for_checkpoint(4)
        crashed.kill(2, signal.SIGKILL)  # the last stage, which holds back the most W passes
        crashed.stop_all()
    found = checkpoint.latest_valid(crashed.ckpt_dir, checkpoint.model_digest(TINY))
    assert found is not None and found[0] < STEPS
    resumed = run_plan(plan, tmp_path / "crash", steps=STEPS, ckpt_every=4, attempt=2, resume_step=found[0])
    assert resumed.losses() == {s: calm.losses()[s] for s in range(found[0] + 1, STEPS + 1)}
