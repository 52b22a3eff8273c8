"""The ``"efta"`` attention implementation for Hugging Face Transformers.

`efta_attention_forward` has the signature of transformers' attention interface (see
``transformers/integrations/sdpa_attention.py``): it receives the projected query/key/value
(B, H, S, D), the mask built by the registered mask function, ``scaling``, ``is_causal``,
``dropout`` and, for T5, ``position_bias``. It returns ``(attn_output (B, M, Hq, D), None)``.

The mask function is transformers' ``sdpa_mask``: a bool mask (B, 1, M, N) with True = attend,
or ``None`` when the pattern is plain causal / full, in which case ``is_causal`` carries it.
Our kernel aligns causal masks bottom-right, which is right for both cases where transformers
skips the mask (q_len == kv_len and q_len == 1).

A key tensor returned by the update of a tracked KV cache (`ft_transformers.kv_checksums`) carries that
cache's checksum tables; eager calls hand them to EFTA, which reads them instead of making its own
while they describe the cache as it is (compiled calls make their own).

With no mask, a causal call of M > 1 queries against more keys (a static cache's first prefill, whose
unwritten slots follow the prompt) is aligned top-left, as SDPA's ``is_causal`` is: the keys past the
first M are never attended, and are left out, as transformers' SDPA path leaves them out.

Routes that pair an attention function with the flash-attention mask function (the Hub-kernels
route, ``load_and_register_attn_kernel``, registers every kernel that way) hand over a 2-D padding
mask (B, N) (bool or int, 1 = attend) that holds neither causality nor the sliding window; that form
is accepted too and turned into the 4-D bool mask here (`_padding_mask_4d`).

Under ``torch.compile`` a protected attention call is one opaque custom op, ``ftt::efta_module``,
running the same eager code (no graph breaks from the reference path's host-side branches); with
faults being injected it runs eagerly outside the graph (see `ft_transformers.protect`).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ._states import STATES, faults_may_hit, static_of, step_block
from .counters import new_counters
from .efta import _efta_forward
from .events import EventRecorder
from .injection import FaultPlan
from .kv_checksums import kv_checksums_of

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

    if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                       for t in (query, key, value, position_bias)):
        # EFTA has no backward: raise rather than hand out gradients that silently stop here.
        raise RuntimeError(
            "attn_implementation='efta' is inference-only (no backward), but "
            f"{type(module).__name__} ran with grad mode on and inputs requiring grad. Run the model under "
            "torch.no_grad() or torch.inference_mode() (model.generate does), or call model.requires_grad_(False)")
    ctx = getattr(module, "_ftt", None)
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", False))
    window = kwargs.get("sliding_window")
    if attention_mask is not None and attention_mask.dim() == 2:
        # A flash-style padding mask holds neither causality nor the window: EFTA applies both itself.
        attention_mask, key, value = _padding_mask_4d(attention_mask, query, key, value)
    elif attention_mask is not None:
        # The mask (built by sdpa_mask or given by the user) already holds causality and the window.
        causal, window = False, None
    elif not (causal and window is not None and key.shape[2] > window):
        # No mask and no window cutting keys: plain causal / full. (sdpa_mask returns None only when the
        # window cuts nothing; a mask function that builds no windows leaves a cutting one to EFTA.)
        window = None
    if attention_mask is None and causal and 1 < query.shape[2] < key.shape[2]:
        # top-left alignment, SDPA's is_causal (the mask function skips the mask only where that is meant)
        m = query.shape[2]
        key, value = key[:, :, :m], value[:, :, :m]
        if position_bias is not None and position_bias.shape[-1] > m:
            position_bias = position_bias[..., :m]
    if ctx is None:
        # "efta" without enable_fault_tolerance: default checks, events not recorded.
        out = _efta_forward(
            query, key, value,
            scale=scaling, causal=causal, bias=position_bias, attn_mask=attention_mask, window=window,
            pasa=False, detect=True, correct=True, plan=FaultPlan(None), counters=new_counters(query.device),
            backend="auto", kv_checksums=kv_checksums_of(key),
        )
    elif not torch.compiler.is_compiling():
        out = _protected(ctx, query, key, value, attention_mask, position_bias, scaling, causal, window)
    else:
        st = static_of(ctx.key)  # (one guard, `_states`)
        if faults_may_hit(st):
            out = _protected_outside_graph(ctx, query, key, value, attention_mask, position_bias, scaling, causal,
                                           window)
        else:
            # Already (B, M, Hq, D), contiguous.
            return torch.ops.ftt.efta_module(
                query, key, value, attention_mask, position_bias, step_block(st, query.device), st.index,
                scaling, causal, window, st.detect, st.correct, st.pasa, st.pasa_beta,
                STATES[st.state_key].config.on_uncorrectable == "raise", st.name), None
    return out.transpose(1, 2).contiguous(), None


def _protected(ctx, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
               position_bias: torch.Tensor | None, scaling: float | None, causal: bool,
               window: int | None) -> torch.Tensor:
    """A protected module's EFTA call run eagerly: plan its faults, compute, count. -> (B, Hq, M, D)."""
    plan, counters = ctx.plan_for_call(), ctx.counters(query.device)
    ctx.ran_efta = True  # read and cleared by `ft_transformers.bypass` while it watches for bypasses
    out = _efta_forward(
        query, key, value,
        scale=scaling, causal=causal, bias=position_bias, attn_mask=attention_mask, window=window,
        pasa=ctx.pasa, detect=ctx.detect, correct=ctx.correct, plan=plan, counters=counters, backend="auto",
        pasa_beta=ctx.pasa_beta, kv_checksums=kv_checksums_of(key),
    )
    ctx.after_call(counters)
    return out


def _padding_mask_4d(mask: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A 2-D padding mask (B, Nm), 1 = attend, as the 4-D bool mask (B, 1, 1, N') EFTA takes.

    Causality and the sliding window stay EFTA's own ``causal`` / ``window`` (bottom-right aligned). A
    mask shorter than the keys (a static cache: slots past the mask were never written) keeps only the
    first Nm keys, as the flash-attention path does, so that causality aligns with the last real key.

    Returns (mask (B, 1, 1, N'), key, value (B, Hkv, N', D)).
    """
    if mask.is_floating_point() or mask.is_complex():
        raise TypeError(f"a 2-D attention_mask must be a padding mask, bool or integer with 1 = attend (the "
                        f"flash-attention form); got dtype {mask.dtype}. Pass additive masks as 4-D "
                        "(B or 1, H or 1, M, N)")
    b, n = query.shape[0], key.shape[2]
    if mask.shape[0] not in (1, b) or mask.shape[1] > n:
        raise ValueError(f"a 2-D attention_mask (padding mask) of shape {tuple(mask.shape)} cannot be broadcast "
                         f"to batch {b} and {n} keys: it must be (B, N) or (1, N) with N <= the key length")
    if mask.shape[1] < n:
        n = mask.shape[1]
        key, value = key[:, :, :n], value[:, :, :n]
    return (mask != 0).to(query.device)[:, None, None, :], key, value


# Under torch.compile with faults active: the call runs eagerly, outside the graph.
_protected_outside_graph = torch.compiler.disable(_protected)


@torch.library.custom_op("ftt::efta_module", mutates_args=("step_counters",))
def _efta_module_op(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
    position_bias: torch.Tensor | None, step_counters: torch.Tensor, slot: int, scaling: float | None,
    causal: bool, window: int | None, detect: bool, correct: bool, pasa: bool, pasa_beta: float | None,
    raise_uncorrectable: bool, name: str,
) -> torch.Tensor:
    """A protected module's EFTA call as one opaque op for compiled graphs (no fault injection).

    Args:
        query: (B, Hq, M, D); key, value: (B, Hkv, N, D); attention_mask / position_bias
            broadcastable to (B, Hq, M, N) or None.
        step_counters: (modules, sites, kinds) int32 counters of the step; row ``slot`` is added into.
    Returns:
        (B, M, Hq, D) contiguous, in query's dtype: what the eager protected call returns.
    """
    counters = step_counters[slot]
    out = _efta_forward(
        query, key, value,
        scale=scaling, causal=causal, bias=position_bias, attn_mask=attention_mask, window=window,
        pasa=pasa, detect=detect, correct=correct, plan=FaultPlan(None), counters=counters, backend="auto",
        pasa_beta=pasa_beta,
    )
    if raise_uncorrectable:
        EventRecorder.raise_if_uncorrectable(counters, name)
    return out.transpose(1, 2).contiguous()


@_efta_module_op.register_fake
def _(query, key, value, attention_mask, position_bias, step_counters, slot, scaling, causal, window, detect,
      correct, pasa, pasa_beta, raise_uncorrectable, name):
    b, h, m, d = query.shape
    return query.new_empty((b, m, h, d))


def register() -> None:
    """Register ``"efta"`` with transformers' attention and mask interfaces (idempotent)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, efta_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
