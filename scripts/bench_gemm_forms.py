"""Forms of a Triton GEMM on the GPU, and what each piece of a checksum check's extra work costs in them.

A study for issue 4 (``docs/vabft.md``), not the library's kernel: the plain GEMM
``y = x·Wᵀ + b`` (fp16, W stored (N, K)) in several forms, then the persistent TMA form with one
piece of a V-ABFT row check added at a time, each timed as a CUDA-graph replay against cuBLAS
(``F.linear``) in interleaved rounds (`_timing.interleaved`: every variant once per round, the
order rotated), median µs and the ratio to cuBLAS of the same run. Variants (names in the CSV):

* ``tiles``      — one program per output tile, pointer loads, grouped order (the form of
  `kernels.abft_gemm.tile` without TMA);
* ``persistent`` — one program per SM looping over the tiles, pointer loads;
* ``tma``        — persistent, operands through TMA descriptors made in the kernel
  (``tl.make_tensor_descriptor``), y stored through one; ``tma_flat`` the same with the tile and K
  loops flattened into one software pipeline (``tl.range(..., flatten=True)``, as
  `kernels.abft_gemm.persistent` runs it);
* ``tma_rowsums`` — ``tma_flat`` plus a row check's epilogue: bias, the two fp32 row partial sums per
  tile (``Σ_n v``, ``Σ_n (n+1)/N·v``) stored to a (T, M, 2) buffer;
* ``tma_share``  — ``tma_rowsums`` plus a checksum share inside the K loop: in the K blocks
  ``kb ≡ pid_n (mod T)`` the tile reloads its x block through pointers and accumulates ``x·w1``,
  ``x·w2`` and x's row max / min / sum in fp32 on the CUDA cores;
* ``tma_csumdot`` — ``tma_rowsums`` plus a second tensor-core dot per K step, x against a 16-column
  checksum operand (what ``x·w1``, ``x·w2`` and ``Σx`` would be in slices of the input dtype);
* ``tma_regstats`` — ``tma_rowsums`` plus x's row max / min taken from the loaded x tile in
  registers (Triton 3.6 gave wrong y with the flattened loop: reported as ``wrong``);
* ``stats_pass`` — a separate kernel (`_stats_pass_kernel`) reading x once for ``x·w1``, ``x·w2`` and
  max / min / sum per row, and ``tma_rowsums+stats`` both launches.

The library's persistent form runs none of these pieces beside its GEMM: its epilogue stores the
64-column group sums, and `kernels.abft_gemm.groups._group_verify_kernel` reads x itself in a launch
after it (x's statistics and the group checksums on the tensor cores).

Every output is compared with ``F.linear``'s (``max_err``); a variant off by more than 0.05 is marked
``wrong`` and not timed. Needs a Hopper GPU (TMA), Triton ≥ 3.4.

    python scripts/bench_gemm_forms.py --out /tmp/forms
    python scripts/bench_gemm_forms.py --shapes 2048x2048x2048 --variants tma_flat,tma_rowsums --out /tmp/f
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import interleaved  # noqa: E402

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the script needs a GPU with triton
    sys.exit("bench_gemm_forms.py needs triton")

# the library's grouped tile order
from ft_transformers.kernels.abft_gemm.common import _grouped_tile  # noqa: E402

# Qwen2-0.5B's prefill GEMMs at 4,096 tokens (q/o, k/v, gate/up, down) and the squares
SHAPES = [(4096, 896, 896), (4096, 128, 896), (4096, 4864, 896), (4096, 896, 4864), (2048, 2048, 2048),
          (4096, 4096, 4096)]
CONFIGS = [(128, 256, 64, 8, 3), (128, 128, 64, 4, 4), (128, 128, 64, 8, 4)]  # BM, BN, BK, warps, stages
VARIANTS = ("tiles", "persistent", "tma", "tma_flat", "tma_rowsums", "tma_share", "tma_csumdot", "tma_regstats",
            "stats_pass", "tma_rowsums+stats")
GROUP = 8
STATS_ROWS, STATS_CHUNK = 8, 256  # `_stats_pass_kernel`: rows per program, columns of x per K step


@triton.jit
def _tiles_kernel(X, W, Y, B, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr):
    """One program per (BM, BN) tile of y (M, N); x (M, K), W (N, K), b (N,); K a multiple of BK."""
    pid_m, pid_n = _grouped_tile(tl.program_id(0), tl.cdiv(M, BM), tl.cdiv(N, BN), GROUP)
    om = pid_m * BM + tl.arange(0, BM)
    on = pid_n * BN + tl.arange(0, BN)
    ok = tl.arange(0, BK)
    a_p = X + (om % M)[:, None] * K + ok[None, :]
    b_p = W + (on % N)[None, :] * K + ok[:, None]
    acc = tl.zeros((BM, BN), tl.float32)
    for _ in range(0, tl.cdiv(K, BK)):
        acc = tl.dot(tl.load(a_p), tl.load(b_p), acc)
        a_p += BK
        b_p += BK
    acc += tl.load(B + on, mask=on < N, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + om[:, None] * N + on[None, :], acc.to(Y.dtype.element_ty), mask=(om < M)[:, None] & (on < N)[None, :])


@triton.jit
def _persistent_kernel(X, W, Y, B, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       GROUP: tl.constexpr, NUM_SMS: tl.constexpr):
    """`_tiles_kernel`'s tiles, NUM_SMS programs each looping over every NUM_SMS-th tile."""
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    ok = tl.arange(0, BK)
    for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_SMS):
        pid_m, pid_n = _grouped_tile(tile, num_pid_m, num_pid_n, GROUP)
        om = pid_m * BM + tl.arange(0, BM)
        on = pid_n * BN + tl.arange(0, BN)
        am = tl.max_contiguous(tl.multiple_of(om % M, BM), BM)
        bn = tl.max_contiguous(tl.multiple_of(on % N, BN), BN)
        acc = tl.zeros((BM, BN), tl.float32)
        for kb in range(tl.cdiv(K, BK)):
            kk = kb * BK + ok
            acc = tl.dot(tl.load(X + am[:, None] * K + kk[None, :]), tl.load(W + bn[None, :] * K + kk[:, None]), acc)
        acc += tl.load(B + on, mask=on < N, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + om[:, None] * N + on[None, :], acc.to(Y.dtype.element_ty),
                 mask=(om < M)[:, None] & (on < N)[None, :])


@triton.jit
def _tma_kernel(X, W, Y, B, C, W12, P, S, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                GROUP: tl.constexpr, NUM_SMS: tl.constexpr, FLAT: tl.constexpr, ROWSUMS: tl.constexpr,
                SHARE: tl.constexpr, CSUMDOT: tl.constexpr, REGSTATS: tl.constexpr):
    """Persistent TMA GEMM with the optional pieces of the checks (see the module docstring).

    C (16, K) fp16: the checksum operand of CSUMDOT; W12 (K, 2) fp32: w1, w2 of SHARE; P (T, M, 2) and
    S (T, M, 8) fp32: the row partial sums and the statistics (x·w1, x·w2, max, min, sum)."""
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    xd = tl.make_tensor_descriptor(X, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
    wd = tl.make_tensor_descriptor(W, shape=[N, K], strides=[K, 1], block_shape=[BN, BK])
    yd = tl.make_tensor_descriptor(Y, shape=[M, N], strides=[N, 1], block_shape=[BM, BN])
    cd = tl.make_tensor_descriptor(C, shape=[16, K], strides=[K, 1], block_shape=[16, BK])
    ok = tl.arange(0, BK)
    for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_SMS, flatten=FLAT):
        pid_m, pid_n = _grouped_tile(tile, num_pid_m, num_pid_n, GROUP)
        om = pid_m * BM + tl.arange(0, BM)
        m_ok = om < M
        acc = tl.zeros((BM, BN), tl.float32)
        cacc = tl.zeros((BM, 16), tl.float32)
        c1 = tl.zeros((BM,), tl.float32)
        c2 = tl.zeros((BM,), tl.float32)
        sm = tl.zeros((BM,), tl.float32)
        mx = tl.full((BM,), -float("inf"), tl.float32)
        mn = tl.full((BM,), float("inf"), tl.float32)
        mxv = tl.full((BM, BK), -float("inf"), X.dtype.element_ty)
        mnv = tl.full((BM, BK), float("inf"), X.dtype.element_ty)
        for kb in range(tl.cdiv(K, BK)):
            a = xd.load([pid_m * BM, kb * BK])
            acc = tl.dot(a, wd.load([pid_n * BN, kb * BK]).T, acc)
            if CSUMDOT:
                cacc = tl.dot(a, cd.load([0, kb * BK]).T, cacc)
            if REGSTATS:
                mxv = tl.maximum(mxv, a)
                mnv = tl.minimum(mnv, a)
            if SHARE:
                if kb % num_pid_n == pid_n:
                    kk = kb * BK + ok
                    af = tl.load(X + (om % M)[:, None] * K + kk[None, :]).to(tl.float32)
                    c1 += tl.sum(af * tl.load(W12 + kk * 2)[None, :], axis=1)
                    c2 += tl.sum(af * tl.load(W12 + kk * 2 + 1)[None, :], axis=1)
                    sm += tl.sum(af, axis=1)
                    mx = tl.maximum(mx, tl.max(af, axis=1))
                    mn = tl.minimum(mn, tl.min(af, axis=1))
        on = pid_n * BN + tl.arange(0, BN)
        acc += tl.load(B + on, mask=on < N, other=0.0).to(tl.float32)[None, :]
        if ROWSUMS:
            prow = P + (pid_n * M + om) * 2
            tl.store(prow, tl.sum(acc, axis=1), mask=m_ok)
            tl.store(prow + 1, tl.sum(acc * ((on + 1).to(tl.float32) / N)[None, :], axis=1), mask=m_ok)
        srow = S + (pid_n * M + om) * 8
        if SHARE:
            tl.store(srow, c1, mask=m_ok)
            tl.store(srow + 1, c2, mask=m_ok)
            tl.store(srow + 2, mx, mask=m_ok)
            tl.store(srow + 3, mn, mask=m_ok)
            tl.store(srow + 4, sm, mask=m_ok)
        if CSUMDOT:  # columns 0, 2, 4, 6, 8, 10, 12, 14 of the checksum product
            f = tl.arange(0, 16)
            tl.store(srow[:, None] + f[None, :] // 2, cacc, mask=m_ok[:, None] & (f[None, :] % 2 == 0))
        if REGSTATS:
            tl.store(srow + 2, tl.max(mxv, axis=1).to(tl.float32), mask=m_ok)
            tl.store(srow + 3, tl.min(mnv, axis=1).to(tl.float32), mask=m_ok)
        yd.store([pid_m * BM, pid_n * BN], acc.to(Y.dtype.element_ty))


@triton.jit
def _stats_pass_kernel(X, W12, S, M, K, R: tl.constexpr, CK: tl.constexpr):
    """One pass over x (M, K), R rows per program, x read once in CK-column chunks: ``x·w1``, ``x·w2``
    (W12 (K, 2) fp32), x's row max, min and sum in fp32 into slots 0-4 of S (M, 8) fp32."""
    rows = tl.program_id(0) * R + tl.arange(0, R)
    r_ok = rows < M
    offs = tl.arange(0, CK)
    c1 = tl.zeros((R,), tl.float32)
    c2 = tl.zeros((R,), tl.float32)
    sm = tl.zeros((R,), tl.float32)
    mx = tl.full((R,), -float("inf"), tl.float32)
    mn = tl.full((R,), float("inf"), tl.float32)
    for k0 in range(0, K, CK):
        kk = k0 + offs
        k_ok = kk < K
        ok = r_ok[:, None] & k_ok[None, :]
        xf = tl.load(X + rows[:, None] * K + kk[None, :], mask=ok, other=0.0).to(tl.float32)
        c1 += tl.sum(xf * tl.load(W12 + kk * 2, mask=k_ok, other=0.0)[None, :], axis=1)
        c2 += tl.sum(xf * tl.load(W12 + kk * 2 + 1, mask=k_ok, other=0.0)[None, :], axis=1)
        sm += tl.sum(xf, axis=1)
        mx = tl.maximum(mx, tl.max(tl.where(ok, xf, -float("inf")), axis=1))
        mn = tl.minimum(mn, tl.min(tl.where(ok, xf, float("inf")), axis=1))
    srow = S + rows * 8
    tl.store(srow, c1, mask=r_ok)
    tl.store(srow + 1, c2, mask=r_ok)
    tl.store(srow + 2, mx, mask=r_ok)
    tl.store(srow + 3, mn, mask=r_ok)
    tl.store(srow + 4, sm, mask=r_ok)


def _alloc(size: int, align: int, stream) -> torch.Tensor:
    """Global scratch for the in-kernel TMA descriptors (`triton.set_allocator`)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


# the TMA form's switches per variant: (FLAT, ROWSUMS, SHARE, CSUMDOT, REGSTATS)
_TMA_FLAGS = {"tma": (False, False, False, False, False), "tma_flat": (True, False, False, False, False),
              "tma_rowsums": (True, True, False, False, False), "tma_share": (True, True, True, False, False),
              "tma_csumdot": (True, True, False, True, False), "tma_regstats": (True, True, False, False, True),
              "tma_rowsums+stats": (True, True, False, False, False)}


def make_variant(name: str, cfg: tuple[int, ...], x: torch.Tensor, w: torch.Tensor, b: torch.Tensor,
                 y: torch.Tensor, sms: int):
    """A no-argument function running variant ``name`` with config ``cfg`` (BM, BN, BK, warps, stages)
    on x (M, K), w (N, K), b (N,) into y (M, N) (``stats_pass`` leaves y alone), with ``sms``
    persistent programs. Its ``buffers`` attribute holds the operands and outputs of the checks'
    pieces: ``w12`` (K, 2), ``c`` (16, K), ``p`` (T, M, 2), ``s`` (T, M, 8), ``s_rows`` (M, 8)."""
    if name not in VARIANTS:
        raise ValueError(f"unknown variant {name!r}; choose from {VARIANTS}")
    bm, bn, bk, nw, ns = cfg
    m, k = x.shape
    n = w.shape[0]
    t = triton.cdiv(n, bn)
    dev = x.device
    buffers = dict(w12=torch.randn(k, 2, device=dev), c=(torch.randn(16, k, device=dev) * 0.01).to(x.dtype),
                   p=torch.zeros(t, m, 2, device=dev), s=torch.zeros(t, m, 8, device=dev),
                   s_rows=torch.zeros(m, 8, device=dev))
    w12, c, p, s, s_rows = buffers.values()
    grid_tiles = (triton.cdiv(m, bm) * t,)
    grid_sms = (min(sms, grid_tiles[0]),)
    opts = dict(num_warps=nw, num_stages=ns)

    def run():
        if name == "tiles":
            _tiles_kernel[grid_tiles](x, w, y, b, m, n, k, bm, bn, bk, GROUP, **opts)
        elif name == "persistent":
            _persistent_kernel[grid_sms](x, w, y, b, m, n, k, bm, bn, bk, GROUP, sms, **opts)
        elif name in _TMA_FLAGS:
            _tma_kernel[grid_sms](x, w, y, b, c, w12, p, s, m, n, k, bm, bn, bk, GROUP, sms, *_TMA_FLAGS[name],
                                  **opts)
        if name in ("stats_pass", "tma_rowsums+stats"):
            _stats_pass_kernel[(triton.cdiv(m, STATS_ROWS),)](x, w12, s_rows, m, k, R=STATS_ROWS, CK=STATS_CHUNK,
                                                              num_warps=4)
    run.buffers = buffers
    return run


def bench_shape(m: int, n: int, k: int, variants: list[str], configs: list[tuple[int, ...]], rounds: int,
                rep: int) -> list[dict]:
    """Rows (variant, config, µs, ratio to cuBLAS, max error, status) of one shape, fp16."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.float16, generator=g)
    w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).half()
    b = torch.randn(n, device="cuda", dtype=torch.float16, generator=g)
    ref = F.linear(x, w, b)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    fns = {"cublas": lambda: F.linear(x, w, b)}
    rows = {}
    for v in variants:
        for cfg in configs if v != "stats_pass" else configs[:1]:
            key = v if v == "stats_pass" else f"{v}@{','.join(map(str, cfg))}"
            y = ref.clone() if v == "stats_pass" else torch.empty_like(ref)
            row = rows[key] = {"M": m, "N": n, "K": k, "variant": v, "config": "" if v == "stats_pass" else cfg}
            try:
                fn = make_variant(v, cfg, x, w, b, y, sms)
                fn()
                torch.cuda.synchronize()
            except triton.runtime.errors.OutOfResources as exc:
                row["status"] = f"no: {str(exc)[:60]}"
                continue
            row["max_err"] = float((y.float() - ref.float()).abs().max())
            row["status"] = "wrong" if row["max_err"] > 0.05 else "ok"
            if row["status"] == "ok":
                fns[key] = fn
    times = interleaved(fns, rounds, lambda fn: 1e3 * triton.testing.do_bench_cudagraph(fn, rep=rep))
    cb = statistics.median(times.pop("cublas"))
    out = [{"M": m, "N": n, "K": k, "variant": "cublas", "config": "", "us": round(cb, 3), "vs_cublas": 1.0,
            "status": "ok"}]
    for key, row in rows.items():
        if key in times:
            us = statistics.median(times[key])
            row["us"], row["vs_cublas"] = round(us, 3), round(cb / us, 4)
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("gemm_forms"))
    ap.add_argument("--shapes", default=None, help="MxNxK,... (default: Qwen2-0.5B prefill GEMMs and squares)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {VARIANTS}")
    ap.add_argument("--configs", default=None, help="BM:BN:BK:warps:stages,... (default: CONFIGS)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rep", type=int, default=15, help="ms of one do_bench_cudagraph timing")
    args = ap.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        ap.error(f"unknown variants {bad}; choose from {VARIANTS}")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        sys.exit("bench_gemm_forms.py needs a Hopper GPU (TMA descriptors made in the kernel)")
    triton.set_allocator(_alloc)
    shapes = SHAPES if args.shapes is None else [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    configs = (CONFIGS if args.configs is None
               else [tuple(int(v) for v in c.split(":")) for c in args.configs.split(",")])
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "gemm_forms.csv"
    fields = ["M", "N", "K", "variant", "config", "us", "vs_cublas", "max_err", "status"]
    rows: list[dict] = []
    for m, n, k in shapes:
        shape_rows = bench_shape(m, n, k, variants, configs, args.rounds, args.rep)
        rows += shape_rows
        best: dict[str, dict] = {}
        for r in shape_rows:
            if "us" in r and (r["variant"] not in best or r["us"] < best[r["variant"]]["us"]):
                best[r["variant"]] = r
        print(f"{m}x{n}x{k}: " + ", ".join(f"{v} {r['us']:.2f} us ({r['vs_cublas']:.3f}, {r['config']})"
                                           for v, r in best.items()), flush=True)
        for r in shape_rows:
            if r["status"] != "ok":
                print(f"  {r['variant']} {r['config']}: {r['status']} (max_err {r.get('max_err', '-')})", flush=True)
        with path.open("w", newline="") as f:  # rewritten after each shape: a cut-off run keeps what it measured
            wr = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
            wr.writeheader()
            wr.writerows(rows)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}: {path}")
    return rows


if __name__ == "__main__":
    main()
