"""What the checked GEMM's kernels and its PyTorch reference path share: a weight version's state
(`WeightChecksums`) with its per-64-column-group checksums (`group_checksums`), the row
statistics both sides take (`row_stats`, with x's variance estimate `xvar_estimate` and the switch
that picks it, `xvar_in_use`), and the dtype autocast runs a GEMM in (`autocast_dtype`).

Pure PyTorch (no Triton): the reference path imports it where Triton is not installed. The e_max
tables stay with the library (`ft_transformers.vabft`); callers pass e_max in.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .options import options

__all__ = ["GROUP_COLS", "GROUP_CONSTS", "WeightChecksums", "XVAR_AUTO_CPU", "autocast_dtype", "group_checksums",
           "group_threshold", "row_stats", "scale_variance_terms", "set_xvar_auto_cuda", "tensor_version",
           "xvar_estimate", "xvar_guard", "xvar_in_use"]

_CHUNK_ELEMS = 1 << 24  # at most 16M fp32 temporaries (64 MiB) while building a weight's checksums
GROUP_COLS = 64  # output columns per checksum group of the decode kernel
GROUP_CONSTS = 8  # fp32 per group: b1, det, v2, v3, v4, bias_det, bias_sd, n_g (`group_checksums`)


def tensor_version(t: torch.Tensor) -> int | None:
    """``t``'s version counter (bumped by every in-place write), or None for an inference tensor, which has
    none: a cache keyed by it then sees an inference tensor's in-place writes only through its identity,
    storage and layout."""
    return None if t.is_inference() else t._version


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast runs a GEMM in on ``device_type`` right now, or None outside autocast (the
    checksums are of the operands as cast)."""
    try:
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
    except (TypeError, RuntimeError):  # pragma: no cover - older torch / unknown device
        pass
    return None


# x's row variance in the group threshold (SPEC §5's σ²_A), two estimates:
#
# * the bound (SPEC §5): Bhatia–Davis, ``(max − μ)(μ − min)``, about 8–9× a Gaussian row's variance at
#   K = 576–896 (σ about 3×), which sets the largest single flip an lm_head's check misses;
# * the outlier estimate (``xvar``): the row's variance plus ``max|x − μ|² / √K``. A Gaussian row gets
#   about 1.2× its variance (max|x − μ| ≈ 3σ), a row whose one outlier holds its variance about √K× it:
#   an activation row's outliers set the GEMM's rounding, which its plain variance understates (a clean
#   all-MiniLM-L6-v2 FFN row failed its check with the plain variance). `xvar_estimate` computes it from
#   the row's sum, sum of squares, max and min, as the kernels do from one pass over x, and never returns
#   more than the bound, so it is never looser than the bound.
#
# `xvar_in_use` says which one a call takes. The e_max tables are calibrated per estimate
# (`ft_transformers.vabft.default_emax`'s ``xvar``): the threshold's slack, which sets e_max, depends on it.
XVAR_AUTO_CPU = False  # auto (Options.gemm_xvar None) on the CPU: the bound (docs/reliability.md, "x-variance")
_U32 = 2.0**-24  # fp32's unit roundoff


# auto on CUDA: whether the current device's e_max table holds the outlier estimate's entry for (dtype,
# mode); set by `ft_transformers.vabft` (the tables live above this leaf), None: never
_XVAR_AUTO_CUDA: Callable[[torch.dtype, str], bool] | None = None


def set_xvar_auto_cuda(rule: Callable[[torch.dtype, str], bool] | None) -> None:
    """The auto rule of `xvar_in_use` on CUDA: ``rule(dtype, mode)`` is True where the current device's
    e_max table was calibrated for the outlier estimate (``ft_transformers.vabft`` sets it)."""
    global _XVAR_AUTO_CUDA
    _XVAR_AUTO_CUDA = rule


def xvar_in_use(device_type: str, dtype: torch.dtype | None = None, mode: str = "accumulator") -> bool:
    """Whether the checked GEMM's group threshold takes x's outlier variance estimate on ``device_type``
    (``"cpu"``, ``"cuda"``) for a GEMM producing ``dtype`` whose e_max is the ``mode`` entry
    (``"accumulator"``: the kernels; ``"output"``: the reference path): ``Options.gemm_xvar``
    (``FTT_GEMM_XVAR=0/1``) where set; auto, on CUDA, wherever the current device's e_max table holds the
    outlier estimate's entry for (dtype, mode) (an e_max is calibrated for one estimate: the threshold's
    slack depends on it; the H200's table has fp16/bf16 accumulator entries, docs/reliability.md), and
    `XVAR_AUTO_CPU` on the CPU. The kernels and the reference path ask it per call; `options()` is part
    of every prepared call's key."""
    o = options().gemm_xvar
    if o is not None:
        return bool(o)
    if device_type == "cpu":
        return XVAR_AUTO_CPU
    return dtype is not None and _XVAR_AUTO_CUDA is not None and _XVAR_AUTO_CUDA(dtype, mode)


def xvar_guard(k: int) -> float:
    """``(4K + 16)·u`` (u = 2^-24): times ``Σx²/K`` (as computed), what fp32's ``Σx²/K − μ²`` may miss of a
    K-value row's variance through rounding, so that `xvar_estimate` is never below the variance.

    Proof (first order in u; the second-order terms stay below the margin for K ≤ 2^20). With m2 = Σx²/K,
    μ = Σx/K and v = m2 − μ² exact, and m̂2, μ̂, r their fp32 values in any summation order (a sum of n
    terms errs by at most (n − 1)·u·Σ|terms|, whatever the order: sequential, tree, split over programs):
    (a) |m̂2 − m2| ≤ (K + 2)·u·m2 (K squares, K − 1 additions, the product by fl(1/K) and its rounding);
    (b) |μ̂ − μ| ≤ (K − 1)·u·Σ|x|/K + 2u·|μ| ≤ (K + 1)·u·√m2 (Σ|x|/K ≤ √m2 and |μ| ≤ √m2, Cauchy–Schwarz);
    (c) |fl(μ̂²) − μ²| ≤ |μ̂ − μ|·|μ̂ + μ| + u·μ̂² ≤ (2K + 3)·u·m2;
    (d) r = fl(m̂2 − fl(μ̂²)): |r − v| ≤ (a) + (c) + u·|r| ≤ (3K + 6)·u·m2 ≤ (3K + 7)·u·m̂2.
    So v ≤ max(r, 0) + (3K + 7)·u·m̂2 < max(r, 0) + (4K + 16)·u·m̂2, the rest covering the guard's own
    rounding. On a row whose mean is small against its spread (m2 ≈ v) the guard adds (4K + 16)·u of the
    variance: 1.4e-4 at K = 576. Where |μ| ≫ σ (cancellation) it can reach the bound, which then caps it."""
    return (4.0 * k + 16.0) * _U32


def xvar_estimate(mean: torch.Tensor, sumsq: torch.Tensor, mx: torch.Tensor, mn: torch.Tensor, k: int
                  ) -> torch.Tensor:
    """x's outlier variance estimate from a row's statistics, in the kernels' order of operations (fp32).

    ``min(max(Σx²/K − μ², 0) + xvar_guard(K)·Σx²/K + max|x − μ|²/√K, (max − μ)(μ − min))`` with
    max|x − μ| = max(max − μ, μ − min): never below the row's variance (`xvar_guard`: the fp32
    cancellation of Σx²/K − μ² on rows with |μ| ≫ σ) and never above SPEC §5's bound, which it is where
    a term overflows (Σx² of values beyond 1.8e19; a NaN there also gives the bound).

    Args:
        mean, sumsq, mx, mn: (...,) fp32: each row's mean, sum of squares, max and min over its K values.
        k: the row length K.
    Returns:
        (...,) fp32.
    """
    m2 = sumsq * (1.0 / k)
    raw = (m2 - mean * mean).clamp_min(0.0)
    dev = torch.maximum(mx - mean, mean - mn)
    est = raw + xvar_guard(k) * m2 + dev * dev * math.sqrt(1.0 / k)
    bound = ((mx - mean) * (mean - mn)).clamp_min(0.0)
    return torch.where(est < bound, est, bound)


def row_stats(t: torch.Tensor, dim: int = -1, *, xvar: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and variance estimate of ``t`` along ``dim`` (fp32): the Bhatia–Davis bound ``(max − μ)(μ − min)``
    (SPEC §5), or with ``xvar`` the outlier estimate (`xvar_estimate`, never above the bound).

    Args:
        t: floating tensor; reduced in fp32.
        xvar: the outlier estimate (`xvar_in_use` says whether a checked call takes it).
    Returns:
        ``(mean, var)``, each of ``t``'s shape without ``dim``; the bound is clamped at 0
        (the fp32 mean of equal values may fall an ulp outside [min, max]).
    """
    t32 = t.float()
    mn, mx = torch.aminmax(t32, dim=dim)
    if xvar:
        k = t32.shape[dim]
        mean = t32.sum(dim) * (1.0 / k)  # as the kernels: the fp32 sum times fl(1/K)
        return mean, xvar_estimate(mean, t32.square().sum(dim), mx, mn, k)
    mean = t32.mean(dim)
    return mean, ((mx - mean) * (mean - mn)).clamp_min(0.0)


@dataclass(frozen=True)
class WeightChecksums:
    """One weight version's (and bias's) state for the checked GEMM, built once.

    With W the logical (N, K) weight (``nn.Linear`` layout) and b the (N,) bias:

    Attributes:
        finite: whether W and b are all finite (a non-finite weight makes every check fail, so its
            calls go straight to the plain product and count ``nonfinite_input``).
        n, k: the output and input features.
        launches: the checked GEMM's prepared calls for this weight version, by call signature
            (`ft_transformers.kernels.abft_gemm.prepared`; they go with the checksums).
        groups: the per-64-column-group checksums and threshold constants (`group_checksums`, key
            GROUP_COLS) and the operands the kernels and the reference path derive from them (the
            tensor-core checksum slices, the float64 copy), each built by the first call that needs it
            and kept with this weight version.

    Building it reads one host number (the non-finite count): one synchronisation per weight version.
    """

    finite: bool
    n: int
    k: int
    launches: dict = field(default_factory=dict, repr=False, compare=False)
    groups: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def compute(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                weight_is_kn: bool = False) -> WeightChecksums:
        """Build from ``weight`` ((N, K), or (K, N) with ``weight_is_kn``) and ``bias`` (N,)."""
        w = weight.detach()
        k, n = w.shape if weight_is_kn else w.shape[::-1]
        bad = torch.zeros((), device=w.device, dtype=torch.int64)
        step = max(1, _CHUNK_ELEMS // max(w.shape[1], 1))
        for r in range(0, w.shape[0], step):  # bounded temporaries on huge weights
            bad += (~torch.isfinite(w[r:r + step])).sum()
        if bias is not None:
            bad += (~torch.isfinite(bias.detach())).sum()
        return cls(finite=int(bad) == 0, n=n, k=k)  # the one host read


def _moments(t: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and (population) variance of the fp32 tensor ``t`` along ``dim``."""
    mu = t.mean(dim)
    return mu, (t - mu.unsqueeze(dim)).square().mean(dim)


@torch.no_grad()
def group_checksums(weight: torch.Tensor, bias: torch.Tensor | None, weight_is_kn: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-group checksums and threshold constants of a weight, in fp32.

    Args:
        weight: (N, K), or (K, N) with ``weight_is_kn``.
        bias: (N,) or None.
    Returns:
        ``w1g`` (⌈N/64⌉, K): ``Σ_{n∈g} W[n, :]``; ``consts`` (⌈N/64⌉, 8): per group ``b1_g = Σ b_n``,
        ``n_g·Σ_k|μ_gk|``, ``n_g·Σ_k σ²_gk``, ``n_g²·Σ_k μ_gk²``, ``sqrt(n_g·Σ_k σ²_gk)``,
        ``n_g·|μ_b|``, ``sqrt(n_g)·σ_b`` and ``n_g`` (μ_gk, σ²_gk: mean and variance of column k of the
        group's rows; μ_b, σ_b: those of the group's bias), so that
        ``T = e·(det·|μ| + c·sqrt(μ²·v2 + σ²·v3) + c·v4·σ + bias_det + c·bias_sd)`` (SPEC §5, with x's row
        mean μ and variance estimate σ² taken per call, `row_stats`). The weight groups' variances are exact,
        not SPEC §5's Bhatia–Davis bound ``(max − μ)(μ − min)``: over 64 rows of a weight that bound is ~6× a
        Gaussian column's variance. (x takes the bound or the outlier estimate, not its plain variance: an
        activation row's outliers set the GEMM's rounding, which its plain variance understates.)
    """
    w = weight.detach()
    w_nk = w.t() if weight_is_kn else w
    n, k = w_nk.shape
    g = GROUP_COLS
    ng, full = -(-n // g), n // g
    dev = w.device

    def groups(t: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        """(first group, (groups, rows, ...)) views of t's rows: the full groups, then the ragged last one."""
        parts = [(0, t[:full * g].unflatten(0, (full, g)))] if full else []
        return parts + ([(full, t[full * g:].unsqueeze(0))] if n > full * g else [])

    n_g = torch.full((ng,), float(g), device=dev)
    n_g[-1] = n - g * (ng - 1)
    w1g = torch.empty((ng, k), dtype=torch.float32, device=dev)
    sums = torch.zeros((ng, 3), dtype=torch.float32, device=dev)  # Σ|μ|, Σσ², Σμ²
    step = max(1, _CHUNK_ELEMS // n)
    for k0 in range(0, k, step):
        blk = w_nk[:, k0:k0 + step].float().contiguous()  # (N, kc); one layout: a (K, N) weight sums alike
        for g0, part in groups(blk):  # (groups, rows, kc)
            rows = slice(g0, g0 + part.shape[0])
            w1g[rows, k0:k0 + blk.shape[1]] = part.sum(1)
            mu, var = _moments(part, dim=1)  # per group and k: over the group's rows
            sums[rows, 0] += mu.abs().sum(1)
            sums[rows, 1] += var.sum(1)
            sums[rows, 2] += mu.square().sum(1)
    consts = torch.zeros((ng, GROUP_CONSTS), dtype=torch.float32, device=dev)
    if bias is not None:
        for g0, part in groups(bias.detach().float()):  # (groups, rows)
            rows = slice(g0, g0 + part.shape[0])
            bmu, bvar = _moments(part, dim=1)
            consts[rows, 0] = part.sum(1)
            consts[rows, 5] = n_g[rows] * bmu.abs()
            consts[rows, 6] = n_g[rows].sqrt() * bvar.sqrt()
    consts[:, 1] = n_g * sums[:, 0]
    consts[:, 2] = n_g * sums[:, 1]
    consts[:, 3] = n_g * n_g * sums[:, 2]
    consts[:, 4] = (n_g * sums[:, 1]).sqrt()
    consts[:, 7] = n_g
    return w1g, consts


def scale_variance_terms(consts: torch.Tensor, var_scale: float) -> torch.Tensor:
    """`group_checksums`' constants with the threshold's variance terms scaled by ``var_scale`` = e_var / e_max
    (`ft_transformers.vabft.default_emax_var`): ``v2``, ``v3`` (under the square root) by its square, ``v4``
    and ``bias_sd`` by it; the checksum, the mean terms and ``n_g`` as they are. `group_threshold` with
    these constants and ``emax`` = e_max is ``e_max·(mean terms) + e_var·(variance terms)``, so the kernels
    take the split without a second unit error.

    Args:
        consts: (T, 8) fp32.
        var_scale: a finite positive number.
    Returns:
        (T, 8) fp32, a new tensor.
    """
    s = torch.ones(GROUP_CONSTS, dtype=consts.dtype, device=consts.device)
    s[2:4] = var_scale * var_scale
    s[4] = var_scale
    s[6] = var_scale
    return consts * s


def group_threshold(mu: torch.Tensor, var: torch.Tensor, consts: torch.Tensor, emax: float, csigma: float
                    ) -> torch.Tensor:
    """SPEC §5's threshold of every (row, 64-column group), as the kernels' epilogues compute it.

    Args:
        mu, var: (M, 1) x's row mean and variance estimate (`row_stats`: the bound, or the outlier
            estimate where `xvar_in_use`).
        consts: (T, 8) `group_checksums`' constants.
    Returns:
        (M, T), in the dtype of the arguments.
    """
    c = consts
    return emax * (c[:, 1] * mu.abs() + csigma * torch.sqrt(mu.square() * c[:, 2] + var * c[:, 3])
                   + csigma * c[:, 4] * var.sqrt() + c[:, 5] + csigma * c[:, 6])
