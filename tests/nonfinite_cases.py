"""Non-finite attention inputs shared by the reference and Triton tests."""

from __future__ import annotations

import math

import torch

NONFINITE_CASES = ("q_nan", "k_inf", "v_nan", "q_neginf", "bias_nan", "mask_posinf")


def nonfinite_case(where: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """Plant one bad value named by ``where`` into q (1,2,10,D)/k/v (1,2,70,D), a bias or an
    additive mask (which also holds a legitimate -inf key). Returns ``(q, k, v, bias, mask)``."""
    bias = torch.zeros(1, 2, 10, 70)
    mask = torch.zeros(1, 1, 10, 70)
    mask[..., 5] = -math.inf  # a legitimate masked key
    if where == "q_nan":
        q[0, 1, 3, 4] = math.nan
    elif where == "k_inf":
        k[0, 0, 12, 0] = math.inf
    elif where == "v_nan":
        v[0, 1, 50, 2] = math.nan
    elif where == "q_neginf":
        q[0, 0, 0, 0] = -math.inf
    elif where == "bias_nan":
        bias[0, 0, 2, 2] = math.nan
    elif where == "mask_posinf":
        mask[0, 0, 1, 7] = math.inf
    else:
        raise ValueError(where)
    return q, k, v, bias, mask
