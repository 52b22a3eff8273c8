"""V-ABFT checked linear layer: ``y = x·Wᵀ + b`` verified per 64-column group (PyTorch path).

The contract is ``docs/algorithms.md`` ("V-ABFT checked linear"). The product is computed in fp32
(the layer's own ``F.linear`` / ``addmm`` for fp32 operands; fp16/bf16 operands upcast, whose products
fp32 holds exactly) and rounded once to the output dtype; the check runs on the fp32 value *before*
that rounding, so its threshold is set by the GEMM's fp32 accumulation, not by the output format:

1. For every row m and group g of ``GROUP_COLS`` (64) output columns:
   ``D[m, g] = Σ_{n∈g} v[m, n] − (x[m]·w1_g + b1_g)`` with ``w1_g = Σ_{n∈g} W[n, :]`` (float64 dot)
   and v the fp32 product; the unit is faulty if ``|D| > T[m, g]`` (SPEC §5's threshold over the
   group's n_g columns, `kernels.gemm_checksums.group_checksums`) or D is not finite: ``detected``.
   One checksum over a 49k–152k-wide row (an lm_head) let a change of several logits hide in the
   rounding noise of the whole row; a group's threshold is that of 64 columns.
2. The faulty units (at most ``RECOMPUTE_GROUPS`` per call, a fixed-capacity gather) are recomputed
   exactly (float64 dots). The differences locate a single error, ``t = G·Σ_j ((j+1)/G)·d_j / Σ_j d_j``
   within 0.25 of an integer; it is replaced when the rest of the group agrees with the recomputation
   (within the threshold plus the fp32 GEMM's rounding bound): ``corrected``. Any other taken unit
   takes the recomputed values: ``recomputed``. Units beyond the capacity stay: ``uncorrectable``.

Counts are per (row, group), as in the Triton kernels. Nothing on this path synchronises with the host
(no ``.item()``, no data-dependent branch, no ``nonzero``): flags, locations and counts stay tensors,
so it runs asynchronously on CUDA. (On CPU, where reading a flag costs nothing, idle repair steps are
skipped; results are identical.) Rows of x holding NaN/inf are not verified and a non-finite W or b
disables the checks for the call (masked, not branched); either counts one ``nonfinite_input``, and
NaN/inf then propagate as in the plain layer.

Site ``linear.output``: flips hit y as returned (logical shape (M, N), M = rows of x with leading dims
flattened; y's dtype, so bits 0–15 for fp16/bf16); the check sees the flipped value where a flip
landed and the fp32 product elsewhere. Recomputations run without injection. With ``detect=False``
the call is exactly the unprotected layer (the GEMM in the operands' dtype).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from .config import _real
from .counters import FaultStats, add_count, new_counters
from .injection import FaultPlan, FaultSpec
from .kernels.contract import LINEAR_SITES
from .kernels.gemm_checksums import GROUP_COLS, group_checksums, group_threshold, row_stats, xvar_in_use
from .kernels.gemm_checksums import autocast_dtype as _autocast_dtype
from .vabft import default_emax, gemm_emax, weight_checksums

__all__ = ["RECOMPUTE_GROUPS", "checked_linear", "group_residuals"]

SITE = "linear.output"
RECOMPUTE_GROUPS = 16  # (row, column group) pairs recomputed per call at most (fixed capacity, no host sync)
LOCATE_TOL = 0.25  # |D2/D1 − (n+1)| ≤ this locates a single error at column n

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INT_VIEW = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}
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


class _WeightOwner:
    """Where `checked_linear` keeps one weight tensor's checksums (`vabft.weight_checksums`' cache) between
    calls: no module owns a weight passed to the function. No prepared launches: each call's counter
    block is new, so a recorded call signature would never match again."""

    __slots__ = ("__dict__", "__weakref__")


# weight tensor -> its `_WeightOwner`, for as long as the tensor lives (by identity: tensors compare by value)
_OWNERS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _owner_of(weight: torch.Tensor) -> _WeightOwner:
    owner = _OWNERS.get(weight)
    if owner is None:
        owner = _OWNERS[weight] = _WeightOwner()
    return owner


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
    settings = ((weight_is_kn, emax, csigma, correct) if cache_owner is not None
                and not isinstance(cache_owner, _WeightOwner) else None)
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
    if not detect or x.numel() == 0 or n == 0 or k == 0:
        y2d = _gemm(x, weight, bias, weight_is_kn).reshape(-1, n)  # exactly the unprotected computation
        sf = plan.for_site(SITE, tuple(y2d.shape), y2d.dtype, y2d.device) if plan else None
        if sf is not None:
            y2d = sf.apply(y2d, dim=-1, start=0)
        return y2d.reshape(*lead, n)
    x2d = x.reshape(-1, k)
    y32 = _gemm32(x2d, weight, bias, weight_is_kn)  # (M, N) fp32: what is verified
    y2d = y32 if y32.dtype == x.dtype else y32.to(x.dtype)  # rounded once
    sf = plan.for_site(SITE, tuple(y2d.shape), y2d.dtype, y2d.device) if plan else None
    v32 = y32
    if sf is not None:  # flips land on the rounded value; the check sees them there, the fp32 value elsewhere
        flipped = sf.apply(y2d.clone() if y2d is y32 else y2d, dim=-1, start=0)
        if y2d is y32:
            v32 = flipped
        else:
            hit = flipped.view(_INT_VIEW[flipped.dtype]) != y2d.view(_INT_VIEW[y2d.dtype])
            v32 = torch.where(hit, flipped.float(), y32)
        y2d = flipped
    if emax is None:
        emax = default_emax(torch.float32, y2d.device.type, "output", k=k)
    if counters is None:
        counters = new_counters(y2d.device)
    wc = weight_checksums(w_src, b_src, weight_is_kn=weight_is_kn, cache_owner=cache_owner, cast=cast)
    y2d = _verify(x2d, v32, y2d, weight, bias, wc, weight_is_kn, float(emax), float(csigma), correct, counters)
    return y2d.reshape(*lead, n)


def _gemm32(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, weight_is_kn: bool) -> torch.Tensor:
    """The product in fp32, (M, N): the layer's own GEMM for fp32 operands; fp16/bf16 operands upcast
    (their products are exact in fp32), so that the check sees the value before it is rounded."""
    if x2d.dtype == torch.float32:
        return _gemm(x2d, weight, bias, weight_is_kn)
    return _gemm(x2d.float(), weight.float(), bias.float() if bias is not None else None, weight_is_kn)


def _groups(wc, weight: torch.Tensor, bias: torch.Tensor | None, weight_is_kn: bool):
    """The weight's column-group checksums ``(w1g (T, K) fp64, consts (T, 8) fp32)``, cached with ``wc``
    (`group_checksums`; float64 so that the expected group sums do not depend on the matmul precision)."""
    key = ("reference", GROUP_COLS)
    g = wc.groups.get(key)
    if g is None:
        w1g, consts = group_checksums(weight, bias, weight_is_kn)
        g = wc.groups[key] = (w1g.double(), consts)
    return g


def _group_check(x32: torch.Tensor, v32: torch.Tensor, groups, emax: float, csigma: float
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(D, T, C)``, each (M, ⌈N/64⌉) fp32: for every row m and column group g of ``v32`` (M, N),
    ``D = Σ_{n∈g} v[m, n] − C``, ``C = x[m]·w1_g + b1_g`` (in float64), and the threshold ``T`` of SPEC §5
    over the group's n_g columns (`group_checksums`' constants, x's row mean and variance estimate of ``x32``
    (M, K): SPEC §5's bound, or the outlier estimate where `xvar_in_use`, `row_stats`))."""
    w1g, gc = groups
    m, n = v32.shape
    pad = (-n) % GROUP_COLS
    s = (F.pad(v32, (0, pad)) if pad else v32).view(m, -1, GROUP_COLS).sum(-1)
    c = (x32.double() @ w1g.t()).float() + gc[:, 0]
    # x's row mean and variance estimate: SPEC §5's bound (max − μ)(μ − min), or the outlier estimate (the
    # variance plus max|x − μ|²/√K, never above the bound). Not the plain variance: an activation row's
    # outliers set the GEMM's rounding, which it understates (a clean MiniLM row then failed its check)
    mu, var = row_stats(x32, xvar=xvar_in_use(x32.device.type, torch.float32, "output"))
    return s - c, group_threshold(mu.unsqueeze(-1), var.unsqueeze(-1), gc, emax, csigma), c


def _verify(x2d: torch.Tensor, v32: torch.Tensor, y2d: torch.Tensor, weight: torch.Tensor,
            bias: torch.Tensor | None, wc, weight_is_kn: bool, emax: float, csigma: float, correct: bool,
            counters: torch.Tensor) -> torch.Tensor:
    """Check every (row, 64-column group) of the fp32 product ``v32`` (M, N) (y before rounding, flips
    included) against ``x2d`` (M, K); repair ``y2d`` (M, N), the output as returned, in place; count
    per (row, group). Returns y2d."""
    m, n = y2d.shape
    k = x2d.shape[1]
    cpu = y2d.device.type == "cpu" and _CPU_SHORTCUTS
    x32 = x2d.float()
    groups = _groups(wc, weight, bias, weight_is_kn)
    d, thr, _ = _group_check(x32, v32, groups, emax, csigma)  # (M, T)
    # Non-finite inputs: a row of x holding NaN/inf is not verified (its checksum means nothing), a non-finite
    # W or b switches the call's checks off; either counts one `nonfinite_input` for the call.
    row_ok = torch.isfinite(x32).all(-1, keepdim=True)  # (M, 1)
    if not wc.finite:  # a host bool read when the weight checksums were built
        row_ok = torch.zeros_like(row_ok)
    add_count(counters, SITE, "nonfinite_input", (~row_ok.all()).to(torch.int32))
    bad = ~(d.abs() <= thr) & row_ok  # NaN/inf D counts as faulty
    n_bad = bad.sum()
    add_count(counters, SITE, "detected", n_bad)
    if not correct:
        add_count(counters, SITE, "uncorrectable", n_bad)
        return y2d
    if cpu and not bool(n_bad):
        return y2d
    # The faulty groups (at most RECOMPUTE_GROUPS per call: a fixed-capacity gather, no host sync) are
    # recomputed exactly (float64 dots); the differences then locate a single error as the weighted
    # checksum would, t = G·Σ_j ((j+1)/G)·d_j / Σ_j d_j within LOCATE_TOL of an integer.
    t = bad.shape[1]
    g = GROUP_COLS
    r = min(RECOMPUTE_GROUPS, bad.numel())
    flag, idx = torch.topk(bad.flatten().to(torch.float32), r, sorted=False)
    take = flag > 0  # (r,)
    rows, grp = idx // t, idx % t
    j = torch.arange(g, device=y2d.device)
    cols = grp[:, None] * g + j  # (r, G)
    col_ok = cols < n
    # a ragged last group's missing columns read and write the group's last column (same values twice)
    cols = torch.where(col_ok, cols, torch.full_like(cols, n - 1))
    w_nk = weight.t() if weight_is_kn else weight
    wg = w_nk[cols].double()  # (r, G, K)
    xr = x32.index_select(0, rows).double().unsqueeze(-1)  # (r, K, 1)
    ref = torch.bmm(wg, xr).squeeze(-1)  # (r, G)
    rabs = torch.bmm(wg.abs(), xr.abs()).squeeze(-1)
    if bias is not None:
        ref = ref + bias.double()[cols]
    ref = ref.float()
    v = v32[rows[:, None], cols]
    dif = torch.where(col_ok, v - ref, torch.zeros_like(ref))
    tq = (dif * ((j + 1) / g)).sum(-1) / dif.sum(-1) * g
    jl = torch.round(tq)
    n_g = col_ok.sum(-1)
    loc = take & torch.isfinite(tq) & ((tq - jl).abs() <= LOCATE_TOL) & (jl >= 1) & (jl <= n_g)
    at = loc[:, None] & (j[None, :] + 1 == jl[:, None])
    others = col_ok & ~at
    # the rest of the group must be clean: within the threshold plus the fp32 GEMM's own rounding
    # bound (K·u·Σ|x·w| per element) against the exact recomputation
    slack = (k * 2.0**-24) * torch.where(others, rabs, torch.zeros_like(rabs)).sum(-1).float()
    rest = torch.where(others, dif, torch.zeros_like(dif)).sum(-1)
    fixed = loc & (rest.abs() <= thr.flatten()[idx] + slack)
    need = take & ~fixed
    write = (at & fixed[:, None]) | need[:, None]
    flat = rows[:, None] * n + cols
    cur = y2d.view(-1)[flat]
    vals = torch.where(write, ref.to(y2d.dtype), cur)
    # a ragged group's missing columns write exactly what its last column writes (one value per index)
    vals = vals.gather(1, torch.where(col_ok, j, (n - 1 - grp * g)[:, None]))
    y2d.view(-1).index_put_((flat.flatten(),), vals.flatten())
    n_fix, n_rec = fixed.sum(), need.sum()
    add_count(counters, SITE, "corrected", n_fix)
    add_count(counters, SITE, "recomputed", n_rec)
    add_count(counters, SITE, "uncorrectable", n_bad - n_fix - n_rec)
    return y2d


def group_residuals(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                    emax: float | None = None, csigma: float = 2.5) -> tuple[torch.Tensor, torch.Tensor]:
    """The clean check of ``y = x·Wᵀ + b`` on the reference path, for studies of its tightness.

    Args:
        x: (..., K); weight: (N, K); bias: (N,) or None (one dtype, one device).
        emax: the unit error (None: the reference path's default, fp32 output side).
        csigma: c_σ of the threshold.
    Returns:
        ``(D, T)``, each (M, ⌈N/64⌉) fp32 with M = x.numel() // K: the checksum difference of every
        (row, 64-column group) of the fp32 product and its threshold.
    """
    k, n = _validate(x, weight, bias, False, False)
    x2d = x.reshape(-1, k)
    with torch.no_grad():
        if emax is None:
            emax = default_emax(torch.float32, x.device.type, "output", k=k)
        wc = weight_checksums(weight, bias)
        d, thr, _ = _group_check(x2d.float(), _gemm32(x2d, weight, bias, False),
                                 _groups(wc, weight, bias, False), float(emax), float(csigma))
    return d, thr


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

    The weight's checksums are built by the first call with that weight tensor and kept while the tensor
    lives, rebuilt when it changes in place (`ft_transformers.vabft.weight_checksums` says how a change is
    seen); later calls with it read no host value.
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
    owner = _owner_of(weight) if isinstance(weight, torch.Tensor) else None
    y = _checked_linear_forward(x, weight, bias, weight_is_kn=False, emax=emax, csigma=csigma, detect=detect,
                                correct=correct and detect, plan=plan, counters=counters, cache_owner=owner,
                                backend=backend)
    return y, FaultStats(counters)
