"""Families protected through discovery: tiny models of each, against eager attention.

For every family: logits (or hidden states) match eager attention, greedy ``generate`` gives the
same tokens, a clean run records no event, and a bit flip injected at ``attn.scores`` and at
``linear.output`` is detected and corrected. Plus what discovery refuses or reports: attention logit
softcapping, fused MoE experts (unchecked, never silently), a model without attention-interface
modules, and `register_family` for a custom model.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from tiny_models import SMALL_VOCAB, make_small, small_configs

import ft_transformers as ftt
from ft_transformers import patches
from ft_transformers.discovery import discover, layer_of

TOL = 2e-4
FAMILIES = list(small_configs())
ENCODERS = {"bert", "roberta"}
MOE = {"mixtral", "qwen2_moe"}


def _batch(seed: int = 0):
    """input_ids (2, 10) and an attention mask with the second row left-padded by 3."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, SMALL_VOCAB, (2, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ids[1, :3] = 0
    return ids, mask


def _forward(model, name, ids, mask):
    with torch.no_grad():
        if name == "t5":
            dec = ids[:, :4].clone()
            dec[:, 0] = 0
            return model(input_ids=ids, attention_mask=mask, decoder_input_ids=dec)[0]
        return model(input_ids=ids, attention_mask=mask)[0]


def _valid(name, out, mask):
    """Real-token positions only (padded query rows are undefined in eager attention too)."""
    return out if name == "t5" else out[mask.bool()]


def _err(name, a, b, mask) -> float:
    return (_valid(name, a, mask) - _valid(name, b, mask)).abs().max().item()


@pytest.mark.parametrize("name", FAMILIES)
def test_family_matches_eager_and_corrects_flips(name):
    model = make_small(name)
    ids, mask = _batch()
    ref = _forward(model, name, ids, mask)
    gen_kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    if name not in ENCODERS:
        with torch.no_grad():
            ref_tokens = model.generate(input_ids=ids, attention_mask=mask, **gen_kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ftt.enable_fault_tolerance(model)
    assert bool([w for w in caught if "UNCHECKED" in str(w.message)]) == (name in MOE)
    assert model.config._attn_implementation == "efta"

    out = _forward(model, name, ids, mask)
    assert _err(name, out, ref, mask) < TOL
    report = ftt.fault_report(model)
    assert report.steps == 1 and report.totals()["detected"] == 0, str(report)
    if name not in ENCODERS:
        with torch.no_grad():
            tokens = model.generate(input_ids=ids, attention_mask=mask, **gen_kw)
        assert torch.equal(tokens, ref_tokens)
        assert ftt.fault_report(model).totals()["detected"] == 0

    for site in ("attn.scores", "linear.output"):
        ftt.fault_report(model).reset()
        spec = ftt.FaultSpec(site=site, bit=30, count=1, layers=[1], seed=1)
        with ftt.inject_faults(model, spec) as log:
            faulty = _forward(model, name, ids, mask)
        assert log.injected >= 1
        tot = ftt.fault_report(model).totals()
        assert tot["detected"] >= 1 and tot["uncorrectable"] == 0, f"{site}: {tot}"
        assert tot["detected"] == tot["corrected"] + tot["recomputed"]
        assert {e.layer for e in ftt.fault_report(model).events} == {1}
        assert _err(name, faulty, ref, mask) < TOL, site


def test_linear_flip_unprotected_leaves_a_trace():
    """The flips above matter: with checks off, the same linear.output flip moves the output."""
    model = make_small("qwen3")
    ids, mask = _batch()
    ref = _forward(model, "qwen3", ids, mask)
    ftt.enable_fault_tolerance(model, ftt.FTConfig(detect=False, correct=False))
    with ftt.inject_faults(model, ftt.FaultSpec(site="linear.output", bit=30, count=1, layers=[1], seed=1)):
        bad = _forward(model, "qwen3", ids, mask)
    err = (_valid("qwen3", bad, mask) - _valid("qwen3", ref, mask)).abs().max()
    assert not torch.isfinite(err) or err > 1e-2


def test_discovered_siblings_and_layers():
    """Q/K/V and gate/up are found from the forwards' code; layer index from the module path."""
    assert discover(make_small("llama3")).siblings == (
        ("LlamaAttention", "hidden_states", ("q_proj", "k_proj", "v_proj")),
        ("LlamaMLP", "x", ("gate_proj", "up_proj")))
    assert discover(make_small("phi3")).siblings == ()  # fused qkv_proj / gate_up_proj
    assert layer_of("model.layers.3.self_attn.q_proj") == 3
    assert layer_of("encoder.block.1.layer.0.SelfAttention") == 1
    assert layer_of("lm_head") == -1


def test_attention_softcapping_is_refused():
    model = make_small("gemma2", attn_logit_softcapping=50.0)
    with pytest.raises(ValueError, match="softcapping"):
        ftt.enable_fault_tolerance(model)
    assert model.config._attn_implementation == "eager"
    ftt.enable_fault_tolerance(model, ftt.FTConfig(attention=False))  # Linear layers only: allowed
    assert model.config._attn_implementation == "eager"


@pytest.mark.parametrize("name", sorted(MOE))
def test_fused_experts_are_reported_unchecked(name):
    model = make_small(name)
    with pytest.warns(UserWarning, match="UNCHECKED"):
        ftt.enable_fault_tolerance(model)
    unchecked = ftt.fault_report(model).unchecked
    assert {n for n in unchecked if n.endswith("mlp.experts")} == {f"model.layers.{i}.mlp.experts" for i in (0, 1)}
    assert "UNCHECKED" in str(ftt.fault_report(model))
    with pytest.warns(UserWarning, match="UNCHECKED"):
        ftt.enable_fault_tolerance(model, ftt.FTConfig(layers=[0]))  # only the blocks in scope are listed
    assert all(layer_of(n) == 0 for n in ftt.fault_report(model).unchecked)


class _CustomAttention(torch.nn.Module):
    """Reaches transformers' attention interface through a helper that discovery does not read."""

    def __init__(self, config):
        super().__init__()
        self.config, self.is_causal = config, True
        self.qkv = torch.nn.Linear(32, 96)
        self.out = torch.nn.Linear(32, 32)

    def forward(self, h):
        return self.out(self._attend(h))

    def _attend(self, h):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: PLC0415

        q, k, v = (t.view(h.shape[0], h.shape[1], 2, 16).transpose(1, 2) for t in self.qkv(h).chunk(3, -1))
        fn = ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]
        o, _ = fn(self, q, k, v, None, scaling=0.25, is_causal=True)
        return o.reshape(h.shape[0], h.shape[1], 32)


class _CustomModel(torch.nn.Module):
    def __init__(self):
        from transformers import PretrainedConfig  # noqa: PLC0415

        super().__init__()
        self.config = PretrainedConfig()
        self.config.model_type = "ftt_test_custom"
        self.config._attn_implementation = "sdpa"
        self.layers = torch.nn.ModuleList([_CustomAttention(self.config) for _ in range(2)])

    def set_attn_implementation(self, impl):
        self.config._attn_implementation = impl

    def forward(self, h):
        for layer in self.layers:
            h = h + layer(h)
        return h


def test_no_attention_found_points_to_register_family(monkeypatch):
    monkeypatch.setattr(patches, "_REGISTERED", {})
    model = _CustomModel()
    with pytest.raises(ValueError, match="register_family") as err:
        ftt.enable_fault_tolerance(model)
    assert "ALL_ATTENTION_FUNCTIONS" in str(err.value)


def test_register_family_protects_a_custom_model(monkeypatch):
    monkeypatch.setattr(patches, "_REGISTERED", {})
    torch.manual_seed(0)
    model = _CustomModel().eval()
    h = torch.randn(2, 7, 32)
    with torch.no_grad():
        ref = model(h)
    adapter = ftt.register_family("ftt_test_custom", attention_classes=[_CustomAttention], quirks="test")
    assert adapter.attention_classes == ("_CustomAttention",) and adapter.family == "ftt_test_custom"
    ftt.enable_fault_tolerance(model)
    with torch.no_grad():
        out = model(h)
        assert (out - ref).abs().max().item() < TOL
        with ftt.inject_faults(model, ftt.FaultSpec(site="attn.scores", bit=30, layers=[1], seed=0)):
            faulty = model(h)
    report = ftt.fault_report(model)
    assert report.totals()["detected"] >= 1 and report.totals()["uncorrectable"] == 0
    assert {e.module for e in report.events} == {"layers.1"}
    assert (faulty - ref).abs().max().item() < TOL


def test_register_family_refusal_and_bad_arguments(monkeypatch):
    monkeypatch.setattr(patches, "_REGISTERED", {})
    ftt.register_family("llama", unsupported=lambda cfg: "not this one" if cfg.hidden_size == 64 else None)
    with pytest.raises(ValueError, match="not this one"):
        ftt.enable_fault_tolerance(make_small("llama3"))
    with pytest.raises(ValueError, match="two or more"):
        ftt.register_family("x", siblings=[("P", "x", ("only",))])
    with pytest.raises(TypeError, match="model_types"):
        ftt.register_family([3])
    with pytest.raises(TypeError, match="unsupported"):
        ftt.register_family("x", unsupported="no")
