"""Where a decode call of the checked GEMM spends its time: the same call in parts, side by side.

Per shape (M, N, K) and dtype, every column is timed as a CUDA graph of ``--calls`` calls cycling over
weight copies past the H100's 50 MB L2 (as a model's layer stack streams its weights; helpers of
``bench_linear.py``), in interleaved rounds (``_timing.interleaved``); the figure is the median per call:

* ``cublas``    — ``torch.nn.functional.linear``,
* ``plain``     — the Triton GEMM with the checks compiled out,
* ``gemm_only`` — the GEMM launch of the tile form (the epilogue's 64-column group sums written), its
  verification launch replaced by nothing: no check is made, so this column is a measurement device only
  (for a call that takes the decode kernel it is that kernel, checks included),
* ``fused``     — the call as it runs: the decode kernel (M ≤ 16: each tile verifies its 64-column groups in
  its epilogue), or the GEMM launch and the group verification launch,
* ``plain_nosplit``, ``fused_nosplit`` — without split-K (``Options.gemm_split = 1``; by default a call of few
  tiles runs each tile as several programs over parts of K, `forms.split_k`).

Every column counts its events in its own counters (``events_by_column``; clean inputs, so any
event is a false positive, whose recompute would dominate that column's time).
``gemm_only − plain`` is what the epilogue's group sums cost, ``fused − gemm_only`` the verification launch;
for the decode kernel ``fused − plain`` is the whole checks' cost.

``--modules`` takes further copies of the kernel package inside ``ft_transformers.kernels`` (e.g. a
variant saved as ``kernels/_abft_gemm_x/``), each with its own columns (``name:mode+mode``, default
``--modes``), named ``name:mode``, so that variants are compared in the same rounds.

    python scripts/bench_gemm_parts.py --out /tmp/parts
    python scripts/bench_gemm_parts.py --modules abft_gemm:fused,_abft_gemm_x:fused --out /tmp/ab
"""

from __future__ import annotations

import argparse
import csv
import importlib
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import interleaved  # noqa: E402
from bench_linear import _cycled, _graphed, _with_options, weight_copies  # noqa: E402

# Qwen2-0.5B's decode GEMMs (q/o 896², k/v 128×896, MLP 4864×896 and 896×4864, lm_head) and SmolLM2's MLP
SHAPES = [(1, 896, 896), (1, 128, 896), (1, 4864, 896), (1, 896, 4864), (16, 4864, 896), (1, 1536, 576),
          (1, 151936, 896)]
MODES = ("plain", "plain_nosplit", "gemm_only", "fused", "fused_nosplit")


def _no_launch(grid, args, kwargs) -> None:
    """A launcher that launches nothing (``gemm_only``'s verification)."""


def _call(mod, mode: str, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, cnt: torch.Tensor, owner):
    """One call of ``mod``'s checked GEMM in ``mode`` (as the checked linear's Triton backend runs it)."""
    from ft_transformers.checked_linear import _triton

    nosplit = mode.endswith("_nosplit")
    mode = mode.removesuffix("_nosplit")
    k, n = w.shape[1], w.shape[0]

    def run():
        checks = mode != "plain"
        return _triton(mod.linear_forward, x, w, b, k, n, False, None, 2.5, checks, True, None, cnt, owner, None)
    if nosplit:
        run = _with_options(run, gemm_split=1)
    if mode == "gemm_only":
        inner = run

        def run():
            saved = mod.calls._VERIFY_LAUNCH
            mod.calls._VERIFY_LAUNCH = _no_launch  # looked up through calls._launcher(1) at each call
            try:
                return inner()
            finally:
                mod.calls._VERIFY_LAUNCH = saved
    return run


def bench_shape(m: int, n: int, k: int, dtype: torch.dtype, modules: list[tuple], calls: int,
                rounds: int, timer, device: str = "cuda", graphed=_graphed
                ) -> tuple[dict[str, float], dict[str, int], float]:
    """Median µs per call of every column (``modules``: (module, modes) pairs, the first unprefixed);
    the events each column counted (its own counters: warm-up, capture and timed calls; any event
    on these clean inputs is a false positive, and a recompute would dominate the column's time);
    the largest relative error of a column's output against float64.

    ``timer(fn)``: ms of one ``fn()``; ``graphed(fn)``: the function timed for ``fn`` (a CUDA-graph
    replay; the CPU test passes ``fn`` itself)."""
    from ft_transformers.counters import new_counters

    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn((m, k), device=dev, dtype=dtype, generator=g)
    w0 = (torch.randn((n, k), device=dev, dtype=torch.float32, generator=g) / k**0.5).to(dtype)
    b = torch.randn((n,), device=dev, dtype=dtype, generator=g)
    n_w = weight_copies(w0.numel() * w0.element_size())
    ws = [w0] + [w0.clone() for _ in range(n_w - 1)]
    counters = {}
    ref = x.double() @ w0.double().t() + b.double()
    fns, err = {}, 0.0
    with torch.no_grad():
        fns["cublas"] = graphed(_cycled(lambda j: (lambda: F.linear(x, ws[j], b)), n_w, calls))
        for i, (mod, modes) in enumerate(modules):
            tag = "" if i == 0 else mod.__name__.rsplit(".", 1)[1] + ":"
            for mode in modes:
                owners = [torch.nn.Module() for _ in ws]  # a column's own cached checksums and launches
                cnt = counters[tag + mode] = new_counters(dev)
                one = _call(mod, mode, x, ws[0], b, cnt, owners[0])
                if mode != "gemm_only":
                    err = max(err, float((one().double() - ref).abs().max() / ref.abs().max()))
                fns[tag + mode] = graphed(_cycled(lambda j, mod=mod, mode=mode, owners=owners, cnt=cnt:
                                                   _call(mod, mode, x, ws[j], b, cnt, owners[j]), n_w, calls))
        times = interleaved(fns, rounds, timer)
        events = {name: int(c.sum()) for name, c in counters.items()}
    return {name: 1e3 * statistics.median(ts) / calls for name, ts in times.items()}, events, err


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("gemm_parts"))
    ap.add_argument("--dtypes", default="float16")
    ap.add_argument("--modules", default="abft_gemm",
                    help="comma-separated kernel packages of ft_transformers.kernels, each optionally name:mode+mode; "
                         "the first is the baseline (its columns unprefixed)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated columns of {MODES}")
    ap.add_argument("--shapes", default=None, help="MxNxK,... (default: Qwen2-0.5B's and SmolLM2's decode GEMMs)")
    ap.add_argument("--calls", type=int, default=16, help="calls per CUDA graph")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rep", type=int, default=25, help="do_bench rep (ms) of one timing")
    args = ap.parse_args(argv)
    specs = []
    for entry in args.modules.split(","):
        name, _, mode_list = entry.partition(":")
        modes = [m for m in (mode_list.split("+") if mode_list else args.modes.split(",")) if m]
        bad = [m for m in modes if m not in MODES]
        if bad or not modes:
            ap.error(f"module {name!r}: unknown or no modes {bad}; choose from {MODES}")
        specs.append((name, modes))
    if args.calls < 1 or args.rounds < 1:
        ap.error("--calls and --rounds must be at least 1")
    if not torch.cuda.is_available():
        sys.exit("bench_gemm_parts.py needs a CUDA device (CUDA graphs of the Triton kernels)")
    modules = [(importlib.import_module(f"ft_transformers.kernels.{name}"), modes) for name, modes in specs]
    import triton.testing

    def timer(fn):
        return triton.testing.do_bench(fn, warmup=10, rep=args.rep)
    shapes = SHAPES if args.shapes is None else [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for dt in args.dtypes.split(","):
        dtype = getattr(torch, dt)
        for m, n, k in shapes:
            us, events, err = bench_shape(m, n, k, dtype, modules, args.calls, args.rounds, timer)
            row = {"dtype": dt, "M": m, "N": n, "K": k, **{c: round(v, 3) for c, v in us.items()},
                   "events": sum(events.values()),
                   "events_by_column": " ".join(f"{c}:{e}" for c, e in events.items() if e) or "-",
                   "rel_err": f"{err:.2e}"}
            rows.append(row)
            print(" ".join(f"{c}={v}" for c, v in row.items()), flush=True)
    with open(args.out / "gemm_parts.csv", "w", newline="") as f:
        cols = list(dict.fromkeys(c for r in rows for c in r))
        wr = csv.DictWriter(f, fieldnames=cols)
        wr.writeheader()
        wr.writerows(rows)
    return rows


if __name__ == "__main__":
    main()
