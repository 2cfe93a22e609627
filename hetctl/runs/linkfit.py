"""Per-link cost fitted from a finished run: what the plan's point-to-point messages really cost.

``hetctl plan --calibrate`` first fits each node's speed from the stages' measured
compute (:mod:`hetctl.runs.calibrate`). What the step took beyond that
compute is the pipeline's waits: the 1F1B bubble, which the simulator knows, and
the messages between stages, whose cost the planner only assumed (a fixed
latency plus the bytes over the probed or declared bandwidth). This module
replays the run in the planner's own 1F1B simulation
(:func:`~hetctl.plan.simulate.simulate_1f1b`) with the *measured* compute per
stage and finds the one extra cost per message, on every hop across nodes, that
makes the simulated step equal the measured one (the mean ``step_ms`` of the
heartbeats the compute came from, else the run's tokens/s) (bisection: the makespan only
grows with it).

One run sends messages of one size, so bandwidth and latency cannot both be
fitted from it: the fit keeps the bandwidth the planner used and moves the
difference into the latency; when the messages were cheaper than even that
bandwidth allows, the latency goes to zero and the bandwidth is raised to match.
Every hop of the run gets the same extra cost (one measured step time cannot
tell the hops apart). The result is ``method: calibrated`` links in the cluster
file (``latency_ms``, ``measured_gbps``), which the planner reads in place of
its assumptions (:func:`hetctl.plan.devices.calibrated_latency`).

What else the measured step holds (optimizer step, Python overhead) lands in the
fitted cost too: it is the per-message figure that makes the planner's model of
this run true, not a network benchmark.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hetctl.files.cluster import Cluster, Link
from hetctl.files.events import Measured
from hetctl.files.plan import Plan, Stage
from hetctl.plan.costmodel import GB, link
from hetctl.plan.workload import Workload, elem_bytes
from hetctl.plan.devices import Group, collect, plan_use
from hetctl.plan.simulate import simulate_1f1b


@dataclass(frozen=True)
class HopFit:
    """One hop of the run's pipelines: the planner's per-message cost before, and as fitted."""

    src: str
    dst: str
    address: str
    nbytes: float
    modeled_s: float
    fitted_s: float
    latency_s: float
    gbs: float | None  # GB/s the fitted cost is expressed with (None: no byte term)


@dataclass(frozen=True)
class LinkFit:
    """The fit, or why there is none (``hops`` empty and ``reason`` set)."""

    hops: list[HopFit]
    extra_s: float = 0.0  # added to every hop's modeled per-message cost
    step_s_simulated: float = 0.0  # measured compute, links as modeled
    step_s_measured: float = 0.0
    reason: str | None = None

    def links(self) -> list[Link]:
        """The hops as ``calibrated`` cluster-file links (one per node pair and direction)."""
        out: dict[tuple[str, str], Link] = {}
        for h in self.hops:
            out[(h.src, h.dst)] = Link(
                src=h.src, dst=h.dst, address=h.address, method="calibrated", streams=0,
                seconds=round(h.fitted_s, 9), latency_ms=round(h.latency_s * 1e3, 6),
                measured_gbps=round(h.gbs * 8, 6) if h.gbs else None)
        return list(out.values())

    def note(self) -> str:
        if not self.hops:
            return f"links not calibrated ({self.reason})"
        pairs = sorted({(h.src, h.dst, h.fitted_s, h.latency_s) for h in self.hops})
        return ("links fitted to the measured step (simulated with measured compute "
                f"{self.step_s_simulated:.4g} s, measured {self.step_s_measured:.4g} s): "
                + ", ".join(f"{a}→{b} {1e3 * x:.3g} ms/message (latency {1e3 * lat:.3g} ms)" for a, b, x, lat in pairs))


def _node_groups(cluster: Cluster, plan: Plan) -> dict[str, list[Group]]:
    """The planner's chip groups of each node (what :func:`hetctl.plan.costmodel.link` prices a hop between).

    Collected at the plan's shape, as the planner did: a cluster whose chips have only a
    layer profile (``probe --bench --model``, the demo's) has no other figure.
    """
    groups: dict[str, list[Group]] = {}
    for k in collect(cluster, plan_use(plan.model, plan.parallel.micro_batch)).kinds:
        for g in k.groups:
            groups.setdefault(g.node, []).append(g)
    return groups


def _group(groups: dict[str, list[Group]], s: Stage) -> Group | None:
    mine = groups.get(s.node, [])
    return next((g for g in mine if (g.vendor, g.model) == (s.vendor, s.model)), mine[0] if mine else None)


def _makespan(comp: list[float], hops: list[float], m: int) -> float:
    """1F1B makespan with per-stage compute per micro-batch (1:2 forward:backward) and per-hop message cost."""
    fwd = [c / 3.0 for c in comp]
    bwd = [2.0 * c / 3.0 for c in comp]
    for k, x in enumerate(hops):
        fwd[k] += x
        bwd[k + 1] += x
    return simulate_1f1b(fwd, bwd, m).makespan


def fit_links(plan: Plan, measured: Measured, cluster: Cluster) -> LinkFit:
    """Fit the per-message cost of the plan's hops across nodes from the run's measured step (pure)."""
    if measured.step_s_measured is None:
        return LinkFit([], reason="the run measured no step time")
    if plan.replicas or plan.parallel.virtual_stages > 1 or plan.parallel.schedule != "1f1b":
        return LinkFit([], reason="only plain 1F1B pipelines of one shape are fitted (plan again with --schedule "
                       "1f1b to calibrate)" if plan.parallel.schedule != "1f1b" else
                       "only plain 1F1B pipelines of one shape are fitted")
    pp, m = plan.parallel.pp, plan.parallel.micro_batches
    if pp < 2:
        return LinkFit([], reason="one stage: no point-to-point messages")
    got: dict[int, list[float]] = {}
    for s in measured.stages:
        got.setdefault(s.stage, []).append(s.measured_ms)
    if sorted(got) != list(range(pp)):
        return LinkFit([], reason="not every stage was measured")
    comp = [max(0.0, sum(v) / len(v) / m / 1e3) for _, v in sorted(got.items())]
    groups, work = _node_groups(cluster, plan), Workload.of_plan(plan)
    bare = dataclasses.replace(work, micro_batch=0)  # a message of no bytes: the latency part alone
    chains = [plan.stages_of(r) for r in range(plan.parallel.dp)]
    modeled: list[list[tuple[float, float, bool]]] = []  # per replica, per hop: cost, latency part, across nodes
    for chain in chains:
        row = []
        for a, b in zip(chain, chain[1:]):
            ga, gb = _group(groups, a), _group(groups, b)
            if ga is None or gb is None:
                return LinkFit([], reason=f"node {a.node if ga is None else b.node} is not in the cluster file")
            row.append((link(ga, gb, a.precision, work)[0], link(ga, gb, a.precision, bare)[0], a.node != b.node))
        modeled.append(row)
    if not any(across for row in modeled for _, _, across in row):
        return LinkFit([], reason="no hop across nodes")
    # Replica 0 stands for all (same shape); the slowest hop at each position, as the planner places them.
    base = [max(row[k][0] for row in modeled) for k in range(pp - 1)]
    across = [any(row[k][2] for row in modeled) for k in range(pp - 1)]
    other = max(0.0, plan.estimate.step_time_s - _predicted_makespan(plan, base, m))  # DP syncs after the drain
    # The step of the very heartbeats the compute came from (tokens/s spans another window); else tokens/s.
    walls = [s.step_ms for s in measured.stages if s.step_ms is not None]
    target = sum(walls) / len(walls) / 1e3 if len(walls) == len(measured.stages) else measured.step_s_measured

    def step(extra: float) -> float:
        return _makespan(comp, [max(0.0, x + extra) if a else x for x, a in zip(base, across)], m) + other

    lo = -max(x for x, a in zip(base, across) if a)  # every hop free
    hi = max(target / max(m, 1), 1e-4)
    for _ in range(60):
        if step(hi) >= target:
            break
        hi *= 2
    if step(lo) >= target:
        extra = lo
    else:
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if step(mid) < target else (lo, mid)
        extra = (lo + hi) / 2
    hops = []
    for chain, row in zip(chains, modeled):
        for (a, b), (x, lat0, cross) in zip(zip(chain, chain[1:]), row):
            if not cross:
                continue
            fitted = max(0.0, x + extra)
            nbytes = float(work.tokens * work.cost.hidden * elem_bytes(a.precision))
            byte_s = max(0.0, x - lat0)
            if fitted >= byte_s:
                lat, gbs = fitted - byte_s, (nbytes / byte_s / GB if byte_s > 0 else None)
            else:
                lat, gbs = 0.0, nbytes / fitted / GB if fitted > 0 else None
            g = _group(groups, b)
            hops.append(HopFit(src=a.node, dst=b.node, address=g.host if g else b.node, nbytes=nbytes,
                               modeled_s=x, fitted_s=fitted, latency_s=lat, gbs=gbs))
    return LinkFit(hops, extra_s=extra, step_s_simulated=step(0.0), step_s_measured=target)


def _predicted_makespan(plan: Plan, hops: list[float], m: int) -> float:
    """The plan's own pipeline phase, rebuilt from its stages' compute (``compute_ms``; in an older plan
    ``est_ms`` less the modelled sends it holds) and ``hops``."""
    chain = plan.stages_of(0)
    comp = []
    for s, st in enumerate(chain):
        if st.compute_ms is not None:
            comp.append(st.compute_ms / 1e3)
            continue
        sends = (hops[s - 1] if s > 0 else 0.0) + (hops[s] if s < len(hops) else 0.0)
        comp.append(max(0.0, st.est_ms / 1e3 - sends))
    return _makespan(comp, hops, m)


def sends_per_step(plan: Plan, cluster: Cluster) -> dict[tuple[int, int], float]:
    """Per (replica, stage), ms per step of the sends the plan's ``est_ms`` counted (empty where unknown)."""
    groups, work = _node_groups(cluster, plan), Workload.of_plan(plan)
    out: dict[tuple[int, int], float] = {}
    for r in range(plan.parallel.dp):
        chain, m = plan.stages_of(r), plan.micro_batches_of(r)
        if any(s.chunks for s in chain):
            continue  # interleaved: more hops than the chain shows
        for a, b in zip(chain, chain[1:]):
            ga, gb = _group(groups, a), _group(groups, b)
            if ga is None or gb is None:
                continue
            ms = link(ga, gb, a.precision, work)[0] * 1e3 * m
            for s in (a, b):  # the forward send of a, the backward send of b
                out[(s.replica, s.stage)] = out.get((s.replica, s.stage), 0.0) + ms
    return out
