"""GEMM I and its check (``docs/algorithms.md`` step 1): ``S = (scale·Q)·K_jᵀ``, compared per group
(row i, residue r) with the checksum GEMM ``Sc = Q·[Kc1 | Kc2]ᵀ``; a single fault per group is
located and rebuilt, anything else recomputes the row's scores for the block.

Two sound variants of the letter of the contract (on clean inputs neither changes a verdict):
a located element is rebuilt as ``checksum − Σ(other members)`` (`checksums.rebuild`), and a
location in the block padding (key ≥ N) counts as out of range (the row is recomputed).

Shapes: GQA rows, q viewed as (B, Hkv, G·M, D) so that kv head h serves query heads h·G … h·G+G−1.
"""

from __future__ import annotations

import torch

from .. import pasa as _pasa
from ..injection import SiteFaults
from .checksums import FP16_ETA, g, g16, group_sums, locate, rebuild, scaled_d2
from .common import count, count_detected, inject


def query_bound(qs: torch.Tensor, nkeys_group: int, pasa: bool) -> tuple[torch.Tensor, float | None]:
    """The query factor of the threshold ``T_s = qn1·max_d Σ_l |K[l·s+r, d]| (+ s_floor)``.

    Args:
        qs: (B, Hkv, G·M, D) fp32 queries as GEMM I takes them (scale folded in; in PASA the fp16 q).
        nkeys_group: L, keys per checksum group.
        pasa: GEMM I is the FP16 GEMM with FP16 accumulation.
    Returns:
        ``qn1`` (B, Hkv, G·M, 1) = ``2·g(D+L)·‖Q_i‖₁`` (worst-case rounding of both sides; PASA adds
        one fp16 rounding per k-chunk), and ``s_floor``: PASA's fp16 subnormal floor, else None
        (``docs/pasa.md``, "checks").
    """
    D = qs.shape[-1]
    L = nkeys_group
    if pasa:
        nchunk = -(-D // _pasa.FP16_CHUNK)
        qn1 = qs.abs().sum(-1, keepdim=True).mul_(g16(nchunk) + 2.0 * g(D + L))
        return qn1, L * nchunk * FP16_ETA
    return qs.abs().sum(-1, keepdim=True).mul_(2.0 * g(D + L)), None


def block_scores(qs: torch.Tensor, kb: torch.Tensor, sf: SiteFaults | None, site_shape4: tuple[int, ...],
                 j0: int, *, q16: torch.Tensor | None = None, kb16: torch.Tensor | None = None) -> torch.Tensor:
    """GEMM I of one key block, then the ``attn.scores`` faults.

    Args:
        qs: (B, Hkv, G·M, D) fp32, scale folded in.
        kb: (B, Hkv, block_n, D) fp32 keys of the block (zero padding past N).
        sf: the site's faults; site_shape4: (B, Hq, M, block_n); j0: the block's first key.
        q16, kb16: PASA's fp16 operands (unscaled q, shifted and scaled keys K'): then GEMM I is the
            FP16 GEMM with FP16 accumulation (`pasa.fp16_matmul`).
    Returns:
        (B, Hkv, G·M, block_n) fp32 scores.
    """
    if q16 is not None:
        S = _pasa.fp16_matmul(q16, kb16.transpose(-1, -2)).to(torch.float32)
    else:
        S = torch.matmul(qs, kb.transpose(-1, -2))
    return inject(sf, S, site_shape4, j0)


def check_scores(S: torch.Tensor, qs: torch.Tensor, kb: torch.Tensor, kc: torch.Tensor, kabs: torch.Tensor,
                 qn1: torch.Tensor, s_floor: float | None, *, width: int, stride: int, correct: bool,
                 counters: torch.Tensor | None, q16: torch.Tensor | None = None,
                 kb16: torch.Tensor | None = None, sf_cs: SiteFaults | None = None,
                 cs_site: tuple[int, ...] = (), j: int = 0) -> torch.Tensor:
    """Step 1's check of one key block; counts at ``attn.scores`` and returns the repaired scores.

    ``D1[i,r] = Sc1[i,r] − Σ_l S[i,l·s+r]``, ``D2`` with weights (l+1). A group with
    ``|D1| > T_s`` (or a non-finite D1) is one fault. Located (`checksums.locate`, a real key): the
    element is rebuilt, ``corrected``; otherwise the row's block of scores is recomputed,
    ``recomputed`` (once per such group).

    Args:
        S: (B, Hkv, G·M, block_n) fp32 scores from `block_scores`.
        qs, kb: GEMM I's fp32 operands (see `block_scores`).
        kc: (B, Hkv, 2s, D) the block's ``[Kc1 | Kc2]``; kabs: (B, Hkv, s) its ``max_d Σ_l |K|``.
        qn1, s_floor: from `query_bound`.
        width: real keys in the block; stride: s.
        correct: repair; False counts ``detected`` and ``uncorrectable`` only.
        counters: the (sites, kinds) block, or None.
        q16, kb16: PASA's fp16 operands: a located element is recomputed with the FP16 GEMM's own
            arithmetic (the same bits), a row with fp32 accumulation (which also repairs a genuine
            fp16 overflow of the row).
        sf_cs, cs_site = (B, Hq, M, s), j: the ``attn.checksum`` faults, on Sc1 of block j (columns
            [2s·j, 2s·j + s) of the site). A wrong checksum fails its group; ``Sc2 = Q·Kc2ᵀ`` does not
            follow it, so ``D2/D1`` stays near 0, the group is not located and the row is recomputed.
    Returns:
        S, or a repaired copy of it.
    """
    s = stride
    L = kb.shape[-2] // s
    sc = torch.matmul(qs, kc.transpose(-1, -2))  # (B, Hkv, G·M, 2s)
    if sf_cs is not None:
        sc[..., :s] = inject(sf_cs, sc[..., :s], cs_site, j * 2 * s)
    d1 = sc[..., :s] - group_sums(S, L, s)[0]
    thr = (qn1 * kabs.unsqueeze(2)).nan_to_num_(nan=0.0)  # T_s (0·inf: the group is 0)
    if s_floor is not None:
        thr = thr.add_(s_floor)
    bad = ~(d1.abs() <= thr)  # NaN differences are faults too
    if not bool(bad.any()):
        return S
    nbad = bad.sum()
    count_detected(counters, "attn.scores", nbad, correct)
    if not correct:
        return S
    S = S.clone()
    S4 = S.view(*S.shape[:-1], L, s)
    loc, ok = locate(d1, scaled_d2(sc[..., s:], S, L, s), bad, L, S4)
    ok &= loc * s + torch.arange(s, device=S.device) < width  # a real key
    redo = bad & ~ok
    count(counters, "attn.scores", "corrected", ok.sum())
    count(counters, "attn.scores", "recomputed", redo.sum())
    if bool(ok.any()):
        idx = ok.nonzero()  # (K, 4): b, hkv, row, r
        lk = loc[ok]
        if q16 is not None:
            col = lk * s + idx[:, 3]
            qe = q16[idx[:, 0], idx[:, 1], idx[:, 2]].unsqueeze(1)  # (K, 1, D)
            ke = kb16[idx[:, 0], idx[:, 1], col].unsqueeze(2)  # (K, D, 1)
            new = _pasa.fp16_matmul(qe, ke).view(-1).to(torch.float32)
        else:
            new = rebuild(S4, idx, lk, sc[..., :s][ok])
        S4[idx[:, 0], idx[:, 1], idx[:, 2], lk, idx[:, 3]] = new
    rows = redo.any(-1)
    if bool(rows.any()):
        ridx = rows.nonzero()  # (R, 3): b, hkv, row
        S[ridx[:, 0], ridx[:, 1], ridx[:, 2]] = torch.bmm(
            kb[ridx[:, 0], ridx[:, 1]], qs[ridx[:, 0], ridx[:, 1], ridx[:, 2]].unsqueeze(2)).squeeze(2)
    return S
