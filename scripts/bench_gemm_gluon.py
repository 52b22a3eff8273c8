#!/usr/bin/env python
"""What a column-group check costs in the product's own kernel: a Gluon GEMM, checked at four levels.

A floor study for the checked GEMM's next step (``docs/vabft.md``, "The check inside a Hopper GEMM"), not
the library's kernel. It computes y = x·Wᵀ (x (M, K), W (N, K), fp16/bf16, fp32 accumulation) with a
STAGES-deep TMA ring under mbarriers and asynchronous wgmma (one MMA group kept in flight) in one of two
forms (``FORMS``; the kernels are in `gemm_gluon_kernels.py`):

* ``tile`` (`gemm_kernel`) — one program per (BLOCK_M, BLOCK_N) tile, y stored from the accumulator's
  registers;
* ``persistent`` (`persistent_kernel`, levels 0–2) — one program per SM walking its tiles as one flat
  sequence of K steps (the ring holds the next tile's first steps while a tile's epilogue runs), y stored
  through shared memory by TMA (cuBLAS's epilogue);

and at four levels:

* ``LEVEL`` 0 — nothing (the plain GEMM: compare with cuBLAS);
* ``LEVEL`` 1 — the checksum as a second MMA: x·Wcᵀ for the tile's column groups of 64, Wc holding each
  group's weight sum w1_g = Σ_{c∈g} W[c, :] as two slices (hi + lo in x's dtype, exact to about fp32), read
  as 16 more weight rows per tile (one more wgmma of 16 columns per K step), its (BLOCK_M, 16) result
  stored for a consumer to verify;
* ``LEVEL`` 2 — and the check in the epilogue: each row's group sums of the fp32 accumulator against
  the checksum, |Σ_{c∈g} y[r, c] − x_r·w1_g| ≤ T[r, g], T the library's SPEC §5 threshold (`_threshold`:
  x's row mean and variance estimate, the group's constants, the accumulator-side e_max and e_var of
  `vabft.gemm_emax`, c_σ = 2.5), failing (row, group) pairs counted with one atomic per program;
* ``LEVEL`` 3 — the checksum merged into the product's MMA (``tile`` form): W' (`merged_operand`) gives
  every 64 rows of a tile 60 weight rows (a group of 60 output columns) followed by −hi and −lo of their
  sum and two zero rows, so one wgmma of BLOCK_N columns yields the group's outputs and, summed over the
  64-column chunk, its residual Σ_{c∈g} y[r, c] − x_r·w1_g directly; the same threshold, a tile stores
  BLOCK_N / 64 · 60 columns of y. W' costs 64/60 of W's memory and MMA work.

The library's location and repair and its injection sites are left out: each level is a lower bound for a
kernel that carries them. Checksum operands, threshold constants and x's row statistics are made by
PyTorch, descriptors and y once per layer, all outside the timing (in a model x's statistics would come
from a pass over x or its producer); times are taken under CUDA graphs (the issue's figure) and as eager
launches; ``--library`` times the library's checked GEMM in the same rounds.

    python scripts/bench_gemm_gluon.py --out /tmp/gemm_gluon --library      # Hopper GPU
    python scripts/bench_gemm_gluon.py --compile 128,256,64,3,8              # offline: sm_90a resources
    python scripts/bench_gemm_gluon.py --plot-from /tmp/gemm_gluon/bench_gemm_gluon.csv --out /tmp/gemm_gluon
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import grouped_bars, write_rows  # noqa: E402
from _gluon import compile_offline as _compile  # noqa: E402
from _gluon import descriptor as _desc  # noqa: E402
from calibrate_emax import sample_matrix  # noqa: E402
from ft_transformers.kernels.gemm_checksums import (  # noqa: E402
    group_checksums,
    row_stats,
    scale_variance_terms,
    xvar_in_use,
)
from ft_transformers.kernels.tl_common import cdiv  # noqa: E402
from gemm_gluon_kernels import CROWS, gemm_kernel, persistent_kernel  # noqa: E402

from ft_transformers.vabft import gemm_emax  # noqa: E402

GROUP = 64  # columns per check group (levels 1, 2)
CSIGMA = 2.5  # the threshold's c_σ, the library's default
# (BLOCK_M, BLOCK_N, BLOCK_K, STAGES, warps): 64 rows per warp group
# (128, 128, 64, 3, ·): 96 KiB of ring, two programs per SM, one's epilogue under the other's MMAs
CONFIGS = [(128, 256, 64, 3, 8), (128, 128, 64, 4, 8), (128, 128, 64, 4, 4), (128, 128, 64, 3, 8),
           (128, 128, 64, 3, 4), (64, 128, 64, 4, 4), (64, 64, 64, 6, 4), (64, 64, 128, 4, 4)]


def _group_constants(w_groups: torch.Tensor, var_scale: float) -> torch.Tensor:
    """The threshold constants (T, 8) of a weight whose rows are its check groups of 64 (N = T·64, zero rows
    allowed: `gemm_checksums.group_checksums`, variance terms scaled by e_var / e_max)."""
    return scale_variance_terms(group_checksums(w_groups, None)[1], var_scale).contiguous()


def checksum_operand(w: torch.Tensor, block_n: int, var_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Wc (N / block_n · 16, K) in w's dtype, tile t's rows 2g, 2g + 1 the hi and lo slices of its group g's
    weight sum, and the groups' threshold constants (N / 64, 8) fp32."""
    N, K = w.shape
    w1 = w.float().view(N // GROUP, GROUP, K).sum(1)  # (T_g, K)
    hi = w1.to(w.dtype)
    lo = (w1 - hi.float()).to(w.dtype)
    per = block_n // GROUP
    wc = torch.zeros(N // block_n, CROWS, K, dtype=w.dtype, device=w.device)
    wc[:, 0:2 * per:2] = hi.view(N // block_n, per, K)
    wc[:, 1:2 * per:2] = lo.view(N // block_n, per, K)
    return wc.view(-1, K), _group_constants(w, var_scale)


def merged_operand(w: torch.Tensor, block_n: int, var_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Level 3's W' (T · block_n, K), T = ⌈N / (block_n / 64 · 60)⌉, in w's dtype: tile t's 64-row chunk g
    holds the weight rows of group g (60 output columns, zero past N), then −hi and −lo of the group's
    weight sum and two zero rows; and the groups' threshold constants (T · block_n / 64, 8) fp32, taken over
    each chunk's 60 rows and 4 zero rows (the same mean terms as over the 60 rows, variance terms no
    smaller: a threshold no tighter than the group's own)."""
    N, K = w.shape
    n_groups = cdiv(N, 60)
    per = block_n // 64
    T = cdiv(n_groups, per)
    wp = torch.zeros(T * per * 60, K, dtype=torch.float32, device=w.device)
    wp[:N] = w.float()
    wg = wp.view(T * per, 60, K)
    w1 = wg.sum(1)
    hi = w1.to(w.dtype)
    lo = (w1 - hi.float()).to(w.dtype)
    wm = torch.zeros(T * per, 64, K, dtype=w.dtype, device=w.device)
    wm[:, :60] = wg.to(w.dtype)
    consts = _group_constants(wm.view(-1, K), var_scale)  # before the check rows go in
    wm[:, 60], wm[:, 61] = -hi, -lo
    return wm.view(T * block_n, K), consts


FORMS = ("tile", "persistent")
LEVELS = {"tile": (0, 1, 2, 3), "persistent": (0, 1, 2)}


def weight_side(w: torch.Tensor, level: int, block_n: int, fault: bool = False) -> tuple:
    """What a layer keeps per weight for ``level`` at tile width ``block_n``: (the product's operand (W, or W'
    at level 3), Wc, the groups' threshold constants, tiles along N, e_max). The check takes the library's
    accumulator-side e_max and e_var for (dtype, K). ``fault``: the operand's [5, 7] += 1 after the checksums
    are made (a fault in the product)."""
    N, K = w.shape
    emax, evar = gemm_emax(w.dtype, w.device, "accumulator", K)
    if level == 3:
        wop, gc = merged_operand(w, block_n, evar / emax)
        wc = torch.zeros(CROWS, K, dtype=w.dtype, device=w.device)  # unread
    else:
        wc, gc = checksum_operand(w, block_n, evar / emax)
        wop = w
    if fault:
        wop = wop.clone()
        wop[5, 7] += 1.0
    return wop, wc, gc, wop.shape[0] // block_n, emax


def prepare(x, w, bad, level: int, cfg, form: str, sms: int, wside: tuple | None = None):
    """A zero-argument launch of y = x·Wᵀ at ``level`` in ``form`` with its operands, x's row statistics,
    descriptors and output made once (a model's layer would keep what depends on W: `weight_side`, or
    ``wside`` when given): x (M, K), w (N, K) contiguous fp16/bf16, N a multiple of the config's BLOCK_N
    below level 3, K of 8; the launch returns y (M, N); c_σ = 2.5. ``sms``: the persistent form's program
    count."""
    bm, bn, bk, stages, warps = cfg
    M, K = x.shape
    N = w.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    wop, wc, gc, tiles, emax = wside if wside is not None else weight_side(w, level, bn)
    xs = torch.stack(row_stats(x, xvar=xvar_in_use(x.device.type, x.dtype, "accumulator")), 1).contiguous()
    cs = torch.empty(M, tiles * 16, device=x.device)
    xd, wd, cd = _desc(x, [bm, bk]), _desc(wop, [bn, bk]), _desc(wc, [CROWS, bk])
    consts = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, STAGES=stages, LEVEL=level, num_warps=warps)
    if form == "tile":
        def launch():
            gemm_kernel[(cdiv(M, bm), tiles)](xd, wd, cd, y, cs, xs, gc, bad, M, N, K, emax, CSIGMA,
                                               EVEN_M=M % bm == 0, **consts)
            return y
    else:
        yd = _desc(y, [bm, bn])
        grid = (min(sms, cdiv(M, bm) * tiles),)

        def launch():
            persistent_kernel[grid](xd, wd, cd, yd, cs, xs, gc, bad, M, N, K, emax, CSIGMA, GROUP_M=8, **consts)
            return y
    return launch


# SPEC §5.1's input distributions (`calibrate_emax.sample_matrix`), drawn in turn by the clean calls
DISTRIBUTIONS = ("N(1e-6,1)", "N(1,1)", "U(-1,1)", "TN(0,1)")


def clean_flags(w: torch.Tensor, M: int, level: int, cfg, form: str, sms: int, calls: int, seed: int) -> int:
    """Failing (row, group) pairs over ``calls`` launches on fresh clean inputs x (M, K), the distributions in
    turn, the weight side made once: the threshold's false positives (should be 0)."""
    bad = torch.zeros(1, dtype=torch.int32, device=w.device)
    wside = weight_side(w, level, cfg[1])
    g = torch.Generator(device=w.device).manual_seed(seed)
    for i in range(calls):
        x = sample_matrix(DISTRIBUTIONS[i % len(DISTRIBUTIONS)], (M, w.shape[1]), g).to(w.dtype)
        prepare(x, w, bad, level, cfg, form, sms, wside=wside)()
    return int(bad.item())


def compile_offline(cfg, level: int, dtype: torch.dtype = torch.float16, arch: int = 90, form: str = "tile"):
    """The ``form``'s kernel compiled for sm_{arch}a without a GPU (`_gluon.compile_offline`), specialised as
    `prepare` launches it."""
    bm, bn, bk, stages, warps = cfg
    M, N, K = 512, 2 * bn, 512
    x, w = torch.empty(M, K, dtype=dtype), torch.empty(N, K, dtype=dtype)
    wc = torch.empty(N // bn * CROWS, K, dtype=dtype)
    y = torch.empty(M, N, dtype=dtype)
    args = dict(x_desc=_desc(x, [bm, bk]), w_desc=_desc(w, [bn, bk]), c_desc=_desc(wc, [CROWS, bk]))
    args |= dict(Y=y) if form == "tile" else dict(y_desc=_desc(y, [bm, bn]))
    args |= dict(CS=torch.empty(M, N // bn * 16))
    args |= dict(XS=torch.empty(M, 2), GC=torch.empty(N // GROUP, 8), Bad=torch.empty(1, dtype=torch.int32), M=M,
                 N=N, K=K, emax=1e-6, csig=CSIGMA)
    consts = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, STAGES=stages, LEVEL=level, num_warps=warps)
    if form == "tile":
        return _compile(gemm_kernel, args, dict(consts, EVEN_M=M % bm == 0), arch)
    return _compile(persistent_kernel, args, dict(consts, GROUP_M=8), arch)


# N × K: Qwen2-0.5B's layers (qkv, o, gate+up, down), Qwen2-7B's
LAYERS = [(1152, 896), (896, 896), (9728, 896), (896, 4864), (4608, 3584), (3584, 3584), (37888, 3584),
          (3584, 18944)]
# M × N × K: the layers at a 4k prefill and two squares ("prefill"); at M = 128 and 512 ("short")
SHAPE_SETS = {"prefill": [(4096, n, k) for n, k in LAYERS] + [(2048, 2048, 2048), (4096, 4096, 4096)],
              "short": [(m, n, k) for m in (128, 512) for n, k in LAYERS]}


def library_linear(x: torch.Tensor, w: torch.Tensor):
    """The library's checked GEMM as a protected layer runs it (`checked_linear._triton`: cached weight
    checksums, the calibrated e_max, detect and correct, the form it picks for the shape), as a zero-argument
    call on x (M, K) and w (N, K)."""
    from ft_transformers.kernels import abft_gemm

    from ft_transformers.checked_linear import _triton
    from ft_transformers.counters import new_counters

    owner, cnt = torch.nn.Module(), new_counters(x.device)
    N, K = w.shape
    return lambda: _triton(abft_gemm.linear_forward, x, w, None, K, N, False, None, 2.5, True, True, None, cnt, owner,
                           None)


def run(args) -> list[dict]:
    import torch.nn.functional as F
    from triton.testing import do_bench, do_bench_cudagraph

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    forms = args.forms.split(",")
    rows = []
    for dt in args.dtypes.split(","):
        dtype = getattr(torch, dt)
        for M, N, K in [s for name in args.shapes.split(",") for s in SHAPE_SETS[name]]:
            g = torch.Generator(device="cuda").manual_seed(M + N + K)
            x = torch.randn(M, K, device="cuda", dtype=dtype, generator=g)
            w = (torch.randn(N, K, device="cuda", dtype=dtype, generator=g) / K ** 0.5).to(dtype)
            ref = F.linear(x, w)
            fns = {"cublas": lambda x=x, w=w: F.linear(x, w)}
            row0 = dict(dtype=dt, M=M, N=N, K=K)
            out = []
            if args.library:
                fns["library"] = library_linear(x, w)
                y_lib = fns["library"]()
                out.append(dict(row0, variant="library", config="", flagged_clean=-1, flagged_fault=-1, clean_calls=0,
                                flagged_clean_calls=-1, max_abs_err=(y_lib.float() - ref.float()).abs().max().item()))
            for form in forms:
                for level in [lv for lv in LEVELS[form] if str(lv) in args.levels.split(",")]:
                    best = None
                    for cfg in CONFIGS:
                        if level < 3 and N % cfg[1]:
                            continue
                        bad = torch.zeros(1, dtype=torch.int32, device="cuda")
                        try:
                            fn = prepare(x, w, bad, level, cfg, form, sms)
                            t = do_bench_cudagraph(fn, rep=10)
                        except Exception as exc:  # noqa: BLE001 - out of resources: the next config
                            print(f"  {form} {cfg} level {level}: {type(exc).__name__}: "
                                  f"{str(exc).splitlines()[0][:100]}")
                            continue
                        if best is None or t < best[0]:
                            best = (t, cfg, fn, bad)
                    if best is None:
                        continue
                    _, cfg, fn, bad = best
                    err = (fn().float() - ref.float()).abs().max().item()
                    bad.zero_()
                    fn()
                    clean_bad = int(bad.item())
                    caught = -1
                    sweep = -1
                    if level >= 2:
                        bad.zero_()
                        prepare(x, w, bad, level, cfg, form, sms, wside=weight_side(w, level, cfg[1], fault=True))()
                        caught = int(bad.item())
                        if args.clean_calls:
                            sweep = clean_flags(w, M, level, cfg, form, sms, args.clean_calls, M + N + K)
                    name = f"{form}{level}"
                    fns[name] = fn
                    out.append(dict(row0, variant=name, config=",".join(map(str, cfg)), max_abs_err=err,
                                    flagged_clean=clean_bad, flagged_fault=caught, clean_calls=args.clean_calls,
                                    flagged_clean_calls=sweep))
            graph = {n: [] for n in fns}
            eager = {n: [] for n in fns}
            for _ in range(args.rounds):  # interleaved rounds, each variant's median over them
                for n, f in fns.items():
                    graph[n].append(do_bench_cudagraph(f, rep=20))
                    eager[n].append(do_bench(f, warmup=10, rep=30))
            tg, te = statistics.median(graph["cublas"]), statistics.median(eager["cublas"])
            base = dict(row0, variant="cublas", config="", max_abs_err=0.0, flagged_clean=0, flagged_fault=-1,
                        clean_calls=0, flagged_clean_calls=-1)
            for r in [base, *out]:
                g_us, e_us = statistics.median(graph[r["variant"]]), statistics.median(eager[r["variant"]])
                r.update(graph_us=g_us * 1e3, x_cublas_graph=tg / g_us, eager_us=e_us * 1e3, x_cublas_eager=te / e_us)
                rows.append(r)
                print(f"{dt} {M}x{N}x{K} {r['variant']:11s} graph {r['graph_us']:8.1f} us {r['x_cublas_graph']:.3f}x  "
                      f"eager {r['eager_us']:8.1f} us {r['x_cublas_eager']:.3f}x  {r['config']:16s} "
                      f"err {r['max_abs_err']:.1e} clean flags {r['flagged_clean']} fault flags {r['flagged_fault']} "
                      f"flags in {r['clean_calls']} clean calls {r['flagged_clean_calls']}",
                      flush=True)
    return rows


def plot(csv_path: str, png_path: str) -> None:
    """Bars of each variant's throughput over cuBLAS's under CUDA graphs per shape, one panel per dtype."""
    import csv

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(csv_path, newline="") as fh:
        every = [r for r in csv.DictReader(fh) if r["variant"] != "cublas"]
    if not every:
        raise SystemExit(f"{csv_path}: no variant rows to plot")
    dtypes = list(dict.fromkeys(r["dtype"] for r in every))
    fig, axes = plt.subplots(len(dtypes), 1, figsize=(13, 3.8 * len(dtypes)), squeeze=False)
    for ax, dt in zip(axes[:, 0], dtypes, strict=True):
        rows = [r for r in every if r["dtype"] == dt]
        shapes = list(dict.fromkeys((r["M"], r["N"], r["K"]) for r in rows))
        names = list(dict.fromkeys(r["variant"] for r in rows))
        grouped_bars(ax, shapes, {name: {(r["M"], r["N"], r["K"]): float(r["x_cublas_graph"]) for r in rows
                                         if r["variant"] == name} for name in names})
        ax.axhline(0.9, color="k", lw=0.6, ls="--")
        ax.set_xticklabels(["×".join(sh) for sh in shapes], fontsize=7, rotation=30, ha="right")
        ax.set_ylabel("throughput / cuBLAS (graphs)")
        ax.set_title(f"{os.path.basename(csv_path)}, {dt} (M×N×K)", fontsize=9)
        ax.legend(fontsize=7, ncol=len(names))
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    print("wrote", png_path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_gemm_gluon")
    ap.add_argument("--dtypes", default="float16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shapes", default="prefill,short", help=f"comma-separated of {sorted(SHAPE_SETS)}")
    ap.add_argument("--forms", default=",".join(FORMS), help=f"comma-separated of {FORMS}")
    ap.add_argument("--levels", default="0,1,2,3", help="comma-separated levels to run (the persistent form has 0-2)")
    ap.add_argument("--library", action="store_true", help="also time the library's checked GEMM (`library`)")
    ap.add_argument("--clean-calls", type=int, default=0,
                    help="checked levels: also count flags over this many launches on fresh clean inputs per shape")
    ap.add_argument("--compile", nargs="*", metavar="BM,BN,BK,STAGES,WARPS",
                    help="compile each config at every level of each form for sm_90a offline; print ptxas's resources")
    ap.add_argument("--plot-from", default=None, metavar="CSV", help="only plot a CSV this script wrote (to --out)")
    args = ap.parse_args()
    if args.plot_from:
        os.makedirs(args.out, exist_ok=True)
        plot(args.plot_from, os.path.join(args.out, "bench_gemm_gluon.png"))
        return 0
    if args.compile is not None:
        from kernel_resources import ptxas_info
        for spec in args.compile or [",".join(map(str, c)) for c in CONFIGS]:
            cfg = tuple(int(v) for v in spec.split(","))
            for form in args.forms.split(","):
                for level in LEVELS[form]:
                    c = compile_offline(cfg, level, form=form)
                    print(spec, form, "level", level, "shared", c.metadata.shared, ptxas_info(c.asm["ptx"]))
        return 0
    if not torch.cuda.is_available():
        ap.error("needs a Hopper GPU (or --compile for the offline resources)")
    rows = run(args)
    os.makedirs(args.out, exist_ok=True)
    write_rows(os.path.join(args.out, "bench_gemm_gluon.csv"), rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
