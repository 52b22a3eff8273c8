"""One model family's facts that discovery cannot see (`ft_transformers.discovery` finds the rest)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from transformers import PretrainedConfig

Siblings = tuple[tuple[str, str, tuple[str, ...]], ...]


@dataclass(frozen=True)
class FamilyAdapter:
    """What `enable_fault_tolerance` needs to know about one family beyond what discovery finds.

    Attributes:
        family: short name shown to users.
        model_types: ``config.model_type`` values served.
        attention_classes: class names of attention modules whose ``forward`` reaches transformers'
            attention interface in a way discovery does not see (through a helper, say); protected
            in addition to the discovered ones. Each must pass itself as the interface's ``module``.
        siblings: ``(parent class name, input argument, Linear attribute names)`` of Linear layers that
            read one input (`ft_transformers.siblings`); a parent class named here replaces what
            discovery found for it.
        unsupported: ``config -> reason or None``: a configuration protection must refuse.
        quirks: one line on what is special in this family (shown in the README table).
    """

    family: str
    model_types: tuple[str, ...]
    attention_classes: tuple[str, ...] = ()
    siblings: Siblings = ()
    unsupported: Callable[[PretrainedConfig], str | None] | None = None
    quirks: str = ""
