"""Checkpoints from peers: which survivors' state makes a step, and which state the next attempt resumes from.

Pure and file-level tests (no torch, no processes): the dumps are folders laid out
exactly as :mod:`hetctl.train.jit` writes them, with manifests written by the same
:func:`hetctl.node.manifest.write_manifest`; the payloads are stand-in bytes, since
only their hashes matter here. Real dumps by real ranks are in ``test_jit_e2e.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hetctl.elastic.peers import CHECKPOINT, PEER, recover, resume_point
from hetctl.files.events import ResumeSource
from hetctl.files.eventlog import EventLog, parse_event, read_events
from hetctl.node import jitstate, manifest
from hetctl.node.jitstate import Dump, choose
from hetctl.train.units import STATE, expected_files, unit_files

MODEL = {"name": "t", "num_layers": 4, "hidden_size": 8, "ffn_hidden_size": 16, "num_attention_heads": 2,
         "num_query_groups": 2, "vocab_size": 32, "seq_len": 4}
DIGEST = manifest.model_digest(MODEL)
EXPECTED = expected_files(4)
STAGE = {0: ((0, 2), True, False), 1: ((2, 4), False, True)}  # a PP=2 split of the 4 layers
RANKS = {0: (0, 0), 1: (1, 0), 2: (0, 1), 3: (1, 1)}  # rank → (stage, replica): dp=2


def payload(name: str, step: int) -> bytes:
    return f"{name} at step {step}".encode()  # replicas of a stage hold the same bytes


def dump(ckpt: Path, attempt: int, rank: int, step: int, *, completed: int | None = None, manifest_last: bool = True,
         files: list[str] | None = None) -> Path:
    """One rank's dump of ``step``, as the trainer lays it out: its stage's files, then the manifest."""
    stage = RANKS[rank][0]
    names = files if files is not None else unit_files(*STAGE[stage])
    d = manifest.step_dir(jitstate.rank_dir(ckpt, attempt, rank), step)
    d.mkdir(parents=True)
    entries = {}
    for name in names:
        data = payload(name, step)
        manifest.write_atomic(d / name, data)
        entries[name] = manifest.file_entry(data)
    if manifest_last:
        meta = {"kind": "jit", "rank": rank, "stage": stage, "completed": step if completed is None else completed}
        manifest.write_manifest(d, step, DIGEST, files=entries, meta=meta)
    return d


def checkpoint(ckpt: Path, step: int) -> None:
    """A complete ordinary checkpoint of ``step``."""
    d = manifest.step_dir(ckpt, step)
    d.mkdir(parents=True)
    for name in EXPECTED:
        manifest.write_atomic(d / name, payload(name, step))
    manifest.write_manifest(d, step, DIGEST)


def fake(rank: int, step: int, files, problems=()) -> Dump:
    return Dump(attempt=0, rank=rank, step=step, path=Path(f"/r{rank}/s{step}"),
                files={n: {"size": 1, "sha256": "x"} for n in files}, completed=step, problems=tuple(problems))


S0, S1 = unit_files(*STAGE[0]), unit_files(*STAGE[1])


# --- the choice, pure ------------------------------------------------------------------------------

def test_a_step_is_complete_when_the_survivors_together_hold_every_file():
    # rank 3 (stage 1 of replica 1) died: rank 1 holds stage 1, ranks 0 and 2 stage 0
    choice, notes = choose([fake(0, 7, S0), fake(1, 7, S1), fake(2, 7, S0)], EXPECTED)
    assert choice is not None and choice.step == 7 and notes == []
    assert choice.ranks == [0, 1]  # each file from the lowest rank holding it
    assert {choice.sources[n].rank for n in S1 if n != STATE} == {1}
    assert set(choice.sources) == EXPECTED


def test_a_stage_that_lost_both_replicas_makes_no_step():
    choice, notes = choose([fake(0, 7, S0), fake(2, 7, S0)], EXPECTED)
    assert choice is None
    assert notes == ["step 7: the dumps of rank 0, 2 lack head.pt, layer-00002.pt, layer-00003.pt"]


def test_the_newest_complete_step_wins_over_a_newer_incomplete_one():
    # Rank 0 passed the commit barrier of step 8 and wrote both 7 and 8; the others only reached 7.
    dumps = [fake(0, 7, S0), fake(0, 8, S0), fake(1, 7, S1), fake(2, 7, S0)]
    choice, notes = choose(dumps, EXPECTED)
    assert choice.step == 7
    assert notes == ["step 8: the dumps of rank 0 lack head.pt, layer-00002.pt, layer-00003.pt"]


def test_an_invalid_dump_is_never_used_and_its_peer_covers_it():
    bad = fake(0, 7, S0, problems=["layer-00000.pt: sha256 mismatch (corrupted)"])
    choice, notes = choose([bad, fake(1, 7, S1), fake(2, 7, S0)], EXPECTED)
    assert choice.step == 7 and choice.ranks == [1, 2]
    assert notes == ["rank 0 step 7: layer-00000.pt: sha256 mismatch (corrupted)"]
    assert choose([bad, fake(1, 7, S1)], EXPECTED)[0] is None


def test_no_dumps_no_choice():
    assert choose([], EXPECTED) == (None, [])


# --- real folders ------------------------------------------------------------------------------------

def test_scan_reads_what_the_trainer_layout_holds(tmp_path):
    dump(tmp_path, 3, 0, 12, completed=11)
    dump(tmp_path, 3, 1, 12)
    found = jitstate.scan(tmp_path, 3, DIGEST)
    assert [(d.rank, d.step, d.valid, d.completed) for d in found] == [(0, 12, True, 11), (1, 12, True, 12)]
    assert jitstate.scan(tmp_path, 2, DIGEST) == [] and jitstate.attempts(tmp_path) == [3]
    assert jitstate.last_completed(found) == 12


def test_a_dump_cut_short_before_its_manifest_is_not_used(tmp_path):
    dump(tmp_path, 0, 0, 9)
    dump(tmp_path, 0, 1, 9, manifest_last=False)  # SIGKILLed after the files, before the manifest
    choice, notes = choose(jitstate.scan(tmp_path, 0, DIGEST), EXPECTED)
    assert choice is None
    assert notes[0] == "rank 1 step 9: no manifest.json (the checkpoint was never finished)"


def test_a_corrupted_or_foreign_dump_is_not_used(tmp_path):
    dump(tmp_path, 0, 0, 9)
    dump(tmp_path, 0, 1, 9)
    d2 = dump(tmp_path, 0, 2, 9)
    d3 = dump(tmp_path, 0, 3, 9)
    p = d3 / "head.pt"
    p.write_bytes(p.read_bytes()[:-1] + b"?")  # same size, other bytes
    (d2 / "layer-00000.pt").write_bytes(b"")  # truncated
    found = {d.rank: d for d in jitstate.scan(tmp_path, 0, DIGEST)}
    assert found[3].problems == ("head.pt: sha256 mismatch (corrupted)",)
    assert found[2].problems[0].startswith("layer-00000.pt: 0 bytes")
    choice, _ = choose(found.values(), EXPECTED)
    assert choice.ranks == [0, 1]  # the peers' copies, not the damaged ones
    assert jitstate.scan(tmp_path, 0, "another-model")[0].problems[0].startswith("model digest")


def test_promote_makes_an_ordinary_checkpoint_of_the_chosen_files(tmp_path):
    for r in (0, 1, 2):
        dump(tmp_path, 1, r, 14)
    stale = manifest.step_dir(tmp_path, 14)  # an asynchronous save of step 14 that never got its manifest
    stale.mkdir()
    (stale / "head.pt").write_bytes(b"half a file")
    choice, _ = choose(jitstate.scan(tmp_path, 1, DIGEST), EXPECTED)
    path = jitstate.promote(tmp_path, choice, DIGEST)
    assert path == stale and manifest.validate(path, DIGEST) == []
    assert manifest.latest_valid(tmp_path, DIGEST) == (14, path)
    assert {n: (path / n).read_bytes() for n in EXPECTED} == {n: payload(n, 14) for n in EXPECTED}
    assert manifest.read_manifest(path)["meta"]["source"] == "jit"
    jitstate.discard(tmp_path, 1)
    assert not (tmp_path / "jit").exists() and manifest.validate(path, DIGEST) == []  # its files are its own


def test_promote_refuses_a_file_changed_after_it_was_verified(tmp_path):
    for r in (0, 1):
        dump(tmp_path, 0, r, 5)
    choice, _ = choose(jitstate.scan(tmp_path, 0, DIGEST), EXPECTED)
    (choice.sources["head.pt"].path / "head.pt").write_bytes(b"head at step 6")
    with pytest.raises(OSError, match="changed after it was verified"):
        jitstate.promote(tmp_path, choice, DIGEST)
    assert manifest.latest_valid(tmp_path, DIGEST) is None


# --- the resume point ---------------------------------------------------------------------------------

def latest(ckpt: Path):
    return lambda: (manifest.latest_valid(ckpt, DIGEST) or (None,))[0]


def test_peer_state_newer_than_the_checkpoint_is_the_resume_point(tmp_path):
    checkpoint(tmp_path, 10)
    for r in (0, 1, 2):  # rank 3 was killed during step 18
        dump(tmp_path, 0, r, 17)
    point = resume_point(tmp_path, MODEL, attempt=0, last_step=17, dp=2, latest=latest(tmp_path))
    assert (point.step, point.recovery_path, point.steps_lost, point.ranks) == (17, PEER, 0, [0, 1])
    assert manifest.validate(manifest.step_dir(tmp_path, 17), DIGEST) == []
    assert not (tmp_path / "jit").exists()


def test_without_complete_peer_state_the_checkpoint_is_the_resume_point(tmp_path):
    checkpoint(tmp_path, 10)
    dump(tmp_path, 0, 0, 17)
    dump(tmp_path, 0, 2, 17)  # stage 1 lost both replicas
    point = resume_point(tmp_path, MODEL, attempt=0, last_step=17, dp=2, latest=latest(tmp_path))
    assert (point.step, point.recovery_path, point.steps_lost) == (10, CHECKPOINT, 7)
    assert point.reason == ("the newest valid checkpoint, step 10; no complete state from the survivors: step 17: "
                            "the dumps of rank 0, 2 lack head.pt, layer-00002.pt, layer-00003.pt")
    assert manifest.latest_valid(tmp_path, DIGEST)[0] == 10


def test_dp1_falls_back_to_the_checkpoint_and_says_why(tmp_path):
    checkpoint(tmp_path, 10)
    point = resume_point(tmp_path, MODEL, attempt=0, last_step=16, dp=1, latest=latest(tmp_path))
    assert (point.step, point.recovery_path, point.steps_lost) == (10, CHECKPOINT, 6)
    assert point.reason.endswith("dp=1: no replica holds a copy of the failed rank's stage")


def test_peer_state_no_newer_than_the_checkpoint_is_not_promoted(tmp_path):
    checkpoint(tmp_path, 10)
    for r in (0, 1):
        dump(tmp_path, 0, r, 10)
    point = resume_point(tmp_path, MODEL, attempt=0, last_step=10, dp=2, latest=latest(tmp_path))
    assert (point.step, point.recovery_path, point.steps_lost) == (10, CHECKPOINT, 0)
    assert "as new as the survivors' state" in point.reason


def test_only_the_failed_attempts_dumps_count(tmp_path):
    for r in (0, 1):
        dump(tmp_path, 0, r, 30)  # an older attempt's, e.g. left by a killed controller
    point = resume_point(tmp_path, MODEL, attempt=1, last_step=12, dp=2, latest=latest(tmp_path))
    assert (point.step, point.recovery_path, point.steps_lost) == (None, CHECKPOINT, 12)


def test_recover_writes_a_typed_recovery_event_and_returns_the_summary_record(tmp_path):
    from hetctl.elastic.loop import latest_checkpoint

    ckpt = tmp_path / "ck"
    checkpoint(ckpt, 10)
    for r in (0, 1, 2):
        dump(ckpt, 2, r, 13)

    class Plan:
        class parallel:
            dp = 2

    with EventLog(tmp_path / "events.jsonl") as log:
        step, record = recover(ckpt, MODEL, (2, Plan, 13), log.emit, latest_checkpoint)
    assert step == 13 and (record.attempt, record.recovery_path, record.steps_lost) == (3, PEER, 0)
    (ev,) = read_events(tmp_path / "events.jsonl", "resume_source")
    assert isinstance(parse_event(ev), ResumeSource)
    assert (ev["attempt"], ev["failed_attempt"], ev["resume_step"], ev["last_step"]) == (3, 2, 13, 13)


def test_the_text_summary_says_where_each_recovery_took_its_state(capsys):
    from hetctl.cli.runview import finish_launch
    from hetctl.elastic.loop import RunResult
    from hetctl.files.run import RecoveryRecord, RunSummary
    from hetctl.launch.outcome import AttemptOutcome, RunState

    summary = RunSummary(run_id="r", run_dir="/r", state="succeeded", steps=20, recoveries=[
        RecoveryRecord(attempt=1, recovery_path=PEER, resume_step=13, steps_lost=0),
        RecoveryRecord(attempt=2, recovery_path=CHECKPOINT, resume_step=10, steps_lost=6)])
    finish_launch(RunResult(summary, AttemptOutcome(RunState.SUCCEEDED)), json_out=False)
    out = capsys.readouterr().out
    assert "attempt 1: from its peers at step 13, 0 completed steps lost" in out
    assert "attempt 2: from the checkpoint at step 10, 6 completed steps lost" in out
