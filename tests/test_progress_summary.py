"""``progress`` events at scale (issue 36): every replica's entry up to 64, else one summary per stage, with the
full list at most every ten minutes (pure: no process, no clock)."""

from __future__ import annotations

import json

from hetctl.files.eventlog import EventLog, parse_event, read_events
from hetctl.files.events import Progress, StageProgress
from hetctl.launch.progress import FULL_ENTRIES, FULL_EVERY_S, ProgressEntries, summarize


def entries(dp: int, pp: int = 2, step: int = 10) -> list[StageProgress]:
    return [StageProgress(replica=r, stage=s, step=step + (r % 3 == 0), loss=2.0 + r if s == pp - 1 else None,
                          step_ms=100.0 + (r * 7) % 50 + s, xv_bytes=1000 + r, xv_raw_bytes=4000 + r)
            for r in range(dp) for s in range(pp)]


def test_a_summary_keeps_each_stages_slowest_replica_lowest_step_and_summed_bytes():
    full = entries(dp=40)
    got = summarize(full)
    assert [e.stage for e in got] == [0, 1]
    for e in got:
        mine = [x for x in full if x.stage == e.stage]
        slowest = max(mine, key=lambda x: x.step_ms)
        assert (e.replica, e.step_ms, e.loss) == (slowest.replica, slowest.step_ms, slowest.loss)
        assert e.step == min(x.step for x in mine) == 10
        assert e.xv_bytes == sum(x.xv_bytes for x in mine) and e.xv_raw_bytes == sum(x.xv_raw_bytes for x in mine)


def test_without_times_or_bytes_the_lowest_replica_stands_and_bytes_stay_none():
    got = summarize([StageProgress(replica=r, stage=0, step=5) for r in (3, 1, 2)])
    assert got == [StageProgress(replica=1, stage=0, step=5)]


def test_small_jobs_list_every_entry_in_every_event():
    choose = ProgressEntries()
    few = entries(dp=FULL_ENTRIES // 2)
    for t in (0.0, 2.0, 4.0):
        assert choose(few, t) == (few, None)


def test_large_jobs_list_every_entry_first_then_every_ten_minutes():
    choose, many = ProgressEntries(), entries(dp=512)
    assert choose(many, 100.0) == (many, None)
    stages, replicas = choose(many, 102.0)
    assert replicas == 512 and stages == summarize(many)
    assert choose(many, 100.0 + FULL_EVERY_S - 1)[1] == 512
    assert choose(many, 100.0 + FULL_EVERY_S) == (many, None)


def test_a_summarized_event_is_small_and_reads_back(tmp_path):
    many = entries(dp=512)
    stages, replicas = ProgressEntries()(many, 0.0)
    full_line = json.dumps(Progress(attempt=0, step=10, loss=2.0, stages=stages).fields())
    stages, replicas = summarize(many), 512
    with EventLog(tmp_path / "events.jsonl") as log:
        log.emit(Progress(attempt=0, step=10, loss=2.0, stages=stages, replicas=replicas))
    line = (tmp_path / "events.jsonl").read_text()
    assert len(line) * 100 < len(full_line)  # 2 entries instead of 1,024
    ev = parse_event(read_events(tmp_path / "events.jsonl")[0])
    assert ev.replicas == 512 and ev.stages == stages


def test_status_says_when_its_stages_are_a_summary(tmp_path):
    import os
    import subprocess
    import sys

    from hetctl.files.run import RunDir
    from hetctl.runs.status import view

    run = RunDir.create(tmp_path / "runs", "20261206-101010-abcd")
    (run.path / "run.yaml").write_text("run_id: 20261206-101010-abcd\ncreated: 0\nupdated: 0\nstate: succeeded\n"
                                       "inputs: {steps: 20, checkpoint_every: 0, checkpoint_dir: c}\n")
    many = entries(dp=512)
    with EventLog(run.events_path) as log:
        log.emit(Progress(attempt=0, step=10, loss=2.0, stages=many))
        log.emit(Progress(attempt=0, step=12, loss=1.9, stages=summarize(many), replicas=512))
    v = view(run.path)
    assert v.stages_of_replicas == 512 and [(s.stage, s.step) for s in v.stages] == [(0, 10), (1, 10)]
    r = subprocess.run([sys.executable, "-m", "hetctl", "status", str(run.path)], capture_output=True, text=True,
                       env={**os.environ, "COLUMNS": "200"}, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "each stage's slowest of 512 replicas" in " ".join(r.stdout.split())  # the title wraps to the table
