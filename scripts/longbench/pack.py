"""Make or check a compact model pack (see ft_transformers/longbench/pack.py, docs/longbench.md).

    python scripts/longbench/pack.py --model smollm2 --out .lbcarry/smollm2-pack
    python scripts/longbench/pack.py --check .lbcarry/smollm2-pack --model smollm2

The pack format lives in the library; this command sits above it because it loads models through
`ft_transformers.longbench.pred`, which itself reads packs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from ft_transformers.longbench import pack as K
from ft_transformers.longbench.data import read_jsonl
from ft_transformers.longbench.pred import load_model


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=K.__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="source model, as longbench_pred.py's --model")
    p.add_argument("--out", default=None, help="pack folder to write (must not exist or be empty)")
    p.add_argument("--bits", type=int, default=3, help="bits per weight of the linear layers")
    p.add_argument("--group", type=int, default=64, help="weights per scale/min of the linear layers")
    p.add_argument("--embed-bits", type=int, default=4, help="bits per weight of the input embedding")
    p.add_argument("--embed-group", type=int, default=128, help="weights per scale/min of the embedding")
    p.add_argument("--max-mib", type=float, default=None,
                   help="fail if the pack is larger than this many MiB (e.g. 60, to carry it)")
    p.add_argument("--check", default=None, metavar="PACK",
                   help="compare PACK with --model on real text (top-1 agreement, KL)")
    p.add_argument("--data-dir", default=None, help="LongBench rows for --check (default: the test fixtures)")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if (args.out is None) == (args.check is None):
        p.error("give exactly one of --out (make a pack) or --check PACK")
    for name in ("bits", "embed_bits"):
        if not 1 <= getattr(args, name) <= 8:
            p.error(f"--{name.replace('_', '-')} must lie in [1, 8]")
    for name in ("group", "embed_group"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be positive")

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_model(args.model, dtype=torch.float32, attn_implementation="eager", device="cpu")
    if args.out:
        meta = K.make_pack(model, tok, args.out, bits=args.bits, group=args.group, embed_bits=args.embed_bits,
                           embed_group=args.embed_group, source=args.model)
        size = K.pack_size(args.out)
        q = [v["rel_rmse"] for v in meta["tensors"].values() if v["kind"] == "q"]
        print(f"pack {args.out}: {size / 2**20:.1f} MiB, {len(q)} quantised tensors "
              f"({meta['quantized_numel'] / 1e6:.1f} M weights), relative RMS error "
              f"median {np.median(q):.3f}, max {np.max(q):.3f}")
        if args.max_mib is not None and size > args.max_mib * 2**20:
            raise SystemExit(f"the pack is {size / 2**20:.1f} MiB, over --max-mib {args.max_mib}")
        return
    other, _ = load_model(str(args.check), dtype=torch.float32, attn_implementation="eager", device="cpu")
    data = Path(args.data_dir) if args.data_dir else Path(__file__).resolve().parents[2] / "tests/fixtures/longbench"
    if not data.is_dir():
        raise SystemExit(f"--data-dir {data}: no such folder of LongBench <task>.jsonl files")
    texts = [r["context"][:4000] for f in sorted(data.glob("*.jsonl")) for r in read_jsonl(f)[:1]]
    print(json.dumps(K.compare_models(model, other, tok, texts), indent=1))


if __name__ == "__main__":
    main()
