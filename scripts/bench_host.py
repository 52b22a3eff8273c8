#!/usr/bin/env python
"""Host time of one eager call: the protected kernels' Python and launch work against PyTorch's.

An eager generation step of a small model is host-bound: each layer's GPU work takes less time than
the Python and kernel-launch work that issues it. This script measures that host work per call, side
by side in one run, on one CUDA device (fp16, Qwen2-0.5B's widths and heads by default):

* GEMMs: ``cublas`` (``F.linear``), ``checked`` (`checked_gemm`, the fused kernel's API) and
  ``module`` (a protected layer's path, `checked_linear` with the layer as checksum-cache owner: the
  path an enabled model takes, with its per-module fast path);
* attention: ``sdpa`` (``F.scaled_dot_product_attention`` on repeated KV heads), ``efta_off`` (EFTA,
  checks off) and ``efta`` (detect + correct), for prefill and decode shapes.

Each protected variant is timed twice: ``direct`` (compiled kernels launched through
`ft_transformers.kernels.launch.DirectLauncher`, the default) and ``triton`` (``override(direct_launch=False)``:
every launch through Triton's own ``JITFunction.run``). The variants of one shape alternate within
every round (``--rounds``, ``--calls`` calls each), and the table gives the median of the rounds:
``host`` is the time the Python call takes to return, ``wall`` the same with a synchronise after the
calls (the larger of host and GPU time). Writes ``bench_host.csv`` and ``bench_host.md`` (device and
versions, ratios to cuBLAS / SDPA) in ``--out``.

    python scripts/bench_host.py --out bench_host                 # the default shapes
    python scripts/bench_host.py --gemm 1x4864x896 --attention 1x14x2x1x1024 --out /tmp/h

CPU (``--device cpu``; the Triton kernels run in the interpreter, so the protected columns measure
the interpreter, not a launch): a smoke run of the script only.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time
from pathlib import Path

if "--device" in sys.argv and "cpu" in sys.argv[sys.argv.index("--device") + 1:][:1]:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch
import torch.nn.functional as F
from ft_transformers.kernels.options import override

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import environment  # noqa: E402

GEMMS = ["1x4864x896", "1x896x4864", "16x896x4864", "1024x4864x896", "1024x896x4864"]  # M x N x K
ATTENTION = ["1x14x2x1024x1024", "1x14x2x1x1024", "16x14x2x1x1024", "1x14x2x4096x4096"]  # B x Hq x Hkv x M x N


def _parse(spec: str, n: int) -> tuple[int, ...]:
    vals = tuple(int(v) for v in spec.lower().split("x"))
    if len(vals) != n or min(vals) < 1:
        raise SystemExit(f"bad shape {spec!r}: expected {n} positive ints joined by 'x'")
    return vals


def _time_calls(fn, calls: int, device: torch.device) -> tuple[float, float]:
    """(host µs, wall µs) per call over ``calls`` calls of ``fn``."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    sync()
    t2 = time.perf_counter()
    return 1e6 * (t1 - t0) / calls, 1e6 * (t2 - t0) / calls


def _measure(variants: dict, rounds: int, calls: int, device: torch.device) -> dict[str, tuple[float, float]]:
    """Median (host, wall) µs per call of each variant; the variants alternate within every round.
    A variant name ending in ``/triton`` runs with ``override(direct_launch=False)``."""
    for name, fn in variants.items():  # warm-up: compile, tune, prepare
        with override(direct_launch=not name.endswith("/triton")):
            for _ in range(3):
                fn()
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            with override(direct_launch=not name.endswith("/triton")):
                samples[name].append(_time_calls(fn, calls, device))
    return {name: (statistics.median(h for h, _ in s), statistics.median(w for _, w in s))
            for name, s in samples.items()}


def gemm_variants(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device) -> dict:
    from ft_transformers.kernels import abft_gemm

    from ft_transformers.checked_linear import _checked_linear_forward
    from ft_transformers.counters import new_counters
    from ft_transformers.vabft import WeightChecksums, gemm_emax

    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(m, k, device=device, generator=g).to(dtype)
    layer = torch.nn.Linear(k, n, device=device, dtype=dtype).requires_grad_(False)
    w, b = layer.weight, layer.bias
    wc = WeightChecksums.compute(w, b)
    cnt = new_counters(device)
    out = {"cublas": lambda: F.linear(x, w, b)}
    for mode in ("direct", "triton"):
        out[f"checked/{mode}"] = lambda: abft_gemm.checked_gemm(x, w, b, wc=wc, emax_table=gemm_emax, counters=cnt)
        out[f"module/{mode}"] = lambda: _checked_linear_forward(
            x, w, b, weight_is_kn=False, emax=None, csigma=2.5, detect=True, correct=True, plan=None,
            counters=cnt, cache_owner=layer)
    return out


def attention_variants(bsz: int, hq: int, hkv: int, m: int, n: int, dtype: torch.dtype,
                       device: torch.device) -> dict:
    from ft_transformers.counters import new_counters
    from ft_transformers.efta import _efta_forward
    from ft_transformers.injection import FaultPlan

    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(bsz, hq, m, 64, device=device, generator=g).to(dtype)
    k = torch.randn(bsz, hkv, n, 64, device=device, generator=g).to(dtype)
    v = torch.randn(bsz, hkv, n, 64, device=device, generator=g).to(dtype)
    kr, vr = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
    cnt, plan = new_counters(device), FaultPlan(None)

    def efta(detect: bool):
        return lambda: _efta_forward(q, k, v, scale=None, causal=True, bias=None, attn_mask=None, window=None,
                                     pasa=False, detect=detect, correct=detect, plan=plan, counters=cnt,
                                     backend="auto")

    out = {"sdpa": lambda: F.scaled_dot_product_attention(q, kr, vr, is_causal=m > 1)}
    for mode in ("direct", "triton"):
        out[f"efta_off/{mode}"] = efta(False)
        out[f"efta/{mode}"] = efta(True)
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"))
    ap.add_argument("--gemm", nargs="*", default=GEMMS, help="M x N x K shapes (e.g. 1x4864x896)")
    ap.add_argument("--attention", nargs="*", default=ATTENTION, help="B x Hq x Hkv x M x N shapes, D = 64")
    ap.add_argument("--rounds", type=int, default=7, help="rounds; each times every variant once")
    ap.add_argument("--calls", type=int, default=50, help="calls per variant and round")
    ap.add_argument("--out", type=Path, default=Path("bench_host"))
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available here; `--device cpu` runs a smoke test only")
    dtype = getattr(torch, args.dtype)
    jobs = [("gemm", s, gemm_variants(*_parse(s, 3), dtype, device), "cublas") for s in args.gemm]
    jobs += [("attention", s, attention_variants(*_parse(s, 5), dtype, device), "sdpa") for s in args.attention]
    rows = []
    with torch.no_grad():
        for kind, shape, variants, base in jobs:
            res = _measure(variants, args.rounds, args.calls, device)
            for name, (host, wall) in res.items():
                rows.append(dict(kind=kind, shape=shape, variant=name, host_us=round(host, 2), wall_us=round(wall, 2),
                                 host_ratio=round(host / res[base][0], 3)))
            print(f"{kind:9s} {shape:18s} " + "  ".join(f"{nm} {h:.0f}/{w:.0f}" for nm, (h, w) in res.items()),
                  flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "bench_host.csv", "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["kind"])
        wr.writeheader()
        wr.writerows(rows)
    lines = ["```", environment(device), f"rounds {args.rounds} x calls {args.calls}, {args.dtype}", "```", "",
             "| kind | shape | variant | host µs / call | wall µs / call | host / cuBLAS or SDPA |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['kind']} | {r['shape']} | {r['variant']} | {r['host_us']:.1f} | {r['wall_us']:.1f} | "
              f"{r['host_ratio']:.2f}× |" for r in rows]
    (args.out / "bench_host.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"\nwrote {args.out / 'bench_host.csv'}, {args.out / 'bench_host.md'}")
    return rows


if __name__ == "__main__":
    main()
