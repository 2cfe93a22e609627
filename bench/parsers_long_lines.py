"""Benchmark: every vendor-tool parser on real captures with one line padded by N blanks (issue 33, kind 6).

A 60,000-space line in ``rocminfo`` output made ``probe`` take 47 s: regular expressions
that backtrack over runs of blanks are quadratic in the line's length. Each parser now
sees its text through :func:`hetctl.probe.parsers._common.tame` (lines and blank runs
bounded). For N in ``--sizes`` this prints, per parser, the slowest parse over every
capture in ``tests/fixtures/smi-samples`` with one line padded, through ``parse_tool``
(as ``probe`` parses) and, for comparison, straight (the parser alone, as before).
Goal: the slowest ``parse_tool`` under 0.2 s at N = 60,000 on any machine that runs the tests.

    python bench/parsers_long_lines.py --sizes 6000,60000 [--straight]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from hetctl.probe.tools import PARSERS, parse_tool

SAMPLES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "smi-samples"


def worst(n: int, straight: bool) -> dict[str, float]:
    out: dict[str, float] = {}
    files = [p for p in sorted(SAMPLES.rglob("*")) if p.is_file()]
    for key, fn in PARSERS.items():
        for path in files:
            lines = path.read_text(errors="replace").splitlines()
            for i in range(0, len(lines), max(1, len(lines) // 4)):
                padded = list(lines)
                padded[i] = padded[i][: len(padded[i]) // 2] + " " * n + padded[i][len(padded[i]) // 2:]
                text = "\n".join(padded)
                t0 = time.perf_counter()
                try:
                    fn(text) if straight else parse_tool(key, text)
                except Exception:  # noqa: BLE001 - a parser refusing the text is fine here; only time counts
                    pass
                out[key] = max(out.get(key, 0.0), time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="6000,60000")
    ap.add_argument("--straight", action="store_true", help="also time the parsers without the bound")
    args = ap.parse_args()
    for n in (int(x) for x in args.sizes.split(",")):
        bounded = worst(n, straight=False)
        raw = worst(n, straight=True) if args.straight else {}
        print(f"N = {n}: slowest parse_tool {max(bounded.values()):.3f} s")
        for key in sorted(bounded, key=lambda k: -bounded[k])[:5]:
            extra = f"  (straight {raw[key]:.3f} s)" if key in raw else ""
            print(f"  {key:16s} {bounded[key]:.3f} s{extra}")


if __name__ == "__main__":
    main()
