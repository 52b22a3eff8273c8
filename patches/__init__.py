"""Per-family adapters: which modules of a model are attention, which are checked GEMMs.

Each family module (`gpt2`, `bert`, `t5`, `qwen2`, `llama`) defines ``ADAPTER``, a
`FamilyAdapter`. `adapter_for` picks one by ``model.config.model_type``.
"""

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


def _adapters() -> list[FamilyAdapter]:
    from . import bert, gpt2, llama, qwen2, t5

    return [gpt2.ADAPTER, bert.ADAPTER, t5.ADAPTER, qwen2.ADAPTER, llama.ADAPTER]


def supported_model_types() -> list[str]:
    return [t for a in _adapters() for t in a.model_types]


def adapter_for(model: torch.nn.Module) -> FamilyAdapter:
    """The adapter for ``model`` or a ValueError naming the supported families."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    for a in _adapters():
        if model_type in a.model_types:
            return a
    raise ValueError(
        f"ft_transformers does not support model_type {model_type!r} "
        f"({type(model).__name__}); supported families: {', '.join(supported_model_types())}"
    )
