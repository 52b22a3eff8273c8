#!/usr/bin/env python
"""What EFTA's checks cost at the least: a plain flash-attention kernel with one check added at a time.

A study for issue 3's target (detect+correct ≤ 1.10× our checks-off kernel), not the library's kernel.
`floor` below is a minimal Triton flash-attention forward (fp16/bf16, BLOCK_N keys per step, base-2
exponent in one FFMA, ``ex2.approx.ftz``: the form of `kernels.efta`'s checks-off loop) to which
``LEVEL`` adds SPEC §3's checks, each in the cheapest form this file could write. They only detect:
no location, no repair branch, no counters, a single fp16/bf16 slice for every checksum operand (the
library's hi/lo slices keep its thresholds at fp32 level), and the checksum tables are built by
PyTorch outside the timing. So each level is a lower bound for a kernel that carries those checks.

* ``floor0`` — no checks (compare with ``ours_off``, the library's checks-off kernel);
* ``floor1`` — step 1, GEMM I's tensor checksum: ``Sc1 = Q·Kc1ᵀ`` (one (BLOCK_M, 16) dot per key
  block), the group sums ``Σ_l S[i, l·16 + r]`` (one add per score, in-thread), each group's worst
  margin kept (one FFMA and one max per group), tested once after the loop;
* ``floor2`` — ``floor1`` + step 4 as the library writes it: ``Π_l max(P, P_min)`` against
  ``2^(Σ_l max(y, y_min))`` per group (per score two max, an add and a multiply; per group one
  ``lg2``);
* ``floor2u`` — ``floor1`` + step 4 as the EFTA paper's unified verification: the exponent sum taken from
  the checksum, ``Σ_l y = c·Sc1 − L·m·log2 e`` (per score one max and a multiply). Tested one-sided
  (``log2 Π ≥ Σ y − tol``) because clamped groups exceed the identity: not a complete check;
* ``floor3`` / ``floor3u`` — ``floor2`` / ``floor2u`` + GEMM II's checksum: ``Oc1 += P·Vc1`` (one
  (BLOCK_M, 16) dot per key block, rescaled with O), ``Σ_r Oc1 = Σ_d O`` tested after the loop, and
  the row sum's range test ``1 ≤ l ≤ keys`` (SPEC §3 case 3).
* ``lean3`` — ``floor3`` with the row sum on the tensor cores: the V-checksum operand carries a ones
  column (``[Vc1 | 1 | 0…]``, (BLOCK_N, 32)), so ``l = Σ_n P[i, n]`` of the P that GEMM II reads comes
  out of the same dot as Oc1, rescaled with it (no FADD row sum in the loop).

Two schedules. The plain one (the library's) runs each key block's GEMM I, softmax and GEMM II in turn.
The overlapped one (suffix ``o``: ``floor0o``, ``floor3o``, ``lean3o``) issues GEMM I of block j+1 (and
its checksum dot) before the softmax of block j, and carries its scores into the next iteration: the
wgmma runs on the tensor cores while the warps do block j's exponentials and checks (the intra-warpgroup
overlap of FlashAttention-3, written in Triton's source order; whether the compiler keeps the overlap is
what the timings show).

The library's kernel runs as ``ours_off`` (checks off) and ``efta_correct`` (detect+correct), and as
``ours_off_tma`` / ``efta_correct_tma`` with K and V read through tensor descriptors (``Options.efta_tma``).

Every variant (and ``sdpa_flash``) is timed in
``--rounds`` interleaved rounds (`_timing.interleaved`); ratios are medians of the same round's ratios
to ``floor0`` and to ``ours_off``. Outputs are compared with ``sdpa_flash`` and the floor variants
report how many rows their checks flagged on these clean inputs (must be 0; the library's variants, the
total of their event counters over every timed call). Needs a CUDA GPU
(``--dry-run`` runs two tiny shapes through Triton's interpreter on the CPU:
``TRITON_INTERPRET=1 python scripts/bench_efta_floor.py --dry-run``).

    python scripts/bench_efta_floor.py --out /tmp/floor
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import statistics
import sys
from functools import partial
from typing import NamedTuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from _common import grouped_bars, write_rows  # noqa: E402
from _timing import interleaved  # noqa: E402
from ft_transformers.kernels.efta.common import _mul  # noqa: E402

# the library's ex2.approx.ftz / lg2.approx.ftz (tl.exp2 / tl.log2 in the interpreter)
from ft_transformers.kernels.efta.host import _tma_allocator  # noqa: E402
from ft_transformers.kernels.efta.softmax import _exp, _lg2  # noqa: E402
from ft_transformers.kernels.tl_common import runs_interpreted  # noqa: E402

LOG2E = 1.4426950408889634
# step 4: exponents (base 2) below Y_MIN count as Y_MIN, P below 2^Y_MIN as 2^Y_MIN: a product of 8 stays normal
_Y_MIN = tl.constexpr(-14.0)
_P_MIN = tl.constexpr(2.0 ** -14)


class Floor(NamedTuple):
    """A floor variant: its check level, step 4 from the checksum (UNIFIED), the row sum from the
    V-checksum dot (LEAN), GEMM I of the next block issued before this block's softmax (OVERLAP), the
    warp-specialized loop (WS, `_floor_ws_kernel`)."""

    level: int
    unified: bool = False
    lean: bool = False
    overlap: bool = False
    tma: bool = False  # `_floor_ws_kernel`: every tile through a TMA descriptor
    ws: bool = False  # ... and its loop warp-specialized
    gluon: bool = False  # `efta_gluon_floor`: explicit asynchronous MMAs and TMA rings (levels 0 and 3 lean)
    pipe: int = 0  # ... 1: GEMM II of block j-1 in flight across block j's softmax; 2: and GEMM I of block j+1
    lazy: bool = False  # ... O rescaled only when the running max grew by more than 2^8
    one_clamp: bool = False  # ... fp16: step 4 with one clamp (the exponent at -25 before exp2)


LEVELS = {"floor0": Floor(0), "floor1": Floor(1), "floor2": Floor(2), "floor2u": Floor(2, unified=True),
          "floor3": Floor(3), "floor3u": Floor(3, unified=True), "lean3": Floor(3, lean=True),
          "floor0o": Floor(0, overlap=True), "floor3o": Floor(3, overlap=True),
          "lean3o": Floor(3, lean=True, overlap=True), "floor0w": Floor(0, tma=True, ws=True),
          "floor3w": Floor(3, tma=True, ws=True), "lean3w": Floor(3, lean=True, tma=True, ws=True),
          "floor0t": Floor(0, tma=True), "floor3t": Floor(3, tma=True), "lean3t": Floor(3, lean=True, tma=True),
          "gfloor0": Floor(0, gluon=True), "glean3": Floor(3, lean=True, gluon=True),
          "gfloor0p": Floor(0, gluon=True, pipe=1), "glean3p": Floor(3, lean=True, gluon=True, pipe=1),
          "gfloor0d": Floor(0, gluon=True, pipe=2), "glean3d": Floor(3, lean=True, gluon=True, pipe=2),
          "gfloor0z": Floor(0, gluon=True, lazy=True), "glean3z": Floor(3, lean=True, gluon=True, lazy=True),
          "glean3c": Floor(3, lean=True, gluon=True, one_clamp=True)}
# the library's kernel: (checks on, K and V through tensor descriptors `Options.efta_tma`, forced configs
# tuned over here (None: the library's autotuner)); ``efta_wide``: key blocks of 128 in the clean launch
LIBRARY = {"ours_off": (False, False, None), "efta_correct": (True, False, None), "ours_off_tma": (False, True, None),
           "efta_correct_tma": (True, True, None)}
CONFIGS_WIDE = [(128, 128, 8, 2), (128, 128, 8, 3), (64, 128, 4, 3), (64, 128, 4, 2)]
CONFIGS_64 = [(128, 64, 8, 3), (64, 64, 4, 3), (128, 64, 8, 4)]  # the checked kernel's 64-key prefill configs
LIBRARY.update(efta_wide=(True, False, CONFIGS_WIDE), efta_wide_tma=(True, True, CONFIGS_WIDE),
               efta_64=(True, False, CONFIGS_64))
VARIANTS = ("sdpa_flash", *LIBRARY, *LEVELS)
DEFAULT_VARIANTS = ("sdpa_flash", "ours_off", "efta_correct", "floor0", "floor3", "lean3", "floor0t", "floor3t",
                    "lean3t", "floor0w", "floor3w", "lean3w")
# (BLOCK_M, BLOCK_N, num_warps, num_stages): the library's checks-off prefill configs and its checked one
# (Triton 3.6 / sm_90a: with 8 warps ptxas serialises the wgmma of every checked floor variant, warning
# C7515, so those lose the tuning; with 4 warps it does not)
CONFIGS = [(128, 128, 8, 3), (64, 128, 4, 3), (64, 64, 4, 3)]
# the warp-specialized loop: 128-row blocks, which its consumer warp groups share (64 rows each)
CONFIGS_WS = [(128, 128, 4, 3), (128, 64, 4, 3), (128, 128, 8, 2), (64, 64, 4, 3)]
# the Gluon floor: 64 query rows per warp group; two-slot TMA rings (the last entry is unused)
CONFIGS_GL = [(128, 128, 8, 2), (128, 64, 8, 2), (64, 128, 4, 2), (64, 64, 4, 2)]


@triton.jit
def _log2_prod(pc, INTERP: tl.constexpr):
    """log2 of the product of pc (BM, G, 16) over axis 1: one fp32 product chain and one lg2 per group."""
    if INTERP:  # the interpreter runs custom reductions element by element
        return tl.sum(tl.log2(pc), axis=1)
    return _lg2(tl.reduce(pc, 1, _mul))


@triton.jit
def _verdict(worst1, worst4, oc, acc, l_i, hi, tol3, vcmax, G: tl.constexpr, LEVEL: tl.constexpr,
             LEAN: tl.constexpr):
    """After the loop: the row sum l (BLOCK_M,) (with LEAN the ones column of ``oc`` (BLOCK_M, 32), else
    ``l_i``) and each row's flag (int32, 1 where a check failed): step 1's and step 4's worst margins
    (BLOCK_M, 16), and from level 3 ``Σ_r Oc1 = Σ_d O`` (``oc``'s first 16 columns, ``acc`` (BLOCK_M, D))
    and ``1 ≤ l ≤ hi`` keys."""
    rc = tl.arange(0, oc.shape[1])
    oc1 = oc
    if LEAN:  # l is the ones column; the checksum columns are the first 16
        l_i = tl.sum(tl.where(rc[None, :] == 16, oc, 0.0), axis=1)
        oc1 = tl.where(rc[None, :] < 16, oc, 0.0)
    flag = tl.zeros((oc.shape[0],), tl.int32)
    if LEVEL >= 1:
        flag = flag | (tl.max(worst1, axis=1) > 0).to(tl.int32)
    if LEVEL >= 2:
        flag = flag | (tl.max(worst4, axis=1) > 1e-3 * 3 * G).to(tl.int32)
    if LEVEL >= 3:  # Σ_r Oc1 = Σ_d O, and 1 ≤ l ≤ number of keys
        dO = tl.abs(tl.sum(oc1, axis=1) - tl.sum(acc, axis=1))
        flag = flag | (dO > tol3 * vcmax * l_i).to(tl.int32)
        flag = flag | ((l_i < 1.0 - 1e-3) | (l_i > hi * 1.001)).to(tl.int32)
    return l_i, flag


@triton.jit
def _gemm1(q, K, KC, base, blk, start_n, offs_j, offs_d, r16, BLOCK_D: tl.constexpr, LEVEL: tl.constexpr):
    """GEMM I of one key block: the unscaled scores Q·Kᵀ (BLOCK_M, BLOCK_N) fp32 and, from level 1 on, the
    checksum dot Sc1 = Q·Kc1ᵀ (BLOCK_M, 16) fp32 (zeros below). Kc1 is K-major: an N-major (·, 16)
    operand of 32-byte rows gave wrong sums on the H100 in the library's kernel."""
    offs_n = start_n + offs_j
    k = tl.load(K + base + offs_n[:, None] * BLOCK_D + offs_d[None, :])
    s = tl.dot(q, tl.trans(k))
    sc1 = tl.zeros((q.shape[0], 16), tl.float32)
    if LEVEL >= 1:
        kc = tl.load(KC + blk.to(tl.int64) * (BLOCK_D * 16) + offs_d[:, None] + r16[None, :] * BLOCK_D)
        sc1 = tl.dot(q, kc)
    return s, sc1


@triton.jit
def _floor_kernel(Q, K, V, KC, KA, VC, O, Flags, S_CTX, qk2, tol1, tol3, vcmax,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
                  LEVEL: tl.constexpr, UNIFIED: tl.constexpr, LEAN: tl.constexpr, OVERLAP: tl.constexpr,
                  INTERP: tl.constexpr):
    """One program: BLOCK_M query rows of one (batch, head). Q, K, V, O (B·H, S, D) contiguous; KC
    (B·H·S/BLOCK_N, 16, D) Kc1 per key block, KA (B·H·S/BLOCK_N,) fp32 max |Kc1|, VC (B·H·S/BLOCK_N, C,
    BLOCK_N) per key block: Vc1 (C = 16), or with LEAN [Vc1 | 1 | 0…] (C = 32, the ones column makes l);
    Flags (B·H·S,) int32: 1 where a check of the row failed. qk2 = scale·log2 e."""
    G: tl.constexpr = BLOCK_N // 16  # key groups per block (checksum stride 16)
    C: tl.constexpr = 32 if LEAN else 16  # columns of the V-checksum operand
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_j = tl.arange(0, BLOCK_N)
    r16 = tl.arange(0, 16)
    rc = tl.arange(0, C)
    base = bh.to(tl.int64) * S_CTX * BLOCK_D
    nblk = S_CTX // BLOCK_N
    q = tl.load(Q + base + offs_m[:, None] * BLOCK_D + offs_d[None, :])
    m_i = tl.full((BLOCK_M,), -float("inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    worst1 = tl.full((BLOCK_M, 16), -float("inf"), tl.float32)
    worst4 = tl.full((BLOCK_M, 16), -float("inf"), tl.float32)
    oc = tl.zeros((BLOCK_M, C), tl.float32)
    qn1 = tl.sum(tl.abs(q.to(tl.float32)), axis=1) * tol1  # step-1 threshold per unit of max |Kc1|
    hi = tl.minimum((start_m + 1) * BLOCK_M, S_CTX) if CAUSAL else S_CTX
    last = (hi - 1) // BLOCK_N * BLOCK_N  # the loop's last block's first key
    if OVERLAP:  # block 0's GEMM I before the loop; each iteration issues the next block's
        s_nx, sc1_nx = _gemm1(q, K, KC, base, bh * nblk, 0, offs_j, offs_d, r16, BLOCK_D, LEVEL)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + offs_j
        blk = bh * nblk + start_n // BLOCK_N
        if OVERLAP:
            s = s_nx
            sc1 = sc1_nx
            # block j+1's GEMM I now, consumed next iteration: its wgmma overlaps this block's softmax
            # (the last iteration repeats the last block, whose result is dropped)
            nx = tl.minimum(start_n + BLOCK_N, last)
            s_nx, sc1_nx = _gemm1(q, K, KC, base, bh * nblk + nx // BLOCK_N, nx, offs_j, offs_d, r16, BLOCK_D,
                                  LEVEL)
        else:
            s, sc1 = _gemm1(q, K, KC, base, blk, start_n, offs_j, offs_d, r16, BLOCK_D, LEVEL)
        v = tl.load(V + base + offs_n[:, None] * BLOCK_D + offs_d[None, :])
        if LEVEL >= 1:  # step 1: Sc1 against the group sums, worst margin per group
            kabs = tl.load(KA + blk)
            d1 = sc1 - tl.sum(tl.reshape(s, (BLOCK_M, G, 16)), axis=1)
            worst1 = tl.maximum(worst1, tl.fma(-qn1[:, None], kabs, tl.abs(d1)))
        diag = CAUSAL and start_n + BLOCK_N > start_m * BLOCK_M  # the causal diagonal block
        if diag:
            s = tl.where(offs_m[:, None] >= offs_n[None, :], s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk2)  # base-2 units
        y = tl.fma(s, qk2, -m_new[:, None])
        p = _exp(y, INTERP, True)
        if LEVEL >= 2:  # step 4: product identity per group
            pc = tl.reshape(tl.maximum(p, _P_MIN), (BLOCK_M, G, 16))
            lp = _log2_prod(pc, INTERP)
            if UNIFIED:  # Σ_l y from the checksum (one-sided: clamped groups lie above it), off the
                xs = sc1 * qk2 - G * m_new[:, None]  # causal diagonal (masked keys break the identity)
                # allowance: the fp16/bf16 rounding of Kc1 that step 1 allows for, in these units
                e4 = (xs - lp) - 1e-4 * tl.abs(xs) - (qn1 * qk2)[:, None] * kabs
                if CAUSAL:
                    e4 = tl.where(diag, -float("inf"), e4)
            else:
                xs = tl.sum(tl.reshape(tl.maximum(y, _Y_MIN), (BLOCK_M, G, 16)), axis=1)
                e4 = tl.abs(lp - xs) - 1e-4 * tl.abs(xs)
            worst4 = tl.maximum(worst4, e4)
        alpha = _exp(m_i - m_new, INTERP, True)
        if not LEAN:
            l_i = l_i * alpha + tl.sum(p, axis=1)
        pd = p.to(v.dtype)
        acc = tl.dot(pd, v, acc * alpha[:, None])
        if LEVEL >= 3:  # GEMM II: Oc += P·[Vc1 (| 1 | 0…)], rescaled like O
            vc = tl.load(VC + blk.to(tl.int64) * (BLOCK_N * C) + offs_j[:, None] + rc[None, :] * BLOCK_N)
            oc = tl.dot(pd, vc, oc * alpha[:, None])
        m_i = m_new
    l_i, flag = _verdict(worst1, worst4, oc, acc, l_i, hi, tol3, vcmax, G, LEVEL, LEAN)
    tl.store(O + base + offs_m[:, None] * BLOCK_D + offs_d[None, :], (acc / l_i[:, None]).to(O.dtype.element_ty))
    tl.store(Flags + bh * S_CTX + offs_m, flag)


@triton.jit
def _floor_ws_kernel(Q, K, V, KC, KA, VC, O, Flags, S_CTX, qk2, tol1, tol3, vcmax,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
                     LEVEL: tl.constexpr, LEAN: tl.constexpr, WS: tl.constexpr, INTERP: tl.constexpr):
    """`_floor_kernel` (levels 0 and 3, LEAN) with every tile through an on-device TMA descriptor (Q, K, V
    (B·H·S, D); Kc1 (blocks·16, D); the V-checksum operand (blocks·C, BLOCK_N)). WS: the loop is
    ``tl.range(..., warp_specialize=True)``, which lets the compiler split it into a producer warp (the
    loads) and consumer warp groups that run the MMAs and the softmax of different row halves in turn
    (FlashAttention-3's ping-pong, as Triton builds it); whether it did is in the compiled TTGIR
    (`_WS_APPLIED`)."""
    G: tl.constexpr = BLOCK_N // 16
    C: tl.constexpr = 32 if LEAN else 16
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
    rows = tl.num_programs(1) * S_CTX
    nblk = S_CTX // BLOCK_N
    dq = tl.make_tensor_descriptor(Q, shape=[rows, BLOCK_D], strides=[BLOCK_D, 1], block_shape=[BLOCK_M, BLOCK_D])
    dk = tl.make_tensor_descriptor(K, shape=[rows, BLOCK_D], strides=[BLOCK_D, 1], block_shape=[BLOCK_N, BLOCK_D])
    dv = tl.make_tensor_descriptor(V, shape=[rows, BLOCK_D], strides=[BLOCK_D, 1], block_shape=[BLOCK_N, BLOCK_D])
    dkc = tl.make_tensor_descriptor(KC, shape=[rows // BLOCK_N * 16, BLOCK_D], strides=[BLOCK_D, 1],
                                    block_shape=[16, BLOCK_D])
    dvc = tl.make_tensor_descriptor(VC, shape=[rows // BLOCK_N * C, BLOCK_N], strides=[BLOCK_N, 1],
                                    block_shape=[C, BLOCK_N])
    do = tl.make_tensor_descriptor(O, shape=[rows, BLOCK_D], strides=[BLOCK_D, 1], block_shape=[BLOCK_M, BLOCK_D])
    row0 = bh * S_CTX
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_j = tl.arange(0, BLOCK_N)
    q = dq.load([row0 + start_m * BLOCK_M, 0])
    m_i = tl.full((BLOCK_M,), -float("inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    worst1 = tl.full((BLOCK_M, 16), -float("inf"), tl.float32)
    worst4 = tl.full((BLOCK_M, 16), -float("inf"), tl.float32)
    oc = tl.zeros((BLOCK_M, C), tl.float32)
    qn1 = tl.sum(tl.abs(q.to(tl.float32)), axis=1) * tol1
    hi = tl.minimum((start_m + 1) * BLOCK_M, S_CTX) if CAUSAL else S_CTX
    for start_n in tl.range(0, hi, BLOCK_N, warp_specialize=WS):
        offs_n = start_n + offs_j
        blk = bh * nblk + start_n // BLOCK_N
        k = dk.load([row0 + start_n, 0])
        s = tl.dot(q, k.T)
        if LEVEL >= 1:
            sc1 = tl.dot(q, dkc.load([blk * 16, 0]).T)
            d1 = sc1 - tl.sum(tl.reshape(s, (BLOCK_M, G, 16)), axis=1)
            worst1 = tl.maximum(worst1, tl.fma(-qn1[:, None], tl.load(KA + blk), tl.abs(d1)))
        if CAUSAL and start_n + BLOCK_N > start_m * BLOCK_M:  # the causal diagonal block
            s = tl.where(offs_m[:, None] >= offs_n[None, :], s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk2)
        y = tl.fma(s, qk2, -m_new[:, None])
        p = _exp(y, INTERP, True)
        if LEVEL >= 2:
            lp = _log2_prod(tl.reshape(tl.maximum(p, _P_MIN), (BLOCK_M, G, 16)), INTERP)
            xs = tl.sum(tl.reshape(tl.maximum(y, _Y_MIN), (BLOCK_M, G, 16)), axis=1)
            worst4 = tl.maximum(worst4, tl.abs(lp - xs) - 1e-4 * tl.abs(xs))
        alpha = _exp(m_i - m_new, INTERP, True)
        if not LEAN:
            l_i = l_i * alpha + tl.sum(p, axis=1)
        v = dv.load([row0 + start_n, 0])
        pd = p.to(v.dtype)
        acc = tl.dot(pd, v, acc * alpha[:, None])
        if LEVEL >= 3:
            oc = tl.dot(pd, dvc.load([blk * C, 0]).T, oc * alpha[:, None])
        m_i = m_new
    l_i, flag = _verdict(worst1, worst4, oc, acc, l_i, hi, tol3, vcmax, G, LEVEL, LEAN)
    do.store([row0 + start_m * BLOCK_M, 0], (acc / l_i[:, None]).to(do.dtype))
    tl.store(Flags + bh * S_CTX + offs_m, flag)


def tables(k: torch.Tensor, v: torch.Tensor, block_n: int):
    """Checksum operands (PyTorch, outside the timing), K-major: KC (B·H·S/block_n, 16, D) Kc1 of each key
    block in k's dtype, KA (B·H·S/block_n,) fp32 max |Kc1| per block, VC (B·H·S/block_n, 16, block_n)
    Vc1[n, r] = Σ_l V[n, l·16 + r] of each key block, max |Vc1|, and VC32 (B·H·S/block_n, 32, block_n):
    VC with a ones column (row 16 of each block's K-major table; rows 17–31 zero) for the lean row sum."""
    BH, S, D = k.shape
    G = block_n // 16
    kc = k.float().view(BH, S // block_n, G, 16, D).sum(2)  # (BH, nblk, 16, D)
    ka = kc.abs().amax(dim=(2, 3)).reshape(-1).contiguous()
    kc = kc.reshape(-1, 16, D).to(k.dtype).contiguous()
    vc = v.float().view(BH, S, D // 16, 16).sum(2)  # (BH, S, 16)
    vcmax = vc.abs().max().item()
    vc = vc.view(BH, S // block_n, block_n, 16).transpose(2, 3).reshape(-1, 16, block_n).to(v.dtype)
    vc32 = torch.zeros(vc.shape[0], 32, block_n, dtype=v.dtype, device=v.device)
    vc32[:, :16] = vc
    vc32[:, 16] = 1.0
    return kc, ka, vc.contiguous(), vcmax, vc32


_WS_APPLIED: dict = {}  # (variant, config) -> whether the compiled TTGIR holds a warp_specialize op


def floor_attention(q, k, v, scale, causal, variant: Floor, cfg, tabs, flags):
    """q, k, v (B·H, S, D) contiguous, S a multiple of the block sizes; returns (B·H, S, D)."""
    BM, BN, warps, stages = cfg
    BH, S, D = q.shape
    kc, ka, vc16, vcmax, vc32 = tabs[BN]
    vc = vc32 if variant.lean else vc16
    o = torch.empty_like(q)
    interp = runs_interpreted(_floor_kernel)
    if variant.gluon:
        if interp:
            raise RuntimeError("the Gluon floor needs a Hopper GPU (no interpreter)")
        from efta_gluon_floor import gluon_attention
        return gluon_attention(q, k, v, scale, causal, variant.level, variant.pipe, cfg, kc, ka, vc32, vcmax, flags,
                               variant.lazy, variant.one_clamp)
    # thresholds of single-slice checksum operands: Kc1 / Vc1 rounded to the input dtype
    u = 2.0 ** -8 if q.dtype == torch.bfloat16 else 2.0 ** -11
    if variant.tma:
        assert not (variant.unified or variant.overlap), "the TMA floor has levels 0-3 and LEAN only"
        _tma_allocator()  # the library's: scratch for on-device descriptors
        h = _floor_ws_kernel[(S // BM, BH)](q, k, v, kc, ka, vc, o, flags, S, scale * LOG2E, 4 * u, 64 * u, vcmax,
                                            BLOCK_M=BM, BLOCK_N=BN, BLOCK_D=D, CAUSAL=causal, LEVEL=variant.level,
                                            LEAN=variant.lean, WS=variant.ws, INTERP=interp, num_warps=warps,
                                            num_stages=stages)
        if not interp:
            _WS_APPLIED[(variant, cfg)] = "ttg.warp_specialize" in h.asm.get("ttgir", "")
        return o
    _floor_kernel[(S // BM, BH)](q, k, v, kc, ka, vc, o, flags, S, scale * LOG2E, 4 * u, 64 * u, vcmax,
                                 BLOCK_M=BM, BLOCK_N=BN, BLOCK_D=D, CAUSAL=causal, LEVEL=variant.level,
                                 UNIFIED=variant.unified, LEAN=variant.lean, OVERLAP=variant.overlap, INTERP=interp,
                                 num_warps=warps, num_stages=stages)
    return o


def _fastest(make, cfgs, timer, tune: bool, row: dict):
    """The fastest of ``cfgs`` for one variant, each timed once with ``timer`` on ``make(cfg)``; without
    tuning (or timing) the first that runs. A config that does not compile or fit is skipped, its error
    kept in ``row``; the winner goes into ``row["config"]``. Returns it, or None when none runs."""
    best = None
    for cfg in cfgs if timer is not None else cfgs[:1]:
        try:
            t = timer(make(cfg)) if timer is not None and tune else 0.0
        except Exception as exc:  # noqa: BLE001 - out of resources: try the next config
            row["error"] = f"{cfg}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
            continue
        if best is None or t < best[0]:
            best = (t, cfg)
        if not tune:
            break
    if best is None:
        return None
    row["config"], row["error"] = ",".join(map(str, best[1])), ""
    return best[1]


def run_shape(B, H, S, D, causal, dtype, args, timer, device):
    import torch.nn.functional as F
    from ft_transformers.kernels import efta as K
    from ft_transformers.kernels.options import override
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ft_transformers.counters import new_counters
    from ft_transformers.injection import FaultPlan

    g = torch.Generator(device=device).manual_seed(S * 31 + D)
    q, k, v = (torch.randn(B, H, S, D, device=device, dtype=dtype, generator=g) for _ in range(3))
    scale = 1.0 / math.sqrt(D)
    q3, k3, v3 = (t.reshape(B * H, S, D) for t in (q, k, v))
    tabs = {bn: tables(k3, v3, bn) for bn in sorted({c[1] for c in CONFIGS + CONFIGS_GL + CONFIGS_WS})}
    with sdpa_kernel(SDPBackend.MATH):
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal, scale=scale)
    plan = FaultPlan(None)
    fns, rows = {}, {}
    for name in args.variants:
        row = dict(dtype=str(dtype).replace("torch.", ""), B=B, H=H, S=S, D=D, causal=causal, variant=name,
                   config="", warp_specialized="", ms=float("nan"), max_abs_err=float("nan"), flagged_rows=0,
                   flagged_k_fault=-1, flagged_v_fault=-1, error="")
        try:
            if name == "sdpa_flash":
                def fn():
                    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
            elif name in LIBRARY:
                counters = new_counters(device)
                on, tma, cfgs = LIBRARY[name]
                row["_counters"] = counters

                def fn(on=on, tma=tma, counters=counters, cfg=None):
                    with override(efta_tma=tma, efta_config=cfg):
                        return K.efta_triton_forward(q, k, v, scale=scale, causal=causal, bias=None, attn_mask=None,
                                                     window=None, detect=on, correct=on, plan=plan, counters=counters)
                if cfgs is not None:
                    cfg = _fastest(lambda c, fn=fn: partial(fn, cfg=c), cfgs, timer, args.tune, row)
                    if cfg is None:
                        rows[name] = row
                        continue
                    fn = partial(fn, cfg=cfg)
            else:
                variant = LEVELS[name]
                flags = torch.zeros(B * H * S, dtype=torch.int32, device=device)
                cfgs = [c for c in (CONFIGS_GL if variant.gluon else CONFIGS_WS if variant.tma else CONFIGS)
                        if not (S % c[0] or S % c[1])]
                cfg = _fastest(lambda c, variant=variant, flags=flags: partial(
                    floor_attention, q3, k3, v3, scale, causal, variant, c, tabs, flags), cfgs, timer, args.tune, row)
                if cfg is None:
                    rows[name] = row
                    continue
                if (variant, cfg) in _WS_APPLIED:
                    row["warp_specialized"] = _WS_APPLIED[(variant, cfg)]
                fn = partial(floor_attention, q3, k3, v3, scale, causal, variant, cfg, tabs, flags)
                row["_flags"] = flags
            out = fn().reshape(B, H, S, D)
            row["max_abs_err"] = (out.float() - ref).abs().max().item()
            if name in LEVELS and LEVELS[name].level >= 1:
                # the checks are live: one key (value) changed after the tables were built stands for a
                # fault in GEMM I (GEMM II); count the rows flagged
                for col, which in (("flagged_k_fault", 1), ("flagged_v_fault", 2)):
                    qkv = [q3, k3, v3]
                    qkv[which] = qkv[which].clone()
                    qkv[which][:, 5] += 4.0
                    flags.zero_()
                    floor_attention(*qkv, scale, causal, variant, cfg, tabs, flags)
                    row[col] = int((flags != 0).sum().item())
                flags.zero_()
            fns[name] = fn
        except Exception as exc:  # noqa: BLE001 - report and go on
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        rows[name] = row
    if timer is None:  # dry run: outputs and flags only
        times = {n: [float("nan")] for n in fns}
    else:
        times = interleaved(fns, args.rounds, timer)
    for name, row in rows.items():
        if name in times:
            row["ms"] = statistics.median(times[name])
        for col, basis in (("x_vs_floor0", "floor0"), ("x_vs_ours_off", "ours_off"), ("x_vs_sdpa", "sdpa_flash"),
                           ("x_vs_efta_correct", "efta_correct")):
            row[col] = (statistics.median(t / tb for t, tb in zip(times[name], times[basis], strict=True))
                        if name in times and basis in times and timer is not None else float("nan"))
        if "_flags" in row:
            row["flagged_rows"] = int((row.pop("_flags") != 0).sum().item())
        if "_counters" in row:  # the library's events over every timed call (0 on these clean inputs)
            row["flagged_rows"] = int(row.pop("_counters").sum().item())
    return list(rows.values())


def plot(csv_paths: list[str], png_path: str) -> None:
    """Bars of each variant's time over SDPA flash's (same round, median) per shape, one panel per CSV
    (over floor0's in a CSV without SDPA flash's times)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(csv_paths), 1, figsize=(12, 3.6 * len(csv_paths)), squeeze=False)
    for ax, path in zip(axes[:, 0], csv_paths, strict=True):
        with open(path, newline="") as fh:
            every = list(csv.DictReader(fh))
        col, basis = "x_vs_sdpa", "sdpa_flash"
        if not any(r["x_vs_sdpa"] not in ("", "nan") for r in every):
            col, basis = "x_vs_floor0", "floor0"
        rows = [r for r in every if r[col] not in ("", "nan") and r["variant"] != basis]
        if not rows:
            raise SystemExit(f"{path}: no timed rows to plot (a --dry-run CSV has no times)")
        shapes = list(dict.fromkeys((r["B"], r["H"], r["S"], r["D"], r["causal"]) for r in rows))
        names = list(dict.fromkeys(r["variant"] for r in rows))
        grouped_bars(ax, shapes, {name: {(r["B"], r["H"], r["S"], r["D"], r["causal"]): float(r[col]) for r in rows
                                         if r["variant"] == name} for name in names})
        ax.set_xticklabels([f"{b}x{h}x{s}, D={d}{', causal' if c == 'True' else ''}" for b, h, s, d, c in shapes],
                           fontsize=8, rotation=20, ha="right")
        ax.set_ylabel(f"time / {basis}")
        ax.set_title(os.path.basename(path), fontsize=9)
        ax.legend(fontsize=7, ncol=min(len(names), 6))
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    print("wrote", png_path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_floor")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtypes", default="float16")
    ap.add_argument("--hd", default="16x64,32x128", help="(heads)x(head dim) settings, comma-separated")
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                    help=f"comma-separated, of {', '.join(VARIANTS)} (floor0 and ours_off are always timed: the "
                         "ratios' bases)")
    ap.add_argument("--configs", default=None,
                    help="BM,BN,warps,stages;... : the configs every floor variant is tuned over (default: CONFIGS, "
                         "CONFIGS_WS for the TMA floors)")
    ap.add_argument("--no-tune", dest="tune", action="store_false", help="first config of CONFIGS only")
    ap.add_argument("--plot-from", nargs="+", default=None, metavar="CSV",
                    help="only draw <out>/bench_efta_floor.png from these CSVs (one panel each)")
    ap.add_argument("--dry-run", action="store_true", help="two tiny shapes, outputs and flags only (CPU ok)")
    args = ap.parse_args()
    names = [n for n in args.variants.split(",") if n]
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        ap.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    args.variants = [n for n in VARIANTS if n in {*names, "floor0", "ours_off"}]
    os.makedirs(args.out, exist_ok=True)
    if args.plot_from:
        plot(args.plot_from, os.path.join(args.out, "bench_efta_floor.png"))
        return 0
    global CONFIGS, CONFIGS_WS
    if args.configs:
        try:
            CONFIGS = CONFIGS_WS = [tuple(int(x) for x in c.split(",")) for c in args.configs.split(";") if c]
        except ValueError:
            ap.error(f"--configs must be 'BM,BN,warps,stages;...', got {args.configs!r}")
        if not CONFIGS or any(len(c) != 4 for c in CONFIGS):
            ap.error(f"--configs must be 'BM,BN,warps,stages;...', got {args.configs!r}")
    if args.dry_run:
        device, timer = ("cuda" if torch.cuda.is_available() else "cpu"), None
        shapes = [(1, 2, 256, 64, False), (1, 2, 256, 32, True)]
        CONFIGS = CONFIGS_WS = [(64, 64, 4, 1)]
    else:
        from triton.testing import do_bench
        device, timer = "cuda", partial(do_bench, warmup=25, rep=100)
        hds = [tuple(map(int, x.split("x"))) for x in args.hd.split(",")]
        shapes = [(16384 // S, H, S, D, c) for H, D in hds for S in (1024, 4096) for c in (False, True)]
        shapes += [(1, H, 16384, D, False) for H, D in hds]
    rows = []
    for dt in args.dtypes.split(","):
        for B, H, S, D, causal in shapes:
            got = run_shape(B, H, S, D, causal, getattr(torch, dt), args, timer, device)
            rows += got
            for r in got:
                print(f"{r['dtype']} B={B} H={H} S={S} D={D} causal={causal!s:5} {r['variant']:12s} "
                      f"{r['ms']:8.3f} ms  x_floor0 {r['x_vs_floor0']:.3f}  x_ours_off {r['x_vs_ours_off']:.3f}  "
                      f"x_sdpa {r['x_vs_sdpa']:.3f}  x_correct {r['x_vs_efta_correct']:.3f}  "
                      f"err {r['max_abs_err']:.2e}  flagged {r['flagged_rows']} (K fault {r['flagged_k_fault']}, "
                      f"V fault {r['flagged_v_fault']})  {r['config']} {'WS' if r['warp_specialized'] is True else ''} "
                      f"{r['error']}",
                      flush=True)
    write_rows(os.path.join(args.out, "bench_efta_floor.csv"), rows)
    if not args.dry_run:
        print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
