"""The online softmax of one key block with its checks (``docs/algorithms.md`` steps 3–5): the
running max and its SNVR check, ``P = exp(x)`` and the product check per group, and the rescaled
accumulation of the row sum ``l``, the output ``O`` and its checksum columns.

Shapes: GQA rows, (B, Hkv, G·M, ·); m, l: (B, Hkv, G·M, 1); the accumulator (B, Hkv, G·M, DA) holds
``[O | Oc1 | Oc2 | lc]`` when checking (DA = D + 2s + 1), ``O`` alone otherwise.
"""

from __future__ import annotations

import torch

from .. import pasa as _pasa
from ..injection import SiteFaults
from ..kernels.contract import EXP_MAX_GROUP, EXP_ULPS, EXP_XMIN, LOG2E, P_MIN
from .checksums import U
from .common import count, inject
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


def exp_group_test(x: torch.Tensor, P: torch.Tensor, s: int) -> torch.Tensor:
    """Step 4: the product identity Π_l P[i, l·s+r] = exp(Σ_l x[i, l·s+r]) per group (row i, residue r),
    checked in log2 on the fp32 product of the group.

    Below x_min = −20 (masked keys included) x counts as x_min and P as P_min = exp(x_min) unless it is
    larger (a NaN-propagating max: a NaN P stays NaN, a negative one becomes P_min), so a product of
    up to 4 clamped values cannot underflow; larger groups (L > 4, other block/stride choices than
    the kernel's) are multiplied in chunks of 4 and the chunks' log2 summed. x, P: (..., L·s) fp32.
    Returns (..., s) bool: |log2 Π P − log2(e)·Σ x| > 64·u·log2(e)·(3L + |Σ x|).
    """
    L = x.shape[-1] // s
    xs = torch.fmax(x, x.new_tensor(EXP_XMIN)).view(*x.shape[:-1], L, s).sum(-2)
    pc = torch.maximum(P, P.new_tensor(P_MIN)).view(*x.shape[:-1], L, s)  # torch.maximum propagates NaN
    lp = sum(torch.log2(pc[..., c:c + EXP_MAX_GROUP, :].prod(-2)) for c in range(0, L, EXP_MAX_GROUP))
    d = lp - xs * LOG2E
    return ~(d.abs() <= (xs.abs() + 3.0 * L) * (EXP_ULPS * U * LOG2E))


def _shifted(S: torch.Tensor, m: torch.Tensor, mb: torch.Tensor, m_new: torch.Tensor) -> torch.Tensor:
    """``x = S − m_new``, with base 0 only where m_new, m and the block max are all −inf (a fully
    masked row so far: its x stays −inf)."""
    all_masked = (m_new == NEG_INF) & (mb == NEG_INF) & (m == NEG_INF)
    base = torch.where(all_masked, torch.zeros_like(m_new), m_new)
    return S - base, base


def running_max(S: torch.Tensor, m: torch.Tensor, sf: SiteFaults | None, site_shape4: tuple[int, ...], j: int,
                *, detect: bool, correct: bool, counters: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 3: the new running max, the ``attn.rowmax`` faults, the SNVR check; counts at ``attn.rowmax``.

    With ``τ_m = min(2^-20·(1 + |m_new|), 1)`` a row is faulty if ``max_n x > τ_m`` (exp would exceed
    1; NaN too), or if ``m_new ≠ m`` and ``max_n x < −τ_m`` (this block raised the max to a wrong
    value). Faulty rows are ``recomputed``: m_new and x again from m and the block max.

    Why the cap and the base rule: uncapped, τ_m would be +inf whenever m_new is ±inf (a bit-30 flip
    turns ±1.0 into ±inf) and disable both comparisons; a max corrupted to −inf would then pass with
    ``x = S − 0``, and the next block's ``α = exp(−inf − m) = 0`` would erase everything before it
    (a wrong output with no event). With the cap alone, base 0 for any ``m_new = −inf`` would still
    let that through when the block max lies in [−1, 1]; with base ``m_new`` there, ``x = +inf`` trips
    the check. In clean runs the max is exact (max x = 0, or −inf for a fully masked block), so
    neither rule can cause a false positive; the cap also keeps an undetected shift of m from
    overflowing exp when |m| is huge.

    Args:
        S: (B, Hkv, G·M, block_n) fp32 masked scores of the block.
        m: (B, Hkv, G·M, 1) the running max before the block (−inf at first).
        sf, site_shape4 = (B, Hq, M, 1), j: the site's faults at block j.
        detect, correct, counters: as `efta_reference`.
    Returns:
        ``m_new`` (B, Hkv, G·M, 1) and ``x = S − m_new`` (B, Hkv, G·M, block_n).
    """
    mb = S.amax(-1, keepdim=True)
    m_new = torch.maximum(m, mb)
    m_new = inject(sf, m_new, site_shape4, j)
    x, base = _shifted(S, m, mb, m_new)
    if detect:
        xmax = mb - base  # = max_n (S - base): subtraction rounding is monotone
        tau = m_new.abs().add_(1.0).mul_(2.0**-20).clamp_(max=1.0)
        bad = ~(xmax <= tau) | ((m_new != m) & (xmax < -tau))
        if bool(bad.any()):
            nbad = bad.sum()
            count(counters, "attn.rowmax", "detected", nbad)
            if not correct:
                count(counters, "attn.rowmax", "uncorrectable", nbad)
            else:
                count(counters, "attn.rowmax", "recomputed", nbad)
                m_new = torch.where(bad, torch.maximum(m, mb), m_new)
                x, _ = _shifted(S, m, mb, m_new)
    return m_new, x


def probabilities(x: torch.Tensor, sf: SiteFaults | None, site_shape4: tuple[int, ...], j0: int, *, stride: int,
                  half_state: bool, detect: bool, correct: bool, counters: torch.Tensor | None) -> torch.Tensor:
    """Step 4: ``P = exp(x)``, the ``attn.probs`` faults, the product check per group (`exp_group_test`);
    counts at ``attn.probs``. A faulty group is ``corrected``: exp recomputed for its members.

    ``P`` is flushed to 0 where ``x < −87`` (`exp_ftz`): the check treats those as exp(−87) anyway.

    Args:
        x: (B, Hkv, G·M, block_n) fp32 shifted scores from `running_max`.
        sf, site_shape4 = (B, Hq, M, block_n), j0: the site's faults at the block's first key.
        stride: s. half_state: PASA's fp16 softmax state (x and P rounded to fp16).
        detect, correct, counters: as `efta_reference`.
    Returns:
        P, (B, Hkv, G·M, block_n) fp32.
    """
    if half_state:
        x = round16(x)
    P = exp_ftz(x)
    if half_state:
        P = round16(P)
    P = inject(sf, P, site_shape4, j0)
    if detect:
        bad = exp_group_test(x, P, stride)  # (B, Hkv, G·M, s): groups (row, residue) that fail
        if bool(bad.any()):
            nbad = bad.sum()
            count(counters, "attn.probs", "detected", nbad)
            if not correct:
                count(counters, "attn.probs", "uncorrectable", nbad)
            else:
                count(counters, "attn.probs", "corrected", nbad)
                redo = bad.unsqueeze(-2).expand(*bad.shape[:-1], P.shape[-1] // stride, stride).reshape(P.shape)
                P = torch.where(redo, exp_ftz(x), P)
    return P


def accumulate(P: torch.Tensor, m: torch.Tensor, m_new: torch.Tensor, l: torch.Tensor, acc: torch.Tensor,
               vb: torch.Tensor, sf: SiteFaults | None, site_shape4: tuple[int, ...], j: int, *,
               vb16: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 5: rescale by ``α = exp(m − m_new)`` (1 where both are −inf) and accumulate,
    ``l = α·l + Σ_n P`` (then the ``attn.rowsum`` faults) and ``acc = α·acc + P·vb``. ``l`` and
    ``acc`` are updated in place.

    Args:
        P: (B, Hkv, G·M, block_n) fp32.
        m, m_new: (B, Hkv, G·M, 1) the running max before and after the block.
        l: (B, Hkv, G·M, 1); acc: (B, Hkv, G·M, DA).
        vb: (B, Hkv, block_n, DA) the block of ``[V | Vc1 | Vc2 | 1]`` (or V alone).
        sf, site_shape4 = (B, Hq, M, 1), j: the site's faults at block j.
        vb16: PASA's fp16 state: the block of V in fp16; every update is then rounded to fp16 and
            P·V is an FP16 GEMM with FP16 accumulation.
    Returns:
        (l, acc).
    """
    alpha = torch.exp(m - m_new)
    alpha = torch.where((m == NEG_INF) & (m_new == NEG_INF), torch.ones_like(alpha), alpha)
    if vb16 is not None:
        alpha = round16(alpha)
        l = round16(round16(l * alpha) + round16(P.sum(-1, keepdim=True)))
        l = inject(sf, l, site_shape4, j)
        pv = _pasa.fp16_matmul(P.to(torch.float16), vb16).to(torch.float32)
        return l, round16(round16(acc * alpha) + pv)
    l = l.mul_(alpha).add_(P.sum(-1, keepdim=True))
    l = inject(sf, l, site_shape4, j)
    acc = acc.mul_(alpha).add_(torch.matmul(P, vb))
    return l, acc
