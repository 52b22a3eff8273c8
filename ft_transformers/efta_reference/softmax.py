"""The online softmax of one key block with its checks (``docs/algorithms.md`` steps 3–5): the
running max and its SNVR check, the exponent ``x = S − m``, ``P = exp(x)`` and P rounded to the dtype
GEMM II reads it in, with the product check per group (on that rounded P, against exponents taken from
the scores, so that faults in x and in the rounded P are seen too; a bf16 P_lp must be P's rounding bit for
bit), and the rescaled accumulation (α
checked against its recomputation) of the output ``O``, its checksum columns, the row sum ``l`` and its
twin ``lc``, all of the rounded P (checked: ``l`` and ``lc`` are the two ones columns of GEMM II's
product; unchecked, ``l`` sums the fp32 P).

Shapes: GQA rows, (B, Hkv, G·M, ·); m, l: (B, Hkv, G·M, 1); the accumulator (B, Hkv, G·M, DA) holds
``[O | Oc1 | Oc2 | l | lc]`` when checking (DA = D + 2s + 2), ``O`` alone otherwise.
"""

from __future__ import annotations

import torch

from .. import pasa as _pasa
from ..injection import SiteFaults
from ..kernels.contract import EXP_MAX_GROUP, EXP_ULPS, LOG2E, LOWP_U, exp_clamp
from .checksums import U, g
from .common import count_detected, inject
from .masks import NEG_INF

_FTZ_XMIN = -87.0  # exp(x) below it is subnormal: flushed to 0 (`exp_ftz`)


def round16(x: torch.Tensor) -> torch.Tensor:
    """x rounded to fp16 and held in fp32 (PASA's fp16 softmax state)."""
    return x.to(torch.float16).to(torch.float32)


def exp_ftz(x: torch.Tensor) -> torch.Tensor:
    """exp(x), flushed to 0 where x < −87 (subnormal results; exp there is < 1.7e-38), as the GPU's
    ``ex2.approx.ftz`` does from −87.3 on.

    CPU exp takes a slow path for underflowing and −inf arguments (about 10× slower), and masked
    keys are −inf. The flush is within the step-4 contract (P below P_min counts as P_min).
    """
    p = torch.exp(x.clamp(min=_FTZ_XMIN))
    return p.masked_fill_(x < _FTZ_XMIN, 0.0)


def exp_group_test(S: torch.Tensor, base: torch.Tensor, P: torch.Tensor, s: int,
                   p_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Step 4: the product identity Π_l P[i, l·s+r] = exp(Σ_l x[i, l·s+r]) per group (row i, residue r),
    checked in log2 on the fp32 product of the group, with the exponents taken from the scores S (the
    values the row max read) rather than from x: ``Σ_l max(x, x_min) = Σ_l max(S, base + x_min) − L·base``.
    A fault in x (or in the subtraction that made it) then breaks the identity like a fault in P does;
    checked against x itself, P = exp(x) would agree with a wrong x.

    Below x_min (masked keys included) x counts as x_min and P as P_min = exp(x_min) unless it is larger
    (a NaN-propagating max: a NaN P stays NaN, a negative one becomes P_min); (x_min, P_min) =
    `contract.exp_clamp` of ``p_dtype`` (−20, or −9.5 for fp16, whose subnormals round absolutely). A
    product of up to 4 clamped values cannot underflow; larger groups (L > 4, other block/stride choices
    than the kernel's) are multiplied in chunks of 4 and the chunks' log2 summed.

    Args:
        S: (..., L·s) fp32 masked scores of the block (−inf where masked).
        base: (..., 1) the row's base (m_new, or 0 for a row masked so far), as x = S − base used it.
        P: (..., L·s) fp32 values of P as GEMM II reads them: rounded to ``p_dtype``.
        s: the stride. p_dtype: the dtype P was rounded to (each log2 P moved by ≤ 1.01·u_lp·log2 e).
    Returns:
        (..., s) bool: ``|log2 Π P − log2(e)·Σ x| > log2(e)·(64·u·(3L + |Σ x|) + g(L+3)·L·(|base| + |x_min|)
        + 1.01·L·u_lp)``; the second term bounds the rounding of ``base + x_min``, of the sum of L scores of
        size |base| and of the subtraction of L·base, the third P's rounding to ``p_dtype``
        (``docs/algorithms.md`` step 4).
    """
    L = S.shape[-1] // s
    xmin, pmin = exp_clamp(p_dtype)
    y = torch.maximum(S, base + xmin).view(*S.shape[:-1], L, s).sum(-2)  # NaN-propagating max
    xs = y - base * L
    pc = torch.maximum(P, P.new_tensor(pmin)).view(*S.shape[:-1], L, s)  # torch.maximum propagates NaN
    lp = sum(torch.log2(pc[..., c:c + EXP_MAX_GROUP, :].prod(-2)) for c in range(0, L, EXP_MAX_GROUP))
    d = lp - xs * LOG2E
    tol = ((xs.abs() + 3.0 * L) * (EXP_ULPS * U * LOG2E) + (base.abs() - xmin) * (g(L + 3) * L * LOG2E)
           + 1.01 * L * LOWP_U[p_dtype] * LOG2E)
    return ~(d.abs() <= tol)


def probs_for_test(P: torch.Tensor, pd: torch.Tensor, p_dtype: torch.dtype) -> torch.Tensor:
    """The P that step 4's product test reads: ``pd``, P as GEMM II reads it, for fp32 and fp16; for bf16 the
    fp32 ``P`` where ``pd`` is its rounding bit for bit (negatives rounded as 0: P = exp(x) ≥ 0 in a clean
    run), NaN (the group fails) where not, tested with fp32's room (none for the rounding).

    bf16's room in the test, half an ulp (2^-9 of P) per key, would let a change of one or two ulps in one
    key of a group through, which moves an output by 2–3 % of its row's RMS where P is near 1.

    Args:
        P: (..., n) fp32 P; pd: (..., n) P rounded to ``p_dtype`` (flips at ``attn.probs_lp`` included),
            held in fp32.
    Returns:
        (..., n) fp32.
    """
    if p_dtype != torch.bfloat16:
        return pd
    again = P.clamp(min=0.0).to(torch.bfloat16).to(torch.float32)
    return torch.where(pd == again, P, P.new_tensor(float("nan")))


def _base(m: torch.Tensor, mb: torch.Tensor, m_new: torch.Tensor) -> torch.Tensor:
    """The base of ``x = S − base``: m_new, or 0 only where m_new, m and the block max are all −inf (a
    fully masked row so far: its x stays −inf)."""
    all_masked = (m_new == NEG_INF) & (mb == NEG_INF) & (m == NEG_INF)
    return torch.where(all_masked, torch.zeros_like(m_new), m_new)


def _snvr_tau(v: torch.Tensor) -> torch.Tensor:
    """Step 3's tolerance around a max ``v``: ``min(2^-20·(1 + |v|), 1)`` (a new tensor)."""
    return v.abs().add_(1.0).mul_(2.0**-20).clamp_(max=1.0)


def running_max(S: torch.Tensor, S2: torch.Tensor, m: torch.Tensor, nm: torch.Tensor, sf: SiteFaults | None,
                site_shape4: tuple[int, ...], j: int, *, detect: bool, correct: bool, counters: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step 3: the new running max, the ``attn.rowmax`` faults, the SNVR check; counts at ``attn.rowmax``.

    First the block max itself: above that of S2 (step 2 evaluated again, `probabilities`) by more than
    ``min(2^-20·(1 + |max S2|), 1)``, a fault in step 2's output (``attn.masked_scores``) lifted it; the row
    is ``recomputed`` with S2's max. Step 4 would see such a fault too, but a max lifted by orders of
    magnitude makes the base, and step 4's room for the rounding of values of its size, as large.

    With ``τ_m = min(2^-20·(1 + |m_new|), 1)`` a row is faulty if ``max_n x > τ_m`` (exp would exceed
    1; NaN too), or if ``m_new ≠ m`` and ``max_n x < −τ_m`` (this block raised the max to a wrong
    value). Faulty rows are ``recomputed``: m_new again from m and the block max.

    Why the cap and the base rule: uncapped, τ_m would be +inf whenever m_new is ±inf (a bit-30 flip
    turns ±1.0 into ±inf) and disable both comparisons; a max corrupted to −inf would then pass with
    ``x = S − 0``, and the next block's ``α = exp(−inf − m) = 0`` would erase everything before it
    (a wrong output with no event). With the cap alone, base 0 for any ``m_new = −inf`` would still
    let that through when the block max lies in [−1, 1]; with base ``m_new`` there, ``x = +inf`` trips
    the check. In clean runs the max is exact (max x = 0, or −inf for a fully masked block), so
    neither rule can cause a false positive; the cap also keeps an undetected shift of m from
    overflowing exp when |m| is huge.

    Args:
        S: (B, Hkv, G·M, block_n) fp32 masked scores of the block; S2: the same without the
            ``attn.masked_scores`` faults.
        m: (B, Hkv, G·M, 1) the running max before the block (−inf at first).
        nm: m's shadow, −m kept by a computation of its own (`carried_max_lost`).
        sf, site_shape4 = (B, Hq, M, 1), j: the site's faults at block j.
        detect, correct, counters: as `efta_reference`.
    Returns:
        ``m_new`` (B, Hkv, G·M, 1), the base of the exponent (B, Hkv, G·M, 1): ``m_new``, or 0 where
        m_new, m and the block max are all −inf (`_base`), and the shadow's ``min(nm, −block max)``
        (``−m_new`` where the check flagged the row: what step 3 counted is not found again).
    """
    mb = S.amax(-1, keepdim=True)
    if detect and S2 is not S:
        m2 = S2.amax(-1, keepdim=True)
        bad = ~(mb <= m2 + _snvr_tau(m2))
        if bool(bad.any()):
            count_detected(counters, "attn.rowmax", bad.sum(), correct, "recomputed")
            if correct:
                mb = torch.where(bad, m2, mb)
    m_new = torch.maximum(m, mb)
    nm_new = torch.minimum(nm, -mb)
    m_new = inject(sf, m_new, site_shape4, j)
    base = _base(m, mb, m_new)
    if detect:
        xmax = mb - base  # = max_n (S - base): subtraction rounding is monotone
        tau = _snvr_tau(m_new)
        bad = ~(xmax <= tau) | ((m_new != m) & (xmax < -tau))
        if bool(bad.any()):
            nbad = bad.sum()
            count_detected(counters, "attn.rowmax", nbad, correct, "recomputed")
            if correct:
                m_new = torch.where(bad, torch.maximum(m, mb), m_new)
                base = _base(m, mb, m_new)
            nm_new = torch.where(bad, -m_new, nm_new)
    return m_new, base, nm_new


def carried_max_lost(m: torch.Tensor, nm: torch.Tensor) -> torch.Tensor:
    """Rows (B, Hkv, G·M, 1) bool whose running max m no longer equals −nm, its shadow: a fault in m (or the
    shadow) between two key blocks. Such a fault changes α and every later exponent consistently, so no
    other check sees it; the caller makes the row's l NaN, and step 6 recomputes the row."""
    return m != -nm


def probabilities(S: torch.Tensor, S2: torch.Tensor, base: torch.Tensor, sfs: dict[str, SiteFaults | None],
                  site_shape4: tuple[int, ...], j0: int, *, stride: int, pv_dtype: torch.dtype, half_state: bool,
                  detect: bool, correct: bool, counters: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 4: the exponent ``x = S − base`` (then the ``attn.exponent`` faults), ``P = exp(x)`` (then the
    ``attn.probs`` faults), P rounded to ``pv_dtype`` as GEMM II reads it (then the ``attn.probs_lp``
    faults), and the product check per group on that rounded P (`exp_group_test`, anchored on S2, step 2
    evaluated again on the scores step 1 verified, so that a fault in S itself, ``attn.masked_scores``, is
    seen too; for bf16 on the fp32 P, with the rounded P tested for being its rounding bit for bit,
    `probs_for_test`); counts at ``attn.probs``. A faulty group is ``corrected``: x from S2, P and its
    rounding again for its members.

    ``P`` is flushed to 0 where ``x < −87`` (`exp_ftz`): the check treats those as exp(−87) anyway.

    Args:
        S: (B, Hkv, G·M, block_n) fp32 masked scores, as the row max read them (``attn.masked_scores``
            faults included); S2: the same without them (the kernel's second evaluation of step 2).
        base: (B, Hkv, G·M, 1) from `running_max`.
        sfs: the call's `SiteFaults` by site; site_shape4 = (B, Hq, M, block_n), j0: the block's first key.
        stride: s. pv_dtype: the dtype GEMM II reads P in. half_state: PASA's fp16 softmax state (x and P
            rounded to fp16).
        detect, correct, counters: as `efta_reference`.
    Returns:
        (P fp32, the rounded P held in fp32), both (B, Hkv, G·M, block_n).
    """
    x = S - base
    if half_state:
        x = round16(x)
    x = inject(sfs["attn.exponent"], x, site_shape4, j0)
    P = exp_ftz(x)
    if half_state:
        P = round16(P)
    P = inject(sfs["attn.probs"], P, site_shape4, j0)
    pd = inject(sfs["attn.probs_lp"], P.to(pv_dtype), site_shape4, j0).to(torch.float32)
    if detect:
        bad = exp_group_test(S2, base, probs_for_test(P, pd, pv_dtype), stride,  # (B, Hkv, G·M, s): failing groups
                             torch.float32 if pv_dtype == torch.bfloat16 else pv_dtype)
        if bool(bad.any()):
            nbad = bad.sum()
            count_detected(counters, "attn.probs", nbad, correct, "corrected")
            if correct:
                redo = bad.unsqueeze(-2).expand(*bad.shape[:-1], P.shape[-1] // stride, stride).reshape(P.shape)
                P = torch.where(redo, exp_ftz(S2 - base), P)
                pd = torch.where(redo, P.to(pv_dtype).to(torch.float32), pd)
    return P, pd


def rescale(m: torch.Tensor, m_new: torch.Tensor, sf: SiteFaults | None, site_shape4: tuple[int, ...], j: int,
            *, detect: bool, correct: bool, counters: torch.Tensor | None) -> torch.Tensor:
    """Step 5's rescale ``α = exp(m − m_new)`` (1 where both are −inf), then the ``attn.alpha`` faults,
    and its check; counts at ``attn.alpha``.

    α scales l, lc, O and Oc alike, so no later check can see a wrong α. It is checked against a second
    evaluation from the negated difference, ``exp(−(m_new − m))``: bit for bit the same number in a
    clean run (round to nearest is symmetric, and exp(±0) = 1), a separate chain of instructions in the
    kernel (no common subexpression). A row whose α differs (while the recomputation is a number: a
    NaN max is step 3's fault) is ``detected`` and ``corrected`` with the recomputed value.

    Args:
        m, m_new: (B, Hkv, G·M, 1) the running max before and after the block.
        sf, site_shape4 = (B, Hq, M, 1), j: the site's faults at block j.
        detect, correct, counters: as `efta_reference`.
    Returns:
        α, (B, Hkv, G·M, 1) fp32.
    """
    both_inf = (m == NEG_INF) & (m_new == NEG_INF)
    alpha = torch.where(both_inf, torch.ones_like(m), torch.exp(m - m_new))
    alpha = inject(sf, alpha, site_shape4, j)
    if detect:
        again = torch.where(both_inf, torch.ones_like(m), torch.exp(-(m_new - m)))
        bad = (alpha != again) & (again == again)
        if bool(bad.any()):
            nbad = bad.sum()
            count_detected(counters, "attn.alpha", nbad, correct, "corrected")
            if correct:
                alpha = torch.where(bad, again, alpha)
    return alpha


def accumulate(P: torch.Tensor, pd: torch.Tensor, alpha: torch.Tensor, l: torch.Tensor, acc: torch.Tensor,
               vb: torch.Tensor, sfs: dict[str, SiteFaults | None], block_site: tuple[int, ...], j: int, *,
               head_dim: int, stride: int, half_state: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 5: ``acc = α·acc + pd·vb`` with the rounded P that GEMM II reads (then the ``attn.acc`` faults on
    O and the ``attn.checksum`` faults on Oc1). Checked (vb ``[V | Vc1 | Vc2 | 1 | 1]``), the row sum is that
    product's first ones column, ``l = α·l + Σ_n pd`` (then the ``attn.rowsum`` faults, in that column), and
    its twin ``lc`` the second: two accumulators of one product, equal in a clean run. Unchecked (vb = V),
    ``l = α·l + Σ_n P`` of the fp32 P, as plain flash attention sums it (then the ``attn.rowsum`` faults).
    ``acc`` is updated in place.

    Args:
        P: (B, Hkv, G·M, block_n) fp32; pd: the same rounded as GEMM II reads it (held in fp32), from
            `probabilities`; alpha: (B, Hkv, G·M, 1) from `rescale`.
        l: (B, Hkv, G·M, 1) the running row sum (checked: unread, acc holds it); acc: (B, Hkv, G·M, DA).
        vb: (B, Hkv, block_n, DA) the block of ``[V | Vc1 | Vc2 | 1 | 1]`` (or V alone), fp32.
        sfs: the call's `SiteFaults` by site; block_site = (B, Hq, M, block_n); j: the block index.
        head_dim: D; stride: s (the checksum columns).
        half_state: PASA's fp16 state (unchecked only): every update is then rounded to fp16 and P·V is an
            FP16 GEMM with FP16 accumulation (vb is then fp16 V).
    Returns:
        (l, acc); checked, l is acc's column ``D + 2s`` (a view).
    """
    row_site = (*block_site[:3], 1)
    D, s = head_dim, stride
    checked = acc.shape[-1] > D
    if half_state:
        alpha = round16(alpha)
        l = round16(round16(l * alpha) + round16(P.sum(-1, keepdim=True)))
        acc = round16(round16(acc * alpha) + _pasa.fp16_matmul(pd.to(torch.float16), vb).to(torch.float32))
    else:
        if not checked:
            l = l.mul_(alpha).add_(P.sum(-1, keepdim=True))
        acc = acc.mul_(alpha).add_(torch.matmul(pd, vb))
    if checked:
        lcol = D + 2 * s
        acc[..., lcol:lcol + 1] = inject(sfs["attn.rowsum"], acc[..., lcol:lcol + 1], row_site, j)
        l = acc[..., lcol:lcol + 1]
    else:
        l = inject(sfs["attn.rowsum"], l, row_site, j)
    if sfs["attn.acc"] is not None:
        acc[..., :D] = inject(sfs["attn.acc"], acc[..., :D], (*block_site[:3], D), j * D)
    if sfs["attn.checksum"] is not None and checked:  # the checksum columns: Oc1
        acc[..., D:D + s] = inject(sfs["attn.checksum"], acc[..., D:D + s], (*block_site[:3], s), j * 2 * s + s)
    return l, acc
