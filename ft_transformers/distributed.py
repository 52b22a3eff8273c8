"""torch.distributed and transformers' tensor parallelism, as protection sees them.

transformers shards a model with ``from_pretrained(..., tp_plan="auto")`` (or
``distributed_config=DistributedConfig(tp_plan="auto")``) under ``torchrun``: each planned parameter becomes
a ``DTensor`` holding this rank's shard, and each planned module's ``forward`` is replaced, on the instance,
by a closure of its parallel style (``TensorParallelLayer.install_forward``'s ``tp_forward``) that

1. makes the input local (a colwise Linear reads the replicated input; a rowwise one its slice of the
   features),
2. swaps the module's ``DTensor`` parameters for their local shards for the duration of the call (a rowwise
   Linear's bias is hidden: it is added once, after the reduction),
3. calls the module's own forward (``original_forward``, captured when the plan was applied),
4. finishes the output: a colwise output stays this rank's slice of the features (or is gathered), a
   rowwise partial product is all-reduced over the tensor-parallel group and the bias added.

Protection replaces step 3 only (`tp_forward_of`, `with_inner_forward`): the checked GEMM runs on the local
shard with the local input, so a rowwise partial product is verified on the rank that computed it, before
the all-reduce mixes it with the other ranks'. Attention needs nothing: the attention module reshapes the
colwise projections into its local heads, and EFTA runs on those. The one-launch sibling GEMMs
(`ft_transformers.siblings`) read the same local shards, for the members whose shards hold whole rows of
their weight (`whole_rows`: colwise).

The rest is what reports need: this process's `rank` and an all-gather of picklable objects (`gather`),
called only when a report over every rank is asked for, never on the hot path.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["gather", "is_sharded", "local_shard", "rank", "tp_forward_of", "whole_rows", "with_inner_forward",
           "world_size"]

# The name under which transformers' TP forward holds the module's own forward (its closure variable).
_INNER = "original_forward"


def _initialized() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def rank() -> int:
    """This process's rank in the default process group (0 when torch.distributed is not initialised)."""
    return torch.distributed.get_rank() if _initialized() else 0


def world_size() -> int:
    """The number of ranks of the default process group (1 when torch.distributed is not initialised)."""
    return torch.distributed.get_world_size() if _initialized() else 1


def gather(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order: a collective over the default group, which every
    rank must call. ``[obj]`` when torch.distributed is not initialised.

    Over NCCL the objects travel through the current CUDA device (``torch.cuda.set_device``, which
    transformers' tensor-parallel loading does)."""
    if not _initialized():
        return [obj]
    out: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


@functools.cache  # (read on every protected call of a sharded model)
def _dtensor_type() -> type | None:
    if not torch.distributed.is_available():
        return None
    try:
        from torch.distributed.tensor import DTensor  # noqa: PLC0415 (absent from builds without distributed)
    except ImportError:
        return None
    return DTensor


def is_sharded(t: object) -> bool:
    """Whether ``t`` is a ``DTensor`` (a tensor-parallel parameter, whatever its placement)."""
    dt = _dtensor_type()
    return dt is not None and isinstance(t, dt)


def local_shard(t: torch.Tensor | None) -> torch.Tensor | None:
    """The tensor a local kernel reads for ``t``, the same object on every call.

    A ``DTensor`` gives its local shard. A plain tensor that is a view of its whole base (same storage
    offset, shape, strides and dtype) gives the base: recent torch hands a ``Parameter(DTensor)``'s shard out
    as a fresh such view on every ``to_local()`` (to mark it a Parameter), and the weight-checksum cache,
    keyed by the tensor's identity, would otherwise be rebuilt on every call. Anything else is returned as is.
    """
    if t is None:
        return None
    if is_sharded(t):
        return t._local_tensor
    if torch.compiler.is_compiling():
        # dynamo traces no data pointer and AOT tracing keeps no ``_base``; the compiled graph hands the checked
        # op the shard itself, whose checksum cache entry it keeps (tests/test_tensor_parallel.py)
        return t
    base = t._base
    if (base is not None and base.dtype == t.dtype and base.shape == t.shape and base.stride() == t.stride()
            and base.data_ptr() == t.data_ptr()):
        return base
    return t


def whole_rows(t: torch.Tensor | None) -> bool:
    """Whether this rank's shard of ``t`` is a block of whole rows of it: a plain tensor (or None), or a
    ``DTensor`` split along dim 0 only (``Shard(0)`` on every dimension of its mesh).

    A colwise Linear's weight (N, K) and bias (N,) are: transformers' colwise forward hands the module's own
    forward exactly these local shards, bias included, so a product computed from them outside that forward
    is the one the forward computes. A rowwise weight (``Shard(1)``, its bias hidden during the call) or a
    replicated one is not."""
    if not is_sharded(t):
        return True
    return all(p.is_shard() and p.dim % t.dim() == 0 for p in t.placements)


def tp_forward_of(module: torch.nn.Module) -> Callable | None:
    """transformers' tensor-parallel forward installed on ``module`` (its instance ``forward``), or None.

    Recognised by its form, not its name: a Python function whose closure holds ``module`` and the module's
    own forward bound to it (``original_forward``). Any other instance forward is not transformers' TP one.
    """
    fn = module.__dict__.get("forward")
    if not isinstance(fn, types.FunctionType) or fn.__closure__ is None:
        return None
    cells = dict(zip(fn.__code__.co_freevars, fn.__closure__))
    cell, owner = cells.get(_INNER), cells.get("module")
    if cell is None or owner is None:
        return None
    try:
        inner, held = cell.cell_contents, owner.cell_contents
    except ValueError:  # an empty cell
        return None
    if held is not module or getattr(inner, "__self__", None) is not module:
        return None
    return fn


def with_inner_forward(tp_forward: Callable, inner: Callable) -> Callable:
    """A copy of transformers' TP forward ``tp_forward`` (`tp_forward_of`) that calls ``inner`` where the
    original calls the module's own forward; its input, parameter and output handling stay transformers'.

    ``inner(x)`` runs with local inputs and the module's parameters swapped for their local shards (a
    rowwise layer's bias hidden until after the reduction). The original is left untouched, so restoring
    it undoes this."""
    code = tp_forward.__code__
    cells = tuple(types.CellType(inner) if name == _INNER else cell
                  for name, cell in zip(code.co_freevars, tp_forward.__closure__))
    fn = types.FunctionType(code, tp_forward.__globals__, tp_forward.__name__, tp_forward.__defaults__, cells)
    fn.__kwdefaults__ = tp_forward.__kwdefaults__
    fn.__qualname__ = tp_forward.__qualname__
    fn.__doc__ = tp_forward.__doc__
    return fn
