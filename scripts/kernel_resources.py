#!/usr/bin/env python
"""Compile the EFTA kernel (or the checked GEMM) for a Hopper GPU without one: registers and spills.

Triton's frontend, LLVM and the ``ptxas`` bundled with the triton wheel run on any Linux machine,
so variants of the kernel (dtype, checks, block config, PASA, split-key decode, injection) can be
compiled for ``sm_90a`` here and compared by what ``ptxas -v`` says — registers per thread, stack
and spill bytes, shared memory — before spending GPU time on them. (Compile errors that only the
GPU toolchain would raise show up here too.) Spill bytes are a static count: spills inside the
rarely taken repair branches cost little at run time. Each variant also says whether ptxas
serialised its wgmma instructions (warning C7515: a wait after every one, which can cost the EFTA
loop 2.2× its time), which the installed ptxas may report differently from the GPU image's.

    python scripts/kernel_resources.py                      # the standard variants
    python scripts/kernel_resources.py --arch 90 --csv out.csv
    python scripts/kernel_resources.py --loops              # + instruction mix of each loop's body
    python scripts/kernel_resources.py --kernel gemm        # the checked GEMM's variants (GEMM_VARIANTS)

``--loops`` disassembles the cubin (the wheel's ``nvdisasm``) and prints, for every loop that
contains a tensor-core instruction, the size of its body, the shortest path through it (forward
branches taken: an interior key block skipping the mask selects) and its instruction mix: a static
proxy for the per-key-block cost of each variant (the clean key loop is the first one listed).
"""

from __future__ import annotations

import argparse
import collections
import csv
import os
import re
import subprocess
import sys
import tempfile
import time

import torch
import triton
from ft_transformers.kernels.abft_gemm import configs as gc
from ft_transformers.kernels.abft_gemm.checksum_tiles import CHECKSUM_SLICES
from ft_transformers.kernels.abft_gemm.decode import grouped_gemm_kernel
from ft_transformers.kernels.abft_gemm.groups import _group_verify_kernel
from ft_transformers.kernels.abft_gemm.persistent import _persistent_kernel
from ft_transformers.kernels.abft_gemm.product_check import _checksum_kernel, _product_check_kernel
from ft_transformers.kernels.abft_gemm.tile import _gemm_kernel
from ft_transformers.kernels.efta.kernel import _efta_fwd
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

POINTERS = {"Q": "in", "K": "in", "V": "in", "Out": "in", "KC": "in", "VC": "in", "KS": "*fp16", "Cnt": "*i32",
            "Flag": "*i32", "Inj": "*i32", "Bias": "*fp32", "Mask": "*fp32", "KA": "*fp32", "VA": "*fp32",
            "SC": "*fp32", "KC2": "*fp32", "W": "*fp32", "Rep": "*i32", "Arr": "*i32"}
FLOATS = {"scale", "gu", "exp_tol", "exp_base", "exp_xmin", "snvr_rel", "snvr_cap", "pasa_t1", "s_floor",
          "gamma", "gamma_last"}
BASE = dict(BLOCK_D=64, CAUSAL=True, HAS_WINDOW=False, HAS_BIAS=False, MASK_KIND=0, DETECT=True, CORRECT=True,
            INJ_S=0, INJ_MS=0, INJ_M=0, INJ_X=0, INJ_P=0, INJ_PL=0, INJ_A=0, INJ_L=0, INJ_ACC=0, INJ_MC=0, INJ_O=0,
            INJ_CS=0,
            NO_SKIP=False, PARTS=2, SCALE_CS=True, DOT_F32=False,
            INTERP=False, EVEN_D=True, SPLIT=False, PASA=False, HALF_STATE=False, PHASE=0, FOLD=True, PACK=False,
            KC2_TABLE=False, TMA=False, BLOCK_M=128, BLOCK_N=64)
FP = {"fp16": dict(PARTS=2, SCALE_CS=True), "bf16": dict(PARTS=3, SCALE_CS=False),
      "fp32": dict(PARTS=1, SCALE_CS=False, DOT_F32=True)}
# (name, dtype, overrides of BASE, num_warps, num_stages)
VARIANTS = [
    ("prefill checks off", "fp16", dict(DETECT=False, CORRECT=False, BLOCK_N=128), 8, 3),
    ("prefill detect", "fp16", dict(CORRECT=False), 8, 3),
    ("prefill detect+correct", "fp16", dict(PHASE=1), 8, 3),
    ("prefill detect+correct, repair launch", "fp16", dict(PHASE=2), 8, 3),
    ("prefill detect+correct, one launch", "fp16", dict(), 8, 3),
    ("prefill detect+correct", "bf16", dict(PHASE=1), 8, 3),
    ("prefill detect+correct D=128", "fp16", dict(BLOCK_D=128, PHASE=1), 8, 3),
    ("prefill detect+correct BM=64", "fp16", dict(BLOCK_M=64, PHASE=1), 4, 3),
    ("prefill PASA", "fp16", dict(PASA=True, PHASE=1, FOLD=False), 8, 3),
    ("prefill PASA fp16 state, no checks", "fp16",
     dict(PASA=True, HALF_STATE=True, DETECT=False, CORRECT=False, FOLD=False), 8, 3),
    ("decode split detect+correct", "fp16", dict(BLOCK_M=16, SPLIT=True), 4, 3),
    ("decode split detect+correct, bool mask", "fp16", dict(BLOCK_M=16, SPLIT=True, MASK_KIND=1), 4, 3),
    ("decode GQA packed, split detect+correct, bool mask", "fp16",
     dict(BLOCK_M=16, SPLIT=True, MASK_KIND=1, PACK=True), 4, 3),
    ("decode GQA packed, split detect+correct, bool mask, stored tables", "fp16",
     dict(BLOCK_M=16, SPLIT=True, MASK_KIND=1, PACK=True, KC2_TABLE=True), 4, 3),
    ("decode GQA packed, split checks off (merged in the launch), bool mask", "fp16",
     dict(BLOCK_M=16, SPLIT=True, MASK_KIND=1, PACK=True, DETECT=False, CORRECT=False), 4, 3),
    ("prefill detect+correct BM=64, bool mask", "fp16", dict(BLOCK_M=64, MASK_KIND=1, PHASE=1), 4, 3),
    ("prefill detect+correct, K and V through TMA descriptors, bool mask", "fp16",
     dict(TMA=True, MASK_KIND=1, PHASE=1), 8, 3),
    ("injection, all sites", "fp16", dict(INJ_S=1, INJ_MS=1, INJ_M=1, INJ_X=1, INJ_P=2, INJ_PL=2, INJ_A=1, INJ_L=1,
                                          INJ_ACC=1, INJ_MC=1, INJ_O=1, INJ_CS=1, NO_SKIP=True, BLOCK_M=64, PHASE=1,
                                          FOLD=False), 4, 2),
    ("prefill detect+correct", "fp32", dict(BLOCK_M=64, PHASE=1), 4, 3),
    ("prefill detect+correct D=128, wide clean launch", "fp16", dict(BLOCK_D=128, BLOCK_N=128, PHASE=1), 8, 2),
    ("prefill detect+correct, wide clean launch through TMA descriptors, causal", "bf16",
     dict(BLOCK_N=128, PHASE=1, TMA=True, CAUSAL=True), 8, 3),
]


# How the runtime specialises the integer arguments of a call on contiguous tensors with sizes that
# are multiples of 16 (Triton turns an int equal to 1 into a constant and marks one divisible by 16):
# last-dim strides and the counter block's inner stride are 1; no GQA and, unless SPLIT, no split
# (GROUP = nsplit = 1)
ONE = ("sqd", "skd", "svd", "sod", "cst1", "GROUP", "nsplit")
NOT_DIV16 = ("cst0", "window", "call_id", "nsplit", "sbb", "sbh", "sbm", "sbn", "smb", "smh", "smm", "smn")


def compile_variant(dtype: str, over: dict, num_warps: int, num_stages: int, arch: int):
    """Compile one variant as a call on aligned, contiguous tensors would specialise it: pointers
    and the other integer arguments divisible by 16 (without that, loads are scalar and the loop is
    not pipelined, which misstates registers and loop bodies)."""
    fn = _efta_fwd
    consts = {k: v for k, v in {**BASE, **FP[dtype], **over}.items() if k in fn.arg_names}
    consts.update({name: 1 for name in ONE if name in fn.arg_names and not (name == "nsplit" and consts["SPLIT"])})
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name in POINTERS:
            sig[name] = f"*{dtype}" if POINTERS[name] == "in" else POINTERS[name]
            if name == "Mask" and consts.get("MASK_KIND") == 1:
                sig[name] = "*u8"  # a bool mask reaches the kernel as its uint8 view
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "fp32" if name in FLOATS else "i32"
            if name not in FLOATS and name not in NOT_DIV16:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()},
                    attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps,
                                                                          "num_stages": num_stages})


# The checked GEMM's kernels, compiled as `kernels.abft_gemm.calls` launches them: the tile GEMM
# (`tile._gemm_kernel`), the group verification after it (`groups._group_verify_kernel`), the persistent
# GEMM (`persistent._persistent_kernel`), the decode kernel (`decode.grouped_gemm_kernel`) and the cuBLAS
# form's checksum programs and check (`product_check`).
GEMM_KERNELS = {"tile": _gemm_kernel, "verify": _group_verify_kernel, "persistent": _persistent_kernel,
                "decode": grouped_gemm_kernel, "checksums": _checksum_kernel, "check": _product_check_kernel}
# each kernel's constexprs before a variant's overrides; its config tuple's entries go to CFG_NAMES
GEMM_BASE = {
    "tile": dict(GROUP=gc.GROUP_M, HAS_BIAS=False, DETECT=True, VERIFY_OUTPUT=False, INJ=False, DOT_F32=False,
                 EVEN_K=True, TMA=False, W_KN=False, TMA_STORE=False, SPLIT=False, FUSED=False, CN=16, XVAR=False),
    "verify": dict(HAS_BIAS=False, CORRECT=True, DEBUG=False, DOT_F32=False, SPLIT=False, XVAR=False, FUSED=False),
    "persistent": dict(GROUP=gc.GROUP_M, NUM_SMS=132, HAS_BIAS=False, W_KN=False, VERIFY_OUTPUT=False, DOT_F32=False,
                       FUSED=False, CN=16, EVEN_K=True, XVAR=False),
    "decode": dict(ROWS=1, HAS_BIAS=False, VERIFY_OUTPUT=False, INJ=False, DOT_F32=False, EVEN_K=True,
                   CORRECT=True, SPLIT=False, SEGS=1, XVAR=False, MULTI=False),
    "checksums": dict(EVEN_K=True, DOT_F32=False, XVAR=False),
    "check": dict(REPAIR_K=gc.VERIFY_BLOCK[2], HAS_BIAS=False, CORRECT=True, DEBUG=False, DOT_F32=False, INJ=False,
                  VERIFY_OUTPUT=False, XVAR=False),
}
CFG_NAMES = {"tile": ("BLOCK_M", "BLOCK_N", "BLOCK_K"), "verify": ("BLOCK_R", "BLOCK_G", "BLOCK_K"),
             "persistent": ("BLOCK_M", "BLOCK_N", "BLOCK_K"), "decode": ("BLOCK_M", "G", "BLOCK_K"),
             "checksums": ("BLOCK_M", "CN", "BLOCK_K"), "check": ("BLOCK_R", "BLOCK_G")}
# the checksum operand's slices per dtype (`checksum_tiles.CHECKSUM_SLICES`), by this script's dtype names
SLICES = {name: CHECKSUM_SLICES[dt] for name, dt in (("fp16", torch.float16), ("bf16", torch.bfloat16),
                                                      ("fp32", torch.float32))}
# (name, kernel, dtype, (block sizes..., num_warps, num_stages), overrides of GEMM_BASE[kernel])
GEMM_VARIANTS = [
    # the tile GEMM: checks off at M <= 16 (checked fp16/bf16 decode calls take the decode kernel), with
    # split-K; the prefill config through TMA descriptors, with the group sums in its epilogue (a (N, K)
    # weight and a (K, N) one); fp32 in IEEE FMAs; the output-side sums; injection with a ragged K
    ("tile, decode-like plain", "tile", "fp16", gc.CONFIGS_SMALL[0], dict(DETECT=False)),
    ("tile, split-K plain", "tile", "bf16", gc.CONFIGS_SMALL[0], dict(DETECT=False, SPLIT=True)),
    ("tile, prefill TMA, group sums", "tile", "fp16", gc.CONFIGS_LARGE[0], dict(TMA=True, TMA_STORE=True)),
    ("tile, prefill TMA, W (K, N), bias", "tile", "bf16", gc.CONFIGS_LARGE[0],
     dict(TMA=True, TMA_STORE=True, W_KN=True, HAS_BIAS=True)),
    ("tile, fp32 IEEE dots, group sums", "tile", "fp32", gc.CONFIGS_FP32[0], dict(DOT_F32=True)),
    ("tile, output-side group sums, bias", "tile", "bf16", gc.CONFIGS_MID[0], dict(VERIFY_OUTPUT=True, HAS_BIAS=True)),
    ("tile, injection, ragged K", "tile", "fp16", gc.CONFIG_INJECT, dict(INJ=True, HAS_BIAS=True, EVEN_K=False)),
    # the checksum programs in the GEMM's launch (`checksum_tiles`): 2 slices of 896 columns, 3 of 4864
    ("tile, prefill TMA, checksum tiles", "tile", "fp16", gc.CONFIGS_LARGE[0],
     dict(TMA=True, TMA_STORE=True, FUSED=True, CN=32)),
    ("tile, checksum tiles, outlier estimate", "tile", "bf16", gc.CONFIGS_LARGE[1],
     dict(FUSED=True, CN=128, XVAR=True)),
    ("persistent, checksum tiles", "persistent", "fp16", gc.PERSISTENT_CONFIG, dict(FUSED=True, CN=128)),
    ("verify, checksum tiles' partials", "verify", "fp16", gc.VERIFY_BLOCK, dict(FUSED=True)),
    ("verify, checksum tiles' partials, outlier estimate", "verify", "bf16", gc.VERIFY_BLOCK,
     dict(FUSED=True, XVAR=True)),
    # the group verification: the checksum operand in 2 (fp16), 3 (bf16) or 1 (fp32, IEEE) slices of x's
    # dtype; unsplit and split over K; detection only; the debug record
    ("verify, 2 slices", "verify", "fp16", gc.VERIFY_BLOCK, {}),
    ("verify, 3 slices, bias", "verify", "bf16", gc.VERIFY_BLOCK, dict(HAS_BIAS=True)),
    ("verify, 1 slice, IEEE dots", "verify", "fp32", gc.VERIFY_BLOCK, dict(DOT_F32=True)),
    ("verify, 2 slices, split-K", "verify", "fp16", gc.VERIFY_BLOCK, dict(SPLIT=True)),
    ("verify, 3 slices, split-K", "verify", "bf16", gc.VERIFY_BLOCK, dict(SPLIT=True)),
    ("verify, 1 slice, IEEE dots, split-K", "verify", "fp32", gc.VERIFY_BLOCK, dict(DOT_F32=True, SPLIT=True)),
    ("verify, 2 slices, detection only", "verify", "fp16", gc.VERIFY_BLOCK, dict(CORRECT=False)),
    ("verify, 3 slices, debug record", "verify", "bf16", gc.VERIFY_BLOCK, dict(DEBUG=True)),
    # the cuBLAS form's: its checksum programs (2 slices of 896 columns, 3 of 4864, on the side stream) and its
    # check (y made from cuBLAS's fp32 product: bias, rounding, injection); short-prompt and long blocks
    ("cuBLAS form checksums, 2 slices", "checksums", "fp16", (64, 32, 64, 4, 3), {}),
    ("cuBLAS form checksums, 3 slices, outlier estimate", "checksums", "bf16", (64, 128, 64, 4, 3),
     dict(XVAR=True)),
    ("cuBLAS form check, 2 slices, bias", "check", "fp16", (16, 1, 4, 1), dict(HAS_BIAS=True)),
    ("cuBLAS form check, 3 slices, injection", "check", "bf16", (16, 8, 8, 1), dict(INJ=True)),
    ("cuBLAS form check, long, output-side sums", "check", "fp16", (64, 2, 8, 1), dict(VERIFY_OUTPUT=True)),
    ("cuBLAS form check, long, outlier estimate", "check", "bf16", (64, 1, 4, 1), dict(XVAR=True)),
    # x's outlier variance estimate (XVAR: the sum of squares beside sum, max and min)
    ("verify, outlier estimate", "verify", "fp16", gc.VERIFY_BLOCK, dict(XVAR=True)),
    ("verify, outlier estimate, split-K", "verify", "bf16", gc.VERIFY_BLOCK, dict(XVAR=True, SPLIT=True)),
    ("verify, outlier estimate, IEEE dots, split-K", "verify", "fp32", gc.VERIFY_BLOCK,
     dict(XVAR=True, DOT_F32=True, SPLIT=True)),
    # the persistent GEMM (132 programs: an H100 SXM's SMs)
    ("persistent", "persistent", "fp16", gc.PERSISTENT_CONFIG, {}),
    ("persistent, W (K, N), bias, output-side", "persistent", "bf16", gc.PERSISTENT_CONFIG,
     dict(W_KN=True, HAS_BIAS=True, VERIFY_OUTPUT=True)),
    # the decode kernel (one 64-column group per program, checked in its epilogue)
    ("decode kernel, M = 1", "decode", "fp16", gc.CONFIGS_GROUPED[0], {}),
    ("decode kernel, BLOCK_K 256, split-K, bias", "decode", "bf16", gc.CONFIGS_GROUPED[1],
     dict(SPLIT=True, HAS_BIAS=True)),
    ("decode kernel, M = 16", "decode", "fp16", gc.CONFIGS_GROUPED[0], dict(ROWS=16)),
    ("decode kernel, detection only", "decode", "bf16", gc.CONFIGS_GROUPED[0], dict(CORRECT=False)),
    ("decode kernel, injection, ragged K", "decode", "fp16", gc.CONFIGS_GROUPED[0], dict(INJ=True, EVEN_K=False)),
    ("decode kernel, output-side check", "decode", "bf16", gc.CONFIGS_GROUPED[1], dict(VERIFY_OUTPUT=True)),
    ("decode kernel, 3 sibling weights, bias", "decode", "fp16", gc.CONFIGS_GROUPED[0], dict(SEGS=3, HAS_BIAS=True)),
    ("decode kernel, 2 sibling weights, M = 16, split-K", "decode", "bf16", gc.CONFIGS_GROUPED[0],
     dict(SEGS=2, ROWS=16, SPLIT=True)),
    ("decode kernel, outlier estimate, M = 1", "decode", "fp16", gc.CONFIGS_GROUPED[0], dict(XVAR=True)),
    ("decode kernel, outlier estimate, M = 16, split-K, bias", "decode", "bf16", gc.CONFIGS_GROUPED[1],
     dict(XVAR=True, ROWS=16, SPLIT=True, HAS_BIAS=True)),
    ("decode kernel, row blocks", "decode", "fp16", gc.CONFIGS_GROUPED[0], dict(ROWS=16, MULTI=True)),
    ("decode kernel, row blocks, split-K, injection", "decode", "bf16", gc.CONFIGS_GROUPED[0],
     dict(ROWS=16, MULTI=True, SPLIT=True, INJ=True)),
]
# pointer arguments: in x's dtype (the descriptors Xd, Wd, Yd too, without TMA), int32 (counters, cells,
# injection tables), fp32 (group sums, partials, checksum constants)
_GEMM_DATA = {"X", "W", "Y", "Xd", "Wd", "Yd", "Bias", "W_b", "W_c", "Bias_b", "Bias_c", "Wc"}
_GEMM_I32 = {"Inj", "Sem", "Flag", "Cnt", "Cnt_b", "Cnt_c"}
_GEMM_F32 = {"P", "Part", "Winv", "Gc", "Dbg", "W1g", "Gc_b", "Gc_c", "W1g_b", "W1g_c"}
_GEMM_FLOATS = {"inv_k", "emax", "csigma", "reverify_scale"}
_GEMM_INTS_1 = ("sxk", "swk", "syn", "scn1")  # unit inner strides (contiguous x, W, y, counters)
# integers that are not multiples of 16 (or are not specialised: call_id, and the verification's w_finite)
_GEMM_NOT_DIV16 = ("call_id", "w_finite", "scn0", "n_split", "kb_per", "t_b", "t_c", "TG", "NC", "c_split", "c_kb_per",
                   "n_csplit", "ldc")


def compile_gemm_variant(kernel: str, dtype: str, cfg: tuple, over: dict, arch: int):
    """Compile one of the checked GEMM's kernels (``kernel``: a key of GEMM_KERNELS) as a call on contiguous,
    16-byte aligned tensors would specialise it: unit inner strides, and the integers the runtime turns into
    constants when they are 1 (a call without split-K has ``n_split`` = 1, the tile GEMM's ``kb_per`` then
    too; the decode kernel's ``M`` at M = 1 and its ``w_finite`` on a finite weight). TMA: descriptors of the
    config's block shapes; a W (K, N) has its strides swapped (``swn`` = 1)."""
    fn = GEMM_KERNELS[kernel]
    *blocks, warps, stages = cfg[:5]
    consts = {**GEMM_BASE[kernel], **over, **dict(zip(CFG_NAMES[kernel], blocks))}
    if kernel in ("verify", "check"):
        consts["SLICES"] = SLICES[dtype]
    kn = bool(consts.get("W_KN"))  # a (K, N) weight: its unit stride is swn
    ones = [n for n in _GEMM_INTS_1 if not (kn and n == "swk")] + ["swn"] * kn
    if not consts.get("SPLIT"):
        ones += ["n_split"] + (["kb_per"] if kernel == "tile" else [])
    if kernel == "decode":
        ones += ["w_finite"] + (["M"] if consts["ROWS"] == 1 else [])
    consts.update({n: 1 for n in ones if n in fn.arg_names})
    bm, bn, bk = (*blocks, 1, 1)[:3]
    tma_blocks = {"Xd": (bm, bk), "Wd": (bk, bn) if kn else (bn, bk), "Yd": (bm, bn)}
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name in tma_blocks and consts.get("TMA"):
            sig[name] = f"tensordesc<{dtype}[{tma_blocks[name][0]},{tma_blocks[name][1]}]>"
        elif name in _GEMM_DATA or name in _GEMM_I32 or name in _GEMM_F32:
            sig[name] = f"*{dtype}" if name in _GEMM_DATA else "*i32" if name in _GEMM_I32 else "*fp32"
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in _GEMM_FLOATS:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if name not in _GEMM_NOT_DIV16:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()},
                    attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps,
                                                                          "num_stages": stages})


def ptxas_info(ptx: str) -> dict:
    """Registers, stack and spill bytes from ``ptxas -v`` (the newest ptxas in the triton wheel)."""
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    found = [os.path.join(bindir, n) for n in ("ptxas-blackwell", "ptxas") if os.path.exists(os.path.join(bindir, n))]
    ptxas = found[0] if found else None
    if ptxas is None:
        return {}
    target = re.search(r"^\.target\s+(\S+)", ptx, re.M).group(1)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        out = subprocess.run([ptxas, f"-arch={target}", "-v", f.name, "-o", os.devnull], capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    text = out.stderr + out.stdout
    grab = lambda pat: int(m.group(1)) if (m := re.search(pat, text)) else -1  # noqa: E731
    return {"registers": grab(r"Used (\d+) registers"), "stack": grab(r"(\d+) bytes stack frame"),
            "spill_stores": grab(r"(\d+) bytes spill stores"), "spill_loads": grab(r"(\d+) bytes spill loads"),
            # ptxas C7515: it could not keep the wgmma pipeline and serialised every wgmma (a wait after
            # each one), which can cost the EFTA loop 2.2x its time
            "wgmma_serialized": "C7515" in text}


def loop_census(cubin: bytes) -> list[tuple[int, collections.Counter, int]]:
    """(body size, opcode counts, shortest path) of every backward-branch loop with an HGMMA/HMMA, in
    code order (`sass_loops` on the cubin's disassembly)."""
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        sass = subprocess.run([os.path.join(bindir, "nvdisasm"), "-c", f.name], capture_output=True,
                              text=True).stdout
    finally:
        os.unlink(f.name)
    return sass_loops(sass)


def sass_loops(sass: str) -> list[tuple[int, collections.Counter, int]]:
    """Loops of an ``nvdisasm -c`` listing: for every backward branch whose body holds a tensor-core
    instruction, (body size, opcode counts, shortest path). The shortest path skips the regions that
    forward conditional branches inside the body jump over (the outermost ones): the instructions a
    loop iteration issues when every such branch is taken, e.g. an interior key block that jumps
    over the mask selects, or a clean block that jumps over the repair code."""
    label_at: dict[str, int] = {}
    ops: list[str] = []
    targets: dict[int, str] = {}  # index of a branch -> its target label
    conditional: set[int] = set()
    for line in sass.splitlines():
        if m := re.match(r"^\s*(\.L_x_\d+):", line):
            label_at[m.group(1)] = len(ops)
        elif m := re.search(r"/\*[0-9a-f]{4,}\*/\s+(.*?);", line):
            text = m.group(1)
            op = re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]
            if op == "BRA" and (t := re.search(r"(\.L_x_\d+)", text)):
                targets[len(ops)] = t.group(1)
                if text.startswith("@"):
                    conditional.add(len(ops))
            ops.append(op)
    loops = []
    for i, target in targets.items():
        start = label_at.get(target, i + 1)
        if start > i:
            continue
        body = collections.Counter(ops[start:i + 1])
        if not body["HGMMA"] + body["HMMA"]:
            continue
        skipped, reach = 0, start  # outermost forward skips inside [start, i]
        for j in range(start, i):
            end = label_at.get(targets.get(j, ""), -1)
            if j in conditional and j >= reach and j < end <= i:
                skipped += end - j - 1
                reach = end
        loops.append((start, i - start + 1, body, i - start + 1 - skipped))
    return [(n, c, short) for _, n, c, short in sorted(loops, key=lambda t: t[0])]


LOOP_OPS = ("HGMMA", "HMMA", "MUFU", "FFMA", "FADD", "FMUL", "FSETP", "LOP3", "SHFL", "BAR", "STS", "LDS", "LDSM",
            "LDG", "STL", "LDL")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability ×10 (90: Hopper)")
    ap.add_argument("--csv", default=None)
    ap.add_argument("--loops", action="store_true", help="also print each loop body's instruction mix")
    ap.add_argument("--only", default="", help="comma-separated substrings: compile only the variants whose "
                    "'name [dtype]' contains one of them")
    ap.add_argument("--kernel", choices=("efta", "gemm"), default="efta",
                    help="EFTA's variants (VARIANTS) or the checked GEMM's (GEMM_VARIANTS)")
    args = ap.parse_args()
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    rows = []
    only = [w for w in args.only.split(",") if w]
    if args.kernel == "gemm":
        todo = [(name, dtype, (kernel, cfg, over), cfg[-2], cfg[-1])  # (cfg ends with warps, stages)
                for name, kernel, dtype, cfg, over in GEMM_VARIANTS]
    else:
        todo = VARIANTS
    for name, dtype, over, nw, ns in todo:
        if only and not any(w in f"{name} [{dtype}]" for w in only):
            continue
        t0 = time.time()
        try:
            if args.kernel == "gemm":
                c = compile_gemm_variant(over[0], dtype, *over[1:], args.arch)
            else:
                c = compile_variant(dtype, over, nw, ns, args.arch)
        except Exception as exc:  # report and go on: a compile error is a finding
            print(f"FAIL {name} [{dtype}]: {type(exc).__name__}: {str(exc)[:200]} ... {str(exc)[-400:]}", flush=True)
            rows.append(dict(variant=name, dtype=dtype, error=type(exc).__name__))
            continue
        info = ptxas_info(c.asm["ptx"])
        row = dict(variant=name, dtype=dtype, num_warps=nw, num_stages=ns, shared=c.metadata.shared,
                   compile_s=round(time.time() - t0, 1), **info)
        rows.append(row)
        print(f"{name:32s} [{dtype}] warps {nw}: {info.get('registers')} regs, spill stores "
              f"{info.get('spill_stores')} B, loads {info.get('spill_loads')} B, shared {c.metadata.shared} B"
              + (", WGMMA SERIALISED (ptxas C7515)" if info.get("wgmma_serialized") else ""), flush=True)
        if args.loops:
            for n, body, short in loop_census(c.asm["cubin"]):
                print(f"    loop body {n} instructions (shortest path {short}): "
                      + ", ".join(f"{k} {body[k]}" for k in LOOP_OPS if body[k]), flush=True)
    if args.csv:
        keys = sorted({k for r in rows for k in r}, key=lambda k: list(rows[0]).index(k) if k in rows[0] else 99)
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(rows)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
