"""Clean calls of the EFTA kernel on the GPU: detections (must be 0) and error against fp32 SDPA."""

import sys
import time

import torch
import torch.nn.functional as F

import ft_transformers as ftt

t0 = time.time()
ALL = [(torch.float16, 128, True, 512), (torch.bfloat16, 128, True, 512), (torch.float16, 128, True, 1),
       (torch.bfloat16, 128, True, 1)]
cases = [c for c in ALL if (c[3] == 1) == (sys.argv[2] == "decode")]
for dt, D, causal, M in cases:
    tot = {}
    worst = 0.0
    calls = 0
    for seed in range(int(sys.argv[1])):
        g = torch.Generator(device="cuda").manual_seed(seed)
        B, H, N = 2, 8, (512 if M > 1 else 512 + 64 * (seed % 5))
        scale = [1.0, 3.0, 0.3][seed % 3]
        q = (torch.randn(B, H, M, D, device="cuda", generator=g) * scale).to(dt)
        k = (torch.randn(B, H, N, D, device="cuda", generator=g) * scale).to(dt)
        v = (torch.randn(B, H, N, D, device="cuda", generator=g) + (seed % 2)).to(dt)
        out, st = ftt.efta_attention(q, k, v, causal=causal, backend="triton")
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal and M > 1)
        worst = max(worst, float((out.float() - ref).abs().max()))
        for kk, n in dict(st).items():
            tot[kk] = tot.get(kk, 0) + int(n)
        calls += 1
    print(dt, "D", D, "M", M, "calls", calls, "events", tot, "max err", f"{worst:.2e}",
          f"{time.time() - t0:.0f}s", flush=True)
