"""PASA (seed 002): the shift factor β of the pseudo-average shifting attention.

PASA shifts each key block by β times its mean, ``K' = (I − (β/n)·J)·K``; the shifting matrix
is stored in the low-precision input format, so its entries ``1 − β/n`` and ``−β/n`` round.
The *optimal accuracy condition* (seed 002, eq. 16 and Appendix A–C) picks β so that the
invariance the correction relies on, ``β/(1−β)``, equals what the rounded matrix really
implements, ``f(β) = b·n / (a·(a − b·n)) + (1 − a)/a`` with ``b = fl(β/n)`` and
``a = fl(1 − β/n) + b``. It is solved by the fixed-point iteration ``β ← f(β) / (1 + f(β))``
in float64.
"""

from __future__ import annotations

import torch

__all__ = ["optimal_beta"]


def _rounded_invariance(beta: float, n: int, dtype: torch.dtype) -> float:
    """f(β): the invariance implemented by the shifting matrix rounded to ``dtype``."""
    b64 = torch.tensor(beta / n, dtype=torch.float64)
    b = b64.to(dtype).double()
    a = torch.tensor(1.0 - beta / n, dtype=torch.float64).to(dtype).double() + b
    return float(b * n / (a * (a - b * n)) + (1.0 - a) / a)


def optimal_beta(block_n: int, dtype: torch.dtype = torch.float16, beta0: float = 1.0 - 2.0**-6,
                 *, tol: float = 1e-10, max_iter: int = 1000) -> float:
    """The β that satisfies PASA's optimal accuracy condition for key blocks of ``block_n``.

    Args:
        block_n: keys per block (n in the seed's formulas, s2 in Algorithm 1).
        dtype: format the shifting matrix is stored in (the input format: fp16 or bf16).
        beta0: initial guess; the seed uses 1 − 2^-4, 1 − 2^-5, 1 − 2^-6.
    Returns:
        β as a Python float (e.g. 0.984497 for fp16, block 128, β0 = 1 − 2^-6).
    """
    if block_n < 1:
        raise ValueError(f"block_n must be positive, got {block_n}")
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"PASA is defined for fp16/bf16/fp32 inputs, got {dtype}")
    if not 0.0 < beta0 < 1.0:
        raise ValueError(f"beta0 must lie in (0, 1), got {beta0}")
    beta = float(beta0)
    for _ in range(max_iter):
        f = _rounded_invariance(beta, block_n, dtype)
        new = f / (1.0 + f)
        if abs(new - beta) <= tol * abs(beta):
            return new
        beta = new
    raise RuntimeError(f"PASA β iteration did not converge from β0={beta0} (block {block_n}, {dtype})")
