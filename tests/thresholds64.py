"""Float64 references of x's row variance as the checked GEMM's thresholds take it, for the GEMM tests.

Nothing of the library is imported at module level: test files import this before they set
``TRITON_INTERPRET``, which must precede triton's import."""

from __future__ import annotations

import math

import torch


def xvar64(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(μ, σ²) (M,) float64 of x (M, K) under the outlier estimate, computed in float64: the exact variance
    plus the guard and the outlier term, capped at the bound (`gemm_checksums.xvar_estimate`'s terms)."""
    from ft_transformers.kernels.gemm_checksums import xvar_guard

    x = x.double().cpu()
    k = x.shape[1]
    mu = x.mean(1)
    v = (x - mu[:, None]).square().mean(1)
    mx, mn = x.amax(1), x.amin(1)
    dev = torch.maximum(mx - mu, mu - mn)
    est = v + xvar_guard(k) * x.square().mean(1) + dev.square() / math.sqrt(k)
    return mu, torch.minimum(est, ((mx - mu) * (mu - mn)).clamp_min(0.0))


def bound64(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(μ, σ²) (M,) float64 of x (M, K) under SPEC §5's bound."""
    x = x.double().cpu()
    mu = x.mean(1)
    return mu, ((x.amax(1) - mu) * (mu - x.amin(1))).clamp_min(0.0)
