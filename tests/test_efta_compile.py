"""The Triton EFTA kernel compiles for the H100 (sm_90) without a GPU.

Triton's frontend, its TritonGPU-to-LLVM lowering and the wheel's ``ptxas`` run on any machine, so
variants that only the GPU would otherwise compile are built here for ``sm_90``, specialised as a
call on aligned, contiguous tensors would be (``scripts/kernel_resources.py``). A bool padding mask
with the repair code compiled in crashed Triton's lowering (``where(mask != 0, s, -inf)`` on a
loaded mask) and stopped every masked model on the GPU: decode against a static cache, batched
generation with padding, BERT. The interpreter tests could not see it.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))

kernel_resources = pytest.importorskip("kernel_resources")


def _can_compile() -> str | None:
    import triton
    from ft_transformers.kernels import efta as K
    from ft_transformers.kernels.tl_common import runs_interpreted

    if runs_interpreted(K._efta_fwd):
        return "TRITON_INTERPRET=1: the kernels are interpreted, not compiled"
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    if not os.path.exists(os.path.join(bindir, "ptxas")):
        return f"the triton wheel has no ptxas in {bindir}"
    return None


_MASKED = [v for v in kernel_resources.VARIANTS if "bool mask" in v[0]]


@pytest.mark.parametrize("name,dtype,over,warps,stages", _MASKED, ids=[v[0] for v in _MASKED])
def test_compiles_for_sm90(name, dtype, over, warps, stages):
    why = _can_compile()
    if why:
        pytest.skip(why)
    compiled = kernel_resources.compile_variant(dtype, over, warps, stages, 90)
    assert compiled.asm.get("cubin"), name
    info = kernel_resources.ptxas_info(compiled.asm["ptx"])
    assert info, name
