"""`scripts/xvar_study.py`: its threshold under the shipped estimate (``bound``) is the library's group
threshold (`checked_linear.group_residuals`), and its estimates order as designed on a Gaussian row and on
a row whose one outlier holds its variance."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from ft_transformers.kernels.gemm_checksums import group_checksums  # noqa: E402
from xvar_study import estimated_threshold, row_variance  # noqa: E402

from ft_transformers.checked_linear import group_residuals  # noqa: E402


def test_bound_estimate_is_the_library_threshold():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 96, generator=g) + 0.3
    w = torch.randn(150, 96, generator=g) * 0.1
    b = torch.randn(150, generator=g)
    _, thr = group_residuals(x, w, b, emax=1e-6)
    ours = estimated_threshold(x, group_checksums(w, b)[1], 1e-6, "bound")
    torch.testing.assert_close(ours, thr.double(), rtol=1e-5, atol=0)


def test_estimates_on_gaussian_and_outlier_rows():
    k = 576
    gauss = torch.randn(1, k, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    outlier = torch.zeros(1, k, dtype=torch.float64)
    outlier[0, 7] = 100.0
    # a Gaussian row: 1 + (max|x − μ|/σ)²/√K with max|x − μ| between 2.5σ and 4σ; one outlier: about √K
    for x, lo, hi in ((gauss, 1.25, 1.7), (outlier, math.sqrt(k) * 0.9, math.sqrt(k) * 1.1)):
        exact = row_variance(x, "exact")[1].item()
        ratio = row_variance(x, "outlier")[1].item() / exact
        assert lo <= ratio <= hi, (ratio, lo, hi)
    assert row_variance(gauss, "bound")[1].item() > 5 * row_variance(gauss, "exact")[1].item()
