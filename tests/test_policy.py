"""The elastic policy and its control loop, driven by scripted failure sequences (no processes, no sleeping)."""

from __future__ import annotations

import pytest

from hetctl.errors import PlanInfeasible
from hetctl.launch.outcome import AttemptOutcome, FailureRecord, FaultKind, RunState, classify, CAUSE_ORDER
from hetctl.elastic.policy import Action, PolicyConfig, Tally, decide, describe, run_loop
from hetctl.elastic.straggler import StragglerHook, StragglerWatch, find_stragglers, predicted_gain, speed_factors


def crash(node="n1", rank=1, sig=9, t=0.0):
    return FailureRecord(FaultKind.CRASH, node, t, rank=rank, signal=sig)


def hang(node="n1", rank=1):
    return FailureRecord(FaultKind.HANG, node, 0.0, rank=rank, reason="no heartbeat for 3.0 s")


def lost(node="n2"):
    return FailureRecord(FaultKind.NODE_LOST, node, 0.0, reason="agent stream ended")


def failed(*records, last_step=0):
    return AttemptOutcome(RunState.FAILED, failures=list(records), last_step=last_step)


OK = AttemptOutcome(RunState.SUCCEEDED, last_step=20, final_loss=1.25)


# --- decide -------------------------------------------------------------------------------


def test_success_and_stop_end_the_run():
    t = Tally()
    assert decide(OK, t, PolicyConfig(), attempt=0).action == Action.FINISH
    assert decide(AttemptOutcome(RunState.STOPPED), t, PolicyConfig(), attempt=0).action == Action.STOP
    assert t.restarts == 0


def test_crash_restarts_same_plan_until_restarts_are_used_up():
    cfg = PolicyConfig(max_restarts=2, max_node_failures=99)
    t = Tally()
    actions = [decide(failed(crash(node=f"n{i}")), t, cfg, attempt=i).action for i in range(3)]
    assert actions == [Action.RESTART, Action.RESTART, Action.GIVE_UP]
    assert t.restarts == 2 and t.membership_changes == 0


def test_hang_is_treated_like_a_crash_and_named_as_a_hang():
    t = Tally()
    d = decide(failed(hang(node="n3", rank=5)), t, PolicyConfig(), attempt=0)
    assert d.action == Action.RESTART
    assert d.reason == "rank 5 on n3: no heartbeat for 3.0 s"
    assert t.node_failures["n3"] == 1


def test_root_cause_takes_the_blame_not_the_ranks_that_failed_after_it():
    t = Tally()
    out = failed(crash(node="n2", rank=3), crash(node="n1", rank=0, sig=None), crash(node="n3", rank=4))
    decide(out, t, PolicyConfig(), attempt=0)
    assert dict(t.node_failures) == {"n2": 1}


def test_node_lost_drops_every_lost_node_and_counts_a_membership_change_not_a_restart():
    cfg = PolicyConfig(max_restarts=0)
    t = Tally()
    d = decide(failed(lost("n2"), crash(node="n1"), lost("n3")), t, cfg, attempt=0)
    assert d.action == Action.REPLAN and d.drop == ("n2", "n3")
    assert t.membership_changes == 1 and t.restarts == 0
    assert t.dropped == ["n2", "n3"]


def test_repeated_failures_of_one_node_mark_it_abnormal_and_drop_it():
    cfg = PolicyConfig(max_restarts=10, max_node_failures=2)
    t = Tally()
    d1 = decide(failed(crash(node="n2")), t, cfg, attempt=0)
    d2 = decide(failed(crash(node="n1")), t, cfg, attempt=1)
    d3 = decide(failed(hang(node="n2")), t, cfg, attempt=2)
    assert [d1.action, d2.action, d3.action] == [Action.RESTART, Action.RESTART, Action.REPLAN]
    assert d3.drop == ("n2",) and d3.abnormal == ("n2",)
    assert "marked abnormal after 2 failures" in d3.reason
    assert t.abnormal == ["n2"] and t.membership_changes == 1 and t.restarts == 2


def test_start_failure_gives_up_on_first_attempt_and_drops_the_node_later():
    start = FailureRecord(FaultKind.START, "n4", 0.0, reason="python3.11: not found")
    assert decide(failed(start), Tally(), PolicyConfig(), attempt=0).action == Action.GIVE_UP
    d = decide(failed(start), Tally(), PolicyConfig(), attempt=2)
    assert d.action == Action.REPLAN and d.drop == ("n4",)


def test_straggler_ends_in_a_measured_replan_only_with_rebalance():
    s = FailureRecord(FaultKind.STRAGGLER, "n2", 0.0, reason="stage 1 1.9x slower")
    assert decide(failed(s), Tally(), PolicyConfig(rebalance=False), attempt=0).action == Action.GIVE_UP
    t = Tally()
    d = decide(failed(s), t, PolicyConfig(rebalance=True), attempt=0)
    assert d.action == Action.REPLAN and d.measured and d.drop == ()
    assert t.rebalances == 1 and t.restarts == 1


def test_failed_without_a_record_gives_up():
    assert decide(AttemptOutcome(RunState.FAILED), Tally(), PolicyConfig(), attempt=0).action == Action.GIVE_UP


def test_describe_names_rank_node_and_cause():
    assert describe(crash(node="n2", rank=3, sig=9)) == "rank 3 on n2 killed by signal 9"
    assert describe(FailureRecord(FaultKind.CRASH, "a", 0, rank=0, exit_code=1)) == "rank 0 on a exited 1"
    assert describe(lost("n7")) == "node n7 lost: agent stream ended"
    assert describe(FailureRecord(FaultKind.HANG, "a", 0, rank=2)) == "rank 2 on a hung (heartbeat stale)"
    assert describe(FailureRecord(FaultKind.CRASH, "a", 0, rank=2, signal=9, reason="killed by SIGKILL")) == \
        "rank 2 on a: killed by SIGKILL"


def test_tally_round_trips_through_a_dict():
    t = Tally()
    decide(failed(crash(node="n2")), t, PolicyConfig(), attempt=0)
    decide(failed(lost("n3")), t, PolicyConfig(), attempt=1)
    again = Tally.from_dict(t.to_dict())
    assert again == t


# --- the loop -----------------------------------------------------------------------------


class Script:
    """A scripted run: attempts return the given outcomes; events and calls are recorded."""

    def __init__(self, outcomes, checkpoints, infeasible_after=None):
        self.outcomes = list(outcomes)
        self.checkpoints = list(checkpoints)
        self.calls = []
        self.events = []
        self.replans = []
        self.now = 100.0
        self.slept = []
        self.infeasible_after = infeasible_after

    def run_attempt(self, attempt, plan, step):
        self.calls.append((attempt, plan, step))
        self.now += 1.0
        return self.outcomes.pop(0)

    def replan(self, plan, decision, outcome, tally):
        self.replans.append((plan, decision.drop, decision.measured))
        self.now += 0.25
        if self.infeasible_after is not None and len(self.replans) > self.infeasible_after:
            raise PlanInfeasible("stage 0 needs 80 GiB on n1 (64 GiB)")
        return f"{plan}-{'+'.join(decision.drop) or 'measured'}"

    def latest(self):
        return self.checkpoints.pop(0)

    def emit(self, event):
        self.events.append((event.kind, event.fields()))

    def go(self, cfg, **kw):
        return run_loop(
            "p0", run_attempt=self.run_attempt, replan=self.replan, latest_step=self.latest,
            emit=self.emit, config=cfg, clock=lambda: self.now, sleep=self.slept.append, **kw,
        )


def test_loop_crash_then_success_restarts_from_the_newest_checkpoint_with_the_same_plan():
    s = Script([failed(crash(node="n2", rank=3)), OK], checkpoints=[10])
    r = s.go(PolicyConfig(max_restarts=1))
    assert r.state == RunState.SUCCEEDED and r.attempts == 2 and r.last_attempt == 1
    assert s.calls == [(0, "p0", None), (1, "p0", 10)]
    assert [e[0] for e in s.events] == ["restart"]
    assert s.events[0][1]["resume_step"] == 10 and s.events[0][1]["attempt"] == 1
    assert r.root_cause.rank == 3 and r.outcome.final_loss == 1.25


def test_loop_node_loss_replans_on_survivors_then_succeeds():
    s = Script([failed(lost("n2")), OK], checkpoints=[6])
    r = s.go(PolicyConfig())
    assert r.state == RunState.SUCCEEDED
    assert s.calls[1] == (1, "p0-n2", 6)
    name, ev = s.events[0]
    assert name == "replan" and ev["dropped"] == ["n2"] and ev["membership_changes"] == 1
    assert ev["replan_s"] == 0.25 and ev["resume_step"] == 6
    assert r.tally.restarts == 0 and r.plan == "p0-n2"


def test_loop_gives_up_when_restarts_are_used_up_and_reports_the_first_root_cause():
    s = Script([failed(crash(node="n1", rank=0)), failed(crash(node="n2", rank=2))], checkpoints=[4])
    r = s.go(PolicyConfig(max_restarts=1, max_node_failures=5))
    assert r.state == RunState.FAILED
    assert "restarts used up (1/1)" in r.reason
    assert r.root_cause.node == "n1"
    assert [e[0] for e in s.events] == ["restart", "gave_up"]


def test_loop_gives_up_when_no_plan_fits_the_survivors():
    s = Script([failed(lost("n2")), failed(lost("n3"))], checkpoints=[2, 4], infeasible_after=1)
    r = s.go(PolicyConfig())
    assert r.state == RunState.FAILED
    assert r.reason.startswith("no feasible plan on the survivors: stage 0 needs 80 GiB")
    assert r.tally.dropped == ["n2", "n3"] and r.tally.membership_changes == 2
    assert [e[0] for e in s.events] == ["replan", "gave_up"]


def test_loop_marks_a_flapping_node_abnormal_then_continues_without_it():
    outcomes = [failed(crash(node="n2")), failed(hang(node="n2")), OK]
    s = Script(outcomes, checkpoints=[2, 5])
    r = s.go(PolicyConfig(max_restarts=5, max_node_failures=2, restart_delay_s=0.5))
    assert r.state == RunState.SUCCEEDED
    assert [e[0] for e in s.events] == ["restart", "node_abnormal", "replan"]
    assert s.calls[-1] == (2, "p0-n2", 5)
    assert s.slept == [0.5, 0.5]
    assert r.tally.abnormal == ["n2"]


def test_loop_stopped_by_user_and_resumed_attempt_numbering_continues():
    s = Script([AttemptOutcome(RunState.STOPPED)], checkpoints=[])
    r = s.go(PolicyConfig(), first_attempt=3, resume_step=8, tally=Tally(restarts=2))
    assert r.state == RunState.STOPPED and r.last_attempt == 3
    assert s.calls == [(3, "p0", 8)] and s.events == []
    assert r.tally.restarts == 2


def test_loop_restart_budget_carries_over_from_an_earlier_controller():
    s = Script([failed(crash())], checkpoints=[])
    r = s.go(PolicyConfig(max_restarts=2), tally=Tally(restarts=2))
    assert r.state == RunState.FAILED and "restarts used up (2/2)" in r.reason


# --- stragglers ---------------------------------------------------------------------------

PLANNED = {(0, 0): 100.0, (0, 1): 50.0, (1, 0): 100.0, (1, 1): 50.0}
NODES = {(0, 0): "a", (0, 1): "b", (1, 0): "c", (1, 1): "d"}


def test_uniformly_slow_cost_model_flags_nothing():
    measured = {k: v * 3.0 for k, v in PLANNED.items()}
    assert find_stragglers(measured, PLANNED, NODES, 0.25) == []


def test_slow_stage_is_flagged_against_plan_and_other_replicas():
    measured = {(0, 0): 300.0, (0, 1): 150.0, (1, 0): 300.0, (1, 1): 300.0}
    found = find_stragglers(measured, PLANNED, NODES, 0.25)
    assert [(s.replica, s.stage, s.node) for s in found] == [(1, 1, "d")]
    assert found[0].slowdown == pytest.approx(2.0)


def test_within_tolerance_is_not_a_straggler_and_single_stage_has_no_peer():
    measured = {(0, 0): 120.0, (0, 1): 50.0, (1, 0): 100.0, (1, 1): 50.0}
    assert find_stragglers(measured, PLANNED, NODES, 0.25) == []
    assert find_stragglers({(0, 0): 900.0}, {(0, 0): 1.0}, {(0, 0): "a"}, 0.1) == []


def test_two_stages_name_the_slow_one():
    found = find_stragglers({(0, 0): 10.0, (0, 1): 25.0}, {(0, 0): 1.0, (0, 1): 1.0}, {(0, 0): "a", (0, 1): "b"}, 0.5)
    assert [s.node for s in found] == ["b"]


def test_watch_reports_once_after_persisting_and_again_only_after_recovery():
    w = StragglerWatch({(0, 0): 1.0, (0, 1): 1.0}, {(0, 0): "a", (0, 1): "b"}, tolerance=0.3, window=2, patience=3)
    reports = []
    for _ in range(8):
        w.observe(0, 0, 10.0)
        reports.append(w.observe(0, 1, 20.0))
    flagged = [i for i, r in enumerate(reports) if r]
    # window fills at step 1; flagged checks at steps 1,2,3 → reported at step 3, once.
    assert flagged == [3] and reports[3][0].node == "b"
    for _ in range(2):  # recovers
        w.observe(0, 0, 10.0)
        assert w.observe(0, 1, 10.0) == []
    again = []
    for _ in range(3):
        w.observe(0, 0, 10.0)
        again += w.observe(0, 1, 30.0)
    assert [s.node for s in again] == ["b"]


def test_watch_judges_nothing_while_held_and_starts_its_windows_again_after():
    w = StragglerWatch({(0, 0): 1.0, (0, 1): 1.0}, {(0, 0): "a", (0, 1): "b"}, tolerance=0.3, window=2, patience=2)
    spare_a, spare_b = ("spare", "a", 0, 11), ("spare", "b", 1, 12)
    w.hold(spare_a)
    w.hold(spare_b)
    for _ in range(6):  # b twice as slow, but a spare imports beside it: nothing is judged
        w.observe(0, 0, 10.0)
        assert w.observe(0, 1, 20.0) == []
    w.release(spare_a)
    w.release(("spare", "b", 1, 99))  # another pid: not what is held
    for _ in range(4):
        w.observe(0, 0, 10.0)
        assert w.observe(0, 1, 20.0) == []  # still held by b's spare
    w.release(spare_b)
    out = []
    for _ in range(3):
        w.observe(0, 0, 10.0)
        out.append(w.observe(0, 1, 20.0))
    # the windows start empty at the release: full after 2 rounds, then 2 flagged checks → the 3rd round reports
    assert [bool(r) for r in out] == [False, False, True] and out[2][0].node == "b"


def test_spare_imports_carry_over_to_the_next_attempts_watch_and_end_on_ready_gone_or_cold():
    from hetctl.elastic.straggler import SpareImports
    from hetctl.files.events import RankFailed, Standby

    def watch():
        return StragglerWatch({(0, 0): 1.0, (0, 1): 1.0}, {(0, 0): "a", (0, 1): "b"}, tolerance=0.3, window=1,
                              patience=1)

    def judged(w) -> bool:
        w.observe(0, 0, 10.0)
        return bool(w.observe(0, 1, 30.0))

    spares = SpareImports()
    first = watch()
    spares.attach(first)
    spares.listen(Standby(attempt=0, node="b", rank=1, state="importing", pid=7))
    spares.listen(Standby(attempt=0, node="a", rank=0, state="importing", pid=8))
    spares.listen(RankFailed(attempt=0, node="b", rank=1, reason="x"))  # other kinds are not read
    assert not judged(first)
    second = watch()  # the next attempt: both spares still import
    spares.attach(second)
    assert not judged(second)
    spares.listen(Standby(attempt=1, node="b", rank=1, state="ready", pid=7))
    spares.listen(Standby(attempt=1, node="a", rank=1, state="cold"))  # another node's rank 1: not a's 0
    assert not judged(second)
    spares.listen(Standby(attempt=1, node="a", rank=0, state="cold"))  # no pid: that rank's spare, whichever
    assert judged(second)


def test_watch_blip_below_patience_is_not_reported():
    w = StragglerWatch({(0, 0): 1.0, (0, 1): 1.0}, {(0, 0): "a", (0, 1): "b"}, tolerance=0.3, window=1, patience=3)
    seq = [20, 20, 10, 20, 20, 10]
    out = []
    for v in seq:
        w.observe(0, 0, 10.0)
        out += w.observe(0, 1, float(v))
    assert out == []


def test_speed_factors_follow_measured_slowdown_with_the_fastest_at_one():
    f = speed_factors({(0, 0): 100.0, (0, 1): 200.0, (0, 2): 100.0}, {(0, 0): 1.0, (0, 1): 1.0, (0, 2): 1.0},
                      {(0, 0): "a", (0, 1): "b", (0, 2): "c"})
    assert f == {"a": 1.0, "b": 0.5, "c": 1.0}
    two = speed_factors({(0, 0): 150.0, (0, 1): 450.0}, {(0, 0): 1.0, (0, 1): 1.0}, {(0, 0): "a", (0, 1): "b"})
    assert two == {"a": 1.0, "b": pytest.approx(1 / 3)}  # not a=1.5, b=0.5 around their mean


def test_predicted_gain_from_measured_per_layer_cost():
    old = [(0, 0, "a", (0, 4)), (0, 1, "b", (4, 8))]
    measured = {(0, 0): 100.0, (0, 1): 400.0}  # b costs 100 ms a layer, a 25
    assert predicted_gain(old, old, measured) == 1.0
    moved = [(0, 0, "a", (0, 7)), (0, 1, "b", (7, 8))]  # a: 175 ms, b: 100 ms
    assert predicted_gain(old, moved, measured) == pytest.approx(400 / 175)
    spare = [(0, 0, "a", (0, 4)), (0, 1, "b", (4, 5)), (0, 2, "c", (5, 8))]  # c unmeasured: as fast as a
    assert predicted_gain(old, spare, measured) == pytest.approx(400 / 100)


def test_straggler_hook_reports_a_straggler_and_ends_the_attempt_only_under_rebalance():
    for rebalance in (False, True):
        events = []
        w = StragglerWatch({(0, 0): 2.0, (0, 1): 1.0}, {(0, 0): "a", (0, 1): "b"}, tolerance=0.25, window=2,
                           patience=2)
        hook = StragglerHook(w, lambda ev: events.append((ev.kind, ev.fields())), attempt=4, rebalance=rebalance)
        records = []
        for _ in range(5):
            records += hook({(0, 0): 20.0})
            records += hook({(0, 1): 30.0})
        assert [(k, f["node"], f["stage"], f["attempt"]) for k, f in events] == [("straggler", "b", 1, 4)]
        assert events[0][1]["slowdown"] == 3.0
        if rebalance:
            assert [(r.kind, r.node) for r in records] == [(FaultKind.STRAGGLER, "b")]
            assert "3.00x slower" in records[0].reason
        else:
            assert records == []


# --- re-planning (the real planner on hand-written cluster facts) ---------------------------

from hetctl.plan.models import load_model as load_spec  # noqa: E402
from hetctl.plan.planner import plan_cluster  # noqa: E402
from hetctl.plan.candidates import Pins  # noqa: E402
from hetctl.files.cluster import Chip, Cluster, NodeFacts  # noqa: E402
from hetctl.elastic.replan import layer_split, replan, survivors, with_speeds  # noqa: E402


def cpu_cluster(*names, tflops=1.0):
    return Cluster(nodes=[NodeFacts(name=n, host=n, tflops_override=tflops, memory_gb=16.0,
                                    chips=[Chip(index=0, vendor="cpu", model="cpu", memory_gb=16.0)])
                          for n in names])


def test_replan_on_survivors_keeps_model_batch_and_dp_width():
    cl = cpu_cluster("a", "b", "c", "d")
    plan = plan_cluster(cl, load_spec("tiny"), pins=Pins(pp=2, dp=2))
    lost = plan.stages[-1].node
    new = replan(plan, cl, drop=[lost], reason=f"{lost} lost")
    assert lost not in {r.node for r in new.ranks}
    assert new.model == plan.model and new.parallel.global_batch == plan.parallel.global_batch
    assert new.parallel.micro_batch == plan.parallel.micro_batch and new.parallel.dp == 2
    assert new.notes[0] == f"re-planned: {lost} lost"


def test_replan_changes_dp_width_only_when_it_must_and_says_so():
    cl = cpu_cluster("a", "b")
    plan = plan_cluster(cl, load_spec("tiny"), pins=Pins(pp=1, dp=2))
    new = replan(plan, cl, drop=["b"])
    assert new.parallel.dp == 1 and {r.node for r in new.ranks} == {"a"}
    assert any("data-parallel width 2 → 1" in n for n in new.notes)


def test_replan_with_nobody_left_is_infeasible():
    cl = cpu_cluster("a")
    plan = plan_cluster(cl, load_spec("tiny"))
    with pytest.raises(PlanInfeasible, match="no node left"):
        replan(plan, cl, drop=["a"])


def test_measured_slowdown_moves_layers_off_the_slow_node():
    cl = cpu_cluster("a", "b")
    plan = plan_cluster(cl, load_spec("tiny"), pins=Pins(pp=2, dp=1))
    slow = plan.stages_of(0)[0].node
    before = {s.node: s.layers[1] - s.layers[0] for s in plan.stages}
    new = replan(plan, cl, factors={slow: 0.4}, reason="rebalance")
    after = {s.node: s.layers[1] - s.layers[0] for s in new.stages}
    assert after.get(slow, 0) < before[slow], (layer_split(plan), layer_split(new))
    assert sum(after.values()) == plan.model.num_layers


def test_with_speeds_records_calibrated_tflops_and_survivors_drop_nodes():
    cl = cpu_cluster("a", "b", tflops=2.0)
    scaled = with_speeds(cl, {"a": 0.5})
    a = next(n for n in scaled.nodes if n.name == "a")
    assert a.chips[0].calibrated_tflops.fp32 == 1.0 and a.tflops_override == 1.0
    assert a.chips[0].measured_tflops is None  # a fitted, sustained rate is not a peak to scale down again
    assert next(n for n in scaled.nodes if n.name == "b").chips[0].calibrated_tflops is None
    assert [n.name for n in survivors(cl, ["b"]).nodes] == ["a"]


def test_straggler_hook_never_waits_for_the_replan():
    """The re-plan runs beside the monitor's loop: a planner that blocks does not block the heartbeat path."""
    import threading

    release, events = threading.Event(), []
    w = StragglerWatch({(0, 0): 1.0, (0, 1): 1.0}, {(0, 0): "a", (0, 1): "b"}, tolerance=0.5, window=1, patience=1)

    def confirm(found, means):
        release.wait(60)
        return True, "predicted 2.00x"

    hook = StragglerHook(w, lambda ev: events.append(ev), attempt=0, rebalance=True, confirm=confirm)
    hook({(0, 0): 10.0})
    assert hook({(0, 1): 40.0}) == []  # returned while confirm is still blocked
    assert hook({(0, 0): 10.0}) == [] and events == []  # later steps go on, nothing acted on yet
    release.set()
    records = hook.settle(timeout=30)
    assert [r.kind for r in records] == [FaultKind.STRAGGLER]
    assert [(e.kind, e.node, e.rebalance) for e in events] == [("straggler", "b", True)]


def test_straggler_hook_restarts_only_when_confirm_sees_a_gain():
    for worth, expect in ((False, []), (True, [FaultKind.STRAGGLER])):
        events, asked = [], []
        w = StragglerWatch({(0, 0): 1.0, (0, 1): 1.0}, {(0, 0): "a", (0, 1): "b"}, tolerance=0.5, window=1,
                           patience=1)

        def confirm(found, means, worth=worth):
            asked.append(([s.node for s in found], dict(means)))
            return worth, "predicted 2.00x" if worth else "not worth a restart: predicts 1.02x"

        hook = StragglerHook(w, lambda ev: events.append(ev.fields()), attempt=0, rebalance=True, confirm=confirm)
        hook({(0, 0): 10.0})
        records = list(hook({(0, 1): 40.0})) + hook.settle(timeout=30)
        assert asked == [(["b"], {(0, 0): 10.0, (0, 1): 40.0})]
        assert [r.kind for r in records] == expect
        assert events[0]["rebalance"] is worth and events[0]["verdict"].startswith("predicted" if worth else "not")
        if worth:
            assert "predicted 2.00x" in records[0].reason


# --- deterministic faults: classified from the rank's log, never retried ----------------------------



@pytest.mark.parametrize("tail, kind, says", [
    ("/usr/bin/python3: can't open file '/w/train.py': [Errno 2] No such file or directory", FaultKind.SETUP,
     "the script /w/train.py does not exist on the node"),
    ("/opt/py/bin/python3: No module named mypkg", FaultKind.SETUP, "python found no module mypkg to run"),
    ("Traceback (most recent call last):\n  File \"t.py\", line 1\nModuleNotFoundError: No module named 'megatron'",
     FaultKind.SETUP, "ModuleNotFoundError: No module named 'megatron'"),
    ("[rank2]: Traceback (most recent call last):\n[rank2]:     f.write(data)\n"
     "[rank2]: OSError: [Errno 28] No space left on device", FaultKind.STORAGE, "the disk is full"),
    ("PermissionError: [Errno 13] Permission denied: '/ck/r1/step-4/layer-0.pt'", FaultKind.STORAGE,
     "permission denied (/ck/r1/step-4/layer-0.pt)"),
    ("[rank1]: hetctl.train: error: training diverged: 5 steps in a row (3-7) had a non-finite grad_norm; each was "
     "skipped, no update was applied (hint: lower --lr)", FaultKind.DIVERGED,
     "training diverged: 5 steps in a row (3-7) had a non-finite grad_norm"),
    ("RuntimeError: CUDA error: an illegal memory access was encountered", FaultKind.CRASH, ""),
    ("PermissionError: [Errno 13] Permission denied: '/data/shard-3.bin'", FaultKind.CRASH, ""),
])
def test_a_crash_is_reread_with_its_log(tail, kind, says):
    f = classify(FailureRecord(FaultKind.CRASH, "n1", 0.0, rank=2, exit_code=1, reason="exit code 1", log_tail=tail))
    assert f.kind == kind and says in f.reason and f.reason.startswith("exit code 1")


def test_a_trainer_config_error_is_a_setup_fault_only_with_exit_2():
    tail = ("hetctl.train: error: checkpoint ck/step-10: its learning-rate schedule has decay_steps=20, this run "
            "has 40 (hint: pass --decay-steps 20)")
    f = classify(FailureRecord(FaultKind.CRASH, "n1", 0.0, rank=0, exit_code=2, reason="exit code 2", log_tail=tail))
    assert f.kind == FaultKind.SETUP and "decay_steps=20, this run has 40" in f.reason
    killed = FailureRecord(FaultKind.CRASH, "n1", 0.0, rank=0, exit_code=1, reason="exit code 1", log_tail=tail)
    assert classify(killed).kind == FaultKind.CRASH


def test_divergence_stops_the_run_saying_why():
    tally = Tally()
    root = FailureRecord(FaultKind.DIVERGED, "n1", 0.0, rank=0, exit_code=6,
                         reason="exit code 6: training diverged: 5 steps in a row (3-7) had a non-finite loss")
    d = decide(failed(root), tally, PolicyConfig(), attempt=0)
    assert d.action == Action.GIVE_UP and tally.restarts == 0 and not d.drop
    assert "training diverged" in d.reason and "restarting would repeat the same steps" in d.reason


@pytest.mark.parametrize("kind", [FaultKind.SETUP, FaultKind.STORAGE])
def test_deterministic_faults_stop_the_run_without_blaming_the_node(kind):
    tally = Tally()
    d = decide(failed(FailureRecord(kind, "n1", 0.0, rank=0, reason="r")), tally, PolicyConfig(), attempt=2)
    assert d.action == Action.GIVE_UP and tally.node_failures == {} and tally.restarts == 0 and not d.drop


def test_an_oom_kill_counts_against_its_node_like_a_crash():
    tally = Tally()
    d = decide(failed(FailureRecord(FaultKind.OOM, "n1", 0.0, rank=0, reason="killed by SIGKILL: out of memory")),
               tally, PolicyConfig(), attempt=0)
    assert d.action == Action.RESTART and tally.node_failures == {"n1": 1} and "out of memory" in d.reason


# --- a checkpoint a rank cannot load (issue 33, kind 7) ------------------------------------------

_LOAD_TAIL = ("[rank2]: Traceback (most recent call last):\n"
              "hetctl.train: error: checkpoint step 12 cannot be loaded: RuntimeError: Error(s) in loading "
              "state_dict for Layer: Missing key(s) in state_dict: \"attn.wq.weight\" (hint: the controller "
              "restarts from the checkpoint before it)\n")


def unloadable(node="n2", rank=2, exit_code=7, tail=_LOAD_TAIL):
    return classify(FailureRecord(FaultKind.CRASH, node, 0.0, rank=rank, exit_code=exit_code,
                                  reason=f"exited {exit_code}", log_tail=tail))


def test_a_rank_that_cannot_load_its_checkpoint_is_the_checkpoints_fault_not_the_nodes():
    f = unloadable()
    assert f.kind == FaultKind.CHECKPOINT and "checkpoint step 12 cannot be loaded: RuntimeError" in f.reason
    assert unloadable(exit_code=1).kind == FaultKind.CRASH  # the line without the trainer's exit 7 is not believed
    tally = Tally()
    fails = sorted([crash(node="n1", rank=0), f], key=lambda r: CAUSE_ORDER.get(r.kind, 2))  # as the monitor does
    assert fails[0] is f  # the load error explains the peer's crash, which came first
    d = decide(failed(*fails), tally, PolicyConfig(max_node_failures=1), attempt=1)
    assert d.action == Action.RESTART and d.unloadable == 12 and d.drop == ()
    assert tally.node_failures == {} and tally.restarts == 1 and "RuntimeError" in d.reason
    d = decide(failed(f), Tally(restarts=3), PolicyConfig(max_restarts=3), attempt=4)
    assert d.action == Action.GIVE_UP and "restarts used up" in d.reason


def test_loop_marks_only_the_step_the_attempt_started_from_then_uses_the_one_before():
    marked = []
    s = Script([failed(unloadable()), OK], checkpoints=[8])
    r = s.go(PolicyConfig(max_restarts=2), resume_step=12, first_attempt=3,
             mark_unloadable=lambda step, why: marked.append((step, why)))
    assert r.state == RunState.SUCCEEDED and s.calls == [(3, "p0", 12), (4, "p0", 8)]
    assert [m[0] for m in marked] == [12] and "cannot be loaded" in marked[0][1]
    lied = []  # a rank that names a step it was not given marks nothing
    s = Script([failed(unloadable()), OK], checkpoints=[8])
    s.go(PolicyConfig(max_restarts=2), resume_step=16, mark_unloadable=lambda step, why: lied.append(step))
    assert lied == []
