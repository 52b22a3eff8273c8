"""x's outlier variance estimate in the checked GEMM's group threshold (``Options.gemm_xvar``,
``FTT_GEMM_XVAR=1``; `gemm_checksums.row_stats` with ``xvar``, `gemm_checksums.xvar_estimate`).

* The estimate lies between the row's variance and SPEC §5's Bhatia–Davis bound on Gaussian rows, rows
  with one outlier and rows with a large mean and a tiny spread (where fp32's Σx²/K − μ² cancels, and
  the guard `gemm_checksums.xvar_guard` keeps it above the variance: the proof's inequality is checked).
* Every path computes it: the kernels' thresholds (the group verification after the tile GEMM, read with
  ``gemm_residuals``; the decode kernel, whose threshold is pinned by a detection boundary on exact data)
  and the reference path's equal a float64 computation of the estimate to fp32 rounding.
* With the switch on, clean calls count nothing (M = 1, 16, 130; a ragged last group), a single exponent
  flip at ``linear.output`` is found and repaired, and a flip whose change lies between the estimate's
  threshold and the bound's is detected with the switch on and missed without it.
* The e_max tables: the entry calibrated for the estimate in use (`vabft.default_emax`).

Without CUDA the kernels run under the Triton interpreter (as in ``tests/test_abft_gemm.py``).
"""

from __future__ import annotations

import importlib
import math
import os
import sys
import warnings
from pathlib import Path

import pytest
import torch
from interpreted import interpreted_tests
from thresholds64 import bound64, xvar64

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from ft_transformers.kernels import abft_gemm as G  # noqa: E402
from ft_transformers.kernels import gemm_checksums as gcs  # noqa: E402
from ft_transformers.kernels.gemm_checksums import (  # noqa: E402
    group_checksums,
    group_threshold,
    row_stats,
    xvar_in_use,
)
from ft_transformers.kernels.options import override  # noqa: E402

from ft_transformers.counters import FaultStats, new_counters  # noqa: E402
from ft_transformers.injection import FaultPlan, FaultSpec  # noqa: E402
from ft_transformers.vabft import gemm_emax  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from calibrate_emax import DISTRIBUTIONS, sample_matrix  # noqa: E402

_cl = importlib.import_module("ft_transformers.checked_linear")
_vabft = importlib.import_module("ft_transformers.vabft")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
SUBPROCESS = DEV == "cpu" and not G.interpreting()
SITE = "linear.output"
GC = 64
U = 2.0**-24
_ITY = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}

_interpreter_available, test_interpreted_in_subprocess = interpreted_tests(__file__, SUBPROCESS, timeout=900)


@pytest.fixture
def xvar_on():
    with override(gemm_xvar=True):
        yield


def _thr64(x, w, b, emax, xvar: bool) -> torch.Tensor:
    """(M, ⌈N/64⌉) float64 group thresholds of x (M, K) and w (N, K) under either estimate."""
    mu, var = (xvar64 if xvar else bound64)(x)
    consts = group_checksums(w.cpu(), None if b is None else b.cpu())[1].double()
    return group_threshold(mu[:, None], var[:, None], consts, emax, 2.5)


def _stats(counters) -> dict:
    """The (sites, kinds) counter block as ``{kind: count}``."""
    return dict(FaultStats(counters))


def _call(x, w, b=None, *, backend, spec=None, emax=None, correct=True):
    """One checked call on ``backend`` ("triton" or "reference"): (y, counts)."""
    cnt = new_counters(x.device)
    with torch.no_grad():
        y = _cl._checked_linear_forward(x, w, b, weight_is_kn=False, emax=emax, csigma=2.5, detect=True,
                                        correct=correct, plan=FaultPlan(spec) if spec else None, counters=cnt,
                                        backend=backend)
    return y, _stats(cnt)


def _flip(v: torch.Tensor, bit: int) -> torch.Tensor:
    """``v`` (a 0-d tensor) with ``bit`` of its storage flipped."""
    iv = v.view(_ITY[v.dtype]).clone()
    iv ^= torch.tensor(1 << bit, dtype=torch.int64).to(iv.dtype)
    return iv.view(v.dtype)


def _position(spec, m, n, dtype):
    """The (row, col) a one-flip ``spec`` hits in an (M, N) output of ``dtype``, as every path draws it."""
    ((r, c),) = FaultPlan(spec).for_site(SITE, (m, n), dtype, DEV).positions.tolist()
    return r, c


# --------------------------------------------------------------------------- the estimate itself


def _rows(k: int, seed: int) -> dict[str, torch.Tensor]:
    """fp32 rows of K values by kind: Gaussian (64, K), Gaussian with one outlier of 60 (64, K), zeros with
    one value (4, K), and means of 100 to 3,000 with spreads of 1e-3 and 1e-2 (64, K)."""
    g = torch.Generator().manual_seed(seed)
    gauss = 4 * torch.randn(64, k, generator=g)
    outlier = torch.randn(64, k, generator=g)
    outlier[torch.arange(64), torch.randint(0, k, (64,), generator=g)] = 60.0
    lone = torch.zeros(4, k)
    lone[:, 3] = torch.tensor([1.0, 100.0, -7.0, 1e4])
    means = torch.tensor([1e2, 1e3, 3e3, -2e3]).repeat_interleave(16)[:, None]
    spread = torch.tensor([1e-3, 1e-2]).repeat(32)[:, None]
    shifted = means + spread * torch.randn(64, k, generator=g)  # |μ| ≫ σ: fp32's Σx²/K − μ² cancels
    return {"gaussian": gauss, "one outlier": outlier, "lone value": lone, "large mean": shifted}


@pytest.mark.parametrize("k", [576, 896])
def test_estimate_between_variance_and_bound(k):
    """On every kind of row (x (64, K) each): the row's variance ≤ the estimate ≤ the bound at the estimate's
    mean (the estimate as `row_stats` computes it in fp32; the variance exact, of the fp32 values; to the
    bound's own rounding where they meet). Gaussian rows get 1.2-2× their variance where the bound gives
    more than 4×. Rows with |μ| ≫ σ: fp32's Σx²/K − μ² is within the proof's (3K + 7)·u·Σx²/K of the
    variance (`xvar_guard`), at or below 0 on some rows, where the guard is what keeps the estimate above
    the variance (the outlier term alone is below it there)."""
    for kind, x in _rows(k, seed=k).items():
        mean, est = row_stats(x, xvar=True)
        bound = ((x.amax(1) - mean) * (mean - x.amin(1))).clamp_min(0)  # the bound at the estimate's mean
        v = x.double().var(1, unbiased=False)
        # (≥ the variance less the fp32 rounding of the bound, where the estimate is the bound: a row of two
        # values, whose bound is its variance)
        assert (est.double() >= v * (1 - 16 * U)).all(), (kind, (est.double() / v).min())
        assert (est <= bound).all(), (kind, (est / bound).max())
        if kind == "gaussian":
            ratio = est.double() / v
            assert 1.2 <= float(ratio.min()) and float(ratio.max()) <= 2.0, ratio
            assert float((bound.double() / v).min()) > 4
        if kind == "large mean":
            inv_k = torch.tensor(1.0 / k, dtype=torch.float32)
            m2 = x.square().sum(1) * inv_k
            mu = x.sum(1) * inv_k
            raw = m2 - mu * mu  # as `xvar_estimate` forms it
            assert ((raw.double() - v).abs() <= (3 * k + 7) * U * m2.double()).all()
            outlier_term = (torch.maximum(x.amax(1) - mu, mu - x.amin(1)).double() ** 2) / math.sqrt(k)
            cancelled = (raw <= 0) & (outlier_term < v)
            assert int(cancelled.sum()) >= 4, int(cancelled.sum())  # the rows only the guard covers


def test_estimate_overflow_and_constant_rows():
    """Rows whose squares overflow fp32 take the bound (finite); a constant row gets 0, like the bound."""
    x = torch.full((3, 100), 7.0)
    x[1, :50] = 3e19
    x[2, 0] = -2e19
    est = row_stats(x, xvar=True)[1]
    bound = row_stats(x)[1]
    assert est[0] == 0 and bound[0] == 0
    assert torch.equal(est[1:], bound[1:]) and torch.isfinite(est).all()


def test_switch_resolution(monkeypatch):
    """Auto (``None``): `XVAR_AUTO_CPU` on the CPU; on CUDA the registered rule per (dtype, mode), never
    without a dtype; ``FTT_GEMM_XVAR`` forces either everywhere."""
    for auto_cpu in (False, True):
        monkeypatch.setattr(gcs, "XVAR_AUTO_CPU", auto_cpu)
        with override(gemm_xvar=None):
            assert xvar_in_use("cpu") is auto_cpu and xvar_in_use("cuda") is False
    monkeypatch.setattr(gcs, "_XVAR_AUTO_CUDA", lambda dt, mode: dt == torch.float16 and mode == "accumulator")
    with override(gemm_xvar=None):
        assert xvar_in_use("cuda", torch.float16) is True
        assert xvar_in_use("cuda", torch.float16, "output") is False and xvar_in_use("cuda", torch.bfloat16) is False
    for forced in (False, True):
        with override(gemm_xvar=forced):
            assert xvar_in_use("cpu") is forced and xvar_in_use("cuda") is forced
            assert xvar_in_use("cuda", torch.bfloat16, "output") is forced


def test_cuda_auto_rule_reads_the_device_table(monkeypatch):
    """The rule `ft_transformers.vabft` registers: the outlier estimate where the current device's shipped
    table holds its entry. The H100's and the H200's tables (each recalibrated on its GPU) have fp16/bf16
    accumulator entries and nothing else; an unknown GPU of the same capability takes the H100's table
    (the first by name), entries included; one of another capability has no table and keeps the bound."""
    import ft_transformers.vabft as vb

    assert gcs._XVAR_AUTO_CUDA is vb._xvar_calibrated
    for name, cap, expect in (("NVIDIA H200", (9, 0), True), ("NVIDIA H100 80GB HBM3", (9, 0), True),
                              ("NVIDIA H20", (9, 0), True), ("NVIDIA A100-SXM4-80GB", (8, 0), False)):
        monkeypatch.setattr(vb, "_cuda_name", lambda i, name=name: name)
        monkeypatch.setattr(vb, "_cuda_capability", lambda i, cap=cap: cap)
        vb._xvar_calibrated_on.cache_clear()
        try:
            for dt in (torch.float16, torch.bfloat16):
                assert vb._xvar_calibrated_on(0, dt, "accumulator") is expect, (name, dt)
                assert vb._xvar_calibrated_on(0, dt, "output") is False, (name, dt)
            assert vb._xvar_calibrated_on(0, torch.float32, "accumulator") is False
        finally:
            vb._xvar_calibrated_on.cache_clear()


def test_emax_entry_follows_the_estimate(monkeypatch):
    """`default_emax` and `gemm_emax` take the table's entry for the estimate in use (``"xvar"`` section for
    the outlier estimate); a table without it gives the bound's entry, with one warning."""
    table = {"device": "fake", "emax": {"accumulator": {"float16": 1e-4}, "output": {"float32": 2e-6}},
             "xvar": {"emax": {"accumulator": {"float16": 3e-4}}}, "k_ref": 8192,
             "k_scaling": {"accumulator": "linear", "output": "sqrt"}}
    monkeypatch.setattr(_vabft, "_table_for", lambda dev: table)
    monkeypatch.setattr(_vabft, "_GEMM_EMAX", {})
    monkeypatch.setattr(_vabft, "_XVAR_WARNED", set())
    f16, f32 = torch.float16, torch.float32
    assert _vabft.default_emax(f16, "cuda", "accumulator", xvar=False) == 1e-4
    assert _vabft.default_emax(f16, "cuda", "accumulator", xvar=True) == 3e-4
    with override(gemm_xvar=True):
        assert _vabft.gemm_emax(f16, torch.device("cpu"), "accumulator", 64) == (3e-4, 3e-4)
        with pytest.warns(RuntimeWarning, match="outlier variance"):
            assert _vabft.default_emax(f32, "cpu", "output") == 2e-6
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert _vabft.default_emax(f32, "cpu", "output") == 2e-6  # warned once
    with override(gemm_xvar=False):
        assert _vabft.gemm_emax(f16, torch.device("cpu"), "accumulator", 64) == (1e-4, 1e-4)


# --------------------------------------------------------------------------- every path, the same thresholds


def _mixed_rows(m: int, k: int, dtype, seed: int) -> torch.Tensor:
    """x (M, K) of Gaussian rows, every third with one outlier, every fifth with a large mean."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x[::3, 5] = 40.0
    x[1::5] = 30.0 + 0.05 * x[1::5]
    return x.to(dtype).to(DEV)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m", [40, 130], ids=["split-verify", "three-row-blocks"])
def test_verification_and_reference_thresholds_equal_float64(dtype, m, xvar_on):
    """The group verification's thresholds (`gemm_residuals`, the tile form; M = 40 splits its K loop over
    programs under the interpreter) and the reference path's (`group_residuals`) with the switch on equal
    the float64 outlier estimate's, N = 130 (a last group of 2 columns), with a bias."""
    k, n = 256, 130
    x = _mixed_rows(m, k, dtype, seed=m)
    g = torch.Generator().manual_seed(7)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(dtype).to(DEV)
    b = torch.randn(n, generator=g).to(dtype).to(DEV)
    want = _thr64(x, w, b, 1.0, xvar=True)
    bound = _thr64(x, w, b, 1.0, xvar=False)
    assert float((bound / want).median()) > 1.5  # the estimate is what the thresholds follow
    res = G.gemm_residuals(x, w, b, emax=1.0)
    torch.testing.assert_close(res["thr"].double().cpu(), want, rtol=2e-5, atol=0)
    assert _stats(res["counters"])["detected"] == 0
    if dtype == torch.float32:  # the reference path: the fp32 product of the same operands
        _, thr = _cl.group_residuals(x, w, b, emax=1.0)
        torch.testing.assert_close(thr.double().cpu(), want, rtol=2e-5, atol=0)
    with override(gemm_xvar=False):
        res0 = G.gemm_residuals(x, w, b, emax=1.0)
    torch.testing.assert_close(res0["thr"].double().cpu(), bound, rtol=2e-5, atol=0)


def _exact_operands(m: int, k: int, n: int, dtype, seed: int):
    """x (M, K) and w (N, K) whose products and sums are exact in fp32 (small integers, w in 1/16ths): a
    clean check's difference is exactly 0, so a flip of change δ is detected iff |δ| > T. Gaussian-shaped
    rows, every odd one with one outlier of 100."""
    g = torch.Generator().manual_seed(seed)
    x = torch.round(3 * torch.randn(m, k, generator=g)).clamp(-12, 12)
    x[1::2, 11] = 100.0
    w = torch.randint(-4, 5, (n, k), generator=g).float() / 16
    return x.to(dtype).to(DEV), w.to(dtype).to(DEV)


@pytest.mark.parametrize("backend,dtype,m,n,split", [
    ("triton", torch.float16, 1, 130, None),  # the decode kernel, ROWS = 1
    ("triton", torch.bfloat16, 16, 130, None),  # the decode kernel, ROWS = 16
    ("triton", torch.float16, 5, 100, 2),  # the decode kernel, split-K
    ("triton", torch.float32, 40, 130, None),  # the tile form, split verification
    ("triton", torch.float16, 130, 130, None),  # the tile form, three row blocks
    ("reference", torch.float16, 16, 130, None),
], ids=["decode-1", "decode-16", "decode-split", "tile-fp32-split", "tile-130", "reference"])
def test_thresholds_pinned_by_a_detection_boundary(backend, dtype, m, n, split, xvar_on):
    """Each path's threshold, read from what it detects: on exact data a flip of change δ is detected iff
    |δ| > T, so with e_max = |δ| / T1 · (1 ± 1e-4) (T1: the float64 threshold with e_max = 1, outlier
    estimate) the call must count one detection just below and none just above. This pins the decode
    kernel's threshold, which nothing else reads out, to 1e-4 of float64's."""
    k = 256
    x, w = _exact_operands(m, k, n, dtype, seed=m + n)
    exact = x.double().cpu() @ w.double().cpu().t()
    t1 = _thr64(x, w, None, 1.0, xvar=True)
    tb = _thr64(x, w, None, 1.0, xvar=False)
    ctx = override(gemm_split=split) if split else override()
    tested = apart = 0
    with ctx:
        for seed in range(6):
            bit = 7 + seed % 3  # mantissa bits of fp16 (bf16: exponent bits 0-1): moderate changes
            spec = FaultSpec(site=SITE, bit=bit, count=1, seed=seed)
            r, c = _position(spec, m, n, dtype)
            delta = float(_flip(exact[r, c].to(dtype), bit).double() - exact[r, c])
            if delta == 0 or not math.isfinite(delta):
                continue
            e0 = abs(delta) / float(t1[r, c // GC])
            apart += float(tb[r, c // GC]) > 1.3 * float(t1[r, c // GC])  # the bound's threshold is elsewhere
            _, st_below = _call(x, w, backend=backend, spec=spec, emax=e0 * (1 - 1e-4), correct=False)
            _, st_above = _call(x, w, backend=backend, spec=spec, emax=e0 * (1 + 1e-4), correct=False)
            assert st_below["detected"] == 1 and st_above["detected"] == 0, (seed, r, c, st_below, st_above)
            tested += 1
    assert tested >= 3 and apart >= 2, (tested, apart)


# --------------------------------------------------------------------------- behaviour with the switch on


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_clean_calls_count_nothing(backend, dtype, xvar_on):
    """With the library's e_max tables (their entries for the outlier estimate): clean calls at M = 1, 16
    and 130 (N = 130: a last group of 2 columns; with a bias) count nothing, over the four distributions
    of the V-ABFT specification and the mixed rows of `_mixed_rows`."""
    k, n = 256, 130
    totals = {}
    for i, m in enumerate((1, 16, 130)):
        g = torch.Generator().manual_seed(50 + i)
        for dist in (*DISTRIBUTIONS[:4], "mixed"):
            if dist == "mixed":
                x = _mixed_rows(m, k, dtype, seed=60 + i)
            else:
                x = sample_matrix(dist, (m, k), g).to(dtype).to(DEV)
            w = (sample_matrix("N(1e-6,1)", (n, k), g) * k**-0.5).to(dtype).to(DEV)
            b = sample_matrix("N(1e-6,1)", (n,), g).to(dtype).to(DEV)
            _, st = _call(x, w, b, backend=backend)
            for key, v in st.items():
                totals[key] = totals.get(key, 0) + v
            if backend == "triton" and m > 1:
                break  # (the interpreter is slow: one distribution per larger shape)
    assert totals and not any(totals.values()), totals


@pytest.mark.parametrize("backend,dtype", [("triton", torch.float16), ("triton", torch.float32),
                                           ("reference", torch.bfloat16)], ids=str)
def test_exponent_flip_found_and_repaired(backend, dtype, xvar_on):
    """A single 0→1 flip of an exponent bit at ``linear.output`` (M = 1, 16, 130) is detected, located and
    corrected with the switch on; y comes back as the clean call's."""
    k, n = 128, 130
    bit = {torch.float16: 13, torch.bfloat16: 13, torch.float32: 27}[dtype]
    checked = 0
    for m in (1, 16, 130):
        g = torch.Generator().manual_seed(m)
        x = torch.randn(m, k, generator=g).to(dtype).to(DEV)
        w = (torch.randn(n, k, generator=g) * k**-0.5).to(dtype).to(DEV)
        clean, st0 = _call(x, w, backend=backend)
        assert not any(st0.values()), st0
        for seed in range(40):
            spec = FaultSpec(site=SITE, bit=bit, count=1, seed=seed)
            r, c = _position(spec, m, n, dtype)
            v = clean[r, c]
            if not 0.05 < abs(float(v)) < 100 or (v.view(_ITY[dtype]) >> bit) & 1:
                continue  # a 0→1 flip of a moderate value
            y, st = _call(x, w, backend=backend, spec=spec)
            assert st["detected"] == 1 and st["corrected"] == 1, (m, seed, st)
            torch.testing.assert_close(y, clean, rtol=0, atol=float(clean.abs().max()) * 2e-3)
            checked += 1
            break
    assert checked == 3


@pytest.mark.parametrize("backend,dtype,m", [("triton", torch.float16, 1), ("triton", torch.float32, 20),
                                             ("reference", torch.float32, 4)], ids=str)
def test_outlier_estimate_detects_a_flip_the_bound_misses(backend, dtype, m):
    """Tightness: on Gaussian-shaped rows (exact data: clean differences are 0) a flip whose change lies
    between the outlier estimate's threshold and the bound's (each with the library's e_max for it) is
    missed with the switch off and detected with it on, on the decode kernel, the tile form and the
    reference path."""
    k, n = 256, 130
    x, w = _exact_operands(m, k, n, dtype, seed=3)
    x = x.clone()
    x[1::2, 11] = x[1::2, 12]  # Gaussian-shaped rows only
    exact = x.double().cpu() @ w.double().cpu().t()
    mode = "output" if backend == "reference" else "accumulator"
    e_dtype = torch.float32 if backend == "reference" else dtype
    with override(gemm_xvar=True):
        e_on = gemm_emax(e_dtype, x.device, mode, k)[0]
    with override(gemm_xvar=False):
        e_off = gemm_emax(e_dtype, x.device, mode, k)[0]
    t_on = _thr64(x, w, None, e_on, xvar=True)
    t_off = _thr64(x, w, None, e_off, xvar=False)
    found = None
    for seed in range(400):  # the first (position, mantissa bit) whose change lies between the thresholds
        for bit in range(23 if dtype == torch.float32 else 10 if dtype == torch.float16 else 7):
            spec = FaultSpec(site=SITE, bit=bit, count=1, seed=seed)
            r, c = _position(spec, m, n, dtype)
            delta = abs(float(_flip(exact[r, c].to(dtype), bit).double() - exact[r, c]))
            if 1.01 * float(t_on[r, c // GC]) < delta < float(t_off[r, c // GC]) / 1.01:
                found = spec
                break
        if found is not None:
            break
    assert found is not None, "no flip between the two thresholds"
    spec = found
    with override(gemm_xvar=False):
        _, st_off = _call(x, w, backend=backend, spec=spec, correct=False)
    with override(gemm_xvar=True):
        _, st_on = _call(x, w, backend=backend, spec=spec, correct=False)
    assert st_off["detected"] == 0 and st_on["detected"] == 1, (delta, st_off, st_on)
