"""The tiled checked GEMM (`_gemm_kernel`): a grouped-order grid over (BLOCK_M × BLOCK_N) output tiles.

Each tile: an fp32 accumulator (tensor cores for fp16/bf16, IEEE fp32 FMAs for fp32), bias added in
fp32, rounded to y's dtype, flips of site ``linear.output`` applied to the *rounded* value (so bit
positions mean what they mean on the reference path), then the tile's rows reduced into two partial
sums ``Σ_n v[m,n]`` and ``Σ_n (n+1)/N·v[m,n]`` (v = acc, or the flipped rounded value where a flip
landed) into a (T, M, 2) fp32 buffer: two FMAs per output element, no atomics, a fixed summation
order. Operands come through TMA tensor descriptors on Hopper when their layout allows, through
pointers otherwise.

The checksums are shared out over a row block's T tiles: tile ``pid_n`` also takes the K blocks
``kb ≡ pid_n (mod T)`` of the x tiles it has just loaded (again, from L2) and computes, in plain fp32
on the CUDA cores, partial ``x·w1`` and ``x·w2`` (``WeightChecksums.w12``) and x's row statistics
(max, min, sum) for the V-ABFT threshold, into a (T, M, 8) buffer. Every element of x enters the
checksums once and no program is added: separate checksum programs that re-read x from memory, each
holding a GEMM-sized share of shared memory while doing little arithmetic, cost up to 60 % at
K-heavy shapes.

Why not append ``w1``/``w2`` as extra output columns of the same GEMM: the checksum operand must keep
fp32 accuracy, which in fp16/bf16 means splitting it into 2–3 slices of the input dtype (a second copy
of every weight with extra columns, or a register-built split operand; the latter is what gives the
EFTA kernel its wgmma false alarms on the H100). Here the checksum math is ordinary fp32 arithmetic on
loaded values, and the tensor-core dot is the plain GEMM's.

Verification runs either in a second launch (`verify._verify_kernel`) or in this one (ONE_LAUNCH):
see `_gemm_kernel`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..tl_common import dot as _mma
from .common import _NONF, _SITE_ROW, _grouped_tile, _store_stats, k_blocks, round_and_inject
from .verify import _verify_rows


@triton.jit
def _gemm_tile(X, W, Y, Xd, Wd, Yd, Bias, W12, P, S, Acc, Inj, Flag, Part, Tcnt, pid_m, pid_n, split, kb_per,
               num_pid_m, num_pid_n, offs_m, offs_am, m_ok, M, N, K, sxm, sxk, swn, swk, sym, syn, inv_n, call_id,
               n_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               HAS_BIAS: tl.constexpr, DETECT: tl.constexpr, VERIFY_OUTPUT: tl.constexpr,
               INJ: tl.constexpr, DOT_F32: tl.constexpr, EVEN_K: tl.constexpr,
               TMA: tl.constexpr, W_KN: tl.constexpr, TMA_STORE: tl.constexpr, CSUM: tl.constexpr,
               SPLIT: tl.constexpr):
    """One (BLOCK_M, BLOCK_N) tile: fp32 GEMM + bias, rounding, injection, row partial sums, store;
    when DETECT also its share of the row checksums: the K blocks ``kb ≡ pid_n (mod T)`` of x, which
    the tile has just loaded (read again from L2), give partial ``x·w1``, ``x·w2`` and row max / min /
    sum (plain fp32 on the CUDA cores, one K block in T per tile, no extra programs).

    TMA: operands are loaded (and y stored) through tensor descriptors ``Xd`` (M, K), ``Wd`` ((N, K),
    or (K, N) when W_KN) and ``Yd`` (M, N), whose out-of-bounds rows/columns read as zero and are not
    written; otherwise through the pointers X, W, Y and strides. TMA_STORE: y through ``Yd`` too (not
    in the one-launch GEMM, whose verifying program reads the other tiles' y: a TMA store is
    asynchronous, and Triton waits only until its shared-memory source may be reused).

    CSUM (a one-launch call of one row block, M ≤ CSUM_ROWS): the checksums and statistics come
    from the `_csum_chunk` programs, so the tile runs the plain main loop, and adds its two row
    partial sums into the per-row cells ``Acc`` (M, 2) (relaxed atomics) instead of storing them.

    SPLIT (one-row-block calls whose few tiles would leave most SMs idle: split-K): this program is split
    ``split`` of ``n_split`` over the tile's K blocks ``[split·kb_per, (split+1)·kb_per)``. It stores
    its fp32 partial tile in ``Part`` (n_split, M, N) and counts on the tile's cell ``Tcnt[pid_n]``;
    the last of the tile's splits to count resets the cell, sums the n_split partials in split order
    (the same fp32 sum whichever program finishes last) and runs the epilogue on that sum, so the
    verification still sees the fp32 accumulators before rounding."""
    offs_k = tl.arange(0, BLOCK_K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_bn = offs_n % N
    kb0, kb1 = k_blocks(split, kb_per, K, BLOCK_K, SPLIT)
    a_ptrs = X + offs_am[:, None] * sxm + (kb0 * BLOCK_K + offs_k)[None, :] * sxk
    b_ptrs = W + (kb0 * BLOCK_K + offs_k)[:, None] * swk + offs_bn[None, :] * swn
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    c1 = tl.zeros((BLOCK_M,), tl.float32)
    c2 = tl.zeros((BLOCK_M,), tl.float32)
    sm = tl.zeros((BLOCK_M,), tl.float32)
    mx = tl.full((BLOCK_M,), -float("inf"), tl.float32)
    mn = tl.full((BLOCK_M,), float("inf"), tl.float32)
    for kb in range(kb0, kb1):
        if TMA:
            a = Xd.load([pid_m * BLOCK_M, kb * BLOCK_K])
            if W_KN:
                b = Wd.load([kb * BLOCK_K, pid_n * BLOCK_N])
            else:
                b = Wd.load([pid_n * BLOCK_N, kb * BLOCK_K]).T
        elif EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            rem = K - kb * BLOCK_K
            a = tl.load(a_ptrs, mask=offs_k[None, :] < rem, other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < rem, other=0.0)
        acc = _mma(a, b, acc, DOT_F32)
        if DETECT and not CSUM:
            if kb % num_pid_n == pid_n:
                kk = kb * BLOCK_K + offs_k
                k_ok = kk < K
                # the x block reloaded (from L2: the tile has just read it) so that ``a`` feeds only
                # the dot and stays in the pipelined shared-memory buffers (taking ``a`` itself cost
                # 8-25 % more on the H100: fewer pipeline stages, spills)
                af = tl.load(X + offs_am[:, None] * sxm + kk[None, :] * sxk, mask=k_ok[None, :],
                             other=0.0).to(tl.float32)
                c1 += tl.sum(af * tl.load(W12 + kk * 2, mask=k_ok, other=0.0)[None, :], axis=1)
                c2 += tl.sum(af * tl.load(W12 + kk * 2 + 1, mask=k_ok, other=0.0)[None, :], axis=1)
                sm += tl.sum(af, axis=1)
                mx = tl.maximum(mx, tl.max(tl.where(k_ok[None, :], af, -float("inf")), axis=1))
                mn = tl.minimum(mn, tl.min(tl.where(k_ok[None, :], af, float("inf")), axis=1))
        if not TMA:
            a_ptrs += BLOCK_K * sxk
            b_ptrs += BLOCK_K * swk
    if SPLIT:
        pmask = m_ok[:, None] & n_ok[None, :]
        part = Part + offs_m[:, None] * N + offs_n[None, :]
        tl.store(part + split * M * N, acc, mask=pmask)
        tl.debug_barrier()  # every thread's partial before the count
        if tl.atomic_add(Tcnt + pid_n, 1, sem="acq_rel") == n_split - 1:
            tl.store(Tcnt + pid_n, 0)  # ready for the next call (every split has counted)
            acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            for s in range(0, n_split):  # a fixed order: the same sum whichever split came last
                acc += tl.load(part + s * M * N, mask=pmask, other=0.0, cache_modifier=".cg")
            _tile_epilogue(acc, Y, Yd, Bias, P, S, Acc, Inj, Flag, pid_m, pid_n, num_pid_m, offs_m, offs_n, n_ok,
                           m_ok, M, sym, syn, inv_n, call_id, c1, c2, mx, mn, sm, HAS_BIAS, DETECT, VERIFY_OUTPUT,
                           INJ, TMA_STORE, CSUM)
    else:
        _tile_epilogue(acc, Y, Yd, Bias, P, S, Acc, Inj, Flag, pid_m, pid_n, num_pid_m, offs_m, offs_n, n_ok,
                       m_ok, M, sym, syn, inv_n, call_id, c1, c2, mx, mn, sm, HAS_BIAS, DETECT, VERIFY_OUTPUT,
                       INJ, TMA_STORE, CSUM)


@triton.jit
def _tile_epilogue(acc, Y, Yd, Bias, P, S, Acc, Inj, Flag, pid_m, pid_n, num_pid_m, offs_m, offs_n, n_ok, m_ok, M,
                   sym, syn, inv_n, call_id, c1, c2, mx, mn, sm, HAS_BIAS: tl.constexpr, DETECT: tl.constexpr,
                   VERIFY_OUTPUT: tl.constexpr, INJ: tl.constexpr, TMA_STORE: tl.constexpr, CSUM: tl.constexpr):
    """A tile's fp32 sum ``acc`` (BLOCK_M, BLOCK_N) out: bias, rounding, injection, the row sums
    (stored, or with CSUM added into ``Acc``) and the checksum partials, y's store."""
    BLOCK_M: tl.constexpr = acc.shape[0]
    BLOCK_N: tl.constexpr = acc.shape[1]
    if HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    # flips at site linear.output, on the rounded value
    yv, v = round_and_inject(acc, Y.dtype.element_ty, Inj, pid_m, num_pid_m, offs_m, offs_n, n_ok, INJ, VERIFY_OUTPUT)
    if DETECT:
        colw = (offs_n + 1).to(tl.float32) * inv_n
        s1 = tl.sum(v, axis=1)
        s2 = tl.sum(v * colw[None, :], axis=1)
        if CSUM:
            # the order of the tiles' additions varies from call to call: the row sums' last bits may
            # too (|error| ~ T·u·Σ|partials|, far under the threshold's unit error)
            tl.atomic_add(Acc + offs_m * 2, s1, mask=m_ok, sem="relaxed")
            tl.atomic_add(Acc + offs_m * 2 + 1, s2, mask=m_ok, sem="relaxed")
        else:
            prow = P + (pid_n * M + offs_m) * 2
            tl.store(prow, s1, mask=m_ok)
            tl.store(prow + 1, s2, mask=m_ok)
            _store_stats(S + (pid_n * M + offs_m) * 8, m_ok, c1, c2, mx, mn, sm, Flag, call_id)
    if TMA_STORE:
        Yd.store([pid_m * BLOCK_M, pid_n * BLOCK_N], yv)
    else:
        tl.store(Y + offs_m[:, None] * sym + offs_n[None, :] * syn, yv, mask=m_ok[:, None] & n_ok[None, :])



@triton.jit
def _csum_chunk(X, W12, S, Flag, chunk, M, K, sxm, sxk, call_id, CSUM_R: tl.constexpr, CSUM_K: tl.constexpr):
    """One K chunk of a decode call's checksums (CSUM): partial ``x·w1``, ``x·w2`` and x's max / min /
    sum for the call's rows (CSUM_R ≥ M) over ``K`` indices ``[chunk·CSUM_K, (chunk+1)·CSUM_K)``,
    into stats slot ``chunk`` of ``S`` (C, M, 8). Plain fp32 on the CUDA cores, one load of x and
    of ``w12`` (K, 2), no loop: the chunk programs run beside the GEMM tiles, on SMs a decode GEMM
    leaves idle."""
    rows = tl.arange(0, CSUM_R)
    r_ok = rows < M
    kk = chunk * CSUM_K + tl.arange(0, CSUM_K)
    k_ok = kk < K
    xv = tl.load(X + rows[:, None] * sxm + kk[None, :] * sxk, mask=r_ok[:, None] & k_ok[None, :],
                 other=0.0).to(tl.float32)
    w1 = tl.load(W12 + kk * 2, mask=k_ok, other=0.0)
    w2 = tl.load(W12 + kk * 2 + 1, mask=k_ok, other=0.0)
    c1 = tl.sum(xv * w1[None, :], axis=1)
    c2 = tl.sum(xv * w2[None, :], axis=1)
    sm = tl.sum(xv, axis=1)
    mx = tl.max(tl.where(k_ok[None, :], xv, -float("inf")), axis=1)
    mn = tl.min(tl.where(k_ok[None, :], xv, float("inf")), axis=1)
    _store_stats(S + (chunk * M + rows) * 8, r_ok, c1, c2, mx, mn, sm, Flag, call_id)



@triton.jit(do_not_specialize=["call_id", "w_finite"])
def _gemm_kernel(X, W, Y, Xd, Wd, Yd, Bias, W12, P, Inj, Flag, Ws,
                 M, N, K, sxm, sxk, swn, swk, sym, syn, inv_n, call_id,
                 Sem, B12, Cnt, Dbg, scn0, scn1, fn, inv_k, w_finite, capacity,
                 th_det, th_v2, th_v3, th_var23, th_var4, th_bias, reverify_scale, Acc, n_csum, n_split, kb_per,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, DETECT: tl.constexpr,
                 VERIFY_OUTPUT: tl.constexpr, INJ: tl.constexpr, DOT_F32: tl.constexpr,
                 EVEN_K: tl.constexpr, TMA: tl.constexpr, W_KN: tl.constexpr, TMA_STORE: tl.constexpr,
                 ONE_LAUNCH: tl.constexpr, VERIFY_R: tl.constexpr, VBLOCK_N: tl.constexpr,
                 VBLOCK_K: tl.constexpr, VBLOCK_T: tl.constexpr, CORRECT: tl.constexpr, DEBUG: tl.constexpr,
                 CSUM: tl.constexpr, CSUM_R: tl.constexpr, CSUM_K: tl.constexpr, SPLIT: tl.constexpr):
    """Grouped-order grid over the output tiles (and, with CSUM, ``n_csum`` checksum programs after them).

    ONE_LAUNCH: the GEMM verifies itself, no second launch. ``Sem`` is the per-device int32 cell
    block of `_cells` (0 between calls): [0] row blocks verified, [1] recompute slots taken, [2:6]
    the call's detected / corrected / recomputed / uncorrectable counts, [8 + r] tiles of row block
    r done. Each program counts itself done on its row block's cell after its stores (barrier, then
    an acq_rel atomic: its stores are visible to whoever sees the count); the one that sees T − 1
    resets the cell and verifies the row block, VERIFY_R rows at a time, counting into [2:6] and
    skipping rows whose own x is non-finite. It then counts the row block verified on [0]; the one
    that sees all row blocks publishes the call's counts into ``Cnt`` — or, if any x of the call was
    non-finite (``Flag``) or W/b is, one ``nonfinite_input`` instead, like the reference — and
    resets [0:8]. A call of one row block skips the [0] stage: every tile has counted before its
    verifier starts, so that program verifies with the whole call's non-finite flag, as
    ``_verify_kernel`` does, counts into ``Cnt`` itself and resets [1]. The verify arguments
    (``Sem`` … ``reverify_scale``) are those of ``_verify_kernel``; unused otherwise.

    CSUM (one launch, one row block, M ≤ CSUM_ROWS: decode): ``n_csum`` more programs, one per
    CSUM_K-wide chunk of K, compute the checksums and x's statistics (`_csum_chunk`, into the stats
    slots at ``P``) while the tiles run the plain main loop and add their row sums into ``Acc``; all
    T + n_csum programs count on the row block's cell, and the last verifies. Measured on an H200
    (``docs/vabft.md``): the tiles' share of the checksums in the K loop cost 0.7-2.6 µs
    per decode call, and the verifier's walk over T tiles' partials 1.7-3 µs (88 µs for the lm_head's
    2,374 tiles), against one load of the cells here.

    SPLIT (calls of one row block and few tiles, `forms.split_plan`: decode calls with checksum programs, and
    the plain GEMM's of the same shapes): each tile runs as ``n_split`` programs over
    ``kb_per`` K blocks each (split-K; see `_gemm_tile`), program ``pid`` being split
    ``pid % n_split`` of tile ``pid // n_split``; the tiles' split counts use the cells
    ``Sem[9 + pid_n]``, which a one-row-block call leaves free (the plain GEMM gets the cell block as
    ``Sem`` for them), and with ONE_LAUNCH all T·n_split + n_csum programs count on the row block's cell."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    if SPLIT:  # one row block, tiles of n_split programs (then, with CSUM, the checksum programs)
        pid_m = 0
        pid_n = pid // n_split
        split = pid % n_split
    elif CSUM:  # one row block; programs past the tiles (pid ≥ T) are the checksum programs
        pid_m = 0
        pid_n = pid
        split = 0
    else:
        split = 0
        pid_m, pid_n = _grouped_tile(pid, num_pid_m, num_pid_n, GROUP)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    offs_am = offs_m % M  # wrapped rows: in-bounds loads without a mask, never stored
    if CSUM:
        S = P  # the (n_csum, M, 8) stats slots of the checksum programs; the row sums go to Acc
    else:
        S = P + num_pid_n * M * 2  # the (T, M, 8) stats follow the (T, M, 2) row sums in one buffer
    if DETECT and not ONE_LAUNCH:
        if pid == 0:
            tl.store(Ws, 0)  # per-call recompute slot counter (read by the verify kernel)
    # SPLIT: the partial tiles after the checksum slots in P, the tiles' split counts in the cells
    # after the row block's (a CSUM call has one row block)
    if CSUM and pid >= num_pid_n * n_split:
        _csum_chunk(X, W12, S, Flag, pid - num_pid_n * n_split, M, K, sxm, sxk, call_id, CSUM_R, CSUM_K)
    else:
        _gemm_tile(X, W, Y, Xd, Wd, Yd, Bias, W12, P, S, Acc, Inj, Flag, P + n_csum * M * 8, Sem + 9, pid_m, pid_n,
                   split, kb_per, num_pid_m, num_pid_n, offs_m, offs_am, m_ok, M, N, K, sxm, sxk, swn, swk, sym, syn,
                   inv_n, call_id, n_split, BLOCK_M, BLOCK_N, BLOCK_K, HAS_BIAS, DETECT, VERIFY_OUTPUT, INJ, DOT_F32,
                   EVEN_K, TMA, W_KN, TMA_STORE, CSUM, SPLIT)
    if ONE_LAUNCH:
        tl.debug_barrier()  # every thread's stores (y, partials, flag) before the count
        done = tl.atomic_add(Sem + 8 + pid_m, 1, sem="acq_rel")
        if done == num_pid_n * n_split + n_csum - 1:
            tl.store(Sem + 8 + pid_m, 0)  # ready for the next call (every tile has counted)
            # statistics slots that can hold a share: the checksum programs', or the tiles' up to the K block count
            ts = n_csum if CSUM else tl.minimum(num_pid_n, tl.cdiv(K, BLOCK_K))
            if num_pid_m == 1:
                # the call's only row block (decode): every tile has finished, so the flag of a
                # non-finite x is final. Verify with the two-launch semantics (checks off for the
                # whole call) and count straight into Cnt: no row-block stage, two fewer round trips.
                for r0 in range(0, M, VERIFY_R):
                    _verify_rows(X, W, Y, Bias, B12, P, S, Acc, Flag, Sem + 1, Cnt, Dbg, r0 + tl.arange(0, VERIFY_R),
                                 r0 == 0, M, N, K, n_csum if CSUM else num_pid_n, ts, sxm, sxk, swn, swk, sym, syn,
                                 scn0, scn1, inv_n, fn, inv_k, call_id, w_finite, capacity, th_det, th_v2, th_v3,
                                 th_var23, th_var4, th_bias, reverify_scale, VBLOCK_N, VBLOCK_K, VBLOCK_T, HAS_BIAS,
                                 CORRECT, DEBUG, DOT_F32, False, VERIFY_OUTPUT, CSUM)
                tl.store(Sem + 1, 0)  # the recompute slot counter, for the next call
                tl.store(Flag, 0)  # the non-finite flag too (`call_flag`'s self_reset: no memset in a graph)
            else:
                for r0 in range(0, tl.minimum(BLOCK_M, M - pid_m * BLOCK_M), VERIFY_R):
                    _verify_rows(X, W, Y, Bias, B12, P, S, Acc, Flag, Sem + 1, Sem + 2, Dbg,
                                 pid_m * BLOCK_M + r0 + tl.arange(0, VERIFY_R), False, M, N, K, num_pid_n, ts,
                                 sxm, sxk, swn, swk, sym, syn, 0, 1, inv_n, fn, inv_k, call_id, w_finite,
                                 capacity, th_det, th_v2, th_v3, th_var23, th_var4, th_bias, reverify_scale,
                                 VBLOCK_N, VBLOCK_K, VBLOCK_T, HAS_BIAS, CORRECT, DEBUG, DOT_F32, True, VERIFY_OUTPUT,
                                 False)
                tl.debug_barrier()  # every thread's counts before the row block counts as verified
                fin = tl.atomic_add(Sem, 1, sem="acq_rel")
                if fin == num_pid_m - 1:
                    # every verifier has finished: plain loads and stores (no atomic round trips in the tail)
                    ok = (tl.load(Flag, cache_modifier=".cg") != call_id) & (w_finite != 0)
                    c8 = tl.arange(0, 8)
                    cs = tl.load(Sem + c8, cache_modifier=".cg")  # [2:6]: detected, corrected, recomputed, unc.
                    tl.store(Sem + c8, 0)
                    tl.store(Flag, 0)  # every tile has raised it or not, and it was read above
                    cbase = Cnt + _SITE_ROW * scn0
                    if ok:
                        if tl.sum(tl.where((c8 >= 2) & (c8 < 6), cs, 0), axis=0) > 0:
                            for kind in tl.static_range(4):
                                c = tl.sum(tl.where(c8 == kind + 2, cs, 0), axis=0)
                                if c > 0:
                                    tl.atomic_add(cbase + kind * scn1, c)
                    else:
                        tl.atomic_add(cbase + _NONF * scn1, 1)

