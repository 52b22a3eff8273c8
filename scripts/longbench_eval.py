"""LongBench scoring and the clean / faulty / protected comparison (see scripts/longbench/eval.py).

    python scripts/longbench_eval.py --pred-dir out/longbench/<model-tag>
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from longbench.eval import main  # noqa: E402

if __name__ == "__main__":
    main()
