"""What every step does at its attention site: flip the value (`inject`) and tally an event (`count`).
Sites, kinds and the counter block are the contract's (``kernels/contract.py``)."""

from __future__ import annotations

import torch

from ..counters import add_count
from ..injection import SiteFaults


def inject(sf: SiteFaults | None, x: torch.Tensor, site_shape4: tuple[int, ...], start: int) -> torch.Tensor:
    """Flip the bits ``sf`` holds for this slice of a site; ``x`` back unchanged when ``sf`` is None.

    Args:
        sf: the site's faults (`FaultPlan.for_site`), or None.
        x: any view of a (B, Hq, M, w) slice of the site's logical shape (GQA rows (B, Hkv, G·M, w)
            are the same elements in the same order).
        site_shape4: (B, Hq, M, w), the slice as the site sees it.
        start: offset of the slice along the site's last dim (key, block or head-dim index).
    Returns:
        ``x`` with the faults applied, same shape.
    """
    if sf is None:
        return x
    return sf.apply(x.reshape(site_shape4), dim=-1, start=start).reshape(x.shape)


def count(counters: torch.Tensor | None, site: str, kind: str, value: int | torch.Tensor) -> None:
    """Add ``value`` events of ``kind`` at ``site`` into the (sites, kinds) int32 block, if any."""
    if counters is not None:
        add_count(counters, site, kind, value)


def count_detected(counters: torch.Tensor | None, site: str, nbad: int | torch.Tensor, correct: bool,
                   repaired: str | None = None) -> None:
    """Count ``nbad`` faults found at ``site``: ``detected``, and each also ``uncorrectable`` without
    correction, or ``repaired`` (``corrected`` / ``recomputed``) with it; ``repaired=None``: the caller
    counts the repairs itself (they split into kinds)."""
    count(counters, site, "detected", nbad)
    if not correct:
        count(counters, site, "uncorrectable", nbad)
    elif repaired is not None:
        count(counters, site, repaired, nbad)
