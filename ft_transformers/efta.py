"""`efta_attention`: fault-tolerant fused attention (EFTA), the kernel-level public entry point.

The checks, thresholds, counters and injection sites are those of ``docs/algorithms.md``. Two
backends implement them: the Triton kernel (``ft_transformers.kernels.efta``, CUDA) and the
PyTorch reference (`ft_transformers.efta_reference`, any device; the CPU runtime).
"""

from __future__ import annotations

import functools
import math
import numbers
import operator
from collections.abc import Sequence

import torch

from . import pasa as _pasa
from .counters import FaultStats, new_counters
from .efta_reference import broadcast_to_scores, efta_reference
from .injection import FaultPlan, FaultSpec
from .kernels.contract import ATTENTION_SITES, CACHE_SITES
from .kv_checksums import KVChecksums, flip_kv_cache

__all__ = ["efta_attention"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_BACKENDS = ("auto", "triton", "reference")


@functools.cache
def _triton_module():
    """``ft_transformers.kernels.efta`` if it imports and has `efta_triton_forward`, else None."""
    try:
        from .kernels import efta as kmod
    except ImportError:
        return None
    return kmod if hasattr(kmod, "efta_triton_forward") else None


@functools.lru_cache(maxsize=256)  # per call on the hot path: β's fixed-point iteration runs once
def _pasa_shift(kmod, beta: float | None, n_keys: int):
    """PASA's key shift as the Triton kernel ``kmod`` takes it (``kmod.PasaShift``) for ``n_keys`` keys in
    blocks of ``kmod.CS_BLOCK_N``: β (``beta``, or the optimal one for fp16 and that block), the fp16
    shifting matrix's entries and the recovery factor γ of a full block and of the last one
    (``docs/pasa.md`` "Kernel interface")."""
    bn = kmod.CS_BLOCK_N
    beta = _pasa.optimal_beta(bn, torch.float16) if beta is None else float(beta)
    w_last = n_keys - (n_keys - 1) // bn * bn if n_keys else bn
    diag, off = _pasa.shift_coefficients(bn, beta)
    diag_l, off_l = _pasa.shift_coefficients(w_last, beta)
    return kmod.PasaShift(diag, off, _pasa.recovery_factor(bn, beta), diag_l, off_l,
                          _pasa.recovery_factor(w_last, beta))


def _resolve_backend(backend: str, device: torch.device):
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(map(repr, _BACKENDS))}, got {backend!r}")
    if backend == "reference":
        return None
    kmod = _triton_module()
    if backend == "triton":
        if kmod is None:
            raise NotImplementedError(
                "backend='triton' needs ft_transformers.kernels.efta.efta_triton_forward, which is not "
                "available (not implemented yet, or triton is not installed); use backend='reference'"
            )
        return kmod
    # auto: the Triton kernel for CUDA tensors of every supported dtype (GPU tests pass for all three
    # on the H100, docs/triton_efta_gpu.md); dtypes are validated by the caller
    return kmod if device.type == "cuda" else None


def _validate(q, k, v, scale, bias, attn_mask, window, flags) -> None:
    for name, flag in flags.items():
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__} {flag!r}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D ({'(B, Hq, M, D)' if name == 'q' else '(B, Hkv, N, D)'}), "
                             f"got shape {tuple(t.shape)}")
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; EFTA supports float16, bfloat16 and float32")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape (B, Hkv, N, D), got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    B, Hq, M, D = q.shape
    if D == 0:
        raise ValueError(f"head dim D must be >= 1, got q of shape {tuple(q.shape)} (B, Hq, M, D)")
    if k.shape[0] != B:
        raise ValueError(f"batch size mismatch: q has {B}, k/v have {k.shape[0]}")
    if k.shape[3] != D:
        raise ValueError(f"head dim mismatch: q has D={D}, k/v have D={k.shape[3]}")
    Hkv = k.shape[1]
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"query heads ({Hq}) must be a multiple of key/value heads ({Hkv})")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)
                              or not math.isfinite(float(scale))):
        raise TypeError(f"scale must be a finite float or None, got {type(scale).__name__} {scale!r}")
    shape = (B, Hq, M, k.shape[2])
    for name, t in (("bias", bias), ("attn_mask", attn_mask)):
        if t is None:
            continue
        broadcast_to_scores(t, shape, name)
        if name == "bias" and not t.is_floating_point():
            raise TypeError(f"bias must be a floating tensor (additive), got {t.dtype}")
        if name == "attn_mask" and not (t.dtype == torch.bool or t.is_floating_point()):
            raise TypeError(f"attn_mask must be bool (True = attend) or floating (additive), got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    if window is not None:
        try:
            if isinstance(window, bool):
                raise TypeError
            window = operator.index(window)
        except TypeError:
            raise TypeError(f"window must be a positive int or None, got {window!r}") from None
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
    if torch.is_grad_enabled():
        for name, t in (("q", q), ("k", k), ("v", v), ("bias", bias), ("attn_mask", attn_mask)):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                raise ValueError(
                    f"EFTA is inference-only (no backward), but {name} requires grad: run it under "
                    "torch.no_grad() or torch.inference_mode(), or detach the inputs"
                )


def _efta_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None,
    causal: bool,
    bias: torch.Tensor | None,
    attn_mask: torch.Tensor | None,
    window: int | None,
    pasa: bool,
    detect: bool,
    correct: bool,
    plan: FaultPlan,
    counters: torch.Tensor,
    backend: str,
    pasa_beta: float | None = None,
    pasa_precision: str = "fp32",
    kv_checksums: KVChecksums | None = None,
) -> torch.Tensor:
    """EFTA forward adding its events into ``counters`` (no validation beyond the backend choice).

    Args:
        q: (B, Hq, M, D); k, v: (B, Hkv, N, D); same dtype (fp16/bf16/fp32) and device.
        bias, attn_mask: broadcastable to (B, Hq, M, N) (mask bool True = attend, or additive).
        plan: injection plan (attention sites only).
        counters: int32 (sites, kinds) block (`contract.COUNTER_SHAPE`) on q's device (e.g. a view into a
            bigger tensor).
        pasa: PASA shifted FP16 score GEMM (``docs/pasa.md``); fp16/bf16 inputs only.
        pasa_beta: PASA shift factor; None = optimal for fp16 and the backend's key block.
        pasa_precision: PASA's softmax-state precision, ``"fp32"`` or ``"fp16"`` (the PASA paper's full
            low-precision allocation; only with ``detect=False``).
        kv_checksums: the tables of the KV cache k and v are (`KVChecksums`): read instead of tables made
            now while they describe k and v as they are and the backend reads their form; the checks on,
            PASA off (PASA's tables are of its shifted keys, made per call).
    Returns:
        (B, Hq, M, D) in q's dtype.
    """
    if pasa and q.dtype == torch.float32:
        raise NotImplementedError(
            "PASA runs the score GEMM in FP16 and is implemented for float16/bfloat16 inputs; float32 "
            "inputs have no FP16 overflow to avoid: use pasa=False (or run the model in fp16/bf16)")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    correct = bool(correct and detect)
    kmod = _resolve_backend(backend, q.device)
    if plan:  # the cache's memory, between the step that wrote it and this call
        flip_kv_cache(plan, k, v, kv_checksums)
    use_stored = kv_checksums is not None and detect and not pasa
    if window is not None:
        window = operator.index(window)
    kwargs = dict(scale=float(scale), causal=bool(causal), bias=bias, attn_mask=attn_mask, window=window,
                  detect=bool(detect), correct=correct, plan=plan, counters=counters)
    if pasa:
        # The Triton kernel opts in to PASA with a module attribute PASA_SUPPORTED = True and then
        # takes the key shift resolved here (pasa=PasaShift) and pasa_precision (docs/pasa.md,
        # "Kernel interface"); the kernel imports nothing of the library.
        if kmod is not None and getattr(kmod, "PASA_SUPPORTED", False):
            kwargs.update(pasa=_pasa_shift(kmod, pasa_beta, k.shape[2]), pasa_precision=pasa_precision)
        elif backend == "triton":
            raise NotImplementedError(
                "PASA is not implemented in the Triton EFTA kernel yet; use backend='reference' "
                "(or 'auto', which takes the reference path for pasa=True)")
        else:
            return efta_reference(q, k, v, pasa=True, pasa_beta=pasa_beta, pasa_precision=pasa_precision, **kwargs)
    if kmod is not None:
        stored = kv_checksums.tables(k, v, "triton") if use_stored else None
        if backend == "triton":
            return kmod.efta_triton_forward(q, k, v, stored=stored, **kwargs)
        # "auto": shapes the kernel does not handle (e.g. head dims outside its range) take the
        # reference path; it raises EftaUnsupported before doing any work.
        unsupported = getattr(kmod, "EftaUnsupported", ())
        try:
            return kmod.efta_triton_forward(q, k, v, stored=stored, **kwargs)
        except unsupported:
            use_stored = False
    kwargs.update(pasa=bool(pasa), pasa_beta=pasa_beta, pasa_precision=pasa_precision)
    stored = kv_checksums.tables(k, v, "reference") if use_stored else None
    return efta_reference(q, k, v, stored=stored, **kwargs)


def efta_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    bias: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
    window: int | None = None,
    pasa: bool = False,
    detect: bool = True,
    correct: bool = True,
    inject: FaultSpec | Sequence[FaultSpec] | None = None,
    backend: str = "auto",
    kv_checksums: KVChecksums | None = None,
) -> tuple[torch.Tensor, FaultStats]:
    """Fault-tolerant attention ``softmax(scale·q·kᵀ + bias + mask)·v`` (inference only).

    Args:
        q: (B, Hq, M, D) float16/bfloat16/float32.
        k, v: (B, Hkv, N, D), q's dtype; Hq a multiple of Hkv (GQA/MQA: query head h uses kv
            head h // (Hq/Hkv)).
        causal: causal mask aligned bottom-right (query i sees keys j ≤ i + N − M), right for
            decoding with a KV cache (M < N).
        scale: score scale; default 1/sqrt(D) (T5 uses 1.0).
        bias: additive float bias broadcastable to (B, Hq, M, N) (e.g. T5's position bias).
        attn_mask: bool (True = attend) or additive float, broadcastable to (B, Hq, M, N).
        window: sliding window; key j is visible only if j > i + N − M − window.
        pasa: PASA: each key block shifted by β times its mean, FP16 score GEMM with FP16
            accumulation, softmax state in fp32, β optimal for fp16 and the key block
            (``docs/pasa.md``). fp16/bf16 inputs only (float32: NotImplementedError).
        detect: verify (checksums and range checks); False = the unprotected computation.
        correct: repair what is detected; False only counts (``detected`` + ``uncorrectable``).
        inject: `FaultSpec` (or a list) at attention sites ``attn.*``.
        backend: ``"auto"`` (the Triton kernel for CUDA tensors when it is available and handles
            the shape, else the reference), ``"triton"`` or ``"reference"``.
        kv_checksums: the checksum tables of the KV cache that k and v are (`KVChecksums`, extended at
            each write to the cache): read instead of making tables from k and v now, while they
            describe k and v as they are (else made now, as without), with the checks on and PASA off.
            A fault in the stored k or v since the tables were made then fails the checks.

    Returns:
        ``(out, stats)``: out (B, Hq, M, D) in q's dtype; stats a `FaultStats` ``{kind: int}``.
        Rows with every key masked are 0 (so are all rows when N = 0); B, Hq or M = 0 give an
        empty output.

    Raises:
        TypeError / ValueError on tensors that are not 4-D float16/bfloat16/float32 on one device,
        head dim 0, mismatched batch, head dim or k/v shapes, Hq not a multiple of Hkv (Hkv = 0
        included), masks that do not broadcast to (B, Hq, M, N), a non-finite ``scale``, a
        ``window`` < 1, flags that are not bools, or ``inject`` naming a non-attention site (the
        attention sites and ``attn.kv_cache``, which flips k or v in place before the call reads them);
        ValueError when grad mode is on and an input requires grad (inference only).
    """
    _validate(q, k, v, scale, bias, attn_mask, window,
              dict(causal=causal, pasa=pasa, detect=detect, correct=correct))
    plan = inject if isinstance(inject, FaultPlan) else FaultPlan(inject)
    plan.check_sites(ATTENTION_SITES + CACHE_SITES, "efta_attention")
    if kv_checksums is not None and not isinstance(kv_checksums, KVChecksums):
        raise TypeError(f"kv_checksums must be a KVChecksums or None, got {type(kv_checksums).__name__}")
    counters = new_counters(q.device)
    out = _efta_forward(q, k, v, scale=scale, causal=causal, bias=bias, attn_mask=attn_mask, window=window,
                        pasa=pasa, detect=detect, correct=correct, plan=plan, counters=counters,
                        backend=backend, kv_checksums=kv_checksums)
    return out, FaultStats(counters)
