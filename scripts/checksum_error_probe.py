"""Where a clean checked GEMM's checksum difference comes from: the kernel's accumulated group sums or its
checksum C (CUDA; issue 38's split of the threshold).

For Qwen2 models of published dims (random weights, transformers' init, 128-token random prompts), every
captured input of the chosen Linear classes goes through ``gemm_residuals`` with the shipped (e_max, e_var)
(`ft_transformers.vabft.gemm_emax`). Against the exact group sums ``S`` (float64 products of the same
operands), with the kernel's D and C per (row, 64-column group):

* E/T: ``max |D| / T`` (the clean ratio ``scripts/tightness.py`` reports);
* acc-err/T: ``max |(D + C) − S| / T``: the rounding of the accumulated sums;
* C-err/T: ``max |C − S| / T``: the rounding of the checksum itself;
* and, to tell the kernel's dot from the operand: the same checksum through cuBLAS, ``x·w1_gᵀ`` in fp32 (TF32
  off; "fp32 C/T") and from the kernel's own operand slices (`calls.group_operand`) with fp32 outputs
  ("slices C/T");
* and, to tell the verification's launch from its arithmetic, the slices' dot in kernels of the verification's
  tile (64 rows × 32 groups, 4 warps; `_slice_dot`): a plain tensor-core dot over K ("dot"), IEEE fp32 FMAs
  without tensor cores ("fma"), and the verification's own `groups._row_stats_and_checksums` alone in a launch
  ("library", with x's outlier statistics "library_xvar"). A C-err/T above these columns is the launch's, not
  the dot's: that is how a miscompiled loop (x's statistics reduced inside the pipelined dot loop, Triton 3.6)
  showed, a wrong C in a few units of calls with several row blocks and no split-K.

    python scripts/checksum_error_probe.py --dims qwen2-0.5b qwen2-7b --classes q down lm_head

``--cpu-emulation`` (no GPU): the checksum of the same operands (fp32 model, inputs and weights cast to fp16,
32 rows, the first block's Linears and lm_head) in emulated fp32 arithmetic, from the kernel's operand slices:
each slice's dot accumulated 16 products at a time, exactly, then truncated to fp32 (the tensor cores'
truncating accumulation), against the split threshold (e_max 1.08e-4, e_var 2e-5): what an fp32 dot of these
operands errs by, to compare with the GPU's C-err/T. With ``TRITON_INTERPRET=1`` also the kernel's own checksum
under the interpreter (slow: about 2 minutes for Qwen2-0.5B's lm_head).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tightness as T  # noqa: E402
from ft_transformers.kernels.abft_gemm import calls, gemm_residuals, interpreting, tuning  # noqa: E402
from ft_transformers.kernels.abft_gemm.groups import _row_stats_and_checksums  # noqa: E402
from ft_transformers.kernels.gemm_checksums import WeightChecksums  # noqa: E402

from ft_transformers.vabft import gemm_emax  # noqa: E402

LAYERS = {"qwen2-0.5b": 4, "qwen2-7b": 1}


def _exact_group_sums(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """(M, ⌈N/64⌉) float64: each (row, 64-column group)'s sum of ``x·wᵀ + b`` from float64 products."""
    ng = -(-w.shape[0] // 64)
    y = x.double() @ w.double().t() + (b.double() if b is not None else 0.0)
    return torch.nn.functional.pad(y, (0, ng * 64 - w.shape[0])).view(x.shape[0], ng, 64).sum(-1)


@triton.jit
def _slice_dot_kernel(X, Wc, C, M, K, TG, S: tl.constexpr, FMA: tl.constexpr):
    """C (M, TG) fp32 = Σ_s X (M, K) · Wc[s] (TG, K)ᵀ for one (64-row, 32-group) tile per program, 64 keys a step."""
    rows = tl.program_id(0) * 64 + tl.arange(0, 64)
    grps = tl.program_id(1) * 32 + tl.arange(0, 32)
    offs_k = tl.arange(0, 64)
    acc = tl.zeros((64, 32), tl.float32)
    for s in range(S):
        part = tl.zeros((64, 32), tl.float32)
        for k0 in range(0, K, 64):
            kk = k0 + offs_k
            a = tl.load(X + rows[:, None] * K + kk[None, :], mask=(rows[:, None] < M) & (kk[None, :] < K), other=0.0)
            b = tl.load(Wc + s * TG * K + grps[None, :] * K + kk[:, None],
                        mask=(grps[None, :] < TG) & (kk[:, None] < K), other=0.0)
            if FMA:
                part = tl.dot(a.to(tl.float32), b.to(tl.float32), part, input_precision="ieee")
            else:
                part = tl.dot(a, b, part)
        acc += part
    tl.store(C + rows[:, None] * TG + grps[None, :], acc, mask=(rows[:, None] < M) & (grps[None, :] < TG))


@triton.jit
def _library_dot_kernel(X, Wc, C, M, K, TG, S: tl.constexpr, XVAR: tl.constexpr):
    """C (M, TG) fp32 as the verification's own `groups._row_stats_and_checksums` forms it, one (64-row,
    32-group) tile per program over every K block."""
    rows = tl.program_id(0) * 64 + tl.arange(0, 64)
    grps = tl.program_id(1) * 32 + tl.arange(0, 32)
    r_ok = rows < M
    g_ok = grps < TG
    c = _row_stats_and_checksums(X, Wc, rows, r_ok, grps, g_ok, 0, tl.cdiv(K, 64), K, TG, K, 1, 64, S, False,
                                 XVAR)[4]
    tl.store(C + rows[:, None] * TG + grps[None, :], c, mask=r_ok[:, None] & g_ok[None, :])


# name → (kernel, its constexpr switch)
VARIANTS = {"dot": (_slice_dot_kernel, dict(FMA=False)), "fma": (_slice_dot_kernel, dict(FMA=True)),
            "library": (_library_dot_kernel, dict(XVAR=False)), "library_xvar": (_library_dot_kernel, dict(XVAR=True))}


def _slice_dot(x: torch.Tensor, slices: torch.Tensor, variant: str) -> torch.Tensor:
    """(M, T_g) fp32: ``x`` (M, K) · each of ``slices`` (S, T_g, K)ᵀ summed, as `VARIANTS[variant]` forms it."""
    m, k = x.shape
    tg = slices.shape[1]
    c = torch.empty(m, tg, dtype=torch.float32, device=x.device)
    kernel, switch = VARIANTS[variant]
    kernel[(triton.cdiv(m, 64), triton.cdiv(tg, 32))](x.contiguous(), slices, c, m, k, tg, S=slices.shape[0], **switch,
                                                      num_warps=4, num_stages=3)
    return c


def probe(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, rows: int = 128) -> list[float]:
    """(E/T, acc-err/T, C-err/T, fp32 C/T, slices C/T, then the C/T of every `VARIANTS` entry) maxima over x (M, K)
    in chunks of ``rows`` rows, w (N, K), b (N,) or None."""
    e, e_var = gemm_emax(x.dtype, x.device, "accumulator", x.shape[1])
    ng = -(-w.shape[0] // 64)
    wc = WeightChecksums.compute(w, b)
    w1g = calls._group_sums(wc, w, b, False)[0]  # (T_g, K) fp32
    slices, winv = calls.group_operand(wc, w, b, False, x.dtype)  # (S, T_g, K) in x's dtype, (1,) fp32
    b1 = 0.0 if b is None else torch.nn.functional.pad(b.double(), (0, ng * 64 - w.shape[0])).view(ng, 64).sum(-1)
    out = [0.0] * (5 + len(VARIANTS))
    for i in range(0, x.shape[0], rows):
        xi = x[i:i + rows]
        r = gemm_residuals(xi, w, b, emax=e, emax_var=e_var)
        s = _exact_group_sums(xi, w, b)
        d, c, thr = r["d"].double(), r["c"].double(), r["thr"].double()
        c32 = (xi.float() @ w1g.t()).double() + b1
        csl = sum(torch.mm(xi, sl.t(), out_dtype=torch.float32) for sl in slices).double() * float(winv) + b1
        cv = [_slice_dot(xi, slices, v).double() * float(winv) + b1 for v in VARIANTS]
        for j, v in enumerate([d.abs(), (d + c - s).abs(), (c - s).abs(), (c32 - s).abs(), (csl - s).abs()]
                              + [(cvi - s).abs() for cvi in cv]):
            out[j] = max(out[j], float((v / thr).max()))
    return out


def _truncating_dot(x: torch.Tensor, w: torch.Tensor, chunk: int = 16) -> torch.Tensor:
    """x (M, K) · w (T, K)ᵀ, float64 (M, T): products exact, summed ``chunk`` at a time with the accumulator
    exactly, the result truncated to fp32 toward zero after each chunk."""
    acc = torch.zeros(x.shape[0], w.shape[0], dtype=torch.float64)
    for k0 in range(0, x.shape[1], chunk):
        s = acc + x[:, k0:k0 + chunk].double() @ w[:, k0:k0 + chunk].double().t()
        f = s.float()
        f = torch.where(f.double().abs() > s.abs(), torch.nextafter(f, torch.zeros_like(f)), f)
        acc = f.double()
    return acc


def emulate(dims: str, classes: list[str], e_det: float = 1.08e-4, e_var: float = 2e-5) -> None:
    """``--cpu-emulation`` (module docstring)."""
    from ft_transformers.kernels.gemm_checksums import group_threshold, scale_variance_terms, xvar_estimate

    model = T.dims_model(dims, LAYERS[dims], torch.float32, "cpu")
    layers, _ = T.capture(model, T.random_prompts(model.config.vocab_size, 1, 128), 128)
    for lay in layers:
        if lay.layer_class not in classes or (lay.layer_class != "lm_head" and ".layers.0." not in lay.name):
            continue
        x, w = torch.cat(lay.inputs)[:32].half(), lay.weight.half()
        wc = WeightChecksums.compute(w, None)
        consts = calls._group_sums(wc, w, None, False)[1]
        slices, winv = calls.group_operand(wc, w, None, False, torch.float16)
        xf = x.float()
        mu = xf.mean(1)
        var = xvar_estimate(mu, xf.square().sum(1), xf.amax(1), xf.amin(1), x.shape[1])
        thr = group_threshold(mu[:, None], var[:, None], scale_variance_terms(consts, e_var / e_det), e_det, 2.5)
        exact = _exact_group_sums(x, w, None)
        c = sum(_truncating_dot(x, sl).float() for sl in slices).double() * float(winv)
        line = f"{dims} float16 {lay.name} emulated: C-err/T {float(((c - exact).abs() / thr.double()).max()):.3f}"
        if interpreting():  # the kernel itself, under the Triton interpreter (numpy's fp32 dots)
            ck = gemm_residuals(x, w, None, emax=e_det, emax_var=e_var)["c"].double()
            line += f"; the kernel interpreted: C-err/T {float(((ck - exact).abs() / thr.double()).max()):.3f}"
        print(line, flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dims", nargs="+", default=list(LAYERS), choices=list(LAYERS))
    ap.add_argument("--dtypes", nargs="+", default=["float16", "bfloat16"])
    ap.add_argument("--classes", nargs="+", default=["q", "down", "lm_head"])
    ap.add_argument("--cpu-emulation", action="store_true", help="the checksum's fp32 arithmetic emulated on the CPU")
    a = ap.parse_args(argv)
    if a.cpu_emulation:
        for dims in a.dims:
            emulate(dims, a.classes)
        return
    if not torch.cuda.is_available():
        raise SystemExit("checksum_error_probe.py measures the CUDA kernels: it needs a GPU")
    for dims in a.dims:
        for dt in a.dtypes:
            model = T.dims_model(dims, LAYERS[dims], getattr(torch, dt), "cuda")
            layers, _ = T.capture(model, T.random_prompts(model.config.vocab_size, 4, 128), 128)
            for lay in layers:
                if lay.layer_class not in a.classes:
                    continue
                w = lay.weight
                et, acc, cerr, c32, csl, *cv = probe(torch.cat(lay.inputs), w, lay.bias)
                cfgs = sorted({v for k, v in tuning._TUNE_CACHE.items() if k[7:9] == (w.shape[0], w.shape[1])})
                print(f"{dims} {dt} {lay.name} tune={os.environ.get('FTT_ABFT_GEMM_TUNE', '1')} E/T {et:.3f}  "
                      f"acc-err/T {acc:.3f}  C-err/T {cerr:.3f}  fp32 C/T {c32:.3f}  slices C/T {csl:.3f}  "
                      + "  ".join(f"{v} {e:.3f}" for v, e in zip(VARIANTS, cv)) + f"  cfg {cfgs}",
                      flush=True)
            del model, layers
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
