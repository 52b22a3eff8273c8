"""What the Gluon studies share (`efta_gluon_floor.py`, `bench_gemm_gluon.py`): the TMA load under its name in
the installed Triton, host tensor descriptors with the default shared layout, and compiling a Gluon kernel for
``sm_{arch}a`` without a GPU (Triton's frontend, LLVM and the wheel's ptxas), specialised as a launch on the
given arguments would be.

Scripts import it as a top-level module (``from _gluon import ...``), as `_common`.
"""

from __future__ import annotations

import torch
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

__all__ = ["compile_offline", "descriptor", "tma_load", "tma_store"]

# the TMA copies' names: `async_copy_global_to_shared` / `async_copy_shared_to_global` in Triton 3.6 (the GPU
# image's), `async_load` / `async_store` from 3.7 on
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
_GL = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}


def descriptor(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    """A host TMA descriptor of the 2-D fp16/bf16 tensor ``t`` in tiles of ``block``, default swizzled layout."""
    return TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, _GL[t.dtype]))


def compile_offline(fn, args: dict, consts: dict, arch: int = 90):
    """``fn`` (a `gluon.jit` kernel) compiled for ``sm_{arch}a`` with the runtime arguments ``args`` (name →
    a value of the launch's kind: CPU tensors stand for device ones) and the constexprs ``consts`` (with
    ``num_warps``); returns the compiled kernel (``.asm["ptx"]``, ``.asm["cubin"]``, ``.metadata``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    sig = {k: mangle_type(v) for k, v in args.items()} | {k: "constexpr" for k in consts}
    src = GluonASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": consts["num_warps"]})
