"""The tests' independent oracle: materialised float64 softmax attention."""

from __future__ import annotations

import math

import torch


def ref_attention(q, k, v, *, scale=None, causal=False, bias=None, attn_mask=None, window=None):
    """float64 softmax(scale·q·kᵀ + bias + mask)·v, GQA by repetition; fully masked rows → 0."""
    q, k, v = q.double().cpu(), k.double().cpu(), v.double().cpu()
    B, Hq, M, D = q.shape
    N = k.shape[2]
    G = Hq // k.shape[1]
    k = k.repeat_interleave(G, dim=1)
    v = v.repeat_interleave(G, dim=1)
    s = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(D) if scale is None else scale)
    if bias is not None:
        s = s + bias.double().cpu()
    if attn_mask is not None:
        am = attn_mask.cpu()
        s = s.masked_fill(~am, -math.inf) if am.dtype == torch.bool else s + am.double()
    i = torch.arange(M).unsqueeze(1) + (N - M)
    j = torch.arange(N).unsqueeze(0)
    ok = torch.ones(M, N, dtype=torch.bool)
    if causal:
        ok &= j <= i
    if window is not None:
        ok &= j > i - window
    s = s.masked_fill(~ok, -math.inf)
    p = torch.softmax(s, dim=-1)
    p = p.masked_fill((s == -math.inf).all(dim=-1, keepdim=True), 0.0)
    return p @ v
