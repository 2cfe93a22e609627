"""``launch --init-from`` and ``export`` end to end: real ranks on two local nodes, transformers on both ends.

A random Llama made and saved by transformers is the starting point of a
two-stage pipeline (``hetctl launch --init-from``); the loss of its first step,
before any update, is the one transformers computes on the same batch. After a
few steps of training, ``hetctl export`` writes the run's checkpoint as a
Hugging Face folder, and transformers' logits from it equal hetctl's own model's
from the checkpoint's units.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hetctl.files.plan import Plan  # noqa: E402
from hetctl.plan.hfconfig import load_config_spec  # noqa: E402
from tests.helpers.hfmodels import save_random  # noqa: E402
from tests.helpers.rankrunner import tiny_plan  # noqa: E402
from tests.helpers.sites import hetctl  # noqa: E402

pytestmark = pytest.mark.e2e
SEED, MB, MICRO, SEQ = 1234, 2, 2, 16


def _site(tmp_path: Path, spec: dict) -> None:
    (tmp_path / "home" / ".ssh").mkdir(parents=True)
    inv = {"defaults": {"transport": "local", "python": sys.executable, "env": {"OMP_NUM_THREADS": "1"}},
           "checkpoint_dir": str(tmp_path / "ckpt"),
           "nodes": [{"name": f"n{i}", "host": "localhost", "workdir": f"wd/n{i}"} for i in range(2)]}
    (tmp_path / "inventory.yaml").write_text(yaml.safe_dump(inv))
    plan = Plan.model_validate({**tiny_plan([1, 2], micro_batch=MB, micro_batches=MICRO, model=spec),
                                "inventory": "inventory.yaml", "framework": "hetctl"})
    (tmp_path / "plan").mkdir()
    (tmp_path / "plan" / "plan.yaml").write_text(yaml.safe_dump(plan.model_dump(mode="json")))


def _first_step_loss(ref, spec: dict) -> float:
    """transformers' loss on the trainer's step-1 batch, weighted as the trainer weighs micro-batches."""
    import torch.nn.functional as F

    from hetctl.train import data

    total = 0.0
    with torch.no_grad():
        for m in range(MICRO):
            x, y = data.micro_batch(SEED, 1, 0, m, MB, MICRO, SEQ, spec["vocab_size"])
            logits = ref(x).logits
            total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))) / MICRO
    return total


def test_init_from_on_two_stages_then_export_reloads_in_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    from hetctl.train.export import read_checkpoint
    from hetctl.train.model import StageModule, build_units

    ref = save_random(tmp_path / "hf", "llama")
    spec = load_config_spec(tmp_path / "hf", seq_len=SEQ).model_dump(mode="json")
    _site(tmp_path, spec)
    r = hetctl(tmp_path, "launch", "plan", "--init-from", "hf", "--steps", "4", "--checkpoint-every", "4", "--json",
               timeout=300)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["state"] == "succeeded" and summary["steps"] == 4
    run = Path(summary["run_dir"])
    assert yaml.safe_load((run / "run.yaml").read_text())["inputs"]["init_from"] == str(tmp_path / "hf")
    log0 = (run / "logs" / "n0" / "rank-0.log").read_text()
    assert "init-from" in log0 and "embedding, layer-00000" in log0 and "layer-00001" not in log0
    # (a) the pipeline's forward on imported weights is transformers' forward
    want = _first_step_loss(ref, spec)
    assert abs(summary["first_loss"] - want) <= 1e-4 * abs(want), (summary["first_loss"], want)

    # (b) export the trained run; transformers loads it as is and agrees with hetctl's model
    r = hetctl(tmp_path, "export", str(run), "-o", "out")
    assert r.returncode == 0, r.stderr
    assert "exported step 4" in r.stdout
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(loaded).__name__ == "LlamaForCausalLM"
    ckpt_dir = Path(yaml.safe_load((run / "run.yaml").read_text())["inputs"]["checkpoint_dir"])
    step, units = read_checkpoint(ckpt_dir, spec, None)
    assert step == 4
    ours = build_units(spec, (0, spec["num_layers"]), True, True, seed=0)
    for name, unit in ours.items():
        unit.load_state_dict(units[name])
    ids = torch.randint(0, spec["vocab_size"], (2, SEQ), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        got, mine, before = loaded(ids).logits, StageModule(ours)(ids), ref(ids).logits
    assert float((got - mine).abs().max() / mine.abs().max()) < 1e-4
    assert not torch.allclose(got, before)  # it did train: the export is not the imported model

    # an export never overwrites: the second one into the same folder is refused
    r = hetctl(tmp_path, "export", str(run), "-o", "out")
    assert r.returncode == 2 and "exists and is not an empty folder" in r.stderr
    # export verifies the manifest: a damaged unit file is refused, and nothing is left behind
    head = ckpt_dir / "step-4" / "head.pt"
    head.write_bytes(head.read_bytes()[:-1] + b"x")
    r = hetctl(tmp_path, "export", str(run), "-o", "out2", "--step", "4")
    assert r.returncode == 2 and "head.pt: size or sha256 differs from the manifest" in r.stderr, r.stderr
    assert not (tmp_path / "out2").exists() and not list(tmp_path.glob(".out2.*"))


def test_mismatched_init_from_is_refused_before_any_rank_starts(tmp_path):
    save_random(tmp_path / "hf", "llama")
    spec = load_config_spec(tmp_path / "hf", seq_len=SEQ).model_dump(mode="json")
    _site(tmp_path, {**spec, "num_layers": 3, "vocab_size": 128})
    r = hetctl(tmp_path, "launch", "plan", "--init-from", "hf", "--steps", "2", "--json", timeout=120)
    assert r.returncode == 2, r.stderr
    line = [ln for ln in r.stderr.splitlines() if "error" in ln.lower()]
    assert line and "hf/config.json: vocab_size gives vocab_size 96, the plan's model has 128" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())  # no run was started


def test_tied_table_stays_one_across_stages_and_resumes_without_reimport(tmp_path):
    """Qwen2 with tied embeddings on 1+2 stages: the last stage's copy of the table trains as the table does.

    Its first loss is transformers'; its losses follow the one-stage run (where head and embedding share one
    parameter) step after step; a resume on another split continues bit for bit, and the ``--init-from``
    it is given again is not re-applied (the checkpoint's weights win).
    """
    from tests.helpers.rankrunner import run_plan

    ref = save_random(tmp_path / "hf", "qwen2", tie_word_embeddings=True)
    spec = load_config_spec(tmp_path / "hf", seq_len=SEQ).model_dump(mode="json")
    assert spec["tie_embeddings"] and spec["qkv_bias"]
    init = ("--init-from", str(tmp_path / "hf"))
    one = run_plan(tiny_plan([3], micro_batch=MB, micro_batches=MICRO, model=spec), tmp_path / "one", steps=8,
                   args=init)
    two = run_plan(tiny_plan([1, 2], micro_batch=MB, micro_batches=MICRO, model=spec), tmp_path / "two", steps=8,
                   ckpt_every=4, args=init)
    want = _first_step_loss(ref, spec)
    a, b = one.losses(), two.losses()
    assert abs(float(b[1]) - want) <= 1e-4 * want
    for step in range(1, 9):  # the same training, up to the order in which the two gradients are added
        assert abs(float(a[step]) - float(b[step])) <= 1e-5 * float(a[step]), (step, a[step], b[step])
    assert float(b[8]) < float(b[1])
    # two replicas of 1+2 stages (same global batch): table and copy summed, reduced over replicas, broadcast
    dp = run_plan(tiny_plan([1, 2], dp=2, micro_batch=MB, micro_batches=MICRO // 2, model=spec), tmp_path / "dp",
                  steps=8, args=init)
    for step, loss in dp.losses().items():
        assert abs(float(a[step]) - float(loss)) <= 1e-5 * float(a[step]), (step, a[step], loss)
    resumed = run_plan(tiny_plan([2, 1], micro_batch=MB, micro_batches=MICRO, model=spec), tmp_path / "resumed",
                       steps=8, resume_step=4, ckpt_dir=two.ckpt_dir, args=init)
    assert resumed.losses() == {s: b[s] for s in range(5, 9)}
    assert "init-from" not in resumed.stdout(0)


def test_tensor_parallel_stages_import_qwen2_biases_and_tied_table(tmp_path):
    """TP=2 on 1+2 stages: each rank keeps its slice of q/k/v and their biases; the loss is transformers'."""
    from tests.helpers.rankrunner import run_plan

    ref = save_random(tmp_path / "hf", "qwen2", tie_word_embeddings=True)
    spec = load_config_spec(tmp_path / "hf", seq_len=SEQ).model_dump(mode="json")
    tp = run_plan(tiny_plan([1, 2], tp=2, micro_batch=MB, micro_batches=MICRO, model=spec), tmp_path / "tp",
                  steps=3, args=("--init-from", str(tmp_path / "hf")))
    want = _first_step_loss(ref, spec)
    losses = tp.losses()
    assert abs(float(losses[1]) - want) <= 1e-4 * want, (losses[1], want)
    assert float(losses[3]) < float(losses[1])
