"""What the Triton kernels and the PyTorch reference path agree on: sites, event kinds, the counter
block, the exp check's constants and the seed derivation of injected faults.

Both sides import this module; it imports nothing from the library, so ``kernels/`` stays a leaf.

A *counter block* is an int32 tensor of shape ``COUNTER_SHAPE = (len(SITES), len(KINDS))`` that
kernels add into on the device. Row ``SITE_INDEX[site]``, column ``KIND_INDEX[kind]`` counts the
events of that kind found at that site; inside a kernel the flat slot is ``site · len(KINDS) + kind``.

A *fault plan* is what a kernel takes as ``plan``: any object with ``for_site(site, shape, dtype,
device)`` returning ``None`` or the flips of that site for this call (``positions``: (count, ndim)
int64 coordinates in the site's logical shape, or ``None`` in BER mode; ``seed``; ``spec.bit`` /
``spec.ber``). The library's `ft_transformers.injection.FaultPlan` is one.
"""

from __future__ import annotations

import hashlib
import math
import struct

import torch

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


def new_counters(device: torch.device | str) -> torch.Tensor:
    """A zeroed (sites, kinds) int32 counter block on ``device``."""
    return torch.zeros(COUNTER_SHAPE, dtype=torch.int32, device=device)


def derive_seed(*parts: object) -> int:
    """A stable 63-bit seed from any printable parts (independent of PYTHONHASHSEED)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


# EFTA step 4, the product check of ``P = exp(x)`` per group (row i, residue r) of L keys: it compares
# ``log2 Π P`` with ``log2(e)·Σ x`` within ``EXP_ULPS·u·log2(e)·(3L + |Σ x|)`` (u = 2^-24). x below
# ``EXP_XMIN`` (masked keys included) counts as ``EXP_XMIN`` and P below ``P_MIN = exp(EXP_XMIN)`` as
# ``P_MIN`` (a NaN-propagating fp32 max, so a NaN stays NaN and a negative P becomes ``P_MIN``). The
# product of ``EXP_MAX_GROUP`` clamped values stays a normal fp32 number (≥ e^-80 > 2^-126), so it is
# formed directly in fp32.
EXP_ULPS = 64.0
EXP_XMIN = -20.0
EXP_MAX_GROUP = 4  # keys per group (L = block / stride = 64 / 16) for which P_MIN^L is still normal
LOG2E = 1.4426950408889634
P_MIN = struct.unpack("<f", struct.pack("<f", math.exp(EXP_XMIN)))[0]  # exp(−20) rounded to fp32
