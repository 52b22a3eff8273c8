"""No silent bypass: attention leaving EFTA, swapped-out Linears, continuous batching, and the 2-D
padding mask of flash-style mask functions (the Hub-kernels route), on tiny models against eager."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from tiny_models import make_model, padded_batch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

import ft_transformers as ftt
from ft_transformers.attention import efta_attention_forward
from ft_transformers.bypass import UnprotectedWarning

TOL = 2e-4
# EFTA paired with the flash-attention mask function (a 2-D padding mask or None), as
# `load_and_register_attn_kernel` pairs every Hub kernel
FLASH_MASKED_EFTA = "efta_2d_padding_mask"  # (a name with "flash" in it would load flash-attn)
AttentionInterface.register(FLASH_MASKED_EFTA, efta_attention_forward)
AttentionMaskInterface.register(FLASH_MASKED_EFTA, flash_attention_mask)


def _logits(model, ids, mask):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


def _attention_names(model):
    return [n for n, m in model.named_modules() if n.endswith("self_attn")]


def _unprotected_warnings(record):
    return [w for w in record if issubclass(w.category, UnprotectedWarning)]


def test_clean_run_reports_nothing_unprotected():
    model = make_model("llama")
    ids, mask = padded_batch()
    ftt.enable_fault_tolerance(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnprotectedWarning)
        _logits(model, ids, mask)
    report = ftt.fault_report(model)
    assert report.unprotected == {}
    assert "UNPROTECTED" not in str(report)
    assert all(site != "unprotected" for _, site in report.summary())


@pytest.mark.parametrize("route", ["set_attn_implementation", "config"])
def test_attention_switched_away_warns_once_and_counts_calls(route, tmp_path):
    model = make_model("llama")
    ids, mask = padded_batch()
    ftt.enable_fault_tolerance(model)
    _logits(model, ids, mask)  # protected call
    if route == "config":
        model.config._attn_implementation = "sdpa"
    else:
        model.set_attn_implementation("sdpa")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(3):
            _logits(model, ids, mask)
    got = _unprotected_warnings(record)
    assert len(got) == 1 and "sdpa" in str(got[0].message), [str(w.message) for w in record]
    assert got[0].filename == __file__  # points at the user's call
    report = ftt.fault_report(model)
    names = _attention_names(model)
    assert report.unprotected == dict.fromkeys(names, 3)
    assert set(report.unprotected_routes.values()) == {"attn_implementation='sdpa'"}
    assert report.summary()[(0, "unprotected")] == {"calls": 3}
    assert "UNPROTECTED" in str(report) and names[0] in str(report)
    report.to_json(tmp_path / "r.json")
    rows = json.loads((tmp_path / "r.json").read_text())["unprotected"]
    assert {r["module"]: r["calls"] for r in rows} == report.unprotected

    # back on EFTA: counting stops
    model.set_attn_implementation("efta")
    _logits(model, ids, mask)
    assert ftt.fault_report(model).unprotected == dict.fromkeys(names, 3)
    ftt.fault_report(model).reset()
    assert ftt.fault_report(model).unprotected == {}
    # disabling restores the original implementation without a warning
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnprotectedWarning)
        ftt.disable_fault_tolerance(model)
    assert model.config._attn_implementation == "eager"


def test_bypass_warning_can_be_made_an_error():
    model = make_model("gpt2")
    ids, mask = padded_batch()
    ftt.enable_fault_tolerance(model)
    model.set_attn_implementation("sdpa")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnprotectedWarning)
        with pytest.raises(UnprotectedWarning, match="not EFTA"):
            _logits(model, ids, mask)


def test_efta_reregistered_is_a_bypass():
    model = make_model("llama")
    ids, mask = padded_batch()
    ftt.enable_fault_tolerance(model)
    sdpa = AttentionInterface._global_mapping["sdpa"]
    AttentionInterface.register("efta", sdpa)
    try:
        with pytest.warns(UnprotectedWarning):
            _logits(model, ids, mask)
    finally:
        AttentionInterface.register("efta", efta_attention_forward)
    assert ftt.fault_report(model).unprotected == dict.fromkeys(_attention_names(model), 1)


def test_swapped_linear_is_reported():
    model = make_model("llama")
    ids, mask = padded_batch()
    ftt.enable_fault_tolerance(model)
    old = model.model.layers[1].mlp.down_proj
    new = torch.nn.Linear(old.in_features, old.out_features, bias=False)
    with torch.no_grad():
        new.weight.copy_(old.weight)
    with pytest.warns(UnprotectedWarning, match="model.layers.1.mlp.down_proj") as record:
        model.model.layers[1].mlp.down_proj = new
    assert record[0].filename == __file__
    _logits(model, ids, mask)
    _logits(model, ids, mask)
    assert ftt.fault_report(model).unprotected == {"model.layers.1.mlp.down_proj": 2}
    # a module moved within the protected model is not a bypass
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnprotectedWarning)
        model.model.layers[0].mlp.gate_proj = model.model.layers[0].mlp.gate_proj
    # enabling again protects the replacement
    ftt.enable_fault_tolerance(model)
    _logits(model, ids, mask)
    assert ftt.fault_report(model).unprotected == {}


def test_swapped_block_reports_its_modules():
    model = make_model("llama")
    ids, mask = padded_batch()
    fresh = make_model("llama", seed=5).model.layers[0]
    ftt.enable_fault_tolerance(model)
    with pytest.warns(UnprotectedWarning):
        model.model.layers[0] = fresh
    _logits(model, ids, mask)
    got = ftt.fault_report(model).unprotected
    assert "model.layers.0.self_attn" in got and "model.layers.0.mlp.down_proj" in got
    assert set(got.values()) == {1} and all(n.startswith("model.layers.0.") for n in got)


@pytest.mark.parametrize("entry", ["generate_batch", "init_continuous_batching"])
def test_continuous_batching_refused_on_a_protected_model(entry):
    model = make_model("llama")
    ftt.enable_fault_tolerance(model)
    with pytest.raises(ValueError, match="continuous batching.*protected model"):
        if entry == "generate_batch":
            model.generate_batch([[3, 4, 5]], max_new_tokens=2)
        else:
            model.init_continuous_batching()
    assert model.config._attn_implementation == "efta"
    ftt.disable_fault_tolerance(model)
    assert entry not in model.__dict__  # the model's own method again


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_two_d_padding_mask_left_padded_matches_eager(family):
    """EFTA under the flash mask function gets a (B, N) padding mask; qwen2's sliding window (6 keys,
    12 tokens) must then come from the layer, not from the mask."""
    model = make_model(family, seed=2)
    ids, mask = padded_batch(seed=3, lengths=(12, 7))
    ref = _logits(model, ids, mask)
    ftt.enable_fault_tolerance(model)
    model.set_attn_implementation(FLASH_MASKED_EFTA)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnprotectedWarning)  # EFTA under another name is not a bypass
        out = _logits(model, ids, mask)
    err = (out[mask.bool()] - ref[mask.bool()]).abs().max().item()
    assert err < TOL, f"{family}: max |efta(2-D mask) - eager| = {err:.3g}"
    report = ftt.fault_report(model)
    assert report.unprotected == {} and report.totals()["detected"] == 0, str(report)


@pytest.mark.parametrize("cache", [None, "static"])
def test_two_d_padding_mask_generate_identical(cache):
    """Decode steps: M = 1 against a growing 2-D mask; a static cache hands a mask shorter than the keys."""
    model = make_model("llama", seed=4)
    ids, mask = padded_batch(seed=5, lengths=(9, 5))
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, cache_implementation=cache)
    with torch.no_grad():
        ref = model.generate(input_ids=ids, attention_mask=mask, **kw)
        ftt.enable_fault_tolerance(model)
        model.set_attn_implementation(FLASH_MASKED_EFTA)
        out = model.generate(input_ids=ids, attention_mask=mask, **kw)
    assert torch.equal(out, ref)
    assert ftt.fault_report(model).unprotected == {}


def _module(causal: bool):
    mod = torch.nn.Module()
    mod.is_causal = causal
    return mod.eval()


@pytest.mark.parametrize("causal", [False, True])
def test_two_d_mask_equals_its_four_d_form(causal):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 6, 32, generator=g) for _ in range(3))
    pad = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    four = pad.bool()[:, None, None, :]
    if causal:
        four = four & torch.ones(6, 6, dtype=torch.bool).tril()
    out2, _ = efta_attention_forward(_module(causal), q, k, v, pad, scaling=0.2)
    out4, _ = efta_attention_forward(_module(causal), q, k, v, four, scaling=0.2)
    # (B, M): the query rows with a key to attend (fully masked rows are undefined)
    rows = four.expand(2, 1, 6, 6).any(-1).squeeze(1)
    torch.testing.assert_close(out2[rows], out4[rows])
    # eager (float64) on the rows that matter
    s = (q.double() @ k.double().transpose(-1, -2)) * 0.2
    p = s.masked_fill(~four, float("-inf")).softmax(-1).nan_to_num()
    ref = (p @ v.double()).transpose(1, 2)
    torch.testing.assert_close(out2[rows].double(), ref[rows], atol=1e-5, rtol=1e-5)


def test_two_d_mask_bad_input_errors():
    q, k, v = (torch.randn(2, 4, 6, 32) for _ in range(3))
    with pytest.raises(ValueError, match=r"2-D attention_mask.*\(3, 6\).*cannot be broadcast"):
        efta_attention_forward(_module(True), q, k, v, torch.ones(3, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match="cannot be broadcast"):
        efta_attention_forward(_module(True), q, k, v, torch.ones(2, 7, dtype=torch.bool))
    with pytest.raises(TypeError, match="padding mask"):
        efta_attention_forward(_module(True), q, k, v, torch.zeros(2, 6))


def test_switch_under_torch_compile_warns_and_counts():
    model = make_model("llama")
    ids, mask = padded_batch()
    ftt.enable_fault_tolerance(model)
    compiled = torch.compile(model, backend="aot_eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnprotectedWarning)
        _logits(compiled, ids, mask)
    model.set_attn_implementation("sdpa")
    with pytest.warns(UnprotectedWarning, match="sdpa"):
        _logits(compiled, ids, mask)
        _logits(compiled, ids, mask)
    assert ftt.fault_report(model).unprotected == dict.fromkeys(_attention_names(model), 2)
