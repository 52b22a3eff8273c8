"""LongBench `rouge_zh` metric as an `evaluate` module: `evaluate.load("<this file>")`.

The implementation lives in longbench_core.py (loaded alongside); see its docstrings.
"""

import evaluate

from .longbench_core import evaluate_compute, evaluate_info


class LongbenchRougeZh(evaluate.Metric):
    def _info(self):
        return evaluate_info("rouge_zh", self.config_name)

    def _compute(self, predictions, references, **kwargs):
        return evaluate_compute("rouge_zh", predictions, references, **kwargs)
