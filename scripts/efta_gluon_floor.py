"""The floor kernel of `bench_efta_floor.py` written in Gluon, with explicit asynchronous MMAs.

A study for EFTA v2's schedule, not the library's kernel. Triton's automatic forms did not keep GEMM I of
key block j+1 in flight across block j's softmax (``docs/triton_efta_gpu.md``, "Schedules and check forms"):
here the schedule is written out. Hopper only (sm_90a: ``wgmma``, TMA, mbarriers).

Two schedules, each at check level 0 (no checks) or 3 with the lean row sum (`bench_efta_floor.py`'s
``floor0`` and ``lean3``: step 1's group checksum ``Sc1 = Q·Kc1ᵀ``, step 4's product identity per group,
GEMM II's checksum ``Oc = P·[Vc1 | 1 | 0…]`` whose ones column is l; detect only):

* sequential (``gfloor0`` / ``glean3``): each key block's GEMM I, softmax and GEMM II in turn, every MMA
  waited for at once (the library's order, with TMA loads two blocks ahead);
* pipelined (``gfloor0p`` / ``glean3p``, PIPE = 1): FlashAttention-3's intra-warpgroup overlap. Iteration j
  issues GEMM I of block j (scores and their checksum dot) and then GEMM II of block j−1 (O and its
  checksum dot), waits only for the first pair, runs block j's softmax and checks while GEMM II is on the
  tensor cores, then waits for it and rescales O by block j's α;
* lazy (``gfloor0z`` / ``glean3z``, sequential): the running max moves only when a block's max exceeds it by
  more than 2^8 (so P ≤ 256), and O with its checksum columns is rescaled only when some row of the program
  moved (FlashAttention-4's conditional rescaling, with one vote per program);
* one clamp (``glean3c``, fp16; bf16 runs as ``glean3``): step 4 clamps the exponent at −25 before exp2
  instead of clamping the exponent and P apart, and forms the product in chains of 4 keys;
* deep (``gfloor0d`` / ``glean3d``, PIPE = 2): GEMM I of block j+1 is issued as soon as block j's scores
  are in, so that during block j's softmax the tensor cores hold GEMM II of block j−1 and GEMM I of block
  j+1 (two key blocks of MMA work against one block's CUDA-core work; one more score accumulator live).

Memory: K with its Kc1 rows and V with its V-checksum rows in two rings of two slots each, filled by TMA
(one mbarrier per slot): K of block j+2 is requested once block j's scores are done, V of block j+1 once
GEMM II of block j−1 is. Q is read once into shared memory and is GEMM I's A operand there; P goes to
GEMM II from registers.

Shapes: Q, K, V, O (B·H·S, D) contiguous 2-D views, S a multiple of BLOCK_M and BLOCK_N; the checksum
operands as `bench_efta_floor.tables` makes them: Kc1 (blocks·16, D), the lean V-checksum operand
(blocks·32, BLOCK_N), KA (blocks,) fp32 max |Kc1|.
"""

from __future__ import annotations

import os
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _gluon import compile_offline as _compile  # noqa: E402
from _gluon import descriptor as _desc  # noqa: E402
from _gluon import tma_load as _tma_load  # noqa: E402

LOG2E = 1.4426950408889634
_Y_MIN = gl.constexpr(-14.0)
_P_MIN = gl.constexpr(2.0 ** -14)
# lazy rescaling: the running max moves only when a block's max exceeds it by more than this (base-2 units),
# so P ≤ 2^8 and most key blocks skip O's rescale
_LAZY_GROWTH = gl.constexpr(8.0)
# one clamp (fp16): y at −25 before exp2. P = 2^−25 rounds to fp16's 0 as any smaller P does, so GEMM II's P is
# unchanged, and step 4 needs no second clamp on P; products of 4 such P stay normal fp32 (2^−100)
_Y_MIN_ONE = gl.constexpr(-25.0)


@gluon.jit
def _mul(a, b):
    return a * b


@gluon.jit
def _ex2(x):
    """2^x as the library's kernel takes it (``ex2.approx.ftz``: no denormal fix-up around the MUFU op)."""
    return gl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=True,
                                     pack=1)


@gluon.jit
def _lg2(x):
    return gl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=True,
                                     pack=1)


@gluon.jit
def _load_block(desc, c_desc, t_s, c_s, bars, j, row0, blk0, BLOCK_N: gl.constexpr, CHECKED: gl.constexpr):
    """Request key (or value) block j into slot j % 2 of its ring, with CHECKED its checksum rows too (the
    checksum descriptor's block: Kc1's 16 rows, or the V-checksum operand's 32)."""
    slot = j % 2
    bar = bars.index(slot)
    if CHECKED:
        mbarrier.expect(bar, desc.block_type.nbytes + c_desc.block_type.nbytes)
        _tma_load(c_desc, [(blk0 + j) * c_desc.block_type.shape[0], 0], bar, c_s.index(slot))
    else:
        mbarrier.expect(bar, desc.block_type.nbytes)
    _tma_load(desc, [row0 + j * BLOCK_N, 0], bar, t_s.index(slot))


@gluon.jit
def _rescale(acc, oc, alpha, o_layout: gl.constexpr, c32_layout: gl.constexpr):
    """O (BLOCK_M, BLOCK_D) and its checksum columns (BLOCK_M, 32) rescaled by α (BLOCK_M,)."""
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    oc = oc * gl.convert_layout(alpha, gl.SliceLayout(1, c32_layout))[:, None]
    return acc, oc


@gluon.jit
def _gemm1(q_s, k_s, kc_s, bars, j, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, LEVEL: gl.constexpr,
           s_layout: gl.constexpr, c16_layout: gl.constexpr):
    """Issue GEMM I of key block j, asynchronously: the scores S = Q·Kᵀ (BLOCK_M, BLOCK_N) and with checks
    the checksum dot Sc1 = Q·Kc1ᵀ (BLOCK_M, 16). Returns the two tokens (Sc1's a zero tile at level 0)."""
    slot = j % 2
    mbarrier.wait(bars.index(slot), (j // 2) & 1)
    s_tok = warpgroup_mma(q_s, k_s.index(slot).permute((1, 0)), gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout),
                          use_acc=False, is_async=True)
    sc = gl.zeros([BLOCK_M, 16], gl.float32, c16_layout)
    if LEVEL >= 1:
        sc = warpgroup_mma(q_s, kc_s.index(slot).permute((1, 0)), sc, use_acc=False, is_async=True)
    return s_tok, sc


@gluon.jit
def _softmax(s, sc, m_i, worst1, worst4, qn1, kabs, offs_m, start_n, qk2, DIAG: gl.constexpr, LEVEL: gl.constexpr,
             LAZY: gl.constexpr, s_layout: gl.constexpr, c16_layout: gl.constexpr, ONE_CLAMP: gl.constexpr = False):
    """One key block's softmax and checks: P (BLOCK_M, BLOCK_N) fp32 against the new running max m_new
    (base-2 units), α = 2^(m_i − m_new), and the worst margins of step 1 (|Sc1 − Σ_l S[:, l·16 + r]| over
    its bound) and step 4 (|log2 Π_l P − Σ_l y| over its bound), (BLOCK_M, 16) each."""
    BLOCK_M: gl.constexpr = s.shape[0]
    BLOCK_N: gl.constexpr = s.shape[1]
    G: gl.constexpr = BLOCK_N // 16
    if LEVEL >= 1:  # step 1: Sc1 against the group sums of the scores
        # (the group sums' layout is c16_layout's: each thread holds the same residues of 16, no shuffle)
        gs = gl.convert_layout(gl.sum(gl.reshape(s, [BLOCK_M, G, 16]), axis=1), c16_layout)
        worst1 = gl.maximum(worst1, gl.fma(-qn1[:, None], kabs, gl.abs(sc - gs)))
    if DIAG:
        offs_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        s = gl.where(offs_m[:, None] >= offs_n[None, :], s, -float("inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk2)
    if LAZY:
        m_new = gl.where(m_new > m_i + _LAZY_GROWTH, m_new, m_i)
    y = gl.fma(s, qk2, -m_new[:, None])
    if ONE_CLAMP:  # fp16: P from the clamped exponent, the product in chains of 4 (one lg2 each)
        y = gl.maximum(y, _Y_MIN_ONE)
    p = _ex2(y)
    if LEVEL >= 2:  # step 4: the product identity per group of 16-strided keys
        if ONE_CLAMP:
            CH: gl.constexpr = (G + 3) // 4
            pc = gl.reduce(gl.reshape(p, [BLOCK_M, CH, G // CH, 16]), 2, _mul)
            xs = gl.sum(gl.reshape(y, [BLOCK_M, G, 16]), axis=1)
            lp = gl.convert_layout(gl.sum(_lg2(pc), axis=1), xs.type.layout)
        else:
            lp = _lg2(gl.reduce(gl.reshape(gl.maximum(p, _P_MIN), [BLOCK_M, G, 16]), 1, _mul))
            xs = gl.sum(gl.reshape(gl.maximum(y, _Y_MIN), [BLOCK_M, G, 16]), axis=1)
        worst4 = gl.maximum(worst4, gl.convert_layout(gl.abs(lp - xs) - 1e-4 * gl.abs(xs), c16_layout))
    alpha = _ex2(m_i - m_new)
    return p, m_new, alpha, worst1, worst4


@gluon.jit
def _softmax_at(s, sc, m_i, worst1, worst4, qn1, KA, blk0, j, diag_from, offs_m, qk2, BLOCK_N: gl.constexpr,
                CAUSAL: gl.constexpr, LEVEL: gl.constexpr, s_layout: gl.constexpr, c16_layout: gl.constexpr,
                LAZY: gl.constexpr = False, ONE_CLAMP: gl.constexpr = False):
    """`_softmax` of key block j, with the causal mask from block `diag_from` on."""
    kabs = gl.load(KA + blk0 + j)
    if CAUSAL and j >= diag_from:
        p, m_new, alpha, worst1, worst4 = _softmax(s, sc, m_i, worst1, worst4, qn1, kabs, offs_m, j * BLOCK_N, qk2,
                                                   True, LEVEL, LAZY, s_layout, c16_layout, ONE_CLAMP)
    else:
        p, m_new, alpha, worst1, worst4 = _softmax(s, sc, m_i, worst1, worst4, qn1, kabs, offs_m, j * BLOCK_N, qk2,
                                                   False, LEVEL, LAZY, s_layout, c16_layout, ONE_CLAMP)
    return p, m_new, alpha, worst1, worst4


@gluon.jit
def _gemm2(p, v_s, vc_s, bars, j, acc, oc, dtype: gl.constexpr, LEVEL: gl.constexpr, o_layout: gl.constexpr,
           c32_layout: gl.constexpr):
    """Issue GEMM II of block j, asynchronously: O += P·V and with checks Oc += P·[Vc1 | 1 | 0…]ᵀ. Returns
    the two tokens and P's operand (to keep alive until they are waited for)."""
    slot = j % 2
    mbarrier.wait(bars.index(slot), (j // 2) & 1)
    pd = p.to(dtype)
    p_op = gl.convert_layout(pd, gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2))
    o_tok = warpgroup_mma(p_op, v_s.index(slot), acc, is_async=True)
    if LEVEL >= 3:
        pc_op = gl.convert_layout(pd, gl.DotOperandLayout(operand_index=0, parent=c32_layout, k_width=2))
        oc = warpgroup_mma(pc_op, vc_s.index(slot).permute((1, 0)), oc, is_async=True)
    return o_tok, oc, p_op


@gluon.jit
def _gl_floor_kernel(q_desc, k_desc, v_desc, kc_desc, vc_desc, KA, O, Flags, S_CTX, qk2, tol1, tol3, vcmax,
                     BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, CAUSAL: gl.constexpr,
                     LEVEL: gl.constexpr, PIPE: gl.constexpr, LAZY: gl.constexpr, ONE_CLAMP: gl.constexpr,
                     num_warps: gl.constexpr):
    """One program: BLOCK_M query rows of one (batch, head); grid (S / BLOCK_M, B·H). LEVEL 0 or 3 (lean)."""
    # wgmma accumulators of (BLOCK_M, n) tiles, 64 rows per warp group
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_D, 16])
    c16_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, 16, 16])
    c32_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, 32, 16])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    dtype: gl.constexpr = q_desc.dtype
    start_m = gl.program_id(0)
    bh = gl.program_id(1)
    row0 = bh * S_CTX
    nblk = S_CTX // BLOCK_N
    blk0 = bh * nblk
    hi = gl.minimum((start_m + 1) * BLOCK_M, S_CTX) if CAUSAL else S_CTX
    n = (hi + BLOCK_N - 1) // BLOCK_N  # key blocks (with BLOCK_M < BLOCK_N the causal mask cuts the last)
    diag_from = (start_m * BLOCK_M) // BLOCK_N  # first key block that needs the causal mask

    q_s = gl.allocate_shared_memory(dtype, q_desc.block_type.shape, q_desc.layout)
    k_s = gl.allocate_shared_memory(dtype, [2] + k_desc.block_type.shape, k_desc.layout)
    v_s = gl.allocate_shared_memory(dtype, [2] + v_desc.block_type.shape, v_desc.layout)
    kc_s = gl.allocate_shared_memory(dtype, [2] + kc_desc.block_type.shape, kc_desc.layout)
    vc_s = gl.allocate_shared_memory(dtype, [2] + vc_desc.block_type.shape, vc_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(2):
        mbarrier.init(k_bars.index(i), count=1)
        mbarrier.init(v_bars.index(i), count=1)

    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    _tma_load(q_desc, [row0 + start_m * BLOCK_M, 0], q_bar, q_s)
    _load_block(k_desc, kc_desc, k_s, kc_s, k_bars, 0, row0, blk0, BLOCK_N, LEVEL >= 1)
    _load_block(v_desc, vc_desc, v_s, vc_s, v_bars, 0, row0, blk0, BLOCK_N, LEVEL >= 3)
    if n > 1:
        _load_block(k_desc, kc_desc, k_s, kc_s, k_bars, 1, row0, blk0, BLOCK_N, LEVEL >= 1)
        _load_block(v_desc, vc_desc, v_s, vc_s, v_bars, 1, row0, blk0, BLOCK_N, LEVEL >= 3)
    mbarrier.wait(q_bar, 0)

    offs_m = start_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_s)
    q_reg = q_s.load(gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0]))
    qn1 = gl.convert_layout(gl.sum(gl.abs(q_reg.to(gl.float32)), axis=1), gl.SliceLayout(1, c16_layout)) * tol1
    m_i = gl.full([BLOCK_M], -float("inf"), gl.float32, row_s)
    l_i = gl.zeros([BLOCK_M], gl.float32, row_s)
    acc = gl.zeros([BLOCK_M, BLOCK_D], gl.float32, o_layout)
    oc = gl.zeros([BLOCK_M, 32], gl.float32, c32_layout)
    worst1 = gl.full([BLOCK_M, 16], -float("inf"), gl.float32, c16_layout)
    worst4 = gl.full([BLOCK_M, 16], -float("inf"), gl.float32, c16_layout)

    NG: gl.constexpr = 2 if LEVEL >= 3 else 1  # wgmma groups per GEMM (the product and its checksum dot)
    if PIPE == 2:
        s_tok, sc = _gemm1(q_s, k_s, kc_s, k_bars, 0, BLOCK_M, BLOCK_N, LEVEL, s_layout, c16_layout)
        s, sc = warpgroup_mma_wait(0, deps=(s_tok, sc))
        if n > 2:
            _load_block(k_desc, kc_desc, k_s, kc_s, k_bars, 2, row0, blk0, BLOCK_N, LEVEL >= 1)
        s_tok, sc_tok = _gemm1(q_s, k_s, kc_s, k_bars, gl.minimum(1, n - 1), BLOCK_M, BLOCK_N, LEVEL, s_layout,
                               c16_layout)
        p, m_i, alpha, worst1, worst4 = _softmax_at(s, sc, m_i, worst1, worst4, qn1, KA, blk0, 0, diag_from, offs_m,
                                                    qk2, BLOCK_N, CAUSAL, LEVEL, s_layout, c16_layout,
                                                    ONE_CLAMP=ONE_CLAMP)
        if LEVEL < 3:
            l_i = gl.sum(p, axis=1)
        for j in range(1, n):
            # in flight: GEMM I of block j; issued now: GEMM II of block j-1
            o_tok, oc, p_op = _gemm2(p, v_s, vc_s, v_bars, j - 1, acc, oc, dtype, LEVEL, o_layout, c32_layout)
            s, sc, p_op = warpgroup_mma_wait(NG, deps=(s_tok, sc_tok, p_op))
            if j + 2 < n:
                _load_block(k_desc, kc_desc, k_s, kc_s, k_bars, j + 2, row0, blk0, BLOCK_N, LEVEL >= 1)
            # GEMM I of block j+1 (block n-1 again on the last pass: one MMA more per program, no branch)
            s_tok, sc_tok = _gemm1(q_s, k_s, kc_s, k_bars, gl.minimum(j + 1, n - 1), BLOCK_M, BLOCK_N, LEVEL,
                                   s_layout, c16_layout)
            p, m_new, alpha, worst1, worst4 = _softmax_at(s, sc, m_i, worst1, worst4, qn1, KA, blk0, j, diag_from,
                                                          offs_m, qk2, BLOCK_N, CAUSAL, LEVEL, s_layout, c16_layout,
                                                          ONE_CLAMP=ONE_CLAMP)
            acc, oc, p_op = warpgroup_mma_wait(NG, deps=(o_tok, oc, p_op))
            if j + 1 < n:
                _load_block(v_desc, vc_desc, v_s, vc_s, v_bars, j + 1, row0, blk0, BLOCK_N, LEVEL >= 3)
            acc, oc = _rescale(acc, oc, alpha, o_layout, c32_layout)
            if LEVEL < 3:
                l_i = l_i * alpha + gl.sum(p, axis=1)
            m_i = m_new
        o_tok, oc, p_op = _gemm2(p, v_s, vc_s, v_bars, n - 1, acc, oc, dtype, LEVEL, o_layout, c32_layout)
        acc, oc, p_op, s_tok, sc_tok = warpgroup_mma_wait(0, deps=(o_tok, oc, p_op, s_tok, sc_tok))
    elif PIPE == 1:
        s_tok, sc = _gemm1(q_s, k_s, kc_s, k_bars, 0, BLOCK_M, BLOCK_N, LEVEL, s_layout, c16_layout)
        s, sc = warpgroup_mma_wait(0, deps=(s_tok, sc))
        if n > 2:
            _load_block(k_desc, kc_desc, k_s, kc_s, k_bars, 2, row0, blk0, BLOCK_N, LEVEL >= 1)
        p, m_i, alpha, worst1, worst4 = _softmax_at(s, sc, m_i, worst1, worst4, qn1, KA, blk0, 0, diag_from, offs_m,
                                                    qk2, BLOCK_N, CAUSAL, LEVEL, s_layout, c16_layout,
                                                    ONE_CLAMP=ONE_CLAMP)
        if LEVEL < 3:
            l_i = gl.sum(p, axis=1)
        for j in range(1, n):
            s_tok, sc = _gemm1(q_s, k_s, kc_s, k_bars, j, BLOCK_M, BLOCK_N, LEVEL, s_layout, c16_layout)
            o_tok, oc, p_op = _gemm2(p, v_s, vc_s, v_bars, j - 1, acc, oc, dtype, LEVEL, o_layout, c32_layout)
            # block j's scores: wait while GEMM II of block j-1 stays in flight
            s, sc, p_op = warpgroup_mma_wait(NG, deps=(s_tok, sc, p_op))
            if j + 2 < n:
                _load_block(k_desc, kc_desc, k_s, kc_s, k_bars, j + 2, row0, blk0, BLOCK_N, LEVEL >= 1)
            p, m_new, alpha, worst1, worst4 = _softmax_at(s, sc, m_i, worst1, worst4, qn1, KA, blk0, j, diag_from,
                                                          offs_m, qk2, BLOCK_N, CAUSAL, LEVEL, s_layout, c16_layout,
                                                          ONE_CLAMP=ONE_CLAMP)
            acc, oc, p_op = warpgroup_mma_wait(0, deps=(o_tok, oc, p_op))
            if j + 1 < n:
                _load_block(v_desc, vc_desc, v_s, vc_s, v_bars, j + 1, row0, blk0, BLOCK_N, LEVEL >= 3)
            acc, oc = _rescale(acc, oc, alpha, o_layout, c32_layout)
            if LEVEL < 3:
                l_i = l_i * alpha + gl.sum(p, axis=1)
            m_i = m_new
        o_tok, oc, p_op = _gemm2(p, v_s, vc_s, v_bars, n - 1, acc, oc, dtype, LEVEL, o_layout, c32_layout)
        acc, oc, p_op = warpgroup_mma_wait(0, deps=(o_tok, oc, p_op))
    else:
        for j in range(0, n):
            s_tok, sc = _gemm1(q_s, k_s, kc_s, k_bars, j, BLOCK_M, BLOCK_N, LEVEL, s_layout, c16_layout)
            s, sc = warpgroup_mma_wait(0, deps=(s_tok, sc))
            if j + 2 < n:
                _load_block(k_desc, kc_desc, k_s, kc_s, k_bars, j + 2, row0, blk0, BLOCK_N, LEVEL >= 1)
            p, m_new, alpha, worst1, worst4 = _softmax_at(s, sc, m_i, worst1, worst4, qn1, KA, blk0, j, diag_from,
                                                          offs_m, qk2, BLOCK_N, CAUSAL, LEVEL, s_layout, c16_layout,
                                                          LAZY, ONE_CLAMP)
            if LAZY:  # O and its checksums are rescaled only when some row's max moved (one vote per program)
                if gl.max((alpha < 1.0).to(gl.int32), axis=0) > 0:
                    acc, oc = _rescale(acc, oc, alpha, o_layout, c32_layout)
            else:
                acc, oc = _rescale(acc, oc, alpha, o_layout, c32_layout)
            if LEVEL < 3:
                l_i = l_i * alpha + gl.sum(p, axis=1)
            o_tok, oc, p_op = _gemm2(p, v_s, vc_s, v_bars, j, acc, oc, dtype, LEVEL, o_layout, c32_layout)
            acc, oc, p_op = warpgroup_mma_wait(0, deps=(o_tok, oc, p_op))
            if j + 2 < n:
                _load_block(v_desc, vc_desc, v_s, vc_s, v_bars, j + 2, row0, blk0, BLOCK_N, LEVEL >= 3)
            m_i = m_new

    mbarrier.invalidate(q_bar)
    for i in gl.static_range(2):
        mbarrier.invalidate(k_bars.index(i))
        mbarrier.invalidate(v_bars.index(i))

    # the verdict: step 1's and step 4's worst margins, Σ_r Oc1 = Σ_d O, 1 ≤ l ≤ keys (`_verdict`)
    row_c: gl.constexpr = gl.SliceLayout(1, c32_layout)
    rc = gl.arange(0, 32, layout=gl.SliceLayout(0, c32_layout))
    flag = gl.zeros([BLOCK_M], gl.int32, row_c)
    if LEVEL >= 3:
        l_c = gl.sum(gl.where(rc[None, :] == 16, oc, 0.0), axis=1)
        flag = flag | gl.convert_layout((gl.max(worst1, axis=1) > 0).to(gl.int32), row_c)
        flag = flag | gl.convert_layout((gl.max(worst4, axis=1) > 1e-3 * 3 * (BLOCK_N // 16)).to(gl.int32), row_c)
        d_o = gl.abs(gl.sum(gl.where(rc[None, :] < 16, oc, 0.0), axis=1)
                     - gl.convert_layout(gl.sum(acc, axis=1), row_c))
        flag = flag | (d_o > tol3 * vcmax * l_c).to(gl.int32)
        top = hi * 256.0 if LAZY else hi * 1.0  # with lazy rescaling P ≤ 2^8
        flag = flag | ((l_c < 1.0 - 1e-3) | (l_c > top * 1.001)).to(gl.int32)
        l_o = gl.convert_layout(l_c, gl.SliceLayout(1, o_layout))
    else:
        l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    om = start_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
    od = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, o_layout))
    gl.store(O + (row0 + om)[:, None].to(gl.int64) * BLOCK_D + od[None, :], (acc / l_o[:, None]).to(dtype))
    fm = start_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_c)
    gl.store(Flags + row0 + fm, flag)


def gluon_attention(q, k, v, scale: float, causal: bool, level: int, pipe: int, cfg, kc, ka, vc32, vcmax, flags,
                    lazy: bool = False, one_clamp: bool = False):
    """q, k, v (B·H, S, D) contiguous fp16/bf16, S a multiple of the config's blocks; cfg (BLOCK_M, BLOCK_N,
    num_warps, ·); kc, ka, vc32 from `bench_efta_floor.tables` at BLOCK_N; flags (B·H·S,) int32. Returns O
    (B·H, S, D)."""
    BM, BN, warps, _ = cfg
    BH, S, D = q.shape
    o = torch.empty_like(q)
    u = 2.0 ** -8 if q.dtype == torch.bfloat16 else 2.0 ** -11
    q2, k2, v2 = (t.reshape(BH * S, D) for t in (q, k, v))
    _gl_floor_kernel[(S // BM, BH)](
        _desc(q2, [BM, D]), _desc(k2, [BN, D]), _desc(v2, [BN, D]), _desc(kc.reshape(-1, D), [16, D]),
        _desc(vc32.reshape(-1, BN), [32, BN]), ka, o, flags, S, scale * LOG2E, 4 * u, 64 * u, vcmax,
        BLOCK_M=BM, BLOCK_N=BN, BLOCK_D=D, CAUSAL=causal, LEVEL=level, PIPE=pipe, LAZY=lazy,
        ONE_CLAMP=one_clamp and q.dtype == torch.float16, num_warps=warps)
    return o


def compile_offline(BM: int, BN: int, D: int, warps: int, causal: bool, level: int, pipe: int = 0, lazy: bool = False,
                    dtype: torch.dtype = torch.float16, arch: int = 90, one_clamp: bool = False):
    """`_gl_floor_kernel` compiled for ``sm_{arch}a`` without a GPU (`_gluon.compile_offline`), specialised as
    `gluon_attention` launches it on contiguous tensors."""
    BH, S = 2, 1024  # any shape of the kernel's form: S is a runtime argument
    q = torch.empty(BH * S, D, dtype=dtype)
    kc = torch.empty(BH * S // BN * 16, D, dtype=dtype)
    vc = torch.empty(BH * S // BN * 32, BN, dtype=dtype)
    args = dict(q_desc=_desc(q, [BM, D]), k_desc=_desc(q, [BN, D]), v_desc=_desc(q, [BN, D]),
                kc_desc=_desc(kc, [16, D]), vc_desc=_desc(vc, [32, BN]), KA=torch.empty(BH * S // BN), O=q,
                Flags=torch.empty(BH * S, dtype=torch.int32), S_CTX=S, qk2=0.1, tol1=0.1, tol3=0.1, vcmax=1.0)
    consts = dict(BLOCK_M=BM, BLOCK_N=BN, BLOCK_D=D, CAUSAL=causal, LEVEL=level, PIPE=pipe, LAZY=lazy,
                  ONE_CLAMP=one_clamp, num_warps=warps)
    return _compile(_gl_floor_kernel, args, consts, arch)


if __name__ == "__main__":
    import argparse

    from kernel_resources import loop_census, ptxas_info

    ap = argparse.ArgumentParser(description="Compile the Gluon floor for sm_90a offline; print ptxas's resources.")
    ap.add_argument("configs", nargs="+", metavar="BM,BN,D,WARPS,CAUSAL,LEVEL,PIPE[,LAZY[,ONE_CLAMP]]")
    ap.add_argument("--loops", action="store_true", help="also the opcode counts of the key loop (SASS)")
    args = ap.parse_args()
    for spec in args.configs:
        bm, bn, d, w, causal, level, pipe, *flags = map(int, spec.split(","))
        flags += [0] * (2 - len(flags))
        c = compile_offline(bm, bn, d, w, bool(causal), level, pipe, bool(flags[0]), one_clamp=bool(flags[1]))
        print(spec, "shared", c.metadata.shared, ptxas_info(c.asm["ptx"]))
        if args.loops:  # the loop with the most tensor-core instructions and the fewest stores: the key loop
            loops = [lp for lp in loop_census(c.asm["cubin"]) if not lp[1]["STG"]]
            size, ops, short = max(loops, key=lambda lp: (lp[1]["HGMMA"], -lp[0]))
            print(f"    key loop: {size} instructions, shortest path {short}:",
                  ", ".join(f"{k} {v}" for k, v in ops.most_common(12)))
