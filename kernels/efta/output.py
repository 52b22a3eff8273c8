"""Steps 6–8 once every key has been seen: the row-sum range check, the normalisation, GEMM II's unified
output verification and repair, the recompute of flagged rows, the event atomics and the store.

GEMM II's checksums ``Oc1 = P·Vc1`` and ``Oc2 = P·Vc2`` go through the same ``P`` and the same α
rescale as ``O`` (`kernel._key_loop`), are normalised by ``l`` like it, and are verified once here
(`_output_tests`): a single faulty element of an output group is located with ``Oc2`` and rebuilt
from the checksum (``checksum − Σ others``), other failing rows are recomputed. The clean pass carries
only ``Oc1``, probes steps 6–7 with it, and leaves ``Oc2`` to the repairing pass; the split-key
decode carries ``Oc2`` in every partial, since its merge needs it.

Recompute: flagged rows (step 6, or step 1/7 groups that cannot be located) run a second, plain
(unchecked, uninjected) flash pass over the key blocks for the whole query block (`_plain_pass`),
only when some row of that block is flagged, and take the flagged rows from it.

Non-finite inputs count one ``nonfinite_input`` at ``attn.scores`` per call: ``Flag`` holds the last
call id that counted, so the programs of one call count it once.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..tl_common import dot as _dot
from .common import (
    _COR,
    _DET,
    _I_OUTPUT,
    _NONF,
    _OUTPUT,
    _REC,
    _ROWSUM,
    _UNC,
    _add_events,
    _bump,
    _inject,
    _locate,
)
from .masks import _bias_mask, _early_mask


@triton.jit
def _plain_pass(q, Kb, Vb, skn, skd, svn, svd, b, h, offs_m, offs_d, M, N, D, scale, window, lo, hi,
                Bias, sbb, sbh, sbm, sbn, Mask, smb, smh, smm, smn,
                BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
                HAS_WINDOW: tl.constexpr, HAS_BIAS: tl.constexpr, MASK_KIND: tl.constexpr,
                DOT_F32: tl.constexpr, EVEN_D: tl.constexpr):
    """Plain flash attention of the program's rows over key blocks [lo, hi): the recompute path
    (no checks, no injection). Returns the normalised (BLOCK_M, BLOCK_D) fp32 output."""
    m_i = tl.full((q.shape[0],), -float("inf"), tl.float32)
    l_i = tl.zeros((q.shape[0],), tl.float32)
    acc = tl.zeros((q.shape[0], BLOCK_D), tl.float32)
    offs_j = tl.arange(0, BLOCK_N)
    d_ok = offs_d < D
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_j
        mtile = _early_mask(offs_m, offs_n, b, h, M, N, Mask, smb, smh, smm, smn, MASK_KIND)
        kv_ok = offs_n[:, None] < N
        if not EVEN_D:
            kv_ok = kv_ok & d_ok[None, :]
        k = tl.load(Kb + offs_n[:, None] * skn + offs_d[None, :] * skd, mask=kv_ok, other=0.0)
        v = tl.load(Vb + offs_n[:, None] * svn + offs_d[None, :] * svd, mask=kv_ok, other=0.0)
        s = _dot(q, tl.trans(k), tl.zeros((q.shape[0], BLOCK_N), tl.float32), DOT_F32) * scale
        s, _ = _bias_mask(s, offs_m, offs_n, b, h, M, N, window, True, Bias, sbb, sbh, sbm, sbn,
                          Mask, smb, smh, smm, smn, mtile, HAS_BIAS, MASK_KIND, CAUSAL, HAS_WINDOW, False, False)
        mb = tl.max(s, axis=1)
        m_new = tl.maximum(m_i, mb)
        base = tl.where(m_new == -float("inf"), 0.0, m_new)
        p = tl.exp(s - base[:, None])
        alpha = tl.where((m_i == -float("inf")) & (m_new == -float("inf")), 1.0, tl.exp(m_i - m_new))
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], DOT_F32)
        m_i = m_new
    return tl.where(l_i[:, None] == 0, 0.0, acc / l_i[:, None])


@triton.jit
def _normalise(acc, l_i, bh, offs_m, offs_d, M, D, Inj, INJ_O: tl.constexpr):
    """Step 7's O = acc / l (0 for rows that saw no key), with the `attn.output` faults applied."""
    o = tl.where(l_i[:, None] == 0.0, 0.0, acc / l_i[:, None])
    if INJ_O != 0:
        o = _inject(o, Inj, _I_OUTPUT, INJ_O, bh, offs_m[:, None], offs_d[None, :], M, D)
    return o


@triton.jit
def _output_tests(acc, l_i, lc, m_i, nvalid, oc1, vmax, nf, bh, offs_m, offs_d, row_ok, M, D, nblocks, nsplit, gu,
                  Inj, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, INJ_O: tl.constexpr, FOLD: tl.constexpr):
    """The tests of steps 6–7, counting nothing. Returns O (normalised, output faults applied), O
    grouped (BLOCK_M, LVP, 16), O1 = Oc1/l and D1 = O1 − Σ_l O (BLOCK_M, 16), the rows failing the
    row-sum test (BLOCK_M,), the (row, group) pairs failing the output test (BLOCK_M, 16), and nf with
    non-finite V folded in. `_finish` counts and repairs from these; on the clean pass, which carries
    no Oc2, any failure sends the query block through the repairing pass first. m_i (BLOCK_M,) is the
    final row max: with FOLD the max element's P is 2^y with |y| ≤ 2·u·|m·log2 e| (`_softmax_steps`),
    so the lower bound 1 − τ_l gets 4·g·|m| more room (u·|m| per rounding, a factor 2 spare)."""
    BLOCK_M: tl.constexpr = acc.shape[0]
    LVP: tl.constexpr = BLOCK_D // 16
    FLT_MAX: tl.constexpr = 3.4028234663852886e38
    nf = nf | tl.max((~(vmax <= FLT_MAX)).to(tl.int32), axis=0)  # non-finite V
    chk = nf == 0
    # ---- 6. row sum check ----
    tau_l = 2.0 * gu * (BLOCK_N + 2 * (nblocks + nsplit - 1) + 4)
    if FOLD:
        tau_l = tau_l + tl.where(tl.abs(m_i) < FLT_MAX, 4.0 * gu * tl.abs(m_i), 0.0)
    # l and its twin lc are two columns of GEMM II's checksum product, rescaled alike: equal bit for bit clean
    fine = (l_i >= 1.0 - tau_l) & (l_i <= nvalid.to(tl.float32) * (1.0 + tau_l)) & (l_i == lc)
    bad6 = tl.where(nvalid > 0, ~fine, l_i != 0.0) & row_ok & chk
    # ---- 7. normalise, inject, unified verification ----
    o = _normalise(acc, l_i, bh, offs_m, offs_d, M, D, Inj, INJ_O)
    o1 = tl.where(l_i[:, None] == 0.0, 0.0, oc1 / l_i[:, None])
    og = tl.reshape(o, (BLOCK_M, LVP, 16))
    d1 = o1 - tl.sum(og, axis=1)
    thr = (2.0 * gu * (BLOCK_N + 2 * (nblocks + nsplit - 1) + tl.cdiv(D, 16) + 4)) * vmax
    bad7 = ~(tl.abs(d1) <= thr[None, :]) & row_ok[:, None] & chk
    return o, og, o1, d1, bad6, bad7, nf


@triton.jit
def _finish(acc, l_i, lc, m_i, nvalid, oc1, oc2, have_oc2, vmax, nf, cnt, q, Kb, Vb, skn, skd, svn, svd, b, h, bh,
            offs_m, offs_d, row_ok, io_ok, M, N, D, scale, window, lo, hi, nblocks, nsplit, gu,
            Bias, sbb, sbh, sbm, sbn, Mask, smb, smh, smm, smn, Inj, Out, sob, soh, som, sod,
            Cnt, cst0, cst1, Flag, call_id,
            BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
            HAS_BIAS: tl.constexpr, MASK_KIND: tl.constexpr, DETECT: tl.constexpr, CORRECT: tl.constexpr,
            INJ_O: tl.constexpr, DOT_F32: tl.constexpr, EVEN_D: tl.constexpr, FOLD: tl.constexpr):
    """Steps 6–8 for a block of query rows once every key has been seen: row-sum check, normalisation,
    output injection, unified output verification and repair, recompute of flagged rows, the event
    atomics, and the store. acc (BLOCK_M, BLOCK_D) fp32 and l_i, lc, m_i, nvalid (BLOCK_M,) are the loop's
    (or the split-key merge's) state; oc1, oc2 (BLOCK_M, 16) the output checksums (oc2 only
    meaningful where ``have_oc2``: otherwise a failing output group is recomputed, never located); vmax
    (16,) max_n Σ_l |V|. ``nsplit`` > 1 when the keys were split across programs (one more rescale per
    split in the rounding bounds)."""
    BLOCK_M: tl.constexpr = acc.shape[0]
    LVP: tl.constexpr = BLOCK_D // 16
    wv = (tl.arange(0, LVP) + 1).to(tl.float32)
    r16 = tl.arange(0, 16)
    redo_rows = row_ok & False
    if not DETECT:
        o = _normalise(acc, l_i, bh, offs_m, offs_d, M, D, Inj, INJ_O)
    else:
        o, og, o1, d1, bad6, bad7, nf = _output_tests(acc, l_i, lc, m_i, nvalid, oc1, vmax, nf, bh, offs_m, offs_d,
                                                      row_ok, M, D, nblocks, nsplit, gu, Inj, BLOCK_N, BLOCK_D,
                                                      INJ_O, FOLD)
        # ---- 6. row sum: count; the rows are recomputed ----
        n6 = tl.sum(bad6.to(tl.int32), axis=0)
        cnt = _bump(cnt, _ROWSUM + _DET, n6)
        if CORRECT:
            cnt = _bump(cnt, _ROWSUM + _REC, n6)
            redo_rows = bad6
        else:
            cnt = _bump(cnt, _ROWSUM + _UNC, n6)
        # ---- 7. output groups (rows already flagged by step 6 are recomputed anyway) ----
        lv = tl.cdiv(D, 16)
        bad = bad7 & ~redo_rows[:, None]
        nbad = tl.sum(tl.sum(bad.to(tl.int32), axis=1), axis=0)
        if nbad > 0:
            cnt = _bump(cnt, _OUTPUT + _DET, nbad)
            if CORRECT:
                o2 = tl.where(l_i[:, None] == 0.0, 0.0, oc2 / l_i[:, None])
                d2s = o2 * (1.0 / LVP) - tl.sum(og * (wv * (1.0 / LVP))[None, :, None], axis=1)  # D2/LVP
                loc, ok = _locate(d1, d2s, bad, og)
                # a real column; without Oc2 (the clean pass's state), recompute
                ok = ok & (loc < lv) & (loc * 16 + r16[None, :] < D) & (have_oc2 != 0)
                redo = bad & ~ok
                cnt = _bump(cnt, _OUTPUT + _COR, tl.sum(tl.sum(ok.to(tl.int32), axis=1), axis=0))
                cnt = _bump(cnt, _OUTPUT + _REC, tl.sum(tl.sum(redo.to(tl.int32), axis=1), axis=0))
                member = tl.arange(0, LVP)[None, :, None] == loc[:, None, :]
                others = tl.sum(tl.where(member, 0.0, og), axis=1)
                og = tl.where(member & ok[:, None, :], (o1 - others)[:, None, :], og)
                o = tl.reshape(og, (BLOCK_M, BLOCK_D))
                redo_rows = redo_rows | (tl.max(redo.to(tl.int32), axis=1) > 0)
            else:
                cnt = _bump(cnt, _OUTPUT + _UNC, nbad)
        if CORRECT:
            if tl.sum(redo_rows.to(tl.int32), axis=0) > 0:  # recompute flagged rows from scratch
                o_re = _plain_pass(q, Kb, Vb, skn, skd, svn, svd, b, h, offs_m, offs_d, M, N, D, scale,
                                   window, lo, hi, Bias, sbb, sbh, sbm, sbn, Mask, smb, smh, smm, smn,
                                   BLOCK_N, BLOCK_D, CAUSAL, HAS_WINDOW, HAS_BIAS, MASK_KIND, DOT_F32, EVEN_D)
                o = tl.where(redo_rows[:, None], o_re, o)
        # events
        _add_events(Cnt, cst0, cst1, cnt)
        if nf != 0:  # non-finite input: one event per call (Flag holds the last call id that counted)
            prev = tl.atomic_max(Flag, call_id)
            if prev < call_id:
                tl.atomic_add(Cnt + _NONF * cst1, 1)  # attn.scores row

    # ---- 8. store in the input dtype ----
    tl.store(Out + b * sob + h * soh + offs_m[:, None] * som + offs_d[None, :] * sod,
             o.to(Out.dtype.element_ty), mask=io_ok)
