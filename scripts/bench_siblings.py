"""Sibling Linear layers checked in one launch, against one checked call per layer and cuBLAS.

A decode step's Q/K/V projections (and a gated MLP's gate/up projections) read one input. Side by
side in one run, per group of real model widths, rows M and dtype, each variant as CUDA-graph replays
of ``--calls`` group calls cycling over weight copies (more bytes than L2, as a layer stack streams
its weights), times per group call:

* ``cublas``     — one ``F.linear`` per layer (the unprotected model),
* ``cublas_cat`` — one ``F.linear`` of the concatenated weight (a fused-projection model; reference),
* ``checked``    — one checked call per layer (`abft_gemm.checked_gemm`, as ``Options.siblings`` off runs),
* ``siblings``   — `abft_gemm.checked_gemm_siblings` (one launch, what protection runs by default).

Every variant is timed once per round, the order rotated each round (``_timing.interleaved``); the
figures are medians over rounds. Counters of the checked variants must stay 0 (printed).

    python scripts/bench_siblings.py --out docs/bench/siblings_h200
"""

from __future__ import annotations

import argparse
import csv
import platform
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import interleaved  # noqa: E402
from bench_linear import _cycled, _graphed, weight_copies  # noqa: E402

# (name, K, widths, bias): Qwen2-0.5B / -1.5B and SmolLM2-135M projections
GROUPS = [
    ("qwen2-0.5b qkv", 896, (896, 128, 128), True),
    ("qwen2-0.5b gate/up", 896, (4864, 4864), False),
    ("qwen2-1.5b qkv", 1536, (1536, 256, 256), True),
    ("qwen2-1.5b gate/up", 1536, (8960, 8960), False),
    ("smollm2-135m qkv", 576, (576, 192, 192), False),
    ("smollm2-135m gate/up", 576, (1536, 1536), False),
]
VARIANTS = ("cublas", "cublas_cat", "checked", "siblings")


def bench_group(k: int, widths: tuple[int, ...], bias: bool, m: int, dtype: torch.dtype, calls: int,
                rounds: int, rep: int) -> dict:
    """Median µs per group call of each variant, and the checked variants' event totals."""
    from ft_transformers.kernels import abft_gemm as G

    from ft_transformers.counters import FaultStats, new_counters
    from ft_transformers.vabft import WeightChecksums, gemm_emax

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    nbytes = sum(widths) * k * 2
    copies = weight_copies(nbytes)
    sets = []
    for _ in range(copies):
        ws = [torch.randn((n, k), generator=g, device=dev).mul_(k**-0.5).to(dtype) for n in widths]
        bs = [torch.randn((n,), generator=g, device=dev).to(dtype) if bias else None for n in widths]
        sets.append((ws, bs, torch.cat(ws), torch.cat(bs) if bias else None,
                     [WeightChecksums.compute(w, b) for w, b in zip(ws, bs)]))
    x = torch.randn((m, k), generator=g, device=dev).to(dtype)
    counters = {v: [new_counters(dev) for _ in widths] for v in ("checked", "siblings")}

    def make(variant: str):
        def per_copy(j: int):
            ws, bs, wcat, bcat, wcs = sets[j]
            cnt = counters.get(variant)
            if variant == "cublas":
                return lambda: [F.linear(x, w, b) for w, b in zip(ws, bs)]
            if variant == "cublas_cat":
                return lambda: F.linear(x, wcat, bcat)
            if variant == "checked":
                return lambda: [G.checked_gemm(x, w, b, wc=wc, counters=c, emax_table=gemm_emax)
                                for w, b, wc, c in zip(ws, bs, wcs, cnt)]
            return lambda: G.checked_gemm_siblings(x, ws, bs, wcs, cnt, emax_table=gemm_emax)
        return _graphed(_cycled(per_copy, copies, calls))

    with torch.no_grad():
        fns = {v: make(v) for v in VARIANTS}
        times = interleaved(fns, rounds, lambda fn: triton.testing.do_bench(fn, rep=rep, return_mode="median"))
    torch.cuda.synchronize()
    events = {v: sum(sum(dict(FaultStats(c)).values()) for c in counters[v]) for v in counters}
    row = {v: 1e3 * statistics.median(t) / calls for v, t in times.items()}
    return {**row, "copies": copies, "events_checked": events["checked"], "events_siblings": events["siblings"]}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("docs/bench/siblings"))
    ap.add_argument("--rows", default="1,4,16", help="comma-separated M values")
    ap.add_argument("--dtypes", default="float16,bfloat16")
    ap.add_argument("--groups", default="", help="comma-separated substrings of the group names (all if empty)")
    ap.add_argument("--calls", type=int, default=16, help="group calls per graph")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rep", type=int, default=20, help="do_bench rep (ms) of one timing")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_siblings.py needs a CUDA device")
    picks = [s for s in args.groups.split(",") if s]
    groups = [gr for gr in GROUPS if not picks or any(p in gr[0] for p in picks)]
    rows = []
    for name, k, widths, bias in groups:
        for dt in args.dtypes.split(","):
            dtype = getattr(torch, dt)
            for m in (int(v) for v in args.rows.split(",")):
                r = bench_group(k, widths, bias, m, dtype, args.calls, args.rounds, args.rep)
                r = {"group": name, "K": k, "widths": "/".join(map(str, widths)), "bias": bias, "M": m, "dtype": dt,
                     **r, "siblings_vs_cublas": r["siblings"] / r["cublas"],
                     "checked_vs_cublas": r["checked"] / r["cublas"],
                     "siblings_vs_checked": r["siblings"] / r["checked"]}
                rows.append(r)
                print(f"{name:22s} {dt:9s} M={m:2d}: " + "  ".join(f"{v} {r[v]:6.2f}" for v in VARIANTS)
                      + f" us | siblings/cublas {r['siblings_vs_cublas']:.2f}x, checked/cublas "
                      f"{r['checked_vs_cublas']:.2f}x, siblings/checked {r['siblings_vs_checked']:.2f}x; "
                      f"events {r['events_checked']}/{r['events_siblings']}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out.with_suffix(".csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    head = (f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
            f"python {platform.python_version()}; µs per group call (CUDA graphs of {args.calls} calls), "
            f"median of {args.rounds} rounds")
    lines = [head, "", "| group | dtype | M | cuBLAS | cuBLAS, one weight | checked per layer | siblings | "
             "siblings / cuBLAS | checked / cuBLAS |", "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['group']} | {r['dtype']} | {r['M']} | {r['cublas']:.2f} | {r['cublas_cat']:.2f} | "
              f"{r['checked']:.2f} | {r['siblings']:.2f} | {r['siblings_vs_cublas']:.2f}× | "
              f"{r['checked_vs_cublas']:.2f}× |" for r in rows]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return rows


if __name__ == "__main__":
    main()
