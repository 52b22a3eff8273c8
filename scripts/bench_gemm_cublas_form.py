"""Study of a checked-GEMM form for the shapes where the fused Triton GEMM is slow: cuBLAS computes the
product with fp32 output, and the per-(row, 64-column group) check runs after it.

    y32 = x · Wᵀ (+ b)              cuBLAS, fp16/bf16 operands, fp32 accumulation and fp32 output
    P[m, g] = Σ_{n∈g} y32[m, n]      the group sums, before any rounding
    C[m, g] = x[m] · w1_g + b1_g     the group checksums: x against w1_g's fp32 value held as 2 (fp16) or
                                     3 (bf16) slices of x's dtype, each product exact in fp32
    |P − C| ≤ T[m, g]                SPEC §5 over the group's n_g columns (`group_checksums`' constants,
                                     x's row mean and Bhatia–Davis bound), the accumulator e_max
    y = round(y32)                   the output in x's dtype

Here every step is a PyTorch op (7–9 launches, each reading what the one before wrote): an *upper bound*
of the form's cost. A fused version reads y32 once (group sums, check and rounding in one pass) and takes
the checksum dots in the same launch. Timed as CUDA-graph replays against cuBLAS's fp16/bf16 `F.linear`
and the library's fused checked GEMM, at the Linear shapes of Qwen2-0.5B and Qwen2-7B for short prompts,
medium and long prefill. It also reports the clean ratio max |P − C| / T (cuBLAS sums in its own order,
possibly split over K: the e_max measured for the Triton kernels must still cover it) and whether a flip
of one exponent bit of y32 in one group is caught.

    python scripts/bench_gemm_cublas_form.py --out gemm_cublas_form.csv [--dtype bfloat16] [--quick]
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import environment  # noqa: E402
from _timing import interleaved  # noqa: E402
from bench_linear import _graphed  # noqa: E402

# (model, layer, N, K)
LAYERS = [("qwen2-0.5b", "q/o", 896, 896), ("qwen2-0.5b", "k/v", 128, 896), ("qwen2-0.5b", "gate/up", 4864, 896),
          ("qwen2-0.5b", "down", 896, 4864), ("qwen2-7b", "q/o", 3584, 3584), ("qwen2-7b", "k/v", 512, 3584),
          ("qwen2-7b", "gate/up", 18944, 3584), ("qwen2-7b", "down", 3584, 18944)]
ROWS = (64, 128, 512, 4096)


def _product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (M, K) · wᵀ (K, N) accumulated and returned in fp32: cuBLAS with fp32 output on CUDA; on the CPU
    (the script's tests) the upcast operands' fp32 product, the same exact products."""
    if x.is_cuda:
        return torch.mm(x, w.t(), out_dtype=torch.float32)
    return x.float() @ w.float().t()


class CublasForm:
    """The form for one weight (N, K) and bias (N,): `__call__(x) -> y`, counting failing groups in
    ``self.failed`` (a device tensor: no host synchronisation per call)."""

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None, emax: float, csigma: float = 2.5) -> None:
        from ft_transformers.kernels.abft_gemm.calls import _group_sums, group_operand
        from ft_transformers.kernels.gemm_checksums import WeightChecksums

        wc = WeightChecksums.compute(w, b)
        slices, self.inv = group_operand(wc, w, b, False, w.dtype)  # (S, T, K): w1_g in S slices of w's dtype
        self.consts = _group_sums(wc, w, b, False)[1]
        self.w, self.b, self.n, self.t = w, b, w.shape[0], slices.shape[1]
        self.wc = slices.reshape(-1, slices.shape[2])  # (S·T, K)
        self.emax, self.csigma = emax, csigma
        self.failed = torch.zeros((), dtype=torch.int64, device=w.device)
        self.ratio = torch.zeros((), dtype=torch.float32, device=w.device)  # the largest |P − C| / T seen
        self.flip: tuple[int, int] | None = None  # (row, column) of y32 whose exponent bit 4 flips

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        y32 = _product(x, self.w)
        if self.b is not None:
            y32 += self.b.float()
        if self.flip is not None:
            r, c = self.flip
            y32[r, c] = (y32[r, c].view(torch.int32) ^ (1 << 27)).view(torch.float32)
        npad = self.t * 64 - self.n
        p = (F.pad(y32, (0, npad)) if npad else y32).view(m, self.t, 64).sum(-1)
        c = _product(x, self.wc).view(m, -1, self.t).sum(1) * self.inv + self.consts[:, 0]
        x32 = x.float()
        mu = x32.mean(1, keepdim=True)
        var = ((x32.amax(1, keepdim=True) - mu) * (mu - x32.amin(1, keepdim=True))).clamp_min(0)
        k = self.consts
        thr = self.emax * (k[:, 1] * mu.abs() + self.csigma * torch.sqrt(mu * mu * k[:, 2] + var * k[:, 3])
                           + self.csigma * k[:, 4] * var.sqrt() + k[:, 5] + self.csigma * k[:, 6])
        d = (p - c).abs()
        self.failed += (~(d <= thr)).sum()
        torch.maximum(self.ratio, (d / thr).amax(), out=self.ratio)
        return y32.to(x.dtype)


def bench_shape(m: int, n: int, k: int, dtype: torch.dtype, rep: int, rounds: int) -> dict:
    """One shape: times (ms per call, medians over rounds) of cuBLAS, the form, its cuBLAS product alone
    (fp32 output) and the fused checked GEMM; the form's clean ratio and its detection of one flip."""
    import statistics

    import triton.testing
    from ft_transformers.kernels import abft_gemm

    from ft_transformers.checked_linear import _triton
    from ft_transformers.counters import new_counters
    from ft_transformers.vabft import gemm_emax

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(m * 7 + n * 3 + k)
    x = torch.randn(m, k, device=dev, generator=g).to(dtype)
    w = (torch.randn(n, k, device=dev, generator=g) * k**-0.5).to(dtype)
    form = CublasForm(w, None, gemm_emax(dtype, dev, "accumulator", k))
    cnt, owner = new_counters(dev), torch.nn.Module()
    fns = {
        "cublas": _graphed(lambda: F.linear(x, w)),
        "cublas_fp32_out": _graphed(lambda: torch.mm(x, w.t(), out_dtype=torch.float32)),
        "cublas_form": _graphed(lambda: form(x)),
        "fused": _graphed(lambda: _triton(abft_gemm.linear_forward, x, w, None, k, n, False, None, 2.5, True, True,
                                          None, cnt, owner, None)),
    }
    times = interleaved(fns, rounds, lambda fn: triton.testing.do_bench(fn, warmup=10, rep=rep))
    med = {name: statistics.median(ts) for name, ts in times.items()}
    err = float((form(x).double() - x.double() @ w.double().t()).abs().max())
    clean_failed, clean_ratio = int(form.failed), float(form.ratio)
    form.flip = (m // 2, n // 3)
    before = int(form.failed)
    form(x)
    caught = int(form.failed) - before
    return dict(m=m, n=n, k=k, dtype=str(dtype).removeprefix("torch."),
                **{f"{a}_ms": round(v, 5) for a, v in med.items()},
                form_vs_cublas=round(med["cublas"] / med["cublas_form"], 3),
                fused_vs_cublas=round(med["cublas"] / med["fused"], 3),
                fp32_out_vs_cublas=round(med["cublas"] / med["cublas_fp32_out"], 3),
                clean_failed=clean_failed, clean_ratio=round(clean_ratio, 4), flip_caught=caught,
                fused_events=int(cnt.sum()), max_abs_err=err)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("gemm_cublas_form.csv"))
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    ap.add_argument("--quick", action="store_true", help="Qwen2-0.5B's layers at 64 and 4096 rows only")
    ap.add_argument("--rep", type=int, default=40, help="do_bench repetition time (ms)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (cuBLAS with fp32 output)")
    dtype = getattr(torch, args.dtype)
    print(environment("cuda"), flush=True)
    layers = LAYERS[:4] if args.quick else LAYERS
    rows = (64, 4096) if args.quick else ROWS
    out = []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        for model, layer, n, k in layers:
            for m in rows:
                r = bench_shape(m, n, k, dtype, args.rep, args.rounds)
                r = {"model": model, "layer": layer, **r}
                out.append(r)
                with args.out.open("w", newline="") as f:  # rewritten per shape: a cut-off run keeps its rows
                    wr = csv.DictWriter(f, fieldnames=list(out[0]))
                    wr.writeheader()
                    wr.writerows(out)
                print(f"{model:10s} {layer:8s} M={m:5d} N={n:6d} K={k:6d} | cuBLAS {r['cublas_ms'] * 1e3:8.1f} us | "
                      f"form x{r['form_vs_cublas']:.3f} | fp32-out product x{r['fp32_out_vs_cublas']:.3f} | "
                      f"fused x{r['fused_vs_cublas']:.3f} | clean E/T {r['clean_ratio']:.3f} "
                      f"(failed {r['clean_failed']}) | flip caught {r['flip_caught']}", flush=True)
    print(f"wrote {args.out} ({len(out)} rows)")
    return out


if __name__ == "__main__":
    main()
