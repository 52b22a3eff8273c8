"""The checksum tables of GEMM I and GEMM II, built once per call by a pre-pass, and the operand slices
the main loop reads them as.

The pre-pass (`_efta_checksums`, one program per key block) reduces every key block once: ``Kc1``,
``max_d Σ_l |K|``, ``Vc1``, ``Vc2``, ``max_n Σ_l |V|``, already split into input-dtype slices, and
the main loop loads them like K and V, in decode too. Built per query block instead, every query
block (and with GQA every query head) would reduce each key block again; in decode that in-loop
reduction outweighed the single query's GEMMs (16.7× the unchecked time on the H100, against 2× with
the pre-pass). PASA's pre-pass also writes the shifted keys.

Step 1's checksum ``Kc1 = Σ_l K[l·16+r]`` (stride s = 16, fp32 sums of the K tile) enters the dot
``Q·Kc1ᵀ`` with fp32 accuracy by splitting the fp32 operand into slices of the input dtype (`_split`;
fp16: hi + lo = 22 bits, with a per-tile power-of-two scale so the slices neither overflow nor go
subnormal; bf16: hi + mid + lo = 24 bits; fp32 inputs: one IEEE fp32 dot). The slices sit side by side
in one operand (`_load_parts`: N = 32 for fp16, 64 for bf16 with 16 zero columns, 16 for fp32), so
the checksum is one more tensor-core dot, and one wait for it, next to the main GEMM; its columns are
summed in registers (`_fold_parts`).

GEMM II's ``Vc1`` and ``Vc2`` (checksums over the head dim, same splitting) are stored transposed, so
that the dot ``P·Vc`` takes a K-major B operand like ``Q·Kc``'s: stored N-major, as V is, the kernels
with in-loop injection computed wrong ``Oc`` on the H100 with Triton 3.6 (every output group failed
step 7, or an illegal address with both passes in one launch). Two ones columns follow Vc1's slices
(`VC_ONES`): the operand ``[Vc1 slices | 1 | 1 | 0…]`` (`_load_parts` with ONES: 64 columns for fp16 and
bf16, 32 for fp32) makes the row sum ``l = Σ_n P_lp[i, n]`` and its twin in two columns of the same
dot's accumulator (`_fold_ones`), unscaled: the slice scale multiplies the slices' sum only. Per key
block the table holds ``32·PARTS + VC_ONES`` rows of 64 keys (`vc_rows`): Vc1's slices, the ones, Vc2's
slices. The ones are stored like the slices (not made in registers inside the loop) so that the operand
is a plain load, as the other operands of the dot are. The wide clean pass at fp16 reads only the slices
from the table and takes the ones from an operand made once before its loop (`_vc_dot_wide`: two blocks'
padded operands would not fit the H100's shared memory at D = 128).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..tl_common import dot as _dot
from .common import _max_nan, _nanmax

VC_ONES = 2  # ones columns after Vc1's slices: the row sum l and its twin (step 6)
_VC_ONES = tl.constexpr(VC_ONES)


def vc_rows(parts: int) -> int:
    """Rows (of 64 keys) of one key block's V-checksum table: Vc1's ``parts`` slices of 16, the ones, Vc2's."""
    return 32 * parts + VC_ONES


@triton.jit
def _split(b, bmax, DT: tl.constexpr, PARTS: tl.constexpr, SCALE: tl.constexpr):
    """Split the fp32 checksum operand b into PARTS slices of the input dtype DT: b ≈ ic·(p0 + p1 + p2).

    fp16 (PARTS=2, SCALE): b is first scaled by a power of two so that bmax (an upper bound of |b|,
    at most 8× above its max) lands in [2^14, 2^15); hi + lo keep 22 significant bits, nothing
    overflows, and what goes subnormal is < 2^-25 of the max. bf16 (PARTS=3): hi + mid + lo, 24 bits
    (bf16 has fp32's range, no scaling). fp32 (PARTS=1): b itself. Unused slices are zeros.
    Returns (p0, p1, p2, ic) with ic the inverse scale (a scalar).
    """
    ic = 1.0
    if PARTS == 1:
        p0 = b
        p1 = tl.zeros(b.shape, tl.float32)
        p2 = p1
    else:
        if SCALE:
            ebits = (bmax.to(tl.int32, bitcast=True) >> 23) & 0xFF
            f = tl.minimum(tl.maximum(268 - ebits, 1), 253)  # 2^(141 − e) as an exponent field
            b = b * (f << 23).to(tl.float32, bitcast=True)
            ic = ((254 - f) << 23).to(tl.float32, bitcast=True)
        p0 = b.to(DT)
        rest = b - p0.to(tl.float32)
        p1 = rest.to(DT)
        if PARTS == 3:
            p2 = (rest - p1.to(tl.float32)).to(DT)
        else:
            p2 = tl.zeros(b.shape, DT)
    return p0, p1, p2, ic


@triton.jit
def _parts_dot(a, p0, p1, p2, PARTS: tl.constexpr, F32: tl.constexpr):
    """Σ_i a·p_i in fp32, the slices of `_split` (not yet multiplied by ic)."""
    z = _dot(a, p0, tl.zeros((a.shape[0], p0.shape[1]), tl.float32), F32 or PARTS == 1)
    if PARTS >= 2:
        z = _dot(a, p1, z, F32)
    if PARTS == 3:
        z = _dot(a, p2, z, F32)
    return z


@triton.jit
def _kabs_nonfinite(kabs_rd):
    """From Σ_l |K[l·16+r, d]| (16, BLOCK_D): kabs[r] = its max over d (16,), and 1 if the key block
    holds a non-finite value (a sum that is not ≤ FLT_MAX), else 0."""
    knf = tl.max(tl.max((~(kabs_rd <= 3.4028234663852886e38)).to(tl.int32), axis=1), axis=0)
    return tl.max(kabs_rd, axis=1), knf


@triton.jit
def _k_checksums(k, L: tl.constexpr):
    """GEMM I sums of a key block k (L·16, BLOCK_D) held in registers (PASA's shifted keys): Kc1 =
    Σ_l K[l·16+r] and Σ_l |K[l·16+r]|, (16, BLOCK_D) fp32 each."""
    kg = tl.reshape(k.to(tl.float32), (L, 16, k.shape[1]))
    return tl.sum(kg, axis=0), tl.sum(tl.abs(kg), axis=0)


@triton.jit
def _k_sums_by_group(Kb, skn, skd, n0, lo, hi, D, offs_d, kc1, kc2, kabs_rd, L: tl.constexpr, EVEN_D: tl.constexpr,
                     KC2: tl.constexpr):
    """Add the keys n ∈ [lo, hi) of the key block starting at row n0 into its GEMM I sums, loaded one group
    of 16 keys at a time (every (16, BLOCK_D) load has the same layout, so the sums over the L groups stay
    in each thread; the whole-tile reshape reduced across threads: 609 shuffles per program at D = 128):
    kc1 += Σ_l K[l·16+r] (Kc1), with KC2 kc2 += Σ_l (l+1)·K[l·16+r] (Kc2), kabs_rd += Σ_l |K[l·16+r]|, all
    (16, BLOCK_D) fp32, each group added in the order l = 0, 1, … (so a block summed in parts holds the
    bits of one summed at once)."""
    r16 = tl.arange(0, 16)
    for l in tl.static_range(L):
        rows = n0 + l * 16 + r16
        ok = ((rows >= lo) & (rows < hi))[:, None]
        if not EVEN_D:
            ok = ok & (offs_d < D)[None, :]
        kl = tl.load(Kb + rows[:, None] * skn + offs_d[None, :] * skd, mask=ok, other=0.0)
        kl = kl.to(tl.float32)
        kc1 += kl
        if KC2:
            kc2 += kl * (l + 1.0)  # exact for fp16/bf16 keys (an integer ≤ 8); fp32 keys round alike in both orders
        kabs_rd += tl.abs(kl)
    return kc1, kc2, kabs_rd


@triton.jit
def _v_sums_by_group(Vb, svn, svd, offs_n, row_ok, D, LVP: tl.constexpr, EVEN_D: tl.constexpr):
    """GEMM II checksums of the values at rows offs_n where row_ok, over the head dim, loaded one group of 16
    dims at a time (the sums stay in each thread): Vc1[n, r] = Σ_l V[n, l·16+r],
    Vc2[n, r] = Σ_l (l+1)·V[n, l·16+r] and Σ_l |V[n, l·16+r]|, (BLOCK_N, 16) fp32 each, 0 on other rows."""
    r16 = tl.arange(0, 16)
    v1 = tl.zeros((offs_n.shape[0], 16), tl.float32)
    v2 = tl.zeros((offs_n.shape[0], 16), tl.float32)
    vabs = tl.zeros((offs_n.shape[0], 16), tl.float32)
    for l in tl.static_range(LVP):
        ok = row_ok[:, None]
        if not EVEN_D:
            ok = ok & (l * 16 + r16 < D)[None, :]
        vl = tl.load(Vb + offs_n[:, None] * svn + (l * 16 + r16)[None, :] * svd, mask=ok, other=0.0)
        vl = vl.to(tl.float32)
        v1 += vl
        v2 += vl * (l + 1.0)  # exact: an fp16/bf16 value times an integer ≤ 8
        vabs += tl.abs(vl)
    return v1, v2, vabs


@triton.jit
def _store_block(KC, VC, KA, VA, SC, KC2, cb, kc1, kc2, kabs_rd, v1, v2, vtile, KDT: tl.constexpr,
                 VDT: tl.constexpr, BLOCK_D: tl.constexpr, PARTS: tl.constexpr, SCALE_CS: tl.constexpr,
                 BLOCK_N: tl.constexpr, KC2_OUT: tl.constexpr):
    """Row cb of the tables from a key block's sums: Kc1 kc1, Kc2 kc2 and Σ_l |K| kabs_rd (16, BLOCK_D),
    Vc1 v1 and Vc2 v2 (BLOCK_N, 16), vtile (16,) = max_n Σ_l |V|; KDT, VDT the key and value dtypes
    (the slices'). Writes KC's slices of Kc1 (`_split`), VC's of Vc1, the ones columns and Vc2's (transposed,
    `vc_rows`), KA = max_d kabs_rd, VA = vtile, SC = (the inverse scales of Kc1, Vc1, Vc2, 1.0 if the keys are
    non-finite) and, with KC2_OUT, KC2 = kc2 in fp32 (the weighted checksum of keys kept in a cache: it
    locates a fault in the stored keys)."""
    LVP: tl.constexpr = BLOCK_D // 16
    r16 = tl.arange(0, 16)
    offs_d = tl.arange(0, BLOCK_D)
    offs_j = tl.arange(0, BLOCK_N)
    kabs, knf = _kabs_nonfinite(kabs_rd)
    k0, k1, k2, kic = _split(kc1, tl.max(kabs, axis=0), KDT, PARTS, SCALE_CS)
    kp = KC + cb * (PARTS * 16 * BLOCK_D) + r16[:, None] * BLOCK_D + offs_d[None, :]
    tl.store(kp, k0)
    if PARTS >= 2:
        tl.store(kp + 16 * BLOCK_D, k1)
    if PARTS == 3:
        tl.store(kp + 32 * BLOCK_D, k2)
    if KC2_OUT:
        tl.store(KC2 + cb * (16 * BLOCK_D) + r16[:, None] * BLOCK_D + offs_d[None, :], kc2)
    vcmax = tl.max(vtile, axis=0)  # ≥ max |Vc1|; ·LVP ≥ max |Vc2|
    VROWS: tl.constexpr = 32 * PARTS + _VC_ONES
    vrow = VC + cb * (VROWS * BLOCK_N)
    vp = vrow + offs_j[:, None] + r16[None, :] * BLOCK_N  # stored as (16, BLOCK_N)
    a0, a1, a2, aic = _split(v1, vcmax, VDT, PARTS, SCALE_CS)
    c0, c1, c2, cic = _split(v2, vcmax * LVP, VDT, PARTS, SCALE_CS)
    C2: tl.constexpr = (16 * PARTS + _VC_ONES) * BLOCK_N  # Vc2's first slice, after Vc1's and the ones
    tl.store(vp, a0)
    tl.store(vp + C2, c0)
    if PARTS >= 2:
        tl.store(vp + 16 * BLOCK_N, a1)
        tl.store(vp + C2 + 16 * BLOCK_N, c1)
    if PARTS == 3:
        tl.store(vp + 32 * BLOCK_N, a2)
        tl.store(vp + C2 + 32 * BLOCK_N, c2)
    ones = tl.arange(0, _VC_ONES)
    tl.store(vrow + (16 * PARTS + ones)[:, None] * BLOCK_N + offs_j[None, :],
             tl.full((_VC_ONES, BLOCK_N), 1.0, VDT))
    tl.store(KA + cb * 16 + r16, kabs)
    tl.store(VA + cb * 16 + r16, vtile)
    four = tl.arange(0, 4)
    sc = tl.where(four == 0, kic, tl.where(four == 1, aic, tl.where(four == 2, cic, knf.to(tl.float32))))
    tl.store(SC + cb * 4 + four, sc)


@triton.jit
def _load_parts(base, inner, PARTS: tl.constexpr, STRIDE_R: tl.constexpr, ONES: tl.constexpr):
    """The PARTS slices of a checksum table row as one operand (len(inner), PW): column c = 16·part + r
    sits at base + inner + c·STRIDE_R (the tables store the slices one after the other). The width PW is
    16·PARTS rounded up to a power of two: bf16's three slices take 64 columns, the last 16 zeros. With
    ONES (the Vc1 operand) the `VC_ONES` ones columns stored after the slices come too, in 64 columns
    (fp16, bf16) or 32 (fp32), the rest zeros."""
    PW: tl.constexpr = (32 if PARTS == 1 else 64) if ONES else 16 << (PARTS - 1)
    LIVE: tl.constexpr = 16 * PARTS + (_VC_ONES if ONES else 0)
    rp = tl.arange(0, PW)
    ptr = base + inner[:, None] + rp[None, :] * STRIDE_R
    if PW == LIVE:
        t = tl.load(ptr)
    else:
        t = tl.load(ptr, mask=rp[None, :] < LIVE, other=0.0)
    return t


@triton.jit
def _vc_dot_wide(pd, ones_op, VC, SC, cb, nsub, PARTS: tl.constexpr, NB: tl.constexpr, STACK: tl.constexpr,
                 SCALE: tl.constexpr, F32: tl.constexpr):
    """GEMM II's checksum product of a wide key block: P_lp pd (rows, NB·CS) against the Vc1 slices and the
    ones of its NB checksum blocks of CS keys (table rows cb … cb + NB − 1, the first ``nsub`` existing; the
    others read as zeros, like their keys). Returns, as `_fold_ones`, the slices' products summed over the
    blocks, each block's times its scale where SCALE (rows, 16), and the ones group (rows, 16), unscaled.

    STACK (no slice scales: bf16, fp32): one dot over the blocks' `_load_parts` operands with ONES stacked
    along the keys, (NB·CS, PW). Otherwise (fp16, a scale per block; NB = 2): each half of P along the keys
    against its own block's slices, (CS, 16·PARTS), two dots, and all of P against ``ones_op`` (NB·CS, 16),
    `VC_ONES` ones columns and zeros, which the caller makes once before the loop (like Q, it is written to
    shared memory once; P is 0 at keys past N, so ones there add nothing). The pipelined operands take
    2·CS·16·PARTS·2 B a stage (8 KiB); one block-diagonal [slices | 1 | 1 | 0…] operand (NB·CS, NB·64) would
    take 32 KiB, half of it zeros, and the launch at D = 128 256 KiB of shared memory, past the H100's."""
    CS: tl.constexpr = 64  # keys per checksum block (`configs.CS_BLOCK_N`)
    VROWS: tl.constexpr = 32 * PARTS + _VC_ONES
    if STACK:
        PW: tl.constexpr = 32 if PARTS == 1 else 64
        n = tl.arange(0, NB * CS)
        row = VC + (cb + n // CS)[:, None] * (VROWS * CS) + (n % CS)[:, None]
        live = (n // CS < nsub)[:, None]
        c = tl.arange(0, PW)
        a = tl.load(row + c[None, :] * CS, mask=live & (c < 16 * PARTS + _VC_ONES)[None, :], other=0.0)
        f, ones = _fold_ones(_dot(pd, a, tl.zeros((pd.shape[0], PW), tl.float32), F32 or PARTS == 1), PARTS)
    else:
        tl.static_assert(NB == 2)
        o = tl.arange(0, 16)
        # (the select keeps the product out of the loop-carried accumulator that `lt·α + ones` would fold
        # it into: a second wgmma chain in flight across iterations makes ptxas serialise them, C7515)
        ones = tl.where(o[None, :] < _VC_ONES, _dot(pd, ones_op, tl.zeros((pd.shape[0], 16), tl.float32), F32), 0.0)
        # P's two halves along the keys: in each thread's registers (the MMA layout repeats along N)
        p0, p1 = tl.split(tl.permute(tl.reshape(pd, (pd.shape[0], NB, CS)), (0, 2, 1)))
        j = tl.arange(0, CS)[:, None]
        c = tl.arange(0, 16 * PARTS)[None, :]
        a0 = tl.load(VC + cb * (VROWS * CS) + j + c * CS)
        second = tl.full((CS, 16 * PARTS), 1, tl.int32) < nsub  # the second block exists (a tensor: the interpreter)
        a1 = tl.load(VC + (cb + 1) * (VROWS * CS) + j + c * CS, mask=second, other=0.0)
        z0 = _fold_parts(_dot(p0, a0, tl.zeros((pd.shape[0], 16 * PARTS), tl.float32), F32))
        z1 = _fold_parts(_dot(p1, a1, tl.zeros((pd.shape[0], 16 * PARTS), tl.float32), F32))
        aic0 = tl.load(SC + cb * 4 + 1)
        aic1 = tl.load(SC + tl.minimum(cb + 1, cb + nsub - 1) * 4 + 1)  # (times z1 = 0 if the block is missing)
        f = _scaled(z0, aic0, SCALE) + _scaled(z1, aic1, SCALE)
    return f, ones


@triton.jit
def _fold_ones(z, PARTS: tl.constexpr):
    """(rows, PW) product with a `_load_parts` operand with ONES → the sum of its slices' products (rows,
    16), not yet times the slice scale, and the ones group (rows, 16): column 0 the row sum l, column 1 its
    twin, the rest 0. Group g = columns [16·g, 16·g + 16) lies in the same threads for every g (the MMA
    layout repeats every 8 columns), so both are in-register selections."""
    g = tl.reshape(z, (z.shape[0], z.shape[1] // 16, 16))
    part = tl.arange(0, z.shape[1] // 16)[None, :, None]
    return tl.sum(tl.where(part < PARTS, g, 0.0), axis=1), tl.sum(tl.where(part == PARTS, g, 0.0), axis=1)


@triton.jit
def _scaled(z, ic, SCALE: tl.constexpr):
    """z·ic, ic a slice scale of `_split`: exactly 1 without SCALE (bf16, fp32), so no multiply then."""
    if SCALE:
        z = z * ic
    return z


@triton.jit
def _fold_parts(z):
    """(rows, 16·n) → (rows, 16): the sum of the n slices' products. Column r + 16·part lies in the
    same thread for every part (the MMA layout repeats every 8 columns), so this is in-register.
    bf16's zero fourth slice stays in: leaving it out through split/permute makes the bf16 kernel 1-5 %
    slower on an H200, for 16 fewer additions per key block."""
    if z.shape[1] == 16:
        f = z
    else:
        f = tl.sum(tl.reshape(z, (z.shape[0], z.shape[1] // 16, 16)), axis=1)
    return f


@triton.jit(do_not_specialize=["j0", "nbt"])  # (one kernel whatever the block range and count)
def _efta_checksums(K, V, KC, VC, KA, VA, SC, KS, KC2, skb, skh, skn, skd, svb, svh, svn, svd, Hkv, N, D,
                    scale, diag, off, diag_last, off_last, j0, nbt,
                    BLOCK_D: tl.constexpr, PARTS: tl.constexpr, SCALE_CS: tl.constexpr, INTERP: tl.constexpr,
                    EVEN_D: tl.constexpr, PASA: tl.constexpr, BLOCK_N: tl.constexpr, KC2_OUT: tl.constexpr):
    """Pre-pass: the checksums of every key block, once per call instead of once per query block; or, for
    the tables of a KV cache (`stored`), of the key blocks [j0, j0 + grid) that tokens filled.

    Program (j − j0, kv head, batch) → row cb = (b·Hkv + hk)·nbt + j of the tables (nbt rows per (batch,
    kv head)): KC (rows, PARTS, 16, BLOCK_D) the slices of Kc1 (`_split`, input dtype), VC (rows, 2, PARTS,
    16, BLOCK_N) the slices of Vc1 and Vc2, transposed, KA (rows, 16) max_d Σ_l |K|, VA (rows, 16)
    max_n Σ_l |V|, SC (rows, 4) fp32: the inverse scales of Kc1, Vc1, Vc2 and 1.0 if the key block is
    non-finite; with KC2_OUT, KC2 (rows, 16, BLOCK_D) fp32 Kc2 (`_store_block`).

    PASA (j0 = 0, nbt = the grid): the block is first shifted by β times its mean with the fp16 shifting
    matrix ``M = (diag − off)·I + off·J`` (``diag_last``/``off_last`` for a short last block) and scaled,
    ``K' = fl16(scale·M·K)`` (the PASA paper, Algorithm 1 line 6; `ft_transformers.pasa.shift_keys`), stored
    in KS (B, Hkv, nblocks·BLOCK_N, BLOCK_D) fp16 (zeros past N and D); the checksums are K''s.
    """
    L: tl.constexpr = BLOCK_N // 16
    LVP: tl.constexpr = BLOCK_D // 16
    j = j0 + tl.program_id(0)
    hk = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    cb = (b * Hkv + hk) * nbt + j
    offs_j = tl.arange(0, BLOCK_N)
    offs_n = j * BLOCK_N + offs_j
    offs_d = tl.arange(0, BLOCK_D)
    Kb = K + b * skb + hk * skh
    Vb = V + b * svb + hk * svh
    kc2 = tl.zeros((16, BLOCK_D), tl.float32)
    if PASA:
        kv_ok = offs_n[:, None] < N
        if not EVEN_D:
            kv_ok = kv_ok & (offs_d < D)[None, :]
        k = tl.load(Kb + offs_n[:, None] * skn + offs_d[None, :] * skd, mask=kv_ok, other=0.0)
        last = N - j * BLOCK_N < BLOCK_N
        dg = tl.where(last, diag_last, diag)
        of = tl.where(last, off_last, off)
        k32 = k.to(tl.float32)
        ks = ((dg - of) * k32 + of * tl.sum(k32, axis=0)[None, :]) * scale
        k = tl.where(offs_n[:, None] < N, ks, 0.0).to(tl.float16)
        tl.store(KS + ((b * Hkv + hk) * nbt * BLOCK_N + offs_n[:, None]) * BLOCK_D + offs_d[None, :], k)
        kc1, kabs_rd = _k_checksums(k, L)
    else:
        kc1, kc2, kabs_rd = _k_sums_by_group(Kb, skn, skd, j * BLOCK_N, j * BLOCK_N, N, D, offs_d,
                                             tl.zeros((16, BLOCK_D), tl.float32), kc2,
                                             tl.zeros((16, BLOCK_D), tl.float32), L, EVEN_D, KC2_OUT)
    v1, v2, vabs = _v_sums_by_group(Vb, svn, svd, offs_n, offs_n < N, D, LVP, EVEN_D)
    _store_block(KC, VC, KA, VA, SC, KC2, cb, kc1, kc2, kabs_rd, v1, v2, _nanmax(vabs, 0, INTERP),
                 K.dtype.element_ty, V.dtype.element_ty, BLOCK_D, PARTS, SCALE_CS, BLOCK_N, KC2_OUT)


@triton.jit(do_not_specialize=["nbt", "start", "end"])  # (one kernel for every step of a decode)
def _efta_checksums_append(K, V, KC, VC, KA, VA, SC, KC2, MK, MV, skb, skh, skn, skd, svb, svh, svn, svd, Hkv,
                           D, nbt, start, end, BLOCK_D: tl.constexpr, PARTS: tl.constexpr, SCALE_CS: tl.constexpr,
                           INTERP: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_N: tl.constexpr):
    """The tables of a KV cache's key blocks that tokens [start, end) entered only in part: the block
    they continue (``start`` inside it) and the block they leave partly filled (``end`` inside it); the
    blocks they fill whole take `_efta_checksums`. Grid (Hkv, B); tables as `_efta_checksums` with KC2.

    A partly filled block keeps its running sums between calls, per (batch, kv head): MK (B·Hkv, 3, 16,
    BLOCK_D) fp32 = Kc1, Kc2, Σ_l |K| (16, BLOCK_D) and MV (B·Hkv, 2, BLOCK_N, 16) fp32 = Vc1, Vc2 of its
    keys. New keys are read from the cache (K, V at rows [start, end)) and added to them in the pre-pass's
    order, so every row written equals the pre-pass's for the same keys (keys not written yet count as
    zeros); the keys written before are not read again (a fault in them since stays visible to the checks).
    The running max_n Σ_l |V| is the block's VA row itself. The block's whole VC row is split again, as
    its scales follow the block's maxima.
    """
    L: tl.constexpr = BLOCK_N // 16
    LVP: tl.constexpr = BLOCK_D // 16
    hk = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    bh = b * Hkv + hk
    Kb = K + b * skb + hk * skh
    Vb = V + b * svb + hk * svh
    r16 = tl.arange(0, 16)
    offs_d = tl.arange(0, BLOCK_D)
    offs_j = tl.arange(0, BLOCK_N)
    mk = MK + bh * (3 * 16 * BLOCK_D) + r16[:, None] * BLOCK_D + offs_d[None, :]
    mv = MV + bh * (2 * BLOCK_N * 16) + offs_j[:, None] * 16 + r16[None, :]
    j_first = start // BLOCK_N
    j_last = (end - 1) // BLOCK_N
    cont = start % BLOCK_N != 0  # the first block continues one the sums were kept for
    for part in tl.static_range(2):
        if part == 0:
            j = j_first
            todo = cont
        else:
            j = j_last
            todo = (end % BLOCK_N != 0) & ((j_last != j_first) | (not cont))
        if todo:
            n0 = j * BLOCK_N
            lo = tl.maximum(start, n0)
            hi = tl.minimum(end, n0 + BLOCK_N)
            cb = bh * nbt + j
            keep = lo > n0  # continue the kept sums; else a block that starts here, from zeros
            kc1 = tl.where(keep, tl.load(mk), 0.0)
            kc2 = tl.where(keep, tl.load(mk + 16 * BLOCK_D), 0.0)
            kabs_rd = tl.where(keep, tl.load(mk + 32 * BLOCK_D), 0.0)
            m1 = tl.where(keep, tl.load(mv), 0.0)
            m2 = tl.where(keep, tl.load(mv + BLOCK_N * 16), 0.0)
            vt_old = tl.where(keep, tl.load(VA + cb * 16 + r16), 0.0)
            kc1, kc2, kabs_rd = _k_sums_by_group(Kb, skn, skd, n0, lo, hi, D, offs_d, kc1, kc2, kabs_rd, L, EVEN_D,
                                                 True)
            offs_n = n0 + offs_j
            new = (offs_n >= lo) & (offs_n < hi)
            v1, v2, vabs = _v_sums_by_group(Vb, svn, svd, offs_n, new, D, LVP, EVEN_D)
            v1 = tl.where(new[:, None], v1, m1)
            v2 = tl.where(new[:, None], v2, m2)
            vtile = _max_nan(vt_old, _nanmax(vabs, 0, INTERP))
            _store_block(KC, VC, KA, VA, SC, KC2, cb, kc1, kc2, kabs_rd, v1, v2, vtile, K.dtype.element_ty,
                         V.dtype.element_ty, BLOCK_D, PARTS, SCALE_CS, BLOCK_N, True)
            if hi < n0 + BLOCK_N:  # still partly filled: keep its sums
                tl.debug_barrier()  # (every thread read the kept sums of part 0 before part 1 writes them)
                tl.store(mk, kc1)
                tl.store(mk + 16 * BLOCK_D, kc2)
                tl.store(mk + 32 * BLOCK_D, kabs_rd)
                tl.store(mv, v1)
                tl.store(mv + BLOCK_N * 16, v2)
