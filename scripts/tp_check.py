#!/usr/bin/env python
"""Full protection of a model sharded by transformers' tensor parallelism: tokens, clean events, a fault on
one rank, speed and memory per GPU.

Run under ``torchrun --nproc-per-node N`` (N = the tensor-parallel size; without torchrun the model runs
unsharded on one device, the tp = 1 reference). Each process loads a random-init model of published
dimensions (``bench_generate.model_config``) with ``tp_plan="auto"`` (transformers' own sharding: DTensor
shards, colwise / rowwise Linear layers, each rank's attention heads) and then:

1. generates greedily, unprotected (``sdpa``) and protected (``FTConfig()``: EFTA attention on each rank's
   heads, every Linear shard a checked GEMM), keeping each step's logits; with ``--reference`` (the JSON a
   tp = 1 run wrote) it compares tokens and logits with the unsharded model's, for both variants;
2. counts every event of the protected runs on clean inputs, over all ranks (``fault_report(model,
   all_ranks=True)``): there should be none;
3. injects one flip on one rank (``--fault-rank``, default 1) at ``linear.output`` of a rowwise layer
   (``mlp.down_proj`` of the middle block: its partial product is verified before the all-reduce) and at
   ``attn.scores`` of that block, protected and unprotected: the protected run must detect and correct it on
   that rank only (corrected, or recomputed), with the clean tokens;
4. times prefill (``--prompt`` tokens, one forward) and decode (ms per token over ``--new-tokens``) for both
   variants (CUDA events), and reads the peak GPU memory of every rank.

``--compile MODE`` also times decode through transformers' compiled decode step (a static cache; with
``reduce-overhead`` CUDA graphs), each variant compiling its own: eager decode under tensor parallelism is
bound by the host, the compiled step measures the GPU's work. Each ``generate`` makes a new static cache, so its
compiled step warms up and records its CUDA graph again; the report also gives the time per token after those
steps (``ms_after_record``) and the record's share of the figure.

``--profile``: after each timed workload, every rank runs it once more under ``torch.profiler`` (all ranks
together: the collectives need them) and writes the ops and kernels that took the most device time to
``profile_tp<N>_rank<R>_<variant>_<workload>.txt`` in ``--out``: where the protected step's extra time goes.

``--per-layer`` adds a third variant, protected with one checked launch per Linear (``Options.siblings``
off): the A/B of the one-launch Q/K/V and gate/up GEMMs (`ft_transformers.siblings`, on each rank's colwise
shards), in the same process. They take calls of up to 16 rows, so decode steps, not a long prefill.

Rank 0 writes ``tp_check_<model>_<dtype>_tp<N>.json`` and ``.md`` to ``--out`` and prints progress; the exit
status is 1 when a check fails.

Weights: no checkpoint of the full model is written. Each process loads a directory holding the config and
an empty safetensors file, so transformers creates every parameter as missing: under ``tp_plan`` it builds
each one as a DTensor whose local shard alone is allocated, on the rank's GPU. `fill_weights` then writes
every shard from a counter-based hash of the parameter's name and the element's position in the whole
(logical) tensor: the weights are the same for every tensor-parallel size and device, no rank ever holds
more than its shards, and the 72B model's ~145 GB are never written to disk.

    # the tp = 1 reference (one GPU), then the same model over 2 and 4 GPUs compared with it
    python scripts/tp_check.py --model qwen2-7b --out tp_out
    torchrun --nproc-per-node 2 scripts/tp_check.py --model qwen2-7b --out tp_out \\
        --reference tp_out/tp_check_qwen2-7b_float16_tp1.json
    torchrun --nproc-per-node 4 scripts/tp_check.py --model qwen2-7b --out tp_out \\
        --reference tp_out/tp_check_qwen2-7b_float16_tp1.json
    # Qwen2-72B dims (no single GPU holds them: no reference)
    torchrun --nproc-per-node 4 scripts/tp_check.py --model qwen2-72b --prompt 4096 --out tp_out
    # the same with the sibling launches' A/B (a third, per-layer protected variant)
    torchrun --nproc-per-node 2 scripts/tp_check.py --model qwen2-7b --per-layer --out tp_out \\
        --reference tp_out/tp_check_qwen2-7b_float16_tp1.json
    # CPU plumbing (gloo), tiny shapes
    python scripts/tp_check.py --tiny --device cpu --out /tmp/tp
    torchrun --nproc-per-node 2 scripts/tp_check.py --tiny --device cpu --out /tmp/tp \\
        --reference /tmp/tp/tp_check_qwen2-7b_float32_tp1.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import math
import os
import sys
import tempfile
import time
import traceback
import zlib
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import device_label, fixed_length, versions  # noqa: E402
from bench_generate import Timer, Workload, compile_kwargs, drop_compiled, model_config, run_workload  # noqa: E402
from ft_transformers.kernels.contract import KINDS  # noqa: E402
from ft_transformers.kernels.options import override  # noqa: E402

import ft_transformers as ftt  # noqa: E402
from ft_transformers.distributed import gather, is_sharded, local_shard, rank, world_size  # noqa: E402

MODELS = ("qwen2-0.5b", "qwen2-1.5b", "qwen2-7b", "qwen2-72b")
PER_LAYER = "protected_per_layer"  # the variant of --per-layer
COMPILED = "decode_compiled"  # the timing key of --compile's decode
TOPK = 8  # logits kept per generation step for the comparison with another run
_M32 = 0xFFFFFFFF
_T0 = time.perf_counter()


def say(msg: str) -> None:
    """A progress line from rank 0, with the seconds since the start."""
    if rank() == 0:
        print(f"[tp_check {time.perf_counter() - _T0:7.1f}s] {msg}", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2-7b", choices=MODELS)
    p.add_argument("--tiny", action="store_true", help="the tiny test shapes (CPU plumbing)")
    p.add_argument("--dtype", default=None, choices=["float16", "bfloat16", "float32"],
                   help="default: float16 on CUDA, float32 on the CPU")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 1024; --tiny 24)")
    p.add_argument("--new-tokens", type=int, default=None, help="generated tokens (default 64; --tiny 6)")
    p.add_argument("--inject-tokens", type=int, default=None,
                   help="tokens generated under each injected fault (default 8; --tiny 3)")
    p.add_argument("--fault-rank", type=int, default=None, help="the rank faults are injected on (default 1, "
                   "or 0 on a single rank)")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls before timing each workload")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per workload (median)")
    p.add_argument("--no-timing", action="store_true", help="skip the timed workloads")
    p.add_argument("--no-injection", action="store_true",
                   help="skip the injected flips (3.): tokens, clean events and timings only, e.g. for a timing call "
                        "whose compiled decode steps take the time")
    p.add_argument("--compile", default="off", choices=("off", "default", "reduce-overhead"),
                   help="also time decode through transformers' compiled decode step with a static cache "
                        "(reduce-overhead: CUDA graphs), beside the eager decode")
    p.add_argument("--workloads", default="prefill,decode," + COMPILED,
                   help=f"the timed workloads, comma-separated, of prefill, decode and {COMPILED} (the last only "
                        "with --compile)")
    p.add_argument("--per-layer", action="store_true", help="also run the protected model with one checked "
                   "launch per Linear (the sibling launches off)")
    p.add_argument("--profile", action="store_true",
                   help="one more call of each workload under torch.profiler on every rank (module docstring)")
    p.add_argument("--reference", type=Path, default=None, help="the JSON of an unsharded (tp = 1) run")
    p.add_argument("--seed", type=int, default=0, help="seeds the weights and the prompt")
    p.add_argument("--weight-std", type=float, default=None,
                   help="standard deviation of the random weights (default: the config's initializer_range, "
                        "0.02; --tiny 0.08, so that the tiny model's tokens depend on its input)")
    p.add_argument("--out", type=Path, required=True, help="folder for the JSON and markdown results")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda needs a GPU (use --device cpu --tiny to check the script on the CPU)")
    tiny = args.tiny
    args.dtype = args.dtype or ("float16" if args.device == "cuda" else "float32")
    args.prompt = args.prompt or (24 if tiny else 1024)
    args.new_tokens = args.new_tokens or (6 if tiny else 64)
    args.inject_tokens = args.inject_tokens or (3 if tiny else 8)
    args.workloads = args.workloads.split(",")
    unknown = sorted(set(args.workloads) - {"prefill", "decode", COMPILED})
    if unknown:
        p.error(f"unknown workload(s) {', '.join(unknown)}; choose from prefill, decode, {COMPILED}")
    if args.per_layer and not {"prefill", "decode"} <= set(args.workloads):
        p.error("--per-layer compares the prefill and decode workloads: keep both in --workloads")
    if args.new_tokens < 2:
        p.error("--new-tokens must be at least 2 (decode time per token)")
    return args


# -- model ---------------------------------------------------------------------------------------

def _fmix(h: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix of ``h`` (int64 holding values < 2^32); every product stays below 2^63."""
    h = (((h >> 16) ^ h) * 0x45D9F3B) & _M32
    h = (((h >> 16) ^ h) * 0x45D9F3B) & _M32
    return (h >> 16) ^ h


def hash_uniform(index: torch.Tensor, seed: int) -> torch.Tensor:
    """Values in [-1, 1) from element indices (int64, any shape) and a seed: the same on every device."""
    lo, hi = index & _M32, index >> 32
    h = _fmix(lo ^ _fmix((hi + seed) & _M32))
    return h.double() * 2.0**-31 - 1.0


def _shard_offsets(param: torch.Tensor) -> tuple[tuple[int, ...], torch.Tensor]:
    """``(offset of the local shard in the whole tensor per dim, local tensor)`` of a parameter: a DTensor
    sharded by at most one mesh dim per tensor dim (what transformers' tensor parallelism makes), or a plain
    tensor (offset 0)."""
    if not is_sharded(param):
        return (0,) * param.dim(), param.data
    mesh, offsets = param.device_mesh, [0] * param.dim()
    coord = mesh.get_coordinate()
    seen = set()
    for i, pl in enumerate(param.placements):
        if not pl.is_shard():
            continue
        d = pl.dim % param.dim()
        if d in seen:
            raise NotImplementedError(f"a tensor dim sharded over two mesh dims: {param.placements}")
        seen.add(d)
        chunk = -(-param.shape[d] // mesh.size(i))  # torch.chunk's split, as DTensor shards
        offsets[d] = min(coord[i] * chunk, param.shape[d])
    return tuple(offsets), local_shard(param)


@torch.no_grad()
def fill_weights(model: torch.nn.Module, seed: int, std: float, chunk: int = 1 << 24) -> None:
    """Write every parameter's local shard from `hash_uniform` of its position in the whole tensor
    (zero mean, standard deviation ``std``; norm weights 1): the same model for any sharding and device.

    Rows are written ``chunk`` elements at a time (the int64 temporaries of a 72B shard would not fit)."""
    amp = std * math.sqrt(3.0)
    for name, p in model.named_parameters():
        offsets, local = _shard_offsets(p)
        if name.endswith("norm.weight"):
            local.fill_(1.0)
            continue
        pseed = zlib.crc32(f"{seed}:{name}".encode())
        full = tuple(p.shape)
        flat = local.view(-1, local.shape[-1]) if local.dim() > 1 else local.view(1, -1)
        rows_total = flat.shape[0]
        cols = torch.arange(offsets[-1], offsets[-1] + local.shape[-1], device=local.device, dtype=torch.int64)
        # a local row r (of the leading dims flattened) sits at whole-tensor row: offsets and strides of `full`
        lead_local, lead_full = tuple(local.shape[:-1]), full[:-1]
        step = max(1, chunk // max(1, local.shape[-1]))
        for r0 in range(0, rows_total, step):
            r = torch.arange(r0, min(r0 + step, rows_total), device=local.device, dtype=torch.int64)
            grow = torch.zeros_like(r)
            rem = r
            for d in range(len(lead_local) - 1, -1, -1):  # unravel the local row, shift, ravel in the full shape
                idx = rem % lead_local[d] + offsets[d]
                rem = rem // lead_local[d]
                stride = 1
                for s in lead_full[d + 1:]:
                    stride *= s
                grow += idx * stride
            index = grow[:, None] * full[-1] + cols[None, :]
            flat[r0:r0 + r.numel()] = (hash_uniform(index, pseed) * amp).to(local.dtype)


def _empty_checkpoint(cfg, path: Path) -> None:
    """``path``: the config and a safetensors file without tensors (every parameter loads as missing)."""
    from safetensors.torch import save_file

    cfg.save_pretrained(path)
    save_file({}, str(path / "model.safetensors"), metadata={"format": "pt"})


def load(args: argparse.Namespace, device: torch.device):
    """The model (``attn_implementation="sdpa"``), sharded over the torchrun ranks when there are several,
    its weights from `fill_weights`, generating exactly the requested length."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    cfg = model_config(args.model, tiny=args.tiny, max_positions=args.prompt + args.new_tokens)
    dtype = getattr(torch, args.dtype)
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        from transformers import DistributedConfig

        kw = {"distributed_config": DistributedConfig(tp_plan="auto")}
    else:
        kw = {"device_map": {"": device}} if device.type == "cuda" else {}
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # (the table of the parameters it creates as missing: all of them)
    try:
        with tempfile.TemporaryDirectory() as tmp:  # one per process: nothing to wait for between ranks
            _empty_checkpoint(cfg, Path(tmp))
            model = AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype, attn_implementation="sdpa", **kw)
    finally:
        hf_logging.set_verbosity(verbosity)
    std = args.weight_std or (0.08 if args.tiny else cfg.initializer_range)
    fill_weights(model, args.seed, std=std)
    return fixed_length(model.eval()), cfg


# -- runs ------------------------------------------------------------------------------------------

def prompt_ids(vocab: int, length: int, seed: int, device: torch.device) -> torch.Tensor:
    """(1, length) token ids, the same on every rank and in every run."""
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randint(3, vocab, (1, length), generator=g).to(device)


def generate(model, ids: torch.Tensor, new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and each step's logits (new_tokens, vocab) fp32, on the model's device."""
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    logits = torch.cat([s.float() for s in out.logits], dim=0)
    return out.sequences[0, ids.shape[1]:].tolist(), logits


def top_logits(logits: torch.Tensor) -> dict:
    """Per step: the ``TOPK`` largest logits and their token ids (what another run is compared on)."""
    vals, ids = logits.topk(TOPK, dim=-1)
    return {"ids": ids.cpu().tolist(), "values": vals.cpu().tolist()}


def compare(ref: dict, tokens: list[int], logits: torch.Tensor) -> dict:
    """This run's tokens and logits against a reference run's (``{"tokens", "top": top_logits}``).

    ``max_dlogit``: over the steps both runs share (up to and including the first differing token), the
    largest |logit − reference logit| at the reference's top ids. A differing token is a ``near-tie`` when the
    reference's top-1 / top-2 margin at that step is at most twice that change (the two logits moving by it
    in opposite directions swap them); else ``differs``."""
    ref_tokens = ref["tokens"]
    n = min(len(ref_tokens), len(tokens))
    first = next((i for i in range(n) if ref_tokens[i] != tokens[i]), None)
    upto = n if first is None else first + 1
    rid = torch.tensor(ref["top"]["ids"][:upto], device=logits.device)
    rval = torch.tensor(ref["top"]["values"][:upto], device=logits.device)
    d = (logits[:upto].gather(1, rid) - rval).abs()
    per_step = d.amax(dim=1).cpu().tolist()
    dmax = max(per_step, default=0.0)
    scale = float(rval.abs().amax()) if rval.numel() else 0.0
    out = {"steps": n, "first_diff": first, "max_dlogit": dmax, "max_abs_logit": scale,
           "rel_dlogit": dmax / scale if scale else 0.0}
    if first is None:
        out["verdict"] = "identical" if len(ref_tokens) == len(tokens) else "identical prefix"
    else:
        margin = ref["top"]["values"][first][0] - ref["top"]["values"][first][1]
        out["margin_at_diff"] = margin
        out["verdict"] = "near-tie" if margin <= 2 * dmax else "differs"
    return out


def gathered_totals(model) -> tuple[dict[str, int], dict[int, dict[str, int]], int]:
    """(totals, {rank: totals}, model calls) of every rank's report (a collective), then each rank's own
    report is reset."""
    rep = ftt.fault_report(model, all_ranks=True)
    ftt.fault_report(model).reset()
    return rep.totals(), rep.by_rank(), rep.steps


def inject(model, args, ids, site: str, target, bit: int, clean_tokens: list[int], fault_rank: int) -> dict:
    """One flip at ``site`` of ``target`` (a module name or block) in the first call, on ``fault_rank``; the
    events of every rank and whether the tokens stayed the clean ones."""
    ftt.fault_report(model).reset()
    spec = ftt.FaultSpec(site=site, bit=bit, count=1, layers=[target], calls=[0], seed=args.seed,
                         ranks=[fault_rank])
    with ftt.inject_faults(model, spec) as log:
        tokens, _ = generate(model, ids, args.inject_tokens)
    injected = gather(int(log.injected))
    totals, by_rank, _ = gathered_totals(model)
    return {"site": site, "target": target, "bit": bit, "rank": fault_rank, "injected_per_rank": injected,
            "totals": totals, "by_rank": {str(r): t for r, t in by_rank.items()},
            "tokens_equal_clean": tokens == clean_tokens[:args.inject_tokens]}


def timings(model, args, device: torch.device, vocab: int, between, name: str = "") -> dict:
    """Prefill (ms per forward) and decode (ms per token) medians on this rank, and every rank's peak
    memory (MiB) over them."""
    timer = Timer(device)
    out = {}
    loads = [("prefill", Workload("prefill", 1, args.prompt), None),
             ("decode", Workload("decode", 1, args.prompt, args.new_tokens), None)]
    if args.compile != "off":
        loads.append((COMPILED, Workload("decode", 1, args.prompt, args.new_tokens, args.compile),
                      compile_kwargs(args.compile, "inductor", device)))
    for key, wl, kw in loads:
        if key not in args.workloads:
            continue
        if kw is not None:  # this variant compiles and records its own decode step
            drop_compiled(model)
            torch._dynamo.utils.counters.clear()
        skips = _CudagraphSkips()
        try:
            prof = (args.out / f"profile_tp{world_size()}_rank{rank()}_{name.replace(' ', '_').replace(',', '')}"
                    f"_{key}.txt") if args.profile else None
            extra: dict = {}
            with skips:
                ms, std, peak = run_workload(model, wl, device, timer, args.warmup, args.repeats, vocab,
                                             gen_kwargs=kw, between=between, profile_path=prof, extra=extra)
        except Exception as e:  # a compiled step that does not build under sharding is reported, not fatal
            if kw is None:
                raise
            if rank() == 0:
                traceback.print_exc()
            first = (str(e).strip().splitlines() or [""])[0][:200].replace("|", "/")
            out[key] = {"error": f"{type(e).__name__}: {first}"}
            say(f"{key} failed: {out[key]['error']}")
            continue
        out[key] = {"ms": ms, "ms_std": std, "peak_mib_per_rank": gather(peak), **extra}
        if kw is not None:  # what the compiled step became on this rank: its graphs and the breaks between them
            c = torch._dynamo.utils.counters
            out[key]["graphs"] = int(c["stats"]["unique_graphs"])
            out[key]["graph_breaks"] = {reason.splitlines()[0][:160]: n for reason, n in c["graph_break"].items()}
            out[key]["cudagraph_skips"] = skips.reasons
    return out


class _CudagraphSkips(logging.Handler):
    """The reasons inductor gives for running a compiled graph without CUDA graphs (its ``cudagraphs`` log,
    a warning per skipped graph), first line of each, counted: a compiled step that skips them launches every
    kernel from the host on every token."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.reasons: dict[str, int] = {}

    def emit(self, record: logging.LogRecord) -> None:
        first = (record.getMessage().strip().splitlines() or [""])[0][:160]
        self.reasons[first] = self.reasons.get(first, 0) + 1

    def __enter__(self):
        from torch._inductor.cudagraph_utils import cudagraphs_log
        cudagraphs_log.addHandler(self)
        return self

    def __exit__(self, *exc):
        from torch._inductor.cudagraph_utils import cudagraphs_log
        cudagraphs_log.removeHandler(self)


def variant(model, args, device, ids, cfg, name: str) -> dict:
    """The clean generation (tokens, top logits) and timings of the model as configured now."""
    say(f"{name}: generating {args.new_tokens} tokens after a {args.prompt}-token prompt")
    tokens, logits = generate(model, ids, args.new_tokens)
    res = {"tokens": tokens, "top": top_logits(logits), "_logits": logits}
    protected = getattr(model, "_ftt_state", None) is not None
    clean = {"totals": dict.fromkeys(KINDS, 0), "by_rank": {}, "calls": 0}

    def collect() -> None:  # every event of the clean protected runs, over all ranks
        if protected:
            totals, by_rank, steps = gathered_totals(model)
            clean["calls"] += steps
            for k, v in totals.items():
                clean["totals"][k] += v
            for r, t in by_rank.items():
                acc = clean["by_rank"].setdefault(str(r), dict.fromkeys(t, 0))
                for k, v in t.items():
                    acc[k] += v

    collect()
    if not args.no_timing:
        say(f"{name}: timing {', '.join(args.workloads)} ({args.warmup} warmup, {args.repeats} timed each)")
        res["timing"] = timings(model, args, device, cfg.vocab_size, collect, name)
        t = res["timing"]
        units = {"prefill": "ms", "decode": "ms/token", COMPILED: "ms/token"}
        say(f"{name}: " + ", ".join(f"{k.replace('_', ' ')} {t[k]['ms']:.3f} {units[k]}" for k in units
                                    if "ms" in t.get(k, {})))
    if protected:
        res["clean_events"] = clean
        say(f"{name}: clean events over {clean['calls']} model call(s) on all ranks: {clean['totals']}")
    return res


# -- report ----------------------------------------------------------------------------------------

def checks_of(result: dict) -> dict[str, bool]:
    """The pass/fail checks of a run (the tp = 1 run has no token comparison)."""
    checks = {}
    prot = result["variants"]["protected"]
    checks["0 events when clean"] = sum(prot["clean_events"]["totals"].values()) == 0
    per_layer = result["variants"].get(PER_LAYER)
    if per_layer is not None:
        checks["0 events when clean, one launch per layer"] = sum(per_layer["clean_events"]["totals"].values()) == 0
    cmp = result.get("comparison", {}).get("protected")
    if cmp is not None:
        checks["protected tokens = unsharded protected (or a near-tie)"] = cmp["verdict"] in (
            "identical", "identical prefix", "near-tie")
    for inj in result["injection"]["protected"]:
        r = str(inj["rank"])
        others = [t for rk, t in inj["by_rank"].items() if rk != r]
        mine = inj["by_rank"].get(r, {})
        # repaired: located and corrected, or recomputed (each fault counts once as detected, once as its outcome)
        repaired = mine.get("corrected", 0) + mine.get("recomputed", 0)
        checks[f"{inj['site']} flip on rank {r}: detected and repaired there only, tokens clean"] = (
            inj["injected_per_rank"][inj["rank"]] == 1 and sum(inj["injected_per_rank"]) == 1
            and mine.get("detected", 0) >= 1 and repaired == mine.get("detected", 0)
            and mine.get("uncorrectable", 0) == 0 and all(sum(t.values()) == 0 for t in others)
            and inj["tokens_equal_clean"])
    return checks


def _ms(t: dict | None, key: str) -> str:
    return "–" if not t else f"{t[key]['ms']:.3f}"


def markdown(result: dict, reference: dict | None) -> str:
    """The run as a markdown table (and the comparison with the tp = 1 run's ratios)."""
    v = result["variants"]
    tp = result["tp"]
    lines = [f"# tp_check: {result['model']} ({result['dtype']}), tensor parallel {tp}", "",
             f"device: {result['device']} × {tp}; " + ", ".join(f"{k} {x}" for k, x in result["versions"].items()),
             f"prompt {result['prompt']} tokens, {result['new_tokens']} generated; weights per rank "
             f"{max(result['weights_mib_per_rank']):.1f} MiB; one-launch sibling GEMMs "
             f"{'on' if result['siblings'] else 'off'} ({result.get('sibling_groups', 0)} groups per rank)", ""]
    if "timing" in v["protected"]:
        ref_t = (reference or {}).get("variants", {})
        lines += ["| workload | unprotected ms | protected ms | protected / unprotected | same ratio at tp = 1 "
                  "| difference | peak MiB per rank (unprot. / prot.) |", "|---|---:|---:|---:|---:|---:|---|"]
        kinds = [("prefill", "per forward"), ("decode", "per token"), (COMPILED, "per token, compiled step")]
        for kind, unit in kinds:
            if kind not in v["protected"]["timing"]:
                continue
            u, p = v["unprotected"]["timing"][kind], v["protected"]["timing"][kind]
            if "ms" not in u or "ms" not in p:
                lines.append(f"| {kind} ({unit}) | {u.get('error', '')} | {p.get('error', '')} | – | – | – | – |")
                continue
            ratio = p["ms"] / u["ms"]
            r1 = "–"
            diff = "–"
            if "ms" in ref_t.get("protected", {}).get("timing", {}).get(kind, {}) and \
                    "ms" in ref_t["unprotected"]["timing"].get(kind, {}):
                ref_ratio = ref_t["protected"]["timing"][kind]["ms"] / ref_t["unprotected"]["timing"][kind]["ms"]
                r1, diff = f"{ref_ratio:.3f}", f"{ratio - ref_ratio:+.3f}"
            peaks = " / ".join(", ".join(f"{x:.0f}" for x in t["peak_mib_per_rank"]) for t in (u, p))
            lines.append(f"| {kind} ({unit}) | {u['ms']:.3f} | {p['ms']:.3f} | {ratio:.3f} | {r1} | {diff} "
                         f"| {peaks} |")
        for name in ("unprotected", "protected"):
            ct = v[name]["timing"].get(COMPILED, {})
            if "graphs" in ct:
                breaks = "; ".join(f"{n} × {r}" for r, n in ct["graph_breaks"].items()) or "none"
                lines.append(f"\n- compiled step, {name}, rank 0: {ct['graphs']} graph(s); graph breaks: {breaks}")
                skipped = "; ".join(f"{n} × {r}" for r, n in ct.get("cudagraph_skips", {}).items())
                if skipped:
                    lines.append(f"- compiled step, {name}, rank 0: CUDA graphs skipped: {skipped}")
        replay = [v[n]["timing"].get(COMPILED, {}).get("ms_after_record") for n in ("unprotected", "protected")]
        if all(replay):
            u, p = (v[n]["timing"][COMPILED]["ms"] for n in ("unprotected", "protected"))
            lines.append(f"- compiled step after its warm-up and CUDA-graph record (each `generate` records again): "
                         f"{replay[0]:.3f} / {replay[1]:.3f} ms per token, ratio {replay[1] / replay[0]:.3f}; the "
                         f"record's share of the figures above {u - replay[0]:.3f} / {p - replay[1]:.3f} ms per token")
        if "timing" in v.get(PER_LAYER, {}):
            lines.append("")
            for kind, unit in (("prefill", "per forward"), ("decode", "per token")):
                u, p, q = (v[n]["timing"][kind]["ms"] for n in ("unprotected", "protected", PER_LAYER))
                lines.append(f"- {kind} ({unit}), protected with one launch per layer (sibling launches off): "
                             f"{q:.3f} ms, {q / u:.3f} of unprotected; one launch per group / per layer "
                             f"{p / q:.3f}")
        if reference is not None:
            lines.append(f"\ntp = 1: {reference['device']}, one-launch sibling GEMMs "
                         f"{'on' if reference.get('siblings') else 'off'}")
        lines.append("")
    for name, cmp in result.get("comparison", {}).items():
        lines.append(f"- {name} vs unsharded {name}: {cmp['verdict']} over {cmp['steps']} tokens"
                     + (f" (first difference at token {cmp['first_diff']}, reference margin "
                        f"{cmp['margin_at_diff']:.4g})" if cmp["first_diff"] is not None else "")
                     + f", max |Δlogit| {cmp['max_dlogit']:.3g} ({cmp['rel_dlogit']:.2g} of the largest logit)")
    for name, label in (("protected", "protected runs"), (PER_LAYER, "protected runs with one launch per layer")):
        if name in v:
            ce = v[name]["clean_events"]
            lines.append(f"- clean {label}: {sum(ce['totals'].values())} events over {ce['calls']} model calls "
                         f"on {tp} rank(s)")
    if PER_LAYER in v:
        same = v[PER_LAYER]["tokens"] == v["protected"]["tokens"]
        lines.append(f"- tokens with one launch per layer {'=' if same else '≠'} tokens with the sibling launches")
    for arm, runs in result["injection"].items():
        for inj in runs:
            ev = "; ".join(f"rank {r}: " + (", ".join(f"{n} {k}" for k, n in t.items() if n) or "none")
                           for r, t in inj["by_rank"].items())
            lines.append(f"- {arm}, one flip of bit {inj['bit']} at {inj['site']} of {inj['target']} on rank "
                         f"{inj['rank']}: {ev}; tokens {'= clean' if inj['tokens_equal_clean'] else 'changed'}")
    lines += ["", "| check | result |", "|---|---|"]
    lines += [f"| {name} | {'OK' if ok else 'FAILED'} |" for name, ok in result["checks"].items()]
    return "\n".join(lines) + "\n"


def read_reference(path: Path, args: argparse.Namespace) -> dict:
    """The tp = 1 run's JSON, refused unless it ran the same model, weights and prompt."""
    ref = json.loads(path.read_text())
    same = ("model", "tiny", "dtype", "prompt", "seed")
    diff = {k: (ref.get(k), getattr(args, k)) for k in same if ref.get(k) != getattr(args, k)}
    if ref.get("weight_std") != args.weight_std:
        diff["weight_std"] = (ref.get("weight_std"), args.weight_std)
    if diff:
        raise SystemExit(f"--reference {path} ran another model or prompt: " + ", ".join(
            f"{k} {a!r} there, {b!r} here" for k, (a, b) in diff.items()))
    return ref


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.profile:
        args.out.mkdir(parents=True, exist_ok=True)  # (every rank writes its tables there)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and importlib.util.find_spec("accelerate") is None:
        # transformers' tensor-parallel loading places the shards through a device map, which needs it
        raise SystemExit("tensor-parallel loading needs the accelerate package (carry its wheel: it is pure "
                         "Python; pip install --no-deps accelerate-*.whl)")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    say(f"loading {args.model}{' (tiny)' if args.tiny else ''} {args.dtype}, "
        f"{os.environ.get('WORLD_SIZE', '1')} rank(s)")
    model, cfg = load(args, device)
    n = world_size()
    fault_rank = args.fault_rank if args.fault_rank is not None else (1 if n > 1 else 0)
    if not 0 <= fault_rank < n:
        raise SystemExit(f"--fault-rank {fault_rank}: this run has {n} rank(s)")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    weights = sum(t.numel() * t.element_size() for t in map(local_shard, model.parameters())) / 2**20
    say(f"loaded: {weights:.0f} MiB of weights on rank 0")
    ids = prompt_ids(cfg.vocab_size, args.prompt, args.seed, device)
    reference = read_reference(args.reference, args) if args.reference else None

    results = {"unprotected": variant(model, args, device, ids, cfg, "unprotected")}
    ftt.enable_fault_tolerance(model, ftt.FTConfig())
    # the one-launch Q/K/V and gate/up GEMMs (`ft_transformers.siblings`, on each rank's colwise shards): groups
    # of fp16/bf16 calls of up to 16 rows on CUDA
    groups = sum("_ftt_sibling_key" in m.__dict__ for m in model.modules())
    siblings = device.type == "cuda" and args.dtype != "float32" and groups > 0
    results["protected"] = variant(model, args, device, ids, cfg, "protected")
    if args.per_layer:
        with override(siblings=False):  # (read when protection is enabled)
            ftt.enable_fault_tolerance(model, ftt.FTConfig())
        results[PER_LAYER] = variant(model, args, device, ids, cfg, "protected, one launch per layer")
        ftt.enable_fault_tolerance(model, ftt.FTConfig())

    block = (cfg.num_hidden_layers - 1) // 2  # (with two layers the first: the last one's flips reach no later layer)
    linear = f"model.layers.{block}.mlp.down_proj"
    lin_bit = 30 if args.dtype == "float32" else 14  # the top exponent bit of the output's format
    sites = () if args.no_injection else (("linear.output", linear, lin_bit), ("attn.scores", block, 30))
    clean = results["protected"]["tokens"]
    injection = {"protected": [], "unprotected": []}
    for site, target, bit in sites:
        say(f"protected: one flip at {site} of {target} on rank {fault_rank}")
        injection["protected"].append(inject(model, args, ids, site, target, bit, clean, fault_rank))
    ftt.enable_fault_tolerance(model, ftt.FTConfig(detect=False, correct=False))
    for site, target, bit in sites:
        say(f"unprotected (checks off): one flip at {site} of {target} on rank {fault_rank}")
        injection["unprotected"].append(inject(model, args, ids, site, target, bit, clean, fault_rank))
    ftt.disable_fault_tolerance(model)

    comparison = {}
    if reference is not None:
        for name in ("unprotected", "protected"):
            comparison[name] = compare(reference["variants"][name], results[name]["tokens"],
                                       results[name]["_logits"])
    for r in results.values():
        del r["_logits"]
    result = {"model": args.model, "tiny": args.tiny, "dtype": args.dtype, "tp": n, "prompt": args.prompt,
              "new_tokens": args.new_tokens, "seed": args.seed, "weight_std": args.weight_std,
              "siblings": siblings, "sibling_groups": groups, "device": device_label(device),
              "versions": versions(), "weights_mib_per_rank": gather(weights), "variants": results,
              "injection": injection, "comparison": comparison,
              "reference": str(args.reference) if args.reference else None}
    result["checks"] = checks_of(result)
    ok = all(result["checks"].values())
    if rank() == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        stem = args.out / f"tp_check_{args.model}_{args.dtype}_tp{n}"
        stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
        text = markdown(result, reference)
        stem.with_suffix(".md").write_text(text)
        print(text, flush=True)
        print("OK" if ok else "FAILED", flush=True)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
