"""Sibling checked GEMMs: the Linear layers that read one input, checked in one launch on the GPU.

A Llama/Qwen2 attention block computes ``q_proj(h)``, ``k_proj(h)`` and ``v_proj(h)`` from the same
``h``, its MLP ``gate_proj(x)`` and ``up_proj(x)``. In a decode step each of these is a small GEMM
(M = batch rows) whose time is mostly the launch and the weight read, so protection runs them as one
launch of the decode kernel (`kernels.abft_gemm.checked_gemm_siblings`): every weight keeps its own
storage, checksums and counters, so events stay attributed to ``q_proj``, ``k_proj`` and ``v_proj``.

How it is wired, without rewriting transformers' forwards: the parent module (the attention block,
the MLP) takes a subclass of its class while protected (`_parent_class`; under an accelerate hook, the
hook's inner forward instead) whose forward computes the siblings' outputs first, parks them on its
`_SiblingGroup` (``pending``), and calls the original forward; each sibling's checked forward
returns its parked slice when it is called with that very input tensor (``x is h``), and runs its
own checked GEMM otherwise. ``torch.compile`` traces through this (the group is one opaque op,
``ftt::checked_linear_siblings``). Calls that the one-launch kernel does not take (more than
``SIBLINGS_MAX_ROWS`` rows — prefill —, fp32, CPU, autocast, grad, active fault injection, non-finite
weights) run each sibling as before.

Under transformers' tensor parallelism the members are this rank's colwise shards: each member's TP forward
hands its own forward the replicated input unchanged and its parameters swapped for their local shards,
and keeps the output local (`ft_transformers.distributed`). The group then reads the members' local shards
(`distributed.local_shard`; its sizes are the local row counts), so the slice a member receives is what
its own checked forward on its shard would return, and transformers' closure finishes it as before. A
member whose shard does not hold whole rows of its weight (rowwise, replicated: `distributed.whole_rows`)
keeps the parent out of the grouping.

``Options.siblings`` off (``FTT_SIBLINGS=0``, read by `enable_fault_tolerance`) leaves the parents alone: one
launch per layer.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence
from typing import NamedTuple

import torch

from ._states import CACHE_OWNERS as _CACHE_OWNERS
from ._states import GROUPS, KEYS, STATES, STATIC, static_of, step_block
from .checked_linear import _TRITON_FAILED, _autocast_dtype, _checked_linear_forward
from .distributed import is_sharded, local_shard, whole_rows
from .events import EventRecorder
from .kernels.options import options
from .vabft import gemm_emax, weight_checksums

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


class _SiblingStatic(NamedTuple):
    """A sibling group's settings, read by traced code as one constant (`_states.static_of`)."""

    names: tuple[str, ...]  # the layers' attribute names on the parent, in output order
    arg: str  # the parent forward's name for the shared input ("hidden_states", "x")
    k: int  # in_features
    sizes: tuple[int, ...]  # out_features of each layer (of its local shard under tensor parallelism)
    state_key: int  # the model's `_states.STATES` key
    max_rows: int  # the kernel's row limit (`abft_gemm.SIBLINGS_MAX_ROWS`)
    on_cpu: bool  # run on CPU too (tests, under the interpreter)
    sharded: bool  # a layer's parameters are DTensors: read their local shards


class _SiblingGroup:
    """The protected Linear layers of one parent module that read the same input: the mutable part.

    Its settings are a `_SiblingStatic` under the same key. Traced code reaches the layers through the
    parent (``getattr(parent, name)``, the path the parent's own forward takes) and the group through
    `_states.GROUPS`: an object reached along two paths costs an identity guard on every call of the
    compiled model (`_states`).

    Attributes:
        pending: ``(h, outputs)`` while the parent's forward runs with precomputed outputs, else None.
    """

    def __init__(self) -> None:
        self.pending: tuple[torch.Tensor, Sequence[torch.Tensor]] | None = None


def _parameters(gs: _SiblingStatic, members: Sequence[torch.nn.Module]
                ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The members' weights (N_i, K) and their biases (N_i,) (empty without), as each member's own checked
    forward reads them: on a sharded model this rank's local shards, which transformers' colwise forward
    swaps in for the call (the same tensors, so the same weight-checksum cache entries)."""
    if not gs.sharded:
        return [m.weight for m in members], [m.bias for m in members if m.bias is not None]
    return ([local_shard(m.weight) for m in members],
            [local_shard(m.bias) for m in members if m.bias is not None])


def _eligible(gs: _SiblingStatic, x: object, weights: Sequence[torch.Tensor]) -> bool:
    """Whether this call of the parent runs its siblings in one launch (host metadata only); ``weights``
    from `_parameters`."""
    if STATES[gs.state_key].active_faults or not isinstance(x, torch.Tensor):
        return False
    if gs.sharded and torch.is_grad_enabled():
        # transformers' colwise forward passes the input on unchanged, with local shards, only with grad off
        return False
    dev = x.device
    if not (dev.type == "cuda" or gs.on_cpu):
        return False
    if x.dtype not in _DTYPES16 or x.dtype in _TRITON_FAILED or x.dim() < 1 or x.shape[-1] != gs.k:
        return False
    rows = x.numel() // gs.k
    if not 0 < rows <= gs.max_rows or _autocast_dtype(dev.type) is not None:
        return False
    if torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights)):
        return False
    return all(w.dtype == x.dtype and w.device == dev for w in weights)


def _outputs(gs: _SiblingStatic, x: torch.Tensor, members: Sequence[torch.nn.Module],
             weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The members' outputs for input x (..., K): views (..., N_i) of one (..., ΣN_i) tensor; ``weights``
    (N_i, K) and ``biases`` (N_i,) from `_parameters`."""
    cfg = STATES[gs.state_key].config
    sts = [static_of(m._ftt.key) for m in members]
    correct = sts[0].correct
    if torch.compiler.is_compiling():
        y = torch.ops.ftt.checked_linear_siblings(
            x, weights, biases, step_block(sts[0], x.device), [st.index for st in sts], [id(m) for m in members],
            cfg.emax, float(cfg.csigma), correct, cfg.on_uncorrectable == "raise", ",".join(st.name for st in sts))
    else:
        ctxs = [m._ftt for m in members]
        counters = [c.counters(x.device) for c in ctxs]
        y = _siblings_forward(x, weights, biases, counters, members, cfg.emax, float(cfg.csigma), correct)
        for c, cnt in zip(ctxs, counters):
            c.after_call(cnt)
    return list(y.split(gs.sizes, dim=-1))


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
            y = G.siblings_forward(x2d, weights, bs, wcs, counters, emax, gemm_emax, csigma, correct)
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


def _parent_forward(self: torch.nn.Module, inner, args: tuple, kwargs: dict):
    """The forward of a parent of siblings: their outputs first (when eligible), then ``inner(*args,
    **kwargs)`` (its original forward), whose sibling calls take them."""
    key = self._ftt_sibling_key
    gs = static_of(key)
    x = kwargs[gs.arg] if gs.arg in kwargs else (args[0] if args else None)
    members = [getattr(self, n) for n in gs.names]
    weights, biases = _parameters(gs, members)
    if not _eligible(gs, x, weights):
        return inner(*args, **kwargs)
    grp = GROUPS[key]
    grp.pending = (x, _outputs(gs, x, members, weights, biases))
    try:
        return inner(*args, **kwargs)
    finally:
        grp.pending = None


def _hooked_parent_forward(self: torch.nn.Module, *args, **kwargs):
    """A parent's forward under an accelerate hook (the hook's inner ``_old_forward``)."""
    return _parent_forward(self, self._ftt_inner_forward, args, kwargs)


def sibling_output(st, x: torch.Tensor) -> torch.Tensor | None:
    """The parked output of the layer with settings ``st`` (`_states.Static`) for input ``x``, or None."""
    if st.sibling_key is None:
        return None
    grp = GROUPS[st.sibling_key]
    if grp.pending is None or grp.pending[0] is not x:
        return None
    return grp.pending[1][st.sibling_index]


_PARENT_CLASSES: dict[type, type] = {}


def _parent_class(base: type) -> type:
    """The subclass of a parent's class whose ``forward`` runs `_parent_forward` around the class's own
    (made once per class and kept in this module's namespace, so that a protected model pickles)."""
    cls = _PARENT_CLASSES.get(base)
    if cls is None:
        def forward(self, *args, **kwargs):
            return _parent_forward(self, functools.partial(base.forward, self), args, kwargs)

        name = f"_Siblings{base.__name__}"
        cls = type(name, (base,), {"forward": forward, "_ftt_base": base, "__module__": __name__,
                                   "__doc__": f"``{base.__name__}`` while protected (`ft_transformers.siblings`)."})
        globals()[name] = _PARENT_CLASSES[base] = cls
    return cls


def install_siblings(model: torch.nn.Module, adapter, install_forward) -> list[torch.nn.Module]:
    """Give the parents named by ``adapter.siblings`` whose members are all protected ``nn.Linear``
    layers (same settings, same in_features) the sibling forward; returns the parents patched.
    ``install_forward(module, fn, swap)`` installs it (`protect._install_forward`).

    Under tensor parallelism sizes and in_features are those of the members' local shards, and a parent
    takes part only if every member's shard holds whole rows of its weight and bias (colwise:
    `distributed.whole_rows`)."""
    G = _kernels()
    if not adapter.siblings or not options().siblings or G is None:
        return []
    by_class = {cls: (arg, names) for cls, arg, names in adapter.siblings}
    patched = []
    for module in model.modules():
        spec = by_class.get(type(module).__name__)
        if spec is None or "forward" in module.__dict__:
            continue
        arg, names = spec
        members = [getattr(module, n, None) for n in names]
        ctxs = [getattr(m, "_ftt", None) for m in members]
        if any(not isinstance(m, torch.nn.Linear) or c is None or not c.detect or c.layout != "nk" for m, c in
               zip(members, ctxs)):
            continue
        params = [t for m in members for t in (m.weight, m.bias)]
        if not all(whole_rows(t) for t in params):
            continue
        weights = [local_shard(m.weight) for m in members]
        if len({w.shape[1] for w in weights}) != 1 or len({c.correct for c in ctxs}) != 1:
            continue
        key = next(KEYS)
        STATIC[key] = _SiblingStatic(tuple(names), arg, int(weights[0].shape[1]),
                                     tuple(int(w.shape[0]) for w in weights), ctxs[0].state_key,
                                     G.SIBLINGS_MAX_ROWS, _ON_CPU and G.interpreting(),
                                     any(is_sharded(t) for t in params))
        GROUPS[key] = _SiblingGroup()
        for i, c in enumerate(ctxs):
            c.sibling_key, c.sibling_index = key, i
            c.publish()
        module._ftt_sibling_key = key
        install_forward(module, _hooked_parent_forward, _parent_class(type(module)))
        patched.append(module)
    return patched

