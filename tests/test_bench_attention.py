"""The decoupled baseline of scripts/bench_attention.py (the EFTA paper's unfused fault-tolerant attention).

It is a benchmark baseline, but its numbers only mean something if it computes attention and its
checks neither false-alarm on clean inputs nor miss a large fault. Oracle: float64 attention.
"""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch
from float64_attention import ref_attention

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
from bench_attention import decoupled_attention  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("M,N", [(64, 64), (1, 200), (30, 90)])
def test_decoupled_matches_float64_without_false_alarms(dtype, causal, M, N):
    g = torch.Generator().manual_seed(M * 1000 + N)
    q = (torch.randn(2, 3, M, 64, generator=g) * 2).to(dtype)
    k = torch.randn(2, 3, N, 64, generator=g).to(dtype)
    v = (torch.randn(2, 3, N, 64, generator=g) + 1).to(dtype)
    counters = torch.zeros(3, dtype=torch.int32)
    out = decoupled_attention(q, k, v, 0.125, causal, counters)
    ref = ref_attention(q, k, v, scale=0.125, causal=causal)
    tol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    assert (out.double() - ref).abs().max().item() <= tol
    assert counters.tolist() == [0, 0, 0]


def test_decoupled_flags_a_corrupted_score(monkeypatch):
    """A score made huge (as an exponent flip in the score GEMM would) fails that row's checksum."""
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, 16, 64, generator=g) for _ in range(3))
    counters = torch.zeros(3, dtype=torch.int32)
    real_matmul = torch.matmul
    calls = []

    def faulty_matmul(a, b):  # corrupt the first GEMM's result only (S = Q·Kᵀ)
        out = real_matmul(a, b)
        if not calls:
            out = out.clone()
            out[0, 0, 3, 5] += 2.0**20
        calls.append(1)
        return out

    monkeypatch.setattr(torch, "matmul", faulty_matmul)
    decoupled_attention(q, k, v, 1 / math.sqrt(64), False, counters)
    assert counters[0].item() == 1  # one row failed its score checksum


def test_variants_are_timed_in_interleaved_rounds(monkeypatch):
    """bench_shape times every variant once per round in an order rotated by one each round, reports
    the median time, and takes each ratio to sdpa_flash as the median of the same round's ratios
    (5 here; the ratio of the medians would be 8/3)."""
    import types

    import bench_attention

    monkeypatch.setattr(bench_attention, "VARIANTS", ("sdpa_flash", "decoupled"))
    seen = []
    real = bench_attention.decoupled_attention

    def counting(*a, **kw):
        seen.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(bench_attention, "decoupled_attention", counting)
    order = []
    per_round = {"sdpa_flash": [1.0, 3.0, 4.0], "decoupled": [5.0, 30.0, 8.0]}

    def timer(fn):
        before = len(seen)
        fn()
        name = "decoupled" if len(seen) > before else "sdpa_flash"
        order.append(name)
        return per_round[name][sum(n == name for n in order) - 1]

    args = types.SimpleNamespace(timer=timer, rounds=3, cudagraph=False)
    rows = bench_attention.bench_shape("prefill", 1, 2, 16, 16, 16, False, torch.float32, args, device="cpu")
    by = {r["variant"]: r for r in rows}
    assert not by["sdpa_flash"]["error"] and not by["decoupled"]["error"], rows
    assert order == ["sdpa_flash", "decoupled", "decoupled", "sdpa_flash", "sdpa_flash", "decoupled"]
    assert by["sdpa_flash"]["ms"] == 3.0 and by["decoupled"]["ms"] == 8.0
    assert by["decoupled"]["x_vs_flash"] == 5.0 and by["sdpa_flash"]["x_vs_flash"] == 1.0
    assert by["decoupled"]["calls"] == 4 and by["decoupled"]["detected_clean"] == 0  # warm-up + 3 rounds


def test_targets_use_same_round_ratios(capsys):
    """The target summary takes a shape's ratio to sdpa_flash or ours_off from bench_shape's paired
    columns (same-round ratios), not from the ratio of median times."""
    import bench_attention

    base = dict(kind="prefill", dtype="float16", B=1, H=16, M=1024, N=1024, D=64, causal=True, error="")
    rows = [dict(base, variant="sdpa_flash", ms=2.0, x_vs_flash=1.0, x_vs_ours_off=2.2),
            dict(base, variant="ours_off", ms=1.0, x_vs_flash=0.45, x_vs_ours_off=1.0),
            dict(base, variant="efta_correct", ms=3.0, x_vs_flash=1.5, x_vs_ours_off=2.9),
            dict(base, variant="decoupled", ms=30.0, x_vs_flash=15.0, x_vs_ours_off=30.0)]
    bench_attention.targets(rows)
    out = capsys.readouterr().out
    assert "ours_off / sdpa_flash: median 2.20" in out  # sdpa_flash's x_vs_ours_off, not 2.0 / 1.0
    assert "efta_correct / ours_off: median 2.90" in out
    assert "efta_correct over decoupled: median 10.00" in out  # no paired column: median times
