"""The checked GEMM on a GPU against float64 and the reference path, and a clean sweep (no GPU-free mode).

For each dtype (fp16, bf16, fp32) and a list of real layer shapes (decode, short prompts, prefill, lm_head):
the clean call's error against float64 and its events (any is a false positive); two-flip injections at
high and low bits, counted by the Triton backend and by the reference path (their counts must agree where
the reference runs: every shape but the largest), and the error left after the repair. Then 20 clean
calls per (dtype, distribution, shape) through a protected layer's path, counted in one block.

    python scripts/gemm_gpu_check.py OUT_DIR      → OUT_DIR/gpu_check.json, mismatches printed
"""
import json
import os
import sys
import time

import torch

import ft_transformers as ftt
from ft_transformers import FaultSpec
from ft_transformers.checked_linear import _checked_linear_forward
from ft_transformers.counters import FaultStats, new_counters

out = sys.argv[1] if len(sys.argv) > 1 else "."
dev = "cuda"
res = {"mismatch": [], "clean_events": 0, "clean_calls": 0, "value_err": []}
torch.manual_seed(0)
shapes = [(1, 896, 896), (16, 4864, 896), (5, 151936, 896), (40, 2688, 896), (512, 49152, 576),
          (4096, 896, 4864), (4096, 4864, 896), (300, 1000, 333), (2048, 4096, 4096)]
t0 = time.time()
for dtype in (torch.float16, torch.bfloat16, torch.float32):
    for (m, n, k) in shapes:
        if dtype == torch.float32 and m * n * k > 2e10:
            continue
        x = torch.randn(m, k, device=dev).to(dtype)
        w = (torch.randn(n, k, device=dev) / k**0.5).to(dtype)
        b = torch.randn(n, device=dev).to(dtype)
        with torch.no_grad():
            y, st = ftt.checked_linear(x, w, b, backend="triton")
            ref = x.double() @ w.double().t() + b.double()
            err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
            res["value_err"].append((str(dtype), m, n, k, err, dict(st)))
            for bit in ((12, 13, 14, 10, 5) if dtype != torch.float32 else (28, 30, 25, 20)):
                for seed in range(2):
                    spec = FaultSpec(site="linear.output", bit=bit, count=2, seed=seed)
                    yk, sk = ftt.checked_linear(x, w, b, backend="triton", inject=spec)
                    if m * n <= 40 * 49152 * 4:
                        yr, sr = ftt.checked_linear(x, w, b, backend="reference", inject=spec)
                        if dict(sk) != dict(sr):
                            res["mismatch"].append((str(dtype), m, n, k, bit, seed, dict(sk), dict(sr)))
                    e2 = ((yk.double() - ref).abs().max() / ref.abs().max()).item()
                    if e2 > 10 * max(err, 1e-7):
                        res["mismatch"].append(("VALUE", str(dtype), m, n, k, bit, seed, e2, dict(sk)))
        print(dtype, m, n, k, "err", err, dict(st), round(time.time() - t0, 1), flush=True)
# clean sweep: four distributions, all forms
dists = {"N01": lambda s: torch.randn(s, device=dev), "N11": lambda s: torch.randn(s, device=dev) + 1,
         "U": lambda s: torch.rand(s, device=dev) * 2 - 1, "absN11": lambda s: (torch.randn(s, device=dev) + 1).abs()}
c = new_counters(dev)
for dtype in (torch.float16, torch.bfloat16):
    for d in dists.values():
        for (m, n, k) in [(1, 4864, 896), (16, 896, 4864), (128, 2688, 896), (512, 896, 4864), (4096, 4864, 896),
                          (8, 49152, 576)]:
            w = (d((n, k)) / k**0.5).to(dtype)
            lin = torch.nn.Linear(k, n, bias=True, device=dev, dtype=dtype)
            with torch.no_grad():
                lin.weight.copy_(w)
                lin.bias.copy_(d((n,)).to(dtype))
                for _ in range(20):
                    x = d((m, k)).to(dtype)
                    _checked_linear_forward(x, lin.weight, lin.bias, weight_is_kn=False, emax=None, csigma=2.5,
                                            detect=True, correct=True, plan=None, counters=c, cache_owner=lin)
                    res["clean_calls"] += 1
torch.cuda.synchronize()
res["clean_stats"] = dict(FaultStats(c))
print("clean", res["clean_calls"], res["clean_stats"], "mismatches", len(res["mismatch"]), round(time.time() - t0, 1))
for mm in res["mismatch"][:30]:
    print("MISMATCH", mm)
os.makedirs(out, exist_ok=True)
json.dump(res, open(os.path.join(out, "gpu_check.json"), "w"), indent=1, default=str)
