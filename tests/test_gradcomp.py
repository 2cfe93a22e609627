"""``--grad-compress``: the compressed cross-vendor reduce (hetctl.train.gradcomp), piece by piece.

The pure parts (the option, int8's round trip, PowerSGD's matrix runs) run in
the fast lane. The reduce itself runs on real gloo ranks (three processes on
loopback): every member gets the same bits, error feedback is carried across
steps and loses nothing (what the results miss is exactly what the ranks still
owe), the bytes counted are the mode's, and a compressor restored from its
state continues bit for bit. Training runs with each mode are in
tests/test_train_hetdp.py.
"""

from __future__ import annotations

import pytest

from hetctl.errors import ConfigError
from hetctl.train.gradmode import Mode, parse_mode


def test_the_option_names_each_mode_and_refuses_others_in_one_line():
    assert parse_mode("none") == Mode() and parse_mode("bf16") == Mode("bf16") and parse_mode("int8") == Mode("int8")
    assert parse_mode("powersgd:4") == Mode("powersgd", 4) and str(parse_mode("powersgd:4")) == "powersgd:4"
    assert parse_mode("int8").feedback and parse_mode("powersgd:1").feedback and not parse_mode("bf16").feedback
    for bad in ("int4", "powersgd", "powersgd:0", "powersgd:x", "bf16:2", ""):
        with pytest.raises(ValueError):
            parse_mode(bad)


def test_launch_args_pass_it_and_a_bad_value_is_one_line():
    """``hetctl launch --args`` is checked by the trainer's own parser (hetctl.elastic.start)."""
    from hetctl.elastic.start import check_trainer_args
    from hetctl.files.plan import Plan
    from tests.helpers.rankrunner import tiny_plan

    plan = Plan.model_validate(tiny_plan([6]))
    check_trainer_args(plan, ("--grad-compress", "int8"))
    check_trainer_args(plan, ("--grad-compress=powersgd:4",))
    with pytest.raises(ConfigError) as e:
        check_trainer_args(plan, ("--grad-compress", "int4"))
    text = str(e.value.message)
    assert "\n" not in text and "--grad-compress" in text and "'int4'" in text and "powersgd:R" in text, text


torch = pytest.importorskip("torch")


def test_int8_round_trip_is_within_half_a_step_of_its_chunk():
    from hetctl.train.gradcomp import CHUNK, dequantize, quantize

    g = torch.Generator().manual_seed(3)
    v = torch.randn(3 * CHUNK + 17, generator=g) * torch.logspace(-6, 2, 3 * CHUNK + 17)
    v[CHUNK:2 * CHUNK] = 0.0  # an all-zero chunk
    q, scale = quantize(v)
    assert q.dtype == torch.int8 and q.shape == (4, CHUNK) and scale.shape == (4,)
    back = dequantize(q, scale, v.numel())
    assert back.shape == v.shape
    step = scale.repeat_interleave(CHUNK)[:v.numel()]
    assert bool(((back - v).abs() <= step / 2 + 1e-12 * v.abs()).all())
    assert bool((back[CHUNK:2 * CHUNK] == 0).all())
    assert int(q.abs().max()) == 127  # each chunk's largest value is exact: its scale is amax / 127


def test_powersgd_sees_whole_rows_of_each_weight():
    from hetctl.train.dpreduce import segments

    shapes = [(4, 3), (5,), (2, 6)]  # 12, 5, 12 elements: [0,12) [12,17) [17,29)
    assert segments(shapes, 0, 29) == [(12, 3), (5, 0), (12, 6)]
    # A piece from 4 to 25: the cut row of the first weight [4,6), its whole rows [6,12), the vector, the
    # second weight's first row [17,23), its cut second row [23,25).
    assert segments(shapes, 4, 25) == [(2, 0), (6, 3), (5, 0), (6, 6), (2, 0)]
    for a in range(0, 29, 3):
        for b in range(a + 1, 30, 4):
            runs = segments(shapes, a, b)
            assert sum(n for n, _ in runs) == b - a
            assert all(c == 0 or n % c == 0 for n, c in runs)
            assert all(not (x[1] == 0 and y[1] == 0) for x, y in zip(runs, runs[1:]))  # vectors merged


# -- real gloo ranks -------------------------------------------------------------------------------
WORLD, STEPS, RESTORE_AT = 3, 12, 6
# Two parts as the reducer hands them over: a vector, a 20×16 weight, the start of a 64×24 one; its rest, cut.
PARTS = [("unit", 500, [(7, 0), (320, 16), (173, 0)]), ("other", 1366, [(1344, 24), (22, 0)])]


def _reduce(comp, group, grad):
    x, at, parts = grad.clone(), 0, []
    for key, n, runs in PARTS:
        parts.append((key, x[at:at + n], runs))
        at += n
    comp.all_reduce(group, parts)
    return x


MODES = ["none", "bf16", "int8", "powersgd:2"]


def _ranks(rank: int, port: int, out: str) -> None:
    """One rank, for each mode: the same gradient every step, reduced STEPS times; a second compressor is
    restored from the first's state at RESTORE_AT and reduces the remaining steps beside it (its own group)."""
    import torch.distributed as dist

    from hetctl.train.gradcomp import Compressor

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    group, again = dist.new_group(list(range(WORLD))), dist.new_group(list(range(WORLD)))
    gen = torch.Generator().manual_seed(100 + rank)
    n = sum(k for _, k, _ in PARTS)
    # Low rank plus noise, like a weight's gradient; another one on every rank.
    grad = (torch.randn(n // 2, 2, generator=gen) @ torch.randn(2, 2, generator=gen)).reshape(-1) \
        + 0.1 * torch.randn(n, generator=gen)
    for mode in MODES:
        comp, restored = Compressor(parse_mode(mode)), None
        results, continued = [], []
        for step in range(1, STEPS + 1):
            results.append(_reduce(comp, group, grad))
            if restored is not None:
                continued.append(_reduce(restored, again, grad))
            if step == RESTORE_AT:
                restored = Compressor(parse_mode(mode))
                assert restored.load_state_dict(comp.state_dict()) is None
        torch.save({"grad": grad, "results": results, "continued": continued, "error": comp.error,
                    "sent": comp.sent, "raw": comp.raw}, f"{out}/{mode}-rank-{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def reduced(tmp_path_factory):
    """Every mode's results on every rank: one set of real gloo processes for all of them."""
    import torch.multiprocessing as mp

    from tests.helpers.rankrunner import free_port

    out = tmp_path_factory.mktemp("reduced")
    mp.spawn(_ranks, args=(free_port(), str(out)), nprocs=WORLD, join=True)
    return {m: [torch.load(out / f"{m}-rank-{r}.pt", weights_only=True) for r in range(WORLD)] for m in MODES}


@pytest.mark.e2e
@pytest.mark.parametrize("mode", MODES)
def test_compressed_reduce_on_real_ranks(mode, reduced):
    from hetctl.train.gradcomp import CHUNK

    got = reduced[mode]
    total = sum(g["grad"] for g in got)
    for step in range(STEPS):  # every member, every step, the same bits
        assert all(torch.equal(g["results"][step], got[0]["results"][step]) for g in got), step
    # A compressor restored from the state continues exactly as the live one.
    for g in got:
        assert len(g["continued"]) == STEPS - RESTORE_AT
        for a, b in zip(g["continued"], g["results"][RESTORE_AT:]):
            assert torch.equal(a, b)
    first = got[0]["results"][0]
    sent, raw = got[0]["sent"], got[0]["raw"]
    assert raw == STEPS * (2 * (WORLD - 1) * total.numel() * 4 // WORLD)  # a ring's fp32 all-reduce, per rank
    if mode == "none":
        assert sent == raw and torch.allclose(first, total, rtol=1e-6, atol=1e-6)
        return
    if mode == "bf16":
        assert sent * 2 == raw
        assert (first - total).norm() / total.norm() < 2 ** -7  # a few bf16 roundings (2⁻⁹ each) per element
        return
    # Error feedback: what the results miss after k steps is exactly what the ranks still owe.
    owed = sum(torch.cat([g["error"]["unit"], g["error"]["other"]]) for g in got)
    delivered = sum(got[0]["results"])
    assert torch.allclose(delivered + owed, STEPS * total, rtol=1e-4, atol=1e-3)
    gap = [(sum(got[0]["results"][:k]) / k - total).norm() / total.norm() for k in (1, STEPS)]
    assert gap[1] < gap[0], gap  # carried across steps: the average result closes in on the sum
    if mode == "int8":  # the all-gather of d shares (d/8 of a ring's fp32), the last chunk padded, 4 bytes a scale
        chunks = -(-total.numel() // CHUNK)
        assert sent == STEPS * (WORLD - 1) * (chunks * CHUNK + 4 * chunks)
    else:  # the vectors and cut rows in fp32; P (R·rows) and Q (R·cols) of the 20×16 and 56×24 weights
        ring = lambda n: 2 * (WORLD - 1) * n * 4 // WORLD  # noqa: E731
        assert sent == STEPS * (ring(7 + 173 + 22) + ring(2 * (20 + 56)) + ring(2 * (16 + 24)))
