"""One model family's description: which modules are attention, which Linear layers share an input."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from transformers.pytorch_utils import Conv1D

_LAYER_RE = re.compile(r"(?:^|\.)(?:h|layers|layer|block)\.(\d+)(?:\.|$)")


@dataclass(frozen=True)
class FamilyAdapter:
    """What `enable_fault_tolerance` needs to know about one model family.

    Attributes:
        family: short name shown to users.
        model_types: ``config.model_type`` values served.
        attention_classes: class names of the modules that call the attention interface.
        quirks: one line on what is special in this family (shown in the README table).
        siblings: ``(parent class name, input argument, layer attribute names)`` of the Linear layers
            that read one input (`ft_transformers.siblings`: checked in one launch on the GPU).
    """

    family: str
    model_types: tuple[str, ...]
    attention_classes: tuple[str, ...]
    quirks: str = ""
    siblings: tuple[tuple[str, str, tuple[str, ...]], ...] = ()

    def is_attention(self, module: torch.nn.Module) -> bool:
        return type(module).__name__ in self.attention_classes

    @staticmethod
    def linear_layout(module: torch.nn.Module) -> str | None:
        """``"nk"`` for ``nn.Linear`` (weight (N, K)), ``"kn"`` for GPT-2 ``Conv1D``, else None."""
        if isinstance(module, Conv1D):
            return "kn"
        if type(module) is torch.nn.Linear:
            return "nk"
        return None

    @staticmethod
    def layer_of(name: str) -> int:
        """Transformer block index from a qualified module name (-1 outside the blocks)."""
        m = _LAYER_RE.search(name)
        return int(m.group(1)) if m else -1
