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
  ("slices C/T").

    python scripts/checksum_error_probe.py --dims qwen2-0.5b qwen2-7b --classes q down lm_head
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tightness as T  # noqa: E402
from ft_transformers.kernels.abft_gemm import calls, gemm_residuals, tuning  # noqa: E402
from ft_transformers.kernels.gemm_checksums import WeightChecksums  # noqa: E402

from ft_transformers.vabft import gemm_emax  # noqa: E402

LAYERS = {"qwen2-0.5b": 4, "qwen2-7b": 1}


def probe(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, rows: int = 128) -> list[float]:
    """(E/T, acc-err/T, C-err/T, fp32 C/T, slices C/T) maxima over x (M, K) in chunks of ``rows`` rows, w (N, K),
    b (N,) or None."""
    e, e_var = gemm_emax(x.dtype, x.device, "accumulator", x.shape[1])
    ng = -(-w.shape[0] // 64)
    wc = WeightChecksums.compute(w, b)
    w1g = calls._group_sums(wc, w, b, False)[0]  # (T_g, K) fp32
    slices, winv = calls.group_operand(wc, w, b, False, x.dtype)  # (S, T_g, K) in x's dtype, (1,) fp32
    b1 = 0.0 if b is None else torch.nn.functional.pad(b.double(), (0, ng * 64 - w.shape[0])).view(ng, 64).sum(-1)
    out = [0.0] * 5
    for i in range(0, x.shape[0], rows):
        xi = x[i:i + rows]
        r = gemm_residuals(xi, w, b, emax=e, emax_var=e_var)
        s = xi.double() @ w.double().t() + (b.double() if b is not None else 0.0)
        s = torch.nn.functional.pad(s, (0, ng * 64 - w.shape[0])).view(xi.shape[0], ng, 64).sum(-1)
        d, c, thr = r["d"].double(), r["c"].double(), r["thr"].double()
        c32 = (xi.float() @ w1g.t()).double() + b1
        csl = sum(torch.mm(xi, sl.t(), out_dtype=torch.float32) for sl in slices).double() * float(winv) + b1
        for j, v in enumerate((d.abs(), (d + c - s).abs(), (c - s).abs(), (c32 - s).abs(), (csl - s).abs())):
            out[j] = max(out[j], float((v / thr).max()))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dims", nargs="+", default=list(LAYERS), choices=list(LAYERS))
    ap.add_argument("--dtypes", nargs="+", default=["float16", "bfloat16"])
    ap.add_argument("--classes", nargs="+", default=["q", "down", "lm_head"])
    a = ap.parse_args(argv)
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
                et, acc, cerr, c32, csl = probe(torch.cat(lay.inputs), w, lay.bias)
                cfgs = sorted({v for k, v in tuning._TUNE_CACHE.items() if k[7:9] == (w.shape[0], w.shape[1])})
                print(f"{dims} {dt} {lay.name} tune={os.environ.get('FTT_ABFT_GEMM_TUNE', '1')} E/T {et:.3f}  "
                      f"acc-err/T {acc:.3f}  C-err/T {cerr:.3f}  fp32 C/T {c32:.3f}  slices C/T {csl:.3f}  cfg {cfgs}",
                      flush=True)
            del model, layers
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
