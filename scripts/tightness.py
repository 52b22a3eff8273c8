#!/usr/bin/env python
"""How tight the checks are, per layer: the clean ratio E/T and the largest change a single bit flip
can make without being detected.

For every protected Linear and every attention call of a model, on real activations (captured by
running the model on short prompts):

* **E/T** — the largest clean checksum difference over its threshold. Linear: every (row, 64-column
  group) of the checked product (`ft_transformers.checked_linear.group_residuals` on the reference
  path, ``gemm_residuals`` of the Triton kernel on CUDA). Attention: EFTA's two checksum checks, GEMM I
  (``attn.scores``) and the unified verification of GEMM II (``attn.output``), read from the reference
  path (on any device).
* **Largest undetected change** — single-bit flips, uniform over the bits, spread over the layers of a
  layer class (q/k/v/o/gate/up/down/lm_head; each attention site of
  ``ft_transformers.kernels.contract.ATTENTION_SITES``), with ``correct=False``. A flip is undetected
  when the call reports 0 ``detected``; its change is ``max |y_faulty − y_clean|`` (a non-finite
  output counts as an infinite change), also relative to the RMS of that output row (the whole row of
  y for a Linear, the head's D values for attention). Targets: ≤ 0.05 absolute at lm_head, ≤ 1 % of
  the row RMS elsewhere.

Linear flips run the checked linear's own forward with the weight checksums cached per layer, as a
protected module runs it (`_linear_call`; the tests check that it agrees with ``ftt.checked_linear``);
attention flips run ``ftt.efta_attention`` on the captured q/k/v with the call's own mask arguments.

Outputs in ``--out``: ``flips.csv`` (one row per layer class and bit), ``clean.csv`` (one row per
layer and check), ``summary.md`` (both tables), ``undetected.png`` (needs matplotlib: the ``plot``
extra) and ``run.json`` (arguments and environment).

    python scripts/tightness.py --model smollm2 --dtype float32 --flips 10000 --out docs/data/tightness/smollm2_fp32
    python scripts/tightness.py --dims qwen2-0.5b --layers 2 --device cuda --dtype bfloat16 --out out/q05
    python scripts/tightness.py --lmhead --device cuda --dtype float16 --m 1 16 512 4096 --out out/lmhead
"""

from __future__ import annotations

import argparse
import csv
import inspect
import json
import math
import os
import subprocess
import sys
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from ft_transformers.kernels.contract import ATTENTION_SITES, KIND_INDEX
from ft_transformers.kernels.gemm_checksums import xvar_in_use
from tqdm import tqdm

import ft_transformers as ftt
from ft_transformers import attention as _attention
from ft_transformers.checked_linear import _checked_linear_forward, group_residuals
from ft_transformers.counters import new_counters
from ft_transformers.discovery import calls_attention_interface, linear_layout
from ft_transformers.injection import FaultPlan

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import environment  # noqa: E402

FLIP_COLUMNS = ("model", "dtype", "device", "backend", "kind", "layer_class", "bit", "flips", "detected",
                "undetected", "undetected_changed", "max_undetected_change", "row_rms_at_max",
                "max_undetected_rel", "max_undetected_ulps", "target_kind", "target", "over_target",
                "over_target_gt_1ulp")
CLEAN_COLUMNS = ("model", "dtype", "device", "kind", "layer_class", "module", "check", "rows", "max_ratio",
                 "source")
LMHEAD_TARGET = 0.05  # largest undetected logit change (absolute)
REL_TARGET = 0.01  # largest undetected change elsewhere, relative to the output row's RMS
# Published dims (random weights): the configs of Qwen2-0.5B and Qwen2-7B; "tiny" for smoke runs and tests.
DIMS = {
    "qwen2-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_attention_heads=14,
                       num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2-7b": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
                     num_key_value_heads=4, tie_word_embeddings=False),
    "tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=False),
}
LMHEAD_SHAPES = ((576, 49152), (896, 151936))  # (K, N) of SmolLM2's and Qwen2-0.5B's lm_head
PROMPTS = (
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain in one paragraph how a bicycle stays upright.",
    "List three prime numbers greater than 100 and say why they are prime.",
    "Translate 'good morning, how are you?' into German.",
    "What does a compiler do?",
)


# ---------------------------------------------------------------------------------------------
# Captured activations
# ---------------------------------------------------------------------------------------------

@dataclass
class LinearLayer:
    """One protected Linear: its weight (N, K), bias and the inputs it saw, as (M ≤ max_rows, K) chunks."""

    name: str
    layer_class: str
    weight: torch.Tensor
    bias: torch.Tensor | None
    inputs: list[torch.Tensor] = field(default_factory=list)
    owner: object = field(default_factory=types.SimpleNamespace)  # holds the cached weight checksums


@dataclass
class AttentionCall:
    """One attention call as EFTA received it: q (B, Hq, M, D), k/v (B, Hkv, N, D) and its arguments."""

    name: str
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    kwargs: dict


def linear_class(name: str) -> str:
    """``model.layers.3.self_attn.q_proj`` → ``q``; ``lm_head`` → ``lm_head``; else the last component."""
    last = name.rsplit(".", 1)[-1]
    return last[:-5] if last.endswith("_proj") else last


def capture(model: torch.nn.Module, prompts: Sequence[torch.Tensor], max_rows: int
            ) -> tuple[list[LinearLayer], list[AttentionCall]]:
    """Run ``model`` on each prompt (1, T) and record every Linear's input and every EFTA call.

    Linear inputs are split into chunks of at most ``max_rows`` rows (the checks are per row, so a
    chunk sees the thresholds the full call would). Attention calls are recorded where
    `ft_transformers.attention` hands them to EFTA (the model must run ``attn_implementation="efta"``).
    """
    layers: dict[str, LinearLayer] = {}
    handles = []
    for name, mod in model.named_modules():
        layout = linear_layout(mod)
        if layout is None:
            continue
        w = mod.weight.detach()
        layers[name] = LinearLayer(name, linear_class(name), w.t() if layout == "kn" else w,
                                   None if mod.bias is None else mod.bias.detach())

        def hook(_mod, args, name=name):
            x = args[0].detach().reshape(-1, args[0].shape[-1])
            layers[name].inputs.extend(x[i:i + max_rows].clone() for i in range(0, x.shape[0], max_rows))

        handles.append(mod.register_forward_pre_hook(hook))
    calls: list[AttentionCall] = []
    names = {id(m): n for n, m in model.named_modules()}
    orig = _attention._efta_forward
    current: list[str] = [""]

    def recording(q, k, v, **kw):
        calls.append(AttentionCall(current[0] or f"attention.{len(calls)}", q.detach().clone(), k.detach().clone(),
                                   v.detach().clone(), {key: kw[key] for key in
                                                        ("scale", "causal", "bias", "attn_mask", "window")}))
        return orig(q, k, v, **kw)

    def attn_pre(mod, _args):
        current[0] = names[id(mod)]

    for mod in model.modules():
        if calls_attention_interface(type(mod)):
            handles.append(mod.register_forward_pre_hook(attn_pre))
    _attention._efta_forward = recording
    try:
        with torch.no_grad():
            for ids in prompts:
                model(input_ids=ids.to(model.device))
    finally:
        _attention._efta_forward = orig
        for h in handles:
            h.remove()
    return [lay for lay in layers.values() if lay.inputs], calls


def smollm2_prompts(tok, n: int) -> list[torch.Tensor]:
    """The first ``n`` of `PROMPTS` through SmolLM2's chat template: (1, T) token ids each."""
    from ft_transformers.campaign.models import encode_prompt

    return [encode_prompt(tok, p, True) for p in PROMPTS[:n]]


def dims_model(dims: str, layers: int, dtype: torch.dtype, device: str):
    """A Qwen2 model with the published dims ``dims`` (`DIMS`), ``layers`` blocks, random weights
    (transformers' default init), attention on EFTA."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    if dims not in DIMS:
        raise ValueError(f"unknown --dims {dims!r}; choose from {', '.join(DIMS)}")
    cfg = Qwen2Config(num_hidden_layers=layers, max_position_embeddings=4096, **DIMS[dims])
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="efta", dtype=dtype)
    return model.eval()


def random_prompts(vocab: int, n: int, tokens: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (1, tokens), generator=g) for _ in range(n)]


def lmhead_layers(shapes: Sequence[tuple[int, int]], ms: Sequence[int], dtype: torch.dtype, device: str,
                  seed: int = 0) -> list[LinearLayer]:
    """Synthetic lm_heads: W ~ N(0, 1/K) (N, K), one input x ~ N(0, 4²) (M, K) per M, so logits have a
    standard deviation of about 4 (a peak near 20 over 49k–152k columns); class ``lm_head K=.. N=.. M=..``."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k, n in shapes:
        w = (torch.randn(n, k, generator=g) / math.sqrt(k)).to(dtype=dtype, device=device)
        for m in ms:
            x = (4.0 * torch.randn(m, k, generator=g)).to(dtype=dtype, device=device)
            name = f"lm_head K={k} N={n} M={m}"
            out.append(LinearLayer(name, name, w, None, [x]))
    return out


# ---------------------------------------------------------------------------------------------
# Clean ratio E/T
# ---------------------------------------------------------------------------------------------

def _ratio(d: torch.Tensor, thr: torch.Tensor) -> float:
    """max |d| / thr (0/0 counts 0, a difference over a zero threshold or a non-finite one counts inf)."""
    d = d.abs().float()
    r = torch.where(thr > 0, d / thr.clamp_min(torch.finfo(torch.float32).tiny),
                    torch.where(d == 0, torch.zeros_like(d), torch.full_like(d, math.inf)))
    r = torch.nan_to_num(r, nan=math.inf)
    return float(r.max()) if r.numel() else 0.0


def _on_triton(backend: str, device_type: str) -> bool:
    """Whether the Linear checks run in the Triton kernels: ``--backend triton``, or ``auto`` on CUDA."""
    return backend == "triton" or (backend == "auto" and device_type == "cuda")


def linear_clean_ratio(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, emax: float | None,
                       csigma: float = 2.5, backend: str = "auto") -> tuple[float, str]:
    """``(E/T, source)`` of one checked GEMM on x (M, K): the largest clean |D|/T over its (row, column
    group) checks. The Triton backend (``"triton"``, or ``"auto"`` on CUDA): the kernel's own residuals
    (``gemm_residuals``, accumulator mode); otherwise the reference path's (`group_residuals`)."""
    if _on_triton(backend, x.device.type):
        from ft_transformers.kernels.abft_gemm import gemm_residuals

        from ft_transformers.vabft import gemm_emax

        e, e_var = (emax, emax) if emax is not None else gemm_emax(x.dtype, x.device, "accumulator", x.shape[-1])
        r = gemm_residuals(x, weight, bias, mode="accumulator", emax=e, emax_var=e_var, csigma=csigma)
        return _ratio(r["d"], r["thr"]), "gemm_residuals"
    d, thr = group_residuals(x, weight, bias, emax=emax, csigma=csigma)
    return _ratio(d, thr), "group_residuals"


def attention_clean_ratios(call: AttentionCall, inject: ftt.FaultSpec | None = None) -> dict[str, float]:
    """E/T of EFTA's two checksum checks on a reference call: ``attn.scores`` (GEMM I, per key block and
    group (row, residue)) and ``attn.output`` (GEMM II's unified verification per group). Clean unless
    ``inject`` is given (then a ratio above 1 is what the check flags).

    The differences and thresholds are re-formed from the arguments the reference path passes its
    checks (`efta_reference.scores.check_scores`, `efta_reference.output.verify_output`), with the
    same helpers and the same threshold expressions, while the call runs.
    """
    from ft_transformers.efta_reference import output as ref_out
    from ft_transformers.efta_reference import scores as ref_scores
    from ft_transformers.efta_reference.checksums import g, group_sums

    ratios = {"attn.scores": 0.0, "attn.output": 0.0}
    check_scores, verify_output = ref_scores.check_scores, ref_out.verify_output

    def scores_ratio(S, qs, kb, kc, kabs, qn1, s_floor, *, stride, **_):
        sc = torch.matmul(qs, kc.transpose(-1, -2))
        g1, _ = group_sums(S, kb.shape[-2] // stride, stride)
        thr = (qn1 * kabs.unsqueeze(2)).nan_to_num(nan=0.0)
        return _ratio(sc[..., :stride] - g1, thr + s_floor if s_floor is not None else thr)

    def output_ratio(O, acc, vmax, redo_rows, *, stride, block_n, nblocks, **_):
        d = O.shape[-1]
        dp = -(-d // stride) * stride
        og = torch.nn.functional.pad(O, (0, dp - d)) if dp != d else O
        g1, _ = group_sums(og, dp // stride, stride)
        thr = 2.0 * g(block_n + 2 * nblocks + dp // stride + 4) * vmax
        return _ratio(acc[..., d:d + stride] - g1, thr)

    def probe(check: str, fn, ratio_of):
        sig = inspect.signature(fn)

        def wrapped(*args, **kw):
            r = ratio_of(**sig.bind(*args, **kw).arguments)
            ratios[check] = max(ratios[check], r)
            return fn(*args, **kw)

        return wrapped

    scores_probe = probe("attn.scores", check_scores, scores_ratio)
    output_probe = probe("attn.output", verify_output, output_ratio)
    ref_scores.check_scores, ref_out.verify_output = scores_probe, output_probe
    try:
        with torch.no_grad():
            ftt.efta_attention(call.q, call.k, call.v, **call.kwargs, backend="reference", correct=False,
                               inject=inject)
    finally:
        ref_scores.check_scores, ref_out.verify_output = check_scores, verify_output
    return ratios


# ---------------------------------------------------------------------------------------------
# Single-bit flips
# ---------------------------------------------------------------------------------------------

@dataclass
class BitStats:
    """Flips of one bit in one layer class."""

    flips: int = 0
    detected: int = 0
    undetected: int = 0
    undetected_changed: int = 0  # undetected flips that changed the output at all
    max_change: float = 0.0  # largest |y_faulty − y_clean| among undetected flips
    rms_at_max: float = 0.0  # RMS of the clean output row where that change happened
    max_rel: float = 0.0  # largest undetected change relative to its row's RMS
    max_ulps: float = 0.0  # largest undetected change in units of the output dtype's ulp at that element
    over_target: int = 0  # undetected flips beyond the class's target
    over_target_ulp: int = 0  # ... of which more than one ulp of the output (not a rounding-boundary step)

    def add(self, detected: bool, change: float, rms: float, ulps: float, over: bool) -> None:
        self.flips += 1
        if detected:
            self.detected += 1
            return
        self.undetected += 1
        if change > 0:
            self.undetected_changed += 1
            rel = change / rms if rms > 0 else math.inf
            if change > self.max_change:
                self.max_change, self.rms_at_max = change, rms
            self.max_rel = max(self.max_rel, rel)
            self.max_ulps = max(self.max_ulps, ulps)
            self.over_target += bool(over)
            self.over_target_ulp += bool(over and ulps > 1.0)


def _change(y: torch.Tensor, y_clean: torch.Tensor, row_rms: torch.Tensor) -> tuple[float, float, float]:
    """``(max |y − y_clean|, RMS of the clean row where it is largest, that change in ulps of y's dtype at
    the clean value)``; rows are the last dim of y. A change of one ulp can come from any perturbation
    that moves the unrounded value across a rounding boundary, however small."""
    diff = torch.nan_to_num((y.float() - y_clean.float()).abs(), nan=math.inf).flatten()
    i = int(diff.argmax())
    change = float(diff[i])
    return change, float(row_rms.reshape(-1)[i // y.shape[-1]]), change / _ulp(float(y_clean.flatten()[i]), y.dtype)


def _ulp(v: float, dtype: torch.dtype) -> float:
    """The spacing of ``dtype`` values at ``v`` (the subnormal spacing near 0)."""
    fi = torch.finfo(dtype)
    if v == 0 or not math.isfinite(v):
        return fi.smallest_normal * fi.eps if v == 0 else math.inf
    _, e = math.frexp(abs(v))  # |v| = m·2^e, 0.5 <= m < 1: the spacing above 2^(e-1)
    return max(math.ldexp(fi.eps, e - 1), fi.smallest_normal * fi.eps)


def _rms(y: torch.Tensor) -> torch.Tensor:
    return y.float().square().mean(-1).sqrt()


def _detected(counters: torch.Tensor) -> int:
    return int(counters[:, KIND_INDEX["detected"]].sum())


def _linear_call(lay: LinearLayer, x: torch.Tensor, spec: ftt.FaultSpec | None, *, emax: float | None,
                 csigma: float, backend: str) -> tuple[torch.Tensor, int]:
    """``(y, detected)`` of one checked, uncorrected call of ``lay`` on x with the faults ``spec``: what
    ``ftt.checked_linear(x, W, b, inject=spec, correct=False)`` computes, with the weight checksums
    cached on the layer (a protected module's forward)."""
    counters = new_counters(x.device)
    with torch.no_grad():
        y = _checked_linear_forward(x, lay.weight, lay.bias, weight_is_kn=False, emax=emax, csigma=csigma,
                                    detect=True, correct=False, plan=FaultPlan(spec), counters=counters,
                                    cache_owner=lay.owner, backend=backend)
    return y, _detected(counters)


def _flip_loop(n_flips: int, nbits: int, targets: int,
               run: Callable[[int, int, int], tuple[bool, float, float, float]],
               stats: dict[int, BitStats], is_over: Callable[[float, float], bool], *, seed: int, budget: float,
               desc: str) -> None:
    """Flip ``i`` flips bit ``i % nbits`` (bits uniform, so a budget cut keeps them balanced) on a
    random target with FaultSpec seed ``seed + i``; ``run(target, bit, seed)`` returns
    ``(detected, change, row_rms, ulps)``."""
    g = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, targets, (n_flips,), generator=g).tolist()
    t0 = time.monotonic()
    for i in tqdm(range(n_flips), desc=desc, unit="flip", leave=False, mininterval=2.0):
        if budget and time.monotonic() - t0 > budget and i % nbits == 0:
            break
        bit = i % nbits
        det, change, rms, ulps = run(picks[i], bit, seed + i)
        stats.setdefault(bit, BitStats()).add(det, change, rms, ulps, is_over(change, rms))


def linear_flips(layers: Sequence[LinearLayer], n_flips: int, *, emax: float | None = None, csigma: float = 2.5,
                 backend: str = "auto", target: tuple[str, float] = ("rel", REL_TARGET), seed: int = 0,
                 budget: float = 0.0) -> dict[int, BitStats]:
    """Single-bit flips at ``linear.output`` over the inputs of ``layers`` (one layer class): per bit,
    the flips, detections and the largest undetected change. ``target`` = ("abs" | "rel", bound)."""
    chunks = [(lay, x) for lay in layers for x in lay.inputs]
    if not chunks:
        return {}
    nbits = torch.finfo(chunks[0][1].dtype).bits
    clean: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def run(t: int, bit: int, s: int):
        lay, x = chunks[t]
        if t not in clean:
            y0, det0 = _linear_call(lay, x, None, emax=emax, csigma=csigma, backend=backend)
            if det0:
                raise RuntimeError(f"{lay.name}: the clean call reports {det0} detections (a false positive); "
                                   "its flips cannot be told apart")
            clean[t] = (y0, _rms(y0))
        y0, rms = clean[t]
        spec = ftt.FaultSpec(site="linear.output", bit=bit, count=1, seed=s)
        y, det = _linear_call(lay, x, spec, emax=emax, csigma=csigma, backend=backend)
        return (det > 0, *_change(y, y0, rms))

    stats: dict[int, BitStats] = {}
    _flip_loop(n_flips, nbits, len(chunks), run, stats, _over(target), seed=seed, budget=budget,
               desc=layers[0].layer_class)
    return stats


def _over(target: tuple[str, float]) -> Callable[[float, float], bool]:
    kind, bound = target
    if kind == "abs":
        return lambda change, rms: change > bound
    return lambda change, rms: change > bound * rms


def site_bits(call: AttentionCall, site: str, backend: str) -> int | None:
    """Bits of the values stored at an attention ``site`` (32 for fp32 sites, 16 for fp16/bf16 ones), or
    None when flips there reach nothing in ``efta_attention`` on this backend: a model-level site, or one
    that the call does not compute (a flip of every element, ``ber=1``, changes no output and is not
    detected)."""
    def attend(spec):
        with torch.no_grad():
            return ftt.efta_attention(call.q, call.k, call.v, **call.kwargs, backend=backend, correct=False,
                                      inject=spec)

    try:
        out, st = attend(ftt.FaultSpec(site=site, ber=1.0, seed=0))
    except ValueError:
        return None
    clean, _ = attend(None)
    if st["detected"] == 0 and torch.equal(out, clean):
        return None
    for nbits in (32, 16):
        try:
            attend(ftt.FaultSpec(site=site, bit=nbits - 1, count=1, seed=0))
            return nbits
        except ValueError as exc:
            if "out of range" not in str(exc):
                return None
    return None


def attention_flips(calls: Sequence[AttentionCall], site: str, n_flips: int, *, backend: str = "auto",
                    detect: bool = True, seed: int = 0, budget: float = 0.0) -> dict[int, BitStats]:
    """Single-bit flips at the attention ``site`` over ``calls``: per bit, the flips, detections and the
    largest undetected change of the output, relative to the RMS of the output row (one head's D values).
    ``detect=False`` runs EFTA unchecked (every flip undetected: the unprotected change)."""
    if not calls:
        return {}
    nbits = site_bits(calls[0], site, backend)
    if nbits is None:
        return {}
    clean: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def attend(c: AttentionCall, spec):
        with torch.no_grad():
            return ftt.efta_attention(c.q, c.k, c.v, **c.kwargs, backend=backend, detect=detect, correct=False,
                                      inject=spec)

    def run(t: int, bit: int, s: int):
        c = calls[t]
        if t not in clean:
            o0, st0 = attend(c, None)
            if st0["detected"]:
                raise RuntimeError(f"{c.name}: the clean call reports {st0['detected']} detections (a false "
                                   "positive); its flips cannot be told apart")
            clean[t] = (o0, _rms(o0))
        o0, rms = clean[t]
        o, st = attend(c, ftt.FaultSpec(site=site, bit=bit, count=1, seed=s))
        return (st["detected"] > 0, *_change(o, o0, rms))

    stats: dict[int, BitStats] = {}
    _flip_loop(n_flips, nbits, len(calls), run, stats, _over(("rel", REL_TARGET)), seed=seed, budget=budget,
               desc=site)
    return stats


# ---------------------------------------------------------------------------------------------
# Reports
# ---------------------------------------------------------------------------------------------

def flip_rows(meta: dict, kind: str, layer_class: str, stats: dict[int, BitStats], target: tuple[str, float]
              ) -> list[dict]:
    """`FLIP_COLUMNS` rows, one per bit."""
    return [dict(meta, kind=kind, layer_class=layer_class, bit=bit, flips=s.flips, detected=s.detected,
                 undetected=s.undetected, undetected_changed=s.undetected_changed,
                 max_undetected_change=s.max_change, row_rms_at_max=s.rms_at_max, max_undetected_rel=s.max_rel,
                 max_undetected_ulps=s.max_ulps, target_kind=target[0], target=target[1], over_target=s.over_target,
                 over_target_gt_1ulp=s.over_target_ulp)
            for bit, s in sorted(stats.items())]


def write_csv(path: str, columns: Sequence[str], rows: Sequence[dict]) -> None:
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=list(columns))
        w.writeheader()
        for r in rows:
            w.writerow({c: r[c] for c in columns})


def read_csv(path: str) -> list[dict]:
    """The rows of a ``flips.csv`` or ``clean.csv``, numbers parsed."""
    ints = {"bit", "flips", "detected", "undetected", "undetected_changed", "over_target", "over_target_gt_1ulp",
            "rows"}
    floats = {"max_undetected_change", "row_rms_at_max", "max_undetected_rel", "max_undetected_ulps", "target",
              "max_ratio"}
    with open(path, newline="", encoding="utf-8") as fh:
        return [{k: int(v) if k in ints else float(v) if k in floats else v for k, v in r.items()}
                for r in csv.DictReader(fh)]


def redraw(out: str, plot_too: bool = True) -> str:
    """Rewrite ``out``'s summary.md (and undetected.png) from its flips.csv and clean.csv; returns the markdown."""
    flips, clean = read_csv(os.path.join(out, "flips.csv")), read_csv(os.path.join(out, "clean.csv"))
    r0 = flips[0] if flips else clean[0]
    run_path = os.path.join(out, "run.json")
    run = {}
    if os.path.exists(run_path):
        with open(run_path, encoding="utf-8") as fh:
            run = json.load(fh)
    title = f"{r0['model']}, {r0['dtype']}, {r0['device']}"
    if run.get("linear_xvar") == "outlier":
        title += ", x's outlier variance estimate"
    md = summary_markdown(flips, clean, title)
    if run:
        md += _skipped_note(run)
    with open(os.path.join(out, "summary.md"), "w", encoding="utf-8") as fh:
        fh.write(md)
    if plot_too:
        plot(flips, os.path.join(out, "undetected.png"), title)
    return md


def _skipped_note(run: dict) -> str:
    if not run.get("skipped_sites"):
        return ""
    return (f"\nNo flip reaches the output through efta_attention ({run['args']['backend']} backend) at: "
            f"{', '.join(run['skipped_sites'])} (model-level sites, or sites this backend does not compute).\n")


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    if not math.isfinite(v):
        return str(v)
    return f"{v:.3g}"


def summary_markdown(flips: Sequence[dict], clean: Sequence[dict], title: str) -> str:
    """Two tables: E/T per layer class (and attention check), and the flips per layer class. Changes of at
    most one ulp of the output are listed apart: any perturbation, however small, can cross a rounding
    boundary, so no check can exclude them."""
    lines = [f"### {title}", "", "| layer class | layers | E/T (largest) | E/T (median of layers) | source |",
             "|---|---|---|---|---|"]
    by_class: dict[tuple[str, str], list[dict]] = {}
    for r in clean:
        by_class.setdefault((r["layer_class"], r["check"]), []).append(r)
    for (cls, check), rs in by_class.items():
        ratios = sorted(r["max_ratio"] for r in rs)
        label = cls if check == "linear.output" else f"attention, {check} check"
        lines.append(f"| {label} | {len(rs)} | {_fmt(ratios[-1])} | {_fmt(ratios[len(ratios) // 2])} | "
                     f"{rs[0]['source']} |")
    lines += ["", "| layer class | flips | detected | largest undetected change (bit) | largest undetected / row "
              "RMS | target | undetected beyond target (of which > 1 ulp) |", "|---|---|---|---|---|---|---|"]
    groups: dict[str, list[dict]] = {}
    for r in flips:
        groups.setdefault(r["layer_class"], []).append(r)
    for cls, rs in groups.items():
        n = sum(r["flips"] for r in rs)
        det = sum(r["detected"] for r in rs)
        worst = max(rs, key=lambda r: r["max_undetected_change"])
        rel = max(r["max_undetected_rel"] for r in rs)
        over = sum(r["over_target"] for r in rs)
        over_ulp = sum(r["over_target_gt_1ulp"] for r in rs)
        tgt = (f"≤ {rs[0]['target']:g}" if rs[0]["target_kind"] == "abs"
               else f"≤ {100 * rs[0]['target']:g} % RMS")
        change = (f"{_fmt(worst['max_undetected_change'])} ({worst['bit']})" if worst["max_undetected_change"] > 0
                  else "0")
        lines.append(f"| {cls} | {n} | {100 * det / max(n, 1):.1f} % | {change} | {_fmt(rel)} | {tgt} | {over} "
                     f"({over_ulp}) |")
    return "\n".join(lines) + "\n"


def plot(flips: Sequence[dict], path: str, title: str) -> None:
    """Largest undetected change per bit and layer class: absolute (left) and relative to the row RMS
    (right), log scale; bits where no undetected flip changed anything are left out."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("the plot needs matplotlib: pip install 'ft-transformers[plot]' (or pass --no-plot)"
                          ) from exc
    groups: dict[str, list[dict]] = {}
    for r in flips:
        groups.setdefault(r["layer_class"], []).append(r)
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    colors = plt.get_cmap("tab20").colors
    for i, (cls, rs) in enumerate(groups.items()):
        pts = [(r["bit"], r["max_undetected_change"], r["max_undetected_rel"]) for r in rs
               if r["max_undetected_change"] > 0]
        if not pts:
            continue
        bits, ab, rel = zip(*pts)
        style = "--" if cls.startswith("attn.") else "-"
        kw = dict(marker=".", label=cls, color=colors[i % len(colors)])
        axes[0].plot(bits, [min(v, 1e38) for v in ab], style, **kw)
        axes[1].plot(bits, [min(v, 1e38) for v in rel], style, **kw)
    axes[0].axhline(LMHEAD_TARGET, color="k", lw=0.8, ls=":", label=f"lm_head target {LMHEAD_TARGET:g}")
    axes[1].axhline(REL_TARGET, color="k", lw=0.8, ls=":", label=f"target {100 * REL_TARGET:g} % of the row RMS")
    axes[0].set_ylabel("largest undetected |Δy|")
    axes[1].set_ylabel("largest undetected |Δy| / row RMS")
    for ax in axes:
        ax.set_yscale("log")
        ax.set_xlabel("bit flipped (0 = mantissa LSB)")
        ax.grid(True, which="major", alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.legend(fontsize=7, ncol=2)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------

_CLASS_ORDER = ("q", "k", "v", "o", "gate", "up", "down", "lm_head")


def _linear_target(layer_class: str) -> tuple[str, float]:
    return ("abs", LMHEAD_TARGET) if layer_class.startswith("lm_head") else ("rel", REL_TARGET)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default="smollm2", help="smollm2 (real weights, the default)")
    src.add_argument("--dims", choices=sorted(DIMS), help="Qwen2 with published dims and random weights")
    src.add_argument("--lmhead", action="store_true", help="synthetic lm_head shapes (K=576,N=49152; K=896,N=151936)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--device", default="cpu")
    p.add_argument("--backend", default="auto", choices=("auto", "triton", "reference"))
    p.add_argument("--flips", type=int, default=10000, help="single-bit flips per layer class")
    p.add_argument("--budget", type=float, default=0.0, help="seconds per layer class at most (0: no limit)")
    p.add_argument("--class-budget", nargs="+", default=[], metavar="CLASS=SECONDS",
                   help="--budget for some layer classes, e.g. lm_head=300")
    p.add_argument("--prompts", type=int, default=4, help="prompts whose activations are captured")
    p.add_argument("--tokens", type=int, default=64, help="tokens per random prompt (--dims)")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks of a --dims model")
    p.add_argument("--max-rows", type=int, default=16, help="rows per captured Linear input chunk")
    p.add_argument("--m", type=int, nargs="+", default=None,
                   help="--lmhead rows M (default 1 16 512 4096 on CUDA, 1 16 on CPU)")
    p.add_argument("--emax", type=float, default=None, help="V-ABFT e_max of the Linear checks (default: the table)")
    p.add_argument("--only", nargs="+", default=None, help="measure only these layer classes / attention sites")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (1: the small GEMMs here run fastest single-threaded on a shared CPU)")
    p.add_argument("--out", default="tightness_out")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--quick", action="store_true", help="64 flips per class, 1 prompt")
    p.add_argument("--redraw", nargs="+", metavar="DIR",
                   help="only rewrite DIR/summary.md and DIR/undetected.png from DIR's CSVs")
    a = p.parse_args(argv)
    if a.quick:
        a.flips, a.prompts = min(a.flips, 64), 1
    if a.flips < 1 or a.prompts < 1 or a.max_rows < 1:
        p.error("--flips, --prompts and --max-rows must be >= 1")
    try:
        a.class_budget = {k: float(v) for k, v in (item.split("=", 1) for item in a.class_budget)}
    except ValueError:
        p.error(f"--class-budget takes CLASS=SECONDS, got {a.class_budget}")
    return a


def _setup(a: argparse.Namespace) -> tuple[str, list[LinearLayer], list[AttentionCall]]:
    dtype = getattr(torch, a.dtype)
    if a.lmhead:
        ms = a.m or ([1, 16, 512, 4096] if a.device.startswith("cuda") else [1, 16])
        return "lmhead", lmhead_layers(LMHEAD_SHAPES, ms, dtype, a.device, a.seed), []
    if a.dims:
        model = dims_model(a.dims, a.layers, dtype, a.device)
        prompts = random_prompts(model.config.vocab_size, a.prompts, a.tokens, a.seed)
        label = f"{a.dims}-dims"
    else:
        from ft_transformers.campaign.models import load_model

        model, tok = load_model(a.model, a.dtype, a.device)
        prompts = smollm2_prompts(tok, a.prompts) if a.model == "smollm2" else random_prompts(
            model.config.vocab_size, a.prompts, a.tokens, a.seed)
        label = a.model
    layers, calls = capture(model, prompts, a.max_rows)
    del model
    return label, layers, calls


def _source_state() -> dict:
    """The checkout measured: its commit and the files changed in the working tree (empty when clean)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return {}
    return dict(commit=head.stdout.strip(), modified=[ln[3:] for ln in dirty.stdout.splitlines()])


def main(argv: Sequence[str] | None = None) -> dict:
    """Run the measurements of the command line ``argv``, write the outputs; returns the rows and run data."""
    a = parse_args(argv)
    if a.redraw:
        for d in a.redraw:
            redraw(d, plot_too=not a.no_plot)
        return {}
    threads = torch.get_num_threads()
    torch.set_num_threads(a.threads)
    try:
        return _run(a, argv)
    finally:
        torch.set_num_threads(threads)


def _emax_in_use(a: argparse.Namespace, classes: dict[str, list[LinearLayer]]) -> dict[str, list[float]]:
    """Per Linear class, the kernels' (e_max, e_var) at its K (`vabft.gemm_emax`; e_var: the variance terms'),
    where the Triton backend runs the checks and ``--emax`` does not set them."""
    dev = torch.device(a.device)
    if a.emax is not None or not _on_triton(a.backend, dev.type):
        return {}
    from ft_transformers.vabft import gemm_emax

    return {cls: list(gemm_emax(getattr(torch, a.dtype), dev, "accumulator", ls[0].weight.shape[1]))
            for cls, ls in classes.items()}


def _run(a: argparse.Namespace, argv: Sequence[str] | None) -> dict:
    os.makedirs(a.out, exist_ok=True)
    t_start = time.monotonic()
    label, layers, calls = _setup(a)
    meta = dict(model=label, dtype=a.dtype, device=a.device, backend=a.backend)
    want = (lambda c: a.only is None or c in a.only)

    classes: dict[str, list[LinearLayer]] = {}
    for lay in sorted(layers, key=lambda lay: (_CLASS_ORDER.index(lay.layer_class)
                                              if lay.layer_class in _CLASS_ORDER else len(_CLASS_ORDER))):
        if want(lay.layer_class):
            classes.setdefault(lay.layer_class, []).append(lay)
    sites = [s for s in ATTENTION_SITES if want(s)] if calls else []

    clean_rows: list[dict] = []
    for lay in tqdm([lay for ls in classes.values() for lay in ls], desc="clean E/T (linear)", unit="layer"):
        x = torch.cat(lay.inputs)
        ratio, source = linear_clean_ratio(x, lay.weight, lay.bias, emax=a.emax, backend=a.backend)
        clean_rows.append(dict(meta, kind="linear", layer_class=lay.layer_class, module=lay.name,
                               check="linear.output", rows=x.shape[0], max_ratio=ratio, source=source))
    if sites:
        for c in tqdm(calls, desc="clean E/T (attention)", unit="call"):
            for check, ratio in attention_clean_ratios(c).items():
                clean_rows.append(dict(meta, kind="attention", layer_class="attention", module=c.name, check=check,
                                       rows=c.q.shape[0] * c.q.shape[1] * c.q.shape[2], max_ratio=ratio,
                                       source="efta_reference checks"))

    flip_out: list[dict] = []
    timing: dict[str, float] = {}
    skipped: list[str] = []
    for cls, ls in classes.items():
        t0 = time.monotonic()
        target = _linear_target(cls)
        st = linear_flips(ls, a.flips, emax=a.emax, backend=a.backend, target=target, seed=a.seed,
                          budget=a.class_budget.get(cls, a.budget))
        flip_out += flip_rows(meta, "linear", cls, st, target)
        timing[cls] = time.monotonic() - t0
    for site in sites:
        t0 = time.monotonic()
        st = attention_flips(calls, site, a.flips, backend=a.backend, seed=a.seed,
                             budget=a.class_budget.get(site, a.budget))
        if not st:
            skipped.append(site)
        flip_out += flip_rows(meta, "attention", site, st, ("rel", REL_TARGET))
        timing[site] = time.monotonic() - t0

    write_csv(os.path.join(a.out, "flips.csv"), FLIP_COLUMNS, flip_out)
    write_csv(os.path.join(a.out, "clean.csv"), CLEAN_COLUMNS, clean_rows)
    run = dict(argv=list(sys.argv[1:] if argv is None else argv), args=vars(a), environment=environment(a.device),
               source=_source_state(),
               # x's variance estimate in the Linear checks' thresholds (FTT_GEMM_XVAR, `xvar_in_use`)
               linear_xvar="outlier" if xvar_in_use(torch.device(a.device).type, getattr(torch, a.dtype)) else "bound",
               linear_emax=_emax_in_use(a, classes), seconds=time.monotonic() - t_start, seconds_per_class=timing,
               skipped_sites=skipped)
    with open(os.path.join(a.out, "run.json"), "w", encoding="utf-8") as fh:
        json.dump(run, fh, indent=1)
    print(redraw(a.out, plot_too=not a.no_plot))
    return dict(flips=flip_out, clean=clean_rows, run=run)


if __name__ == "__main__":
    main()
