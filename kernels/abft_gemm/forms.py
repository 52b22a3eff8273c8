"""The form a checked-GEMM call takes, decided by `choose_form` from small pure predicates.

Forms (``Form.kind``):

* ``"tile"`` — `tile._gemm_kernel`, which leaves each row's 64-column group sums, then the group verification
  (`groups._group_verify_kernel`), a second launch. The plain GEMM of one row block of few tiles splits K
  (`split_plan`).
* ``"decode"`` — `decode.grouped_gemm_kernel`: calls of at most GROUPED_MAX_ROWS rows, and on CUDA the short
  prompts of narrow layers as several row blocks (`grouped`, `decode_rows_auto`), each 64-column tile checked
  against its own column-group checksum in its epilogue, one launch.
* ``"persistent"`` — `persistent._persistent_kernel`, then the group verification: wide calls on Hopper
  (`persistent_ok`).
* ``"cublas"`` — cuBLAS's product with fp32 output (`calls.fp32_product`) with the checksum programs beside it on
  a side stream, then one launch that makes y from the product (bias, rounding, injection) and checks it
  (`product_check`): fp16/bf16 calls, ``Options.gemm_cublas`` (`cublas_ok`); by default on CUDA from 17 rows
  where it was measured ahead of the fused GEMM (`cublas_auto`), in graph captures and calls not host-bound.

Every form checks each (row, 64-column group) against its own threshold.

Each predicate takes its switch from `options()` (``Options.gemm_*``): ``None`` means chosen here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..gemm_checksums import GROUP_COLS
from ..options import options
from ..tl_common import capturing, cdiv, runs_interpreted, sm_count
from .checksum_tiles import CHECKSUM_SLICES, checksum_cols
from .configs import (
    CONFIG_INJECT,
    CONFIG_INTERPRET,
    CONFIG_INTERPRET_GROUPED,
    CONFIGS_GROUPED,
    PERSISTENT_CONFIG,
    PERSISTENT_CONFIG_INTERPRET,
    VERIFY_BLOCK,
)
from .tile import _gemm_kernel

try:  # the scratch memory of TMA descriptors made in a kernel comes from Triton's allocator (Triton ≥ 3.4)
    from triton.runtime import _allocation as triton_allocation
except ImportError:  # pragma: no cover - older triton: no persistent form
    triton_allocation = None

TILE, DECODE, PERSISTENT, CUBLAS = "tile", "decode", "persistent", "cublas"

TMA_MIN_MNK = 1 << 36  # eager calls with fewer multiply-adds (M·N·K < 4096³) load through pointers, see `tma_ok`
# The decode kernel takes calls of at most GROUPED_MAX_ROWS rows (one row block of its BLOCK_M = 16): it verifies
# each tile in its own epilogue, with no launch after the GEMM. (Measured on an H200 against the former row
# check: at M = 1 it was 0.7-1.4 µs faster per call at every Qwen2-0.5B layer shape; at M = 16, 10.1 against
# 8.9 µs at 16 × 4864 × 896; a 151,936-wide lm_head at M = 1, 100 µs against 74: a tile's own verification
# costs ~1 µs after its loop, paid per wave of tiles.)
GROUPED_MAX_ROWS = 16
# Split-K for the decode kernel's calls and the plain GEMM's of the same shapes (`split_k`): each tile's K
# blocks over up to SPLIT_PROGRAMS_PER_SM · SMs / T programs of at least SPLIT_MIN_BLOCKS K blocks (896-wide
# decode GEMMs have 14 tiles at BLOCK_N = 64: 14 busy SMs without it); none past SPLIT_MAX_TILES tiles (the
# tiles' split counts use the cells of `calls._cells`). The tuner times every decode config with and without it.
SPLIT_PROGRAMS_PER_SM = 1
SPLIT_MIN_BLOCKS = 2
SPLIT_MAX_TILES = 1024
INTERPRET_SMS = 4  # the SM count split-K and the persistent form assume under the interpreter
# Persistent form (`persistent_ok`): wide calls (N ≥ PERSISTENT_MIN_N, M·N·K ≥ PERSISTENT_MIN_MNK) on Hopper. On an
# H100 the persistent TMA plain GEMM reached 0.89-1.01× cuBLAS where the tile kernel reached 0.68-0.78, and every
# form of the checksum share inside its K loop cost 5-50 %; the pass over x reads x once more (1.3-1.8 TB/s), which
# only a wide N amortises (`scripts/bench_gemm_forms.py`, docs/vabft.md). With that pass in the GEMM's programs that
# have a tile fewer, 4096³ ran at 0.91 / 0.90× cuBLAS (fp16 / bf16) on an H200 under CUDA graphs.
PERSISTENT_MIN_N = 2048
PERSISTENT_MIN_MNK = 1 << 34
# The cuBLAS form's check (`check_blocks`): blocks of CHECK_ROWS_SHORT rows for calls of at most CHECK_SHORT_MAX
# rows, CHECK_ROWS_LONG beyond, and as many groups per block (a power of two, a tile of y32 of at most
# CHECK_TILE_ELEMS) as keep CHECK_PROGRAMS_PER_SM programs per SM.
CHECK_ROWS_SHORT = 16
CHECK_ROWS_LONG = 64
CHECK_SHORT_MAX = 256
CHECK_TILE_ELEMS = 8192
CHECK_WARPS_4_MAX = 4096  # tiles of y32 up to this many elements take 4 warps, larger ones 8 (`check_warps`)
CHECK_PROGRAMS_PER_SM = 2
# Its checksum programs (`checksum_plan`), beside cuBLAS's product on a side stream: (BLOCK_M, BLOCK_K, warps,
# stages) and K splits of at least CHECKSUM_SIDE_MIN_BLOCKS blocks, up to CHECKSUM_SIDE_PER_SM programs per SM.
CHECKSUM_SIDE_CONFIG = (64, 64, 4, 3)
CHECKSUM_SIDE_MIN_BLOCKS = 2
CHECKSUM_SIDE_PER_SM = 0.5
Y32_MAX_ELEMS = 1 << 30  # the cuBLAS form's product and partials stay within its kernels' int32 offsets
# The cuBLAS form by default (``Options.gemm_cublas`` None, `cublas_ok`): fp16/bf16 calls on a CUDA GPU of more
# than CUBLAS_AUTO_MIN_ROWS rows (fewer: the decode kernel) and, for the first entry (rows, cols) of CUBLAS_AUTO
# with M ≤ rows, N ≤ cols. Measured on an H200 (CUDA graphs, fp16 and bf16, the layers of Qwen2-0.5B, -1.5B, -7B
# and Llama-3-8B, `scripts/bench_gemm_cublas_form.py`, the fused GEMM at its first candidate config): the form was
# ahead of the fused GEMM at every shape of M = 32-256 (N 128 to 18,944, K 896 to 18,944); at M = 512 wherever
# N ≤ 4,096 and behind at N ≥ 4,864; at M = 1024 up to N = 1,536 and behind at N = 4,096 (but for k/v, N = 1,024,
# and Qwen2-1.5B's gate/up); at M = 4096 only at N ≤ 512. docs/vabft.md has the tables.
# The checksum programs in the GEMM's launch by default (``Options.gemm_fused`` None, `fused_ok`): K ≥ FUSED_MIN_K
# or M ≤ FUSED_MAX_ROWS. Measured on an H200 (fp16, CUDA graphs, `bench_linear.py --unfused`, time against the
# verification's own K loop): 0.77-0.87 at M = 64 and 128 (K 896 and 4864), 0.85-0.93 at K = 4096-11008 with
# M = 4096 (4096 × 12288 × 4096: 0.98), but 1.00 at M = 4096, K = 896, where the loop is short, and 1.15 at 2048³,
# whose 128 tiles fill one wave that the checksum programs then delay (docs/vabft.md).
FUSED_MIN_K = 4096
FUSED_MAX_ROWS = 512
CUBLAS_AUTO_MIN_ROWS = 16
# The decode kernel over row blocks by default (`decode_rows_auto`): measured on an H200 against the cuBLAS form
# (CUDA graphs, fp16, M = 32-128, the layers of Qwen2-0.5B, -1.5B, -7B and Llama-3-8B, its first config), it was
# ahead at every shape with N ≤ 1,536 and M·N·K ≤ 3.1e8 (0.62-0.84 of cuBLAS against 0.54-0.65) and behind at all
# others of N ≤ 1,536 (Qwen2-1.5B's down, K = 8,960; M = 128 at K ≥ 4,096); wider layers took it at M = 32 only.
DECODE_AUTO_MAX_ROWS = 128
DECODE_AUTO_MAX_COLS = 1536
DECODE_AUTO_MAX_MNK = 310_000_000
CUBLAS_AUTO = ((256, 18944), (512, 4096), (1024, 1536), (None, 512))  # (M at most, N at most)


def interpreting() -> bool:
    """True when the checked GEMM's kernels run through Triton's CPU interpreter (`tl_common.runs_interpreted`)."""
    return runs_interpreted(_gemm_kernel)


INTERP = interpreting()

_CAPABILITY: dict[torch.device, int] = {}  # device → major compute capability (never dropped: a device's is fixed)


def hopper(dev: torch.device) -> bool:
    """Whether the CUDA device is a Hopper or newer GPU (TMA), cached per device."""
    cap = _CAPABILITY.get(dev)
    if cap is None:
        cap = _CAPABILITY[dev] = torch.cuda.get_device_capability(dev)[0]
    return cap >= 9


def host_bound(m: int, n: int, k: int) -> bool:
    """An eager call this small takes longer on the host than on the GPU (H100: < TMA_MIN_MNK multiply-adds)."""
    return m * n * k < TMA_MIN_MNK


def forced_config() -> tuple[int, int, int, int, int] | None:
    """The config ``Options.gemm_config`` forces on every call, or None."""
    return options().gemm_config


def tma_layout(*ts: torch.Tensor) -> bool:
    """Whether these 2-D tensors can be moved by TMA descriptors: unit inner stride, 16-byte aligned base
    and row stride."""
    for t in ts:
        es = t.element_size()
        if t.stride(1) != 1 or (t.stride(0) * es) % 16 or t.data_ptr() % 16:
            return False
    return True


def tma_ok(m: int, n: int, k: int, *ts: torch.Tensor) -> bool:
    """Whether this call moves its tiles through TMA tensor descriptors.

    The layout must allow it: a Hopper-or-newer GPU (or the interpreter), unit inner stride,
    16-byte aligned base and row stride. And it must pay: the three descriptors are encoded on the
    host at every launch, ~0.1 ms of host time per call on the H100's host (pointer-load launch
    0.12-0.15 ms, TMA 0.22-0.25 ms), which an eager call of fewer than ``TMA_MIN_MNK`` multiply-adds
    (~0.1 ms of GPU time) cannot hide. The choice depends on the shape only, not on whether a CUDA
    graph is being captured: a captured call must find its config already tuned by the eager
    warm-up calls (tuning times launches, which a capture cannot).
    ``Options.gemm_tma``: False never, True whenever the layout allows, None as above (the
    interpreter: whenever the layout allows, so that the tests cover the descriptor path).
    """
    mode = options().gemm_tma
    if mode is False:
        return False
    dev = ts[0].device
    if not INTERP:
        if dev.type != "cuda":
            return False
        if not hopper(dev):
            return False
        if mode is not True and host_bound(m, n, k):
            return False
    return tma_layout(*ts)


def persistent_ok(m: int, n: int, k: int, x2d: torch.Tensor, weight: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether a checked call takes the persistent form: fp16/bf16 operands in a TMA layout on a Hopper-or-newer
    GPU, N ≥ PERSISTENT_MIN_N and M·N·K ≥ PERSISTENT_MIN_MNK, and for an eager call M·N·K ≥ TMA_MIN_MNK. Smaller
    eager calls are host-bound: the form's three launches made a 4k prefill of Qwen2-0.5B 1-1.5 ms slower in wall
    time on an H200's host, against 1.3 ms less GPU time; with the pass in the GEMM's idle programs (two launches)
    a 4096 × 4864 × 896 call still took 14-19 µs more host time than the tile form's, for 30-35 µs less GPU time,
    and the prefill's wall time did not improve.
    ``Options.gemm_persistent``: False never, True whenever the operands allow (the interpreter too: the
    tests), None as above (never in the interpreter)."""
    mode = options().gemm_persistent
    if mode is False or triton_allocation is None or x2d.dtype not in (torch.float16, torch.bfloat16):
        return False
    if INTERP:
        if mode is not True:
            return False
    else:
        if not hopper(x2d.device):
            return False
        if mode is not True:
            if n < PERSISTENT_MIN_N or m * n * k < PERSISTENT_MIN_MNK:
                return False
            if host_bound(m, n, k) and not capturing():
                return False  # an eager call this small is host-bound: the tile form, whose launches cost less
    return tma_layout(x2d, weight, y)


def fused_ok(kind: str, dtype: torch.dtype, m: int, k: int) -> bool:
    """Whether a checked call of form ``kind`` computes its group checksums as checksum programs of the GEMM's
    own launch (`checksum_tiles`) rather than in the verification's K loop: the tile and persistent forms in
    fp16/bf16 (their tensor-core dots of the checksum slices; fp32 calls keep the verification's IEEE loop).
    ``Options.gemm_fused``: False never, True wherever the form and dtype allow, None (the default) where it
    was measured to pay: K ≥ FUSED_MIN_K or M ≤ FUSED_MAX_ROWS."""
    switch = options().gemm_fused
    if switch is False or kind not in (TILE, PERSISTENT) or dtype not in (torch.float16, torch.bfloat16):
        return False
    return switch is True or k >= FUSED_MIN_K or m <= FUSED_MAX_ROWS


def groupable(n: int, dtype: torch.dtype) -> bool:
    """Whether a weight of ``n`` output features may take the decode kernel in ``dtype``: fp16 or bf16 (fp32
    calls take the tile form: the decode kernel's fp32 form compiles for sm_90, but was never timed)."""
    return dtype != torch.float32


def decode_rows_auto(m: int, n: int, k: int, device: torch.device) -> bool:
    """Whether a call of more than GROUPED_MAX_ROWS rows takes the decode kernel over row blocks by default: on
    a CUDA GPU (not the interpreter), M ≤ DECODE_AUTO_MAX_ROWS, N ≤ DECODE_AUTO_MAX_COLS and M·N·K ≤
    DECODE_AUTO_MAX_MNK (few tiles of short K loops: one launch, where it was measured ahead of the cuBLAS form)."""
    return (not INTERP and device.type == "cuda" and m <= DECODE_AUTO_MAX_ROWS and n <= DECODE_AUTO_MAX_COLS
            and m * n * k <= DECODE_AUTO_MAX_MNK)


def grouped(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, debug: torch.Tensor | None) -> bool:
    """Whether a checked call runs the decode kernel (each tile verifies its own 64 columns, one launch): a
    `groupable` weight, M ≤ GROUPED_MAX_ROWS, or more rows as several row blocks of the kernel's BLOCK_M where
    ``Options.gemm_decode_rows`` allows them (unset: `decode_rows_auto`), no ``debug`` output (`gemm_residuals`
    takes the tile form), and a forced config (``Options.gemm_config``), if any, that fits it."""
    if debug is not None or not groupable(n, dtype):
        return False
    rows = options().gemm_decode_rows
    if m > GROUPED_MAX_ROWS and (m > rows if rows is not None else not decode_rows_auto(m, n, k, device)):
        return False
    forced = forced_config()
    return forced is None or (forced[0] >= 16 and forced[1] == GROUP_COLS)


def split_k(n: int, k: int, block_n: int, block_k: int, device: torch.device,
            row_blocks: int = 1) -> tuple[int, int]:
    """(n_split, kb_per) of a decode call with checksum programs: each of its T tiles (``row_blocks`` times the
    column tiles) runs as n_split programs of kb_per ≥ SPLIT_MIN_BLOCKS K blocks (the last may have fewer; none
    is empty), n_split ≤ SPLIT_PROGRAMS_PER_SM · SMs / T, so that a call of few tiles still fills the GPU.
    ``(1, ·)``: no split. ``Options.gemm_split = S`` asks for S splits (1: never split). Never past
    SPLIT_MAX_TILES tiles: their split counts live in `calls._cells`."""
    t, nkb = row_blocks * cdiv(n, block_n), cdiv(k, block_k)
    if t > SPLIT_MAX_TILES:
        return 1, nkb
    want = options().gemm_split
    forced = want is not None
    if not forced:
        sms = sm_count(device) if device.type == "cuda" else INTERPRET_SMS
        want = SPLIT_PROGRAMS_PER_SM * sms // t
    per = cdiv(nkb, max(1, min(want, nkb)))
    if not forced:
        per = max(per, SPLIT_MIN_BLOCKS)
    return cdiv(nkb, per), per


def split_plan(m: int, n: int, k: int, cfg, detect: bool, device: torch.device) -> tuple[int, int]:
    """(n_split, kb_per) of a tile-kernel call (`split_k`): split-K for the plain GEMM of one row block of
    M ≤ GROUPED_MAX_ROWS; ``(1, 1)`` otherwise, or when the config says so (a 6th entry ``False``, which the
    tuner appends to a candidate that it timed faster without split-K)."""
    if len(cfg) > 5 and not cfg[5]:
        return 1, 1
    if not detect and m <= GROUPED_MAX_ROWS and m <= cfg[0]:
        return split_k(n, k, cfg[1], cfg[2], device)
    return 1, 1


def verify_split(m: int, n: int, k: int, device: torch.device) -> tuple[int, int]:
    """(n_split, kb_per) of the group verification (`groups._group_verify_kernel`'s SPLIT): its blocks' K
    loops over up to SPLIT_PROGRAMS_PER_SM · SMs / blocks programs of at least SPLIT_MIN_BLOCKS K blocks, so
    that a call of few row blocks (a short prompt) still fills the GPU; ``(1, ·)`` for calls of enough blocks,
    and past SPLIT_MAX_TILES blocks (their counts live in `calls._cells`)."""
    br, bg, bk = VERIFY_BLOCK[:3]
    blocks, nkb = cdiv(m, br) * cdiv(cdiv(n, GROUP_COLS), bg), cdiv(k, bk)
    sms = sm_count(device) if device.type == "cuda" else INTERPRET_SMS
    want = SPLIT_PROGRAMS_PER_SM * sms // blocks
    if blocks > SPLIT_MAX_TILES or want < 2:
        return 1, nkb
    per = max(cdiv(nkb, min(want, nkb)), SPLIT_MIN_BLOCKS)
    return cdiv(nkb, per), per


def check_blocks(m: int, n: int, device: torch.device) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_G) of the cuBLAS form's check (`product_check._product_check_kernel`): rows per block by
    M, then the most groups per block (a power of two, BLOCK_R · BLOCK_G · 64 ≤ CHECK_TILE_ELEMS) that still
    give CHECK_PROGRAMS_PER_SM · SMs programs."""
    br = CHECK_ROWS_SHORT if m <= CHECK_SHORT_MAX else CHECK_ROWS_LONG
    sms = sm_count(device) if device.type == "cuda" else INTERPRET_SMS
    want, rb, tg = CHECK_PROGRAMS_PER_SM * sms, cdiv(m, br), cdiv(n, GROUP_COLS)
    bg = 1
    while 2 * bg * br * GROUP_COLS <= CHECK_TILE_ELEMS and bg < tg and rb * cdiv(tg, 2 * bg) >= want:
        bg *= 2
    return br, bg


def check_warps(blocks: tuple[int, int]) -> int:
    """Warps of the cuBLAS form's check for `check_blocks`' (BLOCK_R, BLOCK_G): 4 up to CHECK_WARPS_4_MAX elements
    of y32 per program, else 8."""
    br, bg = blocks
    return 4 if br * bg * GROUP_COLS <= CHECK_WARPS_4_MAX else 8


def checksum_plan(m: int, k: int, nc: int, device: torch.device) -> tuple[int, int, int, int, int, int, int]:
    """(BLOCK_M, CN, BLOCK_K, warps, stages, splits, kb_per) of the cuBLAS form's checksum programs
    (`product_check._checksum_kernel`) for ``nc`` = S·T_g checksum columns: CHECKSUM_SIDE_CONFIG, tiles of CN
    columns (`checksum_tiles.checksum_cols`), and K split so that the call has up to CHECKSUM_SIDE_PER_SM · SMs
    programs (the rest of the GPU runs cuBLAS's product meanwhile), each of at least CHECKSUM_SIDE_MIN_BLOCKS
    K blocks (none empty)."""
    bm, bk, warps, stages = CHECKSUM_SIDE_CONFIG
    cn = checksum_cols(nc, 128)
    sms = sm_count(device) if device.type == "cuda" else INTERPRET_SMS
    tiles, nkb = cdiv(m, bm) * cdiv(nc, cn), cdiv(k, bk)
    want = max(1, int(CHECKSUM_SIDE_PER_SM * sms) // tiles)
    per = max(CHECKSUM_SIDE_MIN_BLOCKS, cdiv(nkb, want))
    return bm, cn, bk, warps, stages, cdiv(nkb, per), per


def cublas_ok(m: int, n: int, x2d: torch.Tensor) -> bool:
    """Whether a checked call takes the cuBLAS form: fp16/bf16 operands (an fp32 product through cuBLAS may
    run in TF32, which the fp32 e_max does not cover), its fp32 scratch (`product_elems`) under Y32_MAX_ELEMS, and
    ``Options.gemm_cublas`` True (on a CUDA device or under the interpreter, whose product is the upcast fp32
    one), False never, or None (the default): on a CUDA device, not under the interpreter, where the timings
    put it ahead of the fused GEMM (`cublas_auto`), in a CUDA graph being captured or in an eager call that is not
    `host_bound` (its stream fork and two launches cost more host time than the fused form's launches). CPU calls
    never take it."""
    switch = options().gemm_cublas
    if switch is False or x2d.dtype not in (torch.float16, torch.bfloat16):
        return False
    if switch is None:
        if INTERP or x2d.device.type != "cuda" or not cublas_auto(m, n):
            return False
        if host_bound(m, n, x2d.shape[1]) and not capturing():
            return False  # eager and host-bound: the fused form's launches take less host time (docs/vabft.md)
    elif not INTERP and x2d.device.type != "cuda":
        return False
    return product_elems(m, n, x2d.shape[1], x2d.dtype) < Y32_MAX_ELEMS


def cublas_auto(m: int, n: int) -> bool:
    """The default rule of the cuBLAS form: M > CUBLAS_AUTO_MIN_ROWS and N within the first CUBLAS_AUTO entry
    whose rows bound holds M (K any: 896 to 18,944 measured)."""
    if m <= CUBLAS_AUTO_MIN_ROWS:
        return False
    for rows, cols in CUBLAS_AUTO:
        if rows is None or m <= rows:
            return n <= cols
    return False


def product_elems(m: int, n: int, k: int, dtype: torch.dtype) -> int:
    """A bound on the fp32 elements of a cuBLAS-form call's scratch: the product (M, N), then the checksum
    programs' partials (splits, M, S·T_g + 4) at their most splits (`checksum_plan`; S = `CHECKSUM_SLICES`)."""
    nc = CHECKSUM_SLICES[dtype] * cdiv(n, GROUP_COLS)
    return m * n + cdiv(cdiv(k, CHECKSUM_SIDE_CONFIG[1]), CHECKSUM_SIDE_MIN_BLOCKS) * m * (nc + 4)


def grouped_split(m: int, n: int, k: int, cfg, device: torch.device) -> tuple[int, int]:
    """(n_split, kb_per) of a decode-kernel call of M rows: `split_k` over its row blocks' tiles, or none when
    the config says so."""
    if len(cfg) > 5 and not cfg[5]:
        return 1, 1
    return split_k(n, k, cfg[1], cfg[2], device, cdiv(m, cfg[0]))


def inject_config(decode: bool) -> tuple:
    """The fixed config of a call that injects faults (flip positions are bucketed per row block)."""
    if decode:
        return forced_config() or (CONFIG_INTERPRET_GROUPED if INTERP else CONFIGS_GROUPED[0])
    return forced_config() or (CONFIG_INTERPRET if INTERP else CONFIG_INJECT)


@dataclass(frozen=True)
class Form:
    """How one call runs (`choose_form`)."""

    kind: str  # TILE, DECODE, PERSISTENT or CUBLAS
    tma: bool  # the tile kernel's operands through host TMA descriptors (`tma_ok`)
    cfg: tuple  # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages[, split-K allowed]); CUBLAS: `check_blocks`
    inj: torch.Tensor | None  # the injection table (`calls.inj_table`), or None
    sms: int = 0  # persistent: programs of the GEMM (SMs)


def choose_form(x2d: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, *, detect: bool,
                debug: torch.Tensor | None, inject: Callable[[int], torch.Tensor | None] | None,
                tune: Callable[[bool, bool], tuple]) -> Form:
    """The form of a call ``y (M, N) = x2d (M, K) · weight`` (weight (N, K) or (K, N)).

    ``inject``: with faults to inject, block_m → the call's injection table (None: no flip lands), else
    None; ``tune(tma, decode)``: the tuned config of the tile (decode False) or decode kernel. Without
    ``detect`` the call is the plain tile GEMM.
    """
    m, k = x2d.shape
    n = y.shape[1]
    decode = detect and grouped(m, n, k, x2d.dtype, x2d.device, debug)
    # (the decode kernel first, unless the cuBLAS form is forced; its check injects per row block of BLOCK_R)
    if detect and (not decode or options().gemm_cublas) and cublas_ok(m, n, x2d):
        blocks = check_blocks(m, n, x2d.device)
        return Form(CUBLAS, False, blocks, inject(blocks[0]) if inject is not None else None)
    tma = tma_ok(m, n, k, x2d, weight, y)
    inj = None
    if inject is not None:
        cfg = inject_config(decode)
        inj = inject(cfg[0])
    # (the persistent form has no in-kernel injection: calls with flips take the tile kernel)
    if detect and inj is None and not decode and persistent_ok(m, n, k, x2d, weight, y):
        cfg = forced_config() or (PERSISTENT_CONFIG_INTERPRET if INTERP else PERSISTENT_CONFIG)
        return Form(PERSISTENT, tma, cfg, None, INTERPRET_SMS if INTERP else sm_count(x2d.device))
    if inj is None:
        cfg = tune(tma, decode)
    return Form(DECODE if decode else TILE, tma, cfg, inj)
