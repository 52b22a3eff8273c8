"""LongBench `qa_f1` metric as an `evaluate` module: `evaluate.load("<this file>")`.

The implementation lives in longbench_core.py (loaded alongside); see its docstrings.
"""

import evaluate

from .longbench_core import evaluate_compute, evaluate_info


class LongbenchQaF1(evaluate.Metric):
    def _info(self):
        return evaluate_info("qa_f1", self.config_name)

    def _compute(self, predictions, references, **kwargs):
        return evaluate_compute("qa_f1", predictions, references, **kwargs)
