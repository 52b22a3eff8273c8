"""Block sizes of the checked GEMM, the one place: ``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)``.

The lists are the tuner's candidates (`tuning.pick_config`, which times them once per shape key on
CUDA); the single configs are the fixed ones of the forms that are not tuned (injection, the
interpreter, the persistent form). ``Options.gemm_config`` forces one config for every call.
"""

from __future__ import annotations

CONFIGS_LARGE = [(128, 256, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4), (256, 128, 64, 8, 3)]
CONFIGS_MID = [(64, 128, 64, 4, 4), (64, 256, 64, 8, 3)]  # 16 < M ≤ 64
# also timed for M > 64 when N ≤ NARROW_N: Qwen2-0.5B's k_proj/v_proj (N = 128) at M = 4096 have 32 row blocks of
# 128, one tile each, on a 132-SM GPU; the tuner then picks (64, 64, ...), 128 programs: 15.2 µs against 31.2 for
# its pick among CONFIGS_LARGE (cuBLAS 4.3 µs; one launch, CUDA graphs, H200)
CONFIGS_NARROW = [(64, 64, 64, 4, 4), (64, 128, 64, 4, 4)]
NARROW_N = 256
# M ≤ 16 (decode); the narrow tiles give more programs where N is small (896: 14 programs at BLOCK_N = 64)
CONFIGS_SMALL = [(16, 64, 128, 4, 4), (16, 128, 128, 4, 3), (16, 64, 256, 4, 3),
                 (16, 32, 256, 4, 3), (16, 16, 512, 4, 3)]
CONFIGS_FP32 = [(64, 64, 32, 4, 3), (128, 64, 32, 8, 3), (32, 64, 32, 4, 3)]  # IEEE fp32 FMAs
CONFIG_INJECT = (64, 64, 32, 4, 3)  # fixed while injecting (positions bucketed per row block)
CONFIG_INTERPRET = (16, 32, 32, 4, 1)
# The decode kernel (`decode.grouped_gemm_kernel`, one GROUP_COLS-column group per tile: BLOCK_N = GROUP_COLS);
# the first entry is also its config while injecting
CONFIGS_GROUPED = [(16, 64, 128, 4, 4), (16, 64, 256, 4, 3), (16, 64, 64, 4, 4), (16, 64, 128, 4, 3)]
CONFIG_INTERPRET_GROUPED = (16, 64, 32, 4, 1)
# The persistent form (`persistent._persistent_kernel`): the fastest config at every shape timed with
# `scripts/bench_gemm_forms.py`
PERSISTENT_CONFIG = (128, 256, 64, 8, 3)
PERSISTENT_CONFIG_INTERPRET = (32, 32, 32, 4, 1)
GROUP_M = 8  # row blocks that walk the column tiles together (grouped tile order)
VERIFY_ROWS = 32  # rows per verify program (≥ 16: its recompute uses tl.dot)
VERIFY_BLOCK = (64, 64)  # (BLOCK_N, BLOCK_K) of the verify kernel's repair/recompute loops
VERIFY_TILES = 16  # tiles' partial sums one verify load takes per row
# One launch: the last tile of each row block verifies that row block, ONE_LAUNCH_VERIFY_ROWS rows at a time (one
# program verifying the whole call was 4 % faster than two launches at M ≤ 16 on the H100 under CUDA graphs, but
# 10-50 % slower at M = 64-128)
ONE_LAUNCH_VERIFY_ROWS = 64
STATS_ROWS, STATS_COLS = 8, 256  # rows per program and K chunk of the persistent form's pass over x (`_stats_kernel`)
# that pass made by idle persistent programs: (BLOCK_M, SLACK_BLOCK_K) loads of x, SLACK_STAGES in flight
SLACK_BLOCK_K, SLACK_STAGES = 128, 4
