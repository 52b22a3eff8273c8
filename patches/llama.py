"""Llama (and SmolLM2, which loads as Llama): grouped-query attention, RoPE applied before attention."""

from . import FamilyAdapter

ADAPTER = FamilyAdapter(
    family="Llama",
    model_types=("llama",),
    attention_classes=("LlamaAttention",),
    quirks="GQA without repeat_kv; SmolLM2 (GGUF) loads as this family",
)
