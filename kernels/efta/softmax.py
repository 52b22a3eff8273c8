"""Steps 3–5: the running row max with its SNVR check, the exponent x and ``P = exp(x)`` with the product
check, the rescale α with its check, and the unchecked row sum.

* Step 3 (SNVR, the EFTA paper §4.2): a row-max error cancels out unless it makes exp overflow; the check
  tests that the block's max does not exceed the new running max by more than
  ``τ_m = min(snvr_rel·(1 + |m_new|), snvr_cap)`` and that a changed max is not far below it.
* Step 4: the product check of ``P = exp(x)`` per group (row i, residue r) of L keys, the fp32 product
  of the group's clamped P and one ``lg2`` of it per group (`_exp_test`, constants of the contract).
  P is taken as GEMM II reads it (rounded to V's dtype; for bf16 the fp32 P, with P_lp tested for being
  its rounding bit for bit, `_probs_for_test`), and the exponents it is compared with come
  from the masked scores the row max read, ``Σ_l max(S, base + x_min) − L·base``, not from x: a fault in
  x (the FMA that makes it, or its register) or in the rounded P would otherwise go unseen.
* Step 5: the rescale ``α = exp(m_old − m_new)``, checked against ``exp(−(m_new − m_old))`` (`_rescale`: α
  scales l, lc, O and Oc alike, so nothing later sees a wrong α); ``O += P_lp·V`` and, checked, the row
  sum ``l = Σ_n P_lp`` (P as GEMM II reads it, rounded to the input dtype) and its twin ``lc`` from two
  ones columns of GEMM II's checksum dot (`checksums._fold_ones`); unchecked, ``l`` is the fp32 sum of
  P, as plain flash attention has it; all rescaled by the same α (`kernel._key_loop`).

One FFMA per score on the GPU (FOLD): the scores stay unscaled and the exponent is
``fma(s, scale·log2 e, −m·log2 e)``; off where a bias, an additive mask, PASA or score injection needs
the scaled scores, and in the interpreter (`configs._fold`).

Interpreter (``INTERP``): tl.log2 and tl.exp instead of the PTX ``lg2.approx`` and
``ex2.approx.ftz``; because the interpreter runs custom reductions element by element, a sum of logs
for the group product.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..contract import EXP_MAX_GROUP, LOG2E, LOWP_U, exp_clamp
from .common import (
    _ALPHA,
    _COR,
    _DET,
    _I_ALPHA,
    _I_EXPONENT,
    _I_MSCORES,
    _I_PROBS,
    _I_PROBS_LP,
    _I_ROWMAX,
    _PROBS,
    _REC,
    _ROWMAX,
    _UNC,
    _bump,
    _group_products,
    _group_sums,
    _inject,
    _max_nan,
    _nanmax,
    _per_group,
    _round_to,
)
from .masks import _bias_mask, _bool_mask_tile, _step2_again

_LOG2E = tl.constexpr(LOG2E)
# step 4's floor of P (the contract's `exp_clamp`) and the room for P's rounding (1.01·L·u_lp·log2 e per
# unit of L), by the dtype GEMM II reads P in
_P_MIN32, _P_MIN16 = (tl.constexpr(exp_clamp(t)[1]) for t in (torch.float32, torch.float16))
_LP16 = tl.constexpr(1.01 * LOWP_U[torch.float16] * LOG2E)
_EXP_MAX_GROUP = tl.constexpr(EXP_MAX_GROUP)
# the largest |base| (scaled units) the clean pass leaves to step 4 alone (`_softmax_steps`): there step 4's room,
# g(L+3)·L·log2 e·|base| at L = 4 (g(L+7) with a bias and an additive mask, `Bounds.exp_base`), is 2.5 (4.0),
# under the |x_min|·log2 e (13.7 for fp16, 28.9 else) by which a lifted key's P misses its exponent from S2
_BASE_CAP = tl.constexpr(2.0**20)


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
def _lowp_clamp(PVDT: tl.constexpr):
    """(P_min, room per key of the group for P's rounding in log2 units) for P held in PVDT (the contract's
    `exp_clamp`, ``1.01·u_lp·log2 e``; none for bf16, whose test reads the fp32 P, `_probs_for_test`)."""
    if PVDT == tl.float16:
        pmin = _P_MIN16
        lp = _LP16
    else:
        pmin = _P_MIN32
        lp = 0.0
    return pmin, lp


@triton.jit
def _round_again(p, INTERP: tl.constexpr):
    """fp32 P (BLOCK_M, BLOCK_N) rounded to bf16 a second time, negatives as 0 (P = exp(x) ≥ 0 in a clean
    run). On the GPU a ``cvt.rn.relu.bf16x2.f32``, an instruction the compiler cannot merge with the plain
    conversion that made P_lp (ptxas would fold two identical ones into one, and the equality test into
    true)."""
    if INTERP:
        return _round_to(tl.maximum(p, 0.0), tl.bfloat16, INTERP)
    return tl.inline_asm_elementwise("cvt.rn.relu.bf16x2.f32 $0, $2, $1;", "=r,r,r", [p], dtype=tl.bfloat16,
                                     is_pure=True, pack=2)


@triton.jit
def _or(a, b):
    return a | b


@triton.jit
def _rounding_changed(p, pd, INTERP: tl.constexpr):
    """Rows (BLOCK_M,) bool where some bf16 ``pd`` is not the fp32 ``p``'s rounding bit for bit: the clean
    pass's form of `_probs_for_test`, an OR of the two values' bits XORed (two of them per 32-bit
    instruction), without a predicate per element to keep until the product test."""
    d = pd.to(tl.int16, bitcast=True) ^ _round_again(p, INTERP).to(tl.int16, bitcast=True)
    return tl.reduce(d, 1, _or) != 0


@triton.jit
def _probs_for_test(p, pd, PVDT: tl.constexpr, INTERP: tl.constexpr):
    """The P that step 4's product test reads (BLOCK_M, BLOCK_N) fp32, from the fp32 ``p`` and ``pd``, P as
    GEMM II reads it in PVDT: ``pd`` itself for fp32 and fp16; for bf16, ``p`` where ``pd`` is its rounding
    bit for bit, NaN (the group fails) where not. bf16's rounding room in the test, half an ulp (2^-9 of P)
    per key, would let a change of one or two ulps in one key of a group through, which moves an output by
    2–3 % of its row's RMS where P is near 1; the fp32 P needs no room, and the equality covers P_lp."""
    if PVDT == tl.bfloat16:
        return tl.where(pd == _round_again(p, INTERP), p, float("nan"))
    return pd.to(tl.float32)


@triton.jit
def _exp_test(sa, base, p, scale, exp_tol, exp_base, exp_xmin, PVDT: tl.constexpr, INTERP: tl.constexpr,
              LOG2: tl.constexpr):
    """Step-4 check of one key block, per group (row i, residue r): the product identity
    Π_l P[i, l·16+r] = exp(Σ_l x[i, l·16+r]) (the EFTA paper §4.2, case 2), in log2 on the fp32 product,
    with Σ_l max(x, x_min) taken from the scores step 1 verified, step 2 evaluated again on them
    (`masks._step2_again`): ``Σ_l max(s, base + x_min) − L·base`` (LOG2: ``scale·log2(e)·Σ_l max(s,
    (base + x_min)/scale) − L·log2(e)·base``, s unscaled), so that x, and step 2's output that the row max
    and x read, are checked too. P is `_probs_for_test`'s (held in fp32);
    below P_min = exp(x_min) it counts as P_min (NaN-propagating max: a NaN stays,
    a negative P becomes P_min); with L ≤ 4 the product of clamped values stays a normal fp32 number (the
    contract's exp check constants; x_min and P_min by PVDT, `contract.exp_clamp`).

    sa: (BLOCK_M, BLOCK_N) fp32 ``max(s, floor)`` of those scores, the floor where masked; base: (BLOCK_M,)
    the base of x
    (m_new, or 0 for a row masked so far); p: (BLOCK_M, BLOCK_N) fp32. With BLOCK_N = 128 (the wide
    clean pass) the groups are those of each 64-key checksum block (L = 4), and each (row, residue)
    gets the worse of its two margins. Returns the margin (BLOCK_M, 16) fp32 of each group: the group
    fails the test where it is not ≤ `_exp_limit` (NaN included). The
    margin is |log2 Π P − log2(e)·Σ x| − exp_tol·log2(e)·|Σ x| − exp_base·log2(e)·|base| (the last
    term bounds the rounding of the L scores of size |base| and of L·base, ``exp_base = g(L+3)·L``);
    the interpreter, unless LOG2, keeps the reference's rounding: margin |log2 Π P − log2(e)·Σ x| −
    log2(e)·(exp_tol·(3L + |Σ x|) + exp_base·(|base| − x_min)) − L·(P's rounding room), limit 0. LOG2:
    the same test in base-2 units.
    """
    NB: tl.constexpr = (sa.shape[1] + 63) // 64  # checksum blocks of 64 keys: two in a wide clean pass
    L: tl.constexpr = sa.shape[1] // 16 // NB
    tl.static_assert(L <= _EXP_MAX_GROUP)
    pmin, lp_room = _lowp_clamp(PVDT)
    ys = _group_sums(sa, NB)
    if LOG2:
        xs = tl.fma(ys, scale * _LOG2E, -_per_group(base * (L * _LOG2E), NB))
    else:
        xs = ys - _per_group(base * L, NB)
    pc = tl.maximum(p, pmin, propagate_nan=tl.PropagateNan.ALL)
    if INTERP:  # the interpreter runs custom reductions element by element
        lp = _group_sums(tl.log2(pc), NB)
    else:
        lp = _lg2(_group_products(pc, NB))
    room = _per_group(tl.abs(base) * (exp_base * _LOG2E), NB)  # one subtraction per group
    if LOG2:
        e = tl.fma(tl.abs(xs), -exp_tol, tl.abs(lp - xs)) - room
    elif INTERP:
        e = (tl.abs(lp - xs * _LOG2E) - exp_tol * _LOG2E * (3.0 * L + tl.abs(xs))
             - _per_group((tl.abs(base) - exp_xmin) * (exp_base * _LOG2E), NB) - L * lp_room)
    else:
        e = tl.fma(tl.abs(xs), -(exp_tol * _LOG2E), tl.abs(lp - xs * _LOG2E)) - room
    if NB > 1:  # the worst of the sub-blocks' groups (the clean pass keeps only the worst margin)
        e = _nanmax(e, 1, INTERP)
    return e


@triton.jit
def _exp_limit(exp_tol, exp_base, exp_xmin, L: tl.constexpr, PVDT: tl.constexpr, INTERP: tl.constexpr,
               LOG2: tl.constexpr):
    """The bound of `_exp_test`'s margin for groups of L keys."""
    _, lp_room = _lowp_clamp(PVDT)
    if INTERP and not LOG2:
        lim = 0.0
    else:
        lim = exp_tol * (3.0 * L * _LOG2E) - exp_base * _LOG2E * exp_xmin + L * lp_room
    return lim


@triton.jit
def _rescale(m_i, m_new, cnt, row_ok, chk, Inj, bh, offs_m, jblk, M, nblocks, INJ_A: tl.constexpr,
             DETECT: tl.constexpr, CORRECT: tl.constexpr, REPAIR: tl.constexpr, INTERP: tl.constexpr):
    """Step 5's rescale α = exp(m_i − m_new) (BLOCK_M,) (1 where both are −inf; `_exp`: ex2.approx.ftz, an
    α below 2^-126 is 0), the `attn.alpha` faults, and its check: α scales O, l, lc and Oc alike, so a
    wrong α is invisible to every later check. It is compared with ``exp(−(m_new − m_i))``, the same
    number in a clean run (round to nearest is symmetric) from a separate chain of instructions (no
    common subexpression to merge). Rows that differ while the recomputation is a number (a NaN max is
    step 3's fault) raise a flag; REPAIR counts them at ``attn.alpha`` and takes the recomputed α.
    Returns (α, rows that differ (BLOCK_M,) bool, cnt)."""
    both_inf = (m_i == -float("inf")) & (m_new == -float("inf"))
    alpha = tl.where(both_inf, 1.0, _exp(m_i - m_new, INTERP, False))
    if INJ_A != 0:
        alpha = _inject(alpha, Inj, _I_ALPHA, INJ_A, bh, offs_m, jblk, M, nblocks)
    bad = row_ok & False
    if DETECT:
        again = tl.where(both_inf, 1.0, _exp(-(m_new - m_i), INTERP, False))
        bad = (alpha != again) & (again == again) & row_ok & chk
        if REPAIR:
            cnt = _count_found(cnt, _ALPHA, tl.sum(bad.to(tl.int32), axis=0), _COR, CORRECT)
            if CORRECT:
                alpha = tl.where(bad, again, alpha)
    return alpha, bad, cnt


@triton.jit
def _snvr_tau(v, snvr_rel, snvr_cap):
    """Step 3's tolerance around a max ``v`` (BLOCK_M,): ``min(snvr_rel·(1 + |v|), snvr_cap)``."""
    return tl.minimum(snvr_rel * (1.0 + tl.abs(v)), snvr_cap)


@triton.jit
def _exponent(s, base, scale, FOLD: tl.constexpr):
    """x = s − base (BLOCK_M, BLOCK_N) fp32; FOLD: s unscaled, x in base-2 units, one FFMA per score."""
    if FOLD:
        x = tl.fma(s, scale * _LOG2E, -(base * _LOG2E)[:, None])
    else:
        x = s - base[:, None]
    return x


@triton.jit
def _count_found(cnt, SITE: tl.constexpr, n, REPAIRED: tl.constexpr, CORRECT: tl.constexpr):
    """``n`` faults found at SITE's check: ``detected``, and each also REPAIRED (``corrected`` or
    ``recomputed``) with CORRECT, ``uncorrectable`` without."""
    cnt = _bump(cnt, SITE + _DET, n)
    if CORRECT:
        cnt = _bump(cnt, SITE + REPAIRED, n)
    else:
        cnt = _bump(cnt, SITE + _UNC, n)
    return cnt


@triton.jit
def _softmax_steps(s, m_i, nm_i, cnt, nf, offs_m, offs_n, row_ok, b, h, bh, jblk, M, N, nblocks, window, edge, scale,
                   Bias, sbb, sbh, sbm, sbn, Mask, smb, smh, smm, smn, mtile, Inj,
                   exp_tol, exp_base, exp_xmin, snvr_rel, snvr_cap,
                   HAS_BIAS: tl.constexpr, MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr,
                   HAS_WINDOW: tl.constexpr, DETECT: tl.constexpr, CORRECT: tl.constexpr,
                   INJ_MS: tl.constexpr, INJ_M: tl.constexpr, INJ_X: tl.constexpr, INJ_P: tl.constexpr,
                   INJ_PL: tl.constexpr, PVDT: tl.constexpr, INTERP: tl.constexpr, REPAIR: tl.constexpr,
                   HALF: tl.constexpr, FOLD: tl.constexpr):
    """Steps 2–4 for one key block: bias and masks (then the `attn.masked_scores` faults), running max (SNVR
    check), the exponent x (then the `attn.exponent` faults), P = exp(x) (then the `attn.probs` faults), P in
    PVDT as GEMM II reads it (then the `attn.probs_lp` faults; product check on it). s: (BLOCK_M, BLOCK_N)
    scores after step 1; m_i: (BLOCK_M,) running max (scaled units); nm_i: its shadow, −m_i kept by a
    computation of its own (DETECT; `_key_loop` compares the two where a block reads m_i).

    FOLD: s is the unscaled Q·Kᵀ. Its row max is scaled afterwards (scale > 0 and rounding is
    monotonic, so this equals the max of the scaled scores), and the exponent in base 2,
    y = s·(scale·log2 e) − m·log2 e, is one FFMA per score instead of a multiply by the scale, a
    subtraction and a multiply by log2 e. Step 4 then runs in those base-2 units. The max element
    gets |y| ≤ a few ulp of |m·log2 e| instead of exactly 0, which step 6 allows for (`_output_tests`).

    Without REPAIR (the clean path) the checks only raise flags: step 3 per row, and step 4 as the
    margin of each group (`_exp_test`), which the caller folds into a running maximum (a test after
    the loop instead of a reduction per block); with REPAIR (taken when some flag of the block is
    raised) they count and repair exactly as the contract orders them, step 3 before step 4 (a failing
    group gets x, P and its rounding again, x from step 2 evaluated a second time, `masks._step2_again`,
    as step 4's exponents are). Returns (S masked, m_new, the shadow's −m_new: min(nm_i, −block
    max), or −m_new where step 3 flagged the row (so that what step 3 counted is not found again), P fp32,
    P in PVDT, rows with a raised flag (BLOCK_M,) bool, step-4 margins (BLOCK_M, 16) (the clean path; else
    0), cnt, nf).
    """
    s1 = s  # the scores step 1 verified
    if MASK_KIND == 1 and mtile is None:  # (decode programs: `_early_mask`); step 4 reads it again
        mtile = _bool_mask_tile(offs_m, offs_n, b, h, M, N, Mask, smb, smh, smm, smn)
    s, nfb = _bias_mask(s, offs_m, offs_n, b, h, M, N, window, edge, Bias, sbb, sbh, sbm, sbn,
                        Mask, smb, smh, smm, smn, mtile, HAS_BIAS, MASK_KIND, CAUSAL, HAS_WINDOW, DETECT, INTERP)
    if INJ_MS != 0:
        s = _inject(s, Inj, _I_MSCORES, INJ_MS, bh, offs_m[:, None], offs_n[None, :], M, N)
    nf = nf | nfb
    chk = nf == 0
    # ---- 3. running max (SNVR) ----
    mb = _nanmax(s, 1, INTERP)
    if DETECT and REPAIR:  # a block max that a fault in step 2's output lifted: taken from step 2 again
        m2 = _nanmax(_step2_again(s1, mb, offs_m, offs_n, b, h, M, N, window, edge, Bias, sbb, sbh, sbm, sbn,
                                  Mask, smb, smh, smm, smn, mtile, HAS_BIAS, MASK_KIND, CAUSAL, HAS_WINDOW, False,
                                  INTERP), 1, INTERP)
        badx = ~(mb <= m2 + _snvr_tau(m2, snvr_rel, snvr_cap)) & row_ok & chk
        nbx = tl.sum(badx.to(tl.int32), axis=0)
        if nbx > 0:
            cnt = _count_found(cnt, _ROWMAX, nbx, _REC, CORRECT)
            if CORRECT:
                mb = tl.where(badx, m2, mb)
    if FOLD:
        mb = mb * scale
    m_new = _max_nan(m_i, mb)
    nm_new = tl.minimum(nm_i, -mb)  # (never the negated m_new: the compiler would fold the comparison)
    if INJ_M != 0:
        m_new = _inject(m_new, Inj, _I_ROWMAX, INJ_M, bh, offs_m, jblk, M, nblocks)
    all_inf = (m_new == -float("inf")) & (mb == -float("inf")) & (m_i == -float("inf"))
    base = tl.where(all_inf, 0.0, m_new)
    bad_row = row_ok & False
    if DETECT:
        xmax = mb - base
        tau = _snvr_tau(m_new, snvr_rel, snvr_cap)
        badm = (~(xmax <= tau) | ((m_new != m_i) & (xmax < -tau))) & row_ok & chk
        bad_row = badm
        if REPAIR:
            nbm = tl.sum(badm.to(tl.int32), axis=0)
            if nbm > 0:
                cnt = _count_found(cnt, _ROWMAX, nbm, _REC, CORRECT)
                if CORRECT:
                    m_new = tl.where(badm, _max_nan(m_i, mb), m_new)
                    all_inf = (m_new == -float("inf")) & (mb == -float("inf")) & (m_i == -float("inf"))
                    base = tl.where(all_inf, 0.0, m_new)
            nm_new = tl.where(badm, -m_new, nm_new)  # (the clean pass: a flagged row is redone anyway)
    # ---- 4. x, P = exp(x), product check per group (anchored on step 2 again, not on x nor on s) ----
    x = _exponent(s, base, scale, FOLD)  # FOLD: in base-2 units (x·log2 e)
    if HALF:  # PASA's full FP16 allocation: x and P held in fp16 (never with FOLD)
        x = x.to(tl.float16).to(tl.float32)
    if INJ_X != 0:  # (the host keeps FOLD off while injecting here: x in natural units, as in the reference)
        x = _inject(x, Inj, _I_EXPONENT, INJ_X, bh, offs_m[:, None], offs_n[None, :], M, N)
    p = _exp(x, INTERP, FOLD)
    if HALF:
        p = p.to(tl.float16).to(tl.float32)
    if INJ_P != 0:
        p = _inject(p, Inj, _I_PROBS, INJ_P, bh, offs_m[:, None], offs_n[None, :], M, N)
    pd = _round_to(p, PVDT, INTERP)  # P as GEMM II reads it
    if INJ_PL != 0:
        pd = _inject(pd, Inj, _I_PROBS_LP, INJ_PL, bh, offs_m[:, None], offs_n[None, :], M, N)
    e4 = tl.zeros((x.shape[0], 16), tl.float32)
    sa = s
    if DETECT:  # step 4's exponents: step 2 again on s1, clamped at the floor (x_min, in s's units)
        floor = base + exp_xmin
        if FOLD:
            floor = floor / scale
        sa = _step2_again(s1, floor, offs_m, offs_n, b, h, M, N, window, edge, Bias, sbb, sbh, sbm, sbn,
                          Mask, smb, smh, smm, smn, mtile, HAS_BIAS, MASK_KIND, CAUSAL, HAS_WINDOW, True, INTERP)
    if DETECT and not REPAIR:
        # a fault that lifted one of step 2's outputs to the row's max makes the base, and with it step 4's room
        # (∝ |base|), as large. Up to |base| = _BASE_CAP that room stays below the |x_min|·log2 e by which the
        # lifted key's P misses its exponent from S2, so step 4 fails the block; beyond it the row is flagged
        # here, and the repairing pass compares the block max with S2's (a clean row that large costs that
        # pass, never an event)
        bad_row = bad_row | (~(tl.abs(base) <= _BASE_CAP) & row_ok & chk)
        if PVDT == tl.bfloat16:  # the fp32 P, and P_lp's rounding as a row flag (the repairing pass counts)
            e4 = _exp_test(sa, base, p, scale, exp_tol, exp_base, exp_xmin, PVDT, INTERP, FOLD)
            bad_row = bad_row | (_rounding_changed(p, pd, INTERP) & row_ok & chk)
        else:
            e4 = _exp_test(sa, base, pd.to(tl.float32), scale, exp_tol, exp_base, exp_xmin, PVDT, INTERP, FOLD)
    if DETECT and REPAIR:
        lim = _exp_limit(exp_tol, exp_base, exp_xmin, x.shape[1] // 16, PVDT, INTERP, FOLD)
        e4r = _exp_test(sa, base, _probs_for_test(p, pd, PVDT, INTERP), scale, exp_tol, exp_base, exp_xmin, PVDT,
                        INTERP, FOLD)
        badg = ~(e4r <= lim) & row_ok[:, None] & chk
        bad_row = bad_row | (tl.max(badg.to(tl.int32), axis=1) > 0)
        nbp = tl.sum(tl.sum(badg.to(tl.int32), axis=1), axis=0)
        if nbp > 0:
            cnt = _count_found(cnt, _PROBS, nbp, _COR, CORRECT)
            if CORRECT:  # step 2, x, exp and the rounding again over every member of a failing group
                redo = tl.reshape(tl.broadcast_to(badg[:, None, :], (x.shape[0], x.shape[1] // 16, 16)),
                                  (x.shape[0], x.shape[1]))
                s2 = _step2_again(s1, base, offs_m, offs_n, b, h, M, N, window, edge, Bias, sbb, sbh, sbm, sbn,
                                  Mask, smb, smh, smm, smn, mtile, HAS_BIAS, MASK_KIND, CAUSAL, HAS_WINDOW, False,
                                  INTERP)
                p = tl.where(redo, _exp(_exponent(s2, base, scale, FOLD), INTERP, FOLD), p)
                pd = tl.where(redo, _round_to(p, PVDT, INTERP), pd)
    return s, m_new, nm_new, p, pd, bad_row, e4, cnt, nf
