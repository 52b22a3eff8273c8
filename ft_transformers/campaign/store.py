"""Campaign results on disk: the append-only JSONL store, its read-only loader, and the provenance
(library, torch and transformers versions, git commit, source hash) every record carries.

File format (``FORMAT_VERSION``): one ``header`` line (config, fingerprint, versions), one ``clean``
line per prompt, one ``trial`` line per trial; every line is a JSON object with a ``type`` key.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
from pathlib import Path

import torch

FORMAT_VERSION = 1


def source_hash() -> str:
    """Short hash of the library's Python sources (ft_transformers, its kernels and patches), so a
    record tells which code produced it even in an uncommitted tree."""
    import importlib.util

    h = hashlib.blake2b(digest_size=8)
    dirs = [Path(__file__).resolve().parent.parent]  # ft_transformers/
    for sub in ("ft_transformers.kernels", "ft_transformers.patches"):
        try:
            spec = importlib.util.find_spec(sub)
        except (ImportError, ValueError):
            spec = None
        if spec is not None and spec.submodule_search_locations:
            dirs += [Path(d) for d in spec.submodule_search_locations]
    for d in dirs:
        for f in sorted(d.rglob("*.py")):
            h.update(f.name.encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def versions() -> dict[str, str]:
    """Provenance of a record: ft_transformers, torch, transformers and python versions, the `source_hash`,
    and the git commit when the library runs from a checkout."""
    import transformers

    from .. import __version__

    v = {"ft_transformers": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
         "python": platform.python_version()}
    v["source"] = source_hash()
    try:
        root = Path(__file__).resolve().parents[2]  # the checkout holding ft_transformers/
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                             text=True, timeout=5)
        if out.returncode == 0:
            v["git"] = out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return v


class CampaignStore:
    """Append-only JSONL file: a header line, ``clean`` lines, ``trial`` lines.

    `load` reads what is there, drops a partial last line (a campaign killed mid-write), checks
    that the file belongs to the same campaign (fingerprint) and keeps the records; `append`
    writes one line and fsyncs it, so a kill loses at most the trial in flight.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.header: dict | None = None
        self.clean: dict[int, dict] = {}
        self.trials: dict[str, dict] = {}
        self.dropped_bytes = 0

    def load(self) -> CampaignStore:
        if not self.path.exists():
            return self
        data = self.path.read_bytes()
        good_end = 0
        pos = 0
        records = []
        while pos < len(data):
            nl = data.find(b"\n", pos)
            if nl < 0:  # no newline: a partial last line
                break
            line = data[pos:nl]
            try:
                rec = json.loads(line) if line.strip() else None
            except json.JSONDecodeError:
                if data[nl + 1:].strip():
                    raise ValueError(f"{self.path}: corrupt line at byte {pos} (not the last one)") from None
                break
            if rec is not None:
                records.append(rec)
            pos = nl + 1
            good_end = pos
        self.dropped_bytes = len(data) - good_end
        if self.dropped_bytes:
            with open(self.path, "r+b") as f:
                f.truncate(good_end)
        for rec in records:
            kind = rec.get("type")
            if kind == "header":
                self.header = rec
            elif kind == "clean":
                self.clean[int(rec["prompt_index"])] = rec
            elif kind == "trial":
                self.trials.setdefault(rec["trial_id"], rec)
        return self

    def append(self, rec: dict) -> None:
        line = json.dumps(rec, separators=(",", ":")) + "\n"
        with open(self.path, "a") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        if rec["type"] == "header":
            self.header = rec
        elif rec["type"] == "clean":
            self.clean[int(rec["prompt_index"])] = rec
        elif rec["type"] == "trial":
            self.trials[rec["trial_id"]] = rec


def load_campaign(path: str | os.PathLike) -> tuple[dict | None, list[dict], list[dict]]:
    """``(header, clean records, trial records)`` of a JSONL campaign file (read-only)."""
    path = Path(path)
    header, cleans, trials = None, {}, {}
    with open(path) as f:
        for line in f:
            if not line.endswith("\n"):
                break
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if rec.get("type") == "header":
                header = rec
            elif rec.get("type") == "clean":
                cleans[rec["prompt_index"]] = rec
            elif rec.get("type") == "trial":
                trials.setdefault(rec["trial_id"], rec)
    return header, [cleans[k] for k in sorted(cleans)], sorted(trials.values(), key=lambda r: r["index"])

