"""V-ABFT thresholds, weight checksums, their cache and the e_max table (against float64 references)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from ft_transformers.vabft import (
    WeightChecksums,
    default_emax,
    row_stats,
    vabft_threshold,
    weight_checksums,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from calibrate_emax import main as calibrate_main  # noqa: E402
from calibrate_emax import protocol_emax, threshold_slack  # noqa: E402


def _threshold_f64(a: torch.Tensor, b: torch.Tensor, emax: float, csigma: float) -> torch.Tensor:
    """SPEC §5 written out directly in float64, row by row of A and B."""
    a = a.double()
    b = b.double()
    k, n = b.shape
    out = []
    mu_b = [b[i].mean().item() for i in range(k)]
    var_b = [max(0.0, (b[i].max().item() - mu_b[i]) * (mu_b[i] - b[i].min().item())) for i in range(k)]
    s_abs_mu = sum(abs(v) for v in mu_b)
    s_var = sum(var_b)
    s_mu2 = sum(v * v for v in mu_b)
    for row in a:
        mu = row.mean().item()
        var = max(0.0, (row.max().item() - mu) * (mu - row.min().item()))
        t = (n * abs(mu) * s_abs_mu
             + csigma * math.sqrt(n * mu * mu * s_var + n * n * var * s_mu2)
             + csigma * math.sqrt(n) * math.sqrt(var) * math.sqrt(s_var))
        out.append(emax * t)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shift", [0.0, 1.0, -3.0])
def test_vabft_threshold_matches_float64_formula(dtype, shift):
    g = torch.Generator().manual_seed(7)
    a = (torch.randn(9, 40, generator=g) + shift).to(dtype)
    b = (torch.rand(40, 23, generator=g) * 2 - 1 + 0.3 * shift).to(dtype)
    got = vabft_threshold(a, b, emax=2.2e-6, csigma=2.5)
    assert got.shape == (9,) and got.dtype == torch.float32
    ref = _threshold_f64(a, b, 2.2e-6, 2.5)
    torch.testing.assert_close(got.double(), ref, rtol=2e-5, atol=0)
    # csigma enters the variance terms only; emax scales everything.
    ref2 = _threshold_f64(a, b, 1e-3, 4.0)
    torch.testing.assert_close(vabft_threshold(a, b, emax=1e-3, csigma=4.0).double(), ref2, rtol=2e-5, atol=0)


def test_vabft_threshold_constant_rows_and_validation():
    a = torch.full((3, 8), 2.0)
    b = torch.full((8, 5), -1.0)
    # σ = 0 everywhere: only the deterministic term N·|μ_A|·Σ|μ_B| = 5·2·8 remains.
    torch.testing.assert_close(vabft_threshold(a, b, emax=1.0), torch.full((3,), 80.0))
    with pytest.raises(ValueError, match="inner dimensions"):
        vabft_threshold(a, torch.zeros(7, 5), emax=1.0)
    with pytest.raises(ValueError, match="2-D"):
        vabft_threshold(a[0], b, emax=1.0)
    with pytest.raises(ValueError, match="emax"):
        vabft_threshold(a, b, emax=0.0)
    with pytest.raises(TypeError, match="floating"):
        vabft_threshold(a.long(), b, emax=1.0)


def test_row_stats_bhatia_davis_bounds_the_variance():
    g = torch.Generator().manual_seed(1)
    samples = (torch.randn(50, 300, generator=g), torch.rand(50, 300, generator=g),
               torch.randn(50, 3, generator=g))
    for t in samples:
        mean, var = row_stats(t)
        torch.testing.assert_close(mean, t.mean(-1))
        assert bool((var >= t.var(-1, unbiased=False) * (1 - 1e-5)).all())
    # Two-point data attains the bound exactly.
    t = torch.tensor([[0.0, 4.0] * 10])
    assert row_stats(t)[1].item() == pytest.approx(4.0)


@pytest.mark.parametrize("kn", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_weight_checksums_shape_and_finiteness(kn, with_bias):
    g = torch.Generator().manual_seed(3)
    n, k = 37, 29
    w_nk = torch.randn(n, k, generator=g) + 0.5
    bias = torch.randn(n, generator=g) if with_bias else None
    w = w_nk.t().contiguous() if kn else w_nk
    wc = WeightChecksums.compute(w, bias, weight_is_kn=kn)
    assert (wc.n, wc.k, wc.finite) == (n, k, True)
    for bad in (float("inf"), float("nan")):
        w_bad = w.clone()
        w_bad[-1, -1] = bad
        assert WeightChecksums.compute(w_bad, bias, weight_is_kn=kn).finite is False
    if with_bias:
        b_bad = bias.clone()
        b_bad[3] = float("-inf")
        assert WeightChecksums.compute(w, b_bad, weight_is_kn=kn).finite is False


def test_weight_checksum_cache_refreshes_on_inplace_update():
    lin = torch.nn.Linear(16, 8)
    w, b = lin.weight, lin.bias
    first = weight_checksums(w, b, cache_owner=lin)
    assert weight_checksums(w, b, cache_owner=lin) is first  # cache hit
    with torch.no_grad():
        w.mul_(2.0)  # bumps the version counter
    second = weight_checksums(w, b, cache_owner=lin)
    assert second is not first and second.finite
    with torch.no_grad():
        b[0] = float("nan")  # an in-place update the rebuilt entry must see
    third = weight_checksums(w, b, cache_owner=lin)
    assert third is not second and not third.finite
    with torch.no_grad():
        b[0] = 0.0
    # A new Parameter object (e.g. after .to() or reassignment) is never served from the cache.
    lin.weight = torch.nn.Parameter(w.detach().clone())
    assert weight_checksums(lin.weight, b, cache_owner=lin) is not third
    # A different dtype view (autocast) gets its own slot.
    cast = weight_checksums(lin.weight, b, cache_owner=lin, cast=torch.bfloat16)
    assert cast is not weight_checksums(lin.weight, b, cache_owner=lin)
    assert cast is weight_checksums(lin.weight, b, cache_owner=lin, cast=torch.bfloat16)


def test_cache_does_not_break_pickling_or_copies():
    import copy
    import io

    lin = torch.nn.Linear(8, 4)
    wc = weight_checksums(lin.weight, lin.bias, cache_owner=lin)
    buf = io.BytesIO()
    torch.save(lin, buf)  # whole-module pickling: weakrefs in the cache must not leak into it
    buf.seek(0)
    lin2 = torch.load(buf, weights_only=False)
    assert len(lin2._ftt_vabft_checksums) == 0
    lin3 = copy.deepcopy(lin)
    assert len(lin3._ftt_vabft_checksums) == 0
    assert weight_checksums(lin3.weight, lin3.bias, cache_owner=lin3) is not wc
    assert weight_checksums(lin.weight, lin.bias, cache_owner=lin) is wc


def test_default_emax_table():
    assert default_emax(torch.bfloat16, "cpu") == 8e-3
    assert default_emax(torch.float16, "cuda") == 1e-3
    fp32 = default_emax(torch.float32, "cpu")
    assert 2.6e-7 < fp32 <= 2.2e-6  # above this CPU's measured max (4.4u), at most the V-ABFT specification's value
    assert default_emax(torch.float32, "cpu", k=4096) == fp32
    assert default_emax(torch.float32, "cpu", k=4 * 8192) == pytest.approx(2 * fp32)
    assert default_emax(torch.bfloat16, "cuda", k=10**6) == 8e-3  # low precision: constant in K
    # fused-kernel verification: fp32-level for every input dtype on the CPU; CUDA without a table
    # (the fallback): tensor-core accumulation, finer than the output but not fp32-level
    for dt in (torch.float16, torch.bfloat16):
        assert default_emax(dt, "cpu", mode="accumulator") < default_emax(dt, "cpu") / 100
        assert default_emax(dt, "cuda", mode="accumulator") < default_emax(dt, "cuda") / 4
    with pytest.raises(TypeError):
        default_emax(torch.float64)
    with pytest.raises(ValueError):
        default_emax(torch.float32, mode="fused")
    prev = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")  # TF32 allowed: fp32 GEMMs are fp16-accurate
        assert default_emax(torch.float32, "cuda") == 1e-3
        assert default_emax(torch.float32, "cpu") == 1e-3
        torch.set_float32_matmul_precision("medium")  # bf16 inside fp32 GEMMs on CPU, TF32 on CUDA
        assert default_emax(torch.float32, "cpu") == 8e-3
        assert default_emax(torch.float32, "cuda") == 1e-3
    finally:
        torch.set_float32_matmul_precision(prev)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_calibration_protocol_stays_below_the_table(dtype):
    res = protocol_emax(dtype, "cpu", shapes=((32, 256, 128), (16, 1024, 256)), trials=4)
    assert res["samples"] == 4 * (32 + 16)
    assert 0 < res["max"] < default_emax(dtype, "cpu")
    assert res["emax"] == pytest.approx(1.2 * res["max"])


def test_emax_tables_ship_with_the_package_and_are_loaded(tmp_path, monkeypatch):
    import json

    from ft_transformers import vabft

    assert vabft.device_slug("NVIDIA H100 80GB HBM3") == "nvidia_h100_80gb_hbm3"
    table = vabft.load_emax_table("cpu")
    assert table is not None and table["device"] == "cpu"
    for mode in ("output", "accumulator"):
        for name, dt in (("float32", torch.float32), ("float16", torch.float16), ("bfloat16", torch.bfloat16)):
            assert default_emax(dt, "cpu", mode) == table["emax"][mode][name]
            assert table["emax"][mode][name] >= vabft.builtin_emax(dt, "cpu", mode)  # calibration only raises
    # a table written elsewhere is picked up by name; malformed entries are refused
    monkeypatch.setattr(vabft, "EMAX_TABLE_DIR", tmp_path)
    vabft.load_emax_table.cache_clear()
    try:
        (tmp_path / "cpu.json").write_text(json.dumps({"device": "cpu", "emax": {"output": {"float16": 3e-3}},
                                                        "k_ref": 1024, "k_scaling": {"accumulator": "linear"}}))
        vabft.load_emax_table.cache_clear()
        assert default_emax(torch.float16, "cpu") == 3e-3
        assert default_emax(torch.bfloat16, "cpu") == vabft.builtin_emax(torch.bfloat16, "cpu")  # no entry
        (tmp_path / "cpu.json").write_text(json.dumps({"device": "cpu", "emax": {"output": {"float16": -1}}}))
        vabft.load_emax_table.cache_clear()
        with pytest.raises(ValueError, match="positive"):
            default_emax(torch.float16, "cpu")
    finally:
        vabft.load_emax_table.cache_clear()


def test_cuda_device_without_a_table_takes_its_architectures(monkeypatch):
    """A CUDA device with no table of its own uses the shipped table of a device with the same compute
    capability (an H20, which ships none, computes as the H100 whose table ships), the entry of the variance
    estimate in use included (auto: the outlier estimate's where that table holds it); a device of another
    capability gets the built-ins, whose fp16/bf16 accumulator entries are above every calibrated one (2e-5 for every
    dtype would be below the fp16 slack the H100's calibration measured, 5.1e-5)."""
    import functools
    import json

    from ft_transformers import vabft

    h100 = json.loads((vabft.EMAX_TABLE_DIR / "nvidia_h100_80gb_hbm3.json").read_text())
    assert h100["capability"] == [9, 0]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(vabft, "_cuda_name", lambda index: "NVIDIA H20")
    # a fresh cache of the outlier-estimate rule: device 0's answer as the names patched here give it
    monkeypatch.setattr(vabft, "_xvar_calibrated_on", functools.cache(vabft._xvar_calibrated_on.__wrapped__))
    for cap, want in (((9, 0), h100["emax"]), ((8, 0), None)):
        monkeypatch.setattr(vabft, "_cuda_capability", lambda index, cap=cap: cap)
        for mode in ("output", "accumulator"):
            for name, dt in (("float32", torch.float32), ("float16", torch.float16), ("bfloat16", torch.bfloat16)):
                got = default_emax(dt, "cuda", mode)
                held = h100.get("xvar", {}).get("emax", {}).get(mode, {}).get(name)  # auto takes it where held
                expect = (held or want[mode][name]) if want else vabft.builtin_emax(dt, "cuda", mode)
                assert got == expect, (cap, mode, name, got)
    for name, dt in (("float16", torch.float16), ("bfloat16", torch.bfloat16)):
        assert vabft.builtin_emax(dt, "cuda", "accumulator") > h100["emax"]["accumulator"][name]
    assert vabft.builtin_emax(torch.float32, "cuda", "accumulator") == 2e-5


def test_calibration_slack_per_shape_and_its_trend(tmp_path):
    """The slack's maximum per distribution is the maximum over its shapes; ``--trend-k`` records the slack at
    more K values beside the entry without moving the chosen e_max."""
    per: dict = {}
    shapes = ((16, 64, 64), (16, 512, 64))
    got = threshold_slack(torch.float32, "cpu", shapes=shapes, trials=2, per_shape=per)
    assert set(per) == set(got)
    for dist, ratios in per.items():
        assert set(ratios) == {"16x64x64", "16x512x64"}
        assert max(ratios.values()) == got[dist] > 0

    # (output side: the accumulator side runs the Triton kernel when the suite interprets, far slower here)
    args = ["--device", "cpu", "--trials", "1", "--slack-trials", "1", "--modes", "output", "--dtypes",
            "float32", "--out-dir", str(tmp_path)]
    plain = calibrate_main(args)["measured"]["output"]["float32"]
    trend = calibrate_main(args + ["--trend-k", "128,1024"])["measured"]["output"]["float32"]
    assert "slack_trend" not in plain
    assert set(trend["slack_trend"]) == set(trend["slack_per_dist"])
    assert all(set(v) == {"64x128x1024", "64x1024x1024"} for v in trend["slack_trend"].values())
    assert trend["chosen"] == plain["chosen"] and trend["slack_per_dist_shape"] == plain["slack_per_dist_shape"]
