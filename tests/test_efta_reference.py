"""EFTA reference path (`efta_attention(..., backend="reference")`) against independent references.

The oracle is a float64 materialised softmax attention written here (plus
``torch.nn.functional.scaled_dot_product_attention`` where it applies); injection tests check
that every fault at the attention sites is found and repaired, and that the unprotected
computation really is hurt by them (``tests/test_attention_sites.py`` has the sites' own tests, on
this path and on the kernel).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from float64_attention import ref_attention
from ft_transformers.kernels.contract import ATTENTION_SITES, COUNTER_SHAPE, site_dtype
from nonfinite_cases import NONFINITE_CASES, nonfinite_case

from ft_transformers.counters import FaultStats, new_counters
from ft_transformers.efta import _efta_forward, efta_attention
from ft_transformers.efta_reference import efta_reference
from ft_transformers.injection import FaultPlan, FaultSpec

TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def rand_qkv(B, Hq, Hkv, M, N, D, dtype=torch.float32, seed=0, dist="normal"):
    g = torch.Generator().manual_seed(seed)

    def one(*shape):
        if dist == "normal":
            x = torch.randn(*shape, generator=g)
        elif dist == "normal1":
            x = torch.randn(*shape, generator=g) + 1.0
        elif dist == "uniform":
            x = torch.rand(*shape, generator=g) * 2.0 - 1.0
        elif dist == "trunc":
            x = torch.fmod(torch.randn(*shape, generator=g), 2.0)  # truncated at ±2σ
        else:
            raise ValueError(dist)
        return x.to(dtype)

    return one(B, Hq, M, D), one(B, Hkv, N, D), one(B, Hkv, N, D)


def run(q, k, v, **kw):
    kw.setdefault("backend", "reference")
    with torch.no_grad():
        return efta_attention(q, k, v, **kw)


def check_close(out, ref, dtype):
    assert out.dtype == dtype
    err = (out.double() - ref).abs().max().item()
    assert err <= TOL[dtype], f"max err {err:.3g} > {TOL[dtype]} ({dtype})"


# --------------------------------------------------------------------------------------------
# Correctness against the float64 oracle
# --------------------------------------------------------------------------------------------

CASES = {
    # name: (B, Hq, Hkv, M, N, D, kwargs)
    "causal_self": (2, 4, 4, 70, 70, 64, dict(causal=True)),
    "causal_decode_chunk": (2, 4, 2, 5, 130, 64, dict(causal=True)),
    "causal_M1": (3, 4, 1, 1, 200, 32, dict(causal=True)),
    "cross": (2, 2, 2, 30, 90, 48, {}),
    "gqa": (1, 8, 2, 40, 100, 64, dict(causal=True)),
    "mqa": (2, 6, 1, 17, 65, 40, {}),
    "window": (1, 4, 2, 90, 90, 64, dict(causal=True, window=20)),
    "window_decode": (2, 2, 1, 3, 150, 64, dict(causal=True, window=33)),
    "head_dim_100": (1, 2, 2, 20, 64, 100, dict(causal=True)),
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_checked_row_sum_sums_the_probabilities_gemm_ii_reads(dtype):
    """Checked, the row sum is l = Σ_n P_lp, of the P that GEMM II reads (rounded to the input dtype): O / l
    divides Σ P_lp·V by the sum of the same weights, so with every value 1 the fp32 output is 1 up to fp32
    rounding. Unchecked, l sums the fp32 P (plain flash attention), which differs from Σ P_lp by P's
    rounding: there the output is off 1 by far more."""
    B, Hq, Hkv, M, N, D = 1, 2, 1, 40, 150, 32
    q, k, _ = rand_qkv(B, Hq, Hkv, M, N, D, dtype, seed=9)
    v = torch.ones(B, Hkv, N, D, dtype=dtype)
    kw = dict(scale=D**-0.5, causal=True, bias=None, attn_mask=None, window=None, plan=None, counters=None,
              out_dtype=torch.float32)
    with torch.no_grad():
        checked = efta_reference(q, k, v, detect=True, correct=True, **kw)
        plain = efta_reference(q, k, v, detect=False, correct=False, **kw)
    assert (checked - 1.0).abs().max().item() <= 1e-6
    assert (plain - 1.0).abs().max().item() > 2e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_matches_float64(case, dtype):
    B, Hq, Hkv, M, N, D, kw = CASES[case]
    q, k, v = rand_qkv(B, Hq, Hkv, M, N, D, dtype, seed=sum(map(ord, case)))
    out, stats = run(q, k, v, **kw)
    check_close(out, ref_attention(q, k, v, **kw), dtype)
    assert stats["detected"] == 0 and stats["nonfinite_input"] == 0


def test_matches_sdpa_fp32():
    q, k, v = rand_qkv(2, 4, 4, 77, 77, 64, seed=3)
    for causal in (False, True):
        out, _ = run(q, k, v, causal=causal)
        want = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        assert (out - want).abs().max().item() < 2e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_bool_padding_masks(dtype):
    B, Hq, Hkv, M, N, D = 3, 4, 2, 20, 75, 64
    q, k, v = rand_qkv(B, Hq, Hkv, M, N, D, dtype, seed=5)
    lengths = torch.tensor([75, 50, 9])
    keep = torch.arange(N).unsqueeze(0) < lengths.unsqueeze(1)  # (B, N)
    masks = (keep[:, None, None, :], keep[:, None, None, :].expand(B, 1, M, N), keep[1].expand(M, N)[None])
    for mask in masks:  # 4-D, expanded 4-D, 3-D
        out, stats = run(q, k, v, attn_mask=mask, causal=False)
        check_close(out, ref_attention(q, k, v, attn_mask=mask), dtype)
    # combined with a bottom-right causal mask (decode chunk with left padding style lengths)
    out, _ = run(q, k, v, attn_mask=keep[:, None, None, :], causal=True)
    check_close(out, ref_attention(q, k, v, attn_mask=keep[:, None, None, :], causal=True), dtype)
    # per-head mask (1, Hq, M, N)
    hm = torch.rand(1, Hq, M, N, generator=torch.Generator().manual_seed(0)) > 0.3
    out, _ = run(q, k, v, attn_mask=hm)
    check_close(out, ref_attention(q, k, v, attn_mask=hm), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_additive_masks(dtype):
    B, Hq, Hkv, M, N, D = 2, 4, 4, 33, 97, 32
    q, k, v = rand_qkv(B, Hq, Hkv, M, N, D, dtype, seed=6)
    keep = torch.rand(B, 1, M, N, generator=torch.Generator().manual_seed(1)) > 0.4
    keep[..., 0] = True
    for neg in (torch.finfo(dtype).min, -math.inf):
        mask = torch.zeros(B, 1, M, N, dtype=dtype).masked_fill(~keep, neg)
        out, stats = run(q, k, v, attn_mask=mask)
        check_close(out, ref_attention(q, k, v, attn_mask=keep), dtype)
        assert stats["detected"] == 0 and stats["nonfinite_input"] == 0


def test_t5_bias_scale_one():
    B, Hq, M, N, D = 2, 4, 24, 40, 64
    q, k, v = rand_qkv(B, Hq, Hq, M, N, D, seed=7)
    q, k = q * 0.2, k * 0.2
    bias = torch.randn(1, Hq, M, N, generator=torch.Generator().manual_seed(2)) * 3.0
    out, stats = run(q, k, v, bias=bias, scale=1.0)
    check_close(out, ref_attention(q, k, v, bias=bias, scale=1.0), torch.float32)
    # decoder self-attention: bias + causal, bias (B, 1, M, N), and bias + a bool padding mask
    bias_b = torch.randn(B, 1, M, N, generator=torch.Generator().manual_seed(3))
    keep = torch.ones(B, 1, 1, N, dtype=torch.bool)
    keep[1, ..., 30:] = False
    out, stats = run(q, k, v, bias=bias_b, attn_mask=keep, scale=1.0, causal=True)
    want = ref_attention(q, k, v, bias=bias_b, attn_mask=keep, scale=1.0, causal=True)
    check_close(out, want, torch.float32)
    assert stats["detected"] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fully_masked_rows_are_zero(dtype):
    B, Hq, M, N, D = 2, 2, 6, 70, 64
    q, k, v = rand_qkv(B, Hq, Hq, M, N, D, dtype, seed=8)
    keep = torch.ones(B, 1, M, N, dtype=torch.bool)
    keep[0, :, 2] = False  # one fully masked row
    keep[1, :, :, :] = False  # a fully masked batch entry
    out, stats = run(q, k, v, attn_mask=keep)
    assert torch.all(out[0, :, 2] == 0) and torch.all(out[1] == 0)
    check_close(out, ref_attention(q, k, v, attn_mask=keep), dtype)
    assert stats["detected"] == 0
    # additive -inf everywhere, and a window that hides everything but the newest key
    add = torch.full((1, 1, M, N), -math.inf)
    out, stats = run(q, k, v, attn_mask=add)
    assert torch.all(out == 0) and stats["detected"] == 0
    out, _ = run(q, k, v, causal=True, window=1)
    check_close(out, ref_attention(q, k, v, causal=True, window=1), dtype)


@pytest.mark.parametrize("block_n,stride", [(32, 8), (64, 16), (128, 16), (16, 16)])
def test_block_and_stride_variants(block_n, stride):
    q, k, v = rand_qkv(2, 4, 2, 19, 150, 72, seed=9)
    counters = new_counters("cpu")
    with torch.no_grad():
        out = efta_reference(q, k, v, scale=0.1, causal=True, bias=None, attn_mask=None, window=None,
                             detect=True, correct=True, plan=None, counters=counters,
                             block_n=block_n, stride=stride)
    check_close(out, ref_attention(q, k, v, scale=0.1, causal=True), torch.float32)
    assert int(counters.sum()) == 0


def test_private_forward_counter_view():
    q, k, v = rand_qkv(1, 2, 2, 8, 40, 32, seed=10)
    big = torch.zeros((3,) + COUNTER_SHAPE, dtype=torch.int32)
    plan = FaultPlan(FaultSpec(site="attn.probs", bit=30, seed=1))
    with torch.no_grad():
        out = _efta_forward(q, k, v, scale=None, causal=True, bias=None, attn_mask=None, window=None,
                            pasa=False, detect=True, correct=True, plan=plan, counters=big[1],
                            backend="reference")
    check_close(out, ref_attention(q, k, v, causal=True), torch.float32)
    assert plan.injected == 1
    assert int(big[0].sum()) == 0 and int(big[2].sum()) == 0
    stats = FaultStats(big[1])
    assert stats["detected"] == 1 and stats["corrected"] == 1


# --------------------------------------------------------------------------------------------
# No false positives on clean inputs
# --------------------------------------------------------------------------------------------


def _verifications(B, Hq, M, N, D, block_n=64, s=16):
    """Number of individual checks one call makes (steps 1, 3, 4, 6, 7; steps 1 and 4 per group)."""
    nb = -(-N // block_n)
    rows = B * Hq * M
    return rows * (nb * s + nb + nb * s + 1 + s)


def test_no_false_positives_clean():
    shapes = [(2, 4, 2, 64, 64, 64), (1, 4, 1, 1, 300, 64), (1, 2, 2, 50, 130, 128), (1, 2, 1, 9, 1000, 32)]
    dists = ["normal", "normal1", "uniform", "trunc"]
    total_checks = 0
    detected = 0
    calls = 0
    for seed in range(12):
        for di, dist in enumerate(dists):
            for si, (B, Hq, Hkv, M, N, D) in enumerate(shapes):
                dtype = (torch.float32, torch.float16, torch.bfloat16)[(seed + si) % 3]
                q, k, v = rand_qkv(B, Hq, Hkv, M, N, D, dtype, seed=1000 * seed + 10 * di + si, dist=dist)
                mag = (1.0, 4.0, 0.25)[seed % 3]
                q = (q.float() * mag).to(dtype)
                out, stats = run(q, k, v, causal=bool(seed % 2))
                detected += stats["detected"]
                assert stats["nonfinite_input"] == 0
                total_checks += _verifications(B, Hq, M, N, D)
                calls += 1
    assert calls == 192
    assert total_checks > 2_000_000  # ≈ 2.3 M individual checks (steps 1 and 4 count per group)
    assert detected == 0, f"{detected} false positives in {total_checks} verifications"


# --------------------------------------------------------------------------------------------
# Injection
# --------------------------------------------------------------------------------------------

INJ_SHAPE = (2, 4, 2, 24, 100, 64)  # B, Hq, Hkv, M, N, D: two key blocks, the last one padded
EXP_BITS = (27, 28, 29, 30)
SEEDS = range(6)


@pytest.fixture(scope="module")
def inj_data():
    B, Hq, Hkv, M, N, D = INJ_SHAPE
    q, k, v = rand_qkv(B, Hq, Hkv, M, N, D, seed=42)
    clean, stats = run(q, k, v)
    assert stats["detected"] == 0
    return q, k, v, clean


def _maxdiff(a, b):
    d = (a.double() - b.double()).abs().max().item()
    return math.inf if math.isnan(d) else d


def _acts_unprotected(site: str, plan: FaultPlan) -> bool:
    """Whether the flip of ``plan`` at ``site`` acts on an unprotected call at all: a checksum exists only
    with the checks on, α of the first key block scales an empty state, and the max carried out of the last
    key block is read by no later block (one program per row block: no split merge)."""
    if site == "attn.checksum":
        return False
    if site == "attn.rowmax_carry":
        return int(plan.sites[site].positions[0, 3]) < -(-INJ_SHAPE[4] // 64) - 1
    return site != "attn.alpha" or int(plan.sites[site].positions[0, 3]) > 0


@pytest.mark.parametrize("site", ATTENTION_SITES)
def test_injection_corrected(site, inj_data):
    q, k, v, clean = inj_data
    harmful = 0
    total = 0
    for bit in EXP_BITS:
        for seed in SEEDS:
            spec = FaultSpec(site=site, bit=bit, count=1, seed=seed)
            plan = FaultPlan(spec)
            out, stats = run(q, k, v, inject=plan)
            assert plan.injected == 1
            assert _maxdiff(out, clean) <= 2e-4, (site, bit, seed, stats.by_site())
            assert stats["detected"] >= 1, (site, bit, seed)
            assert stats["detected"] == stats["corrected"] + stats["recomputed"], stats.by_site()
            assert stats["uncorrectable"] == 0 and stats["nonfinite_input"] == 0
            bare, bstats = run(q, k, v, inject=spec, detect=False)
            assert all(val == 0 for val in bstats.values())
            if _acts_unprotected(site, plan):
                total += 1
                harmful += _maxdiff(bare, clean) > 1e-3
    assert site == "attn.checksum" or harmful > total // 2, \
        f"{site}: only {harmful}/{total} unprotected flips changed the output"


def test_injection_always_harmful_unprotected(inj_data):
    """Flips that can never be harmless: they must visibly change the unprotected output."""
    q, k, v, clean = inj_data
    for site, bit in [("attn.probs", 30), ("attn.output", 30)]:  # P ≤ 1, |O| < 2: bit 30 makes them ≥ 2
        for seed in range(6):
            bare, _ = run(q, k, v, inject=FaultSpec(site=site, bit=bit, seed=seed), detect=False)
            assert _maxdiff(bare, clean) > 1e-3, (site, bit, seed)
    # one key block: the final l (≥ 1) is the flipped one, exponent flips scale the row by 2^±16 or more
    q1, k1, v1 = q[:, :, :, :], k[:, :, :60], v[:, :, :60]
    clean1, _ = run(q1, k1, v1)
    for bit in EXP_BITS:
        for seed in range(4):
            bare, _ = run(q1, k1, v1, inject=FaultSpec(site="attn.rowsum", bit=bit, seed=seed), detect=False)
            assert _maxdiff(bare, clean1) > 1e-3, (bit, seed)


@pytest.mark.parametrize("site", ATTENTION_SITES)
def test_correct_false_counts_uncorrectable(site, inj_data):
    q, k, v, clean = inj_data
    for seed in range(3):
        out, stats = run(q, k, v, inject=FaultSpec(site=site, bit=30, seed=seed), correct=False)
        assert stats["detected"] >= 1
        assert stats["uncorrectable"] == stats["detected"]
        assert stats["corrected"] == 0 and stats["recomputed"] == 0


def test_masked_and_decode_injection():
    """Faults with masks, GQA and decode-shaped calls are repaired too."""
    B, Hq, Hkv, M, N, D = 2, 4, 2, 3, 150, 64
    q, k, v = rand_qkv(B, Hq, Hkv, M, N, D, seed=11)
    keep = torch.ones(B, 1, 1, N, dtype=torch.bool)
    keep[1, ..., :40] = False  # left padding
    kw = dict(causal=True, attn_mask=keep, window=100)
    clean, _ = run(q, k, v, **kw)
    check_close(clean, ref_attention(q, k, v, **kw), torch.float32)
    for site in ATTENTION_SITES:
        for bit in (28, 30):
            for seed in range(2):
                out, stats = run(q, k, v, inject=FaultSpec(site=site, bit=bit, seed=seed), **kw)
                assert _maxdiff(out, clean) <= 2e-4, (site, bit, seed)
                assert stats["detected"] == stats["corrected"] + stats["recomputed"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_injection_half_inputs(dtype):
    """Attention sites are fp32 whatever the input dtype; faults are repaired before the cast."""
    q, k, v = rand_qkv(1, 4, 2, 16, 90, 64, dtype, seed=14)
    clean, _ = run(q, k, v, causal=True)
    for site in ATTENTION_SITES:
        bit = 29 if site_dtype(site, dtype) == torch.float32 else 13  # an exponent bit of fp32 / fp16 / bf16
        for seed in range(3):
            out, stats = run(q, k, v, causal=True, inject=FaultSpec(site=site, bit=bit, seed=seed))
            assert out.dtype == dtype
            assert _maxdiff(out, clean) <= TOL[dtype] / 4, (site, seed)
            assert stats["detected"] >= 1 and stats["detected"] == stats["corrected"] + stats["recomputed"]


@pytest.mark.parametrize("site", ATTENTION_SITES)
def test_ber_mode(site, inj_data):
    q, k, v, clean = inj_data
    ber = {"attn.scores": 2e-3, "attn.masked_scores": 2e-3, "attn.exponent": 2e-3, "attn.probs": 2e-3,
           "attn.probs_lp": 2e-3, "attn.rowmax": 0.02, "attn.alpha": 0.02, "attn.rowsum": 0.02, "attn.acc": 1e-3,
           "attn.output": 2e-3, "attn.checksum": 2e-3, "attn.rowmax_carry": 0.02}[site]
    plan = FaultPlan(FaultSpec(site=site, ber=ber, seed=5))
    out, stats = run(q, k, v, inject=plan)
    assert plan.injected >= 3
    assert stats["detected"] >= 1
    assert stats["detected"] == stats["corrected"] + stats["recomputed"]
    # low mantissa flips stay below the rounding thresholds by design: harmless, not exact
    assert _maxdiff(out, clean) <= 1e-3, stats.by_site()


# --------------------------------------------------------------------------------------------
# Non-finite inputs
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", NONFINITE_CASES)
def test_nonfinite_inputs(where):
    q, k, v, bias, mask = nonfinite_case(where, *rand_qkv(1, 2, 2, 10, 70, 32, seed=12))
    out, stats = run(q, k, v, bias=bias, attn_mask=mask)
    assert stats["nonfinite_input"] == 1
    assert stats["detected"] == 0 and stats["corrected"] == 0 and stats["recomputed"] == 0
    plain = ref_attention(q, k, v, bias=bias, attn_mask=mask)
    assert torch.equal(torch.isnan(out), torch.isnan(plain))
    fin = ~torch.isnan(plain)
    assert (out.double()[fin] - plain[fin]).abs().max() < 1e-5


def test_neginf_mask_is_not_nonfinite():
    q, k, v = rand_qkv(1, 2, 2, 10, 70, 32, seed=13)
    bias = torch.zeros(1, 1, 10, 70)
    bias[..., :3] = -math.inf
    out, stats = run(q, k, v, bias=bias)
    assert stats["nonfinite_input"] == 0
    check_close(out, ref_attention(q, k, v, bias=bias), torch.float32)


# --------------------------------------------------------------------------------------------
# Bad inputs
# --------------------------------------------------------------------------------------------


def test_bad_inputs():
    q, k, v = rand_qkv(2, 4, 2, 8, 16, 32)
    with pytest.raises(ValueError, match="4-D"):
        run(q[0], k, v)
    with pytest.raises(TypeError, match="dtype"):
        run(q.double(), k.double(), v.double())
    with pytest.raises(TypeError, match="dtype"):
        run(q.to(torch.int32), k, v)
    with pytest.raises(TypeError, match="share one dtype"):
        run(q.half(), k, v)
    with pytest.raises(ValueError, match="head dim"):
        run(q[..., :16], k, v)
    with pytest.raises(ValueError, match="batch"):
        run(q[:1], k, v)
    with pytest.raises(ValueError, match="multiple"):
        run(q[:, :3], k, v)
    with pytest.raises(ValueError, match="same shape"):
        run(q, k, v[:, :, :8])
    with pytest.raises(ValueError, match="not broadcastable"):
        run(q, k, v, attn_mask=torch.ones(2, 3, 8, 16, dtype=torch.bool))
    with pytest.raises(ValueError, match="not broadcastable"):
        run(q, k, v, bias=torch.zeros(8, 15))
    with pytest.raises(ValueError, match="at most 4"):
        run(q, k, v, bias=torch.zeros(1, 1, 1, 8, 16))
    with pytest.raises(TypeError, match="attn_mask"):
        run(q, k, v, attn_mask=torch.ones(2, 1, 8, 16, dtype=torch.int64))
    with pytest.raises(ValueError, match="window"):
        run(q, k, v, window=0)
    with pytest.raises(ValueError, match="inference"):
        efta_attention(q.clone().requires_grad_(), k, v)
    with pytest.raises(ValueError, match="linear.output"):
        run(q, k, v, inject=FaultSpec(site="linear.output", bit=3))
    with pytest.raises(NotImplementedError, match="PASA"):
        run(q, k, v, pasa=True)
    with pytest.raises(ValueError, match="backend"):
        run(q, k, v, backend="cuda")
    # requires_grad is fine when grad is disabled
    with torch.inference_mode():
        out, _ = efta_attention(q.clone().requires_grad_(False), k, v)
    # 2-D and 3-D masks broadcast like torch
    out2, _ = run(q, k, v, attn_mask=torch.ones(8, 16, dtype=torch.bool))
    check_close(out2, ref_attention(q, k, v), torch.float32)


def test_triton_backend_missing(monkeypatch):
    import ft_transformers.efta as efta_mod

    q, k, v = rand_qkv(1, 2, 2, 4, 8, 32)
    monkeypatch.setattr(efta_mod, "_triton_module", lambda: None)
    with pytest.raises(NotImplementedError, match="triton"):
        run(q, k, v, backend="triton")
    out, _ = run(q, k, v, backend="auto")  # auto falls back to the reference
    check_close(out, ref_attention(q, k, v), torch.float32)


@pytest.mark.parametrize("m0", [-1.0, 1.0])
def test_rowmax_flipped_to_infinity(m0):
    """A running max of exactly ±1.0 becomes ±inf under a bit-30 flip; the row must still be right.

    With m = −inf the literal contract (base 0, τ_m = inf) let the flip pass, and the next block's
    α = exp(−inf − m) = 0 silently erased the first block.
    """
    N, D = 100, 16  # two key blocks
    q = torch.zeros(1, 1, 1, D)
    q[..., 0] = 1.0
    k = torch.zeros(1, 1, N, D)
    g = torch.Generator().manual_seed(0)
    k[0, 0, :64, 0] = m0 - torch.rand(64, generator=g)  # block 0: max exactly m0
    k[0, 0, 7, 0] = m0
    k[0, 0, 64:, 0] = m0 - 0.5 - torch.rand(36, generator=g)  # block 1: below m0, same order
    v = torch.randn(1, 1, N, D, generator=g)
    clean, _ = run(q, k, v, scale=1.0)
    check_close(clean, ref_attention(q, k, v, scale=1.0), torch.float32)
    seed = next(s for s in range(100)
                if int(FaultPlan(FaultSpec(site="attn.rowmax", bit=30, seed=s)).for_site(
                    "attn.rowmax", (1, 1, 1, 2), torch.float32, "cpu").positions[0, 3]) == 0)
    spec = FaultSpec(site="attn.rowmax", bit=30, seed=seed)
    out, stats = run(q, k, v, scale=1.0, inject=spec)
    assert _maxdiff(out, clean) <= 1e-6
    assert stats.by_site()["attn.rowmax"]["detected"] == 1
    bare, _ = run(q, k, v, scale=1.0, inject=spec, detect=False)
    assert _maxdiff(bare, clean) > 1e-2


def test_exp_group_check_covers_bits_that_reach_pv():
    """Step 4's product check per group, against float64 exp: silent on clean groups (masked keys,
    underflow and flushed zeros included); for a P ≥ e^-19 (above the clamp P_min = e^-20 by more
    than the tolerance) every sign and exponent flip caught, and the mantissa flips that survive P's
    rounding to fp16 (bits 13 and up): from bit 12 when |x| ≤ 5, from bit 14 when |x| ≤ 50, from bit
    16 in groups that also hold masked or underflowed keys (each counts as x = −20 and widens the
    tolerance). A flip that keeps a P below P_min is not seen (it moves P by < P_min), a flip that
    lifts it far above P_min is. A NaN P is caught too."""
    from ft_transformers.kernels.contract import P_MIN

    from ft_transformers.efta_reference.softmax import exp_group_test

    gen = torch.Generator().manual_seed(0)
    rows = 4000
    ar = torch.arange(rows)
    for spread, masked, low in ((5.0, False, 12), (50.0, False, 14), (5.0, True, 16), (50.0, True, 16)):
        x = -torch.rand(rows, 64, dtype=torch.float64, generator=gen) * spread
        x[:, 0] = 0.0
        if masked:
            x[:, 40:] = float("-inf")
            x[:, 20:24] = -95.0  # exp underflows: P flushed to 0 or subnormal
        P = torch.exp(x).float()
        if masked:
            P[::2, 20:24] = 0.0
        x32 = x.float()
        base = torch.zeros(rows, 1)  # S = x: the anchor is x itself here
        assert not exp_group_test(x32, base, P, 16).any()
        # one key per row with x ≥ −19 (col 0 always qualifies): random among those
        col = torch.where(x32 >= -19.0, torch.rand(rows, 64, generator=gen), -1.0).argmax(1)
        for bit in range(low, 32):
            Pi = P.clone().view(torch.int32)
            Pi[ar, col] ^= (1 << bit) if bit < 31 else -(1 << 31)
            bad = exp_group_test(x32, base, Pi.view(torch.float32), 16)
            assert int(bad.sum()) == rows and bool(bad[ar, col % 16].all()), (spread, masked, bit)
        if spread == 50.0 and not masked:  # keys far below the clamp: x ≤ −25
            tiny = torch.where(x32 <= -25.0, torch.rand(rows, 64, generator=gen), -1.0).argmax(1)
            assert bool((x32[ar, tiny] <= -25.0).all())
            for bit, seen in ((23, False), (24, False), (30, True)):  # ×2^±1, ×2^±2: still < P_min; ×2^128
                Pi = P.clone().view(torch.int32)
                Pi[ar, tiny] ^= 1 << bit
                assert bool((Pi.view(torch.float32)[ar, tiny] < P_MIN).all()) != seen
                bad = exp_group_test(x32, base, Pi.view(torch.float32), 16)
                assert int(bad.sum()) == (rows if seen else 0), (bit, int(bad.sum()))
        Pn = P.clone()
        Pn[0, 3] = float("nan")
        assert bool(exp_group_test(x32, base, Pn, 16)[0, 3])
