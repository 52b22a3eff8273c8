"""After the last key block (``docs/algorithms.md`` steps 6–8): the row-sum check, the normalisation
``O /= l`` and the unified verification of GEMM II through its checksum columns ``Oc1, Oc2``
(carried through the same α rescale and P·V accumulation as O), then the recompute of the rows
that were flagged (`RowRecompute`: plain fp32 materialised softmax attention, unchecked and
without injection).

Shapes: GQA rows, (B, Hkv, G·M, ·); the accumulator ``acc`` (B, Hkv, G·M, D + 2s + 2) holds
``[O | Oc1 | Oc2 | l | lc]`` when checking.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..injection import SiteFaults
from .checksums import g, group_sums, locate, rebuild, scaled_d2
from .common import count, count_detected, inject
from .masks import NEG_INF, Masks
from .softmax import round16

_RECOMPUTE_CHUNK = 1 << 24  # elements of gathered K/V per chunk of the row recompute


class RowRecompute:
    """The operands a row recompute needs (fp32, keys unpadded).

    Args:
        qs5: (B, Hkv, G, M, D) queries with the softmax scale folded in.
        k32, v32: (B, Hkv, N, D) keys and values.
        masks: the call's `Masks`.
    """

    def __init__(self, qs5: torch.Tensor, k32: torch.Tensor, v32: torch.Tensor, masks: Masks):
        self.qs5 = qs5
        self.k32 = k32
        self.v32 = v32
        self.masks = masks

    def attend(self, rows: torch.Tensor) -> torch.Tensor:
        """Attention of the GQA rows ``rows`` (R, 3) = (b, hkv, g·M + m) → (R, D) fp32; fully masked
        rows give 0."""
        M = self.qs5.shape[3]
        idx = torch.stack([rows[:, 0], rows[:, 1], rows[:, 2] // M, rows[:, 2] % M], 1)
        R = idx.shape[0]
        D = self.qs5.shape[-1]
        n = self.k32.shape[2]
        out = torch.empty(R, D, dtype=torch.float32, device=self.qs5.device)
        chunk = max(1, _RECOMPUTE_CHUNK // max(1, n * D))
        for c0 in range(0, R, chunk):
            ix = idx[c0:c0 + chunk]
            b, h, gi, mi = ix.unbind(1)
            q = self.qs5[b, h, gi, mi]
            s = torch.bmm(self.k32[b, h], q.unsqueeze(2)).squeeze(2)
            s = self.masks.apply_rows(s, ix)
            mx = s.amax(dim=1, keepdim=True)
            mx = torch.where(mx == NEG_INF, torch.zeros_like(mx), mx)
            p = torch.exp(s - mx)
            l = p.sum(dim=1, keepdim=True)
            o = torch.bmm(p.unsqueeze(1), self.v32[b, h]).squeeze(1)
            out[c0:c0 + chunk] = torch.where(l > 0, o / torch.where(l > 0, l, torch.ones_like(l)),
                                             torch.zeros_like(o))
        return out


def check_row_sums(l: torch.Tensor, acc: torch.Tensor, nvalid: torch.Tensor, *, block_n: int, nblocks: int,
                   correct: bool, counters: torch.Tensor | None) -> torch.Tensor | None:
    """Step 6: the row sum's range and its twin; counts at ``attn.rowsum``.

    With ``τ_l = 2·g(block_n + 2·nblocks + 4)``, a row with unmasked keys is faulty unless
    ``1 − τ_l ≤ l ≤ nvalid·(1 + τ_l)`` and ``l = lc`` (two columns of one product, rescaled alike: equal
    bit for bit in a clean run); a fully masked row is faulty if ``l ≠ 0``. Faulty rows are ``recomputed``
    (from scratch, after step 7).

    Args:
        l: (B, Hkv, G·M, 1) fp32 row sums; acc: the accumulator (its last column is lc).
        nvalid: (B, Hkv, G·M, 1) int32 unmasked keys per row.
        block_n, nblocks: the key blocking. correct, counters: as `efta_reference`.
    Returns:
        (B, Hkv, G·M, 1) bool, the rows to recompute, or None when none is (or ``correct`` is off).
    """
    tau_l = 2.0 * g(block_n + 2 * nblocks + 4)
    lc = acc[..., -1:]
    nv = nvalid.to(torch.float32)
    fine = (l >= 1.0 - tau_l) & (l <= nv * (1.0 + tau_l)) & (l == lc)
    bad6 = torch.where(nvalid > 0, ~fine, l != 0)
    if not bool(bad6.any()):
        return None
    nbad = bad6.sum()
    count_detected(counters, "attn.rowsum", nbad, correct, "recomputed")
    if not correct:
        return None
    return bad6


def normalise(l: torch.Tensor, acc: torch.Tensor, half_state: bool) -> torch.Tensor:
    """Step 7's ``acc / l`` (O and its checksum columns alike); rows with l = 0 give 0.

    Args:
        l: (B, Hkv, G·M, 1); acc: (B, Hkv, G·M, DA). half_state: PASA's fp16 state (result rounded
            to fp16).
    Returns:
        (B, Hkv, G·M, DA) fp32.
    """
    lsafe = torch.where(l == 0, torch.ones_like(l), l)
    acc = torch.where(l == 0, torch.zeros_like(acc), acc / lsafe)
    if half_state:
        acc = round16(acc)
    return acc


def extract(acc: torch.Tensor, head_dim: int, sf: SiteFaults | None, site_shape4: tuple[int, ...]
           ) -> torch.Tensor:
    """The normalised O, ``acc[..., :D]``, with the ``attn.output`` faults: (B, Hkv, G·M, D)."""
    return inject(sf, acc[..., :head_dim], site_shape4, 0)


def verify_output(O: torch.Tensor, acc: torch.Tensor, vmax: torch.Tensor, redo_rows: torch.Tensor | None, *,
                  stride: int, block_n: int, nblocks: int, correct: bool, counters: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Step 7's unified verification; counts at ``attn.output``.

    ``D1[i,r] = Oc1[i,r] − Σ_l O[i,l·s+r]`` (D zero-padded to Dp, Lv = Dp/s groups), ``D2`` with
    weights (l+1), threshold ``T_o = 2·g(block_n + 2·nblocks + Lv + 4)·max_n Σ_l |V[n, l·s+r]|``
    (Σ_n P/l = 1 bounds the accumulated rounding). Located in a real column: rebuilt from the
    checksum, ``corrected``; otherwise the row joins the recompute, ``recomputed``. Rows already
    flagged by step 6 are skipped (they are recomputed anyway), so one fault is not counted twice.

    Args:
        O: (B, Hkv, G·M, D) from `extract`; acc: the normalised accumulator (`normalise`).
        vmax: (B, Hkv, 1, s) from `checksums.value_checksums`.
        redo_rows: (B, Hkv, G·M, 1) bool from `check_row_sums`, or None.
        stride: s. block_n, nblocks: the key blocking. correct, counters: as `efta_reference`.
    Returns:
        (O or a repaired copy, the rows to recompute or None).
    """
    s = stride
    B, Hkv, GM, D = O.shape
    Dp = -(-D // s) * s
    Lv = Dp // s
    oc1 = acc[..., D:D + s]
    oc2 = acc[..., D + s:D + 2 * s]
    Og = (F.pad(O, (0, Dp - D)) if Dp != D else O).reshape(B, Hkv, GM, Lv, s)
    d1 = oc1 - group_sums(Og.flatten(-2), Lv, s)[0]
    thr = 2.0 * g(block_n + 2 * nblocks + Lv + 4) * vmax
    bad = ~(d1.abs() <= thr)
    if redo_rows is not None:
        bad &= ~redo_rows
    if not bool(bad.any()):
        return O, redo_rows
    nbad = bad.sum()
    count_detected(counters, "attn.output", nbad, correct)
    if not correct:
        return O, redo_rows
    loc, ok = locate(d1, scaled_d2(oc2, Og.flatten(-2), Lv, s), bad, Lv, Og)
    ok &= loc * s + torch.arange(s, device=O.device) < D  # a real column
    redo = bad & ~ok
    count(counters, "attn.output", "corrected", ok.sum())
    count(counters, "attn.output", "recomputed", redo.sum())
    O = O.clone()
    if bool(ok.any()):
        idx = ok.nonzero()  # (K, 4): b, hkv, row, r
        lk = loc[ok]
        new = rebuild(Og, idx, lk, oc1[ok])
        O[idx[:, 0], idx[:, 1], idx[:, 2], lk * s + idx[:, 3]] = new
    rows = redo.any(-1, keepdim=True)
    return O, rows if redo_rows is None else (redo_rows | rows)


def recompute_rows(O: torch.Tensor, redo_rows: torch.Tensor | None, recompute: RowRecompute) -> torch.Tensor:
    """The flagged rows of O (B, Hkv, G·M, D), in place, replaced by their plain fp32 recompute."""
    if redo_rows is not None and bool(redo_rows.any()):
        ridx = redo_rows.squeeze(-1).nonzero()
        O[ridx[:, 0], ridx[:, 1], ridx[:, 2]] = recompute.attend(ridx)
    return O
