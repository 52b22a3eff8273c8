"""Qwen2: grouped-query attention and (optional) sliding-window layers."""

from . import FamilyAdapter

ADAPTER = FamilyAdapter(
    family="Qwen2",
    model_types=("qwen2",),
    attention_classes=("Qwen2Attention",),
    quirks="GQA without repeat_kv; sliding-window layers via the mask",
)
