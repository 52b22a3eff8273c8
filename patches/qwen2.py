"""Qwen2: grouped-query attention and (optional) sliding-window layers."""

from .adapter import FamilyAdapter

ADAPTER = FamilyAdapter(
    family="Qwen2",
    model_types=("qwen2",),
    attention_classes=("Qwen2Attention",),
    quirks="GQA without repeat_kv; sliding-window layers via the mask",
    siblings=(("Qwen2Attention", "hidden_states", ("q_proj", "k_proj", "v_proj")),
              ("Qwen2MLP", "x", ("gate_proj", "up_proj"))),
)
