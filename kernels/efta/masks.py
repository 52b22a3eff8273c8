"""Step 2: causal, sliding-window and padding masks, bool and additive masks, and the additive bias.

Causal and sliding window are bottom-right aligned (query i sees key j ≤ i + N − M, and with a window
j > i + N − M − window), so decode with a KV cache (M < N) needs no offset. Key blocks that are fully
masked for the whole query block are skipped (`_key_range`); the causal, window and padding selects
run only on key blocks that hold a masked key (`_edge_block`): elsewhere they would select every
score (two instructions per score saved in the interior blocks). Bool and additive masks and the
additive bias are read through (possibly zero) strides, so any broadcast of (B, Hq, M, N) costs no copy.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import _nanmax


@triton.jit
def _additive_tile(Base, b, h, offs_m, offs_n, s0, s1, s2, s3, inb):
    """The (BLOCK_M, BLOCK_N) block of an additive bias or mask read through strides ``s0..s3`` (b, h, row,
    key), fp32, 0 outside ``inb``."""
    return tl.load(Base + b * s0 + h * s1 + offs_m[:, None] * s2 + offs_n[None, :] * s3, mask=inb,
                   other=0.0).to(tl.float32)


@triton.jit
def _bias_mask(s, offs_m, offs_n, b, h, M, N, window, edge,
               Bias, sbb, sbh, sbm, sbn, Mask, smb, smh, smm, smn, mtile,
               HAS_BIAS: tl.constexpr, MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr,
               HAS_WINDOW: tl.constexpr, CHECK_NF: tl.constexpr, INTERP: tl.constexpr):
    """Step 2: S += bias (+ additive mask), −inf where masked (bool mask, causal, window, padding).
    The positional masks (causal, window, padding at N) are applied only where ``edge`` (a scalar,
    `_edge_block`) says that some key of the block is outside some row's range; elsewhere they
    would select every score (two instructions per score saved in the interior blocks).

    mtile: the bool mask's block from `_bool_mask_tile` (MASK_KIND 1), or None to load it here. Returns (S, nf)
    with nf = 1 when a loaded bias / additive-mask value is NaN or +inf.
    """
    nf = tl.full([], 0, tl.int32)
    inb = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    add = None  # bias + additive mask (where CHECK_NF tests them): NaN or +inf in either makes this so
    if HAS_BIAS:
        bt = _additive_tile(Bias, b, h, offs_m, offs_n, sbb, sbh, sbm, sbn, inb)
        s = s + bt
        add = bt
    if MASK_KIND == 2:  # additive
        mt = _additive_tile(Mask, b, h, offs_m, offs_n, smb, smh, smm, smn, inb)
        s = s + mt
        if HAS_BIAS:
            add = add + mt
        else:
            add = mt
    if CHECK_NF:
        if HAS_BIAS or MASK_KIND == 2:  # a row's NaN-propagating max is NaN or +inf iff one of its values is
            nf = tl.max((~(_nanmax(add, 1, INTERP) <= 3.4028234663852886e38)).to(tl.int32), axis=0)
    if MASK_KIND == 1:  # bool, True = attend; applied as an additive 0 / −inf, like SDPA does
        # (a select on the loaded mask, `where(mt != 0, s, -inf)`, crashes Triton 3.6-3.9's
        # TritonGPU-to-LLVM conversion once the repair code is compiled in)
        if mtile is None:  # (decode programs load it here: `_early_mask`)
            mtile = _bool_mask_tile(offs_m, offs_n, b, h, M, N, Mask, smb, smh, smm, smn)
        s = s + mtile
    if edge:
        s = _positional(s, -float("inf"), offs_m, offs_n, M, N, window, CAUSAL, HAS_WINDOW)
    return s, nf


@triton.jit
def _positional(s, other, offs_m, offs_n, M, N, window, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """``s`` (BLOCK_M, BLOCK_N) with ``other`` (a scalar or (BLOCK_M, 1)) at the keys the positional masks
    hide: past the causal limit, at or before the sliding-window limit, past N (bottom-right aligned)."""
    if CAUSAL:
        s = tl.where(offs_n[None, :] <= offs_m[:, None] + (N - M), s, other)
    if HAS_WINDOW:
        s = tl.where(offs_n[None, :] > offs_m[:, None] + (N - M - window), s, other)
    return tl.where(offs_n[None, :] < N, s, other)


@triton.jit
def _add_again(a, b, INTERP: tl.constexpr):
    """``a + b`` for step 2's second evaluation (`_step2_again`). On the GPU one ``add.rz.f32``: ptxas cannot
    merge it with step 2's own round-to-nearest add, so the anchor does not read the register whose fault it
    is there to see (≤ 1 ulp from that add; the host widens step 4's room by it, `Bounds.exp_base`). The
    interpreter merges nothing: a plain add."""
    if INTERP:
        return a + b
    return tl.inline_asm_elementwise("add.rz.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32, is_pure=True,
                                     pack=1)


@triton.jit
def _step2_again(s, fill, offs_m, offs_n, b, h, M, N, window, edge,
                 Bias, sbb, sbh, sbm, sbn, Mask, smb, smh, smm, smn, mtile,
                 HAS_BIAS: tl.constexpr, MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr,
                 HAS_WINDOW: tl.constexpr, CLAMP: tl.constexpr, INTERP: tl.constexpr):
    """Step 2 evaluated a second time from the scores step 1 verified, ``s`` (BLOCK_M, BLOCK_N): the values
    step 4 anchors the exponents on, so that a fault in step 2's output (`attn.masked_scores`: the add's or
    the select's result, which the row max and x read) moves log2 ΠP away from them.

    CLAMP: ``max(s + bias + mask, fill)`` with ``fill`` (BLOCK_M,) step 4's floor, and ``fill`` at masked
    keys (`softmax._exp_test`'s exponents); else the scores with −inf at masked keys (a repair's new x).
    The selects are written with the floor as their other value and the adds as `_add_again`, so the
    compiler cannot take this tile from step 2's registers (a select of −inf then a max would fold back
    into them). The bias and mask tiles are the loads step 2 made (the compiler keeps one copy)."""
    inb = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if HAS_BIAS:
        bt = _additive_tile(Bias, b, h, offs_m, offs_n, sbb, sbh, sbm, sbn, inb)
        s = _add_again(s, bt, INTERP)
    if MASK_KIND == 2:
        mt = _additive_tile(Mask, b, h, offs_m, offs_n, smb, smh, smm, smn, inb)
        s = _add_again(s, mt, INTERP)
    if MASK_KIND == 1:  # 0 or −inf: exact in either rounding
        s = _add_again(s, mtile, INTERP)
    if CLAMP:
        s = tl.maximum(s, fill[:, None], propagate_nan=tl.PropagateNan.ALL)
        other = fill[:, None]
    else:
        other = -float("inf")
    if edge:
        s = _positional(s, other, offs_m, offs_n, M, N, window, CAUSAL, HAS_WINDOW)
    return s


@triton.jit
def _bool_mask_tile(offs_m, offs_n, b, h, M, N, Mask, smb, smh, smm, smn):
    """The bool mask's (BLOCK_M, BLOCK_N) block as the additive fp32 0 / −inf it stands for. The
    callers load it before GEMM I: loaded after the dot, its uint8 tile (in registers where it cannot
    be copied asynchronously: a stride ≠ 1 or unaligned rows) gives Triton 3.6's layout propagation
    its blocked layout for the softmax chain and the loop state, so exp runs twice (in that layout and
    in the MMA one) with conversions through shared memory: the clean loop 2× as long."""
    inb = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    mt = tl.load(Mask + b * smb + h * smh + offs_m[:, None] * smm + offs_n[None, :] * smn, mask=inb, other=0)
    return tl.where(mt != 0, 0.0, -float("inf"))


@triton.jit
def _early_mask(offs_m, offs_n, b, h, M, N, Mask, smb, smh, smm, smn, MASK_KIND: tl.constexpr):
    """`_bool_mask_tile` for a prefill program's key block, loaded before GEMM I (see there), or None:
    no bool mask, or a decode program (BLOCK_M < 64), whose loop this order makes 6 % slower on an H100
    (batch 16 over 4,008 keys); `_bias_mask` then loads it after the dot."""
    mtile = None
    if MASK_KIND == 1 and offs_m.shape[0] >= 64:
        mtile = _bool_mask_tile(offs_m, offs_n, b, h, M, N, Mask, smb, smh, smm, smn)
    return mtile


@triton.jit
def _edge_block(start_m, start_n, M, N, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """True when key block [start_n, start_n + BLOCK_N) holds a key that some real row of query block
    start_m must not see: past N, past the causal limit of its first row, or at or before the
    sliding-window limit of its last real row (bottom-right aligned, as in `_bias_mask`)."""
    edge = start_n + BLOCK_N > N
    if CAUSAL:
        edge = edge | (start_n + BLOCK_N - 1 > start_m * BLOCK_M + (N - M))
    if HAS_WINDOW:
        edge = edge | (start_n <= tl.minimum(start_m * BLOCK_M + BLOCK_M, M) - 1 + (N - M - window))
    return edge


@triton.jit
def _key_range(start_m, M, N, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
               HAS_WINDOW: tl.constexpr):
    """[lo, hi): the keys visible to some row of query block start_m (bottom-right aligned causal and
    sliding window); lo is rounded down to a key block."""
    lo = 0
    hi = N
    if CAUSAL:
        hi = tl.minimum(N, tl.minimum(start_m * BLOCK_M + BLOCK_M, M) + (N - M))
    if HAS_WINDOW:
        lo = tl.maximum(start_m * BLOCK_M + (N - M) - window + 1, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
    return lo, hi
