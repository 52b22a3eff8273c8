"""Reproduce the V-ABFT specification §5 (false-positive and detection tables) next to its numbers.

For each dtype (fp32, fp16, bf16) and input distribution (N(1e-6,1), N(1,1), U(-1,1), truncated
N(0,1); fp16 data scaled by 1e-2 as in the seed), ``--trials`` clean GEMMs C = A·B of shape
(M, K, N) = (128, 1024, 256) are drawn (batched: many matrices per torch call) and verified:

* ``output``      — V-ABFT on the rounded output (the PyTorch checked linear; seed e_max 8e-3 / 2.2e-6 /
  1e-3 for bf16 / fp32 / fp16, c_σ = 2.5, as in the V-ABFT specification §5);
* ``accumulator`` — V-ABFT on the fp32 accumulator before rounding (the fused kernel's verification;
  emulated by the fp32 GEMM of the same operands, e_max from this package's table for the device);
* ``A-ABFT``      — the baseline of the V-ABFT specification §4 (bf16 only: E_sum-C + E_ele-round + E_check1 +
  E_check2, verified in fp32).

False positives: a trial is a false positive if any of its rows fails its check. Detection: every
row of every trial receives one flip of the given bit at a random element whose bit is 0 (0→1) or
1 (1→0) — each row's check sees only its own flip, so a trial gives M samples; a row without such
an element is not eligible ("-" when under 1 % of rows are). The flip is applied to the rounded
value (site ``linear.output``): D1 changes by ``flipped − v`` (v the value the check summed).
Also bf16 at (4096, 4096, 4096) (``--big-trials``). Writes ``<out>.csv``, ``<out>.md`` (tables with
the specification's values side by side) and a plot of detection rate against bit.

    python scripts/vabft_study.py --device cuda --trials 100000 --big-trials 20 --out docs/img/vabft_study_h100
    python scripts/vabft_study.py --device cpu --trials 400 --big-trials 0 --out docs/img/vabft_study_cpu
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import sys
import time
from pathlib import Path

import torch

from ft_transformers.vabft import default_emax, device_name

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from calibrate_emax import sample_matrix  # noqa: E402

DISTS = ["N(1e-6,1)", "N(1,1)", "U(-1,1)", "TN(0,1)"]
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
BITS = {"bfloat16": range(7, 16), "float32": range(23, 32), "float16": range(10, 16)}
ITY = {"bfloat16": torch.int16, "float32": torch.int32, "float16": torch.int16}
SEED_EMAX = {"bfloat16": 8e-3, "float32": 2.2e-6, "float16": 1e-3}
SCALE = {"bfloat16": 1.0, "float32": 1.0, "float16": 1e-2}
CSIGMA = 2.5
EPS_HIGH, EPS_LOW = 2.0**-23, 2.0**-8  # A-ABFT (the V-ABFT specification §4)

_ = None  # the specification's "-" (flip cannot be injected) or "*" (meaningless: FP rate too high)
# the V-ABFT specification §5: per bit, values for [N(1e-6,1), N(1,1), U(-1,1), TN(0,1)] in %
SEED_FP = {("output", "bfloat16"): [0, 0, 0, 0], ("output", "float32"): [0, 0, 0, 0],
           ("output", "float16"): [0, 0, 0, 0], ("A-ABFT", "bfloat16"): [0, 84.825, 0, 0]}
SEED_DET = {
    ("output", "bfloat16", "0->1"): {
        7: [0.0064, 0.0, 19.6558, 10.8967], 8: [36.6953, 69.55, 46.8472, 36.4867], 9: [73.475, 100, 75.031, 99.3833],
        10: [99.986, _, 99.8603, 99.9567], 11: [100] * 4, 12: [100] * 4, 13: [100] * 4, 14: [100, _, 100, 100],
        15: [4.4033, 5.51, 42.3433, 56.7233]},
    ("output", "float32", "0->1"): {
        23: [99.9367, 100, 99.9633, 99.98], 24: [99.9833, 100, 99.9767, 99.9867], 25: [99.9967, 100, 100, 99.9967],
        26: [99.9967, 100, 100, 100], 27: [100] * 4, 28: [100] * 4, 29: [100] * 4, 30: [100] * 4,
        31: [99.9667, 100, 99.9833, 99.9967]},
    ("output", "float16", "0->1"): {
        10: [67.0467, _, 77.2533, _], 11: [88.6567, _, 92.2367, _], 12: [80.4893, 100, 100, 100],
        13: [100, _, 100, _], 14: [100] * 4, 15: [80.1267, 100, 92.2933, 100]},
    ("A-ABFT", "bfloat16", "0->1"): {
        7: [87.1876, _, 87.0669, 80.1737], 8: [96.924, _, 96.9887, 94.537], 9: [99.5554, _, 99.5269, 99.2126],
        10: [99.979, _, 99.993, 100], 11: [100, _, 100, 100], 12: [100, _, 100, 100], 13: [100, _, 100, 100],
        14: [53.9394, _, 48.6708, 55.6291], 15: [93.1479, _, 92.0962, 91.1012]},
    ("output", "bfloat16", "1->0"): {
        7: [0, 0, 0, 0.04], 8: [36.6953, _, 5.58, 11.06], 9: [0, _, 2.0023, 36.874], 10: [0] * 4, 11: [0, _, 0, 0],
        12: [0, _, 0, 0], 13: [0, _, 0, 0], 14: [0, 0, 13.39, 28.69], 15: [4.49, _, 42.34, 56.93]},
    ("output", "float32", "1->0"): {
        23: [99.87, 100, 99.95, 99.96], 24: [99.89, _, 100, 99.96], 25: [99.96, _, 99.7343, 99.8176],
        26: [99.0605, 100, 100, 100], 27: [98.1978, _, 99.7464, 99.8748], 28: [98.324, _, 99.7839, 99.6716],
        29: [98.1148, _, 99.7841, 99.875], 30: [100] * 4, 31: [99.96, _, 99.99, 99.99]},
    ("output", "float16", "1->0"): {
        10: [42.3333, 99.58, 66.3667, 100], 11: [77.7667, 100, 64.9667, 100], 12: [67.7333, _, 100, _],
        13: [100, 100, _, 100], 14: [_] * 4, 15: [79.7333, _, 92.5667, _]},
}
SEED_BIG = {7: [0] * 4, 8: [0, _, 0, 26.4159], 9: [0, 0, 3.4595, 67.5388], 10: [96.411, _, 99.9383, 100],
            11: [100] * 4, 12: [100] * 4, 13: [100] * 4, 14: [100] * 4}


def vabft_thr(a32: torch.Tensor, b32: torch.Tensor, emax: float) -> torch.Tensor:
    """(bt, M) V-ABFT thresholds for a (bt, M, K) and b (bt, K, N) (SPEC §5, Bhatia–Davis variances)."""
    n = b32.shape[-1]
    mu_a = a32.mean(-1)
    mn, mx = a32.amin(-1), a32.amax(-1)
    var_a = ((mx - mu_a) * (mu_a - mn)).clamp_min(0)
    mu_b = b32.mean(-1)
    var_b = ((b32.amax(-1) - mu_b) * (mu_b - b32.amin(-1))).clamp_min(0)
    s_abs = mu_b.abs().sum(-1, keepdim=True)
    s_var = var_b.sum(-1, keepdim=True)
    s_mu2 = mu_b.square().sum(-1, keepdim=True)
    det = n * mu_a.abs() * s_abs
    var23 = torch.sqrt(n * mu_a.square() * s_var + n * n * var_a * s_mu2)
    var4 = math.sqrt(n) * var_a.sqrt() * s_var.sqrt()
    return emax * (det + CSIGMA * var23 + CSIGMA * var4)


def aabft_thr(a32: torch.Tensor, b32: torch.Tensor, maxc: torch.Tensor) -> torch.Tensor:
    """(bt, M) A-ABFT error bound of the V-ABFT specification §4 given the row max |C| (bt, M)."""
    k, n = b32.shape[-2], b32.shape[-1]
    s8 = math.sqrt(n * (n + 1) * (2 * n + 1) / 6 / 8)
    maxb_row = b32.abs().amax(-1)  # (bt, K)
    e_sum = s8 * maxc * EPS_HIGH
    e_ele = EPS_LOW * math.sqrt(n) * maxc
    e_chk1 = torch.bmm(a32.abs(), (EPS_HIGH * s8 * maxb_row).unsqueeze(-1)).squeeze(-1)
    sk = math.sqrt(k * (k + 1) * (2 * k + 1) / 6 / 8 + k / 12)
    e_chk2 = EPS_HIGH * sk * b32.abs().amax((-1, -2)).unsqueeze(-1) * a32.abs().amax(-1)
    return e_sum + e_ele + e_chk1 + e_chk2


def flip(y: torch.Tensor, bit: int, ity: torch.dtype) -> torch.Tensor:
    nb = torch.finfo(y.dtype).bits
    m = 1 << bit
    if m >= 1 << (nb - 1):
        m -= 1 << nb
    return (y.view(ity) ^ torch.tensor(m, dtype=ity, device=y.device)).view(y.dtype)


class Tally:
    def __init__(self) -> None:
        self.n: dict[tuple, int] = {}
        self.k: dict[tuple, int] = {}

    def add(self, key: tuple, hits: torch.Tensor, total: torch.Tensor | int) -> None:
        self.k[key] = self.k.get(key, 0) + int(hits)
        self.n[key] = self.n.get(key, 0) + int(total)


def run_batch(tally: Tally, tag: str, dt: str, dist: str, a: torch.Tensor, b: torch.Tensor, emax_acc: float,
              g: torch.Generator, aabft: bool) -> None:
    """One batch (bt trials) of one configuration: false positives and every bit's detection."""
    a32, b32 = a.float(), b.float()
    y = torch.bmm(a, b)  # output-side: the GEMM in dtype
    acc = torch.bmm(a32, b32)  # accumulator-side: fp32 sums of the same (exact) products
    y_acc = acc.to(a.dtype)  # what a fused kernel stores
    # checksum x·w1 as the verification computes it: elementwise products, fp32 (pairwise) sums
    c1 = (a32 * b32.sum(-1).unsqueeze(-2)).sum(-1)  # (bt, M)
    checks = {"output": (y, y.float(), vabft_thr(a32, b32, SEED_EMAX[dt])),
              "accumulator": (y_acc, acc, vabft_thr(a32, b32, emax_acc))}
    if aabft:
        maxc = y.float().abs().amax(-1)
        checks["A-ABFT"] = (y, y.float(), None, maxc)
    bt, m, n = y.shape
    for algo, val in checks.items():
        yq, v = val[0], val[1]
        d1 = v.sum(-1) - c1
        thr = val[2] if algo != "A-ABFT" else aabft_thr(a32, b32, val[3])
        bad = ~(d1.abs() <= thr)
        tally.add((tag, algo, dt, dist, "fp", None), bad.any(-1).sum(), bt)
        tally.add((tag, algo, dt, dist, "fp-rows", None), bad.sum(), bt * m)
        bits_i = yq.view(ITY[dt])
        for bit in BITS[dt]:
            state = (bits_i >> bit) & 1
            for direction, want in (("0->1", 0), ("1->0", 1)):
                ok = state == want
                score = torch.rand(ok.shape, generator=g, device=ok.device).masked_fill_(~ok, -1.0)
                idx = score.argmax(-1, keepdim=True)
                elig = ok.any(-1)
                yf = flip(yq.gather(-1, idx), bit, ITY[dt]).float().squeeze(-1)
                d1f = d1 + yf - v.gather(-1, idx).squeeze(-1)
                if algo == "A-ABFT":
                    thr_f = aabft_thr(a32, b32, torch.maximum(val[3], yf.abs()))
                else:
                    thr_f = thr
                det = ~(d1f.abs() <= thr_f) & elig
                tally.add((tag, algo, dt, dist, direction, bit), det.sum(), elig.sum())


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}".rstrip("0").rstrip(".") if x not in (0, 100) else f"{x:.0f}"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--trials", type=int, default=100_000, help="clean trials per dtype and distribution")
    ap.add_argument("--batch", type=int, default=0, help="trials per torch call (0: 1000 on CUDA, 16 on CPU)")
    ap.add_argument("--big-trials", type=int, default=20, help="bf16 (4096, 4096, 4096) trials (M samples each)")
    ap.add_argument("--shape", default="128,1024,256", help="M,K,N of the main tables")
    ap.add_argument("--dtypes", default="bfloat16,float32,float16")
    ap.add_argument("--out", type=Path, default=Path("docs/img/vabft_study"))
    ap.add_argument("--plot", type=Path, default=Path("docs/img/vabft_detection.png"))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    dev = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    batch = args.batch or (1000 if dev.type == "cuda" else 16)
    m, k, n = (int(v) for v in args.shape.split(","))
    g = torch.Generator(device=dev).manual_seed(args.seed)
    tally = Tally()
    t0 = time.time()
    runs = [("main", dt, (m, k, n), args.trials) for dt in args.dtypes.split(",")]
    if args.big_trials:
        runs.append(("big", "bfloat16", (4096, 4096, 4096), args.big_trials))
    emax_used = {}
    with torch.no_grad():
        for tag, dt, (mm, kk, nn), trials in runs:
            emax_acc = default_emax(DTYPES[dt], dev.type, "accumulator", k=kk)
            emax_used[(tag, dt)] = emax_acc
            bsz = max(1, min(batch, (batch * 128 * 1024 * 256) // (mm * kk * nn)))
            for dist in DISTS:
                done = 0
                while done < trials:
                    bt = min(bsz, trials - done)
                    a = (sample_matrix(dist, (bt, mm, kk), g) * SCALE[dt]).to(DTYPES[dt])
                    b = (sample_matrix(dist, (bt, kk, nn), g) * SCALE[dt]).to(DTYPES[dt])
                    run_batch(tally, tag, dt, dist, a, b, emax_acc, g, aabft=dt == "bfloat16")
                    done += bt
                print(f"{tag} {dt} {dist}: {trials} trials, {time.time() - t0:.0f}s", flush=True)
    write(args, tally, emax_used, (m, k, n), dev)


def write(args, tally: Tally, emax_used: dict, shape: tuple, dev: torch.device) -> None:
    rows = []
    for key, total in tally.n.items():
        tag, algo, dt, dist, kind, bit = key
        rate = 100.0 * tally.k[key] / total if total else None
        seed = None
        di = DISTS.index(dist)
        if kind == "fp" and tag == "main":
            seed = SEED_FP.get((algo, dt), [None] * 4)[di]
        elif kind in ("0->1", "1->0") and tag == "main":
            seed = SEED_DET.get((algo, dt, kind), {}).get(bit, [None] * 4)[di]
        elif kind == "0->1" and tag == "big" and algo == "output":
            seed = SEED_BIG.get(bit, [None] * 4)[di]
        rows.append({"table": tag, "algo": algo, "dtype": dt, "dist": dist, "kind": kind, "bit": bit,
                     "samples": total, "hits": tally.k[key], "rate_pct": rate, "seed_pct": seed})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out.with_suffix(".csv"), "w", newline="") as fh:
        wr = csv.DictWriter(fh, fieldnames=list(rows[0]))
        wr.writeheader()
        wr.writerows(rows)
    idx = {(r["table"], r["algo"], r["dtype"], r["dist"], r["kind"], r["bit"]): r for r in rows}

    def cell(tag, algo, dt, dist, kind, bit=None):
        r = idx.get((tag, algo, dt, dist, kind, bit))
        if r is None:
            return "n/a"
        ours = "-" if r["samples"] == 0 or (kind != "fp" and r["samples"] < 0.01 * max(
            1, idx.get((tag, algo, dt, dist, "fp-rows", None), {"samples": 1})["samples"])) else fmt(r["rate_pct"])
        return f"{ours} ({fmt(r['seed_pct'])})" if r["seed_pct"] is not None or tag == "main" else ours

    name = device_name(dev.type)
    md = [f"Device: {name}; torch {torch.__version__}. Main shape (M, K, N) = {shape}. Cells: ours (specification). "
          "Samples: false positives per trial; detection per row (one flip per row).", ""]
    md.append("e_max: output-side = seed's (bf16 8e-3, fp32 2.2e-6, fp16 1e-3); accumulator-side = "
              + ", ".join(f"{dt} {v:.3g}" for (tag, dt), v in emax_used.items() if tag == "main") + ".")
    head = "| | " + " | ".join(DISTS) + " |\n|" + " --- |" * 5
    md += ["", "### False-positive rate (%)", "", head]
    trials = {}
    for (tag, algo, dt, _dist, kind, _bit), r in idx.items():
        if kind == "fp" and tag == "main":
            trials[(algo, dt)] = r["samples"]
    for (algo, dt) in sorted(trials):
        md.append(f"| {algo} {dt} ({trials[(algo, dt)]} trials) | "
                  + " | ".join(cell("main", algo, dt, d, "fp") for d in DISTS) + " |")
    for direction in ("0->1", "1->0"):
        for dt in args.dtypes.split(","):
            for algo in ("output", "accumulator", "A-ABFT"):
                if algo == "A-ABFT" and dt != "bfloat16":
                    continue
                md += ["", f"### Detection rate (%), {algo}, {dt}, {direction} flips, {shape}", "",
                       "| bit " + head[1:]]
                for bit in BITS[dt]:
                    cells = " | ".join(cell("main", algo, dt, d, direction, bit) for d in DISTS)
                    md.append(f"| {bit} | {cells} |")
    if any(k[0] == "big" for k in idx):
        for algo in ("output", "accumulator"):
            md += ["", f"### Detection rate (%), {algo}, bfloat16, 0->1 flips, (4096, 4096, 4096)", "",
                   "| bit " + head[1:]]
            for bit in range(7, 15):
                md.append(f"| {bit} | " + " | ".join(cell("big", algo, "bfloat16", d, "0->1", bit) for d in DISTS)
                          + " |")
    args.out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print(f"wrote {args.out.with_suffix('.csv')} and {args.out.with_suffix('.md')}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, len(DISTS), figsize=(4 * len(DISTS), 3.4), sharey=True)
    dt = "bfloat16"
    for ax, dist in zip(axes, DISTS):
        for algo, style in (("output", "o-"), ("accumulator", "s-"), ("A-ABFT", "^--")):
            xs = [b for b in BITS[dt] if (("main", algo, dt, dist, "0->1", b) in idx)]
            ys = [idx[("main", algo, dt, dist, "0->1", b)]["rate_pct"] for b in xs]
            ax.plot(xs, ys, style, label=f"{algo} (ours)", ms=4)
        sd = SEED_DET[("output", dt, "0->1")]
        ax.plot(list(sd), [v[DISTS.index(dist)] if v[DISTS.index(dist)] is not None else float("nan")
                           for v in sd.values()], "k:", label="V-ABFT output (the V-ABFT specification)")
        ax.set_title(f"{dist}, bf16 {shape}", fontsize=9)
        ax.set_xlabel("flipped bit (0→1)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("detection rate (%)")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"V-ABFT detection vs bit on {name}", fontsize=10)
    fig.tight_layout()
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.plot, dpi=110)
    print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
