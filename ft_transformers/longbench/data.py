"""LongBench data: local ``<task>.jsonl`` files (``data.zip`` layout), the zip itself, or the Hub.

Rows keep LongBench's schema: ``input``, ``context``, ``answers`` (list), ``length`` (word count),
``dataset``, ``language``, ``all_classes`` (list or null), ``_id``. LongBench-E splits are the
files/configs ``<task>_e``.

Hub: ``THUDM/LongBench`` is a loading-script dataset, which ``datasets>=4`` refuses to run. Its
automatic Parquet conversion (the ``refs/convert/parquet`` branch, one folder per config) loads
without the script; `load_rows` falls back to it. A local copy of that branch
(``<dir>/<config>/test/*.parquet``) works offline the same way.
"""

from __future__ import annotations

import glob
import json
import os
import zipfile
from pathlib import Path

from .runtime import require

PARQUET_REVISION = "refs/convert/parquet"


def split_name(task: str, longbench_e: bool) -> str:
    """File / config name of a task: ``hotpotqa`` or ``hotpotqa_e``."""
    return f"{task}_e" if longbench_e else task


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _from_dir(root: Path, name: str) -> list[dict] | None:
    for cand in (root / f"{name}.jsonl", root / "data" / f"{name}.jsonl"):
        if cand.is_file():
            return read_jsonl(cand)
    parquet = sorted(glob.glob(str(root / name / "test" / "*.parquet"))) or \
        sorted(glob.glob(str(root / name / "*.parquet")))
    if parquet:
        return _read_parquet(parquet)
    return None


def _from_zip(path: Path, name: str) -> list[dict] | None:
    with zipfile.ZipFile(path) as zf:
        members = set(zf.namelist())
        for cand in (f"data/{name}.jsonl", f"{name}.jsonl"):
            if cand in members:
                with zf.open(cand) as f:
                    lines = f.read().decode("utf-8").splitlines()
                return [json.loads(line) for line in lines if line.strip()]
    return None


def _read_parquet(files: list[str]) -> list[dict]:
    load_dataset = require("datasets", "reading LongBench from Parquet or the Hub").load_dataset

    ds = load_dataset("parquet", data_files={"test": files}, split="test")
    return [_plain(r) for r in ds]


def _plain(row: dict) -> dict:
    row = dict(row)
    if row.get("answers") is not None:
        row["answers"] = list(row["answers"])
    if row.get("all_classes") is not None:
        row["all_classes"] = list(row["all_classes"])
    return row


def parquet_export_files(dataset_id: str, name: str) -> list[str]:
    """``hf://`` globs of the Parquet conversion of config ``name`` of a Hub dataset."""
    rev = PARQUET_REVISION.replace("/", "%2F")
    base = f"hf://datasets/{dataset_id}@{rev}/{name}"
    return [f"{base}/test/*.parquet", f"{base}/*.parquet"]


def _from_hub(dataset_id: str, name: str, revision: str | None) -> list[dict]:
    load_dataset = require("datasets", "reading LongBench from Parquet or the Hub").load_dataset

    errors = []
    try:
        ds = load_dataset(dataset_id, name, split="test", revision=revision)
        return [_plain(r) for r in ds]
    except Exception as e:  # script datasets raise under datasets>=4; fall back to the Parquet export
        errors.append(f"{dataset_id}/{name}: {type(e).__name__}: {e}")
    for pattern in parquet_export_files(dataset_id, name):
        try:
            ds = load_dataset("parquet", data_files={"test": pattern}, split="test")
            return [_plain(r) for r in ds]
        except Exception as e:
            errors.append(f"{pattern}: {type(e).__name__}: {e}")
    raise RuntimeError("could not load LongBench split from the Hub:\n  " + "\n  ".join(errors))


def load_rows(task: str, *, data_dir: str | None = None, dataset: str | None = None,
              longbench_e: bool = False, revision: str | None = None) -> list[dict]:
    """All rows of one task split, in the benchmark's order.

    ``data_dir``: a folder with ``<name>.jsonl`` (or ``data/<name>.jsonl``, i.e. the unpacked
    ``data.zip``), a folder with ``<name>/test/*.parquet`` (the Parquet export), or ``data.zip``.
    ``dataset``: a Hub dataset id (online), used when ``data_dir`` is not given.
    """
    name = split_name(task, longbench_e)
    if data_dir:
        p = Path(data_dir)
        rows = _from_zip(p, name) if p.is_file() else _from_dir(p, name) if p.is_dir() else None
        if rows is None:
            if not p.exists():
                raise FileNotFoundError(f"--data-dir {data_dir} does not exist")
            raise FileNotFoundError(f"no {name}.jsonl (or {name}/test/*.parquet) in {data_dir}")
        return [_plain(r) for r in rows]
    if dataset:
        return _from_hub(dataset, name, revision)
    raise ValueError("give --data-dir (local LongBench files) or --dataset (a Hub id)")


def row_keys(rows: list[dict]) -> list[str]:
    """Stable identity of each row for resuming: its ``_id`` when those are present and unique
    within the split, else its position (``#<index>``)."""
    ids = [r.get("_id") for r in rows]
    if all(i not in (None, "") for i in ids) and len(set(map(str, ids))) == len(ids):
        return [str(i) for i in ids]
    return [f"#{i}" for i in range(len(rows))]
