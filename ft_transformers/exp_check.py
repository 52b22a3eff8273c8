"""EFTA step 4, the product check of ``P = exp(x)`` per group: its constants, shared by the Triton
kernel (`ft_transformers.kernels.efta`) and the PyTorch reference (`ft_transformers.efta_reference`),
which must not import the kernel module.

Per group (row i, residue r) of L keys, the check compares ``Σ log2 P`` with ``log2(e)·Σ x`` within
``EXP_ULPS·u·log2(e)·(3L + |Σ x|)`` (u = 2^-24); x below ``EXP_XMIN`` (masked keys included) counts
as ``EXP_XMIN``, and P is clamped to ``exp(EXP_XMIN)`` on its int32 bits (``PMIN_BITS``).
"""

from __future__ import annotations

import math
import struct

EXP_ULPS = 64.0
EXP_XMIN = -87.0
LOG2E = 1.4426950408889634
PMIN_BITS = struct.unpack("<i", struct.pack("<f", math.exp(EXP_XMIN)))[0]  # fp32 exp(−87) as int32 bits
