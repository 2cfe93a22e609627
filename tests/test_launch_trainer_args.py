"""``launch --args`` for the reference trainer: its own options reach every rank, checked before any starts.

The site is the demo's three local nodes (real agents, real ``python -m hetctl.train`` ranks).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from hetctl.corpus.indexed import IndexedWriter, token_dtype
from tests.helpers.sites import local_cli, local_site

pytestmark = pytest.mark.e2e


def corpus(prefix: Path, vocab: int, top: int, docs: int = 400) -> str:
    """An indexed dataset of ``docs`` documents of ids below ``top``, written with the dtype for ``vocab``."""
    rng = np.random.default_rng(0)
    with IndexedWriter(prefix, token_dtype(vocab)) as w:
        for _ in range(docs):
            w.add_document(rng.integers(0, top, size=int(rng.integers(20, 90))))
        w.commit()
    return str(prefix)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    return local_site(tmp_path_factory.mktemp("trainer-args"))


def test_the_trainers_options_reach_every_rank_in_the_dry_run(site):
    r = local_cli(site, "launch", "plan", "--dry-run", "--json", "--args", "--lr 1e-3 --data /nodes/only/corpus")
    assert r.returncode == 0, r.stderr
    ranks = [x for n in json.loads(r.stdout)["nodes"] for x in n["ranks"]]
    assert len(ranks) == 3
    for x in ranks:
        assert x["argv"][1:3] == ["-m", "hetctl.train"] and x["argv"][-4:] == ["--lr", "1e-3", "--data", "/nodes/only/corpus"]


@pytest.mark.parametrize("args, needle", [
    ("--bogus 1", "--args: unrecognized arguments: --bogus 1"),
    ("--lr fast", "--args: argument --lr: invalid float value: 'fast'"),
    ("--steps 5", "--args: --steps is set by launch itself"),
    ("--init-from=/m", "--args: --init-from is set by launch itself"),
    ("--eval-every 5", "--args: --eval-every and --eval-data need --data"),
])
def test_a_bad_trainer_option_is_one_line_before_anything_starts(site, args, needle):
    r = local_cli(site, "launch", "plan", "--steps", "3", "--args", args)
    assert r.returncode == 2 and needle in " ".join(r.stderr.split()), r.stderr
    assert "Traceback" not in r.stderr and not (site / "runs").exists()


def test_data_that_does_not_fit_the_model_is_refused_naming_the_file(site, tmp_path):
    big = corpus(tmp_path / "wide", vocab=1000, top=900)  # the plan's tiny model has 320 ids
    r = local_cli(site, "launch", "plan", "--steps", "3", "--args", f"--data {big}")
    assert r.returncode == 2 and f"--args --data: {big}" in " ".join(r.stderr.split()), r.stderr
    assert "vocab" in r.stderr and not (site / "runs").exists()


def test_a_run_trains_on_the_data_and_evaluates(site, tmp_path):
    data = corpus(tmp_path / "text", vocab=256, top=256)
    r = local_cli(site, "launch", "plan", "--steps", "4", "--checkpoint-every", "0", "--run-dir", str(tmp_path / "runs"),
                  "--json", "--standby", "off",
                  "--args", f"--data {data} --eval-every 2 --eval-iters 1 --lr 1e-3", timeout=600)
    assert r.returncode == 0, r.stderr
    run = Path(json.loads(r.stdout)["run_dir"])
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["kind"] == "evaluated"] == [2, 4]
    info = (run / "run.yaml").read_text()
    assert "--eval-every" in info  # recorded, so a restart or a resume passes them again


def test_export_that_could_not_be_written_at_the_end_is_refused_first(site, tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("mine")
    for args, needle in [(("--steps", "5", "--checkpoint-every", "2"), "--export: step 5 is not saved with "
                                                                        "--checkpoint-every 2"),
                         (("--steps", "4", "--checkpoint-every", "2", "--export", str(tmp_path / "taken")),
                          f"--export {tmp_path / 'taken'}: exists and is not an empty folder")]:
        if "--export" not in args:
            args = (*args, "--export", str(tmp_path / "new"))
        r = local_cli(site, "launch", "plan", *args)
        assert r.returncode == 2 and needle in " ".join(r.stderr.split()), r.stderr
    assert (tmp_path / "taken" / "x").read_text() == "mine" and not (tmp_path / "new").exists()


def test_a_run_exports_itself_and_transformers_loads_it(site, tmp_path):
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "hf"
    r = local_cli(site, "launch", "plan", "--steps", "2", "--checkpoint-every", "2", "--standby", "off",
                  "--run-dir", str(tmp_path / "runs"), "--export", str(out), timeout=600)
    assert r.returncode == 0, r.stderr
    assert "exported step 2 " in r.stderr and str(out) in r.stderr
    again = local_cli(site, "export", str(next((tmp_path / "runs").iterdir())), "-o", str(tmp_path / "hf2"), "--json")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["step"] == 2 and json.loads(again.stdout)["folder"] == str(tmp_path / "hf2")
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert model.config.num_hidden_layers == 8 and model.config.vocab_size == 320


def test_resume_takes_new_trainer_options_checked_first_and_keeps_them(site, tmp_path):
    """``resume --args``: what a user changes when a run must go on differently (here a tighter gradient clip; the
    trainer itself refuses a learning rate other than its checkpoint's schedule); a bad option is one line before
    anything starts, and the new options reach the ranks and run.yaml."""
    runs = tmp_path / "runs"
    r = local_cli(site, "launch", "plan", "--steps", "4", "--checkpoint-every", "2", "--run-dir", str(runs), "--json",
                  "--standby", "off", "--args", "--lr 1e-3", timeout=600)
    assert r.returncode == 0, r.stderr
    run = Path(json.loads(r.stdout)["run_dir"])
    before = (run / "run.yaml").read_text()
    bad = local_cli(site, "resume", str(run), "--steps", "6", "--args", "--lr fast")
    assert bad.returncode == 2 and "--args: argument --lr: invalid float value: 'fast'" in " ".join(bad.stderr.split())
    assert "Traceback" not in bad.stderr and (run / "run.yaml").read_text() == before
    assert sorted(p.name for p in (run / "attempts").iterdir()) == ["0"]
    r = local_cli(site, "resume", str(run), "--steps", "6", "--args", "--lr 1e-3 --clip-grad 0.5", "--json", timeout=600)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["steps"] == 6
    import yaml

    assert yaml.safe_load((run / "run.yaml").read_text())["inputs"]["script_args"] == ["--lr", "1e-3", "--clip-grad", "0.5"]
    spec = json.loads((run / "attempts" / "1" / "launch.json").read_text())
    assert all(x["argv"][-4:] == ["--lr", "1e-3", "--clip-grad", "0.5"] for n in spec["nodes"] for x in n["ranks"])
