"""LongBench predictions (see scripts/longbench/pred.py, docs/longbench.md).

    python scripts/longbench_pred.py --data-dir DATA --tasks trec,samsum --mode efta --limit 5
    accelerate launch --multi_gpu --num_processes 8 scripts/longbench_pred.py --model ID --data-dir DATA
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from longbench.pred import main  # noqa: E402

if __name__ == "__main__":
    main()
