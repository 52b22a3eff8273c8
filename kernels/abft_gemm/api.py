"""The checked GEMM's entry points: `checked_gemm` (2-D operands), `checked_gemm_siblings` (layers that read
one input, in one launch), `linear_forward` (the checked linear's Triton backend) and `gemm_residuals`
(calibration, studies).

A call takes its form from `forms.choose_form`, its config from `tuning.pick_config`, builds its launches
(`calls`) and records them as a `prepared.PreparedCall` that later calls of the same signature replay.
The e_max tables belong to the caller: it passes ``emax`` and ``emax_table``, a function ``(dtype, device,
mode, K) → e_max`` or ``→ (e_max, e_var)`` (``ft_transformers.vabft.gemm_emax``; e_var: the unit error of the
threshold's variance terms, `gemm_checksums.scale_variance_terms`) asked only where a call needs a value it
was not given (the verification's own when ``emax`` is None, and the output side's for re-verifying a repair).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence

import torch

from ..contract import COUNTER_SHAPE, new_counters
from ..gemm_checksums import GROUP_COLS, WeightChecksums, xvar_in_use
from ..options import options
from ..tl_common import call_flag, capturing, on_tensor_device
from ..tl_common import cdiv as _cdiv
from . import calls as C
from .common import SITE
from .forms import CUBLAS, DECODE, INTERP, PERSISTENT, TILE, checksum_plan, choose_form, forced_config, fused_ok
from .prepared import FastPath, PreparedCall, keep, module_key
from .tuning import pick_config

MODES = ("accumulator", "output")
SIBLINGS_MAX = 3  # weights per sibling launch (the decode kernel's SEGS)
SIBLINGS_MAX_ROWS = 16  # rows per sibling launch (the decode kernel's BLOCK_M)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

EmaxTable = Callable[[torch.dtype, torch.device, str, int], "float | tuple[float, float]"]


class AbftGemmUnsupported(ValueError):
    """The Triton kernel cannot run this call (wrong device, dtype or layout)."""


def _emax_of(emax_table: EmaxTable | None, dtype: torch.dtype, device: torch.device, mode: str,
             k: int) -> tuple[float, float]:
    """``(e_max, e_var)`` from the caller's table (e_var = e_max where it gives one number)."""
    if emax_table is None:
        raise ValueError(f"this call needs the {mode}-side e_max of {dtype} at K = {k}: pass emax_table "
                         "(e.g. ft_transformers.vabft.gemm_emax)")
    e = emax_table(dtype, device, mode, k)
    return (float(e), float(e)) if isinstance(e, (int, float)) else (float(e[0]), float(e[1]))


def _reverify_scale(dtype: torch.dtype, device: torch.device, k: int, emax_var: float, correct: bool,
                    verify_output: bool, emax_table: EmaxTable | None) -> float:
    """The threshold factor a repaired row is re-verified with: it is re-verified as stored (rounded), so
    with the output-side unit error (1 without correction or in output mode). Against the smaller of the
    call's two unit errors (e_var), so that neither term of the re-verification is below the output side's."""
    if not correct or verify_output:
        return 1.0
    return max(1.0, _emax_of(emax_table, dtype, device, "output", k)[0] / float(emax_var))


def _check_device(t: torch.Tensor) -> None:
    dev = t.device
    if dev.type == "cuda":
        return
    if dev.type == "cpu" and INTERP:
        return
    hint = ""
    if dev.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        hint = (" (TRITON_INTERPRET=1 is set, but triton was imported before it was: set it before anything "
                "imports triton)")
    raise AbftGemmUnsupported("the Triton checked GEMM needs CUDA tensors (or CPU tensors with "
                              f"TRITON_INTERPRET=1), got {dev}{hint}; use backend='reference'")


def _check_mode_counters(mode: str, detect: bool, counters: torch.Tensor | None, dev: torch.device) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if detect and (counters is None or tuple(counters.shape) != COUNTER_SHAPE or counters.dtype != torch.int32
                   or counters.device != dev):
        raise ValueError(f"counters must be an int32 {COUNTER_SHAPE} tensor on {dev}")


@on_tensor_device
def checked_gemm(
    x2d: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    weight_is_kn: bool = False,
    wc=None,
    emax: float | None = None,
    emax_table: EmaxTable | None = None,
    csigma: float = 2.5,
    detect: bool = True,
    correct: bool = True,
    plan=None,
    counters: torch.Tensor | None = None,
    mode: str = "accumulator",
    debug: torch.Tensor | None = None,
    emax_var: float | None = None,
) -> torch.Tensor:
    """The checked GEMM on 2-D operands; events are added into ``counters``.

    Args:
        x2d: (M, K) fp16/bf16/fp32, CUDA (or CPU under ``TRITON_INTERPRET=1``), any strides.
        weight: (N, K) (``nn.Linear``) or, with ``weight_is_kn``, (K, N) (GPT-2 ``Conv1D``); x's dtype.
        bias: (N,) or None.
        wc: the weight's `WeightChecksums` (of exactly ``weight``/``bias``); None builds them.
        emax: threshold unit error; None asks ``emax_table(dtype, device, mode, K)``.
        emax_table: the caller's e_max table (module docstring), needed unless ``emax`` is given and
            nothing is repaired.
        emax_var: with ``emax``, the unit error of the threshold's variance terms (None: ``emax``).
        detect / correct: verify / repair (``correct=False`` counts ``detected`` + ``uncorrectable``).
        plan: faults at ``linear.output`` (logical shape (M, N), y's dtype), a fault plan as
            `ft_transformers.kernels.contract` describes it, or None.
        counters: (sites, kinds) int32 counter block (`contract.COUNTER_SHAPE`) on x's device (required
            when ``detect``).
        mode: ``"accumulator"`` (verify the fp32 accumulators, default) or ``"output"`` (verify the
            rounded output, like the PyTorch path; for studies and calibration).
        debug: optional (M, ⌈N/64⌉, 3) fp32 tensor receiving per (row, 64-column group) the checksum
            difference D, the checksum C and the threshold T (the group verification: tile, persistent or cuBLAS form).
    Returns:
        y (M, N) in x's dtype.
    """
    for name, t in (("x", x2d), ("weight", weight), ("bias", bias)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _DTYPES:
            raise AbftGemmUnsupported(f"{name} has dtype {t.dtype}; the checked GEMM supports float16, bfloat16 "
                                      "and float32")
    if x2d.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"x must be 2-D (M, K) and weight 2-D, got {tuple(x2d.shape)} and {tuple(weight.shape)}")
    k_w, n = weight.shape if weight_is_kn else weight.shape[::-1]
    k = x2d.shape[1]
    if k != k_w:
        raise ValueError(f"x has K = {k} columns but weight {tuple(weight.shape)} has in_features = {k_w}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias must have shape ({n},), got {tuple(bias.shape)}")
    if weight.dtype != x2d.dtype or (bias is not None and bias.dtype != x2d.dtype):
        raise TypeError("x, weight and bias must share one dtype")
    _check_device(x2d)
    dev = x2d.device
    if weight.device != dev or (bias is not None and bias.device != dev):
        raise ValueError("x, weight and bias must be on one device")
    _check_mode_counters(mode, detect, counters, dev)
    if emax_var is not None and emax is None:
        raise ValueError("emax_var goes with emax (without emax, both come from emax_table)")
    return _checked_gemm(x2d, weight, bias, weight_is_kn, wc, emax, emax_table, csigma, detect, correct, plan,
                         counters, mode, debug, emax_var=emax_var)


def _checked_gemm(x2d, weight, bias, weight_is_kn, wc, emax, emax_table, csigma, detect, correct, plan, counters,
                  mode, debug, kept: list | None = None, emax_var: float | None = None) -> torch.Tensor:
    """`checked_gemm` on validated arguments (the module path validates once, in `checked_linear`).
    ``kept``: a list the call's `PreparedCall` is appended to (when it has one)."""
    n = weight.shape[1] if weight_is_kn else weight.shape[0]
    m, k = x2d.shape
    dev = x2d.device
    correct = bool(correct and detect)
    prep_key = None
    if detect and wc is not None and not plan and debug is None and m and n and k:
        prep_key = (m, *x2d.stride(), x2d.data_ptr() % 16 == 0, weight.data_ptr(), *weight.stride(),
                    bias.data_ptr() if bias is not None else None, counters.data_ptr(), *counters.stride(),
                    emax, emax_var, csigma, correct, mode, options(),
                    capturing(dev))
        prepared = wc.launches.get(prep_key)
        if prepared is not None:
            if kept is not None:
                kept.append(prepared)
            return prepared(x2d, counters)
    y = torch.empty((m, n), dtype=x2d.dtype, device=dev)
    if m == 0 or n == 0:
        return y
    if k == 0:  # nothing to multiply (or to verify): the bias, plus any injected flips
        y.copy_(bias.expand(m, n) if bias is not None else torch.zeros((), dtype=y.dtype, device=dev))
        sf = plan.for_site(SITE, (m, n), y.dtype, dev) if plan else None
        return sf.apply(y, dim=-1, start=0) if sf is not None else y
    swn, swk = (weight.stride(1), weight.stride(0)) if weight_is_kn else (weight.stride(0), weight.stride(1))
    dot_f32 = x2d.dtype == torch.float32 or INTERP
    verify_output = mode == "output"

    def tune(tma: bool, decode: bool) -> tuple:
        L = C._Launch(x2d, weight, bias, y, swn, swk, weight_is_kn, tma)
        return pick_config(L, bias=bias, detect=detect, verify_output=verify_output, dot_f32=dot_f32, decode=decode)

    inject = functools.partial(C._inj_table, plan, m, n, y.dtype, dev) if plan else None
    form = choose_form(x2d, weight, y, detect=detect, debug=debug, inject=inject, tune=tune)
    L = C._Launch(x2d, weight, bias, y, swn, swk, weight_is_kn, form.tma)
    cfg, inj = form.cfg, form.inj
    if not detect:  # the plain GEMM
        C._launch_gemm(cfg, L, bias=bias, P=C._call_buffer(m, n, k, cfg, False, dev, y), inj=inj, detect=False,
                       verify_output=False, dot_f32=dot_f32)
        return y
    if form.kind in (TILE, PERSISTENT) and cfg[1] % GROUP_COLS:
        raise ValueError(f"a checked call's BLOCK_N must be a multiple of {GROUP_COLS} (its check groups); "
                         f"the forced config {cfg} is not")
    if wc is None:
        wc = WeightChecksums.compute(weight, bias, weight_is_kn=weight_is_kn)
    emax, emax_var = _emax_of(emax_table, y.dtype, dev, mode, k) if emax is None else (
        emax, emax if emax_var is None else emax_var)
    reverify = _reverify_scale(y.dtype, dev, k, emax_var, correct, verify_output, emax_table)
    ver = C._Verify(counters, debug, bool(wc.finite), reverify, correct)
    xvar = xvar_in_use(dev.type, y.dtype, mode)  # x's variance estimate (e_max's entry follows it, `emax_table`)
    groups = C._threshold_groups(wc, weight, bias, weight_is_kn, emax_var / emax)
    # the verification's operand, built now if this call does not use it: a decode step compiled with CUDA
    # graphs (after an eager prefill) must find it made, since a tensor first allocated in the graphs' warm-up
    # lands in their pool and makes the capture fail ("tensor(s) in the cudagraph pool not tracked as outputs")
    operand = C.group_operand(wc, weight, bias, weight_is_kn, x2d.dtype)
    if form.kind == DECODE:
        P = C._grouped_buffer(m, n, k, cfg, dev)
        which = C.decode_launcher(m, cfg)
        flag = call_flag(dev) if which == 6 else None
        call_id = flag[1] if flag is not None else None
        launches = [(which, *C._grouped_call(cfg, L, bias=bias, groups=groups, P=P, inj=inj, ver=ver, emax=emax,
                                             csigma=csigma, verify_output=verify_output, dot_f32=dot_f32, xvar=xvar,
                                             flag=flag))]
    elif form.kind == CUBLAS:
        flag, call_id = call_flag(dev)
        nc = C.checksum_rows(operand)
        plan = checksum_plan(m, k, nc, dev)
        P = C._product_buffer(m, n, plan, nc, dev)
        launches = [(4, *C._product_call(L, P, operand, plan, xvar)),
                    (5, *C._check_call(L, bias, P, flag, call_id, ver, operand, groups[1], emax, csigma, dot_f32,
                                       xvar=xvar, inj=inj, verify_output=verify_output, blocks=cfg,
                                       splits=plan[5]))]
    else:
        flag, call_id = call_flag(dev)
        fused = C.fused_plan(operand, xvar, m, k, cfg) if fused_ok(form.kind, x2d.dtype, m, k) else None
        P = C._call_buffer(m, n, k, cfg, True, dev, y, fused=fused)
        if form.kind == PERSISTENT:
            C._ensure_scratch_allocator()
            launches = [(3, *C._persistent_call(cfg, L, bias, P, verify_output, sms=form.sms, fused=fused))]
        else:
            launches = [(0, *C._gemm_call(cfg, L, bias=bias, P=P, inj=inj, detect=True, verify_output=verify_output,
                                          dot_f32=dot_f32, fused=fused))]
        launches.append((1, *C._verify_call(L, bias, P, flag, call_id, ver, operand, groups[1], emax, csigma,
                                            dot_f32, xvar=xvar, fused=fused)))
    for which, grid, args, kwargs in launches:
        C._launcher(which)(grid, args, kwargs)
    # (host TMA descriptors are made per call: such a call cannot be replayed; the persistent form makes its own)
    if prep_key is not None and (form.kind != TILE or not L.tma):
        prepared = PreparedCall.record(launches, x2d, y, P, counters, call_id)
        keep(wc.launches, prep_key, prepared)
        if kept is not None:
            kept.append(prepared)
    return y


def siblings_supported(x2d: torch.Tensor, weights: Sequence[torch.Tensor],
                       biases: Sequence[torch.Tensor | None]) -> bool:
    """Whether `checked_gemm_siblings` takes these operands (host metadata only): 2 to SIBLINGS_MAX
    ``nn.Linear`` weights (N_i, K), contiguous, of x's fp16/bf16 dtype and device, all with a bias or
    none, every N_i but the last a multiple of GROUP_COLS, M ≤ SIBLINGS_MAX_ROWS, and a decode-kernel
    config (a forced ``Options.gemm_config``, if any) that fits."""
    m, k = x2d.shape
    if not 2 <= len(weights) <= SIBLINGS_MAX or not 0 < m <= SIBLINGS_MAX_ROWS or k == 0:
        return False
    if x2d.dtype not in (torch.float16, torch.bfloat16) or len({b is None for b in biases}) != 1:
        return False
    for i, (w, b) in enumerate(zip(weights, biases)):
        if w.dim() != 2 or w.shape[1] != k or not w.is_contiguous() or w.dtype != x2d.dtype or w.device != x2d.device:
            return False
        if i < len(weights) - 1 and w.shape[0] % GROUP_COLS or w.shape[0] == 0:
            return False
        if b is not None and (b.shape != (w.shape[0],) or b.dtype != x2d.dtype or b.device != x2d.device):
            return False
    forced = forced_config()
    return forced is None or (forced[0] >= 16 and forced[1] == GROUP_COLS)


def checked_gemm_siblings(x2d: torch.Tensor, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None],
                          wcs: Sequence[WeightChecksums], counters: Sequence[torch.Tensor], *,
                          emax: float | None = None, emax_table: EmaxTable | None = None, csigma: float = 2.5,
                          correct: bool = True) -> torch.Tensor:
    """Checked GEMMs of sibling layers that read the same input, in one launch of the decode kernel.

    ``y = x · [W_0; W_1; …]ᵀ + [b_0; b_1; …]``: each weight keeps its own storage, checksum groups
    (`gemm_checksums.group_checksums`, cached in its `WeightChecksums`) and counters, so the events of
    ``y[:, the columns of W_i]`` are W_i's, counted as its own `checked_gemm` call would count them
    (per row and 64-column group, accumulator-side verification). One launch instead of one per
    weight: Q, K and V projections, or a gated MLP's gate and up projections.

    Args:
        x2d: (M, K), fp16/bf16 (`siblings_supported` says which operands are taken).
        weights: 2 or 3 tensors (N_i, K), contiguous, x's dtype and device.
        biases: (N_i,) each, or all None.
        wcs: each weight's `WeightChecksums` (of exactly that weight and bias), all finite.
        counters: each weight's (sites, kinds) int32 counter block.
        emax / emax_table / csigma / correct: as `checked_gemm`'s.
    Returns:
        y (M, ΣN_i) in x's dtype; ``y[:, :N_0]`` is layer 0's output, and so on.
    """
    if not siblings_supported(x2d, weights, biases):
        raise AbftGemmUnsupported("checked_gemm_siblings: operands not supported (see siblings_supported)")
    if not all(wc.finite for wc in wcs):
        raise AbftGemmUnsupported("checked_gemm_siblings needs finite weights and biases")
    return siblings_forward(x2d, weights, biases, wcs, counters, emax, emax_table, csigma, correct)


def siblings_forward(x2d: torch.Tensor, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None],
                     wcs: Sequence[WeightChecksums], counters: Sequence[torch.Tensor], emax: float | None,
                     emax_table: EmaxTable | None, csigma: float, correct: bool) -> torch.Tensor:
    """`checked_gemm_siblings` on operands it takes (the module path checks them once, in
    `ft_transformers.siblings._siblings_forward`)."""
    m, k = x2d.shape
    dev, dtype = x2d.device, x2d.dtype
    correct = bool(correct)
    key = ("siblings", m, *x2d.stride(), x2d.data_ptr() % 16 == 0,
           tuple((w.data_ptr(), id(wc)) for w, wc in zip(weights, wcs)),
           tuple(c.data_ptr() for c in counters), counters[0].stride(), emax, csigma, correct, options(),
           capturing(dev))
    cache = wcs[0].launches
    prepared = cache.get(key)
    if prepared is not None:
        return prepared(x2d, counters[0])
    n = sum(w.shape[0] for w in weights)
    y = torch.empty((m, n), dtype=dtype, device=dev)
    w0 = weights[0]
    L = C._Launch(x2d, w0, biases[0], y, w0.stride(0), w0.stride(1))
    emax, emax_var = _emax_of(emax_table, dtype, dev, "accumulator", k) if emax is None else (emax, emax)
    groups = [C._threshold_groups(wc, w, b, False, emax_var / emax) for w, b, wc in zip(weights, biases, wcs)]
    sibs = tuple(zip(weights[1:], biases[1:], groups[1:], counters[1:]))
    cfg = pick_config(L, bias=biases[0], detect=True, verify_output=False, dot_f32=INTERP, decode=True,
                      siblings=sibs)
    reverify = _reverify_scale(dtype, dev, k, emax_var, correct, False, emax_table)
    ver = C._Verify(counters[0], None, True, reverify, correct)
    P = C._grouped_buffer(m, n, k, cfg, dev)
    launches = [(2, *C._grouped_call(cfg, L, bias=biases[0], groups=groups[0], P=P, inj=None, ver=ver, emax=emax,
                                     csigma=csigma, verify_output=False, dot_f32=INTERP,
                                     xvar=xvar_in_use(dev.type, dtype, "accumulator"),
                                     siblings=sibs))]
    C._launcher(2)(*launches[0][1:])
    keep(cache, key, PreparedCall.record(launches, x2d, y, P, counters[0], None))
    return y


def gemm_residuals(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                   weight_is_kn: bool = False, mode: str = "accumulator", emax: float = 1.0,
                   csigma: float = 2.5, plan=None, emax_var: float | None = None) -> dict[str, torch.Tensor]:
    """Run the kernel without repair and return its verification quantities (calibration, studies).

    Returns ``{"y": (M, N), "d": (M, T_g), "c": (M, T_g), "thr": (M, T_g), "counters": (sites, kinds)}`` with
    T_g = ⌈N/64⌉: per (row, 64-column group) the checksum difference, the checksum ``x·w1_g + b1_g`` and the
    threshold with the given ``emax`` (1.0 gives ``T / e_max``) and ``emax_var`` (the variance terms'; None:
    ``emax``), all fp32 as the kernel computed them (the tile, persistent or cuBLAS form's verification).
    """
    tg = _cdiv(weight.shape[1] if weight_is_kn else weight.shape[0], GROUP_COLS)
    dbg = torch.zeros((x2d.shape[0], tg, 3), dtype=torch.float32, device=x2d.device)
    cnt = new_counters(x2d.device)
    y = checked_gemm(x2d, weight, bias, weight_is_kn=weight_is_kn, emax=emax, csigma=csigma, detect=True,
                     correct=False, plan=plan, counters=cnt, mode=mode, debug=dbg, emax_var=emax_var)
    return {"y": y, "d": dbg[..., 0], "c": dbg[..., 1], "thr": dbg[..., 2], "counters": cnt}


@on_tensor_device
def linear_forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    weight_is_kn: bool,
    wc: WeightChecksums | None,
    emax: float | None,
    emax_table: EmaxTable | None,
    csigma: float,
    detect: bool,
    correct: bool,
    plan,
    counters: torch.Tensor | None,
    cast: torch.dtype | None = None,
    mode: str = "accumulator",
    settings: tuple | None = None,
) -> tuple[torch.Tensor, FastPath | None]:
    """`ft_transformers.checked_linear`'s Triton backend: x (..., K) → y (..., N), events into ``counters``.

    Same arguments as the reference forward (`checked_linear._checked_linear_forward`), which has
    validated shapes, dtypes and devices (they are not checked again here), with the weight checksums
    ``wc`` resolved by the caller (of the cast weight under autocast; None when nothing is verified) and
    ``cast`` the autocast dtype (the operands are cast like autocast would, and the kernel runs on the
    cast tensors).

    Returns ``(y, fast)``: ``fast`` a `FastPath` for the caller to keep when it passed ``settings`` (the
    hashable settings it will pass to the fast path) and the call has a prepared form, else None.
    """
    _check_device(x)
    if cast is not None:
        x = x.to(cast)
        weight = weight.to(cast)
        bias = bias.to(cast) if bias is not None else None
    k = weight.shape[0] if weight_is_kn else weight.shape[1]
    n = weight.shape[1] if weight_is_kn else weight.shape[0]
    lead = tuple(x.shape[:-1])
    x2d = x.reshape(-1, k)
    detect = detect and wc is not None
    if detect and counters is None:
        counters = new_counters(x.device)
    _check_mode_counters(mode, detect, counters, x.device)
    kept: list = []
    y = _checked_gemm(x2d, weight, bias, weight_is_kn, wc, emax, emax_table, csigma, detect, correct, plan, counters,
                      mode, None, kept)
    fast = None
    if settings is not None and kept and cast is None and mode == "accumulator":
        fast = FastPath(module_key(x, weight, bias, counters, settings), kept[0], k, n)
    return y.reshape(*lead, n), fast
