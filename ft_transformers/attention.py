"""The ``"efta"`` attention implementation for Hugging Face Transformers.

`efta_attention_forward` has the signature of transformers' attention interface (see
``transformers/integrations/sdpa_attention.py``): it receives the projected query/key/value
(B, H, S, D), the mask built by the registered mask function, ``scaling``, ``is_causal``,
``dropout`` and, for T5, ``position_bias``. It returns ``(attn_output (B, M, Hq, D), None)``.

The mask function is transformers' ``sdpa_mask``: a bool mask (B, 1, M, N) with True = attend,
or ``None`` when the pattern is plain causal / full, in which case ``is_causal`` carries it.
Our kernel aligns causal masks bottom-right, which is right for both cases where transformers
skips the mask (q_len == kv_len and q_len == 1).
"""

from __future__ import annotations

import warnings

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .counters import new_counters
from .efta import _efta_forward
from .injection import FaultPlan

ATTN_IMPLEMENTATION = "efta"

def efta_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    position_bias: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention through EFTA. query (B, Hq, M, D), key/value (B, Hkv, N, D) → (B, M, Hq, D)."""
    if module.training and dropout > 0.0:
        raise RuntimeError(
            "EFTA attention is inference-only and has no dropout: call model.eval() (the module "
            f"{type(module).__name__} is in training mode with dropout={dropout})"
        )
    if kwargs.get("output_attentions", False):
        raise ValueError("attn_implementation='efta' never materialises attention weights; "
                         "use attn_implementation='eager' for output_attentions=True")
    if kwargs.get("softcap") is not None:
        raise ValueError("attn_implementation='efta' does not support attention logit softcapping")
    if kwargs.get("s_aux") is not None:
        raise ValueError("attn_implementation='efta' does not support attention sinks")

    if torch.is_grad_enabled() and query.requires_grad:
        warnings.warn("attn_implementation='efta' is inference-only: gradients do not flow through it. "
                      "Run under torch.no_grad() / torch.inference_mode().", UserWarning, stacklevel=2)
    ctx = getattr(module, "_ftt", None)
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", False))
    if attention_mask is not None:
        # The mask (built by sdpa_mask or given by the user) already holds causality.
        causal = False
    if ctx is None:
        # "efta" without enable_fault_tolerance: default checks, events not recorded.
        detect, correct, pasa, pasa_beta = True, True, False, None
        plan, counters = FaultPlan(None), new_counters(query.device)
    else:
        detect, correct, pasa, pasa_beta = ctx.detect, ctx.correct, ctx.pasa, ctx.pasa_beta
        plan, counters = ctx.plan_for_call(), ctx.counters(query.device)
    out = _efta_forward(
        query, key, value,
        scale=scaling, causal=causal, bias=position_bias, attn_mask=attention_mask, window=None,
        pasa=pasa, detect=detect, correct=correct, plan=plan, counters=counters, backend="auto",
        pasa_beta=pasa_beta,
    )
    if ctx is not None:
        ctx.after_call(counters)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register ``"efta"`` with transformers' attention and mask interfaces (idempotent)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, efta_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
