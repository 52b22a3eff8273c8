"""LongBench scoring of prediction folders, and the comparison across modes.

    ftt-longbench-eval --pred-dir out/longbench/<model-tag>      # or: python scripts/longbench_eval.py ...

``--pred-dir`` is either one run folder (``.../<run>/<task>.jsonl``) or a model folder holding
several runs (clean, faulty unprotected, faulty protected, ...). Every run folder gets

* ``result.json``: LongBench's own layout, task -> score (LongBench-E runs: task -> length
  buckets);
* ``scores.json``: per task the metric, row count, score and length groups; the leaderboard's
  averages per language (``leaderboard``: the mean of the category means, with the tasks each
  covers) and the plain mean over the run's tasks.

A model folder also gets ``comparison.md`` / ``comparison.json`` / ``comparison.png``: per task
and on average, every run scored on the rows that all runs have predicted, with each run's
fault counts and the share of its predictions identical to the clean reference run's. The
average row names the tasks it covers (those every run has); each run's average over its own
tasks is listed beside it where the task sets differ.

Scores come from the `evaluate` metric modules in ``ft_transformers/longbench/metrics`` (loaded from
local files, offline); ``--direct`` calls the same code without `evaluate`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from .metrics.longbench_core import (
    LENGTH_BUCKETS,
    ROUGE_BACKENDS,
    TASK_METRIC,
    base_task,
    score_task,
)
from .protocol import CATEGORIES, LEADERBOARD
from .runtime import require
from .shards import KINDS, read_jsonl_tolerant

METRICS_DIR = Path(__file__).resolve().parent / "metrics"
_SKIP_INFIXES = (".rank", ".ft_events")


# --------------------------------------------------------------------------------------------
# Reading runs
# --------------------------------------------------------------------------------------------

def prediction_files(run_dir: Path) -> dict[str, Path]:
    """``{name: path}`` of the merged prediction files of a run (task or ``<task>_e`` names)."""
    out = {}
    for p in sorted(run_dir.glob("*.jsonl")):
        name = p.name[: -len(".jsonl")]
        if any(s in name for s in _SKIP_INFIXES):
            continue
        if base_task(name) in TASK_METRIC:
            out[name] = p
    return out


def find_runs(pred_dir: Path) -> list[Path]:
    if prediction_files(pred_dir):
        return [pred_dir]
    return sorted(d for d in pred_dir.iterdir() if d.is_dir() and prediction_files(d))


def run_info(run_dir: Path) -> dict:
    p = run_dir / "run_config.json"
    return json.loads(p.read_text()) if p.exists() else {}


def is_longbench_e(run_dir: Path) -> bool:
    """Whether a run folder holds LongBench-E predictions: its run_config says so, it sits under
    a ``pred_e`` folder (LongBench's layout), or its files carry the ``_e`` suffix."""
    info = run_info(run_dir)
    if "longbench_e" in info:
        return bool(info["longbench_e"])
    if "pred_e" in run_dir.resolve().parts:
        return True
    names = list(prediction_files(run_dir))
    return bool(names) and all(n.endswith("_e") for n in names)


def run_label(info: dict, name: str) -> str:
    """clean (eager) | clean (efta) | faulty unprotected | faulty protected | <run name>."""
    mode = info.get("mode")
    if mode is None:
        return name
    if info.get("fault") is None:
        return f"clean ({mode})"
    return "faulty protected" if mode == "efta" else "faulty unprotected"


def _order_key(info: dict, name: str) -> tuple:
    mode = info.get("mode")
    faulty = info.get("fault") is not None
    rank = {"eager": 0, "sdpa": 1, "efta": 2, "unprotected": 3}.get(mode, 4)
    if faulty:
        rank = 5 if mode == "unprotected" else 6
    return (rank, name)


# --------------------------------------------------------------------------------------------
# Scoring
# --------------------------------------------------------------------------------------------

class Scorer:
    """Scores one task's rows, through the `evaluate` module (default) or directly."""

    def __init__(self, use_evaluate: bool = True, **options) -> None:
        self.use_evaluate = use_evaluate
        self.options = {k: v for k, v in options.items() if v is not None}
        self._modules: dict[str, object] = {}

    def _module(self, name: str):
        if name not in self._modules:
            evaluate = require("evaluate", "scoring through the `evaluate` modules (else --direct)")

            self._modules[name] = evaluate.load(str(METRICS_DIR / "longbench_score.py"), config_name=name,
                                                keep_in_memory=True)
        return self._modules[name]

    def __call__(self, name: str, rows: list[dict]) -> dict:
        preds = [r["pred"] for r in rows]
        answers = [list(r["answers"]) for r in rows]
        classes = next((r.get("all_classes") for r in rows if r.get("all_classes")), None)
        lengths = [r["length"] for r in rows] if rows and all("length" in r for r in rows) else None
        if not rows:
            return {"task": base_task(name), "metric": TASK_METRIC[base_task(name)], "n": 0,
                    "score": math.nan, "scores": []}
        if self.use_evaluate:
            return self._module(name).compute(predictions=preds, references=answers, all_classes=classes,
                                              lengths=lengths, **self.options)
        return score_task(name, preds, answers, all_classes=classes, lengths=lengths, **self.options)


def _nanmean(values) -> float:
    vals = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return round(sum(vals) / len(vals), 2) if vals else math.nan


def leaderboard(scores: dict[str, float]) -> dict:
    """The leaderboard's averages of task scores (``{task: score}``): per language, each
    category's mean over its tasks present, and ``average``, the mean of those category means.
    ``tasks`` lists what each figure covers; ``complete`` is False where tasks are missing (the
    figure is then not the leaderboard's)."""
    out = {}
    for lang, cats in LEADERBOARD.items():
        means, covered, missing = {}, [], []
        for cat, tasks in cats.items():
            got = [t for t in tasks if t in scores]
            missing += [t for t in tasks if t not in scores]
            if got:
                means[cat] = _nanmean(scores[t] for t in got)
                covered += got
        if means:
            out[lang] = {"average": _nanmean(means.values()), "categories": means, "tasks": covered,
                         "missing": missing, "complete": not missing}
    return out


def summarize(results: dict[str, dict]) -> dict:
    """Leaderboard averages per language, category averages, the plain task mean and the
    length-group averages of one run's results."""
    v1 = {base_task(n): r["score"] for n, r in results.items()}
    out = {"leaderboard": leaderboard(v1), "average": _nanmean(v1.values()), "average_over": sorted(v1),
           "categories": {}}
    for cat, tasks in CATEGORIES.items():
        got = [v1[n] for n in v1 if n in tasks]
        if got:
            out["categories"][cat] = _nanmean(got)
    buckets = {b: _nanmean(r["buckets"][b] for r in results.values() if "buckets" in r)
               for b in LENGTH_BUCKETS}
    out["buckets"] = buckets
    return out


def score_run(run_dir: Path, scorer: Scorer) -> dict:
    """Score every task file of a run; writes ``result.json`` and ``scores.json``."""
    results = {}
    e = is_longbench_e(run_dir)
    for name, path in prediction_files(run_dir).items():
        res = scorer(f"{base_task(name)}_e" if e else name, read_jsonl_tolerant(path))
        results[base_task(name)] = {k: v for k, v in res.items() if k != "scores"}
    official = {n: (r.get("buckets") if e else r["score"]) for n, r in results.items()}
    (run_dir / "result.json").write_text(json.dumps(official, indent=4, ensure_ascii=False))
    summary = {"longbench_e": e, "tasks": results, **summarize(results)}
    (run_dir / "scores.json").write_text(json.dumps(summary, indent=1, ensure_ascii=False))
    return summary


# --------------------------------------------------------------------------------------------
# Comparison across runs
# --------------------------------------------------------------------------------------------

def compare_runs(runs: list[Path], scorer: Scorer, *, common_rows: bool = True,
                 reference: str | None = None) -> dict:
    """Per task and run: score on the shared rows, fault counts, agreement with the reference."""
    infos = {r.name: run_info(r) for r in runs}
    runs = sorted(runs, key=lambda r: _order_key(infos[r.name], r.name))
    names = [r.name for r in runs]
    labels: dict[str, str] = {}
    for n in names:
        lab = run_label(infos[n], n)
        k = 2
        while lab in labels.values():
            lab = f"{run_label(infos[n], n)} #{k}"
            k += 1
        labels[n] = lab
    if reference is not None and reference not in names:
        raise ValueError(f"--reference {reference!r} is not one of the runs here: {', '.join(names)}")
    if reference is None:
        clean = [n for n in names if infos[n].get("mode") and infos[n].get("fault") is None]
        reference = clean[0] if clean else names[0]
    data = {r.name: {t: read_jsonl_tolerant(p) for t, p in prediction_files(r).items()} for r in runs}
    tasks = sorted({t for d in data.values() for t in d},
                   key=lambda t: (t.endswith("_e"), list(TASK_METRIC).index(base_task(t))))
    table: dict[str, dict[str, dict]] = {}
    bucket_rows: dict[str, dict[str, int]] = {}
    for t in tasks:
        have = [n for n in names if t in data[n]]
        keys = None
        if common_rows:
            for n in have:
                ks = {str(r.get("_id")) for r in data[n][t]}
                keys = ks if keys is None else keys & ks
        ref_pred = {str(r.get("_id")): r["pred"] for r in data.get(reference, {}).get(t, [])}
        first = [r for r in data[have[0]][t] if keys is None or str(r.get("_id")) in keys]
        bucket_rows[t] = {b: sum(1 for r in first if _bucket_of(r.get("length")) == b)
                          for b in LENGTH_BUCKETS}
        table[t] = {}
        for n in have:
            rows = [r for r in data[n][t] if keys is None or str(r.get("_id")) in keys]
            res = scorer(t, rows)
            ft = dict.fromkeys(("flips", *KINDS), 0)
            has_ft = False
            for r in rows:
                for k, v in (r.get("ft") or {}).items():
                    has_ft = True
                    ft[k] = ft.get(k, 0) + (v or 0)
            same = [r["pred"] == ref_pred[str(r.get("_id"))] for r in rows if str(r.get("_id")) in ref_pred]
            table[t][n] = {"score": res["score"], "n": res["n"], "buckets": res.get("buckets"),
                           "ft": ft if has_ft else None,
                           "same_as_reference": (sum(same) / len(same)) if same else None}
    averages = {}
    full = [t for t in tasks if all(n in table[t] for n in names)]
    for n in names:
        averages[n] = _nanmean(table[t][n]["score"] for t in full)
    own = {n: [t for t in tasks if n in table[t]] for n in names}
    own_avg = {n: _nanmean(table[t][n]["score"] for t in own[n]) for n in names}
    bucket_avg = {n: {b: _nanmean((table[t][n]["buckets"] or {}).get(b, math.nan) for t in full)
                      for b in LENGTH_BUCKETS} for n in names}
    bucket_n = {b: sum(bucket_rows[t][b] for t in full) for b in LENGTH_BUCKETS}
    return {"runs": names, "labels": labels, "reference": reference,
            "infos": {n: {k: infos[n].get(k) for k in ("mode", "fault", "model", "max_length")}
                      for n in names},
            "tasks": tasks, "table": table, "average": averages, "average_over": full,
            "own_average": own_avg, "own_tasks": own,
            "longbench_e": all(is_longbench_e(r) for r in runs),
            "buckets": bucket_avg, "bucket_rows": bucket_n, "common_rows": common_rows}


def _bucket_of(length) -> str | None:
    if length is None:
        return None
    return "0-4k" if length < 4000 else "4-8k" if length < 8000 else "8k+"


def _fmt(v, nd=2) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    return f"{v:.{nd}f}" if isinstance(v, float) else str(v)


def comparison_markdown(cmp: dict) -> str:
    names, labels = cmp["runs"], cmp["labels"]
    head = "| task | metric | n | " + " | ".join(labels[n] for n in names) + " |"
    sep = "|---|---|---:|" + "---:|" * len(names)
    lines = [head, sep]
    for t in cmp["tasks"]:
        row = cmp["table"][t]
        n = max((c["n"] for c in row.values()), default=0)
        lines.append(f"| {t} | {TASK_METRIC[base_task(t)]} | {n} | "
                     + " | ".join(_fmt(row[m]["score"]) if m in row else "–" for m in names) + " |")
    over = cmp["average_over"]
    lines.append(f"| **average** ({len(over)} common tasks) | | | "
                 + " | ".join(f"**{_fmt(cmp['average'][n])}**" for n in names) + " |")
    uneven = any(cmp["own_tasks"][n] != over for n in names)
    if uneven:
        lines.append("| average over each run's own tasks | | | "
                     + " | ".join(f"{_fmt(cmp['own_average'][n])} ({len(cmp['own_tasks'][n])})" for n in names)
                     + " |")
    # LongBench-E's buckets are its own rows; a v1 run's rows merely grouped by the same limits
    # are not LongBench-E results.
    group = "LongBench-E bucket" if cmp["longbench_e"] else "v1 rows by length, not LongBench-E"
    if any(not math.isnan(v) for bs in cmp["buckets"].values() for v in bs.values()):
        for b in LENGTH_BUCKETS:
            nb = cmp["bucket_rows"].get(b, 0)
            lines.append(f"| length {b} words ({group}) | | {nb} | "
                         + " | ".join(_fmt(cmp["buckets"][n][b]) for n in names) + " |")
    # fault counts and agreement
    def total(n, key):
        vals = [cmp["table"][t][n]["ft"].get(key, 0) for t in cmp["tasks"]
                if n in cmp["table"][t] and cmp["table"][t][n]["ft"]]
        return sum(vals) if vals else None

    for key, title in (("flips", "bit flips injected"), ("detected", "faults detected"),
                       ("corrected", "corrected"), ("recomputed", "recomputed"),
                       ("uncorrectable", "uncorrectable")):
        vals = [total(n, key) for n in names]
        if any(v for v in vals if v):
            lines.append(f"| {title} | | | " + " | ".join(_fmt(v) for v in vals) + " |")
    same = []
    for n in names:
        xs = [(cmp["table"][t][n]["same_as_reference"], cmp["table"][t][n]["n"]) for t in cmp["tasks"]
              if n in cmp["table"][t] and cmp["table"][t][n]["same_as_reference"] is not None]
        tot = sum(k for _, k in xs)
        same.append(100 * sum(s * k for s, k in xs) / tot if tot else None)
    lines.append(f"| outputs identical to {labels[cmp['reference']]} (%) | | | "
                 + " | ".join(_fmt(v, 1) for v in same) + " |")
    legend = ["", "Runs:"]
    for n in names:
        info = cmp["infos"][n]
        f = info.get("fault")
        spec = "no faults" if not f else ", ".join(f"{k}={v}" for k, v in f.items() if v is not None)
        legend.append(f"- **{labels[n]}**: `{n}` (mode {info.get('mode')}, {spec})")
    note = ["", "Scores on the rows every run has predicted (n)." if cmp["common_rows"] else
            "Each run scored on all its rows (n: the most rows of any run)."]
    note.append(f"The average row is the plain mean over the {len(over)} tasks every run has: "
                f"{', '.join(over) or 'none'}; it is not the leaderboard's average (the mean of the "
                "category means per language: `leaderboard` in each run's scores.json).")
    if uneven:
        for n in names:
            if cmp["own_tasks"][n] != over:
                note.append(f"- {labels[n]} has its own average over: {', '.join(cmp['own_tasks'][n])}")
    return "\n".join(lines + legend + note) + "\n"


def comparison_plot(cmp: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[longbench] matplotlib not installed (the longbench extra has it): no plot", file=sys.stderr)
        return None
    names, labels = cmp["runs"], cmp["labels"]
    cats = [*cmp["tasks"], "average"]
    width = 0.8 / max(len(names), 1)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(cats) * max(1, len(names)) / 2.5), 4.0))
    for i, n in enumerate(names):
        ys = [cmp["table"][t].get(n, {}).get("score", math.nan) for t in cmp["tasks"]] + [cmp["average"][n]]
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(cats))]
        ax.bar(xs, [0 if math.isnan(y) else y for y in ys], width, label=labels[n])
    ax.set_xticks(range(len(cats)))
    ax.set_xticklabels(cats, rotation=30, ha="right")
    ax.set_ylabel("LongBench score")
    ax.set_title("LongBench: clean vs faulty (unprotected / protected)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pred-dir", required=True, help="a run folder, or a model folder of run folders")
    p.add_argument("--runs", default=None, help="comma-separated run folder names to compare (default: all)")
    p.add_argument("--reference", default=None, help="run whose outputs count as the clean reference")
    p.add_argument("--all-rows", action="store_true",
                   help="compare each run on all its rows, not only those every run has")
    p.add_argument("--rouge-backend", default="official", choices=list(ROUGE_BACKENDS),
                   help="official (default): as LongBench scores, 0.0 where its recursive LCS would "
                        "overflow (long summaries, all Chinese ones); lcs: a deviation, the true score "
                        "on long texts; rouge-package: call the `rouge` package itself")
    p.add_argument("--code-sim-backend", default="difflib", choices=["difflib", "indel"])
    p.add_argument("--classification", default="published", choices=["published", "fixed"],
                   help="published: the official filter loop (skips after a removal); fixed: filter all")
    p.add_argument("--direct", action="store_true", help="score without the `evaluate` modules")
    p.add_argument("--no-plot", action="store_true")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    pred_dir = Path(args.pred_dir)
    if not pred_dir.is_dir():
        raise SystemExit(f"--pred-dir {pred_dir} is not a folder (give a run folder of ftt-longbench-pred, or the "
                         "model folder that holds its runs)")
    runs = find_runs(pred_dir)
    if args.runs:
        wanted = [x.strip() for x in args.runs.split(",") if x.strip()]
        runs = [r for r in runs if r.name in wanted]
    if not runs:
        raise SystemExit(f"no prediction files under {pred_dir}")
    scorer = Scorer(not args.direct, rouge_backend=args.rouge_backend, code_sim_backend=args.code_sim_backend,
                    faithful=args.classification == "published")
    if args.reference is not None and args.reference not in {r.name for r in runs}:
        raise SystemExit(f"--reference {args.reference!r} is not one of the runs in {pred_dir}: "
                         f"{', '.join(sorted(r.name for r in runs))}")
    summaries = {}
    for r in runs:
        summaries[r.name] = score_run(r, scorer)
        s = summaries[r.name]
        board = "; ".join(f"{lang} {_fmt(b['average'])}" + ("" if b["complete"] else
                                                              f" ({len(b['tasks'])} tasks, incomplete)")
                          for lang, b in s["leaderboard"].items())
        print(f"{r.name}: leaderboard average (mean of category means) {board or '–'}; plain mean "
              f"{_fmt(s['average'])} over {len(s['tasks'])} task(s) -> {r / 'result.json'}")
    out = {"runs": summaries}
    if len(runs) > 1 or runs[0] != pred_dir:
        cmp = compare_runs(runs, scorer, common_rows=not args.all_rows, reference=args.reference)
        md = comparison_markdown(cmp)
        (pred_dir / "comparison.md").write_text(md)
        (pred_dir / "comparison.json").write_text(json.dumps(cmp, indent=1, ensure_ascii=False))
        if not args.no_plot:
            comparison_plot(cmp, pred_dir / "comparison.png")
        print()
        print(md)
        out["comparison"] = cmp
    return out



def cli(argv=None) -> int:
    """Console-script entry point: `main` returns the scores (for callers in Python), which a
    console script's ``sys.exit(main())`` would print and turn into exit status 1."""
    main(argv)
    return 0


if __name__ == "__main__":
    sys.exit(cli())
