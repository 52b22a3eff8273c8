"""Which keys a query row sees: the additive bias, bool or additive ``attn_mask``, causal and
sliding-window positions, and the key padding of the last block (``docs/algorithms.md`` step 2).

Positions are bottom-right aligned: query row i sits at absolute position ``i + N − M``; causal
shows it keys ``j ≤ i + N − M``, a window of w keys ``j > i + N − M − w``. A bool mask (True =
attend) is *added* as 0 / −inf, as SDPA applies it (and as the kernel must: Triton's select on a
loaded mask hits a compiler bug), so a NaN or +inf score at a masked position stays NaN.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def additive(keep: torch.Tensor) -> torch.Tensor:
    """A bool mask (True = attend) as the additive 0 / −inf it stands for (fp32, same shape)."""
    return torch.zeros(keep.shape, dtype=torch.float32, device=keep.device).masked_fill_(~keep, NEG_INF)


def broadcast_to_scores(t: torch.Tensor | None, shape: tuple[int, int, int, int], name: str
                        ) -> torch.Tensor | None:
    """``t`` as a 4-D view broadcastable to ``shape`` = (B, Hq, M, N); raises ValueError if it is not."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    if t.dim() > 4:
        raise ValueError(f"{name} must have at most 4 dims (broadcastable to (B, Hq, M, N) = {shape}), "
                         f"got shape {tuple(t.shape)}")
    t4 = t.reshape((1,) * (4 - t.dim()) + tuple(t.shape))
    for have, want in zip(t4.shape, shape, strict=True):
        if have != 1 and have != want:
            raise ValueError(f"{name} of shape {tuple(t.shape)} is not broadcastable to "
                             f"(B, Hq, M, N) = {shape}")
    return t4


def _expand_keys(t4: torch.Tensor | None, n: int) -> torch.Tensor | None:
    """A (…, 1) key dim broadcast to n (a view), so that key blocks can be sliced out of it."""
    if t4 is None or t4.shape[-1] == n:
        return t4
    return t4.expand(*t4.shape[:-1], n)


def _to5d(t4: torch.Tensor | None, hkv: int, groups: int) -> torch.Tensor | None:
    """(b, h, m, n) broadcastable to (B, Hq, M, N) → (b, Hkv|1, G|1, m, n) broadcastable to the 5-D scores."""
    if t4 is None:
        return None
    b, h, m, n = t4.shape
    if h == 1:
        return t4.unsqueeze(2)
    return t4.reshape(b, hkv, groups, m, n)


class Masks:
    """Everything that hides keys from a row in one call, as views broadcastable to the GQA-shaped
    scores (B, Hkv, G, M, N) (query head h = kv head h // G, group member h % G).

    Args:
        bias: additive float, broadcastable to ``full4``, or None.
        attn_mask: bool (True = attend) or additive float, broadcastable to ``full4``, or None.
        full4: (B, Hq, M, N), the scores' shape.
        hkv: Hkv; groups: G = Hq / Hkv.
        causal, window: bottom-right aligned positional masks (window None = none).
    Raises:
        ValueError (TypeError) when ``bias`` or ``attn_mask`` is not broadcastable to ``full4``.
    """

    def __init__(self, bias: torch.Tensor | None, attn_mask: torch.Tensor | None,
                 full4: tuple[int, int, int, int], hkv: int, groups: int, causal: bool, window: int | None):
        B, _, self.m, self.n = full4
        self.shape5 = (B, hkv, groups, self.m, self.n)
        self.bias4 = _expand_keys(broadcast_to_scores(bias, full4, "bias"), self.n)
        mask4 = _expand_keys(broadcast_to_scores(attn_mask, full4, "attn_mask"), self.n)
        self.bmask4 = self.amask4 = None
        if mask4 is not None:
            if mask4.dtype == torch.bool:
                self.bmask4 = mask4
            else:
                self.amask4 = mask4
        self.bias5 = _to5d(self.bias4, hkv, groups)
        self.amask5 = _to5d(self.amask4, hkv, groups)
        self.bmask5 = _to5d(self.bmask4, hkv, groups)
        self.causal = causal
        self.window = window

    @property
    def positional(self) -> bool:
        """Whether a causal or window mask applies."""
        return self.causal or self.window is not None

    def nonfinite(self) -> bool:
        """Whether ``bias`` or an additive ``attn_mask`` holds NaN or +inf (−inf there is a mask value)."""
        return any(bool((torch.isnan(t) | torch.isposinf(t)).any())
                   for t in (self.bias4, self.amask4) if t is not None)

    def visible(self, mi: torch.Tensor, cols: torch.Tensor) -> torch.Tensor | None:
        """Causal/window visibility of keys ``cols`` (C,) for query rows ``mi`` (R,) → (R, C) bool, or
        None when no positional mask applies."""
        if not self.positional:
            return None
        pos = (mi + (self.n - self.m)).unsqueeze(1)
        ok = torch.ones(mi.shape[0], cols.shape[0], dtype=torch.bool, device=mi.device)
        if self.causal:
            ok &= cols.unsqueeze(0) <= pos
        if self.window is not None:
            ok &= cols.unsqueeze(0) > pos - self.window
        return ok

    def apply_block(self, S5: torch.Tensor, j0: int, width: int) -> None:
        """Step 2 on one key block, in place: ``S += bias``, masked entries −inf (key padding included).

        Args:
            S5: (B, Hkv, G, M, block_n) fp32 scores of the block of keys ``j0 … j0 + block_n − 1``.
            j0: first key of the block; width: its real keys (the rest is padding).
        """
        block_n = S5.shape[-1]
        if (self.bias5 is None and self.amask5 is None and self.bmask5 is None and not self.positional
                and width == block_n):
            return
        Sv = S5[..., :width]
        if self.bias5 is not None:
            Sv += self.bias5[..., j0:j0 + width].to(torch.float32)
        if self.amask5 is not None:
            Sv += self.amask5[..., j0:j0 + width].to(torch.float32)
        if self.bmask5 is not None:
            Sv += additive(self.bmask5[..., j0:j0 + width])
        if self.positional:
            dev = S5.device
            Sv.masked_fill_(~self.visible(torch.arange(self.m, device=dev),
                                          torch.arange(j0, j0 + width, device=dev)), NEG_INF)
        if width < block_n:
            S5[..., width:] = NEG_INF

    def apply_rows(self, s: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Step 2 on whole rows (the recompute): bias and masks added, hidden keys −inf.

        Args:
            s: (R, N) fp32 scores of the rows ``idx``.
            idx: (R, 4) long, the rows' (b, hkv, g, m).
        Returns:
            (R, N) a new tensor.
        """
        b, h, gi, mi = idx.unbind(1)
        full = self.shape5
        if self.bias5 is not None:
            s = s + self.bias5.expand(full)[b, h, gi, mi].float()
        if self.amask5 is not None:
            s = s + self.amask5.expand(full)[b, h, gi, mi].float()
        if self.bmask5 is not None:
            s = s + additive(self.bmask5.expand(full)[b, h, gi, mi])
        pos = self.visible(mi, torch.arange(self.n, device=s.device))
        if pos is not None:
            s = s.masked_fill(~pos, NEG_INF)
        return s
