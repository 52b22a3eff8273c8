"""Decode: the GQA packing of a kv head's query heads into one program's rows, and the split-key
decode's merge of partial states.

Split-key decode: when few (batch, head) programs face a long cache, ``nsplit`` programs share the
key blocks of one query block (`configs._num_splits`); each stores its partial state (m, l, lc,
nvalid, O, Oc1, Oc2, Σ|V| maxima, non-finite flag) in a record of ``REC`` floats. With the checks on,
`_efta_combine` merges them in a second launch (`_merge_splits`) and finishes (steps 6–8); with the
checks off, the last program of a row block merges them in the same launch (`kernel._efta_fwd`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import _NSLOT, _max_nan
from .masks import _key_range
from .output import _finish


@triton.jit
def _program_rows(start_m, M, GROUP, BLOCK_M: tl.constexpr, PACK: tl.constexpr):
    """The query rows of program (start_m, axis 1): (h, hk, qblk, offs_m, row_ok).

    Unpacked: query block start_m of head h = program_id(1) (a scalar), kv head hk = h // GROUP,
    rows offs_m = start_m·BLOCK_M + i (BLOCK_M,), query block qblk = start_m.
    PACK (GQA decode, M = 1): kv head hk = program_id(1), and row i is query head hk·GROUP + g with
    g = start_m·BLOCK_M + i < GROUP; h is then (BLOCK_M, 1) (each row's head, for the q, bias, mask
    and output addresses, which broadcast it against the rows), every row's query position is 0
    (offs_m = 0) and qblk = 0. K and V blocks are loaded once for the group's heads, not once per
    head: the checked decode's per-block work (checksum loads and dots, the tests) would be repeated
    GROUP times over rows holding one query each.
    """
    if PACK:
        hk = tl.program_id(1).to(tl.int64)
        g = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = g < GROUP
        h = (hk * GROUP + tl.where(row_ok, g, 0))[:, None]
        offs_m = tl.zeros((BLOCK_M,), tl.int32)
        qblk = 0
    else:
        h = tl.program_id(1).to(tl.int64)
        hk = h // GROUP
        offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = offs_m < M
        qblk = start_m
    return h, hk, qblk, offs_m, row_ok


@triton.jit
def _merge_splits(base, nsplit, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, REC: tl.constexpr):
    """Split-key decode: the ``nsplit`` partial states of one row block, records of REC floats from
    ``base`` — (m, l, lc, nvalid, O, Oc1, Oc2) rescaled to the common maximum exactly like the loop's α
    (l and its twin lc by the same operations, so they stay equal bit for bit),
    the Σ|V| maxima and the non-finite flags merged. Read through L2 (``.cg``): with the checks off the
    other programs of the same launch wrote them. Returns m, l, lc (BLOCK_M,), nvalid (BLOCK_M,) int32,
    O (BLOCK_M, BLOCK_D), Oc1, Oc2 (BLOCK_M, 16), vmax (16,), nf."""
    rows = tl.arange(0, BLOCK_M)
    r16 = tl.arange(0, 16)
    offs_d = tl.arange(0, BLOCK_D)
    m_i = tl.full((BLOCK_M,), -float("inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    lc = tl.zeros((BLOCK_M,), tl.float32)
    nvalid = tl.zeros((BLOCK_M,), tl.int32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    oc1 = tl.zeros((BLOCK_M, 16), tl.float32)
    oc2 = tl.zeros((BLOCK_M, 16), tl.float32)
    vmax = tl.zeros((16,), tl.float32)
    nf = tl.full([], 0, tl.int32)
    for sp in range(0, nsplit):
        rec = base + sp * REC
        m_s = tl.load(rec + rows, cache_modifier=".cg")
        m_new = _max_nan(m_i, m_s)
        a = tl.where((m_i == -float("inf")) & (m_new == -float("inf")), 1.0, tl.exp(m_i - m_new))
        c = tl.where((m_s == -float("inf")) & (m_new == -float("inf")), 1.0, tl.exp(m_s - m_new))
        l_i = l_i * a + tl.load(rec + BLOCK_M + rows, cache_modifier=".cg") * c
        lc = lc * a + tl.load(rec + 2 * BLOCK_M + rows, cache_modifier=".cg") * c
        nvalid += tl.load(rec + 3 * BLOCK_M + rows, cache_modifier=".cg").to(tl.int32)
        o_s = tl.load(rec + 4 * BLOCK_M + rows[:, None] * BLOCK_D + offs_d[None, :], cache_modifier=".cg")
        acc = acc * a[:, None] + o_s * c[:, None]
        ocp = rec + (4 + BLOCK_D) * BLOCK_M + rows[:, None] * 16 + r16[None, :]
        oc1 = oc1 * a[:, None] + tl.load(ocp, cache_modifier=".cg") * c[:, None]
        oc2 = oc2 * a[:, None] + tl.load(ocp + 16 * BLOCK_M, cache_modifier=".cg") * c[:, None]
        vmax = _max_nan(vmax, tl.load(rec + (36 + BLOCK_D) * BLOCK_M + r16, cache_modifier=".cg"))
        nf = nf | (tl.load(rec + (36 + BLOCK_D) * BLOCK_M + 16, cache_modifier=".cg") != 0).to(tl.int32)
        m_i = m_new
    return m_i, l_i, lc, nvalid, acc, oc1, oc2, vmax, nf


@triton.jit(do_not_specialize=["call_id"])
def _efta_combine(
    Q, K, V, Out, Cnt, Flag, Bias, Mask, Inj, W,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod,
    sbb, sbh, sbm, sbn, smb, smh, smm, smn, cst0, cst1,
    Hq, M, N, D, GROUP, scale, window, call_id, nsplit, gu,
    BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_BIAS: tl.constexpr,
    MASK_KIND: tl.constexpr, DETECT: tl.constexpr, CORRECT: tl.constexpr, INJ_O: tl.constexpr,
    DOT_F32: tl.constexpr, EVEN_D: tl.constexpr, FOLD: tl.constexpr, PACK: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Checked split-key decode, second launch: merge the ``nsplit`` partial states that `_efta_fwd`
    (SPLIT) wrote for one query block (`_merge_splits`), then finish (steps 6–8)."""
    REC: tl.constexpr = (36 + BLOCK_D) * BLOCK_M + 17
    start_m = tl.program_id(0)
    b = tl.program_id(2).to(tl.int64)
    bh = tl.program_id(2) * Hq + tl.program_id(1)
    h, hk, qblk, offs_m, row_ok = _program_rows(start_m, M, GROUP, BLOCK_M, PACK)
    offs_d = tl.arange(0, BLOCK_D)
    io_ok = row_ok[:, None]
    if not EVEN_D:
        io_ok = io_ok & (offs_d < D)[None, :]
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd, mask=io_ok, other=0.0)
    Kb = K + b * skb + hk * skh
    Vb = V + b * svb + hk * svh
    nblocks = tl.cdiv(N, BLOCK_N)
    lo, hi = _key_range(qblk, M, N, window, BLOCK_M, BLOCK_N, CAUSAL, HAS_WINDOW)
    base = W + ((b * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(0) + start_m) * nsplit * REC
    m_i, l_i, lc, nvalid, acc, oc1, oc2, vmax, nf = _merge_splits(base, nsplit, BLOCK_M, BLOCK_D, REC)
    _finish(acc, l_i, lc, m_i, nvalid, oc1, oc2, 1, vmax, nf, tl.zeros((_NSLOT,), tl.int32), q, Kb, Vb, skn, skd, svn,
            svd, b, h, bh, offs_m, offs_d, row_ok, io_ok, M, N, D, scale, window, lo, hi, nblocks, nsplit, gu,
            Bias, sbb, sbh, sbm, sbn, Mask, smb, smh, smm, smn, Inj, Out, sob, soh, som, sod,
            Cnt, cst0, cst1, Flag, call_id, BLOCK_N, BLOCK_D, CAUSAL, HAS_WINDOW, HAS_BIAS, MASK_KIND,
            DETECT, CORRECT, INJ_O, DOT_F32, EVEN_D, FOLD)
