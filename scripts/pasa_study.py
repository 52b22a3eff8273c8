"""The PASA paper's random benchmark (Appendix D/E): FP32 flash attention vs FP16-score attention vs PASA.

Inputs (the PASA paper, eqs. 17–18; q, k and v drawn independently from the same law, in fp32, then
rounded to fp16, the attention input format of every arm):

* uniform: ``U(x0 − Am, x0 + Am)``;
* hybrid normal-Bernoulli: ``N(x0, 1) + N(0, Am²)·Bernoulli(p = 0.001)``.

Sweeps: uniform Am = 0.5 with x0 = 0…30 and x0 = 20 with Am = 0.5…20; hybrid Am = 10 with
x0 = 0…30 and x0 = 20 with Am = 10…100 (they include the six cases of the paper's Table 4).

Arms (all take the same fp16 inputs):

* ``fp32``: flash attention with fp32 scores and fp32 softmax (the EFTA reference, checks off).
* ``partial``: "partially low-precision" attention: unscaled FP16 scores ``fl16(q·kᵀ)`` from an
  FP16 GEMM with FP16 accumulation (`ft_transformers.pasa.fp16_matmul`), then scaling and softmax
  and P·V in fp32 (the PASA paper Figure 2).
* ``pasa``: PASA, FP16 scores, softmax state in fp32 (`efta_reference(pasa=True)`, checks off).
* ``pasa_fp16``: PASA with every softmax step in fp16 as well (the PASA paper Figure 3).
* ``pasa_seedmean``: PASA with the block pseudo-average taken from the fp16 scores, as Algorithm
  1 line 13 has it (``pasa_mean="scores"``), softmax state in fp32.
* ``pasa_efta``: PASA with the EFTA checks on (its detections are reported: every one is a false
  positive, no fault is injected).

Metrics per arm: percentage of non-finite output elements, and the relative RMSE
``‖O − O_ref‖₂ / ‖O_ref‖₂`` (seed eq. 19) against float64 attention of the same fp16 inputs
(NaN when the output holds a non-finite element). Outputs are compared in fp32 (before any cast
back to fp16) so that the final rounding does not hide the differences between arms.

    OMP_NUM_THREADS=1 python scripts/pasa_study.py                     # (1, 16, 1280, 128)
    python scripts/pasa_study.py --shape 1,2,256,128 --quick           # a few points, seconds
    python scripts/pasa_study.py --coverage                            # PASA+EFTA vs EFTA, bit flips

``--coverage`` runs a small injection campaign instead: one bit flip per call at each attention
site (bits 30, 26, 22; 25 seeded positions each) on uniform inputs with x0 = 0 and x0 = 30,
with and without PASA, and prints detected / corrected / recomputed and how many outputs were
wrong (max deviation > 1e-3 of the clean output's max) unprotected, and wrong *without* a
detection when protected.
"""

from __future__ import annotations

import argparse
import csv
import math
import time
from pathlib import Path

import torch
from tqdm import tqdm

from ft_transformers.counters import FaultStats, new_counters
from ft_transformers.efta_reference import efta_reference
from ft_transformers.pasa import fp16_matmul

ARMS = ("fp32", "partial", "pasa", "pasa_fp16", "pasa_seedmean", "pasa_efta")
LABELS = {
    "fp32": "FP32 flash attention",
    "partial": "partially low-precision (FP16 scores, FP32 softmax)",
    "pasa": "PASA (FP32 state)",
    "pasa_fp16": "PASA (FP16 state)",
    "pasa_seedmean": "PASA, seed's score mean",
    "pasa_efta": "PASA + EFTA",
}
SWEEPS = {
    "uniform_x0": ("uniform", "x0", [0, 5, 10, 15, 20, 25, 28, 30], 0.5),
    "uniform_am": ("uniform", "Am", [0.5, 1, 2, 5, 10, 15, 20], 20.0),
    "hybrid_x0": ("hybrid", "x0", [0, 5, 10, 15, 20, 25, 28, 30], 10.0),
    "hybrid_am": ("hybrid", "Am", [10, 20, 30, 50, 75, 100], 20.0),
}
QUICK = {
    "uniform_x0": [0, 20, 30],
    "uniform_am": [0.5, 15, 20],
    "hybrid_x0": [0, 20, 30],
    "hybrid_am": [10, 50, 100],
}
TABLE4 = [("uniform", 30, 0.5, "100%"), ("uniform", 20, 15, "0.12%"), ("uniform", 20, 20, "8.14%"),
          ("hybrid", 30, 10, "100%"), ("hybrid", 20, 50, "0.04%"), ("hybrid", 20, 100, "1.11%")]


def make_inputs(dist: str, x0: float, am: float, shape: tuple[int, int, int, int], seed: int,
                p: float = 0.001) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v (B, H, S, D) float16 from the PASA paper's uniform (eq. 17) or hybrid (eq. 18) law."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(3):
        if dist == "uniform":
            x = x0 + am * (2.0 * torch.rand(shape, generator=gen) - 1.0)
        elif dist == "hybrid":
            spikes = torch.randn(shape, generator=gen) * am * (torch.rand(shape, generator=gen) < p)
            x = x0 + torch.randn(shape, generator=gen) + spikes
        else:
            raise ValueError(f"unknown distribution {dist!r}")
        out.append(x.to(torch.float16))
    return out[0], out[1], out[2]


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """float64 softmax(scale·q·kᵀ)·v, one head at a time. (B, H, S, D) float64."""
    out = torch.empty(q.shape, dtype=torch.float64)
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            s = q[b, h].double() @ k[b, h].double().t() * scale
            out[b, h] = torch.softmax(s, -1) @ v[b, h].double()
    return out


def partial_fp16(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Unscaled FP16 scores (FP16 accumulation), fp32 scaling/softmax/P·V. (B, H, S, D) float32."""
    out = torch.empty(q.shape, dtype=torch.float32)
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            s = fp16_matmul(q[b, h], k[b, h].t()).float() * scale
            out[b, h] = torch.softmax(s, -1) @ v[b, h].float()
    return out


def run_arm(arm: str, q, k, v, scale: float) -> tuple[torch.Tensor, int]:
    """Output (fp32) of one arm and its detections."""
    if arm == "partial":
        return partial_fp16(q, k, v, scale), 0
    counters = new_counters("cpu")
    kw = dict(scale=scale, causal=False, bias=None, attn_mask=None, window=None, plan=None,
              counters=counters, out_dtype=torch.float32, detect=False, correct=False)
    if arm == "fp32":
        out = efta_reference(q, k, v, **kw)
    elif arm == "pasa":
        out = efta_reference(q, k, v, pasa=True, **kw)
    elif arm == "pasa_fp16":
        out = efta_reference(q, k, v, pasa=True, pasa_precision="fp16", **kw)
    elif arm == "pasa_seedmean":
        out = efta_reference(q, k, v, pasa=True, pasa_mean="scores", **kw)
    elif arm == "pasa_efta":
        kw.update(detect=True, correct=True)
        out = efta_reference(q, k, v, pasa=True, **kw)
    else:
        raise ValueError(f"unknown arm {arm!r}")
    return out, FaultStats(counters)["detected"]


def metrics(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(percentage of non-finite elements, relative RMSE or NaN)."""
    bad = ~torch.isfinite(out)
    pct = 100.0 * float(bad.float().mean())
    if bad.any():
        return pct, float("nan")
    return pct, float((out.double() - ref).norm() / ref.norm())


def plot(rows: list[dict], img_dir: Path, shape_note: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    styles = {"fp32": "k-o", "partial": "r-s", "pasa": "b-^", "pasa_fp16": "c-v", "pasa_seedmean": "m-.d",
              "pasa_efta": "g--x"}
    for dist, title in (("uniform", "uniform U(x0-Am, x0+Am)"), ("hybrid", "hybrid N(x0,1)+N(0,Am²)·B(0.001)")):
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        for ax, sweep in zip(axes, (f"{dist}_x0", f"{dist}_am"), strict=True):
            sub = [r for r in rows if r["sweep"] == sweep]
            if not sub:
                ax.set_visible(False)
                continue
            var = SWEEPS[sweep][1]
            xs = [r[var] for r in sub]
            for arm in ARMS:
                ys = [r[f"{arm}_rmse"] for r in sub]
                ax.plot(xs, [y if math.isfinite(y) else float("nan") for y in ys], styles[arm], label=LABELS[arm],
                        markersize=5)
                for x, y, r in zip(xs, ys, sub, strict=True):
                    if not math.isfinite(y):
                        ax.annotate(f"NaN {r[f'{arm}_nan_pct']:.3g}%", (x, 0.5), xycoords=("data", "axes fraction"),
                                    rotation=90, color=styles[arm][0], fontsize=7, ha="center")
            ax.set_yscale("log")
            ax.set_xlabel(var)
            ax.set_ylabel("relative RMSE vs float64")
            fixed = "Am" if var == "x0" else "x0"
            ax.set_title(f"{title}, {fixed} = {SWEEPS[sweep][3]:g}", fontsize=9)
            ax.grid(True, which="both", alpha=0.3)
        axes[0].legend(fontsize=7, loc="upper left")
        fig.suptitle(f"the PASA paper random benchmark, {shape_note}", fontsize=10)
        fig.tight_layout()
        path = img_dir / f"pasa_{dist}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def markdown(rows: list[dict]) -> str:
    lines = ["| sweep | x0 | Am | " + " | ".join(f"{a} NaN% | {a} RMSE" for a in ARMS) + " | PASA+EFTA detections |",
             "|" + "---|" * (3 + 2 * len(ARMS) + 1)]
    for r in rows:
        cells = []
        for a in ARMS:
            cells.append(f"{r[f'{a}_nan_pct']:.3g}")
            y = r[f"{a}_rmse"]
            cells.append("NaN" if not math.isfinite(y) else f"{y:.2e}")
        lines.append(f"| {r['sweep']} | {r['x0']:g} | {r['Am']:g} | " + " | ".join(cells)
                     + f" | {r['pasa_efta_detected']} |")
    lines += ["", "Table 4 of the PASA paper (partially low-precision FA, NaN percentage of the output):", "",
              "| # | distribution | x0 | Am | seed | partial (here) | PASA (here) | PASA+EFTA (here) |",
              "|---|---|---|---|---|---|---|---|"]
    for i, (dist, x0, am, seed_pct) in enumerate(TABLE4, 1):
        r = next((r for r in rows if r["dist"] == dist and r["x0"] == x0 and r["Am"] == am
                  and r["sweep"].endswith("_am" if x0 == 20 else "_x0")), None)
        if r is None:
            continue
        lines.append(f"| {i} | {dist} | {x0} | {am} | {seed_pct} | {r['partial_nan_pct']:.3g}% | "
                     f"{r['pasa_nan_pct']:.3g}% | {r['pasa_efta_nan_pct']:.3g}% |")
    return "\n".join(lines) + "\n"


def coverage(trials: int = 25, seed: int = 11) -> str:
    """The ``--coverage`` campaign; returns a markdown table."""
    from ft_transformers import FaultSpec, efta_attention

    gen = torch.Generator().manual_seed(seed)
    lines = ["| x0 | mode | site | bit | detected | corrected | recomputed | wrong unprotected | "
             "wrong undetected (protected) |", "|---|---|---|---|---|---|---|---|---|"]
    sites = ("attn.scores", "attn.rowmax", "attn.probs", "attn.rowsum", "attn.output")
    jobs = [(x0, pasa, site, bit) for x0 in (0.0, 30.0) for pasa in (False, True) for site in sites
            for bit in (30, 26, 22)]
    data = {}
    for x0 in (0.0, 30.0):
        q = (x0 + 0.5 * (2 * torch.rand(1, 2, 64, 128, generator=gen) - 1)).half()
        k = (x0 + 0.5 * (2 * torch.rand(1, 2, 160, 128, generator=gen) - 1)).half()
        v = (2 * torch.rand(1, 2, 160, 128, generator=gen) - 1).half()  # zero mean: lost keys show
        data[x0] = (q, k, v)
    with torch.no_grad():
        for x0, pasa, site, bit in tqdm(jobs, desc="coverage", unit="cell"):
            q, k, v = data[x0]
            clean, _ = efta_attention(q, k, v, pasa=pasa)
            tol = 1e-3 * float(clean.float().abs().max())
            det = cor = rec = wrong_u = wrong_p = 0
            for t in range(trials):
                spec = FaultSpec(site=site, bit=bit, count=1, seed=t)
                out, st = efta_attention(q, k, v, pasa=pasa, inject=spec)
                bad, _ = efta_attention(q, k, v, pasa=pasa, inject=spec, detect=False, correct=False)
                det += st["detected"] > 0
                cor += st["corrected"]
                rec += st["recomputed"]
                wrong_u += not bool(((bad.float() - clean.float()).abs() <= tol).all())
                wrong_p += st["detected"] == 0 and not bool(((out.float() - clean.float()).abs() <= tol).all())
            lines.append(f"| {x0:g} | {'PASA+EFTA' if pasa else 'EFTA'} | {site} | {bit} | {det}/{trials} | {cor} | "
                         f"{rec} | {wrong_u} | {wrong_p} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="1,16,1280,128", help="B,H,S,D (default: the paper's 1,16,1280,128)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="three points per sweep")
    ap.add_argument("--sweeps", default=",".join(SWEEPS), help="comma-separated subset of " + ",".join(SWEEPS))
    ap.add_argument("--csv", type=Path, default=Path("docs/img/pasa_study.csv"))
    ap.add_argument("--md", type=Path, default=Path("docs/img/pasa_study.md"))
    ap.add_argument("--img-dir", type=Path, default=Path("docs/img"))
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--coverage", action="store_true", help="run the bit-flip campaign instead (see above)")
    args = ap.parse_args(argv)
    if args.coverage:
        print(coverage())
        return
    try:
        shape = tuple(int(x) for x in args.shape.split(","))
    except ValueError:
        ap.error(f"--shape must be B,H,S,D integers, got {args.shape!r}")
    if len(shape) != 4 or min(shape) < 1:
        ap.error(f"--shape must be four positive integers B,H,S,D, got {args.shape!r}")
    sweeps = [s for s in args.sweeps.split(",") if s]
    for s in sweeps:
        if s not in SWEEPS:
            ap.error(f"unknown sweep {s!r}; choose from {', '.join(SWEEPS)}")
    scale = 1.0 / math.sqrt(shape[-1])

    points = []
    for sweep in sweeps:
        dist, var, values, fixed = SWEEPS[sweep]
        for val in (QUICK[sweep] if args.quick else values):
            x0, am = (val, fixed) if var == "x0" else (fixed, val)
            points.append((sweep, dist, float(x0), float(am)))
    rows = []
    t0 = time.perf_counter()
    with torch.no_grad():
        for i, (sweep, dist, x0, am) in enumerate(tqdm(points, desc="pasa study", unit="case")):
            q, k, v = make_inputs(dist, x0, am, shape, args.seed + i)
            ref = reference(q, k, v, scale)
            row = {"sweep": sweep, "dist": dist, "x0": x0, "Am": am}
            for arm in ARMS:
                out, det = run_arm(arm, q, k, v, scale)
                row[f"{arm}_nan_pct"], row[f"{arm}_rmse"] = metrics(out, ref)
                if arm == "pasa_efta":
                    row["pasa_efta_detected"] = det
            rows.append(row)
    elapsed = time.perf_counter() - t0

    for path in (args.csv, args.md):
        path.parent.mkdir(parents=True, exist_ok=True)
    with args.csv.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    note = f"shape (B, H, S, D) = {shape}, seed {args.seed}, {len(rows)} cases, {elapsed:.0f} s"
    args.md.write_text(f"<!-- {note} -->\n" + markdown(rows))
    print(markdown(rows))
    print(note)
    if not args.no_plots:
        args.img_dir.mkdir(parents=True, exist_ok=True)
        for p in plot(rows, args.img_dir, f"(B, H, S, D) = {shape}"):
            print("wrote", p)
    print("wrote", args.csv, args.md)


if __name__ == "__main__":
    main()
