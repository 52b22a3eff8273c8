"""BERT: bidirectional self-attention with padding masks; encoder-only."""

from .adapter import FamilyAdapter

ADAPTER = FamilyAdapter(
    family="BERT",
    model_types=("bert",),
    attention_classes=("BertSelfAttention", "BertCrossAttention"),
    quirks="bidirectional attention, padding masks; pooler Linear checked too",
)
