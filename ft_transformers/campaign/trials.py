"""Drawing and running trials: the plan of trial *i* (a function of the campaign seed and *i*), one
trial run with protection off and on, its classification, and the resumable campaign loop.
"""

from __future__ import annotations

import logging
import os
import random
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..events import FTReport
from ..injection import FaultSpec, derive_seed
from ..kernels.contract import KINDS
from ..protect import _state, enable_fault_tolerance, fault_report, inject_faults
from .config import ARM_CONFIGS, ARMS, CampaignConfig, bit_class, bit_fields, site_dtype
from .models import encode_prompt, load_model
from .store import FORMAT_VERSION, CampaignStore, load_campaign, versions

_LOG = logging.getLogger("ft_transformers")

# --------------------------------------------------------------------------------------------
# Planning
# --------------------------------------------------------------------------------------------


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
# Running one trial
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
# The campaign loop
# --------------------------------------------------------------------------------------------


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
    say = log or _LOG.info
    warn = log or _LOG.warning
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    store = CampaignStore(path).load()
    if store.dropped_bytes:
        warn(f"campaign: dropped a partial last line ({store.dropped_bytes} bytes) of {path}")
    fp = config.fingerprint()
    if store.header is not None and store.header["fingerprint"] != fp:
        raise ValueError(f"{path} holds another campaign (fingerprint {store.header['fingerprint']}, "
                         f"this one {fp}); use another output file or `resume` it")
    ver = versions()
    if store.header is not None and store.header.get("versions", {}).get("source") != ver["source"]:
        warn("campaign: warning: the library sources changed since this campaign started "
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
            warn(f"campaign: prompt {i}: clean protected run had {rec['false_positives']} detection(s); "
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

