"""`enable_fault_tolerance` / `disable_fault_tolerance` / `fault_report` for a whole model.

Protection is applied in place: attention modules are switched to the ``"efta"`` attention
implementation and tagged with a `_ModuleContext`; every ``nn.Linear`` (and GPT-2 ``Conv1D``)
gets an instance-level ``forward`` that runs the checked GEMM. The class, the parameters and
the state dict stay untouched, so disabling restores the model exactly.
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Sequence

import torch

from .attention import ATTN_IMPLEMENTATION
from .checked_linear import _checked_linear_forward
from .config import FTConfig
from .events import EventRecorder, FTReport, ModuleSlot
from .injection import FaultPlan, FaultSpec, derive_seed

_STATE_ATTR = "_ftt_state"


class _ModuleContext:
    """Per protected module: its slot in the recorder, its settings, its call count."""

    def __init__(self, state: _ProtectionState, slot: ModuleSlot, is_attention: bool, protected: bool,
                 layout: str | None = None) -> None:
        cfg = state.config
        self.state = state
        self.slot = slot
        self.is_attention = is_attention
        self.detect = cfg.detect and protected
        self.correct = cfg.correct and protected
        self.pasa = cfg.pasa
        self.pasa_beta = cfg.pasa_beta
        self.layout = layout
        self.calls = 0

    def _matches(self, spec: FaultSpec) -> bool:
        if spec.is_attention != self.is_attention:
            return False
        if spec.layers is None:
            return True
        name = self.slot.name
        for sel in spec.layers:
            if isinstance(sel, str):
                if name == sel or name.startswith(sel + "."):
                    return True
            elif int(sel) == self.slot.layer:
                return True
        return False

    def plan_for_call(self) -> FaultPlan:
        """The faults of this forward call (advances the module's call count)."""
        call = self.calls
        self.calls += 1
        specs = [s for s in self.state.active_faults
                 if self._matches(s) and (s.calls is None or call in s.calls)]
        plan = FaultPlan(specs, seed=derive_seed(self.slot.name, call))
        if specs:
            self.state.injection_log.append((self.slot.name, call, plan))
        return plan

    def counters(self, device: torch.device) -> torch.Tensor:
        return self.state.recorder.counters(self.slot, device)

    def after_call(self, counters: torch.Tensor) -> None:
        if self.state.config.on_uncorrectable == "raise":
            EventRecorder.raise_if_uncorrectable(counters, self.slot.name)


class _ProtectionState:
    def __init__(self, config: FTConfig, original_attn: str | None) -> None:
        self.config = config
        self.original_attn = original_attn
        self.recorder = EventRecorder(policy=config.on_uncorrectable, record=config.record_events)
        self.active_faults: list[FaultSpec] = []
        self.injection_log: list[tuple[str, int, FaultPlan]] = []
        self.contexts: list[_ModuleContext] = []
        self.patched: list[torch.nn.Module] = []
        self.hooks: list[torch.utils.hooks.RemovableHandle] = []


def _checked_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
        # Protection is inference-only; compute the same values without autograd.
        warnings.warn("ft_transformers protection is inference-only: gradients do not flow through "
                      "checked Linear layers. Run under torch.no_grad() / torch.inference_mode().",
                      UserWarning, stacklevel=2)
        with torch.no_grad():
            return _checked_forward(self, x)
    ctx: _ModuleContext = self._ftt
    plan = ctx.plan_for_call()
    counters = ctx.counters(x.device)
    cfg = ctx.state.config
    y = _checked_linear_forward(
        x, self.weight, self.bias, weight_is_kn=ctx.layout == "kn", emax=cfg.emax, csigma=cfg.csigma,
        detect=ctx.detect, correct=ctx.correct, plan=plan, counters=counters, cache_owner=self,
    )
    ctx.after_call(counters)
    return y


def _state(model: torch.nn.Module) -> _ProtectionState:
    state = getattr(model, _STATE_ATTR, None)
    if state is None:
        raise ValueError(
            "this model is not protected: call ft_transformers.enable_fault_tolerance(model) first "
            "(use FTConfig(detect=False, correct=False) for an unprotected run with fault injection)"
        )
    return state


def enable_fault_tolerance(model: torch.nn.Module, config: FTConfig | None = None) -> torch.nn.Module:
    """Protect ``model`` in place and return it.

    Switches attention to ``"efta"`` and wraps every ``nn.Linear`` / ``Conv1D`` with a V-ABFT
    checked GEMM, per ``config`` (default `FTConfig()`). Calling it again replaces the earlier
    protection (so it is idempotent for the same config). Raises ValueError for model families
    without an adapter (the message names the supported ones).
    """
    from .patches import adapter_for

    config = config if config is not None else FTConfig()
    if not isinstance(config, FTConfig):
        raise TypeError(f"config must be an FTConfig, got {type(config).__name__}")
    adapter = adapter_for(model)
    original_attn = None
    if getattr(model, _STATE_ATTR, None) is not None:
        original_attn = _state(model).original_attn
        disable_fault_tolerance(model)
    if original_attn is None:
        original_attn = getattr(model.config, "_attn_implementation", None)

    state = _ProtectionState(config, original_attn)
    layers = None if config.layers is None else set(config.layers)

    def in_scope(layer: int) -> bool:
        return layers is None or layer in layers

    if config.attention and model.config._attn_implementation != ATTN_IMPLEMENTATION:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    for name, module in model.named_modules():
        layer = adapter.layer_of(name)
        if adapter.is_attention(module):
            ctx = _ModuleContext(state, state.recorder.add_slot(name, layer), True,
                                 config.attention and in_scope(layer))
        else:
            layout = adapter.linear_layout(module) if config.linear else None
            if layout is None:
                continue
            ctx = _ModuleContext(state, state.recorder.add_slot(name, layer), False, in_scope(layer), layout)
            module.forward = types.MethodType(_checked_forward, module)
            state.patched.append(module)
        module._ftt = ctx
        state.contexts.append(ctx)
    state.hooks.append(model.register_forward_hook(lambda *_: state.recorder.end_step()))
    setattr(model, _STATE_ATTR, state)
    return model


def disable_fault_tolerance(model: torch.nn.Module) -> torch.nn.Module:
    """Undo `enable_fault_tolerance`: original attention implementation and forwards restored."""
    state = getattr(model, _STATE_ATTR, None)
    if state is None:
        return model
    for h in state.hooks:
        h.remove()
    for module in state.patched:
        if "forward" in module.__dict__:
            del module.forward
    for module in model.modules():
        for attr in ("_ftt", "_ftt_vabft_checksums"):
            if attr in module.__dict__:
                delattr(module, attr)
    if state.original_attn and model.config._attn_implementation != state.original_attn:
        model.set_attn_implementation(state.original_attn)
    delattr(model, _STATE_ATTR)
    return model


def fault_report(model: torch.nn.Module) -> FTReport:
    """Everything detected / corrected / recomputed since protection was enabled or reset."""
    rec = _state(model).recorder
    return FTReport(rec.events(), rec, steps=rec.step)




def _protected_modules(model: torch.nn.Module) -> Sequence[str]:
    """Qualified names of the modules protection manages (attention and checked GEMMs)."""
    return [ctx.slot.name for ctx in _state(model).contexts]
