"""LongBench `retrieval` metric as an `evaluate` module: `evaluate.load("<this file>")`.

The implementation lives in longbench_core.py (loaded alongside); see its docstrings.
"""

import evaluate

from .longbench_core import evaluate_compute, evaluate_info


class LongbenchRetrieval(evaluate.Metric):
    def _info(self):
        return evaluate_info("retrieval", self.config_name)

    def _compute(self, predictions, references, **kwargs):
        return evaluate_compute("retrieval", predictions, references, **kwargs)
