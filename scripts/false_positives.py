#!/usr/bin/env python
"""Count false alarms: protected calls on clean data must report zero detections.

Part 1 — kernel level: `efta_attention` and `checked_linear` on four input distributions
(the V-ABFT specification §5.1: N(1e-6,1), N(1,1), U(-1,1), truncated N(0,1)), several shapes and dtypes.
Part 2 — real models: every attention and Linear call of SmolLM2-135M-Instruct generating
answers to a few prompts, and all-MiniLM-L6-v2 embedding sentences.
Part 3 (``--configs``) — architecture configs with random weights (``qwen2-0.5b-config``,
``gpt2-124m-config``, see `ft_transformers.campaign`): every call of a full generation from
byte-level prompts, on ``--device`` in ``--dtype`` (on CUDA: the Triton kernels).

    python scripts/false_positives.py --calls 1500 --prompts 3 --max-new-tokens 32
    python scripts/false_positives.py --calls 0 --skip-models --configs qwen2-0.5b-config gpt2-124m-config
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
from tqdm import tqdm

import ft_transformers as ftt

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from calibrate_emax import sample_matrix  # noqa: E402

DISTS = ("N(1e-6,1)", "N(1,1)", "U(-1,1)", "TN(0,1)")  # the V-ABFT specification §5.1


def kernel_level(calls: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    res = {"attention_calls": 0, "linear_calls": 0, "attention_rows": 0, "linear_rows": 0, "detected": 0}
    dtypes = [torch.float32, torch.bfloat16, torch.float16]
    for i in tqdm(range(calls), desc="kernel-level calls", unit="call"):
        name = DISTS[i % 4]

        def dist(g, shape, name=name):
            return sample_matrix(name, shape, g)

        dtype = dtypes[(i // 4) % 3]
        B, Hkv, G = 1 + i % 2, 2, 1 + (i % 3)
        M = int(torch.randint(1, 96, (1,), generator=g))
        N = M + int(torch.randint(0, 64, (1,), generator=g))
        D = (32, 64)[i % 2]
        q = dist(g, (B, Hkv * G, M, D)).to(dtype)
        k = dist(g, (B, Hkv, N, D)).to(dtype)
        v = dist(g, (B, Hkv, N, D)).to(dtype)
        _, st = ftt.efta_attention(q, k, v, causal=bool(i % 2))
        res["attention_calls"] += 1
        res["attention_rows"] += B * Hkv * G * M
        res["detected"] += st["detected"]
        K, Nout = (256, 512) if i % 2 else (512, 256)
        x = dist(g, (int(torch.randint(1, 64, (1,), generator=g)), K)).to(dtype)
        w = (dist(g, (Nout, K)) / math.sqrt(K)).to(dtype)
        b = dist(g, (Nout,)).to(dtype)
        _, st = ftt.checked_linear(x, w, b)
        res["linear_calls"] += 1
        res["linear_rows"] += x.shape[0]
        res["detected"] += st["detected"]
    return res


def _model_calls(report: ftt.FTReport) -> int:
    return report.steps


def _count_calls(model) -> tuple[dict, list]:
    """Forward hooks counting the protected attention and Linear calls: (counts, hook handles)."""
    counted = {"attention": 0, "linear": 0}

    def count_hook(kind):
        def hook(*_):
            counted[kind] += 1
        return hook

    handles = [m.register_forward_hook(count_hook("attention" if m._ftt.is_attention else "linear"))
               for m in model.modules() if getattr(m, "_ftt", None) is not None]
    return counted, handles


def real_models(prompts: int, max_new_tokens: int) -> dict:
    from ft_transformers.embedded import load_causal_lm

    questions = ["What is the capital of France?", "Explain photosynthesis in two sentences.",
                 "Write a haiku about the sea.", "List three prime numbers and say why they are prime.",
                 "How does a checksum detect an error?"][:prompts]
    model, tok = load_causal_lm("smollm2", attn_implementation="efta")
    ftt.enable_fault_tolerance(model)
    counted, handles = _count_calls(model)
    for q in tqdm(questions, desc="SmolLM2 prompts"):
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                           do_sample=False, pad_token_id=tok.eos_token_id)
    rep = ftt.fault_report(model)
    for h in handles:
        h.remove()
    out = {"smollm2_attention_calls": counted["attention"], "smollm2_linear_calls": counted["linear"],
           "smollm2_model_calls": rep.steps, "smollm2_detected": rep.totals()["detected"]}

    from transformers import AutoModel, AutoTokenizer

    from ft_transformers.embedded import minilm_dir

    path = minilm_dir()
    mtok = AutoTokenizer.from_pretrained(path)
    bert = AutoModel.from_pretrained(path, attn_implementation="efta").eval()
    ftt.enable_fault_tolerance(bert)
    sents = [f"Sentence number {i}: soft errors and checksums, {q}" for i, q in enumerate(questions * 8)]
    enc = mtok(sents, padding=True, return_tensors="pt")
    with torch.inference_mode():
        bert(**enc)
    rep = ftt.fault_report(bert)
    n_att = sum(1 for m in bert.modules() if getattr(m, "_ftt", None) is not None and m._ftt.is_attention)
    n_lin = sum(1 for m in bert.modules() if getattr(m, "_ftt", None) is not None and not m._ftt.is_attention)
    out.update({"minilm_attention_calls": n_att, "minilm_linear_calls": n_lin,
                "minilm_sequences": len(sents), "minilm_detected": rep.totals()["detected"]})
    return out


def config_models(names: list[str], prompts: int, max_new_tokens: int, device: str, dtype: str) -> dict:
    """Protected generation with random-weight architecture configs; counts calls and detections."""
    from ft_transformers.campaign import load_model

    texts = ["What is the capital of France?", "Explain photosynthesis in two sentences.",
             "Write a haiku about the sea.", "List three prime numbers.", "How does a checksum work?"][:prompts]
    out: dict = {}
    for name in names:
        model, tok = load_model(name, dtype, device)
        ftt.enable_fault_tolerance(model)
        counted, handles = _count_calls(model)
        for text in tqdm(texts, desc=name):
            ids = tok(text)["input_ids"].to(device)
            with torch.inference_mode():
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                               min_new_tokens=max_new_tokens, do_sample=False)
        rep = ftt.fault_report(model)
        for h in handles:
            h.remove()
        key = name.replace("-", "_").replace(".", "_")
        out.update({f"{key}_attention_calls": counted["attention"], f"{key}_linear_calls": counted["linear"],
                    f"{key}_model_calls": rep.steps, f"{key}_detected": rep.totals()["detected"]})
        del model
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=1500, help="kernel-level calls of each of efta and checked_linear")
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-models", action="store_true")
    p.add_argument("--configs", nargs="*", default=[], help="random-weight configs to run (part 3)")
    p.add_argument("--device", default="cpu", help="device of part 3")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"], help="dtype of part 3")
    p.add_argument("--json", default=None, help="write the counts here")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    res = kernel_level(args.calls, args.seed)
    if not args.skip_models:
        res.update(real_models(args.prompts, args.max_new_tokens))
    if args.configs:
        res.update(config_models(args.configs, args.prompts, args.max_new_tokens, args.device, args.dtype))
    res["seconds"] = round(time.perf_counter() - t0, 1)
    total_calls = sum(v for k, v in res.items() if k.endswith("_calls") and "model" not in k)
    total_det = sum(v for k, v in res.items() if k.endswith("detected"))
    res["verified_calls_total"] = total_calls
    res["detected_total"] = total_det
    print(json.dumps(res, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 1 if total_det else 0


if __name__ == "__main__":
    sys.exit(main())
