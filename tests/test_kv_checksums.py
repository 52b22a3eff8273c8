"""Checksum tables of a KV cache made when tokens enter it (`ft_transformers.kv_checksums`,
``docs/algorithms.md`` "Stored checksum tables"), on the reference path and in the kernel.

* tables extended token by token hold the bits of tables built at once, and their sums agree with
  float64 ones;
* decode reading the stored tables gives the outputs of decode making its own, and eager attention's;
* an ``attn.kv_cache`` flip (a stored entry changed between steps) is, with stored tables, detected and
  corrected in the output wherever it moves the sum a check compares beyond that check's threshold, and
  otherwise leaves the output within the clean tolerance (no escape, SPEC §7); tables made per call absorb it;
* whatever changes a tracked cache behind the tables (crop, reorder, batch change, reset, in-place
  writes, updates under torch.compile) makes calls fall back to their own tables, never stale ones;
* a tracked tiny model generates with 0 events and eager's tokens.

Without CUDA the kernel runs under the Triton interpreter (small shapes).
"""

from __future__ import annotations

import math
import os
import warnings

import pytest
import torch
from float64_attention import ref_attention
from interpreted import interpreted_tests

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from ft_transformers.kernels.options import override  # noqa: E402
from transformers import DynamicCache, EncoderDecoderCache, StaticCache  # noqa: E402

import ft_transformers as ftt  # noqa: E402
from ft_transformers.efta_reference.checksums import g  # noqa: E402
from ft_transformers.efta_reference.stored import ReferenceTables  # noqa: E402
from ft_transformers.injection import FaultPlan, FaultSpec  # noqa: E402
from ft_transformers.kv_checksums import (  # noqa: E402
    KVChecksums,
    flip_kv_cache,
    kv_checksums_of,
    track_kv_cache,
    untrack_kv_cache,
)

try:
    from ft_transformers.kernels import efta as K
except ImportError:  # pragma: no cover - triton missing
    K = None

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SUBPROCESS = K is not None and DEV == "cpu" and not K.interpreting()
_interpreter_available, test_interpreted_in_subprocess = interpreted_tests(__file__, SUBPROCESS, timeout=600)
needs_kernel = pytest.mark.skipif(K is None, reason="triton is not installed")
BACKENDS = ["reference", pytest.param("triton", marks=needs_kernel)]
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _kv(B, Hkv, N, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, Hkv, N, D, generator=g) * 1.5
    v = torch.randn(B, Hkv, N, D, generator=g)
    return k.to(dtype).to(DEV), v.to(dtype).to(DEV)


def _same(out, own, backend):
    """The same bits, but for the GPU's kernel: the autotuner may time another block config for the stored
    form (a different reduction order), so there the outputs agree to a few ulp."""
    if backend == "triton" and DEV == "cuda":
        scale = max(1.0, float(own.float().abs().max()))
        return bool((out.float() - own.float()).abs().max() <= 4 * torch.finfo(out.dtype).eps * scale)
    return torch.equal(out, own)


def _chunks(n0, n1, sizes):
    """(start, count) steps from n0 to n1: ``sizes`` first, then single tokens."""
    n = n0
    for c in sizes:
        if n + c > n1:
            break
        yield n, c
        n += c
    while n < n1:
        yield n, 1
        n += 1


# ------------------------------------------------------------------------------------------------
# tables extended = tables built at once
# ------------------------------------------------------------------------------------------------


def test_reference_tables_extended_equal_built_and_float64():
    B, Hkv, N, D = 2, 2, 150, 24  # D not a multiple of the stride: the zero-padded head dim
    k, v = _kv(B, Hkv, N, D, torch.float32)
    whole = ReferenceTables()
    whole.build(k, v, N)
    part = ReferenceTables()
    part.build(k[:, :, :3], v[:, :, :3], 3)
    for start, count in _chunks(3, N, [1, 7, 60, 1, 64, 2]):
        part.append(k[:, :, :start + count], v[:, :, :start + count], start, count)
    for a, b in zip(whole.view(N), part.view(N)):
        assert torch.equal(a, b)
    # against float64: |fl(Σ) − Σ| ≤ g(L)·Σ|·| per entry
    t = whole.view(N)
    nb, L = t.kc.shape[2], 4
    k64 = torch.nn.functional.pad(k.double(), (0, 0, 0, nb * 64 - N)).view(B, Hkv, nb, L, 16, D)
    w = torch.arange(1, L + 1, dtype=torch.float64).view(L, 1, 1)
    exact = torch.cat([k64.sum(3), (k64 * w).sum(3)], 3)
    bound = 1.01 * L * 2.0**-24 * torch.cat([k64.abs().sum(3), (k64 * w).abs().sum(3)], 3)
    assert ((t.kc.double() - exact).abs() <= bound).all()
    assert torch.allclose(t.kabs.double(), k64.abs().sum(3).amax(-1), rtol=1e-6)
    vpad = torch.nn.functional.pad(v.double(), (0, 32 - D)).view(B, Hkv, N, 2, 16)
    vc = torch.cat([vpad.sum(3), vpad[:, :, :, 0] + 2 * vpad[:, :, :, 1]], -1)
    assert torch.allclose(t.vc[:, :, :N].double(), vc, atol=1e-5) and (t.vc[:, :, N:] == 0).all()


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_kernel_tables_extended_equal_built(dtype):
    """Dynamic (the cache grows) and static (a zero buffer filled in place) caches."""
    B, Hkv, N, D = 1, 2, 150, 32
    k, v = _kv(B, Hkv, N, D, dtype)
    whole = K.CacheTables()
    whole.build(k, v, N)
    dyn = K.CacheTables()
    dyn.build(k[:, :, :5].contiguous(), v[:, :, :5].contiguous(), 5)
    for start, count in _chunks(5, N, [1, 7, 60, 1, 64, 2]):
        dyn.append(k[:, :, :start + count].contiguous(), v[:, :, :start + count].contiguous(), start, count)
    kb, vb = torch.zeros(B, Hkv, 200, D, dtype=dtype, device=DEV), torch.zeros(B, Hkv, 200, D, dtype=dtype, device=DEV)
    kb[:, :, :70], vb[:, :, :70] = k[:, :, :70], v[:, :, :70]
    static = K.CacheTables()
    static.build(kb, vb, 70)
    for start, count in _chunks(70, N, [3, 58]):
        kb[:, :, start:start + count], vb[:, :, start:start + count] = (k[:, :, start:start + count],
                                                                       v[:, :, start:start + count])
        static.append(kb, vb, start, count)
    whole_static = K.CacheTables()
    whole_static.build(kb, vb, N)
    for a, b in zip(whole.tables, dyn.tables):
        assert torch.equal(a, b)
    for a, b in zip(whole_static.tables, static.tables):
        assert torch.equal(a, b)
    # Kc2 (kept in fp32) and Kc1 (its input-dtype slices times their scale) against float64 sums
    t = whole.tables
    nb = 3
    k64 = torch.nn.functional.pad(k.double().cpu(), (0, 0, 0, nb * 64 - N)).view(B * Hkv * nb, 4, 16, D)
    w = torch.arange(1, 5, dtype=torch.float64).view(4, 1, 1)
    kc1 = (t.kc.double().cpu().sum(1) * t.sc[:, 0, None, None].double().cpu())
    assert torch.allclose(kc1, k64.sum(1), rtol=0, atol=2e-5 * float(k64.abs().sum(1).max()))
    assert torch.allclose(t.kc2.double().cpu(), (k64 * w).sum(1), rtol=1e-5, atol=1e-5)
    # a block's V-checksum rows (`checksums.vc_rows`): Vc1's slices, the two ones rows whose product with P
    # is the row sum l and its twin (at every key, padding included), Vc2's slices; each sum of slices
    # times its scale against float64
    parts = {torch.float16: 2, torch.bfloat16: 3, torch.float32: 1}[dtype]
    vc = t.vc.double().cpu()
    assert vc.shape == (B * Hkv * nb, 32 * parts + 2, 64)
    assert (vc[:, 16 * parts:16 * parts + 2] == 1).all()
    v64 = torch.nn.functional.pad(v.double().cpu(), (0, 0, 0, nb * 64 - N)).view(B * Hkv * nb, 64, D // 16, 16)
    wv = torch.arange(1, D // 16 + 1, dtype=torch.float64).view(1, 1, -1, 1)
    for rows, col, exact in ((slice(0, 16 * parts), 1, v64.sum(2)),
                             (slice(16 * parts + 2, None), 2, (v64 * wv).sum(2))):
        sums = vc[:, rows].reshape(-1, parts, 16, 64).sum(1) * t.sc[:, col, None, None].double().cpu()
        assert torch.allclose(sums, exact.transpose(1, 2), rtol=0, atol=2e-5 * float(exact.abs().max())), col


# ------------------------------------------------------------------------------------------------
# decode with stored tables = decode making its own
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_decode_with_stored_tables(backend, dtype):
    """A growing cache across a block boundary (62 → 67 keys), GQA, causal: stored and own tables give the
    same bits and no event, and agree with float64 attention."""
    B, Hq, Hkv, D = 1, 4, 2, 32
    k, v = _kv(B, Hkv, 67, D, dtype)
    q = torch.randn(B, Hq, 5, D).to(dtype).to(DEV)
    kvc = KVChecksums(backend)
    kvc.extend(k[:, :, :62].contiguous(), v[:, :, :62].contiguous(), 0, 62)
    for i, n in enumerate(range(62, 67)):
        kk, vv = k[:, :, :n + 1].contiguous(), v[:, :, :n + 1].contiguous()
        kvc.extend(kk, vv, n, 1)
        qi = q[:, :, i:i + 1]
        out, st = ftt.efta_attention(qi, kk, vv, causal=True, backend=backend, kv_checksums=kvc)
        own, st2 = ftt.efta_attention(qi, kk, vv, causal=True, backend=backend)
        assert _same(out, own, backend) and sum(st.values()) == 0 == sum(st2.values())
        assert (out.double().cpu() - ref_attention(qi, kk, vv, causal=True)).abs().max() < TOL[dtype]
    assert kvc.stored_calls == 5 and kvc.own_calls == 0 and kvc.form == backend


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("opts", [
    dict(causal=True, window=40),
    dict(bias=True),
    dict(mask=True),
    dict(cross=True),
], ids=["window", "bias", "bool-mask", "cross"])
def test_stored_tables_with_every_feature(backend, opts):
    """Sliding window, additive bias, a bool mask, cross-attention (M queries against a cache written once):
    the same bits with stored tables as with own ones."""
    B, Hq, Hkv, N, D, M = 2, 4, 2, 90, 32, 3 if opts.get("cross") else 1
    k, v = _kv(B, Hkv, N, D, torch.float16, seed=1)
    q = torch.randn(B, Hq, M, D).half().to(DEV)
    kw = dict(causal=opts.get("causal", False), window=opts.get("window"))
    if opts.get("bias"):
        kw["bias"] = torch.randn(1, Hq, M, N).to(DEV)
    if opts.get("mask"):
        mask = torch.ones(B, 1, M, N, dtype=torch.bool)
        mask[0, :, :, :7] = False
        kw["attn_mask"] = mask.to(DEV)
    kvc = KVChecksums(backend)
    kvc.extend(k, v, 0, N)
    out, st = ftt.efta_attention(q, k, v, backend=backend, kv_checksums=kvc, **kw)
    own, _ = ftt.efta_attention(q, k, v, backend=backend, **kw)
    assert _same(out, own, backend) and sum(st.values()) == 0 and kvc.stored_calls == 1


def test_pasa_and_unchecked_calls_make_their_own():
    """PASA's tables are its shifted keys' (made per call); checks off need none: the stored ones are not
    read, and the results are those without them."""
    k, v = _kv(1, 2, 70, 32, torch.float16)
    q = torch.randn(1, 4, 1, 32).half().to(DEV)
    kvc = KVChecksums("reference")
    kvc.extend(k, v, 0, 70)
    for kw in (dict(pasa=True), dict(detect=False)):
        a, _ = ftt.efta_attention(q, k, v, backend="reference", kv_checksums=kvc, **kw)
        b, _ = ftt.efta_attention(q, k, v, backend="reference", **kw)
        assert torch.equal(a, b)
    assert kvc.stored_calls == 0


# ------------------------------------------------------------------------------------------------
# attn.kv_cache: a stored entry flipped between steps
# ------------------------------------------------------------------------------------------------


def _flip_case(backend, dtype, bit, seed, stored):
    B, Hq, Hkv, N, D = 1, 4, 2, 70, 32
    k, v = _kv(B, Hkv, N, D, dtype, seed=3)
    q = torch.randn(B, Hq, 1, D, generator=torch.Generator().manual_seed(4)).to(dtype).to(DEV) * 2
    clean = ftt.efta_attention(q, k, v, causal=True, backend=backend)[0]
    kvc = KVChecksums(backend)
    kvc.extend(k, v, 0, N)
    k0, v0 = k.clone(), v.clone()
    plan = FaultPlan(FaultSpec(site="attn.kv_cache", bit=bit, count=1, seed=seed))
    out, stats = ftt.efta_attention(q, k, v, causal=True, backend=backend, inject=plan,
                                    kv_checksums=kvc if stored else None)
    pos = plan.sites["attn.kv_cache"].positions[0].tolist()
    changed = int((k != k0).sum() + (v != v0).sum())
    return clean, out, dict(stats), pos, changed, kvc


NEAR = 2.0  # a flip's change within this factor of a check's threshold may or may not fail it (see below)


def _slack(backend: str) -> float:
    """The factor on the reference's T_s and T_o that the backend's checks use: the kernel's guard for
    tensor-core accumulation on CUDA (`configs.Bounds.gemm_slack`: 2), 1 in the interpreter and on the
    reference path."""
    if backend != "triton":
        return 1.0
    from ft_transformers.kernels.efta.configs import BOUNDS

    return BOUNDS.gemm_slack(K.interpreting())


def _flip_over(q, k, v, kf, vf, pos):
    """One flipped cache entry seen by a decode call (one query per head, every key visible).

    Returns (over, moved). ``over``: per row that reads the entry (the query heads of its kv head), the
    flip's change of the sum its check compares over that check's threshold as the reference path forms it
    from the tables made before the flip (``docs/algorithms.md``, steps 1 and 7), from the clean cache in
    float64. A key's flip changes the score ``scale·q_d·Δk`` against ``T_s = 2·g(D+L)·‖scale·q‖₁·max_d Σ_l
    |K[l·s+r, d]|``; a value's moves output element d by ``p·Δv`` (p: that key's attention weight) against
    ``T_o = 2·g(64 + 2·nb + Lv + 4)·max_n Σ_l |V[n, l·s+r]|``: a value of a key of small weight can stay
    below it. (A flip to ±inf/NaN: inf.) ``moved``: the largest change the flip makes to exact attention's
    output, what it does unprotected (NaN where the entry became non-finite)."""
    b, h, n, c = pos
    _, Hq, M, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    assert M == 1
    G, s, bn = Hq // Hkv, 16, 64
    nb = -(-N // bn)
    qs = q[b, h * G:(h + 1) * G, 0].double().cpu() / math.sqrt(D)  # (G, D), the scale folded in
    k64, v64 = k[b, h].double().cpu(), v[b, h].double().cpu()
    if c < D:  # a key: step 1, group r = n mod s of its block
        delta = float(kf[b, h, n, c]) - float(k[b, h, n, c])
        L = bn // s
        kabs = torch.nn.functional.pad(k64, (0, 0, 0, nb * bn - N)).view(nb, L, s, D).abs().sum(1).amax(-1)
        over = (qs[:, c] * delta).abs() / (2 * g(D + L) * qs.abs().sum(-1) * kabs[n // bn, n % s])
    else:  # a value: step 7, group r = d mod s of the head dim
        d = c - D
        delta = float(vf[b, h, n, d]) - float(v[b, h, n, d])
        Lv = -(-D // s)
        vmax = torch.nn.functional.pad(v64, (0, Lv * s - D)).view(N, Lv, s).abs().sum(1).amax(0)[d % s]
        p = torch.softmax(qs @ k64.T, -1)[:, n]
        over = p * abs(delta) / (2 * g(bn + 2 * nb + Lv + 4) * vmax)
    over = torch.nan_to_num(over, nan=math.inf)
    moved = float((ref_attention(q, kf, vf, causal=True) - ref_attention(q, k, v, causal=True)).abs().max())
    return over, moved


def _assert_flip_guarantee(stats, out, clean, over, backend, dtype, what) -> bool:
    """What the checks on stored tables guarantee for one flipped cache entry; returns whether it was detected.

    * Every row whose checked sum the flip moves by more than NEAR times the backend's threshold is flagged,
      and none where it stays below 1/NEAR of it. Between, the verdict rests on rounding, on the kernel's
      split-key term, and on CUDA on its guard factor (2: `_slack`): there the kernel and the reference
      may differ, and a flip may go unflagged, as the algorithm's "not covered: flips below T_s / T_o" says.
    * Every flagged group is corrected (located by the stored Kc2 / Vc2 and rebuilt from the stored
      checksum; a recompute would read the same flipped entry): the output is the clean one.
    * A flip nothing flagged leaves the output within the clean tolerance (no escape, SPEC §7): it moved
      the checked sum by at most about the threshold, ~1e-4 of an fp16 output here.
    """
    f = _slack(backend)
    c = dict(stats)
    lo, hi = int((over > NEAR * f).sum()), int((over > f / NEAR).sum())
    diff = float((out.double().cpu() - clean.double().cpu()).abs().max())
    info = (what, backend, c, [f"{x:.3g}" for x in over.tolist()], f"{diff:.3g}")
    assert lo <= c["detected"] <= hi, info
    if c["detected"]:
        assert c["corrected"] == c["detected"] and c["uncorrectable"] == 0 and diff <= 4 * TOL[dtype], info
    else:
        assert diff <= TOL[dtype], info  # an escape fails here
    return c["detected"] > 0


def _flip_campaign(shape, dtype, bit, seeds, *, kv_seed, q_seed, q_mul=1.0, backends=("triton", "reference")):
    """One flip of ``bit`` per seed in a decode call's cache on stored tables, on each backend
    (`_assert_flip_guarantee`); where no row reading the entry lies near either backend's threshold, the
    kernel's counts are the reference's. Returns ({backend: flips detected}, flips that move exact attention's
    output beyond the clean tolerance)."""
    B, Hq, Hkv, N, D = shape
    k, v = _kv(B, Hkv, N, D, dtype, seed=kv_seed)
    q = (torch.randn(B, Hq, 1, D, generator=torch.Generator().manual_seed(q_seed)) * q_mul).to(dtype).to(DEV)
    clean = {b: ftt.efta_attention(q, k, v, causal=True, backend=b)[0] for b in backends}
    fs = [_slack(b) for b in backends]
    detected, harmful = dict.fromkeys(backends, 0), 0
    for seed in seeds:
        counts = {}
        for backend in backends:
            kf, vf = k.clone(), v.clone()
            kvc = KVChecksums(backend)
            kvc.extend(kf, vf, 0, N)
            plan = FaultPlan(FaultSpec(site="attn.kv_cache", bit=bit, count=1, seed=seed))
            out, st = ftt.efta_attention(q, kf, vf, causal=True, backend=backend, inject=plan, kv_checksums=kvc)
            pos = plan.sites["attn.kv_cache"].positions[0].tolist()
            assert kvc.stored_calls == 1 and int((kf != k).sum() + (vf != v).sum()) == 1, (seed, backend)
            over, moved = _flip_over(q, k, v, kf, vf, pos)
            what = (seed, "k" if pos[3] < D else "v", pos, f"moved {moved:.3g}")
            detected[backend] += _assert_flip_guarantee(st, out, clean[backend], over, backend, dtype, what)
            counts[backend] = dict(st)
        if not ((over >= min(fs) / NEAR) & (over <= max(fs) * NEAR)).any():
            assert all(c == counts[backends[0]] for c in counts.values()), (seed, counts)
        harmful += not moved <= TOL[dtype]
    return detected, harmful


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,bits", [(torch.float16, (13, 12)), (torch.bfloat16, (13, 9)),
                                        (torch.float32, (29, 26))])
def test_kv_cache_flip_detected_and_corrected(backend, dtype, bits):
    """Exponent flips of a stored key and a stored value (finite results) that move their check's sum well
    beyond its threshold: with stored tables each is detected and corrected (step 1 for a key, step 7 for
    a value) and the output is the clean one; the flip stays in the cache (one element changed). Every
    flip met on the way keeps the guarantee (`_assert_flip_guarantee`)."""
    seen = set()
    for seed in range(40):
        bit = bits[len(seen) % 2]
        clean, out, c, pos, changed, kvc = _flip_case(backend, dtype, bit, seed, stored=True)
        assert changed == 1 and kvc.stored_calls == 1
        over = _flip_case_over(dtype, bit, seed)
        half = "k" if pos[3] < 32 else "v"
        found = _assert_flip_guarantee(c, out, clean, over, backend, dtype, (seed, half, pos))
        if half in seen or not bool((over > NEAR * _slack(backend)).any()):
            continue
        assert found
        seen.add(half)
        if len(seen) == 2:
            return
    pytest.fail(f"no key and value flip beyond the thresholds among the seeds: {seen}")


def _flip_case_over(dtype, bit, seed):
    """`_flip_over` of `_flip_case`'s flip (the same plan applied to a copy of its cache)."""
    k, v = _kv(1, 2, 70, 32, dtype, seed=3)
    q = torch.randn(1, 4, 1, 32, generator=torch.Generator().manual_seed(4)).to(dtype).to(DEV) * 2
    kf, vf = k.clone(), v.clone()
    plan = FaultPlan(FaultSpec(site="attn.kv_cache", bit=bit, count=1, seed=seed))
    flip_kv_cache(plan, kf, vf, None)
    return _flip_over(q, k, v, kf, vf, plan.sites["attn.kv_cache"].positions[0].tolist())[0]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_kv_cache_entry_turned_nonfinite_is_corrected(backend, dtype):
    """A flip of the top exponent bit of a stored key or value in [1, 2) makes it ±inf or NaN after its
    tables were made: every score or output it meets is non-finite, so D2/D1 is undefined. Each failing
    group's only non-finite member is located and rebuilt from the stored checksum (`checksums.locate`,
    `common._locate`): the output is the clean one, not a recomputation from the same entry."""
    top = 30 if dtype == torch.float32 else 14
    seen = set()
    k, v = _kv(1, 2, 70, 32, dtype, seed=3)
    for seed in range(80):
        # the seed's flip on a copy of the cache first (the plan places it alike), the calls only for a case
        plan = FaultPlan(FaultSpec(site="attn.kv_cache", bit=top, count=1, seed=seed))
        kf, vf = k.clone(), v.clone()
        flip_kv_cache(plan, kf, vf, None)
        pos = plan.sites["attn.kv_cache"].positions[0].tolist()
        half = "k" if pos[3] < 32 else "v"
        entry = (k if half == "k" else v)[pos[0], pos[1], pos[2], pos[3] % 32].float()
        changed = int((kf != k).sum() + (vf != v).sum())
        if changed != 1 or half in seen or not 1.0 <= entry.abs() < 2.0:  # a finite result: not this case
            continue
        clean, out, c, pos_call, changed_call, kvc = _flip_case(backend, dtype, top, seed, stored=True)
        assert (pos_call, changed_call) == (pos, 1), (pos_call, pos, changed_call)
        seen.add(half)
        assert kvc.stored_calls == 1 and c["nonfinite_input"] == 0, (half, c)
        assert c["detected"] >= 1 and c["corrected"] == c["detected"], (half, c)
        assert torch.isfinite(out).all() and (out.double() - clean.double()).abs().max() <= 4 * TOL[dtype], (half, c)
        if len(seen) == 2:
            return
    pytest.fail(f"no key and value entry in [1, 2) among the flipped ones: {seen}")


def test_location_survives_a_huge_member():
    """A member made huge but finite by a flip (−2.5e38): D1 stays finite, but (l+1)·S overflows, so D2
    taken unscaled loses the location; taken as D2/L (`scaled_d2`) it is located and rebuilt."""
    from ft_transformers.efta_reference.checksums import group_sums, locate, rebuild, scaled_d2

    L, s = 4, 16
    x = torch.randn(3, L * s, generator=torch.Generator().manual_seed(1))
    c1, c2 = group_sums(x, L, s)
    bad_x = x.clone()
    bad_x[1, 3 * s + 5] = -2.5e38  # member l = 3 of residue 5 in row 1
    d1 = c1 - group_sums(bad_x, L, s)[0]
    bad = ~(d1.abs() <= 1e-3)
    assert int(bad.sum()) == 1 and torch.isfinite(d1).all()
    members = bad_x.view(3, L, s)
    assert not locate(d1, c2 - group_sums(bad_x, L, s)[1], bad, L, members)[1].any()  # D2 overflowed
    loc, ok = locate(d1, scaled_d2(c2, bad_x, L, s), bad, L, members)
    assert ok.nonzero().tolist() == [[1, 5]] and int(loc[1, 5]) == 3
    new = rebuild(members, ok.nonzero(), loc[ok], c1[ok])
    assert abs(float(new[0]) - float(x[1, 3 * s + 5])) < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_kv_cache_flip_escapes_tables_made_per_call(backend):
    """The same flip with tables made per call: they sum the flipped entry, no check sees it, and the output
    moves (what stored tables close)."""
    moved = 0.0
    for seed in range(6):
        clean, out, c, pos, changed, _ = _flip_case(backend, torch.float16, 13, seed, stored=False)
        assert changed == 1 and c["detected"] == 0
        moved = max(moved, float((out.double() - clean.double()).abs().max()))
    assert moved > 4 * TOL[torch.float16]


def test_kv_cache_flip_campaign():
    """`test_gpu_kv_cache_flips`'s campaign at a small shape, with a sharper query: of 16 exponent flips, 13
    move their check's sum more than twice the threshold (detected and corrected, 6 of them beyond the
    clean tolerance unprotected), seeds 4 and 8 (values of small weight) stay below half of it (undetected;
    the output moves by at most 1e-5 exact: not an escape), seed 0 lies near it (one row at 1.07 × T_o,
    detected by both paths).

    At the GPU test's inputs (1, 8, 4, 700, 128) under the interpreter (about a minute, so not here): both
    paths detected and corrected 15 of the 16 flips, with the same counts; seed 0 went undetected on both,
    the output 6.1e-5 from the clean one."""
    backends = ("triton", "reference") if K is not None else ("reference",)
    detected, harmful = _flip_campaign((1, 4, 2, 200, 32), torch.float16, 13, range(16), kv_seed=3, q_seed=4,
                                       q_mul=2.0, backends=backends)
    assert all(n >= 12 for n in detected.values()) and harmful >= 4, (detected, harmful)


def test_kv_cache_site_contract():
    """The site's shape, bits and validation."""
    from ft_transformers.kernels.contract import CACHE_SITES, site_dtype, site_shape

    assert CACHE_SITES == ("attn.kv_cache",)
    assert site_shape("attn.kv_cache", 2, 8, 1, 100, 64, 2, Hkv=4) == (2, 4, 100, 128)
    assert site_dtype("attn.kv_cache", torch.bfloat16) == torch.bfloat16
    with pytest.raises(ValueError):
        site_shape("attn.kv_cache", 2, 8, 1, 100, 64, 2)
    with pytest.raises(ValueError, match="out of range"):
        FaultPlan(FaultSpec(site="attn.kv_cache", bit=20)).for_site("attn.kv_cache", (1, 1, 4, 4), torch.float16,
                                                                    "cpu")
    q = torch.randn(1, 2, 1, 16)
    with pytest.raises(ValueError, match="efta_attention has no fault site"):
        ftt.efta_attention(q, q, q, inject=FaultSpec(site="linear.output", bit=3))


# ------------------------------------------------------------------------------------------------
# transformers caches: tracking, invalidation, generation
# ------------------------------------------------------------------------------------------------


def _cfg():
    from tiny_models import llama_config

    return llama_config()


def _step(cache, layer, n, B=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, 2, n, 32, generator=g)
    return cache.update(k, torch.randn(B, 2, n, 32, generator=g), layer)


def _same_as_own(keys, values, kvc_used: bool):
    """One call over the cache the update returned: stored tables read (or not, as expected), the output
    that own tables give."""
    q = torch.randn(keys.shape[0], 4, 1, 32)
    kvc = kv_checksums_of(keys)
    before = kvc.stored_calls
    a, st = ftt.efta_attention(q, keys, values, causal=True, backend="reference", kv_checksums=kvc)
    b, _ = ftt.efta_attention(q, keys, values, causal=True, backend="reference")
    assert torch.equal(a, b) and sum(st.values()) == 0
    assert (kvc.stored_calls > before) == kvc_used


def test_dynamic_cache_rebuilds_after_crop_reorder_batch_and_writes():
    cache = track_kv_cache(DynamicCache(config=_cfg()), backend="reference")
    keys, values = _step(cache, 0, 70)
    kvc = kv_checksums_of(keys)
    assert kvc.valid and kvc.n == 70
    _same_as_own(*_step(cache, 0, 1, seed=1), kvc_used=True)
    cache.crop(-5)  # the layer's keys are a shorter view now: a call over them makes its own tables
    layer = cache.layers[0]
    assert not kvc.current(layer.keys, layer.values)
    keys, values = _step(cache, 0, 1, seed=2)  # rebuilt from the cache (nothing past the written tokens)
    assert kvc.valid and kvc.n == 67 and kv_checksums_of(keys) is kvc
    _same_as_own(keys, values, kvc_used=True)
    cache.reorder_cache(torch.tensor([0]))
    _same_as_own(*_step(cache, 0, 1, seed=3), kvc_used=True)
    cache.batch_repeat_interleave(2)
    keys, values = _step(cache, 0, 1, B=2, seed=4)
    assert kvc.valid and keys.shape[0] == 2
    _same_as_own(keys, values, kvc_used=True)
    keys.add_(1e-3)  # written behind the cache's back: the tables no longer describe it
    _same_as_own(keys, values, kvc_used=False)
    _same_as_own(*_step(cache, 0, 1, B=2, seed=5), kvc_used=True)  # the next update rebuilds


def test_static_cache_crop_waits_for_reset():
    cache = track_kv_cache(StaticCache(config=_cfg(), max_cache_len=80), backend="reference")
    keys, values = _step(cache, 0, 10)
    kvc = kv_checksums_of(keys)
    assert kvc.valid and keys.shape[2] == 80
    _same_as_own(*_step(cache, 0, 1, seed=1), kvc_used=True)
    if not hasattr(cache.layers[0], "crop"):  # (transformers releases without static crop)
        return
    cache.crop(-3)  # the slots past the cut keep stale tokens: the tables cannot follow
    _same_as_own(*_step(cache, 0, 1, seed=2), kvc_used=False)
    cache.reset()
    keys, values = _step(cache, 0, 12, seed=3)
    assert kvc.valid and kvc.n == 12
    _same_as_own(keys, values, kvc_used=True)
    keys.mul_(2.0)  # an in-place write by other code
    _same_as_own(keys, values, kvc_used=False)


def test_static_layer_first_seen_filled_and_compiled_updates():
    """A static layer filled before tracking, and updates under torch.compile: never read, until reset."""
    cache = StaticCache(config=_cfg(), max_cache_len=40)
    _step(cache, 0, 5)
    track_kv_cache(cache, backend="reference")
    keys, values = _step(cache, 0, 1, seed=1)
    assert not kv_checksums_of(keys).valid
    _same_as_own(keys, values, kvc_used=False)
    cache.reset()
    keys, values = _step(cache, 0, 3, seed=2)
    kvc = kv_checksums_of(keys)
    assert kvc.valid

    @torch.compile(backend="eager")
    def compiled_update(x):
        return cache.update(x, x, 0)[0].sum()

    compiled_update(torch.randn(1, 2, 1, 32))
    _same_as_own(keys, values, kvc_used=False)  # (the call would read what the compiled update wrote)
    _same_as_own(*_step(cache, 0, 1, seed=3), kvc_used=False)  # a static layer waits for reset
    untrack_kv_cache(cache)
    assert "update" not in vars(cache) and "crop" not in vars(cache.layers[0])


def test_encoder_decoder_cache_both_halves():
    cache = track_kv_cache(EncoderDecoderCache(DynamicCache(config=_cfg()), DynamicCache(config=_cfg())),
                           backend="reference")
    keys, values = cache.cross_attention_cache.update(torch.randn(1, 2, 9, 32), torch.randn(1, 2, 9, 32), 0)
    for _ in range(2):  # every step reads the cross-attention tables made once
        _same_as_own(keys, values, kvc_used=True)
    assert kv_checksums_of(_step(cache.self_attention_cache, 0, 4)[0]).valid


def _generate(model, ids, cache, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        with torch.no_grad():
            return model.generate(input_ids=ids, max_new_tokens=6, do_sample=False, pad_token_id=0,
                                  past_key_values=cache, output_logits=True, return_dict_in_generate=True, **kw)


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_tracked_generate_clean_and_under_a_cache_flip(kind):
    """A tiny Llama (GQA) with a tracked cache: clean generation has 0 events, eager's tokens, and reads the
    stored tables at every call over the whole cache; a stored entry flipped at the fourth step is detected
    and corrected at that step and every later one (the flip stays in the cache), and the tokens do not
    change; with tables made per call nothing sees it."""
    from tiny_models import make_model

    ids = torch.randint(3, 500, (2, 66), generator=torch.Generator().manual_seed(0))
    eager = _generate(make_model("llama", attn="eager"), ids, None)
    model = ftt.enable_fault_tolerance(make_model("llama", attn="efta"), ftt.FTConfig(linear=False))

    def cache():
        c = DynamicCache(config=model.config) if kind == "dynamic" else StaticCache(config=model.config,
                                                                                    max_cache_len=80)
        return track_kv_cache(c, backend="reference")

    c = cache()
    out = _generate(model, ids, c)
    assert not ftt.fault_report(model).events
    assert torch.equal(out.sequences, eager.sequences)
    assert (torch.stack(out.logits) - torch.stack(eager.logits)).abs().max() < 1e-4
    # (a static cache's first prefill reads its first M keys, a slice of the buffer: that call makes its own)
    calls = 6 if kind == "dynamic" else 5
    assert all(layer._ftt_kv.stored_calls == calls and layer._ftt_kv.own_calls == 0 for layer in c.layers)
    spec = FaultSpec(site="attn.kv_cache", bit=29, count=1, layers=[0], calls=[3], seed=2)
    with ftt.inject_faults(model, spec) as log:
        out = _generate(model, ids, cache())
    ev = ftt.fault_report(model).events
    assert log.injected == 1 and torch.equal(out.sequences, eager.sequences)
    steps = sorted({e.step for e in ev})  # the step of the flip (the run's fourth) and the two after it
    assert steps == list(range(steps[0], steps[0] + 3)) and {e.kind for e in ev} == {"detected", "corrected"}
    with override(kv_tables=False):  # protection that leaves generate's cache untracked: tables per call
        ftt.enable_fault_tolerance(model, ftt.FTConfig(linear=False))
    with ftt.inject_faults(model, spec):  # the same flip with tables made per call: nothing sees it
        _generate(model, ids, None)
    assert not ftt.fault_report(model).events


def test_protection_tracks_generate_caches_where_on():
    """`enable_fault_tolerance` registers the cache-tracking pre-hook (`Options.kv_tables`; auto: models on
    the CPU or CUDA): generate's own cache keeps stored tables that every decode step reads, the tokens are
    eager's, a stored entry flipped between steps is corrected; switched off, or with the checks off,
    the cache stays untracked; disabling protection removes the hook."""
    from tiny_models import make_model

    ids = torch.randint(3, 500, (1, 12), generator=torch.Generator().manual_seed(5))
    eager = _generate(make_model("llama", attn="eager"), ids, None)
    model = ftt.enable_fault_tolerance(make_model("llama", attn="efta"), ftt.FTConfig(linear=False))
    out = _generate(model, ids, None)
    assert torch.equal(out.sequences, eager.sequences) and not ftt.fault_report(model).events
    assert all(layer._ftt_kv.stored_calls == 6 and layer._ftt_kv.own_calls == 0  # prefill + 5 steps
               for layer in out.past_key_values.layers)
    spec = FaultSpec(site="attn.kv_cache", bit=29, count=1, layers=[1], calls=[2], seed=4)
    with ftt.inject_faults(model, spec) as log:
        out = _generate(model, ids, None)
    kinds = {e.kind for e in ftt.fault_report(model).events}
    assert log.injected == 1 and kinds == {"detected", "corrected"}
    assert torch.equal(out.sequences, eager.sequences)
    for changes, config in (({"kv_tables": False}, ftt.FTConfig(linear=False)),
                            ({}, ftt.FTConfig(linear=False, detect=False, correct=False))):
        with override(**changes):
            ftt.enable_fault_tolerance(model, config)
        out = _generate(model, ids, None)
        assert not any(hasattr(layer, "_ftt_kv") for layer in out.past_key_values.layers)
    with override(kv_tables=True):
        ftt.enable_fault_tolerance(model, ftt.FTConfig(linear=False))
    ftt.disable_fault_tolerance(model)
    out = _generate(model, ids, None)
    assert not any(hasattr(layer, "_ftt_kv") for layer in out.past_key_values.layers)


def test_kv_tables_auto_rule():
    """`Options.kv_tables` auto keeps tables for models on the CPU or CUDA devices, not elsewhere (a meta
    model stands for another device type); the switch forces either way."""
    from ft_transformers.protect import _kv_tables

    cpu, meta = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2, device="meta")
    with override(kv_tables=None):
        assert _kv_tables(cpu) and not _kv_tables(meta)
        if torch.cuda.is_available():
            assert _kv_tables(cpu.cuda())
    with override(kv_tables=False):
        assert not _kv_tables(torch.nn.Linear(2, 2))
    with override(kv_tables=True):
        assert _kv_tables(meta)


def test_forward_pre_hook_tracks_generate_cache():
    """`track_forward_cache` as a model's forward pre-hook: the cache generate makes is tracked, and every
    decode step reads its stored tables."""
    from tiny_models import make_model

    from ft_transformers.kv_checksums import track_forward_cache

    model = make_model("gpt2", attn="efta")
    handle = model.register_forward_pre_hook(track_forward_cache, with_kwargs=True)
    ids = torch.randint(3, 500, (1, 9), generator=torch.Generator().manual_seed(2))
    out = _generate(model, ids, None)
    handle.remove()
    cache = out.past_key_values
    cache = getattr(cache, "self_attention_cache", cache)
    assert all(layer._ftt_kv.stored_calls == 6 and layer._ftt_kv.valid for layer in cache.layers)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_static_cache_prefill_is_top_left(family):
    """A static cache's first prefill without padding comes with no mask and more keys than queries (the
    unwritten slots): causal attention then aligns top-left, as SDPA's is_causal does."""
    from tiny_models import make_model

    ids = torch.randint(3, 500, (1, 7), generator=torch.Generator().manual_seed(1))
    a = _generate(make_model(family, attn="eager"), ids, None, cache_implementation="static")
    b = _generate(make_model(family, attn="efta"), ids, None, cache_implementation="static")
    assert (torch.stack(a.logits) - torch.stack(b.logits)).abs().max() < 1e-4


# ------------------------------------------------------------------------------------------------
# GPU: real shapes (skipped without CUDA)
# ------------------------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("shape,pad", [((16, 32, 8, 4096, 128), False), ((2, 14, 2, 1000, 64), True),
                                       ((1, 14, 2, 300, 64), False)], ids=["decode4k", "pad1k", "short"])
def test_gpu_decode_on_stored_tables(shape, pad, dtype):
    """Tables extended over the last 70 tokens one at a time (a block boundary crossed), split-key decode
    on them: fp32 attention's outputs, no event, and the per-call tables' outputs."""
    B, Hq, Hkv, N, D = shape
    k, v = _kv(B, Hkv, N, D, dtype, seed=5)
    kvc = KVChecksums("triton")
    kvc.extend(k[:, :, :N - 70].contiguous(), v[:, :, :N - 70].contiguous(), 0, N - 70)
    for n in range(N - 70, N):
        kk, vv = k[:, :, :n + 1].contiguous(), v[:, :, :n + 1].contiguous()
        kvc.extend(kk, vv, n, 1)
    q = torch.randn(B, Hq, 1, D, device="cuda").to(dtype)
    kw = dict(causal=True)
    add = torch.zeros(B, 1, 1, N, device="cuda")
    if pad:
        keep = torch.ones(B, 1, 1, N, dtype=torch.bool, device="cuda")
        keep[1, :, :, :N // 3] = False
        kw["attn_mask"] = keep
        add = add.masked_fill(~keep, -float("inf"))
    G = Hq // Hkv
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float(), kk.float().repeat_interleave(G, 1), vv.float().repeat_interleave(G, 1), attn_mask=add)
    out, st = ftt.efta_attention(q, kk, vv, backend="triton", kv_checksums=kvc, **kw)
    own, _ = ftt.efta_attention(q, kk, vv, backend="triton", **kw)
    assert (out.float() - ref).abs().max() <= TOL[dtype] and sum(st.values()) == 0
    assert _same(out, own, "triton") and kvc.stored_calls == 1


@pytest.mark.gpu
@gpu
def test_gpu_kv_cache_flips():
    """Exponent flips (bit 13, ×/÷ 256) of stored entries at a real shape, on stored tables, kernel and
    reference (`_flip_campaign`): every flip that moves its check's sum beyond the threshold is detected
    and corrected, none escapes, and the kernel's counts are the reference's away from the thresholds.
    The inputs are drawn on the CPU, so the flips are the ones the interpreter ran (see
    `test_kv_cache_flip_campaign`): seed 0, a value 0.26 → 0.001 of weights 1.0e-4 and 1.6e-4 (0.18 and
    0.28 of T_o), stays below both thresholds, undetected and harmless; seeds 4, 8 and 14, values of
    weights 1.8e-4 to 1.4e-3 (1.0 to 3.8 of T_o), lie near the kernel's threshold on CUDA (twice the
    reference's): either verdict passes there. The kernel detects at least 12 of the 16, the reference 14;
    5 flips would move the output beyond the clean tolerance unprotected. The interpreter with the
    kernel's thresholds doubled as on CUDA: the kernel missed seed 14 as well (0.51 of its threshold, the
    output 1.5e-4 off) and flagged one row fewer than the reference at seeds 6, 8 and 9. (Before, the query
    came from the CUDA generator and every flip had to be detected: an H100 run failed at a value flip of
    small weight, seed 7 of its draw.)"""
    detected, harmful = _flip_campaign((1, 8, 4, 700, 128), torch.float16, 13, range(16), kv_seed=9, q_seed=0)
    assert all(n >= 12 for n in detected.values()) and harmful >= 4, (detected, harmful)


@pytest.mark.gpu
@gpu
def test_gpu_tracked_generate():
    """A tiny Qwen2 (a sliding-window layer and a full one) in fp16 on the GPU with a tracked cache: 0
    events, SDPA's tokens, the full layer's calls on stored tables."""
    from tiny_models import make_model

    ids = torch.randint(3, 500, (2, 90), generator=torch.Generator().manual_seed(3)).cuda()
    sdpa = _generate(make_model("qwen2", attn="sdpa", dtype=torch.float16).cuda(), ids, None)
    model = ftt.enable_fault_tolerance(make_model("qwen2", attn="efta", dtype=torch.float16).cuda(),
                                       ftt.FTConfig(linear=False))
    cache = track_kv_cache(DynamicCache(config=model.config))
    out = _generate(model, ids, cache)
    assert not ftt.fault_report(model).events
    assert torch.equal(out.sequences, sdpa.sequences)
    assert any(vars(layer).get("_ftt_kv") is not None and layer._ftt_kv.stored_calls == 6 for layer in cache.layers)


def test_backend_agreement_script(tmp_path):
    """`scripts/efta_backend_agreement.py` runs the same flips through the kernel and the reference path: two
    high exponent flips of a stored bf16 entry are detected by both, and the JSON holds both verdicts."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "efta_backend_agreement.py"
    out = tmp_path / "agree.json"
    res = subprocess.run([sys.executable, str(script), "--shape", "1,2,1,16,64,16", "--bits", "13-14", "--n", "2",
                          "--json", str(out)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TRITON_INTERPRET": "1"})
    assert res.returncode == 0, res.stderr[-2000:]
    assert "detected: reference 2, kernel 2 of 2; same verdict in 2" in res.stdout, res.stdout
    trials = json.loads(out.read_text())["trials"]
    assert len(trials) == 2 and all(13 <= t["bit"] <= 14 for t in trials)
    assert all(t[be]["where"] for t in trials for be in ("reference", "triton"))  # the flip landed in k or v
