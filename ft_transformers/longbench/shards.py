"""Prediction files: append-as-you-go, resume, data-parallel shards and their merge.

Layout of one run (one model, one mode)::

    <run_dir>/<name>.jsonl                   predictions, one row per line, in dataset order
    <run_dir>/ft_events/<name>.jsonl         per row: fault-tolerance events (library modes)
    <run_dir>/<name>.fault_report.json       the task's fault report (aggregated from the above)
    <run_dir>/<name>.rank003-of-008.jsonl    a process's shard while a data-parallel run is going
    <run_dir>/ft_events/<name>.rank003-of-008.jsonl

The event files sit in a subfolder because LongBench's own ``eval.py`` reads every
``*.jsonl`` of a run folder as predictions (and stops at the first line without ``pred``).

``name`` is the task (``hotpotqa``), for LongBench v1 and LongBench-E alike (the split is the
run folder's: see pred.py). A single process
appends straight to ``<name>.jsonl``; with N processes, process r appends to its own shard, and
rank 0 merges every shard into ``<name>.jsonl`` in dataset order (deterministic, whatever the
world size or the order in which processes finish) and removes the shards. Rows already present
in the final file or in any shard (of any world size) are not predicted again.

Sharding is strided over the rows still to do (``todo[rank::world]``), as LongBench's own
multi-GPU script does over all rows.
"""

from __future__ import annotations

import glob
import json
import os
import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path

_SHARD_RE = re.compile(r"\.rank(\d+)-of-(\d+)\.jsonl$")

#: Subfolder of a run folder that holds the per-row fault-tolerance events.
EVENTS_DIR = "ft_events"


def shard(items: Sequence, rank: int, world: int) -> list:
    """The items process ``rank`` of ``world`` handles: every ``world``-th from ``rank``."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"bad rank {rank} for world size {world}")
    return list(items[rank::world])


def read_jsonl_tolerant(path: str | os.PathLike) -> list[dict]:
    """JSON lines of a file that a killed process may have left with a partial last line."""
    out = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # a torn write; the row will be redone
    except FileNotFoundError:
        pass
    return out


def _repair_tail(path: Path) -> None:
    """Drop a partial last line (no trailing newline) so that appends start on a fresh line."""
    if not path.exists() or path.stat().st_size == 0:
        return
    data = path.read_bytes()
    if data.endswith(b"\n"):
        return
    with open(path, "rb+") as f:
        f.truncate(data.rfind(b"\n") + 1)


class TaskFiles:
    """The files of one task split in one run directory, seen from process ``rank`` of ``world``."""

    def __init__(self, run_dir: str | os.PathLike, name: str, rank: int = 0, world: int = 1) -> None:
        self.dir = Path(run_dir)
        self.name = name
        self.rank = rank
        self.world = world
        self.events_dir = self.dir / EVENTS_DIR
        self.final = self.dir / f"{name}.jsonl"
        self.events_final = self.events_dir / f"{name}.jsonl"
        self.report = self.dir / f"{name}.fault_report.json"
        if world == 1:
            self.mine, self.events_mine = self.final, self.events_final
        else:
            tag = f"rank{rank:03d}-of-{world:03d}"
            self.mine = self.dir / f"{name}.{tag}.jsonl"
            self.events_mine = self.events_dir / f"{name}.{tag}.jsonl"

    # -- discovery ---------------------------------------------------------------------------
    def shard_files(self) -> list[Path]:
        pat = glob.escape(str(self.dir / self.name)) + ".rank*-of-*.jsonl"
        return sorted(Path(p) for p in glob.glob(pat) if _SHARD_RE.search(p))

    def event_shard_files(self) -> list[Path]:
        pat = glob.escape(str(self.events_dir / self.name)) + ".rank*-of-*.jsonl"
        return sorted(Path(p) for p in glob.glob(pat) if _SHARD_RE.search(p))

    def adopt_events_beside(self) -> None:
        """Move event files found beside the predictions (``<name>.ft_events[.rank..].jsonl``,
        which LongBench's eval.py would read as predictions) into the events subfolder."""
        pat = glob.escape(str(self.dir / self.name)) + ".ft_events*.jsonl"
        for p in map(Path, glob.glob(pat)):
            rest = p.name[len(self.name) + len(".ft_events"):]  # ".jsonl" or ".rankR-of-W.jsonl"
            self.events_dir.mkdir(parents=True, exist_ok=True)
            dest = self.events_dir / f"{self.name}{rest}"
            if dest.exists():
                _merge_files([dest, p], dest)
                p.unlink()
            else:
                os.replace(p, dest)

    def done_keys(self) -> set[str]:
        """Keys (``_id``) of the rows predicted so far by any process of any earlier run."""
        keys = set()
        for path in [self.final, *self.shard_files()]:
            keys.update(str(r["_id"]) for r in read_jsonl_tolerant(path) if "_id" in r)
        return keys

    def remove(self) -> None:
        """Delete every file of this task split in the run folder (``--overwrite``)."""
        self.adopt_events_beside()
        for p in [self.final, self.events_final, self.report, *self.shard_files(), *self.event_shard_files()]:
            p.unlink(missing_ok=True)

    # -- writing -----------------------------------------------------------------------------
    def open_for_append(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        _repair_tail(self.mine)
        _repair_tail(self.events_mine)

    @staticmethod
    def _append(path: Path, obj: dict) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(obj, ensure_ascii=False) + "\n")
            f.flush()

    def append(self, record: dict, events: dict | None = None) -> None:
        """Append one prediction (and its fault events, written first so a row is never
        recorded as done without them)."""
        if events is not None:
            self._append(self.events_mine, events)
        self._append(self.mine, record)

    def prune_events(self) -> None:
        """Drop event lines of rows that never made it into the predictions (a run killed
        between writing a row's events and its prediction) and duplicates (rank 0, at start)."""
        if not self.events_final.exists():
            return
        keep = {str(r.get("_id")) for r in read_jsonl_tolerant(self.final)}
        lines = read_jsonl_tolerant(self.events_final)
        seen, out = set(), []
        for ln in lines:
            k = str(ln.get("_id"))
            if k in keep and k not in seen:
                seen.add(k)
                out.append(ln)
        if len(out) != len(lines):
            tmp = self.events_final.with_name(self.events_final.name + ".tmp")
            tmp.write_text("".join(json.dumps(x, ensure_ascii=False) + "\n" for x in out), encoding="utf-8")
            os.replace(tmp, self.events_final)

    # -- merging (rank 0, after every process has finished the task) --------------------------
    def merge(self) -> int:
        """Fold every shard into the final files in dataset order; returns the number of shard files."""
        shards = self.shard_files()
        if not shards and not self.event_shard_files():
            return 0
        _merge_files([self.final, *self.shard_files()], self.final)
        _merge_files([self.events_final, *self.event_shard_files()], self.events_final)
        for p in [*self.shard_files(), *self.event_shard_files()]:
            p.unlink(missing_ok=True)
        return len(shards)


def _merge_files(paths: Iterable[Path], dest: Path) -> int:
    seen: dict[str, dict] = {}
    present = False
    for p in paths:
        if p.exists():
            present = True
        for r in read_jsonl_tolerant(p):
            k = str(r.get("_id"))
            if k not in seen:
                seen[k] = r
    if not present:
        return 0
    rows = sorted(seen.values(), key=lambda r: (r.get("index", 1 << 62), str(r.get("_id"))))
    tmp = dest.with_name(dest.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    os.replace(tmp, dest)
    return len(rows)


# --------------------------------------------------------------------------------------------
# Fault reports
# --------------------------------------------------------------------------------------------

KINDS = ("detected", "corrected", "recomputed", "uncorrectable", "nonfinite_input")


def row_events(report, flips: int | None, key: str, index: int) -> dict:
    """One ``ft_events/<name>.jsonl`` line from an `ft_transformers.FTReport` of one row."""
    return {
        "_id": key, "index": index, "steps": int(report.steps), "flips": flips,
        "totals": report.totals(),
        "events": [[e.step, e.layer, e.module, e.site, e.kind, e.count] for e in report.events],
    }


def aggregate_events(lines: Iterable[dict]) -> dict:
    """The task's fault report: totals, per (layer, site), per generation step, per row."""
    totals = dict.fromkeys(KINDS, 0)
    by_layer_site: dict[tuple[int, str], dict[str, int]] = defaultdict(lambda: dict.fromkeys(KINDS, 0))
    by_step: dict[int, dict[str, int]] = defaultdict(lambda: dict.fromkeys(KINDS, 0))
    rows, steps, flips = 0, 0, 0
    per_row = []
    for ln in lines:
        rows += 1
        steps += int(ln.get("steps") or 0)
        flips += int(ln.get("flips") or 0)
        for step, layer, _module, site, kind, count in ln.get("events", []):
            totals[kind] = totals.get(kind, 0) + count
            by_layer_site[(layer, site)][kind] += count
            by_step[step][kind] += count
        per_row.append({"_id": ln.get("_id"), "flips": ln.get("flips"), "steps": ln.get("steps"),
                        **{k: v for k, v in (ln.get("totals") or {}).items() if v}})
    return {
        "rows": rows, "model_calls": steps, "flips_injected": flips, "totals": totals,
        "by_layer_site": [{"layer": layer, "site": site, **c}
                          for (layer, site), c in sorted(by_layer_site.items())],
        "by_step": [{"step": s, **c} for s, c in sorted(by_step.items())],
        "per_row": per_row,
    }


def write_task_report(files: TaskFiles, extra: dict | None = None) -> dict | None:
    lines = read_jsonl_tolerant(files.events_final)
    if not lines:
        return None
    rep = aggregate_events(lines)
    if extra:
        rep = {**extra, **rep}
    files.report.write_text(json.dumps(rep, indent=1))
    return rep


def write_run_report(run_dir: str | os.PathLike, extra: dict | None = None) -> dict | None:
    """``<run_dir>/fault_report.json``: every task's totals and the run's."""
    run_dir = Path(run_dir)
    tasks = {}
    for p in sorted(run_dir.glob("*.fault_report.json")):
        rep = json.loads(p.read_text())
        tasks[p.name[: -len(".fault_report.json")]] = {k: rep[k] for k in
                                                        ("rows", "model_calls", "flips_injected", "totals")}
    if not tasks:
        return None
    totals = dict.fromkeys(KINDS, 0)
    for t in tasks.values():
        for k, v in t["totals"].items():
            totals[k] = totals.get(k, 0) + v
    out = {**(extra or {}), "rows": sum(t["rows"] for t in tasks.values()),
           "model_calls": sum(t["model_calls"] for t in tasks.values()),
           "flips_injected": sum(t["flips_injected"] for t in tasks.values()),
           "totals": totals, "tasks": tasks}
    (run_dir / "fault_report.json").write_text(json.dumps(out, indent=1))
    return out
