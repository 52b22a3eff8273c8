"""A protected model spread over several GPUs gives the single-GPU run's tokens and fault events.

Builds a random-init model of published dimensions (``bench_generate.model_config``), saves it once,
and generates twice under the same injected faults with full protection (``FTConfig()``: EFTA
attention and every Linear / Conv1D checked):

1. the whole model on one GPU;
2. the model loaded with ``device_map`` (``balanced`` by default) over every visible GPU.

It then checks that the generated tokens, the number of injected flips and every fault event
(generation step, layer, module, site, kind, count) are identical, and prints the events per device
(which device holds each block comes from the loaded model). Exit status 1 on any difference.

    python scripts/multigpu_check.py --model qwen2-0.5b --dtype float16 --prompt 512 --new-tokens 32

``--device cpu --tiny`` runs both passes on the CPU (the PyTorch reference paths; CI checks the
script's plumbing this way, not the placement).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import fixed_length, load_model  # noqa: E402
from bench_generate import model_config  # noqa: E402

import ft_transformers as ftt  # noqa: E402
from ft_transformers.longbench.compare_runs import describe_device, events_per_device  # noqa: E402
from ft_transformers.longbench.pred import layer_devices  # noqa: E402


def default_faults(dtype: str) -> str:
    """One flip of the top exponent bit at the attention scores (fp32) and at the Linear outputs."""
    return f"attn.scores:30,linear.output:{30 if dtype == 'float32' else 14}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2-0.5b", choices=["gpt2", "qwen2-0.5b", "qwen2-1.5b"])
    p.add_argument("--tiny", action="store_true", help="the tiny test shapes (CPU)")
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--device-map", default="balanced", help="device_map of the second pass (cuda)")
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--faults", default=None,
                   help="comma-separated site:bit, one flip per targeted call (empty: clean run); default: "
                        "the top exponent bit of the fp32 scores and of the Linear outputs' dtype")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="write the comparison as JSON here")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda needs a GPU (use --device cpu --tiny to check the script on the CPU)")
    return args


def fault_specs(text: str, seed: int) -> list[ftt.FaultSpec]:
    specs = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        site, _, bit = item.partition(":")
        if not bit:
            raise SystemExit(f"--faults: expected site:bit, got {item!r}")
        specs.append(ftt.FaultSpec(site=site, bit=int(bit), count=1, seed=seed))
    return specs


def generate(model, ids: torch.Tensor, new_tokens: int, specs: list[ftt.FaultSpec]) -> dict:
    """Greedy generation of exactly ``new_tokens`` under ``specs``; tokens, flips and every event."""
    ftt.fault_report(model).reset()
    ids = ids.to(model.device)
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
              do_sample=False, num_beams=1)
    with torch.inference_mode():
        if specs:
            with ftt.inject_faults(model, specs) as log:
                out = model.generate(ids, **kw)
            flips = int(log.injected)
        else:
            out = model.generate(ids, **kw)
            flips = 0
    rep = ftt.fault_report(model)
    return {"tokens": out[:, ids.shape[1]:].cpu().tolist(), "flips": flips, "totals": rep.totals(),
            "events": [[e.step, e.layer, e.module, e.site, e.kind, e.count] for e in rep.events]}


def load(path: Path, dtype: torch.dtype, *, device: str | None = None, device_map: str | None = None):
    """The saved model, protected (``FTConfig()``), generating exactly the requested length."""
    model = load_model(str(path), dtype=dtype, device=device, device_map=device_map)
    return ftt.enable_fault_tolerance(fixed_length(model), ftt.FTConfig())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    cfg = model_config(args.model, tiny=args.tiny, max_positions=args.prompt + args.new_tokens)
    if args.faults is None:
        args.faults = default_faults(args.dtype)
    specs = fault_specs(args.faults, args.seed)
    ids = torch.randint(3, cfg.vocab_size, (args.batch, args.prompt), generator=torch.Generator().manual_seed(1))
    with tempfile.TemporaryDirectory() as tmp:
        AutoModelForCausalLM.from_config(cfg, dtype=dtype).save_pretrained(tmp)
        one_dev = "cuda:0" if args.device == "cuda" else "cpu"
        model = load(Path(tmp), dtype, device=one_dev)
        one = generate(model, ids, args.new_tokens, specs)
        one_where = layer_devices(model)
        del model
        if args.device == "cuda":
            torch.cuda.empty_cache()
            model = load(Path(tmp), dtype, device_map=args.device_map)
        else:
            model = load(Path(tmp), dtype, device="cpu")
        many = generate(model, ids, args.new_tokens, specs)
        many_where = layer_devices(model)
    checks = {
        "tokens identical": one["tokens"] == many["tokens"],
        "flips identical": one["flips"] == many["flips"],
        "events identical": one["events"] == many["events"],
    }
    result = {
        "model": args.model, "tiny": args.tiny, "dtype": args.dtype, "prompt": args.prompt,
        "new_tokens": args.new_tokens, "batch": args.batch, "faults": args.faults, "device_map": args.device_map,
        "gpus": torch.cuda.device_count() if args.device == "cuda" else 0,
        "devices_used": sorted(many_where), "flips": [one["flips"], many["flips"]],
        "totals": [one["totals"], many["totals"]], "events": len(one["events"]), "checks": checks,
        "events_by_device": events_per_device(many["events"], many_where),
        "single_device_events": events_per_device(one["events"], one_where),
    }
    for name, ok in checks.items():
        print(f"{name}: {'OK' if ok else 'MISMATCH'}")
    print(f"flips injected: {one['flips']} (one device) / {many['flips']} (spread); "
          f"events: {len(one['events'])} / {len(many['events'])}; totals {many['totals']}")
    for dev, d in result["events_by_device"].items():
        print("  " + describe_device(dev, d))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    ok = all(checks.values())
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
