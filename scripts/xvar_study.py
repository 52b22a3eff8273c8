"""Which estimate of x's row variance the checked linear's group threshold should take (SPEC §5's σ²_A).

The threshold of a (row, 64-column group) grows with σ_A. Three estimates, on the same clean checks:

* ``bound``  — SPEC §5's Bhatia–Davis bound ``(max − μ)(μ − min)`` (the library's default);
* ``exact``  — the row's variance (tight on Gaussian rows: a third of the bound's σ at K = 576–896,
  so a third of the largest undetected change on an lm_head; but it understates the rounding of rows
  whose few outliers dominate the dot products);
* ``outlier`` — the variance plus ``max|x − μ|² / √K``: on a Gaussian row (max ≈ 3σ) about 1.4× the
  variance at K = 576, on a row whose one outlier holds its variance about √K× it;
* ``xvar`` — the outlier estimate as the library computes it with ``FTT_GEMM_XVAR=1``
  (`ft_transformers.kernels.gemm_checksums.row_stats` with ``xvar``: fp32, a guard against the cancellation
  of Σx²/K − μ², never above the bound).

For every Linear of a real model on the CPU (reference path, fp32 product against float64 checksums), it
prints per layer class the largest clean ratio E/T under each estimate with the CPU e_max of the bound
(the table's entry for the bound, so that the columns compare the estimates alone), the largest
``|D| / T(e_max = 1)`` under ``xvar`` (the smallest e_max without a false positive on these activations),
and for Gaussian lm_head rows the thresholds' ratio to ``exact``'s. A clean E/T above 1 is a false positive.

    python scripts/xvar_study.py --model smollm2 --prompts 3
    python scripts/xvar_study.py --model minilm
"""

from __future__ import annotations

import argparse
import math
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ft_transformers.kernels.gemm_checksums import group_checksums, group_threshold, row_stats  # noqa: E402
from tightness import capture, linear_class, smollm2_prompts  # noqa: E402

from ft_transformers.checked_linear import group_residuals  # noqa: E402
from ft_transformers.vabft import default_emax  # noqa: E402

ESTIMATES = ("bound", "exact", "outlier", "xvar")


def row_variance(x: torch.Tensor, how: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(μ, σ²) of each row of x (M, K) in float64 under estimate ``how``: two (M, 1) tensors."""
    if how == "xvar":
        mu, var = row_stats(x.float(), dim=1, xvar=True)
        return mu.double().unsqueeze(1), var.double().unsqueeze(1)
    x = x.double()
    mu = x.mean(1, keepdim=True)
    if how == "bound":
        return mu, ((x.amax(1, keepdim=True) - mu) * (mu - x.amin(1, keepdim=True))).clamp_min(0)
    var = (x - mu).square().mean(1, keepdim=True)
    if how == "exact":
        return mu, var
    return mu, var + (x - mu).abs().amax(1, keepdim=True).square() / math.sqrt(x.shape[1])


def estimated_threshold(x: torch.Tensor, consts: torch.Tensor, emax: float, how: str, csigma: float = 2.5
                    ) -> torch.Tensor:
    """SPEC §5's threshold over each group's n_g columns (`group_checksums`' constants (T, 8)) with x's
    row statistics from ``how``: (M, T) float64."""
    mu, var = row_variance(x, how)
    return group_threshold(mu, var, consts.double(), emax, csigma)


def study_model(model_name: str, prompts: int, max_rows: int) -> dict[str, dict[str, float]]:
    """Largest clean E/T per layer class and estimate over the model's Linear calls on ``prompts`` (and
    ``"xvar_T1"``: the largest |D| / T(e_max = 1) under ``xvar``)."""
    if model_name == "minilm":  # the embedded all-MiniLM-L6-v2 over the campaign's prompts as sentences
        from tightness import PROMPTS
        from transformers import AutoModel, AutoTokenizer

        from ft_transformers.embedded import minilm_dir

        path = minilm_dir()
        model, tok = AutoModel.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
        ids = [tok(p, return_tensors="pt")["input_ids"] for p in PROMPTS[:prompts]]
    else:
        from ft_transformers.campaign.models import load_model

        model, tok = load_model(model_name, "float32", "cpu")
        ids = smollm2_prompts(tok, prompts)
    layers, _ = capture(model, ids, max_rows)
    worst: dict[str, dict[str, float]] = defaultdict(lambda: dict.fromkeys((*ESTIMATES, "xvar_T1"), 0.0))
    for lay in layers:
        k = lay.weight.shape[1]
        emax = default_emax(torch.float32, "cpu", "output", k=k, xvar=False)
        consts = group_checksums(lay.weight, lay.bias)[1]
        for x in lay.inputs:
            d, _ = group_residuals(x, lay.weight, lay.bias)
            cls = linear_class(lay.name)
            for how in ESTIMATES:
                r = float((d.double().abs() / estimated_threshold(x, consts, emax, how)).max())
                worst[cls][how] = max(worst[cls][how], r)
                if how == "xvar":
                    worst[cls]["xvar_T1"] = max(worst[cls]["xvar_T1"], r * emax)
    return dict(worst)


def gaussian_ratios(k: int, rows: int = 256, seed: int = 0) -> dict[str, float]:
    """Median threshold of each estimate over ``exact``'s on Gaussian rows of K values (an lm_head's input)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * 4
    w = torch.randn(128, k, generator=g) * k**-0.5
    consts = group_checksums(w, None)[1]
    base = estimated_threshold(x, consts, 1.0, "exact")
    return {how: float((estimated_threshold(x, consts, 1.0, how) / base).median()) for how in ESTIMATES}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "minilm"])
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-rows", type=int, default=64)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    for k in (576, 896):
        r = gaussian_ratios(k)
        print(f"Gaussian rows, K = {k}: threshold / exact's: " + ", ".join(f"{h} {v:.2f}" for h, v in r.items()))
    worst = study_model(a.model, a.prompts, a.max_rows)
    print(f"\n{a.model}, CPU fp32, largest clean E/T per layer class (above 1: a false positive), e_max "
          f"{default_emax(torch.float32, 'cpu', 'output', xvar=False):.3g}; last column: |D| / T(e_max = 1) under xvar")
    print("| layer class | " + " | ".join(ESTIMATES) + " | xvar: |D|/T1 |")
    print("|---|" + "---|" * (len(ESTIMATES) + 1))
    for cls, r in sorted(worst.items()):
        print(f"| {cls} | " + " | ".join(f"{r[h]:.3f}" for h in ESTIMATES) + f" | {r['xvar_T1']:.3g} |")


if __name__ == "__main__":
    main()
