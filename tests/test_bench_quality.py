"""``bench/engine_quality.py``'s own parts against hetctl's, so the bench compares like with like (nothing timed).

The bench's peer is written independently of the trainer; these check that its
schedule is :class:`hetctl.train.optim.Schedule`'s, its model computes what
:mod:`hetctl.train.model` computes on the same weights, and its reading of a
``.bin/.idx`` corpus gives the trainer's rows.
"""

from __future__ import annotations


import numpy as np
import pytest

from tests.helpers.benches import load_bench

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def bench():
    return load_bench("engine_quality")


@pytest.mark.parametrize("decay", ["cosine", "linear", "constant"])
@pytest.mark.parametrize("warmup", [0, 7])
def test_the_bench_schedule_is_the_trainers(bench, decay, warmup):
    from hetctl.train.optim import Schedule

    s = Schedule(lr=3e-3, min_lr=2e-4, warmup_steps=warmup, decay=decay, decay_steps=50)
    for step in (1, 2, 6, 7, 8, 20, 49, 50, 51, 80):
        assert bench.lr_at(step, 3e-3, 2e-4, warmup, decay, 50) == s.lr_at(step), step


def test_the_bench_model_computes_the_trainers_on_the_same_weights(bench):
    from hetctl.train import hfconvert
    from hetctl.train.model import StageModule, build_units

    m = bench.model_spec(bench.parse([]))
    plain = bench.PlainLlama(m, seed=5)
    units = build_units(m, (0, m["num_layers"]), True, True, seed=1)
    for name, params in hfconvert.from_hf(plain.state_dict()).items():
        units[name].load_state_dict(params)
    ids = torch.randint(0, m["vocab_size"], (3, m["seq_len"]), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(plain(ids), StageModule(units)(ids), rtol=1e-5, atol=1e-5)


def test_the_bench_reads_the_trainers_rows(bench, tmp_path):
    from hetctl.corpus.indexed import IndexedWriter
    from hetctl.corpus.samples import training_data

    rng = np.random.default_rng(0)
    prefix = tmp_path / "docs"
    with IndexedWriter(prefix, np.dtype(np.uint16)) as w:
        for _ in range(300):
            w.add_document(rng.integers(0, 256, int(rng.integers(5, 60))))
        w.commit()
    corpus = bench.Corpus(prefix, seq_len=16, seed=7, global_batch=6)
    train, _ = training_data([str(prefix)], None, seq_len=16, vocab_size=320, seed=7, global_batch=6)
    assert corpus.windows == train.parts[0].windows and corpus.cut == train.parts[0].tokens.size
    for step in (1, 2, 500):
        assert np.array_equal(corpus.step_rows(step).numpy(), train.rows(step, 0, 6)), step
