"""The Triton kernels (EFTA, the checked GEMM) compile for the H100 (sm_90) without a GPU.

Triton's frontend, its TritonGPU-to-LLVM lowering and the wheel's ``ptxas`` run on any machine, so
variants that only the GPU would otherwise compile are built here for ``sm_90``, specialised as a
call on aligned, contiguous tensors would be (``scripts/kernel_resources.py``). A bool padding mask
with the repair code compiled in can crash Triton's lowering (``where(mask != 0, s, -inf)`` on a
loaded mask), which stops every masked model on the GPU: decode against a static cache, batched
generation with padding, BERT. The interpreter tests cannot see it. The wide clean launch (128-key
blocks, two checksum blocks each: 3-D group sums and a block-diagonal operand) is compiled too.

The checked GEMM's kernels (the tile GEMM, the group verification, the persistent GEMM and the decode
kernel, in the variants of ``kernel_resources.GEMM_VARIANTS``: dtypes, checksum slices, split-K, TMA
descriptors, injection, sibling weights) are compiled the same way, with the installed Triton, every
variant of one kernel in one process. The GPU image has Triton 3.6, whose passes differ: a loop of reductions
whose results have two uses each fails 3.6's thread-locality pass for fp32 and compiles with 3.9.
For such version-specific failures run the script against a 3.6 wheel (``pip install --target DIR
triton==3.6.0 --no-deps``, then ``PYTHONPATH=DIR python scripts/kernel_resources.py --kernel gemm``).

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

_COMPILED = [v for v in kernel_resources.VARIANTS if "bool mask" in v[0] or "wide" in v[0]]

_COMPILE = """
import os, sys, triton
sys.path.insert(0, {scripts!r})
bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
if not os.path.exists(os.path.join(bindir, "ptxas")):
    print("SKIP: the triton wheel has no ptxas in", bindir)
    sys.exit(0)
import kernel_resources as kr
{body}
info = kr.ptxas_info(compiled.asm["ptx"])
assert compiled.asm.get("cubin") and info.get("registers", -1) > 0, (name, info)
print("OK", name, info)
"""


def _compile_in_subprocess(body: str) -> None:
    """Run ``body`` (which sets ``name`` and ``compiled``) in a fresh interpreter; skip without ptxas."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = _COMPILE.format(scripts=os.path.abspath(SCRIPTS), body=body)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    if proc.stdout.startswith("SKIP"):
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0 and proc.stdout.startswith("OK"), (proc.stdout[-2000:] + proc.stderr[-4000:])


@pytest.mark.parametrize("variant", _COMPILED, ids=[v[0] for v in _COMPILED])
def test_compiles_for_sm90(variant):
    index = kernel_resources.VARIANTS.index(variant)
    _compile_in_subprocess(f"name, dtype, over, warps, stages = kr.VARIANTS[{index}]\n"
                           "compiled = kr.compile_variant(dtype, over, warps, stages, 90)")


_GEMM_COMPILE = """
failed = []
for name, kernel, dtype, cfg, over in kr.GEMM_VARIANTS:
    if kernel != {kernel!r}:
        continue
    try:
        c = kr.compile_gemm_variant(kernel, dtype, cfg, over, 90)
        info = kr.ptxas_info(c.asm["ptx"])
        assert c.asm.get("cubin") and info.get("registers", -1) > 0, info
    except Exception as exc:
        failed.append(f"{{name}} [{{dtype}}]: {{type(exc).__name__}}: {{str(exc)[-1500:]}}")
assert not failed, failed
name, compiled = "all of " + {kernel!r}, c
"""


@pytest.mark.parametrize("kernel", list(kernel_resources.GEMM_KERNELS))
def test_gemm_compiles_for_sm90(kernel):
    """Every variant of one of the checked GEMM's kernels compiles to a cubin with registers counted."""
    assert any(v[1] == kernel for v in kernel_resources.GEMM_VARIANTS)
    _compile_in_subprocess(_GEMM_COMPILE.format(kernel=kernel))


_GLUON_FLOOR = r"""
import efta_gluon_floor as g
# the checked sequential kernel at D = 128 (causal) and with one clamp at D = 64, and the unchecked pipelined
# one at D = 64: explicit asynchronous wgmma (the pipelined wait keeps one group in flight), no spills
for spec, one_clamp in (((128, 64, 128, 8, True, 3, 0), False), ((64, 128, 64, 4, False, 3, 0), True),
                        ((64, 64, 64, 4, False, 0, 1), False)):
    c = g.compile_offline(*spec, one_clamp=one_clamp)
    info = kr.ptxas_info(c.asm["ptx"])
    assert "wgmma.mma_async" in c.asm["ptx"] and info["spill_stores"] == 0, (spec, info)
assert "wgmma.wait_group.sync.aligned 1" in c.asm["ptx"], "the pipelined schedule waits for GEMM I only"
import bench_gemm_gluon as gg
# the checked GEMM's floor: with its checksum as a second MMA per K step (level 2), and merged into the
# product's MMA (level 3: no second MMA), both without spills
two = gg.compile_offline((128, 256, 64, 3, 8), 2)
c = gg.compile_offline((128, 256, 64, 3, 8), 3)
n2, n3 = (k.asm["ptx"].count("wgmma.mma_async") for k in (two, c))
assert n3 < n2, (n2, n3)
for k in (two, c):
    assert kr.ptxas_info(k.asm["ptx"])["spill_stores"] == 0
name, compiled = "Gluon floors", c
"""


def test_gluon_floor_compiles_for_sm90():
    """`scripts/efta_gluon_floor.py` and `scripts/bench_gemm_gluon.py` (the attention and checked-GEMM floors
    in Gluon, studies run only on Hopper GPUs) keep compiling with the installed Triton, the attention's
    pipelined schedule keeping GEMM II in flight."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    _compile_in_subprocess(_GLUON_FLOOR)


_VERIFY_BUFFERS = r"""
import re
slots = {}
for name, kernel, dtype, cfg, over in kr.GEMM_VARIANTS:
    if kernel != "verify" or over.get("DOT_F32") or over.get("FUSED"):  # (FUSED: no check loop, it sums partials)
        continue
    c = kr.compile_gemm_variant(kernel, dtype, cfg, dict(over, CORRECT=False), 90)
    ttgir = c.asm["ttgir"]
    assert "isAsync = true" in ttgir, name  # asynchronous wgmma: what a shallow buffer races with
    depths = re.findall(r"ttg.local_alloc[^\n]*-> !ttg.memdesc<(\d+)x\d+x\d+x", ttgir)
    slots[name + " [" + dtype + "]"] = sorted({int(d) for d in depths})
assert slots and all(len(v) == 1 for v in slots.values()), slots
name, compiled = "verify check loops", c
"""


def test_verify_check_loop_buffers_share_one_depth():
    """The verification's check loop (`groups._row_stats_and_checksums`, every tensor-core variant, repair
    compiled out) stages x's tile and the checksum slices in shared-memory buffers of one depth. Triton's
    pipeliner gave x's tile one slot fewer while the tile also fed x's row statistics, with the wgmmas left
    pending across the next copy: the copy for block i + 2 overwrote the tile block i's wgmma still read, and
    the checksum came out wrong in a few units on an H100 (docs/reliability.md, "The verification's checksum,
    computed wrong in a few units"). (The checksum programs in the GEMM's launch, `checksum_tiles`, reduce a
    plain load of x of their own, never the staged tile.)"""
    _compile_in_subprocess(_VERIFY_BUFFERS)


_SASS = """
        /*0000*/                   MOV R0, RZ ;
.L_x_0:
        /*0010*/                   HGMMA.64x64x16.F32 R8, gdesc[UR4], RZ ;
        /*0020*/              @!P1 BRA `(.L_x_1) ;
        /*0030*/                   FSEL R1, R2, R3, P0 ;
        /*0040*/                   FSEL R1, R2, R3, P0 ;
        /*0050*/               @P3 BRA `(.L_x_2) ;
        /*0060*/                   FSEL R1, R2, R3, P0 ;
.L_x_2:
        /*0070*/                   ISETP.GE.AND P0, PT, R4, R5, PT ;
.L_x_1:
        /*0080*/                   FADD R1, R1, R2 ;
        /*0090*/               @P2 BRA `(.L_x_0) ;
.L_x_3:
        /*00a0*/                   FADD R1, R1, R2 ;
        /*00b0*/               @P2 BRA `(.L_x_3) ;
        /*00c0*/                   EXIT ;
"""


def test_sass_loops_counts_body_and_shortest_path():
    """A loop of 9 instructions whose forward branch skips 5 (the nested one inside that region does not
    count again); a second loop without a tensor-core instruction is not listed."""
    [(size, ops, shortest)] = kernel_resources.sass_loops(_SASS)
    assert size == 9 and shortest == 4
    assert ops["HGMMA"] == 1 and ops["FSEL"] == 3 and ops["BRA"] == 3 and ops["ISETP"] == 1
