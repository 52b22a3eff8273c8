"""PASA (online pseudo-average shifting attention) in the reference path: shift math,
FP16-accumulation emulation, accuracy against float64 attention, PASA + EFTA detection/correction,
and a tiny Qwen2 whose keys carry a large bias. Every reference here is computed with torch
directly in float64.
"""

from __future__ import annotations

import math

import pytest
import torch
from tiny_models import make_model

import ft_transformers as ftt
from ft_transformers import FaultSpec, efta_attention
from ft_transformers import attention as ftt_attention
from ft_transformers import efta as ftt_efta
from ft_transformers.efta_reference import efta_reference
from ft_transformers.pasa import (
    block_pseudo_average,
    fp16_matmul,
    invariance,
    optimal_beta,
    recovery_factor,
    shift_keys,
    shifting_matrix,
)

FP16_MAX_ROUNDS_TO_INF = 65520.0  # |x| ≥ 65504 + half an ulp rounds to inf in fp16


def ref64(q, k, v, scale=None, causal=False, mask=None, bias=None, window=None):
    """softmax(scale·q·kᵀ + bias)·v in float64 (GQA by repeating k/v; bool mask True = attend;
    causal and window aligned bottom-right)."""
    q, k, v = q.double(), k.double(), v.double()
    G = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(G, 1)
    v = v.repeat_interleave(G, 1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = q @ k.transpose(-1, -2) * scale
    M, N = s.shape[-2:]
    if bias is not None:
        s = s + bias.double()
    if causal:
        s = s.masked_fill(torch.ones(M, N, dtype=torch.bool).triu(N - M + 1), -math.inf)
    if window is not None:  # key j visible iff j > i + N - M - window
        s = s.masked_fill(torch.ones(M, N, dtype=torch.bool).tril(N - M - window), -math.inf)
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf)
    return torch.softmax(s, -1) @ v


def rmse(out, ref):
    return float((out.double() - ref).norm() / ref.norm())


def partial_fp16(q, k, v):
    """'Partially low-precision' attention: unscaled FP16 scores (fp16 accumulation), fp32 softmax."""
    s = fp16_matmul(q, k.transpose(-1, -2)).float() / math.sqrt(q.shape[-1])
    return torch.softmax(s, -1) @ v.float()


def uniform(shape, x0, am, gen):
    return (x0 + am * (2 * torch.rand(shape, generator=gen) - 1)).half()


def normal(shape, mean, std, gen):
    return (mean + std * torch.randn(shape, generator=gen)).half()


def hybrid(shape, x0, am, gen, p=0.001):
    base = x0 + torch.randn(shape, generator=gen)
    spikes = am * torch.randn(shape, generator=gen) * (torch.rand(shape, generator=gen) < p)
    return (base + spikes).half()


def ref_kwargs(**kw):
    base = dict(causal=False, bias=None, attn_mask=None, window=None, plan=None, counters=None)
    base.update(kw)
    return base


# --------------------------------------------------------------------------------------------
# The pieces
# --------------------------------------------------------------------------------------------


def test_shift_keys_subtracts_beta_times_block_mean():
    gen = torch.Generator().manual_seed(0)
    k = normal((1, 2, 150, 32), 50.0, 1.0, gen)
    beta, scale = 0.9375, 0.25
    kp = shift_keys(k, beta, scale, 64)
    assert kp.dtype == torch.float16
    k64 = k.double()
    for j0 in (0, 64, 128):  # the last block holds 22 keys: its mean is over those only
        blk = k64[:, :, j0:j0 + 64]
        want = scale * (blk - beta * blk.mean(-2, keepdim=True))
        got = kp[:, :, j0:j0 + 64].double()
        # fp16 matrix entries (relative 2^-11 on β/n) and the fp16 result (half an ulp)
        assert (got - want).abs().max() <= 2.0**-11 * scale * blk.abs().max() + want.abs().max() * 2.0**-11
    # the shifted keys have lost (almost) all of the 50·scale mean
    assert kp.float().mean().abs() < 0.1 * 50.0 * scale


def test_shifting_matrix_and_recovery_factor():
    m = shifting_matrix(128, optimal_beta(128), torch.float16)
    assert m.dtype == torch.float16 and m.shape == (128, 128)
    assert float(m[0, 0]) == pytest.approx(1 - 0.984497 / 128, abs=2.0**-11)
    # at the optimal β the rounded matrix implements exactly β/(1-β) (PASA paper, Table 3)
    for n in (64, 128):
        b = optimal_beta(n)
        assert recovery_factor(n, b) == pytest.approx(invariance(b), rel=1e-9)
    # a short block's rounded matrix does not (the reason for a per-block factor)
    b = optimal_beta(64)
    assert abs(recovery_factor(22, b) / invariance(b) - 1) > 1e-3
    with pytest.raises(ValueError):
        invariance(1.0)
    with pytest.raises(ValueError):
        shift_keys(torch.zeros(4, 8, dtype=torch.float16), 0.5, 1.0, 0)


def test_block_pseudo_average_recovers_block_means():
    gen = torch.Generator().manual_seed(1)
    q = normal((1, 1, 8, 64), 2.0, 1.0, gen)
    k = normal((1, 1, 100, 64), 40.0, 1.0, gen)
    beta, scale = optimal_beta(64), 0.125
    sbar = block_pseudo_average(q, shift_keys(k, beta, scale, 64), 64)  # (1, 1, 8, 2)
    s64 = q.double() @ k.double().transpose(-1, -2) * scale
    for j, (j0, j1) in enumerate(((0, 64), (64, 100))):
        true_mean = s64[..., j0:j1].mean(-1)
        gamma = recovery_factor(j1 - j0, beta)
        # S̄ = S̄' + γ·S̄' (eq. 14): recovered to fp16-rounding level of the shifted keys
        rec = sbar[..., j].double() * (1 + gamma)
        assert ((rec - true_mean).abs() / true_mean.abs()).max() < 2e-3


def test_fp16_matmul_rounds_and_overflows_like_fp16_accumulation():
    gen = torch.Generator().manual_seed(2)
    a = normal((3, 5, 128), 0.0, 1.0, gen)
    b = normal((3, 128, 7), 0.0, 1.0, gen)
    exact = a.double() @ b.double()
    got = fp16_matmul(a, b)
    assert got.dtype == torch.float16
    bound = 8 * 1.01 * 2.0**-11 * (a.double().abs() @ b.double().abs())  # 8 accumulator roundings
    assert ((got.double() - exact).abs() <= bound).all()
    assert not torch.equal(got.double(), exact)  # it does round
    # final sums on both sides of the fp16 overflow threshold
    ones = torch.ones(1, 16, dtype=torch.float16)
    col = torch.full((16, 1), 65504.0 / 16, dtype=torch.float16)  # 4094 is exact in fp16
    assert float(fp16_matmul(ones, col)) == 65504.0
    col2 = torch.full((16, 1), 4096.0, dtype=torch.float16)
    assert math.isinf(float(fp16_matmul(ones, col2)))
    # an intermediate partial sum overflows although the exact result is 0: the fp16
    # accumulator holds inf from then on (rounding the fp32 result once would give 0)
    a2 = torch.cat([torch.full((1, 16), 300.0), torch.full((1, 16), -300.0)], 1).half()
    b2 = torch.full((32, 1), 300.0, dtype=torch.float16)
    assert float(a2.double() @ b2.double()) == 0.0
    assert not math.isfinite(float(fp16_matmul(a2, b2)))
    # recomputing one element gives the bits of the batched product
    one = fp16_matmul(a[1, 3:4], b[1, :, 5:6])
    assert torch.equal(one.view(()), got[1, 3, 5])


# --------------------------------------------------------------------------------------------
# Accuracy against float64 where FP16 scores overflow
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["normal", "uniform_x0_30"])
def test_pasa_accurate_where_fp16_scores_overflow(case):
    gen = torch.Generator().manual_seed(3)
    shape = (1, 2, 96, 128)
    if case == "normal":  # normal inputs with a large mean (the PASA paper's hybrid case without spikes)
        q, k, v = normal(shape, 30.0, 1.0, gen), normal((1, 2, 200, 128), 30.0, 1.0, gen), \
            normal((1, 2, 200, 128), 30.0, 1.0, gen)
        tol = 2e-3
    else:  # PASA paper, Table 4, case 1: uniform, x0 = 30, Am = 0.5
        q, k, v = uniform(shape, 30.0, 0.5, gen), uniform((1, 2, 200, 128), 30.0, 0.5, gen), \
            uniform((1, 2, 200, 128), 30.0, 0.5, gen)
        tol = 1e-3
    ref = ref64(q, k, v)
    # the exact scores leave the fp16 range, so any FP16 score GEMM overflows ...
    assert (q.double() @ k.double().transpose(-1, -2)).abs().max() > FP16_MAX_ROUNDS_TO_INF
    # ... and the plain FP16-score attention returns NaN
    assert torch.isnan(partial_fp16(q, k, v)).all()
    out, stats = efta_attention(q, k, v, pasa=True, backend="reference")
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
    assert stats["detected"] == 0
    assert rmse(out, ref) < tol
    out32 = efta_reference(q, k, v, scale=1 / math.sqrt(128), detect=False, correct=False, pasa=True,
                           out_dtype=torch.float32, **ref_kwargs())
    assert out32.dtype == torch.float32 and rmse(out32, ref) < tol
    # PASA's full low-precision allocation: also finite, less accurate
    out16 = efta_reference(q, k, v, scale=1 / math.sqrt(128), detect=False, correct=False, pasa=True,
                           pasa_precision="fp16", out_dtype=torch.float32, **ref_kwargs())
    assert torch.isfinite(out16).all() and rmse(out16, ref) < 5e-2


def test_pasa_beats_fp16_scores_at_nonzero_mean():
    # PASA paper, Fig. 9a point x0 = 20, Am = 0.5: no overflow, PASA has the smaller error
    gen = torch.Generator().manual_seed(4)
    q, k, v = (uniform((1, 2, 128, 128), 20.0, 0.5, gen) for _ in range(3))
    ref = ref64(q, k, v)
    kw = ref_kwargs(scale=1 / math.sqrt(128), detect=False, correct=False, out_dtype=torch.float32)
    e_pasa = rmse(efta_reference(q, k, v, pasa=True, **kw), ref)
    e_part = rmse(partial_fp16(q, k, v), ref)
    assert math.isfinite(e_part) and e_pasa < e_part / 5
    # the PASA paper's literal pseudo-average (mean of the fp16 scores) is finite but γ-amplified
    e_scores = rmse(efta_reference(q, k, v, pasa=True, pasa_mean="scores", **kw), ref)
    assert e_pasa < e_scores < 1e-2


def test_pasa_masks_gqa_short_blocks():
    gen = torch.Generator().manual_seed(5)
    q = uniform((2, 4, 20, 64), 20.0, 0.5, gen)
    k = uniform((2, 2, 150, 64), 20.0, 0.5, gen)
    v = uniform((2, 2, 150, 64), 20.0, 0.5, gen)
    mask = torch.ones(2, 1, 20, 150, dtype=torch.bool)
    mask[1, ..., :37] = False  # left padding of the second sequence
    for causal in (False, True):
        ref = ref64(q, k, v, causal=causal, mask=mask)
        out, stats = efta_attention(q, k, v, pasa=True, causal=causal, attn_mask=mask)
        assert stats["detected"] == 0
        assert rmse(out, ref) < 1e-3
    # additive bias (T5-style position bias) and a sliding window (Qwen2)
    bias = torch.randn(1, 4, 20, 150, generator=gen)
    ref = ref64(q, k, v, causal=True, bias=bias, window=40)
    out, stats = efta_attention(q, k, v, pasa=True, causal=True, bias=bias, window=40)
    assert stats["detected"] == 0
    assert rmse(out, ref) < 1e-3


# --------------------------------------------------------------------------------------------
# PASA + EFTA
# --------------------------------------------------------------------------------------------


def _large_mean_case(seed=6):
    gen = torch.Generator().manual_seed(seed)
    q = uniform((1, 2, 64, 128), 30.0, 0.5, gen)
    k = uniform((1, 2, 160, 128), 30.0, 0.5, gen)
    v = uniform((1, 2, 160, 128), 0.0, 1.0, gen)  # zero-mean values: a lost key shows in the output
    return q, k, v


@pytest.mark.parametrize("site", ["attn.scores", "attn.output"])
def test_pasa_efta_corrects_bit30_flip(site):
    q, k, v = _large_mean_case()
    clean, st0 = efta_attention(q, k, v, pasa=True)
    assert st0["detected"] == 0
    corrected = 0
    for seed in range(8):
        out, st = efta_attention(q, k, v, pasa=True, inject=FaultSpec(site=site, bit=30, count=1, seed=seed))
        assert st["detected"] == 1 and st["uncorrectable"] == 0
        assert st["corrected"] + st["recomputed"] == 1
        if st["corrected"]:
            corrected += 1
            assert torch.equal(out, clean)  # the clean PASA output, bit for bit
        else:  # one row recomputed in fp32: the exact attention of that row
            rows = (out != clean).any(-1)
            assert rows.sum() == 1
            assert (out[rows].double() - ref64(q, k, v)[rows]).abs().max() <= 1e-2
    # scores: the flipped element is located and recomputed with the GEMM's own arithmetic; output:
    # a flip to ~1e37 often defeats the location and the row is recomputed (as without PASA)
    assert corrected >= (6 if site == "attn.scores" else 1)
    # unprotected, the same flips corrupt the output (a score flipped to ~0 can vanish in the
    # fp16 rounding of a flat softmax's output; one flipped to ~1e38 cannot)
    changed = 0
    for seed in range(8):
        bad, st = efta_attention(q, k, v, pasa=True, detect=False, correct=False,
                                 inject=FaultSpec(site=site, bit=30, count=1, seed=seed))
        assert st["detected"] == 0
        changed += not torch.equal(bad, clean)
    assert changed >= 1


def test_pasa_efta_no_false_positives():
    gen = torch.Generator().manual_seed(7)
    shape_q, shape_kv = (1, 4, 64, 128), (1, 2, 192, 128)
    cases = {
        "uniform_0": [uniform(s, 0.0, 0.5, gen) for s in (shape_q, shape_kv, shape_kv)],
        "uniform_30": [uniform(s, 30.0, 0.5, gen) for s in (shape_q, shape_kv, shape_kv)],
        "uniform_20_15": [uniform(s, 20.0, 15.0, gen) for s in (shape_q, shape_kv, shape_kv)],
        "hybrid_20_100": [hybrid(s, 20.0, 100.0, gen, p=0.01) for s in (shape_q, shape_kv, shape_kv)],
        "normal": [normal(s, 0.0, 1.0, gen) for s in (shape_q, shape_kv, shape_kv)],
    }
    for name, (q, k, v) in cases.items():
        # clean checks change nothing but the row sum: checked, l sums P as GEMM II reads it (rounded to v's
        # dtype, unit roundoff u), unchecked the fp32 P, so the two differ by ≤ u of l, and the outputs by
        # that and their own rounding to the input dtype (≤ u each; 3.01: the products of those u)
        u = 2.0**-11 if v.dtype == torch.float16 else 2.0**-8
        for causal in (False, True):
            out, st = efta_attention(q, k, v, pasa=True, causal=causal)
            assert st["detected"] == 0, name
            unchecked, _ = efta_attention(q, k, v, pasa=True, causal=causal, detect=False, correct=False)
            diff = (out.float() - unchecked.float()).abs()
            assert bool((diff <= 3.01 * u * unchecked.float().abs() + 2.0**-24).all()), (name, float(diff.max()))


# --------------------------------------------------------------------------------------------
# Dispatch and bad input
# --------------------------------------------------------------------------------------------


def test_pasa_dispatch_and_errors():
    q, k, v = _large_mean_case(8)
    a, _ = efta_attention(q, k, v, pasa=True, backend="reference")
    b, _ = efta_attention(q, k, v, pasa=True, backend="auto")
    assert torch.equal(a, b)
    if not ftt_efta._triton_module().interpreting():  # the kernel has PASA, but needs CUDA tensors here
        with pytest.raises(ValueError, match="CUDA"):
            efta_attention(q, k, v, pasa=True, backend="triton")
    with pytest.raises(NotImplementedError, match="float16/bfloat16"):
        efta_attention(q.float(), k.float(), v.float(), pasa=True)
    # bf16 inputs: q and k rounded to fp16 for the score GEMM
    qb, kb, vb = q.bfloat16(), k.bfloat16(), (v + 30).bfloat16()
    c, st = efta_attention(qb, kb, vb, pasa=True)
    assert c.dtype == torch.bfloat16 and st["detected"] == 0
    assert rmse(c, ref64(qb, kb, vb)) < 1e-3
    kw = ref_kwargs(scale=0.1, detect=True, correct=True)
    with pytest.raises(ValueError, match="detect=False"):
        efta_reference(q, k, v, pasa=True, pasa_precision="fp16", **kw)
    with pytest.raises(ValueError, match="pasa_precision"):
        efta_reference(q, k, v, pasa=True, pasa_precision="fp8", **kw)
    with pytest.raises(ValueError, match="β"):
        efta_reference(q, k, v, pasa=True, pasa_beta=1.0, **kw)
    with pytest.raises(ValueError, match="pasa_beta"):
        ftt.FTConfig(pasa=True, pasa_beta=1.5)


# --------------------------------------------------------------------------------------------
# Model level: a tiny Qwen2 whose keys carry a large bias
# --------------------------------------------------------------------------------------------


def _biased_qwen2():
    model = make_model("qwen2", attn="efta", dtype=torch.float16)
    with torch.no_grad():
        for layer in model.model.layers:
            att = layer.self_attn
            D = att.head_dim
            # the slowly rotating RoPE dims keep a bias aligned across positions (the PASA paper: Qwen2's
            # keys reach |k| ≈ 400); 100 on 16 of 32 dims puts q·kᵀ near 160000
            slow = list(range(D // 4, D // 2)) + list(range(3 * D // 4, D))
            for proj in (att.q_proj, att.k_proj):
                bias = proj.bias.view(-1, D)
                bias[:, slow] = 100.0
    return model


def test_qwen2_large_key_bias_pasa_generation(monkeypatch):
    model = _biased_qwen2()
    ids = torch.randint(3, 512, (1, 12), generator=torch.Generator().manual_seed(0))
    seen = []
    forward = ftt_attention._efta_forward

    def spy(q, k, v, **kw):
        seen.append((q, k, kw["pasa"], kw.get("pasa_beta")))
        return forward(q, k, v, **kw)

    monkeypatch.setattr(ftt_attention, "_efta_forward", spy)
    with torch.no_grad():
        ftt.enable_fault_tolerance(model, ftt.FTConfig(linear=False))
        ref_ids = model.generate(ids, max_new_tokens=6, do_sample=False)
        ref_logits = model(ref_ids).logits.float()
        ftt.disable_fault_tolerance(model)
        q, k = seen[0][0], seen[0][1]
        G = q.shape[1] // k.shape[1]
        kk = k.repeat_interleave(G, 1)
        # FP16 scores of this model overflow (exact float64 scores beyond the fp16 range) ...
        assert (q.double() @ kk.double().transpose(-1, -2)).abs().max() > FP16_MAX_ROUNDS_TO_INF
        assert torch.isnan(partial_fp16(q, kk, torch.ones_like(kk))).any()
        # ... PASA keeps them finite and generates what FP32-score EFTA generates
        ftt.enable_fault_tolerance(model, ftt.FTConfig(linear=False, pasa=True))
        pasa_ids = model.generate(ids, max_new_tokens=6, do_sample=False)
        pasa_logits = model(ref_ids).logits.float()
        report = ftt.fault_report(model)
        ftt.disable_fault_tolerance(model)
        ftt.enable_fault_tolerance(model, ftt.FTConfig(linear=False, pasa=True, pasa_beta=0.9375))
        model(ids)
        ftt.disable_fault_tolerance(model)
    assert torch.equal(pasa_ids, ref_ids)
    assert torch.isfinite(pasa_logits).all()
    assert (pasa_logits - ref_logits).abs().max() < 2e-2 * ref_logits.abs().max()
    assert sum(e.count for e in report.events if e.kind == "detected") == 0
    assert all(p for _, _, p, _ in seen[-2 * len(model.model.layers) - 1:])
    assert seen[-1][3] == 0.9375 and any(p and b is None for _, _, p, b in seen)


def test_triton_backend_pasa_message(monkeypatch):
    class FakeKernel:  # a kernel module without PASA support
        @staticmethod
        def efta_triton_forward(*a, **kw):
            raise AssertionError("must not be called for pasa=True")

    monkeypatch.setattr(ftt_efta, "_triton_module", lambda: FakeKernel)
    q, k, v = _large_mean_case(9)
    with pytest.raises(NotImplementedError, match="PASA is not implemented in the Triton"):
        efta_attention(q, k, v, pasa=True, backend="triton")
    out, _ = efta_attention(q, k, v, pasa=True, backend="auto")  # CPU: the reference path
    assert torch.isfinite(out).all()
