"""The persistent form of the checked GEMM (wide calls on Hopper): `_persistent_kernel`, one program per SM
over TMA descriptors made in the kernel, with nothing but the 64-column group sums in its epilogue;
`groups._group_verify_kernel` then verifies. Any checksum work inside the persistent K loop cost 5-50 %
in Triton 3.6, where the plain persistent GEMM runs at 0.89-1.01× cuBLAS.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..tl_common import dot as _mma
from .checksum_tiles import checksum_program, checksum_tile
from .common import _grouped_tile
from .tile import G, group_sums


@triton.jit
def _persistent_kernel(X, W, Y, Bias, P, Wc, M, N, K, NC, sxm, sw, sym, c_split, c_kb_per,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
                       NUM_SMS: tl.constexpr, HAS_BIAS: tl.constexpr, W_KN: tl.constexpr,
                       VERIFY_OUTPUT: tl.constexpr, DOT_F32: tl.constexpr, FUSED: tl.constexpr, CN: tl.constexpr,
                       EVEN_K: tl.constexpr, XVAR: tl.constexpr):
    """The persistent form's GEMM: NUM_SMS programs loop over the (BLOCK_M, BLOCK_N) tiles of y (M, N) in
    grouped order, with x (M, K), W (N, K) (or (K, N) when W_KN) and y moved by TMA descriptors made here
    (plain pointer arguments, so a prepared call replays it), the tile and K loops flattened into one
    pipeline. Epilogue: bias in fp32, the 64-column group sums of each tile into ``P`` (T_g, M) as
    `tile._tile_epilogue` stores them (of the fp32 accumulators, or of the rounded outputs with
    VERIFY_OUTPUT), y rounded and stored. No checksum work in the K loop (it cost 5-50 % there).
    Row strides sxm, sw (of W as stored), sym; unit inner strides, 16-byte aligned rows (`forms.persistent_ok`).
    DOT_F32: the interpreter's dots in fp32 (as `_gemm_tile`'s).

    FUSED: after y's tiles, the ⌈M / BLOCK_M⌉ · ⌈NC / CN⌉ · ``c_split`` checksum programs
    (`checksum_tiles.checksum_tile`, ``Wc`` (NC, K), ``c_kb_per`` K blocks each) continue the same round-robin
    over the programs, so the programs that had a tile fewer take them first; C (c_split, M, NC) and x's
    statistics (c_split, M, 4) land in ``P`` after the group sums."""
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
        group_sums(v, P, pid_n, offs_m, m_ok, M, N)
        yd.store([pid_m * BLOCK_M, pid_n * BLOCK_N], yv)
    if FUSED:
        n_tiles = num_pid_m * num_pid_n
        num_c = tl.cdiv(NC, CN)
        Cb = P + tl.cdiv(N, G) * M
        # this program's next tile in the round-robin past y's tiles: the first t ≥ n_tiles with t ≡ pid
        first = n_tiles + (pid - n_tiles % NUM_SMS + NUM_SMS) % NUM_SMS
        for t in range(first, n_tiles + num_pid_m * num_c * c_split, NUM_SMS):
            cm, cc, cs = checksum_program(t - n_tiles, num_c, c_split)
            checksum_tile(X, Wc, Cb, Cb + c_split * M * NC, cm, cc, cs, c_kb_per, M, K, NC, sxm, 1,
                          BLOCK_M, CN, BLOCK_K, EVEN_K, DOT_F32, XVAR)
