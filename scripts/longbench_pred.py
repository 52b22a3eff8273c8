"""LongBench predictions (see ft_transformers/longbench/pred.py, docs/longbench.md); installed as the
console script ``ftt-longbench-pred``.

    python scripts/longbench_pred.py --data-dir DATA --tasks trec,samsum --mode efta --limit 5
    accelerate launch --multi_gpu --num_processes 8 scripts/longbench_pred.py --model ID --data-dir DATA
"""

import sys

from ft_transformers.longbench.pred import cli

if __name__ == "__main__":
    sys.exit(cli())
