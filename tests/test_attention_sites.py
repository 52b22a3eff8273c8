"""The attention-loop sites that complete EFTA's fault model (``docs/algorithms.md``, "Fault model of the
key loop"): ``attn.masked_scores`` (S after step 2: bias added, −inf where masked), ``attn.exponent`` (x,
the exponent fed to exp), ``attn.probs_lp`` (P as GEMM II reads it,
in the input dtype), ``attn.alpha`` (the rescale α), ``attn.acc`` (the output accumulator between key
blocks) and ``attn.checksum`` (GEMM I's Sc1 and GEMM II's running Oc1).

Each site on the PyTorch reference and on the Triton kernel (interpreted on CPU: ``TRITON_INTERPRET=1``,
set below before triton is imported; compiled on a GPU): a flip of a high exponent bit lands at the same
position on both, is detected and repaired, and both count the same events; clean calls count nothing.
The oracle for outputs is the clean call and a float64 attention (``float64_attention.py``).
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from float64_attention import ref_attention
from interpreted import interpreted_tests

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from ft_transformers.kernels import efta as K  # noqa: E402
from ft_transformers.kernels.contract import LOG2E, exp_clamp, site_dtype, site_shape  # noqa: E402

from ft_transformers.counters import FaultStats, new_counters  # noqa: E402
from ft_transformers.efta_reference import efta_reference  # noqa: E402
from ft_transformers.efta_reference.softmax import exp_group_test, probs_for_test  # noqa: E402
from ft_transformers.injection import FaultPlan, FaultSpec  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SUBPROCESS = DEV == "cpu" and not K.interpreting()
_interpreter_available, test_interpreted_in_subprocess = interpreted_tests(__file__, SUBPROCESS, timeout=900)

NEW_SITES = ("attn.masked_scores", "attn.exponent", "attn.probs_lp", "attn.alpha", "attn.acc", "attn.checksum",
             "attn.rowmax_carry")
SHAPE = (1, 2, 1, 8, 130, 32)  # B, Hq, Hkv, M, N, D: GQA 2:1, three key blocks of 64, the last padded
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
# the rows (checks) that count a site's faults: x and the rounded P at step 4, α at its own check, O's
# accumulator at step 7, Sc1 at step 1 and Oc1 at step 7, the carried max at step 6 (its shadow lost, the row's l
# is made NaN); S after step 2 at step 4 (against step 2 again), at step 3 where it lifted the block max, and at
# step 6 where the lifted max left the row's state empty
COUNTED_AT = {"attn.masked_scores": {"attn.probs", "attn.rowmax", "attn.rowsum"},
              "attn.exponent": {"attn.probs"}, "attn.probs_lp": {"attn.probs"}, "attn.alpha": {"attn.alpha"},
              "attn.acc": {"attn.output"}, "attn.checksum": {"attn.scores", "attn.output"},
              "attn.rowmax_carry": {"attn.rowsum"}}


def rand_qkv(B, Hq, Hkv, M, N, D, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = ((B, Hq, M, D), (B, Hkv, N, D), (B, Hkv, N, D))
    return tuple(torch.randn(*s, generator=g).to(dtype).to(DEV) for s in shapes)


def _call(path, q, k, v, *, inject=None, detect=True, correct=True, causal=False, attn_mask=None, window=None,
          bias=None):
    """One call on ``path`` ("kernel" or "reference", the latter on CPU copies): (out, FaultStats, plan)."""
    plan = inject if isinstance(inject, FaultPlan) else FaultPlan(inject)
    kw = dict(scale=1.0 / math.sqrt(q.shape[-1]), causal=causal, window=window, detect=detect, correct=correct,
              plan=plan)
    with torch.no_grad():
        if path == "kernel":
            cnt = new_counters(q.device)
            out = K.efta_triton_forward(q, k, v, attn_mask=attn_mask, bias=bias, counters=cnt, **kw)
        else:
            cnt = new_counters("cpu")
            out = efta_reference(q.cpu(), k.cpu(), v.cpu(), attn_mask=None if attn_mask is None else attn_mask.cpu(),
                                 bias=None if bias is None else bias.cpu(), counters=cnt, **kw)
    return out, FaultStats(cnt), plan


def _maxdiff(a, b) -> float:
    d = (a.double().cpu() - b.double().cpu()).abs().max().item()
    return math.inf if math.isnan(d) else d


def _high_bit(site: str, dtype: torch.dtype) -> int:
    """The top exponent bit of the site's storage format (fp32: 30; fp16 and bf16: 14)."""
    return 30 if site_dtype(site, dtype) == torch.float32 else 14


@pytest.fixture(scope="module")
def data():
    if SUBPROCESS:  # module-scoped fixtures run before the autouse skip
        pytest.skip("triton was imported before TRITON_INTERPRET=1: covered by test_interpreted_in_subprocess")
    q, k, v = rand_qkv(*SHAPE, seed=3)
    clean, stats, _ = _call("kernel", q, k, v)
    assert all(val == 0 for val in stats.values())
    assert _maxdiff(clean, ref_attention(q, k, v)) <= TOL[torch.float32]
    return q, k, v, clean


# ------------------------------------------------------------------------------------------------
# the checks that close the holes, on their own (reference path)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("p_dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_exp_check_sees_the_exponent(p_dtype):
    """Step 4 takes its exponents from the scores: silent on clean groups (masked keys, large |m| and P
    rounded to the dtype GEMM II reads included); a flip of x's sign or top exponent bits (P = exp of the
    flipped x, as the loop computes it) fails the group, while the same test on x itself passes it."""
    gen = torch.Generator().manual_seed(1)
    rows, n = 1000, 64
    ar = torch.arange(rows)
    for big in (0.0, 40.0, 3000.0):  # |base|: the rounding of L scores of that size
        S = (torch.randn(rows, n, generator=gen) * 4.0 + big).float()
        S[::3, 50:] = -math.inf  # masked keys
        base = S.amax(-1, keepdim=True)
        x = S - base
        pd = torch.exp(x).to(p_dtype).float()
        assert not exp_group_test(S, base, pd, 16, p_dtype).any(), big
        xmin = exp_clamp(p_dtype)[0]
        # keys above the clamp and not at the max (a sign flip of x ≈ 0 moves P by ≈ 0)
        pick = (x > xmin + 1.0) & (x < -0.5)
        col = torch.where(pick, torch.rand(rows, n, generator=gen), -1.0).argmax(1)
        for bit in (31, 30, 29, 28):
            xi = x.clone().view(torch.int32)
            xi[ar, col] ^= (1 << bit) if bit < 31 else -(1 << 31)
            xf = xi.view(torch.float32)
            pf = torch.exp(xf).to(p_dtype).float()
            moved = ((pf - pd).abs()[ar, col] > 0) & pick.any(1)  # the flip changed P as GEMM II reads it
            bad = exp_group_test(S, base, pf, 16, p_dtype)
            assert bool(bad[ar, col % 16][moved].all()), (big, bit)
            assert int(moved.sum()) > rows // 2, (big, bit)
            # anchored on the flipped x itself (x as both scores and exponent), the identity holds
            assert not exp_group_test(xf, torch.zeros(rows, 1), pf, 16, p_dtype)[moved].any(), (big, bit)


def test_exp_check_sees_the_rounded_probabilities():
    """A flip of a sign or exponent bit of P as GEMM II reads it (fp16 / bf16) fails its group whenever the
    value was above the clamp or lands above it."""
    gen = torch.Generator().manual_seed(2)
    rows = 1000
    ar = torch.arange(rows)
    for p_dtype, bits in ((torch.float16, range(10, 16)), (torch.bfloat16, range(7, 16))):
        S = torch.randn(rows, 64, generator=gen).float() * 3.0
        base = S.amax(-1, keepdim=True)
        pd = torch.exp(S - base).to(p_dtype)
        pmin = exp_clamp(p_dtype)[1]
        col = torch.randint(0, 64, (rows,), generator=gen)
        for bit in bits:
            pi = pd.clone().view(torch.int16)
            pi[ar, col] ^= (1 << bit) if bit < 15 else -(1 << 15)
            pf = pi.view(p_dtype).float()
            was, now = pd.float()[ar, col], pf[ar, col]
            seen = ((was > 2 * pmin) | (now > 2 * pmin)) & (now != was)
            bad = exp_group_test(S, base, pf, 16, p_dtype)[ar, col % 16]
            assert bool(bad[seen].all()), (p_dtype, bit)
            assert int(seen.sum()) > 0, (p_dtype, bit)


def test_bf16_rounded_probabilities_are_checked_bit_for_bit():
    """bf16: a change of one or two ulps of P_lp at one key sits inside the product test's room for P's
    rounding (half an ulp per key), so the test reads the fp32 P instead, with P_lp tested for being its
    rounding (`probs_for_test`): every such change fails its group, and clean P passes."""
    gen = torch.Generator().manual_seed(3)
    rows = 1000
    ar = torch.arange(rows)
    S = torch.randn(rows, 64, generator=gen).float() * 2.0
    S[::4, 40:] = -math.inf  # masked keys (P = 0)
    base = S.amax(-1, keepdim=True)
    P = torch.exp(S - base)
    pd = P.to(torch.bfloat16)
    assert not exp_group_test(S, base, probs_for_test(P, pd.float(), torch.bfloat16), 16).any()
    col = torch.randint(0, 64, (rows,), generator=gen)
    old_missed = 0
    for delta in (1, 2, -1):  # ulps of P_lp (bit 0 or 1 of its mantissa, up or down)
        pi = pd.clone().view(torch.int16)
        pi[ar, col] += delta
        pf = pi.view(torch.bfloat16).float()
        changed = pf[ar, col] != pd.float()[ar, col]
        bad = exp_group_test(S, base, probs_for_test(P, pf, torch.bfloat16), 16)[ar, col % 16]
        assert bool(bad[changed].all()), delta
        old_missed += int((~exp_group_test(S, base, pf, 16, torch.bfloat16)[ar, col % 16] & changed).sum())
    assert old_missed > rows  # the same test on P_lp with bf16's room lets most of them through


# ------------------------------------------------------------------------------------------------
# the holes, unprotected: a flip at these sites changes the output
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("site", ["attn.masked_scores", "attn.exponent", "attn.probs_lp", "attn.alpha", "attn.acc",
                                  "attn.rowmax_carry"])
def test_unprotected_flips_change_the_output(site, data):
    """Without checks, top-exponent-bit flips at these sites move the output (α: flips after the first key
    block, where it scales a real state; the carried max: flips before the last block, which a later block
    reads); ``attn.checksum`` exists only with the checks on."""
    q, k, v, clean = data
    moved = total = 0
    for seed in range(12):
        spec = FaultSpec(site=site, bit=_high_bit(site, q.dtype), seed=seed)
        plan = FaultPlan(spec)
        bare, stats, _ = _call("reference", q, k, v, inject=plan, detect=False)
        assert plan.injected == 1 and all(val == 0 for val in stats.values())
        if site == "attn.alpha" and int(plan.sites[site].positions[0, 3]) == 0:
            continue
        if site == "attn.rowmax_carry" and int(plan.sites[site].positions[0, 3]) == -(-k.shape[2] // 64) - 1:
            continue
        total += 1
        moved += _maxdiff(bare, clean) > 1e-3
    assert total >= 4 and moved >= total - 1, (site, moved, total)


def test_checksum_site_needs_the_checks(data):
    """``attn.checksum`` has no value in an unchecked call: nothing is injected on either path."""
    q, k, v, clean = data
    for path in ("reference", "kernel"):
        out, stats, plan = _call(path, q, k, v, inject=FaultSpec(site="attn.checksum", bit=30, seed=1), detect=False)
        assert plan.injected == 0 and _maxdiff(out, clean) <= TOL[torch.float32], path


# ------------------------------------------------------------------------------------------------
# the kernel and the reference agree, faults are repaired
# ------------------------------------------------------------------------------------------------


def _first_seed(site, q, k, ok) -> int:
    """The first seed whose single flip at ``site`` lands at a position (b, h, row, col) with ``ok(pos)``."""
    B, Hq, M, D = q.shape
    N = k.shape[2]
    nb = -(-N // 64)
    shape = site_shape(site, B, Hq, M, N, D, nb)
    return next(seed for seed in range(100)
                if ok(FaultPlan(FaultSpec(site=site, bit=0, seed=seed)).for_site(site, shape, torch.float32, "cpu")
                      .positions[0].tolist()))


def _check_repaired(site, q, k, v, clean, spec, tol, with_output=False, **kw):
    """Kernel and reference under one spec: same positions, same counters, detected and repaired. Returns the
    kernel's stats (with ``with_output``, and its output)."""
    out, stats, plan = _call("kernel", q, k, v, inject=spec, **kw)
    rout, rstats, rplan = _call("reference", q, k, v, inject=spec, **kw)
    assert plan.injected == rplan.injected == spec.count, (site, plan.injected, rplan.injected)
    assert torch.equal(plan.sites[site].positions, rplan.sites[site].positions)
    assert stats.counters.cpu().tolist() == rstats.counters.tolist(), (site, stats.by_site(), rstats.by_site())
    assert stats["detected"] >= 1, (site, spec)
    assert stats["detected"] == stats["corrected"] + stats["recomputed"], stats.by_site()
    assert stats["uncorrectable"] == 0 and stats["nonfinite_input"] == 0
    assert _maxdiff(out, clean) <= tol and _maxdiff(rout, clean) <= tol, (site, spec, stats.by_site())
    return (stats, out) if with_output else stats


@pytest.mark.parametrize("site", NEW_SITES)
def test_site_detected_and_repaired(site, data):
    """Top exponent bit (and the sign for x and α) at three positions: found, repaired, same counts on both
    paths. Where each check counts: x and the rounded P at step 4 (``attn.probs``), α at its own check
    (``attn.alpha``), O's accumulator at step 7 (``attn.output``), Sc1 at step 1 and Oc1 at step 7 (not
    located: the row recomputed), the carried max at step 6 (``attn.rowsum``: the row recomputed), after its
    last key block too (where the split merge and step 6 read it)."""
    q, k, v, clean = data
    counted_at = COUNTED_AT[site]
    specs = [FaultSpec(site=site, bit=_high_bit(site, q.dtype), seed=seed) for seed in range(3)]
    if site in ("attn.exponent", "attn.alpha"):  # the sign too (α: after the first block, where α ≠ 0)
        specs.append(FaultSpec(site=site, bit=31, seed=_first_seed(site, q, k, lambda pos: pos[3] > 0)))
    if site == "attn.rowmax_carry":  # the sign, and a low mantissa bit; m after the last block
        specs.append(FaultSpec(site=site, bit=31, seed=_first_seed(site, q, k, lambda pos: pos[3] == 0)))
        specs.append(FaultSpec(site=site, bit=3, seed=_first_seed(site, q, k, lambda pos: pos[3] == 1)))
        specs.append(FaultSpec(site=site, bit=30, seed=_first_seed(site, q, k, lambda pos: pos[3] == 2)))
    for spec in specs:
        stats = _check_repaired(site, q, k, v, clean, spec, 2e-4)
        assert set(stats.by_site()) <= counted_at, (site, stats.by_site())
        if site in ("attn.checksum", "attn.rowmax_carry"):
            assert stats["recomputed"] == stats["detected"]  # a row recomputed, never a located correction


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_low_precision_inputs(dtype):
    """fp16 and bf16 inputs: ``attn.probs_lp`` holds P in that dtype (bits 0–15); its flips and those of
    the other new sites repaired with the same counts on both paths, causal."""
    q, k, v = rand_qkv(*SHAPE, dtype=dtype, seed=5)
    clean, stats, _ = _call("kernel", q, k, v, causal=True)
    assert all(val == 0 for val in stats.values())
    with pytest.raises(ValueError, match="out of range"):
        _call("kernel", q, k, v, causal=True, inject=FaultSpec(site="attn.probs_lp", bit=20))
    for i, site in enumerate(NEW_SITES):
        bit = _high_bit(site, dtype) - i % 2  # 14 / 13 (16-bit) or 30 / 29
        _check_repaired(site, q, k, v, clean, FaultSpec(site=site, bit=bit, seed=i), TOL[dtype] / 4, causal=True)


def test_bf16_low_bits_of_the_rounded_probabilities():
    """bf16: flips of P_lp's lowest mantissa bits (a change of 1–4 of its ulps, which the product test's
    rounding room let through) are detected and corrected on both paths with the same counts, wherever they
    land (a masked key's 0 becomes a tiny subnormal): the kernel's output is its clean one bit for bit."""
    q, k, v = rand_qkv(*SHAPE, dtype=torch.bfloat16, seed=5)
    clean, stats, _ = _call("kernel", q, k, v, causal=True)
    assert all(val == 0 for val in stats.values())
    for bit, seed in ((0, 0), (1, 1), (2, 2), (0, 3), (1, 4)):
        spec = FaultSpec(site="attn.probs_lp", bit=bit, seed=seed)
        stats, out = _check_repaired("attn.probs_lp", q, k, v, clean, spec, TOL[torch.bfloat16] / 4,
                                     with_output=True, causal=True)
        assert set(stats.by_site()) == {"attn.probs"}, (bit, seed, stats.by_site())
        assert stats["detected"] == stats["corrected"] == 1, (bit, seed, stats.by_site())
        assert torch.equal(out, clean), (bit, seed)
    # decode-shaped: 3 queries over 150 keys, GQA 2:1
    q, k, v = rand_qkv(1, 4, 2, 3, 150, 32, dtype=torch.bfloat16, seed=6)
    clean, stats, _ = _call("kernel", q, k, v, causal=True)
    assert all(val == 0 for val in stats.values())
    for bit, seed in ((0, 1), (1, 2)):
        stats = _check_repaired("attn.probs_lp", q, k, v, clean, FaultSpec(site="attn.probs_lp", bit=bit, seed=seed),
                                TOL[torch.bfloat16] / 4, causal=True)
        assert set(stats.by_site()) == {"attn.probs"}, (bit, seed, stats.by_site())
        assert stats["detected"] == stats["corrected"] == 1, (bit, seed, stats.by_site())


def test_masks_gqa_window_decode():
    """A padding mask, GQA, a sliding window and a decode-shaped call (3 queries over 150 keys): every new
    site's flip repaired with the same counts on both paths."""
    B, Hq, Hkv, M, N, D = 2, 2, 1, 3, 150, 32
    q, k, v = rand_qkv(B, Hq, Hkv, M, N, D, seed=7)
    keep = torch.ones(B, 1, 1, N, dtype=torch.bool)
    keep[1, ..., :40] = False  # left padding
    kw = dict(causal=True, attn_mask=keep.to(DEV), window=100)
    clean, stats, _ = _call("kernel", q, k, v, **kw)
    assert all(val == 0 for val in stats.values())
    assert _maxdiff(clean, ref_attention(q, k, v, **kw)) <= TOL[torch.float32]
    for site in NEW_SITES:
        _check_repaired(site, q, k, v, clean, FaultSpec(site=site, bit=_high_bit(site, q.dtype), count=2, seed=2),
                        2e-4, **kw)


@pytest.mark.parametrize("form", ["causal", "bool", "additive", "bias"])
def test_step2_output_is_checked(form):
    """S after step 2 (``attn.masked_scores``), in each form step 2 takes (a causal edge block, a bool and an
    additive mask, a bias): a masked key's −inf made finite (bit 30: −1.0, the row's max or near it), a kept
    key's score lifted (bit 30) or moved (bit 27, sign), each found on both paths with the same counts and
    repaired; unprotected, the masked key's flip moves the output."""
    B, Hq, Hkv, M, N, D = 1, 2, 1, 16, 130, 32
    q, k, v = rand_qkv(B, Hq, Hkv, M, N, D, seed=13)
    gen = torch.Generator().manual_seed(2)
    keep = torch.rand(B, 1, M, N, generator=gen) > 0.3
    keep[..., -1] = True
    kw = {"causal": dict(causal=True), "bool": dict(attn_mask=keep.to(DEV)),
          "additive": dict(attn_mask=torch.where(keep, 0.0, -math.inf).to(DEV)),
          "bias": dict(bias=(torch.randn(B, Hq, M, N, generator=gen) * 2.0).to(DEV), causal=True)}[form]
    clean, stats, _ = _call("kernel", q, k, v, **kw)
    assert all(val == 0 for val in stats.values())
    assert _maxdiff(clean, ref_attention(q, k, v, **kw)) <= TOL[torch.float32]
    hidden = keep[0, 0].tolist() if form in ("bool", "additive") else None

    def masked(pos):  # a key step 2 hides from this row
        i, j = pos[2], pos[3]
        return j > i + N - M if hidden is None else not hidden[i][j]

    site = "attn.masked_scores"
    specs = [FaultSpec(site=site, bit=30, seed=_first_seed(site, q, k, masked)),
             FaultSpec(site=site, bit=30, seed=_first_seed(site, q, k, lambda pos: not masked(pos))),
             FaultSpec(site=site, bit=27, seed=_first_seed(site, q, k, lambda pos: not masked(pos) and pos[3] > 64)),
             FaultSpec(site=site, bit=31, seed=_first_seed(site, q, k, lambda pos: not masked(pos) and pos[3] < 64))]
    bare, _, _ = _call("reference", q, k, v, inject=specs[0], detect=False, **kw)
    assert _maxdiff(bare, clean) > 1e-3
    for spec in specs:
        stats = _check_repaired(site, q, k, v, clean, spec, 2e-4, **kw)
        assert set(stats.by_site()) <= COUNTED_AT[site], (form, spec, stats.by_site())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_row_sum_twin_is_exact(dtype):
    """l = Σ P_lp and its twin lc are two ones columns of GEMM II's checksum product, equal bit for bit in a
    clean run, so step 6 compares them exactly: a flip of l in the last key block is found at every bit class
    (sign, exponent, a mantissa bit, and bit 2, a relative change of about 2^-21, far below the range test's
    τ_l), counted at ``attn.rowsum`` with the row recomputed, with the reference's counts; the output is
    the clean one. A flip in the first block, rescaled and added to by two more blocks, too."""
    q, k, v = rand_qkv(*SHAPE, dtype=dtype, seed=11)
    clean, stats, _ = _call("kernel", q, k, v, causal=True)
    assert all(val == 0 for val in stats.values())
    nb = -(-SHAPE[4] // 64)
    last = _first_seed("attn.rowsum", q, k, lambda pos: pos[3] == nb - 1)
    first = _first_seed("attn.rowsum", q, k, lambda pos: pos[3] == 0)
    for bit, seed in ((31, last), (30, last), (20, last), (2, last), (27, first), (12, first)):
        spec = FaultSpec(site="attn.rowsum", bit=bit, seed=seed)
        stats = _check_repaired("attn.rowsum", q, k, v, clean, spec, TOL[dtype] / 4, causal=True)
        assert set(stats.by_site()) == {"attn.rowsum"} and stats["detected"] == stats["recomputed"] == 1, \
            (bit, stats.by_site())


@pytest.mark.parametrize("site", NEW_SITES)
def test_correct_false_counts_uncorrectable(site, data):
    q, k, v, _ = data
    spec = FaultSpec(site=site, bit=30, seed=1)
    _, stats, _ = _call("kernel", q, k, v, inject=spec, correct=False)
    _, rstats, _ = _call("reference", q, k, v, inject=spec, correct=False)
    assert stats["detected"] >= 1 and stats["uncorrectable"] == stats["detected"]
    assert stats["corrected"] == 0 and stats["recomputed"] == 0
    # the checks that own the site agree exactly; what the unrepaired fault does downstream (a huge P left
    # in place) can sit at another check's rounding threshold and differ by one
    for row in COUNTED_AT[site]:
        assert stats.by_site().get(row) == rstats.by_site().get(row), (site, stats.by_site(), rstats.by_site())


def test_ber_low_precision_probabilities():
    """BER mode at ``attn.probs_lp`` (random bits of the 16-bit values): some flips found, every one found
    repaired or harmless; the unprotected call is changed."""
    q, k, v = rand_qkv(*SHAPE, dtype=torch.float16, seed=9)
    clean, _, _ = _call("kernel", q, k, v)
    spec = FaultSpec(site="attn.probs_lp", ber=0.02, seed=4)
    out, stats, _ = _call("kernel", q, k, v, inject=spec)
    assert stats["detected"] >= 1 and stats["detected"] == stats["corrected"] + stats["recomputed"]
    assert _maxdiff(out, clean) <= TOL[torch.float16] / 2, stats.by_site()
    bare, _, _ = _call("kernel", q, k, v, inject=spec, detect=False)
    assert _maxdiff(bare, clean) > 0.0


# ------------------------------------------------------------------------------------------------
# clean calls: no false positives from the new checks
# ------------------------------------------------------------------------------------------------


def test_clean_calls_count_nothing():
    """Clean calls over dtypes, causal, padding masks, GQA, windows, decode and large score magnitudes
    (|m| up to ~10^3: the exponent check's room grows with |base|): no event on either path. Many on the
    reference, a few on the kernel."""
    shapes = [(1, 2, 1, 8, 130, 32), (2, 4, 2, 1, 200, 64), (1, 2, 2, 20, 70, 48), (1, 4, 1, 5, 300, 32)]
    dtypes = (torch.float32, torch.float16, torch.bfloat16)
    calls = 0
    for i in range(32):
        B, Hq, Hkv, M, N, D = shapes[i % len(shapes)]
        dtype = dtypes[i % 3]
        q, k, v = rand_qkv(B, Hq, Hkv, M, N, D, dtype=dtype, seed=100 + i)
        mag = (1.0, 8.0, 60.0)[(i // 3) % 3]
        q = (q.float() * mag).to(dtype)
        keep = torch.rand(B, 1, 1, N, generator=torch.Generator().manual_seed(i)) > 0.2
        keep[..., -1] = True
        kw = dict(causal=bool(i % 2), window=(None, 50)[(i // 2) % 2], attn_mask=keep.to(DEV) if i % 4 == 3 else None)
        paths = ("reference", "kernel") if i % 5 == 0 else ("reference",)  # the kernel: 7 mixed cases
        for path in paths:
            out, stats, _ = _call(path, q, k, v, **kw)
            assert all(val == 0 for val in stats.values()), (i, path, stats.by_site())
            calls += 1
        assert _maxdiff(out, ref_attention(q, k, v, **kw)) <= TOL[dtype] * max(1.0, mag / 8.0), i
    assert calls == 39


def test_huge_scores_count_nothing():
    """Scores past the clean pass's bound on |base| (2^20, `softmax._BASE_CAP`; here |m| ≈ 10^6–10^7): those rows
    take the repairing pass, which finds nothing: no event on either path, and the output is float64
    attention's."""
    q, k, v = rand_qkv(1, 2, 1, 8, 130, 32, seed=21)
    q = q * 4.0e5
    for kw in (dict(causal=True), dict(causal=False)):
        for path in ("kernel", "reference"):
            out, stats, _ = _call(path, q, k, v, **kw)
            assert all(val == 0 for val in stats.values()), (path, kw, stats.by_site())
            assert _maxdiff(out, ref_attention(q, k, v, **kw)) <= TOL[torch.float32], (path, kw)
    s = (q @ k.transpose(-1, -2)).abs().amax() / math.sqrt(q.shape[-1])
    assert float(s) > 2.0**20


def test_exponent_room_bounds_the_rounding():
    """The room step 4 gives the exponents taken from the scores, ``g(L+3)·L·(|base| + |x_min|)`` (natural
    units), bounds the rounding of ``Σ max(S, base + x_min) − L·base`` against a float64 evaluation, and at
    scores of 4096 it is still far below the 1 that an exponent flip moves log2 P by."""
    gen = torch.Generator().manual_seed(5)
    L, s = 4, 16
    for big in (0.0, 100.0, 4096.0):
        S = (torch.randn(512, L * s, generator=gen, dtype=torch.float64) * 8.0 + big).float()
        base = S.amax(-1, keepdim=True)
        exact = (torch.maximum(S.double() - base.double(), torch.tensor(-20.0, dtype=torch.float64))
                 .view(512, L, s).sum(-2))
        approx = torch.maximum(S, base - 20.0).view(512, L, s).sum(-2) - base * L
        room = 1.01 * (L + 3) * 2.0**-24 * L * (base.abs() + 20.0)
        assert bool(((approx.double() - exact).abs() <= room.double()).all()), big
        assert float(room.max()) * LOG2E < 0.02
