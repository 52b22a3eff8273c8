"""Steps 3–5: the running row max with its SNVR check, ``P = exp(x)`` with its product check, and the
row sum.

* Step 3 (SNVR, the EFTA paper §4.2): a row-max error cancels out unless it makes exp overflow; the check
  tests that the block's max does not exceed the new running max by more than
  ``τ_m = min(snvr_rel·(1 + |m_new|), snvr_cap)`` and that a changed max is not far below it.
* Step 4: the product check of ``P = exp(x)`` per group (row i, residue r) of L keys, the fp32 product
  of the group's clamped P and one ``lg2`` of it per group (`_exp_test`, constants of the contract).
* Step 5: row sum ``l`` (fp32 sum of P) and its independent twin ``lc`` (a differently ordered
  reduction of the same P: carried per residue group, summed across them after the loop), ``O += P·V``
  with P rounded to the input dtype (as flash attention does), all rescaled by the same α
  (`kernel._key_loop`).

One FFMA per score on the GPU (FOLD): the scores stay unscaled and the exponent is
``fma(s, scale·log2 e, −m·log2 e)``; off where a bias, an additive mask, PASA or score injection needs
the scaled scores, and in the interpreter (`configs._fold`).

Interpreter (``INTERP``): tl.log2 and tl.exp instead of the PTX ``lg2.approx`` and
``ex2.approx.ftz``; because the interpreter runs custom reductions element by element, a sum of logs
for the group product.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..contract import EXP_MAX_GROUP, LOG2E, P_MIN
from .common import _COR, _DET, _PROBS, _REC, _ROWMAX, _UNC, _bump, _inject, _max_nan, _nanmax
from .masks import _bias_mask

_LOG2E = tl.constexpr(LOG2E)
_P_MIN = tl.constexpr(P_MIN)  # step 4: fp32 exp(EXP_XMIN), the floor of P in the product check
_EXP_MAX_GROUP = tl.constexpr(EXP_MAX_GROUP)


@triton.jit
def _lg2(x):
    """log2 on the GPU for the step-4 check: one MUFU lg2.approx (abs. error ≤ 2^-22 near 1, rel. 2^-22
    elsewhere: far inside the check's tolerance); tl.log2 would be a libdevice call. The ``ftz`` form:
    its argument, a product of at most EXP_MAX_GROUP values clamped to ≥ P_MIN, is never subnormal
    (NaN and inf pass through), so the subnormal fix-up of plain lg2.approx (three instructions) is
    dead code."""
    return tl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                     pack=1)


@triton.jit
def _exp(x, INTERP: tl.constexpr, LOG2: tl.constexpr):
    """exp of the scores' tile; LOG2: x is given as x·log2(e) (the folded path, `_softmax_steps`).
    On the GPU one MUFU ``ex2.approx.ftz``: tl.exp lowers to the non-ftz ex2, which ptxas wraps in a
    subnormal range fix (a compare, two multiplies and a select per element); results below 2^-126
    (x < −87.3) flush to 0, which the reference's `exp_ftz` models from x < −87 on, and which step 4
    counts as P_min = exp(−20) anyway. The interpreter uses tl.exp (tl.exp2 when LOG2)."""
    if INTERP:
        if LOG2:
            p = tl.exp2(x)
        else:
            p = tl.exp(x)
    else:
        y = x
        if not LOG2:
            y = x * _LOG2E
        p = tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [y], dtype=tl.float32, is_pure=True,
                                      pack=1)
    return p


@triton.jit
def _mul(a, b):
    return a * b


@triton.jit
def _exp_test(x, p, exp_tol, exp_xmin, INTERP: tl.constexpr, LOG2: tl.constexpr):
    """Step-4 check of one key block, per group (row i, residue r): the product identity
    Π_l P[i, l·16+r] = exp(Σ_l x[i, l·16+r]) (the EFTA paper §4.2, case 2), in log2 on the fp32 product.
    x < exp_xmin (masked keys included) counts as exp_xmin and P as P_min = exp(exp_xmin) unless it
    is larger (NaN-propagating max: a NaN stays, a negative P becomes P_min); with L ≤ 4 the product
    of clamped values stays a normal fp32 number (the contract's exp check constants).

    x, p: (BLOCK_M, BLOCK_N) fp32. Returns the margin (BLOCK_M, 16) fp32 of each group: the group
    fails the test where it is not ≤ `_exp_limit` (NaN included). The margin is
    |log2 Π P − log2(e)·Σ x| − exp_tol·log2(e)·|Σ x| (one FFMA), the limit exp_tol·log2(e)·3L;
    the interpreter, unless LOG2, keeps the reference's rounding: margin
    |log2 Π P − log2(e)·Σ x| − exp_tol·log2(e)·(3L + |Σ x|), limit 0. LOG2: x is given as x·log2(e)
    (the folded path), and the same test is written in those units.
    """
    BM: tl.constexpr = x.shape[0]
    L: tl.constexpr = x.shape[1] // 16
    tl.static_assert(L <= _EXP_MAX_GROUP)
    if LOG2:
        xs = tl.sum(tl.reshape(tl.maximum(x, exp_xmin * _LOG2E), (BM, L, 16)), axis=1)
    else:
        xs = tl.sum(tl.reshape(tl.maximum(x, exp_xmin), (BM, L, 16)), axis=1)
    pc = tl.reshape(tl.maximum(p, _P_MIN, propagate_nan=tl.PropagateNan.ALL), (BM, L, 16))
    if INTERP:  # the interpreter runs custom reductions element by element
        lp = tl.sum(tl.log2(pc), axis=1)
    else:
        lp = _lg2(tl.reduce(pc, 1, _mul))
    if LOG2:
        e = tl.fma(tl.abs(xs), -exp_tol, tl.abs(lp - xs))
    elif INTERP:
        e = tl.abs(lp - xs * _LOG2E) - exp_tol * _LOG2E * (3.0 * L + tl.abs(xs))
    else:
        e = tl.fma(tl.abs(xs), -(exp_tol * _LOG2E), tl.abs(lp - xs * _LOG2E))
    return e


@triton.jit
def _exp_limit(exp_tol, L: tl.constexpr, INTERP: tl.constexpr, LOG2: tl.constexpr):
    """The bound of `_exp_test`'s margin for groups of L keys."""
    if INTERP and not LOG2:
        lim = 0.0
    else:
        lim = exp_tol * (3.0 * L * _LOG2E)
    return lim


@triton.jit
def _softmax_steps(s, m_i, cnt, nf, offs_m, offs_n, row_ok, b, h, bh, jblk, M, N, nblocks, window, edge, scale,
                   Bias, sbb, sbh, sbm, sbn, Mask, smb, smh, smm, smn, mtile, Inj,
                   exp_tol, exp_xmin, snvr_rel, snvr_cap,
                   HAS_BIAS: tl.constexpr, MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr,
                   HAS_WINDOW: tl.constexpr, DETECT: tl.constexpr, CORRECT: tl.constexpr,
                   INJ_M: tl.constexpr, INJ_P: tl.constexpr, INTERP: tl.constexpr, REPAIR: tl.constexpr,
                   HALF: tl.constexpr, FOLD: tl.constexpr):
    """Steps 2–4 for one key block: bias and masks, running max (SNVR check), P = exp(x) (product
    check). s: (BLOCK_M, BLOCK_N) scores after step 1; m_i: (BLOCK_M,) running max (scaled units).

    FOLD: s is the unscaled Q·Kᵀ. Its row max is scaled afterwards (scale > 0 and rounding is
    monotonic, so this equals the max of the scaled scores), and the exponent in base 2,
    y = s·(scale·log2 e) − m·log2 e, is one FFMA per score instead of a multiply by the scale, a
    subtraction and a multiply by log2 e. Step 4 then runs in those base-2 units. The max element
    gets |y| ≤ a few ulp of |m·log2 e| instead of exactly 0, which step 6 allows for (`_output_tests`).

    Without REPAIR (the clean path) the checks only raise flags: step 3 per row, and step 4 as the
    margin of each group (`_exp_test`), which the caller folds into a running maximum (a test after
    the loop instead of a reduction per block); with REPAIR (taken when some flag of the block is
    raised) they count and repair exactly as the contract orders them, step 3 before step 4. Returns
    (S masked, m_new, P, rows with a raised flag (BLOCK_M,) bool, step-4 margins (BLOCK_M, 16) (the
    clean path; else 0), cnt, nf).
    """
    s, nfb = _bias_mask(s, offs_m, offs_n, b, h, M, N, window, edge, Bias, sbb, sbh, sbm, sbn,
                        Mask, smb, smh, smm, smn, mtile, HAS_BIAS, MASK_KIND, CAUSAL, HAS_WINDOW, DETECT, INTERP)
    nf = nf | nfb
    chk = nf == 0
    # ---- 3. running max (SNVR) ----
    mb = _nanmax(s, 1, INTERP)
    if FOLD:
        mb = mb * scale
    m_new = _max_nan(m_i, mb)
    if INJ_M != 0:
        m_new = _inject(m_new, Inj, 1, INJ_M, bh, offs_m, jblk, M, nblocks)
    all_inf = (m_new == -float("inf")) & (mb == -float("inf")) & (m_i == -float("inf"))
    base = tl.where(all_inf, 0.0, m_new)
    bad_row = row_ok & False
    if DETECT:
        xmax = mb - base
        tau = tl.minimum(snvr_rel * (1.0 + tl.abs(m_new)), snvr_cap)
        badm = (~(xmax <= tau) | ((m_new != m_i) & (xmax < -tau))) & row_ok & chk
        bad_row = badm
        if REPAIR:
            nbm = tl.sum(badm.to(tl.int32), axis=0)
            if nbm > 0:
                cnt = _bump(cnt, _ROWMAX + _DET, nbm)
                if CORRECT:
                    cnt = _bump(cnt, _ROWMAX + _REC, nbm)
                    m_new = tl.where(badm, _max_nan(m_i, mb), m_new)
                    all_inf = (m_new == -float("inf")) & (mb == -float("inf")) & (m_i == -float("inf"))
                    base = tl.where(all_inf, 0.0, m_new)
                else:
                    cnt = _bump(cnt, _ROWMAX + _UNC, nbm)
    # ---- 4. P = exp(x), product check per group ----
    if FOLD:  # x in base-2 units (x·log2 e), one FFMA
        x = tl.fma(s, scale * _LOG2E, -(base * _LOG2E)[:, None])
        p = _exp(x, INTERP, True)
    else:
        x = s - base[:, None]
        if HALF:  # PASA's full FP16 allocation: x and P held in fp16
            x = x.to(tl.float16).to(tl.float32)
        p = _exp(x, INTERP, False)
        if HALF:
            p = p.to(tl.float16).to(tl.float32)
    if INJ_P != 0:
        p = _inject(p, Inj, 2, INJ_P, bh, offs_m[:, None], offs_n[None, :], M, N)
    e4 = tl.zeros((x.shape[0], 16), tl.float32)
    if DETECT and not REPAIR:
        e4 = _exp_test(x, p, exp_tol, exp_xmin, INTERP, FOLD)
    if DETECT and REPAIR:
        badg = (~(_exp_test(x, p, exp_tol, exp_xmin, INTERP, FOLD) <= _exp_limit(exp_tol, x.shape[1] // 16, INTERP,
                                                                                 FOLD)) & row_ok[:, None] & chk)
        bad_row = bad_row | (tl.max(badg.to(tl.int32), axis=1) > 0)
        nbp = tl.sum(tl.sum(badg.to(tl.int32), axis=1), axis=0)
        if nbp > 0:
            cnt = _bump(cnt, _PROBS + _DET, nbp)
            if CORRECT:  # recompute exp over every member of a failing group
                cnt = _bump(cnt, _PROBS + _COR, nbp)
                redo = tl.reshape(tl.broadcast_to(badg[:, None, :], (x.shape[0], x.shape[1] // 16, 16)),
                                  (x.shape[0], x.shape[1]))
                p = tl.where(redo, _exp(x, INTERP, FOLD), p)
            else:
                cnt = _bump(cnt, _PROBS + _UNC, nbp)
    return s, m_new, p, bad_row, e4, cnt, nf
