#!/usr/bin/env python
"""Do the EFTA kernel and the reference path see the same faults? The same single-bit flips through both.

For one injection site and a range of bits, every trial draws a bit and a seed, runs the protected
`efta_attention` call on the Triton backend and on the reference path with the same inputs and the same
`FaultSpec`, and records on each whether the call detected the flip and how far its output moved from that
backend's clean output. At ``attn.kv_cache`` each call gets a fresh copy of the cache and the cache's
checksum tables made before the flip (`KVChecksums`), as when the tokens entered it. Prints the trials where
the backends disagree, or where neither detected a flip that moved the output, then the detection counts.

On a CPU the Triton backend runs under the interpreter (set ``TRITON_INTERPRET=1``): about 3 s a trial at the
default shape.

    TRITON_INTERPRET=1 python scripts/efta_backend_agreement.py --dtype bfloat16 --bits 0-6 --n 300
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from ft_transformers.kernels.contract import CACHE_SITES
from tqdm import tqdm

from ft_transformers import FaultSpec, efta_attention
from ft_transformers.injection import FaultPlan
from ft_transformers.kv_checksums import KVChecksums

BACKENDS = ("reference", "triton")


def _call(q, k, v, spec: FaultSpec | None, backend: str, cached: bool):
    """One protected call on ``backend``: (output, detected, where the flip landed in k or v: ``[tensor,
    b, h, n, d]`` lists). ``cached``: k and v are a cache with tables made before the flip."""
    kp, vp = k.clone(), v.clone()
    kvc = None
    if cached:
        kvc = KVChecksums(backend)
        kvc.extend(kp, vp, 0, kp.shape[2])
    plan = FaultPlan(spec) if spec is not None else None
    with torch.no_grad():
        out, st = efta_attention(q, kp, vp, causal=True, inject=plan, backend=backend, kv_checksums=kvc)
    where = [["k", *i] for i in (kp != k).nonzero().tolist()] + [["v", *i] for i in (vp != v).nonzero().tolist()]
    return out.float(), st["detected"] > 0, where


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--site", default="attn.kv_cache")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--shape", default="1,2,1,64,256,64", help="B,Hq,Hkv,M,N,D")
    ap.add_argument("--bits", default="0-6", help="lo-hi: each trial draws a bit in [lo, hi]")
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--json", default=None, help="every trial, both backends")
    args = ap.parse_args()
    B, Hq, Hkv, M, N, D = (int(x) for x in args.shape.split(","))
    lo, hi = (int(x) for x in args.bits.split("-"))
    if not 0 <= lo <= hi or args.n < 1:
        ap.error("--bits lo-hi with 0 <= lo <= hi, and --n >= 1")
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, h, n, D, generator=g).to(dtype) for h, n in ((Hq, M), (Hkv, N), (Hkv, N)))
    cached = args.site in CACHE_SITES
    clean = {be: _call(q, k, v, None, be, cached)[0] for be in BACKENDS}
    rng = torch.Generator().manual_seed(7)
    trials = []
    for seed in tqdm(range(args.n), desc="trials"):
        bit = int(torch.randint(lo, hi + 1, (1,), generator=rng))
        t = {"seed": seed, "bit": bit}
        for be in BACKENDS:
            out, det, where = _call(q, k, v, FaultSpec(site=args.site, bit=bit, seed=seed), be, cached)
            t[be] = {"detected": det, "change": float((out - clean[be]).abs().max()), "where": where}
        trials.append(t)
    for t in trials:
        r, k_ = t["reference"], t["triton"]
        if r["detected"] != k_["detected"] or not (r["detected"] or k_["detected"]):
            print(f"seed {t['seed']:4d} bit {t['bit']:2d} at {(r['where'] or ['?'])[0]}: reference "
                  f"{'detected' if r['detected'] else 'missed'} (change {r['change']:.2e}), kernel "
                  f"{'detected' if k_['detected'] else 'missed'} (change {k_['change']:.2e})")
    det = {be: sum(t[be]["detected"] for t in trials) for be in BACKENDS}
    both = sum(t["reference"]["detected"] == t["triton"]["detected"] for t in trials)
    print(f"detected: reference {det['reference']}, kernel {det['triton']} of {args.n}; same verdict in {both}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "trials": trials}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
