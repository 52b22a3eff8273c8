"""Detect+correct and checks-off EFTA time at one fixed config, for one tree (argv[1] names it); ab.sh
alternates the trees. Run with PYTHONPATH at a tree laid out as an importable package."""

import sys

import torch
import triton

import ft_transformers as ftt

SHAPES = [(torch.float16, 4, 32, 4096, 128), (torch.float16, 4, 16, 4096, 64), (torch.bfloat16, 4, 32, 4096, 128)]
for dt, B, H, S, D in SHAPES:
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=dt) for _ in range(3))

    def checked(q=q, k=k, v=v):
        return ftt.efta_attention(q, k, v, causal=True, backend="triton")

    def off(q=q, k=k, v=v):
        return ftt.efta_attention(q, k, v, causal=True, backend="triton", detect=False, correct=False)

    t = triton.testing.do_bench(checked, warmup=20, rep=60)
    t0 = triton.testing.do_bench(off, warmup=20, rep=60)
    print(sys.argv[1], dt, B, H, S, D, f"checked {t:.3f} ms off {t0:.3f} ms ratio {t / t0:.3f}", flush=True)
