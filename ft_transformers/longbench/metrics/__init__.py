"""LongBench metrics: `longbench_core` (plain functions) and one `evaluate` module per metric
(`longbench_<metric>.py`, plus `longbench_score.py` for a whole task)."""
