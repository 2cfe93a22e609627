"""The trainer's CPU threads per rank: ``--threads``, else the node's ``OMP_NUM_THREADS`` (one number), else 1."""

from __future__ import annotations

import pytest

from hetctl.train.options import parse_args


@pytest.mark.parametrize("env, want", [
    ({}, 1),
    ({"OMP_NUM_THREADS": "8"}, 8),
    ({"OMP_NUM_THREADS": " 4 "}, 4),
    ({"OMP_NUM_THREADS": "4,2"}, 1),  # OpenMP's nested form is not one number
    ({"OMP_NUM_THREADS": "0"}, 1),
    ({"OMP_NUM_THREADS": "many"}, 1),
])
def test_the_default_follows_the_nodes_omp_num_threads(env, want):
    assert parse_args(["--steps", "3"], env).threads == want


def test_an_explicit_threads_option_wins():
    assert parse_args(["--steps", "3", "--threads", "2"], {"OMP_NUM_THREADS": "8"}).threads == 2
