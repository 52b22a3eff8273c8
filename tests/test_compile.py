"""torch.compile of a protected model: same tokens, no graph breaks, events still counted.

Generation uses a static KV cache (``cache_implementation="static"``), the setting in which
transformers compiles the forward; ``model.forward`` is wrapped with ``torch.compile``. The fast
tests use the ``aot_eager`` backend (Dynamo + functionalisation of the library's custom ops, no
code generation); the inductor test is marked slow.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import VOCAB, make_model

import ft_transformers as ftt

NEW_TOKENS = 4


def _prompt(seed: int = 0, batch: int = 1, length: int = 8) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=g)


def _generate(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                              cache_implementation="static", pad_token_id=0)


def _events(model) -> list[tuple]:
    return [(e.step, e.module, e.site, e.kind, e.count) for e in ftt.fault_report(model).events]


def _protected(family: str, config: ftt.FTConfig):
    model = make_model(family, attn="efta")
    return ftt.enable_fault_tolerance(model, config)


def _compile(model, backend: str) -> None:
    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, backend=backend)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_compiled_protected_generation_equals_eager_without_graph_breaks(family):
    model = _protected(family, ftt.FTConfig())
    ids = _prompt()
    eager = _generate(model, ids)
    ftt.fault_report(model).reset()

    _compile(model, "aot_eager")
    torch._dynamo.utils.counters.clear()
    compiled = _generate(model, ids)
    breaks = dict(torch._dynamo.utils.counters["graph_break"])
    assert torch.equal(compiled, eager)
    assert breaks == {}, (f"{sum(breaks.values())} graph break(s) in the protected forward, e.g. "
                          f"{next(iter(breaks), '')[:400]}")
    report = ftt.fault_report(model)
    assert report.steps == NEW_TOKENS and report.events == []  # clean run: no false alarms


@pytest.mark.filterwarnings("ignore:.*uncorrectable fault:RuntimeWarning")
def test_compiled_graph_counts_events():
    # A tiny e_max makes every checked GEMM flag rounding noise: the events come from the compiled
    # graph's custom ops (no injection, so nothing runs outside the graph) and must match eager. (Every
    # 64-column group of every row flags, more than a call repairs: the uncorrectable ones warn, as meant.)
    cfg = ftt.FTConfig(emax=1e-12)
    model = _protected("llama", cfg)
    ids = _prompt(1)
    eager = _generate(model, ids)
    eager_events = _events(model)
    assert eager_events and any(k == "detected" for _, _, _, k, _ in eager_events)
    ftt.fault_report(model).reset()

    _compile(model, "aot_eager")
    compiled = _generate(model, ids)
    assert torch.equal(compiled, eager)
    assert _events(model) == eager_events


@pytest.mark.parametrize("spec", [
    ftt.FaultSpec(site="attn.scores", bit=30, count=1, layers=[1], calls=[0], seed=3),
    ftt.FaultSpec(site="linear.output", bit=30, count=1, layers=[0], calls=[1], seed=5),
])
def test_compiled_injection_is_detected_and_corrected(spec):
    model = _protected("llama", ftt.FTConfig())
    ids = _prompt(2)
    clean = _generate(model, ids)
    ftt.fault_report(model).reset()
    with ftt.inject_faults(model, spec) as eager_log:
        eager = _generate(model, ids)
    eager_injected = eager_log.injected  # the log reads the shared record list: read it now
    eager_events = _events(model)
    ftt.fault_report(model).reset()

    _compile(model, "aot_eager")
    with ftt.inject_faults(model, spec) as log:
        compiled = _generate(model, ids)
    assert log.injected == eager_injected >= 1
    events = _events(model)
    assert events == eager_events
    kinds = {k for _, _, _, k, _ in events}
    assert "detected" in kinds and kinds & {"corrected", "recomputed"}
    assert torch.equal(compiled, eager) and torch.equal(compiled, clean)
    # After the context closes the compiled graph runs again, clean.
    ftt.fault_report(model).reset()
    assert torch.equal(_generate(model, ids), clean) and _events(model) == []


def test_compiled_injection_without_protection_matches_eager():
    # detect=False: the flips land unchecked, so compiled and eager must corrupt identically.
    model = _protected("llama", ftt.FTConfig(detect=False, correct=False))
    ids = _prompt(3)
    spec = ftt.FaultSpec(site="attn.output", bit=30, count=4, layers=[0], seed=1)
    with ftt.inject_faults(model, spec):
        eager = _generate(model, ids)
    _compile(model, "aot_eager")
    with ftt.inject_faults(model, spec) as log:
        compiled = _generate(model, ids)
    assert log.injected > 0
    assert torch.equal(compiled, eager)
    assert _events(model) == []


@pytest.mark.slow
def test_inductor_compiled_protected_generation_equals_eager():
    model = _protected("qwen2", ftt.FTConfig())
    ids = _prompt(4)
    eager = _generate(model, ids)
    _compile(model, "inductor")
    torch._dynamo.utils.counters.clear()
    compiled = _generate(model, ids)
    assert torch.equal(compiled, eager)
    assert dict(torch._dynamo.utils.counters["graph_break"]) == {}
    spec = ftt.FaultSpec(site="attn.scores", bit=30, count=1, layers=[0], calls=[0], seed=0)
    with ftt.inject_faults(model, spec):
        assert torch.equal(_generate(model, ids), eager)
    assert ftt.fault_report(model).totals()["detected"] >= 1


def test_generation_compile_config_route():
    # transformers' own route: generate() compiles model.__call__ (hooks included) for the decode
    # steps when a static cache is used and a CompileConfig allows the device.
    from transformers import CompileConfig

    model = _protected("llama", ftt.FTConfig())
    ids = _prompt(5)
    eager = _generate(model, ids)
    cc = CompileConfig(backend="aot_eager", mode=None, fullgraph=False)
    cc._compile_all_devices = True  # transformers compiles on CUDA only unless told otherwise
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    ftt.fault_report(model).reset()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                             cache_implementation="static", pad_token_id=0, compile_config=cc)
    assert "_compiled_call" in model.__dict__  # the decode steps did run compiled
    assert torch.equal(out, eager)
    # The model's hooks (step end, KV-cache tracking) run as plain Python beside the compiled forward: no
    # frame of theirs is compiled, so nothing breaks.
    assert dict(torch._dynamo.utils.counters["graph_break"]) == {}
    report = ftt.fault_report(model)
    assert report.steps == NEW_TOKENS and report.events == []


@pytest.mark.filterwarnings("ignore:.*uncorrectable fault:RuntimeWarning")
def test_compiled_module_holding_the_model_files_each_call_like_eager():
    # A compiled module that calls the protected model traces the model's hooks inline (the step end then
    # breaks the graph, being host code): every call is still one step, with eager's events.
    model = _protected("llama", ftt.FTConfig(emax=1e-12, on_uncorrectable="ignore"))

    class Holder(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, ids):
            return self.inner(input_ids=ids).logits

    holder, ids = Holder(model), _prompt(9)
    with torch.no_grad():
        eager = [holder(ids) for _ in range(2)]
    eager_events = _events(model)
    assert {s for s, *_ in eager_events} == {0, 1}
    ftt.fault_report(model).reset()
    torch._dynamo.reset()
    compiled = torch.compile(holder, backend="aot_eager")
    with torch.no_grad():
        outs = [compiled(ids) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(outs, eager))
    assert ftt.fault_report(model).steps == 2 and _events(model) == eager_events


def _frames_compiled_by_generate(model, ids: torch.Tensor) -> int:
    """The frames dynamo compiles while ``generate`` runs transformers' compiled decode route."""
    from transformers import CompileConfig

    cc = CompileConfig(backend="aot_eager", mode=None, fullgraph=False)
    cc._compile_all_devices = True
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                       cache_implementation="static", pad_token_id=0, compile_config=cc)
    return int(torch._dynamo.utils.counters["frames"]["total"])


def test_compiled_decode_step_has_the_frames_of_the_unprotected_one():
    # Every frame dynamo compiles is a cache lookup and a guard evaluation on every decode step (host time,
    # milliseconds per token on a sharded model): protection adds none.
    ids = _prompt(7)
    plain = _frames_compiled_by_generate(make_model("qwen2", attn="sdpa"), ids)
    protected = _frames_compiled_by_generate(_protected("qwen2", ftt.FTConfig()), ids)
    assert protected == plain >= 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("batch", [1, 2])
def test_gpu_cuda_graph_decode_after_eager_prefill(batch):
    # transformers' route with CUDA graphs (mode="reduce-overhead"): the prefill runs eagerly, the decode
    # steps compiled and captured. The first decode-shaped call of each Linear (batch 1: the decode GEMM
    # kernel) then happens in the graphs' warm-up, whose allocations land in the graph pool: a tensor the
    # library caches there (e.g. the weight's group checksums) fails the capture. A fresh model, so that no
    # eager decode step has built anything before.
    from transformers import CompileConfig

    ids = _prompt(6, batch=batch).cuda()
    ref = ftt.enable_fault_tolerance(make_model("qwen2", attn="efta", dtype=torch.float16).cuda(), ftt.FTConfig())
    eager = _generate(ref, ids)
    model = ftt.enable_fault_tolerance(make_model("qwen2", attn="efta", dtype=torch.float16).cuda(), ftt.FTConfig())
    torch._dynamo.reset()
    cc = CompileConfig(backend="inductor", mode="reduce-overhead", fullgraph=False)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                             cache_implementation="static", pad_token_id=0, compile_config=cc)
    assert "_compiled_call" in model.__dict__
    assert torch.equal(out, eager)
    report = ftt.fault_report(model)
    assert report.steps == NEW_TOKENS and report.events == []


def _guards(protected: bool, layers: int) -> tuple[int, int]:
    """(guard lines, Python identity guards) of a compiled Qwen2 of ``layers`` blocks' decode frame."""
    from tiny_models import qwen2_config
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch._dynamo.reset()
    cfg = Qwen2Config(**{**qwen2_config(sliding=False).to_dict(), "num_hidden_layers": layers, "layer_types": None})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    if protected:
        ftt.enable_fault_tolerance(model)
    model.forward = torch.compile(model.forward, backend="eager")
    with torch.no_grad():
        model.generate(_prompt(), attention_mask=torch.ones_like(_prompt()), max_new_tokens=2, do_sample=False,
                       cache_implementation="static", pad_token_id=0)
    entries = _debug_get_cache_entry_list(model.forward._torchdynamo_orig_callable.__code__)
    text = str(entries[-1].guard_manager)
    return text.count("\n"), text.count("LAMBDA_GUARD")


def test_compiled_guards_grow_with_depth_about_as_unprotected():
    # Every call of a compiled model first evaluates its guards on the host; at batch-1 decode that
    # host time is part of each token's. What a protected layer's traced forward reads must not add
    # guards per layer beyond a few: its settings are one constant behind the context's key, its model's
    # state a global (`ft_transformers._states`). Reached through every module's context instead, they
    # would cost ~260 more guard lines and ~27 Python identity guards per block than unprotected (against
    # ~50 and ~1 this way; a protected 24-block Qwen2 had 12,192 guard lines and 662 identity guards
    # against 5,796 and 35 unprotected, and Dynamo's cache lookups took 1.24 against 0.30 ms per step on
    # an H200 host, two lookups against one).
    lines = {(p, n): _guards(p, n) for p in (False, True) for n in (2, 4)}
    plain_lines = lines[(False, 4)][0] - lines[(False, 2)][0]
    prot_lines = lines[(True, 4)][0] - lines[(True, 2)][0]
    plain_id = lines[(False, 4)][1] - lines[(False, 2)][1]
    prot_id = lines[(True, 4)][1] - lines[(True, 2)][1]
    assert prot_lines <= 1.4 * plain_lines, lines
    assert prot_id <= plain_id + 2 * 2, lines  # at most one more identity guard per block and kind of path
