"""EFTA coverage campaign: detection / correction per injection site and bit, and false positives.

Three parts, each optional:

1. **False positives** (``--clean-calls``): clean ``efta_attention`` calls on fresh inputs drawn in
   turn from the four distributions of the V-ABFT specification §5.1 (N(1e-6,1), N(1,1), U(-1,1), truncated
   N(0,1)); counts the calls that raised any event (must be 0).
2. **Real activations** (``--model``): a protected model run (``minilm`` = the embedded
   all-MiniLM-L6-v2 over a few sentences, ``smollm2`` = the embedded SmolLM2 generating, a local
   folder — a BERT encoder or a causal LM — or a hub id) with the attention checks on; counts
   attention calls and detections. (For a machine without the embedded packages, an fp16 copy of
   MiniLM fits in a device call: ``python -c "from ft_transformers.embedded import minilm_dir;
   from transformers import AutoModel as A; A.from_pretrained(minilm_dir(), dtype='float16')
   .save_pretrained('.gpucarry/minilm')"`` plus its tokenizer files.)
3. **Injections** (``--n`` per row): at each attention site (``--sites``, default all, ``attn.kv_cache``
   included: a stored K or V entry flipped before the call, the protected call reading the cache's
   stored checksum tables made before the flip), single bit flips
   either at fixed bits (``--bits``) or at a random bit of a class (``--classes sign,exponent,mantissa``
   of the value's storage format at the site: bit 31, bits 23–30, bits 0–22 of fp32; bit 15, bits
   10–14, bits 0–9 of fp16; bit 15, bits 7–14, bits 0–6 of bf16 — ``attn.probs_lp`` is stored in the
   input dtype), each call protected and unprotected. Per row:

   - ``det``: calls with ``detected ≥ 1``; ``corr`` / ``reco``: calls whose faults were all corrected
     in place / needed a recompute;
   - ``exact``: protected output within ``--tol`` of the clean output; ``err``: the largest
     protected-vs-clean difference left (the residual error after correction);
   - ``harm``: unprotected output off by more than ``--harm`` (or non-finite);
   - ``esc``: escapes (``docs/reliability.md``): flips that no check flagged and that moved the output
     beyond the clean tolerance ``ctol`` (the largest difference between the clean output and float64
     attention on the same inputs, printed with the table); ``sdc``: protected output off by more than
     ``--harm`` (silent corruption left, detected or not). Both should be 0.
   - ``esc_impl``: the same against ``ctol_impl``, SPEC §7's "largest difference between two correct
     implementations" taken over three: the call's backend, the reference path and float64 (on the
     kernel's backend the kernel and the reference path round some outputs one ulp apart, which ``ctol``
     alone need not reach); ``und``: the largest change among the flips no check flagged.

``--backend auto`` uses the Triton kernel on CUDA and the reference on CPU. Writes ``--json``
(everything) and ``--csv`` (the injection table) if given; progress bars on stderr.

    python scripts/efta_coverage.py --n 200 --clean-calls 200                      # CPU, reference
    python scripts/efta_coverage.py --quick                                         # CPU smoke run (seconds)
    python3 scripts/efta_coverage.py --device cuda --dtype float16 --n 1000 \\
        --classes sign,exponent,mantissa --clean-calls 100000 --model minilm      # GPU campaign
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
import time
import zlib

import torch
from ft_transformers.kernels.contract import ATTENTION_SITES, CACHE_SITES, site_dtype
from tqdm import tqdm

from ft_transformers.efta import efta_attention
from ft_transformers.injection import FaultPlan, FaultSpec
from ft_transformers.kv_checksums import KVChecksums

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import device_label, versions  # noqa: E402
from calibrate_emax import sample_matrix  # noqa: E402

# bit classes of a value's storage format: (sign, exponent, mantissa) bit ranges
CLASSES = {
    torch.float32: {"sign": (31, 31), "exponent": (23, 30), "mantissa": (0, 22)},
    torch.float16: {"sign": (15, 15), "exponent": (10, 14), "mantissa": (0, 9)},
    torch.bfloat16: {"sign": (15, 15), "exponent": (7, 14), "mantissa": (0, 6)},
}
QUICK = dict(n=4, clean_calls=8, shape="1,2,1,8,100,32")  # --quick: a CPU smoke run
DISTS = ("N(1e-6,1)", "N(1,1)", "U(-1,1)", "TN(0,1)")


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    d = (a.double() - b.double()).abs().max().item()
    return math.inf if math.isnan(d) else d


def _qkv(shape, dist: str, g: torch.Generator, dtype: torch.dtype):
    B, Hq, Hkv, M, N, D = shape
    return (sample_matrix(dist, (B, Hq, M, D), g).to(dtype), sample_matrix(dist, (B, Hkv, N, D), g).to(dtype),
            sample_matrix(dist, (B, Hkv, N, D), g).to(dtype))


def clean_calls(n: int, shape, causal: bool, dtype, device, backend: str, progress: bool) -> dict:
    """``n`` clean calls over the four distributions; returns counts per distribution."""
    g = torch.Generator(device=device).manual_seed(10_000)
    per = {d: {"calls": 0, "calls_with_events": 0, "events": 0} for d in DISTS}
    for i in tqdm(range(n), desc="clean calls", disable=not progress):
        dist = DISTS[i % len(DISTS)]
        q, k, v = _qkv(shape, dist, g, dtype)
        with torch.no_grad():
            _, st = efta_attention(q, k, v, causal=causal, backend=backend)
        ev = st["detected"] + st["nonfinite_input"]
        per[dist]["calls"] += 1
        per[dist]["calls_with_events"] += ev > 0
        per[dist]["events"] += ev
    return per


def model_calls(name: str, device: str, dtype: torch.dtype) -> dict:
    """Protected run of a real model; attention calls and attention events."""
    import ft_transformers as ftt
    from ft_transformers import embedded

    encoder = name == "minilm"
    path = embedded.minilm_dir() if encoder else name
    if not encoder and os.path.isdir(name):  # a local folder: an encoder if its config says BERT
        with open(os.path.join(name, "config.json")) as f:
            encoder = json.load(f).get("model_type") == "bert"
    if encoder:
        from transformers import AutoModel, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModel.from_pretrained(path, attn_implementation="efta", dtype=dtype).to(device).eval()
        ftt.enable_fault_tolerance(model, ftt.FTConfig(linear=False))
        texts = [f"Sentence number {i} about {w} and the weather in spring." for i, w in
                 enumerate(["cats", "rivers", "compilers", "soft errors", "graphs", "music", "tea", "ships"] * 8)]
        with torch.no_grad():
            for i in range(0, len(texts), 8):
                batch = tok(texts[i:i + 8], return_tensors="pt", padding=True).to(device)
                model(**batch)
        layers = model.config.num_hidden_layers
    else:
        model, tok = embedded.load_causal_lm(name, dtype=dtype, attn_implementation="efta", device=device)
        ftt.enable_fault_tolerance(model, ftt.FTConfig(linear=False))
        msgs = ["What is the capital of France?", "Explain soft errors in one sentence.",
                "Write a haiku about GPUs."]
        with torch.no_grad():
            for m in msgs:
                ids = tok.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True,
                                              return_tensors="pt", return_dict=True).to(device)
                model.generate(**ids, max_new_tokens=32, do_sample=False)
        layers = model.config.num_hidden_layers
    rep = ftt.fault_report(model)
    events = [e for e in rep.events if e.site.startswith("attn.")]
    return {"model": name, "attention_layers": layers, "model_calls": rep.steps,
            "attention_calls": layers * rep.steps,
            "attention_events": sum(e.count for e in events if e.kind in ("detected", "nonfinite_input"))}


def _float64_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """softmax(q·kᵀ/√D)·v in float64 (GQA by repetition, bottom-right causal): the clean tolerance's oracle."""
    q, k, v = q.double(), k.double(), v.double()
    M, N = q.shape[2], k.shape[2]
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        hide = torch.arange(N, device=q.device)[None, :] > torch.arange(M, device=q.device)[:, None] + (N - M)
        s = s.masked_fill(hide, -math.inf)
    return torch.softmax(s, dim=-1) @ v


def _site_bits(site: str, dtype: torch.dtype, args) -> list[tuple[str, tuple[int, int]]]:
    """The rows of one site: fixed bits (``--bits``, those the site's storage format has), or classes."""
    store = site_dtype(site, dtype)
    if args.bits:
        nbits = torch.finfo(store).bits
        return [(f"bit {b}", (b, b)) for b in (int(x) for x in args.bits.split(",")) if b < nbits]
    return [(c, CLASSES[store][c]) for c in args.classes.split(",")]


def injections(args, shape, causal, dtype, device) -> tuple[list[dict], tuple[float, float]]:
    """The injection table (one row per site and bit class) and the clean tolerances it used (``ctol``,
    ``ctol_impl``)."""
    g = torch.Generator(device=device).manual_seed(1)
    q, k, v = _qkv(shape, "N(1e-6,1)", g, dtype)
    with torch.no_grad():
        clean, st = efta_attention(q, k, v, causal=causal, backend=args.backend)
    if st["detected"]:
        raise RuntimeError(f"the clean reference call raised events: {dict(st)}")
    exact = _float64_attention(q, k, v, causal)
    ctol = _maxdiff(clean, exact)
    ctol_impl = ctol
    if args.backend != "reference" and q.is_cuda:  # the kernel's clean output against the reference path's
        with torch.no_grad():
            other, _ = efta_attention(q, k, v, causal=causal, backend="reference")
        ctol_impl = max(ctol, _maxdiff(clean, other), _maxdiff(other, exact))
    sites = args.sites.split(",") if args.sites else list(ATTENTION_SITES + CACHE_SITES)
    plan_rows = [(site, label, lo_hi) for site in sites for label, lo_hi in _site_bits(site, dtype, args)]
    rows = []
    bar = tqdm(total=len(plan_rows) * args.n, desc="injections", disable=args.no_progress)
    for site, label, (lo, hi) in plan_rows:
        c = dict(site=site, bits=label, n=args.n, det=0, corr=0, reco=0, exact=0, harm=0, esc=0, sdc=0,
                 max_err=0.0, esc_impl=0, und=0.0)
        rng = torch.Generator().manual_seed(zlib.crc32(f"{site}/{label}".encode()))
        for seed in range(args.n):
            bit = int(torch.randint(lo, hi + 1, (1,), generator=rng))
            spec = FaultSpec(site=site, bit=bit, seed=seed)
            plan = FaultPlan(spec)
            with torch.no_grad():
                if site in CACHE_SITES:  # flips k or v in place: each call on its own copy, the protected one
                    # with the cache's stored tables (made before the flip, as when the tokens entered it)
                    kp, vp = k.clone(), v.clone()
                    kvc = KVChecksums(args.backend)
                    kvc.extend(kp, vp, 0, kp.shape[2])
                    out, st = efta_attention(q, kp, vp, causal=causal, inject=plan, backend=args.backend,
                                             kv_checksums=kvc)
                    bare, _ = efta_attention(q, k.clone(), v.clone(), causal=causal, inject=spec, detect=False,
                                             backend=args.backend)
                else:
                    out, st = efta_attention(q, k, v, causal=causal, inject=plan, backend=args.backend)
                    bare, _ = efta_attention(q, k, v, causal=causal, inject=spec, detect=False, backend=args.backend)
            if plan.injected != 1:
                raise RuntimeError(f"expected one flip, got {plan.injected} ({site}, bit {bit}, seed {seed})")
            d = st["detected"] > 0
            err = _maxdiff(out, clean)
            h = _maxdiff(bare, clean) > args.harm
            c["det"] += d
            c["corr"] += d and st["recomputed"] == 0
            c["reco"] += st["recomputed"] > 0
            c["exact"] += err <= args.tol
            c["sdc"] += err > args.harm
            c["harm"] += h
            c["esc"] += err > ctol and not d
            c["esc_impl"] += err > ctol_impl and not d
            c["und"] = c["und"] if d else max(c["und"], err)
            c["max_err"] = max(c["max_err"], err)
            bar.update()
        rows.append(c)
    bar.close()
    return rows, (ctol, ctol_impl)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help=f"a CPU smoke run: {QUICK['n']} flips per row, {QUICK['clean_calls']} clean calls, "
                         f"shape {QUICK['shape']} (overrides --n, --clean-calls, --shape)")
    ap.add_argument("--n", type=int, default=200, help="injections per (site, bit or class); 0: none")
    ap.add_argument("--sites", default=None, help="comma-separated attention sites (default: all)")
    ap.add_argument("--bits", default=None, help="fixed bits, e.g. 0,10,16,20,22,27,28,29,30,31")
    ap.add_argument("--classes", default="sign,exponent,mantissa", help="bit classes (when --bits is not given)")
    ap.add_argument("--shape", default="2,4,2,64,200,64", help="B,Hq,Hkv,M,N,D")
    ap.add_argument("--no-causal", action="store_true")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default="auto", choices=["auto", "triton", "reference"])
    ap.add_argument("--tol", type=float, default=None, help="'exact' tolerance (default: 2e-4 fp32, 2e-3 else)")
    ap.add_argument("--harm", type=float, default=None, help="harm threshold (default: 1e-3 fp32, 1e-2 else)")
    ap.add_argument("--clean-calls", type=int, default=200)
    ap.add_argument("--model", default=None, help="minilm | smollm2 | path: count events over a real run")
    ap.add_argument("--json", default=None)
    ap.add_argument("--csv", default=None)
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.n, args.clean_calls, args.shape = QUICK["n"], QUICK["clean_calls"], QUICK["shape"]
    if args.sites and not set(args.sites.split(",")) <= set(ATTENTION_SITES + CACHE_SITES):
        ap.error(f"--sites: choose among {', '.join(ATTENTION_SITES + CACHE_SITES)}")
    shape = tuple(int(x) for x in args.shape.split(","))
    if len(shape) != 6:
        ap.error("--shape needs six integers B,Hq,Hkv,M,N,D")
    dtype = getattr(torch, args.dtype)
    low = dtype != torch.float32
    args.tol = args.tol if args.tol is not None else (2e-3 if low else 2e-4)
    args.harm = args.harm if args.harm is not None else (1e-2 if low else 1e-3)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("--device cuda but no CUDA device is available")
    causal = not args.no_causal
    t0 = time.time()
    result: dict = {"args": vars(args), "versions": versions(), "device": device_label(args.device)}
    print(f"device {result['device']}, dtype {args.dtype}, backend {args.backend}, shape B,Hq,Hkv,M,N,D = "
          f"{args.shape}, causal={causal}", flush=True)

    if args.clean_calls:
        per = clean_calls(args.clean_calls, shape, causal, dtype, args.device, args.backend, not args.no_progress)
        result["clean"] = per
        for d, c in per.items():
            print(f"clean {d:10s}: {c['calls']} calls, {c['calls_with_events']} with events", flush=True)
    if args.model:
        mc = model_calls(args.model, args.device, dtype)
        result["model"] = mc
        print(f"model {mc['model']}: {mc['attention_layers']} attention layers × {mc['model_calls']} model calls "
              f"= {mc['attention_calls']} attention calls, {mc['attention_events']} attention events", flush=True)
    if args.n:
        rows, (ctol, ctol_impl) = injections(args, shape, causal, dtype, args.device)
        result["injections"] = rows
        result["clean_tolerance"] = ctol
        result["clean_tolerance_impl"] = ctol_impl
        hdr = (f"{'site':<14} {'bits':>9} | {'det':>6} {'corr':>6} {'reco':>6} {'exact':>6} {'err':>8} | "
               f"{'harm':>6} {'esc':>4} {'sdc':>4} | {'und':>8} {'esc_impl':>8}")
        print(f"\n{args.n} single-bit injections per row; clean tolerance ctol = {ctol:.2e} (against float64), "
              f"ctol_impl = {ctol_impl:.2e} (over the backend, the reference path and float64)\n" + hdr + "\n"
              + "-" * len(hdr))
        for c in rows:
            pct = lambda x, c=c: f"{100.0 * x / c['n']:5.1f}%"
            print(f"{c['site']:<14} {c['bits']:>9} | {pct(c['det'])} {pct(c['corr'])} {pct(c['reco'])} "
                  f"{pct(c['exact'])} {c['max_err']:8.1e} | {pct(c['harm'])} {c['esc']:>4} {c['sdc']:>4} | "
                  f"{c['und']:8.1e} {c['esc_impl']:>8}")
        if args.csv:
            with open(args.csv, "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=list(rows[0]))
                w.writeheader()
                w.writerows(rows)
    result["seconds"] = time.time() - t0
    print(f"\n{result['seconds']:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
