"""What compiled graphs read of protection: the models' states and the modules' static settings, by key.

``torch.compile`` guards everything a traced forward reads, on every call of the compiled model. Two
things made a protected model's guard evaluation take ~4× the unprotected one's per decode step (1.24
against 0.30 ms on an H200 host):

* an object reached along two paths costs a Python identity guard per path (the model's state through
  every module's context: ``a._ftt.state is b._ftt.state``, ~660 such guards for a 24-layer Qwen2), so
  a context reaches its model's state as ``STATES[state_key]``, one global;
* every setting read from a context (slot, name, detect, correct, layout, …) costs a guard per module,
  so traced code reads them as one constant, `static_of` (``torch.compiler.assume_constant_result``),
  guarded by the context's key alone. Keys are never reused and an entry never changes once the model's
  protection is set up (`protect.enable_fault_tolerance` publishes it; a new protection has new keys).
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any, NamedTuple

import torch

STATES: dict[int, Any] = {}  # state key -> `protect._ProtectionState`
KEYS = itertools.count()  # state, context and sibling-group keys alike


class Static(NamedTuple):
    """A protected module's settings as compiled code reads them (`protect._ModuleContext`)."""

    state_key: int  # its model's `STATES` key
    index: int  # its counter slot
    name: str  # qualified module name
    layer: int  # transformer block (-1 outside the blocks)
    is_attention: bool
    detect: bool
    correct: bool
    kn: bool  # a (K, N) weight (GPT-2 Conv1D)
    pasa: bool
    pasa_beta: float | None
    sibling_key: int | None  # its `siblings._SiblingGroup`, if any
    sibling_index: int  # its place in the group's output


STATIC: dict[int, Static] = {}  # context key -> settings
GROUPS: dict[int, Any] = {}  # group key -> `siblings._SiblingGroup`
# id(module) -> module, for the compiled path's custom op to find the weight-checksum cache owner.
CACHE_OWNERS: weakref.WeakValueDictionary[int, torch.nn.Module] = weakref.WeakValueDictionary()


@torch.compiler.assume_constant_result
def static_of(key: int) -> Static:
    """The settings of the context with ``key``: a constant for ``torch.compile`` (no guard but the key's)."""
    return STATIC[key]


def spec_matches(st: Static, spec) -> bool:
    """Whether ``spec`` (a `FaultSpec`) targets the module with settings ``st``."""
    if spec.is_attention != st.is_attention:
        return False
    if spec.layers is None:
        return True
    for sel in spec.layers:
        if isinstance(sel, str):
            if st.name == sel or st.name.startswith(sel + "."):
                return True
        elif int(sel) == st.layer:
            return True
    return False


def faults_may_hit(st: Static) -> bool:
    """Whether an active `FaultSpec` targets the module with settings ``st`` (traced code's form)."""
    return any(spec_matches(st, s) for s in STATES[st.state_key].active_faults)


def step_block(st: Static, device: torch.device) -> torch.Tensor:
    """The (modules, sites, kinds) counters of the current step of ``st``'s model on ``device``."""
    return STATES[st.state_key].recorder.step_block(device)


def forget(keys: list[int]) -> None:
    """Drop the entries of a protection that ended (its state, context and group keys)."""
    for k in keys:
        STATES.pop(k, None)
        STATIC.pop(k, None)
        GROUPS.pop(k, None)
