"""Step 1 (GEMM I, ``S = Q·Kᵀ``): its tensor-checksum test, and the location and correction of a fault.

The checksum ``Sc1 = Q·Kc1ᵀ`` (BLOCK_M, 16) comes from the pre-pass's table (`checksums`), in the
scores' units; the test compares it with the group sums ``Σ_l S[i, l·16+r]``. The clean pass keeps
each (row, group)'s worst margin ``|D1| − qn1·kabs`` over the key blocks (`_score_margin`, one FFMA
on the GPU) and tests it once after the loop against the constant floor ``s_floor``; the repairing
pass tests each key block (`_score_test`) and, where a group fails, locates the fault with the
weighted checksum ``Sc2`` (computed only then) and rebuilds it, or recomputes the row
(`_score_repair`). ``Kc2 = Σ_l (l+1)·K[l·16+r]`` and ``Sc2`` only locate a fault, so the clean
path does a third less checksum work. Several faults in one (row, residue) group, or a location out
of range, leave the group unlocated: its row is recomputed.

PASA: GEMM I is an FP16 GEMM with FP16 accumulation on the shifted keys K' (the scale folded into
K'), and its checksums are K''s. FOLD: the scores stay unscaled (the scale goes into the exponent's
FFMA, `softmax._softmax_steps`), and so do ``Sc1`` and the test's bound.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..tl_common import dot as _dot
from .checksums import _fold_parts, _load_parts, _parts_dot, _split
from .common import (
    _COR,
    _I_CHECKSUM,
    _I_SCORES,
    _REC,
    _SCORES,
    _bump,
    _group_sums,
    _inject,
    _locate,
    _nanmax,
    _per_group,
)


@triton.jit
def _scores(q, k, scale, Inj, bh, offs_m, offs_n, M, N, INJ_S: tl.constexpr, PASA: tl.constexpr,
            DOT_F32: tl.constexpr, FOLD: tl.constexpr):
    """GEMM I of one key block, (BLOCK_M, BLOCK_N) fp32, with the `attn.scores` faults applied.
    PASA: FP16 GEMM with FP16 accumulation on the shifted keys (scale folded into k). FOLD: the
    unscaled Q·Kᵀ (the scale goes into the exponent's FFMA, `_softmax_steps`)."""
    if PASA:
        s = tl.dot(q, tl.trans(k), out_dtype=tl.float16).to(tl.float32)
    else:
        s = _dot(q, tl.trans(k), tl.zeros((q.shape[0], k.shape[0]), tl.float32), DOT_F32)
        if not FOLD:
            s = s * scale
    if INJ_S != 0:
        s = _inject(s, Inj, _I_SCORES, INJ_S, bh, offs_m[:, None], offs_n[None, :], M, N)
    return s


@triton.jit
def _checksum_faults(sc1, Inj, bh, offs_m, jblk, M, nblocks, INJ_CS: tl.constexpr):
    """The `attn.checksum` faults on Sc1 (BLOCK_M, 16) of key block jblk: columns [32·jblk, 32·jblk + 16)
    of the site (B·Hq, M, nblocks·32). A wrong Sc1 fails its group in step 1; the weighted checksum,
    made from the keys in `_score_repair`, does not follow it, so the group is not located and the
    row's scores are recomputed: a false alarm, never a wrong correction."""
    if INJ_CS != 0:
        r16 = tl.arange(0, 16)
        sc1 = _inject(sc1, Inj, _I_CHECKSUM, INJ_CS, bh, offs_m[:, None], (jblk * 32 + r16)[None, :], M,
                      nblocks * 32)
    return sc1


@triton.jit
def _score_checksum(q, KC, KA, SC, cb, offs_d, scale, BLOCK_D: tl.constexpr, PARTS: tl.constexpr,
                    DOT_F32: tl.constexpr, PASA: tl.constexpr, FOLD: tl.constexpr):
    """Sc1 = Q·Kc1ᵀ (BLOCK_M, 16) fp32 for the key block in row cb of the pre-pass tables (in the
    scores' units: unscaled when FOLD), kabs (16,) = max_d Σ_l |K|, and 1 if the block is non-finite."""
    r16 = tl.arange(0, 16)
    kabs = tl.load(KA + cb * 16 + r16)
    kc = _load_parts(KC + cb * (PARTS * 16 * BLOCK_D), offs_d, PARTS, BLOCK_D, False)  # (BLOCK_D, 16·parts)
    kic = tl.load(SC + cb * 4)
    knf = (tl.load(SC + cb * 4 + 3) != 0).to(tl.int32)
    # one dot over the slices side by side (one tensor-core wait instead of one per slice)
    z = _fold_parts(_dot(q, kc, tl.zeros((q.shape[0], kc.shape[1]), tl.float32), DOT_F32 or PARTS == 1))
    if PASA or FOLD:
        sc1 = z * kic
    else:
        sc1 = z * (kic * scale)
    return sc1, kabs, knf


@triton.jit
def _t1_margin(d1, kabs, qn1, NB: tl.constexpr, INTERP: tl.constexpr):
    """|D1| − qn1·kabs (BLOCK_M, 16), or with NB checksum blocks (BLOCK_M, NB, 16) against kabs (NB, 16):
    the step-1 group fails where this is not ≤ s_floor (T_s = qn1·kabs + s_floor; NaN included). On the
    GPU one FFMA (the product unrounded); the interpreter rounds the product first, as the reference
    does."""
    if NB == 1:
        kb = kabs[None, :]
    else:
        kb = kabs[None, :, :]
    if INTERP:
        m = tl.abs(d1) - _per_group(qn1, NB) * kb
    else:
        m = tl.fma(-_per_group(qn1, NB), kb, tl.abs(d1))
    return m


@triton.jit
def _score_test(s, sc1, kabs, qn1, s_floor, row_ok, chk, L: tl.constexpr, INTERP: tl.constexpr):
    """Step-1 test of one key block: S grouped (BLOCK_M, L, 16), D1 = Sc1 − Σ_l S[i, l·16+r]
    (BLOCK_M, 16), and the groups whose |D1| exceeds T_s = qn1·kabs (+ the PASA fp16 floor s_floor),
    NaN differences included, on real rows while the inputs are finite (chk); `_t1_margin`, as the
    clean pass tests it."""
    thr = qn1[:, None] * kabs[None, :]
    sg = tl.reshape(s, (s.shape[0], L, 16))
    d1 = sc1 - tl.sum(sg, axis=1)
    m = tl.where(thr == thr, _t1_margin(d1, kabs, qn1, 1, INTERP), tl.abs(d1))  # 0·inf: the group is 0
    return sg, d1, ~(m <= s_floor) & row_ok[:, None] & chk


@triton.jit
def _score_margin(s, sc1, kabs, qn1, NB: tl.constexpr, INTERP: tl.constexpr):
    """The clean pass's step-1 test of one key block: `_t1_margin` per group (BLOCK_M, 16), failing
    where not ≤ s_floor. Only meaningful while the inputs are finite (`_key_loop`), where T_s is. A wide
    key block (NB checksum blocks: Sc1 (BLOCK_M, NB, 16), kabs (NB, 16)) tests each block's groups as the
    tables and the reference do, and returns the worse margin of each (row, residue)."""
    m = _t1_margin(sc1 - _group_sums(s, NB), kabs, qn1, NB, INTERP)
    if NB > 1:
        m = _nanmax(m, 1, INTERP)
    return m


@triton.jit
def _score_checksum_wide(q, KC, KA, SC, cb, nsub, offs_d, scale, BLOCK_D: tl.constexpr, PARTS: tl.constexpr,
                         NB: tl.constexpr, DOT_F32: tl.constexpr, FOLD: tl.constexpr):
    """`_score_checksum` for the NB checksum blocks of a wide key block (table rows cb … cb + NB − 1, of
    which the first ``nsub`` exist; the others read as zero keys): their slices side by side in one dot.
    Returns Sc1 (BLOCK_M, NB, 16) fp32, kabs (NB, 16) and 1 if a block is non-finite."""
    PW: tl.constexpr = 16 << (PARTS - 1)  # `_load_parts`' width of one block's slices
    c = tl.arange(0, NB * PW)
    ok = ((c % PW) < 16 * PARTS) & (c // PW < nsub)
    kc = tl.load(KC + (cb + c // PW)[None, :] * (PARTS * 16 * BLOCK_D) + offs_d[:, None] + (c % PW)[None, :] * BLOCK_D,
                 mask=ok[None, :], other=0.0)  # (BLOCK_D, NB·PW)
    z = _dot(q, kc, tl.zeros((q.shape[0], NB * PW), tl.float32), DOT_F32 or PARTS == 1)
    z = tl.sum(tl.reshape(z, (q.shape[0], NB, PW // 16, 16)), axis=2)  # the slices of each block folded
    t = tl.arange(0, NB)
    here = t < nsub
    kic = tl.load(SC + (cb + t) * 4, mask=here, other=0.0)
    if not FOLD:
        kic = kic * scale
    kabs = tl.load(KA + (cb + t)[:, None] * 16 + tl.arange(0, 16)[None, :], mask=here[:, None], other=0.0)
    knf = tl.max((tl.load(SC + (cb + t) * 4 + 3, mask=here, other=0.0) != 0).to(tl.int32), axis=0)
    return z * kic[None, :, None], kabs, knf


@triton.jit
def _score_repair(q, k, sg, d1, sc1, kabs, bad, cnt, start_n, N, scale, wl, r16, KC2, cb, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PARTS: tl.constexpr, SCALE_CS: tl.constexpr,
                  DOT_F32: tl.constexpr, PASA: tl.constexpr, FOLD: tl.constexpr, KC2_TABLE: tl.constexpr):
    """Step-1 location and correction of the failing groups ``bad`` (BLOCK_M, 16) of one key block, with
    its keys k (BLOCK_N, BLOCK_D), S grouped ``sg`` (BLOCK_M, L, 16), D1 and Sc1 (BLOCK_M, 16), kabs (16,)
    from `_score_test` and `_score_checksum`; wl = 1..L (fp32), r16 = 0..15. KC2_TABLE: Kc2 is read from
    row cb of the KC2 table (16, BLOCK_D) fp32, made when the keys entered a KV cache (`checksums`), so
    that a fault in the stored keys is located too (Kc2 made from the keys now would follow it).

    The weighted checksum ``Sc2 = Q·Kc2ᵀ`` is computed only here, and ``D2 = Sc2 − Σ_l (l+1)·S[i, l·s+r]``
    locates one faulty key per group at ``round(D2/D1) − 1`` (a real key, within a quarter of an
    integer). A located element is rebuilt as ``Sc1 − Σ(other members of the group)``, or with PASA
    recomputed with the GEMM's own fp16 arithmetic; the rows of groups that cannot be located are
    recomputed whole. Returns (S (BLOCK_M, BLOCK_N), cnt) with the ``corrected`` and ``recomputed``
    events counted."""
    L: tl.constexpr = BLOCK_N // 16
    # weighted checksum, only now: Sc2 = Q·Kc2ᵀ, D2 = Sc2 − Σ_l (l+1)·S[i, l·s+r] (taken as D2/L)
    if KC2_TABLE:
        kc2 = tl.load(KC2 + cb * (16 * BLOCK_D) + r16[:, None] * BLOCK_D + tl.arange(0, BLOCK_D)[None, :])
    else:
        kc2 = tl.sum(tl.reshape(k.to(tl.float32), (L, 16, BLOCK_D)) * wl[:, None, None], axis=0)
    c0, c1, c2, cic = _split(tl.trans(kc2), tl.max(kabs, axis=0) * L, k.dtype, PARTS, SCALE_CS)
    sc2 = _parts_dot(q, c0, c1, c2, PARTS, DOT_F32) * cic
    if not (PASA or FOLD):
        sc2 = sc2 * scale
    d2s = sc2 * (1.0 / L) - tl.sum(sg * (wl * (1.0 / L))[None, :, None], axis=1)  # D2/L (`_locate`)
    loc, ok = _locate(d1, d2s, bad, sg)
    ok = ok & (start_n + loc * 16 + r16[None, :] < N)  # a real key
    redo = bad & ~ok
    cnt = _bump(cnt, _SCORES + _COR, tl.sum(tl.sum(ok.to(tl.int32), axis=1), axis=0))
    cnt = _bump(cnt, _SCORES + _REC, tl.sum(tl.sum(redo.to(tl.int32), axis=1), axis=0))
    member = tl.arange(0, L)[None, :, None] == loc[:, None, :]
    if PASA:  # recompute located elements with the GEMM's own fp16 arithmetic
        s16 = tl.dot(q, tl.trans(k), out_dtype=tl.float16).to(tl.float32)
        sg = tl.where(member & ok[:, None, :], tl.reshape(s16, (BLOCK_M, L, 16)), sg)
    else:  # rebuild located elements: Sc1 − Σ(other members of the group)
        others = tl.sum(tl.where(member, 0.0, sg), axis=1)
        sg = tl.where(member & ok[:, None, :], (sc1 - others)[:, None, :], sg)
    s = tl.reshape(sg, (BLOCK_M, BLOCK_N))
    redo_row = tl.max(redo.to(tl.int32), axis=1) > 0
    if tl.sum(redo_row.to(tl.int32), axis=0) > 0:  # recompute those rows' scores
        # (PASA: fp32 accumulation, which also repairs a genuine fp16 overflow)
        s_re = _dot(q, tl.trans(k), tl.zeros((BLOCK_M, BLOCK_N), tl.float32), DOT_F32)
        if not (PASA or FOLD):
            s_re = s_re * scale
        s = tl.where(redo_row[:, None], s_re, s)
    return s, cnt
