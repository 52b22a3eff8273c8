"""The cuBLAS form's own kernels: its checksums, computed beside cuBLAS's product, and its check after it.

The form's product ``y32 = x·Wᵀ`` (M, N) is cuBLAS's, fp16/bf16 operands, fp32 accumulation and fp32 output
(`calls.fp32_product`). Around it, on the GPU:

1. ``_checksum_kernel`` runs on a side stream *while* cuBLAS runs (`calls._product_launch` forks and joins the
   streams; a CUDA graph captures the fork as two branches): the checksum dots ``x·Wcᵀ`` of the group checksums'
   S slices (`calls.group_operand`: ``w1_g`` in slices of x's dtype whose sum keeps its fp32 accuracy, every
   product exact in fp32) and x's row statistics for the threshold (sum, max, min and, with XVAR, the sum of
   squares), as the tile GEMM's checksum programs compute them (`checksum_tiles.checksum_tile`): fp32 partials
   per K split. A short prompt's product leaves most SMs idle; these programs take some of them, so the K loop
   the verification once ran after the product (`groups._row_stats_and_checksums`) is off the critical path.
2. ``_product_check_kernel``, after both: each program reads one (BLOCK_R, BLOCK_G·64) tile of y32 once, adds
   the bias in fp32, rounds it to y's dtype with the flips at ``linear.output`` applied to the rounded value as
   the tile GEMM's epilogue applies them, stores y, sums its 64-column groups in registers, sums the partials
   in split order, and checks every (row, group) unit against SPEC §5's group threshold with the accumulator
   e_max (`groups._check_block`, which also counts and repairs). No x read, no K loop, no atomic on a clean call.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .checksum_tiles import checksum_program, checksum_tile
from .common import _NONF, _SITE_ROW, round_and_inject
from .groups import _check_block, _fused_stats_and_checksums

G: tl.constexpr = tl.constexpr(64)  # = gemm_checksums.GROUP_COLS


@triton.jit
def _checksum_kernel(X, Wc, P, M, K, NC, c_off, sxm, sxk, c_split, c_kb_per, BLOCK_M: tl.constexpr,
                     CN: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, DOT_F32: tl.constexpr,
                     XVAR: tl.constexpr):
    """x (M, K) · Wc (NC, K)ᵀ and x's row statistics as ``c_split`` partials over ``c_kb_per`` K blocks each,
    into ``P`` at ``c_off``: C (c_split, M, NC) then the statistics (c_split, M, 4) (`checksum_tiles.checksum_tile`;
    one program per (row block, checksum tile, split), the splits of a tile adjacent)."""
    num_c = tl.cdiv(NC, CN)
    cm, cc, cs = checksum_program(tl.program_id(0), num_c, c_split)
    Cb = P + c_off
    checksum_tile(X, Wc, Cb, Cb + c_split * M * NC, cm, cc, cs, c_kb_per, M, K, NC, sxm, sxk, BLOCK_M, CN, BLOCK_K,
                  EVEN_K, DOT_F32, XVAR)


@triton.jit(do_not_specialize=["call_id", "w_finite"])
def _product_check_kernel(X, W, Y, Bias, Winv, Gc, P, Inj, Flag, Cnt, Dbg,
                          M, N, K, TG, c_off, c_split, sxm, sxk, swn, swk, sym, syn, scn0, scn1, inv_k, call_id,
                          w_finite, emax, csigma,
                          BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr, REPAIR_K: tl.constexpr,
                          SLICES: tl.constexpr, HAS_BIAS: tl.constexpr, CORRECT: tl.constexpr, DEBUG: tl.constexpr,
                          DOT_F32: tl.constexpr, INJ: tl.constexpr, VERIFY_OUTPUT: tl.constexpr, XVAR: tl.constexpr):
    """y (M, N) from the product in ``P`` and the check of block (BLOCK_R rows) × (BLOCK_G groups), one block per
    program.

    ``P``: fp32, y32 (M, N) at 0, `_checksum_kernel`'s partials at ``c_off`` (C (c_split, M, S·T_g): slice s of
    group g in column s·T_g + g; then the statistics (c_split, M, 4)). x (M, K) and W (N, K) through strides
    ``swn``, ``swk`` are read only to repair a failing unit (recomputed over ``REPAIR_K``-wide K blocks); ``Winv``
    (1,) the slices' inverse scale; ``Gc`` (T_g, 8) the groups' constants (`gemm_checksums.group_checksums`);
    ``Inj`` the flips at ``linear.output``, bucketed per BLOCK_R rows (INJ); ``Flag`` the call's flag cell
    (`tl_common.call_flag`); ``Cnt`` the (sites, kinds) int32 counters. VERIFY_OUTPUT: the groups' sums of the
    rounded outputs, else of the accumulators (flipped where a flip landed). DEBUG: (D, C, T) of every unit into
    ``Dbg`` (M, T_g, 3). XVAR: x's outlier variance estimate in the threshold, else SPEC §5's bound."""
    pid = tl.program_id(0)
    n_gb = tl.cdiv(TG, BLOCK_G)
    pid_r = pid // n_gb
    pid_g = pid % n_gb
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = rows < M
    grps = pid_g * BLOCK_G + tl.arange(0, BLOCK_G)
    g_ok = grps < TG
    cols = pid_g * BLOCK_G * G + tl.arange(0, BLOCK_G * G)
    c_ok = cols < N
    ym = r_ok[:, None] & c_ok[None, :]
    acc = tl.load(P + rows[:, None] * N + cols[None, :], mask=ym, other=0.0)
    if HAS_BIAS:
        acc += tl.load(Bias + cols, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    yv, v = round_and_inject(acc, Y.dtype.element_ty, Inj, pid_r, tl.cdiv(M, BLOCK_R), rows, cols, c_ok, INJ,
                             VERIFY_OUTPUT)
    tl.store(Y + rows[:, None] * sym + cols[None, :] * syn, yv, mask=ym)
    if w_finite == 0:  # a non-finite weight or bias: the call's checks are off, counted once
        if pid == 0:
            tl.atomic_add(Cnt + _SITE_ROW * scn0 + _NONF * scn1, 1)
    else:
        s = tl.sum(tl.reshape(v, (BLOCK_R, BLOCK_G, G)), axis=2)
        sm, sq, mx, mn, c = _fused_stats_and_checksums(P + c_off, rows, r_ok, grps, g_ok, M, TG, c_split, SLICES,
                                                       XVAR)
        tl.debug_barrier()  # y stored by every thread before a repair reads it back
        _check_block(X, W, Y, Bias, Winv, Gc, Flag, Cnt, Dbg, rows, r_ok, grps, g_ok, pid_g, s, sm, sq, mx, mn, c,
                     M, N, K, TG, sxm, sxk, swn, swk, sym, syn, scn0, scn1, inv_k, call_id, emax, csigma, REPAIR_K,
                     HAS_BIAS, CORRECT, DEBUG, DOT_F32, XVAR)
