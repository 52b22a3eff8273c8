"""Device-side event counters of one kernel call, and the `stats` mapping returned to users.

Kernels add into a counter block: an int32 tensor of shape ``COUNTER_SHAPE`` = (sites, kinds)
living on the computation's device. Nothing is read on the host until someone looks at the
returned `FaultStats`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from .kernels.contract import COUNTER_SHAPE, KIND_INDEX, KINDS, SITE_INDEX, SITES, new_counters

__all__ = ["FaultStats", "add_count", "new_counters"]



def add_count(counters: torch.Tensor, site: str, kind: str, value: torch.Tensor | int) -> None:
    """``counters[site, kind] += value`` without a host synchronisation (``value`` may be a tensor)."""
    cell = counters[SITE_INDEX[site], KIND_INDEX[kind]]
    if isinstance(value, torch.Tensor):
        cell.add_(value.to(device=counters.device, dtype=counters.dtype).sum())
    elif value:
        cell.add_(int(value))


class FaultStats(Mapping):
    """``{kind: int}`` over the event kinds of one call (summed over sites).

    Backed by the device counter block; the first read copies it to the host (may synchronise).
    `by_site` gives ``{site: {kind: int}}`` for the sites with any event.
    """

    def __init__(self, counters: torch.Tensor) -> None:
        if tuple(counters.shape) != COUNTER_SHAPE:
            raise ValueError(f"counter block must have shape {COUNTER_SHAPE}, got {tuple(counters.shape)}")
        self.counters = counters
        self._host: list[list[int]] | None = None

    def _read(self) -> list[list[int]]:
        if self._host is None:
            self._host = self.counters.detach().cpu().tolist()
        return self._host

    def __getitem__(self, kind: str) -> int:
        k = KIND_INDEX[kind]
        return int(sum(row[k] for row in self._read()))

    def __iter__(self) -> Iterator[str]:
        return iter(KINDS)

    def __len__(self) -> int:
        return len(KINDS)

    def by_site(self) -> dict[str, dict[str, int]]:
        host = self._read()
        return {s: dict(zip(KINDS, host[i])) for i, s in enumerate(SITES) if any(host[i])}

    def __repr__(self) -> str:
        return f"FaultStats({dict(self)})"
