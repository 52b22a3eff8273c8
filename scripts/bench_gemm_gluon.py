#!/usr/bin/env python
"""What a column-group check costs in the product's own epilogue: a Gluon GEMM, checked at three levels.

A floor study for the checked GEMM's next step (``docs/vabft.md``, "The cuBLAS form in the library": the
check in the product's epilogue at cuBLAS speed), not the library's kernel. `_gemm_kernel` computes
y = x·Wᵀ (x (M, K), W (N, K), fp16/bf16, fp32 accumulation) with a STAGES-deep TMA ring under mbarriers
and asynchronous wgmma (one MMA group kept in flight), one (BLOCK_M, BLOCK_N) tile per program, and adds:

* ``LEVEL`` 0 — nothing (the plain GEMM: compare with cuBLAS);
* ``LEVEL`` 1 — the checksum dot: x·Wcᵀ for the tile's column groups of 64, Wc holding each group's
  weight sum w1_g = Σ_{c∈g} W[c, :] as two slices (hi + lo in x's dtype, exact to about fp32), read as
  16 more weight rows per tile (one more wgmma of 16 columns per K step);
* ``LEVEL`` 2 — and the check in the epilogue: each row's group sums of the fp32 accumulator against
  the checksum, |Σ_{c∈g} y[r, c] − x_r·w1_g| ≤ τ·Σ_k |x[r, k]|·max_k Σ_{c∈g} |W[c, k]|, τ = 2·(K + 64)·2^−24 (a
  simplified bound with the shape of V-ABFT's: one FMA per row and group; x's absolute row sums come in
  precomputed), failing (row, group) pairs counted with one atomic per program.

The library's thresholds (e_max, the variance terms), its location and repair and its injection sites are
left out: each level is a lower bound for a kernel that carries them. Checksum operands and x's row sums are
made by PyTorch outside the timing.

    python scripts/bench_gemm_gluon.py --out /tmp/gemm_gluon          # Hopper GPU
    python scripts/bench_gemm_gluon.py --compile 128,256,64,3,8        # offline: sm_90a resources
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import write_rows  # noqa: E402
from _gluon import compile_offline as _compile  # noqa: E402
from _gluon import descriptor as _desc  # noqa: E402
from _gluon import tma_load as _tma_load  # noqa: E402
from ft_transformers.kernels.tl_common import cdiv  # noqa: E402

GROUP = 64  # columns per check group
CROWS = 16  # checksum rows per tile (2 slices × BLOCK_N / 64 groups, padded)
# (BLOCK_M, BLOCK_N, BLOCK_K, STAGES, warps): 64 rows per warp group
CONFIGS = [(128, 256, 64, 3, 8), (128, 128, 64, 4, 8), (128, 128, 64, 4, 4), (64, 128, 64, 4, 4)]


@gluon.jit
def _load(x_desc, w_desc, c_desc, x_s, w_s, c_s, bars, ki, m0, n0, tile_n, BLOCK_K: gl.constexpr,
          STAGES: gl.constexpr, LEVEL: gl.constexpr):
    """Request K step ``ki``'s tiles of x, W (and Wc) into slot ki % STAGES."""
    slot = ki % STAGES
    bar = bars.index(slot)
    nbytes: gl.constexpr = x_desc.block_type.nbytes + w_desc.block_type.nbytes
    if LEVEL >= 1:
        mbarrier.expect(bar, nbytes + c_desc.block_type.nbytes)
        _tma_load(c_desc, [tile_n * 16, ki * BLOCK_K], bar, c_s.index(slot))
    else:
        mbarrier.expect(bar, nbytes)
    _tma_load(x_desc, [m0, ki * BLOCK_K], bar, x_s.index(slot))
    _tma_load(w_desc, [n0, ki * BLOCK_K], bar, w_s.index(slot))


@gluon.jit
def _gemm_kernel(x_desc, w_desc, c_desc, Y, XABS, WABS, Bad, M, N, K, tau,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                 LEVEL: gl.constexpr, num_warps: gl.constexpr):
    """One program: the (BLOCK_M, BLOCK_N) tile (pid_m, pid_n) of y (M, N) (row-major, x's dtype). Wc
    (N / BLOCK_N · 16, K): tile t's rows 2g, 2g + 1 are group g's hi and lo slices; XABS (M,) Σ_k |x[r, k]|,
    WABS (N / 64,) max_k Σ_{c∈g} |W[c, k]| fp32; Bad (1,) int32: failing (row, group) pairs."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    c_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, 16, 16])
    dtype: gl.constexpr = x_desc.dtype
    pid_m = gl.program_id(0)
    pid_n = gl.program_id(1)
    m0 = pid_m * BLOCK_M
    n0 = pid_n * BLOCK_N
    num_k = gl.cdiv(K, BLOCK_K)

    x_s = gl.allocate_shared_memory(dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
    w_s = gl.allocate_shared_memory(dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    c_s = gl.allocate_shared_memory(dtype, [STAGES] + c_desc.block_type.shape, c_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    for i in gl.static_range(STAGES - 1):
        if i < num_k:
            _load(x_desc, w_desc, c_desc, x_s, w_s, c_s, bars, i, m0, n0, pid_n, BLOCK_K, STAGES, LEVEL)

    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
    cacc = gl.zeros([BLOCK_M, 16], gl.float32, c_layout)
    NG: gl.constexpr = 2 if LEVEL >= 1 else 1  # wgmma groups per K step
    for ki in range(num_k):
        slot = ki % STAGES
        mbarrier.wait(bars.index(slot), (ki // STAGES) & 1)
        acc = warpgroup_mma(x_s.index(slot), w_s.index(slot).permute((1, 0)), acc, is_async=True)
        if LEVEL >= 1:
            cacc = warpgroup_mma(x_s.index(slot), c_s.index(slot).permute((1, 0)), cacc, is_async=True)
        # this step's MMAs stay in flight; the previous step's are done, so its slot takes step ki + STAGES - 1
        acc, cacc = warpgroup_mma_wait(NG, deps=(acc, cacc))
        if ki + STAGES - 1 < num_k:
            _load(x_desc, w_desc, c_desc, x_s, w_s, c_s, bars, ki + STAGES - 1, m0, n0, pid_n, BLOCK_K, STAGES, LEVEL)
    acc, cacc = warpgroup_mma_wait(0, deps=(acc, cacc))
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))

    if LEVEL >= 2:  # the epilogue check, per row and group of 64 columns
        G: gl.constexpr = BLOCK_N // 64
        gs = gl.sum(gl.reshape(acc, [BLOCK_M, G, 64]), axis=2)  # (BLOCK_M, G)
        cs = gl.sum(gl.reshape(cacc, [BLOCK_M, 8, 2]), axis=2)  # hi + lo per group (first G of 8)
        cs = gl.convert_layout(cs, gl.BlockedLayout([1, 8], [32, 1], [num_warps, 1], [1, 0]))
        gs = gl.convert_layout(gs, gl.BlockedLayout([1, G], [32, 1], [num_warps, 1], [1, 0]))
        rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, gs.type.layout))
        grp = pid_n * G + gl.arange(0, G, layout=gl.SliceLayout(0, gs.type.layout))
        xa = gl.load(XABS + rows, mask=rows < M, other=0.0)
        wa = gl.load(WABS + grp)
        # the tile's G groups are cs's first G entries, the rest zero padding: folding 8 into (8 / G, G) and
        # summing the first axis leaves group g at g
        c_g = gl.sum(gl.reshape(cs, [BLOCK_M, 8 // G, G]), axis=1) if G < 8 else cs
        c_g = gl.convert_layout(c_g, gs.type.layout)
        bad = (gl.abs(gs - c_g) > tau * xa[:, None] * wa[None, :]) & (rows < M)[:, None]
        gl.atomic_add(Bad, gl.sum(gl.sum(bad.to(gl.int32), axis=1), axis=0))

    om = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
    on = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
    gl.store(Y + om[:, None].to(gl.int64) * N + on[None, :], acc.to(dtype), mask=(om < M)[:, None])


def checksum_operand(w: torch.Tensor, block_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Wc (N / block_n · 16, K) in w's dtype, tile t's rows 2g, 2g + 1 the hi and lo slices of its group g's
    weight sum, and WABS (N / 64,) fp32 max_k Σ_{c∈g} |W[c, k]| (the bound's weight factor)."""
    N, K = w.shape
    w1 = w.float().view(N // GROUP, GROUP, K).sum(1)  # (T_g, K)
    hi = w1.to(w.dtype)
    lo = (w1 - hi.float()).to(w.dtype)
    per = block_n // GROUP
    wc = torch.zeros(N // block_n, CROWS, K, dtype=w.dtype, device=w.device)
    wc[:, 0:2 * per:2] = hi.view(N // block_n, per, K)
    wc[:, 1:2 * per:2] = lo.view(N // block_n, per, K)
    wabs = w.float().abs().view(N // GROUP, GROUP, K).sum(1).amax(1)
    return wc.view(-1, K), wabs.contiguous()


def gluon_linear(x, w, wc, xabs, wabs, bad, level: int, cfg) -> torch.Tensor:
    """x (M, K), w (N, K) contiguous fp16/bf16, N a multiple of the config's BLOCK_N, K of 8; returns y (M, N)."""
    bm, bn, bk, stages, warps = cfg
    M, K = x.shape
    N = w.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    tau = 2.0 * (K + GROUP) * 2.0 ** -24
    _gemm_kernel[(cdiv(M, bm), N // bn)](
        _desc(x, [bm, bk]), _desc(w, [bn, bk]), _desc(wc, [CROWS, bk]), y, xabs, wabs, bad, M, N, K, tau,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, STAGES=stages, LEVEL=level, num_warps=warps)
    return y


def compile_offline(cfg, level: int, dtype: torch.dtype = torch.float16, arch: int = 90):
    """`_gemm_kernel` compiled for sm_{arch}a without a GPU (`_gluon.compile_offline`), specialised as
    `gluon_linear` launches it."""
    bm, bn, bk, stages, warps = cfg
    M, N, K = 512, 2 * bn, 512
    x, w = torch.empty(M, K, dtype=dtype), torch.empty(N, K, dtype=dtype)
    wc = torch.empty(N // bn * CROWS, K, dtype=dtype)
    args = dict(x_desc=_desc(x, [bm, bk]), w_desc=_desc(w, [bn, bk]), c_desc=_desc(wc, [CROWS, bk]),
                Y=torch.empty(M, N, dtype=dtype), XABS=torch.empty(M), WABS=torch.empty(N // GROUP),
                Bad=torch.empty(1, dtype=torch.int32), M=M, N=N, K=K, tau=0.1)
    consts = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, STAGES=stages, LEVEL=level, num_warps=warps)
    return _compile(_gemm_kernel, args, consts, arch)


# M × N × K: Qwen2-0.5B's layers at a 4k prefill, two squares, Qwen2-7B's at 4k
SHAPES = [(4096, 1152, 896), (4096, 896, 896), (4096, 9728, 896), (4096, 896, 4864), (2048, 2048, 2048),
          (4096, 4096, 4096), (4096, 4608, 3584), (4096, 37888, 3584), (4096, 3584, 18944)]


def run(args) -> list[dict]:
    import torch.nn.functional as F
    from triton.testing import do_bench

    rows = []
    for dt in args.dtypes.split(","):
        dtype = getattr(torch, dt)
        for M, N, K in SHAPES:
            g = torch.Generator(device="cuda").manual_seed(M + N + K)
            x = torch.randn(M, K, device="cuda", dtype=dtype, generator=g)
            w = (torch.randn(N, K, device="cuda", dtype=dtype, generator=g) / K ** 0.5).to(dtype)
            xabs = x.float().abs().sum(1).contiguous()
            ref = F.linear(x, w)
            fns = {"cublas": lambda x=x, w=w: F.linear(x, w)}
            row0 = dict(dtype=dt, M=M, N=N, K=K)
            out = []
            for level in (0, 1, 2):
                best = None
                for cfg in CONFIGS:
                    if N % cfg[1]:
                        continue
                    wc, wabs = checksum_operand(w, cfg[1])
                    bad = torch.zeros(1, dtype=torch.int32, device="cuda")
                    try:
                        fn = (lambda x=x, w=w, xabs=xabs, cfg=cfg, wc=wc, wabs=wabs, bad=bad, level=level:
                              gluon_linear(x, w, wc, xabs, wabs, bad, level, cfg))
                        t = do_bench(fn, warmup=10, rep=50)
                    except Exception as exc:  # noqa: BLE001 - out of resources: the next config
                        print(f"  {cfg} level {level}: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}")
                        continue
                    if best is None or t < best[0]:
                        best = (t, cfg, fn, wc, wabs, bad)
                if best is None:
                    continue
                _, cfg, fn, wc, wabs, bad = best
                y = fn()
                err = (y.float() - ref.float()).abs().max().item()
                bad.zero_()
                fn()
                clean_bad = int(bad.item())
                caught = -1
                if level == 2:  # one weight changed after its checksum was made stands for a fault in the product
                    w2 = w.clone()
                    w2[5, 7] += 1.0
                    bad.zero_()
                    gluon_linear(x, w2, wc, xabs, wabs, bad, level, cfg)
                    caught = int(bad.item())
                fns[f"gluon{level}"] = fn
                out.append(dict(row0, variant=f"gluon{level}", config=",".join(map(str, cfg)), max_abs_err=err,
                                flagged_clean=clean_bad, flagged_fault=caught))
            times = {n: [] for n in fns}
            for _ in range(args.rounds):  # interleaved rounds, each variant's median over them
                for n, f in fns.items():
                    times[n].append(do_bench(f, warmup=10, rep=50))
            tc = statistics.median(times["cublas"])
            base = dict(row0, variant="cublas", config="", max_abs_err=0.0, flagged_clean=0, flagged_fault=-1)
            for r in [base, *out]:
                t = statistics.median(times[r["variant"]])
                r.update(us=t * 1e3, x_cublas_throughput=tc / t)
                rows.append(r)
                print(f"{dt} {M}x{N}x{K} {r['variant']:7s} {r['us']:9.1f} us  {r['x_cublas_throughput']:.3f}x cuBLAS  "
                      f"{r['config']:16s} err {r['max_abs_err']:.1e} clean flags {r['flagged_clean']} "
                      f"fault flags {r['flagged_fault']}", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_gemm_gluon")
    ap.add_argument("--dtypes", default="float16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--compile", nargs="*", metavar="BM,BN,BK,STAGES,WARPS",
                    help="compile each config at levels 0-2 for sm_90a offline and print ptxas's resources")
    args = ap.parse_args()
    if args.compile is not None:
        from kernel_resources import ptxas_info
        for spec in args.compile or [",".join(map(str, c)) for c in CONFIGS]:
            cfg = tuple(int(v) for v in spec.split(","))
            for level in (0, 1, 2):
                c = compile_offline(cfg, level)
                print(spec, "level", level, "shared", c.metadata.shared, ptxas_info(c.asm["ptx"]))
        return 0
    if not torch.cuda.is_available():
        ap.error("needs a Hopper GPU (or --compile for the offline resources)")
    rows = run(args)
    os.makedirs(args.out, exist_ok=True)
    write_rows(os.path.join(args.out, "bench_gemm_gluon.csv"), rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
