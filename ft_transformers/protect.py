"""`enable_fault_tolerance` / `disable_fault_tolerance` / `fault_report` for a whole model.

Protection is applied in place: attention modules are switched to the ``"efta"`` attention
implementation and tagged with a `_ModuleContext`; every ``nn.Linear`` (and GPT-2 ``Conv1D``)
runs the checked GEMM as its forward: its class becomes a subclass whose forward it is
(`_CheckedLinear`, `_CheckedConv1D`; under an accelerate hook, the hook's inner forward is replaced
instead). Parameters and state dict stay untouched, and disabling restores the classes, so the
model is exactly what it was.

``torch.compile``: while Dynamo traces a protected model, each protected call goes through one
opaque custom op (``ftt::checked_linear_module`` here, ``ftt::efta_module`` in
`ft_transformers.attention`) that runs exactly the eager code, so the host-side branches of the
reference paths cause no graph breaks and the graph has one node per protected call. While
faults are being injected (`inject_faults`), the calls of the targeted modules run eagerly outside
the graph instead (the plan is host state that changes every call); Dynamo guards on the list of
active faults, so opening and closing an injection context recompiles once each way. What the
traced code reads of the protection is laid out so that the compiled model's guards stay few
(`ft_transformers._states`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import types
import weakref
from collections.abc import Iterator, Sequence

import torch
from transformers import PretrainedConfig
from transformers.pytorch_utils import Conv1D

from ._states import CACHE_OWNERS as _CACHE_OWNERS
from ._states import KEYS as _KEYS
from ._states import STATES as _STATES
from ._states import STATIC, Static, faults_may_hit, forget, spec_matches, static_of, step_block
from .attention import ATTN_IMPLEMENTATION
from .bypass import watch as _watch_bypass
from .checked_linear import _FAST_PATH_ATTR, _autocast_dtype, _checked_linear_forward
from .config import FTConfig
from .distributed import gather, is_sharded, local_shard, tp_forward_of, with_inner_forward
from .events import EventRecorder, FTReport, ModuleSlot
from .injection import FaultPlan, FaultSpec, check_ranks, derive_seed
from .kernels.options import options
from .model_hooks import end_step_hook, track_cache_hook
from .siblings import install_siblings, sibling_output

_STATE_ATTR = "_ftt_state"
_NO_FAULTS = FaultPlan(None)  # the plan of every call while no faults are active (never mutated)


class _ModuleContext:
    """Per protected module: its slot in the recorder, its settings, its call count."""

    def __init__(self, state: _ProtectionState, slot: ModuleSlot, is_attention: bool, protected: bool,
                 layout: str | None = None) -> None:
        cfg = state.config
        self.key = next(_KEYS)
        self.state_key = state.key
        self.slot = slot
        self.is_attention = is_attention
        self.detect = cfg.detect and protected
        self.correct = cfg.correct and protected
        self.pasa = cfg.pasa
        self.pasa_beta = cfg.pasa_beta
        self.layout = layout
        self.calls = 0
        self.sibling_key = None  # the key of the `siblings._SiblingGroup` this layer belongs to, if any
        self.sibling_index = 0
        self.publish()

    def publish(self) -> None:
        """Make this context's settings what compiled code reads (`_states.static_of`)."""
        STATIC[self.key] = Static(self.state_key, self.slot.index, self.slot.name, self.slot.layer, self.is_attention,
                                  self.detect, self.correct, self.layout == "kn", self.pasa, self.pasa_beta,
                                  self.sibling_key, self.sibling_index)

    @property
    def state(self) -> _ProtectionState:
        return _STATES[self.state_key]

    def _matches(self, spec: FaultSpec) -> bool:
        return spec_matches(static_of(self.key), spec)

    def plan_for_call(self) -> FaultPlan:
        """The faults of this forward call (advances the module's call count while faults are active).

        Call counts only matter while an `inject_faults` context is open (it resets them when it
        opens), so without active faults nothing is counted and the shared empty plan is returned:
        no host work and no Python state for a compiler to guard on.
        """
        if not self.state.active_faults:
            return _NO_FAULTS
        call = self.calls
        self.calls += 1
        specs = [s for s in self.state.active_faults
                 if self._matches(s) and (s.calls is None or call in s.calls)]
        plan = FaultPlan(specs, seed=derive_seed(self.slot.name, call))
        if specs:
            self.state.injection_log.append((self.slot.name, call, plan))
        return plan

    def counters(self, device: torch.device) -> torch.Tensor:
        """This module's (sites, kinds) int32 counter block of the current step on ``device``."""
        return self.state.recorder.counters(self.slot, device)

    def after_call(self, counters: torch.Tensor) -> None:
        if self.state.config.on_uncorrectable == "raise":
            EventRecorder.raise_if_uncorrectable(counters, self.slot.name)


class _ProtectionState:
    def __init__(self, config: FTConfig, original_attn: str | None) -> None:
        self.key = next(_KEYS)
        self.config = config
        self.original_attn = original_attn
        self.recorder = EventRecorder(policy=config.on_uncorrectable, record=config.record_events)
        self.active_faults: list[FaultSpec] = []
        self.injection_log: list[tuple[str, int, FaultPlan]] = []
        self.contexts: list[_ModuleContext] = []
        self.patched: list[torch.nn.Module] = []
        self.hooks: list[torch.utils.hooks.RemovableHandle] = []
        self.release: weakref.finalize | None = None  # drops its `_states` entries (`enable_fault_tolerance`)
        self.unchecked: dict[str, str] = {}  # module name -> why its product runs unchecked (`discovery`)

    def __reduce_ex__(self, protocol):
        _refuse_copy()

    def keys(self) -> list[int]:
        """Its entries in `_states`: the state's, the contexts', the sibling groups'."""
        groups = {c.sibling_key for c in self.contexts if c.sibling_key is not None}
        return [self.key, *(c.key for c in self.contexts), *groups]


def _refuse_copy(protocol: int | None = None):
    """``__reduce_ex__`` of a protected model, of its protection state and of each module holding a protected
    layer's context: pickling (``torch.save(model)``, multiprocessing) and ``copy.copy`` / ``copy.deepcopy`` of
    the model, or a deep copy or pickle of any part of it holding protected layers, stop here with the reason,
    instead of at whichever patched part pickle happens to reach first or, for a part, silently."""
    raise TypeError("a model with fault tolerance enabled, or a part of it holding protected layers, cannot be "
                    "pickled or copied (torch.save(model), copy.deepcopy, multiprocessing): its layers find their "
                    "counters and injected faults by keys of this process, and a copy would report into the "
                    "original's. Copy or pickle it before "
                    "enable_fault_tolerance, or disable_fault_tolerance, copy, and enable each; its weights "
                    "(model.state_dict(), save_pretrained) save as usual while it is protected")


def _own_config(model: torch.nn.Module) -> None:
    """Give ``model`` a config object of its own (a deep copy, its sub-configs included) before protection
    switches its attention implementation, which lives on the config. transformers hands every model built
    from one config object (``Model(cfg)``, ``from_config(cfg)`` twice) that same object: switching it would
    move the other models to EFTA as well, unprotected and unreported, and their own protection would then
    take EFTA for the implementation to restore. Every module whose ``config`` is the old object (or one of
    its sub-configs) is pointed at the copy."""
    old = model.config
    new = copy.deepcopy(old)
    swap = {id(old): new}
    for name, value in vars(old).items():
        if isinstance(value, PretrainedConfig):
            swap[id(value)] = getattr(new, name)
    for module in model.modules():
        held = module.__dict__.get("config")
        if held is not None and id(held) in swap:
            module.config = swap[id(held)]


def _checked_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``forward`` of a protected Linear / Conv1D: x (..., K) -> y (..., N)."""
    return _checked_call(self, x, self.weight, self.bias)


def _checked_shard_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The own forward of a protected tensor-parallel Linear, inside transformers' TP forward
    (`distributed.with_inner_forward`): x (..., K_local) -> y (..., N_local) on this rank's shard.

    transformers has made x and the parameters local (and hidden a rowwise layer's bias, added after the
    all-reduce), so a rowwise layer's partial product is verified here, before the reduction."""
    weight, bias = self.weight, self.bias
    if is_sharded(x) or is_sharded(weight):
        # A DTensor product would run through DTensor's own dispatch (its collectives included), not as this
        # rank's shard: there is no local product to check.
        raise RuntimeError(
            f"the tensor-parallel Linear {self._ftt.slot.name!r} was handed DTensors instead of local shards: "
            "transformers runs colwise / rowwise Linear layers on local shards only with grad mode off. Run the "
            "protected model under torch.no_grad() or torch.inference_mode() (model.generate does); other "
            "parallel styles of a Linear are not supported by protection")
    return _checked_call(self, x, local_shard(weight), local_shard(bias))


def _checked_call(self: torch.nn.Module, x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """The checked GEMM of a protected Linear / Conv1D with the given weight (N, K) or (K, N) and bias (N,)
    (the module's own, or their local shards): x (..., K) -> y (..., N)."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        # The checked GEMM has no backward: raise rather than hand out gradients that silently stop here.
        raise RuntimeError(
            f"ft_transformers protection is inference-only (no backward): the checked Linear "
            f"{self._ftt.slot.name!r} ran with grad mode on and an input or parameter requiring grad. Run "
            "the model under torch.no_grad() or torch.inference_mode() (model.generate does), or call "
            "model.requires_grad_(False)")
    st = static_of(self._ftt.key)
    y = sibling_output(st, x)
    if y is not None:  # computed with its siblings' by the parent (`ft_transformers.siblings`)
        return y
    if torch.compiler.is_compiling():
        if faults_may_hit(st) or _autocast_dtype(x.device.type) is not None:
            return _checked_forward_outside_graph(self, x, weight, bias)
        cfg = _STATES[st.state_key].config
        return torch.ops.ftt.checked_linear_module(
            x, weight, bias, step_block(st, x.device), st.index, id(self), st.kn, cfg.emax,
            float(cfg.csigma), st.detect, st.correct, cfg.on_uncorrectable == "raise", st.name)
    return _checked_forward_eager(self, x, weight, bias)


def _checked_forward_eager(module: torch.nn.Module, x: torch.Tensor, weight: torch.Tensor,
                           bias: torch.Tensor | None) -> torch.Tensor:
    """The protected GEMM as run eagerly: plan the call's faults, verify, count."""
    ctx: _ModuleContext = module._ftt
    plan = ctx.plan_for_call()
    counters = ctx.counters(x.device)
    cfg = ctx.state.config
    y = _checked_linear_forward(
        x, weight, bias, weight_is_kn=ctx.layout == "kn", emax=cfg.emax, csigma=cfg.csigma,
        detect=ctx.detect, correct=ctx.correct, plan=plan, counters=counters, cache_owner=module,
    )
    ctx.after_call(counters)
    return y


# Under torch.compile with faults active (or autocast): run the call eagerly, outside the graph.
_checked_forward_outside_graph = torch.compiler.disable(_checked_forward_eager)


class _CheckedLinear(torch.nn.Linear):
    """An ``nn.Linear`` while protected: its class is swapped to this one (the forward a class
    attribute, so a traced call takes ``self`` without the identity guard that a bound method stored on
    the instance costs) and back by `disable_fault_tolerance`; parameters and state dict untouched."""

    _ftt_base = torch.nn.Linear
    forward = _checked_forward


class _CheckedConv1D(Conv1D):
    """GPT-2's ``Conv1D`` while protected (see `_CheckedLinear`)."""

    _ftt_base = Conv1D
    forward = _checked_forward


_CHECKED_CLASSES = {torch.nn.Linear: _CheckedLinear, Conv1D: _CheckedConv1D}


@torch.library.custom_op("ftt::checked_linear_module", mutates_args=("step_counters",))
def _checked_linear_module_op(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, step_counters: torch.Tensor, slot: int,
    owner: int, weight_is_kn: bool, emax: float | None, csigma: float, detect: bool, correct: bool,
    raise_uncorrectable: bool, name: str,
) -> torch.Tensor:
    """A protected GEMM as one opaque op for compiled graphs (no fault injection).

    Args:
        x: (..., K); weight (N, K), or (K, N) with ``weight_is_kn``; bias (N,) or None.
        step_counters: (modules, sites, kinds) int32 counters of the step; row ``slot`` is added into.
        owner: ``id`` of the module (its weight checksums are cached on it).
    Returns:
        y (..., N) in x's dtype: what the eager protected forward returns.
    """
    counters = step_counters[slot]
    y = _checked_linear_forward(
        x, weight, bias, weight_is_kn=weight_is_kn, emax=emax, csigma=csigma, detect=detect, correct=correct,
        plan=None, counters=counters, cache_owner=_CACHE_OWNERS.get(owner),
    )
    if raise_uncorrectable:
        EventRecorder.raise_if_uncorrectable(counters, name)
    return y


@_checked_linear_module_op.register_fake
def _(x, weight, bias, step_counters, slot, owner, weight_is_kn, emax, csigma, detect, correct,
      raise_uncorrectable, name):
    n = weight.shape[1] if weight_is_kn else weight.shape[0]
    return x.new_empty((*x.shape[:-1], n))


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
    protection (so it is idempotent for the same config). What it protects is found in the model
    (`ft_transformers.discovery`): modules whose forward calls transformers' attention interface, and
    every Linear; modules that compute outside them (fused MoE experts) are named in a warning and
    in ``fault_report(model).unchecked``. Raises ValueError when no attention module is found (custom
    models: `register_family`) or the attention uses what EFTA does not compute (logit softcapping),
    and for ``config.layers`` naming a block the model does not have (the message names the valid
    range); the model is left as it was. A protected model is inference-only: its forward raises
    RuntimeError when grad mode is on and an input or parameter requires grad.
    """
    from .discovery import discover, warn_unchecked

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (a transformers model), got {type(model).__name__}")
    config = config if config is not None else FTConfig()
    if not isinstance(config, FTConfig):
        raise TypeError(f"config must be an FTConfig, got {type(config).__name__}")
    adapter = discover(model, require_attention=config.attention)
    config._check_layers({adapter.layer_of(name) for name, _ in model.named_modules()} - {-1})
    if config.linear:
        _check_tensor_parallel(model, adapter)
    original_attn = None
    if getattr(model, _STATE_ATTR, None) is not None:
        original_attn = _state(model).original_attn
        disable_fault_tolerance(model)
    if original_attn is None:
        original_attn = getattr(model.config, "_attn_implementation", None)

    state = _ProtectionState(config, original_attn)
    _STATES[state.key] = state
    layers = None if config.layers is None else set(config.layers)

    def in_scope(layer: int) -> bool:
        return layers is None or layer in layers

    if config.attention and model.config._attn_implementation != ATTN_IMPLEMENTATION:
        _own_config(model)
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
            _install_forward(module, _checked_forward, _CHECKED_CLASSES.get(type(module)))
            _CACHE_OWNERS[id(module)] = module
            state.patched.append(module)
        module._ftt = ctx
        # a copy would keep ctx's key, count into this model's report and read its injections; found before the
        # class's method, it stops pickle before any hook or patched forward of the module does
        module.__reduce_ex__ = _refuse_copy
        state.contexts.append(ctx)
    if config.linear:
        state.patched += install_siblings(model, adapter, _install_forward)  # (on local shards under TP)
        state.unchecked = {n: why for n, why in adapter.unchecked.items() if in_scope(adapter.layer_of(n))}
        warn_unchecked(state.unchecked)
    # its `_states` entries go when protection is disabled, or with the model if it is dropped protected
    state.release = weakref.finalize(model, forget, state.keys())
    state.recorder.prepare({p.device for p in model.parameters()} | {b.device for b in model.buffers()})
    state.hooks.append(model.register_forward_hook(end_step_hook(state.recorder)))
    state.hooks.append(_watch_bypass(model, state))  # attention leaving EFTA, modules swapped out
    if config.attention and config.detect and _kv_tables(model):
        # the caches generate hands the model keep EFTA's checksum tables, made as tokens enter them
        state.hooks.append(model.register_forward_pre_hook(track_cache_hook, with_kwargs=True))
    setattr(model, _STATE_ATTR, state)
    model.__reduce_ex__ = _refuse_copy  # (found before the class's: pickle and copy ask the instance)
    return model


def _kv_tables(model: torch.nn.Module) -> bool:
    """Whether a protected ``model``'s KV caches keep stored checksum tables (`Options.kv_tables`; auto:
    models on the CPU or on CUDA devices, where the tables' path is tested end to end and decode on
    stored tables is faster than with tables made per call; elsewhere tables are made per call)."""
    forced = options().kv_tables
    if forced is not None:
        return forced
    return all(p.device.type in ("cpu", "cuda") for p in model.parameters())


def _check_tensor_parallel(model: torch.nn.Module, adapter) -> None:
    """Raise ValueError, before anything is changed, for a Linear of ``model`` that holds DTensor parameters
    but does not run through transformers' TP forward (`distributed.tp_forward_of`): nothing would hand the
    checked GEMM local shards."""
    for name, module in model.named_modules():
        layout = adapter.linear_layout(module)
        if layout is None or not any(is_sharded(p) for p in module.parameters(recurse=False)):
            continue
        if layout != "nk" or tp_forward_of(module) is None:
            raise ValueError(
                f"{name} ({type(module).__name__}) holds DTensor parameters but does not run through "
                "transformers' tensor-parallel forward (from_pretrained with tp_plan): protection checks each "
                "rank's local shard inside that forward and supports no other sharding")


def _install_forward(module: torch.nn.Module, fn, swap: type | None = None) -> None:
    """Route ``module``'s calls through ``fn(module, ...)`` (the checked GEMM, a sibling parent's forward).

    ``swap``: a subclass of the module's class whose ``forward`` is ``fn`` (with ``_ftt_base`` naming the
    class): the module's class becomes it, unless the instance has a ``forward`` of its own. Otherwise
    ``fn`` is bound into the instance's ``forward``.

    A module that accelerate hooked (``device_map``, offloading) keeps its hook: ``fn`` replaces the
    hook's inner ``_old_forward``, so the hook still moves the input to the weight's device first
    (e.g. a tied ``lm_head`` whose weight sits on another GPU than the last block).

    A module sharded by transformers' tensor parallelism keeps its TP forward (local inputs and shards in,
    the rowwise all-reduce after): ``fn`` replaces the module's own forward inside it
    (`distributed.with_inner_forward`; the checked GEMM as `_checked_shard_forward`).
    """
    bound = types.MethodType(fn, module)
    tp_forward = tp_forward_of(module)
    if hasattr(module, "_hf_hook") and "_old_forward" in module.__dict__:
        module._ftt_inner_forward = module._old_forward
        module._old_forward = bound
    elif tp_forward is not None:
        inner = types.MethodType(_checked_shard_forward, module) if fn is _checked_forward else bound
        module._ftt_tp_forward = tp_forward
        module.forward = with_inner_forward(tp_forward, inner)
    elif swap is not None and "forward" not in module.__dict__:
        module.__class__ = swap
    else:
        module.forward = bound


def _uninstall_forward(module: torch.nn.Module) -> None:
    if "_ftt_inner_forward" in module.__dict__:
        module._old_forward = module.__dict__.pop("_ftt_inner_forward")
    elif "_ftt_tp_forward" in module.__dict__:
        module.forward = module.__dict__.pop("_ftt_tp_forward")
    elif "forward" in module.__dict__:
        del module.forward
    base = type(module).__dict__.get("_ftt_base")
    if base is not None:
        module.__class__ = base


def disable_fault_tolerance(model: torch.nn.Module) -> torch.nn.Module:
    """Undo `enable_fault_tolerance`: original attention implementation and forwards restored."""
    state = getattr(model, _STATE_ATTR, None)
    if state is None:
        return model
    for h in state.hooks:
        h.remove()
    for module in state.patched:
        _uninstall_forward(module)
        _CACHE_OWNERS.pop(id(module), None)
    for module in model.modules():
        for attr in ("_ftt", "_ftt_vabft_checksums", "_ftt_sibling_key", _FAST_PATH_ATTR, "__reduce_ex__"):
            if attr in module.__dict__:
                delattr(module, attr)
    if state.original_attn and model.config._attn_implementation != state.original_attn:
        model.set_attn_implementation(state.original_attn)
    delattr(model, _STATE_ATTR)
    state.release()  # (runs `forget` once and detaches the finalizer)
    return model


def fault_report(model: torch.nn.Module, *, all_ranks: bool = False) -> FTReport:
    """Everything detected / corrected / recomputed since protection was enabled or reset.

    Each event carries the torch.distributed rank of the process that recorded it (0 when not
    distributed). ``all_ranks=True`` gathers the reports of every rank of the default process group into
    one (`FTReport.merge`): a collective, so every rank must call it, and each rank receives the whole
    report. Nothing is gathered until then; the gathered report's ``reset`` forgets only that report
    (each rank resets its own with ``fault_report(model).reset()``).
    """
    if not isinstance(all_ranks, bool):
        raise TypeError(f"all_ranks must be a bool, got {type(all_ranks).__name__} {all_ranks!r}")
    state = _state(model)
    rec = state.recorder
    report = FTReport(rec.events(), rec, steps=rec.step, unchecked=state.unchecked)
    return FTReport.merge(gather(report)) if all_ranks else report



def _protected_modules(model: torch.nn.Module) -> Sequence[str]:
    """Qualified names of the modules protection manages (attention and checked GEMMs)."""
    return [ctx.slot.name for ctx in _state(model).contexts]


class FaultLog:
    """What `inject_faults` did: one record per targeted module call.

    ``records`` is a list of ``(module name, call index, FaultPlan)``; `injected` the number of
    bits flipped so far (reading it may synchronise in BER mode on the reference path).
    """

    def __init__(self, log: list, start: int = 0) -> None:
        self._log = log
        self._start = start

    @property
    def records(self) -> list:
        return self._log[self._start:]

    @property
    def injected(self) -> int:
        return sum(plan.injected for _, _, plan in self.records)

    @property
    def calls(self) -> int:
        return len(self.records)


@contextlib.contextmanager
def inject_faults(model: torch.nn.Module, spec: FaultSpec | Sequence[FaultSpec]) -> Iterator[FaultLog]:
    """Inject faults into a protected model's computation while the context is open.

    The model must have gone through `enable_fault_tolerance` (with ``FTConfig(detect=False,
    correct=False)`` for an unprotected run). ``FaultSpec.calls`` counts each targeted module's
    forward calls from the moment the context opens. ``FaultSpec.ranks`` limits a spec to those
    torch.distributed ranks: every rank opens the context with the same specs (they are checked
    everywhere), and a spec injects only on its ranks. Yields a `FaultLog` (this rank's injections).
    """
    state = _state(model)
    specs = [spec] if isinstance(spec, FaultSpec) else list(spec)
    mine = []  # the specs that inject on this rank (a rank the run lacks is refused before the context opens)
    for s in specs:
        if not isinstance(s, FaultSpec):
            raise TypeError(f"inject_faults takes FaultSpec(s), got {type(s).__name__}")
        if check_ranks(s):
            mine.append(s)
        if s.is_attention and model.config._attn_implementation != ATTN_IMPLEMENTATION:
            raise ValueError(f"cannot inject at {s.site}: attention is not running through EFTA "
                             "(enable_fault_tolerance with FTConfig(attention=True))")
        targets = [c for c in state.contexts if c._matches(s)]
        if not targets:
            raise ValueError(f"FaultSpec(site={s.site!r}, layers={s.layers}) matches no protected module "
                             "(wrong layer index or module name, or linear protection is off)")
        # every selector must hit something: a typo beside a valid entry would otherwise inject less
        # than asked, silently
        unmatched = [sel for sel in (s.layers or ()) if not any(
            c._matches(dataclasses.replace(s, layers=(sel,))) for c in targets)]
        if unmatched:
            kind = "attention" if s.is_attention else "Linear"
            have = sorted({c.slot.layer for c in state.contexts if c.is_attention == s.is_attention} - {-1})
            raise ValueError(f"FaultSpec(site={s.site!r}) layers {unmatched} match no protected {kind} module "
                             f"(protected blocks: {have}; module names must be qualified names)")
    for c in state.contexts:
        c.calls = 0
    start = len(state.injection_log)
    state.active_faults.extend(mine)
    try:
        yield FaultLog(state.injection_log, start)
    finally:
        for s in mine:
            state.active_faults.remove(s)
