"""V-ABFT checked GEMM ``y = x·Wᵀ + b`` as Triton kernels that verify in their fp32 accumulators.

Contract: ``docs/algorithms.md`` ("V-ABFT checked linear") with the verification moved *before* the
output is rounded (online ABFT): the row checksum is compared with the row sums of the fp32
accumulator tiles, so the threshold's unit error is fp32-level (the ``accumulator`` entries of the
e_max tables, ~1e-6 instead of 2u of fp16/bf16). Same checks, same counters, same injection site as
the PyTorch path (`ft_transformers.checked_linear`, which stays the fallback and the oracle).

Modules, by role:

* kernels (``@triton.jit``): `tile` (the tiled GEMM, checksums shared over its tiles, optionally
  verifying in its own launch), `verify` (the verification, and its second launch), `persistent`
  (wide calls: a pass over x and a persistent TMA GEMM), `decode` (batch-1 decode: each 64-column tile
  checks itself), `common` (device helpers they share);
* host: `forms` (`choose_form`: which kernel, one launch or two, split-K, TMA), `configs` (block sizes)
  and `tuning` (the tuner), `calls` (launch arguments, buffers, per-device cells), `prepared` (replayed
  calls and the fast path a caller keeps), `api` (the entry points exported here).

No host synchronisation on any path. Under ``TRITON_INTERPRET=1`` (CPU tensors) one small fixed config
runs, and dots of fp16/bf16 operands are taken in fp32 (exact products, fp32 sums: the GPU's semantics).
"""

from .api import (
    RECOMPUTE_ROWS,
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
    "RECOMPUTE_ROWS",
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
