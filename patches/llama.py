"""Llama (and SmolLM2, which loads as Llama): grouped-query attention, RoPE applied before attention."""

from .adapter import FamilyAdapter

ADAPTER = FamilyAdapter(
    family="Llama",
    model_types=("llama",),
    attention_classes=("LlamaAttention",),
    quirks="GQA without repeat_kv; SmolLM2 (GGUF) loads as this family",
    siblings=(("LlamaAttention", "hidden_states", ("q_proj", "k_proj", "v_proj")),
              ("LlamaMLP", "x", ("gate_proj", "up_proj"))),
)
