"""Sibling checked GEMMs: the Linear layers that read one input, checked in one launch on the GPU.

A Llama/Qwen2 attention block computes ``q_proj(h)``, ``k_proj(h)`` and ``v_proj(h)`` from the same
``h``, its MLP ``gate_proj(x)`` and ``up_proj(x)``. In a decode step each of these is a small GEMM
(M = batch rows) whose time is mostly the launch and the weight read, so protection runs them as one
launch of the decode kernel (`kernels.abft_gemm.checked_gemm_siblings`): every weight keeps its own
storage, checksums and counters, so events stay attributed to ``q_proj``, ``k_proj`` and ``v_proj``.

How it is wired, without rewriting transformers' forwards: the parent module (the attention block,
the MLP) gets an instance ``forward`` that computes the siblings' outputs first, parks them on its
`_SiblingGroup` (``pending``), and calls the original forward; each sibling's checked forward
returns its parked slice when it is called with that very input tensor (``x is h``), and runs its
own checked GEMM otherwise. ``torch.compile`` traces through this (the group is one opaque op,
``ftt::checked_linear_siblings``). Calls that the one-launch kernel does not take (more than
``SIBLINGS_MAX_ROWS`` rows — prefill —, fp32, CPU, autocast, grad, active fault injection, non-finite
weights) run each sibling as before.

``FTT_SIBLINGS=0`` (read by `enable_fault_tolerance`) leaves the parents alone: one launch per layer.
"""

from __future__ import annotations

import functools
import os
import types
import warnings
from collections.abc import Sequence

import torch

from .checked_linear import _TRITON_FAILED, _autocast_dtype, _checked_linear_forward
from .events import EventRecorder
from .vabft import weight_checksums

__all__: list[str] = []

_DTYPES16 = (torch.float16, torch.bfloat16)
# Tests switch this on to run the sibling kernel on CPU under TRITON_INTERPRET=1 (CUDA only otherwise).
_ON_CPU = False


@functools.cache
def _kernels():
    """``ft_transformers.kernels.abft_gemm``, or None without triton."""
    try:
        from .kernels import abft_gemm  # noqa: PLC0415 (optional, imported on demand)
    except ImportError:
        return None
    return abft_gemm


class _SiblingGroup:
    """The protected Linear layers of one parent module that read the same input.

    Attributes:
        members: the layers (``nn.Linear``), in output order.
        contexts: their protection contexts (`protect._ModuleContext`).
        arg: the parent forward's name for the shared input (``"hidden_states"``, ``"x"``).
        inner: the parent's forward before protection (called with the original arguments).
        pending: ``(h, outputs)`` while the parent's forward runs with precomputed outputs, else None.
    """

    def __init__(self, members: Sequence[torch.nn.Module], contexts: Sequence, arg: str, inner) -> None:
        self.members = list(members)
        self.contexts = list(contexts)
        self.state = self.contexts[0].state
        self.arg = arg
        self.inner = inner
        self.k = int(self.members[0].weight.shape[1])
        self.sizes = [int(m.weight.shape[0]) for m in self.members]
        self.kernels = _kernels()  # (looked up here: a traced forward should not run the import)
        self.on_cpu = _ON_CPU and self.kernels.interpreting()
        self.pending: tuple[torch.Tensor, Sequence[torch.Tensor]] | None = None

    def eligible(self, x: object) -> bool:
        """Whether this call of the parent runs its siblings in one launch (host metadata only)."""
        G = self.kernels
        if self.state.active_faults or not isinstance(x, torch.Tensor):
            return False
        dev = x.device
        if not (dev.type == "cuda" or self.on_cpu):
            return False
        if x.dtype not in _DTYPES16 or x.dtype in _TRITON_FAILED or x.dim() < 1 or x.shape[-1] != self.k:
            return False
        rows = x.numel() // self.k
        if not 0 < rows <= G.SIBLINGS_MAX_ROWS or _autocast_dtype(dev.type) is not None:
            return False
        ws = [m.weight for m in self.members]
        if torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in ws)):
            return False
        return all(w.dtype == x.dtype and w.device == dev for w in ws)

    def outputs(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The members' outputs for input x (..., K): views (..., N_i) of one (..., ΣN_i) tensor."""
        cfg = self.state.config
        weights = [m.weight for m in self.members]
        biases = [m.bias for m in self.members if m.bias is not None]
        if torch.compiler.is_compiling():
            y = torch.ops.ftt.checked_linear_siblings(
                x, weights, biases, self.contexts[0].step_block(x.device), [c.slot.index for c in self.contexts],
                [id(m) for m in self.members], cfg.emax, float(cfg.csigma), self.contexts[0].correct,
                cfg.on_uncorrectable == "raise", ",".join(c.slot.name for c in self.contexts))
        else:
            counters = [c.counters(x.device) for c in self.contexts]
            y = _siblings_forward(x, weights, biases, counters, self.members, cfg.emax, float(cfg.csigma),
                                  self.contexts[0].correct)
            for c, cnt in zip(self.contexts, counters):
                c.after_call(cnt)
        return list(y.split(self.sizes, dim=-1))


def _siblings_forward(x: torch.Tensor, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor],
                      counters: Sequence[torch.Tensor], owners: Sequence[object | None], emax: float | None,
                      csigma: float, correct: bool) -> torch.Tensor:
    """y (..., ΣN_i) = the checked GEMMs of x (..., K) with each (N_i, K) weight, events into each
    layer's counters: one launch when the kernel takes the operands, else one checked call per layer.
    ``biases``: one per weight, or empty."""
    k = x.shape[-1]
    x2d = x.reshape(-1, k)
    bs = list(biases) if biases else [None] * len(weights)
    G = _kernels()
    wcs = [weight_checksums(w, b, cache_owner=o) for w, b, o in zip(weights, bs, owners)]
    if G.siblings_supported(x2d, weights, bs) and all(wc.finite for wc in wcs) and x.dtype not in _TRITON_FAILED:
        try:
            y = G.checked_gemm_siblings(x2d, weights, bs, wcs, counters, emax=emax, csigma=csigma, correct=correct)
            return y.view(*x.shape[:-1], y.shape[1])
        except Exception as exc:  # noqa: BLE001 - e.g. a Triton compile failure on an untested GPU
            _TRITON_FAILED.add(x.dtype)
            warnings.warn(f"the Triton sibling GEMM failed for {x.dtype} ({type(exc).__name__}: {exc}); "
                          "falling back to the PyTorch checked path for this dtype", RuntimeWarning, stacklevel=2)
    return torch.cat([
        _checked_linear_forward(x, w, b, weight_is_kn=False, emax=emax, csigma=csigma, detect=True,
                                correct=correct, plan=None, counters=c, cache_owner=o)
        for w, b, c, o in zip(weights, bs, counters, owners)], dim=-1)


@torch.library.custom_op("ftt::checked_linear_siblings", mutates_args=("step_counters",))
def _checked_linear_siblings_op(
    x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor], step_counters: torch.Tensor,
    slots: list[int], owners: list[int], emax: float | None, csigma: float, correct: bool,
    raise_uncorrectable: bool, names: str,
) -> torch.Tensor:
    """A sibling group's checked GEMMs as one opaque op for compiled graphs (no fault injection).

    Args:
        x: (..., K); weights: (N_i, K) each; biases: (N_i,) each, or empty.
        step_counters: (modules, sites, kinds) int32 counters of the step; rows ``slots`` are added into.
        owners: ``id`` of each layer (its weight checksums are cached on it).
        names: the layers' names, comma-separated (for `UncorrectableFaultError`; a newline in a string
            argument breaks inductor's generated code).
    Returns:
        y (..., ΣN_i) in x's dtype.
    """
    from .protect import _CACHE_OWNERS  # noqa: PLC0415 (protect imports this module)

    counters = [step_counters[s] for s in slots]
    y = _siblings_forward(x, weights, biases, counters, [_CACHE_OWNERS.get(o) for o in owners], emax, csigma,
                          correct)
    if raise_uncorrectable:
        for c, name in zip(counters, names.split(",")):
            EventRecorder.raise_if_uncorrectable(c, name)
    return y


@_checked_linear_siblings_op.register_fake
def _(x, weights, biases, step_counters, slots, owners, emax, csigma, correct, raise_uncorrectable, names):
    return x.new_empty((*x.shape[:-1], sum(w.shape[0] for w in weights)))


def _parent_forward(self: torch.nn.Module, *args, **kwargs):
    """Instance ``forward`` of a parent of siblings: their outputs first (when eligible), then the
    original forward, whose sibling calls take them."""
    grp: _SiblingGroup = self._ftt_siblings
    x = kwargs[grp.arg] if grp.arg in kwargs else (args[0] if args else None)
    if not grp.eligible(x):
        return grp.inner(*args, **kwargs)
    grp.pending = (x, grp.outputs(x))
    try:
        return grp.inner(*args, **kwargs)
    finally:
        grp.pending = None


def sibling_output(ctx, x: torch.Tensor) -> torch.Tensor | None:
    """The parked output of the layer with protection context ``ctx`` for input ``x``, or None."""
    grp = ctx.siblings
    if grp is None or grp.pending is None or grp.pending[0] is not x:
        return None
    return grp.pending[1][ctx.sibling_index]


def install_siblings(model: torch.nn.Module, adapter, install_forward) -> list[torch.nn.Module]:
    """Give the parents named by ``adapter.siblings`` whose members are all protected ``nn.Linear``
    layers (same settings, same in_features) the sibling forward; returns the parents patched.
    ``install_forward(module, fn)`` installs an instance forward (`protect._install_forward`)."""
    if not adapter.siblings or os.environ.get("FTT_SIBLINGS") == "0" or _kernels() is None:
        return []
    by_class = {cls: (arg, names) for cls, arg, names in adapter.siblings}
    patched = []
    for module in model.modules():
        spec = by_class.get(type(module).__name__)
        if spec is None:
            continue
        arg, names = spec
        members = [getattr(module, n, None) for n in names]
        ctxs = [getattr(m, "_ftt", None) for m in members]
        if any(type(m) is not torch.nn.Linear or c is None or not c.detect or c.layout != "nk" for m, c in
               zip(members, ctxs)):
            continue
        if len({m.weight.shape[1] for m in members}) != 1 or len({c.correct for c in ctxs}) != 1:
            continue
        hooked = hasattr(module, "_hf_hook") and "_old_forward" in module.__dict__
        inner = module._old_forward if hooked else module.__dict__.get("forward", types.MethodType(
            type(module).forward, module))
        grp = _SiblingGroup(members, ctxs, arg, inner)
        for i, c in enumerate(ctxs):
            c.siblings, c.sibling_index = grp, i
        module._ftt_siblings = grp
        install_forward(module, _parent_forward)
        patched.append(module)
    return patched
