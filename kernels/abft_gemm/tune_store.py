"""The checked GEMM's tuning results kept across processes.

`tuning.pick_config` times a shape's candidate configs once; without a store every new process (each
rank of a tensor-parallel run, each script, each LongBench worker) would time them again, which costs
seconds per distinct shape before the first token. A `TuneStore` is one JSON file per GPU model and per
*kernel fingerprint*: the Triton and torch versions and the source text of the checked GEMM's modules.
A new GPU model, a Triton upgrade or any edit of the kernels or their config lists starts a new file,
so a stored config is only ever reused for the code it was timed with.

File ``<dir>/gemm_tune-<fingerprint>.json``::

    {"format": 1, "device": "NVIDIA H100 80GB HBM3 (sm_90)", "triton": "3.6.0", "torch": "2.11.0",
     "entries": {"<key as JSON>": [BLOCK_M, BLOCK_N, BLOCK_K, warps, stages(, false)], ...}}

Writes are read-merge-replace (`os.replace` of a private temporary file), so processes tuning at the same
time never leave a torn file; at worst one's new entry is lost and timed again later. An unreadable file
is ignored with one warning; an unwritable directory makes the store read-only with one warning. Set
``FTT_TUNE_CACHE=0`` to switch the store off, ``FTT_CACHE_DIR`` to move it (default
``$XDG_CACHE_HOME/ft_transformers`` or ``~/.cache/ft_transformers``; `options.Options.tune_cache_dir`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import warnings
from pathlib import Path

import torch

__all__ = ["FORMAT", "TuneStore", "device_tag", "encode_key", "fingerprint"]

FORMAT = 1
_SOURCES = ("abft_gemm", "tl_common.py", "gemm_checksums.py", "contract.py")  # under kernels/


def encode_key(key: tuple) -> str:
    """A tuner key (dtypes, bools, ints, None, nested tuples) as a stable JSON string."""

    def enc(v):
        if isinstance(v, torch.dtype):
            return str(v)
        if isinstance(v, tuple):
            return [enc(x) for x in v]
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        raise TypeError(f"tuner key element {v!r} of type {type(v).__name__} has no stable encoding")

    return json.dumps(enc(key), separators=(",", ":"))


def _config(raw) -> tuple | None:
    """A stored config back as the tuner's tuple (5 positive ints, optionally a trailing False), or None."""
    if not isinstance(raw, list) or len(raw) not in (5, 6):
        return None
    ints = raw[:5]
    if not all(type(v) is int and v > 0 for v in ints):
        return None
    if len(raw) == 6:
        return (*ints, False) if raw[5] is False else None
    return tuple(ints)


@functools.cache
def device_tag(index: int) -> str:
    """GPU model and compute capability of CUDA device ``index``, e.g. ``NVIDIA H100 80GB HBM3 (sm_90)``."""
    major, minor = torch.cuda.get_device_capability(index)
    return f"{torch.cuda.get_device_name(index)} (sm_{major}{minor})"


@functools.cache
def _source_digest() -> str:
    root = Path(__file__).resolve().parent.parent  # kernels/
    h = hashlib.sha256()
    for name in _SOURCES:
        p = root / name
        for f in sorted(p.rglob("*.py")) if p.is_dir() else [p]:
            h.update(f.relative_to(root).as_posix().encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def _triton_version() -> str:
    try:
        import triton
    except ImportError:  # pragma: no cover - the store is only used where the kernels run
        return "none"
    return triton.__version__


def fingerprint(tag: str) -> str:
    """16 hex digits naming the file for device ``tag`` and this install's Triton, torch and kernel sources."""
    parts = (str(FORMAT), tag, _triton_version(), torch.__version__, _source_digest())
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


class TuneStore:
    """The stored tuning results of one device tag in ``directory`` (module docstring)."""

    def __init__(self, directory: str | os.PathLike, tag: str) -> None:
        self.path = Path(directory) / f"gemm_tune-{fingerprint(tag)}.json"
        self.tag = tag
        self.writable = True
        self._entries: dict[str, tuple] = self._read()

    def _read(self, quiet: bool = False) -> dict[str, tuple]:
        """The file's valid entries; a missing file (or directory) is empty. ``quiet``: no warnings (the
        merge before a write, after the constructor has warned)."""
        try:
            text = self.path.read_text()
        except (FileNotFoundError, NotADirectoryError):
            return {}
        except OSError as e:
            if quiet:
                return {}
            warnings.warn(f"ft_transformers: cannot read the GEMM tuning store {self.path} ({e}); tuning anew",
                          stacklevel=3)
            return {}
        try:
            data = json.loads(text)
            if data.get("format") != FORMAT or not isinstance(data.get("entries"), dict):
                raise ValueError("unknown layout")
        except (ValueError, AttributeError) as e:
            if quiet:
                return {}
            warnings.warn(f"ft_transformers: ignoring the unreadable GEMM tuning store {self.path} ({e}); it is "
                          "rewritten by the next tuned shape", stacklevel=3)
            return {}
        entries = {}
        for k, v in data["entries"].items():
            cfg = _config(v)
            if isinstance(k, str) and cfg is not None:
                entries[k] = cfg
        return entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: tuple) -> tuple | None:
        """The stored config of tuner key ``key``, or None."""
        return self._entries.get(encode_key(key))

    def put(self, key: tuple, config: tuple) -> None:
        """Store ``config`` for ``key``: merged with what other processes wrote meanwhile, then one atomic
        replace of the file. A failing write warns once and leaves the store read-only."""
        self._entries[encode_key(key)] = tuple(config)
        if not self.writable:
            return
        merged = {**self._read(quiet=True), **self._entries}
        payload = {"format": FORMAT, "device": self.tag, "triton": _triton_version(), "torch": torch.__version__,
                   "entries": {k: list(v) for k, v in sorted(merged.items())}}
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(payload, indent=1))
            os.replace(tmp, self.path)
        except OSError as e:
            self.writable = False
            with contextlib.suppress(OSError):
                tmp.unlink()
            warnings.warn(f"ft_transformers: cannot write the GEMM tuning store {self.path} ({e}); tuning results "
                          "stay in this process (FTT_CACHE_DIR moves the store, FTT_TUNE_CACHE=0 switches it off)",
                          stacklevel=2)
            return
        self._entries = merged


