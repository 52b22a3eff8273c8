"""`scripts/bench_gemm_gluon.py`'s host side (its Gluon kernels run only on Hopper GPUs; CI compiles them,
test_kernel_compile): the operands of the checksum merged into the product's MMA (level 3) against float64
and the library's group constants."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import bench_gemm_gluon as bg  # noqa: E402
from ft_transformers.kernels.gemm_checksums import group_checksums  # noqa: E402


@pytest.mark.parametrize("N,block_n", [(896, 256), (1152, 128), (200, 64)])
def test_merged_operand_chunk_sums_are_the_groups_residuals(N, block_n):
    """x·W'ᵀ in float64: every 64-column chunk sums to ~0 (its 60 outputs minus their checksum, hi + lo of the
    fp16 group sum), and the chunks' first 60 columns are y = x·Wᵀ in order, zero past N."""
    g = torch.Generator().manual_seed(N)
    K = 96
    x = torch.randn(8, K, generator=g).half()
    w = (torch.randn(N, K, generator=g) / K ** 0.5).half()
    wm, consts = bg.merged_operand(w, block_n, 1.0)
    chunks = wm.shape[0] // 64
    assert wm.shape == (bg.cdiv(bg.cdiv(N, 60), block_n // 64) * block_n, K) and consts.shape == (chunks, 8)
    acc = (x.double() @ wm.double().T).view(8, chunks, 64)
    y = x.double() @ w.double().T
    scale = x.double().abs() @ w.double().abs().T
    # hi + lo carry the fp32 sum's ~2^-22 relative error; the residual of the exact products is that small
    assert acc.sum(-1).abs().max() <= 1e-5 * scale.sum(1).max()
    data = acc[:, :, :60].reshape(8, -1)
    torch.testing.assert_close(data[:, :N], y, rtol=1e-12, atol=1e-12)
    assert not data[:, N:].any()


def test_merged_constants_bound_the_groups_own():
    """The threshold constants over a chunk's 60 rows and 4 zero rows: the mean terms equal the 60-row group's,
    the variance terms are no smaller (a threshold no tighter than the group's own)."""
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(120, 64, generator=g) + 0.3).half()
    _, merged = bg.merged_operand(w, 128, 1.0)
    own = torch.stack([group_checksums(w[i * 60:(i + 1) * 60], None)[1][0] for i in range(2)])
    torch.testing.assert_close(merged[:, 1], own[:, 1], rtol=1e-5, atol=0)  # n_g·Σ|μ|
    torch.testing.assert_close(merged[:, 3], own[:, 3], rtol=1e-5, atol=0)  # n_g²·Σμ²
    assert (merged[:, 2] >= own[:, 2] * (1 - 1e-6)).all() and (merged[:, 4] >= own[:, 4] * (1 - 1e-6)).all()


def test_weight_side_fault_changes_one_entry():
    """``fault=True`` changes exactly the operand's [5, 7] (after the checksums), at levels 2 and 3."""
    w = torch.randn(128, 64).half()
    for level in (2, 3):
        clean = bg.weight_side(w, level, 64)
        faulty = bg.weight_side(w, level, 64, fault=True)
        diff = (faulty[0] != clean[0]).nonzero().tolist()
        assert diff == [[5, 7]], (level, diff)
        assert torch.equal(faulty[2], clean[2]) and faulty[3] == clean[3]
