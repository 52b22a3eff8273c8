"""One tree's checked EFTA at fp16 D = 128, autotuned (argv[1] names the tree; gpu_ab.sh alternates them, each
with PYTHONPATH at its laid-out package): per shape, 4 clean calls against fp32 SDPA (largest error, events),
then detect+correct timed with do_bench and the config the autotuner picked for the clean launch."""

import sys

import torch
import torch.nn.functional as F
import triton
from ft_transformers.kernels.efta import host

import ft_transformers as ftt

SHAPES = [(4, 32, 4096, True), (4, 32, 4096, False), (16, 32, 1024, True)]
for B, H, S, causal in SHAPES:
    errs, events = [], 0
    for seed in range(4):
        g = torch.Generator(device="cuda").manual_seed(seed)
        q, k, v = (torch.randn(B, H, S, 128, device="cuda", generator=g).half() for _ in range(3))
        out, stats = ftt.efta_attention(q, k, v, causal=causal, backend="triton")
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
        errs.append(float((out.float() - ref).abs().max()))
        events += int(stats["detected"])
    def checked(q=q, k=k, v=v, causal=causal):
        return ftt.efta_attention(q, k, v, causal=causal, backend="triton")

    t = triton.testing.do_bench(checked, warmup=20, rep=80)
    cfgs = sorted({tuple(c) for c in host._TUNED.values()})
    print(f"{sys.argv[1]} fp16 B={B} H={H} S={S} D=128 causal={causal}: detect+correct {t:.3f} ms; max err "
          f"{max(errs):.2e}; events {events} in 4 calls; tuned configs so far {cfgs}", flush=True)
