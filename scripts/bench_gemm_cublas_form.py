"""The cuBLAS form of the checked GEMM against cuBLAS and the fused Triton GEMM, at the Linear shapes of
Qwen2-0.5B, Qwen2-1.5B, Qwen2-7B and Llama-3-8B (by default Qwen2-0.5B's and Qwen2-7B's), for M from 1
(decode) to 4096 (prefill) (by default 64 to 4096).

    y32 = x · Wᵀ                    cuBLAS, fp16/bf16 operands, fp32 accumulation and fp32 output
    P[m, g] = Σ_{n∈g} (y32 + b)     the group sums, before any rounding
    C[m, g] = x[m] · w1_g + b1_g     the group checksums: x against w1_g's fp32 value held as 2 (fp16) or
                                     3 (bf16) slices of x's dtype, each product exact in fp32
    |P − C| ≤ T[m, g]                SPEC §5 over the group's n_g columns (`group_checksums`' constants,
                                     x's row mean and Bhatia–Davis bound), the accumulator e_max
    y = round(y32 + b)               the output in x's dtype

Columns, times per call (medians over interleaved rounds), CUDA-graph replays unless ``_eager``:

* ``cublas``: ``F.linear`` (the unprotected layer); ``cublas_fp32_out``: the product alone, fp32 output;
* ``cublas_form``: the form with every step a PyTorch op (7–9 launches, each reading what the one before
  wrote: an upper bound of its cost; ``--no-ops-form`` leaves it out);
* ``fused``: the library's checked GEMM with the cuBLAS form switched off (``gemm_cublas=False``: the fused
  Triton GEMM, the decode kernel at M ≤ 16), whatever `forms.cublas_ok`'s default rule picks;
* ``cublas_fused``: the library's cuBLAS form (``Options.gemm_cublas``): cuBLAS's product (fp32 output) with the
  checksum programs (dots and x's statistics) beside it on a side stream, then one launch of its check
  (`product_check`) that reads y32 once (bias, rounding, group sums) and writes y;
* with ``--decode-rows R``: ``decode``, the decode kernel over row blocks of 16 (``Options.gemm_decode_rows``) at
  M ≤ R;
* with ``--eager``: ``cublas_eager``, ``fused_eager``, ``cublas_fused_eager`` (launched as they come, the
  host's work included).

Per shape also: the ops form's clean ratio max |P − C| / T and whether a flip of one exponent bit of y32 in
one group is caught; the cuBLAS form's clean ratio (`gemm_residuals`), its events over every timed call (0
expected), whether its y is cuBLAS's fp32 product plus bias rounded once, bit for bit, and the events of one
flip injected at ``linear.output`` (``detected/corrected``, 1/1 expected).

    python scripts/bench_gemm_cublas_form.py --out gemm_cublas_form.csv [--dtype bfloat16] [--quick]
    python scripts/bench_gemm_cublas_form.py --models qwen2-0.5b,qwen2-1.5b --rows 1,16,64,128,512,4096 --eager
    python scripts/bench_gemm_cublas_form.py --plot new.csv more.csv --before old.csv --out forms.png
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
from bench_linear import MODEL_LAYERS, MODELS, _graphed, _with_options  # noqa: E402

LAYERS = MODEL_LAYERS  # (model, layer, N, K)
DEFAULT_MODELS = ("qwen2-0.5b", "qwen2-7b")  # the study's; ``--models`` takes any of MODELS
ROWS = (64, 128, 512, 4096)  # the study's short prompts to prefill; ``--rows`` adds decode sizes
FLIP_BIT = {torch.float16: 13, torch.bfloat16: 13}  # an exponent bit: ×2^±8 (fp16), ×2^±64 (bf16)


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
        from ft_transformers.kernels.abft_gemm.calls import fp32_product
        from ft_transformers.kernels.gemm_checksums import group_threshold, row_stats, xvar_in_use

        m = x.shape[0]
        y32 = fp32_product(x, self.w, False)
        if self.b is not None:
            y32 += self.b.float()
        if self.flip is not None:
            r, c = self.flip
            y32[r, c] = (y32[r, c].view(torch.int32) ^ (1 << 27)).view(torch.float32)
        npad = self.t * 64 - self.n
        p = (F.pad(y32, (0, npad)) if npad else y32).view(m, self.t, 64).sum(-1)
        c = fp32_product(x, self.wc, False).view(m, -1, self.t).sum(1) * self.inv + self.consts[:, 0]
        mu, var = row_stats(x, xvar=xvar_in_use(x.device.type, x.dtype))  # the estimate the library's checks take
        thr = group_threshold(mu.unsqueeze(1), var.unsqueeze(1), self.consts, self.emax, self.csigma)
        d = (p - c).abs()
        self.failed += (~(d <= thr)).sum()
        torch.maximum(self.ratio, (d / thr).amax(), out=self.ratio)
        return y32.to(x.dtype)


def bench_shape(m: int, n: int, k: int, dtype: torch.dtype, rep: int, rounds: int, *, bias: bool = False,
                eager: bool = False, ops_form: bool = True, decode_rows: int = 0) -> dict:
    """One shape: times (ms per call, medians over rounds) of the columns (module docstring); the ops form's
    clean ratio and its detection of one flip; the cuBLAS form's clean ratio, events, exactness and the
    events of one injected flip."""
    import statistics

    import triton.testing
    from ft_transformers.kernels import abft_gemm
    from ft_transformers.kernels.options import override

    from ft_transformers.checked_linear import _triton
    from ft_transformers.counters import FaultStats, new_counters
    from ft_transformers.injection import FaultPlan, FaultSpec
    from ft_transformers.vabft import gemm_emax

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(m * 7 + n * 3 + k)
    x = torch.randn(m, k, device=dev, generator=g).to(dtype)
    w = (torch.randn(n, k, device=dev, generator=g) * k**-0.5).to(dtype)
    b = torch.randn(n, device=dev, generator=g).to(dtype) if bias else None
    emax = gemm_emax(dtype, dev, "accumulator", k)[0]  # (the form's speed: one unit error for every term)
    form = CublasForm(w, b, emax)
    counts = {name: new_counters(dev) for name in ("fused", "cublas_fused", "decode")}
    owners = {name: torch.nn.Module() for name in counts}  # each keeps its own checksums and fast path

    def library(name: str):
        """The checked linear's Triton backend as a protected layer's full path runs it, on its own owner."""
        return lambda: _triton(abft_gemm.linear_forward, x, w, b, k, n, False, None, 2.5, True, True, None,
                               counts[name], owners[name], None)

    calls = {"cublas": lambda: F.linear(x, w, b), "fused": _with_options(library("fused"), gemm_cublas=False),
             "cublas_fused": _with_options(library("cublas_fused"), gemm_cublas=True)}
    fns = {"cublas": _graphed(calls["cublas"]),
           "cublas_fp32_out": _graphed(lambda: torch.mm(x, w.t(), out_dtype=torch.float32))}
    if ops_form:
        fns["cublas_form"] = _graphed(lambda: form(x))
    fns["fused"] = _graphed(calls["fused"])
    fns["cublas_fused"] = _graphed(calls["cublas_fused"])
    if decode_rows >= m:
        calls["decode"] = _with_options(library("decode"), gemm_cublas=False, gemm_decode_rows=decode_rows)
        fns["decode"] = _graphed(calls["decode"])
    if eager:
        fns.update({f"{name}_eager": fn for name, fn in calls.items()})
    times = interleaved(fns, rounds, lambda fn: triton.testing.do_bench(fn, warmup=10, rep=rep))
    med = {name: statistics.median(ts) for name, ts in times.items()}
    row = dict(m=m, n=n, k=k, dtype=str(dtype).removeprefix("torch."), bias=bias,
               **{f"{a}_ms": round(v, 5) for a, v in med.items()})
    for name in med:
        if name not in ("cublas", "cublas_eager"):
            base = "cublas_eager" if name.endswith("_eager") else "cublas"
            row[f"{name}_vs_{base}"] = round(med[base] / med[name], 3)
    ref = x.double() @ w.double().t() + (b.double() if bias else 0)
    if ops_form:
        row["max_abs_err"] = float((form(x).double() - ref).abs().max())
        row["clean_failed"], row["clean_ratio"] = int(form.failed), round(float(form.ratio), 4)
        form.flip = (m // 2, n // 3)
        before = int(form.failed)
        form(x)
        row["flip_caught"] = int(form.failed) - before
    row["fused_events"] = int(counts["fused"].sum())
    if "decode" in calls:
        row["decode_events"] = int(counts["decode"].sum())
        row["decode_err"] = float((calls["decode"]().double() - ref).abs().max())
    with override(gemm_cublas=True):
        y = calls["cublas_fused"]()
        res = abft_gemm.gemm_residuals(x, w, b, emax=emax)
        cnt = new_counters(dev)
        spec = FaultSpec(site="linear.output", bit=FLIP_BIT[dtype], count=1, seed=0)
        abft_gemm.checked_gemm(x, w, b, plan=FaultPlan(spec), counters=cnt, emax_table=gemm_emax)
    y32 = torch.mm(x, w.t(), out_dtype=torch.float32)
    st = FaultStats(cnt)
    row.update(cublas_fused_err=float((y.double() - ref).abs().max()),
               cublas_fused_exact=bool(torch.equal(y, (y32 + b.float() if bias else y32).to(dtype))),
               cublas_fused_ratio=round(float((res["d"].abs() / res["thr"]).max()), 4),
               cublas_fused_events=int(counts["cublas_fused"].sum()),
               cublas_fused_flip=f"{st['detected']}/{st['corrected']}")
    return row


def plot(csvs: list[Path], before: Path | None, out: Path) -> None:
    """One panel per (model, layer) of the CSVs ``csvs``: throughput against cuBLAS over M of the cuBLAS form, of
    the fused GEMM and, from ``before`` (the same script's CSV from an older tree), of the older cuBLAS form."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for path in csvs for r in csv.DictReader(path.open())]
    old = list(csv.DictReader(before.open())) if before else []
    layers = list(dict.fromkeys((r["model"], r["layer"]) for r in rows))
    cols = 4
    fig, axes = plt.subplots(-(-len(layers) // cols), cols, figsize=(16, 3.3 * -(-len(layers) // cols)),
                             sharey=True, squeeze=False)
    for ax, key in zip(axes.flat, layers):
        mine = [r for r in rows if (r["model"], r["layer"]) == key]
        prev = [r for r in old if (r["model"], r["layer"]) == key]
        ms = [int(r["m"]) for r in mine]
        ax.plot(ms, [float(r["cublas_fused_vs_cublas"]) for r in mine], "o-", color="C0", label="cuBLAS form")
        if prev:
            ax.plot([int(r["m"]) for r in prev], [float(r["cublas_fused_vs_cublas"]) for r in prev], "s--",
                    color="C1", label=f"cuBLAS form, {before.stem}")
        ax.plot(ms, [float(r["fused_vs_cublas"]) for r in mine], "^:", color="C2", label="fused Triton GEMM")
        ax.axhline(0.9, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 1.0)
        ax.grid(alpha=0.3)
        ax.set_title(f"{key[0]} {key[1]} (N={mine[0]['n']}, K={mine[0]['k']})", fontsize=9)
    for ax in axes[-1]:
        ax.set_xlabel("M (rows)")
    for ax in axes[:, 0]:
        ax.set_ylabel("throughput / cuBLAS")
    axes.flat[0].legend(fontsize=7, loc="lower left")
    fig.suptitle(f"Checked GEMM against cuBLAS, {rows[0]['dtype']}, CUDA graphs (grey: 0.90)")
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("gemm_cublas_form.csv"))
    ap.add_argument("--plot", type=Path, nargs="+", help="no timing: plot these CSVs of this script into --out (PNG)")
    ap.add_argument("--before", type=Path, help="with --plot: a CSV of an older tree, its cuBLAS form beside")
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    ap.add_argument("--quick", action="store_true", help="Qwen2-0.5B's layers at 64 and 4096 rows only")
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS), help=f"comma-separated, of {MODELS}")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="comma-separated M values")
    ap.add_argument("--bias", action="store_true", help="every layer with a bias")
    ap.add_argument("--eager", action="store_true", help="also time cuBLAS and both checked forms eagerly")
    ap.add_argument("--no-ops-form", action="store_true", help="leave out the form built from PyTorch ops")
    ap.add_argument("--rep", type=int, default=40, help="do_bench repetition time (ms)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--decode-rows", type=int, default=0,
                    help="also time the decode kernel over row blocks (Options.gemm_decode_rows) at M up to this")
    args = ap.parse_args(argv)
    if args.plot:
        plot(args.plot, args.before, args.out)
        return []
    models = args.models.split(",")
    if not set(models) <= set(MODELS):
        ap.error(f"--models takes names from {MODELS}, got {args.models!r}")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (cuBLAS with fp32 output)")
    dtype = getattr(torch, args.dtype)
    print(environment("cuda"), flush=True)
    layers = LAYERS[:4] if args.quick else [layer for layer in LAYERS if layer[0] in models]
    rows = (64, 4096) if args.quick else tuple(int(r) for r in args.rows.split(","))
    out = []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        for model, layer, n, k in layers:
            for m in rows:
                r = bench_shape(m, n, k, dtype, args.rep, args.rounds, bias=args.bias, eager=args.eager,
                                ops_form=not args.no_ops_form, decode_rows=args.decode_rows)
                r = {"model": model, "layer": layer, **r}
                out.append(r)
                with args.out.open("w", newline="") as f:  # rewritten per shape: a cut-off run keeps its rows
                    wr = csv.DictWriter(f, fieldnames=list(dict.fromkeys(key for row in out for key in row)))
                    wr.writeheader()
                    wr.writerows(out)
                eager = (f" | eager: fused x{r['fused_eager_vs_cublas_eager']:.3f} cuBLAS form "
                         f"x{r['cublas_fused_eager_vs_cublas_eager']:.3f}" if args.eager else "")
                ops = (f" | ops form x{r['cublas_form_vs_cublas']:.3f} (E/T {r['clean_ratio']:.3f}, flip "
                       f"{r['flip_caught']})" if not args.no_ops_form else "")
                print(f"{model:10s} {layer:8s} M={m:5d} N={n:6d} K={k:6d} | cuBLAS {r['cublas_ms'] * 1e3:8.1f} us | "
                      f"cuBLAS form x{r['cublas_fused_vs_cublas']:.3f} (E/T {r['cublas_fused_ratio']:.3f}, events "
                      f"{r['cublas_fused_events']}, exact {r['cublas_fused_exact']}, flip {r['cublas_fused_flip']}) | "
                      f"fused x{r['fused_vs_cublas']:.3f} | fp32-out product x{r['cublas_fp32_out_vs_cublas']:.3f}"
                      f"{ops}{eager}" + (f" | decode kernel x{r['decode_vs_cublas']:.3f} (events "
                                         f"{r['decode_events']})" if "decode_vs_cublas" in r else ""), flush=True)
    print(f"wrote {args.out} ({len(out)} rows)")
    return out


if __name__ == "__main__":
    main()
