#!/usr/bin/env python
"""GPU smoke test of the Triton EFTA kernel on clean inputs: max error against a float64
attention and the counter total (which must be 0 on clean data). See docs/triton_efta_gpu.md.

    FTT_EFTA_CONFIG=64,64,4,3 python scripts/efta_gpu_smoke.py float16 1 gqa

Arguments: dtype (float16 | bfloat16 | float32), detect (1 | 0), case (gqa | big | d128 | decode).
"""

from __future__ import annotations

import math
import sys

import torch
from ft_transformers.kernels import efta as K
from ft_transformers.kernels.options import options

from ft_transformers.counters import new_counters
from ft_transformers.injection import FaultPlan

CASES = {  # (B, Hq, Hkv, M, N, D, causal)
    "gqa": (2, 4, 2, 48, 80, 64, True),
    "big": (1, 16, 16, 1024, 1024, 64, False),
    "d128": (1, 8, 8, 256, 256, 128, True),
    "decode": (2, 16, 4, 1, 8192, 128, True),  # q_len 1, GQA 4:1 (FTT_EFTA_SPLIT=n splits the keys)
}


def main() -> None:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, sys.argv[1])
    detect = sys.argv[2] == "1"
    B, Hq, Hkv, M, N, D, causal = CASES[sys.argv[3]]
    torch.manual_seed(0)
    q = torch.randn(B, Hq, M, D, device=dev, dtype=dtype)
    k = torch.randn(B, Hkv, N, D, device=dev, dtype=dtype)
    v = torch.randn(B, Hkv, N, D, device=dev, dtype=dtype)
    cnt = new_counters(dev)
    out = K.efta_triton_forward(q, k, v, scale=1 / math.sqrt(D), causal=causal, bias=None, attn_mask=None,
                                window=None, detect=detect, correct=detect, plan=FaultPlan(None), counters=cnt)
    kk = k.repeat_interleave(Hq // Hkv, 1).double()
    vv = v.repeat_interleave(Hq // Hkv, 1).double()
    s = (q.double() @ kk.transpose(-1, -2)) / math.sqrt(D)
    if causal:
        i = torch.arange(M, device=dev)[:, None] + N - M
        s = s.masked_fill(torch.arange(N, device=dev)[None] > i, float("-inf"))
    err = (out.double() - torch.softmax(s, -1) @ vv).abs().max().item()
    print("OK", options().efta_config, sys.argv[1:], "err", err, "cnt", cnt.sum().item())


if __name__ == "__main__":
    main()
