"""Names shared by every part of the library: injection/verification sites and event kinds.

A *counter block* is an int32 tensor of shape ``(len(SITES), len(KINDS))`` that kernels add
into on the device; ``COUNTER_SHAPE`` is that shape. Row ``SITE_INDEX[site]``, column
``KIND_INDEX[kind]`` counts the events of that kind found at that site.
"""

from __future__ import annotations

SITES: tuple[str, ...] = (
    "attn.scores",  # S = Q·Kᵀ, fp32 accumulator of GEMM I
    "attn.rowmax",  # running row max m of the online softmax
    "attn.probs",  # P = exp(S - m)
    "attn.rowsum",  # running row sum l of the online softmax
    "attn.output",  # normalised output O / l, before it is stored
    "linear.output",  # y = x·Wᵀ + b, as the GEMM produces it
)
ATTENTION_SITES: tuple[str, ...] = SITES[:5]
LINEAR_SITES: tuple[str, ...] = SITES[5:]

KINDS: tuple[str, ...] = ("detected", "corrected", "recomputed", "uncorrectable", "nonfinite_input")

SITE_INDEX: dict[str, int] = {s: i for i, s in enumerate(SITES)}
KIND_INDEX: dict[str, int] = {k: i for i, k in enumerate(KINDS)}
COUNTER_SHAPE: tuple[int, int] = (len(SITES), len(KINDS))

DETECTED, CORRECTED, RECOMPUTED, UNCORRECTABLE, NONFINITE = range(len(KINDS))
