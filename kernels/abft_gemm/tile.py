"""The tiled checked GEMM (`_gemm_kernel`): a grouped-order grid over (BLOCK_M × BLOCK_N) output tiles.

Each tile: an fp32 accumulator (tensor cores for fp16/bf16, IEEE fp32 FMAs for fp32), bias added in
fp32, rounded to y's dtype, flips of site ``linear.output`` applied to the *rounded* value (so bit
positions mean what they mean on the reference path), y stored. With DETECT the epilogue also sums each
64-column group of the tile's rows (``Σ_{n∈g} v[m, n]``, v = acc, or the flipped rounded value where a
flip landed; the rounded outputs in ``output`` mode) into ``P`` (T_g, M): a masked sum per group, no
atomics, a fixed summation order. Everything else of the check (x's statistics, the group checksums,
the comparison and any repair) is `groups._group_verify_kernel`'s, a launch after this one, so the K
loop is the plain GEMM's. Operands come through TMA tensor descriptors on Hopper when their layout
allows, through pointers otherwise.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..tl_common import dot as _mma
from .checksum_tiles import checksum_program, checksum_tile
from .common import _grouped_tile, k_blocks, round_and_inject

G: tl.constexpr = tl.constexpr(64)  # = gemm_checksums.GROUP_COLS; BLOCK_N is a multiple of it with DETECT


@triton.jit
def _gemm_tile(X, W, Y, Xd, Wd, Yd, Bias, P, Inj, Part, Tcnt, pid_m, pid_n, split, kb_per, num_pid_m, offs_m,
               offs_am, m_ok, M, N, K, sxm, sxk, swn, swk, sym, syn, n_split,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               HAS_BIAS: tl.constexpr, DETECT: tl.constexpr, VERIFY_OUTPUT: tl.constexpr,
               INJ: tl.constexpr, DOT_F32: tl.constexpr, EVEN_K: tl.constexpr,
               TMA: tl.constexpr, W_KN: tl.constexpr, TMA_STORE: tl.constexpr, SPLIT: tl.constexpr):
    """One (BLOCK_M, BLOCK_N) tile: fp32 GEMM + bias, rounding, injection, group sums (DETECT), store.

    TMA: operands are loaded (and, with TMA_STORE, y stored) through tensor descriptors ``Xd`` (M, K),
    ``Wd`` ((N, K), or (K, N) when W_KN) and ``Yd`` (M, N), whose out-of-bounds rows/columns read as zero
    and are not written; otherwise through the pointers X, W, Y and strides.

    SPLIT (the plain GEMM of one row block whose few tiles would leave most SMs idle: split-K): this
    program is split ``split`` of ``n_split`` over the tile's K blocks ``[split·kb_per, (split+1)·kb_per)``.
    It stores its fp32 partial tile in ``Part`` (n_split, M, N) and counts on the tile's cell
    ``Tcnt[pid_n]``; the last of the tile's splits to count resets the cell, sums the n_split partials in
    split order (the same fp32 sum whichever program finishes last) and runs the epilogue on that sum."""
    offs_k = tl.arange(0, BLOCK_K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_bn = offs_n % N
    kb0, kb1 = k_blocks(split, kb_per, K, BLOCK_K, SPLIT)
    a_ptrs = X + offs_am[:, None] * sxm + (kb0 * BLOCK_K + offs_k)[None, :] * sxk
    b_ptrs = W + (kb0 * BLOCK_K + offs_k)[:, None] * swk + offs_bn[None, :] * swn
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
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
            _tile_epilogue(acc, Y, Yd, Bias, P, Inj, pid_m, pid_n, num_pid_m, offs_m, offs_n, n_ok, m_ok, M, N,
                           sym, syn, HAS_BIAS, DETECT, VERIFY_OUTPUT, INJ, TMA_STORE)
    else:
        _tile_epilogue(acc, Y, Yd, Bias, P, Inj, pid_m, pid_n, num_pid_m, offs_m, offs_n, n_ok, m_ok, M, N,
                       sym, syn, HAS_BIAS, DETECT, VERIFY_OUTPUT, INJ, TMA_STORE)


@triton.jit
def _tile_epilogue(acc, Y, Yd, Bias, P, Inj, pid_m, pid_n, num_pid_m, offs_m, offs_n, n_ok, m_ok, M, N, sym, syn,
                   HAS_BIAS: tl.constexpr, DETECT: tl.constexpr, VERIFY_OUTPUT: tl.constexpr, INJ: tl.constexpr,
                   TMA_STORE: tl.constexpr):
    """A tile's fp32 sum ``acc`` (BLOCK_M, BLOCK_N) out: bias, rounding, injection, the group sums into
    ``P`` (T_g, M) (DETECT), y's store."""
    BLOCK_M: tl.constexpr = acc.shape[0]
    BLOCK_N: tl.constexpr = acc.shape[1]
    if HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    # flips at site linear.output, on the rounded value
    yv, v = round_and_inject(acc, Y.dtype.element_ty, Inj, pid_m, num_pid_m, offs_m, offs_n, n_ok, INJ, VERIFY_OUTPUT)
    if DETECT:
        group_sums(v, P, pid_n, offs_m, m_ok, M, N)
    if TMA_STORE:
        Yd.store([pid_m * BLOCK_M, pid_n * BLOCK_N], yv)
    else:
        tl.store(Y + offs_m[:, None] * sym + offs_n[None, :] * syn, yv, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def group_sums(v, P, pid_n, offs_m, m_ok, M, N):
    """Store the 64-column group sums of the tile ``v`` (BLOCK_M, BLOCK_N; 0 past N) of column tile
    ``pid_n`` into ``P`` (T_g, M): one masked row sum per group (BLOCK_N / 64 of them)."""
    BLOCK_N: tl.constexpr = v.shape[1]
    GPT: tl.constexpr = BLOCK_N // G
    grp = tl.arange(0, BLOCK_N) // G
    for j in tl.static_range(GPT):
        gidx = pid_n * GPT + j
        tl.store(P + gidx * M + offs_m, tl.sum(tl.where(grp[None, :] == j, v, 0.0), axis=1),
                 mask=tl.where(gidx * G < N, m_ok, False))  # (tl.where: the interpreter mis-types bool & scalar)


@triton.jit
def _gemm_kernel(X, W, Y, Xd, Wd, Yd, Bias, P, Inj, Sem, Wc, M, N, K, NC, sxm, sxk, swn, swk, sym, syn, n_split,
                 kb_per, c_split, c_kb_per, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, DETECT: tl.constexpr,
                 VERIFY_OUTPUT: tl.constexpr, INJ: tl.constexpr, DOT_F32: tl.constexpr,
                 EVEN_K: tl.constexpr, TMA: tl.constexpr, W_KN: tl.constexpr, TMA_STORE: tl.constexpr,
                 SPLIT: tl.constexpr, FUSED: tl.constexpr, CN: tl.constexpr, XVAR: tl.constexpr):
    """y (M, N) = x (M, K) · Wᵀ + b over a grouped-order grid of output tiles; with DETECT the group sums
    into ``P`` (T_g, M) for `groups._group_verify_kernel`.

    FUSED (with DETECT): the grid's first ⌈M / BLOCK_M⌉ · ⌈NC / CN⌉ · ``c_split`` programs compute the group
    checksums and x's row statistics (`checksum_tiles.checksum_tile`, ``Wc`` (NC, K) the checksum operand, each
    over ``c_kb_per`` K blocks) into ``P`` after the group sums: C (c_split, M, NC), then the statistics
    (c_split, M, 4). First, since they are short: they share the first wave with y's tiles instead of adding one.

    SPLIT (the plain GEMM of one row block and few tiles, `forms.split_plan`): each tile runs as ``n_split``
    programs over ``kb_per`` K blocks each (split-K; see `_gemm_tile`), program ``pid`` being split
    ``pid % n_split`` of tile ``pid // n_split``, the partial tiles in ``P`` (n_split, M, N) and the tiles'
    split counts in the cells ``Sem[pid_n]`` (`calls._cells`, 0 between calls)."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    if FUSED:
        num_c = tl.cdiv(NC, CN)
        n_cprog = num_pid_m * num_c * c_split
        if pid < n_cprog:
            cm, cc, cs = checksum_program(pid, num_c, c_split)
            Cb = P + tl.cdiv(N, G) * M
            checksum_tile(X, Wc, Cb, Cb + c_split * M * NC, cm, cc, cs, c_kb_per, M, K, NC, sxm, sxk,
                          BLOCK_M, CN, BLOCK_K, EVEN_K, DOT_F32, XVAR)
        else:
            pid_m, pid_n = _grouped_tile(pid - n_cprog, num_pid_m, num_pid_n, GROUP)
            _gemm_program(X, W, Y, Xd, Wd, Yd, Bias, P, Inj, Sem, pid_m, pid_n, 0, kb_per, num_pid_m, M, N, K,
                          sxm, sxk, swn, swk, sym, syn, n_split, BLOCK_M, BLOCK_N, BLOCK_K, HAS_BIAS, DETECT,
                          VERIFY_OUTPUT, INJ, DOT_F32, EVEN_K, TMA, W_KN, TMA_STORE, SPLIT)
    else:
        if SPLIT:  # one row block, tiles of n_split programs
            pid_m = 0
            pid_n = pid // n_split
            split = pid % n_split
        else:
            split = 0
            pid_m, pid_n = _grouped_tile(pid, num_pid_m, num_pid_n, GROUP)
        _gemm_program(X, W, Y, Xd, Wd, Yd, Bias, P, Inj, Sem, pid_m, pid_n, split, kb_per, num_pid_m, M, N, K,
                      sxm, sxk, swn, swk, sym, syn, n_split, BLOCK_M, BLOCK_N, BLOCK_K, HAS_BIAS, DETECT,
                      VERIFY_OUTPUT, INJ, DOT_F32, EVEN_K, TMA, W_KN, TMA_STORE, SPLIT)


@triton.jit
def _gemm_program(X, W, Y, Xd, Wd, Yd, Bias, P, Inj, Sem, pid_m, pid_n, split, kb_per, num_pid_m, M, N, K,
                  sxm, sxk, swn, swk, sym, syn, n_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, DETECT: tl.constexpr, VERIFY_OUTPUT: tl.constexpr,
                  INJ: tl.constexpr, DOT_F32: tl.constexpr, EVEN_K: tl.constexpr, TMA: tl.constexpr,
                  W_KN: tl.constexpr, TMA_STORE: tl.constexpr, SPLIT: tl.constexpr):
    """Tile (``pid_m``, ``pid_n``) of y, split ``split`` (`_gemm_tile`), with its rows' offsets."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    offs_am = offs_m % M  # wrapped rows: in-bounds loads without a mask, never stored
    _gemm_tile(X, W, Y, Xd, Wd, Yd, Bias, P, Inj, P, Sem, pid_m, pid_n, split, kb_per, num_pid_m, offs_m,
               offs_am, m_ok, M, N, K, sxm, sxk, swn, swk, sym, syn, n_split, BLOCK_M, BLOCK_N, BLOCK_K, HAS_BIAS,
               DETECT, VERIFY_OUTPUT, INJ, DOT_F32, EVEN_K, TMA, W_KN, TMA_STORE, SPLIT)
