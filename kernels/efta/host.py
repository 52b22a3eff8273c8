"""Host side of EFTA: `efta_triton_forward` and its steps, one function each: validate the call
(`_validate`), replay a known signature's launches (`_Replay`), build the injection table
(`injection._injection_table`), pick the block config (`_fixed_config`, `_tuned_config`), lay out the grid
(`_layout`), allocate the call's scratch (`_scratch`), and launch the checksum pre-pass, the forward and
the split-key merge.

Replay: a call whose signature (tensor metadata, settings, the `Options` in force, capture state) was
seen before replays that call's launches with its own tensors (`_Replay`), skipping validation, the
config lookup and the argument building; calls with injection and PASA calls take the full path.

Injection (`injection._injection_table`): while anything is injected the kernel uses a fixed config with
BLOCK_N = 64 (the reference's block, so per-block positions mean the same block) and visits every key
block (no skipping), so faults land exactly where they land in the reference.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import triton

from ..contract import (
    ATTENTION_SITES,
    BLOCK_SITES,
    COUNTER_SHAPE,
    exp_clamp,
    kernel_head_dim,
)
from ..launch import DirectLauncher, record_launches, replay_launches
from ..options import Options, options
from ..tl_common import call_flag, capturing, on_tensor_device, runs_interpreted
from ..tl_common import cdiv as _cdiv
from .checksums import vc_rows
from .configs import (
    BOUNDS,
    CONFIG_INJECT,
    CONFIG_INTERPRET,
    CS_BLOCK_N,
    FP16_MMA_K,
    INJECT_BLOCK_N,
    SPLIT_BLOCKS,
    STRIDE,
    _efta_fwd_tuned,
    _fold,
    _num_splits,
    _pow2_bucket,
    _tma,
    _wide,
)
from .decode import _efta_combine
from .injection import _injection_table
from .kernel import _efta_fwd
from .stored import _PARTS, _PREPASS, StoredTables

Config = tuple[int, int, int, int]  # (BLOCK_M, BLOCK_N, num_warps, num_stages)


class EftaUnsupported(ValueError):
    """The Triton kernel cannot run this call (the caller may fall back to the reference)."""


class PasaShift(NamedTuple):
    """PASA's key shift for one call, as the caller resolves it (``ft_transformers.pasa`` at its β, for
    key blocks of `CS_BLOCK_N`; ``docs/pasa.md`` "Kernel interface"): the entries of the fp16 shifting
    matrix ``M = (diag − off)·I + off·J`` and the recovery factor γ, for a full key block and for the
    call's last block of ``N − (nblocks − 1)·CS_BLOCK_N`` keys."""

    diag: float
    off: float
    gamma: float
    diag_last: float
    off_last: float
    gamma_last: float


PASA_SUPPORTED = True  # efta_triton_forward takes pasa= (float16 inputs); see ft_transformers.efta


def interpreting() -> bool:
    """True when this package's kernels run through Triton's CPU interpreter (`tl_common.runs_interpreted`)."""
    return runs_interpreted(_efta_fwd)


_INTERP = interpreting()
_FWD_LAUNCH = DirectLauncher(_efta_fwd, _INTERP)
_COMBINE_LAUNCH = DirectLauncher(_efta_combine, _INTERP)
_CNT_AT, _FLAG_AT = (_efta_fwd.arg_names.index(a) for a in ("Cnt", "Flag"))  # in `_efta_fwd`'s arguments
# where each launch takes the call id (the checksum pre-pass takes none)
_CALL_ID_AT = (None, _efta_fwd.arg_names.index("call_id"), _efta_combine.arg_names.index("call_id"))
_CHECKSUMS, _FORWARD, _COMBINE = range(3)  # the launches, as `_launcher` numbers them


def _launcher(which: int) -> DirectLauncher:
    """0: the checksum pre-pass's launcher (the one the KV-cache tables use, `stored._PREPASS`), 1: the
    forward's, 2: the split-key merge's (looked up at each call, so that tests can replace them)."""
    return (_PREPASS, _FWD_LAUNCH, _COMBINE_LAUNCH)[which]


# The autotuned launch's winners, by the autotuner's own key (bucketed M and N, the flags, the dtypes),
# so that a cached shape launches the kernel directly: `Autotuner.run` spends ~0.1 ms of host time per
# call building its key over the kernel's ~90 arguments, which alone makes q_len-1 decode host-bound
# (0.26-0.47 ms per call on the H100 host against SDPA's 0.02-0.03 ms; 15 us under a CUDA graph).
_TUNED: dict[tuple, Config] = {}
_ARRIVE: dict[torch.device, torch.Tensor] = {}
# The pipeline depth the repairing pass runs at, per (device, dtype, clean-pass config, flags): see
# `_fitting_stages`.
_REPAIR_STAGES: dict[tuple, int] = {}


def _fitting_stages(launch: Callable[[int], None], stages: int, key: tuple) -> int:
    """Run ``launch(s)`` at the deepest pipeline ``s ≤ stages`` whose kernel fits the device's shared
    memory; returns ``s`` (remembered under ``key``, so later calls compile and try nothing).

    The repairing pass inherits the autotuned clean pass's config with key blocks of `CS_BLOCK_N`
    instead of two of them; its checksum and repair operands can need more shared memory than the
    clean pass the autotuner measured (fp16, D = 128: 254,172 B at 3 stages on sm_90, limit 232,448).
    Its programs return at once unless the clean pass flagged them, so a shallower pipeline costs a
    clean call nothing. Triton raises ``OutOfResources`` when it loads the kernel, before launching."""
    known = _REPAIR_STAGES.get(key)
    if known is not None:
        launch(known)
        return known
    s = stages
    while True:
        try:
            launch(s)
            break
        except triton.runtime.errors.OutOfResources:
            if s == 1:  # (nothing shallower to try)
                raise
            s -= 1
    _REPAIR_STAGES[key] = s
    return s


def _arrival_cells(device: torch.device) -> torch.Tensor:
    """Per-device int32 cells that outlive calls (fixed addresses for CUDA graphs), 0 between calls:
    (SPLIT_BLOCKS,), one arrival count per row block of a checks-off split-key call (the row block's
    last program resets its cell, `_efta_fwd`). Made on the device's first call, an eager one
    normally: a tensor first made during torch.compile's CUDA-graph warm-up would live in the graphs'
    pool, which refuses it."""
    c = _ARRIVE.get(device)
    if c is None:
        c = _ARRIVE[device] = torch.zeros(SPLIT_BLOCKS, dtype=torch.int32, device=device)
    return c


# ------------------------------------------------------------------------------------------------
# Replay
# ------------------------------------------------------------------------------------------------


def _as4d(t: torch.Tensor, shape: tuple[int, int, int, int], name: str) -> torch.Tensor:
    if t.dim() > 4:
        raise ValueError(f"{name} must have at most 4 dims, got shape {tuple(t.shape)}")
    t4 = t.reshape((1,) * (4 - t.dim()) + tuple(t.shape))
    try:
        return t4.expand(shape)
    except RuntimeError as exc:
        raise ValueError(f"{name} of shape {tuple(t.shape)} is not broadcastable to {shape}") from exc


def _tsig(t: torch.Tensor | None) -> tuple | None:
    """What a tensor argument's launches depend on: shape, strides, dtype, device, 16-byte alignment."""
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() & 15 == 0)


REPLAYS_MAX = 256  # call signatures whose launches are kept (`_Replay`); the table starts afresh when full
_REPLAYS: dict[tuple, _Replay] = {}


def _replay_key(q, k, v, scale, causal, bias, attn_mask, window, detect, correct, counters, stored: bool,
                opts: Options) -> tuple:
    """A call's signature for `_Replay`: everything the host path decides from (metadata, settings, the
    options in force, whether a CUDA graph is being captured, whether the checksum tables come stored),
    none of the tensors' values."""
    dev = q.device
    return (_tsig(q), _tsig(k), _tsig(v), _tsig(counters), _tsig(bias), _tsig(attn_mask), scale, bool(causal),
            window, bool(detect), bool(correct), stored, opts,
            capturing(dev))


class _Replay:
    """The launches of one call, replayed for later calls of the same signature (`_replay_key`) with
    their own tensors: the host path's validation, config lookup, argument building (~90 arguments per
    launch) and Triton's specialisation key are skipped (bound launches, `DirectLauncher.bind`). The
    layers of a model share one signature within a forward (and across decode steps with a static
    cache); on the full path each call takes 0.17-0.27 ms of host time against SDPA's 0.03-0.04 on the
    H100's host (``docs/benchmarks.md``). Injected calls and PASA take the full path.

    Per call it allocates the output and the call's scratch (checksum tables unless they come stored, the
    repair pass's flags, the split-key partials) with the recorded shapes, and takes a call id. ``cfg`` is
    the recorded call's block config."""

    __slots__ = ("steps", "out_shape", "shape4", "has_bias", "mask_kind", "scratch", "detect", "cfg")

    def __init__(self, launches, per_call: tuple, out_shape, shape4, has_bias: bool, mask_kind: int,
                 scratch: list, detect: bool, cfg: Config, call_id: int) -> None:
        self.out_shape, self.shape4, self.has_bias, self.mask_kind = out_shape, shape4, has_bias, mask_kind
        self.scratch = [(t.shape, t.dtype) for t in scratch]
        self.detect, self.cfg = detect, cfg
        self.steps = record_launches(launches, per_call, call_id, _CALL_ID_AT, _launcher)

    def __call__(self, q, k, v, bias, attn_mask, counters, stored: StoredTables | None) -> torch.Tensor:
        dev = q.device
        out = torch.empty(self.out_shape, dtype=q.dtype, device=dev)
        objs = [q, k, v, out, counters]
        if self.has_bias:
            objs.append(_as4d(bias, self.shape4, "bias"))
        if self.mask_kind:
            m4 = _as4d(attn_mask, self.shape4, "attn_mask")
            objs.append(m4.view(torch.uint8) if self.mask_kind == 1 else m4)
        objs += [torch.empty(shape, dtype=dtype, device=dev) for shape, dtype in self.scratch]
        if stored is not None:
            objs += stored
        call_id = call_flag(dev, self_reset=not self.detect)[1]
        replay_launches(self.steps, tuple(objs), call_id, _launcher)
        return out


# ------------------------------------------------------------------------------------------------
# The steps of a call
# ------------------------------------------------------------------------------------------------


def _validate(q, k, v, counters, window, bias, pasa: PasaShift | None, detect: bool, pasa_precision: str,
              stored: StoredTables | None) -> None:
    """Raise EftaUnsupported for what the kernel does not handle, ValueError for bad arguments."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise EftaUnsupported("q, k, v must be 4-D (B, H, S, D)")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise EftaUnsupported(f"EFTA Triton kernel supports one dtype among float16, bfloat16, float32 for "
                              f"q, k, v; got {q.dtype}, {k.dtype}, {v.dtype}")
    B, Hq, M, D = q.shape
    Hkv = k.shape[1]
    if k.shape != v.shape or k.shape[0] != B or k.shape[3] != D:
        raise EftaUnsupported(f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if not kernel_head_dim(D):
        raise EftaUnsupported(f"EFTA Triton kernel needs a head dim that is a multiple of 16 in [16, 128], "
                              f"got {D}")
    if Hkv == 0 or Hq % Hkv != 0:
        raise EftaUnsupported(f"query heads ({Hq}) must be a multiple of key/value heads ({Hkv})")
    dev = q.device
    if dev.type != "cuda" and not (_INTERP and dev.type == "cpu"):
        why = ("" if os.environ.get("TRITON_INTERPRET", "0") in ("", "0") else
               " (TRITON_INTERPRET=1 is set, but triton was imported before it was: set it before anything "
               "imports triton)")
        raise EftaUnsupported("EFTA Triton kernel needs CUDA tensors (or CPU tensors with "
                              f"TRITON_INTERPRET=1), got {dev}{why}")
    if k.device != dev or v.device != dev:
        raise EftaUnsupported("q, k, v must be on one device")
    if tuple(counters.shape) != COUNTER_SHAPE or counters.dtype != torch.int32 or counters.device != dev:
        raise ValueError(f"counters must be an int32 {COUNTER_SHAPE} tensor on {dev}")
    if window is not None and int(window) < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if bias is not None and not bias.is_floating_point():
        raise ValueError(f"bias must be a floating tensor, got {bias.dtype}")
    if pasa_precision not in ("fp32", "fp16"):
        raise ValueError(f"pasa_precision must be 'fp32' or 'fp16', got {pasa_precision!r}")
    if pasa is not None and not (isinstance(pasa, tuple) and len(pasa) == len(PasaShift._fields)):
        raise TypeError(f"pasa must be a PasaShift (the caller's PASA key shift) or None, got {pasa!r}")
    half_state = pasa_precision == "fp16"
    if half_state and pasa is None:
        raise ValueError("pasa_precision='fp16' is PASA's allocation: it needs PASA on (pasa=True at "
                         "efta_attention, a PasaShift here)")
    if half_state and detect:
        raise ValueError("pasa_precision='fp16' (fp16 softmax state) has no fp16-level check thresholds: run it "
                         "with detect=False, or use pasa_precision='fp32'")
    if pasa is not None and q.dtype != torch.float16:
        raise EftaUnsupported(f"the Triton kernel runs PASA on float16 inputs, got {q.dtype} (the reference path "
                              "takes bfloat16)")
    if stored is not None:
        if pasa is not None or not detect:
            raise ValueError("stored checksum tables serve the checked kernel without PASA (PASA's tables are its "
                             "shifted keys'): pass stored=None")
        want = StoredTables.shapes(B, Hkv, k.shape[2], max(16, _pow2_bucket(D)), q.dtype)
        got = tuple(tuple(t.shape) for t in stored)
        if got != want or any(t.device != dev or not t.is_contiguous() for t in stored):
            raise ValueError(f"stored checksum tables of shapes {got} do not belong to k, v of shape "
                             f"{tuple(k.shape)} ({q.dtype}, {dev}): expected contiguous {want}")


def _score_operands(q: torch.Tensor, bias, attn_mask, shape4) -> tuple[bool, torch.Tensor, int, torch.Tensor]:
    """(has_bias, bias as (B, Hq, M, N) or q, mask kind (0 none, 1 bool, 2 additive), the mask as
    (B, Hq, M, N) — a bool one as its uint8 view — or q): the placeholders are never read."""
    dev = q.device
    has_bias = bias is not None
    bias4 = _as4d(bias, shape4, "bias") if has_bias else q
    mask_kind = 0
    mask4 = q
    if attn_mask is not None:
        mask4 = _as4d(attn_mask, shape4, "attn_mask")
        if mask4.dtype == torch.bool:
            mask_kind = 1
            mask4 = mask4.view(torch.uint8)
        elif mask4.is_floating_point():
            mask_kind = 2
        else:
            raise ValueError(f"attn_mask must be bool or floating, got {attn_mask.dtype}")
    for name, t in (("bias", bias), ("attn_mask", attn_mask)):
        if t is not None and t.device != dev:
            raise ValueError(f"{name} is on {t.device} but q is on {dev}")
    return has_bias, bias4, mask_kind, mask4


def _fixed_config(no_skip: bool, block_sites: bool, interp: bool, opts: Options) -> Config | None:
    """The config a call runs without tuning: the one `Options.efta_config` forces, else injection's (the
    reference's key block) or the interpreter's; None: autotune. While injecting, a forced config is
    taken only with key blocks of two checksum blocks (the wide clean pass, `configs._wide`) and no fault
    at a site indexed by key block (``block_sites``: row max, α, row sum, the O accumulator, checksums), whose positions
    count blocks of the reference's 64 keys."""
    forced = opts.efta_config
    if no_skip and not (forced is not None and forced[1] == 2 * CS_BLOCK_N and not block_sites):
        return CONFIG_INJECT if not interp else CONFIG_INTERPRET
    if interp and forced is None:
        return CONFIG_INTERPRET
    return forced


def _pasa_scalars(shift: PasaShift, D: int, slack: float) -> tuple[float, ...]:
    """PASA's host-side constants for key blocks of CS_BLOCK_N: (step-1 bound coefficient, its
    fp16 subnormal floor, γ, γ of the short last block, diag, off, diag_last, off_last) —
    ``docs/pasa.md`` "Kernel interface"."""
    diag, off, gamma, diag_l, off_l, gamma_l = shift
    bn = CS_BLOCK_N
    nchunk = -(-D // FP16_MMA_K)
    L = bn // STRIDE
    t1 = (1.01 * nchunk * 2.0**-11 + 2.0 * 1.01 * (D + L) * 2.0**-24) * slack  # g16(⌈D/16⌉) + 2·g(D+L)
    s_floor = L * nchunk * 2.0**-25 * slack
    return (t1, s_floor, gamma, gamma_l, diag, off, diag_l, off_l)


def _tma_allocator() -> None:
    """Triton writes on-device tensor descriptors to a global scratch buffer that it asks the process's
    allocator for at launch; without one set in this context (Triton's default raises), this sets one
    that takes the buffer from PyTorch's caching allocator (inside a CUDA graph capture, from the
    graph's pool). An allocator the caller has set is kept."""
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_scratch_from_torch)


def _scratch_from_torch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda" if torch.cuda.is_available() else "cpu")


def _layout(B, Hq, Hkv, M, N, cfg, in_loop, no_skip, pasa, detect, correct, dev, interp, opts: Options):
    """The grid of a call: (pack, qrows, ax1, block_m, nsplit, phased).

    pack: GQA decode, the query heads of a kv head share a program's rows (`decode._program_rows`); not
    while injecting (fault positions index rows of one head) nor with PASA. qrows, ax1: rows per
    (batch, grid axis 1) and that axis. nsplit: programs per query block (split-key decode: few
    (batch, head) programs against a long cache would leave most of the GPU idle). phased: prefill
    with correction runs the repairing pass in a second launch, only for the query blocks whose clean
    pass raised a flag (it holds more state than the clean loop: compiled into the same kernel, it
    makes ptxas spill inside the clean loop, ~20 % of the call on the H100); `Options.efta_two_launch`
    off keeps both passes in one launch (benchmarks, diagnosis). ``in_loop``: faults are injected at a
    site of the key loop (every site but ``attn.output``), whose positions index the unsplit loop."""
    pack = M == 1 and Hq > Hkv and not no_skip and not pasa
    qrows, ax1 = (Hq // Hkv, Hkv) if pack else (M, Hq)
    block_m = cfg[0] if cfg is not None else 16  # the autotuner's decode configs all have BLOCK_M = 16
    row_blocks = B * ax1 * _cdiv(qrows, block_m)
    nsplit = 1 if pasa else _num_splits(row_blocks, M, N, cfg, in_loop, dev, interp, bool(detect), opts.efta_split)
    if not detect and row_blocks > SPLIT_BLOCKS:  # more row blocks than arrival cells
        nsplit = 1
    phased = correct and nsplit == 1 and M > 16 and opts.efta_two_launch
    return pack, qrows, ax1, block_m, nsplit, phased


def _tuned_config(args: tuple, meta: dict, counters: torch.Tensor, flag: torch.Tensor, grid: Callable,
                  tkey: tuple) -> Config:
    """The autotuner's config for this call: from `_TUNED`, or timed now. The candidates run on scratch
    counters and flag: the autotuner times them on a stream of its own, and restoring the caller's
    counters there raced with work queued on the caller's stream (garbage counts, once on an H200).
    The call itself is launched by the caller."""
    cfg = _TUNED.get(tkey)
    if cfg is None:
        scratch = list(args)
        scratch[_CNT_AT] = torch.empty_strided(counters.shape, counters.stride(), dtype=counters.dtype,
                                               device=counters.device).zero_()
        scratch[_FLAG_AT] = torch.zeros_like(flag)
        _efta_fwd_tuned[grid](*scratch, **meta)
        best = _efta_fwd_tuned.best_config
        _TUNED[tkey] = cfg = (best.kwargs["BLOCK_M"], best.kwargs["BLOCK_N"], best.num_warps, best.num_stages)
    return cfg


def _scratch(q, counters, B, Hq, Hkv, M, N, ax1, qrows, block_m, block_d, parts, nsplit, phased, pasa,
             tables_needed):
    """The call's scratch, in the order a `_Replay` allocates it, and its roles:
    (bufs, rep_buf, work, tables, kshift); ``counters`` stands in for what the call does not use.

    rep_buf: the clean launch's flags for the repair launch, one entry per program (16 is the smallest
    BLOCK_M of any config). work: the split-key partial states. tables: the pre-pass's checksum tables
    (KC, VC, KA, VA, SC; `checksums._efta_checksums`), ``tables_needed`` with the checks on or PASA unless
    they come stored. kshift: PASA's shifted keys (B, Hkv, nblocks·CS_BLOCK_N, BLOCK_D) fp16."""
    dev = q.device
    rep_buf = work = kshift = counters
    tables: tuple[torch.Tensor, ...] = (counters,) * 5
    bufs = []
    if phased:
        rep_buf = torch.empty(B * Hq * -(-M // 16), dtype=torch.int32, device=dev)
        bufs.append(rep_buf)
    if nsplit > 1:
        work = torch.empty(B * ax1 * _cdiv(qrows, block_m) * nsplit * ((36 + block_d) * block_m + 17),
                           dtype=torch.float32, device=dev)
        bufs.append(work)
    nb = -(-N // CS_BLOCK_N)
    if pasa:
        kshift = torch.empty((B, Hkv, nb * CS_BLOCK_N, block_d), dtype=torch.float16, device=dev)
    if tables_needed:
        rows = B * Hkv * nb
        tables = (torch.empty((rows, parts, 16, block_d), dtype=q.dtype, device=dev),
                  torch.empty((rows, vc_rows(parts), CS_BLOCK_N), dtype=q.dtype, device=dev),
                  torch.empty((rows, 16), dtype=torch.float32, device=dev),
                  torch.empty((rows, 16), dtype=torch.float32, device=dev),
                  torch.empty((rows, 4), dtype=torch.float32, device=dev))
        bufs += tables
    return bufs, rep_buf, work, tables, kshift


# ------------------------------------------------------------------------------------------------
# The entry point
# ------------------------------------------------------------------------------------------------


@on_tensor_device
def efta_triton_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None,
    causal: bool,
    bias: torch.Tensor | None,
    attn_mask: torch.Tensor | None,
    window: int | None,
    detect: bool,
    correct: bool,
    plan: Any,
    counters: torch.Tensor,
    pasa: PasaShift | None = None,
    pasa_precision: str = "fp32",
    on_config: Callable[[Config], None] | None = None,
    stored: StoredTables | None = None,
) -> torch.Tensor:
    """EFTA forward through the fused Triton kernel; events are added into ``counters``.

    Args:
        q: (B, Hq, M, D); k, v: (B, Hkv, N, D); one dtype among fp16/bf16/fp32; D a multiple of
            16 in [16, 128]; CUDA tensors, or CPU tensors with ``TRITON_INTERPRET=1``.
        scale: score scale (applied to the fp32 GEMM I result); None = 1/sqrt(D).
        causal, window: bottom-right aligned causal mask / sliding window (None = off).
        bias: additive float broadcastable to (B, Hq, M, N), or None.
        attn_mask: bool (True = attend) or additive float, broadcastable likewise, or None.
        detect, correct: run the checks / repair what they find (correct implies detect).
        plan: fault injection plan (attention sites; duck-typed, the contract's docstring), or None.
        counters: int32 (sites, kinds) block (`contract.COUNTER_SHAPE`) on q's device (any strides) the events
            are added into.
        pasa: PASA (the PASA paper, ``docs/pasa.md``) with this key shift (`PasaShift`, resolved by the
            caller), or None: every key block shifted by β times its mean, the score GEMM in FP16
            with FP16 accumulation, the pseudo-average frame; float16 inputs.
        pasa_precision: with PASA, ``"fp32"`` keeps the online-softmax state (m, l, O) in fp32;
            ``"fp16"`` is the PASA paper's full low-precision allocation (x, P, α, l, O rounded to fp16 at
            every update, P·V with FP16 accumulation), without checks (``detect=False``), like the
            reference path.
        on_config: called with the forward launch's block config (BLOCK_M, BLOCK_N, num_warps,
            num_stages), for benchmarks.
        stored: the checksum tables of k and v made when they entered a KV cache (`stored.CacheTables`),
            with the checks on and without PASA: the checksum pre-pass is skipped, and step 1 locates with
            the stored Kc2, so a fault in k or v since the tables were made fails the checks and, located,
            is corrected.

    Returns:
        (B, Hq, M, D) in q's dtype.

    Raises:
        EftaUnsupported (a ValueError): head dim, dtype or device the kernel does not handle.
    """
    opts = options()
    key = None
    if not plan and pasa is None and pasa_precision == "fp32":  # a signature seen before: its launches again
        key = _replay_key(q, k, v, scale, causal, bias, attn_mask, window, detect, correct, counters,
                          stored is not None, opts)
        replay = _REPLAYS.get(key)
        if replay is not None:
            if on_config is not None:
                on_config(replay.cfg)
            return replay(q, k, v, bias, attn_mask, counters, stored)
    interp = _INTERP
    _validate(q, k, v, counters, window, bias, pasa, detect, pasa_precision, stored)
    B, Hq, M, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    dev = q.device
    if scale is None:
        scale = D**-0.5
    correct = bool(correct and detect)
    half_state = pasa_precision == "fp16"
    use_pasa = pasa is not None
    out = torch.empty((B, Hq, M, D), dtype=q.dtype, device=dev)
    if out.numel() == 0:
        return out
    if N == 0:
        return out.zero_()
    shape4 = (B, Hq, M, N)
    has_bias, bias4, mask_kind, mask4 = _score_operands(q, bias, attn_mask, shape4)

    inj, modes = _injection_table(plan, B, Hq, M, N, D, -(-N // INJECT_BLOCK_N), v.dtype, bool(detect), dev)
    mode = dict(zip(ATTENTION_SITES, modes))
    no_skip = any(modes)
    in_loop = any(m for site, m in mode.items() if site != "attn.output")
    cfg = _fixed_config(no_skip, any(mode[s] for s in BLOCK_SITES), interp, opts)
    if inj is None:
        inj = counters  # unused
    arrive = _arrival_cells(dev)
    parts = _PARTS[q.dtype]
    dot_f32 = q.dtype == torch.float32 or (interp and q.dtype == torch.bfloat16)
    slack = BOUNDS.gemm_slack(interp)
    block_d = max(16, _pow2_bucket(D))  # (triton.next_power_of_2 is a slow constexpr_function call)
    pack, qrows, ax1, block_m, nsplit, phased = _layout(B, Hq, Hkv, M, N, cfg, in_loop, no_skip, use_pasa, detect,
                                                        correct, dev, interp, opts)
    if (detect or use_pasa) and cfg is not None and cfg[1] != CS_BLOCK_N and not (
            cfg[1] == 2 * CS_BLOCK_N and _wide(bool(detect), phased, use_pasa, stored is not None)):
        raise ValueError(f"the checked kernel runs key blocks of {CS_BLOCK_N} (of {2 * CS_BLOCK_N} in the clean "
                         f"launch of a prefill with correction); efta_config (FTT_EFTA_CONFIG) asks for {cfg[1]}")
    # checks off never touch the flag: no captured memset for it (the self-resetting cell stays 0)
    flag, call_id = call_flag(dev, self_reset=not detect)
    bufs, rep_buf, work, tables, kshift = _scratch(q, counters, B, Hq, Hkv, M, N, ax1, qrows, block_m, block_d,
                                                   parts, nsplit, phased, use_pasa,
                                                   (detect or use_pasa) and stored is None)
    kc2 = counters  # (unread without KC2_TABLE)
    if stored is not None:
        tables, kc2 = tuple(stored[:5]), stored.kc2
    launches: list = []

    def run(which: int, grid: tuple, args_: tuple, kwargs: dict) -> None:
        _launcher(which)(grid, args_, kwargs)
        launches.append((which, grid, args_, kwargs))  # (only launches that ran are replayed)

    pasa_args = _pasa_scalars(pasa, D, slack) if use_pasa else (0.0,) * 8
    if (detect or use_pasa) and stored is None:  # the checksum tables (and PASA's shifted keys), once per key block
        nb = -(-N // CS_BLOCK_N)
        run(_CHECKSUMS, (nb, Hkv, B), (
            k, v, *tables, kshift, counters, *k.stride(), *v.stride(), Hkv, N, D, float(scale), *pasa_args[4:], 0, nb,
        ), dict(BLOCK_D=block_d, PARTS=parts, SCALE_CS=q.dtype == torch.float16, INTERP=interp, EVEN_D=D == block_d,
                PASA=use_pasa, BLOCK_N=CS_BLOCK_N, KC2_OUT=False, num_warps=4))

    strides = (*q.stride(), *k.stride(), *v.stride(), *out.stride(),
               *(bias4.stride() if has_bias else (0, 0, 0, 0)), *(mask4.stride() if mask_kind else (0, 0, 0, 0)),
               *counters.stride())
    gu = BOUNDS.gamma * BOUNDS.u * slack
    rz_adds = 0 if interp else int(has_bias) + int(mask_kind == 2)  # step 2's second evaluation (`masks._add_again`)
    args = (
        q, k, v, out, counters, flag, bias4, mask4, inj, *tables, kc2, work, kshift, rep_buf, arrive, *strides,
        Hq, Hkv, M, N, D, Hq // Hkv, float(scale), int(window or 0), call_id, nsplit,
        gu, BOUNDS.exp_ulps * BOUNDS.u, BOUNDS.exp_base(CS_BLOCK_N // STRIDE, rz_adds), exp_clamp(v.dtype)[0],
        BOUNDS.snvr_rel, BOUNDS.snvr_cap, *pasa_args[:4],
        min(_pow2_bucket(M), 256), _pow2_bucket(N),
    )
    meta = dict(
        BLOCK_D=block_d, CAUSAL=bool(causal), HAS_WINDOW=window is not None, HAS_BIAS=has_bias,
        MASK_KIND=mask_kind, DETECT=bool(detect), CORRECT=correct,
        INJ_S=mode["attn.scores"], INJ_MS=mode["attn.masked_scores"], INJ_M=mode["attn.rowmax"],
        INJ_X=mode["attn.exponent"], INJ_P=mode["attn.probs"], INJ_PL=mode["attn.probs_lp"], INJ_A=mode["attn.alpha"],
        INJ_L=mode["attn.rowsum"], INJ_ACC=mode["attn.acc"], INJ_MC=mode["attn.rowmax_carry"],
        INJ_O=mode["attn.output"], INJ_CS=mode["attn.checksum"],
        NO_SKIP=no_skip, PARTS=parts, SCALE_CS=q.dtype == torch.float16, DOT_F32=dot_f32, INTERP=interp,
        EVEN_D=D == block_d, SPLIT=nsplit > 1, PASA=use_pasa, HALF_STATE=half_state, PHASE=int(phased),
        # (faults at S, x or Sc1 strike the scaled values, as in the reference: FOLD off)
        FOLD=_fold(interp, use_pasa or has_bias or mask_kind == 2
                   or any(mode[s] for s in ("attn.scores", "attn.masked_scores", "attn.exponent", "attn.checksum")),
                   opts.efta_fold),
        PACK=pack, KC2_TABLE=stored is not None, TMA=_tma(k, v, M, nsplit, use_pasa, opts.efta_tma),
    )
    if meta["TMA"]:
        _tma_allocator()

    def launch_fwd(c: Config, splits: int, **phase) -> None:
        """`_efta_fwd` with config ``c``, ``splits`` programs per query block; ``phase`` overrides PHASE."""
        run(_FORWARD, (_cdiv(qrows, c[0]) * splits, ax1, B), args, dict(
            meta, **phase, BLOCK_M=c[0], BLOCK_N=c[1], num_warps=c[2], num_stages=c[3]))

    if cfg is None:  # autotuned: our own cache of the winners (see _TUNED), the autotuner on a miss
        def grid(meta_):
            return (_cdiv(qrows, meta_["BLOCK_M"]) * nsplit, ax1, B)

        tkey = (dev, q.dtype, bias4.dtype, mask4.dtype, args[-2], args[-1], *meta.values())
        cfg = _tuned_config(args, meta, counters, flag, grid, tkey)
    launch_fwd(cfg, nsplit)
    if on_config is not None:
        on_config(cfg)
    if phased:  # the repairing pass: its programs return at once unless the clean launch flagged them
        _fitting_stages(lambda s: launch_fwd((cfg[0], CS_BLOCK_N, cfg[2], s), 1, PHASE=2),  # (checksum blocks)
                        cfg[3], (dev, q.dtype, tuple(cfg), *meta.values()))
    if nsplit > 1 and detect:  # checked split-key decode: the merge launch (checks off merge in `_efta_fwd`)
        run(_COMBINE, (_cdiv(qrows, block_m), ax1, B), (
            q, k, v, out, counters, flag, bias4, mask4, inj, work, *strides,
            Hq, M, N, D, Hq // Hkv, float(scale), int(window or 0), call_id, nsplit, gu,
        ), dict({name: meta[name] for name in ("BLOCK_D", "CAUSAL", "HAS_WINDOW", "HAS_BIAS", "MASK_KIND", "DETECT",
                                            "CORRECT", "INJ_O", "DOT_F32", "EVEN_D", "FOLD", "PACK")},
                BLOCK_M=block_m, BLOCK_N=CS_BLOCK_N, num_warps=4))
    per_call = (q, k, v, out, counters, *((bias4,) if has_bias else ()), *((mask4,) if mask_kind else ()), *bufs,
                *(stored if stored is not None else ()))
    # a call whose tensors alias (e.g. k is v) is not recorded: its arguments could not tell them apart
    if key is not None and len(set(map(id, per_call))) == len(per_call):
        if len(_REPLAYS) >= REPLAYS_MAX:
            _REPLAYS.clear()
        _REPLAYS[key] = _Replay(launches, per_call, out.shape, shape4, has_bias, mask_kind, bufs, bool(detect), cfg,
                                call_id)
    return out
