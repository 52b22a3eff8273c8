"""Compare two CSVs of the same benchmark, run on two trees in one device call (old against new).

    python scripts/ab_compare.py OLD.csv NEW.csv --key kind,dtype,M,N,K --time fused_graph_us,cublas_graph_us

Prints, for every row present in both files, new / old for each timing column, and the geometric mean
and range of those ratios per column. A reference column that neither tree changes (cuBLAS, SDPA)
shows how far the machine itself drifted between the two runs: read the others against it.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from pathlib import Path


def _rows(path: Path, key: list[str]) -> dict[tuple[str, ...], dict[str, str]]:
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    if rows and (missing := [k for k in key if k not in rows[0]]):
        raise SystemExit(f"{path}: no column {', '.join(missing)} (columns: {', '.join(rows[0])})")
    return {tuple(r[k] for k in key): r for r in rows}


def _float(v: str | None) -> float | None:
    try:
        x = float(v) if v not in (None, "") else None
    except ValueError:
        return None
    return x if x is not None and x > 0 and math.isfinite(x) else None


def compare(old: Path, new: Path, key: list[str], cols: list[str]) -> dict[str, list[float]]:
    """{column: [new/old per shared row]}; prints one line per row."""
    a, b = _rows(old, key), _rows(new, key)
    shared = [k for k in a if k in b]
    if not shared:
        raise SystemExit(f"{old} and {new} share no row on key {','.join(key)}")
    ratios: dict[str, list[float]] = {c: [] for c in cols}
    print(",".join(key + [f"{c}_old,{c}_new,{c}_ratio" for c in cols]))
    for k in shared:
        cells = list(k)
        for c in cols:
            x, y = _float(a[k].get(c)), _float(b[k].get(c))
            r = y / x if x and y else None
            if r is not None:
                ratios[c].append(r)
            cells += [a[k].get(c, ""), b[k].get(c, ""), f"{r:.3f}" if r is not None else ""]
        print(",".join(cells))
    only = len(a) + len(b) - 2 * len(shared)
    if only:
        print(f"# {only} rows in only one file (left out)", file=sys.stderr)
    return ratios


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--key", required=True, help="comma-separated columns that identify a row")
    ap.add_argument("--time", required=True, help="comma-separated timing columns (lower is better)")
    args = ap.parse_args(argv)
    ratios = compare(args.old, args.new, args.key.split(","), args.time.split(","))
    print("\ncolumn,rows,geomean_new_over_old,min,max")
    for c, rs in ratios.items():
        if rs:
            g = math.exp(sum(map(math.log, rs)) / len(rs))
            print(f"{c},{len(rs)},{g:.3f},{min(rs):.3f},{max(rs):.3f}")
        else:
            print(f"{c},0,,,")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
