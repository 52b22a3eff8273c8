"""Device-side pieces every step of the EFTA kernel uses: the event slots of a program's counters, the
NaN-propagating maximum, and the fault injection of a site's values.

Counters: a program keeps its events in a (32,) int32 vector, slot = site row · 5 + kind column of the
contract's (6, 5) counter block (`ft_transformers.kernels.contract`): ``_SCORES + _DET`` is
``attn.scores``/``detected``. `_finish` adds the vector into the caller's block with one atomic each.

Injection table (built on the host, ``host._injection_table``): a header of ``_HDR`` int32 per
attention site (mode, bit, seed, ber bits, csr offset, positions offset), then per bit-mode site a CSR
over ``b·Hq + h`` and the (row, column) pairs of its flips.
"""

from __future__ import annotations

import triton
import triton.language as tl

# counter slot of an event inside the kernel = site row · 5 + kind column (contract.SITES, contract.KINDS)
_SCORES, _ROWMAX, _PROBS, _ROWSUM, _OUTPUT = (tl.constexpr(5 * i) for i in range(5))
_DET, _COR, _REC, _UNC, _NONF = (tl.constexpr(i) for i in range(5))
_HDR = 6  # ints per site in the injection table header
_HDR_K = tl.constexpr(_HDR)


@triton.jit
def _max_nan(a, b):
    """max that propagates NaN (like torch.amax / torch.maximum)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _nanmax(x, AXIS: tl.constexpr, INTERP: tl.constexpr):
    """NaN-propagating max along AXIS (like torch.amax). The interpreter runs custom reductions element
    by element in Python, so there it is tl.max (NaN-ignoring) plus an explicit NaN test."""
    if INTERP:
        mx = tl.max(x, axis=AXIS)
        mx = tl.where(tl.max((x != x).to(tl.int32), axis=AXIS) > 0, float("nan"), mx)
    else:
        mx = tl.reduce(x, AXIS, _max_nan)
    return mx


@triton.jit
def _bump(cnt, SLOT: tl.constexpr, val):
    """cnt[SLOT] += val (cnt: the program's (32,) int32 event counts, slot = site·5 + kind)."""
    return cnt + tl.where(tl.arange(0, 32) == SLOT, val, 0)


@triton.jit
def _inject(x, Inj, SITE: tl.constexpr, MODE: tl.constexpr, bh, rr, cc, nrows, ncols):
    """Flip bits of the fp32 values x at the site's logical coordinates (bh, rr, cc) of (B·Hq, nrows,
    ncols); rr and cc broadcast to x's shape (a tile: rows[:, None], cols[None, :]; a per-row vector:
    rows, and the block index as a scalar)."""
    hdr = Inj + SITE * _HDR_K
    xi = x.to(tl.int32, bitcast=True)
    if MODE == 1:  # positions, sorted by bh (CSR)
        bit = tl.load(hdr + 1)
        csr = tl.load(hdr + 4)
        pos = tl.load(hdr + 5)
        p0 = tl.load(Inj + csr + bh)
        p1 = tl.load(Inj + csr + bh + 1)
        for p in range(p0, p1):
            pi = tl.load(Inj + pos + 2 * p)
            pj = tl.load(Inj + pos + 2 * p + 1)
            xi = xi ^ tl.where((rr == pi) & (cc == pj), 1 << bit, 0)
    else:  # BER: each element flips with probability ber, one random bit (Philox)
        seed = tl.load(hdr + 2)
        ber = tl.load(hdr + 3).to(tl.float32, bitcast=True)
        lin = (bh * nrows + rr) * ncols + cc
        r0, r1, _, _ = tl.randint4x(seed, lin)
        hit = (tl.uint_to_uniform_float(r0) < ber) & (rr < nrows) & (cc < ncols)
        xi = xi ^ tl.where(hit, 1 << (r1 % 32).to(tl.int32), 0)
    return xi.to(tl.float32, bitcast=True)
