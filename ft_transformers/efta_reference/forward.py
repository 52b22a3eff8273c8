"""`efta_reference`: the driver. It validates the call, builds the checksum tables once, walks the
key blocks calling the steps (`scores`, `masks`, `softmax`), and finishes with `output`; in PASA mode
it also keeps the blocks in one frame (`_PasaFrame`)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from .. import pasa as _pasa
from ..injection import FaultPlan
from ..kernels.contract import ATTENTION_SITES, site_dtype, site_shape
from . import output, scores, softmax
from .checksums import augment_values, key_checksums, value_checksums
from .common import count, inject
from .masks import NEG_INF, Masks
from .stored import StoredReference

PASA_PRECISIONS = ("fp32", "fp16")


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


class _PasaFrame:
    """PASA's common frame across key blocks (the PASA paper, Algorithm 1 lines 13–15).

    Block j's shifted scores S' enter the frame of the global pseudo-average F̄_j; the state kept in
    the frame of F̄_{j−1} moves with it (`pasa.pseudo_average_update`, `pasa.frame_corrections`).

    Args:
        gamma: the recovery factor γ of a full block; gamma_last: that of the last (short) block.
        sbar_all: (B, Hkv, G·M, nblocks) every block's pseudo-average from the keys, or None to take
            the mean of the block's scores (``pasa_mean="scores"``).
        rnd: rounding of the state (`softmax.round16` for the fp16 state, else identity).
    """

    def __init__(self, gamma: float, gamma_last: float, sbar_all: torch.Tensor | None,
                 rnd: Callable[[torch.Tensor], torch.Tensor]):
        self.gamma = gamma
        self.gamma_last = gamma_last
        self.sbar_all = sbar_all
        self.rnd = rnd
        self.f_avg: torch.Tensor | None = None

    def enter(self, S: torch.Tensor, m: torch.Tensor, j: int, width: int, nm: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Block j's scores S (B, Hkv, G·M, block_n) with ``width`` real keys, the running max m
        (B, Hkv, G·M, 1) and its shadow nm (−m), moved into the frame of F̄_j (an m of −inf, no state yet,
        stays −inf)."""
        rnd = self.rnd
        short = width < S.shape[-1]
        sbar = rnd(S[..., :width].mean(-1, keepdim=True) if self.sbar_all is None else self.sbar_all[..., j:j + 1])
        f_new = rnd(_pasa.pseudo_average_update(self.f_avg, sbar, j))
        dprev, dcur = _pasa.frame_corrections(self.f_avg, f_new, sbar, self.gamma,
                                              self.gamma_last if short else None)
        dprev, dcur = rnd(dprev), rnd(dcur)
        self.f_avg = f_new
        return rnd(S + dcur), rnd(m + dprev), rnd(nm - dprev)


def _check_pasa(dtype: torch.dtype, precision: str, mean: str, detect: bool) -> None:
    if dtype == torch.float32:
        raise NotImplementedError(
            "PASA runs the score GEMM in FP16 and is implemented for float16/bfloat16 inputs; "
            "float32 inputs have no FP16 overflow to avoid: use pasa=False")
    if precision not in PASA_PRECISIONS:
        raise ValueError(f"pasa_precision must be one of {PASA_PRECISIONS}, got {precision!r}")
    if mean not in ("keys", "scores"):
        raise ValueError(f"pasa_mean must be 'keys' or 'scores', got {mean!r}")
    if precision == "fp16" and detect:
        raise ValueError("pasa_precision='fp16' (fp16 softmax state) has no fp16-level check "
                         "thresholds yet: run it with detect=False, or use pasa_precision='fp32'")


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
    stored: StoredReference | None = None,
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
        pasa: PASA mode (PASA: online pseudo-average shifting attention; ``docs/pasa.md``): every key
            block is shifted by β times its mean (`pasa.shift_keys`, scale folded in), the score GEMM
            is FP16 with FP16 accumulation (`pasa.fp16_matmul`), and the global pseudo-average with
            the Δm' corrections keeps the blocks in one frame. The checks run on the shifted keys.
            fp16/bf16 inputs (bf16 q and k are rounded to fp16, as PASA prescribes); float32
            inputs raise NotImplementedError.
        pasa_beta: shift factor β in (0, 1); None = `pasa.optimal_beta(block_n, float16)`.
        pasa_precision: ``"fp32"``: the online-softmax state (m, l, O) in fp32 (default);
            ``"fp16"``: every step rounded to fp16 as well, P·V an FP16 GEMM (PASA's full
            low-precision allocation; unchecked only: needs ``detect=False``).
        pasa_mean: how the block pseudo-average ``rowmean(S'_j)`` is formed: ``"keys"`` (default),
            ``q·mean(K'_j)`` in fp32 (`pasa.block_pseudo_average`); ``"scores"``, the mean of the
            fp16 scores themselves (PASA's Algorithm 1 line 13 to the letter; γ = β/(1−β)
            amplifies their rounding error, see ``docs/pasa.md``).
        out_dtype: dtype of the result; None = q's dtype.
        stored: the checksum tables of k and v made when they entered a KV cache
            (`stored.ReferenceTables.view` of N keys, ``block_n`` and ``stride`` as here), used instead
            of tables made from k and v now: a fault in the stored k or v since then fails the checks.
            Whether k and v are finite is then read from the tables (an entry that turned non-finite in
            the cache is a fault, not an input). Not with PASA (its checks run on the shifted keys).

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
    f32, f16 = torch.float32, torch.float16
    if out_dtype is None:
        out_dtype = q.dtype
    if pasa:
        _check_pasa(q.dtype, pasa_precision, pasa_mean, detect)
        beta = _pasa.optimal_beta(block_n, f16) if pasa_beta is None else pasa_beta
        gamma = _pasa.recovery_factor(block_n, beta)  # = β/(1−β) at the optimal β
        gamma_last = _pasa.recovery_factor(N - (N - 1) // block_n * block_n, beta) if N else gamma
        q = q.to(f16)  # bf16 → fp16 (PASA paper, §2.2); values beyond ±65504 become inf
        k = k.to(f16)
    elif pasa_precision not in PASA_PRECISIONS:
        raise ValueError(f"pasa_precision must be one of {PASA_PRECISIONS}, got {pasa_precision!r}")
    half_state = pasa and pasa_precision == "fp16"
    if B == 0 or Hq == 0 or M == 0 or D == 0 or N == 0:  # N == 0: every row fully masked
        return torch.zeros(B, Hq, M, D, dtype=out_dtype, device=dev)
    full4 = (B, Hq, M, N)
    masks = Masks(bias, attn_mask, full4, Hkv, G, causal, window)

    # Non-finite inputs: −inf in q, k or v is as bad as +inf there; in bias and additive masks it
    # is a mask value. The call then runs unchecked (NaN propagates), counted once.
    if pasa and stored is not None:
        raise ValueError("stored checksum tables are K's, not PASA's shifted keys: pass stored=None with pasa")
    kv = (k, v) if stored is None else (stored.kabs, stored.vtile)
    if detect and not (all(bool(torch.isfinite(t).all()) for t in (q, *kv)) and not masks.nonfinite()):
        count(counters, "attn.scores", "nonfinite_input", 1)
        detect = correct = False

    nb = -(-N // block_n)
    pv_dtype = f16 if half_state else v.dtype  # the dtype GEMM II reads P in
    sfs = {site: plan.for_site(site, site_shape(site, B, Hq, M, N, D, nb, stride), site_dtype(site, pv_dtype), dev)
           if plan else None for site in ATTENTION_SITES}

    s = stride
    L = block_n // s
    Np = nb * block_n

    # GQA rows: q viewed as (B, Hkv, G·M, D), query head h = kv head h // G.
    qs5 = (q.to(f32) * float(scale)).contiguous().view(B, Hkv, G, M, D)
    qs = qs5.view(B, Hkv, GM, D)
    k32 = k.to(f32).contiguous()
    v32 = v.to(f32).contiguous()
    kp = F.pad(k32, (0, 0, 0, Np - N)) if Np != N else k32
    vp = F.pad(v32, (0, 0, 0, Np - N)) if Np != N else v32
    q16 = kp16 = vp16 = frame = None
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
        frame = _PasaFrame(gamma, gamma_last, sbar_all, softmax.round16 if half_state else _identity)
    recompute = output.RowRecompute(qs5, k32, v32, masks)

    if detect and stored is not None:
        if tuple(stored.kc.shape) != (B, Hkv, nb, 2 * s, D) or tuple(stored.vc.shape) != (B, Hkv, Np, 2 * s):
            raise ValueError(f"stored tables of shapes {tuple(stored.kc.shape)}, {tuple(stored.vc.shape)} do not "
                             f"belong to k, v of shape {tuple(k.shape)} in blocks of {block_n}")
        kc, kabs = stored.kc, stored.kabs
        qn1, s_floor = scores.query_bound(qs, L, pasa)
        vaug, vmax = augment_values(vp, stored.vc), stored.vtile.amax(2, keepdim=True)
    elif detect:
        kc, kabs = key_checksums(kp, nb, s)
        qn1, s_floor = scores.query_bound(qs, L, pasa)
        vaug, vmax = value_checksums(vp, N, s)
    else:
        vaug = vp

    m = torch.full((B, Hkv, GM, 1), NEG_INF, dtype=f32, device=dev)
    nm = torch.full_like(m, -NEG_INF)  # m's shadow (`softmax.carried_max_lost`)
    lost = torch.zeros_like(m, dtype=torch.bool)
    l = torch.zeros(B, Hkv, GM, 1, dtype=f32, device=dev)
    acc = torch.zeros(B, Hkv, GM, vaug.shape[-1], dtype=f32, device=dev)
    nvalid = torch.zeros(B, Hkv, GM, 1, dtype=torch.int32, device=dev)
    row_site = (B, Hq, M, 1)
    block_site = (B, Hq, M, block_n)

    for j in range(nb):
        j0 = j * block_n
        w = min(N, j0 + block_n) - j0
        kb = kp[:, :, j0:j0 + block_n]
        kb16 = kp16[:, :, j0:j0 + block_n] if pasa else None
        # 1. GEMM I and its checksum check.
        S = scores.block_scores(qs, kb, sfs["attn.scores"], block_site, j0, q16=q16, kb16=kb16)
        if detect:
            S = scores.check_scores(S, qs, kb, kc[:, :, j], kabs[:, :, j], qn1, s_floor, width=w, stride=s,
                                    correct=correct, counters=counters, q16=q16, kb16=kb16,
                                    sf_cs=sfs["attn.checksum"], cs_site=(B, Hq, M, s), j=j)
        if pasa:
            S, m, nm = frame.enter(S, m, j, w, nm)
        # 2. bias and masks (−inf where masked, the key padding included).
        S5 = S.view(B, Hkv, G, M, block_n)
        masks.apply_block(S5, j0, w)
        S = S5.view(B, Hkv, GM, block_n)
        S2 = S  # step 2's result as step 4 anchors on it (the kernel evaluates it a second time)
        S = inject(sfs["attn.masked_scores"], S, block_site, j0)
        if detect:
            nvalid += (S > NEG_INF).sum(-1, keepdim=True, dtype=torch.int32)
        # 3. running max (SNVR check); 4. x, P = exp(x) (product check); 5. rescale (checked), accumulate.
        chk = dict(detect=detect, correct=correct, counters=counters)
        if detect:
            lost |= softmax.carried_max_lost(m, nm)
        m_new, base, nm = softmax.running_max(S, S2, m, nm, sfs["attn.rowmax"], row_site, j, **chk)
        P, pd = softmax.probabilities(S, S2, base, sfs, block_site, j0, stride=s, pv_dtype=pv_dtype,
                                      half_state=half_state, **chk)
        alpha = softmax.rescale(m, m_new, sfs["attn.alpha"], row_site, j, **chk)
        vb = vp16[:, :, j0:j0 + block_n] if half_state else vaug[:, :, j0:j0 + block_n]
        l, acc = softmax.accumulate(P, pd, alpha, l, acc, vb, sfs, block_site, j, head_dim=D, stride=s,
                                    half_state=half_state)
        m = inject(sfs["attn.rowmax_carry"], m_new, row_site, j)

    # 6. row sum check; 7. normalise, inject, unified verification, recompute the flagged rows.
    redo_rows = None
    if detect:
        l = torch.where(lost | softmax.carried_max_lost(m, nm), torch.nan, l)
        redo_rows = output.check_row_sums(l, acc, nvalid, block_n=block_n, nblocks=nb, correct=correct,
                                          counters=counters)
    acc = output.normalise(l, acc, half_state)
    O = output.extract(acc, D, sfs["attn.output"], (B, Hq, M, D))
    if detect:
        O, redo_rows = output.verify_output(O, acc, vmax, redo_rows, stride=s, block_n=block_n, nblocks=nb,
                                            correct=correct, counters=counters)
    O = output.recompute_rows(O, redo_rows, recompute)
    # 8. back to the input dtype.
    return O.reshape(B, Hq, M, D).to(out_dtype)
