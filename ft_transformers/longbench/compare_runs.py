"""Check that two model folders of LongBench runs hold the same results (e.g. 1 GPU vs 2 processes).

For every run folder present in both, compares the scores (``result.json``, as written by
longbench_eval.py), the predictions row by row (``pred`` by ``_id``, and the row order), and the
fault-report totals, and every row's fault-tolerance events (step, layer, module, site, kind, count);
prints one OK / MISMATCH line per run, for a run whose blocks sit on several devices (``device_map``)
its events per device, and a last line ``OK`` or ``MISMATCH``.
Exit status 0 when everything matches, 1 otherwise.

    python -m ft_transformers.longbench.compare_runs out/single/SmolLM2-135M-Instruct.Q4_1 \
        out/dp/SmolLM2-135M-Instruct.Q4_1
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _rows(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(x) for x in f if x.strip()]


def _score_problems(a: Path, b: Path) -> list[str]:
    ra, rb = a / "result.json", b / "result.json"
    if not ra.is_file() or not rb.is_file():
        return ["result.json missing (run longbench_eval.py first)"]
    sa, sb = json.loads(ra.read_text()), json.loads(rb.read_text())
    if sa == sb:
        return []
    diff = {k: (sa.get(k), sb.get(k)) for k in sorted(set(sa) | set(sb)) if sa.get(k) != sb.get(k)}
    return [f"scores differ {diff}"]


def _report_problems(a: Path, b: Path) -> list[str]:
    fa, fb = a / "fault_report.json", b / "fault_report.json"
    if fa.is_file() != fb.is_file():
        return ["fault_report.json in one folder only"]
    if not fa.is_file():
        return []
    ta, tb = json.loads(fa.read_text()), json.loads(fb.read_text())
    keys = ("rows", "flips_injected", "totals")
    if any(ta.get(k) != tb.get(k) for k in keys):
        return [f"fault reports differ: {[(k, ta.get(k), tb.get(k)) for k in keys]}"]
    return []


def compare_run(a: Path, b: Path, rows_of_b: bool = False) -> tuple[bool, str]:
    """``(same, one-line summary)`` for two run folders.

    ``rows_of_b``: B predicted only some of A's rows (e.g. ``--limit``): compare those rows' predictions
    and events, in A's order; the scores and report totals, which cover other rows, are not compared.
    """
    problems = [] if rows_of_b else _score_problems(a, b) + _report_problems(a, b)
    tasks_a = {p.name for p in a.glob("*.jsonl") if ".ft_events" not in p.name and ".rank" not in p.name}
    tasks_b = {p.name for p in b.glob("*.jsonl") if ".ft_events" not in p.name and ".rank" not in p.name}
    if tasks_a != tasks_b and not (rows_of_b and tasks_b <= tasks_a):
        problems.append(f"task files differ: only in A {sorted(tasks_a - tasks_b)}, "
                        f"only in B {sorted(tasks_b - tasks_a)}")
    same = total = 0
    for name in sorted(tasks_a & tasks_b):
        xa, xb = _rows(a / name), _rows(b / name)
        idb = [r.get("_id") for r in xb]
        if rows_of_b:
            xa = [r for r in xa if r.get("_id") in set(idb)]
        if [r.get("_id") for r in xa] != idb:
            problems.append(f"{name}: rows or their order differ ({len(xa)} vs {len(xb)} rows)")
        if len(set(idb)) != len(idb):
            problems.append(f"{name}: duplicate rows in B")
        pb = {r.get("_id"): r.get("pred") for r in xb}
        total += len(xa)
        same += sum(pb.get(r.get("_id")) == r.get("pred") for r in xa)
    if same != total:
        problems.append(f"{total - same} of {total} predictions differ")
    ev_a, ev_b = _events(a), _events(b)
    if rows_of_b:
        ev_a = {k: v for k, v in ev_a.items() if k in ev_b}
    if ev_a != ev_b:
        bad = sorted(k for k in set(ev_a) | set(ev_b) if ev_a.get(k) != ev_b.get(k))
        problems.append(f"fault events differ in {len(bad)} row(s), e.g. {bad[:3]}")
    summary = f"{same}/{total} predictions identical"
    if ev_a and ev_a == ev_b:
        summary += f", events of {len(ev_a)} rows identical"
    return not problems, summary if not problems else summary + "; " + "; ".join(problems)


def _events(run: Path) -> dict[tuple[str, str], tuple]:
    """``{(task file, _id): (steps, flips, events)}`` from every ``ft_events/<task>.jsonl`` of a run."""
    out = {}
    for p in sorted(run.glob("ft_events/*.jsonl")):
        if ".rank" in p.name:
            continue
        for r in _rows(p):
            out[(p.name, r.get("_id"))] = (r.get("steps"), r.get("flips"), r.get("events"))
    return out


def events_per_device(events: list[list], placement: dict[str, list[int]]) -> dict[str, dict]:
    """Per device of ``placement`` (``{device: [block, ...]}``, as `longbench.pred.layer_devices`
    gives): its blocks and the summed counts of ``events`` (``[step, layer, module, site, kind,
    count]`` rows); events of layers outside every block (e.g. ``lm_head``) under "outside the blocks"."""
    where = {layer: dev for dev, layers in placement.items() for layer in layers}
    out: dict[str, dict] = {dev: {"layers": layers, "events": {}} for dev, layers in placement.items()}
    for _step, layer, _module, _site, kind, count in events:
        slot = out.setdefault(where.get(layer, "outside the blocks"), {"layers": [], "events": {}})["events"]
        slot[kind] = slot.get(kind, 0) + count
    return out


def describe_device(dev: str, d: dict) -> str:
    """One device of `events_per_device` as text: ``cuda:1 (layers 11-29): 14250 detected, ...``."""
    where = f"{dev} (layers {_span(d['layers'])})" if d["layers"] else dev
    return f"{where}: " + (", ".join(f"{v} {k}" for k, v in d["events"].items() if v) or "no events")


def events_by_device(run: Path) -> dict[str, dict]:
    """`events_per_device` of every row's events of a run, placed by its ``run_config.json``'s ``layer_devices``."""
    cfg = json.loads((run / "run_config.json").read_text())
    events = [e for (_steps, _flips, evs) in _events(run).values() for e in evs or []]
    return events_per_device(events, cfg.get("layer_devices") or {})


def _span(layers: list[int]) -> str:
    """``[3, 4, 5]`` -> ``3-5``; anything not a run of two or more -> comma-separated."""
    if len(layers) > 1 and layers == list(range(layers[0], layers[-1] + 1)):
        return f"{layers[0]}-{layers[-1]}"
    return ",".join(map(str, layers))


def compare_model_dirs(a: str | Path, b: str | Path, out=sys.stdout, rows_of_b: bool = False) -> bool:
    """Compare every run folder the two model folders share; print a line each and a verdict."""
    a, b = Path(a), Path(b)
    runs_a = {p.name for p in a.iterdir() if (p / "run_config.json").is_file()} if a.is_dir() else set()
    runs_b = {p.name for p in b.iterdir() if (p / "run_config.json").is_file()} if b.is_dir() else set()
    ok = bool(runs_a & runs_b)
    if not ok:
        print(f"MISMATCH: no run folder in common between {a} and {b}", file=out)
        return False
    for run in sorted(runs_a | runs_b):
        if run not in runs_a or run not in runs_b:
            print(f"{run}: only in {'A' if run in runs_a else 'B'} (not compared)", file=out)
            continue
        same, summary = compare_run(a / run, b / run, rows_of_b)
        ok &= same
        print(f"{run}: {'OK' if same else 'MISMATCH'} ({summary})", file=out)
        per_dev = events_by_device(b / run)
        if len(per_dev) > 1:
            print("  B's events by device: " + "; ".join(describe_device(dev, d) for dev, d in per_dev.items()),
                  file=out)
    print("OK" if ok else "MISMATCH", file=out)
    return ok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a", help="model folder of runs (reference, e.g. one GPU)")
    p.add_argument("b", help="model folder of runs to check (e.g. data parallel)")
    p.add_argument("--rows-of-b", action="store_true",
                   help="B holds only some of A's rows (e.g. run with --limit): compare those rows and their "
                        "events, not the scores or report totals")
    args = p.parse_args(argv)
    return 0 if compare_model_dirs(args.a, args.b, rows_of_b=args.rows_of_b) else 1


if __name__ == "__main__":
    sys.exit(main())
