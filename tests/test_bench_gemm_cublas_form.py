"""`scripts/bench_gemm_cublas_form.py`'s check, run on the CPU (its product there is the upcast operands'
fp32 product, what cuBLAS's fp32-output GEMM computes): clean calls pass every group, one flipped
exponent bit of the fp32 product fails its group, and the output is the fp32 product rounded once
(against float64)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from bench_gemm_cublas_form import CublasForm  # noqa: E402

from ft_transformers.vabft import default_emax  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [128, 200])  # whole groups, and a ragged last group of 8 columns
def test_cublas_form_check(dtype, n):
    g = torch.Generator().manual_seed(n)
    m, k = 24, 96
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    form = CublasForm(w, b, default_emax(dtype, "cpu", "accumulator", k=k))
    y = form(x)
    ref = x.double() @ w.double().t() + b.double()
    assert y.dtype == dtype
    ulp = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}[dtype]  # one output ulp at the largest |y|
    torch.testing.assert_close(y.double(), ref.to(dtype).double(), rtol=0, atol=float(ref.abs().max()) * ulp)
    assert int(form.failed) == 0 and 0 < float(form.ratio) < 1
    form.flip = (m // 2, n - 1)
    form(x)
    assert int(form.failed) == 1
