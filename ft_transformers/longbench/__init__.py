"""LongBench v1 / LongBench-E tooling for ft_transformers: prediction (`pred`, the console script
``ftt-longbench-pred``), scoring (`eval`, ``ftt-longbench-eval``), the protocol (`protocol`), data
loading (`data`), shard/merge I/O (`shards`), run comparison (`compare_runs`), compact model packs
(`pack`), versions and model loading (`runtime`) and the metrics (`metrics`, also loadable as
`evaluate` modules).

Its optional dependencies come with ``pip install 'ft-transformers[longbench]'``; ``import
ft_transformers`` does not import this subpackage.
"""
