"""Trials: the plan of trial *i* (a function of the campaign seed and *i*), and how one arm of a trial
is classified.

Outcomes of one arm of a trial (besides its `classify` class):

- ``token_change``: the generated tokens differ from the clean run's (same prompt, same arm).
- ``silent``: a *silent token change*: a token change while no event at all (detected, corrected,
  recomputed, uncorrectable, non-finite input, at any site and step) was recorded. A generation that
  raised is not silent. With protection off no events exist, so every token change is silent there.
- ``near_tie``: for a token change, whether the clean run's top-1 / top-2 logit margin at the first
  differing step is within that step's numerical noise (the largest logit difference between the clean
  run and a float32 eager reference on the same tokens); such changes are reported in their own column.

Each trial also records where its flips landed (`flip_landings`, `positions`): ``masked_position`` is
True when every flip hit a value the generation never reads, None when that cannot be decided.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from ..injection import FaultSpec, derive_seed
from ..protect import _state
from .config import CampaignConfig, bit_choices, bit_class, site_dtype
from .positions import landing

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


def uniform_targets(config: CampaignConfig, targets: dict[int, dict],
                    sites: Sequence[str] | None = None) -> list[tuple[str, int, str]]:
    """Every ``(site, layer, module)`` a uniform campaign draws from: each site of ``sites`` (default
    ``config.sites``) at every attention module (attention sites) or every protected Linear
    (``linear.output``, ``lm_head`` included), in ``config.layers`` (None = all, layer −1 included)."""
    out = []
    for site in config.sites if sites is None else sites:
        attn = site.startswith("attn.")  # the convention `FaultSpec.is_attention` follows
        for layer, d in targets.items():
            if config.layers is not None and layer not in config.layers:
                continue
            if attn:
                if d["attention"]:
                    out.append((site, layer, d["attention"]))
            else:
                out.extend((site, layer, name) for name in d["linear"])
    return out


def plan_trial(config: CampaignConfig, index: int, clean_lengths: Sequence[int],
               targets: dict[int, dict], sites: Sequence[str] | None = None) -> Trial:
    """Trial ``index`` of the campaign: a function of the seed, the index, the config, the clean
    generation lengths (to draw a step the generation reaches), the model's module names and, for a
    uniform campaign, the sites the model's computation reaches (``sites``, default ``config.sites``)."""
    rng = random.Random(derive_seed("ftt-campaign", config.seed, index))
    prompt_index = rng.randrange(len(config.prompts))
    mdt = getattr(torch, config.dtype)
    if config.sampling == "uniform":
        pool = uniform_targets(config, targets, sites)
        if not pool:
            raise ValueError(f"no module to hit at sites {list(config.sites if sites is None else sites)} "
                             f"in layers {config.layers}")
        site, layer, module = pool[rng.randrange(len(pool))]
        if config.bits is not None:
            bits = sorted({b for sel in config.bits for b in bit_choices(sel, site_dtype(site, mdt))})
            sel: str | int | float = bits[rng.randrange(len(bits))]
        else:
            sel = config.ber[rng.randrange(len(config.ber))]
    else:
        combos = config.combos()
        site, sel = combos[index % len(combos)]
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
    if config.bits is not None:
        choices = bit_choices(sel, site_dtype(site, mdt))
        bit: int | None = int(sel) if isinstance(sel, int) else int(choices[rng.randrange(len(choices))])
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


def silent_token_change(tokens: Sequence[int] | None, clean_tokens: Sequence[int],
                        totals: dict[str, int] | None) -> bool:
    """Whether one arm of a trial is a silent token change: its tokens differ from the clean run's and
    no event of any kind was recorded (``totals``: ``{kind: count}``, None/empty = none). A generation
    that raised (``tokens`` None) is loud, not silent."""
    if tokens is None or list(tokens) == list(clean_tokens):
        return False
    return sum(int(v) for v in (totals or {}).values()) == 0


def token_outcome(tokens: Sequence[int] | None, clean_tokens: Sequence[int], totals: dict[str, int] | None, *,
                  first_diff: int | None, margins: Sequence[float], noise: Sequence[float]) -> dict:
    """The token-level outcome of one arm: ``token_change``, ``silent`` (`silent_token_change`),
    ``near_tie`` (the clean top-1 / top-2 margin at the first differing step is ≤ that step's noise;
    None without a token change), and that step with its ``margin`` and ``noise``."""
    changed = tokens is not None and list(tokens) != list(clean_tokens)
    out = {"token_change": changed, "silent": silent_token_change(tokens, clean_tokens, totals),
           "first_diff": None, "near_tie": None, "margin": None, "noise": None}
    if changed and first_diff is not None and first_diff < min(len(margins), len(noise)):
        out.update(first_diff=int(first_diff), margin=float(margins[first_diff]), noise=float(noise[first_diff]),
                   near_tie=bool(margins[first_diff] <= noise[first_diff]))
    return out


def flip_landings(trial: Trial, records: Iterable, *, unused_rows: Iterable[str], mask_form: str,
                  window: int | None) -> tuple[list[dict], list[str]]:
    """The flips of a trial's run (``(module, call, FaultPlan)`` records of `inject_faults`) as JSON, and
    the landing of each flipped position (`positions.landing`; ``undecided`` in BER mode)."""
    unused = set(unused_rows)
    flips, lands = [], []
    for name, call, plan in records:
        sf = plan.sites.get(trial.site)
        if sf is None:
            continue
        pos = None if sf.positions is None else sf.positions.tolist()
        flips.append({"module": name, "call": call, "shape": list(sf.shape), "positions": pos,
                      "injected": int(sf.injected)})
        if pos is None:
            lands.append("undecided")
        elif int(sf.injected) == 0:
            lands.extend(["not_injected"] * len(pos))
        else:
            lands.extend(landing(trial.site, p, sf.shape, module=name, unused_rows=unused, mask_form=mask_form,
                                 window=window, exponent_bit=trial.bit_class == "exponent") for p in pos)
    return flips, lands


def trial_from_record(rec: dict) -> Trial:
    """The `Trial` a stored record describes (``rec["fault_spec"]`` equivalent: ``.fault_spec()``)."""
    return Trial(**{k: rec[k] for k in Trial.__dataclass_fields__})
