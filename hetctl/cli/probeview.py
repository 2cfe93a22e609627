"""The probe table: one row per node and chip model, what each chip trains in, and notes on the benchmarks.

Printed by ``hetctl probe`` (without ``--json``), by the typer command and the lean path alike
(:func:`hetctl.cli.lean.run_probe`).
"""

from __future__ import annotations

from hetctl.cli.base import out, text


def _fmt_tflops(t) -> str:
    """The fastest dtype's figure (bf16 on accelerators; on CPUs often fp32)."""
    known = [(getattr(t, d), d) for d in ("bf16", "fp16", "fp32") if t is not None and getattr(t, d) is not None]
    if not known:
        return "?"
    value, dtype = max(known, key=lambda vd: vd[0])
    return f"{value:.4g} {dtype}"


def print_probe(cluster, *, bench: bool) -> None:
    """The probe table: one row per node and chip model, with footnotes for bench misses."""
    from rich.text import Text

    from hetctl.cli.fit import Col, fitted
    from hetctl.plan.devices import chip_precision  # the precision the planner will train each chip in

    cols = [Col("node", keep=True), Col("vendor"), Col("model"), Col("chips", "right"),
            Col("memory", "right", drop=2), Col("TFLOPS (peak)" + (" / measured" if bench else ""), drop=1),
            Col("trains in", drop=4), Col("NIC", drop=3)]
    rows: list[list] = []
    notes = []
    for node in cluster.nodes:
        if not node.reachable:
            rows.append([Text(node.name), Text("unreachable", "red"), Text(str(node.error), "red"), "", "", "", "",
                         ""])
            continue
        nics = [n for n in node.nics if n.kind not in ("loopback", "other")]
        best = max(nics, key=lambda n: n.speed_gbps or 0, default=None)
        nic = f"{best.kind} {best.speed_gbps:g}G" if best and best.speed_gbps else (best.kind if best else "-")
        if best and len(nics) > 1:
            nic += f" (+{len(nics) - 1})"
        groups: dict[tuple[str, str], list] = {}
        for chip in node.chips:
            groups.setdefault((chip.vendor, chip.model), []).append(chip)
        for i, ((vendor, model), chips) in enumerate(groups.items()):
            mem = chips[0].memory_gb
            tf = _fmt_tflops(chips[0].tflops)
            if node.tflops_override is not None:
                tf = f"{node.tflops_override:g} (inventory)"
            if bench:
                measured = [c.measured_tflops for c in chips if c.measured_tflops is not None]
                tf += f" / {_fmt_tflops(measured[0])}" if measured else " / -"
            rows.append([Text(cell) for cell in (  # outside strings: never markup
                node.name if i == 0 else "", vendor, model, str(len(chips)),
                f"{mem:g} GB" if mem is not None else "?", tf, chip_precision(chips[0]), nic if i == 0 else "",
            )])
        if bench and node.bench_error:
            lead = "" if node.bench_error.startswith("layer profile:") else "not measured: "
            notes.append(f"{node.name}: {lead}{node.bench_error}")
        prof = next((c.profile for c in node.chips if c.profile is not None), None)
        if prof is not None:
            notes.append(f"{node.name}: layer profile ({prof.model}, micro-batch {prof.micro_batch}, seq {prof.seq_len}, "
                         f"{prof.precision}): forward {prof.layer_fwd_ms:g} ms, backward {prof.layer_bwd_ms:g} ms per layer")
    out.print(fitted(out, cols, rows, title=f"{len(cluster.reachable_nodes())}/{len(cluster.nodes)} nodes answered"))
    if bench and cluster.links:
        out.print(text(_links_line(cluster.links)), highlight=False, soft_wrap=True)
    for note in notes:
        out.print(text((note, "dim")), highlight=False)


def _links_line(links) -> str:
    """One line on the measured ring: how many links, their median, the slowest."""
    import statistics

    measured = [lk for lk in links if lk.measured_gbps is not None]
    line = f"links: {len(measured)}/{len(links)} measured (a ring, TCP)"
    if measured:
        slowest = min(measured, key=lambda lk: lk.measured_gbps)
        line += (f", median {statistics.median(lk.measured_gbps for lk in measured):.3g} Gb/s, slowest "
                 f"{slowest.src} → {slowest.dst} {slowest.measured_gbps:.3g} Gb/s")
    return line
