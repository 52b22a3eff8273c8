"""The verification of the row-checked forms: `_verify_rows` (shared with the one-launch tile GEMM) and
`_verify_kernel`, the second launch.

``D1 = Σ_T partials − (x·w1 + b1)``, the per-row threshold ``T_m`` from x's statistics and the
weight's host-folded constants (SPEC §5), ``|D1| > T_m`` or non-finite → ``detected``; ``t = D2/D1 ≈
n+1`` locates a single error, which is repaired by recomputing that element (one fp32 dot ``x[m]·W[n]
+ b[n]``) and re-verified (the row as stored against the output-side threshold, and in accumulator
mode D1 with the repaired term against the accumulator-side one) → ``corrected``; other faulty rows
are recomputed in the kernel (``x[m]·Wᵀ + b``), at most ``capacity`` rows per call, claimed through
one atomic on a per-call slot counter → ``recomputed``; the rest → ``uncorrectable``. Counters are
atomics into the caller's (6, 5) int32 block. Non-finite x (found by the GEMM tiles) or W/b (known
when the weight checksums were built) count one ``nonfinite_input`` and switch the call's checks off,
as on the reference path.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..tl_common import dot as _mma
from .common import _COR, _DET, _NONF, _REC, _SITE_ROW, _UNC


@triton.jit
def _verify_rows(X, W, Y, Bias, B12, P, S, Acc, Flag, Ws, Cnt, Dbg, rows, count_nonf,
                 M, N, K, T, TS, sxm, sxk, swn, swk, sym, syn, scn0, scn1,
                 inv_n, fn, inv_k, call_id, w_finite, capacity,
                 th_det, th_v2, th_v3, th_var23, th_var4, th_bias, reverify_scale,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr,
                 HAS_BIAS: tl.constexpr, CORRECT: tl.constexpr, DEBUG: tl.constexpr,
                 DOT_F32: tl.constexpr, ROW_NONF: tl.constexpr, VERIFY_OUTPUT: tl.constexpr, CSUM: tl.constexpr):
    """Compare checksums of the rows ``rows`` (BLOCK_R,), count, repair located single errors,
    recompute the rest.

    The row sums are the T tiles' partials at ``P`` (T, M, 2) and the checksums and statistics
    partials at ``S`` (T, M, 8), of which only the first TS slots can hold a share (a tile takes the
    K blocks ``kb ≡ pid_n (mod T)``, so tiles past the K block count hold the neutral values); with
    CSUM the row sums are in the cells ``Acc`` (M, 2), reset here for the next call, and ``S`` holds
    the TS = n_csum checksum programs' slots.

    Recompute slots are claimed with one atomic on the call's counter ``Ws``. Checks are off for
    this call when W/b are non-finite (``w_finite`` 0) and, without ROW_NONF, when any x of the call
    is (``Flag``; ``count_nonf``: this program counts the call's ``nonfinite_input``). ROW_NONF (the
    one-launch GEMM, which verifies before every tile has raised the flag): only rows whose own x is
    non-finite are skipped, and the caller settles the call's counts.
    P, S, Y and Flag are read past L1 (``.cg``): in the one-launch GEMM other programs wrote them
    during this launch. VERIFY_OUTPUT: the row sums are of the rounded outputs (else of the fp32
    accumulators, where a repair is also checked against the accumulator-side difference)."""
    BLOCK_R: tl.constexpr = rows.shape[0]
    r_ok = rows < M
    # the T tiles' row partial sums and checksum partials, BLOCK_T tiles per load: a loop of one
    # small load per tile would chain T memory latencies. (Loading each (tile, row) record whole and
    # splitting its fields in registers was slower on the H100: 35.9 against 27.7 µs for a one-launch
    # 4096 × 896 × 896.)
    offs_t = tl.arange(0, BLOCK_T)
    s1 = tl.zeros((BLOCK_R,), tl.float32)
    s2 = tl.zeros((BLOCK_R,), tl.float32)
    # the bias checksums and the call's non-finite flag are loaded first and used only after the
    # loop, so that their round trips overlap the partials' instead of preceding or following them
    b1 = tl.load(B12)
    b2 = tl.load(B12 + 1)
    if not ROW_NONF:
        flag = tl.load(Flag, cache_modifier=".cg")
    c1 = tl.zeros((BLOCK_R,), tl.float32)
    c2 = tl.zeros((BLOCK_R,), tl.float32)
    sm = tl.zeros((BLOCK_R,), tl.float32)
    mx = tl.full((BLOCK_R,), -float("inf"), tl.float32)
    mn = tl.full((BLOCK_R,), float("inf"), tl.float32)
    if CSUM:
        s1 = tl.load(Acc + rows * 2, mask=r_ok, other=0.0, cache_modifier=".cg")
        s2 = tl.load(Acc + rows * 2 + 1, mask=r_ok, other=0.0, cache_modifier=".cg")
    else:
        for t0 in range(0, T, BLOCK_T):
            tt = t0 + offs_t
            lm = (tt[:, None] < T) & r_ok[None, :]
            prow = P + (tt[:, None] * M + rows[None, :]) * 2
            s1 += tl.sum(tl.load(prow, mask=lm, other=0.0, cache_modifier=".cg"), axis=0)
            s2 += tl.sum(tl.load(prow + 1, mask=lm, other=0.0, cache_modifier=".cg"), axis=0)
    for t0 in range(0, TS, BLOCK_T):  # only the slots that can hold a share
        tt = t0 + offs_t
        lm = (tt[:, None] < TS) & r_ok[None, :]
        srow = S + (tt[:, None] * M + rows[None, :]) * 8
        c1 += tl.sum(tl.load(srow + 0, mask=lm, other=0.0, cache_modifier=".cg"), axis=0)
        c2 += tl.sum(tl.load(srow + 1, mask=lm, other=0.0, cache_modifier=".cg"), axis=0)
        mx = tl.maximum(mx, tl.max(tl.load(srow + 2, mask=lm, other=-float("inf"), cache_modifier=".cg"), axis=0))
        mn = tl.minimum(mn, tl.min(tl.load(srow + 3, mask=lm, other=float("inf"), cache_modifier=".cg"), axis=0))
        sm += tl.sum(tl.load(srow + 4, mask=lm, other=0.0, cache_modifier=".cg"), axis=0)
    if CSUM:
        # the cells back to 0 for the next call, once every thread has read them: each row is held by
        # threads of several warps, and one of them stores (without the barrier, a warp that had not
        # yet loaded read the 0: 4-5 % of the calls at M = 16, K ≥ 4352 on an H200)
        tl.debug_barrier()
        tl.store(Acc + rows * 2, tl.zeros_like(s1), mask=r_ok)
        tl.store(Acc + rows * 2 + 1, tl.zeros_like(s2), mask=r_ok)
    c1 += b1
    c2 += b2
    mu = sm * inv_k
    var = tl.maximum((mx - mu) * (mu - mn), 0.0)
    # T_m (SPEC §5, WeightChecksums.thresholds): host-folded weight constants
    thr = th_var23 * tl.sqrt(mu * mu * th_v2 + var * th_v3) + th_det * tl.abs(mu) + th_var4 * tl.sqrt(var) + th_bias
    if ROW_NONF:  # per row: x's row finite (a NaN makes the sum NaN; ±inf shows in max/min), W and b finite
        ok = (tl.abs(sm) < float("inf")) & (mx < float("inf")) & (mn > -float("inf")) & (w_finite != 0)
    else:  # for the call: no non-finite x seen by the GEMM tiles, finite W and b
        ok = (flag != call_id) & (w_finite != 0)
    # (tl.where, not `&`, to combine with the scalar: the interpreter mis-types bool & 0-d bool)
    d1 = s1 - c1
    bad = tl.where(ok, ~(tl.abs(d1) <= thr) & r_ok, False)
    if DEBUG:
        drow = Dbg + rows * 4
        tl.store(drow + 0, d1, mask=r_ok)
        tl.store(drow + 1, c1, mask=r_ok)
        tl.store(drow + 2, thr, mask=r_ok)
    n_bad = tl.sum(bad.to(tl.int32), axis=0)
    n_fix = n_bad * 0
    n_rec = n_bad * 0
    n_unc = n_bad
    if CORRECT:
        d2 = s2 - c2 * inv_n
        tq = d2 / d1 * fn
        j = tl.floor(tq + 0.5)
        loc = bad & (tl.abs(tq) < float("inf")) & (tl.abs(tq - j) <= 0.25) & (j >= 1.0) & (j <= fn)
        col = tl.where(loc, j - 1.0, 0.0).to(tl.int32)
        fixed = loc & (rows < 0)
        offs_k = tl.arange(0, BLOCK_K)
        if tl.sum(loc.to(tl.int32), axis=0) > 0:
            # repair: y[m, col] = fp32 dot x[m]·W[col] + b[col]; re-verify with the repaired value
            val = tl.zeros((BLOCK_R,), tl.float32)
            vabs = tl.zeros((BLOCK_R,), tl.float32)  # Σ|x·w|, for the rounding bound of the check below
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + offs_k
                lm = loc[:, None] & (kk[None, :] < K)
                xa = tl.load(X + rows[:, None] * sxm + kk[None, :] * sxk, mask=lm, other=0.0).to(tl.float32)
                wa = tl.load(W + col[:, None] * swn + kk[None, :] * swk, mask=lm, other=0.0).to(tl.float32)
                val += tl.sum(xa * wa, axis=1)
                if not VERIFY_OUTPUT:
                    vabs += tl.sum(tl.abs(xa * wa), axis=1)
            if HAS_BIAS:
                val += tl.load(Bias + col, mask=loc, other=0.0).to(tl.float32)
            yptr = Y + rows * sym + col * syn
            old = tl.load(yptr, mask=loc, other=0.0, cache_modifier=".cg").to(tl.float32)
            newv = val.to(Y.dtype.element_ty)
            tl.store(yptr, newv, mask=loc)
            # re-verify the repaired row as stored (like the reference): re-sum it in fp32 with the
            # located element replaced (excluded, not subtracted: a flipped value may be ~1e38 and
            # would swamp the others), against the output-side threshold
            offs_j = tl.arange(0, BLOCK_N)
            rs = newv.to(tl.float32)
            for n0 in range(0, N, BLOCK_N):
                cols = n0 + offs_j
                lm2 = loc[:, None] & (cols[None, :] < N) & (cols[None, :] != col[:, None])
                rs += tl.sum(tl.load(Y + rows[:, None] * sym + cols[None, :] * syn, mask=lm2, other=0.0,
                                         cache_modifier=".cg")
                             .to(tl.float32), axis=1)
            fixed = loc & (tl.abs(rs - c1) <= thr * reverify_scale)
            if not VERIFY_OUTPUT:
                # and in the accumulators: D1 with the located element's term replaced by the repair,
                # D1 − v + val, must pass the accumulator-side threshold. v (the fp32 accumulator, or
                # the flipped value) is within half an ulp of the stored y, the GEMM's and the
                # repair's dots differ by at most 2·K·u·Σ|x·w|, and D1's own sum rounds by at most
                # N·u per |v|. The re-sum above uses the output's rounding and can pass a location
                # that does not explain D1: two errors in one row, the rest of whose sum stays under
                # bf16's output-side threshold (one +2.3 and one −3.6 seen; a repair elsewhere, the
                # row left wrong). Such a row goes to recompute instead.
                if Y.dtype.element_ty == tl.float16:
                    u_y: tl.constexpr = 2.0**-11
                elif Y.dtype.element_ty == tl.bfloat16:
                    u_y: tl.constexpr = 2.0**-8
                else:
                    u_y: tl.constexpr = 2.0**-24
                tol = thr + (u_y + fn * 2.0**-24) * tl.abs(old) + 2.0 * K * 2.0**-24 * vabs
                fixed = fixed & (tl.abs(d1 - old + val) <= tol)
        need = bad & ~fixed
        n_need = tl.sum(need.to(tl.int32), axis=0)
        n_fix = tl.sum(fixed.to(tl.int32), axis=0)
        n_unc = n_need
        if n_need > 0:
            base = tl.atomic_add(Ws, n_need)  # fixed capacity per call: claim slots
            rank = tl.cumsum(need.to(tl.int32), axis=0) - 1
            take = need & (base + rank < capacity)
            n_rec = tl.sum(take.to(tl.int32), axis=0)
            n_unc = n_need - n_rec
            if n_rec > 0:
                # recompute the taken rows: x[m]·Wᵀ + b, the GEMM's own arithmetic, no injection
                offs_j = tl.arange(0, BLOCK_N)
                for n0 in range(0, N, BLOCK_N):
                    cols = n0 + offs_j
                    c_ok = cols < N
                    acc = tl.zeros((BLOCK_R, BLOCK_N), tl.float32)
                    for k0 in range(0, K, BLOCK_K):
                        kk = k0 + offs_k
                        xa = tl.load(X + rows[:, None] * sxm + kk[None, :] * sxk,
                                     mask=take[:, None] & (kk[None, :] < K), other=0.0)
                        wb = tl.load(W + kk[:, None] * swk + cols[None, :] * swn,
                                     mask=(kk[:, None] < K) & c_ok[None, :], other=0.0)
                        acc = _mma(xa, wb, acc, DOT_F32)
                    if HAS_BIAS:
                        acc += tl.load(Bias + cols, mask=c_ok, other=0.0).to(tl.float32)[None, :]
                    tl.store(Y + rows[:, None] * sym + cols[None, :] * syn, acc.to(Y.dtype.element_ty),
                             mask=take[:, None] & c_ok[None, :])
    cbase = Cnt + _SITE_ROW * scn0
    if n_bad > 0:
        tl.atomic_add(cbase + _DET * scn1, n_bad)
    if n_fix > 0:
        tl.atomic_add(cbase + _COR * scn1, n_fix)
    if n_rec > 0:
        tl.atomic_add(cbase + _REC * scn1, n_rec)
    if n_unc > 0:
        tl.atomic_add(cbase + _UNC * scn1, n_unc)
    if not ROW_NONF:
        if count_nonf:
            if ok.to(tl.int32) == 0:
                tl.atomic_add(cbase + _NONF * scn1, 1)


@triton.jit(do_not_specialize=["call_id", "w_finite", "T", "TS"])
def _verify_kernel(X, W, Y, Bias, B12, P, Flag, Ws,
                   M, N, K, T, TS, sxm, sxk, swn, swk, sym, syn, inv_n, call_id,
                   Cnt, Dbg, scn0, scn1, fn, inv_k, w_finite, capacity,
                   th_det, th_v2, th_v3, th_var23, th_var4, th_bias, reverify_scale,
                   BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr,
                   HAS_BIAS: tl.constexpr, CORRECT: tl.constexpr, DEBUG: tl.constexpr,
                   DOT_F32: tl.constexpr, VERIFY_OUTPUT: tl.constexpr):
    """The second launch (calls of more than one row block): BLOCK_R rows per program; the row sums of T
    tiles, the statistics in TS slots (the tiles' shares, or the persistent form's single slot)."""
    pid = tl.program_id(0)
    S = P + T * M * 2
    _verify_rows(X, W, Y, Bias, B12, P, S, P, Flag, Ws, Cnt, Dbg, pid * BLOCK_R + tl.arange(0, BLOCK_R), pid == 0,
                 M, N, K, T, TS, sxm, sxk, swn, swk, sym, syn, scn0, scn1,
                 inv_n, fn, inv_k, call_id, w_finite,
                 capacity, th_det, th_v2, th_v3, th_var23, th_var4, th_bias, reverify_scale,
                 BLOCK_N, BLOCK_K, BLOCK_T, HAS_BIAS, CORRECT, DEBUG, DOT_F32, False, VERIFY_OUTPUT, False)
