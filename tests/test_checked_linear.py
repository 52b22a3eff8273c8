"""V-ABFT checked linear (PyTorch path): clean bit-identity, zero false positives, detection and
repair of injected flips, capacity, Conv1D layout, non-finite inputs, validation, weight cache,
and the absence of host synchronisation. References: F.linear / float64 matmul."""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import ft_transformers as ftt
from ft_transformers.counters import FaultStats, new_counters
from ft_transformers.injection import FaultPlan, FaultSpec, flip_bits
from ft_transformers.vabft import default_emax

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from calibrate_emax import sample_matrix  # noqa: E402

_cl = importlib.import_module("ft_transformers.checked_linear")
_forward = _cl._checked_linear_forward

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
_ITY = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
_ULP = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}


@pytest.fixture(params=[True, False], ids=["cpu-shortcuts", "sync-free"])
def shortcuts(request, monkeypatch):
    """Run a test both with the CPU shortcuts and with the branch-free path CUDA takes."""
    monkeypatch.setattr(_cl, "_CPU_SHORTCUTS", request.param)
    return request.param


def _draw(dist: str, shape, g: torch.Generator) -> torch.Tensor:
    return sample_matrix(dist, shape, g)


DISTS = ["N(1e-6,1)", "N(1,1)", "U(-1,1)", "TN(0,1)"]


class _Flips:
    """A stand-in `FaultPlan` flipping ``bit`` where ``mask`` (M, N) is True at ``linear.output``."""

    def __init__(self, mask: torch.Tensor, bit: int) -> None:
        self.mask = mask
        self.bit = bit

    def __bool__(self) -> bool:
        return True

    def check_sites(self, allowed, where) -> None:
        assert "linear.output" in allowed

    def for_site(self, site, shape, dtype, device):
        assert site == "linear.output" and tuple(shape) == tuple(self.mask.shape)
        return self

    def apply(self, x, dim=-1, start=0):
        return flip_bits(x, self.mask, self.bit)


def _bit_is_zero(y2d: torch.Tensor, bit: int) -> torch.Tensor:
    return ((y2d.view(_ITY[y2d.dtype]) >> bit) & 1) == 0


def _pick_zero_bit_cols(y2d: torch.Tensor, bit: int, rows, per_row: int, g: torch.Generator,
                        within: tuple[int, int] | None = None) -> torch.Tensor:
    """A mask with ``per_row`` random columns per listed row where ``bit`` is 0 (a 0→1 flip), the
    columns taken from ``[within[0], within[1])`` when given (e.g. one 64-column check group)."""
    ok = _bit_is_zero(y2d, bit)
    if within is not None:
        ok = ok.clone()
        ok[:, :within[0]] = False
        ok[:, within[1]:] = False
    mask = torch.zeros(y2d.shape, dtype=torch.bool)
    for r in rows:
        cols = ok[r].nonzero().flatten()
        assert len(cols) >= per_row, "not enough 0-bits in the row"
        mask[r, cols[torch.randperm(len(cols), generator=g)[:per_row]]] = True
    return mask


def _run(x, w, b=None, *, plan=None, correct=True, detect=True, kn=False, owner=None, counters=None):
    counters = new_counters(x.device) if counters is None else counters
    with torch.no_grad():
        y = _forward(x, w, b, weight_is_kn=kn, emax=None, csigma=2.5, detect=detect, correct=correct,
                     plan=plan, counters=counters, cache_owner=owner)
    return y, FaultStats(counters)


def _plain(x, w, b=None):
    """The product the check verifies, rounded once to x's dtype (for fp32: exactly F.linear)."""
    return F.linear(x.float(), w.float(), b.float() if b is not None else None).to(x.dtype)


def _units(mask: torch.Tensor) -> tuple[int, int]:
    """(row, 64-column group) units holding exactly one flip, and those holding several."""
    per = torch.nn.functional.pad(mask, (0, (-mask.shape[1]) % 64)).view(mask.shape[0], -1, 64).sum(-1)
    return int((per == 1).sum()), int((per > 1).sum())


def _stats(detected=0, corrected=0, recomputed=0, uncorrectable=0, nonfinite_input=0) -> dict:
    return {"detected": detected, "corrected": corrected, "recomputed": recomputed,
            "uncorrectable": uncorrectable, "nonfinite_input": nonfinite_input}


def _zero_stats(st) -> bool:
    return all(v == 0 for v in dict(st).values())


# --------------------------------------------------------------------------- clean behaviour


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 64), (2, 7, 96), (3, 2, 4, 32)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_clean_output_bit_identical_to_f_linear(dtype, shape, with_bias):
    """fp32: exactly F.linear. fp16/bf16: the fp32 product (what the check verifies) rounded once, i.e.
    F.linear on the upcast operands, cast down (the plain half-precision layer may round twice, at the
    product and after the bias)."""
    g = torch.Generator().manual_seed(11)
    k, n = shape[-1], 48
    x = torch.randn(shape, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if with_bias else None
    with torch.no_grad():
        y, st = ftt.checked_linear(x, w, b)
    ref = F.linear(x.float(), w.float(), b.float() if b is not None else None).to(dtype)
    assert y.shape == (*shape[:-1], n) and y.dtype == dtype
    assert torch.equal(y, ref)
    assert _zero_stats(st)
    # And both are correct: compare with float64.
    ref64 = x.double() @ w.double().t() + (b.double() if b is not None else 0)
    tol = _ULP[dtype] * 4
    torch.testing.assert_close(y.double(), ref64, rtol=tol, atol=tol * ref64.abs().max().item())


def test_empty_rows_and_detect_false():
    w = torch.randn(8, 4)
    y, st = ftt.checked_linear(torch.zeros(0, 4), w)
    assert y.shape == (0, 8) and _zero_stats(st)
    x = torch.randn(3, 4)
    y, st = ftt.checked_linear(x, w, detect=False)
    assert torch.equal(y, F.linear(x, w)) and _zero_stats(st)


# (M, K, N): repetitions with fresh x per weight. Realistic layer shapes up to K, N = 1024, plus many
# small ones so that ~5,700 calls (~120k verified rows) over the three dtypes stay fast.
_FP_SHAPES = [((64, 1024, 256), 8), ((64, 256, 1024), 8), ((16, 1024, 1024), 8), ((32, 512, 512), 12),
              ((64, 128, 128), 60), ((8, 64, 1024), 60), ((1, 1024, 64), 80), ((48, 96, 32), 80),
              ((4, 256, 256), 80), ((2, 512, 128), 80)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_false_positives_four_distributions(dtype):
    """Clean calls over the four distributions of the V-ABFT specification §5.1 at realistic shapes: no detection."""
    g = torch.Generator().manual_seed({torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}[dtype])
    calls = rows = 0
    counters = new_counters("cpu")
    for dist in DISTS:
        for i, ((m, k, n), reps) in enumerate(_FP_SHAPES):
            owner = types.SimpleNamespace()  # caches the weight checksums across the reps
            w = _draw(dist, (n, k), g).to(dtype)
            b = _draw(dist, (n,), g).to(dtype) if i % 2 else None
            xs = _draw(dist, (reps, m, k), g).to(dtype)
            for r in range(reps):
                _run(xs[r], w, b, owner=owner, counters=counters)
            calls += reps
            rows += reps * m
    st = FaultStats(counters)
    assert calls == 4 * 476 and rows == 4 * 10_256  # x 3 dtypes: 5,712 calls, 123,072 rows
    assert _zero_stats(st), f"false positives over {calls} calls / {rows} verified rows: {dict(st)}"


# --------------------------------------------------------------------------- injected faults

_HIGH_BITS = [(torch.float32, b) for b in (27, 28, 29, 30)] + [(torch.float16, b) for b in (12, 13, 14)] + [
    (torch.bfloat16, b) for b in (11, 12, 13, 14)]


@pytest.mark.parametrize("dtype,bit", _HIGH_BITS, ids=lambda v: str(v).replace("torch.", ""))
def test_single_high_bit_flip_detected_and_repaired(dtype, bit, shortcuts):
    """Single 0→1 flips of high exponent bits at random positions (public API, FaultSpec).

    The V-ABFT specification measures 0→1 flips (1→0 only shrinks the value). Positions holding a near-zero value
    (|y| < rms(row)/8) are skipped: there fp16 bit 12 (×16) or 13 (×256) moves y by less than the
    row's rounding-noise threshold (the V-ABFT specification: fp16 bit 12 detected 80.5 % on N(1e-6,1)).
    """
    g = torch.Generator().manual_seed(100 + bit)
    bsz, seq, k, n = 2, 12, 256, 192
    done = 0
    for seed in range(200):
        x = torch.randn(bsz, seq, k, generator=g).to(dtype)
        w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
        b = torch.randn(n, generator=g).to(dtype)
        clean = _plain(x, w, b)
        spec = FaultSpec(site="linear.output", bit=bit, count=1, seed=seed)
        r, c = FaultPlan(spec).for_site("linear.output", (bsz * seq, n), dtype, "cpu").positions[0].tolist()
        c2d = clean.reshape(-1, n).float()
        if not bool(_bit_is_zero(clean.reshape(-1, n), bit)[r, c]):
            continue
        if c2d[r, c].abs() < c2d[r].square().mean().sqrt() / 8:
            continue
        with torch.no_grad():
            y, st = ftt.checked_linear(x, w, b, inject=spec)
        assert st["detected"] == 1 and st["corrected"] + st["recomputed"] == 1, dict(st)
        assert st["uncorrectable"] == 0 and st["nonfinite_input"] == 0
        y2d, c2d = y.reshape(-1, n), clean.reshape(-1, n)
        others = torch.ones(bsz * seq, dtype=torch.bool)
        others[r] = False
        assert torch.equal(y2d[others], c2d[others])  # untouched rows stay bit-identical
        if dtype == torch.float32:
            torch.testing.assert_close(y, clean, rtol=2e-4, atol=2e-4 * clean.abs().max().item())
        else:
            torch.testing.assert_close(y.float(), clean.float(), rtol=_ULP[dtype], atol=_ULP[dtype])
        done += 1
        if done == 4:
            break
    assert done == 4


@pytest.mark.parametrize("dtype,bit", [(torch.float32, 27), (torch.float16, 12), (torch.bfloat16, 12)])
def test_located_flip_is_corrected_not_recomputed(dtype, bit, shortcuts):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(16, 128, generator=g).to(dtype)
    w = (torch.randn(64, 128, generator=g) / 2).to(dtype)
    clean = _plain(x, w)
    mask = _pick_zero_bit_cols(clean, bit, rows=[0, 3, 9, 15], per_row=1, g=g)
    y, st = _run(x, w, plan=_Flips(mask, bit))
    assert dict(st) == _stats(4, 4, 0, 0, 0)
    torch.testing.assert_close(y.float(), clean.float(), rtol=2 * _ULP[dtype], atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_several_flips_in_one_row_recompute(dtype, shortcuts):
    g = torch.Generator().manual_seed(6)
    bit = {torch.float32: 28, torch.float16: 13, torch.bfloat16: 12}[dtype]
    x = torch.randn(3, 10, 200, generator=g).to(dtype)
    w = torch.randn(150, 200, generator=g).to(dtype)  # |y| ~ 14: high exponent bits mostly 0
    b = torch.randn(150, generator=g).to(dtype)
    clean = _plain(x, w, b)
    # three flips in one check group (columns 64-127): no single location, the group is recomputed
    mask = _pick_zero_bit_cols(clean.reshape(-1, 150), bit, rows=[7], per_row=3, g=g, within=(64, 128))
    y, st = _run(x, w, b, plan=_Flips(mask, bit))
    assert dict(st) == _stats(1, 0, 1, 0, 0)
    torch.testing.assert_close(y.float(), clean.float(), rtol=2 * _ULP[dtype], atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flagged_groups_beyond_capacity_count_uncorrectable(dtype, shortcuts):
    """More faulty (row, group) units than RECOMPUTE_GROUPS: exactly that many are repaired (each one
    right), the rest counted uncorrectable and left as they were."""
    g = torch.Generator().manual_seed(8)
    m, k, n = 48, 96, 80
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)  # |y| ~ 10: high exponent bits mostly 0
    clean = _plain(x, w)
    bit = 28 if dtype == torch.float32 else 12
    # 30 rows with two flips in group 0 (recompute), 5 rows with one flip (single errors)
    mask = _pick_zero_bit_cols(clean, bit, rows=range(30), per_row=2, g=g, within=(0, 64)) | _pick_zero_bit_cols(
        clean, bit, rows=range(40, 45), per_row=1, g=g)
    faulty = flip_bits(clean, mask, bit)
    assert _cl.RECOMPUTE_GROUPS == 16 and _units(mask) == (5, 30)
    y, st = _run(x, w, plan=_Flips(mask, bit))
    assert st["detected"] == 35 and st["corrected"] + st["recomputed"] == 16 and st["uncorrectable"] == 19
    assert st["corrected"] <= 5 and st["nonfinite_input"] == 0
    tol = 2 * _ULP[dtype] * clean.float().abs() + 1e-5 * clean.float().abs().max()
    row_ok = ((y.float() - clean.float()).abs() <= tol).all(1)
    assert row_ok[30:40].all() and row_ok[45:].all()
    faulty_rows = torch.cat([torch.arange(30), torch.arange(40, 45)])
    assert int(row_ok[faulty_rows].sum()) == 16  # the repaired units; the other 19 stay faulty
    # element by element: still the faulty value, or its true value
    elem_ok = (y == faulty) | ((y.float() - clean.float()).abs() <= tol)
    assert elem_ok.all()
    # correct=False counts every faulty unit as detected + uncorrectable and repairs nothing.
    y, st = _run(x, w, plan=_Flips(mask, bit), correct=False)
    assert dict(st) == _stats(35, 0, 0, 35, 0)
    assert torch.equal(y, faulty)
    # detect=False: the plain GEMM plus the flips, nothing counted.
    y, st = _run(x, w, plan=_Flips(mask, bit), detect=False)
    assert _zero_stats(st) and torch.equal(y, flip_bits(F.linear(x, w), mask, bit))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flips_in_different_groups_of_one_row_are_each_corrected(dtype, shortcuts):
    """Checked per 64-column group: two flips of one row in two groups are two located single errors."""
    g = torch.Generator().manual_seed(18)
    x = torch.randn(6, 96, generator=g).to(dtype)
    w = torch.randn(200, 96, generator=g).to(dtype)
    clean = _plain(x, w)
    bit = 28 if dtype == torch.float32 else 12
    mask = _pick_zero_bit_cols(clean, bit, rows=[2], per_row=1, g=g, within=(0, 64))
    mask |= _pick_zero_bit_cols(clean, bit, rows=[2], per_row=1, g=g, within=(128, 192))
    y, st = _run(x, w, plan=_Flips(mask, bit))
    assert dict(st) == _stats(2, 2, 0, 0, 0)
    torch.testing.assert_close(y.float(), clean.float(), rtol=2 * _ULP[dtype], atol=1e-5)


def test_public_api_ber_and_unprotected_baseline():
    g = torch.Generator().manual_seed(9)
    x = torch.randn(4, 8, 64, generator=g)
    w = torch.randn(32, 64, generator=g) / 8
    spec = FaultSpec(site="linear.output", ber=2e-3, seed=1)
    with torch.no_grad():
        y, st = ftt.checked_linear(x, w, inject=spec)
        y0, st0 = ftt.checked_linear(x, w, inject=spec, detect=False)
    assert _zero_stats(st0) and not torch.equal(y0, F.linear(x, w))
    assert st["detected"] >= 1
    assert st["detected"] == st["corrected"] + st["recomputed"] + st["uncorrectable"]


# --------------------------------------------------------------------------- layouts, inputs


def test_conv1d_layout_matches_module_and_repairs():
    from transformers.pytorch_utils import Conv1D

    g = torch.Generator().manual_seed(12)
    conv = Conv1D(nf=96, nx=64)
    with torch.no_grad():
        conv.weight.copy_(torch.randn(64, 96, generator=g) * 0.5)
        conv.bias.copy_(torch.randn(96, generator=g))
        x = torch.randn(2, 9, 64, generator=g)
        ref = conv(x)
        y, st = _run(x, conv.weight, conv.bias, kn=True, owner=conv)
        assert torch.equal(y, ref) and _zero_stats(st)
        mask = _pick_zero_bit_cols(ref.reshape(-1, 96), 28, rows=[4, 11], per_row=1, g=g)
        mask |= _pick_zero_bit_cols(ref.reshape(-1, 96), 28, rows=[15], per_row=2, g=g, within=(0, 64))
        y, st = _run(x, conv.weight, conv.bias, kn=True, owner=conv, plan=_Flips(mask, 28))
    assert dict(st) == _stats(3, 2, 1, 0, 0)
    torch.testing.assert_close(y, ref, rtol=2e-4, atol=2e-4 * ref.abs().max().item())
    with pytest.raises(ValueError, match="in_features"):
        _run(torch.randn(3, 96), conv.weight, conv.bias, kn=True)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_input_counts_once_and_skips_checks(bad, shortcuts):
    g = torch.Generator().manual_seed(13)
    x = torch.randn(2, 6, 32, generator=g)
    x[1, 2, 5] = bad
    w = torch.randn(24, 32, generator=g)
    b = torch.randn(24, generator=g)
    y, st = _run(x, w, b)
    assert dict(st) == _stats(0, 0, 0, 0, 1)
    torch.testing.assert_close(y, F.linear(x, w, b), equal_nan=True, rtol=0, atol=0)
    # A non-finite weight is reported the same way.
    x2 = torch.randn(3, 32, generator=g)
    w2 = w.clone()
    w2[3, 4] = float("inf")
    y, st = _run(x2, w2, b)
    assert st["nonfinite_input"] == 1 and st["detected"] == 0


def test_autocast_matches_plain_autocast_and_checks():
    g = torch.Generator().manual_seed(14)
    lin = torch.nn.Linear(64, 40)
    x = torch.randn(5, 64, generator=g)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ref = lin(x)
        y, st = _run(x, lin.weight, lin.bias, owner=lin)
    assert y.dtype == ref.dtype == torch.bfloat16 and torch.equal(y, ref) and _zero_stats(st)


def test_weight_cache_refreshes_after_inplace_update():
    g = torch.Generator().manual_seed(15)
    lin = torch.nn.Linear(128, 64)
    x = torch.randn(10, 128, generator=g)
    y, st = _run(x, lin.weight, lin.bias, owner=lin)
    assert _zero_stats(st)
    cached = lin._ftt_vabft_checksums[None][-1]  # {autocast dtype: (refs, key, WeightChecksums)}
    with torch.no_grad():
        lin.weight.add_(0.5)  # a stale checksum would flag every row now
        lin.bias.mul_(-3.0)
    y, st = _run(x, lin.weight, lin.bias, owner=lin)
    assert _zero_stats(st), dict(st)
    assert torch.equal(y, F.linear(x, lin.weight, lin.bias))
    assert lin._ftt_vabft_checksums[None][-1] is not cached


def test_public_function_keeps_a_weights_checksums_between_calls(monkeypatch):
    """`ftt.checked_linear` builds a weight tensor's checksums once (building them reads host values), rebuilds
    them after an in-place update, and a flip written into the stored weight without a version bump (as a soft
    error would) is caught by the next call against the checksums of the weight as it was."""
    from ft_transformers.kernels.gemm_checksums import WeightChecksums

    builds = []
    real = WeightChecksums.compute.__func__
    monkeypatch.setattr(WeightChecksums, "compute",
                        classmethod(lambda cls, *a, **k: builds.append(1) or real(cls, *a, **k)))
    g = torch.Generator().manual_seed(21)
    lin = torch.nn.Linear(96, 80)
    x = torch.randn(6, 96, generator=g)
    with torch.no_grad():
        for _ in range(3):
            y, st = ftt.checked_linear(x, lin.weight, lin.bias)
            assert torch.equal(y, F.linear(x, lin.weight, lin.bias)) and _zero_stats(st)
        assert len(builds) == 1
        lin.weight.mul_(-2.0)  # in place, versioned: a stale checksum would flag every row
        y, st = ftt.checked_linear(x, lin.weight, lin.bias)
        assert len(builds) == 2 and _zero_stats(st) and torch.equal(y, F.linear(x, lin.weight, lin.bias))
        clean = F.linear(x, lin.weight, lin.bias)
        w = lin.weight.data.view(torch.int32)
        w[7, 3] ^= 1 << 30  # the stored weight's exponent MSB, behind the version counter's back
        y, st = ftt.checked_linear(x, lin.weight, lin.bias, correct=False)
        assert len(builds) == 2 and st["detected"] == x.shape[0], dict(st)
    assert not torch.equal(y, clean)


def test_public_function_takes_inference_tensors():
    """Weights made under ``torch.inference_mode`` carry no version counter; the checksum cache keys them
    without one (`tensor_version`), and the call checks and corrects as for any other weight."""
    g = torch.Generator().manual_seed(22)
    with torch.inference_mode():
        lin = torch.nn.Linear(64, 48)
        x = torch.randn(4, 64, generator=g)
        for _ in range(2):
            y, st = ftt.checked_linear(x, lin.weight, lin.bias)
            assert torch.equal(y, F.linear(x, lin.weight, lin.bias)) and _zero_stats(st)
        spec = ftt.FaultSpec(site="linear.output", bit=30, count=1, seed=3)
        y, st = ftt.checked_linear(x, lin.weight, lin.bias, inject=spec)
    assert st["detected"] == 1 and st["corrected"] == 1, dict(st)
    torch.testing.assert_close(y, F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- validation


def test_validation_errors():
    x = torch.randn(3, 8)
    w = torch.randn(5, 8)
    with pytest.raises(TypeError, match="float16, bfloat16"):
        ftt.checked_linear(x.double(), w.double())
    with pytest.raises(TypeError, match="share one dtype"):
        ftt.checked_linear(x.half(), w)
    with pytest.raises(ValueError, match="in_features"):
        ftt.checked_linear(torch.randn(3, 7), w)
    with pytest.raises(ValueError, match="bias must have shape"):
        ftt.checked_linear(x, w, torch.randn(4))
    with pytest.raises(ValueError, match="2-D"):
        ftt.checked_linear(x, w[None])
    with pytest.raises(ValueError, match="no fault site 'attn.scores'"):
        ftt.checked_linear(x, w, inject=FaultSpec(site="attn.scores", bit=3))
    with pytest.raises(ValueError, match="backend"):
        ftt.checked_linear(x, w, backend="cuda")
    with pytest.raises(ValueError, match="emax"):
        ftt.checked_linear(x, w, emax=-1.0)
    if _cl._triton_forward() is None:
        with pytest.raises(NotImplementedError, match="triton"):
            ftt.checked_linear(x, w, backend="triton")
    wg = w.clone().requires_grad_()
    with pytest.raises(RuntimeError, match="inference-only"):
        ftt.checked_linear(x, wg)
    with torch.no_grad():
        y, st = ftt.checked_linear(x, wg)  # fine without grad
    assert torch.equal(y, F.linear(x, w))
    with torch.inference_mode():
        y, st = ftt.checked_linear(x, wg)
    assert _zero_stats(st)


def test_default_emax_is_used_and_explicit_emax_respected():
    g = torch.Generator().manual_seed(16)
    x = torch.randn(8, 64, generator=g)
    w = torch.randn(32, 64, generator=g)
    with torch.no_grad():
        _, st = ftt.checked_linear(x, w, emax=1e-12)  # far below the rounding noise: (almost) every group flags
        d, thr = _cl.group_residuals(x, w, emax=1e-12)
    flagged = int((d.abs() > thr).sum())
    assert flagged >= 6 and st["detected"] == flagged
    assert st["detected"] == st["corrected"] + st["recomputed"] + st["uncorrectable"]
    assert default_emax(torch.float32, "cpu", k=64) == default_emax(torch.float32, "cpu")


# --------------------------------------------------------------------------- no host sync


def test_hot_path_has_no_host_synchronisation(monkeypatch):
    """With the CPU shortcuts off, detection, correction and recompute never read a tensor on the host.

    (Building the weight checksums reads 6 scalars once per weight version; that happens on the
    first call, outside the patched region.)"""
    monkeypatch.setattr(_cl, "_CPU_SHORTCUTS", False)
    g = torch.Generator().manual_seed(17)
    lin = torch.nn.Linear(64, 48)
    x = torch.randn(20, 64, generator=g) * 8
    with torch.no_grad():
        clean = lin(x)
    _run(x, lin.weight, lin.bias, owner=lin)  # builds the cached weight checksums
    mask = _pick_zero_bit_cols(clean, 28, rows=[1, 2], per_row=1, g=g)
    mask |= _pick_zero_bit_cols(clean, 28, rows=[5], per_row=3, g=g)
    plan = _Flips(mask, 28)

    def forbidden(*_a, **_k):
        raise AssertionError("host synchronisation on the checked-linear path")

    counters = new_counters("cpu")
    with monkeypatch.context() as mp:
        for name in ("__bool__", "item", "tolist", "nonzero", "__int__", "__float__", "__index__"):
            mp.setattr(torch.Tensor, name, forbidden)
        mp.setattr(torch, "nonzero", forbidden)
        with torch.no_grad():
            y = _forward(x, lin.weight, lin.bias, weight_is_kn=False, emax=None, csigma=2.5, detect=True,
                         correct=True, plan=plan, counters=counters, cache_owner=lin)
    st = FaultStats(counters)
    assert dict(st) == _stats(3, 2, 1, 0, 0)
    torch.testing.assert_close(y, clean, rtol=2e-4, atol=1e-5)
