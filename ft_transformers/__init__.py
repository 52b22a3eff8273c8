"""ft_transformers: fault-tolerant transformer inference for Hugging Face Transformers."""
