"""Fault-injection campaigns: what a soft error does to a model, and what ft_transformers saves.

A *campaign* runs N trials. A trial is one fault — (prompt, site, bit or BER, layer/module,
generation step, seed) — injected into a greedy generation twice: once with protection off
(``FTConfig(detect=False, correct=False)``) and once with full protection (``FTConfig()``).
Each arm's generated tokens are compared with the clean (fault-free) generation of the same
configuration, and the trial is classified the way the field does:

- ``masked``: output identical to the clean run, nothing detected;
- ``sdc``: silent data corruption, the output differs and no uncorrectable fault was reported
  (a miscorrection counts here too);
- ``detected_corrected``: detections, all corrected or recomputed, output identical;
- ``detected_uncorrectable``: the protection reported a fault it could not repair (a DUE);
- ``crash``: an exception, or non-finite logits (crash / non-finite).

Results are appended to a JSONL file as each trial finishes (header line, one ``clean`` line
per prompt, one ``trial`` line per trial); a killed campaign resumes where it stopped. Trial
definitions are derived from the campaign seed and the trial index only (plus the clean
generation length of the drawn prompt), so a re-run with the same seed gives the same trials,
and raising ``--trials`` extends a finished campaign.

Library entry points: `CampaignConfig`, `run_campaign`, `load_campaign`, `replay_trial`,
`classify`, `summarize`, `summary_markdown`, `per_bit_markdown`, `plot_sdc_per_bit`,
`plot_outcomes`, `events_by_step_layer`, `write_events`, `plot_events`, `trial_report`,
`write_report`; the CLI is `main` (``ftt-campaign`` / ``scripts/campaign.py``). See
docs/reliability.md.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import math
import os
import platform
import random
import signal
import subprocess
import sys
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .config import FTConfig
from .events import FaultEvent, FTReport
from .injection import FaultSpec, derive_seed
from .protect import _state, enable_fault_tolerance, fault_report, inject_faults
from .kernels.contract import KINDS, SITES

# --------------------------------------------------------------------------------------------
# Vocabulary
# --------------------------------------------------------------------------------------------

CLASSES: tuple[str, ...] = ("masked", "sdc", "detected_corrected", "detected_uncorrectable", "crash")
CLASS_LABELS: dict[str, str] = {
    "masked": "masked",
    "sdc": "SDC",
    "detected_corrected": "detected & corrected",
    "detected_uncorrectable": "detected, uncorrectable",
    "crash": "crash / non-finite",
}
ARMS: tuple[str, ...] = ("unprotected", "protected")
ARM_CONFIGS: dict[str, FTConfig] = {
    "unprotected": FTConfig(detect=False, correct=False, on_uncorrectable="ignore"),
    "protected": FTConfig(on_uncorrectable="ignore"),
}
FORMAT_VERSION = 1

TINY_MODELS = ("tiny-llama", "tiny-gpt2", "qwen2-0.5b-config", "gpt2-124m-config")  # random init, no download

DEFAULT_PROMPTS: tuple[dict, ...] = (  # short questions SmolLM2-135M-Instruct answers within ~10 tokens
    {"prompt": "What is the capital of France?", "answer": ["Paris"]},
    {"prompt": "What is the capital of Japan?", "answer": ["Tokyo"]},
    {"prompt": "What is the chemical symbol for gold?", "answer": ["Au"]},
    {"prompt": "Who painted the Mona Lisa?", "answer": ["Leonardo"]},
    {"prompt": "What is the largest ocean on Earth?", "answer": ["Pacific"]},
    {"prompt": "Who wrote Romeo and Juliet?", "answer": ["Shakespeare"]},
)


def bit_fields(dtype: torch.dtype) -> dict[str, tuple[int, ...]]:
    """``{"sign": bits, "exponent": bits, "mantissa": bits}`` of a float storage format (bit 0 = LSB)."""
    fi = torch.finfo(dtype)
    nbits = fi.bits
    mant = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7, torch.float64: 52}.get(dtype)
    if mant is None:
        raise TypeError(f"no bit layout for {dtype}")
    return {
        "sign": (nbits - 1,),
        "exponent": tuple(range(mant, nbits - 1)),
        "mantissa": tuple(range(mant)),
    }


def bit_class(bit: int, dtype: torch.dtype) -> str:
    """``"sign"``, ``"exponent"`` or ``"mantissa"`` for a bit of ``dtype``."""
    for name, bits in bit_fields(dtype).items():
        if bit in bits:
            return name
    raise ValueError(f"bit {bit} out of range for {dtype}")


def site_dtype(site: str, model_dtype: torch.dtype) -> torch.dtype:
    """Storage format of the values at a site: fp32 for attention, the GEMM output dtype for Linear."""
    return torch.float32 if site.startswith("attn.") else model_dtype


def parse_bits(tokens: Iterable[str | int]) -> list[str | int]:
    """Bit selectors: ``sign`` / ``exponent`` / ``mantissa`` (a bit drawn per trial), an int, or a
    range ``a-b`` (expanded to ints, both ends included)."""
    out: list[str | int] = []
    for tok in tokens:
        if isinstance(tok, int):
            out.append(tok)
            continue
        t = str(tok).strip().lower()
        if t in ("sign", "exponent", "mantissa"):
            out.append(t)
        elif "-" in t.lstrip("-"):
            a, b = t.split("-", 1)
            lo, hi = int(a), int(b)
            out.extend(range(min(lo, hi), max(lo, hi) + 1))
        else:
            out.append(int(t))
    return out


# --------------------------------------------------------------------------------------------
# Configuration and trials
# --------------------------------------------------------------------------------------------


@dataclass
class CampaignConfig:
    """A campaign: model, prompts, fault model, size.

    Attributes:
        model: ``"smollm2"`` (embedded), ``"tiny-llama"`` / ``"tiny-gpt2"`` (random tiny models,
            no download), a local path, a ``.gguf`` file or a Hugging Face id.
        prompts: list of ``{"prompt": str, "answer": [str, ...] | None}`` (answer optional: a
            trial's output is task-correct if it contains one of them, case-insensitive).
        sites: fault sites; trials cycle over ``sites × bits`` (or ``sites × ber``).
        bits: bit selectors (see `parse_bits`); a class name draws a bit of that class per trial.
        ber: bit error rates instead of ``bits`` (each trial one rate).
        count: flips per targeted call (bit mode).
        layers: block indices to draw from (None = every block; -1 = modules outside the blocks,
            e.g. ``lm_head``, for ``linear.output``).
        steps: generation steps (0 = prefill) to draw from (None = any step of the clean run);
            ``[-1]`` hits every step of the generation.
        trials: number of trials.
        max_new_tokens: generation length (greedy).
        seed: campaign seed.
        dtype, device: of the model.
        chat_template: wrap prompts with the tokenizer's chat template when it has one.
    """

    model: str = "smollm2"
    prompts: list[dict] = field(default_factory=lambda: [dict(p) for p in DEFAULT_PROMPTS])
    sites: list[str] = field(default_factory=lambda: ["attn.scores", "linear.output"])
    bits: list[str | int] | None = field(default_factory=lambda: ["exponent", "mantissa"])
    ber: list[float] | None = None
    count: int = 1
    layers: list[int] | None = None
    steps: list[int] | None = None
    trials: int = 100
    max_new_tokens: int = 16
    seed: int = 0
    dtype: str = "float32"
    device: str = "cpu"
    chat_template: bool = True

    def __post_init__(self) -> None:
        self.prompts = [p if isinstance(p, dict) else {"prompt": str(p)} for p in self.prompts]
        for p in self.prompts:
            if "prompt" not in p:
                raise ValueError(f"prompt entry without 'prompt': {p}")
            ans = p.get("answer")
            if isinstance(ans, str):
                p["answer"] = [ans]
        if not self.prompts:
            raise ValueError("a campaign needs at least one prompt")
        for s in self.sites:
            if s not in SITES:
                raise ValueError(f"unknown fault site {s!r}; choose from {', '.join(SITES)}")
        if not self.sites:
            raise ValueError("a campaign needs at least one site")
        if (self.bits is None or not self.bits) == (self.ber is None or not self.ber):
            raise ValueError("give exactly one of bits or ber")
        if self.bits:
            self.bits = parse_bits(self.bits)
            mdt = getattr(torch, self.dtype)
            for s in self.sites:
                nb = torch.finfo(site_dtype(s, mdt)).bits
                for b in self.bits:
                    if isinstance(b, int) and not 0 <= b < nb:
                        raise ValueError(f"bit {b} out of range for {s} ({nb}-bit values)")
            self.ber = None
        else:
            self.ber = [float(x) for x in self.ber]
            self.bits = None
        if self.trials < 0 or self.max_new_tokens < 1 or self.count < 1:
            raise ValueError("trials >= 0, max_new_tokens >= 1 and count >= 1 required")

    def fault_dict(self) -> dict:
        """Everything that defines the trials and their results (not their number)."""
        d = asdict(self)
        d.pop("trials")
        return d

    def fingerprint(self) -> str:
        blob = json.dumps(self.fault_dict(), sort_keys=True, default=str).encode()
        return hashlib.blake2b(blob, digest_size=8).hexdigest()

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> CampaignConfig:
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        return cls(**known)

    def combos(self) -> list[tuple[str, str | int | float]]:
        """The strata trials cycle over: (site, bit selector or BER)."""
        sel = self.bits if self.bits is not None else self.ber
        return [(s, b) for s in self.sites for b in sel]


@dataclass(frozen=True)
class Trial:
    """One fault. ``step`` None = every step; ``bit`` None = BER mode."""

    index: int
    trial_id: str
    prompt_index: int
    site: str
    bit: int | None
    bit_class: str
    ber: float | None
    count: int
    layer: int
    module: str
    step: int | None
    seed: int

    def fault_spec(self) -> FaultSpec:
        return FaultSpec(site=self.site, bit=self.bit, count=self.count, ber=self.ber,
                         layers=[self.module], calls=None if self.step is None else [self.step],
                         seed=self.seed)


def trial_id(seed: int, index: int) -> str:
    """Deterministic id of trial ``index`` of a campaign with seed ``seed``."""
    return f"s{seed}-t{index:06d}"


def model_targets(model: torch.nn.Module) -> dict[int, dict]:
    """``{layer: {"attention": name | None, "linear": [names]}}`` of a protected model."""
    out: dict[int, dict] = {}
    for ctx in _state(model).contexts:
        d = out.setdefault(ctx.slot.layer, {"attention": None, "linear": []})
        if ctx.is_attention:
            d["attention"] = ctx.slot.name
        else:
            d["linear"].append(ctx.slot.name)
    return dict(sorted(out.items()))


def plan_trial(config: CampaignConfig, index: int, clean_lengths: Sequence[int],
               targets: dict[int, dict]) -> Trial:
    """Trial ``index`` of the campaign: a function of the seed, the index, the config, the clean
    generation lengths (to draw a step the generation reaches) and the model's module names."""
    combos = config.combos()
    site, sel = combos[index % len(combos)]
    rng = random.Random(derive_seed("ftt-campaign", config.seed, index))
    prompt_index = rng.randrange(len(config.prompts))
    attn = site.startswith("attn.")
    wanted = config.layers if config.layers is not None else [l for l in targets if l >= 0]
    layers = [l for l in wanted if l in targets
              and (targets[l]["attention"] if attn else targets[l]["linear"])]
    if not layers:
        raise ValueError(f"no module to hit at {site} in layers {wanted}")
    layer = layers[rng.randrange(len(layers))]
    if attn:
        module = targets[layer]["attention"]
    else:
        names = targets[layer]["linear"]
        module = names[rng.randrange(len(names))]
    n_calls = max(1, int(clean_lengths[prompt_index]))
    u = rng.random()
    if config.steps is None:
        step: int | None = min(int(u * n_calls), n_calls - 1)
    elif list(config.steps) == [-1]:
        step = None
    else:
        reach = [s for s in config.steps if s < n_calls] or list(config.steps)
        step = int(reach[min(int(u * len(reach)), len(reach) - 1)])
    mdt = getattr(torch, config.dtype)
    if config.bits is not None:
        if isinstance(sel, str):
            choices = bit_fields(site_dtype(site, mdt))[sel]
            bit: int | None = int(choices[rng.randrange(len(choices))])
        else:
            bit = int(sel)
        bclass = bit_class(bit, site_dtype(site, mdt))
        ber = None
    else:
        bit, ber = None, float(sel)
        bclass = f"ber={ber:g}"
    seed = derive_seed("ftt-fault", config.seed, index)
    return Trial(index=index, trial_id=trial_id(config.seed, index), prompt_index=prompt_index, site=site,
                 bit=bit, bit_class=bclass, ber=ber, count=config.count if bit is not None else 1,
                 layer=layer, module=module, step=step, seed=seed)


# --------------------------------------------------------------------------------------------
# Classification and scores
# --------------------------------------------------------------------------------------------


def classify(*, tokens: Sequence[int] | None, clean_tokens: Sequence[int], finite: bool = True,
             error: str | None = None, totals: dict[str, int] | None = None) -> str:
    """Outcome class of one arm of a trial.

    Args:
        tokens: generated token ids (None when the generation raised).
        clean_tokens: the clean run's token ids (same configuration, no faults).
        finite: every logit of the generation was finite.
        error: the exception text if the generation raised.
        totals: the protection's event totals ``{kind: count}`` (None/empty for an unprotected arm).

    Order: an exception or non-finite logits is ``crash``; an uncorrectable event is
    ``detected_uncorrectable`` (the protection raised its hand, whatever the output); otherwise
    a differing output is ``sdc`` (even when detections were "corrected": a miscorrection is
    silent); an identical output is ``detected_corrected`` if anything was detected, else ``masked``.
    """
    totals = totals or {}
    if error is not None or tokens is None or not finite:
        return "crash"
    if totals.get("uncorrectable", 0) > 0:
        return "detected_uncorrectable"
    if list(tokens) != list(clean_tokens):
        return "sdc"
    if totals.get("detected", 0) > 0:
        return "detected_corrected"
    return "masked"


def token_agreement(tokens: Sequence[int] | None, clean: Sequence[int]) -> float:
    """Fraction of positions (over the longer of the two) where the tokens agree with the clean ones."""
    if tokens is None:
        return 0.0
    n = max(len(tokens), len(clean))
    if n == 0:
        return 1.0
    return sum(1 for a, b in zip(tokens, clean, strict=False) if a == b) / n


def answer_correct(text: str | None, answers: Sequence[str] | None) -> bool | None:
    if not answers:
        return None
    if text is None:
        return False
    t = text.lower()
    return any(a.lower() in t for a in answers)


# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------


class ToyTokenizer:
    """Byte-level stand-in tokenizer for the random tiny models (ids 3..vocab-1, no chat template)."""

    chat_template = None
    pad_token_id = 0
    eos_token_id = None

    def __init__(self, vocab: int = 512) -> None:
        self.vocab = vocab

    def __call__(self, text: str, return_tensors: str = "pt") -> dict:
        ids = [3 + (b % (self.vocab - 3)) for b in text.encode()]
        return {"input_ids": torch.tensor([ids], dtype=torch.long)}

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return " ".join(str(int(i)) for i in ids)


def _tiny_model(name: str, dtype: torch.dtype, seed: int = 0):
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, Qwen2Config

    vocab = 512
    widen = True
    if name == "tiny-llama":
        cfg = LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                          bos_token_id=1, eos_token_id=None, pad_token_id=0)
    elif name == "tiny-gpt2":
        cfg = GPT2Config(vocab_size=vocab, n_positions=256, n_embd=128, n_layer=2, n_head=4,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=None,
                         pad_token_id=0)
    elif name == "qwen2-0.5b-config":  # Qwen2-0.5B's shapes (GQA 14:2, head dim 64); default init
        cfg = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                          num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
                          tie_word_embeddings=True, bos_token_id=1, eos_token_id=None, pad_token_id=0)
        vocab = cfg.vocab_size
        widen = False  # at hidden size 896 the default std 0.02 already gives peaked attention
    elif name == "gpt2-124m-config":  # GPT-2 small's shapes (12 layers, 12 heads, hidden 768); default init
        cfg = GPT2Config(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12, resid_pdrop=0.0,
                         embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=None, pad_token_id=0)
        vocab = cfg.vocab_size
        widen = False
    else:
        raise ValueError(f"unknown tiny model {name!r}; choose from {', '.join(TINY_MODELS)}")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="efta", dtype=dtype)
    with torch.no_grad():  # std 0.02 gives near-uniform attention in the tiny models; widen it there
        for pname, p in model.named_parameters():
            if widen and p.dim() == 2 and "embed" not in pname and "wte" not in pname:
                p.normal_(0.0, 0.08)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval(), ToyTokenizer(vocab)


def load_model(name: str, dtype: str = "float32", device: str = "cpu"):
    """``(model, tokenizer)`` with attention on EFTA: a tiny random model, the embedded SmolLM2,
    a local path, a ``.gguf`` file or a hub id."""
    tdt = getattr(torch, dtype)
    if name in TINY_MODELS:
        model, tok = _tiny_model(name, tdt)
        return model.to(device), tok
    from .embedded import load_causal_lm

    return load_causal_lm(name, dtype=tdt, attn_implementation="efta", device=device)


def encode_prompt(tok, prompt: str, chat_template: bool) -> torch.Tensor:
    if chat_template and getattr(tok, "chat_template", None):
        enc = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)
        return enc["input_ids"]
    return tok(prompt, return_tensors="pt")["input_ids"]


def source_hash() -> str:
    """Short hash of the library's Python sources (ft_transformers, its kernels and patches), so a
    record tells which code produced it even in an uncommitted tree."""
    import importlib.util

    h = hashlib.blake2b(digest_size=8)
    dirs = [Path(__file__).resolve().parent]
    for sub in ("ft_transformers.kernels", "ft_transformers.patches"):
        try:
            spec = importlib.util.find_spec(sub)
        except (ImportError, ValueError):
            spec = None
        if spec is not None and spec.submodule_search_locations:
            dirs += [Path(d) for d in spec.submodule_search_locations]
    for d in dirs:
        for f in sorted(d.rglob("*.py")):
            h.update(f.name.encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def versions() -> dict[str, str]:
    import transformers

    from . import __version__

    v = {"ft_transformers": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
         "python": platform.python_version()}
    v["source"] = source_hash()
    try:
        root = Path(__file__).resolve().parent.parent
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                             text=True, timeout=5)
        if out.returncode == 0:
            v["git"] = out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return v


# --------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------


class _Generator:
    """Greedy generation of a fixed model with the campaign's settings."""

    def __init__(self, model, tok, config: CampaignConfig) -> None:
        self.model = model
        self.tok = tok
        self.config = config
        pad = getattr(tok, "pad_token_id", None)
        if pad is None:
            pad = getattr(tok, "eos_token_id", None)
        self.pad = 0 if pad is None else pad
        self.inputs = [encode_prompt(tok, p["prompt"], config.chat_template).to(config.device)
                       for p in config.prompts]

    def generate(self, prompt_index: int) -> tuple[list[int], bool]:
        ids = self.inputs[prompt_index]
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids),
                                      max_new_tokens=self.config.max_new_tokens, do_sample=False,
                                      pad_token_id=self.pad, return_dict_in_generate=True, output_logits=True)
        tokens = out.sequences[0, ids.shape[1]:].tolist()
        finite = all(bool(torch.isfinite(lg).all()) for lg in out.logits)
        return tokens, finite

    def text(self, tokens: Sequence[int] | None) -> str | None:
        if tokens is None:
            return None
        return self.tok.decode(tokens, skip_special_tokens=True).strip()


def _event_rows(report: FTReport) -> list[list]:
    return [[e.step, e.layer, e.module, e.site, e.kind, e.count] for e in report.events]


def _totals(rows: Iterable[Sequence]) -> dict[str, int]:
    tot = dict.fromkeys(KINDS, 0)
    for r in rows:
        tot[r[4]] += int(r[5])
    return tot


def run_clean(gen: _Generator, prompt_index: int) -> dict:
    """The clean (fault-free) generations of one prompt, unprotected and protected."""
    rec: dict = {"type": "clean", "prompt_index": prompt_index, "prompt": gen.config.prompts[prompt_index]}
    for arm in ARMS:
        enable_fault_tolerance(gen.model, ARM_CONFIGS[arm])
        t0 = time.perf_counter()
        tokens, finite = gen.generate(prompt_index)
        rows = _event_rows(fault_report(gen.model))
        text = gen.text(tokens)
        rec[arm] = {"tokens": tokens, "text": text, "finite": finite, "events": rows, "totals": _totals(rows),
                    "answer_correct": answer_correct(text, gen.config.prompts[prompt_index].get("answer")),
                    "seconds": round(time.perf_counter() - t0, 3)}
    # False positives: every detection in the protected clean run.
    rec["false_positives"] = rec["protected"]["totals"]["detected"]
    rec["arms_agree"] = rec["unprotected"]["tokens"] == rec["protected"]["tokens"]
    return rec


def run_trial(gen: _Generator, trial: Trial, clean: dict, ver: dict | None = None) -> dict:
    """Run one trial in both arms and return its JSON record."""
    spec = trial.fault_spec()
    cfg = gen.config
    rec: dict = {"type": "trial", "trial_id": trial.trial_id, **asdict(trial), "model": cfg.model,
                 "dtype": cfg.dtype, "device": cfg.device, "max_new_tokens": cfg.max_new_tokens,
                 "campaign_seed": cfg.seed, "versions": ver or versions()}
    answers = cfg.prompts[trial.prompt_index].get("answer")
    for arm in ARMS:
        enable_fault_tolerance(gen.model, ARM_CONFIGS[arm])
        ref = clean[arm]["tokens"]
        tokens: list[int] | None = None
        finite, error = True, None
        t0 = time.perf_counter()
        with inject_faults(gen.model, spec) as log:
            try:
                tokens, finite = gen.generate(trial.prompt_index)
            except Exception as e:  # a crash is an outcome, not a campaign failure
                error = f"{type(e).__name__}: {e}"
        seconds = time.perf_counter() - t0
        try:
            rows = _event_rows(fault_report(gen.model))
        except Exception as e:  # pragma: no cover - the report itself failing is a crash too
            rows, error = [], error or f"report: {type(e).__name__}: {e}"
        flips = []
        for name, call, plan in log.records:
            sf = plan.sites.get(trial.site)
            if sf is None:
                continue
            flips.append({"module": name, "call": call, "shape": list(sf.shape),
                          "positions": None if sf.positions is None else sf.positions.tolist(),
                          "injected": int(sf.injected)})
        tot = _totals(rows)
        hit_step = (lambda s: True) if trial.step is None else (lambda s: s == trial.step)
        elsewhere = sum(int(r[5]) for r in rows
                        if r[4] == "detected" and not (r[2] == trial.module and hit_step(r[0])))
        text = gen.text(tokens)
        rec[arm] = {
            "class": classify(tokens=tokens, clean_tokens=ref, finite=finite, error=error, totals=tot),
            "tokens": tokens, "text": text, "finite": finite, "error": error,
            "injected": sum(f["injected"] for f in flips), "flips": flips,
            "exact_match": tokens is not None and list(tokens) == list(ref),
            "token_agreement": round(token_agreement(tokens, ref), 6),
            "answer_correct": answer_correct(text, answers),
            "events": rows, "totals": tot, "detected_elsewhere": elsewhere,
            "seconds": round(seconds, 3),
        }
    return rec


# --------------------------------------------------------------------------------------------
# The JSONL store
# --------------------------------------------------------------------------------------------


class CampaignStore:
    """Append-only JSONL file: a header line, ``clean`` lines, ``trial`` lines.

    `open` reads what is there, drops a partial last line (a campaign killed mid-write), checks
    that the file belongs to the same campaign (fingerprint) and keeps the records; `append`
    writes one line and fsyncs it, so a kill loses at most the trial in flight.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.header: dict | None = None
        self.clean: dict[int, dict] = {}
        self.trials: dict[str, dict] = {}
        self.dropped_bytes = 0

    def load(self) -> CampaignStore:
        if not self.path.exists():
            return self
        data = self.path.read_bytes()
        good_end = 0
        pos = 0
        records = []
        while pos < len(data):
            nl = data.find(b"\n", pos)
            if nl < 0:  # no newline: a partial last line
                break
            line = data[pos:nl]
            try:
                rec = json.loads(line) if line.strip() else None
            except json.JSONDecodeError:
                if data[nl + 1:].strip():
                    raise ValueError(f"{self.path}: corrupt line at byte {pos} (not the last one)") from None
                break
            if rec is not None:
                records.append(rec)
            pos = nl + 1
            good_end = pos
        self.dropped_bytes = len(data) - good_end
        if self.dropped_bytes:
            with open(self.path, "r+b") as f:
                f.truncate(good_end)
        for rec in records:
            kind = rec.get("type")
            if kind == "header":
                self.header = rec
            elif kind == "clean":
                self.clean[int(rec["prompt_index"])] = rec
            elif kind == "trial":
                self.trials.setdefault(rec["trial_id"], rec)
        return self

    def append(self, rec: dict) -> None:
        line = json.dumps(rec, separators=(",", ":")) + "\n"
        with open(self.path, "a") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        if rec["type"] == "header":
            self.header = rec
        elif rec["type"] == "clean":
            self.clean[int(rec["prompt_index"])] = rec
        elif rec["type"] == "trial":
            self.trials[rec["trial_id"]] = rec


def _same_outputs(a: dict, b: dict) -> bool:
    return all(a[arm]["tokens"] == b[arm]["tokens"] and a[arm]["totals"] == b[arm]["totals"] for arm in ARMS)


def run_campaign(config: CampaignConfig, path: str | os.PathLike, *, model=None, tokenizer=None,
                 progress: bool = True, on_trial: Callable[[dict], None] | None = None,
                 log: Callable[[str], None] | None = None) -> list[dict]:
    """Run (or resume) a campaign into the JSONL file ``path``; return every trial record, in order.

    Trials already in the file are skipped, a partial last line is dropped; the clean runs are
    recomputed and must reproduce the stored ones (same numerics), else ValueError.
    ``on_trial(record)`` is called after each trial is written (tests use it to simulate a kill).
    """
    say = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    store = CampaignStore(path).load()
    if store.dropped_bytes:
        say(f"campaign: dropped a partial last line ({store.dropped_bytes} bytes) of {path}")
    fp = config.fingerprint()
    if store.header is not None and store.header["fingerprint"] != fp:
        raise ValueError(f"{path} holds another campaign (fingerprint {store.header['fingerprint']}, "
                         f"this one {fp}); use another output file or `resume` it")
    ver = versions()
    if store.header is not None and store.header.get("versions", {}).get("source") != ver["source"]:
        say("campaign: warning: the library sources changed since this campaign started "
            f"(source hash {store.header.get('versions', {}).get('source')} -> {ver['source']}); "
            "every trial records the versions it ran with")
    if model is None:
        say(f"campaign: loading {config.model} ...")
        model, tokenizer = load_model(config.model, config.dtype, config.device)
    gen = _Generator(model, tokenizer, config)
    if store.header is None or store.header["config"].get("trials") != config.trials:
        store.append({"type": "header", "format": FORMAT_VERSION, "fingerprint": fp,
                      "config": config.to_dict(),
                      "versions": ver, "threads": torch.get_num_threads(), "started": time.time()})

    cleans: dict[int, dict] = {}
    for i in range(len(config.prompts)):
        rec = run_clean(gen, i)
        old = store.clean.get(i)
        if old is None:
            store.append(rec)
        elif not _same_outputs(old, rec):
            raise ValueError(f"clean run of prompt {i} does not reproduce the stored one "
                             "(different numerics: device, threads, library versions?); start a new file")
        cleans[i] = rec
        if rec["false_positives"] or not rec["arms_agree"]:
            say(f"campaign: prompt {i}: clean protected run had {rec['false_positives']} detection(s); "
                f"clean outputs {'agree' if rec['arms_agree'] else 'DIFFER'} across arms")
    lengths = [len(cleans[i]["unprotected"]["tokens"]) for i in range(len(config.prompts))]
    enable_fault_tolerance(model, ARM_CONFIGS["protected"])
    targets = model_targets(model)

    todo = [i for i in range(config.trials) if trial_id(config.seed, i) not in store.trials]
    done = config.trials - len(todo)
    if done:
        say(f"campaign: resuming, {done} of {config.trials} trials already in {path}")
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=config.trials, initial=done, unit="trial", desc="campaign", dynamic_ncols=True,
                   smoothing=0.1)
    sdc = {arm: sum(r[arm]["class"] == "sdc" for r in store.trials.values()) for arm in ARMS}
    try:
        for i in todo:
            trial = plan_trial(config, i, lengths, targets)
            rec = run_trial(gen, trial, cleans[trial.prompt_index], ver)
            store.append(rec)
            for arm in ARMS:
                sdc[arm] += rec[arm]["class"] == "sdc"
            if bar is not None:
                bar.update(1)
                bar.set_postfix_str(f"SDC off {sdc['unprotected']} / on {sdc['protected']}")
            if on_trial is not None:
                on_trial(rec)
    finally:
        if bar is not None:
            bar.close()
    return [store.trials[trial_id(config.seed, i)] for i in range(config.trials)]


def trial_from_record(rec: dict) -> Trial:
    """The `Trial` a stored record describes (``rec["fault_spec"]`` equivalent: ``.fault_spec()``)."""
    return Trial(**{k: rec[k] for k in Trial.__dataclass_fields__})


def _comparable(rec: dict) -> dict:
    out = {k: v for k, v in rec.items() if k not in ("seconds", "versions")}
    for arm in ARMS:
        if arm in out:
            out[arm] = {k: v for k, v in out[arm].items() if k != "seconds"}
    return out


def replay_trial(path: str | os.PathLike, tid: str, *, model=None, tokenizer=None) -> tuple[dict, dict]:
    """Re-run one stored trial from its campaign file; ``(stored, fresh)`` records (compare them
    without ``seconds`` / ``versions``: identical when the environment reproduces the numerics)."""
    header, _cleans, trials = load_campaign(path)
    if header is None:
        raise ValueError(f"{path} has no campaign header")
    stored = next((t for t in trials if t["trial_id"] == tid), None)
    if stored is None:
        raise ValueError(f"no trial {tid!r} in {path}")
    config = CampaignConfig.from_dict(header["config"])
    if model is None:
        model, tokenizer = load_model(config.model, config.dtype, config.device)
    gen = _Generator(model, tokenizer, config)
    clean = run_clean(gen, stored["prompt_index"])
    return stored, run_trial(gen, trial_from_record(stored), clean)


def load_campaign(path: str | os.PathLike) -> tuple[dict | None, list[dict], list[dict]]:
    """``(header, clean records, trial records)`` of a JSONL campaign file (read-only)."""
    path = Path(path)
    header, cleans, trials = None, {}, {}
    with open(path) as f:
        for line in f:
            if not line.endswith("\n"):
                break
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if rec.get("type") == "header":
                header = rec
            elif rec.get("type") == "clean":
                cleans[rec["prompt_index"]] = rec
            elif rec.get("type") == "trial":
                trials.setdefault(rec["trial_id"], rec)
    return header, [cleans[k] for k in sorted(cleans)], sorted(trials.values(), key=lambda r: r["index"])


# --------------------------------------------------------------------------------------------
# Summaries
# --------------------------------------------------------------------------------------------


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95 % Wilson score interval of a rate k/n."""
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (max(0.0, c - h), min(1.0, c + h))


def summarize(trials: Sequence[dict], by: Sequence[str] = ("site", "bit_class")) -> list[dict]:
    """Rows per group × protection arm: counts of each class, SDC rate (+ 95 % CI), scores."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for t in trials:
        groups[tuple(t[k] for k in by)].append(t)

    def order(key):
        out = []
        for k, v in zip(by, key, strict=True):
            if k == "site":
                out.append(SITES.index(v) if v in SITES else 99)
            elif k == "bit_class":
                out.append({"sign": 0, "exponent": 1, "mantissa": 2}.get(v, 3))
                out.append(str(v))
            else:
                out.append(-1 if v is None else v)
        return out

    rows = []
    for key in sorted(groups, key=order):
        ts = groups[key]
        for arm in ARMS:
            counts = dict.fromkeys(CLASSES, 0)
            for t in ts:
                counts[t[arm]["class"]] += 1
            n = len(ts)
            ans = [t[arm]["answer_correct"] for t in ts if t[arm].get("answer_correct") is not None]
            lo, hi = wilson(counts["sdc"], n)
            rows.append({**dict(zip(by, key, strict=True)), "arm": arm, "n": n, **counts,
                         "sdc_rate": counts["sdc"] / n if n else 0.0, "sdc_ci": (lo, hi),
                         "failure_rate": (counts["sdc"] + counts["crash"]) / n if n else 0.0,
                         "exact_match": sum(t[arm]["exact_match"] for t in ts) / n if n else 0.0,
                         "token_agreement": sum(t[arm]["token_agreement"] for t in ts) / n if n else 0.0,
                         "task_accuracy": (sum(ans) / len(ans)) if ans else None,
                         "injected": sum(t[arm]["injected"] for t in ts),
                         "detected_elsewhere": sum(t[arm].get("detected_elsewhere", 0) for t in ts)})
    return rows


def false_positives(cleans: Sequence[dict], trials: Sequence[dict] = ()) -> dict:
    """Detections in fault-free work: the clean protected runs, and (in trials) detections in
    modules or steps the fault did not hit."""
    calls = sum(len(c["protected"]["tokens"]) for c in cleans)
    return {"clean_runs": len(cleans), "clean_model_calls": calls,
            "clean_detections": sum(c["false_positives"] for c in cleans),
            "clean_outputs_agree": all(c["arms_agree"] for c in cleans),
            "trial_detections_elsewhere": sum(t["protected"].get("detected_elsewhere", 0) for t in trials)}


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def summary_markdown(trials: Sequence[dict], cleans: Sequence[dict] = (),
                     by: Sequence[str] = ("site", "bit_class")) -> str:
    """Markdown tables: outcome counts per group × protection, and the false-positive line."""
    rows = summarize(trials, by)
    head = [*by, "protection", "n", *(CLASS_LABELS[c] for c in CLASSES), "SDC rate [95 % CI]",
            "exact match", "token agr.", "task acc."]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lo, hi = r["sdc_ci"]
        acc = "–" if r["task_accuracy"] is None else _pct(r["task_accuracy"])
        lines.append("| " + " | ".join([
            *(str(r[k]) for k in by), "off" if r["arm"] == "unprotected" else "on", str(r["n"]),
            *(str(r[c]) for c in CLASSES), f"{_pct(r['sdc_rate'])} [{100 * lo:.1f}, {100 * hi:.1f}]",
            _pct(r["exact_match"]), _pct(r["token_agreement"]), acc]) + " |")
    out = "\n".join(lines)
    if cleans:
        fp = false_positives(cleans, trials)
        out += (f"\n\nFalse positives: {fp['clean_detections']} detection(s) in {fp['clean_runs']} clean "
                f"protected generation(s) ({fp['clean_model_calls']} model calls); "
                f"{fp['trial_detections_elsewhere']} detection(s) in protected trials outside the "
                f"faulted module/step. Clean outputs identical with protection off and on: "
                f"{'yes' if fp['clean_outputs_agree'] else 'NO'}.")
        acc = [c["unprotected"].get("answer_correct") for c in cleans]
        acc = [a for a in acc if a is not None]
        if acc:
            out += f" Clean task accuracy (answer in the output): {sum(acc)}/{len(acc)}."
    return out


def per_bit_markdown(trials: Sequence[dict]) -> str:
    """Compact table, one row per site × bit: outcome counts with protection off and on."""
    bit_trials = [t for t in trials if t.get("bit") is not None]
    rows = summarize(bit_trials, ("site", "bit"))
    classes = {(t["site"], t["bit"]): t["bit_class"] for t in bit_trials}
    by: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for r in rows:
        by[(r["site"], r["bit"])][r["arm"]] = r
    head = ["site", "bit", "class", "n", "off: SDC", "off: crash", "on: SDC", "on: crash", "on: uncorr.",
            "on: det.&corr.", "on: masked"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (site, bit), arms in by.items():
        off, on = arms["unprotected"], arms["protected"]
        cls = classes[(site, bit)]
        lines.append("| " + " | ".join(str(x) for x in (
            site, bit, cls, off["n"], off["sdc"], off["crash"], on["sdc"], on["crash"],
            on["detected_uncorrectable"], on["detected_corrected"], on["masked"])) + " |")
    return "\n".join(lines)


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_sdc_per_bit(trials: Sequence[dict], path: str | os.PathLike, title: str | None = None) -> None:
    """Bar chart per site: SDC rate per flipped bit, protection off vs on.

    Solid bars are SDC, hatched bars stacked on them crash / non-finite (the other silent-ish
    failure); the x labels carry the number of trials per bit (95 % CIs are in the tables).
    """
    plt = _plt()
    bit_trials = [t for t in trials if t.get("bit") is not None]
    sites = [s for s in SITES if any(t["site"] == s for t in bit_trials)]
    if not sites:
        raise ValueError("no bit-mode trials to plot")
    fig, axes = plt.subplots(len(sites), 1, figsize=(11, 2.7 * len(sites)), squeeze=False)
    for ax, site in zip(axes[:, 0], sites, strict=True):
        ts = [t for t in bit_trials if t["site"] == site]
        bits = sorted({t["bit"] for t in ts})
        x = list(range(len(bits)))
        ns = [sum(t["bit"] == b for t in ts) for b in bits]
        for j, (arm, color) in enumerate((("unprotected", "tab:red"), ("protected", "tab:blue"))):
            sdc, crash = [], []
            for b, n in zip(bits, ns, strict=True):
                tb = [t for t in ts if t["bit"] == b]
                sdc.append(sum(t[arm]["class"] == "sdc" for t in tb) / n)
                crash.append(sum(t[arm]["class"] == "crash" for t in tb) / n)
            xs = [xi + (j - 0.5) * 0.4 for xi in x]
            onoff = "off" if arm == "unprotected" else "on"
            ax.bar(xs, sdc, width=0.4, color=color, alpha=0.85, label=f"SDC, protection {onoff}")
            if any(crash):
                ax.bar(xs, crash, width=0.4, bottom=sdc, color="white", edgecolor=color, hatch="////",
                       label=f"crash / non-finite, protection {onoff}")
        ax.set_xticks(x, [f"{b}\nn={n}" for b, n in zip(bits, ns, strict=True)], fontsize=7)
        ax.set_xlim(-0.7, len(bits) - 0.3)
        ax.set_ylim(0, 1.05)
        ax.set_ylabel("rate")
        ax.set_title(site, fontsize=10, loc="left")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    axes[-1, 0].set_xlabel("flipped bit (0 = mantissa LSB; fp32: 23-30 exponent, 31 sign)")
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


_CLASS_COLORS = {"masked": "#9e9e9e", "sdc": "#d62728", "detected_corrected": "#2ca02c",
                 "detected_uncorrectable": "#ff7f0e", "crash": "#6a3d9a"}


def plot_outcomes(trials: Sequence[dict], path: str | os.PathLike, by: Sequence[str] = ("site", "bit_class"),
                  title: str | None = None) -> None:
    """Stacked bars: outcome shares per group, protection off and on side by side."""
    plt = _plt()
    rows = summarize(trials, by)
    labels = []
    fig, ax = plt.subplots(figsize=(max(7, 0.55 * len(rows) + 3.5), 4.2))
    bottoms = [0.0] * len(rows)
    for c in CLASSES:
        vals = [r[c] / r["n"] if r["n"] else 0 for r in rows]
        ax.bar(range(len(rows)), vals, bottom=bottoms, color=_CLASS_COLORS[c], label=CLASS_LABELS[c],
               width=0.8)
        bottoms = [b + v for b, v in zip(bottoms, vals, strict=True)]
    for r in rows:
        labels.append("\n".join(str(r[k]) for k in by) + f"\n{'off' if r['arm'] == 'unprotected' else 'on'}")
    ax.set_xticks(range(len(rows)), labels, fontsize=6.5)
    ax.set_ylabel("share of trials")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------------------
# Per-layer events during generation
# --------------------------------------------------------------------------------------------


def trial_report(trial: dict, arm: str = "protected") -> FTReport:
    """The library's `FTReport` rebuilt from a stored trial (``.by_step()``, ``.to_json()``, ...)."""
    events = [FaultEvent(*r) for r in trial[arm]["events"]]
    steps = len(trial[arm]["tokens"] or []) if trial[arm].get("tokens") is not None else 0
    return FTReport(events, None, steps=steps)


def events_by_step_layer(trials: Sequence[dict],
                         arm: str = "protected") -> dict[tuple[int, int], dict[str, int]]:
    """``{(step, layer): {kind: count}}`` summed over the given trials (one trial: that trial)."""
    acc: dict[tuple[int, int], dict[str, int]] = defaultdict(lambda: dict.fromkeys(KINDS, 0))
    for t in trials:
        for step, layer, _module, _site, kind, count in t[arm]["events"]:
            acc[(int(step), int(layer))][kind] += int(count)
    return dict(sorted(acc.items()))


def write_events(grouped: dict[tuple[int, int], dict[str, int]], json_path: str | os.PathLike | None = None,
                 csv_path: str | os.PathLike | None = None, meta: dict | None = None) -> None:
    """Export `events_by_step_layer` as JSON (``{"meta", "totals", "rows"}``) and/or CSV."""
    rows = [{"step": s, "layer": l, **counts} for (s, l), counts in grouped.items()]
    if json_path is not None:
        tot = dict.fromkeys(KINDS, 0)
        for r in rows:
            for k in KINDS:
                tot[k] += r[k]
        Path(json_path).write_text(json.dumps({"meta": meta or {}, "totals": tot, "rows": rows}, indent=1))
    if csv_path is not None:
        with open(csv_path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["step", "layer", *KINDS])
            for r in rows:
                w.writerow([r["step"], r["layer"], *(r[k] for k in KINDS)])


def plot_events(grouped: dict[tuple[int, int], dict[str, int]], path: str | os.PathLike,
                kinds: Sequence[str] = ("detected", "corrected", "recomputed"), n_layers: int | None = None,
                n_steps: int | None = None, title: str | None = None) -> None:
    """Heatmaps of event counts over generation steps (x) × layers (y), one panel per kind.
    Layer -1 (modules outside the blocks, e.g. lm_head) is drawn as the top row."""
    import numpy as np

    plt = _plt()
    steps = [s for s, _ in grouped] or [0]
    layers = [l for _, l in grouped] or [0]
    ns = max(n_steps or 0, max(steps) + 1)
    lo = min(-1, min(layers))
    nl = max(n_layers or 0, max(layers) + 1)
    fig, axes = plt.subplots(1, len(kinds), figsize=(4.2 * len(kinds), 0.16 * (nl - lo) + 2.0), squeeze=False)
    for ax, kind in zip(axes[0], kinds, strict=True):
        grid = np.zeros((nl - lo, ns))
        for (s, l), c in grouped.items():
            grid[l - lo, s] += c[kind]
        masked = np.ma.masked_equal(grid, 0)
        im = ax.imshow(masked, aspect="auto", origin="lower", cmap="viridis", interpolation="nearest",
                       extent=(-0.5, ns - 0.5, lo - 0.5, nl - 0.5), vmin=0, vmax=max(1.0, float(grid.max())))
        ax.set_facecolor("#f4f4f4")
        ax.set_xlabel("generation step (0 = prefill)")
        ax.set_ylabel("layer (-1 = outside the blocks)")
        ax.set_title(f"{kind}: {int(grid.sum())}", fontsize=10)
        fig.colorbar(im, ax=ax, fraction=0.046, pad=0.02)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------------------
# Reports and CLI
# --------------------------------------------------------------------------------------------


def write_report(path: str | os.PathLike, out_dir: str | os.PathLike, prefix: str = "campaign",
                 trial: str | None = None, img_dir: str | os.PathLike | None = None) -> dict[str, Path]:
    """Summary (markdown + JSON), per-bit table, plots and per-step × layer events of a campaign file.

    Tables and event exports go to ``out_dir``, PNGs to ``img_dir`` (default ``out_dir``); with
    ``trial`` the events (JSON, CSV, heatmap) are those of that trial only.
    """
    header, cleans, trials = load_campaign(path)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    img = Path(img_dir) if img_dir is not None else out
    img.mkdir(parents=True, exist_ok=True)
    files: dict[str, Path] = {}
    if not trials:
        raise ValueError(f"{path} holds no trials yet")
    cfg = (header or {}).get("config", {})
    md = [f"# Campaign {prefix}", "",
          f"model `{cfg.get('model')}`, {len(trials)} trials, seed {cfg.get('seed')}, "
          f"max_new_tokens {cfg.get('max_new_tokens')}, sites {', '.join(cfg.get('sites', []))}", "",
          "## Per site × bit class", "", summary_markdown(trials, cleans, ("site", "bit_class")), ""]
    if any(t.get("bit") is not None for t in trials):
        md += ["## Per site × bit", "", per_bit_markdown(trials), ""]
    files["summary_md"] = out / f"{prefix}_summary.md"
    files["summary_md"].write_text("\n".join(md))
    files["summary_json"] = out / f"{prefix}_summary.json"
    files["summary_json"].write_text(json.dumps({
        "header": header, "by_site_bit_class": summarize(trials, ("site", "bit_class")),
        "by_site_bit": summarize([t for t in trials if t.get("bit") is not None], ("site", "bit")),
        "false_positives": false_positives(cleans, trials)}, indent=1))
    if any(t.get("bit") is not None for t in trials):
        files["sdc_per_bit"] = img / f"{prefix}_sdc_per_bit.png"
        plot_sdc_per_bit(trials, files["sdc_per_bit"],
                         title=f"SDC rate per flipped bit ({len(trials)} trials)")
    files["outcomes"] = img / f"{prefix}_outcomes.png"
    plot_outcomes(trials, files["outcomes"], title="outcome of each trial, protection off / on")
    sel = trials if trial is None else [t for t in trials if t["trial_id"] == trial]
    if not sel:
        raise ValueError(f"no trial {trial!r} in {path}")
    grouped = events_by_step_layer(sel)
    tag = "events" if trial is None else f"events_{trial}"
    files["events_json"] = out / f"{prefix}_{tag}.json"
    files["events_csv"] = out / f"{prefix}_{tag}.csv"
    write_events(grouped, files["events_json"], files["events_csv"],
                 meta={"campaign": str(path), "trials": len(sel), "arm": "protected", "trial": trial})
    n_layers = 1 + max((t["layer"] for t in trials), default=0)
    files["events_png"] = img / f"{prefix}_{tag}.png"
    plot_events(grouped, files["events_png"], n_layers=n_layers, n_steps=cfg.get("max_new_tokens"),
                title=("protected-arm events over steps × layers, "
                       + (f"trial {trial}" if trial else f"all {len(sel)} trials")))
    return files


def _add_campaign_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2",
                   help="'smollm2' (embedded, offline), 'tiny-llama' / 'tiny-gpt2' (random, no download), "
                        "a local path, a .gguf file or a hub id")
    p.add_argument("--prompts", nargs="+", default=None,
                   help="prompts (default: six short factual questions)")
    p.add_argument("--prompts-file", default=None,
                   help="one prompt per line, or JSONL with {'prompt': ..., 'answer': [...]} per line")
    p.add_argument("--no-chat-template", action="store_true", help="feed prompts raw (no chat template)")
    p.add_argument("--sites", nargs="+", default=["attn.scores", "linear.output"], choices=SITES)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--bits", nargs="+", default=None,
                   help="bit selectors: sign | exponent | mantissa (a bit drawn per trial), ints, ranges a-b "
                        "(default: exponent mantissa)")
    g.add_argument("--ber", nargs="+", type=float, default=None, help="bit error rates instead of --bits")
    p.add_argument("--count", type=int, default=1, help="flips per targeted call (bit mode)")
    p.add_argument("--layers", nargs="+", type=int, default=None,
                   help="blocks to draw from (default all; -1 = lm_head etc. for linear.output)")
    p.add_argument("--steps", nargs="+", type=int, default=None,
                   help="generation steps to draw from (0 = prefill; default: any step the clean run "
                        "reaches; -1 = hit every step)")
    p.add_argument("--trials", type=int, default=100)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")


def _prompts_from(args) -> list[dict] | None:
    if args.prompts_file:
        out = []
        for line in Path(args.prompts_file).read_text().splitlines():
            if not line.strip():
                continue
            if line.lstrip().startswith("{"):
                out.append(json.loads(line))
            else:
                out.append({"prompt": line.strip()})
        return out
    if args.prompts:
        return [{"prompt": p} for p in args.prompts]
    return None


def _common_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: on a loaded machine one thread is much faster)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--report-dir", default=None, help="also write the report (tables, plots, events) here")
    p.add_argument("--prefix", default=None, help="file name prefix of the report (default: the JSONL stem)")


def _sigterm_to_interrupt(signum, frame):  # pragma: no cover - signal path
    raise KeyboardInterrupt


def _run_and_report(config: CampaignConfig, args) -> int:
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, args.threads))
    try:
        old_handler = signal.signal(signal.SIGTERM, _sigterm_to_interrupt)
    except ValueError:  # pragma: no cover - not in the main thread
        old_handler = None
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    t0 = time.perf_counter()
    try:
        records = run_campaign(config, args.out, progress=not args.no_progress)
    except KeyboardInterrupt:
        print(f"\ninterrupted; every finished trial is in {args.out}. Re-run the same command (or "
              f"`ftt-campaign resume {args.out}`) to continue.", file=sys.stderr)
        return 130
    finally:
        torch.set_num_threads(threads)
        hf_logging.set_verbosity(verbosity)
        if old_handler is not None:
            signal.signal(signal.SIGTERM, old_handler)
    print(f"campaign: {len(records)} trials in {args.out} ({time.perf_counter() - t0:.0f} s this run)",
          file=sys.stderr)
    _, cleans, trials = load_campaign(args.out)
    print(summary_markdown(trials, cleans))
    if args.report_dir:
        files = write_report(args.out, args.report_dir, args.prefix or Path(args.out).stem)
        for k, v in files.items():
            print(f"  {k}: {v}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``ftt-campaign run|resume|report``."""
    p = argparse.ArgumentParser(
        prog="ftt-campaign", description="Fault-injection campaigns for ft_transformers: N trials with "
        "protection off and on, classified, stored in JSONL (resumable).")
    sub = p.add_subparsers(dest="cmd", required=True)
    pr = sub.add_parser("run", help="run (or resume) a campaign into a JSONL file")
    _add_campaign_args(pr)
    pr.add_argument("--out", required=True, help="JSONL results file (appended; resumed if it exists)")
    _common_run_args(pr)
    pz = sub.add_parser("resume", help="resume (or extend with --trials) the campaign stored in a JSONL file")
    pz.add_argument("out", help="JSONL results file")
    pz.add_argument("--trials", type=int, default=None, help="new total number of trials")
    _common_run_args(pz)
    pp = sub.add_parser("report", help="tables, plots and per-step × layer events of a campaign file")
    pp.add_argument("file", help="JSONL results file")
    pp.add_argument("--out-dir", required=True, help="tables (markdown, JSON) and events (JSON, CSV)")
    pp.add_argument("--img-dir", default=None, help="plots (PNG; default: --out-dir)")
    pp.add_argument("--prefix", default=None)
    pp.add_argument("--trial", default=None, help="events of this trial id only (default: all trials)")
    pq = sub.add_parser("replay", help="re-run one stored trial and check that it reproduces")
    pq.add_argument("file", help="JSONL results file")
    pq.add_argument("trial", help="trial id, e.g. s0-t000042")
    pq.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)

    if args.cmd == "replay":
        torch.set_num_threads(max(1, args.threads))
        stored, fresh = replay_trial(args.file, args.trial)
        same = _comparable(stored) == _comparable(fresh)
        for arm in ARMS:
            print(f"{arm:>11}: stored {stored[arm]['class']:<22} replayed {fresh[arm]['class']:<22} "
                  f"text {fresh[arm]['text']!r}")
        print("reproduced exactly" if same else "DIFFERS from the stored record")
        return 0 if same else 1
    if args.cmd == "report":
        files = write_report(args.file, args.out_dir, args.prefix or Path(args.file).stem, trial=args.trial,
                             img_dir=args.img_dir)
        _, cleans, trials = load_campaign(args.file)
        print(summary_markdown(trials, cleans))
        for k, v in files.items():
            print(f"  {k}: {v}", file=sys.stderr)
        return 0
    if args.cmd == "resume":
        store = CampaignStore(args.out).load()
        if store.header is None:
            p.error(f"{args.out} has no campaign header")
        cfg = dict(store.header["config"])
        if args.trials is not None:
            cfg["trials"] = args.trials
        return _run_and_report(CampaignConfig.from_dict(cfg), args)
    prompts = _prompts_from(args)
    if prompts is None:  # the reference answers mean nothing to a random tiny model
        prompts = [dict(x) if args.model not in TINY_MODELS else {"prompt": x["prompt"]}
                   for x in DEFAULT_PROMPTS]
    config = CampaignConfig(
        model=args.model, prompts=prompts,
        sites=args.sites, bits=None if args.ber else (args.bits or ["exponent", "mantissa"]), ber=args.ber,
        count=args.count, layers=args.layers, steps=args.steps, trials=args.trials,
        max_new_tokens=args.max_new_tokens, seed=args.seed, dtype=args.dtype, device=args.device,
        chat_template=not args.no_chat_template)
    return _run_and_report(config, args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
