"""Whole models: efta + full protection against eager, on tiny models of the five families."""

from __future__ import annotations

import pytest
import torch
from tiny_models import FAMILIES, make_model, padded_batch

import ft_transformers as ftt

TOL = 2e-4


def _forward(model, family, ids, mask):
    with torch.no_grad():
        if family == "t5":
            dec = ids[:, :5].clone()
            dec[:, 0] = 0
            return model(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits
        if family == "bert":
            return model(input_ids=ids, attention_mask=mask).last_hidden_state
        return model(input_ids=ids, attention_mask=mask).logits


def _valid(family, out, mask):
    """Compare only positions that are real tokens (padded query rows are undefined in eager too)."""
    if family == "t5":
        return out
    return out[mask.bool()]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_protected_logits_match_eager_with_left_padding(family):
    model = make_model(family)
    ids, mask = padded_batch(seed=1)
    ref = _forward(model, family, ids, mask)
    ftt.enable_fault_tolerance(model, ftt.FTConfig())
    assert model.config._attn_implementation == "efta"
    out = _forward(model, family, ids, mask)
    err = (_valid(family, out, mask) - _valid(family, ref, mask)).abs().max().item()
    assert err < TOL, f"{family}: max |efta - eager| = {err:.3g}"
    report = ftt.fault_report(model)
    assert report.totals()["detected"] == 0, str(report)
    assert report.steps == 1


@pytest.mark.parametrize("family", ["gpt2", "qwen2", "llama", "t5"])
def test_greedy_generate_identical_tokens(family):
    model = make_model(family, seed=3)
    ids, mask = padded_batch(seed=4, lengths=(10, 6))
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ref = model.generate(input_ids=ids, attention_mask=mask, **kw)
        ftt.enable_fault_tolerance(model)
        out = model.generate(input_ids=ids, attention_mask=mask, **kw)
    assert torch.equal(out, ref)
    report = ftt.fault_report(model)
    assert report.totals()["detected"] == 0, str(report)
    # One model call per generated token (T5: the encoder runs inside the first call).
    assert report.steps == 8


def test_disable_restores_model():
    model = make_model("gpt2")
    ids, mask = padded_batch()
    ref = _forward(model, "gpt2", ids, mask)
    classes = {name: type(m) for name, m in model.named_modules()}
    ftt.enable_fault_tolerance(model)
    ftt.enable_fault_tolerance(model)  # idempotent
    # the checked layers run under a subclass whose forward is the checked GEMM's
    swapped = [name for name, m in model.named_modules() if type(m) is not classes[name]]
    assert swapped and all(isinstance(model.get_submodule(n), classes[n]) for n in swapped)
    ftt.disable_fault_tolerance(model)
    assert model.config._attn_implementation == "eager"
    assert all(type(m) is classes[name] for name, m in model.named_modules())
    assert not any("forward" in m.__dict__ or "_ftt" in m.__dict__ for m in model.modules())
    assert torch.equal(_forward(model, "gpt2", ids, mask), ref)
    with pytest.raises(ValueError, match="not protected"):
        ftt.fault_report(model)


def test_deepcopy_of_a_protected_model_raises_and_unprotected_copies_protect_apart():
    """A protected model's layers find their state by key, so a deep copy would report into the original's
    counters: copying it raises a clear error. Copied before protection, each model counts its own events."""
    import copy

    model = ftt.enable_fault_tolerance(make_model("qwen2"), ftt.FTConfig(emax=1e-12))
    with pytest.raises(TypeError, match="disable_fault_tolerance"):
        copy.deepcopy(model)
    ftt.disable_fault_tolerance(model)
    twin = copy.deepcopy(model)
    # a tiny e_max: rounding noise is flagged (and left uncorrectable: no warning wanted, only counts)
    noisy = ftt.FTConfig(emax=1e-12, on_uncorrectable="ignore")
    ftt.enable_fault_tolerance(model, noisy)
    ftt.enable_fault_tolerance(twin, noisy)
    ids, mask = padded_batch()
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    assert ftt.fault_report(model).totals()["detected"] > 0
    assert ftt.fault_report(twin).totals()["detected"] == 0
    with torch.no_grad():
        twin(input_ids=ids, attention_mask=mask)
    assert ftt.fault_report(twin).totals()["detected"] == ftt.fault_report(model).totals()["detected"]


def test_accelerate_hooks_survive_protection():
    """A module accelerate hooked (device_map placement) keeps its hook under protection: the hook
    still runs around the checked GEMM, and disabling protection leaves the hook in place."""
    hooks = pytest.importorskip("accelerate.hooks")

    class Count(hooks.ModelHook):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def pre_forward(self, module, *args, **kwargs):
            self.calls += 1
            return args, kwargs

    model = make_model("llama")
    ids, mask = padded_batch()
    ref = _forward(model, "llama", ids, mask)
    hook = Count()
    hooks.add_hook_to_module(model.lm_head, hook)
    ftt.enable_fault_tolerance(model)
    spec = ftt.FaultSpec(site="linear.output", bit=30, layers=["lm_head"])
    with torch.no_grad(), ftt.inject_faults(model, spec) as log:
        out = _forward(model, "llama", ids, mask)
    assert hook.calls == 1 and log.injected == 1  # the hook ran, and so did the checked GEMM it wraps
    assert ftt.fault_report(model).totals()["corrected"] == 1
    assert (_valid("llama", out, mask) - _valid("llama", ref, mask)).abs().max().item() < TOL
    ftt.disable_fault_tolerance(model)
    assert torch.equal(_forward(model, "llama", ids, mask), ref) and hook.calls == 2
    assert "_ftt_inner_forward" not in model.lm_head.__dict__


def test_set_attn_implementation_and_from_config():
    model = make_model("llama", attn="efta")
    assert model.config._attn_implementation == "efta"
    model.set_attn_implementation("eager")
    model.set_attn_implementation("efta")
    ids, mask = padded_batch()
    out = _forward(model, "llama", ids, mask)
    assert torch.isfinite(out[mask.bool()]).all()


def _flip_matters(site, pos, mask):
    """Whether a flip at ``pos`` of ``site`` reaches a real output (causal model, no cache)."""
    if site == "linear.output":
        return True
    b, i = pos[0], pos[2]
    if not mask[b, i]:
        return False  # padded query row: never compared
    if site == "attn.scores":
        j = pos[3]
        return bool(mask[b, j]) and j <= i  # masked scores are overwritten with -inf anyway
    return True


@pytest.mark.parametrize("site", ["attn.scores", "attn.rowmax", "attn.probs", "attn.rowsum", "attn.output",
                                  "linear.output"])
def test_single_exponent_flip_corrected_in_model(site):
    model = make_model("llama", seed=5)
    ids, mask = padded_batch(seed=6)
    harmful = 0
    for seed in range(6):
        ftt.enable_fault_tolerance(model)
        clean = _forward(model, "llama", ids, mask)
        spec = ftt.FaultSpec(site=site, bit=30, count=1, layers=[1], seed=seed)
        with ftt.inject_faults(model, spec) as log:
            out = _forward(model, "llama", ids, mask)
        assert log.injected >= 1
        report = ftt.fault_report(model)
        tot = report.totals()
        assert tot["detected"] >= 1, str(report)
        assert tot["detected"] == tot["corrected"] + tot["recomputed"] + tot["uncorrectable"]
        assert tot["uncorrectable"] == 0
        assert {e.layer for e in report.events} == {1}
        assert all(e.step == 1 for e in report.events)
        err = (_valid("llama", out, mask) - _valid("llama", clean, mask)).abs().max().item()
        assert err < TOL, f"{site}: {err:.3g}\n{report}"

        ftt.enable_fault_tolerance(model, ftt.FTConfig(detect=False, correct=False))
        with ftt.inject_faults(model, spec) as log:
            bad = _forward(model, "llama", ids, mask)
        assert ftt.fault_report(model).totals()["detected"] == 0
        diff = (_valid("llama", bad, mask) - _valid("llama", clean, mask)).abs().max()
        pos = log.records[0][2].sites[site].positions[0].tolist()
        if _flip_matters(site, pos, mask):
            harmful += 1
            assert not torch.isfinite(diff) or diff > 1e-2, f"{site} {pos}: unprotected flip left no trace"
    assert harmful >= 1


def test_fault_report_views(tmp_path):
    model = make_model("gpt2")
    ids, mask = padded_batch()
    ftt.enable_fault_tolerance(model)
    with ftt.inject_faults(model, ftt.FaultSpec(site="linear.output", bit=30, count=2, layers=[0], calls=[1])):
        _forward(model, "gpt2", ids, mask)  # call 0: untouched
        _forward(model, "gpt2", ids, mask)  # call 1: two flips in each Linear of block 0
    report = ftt.fault_report(model)
    assert report.steps == 2
    assert {e.step for e in report.events} == {1}
    assert {e.layer for e in report.events} == {0}
    summ = report.summary()
    assert (0, "linear.output") in summ and summ[(0, "linear.output")]["detected"] >= 4
    text = str(report)
    assert "linear.output" in text and "detected" in text
    report.to_json(tmp_path / "r.json")
    report.to_csv(tmp_path / "r.csv")
    assert (tmp_path / "r.csv").read_text().count("\n") == len(report.events) + 1
    report.reset()
    assert ftt.fault_report(model).events == []


def test_bad_input_errors():
    model = make_model("llama")
    ids, mask = padded_batch()
    ftt.enable_fault_tolerance(model)
    with pytest.raises(ValueError, match="output_attentions"):
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, output_attentions=True)
    with pytest.raises(ValueError, match="unknown fault site"):
        ftt.FaultSpec(site="attn.nowhere", bit=3)
    with pytest.raises(ValueError, match="bit"):
        ftt.FaultSpec(site="attn.scores", bit=32)
    with pytest.raises(ValueError, match="exactly one"):
        ftt.FaultSpec(site="attn.scores")
    with pytest.raises(ValueError, match="matches no protected module"):
        with ftt.inject_faults(model, ftt.FaultSpec(site="attn.scores", bit=3, layers=[7])):
            pass
    with pytest.raises(ValueError, match="register_family"):  # no attention-interface module
        ftt.enable_fault_tolerance(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    with pytest.raises(ValueError, match="not protected"):
        with ftt.inject_faults(make_model("gpt2"), ftt.FaultSpec(site="attn.scores", bit=3)):
            pass


def test_training_mode_with_dropout_is_refused():
    from tiny_models import gpt2_config
    from transformers import AutoModelForCausalLM

    cfg = gpt2_config()
    cfg.attn_pdrop = 0.1
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="efta")
    model.train()
    ids, mask = padded_batch()
    with pytest.raises(RuntimeError, match="inference-only"):
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)


def test_raise_policy():
    model = make_model("gpt2")
    ids, mask = padded_batch()
    ftt.enable_fault_tolerance(model, ftt.FTConfig(correct=False, on_uncorrectable="raise"))
    with pytest.raises(ftt.UncorrectableFaultError):
        with ftt.inject_faults(model, ftt.FaultSpec(site="linear.output", bit=30, layers=[0])):
            _forward(model, "gpt2", ids, mask)


def test_warn_policy():
    model = make_model("gpt2")
    ids, mask = padded_batch()
    ftt.enable_fault_tolerance(model, ftt.FTConfig(correct=False))
    with pytest.warns(RuntimeWarning, match="uncorrectable"):
        with ftt.inject_faults(model, ftt.FaultSpec(site="linear.output", bit=30, layers=[0])):
            _forward(model, "gpt2", ids, mask)


def test_forward_with_grad_enabled_raises_and_frozen_model_matches():
    model = make_model("llama")
    ids, mask = padded_batch()
    ref = _forward(model, "llama", ids, mask)
    ftt.enable_fault_tolerance(model)
    with pytest.raises(RuntimeError, match="inference-only"):
        model(input_ids=ids, attention_mask=mask)
    model.requires_grad_(False)  # grad mode on, nothing requiring grad: runs
    out = model(input_ids=ids, attention_mask=mask).logits
    assert (out[mask.bool()] - ref[mask.bool()]).abs().max().item() < TOL


def test_model_built_under_inference_mode_is_protected():
    """A model whose parameters are inference tensors (built inside ``torch.inference_mode``: no version
    counters) runs protected, matches eager, and a flip in one of its Linears is corrected."""
    with torch.inference_mode():
        model = make_model("llama")
    ids, mask = padded_batch(seed=3)
    with torch.inference_mode():
        ref = model(input_ids=ids, attention_mask=mask).logits
    ftt.enable_fault_tolerance(model, ftt.FTConfig())
    spec = ftt.FaultSpec(site="linear.output", bit=30, count=1, layers=[1], seed=0)
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=mask).logits
        with ftt.inject_faults(model, spec):
            hit = model(input_ids=ids, attention_mask=mask).logits
    valid = mask.bool()
    assert (out[valid] - ref[valid]).abs().max().item() < TOL
    assert (hit[valid] - ref[valid]).abs().max().item() < TOL
    totals = ftt.fault_report(model).summary()
    assert sum(v["corrected"] for v in totals.values()) >= 1, totals
    assert sum(v["uncorrectable"] for v in totals.values()) == 0, totals


def test_protecting_one_of_two_models_sharing_a_config_leaves_the_other_alone():
    """transformers gives models built from one config object that same object, and the attention
    implementation lives on it: protection gives its model a config of its own first, so the other model
    keeps its implementation (and its outputs), and each restores its own on disable."""
    from tiny_models import llama_config
    from transformers import AutoModelForCausalLM

    cfg = llama_config()
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    a = AutoModelForCausalLM.from_config(cfg).eval()
    b = AutoModelForCausalLM.from_config(cfg).eval()
    assert a.config is b.config  # (what makes the test meaningful)
    ids, mask = padded_batch(seed=4)
    with torch.no_grad():
        ref = b(input_ids=ids, attention_mask=mask).logits
    ftt.enable_fault_tolerance(a)
    assert a.config._attn_implementation == "efta"
    assert b.config._attn_implementation == "sdpa" and cfg._attn_implementation == "sdpa"
    assert all(m.config is a.config for m in a.modules() if "config" in m.__dict__)
    with torch.no_grad():
        assert torch.equal(b(input_ids=ids, attention_mask=mask).logits, ref)
    ftt.enable_fault_tolerance(b)
    ftt.disable_fault_tolerance(b)
    assert b.config._attn_implementation == "sdpa"
    ftt.disable_fault_tolerance(a)
    assert a.config._attn_implementation == "sdpa"


def test_pickling_a_protected_model_says_why_and_its_weights_still_save(tmp_path):
    """``torch.save(model)`` / pickle / ``copy.copy`` of a protected model, and deep copies or pickles of a part of
    it holding protected layers, raise one clear TypeError (the model's failed on whichever patched part pickle
    reached first; a part copied silently, keyed to the original's counters); its state dict saves and loads
    with ``weights_only``, and after `disable_fault_tolerance` the model pickles and its parts copy again."""
    import copy
    import pickle

    model = ftt.enable_fault_tolerance(make_model("llama"))
    for attempt in (lambda: pickle.dumps(model), lambda: torch.save(model, tmp_path / "m.pt"),
                    lambda: copy.copy(model)):
        with pytest.raises(TypeError, match="cannot be pickled or copied.*disable_fault_tolerance"):
            attempt()
    # A part holding protected layers would report into the model's counters and read its injections.
    block = model.model.layers[0]
    for part in (block, block.self_attn, block.mlp, block.mlp.down_proj):
        for attempt in (copy.deepcopy, pickle.dumps):
            with pytest.raises(TypeError, match="part of it holding protected layers"):
                attempt(part)
    assert "_ftt" in block.mlp.down_proj.__dict__  # (the refusal leaves the original as it was)
    torch.save(model.state_dict(), tmp_path / "sd.pt")
    loaded = torch.load(tmp_path / "sd.pt", weights_only=True)
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())
    ftt.disable_fault_tolerance(model)
    assert isinstance(pickle.loads(pickle.dumps(model)), type(model))
    assert isinstance(copy.deepcopy(block), type(block))
