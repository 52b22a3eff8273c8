"""Per-family adapters (installed as ``ft_transformers.patches``)."""
