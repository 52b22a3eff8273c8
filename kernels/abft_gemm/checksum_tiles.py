"""The group checksums as extra output tiles of the GEMM's own launch (`checksum_tile`).

The verification compares each (row, 64-column group) sum of y with ``C[m, g] = x[m]·w1_g``
(`groups._group_verify_kernel`). Computed in the verification's own launch, that product re-reads x with a K loop
of its own, latency-bound and serial after the GEMM: 10-25 µs at M = 4096 and K = 896-4864 on an H100, up to a
quarter of the call. Here it is part of the GEMM instead: the checksum operand ``Wc`` (S, T_g, K) in x's dtype
(`calls.group_operand`: w1_g in S slices whose sum keeps its fp32 accuracy) is read as a weight of S·T_g rows,
and a few more programs of the same grid compute ``x · Wcᵀ`` beside y's tiles, each a tile of checksum columns
over a share of K (`checksum_split`). Each leaves its fp32 partial dots in ``C`` (splits, M, S·T_g), and the
first tile of a row block also x's partial row statistics that the threshold needs (sum, max, min and, with
XVAR, the sum of squares) in ``Stats`` (splits, M, 4). The verification then reads only those numbers:
no K loop, no second pass over x.

The dots are the verification's own (every product of x and a slice exact in fp32, fp32 sums), so the
threshold's unit error holds for them. The statistics reduce a plain load of x's tile, never the dot's
pipelined operand (`groups._row_stats_and_checksums` says why).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..tl_common import dot as _mma
from .common import row_stats_add, row_stats_init

# The slices of x's dtype that hold w1_g in fp32 accuracy (`calls.group_operand`): the checksum operand's rows are
# S·T_g, S by dtype (fp32 calls: one slice, multiplied in IEEE FMAs)
CHECKSUM_SLICES = {torch.float16: 2, torch.bfloat16: 3, torch.float32: 1}
# A checksum tile's K loop is as long as a tile of y's and carries x's statistics besides its dots: whole, such
# tiles spilled into a wave of their own (2048³ fp16 on an H200: 91.9 µs against 50.5 with the verification's
# loop). So each runs as up to CHECKSUM_SPLIT programs of at least CHECKSUM_MIN_BLOCKS K blocks, their partial
# sums summed by the verification in split order; never more partials than CHECKSUM_PART_BYTES. (Splits of 2
# blocks made the calls of K = 896 at M = 4096 3-9 µs slower than whole tiles: 224 programs of little work.)
CHECKSUM_SPLIT = 8
CHECKSUM_MIN_BLOCKS = 8
CHECKSUM_PART_BYTES = 32 << 20


@triton.jit
def checksum_tile(X, Wc, C, Stats, pid_m, pid_c, split, kb_per, M, K, NC, sxm, sxk,
                  BLOCK_M: tl.constexpr, CN: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                  DOT_F32: tl.constexpr, XVAR: tl.constexpr):
    """Split ``split``'s share (K blocks ``[split·kb_per, (split+1)·kb_per)``) of columns ``[pid_c·CN,
    (pid_c+1)·CN)`` of x (M, K) · Wc (NC, K)ᵀ for row block ``pid_m`` (NC = S·T_g: slice s of group g is column
    s·T_g + g), fp32, stored unrounded in ``C`` (splits, M, NC); with ``pid_c == 0`` also the block's rows'
    statistics of x over those K blocks into ``Stats`` (splits, M, 4): sum, max, min, sum of squares (XVAR;
    else not written). Operands through pointers (x's strides ``sxm``, ``sxk``; Wc contiguous)."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    offs_am = offs_m % M  # wrapped rows: in-bounds loads, never stored
    offs_c = pid_c * CN + tl.arange(0, CN)
    c_ok = offs_c < NC
    offs_bc = offs_c % NC
    offs_k = tl.arange(0, BLOCK_K)
    kb0 = split * kb_per
    kb1 = tl.minimum(kb0 + kb_per, tl.cdiv(K, BLOCK_K))
    a_ptrs = X + offs_am[:, None] * sxm + (kb0 * BLOCK_K + offs_k)[None, :] * sxk
    b_ptrs = Wc + offs_bc[None, :] * K + (kb0 * BLOCK_K + offs_k)[:, None]
    acc = tl.zeros((BLOCK_M, CN), tl.float32)
    sm, sq, mx, mn = row_stats_init(BLOCK_M)
    # the statistics' plain load runs one K block ahead (the software pipeline stages only the dots' operands:
    # a plain load's latency would otherwise stall every step)
    k_ok = offs_k < K - kb0 * BLOCK_K
    # (tl.where: the interpreter mis-types a bool tensor & a scalar)
    xn = tl.load(a_ptrs, mask=tl.where(kb0 < kb1, k_ok, False)[None, :], other=0.0, cache_modifier=".cg")
    for kb in range(kb0, kb1):
        xf = xn.to(tl.float32)
        k_ok = offs_k < K - kb * BLOCK_K
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        k_next = tl.where(kb + 1 < kb1, offs_k < K - (kb + 1) * BLOCK_K, False)
        xn = tl.load(a_ptrs + BLOCK_K * sxk, mask=k_next[None, :], other=0.0, cache_modifier=".cg")
        acc = _mma(a, b, acc, DOT_F32)
        sm, sq, mx, mn = row_stats_add(sm, sq, mx, mn, xf, k_ok, XVAR)
        a_ptrs += BLOCK_K * sxk
        b_ptrs += BLOCK_K
    cp = C + split * M * NC + offs_m[:, None] * NC + offs_c[None, :]
    tl.store(cp, acc, mask=m_ok[:, None] & c_ok[None, :])
    if pid_c == 0:
        sp = Stats + (split * M + offs_m) * 4
        tl.store(sp, sm, mask=m_ok)
        tl.store(sp + 1, mx, mask=m_ok)
        tl.store(sp + 2, mn, mask=m_ok)
        if XVAR:
            tl.store(sp + 3, sq, mask=m_ok)


@triton.jit
def checksum_program(ct, num_c, n_csplit):
    """(row block, checksum tile, split) of checksum program ``ct``: the splits of one tile adjacent."""
    return ct // (num_c * n_csplit), (ct // n_csplit) % num_c, ct % n_csplit


def checksum_cols(nc: int, block_n: int) -> int:
    """CN, the width of a checksum tile for NC = S·T_g checksum columns and the GEMM's BLOCK_N: NC rounded up
    to a power of two, between 16 (the smallest tensor-core dot) and BLOCK_N."""
    return min(block_n, max(16, triton.next_power_of_2(nc)))


def checksum_split(m: int, k: int, nc: int, block_k: int) -> tuple[int, int]:
    """(splits, kb_per): the K blocks of a checksum tile over up to CHECKSUM_SPLIT programs of at least
    CHECKSUM_MIN_BLOCKS blocks each (none empty), no more splits than keep the partials (splits, M, NC + 4)
    within CHECKSUM_PART_BYTES."""
    nkb = -(-k // block_k)
    most = max(1, min(CHECKSUM_SPLIT, CHECKSUM_PART_BYTES // max(1, 4 * m * (nc + 4))))
    per = max(CHECKSUM_MIN_BLOCKS, -(-nkb // most))
    return -(-nkb // per), per
