"""Predicted against measured: each attempt compared with its plan, and ``hetctl plan --calibrate RUN_DIR``.

:func:`hetctl.elastic.measure.compare` turns an attempt's outcome into the ``measured``
event as the run goes; :func:`calibrate` turns a run's newest one into the cluster facts
to plan from.

Each attempt that trained wrote a ``measured`` event: per stage, the compute time
per step the plan predicted and the one the heartbeats reported. A node whose
stages took twice their prediction really runs at half the TFLOPS the planner
used, so its chips get ``calibrated_tflops`` at that figure (and the inventory's
``tflops`` override, which wins in the planner, is scaled alike). Planning on
those facts makes the planner's compute times the measured ones. The step time
beyond that compute fits the cost of the messages between stages
(:mod:`hetctl.runs.linkfit`): ``calibrated`` links in the cluster file. The
bubble stays the simulator's; ``--explain`` says which nodes and links were calibrated.
With several runs (``--calibrate A --calibrate B``), :func:`combine` takes each node's
speed from the run that kept it busiest and the links from the newest.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path

from hetctl.errors import ConfigError, HetctlError
from hetctl.files.cluster import Cluster
from hetctl.files.events import Measured
from hetctl.files.eventlog import parse_event, read_events
from hetctl.files.plan import Plan
from hetctl.files.run import RunDir
from hetctl.files.yamlio import load_model
from hetctl.runs.linkfit import LinkFit, fit_links, sends_per_step


@dataclass(frozen=True)
class Calibration:
    """What a run measured: the plan it ran, the calibrated facts, and each node's speed against the plan."""

    run_id: str
    attempt: int
    plan: Plan
    cluster: Cluster
    factors: dict[str, float]  # node → measured speed ÷ the speed the plan assumed
    links: LinkFit | None = None  # the per-message cost of the plan's hops, fitted to the measured step
    busy: dict[str, float] = field(default_factory=dict)  # node → share of its step spent computing
    sources: dict[str, tuple[str, float]] = field(default_factory=dict)  # several runs: node → (run, busy share)
    runs: tuple[str, ...] = ()  # several runs: their ids, oldest first
    links_run: str = ""  # several runs: the run the links were fitted on (the newest with a fit)
    measured_ts: float = 0.0  # when the attempt's ``measured`` event was written (orders several runs)

    def note(self) -> str:
        """One line: where each node's speed came from, what it is now (comparable across nodes), and the links."""
        if self.sources:
            nodes = ", ".join(f"{n} ×{self.factors[n]:.3g} from run {run} (busy {100 * share:.0f}%){self._speed(n)}"
                              for n, (run, share) in sorted(self.sources.items()))
            out = (f"calibrated on runs {', '.join(self.runs)}: each node's speed against its plan, from the run "
                   f"it was busiest in: {nodes}")
            return out + (f"; from run {self.links_run or self.run_id}: {self.links.note()}"
                          if self.links is not None else "")
        nodes = ", ".join(f"{n} ×{f:.3g}{self._speed(n)}" for n, f in sorted(self.factors.items()))
        out = f"calibrated on run {self.run_id} attempt {self.attempt}: speeds measured against the plan: {nodes}"
        return out + (f"; {self.links.note()}" if self.links is not None else "")

    def _speed(self, name: str) -> str:
        """`` → <speed>`` of the node's first chip in the calibrated facts (a factor is relative to its own run's
        plan; this is not): ms per layer from a layer profile, else TFLOPS; empty where there is none."""
        from hetctl.plan.devices import _node_chips, chip_rate

        node = next((n for n in self.cluster.nodes if n.name == name), None)
        chips = _node_chips(node) if node is not None else []
        if not chips:
            return ""
        prof = chips[0].profile
        if prof is not None:
            return f" → {prof.layer_fwd_ms + prof.layer_bwd_ms:.3g} ms a layer (micro-batch {prof.micro_batch})"
        try:
            rate, prec, _src = chip_rate(node, chips[0])
        except HetctlError:
            return ""
        return f" → {rate:.3g} TFLOPS {prec}"


def node_factors(measured: Measured, sends_ms: dict[tuple[int, int], float] | None = None) -> dict[str, float]:
    """Per node, predicted ÷ measured compute (1/ratio), averaged over the node's stages.

    ``sends_ms``: for a plan written before ``compute_ms`` was recorded (its predicted
    figure is ``est_ms``, sends included; the heartbeats' compute is not), per (replica,
    stage) the sends taken off before comparing, so that a node's speed is compute against compute.
    """
    per: dict[str, list[float]] = {}
    for s in measured.stages:
        want = s.predicted_ms - (sends_ms or {}).get((s.replica, s.stage), 0.0)
        if s.measured_ms > 0 and want > 0:
            per.setdefault(s.node, []).append(want / s.measured_ms)
        elif s.ratio > 0:
            per.setdefault(s.node, []).append(1.0 / s.ratio)
    return {n: statistics.fmean(v) for n, v in per.items()}


def calibrate(run_dir: str | Path, *more: str | Path) -> Calibration:
    """The run's newest measured attempt turned into calibrated cluster facts; with ``more`` runs,
    each node's speed from the run it was busiest in (:func:`combine`).

    Raises:
        ConfigError: not a run folder, no attempt measured, or the cluster facts it was
            planned from are gone.
    """
    if more:
        return combine([calibrate(d) for d in (run_dir, *more)])
    from hetctl.elastic.replan import load_cluster, with_speeds

    run = RunDir.open(run_dir)
    found = [e for e in read_events(run.events_path) if e.get("kind") == "measured" and e.get("stages")]
    if not found:
        raise ConfigError(f"{run.events_path}: no attempt of run {run.run_id} trained long enough to be measured",
                          "launch it for a few steps (two or more) first, then calibrate")
    measured = parse_event(found[-1])
    plan = run.load_plan(measured.attempt)
    cluster = None
    for n in range(measured.attempt, -1, -1):  # resume saves the facts it re-probed with the attempt
        saved = run.attempt_dir(n) / "cluster.yaml"
        if saved.is_file():
            cluster = load_model(saved, Cluster, "cluster file")
            break
    if cluster is None:
        info = run.load_info()
        try:
            cluster = load_cluster(plan, None, plan_file=Path(info.inputs.plan_dir or ".") / "plan.yaml")
        except HetctlError as e:
            raise ConfigError(f"cannot calibrate run {run.run_id}: {e.message}",
                              "keep the cluster file the run was planned from, or pass it with --cluster") from None
    old_plan = any(s.compute_ms is None for s in plan.stages)  # its predicted figures hold the sends
    factors = node_factors(measured, sends_per_step(plan, cluster) if old_plan else None)
    fit = fit_links(plan, measured, cluster)
    return Calibration(run.run_id, measured.attempt, plan, with_links(with_speeds(cluster, factors, plan), fit), factors, fit,
                       busy=busy_shares(measured), measured_ts=float(found[-1].get("ts") or 0.0))


SAME_BUSY = 0.05  # busy shares this close count as equal: the newer run's speed is taken


def busy_shares(measured: Measured) -> dict[str, float]:
    """Per node, the share of its stages' step time spent computing (compute ÷ step, over its stages)."""
    comp: dict[str, float] = {}
    wall: dict[str, float] = {}
    for s in measured.stages:
        if s.step_ms and s.step_ms > 0:
            comp[s.node] = comp.get(s.node, 0.0) + s.measured_ms
            wall[s.node] = wall.get(s.node, 0.0) + s.step_ms
    return {n: min(1.0, comp[n] / wall[n]) for n in comp}


def combine(cals: list[Calibration]) -> Calibration:
    """Several runs' calibrations as one: the newest run's facts, the links of the newest run that
    fitted them, and each node's speed from the run where its stages were busiest.

    A run of replicas of different shape has no pipeline hop to fit; after one, the links
    stay those of the run before it rather than none.

    A node that waited on its peers for most of a step ran in short bursts, and a chip can
    run a short burst faster than it sustains (boost clocks; under a CFS quota, a burst
    shorter than the quota runs at the whole CPU's speed); a balanced plan keeps every
    node busy, so the speed it needs is the one measured under load. Shares within
    ``SAME_BUSY`` of each other are taken as equal, and the newer run (by its ``measured``
    event) wins.

    Raises:
        ConfigError: the same run given twice, or runs of different models.
    """
    ordered = sorted(cals, key=lambda c: (c.measured_ts, c.run_id, c.attempt))
    for a, b in zip(ordered, ordered[1:]):
        if (a.run_id, a.attempt) == (b.run_id, b.attempt):
            raise ConfigError(f"--calibrate: run {a.run_id} is given twice", "give each run folder once")
    newest = ordered[-1]
    for c in ordered[:-1]:
        if c.plan.model.name != newest.plan.model.name or c.plan.model.num_layers != newest.plan.model.num_layers:
            raise ConfigError(f"--calibrate: run {c.run_id} trained {c.plan.model.name} ({c.plan.model.num_layers} "
                              f"layers), run {newest.run_id} {newest.plan.model.name} "
                              f"({newest.plan.model.num_layers} layers)", "calibrate on runs of one model")
    chosen: dict[str, Calibration] = {}
    nodes = []
    for n in newest.cluster.nodes:
        best = None
        for c in ordered:  # oldest first: a later run at about the same share replaces an earlier one
            share = c.busy.get(n.name)
            if share is not None and n.name in c.factors and (best is None or share >= best.busy[n.name] - SAME_BUSY):
                best = c
        if best is not None:
            chosen[n.name] = best
        if best is None or best is newest:
            nodes.append(n)
            continue
        src = next(m for m in best.cluster.nodes if m.name == n.name)
        nodes.append(n.model_copy(update={"chips": src.chips, "tflops_override": src.tflops_override}))
    cluster = newest.cluster.model_copy(update={"nodes": nodes})
    fitted = [c for c in ordered if c.links is not None and c.links.hops]
    linked = fitted[-1] if fitted else newest
    if linked is not newest:
        cluster = with_links(cluster, linked.links)
    sources = {node: (c.run_id, c.busy[node]) for node, c in chosen.items()}
    factors = {node: c.factors[node] for node, c in chosen.items()}
    return Calibration(newest.run_id, newest.attempt, newest.plan, cluster, factors, linked.links,
                       busy={node: c.busy[node] for node, c in chosen.items()}, sources=sources,
                       runs=tuple(c.run_id for c in ordered), links_run=linked.run_id,
                       measured_ts=newest.measured_ts)


def with_links(cluster: Cluster, fit: LinkFit) -> Cluster:
    """The cluster with the fitted links, in place of earlier calibrated ones between the same nodes."""
    new = fit.links()
    if not new:
        return cluster
    pairs = {(lk.src, lk.dst) for lk in new}
    kept = [lk for lk in cluster.links if not (lk.method == "calibrated" and (lk.src, lk.dst) in pairs)]
    return cluster.model_copy(update={"links": kept + new})
