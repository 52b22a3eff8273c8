"""The verification of the tile and persistent forms: every (row, 64-column group) of y checked on its own, in a
launch after the GEMM (`_group_verify_kernel`); its block check (`_check_block`) serves the cuBLAS form too.

The GEMM's epilogue leaves, per row m and group g of ``GROUP_COLS`` output columns, the fp32 sum
``Σ_{n∈g} v[m, n]`` (v the fp32 accumulators with the bias, or the rounded outputs in ``output`` mode,
flips at ``linear.output`` included) in ``P`` (T_g, M). This launch compares it with the group's
checksum ``C[m, g] = x[m]·w1_g + b1_g`` (``w1_g = Σ_{n∈g} W[n, :]``, `group_checksums`) against the
threshold of SPEC §5 over the group's n_g columns: a threshold of 64 columns, where one checksum over a
whole row let the rounding noise of a 49k–152k-wide lm_head hide a change of several logits.

``C`` is a GEMM of 1/64 of the layer's: ``x (M, K) · w1gᵀ (K, T_g)`` on the tensor cores, with ``w1g``
held in fp32 accuracy as S slices of x's dtype (`calls.group_operand`: 2 for fp16, 3 for bf16, 1 for
fp32 in IEEE FMAs), every product of x and a slice exact in fp32. x's row sum, max and min
for the threshold come from a plain load of the same x tile in that loop (with XVAR, x's outlier variance
estimate, its sum of squares too: `gemm_checksums.xvar_estimate`; `_row_stats_and_checksums` says why not the
dots' operand), so the GEMM's K loop carries no checksum work.

The cuBLAS form checks in a launch of its own (`product_check`), with `_check_block` from here.

A failing unit (rare) is recomputed in fp32 (its 64 columns for the program's rows, one dot over K);
the differences from the stored y locate a single error as the weighted checksum would
(``t = G·Σ_j ((j+1)/G)·d_j / Σ_j d_j`` within 0.25 of an integer). It is replaced when the rest of the
group agrees with the recomputation element by element, within an ulp and the two fp32 sums' bound
→ ``corrected``; otherwise the group takes the recomputed values →
``recomputed``. Without correction: ``detected`` + ``uncorrectable``. No capacity: a unit's recompute is
64 columns.

Rows whose x holds a NaN or ±inf are not verified (their checksum means nothing); the call counts one
``nonfinite_input`` for them (the first program to see one, through the call's flag cell), or for a
non-finite W or b, which switches the call's checks off.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..tl_common import dot as _mma
from .common import (
    _COR,
    _DET,
    _NONF,
    _REC,
    _SITE_ROW,
    _UNC,
    k_blocks,
    row_stats_add,
    row_stats_init,
    x_variance,
)

G: tl.constexpr = tl.constexpr(64)  # = gemm_checksums.GROUP_COLS


@triton.jit
def _row_stats_and_checksums(X, Wc, rows, r_ok, grps, g_ok, kb0, kb1, K, TG, sxm, sxk, BLOCK_K: tl.constexpr,
                             SLICES: tl.constexpr, DOT_F32: tl.constexpr, XVAR: tl.constexpr):
    """x's row sum, sum of squares (XVAR; else 0), max and min (BLOCK_R,) and the checksum dots
    (BLOCK_R, BLOCK_G) of ``Wc``'s S slices (S, T_g, K) summed, over the K blocks ``[kb0, kb1)``.

    One loop; the statistics reduce a plain load of x's tile (``.cg``: a global load beside the dots'
    asynchronous copies, served by L2 which the copy just filled), never the dots' pipelined operand: reduced
    from that operand, Triton 3.6's sm_90 code computed a wrong checksum in 0.02-0.6 % of the (row, group)
    units of calls with more than one row block and no split-K, a different set at each run (H100, fp16,
    Qwen2-0.5B's lm_head: up to 0.3 of the threshold against the 0.015 of the same dots alone). The decode
    kernel reads its statistics from loads of their own too."""
    BLOCK_R: tl.constexpr = rows.shape[0]
    BLOCK_G: tl.constexpr = grps.shape[0]
    offs_k = tl.arange(0, BLOCK_K)
    c0 = tl.zeros((BLOCK_R, BLOCK_G), tl.float32)
    c1 = tl.zeros((BLOCK_R, BLOCK_G), tl.float32)
    c2 = tl.zeros((BLOCK_R, BLOCK_G), tl.float32)
    # sum, max, min: reduced per K block for tensor-core dtypes (element-wise accumulators would hold
    # register tiles as large as x's); element-wise for fp32, whose per-block reductions Triton 3.6 fails to
    # lower here (TritonGPUOptimizeThreadLocality)
    sm, sq, mx, mn = row_stats_init(BLOCK_R)
    sme = tl.zeros((BLOCK_R, BLOCK_K if DOT_F32 else 1), tl.float32)
    sqe = tl.zeros((BLOCK_R, BLOCK_K if DOT_F32 and XVAR else 1), tl.float32)
    mxe = tl.full((BLOCK_R, BLOCK_K if DOT_F32 else 1), -float("inf"), tl.float32)
    mne = tl.full((BLOCK_R, BLOCK_K if DOT_F32 else 1), float("inf"), tl.float32)
    for kb in range(kb0, kb1):
        kk = kb * BLOCK_K + offs_k
        k_ok = kk < K
        xp = X + rows[:, None] * sxm + kk[None, :] * sxk
        xm = r_ok[:, None] & k_ok[None, :]
        xa = tl.load(xp, mask=xm, other=0.0)
        wp = Wc + grps[None, :] * K + kk[:, None]
        wm = k_ok[:, None] & g_ok[None, :]
        c0 = _mma(xa, tl.load(wp, mask=wm, other=0.0), c0, DOT_F32)
        if SLICES > 1:
            c1 = _mma(xa, tl.load(wp + TG * K, mask=wm, other=0.0), c1, DOT_F32)
        if SLICES > 2:
            c2 = _mma(xa, tl.load(wp + 2 * TG * K, mask=wm, other=0.0), c2, DOT_F32)
        xf = tl.load(xp, mask=xm, other=0.0, cache_modifier=".cg").to(tl.float32)  # (0 past K: masked for max / min)
        if DOT_F32:
            sme += xf
            if XVAR:
                sqe += xf * xf
            mxe = tl.maximum(mxe, tl.where(k_ok[None, :], xf, -float("inf")))
            mne = tl.minimum(mne, tl.where(k_ok[None, :], xf, float("inf")))
        else:
            sm, sq, mx, mn = row_stats_add(sm, sq, mx, mn, xf, k_ok, XVAR)
    if DOT_F32:
        sm = tl.sum(sme, axis=1)
        if XVAR:
            sq = tl.sum(sqe, axis=1)
        mx = tl.max(mxe, axis=1)
        mn = tl.min(mne, axis=1)
    # the slices' partial dots summed smallest first
    return sm, sq, mx, mn, c0 + (c1 + c2)


@triton.jit
def _fused_stats_and_checksums(C, rows, r_ok, grps, g_ok, M, TG, n_csplit, SLICES: tl.constexpr,
                               XVAR: tl.constexpr):
    """`_row_stats_and_checksums`' results from the partials the GEMM's checksum programs left
    (`checksum_tiles`), summed in split order: ``C`` (n_csplit, M, S·T_g) the slices' dots (slice s of group g in
    column s·T_g + g), then x's statistics (n_csplit, M, 4): sum, max, min, sum of squares (read with XVAR only;
    else 0). The slices summed as there, smallest first."""
    BLOCK_R: tl.constexpr = rows.shape[0]
    BLOCK_G: tl.constexpr = grps.shape[0]
    nc = SLICES * TG
    m2 = r_ok[:, None] & g_ok[None, :]
    c0 = tl.zeros((BLOCK_R, BLOCK_G), tl.float32)
    c1 = tl.zeros((BLOCK_R, BLOCK_G), tl.float32)
    c2 = tl.zeros((BLOCK_R, BLOCK_G), tl.float32)
    sm, sq, mx, mn = row_stats_init(BLOCK_R)
    for s in range(0, n_csplit):
        cp = C + s * M * nc + rows[:, None] * nc + grps[None, :]
        c0 += tl.load(cp, mask=m2, other=0.0)
        if SLICES > 1:
            c1 += tl.load(cp + TG, mask=m2, other=0.0)
        if SLICES > 2:
            c2 += tl.load(cp + 2 * TG, mask=m2, other=0.0)
        sp = C + n_csplit * M * nc + (s * M + rows) * 4
        sm += tl.load(sp, mask=r_ok, other=0.0)
        mx = tl.maximum(mx, tl.load(sp + 1, mask=r_ok, other=0.0))
        mn = tl.minimum(mn, tl.load(sp + 2, mask=r_ok, other=0.0))
        if XVAR:
            sq += tl.load(sp + 3, mask=r_ok, other=0.0)
    return sm, sq, mx, mn, c0 + (c1 + c2)


@triton.jit
def _group_sums(P, rows, r_ok, grps, g_ok, M):
    """The GEMM's group sums of block (rows, grps) from ``P`` (T_g, M): (BLOCK_R, BLOCK_G) fp32."""
    # (.cg: past L1, which is not coherent where another program of the launch stored them: split-K)
    return tl.load(P + grps[None, :] * M + rows[:, None], mask=r_ok[:, None] & g_ok[None, :], other=0.0,
                   cache_modifier=".cg")


@triton.jit
def _repair_group(X, W, Y, Bias, rows, r_ok, bad, gidx, N, K, sxm, sxk, swn, swk, sym, syn,
                  BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_F32: tl.constexpr):
    """Group ``gidx``'s failing rows ``bad`` (BLOCK_R,): recompute its columns, locate, replace. Returns
    (corrected, recomputed) counts."""
    BLOCK_R: tl.constexpr = rows.shape[0]
    offs_j = tl.arange(0, G)
    cols = gidx * G + offs_j
    c_ok = cols < N
    ccols = tl.where(c_ok, cols, 0)
    offs_k = tl.arange(0, BLOCK_K)
    ref = tl.zeros((BLOCK_R, G), tl.float32)
    rabs = tl.zeros((BLOCK_R, G), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < K
        a = tl.load(X + rows[:, None] * sxm + kk[None, :] * sxk, mask=bad[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(W + kk[:, None] * swk + ccols[None, :] * swn, mask=k_ok[:, None] & c_ok[None, :], other=0.0)
        ref = _mma(a, b, ref, DOT_F32)
        rabs = _mma(tl.abs(a), tl.abs(b), rabs, DOT_F32)
    if HAS_BIAS:
        ref += tl.load(Bias + ccols, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    ym = bad[:, None] & c_ok[None, :]
    yp = Y + rows[:, None] * sym + ccols[None, :] * syn
    yv = tl.load(yp, mask=ym, other=0.0, cache_modifier=".cg")  # (.cg: as the group sums, `_check_block`)
    if Y.dtype.element_ty == tl.float16:
        u_y: tl.constexpr = 2.0**-11
    elif Y.dtype.element_ty == tl.bfloat16:
        u_y: tl.constexpr = 2.0**-8
    else:
        u_y: tl.constexpr = 2.0**-24
    # against the recomputation rounded like y: a clean element then differs by nothing (or an ulp where
    # the two fp32 sums round apart), so y's own rounding does not blur the location
    d = tl.where(ym, yv.to(tl.float32) - ref.to(Y.dtype.element_ty).to(tl.float32), 0.0)
    colw = (offs_j + 1).to(tl.float32)
    den = tl.sum(d, axis=1)
    tq = tl.sum(d * (colw * (1.0 / G))[None, :], axis=1) / tl.where(bad, den, 1.0) * G
    jl = tl.floor(tq + 0.5)
    n_g = tl.minimum(N - gidx * G, G).to(tl.float32)
    loc = bad & (tl.abs(tq) < float("inf")) & (tl.abs(tq - jl) <= 0.25) & (jl >= 1.0) & (jl <= n_g)
    at = loc[:, None] & (colw[None, :] == jl[:, None])
    # every other element of the group as recomputed: within an ulp of its recomputation (the two fp32 sums
    # may round apart) plus the bound of two summation orders of K products. (A bound on their sum instead,
    # an ulp of every element, let a second flip of a small bf16 value pass beside a located large one.)
    slack = 2.0 * u_y * tl.abs(ref) + 2.0 * K * 2.0**-24 * rabs
    stray = ym & ~at & ~(tl.abs(d) <= slack)
    fixed = loc & (tl.max(stray.to(tl.int32), axis=1) == 0)
    need = bad & ~fixed
    newv = ref.to(Y.dtype.element_ty)
    tl.store(yp, newv, mask=ym & (need[:, None] | (at & fixed[:, None])))
    return tl.sum(fixed.to(tl.int32), axis=0), tl.sum(need.to(tl.int32), axis=0)


@triton.jit(do_not_specialize=["call_id", "w_finite"])
def _group_verify_kernel(X, W, Y, Bias, Wc, Winv, Gc, P, Sem, Flag, Cnt, Dbg,
                         M, N, K, TG, sxm, sxk, swn, swk, sym, syn, scn0, scn1, inv_k, call_id, w_finite,
                         emax, csigma, n_split, kb_per, n_csplit,
                         BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr, SLICES: tl.constexpr,
                         HAS_BIAS: tl.constexpr, CORRECT: tl.constexpr, DEBUG: tl.constexpr, DOT_F32: tl.constexpr,
                         SPLIT: tl.constexpr, XVAR: tl.constexpr, FUSED: tl.constexpr):
    """Verify the blocks of (BLOCK_R rows) × (BLOCK_G groups) of y (M, N), one per program (``n_split`` with
    SPLIT).

    x (M, K); W (N, K) through strides ``swn``, ``swk`` (a (K, N) weight has them swapped); ``Wc`` (S, T_g, K)
    the checksum slices in x's dtype and ``Winv`` their fp32 inverse scale (`calls.group_operand`); ``Gc``
    (T_g, 8) the groups' constants (`group_checksums`); ``P`` (T_g, M) the GEMM's group sums (with SPLIT
    followed by the partials); ``Flag`` the call's flag cell (`call_flag`); ``Cnt`` the (sites, kinds) int32
    counters. DEBUG: (D, C, T) of every unit into ``Dbg`` (M, T_g, 3). XVAR: x's outlier variance estimate
    in the thresholds (`gemm_checksums.xvar_estimate`; x's sum of squares beside its sum), else SPEC §5's
    bound.

    FUSED (the tile and persistent forms): the GEMM's launch computed the checksum dots and x's statistics
    (`checksum_tiles`) into ``P`` after the group sums as ``n_csplit`` partials, C (n_csplit, M, S·T_g) then
    (n_csplit, M, 4); this launch sums them (no K loop, no SPLIT).

    SPLIT (calls of few blocks, `forms.verify_split`: a short prompt's 64 rows make one row block): each block
    runs as ``n_split`` programs over ``kb_per`` K blocks each, program ``pid`` being split ``pid % n_split``
    of block ``pid // n_split``. Each of the n_part splits that have K blocks stores its partial checksums
    (n_part, blocks, BLOCK_R, BLOCK_G) and statistics (n_part, blocks, BLOCK_R, NST) after the group sums in
    ``P`` (n_part = n_split; NST = 3: sum, max, min, and 4 with XVAR: the sum of squares after them); every
    split counts on the block's cell ``Sem[block]`` (0 between calls); the last to count resets it, sums the
    partials in split order and checks the block."""
    pid = tl.program_id(0)
    blk = pid // n_split
    split = pid % n_split
    n_gb = tl.cdiv(TG, BLOCK_G)
    pid_r = blk // n_gb
    pid_g = blk % n_gb
    Part = P + TG * M
    if w_finite == 0:  # a non-finite weight or bias: the call's checks are off, counted once
        if pid == 0:
            tl.atomic_add(Cnt + _SITE_ROW * scn0 + _NONF * scn1, 1)
    else:
        rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        r_ok = rows < M
        grps = pid_g * BLOCK_G + tl.arange(0, BLOCK_G)
        g_ok = grps < TG
        if FUSED:
            sm, sq, mx, mn, c = _fused_stats_and_checksums(Part, rows, r_ok, grps, g_ok, M, TG, n_csplit, SLICES,
                                                           XVAR)
        else:
            kb0, kb1 = k_blocks(split, kb_per, K, BLOCK_K, SPLIT)
            sm, sq, mx, mn, c = _row_stats_and_checksums(X, Wc, rows, r_ok, grps, g_ok, kb0, kb1, K, TG, sxm, sxk,
                                                         BLOCK_K, SLICES, DOT_F32, XVAR)
        if SPLIT:
            NST: tl.constexpr = 4 if XVAR else 3  # statistics per row: sum, max, min (, sum of squares)
            n_blk = tl.cdiv(M, BLOCK_R) * n_gb
            n_part = tl.cdiv(tl.cdiv(K, BLOCK_K), kb_per)
            tile = tl.arange(0, BLOCK_R)[:, None] * BLOCK_G + tl.arange(0, BLOCK_G)[None, :]
            cp = Part + blk * BLOCK_R * BLOCK_G + tile  # + split · blocks · BLOCK_R · BLOCK_G
            sp = Part + n_part * n_blk * BLOCK_R * BLOCK_G + (blk * BLOCK_R + tl.arange(0, BLOCK_R)) * NST
            if split < n_part:
                tl.store(cp + split * n_blk * BLOCK_R * BLOCK_G, c)
                tl.store(sp + split * n_blk * BLOCK_R * NST, sm)
                tl.store(sp + split * n_blk * BLOCK_R * NST + 1, mx)
                tl.store(sp + split * n_blk * BLOCK_R * NST + 2, mn)
                if XVAR:
                    tl.store(sp + split * n_blk * BLOCK_R * NST + 3, sq)
            tl.debug_barrier()  # every thread's partials before the count
            if tl.atomic_add(Sem + blk, 1, sem="acq_rel") == n_split - 1:
                tl.store(Sem + blk, 0)  # ready for the next call (every split has counted)
                c = tl.zeros_like(c)
                sm = tl.zeros_like(sm)
                if XVAR:
                    sq = tl.zeros_like(sq)
                for s in range(0, n_part):  # a fixed order: the same sums whichever split came last
                    c += tl.load(cp + s * n_blk * BLOCK_R * BLOCK_G, cache_modifier=".cg")
                    so = sp + s * n_blk * BLOCK_R * NST
                    sm += tl.load(so, cache_modifier=".cg")
                    mx = tl.maximum(mx, tl.load(so + 1, cache_modifier=".cg"))
                    mn = tl.minimum(mn, tl.load(so + 2, cache_modifier=".cg"))
                    if XVAR:
                        sq += tl.load(so + 3, cache_modifier=".cg")
                _check_block(X, W, Y, Bias, Winv, Gc, Flag, Cnt, Dbg, rows, r_ok, grps, g_ok, pid_g,
                             _group_sums(P, rows, r_ok, grps, g_ok, M), sm, sq, mx, mn, c, M, N, K, TG, sxm, sxk,
                             swn, swk, sym, syn, scn0, scn1, inv_k, call_id, emax, csigma, BLOCK_K, HAS_BIAS,
                             CORRECT, DEBUG, DOT_F32, XVAR)
        else:
            _check_block(X, W, Y, Bias, Winv, Gc, Flag, Cnt, Dbg, rows, r_ok, grps, g_ok, pid_g,
                         _group_sums(P, rows, r_ok, grps, g_ok, M), sm, sq, mx, mn, c, M, N, K, TG, sxm, sxk, swn,
                         swk, sym, syn, scn0, scn1, inv_k, call_id, emax, csigma, BLOCK_K, HAS_BIAS, CORRECT, DEBUG,
                         DOT_F32, XVAR)


@triton.jit
def _check_block(X, W, Y, Bias, Winv, Gc, Flag, Cnt, Dbg, rows, r_ok, grps, g_ok, pid_g, s, sm, sq, mx, mn, c,
                 M, N, K, TG, sxm, sxk, swn, swk, sym, syn, scn0, scn1, inv_k, call_id, emax, csigma,
                 BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, CORRECT: tl.constexpr, DEBUG: tl.constexpr,
                 DOT_F32: tl.constexpr, XVAR: tl.constexpr):
    """One block's check from its group sums ``s`` (BLOCK_R, BLOCK_G), its rows' sum ``sm``, sum of squares ``sq``
    (read with XVAR only), max ``mx`` and min ``mn`` (BLOCK_R,) and checksum dots ``c`` (BLOCK_R, BLOCK_G):
    thresholds, comparison, counts, repairs."""
    BLOCK_G: tl.constexpr = grps.shape[0]
    cbase = Cnt + _SITE_ROW * scn0
    gp = Gc + grps * 8
    b1 = tl.load(gp, mask=g_ok, other=0.0)
    det = tl.load(gp + 1, mask=g_ok, other=0.0)
    v2 = tl.load(gp + 2, mask=g_ok, other=0.0)
    v3 = tl.load(gp + 3, mask=g_ok, other=0.0)
    v4 = tl.load(gp + 4, mask=g_ok, other=0.0)
    bdet = tl.load(gp + 5, mask=g_ok, other=0.0)
    bsd = tl.load(gp + 6, mask=g_ok, other=0.0)
    c = c * tl.load(Winv) + b1[None, :]
    # a row whose x is not finite is not verified (NaN makes the sum NaN, ±inf shows in max / min)
    row_fin = (tl.abs(sm) < float("inf")) & (mx < float("inf")) & (mn > -float("inf"))
    if tl.max((r_ok & ~row_fin).to(tl.int32), axis=0) > 0:
        if tl.atomic_xchg(Flag, call_id) != call_id:  # the call's first program to see one counts it
            tl.atomic_add(cbase + _NONF * scn1, 1)
    mu = sm * inv_k
    var = x_variance(mu, sq, mx, mn, K, inv_k, XVAR)
    # T (SPEC §5 over the group's n_g columns; `group_checksums`' constants)
    thr = emax * (det[None, :] * tl.abs(mu)[:, None]
                  + csigma * tl.sqrt((mu * mu)[:, None] * v2[None, :] + var[:, None] * v3[None, :])
                  + csigma * v4[None, :] * tl.sqrt(var)[:, None] + bdet[None, :] + csigma * bsd[None, :])
    d = s - c
    unit_ok = (r_ok & row_fin)[:, None] & g_ok[None, :]
    bad = unit_ok & ~(tl.abs(d) <= thr)
    if DEBUG:
        dp = Dbg + (rows[:, None] * TG + grps[None, :]) * 3
        dm = r_ok[:, None] & g_ok[None, :]
        tl.store(dp, d, mask=dm)
        tl.store(dp + 1, c, mask=dm)
        tl.store(dp + 2, thr, mask=dm)
    n_bad = tl.sum(tl.sum(bad.to(tl.int32), axis=1), axis=0)
    if n_bad > 0:
        tl.atomic_add(cbase + _DET * scn1, n_bad)
        if CORRECT:
            n_fix = n_bad * 0
            n_rec = n_bad * 0
            offs_g = tl.arange(0, BLOCK_G)
            for gi in range(0, BLOCK_G):
                sel = offs_g[None, :] == gi
                bad_g = tl.sum(tl.where(sel, bad.to(tl.int32), 0), axis=1) > 0
                if tl.max(bad_g.to(tl.int32), axis=0) > 0:
                    f, r = _repair_group(X, W, Y, Bias, rows, r_ok, bad_g, pid_g * BLOCK_G + gi, N, K,
                                         sxm, sxk, swn, swk, sym, syn, BLOCK_K, HAS_BIAS, DOT_F32)
                    n_fix += f
                    n_rec += r
            if n_fix > 0:
                tl.atomic_add(cbase + _COR * scn1, n_fix)
            if n_rec > 0:
                tl.atomic_add(cbase + _REC * scn1, n_rec)
        else:
            tl.atomic_add(cbase + _UNC * scn1, n_bad)
