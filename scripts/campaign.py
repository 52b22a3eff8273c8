#!/usr/bin/env python
"""Fault-injection campaigns: N trials with protection off and on, classified, stored in JSONL.

Same as the ``ftt-campaign`` console entry point (``ft_transformers.campaign.cli:main``).

    python scripts/campaign.py run --out out/smoke.jsonl --model tiny-llama --trials 20
    python scripts/campaign.py run --out out/c.jsonl --sites attn.scores linear.output \\
        --bits exponent mantissa --trials 300 --max-new-tokens 8 --report-dir out/report
    python scripts/campaign.py run --out out/on.jsonl --model smollm2 --uniform --arms on \
        --trials 10000 --max-new-tokens 4       # every site, module and bit equally likely; silent token changes
    python scripts/campaign.py resume out/c.jsonl            # after a kill: continues where it stopped
    python scripts/campaign.py report out/c.jsonl --out-dir out/report [--trial s0-t000042]
"""

from __future__ import annotations

import sys

from ft_transformers.campaign.cli import main

if __name__ == "__main__":
    sys.exit(main())
