"""The persistent form of the checked GEMM (wide calls on Hopper): a pass over x for the checksums and
statistics, and `_persistent_kernel`, one program per SM over TMA descriptors made in the kernel with
nothing but the row sums in its epilogue; `verify._verify_kernel` then verifies.

The pass over x runs in the GEMM's programs that the last wave of tiles leaves idle where they have
room (STATS, `_stats_block`), else as a launch before the GEMM (`_stats_kernel`). Any checksum work
inside the persistent K loop cost 5-50 % in Triton 3.6, where the plain persistent GEMM runs at
0.89-1.01× cuBLAS.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..tl_common import dot as _mma
from .common import _grouped_tile, _store_stats


@triton.jit
def _stats_rows(X, W12, S, Flag, rows, M, K, sxm, sxk, call_id, CK: tl.constexpr):
    """The persistent form's statistics of the rows ``rows`` (R,) of x (M, K): ``x·w1``, ``x·w2`` (``W12``
    (K, 2) fp32) and x's row max / min / sum in fp32, into the single statistics slot ``S`` (M, 8) that the
    verify launch reads (TS = 1); raises the call's non-finite flag like the tiles' share does
    (`_store_stats`)."""
    R: tl.constexpr = rows.shape[0]
    r_ok = rows < M
    offs_k = tl.arange(0, CK)
    c1 = tl.zeros((R,), tl.float32)
    c2 = tl.zeros((R,), tl.float32)
    sm = tl.zeros((R,), tl.float32)
    mx = tl.full((R,), -float("inf"), tl.float32)
    mn = tl.full((R,), float("inf"), tl.float32)
    for k0 in range(0, K, CK):
        kk = k0 + offs_k
        k_ok = kk < K
        lm = r_ok[:, None] & k_ok[None, :]
        xv = tl.load(X + rows[:, None] * sxm + kk[None, :] * sxk, mask=lm, other=0.0).to(tl.float32)
        c1 += tl.sum(xv * tl.load(W12 + kk * 2, mask=k_ok, other=0.0)[None, :], axis=1)
        c2 += tl.sum(xv * tl.load(W12 + kk * 2 + 1, mask=k_ok, other=0.0)[None, :], axis=1)
        sm += tl.sum(xv, axis=1)
        mx = tl.maximum(mx, tl.max(tl.where(lm, xv, -float("inf")), axis=1))
        mn = tl.minimum(mn, tl.min(tl.where(lm, xv, float("inf")), axis=1))
    _store_stats(S + rows * 8, r_ok, c1, c2, mx, mn, sm, Flag, call_id)


@triton.jit
def _max_min16(mx, mn, a, b):
    """(max(mx, a), min(mn, b)) elementwise, in the operands' dtype: fp16 and fp32 as Triton does them, bf16
    as two packed PTX ``max.bf16x2`` / ``min.bf16x2`` (Triton widens bf16 to fp32 and back: twice the
    instructions). A NaN is dropped, as `_stats_rows`' max / min drop it (the sum keeps it)."""
    if mx.dtype == tl.bfloat16:
        mx = tl.inline_asm_elementwise("max.bf16x2 $0, $1, $2;", "=r,r,r", [mx, a], dtype=tl.bfloat16,
                                       is_pure=True, pack=2)
        mn = tl.inline_asm_elementwise("min.bf16x2 $0, $1, $2;", "=r,r,r", [mn, b], dtype=tl.bfloat16,
                                       is_pure=True, pack=2)
    else:
        mx = tl.maximum(mx, a)
        mn = tl.minimum(mn, b)
    return mx, mn


@triton.jit
def _stats_block(xd, W16, Winv, S, Flag, row0, M, K, call_id, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                 STAGES: tl.constexpr, DOT_F32: tl.constexpr):
    """`_stats_rows` for the BLOCK_M rows of x (M, K) from ``row0``, as a persistent GEMM program with a tile
    fewer makes them: x loaded by the TMA descriptor ``xd`` (zero past M and K) in (BLOCK_M, BLOCK_K) blocks,
    STAGES loads in flight. ``x·w1``, ``x·w2`` and the row sum are one tensor-core dot per block against
    ``W16`` (K, 16) in x's dtype (`_stats_operand`: w1 and w2 in slices, then ones; ``Winv`` (2,) fp32 the
    slices' inverse scales); max and min are kept per element in x's dtype (exact) and reduced once. The
    CUDA-core form of `_stats_rows` moved ~30 GB/s per SM on an H200: too slow for the idle programs."""
    rows = row0 + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    cols = tl.arange(0, 16)
    DT: tl.constexpr = W16.dtype.element_ty
    MT: tl.constexpr = tl.float32 if DOT_F32 else DT  # (the interpreter's bf16 max / min are not)
    acc = tl.zeros((BLOCK_M, 16), tl.float32)
    mx = tl.full((BLOCK_M, BLOCK_K), -float("inf"), MT)
    mn = tl.full((BLOCK_M, BLOCK_K), float("inf"), MT)
    nfull = K // BLOCK_K
    for kb in tl.range(nfull, num_stages=STAGES):
        xt = xd.load([row0, kb * BLOCK_K])
        acc = _mma(xt, tl.load(W16 + (kb * BLOCK_K + offs_k)[:, None] * 16 + cols[None, :]), acc, DOT_F32)
        mx, mn = _max_min16(mx, mn, xt.to(MT), xt.to(MT))
    if nfull * BLOCK_K < K:  # the last, partial block: TMA's zeros past K must not enter max / min
        kk = nfull * BLOCK_K + offs_k
        k_ok = kk < K
        xt = xd.load([row0, nfull * BLOCK_K])
        acc = _mma(xt, tl.load(W16 + kk[:, None] * 16 + cols[None, :], mask=k_ok[:, None], other=0.0), acc, DOT_F32)
        mx, mn = _max_min16(mx, mn, tl.where(k_ok[None, :], xt, -float("inf")).to(MT),
                            tl.where(k_ok[None, :], xt, float("inf")).to(MT))
    # W16's columns: w1 in slices 0 .. P-1, w2 in P .. 2P-1, ones at 2P (P = 2 for fp16, 3 for bf16)
    P: tl.constexpr = 2 if DT == tl.float16 else 3
    c1 = tl.sum(tl.where(cols[None, :] < P, acc, 0.0), axis=1) * tl.load(Winv)
    c2 = tl.sum(tl.where((cols[None, :] >= P) & (cols[None, :] < 2 * P), acc, 0.0), axis=1) * tl.load(Winv + 1)
    sm = tl.sum(tl.where(cols[None, :] == 2 * P, acc, 0.0), axis=1)
    _store_stats(S + rows * 8, rows < M, c1, c2, tl.max(mx, axis=1).to(tl.float32), tl.min(mn, axis=1).to(tl.float32),
                 sm, Flag, call_id)


@triton.jit(do_not_specialize=["call_id"])
def _stats_kernel(X, W12, P, Flag, Ws, M, K, T, sxm, call_id, R: tl.constexpr, CK: tl.constexpr):
    """The persistent form's first launch, a pass over x (M, K), R rows per program (`_stats_rows`): the
    checksums and statistics into the one slot after the T tiles' row sums in ``P``; program 0 zeroes the
    recompute slot counter ``Ws`` (the two-launch GEMM's first program does). (The same pass as a prologue
    of `_persistent_kernel` made those calls 8-15 % slower on an H200.)"""
    pid = tl.program_id(0)
    if pid == 0:
        tl.store(Ws, 0)
    _stats_rows(X, W12, P + T * M * 2, Flag, pid * R + tl.arange(0, R), M, K, sxm, 1, call_id, CK)


@triton.jit(do_not_specialize=["call_id"])
def _persistent_kernel(X, W, Y, Bias, P, W16, Winv, Flag, Ws, M, N, K, sxm, sw, sym, inv_n, call_id,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
                       NUM_SMS: tl.constexpr, HAS_BIAS: tl.constexpr, W_KN: tl.constexpr,
                       VERIFY_OUTPUT: tl.constexpr, DOT_F32: tl.constexpr, STATS: tl.constexpr,
                       STATS_BK: tl.constexpr, STATS_STAGES: tl.constexpr):
    """The persistent form's GEMM: NUM_SMS programs loop over the (BLOCK_M, BLOCK_N) tiles of y (M, N) in
    grouped order, with x (M, K), W (N, K) (or (K, N) when W_KN) and y moved by TMA descriptors made here
    (plain pointer arguments, so a prepared call replays it), the tile and K loops flattened into one
    pipeline. Epilogue: bias in fp32, the two row partial sums of each tile into ``P`` (T, M, 2) as
    `_tile_epilogue` stores them (of the fp32 accumulators, or of the rounded outputs with VERIFY_OUTPUT),
    y rounded and stored. No checksum work in the K loop (it cost 5-50 % there).

    STATS: the pass over x for ``x·w1``, ``x·w2`` (``W16``, ``Winv``) and the row statistics, into the slot after
    ``P``'s T tiles, is made here (else by `_stats_kernel` before): the programs with a tile fewer than the
    others (the last, partial wave leaves NUM_SMS − T mod NUM_SMS of them idle) take the row blocks in
    turn after their tiles, `_stats_block`; program 0 zeroes ``Ws`` as `_stats_kernel` does. The host
    sets it only where that slack has room (`forms.slack_stats`).
    Row strides sxm, sw (of W as stored), sym; unit inner strides, 16-byte aligned rows (`forms.persistent_ok`).
    DOT_F32: the interpreter's dots in fp32 (as `_gemm_tile`'s)."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    xd = tl.make_tensor_descriptor(X, shape=[M, K], strides=[sxm, 1], block_shape=[BLOCK_M, BLOCK_K])
    if W_KN:
        wd = tl.make_tensor_descriptor(W, shape=[K, N], strides=[sw, 1], block_shape=[BLOCK_K, BLOCK_N])
    else:
        wd = tl.make_tensor_descriptor(W, shape=[N, K], strides=[sw, 1], block_shape=[BLOCK_N, BLOCK_K])
    yd = tl.make_tensor_descriptor(Y, shape=[M, N], strides=[sym, 1], block_shape=[BLOCK_M, BLOCK_N])
    for tile in tl.range(pid, num_pid_m * num_pid_n, NUM_SMS, flatten=True):
        pid_m, pid_n = _grouped_tile(tile, num_pid_m, num_pid_n, GROUP)
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for kb in range(tl.cdiv(K, BLOCK_K)):
            a = xd.load([pid_m * BLOCK_M, kb * BLOCK_K])
            if W_KN:
                b = wd.load([kb * BLOCK_K, pid_n * BLOCK_N])
            else:
                b = wd.load([pid_n * BLOCK_N, kb * BLOCK_K]).T
            acc = _mma(a, b, acc, DOT_F32)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        if HAS_BIAS:
            acc += tl.load(Bias + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        yv = acc.to(Y.dtype.element_ty)
        if VERIFY_OUTPUT:
            v = tl.where(n_ok[None, :], yv.to(tl.float32), 0.0)
        else:
            v = tl.where(n_ok[None, :], acc, 0.0)
        m_ok = offs_m < M
        prow = P + (pid_n * M + offs_m) * 2
        tl.store(prow, tl.sum(v, axis=1), mask=m_ok)
        tl.store(prow + 1, tl.sum(v * ((offs_n + 1).to(tl.float32) * inv_n)[None, :], axis=1), mask=m_ok)
        yd.store([pid_m * BLOCK_M, pid_n * BLOCK_N], yv)
    if STATS:
        if pid == 0:
            tl.store(Ws, 0)
        full = (num_pid_m * num_pid_n) % NUM_SMS  # programs 0 .. full-1 have one tile more
        if pid >= full:
            sd = tl.make_tensor_descriptor(X, shape=[M, K], strides=[sxm, 1], block_shape=[BLOCK_M, STATS_BK])
            for rb in range(pid - full, num_pid_m, NUM_SMS - full):
                _stats_block(sd, W16, Winv, P + num_pid_n * M * 2, Flag, rb * BLOCK_M, M, K, call_id, BLOCK_M,
                             STATS_BK, STATS_STAGES, DOT_F32)

