"""LongBench v1 / LongBench-E tooling for ft_transformers: prediction (`pred`), scoring (`eval`),
the protocol (`protocol`), data loading (`data`), shard/merge I/O (`shards`) and the metrics
(`metrics`, also loadable as `evaluate` modules)."""
