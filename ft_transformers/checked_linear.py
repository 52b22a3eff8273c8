"""V-ABFT checked linear layer: ``y = x·Wᵀ + b`` verified by a row checksum (PyTorch path).

The contract is ``docs/algorithms.md`` ("V-ABFT checked linear"). The GEMM is exactly what the
unprotected layer computes (``F.linear``, or ``torch.addmm`` for GPT-2's ``Conv1D``) in the input
dtype, so a clean protected call returns bit-identical outputs. Verification then runs in fp32 on
the output as produced:

1. ``D1[m] = Σ_n y[m,n] − (x[m]·w1 + b1)``, ``D2[m] = Σ_n (n+1)·y[m,n] − (x[m]·w2 + b2)``;
   a row is faulty if ``|D1| > T_m`` (`ft_transformers.vabft`) or D1 is not finite: ``detected``.
2. ``t = D2/D1`` within 0.25 of an integer ``n+1 ∈ [1, N]`` locates a single error at column n.
   The element is repaired by recomputing it (one fp32 dot product ``x[m]·W[n] + b[n]``, the exact
   value the GEMM should have produced — precise even when the flip made it huge or inf, where
   ``y −= D1`` would lose every digit), then the row is re-verified: ``corrected`` if it passes.
3. Every other faulty row (no location, or still failing after the repair, e.g. a mislocated
   error or several in one row) is recomputed: up to ``RECOMPUTE_ROWS`` (16) per call through a
   fixed-capacity gather (top-k on the flags), ``recomputed``; faulty rows beyond that capacity
   stay as they are, ``uncorrectable``.

Nothing on this path synchronises with the host (no ``.item()``, no data-dependent branch, no
``nonzero``): flags, locations and counts stay tensors, so it runs asynchronously on CUDA. (On CPU,
where reading a flag costs nothing, idle repair steps are skipped; results are identical.)
Non-finite x, W or b count one ``nonfinite_input`` and disable the checks for the call (masked, not
branched); NaN/inf then propagate as in the plain layer.

Site ``linear.output``: flips hit y right after the GEMM (logical shape (M, N), M = rows of x with
leading dims flattened; y's dtype, so bits 0–15 for fp16/bf16). Recomputations run without
injection.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from .config import _real
from .counters import FaultStats, add_count, new_counters
from .injection import FaultPlan, FaultSpec
from .kernels.contract import LINEAR_SITES
from .kernels.gemm_checksums import autocast_dtype as _autocast_dtype
from .vabft import checksum_residuals, default_emax, gemm_emax, weight_checksums

__all__ = ["RECOMPUTE_ROWS", "checked_linear"]

SITE = "linear.output"
RECOMPUTE_ROWS = 16  # rows recomputed per call at most (fixed capacity, no host sync)
LOCATE_TOL = 0.25  # |D2/D1 − (n+1)| ≤ this locates a single error at column n

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_BACKENDS = ("auto", "triton", "reference")
# backend="auto" sends every supported dtype to the Triton kernel on CUDA (all three passed the GPU tests
# on the H100, docs/vabft.md "Status"); a dtype whose kernel call raised (e.g. a compile failure on an
# untested GPU) is recorded here and falls back to the PyTorch path from then on.
_TRITON_FAILED: set[torch.dtype] = set()

# On CPU a flag read costs nothing, so the repair steps are skipped when no row needs them
# (same results). Tests switch this off to exercise the sync-free path that CUDA runs.
_CPU_SHORTCUTS = True


@functools.cache
def _triton_forward():
    """``linear_forward`` of ``ft_transformers.kernels.abft_gemm``, or None (no triton)."""
    try:
        from .kernels import abft_gemm as _kmod  # noqa: PLC0415 (optional, imported on demand)
    except ImportError:
        return None
    return getattr(_kmod, "linear_forward", None)


def _resolve_backend(backend: str, device: torch.device):
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(map(repr, _BACKENDS))}, got {backend!r}")
    if backend == "reference":
        return None
    fwd = _triton_forward()
    if backend == "triton":
        if fwd is None:
            raise NotImplementedError(
                "backend='triton' needs ft_transformers.kernels.abft_gemm.linear_forward, "
                "which is not available (not implemented yet, or triton is not installed); "
                "use backend='reference'"
            )
        return fwd
    return fwd if device.type == "cuda" else None


def _validate(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, weight_is_kn: bool,
              autocast: bool) -> tuple[int, int]:
    """Shape/dtype/device checks (host metadata only). Returns ``(K, N)``."""
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if t is None and name == "bias":
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; the checked linear supports float16, bfloat16 "
                            "and float32")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D ({'(K, N)' if weight_is_kn else '(N, K)'}), "
                         f"got shape {tuple(weight.shape)}")
    k, n = weight.shape if weight_is_kn else weight.shape[::-1]
    if x.dim() < 1 or x.shape[-1] != k:
        layout = ", Conv1D layout (K, N)" if weight_is_kn else ""
        raise ValueError(f"x's last dim must be in_features = {k} (weight {tuple(weight.shape)}{layout}), "
                         f"got x of shape {tuple(x.shape)}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n):
        raise ValueError(f"bias must have shape ({n},), got {tuple(bias.shape)}")
    if not autocast:
        dts = {x.dtype, weight.dtype} | ({bias.dtype} if bias is not None else set())
        if len(dts) != 1:
            raise TypeError(f"x, weight and bias must share one dtype, got x {x.dtype}, weight {weight.dtype}"
                            + (f", bias {bias.dtype}" if bias is not None else ""))
    devs = {x.device, weight.device} | ({bias.device} if bias is not None else set())
    if len(devs) != 1:
        raise ValueError(f"x, weight and bias must be on one device, got {sorted(map(str, devs))}")
    return int(k), int(n)


def _gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
          weight_is_kn: bool) -> torch.Tensor:
    """What the unprotected layer computes: ``nn.Linear`` (``F.linear``) or ``Conv1D`` (``addmm``)."""
    if not weight_is_kn:
        return F.linear(x, weight, bias)
    n = weight.shape[1]
    x2d = x.reshape(-1, x.shape[-1])
    y = torch.addmm(bias, x2d, weight) if bias is not None else torch.mm(x2d, weight)
    return y.view(*x.shape[:-1], n)


# The attribute of a protected module (the ``cache_owner``) holding its last call signature's prepared
# launches: the `FastPath` the Triton backend returned for it. This module writes it, tries it before
# anything else, and `ft_transformers.protect` drops it with the protection.
_FAST_PATH_ATTR = "_ftt_fast_path"


def _checked_linear_forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    weight_is_kn: bool,
    emax: float | None,
    csigma: float,
    detect: bool,
    correct: bool,
    plan: FaultPlan | None,
    counters: torch.Tensor | None,
    cache_owner: object | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """One checked GEMM ``y = x·Wᵀ + b`` (the module-patch entry point; no validation of ``plan``).

    Args:
        x: (..., K) input, float16/bfloat16/float32.
        weight: (N, K) (``nn.Linear``) or, with ``weight_is_kn``, (K, N) (GPT-2 ``Conv1D``).
        bias: (N,) or None.
        weight_is_kn: the weight is stored (K, N) and the layer computes ``addmm(b, x, W)``.
        emax: V-ABFT unit error; None takes `default_emax` for y's dtype and device.
        csigma: variance coefficient of the threshold.
        detect: verify (False: plain GEMM, injection still applied, nothing counted).
        correct: repair what was detected (False: count ``detected`` + ``uncorrectable``).
        plan: the call's faults (site ``linear.output``), or None.
        counters: (sites, kinds) int32 counter block to add into, or None.
        cache_owner: object to cache the weight checksums on (the module), or None.
        backend: ``"auto"`` (the Triton kernel on CUDA when available, falling back to the
            PyTorch path if it raises), ``"triton"`` or ``"reference"``.
    Returns:
        y (..., N) in x's dtype (the autocast dtype under autocast).
    """
    if detect and not plan and backend == "auto" and cache_owner is not None:
        fast = getattr(cache_owner, "__dict__", {}).get(_FAST_PATH_ATTR)
        if fast is not None:  # the module's last call signature, prepared (kernels.abft_gemm.FastPath)
            y = fast(x, weight, bias, counters, (weight_is_kn, emax, csigma, correct))
            if y is not None:
                return y
    if plan is not None:
        plan.check_sites(LINEAR_SITES, "checked_linear")
    dev_type = x.device.type
    cast = _autocast_dtype(dev_type)
    k, n = _validate(x, weight, bias, weight_is_kn, cast is not None)
    if torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    ):  # (detect=False too: the Triton path has no backward either, and a gradient must never stop silently)
        raise RuntimeError(
            "the checked linear layer is inference-only: run under torch.no_grad() or "
            "torch.inference_mode() (x, weight or bias requires grad and grad mode is on)"
        )
    fwd = _resolve_backend(backend, x.device)
    if fwd is not None and backend == "auto" and (cast or x.dtype) in _TRITON_FAILED:
        fwd = None
    if fwd is not None:
        args = (fwd, x, weight, bias, k, n, weight_is_kn, emax, csigma, detect, correct, plan, counters, cache_owner,
                cast)
        if backend == "triton":
            return _triton(*args)
        try:
            return _triton(*args)
        except Exception as exc:  # noqa: BLE001 - e.g. a Triton compile failure on an untested GPU
            _TRITON_FAILED.add(cast or x.dtype)
            warnings.warn(f"the Triton checked GEMM failed for {cast or x.dtype} ({type(exc).__name__}: {exc}); "
                          "falling back to the PyTorch checked path for this dtype", RuntimeWarning, stacklevel=2)
    if cast is None:
        return _forward(x, weight, bias, k, n, weight_is_kn, emax, csigma, detect, correct, plan, counters,
                        cache_owner, None)
    # Under autocast, reproduce its cast of the operands explicitly and run without it, so the
    # checksum sees exactly what the GEMM used (the weight checksums are cached per autocast dtype).
    with torch.autocast(dev_type, enabled=False):
        return _forward(x.to(cast), weight, bias, k, n, weight_is_kn, emax, csigma, detect, correct, plan,
                        counters, cache_owner, cast)


def _triton(fwd, x, weight, bias, k, n, weight_is_kn, emax, csigma, detect, correct, plan, counters, cache_owner,
            cast) -> torch.Tensor:
    """The Triton backend ``fwd`` (`kernels.abft_gemm.linear_forward`) on validated operands: the weight
    checksums from the owner's cache, e_max from the tables (`vabft.gemm_emax`); the `FastPath` it returns
    is kept on the owner."""
    wc = None
    if detect and x.numel() > 0 and n > 0 and k > 0:
        wc = weight_checksums(weight, bias, weight_is_kn=weight_is_kn, cache_owner=cache_owner, cast=cast)
    settings = (weight_is_kn, emax, csigma, correct) if cache_owner is not None else None
    y, fast = fwd(x, weight, bias, weight_is_kn=weight_is_kn, wc=wc, emax=emax, emax_table=gemm_emax, csigma=csigma,
                  detect=detect, correct=correct, plan=plan, counters=counters, cast=cast, settings=settings)
    if fast is not None:
        try:
            object.__setattr__(cache_owner, _FAST_PATH_ATTR, fast)
        except (AttributeError, TypeError):  # an owner without __dict__
            pass
    return y


def _forward(x, weight, bias, k, n, weight_is_kn, emax, csigma, detect, correct, plan, counters, cache_owner,
             cast) -> torch.Tensor:
    w_src, b_src = weight, bias
    if cast is not None:
        weight = weight.to(cast)
        bias = bias.to(cast) if bias is not None else None
    lead = tuple(x.shape[:-1])
    y = _gemm(x, weight, bias, weight_is_kn)  # exactly the unprotected computation
    y2d = y.reshape(-1, n)
    m = y2d.shape[0]
    sf = plan.for_site(SITE, (m, n), y2d.dtype, y2d.device) if plan else None
    if sf is not None:
        y2d = sf.apply(y2d, dim=-1, start=0)
    if not detect or m == 0 or n == 0 or k == 0:
        return y2d.reshape(*lead, n)
    if emax is None:
        emax = default_emax(y2d.dtype, y2d.device.type, "output", k=k)
    if counters is None:
        counters = new_counters(y2d.device)
    wc = weight_checksums(w_src, b_src, weight_is_kn=weight_is_kn, cache_owner=cache_owner, cast=cast)
    x2d = x.reshape(-1, k)
    y2d = _verify(x2d, y2d, weight, bias, wc, weight_is_kn, float(emax), float(csigma), correct, counters)
    return y2d.reshape(*lead, n)


def _verify(x2d: torch.Tensor, y2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, wc,
            weight_is_kn: bool, emax: float, csigma: float, correct: bool,
            counters: torch.Tensor) -> torch.Tensor:
    """Check the rows of ``y2d`` (M, N) against ``x2d`` (M, K); repair in place; count. Returns y2d."""
    m, n = y2d.shape
    cpu = y2d.device.type == "cpu" and _CPU_SHORTCUTS
    x32 = x2d.float()
    mn, mx = torch.aminmax(x32, dim=-1)
    mu = x32.mean(-1)
    var = ((mx - mu) * (mu - mn)).clamp_min(0.0)
    thr = wc.thresholds(mu, var, emax, csigma)  # (M,)
    # Non-finite inputs (x, W or b): one `nonfinite_input`, checks masked off for the call.
    valid = torch.isfinite(mn).all() & torch.isfinite(mx).all()  # 0-dim bool
    if not wc.finite:  # a host bool read when the weight checksums were built
        valid = torch.zeros_like(valid)
    add_count(counters, SITE, "nonfinite_input", (~valid).to(torch.int32))

    d1, d2, c1 = checksum_residuals(x32, y2d.float(), wc, scale2=1.0 / n)
    bad = ~(d1.abs() <= thr) & valid  # NaN/inf D1 counts as faulty
    add_count(counters, SITE, "detected", bad)
    if not correct:
        add_count(counters, SITE, "uncorrectable", bad)
        return y2d
    if cpu and not bool(bad.any()):
        return y2d

    # Locate single errors: t = D2/D1 ≈ n+1.
    t = d2 / d1 * n  # D2 came scaled by 1/N
    j = torch.round(t)
    loc = bad & torch.isfinite(t) & ((t - j).abs() <= LOCATE_TOL) & (j >= 1) & (j <= n)
    col = torch.where(loc, j - 1, torch.zeros_like(j)).to(torch.int64)  # (M,)
    fixed = torch.zeros_like(bad)
    if not (cpu and not bool(loc.any())):
        # Recompute the located element: fp32 dot x[m]·W[col[m]] + b[col[m]], rounded like y.
        w_nk = weight.t() if weight_is_kn else weight
        wrow = w_nk.index_select(0, col).float()  # (M, K)
        val = wrow.mul_(x32).sum(-1)
        if bias is not None:
            val = val + bias.float().index_select(0, col)
        idx = col.unsqueeze(1)
        old = y2d.gather(1, idx).squeeze(1)
        new = torch.where(loc, val.to(y2d.dtype), old)
        y2d.scatter_(1, idx, new.unsqueeze(1))
        # Re-verify the repaired rows (a mislocated repair leaves the fault in place: recompute).
        d1_after = y2d.float().sum(-1) - c1
        fixed = loc & (d1_after.abs() <= thr)
    add_count(counters, SITE, "corrected", fixed)

    need = bad & ~fixed
    if cpu and not bool(need.any()):
        return y2d
    r = min(RECOMPUTE_ROWS, m)
    flag, rows = torch.topk(need.to(torch.float32), r, sorted=False)
    take = flag > 0  # (r,)
    y_rows = _gemm(x2d.index_select(0, rows), weight, bias, weight_is_kn)  # no injection
    cur = y2d.index_select(0, rows)
    y2d.index_copy_(0, rows, torch.where(take.unsqueeze(1), y_rows, cur))
    n_rec = take.sum()
    add_count(counters, SITE, "recomputed", n_rec)
    add_count(counters, SITE, "uncorrectable", need.sum() - n_rec)
    return y2d


def checked_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    correct: bool = True,
    inject: FaultSpec | Sequence[FaultSpec] | None = None,
    backend: str = "auto",
    detect: bool = True,
    emax: float | None = None,
    csigma: float = 2.5,
) -> tuple[torch.Tensor, FaultStats]:
    """V-ABFT checked ``y = x·Wᵀ + b`` (like ``F.linear``), with fault statistics.

    Args:
        x: (..., K) input, float16, bfloat16 or float32.
        weight: (N, K), same dtype and device (``nn.Linear`` layout).
        bias: (N,) or None.
        correct: repair detected faults (locate + correct a single error, else recompute the row);
            ``False`` only counts them (``detected`` and ``uncorrectable``).
        inject: `FaultSpec`(s) at site ``linear.output`` (flips in y right after the GEMM, logical
            shape (M, N) with M = x.numel() // K).
        backend: ``"auto"`` (Triton on CUDA when available, else the PyTorch reference),
            ``"triton"`` or ``"reference"``.
        detect: ``False`` runs the plain GEMM (injection still applied) and checks nothing.
        emax: V-ABFT unit error; None takes the calibrated table (`ft_transformers.vabft.default_emax`).
        csigma: c_σ of the threshold.
    Returns:
        ``(y, stats)``: y (..., N) in x's dtype (on the PyTorch path bit-identical to ``F.linear``
        when nothing is detected; the Triton kernel's own GEMM otherwise), stats a `FaultStats`
        ``{kind: count}`` (reading it synchronises).
    Raises:
        TypeError / ValueError on unsupported dtypes, shape or device mismatches, an ``inject``
        naming an attention site, or an ``emax``/``csigma`` that is not a finite positive number;
        TypeError for a ``correct``/``detect`` that is not a bool; RuntimeError when called
        with grad enabled on tensors that require grad (inference only).
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if emax is not None:
        emax = _real("emax", emax, positive=True)
    csigma = _real("csigma", csigma, positive=True)
    for name, flag in (("correct", correct), ("detect", detect)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__} {flag!r}")
    plan = FaultPlan(inject)
    plan.check_sites(LINEAR_SITES, "checked_linear")
    counters = new_counters(x.device)
    y = _checked_linear_forward(x, weight, bias, weight_is_kn=False, emax=emax, csigma=csigma, detect=detect,
                                correct=correct and detect, plan=plan, counters=counters, backend=backend)
    return y, FaultStats(counters)
