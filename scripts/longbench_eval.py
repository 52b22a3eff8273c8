"""LongBench scoring and the clean / faulty / protected comparison (see ft_transformers/longbench/eval.py);
installed as the console script ``ftt-longbench-eval``.

    python scripts/longbench_eval.py --pred-dir out/longbench/<model-tag>
"""

import sys

from ft_transformers.longbench.eval import cli

if __name__ == "__main__":
    sys.exit(cli())
