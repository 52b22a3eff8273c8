"""The fused Triton V-ABFT checked GEMM (``ft_transformers.kernels.abft_gemm``).

Every form checks each (row, 64-column group) of y against its own threshold and counts events per
such unit: the decode kernel (M ≤ 16, fp16/bf16) inside its tiles, the tile and persistent GEMMs
through the group verification launched after them (`groups._group_verify_kernel`), and the cuBLAS form
(fp16/bf16, ``Options.gemm_cublas``) through its check (`product_check`) of cuBLAS's fp32 product and
checksum dots (under the interpreter the upcast fp32 products, `calls.fp32_product`).

Oracles: float64 ``torch.matmul`` for the values and for the verification quantities (group sums,
checksums, thresholds), and the PyTorch checked path (``backend="reference"``, which verifies the
same units of the fp32 product) for the counters under injection: same site, positions and bits.

Without CUDA the kernels run under the Triton interpreter (``TRITON_INTERPRET=1``, set before triton
is imported) on small shapes; when another module imported triton first (transformers does), the
file re-runs itself in a fresh process. ``gpu``-marked tests use real shapes on CUDA.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import os
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from cuda_graphs import captured
from interpreted import interpreted_tests
from thresholds64 import xvar64

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from ft_transformers.kernels import abft_gemm as G  # noqa: E402
from ft_transformers.kernels.abft_gemm import (  # noqa: E402
    calls,
    checksum_tiles,
    configs,
    decode,
    forms,
    groups,
    persistent,
    prepared,
    tile,
    tuning,
)
from ft_transformers.kernels.gemm_checksums import xvar_in_use  # noqa: E402
from ft_transformers.kernels.options import Options, override  # noqa: E402

import ft_transformers as ftt  # noqa: E402
from ft_transformers.counters import FaultStats, new_counters  # noqa: E402
from ft_transformers.injection import FaultPlan, FaultSpec  # noqa: E402
from ft_transformers.vabft import WeightChecksums, gemm_emax  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from calibrate_emax import sample_matrix  # noqa: E402

_cl = importlib.import_module("ft_transformers.checked_linear")
_vabft = importlib.import_module("ft_transformers.vabft")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
SUBPROCESS = DEV == "cpu" and not G.interpreting()
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPES16 = DTYPES[1:]  # the decode kernel's and the persistent form's (fp32 calls take the tile form)
DISTS = ["N(1e-6,1)", "N(1,1)", "U(-1,1)", "TN(0,1)"]
ULP = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}
GC = 64  # columns per check group (`gemm_checksums.GROUP_COLS`)
SITE = "linear.output"


# the kernel's entry with the library's e_max tables, as the checked linear passes them
checked_gemm = functools.partial(G.checked_gemm, emax_table=gemm_emax)


@pytest.fixture
def setopt():
    """``setopt(**fields)``: `Options` fields changed (`override`) until the test ends."""
    with contextlib.ExitStack() as stack:
        yield lambda **changes: stack.enter_context(override(**changes))


def _gemm_rel_tol(dtype, k):
    """Error bound relative to max|y| for a GEMM against float64: output rounding (4 ulp of the dtype)
    plus fp32 accumulation, whose rounding errors grow like sqrt(k)·u; a TF32 product (u = 2^-11)
    would exceed it more than tenfold."""
    return 4 * ULP[dtype] + 4 * k**0.5 * 2.0**-24


HIGH_BIT = {torch.float32: (27, 28, 29, 30), torch.float16: (12, 13, 14), torch.bfloat16: (11, 12, 13, 14)}
# bits whose flip changes a value of magnitude 0.05-100 by at least its own size and stays finite, either
# way: exponent bit 4 of fp32 (×2^16 or ÷2^16), bit 3 of fp16 (×2^8 or ÷2^8), bit 6 of bf16 (×2^64 or ÷2^64)
MID_BIT = {torch.float32: 27, torch.float16: 13, torch.bfloat16: 13}
_ITY = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


_interpreter_available, test_interpreted_in_subprocess = interpreted_tests(__file__, SUBPROCESS, timeout=900)


def _rand(shape, dtype, seed, scale=1.0, dist=None):
    g = torch.Generator().manual_seed(seed)
    t = sample_matrix(dist, shape, g) if dist else torch.randn(shape, generator=g)
    return (t * scale).to(dtype).to(DEV)


def _ref64(x, w, b=None, kn=False):
    w64 = w.double().cpu()
    y = x.double().cpu() @ (w64 if kn else w64.t())
    return y + b.double().cpu() if b is not None else y


def _run(x, w, b=None, *, kn=False, plan=None, correct=True, detect=True, mode="accumulator", emax=None, wc=None):
    cnt = new_counters(x.device)
    with torch.no_grad():
        y = checked_gemm(x, w, b, weight_is_kn=kn, plan=plan, counters=cnt, correct=correct, detect=detect,
                         mode=mode, emax=emax, wc=wc)
    return y, dict(FaultStats(cnt))


def _reference(x, w, b=None, spec=None, *, kn=False, correct=True, detect=True):
    """The PyTorch checked path (``backend="reference"``) on the same operands and faults: (y, counts)."""
    cnt = new_counters(x.device)
    with torch.no_grad():
        y = _cl._checked_linear_forward(x, w, b, weight_is_kn=kn, emax=None, csigma=2.5, detect=detect,
                                        correct=correct and detect, plan=FaultPlan(spec) if spec else None,
                                        counters=cnt, backend="reference")
    return y, dict(FaultStats(cnt))


ZERO = {"detected": 0, "corrected": 0, "recomputed": 0, "uncorrectable": 0, "nonfinite_input": 0}


def _group_sums64(y, n):
    """(M, ⌈N/64⌉) float64 sums of each row's 64-column groups of ``y`` (M, N)."""
    y64 = y.double().cpu()
    return F.pad(y64, (0, (-n) % GC)).view(y64.shape[0], -1, GC).sum(-1)


def _thr64(x, w_nk, b, emax, csigma=2.5, emax_var=None, xvar=False):
    """SPEC §5's threshold of every (row, 64-column group) in float64, from the operands alone: the
    V-ABFT threshold of ``x`` (M, K) times the group's rows of ``w_nk`` (N, K), plus the bias share of the
    group's bias values: x's row variance bounded as SPEC §5 bounds it (Bhatia–Davis, (max − μ)(μ − min)), or
    with ``xvar`` x's outlier estimate (`thresholds64.xvar64`), the weight groups' and the bias's exact
    (population) variances, as the library takes them. The mean terms take ``emax``, the variance terms
    ``emax_var`` (None: ``emax``)."""
    ev = emax if emax_var is None else emax_var
    x64, w64 = x.double().cpu(), w_nk.double().cpu()
    mu = x64.mean(1)
    var = xvar64(x64)[1] if xvar else ((x64.amax(1) - mu) * (mu - x64.amin(1))).clamp_min(0.0)
    out = []
    for g0 in range(0, w64.shape[0], GC):
        wg = w64[g0:g0 + GC]  # (n_g, K): per k, statistics over the group's rows
        ng = wg.shape[0]
        mu_b = wg.mean(0)
        var_b = wg.var(0, unbiased=False)
        mean_terms = ng * mu.abs() * mu_b.abs().sum()
        var_terms = (csigma * torch.sqrt(ng * mu**2 * var_b.sum() + ng**2 * var * (mu_b**2).sum())
                     + csigma * ng**0.5 * var.sqrt() * var_b.sum().sqrt())
        if b is not None:
            bg = b.double().cpu()[g0:g0 + GC]
            mean_terms = mean_terms + ng * bg.mean().abs()
            var_terms = var_terms + csigma * ng**0.5 * bg.var(unbiased=False).sqrt()
        out.append(emax * mean_terms + ev * var_terms)
    return torch.stack(out, 1)


def _positions(spec, m, n, dtype):
    """The (row, col) positions `spec` flips in an (M, N) output of ``dtype``, as both paths draw them."""
    return [tuple(p) for p in FaultPlan(spec).for_site(SITE, (m, n), dtype, DEV).positions.tolist()]


# the smallest |value| a test flips with `MID_BIT`: its change then exceeds any clean unit's threshold (on
# the GPU too, whose accumulator-side e_max is up to ~100× the CPU's)
MIN_FLIPPED = 0.05 if DEV == "cpu" else 0.5


def _seed_where(bit, count, m, n, dtype, ref, pattern):
    """The first seed whose ``count`` flips at ``bit`` land on distinct positions satisfying ``pattern``
    (a predicate of the positions) on values of magnitude MIN_FLIPPED-100 in ``ref`` (float64 y): flips of
    `MID_BIT` there change every value by at least its size, well above any threshold."""
    for seed in range(20000):
        pos = _positions(FaultSpec(site=SITE, bit=bit, count=count, seed=seed), m, n, dtype)
        if len(set(pos)) == count and pattern(pos) and all(MIN_FLIPPED < abs(float(ref[r, c])) < 100
                                                           for r, c in pos):
            return seed
    raise AssertionError("no seed gives the pattern")


# --------------------------------------------------------------------------- forms


FORMS = ("tile", "decode", "persistent", "cublas")
LAUNCHERS = ("_GEMM_LAUNCH", "_VERIFY_LAUNCH", "_GROUPED_LAUNCH", "_PERSISTENT_LAUNCH", "_product_launch",
             "_CHECK_LAUNCH")  # (the cuBLAS form's checksum programs launch inside _product_launch)
LAUNCHED = {"tile": [0, 1], "decode": [2], "persistent": [3, 1], "cublas": [4, 5]}  # each form's launchers, in order


def _launched(monkeypatch) -> list:
    """Wrap the six launchers of `calls`; returns the list their indices are appended to as they launch
    (0 the tile GEMM, 1 the group verification, 2 the decode kernel, 3 the persistent GEMM, 4 the cuBLAS
    form's product with its checksum programs, 5 its check)."""
    seen = []
    for which, name in enumerate(LAUNCHERS):
        real = getattr(calls, name)

        def spy(grid, args, kwargs, which=which, real=real):
            seen.append(which)
            return real(grid, args, kwargs)

        monkeypatch.setattr(calls, name, spy)
    return seen


def _take(form, setopt) -> int:
    """Make checked calls take ``form`` and return the rows of x its tests use: the decode kernel takes
    fp16/bf16 calls of M ≤ 16 rows, the tile form fp32 calls and calls of more rows, the persistent form
    (forced here) fp16/bf16 calls of more rows, the cuBLAS form (forced here) fp16/bf16 calls of any rows."""
    setopt(gemm_persistent=form == "persistent", gemm_cublas=form == "cublas")
    if form == "persistent" and not G.interpreting():
        setopt(gemm_config=configs.PERSISTENT_CONFIG_INTERPRET)  # small tiles for the small test shapes
    return 6 if form == "decode" else 20


def _no_second_launch(grid, args, kwargs):
    """Stands in for the group verification's launcher where a call must not launch it."""
    raise AssertionError("the group verification was launched")


def _flips_between(monkeypatch, flips) -> None:
    """Faults made between a GEMM and its group verification, for the persistent form, which injects none
    (calls with flips take the tile kernel): the verification's launcher, wrapped, first flips each
    ``(row, col, bit)`` of ``flips`` in the stored y and moves the group sum ``P[col // 64, row]`` by the
    change, as the tile kernel's epilogue sums a flipped value in place of its accumulator (here in place
    of the rounded value: one rounding of y, far below the flips tested)."""
    real = calls._VERIFY_LAUNCH
    at = {a: groups._group_verify_kernel.arg_names.index(a) for a in ("Y", "P", "M")}

    def flip_then_verify(grid, args, kwargs):
        y, p, m = args[at["Y"]], args[at["P"]], args[at["M"]]
        iy = y.view(_ITY[y.dtype])
        for r, c, bit in flips:
            old = y[r, c].float()
            mask = torch.tensor(1 << bit, dtype=torch.int64).to(iy.dtype)  # (bit 15 of int16: its sign)
            iy[r, c] ^= mask.to(iy.device)
            p[(c // GC) * m + r] += y[r, c].float() - old
        return real(grid, args, kwargs)

    monkeypatch.setattr(calls, "_VERIFY_LAUNCH", flip_then_verify)


def _triton_faulty(form, x, w, b, spec, monkeypatch, *, kn=False, correct=True):
    """The kernel's call with ``spec``'s flips: injected by the kernel (tile, decode, cuBLAS), or made between
    the persistent GEMM and its verification (`_flips_between`). Returns (y, counts)."""
    if form != "persistent":
        return _run(x, w, b, kn=kn, plan=FaultPlan(spec), correct=correct)
    n = w.shape[1] if kn else w.shape[0]
    with monkeypatch.context() as mp:
        _flips_between(mp, [(r, c, spec.bit) for r, c in _positions(spec, x.shape[0], n, x.dtype)])
        return _run(x, w, b, kn=kn, correct=correct)


# --------------------------------------------------------------------------- clean values


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kn", [False, True], ids=["linear", "conv1d"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("mkn", [(37, 80, 50), (9, 1100, 20), (37, 80, 56)], ids=["ragged", "longk", "tma"])
def test_matches_float64_matmul(dtype, kn, with_bias, mkn, setopt):
    # ragged: every tile edge is masked (pointer loads: rows of 50 elements are not 16-byte aligned), one
    # check group of 50 columns; longk: 35 K blocks, the last one partial (M = 9: the decode kernel for
    # fp16/bf16); tma: ragged edges again, but every row stride is 16-byte aligned, so tiles move through
    # tensor descriptors (zero-filled edges)
    m, k, n = mkn
    x = _rand((m, k), dtype, 1)
    w = _rand((k, n) if kn else (n, k), dtype, 2, scale=k**-0.5)
    b = _rand((n,), dtype, 3) if with_bias else None
    # gemm_tma on: descriptors wherever the layout allows (on the GPU, small eager calls otherwise take
    # pointer loads, see `forms.tma_ok`), so that the GPU run covers the descriptor path too
    setopt(gemm_tma=True)
    tma = forms.tma_ok(m, n, k, x, w, torch.empty((m, n), dtype=dtype, device=DEV))
    if n == 50:
        assert not tma  # y's rows (100 or 200 bytes) are not 16-byte aligned
    elif n == 56:
        assert tma == (G.interpreting() or torch.cuda.get_device_capability()[0] >= 9)
    y, st = _run(x, w, b, kn=kn)
    ref = _ref64(x, w, b, kn)
    assert y.shape == (m, n) and y.dtype == dtype
    # float32 on a GPU: the fp32 accumulation error over K = 1100 (3.6e-6 of max|y| on the H100)
    # exceeds 2 ulp; the interpreter's dot is exact enough for the tighter bound
    tol = _gemm_rel_tol(dtype, k) if (dtype == torch.float32 and DEV == "cuda") else 2 * ULP[dtype]
    torch.testing.assert_close(y.double().cpu(), ref, rtol=tol, atol=tol * ref.abs().max().item())
    assert st == ZERO
    # detect=False is the plain GEMM: same values (loaded through pointers where the checked call took the
    # decode kernel: descriptor loads can sum differently, under the interpreter's matmul of a transposed view;
    # without split-K where it took the tile form, which never splits K: its epilogue leaves whole group sums)
    if forms.grouped(m, n, k, dtype, torch.device(DEV), None):
        setopt(gemm_tma=False)
    else:
        setopt(gemm_split=1)
    y0, st0 = _run(x, w, b, kn=kn, detect=False)
    assert torch.equal(y0, y) and st0 == ZERO


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_clean_calls_raise_no_detection_four_distributions(dtype):
    """Default (table) e_max in accumulator mode: no detection on clean data, with and without bias,
    in the decode kernel (M = 16, fp16/bf16) and the tile form."""
    total = {k: 0 for k in ZERO}
    n_calls = 0
    scale = 1e-2 if dtype == torch.float16 else 1.0
    for i, dist in enumerate(DISTS):
        for j, (m, k, n) in enumerate([(32, 96, 48), (16, 256, 64), (48, 64, 160)]):
            x = _rand((m, k), dtype, 10 * i + j, scale, dist)
            w = _rand((n, k), dtype, 100 + 10 * i + j, scale, dist)
            b = _rand((n,), dtype, 200 + i + j, scale, dist) if j % 2 else None
            _, st = _run(x, w, b)
            n_calls += 1
            for key in total:
                total[key] += st[key]
    assert n_calls == 12 and total == ZERO, total


def _check_residuals(x, w, b, kn, mode, where=None):
    """`gemm_residuals` against float64: the checksum ``C = x·w1_g + b1_g`` of every (row, group), the
    threshold, and the difference ``D``: in ``output`` mode the rounded outputs' group sums minus C, in
    ``accumulator`` mode rounding noise (exactly 0 in exact arithmetic), or, with a flip at a position
    satisfying ``where`` (a 0→1 flip of `MID_BIT`, which multiplies the value by 2^8 to 2^64), the flip's
    change in its unit. Nothing is repaired; the flip's unit is counted (e_max from the table then, else 1:
    ``T / e_max``)."""
    m, k = x.shape
    w_nk = w.t() if kn else w
    n = w_nk.shape[0]
    ref = _ref64(x, w, b, kn)
    emax, emax_var, plan, flip = 1.0, None, None, None
    if where is not None:
        bit = MID_BIT[x.dtype]
        grows = lambda r, c: not (ref[r, c].to(x.dtype).view(_ITY[x.dtype]) >> bit) & 1  # noqa: E731 (0→1)
        seed = _seed_where(bit, 1, m, n, x.dtype, ref, lambda pos: where(*pos[0]) and grows(*pos[0]))
        plan = FaultPlan(FaultSpec(site=SITE, bit=bit, count=1, seed=seed))
        flip = _positions(plan.specs[0], m, n, x.dtype)[0]
        emax, emax_var = gemm_emax(x.dtype, x.device, mode, k)
    res = G.gemm_residuals(x, w, b, weight_is_kn=kn, mode=mode, emax=emax, emax_var=emax_var, plan=plan)
    tg = -(-n // GC)
    assert res["d"].shape == res["c"].shape == res["thr"].shape == (m, tg)
    x64 = x.double().cpu()
    w1g = _group_sums64(w_nk.t(), n).t()  # (T_g, K): each group's column sum, float64
    b1g = _group_sums64(b[None], n)[0] if b is not None else torch.zeros(tg, dtype=torch.float64)
    c64 = x64 @ w1g.t() + b1g
    # C is taken from w1g split into slices of x's dtype, together in fp32 accuracy (`calls.group_operand`):
    # a slice lost would be an error of 2^-8 (bf16) to 2^-11 (fp16) of the largest |w1g|; plus the fp32 dot's
    # rounding over K
    absdot = x64.abs() @ w1g.abs().t()
    scale = absdot + x64.abs().sum(1, keepdim=True) * w1g.abs().max() + b1g.abs()
    c_tol = 2.0**-19 * scale + 4 * k**0.5 * 2.0**-24 * absdot
    assert bool(((res["c"].double().cpu() - c64).abs() <= c_tol).all())
    # (the estimate of x's variance the call took: the outlier estimate where the device's table has it)
    xvar = xvar_in_use(x.device.type, x.dtype, mode)
    torch.testing.assert_close(res["thr"].double().cpu(), _thr64(x, w_nk, b, emax, emax_var=emax_var, xvar=xvar),
                               rtol=1e-4, atol=0)
    y = res["y"]
    # the fp32 sums' bound (K products, then 64 terms per unit, a flipped one among them), beside C's
    bound = ((k + GC) * 2.0**-23 * _group_sums64(x64.abs() @ w_nk.double().cpu().abs().t(), n)
             + GC * 2.0**-24 * _group_sums64(y.abs(), n) + c_tol)
    if mode == "output":
        d64 = _group_sums64(y, n) - c64  # the rounded outputs, as stored
        assert bool(((res["d"].double().cpu() - d64).abs() <= bound).all())
    else:
        change = torch.zeros_like(c64)
        if flip:
            r, c = flip
            change[r, c // GC] = float(y[r, c]) - float(ref[r, c])
            bound[r, c // GC] += ULP[x.dtype] * abs(float(ref[r, c]))  # the flip is measured from the rounded y
        assert bool(((res["d"].double().cpu() - change).abs() <= bound).all())
    want = dict(ZERO, detected=1, uncorrectable=1) if flip else ZERO
    assert dict(FaultStats(res["counters"])) == want
    assert int((res["d"].abs() > res["thr"]).sum()) == want["detected"]
    return res


@pytest.mark.parametrize("dtype,kn,with_bias,config", [
    (torch.float16, False, True, None),
    (torch.bfloat16, True, True, None),
    (torch.float32, False, False, None),
    (torch.float16, False, True, "16,128,32,4,1"),  # two check groups per tile
    (torch.bfloat16, False, False, "32,256,32,4,1"),  # four per tile, the last past N
], ids=["fp16", "bf16-conv1d", "fp32-nobias", "fp16-block128", "bf16-block256"])
def test_group_residuals_against_float64(dtype, kn, with_bias, config, setopt):
    """The verification's quantities of every (row, 64-column group), as the tile form's verification
    computed them (`gemm_residuals`), against float64: N = 150 (two full groups and one of 22 columns),
    both modes, and a flip seen in its unit's D only."""
    if config is not None:
        setopt(gemm_config=tuple(int(v) for v in config.split(",")))
    m, k, n = 24, 96, 150
    x = _rand((m, k), dtype, 5, 1.0, "N(1,1)")
    w = _rand((k, n) if kn else (n, k), dtype, 6, k**-0.5)
    b = _rand((n,), dtype, 7) if with_bias else None
    acc = _check_residuals(x, w, b, kn, "accumulator")
    out = _check_residuals(x, w, b, kn, "output")
    assert torch.equal(acc["c"], out["c"]) and torch.equal(acc["thr"], out["thr"])
    if dtype != torch.float32:  # the accumulators' noise is far below the rounded outputs'
        assert float(acc["d"].abs().max()) < 0.05 * float(out["d"].abs().max())
    _check_residuals(x, w, b, kn, "accumulator", where=lambda r, c: c >= 128)  # in the ragged group
    _check_residuals(x, w, b, kn, "output", where=lambda r, c: c < 64)


# --------------------------------------------------------------------------- injection


FORM_DTYPES = [("tile", torch.float32), ("tile", torch.float16), ("tile", torch.bfloat16), ("decode", torch.float16),
               ("decode", torch.bfloat16), ("persistent", torch.float16), ("persistent", torch.bfloat16),
               ("cublas", torch.float16), ("cublas", torch.bfloat16)]
FORM_IDS = [f"{f}-{str(d)[6:]}" for f, d in FORM_DTYPES]


@pytest.mark.parametrize("form,dtype", FORM_DTYPES, ids=FORM_IDS)
def test_single_exponent_flips_counted_like_reference(form, dtype, monkeypatch, setopt):
    """Single 0→1 flips of high exponent bits at linear.output: every form finds, locates and repairs
    them, and counts exactly like the reference path (same positions, same bits). N = 104: two check
    groups, the second 40 columns wide."""
    m, k, n = _take(form, setopt), 64, 104
    seen = _launched(monkeypatch)
    checked = 0
    for bit in HIGH_BIT[dtype]:
        for seed in range(4):
            x = _rand((m, k), dtype, 300 + seed)
            w = _rand((n, k), dtype, 400 + seed, k**-0.5)
            b = _rand((n,), dtype, 500 + seed)
            spec = FaultSpec(site=SITE, bit=bit, count=1, seed=seed)
            ((r, c),) = _positions(spec, m, n, dtype)
            with torch.no_grad():
                clean = F.linear(x, w, b)
            if (clean[r, c].view(_ITY[dtype]) >> bit) & 1:
                continue  # a 1→0 flip (shrinks the value); the V-ABFT specification measures 0→1
            seen.clear()
            y_t, st_t = _triton_faulty(form, x, w, b, spec, monkeypatch)
            assert seen == LAUNCHED[form], seen
            y_r, st_r = _reference(x, w, b, spec)
            assert st_t == st_r, (bit, seed, st_t, st_r)
            assert st_t["detected"] == 1 and st_t["corrected"] + st_t["recomputed"] == 1, st_t
            # against float64: on the GPU the Triton GEMM sums in another order than cuBLAS (a 12-ulp
            # difference from F.linear was seen on the H100), and repairs take their own fp32 dot
            ref = _ref64(x, w, b)
            tol = _gemm_rel_tol(dtype, k) * float(ref.abs().max())
            torch.testing.assert_close(y_t.double().cpu(), ref, rtol=0, atol=tol)
            checked += 1
    assert checked >= len(HIGH_BIT[dtype])


@pytest.mark.parametrize("form,dtype", [("tile", torch.float32), ("tile", torch.bfloat16), ("decode", torch.float16),
                                        ("persistent", torch.bfloat16), ("cublas", torch.float16)],
                         ids=lambda v: str(v).replace("torch.", ""))
def test_counts_per_row_and_group_like_reference(form, dtype, monkeypatch, setopt):
    """Events are counted per (row, 64-column group), on every form as on the reference path: two flips
    of one row in two groups are two single errors, each located and corrected (2 detected, 2 corrected);
    three flips in one group make one unit that no single correction explains, recomputed (1 detected,
    1 recomputed). Without correction every unit is detected and uncorrectable, and y keeps the flips."""
    m, k, n = _take(form, setopt), 48, 136  # groups of 64, 64 and 8 columns
    x = _rand((m, k), dtype, 601, 2.0)
    w = _rand((n, k), dtype, 602, k**-0.5)
    b = _rand((n,), dtype, 603)
    ref = _ref64(x, w, b)
    tol = _gemm_rel_tol(dtype, k) * float(ref.abs().max())
    bit = MID_BIT[dtype]
    patterns = [
        (2, lambda p: p[0][0] == p[1][0] and p[0][1] // GC != p[1][1] // GC, dict(detected=2, corrected=2)),
        (3, lambda p: len({r for r, _ in p}) == 1 and len({c // GC for _, c in p}) == 1,
         dict(detected=1, recomputed=1)),
    ]
    for count, pattern, want in patterns:
        spec = FaultSpec(site=SITE, bit=bit, count=count, seed=_seed_where(bit, count, m, n, dtype, ref, pattern))
        y_t, st_t = _triton_faulty(form, x, w, b, spec, monkeypatch)
        y_r, st_r = _reference(x, w, b, spec)
        assert st_t == st_r == dict(ZERO, **want), (count, st_t, st_r)
        assert float((y_t.double().cpu() - ref).abs().max()) <= tol, count
        y_off, st_off = _triton_faulty(form, x, w, b, spec, monkeypatch, correct=False)
        units = want["detected"]
        assert st_off == dict(ZERO, detected=units, uncorrectable=units), (count, st_off)
        y_flip, _ = _reference(x, w, b, spec, detect=False)
        torch.testing.assert_close(y_off.float(), y_flip.float(), rtol=max(4 * ULP[dtype], 1e-4), atol=tol)


@pytest.mark.parametrize("form,dtype,kn", [("tile", torch.float32, False), ("tile", torch.float16, True),
                                           ("decode", torch.bfloat16, False), ("decode", torch.float16, True),
                                           ("persistent", torch.float16, False), ("persistent", torch.bfloat16, True),
                                           ("cublas", torch.bfloat16, True)],
                         ids=lambda v: {True: "conv1d", False: "linear"}.get(v, str(v).replace("torch.", "")))
def test_ragged_last_group_checked_and_repaired(form, dtype, kn, monkeypatch, setopt):
    """A last group narrower than 64 columns (N = 152: 24 columns) is checked against its own width's
    threshold and repaired in place, nothing written past N (every element ends within the GEMM bound of
    float64): a single flip there corrected, three recomputed, counted like the reference path; and a
    clean call finds nothing in it."""
    m, k, n = _take(form, setopt), 40, 152
    x = _rand((m, k), dtype, 701, 2.0)
    w = _rand((k, n) if kn else (n, k), dtype, 702, k**-0.5)
    b = _rand((n,), dtype, 703)
    ref = _ref64(x, w, b, kn)
    tol = _gemm_rel_tol(dtype, k) * float(ref.abs().max())
    y, st = _run(x, w, b, kn=kn)
    assert st == ZERO and float((y.double().cpu() - ref).abs().max()) <= tol
    bit = MID_BIT[dtype]
    last = lambda p: all(c >= 128 for _, c in p)  # noqa: E731
    for count, pattern, want in ((1, last, dict(detected=1, corrected=1)),
                                 (3, lambda p: last(p) and len({r for r, _ in p}) == 1,
                                  dict(detected=1, recomputed=1))):
        spec = FaultSpec(site=SITE, bit=bit, count=count, seed=_seed_where(bit, count, m, n, dtype, ref, pattern))
        y_t, st_t = _triton_faulty(form, x, w, b, spec, monkeypatch, kn=kn)
        _, st_r = _reference(x, w, b, spec, kn=kn)
        assert st_t == st_r == dict(ZERO, **want), (count, st_t, st_r)
        assert float((y_t.double().cpu() - ref).abs().max()) <= tol, count


def test_wide_rows_every_verification_block(monkeypatch):
    """Rows of more than one verification program's groups (N = 2120: 34 groups, the last 8 wide, over two
    programs of 32 groups, `configs.VERIFY_BLOCK`): a flip in a group of each program found and corrected
    like the reference path, one flip in the second program's ragged group too."""
    seen = _launched(monkeypatch)
    m, k, n = 17, 16, 2120
    dtype = torch.float32
    x = _rand((m, k), dtype, 901, 2.0)
    w = _rand((n, k), dtype, 902, k**-0.5)
    b = _rand((n,), dtype, 903)
    ref = _ref64(x, w, b)
    bit = MID_BIT[dtype]
    spec = FaultSpec(site=SITE, bit=bit, count=3, seed=_seed_where(bit, 3, m, n, dtype, ref, lambda p: (
        len({(r, c // GC) for r, c in p}) == 3 and min(c for _, c in p) < 32 * GC and max(c for _, c in p) >= 2112)))
    y_t, st_t = _run(x, w, b, plan=FaultPlan(spec))
    _, st_r = _reference(x, w, b, spec)
    assert st_t == st_r == dict(ZERO, detected=3, corrected=3), (st_t, st_r)
    assert seen == [0, 1]
    assert float((y_t.double().cpu() - ref).abs().max()) <= _gemm_rel_tol(dtype, k) * float(ref.abs().max())


@pytest.mark.parametrize("form", FORMS)
def test_nonfinite_rows_skipped_other_rows_still_repaired(form, monkeypatch, setopt):
    """A row of x holding a NaN or ±inf has no meaningful checksum. Every path skips such rows and counts one
    ``nonfinite_input`` for the call, whichever of its programs see them (here rows in two of three row
    blocks of 64 on the tile and persistent forms), while a flip in another row of the same call is still
    detected and corrected, as on the reference path. A later clean call is checked again."""
    dtype = torch.float32 if form == "tile" else torch.float16
    m = 6 if form == "decode" else 150
    _take(form, setopt)
    k, n = 32, 72
    x = _rand((m, k), dtype, 801)
    w = _rand((n, k), dtype, 802, k**-0.5)
    b = _rand((n,), dtype, 803)
    ref = _ref64(x, w, b)
    tol = _gemm_rel_tol(dtype, k) * float(ref.abs().max())
    bad_rows = [2] if form == "decode" else [2, 140]
    xb = x.clone()
    xb[2, 5] = float("nan")
    if form != "decode":
        xb[140, 0] = float("-inf")
    bit = MID_BIT[dtype]
    spec = FaultSpec(site=SITE, bit=bit, count=1, seed=_seed_where(
        bit, 1, m, n, dtype, ref, lambda p: p[0][0] not in bad_rows and (form == "decode" or 64 <= p[0][0] < 128)))
    y_t, st_t = _triton_faulty(form, xb, w, b, spec, monkeypatch)
    _, st_r = _reference(xb, w, b, spec)
    assert st_r == dict(ZERO, nonfinite_input=1, detected=1, corrected=1), st_r
    assert st_t == st_r
    good = [i for i in range(m) if i not in bad_rows]
    assert float((y_t.double().cpu()[good] - ref[good]).abs().max()) <= tol
    assert not bool(y_t[bad_rows].isfinite().all(1).any())  # (NaN and ±inf propagate in their rows)
    y2, st2 = _run(x, w, b)
    assert st2 == ZERO and float((y2.double().cpu() - ref).abs().max()) <= tol


@pytest.mark.parametrize("form", ["tile", "persistent"])
@pytest.mark.parametrize("dtype", DTYPES16, ids=str)
@pytest.mark.parametrize("xvar", [False, True], ids=["bound", "xvar"])
def test_checksum_tiles_like_the_verification_loop(dtype, form, xvar, monkeypatch, setopt):
    """The group checksums and x's statistics computed as checksum tiles of the GEMM's launch (`checksum_tiles`,
    the default of fp16/bf16 tile and persistent calls) against the verification's own K loop on the same
    operands. One launch each of the GEMM (with ⌈S·T_g / CN⌉ checksum tiles per row block, each over K in
    splits) and of the verification (FUSED, no split of its own; it sums the splits' partials). y bit for bit
    the same; C within fp32 rounding of the loop's; the thresholds (x's sum, max, min, with XVAR its sum of
    squares) within fp32 rounding; clean calls count nothing; one and two flipped units are counted and
    repaired alike. The shape has several checksum tiles (S·T_g = 70 or 105 checksum columns against CN = 64
    on the interpreter), a partial last group, a partial row block, and a K that is not a multiple of
    BLOCK_K."""
    rows = _take(form, setopt)
    setopt(gemm_xvar=xvar)
    monkeypatch.setattr(checksum_tiles, "CHECKSUM_MIN_BLOCKS", 1)  # a split per K block: 3 here
    m, k, n = rows + 17, 72, 2200  # (K · 2 bytes a multiple of 16: the persistent form's TMA layout)
    x = _rand((m, k), dtype, 2101, 2.0)
    w = _rand((n, k), dtype, 2102, k**-0.5)
    b = _rand((n,), dtype, 2103)
    emax, emax_var = gemm_emax(dtype, x.device, "accumulator", k)
    seen = []
    for name in ("_GEMM_LAUNCH", "_PERSISTENT_LAUNCH", "_VERIFY_LAUNCH"):
        real = getattr(calls, name)

        kernel = {"_GEMM_LAUNCH": tile._gemm_kernel, "_PERSISTENT_LAUNCH": persistent._persistent_kernel,
                  "_VERIFY_LAUNCH": groups._group_verify_kernel}[name]
        at = kernel.arg_names.index("n_csplit" if name == "_VERIFY_LAUNCH" else "c_split")

        def spy(grid, args, kwargs, name=name, real=real, at=at):
            seen.append((name, grid[0], kwargs.get("FUSED"), kwargs.get("SPLIT"), kwargs.get("CN"), args[at]))
            return real(grid, args, kwargs)

        monkeypatch.setattr(calls, name, spy)
    res = {}
    for fused in (False, True):
        with override(gemm_fused=fused):
            seen.clear()
            res[fused] = G.gemm_residuals(x, w, b, emax=emax, emax_var=emax_var)
            launches = list(seen)
        gemm, ver = launches
        assert gemm[0] == ("_PERSISTENT_LAUNCH" if form == "persistent" else "_GEMM_LAUNCH")
        assert ver[0] == "_VERIFY_LAUNCH"
        assert gemm[2] is fused and ver[2] is fused
        if fused:
            nc = {torch.float16: 2, torch.bfloat16: 3}[dtype] * -(-n // GC)
            # several checksum tiles, each over K in three splits (3 K blocks of 32), summed by the verification
            assert ver[3] is False and -(-nc // gemm[4]) >= 2 and gemm[5] == ver[5] == 3, launches
    a, f = res[False], res[True]
    assert torch.equal(a["y"], f["y"])
    scale = (x.double().abs().cpu() @ _group_sums64(w.double().abs().t().cpu(), n))  # (M, T_g): Σ|x|·|w1_g|
    assert float(((a["c"].double().cpu() - f["c"].double().cpu()).abs() / scale).max()) <= 4 * k * 2.0**-24
    torch.testing.assert_close(f["thr"], a["thr"], rtol=1e-5, atol=0)
    assert dict(FaultStats(f["counters"])) == dict(FaultStats(a["counters"])) == ZERO
    ref = _ref64(x, w, b)
    bit = MID_BIT[dtype]
    grows = lambda r, c: not (ref[r, c].to(dtype).view(_ITY[dtype]) >> bit) & 1  # noqa: E731 (0→1)
    for count, pattern in ((1, lambda p: True), (2, lambda p: len({(r, c // GC) for r, c in p}) == 2
                                                 and all(grows(*q) for q in p))):
        spec = FaultSpec(site=SITE, bit=bit, count=count, seed=_seed_where(bit, count, m, n, dtype, ref, pattern))
        got = {}
        for fused in (False, True):
            with override(gemm_fused=fused):
                got[fused] = _triton_faulty(form, x, w, b, spec, monkeypatch)
        assert torch.equal(got[False][0], got[True][0]) and got[False][1] == got[True][1] != ZERO, got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_split_verification_like_unsplit(dtype, monkeypatch, setopt):
    """A call of few verification blocks (here one: 20 rows, 3 groups) splits the verification's K loop over
    programs (`forms.verify_split`; at K = 192, 2 splits of 2 and 1 K blocks of 64, on the interpreter's 4
    SMs as on a GPU's many), the last to count summing the partials in split order. Counted as the
    unsplit verification counts: clean calls nothing, a single flip corrected, three in one unit recomputed,
    a row of non-finite x skipped (once) beside a corrected flip; y within the GEMM bound of float64, the
    cells back to 0; its checksums and thresholds the unsplit ones up to fp32 rounding. (The verification's
    own K loop: the checksum tiles in the GEMM's launch, `checksum_tiles`, switched off.)"""
    setopt(gemm_fused=False)
    m, k, n = 20, 192, 136
    x = _rand((m, k), dtype, 1001, 2.0)
    w = _rand((n, k), dtype, 1002, k**-0.5)
    b = _rand((n,), dtype, 1003)
    ref = _ref64(x, w, b)
    tol = _gemm_rel_tol(dtype, k) * float(ref.abs().max())
    seen = []
    real = calls._VERIFY_LAUNCH
    at = groups._group_verify_kernel.arg_names.index("n_split")

    def spy(grid, args, kwargs):
        seen.append((kwargs["SPLIT"], args[at], grid[0]))
        return real(grid, args, kwargs)

    monkeypatch.setattr(calls, "_VERIFY_LAUNCH", spy)
    bit = MID_BIT[dtype]
    grows = lambda r, c: not (ref[r, c].to(dtype).view(_ITY[dtype]) >> bit) & 1  # noqa: E731 (0→1)
    xn = x.clone()
    xn[4, 150] = float("nan")  # (in the second split's K blocks)
    cases = [(x, None, ZERO)]
    for count, x_in, pattern, want in (
            (1, x, lambda p: True, dict(detected=1, corrected=1)),
            (3, x, lambda p: len({(r, c // GC) for r, c in p}) == 1 and all(grows(*q) for q in p),
             dict(detected=1, recomputed=1)),
            (1, xn, lambda p: p[0][0] != 4, dict(detected=1, corrected=1, nonfinite_input=1))):
        seed = _seed_where(bit, count, m, n, dtype, ref, pattern)
        cases.append((x_in, FaultSpec(site=SITE, bit=bit, count=count, seed=seed), dict(ZERO, **want)))
    for x_in, spec, want in cases:
        out = {}
        for split in (True, False):
            with monkeypatch.context() as mp:
                if not split:
                    mp.setattr(calls, "verify_split", lambda m, n, k, device: (1, -(-k // 64)))
                seen.clear()
                out[split] = _run(x_in, w, b, plan=FaultPlan(spec) if spec else None)
                assert seen == ([(True, 2, 2)] if split else [(False, 1, 1)]), seen
        assert out[True][1] == out[False][1] == want, (spec, out[True][1], out[False][1])
        good = [r for r in range(m) if bool(x_in[r].isfinite().all())]
        assert float((out[True][0].double().cpu()[good] - ref[good]).abs().max()) <= tol
        assert int(calls._cells(x.device).abs().sum().item()) == 0
    res = {}
    for split in (True, False):
        with monkeypatch.context() as mp:
            if not split:
                mp.setattr(calls, "verify_split", lambda m, n, k, device: (1, -(-k // 64)))
            res[split] = G.gemm_residuals(x, w, b)
    for key in ("c", "thr"):
        torch.testing.assert_close(res[True][key], res[False][key], rtol=1e-5, atol=1e-5)
    _check_residuals(x, w, b, False, "accumulator")  # (split) against float64


@pytest.mark.parametrize("form", ["tile", "persistent"])
def test_repair_leaves_no_second_flip_in_the_group(form, monkeypatch, setopt):
    """Two flips in one bf16 unit: a large value grown ×2^64 (located) and a small one (0.05-0.2) shrunk to
    ~0. Replacing the located value alone would leave the small one wrong: the rest of the group is compared
    with its recomputation element by element, so the unit is recomputed (as the reference path and the
    decode kernel do). Flips made between the GEMM and the verification (`_flips_between`) at chosen positions."""
    m = _take(form, setopt)
    dtype, k, n = torch.bfloat16, 64, 64
    x = _rand((m, k), dtype, 1101, 2.0)
    w = _rand((n, k), dtype, 1102, k**-0.5)
    b = _rand((n,), dtype, 1103)
    ref = _ref64(x, w, b)
    bit = MID_BIT[dtype]
    row = ref[0].abs()
    big = int(torch.where((row >= 2) & (row < 100), row, 0).argmax())  # bit 6 of its exponent is 0: ×2^64
    small = int(torch.where((row > 0.05) & (row < 0.2), 1.0 / row, 0).argmax())  # bit 6 is 1: ÷2^64
    assert row[big] >= 2 and 0.05 < row[small] < 0.2
    _flips_between(monkeypatch, [(0, big, bit), (0, small, bit)])
    y, st = _run(x, w, b)
    err = float((y.double().cpu() - ref).abs().max())
    assert st == dict(ZERO, detected=1, recomputed=1) and err <= _gemm_rel_tol(dtype, k) * float(ref.abs().max()), (
        st, err)


def test_many_flips_all_repaired(monkeypatch):
    """Many faulty units in one call (90 flips over 40 rows of one 6-column group each): the group
    verification repairs every one it detects (no capacity), where the reference path recomputes at
    most RECOMPUTE_GROUPS per call and leaves the rest uncorrectable; both detect the same units.
    Every element ends within the GEMM bound of float64 plus its unit's threshold (a flip small enough to
    pass the check). Without correction or detection both paths leave the same flipped output."""
    m, k, n = 40, 32, 6
    dtype = torch.float32
    x = _rand((m, k), dtype, 11, 4.0)
    w = _rand((n, k), dtype, 12)
    spec = FaultSpec(site=SITE, bit=28, count=90, seed=3)
    y_t, st_t = _run(x, w, plan=FaultPlan(spec))
    _, st_r = _reference(x, w, spec=spec)
    units = len({r for r, _ in _positions(spec, m, n, dtype)})
    assert units >= st_t["detected"] > _cl.RECOMPUTE_GROUPS, (st_t, st_r)
    same_emax = DEV == "cpu"  # (on a GPU the kernel's accumulator-side e_max is 10× the reference's)
    if same_emax:
        assert st_t["detected"] == st_r["detected"], (st_t, st_r)
    assert st_t["uncorrectable"] == 0 and st_t["corrected"] + st_t["recomputed"] == st_t["detected"], st_t
    assert st_r["uncorrectable"] == st_r["detected"] - _cl.RECOMPUTE_GROUPS > 0, st_r
    ref = _ref64(x, w)
    e, e_var = gemm_emax(dtype, x.device, "accumulator", k)
    thr = G.gemm_residuals(x, w, emax=e, emax_var=e_var)["thr"].double().cpu()
    err = (y_t.double().cpu() - ref).abs()
    assert bool((err <= _gemm_rel_tol(dtype, k) * ref.abs().max() + thr).all()), (err - thr).max()
    detected = st_t["detected"]
    for kw, want in (({"correct": False}, dict(ZERO, detected=detected, uncorrectable=detected)),
                     ({"detect": False}, ZERO)):
        y_t, st_t = _run(x, w, plan=FaultPlan(spec), **kw)
        y_r, st_r = _reference(x, w, spec=spec, **kw)
        assert st_t == want and (st_r == st_t or not same_emax), (kw, st_t, st_r)
        torch.testing.assert_close(y_t, y_r, rtol=1e-4, atol=1e-3, equal_nan=True)


@pytest.mark.parametrize("dtype,m,k,n,seed,bit,count,flip_seed", [
    (torch.bfloat16, 13, 100, 70, None, 14, 5, 5),  # row 4: +2.3 and -3.6 (1→0 flips), sum 1.25
    (torch.float16, 12, 96, 48, 1000, 6, 3, 6),
    (torch.bfloat16, 12, 96, 48, 1001, 9, 3, 109),
], ids=["bf16-two-shrunk", "fp16-two", "bf16-two"])
@pytest.mark.parametrize("table", ["cpu", "h100"])
@pytest.mark.parametrize("form", ["decode", "tile", "cublas"])
def test_repair_must_explain_the_accumulator_difference(dtype, m, k, n, seed, bit, count, flip_seed, table, form,
                                                        monkeypatch, setopt):
    """Two flips in one group of a row: the located column explains neither, and a repair of it alone
    would leave the group wrong while the group re-summed from its outputs could pass. The repair must
    also explain the rest of the group against its recomputation; such units are recomputed.

    Under both shipped accumulator-side tables, whatever the device: ``cpu`` (this CPU's e_max),
    where every flip of the call is caught, and ``h100`` (the H100's, ~100× the CPU's for fp16; an
    H200 uses it too), where a single low-mantissa flip elsewhere in the call may stay under the
    threshold. The units with two flips must be recomputed under both, and under ``h100`` no element
    may end up further from float64 than its injected flip put it. In the decode kernel (M ≤ 16), the
    tile form's verification (forced: two check groups per tile) and the cuBLAS form's."""
    if form == "tile":
        setopt(gemm_config=(16, 128, 32, 4, 1))
    setopt(gemm_cublas=form == "cublas")
    seen = _launched(monkeypatch)
    name = {"cpu": "cpu.json", "h100": "nvidia_h100_80gb_hbm3.json"}[table]
    entries = json.loads((Path(_vabft.__file__).with_name("emax_tables") / name).read_text())["emax"]  # shipped
    monkeypatch.setattr(_cl, "gemm_emax", lambda dt, device, mode, k: float(entries[mode][str(dt)[6:]]))
    if seed is None:
        x, w, b = _rand((m, k), dtype, 81, 2.0), _rand((n, k), dtype, 82, k**-0.5), _rand((n,), dtype, 83)
    else:
        g = torch.Generator().manual_seed(seed)
        x = (torch.randn(m, k, generator=g) * 2).to(dtype).to(DEV)
        w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype).to(DEV)
        b = torch.randn(n, generator=g).to(dtype).to(DEV)
    spec = FaultSpec(site=SITE, bit=bit, count=count, seed=flip_seed)
    units = [(r, c // GC) for r, c in _positions(spec, m, n, dtype)]
    two = sorted({u for u in units if units.count(u) == 2})
    assert two  # a unit with two flips
    with torch.no_grad():
        y, st = ftt.checked_linear(x, w, b, inject=spec, backend="triton")
        y_flipped, _ = ftt.checked_linear(x, w, b, inject=spec, backend="reference", detect=False)
    assert seen == LAUNCHED[form], seen
    st = dict(st)
    assert st["recomputed"] >= 1 and st["uncorrectable"] == 0, st
    ref = _ref64(x, w, b)
    tol = _gemm_rel_tol(dtype, k) * float(ref.abs().max())
    err = (y.double().cpu() - ref).abs()
    for r, g in two:  # recomputed, not "repaired"
        assert float(err[r, g * GC:(g + 1) * GC].max()) <= tol, (r, g, tol)
    if table == "cpu":
        assert float(err.max()) <= tol, float(err.max())
    else:  # every other element: repaired, or left with (at most) its injected error
        flip_err = (y_flipped.double().cpu() - ref).abs().nan_to_num(nan=float("inf"))  # a flip may make a NaN
        assert bool((err <= flip_err + tol).all()), (err - flip_err).max()


def test_accumulator_mode_catches_low_bits_the_output_mode_misses():
    """bf16 bit-8 flips (×4 or ÷4 of one element) hidden in output-side rounding noise are found in
    the accumulators."""
    m, k, n = 64, 128, 64
    x = _rand((m, k), torch.bfloat16, 21)
    w = _rand((n, k), torch.bfloat16, 22, k**-0.5)
    spec = FaultSpec(site=SITE, bit=8, count=12, seed=5)
    _, st_acc = _run(x, w, plan=FaultPlan(spec))
    _, st_out = _run(x, w, plan=FaultPlan(spec), mode="output", emax=8e-3)
    assert st_acc["detected"] > st_out["detected"]
    assert st_acc["detected"] == st_acc["corrected"] + st_acc["recomputed"] + st_acc["uncorrectable"]


def test_ber_mode_matches_reference_positions():
    x = _rand((8, 48), torch.float32, 31, 8.0)
    w = _rand((24, 48), torch.float32, 32)
    spec = FaultSpec(site=SITE, ber=0.01, seed=4)
    with torch.no_grad():
        y_t, _ = ftt.checked_linear(x, w, inject=spec, backend="triton", detect=False)
        y_r, _ = ftt.checked_linear(x, w, inject=spec, backend="reference", detect=False)
        c_t, _ = ftt.checked_linear(x, w, backend="triton", detect=False)
    flipped_t = (y_t.view(torch.int32) ^ c_t.view(torch.int32)) != 0
    flipped_r = (y_r.view(torch.int32) ^ F.linear(x, w).view(torch.int32)) != 0
    assert flipped_t.any() and torch.equal(flipped_t, flipped_r)
    ratio = y_t[flipped_t].abs() / c_t[flipped_t].abs()  # same bits: same factor on both paths
    torch.testing.assert_close(ratio, y_r[flipped_r].abs() / F.linear(x, w)[flipped_r].abs(), rtol=1e-3, atol=0)


# --------------------------------------------------------------------------- the decode kernel


def _spy_launches(monkeypatch) -> list:
    """Record ``(launcher, SPLIT, n_split)`` of every GEMM-side launch (0: `_gemm_kernel`, 2: the decode
    kernel); a decode call must not launch the group verification."""
    seen = []
    for which, attr in ((0, "_GEMM_LAUNCH"), (2, "_GROUPED_LAUNCH")):
        real = getattr(calls, attr)
        kernel = tile._gemm_kernel if which == 0 else decode.grouped_gemm_kernel
        at = kernel.arg_names.index("n_split")

        def spy(grid, args, kwargs, which=which, real=real, at=at):
            seen.append((which, kwargs["SPLIT"], args[at]))
            return real(grid, args, kwargs)

        monkeypatch.setattr(calls, attr, spy)
    monkeypatch.setattr(calls, "_VERIFY_LAUNCH", _no_second_launch)
    return seen


@pytest.mark.parametrize("dtype", DTYPES16, ids=str)
@pytest.mark.parametrize("m,n,k,kn,with_bias,splits", [
    (1, 200, 96, False, True, 1),  # 4 tiles of 64 on the interpreter's 4 SMs: no split; last group 8 wide
    (16, 40, 600, True, False, 4),  # one tile: 4 splits of 5 K blocks (19 of 32)
    (5, 130, 70, False, True, 1),  # K not a multiple of BLOCK_K, 3 groups
], ids=["ragged-n", "split-k", "ragged-k"])
def test_decode_kernel_matches_float64_and_plain(dtype, m, n, k, kn, with_bias, splits, monkeypatch, setopt):
    """A checked call of M ≤ 16 runs the decode kernel alone (no other launch): clean calls count
    nothing (also verifying the rounded outputs, ``mode="output"``), match float64, and equal the
    plain GEMM of the same blocks bit for bit."""
    setopt(gemm_split=None)
    seen = _spy_launches(monkeypatch)
    x = _rand((m, k), dtype, 91, 2.0)
    w = _rand((k, n) if kn else (n, k), dtype, 92, k**-0.5)
    b = _rand((n,), dtype, 93) if with_bias else None
    y, st = _run(x, w, b, kn=kn)
    assert st == ZERO
    if G.interpreting():
        assert seen == [(2, splits > 1, splits)], seen
    else:
        assert [s[0] for s in seen] == [2], seen
    y_out, st_out = _run(x, w, b, kn=kn, mode="output")
    assert st_out == ZERO and seen[-1][0] == 2
    if G.interpreting():  # one config (a GPU tunes each mode on its own)
        assert torch.equal(y_out, y)
    ref = _ref64(x, w, b, kn)
    tol = _gemm_rel_tol(dtype, k) * float(ref.abs().max())
    assert float((y.double().cpu() - ref).abs().max()) <= tol
    if G.interpreting():  # the same blocks and splits (on a GPU each form is tuned on its own)
        setopt(gemm_tma=False)  # and pointer loads, as the decode kernel's
        y0, st0 = _run(x, w, b, kn=kn, detect=False)
        assert torch.equal(y0, y) and st0 == ZERO


@pytest.mark.parametrize("dtype", DTYPES16, ids=str)
@pytest.mark.parametrize("split", ["auto", "1"])
def test_decode_kernel_counts_per_group(dtype, split, monkeypatch, setopt):
    """Flips in a decode call are counted per (row, 64-column group): a group row with one flip is
    located and repaired (``corrected``), one with several is recomputed (``recomputed``); with
    ``correct=False`` every such group row is ``detected`` and ``uncorrectable`` and y keeps the
    flips. Expected counts come from the injected positions alone; repaired outputs match float64.
    With N ≤ 64 (one group per row) also at the top exponent bit, like the reference path."""
    if split != "auto":
        setopt(gemm_split=int(split))
    seen = _spy_launches(monkeypatch)
    m, k, n = 6, 160, 200
    x = _rand((m, k), dtype, 95, 2.0)
    w = _rand((n, k), dtype, 96, k**-0.5)
    b = _rand((n,), dtype, 97)
    ref = _ref64(x, w, b)
    tol = _gemm_rel_tol(dtype, k) * float(ref.abs().max())
    bit = MID_BIT[dtype]
    checked = 0
    for count, seed in ((1, 1), (4, 2), (12, 3)):
        spec = FaultSpec(site=SITE, bit=bit, count=count, seed=seed)
        pos = _positions(spec, m, n, dtype)
        if any(not 0.05 < abs(float(ref[r, c])) < 100 for r, c in pos):
            continue  # a flip of a tiny value may hide in the rounding noise: not this test's subject
        per_group = {}
        for r, c in pos:
            per_group[(r, c // GC)] = per_group.get((r, c // GC), 0) + 1
        ones = sum(1 for v in per_group.values() if v == 1)
        y, st = _run(x, w, b, plan=FaultPlan(spec))
        y_off, st_off = _run(x, w, b, plan=FaultPlan(spec), correct=False)
        y_flip, _ = _run(x, w, b, plan=FaultPlan(spec), detect=False)
        assert st == dict(ZERO, detected=len(per_group), corrected=ones, recomputed=len(per_group) - ones), (
            pos, st)
        assert float((y.double().cpu() - ref).abs().max()) <= tol, pos
        assert st_off == dict(ZERO, detected=len(per_group), uncorrectable=len(per_group)), (pos, st_off)
        torch.testing.assert_close(y_off.float(), y_flip.float(), rtol=max(4 * ULP[dtype], 1e-4), atol=tol)
        checked += 1
    assert checked >= 2 and {s[0] for s in seen} == {0, 2}  # (the plain GEMM took the flips for y_flip)
    # one group per row (N = 48), several flips in a row and flips to ~1e38 (at the top exponent bit):
    # every flipped row found and repaired, counted like the reference wherever it finds them all (its
    # fp32 sums may miss a value shrunk to ~0 that the kernel's recomputation repairs)
    w48, b48 = w[:48].contiguous(), b[:48].contiguous()
    ref48 = _ref64(x, w48, b48)
    for count in (1, 9):
        spec = FaultSpec(site=SITE, bit=HIGH_BIT[dtype][-1], count=count, seed=20 + count)
        rows = {r for r, _ in _positions(spec, m, 48, dtype)}
        y_t, st_t = _run(x, w48, b48, plan=FaultPlan(spec))
        _, st_r = _reference(x, w48, b48, spec)
        assert st_t["detected"] == len(rows) and st_t["uncorrectable"] == 0, (count, st_t)
        if st_r["detected"] == len(rows):
            assert st_t == st_r, (count, st_t, st_r)
        tol48 = _gemm_rel_tol(dtype, k) * float(ref48.abs().max())
        assert float((y_t.double().cpu() - ref48).abs().max()) <= tol48
    assert seen[-1][0] == 2


def test_decode_kernel_group_constants_against_float64():
    """`group_checksums` against an independent float64 computation: ``w1_g`` is each group's column
    sum, ``b1_g`` its bias sum, and the thresholds its constants give (the kernels' formula, in float64
    here) equal SPEC §5's threshold of the group's columns alone plus the group's bias share
    (`_thr64`), including the ragged last group (200 = 3·64 + 8 columns)."""
    from ft_transformers.kernels.gemm_checksums import group_checksums

    m, k, n = 7, 90, 200
    x = _rand((m, k), torch.float32, 1, 3.0, "N(1,1)").cpu()
    w = _rand((n, k), torch.float32, 2).cpu()
    b = _rand((n,), torch.float32, 3).cpu()
    w1g, consts = group_checksums(w, b)
    wkn, consts_kn = group_checksums(w.t().contiguous(), b, weight_is_kn=True)
    assert torch.equal(w1g, wkn) and torch.equal(consts, consts_kn)
    assert w1g.shape == (4, k) and consts.shape == (4, 8)
    x64 = x.double()
    c, mu64 = consts.double(), x64.mean(1, keepdim=True)
    var64 = (x64.amax(1, keepdim=True) - mu64) * (mu64 - x64.amin(1, keepdim=True))  # SPEC §5's bound for x
    # `decode._epilogue`'s and `groups._group_verify_kernel`'s T from the constants
    # (b1, det, v2, v3, v4, bias_det, bias_sd, n_g)
    got = 1e-6 * (c[:, 1] * mu64.abs() + 2.5 * torch.sqrt(mu64 * mu64 * c[:, 2] + var64 * c[:, 3])
                  + 2.5 * c[:, 4] * var64.sqrt() + c[:, 5] + 2.5 * c[:, 6])
    torch.testing.assert_close(got, _thr64(x, w, b, emax=1e-6), rtol=1e-5, atol=0)
    torch.testing.assert_close(w1g.double(), _group_sums64(w.t(), n).t(), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(consts[:, 0].double(), _group_sums64(b[None], n)[0], rtol=1e-6, atol=1e-5)
    assert consts[:, 7].tolist() == [64, 64, 64, 8]


@pytest.mark.skipif(DEV != "cpu", reason="stand-in timings and the interpreter's 4 SMs (split-K counts)")
def test_tuner_times_the_decode_kernel(monkeypatch, setopt):
    """The decode kernel's candidates are timed in its own launches (CONFIGS_GROUPED, each with
    split-K where it applies and without), on its clean path against an infinite threshold: the
    scratch counters see nothing."""
    monkeypatch.setattr(forms, "INTERP", False)
    setopt(gemm_config=None, gemm_tune=True, gemm_split=None)
    monkeypatch.setattr(torch.cuda, "device", lambda dev: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(tuning, "CONFIGS_GROUPED", [(16, 64, 64, 4, 1), (16, 64, 128, 4, 1)])
    monkeypatch.setattr(tuning, "TUNE_STREAM_COPIES", 1)
    seen = []
    real = calls._GROUPED_LAUNCH
    at = {a: decode.grouped_gemm_kernel.arg_names.index(a) for a in ("n_split", "Cnt")}

    def spy(grid, args, kwargs):
        seen.append((kwargs["BLOCK_K"], kwargs["SPLIT"], args[at["n_split"]], args[at["Cnt"]]))
        return real(grid, args, kwargs)

    monkeypatch.setattr(calls, "_GROUPED_LAUNCH", spy)
    monkeypatch.setattr(calls, "_GEMM_LAUNCH", _no_second_launch)
    times = {(64, True): 2.0, (64, False): 1.5, (128, True): 1.0, (128, False): 3.0}  # (BLOCK_K, split): "ms"
    monkeypatch.setattr(tuning, "gpu_time", lambda run: (run(), times[seen[-1][:2]])[1])
    monkeypatch.setattr(tuning, "_TUNE_CACHE", {})
    x = _rand((3, 640), torch.float16, 5)
    w = _rand((128, 640), torch.float16, 6, 640**-0.5)
    launch = calls._Launch(x=x, w=w, b=None, y=torch.empty(3, 128, dtype=x.dtype), swn=w.stride(0), swk=w.stride(1))
    cfg = tuning.pick_config(launch, bias=None, detect=True, verify_output=False, dot_f32=True, decode=True)
    # 2 tiles of 64 on the interpreter's 4 SMs: 2 splits (of 5 K blocks of 64, or 3 and 2 of 128), or none
    assert [e[:3] for e in seen] == [(64, True, 2), (64, False, 1), (128, True, 2), (128, False, 1)], seen
    assert cfg == (16, 64, 128, 4, 1)
    for *_, cnt in seen:
        assert dict(FaultStats(cnt)) == ZERO
    assert int(calls._cells(x.device).abs().sum().item()) == 0  # the split counts back to 0


# --------------------------------------------------------------------------- the persistent form


@pytest.mark.parametrize("dtype", DTYPES16, ids=str)
@pytest.mark.parametrize("kn", [False, True], ids=["linear", "conv1d"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
def test_persistent_form_is_exact_and_verifies_like_float64(dtype, kn, with_bias, monkeypatch, setopt):
    """The persistent form (a persistent TMA GEMM leaving the group sums, then the group verification;
    forced with ``Options.gemm_persistent``: on a GPU only wide calls take it): y within the GEMM bound of
    float64, no events on clean inputs, and the verification's quantities are float64's (checksums and
    thresholds of every (row, group); D far below the threshold)."""
    _take("persistent", setopt)
    seen = _launched(monkeypatch)
    m, n, k = 72, 80, 96  # row blocks, column tiles and K blocks of 32 that do not all divide evenly
    x = _rand((m, k), dtype, 81)
    w = _rand((k, n) if kn else (n, k), dtype, 82, k**-0.5)
    b = _rand((n,), dtype, 83) if with_bias else None
    ref = _ref64(x, w, b, kn)
    y, st = _run(x, w, b, kn=kn)
    assert seen == LAUNCHED["persistent"], seen
    assert st == ZERO
    assert float((y.double().cpu() - ref).abs().max()) <= _gemm_rel_tol(dtype, k) * float(ref.abs().max())
    seen.clear()
    res = _check_residuals(x, w, b, kn, "accumulator")
    assert seen == LAUNCHED["persistent"], seen
    assert torch.equal(res["y"], y)
    assert float((res["d"].abs() / res["thr"]).max()) < 0.5  # thr with e_max = 1: D is fp32 rounding


@pytest.mark.parametrize("dtype", DTYPES16, ids=str)
def test_persistent_form_verification_equals_the_tile_forms(dtype, monkeypatch, setopt):
    """The persistent and tile GEMMs leave the same group sums for the same verification: x's checksums and
    thresholds per (row, group) are identical, D agrees to the two GEMMs' summation orders (rows of
    different scales, a row with one outlier (its max), a negative row (its min), M, N and K not multiples
    of the blocks, 3 row blocks of the persistent GEMM on 4 programs, BLOCK_N = 128: two groups per tile)."""
    m, n, k = 90, 136, 104
    x = _rand((m, k), dtype, 61) * torch.linspace(0.01, 4.0, m, device=DEV)[:, None].to(dtype)
    x[3, 17] = 200.0
    x[5] = -x[5].abs() - 1.0
    w = _rand((n, k), dtype, 62, k**-0.5)
    b = _rand((n,), dtype, 63)
    out = {}
    for form in ("persistent", "tile"):
        with monkeypatch.context() as mp, override(gemm_config=(32, 128, 32, 4, 1),
                                                   gemm_persistent=form == "persistent"):
            seen = _launched(mp)
            out[form] = G.gemm_residuals(x, w, b)
            assert seen == LAUNCHED[form], (form, seen)
    p, t = out["persistent"], out["tile"]
    assert torch.equal(p["c"], t["c"]) and torch.equal(p["thr"], t["thr"])
    scale = _group_sums64(x.double().cpu().abs() @ w.double().cpu().abs().t(), n)
    assert bool(((p["d"] - t["d"]).double().cpu().abs() <= 2 * k * 2.0**-24 * scale).all())
    torch.testing.assert_close(p["y"], t["y"], rtol=2 * ULP[dtype], atol=0)
    for res in (p, t):
        assert dict(FaultStats(res["counters"])) == ZERO


def test_persistent_form_counts_and_repairs_like_the_tile_form(monkeypatch, setopt):
    """Two flips in group 0 of every row (its two largest values, made between the GEMM and the
    verification, `_flips_between`): no single correction explains a unit, so every row's unit is
    recomputed (no capacity: all 40 of them): the persistent form and the tile form (same verification)
    give the same counts and the same y, float64's. A repeated signature replays the recorded launches
    (`PreparedCall`) with the new call's tensors."""
    m, n, k = 40, 64, 64
    x = _rand((m, k), torch.float16, 91)
    w = _rand((n, k), torch.float16, 92, k**-0.5)
    b = _rand((n,), torch.float16, 93)
    ref = _ref64(x, w, b)
    top = ref.abs().topk(2, dim=1).indices.tolist()
    _flips_between(monkeypatch, [(r, c, MID_BIT[torch.float16]) for r in range(m) for c in top[r]])
    wc = WeightChecksums.compute(w, b)
    out = {}
    for form in ("persistent", "tile"):
        with override(gemm_persistent=form == "persistent"):
            out[form] = _run(x, w, b, wc=wc)
    assert out["persistent"][1] == out["tile"][1] == dict(ZERO, detected=m, recomputed=m)
    assert torch.equal(out["persistent"][0], out["tile"][0])
    tol = _gemm_rel_tol(torch.float16, k) * float(ref.abs().max())
    torch.testing.assert_close(out["tile"][0].double().cpu(), ref, rtol=0, atol=tol)
    _take("persistent", setopt)
    seen = _launched(monkeypatch)
    recorded = []
    cnt = new_counters(DEV)  # (a layer's counters: part of the call's signature)
    for i in range(2):
        with torch.no_grad():
            y = checked_gemm(x, w, b, wc=wc, counters=cnt)
        assert torch.equal(y, out["tile"][0])
        assert dict(FaultStats(cnt)) == {key: (i + 1) * v for key, v in out["tile"][1].items()}
        recorded.append(dict(wc.launches))
    assert seen == LAUNCHED["persistent"] * 2 and recorded[0] == recorded[1]  # the second call recorded nothing


def test_persistent_form_is_only_taken_where_it_pays(setopt):
    """``auto`` never takes it in the interpreter, nor for fp32, narrow N or unaligned rows; ``0`` never."""
    x = torch.zeros((64, 64), dtype=torch.float16, device=DEV)
    w = torch.zeros((64, 64), dtype=torch.float16, device=DEV)
    y = torch.zeros((64, 64), dtype=torch.float16, device=DEV)
    setopt(gemm_persistent=True)
    assert forms.persistent_ok(64, 64, 64, x, w, y)
    assert not forms.persistent_ok(64, 64, 64, x.float(), w.float(), y.float())
    x60 = torch.zeros((64, 60), dtype=torch.float16, device=DEV)  # rows of 120 bytes: no TMA
    assert not forms.persistent_ok(64, 64, 60, x60, w[:, :60], y)
    setopt(gemm_persistent=False)
    assert not forms.persistent_ok(64, 64, 64, x, w, y)
    setopt(gemm_persistent=None)
    if G.interpreting():
        assert not forms.persistent_ok(64, 64, 64, x, w, y)
    else:
        assert not forms.persistent_ok(4096, 896, 4864, x, w, y)  # narrow N
        assert not forms.persistent_ok(2048, 2048, 2048, x, w, y)  # too few multiply-adds
        assert not forms.persistent_ok(4096, 4864, 896, x, w, y)  # eager and host-bound


# --------------------------------------------------------------------------- the cuBLAS form


def _rounded_product(x, w, b, kn):
    """What the cuBLAS form returns on a clean call: its fp32 product (`calls.fp32_product`) plus the bias in
    fp32, rounded once to x's dtype (as a kernel rounds: the interpreter's fp32 → bf16 conversion truncates)."""
    m, n = x.shape[0], w.shape[1] if kn else w.shape[0]
    y32 = calls.fp32_product(x, w, kn, torch.empty((m, n), dtype=torch.float32, device=x.device))
    if b is not None:
        y32 += b.float()
    if x.dtype == torch.bfloat16 and G.interpreting():
        y32 = (y32.view(torch.int32) & -(1 << 16)).view(torch.float32)  # (exact in bf16)
    return y32.to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES16, ids=str)
@pytest.mark.parametrize("m,n,k,kn,with_bias", [
    (1, 150, 40, False, True),  # one row, three groups (the last 22 wide)
    (16, 64, 96, True, False),
    (64, 200, 192, False, False),  # one row block: its programs share the groups and split K
    (130, 150, 70, True, True),  # three row blocks, the last of 2 rows
    (300, 100, 33, False, True),  # five row blocks, one program each
], ids=["m1", "m16-conv1d", "m64", "m130-conv1d", "m300"])
def test_cublas_form_is_the_rounded_product_and_verifies_clean(dtype, m, n, k, kn, with_bias, monkeypatch, setopt):
    """The cuBLAS form returns its product rounded once, bias added in fp32 (bit for bit), within the GEMM
    bound of float64 and an ulp of the reference path's output; clean calls count nothing, as on the
    reference path; two launches: the product, then the verification that makes y."""
    _take("cublas", setopt)
    seen = _launched(monkeypatch)
    x = _rand((m, k), dtype, 1201 + m, 2.0)
    w = _rand((k, n) if kn else (n, k), dtype, 1202, k**-0.5)
    b = _rand((n,), dtype, 1203) if with_bias else None
    y, st = _run(x, w, b, kn=kn)
    assert seen == LAUNCHED["cublas"], seen
    assert st == ZERO
    assert torch.equal(y, _rounded_product(x, w, b, kn))
    ref = _ref64(x, w, b, kn)
    torch.testing.assert_close(y.double().cpu(), ref, rtol=2 * ULP[dtype], atol=2 * ULP[dtype] * float(ref.abs().max()))
    y_r, st_r = _reference(x, w, b, kn=kn)
    assert st_r == st
    torch.testing.assert_close(y.double().cpu(), y_r.double().cpu(), rtol=ULP[dtype], atol=0)


def test_cublas_form_blocks_and_checksum_plans(setopt):
    """`forms.check_blocks` and `forms.checksum_plan` on the interpreter's 4 SMs: 16-row check blocks up to 256
    rows, 64 beyond, as many groups per block as keep 8 programs within an 8192-element tile (a ragged last group
    block at 20 × 1100); the checksum programs' K split over up to 2 programs of at least 2 K blocks. Each plan
    checks like float64 (`_check_residuals`, both modes, a flip in the last group); on a GPU the same shapes,
    with its SMs' plans."""
    _take("cublas", setopt)
    dev = torch.device(DEV)
    cases = [((20, 150, 96), (16, 1), 1), ((20, 1100, 64), (16, 4), 1), ((300, 150, 64), (64, 2), 1),
             ((20, 150, 640), (16, 1), 2), ((300, 64, 40), (64, 1), 1)]
    for (m, n, k), blocks, splits in cases:
        if G.interpreting():
            assert forms.check_blocks(m, n, dev) == blocks, (m, n, k)
            assert forms.checksum_plan(m, k, 2 * -(-n // GC), dev)[5] == splits, (m, n, k)
        x = _rand((m, k), torch.float16, 1301, 1.0, "N(1,1)")
        w = _rand((n, k), torch.float16, 1302, k**-0.5)
        b = _rand((n,), torch.float16, 1303)
        _check_residuals(x, w, b, False, "accumulator")
        _check_residuals(x, w, b, False, "output")
        _check_residuals(x, w, b, False, "accumulator", where=lambda r, c, n=n: c >= (n - 1) // GC * GC)


@pytest.mark.parametrize("dtype", DTYPES16, ids=str)
def test_cublas_form_repairs_only_what_was_flipped(dtype, setopt):
    """Flips injected into the cuBLAS form's output (rounded values, as the tile GEMM injects them): a single
    flip is located and its element alone replaced, every other element bit for bit the clean call's and the
    replaced one within an ulp of it (the repair's own fp32 sum); two flips in one unit make it recomputed,
    the elements outside that unit untouched; without correction y keeps exactly the flipped values."""
    _take("cublas", setopt)
    m, k, n = 70, 64, 150
    x = _rand((m, k), dtype, 1401, 2.0)
    w = _rand((n, k), dtype, 1402, k**-0.5)
    b = _rand((n,), dtype, 1403)
    clean, st = _run(x, w, b)
    assert st == ZERO
    ref = _ref64(x, w, b)
    bit = MID_BIT[dtype]
    for count, pattern, want in (
            (1, lambda p: True, dict(detected=1, corrected=1)),
            (1, lambda p: p[0][0] >= 64 and p[0][1] >= 128, dict(detected=1, corrected=1)),  # ragged, 2nd row block
            (2, lambda p: len({(r, c // GC) for r, c in p}) == 1, dict(detected=1, recomputed=1))):
        spec = FaultSpec(site=SITE, bit=bit, count=count, seed=_seed_where(bit, count, m, n, dtype, ref, pattern))
        pos = _positions(spec, m, n, dtype)
        y, st = _run(x, w, b, plan=FaultPlan(spec))
        assert st == dict(ZERO, **want) == _reference(x, w, b, spec)[1], (count, st)
        touched = torch.zeros((m, n), dtype=torch.bool)
        for r, c in pos:
            if count == 1:
                touched[r, c] = True
            else:
                touched[r, c // GC * GC:(c // GC + 1) * GC] = True
        touched = touched.to(DEV)
        assert torch.equal(y[~touched], clean[~touched]), count
        torch.testing.assert_close(y[touched].double(), clean[touched].double(), rtol=ULP[dtype], atol=0)
        y_off, st_off = _run(x, w, b, plan=FaultPlan(spec), correct=False)
        assert st_off == dict(ZERO, detected=want["detected"], uncorrectable=want["detected"])
        flipped = clean.clone()
        iy = flipped.view(_ITY[dtype])
        for r, c in pos:
            iy[r, c] ^= torch.tensor(1 << bit, dtype=torch.int32).to(iy.dtype).to(iy.device)
        assert torch.equal(y_off, flipped), count


@pytest.mark.parametrize("where", ["w-inf", "b-nan", "x-nan"])
def test_cublas_form_nonfinite_inputs(where, setopt):
    """A non-finite W or b switches the call's checks off, a non-finite x row is skipped: one ``nonfinite_input``,
    as on the reference path, and y is still the rounded product (NaN/inf where they propagate)."""
    _take("cublas", setopt)
    m, k, n = 20, 32, 80
    x = _rand((m, k), torch.float16, 1501)
    w = _rand((n, k), torch.float16, 1502, k**-0.5)
    b = _rand((n,), torch.float16, 1503)
    if where == "w-inf":
        w[2, 7] = float("inf")
    elif where == "b-nan":
        b[70] = float("nan")
    else:
        x[3, 5] = float("nan")
    y, st = _run(x, w, b)
    assert st == dict(ZERO, nonfinite_input=1) == _reference(x, w, b)[1]
    torch.testing.assert_close(y, _rounded_product(x, w, b, False), rtol=0, atol=0, equal_nan=True)


def test_decode_rows_default_rule(monkeypatch, setopt):
    """``Options.gemm_decode_rows`` unset: on a CUDA device (not interpreted) calls of 17-128 rows with N ≤ 1536
    and M·N·K ≤ 3.1e8 take the decode kernel over row blocks (`forms.DECODE_AUTO_*`), ahead of the cuBLAS form
    unless that is forced; set, up to that many rows whatever the shape; never under the interpreter's default."""
    cuda = torch.device("cuda")
    monkeypatch.setattr(forms, "INTERP", False)
    setopt(gemm_decode_rows=None)
    for m, n, k, want in ((32, 896, 896, True), (64, 896, 4864, True), (128, 1536, 1536, True),
                          (128, 896, 4864, False), (32, 1537, 64, False), (129, 128, 64, False)):
        assert forms.decode_rows_auto(m, n, k, cuda) is want, (m, n, k)
        assert forms.grouped(m, n, k, torch.float16, cuda, None) is want, (m, n, k)
    assert not forms.grouped(32, 896, 896, torch.float32, cuda, None)  # (fp32: the tile form)
    assert not forms.decode_rows_auto(32, 896, 896, torch.device("cpu"))
    setopt(gemm_decode_rows=48)
    assert forms.grouped(48, 151936, 4096, torch.float16, cuda, None)
    assert not forms.grouped(49, 896, 896, torch.float16, cuda, None)
    monkeypatch.setattr(forms, "INTERP", True)
    setopt(gemm_decode_rows=None)
    assert not forms.grouped(32, 896, 896, torch.float16, cuda, None)


@pytest.mark.parametrize("split", [None, 2], ids=["unsplit", "split-K"])
def test_decode_kernel_over_row_blocks(split, monkeypatch, setopt):
    """``Options.gemm_decode_rows`` (``FTT_ABFT_GEMM_DECODE_ROWS``): calls of up to that many rows take the decode
    kernel as several row blocks of its BLOCK_M (launcher 6, the decode kernel with a call id; the spy sees 2), with
    and without split-K. A
    clean call is within the GEMM bound of float64 and counts nothing; flips in three row blocks (the last, 8 rows
    of 16) are found and corrected, counted like the reference path; non-finite x rows in two row blocks count one
    ``nonfinite_input`` for the call, as on the reference path; the repeated signature replays the same."""
    assert Options.from_env({"FTT_ABFT_GEMM_DECODE_ROWS": "64"}).gemm_decode_rows == 64
    setopt(gemm_decode_rows=48, gemm_cublas=False, gemm_split=split)
    seen = _launched(monkeypatch)
    m, n, k = 40, 150, 70
    for dtype in DTYPES16:
        x = _rand((m, k), dtype, 1701, 2.0)
        w = _rand((n, k), dtype, 1702, k**-0.5)
        b = _rand((n,), dtype, 1703)
        ref = _ref64(x, w, b)
        for _ in range(2):  # (the second call replays the prepared launch)
            seen.clear()
            y, st = _run(x, w, b)
            assert seen == [2] and st == ZERO, (seen, st)
            tol = _gemm_rel_tol(dtype, k) * float(ref.abs().max())
            assert float((y.double().cpu() - ref).abs().max()) <= tol
        bit = MID_BIT[dtype]
        spec = FaultSpec(site=SITE, bit=bit, count=3, seed=_seed_where(
            bit, 3, m, n, dtype, ref, lambda p: len({r // 16 for r, _ in p}) == 3))
        y_t, st_t = _run(x, w, b, plan=FaultPlan(spec))
        assert st_t == _reference(x, w, b, spec)[1] == dict(ZERO, detected=3, corrected=3), st_t
        assert float((y_t.double().cpu() - ref).abs().max()) <= _gemm_rel_tol(dtype, k) * float(ref.abs().max())
        xn = x.clone()
        xn[3, 5] = float("nan")
        xn[37, 0] = float("inf")
        assert _run(xn, w, b)[1] == _reference(xn, w, b)[1] == dict(ZERO, nonfinite_input=1)


def test_cublas_form_only_where_switched_on(monkeypatch, setopt):
    """``Options.gemm_cublas`` (``FTT_ABFT_GEMM_CUBLAS``): unset, no call on the CPU or under the interpreter
    takes the cuBLAS form; on, every checked fp16/bf16 call does, decode-sized ones too; fp32 calls and the
    plain GEMM never."""
    assert Options.from_env({}).gemm_cublas is None
    assert Options.from_env({"FTT_ABFT_GEMM_CUBLAS": "1"}).gemm_cublas is True
    assert Options.from_env({"FTT_ABFT_GEMM_CUBLAS": "0"}).gemm_cublas is False
    with pytest.raises(ValueError, match="FTT_ABFT_GEMM_CUBLAS"):
        Options.from_env({"FTT_ABFT_GEMM_CUBLAS": "on"})
    seen = _launched(monkeypatch)
    x16, w16 = _rand((6, 32), torch.float16, 1601), _rand((64, 32), torch.float16, 1602)
    x32, w32 = x16.float(), w16.float()
    for switch, x, w, detect, want in ((None, x16, w16, True, [2]), (None, x16.repeat(4, 1), w16, True, [0, 1]),
                                       (True, x16, w16, True, [4, 5]), (True, x16.repeat(4, 1), w16, True, [4, 5]),
                                       (True, x32, w32, True, [0, 1]), (True, x16, w16, False, [0])):
        setopt(gemm_cublas=switch)
        seen.clear()
        _run(x, w, detect=detect)
        assert seen == want, (switch, x.shape, x.dtype, detect, seen)


def test_cublas_form_default_rule(monkeypatch, setopt):
    """``Options.gemm_cublas`` unset: fp16/bf16 calls on a CUDA device (not interpreted) take the cuBLAS form
    where it was measured ahead (`forms.CUBLAS_AUTO`): 16 < M ≤ 256 up to N = 18,944; to 512, N ≤ 4096; to 1024,
    N ≤ 1536; beyond, N ≤ 512; K any; in a graph being captured, or eager where the call is not host-bound.
    CPU, interpreted and fp32 calls never; the switch off, none."""
    import types

    cuda16 = types.SimpleNamespace(dtype=torch.float16, device=torch.device("cuda"), shape=(1, 896))
    monkeypatch.setattr(forms, "INTERP", False)
    monkeypatch.setattr(forms, "capturing", lambda: True)
    setopt(gemm_cublas=None)
    for m, n, want in ((1, 896, False), (16, 896, False), (17, 896, True), (64, 896, True), (128, 128, True),
                       (128, 4864, True), (256, 18944, True), (256, 18945, False), (256, 151936, False),
                       (257, 4096, True), (512, 4096, True), (512, 4097, False), (513, 1536, True),
                       (1024, 1537, False), (1025, 512, True), (4096, 513, False), (4096, 896, False)):
        assert forms.cublas_ok(m, n, cuda16) is want, (m, n)
    assert forms.cublas_ok(128, 896, types.SimpleNamespace(dtype=torch.bfloat16, device=torch.device("cuda"),
                                                           shape=(1, 896)))
    assert not forms.cublas_ok(128, 896, types.SimpleNamespace(dtype=torch.float32, device=torch.device("cuda"),
                                                               shape=(1, 896)))
    assert not forms.cublas_ok(128, 896, torch.zeros(128, 8, dtype=torch.float16))  # a CPU tensor
    monkeypatch.setattr(forms, "capturing", lambda: False)  # eager: host-bound calls keep the fused form
    assert not forms.cublas_ok(128, 896, cuda16)
    wide_k = types.SimpleNamespace(dtype=torch.float16, device=torch.device("cuda"), shape=(1, 16384))
    assert forms.host_bound(128, 18944, 16384) and not forms.host_bound(256, 18944, 16384)
    assert not forms.cublas_ok(128, 18944, wide_k) and forms.cublas_ok(256, 18944, wide_k)
    monkeypatch.setattr(forms, "capturing", lambda: True)
    setopt(gemm_cublas=False)
    assert not forms.cublas_ok(128, 896, cuda16)
    monkeypatch.setattr(forms, "INTERP", True)
    setopt(gemm_cublas=None)
    assert not forms.cublas_ok(128, 896, cuda16)


# --------------------------------------------------------------------------- inputs


@pytest.mark.parametrize("where", ["x-nan", "x-inf", "w-inf", "b-nan"])
def test_nonfinite_inputs_count_once(where):
    """A non-finite x row is skipped, a non-finite W or b switches the call's checks off: either way one
    ``nonfinite_input`` for the call, nothing else, and y is the plain GEMM's (NaN/inf propagate)."""
    x = _rand((20, 32), torch.float32, 41)
    w = _rand((24, 32), torch.float32, 42)
    b = _rand((24,), torch.float32, 43)
    if where == "x-nan":
        x[3, 5] = float("nan")
    elif where == "x-inf":
        x[17, 0] = float("-inf")
    elif where == "w-inf":
        w[2, 7] = float("inf")
    else:
        b[20] = float("nan")
    y, st = _run(x, w, b)
    assert st == dict(ZERO, nonfinite_input=1)
    torch.testing.assert_close(y.cpu(), F.linear(x, w, b).cpu(), equal_nan=True, rtol=1e-5, atol=1e-5)
    assert _reference(x, w, b)[1] == st


def _checksums_of(module) -> list:
    """The `WeightChecksums` cached on ``module`` (`ft_transformers.vabft.weight_checksums`)."""
    cache = module.__dict__.get("_ftt_vabft_checksums") or {}
    return [entry[3] for entry in cache.values()]


@pytest.mark.parametrize("m,form", [(5, "decode"), (5, "decode-nosplit"), (40, "tile"), (40, "persistent"),
                                    (40, "cublas")])
def test_prepared_calls_match_first_calls(m, form, monkeypatch, setopt):
    """A repeated call signature takes the prepared launches (`PreparedCall`): new x, y, group sums buffer
    (none for the decode kernel without split-K) and call id each time. Results equal float64 and a
    fresh first call's; a NaN in a later call's x is counted once, as on the first call; another
    weight version, alignment or setting prepares anew."""
    setopt(gemm_tma=False)  # tile calls through TMA descriptors are not prepared (descriptors hold pointers)
    _take(form.split("-")[0], setopt)
    if form == "decode-nosplit":
        setopt(gemm_split=1)
    k = 96  # three K blocks of the interpreter config
    lin = torch.nn.Linear(k, 24).to(DEV, torch.float16)
    cnt = new_counters(DEV)

    def call(x):  # the checked linear's Triton backend (its checksum cache on the module)
        with torch.no_grad():
            y = _cl._triton(G.linear_forward, x, lin.weight, lin.bias, k, 24, False, None, 2.5, True, True, None, cnt,
                            lin, None)
        return y

    xs = [_rand((m, k), torch.float16, 80 + i) for i in range(3)]
    ys = []
    for x in xs:
        ys.append(call(x))
        ref = _ref64(x, lin.weight.detach(), lin.bias.detach())
        assert ((ys[-1].double().cpu() - ref).abs().max() / ref.abs().max()).item() < _gemm_rel_tol(torch.float16, k)
    (checksums,) = _checksums_of(lin)
    assert len(checksums.launches) == 1  # one signature, prepared once, then reused
    (prep,) = checksums.launches.values()
    assert [e[0] for e in prep.launches] == LAUNCHED[form.split("-")[0]]  # the launchers
    if form == "decode-nosplit" or G.interpreting():  # (on a GPU K = 96 is one K block: never split)
        assert (prep.p_numel == 0) == (form == "decode-nosplit")
    assert FaultStats(cnt)["detected"] == 0
    # a replay equals a first call of the same inputs (a fresh module: nothing prepared)
    fresh_lin = torch.nn.Linear(k, 24).to(DEV, torch.float16)
    fresh_lin.load_state_dict(lin.state_dict())
    with torch.no_grad():
        y_first = _cl._triton(G.linear_forward, xs[2], fresh_lin.weight, fresh_lin.bias, k, 24, False, None, 2.5,
                              True, True, None, new_counters(DEV), fresh_lin, None)
    assert torch.equal(y_first, ys[2])
    bad = xs[0].clone()
    bad[m - 1, 3] = float("nan")
    y = call(bad)
    assert dict(FaultStats(cnt)) == dict(ZERO, nonfinite_input=1)
    assert torch.isnan(y[m - 1]).any() and not torch.isnan(y[: m - 1]).any()
    call(_rand((m * k + 1,), torch.float16, 90)[1:].view(m, k))  # 2 bytes off: a fresh signature
    assert len(checksums.launches) == 2
    with torch.no_grad():
        lin.weight.mul_(2.0)  # a new weight version: new checksums, nothing prepared yet
    y = call(xs[1])
    (fresh,) = _checksums_of(lin)
    assert fresh is not checksums and len(fresh.launches) == 1
    ref = _ref64(xs[1], lin.weight.detach(), lin.bias.detach())
    assert ((y.double().cpu() - ref).abs().max() / ref.abs().max()).item() < _gemm_rel_tol(torch.float16, k)


def test_module_fast_path_like_full_path(monkeypatch, setopt):
    """A protected model's Linear/Conv1D calls take the module's fast path (`FastPath`) from the
    second call of a signature on: same outputs as the first (full-path) call and as the unprotected
    model; a call with active faults, an in-place weight update, or a grad-mode change take the full
    path again; disabled models and copies of a fast path's holder carry none (a protected layer refuses copies)."""
    import copy  # noqa: PLC0415

    from tiny_models import make_model  # noqa: PLC0415

    setopt(gemm_tma=False)
    monkeypatch.setattr(_cl, "_resolve_backend", lambda backend, device: G.linear_forward)
    hits = []
    real_call = prepared.FastPath.__call__

    def counting_call(self, *args):
        y = real_call(self, *args)
        hits.append(y is not None)
        return y

    monkeypatch.setattr(prepared.FastPath, "__call__", counting_call)
    model = make_model("gpt2").to(DEV)
    ids = torch.randint(3, 500, (1, 8), device=DEV)
    with torch.no_grad():
        plain = model(ids).logits
        ftt.enable_fault_tolerance(model, ftt.FTConfig(attention=False))
        first = model(ids).logits
        patched = ftt.protect._state(model).patched
        assert all(_cl._FAST_PATH_ATTR in m.__dict__ for m in patched) and not any(hits)
        second = model(ids).logits
        assert len(hits) == len(patched) and all(hits)
        assert torch.equal(first, second)
        torch.testing.assert_close(second, plain, rtol=1e-4, atol=1e-4)
        hits.clear()
        spec = ftt.FaultSpec(site=SITE, bit=29, count=1, seed=5, layers=[0])
        with ftt.inject_faults(model, spec):
            faulty = model(ids).logits
        report = ftt.fault_report(model)
        assert report.totals()["corrected"] >= 1, report
        torch.testing.assert_close(faulty, plain, rtol=1e-4, atol=1e-4)
        mlp = model.transformer.h[1].mlp.c_fc
        mlp.weight.mul_(0.5)  # in place: a new version, new checksums, the full path
        hits.clear()
        updated = model(ids).logits
        assert hits.count(False) == 1
    ftt.disable_fault_tolerance(model)
    with torch.no_grad():
        torch.testing.assert_close(updated, model(ids).logits, rtol=1e-4, atol=1e-4)
    assert not any(_cl._FAST_PATH_ATTR in m.__dict__ for m in patched)
    with torch.no_grad():
        ftt.enable_fault_tolerance(model, ftt.FTConfig(attention=False))
        model(ids)
    with pytest.raises(TypeError, match="cannot be pickled or copied"):  # (a copy would report into the model's)
        copy.deepcopy(model.transformer.h[0].mlp.c_fc)
    fast = model.transformer.h[0].mlp.c_fc.__dict__[_cl._FAST_PATH_ATTR]
    holder = types.SimpleNamespace(**{_cl._FAST_PATH_ATTR: fast})  # copies of any holder carry no fast path
    assert fast is not None and copy.deepcopy(holder).__dict__.get(_cl._FAST_PATH_ATTR) is None


def test_bad_inputs_raise_clear_errors(setopt):
    x = _rand((4, 8), torch.float32, 0)
    w = _rand((5, 8), torch.float32, 1)
    cnt = new_counters(DEV)
    with pytest.raises(G.AbftGemmUnsupported, match="float16, bfloat16"):
        checked_gemm(x.double(), w.double(), None, counters=cnt)
    with pytest.raises(TypeError, match="share one dtype"):
        checked_gemm(x.half(), w, None, counters=cnt)
    with pytest.raises(ValueError, match="in_features"):
        checked_gemm(x[:, :7], w, None, counters=cnt)
    with pytest.raises(ValueError, match="bias must have shape"):
        checked_gemm(x, w, torch.zeros(4, device=DEV), counters=cnt)
    with pytest.raises(ValueError, match="counters"):
        checked_gemm(x, w, None, counters=torch.zeros(3, dtype=torch.int32, device=DEV))
    with pytest.raises(ValueError, match="mode"):
        checked_gemm(x, w, None, counters=cnt, mode="fused")
    with pytest.raises(ValueError, match="2-D"):
        checked_gemm(x[None], w, None, counters=cnt)
    # the public entry point validates before dispatching to the kernel
    with pytest.raises(ValueError, match="in_features"):
        ftt.checked_linear(torch.randn(3, 7, device=DEV), w, backend="triton")
    # a checked tile call sums whole check groups per tile: a forced BLOCK_N that is not a multiple of 64
    # is refused (the plain GEMM takes it)
    setopt(gemm_config=(16, 32, 32, 4, 1))
    with pytest.raises(ValueError, match="multiple of 64"):
        checked_gemm(x, w, None, counters=cnt)
    y, st = _run(x, w, detect=False)
    assert st == ZERO
    torch.testing.assert_close(y.double().cpu(), _ref64(x, w), rtol=1e-5, atol=1e-5)


def test_degenerate_shapes():
    w = _rand((6, 8), torch.float32, 1)
    y, st = _run(torch.zeros((0, 8), device=DEV), w)
    assert y.shape == (0, 6) and st == ZERO
    b = _rand((6,), torch.float32, 2)
    y, st = _run(torch.zeros((3, 0), device=DEV), torch.zeros((6, 0), device=DEV), b)
    assert torch.equal(y, b.expand(3, 6)) and st == ZERO


def test_autocast_and_cached_weight_checksums():
    lin = torch.nn.Linear(48, 24).to(DEV)
    x = _rand((5, 48), torch.float32, 3)
    cnt = new_counters(DEV)
    with torch.no_grad():
        y = _cl._triton(G.linear_forward, x, lin.weight, lin.bias, 48, 24, False, None, 2.5, True, True, None, cnt,
                        lin, None)
        wc = lin._ftt_vabft_checksums[None][-1]
        assert isinstance(wc, WeightChecksums)
        torch.testing.assert_close(y, lin(x), rtol=1e-5, atol=1e-5)
        lin.weight.mul_(2.0)  # in-place update: the cache must refresh
        y2 = _cl._triton(G.linear_forward, x, lin.weight, lin.bias, 48, 24, False, None, 2.5, True, True, None, cnt,
                         lin, None)
        torch.testing.assert_close(y2, lin(x), rtol=1e-5, atol=1e-5)
        # under autocast the operands are cast as autocast would (bf16 on CPU, fp16 on CUDA), checksums of
        # the cast weight cached beside the fp32 ones
        cast = torch.float16 if DEV == "cuda" else torch.bfloat16
        with torch.autocast(DEV, dtype=cast):
            y3, _ = ftt.checked_linear(x, lin.weight, lin.bias, backend="triton")
        assert y3.dtype == cast
        torch.testing.assert_close(y3.double().cpu(), _ref64(x.to(cast), lin.weight.to(cast), lin.bias.to(cast)),
                                   rtol=4 * ULP[cast], atol=4 * ULP[cast])
    assert int(cnt.sum()) == 0


# --------------------------------------------------------------------------- the tuner


def test_tuner_times_nothing_while_capturing(monkeypatch, setopt):
    """A call captured into a CUDA graph before any eager call of its shape cannot time candidates
    (timing synchronises): it takes the first candidate and leaves the cache empty, so that the next
    eager call still tunes."""
    monkeypatch.setattr(forms, "INTERP", False)
    setopt(gemm_config=None, gemm_tune=True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)

    def no_timing(*args, **kwargs):
        raise AssertionError("a candidate was timed during a capture")

    monkeypatch.setattr(tuning, "gpu_time", no_timing)
    x, w = torch.randn(200, 96), torch.randn(80, 96)
    launch = calls._Launch(x=x, w=w, b=None, y=torch.empty(200, 80), swn=w.stride(0), swk=w.stride(1))
    before = dict(tuning._TUNE_CACHE)
    for dtype in (torch.float32, torch.float16):
        launch.x, launch.w, launch.y = x.to(dtype), w.to(dtype), launch.y.to(dtype)
        cfg = tuning.pick_config(launch, bias=None, detect=True, verify_output=False, dot_f32=dtype == torch.float32)
        assert len(tuning._candidates(dtype, 200, 80)) > 1 and cfg == tuning._candidates(dtype, 200, 80)[0]
        assert cfg[1] % GC == 0  # a checked tile call's tiles hold whole check groups
    assert tuning._TUNE_CACHE == before


def test_narrow_outputs_also_time_narrow_tiles():
    """Many rows and few output columns (a k_proj/v_proj prefill): the tuner also times tiles narrow enough
    to give such a call more programs; wide outputs keep the large-tile list."""
    narrow = tuning._candidates(torch.float16, 4096, 128)
    wide = tuning._candidates(torch.float16, 4096, 4864)
    assert wide == configs.CONFIGS_LARGE
    assert set(configs.CONFIGS_LARGE) < set(narrow)
    assert min(c[0] * c[1] for c in narrow) * 4 <= min(c[0] * c[1] for c in wide)


def test_split_k_plans_cover_k_without_empty_splits(setopt):
    """`forms.split_k`: every split gets at least one K block and together they cover K exactly, forced or
    not; no split past SPLIT_MAX_TILES tiles (their counts live in `calls._cells`); a bad forced value is
    refused. `forms.split_plan`: only the plain GEMM of one row block splits (a checked tile call keeps
    its group sums whole)."""
    dev = torch.device(DEV)
    for forced in (None, 1, 3, 64):
        setopt(gemm_split=forced)
        for n in (16, 40, 896, 4864):
            for k in (32, 100, 896, 4864):
                n_split, per = forms.split_k(n, k, 32, 64, dev)
                nkb = -(-k // 64)
                assert n_split >= 1 and per >= 1 and (n_split - 1) * per < nkb <= n_split * per, (n, k, n_split, per)
                if forced == 1:
                    assert n_split == 1
        wide = 32 * (forms.SPLIT_MAX_TILES + 1)
        assert forms.split_k(wide, 4096, 32, 64, dev)[0] == 1
    setopt(gemm_split=4)
    cfg = (16, 64, 64, 4, 1)
    assert forms.split_plan(8, 128, 1024, cfg, False, dev)[0] == 4
    assert forms.split_plan(8, 128, 1024, cfg, True, dev) == (1, 1)  # checked
    assert forms.split_plan(40, 128, 1024, cfg, False, dev) == (1, 1)  # several row blocks
    assert forms.split_plan(8, 128, 1024, (*cfg, False), False, dev) == (1, 1)  # timed faster unsplit
    with pytest.raises(ValueError, match="gemm_split"), override(gemm_split=0):
        pass
    with pytest.raises(ValueError, match="FTT_ABFT_GEMM_SPLIT"):
        Options.from_env({"FTT_ABFT_GEMM_SPLIT": "0"})


@pytest.mark.skipif(DEV != "cpu", reason="stand-in timings and the interpreter's 4 SMs (split-K counts)")
def test_tuner_times_tile_calls_in_the_form_they_run(monkeypatch, setopt):
    """The tuner times a small call's tile-GEMM candidates as the call runs them, over the weight and a
    copy of it (a decode call streams its weight from memory): the plain GEMM's each with split-K (where
    it applies) and without; a checked call's (the tile form: fp32, or a call with debug output) only
    those whose tiles hold whole 64-column groups, never split (its epilogue leaves group sums). Each
    timed launch runs once under the interpreter; the split counts are back to 0 after them, and the
    pick is the fastest candidate, a 6-tuple ending in False when it is the unsplit form of a split one."""
    monkeypatch.setattr(forms, "INTERP", False)
    setopt(gemm_config=None, gemm_tune=True, gemm_split=None)
    monkeypatch.setattr(torch.cuda, "device", lambda dev: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(tuning, "CONFIGS_SMALL", [(16, 64, 64, 4, 1), (16, 128, 64, 4, 1), (16, 32, 64, 4, 1)])
    monkeypatch.setattr(tuning, "TUNE_STREAM_COPIES", 2)  # (8 on a GPU)
    seen, weights = [], []
    real = calls._GEMM_LAUNCH
    at = {a: tile._gemm_kernel.arg_names.index(a) for a in ("n_split", "W")}

    def spy(grid, args, kwargs):
        weights.append(args[at["W"]])
        if len(weights) % 2 == 1:  # each timed run: the call over the weight, then over its copy
            seen.append((kwargs["BLOCK_N"], kwargs["DETECT"], kwargs["SPLIT"], args[at["n_split"]]))
        return real(grid, args, kwargs)

    times = {(64, True): 2.0, (64, False): 1.0, (128, True): 4.0, (128, False): 3.0, (32, False): 5.0}

    def one_run(run):
        run()
        return times[seen[-1][0], seen[-1][2]]  # (BLOCK_N, split-K): "ms"

    monkeypatch.setattr(calls, "_GEMM_LAUNCH", spy)
    monkeypatch.setattr(calls, "_VERIFY_LAUNCH", _no_second_launch)  # (a tile call is timed as its GEMM)
    monkeypatch.setattr(tuning, "gpu_time", one_run)
    monkeypatch.setattr(tuning, "_TUNE_CACHE", {})
    x = _rand((2, 640), torch.float16, 5)
    w = _rand((128, 640), torch.float16, 6, 640**-0.5)
    launch = calls._Launch(x=x, w=w, b=None, y=torch.empty(2, 128, dtype=x.dtype), swn=w.stride(0), swk=w.stride(1))
    # the plain GEMM: 128 / 64 = 2 tiles on the interpreter's 4 SMs: 2 splits of 5 K blocks of 64; 1 tile of
    # 128: 4 splits of 3 (the last of 1); 4 tiles of 32: no split
    cfg = tuning.pick_config(launch, bias=None, detect=False, verify_output=False, dot_f32=True)
    assert seen == [(64, False, True, 2), (64, False, False, 1), (128, False, True, 4), (128, False, False, 1),
                    (32, False, False, 1)], seen
    assert cfg == (16, 64, 64, 4, 1, False)
    assert forms.split_plan(2, 128, 640, cfg, False, x.device) == (1, 1)
    seen.clear()
    cfg = tuning.pick_config(launch, bias=None, detect=True, verify_output=False, dot_f32=True)
    assert seen == [(64, True, False, 1), (128, True, False, 1)], seen
    assert cfg == (16, 64, 64, 4, 1)
    assert int(calls._cells(x.device).abs().sum().item()) == 0
    # timed over the weight and a copy of it
    assert all(weights[i] is w for i in range(0, len(weights), 2))
    copies = weights[1::2]
    assert all(v is not w and v.stride() == w.stride() and torch.equal(v, w) for v in copies)


# --------------------------------------------------------------------------- GPU, real shapes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 64], ids=["decode", "tile"])
def test_gpu_graph_replays_count_nonfinite_per_replay(m):
    """A call captured into a CUDA graph (the decode kernel, or the tile GEMM and the group verification,
    whose flag cell is reset by a memset captured with it): a replay whose x holds a NaN counts one
    nonfinite_input, clean replays count nothing and match F.linear, a NaN replay after clean ones counts
    again, and the tile form's other rows stay right in a NaN replay."""
    k, n = 896, 4864
    lin = torch.nn.Linear(k, n, device="cuda", dtype=torch.float16)
    x = torch.randn(m, k, device="cuda", dtype=torch.float16)
    cnt = new_counters("cuda")

    def call():
        return _cl._triton(G.linear_forward, x, lin.weight, lin.bias, k, n, False, None, 2.5, True, True, None, cnt,
                           lin, None)

    pattern = (False, True, False, False, True, False)
    with torch.no_grad():
        graph, y = captured(call, warmups=3)  # the warm-up tunes and prepares the call
        clean = x.clone()
        seen = []
        for nan in pattern:
            x.copy_(clean)
            if nan:
                x[m - 1, 7] = float("nan")
            cnt.zero_()
            graph.replay()
            torch.cuda.synchronize()
            seen.append(dict(FaultStats(cnt)))
            ok = m - 1 if nan else m
            torch.testing.assert_close(y[:ok], F.linear(x[:ok], lin.weight, lin.bias), rtol=2e-3, atol=2e-3)
    assert seen == [dict(ZERO, nonfinite_input=1) if nan else ZERO for nan in pattern], seen


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_real_shapes_clean_and_flips(dtype, setopt):
    """Clean calls at Qwen2-0.5B-like shapes (the decode kernel, the tuned tile form with up to four check
    groups per tile; the cuBLAS form switched off, its own tests cover it) over four distributions: no event,
    within the GEMM bound of float64. Then single 0→1 flips of high exponent bits (what the V-ABFT
    specification measures) found and repaired, counted like the reference path wherever it finds them too
    (its fp32-output table differs from the kernel's)."""
    setopt(gemm_cublas=False)
    g = torch.Generator(device="cuda").manual_seed(0)
    n_calls = 0
    total = {k: 0 for k in ZERO}
    scale = 1e-2 if dtype == torch.float16 else 1.0
    for dist in DISTS:
        for (m, k, n) in [(1, 896, 4864), (16, 4864, 896), (512, 2048, 2048), (2048, 4096, 1024), (64, 896, 151936)]:
            x = (sample_matrix(dist, (m, k), g) * scale).to(dtype)
            w = (sample_matrix(dist, (n, k), g) * scale / k**0.5).to(dtype)
            b = (sample_matrix(dist, (n,), g) * scale).to(dtype)
            y, st = _run(x, w, b)
            n_calls += 1
            for key in total:
                total[key] += st[key]
            ref = x.double() @ w.double().t() + b.double()
            err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
            tol = _gemm_rel_tol(dtype, k)
            assert err < tol, (dist, m, k, n, err, tol)
    assert total == ZERO, f"false positives over {n_calls} calls: {total}"
    x = torch.randn(4, 256, 1024, device="cuda", generator=g).to(dtype)
    w = (torch.randn(2048, 1024, device="cuda", generator=g) / 32).to(dtype)
    clean = F.linear(x, w)
    repaired_tol = _gemm_rel_tol(dtype, 1024) * clean.abs().max().item()
    for bit in HIGH_BIT[dtype]:
        checked = det_t = 0
        for seed in range(5000):  # fp32 bit 27 is 0 only in values below ~2^-8
            spec = FaultSpec(site=SITE, bit=bit, count=1, seed=seed)
            ((r, c),) = _positions(spec, 1024, 2048, dtype)
            if (clean.reshape(-1, 2048)[r, c].view(_ITY[dtype]) >> bit) & 1:
                continue
            with torch.no_grad():
                y_t, st_t = ftt.checked_linear(x, w, inject=spec, backend="triton")
                _, st_r = ftt.checked_linear(x, w, inject=spec, backend="reference")
            st_t, st_r = dict(st_t), dict(st_r)
            assert st_t["uncorrectable"] == 0 and st_t["corrected"] + st_t["recomputed"] == st_t["detected"], st_t
            # (whether a unit is corrected or recomputed may differ: the reference's e_max is not the kernel's)
            assert st_t["detected"] == st_r["detected"] or not st_t["detected"], (bit, seed, st_t, st_r)
            if st_t["detected"]:  # repaired: the located element is recomputed as a dot in another order
                torch.testing.assert_close(y_t.float(), clean.float(), rtol=0.0, atol=repaired_tol)
            det_t += st_t["detected"]
            checked += 1
            if checked == 8:
                break
        assert checked >= 4 and det_t >= checked - 1, (bit, checked, det_t)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", DTYPES16, ids=str)
@pytest.mark.parametrize("form", ["tile", "persistent"])
def test_gpu_group_verification_at_real_shapes(dtype, form, monkeypatch, setopt):
    """The tile and persistent forms at a wide prefill shape with their GPU configs (the persistent form
    forced: 512 × 4096 × 1024 is below its size threshold; 16 verification blocks, split over K on a GPU of
    32 or more SMs): the verification's quantities against float64 (`_check_residuals`, group sums of
    tiles holding 2-4 groups), clean calls with no event, and single flips made between the GEMM and its
    verification found, located and corrected, counted like the reference path at the same positions."""
    setopt(gemm_persistent=form == "persistent", gemm_cublas=False)
    seen = _launched(monkeypatch)
    m, k, n = 512, 1024, 4096
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).to(dtype)
    b = torch.randn(n, device="cuda", generator=g).to(dtype)
    _check_residuals(x, w, b, False, "accumulator")
    assert seen[:2] == LAUNCHED[form], seen
    ref = _ref64(x, w, b)
    tol = _gemm_rel_tol(dtype, k) * float(ref.abs().max())
    y, st = _run(x, w, b)
    assert st == ZERO and float((y.double().cpu() - ref).abs().max()) <= tol
    bit = MID_BIT[dtype]  # ×2^±8 (fp16) or ×2^±64 (bf16): finite
    checked = 0
    for seed in range(16):
        spec = FaultSpec(site=SITE, bit=bit, count=3, seed=seed)
        pos = _positions(spec, m, n, dtype)
        if len({(r, c // GC) for r, c in pos}) < 3 or not all(MIN_FLIPPED < abs(float(ref[r, c])) < 100
                                                               for r, c in pos):
            continue
        with monkeypatch.context() as mp:
            _flips_between(mp, [(r, c, bit) for r, c in pos])
            y_t, st_t = _run(x, w, b)
        _, st_r = _reference(x, w, b, spec)
        assert st_t == st_r == dict(ZERO, detected=3, corrected=3), (seed, st_t, st_r)
        assert float((y_t.double().cpu() - ref).abs().max()) <= tol
        checked += 1
    assert checked >= 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", DTYPES16, ids=str)
def test_gpu_checksums_repeat_bit_for_bit_without_split(dtype, setopt):
    """The verification's checksum C at a call of several row blocks and no split-K (512 × 18,432 × 896: 72
    verification blocks, more than half the SMs of an H100 or H200), three calls on the same operands: C is
    bit-identical every time, and within 0.1 of the threshold of the float64 checksum in fp16. With x's
    statistics reduced inside the pipelined dot loop, Triton 3.6's code computed a wrong C in 0.02-0.6 % of
    such a call's units (up to 0.3 of the threshold), a different set at each call."""
    setopt(gemm_cublas=False)
    m, k, n = 512, 896, 18432
    assert forms.verify_split(m, n, k, torch.device("cuda"))[0] == 1
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).to(dtype)
    emax, emax_var = gemm_emax(dtype, x.device, "accumulator", k)
    runs = [G.gemm_residuals(x, w, None, emax=emax, emax_var=emax_var) for _ in range(3)]
    assert all(torch.equal(r["c"], runs[0]["c"]) for r in runs[1:])
    if dtype == torch.float16:
        c64 = x.double() @ _group_sums64(w.t(), n).to(x.device)  # (M, K) @ (K, ⌈N/64⌉)
        assert float(((runs[0]["c"].double() - c64).abs() / runs[0]["thr"].double()).max()) <= 0.1
    assert all(dict(FaultStats(r["counters"])) == ZERO for r in runs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_cublas_form_by_default_in_graphs(monkeypatch, setopt):
    """``Options.gemm_cublas`` unset, a short prompt's call (128 × 4864 × 896, fp16, a gate projection): eager,
    host-bound, it takes the tile form; captured into a CUDA graph it takes the cuBLAS form (its kernels first
    compiled during that capture, its checksum programs a branch of the graph), and the replay's y agrees with
    float64 within the GEMM bound and with the eager y within an ulp, with no event."""
    setopt(gemm_cublas=None)
    seen = _launched(monkeypatch)
    g = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(128, 896, device="cuda", generator=g).half()
    w = (torch.randn(4864, 896, device="cuda", generator=g) / 896**0.5).half()
    b = torch.randn(4864, device="cuda", generator=g).half()
    wc, cnt = WeightChecksums.compute(w, b), new_counters(DEV)
    y = checked_gemm(x, w, b, wc=wc, counters=cnt)
    assert seen == LAUNCHED["tile"], seen
    seen.clear()
    graph, y_graph = captured(lambda: checked_gemm(x, w, b, wc=wc, counters=cnt), warmups=2)
    assert seen[-2:] == LAUNCHED["cublas"] and seen[:-2] == LAUNCHED["tile"] * 2, seen
    cnt.zero_()
    y_graph.zero_()
    graph.replay()
    ref = _ref64(x, w, b)
    tol = _gemm_rel_tol(torch.float16, 896) * float(ref.abs().max())
    assert float((y_graph.double().cpu() - ref).abs().max()) <= tol
    torch.testing.assert_close(y_graph, y, rtol=ULP[torch.float16], atol=0)
    assert dict(FaultStats(cnt)) == ZERO


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", DTYPES16, ids=str)
@pytest.mark.parametrize("m,n,k", [(1, 4864, 896), (64, 896, 4864), (128, 4864, 896), (512, 2688, 896)],
                         ids=["decode", "short-down", "short-gate", "prefill-qkv"])
def test_gpu_cublas_form_at_real_shapes(dtype, m, n, k, monkeypatch, setopt):
    """The cuBLAS form at Qwen2-0.5B's layer shapes: y is cuBLAS's fp32 product plus the bias rounded once, bit
    for bit; the verification's quantities against float64 (`_check_residuals`: cuBLAS's summation order within
    the fp32 bound, the checksum programs' dots and statistics from the side stream); clean calls, eager and
    replayed from a CUDA graph (the side stream's branch captured), with no event and the same y; flips injected
    at ``linear.output`` in three units found, located and corrected, counted like the reference path."""
    _take("cublas", setopt)
    seen = _launched(monkeypatch)
    g = torch.Generator(device="cuda").manual_seed(m + n + k)
    x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).to(dtype)
    b = torch.randn(n, device="cuda", generator=g).to(dtype)
    wc = WeightChecksums.compute(w, b)
    y, st = _run(x, w, b, wc=wc)
    assert seen == LAUNCHED["cublas"], seen
    assert st == ZERO and torch.equal(y, _rounded_product(x, w, b, False))
    _check_residuals(x, w, b, False, "accumulator")
    cnt = new_counters(DEV)
    graph, y_graph = captured(lambda: checked_gemm(x, w, b, wc=wc, counters=cnt), warmups=3)
    cnt.zero_()
    y_graph.zero_()
    graph.replay()
    assert torch.equal(y_graph, y) and dict(FaultStats(cnt)) == ZERO
    ref = _ref64(x, w, b)
    tol = _gemm_rel_tol(dtype, k) * float(ref.abs().max())
    bit = MID_BIT[dtype]
    spec = FaultSpec(site=SITE, bit=bit, count=3, seed=_seed_where(
        bit, 3, m, n, dtype, ref, lambda p: len({(r, c // GC) for r, c in p}) == 3))
    y_t, st_t = _run(x, w, b, plan=FaultPlan(spec))
    assert st_t == _reference(x, w, b, spec)[1] == dict(ZERO, detected=3, corrected=3), st_t
    assert float((y_t.double().cpu() - ref).abs().max()) <= tol


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_direct_launch_respecialises(setopt):
    """Repeated calls go through `DirectLauncher` (no Triton binding), and a call whose pointers or
    ints specialise differently (a 2-byte-offset view, an odd row count, M = 1) gets its own kernel:
    every result equals float64 and the same call launched through Triton (``Options.direct_launch`` off)."""
    g = torch.Generator(device="cuda").manual_seed(3)
    w = (torch.randn(768, 512, device="cuda", generator=g) / 23).half()
    b = torch.randn(768, device="cuda", generator=g).half()
    base = torch.randn(64 * 512 + 1, device="cuda", generator=g).half()
    cases = [base[: 64 * 512].view(64, 512), base[1:].view(64, 512), base[: 37 * 512].view(37, 512),
             base[: 512].view(1, 512), base[: 64 * 512].view(64, 512)]
    launchers = (calls._GEMM_LAUNCH, calls._VERIFY_LAUNCH, calls._GROUPED_LAUNCH)
    before = sum(launcher.direct_launches for launcher in launchers)
    for x in cases * 2:
        y, st = _run(x, w, b)
        ref = _ref64(x, w, b)
        err = ((y.double().cpu() - ref).abs().max() / ref.abs().max()).item()
        assert err < _gemm_rel_tol(torch.float16, 512) and st == ZERO, (x.shape, x.data_ptr() % 16, err, st)
        setopt(direct_launch=False)
        y_jit, st_jit = _run(x, w, b)
        setopt(direct_launch=True)
        assert torch.equal(y, y_jit) and st_jit == ZERO
    assert sum(launcher.direct_launches for launcher in launchers) - before >= len(cases)


@pytest.mark.skipif(DEV != "cpu", reason="stand-in timings and the interpreter's 4 SMs (split-K counts)")
def test_bench_gemm_parts_columns(monkeypatch):
    """`scripts/bench_gemm_parts.py`'s columns: every mode runs its call, ``gemm_only`` launches the
    verification of none of its calls (``fused`` one per call of the tile form), and the outputs of the
    verified columns match float64. A decode shape (M = 1: the decode kernel, each tile checked in its
    own epilogue, no verification launch) and a tile-form shape (M = 24)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "scripts" / "bench_gemm_parts.py"
    spec = importlib.util.spec_from_file_location("bench_gemm_parts", path)
    parts = importlib.util.module_from_spec(spec)
    monkeypatch.setattr(sys, "path", [str(path.parent), *sys.path])
    spec.loader.exec_module(parts)
    verifies = []
    real = calls._VERIFY_LAUNCH

    def spy(grid, args, kwargs):
        verifies.append(grid)
        return real(grid, args, kwargs)

    monkeypatch.setattr(calls, "_VERIFY_LAUNCH", spy)
    splits = []
    for attr in ("_GEMM_LAUNCH", "_GROUPED_LAUNCH"):
        real_launch = getattr(calls, attr)

        def split_spy(grid, args, kwargs, real=real_launch):
            splits.append(kwargs["SPLIT"])
            return real(grid, args, kwargs)

        monkeypatch.setattr(calls, attr, split_spy)
    timed = []

    def timer(fn):
        timed.append(fn)
        splits.clear()
        fn()
        return 1.0 if all(splits) else 2.0 if not any(splits) else 3.0

    modes = list(parts.MODES)
    for m, verified in ((1, 0), (24, 1)):
        verifies.clear()
        timed.clear()
        us, events, err = parts.bench_shape(m, 128, 160, torch.float16, [(G, modes)], calls=2, rounds=2, timer=timer,
                                            device=DEV, graphed=lambda fn: fn)
        assert set(us) == {"cublas", *modes} and len(timed) == 2 * len(us)
        assert events == dict.fromkeys(modes, 0) and err < _gemm_rel_tol(torch.float16, 160)
        # the `fused` columns: the error check's call, then 2 rounds × 2 calls each
        assert len(verifies) == verified * 2 * (1 + 2 * 2), (m, len(verifies))
        if m == 1:
            # 2 tiles of 64 on the interpreter's 4 SMs, 5 K blocks of 32: split in 2 (1 ms per timing over 2
            # calls), or not at all with _nosplit (2 ms); gemm_only is the decode kernel itself
            assert us["fused"] == us["plain"] == us["gemm_only"] == pytest.approx(1e3 / 2), us
            assert us["fused_nosplit"] == us["plain_nosplit"] == pytest.approx(2e3 / 2), us
        else:  # several row blocks never split
            assert all(us[mode] == pytest.approx(2e3 / 2) for mode in modes), us


@pytest.mark.parametrize("m,k,nc,want", [(4096, 896, 84, (2, 8)), (4096, 4864, 56, (8, 10)), (64, 4096, 304, (8, 8)),
                                         (8192, 8192, 256, (3, 43)), (16, 256, 16, (1, 8))])
def test_checksum_split(m, k, nc, want):
    """The checksum programs' K split (`checksum_tiles.checksum_split`, BLOCK_K = 64): up to 8 splits of at least
    8 K blocks, fewer where their partials (splits, M, NC + 4) would pass 32 MiB; every split has K blocks."""
    splits, per = checksum_tiles.checksum_split(m, k, nc, 64)
    assert (splits, per) == want
    nkb = -(-k // 64)
    assert (splits - 1) * per < nkb <= splits * per
    assert splits == 1 or splits * 4 * m * (nc + 4) <= checksum_tiles.CHECKSUM_PART_BYTES


def test_fused_rule(setopt):
    """Where the checksum programs run in the GEMM's launch (`forms.fused_ok`): fp16/bf16 tile and persistent
    calls of K ≥ 4096 or M ≤ 512 by default; never for fp32, the decode kernel or the cuBLAS form; the switch
    forces either way."""
    f16, bf16 = torch.float16, torch.bfloat16
    for kind in (forms.TILE, forms.PERSISTENT):
        assert forms.fused_ok(kind, f16, 4096, 4096) and forms.fused_ok(kind, bf16, 4096, 11008)
        assert forms.fused_ok(kind, f16, 512, 896) and forms.fused_ok(kind, bf16, 64, 896)
        assert not forms.fused_ok(kind, f16, 4096, 896) and not forms.fused_ok(kind, bf16, 2048, 2048)
        assert not forms.fused_ok(kind, torch.float32, 64, 4096)
    assert not forms.fused_ok(forms.DECODE, f16, 16, 4096) and not forms.fused_ok(forms.CUBLAS, f16, 128, 4096)
    setopt(gemm_fused=True)
    assert forms.fused_ok(forms.TILE, f16, 4096, 896) and not forms.fused_ok(forms.TILE, torch.float32, 64, 896)
    setopt(gemm_fused=False)
    assert not forms.fused_ok(forms.PERSISTENT, f16, 4096, 4096)
