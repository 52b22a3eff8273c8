"""Sibling checked GEMMs in one launch (``checked_gemm_siblings``, ``ft_transformers.siblings``).

Oracles: float64 ``torch.matmul`` of each weight for the values; the same weights' own checked calls
(`checked_gemm`, the decode kernel) for bit equality and for the counts; a model protected with
``Options.siblings`` off (one checked call per layer) for the generated tokens and the events.

Without CUDA the kernel runs under the Triton interpreter (``TRITON_INTERPRET=1``), and the model
tests switch the sibling path on for CPU (``siblings._ON_CPU``); ``gpu``-marked tests use the real
Qwen2-0.5B widths.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os

import pytest
import torch
from interpreted import interpreted_tests

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from ft_transformers.kernels import abft_gemm as G  # noqa: E402
from ft_transformers.kernels.abft_gemm import calls, forms  # noqa: E402
from ft_transformers.kernels.gemm_checksums import GROUP_COLS  # noqa: E402
from ft_transformers.kernels.options import override  # noqa: E402
from tiny_models import VOCAB, make_model  # noqa: E402

import ft_transformers as ftt  # noqa: E402
from ft_transformers.counters import FaultStats, new_counters  # noqa: E402
from ft_transformers.vabft import WeightChecksums, gemm_emax  # noqa: E402

S = importlib.import_module("ft_transformers.siblings")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
SUBPROCESS = DEV == "cpu" and not G.interpreting()
DTYPES16 = [torch.float16, torch.bfloat16]
ULP = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}
ZERO = {"detected": 0, "corrected": 0, "recomputed": 0, "uncorrectable": 0, "nonfinite_input": 0}

_interpreter_available, test_interpreted_in_subprocess = interpreted_tests(__file__, SUBPROCESS, timeout=900)

# the kernel's entries with the library's e_max tables, as the library passes them
checked_gemm = functools.partial(G.checked_gemm, emax_table=gemm_emax)
checked_gemm_siblings = functools.partial(G.checked_gemm_siblings, emax_table=gemm_emax)


@pytest.fixture
def setopt():
    """``setopt(**fields)``: `Options` fields changed (`override`) until the test ends."""
    with contextlib.ExitStack() as stack:
        yield lambda **changes: stack.enter_context(override(**changes))


def _operands(m, ns, k, dtype, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn((m, k), generator=g) * 2.0).to(dtype).to(DEV)
    ws = [(torch.randn((n, k), generator=g) * k**-0.5).to(dtype).to(DEV) for n in ns]
    bs = [torch.randn((n,), generator=g).to(dtype).to(DEV) if bias else None for n in ns]
    return x, ws, bs


def _ref64(x, ws, bs):
    return torch.cat([x.double().cpu() @ w.double().cpu().t() + (b.double().cpu() if b is not None else 0.0)
                      for w, b in zip(ws, bs)], dim=1)


def _siblings(x, ws, bs, **kw):
    wcs = [WeightChecksums.compute(w, b) for w, b in zip(ws, bs)]
    cnt = [new_counters(x.device) for _ in ws]
    with torch.no_grad():
        y = checked_gemm_siblings(x, ws, bs, wcs, cnt, **kw)
    return y, [dict(FaultStats(c)) for c in cnt], wcs


@pytest.mark.parametrize("dtype", DTYPES16, ids=str)
@pytest.mark.parametrize("m,ns,k,bias,split", [
    (1, (128, 64, 64), 96, True, "1"),  # Q/K/V-like: 4 + 1 + 1 tiles, with bias
    (3, (64, 72), 70, False, "1"),  # two weights, the last ragged (64 + 8 rows), K not a block multiple
    (16, (192, 64, 40), 160, True, "2"),  # 16 rows, split-K in 2, ragged last
], ids=["qkv", "ragged", "split-k"])
def test_siblings_match_float64_and_their_own_calls(dtype, m, ns, k, bias, split, monkeypatch, setopt):
    """One launch for 2-3 weights: y matches float64, nothing is counted on clean inputs, and every
    weight's columns equal its own decode-kernel call bit for bit (same blocks and splits)."""
    setopt(gemm_split=int(split))
    monkeypatch.setattr(forms, "GROUPED_MAX_ROWS", 16)  # the single calls take the decode kernel too
    x, ws, bs = _operands(m, ns, k, dtype, bias)
    assert G.siblings_supported(x, ws, bs)
    _siblings(x, ws, bs)  # on a GPU the first call of a shape also times the configs
    launches = []
    real = calls._GROUPED_LAUNCH
    monkeypatch.setattr(calls, "_GROUPED_LAUNCH", lambda *a: (launches.append(a), real(*a))[1])
    y, stats, _ = _siblings(x, ws, bs)  # (fresh checksums: no prepared launch)
    assert len(launches) == 1 and stats == [ZERO] * len(ns)
    assert y.shape == (m, sum(ns)) and y.dtype == dtype
    ref = _ref64(x, ws, bs)
    tol = (4 * ULP[dtype] + 4 * k**0.5 * 2.0**-24) * float(ref.abs().max())
    assert float((y.double().cpu() - ref).abs().max()) <= tol
    if G.interpreting():  # one config for both (a GPU tunes the single calls)
        col = 0
        for w, b in zip(ws, bs):
            cnt = new_counters(x.device)
            with torch.no_grad():
                y1 = checked_gemm(x, w, b, counters=cnt)
            assert torch.equal(y[:, col:col + w.shape[0]], y1)
            col += w.shape[0]
    # a second call takes the prepared launch: the same result
    y2, stats2, _ = _siblings(x, ws, bs)
    assert torch.equal(y2, y) and stats2 == [ZERO] * len(ns)


@pytest.mark.parametrize("correct", [True, False])
def test_siblings_count_each_weights_events_in_its_counters(correct):
    """A wrong checksum in one group of the middle weight (its ``b1`` off by 100, as a corrupted
    checksum would be) fails that group's rows only: every row is counted in the middle weight's
    counters (``recomputed``, or ``uncorrectable`` without correction), the others count nothing, and
    with correction y still matches float64 (the rows recomputed)."""
    m, ns, k = 3, (128, 128, 64), 96
    x, ws, bs = _operands(m, ns, k, torch.float16, True, seed=1)
    wcs = [WeightChecksums.compute(w, b) for w, b in zip(ws, bs)]
    w1g, consts = calls._group_sums(wcs[1], ws[1], bs[1], False)
    consts[1, 0] += 100.0  # group 1 of weight 1: y's columns 192-255
    cnt = [new_counters(x.device) for _ in ns]
    with torch.no_grad():
        y = checked_gemm_siblings(x, ws, bs, wcs, cnt, correct=correct)
    stats = [dict(FaultStats(c)) for c in cnt]
    bad = dict(ZERO, detected=m, recomputed=m) if correct else dict(ZERO, detected=m, uncorrectable=m)
    assert stats == [ZERO, bad, ZERO]
    ref = _ref64(x, ws, bs)
    tol = (4 * ULP[torch.float16] + 4 * k**0.5 * 2.0**-24) * float(ref.abs().max())
    assert float((y.double().cpu() - ref).abs().max()) <= tol


def test_siblings_nonfinite_input_counted_once_per_weight():
    """A NaN in x switches the checks off for the call and counts one ``nonfinite_input`` in each
    weight's counters, as each weight's own call would; the NaN reaches y."""
    x, ws, bs = _operands(1, (64, 128), 64, torch.bfloat16, False, seed=2)
    x[0, 5] = float("nan")
    y, stats, _ = _siblings(x, ws, bs)
    assert stats == [dict(ZERO, nonfinite_input=1)] * 2
    assert torch.isnan(y).all()


def test_siblings_supported_refuses_what_the_kernel_cannot_take():
    x, ws, bs = _operands(2, (64, 64), 32, torch.float16, True)
    assert G.siblings_supported(x, ws, bs)
    assert not G.siblings_supported(x, ws[:1], bs[:1])  # one weight: its own call
    assert not G.siblings_supported(x, ws * 2, bs * 2)  # four weights
    assert not G.siblings_supported(x.float(), [w.float() for w in ws], [b.float() for b in bs])
    assert not G.siblings_supported(x, ws, [bs[0], None])  # bias on some only
    x17 = torch.zeros((17, 32), dtype=torch.float16, device=DEV)
    assert not G.siblings_supported(x17, ws, bs)  # more rows than the kernel's block
    w72 = torch.zeros((72, 32), dtype=torch.float16, device=DEV)
    assert not G.siblings_supported(x, [w72, ws[1]], [None, None])  # a ragged weight before the last
    assert G.siblings_supported(x, [ws[0], w72], [None, None])  # ragged last: fine
    assert not G.siblings_supported(x, [ws[0], w72.t().contiguous().t()[:, :32]], [None, None])
    with pytest.raises(G.AbftGemmUnsupported):
        checked_gemm_siblings(x, ws[:1], bs[:1], [WeightChecksums.compute(ws[0], bs[0])], [new_counters(DEV)])


# -- in a model ------------------------------------------------------------------------------------

def _prompt(batch=1, length=6, seed=0):
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed)).to(DEV)


def _protected(family, monkeypatch, fuse=True, dtype=torch.float16):
    monkeypatch.setattr(S, "_ON_CPU", True)
    with override(siblings=fuse):  # read when protection is enabled
        return ftt.enable_fault_tolerance(make_model(family, attn="efta", dtype=dtype).to(DEV), ftt.FTConfig())


def _spy(monkeypatch):
    calls = []
    real = S._siblings_forward
    monkeypatch.setattr(S, "_siblings_forward", lambda x, *a: (calls.append(tuple(x.shape)), real(x, *a))[1])
    return calls


def _generate(model, ids, tokens=3):
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, do_sample=False,
                              min_new_tokens=tokens, output_scores=True, return_dict_in_generate=True, pad_token_id=0)


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_model_siblings_generate_like_one_call_per_layer(family, monkeypatch):
    """Q/K/V and gate/up in one launch each: the same tokens as one checked call per layer, logits
    within fp16 rounding, no events; every block's two groups ran fused at every step, and disabling
    protection removes the parents' forwards."""
    ids = _prompt()
    ref = _protected(family, monkeypatch, fuse=False)
    out_ref = _generate(ref, ids)
    model = _protected(family, monkeypatch)
    calls = _spy(monkeypatch)
    out = _generate(model, ids)
    layers = model.config.num_hidden_layers
    assert len(calls) == 3 * 2 * layers  # prefill (6 rows) and two decode steps (1 row)
    assert calls[0] == (1, 6, model.config.hidden_size) and calls[-1] == (1, 1, model.config.hidden_size)
    assert torch.equal(out.sequences, out_ref.sequences)
    torch.testing.assert_close(torch.stack(out.scores), torch.stack(out_ref.scores), rtol=0, atol=2e-2)
    assert ftt.fault_report(model).events == []
    parents = [m for m in model.modules() if "_ftt_sibling_key" in m.__dict__]
    assert len(parents) == 2 * layers
    ftt.disable_fault_tolerance(model)
    assert not any(type(m).__name__.startswith(("_Siblings", "_Checked")) for m in model.modules())
    assert all("forward" not in m.__dict__ and "_ftt_sibling_key" not in m.__dict__ for m in model.modules())


def test_model_sibling_groups_read_what_each_member_reads(monkeypatch):
    """Unsharded, a group is sized by its members' weights and reads their own parameter objects (the
    tensors their own calls read, so one weight-checksum cache entry each); a group over tensor-parallel
    shards (``sharded``, `test_tensor_parallel` runs them) steps aside in grad mode, where transformers'
    colwise forward would hand its members DTensors instead of the parent's input."""
    model = _protected("qwen2", monkeypatch).requires_grad_(False)
    attn = model.model.layers[0].self_attn
    gs = S.static_of(attn._ftt_sibling_key)
    members = [attn.q_proj, attn.k_proj, attn.v_proj]
    assert gs.names == ("q_proj", "k_proj", "v_proj") and not gs.sharded
    assert gs.sizes == (128, 64, 64) and gs.k == 128  # tiny qwen2: 4 heads, 2 KV heads of 32
    weights, biases = S._parameters(gs, members)
    assert all(w is m.weight for w, m in zip(weights, members))
    assert len(biases) == 3 and all(b is m.bias for b, m in zip(biases, members))
    x = torch.zeros((1, 2, 128), dtype=torch.float16, device=DEV)
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            assert S._eligible(gs, x, weights)
            assert S._eligible(gs._replace(sharded=True), x, weights) is not grad
    assert not S._eligible(gs, x[..., :64], weights)  # another width than the group's in_features


def test_model_sibling_events_stay_with_their_layer(monkeypatch):
    """A failing check in k_proj's columns of the fused launch is reported for k_proj of that block,
    as k_proj's own call would report it (here: a corrupted group checksum of its weight)."""
    model = _protected("qwen2", monkeypatch)
    ids = _prompt(seed=3)
    _generate(model, ids, tokens=1)  # builds the checksums
    ftt.fault_report(model).reset()
    k_proj = model.model.layers[1].self_attn.k_proj
    wc = k_proj._ftt_vabft_checksums[None][-1]
    wc.groups[GROUP_COLS][1][0, 0] += 100.0
    _generate(model, ids, tokens=1)
    mods = {(e.module, e.kind, e.count) for e in ftt.fault_report(model).events}
    assert mods == {("model.layers.1.self_attn.k_proj", "detected", 6),
                    ("model.layers.1.self_attn.k_proj", "recomputed", 6)}, mods


def test_model_sibling_uncorrectable_raises_naming_the_layer(monkeypatch):
    """With ``on_uncorrectable="raise"`` and correction off, a failing check in v_proj's columns of the
    fused launch raises, naming v_proj."""
    monkeypatch.setattr(S, "_ON_CPU", True)
    with override(siblings=True):
        model = ftt.enable_fault_tolerance(make_model("qwen2", attn="efta", dtype=torch.float16).to(DEV),
                                           ftt.FTConfig(correct=False, on_uncorrectable="raise"))
    ids = _prompt(seed=6)
    _generate(model, ids, tokens=1)  # builds the checksums
    v_proj = model.model.layers[0].self_attn.v_proj
    v_proj._ftt_vabft_checksums[None][-1].groups[GROUP_COLS][1][0, 0] += 100.0
    with pytest.raises(ftt.UncorrectableFaultError, match=r"model\.layers\.0\.self_attn\.v_proj"):
        _generate(model, ids, tokens=1)


def test_model_siblings_step_aside_for_injection(monkeypatch):
    """While faults are injected each layer runs its own call (the plan is per layer): a flip in
    v_proj's output is found and repaired there, and the sibling path is not taken."""
    model = _protected("qwen2", monkeypatch)
    calls = _spy(monkeypatch)
    spec = ftt.FaultSpec(site="linear.output", layers=["model.layers.0.self_attn.v_proj"], bit=14, count=1,
                         calls=[0], seed=5)
    with ftt.inject_faults(model, spec):
        _generate(model, _prompt(seed=4), tokens=1)
    assert calls == []
    ev = {(e.module, e.kind) for e in ftt.fault_report(model).events}
    assert ("model.layers.0.self_attn.v_proj", "detected") in ev, ev
    assert {m for m, _ in ev} == {"model.layers.0.self_attn.v_proj"}


def test_model_siblings_compile_without_graph_breaks(monkeypatch):
    """Under torch.compile (aot_eager) the parent's forward and the sibling op trace into one graph:
    no graph breaks in the forward, the eager tokens, and the op in the graph."""
    model = _protected("qwen2", monkeypatch)
    ids = _prompt(seed=5)

    def generate():
        with torch.no_grad():
            return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, min_new_tokens=3,
                                  do_sample=False, cache_implementation="static", pad_token_id=0)

    eager = generate()
    ops = []
    torch._dynamo.reset()

    def backend(gm, inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    model.forward = torch.compile(model.forward, backend=backend)
    torch._dynamo.utils.counters.clear()
    out = generate()
    breaks = dict(torch._dynamo.utils.counters["graph_break"])
    # (on CUDA, generate with a static cache also compiles the model's __call__, whose forward hook
    # ends the step outside the graph: that break is expected, as in test_compile)
    assert all("end_step" in reason for reason in breaks), list(breaks)[:3]
    assert torch.equal(out, eager)
    assert sum("checked_linear_siblings" in t for t in ops) >= 2 * model.config.num_hidden_layers
    assert ftt.fault_report(model).events == []


# -- GPU, real widths --------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", DTYPES16, ids=str)
@pytest.mark.parametrize("m", [1, 16])
@pytest.mark.parametrize("ns,bias", [((896, 128, 128), True), ((4864, 4864), False)], ids=["qkv", "gate-up"])
def test_gpu_siblings_qwen2_widths(dtype, m, ns, bias):
    """Qwen2-0.5B's Q/K/V and gate/up at K = 896: float64 agreement, nothing counted over 200 clean
    calls of fresh inputs, and a corrupted group checksum counted in its weight only."""
    k = 896
    x, ws, bs = _operands(m, ns, k, dtype, bias, seed=7)
    y, stats, wcs = _siblings(x, ws, bs)
    assert stats == [ZERO] * len(ns)
    ref = _ref64(x, ws, bs)
    tol = (4 * ULP[dtype] + 4 * k**0.5 * 2.0**-24) * float(ref.abs().max())
    assert float((y.double().cpu() - ref).abs().max()) <= tol
    cnt = [new_counters(DEV) for _ in ns]
    g = torch.Generator(device=DEV).manual_seed(8)
    with torch.no_grad():
        for _ in range(200):
            xi = torch.randn((m, k), generator=g, device=DEV).to(dtype)
            checked_gemm_siblings(xi, ws, bs, wcs, cnt)
    assert [dict(FaultStats(c)) for c in cnt] == [ZERO] * len(ns)
    calls._group_sums(wcs[-1], ws[-1], bs[-1], False)[1][0, 0] += 1e4  # the last weight's first group
    cnt = [new_counters(DEV) for _ in ns]
    with torch.no_grad():
        y3 = checked_gemm_siblings(x, ws, bs, wcs, cnt)
    got = [dict(FaultStats(c)) for c in cnt]
    assert got[:-1] == [ZERO] * (len(ns) - 1) and got[-1]["detected"] == m
    assert got[-1]["recomputed"] + got[-1]["corrected"] == m
    assert float((y3.double().cpu() - ref).abs().max()) <= tol
