"""Bad settings and inputs get a clear, early error naming what is wrong (never silent garbage).

Covers `FTConfig`, `FaultSpec`, `enable_fault_tolerance`'s check of ``layers`` against the model,
`efta_attention`'s and `checked_linear`'s argument checks, and the inference-only contract: with grad
mode on, nothing drops a gradient silently (kernel-level calls and protected models raise).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from tiny_models import make_model

import ft_transformers as ftt

IDS = torch.tensor([[5, 17, 42, 99, 7, 250]])


# FTConfig ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("field", ["emax", "csigma"])
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, 0.0, -1e-3])
def test_config_rejects_non_finite_or_non_positive_bounds(field, value):
    with pytest.raises(ValueError, match=f"FTConfig.{field}"):
        ftt.FTConfig(**{field: value})


@pytest.mark.parametrize("field, value", [("emax", "1e-3"), ("emax", True), ("csigma", "2.5"),
                                          ("csigma", None), ("pasa_beta", "0.5")])
def test_config_rejects_wrong_number_types(field, value):
    with pytest.raises(TypeError, match=f"FTConfig.{field} must be a number"):
        ftt.FTConfig(**{field: value})


def test_config_keeps_numbers_as_floats():
    cfg = ftt.FTConfig(emax=np.float32(1e-3), csigma=3, pasa_beta=0.5)
    assert type(cfg.emax) is float and type(cfg.csigma) is float and cfg.csigma == 3.0
    assert cfg.emax == pytest.approx(1e-3)


@pytest.mark.parametrize("field", ["attention", "linear", "detect", "correct", "pasa", "record_events"])
def test_config_flags_must_be_bools(field):
    with pytest.raises(TypeError, match=f"FTConfig.{field} must be a bool"):
        ftt.FTConfig(**{field: "no"})


def test_config_layers_forms():
    assert ftt.FTConfig(layers=5).layers == (5,)
    assert ftt.FTConfig(layers=np.int64(1)).layers == (1,)
    assert ftt.FTConfig(layers=range(2)).layers == (0, 1)
    assert ftt.FTConfig(layers=(i for i in [1, 0])).layers == (1, 0)
    for bad in ("0", [True], [0.0], 1.0, [None]):
        with pytest.raises(TypeError, match="FTConfig.layers"):
            ftt.FTConfig(layers=bad)
    with pytest.raises(ValueError, match="non-negative"):
        ftt.FTConfig(layers=[-1])
    with pytest.raises(ValueError, match="empty"):
        ftt.FTConfig(layers=[])


def test_enable_refuses_what_is_not_a_module():
    for bad in ("model", None, {"weight": torch.zeros(2, 2)}):
        with pytest.raises(TypeError, match="torch.nn.Module"):
            ftt.enable_fault_tolerance(bad)


def test_config_with_nothing_to_protect_is_refused():
    with pytest.raises(ValueError, match="protects nothing"):
        ftt.FTConfig(attention=False, linear=False)
    assert ftt.FTConfig(attention=False).linear and ftt.FTConfig(linear=False).attention


@pytest.mark.parametrize("family, layers, valid", [("llama", [7], "0..1"), ("gpt2", [0, 2], "0..1"),
                                                   ("llama", 5, "0..1")])
def test_enable_rejects_layers_the_model_lacks(family, layers, valid):
    model = make_model(family)
    attn = model.config._attn_implementation
    with pytest.raises(ValueError, match=rf"does not have \(its blocks: {valid}\)"):
        ftt.enable_fault_tolerance(model, ftt.FTConfig(layers=layers))
    # raised before anything changed
    assert model.config._attn_implementation == attn
    assert not any(hasattr(m, "_ftt") for m in model.modules())


def test_bare_int_layers_protect_and_inject_that_block_only():
    model = make_model("llama")
    ftt.enable_fault_tolerance(model, ftt.FTConfig(layers=1, correct=False, on_uncorrectable="ignore"))
    ctxs = {c.slot.name: c for c in ftt.protect._state(model).contexts}
    assert ctxs["model.layers.1.self_attn"].detect and ctxs["model.layers.1.mlp.up_proj"].detect
    assert not ctxs["model.layers.0.self_attn"].detect and not ctxs["lm_head"].detect
    spec = ftt.FaultSpec(site="linear.output", bit=30, layers=1, calls=0)
    with torch.no_grad(), ftt.inject_faults(model, spec) as log:
        model(IDS)
    names = {name for name, _, _ in log.records}
    assert names and all(n.startswith("model.layers.1.") for n in names)
    assert log.injected == len(names)  # one flip per targeted Linear in its first call
    assert ftt.fault_report(model).totals()["detected"] >= 1


@pytest.mark.parametrize("site, layers, bad", [("linear.output", [0, 7], [7]), ("attn.scores", [1, 3], [3]),
                                               ("linear.output", ["model.layers.0.mlp", "model.layer.1"],
                                                ["model.layer.1"])])
def test_inject_rejects_each_selector_that_matches_nothing(site, layers, bad):
    """A typo beside a valid entry would otherwise inject less than asked, silently."""
    model = make_model("llama")
    ftt.enable_fault_tolerance(model, ftt.FTConfig())
    spec = ftt.FaultSpec(site=site, bit=30, layers=layers)
    with pytest.raises(ValueError, match=r"layers \[" + repr(bad[0]).replace("[", r"\[") + r"\] match no protected"):
        with ftt.inject_faults(model, spec):
            pass
    assert not ftt.protect._state(model).active_faults
    # the valid entries alone are accepted
    ok = [sel for sel in layers if sel not in bad]
    with torch.no_grad(), ftt.inject_faults(model, ftt.FaultSpec(site=site, bit=30, layers=ok, calls=0)) as log:
        model(IDS)
    assert log.injected >= 1


# FaultSpec --------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, field", [
    (dict(bit="3"), "bit"), (dict(bit=30.9), "bit"), (dict(bit=30.0), "bit"), (dict(bit=True), "bit"),
    (dict(bit=3, count=True), "count"), (dict(bit=3, count=2.0), "count"), (dict(bit=3, seed="1"), "seed"),
    (dict(ber="1e-3"), "ber"), (dict(ber=False), "ber"),
    (dict(bit=3, layers=[0.5]), "layers"), (dict(bit=3, layers=[True]), "layers"), (dict(bit=3, layers=2.0), "layers"),
    (dict(bit=3, calls=["0"]), "calls"), (dict(bit=3, calls="0"), "calls"),
])
def test_fault_spec_type_errors_name_the_field(kw, field):
    with pytest.raises(TypeError, match=f"FaultSpec.{field}"):
        ftt.FaultSpec(site="linear.output", **kw)


@pytest.mark.parametrize("kw, match", [
    (dict(bit=32), "bit must lie"), (dict(bit=-1), "bit must lie"), (dict(ber=math.inf), "ber must be finite"),
    (dict(ber=0.0), "ber must lie"), (dict(bit=3, count=0), "count"), (dict(bit=3, calls=-1), "calls"),
    (dict(bit=3, ber=0.1), "exactly one"), (dict(), "exactly one"),
])
def test_fault_spec_value_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        ftt.FaultSpec(site="linear.output", **kw)


def test_fault_spec_site_must_be_a_known_string():
    for site in ("attn.score", None, ["attn.scores"]):
        with pytest.raises(ValueError, match="unknown fault site"):
            ftt.FaultSpec(site=site, bit=3)


def test_fault_spec_normalises_its_fields():
    s = ftt.FaultSpec(site="attn.scores", bit=np.int64(30), count=np.int32(2), seed=np.int64(7), layers=5, calls=3)
    assert (s.bit, s.count, s.seed, s.layers, s.calls) == (30, 2, 7, (5,), (3,))
    assert all(type(v) is int for v in (s.bit, s.count, s.seed))
    # a seed given as a NumPy int draws the same faults as the same Python int
    assert s == ftt.FaultSpec(site="attn.scores", bit=30, count=2, seed=7, layers=[5], calls=[3])
    assert ftt.FaultSpec(site="attn.scores", bit=3, layers="model.layers.0").layers == ("model.layers.0",)
    assert ftt.FaultSpec(site="attn.scores", bit=3, layers=[0, "lm_head", -1]).layers == (0, "lm_head", -1)


# efta_attention ---------------------------------------------------------------------------------

def _qkv(b=1, hq=2, hkv=2, m=4, n=4, d=8, dv=None):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(b, hq, m, d, generator=g), torch.randn(b, hkv, n, d, generator=g),
            torch.randn(b, hkv, n, d if dv is None else dv, generator=g))


@pytest.mark.parametrize("shape, err, match", [
    (dict(d=0), ValueError, "head dim D must be >= 1"),
    (dict(hq=3, hkv=2), ValueError, "multiple of key/value heads"),
    (dict(hq=2, hkv=0), ValueError, "multiple of key/value heads"),
    (dict(dv=16), ValueError, "k and v must have the same shape"),
])
def test_efta_degenerate_shapes_raise(shape, err, match):
    with pytest.raises(err, match=match):
        ftt.efta_attention(*_qkv(**shape), backend="reference")


def test_efta_head_dim_mismatch_raises():
    q, _, _ = _qkv()
    _, k, v = _qkv(d=4)
    with pytest.raises(ValueError, match="head dim mismatch"):
        ftt.efta_attention(q, k, v, backend="reference")


@pytest.mark.parametrize("shape", [dict(b=0), dict(m=0), dict(hq=0, hkv=1)])
def test_efta_empty_inputs_give_empty_outputs(shape):
    q, k, v = _qkv(**shape)
    out, stats = ftt.efta_attention(q, k, v, backend="reference")
    assert out.shape == q.shape and out.numel() == 0
    assert sum(dict(stats).values()) == 0


def test_efta_no_keys_gives_zero_rows():
    q, k, v = _qkv(n=0)
    out, stats = ftt.efta_attention(q, k, v, backend="reference")
    assert torch.equal(out, torch.zeros_like(q))  # every key masked: rows are 0 (documented)
    assert sum(dict(stats).values()) == 0


@pytest.mark.parametrize("kw, match", [(dict(scale="0.5"), "scale"), (dict(scale=math.nan), "scale"),
                                       (dict(window=True), "window"), (dict(window=2.0), "window"),
                                       (dict(causal="yes"), "causal must be a bool"),
                                       (dict(detect=1), "detect must be a bool")])
def test_efta_argument_types(kw, match):
    with pytest.raises(TypeError, match=match):
        ftt.efta_attention(*_qkv(), backend="reference", **kw)


# checked_linear ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, err, match", [
    (dict(emax=math.inf), ValueError, "emax must be finite"), (dict(emax=0.0), ValueError, "emax must be positive"),
    (dict(emax="1e-3"), TypeError, "emax must be a number"), (dict(csigma=math.nan), ValueError, "csigma"),
    (dict(csigma=True), TypeError, "csigma"), (dict(correct=1), TypeError, "correct must be a bool"),
])
def test_checked_linear_argument_errors(kw, err, match):
    x, w = torch.randn(3, 8), torch.randn(5, 8)
    with pytest.raises(err, match=match):
        ftt.checked_linear(x, w, **kw)


# inference only: with grad mode on nothing drops a gradient silently ------------------------------

def test_kernel_level_calls_raise_on_inputs_requiring_grad():
    x, w = torch.randn(3, 8, requires_grad=True), torch.randn(5, 8)
    for detect in (True, False):
        with pytest.raises(RuntimeError, match="inference-only"):
            ftt.checked_linear(x, w, detect=detect)
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="inference-only"):
        ftt.efta_attention(q.requires_grad_(), k, v, backend="reference")


@pytest.mark.parametrize("config", [ftt.FTConfig(), ftt.FTConfig(linear=False), ftt.FTConfig(attention=False),
                                    ftt.FTConfig(detect=False, correct=False), ftt.FTConfig(layers=[1])],
                         ids=["all", "attention-only", "linear-only", "unchecked", "one-block"])
def test_protected_model_forward_under_grad_raises(config):
    model = make_model("llama")
    with torch.no_grad():
        ref = model(IDS).logits
    ftt.enable_fault_tolerance(model, config)
    with pytest.raises(RuntimeError, match="inference-only"):
        model(IDS)
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits, ref, rtol=1e-4, atol=1e-4)
    model.requires_grad_(False)  # grad mode on, nothing requires grad: no gradient to lose
    torch.testing.assert_close(model(IDS).logits, ref, rtol=1e-4, atol=1e-4)


def test_efta_attention_implementation_without_protection_raises_under_grad():
    model = make_model("llama", attn="efta")
    with pytest.raises(RuntimeError, match="attn_implementation='efta' is inference-only"):
        model(IDS)
