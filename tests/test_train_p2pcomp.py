"""The reference trainer with ``--p2p-compress bf16`` (issue 35, item 2): real ranks over gloo on loopback.

A three-stage pipeline whose stages are labelled nvidia, nvidia, ascend (CPU ranks all; the label is what
makes a stage boundary one between vendors): only the second boundary crosses vendors, so only its
activations and gradients go in bfloat16, half the bytes; the loss tracks the fp32 run, and a run resumed
from its checkpoint continues bit for bit (both ends of a link round alike, and nothing is carried).
"""

from __future__ import annotations

import pytest

from tests.helpers.rankrunner import run_plan, tiny_plan

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.e2e  # real torch training processes over gloo

STEPS = 12
VENDORS = ["nvidia", "nvidia", "ascend"]


def plan(p2p: str = "none") -> dict:
    p = tiny_plan([2, 2, 2])
    for st, vendor in zip(p["stages"], VENDORS):
        st["vendor"] = vendor
    p["p2p_compress"] = p2p  # what `hetctl plan --p2p-compress` records: the ranks' default
    return p


def test_bf16_across_the_vendor_boundary_halves_its_bytes_and_tracks_the_loss(tmp_path):
    fp32 = run_plan(plan(), tmp_path / "fp32", steps=STEPS)
    bf16 = run_plan(plan("bf16"), tmp_path / "bf16", steps=STEPS, ckpt_every=6)
    ours, theirs = bf16.losses(), fp32.losses()
    assert sorted(ours) == list(range(1, STEPS + 1)) and ours != theirs  # it changes the numbers, a little
    for s in range(1, STEPS + 1):
        assert float(ours[s]) == pytest.approx(float(theirs[s]), rel=0.01), (s, ours[s], theirs[s])
    assert float(ours[STEPS]) < float(ours[1]) - 0.3  # it trains
    # rank 0 → 1 is inside nvidia: nothing counted; 1 ↔ 2 crosses: activations one way, gradients the other
    assert "xv_p2p_bytes" not in bf16.heartbeat(0) and "xv_p2p_bytes" not in fp32.heartbeat(0)
    for rank in (1, 2):
        sent, plain = bf16.heartbeat(rank)["xv_p2p_bytes"], fp32.heartbeat(rank)["xv_p2p_bytes"]
        assert plain > 0 and 2 * sent == plain, (rank, sent, plain)

    resumed = run_plan(plan(), tmp_path / "bf16", steps=STEPS, ckpt_every=6, attempt=2, resume_step=6,
                       args=("--p2p-compress", "bf16"))  # the option, over a plan that says none
    assert resumed.losses() == {s: ours[s] for s in range(7, STEPS + 1)}
