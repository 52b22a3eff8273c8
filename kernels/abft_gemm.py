"""V-ABFT checked GEMM ``y = x·Wᵀ + b`` as a Triton kernel that verifies in its FP32 accumulators.

Contract: ``docs/algorithms.md`` ("V-ABFT checked linear") with the verification moved *before* the
output is rounded (seed 003, "online ABFT"): the row checksum is compared with the row sums of the
fp32 accumulator tiles, so the threshold's unit error is fp32-level (``default_emax(..., mode=
"accumulator")``, ~1e-6 instead of 2u of fp16/bf16). Same checks, same counters, same injection site
as the PyTorch path (`ft_transformers.checked_linear`, which stays the fallback and the oracle).

Design (one or two launches, no host synchronisation):

1. ``_gemm_kernel`` — a grouped-order tiled GEMM over (BLOCK_M × BLOCK_N) output tiles (T tiles
   per row block); operands come through TMA tensor descriptors on Hopper when their layout allows
   (unit inner stride, 16-byte aligned rows), through pointers otherwise:

   * fp32 accumulator ``acc`` (tensor cores for fp16/bf16, IEEE fp32 FMAs for fp32), bias added in
     fp32, rounded to y's dtype, flips of site ``linear.output`` applied to the *rounded* value (so
     bit positions mean what they mean on the reference path). The epilogue then reduces the
     tile's rows into two partial sums ``Σ_n v[m,n]`` and ``Σ_n (n+1)/N·v[m,n]`` (v = acc, or the
     flipped rounded value where a flip landed) into a (T, M, 2) fp32 buffer: two FMAs per output
     element, no atomics, a fixed summation order.
   * Checksums, shared out over the row block's tiles: tile ``pid_n`` also takes the K blocks
     ``kb ≡ pid_n (mod T)`` of the x tiles it has just loaded (again, from L2) and computes, in plain fp32 on the
     CUDA cores (no split operands, no extra tensor-core dot), partial ``x·w1`` and ``x·w2``
     (``w1 = Σ_n W[n,:]``, ``w2 = Σ_n (n+1)·W[n,:]``: the cached `WeightChecksums.w12`) and the
     row statistics of x (max, min, sum) for the V-ABFT threshold, into a (T, M, 8) buffer. Every
     element of x enters the checksums once, re-read from L2 right after the tile's own load, and
     no program is added: an earlier version ran separate checksum programs that re-read x from
     memory, and each held a GEMM-sized share of shared memory (one per SM) while doing little
     arithmetic; they cost up to 60 % at K-heavy shapes.

   Why not append ``w1``/``w2`` as extra output columns of the same GEMM: the checksum operand must
   keep fp32 accuracy, which in fp16/bf16 means splitting it into 2–3 slices of the input dtype
   (a second copy of every weight with extra columns, or a register-built split operand; the
   latter is what gives the EFTA kernel its wgmma false alarms on the H100). Here the checksum math
   is ordinary fp32 arithmetic on loaded values, and the tensor-core dot is the plain GEMM's.

2. ``_verify_kernel`` (one program per BLOCK_R rows): ``D1 = Σ_T partials − (x·w1 + b1)``, the
   per-row threshold ``T_m`` from x's statistics and the weight's cached constants (SPEC §5),
   ``|D1| > T_m`` or non-finite → ``detected``; ``t = D2/D1 ≈ n+1`` locates a single error, which
   is repaired by recomputing that element (one fp32 dot ``x[m]·W[n] + b[n]``) and re-verified (the
   row as stored against the output-side threshold, and in accumulator mode D1 with the repaired
   term against the accumulator-side one) → ``corrected``; other faulty rows are recomputed in the
   kernel (``x[m]·Wᵀ + b``), at most ``capacity`` (16) rows per call, claimed through one atomic on
   a per-call slot counter → ``recomputed``; the rest → ``uncorrectable``. Counters are atomics
   into the caller's (6, 5) int32 block. Non-finite x (found by the GEMM tiles) or W/b (known when
   the weight checksums were built) count one ``nonfinite_input`` and switch the call's checks
   off, as on the reference path.

   By default this launch is skipped (``FTT_ABFT_GEMM_ONE_LAUNCH=0`` keeps it): in each row block
   the GEMM tile that finishes last (a per-device semaphore per row block, reset by that program)
   runs the same verification over the row block's rows, and the last row block to be verified
   settles the call's counts (see `_gemm_kernel`). A call of one row block (decode) skips that last
   stage: its verifying program runs after every tile, so it verifies exactly as `_verify_kernel`
   does and counts straight into the caller's counters (0.6-1.3 µs less per decode call on the
   H100, ``docs/vabft.md``, session 22). The result and the counts are the two-launch path's; only
   a call of several row blocks with a non-finite x somewhere may get repairs in its other rows
   that the reference path (checks off for the whole call) does not make.

   Decode calls (one launch, one row block, M ≤ ``CSUM_ROWS``) move the checksums out of the tiles:
   ``n_csum`` extra programs, one per K chunk (`_csum_chunk`), compute ``x·w1``, ``x·w2`` and x's
   statistics while the tiles run the plain main loop and add their row sums into per-device cells
   (`_cells`); the last program to count verifies from those cells and the chunks' slots, so
   neither a share of the checksums in the K loop nor a walk over the T tiles' partials is left
   (1.2-2.3 µs of checks per decode call instead of 3.2-7.8, 9 µs instead of 91 for a 151,936-wide
   lm_head, on an H200: ``docs/vabft.md``, session 23). Where such a call has few tiles, each tile
   runs as several programs over parts of K (split-K, `_split_k`; the last one of a tile sums the
   fp32 partials in a fixed order before the epilogue): 10.0 instead of 14.1 µs at Qwen2-0.5B's
   1 × 896 × 4864 (session 24). The tuner times these calls in that form, each config with and
   without split-K, over copies of the weight past L2.

   Batch-1 decode calls (M = 1, at most ``GROUPED_MAX_TILES`` tiles) take neither form: the decode kernel
   (`abft_decode`) checks each 64-column tile against its own column-group checksum in the tile's
   epilogue, with no cross-program step (0.5-1.2 µs of checks per call instead of 1.6-1.9, H200,
   session 27).

3. The persistent form (wide calls, `_persistent_ok`; ``FTT_ABFT_GEMM_PERSISTENT``): one pass over x for
   ``x·w1``, ``x·w2`` and x's statistics (one statistics slot instead of the tiles' shares),
   ``_persistent_kernel`` runs the GEMM as one program per SM over TMA descriptors made in the kernel
   with nothing but the row sums in its epilogue, and ``_verify_kernel`` verifies as above. The pass runs
   in the GEMM's programs that the last wave of tiles leaves idle where they have room (`_slack_stats`,
   `_stats_block`), else as a launch before it (``_stats_kernel``). In Triton 3.6 any checksum work
   inside the K loop cost 5-50 % (session 31), where the plain persistent GEMM runs at 0.89-1.01× cuBLAS.

Block sizes: the ``CONFIGS_*`` lists below are the only place; ``_pick_config`` times the
candidates (GPU time, `tl_common.gpu_time`) once per (dtype, layout, flags, M bucket, N, K) on CUDA
and caches the winner (set
``FTT_ABFT_GEMM_CONFIG=BM,BN,BK,warps,stages`` to force one, ``FTT_ABFT_GEMM_TUNE=0`` to take each
list's first entry without timing). While injecting, a fixed config is used
(flip positions are bucketed per row block). Under ``TRITON_INTERPRET=1`` (CPU tensors) one small
fixed config runs, and dots of fp16/bf16 operands are taken in fp32 (exact products, fp32 sums:
the GPU's semantics).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # pragma: no cover - exercised only where triton is missing
    raise ImportError("ft_transformers.kernels.abft_gemm needs triton") from exc

from ..checked_linear import _FAST_PATH_ATTR, _autocast_dtype
from .contract import new_counters
from ..injection import FaultPlan
from .contract import COUNTER_SHAPE, KIND_INDEX, SITE_INDEX
from ..vabft import WeightChecksums, default_emax, weight_checksums
from .abft_decode import GROUP_COLS, GROUP_CONSTS, group_checksums, grouped_gemm_kernel, k_blocks, round_and_inject
from .launch import DirectLauncher, record_launches, replay_launches
from .tl_common import call_flag, env_get, env_reader, gpu_time, on_tensor_device, runs_interpreted, sm_count
from .tl_common import cdiv as _cdiv
from .tl_common import dot as _mma

__all__ = [
    "AbftGemmUnsupported",
    "CONFIGS_LARGE",
    "CONFIGS_SMALL",
    "checked_gemm",
    "checked_gemm_siblings",
    "checked_linear_triton_forward",
    "gemm_residuals",
    "interpreting",
]

SITE = "linear.output"
RECOMPUTE_ROWS = 16  # = checked_linear.RECOMPUTE_ROWS (kept equal by a test)
LOCATE_TOL = 0.25
MODES = ("accumulator", "output")
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_STATS_W = 8  # fp32 per row in the stats buffer: c1, c2, max, min, sum, (pad)

_SITE_ROW = tl.constexpr(SITE_INDEX[SITE])
_DET, _COR, _REC, _UNC, _NONF = (tl.constexpr(KIND_INDEX[k]) for k in
                                 ("detected", "corrected", "recomputed", "uncorrectable", "nonfinite_input"))


class AbftGemmUnsupported(ValueError):
    """The Triton kernel cannot run this call (wrong device, dtype or layout)."""


# ------------------------------------------------------------------------------------------------
# Configs (the one place): (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
# ------------------------------------------------------------------------------------------------

CONFIGS_LARGE = [(128, 256, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4), (256, 128, 64, 8, 3)]
CONFIGS_MID = [(64, 128, 64, 4, 4), (64, 256, 64, 8, 3)]  # 16 < M ≤ 64
# also timed for M > 64 when N ≤ NARROW_N: Qwen2-0.5B's k_proj/v_proj (N = 128) at M = 4096 have 32 row blocks of
# 128, one tile each, on a 132-SM GPU; the tuner then picks (64, 64, ...), 128 programs: 15.2 µs against 31.2 for
# its pick among CONFIGS_LARGE (cuBLAS 4.3 µs; one launch, CUDA graphs, H200, session 30)
CONFIGS_NARROW = [(64, 64, 64, 4, 4), (64, 128, 64, 4, 4)]
NARROW_N = 256
# M ≤ 16 (decode); the narrow tiles give more programs where N is small (896: 14 programs at BLOCK_N = 64)
CONFIGS_SMALL = [(16, 64, 128, 4, 4), (16, 128, 128, 4, 3), (16, 64, 256, 4, 3),
                 (16, 32, 256, 4, 3), (16, 16, 512, 4, 3)]
CONFIGS_FP32 = [(64, 64, 32, 4, 3), (128, 64, 32, 8, 3), (32, 64, 32, 4, 3)]  # IEEE fp32 FMAs
CONFIG_INJECT = (64, 64, 32, 4, 3)  # fixed while injecting (positions bucketed per row block)
CONFIG_INTERPRET = (16, 32, 32, 4, 1)
# The decode kernel (`abft_decode`, M ≤ CSUM_ROWS, one GROUP_COLS-column group per tile: BLOCK_N = GROUP_COLS);
# the first entry is also its config while injecting
CONFIGS_GROUPED = [(16, 64, 128, 4, 4), (16, 64, 256, 4, 3), (16, 64, 64, 4, 4), (16, 64, 128, 4, 3)]
CONFIG_INTERPRET_GROUPED = (16, 64, 32, 4, 1)
# ... for calls of at most GROUPED_MAX_ROWS rows (batch-1 decode) and GROUPED_MAX_TILES tiles. Measured on an H200
# (session 27, tuned): at M = 1 it beat the row-checked one-launch form at every Qwen2-0.5B layer shape (0.7-1.4 µs
# less per call); at M = 16 it lost (10.1 against 8.9 µs at 16 × 4864 × 896: the tuner's pick; the first config
# alone took 7.8); and a tile's own verification costs it ~1 µs after its loop, which a call of many waves of tiles
# pays per wave (a 151,936-wide lm_head: 100 µs against 74 µs with rows checked)
GROUPED_MAX_ROWS = 1
GROUPED_MAX_TILES = 1024
GROUP_M = 8
VERIFY_ROWS = 32  # rows per verify program (≥ 16: its recompute uses tl.dot)
VERIFY_BLOCK = (64, 64)  # (BLOCK_N, BLOCK_K) of the verify kernel's repair/recompute loops
VERIFY_TILES = 16  # tiles' partial sums one verify load takes per row
# One launch: the last tile of each row block verifies that row block, ONE_LAUNCH_VERIFY_ROWS rows at a time
# (an earlier form, one program verifying the whole call, was 4 % faster than two launches at M ≤ 16 on the
# H100 under CUDA graphs, but 10-50 % slower at M = 64-128); calls of more row blocks than the per-device
# cells hold take two launches.
ONE_LAUNCH_VERIFY_ROWS = 64
ONE_LAUNCH_ROW_BLOCKS = 8192
# Decode (one launch, one row block, M ≤ CSUM_ROWS): checksum programs beside the tiles (`_csum_chunk`),
# each taking CSUM_ELEMS elements of x (a K chunk of CSUM_ELEMS / next_pow2(M)) in one load
CSUM_ROWS = 16
CSUM_ELEMS = 4096
# Split-K for those calls (`_split_k`): each tile's K blocks over up to SPLIT_PROGRAMS_PER_SM · SMs / T programs
# of at least SPLIT_MIN_BLOCKS K blocks (896-wide decode GEMMs have 14 tiles at BLOCK_N = 64: 14 busy SMs without
# it); none past SPLIT_MAX_TILES tiles (< ONE_LAUNCH_ROW_BLOCKS: the tiles' split counts use those cells). The tuner
# times every decode config with and without it.
SPLIT_PROGRAMS_PER_SM = 1
SPLIT_MIN_BLOCKS = 2
SPLIT_MAX_TILES = 1024
INTERPRET_SMS = 4  # the SM count split-K assumes under the interpreter
# The tuner times a decode call (M ≤ CSUM_ROWS) over copies of its weight, up to TUNE_STREAM_COPIES and past
# TUNE_STREAM_BYTES (more than an H100's or H200's L2), as a model streams its layers' weights: timed on one
# L2-resident weight, its picks were up to 15 % slower than the first config at decode shapes (session 24)
TUNE_STREAM_BYTES = 120_000_000
TUNE_STREAM_COPIES = 8
PREPARED_PER_WEIGHT = 64  # prepared call signatures kept per weight (`_PreparedCall`)
# Persistent form (`_persistent_ok`): wide calls (N ≥ PERSISTENT_MIN_N, M·N·K ≥ PERSISTENT_MIN_MNK) on Hopper run
# a pass over x for the checksums and statistics, a persistent TMA GEMM (one program per SM) whose tiles only add
# their row sums, and the verify launch. On an H100 the persistent TMA plain
# GEMM reached 0.89-1.01× cuBLAS where the tile kernel reached 0.68-0.78, and every form of the checksum share
# inside its K loop cost 5-50 %; the pass reads x once more (1.3-1.8 TB/s), which only a wide N amortises
# (session 31, `scripts/bench_gemm_forms.py`, docs/vabft.md). Since session 32 the GEMM's programs with a tile
# fewer make that pass after their tiles where they have room (`_slack_stats`): on an H200 under CUDA graphs,
# 4096³ went from 0.85 / 0.83× cuBLAS (fp16 / bf16) to 0.91 / 0.90×.
PERSISTENT_CONFIG = (128, 256, 64, 8, 3)  # BM, BN, BK, warps, stages: the fastest at every session-31 shape
PERSISTENT_CONFIG_INTERPRET = (32, 32, 32, 4, 1)
PERSISTENT_MIN_N = 2048
PERSISTENT_MIN_MNK = 1 << 34
STATS_ROWS, STATS_COLS = 8, 256  # rows per program and K chunk of its pass over x (`_stats_kernel`)
SLACK_ROW_BLOCKS = 2  # row blocks of x per idle persistent program, at most, for the pass there (`_slack_stats`)
SLACK_BLOCK_K, SLACK_STAGES = 128, 4  # its loads of x: (BLOCK_M, SLACK_BLOCK_K) blocks, SLACK_STAGES in flight
_TUNE_CACHE: dict[tuple, tuple] = {}  # key → config (5 entries, or 6 with False: no split-K)


# ------------------------------------------------------------------------------------------------
# Kernels
# ------------------------------------------------------------------------------------------------


@triton.jit
def _gemm_tile(X, W, Y, Xd, Wd, Yd, Bias, W12, P, S, Acc, Inj, Flag, Part, Tcnt, pid_m, pid_n, split, kb_per,
               num_pid_m, num_pid_n, offs_m, offs_am, m_ok, M, N, K, sxm, sxk, swn, swk, sym, syn, inv_n, call_id,
               n_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               HAS_BIAS: tl.constexpr, DETECT: tl.constexpr, VERIFY_OUTPUT: tl.constexpr,
               INJ: tl.constexpr, DOT_F32: tl.constexpr, EVEN_K: tl.constexpr,
               TMA: tl.constexpr, W_KN: tl.constexpr, TMA_STORE: tl.constexpr, CSUM: tl.constexpr,
               SPLIT: tl.constexpr):
    """One (BLOCK_M, BLOCK_N) tile: fp32 GEMM + bias, rounding, injection, row partial sums, store;
    when DETECT also its share of the row checksums: the K blocks ``kb ≡ pid_n (mod T)`` of x, which
    the tile has just loaded (read again from L2), give partial ``x·w1``, ``x·w2`` and row max / min /
    sum (plain fp32 on the CUDA cores, one K block in T per tile, no extra programs).

    TMA: operands are loaded (and y stored) through tensor descriptors ``Xd`` (M, K), ``Wd`` ((N, K),
    or (K, N) when W_KN) and ``Yd`` (M, N), whose out-of-bounds rows/columns read as zero and are not
    written; otherwise through the pointers X, W, Y and strides. TMA_STORE: y through ``Yd`` too (not
    in the one-launch GEMM, whose verifying program reads the other tiles' y: a TMA store is
    asynchronous, and Triton waits only until its shared-memory source may be reused).

    CSUM (a one-launch call of one row block, M ≤ CSUM_ROWS): the checksums and statistics come
    from the `_csum_chunk` programs, so the tile runs the plain main loop, and adds its two row
    partial sums into the per-row cells ``Acc`` (M, 2) (relaxed atomics) instead of storing them.

    SPLIT (one-row-block calls whose few tiles would leave most SMs idle: split-K): this program is split
    ``split`` of ``n_split`` over the tile's K blocks ``[split·kb_per, (split+1)·kb_per)``. It stores
    its fp32 partial tile in ``Part`` (n_split, M, N) and counts on the tile's cell ``Tcnt[pid_n]``;
    the last of the tile's splits to count resets the cell, sums the n_split partials in split order
    (the same fp32 sum whichever program finishes last) and runs the epilogue on that sum, so the
    verification still sees the fp32 accumulators before rounding."""
    offs_k = tl.arange(0, BLOCK_K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_bn = offs_n % N
    kb0, kb1 = k_blocks(split, kb_per, K, BLOCK_K, SPLIT)
    a_ptrs = X + offs_am[:, None] * sxm + (kb0 * BLOCK_K + offs_k)[None, :] * sxk
    b_ptrs = W + (kb0 * BLOCK_K + offs_k)[:, None] * swk + offs_bn[None, :] * swn
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    c1 = tl.zeros((BLOCK_M,), tl.float32)
    c2 = tl.zeros((BLOCK_M,), tl.float32)
    sm = tl.zeros((BLOCK_M,), tl.float32)
    mx = tl.full((BLOCK_M,), -float("inf"), tl.float32)
    mn = tl.full((BLOCK_M,), float("inf"), tl.float32)
    for kb in range(kb0, kb1):
        if TMA:
            a = Xd.load([pid_m * BLOCK_M, kb * BLOCK_K])
            if W_KN:
                b = Wd.load([kb * BLOCK_K, pid_n * BLOCK_N])
            else:
                b = Wd.load([pid_n * BLOCK_N, kb * BLOCK_K]).T
        elif EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            rem = K - kb * BLOCK_K
            a = tl.load(a_ptrs, mask=offs_k[None, :] < rem, other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < rem, other=0.0)
        acc = _mma(a, b, acc, DOT_F32)
        if DETECT and not CSUM:
            if kb % num_pid_n == pid_n:
                kk = kb * BLOCK_K + offs_k
                k_ok = kk < K
                # the x block reloaded (from L2: the tile has just read it) so that ``a`` feeds only
                # the dot and stays in the pipelined shared-memory buffers (taking ``a`` itself cost
                # 8-25 % more on the H100: fewer pipeline stages, spills)
                af = tl.load(X + offs_am[:, None] * sxm + kk[None, :] * sxk, mask=k_ok[None, :],
                             other=0.0).to(tl.float32)
                c1 += tl.sum(af * tl.load(W12 + kk * 2, mask=k_ok, other=0.0)[None, :], axis=1)
                c2 += tl.sum(af * tl.load(W12 + kk * 2 + 1, mask=k_ok, other=0.0)[None, :], axis=1)
                sm += tl.sum(af, axis=1)
                mx = tl.maximum(mx, tl.max(tl.where(k_ok[None, :], af, -float("inf")), axis=1))
                mn = tl.minimum(mn, tl.min(tl.where(k_ok[None, :], af, float("inf")), axis=1))
        if not TMA:
            a_ptrs += BLOCK_K * sxk
            b_ptrs += BLOCK_K * swk
    if SPLIT:
        pmask = m_ok[:, None] & n_ok[None, :]
        part = Part + offs_m[:, None] * N + offs_n[None, :]
        tl.store(part + split * M * N, acc, mask=pmask)
        tl.debug_barrier()  # every thread's partial before the count
        if tl.atomic_add(Tcnt + pid_n, 1, sem="acq_rel") == n_split - 1:
            tl.store(Tcnt + pid_n, 0)  # ready for the next call (every split has counted)
            acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            for s in range(0, n_split):  # a fixed order: the same sum whichever split came last
                acc += tl.load(part + s * M * N, mask=pmask, other=0.0, cache_modifier=".cg")
            _tile_epilogue(acc, Y, Yd, Bias, P, S, Acc, Inj, Flag, pid_m, pid_n, num_pid_m, offs_m, offs_n, n_ok,
                           m_ok, M, sym, syn, inv_n, call_id, c1, c2, mx, mn, sm, HAS_BIAS, DETECT, VERIFY_OUTPUT,
                           INJ, TMA_STORE, CSUM)
    else:
        _tile_epilogue(acc, Y, Yd, Bias, P, S, Acc, Inj, Flag, pid_m, pid_n, num_pid_m, offs_m, offs_n, n_ok,
                       m_ok, M, sym, syn, inv_n, call_id, c1, c2, mx, mn, sm, HAS_BIAS, DETECT, VERIFY_OUTPUT,
                       INJ, TMA_STORE, CSUM)


@triton.jit
def _tile_epilogue(acc, Y, Yd, Bias, P, S, Acc, Inj, Flag, pid_m, pid_n, num_pid_m, offs_m, offs_n, n_ok, m_ok, M,
                   sym, syn, inv_n, call_id, c1, c2, mx, mn, sm, HAS_BIAS: tl.constexpr, DETECT: tl.constexpr,
                   VERIFY_OUTPUT: tl.constexpr, INJ: tl.constexpr, TMA_STORE: tl.constexpr, CSUM: tl.constexpr):
    """A tile's fp32 sum ``acc`` (BLOCK_M, BLOCK_N) out: bias, rounding, injection, the row sums
    (stored, or with CSUM added into ``Acc``) and the checksum partials, y's store."""
    BLOCK_M: tl.constexpr = acc.shape[0]
    BLOCK_N: tl.constexpr = acc.shape[1]
    if HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    # flips at site linear.output, on the rounded value
    yv, v = round_and_inject(acc, Y.dtype.element_ty, Inj, pid_m, num_pid_m, offs_m, offs_n, n_ok, INJ, VERIFY_OUTPUT)
    if DETECT:
        colw = (offs_n + 1).to(tl.float32) * inv_n
        s1 = tl.sum(v, axis=1)
        s2 = tl.sum(v * colw[None, :], axis=1)
        if CSUM:
            # the order of the tiles' additions varies from call to call: the row sums' last bits may
            # too (|error| ~ T·u·Σ|partials|, far under the threshold's unit error)
            tl.atomic_add(Acc + offs_m * 2, s1, mask=m_ok, sem="relaxed")
            tl.atomic_add(Acc + offs_m * 2 + 1, s2, mask=m_ok, sem="relaxed")
        else:
            prow = P + (pid_n * M + offs_m) * 2
            tl.store(prow, s1, mask=m_ok)
            tl.store(prow + 1, s2, mask=m_ok)
            _store_stats(S + (pid_n * M + offs_m) * 8, m_ok, c1, c2, mx, mn, sm, Flag, call_id)
    if TMA_STORE:
        Yd.store([pid_m * BLOCK_M, pid_n * BLOCK_N], yv)
    else:
        tl.store(Y + offs_m[:, None] * sym + offs_n[None, :] * syn, yv, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _store_stats(srow, m_ok, c1, c2, mx, mn, sm, Flag, call_id):
    """Store rows' checksum partials and x statistics at ``srow`` (8 fp32 per row); raise the call's
    non-finite flag if one of the rows' x is (NaN makes the sum NaN, max/min may ignore it; ±inf
    shows in max/min)."""
    nf = ~(tl.abs(sm) < float("inf")) | (mx == float("inf")) | (mn == -float("inf"))
    if tl.max((nf & m_ok).to(tl.int32), axis=0) > 0:
        tl.atomic_max(Flag, call_id)
    tl.store(srow + 0, c1, mask=m_ok)
    tl.store(srow + 1, c2, mask=m_ok)
    tl.store(srow + 2, mx, mask=m_ok)
    tl.store(srow + 3, mn, mask=m_ok)
    tl.store(srow + 4, sm, mask=m_ok)


@triton.jit
def _csum_chunk(X, W12, S, Flag, chunk, M, K, sxm, sxk, call_id, CSUM_R: tl.constexpr, CSUM_K: tl.constexpr):
    """One K chunk of a decode call's checksums (CSUM): partial ``x·w1``, ``x·w2`` and x's max / min /
    sum for the call's rows (CSUM_R ≥ M) over ``K`` indices ``[chunk·CSUM_K, (chunk+1)·CSUM_K)``,
    into stats slot ``chunk`` of ``S`` (C, M, 8). Plain fp32 on the CUDA cores, one load of x and
    of ``w12`` (K, 2), no loop: the chunk programs run beside the GEMM tiles, on SMs a decode GEMM
    leaves idle."""
    rows = tl.arange(0, CSUM_R)
    r_ok = rows < M
    kk = chunk * CSUM_K + tl.arange(0, CSUM_K)
    k_ok = kk < K
    xv = tl.load(X + rows[:, None] * sxm + kk[None, :] * sxk, mask=r_ok[:, None] & k_ok[None, :],
                 other=0.0).to(tl.float32)
    w1 = tl.load(W12 + kk * 2, mask=k_ok, other=0.0)
    w2 = tl.load(W12 + kk * 2 + 1, mask=k_ok, other=0.0)
    c1 = tl.sum(xv * w1[None, :], axis=1)
    c2 = tl.sum(xv * w2[None, :], axis=1)
    sm = tl.sum(xv, axis=1)
    mx = tl.max(tl.where(k_ok[None, :], xv, -float("inf")), axis=1)
    mn = tl.min(tl.where(k_ok[None, :], xv, float("inf")), axis=1)
    _store_stats(S + (chunk * M + rows) * 8, r_ok, c1, c2, mx, mn, sm, Flag, call_id)


@triton.jit
def _grouped_tile(tile, num_pid_m, num_pid_n, GROUP: tl.constexpr):
    """(pid_m, pid_n) of output tile ``tile`` in grouped order: GROUP row blocks walk the column tiles
    together, so a W tile is read from L2 by the GROUP programs that need it."""
    in_group = GROUP * num_pid_n
    first_m = (tile // in_group) * GROUP
    gsize = tl.minimum(num_pid_m - first_m, GROUP)
    return first_m + ((tile % in_group) % gsize), (tile % in_group) // gsize


@triton.jit(do_not_specialize=["call_id", "w_finite"])
def _gemm_kernel(X, W, Y, Xd, Wd, Yd, Bias, W12, P, Inj, Flag, Ws,
                 M, N, K, sxm, sxk, swn, swk, sym, syn, inv_n, call_id,
                 Sem, B12, Cnt, Dbg, scn0, scn1, fn, inv_k, w_finite, capacity,
                 th_det, th_v2, th_v3, th_var23, th_var4, th_bias, reverify_scale, Acc, n_csum, n_split, kb_per,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, DETECT: tl.constexpr,
                 VERIFY_OUTPUT: tl.constexpr, INJ: tl.constexpr, DOT_F32: tl.constexpr,
                 EVEN_K: tl.constexpr, TMA: tl.constexpr, W_KN: tl.constexpr, TMA_STORE: tl.constexpr,
                 ONE_LAUNCH: tl.constexpr, VERIFY_R: tl.constexpr, VBLOCK_N: tl.constexpr,
                 VBLOCK_K: tl.constexpr, VBLOCK_T: tl.constexpr, CORRECT: tl.constexpr, DEBUG: tl.constexpr,
                 CSUM: tl.constexpr, CSUM_R: tl.constexpr, CSUM_K: tl.constexpr, SPLIT: tl.constexpr):
    """Grouped-order grid over the output tiles (and, with CSUM, ``n_csum`` checksum programs after them).

    ONE_LAUNCH: the GEMM verifies itself, no second launch. ``Sem`` is the per-device int32 cell
    block of `_cells` (0 between calls): [0] row blocks verified, [1] recompute slots taken, [2:6]
    the call's detected / corrected / recomputed / uncorrectable counts, [8 + r] tiles of row block
    r done. Each program counts itself done on its row block's cell after its stores (barrier, then
    an acq_rel atomic: its stores are visible to whoever sees the count); the one that sees T − 1
    resets the cell and verifies the row block, VERIFY_R rows at a time, counting into [2:6] and
    skipping rows whose own x is non-finite. It then counts the row block verified on [0]; the one
    that sees all row blocks publishes the call's counts into ``Cnt`` — or, if any x of the call was
    non-finite (``Flag``) or W/b is, one ``nonfinite_input`` instead, like the reference — and
    resets [0:8]. A call of one row block skips the [0] stage: every tile has counted before its
    verifier starts, so that program verifies with the whole call's non-finite flag, as
    ``_verify_kernel`` does, counts into ``Cnt`` itself and resets [1]. The verify arguments
    (``Sem`` … ``reverify_scale``) are those of ``_verify_kernel``; unused otherwise.

    CSUM (one launch, one row block, M ≤ CSUM_ROWS: decode): ``n_csum`` more programs, one per
    CSUM_K-wide chunk of K, compute the checksums and x's statistics (`_csum_chunk`, into the stats
    slots at ``P``) while the tiles run the plain main loop and add their row sums into ``Acc``; all
    T + n_csum programs count on the row block's cell, and the last verifies. Measured on an H200
    (``docs/vabft.md``, session 23): the tiles' share of the checksums in the K loop cost 0.7-2.6 µs
    per decode call, and the verifier's walk over T tiles' partials 1.7-3 µs (88 µs for the lm_head's
    2,374 tiles), against one load of the cells now.

    SPLIT (calls of one row block and few tiles, `_split_plan`: decode calls with checksum programs, and
    the plain GEMM's of the same shapes): each tile runs as ``n_split`` programs over
    ``kb_per`` K blocks each (split-K; see `_gemm_tile`), program ``pid`` being split
    ``pid % n_split`` of tile ``pid // n_split``; the tiles' split counts use the cells
    ``Sem[9 + pid_n]``, which a one-row-block call leaves free (the plain GEMM gets the cell block as
    ``Sem`` for them), and with ONE_LAUNCH all T·n_split + n_csum programs count on the row block's cell."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    if SPLIT:  # one row block, tiles of n_split programs (then, with CSUM, the checksum programs)
        pid_m = 0
        pid_n = pid // n_split
        split = pid % n_split
    elif CSUM:  # one row block; programs past the tiles (pid ≥ T) are the checksum programs
        pid_m = 0
        pid_n = pid
        split = 0
    else:
        split = 0
        pid_m, pid_n = _grouped_tile(pid, num_pid_m, num_pid_n, GROUP)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    offs_am = offs_m % M  # wrapped rows: in-bounds loads without a mask, never stored
    if CSUM:
        S = P  # the (n_csum, M, 8) stats slots of the checksum programs; the row sums go to Acc
    else:
        S = P + num_pid_n * M * 2  # the (T, M, 8) stats follow the (T, M, 2) row sums in one buffer
    if DETECT and not ONE_LAUNCH:
        if pid == 0:
            tl.store(Ws, 0)  # per-call recompute slot counter (read by the verify kernel)
    # SPLIT: the partial tiles after the checksum slots in P, the tiles' split counts in the cells
    # after the row block's (a CSUM call has one row block)
    if CSUM and pid >= num_pid_n * n_split:
        _csum_chunk(X, W12, S, Flag, pid - num_pid_n * n_split, M, K, sxm, sxk, call_id, CSUM_R, CSUM_K)
    else:
        _gemm_tile(X, W, Y, Xd, Wd, Yd, Bias, W12, P, S, Acc, Inj, Flag, P + n_csum * M * 8, Sem + 9, pid_m, pid_n,
                   split, kb_per, num_pid_m, num_pid_n, offs_m, offs_am, m_ok, M, N, K, sxm, sxk, swn, swk, sym, syn,
                   inv_n, call_id, n_split, BLOCK_M, BLOCK_N, BLOCK_K, HAS_BIAS, DETECT, VERIFY_OUTPUT, INJ, DOT_F32,
                   EVEN_K, TMA, W_KN, TMA_STORE, CSUM, SPLIT)
    if ONE_LAUNCH:
        tl.debug_barrier()  # every thread's stores (y, partials, flag) before the count
        done = tl.atomic_add(Sem + 8 + pid_m, 1, sem="acq_rel")
        if done == num_pid_n * n_split + n_csum - 1:
            tl.store(Sem + 8 + pid_m, 0)  # ready for the next call (every tile has counted)
            # statistics slots that can hold a share: the checksum programs', or the tiles' up to the K block count
            ts = n_csum if CSUM else tl.minimum(num_pid_n, tl.cdiv(K, BLOCK_K))
            if num_pid_m == 1:
                # the call's only row block (decode): every tile has finished, so the flag of a
                # non-finite x is final. Verify with the two-launch semantics (checks off for the
                # whole call) and count straight into Cnt: no row-block stage, two fewer round trips.
                for r0 in range(0, M, VERIFY_R):
                    _verify_rows(X, W, Y, Bias, B12, P, S, Acc, Flag, Sem + 1, Cnt, Dbg, r0 + tl.arange(0, VERIFY_R),
                                 r0 == 0, M, N, K, n_csum if CSUM else num_pid_n, ts, sxm, sxk, swn, swk, sym, syn,
                                 scn0, scn1, inv_n, fn, inv_k, call_id, w_finite, capacity, th_det, th_v2, th_v3,
                                 th_var23, th_var4, th_bias, reverify_scale, VBLOCK_N, VBLOCK_K, VBLOCK_T, HAS_BIAS,
                                 CORRECT, DEBUG, DOT_F32, False, VERIFY_OUTPUT, CSUM)
                tl.store(Sem + 1, 0)  # the recompute slot counter, for the next call
                tl.store(Flag, 0)  # the non-finite flag too (`call_flag`'s self_reset: no memset in a graph)
            else:
                for r0 in range(0, tl.minimum(BLOCK_M, M - pid_m * BLOCK_M), VERIFY_R):
                    _verify_rows(X, W, Y, Bias, B12, P, S, Acc, Flag, Sem + 1, Sem + 2, Dbg,
                                 pid_m * BLOCK_M + r0 + tl.arange(0, VERIFY_R), False, M, N, K, num_pid_n, ts,
                                 sxm, sxk, swn, swk, sym, syn, 0, 1, inv_n, fn, inv_k, call_id, w_finite,
                                 capacity, th_det, th_v2, th_v3, th_var23, th_var4, th_bias, reverify_scale,
                                 VBLOCK_N, VBLOCK_K, VBLOCK_T, HAS_BIAS, CORRECT, DEBUG, DOT_F32, True, VERIFY_OUTPUT,
                                 False)
                tl.debug_barrier()  # every thread's counts before the row block counts as verified
                fin = tl.atomic_add(Sem, 1, sem="acq_rel")
                if fin == num_pid_m - 1:
                    # every verifier has finished: plain loads and stores (no atomic round trips in the tail)
                    ok = (tl.load(Flag, cache_modifier=".cg") != call_id) & (w_finite != 0)
                    c8 = tl.arange(0, 8)
                    cs = tl.load(Sem + c8, cache_modifier=".cg")  # [2:6]: detected, corrected, recomputed, unc.
                    tl.store(Sem + c8, 0)
                    tl.store(Flag, 0)  # every tile has raised it or not, and it was read above
                    cbase = Cnt + _SITE_ROW * scn0
                    if ok:
                        if tl.sum(tl.where((c8 >= 2) & (c8 < 6), cs, 0), axis=0) > 0:
                            for kind in tl.static_range(4):
                                c = tl.sum(tl.where(c8 == kind + 2, cs, 0), axis=0)
                                if c > 0:
                                    tl.atomic_add(cbase + kind * scn1, c)
                    else:
                        tl.atomic_add(cbase + _NONF * scn1, 1)


@triton.jit
def _verify_rows(X, W, Y, Bias, B12, P, S, Acc, Flag, Ws, Cnt, Dbg, rows, count_nonf,
                 M, N, K, T, TS, sxm, sxk, swn, swk, sym, syn, scn0, scn1,
                 inv_n, fn, inv_k, call_id, w_finite, capacity,
                 th_det, th_v2, th_v3, th_var23, th_var4, th_bias, reverify_scale,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr,
                 HAS_BIAS: tl.constexpr, CORRECT: tl.constexpr, DEBUG: tl.constexpr,
                 DOT_F32: tl.constexpr, ROW_NONF: tl.constexpr, VERIFY_OUTPUT: tl.constexpr, CSUM: tl.constexpr):
    """Compare checksums of the rows ``rows`` (BLOCK_R,), count, repair located single errors,
    recompute the rest.

    The row sums are the T tiles' partials at ``P`` (T, M, 2) and the checksums and statistics
    partials at ``S`` (T, M, 8), of which only the first TS slots can hold a share (a tile takes the
    K blocks ``kb ≡ pid_n (mod T)``, so tiles past the K block count hold the neutral values); with
    CSUM the row sums are in the cells ``Acc`` (M, 2), reset here for the next call, and ``S`` holds
    the TS = n_csum checksum programs' slots.

    Recompute slots are claimed with one atomic on the call's counter ``Ws``. Checks are off for
    this call when W/b are non-finite (``w_finite`` 0) and, without ROW_NONF, when any x of the call
    is (``Flag``; ``count_nonf``: this program counts the call's ``nonfinite_input``). ROW_NONF (the
    one-launch GEMM, which verifies before every tile has raised the flag): only rows whose own x is
    non-finite are skipped, and the caller settles the call's counts.
    P, S, Y and Flag are read past L1 (``.cg``): in the one-launch GEMM other programs wrote them
    during this launch. VERIFY_OUTPUT: the row sums are of the rounded outputs (else of the fp32
    accumulators, where a repair is also checked against the accumulator-side difference)."""
    BLOCK_R: tl.constexpr = rows.shape[0]
    r_ok = rows < M
    # the T tiles' row partial sums and checksum partials, BLOCK_T tiles per load: a loop of one
    # small load per tile would chain T memory latencies. (Loading each (tile, row) record whole and
    # splitting its fields in registers was slower on the H100: 35.9 against 27.7 µs for a one-launch
    # 4096 × 896 × 896, session 31.)
    offs_t = tl.arange(0, BLOCK_T)
    s1 = tl.zeros((BLOCK_R,), tl.float32)
    s2 = tl.zeros((BLOCK_R,), tl.float32)
    # the bias checksums and the call's non-finite flag are loaded first and used only after the
    # loop, so that their round trips overlap the partials' instead of preceding or following them
    b1 = tl.load(B12)
    b2 = tl.load(B12 + 1)
    if not ROW_NONF:
        flag = tl.load(Flag, cache_modifier=".cg")
    c1 = tl.zeros((BLOCK_R,), tl.float32)
    c2 = tl.zeros((BLOCK_R,), tl.float32)
    sm = tl.zeros((BLOCK_R,), tl.float32)
    mx = tl.full((BLOCK_R,), -float("inf"), tl.float32)
    mn = tl.full((BLOCK_R,), float("inf"), tl.float32)
    if CSUM:
        s1 = tl.load(Acc + rows * 2, mask=r_ok, other=0.0, cache_modifier=".cg")
        s2 = tl.load(Acc + rows * 2 + 1, mask=r_ok, other=0.0, cache_modifier=".cg")
    else:
        for t0 in range(0, T, BLOCK_T):
            tt = t0 + offs_t
            lm = (tt[:, None] < T) & r_ok[None, :]
            prow = P + (tt[:, None] * M + rows[None, :]) * 2
            s1 += tl.sum(tl.load(prow, mask=lm, other=0.0, cache_modifier=".cg"), axis=0)
            s2 += tl.sum(tl.load(prow + 1, mask=lm, other=0.0, cache_modifier=".cg"), axis=0)
    for t0 in range(0, TS, BLOCK_T):  # only the slots that can hold a share
        tt = t0 + offs_t
        lm = (tt[:, None] < TS) & r_ok[None, :]
        srow = S + (tt[:, None] * M + rows[None, :]) * 8
        c1 += tl.sum(tl.load(srow + 0, mask=lm, other=0.0, cache_modifier=".cg"), axis=0)
        c2 += tl.sum(tl.load(srow + 1, mask=lm, other=0.0, cache_modifier=".cg"), axis=0)
        mx = tl.maximum(mx, tl.max(tl.load(srow + 2, mask=lm, other=-float("inf"), cache_modifier=".cg"), axis=0))
        mn = tl.minimum(mn, tl.min(tl.load(srow + 3, mask=lm, other=float("inf"), cache_modifier=".cg"), axis=0))
        sm += tl.sum(tl.load(srow + 4, mask=lm, other=0.0, cache_modifier=".cg"), axis=0)
    if CSUM:
        # the cells back to 0 for the next call, once every thread has read them: each row is held by
        # threads of several warps, and one of them stores (without the barrier, a warp that had not
        # yet loaded read the 0: 4-5 % of the calls at M = 16, K ≥ 4352 on an H200)
        tl.debug_barrier()
        tl.store(Acc + rows * 2, tl.zeros_like(s1), mask=r_ok)
        tl.store(Acc + rows * 2 + 1, tl.zeros_like(s2), mask=r_ok)
    c1 += b1
    c2 += b2
    mu = sm * inv_k
    var = tl.maximum((mx - mu) * (mu - mn), 0.0)
    # T_m (SPEC §5, WeightChecksums.thresholds): host-folded weight constants
    thr = th_var23 * tl.sqrt(mu * mu * th_v2 + var * th_v3) + th_det * tl.abs(mu) + th_var4 * tl.sqrt(var) + th_bias
    if ROW_NONF:  # per row: x's row finite (a NaN makes the sum NaN; ±inf shows in max/min), W and b finite
        ok = (tl.abs(sm) < float("inf")) & (mx < float("inf")) & (mn > -float("inf")) & (w_finite != 0)
    else:  # for the call: no non-finite x seen by the GEMM tiles, finite W and b
        ok = (flag != call_id) & (w_finite != 0)
    # (tl.where, not `&`, to combine with the scalar: the interpreter mis-types bool & 0-d bool)
    d1 = s1 - c1
    bad = tl.where(ok, ~(tl.abs(d1) <= thr) & r_ok, False)
    if DEBUG:
        drow = Dbg + rows * 4
        tl.store(drow + 0, d1, mask=r_ok)
        tl.store(drow + 1, c1, mask=r_ok)
        tl.store(drow + 2, thr, mask=r_ok)
    n_bad = tl.sum(bad.to(tl.int32), axis=0)
    n_fix = n_bad * 0
    n_rec = n_bad * 0
    n_unc = n_bad
    if CORRECT:
        d2 = s2 - c2 * inv_n
        tq = d2 / d1 * fn
        j = tl.floor(tq + 0.5)
        loc = bad & (tl.abs(tq) < float("inf")) & (tl.abs(tq - j) <= 0.25) & (j >= 1.0) & (j <= fn)
        col = tl.where(loc, j - 1.0, 0.0).to(tl.int32)
        fixed = loc & (rows < 0)
        offs_k = tl.arange(0, BLOCK_K)
        if tl.sum(loc.to(tl.int32), axis=0) > 0:
            # repair: y[m, col] = fp32 dot x[m]·W[col] + b[col]; re-verify with the repaired value
            val = tl.zeros((BLOCK_R,), tl.float32)
            vabs = tl.zeros((BLOCK_R,), tl.float32)  # Σ|x·w|, for the rounding bound of the check below
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + offs_k
                lm = loc[:, None] & (kk[None, :] < K)
                xa = tl.load(X + rows[:, None] * sxm + kk[None, :] * sxk, mask=lm, other=0.0).to(tl.float32)
                wa = tl.load(W + col[:, None] * swn + kk[None, :] * swk, mask=lm, other=0.0).to(tl.float32)
                val += tl.sum(xa * wa, axis=1)
                if not VERIFY_OUTPUT:
                    vabs += tl.sum(tl.abs(xa * wa), axis=1)
            if HAS_BIAS:
                val += tl.load(Bias + col, mask=loc, other=0.0).to(tl.float32)
            yptr = Y + rows * sym + col * syn
            old = tl.load(yptr, mask=loc, other=0.0, cache_modifier=".cg").to(tl.float32)
            newv = val.to(Y.dtype.element_ty)
            tl.store(yptr, newv, mask=loc)
            # re-verify the repaired row as stored (like the reference): re-sum it in fp32 with the
            # located element replaced (excluded, not subtracted: a flipped value may be ~1e38 and
            # would swamp the others), against the output-side threshold
            offs_j = tl.arange(0, BLOCK_N)
            rs = newv.to(tl.float32)
            for n0 in range(0, N, BLOCK_N):
                cols = n0 + offs_j
                lm2 = loc[:, None] & (cols[None, :] < N) & (cols[None, :] != col[:, None])
                rs += tl.sum(tl.load(Y + rows[:, None] * sym + cols[None, :] * syn, mask=lm2, other=0.0,
                                         cache_modifier=".cg")
                             .to(tl.float32), axis=1)
            fixed = loc & (tl.abs(rs - c1) <= thr * reverify_scale)
            if not VERIFY_OUTPUT:
                # and in the accumulators: D1 with the located element's term replaced by the repair,
                # D1 − v + val, must pass the accumulator-side threshold. v (the fp32 accumulator, or
                # the flipped value) is within half an ulp of the stored y, the GEMM's and the
                # repair's dots differ by at most 2·K·u·Σ|x·w|, and D1's own sum rounds by at most
                # N·u per |v|. The re-sum above uses the output's rounding and can pass a location
                # that does not explain D1: two errors in one row, the rest of whose sum stays under
                # bf16's output-side threshold (one +2.3 and one −3.6 seen; a repair elsewhere, the
                # row left wrong). Such a row goes to recompute instead.
                if Y.dtype.element_ty == tl.float16:
                    u_y: tl.constexpr = 2.0**-11
                elif Y.dtype.element_ty == tl.bfloat16:
                    u_y: tl.constexpr = 2.0**-8
                else:
                    u_y: tl.constexpr = 2.0**-24
                tol = thr + (u_y + fn * 2.0**-24) * tl.abs(old) + 2.0 * K * 2.0**-24 * vabs
                fixed = fixed & (tl.abs(d1 - old + val) <= tol)
        need = bad & ~fixed
        n_need = tl.sum(need.to(tl.int32), axis=0)
        n_fix = tl.sum(fixed.to(tl.int32), axis=0)
        n_unc = n_need
        if n_need > 0:
            base = tl.atomic_add(Ws, n_need)  # fixed capacity per call: claim slots
            rank = tl.cumsum(need.to(tl.int32), axis=0) - 1
            take = need & (base + rank < capacity)
            n_rec = tl.sum(take.to(tl.int32), axis=0)
            n_unc = n_need - n_rec
            if n_rec > 0:
                # recompute the taken rows: x[m]·Wᵀ + b, the GEMM's own arithmetic, no injection
                offs_j = tl.arange(0, BLOCK_N)
                for n0 in range(0, N, BLOCK_N):
                    cols = n0 + offs_j
                    c_ok = cols < N
                    acc = tl.zeros((BLOCK_R, BLOCK_N), tl.float32)
                    for k0 in range(0, K, BLOCK_K):
                        kk = k0 + offs_k
                        xa = tl.load(X + rows[:, None] * sxm + kk[None, :] * sxk,
                                     mask=take[:, None] & (kk[None, :] < K), other=0.0)
                        wb = tl.load(W + kk[:, None] * swk + cols[None, :] * swn,
                                     mask=(kk[:, None] < K) & c_ok[None, :], other=0.0)
                        acc = _mma(xa, wb, acc, DOT_F32)
                    if HAS_BIAS:
                        acc += tl.load(Bias + cols, mask=c_ok, other=0.0).to(tl.float32)[None, :]
                    tl.store(Y + rows[:, None] * sym + cols[None, :] * syn, acc.to(Y.dtype.element_ty),
                             mask=take[:, None] & c_ok[None, :])
    cbase = Cnt + _SITE_ROW * scn0
    if n_bad > 0:
        tl.atomic_add(cbase + _DET * scn1, n_bad)
    if n_fix > 0:
        tl.atomic_add(cbase + _COR * scn1, n_fix)
    if n_rec > 0:
        tl.atomic_add(cbase + _REC * scn1, n_rec)
    if n_unc > 0:
        tl.atomic_add(cbase + _UNC * scn1, n_unc)
    if not ROW_NONF:
        if count_nonf:
            if ok.to(tl.int32) == 0:
                tl.atomic_add(cbase + _NONF * scn1, 1)


@triton.jit(do_not_specialize=["call_id", "w_finite", "T", "TS"])
def _verify_kernel(X, W, Y, Bias, B12, P, Flag, Ws,
                   M, N, K, T, TS, sxm, sxk, swn, swk, sym, syn, inv_n, call_id,
                   Cnt, Dbg, scn0, scn1, fn, inv_k, w_finite, capacity,
                   th_det, th_v2, th_v3, th_var23, th_var4, th_bias, reverify_scale,
                   BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr,
                   HAS_BIAS: tl.constexpr, CORRECT: tl.constexpr, DEBUG: tl.constexpr,
                   DOT_F32: tl.constexpr, VERIFY_OUTPUT: tl.constexpr):
    """The second launch (calls of more than one row block): BLOCK_R rows per program; the row sums of T
    tiles, the statistics in TS slots (the tiles' shares, or the persistent form's single slot)."""
    pid = tl.program_id(0)
    S = P + T * M * 2
    _verify_rows(X, W, Y, Bias, B12, P, S, P, Flag, Ws, Cnt, Dbg, pid * BLOCK_R + tl.arange(0, BLOCK_R), pid == 0,
                 M, N, K, T, TS, sxm, sxk, swn, swk, sym, syn, scn0, scn1,
                 inv_n, fn, inv_k, call_id, w_finite,
                 capacity, th_det, th_v2, th_v3, th_var23, th_var4, th_bias, reverify_scale,
                 BLOCK_N, BLOCK_K, BLOCK_T, HAS_BIAS, CORRECT, DEBUG, DOT_F32, False, VERIFY_OUTPUT, False)




@triton.jit
def _stats_rows(X, W12, S, Flag, rows, M, K, sxm, sxk, call_id, CK: tl.constexpr):
    """The persistent form's statistics of the rows ``rows`` (R,) of x (M, K): ``x·w1``, ``x·w2`` (``W12``
    (K, 2) fp32) and x's row max / min / sum in fp32, into the single statistics slot ``S`` (M, 8) that the
    verify launch reads (TS = 1); raises the call's non-finite flag like the tiles' share does
    (`_store_stats`)."""
    R: tl.constexpr = rows.shape[0]
    r_ok = rows < M
    offs_k = tl.arange(0, CK)
    c1 = tl.zeros((R,), tl.float32)
    c2 = tl.zeros((R,), tl.float32)
    sm = tl.zeros((R,), tl.float32)
    mx = tl.full((R,), -float("inf"), tl.float32)
    mn = tl.full((R,), float("inf"), tl.float32)
    for k0 in range(0, K, CK):
        kk = k0 + offs_k
        k_ok = kk < K
        lm = r_ok[:, None] & k_ok[None, :]
        xv = tl.load(X + rows[:, None] * sxm + kk[None, :] * sxk, mask=lm, other=0.0).to(tl.float32)
        c1 += tl.sum(xv * tl.load(W12 + kk * 2, mask=k_ok, other=0.0)[None, :], axis=1)
        c2 += tl.sum(xv * tl.load(W12 + kk * 2 + 1, mask=k_ok, other=0.0)[None, :], axis=1)
        sm += tl.sum(xv, axis=1)
        mx = tl.maximum(mx, tl.max(tl.where(lm, xv, -float("inf")), axis=1))
        mn = tl.minimum(mn, tl.min(tl.where(lm, xv, float("inf")), axis=1))
    _store_stats(S + rows * 8, r_ok, c1, c2, mx, mn, sm, Flag, call_id)


@triton.jit
def _max_min16(mx, mn, a, b):
    """(max(mx, a), min(mn, b)) elementwise, in the operands' dtype: fp16 and fp32 as Triton does them, bf16
    as two packed PTX ``max.bf16x2`` / ``min.bf16x2`` (Triton widens bf16 to fp32 and back: twice the
    instructions). A NaN is dropped, as `_stats_rows`' max / min drop it (the sum keeps it)."""
    if mx.dtype == tl.bfloat16:
        mx = tl.inline_asm_elementwise("max.bf16x2 $0, $1, $2;", "=r,r,r", [mx, a], dtype=tl.bfloat16,
                                       is_pure=True, pack=2)
        mn = tl.inline_asm_elementwise("min.bf16x2 $0, $1, $2;", "=r,r,r", [mn, b], dtype=tl.bfloat16,
                                       is_pure=True, pack=2)
    else:
        mx = tl.maximum(mx, a)
        mn = tl.minimum(mn, b)
    return mx, mn


@triton.jit
def _stats_block(xd, W16, Winv, S, Flag, row0, M, K, call_id, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                 STAGES: tl.constexpr, DOT_F32: tl.constexpr):
    """`_stats_rows` for the BLOCK_M rows of x (M, K) from ``row0``, as a persistent GEMM program with a tile
    fewer makes them: x loaded by the TMA descriptor ``xd`` (zero past M and K) in (BLOCK_M, BLOCK_K) blocks,
    STAGES loads in flight. ``x·w1``, ``x·w2`` and the row sum are one tensor-core dot per block against
    ``W16`` (K, 16) in x's dtype (`_stats_operand`: w1 and w2 in slices, then ones; ``Winv`` (2,) fp32 the
    slices' inverse scales); max and min are kept per element in x's dtype (exact) and reduced once. The
    CUDA-core form of `_stats_rows` moved ~30 GB/s per SM on an H200: too slow for the idle programs."""
    rows = row0 + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    cols = tl.arange(0, 16)
    DT: tl.constexpr = W16.dtype.element_ty
    MT: tl.constexpr = tl.float32 if DOT_F32 else DT  # (the interpreter's bf16 max / min are not)
    acc = tl.zeros((BLOCK_M, 16), tl.float32)
    mx = tl.full((BLOCK_M, BLOCK_K), -float("inf"), MT)
    mn = tl.full((BLOCK_M, BLOCK_K), float("inf"), MT)
    nfull = K // BLOCK_K
    for kb in tl.range(nfull, num_stages=STAGES):
        xt = xd.load([row0, kb * BLOCK_K])
        acc = _mma(xt, tl.load(W16 + (kb * BLOCK_K + offs_k)[:, None] * 16 + cols[None, :]), acc, DOT_F32)
        mx, mn = _max_min16(mx, mn, xt.to(MT), xt.to(MT))
    if nfull * BLOCK_K < K:  # the last, partial block: TMA's zeros past K must not enter max / min
        kk = nfull * BLOCK_K + offs_k
        k_ok = kk < K
        xt = xd.load([row0, nfull * BLOCK_K])
        acc = _mma(xt, tl.load(W16 + kk[:, None] * 16 + cols[None, :], mask=k_ok[:, None], other=0.0), acc, DOT_F32)
        mx, mn = _max_min16(mx, mn, tl.where(k_ok[None, :], xt, -float("inf")).to(MT),
                            tl.where(k_ok[None, :], xt, float("inf")).to(MT))
    # W16's columns: w1 in slices 0 .. P-1, w2 in P .. 2P-1, ones at 2P (P = 2 for fp16, 3 for bf16)
    P: tl.constexpr = 2 if DT == tl.float16 else 3
    c1 = tl.sum(tl.where(cols[None, :] < P, acc, 0.0), axis=1) * tl.load(Winv)
    c2 = tl.sum(tl.where((cols[None, :] >= P) & (cols[None, :] < 2 * P), acc, 0.0), axis=1) * tl.load(Winv + 1)
    sm = tl.sum(tl.where(cols[None, :] == 2 * P, acc, 0.0), axis=1)
    _store_stats(S + rows * 8, rows < M, c1, c2, tl.max(mx, axis=1).to(tl.float32), tl.min(mn, axis=1).to(tl.float32),
                 sm, Flag, call_id)


@triton.jit(do_not_specialize=["call_id"])
def _stats_kernel(X, W12, P, Flag, Ws, M, K, T, sxm, call_id, R: tl.constexpr, CK: tl.constexpr):
    """The persistent form's first launch, a pass over x (M, K), R rows per program (`_stats_rows`): the
    checksums and statistics into the one slot after the T tiles' row sums in ``P``; program 0 zeroes the
    recompute slot counter ``Ws`` (the two-launch GEMM's first program does). (The same pass as a prologue
    of `_persistent_kernel` made those calls 8-15 % slower on an H200, session 31.)"""
    pid = tl.program_id(0)
    if pid == 0:
        tl.store(Ws, 0)
    _stats_rows(X, W12, P + T * M * 2, Flag, pid * R + tl.arange(0, R), M, K, sxm, 1, call_id, CK)


@triton.jit(do_not_specialize=["call_id"])
def _persistent_kernel(X, W, Y, Bias, P, W16, Winv, Flag, Ws, M, N, K, sxm, sw, sym, inv_n, call_id,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
                       NUM_SMS: tl.constexpr, HAS_BIAS: tl.constexpr, W_KN: tl.constexpr,
                       VERIFY_OUTPUT: tl.constexpr, DOT_F32: tl.constexpr, STATS: tl.constexpr,
                       STATS_BK: tl.constexpr, STATS_STAGES: tl.constexpr):
    """The persistent form's GEMM: NUM_SMS programs loop over the (BLOCK_M, BLOCK_N) tiles of y (M, N) in
    grouped order, with x (M, K), W (N, K) (or (K, N) when W_KN) and y moved by TMA descriptors made here
    (plain pointer arguments, so a prepared call replays it), the tile and K loops flattened into one
    pipeline. Epilogue: bias in fp32, the two row partial sums of each tile into ``P`` (T, M, 2) as
    `_tile_epilogue` stores them (of the fp32 accumulators, or of the rounded outputs with VERIFY_OUTPUT),
    y rounded and stored. No checksum work in the K loop (it cost 5-50 % there).

    STATS: the pass over x for ``x·w1``, ``x·w2`` (``W16``, ``Winv``) and the row statistics, into the slot after
    ``P``'s T tiles, is made here (else by `_stats_kernel` before): the programs with a tile fewer than the
    others (the last, partial wave leaves NUM_SMS − T mod NUM_SMS of them idle) take the row blocks in
    turn after their tiles, `_stats_block`; program 0 zeroes ``Ws`` as `_stats_kernel` does. The host
    sets it only where that slack has room (`_slack_stats`).
    Row strides sxm, sw (of W as stored), sym; unit inner strides, 16-byte aligned rows (`_persistent_ok`).
    DOT_F32: the interpreter's dots in fp32 (as `_gemm_tile`'s)."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    xd = tl.make_tensor_descriptor(X, shape=[M, K], strides=[sxm, 1], block_shape=[BLOCK_M, BLOCK_K])
    if W_KN:
        wd = tl.make_tensor_descriptor(W, shape=[K, N], strides=[sw, 1], block_shape=[BLOCK_K, BLOCK_N])
    else:
        wd = tl.make_tensor_descriptor(W, shape=[N, K], strides=[sw, 1], block_shape=[BLOCK_N, BLOCK_K])
    yd = tl.make_tensor_descriptor(Y, shape=[M, N], strides=[sym, 1], block_shape=[BLOCK_M, BLOCK_N])
    for tile in tl.range(pid, num_pid_m * num_pid_n, NUM_SMS, flatten=True):
        pid_m, pid_n = _grouped_tile(tile, num_pid_m, num_pid_n, GROUP)
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for kb in range(tl.cdiv(K, BLOCK_K)):
            a = xd.load([pid_m * BLOCK_M, kb * BLOCK_K])
            if W_KN:
                b = wd.load([kb * BLOCK_K, pid_n * BLOCK_N])
            else:
                b = wd.load([pid_n * BLOCK_N, kb * BLOCK_K]).T
            acc = _mma(a, b, acc, DOT_F32)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        if HAS_BIAS:
            acc += tl.load(Bias + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        yv = acc.to(Y.dtype.element_ty)
        if VERIFY_OUTPUT:
            v = tl.where(n_ok[None, :], yv.to(tl.float32), 0.0)
        else:
            v = tl.where(n_ok[None, :], acc, 0.0)
        m_ok = offs_m < M
        prow = P + (pid_n * M + offs_m) * 2
        tl.store(prow, tl.sum(v, axis=1), mask=m_ok)
        tl.store(prow + 1, tl.sum(v * ((offs_n + 1).to(tl.float32) * inv_n)[None, :], axis=1), mask=m_ok)
        yd.store([pid_m * BLOCK_M, pid_n * BLOCK_N], yv)
    if STATS:
        if pid == 0:
            tl.store(Ws, 0)
        full = (num_pid_m * num_pid_n) % NUM_SMS  # programs 0 .. full-1 have one tile more
        if pid >= full:
            sd = tl.make_tensor_descriptor(X, shape=[M, K], strides=[sxm, 1], block_shape=[BLOCK_M, STATS_BK])
            for rb in range(pid - full, num_pid_m, NUM_SMS - full):
                _stats_block(sd, W16, Winv, P + num_pid_n * M * 2, Flag, rb * BLOCK_M, M, K, call_id, BLOCK_M,
                             STATS_BK, STATS_STAGES, DOT_F32)


def interpreting() -> bool:
    """True when this module's kernels run through Triton's CPU interpreter (`tl_common.runs_interpreted`)."""
    return runs_interpreted(_gemm_kernel)


_INTERP = interpreting()
_GEMM_LAUNCH = DirectLauncher(_gemm_kernel, _INTERP)
_VERIFY_LAUNCH = DirectLauncher(_verify_kernel, _INTERP)
_GROUPED_LAUNCH = DirectLauncher(grouped_gemm_kernel, _INTERP)
_STATS_LAUNCH = DirectLauncher(_stats_kernel, _INTERP)
_PERSISTENT_LAUNCH = DirectLauncher(_persistent_kernel, _INTERP)
# where each launch takes its call id (the decode kernel takes none: it has no non-finite flag)
_CALL_ID_AT = (_gemm_kernel.arg_names.index("call_id"), _verify_kernel.arg_names.index("call_id"), None,
               _stats_kernel.arg_names.index("call_id"), _persistent_kernel.arg_names.index("call_id"))


def _launcher(which: int) -> DirectLauncher:
    """0: the GEMM's launcher, 1: the verify kernel's, 2: the decode kernel's, 3: the persistent form's pass
    over x, 4: its GEMM (looked up at each call, so tests can replace them)."""
    return (_GEMM_LAUNCH, _VERIFY_LAUNCH, _GROUPED_LAUNCH, _STATS_LAUNCH, _PERSISTENT_LAUNCH)[which]


# ------------------------------------------------------------------------------------------------
# Host side
# ------------------------------------------------------------------------------------------------

@dataclass
class _Launch:
    """Everything one call needs, resolved on the host (no device reads)."""

    x: torch.Tensor  # (M, K)
    w: torch.Tensor  # (N, K) or (K, N) storage
    b: torch.Tensor | None
    y: torch.Tensor  # (M, N)
    swn: int
    swk: int
    kn: bool = False  # w is stored (K, N)
    tma: bool = False  # load x, w and store y through TMA tensor descriptors (`_tma_ok`)


TMA_MIN_MNK = 1 << 36  # eager calls with fewer multiply-adds (M·N·K < 4096³) load through pointers, see `_tma_ok`
_CAPABILITY: dict[torch.device, int] = {}


def _hopper(dev: torch.device) -> bool:
    """Whether the CUDA device is a Hopper or newer GPU (TMA), cached per device."""
    cap = _CAPABILITY.get(dev)
    if cap is None:
        cap = _CAPABILITY[dev] = torch.cuda.get_device_capability(dev)[0]
    return cap >= 9


def _host_bound(m: int, n: int, k: int) -> bool:
    """An eager call this small takes longer on the host than on the GPU (H100: < TMA_MIN_MNK multiply-adds)."""
    return m * n * k < TMA_MIN_MNK


def _tma_ok(m: int, n: int, k: int, *ts: torch.Tensor) -> bool:
    """Whether this call moves its tiles through TMA tensor descriptors.

    The layout must allow it: a Hopper-or-newer GPU (or the interpreter), unit inner stride,
    16-byte aligned base and row stride. And it must pay: the three descriptors are encoded on the
    host at every launch, ~0.1 ms of host time per call on the H100's host (pointer-load launch
    0.12-0.15 ms, TMA 0.22-0.25 ms), which an eager call of fewer than ``TMA_MIN_MNK`` multiply-adds
    (~0.1 ms of GPU time) cannot hide. The choice depends on the shape only, not on whether a CUDA
    graph is being captured: a captured call must find its config already tuned by the eager
    warm-up calls (tuning times launches, which a capture cannot).
    ``FTT_ABFT_GEMM_TMA``: ``0`` never, ``1`` whenever the layout allows, unset or ``auto`` as above
    (the interpreter: whenever the layout allows, so that the tests cover the descriptor path).
    """
    mode = env_get("FTT_ABFT_GEMM_TMA", "auto")
    if mode == "0":
        return False
    dev = ts[0].device
    if not _INTERP:
        if dev.type != "cuda":
            return False
        if not _hopper(dev):
            return False
        if mode != "1" and _host_bound(m, n, k):
            return False
    return _tma_layout(*ts)


def _tma_layout(*ts: torch.Tensor) -> bool:
    """Whether these 2-D tensors can be moved by TMA descriptors: unit inner stride, 16-byte aligned base
    and row stride."""
    for t in ts:
        es = t.element_size()
        if t.stride(1) != 1 or (t.stride(0) * es) % 16 or t.data_ptr() % 16:
            return False
    return True


try:  # the scratch memory of TMA descriptors made in a kernel comes from Triton's allocator (Triton ≥ 3.4)
    from triton.runtime import _allocation as _triton_allocation
except ImportError:  # pragma: no cover - older triton: no persistent form
    _triton_allocation = None


_SCRATCH: dict[tuple, torch.Tensor] = {}  # (device, stream, bytes) → the eager launches' scratch buffer


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Triton's global-scratch allocator (the persistent kernel's TMA descriptors), from torch's caching
    allocator: on the interpreter's CPU, or the current CUDA device. Eager launches reuse one buffer per
    (device, stream, size), since launches on one stream run one after the other (no programmatic dependent
    launch here; a fresh buffer per launch was 5 µs of host time per call); a captured launch gets its own,
    from its graph's pool (such memory must not be kept past the graph)."""
    if _INTERP:
        return torch.empty(size, dtype=torch.int8, device="cpu")
    if torch.cuda.is_current_stream_capturing():
        return torch.empty(size, dtype=torch.int8, device="cuda")
    key = (torch.cuda.current_device(), stream, size)
    buf = _SCRATCH.get(key)
    if buf is None:
        buf = _SCRATCH[key] = torch.empty(size, dtype=torch.int8, device="cuda")
    return buf


def _ensure_scratch_allocator() -> None:
    """Set `_scratch` as Triton's allocator where none is set (Triton keeps it per context, so a thread of
    its own has none); an allocator the user set stays."""
    if isinstance(_triton_allocation._allocator.get(), _triton_allocation.NullAllocator):
        triton.set_allocator(_scratch)


def _persistent_ok(m: int, n: int, k: int, x2d: torch.Tensor, weight: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether a checked call takes the persistent form (`_persistent_kernel`, see PERSISTENT_CONFIG): fp16/bf16
    operands in a TMA layout on a Hopper-or-newer GPU, N ≥ PERSISTENT_MIN_N and M·N·K ≥ PERSISTENT_MIN_MNK, and
    for an eager call M·N·K ≥ TMA_MIN_MNK (smaller ones are host-bound: the form's three launches made a 4k
    prefill of Qwen2-0.5B 1-1.5 ms slower in wall time on an H200's host, against 1.3 ms less GPU time,
    session 31; with the pass in the GEMM's idle programs, two launches, a 4096 × 4864 × 896 call still took
    14-19 µs more host time than the tile form's, for 30-35 µs less GPU time, and the prefill's wall time
    did not improve, session 32).
    ``FTT_ABFT_GEMM_PERSISTENT``: ``0`` never, ``1`` whenever the operands allow (the interpreter too: the
    tests), unset or ``auto`` as above (never in the interpreter)."""
    mode = env_get("FTT_ABFT_GEMM_PERSISTENT", "auto")
    if mode == "0" or _triton_allocation is None or x2d.dtype not in (torch.float16, torch.bfloat16):
        return False
    if _INTERP:
        if mode != "1":
            return False
    else:
        if not _hopper(x2d.device):
            return False
        if mode != "1":
            if n < PERSISTENT_MIN_N or m * n * k < PERSISTENT_MIN_MNK:
                return False
            if _host_bound(m, n, k) and not torch.cuda.is_current_stream_capturing():
                return False  # an eager call this small is host-bound: the tile form, whose launches cost less
    return _tma_layout(x2d, weight, y)


def _descriptors(cfg, L: _Launch):
    """(Xd, Wd, Yd) tensor descriptors with the config's block shapes, or (x, w, y) without TMA."""
    if not L.tma:
        return L.x, L.w, L.y
    from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: PLC0415

    bm, bn, bk = cfg[:3]
    return (TensorDescriptor.from_tensor(L.x, [bm, bk]),
            TensorDescriptor.from_tensor(L.w, [bk, bn] if L.kn else [bn, bk]),
            TensorDescriptor.from_tensor(L.y, [bm, bn]))


def _bucket(m: int) -> int:
    return 16 if m <= 16 else 64 if m <= 64 else 1 << min(max(int(m - 1).bit_length(), 7), 13)


def _candidates(dtype: torch.dtype, m: int, n: int) -> list[tuple[int, int, int, int, int]]:
    if dtype == torch.float32:
        return CONFIGS_FP32
    if m <= 16:
        return CONFIGS_SMALL
    if m <= 64:
        return CONFIGS_MID
    return CONFIGS_LARGE + CONFIGS_NARROW if n <= NARROW_N else CONFIGS_LARGE


def _forced_config() -> tuple[int, int, int, int, int] | None:
    env = env_get("FTT_ABFT_GEMM_CONFIG")
    if not env:
        return None
    vals = tuple(int(v) for v in env.split(","))
    if len(vals) != 5:
        raise ValueError(f"FTT_ABFT_GEMM_CONFIG must be 'BLOCK_M,BLOCK_N,BLOCK_K,num_warps,num_stages', got {env!r}")
    return vals  # type: ignore[return-value]


def _inj_table(plan: FaultPlan | None, m: int, n: int, dtype: torch.dtype, device: torch.device,
               block_m: int) -> torch.Tensor | None:
    """int32 [CSR over row blocks (num_blocks + 1) | (row, col, bit) triples], or None.

    Positions and bits are those `SiteFaults.apply` would flip on the reference path (bit mode: the
    drawn positions; BER mode: the same generator draws over the whole (M, N) output)."""
    if not plan:
        return None
    sf = plan.for_site(SITE, (m, n), dtype, device)
    if sf is None:
        return None
    if sf.spec.bit is not None:
        pos = sf.positions
        if pos is None or pos.numel() == 0:
            return None
        rows, cols = pos[:, 0].to(torch.int64), pos[:, 1].to(torch.int64)
        bits = torch.full_like(rows, int(sf.spec.bit))
    else:
        from .contract import derive_seed  # noqa: PLC0415

        g = torch.Generator().manual_seed(derive_seed(sf.seed, 0))
        flip = torch.rand((m, n), generator=g) < float(sf.spec.ber)
        allbits = torch.randint(0, sf.nbits, (m, n), generator=g)
        idx = flip.nonzero()
        if idx.numel() == 0:
            return None
        rows, cols = idx[:, 0], idx[:, 1]
        bits = allbits[rows, cols]
    sf.injected += int(rows.numel())
    nblk = -(-m // block_m)
    order = torch.argsort(rows, stable=True)
    rows, cols, bits = rows[order], cols[order], bits[order]
    counts = torch.bincount(rows // block_m, minlength=nblk)
    csr = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(counts, 0)])
    trip = torch.stack([rows, cols, bits], dim=1).reshape(-1)
    return torch.cat([csr, trip]).to(torch.int32).to(device)


def _threshold_consts(wc, emax: float, csigma: float) -> tuple[float, ...]:
    """Host constants of `WeightChecksums.thresholds`: (det, v2, v3, var23, var4, bias)."""
    n = float(wc.n)
    return (emax * n * wc.sum_abs_mu, n * wc.sum_var, n * n * wc.sum_mu2, emax * csigma,
            emax * csigma * math.sqrt(n * wc.sum_var),
            emax * (n * abs(wc.bias_mu) + csigma * math.sqrt(n) * wc.bias_sd))


@dataclass
class _Verify:
    """The verification arguments of one call (`_verify_kernel`'s, and the one-launch GEMM's)."""

    b12: torch.Tensor  # (2,) fp32: bias checksums
    counters: torch.Tensor  # (6, 5) int32
    debug: torch.Tensor | None  # (M, 4) fp32 or None
    w_finite: bool
    capacity: int
    th: tuple[float, ...]  # `_threshold_consts`
    reverify: float
    correct: bool

    def args(self, n: int, k: int, placeholder: torch.Tensor) -> tuple:
        """From ``Cnt`` to ``reverify_scale`` in the kernels' order (``Dbg`` = placeholder if None)."""
        c = self.counters
        return (c, self.debug if self.debug is not None else placeholder, c.stride(0), c.stride(1), float(n),
                1.0 / k, int(self.w_finite), int(self.capacity), *self.th, self.reverify)


_CELLS: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _cells(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-device cells that outlive calls (no allocation per call, fixed addresses for CUDA graphs):
    ``(block, slots, sums)``. ``block`` (8 + ONE_LAUNCH_ROW_BLOCKS,) int32 is the one-launch GEMM's
    (see `_gemm_kernel`), all 0 between calls (its programs reset what they used); ``slots`` (1,)
    int32 is the two-launch call's recompute slot counter (zeroed by the GEMM launch's first program,
    then claimed by the verify launch that follows it on the stream); ``sums`` (CSUM_ROWS, 2) fp32,
    0 between calls, holds a decode call's row sums, added by its tiles and read and reset by its
    verifying program (`_gemm_kernel`'s CSUM)."""
    c = _CELLS.get(device)
    if c is None:
        buf = torch.zeros(9 + ONE_LAUNCH_ROW_BLOCKS, dtype=torch.int32, device=device)
        sums = torch.zeros(CSUM_ROWS * 2, dtype=torch.float32, device=device)
        c = _CELLS[device] = (buf[:8 + ONE_LAUNCH_ROW_BLOCKS], buf[8 + ONE_LAUNCH_ROW_BLOCKS:], sums)
    return c


def _stats_buffer(t: int, m: int, device: torch.device, n_csum: int = 0, part: int = 0) -> torch.Tensor:
    """fp32: the tiles' (T, M, 2) row sums, then their (T, M, 8) checksum partials and row
    statistics (the kernels address the second part as ``P + T·M·2``); with ``n_csum`` checksum
    programs (`_csum_layout`), at least their (n_csum, M, 8) slots followed by ``part`` floats (the
    split-K partial tiles, (n_split, M, N))."""
    return torch.empty(max(t * m * (2 + _STATS_W), n_csum * m * _STATS_W + part), dtype=torch.float32,
                       device=device)


def _csum_layout(m: int, k: int, block_m: int, one: bool) -> tuple[int, int, int]:
    """(n_csum, CSUM_R, CSUM_K): the checksum programs of a one-launch call of one row block with
    M ≤ CSUM_ROWS (n_csum = 0: the tiles compute the checksums)."""
    if not one or m > CSUM_ROWS or m > block_m:
        return 0, 1, 16
    r = triton.next_power_of_2(m)
    ck = min(CSUM_ELEMS // r, triton.next_power_of_2(k))
    return _cdiv(k, ck), r, ck


def _split_plan(m: int, n: int, k: int, cfg, n_csum: int, detect: bool, device: torch.device) -> tuple[int, int]:
    """(n_split, kb_per) of a call (`_split_k`): split-K for a decode call with checksum programs, and
    for the plain GEMM of one row block of M ≤ CSUM_ROWS (the same sums, so that checks off and on
    give the same y); ``(1, 1)`` otherwise, or when the config says so (a 6th entry ``False``, which
    the tuner appends to a candidate that it timed faster without split-K)."""
    if len(cfg) > 5 and not cfg[5]:
        return 1, 1
    if n_csum or (not detect and m <= CSUM_ROWS and m <= cfg[0]):
        return _split_k(n, k, cfg[1], cfg[2], device)
    return 1, 1


def _call_buffer(m: int, n: int, k: int, cfg, one: bool, detect: bool, device: torch.device,
                 unused: torch.Tensor) -> torch.Tensor:
    """The `_stats_buffer` of a call with config ``cfg``, one launch or two; checks off: room for the
    split-K partials, or ``unused`` (any tensor, passed as the kernel's unread ``P``) without them."""
    n_csum = _csum_layout(m, k, cfg[0], one)[0] if detect else 0
    n_split = _split_plan(m, n, k, cfg, n_csum, detect, device)[0]
    part = n_split * m * n if n_split > 1 else 0
    if not detect:
        return torch.empty(part, dtype=torch.float32, device=device) if part else unused
    return _stats_buffer(_cdiv(n, cfg[1]), m, device, n_csum, part)


def _split_k(n: int, k: int, block_n: int, block_k: int, device: torch.device) -> tuple[int, int]:
    """(n_split, kb_per) of a decode call with checksum programs: each of its T tiles runs as n_split
    programs of kb_per ≥ SPLIT_MIN_BLOCKS K blocks (the last may have fewer; none is empty), n_split ≤
    SPLIT_PROGRAMS_PER_SM · SMs / T, so that a call of few tiles still fills the GPU. ``(1, ·)``:
    no split. ``FTT_ABFT_GEMM_SPLIT=S`` asks for S splits (1: never split). Never past SPLIT_MAX_TILES
    tiles: their split counts live in the one-launch cell block."""
    t, nkb = _cdiv(n, block_n), _cdiv(k, block_k)
    if t > SPLIT_MAX_TILES:
        return 1, nkb
    env = env_get("FTT_ABFT_GEMM_SPLIT")
    if env:
        want = int(env)
        if want < 1:
            raise ValueError(f"FTT_ABFT_GEMM_SPLIT must be a positive integer, got {env!r}")
    else:
        sms = sm_count(device) if device.type == "cuda" else INTERPRET_SMS
        want = SPLIT_PROGRAMS_PER_SM * sms // t
    per = _cdiv(nkb, max(1, min(want, nkb)))
    if not env:
        per = max(per, SPLIT_MIN_BLOCKS)
    return _cdiv(nkb, per), per


_EMAX: dict[tuple, float] = {}


def _emax(dtype: torch.dtype, device: torch.device, mode: str, k: int) -> float:
    """`default_emax`, memoised per (dtype, device, mode, K): it reads the device's table and name on
    every call. Not memoised for fp32 output-side entries, which follow the current matmul precision."""
    if mode == "output" and dtype == torch.float32:
        return default_emax(dtype, device.type, mode, k=k)
    key = (dtype, device, mode, k)
    e = _EMAX.get(key)
    if e is None:
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            e = _EMAX[key] = default_emax(dtype, device.type, mode, k=k)
    return e


def _reverify_scale(dtype: torch.dtype, device: torch.device, k: int, emax: float, correct: bool,
                    verify_output: bool) -> float:
    """The threshold factor a repaired row is re-verified with: it is re-verified as stored (rounded), so
    with the output-side unit error (1 without correction or in output mode)."""
    if not correct or verify_output:
        return 1.0
    return max(1.0, _emax(dtype, device, "output", k) / float(emax))


def _one_launch(m: int, n: int, k: int, block_m: int, device: torch.device) -> bool:
    """Whether this call verifies inside the GEMM launch (`_gemm_kernel`'s ONE_LAUNCH) instead of in a
    second launch (`_verify_kernel`). Measured on the H100 (``docs/vabft.md``, session 18):

    * a single row block (decode): one launch, also under CUDA graphs (0.51-0.55× cuBLAS against
      0.48-0.54× with two);
    * several row blocks, eager and below ``TMA_MIN_MNK`` multiply-adds: one launch, since such calls
      are host-bound and the second launch costs ~0.1 ms of host time (2048³: 0.27× cuBLAS eagerly
      against 0.14× with two);
    * several row blocks otherwise (captured into a CUDA graph, or large): two launches, faster on
      the GPU (under graphs 2048³ 0.67× against 0.57×, 4096³ 0.84× against 0.75×: the last tile
      of each row block verifies it serially, and y cannot leave through a TMA store).

    ``FTT_ABFT_GEMM_ONE_LAUNCH``: ``0`` never, ``1`` always, unset or ``auto`` as above. Calls of more
    row blocks than the cells hold take two launches.
    """
    mode = env_get("FTT_ABFT_GEMM_ONE_LAUNCH", "auto")
    blocks = _cdiv(m, block_m)
    if mode == "0" or blocks > ONE_LAUNCH_ROW_BLOCKS:
        return False
    if mode == "1" or blocks == 1:
        return True
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return False
    return _host_bound(m, n, k)


def _groupable(n: int, dtype: torch.dtype) -> bool:
    """Whether a weight of ``n`` output features may take the decode kernel in ``dtype``: at most
    GROUPED_MAX_TILES tiles, fp16 or bf16 (fp32 calls keep the row check: the kernel's fp32 form compiles for
    sm_90 now, but an earlier form made Triton 3.6 assert, and none was timed), and not
    ``FTT_ABFT_GEMM_GROUPS=0`` (the row-checked one-launch form instead)."""
    return (_cdiv(n, GROUP_COLS) <= GROUPED_MAX_TILES and dtype != torch.float32
            and env_get("FTT_ABFT_GEMM_GROUPS") != "0")


def _grouped(m: int, n: int, dtype: torch.dtype, debug: torch.Tensor | None, capacity: int) -> bool:
    """Whether a checked call runs the decode kernel (`abft_decode`: each tile verifies its 64 columns):
    a `_groupable` weight, M ≤ GROUPED_MAX_ROWS, no ``debug`` output (it has no per-row D1), at least M
    recompute slots (it recomputes every failing row of a tile), and a forced config
    (``FTT_ABFT_GEMM_CONFIG``), if any, that fits it."""
    if m > GROUPED_MAX_ROWS or debug is not None or capacity < m or not _groupable(n, dtype):
        return False
    forced = _forced_config()
    return forced is None or (forced[0] >= max(m, 16) and forced[1] == GROUP_COLS)


def _group_sums(wc: WeightChecksums, weight: torch.Tensor, bias: torch.Tensor | None,
                weight_is_kn: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight's `abft_decode.group_checksums`, cached with its `WeightChecksums`."""
    g = wc.groups.get(GROUP_COLS)
    if g is None:
        g = wc.groups[GROUP_COLS] = group_checksums(weight, bias, weight_is_kn)
    return g


def _stats_operand(wc: WeightChecksums, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight's checksum vectors as `_stats_block`'s dot operand, cached with its `WeightChecksums`:
    ``W16`` (K, 16) in ``dtype`` (fp16 / bf16) holds ``w1`` in slices (columns 0 .. P-1), ``w2`` in slices
    (P .. 2P-1) and ones (column 2P): P = 2 slices for fp16 (scaled by a power of two so that the larger
    |value| lands in [2^14, 2^15): 22 significant bits, nothing overflows), 3 for bf16 (24 bits, unscaled);
    ``Winv`` (2,) fp32 the inverse scales. Device ops only (no host read)."""
    key = ("stats", dtype)
    op = wc.groups.get(key)
    if op is None:
        w12 = wc.w12
        parts = 2 if dtype == torch.float16 else 3
        scale = torch.ones(2, dtype=torch.float32, device=w12.device)
        if dtype == torch.float16:  # amax = f·2^e with f in [0.5, 1): ·2^(15 − e) puts it in [2^14, 2^15)
            scale = torch.ldexp(scale, 15 - torch.frexp(w12.abs().amax(0)).exponent)
        rest = w12 * scale
        w16 = torch.zeros((w12.shape[0], 16), dtype=dtype, device=w12.device)
        for i in range(parts):
            sl = rest.to(dtype)
            w16[:, i], w16[:, parts + i] = sl[:, 0], sl[:, 1]
            rest = rest - sl.float()
        w16[:, 2 * parts] = 1
        op = wc.groups[key] = (w16, 1.0 / scale)
    return op


def _grouped_split(n: int, k: int, cfg, device: torch.device) -> tuple[int, int]:
    """(n_split, kb_per) of a decode-kernel call: `_split_k`, or none when the config says so."""
    if len(cfg) > 5 and not cfg[5]:
        return 1, 1
    return _split_k(n, k, cfg[1], cfg[2], device)


def _grouped_buffer(m: int, n: int, k: int, cfg, device: torch.device) -> torch.Tensor | None:
    """The decode kernel's split-K partials: (n_split, M, N) tiles, then (n_split, T, M, 4) checksums and
    statistics; None without split-K."""
    s = _grouped_split(n, k, cfg, device)[0]
    if s == 1:
        return None
    return torch.empty(s * m * (n + _cdiv(n, cfg[1]) * 4), dtype=torch.float32, device=device)


def _grouped_call(cfg, L: _Launch, *, bias, groups, P, inj, ver: _Verify, emax: float, csigma: float,
                  verify_output: bool, dot_f32: bool, siblings: tuple = ()) -> tuple:
    """The decode kernel's launch as ``(grid, args, kwargs)``; ``groups`` = (w1g, consts) of
    `_group_sums`, ``P`` = `_grouped_buffer`. ``siblings``: up to two more weights after ``L.w`` in the
    same launch (`checked_gemm_siblings`), each ``(weight, bias, groups, counters)``; ``L.y`` then holds
    all their columns, ``L.w``'s first."""
    bm, bn, bk, warps, stages = cfg[:5]
    assert bn == GROUP_COLS, cfg
    m, k = L.x.shape
    n = L.y.shape[1]
    w1g, gc = groups
    n_split, kb_per = _grouped_split(n, k, cfg, L.x.device)
    c = ver.counters
    seg = [(L.w, bias if bias is not None else gc, w1g, gc, c)]
    starts, t0 = [], _cdiv(L.w.shape[1] if L.kn else L.w.shape[0], bn)
    for w_s, b_s, (w1g_s, gc_s), c_s in siblings:
        seg.append((w_s, b_s if b_s is not None else gc_s, w1g_s, gc_s, c_s))
        starts.append(t0)
        t0 += _cdiv(w_s.shape[0], bn)
    segs = len(seg)
    seg += [seg[0]] * (3 - segs)
    starts += [0] * (2 - len(starts))
    return (_cdiv(n, bn) * n_split,), (
        L.x, L.w, L.y, seg[0][1], w1g, gc, inj if inj is not None else gc,
        P if P is not None else gc, _cells(L.x.device)[0], c, *seg[1], *seg[2], *starts,
        m, n, k, L.x.stride(0), L.x.stride(1), L.swn, L.swk, L.y.stride(0), L.y.stride(1), c.stride(0), c.stride(1),
        1.0 / k, float(emax), float(csigma), float(ver.reverify), int(ver.w_finite), n_split, kb_per,
    ), dict(
        BLOCK_M=bm, G=bn, BLOCK_K=bk, ROWS=triton.next_power_of_2(m), HAS_BIAS=bias is not None,
        VERIFY_OUTPUT=verify_output,
        INJ=inj is not None, DOT_F32=dot_f32, EVEN_K=k % bk == 0, CORRECT=ver.correct, SPLIT=n_split > 1,
        SEGS=segs, num_warps=warps, num_stages=stages,
    )


def _launch_gemm(cfg, L: _Launch, **kw) -> None:
    """Launch `_gemm_call`'s GEMM."""
    _launcher(0)(*_gemm_call(cfg, L, **kw))


def _gemm_call(cfg, L: _Launch, *, bias, w12, P, inj, flag, ws, call_id, detect, verify_output, dot_f32,
               verify: _Verify | None = None) -> tuple:
    """The GEMM launch as ``(grid, args, kwargs)``; with ``verify`` (`_one_launch`) it verifies too.

    P: the `_stats_buffer` (or any placeholder without ``detect``); ws: the int32 cells the launch
    uses (the recompute slot counter, or with ``verify`` the one-launch cell block of `_cells`)."""
    bm, bn, bk, warps, stages = cfg[:5]
    m, k = L.x.shape
    n = L.y.shape[1]
    t = _cdiv(n, bn)
    one = verify is not None
    n_csum, csum_r, csum_k = _csum_layout(m, k, bm, one)
    n_split, kb_per = _split_plan(m, n, k, cfg, n_csum, detect, L.x.device)
    grid = (_cdiv(m, bm) * t * n_split + n_csum,)
    xd, wd, yd = _descriptors(cfg, L)
    if one:
        vargs = (ws, verify.b12, *verify.args(n, k, P))  # ws: the one-launch cell block, as Sem
    else:
        # Sem: the split-K counts of the plain GEMM's tiles are in the one-launch cells too
        vargs = (_cells(L.x.device)[0] if n_split > 1 else flag, flag, flag, flag, 0, 0, 1.0, 1.0, 0, 0,
                 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0)
    vargs += (_cells(L.x.device)[2] if n_csum else P, n_csum, n_split, kb_per)
    vbn, vbk = VERIFY_BLOCK
    return grid, (
        L.x, L.w, L.y, xd, wd, yd, bias if bias is not None else L.y, w12, P, inj if inj is not None else ws,
        flag, ws,
        m, n, k, L.x.stride(0), L.x.stride(1), L.swn, L.swk, L.y.stride(0), L.y.stride(1),
        1.0 / n, call_id, *vargs,
    ), dict(
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP=GROUP_M, HAS_BIAS=bias is not None, DETECT=detect,
        VERIFY_OUTPUT=verify_output, INJ=inj is not None, DOT_F32=dot_f32, EVEN_K=k % bk == 0,
        TMA=L.tma, W_KN=L.kn, TMA_STORE=L.tma and not one, ONE_LAUNCH=one, VERIFY_R=min(bm, ONE_LAUNCH_VERIFY_ROWS),
        VBLOCK_N=vbn, VBLOCK_K=vbk, VBLOCK_T=VERIFY_TILES, CORRECT=one and verify.correct,
        DEBUG=one and verify.debug is not None, CSUM=n_csum > 0, CSUM_R=csum_r, CSUM_K=csum_k, SPLIT=n_split > 1,
        num_warps=warps, num_stages=stages,
    )


def _slack_stats(m: int, n: int, cfg, sms: int) -> bool:
    """Whether the persistent GEMM's programs with a tile fewer (`_persistent_kernel`'s STATS) make the pass
    over x: there are some (the tiles do not fill whole waves of ``sms`` programs), and none takes more than
    SLACK_ROW_BLOCKS of x's row blocks. A row block's pass reads a third of a (128, 256) tile's operand bytes
    and does no MMA, so two fit in the time of the tile such a program does not have (session 32); else
    `_stats_kernel` runs first, a launch of its own."""
    if env_get("FTT_ABFT_GEMM_SLACK_STATS", "1") == "0":
        return False
    tiles = _cdiv(m, cfg[0]) * _cdiv(n, cfg[1])
    idle = sms - tiles % sms if tiles % sms else 0
    return idle > 0 and _cdiv(_cdiv(m, cfg[0]), idle) <= SLACK_ROW_BLOCKS


def _persistent_call(cfg, L: _Launch, bias: torch.Tensor | None, P: torch.Tensor, verify_output: bool, *,
                     sms: int, stats: tuple | None, flag: torch.Tensor, ws: torch.Tensor, call_id: int) -> tuple:
    """The persistent form's GEMM (`_persistent_kernel`) as ``(grid, args, kwargs)``: one program per SM of the
    ``sms`` (per tile if fewer, unless ``stats``, `_stats_operand`'s (W16, Winv): then the pass over x too,
    `_slack_stats`)."""
    bm, bn, bk, warps, stages = cfg[:5]
    m, k = L.x.shape
    n = L.y.shape[1]
    if stats is None:
        sms = min(_cdiv(m, bm) * _cdiv(n, bn), sms)
    w16, winv = stats if stats is not None else (L.x, P)
    return (sms,), (L.x, L.w, L.y, bias if bias is not None else L.y, P, w16, winv, flag, ws, m, n, k,
                    L.x.stride(0), L.w.stride(0), L.y.stride(0), 1.0 / n, call_id), dict(
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP=GROUP_M, NUM_SMS=sms, HAS_BIAS=bias is not None, W_KN=L.kn,
        VERIFY_OUTPUT=verify_output, DOT_F32=_INTERP, STATS=stats is not None,
        STATS_BK=bk if _INTERP else SLACK_BLOCK_K, STATS_STAGES=SLACK_STAGES, num_warps=warps, num_stages=stages)


def _pick_config(L: _Launch, *, bias, detect, verify_output, dot_f32, grouped: bool = False, siblings: tuple = ()):
    """The block sizes for this call: forced, interpreter, or timed once per shape key (CUDA).
    ``grouped``: for the decode kernel (`_grouped`); ``siblings``: the weights after ``L.w`` in a
    `checked_gemm_siblings` launch, as `_grouped_call` takes them (timed per exact M: at 1 × 9728 × 896
    and 16 × 9728 × 896 different configs were fastest, 11.7 and 9.3 µs, H200)."""
    forced = _forced_config()
    if forced is not None:
        return forced
    m, k = L.x.shape
    n = L.y.shape[1]
    if _INTERP:  # the plain GEMM of a decode shape takes the decode kernel's blocks: the same sums as its
        plain_decode = not detect and _grouped(m, n, L.x.dtype, None, m)
        return CONFIG_INTERPRET_GROUPED if grouped or plain_decode else CONFIG_INTERPRET
    # (the forms a decode call is timed in depend on the one-launch and split-K settings)
    key = (L.x.dtype, L.kn, L.tma, bias is not None, detect, verify_output, m if siblings else _bucket(m), n, k,
           grouped, tuple(sib[0].shape[0] for sib in siblings),
           env_get("FTT_ABFT_GEMM_SPLIT"), env_get("FTT_ABFT_GEMM_ONE_LAUNCH"))
    cfg = _TUNE_CACHE.get(key)
    if cfg is not None:
        return cfg
    cands = CONFIGS_GROUPED if grouped else _candidates(L.x.dtype, m, n)
    if len(cands) == 1 or env_get("FTT_ABFT_GEMM_TUNE", "1") == "0":
        _TUNE_CACHE[key] = cands[0]
        return cands[0]
    dev = L.x.device
    if torch.cuda.is_current_stream_capturing():
        return cands[0]  # a capture cannot time candidates: the first, not cached (an eager call tunes)
    ws = torch.zeros(2, dtype=torch.int32, device=dev)
    w12 = torch.zeros((k, 2), dtype=torch.float32, device=dev)
    flag = torch.zeros(1, dtype=torch.int32, device=dev)
    y_scratch = torch.empty_like(L.y)
    Ls = dataclasses.replace(L, y=y_scratch)
    # decode calls are timed in the form they run: one launch with checksum programs (and split-K),
    # verifying against an infinite threshold into scratch counters (nothing to detect or repair)
    ver = None
    if detect and m <= CSUM_ROWS:
        ver = _Verify(torch.zeros(2, dtype=torch.float32, device=dev), new_counters(dev), None, True, 0,
                      (0.0, 0.0, 0.0, 0.0, 0.0, float("inf")), 1.0, False)
    if grouped:
        # the decode kernel on scratch group checksums whose threshold is infinite (bias_sd = inf): it runs
        # its clean path, checks included, and finds nothing to repair. (Timed with its checks switched
        # off instead, w_finite = 0, it picked configs 1.6-1.9× slower than the first one, on an H200.)
        ng = _cdiv(n, GROUP_COLS)
        groups = (torch.zeros((ng, k), dtype=torch.float32, device=dev),
                  torch.zeros((ng, GROUP_CONSTS), dtype=torch.float32, device=dev))
        groups[1][:, 6] = float("inf")
        sib_scratch, t0 = [], _cdiv(L.w.shape[0], GROUP_COLS)
        for w_s, b_s, *_ in siblings:  # each sibling weight's slice of the scratch groups
            t1 = t0 + _cdiv(w_s.shape[0], GROUP_COLS)
            sib_scratch.append((w_s, b_s, (groups[0][t0:t1], groups[1][t0:t1]), ver.counters))
            t0 = t1

    def one_launch(c) -> bool:
        return ver is not None and not grouped and _one_launch(m, n, k, c[0], dev)

    def splits(c) -> int:
        if grouped:
            return _grouped_split(n, k, c, dev)[0]
        return _split_plan(m, n, k, c, _csum_layout(m, k, c[0], one_launch(c))[0] if detect else 0, detect, dev)[0]

    if not env_get("FTT_ABFT_GEMM_SPLIT"):
        # each config with split-K (where the call's form splits, `_split_plan`) and without
        cands = [v for c in cands for v in ((c, (*c, False)) if splits(c) > 1 else (c,))]
    copies = [Ls]
    if m <= CSUM_ROWS:  # a decode call: timed over copies of its weight, as a model streams its weights
        nbytes = L.w.numel() * L.w.element_size()
        for _ in range(min(TUNE_STREAM_COPIES, -(-TUNE_STREAM_BYTES // max(nbytes, 1))) - 1):
            w = torch.empty_strided(L.w.shape, L.w.stride(), dtype=L.w.dtype, device=dev).copy_(L.w)
            copies.append(dataclasses.replace(Ls, w=w))
    best, best_t = None, float("inf")
    for c in cands:
        one = one_launch(c)
        if grouped:
            P = _grouped_buffer(m, n, k, c, dev)

            def run(c=c, P=P):
                for Lc in copies:
                    _launcher(2)(*_grouped_call(c, Lc, bias=bias, groups=groups, P=P, inj=None, ver=ver, emax=1.0,
                                                csigma=1.0, verify_output=verify_output, dot_f32=dot_f32,
                                                siblings=tuple(sib_scratch)))
        else:
            P = _call_buffer(m, n, k, c, one, detect, dev, y_scratch)

            def run(c=c, one=one, P=P):
                for Lc in copies:
                    _launch_gemm(c, Lc, bias=bias, w12=w12, P=P, inj=None, flag=flag,
                                 ws=_cells(dev)[0] if one else ws, call_id=1, detect=detect,
                                 verify_output=verify_output, dot_f32=dot_f32, verify=ver if one else None)
        try:
            with torch.cuda.device(dev):
                ms = gpu_time(run)
        except Exception:  # noqa: BLE001 - a config that does not fit (shared memory, registers)
            continue
        if ms < best_t:
            best, best_t = c, ms
    if best is None:
        raise RuntimeError(f"no Triton config of the checked GEMM ran for {key}")
    _TUNE_CACHE[key] = best
    return best


def _check_device(t: torch.Tensor) -> None:
    dev = t.device
    if dev.type == "cuda":
        return
    if dev.type == "cpu" and _INTERP:
        return
    hint = ""
    if dev.type == "cpu" and env_get("TRITON_INTERPRET", "0") not in ("", "0"):
        hint = (" (TRITON_INTERPRET=1 is set, but triton was imported before it was: set it before anything "
                "imports triton)")
    raise AbftGemmUnsupported("the Triton checked GEMM needs CUDA tensors (or CPU tensors with "
                              f"TRITON_INTERPRET=1), got {dev}{hint}; use backend='reference'")


def _check_mode_counters(mode: str, detect: bool, counters: torch.Tensor | None, dev: torch.device) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if detect and (counters is None or tuple(counters.shape) != COUNTER_SHAPE or counters.dtype != torch.int32
                   or counters.device != dev):
        raise ValueError(f"counters must be an int32 {COUNTER_SHAPE} tensor on {dev}")


@on_tensor_device
def checked_gemm(
    x2d: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    weight_is_kn: bool = False,
    wc=None,
    emax: float | None = None,
    csigma: float = 2.5,
    detect: bool = True,
    correct: bool = True,
    plan: FaultPlan | None = None,
    counters: torch.Tensor | None = None,
    mode: str = "accumulator",
    debug: torch.Tensor | None = None,
    capacity: int = RECOMPUTE_ROWS,
) -> torch.Tensor:
    """The checked GEMM on 2-D operands; events are added into ``counters``.

    Args:
        x2d: (M, K) fp16/bf16/fp32, CUDA (or CPU under ``TRITON_INTERPRET=1``), any strides.
        weight: (N, K) (``nn.Linear``) or, with ``weight_is_kn``, (K, N) (GPT-2 ``Conv1D``); x's dtype.
        bias: (N,) or None.
        wc: the weight's `WeightChecksums` (of exactly ``weight``/``bias``); None builds them.
        emax: threshold unit error; None = ``default_emax(dtype, device, mode, k=K)``.
        detect / correct: verify / repair (``correct=False`` counts ``detected`` + ``uncorrectable``).
        plan: faults at ``linear.output`` (logical shape (M, N), y's dtype), or None.
        counters: (6, 5) int32 counter block on x's device (required when ``detect``).
        mode: ``"accumulator"`` (verify the fp32 accumulators, default) or ``"output"`` (verify the
            rounded output, like the PyTorch path; for studies and calibration).
        debug: optional (M, 4) fp32 tensor receiving per row ``D1``, ``C1``, ``T_m``.
        capacity: rows recomputed per call at most.
    Returns:
        y (M, N) in x's dtype.
    """
    for name, t in (("x", x2d), ("weight", weight), ("bias", bias)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _DTYPES:
            raise AbftGemmUnsupported(f"{name} has dtype {t.dtype}; the checked GEMM supports float16, bfloat16 "
                                      "and float32")
    if x2d.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"x must be 2-D (M, K) and weight 2-D, got {tuple(x2d.shape)} and {tuple(weight.shape)}")
    k_w, n = weight.shape if weight_is_kn else weight.shape[::-1]
    k = x2d.shape[1]
    if k != k_w:
        raise ValueError(f"x has K = {k} columns but weight {tuple(weight.shape)} has in_features = {k_w}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias must have shape ({n},), got {tuple(bias.shape)}")
    if weight.dtype != x2d.dtype or (bias is not None and bias.dtype != x2d.dtype):
        raise TypeError("x, weight and bias must share one dtype")
    _check_device(x2d)
    dev = x2d.device
    if weight.device != dev or (bias is not None and bias.device != dev):
        raise ValueError("x, weight and bias must be on one device")
    _check_mode_counters(mode, detect, counters, dev)
    return _checked_gemm(x2d, weight, bias, weight_is_kn, wc, emax, csigma, detect, correct, plan, counters, mode,
                         debug, capacity)


def _checked_gemm(x2d, weight, bias, weight_is_kn, wc, emax, csigma, detect, correct, plan, counters, mode, debug,
                  capacity, keep: list | None = None) -> torch.Tensor:
    """`checked_gemm` on validated arguments (the module path validates once, in `checked_linear`).
    ``keep``: a list the call's `_PreparedCall` is appended to (when it has one)."""
    n = weight.shape[1] if weight_is_kn else weight.shape[0]
    m, k = x2d.shape
    dev = x2d.device
    correct = bool(correct and detect)
    prep_key = None
    if detect and wc is not None and not plan and debug is None and m and n and k:
        prep_key = (m, *x2d.stride(), x2d.data_ptr() % 16 == 0, weight.data_ptr(), *weight.stride(),
                    bias.data_ptr() if bias is not None else None, counters.data_ptr(), *counters.stride(),
                    emax, csigma, correct, mode, capacity, _env_key(),
                    dev.type == "cuda" and torch.cuda.is_current_stream_capturing())
        prepared = wc.launches.get(prep_key)
        if prepared is not None:
            if keep is not None:
                keep.append(prepared)
            return prepared(x2d, counters)
    y = torch.empty((m, n), dtype=x2d.dtype, device=dev)
    if m == 0 or n == 0:
        return y
    if k == 0:  # nothing to multiply (or to verify): the bias, plus any injected flips
        y.copy_(bias.expand(m, n) if bias is not None else torch.zeros((), dtype=y.dtype, device=dev))
        sf = plan.for_site(SITE, (m, n), y.dtype, dev) if plan else None
        return sf.apply(y, dim=-1, start=0) if sf is not None else y
    swn, swk = (weight.stride(1), weight.stride(0)) if weight_is_kn else (weight.stride(0), weight.stride(1))
    L = _Launch(x2d, weight, bias, y, swn, swk, weight_is_kn, _tma_ok(m, n, k, x2d, weight, y))
    dot_f32 = x2d.dtype == torch.float32 or _INTERP
    verify_output = mode == "output"
    grouped = detect and _grouped(m, n, x2d.dtype, debug, capacity)
    if plan:
        if grouped:
            cfg = _forced_config() or (CONFIG_INTERPRET_GROUPED if _INTERP else CONFIGS_GROUPED[0])
        else:
            cfg = _forced_config() or (CONFIG_INTERPRET if _INTERP else CONFIG_INJECT)
        inj = _inj_table(plan, m, n, y.dtype, dev, cfg[0])
    else:
        inj = None
    # (the persistent form has no in-kernel injection: calls with a plan take the tile kernel)
    persist = detect and inj is None and not grouped and _persistent_ok(m, n, k, x2d, weight, y)
    if persist:
        cfg = _forced_config() or (PERSISTENT_CONFIG_INTERPRET if _INTERP else PERSISTENT_CONFIG)
    elif inj is None:
        cfg = _pick_config(L, bias=bias, detect=detect, verify_output=verify_output, dot_f32=dot_f32, grouped=grouped)
    sem, slots, _ = _cells(dev)
    if not detect:  # no flag: the plain GEMM never reads it
        _launch_gemm(cfg, L, bias=bias, w12=y, P=_call_buffer(m, n, k, cfg, False, False, dev, y), inj=inj, flag=slots,
                     ws=slots, call_id=0, detect=False, verify_output=False, dot_f32=dot_f32)
        return y
    if wc is None:
        wc = WeightChecksums.compute(weight, bias, weight_is_kn=weight_is_kn)
    if emax is None:
        emax = _emax(y.dtype, dev, mode, k)
    reverify = _reverify_scale(y.dtype, dev, k, emax, correct, verify_output)
    ver = _Verify(wc.b12, counters, debug, bool(wc.finite), int(capacity),
                  _threshold_consts(wc, float(emax), float(csigma)), reverify, correct)
    if not grouped and _groupable(n, x2d.dtype):
        # the weight's group checksums, built now if this call does not use them: a decode step compiled
        # with CUDA graphs (after an eager prefill) must find them made, since a tensor first allocated
        # in the graphs' warm-up lands in their pool and makes the capture fail ("tensor(s) in the
        # cudagraph pool not tracked as outputs")
        _group_sums(wc, weight, bias, weight_is_kn)
    if not grouped and x2d.dtype != torch.float32 and (
            persist or (n >= PERSISTENT_MIN_N and dev.type == "cuda" and _hopper(dev))):
        _stats_operand(wc, x2d.dtype)  # likewise (an eager call may not take the form its captured twin takes)
    t = _cdiv(n, cfg[1])
    one = grouped or (not persist and _one_launch(m, n, k, cfg[0], dev))
    # statistics slots that can hold a share (`_verify_rows`): the pass's one, or the tiles' up to the K blocks
    ts = 1 if persist else min(t, _cdiv(k, cfg[2]))
    if persist:
        flag, call_id = call_flag(dev, self_reset=False)
        P = _call_buffer(m, n, k, cfg, False, True, dev, y)
        sms = INTERPRET_SMS if _INTERP else sm_count(dev)
        slack = _slack_stats(m, n, cfg, sms)
        launches = [] if slack else [
            (3, (_cdiv(m, STATS_ROWS),), (x2d, wc.w12, P, flag, slots, m, k, t, x2d.stride(0), call_id),
             dict(R=STATS_ROWS, CK=STATS_COLS, num_warps=4))]
        launches.append((4, *_persistent_call(cfg, L, bias, P, verify_output, sms=sms, flag=flag, ws=slots,
                                              call_id=call_id, stats=_stats_operand(wc, x2d.dtype) if slack else None)))
    elif grouped:
        P, call_id = _grouped_buffer(m, n, k, cfg, dev), None
        launches = [(2, *_grouped_call(cfg, L, bias=bias, groups=_group_sums(wc, weight, bias, weight_is_kn), P=P,
                                       inj=inj, ver=ver, emax=emax, csigma=csigma, verify_output=verify_output,
                                       dot_f32=dot_f32))]
    else:
        flag, call_id = call_flag(dev, self_reset=one)  # one launch: its last program resets the flag
        P = _call_buffer(m, n, k, cfg, one, True, dev, y)
        launches = [(0, *_gemm_call(cfg, L, bias=bias, w12=wc.w12, P=P, inj=inj, flag=flag,
                                    ws=sem if one else slots, call_id=call_id, detect=True,
                                    verify_output=verify_output, dot_f32=dot_f32, verify=ver if one else None))]
    if not one:
        vbn, vbk = VERIFY_BLOCK
        launches.append((1, (_cdiv(m, VERIFY_ROWS),), (
            x2d, weight, y, bias if bias is not None else y, wc.b12, P, flag, slots,
            m, n, k, t, ts, x2d.stride(0), x2d.stride(1), swn, swk, y.stride(0), y.stride(1), 1.0 / n, call_id,
            *ver.args(n, k, P),
        ), dict(
            BLOCK_R=VERIFY_ROWS, BLOCK_N=vbn, BLOCK_K=vbk, BLOCK_T=VERIFY_TILES, HAS_BIAS=bias is not None,
            CORRECT=correct, DEBUG=debug is not None, DOT_F32=dot_f32, VERIFY_OUTPUT=verify_output, num_warps=4,
        )))
    if persist:
        _ensure_scratch_allocator()
    for which, grid, args, kwargs in launches:
        _launcher(which)(grid, args, kwargs)
    # (host TMA descriptors are made per call: such a call cannot be replayed; the persistent form makes its own)
    if prep_key is not None and (grouped or persist or not L.tma):
        if len(wc.launches) >= PREPARED_PER_WEIGHT:  # e.g. prefills of many lengths: start afresh
            wc.launches.clear()
        wc.launches[prep_key] = prepared = _PreparedCall.record(launches, x2d, y, P, counters, call_id)
        if keep is not None:
            keep.append(prepared)
    return y


SIBLINGS_MAX = 3  # weights per sibling launch (the decode kernel's SEGS)
SIBLINGS_MAX_ROWS = 16  # rows per sibling launch (the decode kernel's BLOCK_M)


def siblings_supported(x2d: torch.Tensor, weights: Sequence[torch.Tensor],
                       biases: Sequence[torch.Tensor | None]) -> bool:
    """Whether `checked_gemm_siblings` takes these operands (host metadata only): 2 to SIBLINGS_MAX
    ``nn.Linear`` weights (N_i, K), contiguous, of x's fp16/bf16 dtype and device, all with a bias or
    none, every N_i but the last a multiple of GROUP_COLS, M ≤ SIBLINGS_MAX_ROWS, and a decode-kernel
    config (a forced ``FTT_ABFT_GEMM_CONFIG``, if any) that fits."""
    m, k = x2d.shape
    if not 2 <= len(weights) <= SIBLINGS_MAX or not 0 < m <= SIBLINGS_MAX_ROWS or k == 0:
        return False
    if x2d.dtype not in (torch.float16, torch.bfloat16) or len({b is None for b in biases}) != 1:
        return False
    for i, (w, b) in enumerate(zip(weights, biases)):
        if w.dim() != 2 or w.shape[1] != k or not w.is_contiguous() or w.dtype != x2d.dtype or w.device != x2d.device:
            return False
        if i < len(weights) - 1 and w.shape[0] % GROUP_COLS or w.shape[0] == 0:
            return False
        if b is not None and (b.shape != (w.shape[0],) or b.dtype != x2d.dtype or b.device != x2d.device):
            return False
    if _cdiv(sum(w.shape[0] for w in weights), GROUP_COLS) > GROUPED_MAX_TILES:
        return False
    forced = _forced_config()
    return forced is None or (forced[0] >= 16 and forced[1] == GROUP_COLS)


def checked_gemm_siblings(x2d: torch.Tensor, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None],
                          wcs: Sequence[WeightChecksums], counters: Sequence[torch.Tensor], *,
                          emax: float | None = None, csigma: float = 2.5, correct: bool = True) -> torch.Tensor:
    """Checked GEMMs of sibling layers that read the same input, in one launch of the decode kernel.

    ``y = x · [W_0; W_1; …]ᵀ + [b_0; b_1; …]``: each weight keeps its own storage, checksum groups
    (`abft_decode.group_checksums`, cached in its `WeightChecksums`) and counters, so the events of
    ``y[:, the columns of W_i]`` are W_i's, counted as its own `checked_gemm` call would count them
    (per row and 64-column group, accumulator-side verification). One launch instead of one per
    weight: Q, K and V projections, or a gated MLP's gate and up projections.

    Args:
        x2d: (M, K), fp16/bf16 (`siblings_supported` says which operands are taken).
        weights: 2 or 3 tensors (N_i, K), contiguous, x's dtype and device.
        biases: (N_i,) each, or all None.
        wcs: each weight's `WeightChecksums` (of exactly that weight and bias), all finite.
        counters: each weight's (6, 5) int32 counter block.
        emax / csigma / correct: as `checked_gemm`'s (emax None: the calibrated accumulator-side value).
    Returns:
        y (M, ΣN_i) in x's dtype; ``y[:, :N_0]`` is layer 0's output, and so on.
    """
    if not siblings_supported(x2d, weights, biases):
        raise AbftGemmUnsupported("checked_gemm_siblings: operands not supported (see siblings_supported)")
    if not all(wc.finite for wc in wcs):
        raise AbftGemmUnsupported("checked_gemm_siblings needs finite weights and biases")
    return _checked_gemm_siblings(x2d, weights, biases, wcs, counters, emax, csigma, correct)


def _checked_gemm_siblings(x2d, weights, biases, wcs, counters, emax, csigma, correct) -> torch.Tensor:
    """`checked_gemm_siblings` on operands it takes (the module path checks them once, in
    `siblings._siblings_forward`)."""
    m, k = x2d.shape
    dev, dtype = x2d.device, x2d.dtype
    correct = bool(correct)
    key = ("siblings", m, *x2d.stride(), x2d.data_ptr() % 16 == 0,
           tuple((w.data_ptr(), id(wc)) for w, wc in zip(weights, wcs)),
           tuple(c.data_ptr() for c in counters), counters[0].stride(), emax, csigma, correct, _env_key(),
           dev.type == "cuda" and torch.cuda.is_current_stream_capturing())
    cache = wcs[0].launches
    prepared = cache.get(key)
    if prepared is not None:
        return prepared(x2d, counters[0])
    n = sum(w.shape[0] for w in weights)
    y = torch.empty((m, n), dtype=dtype, device=dev)
    w0 = weights[0]
    L = _Launch(x2d, w0, biases[0], y, w0.stride(0), w0.stride(1))
    groups = [_group_sums(wc, w, b, False) for w, b, wc in zip(weights, biases, wcs)]
    sibs = tuple(zip(weights[1:], biases[1:], groups[1:], counters[1:]))
    cfg = _pick_config(L, bias=biases[0], detect=True, verify_output=False, dot_f32=_INTERP, grouped=True,
                       siblings=sibs)
    if emax is None:
        emax = _emax(dtype, dev, "accumulator", k)
    reverify = _reverify_scale(dtype, dev, k, emax, correct, False)
    ver = _Verify(wcs[0].b12, counters[0], None, True, RECOMPUTE_ROWS, (), reverify, correct)
    P = _grouped_buffer(m, n, k, cfg, dev)
    launches = [(2, *_grouped_call(cfg, L, bias=biases[0], groups=groups[0], P=P, inj=None, ver=ver, emax=emax,
                                   csigma=csigma, verify_output=False, dot_f32=_INTERP, siblings=sibs))]
    _launcher(2)(*launches[0][1:])
    if len(cache) >= PREPARED_PER_WEIGHT:
        cache.clear()
    cache[key] = _PreparedCall.record(launches, x2d, y, P, counters[0], None)
    return y


_env_key = env_reader(("FTT_ABFT_GEMM_TMA", "FTT_ABFT_GEMM_ONE_LAUNCH", "FTT_ABFT_GEMM_CONFIG", "FTT_ABFT_GEMM_TUNE",
                       "FTT_DIRECT_LAUNCH", "FTT_ABFT_GEMM_SPLIT", "FTT_ABFT_GEMM_GROUPS", "FTT_ABFT_GEMM_PERSISTENT",
                       "FTT_ABFT_GEMM_SLACK_STATS"))
"""() -> the environment settings a call's launch plan depends on (`_tma_ok`, `_one_launch`, `_pick_config`,
`_persistent_ok`, `_slack_stats`, `DirectLauncher`), raw."""


class _PreparedCall:
    """A verified call's launches with everything resolved but its own tensors: a later call of the same
    signature (`_checked_gemm`'s ``prep_key``: shapes, strides, alignment, weight, counters, settings)
    allocates y and the stats buffer, takes a call id and launches the compiled kernels directly
    (`DirectLauncher.bind`: the key fixes their specialisation), skipping the host work that decided
    the config, the one/two-launch form, the thresholds and the arguments. Kept in the weight's
    `WeightChecksums.launches`, so it goes when the weight changes; it holds none of the call's own
    tensors (x, y, the stats buffer, the counters are put in at each call)."""

    __slots__ = ("launches", "bound", "y_shape", "dtype", "device", "p_numel", "self_reset", "flagged", "scratch")

    @classmethod
    def record(cls, launches, x2d, y, P, counters, call_id) -> _PreparedCall:
        """``P``: the call's stats buffer, or None (the decode kernel without split-K); ``call_id``: None
        for the decode kernel, which takes none."""
        self = cls()
        per_call = tuple(t for t in (x2d, y, P, counters) if t is not None)
        self.launches = record_launches(launches, per_call, call_id, _CALL_ID_AT, _launcher)
        self.bound = all(entry[-1] is not None for entry in self.launches)
        self.self_reset = len(launches) == 1  # the one-launch form resets its flag (`call_flag`)
        self.scratch = any(entry[0] == 4 for entry in launches)  # the persistent form: TMA descriptor scratch
        self.flagged = call_id is not None
        self.y_shape, self.dtype, self.device = tuple(y.shape), y.dtype, y.device
        self.p_numel = P.numel() if P is not None else 0
        return self

    def __call__(self, x2d: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
        """y (M, N) of x2d (M, K), events into counters (6, 5)."""
        if self.device.type == "cuda" and self.device.index != torch.cuda.current_device():
            with torch.cuda.device(self.device):  # launches go to the current device's stream
                return self(x2d, counters)
        y = torch.empty(self.y_shape, dtype=self.dtype, device=self.device)
        per_call = (x2d, y, counters)
        direct = self.bound and y.data_ptr() & 15 == 0
        if self.p_numel:
            P = torch.empty(self.p_numel, dtype=torch.float32, device=self.device)
            per_call = (x2d, y, P, counters)
            direct = direct and P.data_ptr() & 15 == 0
        # (the bound kernels were specialised on 16-byte aligned y and P: fresh allocations always are)
        call_id = call_flag(self.device, self.self_reset)[1] if self.flagged else None  # the recorded call's cell
        if self.scratch:
            _ensure_scratch_allocator()
        replay_launches(self.launches, per_call, call_id, _launcher, direct)
        return y


def gemm_residuals(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                   weight_is_kn: bool = False, mode: str = "accumulator", emax: float = 1.0,
                   csigma: float = 2.5, plan: FaultPlan | None = None) -> dict[str, torch.Tensor]:
    """Run the kernel without repair and return its verification quantities (calibration, studies).

    Returns ``{"y": (M, N), "d1": (M,), "c1": (M,), "thr": (M,), "counters": (6, 5)}``: ``d1`` the
    checksum difference, ``c1`` the expected row sum ``x·w1 + b1``, ``thr`` the threshold with the
    given ``emax`` (1.0 gives ``T_m / e_max``), all fp32 as the kernel computed them.
    """
    dbg = torch.zeros((x2d.shape[0], 4), dtype=torch.float32, device=x2d.device)
    cnt = new_counters(x2d.device)
    y = checked_gemm(x2d, weight, bias, weight_is_kn=weight_is_kn, emax=emax, csigma=csigma, detect=True,
                     correct=False, plan=plan, counters=cnt, mode=mode, debug=dbg)
    return {"y": y, "d1": dbg[:, 0], "c1": dbg[:, 1], "thr": dbg[:, 2], "counters": cnt}


@on_tensor_device
def checked_linear_triton_forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    weight_is_kn: bool,
    emax: float | None,
    csigma: float,
    detect: bool,
    correct: bool,
    plan: FaultPlan | None,
    counters: torch.Tensor | None,
    cache_owner: object | None = None,
    mode: str = "accumulator",
) -> torch.Tensor:
    """`ft_transformers.checked_linear`'s Triton backend: x (..., K) → y (..., N), events into ``counters``.

    Same arguments as the reference forward (`checked_linear._checked_linear_forward`), which has
    validated shapes, dtypes and devices (they are not checked again here); the weight
    checksums are cached on ``cache_owner`` (per autocast dtype). Under autocast the operands are
    cast like autocast would and the kernel runs on the cast tensors.
    """
    _check_device(x)
    cast = _autocast_dtype(x.device.type)
    w_src, b_src = weight, bias
    if cast is not None:
        x = x.to(cast)
        weight = weight.to(cast)
        bias = bias.to(cast) if bias is not None else None
    k = weight.shape[0] if weight_is_kn else weight.shape[1]
    n = weight.shape[1] if weight_is_kn else weight.shape[0]
    lead = tuple(x.shape[:-1])
    x2d = x.reshape(-1, k)
    wc = None
    if detect and x2d.shape[0] > 0 and n > 0 and k > 0:
        wc = weight_checksums(w_src, b_src, weight_is_kn=weight_is_kn, cache_owner=cache_owner, cast=cast)
        if counters is None:
            counters = new_counters(x.device)
    detect = detect and wc is not None
    _check_mode_counters(mode, detect, counters, x.device)
    # shapes, dtypes and devices were validated by the caller (`checked_linear._validate`)
    keep: list = []
    y = _checked_gemm(x2d, weight, bias, weight_is_kn, wc, emax, csigma, detect, correct, plan, counters, mode, None,
                      RECOMPUTE_ROWS, keep)
    if cache_owner is not None and keep and cast is None and mode == "accumulator":
        settings = (weight_is_kn, emax, csigma, correct)
        fast = _ModuleFastPath(_module_key(x, weight, bias, counters, settings), keep[0], k, n)
        try:
            object.__setattr__(cache_owner, _FAST_PATH_ATTR, fast)
        except (AttributeError, TypeError):  # an owner without __dict__
            pass
    return y.reshape(*lead, n)


def _module_key(x, weight, bias, counters, settings) -> tuple:
    """What a module call's prepared launches depend on beyond `_checked_gemm`'s key: the input's
    metadata (and whether it requires grad), the weight's and bias's identity, storage and version,
    grad and autocast modes (a call the full path would refuse or cast never matches a recorded one)."""
    dev = x.device
    return (x.shape, x.stride(), x.dtype, dev, x.data_ptr() % 16 == 0, x.requires_grad,
            id(weight), weight.data_ptr(), weight._version,
            None if bias is None else (id(bias), bias.data_ptr(), bias._version),
            counters.data_ptr(), settings, _env_key(), torch.is_grad_enabled(), _autocast_dtype(dev.type),
            dev.type == "cuda" and torch.cuda.is_current_stream_capturing())


def _no_fast_path() -> None:
    return None


class _ModuleFastPath:
    """The last call signature of one protected module (`_module_key`) and its `_PreparedCall`.

    `ft_transformers.checked_linear` tries it first: a call with the same signature goes straight to
    the prepared launches, skipping validation, backend choice, the checksum cache lookup and
    `_checked_gemm`'s own key (all of which would find the same answers again). One entry per
    module: decode repeats one signature, a prefill of another length replaces it. Copies and
    pickles of the module carry no entry."""

    __slots__ = ("key", "prepared", "k", "n")

    def __init__(self, key: tuple, prepared: _PreparedCall, k: int, n: int) -> None:
        self.key, self.prepared, self.k, self.n = key, prepared, k, n

    def __deepcopy__(self, memo) -> None:
        return None

    def __reduce__(self):
        return (_no_fast_path, ())

    def __call__(self, x, weight, bias, counters, settings) -> torch.Tensor | None:
        """y (..., N) for x (..., K), or None when this call's signature is not the recorded one."""
        if counters is None or _module_key(x, weight, bias, counters, settings) != self.key:
            return None
        return self.prepared(x.reshape(-1, self.k), counters).view(*x.shape[:-1], self.n)
