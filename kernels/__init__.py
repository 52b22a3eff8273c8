"""Triton kernels of ft_transformers (installed as ``ft_transformers.kernels``)."""
