"""Token data: Megatron's indexed format against megatron-core itself, ``hetctl data prepare``, and samples.

The format is checked both ways with megatron-core's own ``IndexedDataset`` and
``IndexedDatasetBuilder``; ``prepare`` runs as the real command line; the
trainer's rows are checked to depend only on (seed, step, row), whatever the split.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hetctl.corpus import indexed, samples
from hetctl.corpus.indexed import IndexedWriter, open_dataset, token_dtype
from hetctl.errors import ConfigError

CORPUS = Path(__file__).resolve().parents[1] / "hetctl" / "data" / "corpus" / "tinyshakespeare.txt"


def megatron():
    pytest.importorskip("torch")
    return pytest.importorskip("megatron.core.datasets.indexed_dataset")


def hetctl(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hetctl", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "COLUMNS": "200"})


def write(prefix: Path, docs: list[list[int]], vocab: int = 257) -> None:
    with IndexedWriter(prefix, token_dtype(vocab)) as w:
        for d in docs:
            w.add_document(np.asarray(d))
        w.commit()


def make_tokenizer(folder: Path, text: str, vocab: int = 300) -> Path:
    """A small byte-level BPE trained here on ``text`` (no hub), saved as a Hugging Face tokenizer folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text], trainer)
    folder.mkdir(parents=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return folder


# --- the format, both ways with megatron-core ----------------------------------------------


@pytest.mark.parametrize("vocab", [257, 100_000])
def test_megatron_reads_what_we_write(tmp_path, vocab):
    mod = megatron()
    rng = np.random.default_rng(0)
    docs = [list(rng.integers(0, vocab, size=n)) for n in (5, 1, 300, 17)]
    write(tmp_path / "ours", docs, vocab)
    theirs = mod.IndexedDataset(str(tmp_path / "ours"))
    assert len(theirs) == len(docs)
    assert theirs.index.dtype == (np.uint16 if vocab < 65500 else np.int32)
    assert [list(theirs[i]) for i in range(len(docs))] == docs
    assert list(theirs.document_indices) == list(range(len(docs) + 1))
    assert list(theirs.sequence_lengths) == [len(d) for d in docs]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.int64])
def test_we_read_what_megatron_writes(tmp_path, dtype):
    mod = megatron()
    import torch

    builder = mod.IndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=dtype)
    builder.add_document(torch.tensor([7, 8, 9, 0]), [4])
    for seq in ([1, 2], [3], [4, 5, 6]):  # one document of three sequences (sentence-split data)
        builder.add_item(torch.tensor(seq))
    builder.end_document()
    builder.add_document(torch.tensor([11, 12]), [2])
    builder.finalize(str(tmp_path / "m.idx"))
    ds = open_dataset(tmp_path / "m")
    assert ds.dtype == np.dtype(dtype) and len(ds) == 5 and ds.num_documents == 3
    assert [list(ds[i]) for i in range(5)] == [[7, 8, 9, 0], [1, 2], [3], [4, 5, 6], [11, 12]]
    assert list(ds.tokens) == [7, 8, 9, 0, 1, 2, 3, 4, 5, 6, 11, 12]
    assert ds.document_token_start(1) == 4 and ds.document_token_start(2) == 10 and ds.max_token() == 12


def _corrupt(prefix: Path, how: str) -> None:
    bin_path, idx_path = indexed.paths(prefix)
    raw = bytearray(idx_path.read_bytes())
    if how == "missing bin":
        bin_path.unlink()
    elif how == "magic":
        raw[:7] = b"NOTIDX!"
    elif how == "version":
        raw[9:17] = struct.pack("<Q", 2)
    elif how == "dtype":
        raw[17] = 42
    elif how == "truncated":
        del raw[-5:]
    elif how == "short header":
        del raw[20:]
    elif how == "pointer":
        raw[34 + 4 * 3 + 8:34 + 4 * 3 + 16] = struct.pack("<q", 999)  # sequence_pointers[1]
    elif how == "bin size":
        bin_path.write_bytes(bin_path.read_bytes()[:-2])
    if how != "missing bin":
        idx_path.write_bytes(bytes(raw))


@pytest.mark.parametrize("how, needle", [
    ("missing bin", r"d\.bin: no such file"),
    ("magic", r"d\.idx: header starts b'NOTIDX!"),
    ("version", r"d\.idx: version is 2; only version 1"),
    ("dtype", r"d\.idx: dtype code is 42, not one of"),
    ("truncated", r"d\.idx: size is \d+ bytes; sequence_count=3 and document_count=4 need"),
    ("short header", r"d\.idx: header is truncated \(20 of 34 bytes\)"),
    ("pointer", r"d\.idx: sequence_pointers\[1\] is 999, expected 6"),
    ("bin size", r"d\.bin: size is 14 bytes; the index's sequence_lengths say 16"),
])
def test_a_bad_dataset_is_refused_naming_file_and_field(tmp_path, how, needle):
    write(tmp_path / "d", [[1, 2, 3], [4], [5, 6, 7, 8]])
    open_dataset(tmp_path / "d")  # sound before
    _corrupt(tmp_path / "d", how)
    with pytest.raises(ConfigError, match=needle):
        open_dataset(tmp_path / "d")


def test_token_ids_must_fit_the_model(tmp_path):
    write(tmp_path / "d", [[1, 2, 256]])
    with pytest.raises(ConfigError, match=r"d\.bin: token id 256 >= the model's vocab_size 256"):
        samples.check_dataset(open_dataset(tmp_path / "d"), 256)
    samples.check_dataset(open_dataset(tmp_path / "d"), 257)
    with IndexedWriter(tmp_path / "f", np.float32) as w:
        w.add_document(np.array([0.5, 1.0]))
        w.commit()
    with pytest.raises(ConfigError, match=r"f\.idx: dtype is float32, not a token type"):
        samples.check_dataset(open_dataset(tmp_path / "f"), 257)


# --- hetctl data prepare -----------------------------------------------------------------------


def test_prepare_reports_what_it_skipped_and_megatron_reads_it(tmp_path):
    mod = megatron()
    big = b"y" * (10 * 1024 * 1024)  # one 10 MB line
    lines = [b"first line", b"", b"   ", big, b"caf\xe9 au lait \xff", b"", b"last line"]
    src = tmp_path / "in.txt"
    src.write_bytes(b"\n".join(lines) + b"\n")
    r = hetctl("data", "prepare", str(src), "-o", str(tmp_path / "out" / "d"), "--tokenizer", "bytes",
               "--txt-split", "line", "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["documents"] == 3 and rep["vocab_size"] == 257 and rep["eod"] == 256 and rep["dtype"] == "uint16"
    assert rep["skipped"] == {"empty": 3, "overlong": 1, "replaced": 1}
    assert rep["first"] == {"empty": f"{src}:2", "overlong": f"{src}:4", "replaced": f"{src}:5"}
    ds = mod.IndexedDataset(str(tmp_path / "out" / "d"))
    docs = [bytes(ds[i][:-1].astype(np.uint8)) for i in range(len(ds))]
    assert docs == [b"first line", "caf\ufffd au lait \ufffd".encode(), b"last line"]
    assert all(int(ds[i][-1]) == 256 for i in range(len(ds)))
    assert rep["tokens"] == sum(len(d) + 1 for d in docs)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["d.bin", "d.idx"]  # no temporary files left
    human = hetctl("data", "prepare", str(src), "-o", str(tmp_path / "h"), "--tokenizer", "bytes", "--txt-split", "line")
    assert human.returncode == 0 and "1 over-long documents skipped" in human.stdout, human.stdout
    assert "Traceback" not in human.stderr


def test_prepare_paragraphs_are_documents(tmp_path):
    src = tmp_path / "in.txt"
    src.write_text("Para one\nstill one\n\n\n\nPara two\n   \nthree\n")
    r = hetctl("data", "prepare", str(src), "-o", str(tmp_path / "d"), "--tokenizer", "bytes", "--json")
    assert r.returncode == 0, r.stderr
    ds = open_dataset(tmp_path / "d")
    assert [bytes(ds[i][:-1].astype(np.uint8)).decode() for i in range(len(ds))] == ["Para one\nstill one",
                                                                                      "Para two", "three"]
    assert json.loads(r.stdout)["skipped"] == {}


def test_prepare_with_a_hugging_face_tokenizer_jsonl_and_parquet(tmp_path):
    mod = megatron()
    text = CORPUS.read_text()[:20_000]
    folder = make_tokenizer(tmp_path / "tok", text)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    eod = tok.token_to_id("<|endoftext|>")
    records = ["First Citizen: speak.", "", "All: Resolved, resolved.", None]
    jl = tmp_path / "in.jsonl"
    jl.write_text("\n".join([json.dumps({"text": t}) if t is not None else json.dumps({"title": "x"})
                             for t in records] + ["{not json"]) + "\n")
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["Second Citizen: one word.", None, "Menenius: hear me."]}), tmp_path / "in.parquet")
    r = hetctl("data", "prepare", str(jl), str(tmp_path / "in.parquet"), "-o", str(tmp_path / "d"),
               "--tokenizer", str(folder), "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["skipped"] == {"empty": 1, "no_text": 2, "bad_json": 1}
    assert rep["vocab_size"] == tok.get_vocab_size() and rep["eod"] == eod
    ds = mod.IndexedDataset(str(tmp_path / "d"))
    expected = ["First Citizen: speak.", "All: Resolved, resolved.", "Second Citizen: one word.", "Menenius: hear me."]
    assert [list(ds[i]) for i in range(len(ds))] == [tok.encode(t).ids + [eod] for t in expected]


@pytest.mark.parametrize("args, needle", [
    (["missing.txt"], "missing.txt: no such input file"),
    (["in.csv"], "in.csv: unknown input kind '.csv'"),
    (["in.txt", "--tokenizer-dir"], "tok: no such tokenizer file"),
    (["empty.txt"], "no documents left to write: every input was empty or skipped (2 empty documents skipped)"),
])
def test_prepare_refuses_bad_input_in_one_line(tmp_path, args, needle):
    (tmp_path / "in.txt").write_text("hello\n")
    (tmp_path / "in.csv").write_text("a,b\n")
    (tmp_path / "empty.txt").write_text("\n  \n")
    tok = str(tmp_path / "tok") if "--tokenizer-dir" in args else "bytes"
    files = [str(tmp_path / a) for a in args if not a.startswith("--")]
    split = ["--txt-split", "line"] if args == ["empty.txt"] else []
    r = hetctl("data", "prepare", *files, "-o", str(tmp_path / "d"), "--tokenizer", tok, *split)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert needle in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not list(tmp_path.glob("d.*"))


def test_an_interrupted_prepare_leaves_the_old_dataset_and_no_temporary_files(tmp_path):
    from hetctl.corpus.prepare import BATCH, Options, prepare
    from hetctl.corpus.tokenize import Tokenizer, byte_tokenizer

    src = tmp_path / "in.txt"
    src.write_text("".join(f"line {i}\n" for i in range(3 * BATCH)))
    opts = Options((src,), tmp_path / "d", txt_split="line")
    prepare(opts, byte_tokenizer())
    before = {p.name: p.read_bytes() for p in tmp_path.glob("d.*")}
    calls = []

    def dies(texts):
        calls.append(len(texts))
        if len(calls) == 2:
            raise KeyboardInterrupt  # Ctrl-C in the middle of writing
        return byte_tokenizer().encode_batch(texts)

    with pytest.raises(KeyboardInterrupt):
        prepare(opts, Tokenizer("dies", 257, 256, dies))
    assert calls == [BATCH, BATCH]  # it died with one batch written
    assert {p.name: p.read_bytes() for p in tmp_path.glob("d.*")} == before  # untouched, nothing else there
    assert len(open_dataset(tmp_path / "d")) == 3 * BATCH


# --- samples -------------------------------------------------------------------------------


def test_blend_pattern_honours_the_weights_in_every_prefix():
    for weights in ([0.7, 0.3], [1, 1, 1], [0.001, 0.999], [0.5, 0.25, 0.125, 0.125]):
        pattern, before, share = samples.blend_pattern(weights)
        w = np.asarray(weights) / sum(weights)
        assert share.sum() == samples.BLEND_PERIOD and np.all(np.abs(share - w * samples.BLEND_PERIOD) <= 1)
        counts = np.zeros(len(weights), dtype=int)
        for s, d in enumerate(pattern):
            assert before[s] == counts[d]
            counts[d] += 1
            assert np.all(np.abs(counts - share / samples.BLEND_PERIOD * (s + 1)) < 1), (weights, s)
        assert list(counts) == list(share)


def test_parse_blend_uses_megatrons_syntax():
    assert samples.parse_blend(["a"]) == [(1.0, "a")]
    assert samples.parse_blend(["0.7", "a", "0.3", "b"]) == [(0.7, "a"), (0.3, "b")]
    assert samples.parse_blend(["3", "a", "1", "b"]) == [(0.75, "a"), (0.25, "b")]
    for bad, needle in ((["0.7", "a", "b"], "weight/PREFIX pairs"), (["x", "a", "1", "b"], "'x' is not a weight"),
                        (["0", "a", "1", "b"], "must be a positive number")):
        with pytest.raises(ConfigError, match=needle):
            samples.parse_blend(bad)


def _blend_files(tmp_path: Path) -> tuple[Path, Path]:
    rng = np.random.default_rng(1)
    write(tmp_path / "a", [list(rng.integers(0, 200, size=n)) + [256] for n in rng.integers(5, 60, size=200)])
    write(tmp_path / "b", [list(rng.integers(0, 200, size=n)) + [256] for n in rng.integers(5, 60, size=50)])
    return tmp_path / "a", tmp_path / "b"


def test_a_blend_sweeps_each_dataset_once_per_epoch_in_its_share(tmp_path):
    a, b = _blend_files(tmp_path)
    train, ev = samples.training_data(["0.7", str(a), "0.3", str(b)], None, seq_len=16, vocab_size=257, seed=5,
                                      global_batch=10)
    wa, wb = (p.windows for p in train.parts)
    n = 30 * samples.BLEND_PERIOD // 10  # the first 3 periods
    got = [train.sample(g) for g in range(n)]
    a_windows = [w for d, w in got if d == 0]
    assert len(a_windows) == 7 * n // 10 and len(got) - len(a_windows) == 3 * n // 10
    assert sorted(a_windows[:wa]) == list(range(wa))  # epoch 0 of a: every window once
    assert a_windows[wa:2 * wa] != a_windows[:wa] and sorted(a_windows[wa:2 * wa]) == list(range(wa))
    b_windows = [w for d, w in got if d == 1]
    assert sorted(b_windows[:wb]) == list(range(wb))
    rows = train.rows(3, 2, 4)
    assert rows.shape == (4, 17) and rows.dtype == np.int64
    for row, sid in zip(rows, train.ids(3, 2, 4)):
        d, w = map(int, sid.split(":"))
        assert list(row) == list(train.parts[d].window(w))
    # Another seed, another order; the same seed, the same.
    other, _ = samples.training_data(["0.7", str(a), "0.3", str(b)], None, seq_len=16, vocab_size=257, seed=6,
                                     global_batch=10)
    assert other.ids(1, 0, 10) != train.ids(1, 0, 10)
    again, _ = samples.training_data(["0.7", str(a), "0.3", str(b)], None, seq_len=16, vocab_size=257, seed=5,
                                     global_batch=10)
    assert again.ids(7, 0, 10) == train.ids(7, 0, 10)


def test_the_held_out_split_is_never_trained_on(tmp_path):
    a, _ = _blend_files(tmp_path)
    ds = open_dataset(a)
    train, ev = samples.training_data([str(a)], None, seq_len=16, vocab_size=257, seed=5, global_batch=4)
    cut = ds.document_token_start(ds.num_documents - 2)  # 1% of 200 documents: the last 2
    assert train.parts[0].tokens.size == cut and ev.parts[0].tokens.size == ds.tokens.size - cut
    held = ev.parts[0].windows
    assert 1 < held < 4 and ev.ids(1, 0, 4) == [f"0:{i % held}" for i in range(4)]  # fixed windows, in order
    assert np.array_equal(ev.rows(1, 0, 1)[0], ds.tokens[cut:cut + 17])
    named, ev2 = samples.training_data([str(a)], [str(a)], seq_len=16, vocab_size=257, seed=5, global_batch=4)
    assert named.parts[0].tokens.size == ds.tokens.size and ev2.parts[0].tokens.size == ds.tokens.size


def test_rows_do_not_depend_on_the_split(tmp_path):
    """The same global batch cut into other replicas and micro-batches (DP, PP, interleaving): the same rows."""
    pytest.importorskip("torch")
    import torch

    from hetctl.train import data

    a, b = _blend_files(tmp_path)
    train, _ = samples.training_data(["0.7", str(a), "0.3", str(b)], None, seq_len=16, vocab_size=257, seed=5,
                                     global_batch=8)

    def global_batch(step, dp, micro_batches, mb):
        parts = [data.micro_batch(5, step, r, m, mb, micro_batches, 16, 257, corpus=train)
                 for r in range(dp) for m in range(micro_batches)]
        return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])

    for step in (1, 2, 9):
        ref = global_batch(step, 1, 4, 2)
        for dp, micro, mb in ((2, 2, 2), (4, 1, 2), (1, 8, 1), (2, 4, 1)):
            got = global_batch(step, dp, micro, mb)
            assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]), (step, dp, micro, mb)
        assert torch.equal(ref[0][:, 1:], ref[1][:, :-1])  # targets are the inputs shifted by one
    assert not torch.equal(global_batch(1, 1, 4, 2)[0], global_batch(2, 1, 4, 2)[0])


# --- the trainer on a prepared corpus (real ranks over gloo) -------------------------------------

MODEL = {"name": "tiny", "num_layers": 6, "hidden_size": 64, "ffn_hidden_size": 172, "num_attention_heads": 4,
         "num_query_groups": 2, "vocab_size": 257, "seq_len": 32}  # tiny, with the bytes tokenizer's vocabulary


@pytest.fixture(scope="module")
def shakespeare(tmp_path_factory) -> Path:
    """The shipped corpus, prepared as a user would (bytes tokenizer)."""
    prefix = tmp_path_factory.mktemp("corpus") / "shake"
    r = hetctl("data", "prepare", str(CORPUS), "-o", str(prefix), "--tokenizer", "bytes", "--json")
    assert r.returncode == 0, r.stderr
    return prefix


def sample_ids(ranks, first_stage_ranks) -> dict[int, list[str]]:
    """``{step: ids of the global batch}`` from the ``samples …`` lines of the first-stage ranks, rows in order."""
    rows: dict[int, list[tuple[int, list[str]]]] = {}
    for r in first_stage_ranks:
        for line in ranks.stdout(r).splitlines():
            if line.startswith("samples "):
                f = dict(kv.split("=", 1) for kv in line.split()[1:])
                rows.setdefault(int(f["step"]), []).append((int(f["rows"].split("-")[0]), f["ids"].split(",")))
    return {s: [i for _, ids in sorted(parts) for i in ids] for s, parts in rows.items()}


def eval_losses(ranks) -> dict[int, str]:
    out = {}
    for line in ranks.stdout(ranks.last_rank()).splitlines():
        if line.startswith("eval step="):
            f = dict(kv.split("=", 1) for kv in line.split()[1:])
            out[int(f["step"])] = f["eval_loss"]
    return out


@pytest.mark.e2e
def test_a_pipeline_trains_on_the_corpus_and_resumed_or_replanned_runs_see_the_same_samples(shakespeare, tmp_path):
    pytest.importorskip("torch")
    from hetctl.node import manifest as checkpoint
    from tests.helpers.rankrunner import Ranks, run_plan, tiny_plan

    steps, every = 12, 4
    args = ("--data", str(shakespeare), "--eval-every", "4", "--log-samples")
    base = run_plan(tiny_plan([3, 3], model=MODEL), tmp_path / "base", steps=steps, ckpt_every=every, args=args)
    ids, losses, evals = sample_ids(base, [0]), base.losses(), eval_losses(base)
    assert sorted(ids) == list(range(1, steps + 1)) and all(len(v) == 8 for v in ids.values())
    assert len({i for v in ids.values() for i in v}) == 8 * steps  # no window twice within the first epoch
    assert "samples " not in base.stdout(1)  # only the stage that reads inputs logs them
    first, last = [float(losses[s]) for s in (1, 2, 3)], [float(losses[s]) for s in (10, 11, 12)]
    assert sum(last) < 0.9 * sum(first), (first, last)  # real text: from ln 257 = 5.55 down
    assert sorted(evals) == [4, 8, 12] and float(evals[12]) < float(evals[4])
    assert f"{base.heartbeat(1)['eval_loss']:.9g}" == evals[12] and base.heartbeat(1)["eval_step"] == 12

    with Ranks(tiny_plan([3, 3], model=MODEL), tmp_path / "crash", steps=steps, ckpt_every=every, args=args) as crashed:
        crashed.start()
        crashed.wait_for_step(1, 7)
        crashed.wait_for_checkpoint()  # the first save is asynchronous: under load it commits steps later
        crashed.kill(1)  # the last stage dies mid-run
        crashed.stop_all()
    seen = sample_ids(crashed, [0])
    assert seen and all(seen[s] == ids[s] for s in seen)
    found = checkpoint.latest_valid(crashed.ckpt_dir, checkpoint.model_digest(MODEL))
    assert found is not None and every <= found[0] < steps
    after = range(found[0] + 1, steps + 1)
    resumed = run_plan(tiny_plan([3, 3], model=MODEL), tmp_path / "crash", steps=steps, ckpt_every=every, args=args,
                       attempt=2, resume_step=found[0])
    assert sample_ids(resumed, [0]) == {s: ids[s] for s in after}
    assert resumed.losses() == {s: losses[s] for s in after}
    assert eval_losses(resumed) == {s: evals[s] for s in evals if s > found[0]}
    assert [resumed.stderr(r) for r in (0, 1)] == ["", ""]  # same data as the checkpoint's: no warning
    other = run_plan(tiny_plan([3, 3], model=MODEL), tmp_path / "other", steps=found[0] + 1, resume_step=found[0],
                     ckpt_dir=crashed.ckpt_dir, args=("--data", "3", str(shakespeare), "1", str(shakespeare)))
    assert "was trained on [[1.0, 'shake', " in other.stderr(0) and "continuing on [[0.75, 'shake', " in other.stderr(0)
    # Re-planned onto one node (PP=1) from the crashed run's checkpoint: the same samples, the same numbers.
    replanned = run_plan(tiny_plan([6], model=MODEL), tmp_path / "replan", steps=steps, args=args,
                         resume_step=found[0], ckpt_dir=crashed.ckpt_dir)
    assert sample_ids(replanned, [0]) == {s: ids[s] for s in after}
    assert replanned.losses() == {s: losses[s] for s in after}
    assert eval_losses(replanned) == {s: evals[s] for s in evals if s > found[0]}
    # Two replicas of the same global batch: together they read the same rows.
    dp = run_plan(tiny_plan([3, 3], dp=2, micro_batches=2, model=MODEL), tmp_path / "dp", steps=4, args=args)
    assert sample_ids(dp, [0, 2]) == {s: ids[s] for s in range(1, 5)}
    assert float(eval_losses(dp)[4]) == pytest.approx(float(evals[4]), rel=1e-5)


@pytest.mark.e2e
def test_bad_data_is_refused_by_a_rank_before_it_joins_the_group(shakespeare, tmp_path):
    """One rank alone (its peer never starts) fails at once, in one line naming the file and field."""
    pytest.importorskip("torch")
    from tests.helpers.rankrunner import Ranks, free_port, tiny_plan

    small = {**MODEL, "vocab_size": 256}  # the bytes tokenizer's end-of-document id is 256
    cases = [(small, (str(shakespeare),), f"{shakespeare}.bin: token id 256 >= the model's vocab_size 256"),
             (MODEL, (str(tmp_path / "none"),), f"{tmp_path / 'none'}.idx: no such file"),
             (MODEL, ("0.5", str(shakespeare), "0.5"), "give one PREFIX, or weight/PREFIX pairs")]
    for n, (model, data, needle) in enumerate(cases):
        plan = tiny_plan([3, 3], model=model)
        ranks = Ranks(plan, tmp_path / f"case{n}", steps=4, args=("--data", *data, "--comm-timeout", "60"))
        with open(ranks.dir / "rank-1.err", "wb") as err:
            proc = subprocess.Popen(ranks.cmd, env=ranks.env(plan["ranks"][1], free_port()), stdout=subprocess.DEVNULL,
                                    stderr=err, stdin=subprocess.DEVNULL)
            assert proc.wait(60) == 2
        text = ranks.stderr(1)
        assert needle in text and "Traceback" not in text and len(text.strip().splitlines()) == 1, text


@pytest.mark.e2e
def test_validation_goes_through_interleaved_and_tensor_parallel_stages(shakespeare, tmp_path):
    """The forward-only pass of every layout gives one stage's validation loss: exactly, or within float
    tolerance under TP (its all-reduces sum in another order)."""
    pytest.importorskip("torch")
    from tests.helpers.rankrunner import run_plan, tiny_plan
    from tests.test_train_interleave import PP3_V2, interleaved_plan

    args = ("--data", str(shakespeare), "--eval-every", "2", "--log-samples")
    ref = run_plan(tiny_plan([6], model=MODEL), tmp_path / "one", steps=4, args=args)
    interleaved = interleaved_plan(PP3_V2, group=4)
    interleaved["model"]["vocab_size"] = MODEL["vocab_size"]
    il = run_plan(interleaved, tmp_path / "il", steps=4, args=args)
    tp = run_plan(tiny_plan([3, 3], tp=2, model=MODEL), tmp_path / "tp", steps=4, args=args)
    assert sorted(eval_losses(ref)) == [2, 4]
    assert eval_losses(il) == eval_losses(ref) and il.losses() == ref.losses()
    for step, value in eval_losses(ref).items():
        assert float(eval_losses(tp)[step]) == pytest.approx(float(value), rel=1e-5)
    assert sample_ids(ref, [0]) == sample_ids(il, [0]) == sample_ids(tp, [0])
