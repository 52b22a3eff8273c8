"""A whole LongBench task as an `evaluate` module.

    metric = evaluate.load("ft_transformers/longbench/metrics/longbench_score.py", config_name="hotpotqa")
    metric.compute(predictions=[...], references=[[...], ...], lengths=[...])

The config name is the task (``hotpotqa``, ``trec_e``, ...): it picks the task's metric and the
few-shot first-line rule; ``all_classes`` (trec, lsht) and ``lengths`` (LongBench-E buckets) are
keyword arguments. The implementation lives in longbench_core.py (loaded alongside).
"""

import evaluate

from .longbench_core import evaluate_compute, evaluate_info


class LongbenchScore(evaluate.Metric):
    def _info(self):
        return evaluate_info("task", self.config_name)

    def _compute(self, predictions, references, **kwargs):
        return evaluate_compute("task", predictions, references, config_name=self.config_name, **kwargs)
