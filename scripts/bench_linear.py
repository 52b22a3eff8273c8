"""Throughput of the fused V-ABFT checked GEMM against cuBLAS and the PyTorch checked path.

Side by side in one run, per shape (M, N, K) and dtype (fp16, bf16), all on one CUDA device:

* ``cublas``       — ``torch.nn.functional.linear`` (the unprotected layer),
* ``fused``        — `ft_transformers.kernels.abft_gemm` with verification in the fp32 accumulators,
* ``triton_plain`` — the same Triton GEMM with the checks compiled out (the kernel's own speed),
* ``torch_checked``— the PyTorch checked path (`checked_linear(..., backend="reference")`).

Shapes: M = N = K squares ≥ 2048 (the issue's ≥ 0.90× cuBLAS target), decode shapes M = 1…16 at
real model widths (Qwen2-0.5B 896→4864 and 4864→896, SmolLM2-135M 576→1536), short inputs of
M = 64, 128 tokens at Qwen2-0.5B widths, and transformer-layer shapes (batch·seq = 4096 tokens through
Qwen2-0.5B / Llama-7B projections); ``--kinds`` picks among them. Every variant of a shape is timed
once per round (``--rounds``, the order rotated by one each round, ``--rep`` ms of
``triton.testing.do_bench`` per timing, L2 flushed between runs) and the figure is the median over the
rounds: the H100's speed drifts during a run (single timings at 8192³ spread over 0.82–0.96×
cuBLAS in one call), and a drift then reaches every variant alike. The ``*_spread`` columns give
the lowest and highest per-round ratio to cuBLAS. TFLOP/s = 2·M·N·K / time. Writes CSV, a markdown
table headed by device and versions, and a plot of throughput relative to cuBLAS.

    python scripts/bench_linear.py --out docs/img/vabft_bench_linear          # full
    python scripts/bench_linear.py --quick --out /tmp/bench         # a few shapes
    python scripts/bench_linear.py --kinds decode,short --graph --two-launch   # one launch vs two
    python scripts/bench_linear.py --kinds decode --graph --graph-calls 16     # decode as in a model
    python scripts/bench_linear.py --kinds target --models qwen2-0.5b --graph   # the target grid of one model

``--graph-calls N`` (with ``--graph``): each graph holds N calls that cycle over copies of the weight
(as many as make ~120 MB, at most 8: more bytes than the H100's 50 MB L2, as a model's layer stack
streams its weights), and the ``*_graph`` times are per call. A single-call graph's replay also times
the graph launch (~5 µs on the H100), as much as a whole decode GEMM.
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import interleaved, ratio_summary  # noqa: E402

SQUARES = [2048, 4096, 8192]
DECODE = [(m, n, k) for (n, k) in ((4864, 896), (896, 4864), (1536, 576)) for m in (1, 4, 16)]
LAYERS = [(4096, 896 * 3, 896), (4096, 4864, 896), (4096, 896, 4864), (4096, 4096 * 3, 4096),
          (4096, 11008, 4096), (4096, 4096, 11008)]


SHORT = [(m, n, k) for (n, k) in ((4864, 896), (896, 4864)) for m in (64, 128)]  # one row block of a large config

# (model, layer, N, K) of every distinct Linear shape of these models, from their published configs (hidden and
# intermediate sizes; k/v of KV heads × head dim columns; q and o share a shape), and each model's lm_head (N, K).
MODEL_LAYERS = [("qwen2-0.5b", "q/o", 896, 896), ("qwen2-0.5b", "k/v", 128, 896), ("qwen2-0.5b", "gate/up", 4864, 896),
                ("qwen2-0.5b", "down", 896, 4864),
                ("qwen2-1.5b", "q/o", 1536, 1536), ("qwen2-1.5b", "k/v", 256, 1536),
                ("qwen2-1.5b", "gate/up", 8960, 1536), ("qwen2-1.5b", "down", 1536, 8960),
                ("qwen2-7b", "q/o", 3584, 3584), ("qwen2-7b", "k/v", 512, 3584),
                ("qwen2-7b", "gate/up", 18944, 3584), ("qwen2-7b", "down", 3584, 18944),
                ("llama-3-8b", "q/o", 4096, 4096), ("llama-3-8b", "k/v", 1024, 4096),
                ("llama-3-8b", "gate/up", 14336, 4096), ("llama-3-8b", "down", 4096, 14336)]
MODELS = tuple(dict.fromkeys(model for model, *_ in MODEL_LAYERS))
LM_HEADS = {"qwen2-0.5b": (151936, 896), "qwen2-1.5b": (151936, 1536), "qwen2-7b": (152064, 3584),
            "llama-3-8b": (128256, 4096)}
TARGET_M = (1, 16, 128, 512, 4096)


def target_shapes(models: tuple[str, ...] = MODELS) -> list[tuple[int, int, int]]:
    """(M, N, K) of the checked GEMM's target grid for ``models``: each layer shape at M ∈ TARGET_M, the lm_head
    only at M ≤ 16 (generation runs it on each sequence's last position, ``logits_to_keep=1``, not on a whole
    prompt); without repeats, in model and layer order."""
    out: list[tuple[int, int, int]] = []
    for model in models:
        nks = [(n, k) for mod, _, n, k in MODEL_LAYERS if mod == model]
        for (n, k), ms in [*((nk, TARGET_M) for nk in nks), (LM_HEADS[model], [m for m in TARGET_M if m <= 16])]:
            out += [(m, n, k) for m in ms if (m, n, k) not in out]
    return out


KINDS = ("square", "decode", "short", "layer", "target")
DEFAULT_KINDS = KINDS[:4]  # "target" (the checked-GEMM target grid, 88 shapes) only when asked for


def shapes(quick: bool, kinds: tuple[str, ...] = DEFAULT_KINDS,
           models: tuple[str, ...] = MODELS) -> list[tuple[str, int, int, int]]:
    lists = {"square": [(s, s, s) for s in SQUARES], "decode": DECODE, "short": SHORT, "layer": LAYERS,
             "target": target_shapes(models)}
    picks = {"square": slice(0, 2), "decode": slice(None, None, 3), "short": slice(None, None, 2), "layer": slice(0, 2),
             "target": slice(None, None, 4)}
    return [(kind, *mnk) for kind in kinds for mnk in (lists[kind][picks[kind]] if quick else lists[kind])]


def _graphed(fn):
    """``fn`` captured once into a CUDA graph (after a warm-up call that also tunes): its replay.

    Timed with ``do_bench`` like the eager columns, so L2 is flushed between replays (triton's
    ``do_bench_cudagraph``, which bench_attention uses, replays without flushing).

    The replay keeps ``fn`` alive: the graph reads tensors that only ``fn``'s closures hold (the
    checked GEMM's cached weight checksums, on the modules ``fn`` calls). A bare ``g.replay`` would
    let them be freed: later allocations would reuse their memory, and every replay of an earlier
    column would compare its outputs with garbage checksums (false positives in every replay of
    every column but the last)."""
    fn()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()

    def replay(g=g, fn=fn):
        g.replay()
    return replay


def weight_copies(nbytes: int, budget: float = 120e6, most: int = 8) -> int:
    """How many copies of a weight of ``nbytes`` a multi-call graph cycles over: enough to pass
    ``budget`` bytes (more than L2), at least 1, at most ``most``."""
    return max(1, min(most, -(-int(budget) // max(nbytes, 1))))


def _cycled(make, n_weights: int, calls: int):
    """One function making ``calls`` calls, call i through ``make(i % n_weights)``'s function (one per
    weight copy, built once)."""
    fns = [make(j) for j in range(n_weights)]

    def run():
        for i in range(calls):
            fns[i % n_weights]()
    return run


def _with_options(fn, **changes):
    """``fn`` run with the switches ``changes`` (`Options` fields) for its call. The switched `Options` object
    is made once (`override` interns it) and only put in place around each call: building it per call
    (``dataclasses.replace`` and the interning) would add microseconds of host time to the eager timings."""
    from ft_transformers.kernels import options as opts

    with opts.override(**changes) as switched:
        pass

    def run():
        previous = opts._current
        opts._current = switched
        try:
            return fn()
        finally:
            opts._current = previous
    return run


def bench_one(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, rep: int, with_torch_checked: bool,
              graph: bool = False, pointer: bool = False, rounds: int = 1,
              graph_calls: int = 1, unfused: bool = False) -> tuple[dict[str, list[float]], int, float]:
    """Times (ms, one per round, `_timing.interleaved`) of each method on ``F.linear(x, w, b)``; the fused
    call's event count and max error.

    ``graph``: also time cuBLAS, fused and plain as CUDA-graph replays (``*_graph``: GPU time without
    the host's launch work). ``pointer``: also time the fused kernel with pointer loads instead of
    TMA descriptors (``fused_ptr``). ``unfused``: also time the fused call with its group checksums in the
    verification's launch instead of the GEMM's (``Options.gemm_fused`` False: ``unfused``, and with
    ``graph`` ``unfused_graph``). ``graph_calls``: calls per graph, cycling over
    `weight_copies` copies of ``w`` (each with its own cached checksums); ``*_graph`` times per call."""
    import triton.testing
    from ft_transformers.kernels import abft_gemm

    import ft_transformers as ftt
    from ft_transformers.checked_linear import _triton
    from ft_transformers.counters import new_counters
    from ft_transformers.vabft import weight_checksums

    cnt = new_counters(x.device)
    n_w = weight_copies(w.numel() * w.element_size()) if graph and graph_calls > 1 else 1
    ws = [w] + [w.clone() for _ in range(n_w - 1)]
    owners = [torch.nn.Module() for _ in ws]  # each holds its weight's cached checksums, like a real layer

    def make(name: str, j: int = 0):
        """The call of column ``name`` (cublas, fused, fused_two, triton_plain) on weight copy ``j``."""
        if name == "cublas":
            return lambda: F.linear(x, ws[j], b)
        checks = name != "triton_plain"
        k, n = ws[j].shape[1], ws[j].shape[0]
        # the checked linear's Triton backend as a protected layer's full path runs it (checksum cache, e_max,
        # the kernel, its fast path kept on the owner), without the library's validation
        return lambda: _triton(abft_gemm.linear_forward, x, ws[j], b, k, n, False, None, 2.5, checks, checks, None,
                               cnt, owners[j], None)

    fused, plain, cublas = make("fused"), make("triton_plain"), make("cublas")

    def torch_checked():
        return ftt.checked_linear(x, w, b, backend="reference")[0]

    with torch.no_grad():
        weight_checksums(w, b, cache_owner=owners[0])
        ref = x.double() @ w.double().t() + b.double()
        y = fused()
        err = float((y.double() - ref).abs().max() / ref.abs().max())
        fns = {"cublas": cublas, "fused": fused, "triton_plain": plain}
        if pointer:
            fns["fused_ptr"] = _with_options(fused, gemm_tma=False)
            fns["plain_ptr"] = _with_options(plain, gemm_tma=False)
        if unfused:
            fns["unfused"] = _with_options(fused, gemm_fused=False)
        if with_torch_checked:
            fns["torch_checked"] = torch_checked
        graphed = ("cublas", "fused", "triton_plain", *(("unfused",) if unfused else ()))
        if graph:
            for name in graphed:
                if graph_calls > 1:
                    fn = _cycled(lambda j, name=name: make("fused" if name == "unfused" else name, j), n_w,
                                 graph_calls)
                    fn = _with_options(fn, gemm_fused=False) if name == "unfused" else fn
                else:
                    fn = fns[name]
                fns[f"{name}_graph"] = _graphed(fn)
        per_call = {f"{name}_graph": graph_calls for name in graphed}
        times = interleaved(fns, rounds, lambda fn: triton.testing.do_bench(fn, warmup=10, rep=rep))
        times = {name: [t / per_call.get(name, 1) for t in ts] for name, ts in times.items()}
        events = int(cnt.sum())  # every fused call of the run, graph replays included
    return times, events, err


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("docs/img/vabft_bench_linear"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--dtypes", default="float16,bfloat16")
    ap.add_argument("--no-torch-checked", action="store_true", help="skip the PyTorch checked path")
    ap.add_argument("--rep", type=int, default=25, help="do_bench rep (ms) of one timing")
    ap.add_argument("--rounds", type=int, default=5, help="rounds; each times every variant once (median)")
    ap.add_argument("--graph", action="store_true", help="also time cuBLAS, fused and plain as CUDA-graph replays")
    ap.add_argument("--graph-calls", type=int, default=1,
                    help="calls per CUDA graph (with --graph), cycling over weight copies past L2; times per call")
    ap.add_argument("--pointer", action="store_true",
                    help="also time fused and plain with pointer loads instead of TMA descriptors")
    ap.add_argument("--unfused", action="store_true",
                    help="also time the checked call with its group checksums in the verification's launch")
    ap.add_argument("--kinds", default=",".join(DEFAULT_KINDS), help=f"comma-separated shape kinds of {KINDS}")
    ap.add_argument("--models", default=",".join(MODELS),
                    help=f"the models whose Linear shapes the 'target' kind takes, of {MODELS}")
    args = ap.parse_args(argv)
    models = tuple(args.models.split(","))
    if not set(models) <= set(MODELS):
        ap.error(f"--models takes names from {MODELS}, got {args.models!r}")
    if args.graph_calls < 1:
        ap.error(f"--graph-calls must be at least 1, got {args.graph_calls}")
    kinds = tuple(args.kinds.split(","))
    if not set(kinds) <= set(KINDS):
        ap.error(f"--kinds takes names from {KINDS}, got {args.kinds!r}")
    if not torch.cuda.is_available():
        raise SystemExit("bench_linear.py needs a CUDA device (the Triton kernel is compiled for it)")
    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    rows: list[dict] = []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for dt_name in args.dtypes.split(","):
        dt = getattr(torch, dt_name)
        for (kind, m, n, k) in shapes(args.quick, kinds, models):
            g = torch.Generator(device=dev).manual_seed(0)
            x = torch.randn(m, k, device=dev, generator=g).to(dt)
            w = (torch.randn(n, k, device=dev, generator=g) / k**0.5).to(dt)
            b = torch.randn(n, device=dev, generator=g).to(dt)
            per_round, events, err = bench_one(x, w, b, args.rep, not args.no_torch_checked, args.graph,
                                               args.pointer, args.rounds, args.graph_calls, args.unfused)
            times = {name: statistics.median(v) for name, v in per_round.items()}
            flops = 2.0 * m * n * k
            row = {"kind": kind, "dtype": dt_name, "M": m, "N": n, "K": k, "rounds": args.rounds, "events": events,
                   "rel_err": err, "graph_calls": args.graph_calls if args.graph else 0}
            for name, ms in times.items():
                row[f"{name}_us"] = round(ms * 1e3, 2)
                row[f"{name}_tflops"] = round(flops / ms / 1e9, 1)
            # ratios: medians over the rounds of the same-round ratio (a drift hits both times of a round)
            pairs = {"fused_vs_cublas": ("cublas", "fused"), "plain_vs_cublas": ("cublas", "triton_plain"),
                     "fused_vs_plain": ("triton_plain", "fused"),
                     "torch_checked_vs_cublas": ("cublas", "torch_checked"),
                     "fused_ptr_vs_cublas": ("cublas", "fused_ptr"), "plain_ptr_vs_cublas": ("cublas", "plain_ptr"),
                     "fused_vs_cublas_graph": ("cublas_graph", "fused_graph"),
                     "plain_vs_cublas_graph": ("cublas_graph", "triton_plain_graph"),
                     "unfused_vs_cublas": ("cublas", "unfused"),
                     "unfused_vs_cublas_graph": ("cublas_graph", "unfused_graph"),
                     "fused_over_unfused_time_graph": ("fused_graph", "unfused_graph")}
            for col, (base, name) in pairs.items():
                if name in per_round:
                    med, lo, hi = ratio_summary(per_round, base, name)
                    row[col] = round(med, 3)
                    if col in ("fused_vs_cublas", "fused_vs_cublas_graph"):
                        row[f"{col}_spread"] = f"{lo:.3f}-{hi:.3f}"
            rows.append(row)
            extra = ""
            if "fused_ptr" in times:
                extra += (f"  pointer-loads fused {row['fused_ptr_vs_cublas']:.3f}x "
                          f"plain {row['plain_ptr_vs_cublas']:.3f}x")
            if "fused_graph" in times:
                extra += (f"  graphs: fused {row['fused_vs_cublas_graph']:.3f}x "
                          f"({row['fused_vs_cublas_graph_spread']}) plain {row['plain_vs_cublas_graph']:.3f}x")
            if "unfused_graph" in times:
                extra += (f" unfused {row['unfused_vs_cublas_graph']:.3f}x ({times['fused_graph'] * 1e3:.1f} "
                          f"against {times['unfused_graph'] * 1e3:.1f} us)")
            print(f"{dt_name:8s} {kind:6s} M={m:5d} N={n:5d} K={k:5d}  cuBLAS {row['cublas_tflops']:6.1f} TF/s  "
                  f"fused {row['fused_tflops']:6.1f} ({row['fused_vs_cublas']:.3f}x, rounds "
                  f"{row['fused_vs_cublas_spread']})  plain "
                  f"{row['plain_vs_cublas']:.3f}x  torch-checked "
                  f"{row.get('torch_checked_vs_cublas', float('nan')):.3f}x{extra}"
                  f"  events {events}  err {err:.1e}", flush=True)
    keys = sorted({k for r in rows for k in r}, key=lambda k: list(rows[0]).index(k) if k in rows[0] else 99)
    with open(args.out.with_suffix(".csv"), "w", newline="") as fh:
        wr = csv.DictWriter(fh, fieldnames=keys)
        wr.writeheader()
        wr.writerows(rows)
    head = (f"Device: {torch.cuda.get_device_name()}; torch {torch.__version__}, triton {triton.__version__}, "
            f"CUDA {torch.version.cuda}, Python {platform.python_version()}. Throughput relative to cuBLAS "
            f"(`F.linear`), higher is better: the median over {args.rounds} interleaved rounds of the same "
            "round's time ratio (`triton.testing.do_bench`)"
            + (f"; graphs of {args.graph_calls} calls over weight copies past L2, times per call"
               if args.graph_calls > 1 else "") + ".\n\n")
    lines = ["| dtype | kind | M | N | K | cuBLAS TFLOP/s | fused TFLOP/s | fused / cuBLAS (rounds) | Triton plain / "
             "cuBLAS | fused / plain | fused / cuBLAS, graphs (rounds) | PyTorch checked / cuBLAS |",
             "|" + " --- |" * 12]
    for r in rows:
        graph = (f"{r['fused_vs_cublas_graph']:.3f} ({r['fused_vs_cublas_graph_spread']})"
                 if "fused_vs_cublas_graph" in r else "")
        lines.append(f"| {r['dtype']} | {r['kind']} | {r['M']} | {r['N']} | {r['K']} | {r['cublas_tflops']} | "
                     f"{r['fused_tflops']} | {r['fused_vs_cublas']:.3f} ({r['fused_vs_cublas_spread']}) | "
                     f"{r['plain_vs_cublas']:.3f} | {r['fused_vs_plain']:.3f} | {graph} | "
                     f"{r.get('torch_checked_vs_cublas', '')} |")
    args.out.with_suffix(".md").write_text(head + "\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(max(8, len(rows) * 0.45), 4))
        labels = [f"{r['dtype'][:4]} {r['M']}x{r['N']}x{r['K']}" for r in rows]
        xs = range(len(rows))
        wdt = 0.27
        ax.bar([i - wdt for i in xs], [r["fused_vs_cublas"] for r in rows], wdt, label="fused checked")
        ax.bar(list(xs), [r["plain_vs_cublas"] for r in rows], wdt, label="Triton plain")
        ax.bar([i + wdt for i in xs], [r.get("torch_checked_vs_cublas", 0) for r in rows], wdt,
               label="PyTorch checked")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.axhline(0.9, color="r", lw=0.8, ls="--", label="0.90 target")
        ax.set_xticks(list(xs))
        ax.set_xticklabels(labels, rotation=70, fontsize=7)
        ax.set_ylabel("throughput / cuBLAS")
        ax.set_title(f"checked linear vs cuBLAS on {torch.cuda.get_device_name()}")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(args.out.with_suffix(".png"), dpi=120)
    except ImportError:
        pass
    return rows


if __name__ == "__main__":
    main()
