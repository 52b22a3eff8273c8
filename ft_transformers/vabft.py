"""V-ABFT: variance-based adaptive thresholds for checksum-verified GEMMs (the V-ABFT paper and its
specification; SPEC §5).

For ``y = x·Wᵀ + b`` with A = x (M×K) and B = Wᵀ (K×N), the row checksum difference
``D1[m] = Σ_n y[m,n] − (x[m]·w1 + b1)`` (``w1 = Σ_n W[n,:]``, ``b1 = Σ_n b_n``) is pure rounding
noise when nothing went wrong. `vabft_threshold` bounds that noise per output row::

    T_m = e_max·( N|μ_Am|·Σ_k|μ_Bk|
                  + cσ·sqrt(N·μ_Am²·Σ_k σ²_Bk + N²·σ²_Am·Σ_k μ²_Bk)
                  + cσ·sqrt(N)·σ_Am·sqrt(Σ_k σ²_Bk) )

with the row statistics of A (row m of x) and of B (row k of B = column k of W): mean μ and the
distribution-free Bhatia–Davis variance bound ``σ² ≤ (max − μ)(μ − min)``. ``e_max`` is the unit
error of the verification (what the two computation paths may differ by, relative to the values
summed); `default_emax` holds the calibrated table, which ``scripts/calibrate_emax.py`` measures
(the V-ABFT paper §3.6).

The weight side is computed once per weight version (`WeightChecksums`, `weight_checksums`);
everything per call costs O(M·K + M·N), next to the GEMM's O(M·N·K).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import math
import re
import warnings
import weakref
from pathlib import Path

import torch

from .kernels.gemm_checksums import WeightChecksums, row_stats, set_xvar_auto_cuda, tensor_version, xvar_in_use

__all__ = [
    "WeightChecksums",
    "builtin_emax",
    "default_emax",
    "default_emax_var",
    "device_name",
    "device_slug",
    "gemm_emax",
    "load_emax_table",
    "row_stats",
    "table_entry",
    "vabft_threshold",
    "weight_checksums",
]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MODES = ("output", "accumulator")

# ---------------------------------------------------------------------------------------------
# e_max table (verification in fp32 of the values the GEMM produced).
#
# The papers' values: the V-ABFT specification §3 (Ascend 910B) bf16 8e-3, fp32 2.2e-6, fp16 1e-3;
# the V-ABFT paper Tables 1/2/7:
# CPU fp32 ≈ 4e-7 (constant in K), H100 fp32 5e-9·sqrt(N) + 1.2e-7, H100 bf16 8e-3 / fp16 1e-3.
#
# Two measurements per entry (u = unit roundoff of the output format: 2^-24, 2^-11, 2^-8):
#  (P) the V-ABFT paper §3.6 protocol (``scripts/calibrate_emax.py``, `protocol_emax`): |N(1,1)| operands,
#      max |D1| / |C1| over all rows; the seed sets e_max = max + 20 %.
#  (S) the slack of the threshold itself (the same script's `threshold_slack`): max |D1| / T(e_max = 1) over clean
#      GEMMs with operands (and a bias every other trial) from N(1e-6,1), N(1,1), U(-1,1),
#      TN(0,1) and |N(1,1)| — the smallest e_max with zero false positives on that data.
# Shapes (M, K, N): (64, 64, 256), (64, 256|1024, 256|1024), (64, 4096|8192, 1024), (8|16, 8192,
# 4096|8192), (256, 8192, 4096) [H100 only], (256, 16|64, 16|64). CPU = this 2-core x86 machine
# (torch 2.13 CPU, MKL/oneDNN); H100 = torch 2.11 + cuBLAS, TF32 off (the default).
#
# fp32: the difference is the GEMM's own fp32 accumulation error.
#   CPU:  (P) 24,000 rows: max 3.44e-7 = 5.8u (at K = 64; 4.4u for K = 256..8192: flat in K),
#         max + 20 % = 4.1e-7 (= the V-ABFT paper's CPU 4e-7). (S) 20 trials x 9 shapes x 5 dists:
#         max 2.7e-7 = 4.5u (N(1,1), (64, 1024, 1024)). Chosen 1e-6 = 16.8u: 2.9x the largest
#         observed value (the observed max still creeps up with more samples: 4.4u at 4k rows,
#         5.8u at 24k), room for other CPUs' blocking.
#   H100: (P) 249,600 rows: max 2.6e-7 = 4.4u. (S) max 5.9e-7 = 9.8u (zero-mean TN(0,1) / U(-1,1)
#         at (256, 8192, 4096); ≤ 3.6u at the smaller shapes), matching the V-ABFT paper's fit at K = 8192
#         (5.7e-7) with no margin. Chosen 2e-6 = 33.5u: 3.4x.
#   Measured to K = 8192; `default_emax(..., k=K)` scales the fp32 entries by sqrt(K / 8192) above.
# fp16 / bf16: the GEMM accumulates in fp32 and rounds once to the output format; we re-sum that
#   output in fp32, so the difference is the output rounding (≤ u·Σ_n|y_n|). It averages out over
#   N, so (P) gives only ~0.05–0.1u at N ≥ 256 — but up to 0.48u at N = K = 16 on the H100, and
#   zero-mean data leaves less slack than the protocol suggests, so "max + 20 %" of (P) is no safe
#   floor. We keep the papers' 2u (1e-3 / 8e-3), which also reproduces the V-ABFT specification's detection table:
#   bf16  CPU (P) 0.087u (S) 0.216u; H100 (P) 0.476u (S) 0.218u  -> 8e-3 = 2.05u (≥ 4.3x (P), 9.4x (S))
#   fp16  CPU (P) 0.086u (S) 0.192u; H100 (P) 0.458u (S) 0.226u  -> 1e-3 = 2.05u (≥ 4.5x (P), 9.1x (S))
# TF32 / reduced-precision fp32 matmul (torch.set_float32_matmul_precision("high"/"medium"), or
#   the backends' fp32_precision = "tf32"/"bf16"): the GEMM's inputs lose mantissa bits, so fp32
#   takes the fp16 (TF32: 10 mantissa bits) or bf16 entry. The checksums themselves never use
#   matmuls (float64 dots on the reference path), so these settings don't touch the verification side.
# mode="accumulator": verification inside a fused kernel before the output is rounded (the V-ABFT paper
#   "online ABFT"): the device's fp32 entry for every dtype — to be re-calibrated against the
#   fused kernel's own accumulation order.
# ---------------------------------------------------------------------------------------------
_EMAX_FP32_CPU = 1e-6
_EMAX_FP32_CUDA = 2e-6
_EMAX_FP16 = 1e-3  # 2·u_fp16 (u = 2^-11): the V-ABFT paper and specification, measured above
_EMAX_BF16 = 8e-3  # 2·u_bf16 (u = 2^-8): the V-ABFT paper and specification, measured above
_EMAX_K_REF = 8192  # the fp32 entries hold for K ≤ this (measured up to it)
# Fused-kernel (accumulator) fallback on a CUDA device without a table (`builtin_emax`): 10x the
# fp32 (cuBLAS SGEMM) entry for fp32's IEEE FMAs; for fp16/bf16, whose tensor-core fp32
# accumulation does not round to nearest, 2x the H100's calibrated fp16 entry (1.03e-4, ~900 fp32
# ulps; its calibration measured fp16 slack up to 5.1e-5, above the fp32-derived 2e-5).
_EMAX_ACC_CUDA = 2e-5
_EMAX_ACC_CUDA_TC = 2e-4

_EMAX_TABLE: dict[tuple[str, torch.dtype], float] = {
    ("cpu", torch.float32): _EMAX_FP32_CPU,
    ("cpu", torch.float16): _EMAX_FP16,
    ("cpu", torch.bfloat16): _EMAX_BF16,
    ("cuda", torch.float32): _EMAX_FP32_CUDA,
    ("cuda", torch.float16): _EMAX_FP16,
    ("cuda", torch.bfloat16): _EMAX_BF16,
}


def _fp32_matmul_mode(device_type: str) -> str:
    """``"ieee"``, ``"tf32"`` or ``"bf16"``: how fp32 GEMMs run on ``device_type`` right now."""
    mod = getattr(torch.backends, "cuda" if device_type == "cuda" else "mkldnn", None)
    prec = getattr(getattr(mod, "matmul", None), "fp32_precision", None)
    if prec in ("tf32", "bf16", "ieee"):
        return prec
    global_prec = torch.get_float32_matmul_precision()  # "highest" | "high" | "medium"
    if device_type == "cuda":
        allow_tf32 = False
        try:
            allow_tf32 = bool(torch.backends.cuda.matmul.allow_tf32)
        except (AttributeError, RuntimeError):  # pragma: no cover - API drift
            pass
        # cuBLAS has no bf16-internal fp32 GEMM: "medium" runs TF32 there.
        return "tf32" if allow_tf32 or global_prec in ("high", "medium") else "ieee"
    return {"high": "tf32", "medium": "bf16"}.get(global_prec, "ieee")


_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
EMAX_TABLE_DIR = Path(__file__).with_name("emax_tables")


def device_slug(name: str) -> str:
    """File-name form of a device name: ``"NVIDIA H100 80GB HBM3"`` → ``"nvidia_h100_80gb_hbm3"``."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_") or "unknown"


def device_name(device_type: str, index: int | None = None) -> str:
    """The name the e_max tables are keyed by: ``"cpu"`` for every CPU, the CUDA device's name else."""
    if device_type == "cpu":
        return "cpu"
    if device_type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.cuda.current_device() if index is None else index)
    return device_type


@functools.cache
def load_emax_table(name: str) -> dict | None:
    """The calibrated table ``emax_tables/<device_slug(name)>.json`` shipped with the package, or None.

    Written by ``scripts/calibrate_emax.py``: ``{"device", "emax": {mode: {dtype name: value}},
    "k_ref", "k_scaling": {mode: "sqrt" | "linear"}, "measured": ..., ...}``, calibrated for SPEC §5's
    bound of x's row variance; entries calibrated for the outlier estimate (`xvar_in_use`) go under
    ``"xvar": {"emax": {mode: {dtype name: value}}, "measured": ...}``. Either section may hold
    ``"emax_var"`` beside ``"emax"``, alike in form: the variance terms' unit error (`default_emax_var`).
    """
    path = EMAX_TABLE_DIR / f"{device_slug(name)}.json"
    if not path.is_file():
        return None
    with open(path, encoding="utf-8") as fh:
        table = json.load(fh)
    for prefix, section in (("", table), ("xvar.", table.get("xvar", {}))):
        for key, mode, dt in itertools.product(("emax", "emax_var"), _MODES, _DTYPE_NAMES.values()):
            v = section.get(key, {}).get(mode, {}).get(dt)
            if v is not None and not (isinstance(v, (int, float)) and v > 0):
                raise ValueError(f"{path}: {prefix}{key}[{mode}][{dt}] must be a positive number, got {v!r}")
    return table


@functools.cache
def _cuda_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


@functools.cache
def _table_for_capability(capability: tuple[int, int]) -> dict | None:
    """A shipped CUDA table calibrated on a device of this compute capability (its ``"capability"``
    field), or None: the fused kernel's accumulation error is the tensor cores' arithmetic, which a
    capability fixes (an H200 computes as an H100 does; only its memory differs)."""
    for path in sorted(EMAX_TABLE_DIR.glob("*.json")):
        with open(path, encoding="utf-8") as fh:
            cap = json.load(fh).get("capability")
        if cap is not None and tuple(cap) == tuple(capability):
            return load_emax_table(path.stem)
    return None


def _table_for(device_type: str) -> dict | None:
    """The calibrated table of the current device: its own (by name), else one of a device of the
    same compute capability (CUDA), else None."""
    if device_type == "cpu":
        return load_emax_table("cpu")
    if device_type == "cuda" and torch.cuda.is_available():
        return _cuda_table(torch.cuda.current_device())
    return None


def _cuda_table(index: int) -> dict | None:
    """CUDA device ``index``'s table: its own (by name), else one of a device of the same capability."""
    table = load_emax_table(_cuda_name(index))
    return table if table is not None else _table_for_capability(_cuda_capability(index))


@functools.cache
def _cuda_capability(index: int) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(index))


@functools.cache
def _xvar_calibrated_on(index: int, dtype: torch.dtype, mode: str) -> bool:
    table = _cuda_table(index)
    if table is None or dtype not in _DTYPE_NAMES:
        return False
    return table_entry(table, mode, _DTYPE_NAMES[dtype], True) is not None


def _xvar_calibrated(dtype: torch.dtype, mode: str) -> bool:
    """`xvar_in_use`'s auto rule on CUDA: the current device's table (its own, else its capability's, as
    `default_emax` picks it) holds an e_max calibrated for the outlier estimate for (mode, dtype)."""
    return torch.cuda.is_available() and _xvar_calibrated_on(torch.cuda.current_device(), dtype, mode)


set_xvar_auto_cuda(_xvar_calibrated)


def builtin_emax(dtype: torch.dtype, device_type: str = "cpu", mode: str = "output") -> float:
    """The built-in (seed-derived) e_max used where no calibrated table entry exists (K ≤ 8192)."""
    dev = "cpu" if device_type == "cpu" else "cuda"
    if mode == "accumulator":
        if dev == "cuda":
            return _EMAX_ACC_CUDA if dtype == torch.float32 else _EMAX_ACC_CUDA_TC
        return _EMAX_TABLE[(dev, torch.float32)]
    return _EMAX_TABLE[(dev, dtype)]


_XVAR_WARNED: set[tuple[str, str, str]] = set()


def table_entry(table: dict, mode: str, dtype_name: str, xvar: bool, key: str = "emax") -> float | None:
    """A table's e_max for (mode, dtype name) under x's variance estimate: ``table["emax"]``'s (the bound),
    or with ``xvar`` ``table["xvar"]["emax"]``'s (the outlier estimate); None where it has none. ``key``
    "emax_var": the variance terms' unit error of the same section (`default_emax_var`)."""
    section = table.get("xvar", {}) if xvar else table
    return section.get(key, {}).get(mode, {}).get(dtype_name)


def default_emax(dtype: torch.dtype, device_type: str = "cpu", mode: str = "output", *,
                 k: int | None = None, xvar: bool | None = None) -> float:
    """The calibrated V-ABFT unit error ``e_max`` for GEMMs producing ``dtype`` on ``device_type``.

    Looks up the device's table (``ft_transformers/emax_tables/<device>.json``, written by
    ``scripts/calibrate_emax.py``: ``cpu.json`` for CPUs, the CUDA device name otherwise; a CUDA
    device without one takes the table of a device of the same compute capability) and falls back
    to the built-in constants above when there is none (or it lacks the entry).

    Args:
        dtype: the GEMM's output dtype (float32, float16 or bfloat16).
        device_type: ``"cpu"`` or ``"cuda"`` (other devices take the CUDA fallback entries).
        mode: ``"output"`` — verification of the output as stored (the PyTorch path);
            ``"accumulator"`` — verification of the fp32 accumulator inside the fused kernel
            (`ft_transformers.kernels.abft_gemm`), per input dtype.
        k: the GEMM's inner dimension; fp32-level entries grow above the table's ``k_ref``
            (``sqrt(k / k_ref)``, or linearly where the table says so).
        xvar: the entry calibrated for x's outlier variance estimate (True) or for SPEC §5's bound
            (False); None: the estimate the checks take on ``device_type`` (`xvar_in_use`). A table
            without an outlier entry gives its bound entry (with a warning, once): the outlier estimate's
            thresholds are then those of an e_max calibrated for the larger bound, which is what a
            calibration run measures (``scripts/calibrate_emax.py --xvar``).
    """
    return _lookup(dtype, device_type, mode, k, xvar, "emax")


def default_emax_var(dtype: torch.dtype, device_type: str = "cpu", mode: str = "output", *,
                     k: int | None = None, xvar: bool | None = None) -> float:
    """The unit error of the threshold's variance terms (SPEC §5's ``cσ·sqrt(...)`` terms), where the table
    calibrates it apart from e_max (``"emax_var"``); `default_emax`'s value elsewhere. Same arguments.

    Why apart: the mean term ``N|μ_A|·Σ|μ_B|`` bounds the rounding of partial sums that grow in one
    direction, the variance terms that of sums that cancel. The paper's single e_max is set by data of
    positive mean (its protocol's |N(1,1)|), whose rounding is several times that of zero-mean data per unit
    of threshold; a layer whose operands have means near 0 (an MLP's down projection) then gets that
    margin on terms that need far less. The calibration measures the variance terms' unit error on
    zero-mean data and keeps e_max for the mean term, so every calibration row stays within half its
    threshold (``scripts/calibrate_emax.py``, "split")."""
    return _lookup(dtype, device_type, mode, k, xvar, "emax_var")


def _lookup(dtype: torch.dtype, device_type: str, mode: str, k: int | None, xvar: bool | None, key: str) -> float:
    """`default_emax` (``key`` "emax") or `default_emax_var` (``key`` "emax_var"; e_max where there is none)."""
    if dtype not in _DTYPES:
        raise TypeError(f"no e_max for {dtype}; V-ABFT supports float16, bfloat16 and float32")
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
    dev = "cpu" if device_type == "cpu" else "cuda"
    eff = dtype
    if mode == "output" and dtype == torch.float32:
        fp32 = _fp32_matmul_mode(dev)
        if fp32 == "tf32":
            eff = torch.float16  # 10 stored mantissa bits, like fp16
        elif fp32 == "bf16":
            eff = torch.bfloat16
    if xvar is None:
        xvar = xvar_in_use(dev, eff, mode)
    table = _table_for(dev)
    entry = None
    if table is not None:
        entry = table_entry(table, mode, _DTYPE_NAMES[eff], bool(xvar))
        if entry is None and xvar:
            xvar = False
            entry = table_entry(table, mode, _DTYPE_NAMES[eff], False)
            if entry is not None and (table.get("device"), mode, _DTYPE_NAMES[eff]) not in _XVAR_WARNED:
                _XVAR_WARNED.add((table.get("device"), mode, _DTYPE_NAMES[eff]))
                warnings.warn(f"the e_max table of {table.get('device')} has no {mode}-side {_DTYPE_NAMES[eff]} "
                              "entry calibrated for x's outlier variance estimate (FTT_GEMM_XVAR=1): taking the "
                              "entry calibrated for the bound (scripts/calibrate_emax.py --xvar calibrates one)",
                              RuntimeWarning, stacklevel=3)
        if entry is not None and key == "emax_var":
            entry = table_entry(table, mode, _DTYPE_NAMES[eff], bool(xvar), key) or entry
    k_ref, scaling = _EMAX_K_REF, "sqrt"
    if entry is not None:
        emax = float(entry)
        k_ref = int(table.get("k_ref", _EMAX_K_REF))
        scaling = table.get("k_scaling", {}).get(mode, "sqrt")
    else:
        emax = builtin_emax(eff, dev, mode)
    fp32_level = mode == "accumulator" or eff == torch.float32
    if fp32_level and k is not None and k > k_ref:
        emax *= (k / k_ref) if scaling == "linear" else math.sqrt(k / k_ref)
    return emax


_GEMM_EMAX: dict[tuple, tuple[float, float]] = {}  # (dtype, device, mode, K, xvar) → (e_max, e_var); never dropped


def gemm_emax(dtype: torch.dtype, device: torch.device, mode: str, k: int) -> tuple[float, float]:
    """``(e_max, e_var)`` of a checked GEMM on ``device`` (`default_emax`, `default_emax_var`), for the variance
    estimate its checks take (`xvar_in_use`), memoised per (dtype, device, mode, K, estimate): the table lookup
    reads the device's name and table on every call. Not memoised for fp32 output-side entries, which follow
    the current matmul precision. This is the ``emax_table`` the Triton kernels take
    (`ft_transformers.kernels.abft_gemm`)."""
    if mode == "output" and dtype == torch.float32:
        return (default_emax(dtype, device.type, mode, k=k), default_emax_var(dtype, device.type, mode, k=k))
    key = (dtype, device, mode, k, xvar_in_use(device.type, dtype, mode))
    e = _GEMM_EMAX.get(key)
    if e is None:
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            e = _GEMM_EMAX[key] = (default_emax(dtype, device.type, mode, k=k, xvar=key[-1]),
                                   default_emax_var(dtype, device.type, mode, k=k, xvar=key[-1]))
    return e

# ---------------------------------------------------------------------------------------------
# Statistics and thresholds
# ---------------------------------------------------------------------------------------------


def _threshold(mu_a: torch.Tensor, var_a: torch.Tensor, n: int, sum_abs_mu_b: torch.Tensor,
               sum_var_b: torch.Tensor, sum_mu2_b: torch.Tensor, emax: float, csigma: float) -> torch.Tensor:
    """SPEC §5's ``T_m`` from the row statistics of A (shape (M,)) and the sums over k of B's."""
    fn = float(n)
    det = fn * mu_a.abs() * sum_abs_mu_b
    var23 = torch.sqrt(fn * mu_a.square() * sum_var_b + fn * fn * var_a * sum_mu2_b)
    var4 = math.sqrt(fn) * torch.sqrt(var_a) * torch.sqrt(sum_var_b)
    return emax * (det + csigma * var23 + csigma * var4)


def vabft_threshold(a: torch.Tensor, b: torch.Tensor, *, emax: float, csigma: float = 2.5) -> torch.Tensor:
    """Per-row V-ABFT threshold of the GEMM ``a @ b``.

    Args:
        a: (M, K) floating tensor (the GEMM's left operand; for a linear layer, x).
        b: (K, N) floating tensor (the right operand; for a linear layer, Wᵀ).
        emax: unit error bound of the verification (`default_emax` gives the calibrated ones).
        csigma: confidence coefficient c_σ of the variance terms.
    Returns:
        (M,) float32 thresholds ``T_m`` (SPEC §5), on ``a``'s device: the largest ``|D1[m]|`` the
        rounding noise of a correct GEMM is expected to produce. Statistics are taken in fp32.
    """
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating tensor, got {t.dtype}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"inner dimensions differ: a is {tuple(a.shape)}, b is {tuple(b.shape)}")
    if a.device != b.device:
        raise ValueError(f"a and b must be on one device, got {a.device} and {b.device}")
    if not (isinstance(emax, (int, float)) and emax > 0):
        raise ValueError(f"emax must be a positive number, got {emax!r}")
    if not (isinstance(csigma, (int, float)) and csigma > 0):
        raise ValueError(f"csigma must be a positive number, got {csigma!r}")
    mu_a, var_a = row_stats(a, dim=1)
    mu_b, var_b = row_stats(b, dim=1)  # per k: statistics of row k of b
    return _threshold(mu_a, var_a, b.shape[1], mu_b.abs().sum(), var_b.sum(), mu_b.square().sum(),
                      float(emax), float(csigma))


# ---------------------------------------------------------------------------------------------
# Weight-side checksums, cached per weight version on the owner (the math: `kernels.gemm_checksums`)
# ---------------------------------------------------------------------------------------------

_CACHE_ATTR = "_ftt_vabft_checksums"


class _ChecksumCache(dict):
    """``{autocast dtype or None: (weakref(weight), weakref(bias), key, WeightChecksums)}``.

    Lives in the owner's ``__dict__``; pickling or copying the owner (``torch.save(module)``,
    ``copy.deepcopy``) carries an empty cache, rebuilt on the next call.
    """

    def __reduce__(self):
        return (_ChecksumCache, ())

    def __copy__(self):
        return _ChecksumCache()

    def __deepcopy__(self, memo):
        return _ChecksumCache()


def _key(t: torch.Tensor | None) -> tuple:
    if t is None:
        return (None,)
    return (t.data_ptr(), tensor_version(t), t.dtype, t.device, tuple(t.shape), tuple(t.stride()))


def weight_checksums(weight: torch.Tensor, bias: torch.Tensor | None = None, *, weight_is_kn: bool = False,
                     cache_owner: object | None = None, cast: torch.dtype | None = None) -> WeightChecksums:
    """`WeightChecksums` of ``weight``/``bias``, cached on ``cache_owner`` (e.g. the module).

    The cache entry is keyed by the identity, storage pointer, version counter (``_version``, bumped by
    every in-place update; an inference tensor has none, `tensor_version`), dtype, device, shape and
    strides of both tensors, so it refreshes when the weight changes. Note: updates through ``.data``
    bypass the version counter, and so do in-place writes to an inference tensor; use
    ``with torch.no_grad(): weight.copy_(...)`` (as ``load_state_dict`` does). The cache is an attribute
    ``_ftt_vabft_checksums`` of the owner (dropped when the owner is pickled or copied). Without
    ``cache_owner`` nothing is cached. ``cast`` (the autocast dtype) builds the checksums of
    ``weight.to(cast)`` / ``bias.to(cast)``, cached separately.
    """

    def build() -> WeightChecksums:
        if cast is None:
            return WeightChecksums.compute(weight, bias, weight_is_kn=weight_is_kn)
        b_cast = None if bias is None else bias.detach().to(cast)
        return WeightChecksums.compute(weight.detach().to(cast), b_cast, weight_is_kn=weight_is_kn)

    if cache_owner is None:
        return build()
    key = (bool(weight_is_kn), cast, _key(weight), _key(bias))
    slots = getattr(cache_owner, _CACHE_ATTR, None)
    entry = slots.get(cast) if isinstance(slots, _ChecksumCache) else None
    if entry is not None:
        ref_w, ref_b, ekey, wc = entry
        if ekey == key and ref_w() is weight and (ref_b() if ref_b is not None else None) is bias:
            return wc
    wc = build()
    entry = (weakref.ref(weight), weakref.ref(bias) if bias is not None else None, key, wc)
    if not isinstance(slots, _ChecksumCache):
        slots = _ChecksumCache()
        try:
            object.__setattr__(cache_owner, _CACHE_ATTR, slots)
        except (AttributeError, TypeError):  # an owner without __dict__: no cache
            return wc
    slots[cast] = entry
    return wc
