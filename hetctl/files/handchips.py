"""Chip entries a person writes in a cluster file, turned into the chips ``probe`` would write.

``probe`` writes every chip out in full. A cluster file written by hand (to size
a purchase, or to plan a cluster that cannot be probed from here) may instead
say what the chips are and how many::

    chips:
      - {model: NVIDIA H100 80GB HBM3, count: 8}   # a vendor tool's name
      - {spec: MI300X, count: 4, index: 8}         # a short name, or a row id such as amd/instinct-mi300x

Each entry with ``count: N`` becomes N chips with consecutive indices (from its
``index``, else after the vendor's previous chips). A chip that lacks its
``vendor``, ``memory_gb`` or ``tflops`` gets them from the chip table
(:mod:`hetctl.probe.specs`, ``hetctl chips`` lists it), looked up by its
``spec`` or ``model``; a value written in the entry wins. Entries that give
everything (every file ``probe`` wrote) pass through unchanged.
"""

from __future__ import annotations

from typing import Any

from hetctl.files.fields import Invalid

MAX_CHIPS_PER_NODE = 4096  # the cluster file's own bound (NodeFacts.chips)
_FILLED = ("vendor", "memory_gb", "tflops")


def expand_cluster(data: Any) -> Any:
    """``data`` (a loaded cluster file) with every node's hand-written chip entries expanded; not changed in place
    (aliases may share one chip list between nodes)."""
    if not isinstance(data, dict) or not isinstance(data.get("nodes"), list):
        return data
    nodes = [
        {**node, "chips": expand_chips(node["chips"], ("nodes", i, "chips"))}
        if isinstance(node, dict) and isinstance(node.get("chips"), list) else node
        for i, node in enumerate(data["nodes"])
    ]
    return {**data, "nodes": nodes}


def expand_chips(chips: list[Any], loc: tuple[Any, ...]) -> list[Any]:
    """One node's chip entries, each ``count:`` expanded and missing figures looked up.

    Raises:
        Invalid: naming the entry (``nodes[0].chips[2].spec``) for a bad count, an
            unknown or ambiguous ``spec``, or a vendor that contradicts the table.
    """
    if not any(isinstance(c, dict) and ("count" in c or "index" not in c or any(k not in c for k in _FILLED))
               for c in chips):
        return chips
    out: list[Any] = []
    next_index: dict[Any, int] = {}
    for j, entry in enumerate(chips):
        if not isinstance(entry, dict):
            out.append(entry)  # the model's own validation names it
            continue
        entry = _looked_up(dict(entry), (*loc, j))
        count = _count(entry.pop("count", 1), (*loc, j, "count"), len(out))
        vendor = entry.get("vendor")
        start = entry.get("index", next_index.get(vendor, 0))
        if not isinstance(start, int) or isinstance(start, bool):
            out.append(entry)
            continue
        out += [{**entry, "index": start + k} for k in range(count)]
        next_index[vendor] = max(next_index.get(vendor, 0), start + count)
    return out


def _count(value: Any, loc: tuple[Any, ...], before: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise Invalid(loc, f"count must be a whole number of chips, at least 1 (got {value!r})",
                      "write count: 8 for eight chips of this kind")
    if before + value > MAX_CHIPS_PER_NODE:
        raise Invalid(loc, f"more than {MAX_CHIPS_PER_NODE} chips on one node", "split the node, or lower count")
    return value


def _looked_up(entry: dict[str, Any], loc: tuple[Any, ...]) -> dict[str, Any]:
    """``entry`` with vendor, model, memory and TFLOPS from the chip table where it does not give them."""
    if all(k in entry for k in _FILLED):
        return entry
    key = "spec" if isinstance(entry.get("spec"), str) and entry["spec"] else "model"
    name = entry.get(key)
    if not isinstance(name, str) or not name or name == "unknown":
        return entry
    from hetctl.probe import specs  # the table's loader; the file models stay importable without it

    vendor = entry.get("vendor") if isinstance(entry.get("vendor"), str) else None
    memory = entry.get("memory_gb") if isinstance(entry.get("memory_gb"), (int, float)) else None
    try:
        row = specs.find(name, None, memory)
    except specs.AmbiguousSpec as e:
        raise Invalid((*loc, key), str(e), "write one of them; `hetctl chips` lists the table") from None
    if row is None:
        if key == "spec":
            raise Invalid((*loc, key), f"{name!r} is not in the chip table",
                          "`hetctl chips` lists the names it knows; or give vendor, memory_gb and tflops yourself")
        return entry  # a model the table does not know: the planner says which figure is missing
    if vendor is not None and vendor != row.vendor:
        raise Invalid((*loc, "vendor"), f"{name!r} is {row.vendor}'s {row.model} in the chip table, not {vendor}",
                      "fix vendor, or name the chip you meant")
    entry.setdefault("vendor", row.vendor)
    entry.setdefault("model", row.model)
    entry.setdefault("memory_gb", row.memory_gb if row.memory_gb is not None else row.memory_fallback_gb())
    entry.setdefault("tflops", row.tflops.model_dump())
    entry["spec"] = row.id
    return entry
