"""The elastic run (``hetctl.elastic.loop.ElasticRun``) with a scripted attempt function.

Everything above one attempt is real: the policy, the loop, ``run.yaml`` and
``events.jsonl`` in a real run folder, checkpoint manifests on disk (written by
the same code the trainer uses), the planner for re-plans, and the CLI's closing
lines. Only the attempts are scripted, so each test states a whole failure story
and checks what the user and ``hetctl resume`` would see.
"""

from __future__ import annotations

import pytest
import typer

from hetctl.elastic.loop import ElasticRun, Prepared
from hetctl.elastic.policy import PolicyConfig
from hetctl.elastic.start import prepare_launch
from hetctl.errors import StartFailed
from hetctl.files.cluster import Chip, Cluster, NodeFacts
from hetctl.files.eventlog import EVENT_TYPES, parse_event, read_events
from hetctl.files.inventory import Inventory, Node
from hetctl.files.run import LaunchOptions
from hetctl.files.yamlio import save_model
from hetctl.launch.outcome import AttemptOutcome, FailureRecord, FaultKind, RunState
from hetctl.node import manifest
from hetctl.plan.models import load_model as load_spec
from hetctl.plan.planner import plan_cluster
from hetctl.plan.candidates import Pins


def cpu_cluster(*names: str) -> Cluster:
    return Cluster(nodes=[NodeFacts(name=n, host=n, tflops_override=1.0, memory_gb=16.0,
                                    chips=[Chip(index=0, vendor="cpu", model="cpu", memory_gb=16.0)])
                          for n in names])


@pytest.fixture
def site(tmp_path):
    """A three-node cluster file, its plan (PP=3) and a prepared run whose checkpoints go to tmp_path/ck."""
    cl = cpu_cluster("a", "b", "c")
    cluster_file = tmp_path / "cluster.yaml"
    save_model(cluster_file, cl)
    plan = plan_cluster(cl, load_spec("tiny"), pins=Pins(pp=3, dp=1), cluster_path=str(cluster_file))
    inv = Inventory(checkpoint_dir=str(tmp_path / "ck"), nodes=[Node(name=n, host=n) for n in ("a", "b", "c")])
    return tmp_path, plan, inv


def prepared(site, **policy) -> Prepared:
    tmp_path, plan, inv = site
    return prepare_launch(plan, inv, LaunchOptions(steps=20, checkpoint_every=4), run_root=tmp_path / "runs",
                          plan_path=None, policy=PolicyConfig(**policy))


class Script:
    """The attempts, in order: each a function of the request returning an outcome (or raising)."""

    def __init__(self, *steps):
        self.steps = list(steps)
        self.requests = []

    def __call__(self, req, **kwargs):
        self.requests.append(req)
        return self.steps.pop(0)(req)


def ok(last=20, loss=1.5, first=5.0, stage_ms=None):
    return lambda req: AttemptOutcome(RunState.SUCCEEDED, last_step=last, final_loss=loss, first_loss=first,
                                      tokens_per_s=1000.0, stage_step_ms=stage_ms or {})


def crash(node="b", rank=1, last=7, first=5.0):
    return lambda req: AttemptOutcome(RunState.FAILED, last_step=last, first_loss=first, final_loss=3.0,
                                      failures=[FailureRecord(FaultKind.CRASH, node, 0.0, rank=rank, exit_code=1,
                                                              reason="exit code 1")])


def write_checkpoint(ck_dir, step, plan, corrupt=False):
    d = manifest.step_dir(ck_dir, step)
    d.mkdir(parents=True)
    (d / "layer-0.pt").write_bytes(b"weights %d" % step)
    manifest.write_manifest(d, step, manifest.model_digest(plan.model.model_dump()))
    if corrupt:  # same size, other bytes: only the checksum can tell
        (d / "layer-0.pt").write_bytes(b"weights %d" % (step + 1))


def test_the_fault_policy_is_recorded_and_a_resume_keeps_what_it_is_not_given(site):
    """launch's --max-restarts, --hang-timeout, … go into run.yaml; resume takes them from there, except the
    options it is given, and records the result (it used to fall back to its own defaults)."""
    from hetctl.elastic.resume import resumed_faults
    from hetctl.elastic.start import policy_and_thresholds
    from hetctl.files.run import RunDir
    from hetctl.launch.controller import Thresholds

    tmp_path, plan, inv = site
    prep = prepare_launch(plan, inv, LaunchOptions(steps=20, checkpoint_every=4), run_root=tmp_path / "runs",
                          plan_path=None, policy=PolicyConfig(max_restarts=7, max_node_failures=2, rebalance=True),
                          thresholds=Thresholds(grace_s=1.5, hang_timeout=3600.0, node_timeout=45.0))
    prep.lock.release()
    recorded = RunDir.open(prep.run.path).load_info().inputs.faults
    assert recorded.model_dump() == {"max_restarts": 7, "max_node_failures": 2, "rebalance": True, "grace": 1.5,
                                     "hang_timeout": 3600.0, "node_timeout": 45.0}
    policy, th = policy_and_thresholds(recorded)
    assert (policy.max_restarts, policy.max_node_failures, policy.rebalance) == (7, 2, True)
    assert (th.grace_s, th.hang_timeout, th.node_timeout) == (1.5, 3600.0, 45.0)
    assert resumed_faults(recorded, {"hang_timeout": None, "grace": None}) == recorded  # nothing given: the run's
    changed = resumed_faults(recorded, {"node_timeout": 10.0, "rebalance": False, "hang_timeout": None})
    assert changed.model_dump() == {**recorded.model_dump(), "node_timeout": 10.0, "rebalance": False}
    with pytest.raises(TypeError, match="not a fault option: hang"):
        resumed_faults(recorded, {"hang": 1.0})


def test_restarts_used_up_fail_with_exit_5_and_the_resume_line(site, capsys):
    prep = prepared(site, max_restarts=1, max_node_failures=9)
    script = Script(crash(), crash(last=9))
    result = ElasticRun(prep, attempt_fn=script).run()
    s = result.summary
    assert s.state == "failed" and s.attempts == 2 and s.restarts == 1
    assert "restarts used up (1/1)" in s.reason
    info = prep.run.load_info()
    assert info.state == "failed" and info.tally["restarts"] == 1 and info.tally["node_failures"] == {"b": 2}
    kinds = [e["kind"] for e in read_events(prep.run.events_path)]
    assert kinds == ["checkpoint_unseen", "resume_source", "restart", "gave_up", "failed"]
    (rec,) = read_events(prep.run.events_path, "resume_source")
    assert (rec["recovery_path"], rec["resume_step"], rec["steps_lost"]) == ("checkpoint", None, 7)
    assert rec["reason"] == "no valid checkpoint: from step 0; the controller sees no checkpoint folder"
    from hetctl.cli.runview import finish_launch

    with pytest.raises(typer.Exit) as e:
        finish_launch(result, json_out=False)
    assert e.value.exit_code == 5
    assert f"hetctl resume {s.run_dir}" in capsys.readouterr().err


def test_a_corrupt_newest_checkpoint_is_skipped_and_the_restart_uses_the_one_before(site):
    tmp_path, plan, _ = site
    prep = prepared(site)
    ck = prep.info.inputs.checkpoint_dir
    write_checkpoint(ck, 4, plan)
    write_checkpoint(ck, 8, plan, corrupt=True)
    script = Script(crash(last=9), ok())
    result = ElasticRun(prep, attempt_fn=script).run()
    assert result.summary.state == "succeeded"
    assert [r.resume_step for r in script.requests] == [0, 4]
    events = read_events(prep.run.events_path)
    skipped = [e for e in events if e["kind"] == "checkpoint_skipped"]
    assert [e["step"] for e in skipped] == [8] and "layer-0.pt" in " ".join(skipped[0]["problems"])
    assert [e["resume_step"] for e in events if e["kind"] == "restart"] == [4]


def test_losses_carry_across_attempts_and_an_attempt_that_trains_nothing_keeps_the_last_loss(site):
    prep = prepared(site)
    write_checkpoint(prep.info.inputs.checkpoint_dir, 20, site[1])
    # attempt 0 reaches step 20 and reports its loss, then crashes; attempt 1 resumes at 20: nothing to train
    finished_then_crashed = lambda req: AttemptOutcome(  # noqa: E731
        RunState.FAILED, last_step=20, first_loss=5.0, final_loss=1.25,
        failures=[FailureRecord(FaultKind.CRASH, "c", 0.0, rank=2, reason="exit code 1")])
    nothing_left = lambda req: AttemptOutcome(RunState.SUCCEEDED, last_step=20)  # noqa: E731
    result = ElasticRun(prep, attempt_fn=Script(finished_then_crashed, nothing_left)).run()
    s = result.summary
    assert (s.state, s.first_loss, s.final_loss, s.steps) == ("succeeded", 5.0, 1.25, 20)


def test_a_rebalance_replans_with_measured_speeds_and_reports_the_speedup(site):
    tmp_path, plan, _ = site
    prep = prepared(site, rebalance=True)
    slow = plan.stages[1].node
    straggling = lambda req: AttemptOutcome(  # noqa: E731
        RunState.FAILED, last_step=6, first_loss=5.0,
        stage_step_ms={(0, 0): 100.0, (0, 1): 400.0, (0, 2): 100.0},
        failures=[FailureRecord(FaultKind.STRAGGLER, slow, 0.0, reason="stage 1 is 4.00x slower")])
    script = Script(straggling, ok(stage_ms={(0, 0): 150.0, (0, 1): 200.0, (0, 2): 160.0}))
    result = ElasticRun(prep, attempt_fn=script).run()
    assert result.summary.state == "succeeded"
    before, after = script.requests[0].plan, script.requests[1].plan
    layers = lambda p, node: sum(s.layers[1] - s.layers[0] for s in p.stages if s.node == node)  # noqa: E731
    assert layers(after, slow) < layers(before, slow)
    events = {e["kind"]: e for e in read_events(prep.run.events_path)}
    assert events["replan"]["measured"] is True
    # speed = (best measured/planned ratio) / (this node's ratio): the slow node ran 4x its peers' ms
    # (planned: the plan's compute per step, sends left out, the unit the heartbeats measure)
    planned = {(s.replica, s.stage): s.compute_ms * before.micro_batches_of(s.replica) for s in before.stages}
    assert all(s.compute_ms < s.est_ms for s in before.stages)  # a 3-stage pipeline: every stage sends
    ratio = {k: ms / planned[k] for k, ms in {(0, 0): 100.0, (0, 1): 400.0, (0, 2): 100.0}.items()}
    assert events["replan_layout"]["speed_factors"][slow] == pytest.approx(min(ratio.values()) / ratio[(0, 1)],
                                                                           abs=1e-3)
    assert events["rebalanced"]["speedup"] == pytest.approx(400.0 / 200.0)
    assert prep.run.attempts() == [0, 1] and prep.run.load_plan(1).stages == after.stages


def test_a_node_that_cannot_start_later_is_dropped_but_on_the_first_attempt_it_is_the_users_error(site):
    prep = prepared(site, max_node_failures=9)
    lost_c = lambda req: AttemptOutcome(  # noqa: E731
        RunState.FAILED, last_step=3, failures=[FailureRecord(FaultKind.NODE_LOST, "c", 0.0, reason="gone")])

    def cannot_start_b(req):
        raise StartFailed("cannot launch on node b: python missing",
                          failures=[FailureRecord(FaultKind.START, "b", 0.0, reason="python missing")])

    script = Script(lost_c, cannot_start_b, ok())
    result = ElasticRun(prep, attempt_fn=script).run()
    assert result.summary.state == "succeeded"
    assert [sorted({r.node for r in q.plan.ranks}) for q in script.requests] == [["a", "b", "c"], ["a", "b"], ["a"]]

    first = prepared(site)
    with pytest.raises(StartFailed, match="python missing"):
        ElasticRun(first, attempt_fn=Script(cannot_start_b)).run()
    info = first.run.load_info()
    assert info.state == "failed" and info.summary.reason == "cannot launch on node b: python missing"


def test_a_user_stop_ends_stopped_without_a_restart(site):
    prep = prepared(site)
    result = ElasticRun(prep, attempt_fn=Script(lambda req: AttemptOutcome(RunState.STOPPED, last_step=2))).run()
    assert result.summary.state == "stopped"
    assert [e["kind"] for e in read_events(prep.run.events_path)] == ["stopped"]


def sample_event(cls):
    """An instance of an event class with a plausible value in every field (from its type hints)."""
    import dataclasses
    import typing

    samples = {int: 3, float: 1.5, str: "x", bool: True}
    values = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        origin = typing.get_origin(hint)
        if hint in samples:
            values[f.name] = samples[hint]
        elif origin is list:
            values[f.name] = [3] if typing.get_args(hint) == (int,) else ["x"] if typing.get_args(hint) == (str,) else []
        elif origin is dict:
            values[f.name] = {"n": 1.0}
        else:  # X | None
            inner = [a for a in typing.get_args(hint) if a is not type(None)][0]
            values[f.name] = samples.get(inner)
    return cls(**values)


def test_every_event_kind_round_trips_through_its_model(site):
    """What the loop and the controller write is what the typed models read back, for every kind."""
    from hetctl.files.eventlog import EventLog

    for kind, cls in EVENT_TYPES.items():
        ev = sample_event(cls)
        path = site[0] / f"{kind}.jsonl"
        with EventLog(path) as log:
            log.emit(ev)
        (line,) = read_events(path)
        assert line["kind"] == kind and parse_event(line) == ev


def test_a_listener_gets_the_typed_event_with_its_lines_time(tmp_path):
    """Listeners get the event object, not the dict written; its ``ts`` is the line's, and the line is as before."""
    from hetctl.files.eventlog import EventLog
    from hetctl.files.events import RankFailed

    seen = []
    ev = RankFailed(attempt=1, node="n2", rank=5, reason="killed by SIGKILL", signal=9)
    with EventLog(tmp_path / "events.jsonl", listeners=[seen.append], clock=lambda: 1700000000.25) as log:
        written = log.emit(ev)
    (got,) = seen
    assert type(got) is RankFailed and got == ev and got.ts == 1700000000.25
    assert ev.ts is None  # the caller's event is left as it was
    assert (tmp_path / "events.jsonl").read_text() == (
        '{"ts":1700000000.25,"kind":"rank_failed","attempt":1,"node":"n2","rank":5,"reason":"killed by SIGKILL",'
        '"exit_code":null,"signal":9}\n')
    assert read_events(tmp_path / "events.jsonl") == [written]
    assert parse_event(written).ts == got.ts  # read back: the same event at the same time


def test_every_attempt_that_trained_is_compared_with_its_plan(site):
    tmp_path, plan, _ = site
    prep = prepared(site)
    m = plan.parallel.micro_batches
    measured_ms = {(s.replica, s.stage): s.compute_ms * m * (2.0 + s.stage) for s in plan.stages}  # 2x, 3x, 4x
    tokens = plan.parallel.global_batch * plan.model.seq_len
    step_s = plan.estimate.step_time_s * 5.0

    def trained(req):
        return AttemptOutcome(RunState.SUCCEEDED, last_step=20, final_loss=1.0, first_loss=5.0,
                              tokens_per_s=tokens / step_s, stage_step_ms=measured_ms)

    result = ElasticRun(prep, attempt_fn=Script(trained)).run()
    (ev,) = [e for e in read_events(prep.run.events_path) if e["kind"] == "measured"]
    assert [round(s["ratio"], 3) for s in ev["stages"]] == [2.0, 3.0, 4.0]
    assert ev["step_ratio"] == pytest.approx(5.0, rel=1e-3)
    assert result.summary.step_ratio == pytest.approx(5.0, rel=1e-3)
    assert result.summary.predicted_step_s == plan.estimate.step_time_s


def test_calibrate_plans_on_the_measured_speeds(site):
    """A run whose middle stage computed 4x slower than planned → --calibrate moves layers off that node."""
    import subprocess
    import sys

    tmp_path, plan, _ = site
    prep = prepared(site)
    m = plan.parallel.micro_batches
    slow = plan.stages[1].node
    from hetctl.runs.linkfit import sends_per_step

    sends = sends_per_step(plan, cpu_cluster("a", "b", "c"))  # est_ms holds them, a heartbeat's compute does not
    for s in plan.stages:  # the plan's compute_ms is exactly its est_ms less the sends the cost model put in it
        assert s.compute_ms * m == pytest.approx(s.est_ms * m - sends[(s.replica, s.stage)], rel=1e-3, abs=1e-3)
    measured_ms = {(s.replica, s.stage): s.compute_ms * m * (4.0 if s.node == slow else 1.0) for s in plan.stages}
    ElasticRun(prep, attempt_fn=Script(ok(stage_ms=measured_ms))).run()
    # the run's plan points at the site's cluster file, as `hetctl plan` writes it
    r = subprocess.run([sys.executable, "-m", "hetctl", "plan", "--calibrate", str(prep.run.path), "-o", "plan2",
                        "--json"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    from hetctl.files.plan import Plan as PlanModel

    new = PlanModel.model_validate_json(r.stdout)
    layers = lambda p, node: sum(s.layers[1] - s.layers[0] for s in p.stages if s.node == node)  # noqa: E731
    assert layers(new, slow) < layers(plan, slow)
    assert new.notes[0].startswith(f"calibrated on run {prep.run.run_id} attempt 0") and f"{slow} ×0.25" in new.notes[0]
    assert new.model == plan.model and new.parallel.global_batch == plan.parallel.global_batch
    assert (tmp_path / "plan2" / "cluster.calibrated.yaml").is_file() and new.cluster.endswith("cluster.calibrated.yaml")
    # The links the plan used are fitted too (to the run's 1,000 tokens/s), and the re-plan reads them.
    from hetctl.files.cluster import Cluster
    from hetctl.files.yamlio import load_model

    facts = load_model(tmp_path / "plan2" / "cluster.calibrated.yaml", Cluster)
    hops = {(s.node, n.node) for s, n in zip(plan.stages, plan.stages[1:])}
    assert {(lk.src, lk.dst) for lk in facts.links if lk.method == "calibrated"} == hops
    assert "links fitted to the measured step" in new.notes[0]
    assert any("links calibrated by plan --calibrate" in n for n in new.notes), new.notes


def test_report_draws_the_planned_and_the_measured_timeline(site):
    from html.parser import HTMLParser

    from hetctl.runs.report import render

    tmp_path, plan, _ = site
    prep = prepared(site)
    m = plan.parallel.micro_batches
    slow = plan.stages[2]
    measured_ms = {(s.replica, s.stage): s.est_ms * m * (3.0 if s is slow else 1.0) for s in plan.stages}
    crash_first = crash(node="b<script>", rank=1)  # outside strings are escaped in the page
    ElasticRun(prep, attempt_fn=Script(crash_first, ok(stage_ms=measured_ms))).run()
    page = render(prep.run.path)

    class Count(HTMLParser):
        def __init__(self):
            super().__init__()
            self.svgs, self.ops = 0, []

        def handle_starttag(self, tag, attrs):
            a = dict(attrs)
            if tag == "svg" and a.get("class") == "timeline":
                self.svgs += 1
            if tag == "rect" and a.get("class") in ("f", "b"):
                self.ops.append(a["class"])

    c = Count()
    c.feed(page)
    assert c.svgs == 2  # planned and measured
    assert len(c.ops) == 2 * (2 * m * len(plan.stages))  # every forward and backward of every stage, twice
    assert f"slowest stage as measured: <b>{slow.stage}: {slow.node}" in page
    assert "<script>" not in page and "b&lt;script&gt;" in page
    assert "rank_failed" in page or "restart" in page


def test_a_warm_spare_importing_holds_the_straggler_watch_until_it_is_ready(site):
    """The loop's listener: standby ``importing`` (any attempt's spare) holds the running attempt's watch;
    its ``ready`` releases it, and only then is a slow stage judged."""
    from hetctl.files.events import Standby

    tmp_path, plan, _ = site
    prep = prepared(site, straggler_window=2, straggler_patience=2)
    slow = plan.stages[1]
    timings = {(s.replica, s.stage): plan.compute_ms_per_step(s) * (3.0 if s is slow else 1.0) for s in plan.stages}
    seen: dict[str, int] = {}

    def attempt(req, **kw):
        events, hook = kw["events"], kw["on_progress"]
        events.emit(Standby(attempt=req.attempt, node=slow.node, rank=1, state="importing", pid=4242))
        for _ in range(8):
            hook(timings)
        seen["while_importing"] = len([e for e in read_events(prep.run.events_path) if e["kind"] == "straggler"])
        events.emit(Standby(attempt=req.attempt, node=slow.node, rank=1, state="ready", pid=4242))
        for _ in range(3):
            hook(timings)
        return ok()(req)

    ElasticRun(prep, attempt_fn=attempt).run()
    found = [e for e in read_events(prep.run.events_path) if e["kind"] == "straggler"]
    assert seen["while_importing"] == 0
    assert [(e["node"], e["stage"]) for e in found] == [(slow.node, slow.stage)]
    assert found[0]["planned_ms"] == pytest.approx(plan.compute_ms_per_step(slow), abs=1e-3)  # ms a step, as measured
    # both figures are recorded to 1 µs: compare with the unrounded slow-down, not 3 × a rounded figure
    assert found[0]["measured_ms"] == pytest.approx(3.0 * plan.compute_ms_per_step(slow), abs=1e-3)
