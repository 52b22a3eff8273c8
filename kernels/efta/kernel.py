"""The EFTA forward program `_efta_fwd` and its key loop `_key_loop`, which call the steps of `scores`,
`softmax` and `output` in the contract's order.

One program owns a query block (BLOCK_M rows) of one (batch, head), or with PACK the query heads of
one kv head (`decode._program_rows`), and walks the key blocks (BLOCK_N keys): the Q block stays in
SRAM, K/V blocks and their checksum-table rows are streamed, the online softmax runs in fp32.

A clean pass, and a repair pass only when needed (`_key_loop`): the clean pass over the key blocks has
no data-dependent branch and no block-wide reduction. Step 3 raises per-row flags; steps 1 and 4 only
keep each (row, group)'s worst margin over the key blocks (``|D1| − qn1·kabs`` and the product
check's, one FFMA each on the GPU, a NaN-propagating running max), tested once after the loop
against the margins' constant bounds (``s_floor``, `softmax._exp_limit`), so the loop stays as
pipelineable as the unchecked one. If any row of the query block raised a flag, the program runs the
key loop again in repair mode: one block-wide test per key block guards a branch that counts and
repairs in the contract's order (step 1, then steps 3–4 redone on the repaired scores). That branch
recomputes GEMM I, re-applying the same injected faults, which are deterministic. A clean-pass
step-1 failure that the second pass does not see (a transient fault) counts as detected and
recomputed.

Prefill with correction runs the two passes in two launches (``PHASE``, `host`): compiled into one
kernel, the repairing pass's state makes ptxas spill inside the clean loop.

The same source with ``DETECT=False`` compiles to plain flash attention (the baseline); injection
stays available there.

`_efta_fwd`'s arguments, by group (Triton takes them flat: a tuple argument would change the
specialisation and the launch path, so the signature stays as it is):

* tensors: ``Q, K, V, Out`` (inputs, output), ``Cnt, Flag`` (counter block, the per-call non-finite
  flag), ``Bias, Mask`` (read through strides), ``Inj`` (injection table), ``KC, VC, KA, VA, SC``
  (checksum tables), ``KC2`` (a KV cache's stored Kc2 table, with ``KC2_TABLE``), ``W`` (split-key
  partials), ``KS`` (PASA's shifted keys), ``Rep`` (the clean launch's flags for the repair launch),
  ``Arr`` (split-key arrival cells);
* strides: ``sq*, sk*, sv*, so*`` (b, h, row, d), ``sb*, sm*`` (bias, mask), ``cst0, cst1`` (counters);
* sizes and call scalars: ``Hq, Hkv, M, N, D, GROUP, scale, window, call_id, nsplit``;
* thresholds (`configs.Bounds`): ``gu, exp_tol, exp_base, exp_xmin, snvr_rel, snvr_cap``; PASA's ``pasa_t1,
  s_floor, gamma, gamma_last``;
* autotune keys only: ``M_KEY, N_KEY``;
* constexprs: shape (``BLOCK_D, EVEN_D, BLOCK_M, BLOCK_N``), masks (``CAUSAL, HAS_WINDOW, HAS_BIAS,
  MASK_KIND``), checks (``DETECT, CORRECT``), injection (one mode per attention site: ``INJ_S, INJ_MS, INJ_M,
  INJ_X, INJ_P, INJ_PL, INJ_A, INJ_L, INJ_ACC, INJ_MC, INJ_O, INJ_CS``; and ``NO_SKIP``), checksum operands
  (``PARTS, SCALE_CS, DOT_F32``), form (``INTERP, SPLIT, PASA, HALF_STATE, PHASE, FOLD, PACK``; ``TMA``: K
  and V through tensor descriptors, `_key_loop`), stored
  tables (``KC2_TABLE``: the tables were made when the keys entered a KV cache, and step 1 locates with
  their Kc2).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..tl_common import dot as _dot
from .checksums import _VC_ONES, _fold_ones, _fold_parts, _load_parts, _scaled, _vc_dot_wide
from .common import (
    _DET,
    _I_ACC,
    _I_CHECKSUM,
    _I_MCARRY,
    _I_ROWSUM,
    _NSLOT,
    _REC,
    _SCORES,
    _UNC,
    _add_events,
    _bump,
    _inject,
    _max_nan,
    _nanmax,
)
from .decode import _merge_splits, _program_rows
from .masks import _early_mask, _edge_block, _key_range
from .output import _finish, _output_tests
from .scores import (
    _checksum_faults,
    _score_checksum,
    _score_checksum_wide,
    _score_margin,
    _score_repair,
    _score_test,
    _scores,
)
from .softmax import _exp_limit, _rescale, _softmax_steps


@triton.jit
def _fresh_state(BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """Empty loop state: m (−inf), l, O (BLOCK_M, BLOCK_D), the row-sum twin lc, the GEMM II checksums
    Oc1, Oc2 (BLOCK_M, 16), nvalid (int32), vmax (16,), and the event slots (_NSLOT,) int32.

    The GEMM II checksums Oc1 = P·Vc1 and Oc2 = P·Vc2 go through the same α rescale as O, and so do l
    and lc, two ones columns of the P·Vc1 dot's operand. Vc comes from the pre-pass's table, stored
    K-major (`checksums`): built in registers inside the loop, that wgmma operand gives wrong sums on
    the H100."""
    return (tl.full((BLOCK_M,), -float("inf"), tl.float32), tl.zeros((BLOCK_M,), tl.float32),
            tl.zeros((BLOCK_M, BLOCK_D), tl.float32), tl.zeros((BLOCK_M,), tl.float32),
            tl.zeros((BLOCK_M, 16), tl.float32), tl.zeros((BLOCK_M, 16), tl.float32),
            tl.zeros((BLOCK_M,), tl.int32), tl.zeros((16,), tl.float32), tl.zeros((_NSLOT,), tl.int32))


@triton.jit
def _key_loop(q, qn1, nf, Kb, Vb, Kd, Vd, tb, th, KSb, skn, skd, svn, svd, KC, VC, KA, VA, SC, KC2, cs_row, Inj, b, h,
              bh,
              start_m, offs_m, offs_d, row_ok, d_ok, M, N, D, nblocks, window, scale, scan_lo, scan_hi,
              Bias, sbb, sbh, sbm, sbn, Mask, smb, smh, smm, smn,
              exp_tol, exp_base, exp_xmin, snvr_rel, snvr_cap, s_floor, gamma, gamma_last,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
              HAS_WINDOW: tl.constexpr, HAS_BIAS: tl.constexpr, MASK_KIND: tl.constexpr, DETECT: tl.constexpr,
              CORRECT: tl.constexpr, INJ_S: tl.constexpr, INJ_MS: tl.constexpr, INJ_M: tl.constexpr,
              INJ_X: tl.constexpr,
              INJ_P: tl.constexpr, INJ_PL: tl.constexpr, INJ_A: tl.constexpr, INJ_L: tl.constexpr,
              INJ_ACC: tl.constexpr, INJ_MC: tl.constexpr, INJ_CS: tl.constexpr, PARTS: tl.constexpr,
              SCALE_CS: tl.constexpr, DOT_F32: tl.constexpr,
              INTERP: tl.constexpr, EVEN_D: tl.constexpr, PASA: tl.constexpr, HALF_STATE: tl.constexpr,
              OC2: tl.constexpr, REPAIR: tl.constexpr, FOLD: tl.constexpr, KC2_TABLE: tl.constexpr,
              TMA: tl.constexpr):
    """Steps 1–5 over the key blocks [scan_lo, scan_hi) for one block of query rows.

    Wide (BLOCK_N = 128, the clean launch of a correcting prefill, `configs._wide`): a key block holds NB = 2
    checksum blocks of CSN = 64 keys (table rows cb, cb + 1; jblk counts checksum blocks); each one's
    step-1 and step-4 groups are tested on its own row, so the flags are those of 64-key blocks and the
    repairing launch, on 64-key blocks, counts as the reference does.

    TMA: the K and V tiles come through the tensor descriptors Kd, Vd ((B, Hkv, N, D), blocks of
    (1, 1, BLOCK_N, BLOCK_D), at batch tb and kv head th, int32); the descriptor fills keys past N and
    columns past D with zeros, as the masked pointer loads do.

    The clean pass (REPAIR=False) has no data-dependent branch and no block-wide reduction in the
    loop: the checks only raise per-row flags, so the loop pipelines like the unchecked one. When a
    flag was raised, the caller runs the loop again with REPAIR=True. That pass tests each key
    block, and the blocks whose test fails take the repair branch. It recomputes GEMM I with the
    same (deterministic) injected faults, and counts and repairs in the contract's order.

    Row sum (DETECT): l = Σ_n P_lp and its twin lc are columns 0 and 1 of the ones group of the P·Vc1
    dot (`checksums._fold_ones`; in the wide fp16 pass, of a dot of P with ones, `checksums._vc_dot_wide`),
    carried as that (BLOCK_M, 16) group through the loop, where the `attn.rowsum` faults strike column 0;
    unchecked, l is the fp32 row sum of P (FADD).

    Returns the online-softmax state m_i, l_i (BLOCK_M,), acc (BLOCK_M, BLOCK_D); the checksum
    state lc (BLOCK_M,), oc1, oc2 (BLOCK_M, 16), nvalid (BLOCK_M,) int32, vmax (16,); the event
    slots cnt (_NSLOT,) int32 (REPAIR only); nf; and the clean pass's flags: rows with a raised flag
    (BLOCK_M,) bool and failing step-1 groups per row (BLOCK_M,) int32 (groups (row, residue) that
    failed in some key block: a group failing in two blocks counts once).
    """
    L: tl.constexpr = BLOCK_N // 16  # key groups per block (checksum stride 16)
    NB: tl.constexpr = (BLOCK_N + 63) // 64  # checksum blocks per key block: 2 in a wide clean pass
    CSN: tl.constexpr = BLOCK_N // NB  # keys per checksum block (the tables', the counters' and the reference's)
    LC: tl.constexpr = L // NB  # keys per (row, residue) group of a checksum block
    # a wide key block only in the clean pass of a phased prefill, uninjected at block-indexed sites
    tl.static_assert(NB == 1 or not DETECT or not (REPAIR or PASA or OC2 or HALF_STATE or KC2_TABLE or INJ_M != 0
                                                   or INJ_A != 0 or INJ_L != 0 or INJ_ACC != 0 or INJ_CS != 0
                                                   or INJ_MC != 0))
    STACK: tl.constexpr = not SCALE_CS  # wide V-checksum operand stacked (no slice scales) or one per block
    VROWS: tl.constexpr = 32 * PARTS + _VC_ONES  # rows of a key block's V-checksum table (`checksums.vc_rows`)
    tl.static_assert(not (HALF_STATE and DETECT))  # PASA's fp16 state runs unchecked (`host._validate`)
    offs_j = tl.arange(0, BLOCK_N)
    m_i, l_i, acc, lc, oc1, oc2, nvalid, vmax, cnt = _fresh_state(BLOCK_M, BLOCK_D)
    wl = (tl.arange(0, L) + 1).to(tl.float32)
    r16 = tl.arange(0, 16)
    f_avg = tl.zeros((BLOCK_M,), tl.float32)  # PASA: global pseudo-average F̄ of the blocks seen so far
    nvis = tl.full([], 0, tl.int32)  # PASA: key blocks seen so far
    flag_rows = row_ok & False
    n1_rows = tl.zeros((BLOCK_M,), tl.int32)
    NEG_INF: tl.constexpr = -float("inf")
    # m's shadow: −m, kept by min over the negated block maxima. A fault in the register of m between two
    # blocks changes α and every later exponent consistently, so no other check sees it; m ≠ −shadow where a
    # block reads m (and after the loop, where the split merge and step 6 read it) does
    nm_i = tl.full((BLOCK_M,), float("inf"), tl.float32)
    carry_bad = row_ok & False
    worst1 = tl.full((BLOCK_M, 16), NEG_INF, tl.float32)  # clean pass: worst step-1 / step-4 margins
    worst4 = tl.full((BLOCK_M, 16), NEG_INF, tl.float32)  # per (row, group) over the key blocks
    lt = tl.zeros((BLOCK_M, 16), tl.float32)  # checked: the ones group of GEMM II's checksum dot (l, twin, 0…)
    # the wide fp16 pass's ones operand (BLOCK_N, 16): `VC_ONES` ones columns, made once (`_vc_dot_wide`)
    ones_op = tl.where(r16[None, :] < _VC_ONES, 1.0, tl.zeros((BLOCK_N, 16), tl.float32)).to(Vb.dtype.element_ty)

    for start_n in range(scan_lo, scan_hi, BLOCK_N):
        jblk = start_n // CSN  # (the first) checksum block
        offs_n = start_n + offs_j
        edge = _edge_block(start_m, start_n, M, N, window, BLOCK_M, BLOCK_N, CAUSAL, HAS_WINDOW)
        kv_ok = offs_n[:, None] < N
        if not EVEN_D:
            kv_ok = kv_ok & d_ok[None, :]
        if TMA:
            v = tl.reshape(Vd.load([tb, th, start_n, 0]), (BLOCK_N, BLOCK_D))
        else:
            v = tl.load(Vb + offs_n[:, None] * svn + offs_d[None, :] * svd, mask=kv_ok, other=0.0)

        mtile = _early_mask(offs_m, offs_n, b, h, M, N, Mask, smb, smh, smm, smn, MASK_KIND)
        # ---- 1. GEMM I ----
        if PASA:  # the shifted keys K' (scale folded in)
            k = tl.load(KSb + offs_n[:, None] * BLOCK_D + offs_d[None, :])
        elif TMA:
            k = tl.reshape(Kd.load([tb, th, start_n, 0]), (BLOCK_N, BLOCK_D))
        else:
            k = tl.load(Kb + offs_n[:, None] * skn + offs_d[None, :] * skd, mask=kv_ok, other=0.0)
        s = _scores(q, k, scale, Inj, bh, offs_m, offs_n, M, N, INJ_S, PASA, DOT_F32, FOLD)
        cb = cs_row + jblk  # this key block's (first) row in the checksum tables
        if NB > 1 and DETECT:  # the wide clean pass: each checksum block's Sc1 and groups
            sc1, kabs, knf = _score_checksum_wide(q, KC, KA, SC, cb, nblocks - jblk, offs_d, scale, BLOCK_D, PARTS, NB,
                                                  DOT_F32, FOLD)
            tt = tl.arange(0, NB)
            vtile = _nanmax(tl.load(VA + (cb + tt)[:, None] * 16 + r16[None, :], mask=(tt < nblocks - jblk)[:, None],
                                    other=0.0), 0, INTERP)
        elif DETECT or PASA:
            sc1_raw, kabs, knf = _score_checksum(q, KC, KA, SC, cb, offs_d, scale, BLOCK_D, PARTS, DOT_F32, PASA,
                                                 FOLD)
            sc1 = _checksum_faults(sc1_raw, Inj, bh, offs_m, jblk, M, nblocks, INJ_CS)
        if DETECT:
            if NB == 1:
                vtile = tl.load(VA + cb * 16 + r16)
            nf = nf | knf  # a non-finite key is an input problem, not a fault
            vmax = _max_nan(vmax, vtile)
            chk = nf == 0
            if REPAIR:
                _, _, bad = _score_test(s, sc1, kabs, qn1, s_floor, row_ok, chk, L, INTERP)
                nbad_row = tl.sum(bad.to(tl.int32), axis=1)
            else:  # the clean pass keeps each group's worst margin; one test after the loop
                worst1 = _max_nan(worst1, tl.where(chk, _score_margin(s, sc1, kabs, qn1, NB, INTERP), NEG_INF))

        s_in = s
        if PASA:
            # frame of the global pseudo-average F̄ (the PASA paper, Algorithm 1 lines 13–15): the block's
            # pseudo-average S̄' = Σ_r Sc1[:, r] / w (from the checksum dot, not the fp16 scores),
            # F̄ ← (j·F̄ + S̄')/(j + 1); the block enters as S' + Δm'_j, the state moves by Δm'_{j−1}
            w = tl.minimum(N - start_n, BLOCK_N).to(tl.float32)
            sbar = tl.sum(sc1_raw, axis=1) / w
            f_new = tl.where(nvis == 0, sbar, (f_avg * nvis + sbar) / (nvis + 1))
            dcur = (sbar - f_new) * gamma
            dcur = tl.where(w < BLOCK_N, dcur + sbar * (gamma_last - gamma), dcur)
            dprev = tl.where(nvis == 0, 0.0, (f_avg - f_new) * gamma)
            m_i = m_i + dprev  # −inf stays −inf
            nm_i = nm_i - dprev
            f_avg = f_new
            nvis += 1
            s_in = s + dcur[:, None]

        if DETECT:
            carry_bad = carry_bad | (m_i != -nm_i)
        # ---- 2.–4. bias and masks, running max, exp (clean path: the checks only raise flags) ----
        sm, m_new, nm_new, p, pd, bad_row, e4, cnt, nf = _softmax_steps(
            s_in, m_i, nm_i, cnt, nf, offs_m, offs_n, row_ok, b, h, bh, jblk, M, N, nblocks, window, edge, scale,
            Bias, sbb, sbh, sbm, sbn, Mask, smb, smh, smm, smn, mtile, Inj, exp_tol, exp_base, exp_xmin, snvr_rel,
            snvr_cap, HAS_BIAS, MASK_KIND, CAUSAL, HAS_WINDOW, DETECT, CORRECT, INJ_MS, INJ_M, INJ_X, INJ_P, INJ_PL,
            v.dtype,
            INTERP, False, HALF_STATE, FOLD)
        if DETECT:
            if REPAIR:
                lim4 = _exp_limit(exp_tol, exp_base, exp_xmin, L, v.dtype, INTERP, FOLD)
                bad4 = ~(e4 <= lim4) & row_ok[:, None] & (nf == 0)
                bad_row = bad_row | (tl.max(bad4.to(tl.int32), axis=1) > 0)
                # One block-wide test per key block (step-1 groups that failed, plus rows that raised a
                # step 3/4 flag ·2^16). A failing block takes the branch that recomputes its scores,
                # with the same injected faults, and counts and repairs in the contract's order
                # (step 1, then 3–4).
                flags = tl.sum(nbad_row + bad_row.to(tl.int32) * 65536, axis=0)
                if flags > 0:
                    s = _scores(q, k, scale, Inj, bh, offs_m, offs_n, M, N, INJ_S, PASA, DOT_F32, FOLD)
                    sc1, kabs, knf = _score_checksum(q, KC, KA, SC, cb, offs_d, scale, BLOCK_D, PARTS, DOT_F32,
                                                     PASA, FOLD)
                    sc1 = _checksum_faults(sc1, Inj, bh, offs_m, jblk, M, nblocks, INJ_CS)
                    sg, d1, bad = _score_test(s, sc1, kabs, qn1, s_floor, row_ok, chk, L, INTERP)
                    nbad = tl.sum(tl.sum(bad.to(tl.int32), axis=1), axis=0)
                    if nbad > 0:
                        cnt = _bump(cnt, _SCORES + _DET, nbad)
                        if CORRECT:
                            s, cnt = _score_repair(q, k, sg, d1, sc1, kabs, bad, cnt, start_n, N, scale, wl, r16,
                                                   KC2, cb, BLOCK_M, BLOCK_N, BLOCK_D, PARTS, SCALE_CS, DOT_F32,
                                                   PASA, FOLD, KC2_TABLE)
                        else:
                            cnt = _bump(cnt, _SCORES + _UNC, nbad)
                    else:
                        # the clean path saw failing groups that the recomputed GEMM does not have: a
                        # transient fault in GEMM I, repaired by the recomputation
                        n1 = flags % 65536
                        cnt = _bump(cnt, _SCORES + _DET, n1)
                        cnt = _bump(cnt, _SCORES + _REC, n1)
                    s_in = s
                    if PASA:
                        s_in = s + dcur[:, None]
                    sm, m_new, nm_new, p, pd, bad_row, _, cnt, nf = _softmax_steps(
                        s_in, m_i, nm_i, cnt, nf, offs_m, offs_n, row_ok, b, h, bh, jblk, M, N, nblocks, window, edge,
                        scale, Bias, sbb, sbh, sbm, sbn, Mask, smb, smh, smm, smn, mtile, Inj, exp_tol, exp_base,
                        exp_xmin, snvr_rel, snvr_cap, HAS_BIAS, MASK_KIND, CAUSAL, HAS_WINDOW, DETECT, CORRECT, INJ_MS,
                        INJ_M, INJ_X, INJ_P, INJ_PL, v.dtype, INTERP, True, HALF_STATE, FOLD)
            else:  # the clean pass only raises flags: rows (step 3), and the step-4 margins
                flag_rows = flag_rows | bad_row
                worst4 = _max_nan(worst4, tl.where(nf == 0, e4, NEG_INF))
            chk = nf == 0
            if HAS_BIAS or MASK_KIND != 0:  # without them the count has a closed form (after the loop)
                nvalid += tl.sum((sm > -float("inf")).to(tl.int32), axis=1)

        # ---- 5. rescale (checked), row sum, GEMM II (+ checksum columns) ----
        alpha, bad_a, cnt = _rescale(m_i, m_new, cnt, row_ok, nf == 0, Inj, bh, offs_m, jblk, M, nblocks, INJ_A,
                                     DETECT, CORRECT, REPAIR, INTERP)
        if DETECT and not REPAIR:
            flag_rows = flag_rows | bad_a
        if not DETECT:  # l from the fp32 P (plain flash attention); checked, from GEMM II's checksum dot below
            if HALF_STATE:  # the PASA paper's full FP16 allocation: every state update rounded to fp16
                alpha = alpha.to(tl.float16).to(tl.float32)
                l_i = ((l_i * alpha).to(tl.float16).to(tl.float32)
                       + tl.sum(p, axis=1).to(tl.float16).to(tl.float32)).to(tl.float16).to(tl.float32)
            else:
                l_i = l_i * alpha + tl.sum(p, axis=1)
            if INJ_L != 0:
                l_i = _inject(l_i, Inj, _I_ROWSUM, INJ_L, bh, offs_m, jblk, M, nblocks)
        if HALF_STATE:  # P·V an FP16 GEMM with FP16 accumulation
            pv = tl.dot(pd, v, out_dtype=tl.float16).to(tl.float32)
            acc = ((acc * alpha[:, None]).to(tl.float16).to(tl.float32) + pv).to(tl.float16).to(tl.float32)
        else:
            acc = _dot(pd, v, acc * alpha[:, None], DOT_F32)
        if INJ_ACC != 0:  # columns past D (BLOCK_D's padding) map past the site's last column: never hit
            acc = _inject(acc, Inj, _I_ACC, INJ_ACC, bh, offs_m[:, None],
                          tl.where(offs_d < D, jblk * D + offs_d, nblocks * D)[None, :], M, nblocks * D)
        if DETECT:
            # [Oc1 | l, twin] += P_lp·[Vc1 slices | 1 | 1 | 0…]: the checksum, the row sum l = Σ_n P_lp and its
            # twin from one dot, the slices side by side (one tensor-core wait, not one per slice), the ones
            # columns unscaled. Two other orders make ptxas serialise every wgmma of the loop (warning C7515,
            # 2.2× the time in one case): Oc accumulated in place like O (in units of each block's slice
            # scale), and this dot issued before P·V.
            vbase = VC + cb * (VROWS * BLOCK_N)
            if NB > 1:
                vz, lz = _vc_dot_wide(pd, ones_op, VC, SC, cb, nblocks - jblk, PARTS, NB, STACK, SCALE_CS, DOT_F32)
            else:
                a = _load_parts(vbase, offs_j, PARTS, BLOCK_N, True)  # (BLOCK_N, 32 or 64)
                aic = tl.load(SC + cb * 4 + 1)
                vz, lz = _fold_ones(_dot(pd, a, tl.zeros((BLOCK_M, a.shape[1]), tl.float32), DOT_F32 or PARTS == 1),
                                    PARTS)
                vz = _scaled(vz, aic, SCALE_CS)
            oc1 = oc1 * alpha[:, None] + vz
            lt = lt * alpha[:, None] + lz
            if INJ_L != 0:  # the `attn.rowsum` faults on l, column 0 of the ones group
                lt = _inject(lt, Inj, _I_ROWSUM, INJ_L, bh, offs_m[:, None], tl.where(r16 == 0, jblk, nblocks)[None, :],
                             M, nblocks)
            if INJ_CS != 0:  # the `attn.checksum` faults on Oc1: columns [32·jblk + 16, 32·jblk + 32)
                oc1 = _inject(oc1, Inj, _I_CHECKSUM, INJ_CS, bh, offs_m[:, None], (jblk * 32 + 16 + r16)[None, :], M,
                              nblocks * 32)
            if OC2:  # the weighted checksum only locates output faults: carried when it may be needed
                c = _load_parts(vbase + (16 * PARTS + _VC_ONES) * BLOCK_N, offs_j, PARTS, BLOCK_N, False)
                cic = tl.load(SC + cb * 4 + 2)
                oc2 = oc2 * alpha[:, None] + _scaled(
                    _fold_parts(_dot(pd, c, tl.zeros((BLOCK_M, c.shape[1]), tl.float32), DOT_F32 or PARTS == 1)),
                    cic, SCALE_CS)
        m_i = m_new
        nm_i = nm_new
        if INJ_MC != 0:  # the `attn.rowmax_carry` faults: m as the next block (or the merge) reads it
            m_i = _inject(m_i, Inj, _I_MCARRY, INJ_MC, bh, offs_m, jblk, M, nblocks)
    if DETECT:  # l and its twin: columns 0 and 1 of the ones group (one cross-thread sum each, once)
        l_i = tl.sum(tl.where(r16[None, :] == 0, lt, 0.0), axis=1)
        lc = tl.sum(tl.where(r16[None, :] == 1, lt, 0.0), axis=1)
    if DETECT:
        # a carried max that lost its shadow: the row's state is the sum of blocks in different frames. Its l
        # made NaN, step 6 recomputes the row (the clean pass: a raised flag, the repairing pass then counts)
        carry_bad = (carry_bad | (m_i != -nm_i)) & row_ok & (nf == 0)
        l_i = tl.where(carry_bad, float("nan"), l_i)
        if not REPAIR:
            flag_rows = flag_rows | carry_bad
    if DETECT and not REPAIR:
        # the clean pass's tests of steps 1 and 4, once: a group fails if it failed in some key block
        n1_rows = tl.sum((~(worst1 <= s_floor) & row_ok[:, None]).to(tl.int32), axis=1)
        lim4 = _exp_limit(exp_tol, exp_base, exp_xmin, LC, Vb.dtype.element_ty, INTERP, FOLD)
        flag_rows = flag_rows | (tl.max((~(worst4 <= lim4) & row_ok[:, None]).to(tl.int32), axis=1) > 0)
    if DETECT and not (HAS_BIAS or MASK_KIND != 0):
        # unmasked keys per row: those in [scan_lo, scan_hi) below N, the causal limit and above the
        # window (what counting S > −inf gives while the scores are finite; a non-finite score raises
        # a step-1 flag, and the repairing pass uses the same count)
        hi_j = tl.minimum(scan_hi, N) + tl.zeros((BLOCK_M,), tl.int32)
        if CAUSAL:
            hi_j = tl.minimum(hi_j, offs_m + (N - M) + 1)
        lo_j = scan_lo + tl.zeros((BLOCK_M,), tl.int32)
        if HAS_WINDOW:
            lo_j = tl.maximum(lo_j, offs_m + (N - M - window) + 1)
        nvalid = tl.maximum(hi_j - lo_j, 0)
    return m_i, l_i, acc, lc, oc1, oc2, nvalid, vmax, cnt, nf, flag_rows, n1_rows


@triton.jit(do_not_specialize=["call_id"])
def _efta_fwd(
    Q, K, V, Out, Cnt, Flag, Bias, Mask, Inj, KC, VC, KA, VA, SC, KC2, W, KS, Rep, Arr,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod,
    sbb, sbh, sbm, sbn, smb, smh, smm, smn, cst0, cst1,
    Hq, Hkv, M, N, D, GROUP, scale, window, call_id, nsplit,
    gu, exp_tol, exp_base, exp_xmin, snvr_rel, snvr_cap,
    pasa_t1, s_floor, gamma, gamma_last,  # PASA: step-1 bound coefficient and floor, recovery factors
    M_KEY, N_KEY,  # autotune keys only (bucketed M, N)
    BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_BIAS: tl.constexpr,
    MASK_KIND: tl.constexpr, DETECT: tl.constexpr, CORRECT: tl.constexpr,
    INJ_S: tl.constexpr, INJ_MS: tl.constexpr, INJ_M: tl.constexpr, INJ_X: tl.constexpr, INJ_P: tl.constexpr,
    INJ_PL: tl.constexpr, INJ_A: tl.constexpr, INJ_L: tl.constexpr, INJ_ACC: tl.constexpr, INJ_MC: tl.constexpr,
    INJ_O: tl.constexpr, INJ_CS: tl.constexpr, NO_SKIP: tl.constexpr, PARTS: tl.constexpr, SCALE_CS: tl.constexpr,
    DOT_F32: tl.constexpr, INTERP: tl.constexpr, EVEN_D: tl.constexpr,
    SPLIT: tl.constexpr, PASA: tl.constexpr, HALF_STATE: tl.constexpr, PHASE: tl.constexpr, FOLD: tl.constexpr,
    PACK: tl.constexpr, KC2_TABLE: tl.constexpr, TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Grid (row blocks · nsplit, Hq, B); with PACK (GQA decode, M = 1) (row blocks · nsplit, Hkv, B),
    the rows of a block being the query heads of one kv head (`_program_rows`).

    SPLIT (split-key decode): each program stores its key range's partial state in W. With the checks
    on, `_efta_combine` merges them in a second launch. With the checks off, each program then counts
    itself in its row block's cell of ``Arr`` (per-device int32 cells, 0 between calls), and the last
    of the row block's ``nsplit`` programs merges the partial states (`_merge_splits`), finishes and
    resets the cell: one launch instead of two (H200, batch 1, Qwen2-0.5B heads over 544 keys: 8.1 µs
    against 9.2). The checked kernel merges in the second launch: merging in the kernel is slower
    there (21.9 µs against 20.3 with the second launch; 38.3 against 28.3 over 4,096 keys)."""
    CSN: tl.constexpr = BLOCK_N // ((BLOCK_N + 63) // 64)  # keys per checksum block (`_key_loop`)
    L: tl.constexpr = CSN // 16  # keys per (row, residue) group of a checksum block (checksum stride 16)
    FLT_MAX: tl.constexpr = 3.4028234663852886e38
    REC: tl.constexpr = (36 + BLOCK_D) * BLOCK_M + 17  # floats per partial-state record (SPLIT)

    start_m = tl.program_id(0) // nsplit
    split = tl.program_id(0) % nsplit  # which share of the key blocks (split-key decode); 0 otherwise
    # PHASE 0: clean and repairing pass in this launch. 1: the clean pass only; a program whose pass
    # raised a flag stores 1 + (failing step-1 groups) in Rep and leaves its block to the PHASE 2
    # launch (else 0, and it finishes here). 2: the repairing pass for the programs Rep names.
    rep_at = Rep + (tl.program_id(2) * Hq + tl.program_id(1)) * tl.num_programs(0) + tl.program_id(0)
    if PHASE == 2:
        rep_val = tl.load(rep_at)
        if rep_val == 0:
            return
    b = tl.program_id(2).to(tl.int64)
    bh = tl.program_id(2) * Hq + tl.program_id(1)  # index into the sites' (B·Hq, ...) shapes (unpacked)
    h, hk, qblk, offs_m, row_ok = _program_rows(start_m, M, GROUP, BLOCK_M, PACK)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    # masks only along rows/keys when D is a power of two: loads stay vectorised and pipelined
    io_ok = row_ok[:, None]
    if not EVEN_D:
        io_ok = io_ok & d_ok[None, :]
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd, mask=io_ok, other=0.0)
    Kb = K + b * skb + hk * skh
    Vb = V + b * svb + hk * svh
    Kd = Kb  # (unread without TMA)
    Vd = Vb
    if TMA:  # K, V (B, Hkv, N, D) with a unit last stride; one (BLOCK_N, BLOCK_D) tile per key block
        nb = tl.num_programs(2)
        Kd = tl.make_tensor_descriptor(K, shape=[nb, Hkv, N, D], strides=[skb, skh, skn, 1],
                                       block_shape=[1, 1, BLOCK_N, BLOCK_D])
        Vd = tl.make_tensor_descriptor(V, shape=[nb, Hkv, N, D], strides=[svb, svh, svn, 1],
                                       block_shape=[1, 1, BLOCK_N, BLOCK_D])

    nblocks = tl.cdiv(N, CSN)  # checksum blocks (the tables' rows per (batch, kv head))
    lo, hi = _key_range(qblk, M, N, window, BLOCK_M, BLOCK_N, CAUSAL, HAS_WINDOW)
    scan_lo = lo
    scan_hi = hi
    if NO_SKIP:  # injecting: visit every block, like the reference
        scan_lo = 0
        scan_hi = N
    if SPLIT:  # this program's share of the key blocks
        per = tl.cdiv(tl.cdiv(N, BLOCK_N), nsplit) * BLOCK_N
        scan_lo = tl.maximum(scan_lo, split * per)
        scan_hi = tl.minimum(scan_hi, split * per + per)

    qn1 = tl.zeros((BLOCK_M,), tl.float32)
    nf = tl.full([], 0, tl.int32)
    if DETECT:
        qa = tl.sum(tl.abs(q.to(tl.float32)), axis=1)
        nf = nf | tl.max((~(qa <= FLT_MAX)).to(tl.int32))
        # 2·g(D+L)·‖scale·Q_i‖₁  (T_s = qn1 · max_d Σ_l |K[l·s+r, d]|; FOLD: unscaled, like its scores)
        if PASA:  # fp16 accumulation (one rounding per 16-deep MMA) on unscaled q (docs/pasa.md)
            qn1 = pasa_t1 * qa
        elif FOLD:
            qn1 = (2.0 * gu * (D + L)) * qa
        else:
            qn1 = (2.0 * gu * (D + L) * scale) * qa
    cs_row = (b * Hkv + hk) * nblocks  # first row of this (batch, kv head) in the checksum tables
    KSb = KS + cs_row * BLOCK_N * BLOCK_D  # PASA: this (batch, kv head)'s shifted keys
    r16 = tl.arange(0, 16)
    # Pass 0 is the clean pass; pass 1, the repairing one, runs only if pass 0 raised a flag. The clean
    # pass does not carry Oc2, which only locates output faults; pass 1 does. The exception is the
    # split-key decode, whose merge needs every partial's Oc2.
    OC2_CLEAN: tl.constexpr = CORRECT and SPLIT
    m_i, l_i, acc, lc, oc1, oc2, nvalid, vmax, cnt = _fresh_state(BLOCK_M, BLOCK_D)
    nf_loop = nf
    flag_rows = row_ok & False
    n1_rows = tl.zeros((BLOCK_M,), tl.int32)
    todo = tl.full([], 1, tl.int32)
    n1 = tl.full([], 0, tl.int32)
    for rep in tl.static_range(2):
        if (rep == 0 and PHASE != 2) or (rep == 1 and PHASE != 1):
            if todo > 0:
                m_i, l_i, acc, lc, oc1, oc2, nvalid, vmax, cnt, nf_loop, flag_rows, n1_rows = _key_loop(
                    q, qn1, nf, Kb, Vb, Kd, Vd, tl.program_id(2), hk.to(tl.int32), KSb, skn, skd, svn, svd, KC, VC,
                    KA, VA, SC, KC2, cs_row, Inj, b, h, bh,
                    qblk, offs_m, offs_d, row_ok, d_ok, M, N, D, nblocks, window, scale, scan_lo, scan_hi,
                    Bias, sbb, sbh, sbm, sbn, Mask, smb, smh, smm, smn,
                    exp_tol, exp_base, exp_xmin, snvr_rel, snvr_cap, s_floor, gamma, gamma_last,
                    BLOCK_M, BLOCK_N, BLOCK_D, CAUSAL, HAS_WINDOW, HAS_BIAS, MASK_KIND, DETECT, CORRECT,
                    INJ_S, INJ_MS, INJ_M, INJ_X, INJ_P, INJ_PL, INJ_A, INJ_L, INJ_ACC, INJ_MC, INJ_CS, PARTS, SCALE_CS,
                    DOT_F32,
                    INTERP, EVEN_D, PASA, HALF_STATE,
                    OC2_CLEAN or (CORRECT and rep == 1), rep == 1, FOLD, KC2_TABLE, TMA)
        if rep == 0:
            if PHASE == 2:  # the clean launch flagged this block
                n1 = rep_val - 1
            else:
                todo = todo * 0
                if DETECT:
                    todo = tl.sum((flag_rows | (n1_rows > 0)).to(tl.int32), axis=0)
                    n1 = tl.sum(n1_rows, axis=0)
                    if CORRECT and not OC2_CLEAN:
                        if todo == 0:  # the clean pass carried no Oc2: if steps 6–7 will find something, redo
                            _, _, _, _, bad6, bad7, _ = _output_tests(acc, l_i, lc, m_i, nvalid, oc1, vmax, nf_loop,
                                                                      bh, offs_m, offs_d, row_ok, M, D, nblocks, 1, gu,
                                                                      Inj, BLOCK_N, BLOCK_D, INJ_O, FOLD)
                            todo = (tl.sum(bad6.to(tl.int32), axis=0)
                                    + tl.sum(tl.sum(bad7.to(tl.int32), axis=1), axis=0))
            if PHASE == 1:
                tl.store(rep_at, tl.where(todo > 0, n1 + 1, 0))
                if todo > 0:
                    return
    if DETECT:
        if (todo > 0) & (tl.sum(cnt, axis=0) == 0):
            # the clean pass saw failing step-1 groups that the second pass does not have: a
            # transient fault in GEMM I, repaired by the recomputation (one event per failing
            # (row, residue) group, however many of its key blocks failed)
            cnt = _bump(cnt, _SCORES + _DET, n1)
            cnt = _bump(cnt, _SCORES + _REC, n1)
    nf = nf_loop

    if SPLIT:  # partial state of this key range, merged by the row block's last program or `_efta_combine`
        rec = W + ((b * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(0) + tl.program_id(0)) * REC
        rows = tl.arange(0, BLOCK_M)
        tl.store(rec + rows, m_i)
        tl.store(rec + BLOCK_M + rows, l_i)
        tl.store(rec + 2 * BLOCK_M + rows, lc)
        tl.store(rec + 3 * BLOCK_M + rows, nvalid.to(tl.float32))
        tl.store(rec + 4 * BLOCK_M + rows[:, None] * BLOCK_D + offs_d[None, :], acc)
        ocp = rec + (4 + BLOCK_D) * BLOCK_M + rows[:, None] * 16 + r16[None, :]
        tl.store(ocp, oc1)
        tl.store(ocp + 16 * BLOCK_M, oc2)
        tl.store(rec + (36 + BLOCK_D) * BLOCK_M + r16, vmax)
        tl.store(rec + (36 + BLOCK_D) * BLOCK_M + 16, nf.to(tl.float32))
        if DETECT:  # the loop's events (steps 1, 3, 4, 5); steps 6–7 count in the merge
            _add_events(Cnt, cst0, cst1, cnt)
        else:  # checks off: the row block's last program merges and finishes (`_efta_combine` with the checks on)
            nq = tl.num_programs(0) // nsplit
            blk = (b * tl.num_programs(1) + tl.program_id(1)) * nq + start_m  # this row block's cell
            tl.debug_barrier()  # every thread's stores of the record before the count (acq_rel: seen by the last)
            if tl.atomic_add(Arr + blk, 1, sem="acq_rel") == nsplit - 1:
                tl.store(Arr + blk, 0)
                base = W + ((b * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(0) + start_m * nsplit) * REC
                m_i, l_i, lc, nvalid, acc, oc1, oc2, vmax, nf = _merge_splits(base, nsplit, BLOCK_M, BLOCK_D, REC)
                _finish(acc, l_i, lc, m_i, nvalid, oc1, oc2, 1, vmax, nf, cnt, q, Kb, Vb, skn, skd, svn, svd, b, h,
                        bh, offs_m, offs_d, row_ok, io_ok, M, N, D, scale, window, lo, hi, nblocks, nsplit, gu,
                        Bias, sbb, sbh, sbm, sbn, Mask, smb, smh, smm, smn, Inj, Out, sob, soh, som, sod,
                        Cnt, cst0, cst1, Flag, call_id, BLOCK_N, BLOCK_D, CAUSAL, HAS_WINDOW, HAS_BIAS, MASK_KIND,
                        DETECT, CORRECT, INJ_O, DOT_F32, EVEN_D, FOLD)
    else:
        have_oc2 = (todo > 0) | OC2_CLEAN  # Oc2 was carried (pass 1 ran, or the split merge needs it)
        _finish(acc, l_i, lc, m_i, nvalid, oc1, oc2, have_oc2, vmax, nf, cnt, q, Kb, Vb, skn, skd, svn, svd, b, h, bh,
                offs_m, offs_d, row_ok, io_ok, M, N, D, scale, window, lo, hi, nblocks, 1, gu,
                Bias, sbb, sbh, sbm, sbn, Mask, smb, smh, smm, smn, Inj, Out, sob, soh, som, sod,
                Cnt, cst0, cst1, Flag, call_id, BLOCK_N, BLOCK_D, CAUSAL, HAS_WINDOW, HAS_BIAS, MASK_KIND,
                DETECT, CORRECT, INJ_O, DOT_F32, EVEN_D, FOLD)
