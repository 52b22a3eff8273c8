"""PASA (online pseudo-average shifting attention): the math of the paper's Algorithm 1.

The pieces, each a small function used by the reference path (`efta_reference(pasa=True)`) and
by the study script; the Triton kernel implements the same formulas (``docs/pasa.md``):

* `optimal_beta`: the shift factor β (optimal accuracy condition, Appendix C).
* `shift_coefficients` / `shifting_matrix` / `shift_keys`: ``K'_j = fl16(scale·M_j·K_j)``, each
  key block shifted by β times its mean with the shifting matrix stored in fp16.
* `fp16_matmul`: the FP16 score GEMM with FP16 accumulation (emulated, overflow included).
* `pseudo_average_update` / `frame_corrections`: the global pseudo-average F̄ and the Δm'
  corrections (Algorithm 1, lines 13–15) that keep every key block in one frame.

PASA shifts each key block by β times its mean, ``K' = (I − (β/n)·J)·K``; the shifting matrix
is stored in the low-precision input format, so its entries ``1 − β/n`` and ``−β/n`` round.
The *optimal accuracy condition* (the PASA paper, eq. 16 and Appendix A–C) picks β so that the
invariance the correction relies on, ``β/(1−β)``, equals what the rounded matrix really
implements, ``f(β) = b·n / (a·(a − b·n)) + (1 − a)/a`` with ``b = fl(β/n)`` and
``a = fl(1 − β/n) + b``. It is solved by the fixed-point iteration ``β ← f(β) / (1 + f(β))``
in float64.
"""

from __future__ import annotations

import torch

__all__ = [
    "optimal_beta",
    "invariance",
    "recovery_factor",
    "shift_coefficients",
    "shifting_matrix",
    "shift_keys",
    "fp16_matmul",
    "block_pseudo_average",
    "pseudo_average_update",
    "frame_corrections",
    "FP16_CHUNK",
]

FP16_CHUNK = 16  # k-depth of one fp16 tensor-core MMA (m16n8k16): one accumulator rounding each


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
        block_n: keys per block (n in the paper's formulas, s2 in Algorithm 1).
        dtype: format the shifting matrix is stored in (the input format: fp16 or bf16).
        beta0: initial guess; the paper uses 1 − 2^-4, 1 − 2^-5, 1 − 2^-6.
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


def invariance(beta: float) -> float:
    """γ = β/(1 − β): the factor that recovers a block's mean score from its shifted mean.

    With ``S' = S·(I − (β/n)·J)`` (the shifted scores of one key block of n keys),
    ``rowmean(S') = (1 − β)·rowmean(S)`` and therefore ``S = S' + γ·rowmean(S')`` (PASA paper,
    eqs. 13–14; exact in exact arithmetic, and at the optimal β also for the fp16-rounded matrix).
    """
    _check_beta(beta)
    return beta / (1.0 - beta)


def recovery_factor(n: int, beta: float, dtype: torch.dtype = torch.float16) -> float:
    """The γ that recovers a block's scores with the shifting matrix *as rounded to* ``dtype``.

    The rounded matrix is ``M = a·I − b·J`` (b = fl(β/n), a = fl(1 − β/n) + b), so the shifted
    scores are ``S' = a·S − b·n·rowmean(S)`` and ``S ≈ S' + f·rowmean(S')`` with
    ``f = b·n/(a·(a − b·n)) + (1 − a)/a`` (PASA paper, eqs. 20 and 24; the residual
    ``(1 − a)/a·(S' − rowmean(S'))`` is the part no per-row constant can carry). At the optimal β of
    `optimal_beta` for this n, f equals `invariance` β/(1 − β) (that is the optimal accuracy
    condition). A short last key block (fewer keys than the block size the β was chosen for) has
    its own f, which differs from β/(1 − β) by ~1%: used blindly, that error times the block's
    mean score (thousands, when the keys carry a large bias) lands in the block's offset.

    Args:
        n: keys in the block (the size of its shifting matrix).
        beta: shift factor in (0, 1).
        dtype: storage format of the shifting matrix.
    Returns:
        f as a Python float.
    """
    if n < 1:
        raise ValueError(f"the block must hold at least one key, got n={n}")
    _check_beta(beta)
    return _rounded_invariance(float(beta), n, dtype)


def _check_beta(beta: float) -> None:
    if not isinstance(beta, (int, float)) or isinstance(beta, bool) or not 0.0 < float(beta) < 1.0:
        raise ValueError(f"PASA β must be a float in (0, 1), got {beta!r}")


def shift_coefficients(n: int, beta: float, dtype: torch.dtype = torch.float16) -> tuple[float, float]:
    """The two distinct entries of the shifting matrix ``M = I − (β/n)·J`` rounded to ``dtype``.

    Args:
        n: keys in the block (the size of M).
        beta: shift factor in (0, 1).
        dtype: storage format of M (the paper stores it in the input format, fp16).
    Returns:
        ``(diag, off)`` = ``(fl(1 − β/n), −fl(β/n))`` as Python floats (exact values of the
        rounded entries), so ``M = (diag − off)·I + off·J``.
    """
    if n < 1:
        raise ValueError(f"the block must hold at least one key, got n={n}")
    _check_beta(beta)
    diag = float(torch.tensor(1.0 - beta / n, dtype=torch.float64).to(dtype))
    off = -float(torch.tensor(beta / n, dtype=torch.float64).to(dtype))
    return diag, off


def shifting_matrix(n: int, beta: float, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """The paper's shifting matrix ``M = I − (β/n)·J`` (n × n) stored in ``dtype`` (eq. 10 without 1/α)."""
    diag, off = shift_coefficients(n, beta, dtype)
    m = torch.full((n, n), off, dtype=torch.float64)
    m.fill_diagonal_(diag)
    return m.to(dtype)


def shift_keys(k: torch.Tensor, beta: float, scale: float, block_n: int) -> torch.Tensor:
    """Shift every block of ``block_n`` keys by β times its mean, fold in ``scale``, round to fp16.

    ``K'_j = fl16(scale · M_j·K_j)`` with ``M_j`` the fp16 shifting matrix of the block's w keys
    (w = block_n, or fewer for the last block; its mean is over its real keys only). The product
    ``M_j·K_j = diag·K_n + off·(Σ_n' K_n' − K_n)`` is formed in float64 from the fp16 entries and
    rounded once to fp16, the way a tensor-core GEMM with fp32 accumulation and an fp16 epilogue
    produces it (PASA paper, Algorithm 1 line 6; the 1/√d of eq. 10 is folded into the same
    epilogue instead of into M, so that M's entries are exactly what `optimal_beta` assumes).

    Args:
        k: (..., N, D) keys, float16 (other float dtypes are rounded to fp16 first).
        beta: shift factor in (0, 1).
        scale: softmax scale folded into the shifted keys (1/√D for most models).
        block_n: keys per block.
    Returns:
        (..., N, D) float16 shifted, scaled keys.
    """
    if k.dim() < 2:
        raise ValueError(f"k must have shape (..., N, D), got {tuple(k.shape)}")
    if block_n < 1:
        raise ValueError(f"block_n must be positive, got {block_n}")
    k64 = k.to(torch.float16).to(torch.float64)
    out = torch.empty(k.shape, dtype=torch.float16, device=k.device)
    N = k.shape[-2]
    for j0 in range(0, N, block_n):
        kb = k64[..., j0:j0 + block_n, :]
        diag, off = shift_coefficients(kb.shape[-2], beta)
        colsum = kb.sum(-2, keepdim=True)
        out[..., j0:j0 + block_n, :] = ((diag - off) * kb + off * colsum).mul_(scale).to(torch.float16)
    return out


def fp16_matmul(a: torch.Tensor, b: torch.Tensor, chunk: int = FP16_CHUNK) -> torch.Tensor:
    """``a @ b`` as an FP16 GEMM with FP16 accumulation computes it, overflow to ±inf included.

    Emulation: the products of fp16 numbers are exact in float64, and so (barring exponent spreads
    beyond ~30 bits) is their sum over one k-chunk of ``chunk`` terms; the running accumulator
    is fp16 and is rounded once per chunk: ``acc = fl16(acc + Σ_chunk a·b)``. That is a tensor
    core MMA (k = 16 for fp16) accumulating into an fp16 register: one rounding per instruction,
    so a partial sum that leaves the fp16 range (|x| ≥ 65520 rounds to inf) becomes ±inf there
    and stays inf, exactly where the hardware's accumulator overflows — also when the final sum
    would be back in range. Rounding the fp32 result once would miss those intermediate
    overflows and under-state the accumulation error by the factor D/16. Because every chunk sum
    is exact, the result does not depend on the summation order of the underlying matmul:
    recomputing one element gives the same bits as the batched product.

    Args:
        a: (..., M, K) float16.
        b: (..., K, N) float16 (broadcast batch dims like `torch.matmul`).
        chunk: k-depth per accumulator rounding.
    Returns:
        (..., M, N) float16.
    """
    if a.dtype != torch.float16 or b.dtype != torch.float16:
        raise TypeError(f"fp16_matmul takes float16 operands, got {a.dtype} and {b.dtype}")
    if a.dim() < 2 or b.dim() < 2 or a.shape[-1] != b.shape[-2]:
        raise ValueError(f"shapes {tuple(a.shape)} @ {tuple(b.shape)} do not chain")
    if chunk < 1:
        raise ValueError(f"chunk must be positive, got {chunk}")
    K = a.shape[-1]
    a64 = a.to(torch.float64)
    b64 = b.to(torch.float64)
    acc = None
    for c0 in range(0, K, chunk):
        part = torch.matmul(a64[..., c0:c0 + chunk], b64[..., c0:c0 + chunk, :])
        acc = part.to(torch.float16) if acc is None else (acc.to(torch.float64) + part).to(torch.float16)
    if acc is None:  # K == 0
        acc = torch.zeros(torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1]),
                          dtype=torch.float16, device=a.device)
    return acc


def block_pseudo_average(q: torch.Tensor, kshift: torch.Tensor, block_n: int) -> torch.Tensor:
    """Row means of every key block's shifted scores, ``S̄'_j = q·mean_n(K'_n)``, in fp32.

    This is Algorithm 1's ``rowmean(S'_j)`` (line 13) computed from the keys instead of from the
    fp16 scores: one fp32 dot product per row and block against the block's mean shifted key
    (in PASA+EFTA it is the sum of the checksum columns, ``Σ_r Sc1[i, r] / w``). The recovery
    multiplies the pseudo-average by γ = β/(1 − β) (63.5 at β = 0.9845), so the mean of the
    fp16-rounded, fp16-accumulated scores carries γ times their averaged rounding error into the
    block's offset; the dot with the mean key has none of it (``docs/pasa.md`` measures both).

    Args:
        q: (..., M, D) queries in the dtype the score GEMM takes (fp16 values; held in any float).
        kshift: (..., N, D) shifted keys from `shift_keys` (same leading dims as q, or broadcastable).
        block_n: keys per block.
    Returns:
        (..., M, nblocks) float32, block j averaged over its real keys (the last may be short).
    """
    N = kshift.shape[-2]
    nb = -(-N // block_n)
    k32 = kshift.to(torch.float32)
    sums = torch.stack([k32[..., j0:j0 + block_n, :].sum(-2) for j0 in range(0, N, block_n)], dim=-2)
    widths = torch.tensor([min(block_n, N - j * block_n) for j in range(nb)], dtype=torch.float32,
                          device=q.device)
    return torch.matmul(q.to(torch.float32), sums.transpose(-1, -2)) / widths


def pseudo_average_update(f_prev: torch.Tensor | None, sbar: torch.Tensor, j: int) -> torch.Tensor:
    """Global pseudo-average after key block j (0-based): ``F̄_j = (j·F̄_{j−1} + S̄'_j)/(j + 1)``.

    Algorithm 1 line 14 (with 1-based j there). ``sbar`` (…, 1) is the row mean of block j's
    shifted scores over its real keys; ``f_prev`` the same shape (ignored, may be None, for j = 0).
    """
    if j == 0 or f_prev is None:
        return sbar.clone()
    return (f_prev * j + sbar) / (j + 1)


def frame_corrections(f_prev: torch.Tensor | None, f_new: torch.Tensor, sbar: torch.Tensor, gamma: float,
                      gamma_block: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The maximum corrections of Algorithm 1 line 15: ``(Δm'_{j−1}, Δm'_j)``.

    Frame of block j: scores ``S − γ·F̄_j`` (γ = `recovery_factor` of a full block, which is
    β/(1 − β) at the optimal β); block j's shifted scores enter it as ``S' + Δm'_j`` with
    ``Δm'_j = γ·(S̄'_j − F̄_j) + (γ_j − γ)·S̄'_j`` (γ_j: the block's own factor; the second
    term is 0 except for a short last block), and state kept in the previous frame moves by
    ``Δm'_{j−1} = γ·(F̄_{j−1} − F̄_j)``.

    Args:
        f_prev: (…, 1) F̄_{j−1}, or None for the first block (then Δm'_{j−1} = 0: no state yet).
        f_new: (…, 1) F̄_j from `pseudo_average_update`.
        sbar: (…, 1) S̄'_j, the block's pseudo-average (`block_pseudo_average`).
        gamma: γ of a full block; gamma_block: γ_j of this block (None: a full block).
    Returns:
        ``(Δm'_{j−1}, Δm'_j)``, both (…, 1).
    """
    dcur = (sbar - f_new) * gamma
    if gamma_block is not None and gamma_block != gamma:
        dcur = dcur + sbar * (gamma_block - gamma)
    dprev = torch.zeros_like(f_new) if f_prev is None else (f_prev - f_new) * gamma
    return dprev, dcur
