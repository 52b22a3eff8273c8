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
CONFIG_INTERPRET = (16, 64, 32, 4, 1)  # BLOCK_N a multiple of the 64-column check groups
# The decode kernel (`decode.grouped_gemm_kernel`, one GROUP_COLS-column group per tile: BLOCK_N = GROUP_COLS);
# the first entry is also its config while injecting
CONFIGS_GROUPED = [(16, 64, 128, 4, 4), (16, 64, 256, 4, 3), (16, 64, 64, 4, 4), (16, 64, 128, 4, 3)]
CONFIG_INTERPRET_GROUPED = (16, 64, 32, 4, 1)
# The persistent form (`persistent._persistent_kernel`): the fastest config at every shape timed with
# `scripts/bench_gemm_forms.py`
PERSISTENT_CONFIG = (128, 256, 64, 8, 3)
PERSISTENT_CONFIG_INTERPRET = (32, 64, 32, 4, 1)
GROUP_M = 8  # row blocks that walk the column tiles together (grouped tile order)
# The group verification (`groups._group_verify_kernel`): (BLOCK_R rows, BLOCK_G groups, BLOCK_K, warps, stages)
# per program (BLOCK_R ≥ 16 and BLOCK_G ≥ 16: its checksum dots and recomputations use tl.dot)
VERIFY_BLOCK = (64, 32, 64, 4, 3)
