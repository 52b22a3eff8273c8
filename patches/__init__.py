"""Per-family facts discovery cannot see, and `register_family` for users' own models.

`ft_transformers.discovery` finds attention modules, checked GEMMs and sibling groups in any model
whose attention goes through transformers' attention interface; a `FamilyAdapter` adds what it
cannot see. Built-in families are the modules of this package that define ``ADAPTER``; a family
registered with `register_family` takes precedence over a built-in one for the same model type.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from collections.abc import Callable, Iterable

import torch
from transformers import PretrainedConfig

from .adapter import FamilyAdapter, Siblings

__all__ = ["FamilyAdapter", "adapter_for", "register_family", "registered_families"]

_REGISTERED: dict[str, FamilyAdapter] = {}  # model_type -> adapter, from register_family


@functools.cache
def _builtin() -> list[FamilyAdapter]:
    """The ``ADAPTER`` of each family module of this package (none is needed by the families tested)."""
    found = []
    for info in pkgutil.iter_modules(__path__):
        if info.name != "adapter":
            adapter = getattr(importlib.import_module(f"{__name__}.{info.name}"), "ADAPTER", None)
            if isinstance(adapter, FamilyAdapter):
                found.append(adapter)
    return found


def registered_families() -> list[FamilyAdapter]:
    """The adapters in force: registered ones first, then built-in ones."""
    seen, out = set(), []
    for a in [*_REGISTERED.values(), *_builtin()]:
        if id(a) not in seen:
            seen.add(id(a))
            out.append(a)
    return out


def adapter_for(model: torch.nn.Module) -> FamilyAdapter | None:
    """The adapter registered for ``model.config.model_type``, or None (discovery alone)."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in _REGISTERED:
        return _REGISTERED[model_type]
    return next((a for a in _builtin() if model_type in a.model_types), None)


def _names(value: Iterable[str | type] | str | type, what: str) -> tuple[str, ...]:
    items = [value] if isinstance(value, (str, type)) else list(value)
    out = tuple(v.__name__ if isinstance(v, type) else v for v in items)
    if not all(isinstance(v, str) and v for v in out):
        raise TypeError(f"register_family: {what} must be non-empty strings or classes, got {items!r}")
    return out


def register_family(
    model_types: str | Iterable[str],
    *,
    attention_classes: str | type | Iterable[str | type] = (),
    siblings: Iterable[tuple[str | type, str, Iterable[str]]] = (),
    unsupported: Callable[[PretrainedConfig], str | None] | None = None,
    family: str | None = None,
    quirks: str = "",
) -> FamilyAdapter:
    """Register what automatic discovery cannot see about a model family; returns its adapter.

    `enable_fault_tolerance` protects, in any model, the modules whose ``forward`` calls
    transformers' attention interface (``ALL_ATTENTION_FUNCTIONS``) and every ``nn.Linear`` /
    ``Conv1D``. Register a family when that is not enough:

    Args:
        model_types: the ``config.model_type`` value(s) this applies to.
        attention_classes: attention module classes (or class names) to protect that discovery
            misses, e.g. a forward that reaches the attention interface through a helper method. Their
            call must go through transformers' attention interface (so that ``"efta"`` runs it) with
            the module itself as the ``module`` argument.
        siblings: ``(parent class or name, input argument name, (Linear attribute names...))``: Linear
            layers that read the parent forward's input ``argument`` unchanged, checked in one launch
            on the GPU (e.g. ``("MyAttention", "hidden_states", ("q", "k", "v"))``).
        unsupported: ``config -> reason or None``; a reason makes `enable_fault_tolerance` refuse the
            model with a ValueError quoting it.
        family: the name shown to users (default: the first model type).
        quirks: a line on what is special in the family.

    Registering a model type again replaces its earlier registration.
    """
    types_ = _names(model_types, "model_types")
    if not types_:
        raise ValueError("register_family: model_types is empty")
    sib: Siblings = ()
    for entry in siblings:
        try:
            parent, arg, names = entry
        except (TypeError, ValueError):
            raise TypeError(f"register_family: each sibling group is (parent class, argument, names), got {entry!r}"
                            ) from None
        names = _names(names, "sibling names")
        if len(names) < 2 or not isinstance(arg, str) or not arg:
            raise ValueError(f"register_family: a sibling group needs an argument name and two or more "
                             f"Linear names, got {entry!r}")
        sib += ((_names(parent, "sibling parent")[0], arg, names),)
    if unsupported is not None and not callable(unsupported):
        raise TypeError("register_family: unsupported must be a callable config -> reason or None")
    adapter = FamilyAdapter(family=family or types_[0], model_types=types_,
                            attention_classes=_names(attention_classes, "attention_classes"), siblings=sib,
                            unsupported=unsupported, quirks=quirks)
    for t in types_:
        _REGISTERED[t] = adapter
    return adapter
