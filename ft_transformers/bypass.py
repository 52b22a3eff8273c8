"""No silent bypass: notice when a protected model's computation leaves protection.

Attention leaves EFTA when the attention function that transformers looks up for a module's config
(``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``) is no longer `efta_attention_forward`:
``model.set_attn_implementation(...)``, ``config._attn_implementation = ...``, a Hub kernel
(``load_and_register_attn_kernel``), a re-registration of ``"efta"``, or transformers' continuous
batching switching the model to a paged / flash implementation. A Linear (or any protected module)
leaves protection when it is replaced in its parent after `enable_fault_tolerance`.

What is watched, and what it costs on the hot path:

* per attention config (one per model, two for an encoder-decoder), a forward pre-hook on the first
  protected attention module that uses it compares one dict lookup with the EFTA function: a few µs
  per model call, no device work. While attention is off EFTA, every protected attention module of
  that config gets a forward hook that counts its call as unprotected unless EFTA ran in it (EFTA
  sets a flag on the module's context); the hooks go again when attention is back on EFTA;
* module replacement: a global module-registration hook of torch (it runs on ``parent.name = m``
  and ``add_module``), which does nothing unless a protected module is being replaced; the
  replacement then gets a forward hook counting its calls.

Counts are Python ints in the model's `EventRecorder` (`FTReport.unprotected`): no host sync.

Policy: one `UnprotectedWarning` per route and model, when the route is first seen (before the
unprotected computation of that call runs). ``FTConfig.on_uncorrectable`` is about faults the checks
found, so it is not reused here; to make a bypass an error, turn the warning into one::

    warnings.simplefilter("error", ft_transformers.bypass.UnprotectedWarning)

Continuous batching (``generate_batch``, ``init_continuous_batching``,
``continuous_batching_context_manager``) is refused on a protected model with a ``ValueError``:
transformers runs it over its paged cache with paged / flash attention kernels, which EFTA does not
implement, so it could only run unprotected.

Under ``torch.compile`` the check is traced with the model and compiles to nothing while attention
runs EFTA (it reads only what the attention call reads itself); once attention is off EFTA, the
counting hooks break the graph (a ``fullgraph=True`` compile then raises), so counts stay exact.
"""

from __future__ import annotations

import os
import sys
import warnings
import weakref
from collections.abc import Callable

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ._states import STATES
from .attention import efta_attention_forward
from .events import EventRecorder, ModuleSlot


class UnprotectedWarning(RuntimeWarning):
    """A protected model ran (part of) its computation outside protection."""


CONTINUOUS_BATCHING_ENTRY_POINTS = ("generate_batch", "init_continuous_batching",
                                    "continuous_batching_context_manager")
REPLACED = "module replaced after enable_fault_tolerance"

# state key -> its watch, while the protection lasts (the replacement hook finds watches here)
_WATCHES: weakref.WeakValueDictionary[int, _Watch] = weakref.WeakValueDictionary()
_REGISTRATION_HOOK: list = []


def attention_route(config) -> str | None:
    """``None`` when ``config``'s attention implementation runs EFTA, else the route's name."""
    impl = getattr(config, "_attn_implementation", None)
    try:
        fn = ALL_ATTENTION_FUNCTIONS[impl]
    except (KeyError, TypeError):
        fn = None
    if fn is efta_attention_forward:
        return None
    return f"attn_implementation={impl!r}" if fn is not None or impl != "efta" else "'efta' unregistered"


class _Group:
    """The protected attention modules that read one config: one check, counting hooks while bypassed."""

    def __init__(self, config, modules: list[tuple[torch.nn.Module, object]]) -> None:
        self.config = config
        self.modules = modules  # (module, its `_ModuleContext`)
        self.route: str | None = None  # the route now counted, None while on EFTA
        self.counting: list[torch.utils.hooks.RemovableHandle] = []


class _Watch:
    """Watches one protected model (see the module docstring); ``remove()`` ends it."""

    def __init__(self, model: torch.nn.Module, state) -> None:
        self.recorder: EventRecorder = state.recorder
        self.state_key = state.key
        layers = state.config.layers
        self.in_scope = lambda slot: layers is None or slot.layer in layers
        self.warned: set[str] = set()
        self.handles: list = []
        self.patched_entry_points: list[tuple[torch.nn.Module, str]] = []
        groups: dict[int, _Group] = {}
        if state.config.attention:
            for module in model.modules():
                ctx = module.__dict__.get("_ftt")
                if ctx is None or not ctx.is_attention or ctx.state_key != state.key or not self.in_scope(ctx.slot):
                    continue
                cfg = getattr(module, "config", None)
                group = groups.get(id(cfg))
                if group is None:
                    group = groups[id(cfg)] = _Group(cfg, [])
                group.modules.append((module, ctx))
        self.groups = list(groups.values())
        for group in self.groups:
            if group.config is None:
                # no config to check: whether EFTA ran is counted on every call
                self._start_counting(group, "attention outside EFTA")
            else:
                first = group.modules[0][0]
                self.handles.append(first.register_forward_pre_hook(self._checker(group)))
        for name in CONTINUOUS_BATCHING_ENTRY_POINTS:
            if hasattr(type(model), name) and name not in model.__dict__:
                model.__dict__[name] = _refusal(name)
                self.patched_entry_points.append((model, name))
        _WATCHES[self.state_key] = self
        _install_registration_hook()

    # -- attention -------------------------------------------------------------------------------
    def _checker(self, group: _Group) -> Callable:
        def check(module, args):
            # Traced too under torch.compile: on EFTA it reads only what the attention call itself reads
            # (the config's implementation, the registry entry) and compiles to nothing.
            route = attention_route(group.config)
            if route != group.route:
                self._switched(group, route)
        return check

    @torch.compiler.disable  # (hooks and warnings: eager code, run once per switch)
    def _switched(self, group: _Group, route: str | None) -> None:
        self._stop_counting(group)
        if route is not None:
            self._warn(route, f"attention of the protected model runs through {route}, not EFTA",
                       "switch back with model.set_attn_implementation('efta')")
            self._start_counting(group, route)

    def _start_counting(self, group: _Group, route: str) -> None:
        group.route = route
        recorder = self.recorder

        @torch.compiler.disable  # (compiled code breaks its graph here while attention is off EFTA)
        def count(module, args, output):
            ctx = module.__dict__.get("_ftt")
            if ctx is not None and not ctx.__dict__.pop("ran_efta", False):
                recorder.note_unprotected(ctx.slot, group.route)

        def count_eager(module, args, output):
            # EFTA's compiled op cannot set the flag: without a config to check, count in eager code only
            if not torch.compiler.is_compiling():
                count(module, args, output)
        hook = count if group.config is not None else count_eager
        for module, ctx in group.modules:
            ctx.__dict__.pop("ran_efta", None)  # (a flag left by calls made while nobody counted)
            group.counting.append(module.register_forward_hook(hook))

    @staticmethod
    def _stop_counting(group: _Group) -> None:
        for h in group.counting:
            h.remove()
        group.counting = []
        group.route = None

    # -- replaced modules --------------------------------------------------------------------------
    def replaced(self, slot: ModuleSlot, new: torch.nn.Module | None) -> None:
        """The protected module of ``slot`` was replaced by ``new`` (None: by nothing that runs)."""
        if not self.in_scope(slot):
            return
        self._warn(REPLACED, f"the protected module {slot.name!r} was replaced after enable_fault_tolerance",
                   "protect the replacement with ft_transformers.enable_fault_tolerance(model) again")
        if new is None:
            return
        recorder = self.recorder

        @torch.compiler.disable
        def count(module, args, output):
            recorder.note_unprotected(slot, REPLACED)
        self.handles.append(new.register_forward_hook(count))

    # -- both ------------------------------------------------------------------------------------------
    def _warn(self, route: str, what: str, fix: str) -> None:
        if route in self.warned:
            return
        self.warned.add(route)
        warnings.warn(f"ft_transformers: {what}; its calls run UNPROTECTED (counted in "
                      f"fault_report(model).unprotected): {fix}", UnprotectedWarning, stacklevel=_user_stacklevel())

    def remove(self) -> None:
        """End the watch: hooks removed, continuous batching entry points given back."""
        for group in self.groups:
            self._stop_counting(group)
        for h in self.handles:
            h.remove()
        self.handles = []
        for model, name in self.patched_entry_points:
            model.__dict__.pop(name, None)
        self.patched_entry_points = []
        if _WATCHES.get(self.state_key) is self:
            del _WATCHES[self.state_key]


def watch(model: torch.nn.Module, state) -> _Watch:
    """Start watching the protected ``model`` (its `protect._ProtectionState` ``state``) for bypasses.

    Returns the watch; its ``remove()`` (called by `disable_fault_tolerance` with the other hooks) ends it.
    """
    return _Watch(model, state)


def _refusal(name: str) -> Callable:
    def refuse(*args, **kwargs):
        raise ValueError(
            f"ft_transformers: model.{name}(...) (continuous batching) cannot run on a protected model: "
            "transformers runs continuous batching over its paged KV cache with paged / flash attention "
            "kernels, which EFTA does not implement (on a GPU it switches the model to flash attention with "
            "only a log line), so the model would run unprotected. Use model.generate(...) with a padded "
            "batch, which runs protected, or call ft_transformers.disable_fault_tolerance(model) first to "
            "run continuous batching unprotected.")
    refuse.__name__ = name
    return refuse


def _on_module_registration(parent: torch.nn.Module, name: str, value: torch.nn.Module | None) -> None:
    """torch's global module-registration hook: ``parent.name = value`` is about to happen."""
    # the parent's own slot first: a fresh container filling empty slots (``self.layers[:n]`` under
    # torch.compile, traced) never reads the global weak dictionary, whose size dynamo would guard on
    # while the garbage collector may change it (a guard failing on its own frame)
    old = parent.__dict__.get("_modules", {}).get(name)
    if old is None or old is value or not _WATCHES:
        return None
    for rel, sub in old.named_modules():
        ctx = sub.__dict__.get("_ftt")
        if ctx is None or ctx.state_key not in STATES:
            continue
        w = _WATCHES.get(ctx.state_key)
        if w is None:
            continue
        new = None
        if value is not None:
            try:
                new = value.get_submodule(rel) if rel else value
            except AttributeError:
                new = None
        new_ctx = None if new is None else new.__dict__.get("_ftt")
        if new_ctx is not None and new_ctx.state_key == ctx.state_key:
            continue  # a protected module moved within its model: still protected
        w.replaced(ctx.slot, new)
    return None  # (a value returned would replace the module being registered)


_LIBRARY_DIRS = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, sys.modules["transformers"]))
_OWN_DIR = os.path.dirname(__file__) + os.sep


def _user_stacklevel() -> int:
    """The ``stacklevel`` of `_Watch._warn`'s warning that names the user's line (first frame outside
    torch, transformers and this library)."""
    frame, level = sys._getframe(2), 2  # (the caller of `_warn`)
    while frame is not None and frame.f_code.co_filename.startswith((*_LIBRARY_DIRS, _OWN_DIR)):
        frame, level = frame.f_back, level + 1
    return level


def _install_registration_hook() -> None:
    if not _REGISTRATION_HOOK:
        _REGISTRATION_HOOK.append(
            torch.nn.modules.module.register_module_module_registration_hook(_on_module_registration))
