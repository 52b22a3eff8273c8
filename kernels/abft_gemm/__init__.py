"""V-ABFT checked GEMM ``y = x·Wᵀ + b`` as Triton kernels that verify the fp32 accumulators.

Contract: ``docs/algorithms.md`` ("V-ABFT checked linear") with the verification moved *before* the
output is rounded (online ABFT): every (row, 64-column group) sum of the fp32 accumulators is compared
with the group's checksum ``x·w1_g + b1_g``, so the threshold's unit error is fp32-level (the
``accumulator`` entries of the e_max tables) and its width is that of 64 columns, not of a whole row.
Same checks, same counters, same injection site as the PyTorch path (`ft_transformers.checked_linear`,
which stays the fallback and the oracle).

Modules, by role:

* kernels (``@triton.jit``): `tile` (the tiled GEMM, leaving the group sums), `persistent` (wide calls:
  a persistent TMA GEMM, the same epilogue), `groups` (their verification, a second launch), `decode`
  (M ≤ 16: each 64-column tile checks itself, one launch), `checksum_tiles` (the group checksums as
  programs of a GEMM's launch), `product_check` (the cuBLAS form's checksums beside cuBLAS's product and its
  check after it), `common` (device helpers they share);
* host: `forms` (`choose_form`: which kernel, split-K, TMA, the cuBLAS form), `configs` (block sizes) and `tuning` (the
  tuner), `calls` (launch arguments, buffers, per-device cells, the verification's operand), `prepared`
  (replayed calls and the fast path a caller keeps), `api` (the entry points exported here).

No host synchronisation on any path. Under ``TRITON_INTERPRET=1`` (CPU tensors) one small fixed config
runs, and dots of fp16/bf16 operands are taken in fp32 (exact products, fp32 sums: the GPU's semantics).
"""

from .api import (
    SIBLINGS_MAX_ROWS,
    AbftGemmUnsupported,
    EmaxTable,
    checked_gemm,
    checked_gemm_siblings,
    gemm_residuals,
    linear_forward,
    siblings_forward,
    siblings_supported,
)
from .forms import interpreting
from .prepared import FastPath

__all__ = [
    "SIBLINGS_MAX_ROWS",
    "AbftGemmUnsupported",
    "EmaxTable",
    "FastPath",
    "checked_gemm",
    "checked_gemm_siblings",
    "gemm_residuals",
    "interpreting",
    "linear_forward",
    "siblings_forward",
    "siblings_supported",
]
