"""GPT-2: fused ``c_attn`` projection and ``Conv1D`` layers (weight stored (K, N))."""

from .adapter import FamilyAdapter

ADAPTER = FamilyAdapter(
    family="GPT-2",
    model_types=("gpt2",),
    attention_classes=("GPT2Attention",),
    quirks="Conv1D weights stored (in, out): checksums taken over the transposed layout",
)
