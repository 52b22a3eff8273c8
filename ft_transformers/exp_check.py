"""EFTA step 4, the product check of ``P = exp(x)`` per group: its constants, shared by the Triton
kernel (`ft_transformers.kernels.efta`) and the PyTorch reference (`ft_transformers.efta_reference`),
which must not import the kernel module.

Per group (row i, residue r) of L keys, the check compares ``log2 Π P`` with ``log2(e)·Σ x`` within
``EXP_ULPS·u·log2(e)·(3L + |Σ x|)`` (u = 2^-24). x below ``EXP_XMIN`` (masked keys included) counts
as ``EXP_XMIN`` and P below ``P_MIN = exp(EXP_XMIN)`` as ``P_MIN`` (a NaN-propagating fp32 max, so a
NaN stays NaN and a negative P becomes ``P_MIN``). The product of ``EXP_MAX_GROUP`` clamped values
stays a normal fp32 number (≥ e^-80 > 2^-126), so it is formed directly in fp32.
"""

from __future__ import annotations

import math
import struct

EXP_ULPS = 64.0
EXP_XMIN = -20.0
EXP_MAX_GROUP = 4  # keys per group (L = block / stride = 64 / 16) for which P_MIN^L is still normal
LOG2E = 1.4426950408889634
P_MIN = struct.unpack("<f", struct.pack("<f", math.exp(EXP_XMIN)))[0]  # exp(−20) rounded to fp32
