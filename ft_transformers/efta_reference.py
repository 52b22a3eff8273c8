"""PyTorch reference implementation of EFTA (fault-tolerant flash attention).

This is the CPU runtime of the library and the oracle of the Triton kernel. It is blocked the
way the kernel is: a Python loop over key blocks of ``block_n`` keys, every query row (all
batches, heads and query blocks) processed at once with torch ops, the online softmax, and the
checks of ``docs/algorithms.md`` steps 1–8 with their counters and injection sites.

Shapes: q (B, Hq, M, D), k/v (B, Hkv, N, D), Hq a multiple of Hkv; query head h uses kv head
``h // (Hq // Hkv)`` (GQA/MQA without repeating k/v: q is viewed as (B, Hkv, G·M, D)).

Deviations from the letter of ``docs/algorithms.md`` (sound variants of the same checks; on
clean inputs none of them changes a check's verdict):

* Steps 1 and 7, correction: a located element is rebuilt as ``checksum − Σ(other members of its
  group)`` instead of ``value += D1``. Both are equal in exact arithmetic, but when the fault made
  the value huge (exponent flips reach 3e38) ``D1`` has absorbed the other members and
  ``value + D1`` cancels catastrophically: the "corrected" value comes out as ~0, not the true one.
* Steps 1 and 7, location: a key in the block padding (≥ N) or a column in the zero padding of D
  counts as "out of range" (the row is recomputed).
* Step 3: ``τ_m = min(2^-20·(1 + |m_new|), 1)``, and the 0 base of ``x`` is used only where
  ``m_new``, ``m`` and the block max are all −inf. Uncapped, τ_m is +inf whenever ``m_new`` is
  ±inf (a bit-30 flip turns ±1.0 into ±inf), which disables both comparisons: a max corrupted to
  −inf passed, ``x = S − 0`` was used, and the next block's α = exp(−inf − m) = 0 silently erased
  everything before it (a wrong output with no event). With the cap alone, base 0 for any
  ``m_new = −inf`` would still let that through when the block max lies in [−1, 1]; with base
  ``m_new`` there, ``x = +inf`` trips the check. In clean runs the max is exact (max x = 0, or
  −inf for a fully masked block), so neither change can cause a false positive; the cap also keeps
  an undetected shift of m from overflowing exp when |m| is huge.
* Step 4: ``P = exp(x)`` is flushed to 0 where ``x < −87`` (results < 1.7e-38, which the check
  treats as exp(−87) anyway). CPU exp takes slow paths on −inf, 0 and subnormals.
* Non-finite inputs: −inf in q, k or v also counts as ``nonfinite_input`` (it is as bad as +inf
  there); in ``bias`` and an additive ``attn_mask`` −inf is a mask value, so only NaN and +inf count.
* Step 7 skips the rows flagged by step 6 (they are recomputed from scratch anyway), so one fault
  is not counted twice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import pasa as _pasa
from .counters import add_count
from .kernels.contract import EXP_MAX_GROUP, EXP_ULPS, EXP_XMIN, LOG2E, P_MIN
from .injection import FaultPlan, SiteFaults

__all__ = ["efta_reference", "broadcast_to_scores", "PASA_PRECISIONS"]

U = 2.0**-24  # fp32 unit roundoff
U16 = 2.0**-11  # fp16 unit roundoff
_FP16_ETA = 2.0**-25  # fp16 absolute rounding error bound in the subnormal range
PASA_PRECISIONS = ("fp32", "fp16")
_NEG_INF = float("-inf")
_RECOMPUTE_CHUNK = 1 << 24  # elements of gathered K/V per chunk of the row recompute
_FTZ_XMIN = -87.0  # exp(x) below it is subnormal: flushed to 0 (`_exp_ftz`)


def _additive(keep: torch.Tensor) -> torch.Tensor:
    """A bool mask (True = attend) as the additive 0 / −inf it stands for (fp32, same shape). Added,
    not filled in, as SDPA applies it and as the kernel must (Triton's select on a loaded mask hits a
    compiler bug): a NaN or +inf score at a masked position stays NaN."""
    return torch.zeros(keep.shape, dtype=torch.float32, device=keep.device).masked_fill_(~keep, _NEG_INF)


def _g(k: float) -> float:
    """The γ_k rounding bound 1.01·k·u."""
    return 1.01 * k * U


def broadcast_to_scores(t: torch.Tensor | None, shape: tuple[int, int, int, int], name: str
                        ) -> torch.Tensor | None:
    """``t`` as a 4-D view broadcastable to ``shape`` = (B, Hq, M, N); raises ValueError if it is not."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    if t.dim() > 4:
        raise ValueError(f"{name} must have at most 4 dims (broadcastable to (B, Hq, M, N) = {shape}), "
                         f"got shape {tuple(t.shape)}")
    t4 = t.reshape((1,) * (4 - t.dim()) + tuple(t.shape))
    for have, want in zip(t4.shape, shape, strict=True):
        if have != 1 and have != want:
            raise ValueError(f"{name} of shape {tuple(t.shape)} is not broadcastable to "
                             f"(B, Hq, M, N) = {shape}")
    return t4


def _expand_keys(t4: torch.Tensor | None, n: int) -> torch.Tensor | None:
    """A (…, 1) key dim broadcast to n (a view), so that key blocks can be sliced out of it."""
    if t4 is None or t4.shape[-1] == n:
        return t4
    return t4.expand(*t4.shape[:-1], n)


def _to5d(t4: torch.Tensor | None, hkv: int, groups: int) -> torch.Tensor | None:
    """(b, h, m, n) broadcastable to (B, Hq, M, N) → (b, Hkv|1, G|1, m, n) broadcastable to the 5-D scores."""
    if t4 is None:
        return None
    b, h, m, n = t4.shape
    if h == 1:
        return t4.unsqueeze(2)
    return t4.reshape(b, hkv, groups, m, n)


class _Ctx:
    """Everything the row recompute needs (fp32, unpadded)."""

    def __init__(self, qs5, k32, v32, bias5, amask5, bmask5, causal, window, n_keys):
        self.qs5 = qs5  # (B, Hkv, G, M, D), scale folded in
        self.k32 = k32  # (B, Hkv, N, D)
        self.v32 = v32
        self.bias5 = bias5  # additive, 5-D broadcastable, or None
        self.amask5 = amask5  # additive mask
        self.bmask5 = bmask5  # bool mask (True = attend)
        self.causal = causal
        self.window = window
        self.n = n_keys

    def shape5(self) -> tuple[int, ...]:
        B, Hkv, G, M, _ = self.qs5.shape
        return (B, Hkv, G, M, self.n)

    def positional(self, mi: torch.Tensor, cols: torch.Tensor) -> torch.Tensor | None:
        """Causal/window visibility of keys ``cols`` (C,) for query rows ``mi`` (R,) → (R, C) or None."""
        if not self.causal and self.window is None:
            return None
        M = self.qs5.shape[3]
        pos = (mi + (self.n - M)).unsqueeze(1)
        ok = torch.ones(mi.shape[0], cols.shape[0], dtype=torch.bool, device=mi.device)
        if self.causal:
            ok &= cols.unsqueeze(0) <= pos
        if self.window is not None:
            ok &= cols.unsqueeze(0) > pos - self.window
        return ok

    def rows_scores(self, idx: torch.Tensor, k_rows: torch.Tensor) -> torch.Tensor:
        """Raw scores (scale·q)·kᵀ of rows idx (R, 4) = (b, hkv, g, m) against k_rows (R, C, D)."""
        q = self.qs5[idx[:, 0], idx[:, 1], idx[:, 2], idx[:, 3]]
        return torch.bmm(k_rows, q.unsqueeze(2)).squeeze(2)

    def attend_rows(self, idx: torch.Tensor) -> torch.Tensor:
        """Plain fp32 materialised attention of rows idx (R, 4) → (R, D); fully masked rows give 0."""
        R = idx.shape[0]
        D = self.qs5.shape[-1]
        out = torch.empty(R, D, dtype=torch.float32, device=self.qs5.device)
        chunk = max(1, _RECOMPUTE_CHUNK // max(1, self.n * D))
        full = self.shape5()
        cols = torch.arange(self.n, device=self.qs5.device)
        for c0 in range(0, R, chunk):
            ix = idx[c0:c0 + chunk]
            b, h, g, m = ix.unbind(1)
            kk = self.k32[b, h]
            s = self.rows_scores(ix, kk)
            if self.bias5 is not None:
                s = s + self.bias5.expand(full)[b, h, g, m].float()
            if self.amask5 is not None:
                s = s + self.amask5.expand(full)[b, h, g, m].float()
            if self.bmask5 is not None:
                s = s + _additive(self.bmask5.expand(full)[b, h, g, m])
            pos = self.positional(m, cols)
            if pos is not None:
                s = s.masked_fill(~pos, _NEG_INF)
            mx = s.amax(dim=1, keepdim=True)
            mx = torch.where(mx == _NEG_INF, torch.zeros_like(mx), mx)
            p = torch.exp(s - mx)
            l = p.sum(dim=1, keepdim=True)
            o = torch.bmm(p.unsqueeze(1), self.v32[b, h]).squeeze(1)
            out[c0:c0 + chunk] = torch.where(l > 0, o / torch.where(l > 0, l, torch.ones_like(l)),
                                             torch.zeros_like(o))
        return out


def _apply(sf: SiteFaults | None, x: torch.Tensor, site_shape4: tuple[int, ...], start: int) -> torch.Tensor:
    """Inject into ``x`` (any view of a (B, Hq, M, w) slice of the site), same shape back."""
    if sf is None:
        return x
    return sf.apply(x.reshape(site_shape4), dim=-1, start=start).reshape(x.shape)


def _count(counters: torch.Tensor | None, site: str, kind: str, value) -> None:
    if counters is not None:
        add_count(counters, site, kind, value)


def _group_sums(x: torch.Tensor, ngroups: int, stride: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ_l x[..., l·s+r] and Σ_l (l+1)·x[..., l·s+r] over the last dim → two (..., s) tensors.

    The weighted sum is accumulated as the sum of the suffix sums (Σ_k Σ_{l≥k} x_l = Σ_l (l+1)·x_l),
    which costs 2(L−1) slice additions instead of a weighted copy and two reductions.
    """
    xg = x.unflatten(-1, (ngroups, stride))
    suf = xg[..., ngroups - 1, :]
    wsum = suf
    for i in range(ngroups - 2, -1, -1):
        suf = suf + xg[..., i, :]
        wsum = wsum + suf
    return suf, wsum


def _g16(k: float) -> float:
    """The γ_k rounding bound 1.01·k·u for fp16 (u = 2^-11)."""
    return 1.01 * k * U16


def _round16(x: torch.Tensor) -> torch.Tensor:
    """x rounded to fp16 and held in fp32 (the fp16 softmax state of PASA)."""
    return x.to(torch.float16).to(torch.float32)


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _exp_ftz(x: torch.Tensor) -> torch.Tensor:
    """exp(x), flushed to 0 where x < −87 (subnormal results; exp there is < 1.7e-38), as the GPU's
    ``ex2.approx.ftz`` does from −87.3 on.

    CPU exp takes a slow path for underflowing and −inf arguments (about 10× slower), and masked
    keys are −inf. The flush is within the step-4 contract (P below P_min counts as P_min).
    """
    p = torch.exp(x.clamp(min=_FTZ_XMIN))
    return p.masked_fill_(x < _FTZ_XMIN, 0.0)


def _exp_group_test(x: torch.Tensor, P: torch.Tensor, s: int) -> torch.Tensor:
    """Step 4: the product identity Π_l P[i, l·s+r] = exp(Σ_l x[i, l·s+r]) per group (row i, residue r),
    checked in log2 on the fp32 product of the group.

    Below x_min = −20 (masked keys included) x counts as x_min and P as P_min = exp(x_min) unless it is
    larger (a NaN-propagating max: a NaN P stays NaN, a negative one becomes P_min), so a product of
    up to 4 clamped values cannot underflow; larger groups (L > 4, other block/stride choices than
    the kernel's) are multiplied in chunks of 4 and the chunks' log2 summed. x, P: (..., L·s) fp32.
    Returns (..., s) bool: |log2 Π P − log2(e)·Σ x| > 64·u·log2(e)·(3L + |Σ x|).
    """
    L = x.shape[-1] // s
    xs = torch.fmax(x, x.new_tensor(EXP_XMIN)).view(*x.shape[:-1], L, s).sum(-2)
    pc = torch.maximum(P, P.new_tensor(P_MIN)).view(*x.shape[:-1], L, s)  # torch.maximum propagates NaN
    lp = sum(torch.log2(pc[..., c:c + EXP_MAX_GROUP, :].prod(-2)) for c in range(0, L, EXP_MAX_GROUP))
    d = lp - xs * LOG2E
    return ~(d.abs() <= (xs.abs() + 3.0 * L) * (EXP_ULPS * U * LOG2E))


def _locate(d1: torch.Tensor, d2: torch.Tensor, bad: torch.Tensor, ngroups: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Group index l (0-based) from t = D2/D1 ≈ l+1, and where that location is valid."""
    t = d2 / d1
    tr = torch.round(t)
    ok = bad & torch.isfinite(t) & ((t - tr).abs() <= 0.25) & (tr >= 1) & (tr <= ngroups)
    loc = torch.where(ok, tr - 1, torch.zeros_like(tr)).to(torch.long)
    return loc, ok


def _rebuild(grp: torch.Tensor, idx: torch.Tensor, loc: torch.Tensor, csum: torch.Tensor) -> torch.Tensor:
    """New values of located elements: checksum minus the sum of the other members of their group.

    grp: (..., Lg, s) grouped values (member l of residue r at [..., l, r]); idx (K, nd) indices
    of (..., r) of the located groups; loc (K,) member index; csum (K,) the checksums.
    """
    r = idx[:, -1]
    members = grp[tuple(idx[:, :-1].t())]  # (K, Lg, s)
    members = members.gather(2, r.view(-1, 1, 1).expand(-1, members.shape[1], 1)).squeeze(2)  # (K, Lg)
    keep = torch.arange(members.shape[1], device=members.device).unsqueeze(0) != loc.unsqueeze(1)
    others = torch.where(keep, members, torch.zeros_like(members)).sum(dim=1)
    return csum - others


@torch.no_grad()
def efta_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    causal: bool,
    bias: torch.Tensor | None,
    attn_mask: torch.Tensor | None,
    window: int | None,
    detect: bool,
    correct: bool,
    plan: FaultPlan | None,
    counters: torch.Tensor | None,
    block_n: int = 64,
    stride: int = 16,
    pasa: bool = False,
    pasa_beta: float | None = None,
    pasa_precision: str = "fp32",
    pasa_mean: str = "keys",
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Fault-tolerant attention, blocked like the Triton kernel (inputs are assumed validated).

    Args:
        q: (B, Hq, M, D) fp16/bf16/fp32.
        k, v: (B, Hkv, N, D), same dtype; Hq a multiple of Hkv.
        scale: softmax scale, folded into q.
        causal: bottom-right aligned causal mask (query i sees keys j ≤ i + N − M).
        bias: additive float, broadcastable to (B, Hq, M, N), or None.
        attn_mask: bool (True = attend) or additive float, broadcastable to (B, Hq, M, N), or None.
        window: sliding window (key j visible iff j > i + N − M − window), or None.
        detect: run the checks; False = unprotected baseline (injection still happens).
        correct: repair what is detected; False = count ``detected`` + ``uncorrectable`` only.
        plan: fault injection plan (attention sites), or None.
        counters: int32 (sites, kinds) block to add the events into, or None.
        block_n: keys per block (multiple of ``stride``).
        stride: checksum stride s over keys and over the head dim.
        pasa: PASA mode (seed 002, ``docs/pasa.md``): every key block is shifted by β times its
            mean (`pasa.shift_keys`, scale folded in), the score GEMM is FP16 with FP16
            accumulation (`pasa.fp16_matmul`), and the global pseudo-average with the Δm'
            corrections keeps the blocks in one frame. The checks run on the shifted keys.
            fp16/bf16 inputs (bf16 q and k are rounded to fp16, as the seed prescribes); float32
            inputs raise NotImplementedError.
        pasa_beta: shift factor β in (0, 1); None = `pasa.optimal_beta(block_n, float16)`.
        pasa_precision: ``"fp32"``: the online-softmax state (m, l, O) in fp32 (default);
            ``"fp16"``: every step rounded to fp16 as well, P·V an FP16 GEMM (the seed's full
            low-precision allocation; unchecked only: needs ``detect=False``).
        pasa_mean: how the block pseudo-average ``rowmean(S'_j)`` is formed: ``"keys"`` (default),
            ``q·mean(K'_j)`` in fp32 (`pasa.block_pseudo_average`); ``"scores"``, the mean of the
            fp16 scores themselves (the seed's Algorithm 1 line 13 to the letter; γ = β/(1−β)
            amplifies their rounding error, see ``docs/pasa.md``).
        out_dtype: dtype of the result; None = q's dtype.

    Returns:
        (B, Hq, M, D) in ``out_dtype``. Runs under ``torch.no_grad()``: EFTA is inference-only.
    """
    if block_n % stride != 0 or block_n <= 0 or stride <= 0:
        raise ValueError(f"block_n ({block_n}) must be a positive multiple of stride ({stride})")
    correct = bool(correct and detect)
    B, Hq, M, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    G = Hq // Hkv
    GM = G * M
    dev = q.device
    if out_dtype is None:
        out_dtype = q.dtype
    f16 = torch.float16
    if pasa:
        if q.dtype == torch.float32:
            raise NotImplementedError(
                "PASA runs the score GEMM in FP16 and is implemented for float16/bfloat16 inputs; "
                "float32 inputs have no FP16 overflow to avoid: use pasa=False")
        if pasa_precision not in PASA_PRECISIONS:
            raise ValueError(f"pasa_precision must be one of {PASA_PRECISIONS}, got {pasa_precision!r}")
        if pasa_mean not in ("keys", "scores"):
            raise ValueError(f"pasa_mean must be 'keys' or 'scores', got {pasa_mean!r}")
        if pasa_precision == "fp16" and detect:
            raise ValueError("pasa_precision='fp16' (fp16 softmax state) has no fp16-level check "
                             "thresholds yet: run it with detect=False, or use pasa_precision='fp32'")
        beta = _pasa.optimal_beta(block_n, f16) if pasa_beta is None else pasa_beta
        gamma = _pasa.recovery_factor(block_n, beta)  # = β/(1−β) at the optimal β
        gamma_last = _pasa.recovery_factor(N - (N - 1) // block_n * block_n, beta) if N else gamma
        q = q.to(f16)  # bf16 → fp16 (seed 002, §2.2); values beyond ±65504 become inf
        k = k.to(f16)
    elif pasa_precision not in PASA_PRECISIONS:
        raise ValueError(f"pasa_precision must be one of {PASA_PRECISIONS}, got {pasa_precision!r}")
    half_state = pasa and pasa_precision == "fp16"
    if B == 0 or Hq == 0 or M == 0 or D == 0 or N == 0:  # N == 0: every row fully masked
        return torch.zeros(B, Hq, M, D, dtype=out_dtype, device=dev)
    full4 = (B, Hq, M, N)
    bias4 = _expand_keys(broadcast_to_scores(bias, full4, "bias"), N)
    mask4 = _expand_keys(broadcast_to_scores(attn_mask, full4, "attn_mask"), N)
    bmask4 = amask4 = None
    if mask4 is not None:
        if mask4.dtype == torch.bool:
            bmask4 = mask4
        else:
            amask4 = mask4

    if detect:
        finite = all(bool(torch.isfinite(t).all()) for t in (q, k, v))
        for t in (bias4, amask4):
            if t is not None and finite:
                finite = not bool((torch.isnan(t) | torch.isposinf(t)).any())
        if not finite:
            _count(counters, "attn.scores", "nonfinite_input", 1)
            detect = correct = False

    if plan:
        sf_scores = plan.for_site("attn.scores", full4, torch.float32, dev)
        nblocks_site = -(-N // block_n)
        sf_rowmax = plan.for_site("attn.rowmax", (B, Hq, M, nblocks_site), torch.float32, dev)
        sf_probs = plan.for_site("attn.probs", full4, torch.float32, dev)
        sf_rowsum = plan.for_site("attn.rowsum", (B, Hq, M, nblocks_site), torch.float32, dev)
        sf_output = plan.for_site("attn.output", (B, Hq, M, D), torch.float32, dev)
    else:
        sf_scores = sf_rowmax = sf_probs = sf_rowsum = sf_output = None

    s = stride
    L = block_n // s
    nb = -(-N // block_n)
    Np = nb * block_n
    Dp = -(-D // s) * s
    Lv = Dp // s
    f32 = torch.float32

    qs5 = (q.to(f32) * float(scale)).contiguous().view(B, Hkv, G, M, D)
    qs = qs5.view(B, Hkv, GM, D)
    k32 = k.to(f32).contiguous()
    v32 = v.to(f32).contiguous()
    kp = F.pad(k32, (0, 0, 0, Np - N)) if Np != N else k32
    vp = F.pad(v32, (0, 0, 0, Np - N)) if Np != N else v32
    if pasa:
        # Scores are q·K'ᵀ with the unscaled fp16 q and the shifted, scaled fp16 keys K'; the
        # checks see exactly those operands (q16 is exact in fp32, so is K').
        q16 = q.contiguous().view(B, Hkv, GM, D)
        kp16 = _pasa.shift_keys(k, float(beta), float(scale), block_n)
        if Np != N:
            kp16 = F.pad(kp16, (0, 0, 0, Np - N))  # padding keys score 0 (masked anyway)
        qs = q16.to(f32)
        kp = kp16.to(f32)
        vp16 = vp.to(f16) if half_state else None
        sbar_all = _pasa.block_pseudo_average(qs, kp16[:, :, :N], block_n) if pasa_mean == "keys" else None
        f_avg = None
        rnd = _round16 if half_state else _identity
    bias5 = _to5d(bias4, Hkv, G)
    amask5 = _to5d(amask4, Hkv, G)
    bmask5 = _to5d(bmask4, Hkv, G)
    ctx = _Ctx(qs5, k32, v32, bias5, amask5, bmask5, causal, window, N)

    wk = torch.arange(1, L + 1, dtype=f32, device=dev)
    wv = torch.arange(1, Lv + 1, dtype=f32, device=dev)
    if detect:
        k6 = kp.view(B, Hkv, nb, L, s, D)
        kc = torch.cat([k6.sum(3), (k6 * wk.view(L, 1, 1)).sum(3)], dim=3)  # (B, Hkv, nb, 2s, D)
        kabs = k6.abs().sum(3).amax(-1)  # (B, Hkv, nb, s): max_d Σ_l |K[l·s+r, d]|
        if pasa:
            # fp16 accumulation: one fp16 rounding per k-chunk on top of the fp32 checksum side,
            # plus the fp16 subnormal floor (docs/pasa.md, "checks").
            nchunk = -(-D // _pasa.FP16_CHUNK)
            qn1 = qs.abs().sum(-1, keepdim=True).mul_(_g16(nchunk) + 2.0 * _g(D + L))
            s_floor = L * nchunk * _FP16_ETA
        else:
            qn1 = qs.abs().sum(-1, keepdim=True).mul_(2.0 * _g(D + L))  # 2·g(D+L)·‖scale·Q_i‖₁ (B, Hkv, GM, 1)
        vpd = F.pad(vp, (0, Dp - D)) if Dp != D else vp
        v5 = vpd.view(B, Hkv, Np, Lv, s)
        vc1 = v5.sum(3)
        vc2 = (v5 * wv.view(Lv, 1)).sum(3)
        vaug = torch.cat([vp, vc1, vc2, torch.ones(B, Hkv, Np, 1, dtype=f32, device=dev)], dim=-1)
        vmax = v5[:, :, :N].abs().sum(3).amax(2).unsqueeze(2)  # (B, Hkv, 1, s)
    else:
        vaug = vp
    DA = vaug.shape[-1]

    m = torch.full((B, Hkv, GM, 1), _NEG_INF, dtype=f32, device=dev)
    l = torch.zeros(B, Hkv, GM, 1, dtype=f32, device=dev)
    acc = torch.zeros(B, Hkv, GM, DA, dtype=f32, device=dev)
    nvalid = torch.zeros(B, Hkv, GM, 1, dtype=torch.int32, device=dev)
    positional = causal or window is not None
    mrow = torch.arange(M, device=dev)

    for j in range(nb):
        j0 = j * block_n
        w = min(N, j0 + block_n) - j0
        kb = kp[:, :, j0:j0 + block_n]
        # 1. GEMM I (scale folded into Q) + tensor checksums.
        if pasa:  # FP16 GEMM, FP16 accumulation, on the shifted keys (scale folded into K')
            kb16 = kp16[:, :, j0:j0 + block_n]
            S = _pasa.fp16_matmul(q16, kb16.transpose(-1, -2)).to(f32)
        else:
            S = torch.matmul(qs, kb.transpose(-1, -2))  # (B, Hkv, GM, BN)
        S = _apply(sf_scores, S, (B, Hq, M, block_n), j0)
        if detect:
            sc = torch.matmul(qs, kc[:, :, j].transpose(-1, -2))  # (B, Hkv, GM, 2s)
            g1, g2 = _group_sums(S, L, s)
            d1 = sc[..., :s] - g1
            d2 = sc[..., s:] - g2
            thr = (qn1 * kabs[:, :, j].unsqueeze(2)).nan_to_num_(nan=0.0)  # T_s (0·inf: the group is 0)
            if pasa:
                thr = thr.add_(s_floor)
            bad = ~(d1.abs() <= thr)  # NaN differences are faults too
            if bool(bad.any()):
                nbad = bad.sum()
                _count(counters, "attn.scores", "detected", nbad)
                if not correct:
                    _count(counters, "attn.scores", "uncorrectable", nbad)
                else:
                    loc, ok = _locate(d1, d2, bad, L)
                    ok &= loc * s + torch.arange(s, device=dev) < w  # a real key
                    redo = bad & ~ok
                    _count(counters, "attn.scores", "corrected", ok.sum())
                    _count(counters, "attn.scores", "recomputed", redo.sum())
                    S = S.clone()
                    S4 = S.view(B, Hkv, GM, L, s)
                    if bool(ok.any()):
                        idx = ok.nonzero()  # (K, 4): b, hkv, row, r
                        lk = loc[ok]
                        if pasa:  # recompute the element with the GEMM's own arithmetic (same bits)
                            col = lk * s + idx[:, 3]
                            qe = q16[idx[:, 0], idx[:, 1], idx[:, 2]].unsqueeze(1)  # (K, 1, D)
                            ke = kb16[idx[:, 0], idx[:, 1], col].unsqueeze(2)  # (K, D, 1)
                            new = _pasa.fp16_matmul(qe, ke).view(-1).to(f32)
                        else:
                            new = _rebuild(S4, idx, lk, sc[..., :s][ok])
                        S4[idx[:, 0], idx[:, 1], idx[:, 2], lk, idx[:, 3]] = new
                    rows = redo.any(-1)
                    if bool(rows.any()):
                        ridx = rows.nonzero()  # (R, 3): b, hkv, row
                        if pasa:  # fp32 accumulation: also repairs a genuine fp16 overflow of the row
                            fresh = torch.bmm(kb[ridx[:, 0], ridx[:, 1]],
                                              qs[ridx[:, 0], ridx[:, 1], ridx[:, 2]].unsqueeze(2)).squeeze(2)
                        else:
                            idx4 = torch.stack([ridx[:, 0], ridx[:, 1], ridx[:, 2] // M, ridx[:, 2] % M], 1)
                            fresh = ctx.rows_scores(idx4, kb[ridx[:, 0], ridx[:, 1]])
                        S[ridx[:, 0], ridx[:, 1], ridx[:, 2]] = fresh
        if pasa:
            # PASA frame (Algorithm 1, lines 13–15): block mean of S' over the real keys, global
            # pseudo-average, Δm' corrections; S' enters the frame of F̄_j, the state moves there.
            sbar = rnd(S[..., :w].mean(-1, keepdim=True) if sbar_all is None else sbar_all[..., j:j + 1])
            f_new = rnd(_pasa.pseudo_average_update(f_avg, sbar, j))
            dprev, dcur = _pasa.frame_corrections(f_avg, f_new, sbar, gamma, gamma_last if w < block_n else None)
            dprev, dcur = rnd(dprev), rnd(dcur)
            f_avg = f_new
            S = rnd(S + dcur)
            m = rnd(m + dprev)  # −inf (no state yet) stays −inf
        # 2. bias, masks (-inf where masked, incl. the key padding).
        S5 = S.view(B, Hkv, G, M, block_n)
        if bias5 is not None or amask5 is not None or bmask5 is not None or positional or w < block_n:
            Sv = S5[..., :w]
            if bias5 is not None:
                Sv += bias5[..., j0:j0 + w].to(f32)
            if amask5 is not None:
                Sv += amask5[..., j0:j0 + w].to(f32)
            if bmask5 is not None:
                Sv += _additive(bmask5[..., j0:j0 + w])
            if positional:
                Sv.masked_fill_(~ctx.positional(mrow, torch.arange(j0, j0 + w, device=dev)), _NEG_INF)
            if w < block_n:
                S5[..., w:] = _NEG_INF
        S = S5.view(B, Hkv, GM, block_n)
        if detect:
            nvalid += (S > _NEG_INF).sum(-1, keepdim=True, dtype=torch.int32)
        # 3. running max (SNVR check).
        mb = S.amax(-1, keepdim=True)
        m_new = torch.maximum(m, mb)
        m_new = _apply(sf_rowmax, m_new, (B, Hq, M, 1), j)
        all_masked = (m_new == _NEG_INF) & (mb == _NEG_INF) & (m == _NEG_INF)
        base = torch.where(all_masked, torch.zeros_like(m_new), m_new)
        x = S - base
        if detect:
            xmax = mb - base  # = max_n (S - base): subtraction rounding is monotone
            tau = m_new.abs().add_(1.0).mul_(2.0**-20).clamp_(max=1.0)
            bad = ~(xmax <= tau) | ((m_new != m) & (xmax < -tau))
            if bool(bad.any()):
                nbad = bad.sum()
                _count(counters, "attn.rowmax", "detected", nbad)
                if not correct:
                    _count(counters, "attn.rowmax", "uncorrectable", nbad)
                else:
                    _count(counters, "attn.rowmax", "recomputed", nbad)
                    m_new = torch.where(bad, torch.maximum(m, mb), m_new)
                    all_masked = (m_new == _NEG_INF) & (mb == _NEG_INF) & (m == _NEG_INF)
                    base = torch.where(all_masked, torch.zeros_like(m_new), m_new)
                    x = S - base
        # 4. P = exp(x) (product check per group).
        if half_state:
            x = _round16(x)
        P = _exp_ftz(x)
        if half_state:
            P = _round16(P)
        P = _apply(sf_probs, P, (B, Hq, M, block_n), j0)
        if detect:
            bad = _exp_group_test(x, P, s)  # (B, Hkv, GM, s): groups (row, residue) that fail
            if bool(bad.any()):
                nbad = bad.sum()
                _count(counters, "attn.probs", "detected", nbad)
                if not correct:
                    _count(counters, "attn.probs", "uncorrectable", nbad)
                else:
                    _count(counters, "attn.probs", "corrected", nbad)
                    redo = bad.unsqueeze(-2).expand(*bad.shape[:-1], block_n // s, s).reshape(P.shape)
                    P = torch.where(redo, _exp_ftz(x), P)
        # 5. rescale and accumulate (O, and Oc = [Oc1 | Oc2 | lc] through the same α).
        alpha = torch.exp(m - m_new)
        alpha = torch.where((m == _NEG_INF) & (m_new == _NEG_INF), torch.ones_like(alpha), alpha)
        if half_state:  # every state update rounded to fp16, P·V an FP16 GEMM with FP16 accumulation
            alpha = _round16(alpha)
            l = _round16(_round16(l * alpha) + _round16(P.sum(-1, keepdim=True)))
            l = _apply(sf_rowsum, l, (B, Hq, M, 1), j)
            pv = _pasa.fp16_matmul(P.to(f16), vp16[:, :, j0:j0 + block_n]).to(f32)
            acc = _round16(_round16(acc * alpha) + pv)
            m = m_new
            continue
        l = l.mul_(alpha).add_(P.sum(-1, keepdim=True))
        l = _apply(sf_rowsum, l, (B, Hq, M, 1), j)
        acc = acc.mul_(alpha).add_(torch.matmul(P, vaug[:, :, j0:j0 + block_n]))
        m = m_new

    # 6. row sum check.
    redo_rows = None
    if detect:
        tau_l = 2.0 * _g(block_n + 2 * nb + 4)
        lc = acc[..., -1:]
        nv = nvalid.to(f32)
        fine = (l >= 1.0 - tau_l) & (l <= nv * (1.0 + tau_l)) & ((l - lc).abs() <= tau_l * l)
        bad6 = torch.where(nvalid > 0, ~fine, l != 0)
        if bool(bad6.any()):
            nbad = bad6.sum()
            _count(counters, "attn.rowsum", "detected", nbad)
            if not correct:
                _count(counters, "attn.rowsum", "uncorrectable", nbad)
            else:
                _count(counters, "attn.rowsum", "recomputed", nbad)
                redo_rows = bad6
    # 7. normalise, inject, unified verification.
    lsafe = torch.where(l == 0, torch.ones_like(l), l)
    acc = torch.where(l == 0, torch.zeros_like(acc), acc / lsafe)
    if half_state:
        acc = _round16(acc)
    O = acc[..., :D]
    O = _apply(sf_output, O, (B, Hq, M, D), 0)
    if detect:
        oc1 = acc[..., D:D + s]
        oc2 = acc[..., D + s:D + 2 * s]
        Og = (F.pad(O, (0, Dp - D)) if Dp != D else O).reshape(B, Hkv, GM, Lv, s)
        g1, g2 = _group_sums(Og.flatten(-2), Lv, s)
        d1 = oc1 - g1
        d2 = oc2 - g2
        thr = 2.0 * _g(block_n + 2 * nb + Lv + 4) * vmax
        bad = ~(d1.abs() <= thr)
        if redo_rows is not None:
            bad &= ~redo_rows
        if bool(bad.any()):
            nbad = bad.sum()
            _count(counters, "attn.output", "detected", nbad)
            if not correct:
                _count(counters, "attn.output", "uncorrectable", nbad)
            else:
                loc, ok = _locate(d1, d2, bad, Lv)
                ok &= loc * s + torch.arange(s, device=dev) < D  # a real column
                redo = bad & ~ok
                _count(counters, "attn.output", "corrected", ok.sum())
                _count(counters, "attn.output", "recomputed", redo.sum())
                O = O.clone()
                if bool(ok.any()):
                    idx = ok.nonzero()  # (K, 4): b, hkv, row, r
                    lk = loc[ok]
                    new = _rebuild(Og, idx, lk, oc1[ok])
                    O[idx[:, 0], idx[:, 1], idx[:, 2], lk * s + idx[:, 3]] = new
                rows = redo.any(-1, keepdim=True)
                redo_rows = rows if redo_rows is None else (redo_rows | rows)
    if redo_rows is not None and bool(redo_rows.any()):
        ridx = redo_rows.squeeze(-1).nonzero()
        idx4 = torch.stack([ridx[:, 0], ridx[:, 1], ridx[:, 2] // M, ridx[:, 2] % M], 1)
        O[ridx[:, 0], ridx[:, 1], ridx[:, 2]] = ctx.attend_rows(idx4)
    # 8. back to the input dtype.
    return O.reshape(B, Hq, M, D).to(out_dtype)

