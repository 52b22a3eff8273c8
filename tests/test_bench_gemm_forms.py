"""`scripts/bench_gemm_forms.py`'s kernels (a study of GEMM forms, timed only on a Hopper GPU): each
variant's output against ``F.linear`` in float64, and the checks' pieces against float64 sums, on small
shapes. Without CUDA they run under the Triton interpreter (set before triton is imported; when another
module imported triton first, the file re-runs itself in a fresh process)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch
from interpreted import interpreted_tests

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from ft_transformers.kernels.tl_common import runs_interpreted  # noqa: E402

_spec = importlib.util.spec_from_file_location(
    "bench_gemm_forms", Path(__file__).resolve().parents[1] / "scripts" / "bench_gemm_forms.py")
forms = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(forms)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SUBPROCESS = DEV == "cpu" and not runs_interpreted(forms._tiles_kernel)
_interpreter_available, test_interpreted_in_subprocess = interpreted_tests(__file__, SUBPROCESS, timeout=600)

M, N, K = 64, 48, 64  # two row blocks, two column tiles (the last one partial), two K blocks
CFG = (32, 32, 32, 4, 1)


@pytest.fixture(scope="module")
def operands():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(M, K, generator=g).half().to(DEV)
    w = (torch.randn(N, K, generator=g) / K**0.5).half().to(DEV)
    b = torch.randn(N, generator=g).half().to(DEV)
    if DEV == "cpu":
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8))
    else:
        triton.set_allocator(forms._alloc)
    return x, w, b


def _run(name, operands):
    x, w, b = operands
    y = torch.zeros(M, N, dtype=torch.float16, device=DEV)
    fn = forms.make_variant(name, CFG, x, w, b, y, sms=3)  # 3 programs for 4 tiles: one loops twice
    fn()
    return y, fn.buffers


@pytest.mark.parametrize("name", [v for v in forms.VARIANTS if v != "stats_pass"])
def test_every_gemm_form_computes_x_wt_plus_b(name, operands):
    x, w, b = operands
    y, _ = _run(name, operands)
    ref = x.double() @ w.double().t() + b.double()
    assert (y.double() - ref).abs().max().item() <= 2e-3 * ref.abs().max().item()


def test_the_checks_pieces_compute_what_the_checked_gemm_verifies(operands):
    x, w, b = operands
    x64 = x.double()
    y64 = x64 @ w.double().t() + b.double()
    t = -(-N // CFG[1])
    # the epilogue's row partial sums, per column tile
    _, buf = _run("tma_rowsums", operands)
    cols = torch.arange(N, dtype=torch.float64, device=DEV)
    for j in range(t):
        part = y64[:, j * CFG[1]:(j + 1) * CFG[1]]
        cw = ((cols[j * CFG[1]:(j + 1) * CFG[1]] + 1) / N)
        assert torch.allclose(buf["p"][j, :, 0].double(), part.sum(1), rtol=1e-5, atol=1e-4)
        assert torch.allclose(buf["p"][j, :, 1].double(), (part * cw).sum(1), rtol=1e-5, atol=1e-4)
    # the share in the K loop: the tiles' slots add up to x·w1, x·w2 and x's row statistics
    _, buf = _run("tma_share", operands)
    s, w12 = buf["s"], buf["w12"].double()
    assert torch.allclose(s[:, :, 0].sum(0).double(), x64 @ w12[:, 0], rtol=1e-5, atol=1e-4)
    assert torch.allclose(s[:, :, 1].sum(0).double(), x64 @ w12[:, 1], rtol=1e-5, atol=1e-4)
    assert torch.equal(s[:, :, 2].amax(0), x.float().amax(1))
    assert torch.equal(s[:, :, 3].amin(0), x.float().amin(1))
    assert torch.allclose(s[:, :, 4].sum(0).double(), x64.sum(1), rtol=1e-5, atol=1e-4)
    # the checksum dot: x against the 16-column operand (even columns stored)
    _, buf = _run("tma_csumdot", operands)
    ref = x64 @ buf["c"].double().t()
    for j in range(t):
        assert torch.allclose(buf["s"][j, :, :8].double(), ref[:, 0::2], rtol=1e-4, atol=1e-4)
    # max / min from the x tile in registers (the form Triton 3.6 miscompiled on the H100: wrong y)
    _, buf = _run("tma_regstats", operands)
    assert torch.equal(buf["s"][0, :, 2], x.float().amax(1))
    assert torch.equal(buf["s"][0, :, 3], x.float().amin(1))
    # the separate pass over x
    _, buf = _run("stats_pass", operands)
    sr, w12 = buf["s_rows"], buf["w12"].double()
    assert torch.allclose(sr[:, 0].double(), x64 @ w12[:, 0], rtol=1e-5, atol=1e-4)
    assert torch.allclose(sr[:, 1].double(), x64 @ w12[:, 1], rtol=1e-5, atol=1e-4)
    assert torch.equal(sr[:, 2], x.float().amax(1))
    assert torch.equal(sr[:, 3], x.float().amin(1))
    assert torch.allclose(sr[:, 4].double(), x64.sum(1), rtol=1e-5, atol=1e-4)


def test_stats_pass_on_ragged_rows_and_k():
    """The pass over x on rows that leave its last program partial and a K of two chunks, the second
    partial: every row's x·w1, x·w2, max, min and sum against float64; the rows past M are not written."""
    m, k = forms.STATS_ROWS + 5, forms.STATS_CHUNK + 44
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(m, k, generator=g) - 3.0).half().to(DEV)  # rows mostly below 0: a padded 0 in the max would show
    w12 = torch.randn(k, 2, generator=g).to(DEV)
    s = torch.full((m + 3, 8), 7.0, device=DEV)
    forms._stats_pass_kernel[(triton.cdiv(m, forms.STATS_ROWS),)](x, w12, s, m, k, R=forms.STATS_ROWS,
                                                                  CK=forms.STATS_CHUNK, num_warps=4)
    x64, w64 = x.double(), w12.double()
    assert torch.allclose(s[:m, 0].double(), x64 @ w64[:, 0], rtol=1e-5, atol=1e-3)
    assert torch.allclose(s[:m, 1].double(), x64 @ w64[:, 1], rtol=1e-5, atol=1e-3)
    assert torch.equal(s[:m, 2], x.float().amax(1))
    assert torch.equal(s[:m, 3], x.float().amin(1))
    assert torch.allclose(s[:m, 4].double(), x64.sum(1), rtol=1e-5, atol=1e-3)
    assert (s[m:] == 7.0).all() and (s[:m, 5:] == 7.0).all()


def test_unknown_variant_is_refused(operands):
    x, w, b = operands
    with pytest.raises(ValueError, match="unknown variant"):
        forms.make_variant("fastest", CFG, x, w, b, torch.empty(M, N, dtype=torch.float16, device=DEV), sms=3)
