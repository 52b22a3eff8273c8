"""The fused Triton V-ABFT checked GEMM (``ft_transformers.kernels.abft_gemm``).

Oracles: float64 ``torch.matmul`` for the values, the PyTorch checked path (``backend="reference"``)
for the counters under injection (same site, positions and bits: for high exponent bits both paths
must count the same), and float64 checksums for the kernel's verification quantities.

Without CUDA the kernel runs under the Triton interpreter (``TRITON_INTERPRET=1``, set before triton
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
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from cuda_graphs import captured
from interpreted import interpreted_tests

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from ft_transformers.kernels import abft_gemm as G  # noqa: E402
from ft_transformers.kernels.abft_gemm import (  # noqa: E402
    api,
    calls,
    configs,
    decode,
    forms,
    prepared,
    tile,
    tuning,
)
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
DTYPES16 = DTYPES[1:]  # the decode kernel's (fp32 decode calls take the row-checked form)
DISTS = ["N(1e-6,1)", "N(1,1)", "U(-1,1)", "TN(0,1)"]
ULP = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}


# the kernel's entry with the library's e_max tables, as the checked linear passes them
checked_gemm = functools.partial(G.checked_gemm, emax_table=gemm_emax)


@pytest.fixture
def setopt():
    """``setopt(**fields)``: `Options` fields changed (`override`) until the test ends."""
    with contextlib.ExitStack() as stack:
        yield lambda **changes: stack.enter_context(override(**changes))


def _config(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(","))


def _gemm_rel_tol(dtype, k):
    """Error bound relative to max|y| for a GEMM against float64: output rounding (4 ulp of the dtype)
    plus fp32 accumulation, whose rounding errors grow like sqrt(k)·u; a TF32 product (u = 2^-11)
    would exceed it more than tenfold."""
    return 4 * ULP[dtype] + 4 * k**0.5 * 2.0**-24


HIGH_BIT = {torch.float32: (27, 28, 29, 30), torch.float16: (12, 13, 14), torch.bfloat16: (11, 12, 13, 14)}


_interpreter_available, test_interpreted_in_subprocess = interpreted_tests(__file__, SUBPROCESS, timeout=900)


def _rand(shape, dtype, seed, scale=1.0, dist=None):
    g = torch.Generator().manual_seed(seed)
    t = sample_matrix(dist, shape, g) if dist else torch.randn(shape, generator=g)
    return (t * scale).to(dtype).to(DEV)


def _ref64(x, w, b=None, kn=False):
    w64 = w.double().cpu()
    y = x.double().cpu() @ (w64 if kn else w64.t())
    return y + b.double().cpu() if b is not None else y


def _run(x, w, b=None, *, kn=False, plan=None, correct=True, detect=True, mode="accumulator", emax=None):
    cnt = new_counters(x.device)
    with torch.no_grad():
        y = checked_gemm(x, w, b, weight_is_kn=kn, plan=plan, counters=cnt, correct=correct, detect=detect,
                           mode=mode, emax=emax)
    return y, dict(FaultStats(cnt))


ZERO = {"detected": 0, "corrected": 0, "recomputed": 0, "uncorrectable": 0, "nonfinite_input": 0}


# --------------------------------------------------------------------------- clean values


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kn", [False, True], ids=["linear", "conv1d"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("mkn", [(37, 80, 50), (9, 1100, 20), (37, 80, 56)], ids=["ragged", "longk", "tma"])
def test_matches_float64_matmul(dtype, kn, with_bias, mkn, monkeypatch, setopt):
    # ragged: every tile edge is masked (pointer loads: rows of 50 elements are not 16-byte aligned),
    # and the two N tiles share the K blocks' checksums; longk: one N tile takes the checksums of
    # all 35 K blocks, the last one partial; tma: ragged edges again, but every row stride is
    # 16-byte aligned, so tiles move through tensor descriptors (zero-filled edges)
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
    # decode kernel: descriptor loads can sum differently, under the interpreter's matmul of a transposed view)
    if forms.grouped(m, n, dtype, None, m):
        setopt(gemm_tma=False)
    y0, st0 = _run(x, w, b, kn=kn, detect=False)
    assert torch.equal(y0, y) and st0 == ZERO


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_clean_calls_raise_no_detection_four_distributions(dtype):
    """Default (table) e_max in accumulator mode: no detection on clean data, with and without bias."""
    total = {k: 0 for k in ZERO}
    calls = 0
    scale = 1e-2 if dtype == torch.float16 else 1.0
    for i, dist in enumerate(DISTS):
        for j, (m, k, n) in enumerate([(32, 96, 48), (16, 256, 64), (48, 64, 96)]):
            x = _rand((m, k), dtype, 10 * i + j, scale, dist)
            w = _rand((n, k), dtype, 100 + 10 * i + j, scale, dist)
            b = _rand((n,), dtype, 200 + i + j, scale, dist) if j % 2 else None
            _, st = _run(x, w, b)
            calls += 1
            for key in total:
                total[key] += st[key]
    assert calls == 12 and total == ZERO, total


def test_checksums_and_residuals_against_float64():
    """The kernel's C1 is x·(Σ_n W[n,:]) + Σ b; its accumulator-side D1 is fp32-level small, far below
    the output-side D1 (which contains the fp16 rounding of every output)."""
    m, k, n = 24, 128, 96
    x = _rand((m, k), torch.float16, 5)
    w = _rand((n, k), torch.float16, 6, 0.1)
    b = _rand((n,), torch.float16, 7)
    acc = G.gemm_residuals(x, w, b, mode="accumulator")
    out = G.gemm_residuals(x, w, b, mode="output")
    c1_64 = x.double().cpu() @ w.double().cpu().sum(0) + b.double().cpu().sum()
    torch.testing.assert_close(acc["c1"].double().cpu(), c1_64, rtol=1e-5, atol=1e-4)
    y64 = _ref64(x, w, b)
    d1_out_64 = out["y"].double().cpu().sum(1) - c1_64  # output rounding, measured in float64
    torch.testing.assert_close(out["d1"].double().cpu(), d1_out_64, rtol=1e-3, atol=2e-4)
    assert acc["d1"].abs().max() < 2e-4 * y64.abs().sum(1).max()
    assert acc["d1"].abs().max() < 0.05 * out["d1"].abs().max()
    assert (acc["thr"] > 0).all() and torch.equal(acc["thr"], out["thr"])


# --------------------------------------------------------------------------- injection


_ITY = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_single_exponent_flips_detected_corrected_like_reference(dtype):
    """Single 0→1 flips of high exponent bits at linear.output through the public API: the Triton
    backend finds, locates and repairs them, and counts exactly like the reference path (same
    positions, same bits)."""
    bsz, seq, k, n = 2, 9, 64, 40
    checked = 0
    for bit in HIGH_BIT[dtype]:
        for seed in range(8):
            x = _rand((bsz, seq, k), dtype, 300 + seed)
            w = _rand((n, k), dtype, 400 + seed, k**-0.5)
            b = _rand((n,), dtype, 500 + seed)
            spec = FaultSpec(site="linear.output", bit=bit, count=1, seed=seed)
            with torch.no_grad():
                clean = F.linear(x, w, b)
                r, c = FaultPlan(spec).for_site("linear.output", (bsz * seq, n), dtype, DEV).positions[0].tolist()
                if (clean.reshape(-1, n)[r, c].view(_ITY[dtype]) >> bit) & 1:
                    continue  # a 1→0 flip (shrinks the value); the V-ABFT specification measures 0→1
                y_t, st_t = ftt.checked_linear(x, w, b, inject=spec, backend="triton")
                y_r, st_r = ftt.checked_linear(x, w, b, inject=spec, backend="reference")
            st_t, st_r = dict(st_t), dict(st_r)
            assert st_t == st_r, (bit, seed, st_t, st_r)
            assert st_t["detected"] == 1 and st_t["corrected"] + st_t["recomputed"] == 1, st_t
            # against float64: on the GPU the Triton GEMM sums in another order than cuBLAS (a 12-ulp
            # difference from F.linear was seen on the H100), and repairs take their own fp32 dot
            ref = _ref64(x.reshape(-1, k), w, b)
            tol = _gemm_rel_tol(dtype, k) * float(ref.abs().max())
            torch.testing.assert_close(y_t.reshape(-1, n).double().cpu(), ref, rtol=0, atol=tol)
            checked += 1
    assert checked >= len(HIGH_BIT[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_many_flips_capacity_and_flags_like_reference(dtype):
    """Rows with several flips are recomputed (at most 16 per call), the rest uncorrectable, like the
    reference (which may miss a small 1→0 flip that the accumulator check finds and corrects)."""
    m, k, n = 40, 32, 6
    bit = 28 if dtype == torch.float32 else 12
    x = _rand((m, k), dtype, 11, 4.0)
    w = _rand((n, k), dtype, 12)
    spec = FaultSpec(site="linear.output", bit=bit, count=90, seed=3)
    for kw in ({}, {"correct": False}, {"detect": False}):
        with torch.no_grad():
            y_t, st_t = ftt.checked_linear(x, w, inject=spec, backend="triton", **kw)
            y_r, st_r = ftt.checked_linear(x, w, inject=spec, backend="reference", **kw)
        st_t, st_r = dict(st_t), dict(st_r)
        assert st_t["detected"] >= st_r["detected"], (kw, st_t, st_r)
        assert st_t["detected"] == st_t["corrected"] + st_t["recomputed"] + st_t["uncorrectable"]
        if not kw:
            assert st_t["recomputed"] == st_r["recomputed"] == 16
            assert st_t["uncorrectable"] == st_r["uncorrectable"] > 0
            assert st_t["corrected"] - st_r["corrected"] == st_t["detected"] - st_r["detected"]
        else:  # nothing repaired: the same flipped output (up to the GEMMs' rounding)
            assert st_t["corrected"] == st_t["recomputed"] == 0
            torch.testing.assert_close(y_t.float(), y_r.float(), rtol=max(4 * ULP[dtype], 1e-4), atol=1e-3)
    assert st_t == ZERO


def _no_second_launch(grid, args, kwargs):
    """Stands in for the `_verify_kernel` launcher: a one-launch call must verify inside the GEMM launch."""
    raise AssertionError("the verify kernel was launched for a one-launch call")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("config,m", [(None, 13), (None, 50), ("64,32,32,4,1", 150)],
                         ids=["block16-one", "block16-four", "block64-three"])
def test_one_launch_verifies_like_reference(dtype, config, m, monkeypatch, setopt):
    """The GEMM verifies itself (the last tile of each row block verifies that block), no second
    launch: single flips located and repaired, rows with several flips recomputed, non-finite
    inputs counted once for the call and every other row block's counts dropped; all counted
    exactly like the reference path. One and several row blocks (interpreter config: 16 rows). The
    row-checked form (``Options.gemm_groups`` off: a call of M = 1 takes the decode kernel otherwise,
    tested below)."""
    setopt(gemm_groups=False)
    if config is not None:
        setopt(gemm_config=_config(config))
    verify_launch = calls._VERIFY_LAUNCH
    monkeypatch.setattr(calls, "_VERIFY_LAUNCH", _no_second_launch)
    k, n = 32, 24
    bit = HIGH_BIT[dtype][-1]
    x = _rand((m, k), dtype, 61, 2.0)
    w = _rand((n, k), dtype, 62, k**-0.5)
    b = _rand((n,), dtype, 63)
    ref = _ref64(x, w, b)
    tol = _gemm_rel_tol(dtype, k) * float(ref.abs().max())  # repairs use their own fp32 dots
    counts = (1, 5, 3 * m) if m <= G.RECOMPUTE_ROWS else (1, 5, 24)  # more rows than slots: see the next test
    for count in counts:
        spec = FaultSpec(site="linear.output", bit=bit, count=count, seed=count)
        with torch.no_grad():
            y_t, st_t = ftt.checked_linear(x, w, b, inject=spec, backend="triton")
            y_r, st_r = ftt.checked_linear(x, w, b, inject=spec, backend="reference")
        st_t, st_r = dict(st_t), dict(st_r)
        if count <= 5:
            assert st_t == st_r, (count, st_t, st_r)
        else:
            # a small 1→0 flip among many may hide below the reference's output-side threshold:
            # against the two-launch path (its own tests compare it with the reference), bit for bit
            with monkeypatch.context() as mp, override(gemm_one_launch=False):
                mp.setattr(calls, "_VERIFY_LAUNCH", verify_launch)
                with torch.no_grad():
                    y_2, st_2 = ftt.checked_linear(x, w, b, inject=spec, backend="triton")
            assert st_t == dict(st_2), (st_t, dict(st_2))
            assert torch.equal(y_t, y_2)
            assert st_t["detected"] >= st_r["detected"] and st_t["recomputed"] > 1, (st_t, st_r)
        assert st_t["detected"] > 0 and st_t["uncorrectable"] == 0, st_t
        assert st_t["detected"] == st_t["corrected"] + st_t["recomputed"], st_t
        torch.testing.assert_close(y_t.double().cpu(), ref, rtol=0, atol=tol)
    xn = x.clone()
    xn[m - 1, 3] = float("nan")
    _, st = _run(xn, w, b)
    assert st == dict(ZERO, nonfinite_input=1)
    # a non-finite x in the last row block and flips in the others: the reference switches the
    # call's checks off, so only nonfinite_input counts, although the other row blocks were verified
    spec = FaultSpec(site="linear.output", bit=bit, count=4, seed=3)
    with torch.no_grad():
        y_t, st_t = ftt.checked_linear(xn, w, b, inject=spec, backend="triton")
        y_r, st_r = ftt.checked_linear(xn, w, b, inject=spec, backend="reference")
    assert dict(st_t) == dict(st_r) == dict(ZERO, nonfinite_input=1), (dict(st_t), dict(st_r))
    if m <= 16:  # one row block: verified after every tile has raised the flag, so nothing is repaired either
        torch.testing.assert_close(y_t.float(), y_r.float(), rtol=max(4 * ULP[dtype], 1e-4), atol=1e-3,
                                   equal_nan=True)
    y2, st2 = _run(x, w, b)  # and the next call is checked again (the cells were reset)
    assert st2 == ZERO
    torch.testing.assert_close(y2.double().cpu(), ref, rtol=0, atol=tol)
    assert int(calls._cells(x.device)[0].abs().sum().item()) == 0  # every one-launch cell back to 0
    assert float(calls._cells(x.device)[2].abs().sum().item()) == 0.0  # and a decode call's row-sum cells


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("m", [1, 16])
@pytest.mark.parametrize("split", ["auto", "1"])
def test_decode_checksum_programs_verify_like_reference(dtype, m, split, monkeypatch, setopt):
    """A decode call (one launch, one row block, M ≤ CSUM_ROWS) takes its checksums from extra
    programs, one per K chunk (here 1 or 3 chunks of K = 600), and its row sums from the tiles'
    atomics: clean calls count nothing and match float64; flips at high bits are located, repaired
    and counted exactly as the reference path counts them; the cells are back to 0 after each call.
    ``auto``: each of the 2 tiles runs as 2 split-K programs of 10 K blocks (the interpreter counts 4
    SMs, `forms.split_k`), whose last one sums the partials (on a GPU, as the tuned config and the SM count
    decide: on the H100 the last call may not split); ``1``: no split. (The row-checked form,
    ``Options.gemm_groups`` off; by default a call of M = 1 takes the decode kernel.)"""
    setopt(gemm_groups=False)
    grids = []
    real = calls._GEMM_LAUNCH
    at = {a: tile._gemm_kernel.arg_names.index(a) for a in ("N", "n_csum", "n_split", "kb_per")}

    def spy(grid, args, kwargs):
        t = -(-args[at["N"]] // kwargs["BLOCK_N"])  # the GEMM's tiles
        grids.append((grid[0] - t * args[at["n_split"]], kwargs["CSUM"], args[at["n_csum"]], kwargs["SPLIT"],
                      args[at["n_split"]], args[at["kb_per"]]))
        return real(grid, args, kwargs)

    if split != "auto":
        setopt(gemm_split=int(split))
    monkeypatch.setattr(calls, "_GEMM_LAUNCH", spy)
    monkeypatch.setattr(calls, "_VERIFY_LAUNCH", _no_second_launch)
    k, n = 600, 40
    x = _rand((m, k), dtype, 71, 2.0)
    w = _rand((n, k), dtype, 72, k**-0.5)
    b = _rand((n,), dtype, 73)
    ref = _ref64(x, w, b)
    tol = _gemm_rel_tol(dtype, k) * float(ref.abs().max())
    y, st = _run(x, w, b)
    assert st == ZERO and float((y.double().cpu() - ref).abs().max()) <= tol
    chunks = 1 if m == 1 else 3  # K chunks of 4096 / next_pow2(M) (capped at next_pow2(K) = 1024)
    splits = grids[-1][3:]
    if split == "1":
        assert not splits[0] and splits[1] == 1, grids
    elif G.interpreting():
        assert splits == (True, 2, 10), grids  # 19 K blocks of 32
    else:  # on a GPU the plan follows the tuned config and the SM count: split-K may or may not pay
        assert splits[0] == (splits[1] > 1), grids
    assert grids[-1][:3] == (chunks, True, chunks), grids  # programs beyond the tiles: one per chunk
    bit = HIGH_BIT[dtype][-1]
    for count in (1, 3):
        spec = FaultSpec(site="linear.output", bit=bit, count=count, seed=10 + count)
        with torch.no_grad():
            y_t, st_t = ftt.checked_linear(x, w, b, inject=spec, backend="triton")
            y_r, st_r = ftt.checked_linear(x, w, b, inject=spec, backend="reference")
        assert dict(st_t) == dict(st_r) and st_t["detected"] >= 1, (count, dict(st_t), dict(st_r))
        assert float((y_t.double().cpu() - ref).abs().max()) <= tol, count
        # the injecting call took the checksum programs too, split-K as asked (on a GPU its fixed config
        # may split where the clean call's tuned one did not, as it does on the H100)
        assert grids[-1][1], grids[-1]
        if split == "1" or G.interpreting():
            assert grids[-1][3] == splits[0], grids[-1]
        else:
            assert grids[-1][3] == (grids[-1][4] > 1), grids[-1]
        assert float(calls._cells(x.device)[2].abs().sum().item()) == 0.0
        assert int(calls._cells(x.device)[0].abs().sum().item()) == 0  # the split counts too


@pytest.mark.parametrize("dtype,m,k,n,seed,bit,count,flip_seed", [
    (torch.bfloat16, 13, 100, 70, None, 14, 5, 5),  # row 4: +2.3 and -3.6 (1→0 flips), sum 1.25
    (torch.float16, 12, 96, 48, 1000, 6, 3, 6),
    (torch.bfloat16, 12, 96, 48, 1001, 9, 3, 109),
], ids=["bf16-two-shrunk", "fp16-two", "bf16-two"])
@pytest.mark.parametrize("table", ["cpu", "h100"])
def test_repair_must_explain_the_accumulator_difference(dtype, m, k, n, seed, bit, count, flip_seed, table,
                                                        monkeypatch):
    """Two flips in one row: the located column explains neither, and after its (no-op) repair the
    row re-summed from the rounded outputs passed the output-side threshold, so the row counted as
    corrected while still wrong (up to 23 % of max|y| in a sweep of 768 injected calls). The repair
    must now also explain the accumulator-side difference; such rows are recomputed.

    Under both shipped accumulator-side tables, whatever the device: ``cpu`` (this CPU's e_max),
    where every flip of the call is caught, and ``h100`` (the H100's, ~100× the CPU's for fp16; an
    H200 uses it too), where a single low-mantissa flip elsewhere in the call may stay under the
    threshold. The rows with two flips must be recomputed under both, and under ``h100`` no element
    may end up further from float64 than its injected flip put it."""
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
    spec = FaultSpec(site="linear.output", bit=bit, count=count, seed=flip_seed)
    rows = FaultPlan(spec).for_site("linear.output", (m, n), dtype, DEV).positions[:, 0].tolist()
    two = sorted({r for r in rows if rows.count(r) == 2})
    assert two  # a row with two flips
    with torch.no_grad():
        y, st = ftt.checked_linear(x, w, b, inject=spec, backend="triton")
        y_flipped, _ = ftt.checked_linear(x, w, b, inject=spec, backend="reference", detect=False)
    st = dict(st)
    assert st["recomputed"] >= 1 and st["uncorrectable"] == 0, st
    ref = _ref64(x, w, b)
    tol = _gemm_rel_tol(dtype, k) * float(ref.abs().max())
    err = (y.double().cpu() - ref).abs()
    assert float(err[two].max()) <= tol, (two, float(err[two].max()), tol)  # recomputed, not "repaired"
    if table == "cpu":
        assert float(err.max()) <= tol, float(err.max())
    else:  # every other element: repaired, or left with (at most) its injected error
        flip_err = (y_flipped.double().cpu() - ref).abs().nan_to_num(nan=float("inf"))  # a flip may make a NaN
        assert bool((err <= flip_err + tol).all()), (err - flip_err).max()


def test_one_launch_recompute_capacity_like_two_launches(monkeypatch, setopt):
    """More faulty rows than recompute slots: the verifying program recomputes the first ``capacity``
    rows and counts the rest uncorrectable, as the two-launch path (checked against the reference
    above) does."""
    m, k, n = 12, 32, 24
    x = _rand((m, k), torch.float32, 71)
    w = _rand((n, k), torch.float32, 72, k**-0.5)
    spec = FaultSpec(site="linear.output", bit=30, count=4 * m, seed=9)

    def run(one):
        setopt(gemm_one_launch=one)
        cnt = new_counters(x.device)
        with torch.no_grad():
            y = checked_gemm(x, w, None, plan=FaultPlan(spec), counters=cnt, capacity=3)
        return y, dict(FaultStats(cnt))

    y1, st1 = run(True)
    y2, st2 = run(False)
    assert st1 == st2, (st1, st2)
    assert st1["recomputed"] == 3 and st1["uncorrectable"] > 0, st1
    torch.testing.assert_close(y1, y2, rtol=0, atol=0, equal_nan=True)  # bit-30 flips left in place: inf, NaN


def test_accumulator_mode_catches_low_bits_the_output_mode_misses():
    """bf16 bit-8 flips (×4 or ÷4 of one element) hidden in output-side rounding noise are found in
    the accumulators."""
    m, k, n = 64, 128, 64
    x = _rand((m, k), torch.bfloat16, 21)
    w = _rand((n, k), torch.bfloat16, 22, k**-0.5)
    spec = FaultSpec(site="linear.output", bit=8, count=12, seed=5)
    _, st_acc = _run(x, w, plan=FaultPlan(spec))
    _, st_out = _run(x, w, plan=FaultPlan(spec), mode="output", emax=8e-3)
    assert st_acc["detected"] > st_out["detected"]
    assert st_acc["detected"] == st_acc["corrected"] + st_acc["recomputed"] + st_acc["uncorrectable"]


def test_ber_mode_matches_reference_positions():
    x = _rand((8, 48), torch.float32, 31, 8.0)
    w = _rand((24, 48), torch.float32, 32)
    spec = FaultSpec(site="linear.output", ber=0.01, seed=4)
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
    """Record ``(launcher, SPLIT, n_split)`` of every GEMM-side launch (0: `_gemm_kernel`, 2: the decode kernel);
    calls of up to 16 rows take the decode kernel (by default only M = 1 does: `GROUPED_MAX_ROWS`)."""
    monkeypatch.setattr(forms, "GROUPED_MAX_ROWS", forms.CSUM_ROWS)
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


# bits whose flip changes a value of magnitude 0.05-100 by at least its own size and stays finite:
# exponent bit 3 (fp16: ×2^8 or ÷2^8), bit 6 (bf16: ×2^64 or ÷2^64)
_GROUP_BIT = {torch.float16: 13, torch.bfloat16: 13}


@pytest.mark.parametrize("dtype", DTYPES16, ids=str)
@pytest.mark.parametrize("split", ["auto", "1"])
def test_decode_kernel_counts_per_group(dtype, split, monkeypatch, setopt):
    """Flips in a decode call are counted per (row, 64-column group): a group row with one flip is
    located and repaired (``corrected``), one with several is recomputed (``recomputed``); with
    ``correct=False`` every such group row is ``detected`` and ``uncorrectable`` and y keeps the
    flips. Expected counts come from the injected positions alone; repaired outputs match float64.
    With N ≤ 64 (one group per row) the counts equal the reference path's."""
    if split != "auto":
        setopt(gemm_split=int(split))
    seen = _spy_launches(monkeypatch)
    m, k, n = 6, 160, 200
    x = _rand((m, k), dtype, 95, 2.0)
    w = _rand((n, k), dtype, 96, k**-0.5)
    b = _rand((n,), dtype, 97)
    ref = _ref64(x, w, b)
    tol = _gemm_rel_tol(dtype, k) * float(ref.abs().max())
    bit = _GROUP_BIT[dtype]
    checked = 0
    for count, seed in ((1, 1), (4, 2), (12, 3), (12, 4)):
        spec = FaultSpec(site="linear.output", bit=bit, count=count, seed=seed)
        pos = FaultPlan(spec).for_site("linear.output", (m, n), dtype, DEV).positions.tolist()
        if any(not 0.05 < abs(float(ref[r, c])) < 100 for r, c in pos):
            continue  # a flip of a tiny value may hide in the rounding noise: not this test's subject
        per_group = {}
        for r, c in pos:
            per_group[(r, c // 64)] = per_group.get((r, c // 64), 0) + 1
        ones = sum(1 for v in per_group.values() if v == 1)
        with torch.no_grad():
            y, st = _run(x, w, b, plan=FaultPlan(spec))
            y_off, st_off = _run(x, w, b, plan=FaultPlan(spec), correct=False)
            y_flip, _ = _run(x, w, b, plan=FaultPlan(spec), detect=False)
        assert st == dict(ZERO, detected=len(per_group), corrected=ones, recomputed=len(per_group) - ones), (
            pos, st)
        assert float((y.double().cpu() - ref).abs().max()) <= tol, pos
        assert st_off == dict(ZERO, detected=len(per_group), uncorrectable=len(per_group)), (pos, st_off)
        torch.testing.assert_close(y_off.float(), y_flip.float(), rtol=max(4 * ULP[dtype], 1e-4), atol=tol)
        checked += 1
    assert checked >= 3 and {s[0] for s in seen} == {0, 2}  # (the plain GEMM took the flips for y_flip)
    # one group per row (N = 48): the reference path's counts, also for several flips in a row and for
    # flips to ~1e38 (at the top exponent bit) -- where the reference finds every flipped row: its
    # output-side check misses some bf16 values shrunk to ~0 (2.6 → 4e-39), which the kernel repairs
    w48, b48 = w[:48].contiguous(), b[:48].contiguous()
    ref48 = _ref64(x, w48, b48)
    for count in (1, 3, 9, 12):
        spec = FaultSpec(site="linear.output", bit=HIGH_BIT[dtype][-1], count=count, seed=20 + count)
        rows = {r for r, _ in FaultPlan(spec).for_site("linear.output", (m, 48), dtype, DEV).positions.tolist()}
        with torch.no_grad():
            y_t, st_t = ftt.checked_linear(x, w48, b48, inject=spec, backend="triton")
            _, st_r = ftt.checked_linear(x, w48, b48, inject=spec, backend="reference")
        st_t, st_r = dict(st_t), dict(st_r)
        assert st_t["detected"] == len(rows) and st_t["uncorrectable"] == 0, (count, st_t)
        if st_r["detected"] == len(rows):
            assert st_t == st_r, (count, st_t, st_r)
        tol48 = _gemm_rel_tol(dtype, k) * float(ref48.abs().max())
        assert float((y_t.double().cpu() - ref48).abs().max()) <= tol48
    assert seen[-1][0] == 2


def test_decode_kernel_group_constants_against_float64():
    """`group_checksums` against an independent float64 computation: ``w1_g`` is each group's column
    sum, ``b1_g`` its bias sum, and the thresholds its constants give (the kernel's formula, in float64
    here) equal `vabft.vabft_threshold` of the group's columns alone (plus the bias share of
    `WeightChecksums.thresholds`), including the ragged last group (200 = 3·64 + 8 columns)."""
    from ft_transformers.kernels.gemm_checksums import group_checksums

    m, k, n = 7, 90, 200
    x = _rand((m, k), torch.float32, 1, 3.0, "N(1,1)").cpu()
    w = _rand((n, k), torch.float32, 2).cpu()
    b = _rand((n,), torch.float32, 3).cpu()
    w1g, consts = group_checksums(w, b)
    wkn, consts_kn = group_checksums(w.t().contiguous(), b, weight_is_kn=True)
    assert torch.equal(w1g, wkn) and torch.equal(consts, consts_kn)
    assert w1g.shape == (4, k) and consts.shape == (4, 8)
    mu, var = _vabft.row_stats(x)
    c, mu64, var64 = consts.double(), mu.double()[:, None], var.double()[:, None]
    # `decode._epilogue`'s T from the constants (b1, det, v2, v3, v4, bias_det, bias_sd, n_g)
    got = 1e-6 * (c[:, 1] * mu64.abs() + 2.5 * torch.sqrt(mu64 * mu64 * c[:, 2] + var64 * c[:, 3])
                  + 2.5 * c[:, 4] * var64.sqrt() + c[:, 5] + 2.5 * c[:, 6])
    for g in range(4):
        cols = slice(64 * g, min(64 * g + 64, n))
        torch.testing.assert_close(w1g[g].double(), w[cols].double().sum(0), rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(consts[g, 0].double(), b[cols].double().sum(), rtol=1e-6, atol=1e-5)
        assert consts[g, 7] == w[cols].shape[0]
        # the group's own V-ABFT threshold, and the bias share with the group's width and bias
        want = _vabft.vabft_threshold(x.double(), w[cols].double().t(), emax=1e-6, csigma=2.5).double()
        bg = b[cols].double()
        bmu = bg.mean()
        bsd = ((bg.max() - bmu) * (bmu - bg.min())).clamp_min(0).sqrt()
        ng = bg.numel()
        want = want + 1e-6 * (ng * bmu.abs() + 2.5 * ng**0.5 * bsd)
        torch.testing.assert_close(got[:, g], want, rtol=1e-5, atol=0)


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
    assert int(calls._cells(x.device)[0].abs().sum().item()) == 0  # the split counts back to 0


# --------------------------------------------------------------------------- the persistent form


def _counted(monkeypatch, name):
    """Wrap launcher ``name`` of `calls`; returns the list its calls are appended to."""
    grids, real = [], getattr(calls, name)

    def spy(grid, args, kwargs):
        grids.append(grid)
        return real(grid, args, kwargs)
    monkeypatch.setattr(calls, name, spy)
    return grids


@pytest.mark.parametrize("dtype", DTYPES16, ids=str)
@pytest.mark.parametrize("kn", [False, True], ids=["linear", "conv1d"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("slack", [True, False], ids=["slack-stats", "stats-launch"])
def test_persistent_form_is_exact_and_verifies_like_float64(dtype, kn, with_bias, slack, monkeypatch, setopt):
    """The persistent form (the pass over x in the GEMM's idle programs or a launch before it, a persistent
    TMA GEMM adding row sums, the verify launch; forced with ``Options.gemm_persistent``: on a GPU only
    wide calls take it): y within the GEMM bound of float64, no events on clean inputs, and the verification
    quantities are float64's: C1 = x·w1 + b1, and D1 far below the threshold (x's statistics are right)."""
    setopt(gemm_persistent=True)
    setopt(gemm_slack_stats=slack)
    if not G.interpreting():
        setopt(gemm_config=configs.PERSISTENT_CONFIG_INTERPRET)
    stats, gemm = _counted(monkeypatch, "_STATS_LAUNCH"), _counted(monkeypatch, "_PERSISTENT_LAUNCH")
    m, n, k = 72, 80, 96  # row blocks, column tiles and K blocks of 32 that do not all divide evenly
    x = _rand((m, k), dtype, 81)
    w = _rand((k, n) if kn else (n, k), dtype, 82, k**-0.5)
    b = _rand((n,), dtype, 83) if with_bias else None
    ref = _ref64(x, w, b, kn)
    y, st = _run(x, w, b, kn=kn)
    assert gemm, "the persistent form did not run"
    assert bool(stats) != slack  # 9 tiles on 4 programs (more on a GPU): 3 row blocks in the idle programs
    assert st == ZERO
    assert float((y.double().cpu() - ref).abs().max()) <= _gemm_rel_tol(dtype, k) * float(ref.abs().max())
    res = G.gemm_residuals(x, w, b, weight_is_kn=kn)
    w_nk = (w.t() if kn else w).double().cpu()
    c1 = x.double().cpu() @ w_nk.sum(0) + (b.double().cpu().sum() if b is not None else 0.0)
    assert torch.allclose(res["c1"].double().cpu(), c1, rtol=1e-5, atol=1e-4)
    assert float((res["d1"].abs() / res["thr"]).max()) < 0.5  # thr with e_max = 1: D1 is fp32 rounding
    assert dict(FaultStats(res["counters"])) == ZERO


@pytest.mark.parametrize("dtype", DTYPES16, ids=str)
def test_persistent_form_statistics_equal_the_tile_forms(dtype, monkeypatch, setopt):
    """x's checksums and row statistics, whichever code takes them (the persistent GEMM's idle programs, the
    pass launched before it, the tile kernel's K-loop share), give the same C1 and threshold per row: rows of
    different scales, a row with one outlier (its max), a negative row (its min), M, N and K not multiples of
    the blocks, 3 row blocks for the 2 idle programs of 6 tiles on 4 (one takes two; more on a GPU)."""
    m, n, k = 90, 56, 104
    x = _rand((m, k), dtype, 61) * torch.linspace(0.01, 4.0, m, device=DEV)[:, None].to(dtype)
    x[3, 17] = 200.0
    x[5] = -x[5].abs() - 1.0
    w = _rand((n, k), dtype, 62, k**-0.5)
    b = _rand((n,), dtype, 63)
    out, launched = {}, {}
    for form, opts in (("slack", dict(gemm_persistent=True, gemm_slack_stats=True)),
                       ("pass", dict(gemm_persistent=True, gemm_slack_stats=False)),
                       ("tiles", dict(gemm_persistent=False))):
        with monkeypatch.context() as mp, override(gemm_config=configs.PERSISTENT_CONFIG_INTERPRET, **opts):
            stats = _counted(mp, "_STATS_LAUNCH")
            out[form] = G.gemm_residuals(x, w, b)
            launched[form] = bool(stats)
    assert launched == {"slack": False, "pass": True, "tiles": False}
    c1 = x.double().cpu() @ w.double().cpu().sum(0) + b.double().cpu().sum()
    for form, res in out.items():
        assert dict(FaultStats(res["counters"])) == ZERO, form
        assert torch.allclose(res["c1"].double().cpu(), c1, rtol=1e-5, atol=1e-3), form
        assert torch.allclose(res["thr"], out["tiles"]["thr"], rtol=1e-4, atol=0), form
    setopt(gemm_persistent=True)
    setopt(gemm_config=configs.PERSISTENT_CONFIG_INTERPRET)
    for bad in (float("nan"), float("inf")):  # a non-finite x, seen by the idle programs' pass: counted once
        x_bad = x.clone()
        x_bad[70, 100] = bad  # the last row block, the ragged K block
        _, st = _run(x_bad, w, b)
        assert st == dict(ZERO, nonfinite_input=1), bad


def test_persistent_form_counts_and_repairs_like_the_two_launch_form(monkeypatch, setopt):
    """Checksums of another weight (row 5 of W changed): every row's D1 is x·Δ, which locates column 5
    and whose repair cannot explain it, so the first 16 rows are recomputed and the rest counted
    uncorrectable: the persistent form and the two-launch tile form (same verify launch) give the same
    counts and the same y. A non-finite x switches the call's checks off: one ``nonfinite_input``."""
    m, n, k = 40, 64, 64
    x = _rand((m, k), torch.float16, 91)
    w = _rand((n, k), torch.float16, 92, k**-0.5)
    b = _rand((n,), torch.float16, 93)
    w_bad = w.clone()
    w_bad[5] += 1.0
    wc_bad = WeightChecksums.compute(w_bad, b)
    out = {}
    for form, opts in (("persistent", dict(gemm_persistent=True)),
                       ("two", dict(gemm_persistent=False, gemm_one_launch=False))):
        with override(**opts):
            cnt = new_counters(DEV)
            with torch.no_grad():
                y = checked_gemm(x, w, b, wc=wc_bad, counters=cnt)
            out[form] = (y, dict(FaultStats(cnt)))
    assert out["persistent"][1] == out["two"][1] == dict(ZERO, detected=m, recomputed=16, uncorrectable=m - 16)
    assert torch.equal(out["persistent"][0], out["two"][0])
    setopt(gemm_persistent=True)
    # a repeated signature replays the recorded launches (`PreparedCall`) with the new call's tensors
    gemm = _counted(monkeypatch, "_PERSISTENT_LAUNCH")
    recorded = []
    cnt = new_counters(DEV)  # (a layer's counters: part of the call's signature)
    for i in range(2):
        with torch.no_grad():
            y = checked_gemm(x, w, b, wc=wc_bad, counters=cnt)
        assert torch.equal(y, out["two"][0])
        assert dict(FaultStats(cnt)) == {key: (i + 1) * v for key, v in out["two"][1].items()}
        recorded.append(dict(wc_bad.launches))
    assert len(gemm) == 2 and recorded[0] == recorded[1]  # the second call recorded nothing new
    x_nan = x.clone()
    x_nan[7, 3] = float("nan")
    _, st = _run(x_nan, w, b)
    assert st == dict(ZERO, nonfinite_input=1)


def test_persistent_form_is_only_taken_where_it_pays(monkeypatch, setopt):
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


# --------------------------------------------------------------------------- inputs


@pytest.mark.parametrize("where", ["x-nan", "x-inf", "w-inf"])
def test_nonfinite_inputs_count_once_and_skip_checks(where):
    x = _rand((20, 32), torch.float32, 41)
    w = _rand((24, 32), torch.float32, 42)
    if where == "x-nan":
        x[3, 5] = float("nan")
    elif where == "x-inf":
        x[17, 0] = float("-inf")
    else:
        w[2, 7] = float("inf")
    y, st = _run(x, w)
    assert st == dict(ZERO, nonfinite_input=1)
    torch.testing.assert_close(y.cpu(), F.linear(x, w).cpu(), equal_nan=True, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("m", [5, 40], ids=["one-block", "three-blocks"])
def test_one_launch_resets_its_flag_for_a_frozen_call_id(m, monkeypatch, setopt):
    """Captured into a CUDA graph, every replay of a call has the same call id (1) and a one-launch
    call gets no memset of its non-finite flag (`call_flag`'s self_reset): the launch's last program
    must set the cell back to 0, else a NaN in one replay would switch the checks off in every later
    one. Stand-in for the replays: `call_flag` returning the same cell and id 1 for every call, with
    a flip injected after a call whose x held a NaN; both calls counted like the reference."""
    setopt(gemm_one_launch=True)
    setopt(gemm_groups=False)  # (the decode kernel has no flag)
    monkeypatch.setattr(calls, "_VERIFY_LAUNCH", _no_second_launch)
    cell = torch.zeros(1, dtype=torch.int32, device=DEV)
    asked = []

    def frozen(device, self_reset=False):
        asked.append(self_reset)
        return cell, 1

    monkeypatch.setattr(api, "call_flag", frozen)
    monkeypatch.setattr(prepared, "call_flag", frozen)
    k, n = 32, 24
    x = _rand((m, k), torch.float32, 71)
    w = _rand((n, k), torch.float32, 72, k**-0.5)
    xn = x.clone()
    xn[m - 1, 3] = float("nan")
    _, st = _run(xn, w)
    assert st == dict(ZERO, nonfinite_input=1)
    assert int(cell.item()) == 0
    spec = FaultSpec(site="linear.output", bit=HIGH_BIT[torch.float32][-1], count=1, seed=2)
    with torch.no_grad():
        y_t, st_t = ftt.checked_linear(x, w, inject=spec, backend="triton")
        _, st_r = ftt.checked_linear(x, w, inject=spec, backend="reference")
    assert dict(st_t) == dict(st_r) and st_t["detected"] == 1, (dict(st_t), dict(st_r))
    ref = _ref64(x, w)
    torch.testing.assert_close(y_t.double().cpu(), ref, rtol=0, atol=_gemm_rel_tol(torch.float32, k) * float(
        ref.abs().max()))
    assert int(cell.item()) == 0 and asked == [True, True]


@pytest.mark.parametrize("m,form", [(5, "decode"), (5, "decode-nosplit"), (5, "one"), (40, "two")],
                         ids=["decode-kernel", "decode-kernel-nosplit", "one-launch", "two-launches"])
def test_prepared_calls_match_first_calls(m, form, monkeypatch, setopt):
    """A repeated call signature takes the prepared launches (`PreparedCall`): new x, y, stats buffer
    (none for the decode kernel without split-K) and call id each time. Results equal float64 and a
    fresh first call's; a NaN in a later call's x is counted once, as on the first call; another
    weight version, alignment or setting prepares anew."""
    setopt(gemm_tma=False)  # TMA calls are not prepared (descriptors hold pointers)
    setopt(gemm_one_launch=form != "two")
    setopt(gemm_groups=form != "one")
    monkeypatch.setattr(forms, "GROUPED_MAX_ROWS", forms.CSUM_ROWS)  # the decode kernel at M = 5 too
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
    for x in xs:
        y = call(x)
        ref = _ref64(x, lin.weight.detach(), lin.bias.detach())
        assert ((y.double().cpu() - ref).abs().max() / ref.abs().max()).item() < _gemm_rel_tol(torch.float16, k)
    (checksums,) = _checksums_of(lin)
    assert len(checksums.launches) == 1  # one signature, prepared once, then reused
    (prepared,) = checksums.launches.values()
    assert [e[0] for e in prepared.launches] == {"one": [0], "two": [0, 1]}.get(form, [2])  # the launchers
    if form == "decode-nosplit" or G.interpreting():  # (on a GPU K = 96 is one K block: never split)
        assert (prepared.p_numel == 0) == (form == "decode-nosplit")
    assert FaultStats(cnt)["detected"] == 0
    bad = xs[0].clone()
    bad[m - 1, 3] = float("nan")
    y = call(bad)
    assert dict(FaultStats(cnt)) == dict(ZERO, nonfinite_input=1)
    assert torch.isnan(y[m - 1]).any() and not torch.isnan(y[: m - 1]).any()
    call(_rand((m * k + 1,), torch.float16, 90)[1:].view(m, k))  # 4 bytes off: a fresh signature
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
    path again; copies and disabled models carry no fast path."""
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
        spec = ftt.FaultSpec(site="linear.output", bit=29, count=1, seed=5, layers=[0])
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
    clone = copy.deepcopy(model.transformer.h[0].mlp.c_fc)
    assert clone.__dict__.get(_cl._FAST_PATH_ATTR) is None


def _checksums_of(module) -> list:
    """The `WeightChecksums` cached on ``module`` (`ft_transformers.vabft.weight_checksums`)."""
    cache = module.__dict__.get("_ftt_vabft_checksums") or {}
    return [entry[3] for entry in cache.values()]


def test_bad_inputs_raise_clear_errors():
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
    assert G.RECOMPUTE_ROWS == _cl.RECOMPUTE_ROWS


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
    assert int(cnt.sum()) == 0


# --------------------------------------------------------------------------- GPU, real shapes

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
    assert tuning._TUNE_CACHE == before


def test_narrow_outputs_also_time_narrow_tiles():
    """Many rows and few output columns (a k_proj/v_proj prefill): the tuner also times tiles narrow enough
    to give such a call more programs; wide outputs keep the large-tile list."""
    narrow = tuning._candidates(torch.float16, 4096, 128)
    wide = tuning._candidates(torch.float16, 4096, 4864)
    assert wide == configs.CONFIGS_LARGE
    assert set(configs.CONFIGS_LARGE) < set(narrow)
    assert min(c[0] * c[1] for c in narrow) * 4 <= min(c[0] * c[1] for c in wide)


def test_split_k_plans_cover_k_without_empty_splits(monkeypatch, setopt):
    """`forms.split_k`: every split gets at least one K block and together they cover K exactly, forced or
    not; a forced split never goes past SPLIT_MAX_TILES tiles (their counts live in the one-launch
    cells); a bad forced value is refused."""
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
    with pytest.raises(ValueError, match="gemm_split"), override(gemm_split=0):
        pass
    with pytest.raises(ValueError, match="FTT_ABFT_GEMM_SPLIT"):
        Options.from_env({"FTT_ABFT_GEMM_SPLIT": "0"})


@pytest.mark.skipif(DEV != "cpu", reason="stand-in timings and the interpreter's 4 SMs (split-K counts)")
def test_tuner_times_decode_calls_in_the_form_they_run(monkeypatch, setopt):
    """The tuner times a decode call's candidates as the call runs them: one launch with checksum
    programs, each config with split-K (where it applies) and without (verifying into scratch
    counters against an infinite threshold); the plain GEMM's candidates without checks. Each timed
    launch here runs once under the interpreter: the one-launch cells must be back to 0 after it,
    and the pick is the fastest candidate, a 6-tuple ending in False when it is the unsplit form."""
    monkeypatch.setattr(forms, "INTERP", False)
    setopt(gemm_config=None, gemm_tune=True, gemm_split=None)
    monkeypatch.setattr(torch.cuda, "device", lambda dev: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(tuning, "CONFIGS_SMALL", [(16, 32, 64, 4, 1), (16, 16, 128, 4, 1)])  # small for the interpreter
    monkeypatch.setattr(tuning, "TUNE_STREAM_COPIES", 2)  # (8 on a GPU)
    seen, weights = [], []
    real = calls._GEMM_LAUNCH
    at = {a: tile._gemm_kernel.arg_names.index(a) for a in ("n_split", "Cnt", "W")}

    def spy(grid, args, kwargs):
        weights.append(args[at["W"]])
        if len(weights) % 2 == 0:  # each timed run: the call over the weight and one copy of it
            return real(grid, args, kwargs)
        seen.append((kwargs["BLOCK_N"], kwargs["ONE_LAUNCH"], kwargs["CSUM"], kwargs["SPLIT"], args[at["n_split"]]))
        if kwargs["ONE_LAUNCH"]:
            seen[-1] += (args[at["Cnt"]],)
        return real(grid, args, kwargs)

    times = {(32, True): 2.0, (32, False): 1.0, (16, False): 3.0}  # (BLOCK_N, split-K): "ms"

    def one_run(run):
        run()
        return times[seen[-1][0], seen[-1][3]]

    monkeypatch.setattr(calls, "_GEMM_LAUNCH", spy)
    monkeypatch.setattr(tuning, "gpu_time", one_run)
    monkeypatch.setattr(tuning, "_TUNE_CACHE", {})
    x = _rand((2, 640), torch.float16, 5)
    w = _rand((48, 640), torch.float16, 6, 640**-0.5)
    launch = calls._Launch(x=x, w=w, b=None, y=torch.empty(2, 48, dtype=x.dtype), swn=w.stride(0), swk=w.stride(1))
    for detect in (True, False):
        seen.clear()
        cfg = tuning.pick_config(launch, bias=None, detect=detect, verify_output=False, dot_f32=True)
        assert cfg == (16, 32, 64, 4, 1, False)
        assert forms.split_plan(2, 48, 640, cfg, 1, detect, x.device) == (1, 1)
        # 48 / 32 = 2 tiles: 4 SMs / 2 = 2 splits of 5 K blocks of 64, or none; 3 tiles of 16: no split
        assert [e[:5] for e in seen] == [(32, detect, detect, True, 2), (32, detect, detect, False, 1),
                                         (16, detect, detect, False, 1)], seen
        if detect:
            assert all(int(e[5].abs().sum()) == 0 for e in seen)  # clean: nothing counted
        assert int(calls._cells(x.device)[0].abs().sum().item()) == 0
        # timed over the weight and a copy of it (a decode call streams its weight from memory)
        assert len(weights) == 2 * len(seen) and all(weights[i] is w for i in range(0, len(weights), 2))
        copy = weights[1]
        assert copy is not w and all(v is copy for v in weights[1::2])
        assert copy.stride() == w.stride() and torch.equal(copy, w)
        weights.clear()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_graph_replays_count_nonfinite_per_replay():
    """A decode call (one launch) captured into a CUDA graph: a replay whose x holds a NaN counts one
    nonfinite_input, clean replays count nothing and match F.linear, and a NaN replay after clean
    ones counts again (the flag goes back to 0 at the end of each replay, with no memset captured)."""
    k, n = 896, 4864
    lin = torch.nn.Linear(k, n, device="cuda", dtype=torch.float16)
    x = torch.randn(1, k, device="cuda", dtype=torch.float16)
    cnt = new_counters("cuda")

    def call():
        return _cl._triton(G.linear_forward, x, lin.weight, lin.bias, k, n, False, None, 2.5, True, True, None, cnt,
                           lin, None)

    with torch.no_grad():
        graph, y = captured(call, warmups=3)  # the warm-up tunes and prepares the call
        clean = x.clone()
        seen = []
        for nan in (False, True, False, False, True, False):
            x.copy_(clean)
            if nan:
                x[0, 7] = float("nan")
            cnt.zero_()
            graph.replay()
            torch.cuda.synchronize()
            seen.append(dict(FaultStats(cnt)))
            if not nan:
                torch.testing.assert_close(y, F.linear(x, lin.weight, lin.bias), rtol=2e-3, atol=2e-3)
    expect = [dict(ZERO, nonfinite_input=1) if nan else ZERO for nan in (False, True, False, False, True, False)]
    assert seen == expect, seen


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_real_shapes_clean_and_flips(dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    calls = 0
    total = {k: 0 for k in ZERO}
    scale = 1e-2 if dtype == torch.float16 else 1.0
    for dist in DISTS:
        for (m, k, n) in [(1, 896, 4864), (16, 4864, 896), (512, 2048, 2048), (2048, 4096, 1024)]:
            x = (sample_matrix(dist, (m, k), g) * scale).to(dtype)
            w = (sample_matrix(dist, (n, k), g) * scale / k**0.5).to(dtype)
            b = (sample_matrix(dist, (n,), g) * scale).to(dtype)
            y, st = _run(x, w, b)
            calls += 1
            for key in total:
                total[key] += st[key]
            ref = x.double() @ w.double().t() + b.double()
            err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
            tol = _gemm_rel_tol(dtype, k)
            assert err < tol, (dist, m, k, n, err, tol)
    assert total == ZERO, f"false positives over {calls} calls: {total}"
    # single 0→1 flips of high exponent bits (what the V-ABFT specification measures). The fused kernel verifies in its
    # fp32 accumulators, the reference (cuBLAS) its rounded output: every flip the reference finds, the
    # kernel finds too, and repairs; a small value scaled up may stay below the output-side threshold only
    x = torch.randn(4, 256, 1024, device="cuda", generator=g).to(dtype)
    w = (torch.randn(2048, 1024, device="cuda", generator=g) / 32).to(dtype)
    clean = F.linear(x, w)
    repaired_tol = _gemm_rel_tol(dtype, 1024) * clean.abs().max().item()
    for bit in HIGH_BIT[dtype]:
        checked = det_t = det_r = 0
        for seed in range(5000):  # fp32 bit 27 is 0 only in values below ~2^-8
            spec = FaultSpec(site="linear.output", bit=bit, count=1, seed=seed)
            r, c = FaultPlan(spec).for_site("linear.output", (1024, 2048), dtype, "cuda").positions[0].tolist()
            if (clean.reshape(-1, 2048)[r, c].view(_ITY[dtype]) >> bit) & 1:
                continue
            with torch.no_grad():
                y_t, st_t = ftt.checked_linear(x, w, inject=spec, backend="triton")
                y_r, st_r = ftt.checked_linear(x, w, inject=spec, backend="reference")
            assert st_t["uncorrectable"] == 0 and st_r["detected"] <= st_t["detected"], (bit, seed, dict(st_t),
                                                                                         dict(st_r))
            if st_t["detected"]:  # repaired: the located element is recomputed as a dot in another order
                torch.testing.assert_close(y_t.float(), clean.float(), rtol=0.0, atol=repaired_tol)
            det_t += st_t["detected"]
            det_r += st_r["detected"]
            checked += 1
            if checked == 8:
                break
        assert checked >= 4 and det_t >= checked - 1, (bit, checked, det_t, det_r)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_direct_launch_respecialises(monkeypatch, setopt):
    """Repeated calls go through `DirectLauncher` (no Triton binding), and a call whose pointers or
    ints specialise differently (a 2-byte-offset view, an odd row count, M = 1) gets its own kernel:
    every result equals float64 and the same call launched through Triton (``Options.direct_launch`` off)."""
    g = torch.Generator(device="cuda").manual_seed(3)
    w = (torch.randn(768, 512, device="cuda", generator=g) / 23).half()
    b = torch.randn(768, device="cuda", generator=g).half()
    base = torch.randn(64 * 512 + 1, device="cuda", generator=g).half()
    cases = [base[: 64 * 512].view(64, 512), base[1:].view(64, 512), base[: 37 * 512].view(37, 512),
             base[: 512].view(1, 512), base[: 64 * 512].view(64, 512)]
    before = calls._GEMM_LAUNCH.direct_launches
    for x in cases * 2:
        y, st = _run(x, w, b)
        ref = _ref64(x, w, b)
        err = ((y.double().cpu() - ref).abs().max() / ref.abs().max()).item()
        assert err < _gemm_rel_tol(torch.float16, 512) and st == ZERO, (x.shape, x.data_ptr() % 16, err, st)
        setopt(direct_launch=False)
        y_jit, st_jit = _run(x, w, b)
        setopt(direct_launch=True)
        assert torch.equal(y, y_jit) and st_jit == ZERO
    assert calls._GEMM_LAUNCH.direct_launches - before >= len(cases)


def test_bench_gemm_parts_columns(monkeypatch):
    """`scripts/bench_gemm_parts.py`'s columns: every mode runs its call, ``gemm_only`` launches the
    verification of none of its calls (the ``two`` column launches one per call), and the outputs
    of the verified columns match float64."""
    import importlib.util
    import sys

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
    real_gemm = calls._GEMM_LAUNCH

    def gemm_spy(grid, args, kwargs):
        splits.append(kwargs["SPLIT"])
        return real_gemm(grid, args, kwargs)

    monkeypatch.setattr(calls, "_GEMM_LAUNCH", gemm_spy)
    real_decode = calls._GROUPED_LAUNCH
    decode_launches = []

    def decode_spy(grid, args, kwargs):
        splits.append(kwargs["SPLIT"])
        decode_launches.append(grid)
        return real_decode(grid, args, kwargs)

    monkeypatch.setattr(calls, "_GROUPED_LAUNCH", decode_spy)
    timed = []

    def timer(fn):
        timed.append(fn)
        splits.clear()
        fn()
        return 1.0 if all(splits) else 2.0 if not any(splits) else 3.0

    modes = ["plain", "plain_nosplit", "gemm_only", "two", "one", "one_nosplit", "decode", "decode_nosplit"]
    us, events, err = parts.bench_shape(1, 48, 160, torch.float16, [(G, modes)],
                                        calls=2, rounds=2, timer=timer, device=DEV, graphed=lambda fn: fn)
    assert set(us) == {"cublas", *modes} and len(timed) == 2 * len(us)
    # µs per call: 1 ms per timing over 2 calls where every launch split K (2 tiles of 5 K blocks:
    # 2 splits each), 2 ms where none did
    assert us["one"] == us["plain"] == pytest.approx(1e3 / 2)
    assert us["one_nosplit"] == us["plain_nosplit"] == us["two"] == pytest.approx(2e3 / 2)
    # the decode kernel (1 tile of 64: 4 splits on the interpreter's 4 SMs), only in its own columns:
    # the error check's call, then 2 rounds × 2 calls for each of its two columns
    assert us["decode"] == pytest.approx(1e3 / 2) and us["decode_nosplit"] == pytest.approx(2e3 / 2)
    assert len(decode_launches) == 2 * (1 + 2 * 2), len(decode_launches)
    # the `two` column: one verification for the error check, then one per call of the 2 rounds × 2 calls
    assert len(verifies) == 1 + 2 * 2, len(verifies)
    assert events == dict.fromkeys(modes, 0) and err < _gemm_rel_tol(torch.float16, 160)
