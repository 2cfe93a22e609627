"""Re-planning during a run: on the surviving nodes, or with measured stage speeds.

Uses only the planner's public API (:func:`hetctl.plan.planner.plan_cluster`)
and the cluster facts contract. The model, global batch, micro-batch and
framework never change across attempts, so a checkpoint of any attempt loads into
any later one (layer-granular checkpoints, docs/architecture.md §5).

Which layout is preferred: the same data-parallel width as before when the
survivors can hold it, because then the run computes bit for bit what an
undisturbed run computes (the same micro-batches summed in the same order, only
the layer split moves); a different width is taken only when the old one no
longer fits, and the new plan's notes say that the losses will then differ in the
last bits (a gradient all-reduce over a different number of replicas rounds
differently).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from hetctl.errors import ConfigError, HetctlError, PlanInfeasible
from hetctl.files.plan import Plan
from hetctl.files.inventory import Inventory
from hetctl.files.cluster import Cluster, LayerProfile, NodeFacts, Tflops

PlanFn = Callable[..., Plan]


def load_cluster(plan: Plan, inventory: Inventory | None = None, *, plan_file: str | Path | None = None,
                 probe: Callable[[Any], Cluster] | None = None) -> Cluster:
    """The cluster facts the plan was made from; probed afresh when the file is gone.

    ``plan.cluster`` is tried as written (from the current directory), then next to
    the plan file. Without it, the inventory is probed (``probe`` defaults to
    :func:`hetctl.probe.gather.probe`).
    """
    from hetctl.files.yamlio import load_model

    candidates = []
    if plan.cluster:
        p = Path(plan.cluster)
        candidates.append(p)
        if plan_file is not None and not p.is_absolute():
            candidates.append(Path(plan_file).parent / p)
            candidates.append(Path(plan_file).parent / p.name)
    for c in candidates:
        if c.is_file():
            try:
                return load_model(c, Cluster, "cluster file")
            except ConfigError:
                break
    if inventory is None:
        raise ConfigError(
            f"cannot re-plan: the cluster file {plan.cluster or '(none recorded)'} is gone and no inventory was given",
            "pass the inventory with -i",
        )
    if probe is None:
        from hetctl.probe.gather import probe as probe_inventory

        probe = probe_inventory
    return probe(inventory)


def survivors(cluster: Cluster, drop: Sequence[str], keep_only: Sequence[str] | None = None) -> Cluster:
    """The cluster without the dropped nodes (and, when given, only nodes named in ``keep_only``)."""
    gone = set(drop)
    nodes = [n for n in cluster.nodes if n.name not in gone and (keep_only is None or n.name in keep_only)]
    return cluster.model_copy(update={"nodes": nodes})


def keep_measured(fresh: Cluster, before: Cluster | None) -> tuple[Cluster, list[str]]:
    """Carry ``--bench`` figures and layer profiles from ``before`` into a fresh probe for chips that did not change.

    A re-probe (``hetctl resume``) does not benchmark, so without this a node whose
    TFLOPS were only ever measured (a CPU node, a chip missing from the spec table:
    by ``probe --bench``, or by the layer profile of ``probe --model``, as the demo
    does) would become unplannable. A chip counts as unchanged when its node, index,
    vendor and model are the same; anything else is measured again by ``probe --bench``.

    Returns:
        The cluster with the carried figures, and the names of the nodes that got them.
    """
    if before is None:
        return fresh, []
    old = {(n.name, c.index, c.vendor, c.model): c for n in before.nodes for c in n.chips}
    nodes, carried = [], []
    for n in fresh.nodes:
        chips = []
        for c in n.chips:
            was = old.get((n.name, c.index, c.vendor, c.model))
            keep = {} if was is None else {k: getattr(was, k) for k in ("measured_tflops", "calibrated_tflops", "profile")
                                           if getattr(c, k) is None and getattr(was, k) is not None}
            chips.append(c.model_copy(update=keep) if keep else c)
        if chips != list(n.chips):
            carried.append(n.name)
        nodes.append(n.model_copy(update={"chips": chips}))
    return fresh.model_copy(update={"nodes": nodes}), carried


def with_speeds(cluster: Cluster, factors: Mapping[str, float], plan: Plan | None = None) -> Cluster:
    """Scale each node's chips to their measured relative speed (``calibrated_tflops``, and the
    inventory's ``tflops`` override when the node has one, since that figure wins in the planner).

    The figure scaled is the sustained rate the planner used at ``plan``'s shape (a peak times
    its efficiency: :mod:`hetctl.plan.efficiency`), and the result is a sustained rate too, so
    it goes in ``calibrated_tflops``, which the planner uses as is (a new ``measured_tflops``
    would be scaled down a second time).

    A factor of 0.5 (the node's stages ran twice their planned share) halves the
    figure the planner used for every chip of the node, so the next plan gives it
    about half the layers.
    """
    from hetctl.plan.devices import _node_chips, chip_rate, plan_use

    use = plan_use(plan.model, plan.parallel.micro_batch) if plan is not None else None
    nodes: list[NodeFacts] = []
    for n in cluster.nodes:
        f = factors.get(n.name)
        if f is None or not n.reachable or abs(f - 1.0) < 1e-9:
            nodes.append(n)
            continue
        chips = []
        for c in _node_chips(n):
            rate, prec, _src = chip_rate(n, c, use)
            update_chip: dict = {"calibrated_tflops": Tflops(**{prec: round(rate * f, 6)})}
            if c.profile is not None:  # a layer profile wins over the matmul figure in the planner: scale it too
                update_chip["profile"] = scaled_profile(c.profile, f)
            chips.append(c.model_copy(update=update_chip))
        update: dict = {"chips": chips}
        if n.tflops_override:  # the inventory's figure wins over measurements in the planner: scale it too
            update["tflops_override"] = round(n.tflops_override * f, 6)
        nodes.append(n.model_copy(update=update))
    return cluster.model_copy(update={"nodes": nodes})


def scaled_profile(prof: LayerProfile, f: float) -> LayerProfile:
    """A layer profile of a chip ``f`` times as fast as it was measured: every time divided by ``f``."""
    times = {k: round(getattr(prof, k) / f, 6) for k in ("layer_fwd_ms", "layer_bwd_ms", "edges_fwd_bwd_ms",
                                                          "optimizer_ns_per_param") if getattr(prof, k) is not None}
    return prof.model_copy(update=times)


def replan(
    plan: Plan,
    cluster: Cluster,
    *,
    drop: Sequence[str] = (),
    factors: Mapping[str, float] | None = None,
    reason: str = "",
    plan_fn: PlanFn | None = None,
) -> Plan:
    """A new plan for the same model and batch on ``cluster`` minus ``drop``.

    Args:
        plan: the plan of the attempt that just ended.
        cluster: cluster facts (see :func:`load_cluster`).
        drop: nodes lost or marked abnormal.
        factors: measured relative speed per node (``--rebalance``); None keeps the figures.
        reason: why, recorded in the new plan's notes.
        plan_fn: the planner (default :func:`hetctl.plan.planner.plan_cluster`).

    Returns:
        The new plan: the planner's best layout with the same DP width, or its best
        layout of any width when that width no longer fits.

    Raises:
        PlanInfeasible: no layout of the model fits the survivors.
    """
    if plan_fn is None:
        from hetctl.plan.planner import plan_cluster as plan_fn
    from hetctl.plan.candidates import Pins

    left = survivors(cluster, drop)
    if factors:
        left = with_speeds(left, factors, plan)
    if not any(n.reachable for n in left.nodes):
        raise PlanInfeasible(f"no node left after dropping {', '.join(drop)}", "add nodes to the inventory and resume")
    par = plan.parallel
    tries = [Pins(dp=par.dp), Pins()]
    last: HetctlError | None = None
    for pins in tries:
        try:
            new = plan_fn(left, plan.model, global_batch=par.global_batch, micro_batch=par.micro_batch,
                          framework=plan.framework, pins=pins, cluster_path=plan.cluster, homogeneous=False)
        except (PlanInfeasible, ConfigError) as e:
            last = e
            continue
        break
    else:
        assert last is not None
        if isinstance(last, PlanInfeasible):
            raise last
        raise PlanInfeasible(last.message, last.hint)
    new.inventory = plan.inventory
    if plan.rendered_anyway:  # `hetctl plan --render-anyway` holds for the run's later plans (launch warns)
        from hetctl.plan.render import unrunnable

        new.rendered_anyway = unrunnable(new)
    notes = [f"re-planned: {reason}"] if reason else []
    if new.parallel.dp != par.dp:
        notes.append(
            f"data-parallel width {par.dp} → {new.parallel.dp}: the gradient all-reduce now sums over a different "
            "number of replicas, so losses match the undisturbed run to rounding, not bit for bit"
        )
    new.notes = notes + list(new.notes)
    return new


def layer_split(plan: Plan) -> list[str]:
    """``node:start-end`` per stage of replica 0, for events and summaries."""
    return [f"{s.node}:{s.layers[0]}-{s.layers[1]}" for s in plan.stages_of(0)]
