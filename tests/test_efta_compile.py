"""The Triton EFTA kernel compiles for the H100 (sm_90) without a GPU.

Triton's frontend, its TritonGPU-to-LLVM lowering and the wheel's ``ptxas`` run on any machine, so
variants that only the GPU would otherwise compile are built here for ``sm_90``, specialised as a
call on aligned, contiguous tensors would be (``scripts/kernel_resources.py``). A bool padding mask
with the repair code compiled in crashed Triton's lowering (``where(mask != 0, s, -inf)`` on a
loaded mask) and stopped every masked model on the GPU: decode against a static cache, batched
generation with padding, BERT. The interpreter tests could not see it.

Each compile runs in a fresh process without ``TRITON_INTERPRET``: other test files of the session
set it before triton is imported, after which triton only interprets.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPTS = os.path.join(os.path.dirname(__file__), "..", "scripts")
sys.path.insert(0, SCRIPTS)

kernel_resources = pytest.importorskip("kernel_resources")

_MASKED = [v for v in kernel_resources.VARIANTS if "bool mask" in v[0]]

_COMPILE = """
import os, sys, triton
sys.path.insert(0, {scripts!r})
bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
if not os.path.exists(os.path.join(bindir, "ptxas")):
    print("SKIP: the triton wheel has no ptxas in", bindir)
    sys.exit(0)
import kernel_resources as kr
name, dtype, over, warps, stages = kr.VARIANTS[{index}]
compiled = kr.compile_variant(dtype, over, warps, stages, 90)
info = kr.ptxas_info(compiled.asm["ptx"])
assert compiled.asm.get("cubin") and info.get("registers", -1) > 0, (name, info)
print("OK", name, info)
"""


@pytest.mark.parametrize("variant", _MASKED, ids=[v[0] for v in _MASKED])
def test_compiles_for_sm90(variant):
    index = kernel_resources.VARIANTS.index(variant)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE.format(scripts=os.path.abspath(SCRIPTS), index=index)],
                          env=env, capture_output=True, text=True, timeout=600)
    if proc.stdout.startswith("SKIP"):
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0 and proc.stdout.startswith("OK"), (proc.stdout[-2000:] + proc.stderr[-4000:])
