"""What the scripts share: the provenance a result is written with, and loading a causal LM for
fixed-length greedy generation. `versions` and `load_model` live in the library
(`ft_transformers.longbench.runtime`, which the LongBench console scripts use) and are re-exported.

Scripts import it as a top-level module (``from _common import ...``): a script run as a file has
``scripts/`` on ``sys.path`` already, and the tests put it there.
"""

from __future__ import annotations

import csv
import platform

import torch

from ft_transformers.longbench.runtime import load_model, versions

__all__ = ["device_label", "environment", "fixed_length", "load_model", "grouped_bars", "versions", "write_rows"]


def device_label(device: torch.device | str | None = None) -> str:
    """The device results were measured on, in words; ``None``: the first GPU if there is one, else the CPU."""
    if device is None:
        device = "cuda:0" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        return (f"{torch.cuda.get_device_name(device)} (sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, "
                f"{p.total_memory / 2**30:.0f} GiB)")
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def write_rows(path: str, rows: list[dict]) -> None:
    """``rows`` (dicts of the same keys) as a CSV at ``path``, columns in the first row's order."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print("wrote", path)


def grouped_bars(ax, keys: list, series: dict[str, dict]) -> None:
    """One group of bars per key on the matplotlib axes ``ax``, a bar per series (name → {key: value}; NaN
    where a series lacks the key), a line at 1 and an x tick per group (the caller labels them)."""
    width = 0.8 / max(len(series), 1)
    for i, (name, val) in enumerate(series.items()):
        ax.bar([j + (i - len(series) / 2) * width for j in range(len(keys))],
               [val.get(k, float("nan")) for k in keys], width, label=name)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(keys)))


def environment(device: torch.device | str | None = None) -> str:
    """Two lines for the head of a result file: ``device: ...`` and the `versions`."""
    return f"device: {device_label(device)}\n" + ", ".join(f"{k} {v}" for k, v in versions().items())


def fixed_length(model):
    """Set ``model``'s generation config to greedy generation of exactly the requested length: no
    end-of-sequence token, pad id 0, no sampling settings (they would only warn). Returns ``model``."""
    gc = model.generation_config
    gc.eos_token_id = None
    gc.pad_token_id = 0
    gc.do_sample = False
    for attr in ("temperature", "top_p", "top_k"):
        if hasattr(gc, attr):
            setattr(gc, attr, None)
    return model

