"""T5: additive relative ``position_bias`` with ``scaling=1.0``; encoder, decoder, cross-attention."""

from .adapter import FamilyAdapter

ADAPTER = FamilyAdapter(
    family="T5",
    model_types=("t5",),
    attention_classes=("T5Attention",),
    quirks="position_bias passed as an additive bias, scale 1.0; cross-attention",
)
