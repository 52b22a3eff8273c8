"""Device-side pieces every step of the EFTA kernel uses: the event slots of a program's counters, the
NaN-propagating maximum, and the fault injection of a site's values.

Counters: a program keeps its events in a (`_NSLOT`,) int32 vector, slot = site row · 5 + kind column of
the contract's (sites, kinds) counter block (`ft_transformers.kernels.contract`): ``_SCORES + _DET`` is
``attn.scores``/``detected``. `_finish` adds the vector into the caller's block with one atomic each.

Injection table (built on the host, ``injection._injection_table``): a header of ``_HDR`` int32 per
attention site (in the contract's ``ATTENTION_SITES`` order: mode, bit, seed, ber bits, csr offset,
positions offset), then per bit-mode site a CSR over ``b·Hq + h`` and the (row, column) pairs of its
flips. ``_I_<SITE>`` is a site's place in that order.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..contract import ATTENTION_SITES, KIND_INDEX, KINDS, SITE_INDEX, SITES


def _slot(site: str) -> tl.constexpr:
    return tl.constexpr(len(KINDS) * SITE_INDEX[site])


# counter slot of an event inside the kernel = site row · 5 + kind column (contract.SITES, contract.KINDS)
_SCORES, _ROWMAX, _PROBS, _ALPHA, _ROWSUM, _OUTPUT = (_slot(s) for s in (
    "attn.scores", "attn.rowmax", "attn.probs", "attn.alpha", "attn.rowsum", "attn.output"))
_DET, _COR, _REC, _UNC, _NONF = (tl.constexpr(KIND_INDEX[k]) for k in
                                 ("detected", "corrected", "recomputed", "uncorrectable", "nonfinite_input"))
_NSLOT = tl.constexpr(1 << (len(SITES) * len(KINDS) - 1).bit_length())  # slots per program, a power of two
_NKIND = tl.constexpr(len(KINDS))
# a site's place in the injection table
(_I_SCORES, _I_MSCORES, _I_ROWMAX, _I_EXPONENT, _I_PROBS, _I_PROBS_LP, _I_ALPHA, _I_ROWSUM, _I_ACC, _I_MCARRY,
 _I_OUTPUT, _I_CHECKSUM) = (tl.constexpr(ATTENTION_SITES.index(s)) for s in (
    "attn.scores", "attn.masked_scores", "attn.rowmax", "attn.exponent", "attn.probs", "attn.probs_lp",
    "attn.alpha", "attn.rowsum", "attn.acc", "attn.rowmax_carry", "attn.output", "attn.checksum"))
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
def _round_to(x, DT: tl.constexpr, INTERP: tl.constexpr):
    """fp32 x rounded to nearest (ties to even) in DT, as the GPU's conversion does. Triton 3.6's
    interpreter truncates fp32 → bf16 whatever the rounding mode asked: there the rounding is done on the
    bits first (add half an ulp of bf16, minus one unless the kept LSB is odd; inf and NaN stay), so that
    the interpreted kernel reads the same P as the reference."""
    if INTERP and DT == tl.bfloat16:
        xi = x.to(tl.int32, bitcast=True)
        xi = (xi + (0x7FFF + ((xi >> 16) & 1))) & -65536
        x = xi.to(tl.float32, bitcast=True)
    return x.to(DT)


@triton.jit
def _bump(cnt, SLOT: tl.constexpr, val):
    """cnt[SLOT] += val (cnt: the program's (_NSLOT,) int32 event counts, slot = site·5 + kind)."""
    return cnt + tl.where(tl.arange(0, _NSLOT) == SLOT, val, 0)


@triton.jit
def _add_events(Cnt, cst0, cst1, cnt):
    """Add a program's event slots ``cnt`` (_NSLOT,) into the caller's counter block (strides cst0, cst1)."""
    slots = tl.arange(0, _NSLOT)
    tl.atomic_add(Cnt + (slots // _NKIND) * cst0 + (slots % _NKIND) * cst1, cnt, mask=cnt != 0)


@triton.jit
def _inject(x, Inj, SITE: tl.constexpr, MODE: tl.constexpr, bh, rr, cc, nrows, ncols):
    """Flip bits of the values x (fp32, or a 16-bit float: ``attn.probs_lp`` in the input dtype) at the
    site's logical coordinates (bh, rr, cc) of (B·Hq, nrows, ncols); rr and cc broadcast to x's shape (a
    tile: rows[:, None], cols[None, :]; a per-row vector: rows, and the block index as a scalar).
    Coordinates at or past ``ncols`` never flip (callers map padding there)."""
    hdr = Inj + SITE * _HDR_K
    NB: tl.constexpr = x.dtype.primitive_bitwidth
    if NB == 32:
        xi = x.to(tl.int32, bitcast=True)
    else:  # 16 bits, widened (the xor only touches the low 16)
        xi = x.to(tl.int16, bitcast=True).to(tl.int32)
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
        xi = xi ^ tl.where(hit, 1 << (r1 % NB).to(tl.int32), 0)
    if NB == 32:
        y = xi.to(tl.float32, bitcast=True)
    else:
        y = xi.to(tl.int16).to(x.dtype, bitcast=True)
    return y


@triton.jit
def _locate(d1, d2s, bad, grouped):
    """The member of each failing group (steps 1 and 7), as the reference's `checksums.locate`: the group's
    only non-finite member if it has exactly one (a fault that made a value ±inf or NaN leaves D2/D1
    undefined), else ``round(D2/D1) − 1`` within a quarter of an integer in [0, L). d1, bad (R, 16);
    d2s (R, 16) = D2/L, the weighted difference with weights (l+1)/L ≤ 1 (`checksums.scaled_d2`: (l+1)·x
    overflows when a fault made one member huge); grouped (R, L, 16) the members, L a power of two.
    Returns (loc (R, 16) int32, ok (R, 16) bool)."""
    L: tl.constexpr = grouped.shape[1]
    t = d2s / d1 * L
    tr = tl.floor(t + 0.5)
    ok = bad & (tl.abs(t - tr) <= 0.25) & (tr >= 1.0) & (tr <= L)
    loc = tl.where(ok, tr - 1.0, 0.0).to(tl.int32)
    nonfinite = ~(tl.abs(grouped) <= 3.4028234663852886e38)  # NaN included
    single = bad & (tl.sum(nonfinite.to(tl.int32), axis=1) == 1)
    at = tl.sum(tl.where(nonfinite, tl.arange(0, L)[None, :, None], 0), axis=1)
    return tl.where(single, at, loc), ok | single


@triton.jit
def _mul(a, b):
    return a * b


@triton.jit
def _group_sums(t, NB: tl.constexpr):
    """Σ_l t[i, l·16+r] per group: (BLOCK_M, 16), or with NB checksum blocks (BLOCK_M, NB, 16)."""
    if NB == 1:
        g = tl.sum(tl.reshape(t, (t.shape[0], t.shape[1] // 16, 16)), axis=1)
    else:
        g = tl.sum(tl.reshape(t, (t.shape[0], NB, t.shape[1] // (16 * NB), 16)), axis=2)
    return g


@triton.jit
def _group_products(t, NB: tl.constexpr):
    """Π_l t[i, l·16+r] per group, shaped as `_group_sums`."""
    if NB == 1:
        g = tl.reduce(tl.reshape(t, (t.shape[0], t.shape[1] // 16, 16)), 1, _mul)
    else:
        g = tl.reduce(tl.reshape(t, (t.shape[0], NB, t.shape[1] // (16 * NB), 16)), 2, _mul)
    return g


@triton.jit
def _per_group(x, NB: tl.constexpr):
    """A per-row (BLOCK_M,) value broadcast against `_group_sums`' shape."""
    if NB == 1:
        y = x[:, None]
    else:
        y = x[:, None, None]
    return y
