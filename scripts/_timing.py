"""Interleaved timing for the benchmark scripts (``bench_linear.py``, ``bench_attention.py``).

The H100's speed drifts during a run: single timings of the same call at 8192³ spread over
0.82–0.96× cuBLAS in one device call (docs/vabft.md). Timing every variant once per
round, in an order rotated by one each round, and taking medians of the same round's ratios lets a
drift hit every variant of a ratio alike."""

from __future__ import annotations

import statistics
from collections.abc import Callable


def interleaved(fns: dict[str, Callable], rounds: int, timer: Callable[[Callable], float]
                ) -> dict[str, list[float]]:
    """Each of ``fns`` timed once per round by ``timer`` (ms), the order rotated by one each round.

    Returns every round's time per name, in round order."""
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            times[name].append(timer(fns[name]))
    return times


def ratio_summary(times: dict[str, list[float]], base: str, name: str) -> tuple[float, float, float]:
    """(median, lowest, highest) over the rounds of ``base``'s time / ``name``'s time in the same round."""
    r = [tb / tn for tb, tn in zip(times[base], times[name], strict=True)]
    return statistics.median(r), min(r), max(r)
