"""The threshold's variance terms with their own unit error (`vabft.default_emax_var`, the tables'
``"emax_var"``; `gemm_checksums.scale_variance_terms`; `calibrate_emax.split_emax`).

* The scaled constants give ``e_max·(mean terms) + e_var·(variance terms)``, against float64 by hand.
* The kernels take the pair from the caller's table: the tile form's threshold (read with
  ``gemm_residuals``) equals float64; on the decode kernel and the tile form a flip whose change lies
  between the split threshold and the single-e_max one is detected with the pair and missed with e_max alone.
* The table lookup: ``"emax_var"`` of the section in use, grown with K as e_max is, e_max where none.
* The calibration's rule keeps every row within half its threshold and gives the smallest such e_var.

Without CUDA the kernels run under the Triton interpreter (as in ``tests/test_abft_gemm.py``).
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import pytest
import torch
from interpreted import interpreted_tests

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from ft_transformers.kernels import abft_gemm as G  # noqa: E402
from ft_transformers.kernels.gemm_checksums import (  # noqa: E402
    GROUP_CONSTS,
    group_checksums,
    group_threshold,
    scale_variance_terms,
)
from ft_transformers.kernels.options import override  # noqa: E402

from ft_transformers.counters import FaultStats, new_counters  # noqa: E402
from ft_transformers.injection import FaultPlan, FaultSpec  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from calibrate_emax import split_emax  # noqa: E402

_vabft = importlib.import_module("ft_transformers.vabft")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
SUBPROCESS = DEV == "cpu" and not G.interpreting()
SITE = "linear.output"
GC = 64
E_MAX, E_VAR = 2e-3, 2e-4
_ITY = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}

_interpreter_available, test_interpreted_in_subprocess = interpreted_tests(__file__, SUBPROCESS, timeout=600)


def _terms64(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, csigma: float = 2.5
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean terms, variance terms) (M, ⌈N/64⌉) float64 of SPEC §5's group threshold at e_max = 1, from the
    operands alone: x's row variance bounded by Bhatia–Davis, each group's exact column statistics."""
    x64, w64 = x.double().cpu(), w.double().cpu()
    mu = x64.mean(1)
    var = ((x64.amax(1) - mu) * (mu - x64.amin(1))).clamp_min(0.0)
    means, vars_ = [], []
    for g0 in range(0, w64.shape[0], GC):
        wg = w64[g0:g0 + GC]
        ng = wg.shape[0]
        mu_b, var_b = wg.mean(0), wg.var(0, unbiased=False)
        mt = ng * mu.abs() * mu_b.abs().sum()
        vt = (csigma * torch.sqrt(ng * mu**2 * var_b.sum() + ng**2 * var * (mu_b**2).sum())
              + csigma * ng**0.5 * var.sqrt() * var_b.sum().sqrt())
        if b is not None:
            bg = b.double().cpu()[g0:g0 + GC]
            mt = mt + ng * bg.mean().abs()
            vt = vt + csigma * ng**0.5 * bg.var(unbiased=False).sqrt()
        means.append(mt)
        vars_.append(vt)
    return torch.stack(means, 1), torch.stack(vars_, 1)


def _exact_operands(m: int, k: int, n: int, dtype, seed: int):
    """x (M, K) and w (N, K) whose products and sums are exact in fp32 (small integers, w in 1/16ths, a
    mean of about 1 in x so that both kinds of terms weigh): a clean check's difference is exactly 0."""
    g = torch.Generator().manual_seed(seed)
    x = torch.round(1 + 3 * torch.randn(m, k, generator=g)).clamp(-12, 12)
    w = torch.randint(-4, 5, (n, k), generator=g).float() / 16
    return x.to(dtype).to(DEV), w.to(dtype).to(DEV)


def _flip(v: torch.Tensor, bit: int) -> torch.Tensor:
    iv = v.view(_ITY[v.dtype]).clone()
    iv ^= torch.tensor(1 << bit, dtype=torch.int64).to(iv.dtype)
    return iv.view(v.dtype)


def test_scaled_constants_split_the_threshold():
    """`group_threshold` on `scale_variance_terms`' constants is e_max·(mean terms) + e_var·(variance terms)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(150, 40, generator=g) + 0.3
    b = torch.randn(150, generator=g)
    x = torch.randn(6, 40, generator=g) + 0.5
    consts = group_checksums(w, b)[1]
    scaled = scale_variance_terms(consts, E_VAR / E_MAX)
    assert scaled.shape == consts.shape == (3, GROUP_CONSTS)
    for col in (0, 1, 5, 7):  # the checksum, the mean terms and n_g stay
        assert torch.equal(scaled[:, col], consts[:, col])
    mu = x.double().mean(1, keepdim=True)
    var = ((x.double().amax(1, keepdim=True) - mu) * (mu - x.double().amin(1, keepdim=True)))
    got = group_threshold(mu, var, scaled.double(), E_MAX, 2.5)
    mt, vt = _terms64(x, w, b)
    torch.testing.assert_close(got, E_MAX * mt + E_VAR * vt, rtol=1e-5, atol=0)
    assert bool((got < group_threshold(mu, var, consts.double(), E_MAX, 2.5)).all())


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_tile_threshold_with_the_pair_against_float64(dtype):
    """``gemm_residuals`` with (e_max, e_var): the tile form's verification computes the split threshold."""
    x, w = _exact_operands(24, 96, 150, dtype, seed=1)
    b = (torch.randint(-8, 9, (150,)).float() / 8).to(dtype).to(DEV)
    with override(gemm_xvar=False):
        res = G.gemm_residuals(x, w, b, emax=E_MAX, emax_var=E_VAR)
    mt, vt = _terms64(x, w, b)
    torch.testing.assert_close(res["thr"].double().cpu(), E_MAX * mt + E_VAR * vt, rtol=1e-4, atol=0)
    assert float(res["d"].abs().max()) == 0.0  # exact data
    with pytest.raises(ValueError, match="emax_var goes with emax"):
        G.checked_gemm(x, w, b, emax_var=E_VAR, counters=new_counters(x.device))


@pytest.mark.parametrize("m", [1, 40], ids=["decode", "tile"])
def test_pair_from_the_table_detects_what_one_emax_misses(m):
    """A flip whose change lies between the split threshold and the single-e_max threshold: detected when the
    table gives (e_max, e_var), missed when it gives e_max alone, on the decode kernel and the tile form."""
    k, n, dtype = 256, 130, torch.float16
    x, w = _exact_operands(m, k, n, dtype, seed=3)
    exact = x.double().cpu() @ w.double().cpu().t()
    mt, vt = _terms64(x, w, None)
    t_split, t_one = E_MAX * mt + E_VAR * vt, E_MAX * (mt + vt)
    found = None
    for seed in range(400):
        for bit in range(10):
            spec = FaultSpec(site=SITE, bit=bit, count=1, seed=seed)
            ((r, c),) = FaultPlan(spec).for_site(SITE, (m, n), dtype, DEV).positions.tolist()
            delta = abs(float(_flip(exact[r, c].to(dtype), bit).double() - exact[r, c]))
            if 1.05 * float(t_split[r, c // GC]) < delta < float(t_one[r, c // GC]) / 1.05:
                found = spec
                break
        if found is not None:
            break
    assert found is not None, "no flip between the two thresholds"

    def detected(table) -> int:
        cnt = new_counters(x.device)
        with override(gemm_xvar=False):
            G.checked_gemm(x, w, None, emax_table=table, counters=cnt, plan=FaultPlan(found), correct=False)
        return dict(FaultStats(cnt))["detected"]

    assert detected(lambda dt, dev, mode, kk: (E_MAX, E_VAR)) == 1
    assert detected(lambda dt, dev, mode, kk: E_MAX) == 0


def test_table_lookup_of_the_variance_terms(monkeypatch):
    """`default_emax_var`: the ``"emax_var"`` entry of the section in use, grown with K as e_max is (linearly
    in accumulator mode here); e_max where the section has none; `gemm_emax` gives the pair."""
    table = {"device": "fake", "emax": {"accumulator": {"float16": 1e-4}},
             "emax_var": {"accumulator": {"float16": 2e-5}},
             "xvar": {"emax": {"accumulator": {"float16": 3e-4, "bfloat16": 5e-4}},
                      "emax_var": {"accumulator": {"float16": 4e-5}}},
             "k_ref": 8192, "k_scaling": {"accumulator": "linear", "output": "sqrt"}}
    monkeypatch.setattr(_vabft, "_table_for", lambda dev: table)
    monkeypatch.setattr(_vabft, "_GEMM_EMAX", {})
    f16, bf16 = torch.float16, torch.bfloat16
    ev = _vabft.default_emax_var
    assert ev(f16, "cuda", "accumulator", xvar=False) == 2e-5
    assert ev(f16, "cuda", "accumulator", xvar=True) == 4e-5
    assert ev(f16, "cuda", "accumulator", k=16384, xvar=True) == pytest.approx(8e-5)
    assert _vabft.default_emax(f16, "cuda", "accumulator", k=16384, xvar=True) == pytest.approx(6e-4)
    assert ev(bf16, "cuda", "accumulator", xvar=True) == 5e-4  # no split: e_max
    with override(gemm_xvar=True):
        assert _vabft.gemm_emax(f16, torch.device("cpu"), "accumulator", 64) == (3e-4, 4e-5)
        assert _vabft.gemm_emax(bf16, torch.device("cpu"), "accumulator", 64) == (5e-4, 5e-4)


def test_calibration_rule_keeps_every_row_within_half_its_threshold():
    """`split_emax` on zero-mean rows (the variance terms set |D|) and positive-mean rows (the mean terms do,
    the variance terms weighing a few %): e_var = 2·max |D| / V of the zero-mean rows (at least the floor,
    at most e_max); e_det the smallest value ≥ e_max keeping every row's threshold ≥ 2·|D| (1 % less breaks
    it), several times e_var; an all-zero-mean calibration keeps e_max for the mean terms."""
    g = torch.Generator().manual_seed(0)
    v = torch.rand(300, generator=g) + 0.1
    m_zero = 1e-3 * v  # the mean terms of zero-mean rows are small
    m_pos = 40 * v * (torch.rand(300, generator=g) + 0.5)
    d_zero = 5e-6 * v * torch.rand(300, generator=g)
    d_pos = 5e-5 * (m_pos + v) * torch.rand(300, generator=g)
    rows = [("U(-1,1)", d_zero, m_zero, v, 1024), ("|N(1,1)|", d_pos, m_pos, v, 1024)]
    e_max = 2 * float((d_pos / (m_pos + v)).max())  # the single-value rule: 2 x the largest |D| / T1
    res = split_emax(rows, e_max, 2.0, 0.0)
    e_det, e_var = res["emax"], res["emax_var"]
    assert e_var == pytest.approx(2 * float((d_zero / v).max()), rel=1e-2)
    assert e_det >= e_max and e_var < e_det / 5
    for _, d, m, vv, _ in rows:
        assert bool((e_det * m.double() + e_var * vv.double() >= 2 * d.double() * (1 - 1e-6)).all())
    assert res["min_margin"] >= 2 * (1 - 1e-6)
    assert any(bool((0.99 * e_det * m + e_var * vv < 2 * d).any()) for _, d, m, vv, _ in rows)
    assert split_emax(rows, e_max, 2.0, 5e-5)["emax_var"] == 5e-5  # the floor
    assert split_emax(rows, 1e-9, 2.0, 0.0)["emax_var"] == 1e-9  # never above e_max
    assert split_emax(rows[:1], 1e-4, 2.0, 0.0)["emax"] == 1e-4


def test_shipped_h100_table_splits_both_dtypes():
    """The H100 table: fp16's and bf16's accumulator-side entries are each a split whose calibration rows all
    kept half their threshold (recalibrated on the exact verification, docs/reliability.md), and the table's
    pair is the calibration's."""
    table = _vabft.load_emax_table("NVIDIA H100 80GB HBM3")
    sect = table["xvar"]
    for dt in ("bfloat16", "float16"):
        e, ev = sect["emax"]["accumulator"][dt], sect["emax_var"]["accumulator"][dt]
        split = sect["measured"]["accumulator"][dt]["split"]
        assert split["used"] is True
        assert split["min_margin"] >= 2.0 and split["emax_var"] <= split["emax"]
        assert (e, ev) == (split["emax"], split["emax_var"])
        assert ev < e / 3
