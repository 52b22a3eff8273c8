"""What the checked GEMM's kernels and its PyTorch reference path share: a weight version's state
(`WeightChecksums`) with its per-64-column-group checksums (`group_checksums`), the row
statistics both sides take (`row_stats`), and the dtype autocast runs a GEMM in (`autocast_dtype`).

Pure PyTorch (no Triton): the reference path imports it where Triton is not installed. The e_max
tables stay with the library (`ft_transformers.vabft`); callers pass e_max in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["GROUP_COLS", "GROUP_CONSTS", "WeightChecksums", "autocast_dtype", "group_checksums", "group_threshold",
           "row_stats"]

_CHUNK_ELEMS = 1 << 24  # at most 16M fp32 temporaries (64 MiB) while building a weight's checksums
GROUP_COLS = 64  # output columns per checksum group of the decode kernel
GROUP_CONSTS = 8  # fp32 per group: b1, det, v2, v3, v4, bias_det, bias_sd, n_g (`group_checksums`)


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast runs a GEMM in on ``device_type`` right now, or None outside autocast (the
    checksums are of the operands as cast)."""
    try:
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
    except (TypeError, RuntimeError):  # pragma: no cover - older torch / unknown device
        pass
    return None


def row_stats(t: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and Bhatia–Davis variance bound ``(max − μ)(μ − min)`` of ``t`` along ``dim`` (fp32).

    Args:
        t: floating tensor; reduced in fp32.
    Returns:
        ``(mean, var_bound)``, each of ``t``'s shape without ``dim``; the bound is clamped at 0
        (the fp32 mean of equal values may fall an ulp outside [min, max]).
    """
    t32 = t.float()
    mean = t32.mean(dim)
    mn, mx = torch.aminmax(t32, dim=dim)
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
        mean μ and variance bound σ² taken per call). The weight groups' variances are exact, not SPEC §5's
        Bhatia–Davis bound ``(max − μ)(μ − min)``: over 64 rows of a weight that bound is ~6× a Gaussian
        column's variance. (x keeps the bound: an activation row's outliers set the GEMM's rounding, which
        its exact variance understates.)
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


def group_threshold(mu: torch.Tensor, var: torch.Tensor, consts: torch.Tensor, emax: float, csigma: float
                    ) -> torch.Tensor:
    """SPEC §5's threshold of every (row, 64-column group), as the kernels' epilogues compute it.

    Args:
        mu, var: (M, 1) x's row mean and variance estimate (the library takes `row_stats`' bound).
        consts: (T, 8) `group_checksums`' constants.
    Returns:
        (M, T), in the dtype of the arguments.
    """
    c = consts
    return emax * (c[:, 1] * mu.abs() + csigma * torch.sqrt(mu.square() * c[:, 2] + var * c[:, 3])
                   + csigma * c[:, 4] * var.sqrt() + c[:, 5] + csigma * c[:, 6])
