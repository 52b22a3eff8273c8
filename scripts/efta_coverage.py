"""Detection / correction rates of EFTA (reference path, fp32) per injection site and bit.

For every (site, bit) it runs ``--n`` calls with one flip each (different seeds), protected and
unprotected, and prints a table:

- ``det``: calls with ``detected ≥ 1``;
- ``corr`` / ``reco``: calls whose faults were all corrected in place / needed a recompute;
- ``exact``: protected output within ``--tol`` of the clean output;
- ``harm``: unprotected (``detect=False``) output off by more than ``--harm`` (or non-finite);
- ``esc``: harmful flips the protected call did *not* detect (escapes; should be 0);
- ``sdc``: protected output off by more than ``--harm`` (silent corruption left; should be 0).

Usage: ``python scripts/efta_coverage.py [--n 200] [--bits 0,10,16,20,22,27,28,29,30,31]``
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from ft_transformers.efta import efta_attention
from ft_transformers.injection import FaultPlan, FaultSpec
from ft_transformers.sites import ATTENTION_SITES


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    d = (a.double() - b.double()).abs().max().item()
    return math.inf if math.isnan(d) else d


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200, help="injections per (site, bit)")
    ap.add_argument("--bits", default="0,10,16,20,22,27,28,29,30,31")
    ap.add_argument("--shape", default="2,4,2,64,200,64", help="B,Hq,Hkv,M,N,D")
    ap.add_argument("--no-causal", action="store_true")
    ap.add_argument("--tol", type=float, default=2e-4)
    ap.add_argument("--harm", type=float, default=1e-3)
    ap.add_argument("--clean-calls", type=int, default=200)
    args = ap.parse_args()
    B, Hq, Hkv, M, N, D = (int(x) for x in args.shape.split(","))
    bits = [int(b) for b in args.bits.split(",")]
    causal = not args.no_causal
    torch.manual_seed(0)
    t0 = time.time()

    # false positives on clean calls (fresh data each call)
    fp = 0
    for i in range(args.clean_calls):
        g = torch.Generator().manual_seed(10_000 + i)
        q = torch.randn(B, Hq, M, D, generator=g) + (i % 2)
        k = torch.randn(B, Hkv, N, D, generator=g)
        v = torch.randn(B, Hkv, N, D, generator=g)
        with torch.no_grad():
            _, st = efta_attention(q, k, v, causal=causal, backend="reference")
        fp += st["detected"] > 0
    print(f"clean calls: {args.clean_calls}, calls with a false positive: {fp}")

    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, Hq, M, D, generator=g)
    k = torch.randn(B, Hkv, N, D, generator=g)
    v = torch.randn(B, Hkv, N, D, generator=g)
    with torch.no_grad():
        clean, st = efta_attention(q, k, v, causal=causal, backend="reference")
    assert st["detected"] == 0
    print(f"shape B,Hq,Hkv,M,N,D = {B},{Hq},{Hkv},{M},{N},{D}  causal={causal}  fp32  "
          f"{args.n} single-bit injections per row\n")
    hdr = (f"{'site':<12} {'bit':>3} | {'det':>6} {'corr':>6} {'reco':>6} {'exact':>6} | "
           f"{'harm':>6} {'esc':>4} {'sdc':>4}")
    print(hdr)
    print("-" * len(hdr))
    for site in ATTENTION_SITES:
        for bit in bits:
            det = corr = reco = exact = harm = esc = sdc = 0
            for seed in range(args.n):
                spec = FaultSpec(site=site, bit=bit, seed=seed)
                plan = FaultPlan(spec)
                with torch.no_grad():
                    out, st = efta_attention(q, k, v, causal=causal, inject=plan, backend="reference")
                    bare, _ = efta_attention(q, k, v, causal=causal, inject=spec, detect=False,
                                             backend="reference")
                assert plan.injected == 1
                d = st["detected"] > 0
                det += d
                corr += d and st["recomputed"] == 0
                reco += st["recomputed"] > 0
                err = _maxdiff(out, clean)
                exact += err <= args.tol
                sdc += err > args.harm
                h = _maxdiff(bare, clean) > args.harm
                harm += h
                esc += h and not d
            pct = lambda c: f"{100.0 * c / args.n:5.1f}%"
            print(f"{site:<12} {bit:>3} | {pct(det)} {pct(corr)} {pct(reco)} {pct(exact)} | "
                  f"{pct(harm)} {esc:>4} {sdc:>4}")
    print(f"\n{time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
