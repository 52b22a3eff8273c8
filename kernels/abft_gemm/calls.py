"""The checked GEMM's launches, resolved on the host: each as ``(which, grid, args, kwargs)`` for its
`DirectLauncher` (``which``: 0 the tile GEMM, 1 the verify kernel, 2 the decode kernel, 3 the persistent
form's pass over x, 4 its GEMM), plus the buffers and per-device cells they use and the operands
derived from the weight (decode group checksums, the persistent pass's checksum operand).

Module-level state (each documented where it is defined): the five launchers, the per-device cells
(`_cells`) and the persistent form's scratch buffers (`_scratch`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton

from ..contract import derive_seed
from ..gemm_checksums import GROUP_COLS, WeightChecksums, group_checksums
from ..launch import DirectLauncher
from ..tl_common import cdiv as _cdiv
from .common import SITE
from .configs import (
    GROUP_M,
    ONE_LAUNCH_VERIFY_ROWS,
    SLACK_BLOCK_K,
    SLACK_STAGES,
    STATS_COLS,
    STATS_ROWS,
    VERIFY_BLOCK,
    VERIFY_ROWS,
    VERIFY_TILES,
)
from .decode import grouped_gemm_kernel
from .forms import CSUM_ROWS, INTERP, ONE_LAUNCH_ROW_BLOCKS, csum_layout, grouped_split, split_plan, triton_allocation
from .persistent import _persistent_kernel, _stats_kernel
from .tile import _gemm_kernel
from .verify import _verify_kernel

_STATS_W = 8  # fp32 per row in the stats buffer: c1, c2, max, min, sum, (pad)

_GEMM_LAUNCH = DirectLauncher(_gemm_kernel, INTERP)
_VERIFY_LAUNCH = DirectLauncher(_verify_kernel, INTERP)
_GROUPED_LAUNCH = DirectLauncher(grouped_gemm_kernel, INTERP)
_STATS_LAUNCH = DirectLauncher(_stats_kernel, INTERP)
_PERSISTENT_LAUNCH = DirectLauncher(_persistent_kernel, INTERP)
# where each launch takes its call id (the decode kernel takes none: it has no non-finite flag)
_CALL_ID_AT = (_gemm_kernel.arg_names.index("call_id"), _verify_kernel.arg_names.index("call_id"), None,
               _stats_kernel.arg_names.index("call_id"), _persistent_kernel.arg_names.index("call_id"))


def _launcher(which: int) -> DirectLauncher:
    """0: the GEMM's launcher, 1: the verify kernel's, 2: the decode kernel's, 3: the persistent form's pass
    over x, 4: its GEMM (looked up at each call, so tests can replace them)."""
    return (_GEMM_LAUNCH, _VERIFY_LAUNCH, _GROUPED_LAUNCH, _STATS_LAUNCH, _PERSISTENT_LAUNCH)[which]


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
    programs (`csum_layout`), at least their (n_csum, M, 8) slots followed by ``part`` floats (the
    split-K partial tiles, (n_split, M, N))."""
    return torch.empty(max(t * m * (2 + _STATS_W), n_csum * m * _STATS_W + part), dtype=torch.float32,
                       device=device)


def _call_buffer(m: int, n: int, k: int, cfg, one: bool, detect: bool, device: torch.device,
                 unused: torch.Tensor) -> torch.Tensor:
    """The `_stats_buffer` of a call with config ``cfg``, one launch or two; checks off: room for the
    split-K partials, or ``unused`` (any tensor, passed as the kernel's unread ``P``) without them."""
    n_csum = csum_layout(m, k, cfg[0], one)[0] if detect else 0
    n_split = split_plan(m, n, k, cfg, n_csum, detect, device)[0]
    part = n_split * m * n if n_split > 1 else 0
    if not detect:
        return torch.empty(part, dtype=torch.float32, device=device) if part else unused
    return _stats_buffer(_cdiv(n, cfg[1]), m, device, n_csum, part)


def _group_sums(wc: WeightChecksums, weight: torch.Tensor, bias: torch.Tensor | None,
                weight_is_kn: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight's `gemm_checksums.group_checksums`, cached with its `WeightChecksums`."""
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


def _grouped_buffer(m: int, n: int, k: int, cfg, device: torch.device) -> torch.Tensor | None:
    """The decode kernel's split-K partials: (n_split, M, N) tiles, then (n_split, T, M, 4) checksums and
    statistics; None without split-K."""
    s = grouped_split(n, k, cfg, device)[0]
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
    n_split, kb_per = grouped_split(n, k, cfg, L.x.device)
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
    """The GEMM launch as ``(grid, args, kwargs)``; with ``verify`` (`forms.one_launch`) it verifies too.

    P: the `_stats_buffer` (or any placeholder without ``detect``); ws: the int32 cells the launch
    uses (the recompute slot counter, or with ``verify`` the one-launch cell block of `_cells`)."""
    bm, bn, bk, warps, stages = cfg[:5]
    m, k = L.x.shape
    n = L.y.shape[1]
    t = _cdiv(n, bn)
    one = verify is not None
    n_csum, csum_r, csum_k = csum_layout(m, k, bm, one)
    n_split, kb_per = split_plan(m, n, k, cfg, n_csum, detect, L.x.device)
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


def _persistent_call(cfg, L: _Launch, bias: torch.Tensor | None, P: torch.Tensor, verify_output: bool, *,
                     sms: int, stats: tuple | None, flag: torch.Tensor, ws: torch.Tensor, call_id: int) -> tuple:
    """The persistent form's GEMM (`_persistent_kernel`) as ``(grid, args, kwargs)``: one program per SM of the
    ``sms`` (per tile if fewer, unless ``stats``, `_stats_operand`'s (W16, Winv): then the pass over x too,
    `forms.slack_stats`)."""
    bm, bn, bk, warps, stages = cfg[:5]
    m, k = L.x.shape
    n = L.y.shape[1]
    if stats is None:
        sms = min(_cdiv(m, bm) * _cdiv(n, bn), sms)
    w16, winv = stats if stats is not None else (L.x, P)
    return (sms,), (L.x, L.w, L.y, bias if bias is not None else L.y, P, w16, winv, flag, ws, m, n, k,
                    L.x.stride(0), L.w.stride(0), L.y.stride(0), 1.0 / n, call_id), dict(
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP=GROUP_M, NUM_SMS=sms, HAS_BIAS=bias is not None, W_KN=L.kn,
        VERIFY_OUTPUT=verify_output, DOT_F32=INTERP, STATS=stats is not None,
        STATS_BK=bk if INTERP else SLACK_BLOCK_K, STATS_STAGES=SLACK_STAGES, num_warps=warps, num_stages=stages)


def _stats_call(L: _Launch, w12: torch.Tensor, P: torch.Tensor, flag: torch.Tensor, ws: torch.Tensor, t: int,
                call_id: int) -> tuple:
    """The persistent form's pass over x as a launch of its own (`_stats_kernel`): ``(grid, args, kwargs)``."""
    m, k = L.x.shape
    return (_cdiv(m, STATS_ROWS),), (L.x, w12, P, flag, ws, m, k, t, L.x.stride(0), call_id), dict(
        R=STATS_ROWS, CK=STATS_COLS, num_warps=4)


def _verify_call(L: _Launch, bias: torch.Tensor | None, P: torch.Tensor, flag: torch.Tensor, ws: torch.Tensor,
                 t: int, ts: int, call_id: int, ver: _Verify, verify_output: bool, dot_f32: bool) -> tuple:
    """The second launch of a two-launch call (`_verify_kernel`): ``(grid, args, kwargs)``. ``t``: the tiles'
    row-sum slots in ``P``, ``ts``: the statistics slots that can hold a share (`_verify_rows`)."""
    x2d, y = L.x, L.y
    m, k = x2d.shape
    n = y.shape[1]
    vbn, vbk = VERIFY_BLOCK
    return (_cdiv(m, VERIFY_ROWS),), (
        x2d, L.w, y, bias if bias is not None else y, ver.b12, P, flag, ws,
        m, n, k, t, ts, x2d.stride(0), x2d.stride(1), L.swn, L.swk, y.stride(0), y.stride(1), 1.0 / n, call_id,
        *ver.args(n, k, P),
    ), dict(
        BLOCK_R=VERIFY_ROWS, BLOCK_N=vbn, BLOCK_K=vbk, BLOCK_T=VERIFY_TILES, HAS_BIAS=bias is not None,
        CORRECT=ver.correct, DEBUG=ver.debug is not None, DOT_F32=dot_f32, VERIFY_OUTPUT=verify_output, num_warps=4,
    )
