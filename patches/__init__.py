"""Per-family adapters: which modules of a model are attention, which are checked GEMMs.

Each family module (`gpt2`, `bert`, `t5`, `qwen2`, `llama`) defines ``ADAPTER``, a
`FamilyAdapter`. `adapter_for` picks one by ``model.config.model_type``.
"""

from __future__ import annotations

import torch

from .adapter import FamilyAdapter

__all__ = ["FamilyAdapter", "adapter_for", "supported_model_types"]


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
