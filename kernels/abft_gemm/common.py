"""Device helpers that the checked GEMM's kernels share: the counter slots, injection of flips at
``linear.output``, a program's K blocks under split-K, and the grouped tile order."""

from __future__ import annotations

import triton
import triton.language as tl

from ..contract import KIND_INDEX, SITE_INDEX

SITE = "linear.output"

_SITE_ROW = tl.constexpr(SITE_INDEX[SITE])
_DET, _COR, _REC, _UNC, _NONF = (tl.constexpr(KIND_INDEX[k]) for k in
                                 ("detected", "corrected", "recomputed", "uncorrectable", "nonfinite_input"))


@triton.jit
def round_and_inject(acc, dtype: tl.constexpr, Inj, pid_m, num_pid_m, offs_m, offs_n, n_ok, INJ: tl.constexpr,
                     VERIFY_OUTPUT: tl.constexpr):
    """A tile's fp32 sum ``acc`` (BLOCK_M, BLOCK_N), bias included, rounded to ``dtype`` with the flips
    of `_inject_output` (INJ); returns it and the fp32 values the checks sum (``v``: the rounded
    outputs with VERIFY_OUTPUT, else the accumulators, flipped where a flip landed; 0 past N)."""
    yv = acc.to(dtype)
    if INJ:
        yv, hit = _inject_output(yv, Inj, pid_m, num_pid_m, offs_m, offs_n)
    if VERIFY_OUTPUT:
        v = yv.to(tl.float32)
    elif INJ:
        v = tl.where(hit, yv.to(tl.float32), acc)
    else:
        v = acc
    return yv, tl.where(n_ok[None, :], v, 0.0)


@triton.jit
def x_variance(mu, sq, mx, mn, K, inv_k, XVAR: tl.constexpr):
    """x's row variance estimate in the group threshold from each row's mean ``mu``, sum of squares ``sq``
    (read with XVAR only), max ``mx`` and min ``mn`` (any one shape; fp32): SPEC §5's Bhatia–Davis bound
    ``(max − μ)(μ − min)``, or with XVAR the outlier estimate, in `gemm_checksums.xvar_estimate`'s order of
    operations (``inv_k`` = fl(1/K); the guard `gemm_checksums.xvar_guard`; the bound where the estimate
    is larger or not a number)."""
    bound = tl.maximum((mx - mu) * (mu - mn), 0.0)
    if XVAR:
        m2 = sq * inv_k
        dev = tl.maximum(mx - mu, mu - mn)
        est = (tl.maximum(m2 - mu * mu, 0.0) + ((4.0 * K + 16.0) * 5.9604644775390625e-08) * m2
               + dev * dev * tl.sqrt(inv_k))
        return tl.where(est < bound, est, bound)
    return bound


@triton.jit
def k_blocks(split, kb_per, K, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr):
    """The K blocks ``[kb0, kb1)`` of a program: split ``split`` of ``kb_per`` blocks each with SPLIT, else all."""
    if SPLIT:
        kb0 = split * kb_per
        kb1 = tl.minimum(kb0 + kb_per, tl.cdiv(K, BLOCK_K))
    else:
        kb0 = 0
        kb1 = tl.cdiv(K, BLOCK_K)
    return kb0, kb1


@triton.jit
def _inject_output(yv, Inj, pid_m, num_pid_m, offs_m, offs_n):
    """Flips of site ``linear.output`` on the rounded tile ``yv`` (BLOCK_M, BLOCK_N): the (row, col,
    bit) triples of row block ``pid_m`` (``Inj``: CSR over the row blocks, then the triples).
    Returns the flipped tile and the (BLOCK_M, BLOCK_N) mask of flipped elements."""
    p0 = tl.load(Inj + pid_m)
    p1 = tl.load(Inj + pid_m + 1)
    xm = tl.zeros(yv.shape, tl.int32)
    for p in range(p0, p1):
        r = tl.load(Inj + num_pid_m + 1 + 3 * p)
        c = tl.load(Inj + num_pid_m + 2 + 3 * p)
        bit = tl.load(Inj + num_pid_m + 3 + 3 * p)
        xm = xm ^ tl.where((offs_m[:, None] == r) & (offs_n[None, :] == c), 1 << bit, 0)
    hit = xm != 0
    if yv.dtype == tl.float32:
        yf = (yv.to(tl.int32, bitcast=True) ^ xm).to(tl.float32, bitcast=True)
    else:
        yf = (yv.to(tl.int16, bitcast=True) ^ xm.to(tl.int16)).to(yv.dtype, bitcast=True)
    return tl.where(hit, yf, yv), hit



@triton.jit
def _grouped_tile(tile, num_pid_m, num_pid_n, GROUP: tl.constexpr):
    """(pid_m, pid_n) of output tile ``tile`` in grouped order: GROUP row blocks walk the column tiles
    together, so a W tile is read from L2 by the GROUP programs that need it."""
    in_group = GROUP * num_pid_n
    first_m = (tile // in_group) * GROUP
    gsize = tl.minimum(num_pid_m - first_m, GROUP)
    return first_m + ((tile % in_group) % gsize), (tile % in_group) // gsize


@triton.jit
def row_stats_init(R: tl.constexpr):
    """x's row statistics before any K block, (R,) fp32 each: sum 0, sum of squares 0, max −inf, min +inf."""
    return (tl.zeros((R,), tl.float32), tl.zeros((R,), tl.float32), tl.full((R,), -float("inf"), tl.float32),
            tl.full((R,), float("inf"), tl.float32))


@triton.jit
def row_stats_add(sm, sq, mx, mn, xf, k_ok, XVAR: tl.constexpr):
    """x's row statistics (`row_stats_init`) with one K block ``xf`` (R, BLOCK_K) fp32 (0 past K) reduced in:
    sum, sum of squares (XVAR; else left as is), and max / min over the columns ``k_ok`` (BLOCK_K,) marks."""
    sm += tl.sum(xf, axis=1)
    if XVAR:
        sq += tl.sum(xf * xf, axis=1)
    mx = tl.maximum(mx, tl.max(tl.where(k_ok[None, :], xf, -float("inf")), axis=1))
    mn = tl.minimum(mn, tl.min(tl.where(k_ok[None, :], xf, float("inf")), axis=1))
    return sm, sq, mx, mn
