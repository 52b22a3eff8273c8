"""The checked GEMM's launches, resolved on the host: each as ``(which, grid, args, kwargs)`` for its
launcher (``which``: 0 the tile GEMM, 1 the group verification, 2 the decode kernel, 3 the persistent GEMM,
5 the cuBLAS form's check, each a `DirectLauncher`; 4 the cuBLAS form's product with its checksum programs on a
side stream, `_product_launch`), plus the buffers, per-device cells and side streams they use and the operands
derived from the weight (the column-group checksums and constants, and the checksum slices the verification
multiplies).

Module-level state (each documented where it is defined): the seven launchers, the side streams
(`_side_stream`), the per-device cells (`_cells`) and the persistent form's scratch buffers (`_scratch`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton

from ..contract import derive_seed
from ..gemm_checksums import GROUP_COLS, WeightChecksums, group_checksums, scale_variance_terms
from ..launch import DirectLauncher
from ..tl_common import capturing
from ..tl_common import cdiv as _cdiv
from .checksum_tiles import CHECKSUM_SLICES, checksum_cols, checksum_split
from .common import SITE
from .configs import GROUP_M, VERIFY_BLOCK
from .decode import grouped_gemm_kernel
from .forms import INTERP, SPLIT_MAX_TILES, check_warps, grouped_split, split_plan, triton_allocation, verify_split
from .groups import _group_verify_kernel
from .persistent import _persistent_kernel
from .product_check import _checksum_kernel, _product_check_kernel
from .tile import _gemm_kernel

_GEMM_LAUNCH = DirectLauncher(_gemm_kernel, INTERP)
_VERIFY_LAUNCH = DirectLauncher(_group_verify_kernel, INTERP)
_GROUPED_LAUNCH = DirectLauncher(grouped_gemm_kernel, INTERP)
_PERSISTENT_LAUNCH = DirectLauncher(_persistent_kernel, INTERP)
_CHECK_LAUNCH = DirectLauncher(_product_check_kernel, INTERP)
_CHECKSUM_LAUNCH = DirectLauncher(_checksum_kernel, INTERP)
# where each launch takes its call id (only the verifications have a non-finite flag)
_CALL_ID_AT = (None, _group_verify_kernel.arg_names.index("call_id"), None, None, None,
               _product_check_kernel.arg_names.index("call_id"), grouped_gemm_kernel.arg_names.index("call_id"))


def fp32_product(x2d: torch.Tensor, weight: torch.Tensor, weight_is_kn: bool,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """(M, N) fp32 = x2d (M, K) · W, W (N, K) or with ``weight_is_kn`` (K, N), fp16/bf16 operands, into ``out``
    when given.

    CUDA: cuBLAS with fp32 output (fp32 accumulation, no rounding to x's dtype). Elsewhere (the interpreter's
    tests) the product of the operands upcast to fp32: the same exact products, summed in another order."""
    wt = weight if weight_is_kn else weight.t()
    if x2d.is_cuda:
        return torch.mm(x2d, wt, out_dtype=torch.float32, out=out)
    return torch.mm(x2d.float(), wt.float(), out=out)


_SIDE: dict[torch.device, tuple] = {}  # device → (side stream, fork event, join event) of the cuBLAS form


def _side_stream(device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Event, torch.cuda.Event]:
    """The cuBLAS form's side stream on ``device`` and the two events that fork onto it and join back (kept: each
    wait is enqueued right after its record, and a CUDA graph captures the pair as a branch)."""
    side = _SIDE.get(device)
    if side is None:
        side = _SIDE[device] = (torch.cuda.Stream(device), torch.cuda.Event(), torch.cuda.Event())
    return side


def _product_launch(grid, args: tuple, kwargs: dict) -> None:
    """The cuBLAS form's first step as a launcher of `record_launches`: ``args`` = (x2d, w, P, then the checksum
    programs' arguments, `_checksum_kernel`'s with x2d and P among them); ``kwargs``: ``kn`` (w is stored
    (K, N)), ``grid`` and ``meta`` (the checksum launch's grid and constexprs), and once launched ``bound`` (its
    compiled kernel, `DirectLauncher.bind`: a prepared call keeps these kwargs). On CUDA the checksum programs run
    on the side stream while cuBLAS's product x2d·w goes into P's first M·N elements on the current one, which
    then waits for them; elsewhere (the interpreter) one after the other. (x2d and P are the current stream's
    allocations: it waits for the side stream before any later work, so reusing their memory stays ordered.)"""
    x2d, w, P = args[:3]
    kn = kwargs["kn"]
    m, n = x2d.shape[0], w.shape[1] if kn else w.shape[0]
    if not x2d.is_cuda:
        _CHECKSUM_LAUNCH(kwargs["grid"], args[3:], kwargs["meta"])
        fp32_product(x2d, w, kn, P[:m * n].view(m, n))
        return
    side, fork, join = _side_stream(x2d.device)
    main = torch.cuda.current_stream()
    fork.record(main)
    side.wait_event(fork)
    torch.cuda.set_stream(side)
    try:
        bound = kwargs.get("bound")
        if bound is not None:  # (a recorded step's later calls: its arguments specialise alike)
            bound(args[3:])
        else:
            _CHECKSUM_LAUNCH(kwargs["grid"], args[3:], kwargs["meta"])
            kwargs["bound"] = _CHECKSUM_LAUNCH.bind(kwargs["grid"], args[3:], kwargs["meta"])
    finally:
        torch.cuda.set_stream(main)
    fp32_product(x2d, w, kn, P[:m * n].view(m, n))
    join.record(side)
    main.wait_event(join)


def _launcher(which: int) -> Callable[[tuple | None, tuple, dict], None]:
    """0: the GEMM's launcher, 1: the group verification's, 2: the decode kernel's, 3: the persistent GEMM's,
    4: the cuBLAS form's product and checksums, 5: its check, 6: the decode kernel's over several row blocks (a
    call id of its own; looked up at each call, so tests can replace them)."""
    return (_GEMM_LAUNCH, _VERIFY_LAUNCH, _GROUPED_LAUNCH, _PERSISTENT_LAUNCH, _product_launch, _CHECK_LAUNCH,
            _GROUPED_LAUNCH)[which]


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
    tma: bool = False  # load x, w and store y through TMA tensor descriptors (`forms.tma_ok`)



_SCRATCH: dict[tuple, torch.Tensor] = {}  # (device, stream, bytes) → the eager launches' scratch buffer


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Triton's global-scratch allocator (the persistent kernel's TMA descriptors), from torch's caching
    allocator: on the interpreter's CPU, or the current CUDA device. Eager launches reuse one buffer per
    (device, stream, size), since launches on one stream run one after the other (no programmatic dependent
    launch here; a fresh buffer per launch was 5 µs of host time per call); a captured launch gets its own,
    from its graph's pool (such memory must not be kept past the graph)."""
    if INTERP:
        return torch.empty(size, dtype=torch.int8, device="cpu")
    if capturing():
        return torch.empty(size, dtype=torch.int8, device="cuda")
    key = (torch.cuda.current_device(), stream, size)
    buf = _SCRATCH.get(key)
    if buf is None:
        buf = _SCRATCH[key] = torch.empty(size, dtype=torch.int8, device="cuda")
    return buf


def _ensure_scratch_allocator() -> None:
    """Set `_scratch` as Triton's allocator where none is set (Triton keeps it per context, so a thread of
    its own has none); an allocator the user set stays."""
    if isinstance(triton_allocation._allocator.get(), triton_allocation.NullAllocator):
        triton.set_allocator(_scratch)


def _descriptors(cfg, L: _Launch):
    """(Xd, Wd, Yd) tensor descriptors with the config's block shapes, or (x, w, y) without TMA."""
    if not L.tma:
        return L.x, L.w, L.y
    from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: PLC0415

    bm, bn, bk = cfg[:3]
    return (TensorDescriptor.from_tensor(L.x, [bm, bk]),
            TensorDescriptor.from_tensor(L.w, [bk, bn] if L.kn else [bn, bk]),
            TensorDescriptor.from_tensor(L.y, [bm, bn]))


def _inj_table(plan, m: int, n: int, dtype: torch.dtype, device: torch.device,
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


@dataclass
class _Verify:
    """The verification arguments of one call."""

    counters: torch.Tensor  # (sites, kinds) int32
    debug: torch.Tensor | None  # (M, T_g, 3) fp32 or None
    w_finite: bool
    reverify: float  # the decode kernel's: the threshold factor a repair is re-verified with
    correct: bool


_CELLS: dict[torch.device, torch.Tensor] = {}


def _cells(device: torch.device) -> torch.Tensor:
    """Per-device int32 cells that outlive calls (no allocation per call, fixed addresses for CUDA graphs),
    all 0 between calls: ``[t]`` counts the splits of tile t of a split-K call (the tile and decode
    kernels' SPLIT; the last split resets it)."""
    c = _CELLS.get(device)
    if c is None:
        c = _CELLS[device] = torch.zeros(SPLIT_MAX_TILES, dtype=torch.int32, device=device)
    return c


def _call_buffer(m: int, n: int, k: int, cfg, detect: bool, device: torch.device,
                 unused: torch.Tensor, fused: Fused | None = None) -> torch.Tensor:
    """fp32 scratch of a tile-GEMM call: with ``detect`` its (T_g, M) group sums, then the split verification's
    partials (`groups._group_verify_kernel`); with ``fused`` (the checksum programs in the GEMM's launch,
    `checksum_tiles`) the group sums, then their partials C (splits, M, S·T_g) and x's statistics (splits, M, 4);
    checks off: room for the split-K partial tiles (n_split, M, N), or ``unused`` (any tensor, passed as the
    kernel's unread ``P``) without them."""
    if detect:
        tg = _cdiv(n, GROUP_COLS)
        if fused is not None:
            return torch.empty(tg * m + fused.split * m * (fused.cols + 4), dtype=torch.float32, device=device)
        part = 0
        br, bg, bk = VERIFY_BLOCK[:3]
        vs, per = verify_split(m, n, k, device)
        if vs > 1:
            # (room for 4 statistics per row: x's sum, max, min and, with XVAR, its sum of squares)
            part = _cdiv(_cdiv(k, bk), per) * _cdiv(m, br) * _cdiv(tg, bg) * br * (bg + 4)
        return torch.empty(tg * m + part, dtype=torch.float32, device=device)
    n_split = split_plan(m, n, k, cfg, detect, device)[0]
    return torch.empty(n_split * m * n, dtype=torch.float32, device=device) if n_split > 1 else unused


def _product_buffer(m: int, n: int, plan: tuple, nc: int, device: torch.device) -> torch.Tensor:
    """fp32 scratch of a cuBLAS-form call: the product (M, N), then its checksum programs' partials (`plan` of
    `forms.checksum_plan`, ``nc`` = S·T_g columns): C (splits, M, nc) and x's statistics (splits, M, 4)."""
    return torch.empty(m * n + plan[5] * m * (nc + 4), dtype=torch.float32, device=device)


def _group_sums(wc: WeightChecksums, weight: torch.Tensor, bias: torch.Tensor | None,
                weight_is_kn: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight's `gemm_checksums.group_checksums`, cached with its `WeightChecksums`."""
    g = wc.groups.get(GROUP_COLS)
    if g is None:
        g = wc.groups[GROUP_COLS] = group_checksums(weight, bias, weight_is_kn)
    return g


def _threshold_groups(wc: WeightChecksums, weight: torch.Tensor, bias: torch.Tensor | None, weight_is_kn: bool,
                      var_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`_group_sums` with the constants' variance terms scaled by ``var_scale`` = e_var / e_max
    (`gemm_checksums.scale_variance_terms`), cached per scale with the `WeightChecksums`."""
    g = _group_sums(wc, weight, bias, weight_is_kn)
    if var_scale == 1.0:
        return g
    key = ("consts", var_scale)
    c = wc.groups.get(key)
    if c is None:
        c = wc.groups[key] = scale_variance_terms(g[1], var_scale)
    return g[0], c


def group_operand(wc: WeightChecksums, weight: torch.Tensor, bias: torch.Tensor | None, weight_is_kn: bool,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The group checksums as the verification's dot operand, cached with the `WeightChecksums`: ``Wc``
    (S, T_g, K) in ``dtype`` holds ``w1g`` (`group_checksums`) times a power of two in S slices whose sum
    keeps its fp32 accuracy (fp16: S = 2, the scale putting the largest |value| in [2^14, 2^15): 22
    significant bits, nothing overflows; bf16: S = 3, 24 bits, unscaled; fp32: S = 1), ``Winv`` (1,) fp32
    the inverse scale. Device ops only (no host read)."""
    key = ("operand", dtype)
    op = wc.groups.get(key)
    if op is None:
        w1g = _group_sums(wc, weight, bias, weight_is_kn)[0]
        parts = CHECKSUM_SLICES[dtype]
        scale = torch.ones(1, dtype=torch.float32, device=w1g.device)
        if dtype == torch.float16:  # amax = f·2^e with f in [0.5, 1): ·2^(15 − e) puts it in [2^14, 2^15)
            scale = torch.ldexp(scale, 15 - torch.frexp(w1g.abs().amax().reshape(1)).exponent)
        rest = w1g * scale
        slices = []
        for _ in range(parts):
            sl = rest.to(dtype)
            slices.append(sl)
            rest = rest - sl.float()
        op = wc.groups[key] = (torch.stack(slices).contiguous(), 1.0 / scale)
    return op


def _row_blocks(m: int, cfg) -> bool:
    """Whether a decode-kernel call of M rows spans several row blocks of the config's BLOCK_M (the kernel's
    MULTI)."""
    return m > cfg[0]


def decode_launcher(m: int, cfg) -> int:
    """The `_launcher` index of a decode-kernel call: 2 for one row block, 6 for several (which take a call id)."""
    return 6 if _row_blocks(m, cfg) else 2


def _grouped_buffer(m: int, n: int, k: int, cfg, device: torch.device) -> torch.Tensor | None:
    """The decode kernel's split-K partials: (n_split, M, N) tiles, then (n_split, T, M, 4 or 5) checksums and
    statistics (room for 5: x·w1_g, x's sum, max, min and, with XVAR, its sum of squares); None without
    split-K."""
    s = grouped_split(m, n, k, cfg, device)[0]
    if s == 1:
        return None
    return torch.empty(s * m * (n + _cdiv(n, cfg[1]) * 5), dtype=torch.float32, device=device)


def _grouped_call(cfg, L: _Launch, *, bias, groups, P, inj, ver: _Verify, emax: float, csigma: float,
                  verify_output: bool, dot_f32: bool, xvar: bool, siblings: tuple = (),
                  flag: tuple[torch.Tensor, int] | None = None) -> tuple:
    """The decode kernel's launch as ``(grid, args, kwargs)``; ``groups`` = (w1g, consts) of
    `_group_sums`, ``P`` = `_grouped_buffer`; ``xvar``: x's outlier variance estimate in the thresholds
    (`gemm_checksums.xvar_in_use`); ``flag``: the call's (flag cell, call id) of `tl_common.call_flag`, for a
    call of several row blocks (`decode_launcher`; one row block reads neither). ``siblings``: up to two more
    weights after ``L.w`` in the same launch (`checked_gemm_siblings`), each ``(weight, bias, groups, counters)``;
    ``L.y`` then holds all their columns, ``L.w``'s first."""
    bm, bn, bk, warps, stages = cfg[:5]
    assert bn == GROUP_COLS, cfg
    m, k = L.x.shape
    n = L.y.shape[1]
    w1g, gc = groups
    n_split, kb_per = grouped_split(m, n, k, cfg, L.x.device)
    c = ver.counters
    cells = _cells(L.x.device)
    fcell, call_id = flag if flag is not None else (cells, 0)
    seg = [(L.w, bias if bias is not None else gc, w1g, gc, c)]
    starts, t0 = [], _cdiv(L.w.shape[1] if L.kn else L.w.shape[0], bn)
    for w_s, b_s, (w1g_s, gc_s), c_s in siblings:
        seg.append((w_s, b_s if b_s is not None else gc_s, w1g_s, gc_s, c_s))
        starts.append(t0)
        t0 += _cdiv(w_s.shape[0], bn)
    segs = len(seg)
    seg += [seg[0]] * (3 - segs)
    starts += [0] * (2 - len(starts))
    return (_cdiv(m, bm) * _cdiv(n, bn) * n_split,), (
        L.x, L.w, L.y, seg[0][1], w1g, gc, inj if inj is not None else gc,
        P if P is not None else gc, cells, c, fcell, call_id, *seg[1], *seg[2], *starts,
        m, n, k, L.x.stride(0), L.x.stride(1), L.swn, L.swk, L.y.stride(0), L.y.stride(1), c.stride(0), c.stride(1),
        1.0 / k, float(emax), float(csigma), float(ver.reverify), int(ver.w_finite), n_split, kb_per,
    ), dict(
        BLOCK_M=bm, G=bn, BLOCK_K=bk, ROWS=triton.next_power_of_2(min(m, bm)), HAS_BIAS=bias is not None,
        VERIFY_OUTPUT=verify_output,
        INJ=inj is not None, DOT_F32=dot_f32, EVEN_K=k % bk == 0, CORRECT=ver.correct, SPLIT=n_split > 1,
        SEGS=segs, XVAR=bool(xvar), MULTI=_row_blocks(m, cfg), num_warps=warps, num_stages=stages,
    )


def _launch_gemm(cfg, L: _Launch, **kw) -> None:
    """Launch `_gemm_call`'s GEMM."""
    _launcher(0)(*_gemm_call(cfg, L, **kw))


@dataclass(frozen=True)
class Fused:
    """The checksum programs of a call (`checksum_tiles`): their weight (S·T_g, K), whether x's sum of squares is
    wanted (XVAR), and their K split (splits, K blocks per split)."""

    wc: torch.Tensor
    xvar: bool
    split: int
    kb_per: int

    @property
    def cols(self) -> int:
        return self.wc.shape[0]


def fused_plan(operand: tuple[torch.Tensor, torch.Tensor], xvar: bool, m: int, k: int, cfg) -> Fused:
    """The checksum programs of a call of config ``cfg`` on `group_operand`'s slices (S, T_g, K), read as a
    weight (S·T_g, K) (a view, no copy)."""
    wc = operand[0]
    wcf = wc.view(wc.shape[0] * wc.shape[1], wc.shape[2])
    return Fused(wcf, bool(xvar), *checksum_split(m, k, wcf.shape[0], cfg[2]))


def _checksum_programs(fused: Fused | None, m: int, bm: int, bn: int, w: torch.Tensor) -> tuple[int, int, tuple]:
    """(programs, CN, (Wc, NC, splits, K blocks per split)) of a call's checksum tiles (`checksum_tiles`): the
    GEMM kernels' arguments for them; none without ``fused`` (then ``w``, any tensor, stands for the unread
    Wc)."""
    if fused is None:
        return 0, 16, (w, 0, 1, 1)
    cn = checksum_cols(fused.cols, bn)
    return _cdiv(m, bm) * _cdiv(fused.cols, cn) * fused.split, cn, (fused.wc, fused.cols, fused.split, fused.kb_per)


def _gemm_call(cfg, L: _Launch, *, bias, P, inj, detect, verify_output, dot_f32, fused: Fused | None = None) -> tuple:
    """The tile GEMM launch as ``(grid, args, kwargs)``. P: the `_call_buffer`. ``fused``: the checksum programs
    that compute the group checksums in this launch (`fused_plan`), or None."""
    bm, bn, bk, warps, stages = cfg[:5]
    m, k = L.x.shape
    n = L.y.shape[1]
    t = _cdiv(n, bn)
    n_split, kb_per = split_plan(m, n, k, cfg, detect, L.x.device)
    c_progs, cn, (wc, nc, c_split, c_kb_per) = _checksum_programs(fused, m, bm, bn, L.w)
    grid = (_cdiv(m, bm) * t * n_split + c_progs,)
    xd, wd, yd = _descriptors(cfg, L)
    cells = _cells(L.x.device)
    return grid, (
        L.x, L.w, L.y, xd, wd, yd, bias if bias is not None else L.y, P, inj if inj is not None else cells, cells,
        wc, m, n, k, nc, L.x.stride(0), L.x.stride(1), L.swn, L.swk, L.y.stride(0), L.y.stride(1), n_split, kb_per,
        c_split, c_kb_per,
    ), dict(
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP=GROUP_M, HAS_BIAS=bias is not None, DETECT=detect,
        VERIFY_OUTPUT=verify_output, INJ=inj is not None, DOT_F32=dot_f32, EVEN_K=k % bk == 0,
        TMA=L.tma, W_KN=L.kn, TMA_STORE=L.tma, SPLIT=n_split > 1, FUSED=fused is not None, CN=cn,
        XVAR=fused is not None and fused.xvar, num_warps=warps, num_stages=stages,
    )


def _persistent_call(cfg, L: _Launch, bias: torch.Tensor | None, P: torch.Tensor, verify_output: bool, *,
                     sms: int, fused: Fused | None = None) -> tuple:
    """The persistent GEMM (`_persistent_kernel`) as ``(grid, args, kwargs)``: one program per SM of the
    ``sms`` (per tile if fewer). ``fused``: as `_gemm_call`'s."""
    bm, bn, bk, warps, stages = cfg[:5]
    m, k = L.x.shape
    n = L.y.shape[1]
    c_progs, cn, (wc, nc, c_split, c_kb_per) = _checksum_programs(fused, m, bm, bn, L.w)
    sms = min(_cdiv(m, bm) * _cdiv(n, bn) + c_progs, sms)
    return (sms,), (L.x, L.w, L.y, bias if bias is not None else L.y, P, wc, m, n, k, nc, L.x.stride(0),
                    L.w.stride(0), L.y.stride(0), c_split, c_kb_per), dict(
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP=GROUP_M, NUM_SMS=sms, HAS_BIAS=bias is not None, W_KN=L.kn,
        VERIFY_OUTPUT=verify_output, DOT_F32=INTERP, FUSED=fused is not None, CN=cn, EVEN_K=k % bk == 0,
        XVAR=fused is not None and fused.xvar, num_warps=warps, num_stages=stages)


def checksum_rows(operand: tuple[torch.Tensor, torch.Tensor]) -> int:
    """S·T_g: the rows of `group_operand`'s slices (S, T_g, K) read as one weight, the checksum columns of the
    cuBLAS form's checksum programs."""
    return operand[0].shape[0] * operand[0].shape[1]


def _product_call(L: _Launch, P: torch.Tensor, operand: tuple[torch.Tensor, torch.Tensor], plan: tuple,
                  xvar: bool) -> tuple:
    """The cuBLAS form's product and checksum programs into its `_product_buffer` ``P``: ``(grid, args, kwargs)``
    of `_product_launch` (no grid of its own). ``operand``: `group_operand`'s slices (S, T_g, K), read as a
    weight (S·T_g, K); ``plan``: `forms.checksum_plan`'s; ``xvar``: x's sum of squares too."""
    x2d = L.x
    m, k = x2d.shape
    n = L.y.shape[1]
    nc = checksum_rows(operand)
    wcf = operand[0].view(nc, k)
    bm, cn, bk, warps, stages, splits, per = plan
    grid = (_cdiv(m, bm) * _cdiv(nc, cn) * splits,)
    meta = dict(BLOCK_M=bm, CN=cn, BLOCK_K=bk, EVEN_K=k % bk == 0, DOT_F32=INTERP or x2d.dtype == torch.float32,
                XVAR=bool(xvar), num_warps=warps, num_stages=stages)
    return None, (x2d, L.w, P, x2d, wcf, P, m, k, nc, m * n, x2d.stride(0), x2d.stride(1), splits, per), dict(
        kn=L.kn, grid=grid, meta=meta)


def _check_call(L: _Launch, bias: torch.Tensor | None, P: torch.Tensor, flag: torch.Tensor, call_id: int,
                ver: _Verify, operand: tuple[torch.Tensor, torch.Tensor], consts: torch.Tensor, emax: float,
                csigma: float, dot_f32: bool, *, xvar: bool, inj: torch.Tensor | None, verify_output: bool,
                blocks: tuple[int, int], splits: int) -> tuple:
    """The cuBLAS form's check (`product_check._product_check_kernel`) after `_product_call`: ``(grid, args,
    kwargs)``. ``operand``: `group_operand`'s (Wc, Winv); ``consts`` (T_g, 8) from `group_checksums`; ``inj``
    the flips at ``linear.output``, bucketed per ``blocks[0]`` rows; ``verify_output``: the group sums of the
    rounded outputs; ``blocks`` (BLOCK_R, BLOCK_G) of `forms.check_blocks`; ``splits``: the checksum partials'."""
    x2d, y = L.x, L.y
    m, k = x2d.shape
    n = y.shape[1]
    tg = _cdiv(n, GROUP_COLS)
    wc, winv = operand
    br, bg = blocks
    c = ver.counters
    return (_cdiv(m, br) * _cdiv(tg, bg),), (
        x2d, L.w, y, bias if bias is not None else y, winv, consts, P, inj if inj is not None else P, flag, c,
        ver.debug if ver.debug is not None else P,
        m, n, k, tg, m * n, splits, x2d.stride(0), x2d.stride(1), L.swn, L.swk, y.stride(0), y.stride(1),
        c.stride(0), c.stride(1), 1.0 / k, call_id, int(ver.w_finite), float(emax), float(csigma),
    ), dict(
        BLOCK_R=br, BLOCK_G=bg, REPAIR_K=VERIFY_BLOCK[2], SLICES=wc.shape[0], HAS_BIAS=bias is not None,
        CORRECT=ver.correct, DEBUG=ver.debug is not None, DOT_F32=dot_f32, INJ=inj is not None,
        VERIFY_OUTPUT=verify_output, XVAR=bool(xvar), num_warps=check_warps(blocks),
        num_stages=1,
    )


def _verify_call(L: _Launch, bias: torch.Tensor | None, P: torch.Tensor, flag: torch.Tensor, call_id: int,
                 ver: _Verify, operand: tuple[torch.Tensor, torch.Tensor], consts: torch.Tensor, emax: float,
                 csigma: float, dot_f32: bool, *, xvar: bool, fused: Fused | None = None) -> tuple:
    """The group verification after the GEMM (`_group_verify_kernel`): ``(grid, args, kwargs)``. ``operand``:
    `group_operand`'s (Wc, Winv); ``consts`` (T_g, 8) from `group_checksums`; ``xvar``: x's outlier variance
    estimate in the thresholds (`gemm_checksums.xvar_in_use`). ``fused``: the checksum programs
    of the GEMM's launch, which left the checksums and x's statistics in P (`checksum_tiles`), or None."""
    x2d, y = L.x, L.y
    m, k = x2d.shape
    n = y.shape[1]
    tg = _cdiv(n, GROUP_COLS)
    br, bg, bk = VERIFY_BLOCK[:3]
    wc, winv = operand
    c = ver.counters
    n_split, kb_per = (1, 1) if fused is not None else verify_split(m, n, k, x2d.device)
    return (_cdiv(m, br) * _cdiv(tg, bg) * n_split,), (
        x2d, L.w, y, bias if bias is not None else y, wc, winv, consts, P, _cells(x2d.device), flag, c,
        ver.debug if ver.debug is not None else P,
        m, n, k, tg, x2d.stride(0), x2d.stride(1), L.swn, L.swk, y.stride(0), y.stride(1), c.stride(0), c.stride(1),
        1.0 / k, call_id, int(ver.w_finite), float(emax), float(csigma), n_split, kb_per,
        fused.split if fused is not None else 1,
    ), dict(
        BLOCK_R=br, BLOCK_G=bg, BLOCK_K=bk, SLICES=wc.shape[0], HAS_BIAS=bias is not None, CORRECT=ver.correct,
        DEBUG=ver.debug is not None, DOT_F32=dot_f32, SPLIT=n_split > 1, XVAR=bool(xvar), FUSED=fused is not None,
        num_warps=VERIFY_BLOCK[3], num_stages=VERIFY_BLOCK[4],
    )
