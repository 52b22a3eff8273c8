"""Calibrate V-ABFT's unit error e_max on this device and write the table `default_emax` loads.

Protocol (the V-ABFT paper §3.6): positive |N(1,1)| operands (no cancellation in the checksum), many clean
GEMMs at representative sizes, e_max = observed max of |D1| / |C1| + 20 %. Measured for fp32, fp16
and bf16 and for both verification modes:

* ``output``: the PyTorch checked linear (``F.linear`` in the dtype, verified on the rounded output);
* ``accumulator``: the fused Triton kernel (`ft_transformers.kernels.abft_gemm`), verified on its fp32
  accumulators (on CPU without the Triton interpreter: the fp32 GEMM of the upcast operands).

Next to the protocol's value (P, `protocol_emax`) the script measures the threshold's slack (S, `threshold_slack`):
max |D1| / T(e_max = 1) over the four seed distributions (+ |N(1,1)|) with and without bias, which
is the smallest e_max with zero false positives on that data. The shipped value is
``max(1.2·P, 2·S, builtin)`` with the built-in value of `ft_transformers.vabft.builtin_emax` as a
floor: 2u for fp16/bf16 output verification (the papers' value: the rounding of a row sum averages
out over N, so P alone leaves too little room for zero-mean data), longer measurements for
fp32 (CPU 1e-6, which also serves CPUs with other BLAS blockings; H100 2e-6), 2e-5 for the fused
kernel on CUDA. A short calibration can raise these, never lower them.

The variance terms' own unit error (``"emax_var"``, `ft_transformers.vabft.default_emax_var`; "split" in the
measured entry): the slack of positive-mean data is set by the threshold's mean term, that of zero-mean
data by its variance terms, and the first is several times the second per unit of threshold. Keeping e_max
for the mean term, `split_emax` gives the variance terms the smallest unit error that keeps every slack row
within ``1 / slack-margin`` of its threshold (floored as e_max is, never above it), so layers whose operands
have means near 0 are not checked with the margin that positive means need. The table takes the split for
``--split-dtypes`` (fp16 and bf16 by default) and records it for every dtype.

The slack depends on the estimate of x's row variance in the threshold: SPEC §5's bound (the table's
``"emax"``) or the outlier estimate (``--xvar``: the table's ``"xvar"`` section,
`ft_transformers.kernels.gemm_checksums.xvar_in_use`), each measured with its own estimate in force.

Output: ``<out-dir>/<device slug>.json`` (``cpu.json`` for CPUs; the CUDA device name otherwise),
package data of ``ft_transformers``, loaded by `ft_transformers.vabft.default_emax`. Entries not measured
in the run are kept; a CUDA device without a table of its own starts from the one it loads now (a device
of the same compute capability, e.g. an H200 from the H100's), named in ``"inherited_from"``.

    python scripts/calibrate_emax.py --device cpu --trials 40 --slack-trials 4
    python scripts/calibrate_emax.py --device cuda --trials 400 --slack-trials 20
    python scripts/calibrate_emax.py --device cuda --modes accumulator --dtypes float16,bfloat16 --xvar
    # how each distribution's slack moves with K (recorded, not chosen from), into a scratch folder
    python scripts/calibrate_emax.py --device cuda --modes accumulator --dtypes float16 --xvar \
        --trend-k 1024,4096,8192,18944 --out-dir /tmp/cal
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import platform
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from ft_transformers.kernels.gemm_checksums import group_checksums
from ft_transformers.kernels.options import override

import ft_transformers as ftt
from ft_transformers.checked_linear import _group_check, _groups
from ft_transformers.vabft import (
    EMAX_TABLE_DIR,
    WeightChecksums,
    _table_for,
    builtin_emax,
    device_name,
    device_slug,
    load_emax_table,
)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
UNIT = {"float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}
SHAPES_CPU = [(64, 64, 256), (64, 1024, 256), (64, 4096, 1024), (32, 8192, 1024)]
SHAPES_CUDA = [(64, 64, 256), (16, 256, 16), (128, 1024, 256), (64, 4096, 1024), (64, 8192, 1024),
               (256, 8192, 4096)]
SLACK_SHAPES_CPU = [(64, 256, 256), (64, 1024, 1024), (32, 4096, 1024)]
# (the last: an lm_head's width, whose fp16 checksum C carries more rounding than its sums, per unit of threshold)
SLACK_SHAPES_CUDA = [(64, 256, 256), (64, 1024, 1024), (64, 4096, 1024), (64, 8192, 4096), (64, 896, 151936)]
MODES = ("output", "accumulator")

_CAL_SHAPES = ((64, 1024, 256), (64, 4096, 1024), (64, 8192, 1024))
DISTRIBUTIONS = ("N(1e-6,1)", "N(1,1)", "U(-1,1)", "TN(0,1)", "|N(1,1)|")
ZERO_MEAN = ("N(1e-6,1)", "U(-1,1)", "TN(0,1)")  # the distributions whose slack the variance terms set


def sample_matrix(dist: str, shape: Sequence[int], generator: torch.Generator) -> torch.Tensor:
    """An fp32 sample of a distribution of the V-ABFT specification §5.1 (`DISTRIBUTIONS`), on the
    generator's device.

    ``"N(1e-6,1)"``, ``"N(1,1)"``, ``"U(-1,1)"``, ``"TN(0,1)"`` (N(0,1) truncated to [-1, 1]) and
    ``"|N(1,1)|"`` (the V-ABFT paper §3.6's positive calibration matrices).
    """
    g = generator
    dev = g.device
    if dist == "N(1e-6,1)":
        return torch.randn(shape, generator=g, device=dev) + 1e-6
    if dist == "N(1,1)":
        return torch.randn(shape, generator=g, device=dev) + 1.0
    if dist == "U(-1,1)":
        return torch.rand(shape, generator=g, device=dev) * 2 - 1
    if dist == "TN(0,1)":
        return torch.nn.init.trunc_normal_(torch.empty(shape, device=dev), 0.0, 1.0, -1.0, 1.0, generator=g)
    if dist == "|N(1,1)|":
        return (torch.randn(shape, generator=g, device=dev) + 1.0).abs()
    raise ValueError(f"unknown distribution {dist!r}; choose one of {DISTRIBUTIONS}")


def _use_kernel(dev: torch.device) -> bool:
    """Whether accumulator-side residuals come from the fused Triton kernel on ``dev``."""
    if dev.type == "cuda":
        return True
    try:
        from ft_transformers.kernels import abft_gemm
    except ImportError:
        return False
    return dev.type == "cpu" and abft_gemm.interpreting()


def clean_residuals(a: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, *, mode: str = "output",
                    csigma: float = 2.5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(D, C, T1)`` (each (M·⌈N/64⌉,), fp32: one entry per row and 64-column check group) of one clean
    checked GEMM ``y = a·wᵀ + b``.

    ``T1`` is the threshold with ``e_max = 1`` (so ``|D1| / T1`` is the smallest e_max that passes).
    ``mode="output"``: the PyTorch path (``F.linear`` in a's dtype, verified on the rounded output).
    ``mode="accumulator"``: the fused kernel's own quantities on CUDA (or CPU under the Triton
    interpreter); elsewhere emulated by verifying ``F.linear`` of the fp32-upcast operands (an fp32
    accumulator of the same products, rounded nowhere).

    Args:
        a: (M, K); w: (N, K); b: (N,) or None; one dtype among fp16/bf16/fp32, one device.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "accumulator" and _use_kernel(a.device):
        from ft_transformers.kernels.abft_gemm import gemm_residuals

        r = gemm_residuals(a, w, b, mode="accumulator", emax=1.0, csigma=csigma)
        return r["d"].flatten(), r["c"].flatten(), r["thr"].flatten()
    if mode == "accumulator":
        y = F.linear(a.float(), w.float(), None if b is None else b.float())
    else:
        y = F.linear(a, w, b)
    wc = WeightChecksums.compute(w, b)
    d, thr, c = _group_check(a.float(), y.float(), _groups(wc, w, b, False), 1.0, csigma)
    return d.flatten(), c.flatten(), thr.flatten()


def mean_terms(a: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """The threshold's mean terms at ``e_max = 1`` (``N|μ_A|·Σ|μ_B|`` of each (row, 64-column group), plus the
    bias's), shape (M·⌈N/64⌉,) fp32 in `clean_residuals`' order: ``T1`` minus this is the variance terms'."""
    consts = group_checksums(w, b)[1]
    mu = a.float().mean(1, keepdim=True)
    return (consts[:, 1] * mu.abs() + consts[:, 5]).flatten()


def _ceil3(v: float) -> float:
    """``v`` rounded up to 3 significant digits."""
    if v <= 0:
        return 0.0
    q = 10.0 ** (math.floor(math.log10(v)) - 2)
    return float(f"{math.ceil(v / q * (1 - 1e-12)) * q:.3g}")


def _min_margin(d: torch.Tensor, m: torch.Tensor, v: torch.Tensor, e_det: float, e_var: float) -> float:
    """The smallest threshold / |D| ``(e_det·M + e_var·V) / |D|`` over the rows with |D| > 0 (inf if none)."""
    pos = d > 0
    return float(((e_det * m + e_var * v)[pos] / d[pos]).min()) if bool(pos.any()) else float("inf")


def split_emax(rows: Sequence[tuple], e_max: float, margin: float, floor: float,
               zero_mean: Sequence[str] = ZERO_MEAN) -> dict:
    """The pair (e_det, e_var) of the threshold's mean and variance terms, from the slack rows.

    e_var = ``margin·max |D| / V`` over the rows of the zero-mean distributions (whose |D| the variance terms
    must cover alone), at least ``floor`` and at most ``e_max``; then e_det = the smallest value, at least
    ``e_max`` (the single-value rule's), that keeps every row of every distribution within ``1 / margin`` of
    its threshold ``e_det·M + e_var·V``: ``max over rows of (margin·|D| − e_var·V) / M``. Positive-mean data
    needs its margin on the mean term, which then carries it: e_det rises a little, e_var falls several-fold.

    Args:
        rows: ``(distribution, |D|, M, V, K)`` per clean GEMM, |D|, M, V (rows,) fp32: the checksum differences,
            the mean terms and the variance terms at e_max = 1 (`threshold_slack`'s ``rows``).
    Returns:
        ``{"emax": e_det, "emax_var": e_var, "var_need_per_dist": {dist: max |D| / V},
        "det_need_per_dist": {dist: max (|D| − e_var·V / margin) / M}, "min_margin": the smallest threshold /
        |D| over the rows}``.
    """
    tiny = torch.finfo(torch.float32).tiny
    var_need: dict[str, float] = {}
    for dist, d, _, v, _ in rows:
        var_need[dist] = max(var_need.get(dist, 0.0), float((d / v.clamp_min(tiny)).max()))
    e_var = max(floor, margin * max((var_need[z] for z in zero_mean if z in var_need), default=0.0))
    e_var = min(float(f"{e_var:.3g}"), e_max)
    det_need: dict[str, float] = {}
    for dist, d, m, v, _ in rows:
        det_need[dist] = max(det_need.get(dist, 0.0), float(((d - e_var * v / margin) / m.clamp_min(tiny)).max()))
    e_det = max(e_max, _ceil3(margin * max(det_need.values(), default=0.0)))
    worst = min((_min_margin(d, m, v, e_det, e_var) for _, d, m, v, _ in rows), default=float("inf"))
    return {"emax": e_det, "emax_var": e_var, "var_need_per_dist": var_need, "det_need_per_dist": det_need,
            "min_margin": worst}


def protocol_emax(dtype: torch.dtype, device: torch.device | str = "cpu",
                   shapes: Sequence[tuple[int, int, int]] = _CAL_SHAPES,
                   trials: int = 100, seed: int = 0, margin: float = 1.2, mode: str = "output") -> dict:
    """Measure ``e_max`` with the V-ABFT paper's protocol: ``max |D1| / |C1|`` over clean GEMMs.

    Each trial draws A = |N(1,1)| (M×K) and W = |N(1,1)| (N×K) (positive, so the checksum has no
    cancellation), computes the checked GEMM in ``dtype`` on ``device`` and its residuals exactly as
    the verification does (`clean_residuals`, ``mode`` "output" or "accumulator"); every row is one
    sample. Returns ``{"max": observed max, "emax": max·margin, "per_shape": {(M, K, N): max},
    "samples": rows}``.
    """
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(seed)
    per_shape: dict[tuple[int, int, int], float] = {}
    samples = 0
    for (m, k, n) in shapes:
        worst = torch.zeros((), device=dev)
        for _ in range(trials):
            a = sample_matrix("|N(1,1)|", (m, k), g).to(dev, dtype)
            w = sample_matrix("|N(1,1)|", (n, k), g).to(dev, dtype)
            d1, c1, _ = clean_residuals(a, w, mode=mode)
            worst = torch.maximum(worst, (d1.abs() / c1.abs()).max())
            samples += m
        per_shape[(m, k, n)] = float(worst)
    mx = max(per_shape.values())
    return {"max": mx, "emax": mx * margin, "per_shape": per_shape, "samples": samples}


def threshold_slack(dtype: torch.dtype, device: torch.device | str = "cpu",
                    shapes: Sequence[tuple[int, int, int]] = _CAL_SHAPES, trials: int = 20,
                    distributions: Sequence[str] = DISTRIBUTIONS, csigma: float = 2.5, seed: int = 0,
                    mode: str = "output", per_shape: dict | None = None, rows: list | None = None) -> dict:
    """The smallest ``e_max`` without a false positive: ``max |D1| / T(e_max = 1)`` over clean GEMMs.

    For each distribution, ``trials`` GEMMs per shape (M, K, N) with x, W (and, every other
    trial, a bias) drawn from it, verified exactly as the checked linear layer (``mode="output"``)
    or the fused kernel (``mode="accumulator"``) does. Returns ``{dist: max ratio}``; a table entry
    ``e_max`` has slack ``e_max / ratio`` over that data. ``per_shape``, when given, is filled with
    ``{dist: {"MxKxN": max ratio}}`` (how the ratio moves with K, per distribution). ``rows``, when given,
    receives ``(dist, |D|, mean terms, variance terms, K)`` of every GEMM (`split_emax`'s input).
    """
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(seed)
    out: dict[str, float] = {}
    for dist in distributions:
        worst = torch.zeros((), device=dev)
        for (m, k, n) in shapes:
            shape_worst = torch.zeros((), device=dev)
            for t in range(trials):
                a = sample_matrix(dist, (m, k), g).to(dev, dtype)
                w = sample_matrix(dist, (n, k), g).to(dev, dtype)
                b = sample_matrix(dist, (n,), g).to(dev, dtype) if t % 2 else None
                d1, _, t1 = clean_residuals(a, w, b, mode=mode, csigma=csigma)
                shape_worst = torch.maximum(shape_worst, (d1.abs() / t1).max())
                if rows is not None:
                    mt = mean_terms(a, w, b)
                    rows.append((dist, d1.abs().float(), mt, (t1 - mt).clamp_min(0.0), k))
            worst = torch.maximum(worst, shape_worst)
            if per_shape is not None:
                per_shape.setdefault(dist, {})[f"{m}x{k}x{n}"] = float(shape_worst)
        out[dist] = float(worst)
    return out


def choose(mode: str, dtype: str, p: float, s: float, device_type: str, margin: float, slack_margin: float) -> float:
    """The shipped e_max from the protocol max P and the slack S (see the module docstring): never
    below the built-in value (`builtin_emax`: the papers' 2u for fp16/bf16 output,
    measurements with more trials for fp32), so a short calibration can only raise it. In
    accumulator mode the floor is the fp32 entry for every dtype (the fp16/bf16 built-ins are the
    cautious fallback for devices never calibrated, not a floor for those that are)."""
    v = max(margin * p, slack_margin * s, _floor(mode, dtype, device_type))
    return float(f"{v:.3g}")


def _floor(mode: str, dtype: str, device_type: str) -> float:
    """`choose`'s floor, also the variance terms' (`split_emax`)."""
    return builtin_emax(torch.float32 if mode == "accumulator" else DTYPES[dtype], device_type, mode)


def split_trend(rows: Sequence[tuple], e_det: float, e_var: float, margin: float) -> dict:
    """Per distribution and K of the ``--trend-k`` GEMMs (`threshold_slack`'s ``rows``), the smallest
    threshold / |D| with the pair grown past k_ref = 8192 linearly as the shipped table grows it:
    ``{dist: {K: margin}}``, to read against ``margin`` (how the pair's headroom moves with K)."""
    out: dict = {}
    for dist, d, m, v, k in rows:
        grow = max(1.0, k / 8192)
        r = _min_margin(d, m, v, grow * e_det, grow * e_var)
        out.setdefault(dist, {})[str(k)] = min(out.get(dist, {}).get(str(k), float("inf")), r)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--trials", type=int, default=200, help="protocol trials per shape (seed: 100k in all)")
    ap.add_argument("--slack-trials", type=int, default=10, help="slack trials per shape and distribution")
    ap.add_argument("--margin", type=float, default=1.2)
    ap.add_argument("--slack-margin", type=float, default=2.0)
    ap.add_argument("--modes", default="output,accumulator")
    ap.add_argument("--dtypes", default="float32,float16,bfloat16")
    ap.add_argument("--out-dir", type=Path, default=EMAX_TABLE_DIR)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trend-k", default="",
                    help="comma-separated K values: also measure the slack of each distribution at (64, K, 1024), "
                         "recorded as \"slack_trend\" beside the entry and not used for the choice (how the "
                         "threshold's headroom moves with K, e.g. past the table's k_ref)")
    ap.add_argument("--split-dtypes", default="float16,bfloat16",
                    help="comma-separated dtypes whose entries take the split (e_det, e_var); the others keep the "
                         "single e_max for both (the split is measured and recorded for every dtype; "
                         "docs/reliability.md, \"The variance terms' own unit error\")")
    ap.add_argument("--xvar", action="store_true",
                    help="calibrate for x's outlier variance estimate (the table's \"xvar\" section) instead of "
                         "SPEC §5's bound")
    args = ap.parse_args(argv)

    dev = torch.device(args.device)
    cpu = dev.type == "cpu"
    shapes = SHAPES_CPU if cpu else SHAPES_CUDA
    slack_shapes = SLACK_SHAPES_CPU if cpu else SLACK_SHAPES_CUDA
    name = device_name(dev.type)
    path = args.out_dir / f"{device_slug(name)}.json"
    if path.is_file():
        old = json.loads(path.read_text())
    else:  # a device without a table of its own starts from the one it loads now (same compute capability)
        with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
            old = copy.deepcopy(_table_for(dev.type) or {})
        if old:
            old["inherited_from"] = old.get("device")
    protocol = {"trials_per_shape": args.trials, "shapes_MKN": shapes, "slack_trials": args.slack_trials,
                "slack_shapes_MKN": slack_shapes, "slack_distributions": list(DISTRIBUTIONS),
                "margin": args.margin, "slack_margin": args.slack_margin,
                "rule": "max(margin*P, slack_margin*S, builtin_emax)",
                "rule_split": "e_var = min(e_max, max(builtin_emax, slack_margin * max |D| / V over the zero-mean "
                              "distributions)); e_det = max(e_max, slack_margin * max (|D| - e_var*V/slack_margin) / M "
                              "over all rows) (M, V: the threshold's mean and variance terms at e_max = 1)"}
    table = {
        **old,
        "device": name,
        "capability": list(torch.cuda.get_device_capability(dev)) if dev.type == "cuda" else None,
        "emax": old.get("emax", {}),
        "k_ref": 8192,
        "k_scaling": {"output": "sqrt", "accumulator": "sqrt" if cpu else "linear"},
        "measured": old.get("measured", {}),
    }
    versions = {"torch": torch.__version__, "python": platform.python_version(),
                "ft_transformers": getattr(ftt, "__version__", "0.1.0")}
    # the bound's entries at the top level, the outlier estimate's in "xvar" (`vabft.table_entry`)
    section = table.setdefault("xvar", {}) if args.xvar else table
    section.setdefault("emax", {})
    section.setdefault("measured", {})
    section["protocol"] = protocol
    try:
        import triton

        versions["triton"] = triton.__version__
    except ImportError:
        pass
    section["versions"] = versions
    for mode in args.modes.split(","):
        for dt in args.dtypes.split(","):
            t0 = time.time()
            with torch.no_grad(), override(gemm_xvar=bool(args.xvar)):
                prot = protocol_emax(DTYPES[dt], dev, shapes=shapes, trials=args.trials, seed=args.seed,
                                      margin=args.margin, mode=mode)
                slack_shape: dict = {}
                rows: list = []
                slack = threshold_slack(DTYPES[dt], dev, shapes=slack_shapes, trials=args.slack_trials,
                                        seed=args.seed + 1, mode=mode, per_shape=slack_shape, rows=rows)
                trend: dict = {}
                trend_rows: list = []
                if args.trend_k:
                    threshold_slack(DTYPES[dt], dev, shapes=[(64, int(k), 1024) for k in args.trend_k.split(",")],
                                    trials=args.slack_trials, seed=args.seed + 2, mode=mode, per_shape=trend,
                                    rows=trend_rows)
            p, s = prot["max"], max(slack.values())
            u = UNIT["float32" if mode == "accumulator" else dt]
            val = choose(mode, dt, p, s, dev.type, args.margin, args.slack_margin)
            split = split_emax(rows, val, args.slack_margin, _floor(mode, dt, dev.type))
            split["used"] = dt in args.split_dtypes.split(",")
            section["emax"].setdefault(mode, {})[dt] = split["emax"] if split["used"] else val
            section.setdefault("emax_var", {}).setdefault(mode, {})[dt] = split["emax_var"] if split["used"] else val
            section["measured"].setdefault(mode, {})[dt] = {
                "protocol_max": p, "protocol_max_over_u": p / u,
                "protocol_per_shape": {"x".join(map(str, k)): v for k, v in prot["per_shape"].items()},
                "protocol_rows": prot["samples"], "slack_max": s, "slack_per_dist": slack,
                "slack_per_dist_shape": slack_shape, "chosen": val, "split": split,
            }
            if trend:
                section["measured"][mode][dt]["slack_trend"] = trend
                section["measured"][mode][dt]["split_trend"] = split_trend(trend_rows, split["emax"],
                                                                           split["emax_var"], args.slack_margin)
            est = "outlier" if args.xvar else "bound"
            print(f"{name} {est} {mode:11s} {dt:8s}: P {p:.3e} ({p / u:.2f}u)  S {s:.3e}  -> e_max {val:.3g}; "
                  f"split: e_det {split['emax']:.3g}, e_var {split['emax_var']:.3g} (margin {split['min_margin']:.2f})"
                  f"   [{prot['samples']} rows, {time.time() - t0:.1f}s]", flush=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=1) + "\n")
    load_emax_table.cache_clear()
    print(f"wrote {path}")
    return table


if __name__ == "__main__":
    main()
