"""Counting what a hostlist range names, without expanding it.

python-hostlist bounds one range (100,000) but not a list of them, and a bound
with thousands of digits makes it raise ValueError; an inventory is refused on
the count instead, before a single name is made.
"""

from __future__ import annotations

import re

# All ranges of a file together: checked before anything is expanded, so that
# `gpu-[1-99999],cpu-[1-99999],…` costs nothing to refuse.
MAX_NODES = 100_000


def count_hostlist(pattern: str) -> int:
    """How many names ``pattern`` expands to at most, without expanding it.

    Follows python-hostlist's syntax (top-level commas, ``[lo-hi,n,…]`` groups
    multiplied within one item); a malformed part counts as one name and is left
    for the inventory loader to report. A bound with more than 18 digits counts as
    more than :data:`MAX_NODES`.
    """
    total, depth, part = 0, 0, ""
    for c in pattern + ",":
        if c == "," and depth == 0:
            total += _count_item(part)
            part = ""
            continue
        part += c
        depth += {"[": 1, "]": -1}.get(c, 0)
    return total + (_count_item(part) if part else 0)


def _count_item(item: str) -> int:
    if not item:
        return 0
    n = 1
    for group in re.findall(r"\[([^\]]*)\]", item):
        size = 0
        for r in group.split(","):
            m = re.fullmatch(r"([0-9]+)-([0-9]+)", r)
            if m is None:
                size += 1
            elif max(len(m[1]), len(m[2])) > 18:
                size += MAX_NODES + 1
            else:
                size += max(1, int(m[2]) - int(m[1]) + 1)
        n *= size
    return n
