"""The device code of `bench_gemm_gluon.py`: a Gluon GEMM y = x·Wᵀ with its column-group check at four
levels (0 plain; 1 the group checksums as a second MMA, stored; 2 and the check in the epilogue; 3 the
checksum merged into the product's MMA through W'), in two forms (`gemm_kernel`: one program per tile;
`persistent_kernel`: one per SM, y out by TMA). The host side, the operands and the levels' meaning are in
`bench_gemm_gluon.py`'s docstring.

Shapes: x (M, K), W (N, K) (W' (T·BLOCK_N, K) at level 3), y (M, N), x's dtype, fp32 accumulation; XS (M, 2)
x's row mean and variance estimate, GC (T_g, 8) the groups' threshold constants (`_threshold`).
"""

from __future__ import annotations

import os
import sys

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _gluon import tma_load as _tma_load  # noqa: E402
from _gluon import tma_store as _tma_store  # noqa: E402

__all__ = ["CROWS", "gemm_kernel", "persistent_kernel"]

CROWS = 16  # checksum rows per tile at levels 1, 2 (2 slices × BLOCK_N / 64 groups, padded)


@gluon.jit
def _load(x_desc, w_desc, c_desc, x_s, w_s, c_s, bars, ki, m0, n0, tile_n, BLOCK_K: gl.constexpr,
          STAGES: gl.constexpr, LEVEL: gl.constexpr, slot):
    """Request K step ``ki``'s tiles of x, W (W' at level 3; and Wc at levels 1, 2) into ``slot``."""
    bar = bars.index(slot)
    nbytes: gl.constexpr = x_desc.block_type.nbytes + w_desc.block_type.nbytes
    if (LEVEL == 1) or (LEVEL == 2):
        mbarrier.expect(bar, nbytes + c_desc.block_type.nbytes)
        _tma_load(c_desc, [tile_n * 16, ki * BLOCK_K], bar, c_s.index(slot))
    else:
        mbarrier.expect(bar, nbytes)
    _tma_load(x_desc, [m0, ki * BLOCK_K], bar, x_s.index(slot))
    _tma_load(w_desc, [n0, ki * BLOCK_K], bar, w_s.index(slot))


@gluon.jit
def _threshold(XS, GC, rows, grp, M, emax, csig):
    """SPEC §5's threshold of every (row, group) as the library's epilogues compute it
    (`gemm_checksums.group_threshold`): XS (M, 2) x's row mean and variance estimate, GC (T_g, 8) the groups'
    constants with the variance terms scaled to e_var (`scale_variance_terms`); rows (R,), grp (G,) in
    slices of one 2-D layout. Returns (R, G) fp32."""
    r_ok = rows < M
    mu = gl.load(XS + rows * 2, mask=r_ok, other=0.0)[:, None]
    var = gl.load(XS + rows * 2 + 1, mask=r_ok, other=0.0)[:, None]
    c1 = gl.load(GC + grp * 8 + 1)[None, :]
    c2 = gl.load(GC + grp * 8 + 2)[None, :]
    c3 = gl.load(GC + grp * 8 + 3)[None, :]
    c4 = gl.load(GC + grp * 8 + 4)[None, :]
    c5 = gl.load(GC + grp * 8 + 5)[None, :]
    c6 = gl.load(GC + grp * 8 + 6)[None, :]
    return emax * (c1 * gl.abs(mu) + csig * gl.sqrt(mu * mu * c2 + var * c3) + csig * c4 * gl.sqrt(var) + c5
                   + csig * c6)


@gluon.jit
def _check(acc, cacc, XS, GC, Bad, m0, pid_n, M, emax, csig, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
           num_warps: gl.constexpr):
    """The epilogue check of one (BLOCK_M, BLOCK_N) tile: acc its fp32 product, cacc (BLOCK_M, 16) x·Wcᵀ (the
    hi and lo slices of each of its G = BLOCK_N / 64 groups' checksums, zero padded); failing (row, group)
    pairs are added to Bad with one atomic."""
    G: gl.constexpr = BLOCK_N // 64
    gs = gl.sum(gl.reshape(acc, [BLOCK_M, G, 64]), axis=2)  # (BLOCK_M, G)
    cs = gl.sum(gl.reshape(cacc, [BLOCK_M, 8, 2]), axis=2)  # hi + lo per group (first G of 8)
    cs = gl.convert_layout(cs, gl.BlockedLayout([1, 8], [32, 1], [num_warps, 1], [1, 0]))
    gs = gl.convert_layout(gs, gl.BlockedLayout([1, G], [32, 1], [num_warps, 1], [1, 0]))
    rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, gs.type.layout))
    grp = pid_n * G + gl.arange(0, G, layout=gl.SliceLayout(0, gs.type.layout))
    # the tile's G groups are cs's first G entries, the rest zero padding: folding 8 into (8 / G, G) and
    # summing the first axis leaves group g at g
    c_g = gl.sum(gl.reshape(cs, [BLOCK_M, 8 // G, G]), axis=1) if G < 8 else cs
    c_g = gl.convert_layout(c_g, gs.type.layout)
    bad = ~(gl.abs(gs - c_g) <= _threshold(XS, GC, rows, grp, M, emax, csig)) & (rows < M)[:, None]
    gl.atomic_add(Bad, gl.sum(gl.sum(bad.to(gl.int32), axis=1), axis=0))


@gluon.jit
def _keep(cacc, CS, m0, pid_n, M, stride, BLOCK_M: gl.constexpr):
    """Level 1's use of the checksum product, so that it is not compiled away: cacc (BLOCK_M, 16) into CS
    (M, T·16) fp32 (row ``stride`` = T·16), as a consumer that verifies y would read it."""
    r = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, cacc.type.layout))
    c = gl.arange(0, 16, layout=gl.SliceLayout(0, cacc.type.layout))
    gl.store(CS + r[:, None].to(gl.int64) * stride + pid_n * 16 + c[None, :], cacc,
             mask=(r < M)[:, None])


@gluon.jit
def gemm_kernel(x_desc, w_desc, c_desc, Y, CS, XS, GC, Bad, M, N, K, emax, csig,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                 LEVEL: gl.constexpr, EVEN_M: gl.constexpr, num_warps: gl.constexpr):
    """Form "tile": one program per (BLOCK_M, BLOCK_N) tile (pid_m, pid_n) of y (M, N) (row-major, x's
    dtype), stored from the accumulator's registers. Wc (N / BLOCK_N · 16, K): tile t's rows 2g, 2g + 1 are
    group g's hi and lo slices; XS (M, 2), GC (T_g, 8) and emax, csig the threshold's (`_threshold`); Bad (1,)
    int32: failing (row, group) pairs. EVEN_M: BLOCK_M divides M (y's stores need no row mask, hence no
    branch per store)."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    c_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, 16, 16])
    dtype: gl.constexpr = x_desc.dtype
    pid_m = gl.program_id(0)
    pid_n = gl.program_id(1)
    m0 = pid_m * BLOCK_M
    n0 = pid_n * BLOCK_N
    num_k = gl.cdiv(K, BLOCK_K)

    x_s = gl.allocate_shared_memory(dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
    w_s = gl.allocate_shared_memory(dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    c_s = gl.allocate_shared_memory(dtype, [STAGES] + c_desc.block_type.shape, c_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    for i in gl.static_range(STAGES - 1):
        if i < num_k:
            _load(x_desc, w_desc, c_desc, x_s, w_s, c_s, bars, i, m0, n0, pid_n, BLOCK_K, STAGES, LEVEL, i)

    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
    cacc = gl.zeros([BLOCK_M, 16], gl.float32, c_layout)
    SEP: gl.constexpr = (LEVEL == 1) or (LEVEL == 2)  # the checksum as a second MMA
    NG: gl.constexpr = 2 if SEP else 1  # wgmma groups per K step
    for ki in range(num_k):
        slot = ki % STAGES
        mbarrier.wait(bars.index(slot), (ki // STAGES) & 1)
        acc = warpgroup_mma(x_s.index(slot), w_s.index(slot).permute((1, 0)), acc, is_async=True)
        if SEP:
            cacc = warpgroup_mma(x_s.index(slot), c_s.index(slot).permute((1, 0)), cacc, is_async=True)
        # this step's MMAs stay in flight; the previous step's are done, so its slot takes step ki + STAGES - 1
        acc, cacc = warpgroup_mma_wait(NG, deps=(acc, cacc))
        if ki + STAGES - 1 < num_k:
            _load(x_desc, w_desc, c_desc, x_s, w_s, c_s, bars, ki + STAGES - 1, m0, n0, pid_n, BLOCK_K, STAGES, LEVEL,
                  (ki + STAGES - 1) % STAGES)
    acc, cacc = warpgroup_mma_wait(0, deps=(acc, cacc))
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))

    om = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
    col = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
    if LEVEL == 1:
        _keep(cacc, CS, m0, pid_n, M, N // BLOCK_N * 16, BLOCK_M)
    if LEVEL == 2:
        _check(acc, cacc, XS, GC, Bad, m0, pid_n, M, emax, csig, BLOCK_M, BLOCK_N, num_warps)
    if LEVEL == 3:
        # W' tile: chunk g of 64 columns = group g's 60 weight rows, then −hi_g, −lo_g and two zero rows, so
        # a chunk's sum is the group's residual Σ_{c∈g} y[r, c] − x_r·w1_g (the check without a second MMA)
        G: gl.constexpr = BLOCK_N // 64
        res = gl.sum(gl.reshape(acc, [BLOCK_M, G, 64]), axis=2)  # (BLOCK_M, G)
        rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, res.type.layout))
        grp = pid_n * G + gl.arange(0, G, layout=gl.SliceLayout(0, res.type.layout))
        bad = ~(gl.abs(res) <= _threshold(XS, GC, rows, grp, M, emax, csig)) & (rows < M)[:, None]
        gl.atomic_add(Bad, gl.sum(gl.sum(bad.to(gl.int32), axis=1), axis=0))
        on = pid_n * (G * 60) + (col // 64) * 60 + col % 64
        keep = ((col % 64) < 60) & (on < N)
        gl.store(Y + om[:, None].to(gl.int64) * N + on[None, :], acc.to(dtype),
                 mask=((om < M) | EVEN_M)[:, None] & keep[None, :])
    elif EVEN_M:
        gl.store(Y + om[:, None].to(gl.int64) * N + (n0 + col)[None, :], acc.to(dtype))
    else:
        gl.store(Y + om[:, None].to(gl.int64) * N + (n0 + col)[None, :], acc.to(dtype), mask=(om < M)[:, None])


@gluon.jit
def _tile_of(t, num_pid_m, num_pid_n, GROUP_M: gl.constexpr):
    """Tile index t → (pid_m, pid_n), GROUP_M row blocks at a time so that consecutive tiles share W's
    columns and x's rows in L2."""
    width = GROUP_M * num_pid_n
    first_m = (t // width) * GROUP_M
    size_m = gl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (t % width) % size_m, (t % width) // size_m


@gluon.jit
def _load_step(x_desc, w_desc, c_desc, x_s, w_s, c_s, bars, s, num_k, num_pid_m, num_pid_n,
               BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
               LEVEL: gl.constexpr, GROUP_M: gl.constexpr):
    """The persistent program's flat step s (its (s // num_k)-th tile, K step s % num_k) into slot s % STAGES."""
    pid_m, pid_n = _tile_of(gl.program_id(0) + (s // num_k) * gl.num_programs(0), num_pid_m, num_pid_n, GROUP_M)
    _load(x_desc, w_desc, c_desc, x_s, w_s, c_s, bars, s % num_k, pid_m * BLOCK_M, pid_n * BLOCK_N, pid_n, BLOCK_K,
          STAGES, LEVEL, s % STAGES)


@gluon.jit
def persistent_kernel(x_desc, w_desc, c_desc, y_desc, CS, XS, GC, Bad, M, N, K, emax, csig,
                       BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                       STAGES: gl.constexpr, LEVEL: gl.constexpr, GROUP_M: gl.constexpr, num_warps: gl.constexpr):
    """Form "persistent": one program per SM walks tiles pid, pid + P, … as one flat sequence of K steps, so
    the TMA ring already holds the next tile's first STAGES − 1 steps while a tile's epilogue runs; y goes out
    through shared memory with one TMA store per tile (cuBLAS's epilogue). Operands as `gemm_kernel`'s, y
    through its descriptor."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    c_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, 16, 16])
    dtype: gl.constexpr = x_desc.dtype
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = N // BLOCK_N
    num_k = gl.cdiv(K, BLOCK_K)
    my_tiles = gl.cdiv(num_pid_m * num_pid_n - gl.program_id(0), gl.num_programs(0))
    total = my_tiles * num_k

    x_s = gl.allocate_shared_memory(dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
    w_s = gl.allocate_shared_memory(dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    c_s = gl.allocate_shared_memory(dtype, [STAGES] + c_desc.block_type.shape, c_desc.layout)
    y_s = gl.allocate_shared_memory(dtype, y_desc.block_type.shape, y_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    for i in gl.static_range(STAGES - 1):
        if i < total:
            _load_step(x_desc, w_desc, c_desc, x_s, w_s, c_s, bars, i, num_k, num_pid_m, num_pid_n, BLOCK_M,
                       BLOCK_N, BLOCK_K, STAGES, LEVEL, GROUP_M)

    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
    cacc = gl.zeros([BLOCK_M, 16], gl.float32, c_layout)
    SEP: gl.constexpr = (LEVEL == 1) or (LEVEL == 2)
    NG: gl.constexpr = 2 if SEP else 1
    for s in range(total):
        slot = s % STAGES
        ki = s % num_k
        mbarrier.wait(bars.index(slot), (s // STAGES) & 1)
        acc = warpgroup_mma(x_s.index(slot), w_s.index(slot).permute((1, 0)), acc, use_acc=ki > 0, is_async=True)
        if SEP:
            cacc = warpgroup_mma(x_s.index(slot), c_s.index(slot).permute((1, 0)), cacc, use_acc=ki > 0,
                                 is_async=True)
        acc, cacc = warpgroup_mma_wait(NG, deps=(acc, cacc))
        if s + STAGES - 1 < total:
            _load_step(x_desc, w_desc, c_desc, x_s, w_s, c_s, bars, s + STAGES - 1, num_k, num_pid_m, num_pid_n,
                       BLOCK_M, BLOCK_N, BLOCK_K, STAGES, LEVEL, GROUP_M)
        if ki == num_k - 1:  # the tile's last step: its epilogue, with the next tile's loads in flight
            acc, cacc = warpgroup_mma_wait(0, deps=(acc, cacc))
            pid_m, pid_n = _tile_of(gl.program_id(0) + (s // num_k) * gl.num_programs(0), num_pid_m, num_pid_n,
                                    GROUP_M)
            if LEVEL == 1:
                _keep(cacc, CS, pid_m * BLOCK_M, pid_n, M, N // BLOCK_N * 16, BLOCK_M)
            if LEVEL == 2:
                _check(acc, cacc, XS, GC, Bad, pid_m * BLOCK_M, pid_n, M, emax, csig, BLOCK_M, BLOCK_N, num_warps)
            tma.store_wait(0)  # the previous tile's store has left y_s
            y_s.store(acc.to(dtype))
            fence_async_shared()
            _tma_store(y_desc, [pid_m * BLOCK_M, pid_n * BLOCK_N], y_s)
    tma.store_wait(0)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))
